//! The calling thread's stack extent, which every stack read of the unwinder is checked
//! against.
//!
//! Asked once per thread and cached in its thread state: the main thread's from where glibc
//! says it started and `RLIMIT_STACK`, another thread's from `pthread_getattr_np`. That
//! function holds the thread's own lock while it allocates, so it must not be asked from a
//! hook on one of its own allocations: [`crate::thread_create`] asks before the program's code
//! runs in a new thread.

use crate::tls;

/// The calling thread's stack, `(low, high)` (cached in its thread state; `(0, 0)` when
/// unknown).
pub(crate) fn stack_bounds() -> (u64, u64) {
    let ts = tls::state();
    if ts.stack_top.get() == 0 {
        let (low, high) = query();
        ts.stack_low.set(low);
        ts.stack_top.set(high.max(1));
    }
    (ts.stack_low.get(), ts.stack_top.get())
}

/// The stack's extent as glibc knows it (`(0, 0)`: unknown).
fn query() -> (u64, u64) {
    unsafe extern "C" {
        /// glibc: the stack address at process start (the main thread's frames lie below).
        static __libc_stack_end: *mut core::ffi::c_void;
    }
    // SAFETY: gettid has no preconditions.
    let is_main = unsafe { libc::syscall(libc::SYS_gettid) } == crate::os::getpid() as libc::c_long;
    if is_main {
        // The main stack grows on demand up to RLIMIT_STACK below its start.
        // SAFETY: glibc initialises __libc_stack_end before any user code runs; rlimit is
        // plain data written by getrlimit.
        let (top, limit) = unsafe {
            let mut lim: libc::rlimit = core::mem::zeroed();
            let limit = if libc::getrlimit(libc::RLIMIT_STACK, &mut lim) == 0 { lim.rlim_cur } else { 8 << 20 };
            (__libc_stack_end as u64, limit.min(1 << 32))
        };
        return (top.saturating_sub(limit), top);
    }
    // SAFETY: attr is initialised by pthread_getattr_np before use and destroyed after (it
    // allocates: callers are inside a hook, or as if, where that goes to the real allocator).
    unsafe {
        let mut attr: libc::pthread_attr_t = core::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return (0, 0);
        }
        let mut addr = core::ptr::null_mut();
        let mut size = 0;
        let ok = libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0;
        libc::pthread_attr_destroy(&mut attr);
        if ok { (addr as u64, addr as u64 + size as u64) } else { (0, 0) }
    }
}
