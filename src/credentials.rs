//! The calls by which a process changes who it is or what it sees of the file system: the
//! `setuid` family, `setgroups` and `chroot` (wrapped). A forked child starts its trace writer
//! at its first record (see `trace::writer::start_deferred`), and the writer opens the trace
//! then: after a worker's drop to an unprivileged user (nginx's and sshd's workers) it was
//! refused the directory, and the child ran without a trace (review helper 151). Its writer
//! starts before such a call instead, as the process it was forked as.

use core::ffi::{CStr, c_int, c_void};
use core::sync::atomic::AtomicPtr;

use crate::os;

/// `name` with its NUL, as a C string (at compile time).
const fn c_name(name: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(name.as_bytes()) {
        Ok(name) => name,
        Err(_) => panic!("a C name ends in its only NUL"),
    }
}

/// Defines, for each name, the wrapper `interpose` exports under it (with the slot of the next
/// library's function), and [`WRAPPED`] for [`warm_up`]. Every one takes at most three words and
/// returns an `int`; the words beyond a function's own are passed on unread.
macro_rules! wrappers {
    ($($name:ident),* $(,)?) => {
        /// The wrapped functions: the slot of each one's next, and its name.
        const WRAPPED: &[(&AtomicPtr<c_void>, &CStr)] = &[$((&$name::NEXT, $name::NAME)),*];
        $(
            #[allow(non_snake_case)]
            mod $name {
                use super::*;
                pub(super) static NEXT: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
                pub(super) const NAME: &CStr = c_name(concat!(stringify!($name), "\0"));
            }

            /// The C function of this name: a forked child's trace writer starts first.
            ///
            /// # Safety
            /// As the C function with these arguments.
            pub(crate) unsafe fn $name(a: usize, b: usize, c: usize) -> c_int {
                // SAFETY: the caller's guarantee.
                unsafe { call(&$name::NEXT, $name::NAME, [a, b, c]) }
            }
        )*
    };
}

wrappers!(setuid, setgid, seteuid, setegid, setreuid, setregid, setresuid, setresgid, setgroups, chroot);

/// Looks up the wrapped functions at start (see [`crate::program_mappings::warm_up`]).
pub(crate) fn warm_up() {
    for (slot, name) in WRAPPED {
        os::next_symbol_cached(slot, name);
    }
}

/// Starts a forked child's writer, then calls the next library's function `name`.
///
/// # Safety
/// As the function with these arguments.
unsafe fn call(slot: &AtomicPtr<c_void>, name: &CStr, [a, b, c]: [usize; 3]) -> c_int {
    crate::trace::writer::start_deferred(false);
    let f = os::next_symbol_cached(slot, name);
    if f.is_null() {
        os::set_errno(libc::ENOSYS);
        return -1;
    }
    type Three = unsafe extern "C" fn(usize, usize, usize) -> c_int;
    // SAFETY: the C function takes at most three words and returns an int; the caller's
    // guarantee covers the arguments.
    unsafe { core::mem::transmute::<*mut c_void, Three>(f)(a, b, c) }
}
