//! Whether the dynamic loader can be called in the child of a `fork`.
//!
//! `fork` copies the loader's locks as they are. If another thread of the parent was inside
//! `dlopen` or `dlclose`, the child's copies stay held by a thread that does not exist there,
//! and every `dl_iterate_phdr` or `dladdr` in the child waits forever (glibc 2.36 takes
//! neither lock around `fork`). A child that leaves by `_exit` calls neither, but its leak
//! report does (the modules' data are roots; frames and globals are named from the modules):
//! 56 of 200 children of a program that forked while a thread loaded and unloaded a library
//! hung in their report, where natively none did.
//!
//! So a forked child asks the loader once, from a throwaway thread, and waits for the answer
//! [`PATIENCE_MS`], longer while the thread is still runnable (a machine so loaded that it
//! has not run yet: review helper 63 saw a child give up there, one run in nine at a load
//! average of 56), up to [`RUNNABLE_PATIENCE_MS`]; a thread waiting on a lock sleeps. The thread is a raw `clone` (glibc's `pthread_create` takes locks
//! of the loader's itself) that shares the caller's thread pointer, so that it calls the
//! loader as the caller would, with every signal blocked; if it never returns, the process's
//! exit ends it. A process that was not forked, or whose loader answered once, is not asked.

use core::ffi::{c_int, c_void};
use core::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};

use crate::os;

/// How long a forked child waits for its loader to answer, in milliseconds.
pub(crate) const PATIENCE_MS: u64 = 500;

/// How long it waits at most while the asking thread is runnable.
const RUNNABLE_PATIENCE_MS: u64 = 10_000;

/// The probe thread's stack.
const STACK: usize = 64 << 10;

const NOT_FORKED: u8 = 0;
const UNKNOWN: u8 = 1;
const ANSWERS: u8 = 2;
const STUCK: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(NOT_FORKED);

/// Whether a leak check holds the other threads stopped: one may be stopped inside `dlopen`
/// or `dlclose`, holding the loader's locks until the check resumes it, and a module list
/// read then waited for it forever (review helper 84).
static WORLD_STOPPED: AtomicBool = AtomicBool::new(false);

/// Says that a leak check stopped the other threads (`true`) or resumed them.
pub(crate) fn world_stopped(stopped: bool) {
    WORLD_STOPPED.store(stopped, Ordering::Release);
}

/// In the child of a `fork`: the loader's locks may be held by a thread left behind.
pub(crate) fn after_fork_child() {
    STATE.store(UNKNOWN, Ordering::Relaxed);
}

/// Whether the loader may be called without waiting forever: always, unless a leak check
/// holds the other threads stopped, or this process is the child of a `fork` and the loader
/// did not answer within [`PATIENCE_MS`] when asked.
pub(crate) fn usable() -> bool {
    if WORLD_STOPPED.load(Ordering::Acquire) {
        return false;
    }
    match STATE.load(Ordering::Relaxed) {
        NOT_FORKED | ANSWERS => true,
        STUCK => false,
        _ => {
            let answers = answers_within(PATIENCE_MS);
            STATE.store(if answers { ANSWERS } else { STUCK }, Ordering::Relaxed);
            answers
        }
    }
}

/// The throwaway thread: takes each of the loader's locks once, then leaves (glibc's `clone`
/// makes the `exit` system call with the value returned).
extern "C" fn ask_the_loader(_: *mut c_void) -> c_int {
    extern "C" fn stop(_: *mut libc::dl_phdr_info, _: usize, _: *mut c_void) -> c_int {
        1
    }
    // SAFETY: `stop` matches dl_iterate_phdr's callback and touches nothing; dladdr only
    // writes `info`.
    unsafe {
        libc::dl_iterate_phdr(Some(stop), core::ptr::null_mut());
        let mut info: libc::Dl_info = core::mem::zeroed();
        libc::dladdr(ask_the_loader as *const c_void, &mut info);
    }
    0
}

/// Runs [`ask_the_loader`] on a thread of its own and waits for it `timeout_ms` at most.
fn answers_within(timeout_ms: u64) -> bool {
    let Some(stack) = os::map(STACK) else { return true };
    // The kernel stores the thread's id here at its start and clears it (and wakes a waiter)
    // at its exit: the first word of its stack mapping, far below anything it uses.
    // SAFETY: the mapping is ours, zeroed, and 4-aligned.
    let tid = unsafe { &*stack.as_ptr().cast::<AtomicU32>() };
    let flags = libc::CLONE_VM
        | libc::CLONE_FS
        | libc::CLONE_FILES
        | libc::CLONE_SIGHAND
        | libc::CLONE_THREAD
        | libc::CLONE_SYSVSEM
        | libc::CLONE_PARENT_SETTID
        | libc::CLONE_CHILD_CLEARTID;
    let started = os::with_signals_blocked(|| {
        // SAFETY: the new thread runs `ask_the_loader` on the top of the fresh mapping, with
        // the caller's (blocked) signal mask and thread pointer; `tid` outlives it (the
        // mapping is unmapped only once the kernel has cleared it, and never if the thread
        // does not end).
        unsafe {
            libc::clone(
                ask_the_loader,
                stack.as_ptr().add(STACK).cast(),
                flags,
                core::ptr::null_mut(),
                tid.as_ptr(),
                core::ptr::null_mut::<c_void>(),
                tid.as_ptr(),
            )
        }
    }) > 0;
    // A thread that could not start says nothing about the loader: it is taken as answering.
    let ended = !started || ended_within(tid, timeout_ms, RUNNABLE_PATIENCE_MS);
    if ended {
        // SAFETY: no thread uses the mapping: none started, or the kernel cleared the id
        // after the thread's last use of its stack.
        unsafe { os::unmap(stack, STACK) };
    }
    ended
}

/// Waits at most `timeout_ms` for the kernel to clear `tid`, at the thread's exit.
fn ended_within(tid: &AtomicU32, timeout_ms: u64, runnable_ms: u64) -> bool {
    let start = os::monotonic_ns();
    let (mut deadline, last) = (start + timeout_ms * 1_000_000, start + runnable_ms * 1_000_000);
    loop {
        let id = tid.load(Ordering::Acquire);
        if id == 0 {
            return true;
        }
        let now = os::monotonic_ns();
        if now >= deadline {
            if now >= last || !runnable(id) {
                return false;
            }
            deadline = (now + 100_000_000).min(last);
        }
        let left = deadline - now;
        let wait = libc::timespec { tv_sec: (left / 1_000_000_000) as _, tv_nsec: (left % 1_000_000_000) as _ };
        // SAFETY: waits while the word still holds `id`, at most `wait`.
        unsafe { libc::syscall(libc::SYS_futex, tid.as_ptr(), libc::FUTEX_WAIT, id, &wait) };
    }
}

/// Whether thread `tid` of this process is running or waiting for a processor (`R` in its
/// `stat`), rather than asleep.
fn runnable(tid: u32) -> bool {
    let mut path = [0u8; 64];
    let mut stat = [0u8; 512];
    let Some(stat) = os::task_path(&mut path, os::getpid(), tid, b"stat").and_then(|p| os::read_file(p, &mut stat))
    else {
        return false;
    };
    // `tid (name) S ...`: the name may hold anything, the state follows its last `)`.
    let state = stat.iter().rposition(|&c| c == b')').and_then(|i| stat.get(i + 2));
    state == Some(&b'R')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_thread_is_runnable_and_a_sleeping_one_is_not() {
        assert!(runnable(os::gettid()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let sleeper = std::thread::spawn(move || {
            tx.send(os::gettid()).unwrap();
            done_rx.recv().unwrap();
        });
        let tid = rx.recv().unwrap();
        // Asleep in `recv` once it has sent its id (a moment after, on a loaded machine).
        let asleep = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            !runnable(tid)
        });
        done_tx.send(()).unwrap();
        sleeper.join().unwrap();
        assert!(asleep);
    }

    #[test]
    fn a_loader_that_answers_is_found_answering() {
        assert!(answers_within(PATIENCE_MS));
    }
}
