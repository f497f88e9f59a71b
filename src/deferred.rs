//! Frees that cannot run where they were asked for, kept until a hook can run them (and, in
//! a ring of their own, blocks served where no spy code could run, for the spy to hear of:
//! see `Interposer::served_unseen`).
//!
//! A `free` of a spied block needs the spy (its `pre_free` knows where the real block starts),
//! but a call made from inside a hook, by a signal handler that interrupted one, or by a thread
//! that has no slot must not run spy code. Such frees are parked here, lock-free, and the next
//! spied hook on any thread finishes them. When the ring is full the block is leaked, which is
//! safe; the count of such leaks is kept for the report.
//!
//! Each parked pointer keeps the function that gave it back (`free`, `realloc`, `operator
//! delete`: the guard checks that it matches the block's allocation) in its top byte, which
//! no user-space address of x86-64 uses.

use core::ffi::c_void;
use core::sync::atomic::{AtomicUsize, Ordering};

use crate::spy::Entry;

/// Where a slot keeps the entry point of its release.
const ENTRY_AT: u32 = 56;

const CAPACITY: usize = 256;

/// A fixed ring of `N` parked pointers, filled from its first slot up.
///
/// `repr(C)`, `pending` first: every spied `free` reads it, and the interposer keeps it on
/// one of its first lines.
#[repr(C)]
pub(crate) struct DeferredFrees<const N: usize = CAPACITY> {
    pending: AtomicUsize,
    leaked: AtomicUsize,
    slots: [AtomicUsize; N],
}

impl<const N: usize> DeferredFrees<N> {
    pub(crate) const fn new() -> Self {
        Self { pending: AtomicUsize::new(0), leaked: AtomicUsize::new(0), slots: [const { AtomicUsize::new(0) }; N] }
    }

    /// Parks `ptr`, given back by `entry`; false (and the block counted as leaked) when the
    /// ring is full.
    pub(crate) fn push(&self, ptr: *mut c_void, entry: Entry) -> bool {
        let parked = self.park(ptr, entry);
        if !parked {
            self.leaked.fetch_add(1, Ordering::Relaxed);
        }
        parked
    }

    /// Parks `ptr` under `entry`, not a release: false when the ring is full (nothing leaks).
    ///
    /// Counted before a slot is taken, so that `pending` is never below the slots filled: a
    /// drain that took a slot whose count was yet to come made it wrap below zero, and a full
    /// ring was read then (review helper 133).
    pub(crate) fn park(&self, ptr: *mut c_void, entry: Entry) -> bool {
        debug_assert!(ptr as usize >> ENTRY_AT == 0);
        if self.pending.fetch_add(1, Ordering::AcqRel) < N {
            let value = ptr as usize | (entry as usize) << ENTRY_AT;
            for slot in &self.slots {
                if slot.load(Ordering::Relaxed) == 0
                    && slot.compare_exchange(0, value, Ordering::AcqRel, Ordering::Relaxed).is_ok()
                {
                    return true;
                }
            }
        }
        self.pending.fetch_sub(1, Ordering::AcqRel);
        false
    }

    /// True when something is parked (one relaxed load: cheap enough for every hook).
    #[inline]
    pub(crate) fn has_pending(&self) -> bool {
        self.pending.load(Ordering::Relaxed) != 0
    }

    /// Takes every parked pointer out and hands it to `f`: up to the last one parked, as
    /// slots fill from the first (a drain that swapped every slot of the ring cost each hook
    /// after a tick callback's allocation 256 locked instructions: review helper 132).
    pub(crate) fn drain(&self, mut f: impl FnMut(*mut c_void, Entry)) {
        for slot in &self.slots {
            if self.pending.load(Ordering::Acquire) == 0 {
                return;
            }
            if slot.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let value = slot.swap(0, Ordering::AcqRel);
            if value != 0 {
                self.pending.fetch_sub(1, Ordering::AcqRel);
                f((value & ((1 << ENTRY_AT) - 1)) as *mut c_void, Entry::from_index((value >> ENTRY_AT) as u8));
            }
        }
    }

    /// Blocks that had to be leaked because the ring was full.
    pub(crate) fn leaked(&self) -> usize {
        self.leaked.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parks_drains_and_counts_overflow() {
        let d = DeferredFrees::<CAPACITY>::new();
        assert!(!d.has_pending());
        for i in 1..=CAPACITY + 3 {
            let entry = if i % 2 == 0 { Entry::Free } else { Entry::OperatorDeleteArray };
            d.push((0x7fff_ffff_f000 + i * 16) as *mut c_void, entry);
        }
        assert!(d.has_pending());
        assert_eq!(d.leaked(), 3);
        let mut got = Vec::new();
        d.drain(|p, entry| got.push((p as usize, entry)));
        got.sort_by_key(|&(p, _)| p);
        let parked = (1..=CAPACITY)
            .map(|i| (0x7fff_ffff_f000 + i * 16, if i % 2 == 0 { Entry::Free } else { Entry::OperatorDeleteArray }));
        assert_eq!(got, parked.collect::<Vec<_>>());
        assert!(!d.has_pending());
    }
}
