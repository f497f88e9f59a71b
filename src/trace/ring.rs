//! The bounded queue between the hook path and the trace writer.
//!
//! Dmitry Vyukov's bounded MPMC queue, used with one consumer: each slot carries a sequence
//! number telling producers and the consumer whose turn it is. A push is one CAS on the head
//! and two stores; it never waits, never allocates and never locks, so it is safe inside
//! any hook, a signal handler included (a push interrupted by a handler's push only delays
//! the consumer until the interrupted one publishes). A full queue drops the event and
//! counts it: the program never waits for the writer.

use core::cell::UnsafeCell;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::pool;

/// What the hook path hands to the writer (the writer adds stacks, modules, statistics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Raw {
    pub tag: RawTag,
    pub kind: u8,
    pub entry: u8,
    pub thread: u32,
    pub stack: u32,
    pub time_ns: u64,
    pub size: u64,
    pub address: u64,
    pub weight: u64,
}

/// The events the hook path makes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum RawTag {
    #[default]
    Tick,
    Free,
    /// `size` holds the kernel thread id.
    ThreadStart,
    ThreadExit,
}

#[repr(C, align(64))]
struct Slot {
    sequence: AtomicUsize,
    event: UnsafeCell<Raw>,
}

/// The queue; its slots live in mallocspy's pool.
pub(crate) struct Ring {
    slots: NonNull<Slot>,
    mask: usize,
    head: AtomicUsize,
    /// Only the consumer moves it.
    tail: AtomicUsize,
    dropped: AtomicU64,
}

// SAFETY: a slot's event is written only by the producer that claimed it (by CAS on `head`)
// and read only by the consumer after the producer published it through `sequence`.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

impl Ring {
    /// A queue of `capacity` (a power of two) events; `None` if its memory cannot be had.
    pub(crate) fn new(capacity: usize) -> Option<Self> {
        assert!(capacity.is_power_of_two());
        let slots: NonNull<Slot> = pool::lease(capacity * core::mem::size_of::<Slot>())?.cast();
        let ring = Ring {
            slots,
            mask: capacity - 1,
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
        };
        ring.reset();
        Some(ring)
    }

    fn slot(&self, position: usize) -> &Slot {
        // SAFETY: masked into the leased array of mask + 1 slots, zeroed (valid) at lease.
        unsafe { &*self.slots.as_ptr().add(position & self.mask) }
    }

    /// Empties the queue. Only when no one else uses it (start-up, the child after `fork`,
    /// where a slot claimed by a thread that no longer exists would block the consumer).
    pub(crate) fn reset(&self) {
        for i in 0..=self.mask {
            self.slot(i).sequence.store(i, Ordering::Relaxed);
        }
        self.head.store(0, Ordering::Relaxed);
        self.tail.store(0, Ordering::Relaxed);
        self.dropped.store(0, Ordering::Release);
    }

    /// Queues `event`; `false` (and counted) when the queue is full.
    #[inline]
    pub(crate) fn push(&self, event: Raw) -> bool {
        let mut position = self.head.load(Ordering::Relaxed);
        loop {
            let slot = self.slot(position);
            let sequence = slot.sequence.load(Ordering::Acquire);
            match (sequence as isize).wrapping_sub(position as isize) {
                0 => {
                    match self.head.compare_exchange_weak(position, position + 1, Ordering::Relaxed, Ordering::Relaxed)
                    {
                        Ok(_) => {
                            // SAFETY: the CAS made this slot ours until we publish it.
                            unsafe { *slot.event.get() = event };
                            slot.sequence.store(position + 1, Ordering::Release);
                            return true;
                        }
                        Err(now) => position = now,
                    }
                }
                d if d < 0 => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                _ => position = self.head.load(Ordering::Relaxed),
            }
        }
    }

    /// The oldest published event. Only the consumer (one thread at a time) may call it.
    pub(crate) fn pop(&self) -> Option<Raw> {
        let position = self.tail.load(Ordering::Relaxed);
        let slot = self.slot(position);
        if slot.sequence.load(Ordering::Acquire) != position + 1 {
            return None;
        }
        // SAFETY: published by its producer (sequence = position + 1); no producer touches
        // it until we hand it back below.
        let event = unsafe { *slot.event.get() };
        slot.sequence.store(position + self.mask + 1, Ordering::Release);
        self.tail.store(position + 1, Ordering::Relaxed);
        Some(event)
    }

    /// Events dropped since the last call (the queue was full).
    pub(crate) fn take_dropped(&self) -> u64 {
        self.dropped.swap(0, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_out_in_order_and_a_full_queue_drops_and_counts() {
        let ring = Ring::new(8).unwrap();
        for i in 0..10 {
            assert_eq!(ring.push(Raw { size: i, ..Raw::default() }), i < 8);
        }
        assert_eq!(ring.take_dropped(), 2);
        let sizes: Vec<u64> = std::iter::from_fn(|| ring.pop()).map(|e| e.size).collect();
        assert_eq!(sizes, (0..8).collect::<Vec<_>>());
        assert!(ring.push(Raw::default()), "room again");
    }

    #[test]
    fn producers_on_many_threads_lose_nothing_that_fits() {
        let ring = Ring::new(1 << 12).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let ring = &ring;
                s.spawn(move || {
                    for i in 0..1000 {
                        assert!(ring.push(Raw { size: t << 32 | i, ..Raw::default() }));
                    }
                });
            }
        });
        let mut seen: Vec<u64> = std::iter::from_fn(|| ring.pop()).map(|e| e.size).collect();
        seen.sort_unstable();
        let mut want: Vec<u64> = (0..4u64).flat_map(|t| (0..1000).map(move |i| t << 32 | i)).collect();
        want.sort_unstable();
        assert_eq!(seen, want);
    }
}
