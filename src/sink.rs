//! Where reports go: the `log_path` file or a private duplicate of stderr.
//!
//! The descriptor is opened (or duplicated) at start-up, because programs close their stderr
//! before exit (`ls` does, before `.fini_array` runs), and it is moved to a high number so that
//! a program that reuses low descriptors does not write over it. Before each report the
//! descriptor is checked to still be the file it was; if the program replaced it, the report
//! goes to the program's current stderr instead of into the program's own file.

use core::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::ffi::CString;

use crate::os;

/// The report descriptor, or -1.
static FD: AtomicI32 = AtomicI32::new(-1);
static DEV: AtomicU64 = AtomicU64::new(0);
static INO: AtomicU64 = AtomicU64::new(0);

/// `log_path` as given (with `%p`), for the child of a fork to open its own file.
static TEMPLATE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Replaces `%p` with the process id (and `%%` with `%`).
pub(crate) fn expand(template: &str, pid: u32) -> String {
    let mut out = String::with_capacity(template.len() + 8);
    let mut chars = template.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('p') => out.push_str(&pid.to_string()),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn identity(fd: i32) -> Option<(u64, u64)> {
    // SAFETY: stat is plain data, valid when zeroed; fstat only writes it.
    let mut st: libc::stat = unsafe { core::mem::zeroed() };
    // SAFETY: st is a valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some((st.st_dev, st.st_ino))
}

/// Moves `fd` to a high descriptor number, close-on-exec.
fn move_high(fd: i32) -> i32 {
    // SAFETY: rlimit is plain data; getrlimit only writes it.
    let mut lim: libc::rlimit = unsafe { core::mem::zeroed() };
    // SAFETY: lim is a valid out-pointer.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 { lim.rlim_cur } else { 1024 };
    let base = soft.clamp(64, 1024) as i32 - 32;
    // SAFETY: fcntl on a descriptor we own.
    let high = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, base) };
    if high < 0 {
        return fd;
    }
    // SAFETY: fd is ours (opened by us) and replaced by `high`.
    unsafe { libc::close(fd) };
    high
}

fn install(fd: i32) {
    let (dev, ino) = identity(fd).unwrap_or((0, 0));
    DEV.store(dev, Ordering::Relaxed);
    INO.store(ino, Ordering::Relaxed);
    FD.store(fd, Ordering::Release);
}

/// Opens `path` for writing at a high descriptor number: appending, or truncating it.
pub(crate) fn open_path(path: &str, append: bool) -> Result<i32, String> {
    let c = CString::new(path).map_err(|_| "the path contains a NUL byte".to_string())?;
    let mode = if append { libc::O_APPEND } else { libc::O_TRUNC };
    // SAFETY: c is NUL-terminated; the flags and mode are plain integers.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC | mode, 0o644) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    Ok(move_high(fd))
}

/// Duplicates stderr for the reports.
pub(crate) fn use_stderr() {
    // SAFETY: fcntl on fd 2; a closed stderr makes it fail harmlessly.
    let fd = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 0) };
    if fd >= 0 {
        install(move_high(fd));
    }
}

/// Opens `log_path` (`%p` = pid) for the reports, appending. On failure the reports go to
/// stderr and the error is returned for a one-line message.
pub(crate) fn use_path(template: &str) -> Result<(), String> {
    let path = expand(template, os::getpid());
    match open_path(&path, true) {
        Ok(fd) => {
            install(fd);
            if let Ok(mut t) = TEMPLATE.lock() {
                *t = Some(template.to_string());
            }
            Ok(())
        }
        Err(e) => {
            use_stderr();
            Err(format!("cannot open log_path '{path}': {e}"))
        }
    }
}

/// Child side of `fork`: a `%p` path names a file of its own.
pub(crate) fn after_fork_child() {
    let template = TEMPLATE.try_lock().ok().and_then(|t| t.clone());
    if let Some(template) = template
        && template.contains("%p")
        && let Ok(fd) = open_path(&expand(&template, os::getpid()), true)
    {
        let old = FD.swap(-1, Ordering::AcqRel);
        install(fd);
        if old >= 0 {
            // SAFETY: the inherited report descriptor is ours.
            unsafe { libc::close(old) };
        }
    }
}

/// Writes one report (whole lines) to the report descriptor. Never allocates.
pub(crate) fn write(bytes: &[u8]) {
    let fd = FD.load(Ordering::Acquire);
    let same = fd >= 0 && identity(fd) == Some((DEV.load(Ordering::Relaxed), INO.load(Ordering::Relaxed)));
    if !(same && os::write_all(fd, bytes)) {
        os::write_all(2, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_pid_and_percent() {
        assert_eq!(expand("/tmp/r.%p.log", 42), "/tmp/r.42.log");
        assert_eq!(expand("100%%-%p-%x%", 7), "100%-7-%x%");
    }
}
