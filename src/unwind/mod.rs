//! Call stacks for the hook path: raw return addresses, captured in place, no allocation on
//! the common path.
//!
//! libgcc's `_Unwind_Backtrace` costs about 90 ns a frame here (1.8 us for 20 frames); a
//! frame-pointer walk costs 2 ns a frame but Debian's libraries are built without frame
//! pointers, so it stops in the first libc or libsqlite3 frame. This unwinder follows the
//! DWARF CFI that every module carries (`.eh_frame`), with each return address's rule
//! computed once and cached ([`rules`]): after warm-up a frame costs a cache probe and two
//! loads, whatever the code was compiled with. Every stack read is bounds-checked against
//! the thread's stack, so a wrong rule ends the stack instead of faulting.

mod bounds;
mod modules;
mod rules;

pub(crate) use bounds::{kernel_finds_stacks, note_thread_start, stack_bounds};

use crate::tls;

/// Most frames to walk (the deepest `stack_depth` plus mallocspy's own frames on top).
pub(crate) const MAX_WALK: usize = 160;

/// What a thread keeps between walks: its previous walk and the rules it used last.
pub(crate) struct WalkCache {
    prev: PrevWalk,
    rules: rules::Recent,
}

impl WalkCache {
    /// An empty cache. Zeroed memory is one too.
    #[cfg(test)]
    pub(crate) const fn new() -> Self {
        Self { prev: PrevWalk::new(), rules: rules::Recent::new() }
    }
}

/// The previous walk of a thread: where each frame's CFA was, and the values read there.
///
/// Consecutive allocations mostly share everything below their last few frames. A walk is a
/// deterministic function of the registers it starts from and the stack words it reads, so
/// once a new walk reaches a frame with the same CFA, return address and RBP as a frame of
/// the previous walk, and every word the previous walk read below that frame still holds the
/// same value, the rest of the walk would repeat the previous one: it is copied instead.
/// Checking those words is a row of independent loads, where walking them is a chain of
/// dependent ones (about 7 ns a frame).
///
/// Two arrays take turns: the new walk writes one while the previous walk stays whole in
/// the other, so a walk that is deeper than the previous one (more frames before the part
/// they share) can still take its tail.
struct PrevWalk {
    /// The thread that made the walk ([`tls::thread_key`]): the cache belongs to a thread
    /// record, which a new thread may take over, with its stack elsewhere.
    walker: usize,
    len: usize,
    /// The walk ran out of `out` (not to the end of the stack).
    truncated: bool,
    /// It was cut short for want of stack to compute a rule, or at a signal's frame it could
    /// not read ([`Step::Later`]).
    cut: bool,
    generation: u32,
    /// Which of `frames` holds the previous walk.
    side: usize,
    frames: [[Frame; MAX_WALK]; 2],
}

impl PrevWalk {
    /// The previous walk's frames, and the array the next walk writes.
    fn split(&mut self) -> (&[Frame], &mut [Frame; MAX_WALK]) {
        let [a, b] = &mut self.frames;
        if self.side == 0 { (&a[..self.len], b) } else { (&b[..self.len], a) }
    }

    /// The previous walk's frames.
    fn last(&self) -> &[Frame] {
        &self.frames[self.side][..self.len]
    }

    /// Forgets the previous walk: the next one starts from scratch.
    fn forget(&mut self) {
        self.len = 0;
        self.cut = false;
    }
}

/// One frame of a walk: what was read, and where.
#[derive(Clone, Copy)]
struct Frame {
    cfa: u64,
    /// The return address (read at `cfa - 8`).
    ra: u64,
    /// RBP after the frame.
    bp: u64,
    /// Where that RBP was read from (0: unchanged by the frame).
    bp_slot: u64,
    /// Whether the frame's CFA was computed from RBP (as it was before the frame).
    rbp_rule: bool,
    /// Whether the frame is one a signal interrupted, its registers read from the `ucontext`
    /// below it ([`signal_frame`]) rather than at its CFA.
    signal: bool,
}

/// The calling thread's stack pointer.
#[inline(always)]
pub(crate) fn current_sp() -> u64 {
    let sp: u64;
    // SAFETY: reads a register.
    unsafe { core::arch::asm!("mov {}, rsp", out(reg) sp, options(nomem, nostack, preserves_flags)) };
    sp
}

/// Where a walk starts: a frame's registers, and whether `pc` is a return address (to be
/// reported, and looked up one byte back) or the current instruction.
#[derive(Clone, Copy)]
struct Start {
    pc: u64,
    sp: u64,
    bp: u64,
    is_return: bool,
}

/// The start of the call stack of the top-level hook in progress, as registers (pc, sp, bp):
/// the return address its caller will return to (the trampoline of the exported function
/// noted where that is), and the stack and frame pointers there. `None` when the entry is not
/// known.
#[inline(always)]
pub(crate) fn hook_start() -> Option<(u64, u64, u64)> {
    let ts = tls::state();
    let entry = ts.hook_sp.get();
    let (_, high) = stack_bounds();
    let here = current_sp();
    // On the thread's stack, or close above this frame on another one (a signal handler's
    // alternate stack, a coroutine's), where the export's caller pushed it.
    if !entry.is_multiple_of(8) || entry <= here || (entry + 8 > high && entry - here > OTHER_STACK_ENTRY) {
        return None;
    }
    // SAFETY: entry lies between this frame and the top of the thread's stack, or close above
    // this frame on the same stack, where the caller's call pushed it: mapped.
    let ra = unsafe { *(entry as *const u64) };
    Some((ra, entry + 8, ts.hook_bp.get()))
}

/// How far above a hook's frame its entry may lie on a stack other than the thread's.
const OTHER_STACK_ENTRY: u64 = 1 << 20;

/// Where the calling thread's own stack resumes above `start` (pc, sp, bp of a frame in
/// progress) when that frame runs on its alternate signal stack: see [`resumes_off`]. The
/// leak check's roots start there too: a report made on an alternate stack (an `exit` in such
/// a handler, an ending signal that struck one) scanned that stack alone, and a block only
/// `main`'s frame held was "definitely lost" (review helper 74). `None` when `start` is not on
/// the alternate stack, or no signal's frame leads off it.
pub(crate) fn own_stack_resumes_at(start: (u64, u64, u64)) -> Option<u64> {
    // Not `stack_bounds`: a report runs on a spare stack (`spare_stack.rs`), which they are
    // then.
    resumes_off(start, configured_alternate_stack()?)
}

/// Where a thread's own stack resumes above `start` (pc, sp, bp of a frame in progress, of
/// the calling thread or of one stopped for a leak check) when that frame runs on `stack`, a
/// stack not its own such as an alternate signal stack: the stack pointer the signal
/// interrupted, found by walking out through the handler's frames to the signal's. `None`
/// when `start` is not on `stack`, or no signal's frame leads off it.
pub(crate) fn resumes_off(start: (u64, u64, u64), stack: (u64, u64)) -> Option<u64> {
    let (mut pc, mut sp, mut bp) = start;
    let (low, high) = stack;
    if !(low..high).contains(&sp) {
        return None;
    }
    let read = stack_reader(sp, high);
    let rules = rules::Rules::new();
    let mut recent = rules::Recent::new();
    for walked in 0..MAX_WALK {
        // The start is a frame in progress; every later pc a return address.
        let lookup = if walked == 0 { pc } else { pc - 1 };
        let Step::Caller(frame) = step(&rules, &mut recent, lookup, sp, bp, &read, false) else { return None };
        // A signal that struck a handler on the same stack leads on within it.
        if frame.signal && !(low..high).contains(&frame.cfa) {
            return Some(frame.cfa);
        }
        (pc, sp, bp) = (frame.ra, frame.cfa, frame.bp);
    }
    None
}

/// The extent of the calling thread's alternate signal stack, whether or not it runs on it.
fn configured_alternate_stack() -> Option<(u64, u64)> {
    // SAFETY: zero is a valid stack_t; a query (no new stack) writes only `now`.
    let mut now: libc::stack_t = unsafe { core::mem::zeroed() };
    // SAFETY: as above.
    let set = unsafe { libc::sigaltstack(core::ptr::null(), &mut now) } == 0 && now.ss_flags & libc::SS_DISABLE == 0;
    set.then(|| (now.ss_sp as u64, now.ss_sp as u64 + now.ss_size as u64))
}

/// The extent of the alternate signal stack (`sigaltstack`) the calling thread runs on, if
/// it runs on one.
pub(super) fn alternate_stack() -> Option<(u64, u64)> {
    // SAFETY: zero is a valid stack_t; a query (no new stack) writes only `now`.
    let mut now: libc::stack_t = unsafe { core::mem::zeroed() };
    // SAFETY: as above.
    let on = unsafe { libc::sigaltstack(core::ptr::null(), &mut now) } == 0 && now.ss_flags & libc::SS_ONSTACK != 0;
    on.then(|| (now.ss_sp as u64, now.ss_sp as u64 + now.ss_size as u64))
}

/// A walk that starts on a stack other than the thread's: a signal handler's alternate stack
/// is walked within its extent to the signal's frame, and from there on the thread's own stack
/// (where the signal struck); of any other (a coroutine's), whose extent is unknown, only the
/// caller's return address is taken.
/// Without the walk cache, as [`capture_uncached`]. Such stacks had no frame at all (review
/// helper 66).
#[cold]
#[inline(never)]
fn walk_other_stack(out: &mut [u64], start: Start) -> usize {
    let Start { pc, sp, bp, is_return } = start;
    if out.is_empty() || pc == 0 || !is_return {
        return 0;
    }
    // Not on a small alternate stack, which the walk's own rule cache would overflow.
    if stack_room() < UNCACHED_WALK_ROOM {
        out[0] = pc;
        return 1;
    }
    capture_uncached(out, (pc, sp, bp))
}

/// Fills `out` with the return addresses of the stack that starts at `start` (from
/// [`hook_start`]), innermost first, starting with `start`'s own. Returns how many. `cache`
/// is the calling thread's walk cache (a walk may reuse the previous walk's tail).
///
/// Never allocates once the unwind rules of the addresses involved are cached.
#[inline(never)]
pub(crate) fn capture(out: &mut [u64], start: (u64, u64, u64), cache: &mut WalkCache) -> usize {
    let (pc, sp, bp) = start;
    walk(out, Start { pc, sp, bp, is_return: true }, cache)
}

/// Bytes of the stack the calling thread runs on left below this frame; 0 when its extent is
/// unknown (a coroutine's).
#[inline(always)]
pub(crate) fn stack_room() -> u64 {
    current_stack().map_or(0, |(low, _)| current_sp() - low)
}

/// Bytes of the calling thread's own stack left below this frame; 0 when the frame is on
/// another one (a signal handler's alternate stack, a coroutine's). The reports, whose walks
/// take the thread's stack for the one they run on, run on a mapping of their own then.
#[inline(always)]
pub(crate) fn thread_stack_room() -> u64 {
    let (low, high) = stack_bounds();
    let sp = current_sp();
    if (low..high).contains(&sp) { sp - low } else { 0 }
}

/// The extent of the stack the calling thread runs on: its own, or the alternate signal stack
/// it is on; `None` on any other (a coroutine's).
#[inline(always)]
fn current_stack() -> Option<(u64, u64)> {
    let (low, high) = stack_bounds();
    let sp = current_sp();
    if (low..high).contains(&sp) {
        return Some((low, high));
    }
    alternate_stack().filter(|&(bottom, top)| (bottom..top).contains(&sp))
}

/// Stack that [`capture_uncached`] needs below its caller's frame (its rule cache is 8 KiB).
pub(crate) const UNCACHED_WALK_ROOM: u64 = 16 << 10;

/// [`capture`] without a thread's walk cache, for a stack wanted seldom (where a finding of
/// the guard was made, or on a stack other than the thread's): the rules come from the shared
/// table, as [`walk_out`] takes them. Out of line: its rule cache (8 KiB) is on the stack only
/// while it runs; its caller makes sure of [`UNCACHED_WALK_ROOM`].
#[inline(never)]
pub(crate) fn capture_uncached(out: &mut [u64], start: (u64, u64, u64)) -> usize {
    let Some(first) = out.first_mut() else { return 0 };
    let (mut pc, mut sp, mut bp) = start;
    *first = pc;
    let Some((_, high)) = current_stack() else { return 1 };
    let bounds = core::cell::Cell::new((current_sp(), high));
    let read = |addr: u64| {
        let (low, high) = bounds.get();
        stack_reader(low, high)(addr)
    };
    let rules = rules::Rules::new();
    let mut recent = rules::Recent::new();
    let mut n = 1;
    while n < out.len() {
        // Every pc here is a return address: its call is a byte before it.
        let Step::Caller(frame) = step(&rules, &mut recent, pc - 1, sp, bp, &read, false) else { break };
        // From a handler on an alternate signal stack to the code the signal interrupted, on
        // the thread's own stack: the walk reads that stack from there on.
        let (own_low, own_high) = stack_bounds();
        if frame.signal && read(frame.cfa).is_none() && (own_low..own_high).contains(&frame.cfa) {
            bounds.set((frame.cfa, own_high));
        }
        (pc, sp, bp) = (frame.ra, frame.cfa, frame.bp);
        out[n] = pc;
        n += 1;
    }
    n
}

/// How [`walk_out`] ended.
#[derive(Debug, PartialEq)]
pub(crate) enum WalkOut {
    /// `visit` answered this.
    Answer(u64),
    /// The frame at `pc`, whose stack pointer is `sp`, has no rule to go further: the
    /// outermost frame (a thread's start, `_start`), or one this unwinder cannot follow (code
    /// without unwind tables), or a signal trampoline (not followed here).
    Ends { pc: u64, sp: u64 },
    /// The stack could not be read further.
    Lost,
}

/// Walks the calling thread's stack outward from `start`, a frame in progress (`pc` its
/// current instruction, with its `sp` and `bp`), calling `visit(pc, sp)` for each frame
/// further out: a return address, and the stack pointer its function had at the call (its
/// frame's live words start there). For the leak check: the rules come from the shared table
/// as a hook's walk takes them (without locks), not from the walk cache.
pub(crate) fn walk_out(start: (u64, u64, u64), mut visit: impl FnMut(u64, u64) -> Option<u64>) -> WalkOut {
    let (mut pc, mut sp, mut bp) = start;
    let read = stack_reader(current_sp(), stack_bounds().1);
    let rules = rules::Rules::new();
    let mut recent = rules::Recent::new();
    let mut first = true;
    for _ in 0..MAX_WALK {
        let frame = match step(&rules, &mut recent, if first { pc } else { pc - 1 }, sp, bp, &read, false) {
            // Everything the signal interrupted is live, from the registers the kernel saved
            // (the only copy of a pointer held in a register) outward: the walk ends there.
            Step::Caller(frame) if !frame.signal => frame,
            Step::Caller(_) | Step::NoRule => return WalkOut::Ends { pc, sp },
            Step::Broken | Step::Later => return WalkOut::Lost,
        };
        (pc, sp, bp, first) = (frame.ra, frame.cfa, frame.bp, false);
        if let Some(answer) = visit(pc, sp) {
            return WalkOut::Answer(answer);
        }
    }
    WalkOut::Lost
}

/// Reads a word of a stack (the calling thread's, or a stopped thread's) between `low` (at or
/// below its stack pointer) and `high` (its end): `None` outside, or unaligned.
#[inline(always)]
fn stack_reader(low: u64, high: u64) -> impl Fn(u64) -> Option<u64> {
    move |addr: u64| {
        // SAFETY: inside [low, high) of a stack that the calling thread runs on, or that a
        // thread stopped for a leak check left, mapped until it runs again.
        (addr >= low && addr.wrapping_add(8) <= high && addr.is_multiple_of(8))
            .then(|| unsafe { *(addr as *const u64) })
    }
}

/// One step of a walk outward, from a frame whose code is at `lookup` (its pc; a return
/// address less one, the call itself) and whose registers were `sp` and `bp`.
enum Step {
    /// The caller's frame: its return address, its CFA and the RBP it has.
    Caller(Frame),
    /// No rule goes further: the outermost frame, or code this unwinder cannot follow.
    NoRule,
    /// The rule leads nowhere readable: a CFA that does not grow, a word outside the stack,
    /// a null return address.
    Broken,
    /// The rule is not known yet, and the thread has too little stack left to compute it; or
    /// a signal's frame could not be read: the walk is cut short this time, not ended (its
    /// stack is not taken for its start's whole one).
    Later,
}

#[inline(always)]
fn step(
    rules: &rules::Rules,
    recent: &mut rules::Recent,
    lookup: u64,
    sp: u64,
    bp: u64,
    read: &impl Fn(u64) -> Option<u64>,
    frame_pointers: bool,
) -> Step {
    let (cfa, saved_bp, rbp_rule) = match rules.get(recent, lookup) {
        rules::Rule::Rsp { cfa, rbp } => (sp.wrapping_add(cfa as u64), rbp, false),
        rules::Rule::Rbp { cfa, rbp } => (bp.wrapping_add(cfa as u64), rbp, true),
        rules::Rule::Stop => return Step::NoRule,
        // Code that no unwind table covers (built with frame pointers but
        // `-fno-asynchronous-unwind-tables`: its stacks ended at its first frame, review helper
        // 66), followed by the frame pointer if `frame_pointers`: CFA = RBP + 16, the caller's
        // RBP at CFA - 16. Code without a frame pointer may leave anything in RBP: a walk
        // through it may then read a frame or two that are not (as libunwind's and valgrind's
        // do), and ends where RBP leaves the stack. Not for the leak check's walks, which must
        // not guess.
        rules::Rule::NoTable if frame_pointers => (bp.wrapping_add(16), 16, true),
        rules::Rule::NoTable => return Step::NoRule,
        rules::Rule::Later => return Step::Later,
        rules::Rule::Signal => return signal_frame(sp, read),
    };
    if cfa <= sp {
        return Step::Broken;
    }
    let Some(ra) = read(cfa - 8).filter(|&ra| ra != 0) else { return Step::Broken };
    let (mut bp, mut bp_slot) = (bp, 0);
    if saved_bp != 0 {
        bp_slot = cfa - saved_bp as u64;
        let Some(saved) = read(bp_slot) else { return Step::Broken };
        bp = saved;
    }
    Step::Caller(Frame { cfa, ra, bp, bp_slot, rbp_rule, signal: false })
}

/// Where the interrupted code's RBP, RSP and RIP lie above a signal trampoline's stack
/// pointer: the kernel's `struct rt_sigframe` starts with the return address into the
/// trampoline (popped by the handler's return), then the `ucontext`, whose `uc_mcontext`
/// (after `uc_flags`, `uc_link` and `uc_stack`: 40 bytes) starts with R8-R15, RDI, RSI, RBP,
/// RBX, RDX, RAX, RCX, RSP and RIP.
const UC_RBP: u64 = 40 + 10 * 8;
const UC_RSP: u64 = 40 + 15 * 8;
const UC_RIP: u64 = 40 + 16 * 8;

/// Whether `ra`, a return address of a captured stack, is a signal trampoline's: the frame a
/// handler returns to, which the reports name as gdb does ([`SIGNAL_FRAME`]). Computes the
/// rule if it is not known: not for the hook path.
pub(crate) fn is_signal_return(ra: u64) -> bool {
    ra != 0 && rules::lookup(ra - 1) == rules::Rule::Signal
}

/// The name of a signal trampoline's frame in the reports.
pub(crate) const SIGNAL_FRAME: &str = "<signal handler called>";

pub(crate) use rules::is_signal_trampoline_in;

/// The frame a signal interrupted, from the `ucontext` at `ctx`, the stack pointer of the
/// signal trampoline that the handler returns to. Its pc is where the signal struck, not a
/// return address: it is given one byte on, so that the walk's look-up of "the call, a byte
/// before the return address" and the symbolizer's land on the instruction itself (as
/// libunwind does for a signal frame). Stacks ended at the trampoline, named `??` (as valgrind
/// and heaptrack go on to the code that was interrupted, and to its callers).
#[cold]
fn signal_frame(ctx: u64, read: &impl Fn(u64) -> Option<u64>) -> Step {
    // Cut short rather than ended: the words that ended it are the `ucontext`'s, which no
    // record of the walk's words holds, so a later walk from the same start might go further
    // (a handler's first stack, ended here, was taken for its later ones: review helper 74).
    let (Some(bp), Some(sp), Some(pc)) = (read(ctx + UC_RBP), read(ctx + UC_RSP), read(ctx + UC_RIP)) else {
        return Step::Later;
    };
    // No check that the interrupted code's frames lie above the handler's, as a caller's do
    // above its callee's: on an alternate signal stack the handler's may lie anywhere (a
    // buffer in `main`'s frame puts them above), and a walk is bounded in frames anyway.
    if pc == 0 || pc == u64::MAX {
        return Step::Later;
    }
    Step::Caller(Frame { cfa: sp, ra: pc + 1, bp, bp_slot: ctx + UC_RBP, rbp_rule: false, signal: true })
}

impl WalkCache {
    /// Whether the last walk was cut short for want of stack: its stack is not to be taken
    /// for the whole one of its start.
    pub(crate) fn cut_short(&self) -> bool {
        self.prev.cut
    }
}

/// Forgets the last walk (the hook's stack could not be walked).
pub(crate) fn no_walk(cache: &mut WalkCache) {
    cache.prev.forget();
}

/// Most stack words a [`WalkWords`] records: a return address and a saved frame pointer for
/// each of 32 frames.
const WORDS: usize = 64;

/// The stack words a walk read, where it read them (as offsets above its start's stack
/// pointer) and the hash of their values. A walk is a function of its start and of the words
/// it reads: while they hold, a walk from the same start, at the same depth, by the same
/// thread with the same modules, gives the same frames again. Of the saved frame pointers it
/// read, only those a CFA was then computed from count ([`Frame::rbp_rule`]): code built
/// without frame pointers saves RBP as an ordinary register, whose value changes from call to
/// call without changing the walk. Words are known by their hash, as stacks are
/// ([`crate::stacks::hash`]). Zero is the empty record. `repr(C)`, the offsets last: a check
/// reads only as many as the walk read words.
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct WalkWords {
    /// 0 for the empty record.
    hash: u64,
    /// The thread that walked ([`tls::thread_key`]; a thread record may be taken over by a
    /// new thread, with its stack elsewhere).
    walker: usize,
    /// The module list generation the walk's rules came from.
    generation: u32,
    len: u16,
    offsets: [u16; WORDS],
}

/// The hash of the words at `offsets` above `sp`, as [`crate::stacks::hash`] would give it.
///
/// # Safety
///
/// Every `sp + offset` must be a word of the calling thread's stack between its current
/// stack pointer and its top.
#[inline(always)]
unsafe fn hash_at(sp: u64, offsets: &[u16]) -> u64 {
    // SAFETY: the caller's contract.
    crate::stacks::hash_of(offsets, |o| unsafe { *((sp + u64::from(o)) as *const u64) })
}

impl WalkWords {
    /// Whether every word recorded still holds its value, read by the thread that recorded
    /// them with the same modules; `false` for an empty record.
    #[inline]
    pub(crate) fn hold(&self, sp: u64) -> bool {
        self.hash != 0
            && self.walker == tls::thread_key()
            && self.generation == rules::Rules::new().generation()
            // SAFETY: recorded by this thread (checked above) at words its walk read inside
            // its own stack above `sp`, the stack pointer of a hook's start, which is above
            // this frame: the stack between stays mapped while the thread lives.
            && unsafe { hash_at(sp, &self.offsets[..(self.len as usize).min(WORDS)]) } == self.hash
    }
}

impl WalkCache {
    /// Records in `words` what the last walk read, relative to `sp`, the stack pointer of its
    /// start (of the frame pointers, those a CFA was computed from); an empty record when it
    /// read more than a record holds, or farther than 64 KiB above `sp`.
    pub(crate) fn last_walk_words(&self, sp: u64, words: &mut WalkWords) {
        let frames = self.prev.last();
        words.hash = 0;
        if frames.is_empty() || frames.len() * 2 > WORDS || self.prev.walker != tls::thread_key() {
            return;
        }
        let (mut n, mut far) = (0, 0);
        // Where RBP was last restored from, and whether that word is recorded already.
        let (mut slot, mut slot_recorded) = (0u64, true);
        for f in frames {
            // A frame a signal interrupted depends on words of its `ucontext` that are not
            // recorded: no record (allocations in signal handlers are few).
            if f.signal {
                return;
            }
            // A CFA taken from RBP depends on the word RBP was last restored from (or on RBP
            // at the start, which is part of the start); the other saved values of RBP are
            // read, but the walk does not depend on them.
            if f.rbp_rule && !slot_recorded {
                let o = slot.wrapping_sub(sp);
                far |= o;
                words.offsets[n] = o as u16;
                n += 1;
                slot_recorded = true;
            }
            let o = (f.cfa - 8).wrapping_sub(sp);
            far |= o;
            words.offsets[n] = o as u16;
            n += 1;
            if f.bp_slot != 0 {
                (slot, slot_recorded) = (f.bp_slot, false);
            }
        }
        if far >> 16 != 0 {
            return;
        }
        words.len = n as u16;
        words.walker = self.prev.walker;
        words.generation = self.prev.generation;
        // SAFETY: the words this thread's walk just read, above `sp` (checked by `far`), in
        // its stack.
        words.hash = unsafe { hash_at(sp, &words.offsets[..n]) };
    }
}

/// Copies into `new` the frames `tail` of a previous walk, which followed a frame where this
/// walk now stands with RBP = `bp` (`old_bp` then), if the walk would find them again: each
/// return address still lies where it was read, and each CFA that was taken from RBP would be
/// taken from the same value. Saved values of RBP that no rule reads may have changed (code
/// built without frame pointers saves RBP as an ordinary register): the copies hold the values
/// RBP takes now. Whether it copied them all.
///
/// The words were read by the calling thread (the callers check [`PrevWalk::walker`]) inside
/// its stack (they were bounds-checked when read), which stays mapped while the thread lives.
#[inline(always)]
fn follow(tail: &[Frame], mut bp: u64, mut old_bp: u64, new: &mut [Frame]) -> bool {
    for (f, copy) in tail.iter().zip(new) {
        // SAFETY: see above: both addresses are 8-aligned words of the live stack.
        // A frame a signal interrupted was read elsewhere ([`signal_frame`]): walked again.
        if f.signal || (f.rbp_rule && bp != old_bp) || unsafe { *((f.cfa - 8) as *const u64) } != f.ra {
            return false;
        }
        if f.bp_slot != 0 {
            // SAFETY: as above.
            bp = unsafe { *(f.bp_slot as *const u64) };
            old_bp = f.bp;
        }
        *copy = Frame { bp, ..*f };
    }
    true
}

/// The unwind loop.
#[inline(always)]
fn walk(out: &mut [u64], start: Start, cache: &mut WalkCache) -> usize {
    let WalkCache { prev, rules: recent } = cache;
    let Start { mut pc, mut sp, mut bp, is_return } = start;
    let (bottom, high) = stack_bounds();
    let low = current_sp();
    if low < bottom || low >= high || out.is_empty() || pc == 0 {
        prev.forget();
        return walk_other_stack(out, start);
    }
    let read = stack_reader(low, high);
    let rules = rules::Rules::new();
    let prev_truncated = prev.truncated;
    let (generation, walker) = (prev.generation, prev.walker);
    let (old, new) = prev.split();
    let reusable = generation == rules.generation() && walker == tls::thread_key();
    let (mut n, mut walked, mut j) = (0, 0, 0);
    if is_return {
        out[0] = pc;
        n = 1;
    }
    let (mut truncated, mut cut) = (true, false);
    while n < out.len() && walked < MAX_WALK {
        // A return address points after the call: look up the call itself.
        let lookup = if is_return || walked > 0 { pc - 1 } else { pc };
        let frame = match step(&rules, recent, lookup, sp, bp, &read, true) {
            Step::Caller(frame) => frame,
            // Cut short, not ended: the next walk that takes this one's tail goes on from it.
            Step::Later => {
                cut = true;
                break;
            }
            Step::NoRule | Step::Broken => {
                truncated = false;
                break;
            }
        };
        let Frame { cfa, ra, .. } = frame;
        (sp, pc, bp) = (cfa, ra, frame.bp);
        // The previous walk's frame at the same height, if any (CFAs only grow).
        while reusable && j < old.len() && old[j].cfa < cfa {
            j += 1;
        }
        new[walked] = frame;
        walked += 1;
        out[n] = ra;
        n += 1;
        // Frames j+1.. of the previous walk may follow.
        let matched = reusable && j < old.len() && old[j].cfa == cfa && old[j].ra == ra;
        let tail = if matched { &old[j + 1..] } else { &[] };
        let take = tail.len().min(out.len() - n).min(MAX_WALK - walked);
        if matched && follow(&tail[..take], bp, old[j].bp, &mut new[walked..walked + take]) {
            for (o, f) in out[n..n + take].iter_mut().zip(&tail[..take]) {
                *o = f.ra;
            }
            (walked, n) = (walked + take, n + take);
            if take == tail.len() && !prev_truncated {
                truncated = false;
                break;
            }
            // The previous walk was cut short: go on walking from its last frame.
            let last = new[walked - 1];
            (sp, pc, bp) = (last.cfa, last.ra, last.bp);
            j = old.len();
        }
    }
    prev.side ^= 1;
    prev.walker = tls::thread_key();
    prev.len = walked;
    prev.truncated = truncated;
    prev.cut = cut;
    prev.generation = rules.generation();
    n
}

#[cfg(test)]
impl PrevWalk {
    /// An empty record (any walk starts from scratch). Zeroed memory is one too: generation 0
    /// never matches the module list's, which starts at 1.
    pub(crate) const fn new() -> Self {
        Self {
            walker: 0,
            len: 0,
            truncated: false,
            cut: false,
            generation: u32::MAX,
            side: 0,
            frames: [[Frame { cfa: 0, ra: 0, bp: 0, bp_slot: 0, rbp_rule: false, signal: false }; MAX_WALK]; 2],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks from the current instruction of the calling function.
    #[inline(always)]
    fn walk_here(out: &mut [u64], prev: &mut WalkCache) -> usize {
        let (pc, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers.
        unsafe {
            core::arch::asm!("lea {}, [rip]", "mov {}, rsp", "mov {}, rbp", out(reg) pc, out(reg) sp, out(reg) bp)
        };
        walk(out, Start { pc, sp, bp, is_return: false }, prev)
    }

    #[inline(never)]
    fn nest(depth: u32, out: &mut [u64], prev: &mut WalkCache) -> usize {
        if depth == 0 { walk_here(out, prev) } else { core::hint::black_box(nest(depth - 1, out, prev)) }
    }

    #[test]
    fn captures_the_whole_chain_of_a_deep_stack() {
        let mut prev = Box::new(WalkCache::new());
        let mut out = [0u64; 64];
        let shallow = nest(0, &mut out, &mut prev);
        let deep = nest(20, &mut out, &mut prev);
        assert_eq!(deep, shallow + 20, "one frame per level of nesting");
        let nest_frames = out[..deep].windows(2).filter(|w| w[0] == w[1]).count();
        assert!(nest_frames >= 19, "the recursive frames return to the same address");
    }

    /// Walks at `depth`, then at `depth2` from a different call site, with and without the
    /// previous walk: the reused tail must give exactly what a fresh walk gives.
    #[inline(never)]
    fn twice(depth: u32, depth2: u32, prev: &mut WalkCache) -> (Vec<u64>, Vec<u64>) {
        nest(depth, &mut [0u64; 64], prev);
        let mut b = [0u64; 64];
        let m = core::hint::black_box(nest(depth2, &mut b, prev));
        let mut fresh = [0u64; 64];
        let f = nest(depth2, &mut fresh, &mut WalkCache::new());
        (b[..m].to_vec(), fresh[..f].to_vec())
    }

    #[test]
    fn reusing_the_previous_walk_gives_what_a_fresh_walk_gives() {
        let mut prev = Box::new(WalkCache::new());
        for (d1, d2) in [(5, 5), (5, 9), (9, 5), (30, 2), (0, 40)] {
            let (second, fresh) = twice(d1, d2, &mut prev);
            assert_eq!(second.len(), fresh.len(), "depths {d1} then {d2}");
            // The two walks were made from two call sites in `twice`: one frame differs.
            let differ = second.iter().zip(&fresh).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 1, "depths {d1} then {d2}:\n{second:x?}\n{fresh:x?}");
        }
        // A depth limit: the reused tail is cut at the limit, and the next walk goes deeper.
        let mut short = [0u64; 8];
        assert_eq!(nest(20, &mut short, &mut prev), 8);
        let mut full = [0u64; 64];
        let n = nest(20, &mut full, &mut prev);
        let f = nest(20, &mut [0u64; 64], &mut WalkCache::new());
        assert_eq!(n, f, "a walk after a truncated one still reaches the bottom");
    }
}
