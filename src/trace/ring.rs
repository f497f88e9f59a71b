//! The bounded queue between the hook path and the trace writer process.
//!
//! Dmitry Vyukov's bounded MPMC queue, used with one consumer, in a shared anonymous mapping
//! that the writer process inherits: each 64-byte slot carries a sequence number telling
//! producers and the consumer whose turn it is, and seven words of message. A message takes
//! one slot, or a run of consecutive slots claimed with one CAS on the head (a tick with its
//! stack, a statistics event). A push never waits, never allocates and never locks, so it is
//! safe inside any hook, a signal handler included (a push interrupted by a handler's push
//! only delays the consumer until the interrupted one publishes). A full queue drops the
//! message and counts it: the program never waits for the writer.

use core::cell::UnsafeCell;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};

use crate::{os, prefetch};

/// Words of message per slot.
pub(crate) const WORDS: usize = 7;
/// Most slots one message may take.
pub(crate) const MAX_SLOTS: usize = 32;
/// How many times a lap of the queue a producer looks at how full it is.
const FILL_CHECKS_PER_LAP: usize = 8;

#[repr(C, align(64))]
struct Slot {
    sequence: AtomicUsize,
    words: UnsafeCell<[u64; WORDS]>,
}

/// The queue's shared state, at the start of the mapping; the slots follow.
#[repr(C)]
struct Control {
    head: AtomicUsize,
    _head_line: [u8; 56],
    /// Only the consumer moves it.
    tail: AtomicUsize,
    _tail_line: [u8; 56],
    dropped: AtomicU64,
    /// 1 while the consumer sleeps for want of messages.
    idle: AtomicU32,
    /// Where the consumer has finished with the messages it popped (a position, as `tail`).
    done: AtomicUsize,
    /// The error number of the consumer's first failed write of the trace (0: none), and the
    /// bytes of the trace written before it: for the program to say at exit.
    write_error: AtomicU32,
    written_before_error: AtomicU64,
    /// When the program last unloaded a library (ns since its start, at least 1), until the
    /// consumer takes it (0).
    unloaded_ns: AtomicU64,
    /// A futex shared by the two processes, for when the program has closed its socket to the
    /// consumer (see [`Ring::nudge`]).
    nudges: AtomicU32,
    /// 1 once the consumer found the trace file deleted (its directory removed) at the end.
    unlinked: AtomicU32,
    /// 1 once the consumer found the trace file shorter than it wrote at the end (truncated
    /// under it: logrotate's `copytruncate`).
    cut: AtomicU32,
    /// Messages dropped in all, for the program to say at exit (`dropped` is the consumer's
    /// to take).
    dropped_total: AtomicU64,
}

/// A queue in memory shared with the writer process.
pub(crate) struct Ring {
    control: NonNull<Control>,
    slots: NonNull<Slot>,
    mask: usize,
}

// SAFETY: a slot's words are written only by the producer that claimed it (by CAS on `head`)
// and read only by the consumer after the producer published it through `sequence`.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

/// What became of a pushed message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Push {
    /// Queued.
    Queued,
    /// Queued while the consumer slept: this producer, and no other, is to wake it.
    QueuedWake,
    /// Queued, past half full: this producer is to wake the consumer now, though it is not
    /// asleep (between two drains it waits up to `stats_interval_ms`, and a burst could fill
    /// the rest meanwhile).
    QueuedFilling,
    /// Dropped (and counted): the queue had no room.
    Dropped,
}

impl Push {
    /// Whether the message is in the queue.
    pub(crate) fn queued(self) -> bool {
        self != Push::Dropped
    }

    /// Whether the producer is to wake the consumer.
    pub(crate) fn wakes(self) -> bool {
        matches!(self, Push::QueuedWake | Push::QueuedFilling)
    }
}

/// Slots a message of `words` words takes.
pub(crate) fn slots_for(words: usize) -> usize {
    words.div_ceil(WORDS).max(1)
}

impl Ring {
    /// A queue of `capacity` slots (a power of two) in a new shared mapping; `None` if the
    /// kernel refuses it.
    pub(crate) fn new_shared(capacity: usize) -> Option<Self> {
        assert!(capacity.is_power_of_two() && capacity >= MAX_SLOTS);
        let control_bytes = core::mem::size_of::<Control>().next_multiple_of(64);
        let base = os::map_shared(control_bytes + capacity * core::mem::size_of::<Slot>())?;
        // SAFETY: the mapping holds the control block and then `capacity` slots; zeroed
        // memory is a valid value of both (atomics and plain words).
        let slots = unsafe { NonNull::new_unchecked(base.as_ptr().add(control_bytes)) }.cast();
        Some(Ring { control: base.cast(), slots, mask: capacity - 1 })
    }

    /// Where the shared mapping starts (the same address in the writer, a fork of the program).
    pub(crate) fn address(&self) -> usize {
        self.control.as_ptr() as usize
    }

    fn control(&self) -> &Control {
        // SAFETY: the mapping lives as long as the ring (it is never unmapped).
        unsafe { self.control.as_ref() }
    }

    fn slot(&self, position: usize) -> &Slot {
        // SAFETY: masked into the mapping's mask + 1 slots.
        unsafe { &*self.slots.as_ptr().add(position & self.mask) }
    }

    /// The sequence number of the slot of `position`. A slot stores it less its own index,
    /// so that the fresh mapping's zeros are the queue's first state (slot `i` waits for the
    /// message at position `i`) and no page of the queue is touched before a message needs
    /// it: writing the numbers out faulted in all 2 MiB at start-up.
    fn sequence(&self, position: usize) -> usize {
        self.slot(position).sequence.load(Ordering::Acquire).wrapping_add(position & self.mask)
    }

    fn set_sequence(&self, position: usize, sequence: usize) {
        self.slot(position).sequence.store(sequence.wrapping_sub(position & self.mask), Ordering::Release);
    }

    /// Queues the message `head` followed by `tail` (at most `MAX_SLOTS * WORDS` words in
    /// all), and says whether the caller is to wake the consumer.
    pub(crate) fn push(&self, head: &[u64], tail: &[u64]) -> Push {
        let n = slots_for(head.len() + tail.len());
        debug_assert!(n <= MAX_SLOTS);
        let Some(position) = self.claim(n) else { return Push::Dropped };
        let notice = self.notice(position, n);
        // Slot by slot, `head` then `tail`, each through a counted loop: a chained iterator
        // branches on every word (a push took 132 instructions with one, 80 without).
        let (mut head, mut tail) = (head, tail);
        for i in 0..n {
            let mut slot_words = [0u64; WORDS];
            let from_head = head.len().min(WORDS);
            for (w, &v) in slot_words.iter_mut().zip(&head[..from_head]) {
                *w = v;
            }
            let from_tail = tail.len().min(WORDS - from_head);
            for (w, &v) in slot_words[from_head..].iter_mut().zip(&tail[..from_tail]) {
                *w = v;
            }
            (head, tail) = (&head[from_head..], &tail[from_tail..]);
            // SAFETY: the claim made these slots ours until we publish them.
            unsafe { *self.slot(position + i).words.get() = slot_words };
        }
        // The first slot last: once the consumer sees it, it finds the rest published.
        for i in (0..n).rev() {
            self.set_sequence(position + i, position + i + 1);
        }
        self.pushed(position + n, notice)
    }

    /// Queues a message of one slot, `N` words known when compiled, as [`Ring::push`] does.
    /// The commonest messages (a tick of a stack already sent, the free of a sampled block)
    /// come this way: their words go into the slot in a few moves, where `push`'s loops over
    /// lengths known only at run time cost a call of `memcpy` and 150 instructions a message
    /// (cachegrind, churn).
    pub(crate) fn push_one<const N: usize>(&self, message: &[u64; N]) -> Push {
        const { assert!(N <= WORDS) };
        let Some(position) = self.claim(1) else { return Push::Dropped };
        let notice = self.notice(position, 1);
        let mut words = [0u64; WORDS];
        words[..N].copy_from_slice(message);
        // SAFETY: the claim made this slot ours until we publish it.
        unsafe { *self.slot(position).words.get() = words };
        self.set_sequence(position, position + 1);
        self.pushed(position + 1, notice)
    }

    /// Claims `n` consecutive slots for a message: their first position, or `None` (the
    /// message dropped and counted) when the queue has no room.
    #[inline(always)]
    fn claim(&self, n: usize) -> Option<usize> {
        let next = &self.control().head;
        let mut position = next.load(Ordering::Relaxed);
        loop {
            // The consumer frees slots in order: when the last of the run is free, all are.
            let last = position + n - 1;
            let sequence = self.sequence(last);
            match (sequence as isize).wrapping_sub(last as isize) {
                0 => match next.compare_exchange_weak(position, position + n, Ordering::SeqCst, Ordering::Relaxed) {
                    Ok(_) => return Some(position),
                    Err(now) => position = now,
                },
                d if d < 0 => {
                    self.control().dropped.fetch_add(1, Ordering::Relaxed);
                    self.control().dropped_total.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                _ => position = next.load(Ordering::Relaxed),
            }
        }
    }

    /// What the producer that claimed `n` slots at `position` is to do once it has published
    /// them: whether the consumer sleeps, and whether the claim filled the queue past half.
    #[inline(always)]
    fn notice(&self, position: usize, n: usize) -> (bool, bool) {
        // Whether the consumer sleeps, read after the claim: [`Ring::go_idle`] announces a
        // sleep and then reads the head, so either it sees this claim or this sees its flag
        // (all four accesses sequentially consistent). The claim's locked instruction is the
        // barrier on x86; a fence after publishing, as before, cost 17 ns a message.
        let sleeping = self.control().idle.load(Ordering::SeqCst) != 0;
        // The producer whose claim crosses an eighth of a lap looks at the consumer's place:
        // the consumer drains every `stats_interval_ms`, and at churn's pace (two threads, 220
        // thousand messages a second) a lap lasts 150 ms. Left to its timer alone, it lost
        // messages in a third of such runs. A stale `tail` only wakes it early.
        let end = position + n;
        let slots = self.mask + 1;
        // Both powers of two: the claim crosses a multiple of the stride when the positions
        // differ in its bit or above.
        let filling = (position ^ end) >= slots / FILL_CHECKS_PER_LAP
            && end.wrapping_sub(self.control().tail.load(Ordering::Relaxed)) > slots / 2;
        (sleeping, filling)
    }

    /// After a message is published (the next message's position: `next`), with what
    /// [`Ring::notice`] said of its claim.
    #[inline(always)]
    fn pushed(&self, next: usize, (sleeping, filling): (bool, bool)) -> Push {
        // The next message's slot, last written by the consumer a lap ago (in its cache, or
        // evicted): its transfer was three quarters of a push on churn. Fetched now, it is
        // here by the next tick.
        prefetch::write((self.slot(next) as *const Slot).cast());
        if sleeping && self.control().idle.swap(0, Ordering::AcqRel) != 0 {
            Push::QueuedWake
        } else if filling {
            Push::QueuedFilling
        } else {
            Push::Queued
        }
    }

    /// The oldest published message, appended to `out` (whole slots, so padded to a multiple
    /// of `WORDS`), given the number of words it has from its first slot. Only the consumer
    /// (one thread of one process) may call it.
    pub(crate) fn pop(&self, out: &mut Vec<u64>, words_of: impl Fn(&[u64; WORDS]) -> usize) -> bool {
        let tail = &self.control().tail;
        let position = tail.load(Ordering::Relaxed);
        if self.sequence(position) != position + 1 {
            return false;
        }
        // SAFETY: published by its producer (sequence = position + 1).
        let head_words = unsafe { *self.slot(position).words.get() };
        let n = slots_for(words_of(&head_words)).min(MAX_SLOTS);
        for i in 0..n {
            let slot = self.slot(position + i);
            // SAFETY: the producer published the rest of its run before the first slot.
            out.extend_from_slice(unsafe { &*slot.words.get() });
            self.set_sequence(position + i, position + i + self.mask + 1);
        }
        tail.store(position + n, Ordering::Relaxed);
        true
    }

    /// Consumer: everything popped so far has been dealt with.
    pub(crate) fn mark_done(&self) {
        self.control().done.store(self.control().tail.load(Ordering::Relaxed), Ordering::Release);
    }

    /// Whether `n` more slots are free by the consumer's last report (its `done`): a producer
    /// with many messages and the time to wait for room waits rather than drop them.
    pub(crate) fn has_room(&self, n: usize) -> bool {
        let c = self.control();
        c.head.load(Ordering::Acquire).wrapping_sub(c.done.load(Ordering::Acquire)) + n <= self.mask + 1
    }

    /// Producer: the position after the last message claimed so far, to compare with
    /// [`Ring::done`] later.
    pub(crate) fn claimed(&self) -> usize {
        self.control().head.load(Ordering::Acquire)
    }

    /// Whether the consumer has dealt with every message before position `claimed`.
    pub(crate) fn done(&self, claimed: usize) -> bool {
        self.control().done.load(Ordering::Acquire) >= claimed
    }

    /// Consumer: the trace could not be written past `written` bytes, for error `errno`.
    pub(crate) fn note_write_error(&self, errno: i32, written: u64) {
        self.control().written_before_error.store(written, Ordering::Relaxed);
        self.control().write_error.store(errno as u32, Ordering::Release);
    }

    /// Producer: the error of the consumer's failed write, if any, and the bytes written before it.
    pub(crate) fn write_error(&self) -> Option<(i32, u64)> {
        let errno = self.control().write_error.load(Ordering::Acquire) as i32;
        (errno != 0).then(|| (errno, self.control().written_before_error.load(Ordering::Relaxed)))
    }

    /// Consumer: the trace file was deleted while it was written.
    pub(crate) fn note_unlinked(&self) {
        self.control().unlinked.store(1, Ordering::Release);
    }

    /// Producer: whether the consumer found the trace file deleted.
    pub(crate) fn unlinked(&self) -> bool {
        self.control().unlinked.load(Ordering::Acquire) != 0
    }

    /// Consumer: the trace file is shorter than what was written to it.
    pub(crate) fn note_cut(&self) {
        self.control().cut.store(1, Ordering::Release);
    }

    /// Producer: whether the consumer found the trace file shorter than it wrote.
    pub(crate) fn cut(&self) -> bool {
        self.control().cut.load(Ordering::Acquire) != 0
    }

    /// Producer: the messages dropped for want of room, in all.
    pub(crate) fn dropped_total(&self) -> u64 {
        self.control().dropped_total.load(Ordering::Relaxed)
    }

    /// Whether a message waits for the consumer.
    pub(crate) fn has_message(&self) -> bool {
        let position = self.control().tail.load(Ordering::Relaxed);
        self.sequence(position) == position + 1
    }

    /// Producer: the program unloaded a library at `time_ns`. A mark rather than a message,
    /// which the next `dlclose` would wait for the consumer to deal with ([`Ring::done`]).
    pub(crate) fn note_unloaded(&self, time_ns: u64) {
        self.control().unloaded_ns.store(time_ns.max(1), Ordering::Release);
    }

    /// Consumer: when the program last unloaded a library, if it did since the last call.
    pub(crate) fn take_unloaded(&self) -> Option<u64> {
        Some(self.control().unloaded_ns.swap(0, Ordering::Acquire)).filter(|&t| t != 0)
    }

    /// Messages dropped since the last call (the queue was full).
    pub(crate) fn take_dropped(&self) -> u64 {
        self.control().dropped.swap(0, Ordering::Relaxed)
    }

    /// Consumer: announce a sleep. Returns `false` (and stays awake) when a message has been
    /// claimed meanwhile, published or not yet. Pairs with [`Ring::push`] (either the
    /// producer sees the flag, or the consumer sees the claim) and with [`Ring::take_idle`].
    pub(crate) fn go_idle(&self) -> bool {
        self.control().idle.store(1, Ordering::SeqCst);
        if self.control().head.load(Ordering::SeqCst) != self.control().tail.load(Ordering::Relaxed) {
            self.control().idle.store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Producer: wakes a consumer that sleeps in [`Ring::sleep_unless_nudged`] (one the
    /// socket cannot reach: the program closed it). A system call: only where the socket's
    /// byte would have been sent.
    pub(crate) fn nudge(&self) {
        let word = &self.control().nudges;
        word.fetch_add(1, Ordering::Release);
        // SAFETY: FUTEX_WAKE on a word of the shared mapping (not private: the consumer is
        // another process) reads nothing else.
        unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1) };
    }

    /// Consumer: the nudges so far, read before looking at the queue.
    pub(crate) fn nudges(&self) -> u32 {
        self.control().nudges.load(Ordering::Acquire)
    }

    /// Consumer: sleeps up to `timeout_ms` unless nudged since [`Ring::nudges`] said `seen`.
    pub(crate) fn sleep_unless_nudged(&self, seen: u32, timeout_ms: i32) {
        let timeout = libc::timespec {
            tv_sec: (timeout_ms / 1000) as libc::time_t,
            tv_nsec: (timeout_ms % 1000) as libc::c_long * 1_000_000,
        };
        let word = &self.control().nudges;
        // SAFETY: FUTEX_WAIT on a word of the shared mapping with a relative timeout; it
        // returns at once if the word is no longer `seen`.
        unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, seen, &timeout) };
    }

    /// Whether the consumer sleeps and is now to be woken (once), for a producer that wakes
    /// it whatever its push said (at exit, before a library is unmapped).
    #[inline]
    pub(crate) fn take_idle(&self) -> bool {
        fence(Ordering::SeqCst);
        let idle = &self.control().idle;
        idle.load(Ordering::Relaxed) != 0 && idle.swap(0, Ordering::AcqRel) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first_word_count(w: &[u64; WORDS]) -> usize {
        w[0] as usize
    }

    #[test]
    fn messages_of_any_length_come_out_in_order_and_a_full_queue_drops_and_counts() {
        let ring = Ring::new_shared(32).unwrap();
        let message = |len: usize, tag: u64| -> Vec<u64> {
            let mut m = vec![len as u64];
            m.extend((1..len as u64).map(|i| tag << 32 | i));
            m
        };
        let mut pushed = Vec::new();
        // Lengths 4 and 7 also go through `push_one`, as a free and a tick without frames do.
        for (i, len) in [1usize, 7, 8, 20, 3, 4, 7].into_iter().cycle().take(30).enumerate() {
            let m = message(len, i as u64);
            let queued = match (len, i % 2) {
                (4, _) => ring.push_one::<4>(m[..].try_into().unwrap()),
                (7, 0) => ring.push_one::<7>(m[..].try_into().unwrap()),
                _ => ring.push(&m, &[]),
            };
            if queued.queued() {
                pushed.push(m);
            }
        }
        assert!(pushed.len() < 30 && ring.take_dropped() == 30 - pushed.len() as u64);
        let mut popped = Vec::new();
        loop {
            let mut out = Vec::new();
            if !ring.pop(&mut out, first_word_count) {
                break;
            }
            out.truncate(out[0] as usize);
            popped.push(out);
        }
        assert_eq!(popped, pushed);
        let last = message(20, 99);
        let (head, tail) = last.split_at(3);
        assert!(ring.push(head, tail).queued(), "room again, and a message in two parts");
    }

    #[test]
    fn the_producer_sees_when_the_consumer_is_done_with_what_it_pushed() {
        let ring = Ring::new_shared(32).unwrap();
        assert!(ring.done(ring.claimed()), "nothing pushed: nothing to wait for");
        assert!(ring.push(&[2, 7], &[]).queued() && ring.push(&[1], &[]).queued());
        let claimed = ring.claimed();
        let mut out = Vec::new();
        assert!(ring.pop(&mut out, first_word_count));
        ring.mark_done();
        assert!(!ring.done(claimed), "one message still queued");
        assert!(ring.pop(&mut out, first_word_count));
        assert!(!ring.done(claimed), "popped but not yet dealt with");
        ring.mark_done();
        assert!(ring.done(claimed));
    }

    #[test]
    fn an_unload_mark_is_taken_once_with_the_latest_time() {
        let ring = Ring::new_shared(64).unwrap();
        assert_eq!(ring.take_unloaded(), None);
        ring.note_unloaded(0);
        assert_eq!(ring.take_unloaded(), Some(1), "an unload at the start is one too");
        assert_eq!(ring.take_unloaded(), None);
        ring.note_unloaded(5);
        ring.note_unloaded(9);
        assert_eq!(ring.take_unloaded(), Some(9));
    }

    #[test]
    fn room_is_what_the_consumer_has_dealt_with() {
        let ring = Ring::new_shared(32).unwrap();
        assert!(ring.has_room(32) && !ring.has_room(33));
        for i in 0..32 {
            assert!(ring.push(&[2, i], &[]).queued());
        }
        assert!(!ring.has_room(1), "full");
        let mut out = Vec::new();
        assert!(ring.pop(&mut out, first_word_count));
        assert!(!ring.has_room(1), "popped but not yet dealt with");
        ring.mark_done();
        assert!(ring.has_room(1) && !ring.has_room(2));
    }

    #[test]
    fn a_push_to_a_sleeping_consumer_says_to_wake_it_once_and_a_claim_keeps_it_awake() {
        let ring = Ring::new_shared(32).unwrap();
        assert_eq!(ring.push(&[1], &[]), Push::Queued, "the consumer is awake");
        assert!(!ring.go_idle(), "a message waits: no sleep");
        let mut out = Vec::new();
        assert!(ring.pop(&mut out, first_word_count));
        assert!(ring.go_idle(), "nothing claimed: it sleeps");
        assert_eq!(ring.push(&[1], &[]), Push::QueuedWake);
        assert_eq!(ring.push(&[1], &[]), Push::Queued, "to be woken once");
        assert!(!ring.take_idle());
        while ring.pop(&mut out, first_word_count) {}
        // A producer between its claim and its publication: the consumer stays awake.
        ring.control().head.fetch_add(1, Ordering::SeqCst);
        assert!(!ring.go_idle() && !ring.has_message());
    }

    #[test]
    fn past_half_full_a_producer_wakes_the_consumer_once_an_eighth_of_a_lap() {
        // 64 slots: a look every 8 claimed, a wake above 32 queued.
        let ring = Ring::new_shared(64).unwrap();
        let filling = |ring: &Ring, ends: core::ops::RangeInclusive<usize>| -> Vec<usize> {
            ends.filter(|_| ring.push(&[1], &[]) == Push::QueuedFilling).collect()
        };
        assert_eq!(filling(&ring, 1..=64), [40, 48, 56, 64]);
        let mut out = Vec::new();
        for _ in 0..40 {
            assert!(ring.pop(&mut out, first_word_count));
        }
        assert_eq!(filling(&ring, 65..=80), [80], "32 queued at 72 is half: no wake");
        // A message of three slots that crosses the mark wakes too.
        for _ in 0..16 {
            assert!(ring.pop(&mut out, first_word_count));
        }
        assert!(filling(&ring, 81..=86).is_empty());
        assert_eq!(ring.push(&[15; 15], &[]), Push::QueuedFilling, "slots 86 to 88: 33 queued");
    }

    #[test]
    fn producers_on_many_threads_lose_nothing_that_fits() {
        let ring = Ring::new_shared(1 << 14).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let ring = &ring;
                s.spawn(move || {
                    for i in 0..1000u64 {
                        let len = 1 + (i % 3) as usize * 7;
                        let mut m = vec![len as u64, t << 32 | i];
                        m.resize(len, t);
                        assert!(ring.push(&m[..len], &[]).queued());
                    }
                });
            }
        });
        let mut seen = Vec::new();
        let mut out = Vec::new();
        while ring.pop(&mut out, first_word_count) {
            let len = out[0] as usize;
            seen.push(if len > 1 { out[1] } else { u64::MAX });
            out.clear();
        }
        assert_eq!(seen.len(), 4000);
    }

    #[test]
    fn a_forked_consumer_sees_what_the_parent_pushes_later() {
        let _alone = crate::trace::FORKING_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let ring = Ring::new_shared(64).unwrap();
        // SAFETY: the child only spins on the shared ring and leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let mut out = Vec::new();
            for _ in 0..5_000_000 {
                if ring.pop(&mut out, first_word_count) {
                    // SAFETY: leaves the child at once.
                    unsafe { libc::_exit(if out[..3] == [3, 42, 43] { 0 } else { 1 }) };
                }
                std::thread::yield_now();
            }
            // SAFETY: as above.
            unsafe { libc::_exit(2) };
        }
        assert!(ring.push(&[3, 42, 43], &[]).queued());
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 0, "the child saw the message");
    }
}
