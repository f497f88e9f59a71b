//! `kill(-1, signal)`: a signal to every process the caller may signal but itself and its pid
//! namespace's init. mallocspy's trace writers are the program's processes too (each forked by
//! the process it writes for), and the kernel's call killed them: a container's init that
//! killed all at its end lost the last events of every trace, its own among them, and its call
//! succeeded where natively nothing was left to signal (ESRCH; review helper 156). Here the
//! call signals each other process itself, found in `/proc`, and leaves the writers out: they
//! block every signal they can, and end with the programs they write for.
//!
//! One call per process, not one for all: a process forked meanwhile by one not signalled yet
//! escapes a look, so for SIGKILL and SIGSTOP, after which a signalled process forks no more,
//! the looks go on until one finds no process not signalled yet (a chain of processes that
//! each fork and exit outran two looks: review helper 159). Only where this process writes a
//! trace: without one, no writer of ours is there to spare, and the call is the kernel's. It
//! is the kernel's too where `/proc` is not this pid namespace's (`unshare -pf` without
//! `--mount-proc`: its pids are another namespace's) or cannot be read. System calls and the stack only: the call
//! is async-signal-safe, and an init makes it from its handler of SIGTERM.

use core::ffi::{CStr, c_int, c_void};
use core::sync::atomic::AtomicPtr;

use crate::os;

/// The next library's `kill` (libc's).
static NEXT: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// What a trace writer names itself (`PR_SET_NAME`), as `/proc/PID/comm` shows it.
const WRITER_COMM: &[u8] = b"mallocspy-trace\n";

/// The most looks for SIGKILL and SIGSTOP (see the module's documentation).
const MOST_LOOKS: usize = 64;

/// One bit per pid the kernel may give (`PID_MAX_LIMIT` on 64 bits).
const PIDS: usize = 1 << 22;

/// Looks up the next `kill` at start (see [`crate::program_mappings::warm_up`]).
pub(crate) fn warm_up() {
    os::next_symbol_cached(&NEXT, c"kill");
}

/// C's `kill`: [`kill_all`] for `pid` -1 in a process that writes a trace, the next library's
/// otherwise.
///
/// # Safety
/// None beyond C's: the arguments are plain integers.
pub(crate) unsafe fn kill(pid: c_int, signal: c_int) -> c_int {
    if pid == -1
        && crate::trace::writer::writer().is_some()
        && let Some(result) = kill_all(signal)
    {
        return result;
    }
    next_kill(pid, signal)
}

/// `kill(pid, signal)` by the next library's `kill` (the system call before it is looked up).
fn next_kill(pid: c_int, signal: c_int) -> c_int {
    let f = os::next_symbol_cached(&NEXT, c"kill");
    if f.is_null() {
        // SAFETY: kill takes two integers.
        return unsafe { libc::syscall(libc::SYS_kill, pid, signal) as c_int };
    }
    // SAFETY: the next library's `kill` has C's signature.
    unsafe { core::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int, c_int) -> c_int>(f)(pid, signal) }
}

/// `kill(-1, signal)` without the trace writers (see the module's documentation), with the
/// kernel's result: 0 when some process was there to signal and no call to one failed for a
/// reason other than permission (the last such failure otherwise: EINVAL for a signal that is
/// none), ESRCH when none was. `None` when `/proc` cannot tell: nothing was signalled.
fn kill_all(signal: c_int) -> Option<c_int> {
    let errno = os::errno();
    let proc_fd = os::open(c"/proc", libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC);
    if proc_fd < 0 {
        os::set_errno(errno);
        return None;
    }
    let me = os::getpid();
    let result = if names_pid(proc_fd, c"self") == Some(me) { signal_each(proc_fd, me, signal) } else { None };
    os::close(proc_fd);
    let Some((found, last)) = result else {
        os::set_errno(errno);
        return None;
    };
    let error = if found == 0 { libc::ESRCH } else { last };
    os::set_errno(if error == 0 { errno } else { error });
    Some(if error == 0 { 0 } else { -1 })
}

/// Sends `signal` to each process `/proc` (open as `proc_fd`) lists but pid 1, `me` and the
/// trace writers, once each (see the module's documentation): how many were there, and the last
/// error other than permission's (0: none). `None` when `/proc` could not be read and nothing
/// was signalled.
fn signal_each(proc_fd: c_int, me: u32, signal: c_int) -> Option<(u32, c_int)> {
    let bytes = PIDS / 8;
    let signalled = os::map(bytes)?;
    // SAFETY: `bytes` zeroed bytes just mapped, ours alone until unmapped below.
    let bits = unsafe { core::slice::from_raw_parts_mut(signalled.as_ptr().cast::<u64>(), bytes / 8) };
    let (mut found, mut last) = (0u32, 0);
    let looks = if matches!(signal, libc::SIGKILL | libc::SIGSTOP) { MOST_LOOKS } else { 1 };
    let mut readable = true;
    for _ in 0..looks {
        let mut new = 0;
        readable = each_process(proc_fd, |pid| {
            let (word, bit) = (pid as usize / 64, 1u64 << (pid % 64));
            if pid <= 1 || pid == me || bits.get(word).is_some_and(|w| w & bit != 0) {
                return;
            }
            if let Some(w) = bits.get_mut(word) {
                *w |= bit;
            }
            if crate::trace::writer::is_child_writer(pid) || is_trace_writer(pid) {
                return;
            }
            new += 1;
            if next_kill(pid as c_int, signal) == 0 {
                (found, last) = (found + 1, 0);
                return;
            }
            match os::errno() {
                // Gone since it was listed: natively, not there to signal.
                libc::ESRCH => {}
                libc::EPERM => found += 1,
                error => (found, last) = (found + 1, error),
            }
        });
        if !readable || new == 0 {
            break;
        }
    }
    // SAFETY: the mapping above, which nothing uses any more.
    unsafe { os::unmap(signalled, bytes) };
    (readable || found > 0).then_some((found, last))
}

/// Where a `getdents64` entry's name starts.
const NAME_AT: usize = 19;

/// Calls `visit` with the pid of each process `/proc` (open as `proc_fd`) lists; false if it
/// could not be read to its end.
fn each_process(proc_fd: c_int, mut visit: impl FnMut(u32)) -> bool {
    // Rewound: the second look reads the directory afresh.
    // SAFETY: lseek takes integers.
    if unsafe { libc::lseek(proc_fd, 0, libc::SEEK_SET) } != 0 {
        return false;
    }
    #[repr(C, align(8))]
    struct Entries([u8; 4096]);
    let mut buf = Entries([0; 4096]);
    loop {
        // SAFETY: getdents64 writes at most buf's length into it.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, proc_fd, buf.0.as_mut_ptr(), buf.0.len()) };
        if n <= 0 {
            return n == 0;
        }
        let (mut at, n) = (0, n as usize);
        // Each entry: inode (8 bytes), offset (8), its length (2), type (1), the NUL-ended name.
        while at + NAME_AT < n {
            let len = u16::from_ne_bytes([buf.0[at + 16], buf.0[at + 17]]) as usize;
            if len <= NAME_AT || at + len > n {
                return false;
            }
            let name = &buf.0[at + NAME_AT..at + len];
            if let Some(pid) = decimal(&name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())]) {
                visit(pid);
            }
            at += len;
        }
    }
}

/// The number `name` spells in decimal digits, if it is one (`/proc`'s processes).
fn decimal(name: &[u8]) -> Option<u32> {
    if name.is_empty() || name.len() > 10 || !name.iter().all(u8::is_ascii_digit) {
        return None;
    }
    name.iter().try_fold(0u32, |n, &d| n.checked_mul(10)?.checked_add(u32::from(d - b'0')))
}

/// The pid the link `name` in `/proc` (open as `proc_fd`) names: `self`, this process as
/// `/proc` knows it.
fn names_pid(proc_fd: c_int, name: &CStr) -> Option<u32> {
    let mut buf = [0u8; 16];
    // SAFETY: readlinkat reads the NUL-terminated name and writes at most buf's length.
    let n = unsafe { libc::readlinkat(proc_fd, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    decimal(buf.get(..usize::try_from(n).ok()?)?)
}

/// Whether process `pid` is a trace writer, by its name.
fn is_trace_writer(pid: u32) -> bool {
    let (mut path, mut comm) = ([0u8; 64], [0u8; 32]);
    os::process_path(&mut path, pid, b"comm").and_then(|p| os::read_file(p, &mut comm)) == Some(WRITER_COMM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_decimal_names_are_processes() {
        assert_eq!(decimal(b"1"), Some(1));
        assert_eq!(decimal(b"4194304"), Some(4_194_304));
        for name in [&b""[..], b"self", b"12a", b"-1", b"99999999999", b"4294967296"] {
            assert_eq!(decimal(name), None, "{}", String::from_utf8_lossy(name));
        }
    }

    #[test]
    fn the_processes_listed_include_this_one_and_its_child() {
        let proc_fd = os::open(c"/proc", libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC);
        assert!(proc_fd >= 0);
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let (mut me, mut it) = (false, false);
        assert!(each_process(proc_fd, |pid| {
            me |= pid == std::process::id();
            it |= pid == child.id();
        }));
        assert!(me && it);
        assert_eq!(names_pid(proc_fd, c"self"), Some(std::process::id()));
        assert!(!is_trace_writer(child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
        os::close(proc_fd);
    }

    #[test]
    fn a_trace_writer_is_told_by_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let named = dir.path().join("mallocspy-trace");
        std::fs::copy("/bin/sleep", &named).unwrap();
        let mut writer = std::process::Command::new(&named).arg("5").spawn().unwrap();
        let mut other = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        // The name is the executable's once it runs.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !is_trace_writer(writer.id()) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(is_trace_writer(writer.id()));
        assert!(!is_trace_writer(other.id()));
        for child in [&mut writer, &mut other] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}
