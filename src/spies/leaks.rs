//! `spy=leaks`: every live block with its size, the entry point that made it, its thread and
//! its call stack, for the leak report at exit and for [`crate::heap_stats`].
//!
//! An observer ([`Role::Observe`]): it records after each allocation and forgets before each
//! release (the address may be handed out again right after the real free). Its memory —
//! the live-block table, the stack table, per-thread records — comes from [`crate::pool`].
//! Per-thread counters are single-writer (no atomic read-modify-write); live and peak bytes
//! are process-wide atomics, because a peak is only a peak if it is one number.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use crate::live_table::LiveTable;
use crate::spy::{Call, CallScratch, Entry, MallocSpy, Role};
use crate::stacks::Stacks;
use crate::threads::{self, MAX_THREADS};
use crate::unwind::{self, PrevWalk};
use crate::{pool, tls};

/// Deepest stack the option `stack_depth` may ask for.
pub(crate) const MAX_DEPTH: usize = 128;
/// Default `stack_depth`.
pub(crate) const DEFAULT_DEPTH: usize = 32;

// Scratch words (4..7; the guard spy uses 0..3): the record a realloc removed, kept until
// the call's outcome is known.
const S_SIZE_ENTRY: usize = 4;
const S_STACK_TID: usize = 5;
const S_HAD_RECORD: usize = 6;

/// What is known of a live block.
#[derive(Clone, Copy)]
pub(crate) struct Record {
    /// Size in the high 56 bits, entry point in the low 8.
    size_entry: u64,
    pub stack: u32,
    pub tid: u32,
}

impl Record {
    pub(crate) fn size(&self) -> u64 {
        self.size_entry >> 8
    }

    pub(crate) fn entry(&self) -> Entry {
        Entry::from_index(self.size_entry as u8)
    }
}

/// Per-thread state: counters, and the last walk and stack (consecutive allocations mostly
/// share their stack).
struct PerThread {
    allocs: AtomicU64,
    frees: AtomicU64,
    bytes: AtomicU64,
    last_len: usize,
    last_id: u32,
    last: [u64; MAX_DEPTH],
    walk: PrevWalk,
}

/// Totals since the tracker started.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    pub(crate) live: LiveTable<Record>,
    pub(crate) stacks: Stacks,
    depth: usize,
    /// `[*mut PerThread; MAX_THREADS]`, each leased by its thread on first use.
    per_thread: NonNull<AtomicPtr<PerThread>>,
    live_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    /// Allocations that could not be recorded (mallocspy's memory limit).
    untracked: AtomicU64,
}

// SAFETY: per-thread records are written only by the thread owning the slot (counters are
// atomics read by the report); the tables are Sync.
unsafe impl Send for LeakTracker {}
// SAFETY: as above.
unsafe impl Sync for LeakTracker {}

fn is_allocation(entry: Entry) -> bool {
    !matches!(entry, Entry::Free | Entry::MallocUsableSize | Entry::MallocTrim)
}

/// The calling thread's kernel id (cached in its thread state).
fn tid() -> u32 {
    let ts = tls::state();
    let cached = ts.tid.get();
    if cached != 0 {
        return cached;
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
    ts.tid.set(tid);
    tid
}

#[inline(always)]
fn bump(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

impl LeakTracker {
    /// A tracker capturing `depth` frames per block; `None` if its memory cannot be mapped.
    pub(crate) fn new(depth: usize) -> Option<Self> {
        Some(Self {
            live: LiveTable::new(),
            stacks: Stacks::new(),
            depth: depth.clamp(1, MAX_DEPTH),
            per_thread: threads::map_per_thread::<AtomicPtr<PerThread>>()?,
            live_bytes: AtomicU64::new(0),
            peak_bytes: AtomicU64::new(0),
            untracked: AtomicU64::new(0),
        })
    }

    fn slot(&self, index: usize) -> &AtomicPtr<PerThread> {
        debug_assert!(index < MAX_THREADS);
        // SAFETY: index < MAX_THREADS, the array's length; zeroed memory is null pointers.
        unsafe { &*self.per_thread.as_ptr().add(index) }
    }

    /// The calling thread's record (inside a hook every thread has a slot), leased from the
    /// pool the first time.
    #[allow(clippy::mut_from_ref)] // one slot per thread, used by one hook at a time
    fn mine(&self) -> Option<&mut PerThread> {
        let slot = self.slot(threads::current_index()? as usize);
        let mut record = slot.load(Ordering::Acquire);
        if record.is_null() {
            record = pool::lease(core::mem::size_of::<PerThread>())?.as_ptr().cast();
            slot.store(record, Ordering::Release);
        }
        // SAFETY: the record is owned by the calling thread's slot, and the thread is inside a
        // hook, so not re-entering this method; zeroed memory is a valid PerThread (atomics,
        // integers, arrays) and leases are zeroed.
        Some(unsafe { &mut *record })
    }

    fn all_threads(&self) -> impl Iterator<Item = &PerThread> {
        // SAFETY: published records live as long as the tracker; only the counters (atomics)
        // are read.
        (0..threads::high_water()).filter_map(|i| unsafe { self.slot(i).load(Ordering::Acquire).as_ref() })
    }

    /// The id of the calling thread's current stack.
    #[inline]
    fn stack_id(&self, t: &mut PerThread) -> u32 {
        let mut frames = [0u64; MAX_DEPTH];
        let n = unwind::capture(&mut frames[..self.depth], &mut t.walk);
        if n == t.last_len && frames[..n] == t.last[..n] && t.last_id != 0 {
            return t.last_id;
        }
        let id = self.stacks.intern(&frames[..n]);
        t.last[..n].copy_from_slice(&frames[..n]);
        t.last_len = n;
        t.last_id = id;
        id
    }

    fn record(&self, ptr: usize, size: u64, entry: Entry, t: &mut PerThread) {
        let stack = self.stack_id(t);
        let record = Record { size_entry: size << 8 | entry as u64, stack, tid: tid() };
        if stack == 0 || !self.live.insert(ptr, record) {
            self.untracked.fetch_add(1, Ordering::Relaxed);
            return;
        }
        bump(&t.allocs, 1);
        bump(&t.bytes, size);
        let live = self.live_bytes.fetch_add(size, Ordering::Relaxed) + size;
        if live > self.peak_bytes.load(Ordering::Relaxed) {
            self.peak_bytes.fetch_max(live, Ordering::Relaxed);
        }
    }

    fn forget(&self, record: &Record, t: &mut PerThread) {
        bump(&t.frees, 1);
        self.live_bytes.fetch_sub(record.size(), Ordering::Relaxed);
    }

    /// Totals so far (exact when no other thread is allocating).
    pub(crate) fn stats(&self) -> HeapStats {
        let mut s = HeapStats {
            live_blocks: self.live.len() as u64,
            live_bytes: self.live_bytes.load(Ordering::Relaxed),
            peak_bytes: self.peak_bytes.load(Ordering::Relaxed),
            ..HeapStats::default()
        };
        for t in self.all_threads() {
            s.total_allocs += t.allocs.load(Ordering::Relaxed);
            s.total_frees += t.frees.load(Ordering::Relaxed);
            s.total_bytes += t.bytes.load(Ordering::Relaxed);
        }
        s
    }

    /// Allocations that went unrecorded because mallocspy's memory limit was reached.
    pub(crate) fn untracked(&self) -> u64 {
        self.untracked.load(Ordering::Relaxed)
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

    /// Every live block: address and record.
    pub(crate) fn snapshot(&self) -> Vec<(u64, Record)> {
        let mut blocks = Vec::with_capacity(self.live.len() + 64);
        self.live.for_each(|addr, r| blocks.push((addr as u64, r)));
        blocks
    }

    /// Child side of `fork`: the child's thread keeps its slot; other slots' walks are stale
    /// but harmless (each is checked before reuse). Locks held by vanished threads go.
    pub(crate) fn after_fork_child(&self) {
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
        let removed = self.live.remove(ptr as usize);
        if entry == Entry::Free {
            if let (Some(r), Some(t)) = (removed, self.mine()) {
                self.forget(&r, t);
            }
            return;
        }
        // realloc: the outcome decides whether the block was freed.
        CallScratch::set(S_HAD_RECORD, removed.is_some() as u64);
        if let Some(r) = removed {
            CallScratch::set(S_SIZE_ENTRY, r.size_entry);
            CallScratch::set(S_STACK_TID, (r.stack as u64) << 32 | r.tid as u64);
        }
    }

    fn after_call(&self, call: &Call) {
        if !is_allocation(call.entry) {
            return;
        }
        let Some(t) = self.mine() else { return };
        let resized = !call.ptr.is_null();
        let had_record = resized && CallScratch::get(S_HAD_RECORD) != 0;
        let old = had_record.then(|| {
            let st = CallScratch::get(S_STACK_TID);
            Record { size_entry: CallScratch::get(S_SIZE_ENTRY), stack: (st >> 32) as u32, tid: st as u32 }
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

static TRACKER: std::sync::OnceLock<&'static LeakTracker> = std::sync::OnceLock::new();

/// Makes `tracker` the process's leak tracker (for [`crate::heap_stats`] and
/// [`crate::leak_check`]). The first one stays.
pub(crate) fn set_tracker(tracker: &'static LeakTracker) {
    let _ = TRACKER.set(tracker);
}

/// The process's leak tracker, if one was started in this module.
pub(crate) fn tracker() -> Option<&'static LeakTracker> {
    TRACKER.get().copied()
}
