//! A descriptor of mallocspy's kept open for the whole run, and the file it was.
//!
//! Reports, the trace writer's socket and the process map are opened early and used late: at
//! exit, in a forked child, after the program has run out of descriptors or `chroot`ed. In
//! between, the program may close every descriptor it did not open (daemons, `closefrom`-style
//! loops) and a file of its own may then get the number: a descriptor is used only while it is
//! still the file it was kept as (its device and inode). Kept at a high number, out of the way
//! of the program's own, which come from the bottom up.

use core::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use crate::os;

/// A kept descriptor (-1: none) and the identity of its file.
pub(crate) struct KeptFd {
    fd: AtomicI32,
    dev: AtomicU64,
    ino: AtomicU64,
    /// Whether an open descriptor that `fstat` cannot be asked about counts as the file (see
    /// [`os::is_file`]).
    unasked_is_same: bool,
}

impl KeptFd {
    /// Nothing kept yet. An open descriptor that cannot be asked about (a seccomp filter
    /// answering `fstat` with an errno) will count as the file: a report's last lines still
    /// go out.
    pub(crate) const fn new() -> Self {
        Self { fd: AtomicI32::new(-1), dev: AtomicU64::new(0), ino: AtomicU64::new(0), unasked_is_same: true }
    }

    /// Nothing kept yet, and a descriptor that cannot be asked about will not count as the
    /// file: for one that is closed at the end, where closing a file of the program's would
    /// be worse than doing without ours.
    pub(crate) const fn strict() -> Self {
        Self { unasked_is_same: false, ..Self::new() }
    }

    /// Keeps `fd` (or none: -1) as the file it is now; returns the descriptor kept before.
    pub(crate) fn keep(&self, fd: i32) -> i32 {
        self.keep_as(fd, os::file_identity(fd).unwrap_or((0, 0)))
    }

    /// Keeps `fd` (or none: -1) as the file `id`, which a descriptor that could not be kept
    /// still names (what stderr was); returns the descriptor kept before.
    pub(crate) fn keep_as(&self, fd: i32, (dev, ino): (u64, u64)) -> i32 {
        self.dev.store(dev, Ordering::Relaxed);
        self.ino.store(ino, Ordering::Relaxed);
        self.fd.swap(fd, Ordering::AcqRel)
    }

    /// The descriptor kept, whatever it is now (-1: none).
    pub(crate) fn raw(&self) -> i32 {
        self.fd.load(Ordering::Acquire)
    }

    /// The descriptor kept, if it is still the file it was.
    pub(crate) fn get(&self) -> Option<i32> {
        let fd = self.raw();
        self.is(fd).then_some(fd)
    }

    /// Whether `fd` is the file kept.
    pub(crate) fn is(&self, fd: i32) -> bool {
        fd >= 0
            && if self.unasked_is_same {
                os::is_file(fd, self.identity())
            } else {
                os::file_identity(fd) == Some(self.identity())
            }
    }

    /// The identity of the file kept: its device and inode.
    pub(crate) fn identity(&self) -> (u64, u64) {
        (self.dev.load(Ordering::Relaxed), self.ino.load(Ordering::Relaxed))
    }

    /// Keeps nothing from now on; returns the descriptor kept, whatever it is now (its
    /// identity stays: [`KeptFd::is`] still tells whether it is the file).
    pub(crate) fn take(&self) -> i32 {
        self.fd.swap(-1, Ordering::AcqRel)
    }

    /// Keeps nothing from now on, and closes the descriptor kept if it is still the file.
    pub(crate) fn release(&self) {
        let fd = self.take();
        if self.is(fd) {
            os::close(fd);
        }
    }

    /// Keeps `-1` instead of `fd`, if `fd` is the descriptor kept.
    pub(crate) fn forget(&self, fd: i32) {
        let _ = self.fd.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Moves `fd` to a high descriptor number, close-on-exec: `fd` itself when there is no room.
/// Under a limit below 64, into its top quarter (below 33 it found none: a program that then
/// closed its stderr lost its leak report, review helper 132).
pub(crate) fn move_high(fd: i32) -> i32 {
    // SAFETY: rlimit is plain data; getrlimit only writes it.
    let mut lim: libc::rlimit = unsafe { core::mem::zeroed() };
    // SAFETY: lim is a valid out-pointer.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 { lim.rlim_cur } else { 1024 };
    let base = if soft >= 64 { soft.min(1024) as i32 - 32 } else { (soft as i32 * 3 / 4).max(3) };
    // SAFETY: fcntl on a descriptor we own.
    let high = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, base) };
    if high < 0 {
        return fd;
    }
    os::close(fd);
    high
}

/// [`move_high`], or `None` (and `fd` closed) when there is no room high up: for a descriptor
/// kept only where it takes none of the program's numbers.
pub(crate) fn move_high_or_close(fd: i32) -> Option<i32> {
    let high = move_high(fd);
    if high == fd {
        os::close(fd);
        return None;
    }
    Some(high)
}
