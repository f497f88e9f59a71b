//! Whether an allocation made from inside a hook comes from a signal handler that interrupted
//! the hook, rather than from mallocspy's own calls into the C library (`opendir`,
//! `pthread_getattr_np` allocate).
//!
//! Neither may run spy code (the hook interrupted may hold the locks it would take), so both
//! go to the real allocator unseen; but only the handler's are the program's, and the leak
//! report says how many it missed. The kernel gives a handler the return address `sa_restorer`
//! (glibc's `__restore_rt`, set by its `sigaction` for every handler), at the start of the
//! frame it pushes below the interrupted code's stack: that frame lies between the call and
//! the hook exactly when a handler runs in between. The word alone is not enough (mallocspy's
//! own frames may hold a `struct sigaction` it read): the frame's `ucontext` must have no
//! link and a saved stack pointer above the frame, inside the hook. A handler on an alternate
//! stack (`sigaltstack`) is not found: its stack is not the hook's.

use core::sync::atomic::{AtomicUsize, Ordering};

/// `sa_restorer` of the handlers installed through the C library, once one was seen (0 before).
static RESTORER: AtomicUsize = AtomicUsize::new(0);

/// The kernel's `struct sigaction` on x86_64, as `rt_sigaction` takes it.
#[repr(C)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

const SA_RESTORER: u64 = 0x0400_0000;

/// [`RESTORER`] once a search found no handler: a nested allocation (a tick callback's, a
/// spy's own) searched all 64 signals, 64 system calls and 19 us a call, in every program
/// with no handler installed (review helper 133). Searched again after the program installs
/// one through the C library ([`handlers_may_change`]); one installed by a raw system call
/// (Go's runtime) goes unseen until then, and its frames are not looked for: only the count of
/// calls a handler made inside a hook misses them.
const NONE_FOUND: usize = 1;

/// Called by the wrappers of `sigaction` and the `signal` family: a handler with a restorer
/// may be installed now.
pub(crate) fn handlers_may_change() {
    let _ = RESTORER.compare_exchange(NONE_FOUND, 0, Ordering::Relaxed, Ordering::Relaxed);
}

/// The restorer of any signal's handler installed with one, if some is.
fn restorer() -> usize {
    match RESTORER.load(Ordering::Relaxed) {
        NONE_FOUND => return 0,
        0 => {}
        known => return known,
    }
    let found = (1..=64).find_map(|signal: libc::c_long| {
        let mut action = KernelSigaction { handler: 0, flags: 0, restorer: 0, mask: 0 };
        // SAFETY: a query (no new action) into a structure of the kernel's layout and size.
        let rc = unsafe {
            libc::syscall(libc::SYS_rt_sigaction, signal, core::ptr::null::<KernelSigaction>(), &mut action, 8usize)
        };
        (rc == 0 && action.handler > 1 && action.flags & SA_RESTORER != 0 && action.restorer != 0)
            .then_some(action.restorer)
    });
    let _ = RESTORER.compare_exchange(0, found.unwrap_or(NONE_FOUND), Ordering::Relaxed, Ordering::Relaxed);
    found.unwrap_or(0)
}

/// At most this much stack between a hook and a call from inside it is searched.
const MAX_SEARCH: u64 = 1 << 20;

/// Whether a signal handler runs between the calling frame and the hook whose stack pointer
/// was `hook_sp` (on the same stack, above).
pub(crate) fn handler_interrupted(hook_sp: u64) -> bool {
    let sp = crate::unwind::current_sp();
    if hook_sp <= sp || hook_sp - sp > MAX_SEARCH {
        return false;
    }
    let restorer = restorer();
    if restorer == 0 {
        return false;
    }
    let words = ((hook_sp - sp) / 8) as usize;
    // SAFETY: the words between this frame's stack pointer and a caller's are this thread's
    // live stack, mapped and aligned (both pointers are 8-byte aligned).
    let word = |i: usize| unsafe { core::ptr::read_volatile((sp as *const u64).add(i)) };
    (0..words.saturating_sub(SAVED_RSP)).any(|i| {
        let at = sp + 8 * i as u64;
        word(i) == restorer as u64 && word(i + UC_LINK) == 0 && (at + 8..=hook_sp).contains(&word(i + SAVED_RSP))
    })
}

/// Where, in words from the return address that starts a signal frame (`struct rt_sigframe`:
/// `pretcode`, then the `ucontext`), the `ucontext`'s `uc_link` and the saved `rsp` lie:
/// `uc_flags`, `uc_link`, `uc_stack` (3 words), then `uc_mcontext`, whose `rsp` is its 16th
/// word (`r8`-`r15`, `rdi`, `rsi`, `rbp`, `rbx`, `rdx`, `rax`, `rcx`, `rsp`).
const UC_LINK: usize = 2;
const SAVED_RSP: usize = 1 + 5 + 15;
