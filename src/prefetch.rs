//! Cache-line prefetch hints, for the hook path's likely misses (a table line, a queue slot)
//! that can be asked for early and waited on later.
//!
//! A prefetch never faults and never reads or writes for the program: any address will do,
//! and on architectures without the hint these do nothing.

/// Asks for the line holding `addr`, to be read.
#[inline(always)]
pub(crate) fn read(addr: *const u8) {
    // SAFETY: a prefetch only hints the cache (see the module doc).
    #[cfg(target_arch = "x86_64")]
    unsafe {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(addr.cast());
    }
}

/// Asks for the line holding `addr`, to be written (`prefetchw`: the line comes exclusive,
/// taken from another core's cache without a second transfer at the write). In assembly:
/// `_mm_prefetch`'s write hint compiles to a read prefetch for the baseline x86-64 target.
/// Intel's x86-64 processors before Broadwell do not advertise `prefetchw` but run it as a
/// no-op (64-bit Windows 8.1 requires it of them on that ground); AMD's all have it.
#[inline(always)]
pub(crate) fn write(addr: *const u8) {
    // SAFETY: a prefetch only hints the cache (see the module doc); it touches no register
    // but its operand's and no stack.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        core::arch::asm!("prefetchw byte ptr [{0}]", in(reg) addr, options(nostack, preserves_flags, readonly));
    }
}
