//! The alternate signal stack a thread set (`sigaltstack` is wrapped): a hook in a signal
//! handler that runs on it with little room left goes straight to the real allocator.
//!
//! A handler on a stack of `MINSIGSTKSZ` (3,376 bytes here, of which the kernel's signal frame
//! takes about 3,000) that calls `malloc` works natively, with a few hundred bytes of stack;
//! the leak tracker's record of the block, its stack walk included, takes over a kilobyte
//! more, and such a program died of it (review helper 97). Below [`HOOK_ROOM`] the call is
//! served unspied, as a call from a handler that interrupted a hook is. The stack is noted as
//! the program sets it: looking it up on each call (a system call) would cost every program
//! whose calls run off the thread's stack (coroutines), and one set by a raw system call is
//! not seen. Nor can it tell a handler from ordinary frames that run over the stack (one set
//! from a buffer its function's return left behind): the kernel's `SS_ONSTACK` too is only
//! where the stack pointer lies.

use core::ffi::{c_int, c_void};
use core::sync::atomic::AtomicPtr;

use crate::{os, tls};

/// Room a hook wants below it on an alternate signal stack: the leak tracker's first record
/// of a thread, which leases its tables, with a stack walk that takes the caller's frame only.
const HOOK_ROOM: u64 = 4 << 10;

static NEXT_SIGALTSTACK: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

type Sigaltstack = unsafe extern "C" fn(*const libc::stack_t, *mut libc::stack_t) -> c_int;

/// Whether `sp`, the stack pointer of a hook about to begin, lies on the thread's alternate
/// signal stack within [`HOOK_ROOM`] of its bottom.
#[inline(always)]
pub(crate) fn little_room(ts: &tls::ThreadState, sp: u64) -> bool {
    // A size of 0 when none is set: no stack pointer is that close.
    sp.wrapping_sub(ts.alt_stack_low.get()) < HOOK_ROOM.min(ts.alt_stack_size.get())
}

/// `sigaltstack`: libc's, then the new stack's bottom is noted for this thread.
///
/// # Safety
/// As `sigaltstack`.
pub(crate) unsafe fn sigaltstack(stack: *const libc::stack_t, old: *mut libc::stack_t) -> c_int {
    let f = os::next_symbol_cached(&NEXT_SIGALTSTACK, c"sigaltstack");
    let status = if f.is_null() {
        // SAFETY: the raw system call, with the caller's arguments.
        unsafe { libc::syscall(libc::SYS_sigaltstack, stack, old) as c_int }
    } else {
        // SAFETY: libc's sigaltstack has this signature; the caller's guarantee covers the
        // arguments.
        unsafe { core::mem::transmute::<*mut c_void, Sigaltstack>(f)(stack, old) }
    };
    if status != 0 {
        return status;
    }
    // SAFETY: a non-null `stack` is the caller's valid stack_t.
    if let Some(stack) = unsafe { stack.as_ref() } {
        let disabled = stack.ss_flags & libc::SS_DISABLE != 0;
        let ts = tls::state();
        ts.alt_stack_low.set(if disabled { 0 } else { stack.ss_sp as u64 });
        ts.alt_stack_size.set(if disabled { 0 } else { stack.ss_size as u64 });
    }
    status
}

/// Looks up libc's function at start (see [`crate::program_mappings::warm_up`]).
pub(crate) fn warm_up() {
    os::next_symbol_cached(&NEXT_SIGALTSTACK, c"sigaltstack");
}
