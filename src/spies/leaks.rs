//! `spy=leaks`: every live block with its size, the entry point that made it, its thread and
//! its call stack, for the leak report at exit and for [`crate::heap_stats`].
//!
//! An observer ([`Role::Observe`]): it records after each allocation. A free is noted, not
//! applied: the block's line of the live table is prefetched and its address queued in the
//! thread's [`PENDING`] ring, and the record is removed a few frees later, when the line has
//! arrived (the removal is the cache miss that dominated a free). The address may be handed
//! out again before that: an allocation that finds its address still recorded takes the old
//! record out itself and withdraws the queued free (under the same shard lock), and reports
//! ([`LeakTracker::stats`], the leak check) first apply every queued free. Its memory —
//! the live-block table, the stack table, per-thread records — comes from [`crate::pool`].
//! Per-thread counters are single-writer (no atomic read-modify-write). Live bytes are kept
//! per thread too and folded into one process-wide figure every [`LIVE_FLUSH`] bytes, so the
//! threads do not fight over one cache line on every call; the peak compares that figure plus
//! the calling thread's unfolded part, which makes it exact in a single-threaded program and
//! within `threads x LIVE_FLUSH` bytes otherwise.

use core::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};

use crate::live_table::LiveTable;
use crate::spies::handler_frees::{HandlerFrees, Push};
use crate::spy::{Call, CallScratch, Entry, MallocSpy, Role};
use crate::stacks::{Capture, Stacks};
use crate::sync::SelfHeld;
use crate::thread_records::{Owned, ThreadRecords, Zeroed, bump};
use crate::threads;
use crate::tls;

pub(crate) use crate::stacks::{DEFAULT_DEPTH, MAX_DEPTH};
/// Live bytes a thread keeps to itself before adding them to the process-wide figure.
const LIVE_FLUSH: i64 = 256 << 10;
/// Frees a thread keeps queued before removing their records.
const PENDING: usize = 4;

// Scratch words (8..10; the guard spy, which runs beside the tracker under
// `spy=guard,leaks`, uses 0..7): the record a realloc removed, kept until the call's outcome
// is known. (They were 4..6 once, the guard's too: each realloc of such a run went
// uncounted as a free, and the guard read the record's serial as its entry point.)
const S_SIZE_ENTRY: usize = 8;
const S_STACK_SERIAL: usize = 9;
const S_HAD_RECORD: usize = 10;

/// What is known of a live block.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    /// Size in the high 56 bits, entry point in the low 8.
    size_entry: u64,
    pub stack: u32,
    /// Tells this allocation from another at the same address, by the same call site, of the
    /// same size: the leak check takes a block whose record is still the one of its snapshot
    /// for the block it scanned (see `leaks::check`). Each thread counts its allocations from
    /// a start its id picks ([`serial`]).
    serial: u32,
}

/// The serial of the `count`th allocation of thread `tid`. One thread's never repeat within
/// 2^32 allocations; two threads' meet where their counts differ by the difference of their
/// starts, which the hash spreads (a few pairs of thread ids among millions lie a few hundred
/// apart), and a block taken for another then also had the same address, call and size.
///
/// Without it, a thread loop that freed a page and got it back, from the same call with the
/// same size, made records equal to the bit; freed while the exit's check ran, such a block
/// was called lost (CI, 2026-12-05, twice; the log of addresses freed during a check this
/// replaces overflowed, or missed a free in flight: review helper 69).
fn serial(tid: u32, count: u32) -> u32 {
    tid.wrapping_mul(0x9E37_79B9).wrapping_add(count)
}

impl Record {
    pub(crate) fn size(&self) -> u64 {
        self.size_entry >> 8
    }

    pub(crate) fn entry(&self) -> Entry {
        Entry::from_index(self.size_entry as u8)
    }
}

/// Per-thread state: what other threads read (counters, queued frees), and what only the
/// owning thread touches, inside its hooks.
struct PerThread {
    allocs: AtomicU64,
    frees: AtomicU64,
    bytes: AtomicU64,
    /// Net live bytes not yet added to `LeakTracker::live_bytes` (below `LIVE_FLUSH`).
    unflushed: AtomicI64,
    /// Addresses freed (or about to be) whose records are still in the table; 0 when empty.
    /// Whoever swaps one to 0, under the lock of its shard, removes the record.
    pending: [AtomicUsize; PENDING],
    own: Owned<Own>,
}

/// The owning thread's part of [`PerThread`].
struct Own {
    /// The oldest entry of the `pending` ring, where the next free goes.
    pending_next: usize,
    /// Allocations recorded by the threads of this record (see [`Record::serial`]).
    allocations: u32,
    capture: Capture,
}

// SAFETY: atomics, integers, arrays of them and an `Owned` (an `UnsafeCell`) of such: zero
// is valid.
unsafe impl Zeroed for PerThread {}

/// Totals since the tracker started.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeapStats {
    /// Blocks allocated and not yet freed.
    pub live_blocks: u64,
    /// Bytes in them (as asked for).
    pub live_bytes: u64,
    /// Largest `live_bytes` so far.
    pub peak_bytes: u64,
    /// Allocating calls that succeeded (a `realloc` counts as one allocation and one free).
    pub total_allocs: u64,
    /// Blocks freed.
    pub total_frees: u64,
    /// Bytes allocated in all.
    pub total_bytes: u64,
}

/// The leak tracker's own memory, all of it from mallocspy's pool (never the watched heap).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TrackerMemory {
    /// Live blocks recorded.
    pub live_blocks: u64,
    /// Bytes of the live-block table (key and record per block, the table at most half full).
    pub table_bytes: u64,
    /// Distinct stacks interned.
    pub stacks: u64,
    /// Bytes holding them (frames and index).
    pub stack_bytes: u64,
    /// Bytes mallocspy has mapped in all (tables, stacks, per-thread records, unwind cache).
    pub pool_bytes: u64,
}

/// The tracking spy.
pub(crate) struct LeakTracker {
    pub(crate) live: &'static LiveTable<Record>,
    pub(crate) stacks: Stacks,
    depth: usize,
    /// `[*mut PerThread; MAX_THREADS]`, each leased by its thread on first use.
    per_thread: ThreadRecords<PerThread>,
    /// Live bytes, but for each thread's `unflushed` part.
    live_bytes: AtomicI64,
    peak_bytes: AtomicU64,
    /// Frees applied by [`LeakTracker::apply_all_pending`] (the others count per thread).
    applied_frees: AtomicU64,
    /// Allocations that could not be recorded (mallocspy's memory limit).
    untracked: AtomicU64,
    /// Frees by signal handlers that could not remove their blocks' records at once
    /// ([`LeakTracker::free_in_handler`]).
    handler_frees: HandlerFrees,
    /// Such frees that found the queue full: their records stayed, blocks the report may
    /// call lost.
    unfollowed_frees: AtomicU64,
    /// Allocations made before the tracker was registered, and their bytes (the live ones
    /// are adopted: [`LeakTracker::adopt`]).
    adopted_allocs: AtomicU64,
    adopted_bytes: AtomicU64,
}

// SAFETY: per-thread records are written only by the thread owning the slot (counters are
// atomics read by the report); the tables are Sync.
unsafe impl Send for LeakTracker {}
// SAFETY: as above.
unsafe impl Sync for LeakTracker {}

fn is_allocation(entry: Entry) -> bool {
    !(entry.only_releases() || matches!(entry, Entry::MallocUsableSize | Entry::MallocTrim))
}

impl LeakTracker {
    /// A tracker capturing `depth` frames per block; `None` if its memory cannot be mapped.
    pub(crate) fn new(depth: usize) -> Option<Self> {
        crate::leaks::roots::warm_up();
        crate::leaks::kept::keep();
        Some(Self {
            live: LiveTable::leased()?,
            stacks: Stacks::new()?,
            depth: depth.clamp(1, MAX_DEPTH),
            per_thread: ThreadRecords::new()?,
            live_bytes: AtomicI64::new(0),
            peak_bytes: AtomicU64::new(0),
            applied_frees: AtomicU64::new(0),
            untracked: AtomicU64::new(0),
            handler_frees: HandlerFrees::new()?,
            unfollowed_frees: AtomicU64::new(0),
            adopted_allocs: AtomicU64::new(0),
            adopted_bytes: AtomicU64::new(0),
        })
    }

    /// Records the blocks allocated before any spy was registered and still live (see
    /// `early.rs`), each with a stack of one frame: where its allocation returned to.
    pub(crate) fn adopt(&self, live: &crate::early::Live) {
        live.for_each(|addr, size, entry, caller| {
            let frames = [caller];
            let stack = self.stacks.intern(crate::stacks::hash(&frames), &frames);
            let record = Record { size_entry: size << 8 | entry as u64, stack, serial: 0 };
            if stack != 0 && self.live.insert(addr as usize, record) {
                self.live_bytes.fetch_add(size as i64, Ordering::Relaxed);
            } else {
                self.untracked.fetch_add(1, Ordering::Relaxed);
            }
        });
        let (allocs, bytes, frees) = live.totals();
        self.adopted_allocs.fetch_add(allocs, Ordering::Relaxed);
        self.adopted_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.applied_frees.fetch_add(frees, Ordering::Relaxed);
        self.untracked.fetch_add(live.missed() as u64, Ordering::Relaxed);
        self.peak_bytes.fetch_max(self.live_bytes.load(Ordering::Relaxed).max(0) as u64, Ordering::Relaxed);
    }

    /// The calling thread's record (inside a hook every thread has a slot), leased from the
    /// pool the first time.
    fn mine(&self) -> Option<&PerThread> {
        self.per_thread.get_or_lease(threads::current_index()?)
    }

    fn all_threads(&self) -> impl Iterator<Item = &PerThread> {
        self.per_thread.iter()
    }

    /// The id of the calling thread's current stack.
    #[inline]
    fn stack_id(&self, t: &PerThread) -> u32 {
        // SAFETY: `t` is the calling thread's record (from `mine`), inside its hook.
        unsafe { t.own.get() }.capture.stack_id(self.depth, &self.stacks)
    }

    fn record(&self, ptr: usize, size: u64, entry: Entry, t: &PerThread) {
        // The table's line for `ptr` is likely out of cache: fetch it while the stack is walked.
        self.live.prefetch(ptr);
        let stack = self.stack_id(t);
        let serial = {
            // SAFETY: `t` is the calling thread's record (from `mine`), inside its hook.
            let own = unsafe { t.own.get() };
            own.allocations = own.allocations.wrapping_add(1);
            serial(tls::tid(), own.allocations)
        };
        let record = Record { size_entry: size << 8 | entry as u64, stack, serial };
        // A free of this address queued by this thread must not remove the record made now.
        // It is looked for even when the address is not recorded: the block freed may have
        // been allocated before tracking began, and allocators hand a thread the block it
        // freed last.
        let withdrawn = Self::withdraw_queued(t, ptr) | self.handler_frees.withdraw(ptr);
        // The address is still recorded when its free is queued (or went unseen): that block
        // is gone. Its free may be queued by another thread.
        let mut replaced = None;
        let inserted = stack != 0
            && self.live.insert_with(ptr, record, |old| {
                if !withdrawn {
                    self.withdraw_elsewhere(ptr, t);
                }
                replaced = Some(old);
            });
        if let Some(old) = replaced {
            self.forget(&old, t);
        }
        if !inserted {
            self.untracked.fetch_add(1, Ordering::Relaxed);
            return;
        }
        bump(&t.allocs, 1);
        bump(&t.bytes, size);
        let mut live = self.add_live(t, size as i64);
        if live > self.peak_bytes.load(Ordering::Relaxed) {
            // A new peak, unless this thread's queued frees bring it back down.
            for slot in &t.pending {
                let ptr = slot.load(Ordering::Relaxed);
                if let Some(r) = (ptr != 0).then(|| self.apply_pending(slot, ptr)).flatten() {
                    self.forget(&r, t);
                }
            }
            live = self.add_live(t, 0);
            // Written only when it is one: in a steady loop of frees and allocations the queued
            // frees brought it back down each time, and the write on every allocation made
            // threads take the tracker's line from one another (a fifth of a call's time with
            // two threads).
            if live > self.peak_bytes.load(Ordering::Relaxed) {
                self.peak_bytes.fetch_max(live, Ordering::Relaxed);
            }
        }
    }

    fn forget(&self, record: &Record, t: &PerThread) {
        bump(&t.frees, 1);
        self.add_live(t, -(record.size() as i64));
    }

    /// Adds `delta` to the calling thread's live bytes; returns the process's live bytes as
    /// this thread sees them.
    #[inline(always)]
    fn add_live(&self, t: &PerThread, delta: i64) -> u64 {
        let mine = t.unflushed.load(Ordering::Relaxed) + delta;
        let global = if mine.abs() >= LIVE_FLUSH {
            t.unflushed.store(0, Ordering::Relaxed);
            self.live_bytes.fetch_add(mine, Ordering::Relaxed) + mine
        } else {
            t.unflushed.store(mine, Ordering::Relaxed);
            self.live_bytes.load(Ordering::Relaxed) + mine
        };
        global.max(0) as u64
    }

    /// Queues the free of `ptr`, applying the oldest queued one.
    fn free_later(&self, ptr: usize, t: &PerThread) {
        self.live.prefetch(ptr);
        // SAFETY: `t` is the calling thread's record (from `mine`), inside its hook.
        let own = unsafe { t.own.get() };
        let i = own.pending_next;
        own.pending_next = (i + 1) % PENDING;
        let oldest = t.pending[i].load(Ordering::Relaxed);
        if let Some(r) = (oldest != 0).then(|| self.apply_pending(&t.pending[i], oldest)).flatten() {
            self.forget(&r, t);
        }
        // Stored before the real free, so an allocation that gets `ptr` back sees it.
        t.pending[i].store(ptr, Ordering::Release);
        for (slot, queued) in self.handler_frees.queued() {
            if let Some(r) = self.apply_handler_free(slot, queued) {
                self.forget(&r, t);
            }
        }
    }

    /// Puts back a record [`Self::free_now`] took for a tick callback's `realloc` that failed.
    fn restore_unseen(&self, ptr: usize, r: Record) {
        self.applied_frees.fetch_sub(1, Ordering::Relaxed);
        self.live_bytes.fetch_add(r.size() as i64, Ordering::Relaxed);
        self.live.insert(ptr, r);
    }

    /// The free of `ptr` applied at once, with no queue: by a thread without a record
    /// (`max_memory` was reached), or by a tick callback ([`released_unseen`]). Ignored, the
    /// block's record outlived it, a leak in the report, and the allocation the guard named for
    /// the next block at its address (review helper 112). The record taken, if there was one.
    fn free_now(&self, ptr: usize) -> Option<Record> {
        let r = self.remove_untracked(ptr)?;
        self.count_applied(&r);
        Some(r)
    }

    /// Counts the free of `r`'s block, applied with no queue, straight into the process-wide
    /// figures, as `apply_all_pending` does.
    fn count_applied(&self, r: &Record) {
        self.applied_frees.fetch_add(1, Ordering::Relaxed);
        self.live_bytes.fetch_sub(r.size() as i64, Ordering::Relaxed);
    }

    /// The free of `ptr` by a signal handler that interrupted a hook of the calling thread,
    /// applied at once as [`Self::free_now`] does: the hook may be anywhere in the tracker,
    /// and the removal touches only `ptr`'s shard, under its lock, and atomics. Unless the
    /// hook holds that lock (waiting for it would never end): then it is queued in
    /// [`HandlerFrees`] (before the real free, as [`Self::free_later`] queues), for the next
    /// free of any thread; with the queue full the record stays, counted for the report's note.
    /// Left to the hook, every such record made a false leak (`handler_frees.c`: about 300 of
    /// the 400 blocks a handler freed were reported definitely lost).
    pub(crate) fn free_in_handler(&'static self, ptr: usize) -> Option<Unseen> {
        match self.live.try_remove_if(ptr, || self.withdraw_everywhere(ptr)) {
            Ok(r) => {
                let r = r?;
                self.count_applied(&r);
                Some(Unseen::Taken(ptr, r))
            }
            Err(SelfHeld) => match self.handler_frees.push(ptr) {
                Push::Queued(slot) => Some(Unseen::Queued(slot, ptr)),
                // Nothing for a failed `realloc` to take back: the record the queued free
                // removes is not the live block's.
                Push::AlreadyQueued => None,
                Push::Full => {
                    self.unfollowed_frees.fetch_add(1, Ordering::Relaxed);
                    None
                }
            },
        }
    }

    /// Removes the record of `ptr` for a thread without a record, taking back any free of
    /// `ptr` another thread queued: such a free was of the block this record is for, which
    /// came back to the untracked thread unrecorded; left queued, it would later remove the
    /// record of the next block at `ptr` (review helper 113). Under the shard's lock, as every
    /// claim of a queued free. Not for tracked threads: their new records take such frees back
    /// ([`LeakTracker::withdraw_elsewhere`]), and this reads every thread's queue.
    fn remove_untracked(&self, ptr: usize) -> Option<Record> {
        self.live.remove_if(ptr, || self.withdraw_everywhere(ptr))
    }

    /// Takes back every queued free of `ptr`, as the claim of a removal under `ptr`'s shard
    /// lock (always granted).
    fn withdraw_everywhere(&self, ptr: usize) -> bool {
        self.all_threads().for_each(|t| {
            Self::withdraw_queued(t, ptr);
        });
        self.handler_frees.withdraw(ptr);
        true
    }

    /// Removes the record of `ptr`, queued in `slot`, unless someone else claimed it first.
    fn apply_pending(&self, slot: &AtomicUsize, ptr: usize) -> Option<Record> {
        let claim = || slot.compare_exchange(ptr, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok();
        self.live.remove_if(ptr, claim)
    }

    /// Removes the record of `ptr`, queued by a signal handler in `slot`, unless someone else
    /// claimed it first.
    fn apply_handler_free(&self, slot: &AtomicUsize, ptr: usize) -> Option<Record> {
        self.live.remove_if(ptr, || self.handler_frees.claim(slot, ptr))
    }

    /// Takes back the frees of `ptr` queued in `t`'s queue; whether there was one.
    ///
    /// An allocation of an address withdraws its queued frees before it records the new block,
    /// so one free of `ptr` is queued, unless the address was given out again unseen and freed
    /// again (inside a hook, by a signal handler): all go. Plain loads find them; only a match is claimed with a
    /// read-modify-write, so the other threads' queues, which their owners write on every
    /// free, are read and not made to bounce (with one locked compare-exchange per entry of
    /// every thread, python3 running 4 threads at a time spent 70% of its time here once
    /// 16,000 threads had come and gone).
    fn withdraw_queued(t: &PerThread, ptr: usize) -> bool {
        let claimed = |slot: &&AtomicUsize| {
            slot.load(Ordering::Relaxed) == ptr
                && slot.compare_exchange(ptr, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        };
        t.pending.iter().filter(claimed).count() > 0
    }

    /// Takes back the frees of `ptr` queued by threads other than `mine`, and by signal
    /// handlers. Called under the lock of `ptr`'s shard, which every claim of a queued `ptr`
    /// also holds.
    fn withdraw_elsewhere(&self, ptr: usize, mine: &PerThread) {
        self.all_threads().filter(|other| !core::ptr::eq(*other, mine)).for_each(|other| {
            Self::withdraw_queued(other, ptr);
        });
        self.handler_frees.withdraw(ptr);
    }

    /// Applies every thread's queued frees (for a report: the records of freed blocks go).
    pub(crate) fn apply_all_pending(&self) {
        let (mut frees, mut bytes) = (0, 0);
        for other in self.all_threads() {
            for slot in &other.pending {
                let ptr = slot.load(Ordering::Acquire);
                if let Some(r) = (ptr != 0).then(|| self.apply_pending(slot, ptr)).flatten() {
                    frees += 1;
                    bytes += r.size() as i64;
                }
            }
        }
        for (slot, ptr) in self.handler_frees.queued() {
            if let Some(r) = self.apply_handler_free(slot, ptr) {
                frees += 1;
                bytes += r.size() as i64;
            }
        }
        // Straight into the process-wide figures: the caller may have no thread record.
        self.applied_frees.fetch_add(frees, Ordering::Relaxed);
        self.live_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Totals so far (exact when no other thread is allocating).
    pub(crate) fn stats(&self) -> HeapStats {
        self.apply_all_pending();
        let mut s = HeapStats {
            live_blocks: self.live.len() as u64,
            live_bytes: 0,
            peak_bytes: self.peak_bytes.load(Ordering::Relaxed),
            total_frees: self.applied_frees.load(Ordering::Relaxed),
            total_allocs: self.adopted_allocs.load(Ordering::Relaxed),
            total_bytes: self.adopted_bytes.load(Ordering::Relaxed),
        };
        let mut live = self.live_bytes.load(Ordering::Relaxed);
        for t in self.all_threads() {
            live += t.unflushed.load(Ordering::Relaxed);
            s.total_allocs += t.allocs.load(Ordering::Relaxed);
            s.total_frees += t.frees.load(Ordering::Relaxed);
            s.total_bytes += t.bytes.load(Ordering::Relaxed);
        }
        s.live_bytes = live.max(0) as u64;
        s.peak_bytes = s.peak_bytes.max(s.live_bytes);
        s
    }

    /// Allocations that went unrecorded because mallocspy's memory limit was reached.
    pub(crate) fn untracked(&self) -> u64 {
        self.untracked.load(Ordering::Relaxed)
    }

    /// Frees by signal handlers whose records stayed (the handlers' queue was full).
    pub(crate) fn unfollowed_frees(&self) -> u64 {
        self.unfollowed_frees.load(Ordering::Relaxed)
    }

    /// What the tracker's own memory holds.
    pub(crate) fn memory(&self) -> TrackerMemory {
        let (pool_mapped, _) = crate::pool::usage();
        TrackerMemory {
            live_blocks: self.live.len() as u64,
            table_bytes: self.live.memory_bytes() as u64,
            stacks: self.stacks.count() as u64,
            stack_bytes: self.stacks.memory_bytes() as u64,
            pool_bytes: pool_mapped as u64,
        }
    }

    /// The size and the stack's frames of the live block at `ptr`, if it is tracked.
    pub(crate) fn allocation(&'static self, ptr: usize) -> Option<(u64, &'static [u64])> {
        let record = self.live.get(ptr)?;
        Some((record.size(), self.stacks.frames(record.stack)))
    }

    /// Every live block: address and record.
    pub(crate) fn snapshot(&self) -> Vec<(u64, Record)> {
        self.apply_all_pending();
        let mut blocks = Vec::with_capacity(self.live.len() + 64);
        self.live.for_each(|addr, r| blocks.push((addr as u64, r)));
        blocks
    }

    /// Child side of `fork`: the child's thread keeps its slot; other slots' walks are stale
    /// but harmless (each is checked before reuse). Locks held by vanished threads go.
    pub(crate) fn after_fork_child(&self) {
        crate::leaks::after_fork_child();
        self.live.force_unlock();
        self.stacks.force_unlock();
        tls::state().tid.set(0);
    }
}

impl MallocSpy for LeakTracker {
    fn role(&self) -> Role {
        Role::Observe
    }

    fn before_release(&self, entry: Entry, ptr: *mut core::ffi::c_void, _spied: bool) {
        crate::leaks::wait_while_a_check_starts();
        if entry.only_releases() {
            match self.mine() {
                Some(t) => self.free_later(ptr as usize, t),
                None => {
                    self.free_now(ptr as usize);
                }
            }
            return;
        }
        let removed = match self.mine() {
            Some(_) => self.live.remove(ptr as usize),
            None => self.remove_untracked(ptr as usize),
        };
        // realloc: the outcome decides whether the block was freed.
        CallScratch::set(S_HAD_RECORD, removed.is_some() as u64);
        if let Some(r) = removed {
            CallScratch::set(S_SIZE_ENTRY, r.size_entry);
            CallScratch::set(S_STACK_SERIAL, (r.stack as u64) << 32 | r.serial as u64);
        }
    }

    fn after_call(&self, call: &Call) {
        if !is_allocation(call.entry) {
            return;
        }
        crate::leaks::wait_while_a_check_starts();
        let Some(t) = self.mine() else {
            // The thread got no record (max_memory was reached): said in the report's note.
            if !call.failed && !call.result.is_null() {
                self.untracked.fetch_add(1, Ordering::Relaxed);
            }
            return;
        };
        let resized = !call.ptr.is_null();
        let had_record = resized && CallScratch::get(S_HAD_RECORD) != 0;
        let old = had_record.then(|| {
            let st = CallScratch::get(S_STACK_SERIAL);
            Record { size_entry: CallScratch::get(S_SIZE_ENTRY), stack: (st >> 32) as u32, serial: st as u32 }
        });
        if call.failed {
            // The old block is still the caller's.
            if let Some(r) = old {
                self.live.insert(call.ptr as usize, r);
            }
            return;
        }
        if let Some(r) = old {
            self.forget(&r, t);
        }
        if !call.result.is_null() {
            self.record(call.result as usize, call.size as u64, call.entry, t);
        }
    }
}

/// The process's leak tracker: a `&'static LeakTracker`, or null.
static TRACKER: core::sync::atomic::AtomicPtr<LeakTracker> = core::sync::atomic::AtomicPtr::new(core::ptr::null_mut());

/// Makes `tracker` the process's leak tracker (for [`crate::heap_stats`] and
/// [`crate::leak_check`]): the newest one started.
pub(crate) fn set_tracker(tracker: &'static LeakTracker) {
    TRACKER.store((tracker as *const LeakTracker).cast_mut(), Ordering::Release);
}

/// A block freed or moved where no spy code ran, by a tick callback (program code the ticks spy
/// runs inside the allocator) or outside any hook (a nearly full alternate signal stack, a
/// thread without a slot): its record goes now, and its free counts. Else the record outlived
/// the block: a callback's `realloc` of a block made the block's first `malloc` a definite
/// leak, its `free`s went uncounted (`callback_frees.c` under `spy=ticks,leaks`). From a
/// signal handler that interrupted a hook ([`crate::dispatch::following_unseen`]), which may
/// hold the lock the removal takes, only if it does not ([`LeakTracker::free_in_handler`]).
/// Returns what a failed `realloc` puts back ([`restore_unseen`]): a `realloc` there takes the
/// record before the real call, as once the block has moved its address may be another
/// thread's new block (a handler's failed one does not get it back: its block goes untracked).
#[inline]
pub(crate) fn released_unseen(ptr: usize) -> Option<Unseen> {
    if ptr == 0 {
        return None;
    }
    let t = tracker()?;
    match crate::dispatch::following_unseen(|| t.free_now(ptr)) {
        Some(taken) => Some(Unseen::Taken(ptr, taken?)),
        // A thread in seccomp's strict mode: its spinning lock's wait makes a system call that
        // kills it (review helper 127); its blocks go untracked, as its allocations do.
        None if tls::state().depth.get() == tls::UNSPIED => None,
        None => t.free_in_handler(ptr),
    }
}

/// What [`released_unseen`] did with a block's record.
pub(crate) enum Unseen {
    /// Took it out of the table.
    Taken(usize, Record),
    /// Queued its removal in [`HandlerFrees`].
    Queued(&'static AtomicUsize, usize),
}

/// Puts back the record a failed `realloc` took, or withdraws the removal it queued
/// ([`released_unseen`]).
pub(crate) fn restore_unseen(taken: Option<Unseen>) {
    match (taken, tracker()) {
        (Some(Unseen::Taken(ptr, r)), Some(t)) => {
            // Where `released_unseen` took it: the same answer (a signal handler's stays
            // taken, its block untracked from then on).
            crate::dispatch::following_unseen(|| t.restore_unseen(ptr, r));
        }
        (Some(Unseen::Queued(slot, ptr)), Some(t)) => {
            // The block lives on, and its record, unless a free applied the queue meanwhile.
            t.handler_frees.claim(slot, ptr);
        }
        _ => {}
    }
}

/// The process's leak tracker, if one was started in this module.
pub(crate) fn tracker() -> Option<&'static LeakTracker> {
    // SAFETY: only `&'static` trackers are stored.
    unsafe { TRACKER.load(Ordering::Acquire).as_ref() }
}
