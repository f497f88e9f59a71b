//! A `#[global_allocator]` for the interposer's own Rust code: straight to the real
//! allocator, never through the exported (hooked) functions.
//!
//! While the shim starts up, its allocations (the options string, the spies, the registry
//! cell) come from the static bootstrap arena instead. The program's heap then starts in the
//! very state it would have without us: glibc's layout, and with it when it trims and grows
//! the heap, is chaotic in the first few blocks (one transient 8-byte block moved a churn run
//! from 170,000 page faults to 192,000), and a spy must not change what the program does.

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;
use core::sync::atomic::{AtomicBool, Ordering};

use crate::bootstrap;
use crate::global::GLOBAL;
use crate::heap::Heap;

static STARTING_UP: AtomicBool = AtomicBool::new(false);

/// Runs `f` with the interposer's own allocations served from the bootstrap arena (the real
/// heap only when the arena is full). Blocks freed from there are simply not reused.
pub(crate) fn starting_up<R>(f: impl FnOnce() -> R) -> R {
    STARTING_UP.store(true, Ordering::Relaxed);
    let r = f();
    STARTING_UP.store(false, Ordering::Relaxed);
    r
}

fn from_bootstrap(layout: Layout) -> Option<*mut u8> {
    if !STARTING_UP.load(Ordering::Relaxed) {
        return None;
    }
    let p = bootstrap::alloc(layout.size(), layout.align().max(MALLOC_ALIGN));
    (!p.is_null()).then_some(p.cast())
}

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
        if let Some(p) = from_bootstrap(layout) {
            return p;
        }
        if layout.align() <= MALLOC_ALIGN && layout.align() <= layout.size() {
            GLOBAL.heap.malloc(layout.size()).cast()
        } else {
            GLOBAL.heap.memalign(layout.align(), layout.size()).cast()
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if let Some(p) = from_bootstrap(layout) {
            // The arena is zeroed static memory, never handed out twice.
            return p;
        }
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
        // SAFETY: ptr came from alloc/realloc above: from the real allocator, or from the
        // bootstrap arena, whose blocks the heap's free recognises and ignores.
        unsafe { GLOBAL.heap.free(ptr.cast::<c_void>()) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let starting_up = STARTING_UP.load(Ordering::Relaxed);
        if !starting_up && layout.align() <= MALLOC_ALIGN && layout.align() <= new_size {
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
