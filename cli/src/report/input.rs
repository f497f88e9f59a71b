//! The trace's bytes: a regular file is mapped, not copied (a recording of an hour of a busy
//! program is gigabytes); anything else (a FIFO, `<(zcat trace.gz)`, the standard input as
//! `-`) is read whole.

use std::ffi::c_int;
use std::fs::File;
use std::io::{self, Read};
use std::ops::Deref;
use std::path::Path;
use std::sync::OnceLock;

use super::text::path_shown;
use mallocspy::trace::{MAGIC, read_on};

/// A trace's bytes, mapped (up to where its data ends) or read.
pub enum TraceBytes {
    Mapped(memmap2::Mmap, usize),
    Read(Vec<u8>),
}

impl Deref for TraceBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            TraceBytes::Mapped(map, data_end) => &map[..*data_end],
            TraceBytes::Read(bytes) => bytes,
        }
    }
}

/// The trace path that names the standard input (`zcat app.trace.gz | mallocspy report -`).
pub const STDIN: &str = "-";

/// The line written if the mapped file shrinks under us (another `record` over it).
static SHRANK: OnceLock<Vec<u8>> = OnceLock::new();

/// A trace as read.
pub struct Loaded {
    pub bytes: TraceBytes,
    /// A writer held the file when it was opened: its program is still running, and the
    /// trace is read as far as it was written.
    pub being_written: bool,
}

/// Opens `path` and maps or reads it.
pub fn load(path: &Path) -> io::Result<Loaded> {
    if path == Path::new(STDIN) {
        let bytes = read_stream(io::stdin().lock())?;
        return Ok(Loaded { bytes: TraceBytes::Read(bytes), being_written: false });
    }
    let file = File::open(path)?;
    let being_written = locked_by_writer(&file);
    let meta = file.metadata()?;
    if meta.is_file() && meta.len() > 0 {
        on_shrink(path);
        // SAFETY: a read-only private map of a regular file. The file may change under it:
        // what the reader reads is then what the file holds (a trace still being written is
        // read up to where it was), and a page past a new, shorter end raises SIGBUS, which
        // `on_shrink` turns into one line and status 1.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        let bytes = TraceBytes::Mapped(map, data_end(&file, meta.len()) as usize);
        return Ok(Loaded { bytes, being_written });
    }
    let bytes = read_stream(file)?;
    Ok(Loaded { bytes: TraceBytes::Read(bytes), being_written })
}

/// Reads a stream (standard input, a FIFO) as far as it can be read as a trace: past its
/// first bytes only if they are a trace's signature (`report - < /dev/zero` was read whole
/// before it was refused, without end), and then in doubling steps while what was read could
/// go on ([`read_on`]): a trace followed by zeros or random bytes was read without end too
/// (review helper 85).
fn read_stream(mut stream: impl Read) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    (&mut stream).take(MAGIC.len() as u64).read_to_end(&mut bytes)?;
    if bytes.as_slice() != MAGIC {
        return Ok(bytes);
    }
    let mut step_end: u64 = 1 << 20;
    loop {
        let missing = step_end - bytes.len() as u64;
        if ((&mut stream).take(missing).read_to_end(&mut bytes)? as u64) < missing || !read_on(&bytes) {
            return Ok(bytes);
        }
        step_end *= 2;
    }
}

/// Where a regular file's data ends: where a hole starts that runs to its end (the unwritten
/// tail of a file cut short by a crash, or one made longer with `truncate -s`), else its
/// length `len`. The reader would find the hole's zeros one mapped page at a time: a 20 GB
/// hole took 101 s.
fn data_end(file: &File, len: u64) -> u64 {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut at: libc::off_t = 0;
    loop {
        // SAFETY: lseek on a descriptor `file` owns; the mapping does not use its offset.
        let hole = unsafe { libc::lseek(fd, at, libc::SEEK_HOLE) };
        if hole < 0 || hole as u64 >= len {
            return len;
        }
        // SAFETY: as above.
        let data = unsafe { libc::lseek(fd, hole, libc::SEEK_DATA) };
        if data < 0 {
            // ENXIO: no data after the hole. Any other error: read it all.
            return if io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) { hole as u64 } else { len };
        }
        at = data;
    }
}

/// Whether a trace writer holds `file`: mallocspy's writer keeps an exclusive `flock` on its
/// trace until it closes it (`src/trace/writer.rs`). A shared lock taken here is let go at
/// once; a `record` that opens the same path between the two calls takes it for another
/// writer's, and writes `PATH.PID` instead.
fn locked_by_writer(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: flock on a descriptor `file` owns and keeps open across both calls.
    unsafe {
        if libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) == 0 {
            libc::flock(fd, libc::LOCK_UN);
            return false;
        }
    }
    io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK)
}

/// A SIGBUS while the map is read means the file was cut shorter meanwhile: say so and leave,
/// rather than die of the signal.
fn on_shrink(path: &Path) {
    let _ = SHRANK
        .set(format!("mallocspy report: {}: the file got shorter while it was read\n", path_shown(path)).into_bytes());
    extern "C" fn shrank(_: c_int) {
        if let Some(line) = SHRANK.get() {
            // SAFETY: write(2) and _exit(2) are async-signal-safe; the line is a finished,
            // never freed buffer.
            unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
        }
        // SAFETY: as above.
        unsafe { libc::_exit(1) };
    }
    // SAFETY: a plain handler for SIGBUS, installed before any page of the map is read.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = shrank as extern "C" fn(c_int) as usize;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::read_stream;
    use mallocspy::trace::{Event, Header, write_event, write_header};
    use std::io::{Cursor, Read};

    /// A trace of `frees` events, ended.
    fn trace(frees: u64) -> Vec<u8> {
        let mut bytes = Vec::new();
        write_header(&mut bytes, &Header { pid: 7, interval: 102400, ..Header::default() });
        for address in 1..=frees {
            write_event(&mut bytes, &Event::Free { time_ns: address, thread: 1, address: address << 4 });
        }
        write_event(&mut bytes, &Event::End { time_ns: frees + 1 });
        bytes
    }

    /// `pattern` over and over, without end (its offset in it: the second field).
    struct Endless(&'static [u8], usize);

    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            for b in buf.iter_mut() {
                *b = self.0[self.1 % self.0.len()];
                self.1 += 1;
            }
            Ok(buf.len())
        }
    }

    #[test]
    fn a_stream_is_read_whole_while_it_is_a_trace() {
        let whole = trace(400_000);
        assert!(whole.len() > 3 << 20, "past a few of the reader's steps");
        assert_eq!(read_stream(Cursor::new(whole.clone())).unwrap(), whole);
    }

    #[test]
    fn what_follows_a_trace_on_a_stream_is_read_only_as_far_as_a_record_could_reach() {
        let whole = trace(10);
        // `cat app.trace /dev/zero | mallocspy report -`: read without end before.
        let zeros = std::io::repeat(0).take(1 << 30);
        let read = read_stream(Cursor::new(whole.clone()).chain(zeros)).unwrap();
        assert!(read.starts_with(&whole) && read.len() <= 128 << 20, "{} bytes read", read.len());
        // Damage after the trace (a record of tag 0 with data after it), without end.
        let read = read_stream(Cursor::new(whole.clone()).chain(Endless(&[0, 1, 2, 3], 0))).unwrap();
        assert_eq!(read.len(), 1 << 20, "stopped at the first step");
        // Text (`yes`): records of a tag no version knows (`y`, 10 bytes long), skipped one by one.
        let read = read_stream(Cursor::new(whole.clone()).chain(Endless(b"y\n", 0))).unwrap();
        assert!(read.len() <= 128 << 20, "{} bytes read", read.len());
    }
}
