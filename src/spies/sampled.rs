//! The live sampled blocks of `spy=ticks`, and the bitmap of their addresses that every free
//! reads ([`crate::gate`]).
//!
//! A sample and its free each touch one line of this set: its [`Bucket`], which holds the lock,
//! the first blocks whose addresses fall on it and the count of those that did not fit. The
//! bucket of an address is a function of its bitmap bit, so whether a bit may be cleared
//! (no other live sample shares it) is read from the same line, without counts of their own:
//! on churn, the shard lock, the table line, the bit's count and its lock were four lines, of
//! which three missed the cache at the sample and again at the free.
//!
//! Blocks beyond a bucket's slots go to an overflow table. While a bucket has blocks there,
//! its bits are left set when one of its blocks goes (a spare bit sends a free to the slow
//! path, which finds nothing); they are made exact again once its overflow has emptied.

use core::cell::UnsafeCell;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::gate;
use crate::live_table::LiveTable;
use crate::sync::SpinLock;
use crate::{pool, prefetch};

/// Bitmap bits per bucket: the bucket of an address is its bit divided by this.
const BITS_PER_BUCKET: usize = 16;
const BUCKETS: usize = gate::BITS / BITS_PER_BUCKET;
/// Blocks a bucket holds in its own line.
const SLOTS: usize = 2;

/// An empty slot's key (no block lives at address 0).
const EMPTY: usize = 0;

#[repr(C)]
#[derive(Clone, Copy)]
struct Slot<V> {
    key: usize,
    value: V,
}

#[repr(C, align(64))]
struct Bucket<V> {
    lock: SpinLock,
    /// Under `lock`.
    slots: UnsafeCell<[Slot<V>; SLOTS]>,
    /// This bucket's blocks in the overflow table, under `lock`.
    overflowed: UnsafeCell<usize>,
}

/// The set of live sampled blocks, each with its `V`, and their bitmap.
pub(crate) struct SampledBlocks<V: Copy + 'static> {
    /// `[AtomicU64; gate::BITS / 64]`: bit [`gate::bit_of`] of every live block is set. A
    /// bucket's bits change only under its lock (other buckets share the word, hence the
    /// atomic read-modify-writes).
    bitmap: NonNull<AtomicU64>,
    /// `[Bucket<V>; BUCKETS]`, zeroed: free locks, empty slots, nothing overflowed.
    buckets: NonNull<Bucket<V>>,
    overflow: &'static LiveTable<V>,
}

// SAFETY: a bucket's slots and count are accessed only under its lock; the bitmap is atomic;
// the overflow table is Sync.
unsafe impl<V: Copy + Send + 'static> Sync for SampledBlocks<V> {}
// SAFETY: the set owns its leased memory; moving it moves plain pointers.
unsafe impl<V: Copy + Send + 'static> Send for SampledBlocks<V> {}

/// The bitmap bits of `bucket`, as a mask of its word.
fn bucket_mask(bucket: usize) -> u64 {
    const { assert!(BITS_PER_BUCKET < 64 && 64 % BITS_PER_BUCKET == 0) };
    ((1u64 << BITS_PER_BUCKET) - 1) << (bucket * BITS_PER_BUCKET % 64)
}

impl<V: Copy + 'static> SampledBlocks<V> {
    /// An empty set; `None` if its memory cannot be mapped.
    pub(crate) fn new() -> Option<Self> {
        const { assert!(core::mem::size_of::<Bucket<V>>() == 64, "a bucket is one cache line") };
        Some(Self {
            bitmap: pool::lease(gate::BITS / 8)?.cast(),
            buckets: pool::lease(BUCKETS * core::mem::size_of::<Bucket<V>>())?.cast(),
            overflow: LiveTable::leased()?,
        })
    }

    /// The bitmap, for the gate's fast path (`gate::BITS` bits, never freed).
    pub(crate) fn bitmap(&self) -> *mut AtomicU64 {
        self.bitmap.as_ptr()
    }

    fn word(&self, bit: usize) -> &AtomicU64 {
        // SAFETY: bit < gate::BITS; the leased array has gate::BITS / 64 words (zeroed: valid).
        unsafe { &*self.bitmap.as_ptr().add(bit / 64) }
    }

    /// Whether a block of the set may live at `ptr` (no false negatives).
    #[inline(always)]
    pub(crate) fn may_hold(&self, ptr: usize) -> bool {
        let bit = gate::bit_of(ptr);
        self.word(bit).load(Ordering::Relaxed) & (1 << (bit % 64)) != 0
    }

    fn bucket(&self, ptr: usize) -> &Bucket<V> {
        self.bucket_at(gate::bit_of(ptr) / BITS_PER_BUCKET)
    }

    fn bucket_at(&self, index: usize) -> &Bucket<V> {
        debug_assert!(index < BUCKETS);
        // SAFETY: every caller's index is below BUCKETS (from a bit below gate::BITS), within
        // the lease (zeroed: a valid bucket).
        unsafe { &*self.buckets.as_ptr().add(index) }
    }

    /// Starts loading the line of `ptr`'s bucket, for an insert or remove to come.
    #[inline(always)]
    pub(crate) fn prefetch(&self, ptr: usize) {
        prefetch::write((self.bucket(ptr) as *const Bucket<V>).cast());
    }

    /// Adds the block at `ptr` (not 0) with `value`; returns the value it replaces if the
    /// block was already there. A block that fits neither its bucket nor a newly mapped
    /// overflow array is not added.
    pub(crate) fn insert(&self, ptr: usize, value: V) -> Option<V> {
        debug_assert!(ptr != EMPTY);
        let bucket = self.bucket(ptr);
        let _guard = bucket.lock.lock();
        // SAFETY: the bucket's lock is held.
        let (slots, overflowed) = unsafe { (&mut *bucket.slots.get(), &mut *bucket.overflowed.get()) };
        if let Some(slot) = slots.iter_mut().find(|s| s.key == ptr) {
            return Some(core::mem::replace(&mut slot.value, value));
        }
        if *overflowed > 0 && self.overflow.get(ptr).is_some() {
            let mut old = None;
            self.overflow.insert_with(ptr, value, |v| old = Some(v));
            return old;
        }
        if let Some(slot) = slots.iter_mut().find(|s| s.key == EMPTY) {
            *slot = Slot { key: ptr, value };
        } else if self.overflow.insert(ptr, value) {
            *overflowed += 1;
        } else {
            return None;
        }
        let bit = gate::bit_of(ptr);
        let (word, mask) = (self.word(bit), 1u64 << (bit % 64));
        if word.load(Ordering::Relaxed) & mask == 0 {
            word.fetch_or(mask, Ordering::Release);
        }
        None
    }

    /// Whether the block at `ptr` is in the set.
    pub(crate) fn contains(&self, ptr: usize) -> bool {
        let bucket = self.bucket(ptr);
        let _guard = bucket.lock.lock();
        // SAFETY: the bucket's lock is held.
        let (slots, overflowed) = unsafe { (&*bucket.slots.get(), *bucket.overflowed.get()) };
        slots.iter().any(|s| s.key == ptr) || (overflowed > 0 && self.overflow.get(ptr).is_some())
    }

    /// Removes the block at `ptr`, returning its value.
    pub(crate) fn remove(&self, ptr: usize) -> Option<V> {
        let bucket = self.bucket(ptr);
        let _guard = bucket.lock.lock();
        // SAFETY: the bucket's lock is held.
        let (slots, overflowed) = unsafe { (&mut *bucket.slots.get(), &mut *bucket.overflowed.get()) };
        let value = match slots.iter_mut().find(|s| s.key == ptr) {
            Some(slot) => {
                slot.key = EMPTY;
                slot.value
            }
            None if *overflowed > 0 => {
                let value = self.overflow.remove(ptr)?;
                *overflowed -= 1;
                value
            }
            None => return None,
        };
        if *overflowed == 0 {
            // Exact again: keep only the bits of the blocks left in the slots.
            let bit = gate::bit_of(ptr);
            let kept = slots.iter().filter(|s| s.key != EMPTY).fold(0, |m, s| m | 1u64 << (gate::bit_of(s.key) % 64));
            let word = self.word(bit);
            let stale = word.load(Ordering::Relaxed) & bucket_mask(bit / BITS_PER_BUCKET) & !kept;
            if stale != 0 {
                word.fetch_and(!stale, Ordering::Release);
            }
        }
        Some(value)
    }

    /// Calls `f` on every block of the set and its value, bucket by bucket under its lock (the
    /// bitmap says which buckets may hold any). `f` must not touch the set.
    pub(crate) fn for_each(&self, mut f: impl FnMut(usize, V)) {
        for w in 0..gate::BITS / 64 {
            let word = self.word(w * 64).load(Ordering::Relaxed);
            for b in (0..64 / BITS_PER_BUCKET).filter(|b| word & bucket_mask(*b) != 0) {
                let bucket = self.bucket_at(w * 64 / BITS_PER_BUCKET + b);
                let _guard = bucket.lock.lock();
                // SAFETY: the bucket's lock is held.
                let slots = unsafe { &*bucket.slots.get() };
                slots.iter().filter(|s| s.key != EMPTY).for_each(|s| f(s.key, s.value));
            }
        }
        self.overflow.for_each(f);
    }

    /// Child side of `fork`. The buckets' locks need nothing: no other thread is inside a
    /// hook when `fork` runs ([`crate::threads::quiesce`]); the overflow table is released as
    /// the other tables are.
    pub(crate) fn force_unlock(&self) {
        self.overflow.force_unlock();
    }

    /// Blocks in the overflow table.
    #[cfg(test)]
    fn overflow_len(&self) -> usize {
        self.overflow.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Addresses on one bucket: the `n`-th address on bit `bit`. Address bits 26 to 28 are
    /// the bit's part; the low 22 bits its line within the part with the fold of
    /// [`gate::bit_of`] undone (`x ^ x >> 11` is its own inverse on 22 bits), the part's bits
    /// folded onto it included; multiples of 8 GiB change neither.
    fn on_bit(bit: usize, n: usize) -> usize {
        let part = bit / gate::PART_BITS;
        let folded = (bit % gate::PART_BITS) << gate::LINE_SHIFT ^ part << (26 - gate::FOLD_SHIFT);
        0x7f00_0000_0000 + (part << 26) + (folded ^ folded >> gate::FOLD_SHIFT) + (n << 33)
    }

    #[test]
    fn on_bit_lands_on_its_bit() {
        for (bit, n) in [(0, 0), (5, 1), (100, 3), (gate::PART_BITS + 7, 1), (gate::BITS - 1, 2)] {
            assert_eq!(gate::bit_of(on_bit(bit, n)), bit);
        }
    }

    #[test]
    fn a_block_sets_its_bit_until_it_goes() {
        let s = SampledBlocks::<u64>::new().unwrap();
        let p = on_bit(100, 0);
        assert!(!s.may_hold(p));
        assert_eq!(s.insert(p, 7), None);
        assert!(s.may_hold(p));
        assert!(!s.may_hold(on_bit(101, 0)));
        assert_eq!(s.insert(p, 8), Some(7));
        assert_eq!(s.remove(p), Some(8));
        assert!(!s.may_hold(p));
        assert_eq!(s.remove(p), None);
    }

    #[test]
    fn a_bit_shared_by_two_blocks_stays_until_both_go() {
        let s = SampledBlocks::<u64>::new().unwrap();
        let (a, b) = (on_bit(5, 0), on_bit(5, 1));
        s.insert(a, 1);
        s.insert(b, 2);
        assert_eq!(s.remove(a), Some(1));
        assert!(s.may_hold(b));
        assert_eq!(s.remove(b), Some(2));
        assert!(!s.may_hold(b));
    }

    #[test]
    fn a_full_bucket_overflows_and_its_bits_are_exact_again_once_emptied() {
        let s = SampledBlocks::<u64>::new().unwrap();
        // Five blocks on bits 32..36, all in bucket 2.
        let blocks: Vec<usize> = (0..5).map(|i| on_bit(32 + i, i)).collect();
        for (i, &p) in blocks.iter().enumerate() {
            assert_eq!(s.insert(p, i as u64), None);
        }
        assert_eq!(s.overflow_len(), 3);
        assert!(blocks.iter().all(|&p| s.may_hold(p)));
        assert_eq!(s.insert(blocks[4], 40), Some(4), "a replacement in the overflow table");
        assert_eq!(s.overflow_len(), 3);
        // Slots first: their bits stay while the overflow holds blocks.
        assert_eq!(s.remove(blocks[0]), Some(0));
        assert!(s.may_hold(blocks[0]), "left set while the bucket has overflowed blocks");
        assert_eq!(s.remove(blocks[2]), Some(2));
        assert_eq!(s.remove(blocks[4]), Some(40));
        assert_eq!(s.overflow_len(), 1);
        assert!(s.may_hold(blocks[2]));
        assert_eq!(s.remove(blocks[3]), Some(3));
        assert_eq!(s.overflow_len(), 0);
        for (i, &p) in blocks.iter().enumerate() {
            assert_eq!(s.may_hold(p), i == 1, "block {i}");
        }
        assert_eq!(s.remove(blocks[1]), Some(1));
        assert!(blocks.iter().all(|&p| !s.may_hold(p)));
        // Other buckets' bits in the same word are not touched.
        let other = on_bit(16, 0);
        s.insert(other, 9);
        s.insert(blocks[0], 0);
        s.remove(blocks[0]);
        assert!(s.may_hold(other));
    }

    #[test]
    fn every_block_is_visited_once_slots_and_overflow_alike() {
        let s = SampledBlocks::<u64>::new().unwrap();
        let mut blocks: Vec<usize> = (0..5).map(|i| on_bit(32 + i, i)).collect();
        blocks.extend([on_bit(0, 0), on_bit(63, 1), on_bit(64, 0), on_bit(gate::BITS - 1, 2)]);
        for (i, &p) in blocks.iter().enumerate() {
            s.insert(p, i as u64);
        }
        s.remove(blocks[1]);
        let mut seen = Vec::new();
        s.for_each(|p, v| seen.push((p, v)));
        seen.sort_unstable();
        let mut want: Vec<(usize, u64)> =
            blocks.iter().enumerate().filter(|&(i, _)| i != 1).map(|(i, &p)| (p, i as u64)).collect();
        want.sort_unstable();
        assert_eq!(seen, want);
    }

    #[test]
    fn threads_inserting_and_removing_leave_it_empty() {
        let s = SampledBlocks::<u64>::new().unwrap();
        std::thread::scope(|scope| {
            for t in 0..4 {
                let s = &s;
                scope.spawn(move || {
                    for round in 0..200 {
                        let blocks: Vec<usize> =
                            (0..64).map(|i| on_bit((i * 7 + t) % 256, round % 3 + t * 4)).collect();
                        for &p in &blocks {
                            assert_eq!(s.insert(p, p as u64), None);
                        }
                        for &p in &blocks {
                            assert_eq!(s.remove(p), Some(p as u64));
                        }
                    }
                });
            }
        });
        assert_eq!(s.overflow_len(), 0);
        assert!((0..256).all(|bit| !s.may_hold(on_bit(bit, 0))));
    }
}
