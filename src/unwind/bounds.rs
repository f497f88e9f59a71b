//! The calling thread's stack extent, which every stack read of the unwinder is checked
//! against.
//!
//! Known once per thread and cached in its thread state. The main thread's comes from where
//! glibc says it started and `RLIMIT_STACK`. Any other thread asks the kernel, on its first
//! captured stack, for the mapping that holds its stack pointer (`PROCMAP_QUERY`, Linux 6.11:
//! plain system calls, about 7 us once per thread that captures a stack).
//!
//! Before Linux 6.11, a thread made by `pthread_create` asks `pthread_getattr_np` before the
//! program's code runs in it ([`crate::thread_create`]). That function allocates (its CPU
//! set, the attribute's extension), and so gives every new thread an arena of glibc's
//! (64 MiB of address space), where natively a thread that never allocates has none; it must
//! never be asked from a hook, since it holds the thread's own lock while it allocates, so a
//! hook on one of its allocations would wait forever for the lock its caller holds (`java`
//! hung at start that way). Other threads read the kernel's map as text (free of locks, but a
//! few hundred microseconds).

use core::sync::atomic::{AtomicU8, Ordering};

use crate::{os, tls};

/// The calling thread's stack, `(low, high)` (cached in its thread state; `(0, 0)` when
/// unknown).
#[inline(always)]
pub(crate) fn stack_bounds() -> (u64, u64) {
    let ts = tls::state();
    if ts.stack_top.get() == 0 && !find_stack() {
        return (0, 0);
    }
    (ts.stack_low.get(), ts.stack_top.get())
}

/// A thread's first capture (unless the wrapper noted its stack): where is its stack? Not
/// from a signal handler's alternate stack, whose mapping is no stack of the thread's (and
/// which reading the memory map, 4 KiB of buffer, overflowed: a handler's `malloc` on a stack
/// of `MINSIGSTKSZ` crashed, review helper 97): unknown there, asked again later.
#[cold]
#[inline(never)]
fn find_stack() -> bool {
    if super::alternate_stack().is_some() {
        return false;
    }
    let sp = super::current_sp();
    cache(if is_main_thread() { main_stack() } else { queried(sp).unwrap_or_else(|| stack_in_map(sp)) });
    true
}

/// Whether the kernel answers `PROCMAP_QUERY` (asked once): if not, a new thread asks glibc
/// for its stack before the program's code runs in it.
pub(crate) fn kernel_finds_stacks() -> bool {
    /// 0: not asked yet, 1: yes, 2: no.
    static ANSWER: AtomicU8 = AtomicU8::new(0);
    match ANSWER.load(Ordering::Relaxed) {
        0 => {
            let yes = queried(super::current_sp()).is_some();
            ANSWER.store(if yes { 1 } else { 2 }, Ordering::Relaxed);
            yes
        }
        answer => answer == 1,
    }
}

/// Notes a new thread's stack, from `pthread_getattr_np` (a kernel older than 6.11). Called
/// first thing in a thread that `pthread_create` made, as if inside a hook (its allocations go
/// straight to the real allocator).
pub(crate) fn note_thread_start() {
    cache(asked_of_glibc());
}

/// Keeps `(low, high)` in the thread state (`high` 0, unknown, is kept as 1: asked already).
fn cache((low, high): (u64, u64)) {
    let ts = tls::state();
    ts.stack_low.set(low);
    ts.stack_top.set(high.max(1));
}

fn is_main_thread() -> bool {
    crate::os::gettid() == crate::os::getpid()
}

/// The main thread's stack: its frames lie below where glibc says it started, and it grows on
/// demand until it spans RLIMIT_STACK from the top of its mapping, which lies above the
/// arguments and the environment (counted from the start, the room left below a frame was
/// overstated by their size: a program with a large environment under `ulimit -s 64` died in
/// a stack walk that thought it had room).
fn main_stack() -> (u64, u64) {
    unsafe extern "C" {
        /// glibc: the stack address at process start (the main thread's frames lie below).
        static __libc_stack_end: *mut core::ffi::c_void;
    }
    // SAFETY: glibc initialises __libc_stack_end before any user code runs; rlimit is plain
    // data written by getrlimit.
    let (top, limit) = unsafe {
        let mut lim: libc::rlimit = core::mem::zeroed();
        let limit = if libc::getrlimit(libc::RLIMIT_STACK, &mut lim) == 0 { lim.rlim_cur } else { 8 << 20 };
        (__libc_stack_end as u64, limit.min(1 << 32))
    };
    let mapping_top = match queried(super::current_sp()) {
        Some((_, end)) if end >= top => end,
        _ => stack_in_map(super::current_sp()).1.max(top),
    };
    (mapping_top.saturating_sub(limit), top)
}

/// The calling thread's stack as glibc knows it (`(0, 0)`: unknown).
fn asked_of_glibc() -> (u64, u64) {
    // SAFETY: attr is initialised by pthread_getattr_np before use and destroyed after.
    unsafe {
        let mut attr: libc::pthread_attr_t = core::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return (0, 0);
        }
        let mut addr = core::ptr::null_mut();
        let mut size = 0;
        let ok = libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0;
        libc::pthread_attr_destroy(&mut attr);
        if ok { (addr as u64, addr as u64 + size as u64) } else { (0, 0) }
    }
}

/// A thread's stack from the mapping `(start, end)` that holds its stack pointer `sp`. A glibc
/// thread's control block (where its thread pointer points) ends its stack block, so the
/// extent stops there when it lies inside: the mapping may have merged with a neighbour above.
fn stack_of_mapping(sp: u64, (start, end): (u64, u64)) -> (u64, u64) {
    let tp = crate::os::thread_pointer();
    (start, if sp < tp && tp < end { tp } else { end })
}

/// `struct procmap_query` of `<linux/fs.h>` (Linux 6.11).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: u64 = 3 << 30 | (size_of::<ProcmapQuery>() as u64) << 16 | (b'f' as u64) << 8 | 17;

/// The stack that holds `sp`, from the mapping the kernel says holds it (`None`: a kernel
/// older than 6.11, or no `/proc`). Plain system calls: no allocation, no lock of ours.
///
/// `/proc/self` is opened in a third of the time of `/proc/thread-self`, but its map is empty
/// once the main thread has left by `pthread_exit`.
fn queried(sp: u64) -> Option<(u64, u64)> {
    query(c"/proc/self/maps", sp).or_else(|| query(c"/proc/thread-self/maps", sp))
}

/// [`queried`] of the map at `path`.
fn query(path: &core::ffi::CStr, sp: u64) -> Option<(u64, u64)> {
    let fd = os::open(path, libc::O_RDONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return None;
    }
    let mut query = ProcmapQuery { size: size_of::<ProcmapQuery>() as u64, query_addr: sp, ..Default::default() };
    // SAFETY: PROCMAP_QUERY reads and writes one struct procmap_query of the size it is told;
    // no name or build id is asked for (their sizes are 0).
    let status = unsafe { libc::ioctl(fd, PROCMAP_QUERY as _, &mut query) };
    os::close(fd);
    (status == 0 && query.vma_start <= sp && sp < query.vma_end)
        .then(|| stack_of_mapping(sp, (query.vma_start, query.vma_end)))
}

/// The stack that holds `sp` from the text of `/proc/thread-self/maps` (`(0, 0)`: none),
/// read without allocating.
fn stack_in_map(sp: u64) -> (u64, u64) {
    let fd = os::open(c"/proc/thread-self/maps", libc::O_RDONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return (0, 0);
    }
    let mut lines = MapLines::default();
    let mut buf = [0u8; 4096];
    let found = loop {
        let n = os::read(fd, &mut buf);
        if n <= 0 {
            break None;
        }
        if let Some(range) = buf[..n as usize].iter().find_map(|&c| lines.feed(c).filter(|&(s, e)| s <= sp && sp < e)) {
            break Some(range);
        }
    };
    os::close(fd);
    found.map_or((0, 0), |mapping| stack_of_mapping(sp, mapping))
}

/// The `start-end` ranges of a maps file, fed a byte at a time (lines may be longer than any
/// buffer: a path can take 4 KiB).
#[derive(Default)]
struct MapLines {
    start: u64,
    end: u64,
    /// 0: reading the start, 1: the end, 2: skipping to the end of the line.
    field: u8,
}

impl MapLines {
    fn feed(&mut self, c: u8) -> Option<(u64, u64)> {
        match (self.field, c) {
            (_, b'\n') => *self = MapLines::default(),
            (0, b'-') => self.field = 1,
            (1, b' ') => {
                self.field = 2;
                return Some((self.start, self.end));
            }
            (0 | 1, _) => {
                let digit = (c as char).to_digit(16)? as u64;
                let v = if self.field == 0 { &mut self.start } else { &mut self.end };
                *v = *v << 4 | digit;
            }
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_finds_its_stack_in_the_map_as_glibc_describes_it() {
        std::thread::spawn(|| {
            let glibc = asked_of_glibc();
            let here = super::super::current_sp();
            let mapped = stack_in_map(here);
            assert!(mapped.0 <= here && here < mapped.1, "{mapped:x?} holds {here:#x}");
            // The map's mapping is the stack without its guard page, up to the control block.
            assert!(mapped.0 >= glibc.0 && mapped.1 <= glibc.1, "{mapped:x?} within {glibc:x?}");
            assert!(glibc.1 - mapped.1 < 64 << 10, "{mapped:x?} ends near {glibc:x?}");
            // The kernel's answer to the query is the same mapping (where it can be asked).
            if let Some(asked) = queried(here) {
                assert_eq!(asked, mapped);
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn map_lines_of_any_length_give_their_ranges() {
        let text = format!("10-20 r--p 0 0:0 0 {}\n7f00-7f80 rw-p 0 0:0 0 [stack]\n", "x".repeat(5000));
        let mut lines = MapLines::default();
        let ranges: Vec<(u64, u64)> = text.bytes().filter_map(|c| lines.feed(c)).collect();
        assert_eq!(ranges, [(0x10, 0x20), (0x7f00, 0x7f80)]);
    }
}
