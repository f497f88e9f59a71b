//! What the hook path tells the writer process, as the words of a [`super::ring`] message.
//!
//! The first word holds the message's tag, its length in words and, for a tick, the kind and
//! the entry point; the writer needs the length before it has the rest. A tick carries its
//! stack's frames the first time the stack is sent; the writer keeps them from then on.
//! Encoding makes small arrays on the stack (the hook path never allocates, and a tick's
//! frames are queued straight from the stack table); decoding is the writer's.

use super::ring::{MAX_SLOTS, WORDS};
use super::{Event, HeapStats, Tick};

const TICK: u64 = 1;
const FREE: u64 = 2;
const THREAD_START: u64 = 3;
const THREAD_EXIT: u64 = 4;
const STATS: u64 = 5;
const END: u64 = 6;
const INHERITED: u64 = 7;

/// Words of a tick before its frames.
const TICK_WORDS: usize = 7;
/// Words of a statistics message.
const STATS_WORDS: usize = 21;

/// Most words of a message.
pub(crate) const MAX_WORDS: usize = MAX_SLOTS * WORDS;
/// Most frames a tick carries.
pub(crate) const MAX_FRAMES: usize = MAX_WORDS - TICK_WORDS;

/// A message of `N` words: `fields`, whose first word (left 0) becomes the tag and length.
fn encode<const N: usize>(tag: u64, fields: [u64; N]) -> [u64; N] {
    let mut words = fields;
    words[0] = tag | (N as u64) << 8;
    words
}

/// The length in words of the message whose first slot is `first`.
pub(crate) fn words_of(first: &[u64; WORDS]) -> usize {
    ((first[0] >> 8) & 0xFFFF) as usize
}

/// A tick's first words; its `frame_count` frames (at most [`MAX_FRAMES`]; none when the
/// writer has its stack) follow them in the same message.
pub(crate) fn tick(t: &Tick, frame_count: usize) -> [u64; TICK_WORDS] {
    let frames = frame_count.min(MAX_FRAMES);
    let head = TICK | ((TICK_WORDS + frames) as u64) << 8 | (t.kind as u64) << 24 | (t.entry as u64) << 32;
    [head, t.thread as u64 | t.stack << 32, t.time_ns, t.size, t.address, t.weight, frames as u64]
}

pub(crate) fn free(time_ns: u64, thread: u32, address: u64) -> [u64; 4] {
    encode(FREE, [0, thread as u64, time_ns, address])
}

/// A block sampled in the parent, live in the child of a `fork` (see [`Event::Inherited`]).
pub(crate) fn inherited(parent: u32, kind: u8, size: u64, address: u64, weight: u64) -> [u64; 6] {
    encode(INHERITED, [0, parent as u64, kind as u64, size, address, weight])
}

pub(crate) fn thread_start(time_ns: u64, thread: u32, tid: u32) -> [u64; 4] {
    encode(THREAD_START, [0, thread as u64, time_ns, tid as u64])
}

pub(crate) fn thread_exit(time_ns: u64, thread: u32) -> [u64; 3] {
    encode(THREAD_EXIT, [0, thread as u64, time_ns])
}

pub(crate) fn stats(s: &HeapStats) -> [u64; STATS_WORDS] {
    let mut fields = [0u64; STATS_WORDS];
    fields[1] = s.time_ns;
    for (k, kind) in s.kinds.iter().enumerate() {
        fields[2 + 4 * k..6 + 4 * k].copy_from_slice(&[kind.live_bytes, kind.live_blocks, kind.allocs, kind.bytes]);
    }
    fields[14..].copy_from_slice(&[
        s.frees,
        s.peak_live_bytes,
        s.arena_bytes,
        s.mmapped_bytes,
        s.free_bytes,
        s.in_use_bytes,
        s.own_bytes,
    ]);
    encode(STATS, fields)
}

pub(crate) fn end(time_ns: u64) -> [u64; 2] {
    encode(END, [0, time_ns])
}

/// Decodes a message popped from the ring (`words` may carry padding): the event it makes in
/// the trace, and the frames a tick carried (none for other events); `None` if it is not one
/// the hook path makes.
pub(crate) fn decode(words: &[u64]) -> Option<(Event, Vec<u64>)> {
    let len = words_of(words.first_chunk::<WORDS>()?);
    let w = words.get(..len)?;
    let thread = |i: usize| w[i] as u32;
    let event = match w[0] & 0xFF {
        TICK if len >= TICK_WORDS => {
            let frames = w[6] as usize;
            let tick = Tick {
                time_ns: w[2],
                thread: thread(1),
                kind: (w[0] >> 24) as u8,
                entry: (w[0] >> 32) as u8,
                size: w[3],
                address: w[4],
                weight: w[5],
                stack: w[1] >> 32,
            };
            return Some((Event::Tick(tick), w.get(TICK_WORDS..TICK_WORDS + frames)?.to_vec()));
        }
        FREE if len == 4 => Event::Free { thread: thread(1), time_ns: w[2], address: w[3] },
        INHERITED if len == 6 => {
            Event::Inherited { parent: thread(1), kind: w[2] as u8, size: w[3], address: w[4], weight: w[5] }
        }
        THREAD_START if len == 4 => Event::ThreadStart { thread: thread(1), time_ns: w[2], tid: w[3] as u32 },
        THREAD_EXIT if len == 3 => Event::ThreadExit { thread: thread(1), time_ns: w[2] },
        STATS if len == STATS_WORDS => {
            let mut s = HeapStats { time_ns: w[1], ..HeapStats::default() };
            for (k, kind) in s.kinds.iter_mut().enumerate() {
                let f = &w[2 + 4 * k..6 + 4 * k];
                (kind.live_bytes, kind.live_blocks, kind.allocs, kind.bytes) = (f[0], f[1], f[2], f[3]);
            }
            [s.frees, s.peak_live_bytes, s.arena_bytes, s.mmapped_bytes, s.free_bytes, s.in_use_bytes, s.own_bytes] =
                w[14..21].try_into().ok()?;
            Event::HeapStats(s)
        }
        END if len == 2 => Event::End { time_ns: w[1] },
        _ => return None,
    };
    Some((event, Vec::new()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::KindStats;

    fn through_words(head: &[u64], tail: &[u64]) -> Option<(Event, Vec<u64>)> {
        // As popped: whole slots.
        let mut words = [head, tail].concat();
        let len = words.len();
        words.resize(len.next_multiple_of(WORDS), 0);
        assert_eq!(words_of(words.first_chunk().unwrap()), len);
        decode(&words)
    }

    #[test]
    fn every_message_comes_back_as_it_went() {
        let t = Tick { time_ns: 5, thread: 3, kind: 2, entry: 7, size: 100, address: 0x1000, weight: 99, stack: 42 };
        let frames: Vec<u64> = (1..=30).map(|i| i * 0x10).collect();
        assert_eq!(through_words(&tick(&t, frames.len()), &frames), Some((Event::Tick(t.clone()), frames)));
        assert_eq!(through_words(&tick(&t, 0), &[]), Some((Event::Tick(t), vec![])));
        assert_eq!(
            through_words(&free(1, 2, 3), &[]),
            Some((Event::Free { time_ns: 1, thread: 2, address: 3 }, vec![]))
        );
        assert_eq!(
            through_words(&inherited(1, 2, 3, 4, 5), &[]),
            Some((Event::Inherited { parent: 1, kind: 2, size: 3, address: 4, weight: 5 }, vec![]))
        );
        assert_eq!(
            through_words(&thread_start(1, 2, 3), &[]),
            Some((Event::ThreadStart { time_ns: 1, thread: 2, tid: 3 }, vec![]))
        );
        assert_eq!(through_words(&thread_exit(1, 2), &[]), Some((Event::ThreadExit { time_ns: 1, thread: 2 }, vec![])));
        let k = |b| KindStats { live_bytes: b, live_blocks: b + 1, allocs: b + 2, bytes: b + 3 };
        let s = HeapStats {
            time_ns: 9,
            kinds: [k(10), k(20), k(30)],
            frees: 1,
            peak_live_bytes: 2,
            arena_bytes: 3,
            mmapped_bytes: 4,
            free_bytes: 5,
            in_use_bytes: 6,
            own_bytes: 7,
        };
        assert_eq!(through_words(&stats(&s), &[]), Some((Event::HeapStats(s), vec![])));
        assert_eq!(through_words(&end(8), &[]), Some((Event::End { time_ns: 8 }, vec![])));
        assert_eq!(decode(&[0xFF | 2 << 8, 0, 0, 0, 0, 0, 0]), None);
    }
}
