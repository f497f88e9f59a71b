//! The calling thread's stack extent, which every stack read of the unwinder is checked
//! against.
//!
//! Known once per thread and cached in its thread state. The main thread's comes from where
//! glibc says it started and `RLIMIT_STACK`. A thread made by `pthread_create` asks
//! `pthread_getattr_np` before the program's code runs in it ([`crate::thread_create`]). That
//! function must never be asked from a hook: it holds the thread's own lock while it
//! allocates, so a hook on one of its allocations would wait forever for the lock its caller
//! holds (`java` hung at start that way). Any other thread (made before a spy was registered,
//! by glibc itself, or by a raw `clone`) finds its stack in the kernel's map of its process,
//! read with plain system calls: slower (tens of microseconds, once), but free of locks.

use crate::tls;

/// The calling thread's stack, `(low, high)` (cached in its thread state; `(0, 0)` when
/// unknown).
#[inline(always)]
pub(crate) fn stack_bounds() -> (u64, u64) {
    let ts = tls::state();
    if ts.stack_top.get() == 0 {
        find_stack();
    }
    (ts.stack_low.get(), ts.stack_top.get())
}

/// The first capture on a thread that the wrapper did not start: where is its stack?
#[cold]
#[inline(never)]
fn find_stack() {
    cache(if is_main_thread() { main_stack() } else { stack_in_map(super::current_sp()) });
}

/// Notes a new thread's stack, from `pthread_getattr_np`. Called first thing in a thread that
/// `pthread_create` made, as if inside a hook (its allocations go straight to the real
/// allocator).
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

/// The main thread's stack: it grows on demand up to RLIMIT_STACK below its start.
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
    (top.saturating_sub(limit), top)
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

/// The mapping of `/proc/thread-self/maps` that holds `sp` (`(0, 0)`: none), read without
/// allocating. A glibc thread's control block (where its thread pointer points) ends its
/// stack block, so the extent stops there when it lies inside: the mapping may have merged
/// with a neighbour above.
fn stack_in_map(sp: u64) -> (u64, u64) {
    // SAFETY: a NUL-terminated path; the descriptor is closed below.
    let fd = unsafe { libc::open(c"/proc/thread-self/maps".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return (0, 0);
    }
    let mut lines = MapLines::default();
    let mut buf = [0u8; 4096];
    let found = loop {
        // SAFETY: reads at most buf.len() bytes into buf.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break None;
        }
        if let Some(range) = buf[..n as usize].iter().find_map(|&c| lines.feed(c).filter(|&(s, e)| s <= sp && sp < e)) {
            break Some(range);
        }
    };
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    let Some((start, end)) = found else { return (0, 0) };
    let tp = crate::os::thread_pointer();
    (start, if sp < tp && tp < end { tp } else { end })
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
