//! The calls by which a process changes who it is, what it may do or what it sees: the `setuid`
//! and `setgid` families, `setgroups`, `capset`, `chroot`, `unshare` and `setns` (wrapped). A forked child starts its trace writer
//! at its first record (see `trace::writer::start_deferred`), and the writer opens the trace
//! then: after a worker's drop to an unprivileged user (nginx's and sshd's workers) it was
//! refused the directory, and the child ran without a trace (review helper 151). Its writer
//! starts before such a call instead, as the process it was forked as (and keeps running as
//! that user: it reads the queue the dropped worker writes). A privileged process that becomes
//! another user gives it its trace file first, for the program it may `exec` next to replace.
//!
//! A child forked after `unshare(CLONE_NEWPID)`, or a `setns` into a pid namespace, enters it:
//! a writer started then was the namespace's first process, its init, and ended it when it
//! went, its parent's next `fork` failing with ENOMEM.

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
/// returns an `int`; the words beyond a function's own are passed on unread. After a name, the
/// index of the argument that is the effective user the call asks for, if it asks for one.
macro_rules! wrappers {
    ($($name:ident: $euid:expr),* $(,)?) => {
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
                let euid: Option<usize> = $euid;
                // SAFETY: the caller's guarantee.
                unsafe { call(&$name::NEXT, $name::NAME, [a, b, c], euid.map(|i| [a, b, c][i] as u32)) }
            }
        )*
    };
}

/// Gives `$then` every wrapped function's name, each with the index of its argument that is the
/// effective user it asks for, if it asks for one: the one list of them for the wrappers here
/// and their exports (`interpose.rs`).
#[doc(hidden)]
#[macro_export]
macro_rules! __credential_calls {
    ($then:path) => {
        $then! {
            setuid: Some(0),
            seteuid: Some(0),
            setreuid: Some(1),
            setresuid: Some(1),
            setfsuid: None,
            setgid: None,
            setegid: None,
            setregid: None,
            setresgid: None,
            setfsgid: None,
            setgroups: None,
            capset: None,
            chroot: None,
            unshare: None,
            setns: None
        }
    };
}

crate::__credential_calls!(wrappers);

/// Looks up the wrapped functions at start (see [`crate::program_mappings::warm_up`]).
pub(crate) fn warm_up() {
    for (slot, name) in WRAPPED {
        os::next_symbol_cached(slot, name);
    }
}

/// Starts a forked child's writer, then calls the next library's function `name`. A call that
/// makes a privileged process another user (`euid`, -1 for none) gives it the trace first.
/// `errno` is the call's alone.
///
/// # Safety
/// As the function with these arguments.
unsafe fn call(slot: &AtomicPtr<c_void>, name: &CStr, [a, b, c]: [usize; 3], euid: Option<u32>) -> c_int {
    let errno = os::errno();
    crate::trace::writer::start_deferred(false);
    // SAFETY: geteuid has no preconditions.
    if let Some(uid) = euid.filter(|&uid| uid != u32::MAX && unsafe { libc::geteuid() } == 0 && uid != 0) {
        crate::trace::writer::hand_trace_to(uid);
    }
    let f = os::next_symbol_cached(slot, name);
    if f.is_null() {
        os::set_errno(libc::ENOSYS);
        return -1;
    }
    os::set_errno(errno);
    type Three = unsafe extern "C" fn(usize, usize, usize) -> c_int;
    // SAFETY: the C function takes at most three words and returns an int; the caller's
    // guarantee covers the arguments.
    unsafe { core::mem::transmute::<*mut c_void, Three>(f)(a, b, c) }
}
