//! Per-thread state of the hook path, in initial-exec thread-local storage.
//!
//! Why not `thread_local!`: in a shared object it compiles to global-dynamic TLS, whose
//! `__tls_get_addr` may call `malloc` (glibc >= 2.39 does so in more cases), which recurses into
//! the hook forever (koute/bytehound#131, scylladb/seastar#2247). The glibc manual requires a
//! malloc replacement to use initial-exec TLS. Stable Rust cannot ask for that model, so the block
//! is declared in `.tbss` with `global_asm!` and addressed through its `@GOTTPOFF` slot: one load
//! and one add, no call, no allocation, valid from the first instruction a thread runs.
//!
//! The block starts zeroed in every thread, and every field is valid when zero.

use core::cell::Cell;

/// Number of scratch words each thread gives the spy for the span of one call
/// (see [`crate::CallScratch`]).
pub(crate) const SCRATCH_WORDS: usize = 12;

/// The per-thread state. Zero is the initial state of every field.
#[repr(C, align(64))]
pub(crate) struct ThreadState {
    // The first cache line holds everything an allocation that the gate lets through reads
    // and writes (depth, entry trampoline's words, the ticks countdowns): one line per call.
    /// The epoch of the sampling gate under which the sampling spy last pointed `tick_record`
    /// at this thread's counters and started its countdowns (0: never, or not gated). Next
    /// to `depth`, so that the gate tests both with one compare
    /// ([`ThreadState::seen_and_depth`]).
    pub tick_seen: Cell<u32>,
    /// Depth of hook nesting: 0 outside the hooks. A call that finds it non-zero was made by
    /// the hook itself (or by a signal handler that interrupted it) and goes straight to the
    /// real allocator. [`IN_REAL_ALLOCATOR`] while a top-level hook is in the real allocator
    /// ([`in_real_allocator`]).
    pub depth: Cell<u32>,
    /// Stack and frame pointer at the entry of the last exported allocating function called
    /// on this thread, written by its trampoline (see [`crate::export_interposer!`]; by
    /// `fast_path.rs` for a `malloc`, and only when it goes on to the spy): the caller's
    /// return address is at `entry_sp`.
    pub entry_sp: Cell<u64>,
    pub entry_bp: Cell<u64>,
    /// The ticks spy's counters for this thread (a `TickCounters` in mallocspy's pool), once
    /// the spy has seen the thread; 0 before. The sampling gate counts through it.
    pub tick_record: Cell<usize>,
    /// Bytes left before the next sample: one countdown (poisson), or one per allocation
    /// kind (tick). Only meaningful once `tick_record` is set.
    pub tick_until: [Cell<i64>; 3],
    /// This thread's slot in [`crate::threads`] plus one; 0 while it has none yet and
    /// [`crate::threads::NO_SLOT`] when none was available.
    pub slot: Cell<u32>,
    /// The thread's kernel id, for the leak tracker's records (0 until first needed; reset
    /// in the child of a fork).
    pub tid: Cell<u32>,
    /// The in-flight sequence of this thread's slot in [`crate::threads`], as last written.
    /// The owner is the only writer while it lives, so entering and leaving a hook store to
    /// the slot without loading it first: the slot's line is often out of cache (its load
    /// was a fifth of the dispatch's time on churn).
    pub in_flight_seq: Cell<u64>,
    /// The same as `entry_sp`/`entry_bp` for the top-level hook in progress (copied when it
    /// starts, so that the spy's own allocations do not overwrite it): where its call stack
    /// starts.
    pub hook_sp: Cell<u64>,
    pub hook_bp: Cell<u64>,
    /// The return address at `hook_sp` when the hook began: a hook whose frames a `siglongjmp`
    /// out of a signal handler abandoned finds it overwritten (see `dispatch::Scope::enter`).
    pub hook_ret: Cell<u64>,
    /// The stack pointer of the top-level hook in progress, in the hook itself: a call from
    /// inside the hook is deeper (see [`crate::signal_frames`]). 0 while mallocspy's own code
    /// runs as if in a hook (a leak check, a new thread's first steps).
    pub scope_sp: Cell<u64>,
    /// Bounds of this thread's stack, for the unwinder (0 until first needed).
    pub stack_top: Cell<u64>,
    pub stack_low: Cell<u64>,
    /// Scratch words for the spy, private to the call in progress.
    pub scratch: [Cell<u64>; SCRATCH_WORDS],
    /// Set (1) by a spy's method that could not do its work (`mallocspy_api.spy_failed`),
    /// taken by the dispatcher when the method returns.
    pub spy_failed: Cell<u32>,
    /// The cell of the registered spy whose method this thread runs (0: none), for a revoke
    /// made from it (see `registry::Registry::settle_at_hook_end`).
    pub calling_cell: Cell<usize>,
    /// 1 while a callback of the ticks spy runs on this thread (see
    /// `spies::ticks::released_unseen`).
    pub in_tick_callback: Cell<u32>,
    /// While this thread runs on a spare stack (`spare_stack.rs`), the stack pointer it left
    /// its own at; 0 otherwise. A leak check scans the thread's own stack from there too: a
    /// thread stopped on the spare stack had its own skipped, and a block only its frames
    /// held was reported lost (review helper 73).
    pub spare_from_sp: Cell<u64>,
    /// The bottom and size of the alternate signal stack the program set for this thread, 0
    /// if none (see [`crate::alt_stack`]).
    pub alt_stack_low: Cell<u64>,
    pub alt_stack_size: Cell<u64>,
    /// The block an `operator delete` in progress gives back, and the size and alignment its
    /// caller said (see [`crate::delete_hint`]).
    pub delete_ptr: Cell<usize>,
    pub delete_size: Cell<usize>,
    pub delete_align: Cell<usize>,
    /// Where this thread's `errno` is, as the C library's `__errno_location` says (0 until
    /// first asked, see [`crate::os::errno`]).
    pub errno_at: Cell<usize>,
}

/// Offset of `ThreadState::spare_from_sp` in the block (read in a stopped thread's block).
pub(crate) const SPARE_FROM_SP_OFFSET: usize = core::mem::offset_of!(ThreadState, spare_from_sp);

/// Offset of `ThreadState::entry_sp` in the block (for the trampolines' assembly).
pub const ENTRY_SP_OFFSET: usize = core::mem::offset_of!(ThreadState, entry_sp);
/// Offset of `ThreadState::entry_bp` in the block.
pub const ENTRY_BP_OFFSET: usize = core::mem::offset_of!(ThreadState, entry_bp);

const BLOCK_SIZE: usize = 320;
const _: () = assert!(core::mem::size_of::<ThreadState>() <= BLOCK_SIZE);
const _: () = assert!(core::mem::offset_of!(ThreadState, tick_until) + 24 <= 64);
const _: () = assert!(core::mem::offset_of!(ThreadState, tick_seen) == 0);
const _: () = assert!(core::mem::offset_of!(ThreadState, depth) == 4);

impl ThreadState {
    /// `tick_seen` and `depth` as one word, `tick_seen | depth << 32`: equal to a gate's
    /// epoch exactly when the spy set this thread up under it and the call is outside any
    /// hook. One load and one compare on the path of every gated call.
    #[inline(always)]
    pub fn seen_and_depth(&self) -> u64 {
        // SAFETY: `tick_seen` and `depth` are the block's first 8 bytes (asserted above), and
        // the block is 64-byte aligned; only this thread writes them (a signal handler that
        // interrupts it restores `depth` before returning), so the read races with nothing.
        unsafe { (self as *const Self).cast::<u64>().read() }
    }
}

#[cfg(not(target_arch = "x86_64"))]
compile_error!("mallocspy's initial-exec TLS block is written for x86_64 only");

core::arch::global_asm!(
    ".pushsection .tbss,\"awT\",@nobits",
    ".p2align 6",
    ".globl __mallocspy_thread_state",
    ".hidden __mallocspy_thread_state",
    ".type __mallocspy_thread_state,@object",
    ".size __mallocspy_thread_state, {size}",
    "__mallocspy_thread_state:",
    ".zero {size}",
    ".popsection",
    size = const BLOCK_SIZE,
);

/// The calling thread's state.
///
/// The reference is `'static` only in the sense of `std`'s `LocalKey`: `ThreadState` is not
/// `Sync`, so the reference cannot leave the thread, and the thread's TLS outlives any use
/// the thread makes of it.
#[inline(always)]
pub(crate) fn state() -> &'static ThreadState {
    let block: *const ThreadState;
    // SAFETY: fs:0 holds the thread pointer on x86_64 Linux; the GOT slot holds the block's
    // offset from it (initial-exec model). The asm reads memory only and keeps the stack.
    unsafe {
        core::arch::asm!(
            "mov {p}, qword ptr fs:[0]",
            "add {p}, qword ptr [rip + __mallocspy_thread_state@GOTTPOFF]",
            p = out(reg) block,
            options(pure, readonly, nostack),
        );
    }
    // SAFETY: the block is BLOCK_SIZE zero-initialised, 64-byte aligned bytes owned by this
    // thread, and an all-zero ThreadState is valid (Cells of integers).
    unsafe { &*block }
}

/// The block of the thread whose thread pointer is `tp`: `[start, end)`.
pub(crate) fn block_of(tp: u64) -> (u64, u64) {
    let start = tp.wrapping_add(block_offset() as u64);
    (start, start + BLOCK_SIZE as u64)
}

/// The offset of every thread's block from its thread pointer (`fs:0`): fixed when the loader
/// placed this library's TLS, the same for every thread, and kept across `fork`.
pub(crate) fn block_offset() -> usize {
    let offset: usize;
    // SAFETY: reads the GOT slot the loader filled in (initial-exec model); memory only.
    unsafe {
        core::arch::asm!(
            "mov {o}, qword ptr [rip + __mallocspy_thread_state@GOTTPOFF]",
            o = out(reg) offset,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    offset
}

/// An address unique to the calling thread among live threads (its TLS block).
#[inline(always)]
pub(crate) fn thread_key() -> usize {
    state() as *const ThreadState as usize
}

/// The calling thread's kernel id, cached in its state (reset in the child of a fork).
#[inline]
pub(crate) fn tid() -> u32 {
    let ts = state();
    let cached = ts.tid.get();
    if cached != 0 {
        return cached;
    }
    let tid = crate::os::gettid();
    ts.tid.set(tid);
    tid
}

/// [`ThreadState::depth`] while a top-level hook is in the real allocator, where mallocspy
/// holds no lock of its own.
pub(crate) const IN_REAL_ALLOCATOR: u32 = 2;

/// [`ThreadState::depth`] of a thread in seccomp's strict mode, for good: its calls go straight
/// to the real allocator, as a hook's own do (the spies make system calls, which kill it there,
/// and read clocks through the time-stamp counter, which it may not read).
pub(crate) const UNSPIED: u32 = 3;

/// Runs `f`, a call of the real allocator, with a top-level hook in progress on this thread
/// marked as in it: a signal handler that interrupts it there and leaves by `siglongjmp`
/// leaves no lock of mallocspy's held, and the hook may be given up.
#[inline(always)]
pub(crate) fn in_real_allocator<T>(f: impl FnOnce() -> T) -> T {
    let ts = state();
    let in_hook = ts.depth.get() == 1;
    if in_hook {
        ts.depth.set(IN_REAL_ALLOCATOR);
    }
    let result = f();
    if in_hook {
        ts.depth.set(1);
    }
    result
}
