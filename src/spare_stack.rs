//! Stacks to run on when the calling thread's own has too little left.
//!
//! The exit reports run where the process ends: in `exit`'s handlers, `_exit` or a signal
//! handler, on whatever stack that thread has. The leak check alone takes 12 KiB of frame, and
//! symbolizing takes more; a thread on a 16 KiB stack (`PTHREAD_STACK_MIN`) that called `exit`
//! died of SIGSEGV in the check, and so did an `exit` from a handler on a small alternate
//! signal stack, where the program itself exits normally. Such a thread runs the reports on a
//! mapping of its own, as `sigaltstack` gives a handler one; the scan of its own stack still
//! starts where the reports' caller left it (see `leaks::Caller`).
//!
//! Computing an unwind rule from `.eh_frame` takes 7 KiB (see `unwind::rules::COMPUTE_ROOM`).
//! A thread with less left used to end its stacks at the first frame whose rule was not cached
//! yet: every stack of a thread on a 16 KiB stack was cut short. It computes the rule on the
//! process's spare stack instead, one thread at a time (a thread that finds it taken ends its
//! walk there, as before): a mapping made at the first need and kept, since a hook may not
//! wait for a lock.

use core::ffi::c_void;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::{os, tls, unwind};

/// Stack the reports may take: 29 KiB for a C program's leak report, 36 KiB for python3's,
/// 54 KiB for a C++ program's with its demangled names (measured 2026-12-04); more than four
/// times that, for deeper programs' DWARF.
const ROOM: u64 = 256 << 10;
/// The mapping run on: `ROOM` and more, with an inaccessible page below it, so that an
/// overflow faults rather than writes over a neighbour.
const MAPPED: usize = 1 << 20;

/// Runs `f` on this thread's stack if it has [`ROOM`] left below this frame, and otherwise on
/// a mapping of [`MAPPED`] bytes (or, if none can be had, on this stack all the same).
pub(crate) fn with_room(f: &mut dyn FnMut()) {
    if unwind::thread_stack_room() >= ROOM {
        return f();
    }
    let Some(stack) = map_guarded(MAPPED) else { return f() };
    let guard = os::page_size();
    // SAFETY: a mapping of ours that nothing else uses, unmapped only below.
    unsafe { run_on(stack.as_ptr() as u64 + guard as u64, (MAPPED - guard) as u64, f) };
    // SAFETY: the mapping of `map_guarded` above; the call on it has returned.
    unsafe { os::unmap(stack, MAPPED) };
}

/// Usable bytes of the spare stack for rules: a rule takes 7 KiB of it; the rest is for a
/// signal handler that interrupts the computation, which runs on it too (untouched, it costs
/// no memory).
const RULE_ROOM: usize = 256 << 10;
/// The spare stack for rules (the low end of its usable part), 0 until first needed.
static RULE_STACK: AtomicUsize = AtomicUsize::new(0);
/// Whether a thread runs on [`RULE_STACK`].
static RULE_STACK_TAKEN: AtomicBool = AtomicBool::new(false);

/// Runs `f` on the process's spare stack for rules, unless another thread is on it or it
/// cannot be mapped.
pub(crate) fn for_a_rule(f: &mut dyn FnMut()) {
    if RULE_STACK_TAKEN.swap(true, Ordering::Acquire) {
        return;
    }
    let mut low = RULE_STACK.load(Ordering::Relaxed);
    if low == 0 {
        low = map_guarded(RULE_ROOM + os::page_size()).map_or(0, |stack| stack.as_ptr() as usize + os::page_size());
        RULE_STACK.store(low, Ordering::Relaxed);
    }
    if low != 0 {
        // SAFETY: the spare stack, which this thread alone runs on until it lets go of it.
        unsafe { run_on(low as u64, RULE_ROOM as u64, f) };
    }
    RULE_STACK_TAKEN.store(false, Ordering::Release);
}

/// Whether `[start, end)` overlaps the spare stack for rules: not a root of the leak check
/// (what lies there is the stale frames of rules computed; a thread stopped on it has its
/// frames scanned from its stack pointer, as on its own stack).
pub(crate) fn owns(start: u64, end: u64) -> bool {
    let low = RULE_STACK.load(Ordering::Relaxed) as u64;
    low != 0 && start < low + RULE_ROOM as u64 && low - (os::page_size() as u64) < end
}

/// Child side of `fork`: a thread that was on the spare stack for rules is gone.
pub(crate) fn after_fork_child() {
    RULE_STACK_TAKEN.store(false, Ordering::Relaxed);
}

/// Maps `len` bytes with an inaccessible first page, so that an overflow faults rather than
/// writes over a neighbour.
fn map_guarded(len: usize) -> Option<NonNull<u8>> {
    let stack = os::map(len)?;
    // SAFETY: the mapping's first page, ours; PROT_NONE only makes it fault.
    unsafe { libc::mprotect(stack.as_ptr().cast(), os::page_size(), libc::PROT_NONE) };
    Some(stack)
}

/// Runs `f` on the `len` bytes of stack from `low`, as this thread's stack for the walks and
/// room checks made on it, and gives the thread its own bounds back.
///
/// # Safety
/// `[low, low + len)` is writable memory that nothing else uses during the call, `low + len`
/// 16-byte aligned.
unsafe fn run_on(low: u64, len: u64, f: &mut dyn FnMut()) {
    let top = low + len;
    let ts = tls::state();
    let bounds = (ts.stack_low.get(), ts.stack_top.get());
    let from = ts.spare_from_sp.get();
    ts.stack_low.set(low);
    ts.stack_top.set(top);
    // Where its own stack's frames start, for a leak check made meanwhile (the first switch
    // of nested ones: the frames of the spare stack in between hold no block of the program).
    if from == 0 {
        ts.spare_from_sp.set(unwind::current_sp());
    }
    let mut f = f;
    // SAFETY: the caller's guarantee; `run` is given a pointer to `f`, which outlives the call.
    unsafe { call_on_stack((&raw mut f).cast(), run, top) };
    ts.spare_from_sp.set(from);
    ts.stack_low.set(bounds.0);
    ts.stack_top.set(bounds.1);
}

/// What [`call_on_stack`] calls: the closure `arg` points to.
extern "C" fn run(arg: *mut c_void) {
    // SAFETY: `run_on` passes a pointer to its `&mut dyn FnMut()`, alive during the call.
    let f = unsafe { &mut *arg.cast::<&mut dyn FnMut()>() };
    f();
}

/// Calls `f(arg)` with the stack pointer at `top`, and returns on the caller's stack.
///
/// # Safety
/// `top` is the 16-byte aligned end of writable memory that nothing else uses, with room for
/// what `f` needs; `f` does not unwind.
#[unsafe(naked)]
unsafe extern "C" fn call_on_stack(arg: *mut c_void, f: extern "C" fn(*mut c_void), top: u64) {
    core::arch::naked_asm!("push rbp", "mov rbp, rsp", "mov rsp, rdx", "call rsi", "mov rsp, rbp", "pop rbp", "ret")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_with_little_stack_runs_on_a_mapping_and_gets_its_bounds_back() {
        let little = std::thread::Builder::new().stack_size(64 << 10).spawn(|| {
            let ts = tls::state();
            unwind::thread_stack_room();
            let before = (ts.stack_low.get(), ts.stack_top.get());
            let mut inside = (0, 0, 0);
            with_room(&mut || {
                // A frame far larger than the thread's whole stack.
                let big = core::hint::black_box([7u8; 200 << 10]);
                inside = (unwind::thread_stack_room(), big[12345] as u64, ts.stack_top.get());
            });
            (before, inside, (ts.stack_low.get(), ts.stack_top.get()))
        });
        let (before, (room, seven, top), after) = little.unwrap().join().unwrap();
        assert_eq!(seven, 7);
        assert!(room > ROOM && room < MAPPED as u64, "{room}");
        assert_ne!(top, before.1);
        assert_eq!(after, before);
        // With room enough, on the thread's own stack.
        let mut top = 0;
        with_room(&mut || top = tls::state().stack_top.get());
        assert_eq!(top, tls::state().stack_top.get());
    }

    #[test]
    fn a_rule_runs_on_the_spare_stack_one_thread_at_a_time() {
        let (mut sp, mut nested_ran) = (0, false);
        for_a_rule(&mut || {
            sp = unwind::current_sp();
            // Taken: a second user (a signal handler's hook, another thread) does without.
            for_a_rule(&mut || nested_ran = true);
        });
        let low = RULE_STACK.load(Ordering::Relaxed) as u64;
        assert!(low != 0 && (low..low + RULE_ROOM as u64).contains(&sp), "{sp:#x} not in {low:#x}");
        assert!(!nested_ran);
        assert!(owns(sp, sp + 1) && !owns(0, 4096));
        // Let go of: the next one runs.
        let mut ran = false;
        for_a_rule(&mut || ran = true);
        assert!(ran);
    }
}
