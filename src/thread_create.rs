//! `pthread_create`, wrapped (on a kernel older than 6.11) so that a new thread learns its
//! stack's extent before any code of the program runs in it.
//!
//! The unwinder checks every stack read against the thread's stack. A newer kernel tells it
//! in one query, from any frame ([`crate::unwind::kernel_finds_stacks`]): threads then start
//! exactly as without mallocspy. Otherwise glibc tells it, through `pthread_getattr_np`. That
//! function holds the thread's own lock while it allocates (its CPU set, the attribute's
//! extension), so asking it from a hook on one of those allocations waits forever for the lock
//! the caller holds. The JVM and Rust's `std` ask for a new thread's stack before anything
//! else, so that was the first hook of each of their threads: `java` hung at start under
//! `spy=leaks`. (ddprof met the same deadlock and wraps `pthread_create` the same way,
//! DataDog/ddprof#124.) Threads made otherwise (glibc's own helpers, a raw `clone`), or made
//! before any spy was registered, read the kernel's map instead, on their first captured
//! stack.

use core::ffi::{c_int, c_void};
use core::sync::atomic::AtomicPtr;

use crate::global::GLOBAL;
use crate::tls;

/// A thread's start routine. `C-unwind`: `pthread_exit` and cancellation unwind out of it.
pub type Routine = unsafe extern "C-unwind" fn(*mut c_void) -> *mut c_void;

type Create = unsafe extern "C" fn(*mut c_void, *const c_void, Option<Routine>, *mut c_void) -> c_int;

static NEXT: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// The `pthread_create` after ours (libc's).
fn next() -> Option<Create> {
    let f = crate::os::next_symbol_cached(&NEXT, c"pthread_create");
    // SAFETY: libc's pthread_create has this signature (the thread and attribute pointers are
    // passed through untouched).
    (!f.is_null()).then(|| unsafe { core::mem::transmute::<*mut c_void, Create>(f) })
}

/// Looks up libc's `pthread_create` now (at start-up), not in the program's first call,
/// where `dlsym` would take the loader's lock wherever the program happens to be; and asks
/// whether the kernel tells threads their stacks.
pub(crate) fn warm_up() {
    let _ = next();
    let _ = crate::unwind::kernel_finds_stacks();
}

struct Start {
    routine: Routine,
    arg: *mut c_void,
}

/// The new thread's first frame: notes the stack, then runs the program's routine.
unsafe extern "C-unwind" fn start(start: *mut c_void) -> *mut c_void {
    // SAFETY: `create` handed over this Box<Start> to the thread.
    let Start { routine, arg } = *unsafe { Box::from_raw(start.cast::<Start>()) };
    // As inside a hook: pthread_getattr_np's allocations are mallocspy's, not the program's,
    // and go straight to the real allocator, unseen by the spies.
    let ts = tls::state();
    let depth = ts.depth.replace(1);
    let scope_sp = ts.scope_sp.replace(0);
    crate::unwind::note_thread_start();
    ts.scope_sp.set(scope_sp);
    ts.depth.set(depth);
    if depth == 0 {
        crate::ending_signals::after_hook();
    }
    // SAFETY: the routine and argument the program gave pthread_create. Nothing of this frame
    // needs dropping, so pthread_exit may unwind through it.
    unsafe { routine(arg) }
}

/// C `pthread_create`.
///
/// # Safety
/// As `pthread_create`: `thread` is writable, `attr` is NULL or initialised, and `routine`
/// may be called with `arg` on the new thread.
pub unsafe fn create(thread: *mut c_void, attr: *const c_void, routine: Option<Routine>, arg: *mut c_void) -> c_int {
    // A forked child's trace writer is forked from it while it has one thread: no lock of
    // ours or of the C library's is then held by a thread the writer's copy lacks.
    crate::trace::writer::start_deferred(false);
    let Some(next) = next() else { return libc::EAGAIN };
    // With no spy, nothing captures stacks; and where the kernel tells a thread its stack, it
    // needs nothing at start: the thread starts exactly as without mallocspy.
    let Some(routine) = routine.filter(|_| !GLOBAL.registry.is_empty() && !crate::unwind::kernel_finds_stacks()) else {
        // SAFETY: the caller's arguments, unchanged.
        return unsafe { next(thread, attr, routine, arg) };
    };
    let start_arg = Box::into_raw(Box::new(Start { routine, arg }));
    // SAFETY: the caller's thread and attributes; `start` takes ownership of `start_arg`.
    let status = unsafe { next(thread, attr, Some(start), start_arg.cast()) };
    if status != 0 {
        // SAFETY: no thread was created: the Box is still ours.
        drop(unsafe { Box::from_raw(start_arg) });
    }
    status
}
