//! What a leak check reads from `/proc`, kept open from the tracker's start for a check that
//! can no longer open it: a program out of descriptors (a server at its `ulimit -n`), one that
//! `chroot`ed where there is no `/proc` (sshd's privilege separation, vsftpd), one whose
//! seccomp filter refuses `openat`. Without the process map nothing tells the program's memory
//! from the rest: every block read as definitely lost, and `exitcode` failed the program.

use core::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

use crate::kept_fd::{self, KeptFd};
use crate::os;

/// The kept descriptor of `/proc/self/maps`, and the process it was opened in.
static MAPS: KeptFd = KeptFd::new();
static PID: AtomicI32 = AtomicI32::new(0);

/// The program's path, as `/proc/self/exe` said at the start.
static PROGRAM: OnceLock<String> = OnceLock::new();

/// Opens the map to keep, and notes the program's path. Kept only at a high number (see
/// [`kept_fd::move_high`]): a program whose `ulimit -n` leaves no room there keeps its
/// lowest free numbers, and its checks go without.
pub(crate) fn keep() {
    PROGRAM.get_or_init(|| std::fs::read_link("/proc/self/exe").map(|p| p.display().to_string()).unwrap_or_default());
    if MAPS.raw() >= 0 {
        return;
    }
    let fd = os::open(c"/proc/self/maps", libc::O_RDONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return;
    }
    let Some(high) = kept_fd::move_high_or_close(fd) else { return };
    let Some(id) = os::file_identity(high) else {
        os::close(high);
        return;
    };
    PID.store(os::getpid() as i32, Ordering::Relaxed);
    MAPS.keep_as(high, id);
}

/// In a forked child: the descriptor kept reads the parent's map; the child's replaces it.
pub(crate) fn after_fork_child() {
    if MAPS.raw() >= 0 {
        MAPS.release();
        keep();
    }
}

/// The kept descriptor of this process's map, if it is still that (read it with `pread`).
pub(crate) fn map() -> Option<i32> {
    MAPS.get().filter(|_| PID.load(Ordering::Relaxed) == os::getpid() as i32)
}

/// The program's path: `/proc/self/exe` now (what valgrind answers with its client's path),
/// `/proc/thread-self/exe` (once the main thread has exited), or else what it was at the start.
/// A program the dynamic loader ran as a command (`ld.so ./prog`) has the loader for its
/// executable: then the program is the file the loader mapped first.
pub(crate) fn program() -> String {
    let exe = std::fs::read_link("/proc/self/exe")
        .or_else(|_| std::fs::read_link("/proc/thread-self/exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| PROGRAM.get().cloned().unwrap_or_default());
    if super::is_dynamic_loader_name(exe.rsplit('/').next().unwrap_or(&exe)) {
        return super::symbols::program_file().unwrap_or(exe);
    }
    exe
}
