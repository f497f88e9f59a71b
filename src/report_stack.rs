//! A stack to write the exit reports on, when the thread ending the process has little left.
//!
//! The reports run where the process ends: in `exit`'s handlers, `_exit` or a signal handler,
//! on whatever stack that thread has. The leak check alone takes 12 KiB of frame, and
//! symbolizing takes more; a thread on a 16 KiB stack (`PTHREAD_STACK_MIN`) that called `exit`
//! died of SIGSEGV in the check, and so did an `exit` from a handler on a small alternate
//! signal stack, where the program itself exits normally. Such a thread runs the reports on a
//! mapping of its own, as `sigaltstack` gives a handler one; the scan of its own stack still
//! starts where the reports' caller left it (see `leaks::Caller`).

use core::ffi::c_void;

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
    let Some(stack) = os::map(MAPPED) else { return f() };
    let guard = os::page_size();
    // SAFETY: the mapping's first page, ours; PROT_NONE only makes it fault.
    unsafe { libc::mprotect(stack.as_ptr().cast(), guard, libc::PROT_NONE) };
    let (low, top) = (stack.as_ptr() as u64 + guard as u64, stack.as_ptr() as u64 + MAPPED as u64);
    // The walks and room checks made on it take it for the thread's stack while it is.
    let ts = tls::state();
    let bounds = (ts.stack_low.get(), ts.stack_top.get());
    ts.stack_low.set(low);
    ts.stack_top.set(top);
    let mut f = f;
    // SAFETY: `top` is the 16-byte aligned end of a mapping of ours that nothing else uses;
    // `run` is given a pointer to `f`, which outlives the call.
    unsafe { call_on_stack((&raw mut f).cast(), run, top) };
    ts.stack_low.set(bounds.0);
    ts.stack_top.set(bounds.1);
    // SAFETY: the mapping of `os::map` above; the call on it has returned.
    unsafe { os::unmap(stack, MAPPED) };
}

/// What [`call_on_stack`] calls: the closure `arg` points to.
extern "C" fn run(arg: *mut c_void) {
    // SAFETY: `with_room` passes a pointer to its `&mut dyn FnMut()`, alive during the call.
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
}
