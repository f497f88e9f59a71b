//! A small static arena for the allocations made while the real allocator is being looked up.
//!
//! `dlsym` may allocate (a failing lookup allocates its `dlerror` state), and the allocation
//! arrives at our own `malloc` before we know where the real one is. heaptrack solves this with
//! a static "dummy pool"; so do we. Blocks from here are never freed (`free` ignores them) and
//! `realloc` moves them out; `malloc_usable_size` reads the size kept in front of each.

use core::cell::UnsafeCell;
use core::ffi::c_void;
use core::sync::atomic::{AtomicUsize, Ordering};

const SIZE: usize = 64 * 1024;
const HEADER: usize = 16;

#[repr(C, align(4096))]
struct Arena(UnsafeCell<[u8; SIZE]>);

// SAFETY: disjoint ranges of the arena are handed out by an atomic bump pointer; no byte is
// given to two callers.
unsafe impl Sync for Arena {}

static ARENA: Arena = Arena(UnsafeCell::new([0; SIZE]));
static NEXT: AtomicUsize = AtomicUsize::new(0);

fn base() -> usize {
    ARENA.0.get() as usize
}

/// Allocates `size` bytes aligned to `align` (a power of two, at least 16), zeroed; NULL when
/// the arena is exhausted or the request is invalid.
pub(crate) fn alloc(size: usize, align: usize) -> *mut c_void {
    if !align.is_power_of_two() || align > 4096 {
        return core::ptr::null_mut();
    }
    let align = align.max(HEADER);
    let mut cur = NEXT.load(Ordering::Relaxed);
    loop {
        let Some(start) = (cur + HEADER).checked_next_multiple_of(align) else { return core::ptr::null_mut() };
        let Some(end) = start.checked_add(size) else { return core::ptr::null_mut() };
        if end > SIZE {
            return core::ptr::null_mut();
        }
        match NEXT.compare_exchange_weak(cur, end, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => {
                let p = (base() + start) as *mut u8;
                // SAFETY: [start - HEADER, end) lies inside the arena and was just reserved for
                // this caller alone; the header slot is 8-aligned because start is 16-aligned.
                unsafe { (p.sub(HEADER) as *mut usize).write(size) };
                return p.cast();
            }
            Err(now) => cur = now,
        }
    }
}

/// Whether the arena has handed out (or reserved) any block.
pub(crate) fn in_use() -> bool {
    NEXT.load(Ordering::Relaxed) != 0
}

/// True when `p` was handed out by [`alloc`].
#[inline]
pub(crate) fn contains(p: *const c_void) -> bool {
    (p as usize).wrapping_sub(base()) < SIZE
}

/// The size requested for a block of the arena.
///
/// # Safety
/// `p` must have been returned by [`alloc`].
pub(crate) unsafe fn size_of(p: *const c_void) -> usize {
    // SAFETY: every block returned by alloc has its size in the HEADER bytes before it.
    unsafe { ((p as *const u8).sub(HEADER) as *const usize).read() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_aligned_disjoint_blocks_with_their_sizes() {
        let a = alloc(10, 16);
        let b = alloc(100, 64);
        assert!(contains(a) && contains(b));
        assert_eq!(a as usize % 16, 0);
        assert_eq!(b as usize % 64, 0);
        assert!(b as usize >= a as usize + 10);
        // SAFETY: both came from alloc.
        unsafe {
            assert_eq!(size_of(a), 10);
            assert_eq!(size_of(b), 100);
        }
        assert!(alloc(SIZE, 16).is_null());
        assert!(!contains(core::ptr::null()));
    }
}
