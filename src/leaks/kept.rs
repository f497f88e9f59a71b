//! What a leak check reads from `/proc`, kept open from the tracker's start for a check that
//! can no longer open it: a program out of descriptors (a server at its `ulimit -n`), one that
//! `chroot`ed where there is no `/proc` (sshd's privilege separation, vsftpd), one whose
//! seccomp filter refuses `openat`. Without the process map nothing tells the program's memory
//! from the rest: every block read as definitely lost, and `exitcode` failed the program.

use core::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::os;

/// The kept descriptor of `/proc/self/maps` (-1: none), the process it was opened in and the
/// file it was (a program that closes every descriptor may reuse its number).
static FD: AtomicI32 = AtomicI32::new(-1);
static PID: AtomicI32 = AtomicI32::new(0);
static DEV: AtomicU64 = AtomicU64::new(0);
static INO: AtomicU64 = AtomicU64::new(0);

/// The program's path, as `/proc/self/exe` said at the start.
static PROGRAM: OnceLock<String> = OnceLock::new();

/// Opens the map to keep, and notes the program's path. Kept only at a high number (see
/// [`crate::sink::move_high`]): a program whose `ulimit -n` leaves no room there keeps its
/// lowest free numbers, and its checks go without.
pub(crate) fn keep() {
    PROGRAM.get_or_init(|| std::fs::read_link("/proc/self/exe").map(|p| p.display().to_string()).unwrap_or_default());
    if FD.load(Ordering::Acquire) >= 0 {
        return;
    }
    let fd = os::open(c"/proc/self/maps", libc::O_RDONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return;
    }
    let high = crate::sink::move_high(fd);
    let Some((dev, ino)) = os::file_identity(high).filter(|_| high != fd) else {
        os::close(high);
        return;
    };
    DEV.store(dev, Ordering::Relaxed);
    INO.store(ino, Ordering::Relaxed);
    PID.store(os::getpid() as i32, Ordering::Relaxed);
    FD.store(high, Ordering::Release);
}

/// In a forked child: the descriptor kept reads the parent's map; the child's replaces it.
pub(crate) fn after_fork_child() {
    let fd = FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        if is_ours(fd) {
            os::close(fd);
        }
        keep();
    }
}

fn is_ours(fd: i32) -> bool {
    os::is_file(fd, (DEV.load(Ordering::Relaxed), INO.load(Ordering::Relaxed)))
}

/// The kept descriptor of this process's map, if it is still that (read it with `pread`).
pub(crate) fn map() -> Option<i32> {
    let fd = FD.load(Ordering::Acquire);
    (fd >= 0 && PID.load(Ordering::Relaxed) == os::getpid() as i32 && is_ours(fd)).then_some(fd)
}

/// The program's path: `/proc/self/exe` now (what valgrind answers with its client's path),
/// `/proc/thread-self/exe` (once the main thread has exited), or else what it was at the start.
pub(crate) fn program() -> String {
    std::fs::read_link("/proc/self/exe")
        .or_else(|_| std::fs::read_link("/proc/thread-self/exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| PROGRAM.get().cloned().unwrap_or_default())
}
