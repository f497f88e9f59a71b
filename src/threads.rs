//! Thread slots: who is inside a spied hook right now, and waiting until nobody is.
//!
//! Two operations must know that no other thread is still running spy code:
//! dropping a revoked spy (its methods may still be executing elsewhere) and `fork` (a lock held
//! by another thread would stay held forever in the child). Both wait for *quiescence*: every
//! thread that was inside a spied hook when the wait began has left it.
//!
//! Each thread that enters a spied hook owns a slot with a sequence number, odd while inside.
//! Entering costs one plain store and a compiler fence: the store-load ordering the waiter
//! needs is supplied by the waiter itself with `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`
//! (the asymmetric fence of userspace RCU), and only on kernels without it does the hook pay
//! a full fence. Slots are single-writer, so spies keep their per-thread counters beside them
//! without atomic read-modify-write.
//!
//! A slot is recycled once its thread has died, which only the kernel can tell: a thread still
//! calls the allocator after its `pthread_key_create` destructors have run (glibc frees its
//! per-thread buffers after them, through the exported `free`), so a slot given back by such a
//! destructor was at once taken again by its own exiting thread, never to be returned: a
//! program that started thousands of threads over its life used as many slots (and spy
//! records). Instead, each slot notes its owner's kernel id, and when no slot is free and the
//! slots in use have doubled since the last look, the dead owners' slots are reclaimed
//! (`tgkill(pid, tid, 0)` says whether a thread lives): a syscall or two per thread started,
//! and at most twice as many slots as threads alive at once, plus [`SWEEP_MIN`]. The key's
//! destructor still tells the spies that their thread is leaving. A thread that finds all
//! [`MAX_THREADS`] slots taken by live threads runs unspied.

use core::ffi::c_void;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering, compiler_fence, fence};

use crate::sync::SpinLock;
use crate::tls::ThreadState;
use crate::{os, pool, tls};

/// How many threads can be inside spied hooks over the process's life at once.
pub const MAX_THREADS: usize = 16384;

/// [`ThreadState::slot`] value of a thread that found no free slot.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// Slots handed out before the first look for dead owners.
const SWEEP_MIN: usize = 64;

#[repr(align(64))]
struct Slot {
    /// Odd while the owning thread is inside a spied hook. Only the owner writes it (keeping
    /// a copy in its `ThreadState::in_flight_seq`), but for the slot of a dead owner
    /// ([`reclaim_dead_owners`]) and the slots of the threads a `fork` left behind.
    seq: AtomicU64,
    /// The owner's kernel thread id; 0 while the slot is free. Written under `SLOTS.lock`.
    tid: AtomicU32,
}

/// `repr(C)`, one line: what every hook's entry reads (`table`, `forking`, `membarrier`)
/// comes first, so that entering a hook costs one line of this module's globals, not three.
#[repr(C, align(64))]
struct Slots {
    /// `[Slot; MAX_THREADS]`, mapped on first use.
    table: AtomicPtr<Slot>,
    /// Forks in progress (the program's, and a forked child's trace writer started from a
    /// hook on another thread, `trace::writer::start_deferred`): while any is, threads
    /// arriving at a hook wait outside.
    forking: AtomicU32,
    /// The process is registered for expedited private membarrier: entering a hook needs
    /// no fence.
    membarrier: AtomicBool,
    /// Stack of free indices below `high_water`: `[u32; MAX_THREADS]`, under `lock`.
    free: AtomicPtr<u32>,
    free_len: AtomicUsize,
    /// Slots ever handed out; quiescence scans this many.
    high_water: AtomicUsize,
    /// The high water at which, when no slot is free, the slots of dead threads are reclaimed
    /// before a new one is handed out. Under `lock`.
    next_sweep: AtomicUsize,
    lock: SpinLock,
    /// The pthread key whose destructor announces a thread's exit, plus one (0: none yet).
    key: AtomicUsize,
}

const _: () = assert!(core::mem::size_of::<Slots>() == 64);

static SLOTS: Slots = Slots {
    table: AtomicPtr::new(core::ptr::null_mut()),
    forking: AtomicU32::new(0),
    membarrier: AtomicBool::new(false),
    free: AtomicPtr::new(core::ptr::null_mut()),
    free_len: AtomicUsize::new(0),
    high_water: AtomicUsize::new(0),
    next_sweep: AtomicUsize::new(SWEEP_MIN),
    lock: SpinLock::new(),
    key: AtomicUsize::new(0),
};

const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

fn membarrier(cmd: libc::c_long) -> bool {
    // SAFETY: membarrier takes plain integers and touches no memory of ours.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_long, 0 as libc::c_long) == 0 }
}

fn register_membarrier() {
    SLOTS.membarrier.store(membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED), Ordering::Release);
}

/// The hook's side of the asymmetric fence (see the module docs): orders the caller's
/// stores before its loads against a [`heavy_fence`] on another thread. A compiler fence
/// where the process is registered for the expedited membarrier, a full fence elsewhere.
#[inline(always)]
fn light_fence() {
    if SLOTS.membarrier.load(Ordering::Relaxed) {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The waiter's side of the asymmetric fence: whatever the caller stored before it, every
/// thread's loads after its own [`light_fence`] see; whatever a thread stored before a
/// `light_fence` whose loads missed the caller's stores, the caller's loads after it see.
fn heavy_fence() {
    fence(Ordering::SeqCst);
    if SLOTS.membarrier.load(Ordering::Acquire) {
        membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED);
    }
    fence(Ordering::SeqCst);
}

fn slot(index: u32) -> &'static Slot {
    let table = SLOTS.table.load(Ordering::Acquire);
    debug_assert!(!table.is_null() && (index as usize) < MAX_THREADS);
    // SAFETY: an index is handed out only after the table was mapped, it is below MAX_THREADS,
    // and the mapping is never released.
    unsafe { &*table.add(index as usize) }
}

/// Maps the slot tables now, before the spies, so that a `max_memory` too small for them is
/// said as too small for the spies: mapped at the first call, after the spies were made, they
/// did not fit under `spy=count:max_memory=3m`, no thread had a slot, and the spy counted no
/// call with only "reached" said (review helper 131). Whether they are mapped.
pub(crate) fn map_tables() -> bool {
    let _guard = SLOTS.lock.lock();
    init_tables()
}

/// Maps the slot tables and creates the exit key, once. Called under `SLOTS.lock`.
fn init_tables() -> bool {
    if !SLOTS.table.load(Ordering::Acquire).is_null() {
        return true;
    }
    let Some(table) = pool::lease(MAX_THREADS * core::mem::size_of::<Slot>()) else { return false };
    let Some(free) = pool::lease(MAX_THREADS * core::mem::size_of::<u32>()) else {
        // SAFETY: `table` was leased just above with this length and never shared.
        unsafe { pool::give_back(table, MAX_THREADS * core::mem::size_of::<Slot>()) };
        return false;
    };
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: `key` is a valid out-pointer; the destructor is an `extern "C"` fn of the right type.
    if unsafe { libc::pthread_key_create(&mut key, Some(announce_thread_exit)) } == 0 {
        SLOTS.key.store(key as usize + 1, Ordering::Relaxed);
    }
    register_membarrier();
    SLOTS.free.store(free.as_ptr().cast(), Ordering::Release);
    SLOTS.table.store(table.as_ptr().cast(), Ordering::Release);
    true
}

/// The calling thread's slot index, acquiring one on first use; `None` when none is free.
///
/// The caller must already have raised [`ThreadState::depth`]: acquiring may call
/// `pthread_setspecific`, which may allocate.
#[inline]
pub(crate) fn current(ts: &ThreadState) -> Option<u32> {
    match ts.slot.get() {
        0 => acquire(ts),
        NO_SLOT => {
            UNSPIED_CALLS.fetch_add(1, Ordering::Relaxed);
            None
        }
        index_plus_one => Some(index_plus_one - 1),
    }
}

/// Calls of threads that got no slot, which went to the real allocator unspied.
static UNSPIED_CALLS: AtomicU64 = AtomicU64::new(0);

/// How many calls went unspied for want of a slot (see [`current`]), for the reports' notes.
pub(crate) fn unspied_calls() -> u64 {
    UNSPIED_CALLS.load(Ordering::Relaxed)
}

/// The calling thread's slot index if it has one (never acquires). Inside a spied hook of
/// this module's interposer it always has one.
#[inline]
pub(crate) fn current_index() -> Option<u32> {
    match tls::state().slot.get() {
        0 | NO_SLOT => None,
        index_plus_one => Some(index_plus_one - 1),
    }
}

#[cold]
fn acquire(ts: &ThreadState) -> Option<u32> {
    debug_assert!(ts.depth.get() != 0);
    let index = {
        let _guard = SLOTS.lock.lock();
        if !init_tables() {
            None
        } else {
            let hw = SLOTS.high_water.load(Ordering::Relaxed);
            let due = hw >= SLOTS.next_sweep.load(Ordering::Relaxed) || hw == MAX_THREADS;
            if SLOTS.free_len.load(Ordering::Relaxed) == 0 && due {
                let live = reclaim_dead_owners();
                SLOTS.next_sweep.store((2 * live).max(SWEEP_MIN), Ordering::Relaxed);
            }
            let index = pop_free().or_else(|| {
                (hw < MAX_THREADS).then(|| {
                    SLOTS.high_water.store(hw + 1, Ordering::Release);
                    hw as u32
                })
            });
            if let Some(index) = index {
                slot(index).tid.store(os::gettid(), Ordering::Relaxed);
            }
            index
        }
    };
    match index {
        Some(index) => {
            ts.slot.set(index + 1);
            // Even: a slot is free only while no hook holds it (see `reclaim_dead_owners`).
            ts.in_flight_seq.set(slot(index).seq.load(Ordering::Relaxed));
            let key = SLOTS.key.load(Ordering::Relaxed);
            if key != 0 {
                // SAFETY: the key was created by init_tables; the value is an integer tag, never
                // dereferenced.
                unsafe {
                    libc::pthread_setspecific((key - 1) as libc::pthread_key_t, (index as usize + 1) as *const c_void)
                };
            }
            Some(index)
        }
        None => {
            ts.slot.set(NO_SLOT);
            None
        }
    }
}

/// Takes a slot off the free list. Under `SLOTS.lock`.
fn pop_free() -> Option<u32> {
    let free_len = SLOTS.free_len.load(Ordering::Relaxed).checked_sub(1)?;
    SLOTS.free_len.store(free_len, Ordering::Relaxed);
    // SAFETY: `free` holds MAX_THREADS entries and free_len < MAX_THREADS; the lock is held.
    Some(unsafe { *SLOTS.free.load(Ordering::Relaxed).add(free_len) })
}

/// Puts the slots whose owners have died on the free list; returns how many slots remain
/// taken. Under `SLOTS.lock`, with the tables mapped.
#[cold]
fn reclaim_dead_owners() -> usize {
    let saved = os::errno();
    let pid = os::getpid();
    let free = SLOTS.free.load(Ordering::Relaxed);
    let mut free_len = SLOTS.free_len.load(Ordering::Relaxed);
    let mut live = 0;
    for index in 0..SLOTS.high_water.load(Ordering::Relaxed) as u32 {
        let slot = slot(index);
        let tid = slot.tid.load(Ordering::Relaxed);
        if tid == 0 {
            continue;
        }
        // SAFETY: signal 0 only checks that thread `tid` of this process exists.
        let gone = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, 0) } != 0 && os::errno() == libc::ESRCH;
        if gone {
            slot.tid.store(0, Ordering::Relaxed);
            // A thread that died inside a hook (pthread_exit from a signal handler) left its
            // mark: no quiescence may wait for it.
            let seq = slot.seq.load(Ordering::Relaxed);
            slot.seq.store(seq + (seq & 1), Ordering::Release);
            // SAFETY: a slot is on the list only while its tid is 0, so free_len < MAX_THREADS.
            unsafe { *free.add(free_len) = index };
            free_len += 1;
        } else {
            live += 1;
        }
    }
    SLOTS.free_len.store(free_len, Ordering::Relaxed);
    os::set_errno(saved);
    live
}

/// Stack pointers of the latest threads to exit, as they left (a ring). glibc keeps an exited
/// thread's stack mapped for a thread to come: the words left on it are stale, and the leak
/// scan must not take them for roots (memcheck calls a block held only there lost).
static EXITED_STACKS: [AtomicU64; EXITED_KEPT] = [const { AtomicU64::new(0) }; EXITED_KEPT];
/// The thread pointers of the same threads, in the same slots: their control blocks, which
/// glibc keeps with their stacks, name their dynamic TLS ([`crate::leaks::dead_tls`]).
static EXITED_THREAD_POINTERS: [AtomicU64; EXITED_KEPT] = [const { AtomicU64::new(0) }; EXITED_KEPT];
static EXITED_NEXT: AtomicUsize = AtomicUsize::new(0);
/// Exited threads remembered: glibc's cache keeps 40 MiB of stacks (five of 8 MiB, 2,560 of
/// 16 KiB), and a thread not yet joined keeps its own.
pub(crate) const EXITED_KEPT: usize = 4096;

/// A stack pointer of each of the latest threads to exit, in order, into `sps`, whose
/// capacity of [`EXITED_KEPT`] it does not go past: a leak check reads them while the other
/// threads are stopped, one of them maybe inside mallocspy's heap.
pub(crate) fn exited_stacks(sps: &mut Vec<u64>) {
    sps.clear();
    let room = sps.capacity();
    sps.extend(EXITED_STACKS.iter().map(|sp| sp.load(Ordering::Relaxed)).filter(|&sp| sp != 0).take(room));
    sps.sort_unstable();
}

/// The thread pointer of each of the latest threads to exit, as [`exited_stacks`] gives
/// their stack pointers (sorted, within `tps`'s capacity).
pub(crate) fn exited_thread_pointers(tps: &mut Vec<u64>) {
    tps.clear();
    let room = tps.capacity();
    tps.extend(EXITED_THREAD_POINTERS.iter().map(|tp| tp.load(Ordering::Relaxed)).filter(|&tp| tp != 0).take(room));
    tps.sort_unstable();
}

/// A function told of each thread's exit (its slot index).
static EXIT_HOOK: core::sync::atomic::AtomicPtr<()> = core::sync::atomic::AtomicPtr::new(core::ptr::null_mut());

/// Sets the function told of thread exits (the ticks spy's thread events).
pub(crate) fn set_exit_hook(hook: fn(u32)) {
    EXIT_HOOK.store(hook as *mut (), Ordering::Release);
}

/// Tells the spies that the thread is leaving. Runs as a pthread key destructor. The slot stays
/// the thread's: it may still call the allocator (glibc frees its per-thread buffers after
/// the destructors); [`reclaim_dead_owners`] frees it once the thread has died.
extern "C" fn announce_thread_exit(value: *mut c_void) {
    let index = (value as usize).wrapping_sub(1) as u32;
    let ts = tls::state();
    if ts.slot.get() != index + 1 || ts.depth.get() != 0 {
        return;
    }
    let at = EXITED_NEXT.fetch_add(1, Ordering::Relaxed) % EXITED_KEPT;
    EXITED_STACKS[at].store(crate::unwind::current_sp(), Ordering::Relaxed);
    EXITED_THREAD_POINTERS[at].store(os::thread_pointer(), Ordering::Relaxed);
    let hook = EXIT_HOOK.load(Ordering::Acquire);
    if !hook.is_null() {
        // SAFETY: only `set_exit_hook` stores here, always a `fn(u32)`.
        let hook: fn(u32) = unsafe { core::mem::transmute::<*mut (), fn(u32)>(hook) };
        hook(index);
    }
}

/// Proof that the calling thread is inside a spied hook, visible to [`quiesce`]; leaving
/// happens on drop.
pub(crate) struct InFlight {
    slot: &'static Slot,
    ts: &'static ThreadState,
}

impl InFlight {
    /// Marks the calling thread (owner of `index`, whose state is `ts`) as inside a spied
    /// hook, first waiting out a `fork` in progress.
    #[inline]
    pub(crate) fn enter(index: u32, ts: &'static ThreadState) -> Self {
        let slot = slot(index);
        loop {
            let seq = ts.in_flight_seq.get() | 1;
            ts.in_flight_seq.set(seq);
            slot.seq.store(seq, Ordering::Relaxed);
            light_fence();
            if SLOTS.forking.load(Ordering::Relaxed) == 0 {
                return Self { slot, ts };
            }
            ts.in_flight_seq.set(seq + 1);
            slot.seq.store(seq + 1, Ordering::Release);
            while SLOTS.forking.load(Ordering::Acquire) != 0 {
                os::yield_now();
            }
        }
    }
}

/// Ends the calling thread's mark of a spied hook in progress, if it has one: for a hook that
/// a `siglongjmp` out of a signal handler abandoned, whose [`InFlight`] is never dropped
/// (a `fork` would wait for it for ever).
pub(crate) fn leave_abandoned_hook(ts: &ThreadState) {
    let seq = ts.in_flight_seq.get();
    if seq & 1 == 1 && (1..NO_SLOT).contains(&ts.slot.get()) {
        ts.in_flight_seq.set(seq + 1);
        slot(ts.slot.get() - 1).seq.store(seq + 1, Ordering::Release);
    }
}

impl Drop for InFlight {
    #[inline]
    fn drop(&mut self) {
        let seq = self.ts.in_flight_seq.get() + 1;
        self.ts.in_flight_seq.set(seq);
        self.slot.seq.store(seq, Ordering::Release);
    }
}

/// Waits until every thread that was inside a spied hook when the call began has left it.
///
/// `except` is the caller's own slot when the caller is itself inside a hook. Whatever the
/// caller stored before the call is visible to every hook entered after it returns.
///
/// Two threads that wait here from inside hooks at the same time wait for each other forever,
/// and skipping a waiting thread is not sound (its hook may be inside the very spy being
/// dropped): the registry lets only one thread at a time wait from inside a hook (see
/// [`crate::registry::Registry::retire_if_unused`]); `fork` from inside a spy method is the
/// one case left out.
pub(crate) fn quiesce(except: Option<u32>) {
    heavy_fence();
    if SLOTS.table.load(Ordering::Acquire).is_null() {
        return;
    }
    let high_water = SLOTS.high_water.load(Ordering::Acquire);
    for index in 0..high_water as u32 {
        if Some(index) == except {
            continue;
        }
        let slot = slot(index);
        let seq = slot.seq.load(Ordering::Acquire);
        if seq & 1 == 1 {
            let mut spins = 0u32;
            while slot.seq.load(Ordering::Acquire) == seq {
                spins += 1;
                if spins < 128 {
                    core::hint::spin_loop();
                } else {
                    os::yield_now();
                }
            }
        }
    }
}

/// `pthread_atfork` prepare: keep every other thread out of the hooks until the fork is done.
pub(crate) fn fork_prepare() {
    SLOTS.forking.fetch_add(1, Ordering::SeqCst);
    quiesce(current_index());
}

/// `pthread_atfork` parent: let the threads back in.
pub(crate) fn fork_parent() {
    SLOTS.forking.fetch_sub(1, Ordering::SeqCst);
}

/// `pthread_atfork` child: only the calling thread survived; every other slot is free again.
pub(crate) fn fork_child() {
    SLOTS.lock.force_unlock();
    let free = SLOTS.free.load(Ordering::Relaxed);
    if !free.is_null() {
        let mine = tls::state().slot.get();
        let high_water = SLOTS.high_water.load(Ordering::Relaxed);
        let mut len = 0;
        for index in (0..high_water as u32).rev() {
            if index + 1 == mine {
                // The thread lives on under a new id.
                slot(index).tid.store(os::gettid(), Ordering::Relaxed);
            } else {
                slot(index).seq.store(0, Ordering::Relaxed);
                slot(index).tid.store(0, Ordering::Relaxed);
                // SAFETY: len < high_water <= MAX_THREADS; no other thread exists.
                unsafe { *free.add(len) = index };
                len += 1;
            }
        }
        SLOTS.free_len.store(len, Ordering::Relaxed);
    }
    // Registration belongs to the address space: a new one needs its own.
    if SLOTS.membarrier.load(Ordering::Relaxed) {
        register_membarrier();
    }
    SLOTS.forking.store(0, Ordering::SeqCst);
}

/// Number of slots ever handed out (the range a per-thread aggregate must sum over).
pub(crate) fn high_water() -> usize {
    SLOTS.high_water.load(Ordering::Acquire)
}

/// Leases `MAX_THREADS` zeroed per-thread records of `T` (a spy's single-writer counters),
/// indexed by slot. Pages are touched only by the threads that use them.
pub(crate) fn map_per_thread<T>() -> Option<NonNull<T>> {
    pool::lease(MAX_THREADS * core::mem::size_of::<T>()).map(NonNull::cast)
}
