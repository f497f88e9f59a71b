//! Whether the calling process is the one that set mallocspy's state up, or a child of a
//! `fork` that ran no `pthread_atfork` handler: one made by `clone()` or `syscall(SYS_fork)`
//! (bubblewrap, runc's `nsexec`, Chromium's zygote). Such a child holds a copy of its
//! parent's state without knowing it, the trace queue shared with the parent's writer
//! included: its samples went into the parent's trace, under the parent's name.
//!
//! A page advised `MADV_WIPEONFORK` reads zero in every child, however it was forked; a word
//! set there says "set up here", and costs a load to read. Where the kernel refuses the advice
//! (before Linux 4.14) the word survives a fork as any other, and such a child is not told
//! apart.

use core::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use crate::os;

const PAGE: usize = 4096;

/// The marked page's word; null until [`set_here`] first runs.
static MARK: AtomicPtr<AtomicUsize> = AtomicPtr::new(core::ptr::null_mut());

/// Marks the calling process as set up: at start-up, and in the atfork handler of a child.
pub(crate) fn set_here() {
    let mut mark = MARK.load(Ordering::Acquire);
    if mark.is_null() {
        let Some(page) = os::map(PAGE) else { return };
        // SAFETY: advice on a private anonymous page just mapped, of PAGE bytes. A refusal
        // leaves an ordinary page.
        unsafe { libc::madvise(page.as_ptr().cast(), PAGE, libc::MADV_WIPEONFORK) };
        mark = page.as_ptr().cast();
        MARK.store(mark, Ordering::Release);
    }
    // SAFETY: the mark is the first word of a page of ours, never unmapped.
    unsafe { (*mark).store(1, Ordering::Release) };
}

/// False in a child of a `fork` that ran no atfork handler (see the module's documentation);
/// true before [`set_here`] ever ran, or when it could not map its page.
#[inline]
pub(crate) fn set_up_here() -> bool {
    let mark = MARK.load(Ordering::Relaxed);
    // SAFETY: as in `set_here`.
    mark.is_null() || unsafe { (*mark).load(Ordering::Relaxed) } != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child forked by the system call itself, running no atfork handler, sees the mark
    /// cleared; the parent keeps it.
    #[test]
    fn a_child_forked_without_handlers_is_not_set_up_here() {
        let _alone = crate::trace::FORKING_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        set_here();
        assert!(set_up_here());
        // SAFETY: the child only reads a word and leaves with _exit.
        let child = unsafe { libc::syscall(libc::SYS_fork) } as i32;
        if child == 0 {
            // SAFETY: _exit ends the child without running anything of the test harness's.
            unsafe { libc::_exit(if set_up_here() { 1 } else { 0 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child saw the mark: {status:#x}");
        assert!(set_up_here(), "the parent keeps it");
    }
}
