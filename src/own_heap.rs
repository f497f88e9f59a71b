//! mallocspy's own heap: the `#[global_allocator]` of the interposer's Rust code.
//!
//! Every allocation mallocspy makes for itself (the options, the spies' start-up state, the
//! unwinder's module list, the trace writer's buffers, the reports) comes from dlmalloc running
//! on regions of mallocspy's pool ([`crate::pool`]: counted, and known to the leak scan as
//! not the program's): never from the exported (hooked) functions, and never from the heap
//! it watches either. glibc's heap layout, and with it when glibc trims and
//! regrows the heap, is chaotic in the blocks handed out: one transient 8-byte block of ours
//! moved a churn run from 170,000 page faults to 192,000, a few unwinder buffers to 214,000.
//! A spy must not change what the program does, so the program's heap holds the program's
//! blocks only.
//!
//! One lock guards the heap. It is never taken on the hot path of a hook (only where a spy
//! builds something new: a report, the module list after a `dlopen`; an unwind rule is
//! computed in place) and never re-entered: a signal handler that allocates while its thread
//! is inside mallocspy finds the hook depth raised and goes straight to the real allocator.
//! `fork` takes it in the prepare handler so that the child's copy is consistent.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;

use dlmalloc::Dlmalloc;

use crate::sync::SpinLock;
use crate::{os, pool};

/// dlmalloc's source of memory: regions of mallocspy's pool, so that its memory is counted
/// with the rest of mallocspy's and the leak scan leaves it out of the roots.
struct Regions;

// SAFETY: every region handed out is a zeroed pool region of the size returned (as
// `allocates_zeros` says), given back whole with that size; none is remapped or cut.
unsafe impl dlmalloc::Allocator for Regions {
    fn alloc(&self, size: usize) -> (*mut u8, usize, u32) {
        match pool::lease_unbounded(size) {
            Some((region, size)) => (region.as_ptr(), size, 0),
            None => (core::ptr::null_mut(), 0, 0),
        }
    }

    fn remap(&self, _ptr: *mut u8, _oldsize: usize, _newsize: usize, _can_move: bool) -> *mut u8 {
        core::ptr::null_mut()
    }

    fn free_part(&self, _ptr: *mut u8, _oldsize: usize, _newsize: usize) -> bool {
        false
    }

    fn free(&self, ptr: *mut u8, size: usize) -> bool {
        if let Some(region) = core::ptr::NonNull::new(ptr) {
            // SAFETY: dlmalloc gives back a whole region it was handed, with its size, unused.
            unsafe { pool::give_back(region, size) };
        }
        true
    }

    fn can_release_part(&self, _flags: u32) -> bool {
        false
    }

    fn allocates_zeros(&self) -> bool {
        true
    }

    fn page_size(&self) -> usize {
        os::page_size()
    }
}

struct Heap {
    lock: SpinLock,
    dlmalloc: UnsafeCell<Dlmalloc<Regions>>,
}

// SAFETY: `dlmalloc` is touched only by the holder of `lock`.
unsafe impl Sync for Heap {}

static HEAP: Heap = Heap { lock: SpinLock::new(), dlmalloc: UnsafeCell::new(Dlmalloc::new_with_allocator(Regions)) };

/// Runs `f` on the heap under its lock.
fn with_heap<R>(f: impl FnOnce(&mut Dlmalloc<Regions>) -> R) -> R {
    let _guard = HEAP.lock.lock();
    // SAFETY: the lock makes this the only reference.
    f(unsafe { &mut *HEAP.dlmalloc.get() })
}

/// The own heap as a Rust global allocator. The preload shim installs it.
pub struct OwnHeap;

// SAFETY: dlmalloc honours size and alignment; each block goes back to dlmalloc with the
// layout it was allocated with, as `GlobalAlloc` guarantees.
unsafe impl GlobalAlloc for OwnHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: a valid layout (GlobalAlloc's contract).
        with_heap(|h| unsafe { h.malloc(layout.size(), layout.align()) })
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as alloc.
        with_heap(|h| unsafe { h.calloc(layout.size(), layout.align()) })
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: ptr was allocated here with this layout (GlobalAlloc's contract).
        with_heap(|h| unsafe { h.free(ptr, layout.size(), layout.align()) })
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as dealloc, and new_size is valid for the alignment (GlobalAlloc's contract).
        with_heap(|h| unsafe { h.realloc(ptr, layout.size(), layout.align(), new_size) })
    }
}

/// Before `fork`: hold the lock, so that no thread is inside dlmalloc while memory is copied.
pub(crate) fn fork_prepare() {
    core::mem::forget(HEAP.lock.lock());
}

/// Whether the heap is free, or comes free within `ms` milliseconds. A thread stopped for good
/// while it holds the heap (a signal handler that never returns, a thread stopped by a
/// debugger or a garbage collector, interrupted it inside mallocspy) would hang whoever needs
/// it next: the exit reports ask first.
pub(crate) fn free_within(ms: u64) -> bool {
    let deadline = os::monotonic_ns() + ms * 1_000_000;
    while !HEAP.lock.is_free() {
        if os::monotonic_ns() >= deadline {
            return false;
        }
        os::pause_us(1000);
    }
    true
}

/// After `fork`, in the parent and in the child (where the holder is the forking thread).
pub(crate) fn fork_release() {
    HEAP.lock.force_unlock();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heap_held_for_good_is_waited_for_only_so_long() {
        assert!(free_within(0));
        fork_prepare();
        let start = os::monotonic_ns();
        assert!(!free_within(20));
        assert!(os::monotonic_ns() - start >= 20_000_000);
        fork_release();
        assert!(free_within(20));
    }

    #[test]
    fn blocks_are_aligned_zeroed_when_asked_and_keep_their_contents_through_realloc() {
        let heap = OwnHeap;
        let layout = Layout::from_size_align(100, 64).unwrap();
        // SAFETY: a valid layout; every block is freed with the layout it has.
        unsafe {
            let p = heap.alloc_zeroed(layout);
            assert!(!p.is_null() && (p as usize).is_multiple_of(64));
            assert!((0..100).all(|i| *p.add(i) == 0));
            p.write_bytes(7, 100);
            let q = heap.realloc(p, layout, 1 << 20);
            assert!(!q.is_null() && (q as usize).is_multiple_of(64));
            assert!((0..100).all(|i| *q.add(i) == 7));
            // Other tests lease and return pool memory meanwhile: only a lower bound holds.
            assert!(pool::usage().1 >= 1 << 20, "the heap's memory is leased from the pool");
            assert!(pool::owns(q as u64, q as u64 + 1), "the leak scan knows it as mallocspy's");
            heap.dealloc(q, Layout::from_size_align(1 << 20, 64).unwrap());
        }
    }
}
