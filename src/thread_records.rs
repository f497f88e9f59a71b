//! One record per thread slot, for a spy's per-thread state: leased from mallocspy's pool the
//! first time a slot is used, never freed (a later thread of the slot takes it over), readable
//! by any thread for the totals.

use core::cell::UnsafeCell;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use crate::pool;
use crate::threads::{self, MAX_THREADS};

/// A record type that is valid when all its bytes are zero (atomics, integers, arrays,
/// `UnsafeCell`s of such), as the pool's leases are.
///
/// # Safety
/// An all-zero `T` must be a valid value.
pub(crate) unsafe trait Zeroed {}

/// `[*mut T; MAX_THREADS]`, indexed by thread slot.
pub(crate) struct ThreadRecords<T: Zeroed> {
    slots: NonNull<AtomicPtr<T>>,
}

// SAFETY: the slots are atomics; the records are shared as `&T` and `T: Sync` is required to
// share them across threads.
unsafe impl<T: Zeroed + Sync> Sync for ThreadRecords<T> {}
// SAFETY: as above.
unsafe impl<T: Zeroed + Sync> Send for ThreadRecords<T> {}

impl<T: Zeroed> ThreadRecords<T> {
    /// The table; `None` if its memory cannot be mapped.
    pub(crate) fn new() -> Option<Self> {
        Some(Self { slots: threads::map_per_thread::<AtomicPtr<T>>()? })
    }

    fn slot(&self, index: usize) -> &AtomicPtr<T> {
        debug_assert!(index < MAX_THREADS);
        // SAFETY: index < MAX_THREADS, the array's length; zeroed memory is null pointers.
        unsafe { &*self.slots.as_ptr().add(index) }
    }

    /// The record of slot `index`, leased the first time; `None` past mallocspy's memory
    /// limit. Only the slot's owner may lease it (no two threads race for one slot).
    pub(crate) fn get_or_lease(&self, index: u32) -> Option<&T> {
        let slot = self.slot(index as usize);
        let mut record = slot.load(Ordering::Acquire);
        if record.is_null() {
            record = pool::lease(core::mem::size_of::<T>())?.as_ptr().cast();
            slot.store(record, Ordering::Release);
        }
        // SAFETY: published records live as long as the process (the pool never takes them
        // back); leases are zeroed, and a zeroed T is valid (`T: Zeroed`).
        Some(unsafe { &*record })
    }

    /// The record of slot `index`, if it was ever leased.
    pub(crate) fn get(&self, index: u32) -> Option<&T> {
        // SAFETY: as in `get_or_lease`.
        unsafe { self.slot(index as usize).load(Ordering::Acquire).as_ref() }
    }

    /// Every record leased so far.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        (0..threads::high_water() as u32).filter_map(|i| self.get(i))
    }
}

/// The part of a thread's record that only the owning thread touches, inside its hooks.
pub(crate) struct Owned<T>(UnsafeCell<T>);

impl<T> Owned<T> {
    /// The owner's view.
    ///
    /// # Safety
    /// Only the thread owning the record may call this, from inside a hook, and not while an
    /// earlier result is in use (hooks do not nest into the spy).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn get(&self) -> &mut T {
        // SAFETY: the caller's guarantee makes this the only reference.
        unsafe { &mut *self.0.get() }
    }
}

/// Adds `n` to a counter only the calling thread writes: a load and a store, no atomic
/// read-modify-write (readers sum the threads' counters).
#[inline(always)]
pub(crate) fn bump(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}
