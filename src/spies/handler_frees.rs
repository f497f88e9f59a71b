//! The leak tracker's queue of frees made by signal handlers that interrupted one of their
//! thread's hooks while it held the lock of the block's shard: the handler cannot remove the
//! record (waiting for that lock would never end), so it queues the address, and the next free
//! of any thread (or a report) removes it.
//!
//! One queue for the process, a page of slots, rather than a few slots per thread: with 4 per
//! thread, a storm of SIGALRM handlers every 20 us under CPU load (`handler_frees.c` beside
//! three busy loops on two cores) filled them in about 2 runs of 1,200 (once 16 in a row): a
//! handler preempted while it runs finds the next signal pending when it returns, and the
//! interrupted hook makes no progress in between. A count in front of the slots keeps an empty
//! queue at one load for the hooks that look.

use core::sync::atomic::{AtomicUsize, Ordering};

use crate::pool;

/// Slots in the queue: a page of them (a lease is at least a page).
pub(crate) const SLOTS: usize = 4096 / core::mem::size_of::<AtomicUsize>();

/// Addresses freed by signal handlers whose records are still in the live table; 0 when a
/// slot is empty. Whoever swaps a slot to 0, under the lock of its address's shard, removes
/// the record ([`HandlerFrees::claim`]).
pub(crate) struct HandlerFrees {
    /// At least the number of slots taken: raised before a slot is taken, lowered after one is
    /// emptied, so that none is missed by a reader that finds it 0.
    queued: AtomicUsize,
    slots: &'static [AtomicUsize; SLOTS],
}

/// What [`HandlerFrees::push`] did.
pub(crate) enum Push {
    Queued(&'static AtomicUsize),
    AlreadyQueued,
    /// Every slot is taken.
    Full,
}

impl HandlerFrees {
    /// An empty queue; `None` if its page cannot be leased.
    pub(crate) fn new() -> Option<Self> {
        let page = pool::lease(core::mem::size_of::<[AtomicUsize; SLOTS]>())?;
        // SAFETY: the lease is zeroed (all slots empty), large enough, page-aligned and never
        // given back.
        let slots = unsafe { &*page.as_ptr().cast::<[AtomicUsize; SLOTS]>() };
        Some(Self { queued: AtomicUsize::new(0), slots })
    }

    /// Whether a free may be queued. A thread holding the lock of a shard sees every free of
    /// that shard's addresses queued before another thread released it.
    #[inline(always)]
    pub(crate) fn any(&self) -> bool {
        self.queued.load(Ordering::Acquire) != 0
    }

    /// Queues the free of `ptr`, unless it is queued already: then the address was given out
    /// again unseen (a handler's own `malloc` inside the hook) and freed again, its record is
    /// still the one that free removes, and a second entry would remove the record of the
    /// block a recorded allocation gets there next (review helper 166: a handler's `malloc`
    /// and `free` of the same three blocks every 20 us filled the queue, and main's leaks of
    /// those addresses went unreported).
    pub(crate) fn push(&self, ptr: usize) -> Push {
        if self.any() && self.slots.iter().any(|slot| slot.load(Ordering::Acquire) == ptr) {
            return Push::AlreadyQueued;
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let free = |slot: &&AtomicUsize| {
            slot.load(Ordering::Relaxed) == 0
                && slot.compare_exchange(0, ptr, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        };
        match self.slots.iter().find(free) {
            Some(slot) => Push::Queued(slot),
            None => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                Push::Full
            }
        }
    }

    /// Empties `slot` if it still holds `ptr`: whether this call did (the caller then owns the
    /// removal of `ptr`'s record).
    pub(crate) fn claim(&self, slot: &AtomicUsize, ptr: usize) -> bool {
        let claimed = slot.compare_exchange(ptr, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok();
        if claimed {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        claimed
    }

    /// Takes back every queued free of `ptr` (an allocation got the address back); whether
    /// there was one. Plain loads find them, as in the threads' own queues.
    pub(crate) fn withdraw(&self, ptr: usize) -> bool {
        self.any()
            && self.slots.iter().filter(|slot| slot.load(Ordering::Relaxed) == ptr && self.claim(slot, ptr)).count() > 0
    }

    /// Every queued address, with its slot (for [`Self::claim`]).
    pub(crate) fn queued(&self) -> impl Iterator<Item = (&'static AtomicUsize, usize)> {
        let slots = if self.any() { &self.slots[..] } else { &[] };
        slots.iter().map(|slot| (slot, slot.load(Ordering::Acquire))).filter(|&(_, ptr)| ptr != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_refuses_and_an_emptied_slot_is_taken_again() {
        let q = HandlerFrees::new().unwrap();
        assert!(!q.any() && q.queued().next().is_none());
        let slot = |push| match push {
            Push::Queued(slot) => slot,
            _ => panic!("not queued"),
        };
        let taken: Vec<_> = (1..=SLOTS).map(|i| slot(q.push(i * 16))).collect();
        assert!(matches!(q.push(0x9990), Push::Full));
        assert!(matches!(q.push(5 * 16), Push::AlreadyQueued));
        assert_eq!(q.queued().count(), SLOTS);
        assert!(!q.claim(taken[3], 0x1230), "a slot holding another address is not emptied");
        assert!(q.withdraw(4 * 16) && !q.withdraw(4 * 16));
        slot(q.push(0x9990));
        for (slot, ptr) in q.queued() {
            assert!(q.claim(slot, ptr));
        }
        assert!(!q.any() && q.queued().next().is_none());
    }
}
