//! Formatting a report line into a stack buffer: `core::fmt` without a heap.

use core::fmt;

/// A fixed-capacity text buffer; output past the capacity is dropped and marked with `...`.
pub(crate) struct Line<const N: usize> {
    buf: [u8; N],
    len: usize,
    truncated: bool,
}

impl<const N: usize> Line<N> {
    pub(crate) const fn new() -> Self {
        Self { buf: [0; N], len: 0, truncated: false }
    }

    /// The text so far, with `...` in place of what did not fit.
    pub(crate) fn as_bytes(&mut self) -> &[u8] {
        if self.truncated && N >= 4 {
            let end = self.len.min(N - 4);
            self.buf[end..end + 3].copy_from_slice(b"...");
            self.len = end + 3;
            self.truncated = false;
        }
        &self.buf[..self.len]
    }
}

impl<const N: usize> fmt::Write for Line<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = N - self.len;
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        if n < s.len() {
            self.truncated = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::fmt::Write;

    #[test]
    fn formats_and_truncates() {
        let mut l = Line::<16>::new();
        write!(l, "x={} {:#x}", 42, 255).unwrap();
        assert_eq!(l.as_bytes(), b"x=42 0xff");
        let mut l = Line::<8>::new();
        write!(l, "0123456789").unwrap();
        assert_eq!(l.as_bytes(), b"0123...");
    }
}
