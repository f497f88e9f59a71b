//! `spy=guard`: the IMallocSpy showcase. A header and a trailer canary around every block,
//! checked when the block is freed or reallocated, and at exit if it is still live. Double
//! frees (a caller pointer freed, or given up by a `realloc` that moved its block, among about
//! the last 100,000: see [`GuardSpy::remember_freed`]) and frees of pointers that cannot be
//! blocks (misaligned, on the thread's stack, or unmapped) are caught before the real
//! allocator sees them; any other pointer the guard did not lay out may be a block of the real
//! heap allocated before it, and goes to the real allocator's own checks, unless it is where
//! the real block under one of the guard's starts (`free(p - 16)`). A block given back by a function of another family than the one
//! that allocated it (`free` or `realloc` of a block from C++'s `new`, `delete` of one from
//! `new[]` or `malloc`) is a finding too, as valgrind's "Mismatched free() / delete / delete
//! []" and AddressSanitizer's alloc-dealloc-mismatch are; it is then freed all the same. So is
//! a `new` block that a sized or aligned `delete` gives back saying another size or alignment
//! than the block's (AddressSanitizer's new-delete-type-mismatch; `delete_hint.rs`).
//!
//! Layout of a block (caller's pointer `p`, `size` bytes asked for):
//!
//! ```text
//! real                       p-16        p-8          p                p+size
//! | padding (aligned blocks) | size: u64 | tag: u64 | caller's bytes | trailer: u64 |
//! ```
//!
//! The size word also holds, in its top bits, log2 of the header's offset from the real block
//! (16, or the alignment for aligned blocks), below them the [`Family`] of the function that
//! allocated it, and below that whether the function was an aligned one; `tag` is a hash of
//! `p` and the size word. A
//! change to any byte of either word is seen (a zero written just before the block, as
//! `s[strlen(s) - 1] = 0` on an empty string does, included), the size is trusted only once
//! the tag vouches for it, and a header copied elsewhere does not validate. Every byte of the
//! tag and of the trailer is even and from 0x80 up: a zero, a byte of ASCII text, 0xff or any
//! odd byte written over one is always seen; another byte is missed only when it happens to be
//! the value already there (one in 64).
//! Every finding is one line: what, where, how big, and the module and offset of the call;
//! the program goes on where it safely can (a damaged header means the real block cannot be
//! found, so it is leaked, not freed). At exit, each distinct call stack of a finding is
//! listed, named ([`FindingSites`]).

use core::ffi::c_void;
use core::fmt::Write;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::finding_sites::{self, FindingSites};
use crate::delete_hint::DeleteHint;
use crate::leaks::report::{Namer, write_frame};
use crate::leaks::{Frame, StackOptions, Suppressions};
use crate::line::Line;
use crate::live_table::LiveTable;
use crate::spy::{CallScratch, Entry, MallocSpy};
use crate::threads::{self, MAX_THREADS};
use crate::{os, pool, sink, unwind};

const HEADER: usize = 16;
const TRAILER: usize = 8;
const CANARY: u64 = 0x5AFE_C0DE_0BAD_F00D;
const TRAILER_CANARY: u64 = 0xDEAD_BEEF_FEED_FACE;
/// Largest header offset (alignment): the most an x86-64 address space can honour (the size
/// word's top bits hold its log2). A larger alignment the real allocator fails anyway.
const MAX_OFFSET: usize = 1 << 47;
/// Recently freed blocks remembered for double-free detection: the places of the ring.
const RECENT: usize = 1 << 17;
/// Places in the ring a thread takes at once for its frees: 8 lines of the ring its own, and
/// the shared counter touched once in 64 frees. Taken one at a time, two threads freeing in a
/// loop met on the counter's line and on the ring's at every free, and each free cost 2.3
/// times what it cost on one thread.
const CHUNK: usize = 64;
/// How far behind the newest chunk a thread's own may be and still be used: a thread that
/// frees seldom kept its chunk for a lap of the others' frees, and a block it freed was
/// forgotten a few hundred frees later, its double free taken for an invalid one (review
/// helper 160).
const MAX_LAG: usize = 8192;
/// Threads take chunks only while no more than this many have had a slot at once. Among more,
/// the chunks in use spread over more numbers than `MAX_LAG`: a chunk taken pushed the others
/// past it, they took new ones in turn, each used one number, and the ring went round in about
/// 2,000 frees (200 threads freeing in turn: review helper 161). Each takes one number then.
const CHUNKED_THREADS: usize = 16;
const _: () = assert!(RECENT.is_multiple_of(CHUNK) && CHUNKED_THREADS * CHUNK * 4 <= MAX_LAG && MAX_LAG < RECENT / 8);

// Scratch words 0..7, from a Pre method to its Post method (the leak tracker, which may run
// beside the guard, has 8..10).
const S_SIZE: usize = 0;
const S_OFFSET: usize = 1;
const S_KEEP: usize = 2;
/// The caller's pointer a realloc was given, and its size: freed if the block moves.
const S_OLD: usize = 3;
const S_OLD_SIZE: usize = 4;

/// The size remembered of a freed block the guard did not lay out (never measured).
const UNKNOWN_SIZE: usize = usize::MAX;
/// The entry point of a release (a free, or a realloc to 0 that frees), for the findings.
const S_ENTRY: usize = 5;
/// The [`Family`] of the allocating call in progress.
const S_FAMILY: usize = 6;
/// Whether the allocating call in progress is one of the aligned functions (`memalign`, the
/// aligned `operator new`...).
const S_ALIGNED: usize = 7;

/// The functions that allocate and release blocks of one kind: a block is given back by the
/// family that gave it out, or the C++ standard says the behaviour is undefined.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Family {
    /// `malloc`, `calloc`, `realloc`, the aligned functions: `free` and `realloc`.
    Malloc = 0,
    /// `operator new`: `operator delete`.
    New,
    /// `operator new[]`: `operator delete[]`.
    NewArray,
}

impl Family {
    /// The family that `entry` allocates in, or gives blocks back to.
    fn of(entry: Entry) -> Family {
        match entry {
            Entry::OperatorNew | Entry::OperatorDelete => Family::New,
            Entry::OperatorNewArray | Entry::OperatorDeleteArray => Family::NewArray,
            _ => Family::Malloc,
        }
    }

    fn from_bits(bits: u64) -> Family {
        match bits {
            1 => Family::New,
            2 => Family::NewArray,
            _ => Family::Malloc,
        }
    }

    /// What the finding of a block of this family given back by another says.
    const fn allocated_by(self) -> &'static str {
        match self {
            Family::Malloc => ": allocated by malloc",
            Family::New => ": allocated by operator new",
            Family::NewArray => ": allocated by operator new[]",
        }
    }
}

/// What kind of misuse a finding is.
#[derive(Clone, Copy)]
enum Finding {
    Overflow = 0,
    Underflow,
    DoubleFree,
    InvalidFree,
    Mismatch,
    /// A sized or aligned `delete` told another size or alignment than the block's.
    TypeMismatch,
    /// C23's `free_sized` or `free_aligned_sized` told another size or alignment.
    SizeMismatch,
}

/// The number of kinds of [`Finding`].
const FINDINGS: usize = 7;

/// The bit of a site's kind that says its stack is the allocation of a block found damaged
/// at exit, not the call at which a finding was made.
const LIVE_AT_EXIT: u32 = 1 << 8;

/// What each [`Finding`] is, as its lines and the summary of its sites name it.
const FINDING_NAMES: [&str; FINDINGS] = [
    "heap-buffer-overflow",
    "heap-buffer-underflow",
    "double-free",
    "invalid-free",
    "alloc-dealloc-mismatch",
    "new-delete-type-mismatch",
    "free-size-mismatch",
];

/// What each [`Finding`]'s line says after the block's address and size. ("header canary
/// damaged, block leaked at 0x..." read as if the address were where a leak was.)
/// (A mismatch's says which function allocated the block: [`Family::allocated_by`]; a type
/// mismatch's what the `delete` told: [`mismatch`].)
const FINDING_DETAILS: [&str; FINDINGS] =
    [": trailer canary damaged", ": header canary damaged, the block is leaked", "", ": not a live block", "", "", ""];

/// A recently freed block: its size, and its sequence number (its place in the eviction ring
/// is `seq % RECENT`).
#[derive(Clone, Copy)]
struct Recent {
    size: usize,
    seq: usize,
}

/// The guard spy.
pub(crate) struct GuardSpy {
    /// Recently freed caller pointers, to tell a double free from a foreign pointer.
    recent: &'static LiveTable<Recent>,
    /// FIFO of the pointers in `recent`, `[AtomicUsize; RECENT]` in an anonymous mapping.
    ring: NonNull<AtomicUsize>,
    /// The first sequence number of the next chunk a thread takes (a multiple of [`CHUNK`]
    /// unless a thread without a slot took a single number).
    ring_next: Cursor,
    /// `[Cursor; MAX_THREADS]`, indexed by thread slot: the next sequence number of the slot's
    /// chunk.
    cursors: NonNull<Cursor>,
    findings: [AtomicU64; FINDINGS],
    /// Where the findings were made.
    sites: FindingSites,
    /// The real allocator is glibc's, whose chunk headers a foreign pointer is checked by
    /// ([`glibc_would_take`]).
    glibc: bool,
    /// Whether a block given back by another family than its own is a finding.
    mismatches: bool,
}

/// A sequence number on a line of its own: a thread's next one in its chunk (a multiple of
/// [`CHUNK`] when it has none left; a chunk that did not start at one ends early at the next),
/// written only by the thread owning the slot; or the first of the next chunk. (The spy's
/// read-mostly fields, beside the shared counter, were taken from every thread each time one
/// took a chunk.)
#[repr(C, align(64))]
struct Cursor(AtomicUsize);

// SAFETY: the ring and the cursors are atomics; the rest is atomics and a Sync table.
unsafe impl Send for GuardSpy {}
// SAFETY: as above.
unsafe impl Sync for GuardSpy {}

/// A header as read back.
struct Header {
    size: usize,
    offset: usize,
    family: Family,
    /// Allocated by an aligned function (its alignment, if above 16, is `offset`).
    aligned: bool,
}

/// Where the size word keeps log2 of the header's offset (no block is 2^55 bytes long), below
/// it the block's [`Family`], and below that whether an aligned function allocated it.
const SHIFT_AT: u32 = 58;
const FAMILY_AT: u32 = 56;
const ALIGNED_AT: u32 = 55;
const _: () = assert!(MAX_OFFSET.trailing_zeros() < 1 << (64 - SHIFT_AT));

/// The size word of a block of `size` bytes whose header is `offset` bytes into the real one.
fn size_word(size: usize, offset: usize, family: Family, aligned: bool) -> u64 {
    size as u64
        | u64::from(aligned) << ALIGNED_AT
        | (family as u64) << FAMILY_AT
        | u64::from(offset.trailing_zeros()) << SHIFT_AT
}

/// Bits set, and bits cleared, in every byte of a canary word: the top bit and the lowest.
const CANARY_SET: u64 = 0x8080_8080_8080_8080;
const CANARY_CLEAR: u64 = 0x0101_0101_0101_0101;

/// A hash made a canary: every byte from 0x80 up and even, so that none is a zero, a byte of
/// ASCII text or 0xff (the fills and overflows most writes past a block are made of).
fn canary(hash: u64) -> u64 {
    (hash | CANARY_SET) & !CANARY_CLEAR
}

/// splitmix64's finalizer: every bit of the result depends on every bit of `z`.
fn mix(mut z: u64) -> u64 {
    z = (z ^ z >> 30).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ z >> 27).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ z >> 31
}

/// The tag of the block at `p`: a [`canary`] of a hash of `p` and of the size word. With any
/// byte of the hash there, one in 256 writes found the very value already in place ('u'
/// written at `p[-1]` went unseen in one CI run).
fn tag(p: usize, size_word: u64) -> u64 {
    canary(mix((p as u64 ^ CANARY) ^ size_word.rotate_left(32)))
}

/// The trailer after the block at `p`: a [`canary`] of a hash of `p`. (`TRAILER_CANARY ^ p`
/// gave the first byte one of 16 values ending in 0xE, so a string overflowing by an `n` or a
/// `.` went unseen once in 16 blocks; with only the top bit set, a 0xff fill once in 128.)
fn trailer(p: usize) -> u64 {
    canary(mix(p as u64 ^ TRAILER_CANARY))
}

/// Writes the header and trailer of the block whose caller pointer is `p`.
///
/// # Safety
/// `[p - 16, p + size + 8)` is inside one live block of ours.
unsafe fn lay_out(p: usize, size: usize, offset: usize, family: Family, aligned: bool) {
    let p8 = p as *mut u8;
    // SAFETY: the caller's guarantee; p is 16-aligned, so the header words are aligned.
    unsafe {
        let word = size_word(size, offset, family, aligned);
        (p8.sub(HEADER) as *mut u64).write(word);
        (p8.sub(8) as *mut u64).write(tag(p, word));
        (p8.add(size) as *mut u64).write_unaligned(trailer(p));
    }
}

/// Unmakes the header of the spied block at `p` (its tag) as its real block goes back to the
/// real allocator. Freed memory keeps what it held where glibc writes nothing of its own (a
/// block merged into the top of the heap), and a header left there made a block of the real
/// heap later handed out at that place, unspied (the live-block table full, `max_memory`
/// reached), look like a guarded block's start: its free was an invalid-free (review helper
/// 121: a correct program, hundreds of findings).
///
/// # Safety
/// `p` is the caller pointer of a live block this spy laid out.
unsafe fn wipe_header(p: usize) {
    // SAFETY: the caller's guarantee: the header's words are the block's.
    unsafe { ((p as *mut u8).sub(8) as *mut u64).write(0) };
}

/// Puts back the tag [`wipe_header`] took from the block at `p`, whose `realloc` failed.
///
/// # Safety
/// As [`wipe_header`].
unsafe fn restore_header(p: usize) {
    let p8 = p as *mut u8;
    // SAFETY: the caller's guarantee; the size word was left as it was.
    unsafe { (p8.sub(8) as *mut u64).write(tag(p, (p8.sub(HEADER) as *const u64).read())) };
}

/// Reads the header of a spied block; `None` when it is damaged.
///
/// # Safety
/// `p` is the caller pointer of a block this spy laid out (its 16 header bytes are readable).
unsafe fn read_header(p: usize) -> Option<Header> {
    let p8 = p as *const u8;
    // SAFETY: the caller's guarantee.
    let (word, tag_word) = unsafe { ((p8.sub(HEADER) as *const u64).read(), (p8.sub(8) as *const u64).read()) };
    header_of(p, word, tag_word)
}

/// The header that the size word `word` and tag `tag_word` before `p` make, if they are one.
fn header_of(p: usize, word: u64, tag_word: u64) -> Option<Header> {
    let shift = word >> SHIFT_AT;
    let valid = tag_word == tag(p, word)
        && (u64::from(HEADER.trailing_zeros())..=u64::from(MAX_OFFSET.trailing_zeros())).contains(&shift);
    valid.then(|| Header {
        size: (word & ((1 << ALIGNED_AT) - 1)) as usize,
        offset: 1 << shift,
        family: Family::from_bits(word >> FAMILY_AT & 3),
        aligned: word >> ALIGNED_AT & 1 != 0,
    })
}

/// Whether the trailer after a block with an intact header is intact.
///
/// # Safety
/// `p` has an intact header of this spy.
unsafe fn trailer_intact(p: usize, size: usize) -> bool {
    // SAFETY: an intact header means the block holds size + TRAILER bytes after p.
    unsafe { ((p as *const u8).add(size) as *const u64).read_unaligned() == trailer(p) }
}

/// Whether `p` (16-aligned, not a block of the guard's) could be a block of the real heap:
/// not on the calling thread's stack, and with the 16 bytes the real allocator reads before
/// it mapped. A pointer elsewhere in a mapping (into the middle of a block, say) still goes
/// through, to the real allocator's own checks.
fn could_be_a_block(p: usize) -> bool {
    let (low, high) = crate::unwind::stack_bounds();
    // The program's frames lie above this one: a pointer into its stack is at least here. The
    // mapping's start is no bound for a thread running on a stack the program malloc'ed: that
    // mapping is the heap, whose blocks below the stack were refused as not the heap's.
    // (Not when this frame is on another stack: a signal handler's alternate one.)
    let here = 0u8;
    let here = core::hint::black_box(&here) as *const u8 as u64;
    let low = if (low..high).contains(&here) { here } else { low };
    p >= HEADER && !(low..high).contains(&(p as u64)) && crate::os::is_mapped(p - HEADER)
}

/// Whether glibc's `free` would take `p` (16-aligned, the 16 bytes before it mapped) as the
/// start of one of its blocks: the checks it makes before it aborts ("free(): invalid
/// pointer", "free(): invalid size", "munmap_chunk(): invalid pointer", "double free or
/// corruption (!prev)"), and the pages it reads (a thread arena's heap header), made first so
/// that a pointer into the middle of a block is a finding and the program goes on, as under
/// valgrind (glibc aborted, or took text for a size). The layout is glibc's `malloc_chunk`:
/// the previous chunk's size, then this one's with three flag bits, then the block.
///
/// # Safety
/// The 16 bytes before `p` are mapped and readable.
unsafe fn glibc_would_take(p: usize) -> bool {
    const PREV_INUSE: u64 = 1;
    const IS_MMAPPED: u64 = 2;
    const NON_MAIN_ARENA: u64 = 4;
    const MIN_CHUNK: u64 = 32;
    /// A thread arena's heaps are aligned to this, their header at the start.
    const HEAP_MAX: u64 = 64 << 20;
    let chunk = (p - HEADER) as u64;
    // SAFETY: the caller's guarantee.
    let (prev_size, size_field) = unsafe { (read_word(chunk), read_word(chunk + 8)) };
    let size = size_field & !7;
    if size < MIN_CHUNK || !size.is_multiple_of(16) || chunk > size.wrapping_neg() {
        return false;
    }
    let page = os::page_size() as u64 - 1;
    if size_field & IS_MMAPPED != 0 {
        let (start, total) = (chunk.wrapping_sub(prev_size), prev_size.wrapping_add(size));
        // glibc's `powerof2`, which 0 passes too.
        let in_page = p as u64 & page;
        return (start | total) & page == 0 && in_page & in_page.wrapping_sub(1) == 0;
    }
    if size_field & NON_MAIN_ARENA != 0 && !os::is_mapped((chunk & !(HEAP_MAX - 1)) as usize) {
        return false;
    }
    let next = chunk + size;
    // SAFETY: read only once seen mapped (16-aligned: both of its words on one page).
    os::is_mapped(next as usize + 8) && unsafe { read_word(next + 8) } & PREV_INUSE != 0
}

/// Whether `p` is where the real allocator's block under a live block of the guard's starts:
/// `free(q - 16)` of a block `q`, or `free(q - 64)` of a `memalign(64, ...)` one. glibc takes
/// it (it is its block), and the caller's memory went back under the caller, to be handed out
/// again (review helper 90). Told by the header the guard wrote `offset` bytes on, whose tag
/// names that place (a block's header is unmade as it goes back, [`wipe_header`]: none is
/// left in freed memory to be read as one). Every offset is looked for (up to a page only, a
/// `memalign(8192, ...)` block's memory went back under it: review helper 129); the words
/// are read by the kernel, as what lies past `p` may not be mapped.
fn begins_a_guarded_block(p: usize) -> bool {
    // Every header place at once: a free of an unspied block made one system call a place
    // (and one for the pid), 64% of a run whose blocks went unspied (review helper 121).
    const PLACES: usize = (MAX_OFFSET / HEADER).trailing_zeros() as usize + 1;
    let offset = |i: usize| HEADER << i;
    let mut places = [0usize; PLACES];
    let mut n = 0;
    while n < PLACES
        && let Some(q) = p.checked_add(offset(n))
    {
        places[n] = q - HEADER;
        n += 1;
    }
    let mut words = [[0u64; 2]; PLACES];
    let read = os::read_own_pairs(&places[..n], &mut words);
    (0..read).any(|i| header_of(p + offset(i), words[i][0], words[i][1]).is_some_and(|h| h.offset == offset(i)))
}

/// How far past a guarded block's start `p` lies, and the block's size, when it is a C++
/// array cookie's width (8 or 16 bytes) and within the block or just after it. Read with `process_vm_readv`: the
/// bytes before `p` may be anything, unmapped included.
fn block_under(p: usize) -> Option<(usize, usize)> {
    [8, 16].into_iter().find_map(|inside| {
        let start = p.checked_sub(inside).filter(|s| s.is_multiple_of(HEADER) && *s >= HEADER)?;
        let mut words = [[0u64; 2]];
        (os::read_own_pairs(&[start - HEADER], &mut words) == 1)
            .then(|| header_of(start, words[0][0], words[0][1]))
            .flatten()
            .filter(|h| h.size >= inside)
            .map(|h| (inside, h.size))
    })
}

/// # Safety
/// `at` is mapped, readable and 8-aligned.
unsafe fn read_word(at: u64) -> u64 {
    // SAFETY: the caller's guarantee; volatile, as the word is not Rust's.
    unsafe { core::ptr::read_volatile(at as *const u64) }
}

/// The start of a finding's line: what, where, how big.
fn finding_line(finding: Finding, p: usize, size: Option<usize>) -> Line<256> {
    let mut line = Line::new();
    let _ = write!(line, "mallocspy: guard: {} at {p:#x}", FINDING_NAMES[finding as usize]);
    if let Some(size) = size.filter(|&s| s != UNKNOWN_SIZE) {
        let _ = write!(line, ", size {size}");
    }
    line
}

/// Header offset for an alignment: the header must end where an aligned pointer can start.
fn offset_for(align: usize) -> usize {
    if align <= HEADER {
        HEADER
    } else {
        // A bad alignment is the real allocator's to reject; a huge one ours to refuse.
        align.checked_next_power_of_two().filter(|&a| a <= MAX_OFFSET).unwrap_or(HEADER)
    }
}

impl GuardSpy {
    /// A guard with an empty memory of freed blocks; `None` if it cannot be mapped. `glibc`:
    /// whether the real allocator is glibc's; `mismatches`: whether a block given back by
    /// another family than its own is a finding.
    pub(crate) fn new(glibc: bool, mismatches: bool) -> Option<Self> {
        let ring = pool::lease(RECENT * core::mem::size_of::<usize>())?.cast::<AtomicUsize>();
        Some(Self {
            recent: LiveTable::leased()?,
            ring,
            ring_next: Cursor(AtomicUsize::new(0)),
            cursors: threads::map_per_thread::<Cursor>()?,
            findings: [const { AtomicU64::new(0) }; FINDINGS],
            sites: FindingSites::new()?,
            glibc,
            mismatches,
        })
    }

    fn report(&self, finding: Finding, p: usize, size: Option<usize>, place: &str) {
        self.report_saying(finding, p, size, FINDING_DETAILS[finding as usize], place);
    }

    /// [`Self::report`] with the line's `detail` (what follows the block's address and size).
    fn report_saying(&self, finding: Finding, p: usize, size: Option<usize>, detail: &str, place: &str) {
        let order = self.findings();
        self.findings[finding as usize].fetch_add(1, Ordering::Relaxed);
        let mut frames = [0u64; finding_sites::DEPTH];
        // The walk needs the loader (the module list) and a few KiB of a stack whose extent it
        // knows (the thread's, or the alternate signal stack it is on; not a coroutine's): a
        // forked child whose loader's lock another thread held hung in it, and a thread on a
        // 16 KiB stack died of it. Without them the finding is said without where.
        let walkable = unwind::stack_room() >= unwind::UNCACHED_WALK_ROOM && crate::loader::usable();
        let start = unwind::hook_start().filter(|_| walkable);
        let depth = start.map_or(0, |start| unwind::capture_uncached(&mut frames, start));
        let mut modules = [(0, 0); finding_sites::DEPTH];
        if depth > 0 {
            modules_of(&frames[..depth], &mut modules[..depth]);
        }
        self.sites.record(finding as u32, &frames[..depth], &modules[..depth], order);
        let mut line = finding_line(finding, p, size);
        let _ = write!(line, "{detail} (in {place}");
        if depth > 0 {
            let _ = write!(line, ", called from ");
            write_code_place(&mut line, frames[0]);
        }
        let _ = writeln!(line, ")");
        sink::write(line.as_bytes());
    }

    /// Checks the canaries of the blocks still live at exit, whose caller pointers
    /// `each_live` lists: an overrun of a block never freed was never seen (review helper 81).
    /// One line per damaged block, counted in the summary. The writes are long past; what
    /// names the block is the stack that allocated it, which `allocated_at` gives with the
    /// block's size when another spy kept it (the leak tracker's): the line says its call, and
    /// the sites report lists it (review helper 109: an address and a size alone were nothing
    /// to act on). A size other than the block's is another block's record, not named.
    pub(crate) fn check_live_blocks(
        &self,
        each_live: impl FnOnce(&mut dyn FnMut(usize)),
        allocated_at: &dyn Fn(usize) -> Option<(u64, &'static [u64])>,
    ) {
        each_live(&mut |p| {
            // SAFETY: the dispatcher lists the blocks laid out under the guard (the only
            // built-in spy that moves pointers) and still live, each not freed while listed.
            let (finding, size, detail) = match unsafe { read_header(p) } {
                None => (Finding::Underflow, None, ": header canary damaged"),
                // SAFETY: as above; the header is intact.
                Some(h) if !unsafe { trailer_intact(p, h.size) } => {
                    (Finding::Overflow, Some(h.size), FINDING_DETAILS[Finding::Overflow as usize])
                }
                Some(_) => return,
            };
            let order = self.findings();
            self.findings[finding as usize].fetch_add(1, Ordering::Relaxed);
            let mut line = finding_line(finding, p, size);
            let _ = write!(line, "{detail} (in a block still live at exit");
            let allocation = allocated_at(p)
                .filter(|&(recorded, frames)| !frames.is_empty() && size.is_none_or(|size| recorded == size as u64));
            if let Some((_, frames)) = allocation {
                let frames = &frames[..frames.len().min(finding_sites::DEPTH)];
                let mut modules = [(0, 0); finding_sites::DEPTH];
                modules_of(frames, &mut modules[..frames.len()]);
                self.sites.record(finding as u32 | LIVE_AT_EXIT, frames, &modules[..frames.len()], order);
                let _ = write!(line, ", allocated from ");
                write_code_place(&mut line, frames[0]);
            }
            let _ = writeln!(line, ")");
            sink::write(line.as_bytes());
        });
    }

    /// Number of findings so far.
    pub(crate) fn findings(&self) -> u64 {
        self.findings.iter().map(|f| f.load(Ordering::Relaxed)).sum()
    }

    /// The exit summary: nothing when all was well.
    pub(crate) fn report_summary(&self) -> Option<Line<256>> {
        let total = self.findings();
        if total == 0 {
            return None;
        }
        let n = |f: Finding| self.findings[f as usize].load(Ordering::Relaxed);
        let mut line = Line::new();
        let _ = writeln!(
            line,
            "mallocspy: guard: {total} finding(s): {} overflow, {} underflow, {} double-free, {} invalid-free, {} \
             alloc-dealloc-mismatch, {} new-delete-type-mismatch, {} free-size-mismatch",
            n(Finding::Overflow),
            n(Finding::Underflow),
            n(Finding::DoubleFree),
            n(Finding::InvalidFree),
            n(Finding::Mismatch),
            n(Finding::TypeMismatch),
            n(Finding::SizeMismatch)
        );
        Some(line)
    }

    /// Each distinct call stack of a finding, named, in the order of their first findings
    /// (frames below `main` left out unless `below_main`); empty when there was none.
    pub(crate) fn sites_report(&self, below_main: bool) -> String {
        let (sites, unplaced) = self.sites.sites();
        let mut out = String::new();
        if sites.is_empty() && unplaced == 0 {
            return out;
        }
        let prefix = "mallocspy: guard:";
        let _ = writeln!(out, "{prefix} where the findings were made:");
        let ids: Vec<u32> = (0..sites.len() as u32).collect();
        let none = Suppressions::default();
        let mut namer =
            Namer::new(StackOptions { suppressions: &none, below_main }, &ids, &|id| sites[id as usize].frames.clone());
        let loaded = loaded_modules();
        for site in &sites {
            let times = if site.count == 1 { "1 time".to_owned() } else { format!("{} times", site.count) };
            let what = FINDING_NAMES.get((site.kind & !LIVE_AT_EXIT) as usize).copied().unwrap_or("finding");
            if site.kind & LIVE_AT_EXIT != 0 {
                let _ = writeln!(out, "{prefix} {what} in a block still live at exit ({times}), allocated at:");
            } else {
                let _ = writeln!(out, "{prefix} {what} ({times})");
            }
            if site.frames.is_empty() {
                let _ = writeln!(
                    out,
                    "{prefix}    no call stack: found on a stack other than the thread's own (a signal \
                     handler's alternate one, a coroutine's) or with too little of it left to walk, or in a \
                     forked child whose loader was locked"
                );
            }
            let shown = namer.shown(&site.frames);
            let mut i = 0;
            for (&addr, &(bias, name)) in site.frames[..shown].iter().zip(&site.modules) {
                let gone = (bias, name) != (0, 0) && !loaded.contains(&(bias, name));
                let unloaded;
                let frames = if gone {
                    // Its library was unloaded since (another may be where it was): not named
                    // from what is there now.
                    unloaded = [Frame {
                        address: format!("{addr:#x}"),
                        function: None,
                        file: None,
                        line: None,
                        module: Some("a library unloaded since".to_owned()),
                        offset: Some(addr.wrapping_sub(bias)),
                        unloaded: false,
                    }];
                    &unloaded[..]
                } else {
                    namer.frames_of_address(addr)
                };
                for frame in frames {
                    write_frame(&mut out, prefix, i, frame);
                    i += 1;
                }
            }
        }
        if unplaced > 0 {
            let _ = writeln!(out, "{prefix} {unplaced} finding(s) at further call stacks, not listed");
        }
        out
    }

    /// Remembers a freed caller pointer, forgetting the oldest one. A `realloc` remembers its
    /// block before the real call, which frees it (a thread given the place afterwards makes
    /// it live again), and forgets it if the call fails or the block stays: it takes a place
    /// of the ring all the same (python3's reallocs are 3.5% of its frees).
    ///
    /// Without a lock: each free takes a sequence number (from its thread's chunk of them)
    /// and swaps itself into that place of the ring. (Under one lock, 400 threads freeing
    /// spent their time waiting for it: 3x the native run.) The pointer it evicts leaves
    /// `recent` if its record was made in this place of the ring: a later free of that
    /// pointer was recorded elsewhere and stays. A record lives until its place comes round
    /// again: RECENT numbers later, less the numbers taken but never used (the rest of a
    /// chunk whose thread exited, or fell more than [`MAX_LAG`] behind and took a new one)
    /// and less the lag of the chunks in use (at most [`CHUNKED_THREADS`] of them): about
    /// 100,000 frees at the least. A race between two frees a lap apart can at worst drop the
    /// record of one of them, and so miss a later double free of that block; it never makes a
    /// valid free look like a double one.
    fn remember_freed(&self, p: usize, size: usize) {
        let seq = self.next_seq();
        let place = seq % RECENT;
        // SAFETY: `place` is below RECENT, the ring's length.
        let slot = unsafe { &*self.ring.as_ptr().add(place) };
        let evicted = slot.swap(p, Ordering::AcqRel);
        if evicted != 0 && self.recent.get(evicted).is_some_and(|r| r.seq != seq && r.seq % RECENT == place) {
            self.recent.remove(evicted);
        }
        self.recent.insert(p, Recent { size, seq });
    }

    /// The calling thread's next sequence number: from a new chunk when its own is used up or
    /// lags the newest by more than [`MAX_LAG`]; alone, among more than [`CHUNKED_THREADS`].
    fn next_seq(&self) -> usize {
        let Some(index) = threads::current_index().filter(|_| threads::high_water() <= CHUNKED_THREADS) else {
            // No slot to keep a chunk in, or too many threads: one number. The chunks taken
            // after it are no longer on the ring's lines, but their numbers are still their own.
            return self.ring_next.0.fetch_add(1, Ordering::Relaxed);
        };
        debug_assert!((index as usize) < MAX_THREADS);
        // SAFETY: index < MAX_THREADS, the mapping's length; zeroed memory is valid atomics.
        let cursor = unsafe { &(*self.cursors.as_ptr().add(index as usize)).0 };
        let mut seq = cursor.load(Ordering::Relaxed);
        if seq.is_multiple_of(CHUNK) || self.ring_next.0.load(Ordering::Relaxed).wrapping_sub(seq) > MAX_LAG {
            seq = self.ring_next.0.fetch_add(CHUNK, Ordering::Relaxed);
        }
        // Only the slot's owner writes its cursor.
        cursor.store(seq.wrapping_add(1), Ordering::Relaxed);
        seq
    }

    /// A pointer the dispatcher does not know as a live spied block: a double free, a
    /// pointer no block starts at, or a block of the real heap the guard did not lay out
    /// (allocated before it, or from inside a hook: passed through). Returns false when the
    /// pointer must not reach the real allocator.
    fn check_foreign(&self, p: usize, place: &str) -> bool {
        if !p.is_multiple_of(HEADER) {
            self.report_invalid_free(p, place);
            return false;
        }
        if let Some(r) = self.recent.get(p) {
            self.report(Finding::DoubleFree, p, Some(r.size), place);
            return false;
        }
        if !could_be_a_block(p) {
            self.report_invalid_free(p, place);
            return false;
        }
        // SAFETY: `could_be_a_block` saw the 16 bytes before `p` mapped.
        if self.glibc && !crate::bootstrap::contains(p as *const c_void) && !unsafe { glibc_would_take(p) }
            || begins_a_guarded_block(p)
        {
            self.report_invalid_free(p, place);
            return false;
        }
        true
    }

    /// An invalid free, said as inside a guarded block when a C++ array cookie's width past
    /// one's start (`delete` of what `new D[3]` returned, whose block starts 8 bytes before:
    /// "not a live block" said nothing of the block it was in; review helper 129), as
    /// valgrind's "8 bytes inside a block of size 32" does.
    fn report_invalid_free(&self, p: usize, place: &str) {
        let mut detail = Line::<96>::new();
        match block_under(p) {
            Some((inside, size)) => {
                let _ = match inside < size {
                    true => write!(detail, ": {inside} bytes inside a block of size {size}"),
                    // `new D[0]`: the block holds only the cookie, and `new[]` returned its end.
                    false => write!(detail, ": 0 bytes after a block of size {size}"),
                };
                if releasing_entry() == Entry::OperatorDelete {
                    let _ = write!(detail, " (a delete of what new[] returned?)");
                }
            }
            None => {
                let _ = write!(detail, "{}", FINDING_DETAILS[Finding::InvalidFree as usize]);
            }
        }
        let detail = core::str::from_utf8(detail.as_bytes()).unwrap_or_default();
        self.report_saying(Finding::InvalidFree, p, None, detail, place);
    }

    /// Validates a spied block before it goes back; `None` when its header is damaged.
    fn check_spied(&self, p: usize, place: &str) -> Option<Header> {
        let releasing = Family::of(releasing_entry());
        // SAFETY: spied blocks were laid out by post_alloc/post_realloc of this spy.
        let Some(header) = (unsafe { read_header(p) }) else {
            self.report(Finding::Underflow, p, None, place);
            return None;
        };
        // SAFETY: the header is intact.
        if !unsafe { trailer_intact(p, header.size) } {
            self.report(Finding::Overflow, p, Some(header.size), place);
        }
        if header.family != releasing && self.mismatches {
            self.report_saying(Finding::Mismatch, p, Some(header.size), header.family.allocated_by(), place);
        } else if self.mismatches {
            // A `delete` of a `new` block, or a sized free of a `malloc` one, says what it
            // was allocated with.
            let said = match releasing_entry() {
                Entry::FreeSized | Entry::FreeAlignedSized => Some((Finding::SizeMismatch, Said::Free)),
                _ if header.family != Family::Malloc => Some((Finding::TypeMismatch, Said::Delete)),
                _ => None,
            };
            let told = said.zip(DeleteHint::of(p as *mut c_void));
            if let Some((finding, mut detail)) =
                told.and_then(|((f, said), told)| Some((f, mismatch(&header, told, said)?)))
            {
                let detail = core::str::from_utf8(detail.as_bytes()).unwrap_or("");
                self.report_saying(finding, p, Some(header.size), detail, place);
            }
        }
        Some(header)
    }

    /// Lays out a block the real allocator returned (for the sizes a Pre method noted).
    fn finish(&self, real: *mut c_void) -> *mut c_void {
        if real.is_null() {
            return real;
        }
        let size = CallScratch::get(S_SIZE) as usize;
        let offset = CallScratch::get(S_OFFSET) as usize;
        let family = Family::from_bits(CallScratch::get(S_FAMILY));
        let aligned = CallScratch::get(S_ALIGNED) != 0;
        let p = real as usize + offset;
        // SAFETY: the Pre method asked for offset + size + TRAILER bytes.
        unsafe { lay_out(p, size, offset, family, aligned) };
        // A block laid out and then refused by the dispatcher goes back through `pre_free`
        // without `before_release`: as it was allocated.
        let release = match family {
            Family::Malloc => Entry::Free,
            Family::New => Entry::OperatorDelete,
            Family::NewArray => Entry::OperatorDeleteArray,
        };
        CallScratch::set(S_ENTRY, release as u64);
        // The address is live again: it can no longer be a double free.
        self.recent.remove(p);
        p as *mut c_void
    }

    fn plan(&self, size: usize, offset: usize, aligned: bool) -> usize {
        CallScratch::set(S_SIZE, size as u64);
        CallScratch::set(S_OFFSET, offset as u64);
        CallScratch::set(S_ALIGNED, u64::from(aligned));
        // 0, a forced failure, for a size the size word cannot hold: the real allocator
        // would fail it too.
        if (size as u64) >> ALIGNED_AT != 0 {
            return 0;
        }
        offset.checked_add(size).and_then(|n| n.checked_add(TRAILER)).unwrap_or(0)
    }
}

impl MallocSpy for GuardSpy {
    fn pre_alloc(&self, size: usize) -> usize {
        self.plan(size, HEADER, false)
    }

    fn post_alloc(&self, actual: *mut c_void) -> *mut c_void {
        self.finish(actual)
    }

    fn pre_alloc_aligned(&self, size: usize, align: usize) -> usize {
        self.plan(size, offset_for(align), true)
    }

    fn post_alloc_aligned(&self, actual: *mut c_void, _align: usize) -> *mut c_void {
        self.finish(actual)
    }

    fn before_alloc(&self, entry: Entry) {
        CallScratch::set(S_FAMILY, Family::of(entry) as u64);
    }

    fn before_release(&self, entry: Entry, _ptr: *mut c_void, _spied: bool) {
        CallScratch::set(S_ENTRY, entry as u64);
    }

    fn pre_free(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        let p = request as usize;
        let place = releasing_in();
        if !spied {
            return if self.check_foreign(p, place) { request } else { core::ptr::null_mut() };
        }
        match self.check_spied(p, place) {
            Some(header) => {
                self.remember_freed(p, header.size);
                // SAFETY: a spied block with an intact header.
                unsafe { wipe_header(p) };
                (p - header.offset) as *mut c_void
            }
            None => core::ptr::null_mut(),
        }
    }

    fn pre_realloc(&self, request: *mut c_void, size: usize, spied: bool) -> (*mut c_void, usize) {
        // What `realloc` gives is `malloc`'s, whoever allocated the block before.
        CallScratch::set(S_FAMILY, Family::Malloc as u64);
        // None yet: a refused call leaves none for `post_realloc` to forget (an earlier
        // call's was forgotten, review helper 165).
        CallScratch::set(S_OLD, 0);
        let p = request as usize;
        let place = releasing_in();
        if !spied {
            if !self.check_foreign(p, place) {
                return (request, 0);
            }
            // An unspied block becomes spied: its bytes move up behind a header afterwards.
            // Its size is not asked for: `malloc_usable_size` trusts the pointer, and one that
            // passed these checks but is no block (a global buffer, a pointer into a block)
            // crashed it, where the real `realloc` checks and says "invalid old size". The
            // first `size` bytes move, the old ones among them (the new block holds them all).
            CallScratch::set(S_KEEP, size as u64);
            CallScratch::set(S_OLD, p as u64);
            CallScratch::set(S_OLD_SIZE, UNKNOWN_SIZE as u64);
            let total = self.plan(size, HEADER, false);
            CallScratch::set(S_OFFSET, 0);
            if total != 0 {
                self.remember_freed(p, UNKNOWN_SIZE);
            }
            return (request, total);
        }
        let Some(header) = self.check_spied(p, place) else { return (request, 0) };
        let keep = header.size.min(size);
        // offset + size + TRAILER bytes: room for the new layout, and the kept bytes, which
        // sit at `offset` in the old block, survive the real copy.
        let total = self.plan(size, header.offset, false);
        CallScratch::set(S_KEEP, keep as u64);
        CallScratch::set(S_OLD, p as u64);
        CallScratch::set(S_OLD_SIZE, header.size as u64);
        if total != 0 {
            // The real `realloc` may free the old block (put back if it fails; not called for
            // a size past what a layout can hold, which fails at once).
            // SAFETY: a spied block with an intact header.
            unsafe { wipe_header(p) };
            self.remember_freed(p, header.size);
        }
        ((p - header.offset) as *mut c_void, total)
    }

    fn post_realloc(&self, actual: *mut c_void, _spied: bool) -> *mut c_void {
        let old = CallScratch::get(S_OLD) as usize;
        if actual.is_null() {
            if old == 0 {
                return actual;
            }
            // Still the caller's: no double free.
            self.recent.remove(old);
            if CallScratch::get(S_OLD_SIZE) as usize != UNKNOWN_SIZE {
                // SAFETY: the old block is still the caller's: its header, wiped by
                // `pre_realloc`, is put back.
                unsafe { restore_header(old) };
            }
            return actual;
        }
        let from = CallScratch::get(S_OFFSET) as usize;
        let keep = CallScratch::get(S_KEEP) as usize;
        if from != HEADER {
            // SAFETY: the block holds max(from + keep, HEADER + size + TRAILER) bytes and
            // keep <= size; ptr::copy handles the overlap.
            unsafe { core::ptr::copy((actual as *const u8).add(from), (actual as *mut u8).add(HEADER), keep) };
        }
        CallScratch::set(S_OFFSET, HEADER as u64);
        // A block that stayed where it was is live again (`finish`); one that moved was
        // remembered as freed by `pre_realloc`.
        self.finish(actual)
    }

    fn pre_get_size(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        if !spied {
            // A block of ours already freed: its real block's header is the guard's, which
            // the real allocator would take for a chunk size. Measured as NULL is: 0.
            return if self.recent.get(request as usize).is_some() { core::ptr::null_mut() } else { request };
        }
        let p = request as usize;
        // SAFETY: spied blocks were laid out by this spy.
        match unsafe { read_header(p) } {
            Some(header) => {
                CallScratch::set(S_SIZE, header.size as u64);
                (p - header.offset) as *mut c_void
            }
            None => {
                // Damaged: the real allocator would read the guard's words as a chunk size
                // (and crash on some). Measured as NULL is, 0; the free reports it.
                CallScratch::set(S_SIZE, 0);
                core::ptr::null_mut()
            }
        }
    }

    fn post_get_size(&self, actual: usize, spied: bool) -> usize {
        if spied { CallScratch::get(S_SIZE) as usize } else { actual }
    }

    fn served_unspied(&self, ptr: *mut c_void) {
        // Live again, as `finish` says of the blocks it lays out.
        self.recent.remove(ptr as usize);
    }
}

/// The module of each of `frames` (see [`finding_sites::Module`]), in one walk of the
/// loader's list (free of allocations).
fn modules_of(frames: &[u64], modules: &mut [finding_sites::Module]) {
    os::each_module(|m| {
        for (&pc, module) in frames.iter().zip(modules.iter_mut()) {
            if module.0 == 0 && m.segments(0).any(|(start, end)| start <= pc && pc < end) {
                *module = (m.bias, name_hash(m.name));
            }
        }
        false
    });
}

/// The modules loaded now, as [`modules_of`] knows them.
fn loaded_modules() -> Vec<finding_sites::Module> {
    let mut loaded = Vec::new();
    os::each_module(|m| {
        loaded.push((m.bias, name_hash(m.name)));
        false
    });
    loaded
}

fn name_hash(name: &core::ffi::CStr) -> u64 {
    crate::stacks::hash_of(name.to_bytes(), u64::from)
}

/// Writes `module+0xoffset` for code address `pc`: the module's file name (the program's
/// too) and the offset that `addr2line -e` takes. Found without the symbolizer, which a hook
/// must not run (it allocates, reads files and takes locks); the exit report names the stack.
#[inline(never)]
fn write_code_place(line: &mut Line<256>, pc: u64) {
    // A longer name is cut: the line holds 256 bytes.
    let mut name = [0u8; 64];
    let mut found = None;
    os::each_module(|m| {
        if !m.segments(0).any(|(start, end)| start <= pc && pc < end) {
            return false;
        }
        let path = m.name.to_bytes();
        let base = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
        let len = base.len().min(name.len());
        name[..len].copy_from_slice(&base[..len]);
        found = Some((m.bias, len));
        true
    });
    let Some((bias, mut len)) = found else {
        let _ = write!(line, "{pc:#x}");
        return;
    };
    if len == 0 {
        // The loader names the program "": its file, as the kernel knows it.
        let mut path = [0u8; 256];
        // SAFETY: readlink writes at most `path.len()` bytes into `path`.
        let n = unsafe { libc::readlink(c"/proc/thread-self/exe".as_ptr(), path.as_mut_ptr().cast(), path.len()) };
        let path = &path[..usize::try_from(n).unwrap_or(0)];
        let base = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
        len = base.len().min(name.len());
        name[..len].copy_from_slice(&base[..len]);
    }
    let module = core::str::from_utf8(&name[..len]).unwrap_or("?");
    let _ = write!(line, "{}+{:#x}", crate::options::Escaped(module), pc.wrapping_sub(bias));
}

/// Who told a block's size or alignment at its release.
#[derive(Clone, Copy)]
enum Said {
    /// A sized or aligned `delete` of a `new` block.
    Delete,
    /// C23's `free_sized` (the size `malloc`, `calloc` or `realloc` was asked for), or
    /// `free_aligned_sized` (and the alignment `aligned_alloc` was given).
    Free,
}

/// What a release told of its block that the block's allocation contradicts, as
/// AddressSanitizer's new-delete-type-mismatch says it (the size first); `None` when they
/// agree. The alignments compare as the guard lays them out: a request of 16 or less is 16.
fn mismatch(header: &Header, told: DeleteHint, said: Said) -> Option<Line<128>> {
    let mut detail = Line::new();
    // A sized free always says a size: 0 too, which only a block of 0 bytes may be told
    // (taken as not said for a `delete`, as AddressSanitizer takes it).
    let (verb, as_what, told_size) = match said {
        Said::Delete => ("deleted", "an object", told.size),
        Said::Free => ("freed", "a block", Some(told.size.unwrap_or(0))),
    };
    if let Some(size) = told_size.filter(|&size| size != header.size) {
        let _ = write!(detail, ": {verb} as {as_what} of {size} bytes");
        return Some(detail);
    }
    // `free_sized` is for blocks of `malloc`, `calloc` and `realloc`: an aligned one's
    // alignment is not said, as a plain `delete` of an aligned `new`'s block.
    let allocated = header.aligned.then_some(header.offset);
    if allocated == told.align.map(offset_for) {
        return None;
    }
    let _ = match allocated {
        Some(HEADER) => write!(detail, ": allocated with alignment {HEADER} or less"),
        Some(align) => write!(detail, ": allocated with alignment {align}"),
        None => write!(detail, ": allocated default-aligned"),
    };
    let _ = match told.align {
        Some(align) => write!(detail, ", {verb} with alignment {align}"),
        None => write!(detail, ", {verb} default-aligned"),
    };
    Some(detail)
}

/// The entry point that is giving a block back ([`GuardSpy::before_release`] noted it).
fn releasing_entry() -> Entry {
    match Entry::from_index(CallScratch::get(S_ENTRY) as u8) {
        e @ (Entry::Realloc
        | Entry::Reallocarray
        | Entry::OperatorDelete
        | Entry::OperatorDeleteArray
        | Entry::FreeSized
        | Entry::FreeAlignedSized) => e,
        _ => Entry::Free,
    }
}

/// The entry point that is giving a block back, as findings name it.
fn releasing_in() -> &'static str {
    releasing_entry().name()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A freed block is remembered for a lap of the ring and then forgotten, also where threads
    /// left most of their chunks unused (each of them exited after one free): those places
    /// kept what a lap before had put there, and it was never forgotten (an evicted pointer
    /// was forgotten only if its record was exactly one lap old).
    #[test]
    fn a_freed_block_is_remembered_for_a_lap_of_the_ring_and_then_forgotten() {
        let guard = GuardSpy::new(true, true).unwrap();
        let block = |lap: usize, i: usize| 0x10_0000_0000 + (lap << 24) + i * 16;
        let free_all = |lap: usize, n: usize| {
            let _hook = crate::dispatch::Scope::enter().unwrap();
            (0..n).for_each(|i| guard.remember_freed(block(lap, i), 32));
        };
        free_all(0, RECENT);
        // Threads that free one block each, all alive at once, each in its own slot (those
        // that came while no more than CHUNKED_THREADS had slots each take a chunk).
        let threads = 100;
        let all_in = std::sync::Barrier::new(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                let (all_in, guard) = (&all_in, &guard);
                s.spawn(move || {
                    all_in.wait();
                    let _hook = crate::dispatch::Scope::enter().unwrap();
                    guard.remember_freed(block(1, t), 32);
                });
            }
        });
        assert!((0..threads).all(|t| guard.recent.get(block(1, t)).is_some()));
        free_all(2, 2 * RECENT);
        let remembered = |lap: usize, n: usize| (0..n).filter(|&i| guard.recent.get(block(lap, i)).is_some()).count();
        assert_eq!((remembered(0, RECENT), remembered(1, threads)), (0, 0), "forgotten after a lap");
        assert_eq!(remembered(2, 2 * RECENT), RECENT, "the last lap's frees remembered");
        assert!((RECENT..2 * RECENT).all(|i| guard.recent.get(block(2, i)).is_some()));
        assert_eq!(guard.recent.len(), RECENT);
    }

    /// A `realloc` that moves its block remembers the old pointer before the real call frees
    /// it: remembered after, it was remembered over the block another thread had meanwhile
    /// been given at the same place (review helper 161). One that fails leaves it live.
    #[test]
    fn a_moved_block_is_remembered_as_freed_before_another_thread_can_be_given_its_place() {
        let guard = GuardSpy::new(true, true).unwrap();
        let mut memory = vec![0u64; 256];
        let old_real = (memory.as_mut_ptr() as usize).next_multiple_of(64);
        let new_real = old_real + 1024;
        let allocate_at = |real: usize| {
            assert!(guard.pre_alloc(40) <= 1024);
            guard.post_alloc(real as *mut c_void) as usize
        };
        let _hook = crate::dispatch::Scope::enter().unwrap();
        let old = allocate_at(old_real);
        guard.before_release(Entry::Realloc, old as *mut c_void, true);
        let (real, total) = guard.pre_realloc(old as *mut c_void, 100, true);
        assert_eq!((real as usize, total != 0), (old_real, true));
        // The real `realloc` moved the block, and another thread was given the old one.
        let reused = std::thread::scope(|s| {
            s.spawn(|| {
                let _hook = crate::dispatch::Scope::enter().unwrap();
                allocate_at(old_real)
            })
            .join()
            .unwrap()
        });
        assert_eq!(reused, old);
        let new = guard.post_realloc(new_real as *mut c_void, true) as usize;
        assert_eq!(new, new_real + HEADER);
        assert!(guard.recent.get(old).is_none(), "the other thread's live block taken for a freed one");

        // A failed realloc: the block stays the caller's, with its header.
        guard.before_release(Entry::Realloc, new as *mut c_void, true);
        guard.pre_realloc(new as *mut c_void, 200, true);
        assert!(guard.recent.get(new).is_some(), "remembered while the real realloc runs");
        assert!(guard.post_realloc(core::ptr::null_mut(), true).is_null());
        assert!(guard.recent.get(new).is_none());
        // SAFETY: `new` is a block laid out by the guard in `memory`.
        assert_eq!(unsafe { read_header(new) }.map(|h| h.size), Some(100));

        // A refused realloc to 0 (of a pointer no block starts at), which a heap whose
        // realloc(p, 0) does not free still runs, forgets nothing when it fails: it forgot the
        // block of the call before.
        guard.before_release(Entry::Realloc, new as *mut c_void, true);
        guard.pre_realloc(new as *mut c_void, 100, true);
        let third = guard.post_realloc((old_real + 1536) as *mut c_void, true) as usize;
        assert!(guard.recent.get(new).is_some() && third != new);
        guard.before_release(Entry::Realloc, (third + 1) as *mut c_void, false);
        assert_eq!(guard.pre_realloc((third + 1) as *mut c_void, 0, false).1, 0);
        guard.post_realloc(core::ptr::null_mut(), false);
        assert!(guard.recent.get(new).is_some(), "the block moved before forgotten");
    }

    #[test]
    fn offsets_follow_alignment() {
        assert_eq!(offset_for(0), 16);
        assert_eq!(offset_for(8), 16);
        assert_eq!(offset_for(64), 64);
        assert_eq!(offset_for(48), 64);
        // Above 2 GiB too: memalign(4 GiB, 16) was served unspied, with a message blaming
        // the spy for a misaligned pointer.
        assert_eq!(offset_for(1 << 32), 1 << 32);
        assert_eq!(offset_for(usize::MAX), 16);
    }

    /// What [`mismatch`] says of a block of `size` laid out at `offset` (`aligned`: by the
    /// memalign family), released by `said`, told `told`.
    fn said_of(
        said: Said,
        family: Family,
        size: usize,
        offset: usize,
        aligned: bool,
        told: DeleteHint,
    ) -> Option<String> {
        let header = Header { size, offset, family, aligned };
        mismatch(&header, told, said).map(|mut line| String::from_utf8(line.as_bytes().to_vec()).unwrap())
    }

    fn told(size: Option<usize>, align: Option<usize>) -> DeleteHint {
        DeleteHint { size, align }
    }

    #[test]
    fn a_delete_that_says_another_size_or_alignment_is_a_type_mismatch() {
        let said = |size, offset, aligned, told| said_of(Said::Delete, Family::New, size, offset, aligned, told);
        assert_eq!(said(64, 16, false, told(Some(64), None)), None);
        assert_eq!(said(64, 16, false, told(None, None)), None);
        assert_eq!(said(64, 16, false, told(Some(8), None)).unwrap(), ": deleted as an object of 8 bytes");
        // The size first, then the alignment.
        assert_eq!(said(64, 128, true, told(Some(8), Some(256))).unwrap(), ": deleted as an object of 8 bytes");
        assert_eq!(
            said(64, 128, true, told(Some(64), Some(256))).unwrap(),
            ": allocated with alignment 128, deleted with alignment 256"
        );
        assert_eq!(
            said(100, 64, true, told(None, None)).unwrap(),
            ": allocated with alignment 64, deleted default-aligned"
        );
        assert_eq!(
            said(48, 16, false, told(None, Some(64))).unwrap(),
            ": allocated default-aligned, deleted with alignment 64"
        );
        // Alignments of 16 and less are all laid out at 16: an aligned new of 8 deleted with 16 agrees.
        assert_eq!(said(24, 16, true, told(None, Some(8))), None);
        assert_eq!(said(24, 16, true, told(None, Some(16))), None);
        assert_eq!(
            said(24, 16, true, told(None, None)).unwrap(),
            ": allocated with alignment 16 or less, deleted default-aligned"
        );
        assert_eq!(said(64, 64, true, told(Some(64), Some(64))), None);
    }

    #[test]
    fn a_sized_free_that_says_another_size_or_alignment_is_a_size_mismatch() {
        let said = |size, offset, aligned, told| said_of(Said::Free, Family::Malloc, size, offset, aligned, told);
        assert_eq!(said(100, 16, false, told(Some(100), None)), None);
        assert_eq!(said(100, 16, false, told(Some(64), None)).unwrap(), ": freed as a block of 64 bytes");
        // 0 is a size (the hint takes it as unsaid): right for a block of 0 bytes only.
        assert_eq!(said(0, 16, false, told(None, None)), None);
        assert_eq!(said(10, 16, false, told(None, None)).unwrap(), ": freed as a block of 0 bytes");
        assert_eq!(said(128, 64, true, told(Some(128), Some(64))), None);
        assert_eq!(
            said(128, 64, true, told(Some(128), None)).unwrap(),
            ": allocated with alignment 64, freed default-aligned"
        );
        assert_eq!(
            said(48, 16, false, told(Some(48), Some(64))).unwrap(),
            ": allocated default-aligned, freed with alignment 64"
        );
    }

    #[test]
    fn header_round_trip_and_damage() {
        let mut buf = vec![0u64; 16];
        let p = buf.as_mut_ptr() as usize + 16;
        // SAFETY: buf holds 128 bytes: 16 before p, 48 + 8 after.
        unsafe {
            lay_out(p, 40, 16, Family::Malloc, false);
            let h = read_header(p).unwrap();
            assert_eq!((h.size, h.offset, h.family), (40, 16, Family::Malloc));
            lay_out(p, 40, 16, Family::NewArray, true);
            let h = read_header(p).unwrap();
            assert_eq!((h.size, h.offset, h.family, h.aligned), (40, 16, Family::NewArray, true));
            lay_out(p, 40, 16, Family::Malloc, false);
            assert!(trailer_intact(p, 40));
            *(p as *mut u8).add(40) ^= 1;
            assert!(!trailer_intact(p, 40));
            *(p as *mut u8).sub(1) ^= 0x80;
            assert!(read_header(p).is_none());
        }
    }

    /// A zero, a byte of text, 0xff or any odd byte written into the tag or the trailer is seen
    /// whatever the block's address: before, a write that found its own value in place went
    /// unseen.
    #[test]
    fn text_and_zeros_over_a_canary_are_always_seen() {
        let mut buf = vec![0u64; 64];
        let base = (buf.as_mut_ptr() as usize).next_multiple_of(16);
        for block in 0..20_000usize {
            // Addresses of blocks spread over the address space, as many as the hash sees.
            let p = (block.wrapping_mul(0x9E37_79B9_7F4A_7C15) & 0x7fff_ffff_fff0) | 0x10;
            let (tag_bytes, trailer_bytes) =
                (tag(p, size_word(40, 16, Family::Malloc, false)).to_le_bytes(), trailer(p).to_le_bytes());
            for value in (0..0x80u8).chain((0x81..=0xff).step_by(2)) {
                assert!(!tag_bytes.contains(&value) && !trailer_bytes.contains(&value), "{value:#x} at {p:#x}");
            }
        }
        // And through the checks themselves, at a real block.
        let p = base + 16;
        for value in [0u8, b'u', b'n', b'.', 0xff] {
            // SAFETY: buf holds 512 bytes; p lies 16 to 24 bytes into it, and the block needs
            // 16 bytes before p and 48 after.
            unsafe {
                lay_out(p, 40, 16, Family::Malloc, false);
                *(p as *mut u8).add(40) = value;
                assert!(!trailer_intact(p, 40), "{value:#x} after the block");
                lay_out(p, 40, 16, Family::Malloc, false);
                *(p as *mut u8).sub(1) = value;
                assert!(read_header(p).is_none(), "{value:#x} before the block");
            }
        }
    }

    /// Any byte of the header changed, to zero or to another value, is seen: the size too,
    /// which is not trusted before the tag vouches for it.
    #[test]
    fn every_header_byte_is_checked() {
        let mut buf = vec![0u64; 1536];
        let base = buf.as_mut_ptr() as usize;
        for offset in [16, 64, 4096] {
            let p = (base + offset).next_multiple_of(offset);
            for byte in 1..=HEADER {
                for value in [0u8, 0x7f, 0xff] {
                    // SAFETY: buf holds 12,288 bytes; p is at least `offset` and less than
                    // 2 * 4096 bytes into it, and the block needs 16 bytes before p and 48 after.
                    unsafe {
                        lay_out(p, 40, offset, Family::Malloc, false);
                        assert_eq!(read_header(p).map(|h| (h.size, h.offset)), Some((40, offset)));
                        let at = (p as *mut u8).sub(byte);
                        if *at == value {
                            continue;
                        }
                        *at = value;
                        assert!(read_header(p).is_none(), "byte p-{byte} set to {value:#x}, offset {offset}");
                    }
                }
            }
        }
    }
}
