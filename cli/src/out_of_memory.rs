//! The command's allocator: the system's, with one line and status 1 when memory runs out.
//!
//! Rust's answer to a failed allocation is "memory allocation of N bytes failed" and an abort:
//! `mallocspy report` of a large or damaged trace under a memory limit died by SIGABRT, with a
//! core dump and, with `RUST_BACKTRACE` set, a backtrace of seventy lines (review helper 36).
//! Nothing in the command asks for memory it can do without, so a failed allocation ends it.

use std::alloc::{GlobalAlloc, Layout, System};

/// [`System`], ending the process in one line when it fails.
pub struct ExitWhenOut;

// SAFETY: every method forwards to `System` with the caller's arguments, and returns what it
// returned when that is not null.
unsafe impl GlobalAlloc for ExitWhenOut {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's guarantees for `layout`.
        or_exit(unsafe { System.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        or_exit(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's guarantees for `ptr`, `layout` and `new_size`.
        or_exit(unsafe { System.realloc(ptr, layout, new_size) }, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// `ptr`, or the end of the process when it is null (an allocation of `size` bytes failed).
fn or_exit(ptr: *mut u8, size: usize) -> *mut u8 {
    if ptr.is_null() {
        out_of_memory(size);
    }
    ptr
}

#[cold]
fn out_of_memory(size: usize) -> ! {
    // Formatted on the stack: there is no memory to format into.
    let mut line = [0u8; 160];
    let mut at = 0;
    for part in [b"mallocspy: out of memory (".as_slice(), decimal(size, &mut [0; 20]), b" bytes more were needed)\n"] {
        line[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    // SAFETY: writes `at` initialized bytes of `line` to stderr; `_exit` runs nothing that
    // could allocate.
    unsafe {
        libc::write(2, line.as_ptr().cast(), at);
        libc::_exit(1)
    }
}

/// `n` in decimal, in the end of `buf`.
fn decimal(mut n: usize, buf: &mut [u8; 20]) -> &[u8] {
    let mut start = buf.len();
    loop {
        start -= 1;
        buf[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[start..];
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn decimal_writes_every_digit() {
        for n in [0, 7, 10, 2147483648, usize::MAX] {
            assert_eq!(super::decimal(n, &mut [0; 20]), n.to_string().as_bytes());
        }
    }
}
