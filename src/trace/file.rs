//! Where a process's trace goes: the file it opens at start, named from the `trace` option's
//! template (`%p`, or `PATH.PID` for a process that finds the path another's), locked while
//! its writer runs, and what becomes of an earlier trace at that path (an image before an
//! `exec` of this process: kept beside; an ended run's: replaced; a live writer's: left to it).

use core::sync::atomic::AtomicPtr;

use super::{Event, Header, write_header};
use crate::os::close;
use crate::{options, os, sink};

/// Opens a new, empty trace file for this process, locked for as long as its writer runs;
/// returns it and its path.
///
/// With `%p` the path is this process's own: an existing regular file there is unlinked
/// rather than truncated. A process that `exec`s keeps its pid, so the new image opens the
/// same path while the old image's writer may still be flushing its last events: into a
/// truncated file they would land over the new trace; into an unlinked one they go nowhere.
///
/// Without `%p` the path is shared by every process of the run: the first one takes it, and
/// the others write `PATH.PID` instead of clobbering it. A `descendant` always does: a forked
/// child, whose parent's trace is there, or a process whose environment names another
/// process as the path's taker (`trace_owner`, which the first process adds to the
/// `MALLOCSPY_OPTIONS` its descendants inherit: a child that `exec`d after its parent had
/// ended found the path unlocked and truncated the parent's trace). So does a process that
/// finds it locked by another's writer (a run started while another writes the same path).
/// A trace of this very process's image before an `exec` (its header has our pid) is
/// replaced as with `%p`, whether its writer still holds it or not: the program a wrapper
/// `exec`s (pyenv's shim of `python3` is a bash script) is the one asked for, and it wrote
/// `PATH.PID` while `PATH` kept the wrapper's few milliseconds.
///
/// Replaced, an earlier image's trace is kept beside as `PATH.before-exec` (`.2`, `.3` ...
/// for more): a child that worked for minutes and then `exec`d lost its trace to the new
/// program's (review helper 68), and an exec'd image's writer may still be flushing into it.
fn open(template: &str, descendant: bool, ours: &Header) -> Result<(i32, String), String> {
    let pid = os::getpid();
    let path = options::expand_path(template, pid);
    if options::names_pid(template) {
        return replace_unless_anothers(path, ours);
    }
    if descendant {
        return replace_unless_anothers(format!("{path}.{pid}"), ours);
    }
    let fd =
        sink::open_path(&path, true).map_err(|e| format!("cannot open trace '{}': {e}", options::shown_path(&path)))?;
    let before_exec = earlier_image(&path);
    if locked_by_another(fd) {
        close(fd);
        return if before_exec {
            replace_earlier(path, true)
        } else {
            replace_unless_anothers(format!("{path}.{pid}"), ours)
        };
    }
    if before_exec {
        close(fd);
        return replace_earlier(path, true);
    }
    // SAFETY: truncating a file we opened for writing.
    unsafe { libc::ftruncate(fd, 0) };
    forget_earlier_images(&path);
    Ok((fd, path))
}

/// The trace file of `header`'s process (see [`open`]), and who writes its header: the
/// process itself, into a regular file, before anything it runs can `exec`. The image after
/// an `exec` finds its pid there and takes the path over; written by the writer process, the
/// header was not always there yet (a shell's chain of `exec`s left an image's trace at
/// `PATH.PID`, 3 runs in 20). Anything else (a FIFO, a device) is left to the writer, which
/// blocks every signal: the program's own write to a FIFO its reader closed raised `SIGPIPE`.
pub(super) fn create(template: &str, descendant: bool, header: &Header) -> Result<(i32, String, HeaderWrite), String> {
    let (fd, path) = open(template, descendant, header)?;
    if !is_regular(fd) {
        return Ok((fd, path, HeaderWrite::ByWriter));
    }
    let mut head = Vec::new();
    write_header(&mut head, header);
    let write = match os::without_write_signals(|| os::write_whole(fd, &head)) {
        Ok(()) => HeaderWrite::Written(head.len() as u64),
        Err((errno, done)) => HeaderWrite::Failed { errno, written: done as u64 },
    };
    Ok((fd, path, write))
}

/// Who writes a trace's header (see [`create`]).
#[derive(Clone, Copy)]
pub(super) enum HeaderWrite {
    /// The writer process, first thing.
    ByWriter,
    /// The program did, this many bytes.
    Written(u64),
    /// The program's write failed after `written` bytes: the writer's first write error.
    Failed { errno: i32, written: u64 },
}

/// Whether `fd` is a regular file's.
fn is_regular(fd: i32) -> bool {
    os::fstat(fd).is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG)
}

/// Removes the trace at `path` that a writer could not start for, if it is a regular file: the
/// path may name a device (`trace=/dev/null`), which is not ours to remove.
pub(super) fn remove_trace(path: &str) {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file()) {
        let _ = std::fs::remove_file(path);
    }
}

/// Whether the file at `path` is the trace of an earlier image of this process (before an
/// `exec`): a regular file (a FIFO's read would take the reader's bytes, and wait for ever on
/// our own open end) whose header has our pid and a start no earlier than this process's. A
/// trace left by an earlier run with the same pid (a container's pid 1 each time) was taken
/// for one, and kept as `.before-exec` at every run (review helper 69). The process's start is
/// known to the kernel's clock tick (10 ms): a trace of a run that started less than that
/// before this process is told by its end record, which an image replaced by `exec` never
/// writes (looked for in a trace of at most [`ENDED_LOOKUP`] bytes: a run of 10 ms writes
/// less). (Marking each image in the environment it leaves, instead, deadlocked a forked
/// child in `putenv` and missed execs with an environment copied before a fork, or through
/// bash's own `putenv`: review helper 70.)
fn earlier_image(path: &str) -> bool {
    let header = || {
        if !std::fs::metadata(path).ok()?.is_file() {
            return None;
        }
        super::header_of(std::fs::File::open(path).ok()?)
    };
    let ended = || {
        // Only a short trace is read: an earlier image's may be gigabytes.
        let short = std::fs::metadata(path).is_ok_and(|m| m.len() <= ENDED_LOOKUP);
        let bytes = if short { std::fs::read(path).unwrap_or_default() } else { Vec::new() };
        short && super::Reader::new(&bytes).is_ok_and(|mut events| events.any(|e| matches!(e, Ok(Event::End { .. }))))
    };
    header().is_some_and(|h| match this_process(&h) {
        Some(this) => this,
        None => {
            h.pid == os::getpid()
                && os::process_start_unix_ns().is_none_or(|start| h.start_unix_ns >= start)
                && !ended()
        }
    })
}

/// Whether `h` is a header of this process, an image of it before an `exec` or this one: its
/// pid, pid namespace and start (see [`Header::process_start_ticks`]). `None` where the header
/// (version 1) or `/proc` does not say.
fn this_process(h: &Header) -> Option<bool> {
    if h.process_start_ticks == 0 || h.pid_namespace == 0 {
        return None;
    }
    let (start, namespace) = (os::process_start_ticks()?, os::pid_namespace()?);
    Some(h.pid == os::getpid() && h.pid_namespace == namespace && h.process_start_ticks == start)
}

/// [`replace`], unless `path` holds the trace of another process that is not an earlier run's:
/// one of this run (`record_run` in both headers' options), or one whose writer holds it still.
/// The same pid in another pid namespace names it alike: sibling containers each have a pid 1,
/// and their traces replaced each other, or were taken for earlier images of one process and
/// kept as `.before-exec` (review helper 156). Ours then goes beside it, as `PATH.2`, `PATH.3`,
/// ...: the first that is free, an earlier run's, or this process's own before an `exec`. A
/// file is made with `O_EXCL` (siblings started together each unlinked the one another had just
/// made), and an earlier run's (with a header, and no writer) is removed only while it is
/// still that file, by the one that holds its lock: between a sibling's look and its removal,
/// another removed it and put its own there, which the sibling then removed (1 run in 25 of
/// the sibling namespaces' test replacing a run's traces). An image after an `exec` looks for
/// its earlier image's trace first, and takes its place with a new file made alike: it took
/// the first free name instead, which a sibling's `exec` had just freed, and truncated the
/// file the sibling then made there (1 run in 45 of the sibling namespaces' test: one
/// `true`'s trace lost, its `sh`'s left).
fn replace_unless_anothers(path: String, ours: &Header) -> Result<(i32, String), String> {
    let run = ours.options.split(':').find(|o| o.starts_with("record_run="));
    // Judged by one descriptor, which the removal checks the path still names, and locked
    // until it is removed: a writer's, or one a sibling is removing, is locked already.
    let anothers = |file: &std::fs::File| {
        let header = || super::header_of(file);
        held_by_another(file) || header().is_some_and(|h| run.is_some_and(|run| h.options.split(':').any(|o| o == run)))
    };
    let names = || std::iter::once(path.clone()).chain((2..1000).map(|n| format!("{path}.{n}")));
    if let Some(at) = earliers_name(names()) {
        clear(&at, true);
        match make_locked(&at) {
            Ok(fd) => return Ok((fd, at)),
            // Taken by a sibling while it was free: ours goes where another would.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(_) => return open_cleared(at),
        }
    }
    for at in names() {
        match std::fs::symlink_metadata(&at) {
            // A symbolic link, a FIFO or a device is written through, as ever.
            Ok(m) if !m.file_type().is_file() => return replace(at),
            Ok(_) => {
                let Ok(file) = std::fs::File::open(&at) else { continue };
                if anothers(&file) {
                    continue;
                }
                // An earlier run's, and ours to remove while the lock is ours; so are the
                // traces it kept beside.
                if remove_if_still(&at, std::os::fd::AsRawFd::as_raw_fd(&file)) {
                    forget_earlier_images(&at);
                }
                drop(file);
            }
            Err(_) => {}
        }
        match make_locked(&at) {
            Ok(fd) => return Ok((fd, at)),
            // Made by another meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            // A directory we may not write in: a file already there is written over, as ever.
            Err(_) if at == path => return replace(path),
            Err(e) => return Err(format!("cannot open trace '{}': {e}", options::shown_path(&at))),
        }
    }
    replace(path)
}

/// Which of `names` holds the trace of this process's image before an `exec`, looked for while
/// the names are taken: they are taken from the first, and a name is free for a moment while
/// its trace is replaced (or a few more, after a failure).
fn earliers_name(names: impl Iterator<Item = String>) -> Option<String> {
    const FREE_IN_A_ROW: usize = 8;
    let mut free = 0;
    for at in names {
        if std::fs::symlink_metadata(&at).is_err() {
            free += 1;
            if free == FREE_IN_A_ROW {
                return None;
            }
            continue;
        }
        free = 0;
        if earlier_image(&at) {
            return Some(at);
        }
    }
    None
}

/// A new file at `path`, locked before it appears there: made under another name, locked,
/// then linked to `path`, which fails if a file is there (a sibling that found it unlocked,
/// just made, took it for an earlier run's, and unlinked it). Where the file system makes no
/// links, made at `path` with `O_EXCL`, then locked. The other name is random: named by the
/// pid, it was the same for siblings in pid namespaces of their own, which then unlinked
/// each other's and linked the wrong one (1 run in 36 of the sibling namespaces' test: a
/// `seq`'s trace lost, written to a file with no name).
fn make_locked(path: &str) -> std::io::Result<i32> {
    use std::os::unix::fs::OpenOptionsExt;
    let make = |at: &str| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(at)
            .map(std::os::fd::IntoRawFd::into_raw_fd)
    };
    // Made at `path`, then locked: one a sibling locked first is its to remove.
    let made_at_path = |directory_refused: Option<std::io::Error>| {
        let fd = match make(path) {
            // A directory we may not write in: its error, for the file there to be written
            // over (the file's own existence said nothing of that).
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(directory_refused.unwrap_or(e)),
            made => made?,
        };
        if locked_by_another(fd) {
            close(fd);
            return Err(std::io::ErrorKind::AlreadyExists.into());
        }
        Ok(fd)
    };
    let making = format!("{path}.making.{:016x}", os::random_u64());
    let fd = match make(&making) {
        Ok(fd) => fd,
        Err(e) => {
            let refused = matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM | libc::EROFS));
            return made_at_path(refused.then_some(e));
        }
    };
    // A new file: the lock is ours, for the next process to find.
    locked_by_another(fd);
    let linked = std::fs::hard_link(&making, path);
    let _ = std::fs::remove_file(&making);
    match linked {
        Ok(()) => Ok(fd),
        Err(e) => {
            close(fd);
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                return Err(e);
            }
            made_at_path(None)
        }
    }
}

/// Whether another open file holds the lock of `file` (a writer's, or a sibling's about to
/// remove it), taking it if not (see [`locked_by_another`]). NFS's emulation of `flock` takes
/// an exclusive lock only on a file open for writing, and refuses it on `file`: a shared one
/// is then asked for, which a writer's refuses too.
fn held_by_another(file: &std::fs::File) -> bool {
    let fd = std::os::fd::AsRawFd::as_raw_fd(file);
    // SAFETY: flock on the descriptor of `file`, open for as long as the call.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return false;
    }
    match os::errno() {
        libc::EWOULDBLOCK => true,
        libc::EBADF => {
            // SAFETY: as above.
            let refused = unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) } != 0;
            refused && os::errno() == libc::EWOULDBLOCK
        }
        // Where nothing locks, no one can tell.
        _ => false,
    }
}

/// The largest trace [`earlier_image`] reads whole for an end record.
const ENDED_LOOKUP: u64 = 4 << 20;

/// A new, empty, locked file at `path`, replacing a regular file there: the trace of an
/// earlier image of this process is kept beside (see [`open`]), anything else unlinked.
fn replace(path: String) -> Result<(i32, String), String> {
    let earlier = earlier_image(&path);
    replace_earlier(path, earlier)
}

/// [`replace`], told whether `path` holds an earlier image's trace (`open` read it already).
fn replace_earlier(path: String, earlier: bool) -> Result<(i32, String), String> {
    clear(&path, earlier);
    open_cleared(path)
}

/// Takes the regular file at `path` away: the trace of an earlier image of this process
/// (`earlier`) is kept beside (see [`open`]) if it holds anything of its own, anything else
/// unlinked. A symbolic link stays, to be written through.
fn clear(path: &str, earlier: bool) {
    if !earlier {
        forget_earlier_images(path);
    }
    if let Ok(c) = std::ffi::CString::new(path) {
        // SAFETY: stat is plain data, valid when zeroed; lstat only writes it.
        let mut st: libc::stat = unsafe { core::mem::zeroed() };
        // SAFETY: c is NUL-terminated and st a valid out-pointer. A failed unlink (a read-only
        // directory) leaves the truncating open after it to do what it can.
        if unsafe { libc::lstat(c.as_ptr(), &mut st) } == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG {
            let judged = if earlier { holds_its_own_events(path) } else { Some(false) };
            let kept = if judged == Some(false) { None } else { keep_beside(path) };
            match kept {
                // SAFETY: as above.
                None => unsafe {
                    libc::unlink(c.as_ptr());
                },
                Some(kept) if judged.is_none() => drop_if_idle(&kept),
                Some(_) => {}
            }
        }
    }
}

/// The trace file at `path`, [`clear`]ed: made, or opened and truncated (what a failed unlink
/// left), and locked.
fn open_cleared(path: String) -> Result<(i32, String), String> {
    let fd = sink::open_path(&path, false)
        .map_err(|e| format!("cannot open trace '{}': {e}", options::shown_path(&path)))?;
    // A new file: the lock is ours, for the next process to find.
    locked_by_another(fd);
    Ok((fd, path))
}

/// Whether the trace at `path`, of an earlier image of this process (see [`earlier_image`]),
/// holds a record of that image's own: a sample, a free, statistics, a thread's end, lost
/// events. One that holds none but its modules (and the samples it inherited at a `fork`) is
/// not worth keeping: each command a shell forks and `exec`s left such a `PATH.before-exec`
/// beside its trace, as many again as a script ran commands. Its writer may still be
/// writing the image's last records: until it lets go of the file (its lock; for
/// [`DRAIN_WAIT_MS`] at most), only a record of its own decides. Where no one can tell (a
/// file system without `flock`, NFS's emulation of it on a file opened for reading), the
/// trace is kept. `None` when the writer is slow: the trace is kept, and a writer that then
/// ends with nothing of its own removes it (see [`remove_if_idle_before_exec`], and
/// [`drop_if_idle`] for one that ended meanwhile).
fn holds_its_own_events(path: &str) -> Option<bool> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    // Not blocking: a FIFO put at the path since it was looked at waits for no writer.
    let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path) else {
        return Some(false);
    };
    let start = os::monotonic_ns();
    loop {
        // Looked at in this order: once its writer has let go, the file is whole.
        // SAFETY: flock on a descriptor we own.
        let done = match unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } {
            0 => true,
            _ if os::errno() == libc::EWOULDBLOCK => false,
            _ => return Some(true),
        };
        // While it is written, only a short trace is read again and again: a child of a
        // large heap inherits megabytes of samples, read once its writer is done.
        let short = file.metadata().is_ok_and(|m| m.len() <= READ_WHILE_WRITTEN);
        let found = if done || short { own_events(&file) } else { None };
        match (found, done) {
            (Some(true), _) => return Some(true),
            (found, true) => return Some(found != Some(false)),
            (_, false) if os::monotonic_ns() - start > DRAIN_WAIT_MS * 1_000_000 => return None,
            _ => os::pause_us(1000),
        }
    }
}

/// After [`keep_beside`] kept the trace at `kept` while its writer was still at work: if the
/// writer has let go of it since, removes it when it holds nothing of its image's own. The
/// writer's end judges the trace by its name, and may have come just before the rename.
fn drop_if_idle(kept: &str) {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(kept) else {
        return;
    };
    // SAFETY: flock on a descriptor we own.
    let let_go = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
    if let_go && own_events(&file) == Some(false) {
        remove_if_still(kept, file.as_raw_fd());
    }
}

/// Removes the file at `path` if it is still the one open as `fd` (not another put there
/// since); whether it did.
fn remove_if_still(path: impl AsRef<std::path::Path>, fd: i32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let here = std::fs::symlink_metadata(&path).map(|m| (m.dev(), m.ino()));
    here.is_ok_and(|id| os::file_identity(fd) == Some(id)) && std::fs::remove_file(path).is_ok()
}

/// The longest trace [`holds_its_own_events`] reads while its writer may still write it.
const READ_WHILE_WRITTEN: u64 = 64 << 10;

/// The longest an image waits for the writer of its image before an `exec` (see
/// [`holds_its_own_events`]): that writer, told of the `exec` by its socket's end, leaves
/// within a millisecond when it has nothing to write.
const DRAIN_WAIT_MS: u64 = 20;

/// Whether `file`, a trace, holds a record other than a module's, a stack's or an inherited
/// sample's; `None` when it cannot tell (cut in the middle of a record, or not a trace).
fn own_events(file: &std::fs::File) -> Option<bool> {
    use std::os::unix::fs::FileExt;
    // Past this, it is kept unread (1.6 million inherited samples).
    const READ_AT_MOST: u64 = 64 << 20;
    let len = file.metadata().ok()?.len();
    if len > READ_AT_MOST {
        return Some(true);
    }
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, 0).ok()?;
    let mut events = super::Reader::new(&bytes).ok()?;
    for event in events.by_ref() {
        if is_own(&event.ok()?) {
            return Some(true);
        }
    }
    // A record cut short may be one of its own, half written.
    events.truncated().is_none().then_some(false)
}

/// Whether `event` is a record of the traced image's own work (see [`holds_its_own_events`]).
pub(super) fn is_own(event: &Event) -> bool {
    !matches!(
        event,
        Event::ModuleLoad { .. } | Event::ModuleUnload { .. } | Event::Stack { .. } | Event::Inherited { .. }
    )
}

/// At the end of a writer whose program `exec`d (its trace without an end) having recorded
/// nothing of its own: removes the trace if the new image kept it beside its own as
/// `NAME.before-exec` (`.2`, ...) while this writer was still at work (see
/// [`holds_its_own_events`]), `NAME` being the trace's name at the writer's start. Under that
/// name the trace is the new image's to judge; under any other, someone else's. Found by the
/// file's identity: the descriptor's own name is the one it was made under (see
/// [`make_locked`]), and such a trace was never removed.
pub(super) fn remove_if_idle_before_exec(fd: i32, first_name: &str) {
    use std::os::unix::fs::MetadataExt;
    let Some(ours) = os::file_identity(fd) else { return };
    let is_ours = |name: &String| std::fs::symlink_metadata(name).is_ok_and(|m| (m.dev(), m.ino()) == ours);
    if let Some(kept) = (1..=KEPT_BESIDE).map(|n| before_exec_name(first_name, n)).find(is_ours) {
        remove_if_still(kept, fd);
    }
}

/// How many traces of earlier images are kept beside one (see [`keep_beside`]).
const KEPT_BESIDE: u32 = 100;

/// The name of the `n`th trace kept beside `path` (from 1): `PATH.before-exec`, `.2`, ...
fn before_exec_name(path: &str, n: u32) -> String {
    if n == 1 { format!("{path}.before-exec") } else { format!("{path}.before-exec.{n}") }
}

/// Removes the traces kept beside `path` (see [`keep_beside`]) by an earlier run, whose trace
/// this run's replaces: this run's images before an `exec` are kept under the same names,
/// from the first free one, and a run that `exec`d once after two that had left
/// `PATH.before-exec` and `.2` left its own as `.3`, the first name its parent's (review
/// helper 123). Only traces: the names stop at the first that is not one.
fn forget_earlier_images(path: &str) {
    use std::io::Read;
    for n in 1..=KEPT_BESIDE {
        let name = before_exec_name(path, n);
        let mut magic = [0u8; super::MAGIC.len()];
        let is_trace = std::fs::symlink_metadata(&name).is_ok_and(|m| m.file_type().is_file())
            && std::fs::File::open(&name).and_then(|mut f| f.read_exact(&mut magic)).is_ok()
            && &magic == super::MAGIC;
        if !is_trace || std::fs::remove_file(&name).is_err() {
            return;
        }
    }
}

/// Renames the trace at `path` to the first free `PATH.before-exec`, `PATH.before-exec.2`, ...;
/// the name it took, if it did (another file system's refusal, a hundred taken: it is
/// replaced).
fn keep_beside(path: &str) -> Option<String> {
    let from = std::ffi::CString::new(path).ok()?;
    for n in 1..=KEPT_BESIDE {
        let name = before_exec_name(path, n);
        let to = std::ffi::CString::new(name.as_str()).ok()?;
        // SAFETY: two NUL-terminated paths; RENAME_NOREPLACE fails rather than replace `to`.
        let renamed = unsafe {
            libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_NOREPLACE)
        } == 0;
        match (renamed, os::errno()) {
            (true, _) => return Some(name),
            (false, libc::EEXIST) => continue,
            // A file system without RENAME_NOREPLACE: look first.
            (false, libc::EINVAL | libc::ENOSYS) => {
                // SAFETY: as above; `access` only looks.
                if unsafe { libc::access(to.as_ptr(), libc::F_OK) } != 0 {
                    // SAFETY: as above.
                    return (unsafe { libc::rename(from.as_ptr(), to.as_ptr()) } == 0).then_some(name);
                }
            }
            (false, _) => return None,
        }
    }
    None
}

/// Takes `fd`'s file lock without waiting; `true` when another open file (another process's
/// writer) holds it. Where nothing locks (a file system without `flock`, a pipe) no one can
/// tell, and the file is ours. The lock belongs to the open file, so it passes to the writer
/// process with the descriptor and ends when the writer closes it.
fn locked_by_another(fd: i32) -> bool {
    // SAFETY: flock on a descriptor we own.
    let failed = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0;
    failed && os::errno() == libc::EWOULDBLOCK
}

/// Adds `trace_owner=PID` to this process's `MALLOCSPY_OPTIONS`, which its descendants
/// inherit: they then write `PATH.PID` (see [`open`]). Called at start-up, before the
/// program's code runs; the entry replaces the variable's in `environ` (no other variable is
/// added, and the program sees one more key in a variable that is ours).
///
/// By the C library's `putenv`, not the one the program may export: bash's kept the entry in
/// its table of variables (not yet read from `environ`, and then read over), so its children
/// never saw the owner and the first one to start took the trace's path from bash's own
/// trace; and its copy of the entry was a leak in bash's report (review helper 128).
pub(super) fn name_owner_for_descendants(pid: u32) {
    static PUTENV: AtomicPtr<libc::c_void> = AtomicPtr::new(core::ptr::null_mut());
    let Ok(options) = std::env::var("MALLOCSPY_OPTIONS") else { return };
    let Ok(entry) = std::ffi::CString::new(format!("MALLOCSPY_OPTIONS={options}:trace_owner={pid}")) else { return };
    let putenv = os::next_symbol_cached(&PUTENV, c"putenv");
    if putenv.is_null() {
        return;
    }
    // SAFETY: the C library's putenv, given a NUL-terminated `name=value` string that is
    // never freed (putenv keeps it); replacing an existing variable, it allocates nothing.
    unsafe {
        core::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(*mut libc::c_char) -> libc::c_int>(putenv)(
            entry.into_raw(),
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::writer::unix_now_ns;
    use crate::trace::{Module, write_event};

    #[test]
    fn a_reopened_trace_is_not_overwritten_by_the_previous_writer() {
        let _alone = crate::trace::FORKING_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let template = dir.path().join("t.%p.trace");
        let template = template.to_str().unwrap();
        let before_exec = open(template, false, &Header::default()).unwrap().0;
        // Its header names this process, which an `exec` keeps.
        let this = Header {
            pid: os::getpid(),
            start_unix_ns: unix_now_ns(),
            pid_namespace: os::pid_namespace().unwrap(),
            process_start_ticks: os::process_start_ticks().unwrap(),
            ..Header::default()
        };
        let mut header = Vec::new();
        write_header(&mut header, &this);
        assert!(os::write_all(before_exec, &header));
        assert!(os::write_all(before_exec, b"old image's events"));
        // The image after exec opens the same path (same pid) and writes its trace ...
        let after_exec = open(template, false, &Header::default()).unwrap().0;
        assert!(os::write_all(after_exec, b"new"));
        // ... while the old image's writer flushes its last events.
        assert!(os::write_all(before_exec, b" and the last ones"));
        close(before_exec);
        close(after_exec);
        let path = options::expand_path(template, os::getpid());
        assert_eq!(std::fs::read(path).unwrap(), b"new");
    }

    /// An image that `exec`s right after its start (a shell's `exec` chain) takes over the
    /// trace its writer still holds: the header naming its pid is there from the start.
    #[test]
    fn an_exec_right_after_the_start_takes_the_trace_over() {
        let _alone = crate::trace::FORKING_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let template = dir.path().join("exec.trace");
        let template = template.to_str().unwrap();
        let header = |command: &str| Header {
            pid: os::getpid(),
            command: vec![command.to_string()],
            start_unix_ns: unix_now_ns(),
            ..Header::default()
        };
        let (before_exec, path, _) = create(template, false, &header("sh")).unwrap();
        assert_eq!(path, template);
        let (after_exec, path, written) = create(template, false, &header("echo")).unwrap();
        assert_eq!(path, template);
        let HeaderWrite::Written(written) = written else { panic!("a regular file's header is the program's") };
        close(before_exec);
        close(after_exec);
        let trace = std::fs::read(template).unwrap();
        assert_eq!(trace.len() as u64, written);
        assert_eq!(super::super::Reader::new(&trace).unwrap().header().command, ["echo"]);
        assert!(!std::path::Path::new(&format!("{template}.{}", os::getpid())).exists());
        let kept = std::fs::read(format!("{template}.before-exec")).unwrap();
        assert_eq!(super::super::Reader::new(&kept).unwrap().header().command, ["sh"], "the earlier image's, kept");
    }

    /// The trace of an image that worked and then `exec`d is kept beside the new one's, with
    /// what its writer adds after the `exec`, whether or not that writer still held it, with
    /// `%p` or without (review helper 68: a child's 744 MiB of work gone without a word).
    #[test]
    fn the_trace_of_an_image_before_an_exec_is_kept_beside() {
        let _alone = crate::trace::FORKING_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let header = |command: &str| Header {
            pid: os::getpid(),
            command: vec![command.to_string()],
            start_unix_ns: unix_now_ns(),
            ..Header::default()
        };
        let command = |path: &str| {
            let bytes = std::fs::read(path).unwrap();
            super::super::Reader::new(&bytes).unwrap().header().command.clone()
        };
        for name in ["t.%p.trace", "shared.trace"] {
            let template = dir.path().join(name);
            let template = template.to_str().unwrap();
            let path = options::expand_path(template, os::getpid());
            // The first image's writer still writes; the second's is done when the third starts.
            let (first, _, _) = create(template, false, &header("worker")).unwrap();
            let (second, second_path, _) = create(template, false, &header("sh")).unwrap();
            assert!(os::write_all(first, b"+"), "the first image's writer flushes its last events");
            close(first);
            let mut own = Vec::new();
            write_event(&mut own, &Event::Free { time_ns: 1, thread: 0, address: 0x1000 });
            assert!(os::write_all(second, &own));
            close(second);
            let (third, third_path, _) = create(template, false, &header("ls")).unwrap();
            close(third);
            assert_eq!((second_path.as_str(), third_path.as_str()), (path.as_str(), path.as_str()));
            assert_eq!(command(&path), ["ls"]);
            assert_eq!(command(&format!("{path}.before-exec")), ["worker"]);
            assert!(std::fs::read(format!("{path}.before-exec")).unwrap().ends_with(b"+"));
            assert_eq!(command(&format!("{path}.before-exec.2")), ["sh"]);
            // The next run (this one's trace ended) replaces the chain: kept, the earlier
            // images' traces took the names of its own.
            let mut end = Vec::new();
            write_event(&mut end, &Event::End { time_ns: 1 });
            std::io::Write::write_all(&mut std::fs::OpenOptions::new().append(true).open(&path).unwrap(), &end)
                .unwrap();
            let not_a_trace = format!("{path}.before-exec.3");
            std::fs::write(&not_a_trace, b"notes").unwrap();
            let (next, _, _) = create(template, false, &header("next-run")).unwrap();
            close(next);
            assert_eq!(command(&path), ["next-run"]);
            for kept in [format!("{path}.before-exec"), format!("{path}.before-exec.2")] {
                assert!(!std::path::Path::new(&kept).exists(), "{kept} left");
            }
            assert_eq!(std::fs::read(&not_a_trace).unwrap(), b"notes");
            std::fs::remove_file(not_a_trace).unwrap();
        }
        // An image that recorded nothing of its own (a shell's child between its `fork` and
        // its `exec`) is not kept: its modules, and the samples it inherited, are not its work.
        let template = dir.path().join("forked.trace");
        let template = template.to_str().unwrap();
        let (child, _, _) = create(template, false, &header("bash")).unwrap();
        let mut modules = Vec::new();
        let module = Module { path: "/bin/bash".into(), ranges: vec![(0x1000, 0x2000)], ..Module::default() };
        write_event(&mut modules, &Event::ModuleLoad { time_ns: 0, module });
        let inherited = Event::Inherited { parent: 1, kind: 0, size: 64, address: 0x1000, weight: 4096 };
        write_event(&mut modules, &inherited);
        assert!(os::write_all(child, &modules));
        close(child);
        close(create(template, false, &header("ls")).unwrap().0);
        assert_eq!(command(template), ["ls"]);
        assert!(!std::path::Path::new(&format!("{template}.before-exec")).exists(), "nothing kept");
        // A trace with this pid that started before this process is an earlier run's (pid 1
        // of a container each time): replaced.
        let template = dir.path().join("stale.trace");
        let template = template.to_str().unwrap();
        let stale = Header { start_unix_ns: unix_now_ns() - 3_600_000_000_000, ..header("earlier-run") };
        close(create(template, false, &stale).unwrap().0);
        close(create(template, false, &header("this-run")).unwrap().0);
        assert_eq!(command(template), ["this-run"]);
        assert!(!std::path::Path::new(&format!("{template}.before-exec")).exists(), "nothing kept");
        // So is one that started at once before this process, which its end record tells.
        std::fs::remove_file(template).unwrap();
        let (fd, _, _) = create(template, false, &header("ended-run")).unwrap();
        let mut end = Vec::new();
        write_event(&mut end, &Event::End { time_ns: 5 });
        assert!(os::write_all(fd, &end));
        close(fd);
        close(create(template, false, &header("next-run")).unwrap().0);
        assert_eq!(command(template), ["next-run"]);
        assert!(!std::path::Path::new(&format!("{template}.before-exec")).exists(), "nothing kept");
    }

    /// The program writes nothing into a FIFO: a write there after the reader closed raised
    /// `SIGPIPE` in the program, which died of it. The writer, which blocks every signal,
    /// writes the header.
    #[test]
    fn the_program_leaves_a_fifos_header_to_the_writer() {
        let _alone = crate::trace::FORKING_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path; the reader's descriptor is ours.
        let reader = unsafe {
            assert_eq!(libc::mkfifo(c.as_ptr(), 0o600), 0);
            libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK)
        };
        assert!(reader >= 0);
        let header = Header { pid: os::getpid(), ..Header::default() };
        let (fd, _, write) = create(fifo.to_str().unwrap(), false, &header).unwrap();
        assert!(matches!(write, HeaderWrite::ByWriter));
        let mut byte = 0u8;
        // SAFETY: one byte into a local.
        let read = unsafe { libc::read(reader, (&raw mut byte).cast(), 1) };
        assert_eq!((read, os::errno()), (-1, libc::EAGAIN), "nothing written");
        close(fd);
        close(reader);
    }

    #[test]
    fn a_shared_trace_path_taken_by_a_live_writer_is_left_to_it() {
        let _alone = crate::trace::FORKING_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let template = dir.path().join("shared.trace");
        let template = template.to_str().unwrap();
        let first = open(template, false, &Header::default()).unwrap().0;
        assert!(os::write_all(first, b"first"));
        // A second process (an exec'd child) finds the path locked: it takes PATH.PID.
        let (second, second_path) = open(template, false, &Header::default()).unwrap();
        assert!(os::write_all(second, b"second"));
        let own = format!("{template}.{}", os::getpid());
        assert_eq!(second_path, own);
        assert_eq!(std::fs::read(template).unwrap(), b"first");
        assert_eq!(std::fs::read(&own).unwrap(), b"second");
        // Once the first writer is done, the path is free for the next run, and truncated.
        close(first);
        close(second);
        let third = open(template, false, &Header::default()).unwrap().0;
        assert!(os::write_all(third, b"3"));
        close(third);
        assert_eq!(std::fs::read(template).unwrap(), b"3");
        // A forked child takes PATH.PID even when PATH is free: its parent's trace is there.
        let child = open(template, true, &Header::default()).unwrap().0;
        assert!(os::write_all(child, b"child"));
        close(child);
        assert_eq!(std::fs::read(template).unwrap(), b"3");
        assert_eq!(std::fs::read(&own).unwrap(), b"child");
    }
}
