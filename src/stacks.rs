//! Interned call stacks: each distinct stack is stored once and named by a 32-bit id.
//!
//! The hook path hashes the return addresses it captured and looks the hash up in a
//! [`LiveTable`]; only a stack never seen before takes the store's lock and is appended.
//! Stacks live in chunks leased from [`crate::pool`] as `[len, frame...]` runs, never moved,
//! so a stack read at report time is a plain slice; a stack's id is where its run starts
//! (plus one: 0 means "no stack").

use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::live_table::LiveTable;
use crate::sync::SpinLock;
use crate::unwind::{self, WalkCache, WalkWords};
use crate::{os, pool};

/// Deepest stack the option `stack_depth` may ask for.
pub(crate) const MAX_DEPTH: usize = 128;
/// Default `stack_depth`.
pub(crate) const DEFAULT_DEPTH: usize = 32;
/// Entries of a thread's cache of stack ids (a power of two): with 1,024, 99.5% of python3's
/// allocations find their stack's id there (87.5% with 256), for 16 KiB per thread.
const KNOWN_STACKS: usize = 1024;

/// Entries of a thread's cache of walk starts (a power of two; 192 bytes each). sqlite3 meets
/// a start again with the same stack under it within 4 walks 12% of the time, within 32 walks
/// 13%, within 64 walks 89%; python3 within 16 walks 77%, within 64 walks 82%.
const STARTS: usize = 256;
/// Ways of the cache of walk starts: an entry new to its set takes the first way and moves
/// the others down one, dropping the oldest. Hits: sqlite3 99.5%, python3 70% (with sets
/// chosen by return address and stack pointer alone, sqlite3 hit 80% with 4 ways, 54% with 2,
/// 41% direct-mapped).
const WAYS: usize = 4;

/// Misses in a row after which the cache of walk starts is looked at once in this many calls.
const STARTS_IDLE: u32 = 64;

/// A walk's start, the stack words it read, and the id of its stack.
///
/// `repr(C)`, a line's alignment, in the order a hit reads them: the start, the id and depth,
/// then the words' record, whose offsets are read only as far as the walk went. A hit on a
/// walk of up to 5 words reads one line, up to 37 two.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct KnownStart {
    start: (u64, u64, u64),
    /// 0 when the entry is empty.
    id: u32,
    /// The depth the id was captured at.
    depth: u32,
    words: WalkWords,
}

const _: () = assert!(core::mem::size_of::<KnownStart>() == 192);

/// Unloads so far (`dlclose` calls after which the loader had unmapped something). Folded
/// into the walk-start cache's tags: a start seen before an unload may name a stack of the
/// unloaded library.
static UNLOADS: AtomicU64 = AtomicU64::new(0);

/// Unloads by granule of the address space (64 KiB), in an open-addressed table: a granule's
/// slot counts the unloads that unmapped code in it ([`UNLOADS_ANYWHERE`], those whose code
/// was not known). A stack's frames in such a granule fold which object is there now (or,
/// where no object is known, the granule's count) into its hash: a library loaded where an
/// unloaded one was may have code at the same addresses, and the same return addresses then
/// stand for other functions. Its stacks get ids of their own, which the trace and the leak
/// report name after the modules loaded then (they were given the unloaded library's stacks,
/// and its names); the same file loaded there again gets the stacks it had there, whose names
/// are the same. Stacks through code that stayed keep their ids: when
/// every unload gave every later stack a new one, a program reloading a plugin in a loop
/// interned the loader's stacks and its own again each round (1.1 KB a round, 43 MB in 40,000
/// rounds). Granules are told apart by their tags: with 4 KiB pages hashed onto counters, a
/// 1.1 MB plugin's unload bumped 7% of them, and the loader's stacks met one.
static GRANULE_TAGS: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
/// The unloads counted for the granule of the same slot of [`GRANULE_TAGS`].
static GRANULE_UNLOADS: [AtomicU32; SLOTS] = [const { AtomicU32::new(0) }; SLOTS];
/// Slots of the table (a power of two); at most half are filled, so that a lookup's probe
/// soon meets an empty one.
const SLOTS: usize = 4096;
/// log2 of a granule's bytes.
const GRANULE_SHIFT: u32 = 16;
/// Slots filled.
static GRANULES: AtomicUsize = AtomicUsize::new(0);
/// Unloads whose code was not known, or did not fit in the table: they count everywhere.
static UNLOADS_ANYWHERE: AtomicU32 = AtomicU32::new(0);

/// The first slot of the table to look at for `granule`.
#[inline(always)]
fn first_slot(granule: u64) -> usize {
    (granule.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SLOTS.trailing_zeros())) as usize
}

/// The unloads counted for `granule` (see [`GRANULE_TAGS`]).
#[inline(always)]
fn unloads_in(granule: u64) -> u32 {
    let tag = granule + 1;
    let mut slot = first_slot(granule);
    loop {
        match GRANULE_TAGS[slot].load(Ordering::Acquire) {
            0 => return 0,
            t if t == tag => return GRANULE_UNLOADS[slot].load(Ordering::Relaxed),
            _ => slot = (slot + 1) % SLOTS,
        }
    }
}

/// Counts an unload in `granule`; `false` when the table has no room for it.
fn count_unload_in(granule: u64) -> bool {
    let tag = granule + 1;
    let mut slot = first_slot(granule);
    loop {
        let found = match GRANULE_TAGS[slot].load(Ordering::Acquire) {
            0 if GRANULES.load(Ordering::Relaxed) >= SLOTS / 2 => return false,
            0 => match GRANULE_TAGS[slot].compare_exchange(0, tag, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    GRANULES.fetch_add(1, Ordering::Relaxed);
                    true
                }
                Err(t) => t == tag,
            },
            t => t == tag,
        };
        if found {
            GRANULE_UNLOADS[slot].fetch_add(1, Ordering::Relaxed);
            return true;
        }
        slot = (slot + 1) % SLOTS;
    }
}

/// After a `dlclose` that unmapped code: `unmapped`, the extents of the code it unmapped, or
/// `None` when they are not known. Stacks captured from now on through that code are interned
/// apart from earlier ones with the same frames (see [`GRANULE_TAGS`]).
pub(crate) fn after_unload(unmapped: Option<&[(u64, u64)]>) {
    // Before the count that has frames salted: `unload_salt` asks for it from then on.
    os::look_up_objects_later();
    let counted = unmapped.is_some_and(|extents| {
        let mut all = true;
        for &(start, end) in extents.iter().filter(|(start, end)| start < end) {
            for granule in (start >> GRANULE_SHIFT)..=((end - 1) >> GRANULE_SHIFT) {
                // Every granule counted, even past one that found no room.
                all &= count_unload_in(granule);
            }
        }
        all
    });
    if !counted {
        UNLOADS_ANYWHERE.fetch_add(1, Ordering::Relaxed);
    }
    UNLOADS.fetch_add(1, Ordering::Release);
}

/// What the unloads so far add to the hash of `frames` (see [`GRANULE_TAGS`]): 0 until the
/// first, and for frames in granules that never saw one.
#[inline(always)]
fn unload_salt(frames: &[u64]) -> u64 {
    const K: u64 = 0xD6E8_FEB8_6659_FD93;
    if UNLOADS.load(Ordering::Acquire) == 0 {
        return 0;
    }
    let mut salt = u64::from(UNLOADS_ANYWHERE.load(Ordering::Relaxed)).wrapping_mul(K);
    // Neighbouring frames are mostly in one granule, and in one object: each looked up once.
    let (mut last, mut unloads) = (u64::MAX, 0);
    let mut object = (0, 0, 0);
    for &frame in frames {
        let granule = frame >> GRANULE_SHIFT;
        if granule != last {
            (last, unloads) = (granule, unloads_in(granule));
        }
        if unloads == 0 {
            continue;
        }
        // Where an unload was, the object there now: a plugin reloaded in a loop, mapped where
        // it was each time, has the same stacks each time (a stack of its own a round, 370
        // bytes a round for good, when the number of unloads salted its frames: review helper
        // 126), and another library there has stacks of its own. Code no object holds (or no
        // lookup of objects, or one named by a relative path) is salted by the count.
        if !(object.0 <= frame && frame < object.1) {
            object = os::object_at(frame).unwrap_or((0, 0, u64::from(unloads) << 32 ^ granule));
        }
        salt = salt.wrapping_add(object.2.wrapping_mul(K));
    }
    salt
}

/// A thread's stack capture: the walk buffer, the unwinder's cache, the stacks this thread
/// interned lately, by hash (a thread mostly allocates from the same few stacks, and the
/// shared table is a lock and a cache miss away), and the walk starts it saw lately. Lives in
/// a spy's per-thread record, not on the stack, to spare a 1 KiB frame per call; zero is its
/// initial state.
pub(crate) struct Capture {
    frames: [u64; MAX_DEPTH],
    /// By start (return address, stack and frame pointers at the hook's entry): a function
    /// that allocates at several places, or in a loop, enters the allocator again and again
    /// above the same stack, and a start whose walk's words still hold names its stack
    /// without a walk.
    starts: [[KnownStart; WAYS]; STARTS / WAYS],
    /// A hash of each entry's start (0: empty), kept apart so that a lookup reads one line
    /// for the whole set.
    start_tags: [[u64; WAYS]; STARTS / WAYS],
    /// Lookups in `starts` that missed since the last hit. Past [`STARTS_IDLE`] the cache is
    /// looked at (and filled) only once in that many calls: a program whose stacks never
    /// repeat that way does not pay for it on every call.
    starts_missed: u32,
    known: [(u64, u32); KNOWN_STACKS],
    walk: WalkCache,
}

impl Capture {
    /// The id in `stacks` of the calling thread's current stack, `depth` frames deep at most.
    #[inline]
    pub(crate) fn stack_id(&mut self, depth: usize, stacks: &Stacks) -> u32 {
        let Some(key) = unwind::hook_start() else {
            unwind::no_walk(&mut self.walk);
            return self.intern(0, stacks);
        };
        let missed = self.starts_missed;
        self.starts_missed = missed.wrapping_add(1);
        if missed >= STARTS_IDLE && !missed.is_multiple_of(STARTS_IDLE) {
            // The walk of the miss below, apart: folding the two into one path with a flag
            // cost sqlite3 0.4% more instructions.
            let n = unwind::capture(&mut self.frames[..depth], key, &mut self.walk);
            return self.intern(n, stacks);
        }
        // A start seen before the last unload may name a stack of the unloaded library.
        let unloads = UNLOADS.load(Ordering::Relaxed);
        let tag =
            (key.0 ^ key.1.rotate_left(32) ^ key.2.rotate_left(16) ^ unloads).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let at = (tag >> (64 - (STARTS / WAYS).trailing_zeros())) as usize;
        for (way, &t) in self.start_tags[at].iter().enumerate() {
            let known = &self.starts[at][way];
            if t == tag && known.start == key && known.depth as usize == depth && known.words.hold(key.1) {
                self.starts_missed = 0;
                return known.id;
            }
        }
        let n = unwind::capture(&mut self.frames[..depth], key, &mut self.walk);
        let id = self.intern(n, stacks);
        if self.walk.cut_short() {
            // Not this start's whole stack: the next call from it walks again.
            return id;
        }
        let tags = &mut self.start_tags[at];
        tags.copy_within(0..WAYS - 1, 1);
        tags[0] = if id != 0 { tag } else { 0 };
        let set = &mut self.starts[at];
        set.copy_within(0..WAYS - 1, 1);
        let first = &mut set[0];
        (first.start, first.id, first.depth) = (key, id, depth as u32);
        self.walk.last_walk_words(key.1, &mut first.words);
        id
    }

    /// The id of the first `n` frames captured, among the stacks captured since the last
    /// unload of their code ([`GRANULE_TAGS`]).
    #[inline(always)]
    fn intern(&mut self, n: usize, stacks: &Stacks) -> u32 {
        let frames = &self.frames[..n];
        // Bit 0, which keeps a hash from being 0, stays set.
        let h = hash(frames) ^ unload_salt(frames) << 1;
        let known = &mut self.known[(h >> (64 - KNOWN_STACKS.trailing_zeros())) as usize];
        if known.0 == h && known.1 != 0 {
            return known.1;
        }
        let id = stacks.intern(h, frames);
        *known = (h, id);
        id
    }
}

/// The bit of a run's length word that says the stack was sent to the trace writer.
const SENT: u64 = 1 << 63;

/// Words per chunk of the store.
const CHUNK_WORDS: usize = 1 << 16;
/// Most chunks (so at most 64 Mi words: far beyond any program's distinct stacks).
const MAX_CHUNKS: usize = 1024;

/// A store had no room left for a new stack (its [`MAX_CHUNKS`], not `max_memory`): said once
/// then, and by the leak report's note. Stacks are kept for the whole run; a program with
/// millions of distinct ones (generated recursion) filled it, and its later blocks went
/// untracked with only a note blaming `max_memory` (review helper 126).
static FULL: AtomicBool = AtomicBool::new(false);

/// Whether a store was full (see [`FULL`]).
pub(crate) fn was_full() -> bool {
    FULL.load(Ordering::Relaxed)
}

/// The table of interned stacks.
pub(crate) struct Stacks {
    by_hash: &'static LiveTable<u32>,
    lock: SpinLock,
    /// Chunk base addresses (`[u64; CHUNK_WORDS]` each), `[usize; MAX_CHUNKS]`.
    chunks: AtomicUsize,
    chunk_count: AtomicUsize,
    /// Words used in the last chunk.
    used: AtomicUsize,
    /// Stacks interned.
    count: AtomicU32,
    /// Words stored in all.
    words: AtomicUsize,
}

/// A 64-bit hash of the addresses, never 0 (a table key). A stack is known by its hash
/// alone, so every bit of every address must reach every bit of the hash: each step
/// multiplies and folds the high half back. Four lanes, so that the multiplies of a deep
/// stack overlap instead of waiting on each other.
#[inline(always)]
pub(crate) fn hash(frames: &[u64]) -> u64 {
    hash_of(frames, |f| f)
}

/// [`hash`] of the words `word` gives for each of `items` (a walk's words are hashed where
/// they lie on the stack, from their offsets).
#[inline(always)]
pub(crate) fn hash_of<T: Copy>(items: &[T], word: impl Fn(T) -> u64) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let step = |h: u64, f: u64| {
        let x = (h ^ f).wrapping_mul(K);
        x ^ (x >> 29)
    };
    let mut lanes = [0x243F_6A88_85A3_08D3u64, 0x1319_8A2E_0370_7344, 0xA409_3822_299F_31D0, 0x082E_FA98_EC4E_6C89];
    let mut chunks = items.chunks_exact(4);
    for c in &mut chunks {
        for (lane, &f) in lanes.iter_mut().zip(c) {
            *lane = step(*lane, word(f));
        }
    }
    for (lane, &f) in lanes.iter_mut().zip(chunks.remainder()) {
        *lane = step(*lane, word(f));
    }
    let h = lanes.iter().fold(items.len() as u64, |h, &l| step(h, l));
    step(h, K) | 1
}

impl Stacks {
    /// An empty store; `None` if its table cannot be mapped.
    pub(crate) fn new() -> Option<Self> {
        Some(Self {
            by_hash: LiveTable::leased()?,
            lock: SpinLock::new(),
            chunks: AtomicUsize::new(0),
            chunk_count: AtomicUsize::new(0),
            used: AtomicUsize::new(CHUNK_WORDS),
            count: AtomicU32::new(0),
            words: AtomicUsize::new(0),
        })
    }

    /// The id of `frames` (at most `u16::MAX` of them), whose [`hash`] is `h`, interning it if
    /// new; 0 when mallocspy's memory is exhausted.
    #[inline]
    pub(crate) fn intern(&self, h: u64, frames: &[u64]) -> u32 {
        let h = h as usize;
        if let Some(id) = self.by_hash.get(h) {
            return id;
        }
        self.add(h, frames)
    }

    /// An id above every stack interned so far (stacks interned later get higher ids).
    pub(crate) fn next_id(&self) -> u32 {
        let _guard = self.lock.lock();
        match self.chunk_count.load(Ordering::Relaxed) {
            0 => 0,
            count => ((count - 1) * CHUNK_WORDS + self.used.load(Ordering::Relaxed) + 1) as u32,
        }
    }

    #[cold]
    fn add(&self, h: usize, frames: &[u64]) -> u32 {
        let _guard = self.lock.lock();
        if let Some(id) = self.by_hash.get(h) {
            return id;
        }
        let len = frames.len().min(CHUNK_WORDS - 1);
        if self.chunks.load(Ordering::Relaxed) == 0 {
            let Some(chunks) = pool::lease(MAX_CHUNKS * core::mem::size_of::<usize>()) else { return 0 };
            self.chunks.store(chunks.as_ptr() as usize, Ordering::Release);
        }
        let mut used = self.used.load(Ordering::Relaxed);
        if used + 1 + len > CHUNK_WORDS {
            let count = self.chunk_count.load(Ordering::Relaxed);
            if count == MAX_CHUNKS {
                if !FULL.swap(true, Ordering::Relaxed) {
                    crate::sink::write(
                        b"mallocspy: the store of call stacks is full (512 MiB of distinct stacks): what is allocated \
                          at a new stack from here on goes untracked\n",
                    );
                }
                return 0;
            }
            let Some(chunk) = pool::lease(CHUNK_WORDS * 8) else { return 0 };
            // SAFETY: count < MAX_CHUNKS, the chunk table's length; the lock is held.
            unsafe { *(self.chunks.load(Ordering::Relaxed) as *mut usize).add(count) = chunk.as_ptr() as usize };
            self.chunk_count.store(count + 1, Ordering::Release);
            used = 0;
        }
        let chunk = self.chunk_count.load(Ordering::Relaxed) - 1;
        let Some(base) = self.chunk_base(chunk) else { return 0 };
        // SAFETY: used + 1 + len <= CHUNK_WORDS, inside the chunk; these words are not yet
        // published, so nobody reads them.
        unsafe {
            *base.as_ptr().add(used) = len as u64;
            core::ptr::copy_nonoverlapping(frames.as_ptr(), base.as_ptr().add(used + 1), len);
        }
        let id = (chunk * CHUNK_WORDS + used + 1) as u32;
        self.used.store(used + 1 + len, Ordering::Relaxed);
        self.words.fetch_add(1 + len, Ordering::Relaxed);
        if !self.by_hash.insert(h, id) {
            return 0;
        }
        self.count.fetch_add(1, Ordering::Release);
        id
    }

    fn chunk_base(&self, chunk: usize) -> Option<NonNull<u64>> {
        if chunk >= self.chunk_count.load(Ordering::Acquire) {
            return None;
        }
        // SAFETY: chunk < chunk_count <= MAX_CHUNKS, and published chunk slots hold leased,
        // never-returned chunks.
        let addr = unsafe { *(self.chunks.load(Ordering::Acquire) as *const usize).add(chunk) };
        NonNull::new(addr as *mut u64)
    }

    /// The frames of stack `id` (empty for 0). `id` must come from [`Stacks::intern`].
    pub(crate) fn frames(&self, id: u32) -> &[u64] {
        let Some(len_word) = self.len_word(id) else { return &[] };
        let len = (len_word.load(Ordering::Relaxed) & !SENT) as usize;
        let offset = (id as usize - 1) % CHUNK_WORDS;
        // SAFETY: an interned id names a `[len, frames...]` run inside its chunk, written
        // before the id was published; only the length word's SENT bit changes after.
        unsafe {
            core::slice::from_raw_parts(len_word.as_ptr().add(1) as *const u64, len.min(CHUNK_WORDS - offset - 1))
        }
    }

    /// The length word of stack `id`'s run.
    fn len_word(&self, id: u32) -> Option<&AtomicU64> {
        let at = (id as usize).checked_sub(1)?;
        let base = self.chunk_base(at / CHUNK_WORDS)?;
        // SAFETY: an interned id names a run inside its chunk; its length word, written before
        // the id was published, is only touched atomically afterwards.
        Some(unsafe { AtomicU64::from_ptr(base.as_ptr().add(at % CHUNK_WORDS)) })
    }

    /// Whether stack `id` was sent to the trace writer (see [`Stacks::mark_sent`]).
    pub(crate) fn is_sent(&self, id: u32) -> bool {
        self.len_word(id).is_some_and(|w| w.load(Ordering::Acquire) & SENT != 0)
    }

    /// Notes that the trace writer has stack `id`'s frames.
    pub(crate) fn mark_sent(&self, id: u32) {
        if let Some(w) = self.len_word(id) {
            w.fetch_or(SENT, Ordering::Release);
        }
    }

    /// Forgets what was sent (a new writer, in a child after `fork`, has none). Only while
    /// no other thread interns (the child after `fork` has one thread).
    pub(crate) fn forget_sent(&self) {
        let chunks = self.chunk_count.load(Ordering::Acquire);
        for chunk in 0..chunks {
            let Some(base) = self.chunk_base(chunk) else { return };
            let end = if chunk + 1 == chunks { self.used.load(Ordering::Relaxed) } else { CHUNK_WORDS };
            let mut at = 0;
            while at < end {
                // SAFETY: at < end <= CHUNK_WORDS: a run's length word, or a zero word of the
                // unused tail of a chunk.
                let word = unsafe { AtomicU64::from_ptr(base.as_ptr().add(at)) };
                let len = word.fetch_and(!SENT, Ordering::Relaxed) & !SENT;
                at += 1 + len as usize;
            }
        }
    }

    /// Number of distinct stacks.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire) as usize
    }

    /// Bytes the stacks take: their words, and their entries in the hash index.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.words.load(Ordering::Relaxed) * 8 + self.by_hash.memory_bytes()
    }

    /// Child side of `fork`.
    pub(crate) fn force_unlock(&self) {
        self.lock.force_unlock();
        self.by_hash.force_unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interns_each_distinct_stack_once() {
        let s = Stacks::new().unwrap();
        let intern = |frames: &[u64]| s.intern(hash(frames), frames);
        let a = intern(&[1, 2, 3]);
        let b = intern(&[1, 2, 4]);
        assert_ne!(a, b);
        assert_eq!(intern(&[1, 2, 3]), a);
        assert_eq!(s.frames(a), &[1, 2, 3]);
        assert_eq!(s.frames(b), &[1, 2, 4]);
        assert_eq!(s.frames(0), &[] as &[u64]);
        let many: Vec<u32> = (0..100_000u64).map(|i| intern(&[i, i * 3, 7])).collect();
        assert!(many.iter().all(|&id| id != 0));
        assert_eq!(s.count(), 2 + 100_000);
        assert_eq!(s.frames(many[77_777]), &[77_777, 233_331, 7]);
    }

    #[test]
    fn sent_marks_keep_the_frames_and_are_forgotten_in_every_chunk() {
        let s = Stacks::new().unwrap();
        let ids: Vec<u32> = (0..60_000u64).map(|i| s.intern(hash(&[i, 9]), &[i, 9])).collect();
        assert!(s.chunk_count.load(Ordering::Relaxed) > 1, "the stacks span chunks");
        for &id in &ids {
            assert!(!s.is_sent(id));
            s.mark_sent(id);
        }
        assert!(ids.iter().all(|&id| s.is_sent(id)));
        assert_eq!(s.frames(ids[59_999]), &[59_999, 9]);
        s.forget_sent();
        assert!(ids.iter().all(|&id| !s.is_sent(id)));
        assert_eq!(s.frames(ids[12_345]), &[12_345, 9]);
        assert!(!s.is_sent(0));
    }

    /// An unload changes the salt of frames in the code it unmapped, and of no other frame,
    /// however much code it unmapped (with pages hashed onto counters, a 1.1 MB plugin's
    /// unload changed the salt of one frame in 14, the loader's among them).
    #[test]
    fn an_unload_salts_only_the_frames_in_its_code() {
        // Addresses no code of this process is at: the table is the process's.
        let (start, end) = (0x5a5a_0000_0000u64, 0x5a5a_0000_0000 + (64 << 20));
        let inside: Vec<u64> = (0..100).map(|i| start + i * 0x9_1e37).collect();
        let outside: Vec<u64> = (1..10_000).map(|i| 0x7e00_0000_0000 + i * 0x1_3579).collect();
        let before: Vec<u64> = inside.iter().map(|&f| unload_salt(&[f])).collect();
        after_unload(Some(&[(start, end)]));
        assert!(inside.iter().zip(&before).all(|(&f, &was)| unload_salt(&[f]) != was));
        let anywhere = u64::from(UNLOADS_ANYWHERE.load(Ordering::Relaxed)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        assert_eq!(outside.iter().filter(|&&f| unload_salt(&[f]) != anywhere).count(), 0);
        // Salts never come back: the same frames after a second unload differ again.
        let once: Vec<u64> = inside.iter().map(|&f| unload_salt(&[f])).collect();
        after_unload(Some(&[(start, start + 1)]));
        assert_ne!(unload_salt(&inside[..1]), once[0]);
    }

    #[test]
    fn hash_separates_stacks_that_differ_anywhere() {
        let base: Vec<u64> = (0..32).map(|i| 0x7f00_1234_0000 + i * 0x40).collect();
        let mut seen = std::collections::HashSet::new();
        assert!(seen.insert(hash(&base)));
        for i in 0..base.len() {
            for bit in 0..64 {
                let mut v = base.clone();
                v[i] ^= 1 << bit;
                assert!(seen.insert(hash(&v)), "frame {i} bit {bit}");
            }
        }
        for n in 0..base.len() {
            assert!(seen.insert(hash(&base[..n])), "prefix of {n}");
        }
    }
}
