//! Where reports go: the `log_path` file or a private duplicate of stderr.
//!
//! The descriptor is opened (or duplicated) at start-up, because programs close their stderr
//! before exit (`ls` does, before `.fini_array` runs), and it is moved to a high number so that
//! a program that reuses low descriptors does not write over it. Before each report the
//! descriptor is checked to still be the file it was. If the program closed or replaced it
//! (daemons and `closefrom`-style loops close every descriptor they did not open), the
//! `log_path` file is opened again; a duplicate of stderr cannot be, and the report then goes
//! to descriptor 2 if that is still the stderr the process started with. Never to whatever
//! else has the number: a program started with stderr closed gives descriptor 2 to the first
//! file it opens, and a report there would be written into the program's own file. Beside a
//! log file a duplicate of stderr is kept as well, for warnings and for a report the log file
//! refuses (a full disk), which a program that closed its stderr by then would otherwise lose.
//!
//! The child of a `fork` gives up the duplicate of stderr when its descriptor 2 is still that
//! stderr, and writes there: a daemon that points 0-2 at `/dev/null` after forking would
//! otherwise hold its caller's pipe open for its whole life, and `x=$(program 2>&1)` would
//! wait for it. A child whose parent had already moved descriptor 2 elsewhere (a server that
//! sends its stderr to a log and forks its workers) keeps the duplicate: it is its only way
//! to the stderr the reports belong on.

use core::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::ffi::CString;

use crate::kept_fd::{KeptFd, move_high, move_high_or_close};
use crate::options::{expand_path, names_pid, shown_path};
use crate::os;

/// The report descriptor.
static REPORT: KeptFd = KeptFd::new();

/// What descriptor 2 was when the reports' destination was chosen: [`STDERR_UNSEEN`] (never
/// chosen: the library used without the preload), [`STDERR_CLOSED`], or [`STDERR_OPEN`] with
/// its identity kept in `STDERR_COPY`.
static STDERR: AtomicU8 = AtomicU8::new(STDERR_UNSEEN);
/// A duplicate of that stderr (if one could be made), made with a log file as well: where the
/// reports and warnings that belong on stderr go once the program has closed its descriptor 2
/// (coreutils close it at exit, before the report is written). Without a log file it is the
/// report descriptor.
static STDERR_COPY: KeptFd = KeptFd::new();
const STDERR_UNSEEN: u8 = 0;
const STDERR_CLOSED: u8 = 1;
const STDERR_OPEN: u8 = 2;

/// `log_path` as given (with `%p`), for the child of a fork to open its own file.
static TEMPLATE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
/// The log file of this process (`log_path` expanded), to open again if the program closes
/// its descriptor. Made when the file is first opened, so that reopening does not allocate.
static PATH: std::sync::Mutex<Option<CString>> = std::sync::Mutex::new(None);
/// Whether the log file had a name when it was opened: one that never had (a memfd or an
/// `O_TMPFILE` file behind `log_path=/dev/stdout`) is not taken for one deleted since.
static NAMED: AtomicBool = AtomicBool::new(false);

/// Opens `path` for writing at a high descriptor number: appending, or truncating it.
pub(crate) fn open_path(path: &str, append: bool) -> Result<i32, String> {
    let c = CString::new(path).map_err(|_| "the path contains a NUL byte".to_string())?;
    open_c(&c, append).ok_or_else(|| open_error(&c))
}

/// Why [`open_c`] failed on `path`, in words.
fn open_error(path: &CString) -> String {
    let error = std::io::Error::last_os_error();
    // SAFETY: stat is plain data, valid when zeroed; stat only writes it.
    let mut st: libc::stat = unsafe { core::mem::zeroed() };
    // SAFETY: path is NUL-terminated and st a valid out-pointer.
    let fifo = unsafe { libc::stat(path.as_ptr(), &mut st) } == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO;
    match error.raw_os_error() {
        Some(libc::ENXIO) if fifo => "a FIFO that nothing reads".to_string(),
        _ => error.to_string(),
    }
}

/// [`open_path`] without allocating.
///
/// Opened non-blocking, because opening a FIFO for writing waits for a reader: a path naming
/// one that nobody reads would hang the program in its start-up. Such an open fails (`ENXIO`)
/// instead; one with a reader gets blocking writes back.
fn open_c(path: &CString, append: bool) -> Option<i32> {
    let mode = if append { libc::O_APPEND } else { libc::O_TRUNC };
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NONBLOCK | mode;
    // SAFETY: path is NUL-terminated; the flags and mode are plain integers.
    let fd = unsafe { libc::open(path.as_ptr(), flags, 0o644) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fcntl on the descriptor just opened.
    unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) & !libc::O_NONBLOCK) };
    Some(move_high(fd))
}

/// Opens this process's log file (from [`use_path`]) for the reports, appending.
fn use_log_file(path: String) -> Result<(), String> {
    // Absolute, so that the file opened again after a `chdir` is this one.
    let path = match std::env::current_dir() {
        Ok(cwd) if !path.starts_with('/') => cwd.join(path).to_string_lossy().into_owned(),
        _ => path,
    };
    let c = CString::new(path).map_err(|_| "the path contains a NUL byte".to_string())?;
    let fd = open_c(&c, true).ok_or_else(|| open_error(&c))?;
    NAMED.store(!os::is_unlinked(fd), Ordering::Relaxed);
    let old = REPORT.keep(fd);
    if old >= 0 && old != fd {
        // SAFETY: the report descriptor was ours (a fork's child inherits the parent's).
        unsafe { libc::close(old) };
    }
    // try_lock: in the child of a fork, another thread of the parent may have held it.
    if let Ok(mut p) = PATH.try_lock() {
        *p = Some(c);
    }
    Ok(())
}

/// Opens the log file again, for a program that closed or replaced its descriptor. Without
/// allocating or waiting: `false` if there is no log file or it cannot be opened now.
fn reopen_log_file() -> bool {
    let Ok(path) = PATH.try_lock() else { return false };
    let Some(fd) = path.as_ref().and_then(|c| open_c(c, true)) else { return false };
    NAMED.store(!os::is_unlinked(fd), Ordering::Relaxed);
    REPORT.keep(fd);
    true
}

/// Notes what descriptor 2 is now, at start-up, and keeps a duplicate of it: the stderr that
/// reports may fall back to.
fn note_stderr() {
    let old = match os::file_identity(2) {
        Some(id) => {
            // SAFETY: fcntl on fd 2, which is open.
            let copy = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 0) };
            // Under a limit with no room above the program's first free descriptor (`ulimit -n
            // 4`), none: a copy there took it (review helper 128: the program could open no
            // file), and reports go to descriptor 2 while it is this stderr.
            let kept = if copy < 0 { -1 } else { move_high_or_close(copy).unwrap_or(-1) };
            let old = STDERR_COPY.keep_as(kept, id);
            STDERR.store(STDERR_OPEN, Ordering::Release);
            old
        }
        None => {
            STDERR.store(STDERR_CLOSED, Ordering::Release);
            STDERR_COPY.take()
        }
    };
    if old >= 0 && old != REPORT.raw() {
        os::close(old);
    }
}

/// Whether `fd` is the stderr noted at start-up.
fn is_noted_stderr(fd: i32) -> bool {
    STDERR.load(Ordering::Acquire) == STDERR_OPEN && STDERR_COPY.is(fd)
}

/// Whether descriptor 2 is the stderr the process started with (or was never noted).
fn stderr_is_original() -> bool {
    match STDERR.load(Ordering::Acquire) {
        STDERR_UNSEEN => true,
        STDERR_OPEN => is_noted_stderr(2),
        _ => false,
    }
}

/// Writes `bytes` to the process's stderr: descriptor 2 if it is still that, or else the
/// duplicate kept of it. For warnings, which go to stderr even with a `log_path`, and for
/// reports that the log file refused.
pub(crate) fn to_stderr(bytes: &[u8]) {
    let mut held = Held::default();
    to_stderr_holding(bytes, &mut held);
    held.release();
}

fn to_stderr_holding(bytes: &[u8], held: &mut Held) {
    if stderr_is_original() {
        write_whole(2, bytes, held);
        return;
    }
    let copy = STDERR_COPY.raw();
    if is_noted_stderr(copy) {
        write_whole(copy, bytes, held);
    }
}

/// The lock [`write_whole`] took for a report written in parts ([`write_parts`]), kept until
/// its last part: the descriptor written and the locked one.
#[derive(Default)]
struct Held(Option<(i32, i32)>);

impl Held {
    fn release(self) {
        if let Some((_, lock)) = self.0 {
            // Closing the descriptor releases the lock.
            os::close(lock);
        }
    }
}

/// Writes `bytes` to `fd` with no other process's report in between: processes of one program
/// that end together share its stderr, and a pipe takes at most 64 KiB of a write at a time
/// (4 KiB whole), so their reports of a megabyte came out cut into each other (JSON objects
/// that no longer parsed). A longer report is written holding an exclusive `flock` on the
/// file behind `fd`, opened anew through `/proc` so that the lock is this process's own: a
/// lock on `fd` itself would be on the open file description the processes forked from one
/// another share, and theirs too. Without `/proc`, or for a file that cannot be opened again
/// (a socket; a FIFO left without a reader), or after ten seconds of waiting behind another
/// report (whose reader may have stopped reading), the report goes unlocked. The lock is kept
/// in `held` for the report's next parts.
fn write_whole(fd: i32, bytes: &[u8], held: &mut Held) -> bool {
    if bytes.len() <= libc::PIPE_BUF || held.0.is_some_and(|(locked, _)| locked == fd) {
        return os::write_all(fd, bytes);
    }
    let lock = lock_file_of(fd);
    let written = os::write_all(fd, bytes);
    match (lock, &held.0) {
        (Some(lock), None) => held.0 = Some((fd, lock)),
        (Some(lock), Some(_)) => os::close(lock),
        (None, _) => {}
    }
    written
}

/// A new descriptor of the file behind `fd`, locked (see [`write_whole`]). Never allocates.
fn lock_file_of(fd: i32) -> Option<i32> {
    use core::fmt::Write;
    let mut path = crate::line::Line::<32>::new();
    write!(path, "/proc/self/fd/{fd}\0").ok()?;
    // SAFETY: `path` is NUL-terminated; O_NONBLOCK: a FIFO's open does not wait for a reader.
    let lock = unsafe {
        libc::open(
            path.as_bytes().as_ptr().cast(),
            libc::O_WRONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if lock < 0 {
        return None;
    }
    let deadline = os::monotonic_ns() + 10_000_000_000;
    // SAFETY: flock on a descriptor of ours.
    while unsafe { libc::flock(lock, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        if os::errno() != libc::EWOULDBLOCK || os::monotonic_ns() > deadline {
            break;
        }
        os::pause_us(1000);
    }
    Some(lock)
}

/// Sends the reports to a duplicate of stderr.
pub(crate) fn use_stderr() {
    note_stderr();
    let copy = STDERR_COPY.raw();
    if copy >= 0 {
        REPORT.keep(copy);
    }
}

/// Whether the reports went to a log file that is the file at `path` (the trace's, where
/// they would damage it): they then go to stderr instead.
pub(crate) fn leave_file(path: &str) -> bool {
    let Ok(c) = CString::new(path) else { return false };
    // SAFETY: stat is plain data, valid when zeroed; stat only writes it.
    let mut st: libc::stat = unsafe { core::mem::zeroed() };
    // SAFETY: c is NUL-terminated and st a valid out-pointer.
    if unsafe { libc::stat(c.as_ptr(), &mut st) } != 0 {
        return false;
    }
    let fd = REPORT.raw();
    let log_file = PATH.lock().is_ok_and(|p| p.is_some());
    if !log_file || fd < 0 || os::file_identity(fd) != Some((st.st_dev, st.st_ino)) {
        return false;
    }
    if let Ok(mut t) = TEMPLATE.lock() {
        *t = None;
    }
    if let Ok(mut p) = PATH.lock() {
        *p = None;
    }
    use_stderr();
    // With stderr closed there is no copy of it: no reports, rather than a damaged trace.
    REPORT.forget(fd);
    // The log file's descriptor was ours, and is no longer the reports'.
    os::close(fd);
    true
}

/// Opens `log_path` (`%p` = pid) for the reports, appending. On failure the reports go to
/// stderr and the error is returned for a one-line message.
pub(crate) fn use_path(template: &str) -> Result<(), String> {
    note_stderr();
    let path = expand_path(template, os::getpid());
    match use_log_file(path.clone()) {
        Ok(()) => {
            if let Ok(mut t) = TEMPLATE.lock() {
                *t = Some(template.to_string());
            }
            Ok(())
        }
        Err(e) => {
            use_stderr();
            Err(format!("cannot open log_path '{}': {e}", shown_path(&path)))
        }
    }
}

/// Child side of `fork`: a `%p` path names a file of its own; the duplicate of stderr is
/// given up beside a log file, and without one while descriptor 2 is still that stderr (see
/// the module's docs).
pub(crate) fn after_fork_child() {
    let template = TEMPLATE.try_lock().ok().and_then(|t| t.clone());
    let log_file = template.is_some();
    if let Some(template) = template.filter(|t| names_pid(t)) {
        // On failure the child writes to the parent's file.
        let _ = use_log_file(expand_path(&template, os::getpid()));
    }
    // Beside a log file the copy is only a fallback: given up whatever descriptor 2 is now (a
    // parent that pointed it at /dev/null before forking a daemon left the daemon holding
    // its caller's pipe: review helper 84).
    if log_file || (STDERR.load(Ordering::Acquire) == STDERR_OPEN && stderr_is_original()) {
        let copy = STDERR_COPY.take();
        // Without a log file the copy is the report descriptor: the reports go to descriptor 2.
        REPORT.forget(copy);
        if is_noted_stderr(copy) {
            os::close(copy);
        }
    }
}

/// Whether `fd`, the report descriptor, is a log file that has no name left.
fn log_file_deleted(fd: i32) -> bool {
    NAMED.load(Ordering::Relaxed) && os::is_unlinked(fd) && PATH.try_lock().is_ok_and(|p| p.is_some())
}

/// Writes one report (whole lines) to the report descriptor. Never allocates.
pub(crate) fn write(bytes: &[u8]) {
    write_parts(&mut |emit| emit(bytes));
}

/// What a report's parts are given to, one after another.
pub(crate) type Emit<'a> = &'a mut dyn FnMut(&[u8]);

/// Writes one report that `give` hands over in parts, whole lines each, with no other
/// process's report between them (see [`write_whole`]): a leak report of many records is
/// made a part at a time, not held whole in memory. Allocates nothing of its own.
pub(crate) fn write_parts(give: &mut dyn FnMut(Emit<'_>)) {
    let mut held = Held::default();
    give(&mut |part| write_part(part, &mut held));
    held.release();
}

fn write_part(bytes: &[u8], held: &mut Held) {
    let fd = match REPORT.get() {
        // The log file deleted (its directory removed, `logrotate` without `copytruncate`):
        // written on, the report went nowhere, unsaid (review helper 105). It is made again
        // at its path, or else the report goes to stderr, said once.
        Some(fd) if log_file_deleted(fd) => {
            if reopen_log_file() {
                os::close(fd);
            } else {
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Ordering::Relaxed) {
                    to_stderr_holding(
                        b"mallocspy: the log file was deleted and cannot be made again; the report goes to stderr\n",
                        held,
                    );
                }
                REPORT.forget(fd);
                os::close(fd);
            }
            REPORT.get()
        }
        Some(fd) => Some(fd),
        None if reopen_log_file() => REPORT.get(),
        None => None,
    };
    let Some(fd) = fd else {
        return to_stderr_holding(bytes, held);
    };
    if !write_whole(fd, bytes, held) {
        // A full disk, or a path that takes no writes (`/dev/full`, a file in /proc): said once,
        // then the report goes where it would without a log.
        static SAID: AtomicBool = AtomicBool::new(false);
        let stderr_copy = STDERR.load(Ordering::Relaxed) == STDERR_OPEN && REPORT.identity() == STDERR_COPY.identity();
        if !stderr_copy && !SAID.swap(true, Ordering::Relaxed) {
            to_stderr_holding(b"mallocspy: writing to the log failed; the report goes to stderr\n", held);
        }
        to_stderr_holding(bytes, held);
    }
}
