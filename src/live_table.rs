//! A hash table from block address to a small record, for the hook path.
//!
//! Open addressing with linear probing and backward-shift deletion (no tombstones, so probe
//! sequences stay short under churn), split into [`SHARDS`] independently locked shards so
//! that threads rarely meet. Memory comes from anonymous mappings, never from the heap being
//! watched, and grows by doubling per shard. DashMap measured 62 ns per insert/remove pair here
//! and allocated through the hook (see `interposer-pitfalls.md` section 6); this costs one
//! uncontended lock and a probe or two. Its arrays are leased from [`crate::pool`].
//!
//! A signal handler can interrupt a thread inside a shard's critical section; its own
//! allocator calls then see the lock held by themselves. [`LiveTable::try_get`] reports that
//! instead of deadlocking, and the hook path defers such work.

use core::cell::UnsafeCell;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use crate::sync::{SelfHeld, SpinLock};
use crate::{pool, prefetch};

/// Number of shards (a power of two); the top bits of the hash choose one.
pub(crate) const SHARDS: usize = 64;
const SHARD_BITS: u32 = SHARDS.trailing_zeros();

const EMPTY: usize = 0;

#[repr(C)]
#[derive(Clone, Copy)]
struct Entry<V> {
    key: usize,
    value: V,
}

struct Array<V> {
    entries: *mut Entry<V>,
    /// A power of two, or 0 before the first insert.
    capacity: usize,
}

#[repr(align(64))]
struct Shard<V> {
    lock: SpinLock,
    array: UnsafeCell<Array<V>>,
    /// Live entries; updated under the lock, read without it.
    len: AtomicUsize,
    /// The array's address and capacity, published for [`LiveTable::prefetch`] (which reads
    /// them without the lock).
    hint_entries: AtomicPtr<u8>,
    hint_capacity: AtomicUsize,
}

/// Outcome of a lookup that must not wait for the calling thread itself.
pub(crate) enum Lookup<V> {
    Found(V),
    Absent,
    /// The calling thread holds the shard's lock (it is a signal handler interrupting a
    /// critical section): the answer is unknown.
    Busy,
}

/// Address-keyed table of `V` records. Keys are never 0.
pub(crate) struct LiveTable<V: Copy> {
    shards: [Shard<V>; SHARDS],
}

// SAFETY: every access to a shard's array happens under that shard's lock; `len` is atomic.
unsafe impl<V: Copy + Send> Sync for LiveTable<V> {}
// SAFETY: the table owns its mappings; moving it between threads moves plain pointers.
unsafe impl<V: Copy + Send> Send for LiveTable<V> {}

/// Where `key` lives: the top bits choose the shard, the low bits the slot.
///
/// Each page of addresses (4 KiB) starts at a random place (Fibonacci hashing of the page
/// number) and its 16-byte granules follow in order from there, so blocks allocated one after
/// another, which allocators carve side by side, share cache lines of the table: an
/// allocation mostly finds its slot already in cache, where a uniform hash would miss every
/// time the table outgrows the cache. Not larger regions: with 64 KiB ones (4,096 slots each,
/// half of them filled by 16-byte blocks), regions whose runs overlapped filled whole
/// stretches of the table, and with 16 million live blocks a free probed thousands of slots
/// (3.7 us a free against 0.1; review helper 97). Pages gave churn 8% and sqlite3 2.6% less
/// time under the leak tracker too (7 alternating rounds).
#[inline]
fn hash(key: usize) -> u64 {
    let key = key as u64;
    (key >> 12).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add((key >> 4) & 0xff)
}

impl<V: Copy> Array<V> {
    #[inline]
    fn index(&self, h: u64) -> usize {
        h as usize & (self.capacity - 1)
    }

    /// Finds `key`: `Ok(slot)` when present, `Err(slot)` with the empty slot where it would
    /// go otherwise. The array must have capacity and at least one empty slot.
    #[inline]
    fn probe(&self, key: usize, h: u64) -> Result<usize, usize> {
        let mask = self.capacity - 1;
        let mut i = self.index(h);
        loop {
            // SAFETY: i <= mask < capacity, within the mapping.
            let k = unsafe { (*self.entries.add(i)).key };
            if k == key {
                return Ok(i);
            }
            if k == EMPTY {
                return Err(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Empties `slot` and shifts back the entries of its probe run that belong before it, so
    /// that every entry stays reachable from its home slot without tombstones.
    fn delete(&mut self, mut slot: usize) {
        let mask = self.capacity - 1;
        let mut next = slot;
        loop {
            next = (next + 1) & mask;
            // SAFETY: next <= mask < capacity.
            let e = unsafe { *self.entries.add(next) };
            if e.key == EMPTY {
                break;
            }
            let home = self.index(hash(e.key));
            // Move `e` back into the hole unless its home lies cyclically in (slot, next].
            let stays = if slot <= next { slot < home && home <= next } else { slot < home || home <= next };
            if !stays {
                // SAFETY: both slots are below capacity.
                unsafe { *self.entries.add(slot) = e };
                slot = next;
            }
        }
        // SAFETY: slot < capacity.
        unsafe { (*self.entries.add(slot)).key = EMPTY };
    }

    fn bytes(capacity: usize) -> usize {
        capacity * core::mem::size_of::<Entry<V>>()
    }

    /// Rebuilds into a fresh mapping of `capacity` entries, dropping tombstones.
    fn rebuild(&mut self, capacity: usize) -> bool {
        let Some(mem) = pool::lease(Self::bytes(capacity)) else { return false };
        let fresh = Array { entries: mem.as_ptr().cast::<Entry<V>>(), capacity };
        for i in 0..self.capacity {
            // SAFETY: i < capacity of the old mapping.
            let e = unsafe { *self.entries.add(i) };
            if e.key != EMPTY {
                let slot = fresh.probe(e.key, hash(e.key)).unwrap_or_else(|slot| slot);
                // SAFETY: probe returned a slot below the new capacity.
                unsafe { *fresh.entries.add(slot) = e };
            }
        }
        self.release();
        *self = fresh;
        true
    }

    fn release(&mut self) {
        if let Some(p) = NonNull::new(self.entries) {
            // SAFETY: entries/capacity describe the one lease this array made; the lock
            // holder is its only user and forgets it right after.
            unsafe { pool::give_back(p.cast(), Self::bytes(self.capacity)) };
        }
        self.entries = core::ptr::null_mut();
        self.capacity = 0;
    }
}

impl<V: Copy> Shard<V> {
    const fn new() -> Self {
        Self {
            lock: SpinLock::new(),
            array: UnsafeCell::new(Array { entries: core::ptr::null_mut(), capacity: 0 }),
            len: AtomicUsize::new(0),
            hint_entries: AtomicPtr::new(core::ptr::null_mut()),
            hint_capacity: AtomicUsize::new(0),
        }
    }
}

impl<V: Copy> LiveTable<V> {
    /// An empty table; it maps memory on first insert.
    pub(crate) const fn new() -> Self {
        Self { shards: [const { Shard::new() }; SHARDS] }
    }

    /// An empty table in memory leased for it alone, never given back. The spies hold their
    /// tables so because a table is 4 KiB, and a value that size is built on the stack and
    /// copied: the shim's constructor, on the program's main thread, needed 40 KiB of stack
    /// where `ls` itself needs 24 (under `ulimit -s 32` every program died at start).
    pub(crate) fn leased() -> Option<&'static Self> {
        const { assert!(core::mem::align_of::<Self>() <= 4096) };
        let region = pool::lease(core::mem::size_of::<Self>())?;
        // SAFETY: the region is zeroed, page-aligned (a lease is at least a page), large
        // enough, and never given back; an empty table's fields are all zero bytes (free
        // locks, no arrays, zero counts: `an_empty_table_is_all_zero_bytes`), and its padding
        // may be anything.
        Some(unsafe { &*region.as_ptr().cast::<Self>() })
    }

    #[inline]
    fn shard(&self, h: u64) -> &Shard<V> {
        &self.shards[(h >> (64 - SHARD_BITS)) as usize]
    }

    /// Inserts or replaces `key`. Returns false when no memory could be mapped.
    pub(crate) fn insert(&self, key: usize, value: V) -> bool {
        self.insert_with(key, value, |_| {})
    }

    /// Inserts `key`, or replaces it and calls `replaced` with the old value, under the
    /// shard's lock. Returns false when no memory could be mapped.
    pub(crate) fn insert_with(&self, key: usize, value: V, replaced: impl FnOnce(V)) -> bool {
        debug_assert!(key != EMPTY);
        let h = hash(key);
        let shard = self.shard(h);
        let _guard = shard.lock.lock();
        // SAFETY: the shard lock is held.
        let array = unsafe { &mut *shard.array.get() };
        // At most half full: linear probing stays at a probe or two.
        if (shard.len.load(Ordering::Relaxed) + 1) * 2 > array.capacity {
            // A page of entries to start with, rounded down to a power of two.
            let per_page = (4096 / core::mem::size_of::<Entry<V>>()).max(1);
            let min = 1 << per_page.ilog2();
            if !array.rebuild((array.capacity * 2).max(min)) {
                return false;
            }
            shard.hint_entries.store(array.entries.cast(), Ordering::Relaxed);
            shard.hint_capacity.store(array.capacity, Ordering::Relaxed);
        }
        match array.probe(key, h) {
            Ok(slot) => {
                // SAFETY: slot < capacity; lock held.
                let entry = unsafe { &mut (*array.entries.add(slot)).value };
                replaced(core::mem::replace(entry, value));
            }
            Err(slot) => {
                // SAFETY: slot < capacity; lock held.
                unsafe { *array.entries.add(slot) = Entry { key, value } };
                // Under the lock: a plain store, no locked instruction (see `len`).
                shard.len.store(shard.len.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            }
        }
        true
    }

    /// Removes `key`, returning its value.
    pub(crate) fn remove(&self, key: usize) -> Option<V> {
        if self.shard(hash(key)).len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.remove_if(key, || true)
    }

    /// Removes `key` if `claim`, called first under the shard's lock, says so.
    pub(crate) fn remove_if(&self, key: usize, claim: impl FnOnce() -> bool) -> Option<V> {
        let h = hash(key);
        let shard = self.shard(h);
        let _guard = shard.lock.lock();
        Self::remove_locked(shard, key, h, claim)
    }

    /// [`Self::remove_if`], or `Err` when the calling thread holds the shard's lock (a signal
    /// handler that interrupted it there), where waiting would deadlock.
    pub(crate) fn try_remove_if(&self, key: usize, claim: impl FnOnce() -> bool) -> Result<Option<V>, SelfHeld> {
        let h = hash(key);
        let shard = self.shard(h);
        if shard.len.load(Ordering::Relaxed) == 0 {
            return Ok(None);
        }
        let _guard = shard.lock.try_lock()?;
        Ok(Self::remove_locked(shard, key, h, claim))
    }

    /// The removal of [`Self::remove_if`], with `shard`'s lock held by the caller.
    fn remove_locked(shard: &Shard<V>, key: usize, h: u64, claim: impl FnOnce() -> bool) -> Option<V> {
        if !claim() {
            return None;
        }
        // SAFETY: the caller holds the shard lock.
        let array = unsafe { &mut *shard.array.get() };
        if array.capacity == 0 {
            return None;
        }
        let slot = array.probe(key, h).ok()?;
        // SAFETY: slot < capacity; lock held.
        let value = unsafe { (*array.entries.add(slot)).value };
        array.delete(slot);
        shard.len.store(shard.len.load(Ordering::Relaxed) - 1, Ordering::Relaxed);
        Some(value)
    }

    /// The value of `key`, if present.
    pub(crate) fn get(&self, key: usize) -> Option<V> {
        let h = hash(key);
        let shard = self.shard(h);
        if shard.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let _guard = shard.lock.lock();
        // SAFETY: the shard lock is held.
        Self::lookup(unsafe { &*shard.array.get() }, key, h)
    }

    /// Like [`LiveTable::get`], but answers [`Lookup::Busy`] instead of deadlocking when the
    /// calling thread holds the shard's lock.
    pub(crate) fn try_get(&self, key: usize) -> Lookup<V> {
        let h = hash(key);
        let shard = self.shard(h);
        if shard.len.load(Ordering::Relaxed) == 0 {
            return Lookup::Absent;
        }
        match shard.lock.try_lock() {
            Err(SelfHeld) => Lookup::Busy,
            Ok(_guard) => {
                // SAFETY: the shard lock is held.
                match Self::lookup(unsafe { &*shard.array.get() }, key, h) {
                    Some(v) => Lookup::Found(v),
                    None => Lookup::Absent,
                }
            }
        }
    }

    fn lookup(array: &Array<V>, key: usize, h: u64) -> Option<V> {
        if array.capacity == 0 {
            return None;
        }
        let slot = array.probe(key, h).ok()?;
        // SAFETY: slot < capacity; the caller holds the lock.
        Some(unsafe { (*array.entries.add(slot)).value })
    }

    /// Number of live entries. Exact when no insert or remove runs concurrently. The fence
    /// orders the caller's own earlier removals before these loads, so of two threads that
    /// each remove an entry and then read the length, at least one sees both removals (the
    /// store-buffering pattern needs a full fence between store and load on both sides).
    pub(crate) fn len(&self) -> usize {
        core::sync::atomic::fence(Ordering::SeqCst);
        self.shards.iter().map(|s| s.len.load(Ordering::Relaxed)).sum()
    }

    /// Starts loading the cache line where `key` would sit, so that a later insert or remove
    /// finds it in cache. A hint only: it reads the shard's array without the lock, and a
    /// stale array (mid-rebuild) merely prefetches the wrong line.
    #[inline(always)]
    pub(crate) fn prefetch(&self, key: usize) {
        let h = hash(key);
        let shard = self.shard(h);
        let entries = shard.hint_entries.load(Ordering::Relaxed).cast::<Entry<V>>();
        let capacity = shard.hint_capacity.load(Ordering::Relaxed);
        if capacity != 0 {
            let i = h as usize & (capacity - 1);
            // The entry and the one after it (a removal looks at the next to shift it back;
            // either may straddle a line).
            let first = entries.wrapping_add(i).cast::<u8>();
            prefetch::read(first);
            prefetch::read(first.wrapping_add(2 * core::mem::size_of::<Entry<V>>() - 1));
        }
    }

    /// Bytes of pool memory the table holds.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let _guard = s.lock.lock();
                // SAFETY: the shard lock is held.
                Array::<V>::bytes(unsafe { (*s.array.get()).capacity })
            })
            .sum()
    }

    /// Calls `f` on every entry, shard by shard, each under its lock. `f` must not touch the
    /// table (nor allocate through the hooks: the lock is held).
    pub(crate) fn for_each(&self, mut f: impl FnMut(usize, V)) {
        for shard in &self.shards {
            if shard.len.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let _guard = shard.lock.lock();
            // SAFETY: the shard lock is held.
            let array = unsafe { &*shard.array.get() };
            for i in 0..array.capacity {
                // SAFETY: i < capacity.
                let e = unsafe { *array.entries.add(i) };
                if e.key != EMPTY {
                    f(e.key, e.value);
                }
            }
        }
    }

    /// Runs `f` with the lock of `key`'s shard held, as a hook interrupted there holds it.
    #[cfg(test)]
    pub(crate) fn with_shard_locked<R>(&self, key: usize, f: impl FnOnce() -> R) -> R {
        let _guard = self.shard(hash(key)).lock.lock();
        f()
    }

    /// Whether `a` and `b` have the same shard.
    #[cfg(test)]
    pub(crate) fn same_shard(&self, a: usize, b: usize) -> bool {
        core::ptr::eq(self.shard(hash(a)), self.shard(hash(b)))
    }

    /// Child side of `fork`: no other thread survived, so no lock can be legitimately held.
    pub(crate) fn force_unlock(&self) {
        for shard in &self.shards {
            shard.lock.force_unlock();
        }
    }
}

impl<V: Copy> Drop for LiveTable<V> {
    fn drop(&mut self) {
        for shard in &mut self.shards {
            shard.array.get_mut().release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_get_remove_across_growth() {
        let t = LiveTable::<u64>::new();
        let keys: Vec<usize> = (1..=50_000usize).map(|i| i * 48 + 0x1000).collect();
        for (n, &k) in keys.iter().enumerate() {
            assert!(t.insert(k, n as u64));
        }
        assert_eq!(t.len(), keys.len());
        for (n, &k) in keys.iter().enumerate() {
            assert_eq!(t.get(k), Some(n as u64));
        }
        for &k in keys.iter().step_by(2) {
            assert!(t.remove(k).is_some());
        }
        assert_eq!(t.len(), keys.len() / 2);
        assert_eq!(t.get(keys[0]), None);
        assert_eq!(t.get(keys[1]), Some(1));
        assert!(t.remove(keys[0]).is_none());
    }

    #[test]
    fn deletion_keeps_colliding_runs_reachable() {
        // Keys whose hashes collide in a small table: delete from the middle of runs.
        let t = LiveTable::<u64>::new();
        let keys: Vec<usize> = (1..=3000usize).map(|i| i << 12).collect();
        for &k in &keys {
            t.insert(k, k as u64);
        }
        for &k in keys.iter().filter(|&&k| (k >> 12) % 3 == 0) {
            assert_eq!(t.remove(k), Some(k as u64));
        }
        for &k in &keys {
            let expect = if (k >> 12) % 3 == 0 { None } else { Some(k as u64) };
            assert_eq!(t.get(k), expect, "key {k:#x}");
        }
    }

    #[test]
    fn churn_does_not_grow_the_table() {
        let t = LiveTable::<u64>::new();
        for round in 0..200usize {
            for i in 0..100usize {
                t.insert(0x10_0000 + (round * 100 + i) * 16, 0);
            }
            for i in 0..100usize {
                t.remove(0x10_0000 + (round * 100 + i) * 16);
            }
        }
        assert_eq!(t.len(), 0);
        // Each shard still at its first page.
        for shard in &t.shards {
            // SAFETY: no other thread uses the table.
            assert!(unsafe { (*shard.array.get()).capacity } <= 256);
        }
    }

    #[test]
    fn entries_of_any_size_keep_power_of_two_capacity() {
        let t = LiveTable::<[u64; 2]>::new();
        for i in 1..=5000usize {
            assert!(t.insert(i * 16, [i as u64, 0]));
            if i % 2 == 0 {
                t.remove(i * 16 - 16);
            }
        }
        assert_eq!(t.get(5000 * 16), Some([5000, 0]));
        assert_eq!(t.len(), 2500);
    }

    #[test]
    fn an_empty_table_is_all_zero_bytes() {
        fn zero<T>(field: &T) -> bool {
            // SAFETY: reads the bytes of a field made of words (no padding inside).
            let bytes = unsafe { core::slice::from_raw_parts((field as *const T).cast::<u8>(), size_of::<T>()) };
            bytes.iter().all(|&b| b == 0)
        }
        let t = LiveTable::<[u64; 2]>::new();
        for s in &t.shards {
            assert!(zero(&s.lock) && zero(&s.array) && zero(&s.len) && zero(&s.hint_entries) && zero(&s.hint_capacity));
        }
        let leased = LiveTable::<[u64; 2]>::leased().unwrap();
        assert!(leased.insert(0x7000, [1, 2]));
        assert_eq!((leased.get(0x7000), leased.get(0x7010), leased.len()), (Some([1, 2]), None, 1));
    }

    /// Two million 32-byte blocks side by side, as an allocator carves them: every entry lies
    /// close to its home slot. With 64 KiB regions of slots, regions whose runs overlapped
    /// filled whole stretches of the table, and probes grew to thousands of slots (review
    /// helper 97).
    #[test]
    fn blocks_side_by_side_stay_near_their_home_slots() {
        let t = LiveTable::<u64>::new();
        let blocks = 2_000_000usize;
        for i in 0..blocks {
            assert!(t.insert(0x5555_0000_0000 + i * 32, 0));
        }
        let (mut total, mut longest) = (0usize, 0usize);
        for shard in &t.shards {
            // SAFETY: no other thread uses the table.
            let array = unsafe { &*shard.array.get() };
            for slot in 0..array.capacity {
                // SAFETY: slot < capacity.
                let key = unsafe { (*array.entries.add(slot)).key };
                if key != EMPTY {
                    let distance = slot.wrapping_sub(array.index(hash(key))) & (array.capacity - 1);
                    total += distance;
                    longest = longest.max(distance);
                }
            }
        }
        let mean = total as f64 / blocks as f64;
        assert!(mean < 10.0 && longest < 1000, "mean distance {mean:.1}, longest {longest}");
    }

    #[test]
    fn try_get_reports_self_held_lock() {
        let t = LiveTable::<u64>::new();
        t.insert(0x5000, 7);
        let h = hash(0x5000);
        let _held = t.shard(h).lock.lock();
        assert!(matches!(t.try_get(0x5000), Lookup::Busy));
    }

    #[test]
    fn concurrent_threads_keep_counts_exact() {
        let t = std::sync::Arc::new(LiveTable::<u64>::new());
        let handles: Vec<_> = (0..4usize)
            .map(|tid| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000usize {
                        let k = 0x100_0000 * (tid + 1) + i * 32;
                        t.insert(k, i as u64);
                        if i % 3 == 0 {
                            t.remove(k);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(t.len(), 4 * (20_000 - 20_000usize.div_ceil(3)));
    }
}
