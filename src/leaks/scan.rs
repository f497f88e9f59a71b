//! Reachability: which live blocks the program can still reach, and how the others were lost.
//!
//! A conservative mark, as memcheck and LeakSanitizer do it. Every aligned word of the roots
//! (writable data of the loaded modules, each thread's stack, registers and static TLS) that
//! points at a live block marks it: a pointer to its start makes it *reachable*, a pointer
//! into it only *possibly* reachable. Marked blocks are scanned in turn; a possibly reached
//! block passes on at most "possibly". What stays unmarked is lost: in address order, each
//! lost block not yet claimed leads a group, and everything the group reaches through any
//! pointer is *indirectly* lost; the leader is *definitely* lost (a lost cycle has one
//! definitely lost block and the rest indirect). Each edge between live blocks is followed
//! once per state change, as ObjectReferences reports each reference once. The first
//! pointer that made a block reachable is kept: following them back from any reachable
//! block gives one retention path to a root ([`Scratch::retention_path`]).

/// How a block ended up, memcheck's four kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LeakKind {
    /// No pointer to it anywhere.
    DefinitelyLost,
    /// Reachable only from lost blocks.
    IndirectlyLost,
    /// Reachable only through a pointer into its middle.
    PossiblyLost,
    /// A pointer to its start is reachable from a root.
    StillReachable,
}

impl LeakKind {
    /// The JSON name of the kind.
    pub const fn name(self) -> &'static str {
        match self {
            LeakKind::DefinitelyLost => "definitely_lost",
            LeakKind::IndirectlyLost => "indirectly_lost",
            LeakKind::PossiblyLost => "possibly_lost",
            LeakKind::StillReachable => "still_reachable",
        }
    }
}

/// Reads memory in runs of words; a range it cannot read yields nothing.
pub(crate) trait Memory {
    /// Calls `f(address, words)` on the 8-byte-aligned words in `[start, end)`, a root region,
    /// a run at a time: `words[k]` is the word at `address + 8 * k`. One call per run, not
    /// per word: a root region can be hundreds of megabytes (a runtime's own arenas).
    fn words(&self, start: u64, end: u64, f: &mut dyn FnMut(u64, &[u64]));

    /// The same for a live block's bytes (many small ranges, all in the heap).
    fn block_words(&self, start: u64, end: u64, f: &mut dyn FnMut(u64, &[u64])) {
        self.words(start, end, f)
    }

    /// The aligned word at `addr` (in a live block, or a module's constants), if readable.
    /// Called while a run of words is being marked, from inside the callbacks of the two
    /// methods above.
    fn word(&self, addr: u64) -> Option<u64> {
        let mut word = None;
        self.block_words(addr, addr + 8, &mut |_, run| word = run.first().copied());
        word
    }

    /// What the file mapped at `addr` holds there, if a file is.
    fn file_kind(&self, _addr: u64) -> FileKind {
        FileKind::Other
    }
}

/// A file-backed mapping's use, as its permissions tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FileKind {
    /// Not a file's, or a file's writable data.
    Other,
    /// Read-only, not executable: constants, and vtables (`.rodata`, and `.data.rel.ro` once
    /// relocated).
    Constants,
    /// Executable.
    Code,
}

/// A `parent` of a block reached from a root, not from another block.
const ROOT: u32 = u32::MAX;

/// One step of a retention path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hop {
    /// The root word at this address (0: a thread's register) points at the next hop.
    Root(u64),
    /// Block `index` (in heap order), whose word at `via` points at the next hop.
    Block { index: usize, via: u64 },
    /// This many blocks left out of a long path.
    Elided(usize),
}

const UNREACHED: u8 = 0;
const POSSIBLE: u8 = 1;
const REACHABLE: u8 = 2;
const INDIRECT: u8 = 3;
/// Lost, and suppressed: see [`suppress`].
const SUPPRESSED: u8 = 4;
/// Taken for freed ([`Scratch::forget`]): no pointer reaches it, and its words reach nothing.
const FORGOTTEN: u8 = 5;

/// Live blocks sorted by address, for pointer lookups.
pub(crate) struct Heap<'a> {
    /// `(start, size)`, sorted by start, non-overlapping.
    blocks: &'a [(u64, u64)],
    low: u64,
    high: u64,
    /// One bit per hashed page number, set for every page a block touches: a clear bit says
    /// in one load that a word points into no block. Most words of a large root region point
    /// somewhere between the blocks (a Python heap's objects live in pymalloc's arenas, not
    /// in malloc's blocks), and each of those cost a binary search over all the blocks.
    pages: Vec<u64>,
    /// `64 - log2(bits in pages)`: the hash keeps the top bits of the product.
    page_shift: u32,
}

const PAGE_SHIFT: u32 = 12;
/// Bits of the page filter per page touched by a block: at most one in 32 set, so a word
/// that points at no block takes the binary search 3% of the time, and the filter's 4 bytes
/// per page cost 0.1% of the live bytes.
const FILTER_BITS_PER_PAGE: u64 = 32;
const FILTER_MIN_BITS: u64 = 1 << 12;
const FILTER_MAX_BITS: u64 = 1 << 27;

impl<'a> Heap<'a> {
    pub(crate) fn new(blocks: &'a [(u64, u64)]) -> Self {
        debug_assert!(blocks.windows(2).all(|w| w[0].0 < w[1].0));
        let low = blocks.first().map_or(0, |b| b.0);
        let high = blocks.iter().map(|b| b.0 + b.1.max(1)).max().unwrap_or(0);
        let pages_of =
            |&(start, size): &(u64, u64)| (start >> PAGE_SHIFT)..=(start.saturating_add(size.max(1) - 1) >> PAGE_SHIFT);
        let touched = blocks.iter().map(&pages_of).map(|p| p.end() - p.start() + 1).fold(0, u64::saturating_add);
        let bits =
            touched.saturating_mul(FILTER_BITS_PER_PAGE).clamp(FILTER_MIN_BITS, FILTER_MAX_BITS).next_power_of_two();
        let mut heap =
            Self { blocks, low, high, pages: vec![0; (bits / 64) as usize], page_shift: 64 - bits.trailing_zeros() };
        for block in blocks {
            let pages = pages_of(block);
            if pages.end() - pages.start() >= bits {
                // A block larger than the filter covers every bit.
                heap.pages.fill(u64::MAX);
                break;
            }
            for page in pages {
                let bit = heap.page_bit(page);
                heap.pages[bit / 64] |= 1 << (bit % 64);
            }
        }
        heap
    }

    #[inline(always)]
    fn page_bit(&self, page: u64) -> usize {
        (page.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.page_shift) as usize
    }

    /// The block `word` points into, and whether it points at its start.
    #[inline(always)]
    fn find(&self, word: u64) -> Option<(usize, bool)> {
        if word < self.low || word >= self.high {
            return None;
        }
        let bit = self.page_bit(word >> PAGE_SHIFT);
        if self.pages[bit / 64] & (1 << (bit % 64)) == 0 {
            return None;
        }
        let i = self.blocks.partition_point(|b| b.0 <= word).checked_sub(1)?;
        let (start, size) = self.blocks[i];
        if word == start {
            Some((i, true))
        } else if word < start + size {
            Some((i, false))
        } else {
            None
        }
    }
}

/// The scan's working memory, reserved before other threads are stopped (the scan itself
/// must not allocate: a stopped thread may hold the allocator's lock).
pub(crate) struct Scratch {
    state: Vec<u8>,
    todo: Vec<usize>,
    leader: Vec<bool>,
    /// For a reachable block: the block whose word first made it so, or [`ROOT`]. For an
    /// indirectly lost one: the leader of the group that claimed it (a leader absorbed into a
    /// later group points at that group's). For a suppressed one: the suppressed leak it was
    /// found from ([`suppress`]).
    parent: Vec<u32>,
    /// ... and that word's address (0 for a register).
    via: Vec<u64>,
}

impl Scratch {
    /// Room for `n` blocks: each is pushed at most twice while marking (possibly, then
    /// reachable) and once while grouping the lost.
    pub(crate) fn for_blocks(n: usize) -> Self {
        Self {
            state: vec![UNREACHED; n],
            todo: Vec::with_capacity(2 * n + 1),
            leader: vec![false; n],
            parent: vec![ROOT; n],
            via: vec![0; n],
        }
    }

    /// How block `index` (reachable) is retained: from the root to the block pointing at it.
    /// A path longer than `max` hops (at least 2) keeps its root and the hops nearest the
    /// block, with [`Hop::Elided`] between. Empty for a block that is not reachable.
    pub(crate) fn retention_path(&self, index: usize, max: usize) -> Vec<Hop> {
        let mut path = Vec::new();
        if self.state.get(index) != Some(&REACHABLE) {
            return path;
        }
        // Parents were set when blocks were first reached, so the chain ends at a root.
        let mut at = index;
        loop {
            let (parent, via) = (self.parent[at], self.via[at]);
            if parent == ROOT {
                path.push(Hop::Root(via));
                break;
            }
            path.push(Hop::Block { index: parent as usize, via });
            at = parent as usize;
        }
        let max = max.max(2);
        if path.len() > max {
            let root = path[path.len() - 1];
            let elided = path.len() - max + 1;
            path.truncate(max - 2);
            path.extend([Hop::Elided(elided), root]);
        }
        path.reverse();
        path
    }

    /// For a block [`suppress`] took out: the suppressed leak it was found from (itself, for
    /// one of those).
    pub(crate) fn suppressed_by(&self, index: usize) -> Option<usize> {
        (self.state.get(index) == Some(&SUPPRESSED)).then(|| self.parent[index] as usize)
    }

    /// For an indirectly lost block: the definitely lost block whose group holds it (memcheck's
    /// "232 (16 direct, 216 indirect) bytes" counts a leak's group with it).
    pub(crate) fn group_leader(&self, index: usize) -> Option<usize> {
        let mut at = index;
        // Absorbed leaders point at later ones: the chain ends at a leader still lost.
        while self.state.get(at) == Some(&INDIRECT) {
            at = *self.parent.get(at)? as usize;
        }
        (at != index && self.state.get(at) == Some(&UNREACHED)).then_some(at)
    }

    /// Takes block `index` for one already freed, before [`classify`]: glibc's memory that
    /// it frees only later (see [`super::dead_tls`]). Its kind then reads still reachable;
    /// [`Self::forgotten`] says to leave it out.
    pub(crate) fn forget(&mut self, index: usize) {
        self.state[index] = FORGOTTEN;
    }

    /// Whether block `index` was [`forget`](Self::forget)-ten.
    pub(crate) fn forgotten(&self, index: usize) -> bool {
        self.state[index] == FORGOTTEN
    }

    /// The kinds found by [`classify`], in block order.
    pub(crate) fn kinds(&self) -> impl Iterator<Item = LeakKind> + '_ {
        self.state.iter().map(|&s| match s {
            REACHABLE | FORGOTTEN => LeakKind::StillReachable,
            POSSIBLE => LeakKind::PossiblyLost,
            INDIRECT => LeakKind::IndirectlyLost,
            _ => LeakKind::DefinitelyLost,
        })
    }
}

/// Whether `word`, a pointer into `block`'s middle, is the one C++ hands out for a `new[]` of
/// objects with a destructor: the block starts with the element count, and the caller's
/// pointer is the word after it. memcheck's `newarray` heuristic, on by default, counts such a
/// pointer as one to the block's start (its `length64` heuristic, a block led by the length of
/// the rest, as sqlite's allocations are, is the count-of-one case). Otherwise every array of
/// objects with destructors a C++ program keeps was "possibly lost". (Its `stdstring`
/// heuristic, for the reference-counted strings of libstdc++ before GCC 5, is not done here.)
fn past_a_count((start, size): (u64, u64), word: u64, memory: &dyn Memory) -> bool {
    if word != start + 8 || size <= 8 {
        return false;
    }
    memory.word(start).is_some_and(|count| count != 0 && (size - 8) % count == 0)
}

/// Whether `word`, a pointer into `block`'s middle, is one to the second base of a C++ object
/// with multiple inheritance: the block starts with a vtable pointer, and so does the word it
/// points at. memcheck's `multipleinheritance` heuristic, on by default, counts such a pointer
/// as one to the block's start; otherwise an object kept as its second base was "possibly
/// lost". A vtable pointer points into a file's constants, at the first virtual function: a
/// pointer into a file's code.
fn at_a_second_base((start, size): (u64, u64), word: u64, memory: &dyn Memory) -> bool {
    let vtable = |at: u64| {
        memory.word(at).is_some_and(|v| {
            memory.file_kind(v) == FileKind::Constants
                && memory.word(v).is_some_and(|f| memory.file_kind(f) == FileKind::Code)
        })
    };
    word.is_multiple_of(8) && word > start && word + 8 <= start + size && vtable(word) && vtable(start)
}

/// Classifies `heap`'s blocks into `scratch` (made for this many blocks) from the roots:
/// `regions` (`[start, end)`), the root `words` (registers of stopped threads, and blocks
/// that are roots themselves), and `start_only` regions, whose pointers into a block's middle
/// do not count (the real allocator's own state, which points into blocks it manages).
/// Allocates nothing.
pub(crate) fn classify(
    heap: &Heap<'_>,
    regions: &[(u64, u64)],
    start_only: &[(u64, u64)],
    words: &[u64],
    memory: &dyn Memory,
    scratch: &mut Scratch,
) {
    let n = heap.blocks.len();
    assert!(scratch.state.len() == n && scratch.leader.len() == n, "scratch made for another heap");
    let Scratch { state, todo, leader, parent, via } = scratch;
    // Marks what the words of `run` point at. `from`: the block holding them, or ROOT; `at`:
    // the first word's address; `interior`: whether a pointer into a block's middle counts.
    let mut mark =
        |run: &[u64], at: u64, from: u32, definite: bool, interior: bool, state: &mut [u8], todo: &mut Vec<usize>| {
            for (k, &word) in run.iter().enumerate() {
                let Some((i, at_start)) = heap.find(word).filter(|&(i, _)| state[i] != FORGOTTEN) else { continue };
                // memcheck's heuristics, asked only where they could change something.
                let counts_as_start = at_start
                    || definite && interior && state[i] != REACHABLE && {
                        let block = heap.blocks[i];
                        past_a_count(block, word, memory) || at_a_second_base(block, word, memory)
                    };
                if counts_as_start && definite {
                    if state[i] != REACHABLE {
                        state[i] = REACHABLE;
                        parent[i] = from;
                        via[i] = at + 8 * k as u64;
                        todo.push(i);
                    }
                } else if interior && state[i] == UNREACHED {
                    state[i] = POSSIBLE;
                    todo.push(i);
                }
            }
        };
    for &(start, end) in regions {
        memory.words(start, end, &mut |at, run| mark(run, at, ROOT, true, true, state, todo));
    }
    for &(start, end) in start_only {
        memory.words(start, end, &mut |at, run| mark(run, at, ROOT, true, false, state, todo));
    }
    for &w in words {
        // A register has no address.
        mark(&[w], 0, ROOT, true, true, state, todo);
    }
    // Breadth first, so that each block's parent is on a shortest path from a root (the
    // retention path a report shows). Each block is queued at most twice (possibly, then
    // reachable), within the queue's capacity.
    let mut head = 0;
    while let Some(&i) = todo.get(head) {
        head += 1;
        let definite = state[i] == REACHABLE;
        let (start, size) = heap.blocks[i];
        memory.block_words(start, start + size, &mut |at, run| mark(run, at, i as u32, definite, true, state, todo));
    }
    todo.clear();

    // The lost: groups led by the lowest unclaimed block.
    for l in 0..n {
        if state[l] != UNREACHED || leader[l] {
            continue;
        }
        leader[l] = true;
        todo.push(l);
        walk(heap, memory, todo, |k| {
            if k == l || state[k] != UNREACHED {
                return false;
            }
            state[k] = INDIRECT;
            parent[k] = l as u32;
            // An earlier leader's group is already claimed: it joins this one.
            !leader[k]
        });
    }
}

/// Walks from the blocks in `todo` to every block their words point into: `claim(k)`, for
/// each block `k` a word points into, marks it and says whether to walk on from it.
fn walk(heap: &Heap<'_>, memory: &dyn Memory, todo: &mut Vec<usize>, mut claim: impl FnMut(usize) -> bool) {
    while let Some(i) = todo.pop() {
        let (start, size) = heap.blocks[i];
        memory.block_words(start, start + size, &mut |_, run| {
            for &w in run {
                if let Some((k, _)) = heap.find(w)
                    && claim(k)
                {
                    todo.push(k);
                }
            }
        });
    }
}

/// LeakSanitizer's suppressions: each lost block (definitely, indirectly or possibly) for
/// which `suppressed` says yes is taken for a root, and every lost block it reaches, by any
/// pointer, is suppressed with it, whichever was allocated first (classified earlier, a
/// buffer a suppressed object held was reported as indirectly lost, and failed
/// `exitcode`). Run after [`classify`], once the other threads run again: nothing points to
/// a lost block, so nothing writes to one (a block freed meanwhile reads as what the
/// allocator left there; `memory` must read one unmapped since as nothing:
/// [`super::roots::ProcessMemory::others_run`]). Allocates nothing.
pub(crate) fn suppress(
    heap: &Heap<'_>,
    memory: &dyn Memory,
    scratch: &mut Scratch,
    suppressed: impl Fn(usize) -> bool,
) {
    let Scratch { state, todo, parent, .. } = scratch;
    todo.clear();
    for root in 0..heap.blocks.len() {
        if matches!(state[root], REACHABLE | SUPPRESSED | FORGOTTEN) || !suppressed(root) {
            continue;
        }
        state[root] = SUPPRESSED;
        parent[root] = root as u32;
        todo.push(root);
        walk(heap, memory, todo, |k| {
            if matches!(state[k], REACHABLE | SUPPRESSED | FORGOTTEN) {
                return false;
            }
            state[k] = SUPPRESSED;
            parent[k] = root as u32;
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(blocks: &[(u64, u64)], regions: &[(u64, u64)], words: &[u64], memory: &dyn Memory) -> Vec<LeakKind> {
        scan(blocks, regions, words, memory).kinds().collect()
    }

    fn scan(blocks: &[(u64, u64)], regions: &[(u64, u64)], words: &[u64], memory: &dyn Memory) -> Scratch {
        let mut scratch = Scratch::for_blocks(blocks.len());
        classify(&Heap::new(blocks), regions, &[], words, memory, &mut scratch);
        scratch
    }

    /// A toy address space: words at addresses.
    struct Toy(std::collections::BTreeMap<u64, u64>);

    impl Memory for Toy {
        fn words(&self, start: u64, end: u64, f: &mut dyn FnMut(u64, &[u64])) {
            for (&at, &w) in self.0.range(start..end) {
                f(at, &[w]);
            }
        }
    }

    /// The real allocator's state points into blocks (glibc's top chunk into the newest one):
    /// only its pointers to a block's start count.
    #[test]
    fn the_allocators_pointers_into_a_block_do_not_make_it_possibly_lost() {
        let blocks = [(0x1000, 24), (0x2000, 24)];
        let mut mem = std::collections::BTreeMap::new();
        mem.insert(0x100, 0x1010); // the allocator's top chunk, inside the first block
        mem.insert(0x108, 0x2000); // the allocator's pointer to the start of the second
        let mut scratch = Scratch::for_blocks(blocks.len());
        classify(&Heap::new(&blocks), &[], &[(0x100, 0x110)], &[], &Toy(mem.clone()), &mut scratch);
        use LeakKind::*;
        assert_eq!(scratch.kinds().collect::<Vec<_>>(), [DefinitelyLost, StillReachable]);
        // The same words from any other root: possibly lost, as before.
        assert_eq!(run(&blocks, &[(0x100, 0x110)], &[], &Toy(mem)), [PossiblyLost, StillReachable]);
    }

    #[test]
    fn a_forgotten_block_keeps_nothing_and_nothing_reaches_it() {
        // A root word and a root register point at the first block, which points at the
        // second: forgotten, the first keeps nothing, and the second is lost alone.
        let blocks = [(0x1000, 16), (0x2000, 16)];
        let mut mem = std::collections::BTreeMap::new();
        mem.insert(0x100, 0x1000);
        mem.insert(0x1000, 0x2000);
        let mut scratch = Scratch::for_blocks(blocks.len());
        scratch.forget(0);
        classify(&Heap::new(&blocks), &[(0x100, 0x108)], &[], &[0x1008], &Toy(mem), &mut scratch);
        use LeakKind::*;
        assert_eq!(scratch.kinds().collect::<Vec<_>>(), [StillReachable, DefinitelyLost]);
        assert!(scratch.forgotten(0) && !scratch.forgotten(1));
        assert!(scratch.retention_path(0, 4).is_empty());
    }

    #[test]
    fn leaky_shaped_heap_gets_memchecks_kinds() {
        // Globals at 0x100..0x120. Blocks: 0x1000 table (reachable), 0x2000 pointed by the
        // table (reachable), 0x3000 lost tree root -> 0x4000 child -> 0x5000 payload,
        // 0x6000 lost alone, 0x7000 reached by an interior pointer only, 0x8000 reached only
        // from 0x7000 (possibly), 0x9000 <-> 0xA000 a lost cycle.
        let blocks = [
            (0x1000, 48),
            (0x2000, 200),
            (0x3000, 64),
            (0x4000, 128),
            (0x5000, 256),
            (0x6000, 48),
            (0x7000, 64),
            (0x8000, 32),
            (0x9000, 16),
            (0xA000, 16),
        ];
        let mut mem = std::collections::BTreeMap::new();
        mem.insert(0x100, 0x1000); // global -> table
        mem.insert(0x108, 0x7010); // global -> inside 0x7000
        mem.insert(0x1000, 0x2000); // table -> block
        mem.insert(0x3000, 0x4000); // root -> child
        mem.insert(0x4000, 0x5000); // child -> payload
        mem.insert(0x7008, 0x8000); // possibly reached block -> start of 0x8000
        mem.insert(0x9000, 0xA000);
        mem.insert(0xA000, 0x9000);
        let kinds = run(&blocks, &[(0x100, 0x120)], &[], &Toy(mem));
        use LeakKind::*;
        assert_eq!(
            kinds,
            [
                StillReachable,
                StillReachable,
                DefinitelyLost,
                IndirectlyLost,
                IndirectlyLost,
                DefinitelyLost,
                PossiblyLost,
                PossiblyLost,
                DefinitelyLost,
                IndirectlyLost
            ]
        );
    }

    /// What a suppressed leak reaches is suppressed with it, whichever was allocated first:
    /// a block held by both a suppressed and an unsuppressed leak, a cycle, a payload behind
    /// an indirectly lost block whose own stack is suppressed.
    #[test]
    fn what_a_suppressed_leak_reaches_is_suppressed_whatever_the_order() {
        use LeakKind::*;
        // 0x1000 (unsuppressed) -> 0x3000 <- 0x2000 (suppressed); 0x4000 -> 0x5000 (suppressed)
        // -> 0x6000; 0x7000 <-> 0x8000 (suppressed).
        let blocks =
            [(0x1000, 8), (0x2000, 8), (0x3000, 8), (0x4000, 8), (0x5000, 8), (0x6000, 8), (0x7000, 8), (0x8000, 8)];
        let mem = std::collections::BTreeMap::from([
            (0x1000, 0x3000),
            (0x2000, 0x3000),
            (0x4000, 0x5000),
            (0x5000, 0x6000),
            (0x7000, 0x8000),
            (0x8000, 0x7000),
        ]);
        let mut scratch = scan(&blocks, &[], &[], &Toy(mem.clone()));
        let kinds: Vec<LeakKind> = scratch.kinds().collect();
        let expected_before = [
            DefinitelyLost,
            DefinitelyLost,
            IndirectlyLost,
            DefinitelyLost,
            IndirectlyLost,
            IndirectlyLost,
            DefinitelyLost,
            IndirectlyLost,
        ];
        assert_eq!(kinds, expected_before);
        suppress(&Heap::new(&blocks), &Toy(mem), &mut scratch, |i| [1, 4, 7].contains(&i));
        let by: Vec<Option<usize>> = (0..blocks.len()).map(|i| scratch.suppressed_by(i)).collect();
        assert_eq!(by, [None, Some(1), Some(1), None, Some(4), Some(4), Some(7), Some(7)]);
    }

    /// memcheck's `newarray` heuristic: C++'s pointer to a `new[]` array of objects with a
    /// destructor is the word after the element count that starts the block.
    #[test]
    fn a_pointer_past_an_array_count_reaches_its_block() {
        // Four 24-byte blocks, each pointed at 8 bytes in: led by a count that divides the 16
        // bytes after it (2), by the length of the rest (16: sqlite's), by one that does not
        // (3), and by 0.
        let blocks = [(0x1000, 24), (0x2000, 24), (0x3000, 24), (0x4000, 24)];
        let mem = std::collections::BTreeMap::from([
            (0x100, 0x1008),
            (0x108, 0x2008),
            (0x110, 0x3008),
            (0x118, 0x4008),
            (0x1000, 2),
            (0x2000, 16),
            (0x3000, 3),
            (0x4000, 0),
        ]);
        use LeakKind::*;
        assert_eq!(
            run(&blocks, &[(0x100, 0x120)], &[], &Toy(mem)),
            [StillReachable, StillReachable, PossiblyLost, PossiblyLost]
        );
    }

    /// A toy address space with files mapped in it: constants and code.
    struct Files {
        words: std::collections::BTreeMap<u64, u64>,
        files: Vec<(u64, u64, FileKind)>,
    }

    impl Memory for Files {
        fn words(&self, start: u64, end: u64, f: &mut dyn FnMut(u64, &[u64])) {
            Toy(self.words.clone()).words(start, end, f)
        }

        fn file_kind(&self, addr: u64) -> FileKind {
            self.files.iter().find(|&&(s, e, _)| (s..e).contains(&addr)).map_or(FileKind::Other, |f| f.2)
        }
    }

    /// memcheck's `multipleinheritance` heuristic: a pointer to an object's second base, where
    /// the block and the word pointed at both hold vtable pointers (into a file's constants,
    /// at a pointer into its code).
    #[test]
    fn a_pointer_to_a_second_base_reaches_its_object() {
        let blocks = [(0x1000, 32), (0x2000, 32)];
        let words = std::collections::BTreeMap::from([
            (0x100, 0x1010), // -> the second base of 0x1000
            (0x108, 0x2010), // -> the same offset in 0x2000
            (0x1000, 0x50_0000),
            (0x1010, 0x50_0100),
            (0x2000, 0x50_0200), // a string constant, say: its bytes are no code address
            (0x2010, 0x50_0100),
            (0x50_0000, 0x40_0000),
            (0x50_0100, 0x40_0010),
            (0x50_0200, 0x6f_6c6c_6568),
        ]);
        let files = vec![(0x40_0000, 0x40_1000, FileKind::Code), (0x50_0000, 0x50_1000, FileKind::Constants)];
        use LeakKind::*;
        assert_eq!(run(&blocks, &[(0x100, 0x110)], &[], &Files { words, files }), [StillReachable, PossiblyLost]);
    }

    #[test]
    fn retention_paths_lead_from_the_root_through_the_first_pointers() {
        // global 0x100 -> 0x1000 -> (word at 0x1010) 0x2000 -> (0x2008) 0x3000; a register
        // -> 0x4000; 0x5000 lost.
        let blocks = [(0x1000, 32), (0x2000, 16), (0x3000, 16), (0x4000, 16), (0x5000, 16)];
        let mem = std::collections::BTreeMap::from([(0x100, 0x1000), (0x1010, 0x2000), (0x2008, 0x3000)]);
        let s = scan(&blocks, &[(0x100, 0x110)], &[0x4000], &Toy(mem));
        assert_eq!(
            s.retention_path(2, 8),
            [Hop::Root(0x100), Hop::Block { index: 0, via: 0x1010 }, Hop::Block { index: 1, via: 0x2008 }]
        );
        assert_eq!(s.retention_path(2, 2), [Hop::Root(0x100), Hop::Elided(2)]);
        assert_eq!(s.retention_path(2, 3).len(), 3, "short enough to show whole");
        assert_eq!(s.retention_path(0, 8), [Hop::Root(0x100)]);
        assert_eq!(s.retention_path(3, 8), [Hop::Root(0)], "a register");
        assert_eq!(s.retention_path(4, 8), [], "lost blocks have no path");
    }

    #[test]
    fn retention_paths_are_shortest() {
        // global 0x100 -> 0x6000 -> 0x7000, and global 0x108 -> 0x1000 -> 0x2000 -> 0x3000 -> 0x7000:
        // a depth-first walk would meet 0x7000 at the end of the long chain.
        let blocks = [(0x1000, 16), (0x2000, 16), (0x3000, 16), (0x6000, 16), (0x7000, 16)];
        let mem = std::collections::BTreeMap::from([
            (0x100, 0x6000),
            (0x108, 0x1000),
            (0x1000, 0x2000),
            (0x2000, 0x3000),
            (0x3000, 0x7000),
            (0x6000, 0x7000),
        ]);
        let s = scan(&blocks, &[(0x100, 0x110)], &[], &Toy(mem));
        assert_eq!(s.retention_path(4, 8), [Hop::Root(0x100), Hop::Block { index: 3, via: 0x6000 }]);
    }

    #[test]
    fn a_later_group_absorbs_an_earlier_leader_it_points_to() {
        // 0x1000 lost; 0x2000 lost and points to 0x1000: 0x2000 leads, 0x1000 is indirect.
        let blocks = [(0x1000, 16), (0x2000, 16)];
        let mem = std::collections::BTreeMap::from([(0x2000, 0x1000)]);
        let kinds = run(&blocks, &[], &[], &Toy(mem));
        assert_eq!(kinds, [LeakKind::IndirectlyLost, LeakKind::DefinitelyLost]);
    }

    #[test]
    fn each_indirectly_lost_block_belongs_to_the_group_of_one_definitely_lost_block() {
        // 0x1000 leads 0x1100 (lost list); 0x3000 points to 0x1000, absorbing its group, and
        // to 0x3100; 0x5000 leads nothing; 0x6000 is reachable from a global.
        let blocks = [(0x1000, 16), (0x1100, 16), (0x3000, 16), (0x3100, 16), (0x5000, 16), (0x6000, 16)];
        let mem =
            std::collections::BTreeMap::from([(0x100, 0x6000), (0x1000, 0x1100), (0x3000, 0x1000), (0x3008, 0x3100)]);
        let s = scan(&blocks, &[(0x100, 0x108)], &[], &Toy(mem));
        use LeakKind::*;
        let kinds: Vec<LeakKind> = s.kinds().collect();
        assert_eq!(
            kinds,
            [IndirectlyLost, IndirectlyLost, DefinitelyLost, IndirectlyLost, DefinitelyLost, StillReachable]
        );
        let leaders: Vec<Option<usize>> = (0..blocks.len()).map(|i| s.group_leader(i)).collect();
        assert_eq!(leaders, [Some(2), Some(2), None, Some(2), None, None]);
    }

    #[test]
    fn register_words_are_roots_and_zero_sized_blocks_match_their_start_only() {
        let blocks = [(0x1000, 0), (0x2000, 16)];
        let kinds = run(&blocks, &[], &[0x1000, 0x2008], &Toy(Default::default()));
        assert_eq!(kinds, [LeakKind::StillReachable, LeakKind::PossiblyLost]);
    }

    #[test]
    fn the_page_filter_never_hides_a_block() {
        // Blocks on one page, across pages, far apart, zero-sized, and one larger than the
        // filter's minimum: every word near each of them, and between them, finds what a
        // search of the whole list finds.
        let blocks = [
            (0x1000, 0),
            (0x1ff0, 32),
            (0x5000, 3 * 4096 + 8),
            (0x7f00_0000_0000, 16),
            (0x7f00_0001_0000, FILTER_MIN_BITS * 4096 * 2),
        ];
        let heap = Heap::new(&blocks);
        let naive =
            |w: u64| blocks.iter().position(|&(s, n)| w == s || (s < w && w < s + n)).map(|i| (i, w == blocks[i].0));
        let mut words: Vec<u64> = (0..0x10000).step_by(8).collect();
        for &(s, n) in &blocks {
            words.extend((s.saturating_sub(64)..s + n.min(1 << 20) + 64).step_by(8));
            words.extend([s + n - n.min(8), s + n, s + n + 4096]);
        }
        for w in words {
            assert_eq!(heap.find(w), naive(w), "word {w:#x}");
        }
        let sparse = Heap::new(&blocks[..4]);
        let set = sparse.pages.iter().map(|w| w.count_ones()).sum::<u32>();
        assert!(set <= 7, "seven pages touched, at most seven bits set: {set}");
    }
}
