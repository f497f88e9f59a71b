//! A `#[global_allocator]` for the interposer's own Rust code: straight to the real
//! allocator, never through the exported (hooked) functions.

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;

use crate::global::GLOBAL;
use crate::heap::Heap;

/// The real allocator as a Rust global allocator. The preload shim installs it so that the
/// spies' own collections and formatting never reach the hooks.
pub struct RealAllocator;

/// glibc's `malloc` alignment on x86_64.
const MALLOC_ALIGN: usize = 16;

// SAFETY: every method forwards to the real allocator with a size and alignment it honours:
// plain malloc when the layout's alignment is within malloc's guarantee, memalign otherwise;
// blocks go back to the same allocator's free/realloc.
unsafe impl GlobalAlloc for RealAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN && layout.align() <= layout.size() {
            GLOBAL.heap.malloc(layout.size()).cast()
        } else {
            GLOBAL.heap.memalign(layout.align(), layout.size()).cast()
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN && layout.align() <= layout.size() {
            GLOBAL.heap.calloc(1, layout.size()).cast()
        } else {
            // SAFETY: same layout contract as alloc.
            let p = unsafe { self.alloc(layout) };
            if !p.is_null() {
                // SAFETY: p holds layout.size() bytes.
                unsafe { p.write_bytes(0, layout.size()) };
            }
            p
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: ptr came from alloc/realloc above, i.e. from the real allocator.
        unsafe { GLOBAL.heap.free(ptr.cast::<c_void>()) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN && layout.align() <= new_size {
            // SAFETY: ptr is a live block of the real allocator.
            return unsafe { GLOBAL.heap.realloc(ptr.cast(), new_size) }.cast();
        }
        // SAFETY: the layout is valid (it described the old block) with the new size.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: as alloc.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks hold at least min(old, new) bytes and are distinct.
            unsafe {
                core::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}
