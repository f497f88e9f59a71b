//! The sampling gate: lets the calls a sampling spy would only count bypass the spy.
//!
//! A spy that samples (`spy=ticks`) looks at one allocation in thousands; the rest it only
//! counts. Sending every call through the registry, the hook scope and the spy's methods
//! costs more than the sampling itself, so when the sampling spy is the process's only spy
//! the entry points ask the gate first: an allocation that does not use up the thread's
//! countdown, and a free of an address the spy never sampled, are counted here — a few loads
//! and stores on this thread's own lines — and go straight to the real allocator, as
//! tcmalloc's sampler sits on its fast path. The rest take the spied path, where the spy
//! decides, samples and resets the countdown.
//!
//! The spy publishes which addresses may be sampled blocks in a bitmap (a bit per address
//! hash, set while any sampled block of that hash lives); a free whose bit is clear cannot
//! be of a sampled block. The countdowns live in the thread's initial-exec TLS
//! ([`crate::tls::ThreadState::tick_until`]); the counters in the spy's per-thread record,
//! which the thread's TLS points to once the spy has seen the thread.
//!
//! Each opening of a gate has its own epoch, which the spy writes into a thread's TLS
//! (`tick_seen`) when it sets up the thread's countdowns and record. The gate lets a call
//! through only when that word and the hook depth, read as one 8-byte word, equal its key:
//! one compare says at once that the gate is open, that the spy has seen this thread under
//! this opening (not some earlier spy), and that the call comes from outside the hooks.

use core::cell::Cell;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::thread_records::bump;
use crate::tls;

/// Bits of the address bitmap (a power of two): eight parts of [`PART_BITS`].
pub(crate) const BITS: usize = 1 << 19;

/// Bits of one part of the bitmap (a power of two). The part of an address is its 64 MiB
/// heap's number modulo eight (address bits 26 to 28): see [`bit_of`].
pub(crate) const PART_BITS: usize = 1 << 16;

/// How far [`bit_of`] shifts an address for its part's number (address bits 26 to 28) to
/// land on the bits above a part's.
pub(crate) const PART_SHIFT: u32 = 26 - PART_BITS.trailing_zeros();

/// A thread's exact totals, as the gate and the spy count them (single writer: the thread).
#[repr(C)]
pub(crate) struct TickCounters {
    pub allocs: [AtomicU64; 3],
    pub bytes: [AtomicU64; 3],
    pub frees: AtomicU64,
}

/// Allocation kinds, as indexes (see [`crate::trace::Kind`]).
pub(crate) const SMALL: usize = 0;
pub(crate) const LARGE: usize = 1;
pub(crate) const ALIGNED: usize = 2;
/// Requests at or above this are `large` (glibc's default mmap threshold).
pub(crate) const LARGE_BYTES: usize = 128 << 10;

/// The kind of an unaligned request of `size` bytes.
#[inline(always)]
pub(crate) fn kind_of(size: usize) -> usize {
    if size >= LARGE_BYTES { LARGE } else { SMALL }
}

/// log2 of the bytes of address space each bit of the bitmap stands for (a 64-byte line).
pub(crate) const LINE_SHIFT: u32 = 6;

/// How far [`bit_of`] shifts an address before folding it onto itself: glibc's arenas for
/// threads are heaps of 64 MiB aligned on 64 MiB, so that address bits 26 and up, which
/// tell one thread's heap from another's, land on the bits that pick a part's line too (more
/// than eight heaps share the parts).
pub(crate) const FOLD_SHIFT: u32 = 11;

/// The bit of `ptr` in the bitmap: in the part of its 64 MiB heap, its 64-byte line modulo the
/// part's 4 MiB of reach, with the higher bits that tell the threads' heaps apart folded in.
///
/// Not a scrambling hash, on purpose: frees of neighbouring blocks read the same bitmap word
/// (the fold keeps a page's blocks on one word), so the bitmap stays in cache while the
/// program walks its heap, and a sampled block costs a slow free only to the few blocks
/// sharing its line (and a few far away). Without the fold, blocks at the same offset in two
/// threads' arenas shared a bit: a sample of one thread sent the other's frees to the slow
/// path, and the two threads wrote the same lines of the bitmap and of the sampled set. A
/// sample and its free then cost 164 and 359 ns on each of two threads sampling at once (two
/// runs of the bench's `sample_cost` row), against 92 ns on one thread; 117 and 121 ns with it.
///
/// The parts keep threads apart: glibc gives each thread's arena heaps of its own, so up to
/// eight threads each set and clear bits on lines no other thread's frees read, and the
/// sampled set's buckets, which follow the bits, are theirs too. With one part for all, each
/// of churn's two threads covered every line of the bitmap: every sample and every free of a
/// sampled block took a line from the other core, and the other core's next free there took
/// it back. In `sample` and the free of a sampled block, the bitmap's two locked instructions
/// went from 30% and 41% of their time to 12% and 15% (`perf`, churn with two threads).
#[inline(always)]
pub(crate) fn bit_of(ptr: usize) -> usize {
    ((ptr ^ ptr >> FOLD_SHIFT) >> LINE_SHIFT) & (PART_BITS - 1) | (ptr >> PART_SHIFT) & (BITS - PART_BITS)
}

/// Takes `size` bytes off the countdown `until` and counts an allocation of `kind`, unless
/// that would end the countdown (the allocation is then the spy's to sample).
#[inline(always)]
fn take(until: &Cell<i64>, c: &TickCounters, size: usize, kind: usize) -> bool {
    // A request of 2^63 bytes or more can only fail: cast, it would add to the countdown (one
    // such `realloc` stopped a thread's sampling for good). The spied path counts only what
    // the real allocator gave.
    let Ok(size) = i64::try_from(size) else { return false };
    let left = until.get() - size;
    if left <= 0 {
        return false;
    }
    until.set(left);
    bump(&c.allocs[kind], 1);
    bump(&c.bytes[kind], size as u64);
    true
}

/// The key of a closed gate: no thread's `tick_seen` and `depth` pair equals it (the depth
/// would be `u32::MAX`).
const CLOSED: u64 = u64::MAX;

/// The epoch of the next opening of any gate (the tests' interposers have gates of their own).
static NEXT_EPOCH: AtomicU32 = AtomicU32::new(1);

/// The gate of one interposer.
pub(crate) struct Gate {
    /// The epoch of the current opening, or [`CLOSED`].
    key: AtomicU64,
    /// [`tls::block_offset`], set before the first opening (0 until then), on the key's line:
    /// the assembly reads it there rather than in the GOT, one line and page fewer per call.
    tls_offset: AtomicUsize,
    /// One countdown per kind (tick sampling) rather than one for all (poisson).
    per_kind: AtomicBool,
    /// `[AtomicU64; BITS / 64]`, set by the spy.
    bitmap: AtomicPtr<AtomicU64>,
}

impl Gate {
    /// Where `key` and `bitmap` lie in a gate, for the assembly of [`crate::fast_path`].
    pub(crate) const KEY_OFFSET: usize = core::mem::offset_of!(Gate, key);
    pub(crate) const BITMAP_OFFSET: usize = core::mem::offset_of!(Gate, bitmap);
    pub(crate) const TLS_OFFSET: usize = core::mem::offset_of!(Gate, tls_offset);

    pub(crate) const fn new() -> Self {
        Self {
            key: AtomicU64::new(CLOSED),
            tls_offset: AtomicUsize::new(0),
            per_kind: AtomicBool::new(false),
            bitmap: AtomicPtr::new(core::ptr::null_mut()),
        }
    }

    /// Opens the gate for the spy that maintains `bitmap` (`BITS` bits) and the threads'
    /// countdowns and counters. Returns the opening's epoch: the spy marks each thread it
    /// sets up with it (`tick_seen`), and only such threads are counted here.
    pub(crate) fn open(&self, bitmap: *mut AtomicU64, per_kind: bool) -> u32 {
        // Epochs are never 0, the mark of a thread no spy has set up (nor would 4 billion
        // openings wrap into a live one in practice).
        let epoch = NEXT_EPOCH.fetch_add(1, Ordering::Relaxed).max(1);
        self.per_kind.store(per_kind, Ordering::Relaxed);
        self.bitmap.store(bitmap, Ordering::Release);
        self.tls_offset.store(tls::block_offset(), Ordering::Relaxed);
        self.key.store(u64::from(epoch), Ordering::Release);
        epoch
    }

    /// Whether a sampling spy has the gate open.
    #[inline(always)]
    pub(crate) fn is_open(&self) -> bool {
        self.key.load(Ordering::Relaxed) != CLOSED
    }

    /// Closes the gate (the sampling spy is revoked): every call goes to the registry again.
    pub(crate) fn close(&self) {
        self.key.store(CLOSED, Ordering::Release);
    }

    /// The calling thread's counters, if the gate is open, the spy has set the thread up
    /// under this opening and the thread is outside any hook.
    #[inline(always)]
    fn counters(&self) -> Option<(&'static tls::ThreadState, &'static TickCounters)> {
        let key = self.key.load(Ordering::Relaxed);
        let ts = tls::state();
        if ts.seen_and_depth() != key {
            return None;
        }
        // SAFETY: the spy set this thread's record when it marked the thread with the key,
        // and it stores only pointers to its per-thread records, which live as long as the
        // process (mallocspy's pool never unmaps them).
        Some((ts, unsafe { &*(ts.tick_record.get() as *const TickCounters) }))
    }

    /// Whether a sampled block may live at `ptr`.
    #[inline(always)]
    pub(crate) fn maybe_sampled(&self, ptr: usize) -> bool {
        let bit = bit_of(ptr);
        // SAFETY: set with the gate opened: BITS / 64 words, never freed.
        let word = unsafe { &*self.bitmap.load(Ordering::Relaxed).add(bit / 64) };
        word.load(Ordering::Relaxed) & (1 << (bit % 64)) != 0
    }

    /// A `malloc` or `calloc` of `size` bytes: `true` when it is only counted (the caller goes
    /// straight to the real allocator). Only `small` requests pass here: their countdown is
    /// the first in both sampling modes and their counters come first, so the commonest
    /// call reads no mode and computes no index; a `large` one (an `mmap` of its own in the
    /// real allocator, far dearer than the spy) takes the spied path.
    #[inline(always)]
    pub(crate) fn pass_small(&self, size: usize) -> bool {
        const { assert!(SMALL == 0) };
        let Some((ts, c)) = self.counters() else { return false };
        size < LARGE_BYTES && take(&ts.tick_until[SMALL], c, size, SMALL)
    }

    /// An allocation of `size` bytes of `kind`: `true` when it is only counted (the caller
    /// goes straight to the real allocator).
    #[inline(always)]
    pub(crate) fn pass_alloc(&self, size: usize, kind: usize) -> bool {
        let Some((ts, c)) = self.counters() else { return false };
        self.count_down(ts, c, size, kind)
    }

    /// Takes back what [`Gate::pass_alloc`] counted of an aligned allocation that the real
    /// allocator then refused (an alignment of a terabyte, an impossible size): the exact
    /// totals counted each such failure as an allocation (review helper 81).
    #[cold]
    pub(crate) fn failed_after_pass(&self, size: usize) {
        let Some((ts, c)) = self.counters() else { return };
        let until = &ts.tick_until[if self.per_kind.load(Ordering::Relaxed) { ALIGNED } else { 0 }];
        // `take` passed only sizes below 2^63 that left the countdown above 0.
        until.set(until.get() + size as i64);
        bump(&c.allocs[ALIGNED], 1u64.wrapping_neg());
        bump(&c.bytes[ALIGNED], (size as u64).wrapping_neg());
    }

    /// [`take`] from the countdown of `kind` (tick sampling) or the only one (poisson).
    #[inline(always)]
    fn count_down(&self, ts: &tls::ThreadState, c: &TickCounters, size: usize, kind: usize) -> bool {
        take(&ts.tick_until[if self.per_kind.load(Ordering::Relaxed) { kind } else { 0 }], c, size, kind)
    }

    /// A free of `ptr`: `true` when it is only counted (NULL: not even counted). The
    /// process's interposer takes these steps in assembly ([`crate::fast_path`]).
    #[cfg(test)]
    #[inline(always)]
    pub(crate) fn pass_free(&self, ptr: usize) -> bool {
        let Some((_, c)) = self.counters() else { return false };
        if ptr == 0 {
            return true;
        }
        if self.maybe_sampled(ptr) {
            return false;
        }
        bump(&c.frees, 1);
        true
    }

    /// A `realloc` of `ptr` (maybe NULL) to `size` (not 0): `true` when it is only counted.
    #[inline(always)]
    pub(crate) fn pass_realloc(&self, ptr: usize, size: usize) -> bool {
        let Some((ts, c)) = self.counters() else { return false };
        if (ptr != 0 && self.maybe_sampled(ptr)) || !self.count_down(ts, c, size, kind_of(size)) {
            return false;
        }
        if ptr != 0 {
            bump(&c.frees, 1);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bitmap's line (eight words) of an address.
    fn line_of(ptr: usize) -> usize {
        bit_of(ptr) / 512
    }

    /// The lines of a page fall on the 64 bits of one word.
    #[test]
    fn neighbouring_blocks_read_one_word() {
        let page = 0x7f12_3456_7000;
        let bits: std::collections::HashSet<usize> = (0..4096).step_by(64).map(|off| bit_of(page + off)).collect();
        assert_eq!(bits.len(), 64);
        assert!(bits.iter().all(|&bit| bit / 64 == bit_of(page) / 64));
    }

    /// A thread's heap: glibc's arenas for threads are 64 MiB heaps aligned on 64 MiB.
    fn heap(i: usize) -> usize {
        0x7f00_0000_0000 + (i << 26)
    }

    /// The same offset in two heaps falls on different lines of the bitmap (and of the
    /// sampled set, whose buckets follow the bits), eight heaps apart too (the same part).
    #[test]
    fn the_same_offset_in_two_threads_heaps_falls_on_different_lines() {
        for offset in [0x8a0, 0x1_2340, 0x3f_fff0] {
            for i in 0..32 {
                for j in [i + 1, i + 8] {
                    assert_ne!(line_of(heap(i) + offset), line_of(heap(j) + offset), "heaps {i} and {j}");
                }
            }
        }
    }

    /// Eight neighbouring heaps have lines of their own: no thread's sample writes a line
    /// that another thread's frees read.
    #[test]
    fn eight_neighbouring_heaps_share_no_line() {
        let lines = |i: usize| -> std::collections::HashSet<usize> {
            (0..1 << 26).step_by(4096 + 64).map(|offset| line_of(heap(i) + offset)).collect()
        };
        let first = 5;
        let all: Vec<_> = (first..first + 8).map(lines).collect();
        for (a, lines_a) in all.iter().enumerate() {
            assert_eq!(lines_a.len(), PART_BITS / 512, "heap {} covers its part", first + a);
            for (b, lines_b) in all.iter().enumerate().skip(a + 1) {
                assert!(lines_a.is_disjoint(lines_b), "heaps {} and {}", first + a, first + b);
            }
        }
    }
}
