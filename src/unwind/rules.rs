//! Unwind rules per return address, computed once from `.eh_frame` and cached.
//!
//! On x86_64 nearly every frame is described by "CFA = RSP + n" (code without frame
//! pointers) or "CFA = RBP + 16" (with), the return address at CFA - 8 and RBP either left
//! alone or saved at CFA - m. Such a rule packs into 64 bits; applying it is a couple of
//! loads. The DWARF work (finding the FDE through `.eh_frame_hdr`'s binary-search table and
//! running its CFA program, with gimli) happens once per distinct address, on a miss.
//! A signal trampoline (an FDE whose CIE says `S`: glibc's `__restore_rt`) is cached as
//! `Signal`, which a walk follows through the `ucontext` the kernel saved; a CFA expression of
//! RSP and the pc alone (the PLT's) as the `Rsp` rule it comes to at that pc; anything else (an
//! expression that reads memory) as `Stop`; code that no unwind table covers (built with
//! `-fno-asynchronous-unwind-tables`, or no module's) as `NoTable`, which a walk may follow by
//! the frame pointer.
//!
//! The cache is a fixed, direct-mapped table in an anonymous mapping; each entry is
//! published under a sequence number, so readers never lock and never see half an entry.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, EndianSlice, LittleEndian, Register, RegisterRule, UnwindContext,
    UnwindContextStorage, UnwindSection, UnwindTableRow,
};

use super::modules::{self, Modules};
use crate::pool;

/// What to do at one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rule {
    /// CFA = RSP + `cfa`; the caller's RBP is at CFA - `rbp` (0: RBP unchanged).
    Rsp { cfa: u32, rbp: u16 },
    /// CFA = RBP + `cfa`; as above.
    Rbp { cfa: u32, rbp: u16 },
    /// No rule this unwinder follows: the stack ends here.
    Stop,
    /// A signal trampoline: the interrupted frame's registers are in the `ucontext` the
    /// kernel pushed, which starts at the trampoline's stack pointer.
    Signal,
    /// No unwind table covers the address: only the frame pointer may lead further, if the
    /// code keeps one (CFA = RBP + 16, the caller's RBP at CFA - 16).
    NoTable,
    /// Not known yet, with too little of the thread's stack left to compute it and the
    /// spare stack taken by another thread: the walk is cut short here this time. Never
    /// cached.
    Later,
}

const DWARF_RBP: Register = Register(6);
const DWARF_RSP: Register = Register(7);
const DWARF_RA: Register = Register(16);

impl Rule {
    fn pack(self) -> u64 {
        match self {
            Rule::Rsp { cfa, rbp } => 1 | (rbp as u64) << 8 | (cfa as u64) << 32,
            Rule::Rbp { cfa, rbp } => 2 | (rbp as u64) << 8 | (cfa as u64) << 32,
            Rule::Stop | Rule::Later => 3,
            Rule::NoTable => 7,
            Rule::Signal => 11,
        }
    }

    fn unpack(v: u64) -> Rule {
        let (rbp, cfa) = ((v >> 8) as u16, (v >> 32) as u32);
        match v & 3 {
            1 => Rule::Rsp { cfa, rbp },
            2 => Rule::Rbp { cfa, rbp },
            _ if v == 7 => Rule::NoTable,
            _ if v == 11 => Rule::Signal,
            _ => Rule::Stop,
        }
    }
}

/// Registers an FDE row may give rules for. x86_64's unwinders know 17 (RAX to R15 and the
/// return address: libgcc's `DWARF_FRAME_REGISTERS`, libunwind's); gimli's default of 192
/// makes a row 6 KiB, boxed on the heap and copied by value while the CFA program runs.
const REGISTER_RULES: usize = 32;
/// `DW_CFA_remember_state` depth, gimli's default.
const REMEMBERED_STATES: usize = 4;

/// gimli's unwinder state held in place, on the stack of the computation: a rule computed on a
/// hook's path takes no lock and allocates nothing (a thread stopped for good inside a
/// computation used to hold mallocspy's heap: `own_heap::free_within`). A CFA program that
/// needs more registers or states than these stops the stack, as an unknown rule does.
struct InPlace;

impl<T: gimli::ReaderOffset> UnwindContextStorage<T> for InPlace {
    type Rules = [(Register, RegisterRule<T>); REGISTER_RULES];
    type Stack = [UnwindTableRow<T, Self>; REMEMBERED_STATES];
}

impl<R: gimli::Reader> gimli::EvaluationStorage<R> for InPlace {
    type Stack = [gimli::Value; 8];
    type ExpressionStack = [(R, R); 2];
    type Result = [gimli::Piece<R>; 1];
}

/// The CFA that `expression` computes at `pc`, as an offset from RSP, if it is RSP plus what
/// the pc alone decides: the PLT's (RSP + 8, or + 16 once an entry has pushed its index), where
/// a signal may strike a program in a loop of library calls, and whose frame ended its stack.
/// `None` for any other expression (one that reads memory: a frame realigned by DRAP).
fn rsp_offset_at<R: gimli::Reader>(
    expression: gimli::Expression<R>,
    encoding: gimli::Encoding,
    pc: u64,
) -> Option<u32> {
    let cfa_with = |rsp: u64| -> Option<u64> {
        let mut evaluation = gimli::Evaluation::<R, InPlace>::new_in(expression.0.clone(), encoding);
        let mut state = evaluation.evaluate().ok()?;
        while let gimli::EvaluationResult::RequiresRegister { register, .. } = state {
            let value = match register {
                DWARF_RSP => rsp,
                DWARF_RA => pc,
                _ => return None,
            };
            state = evaluation.resume_with_register(gimli::Value::Generic(value)).ok()?;
        }
        match (state, evaluation.as_result()) {
            (
                gimli::EvaluationResult::Complete,
                [gimli::Piece { location: gimli::Location::Address { address }, .. }],
            ) => Some(*address),
            _ => None,
        }
    };
    // Evaluated at two values of RSP, so that an expression that is not RSP plus a constant
    // (RSP times anything, or masked) is told apart.
    const ONE: u64 = 1 << 32;
    let (low, high) = (cfa_with(ONE)?, cfa_with(2 * ONE)?);
    let offset = low.checked_sub(ONE)?;
    (high.wrapping_sub(low) == ONE).then(|| u32::try_from(offset).ok()).flatten()
}

/// A module's mapped `.eh_frame`, as gimli reads it.
type Section = EndianSlice<'static, LittleEndian>;

/// A module's unwind tables as gimli reads them: their base addresses, `.eh_frame_hdr`
/// parsed, and `.eh_frame`. `None` if the header does not parse.
fn tables_of(m: &modules::Module) -> Option<(BaseAddresses, gimli::ParsedEhFrameHdr<Section>, EhFrame<Section>)> {
    let slice = |(start, end): (u64, u64)| {
        // SAFETY: the ranges come from the module's mapped program headers, which stay mapped
        // while the module is loaded (longer than a computation that reads them).
        EndianSlice::new(
            unsafe { core::slice::from_raw_parts(start as *const u8, (end - start) as usize) },
            LittleEndian,
        )
    };
    let bases =
        BaseAddresses::default().set_eh_frame_hdr(m.eh_frame_hdr.0).set_eh_frame(m.eh_frame.0).set_text(m.text.0);
    let hdr = EhFrameHdr::from(slice(m.eh_frame_hdr)).parse(&bases, 8).ok()?;
    Some((bases, hdr, EhFrame::from(slice(m.eh_frame))))
}

/// Computes the rule for `pc` from the unwind tables of its module. Out of line: [`computed`]
/// calls it twice, and one frame of it at a time is what [`COMPUTE_ROOM`] allows for.
#[inline(never)]
fn compute(modules: &Modules, pc: u64) -> Option<Rule> {
    let (bases, hdr, eh_frame) = tables_of(modules.find(pc)?)?;
    let fde = hdr.table()?.fde_for_address(&eh_frame, &bases, pc, EhFrame::cie_from_offset).ok()?;
    if fde.is_signal_trampoline() {
        return Some(Rule::Signal);
    }
    let mut ctx = UnwindContext::<_, InPlace>::new_in();
    let row = match fde.unwind_info_for_address(&eh_frame, &bases, &mut ctx, pc) {
        Ok(row) => row,
        Err(gimli::Error::TooManyRegisterRules | gimli::Error::StackFull) => return Some(Rule::Stop),
        Err(_) => return None,
    };
    let ra_at_cfa_minus_8 = matches!(row.register(DWARF_RA), Some(RegisterRule::Offset(-8)));
    let rbp = match row.register(DWARF_RBP) {
        None | Some(RegisterRule::Undefined | RegisterRule::SameValue) => Some(0),
        Some(RegisterRule::Offset(off)) if (-65535..0).contains(&off) => Some((-off) as u16),
        _ => None,
    };
    let rule = match (row.cfa(), rbp) {
        (_, None) => Rule::Stop,
        _ if !ra_at_cfa_minus_8 => Rule::Stop,
        (&CfaRule::RegisterAndOffset { register, offset }, Some(rbp)) if (0..=u32::MAX as i64).contains(&offset) => {
            match register {
                DWARF_RSP => Rule::Rsp { cfa: offset as u32, rbp },
                DWARF_RBP => Rule::Rbp { cfa: offset as u32, rbp },
                _ => Rule::Stop,
            }
        }
        (CfaRule::Expression(expression), Some(rbp)) => expression
            .get(&eh_frame)
            .ok()
            .and_then(|expression| rsp_offset_at(expression, fde.cie().encoding(), pc))
            .map_or(Rule::Stop, |cfa| Rule::Rsp { cfa, rbp }),
        _ => Rule::Stop,
    };
    Some(rule)
}

/// Whether file address `address` of an ELF file lies in a signal trampoline by the file's
/// own unwind tables, its `.eh_frame_hdr` and `.eh_frame` given with their file addresses: for
/// the reports of a trace, which name the trampoline's frame as the exit reports do.
pub(crate) fn is_signal_trampoline_in(eh_frame_hdr: (&[u8], u64), eh_frame: (&[u8], u64), address: u64) -> bool {
    let bases = BaseAddresses::default().set_eh_frame_hdr(eh_frame_hdr.1).set_eh_frame(eh_frame.1);
    let Ok(hdr) = EhFrameHdr::new(eh_frame_hdr.0, LittleEndian).parse(&bases, 8) else { return false };
    let Some(table) = hdr.table() else { return false };
    let eh_frame = EhFrame::new(eh_frame.0, LittleEndian);
    table.fde_for_address(&eh_frame, &bases, address, EhFrame::cie_from_offset).is_ok_and(|f| f.is_signal_trampoline())
}

const ENTRIES: usize = 1 << 16;

#[repr(C, align(32))]
struct Entry {
    /// Even when the entry is stable.
    seq: AtomicU32,
    /// The address with the module generation in the top 16 bits, 0 when empty.
    key: AtomicU64,
    rule: AtomicU64,
}

/// The cache table, mapped on first use; `None` if the mapping failed (rules are then
/// computed every time).
fn table() -> Option<&'static [Entry]> {
    static TABLE: OnceLock<Option<usize>> = OnceLock::new();
    let base =
        (*TABLE.get_or_init(|| pool::lease(ENTRIES * core::mem::size_of::<Entry>()).map(|p| p.as_ptr() as usize)))?;
    // SAFETY: the mapping holds ENTRIES zeroed entries (valid atomics) and is never released.
    Some(unsafe { core::slice::from_raw_parts(base as *const Entry, ENTRIES) })
}

/// Entries on one page of the table.
const PAGE_ENTRIES: usize = 4096 / core::mem::size_of::<Entry>();

/// The entry of `key`: a page of the table picked by a hash of the key's 1 KiB of code, and
/// on that page the address's 8 bytes within it, so that the return addresses of one stretch
/// of code share a page of the table (a hash of the whole address put every one on a page of
/// its own: two page faults each on first use, a read and a write).
fn slot(key: u64) -> usize {
    const CODE_SHIFT: u32 = (PAGE_ENTRIES * 8).trailing_zeros();
    let page = ((key >> CODE_SHIFT).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        >> (64 - (ENTRIES / PAGE_ENTRIES).trailing_zeros())) as usize;
    page * PAGE_ENTRIES + (key as usize >> 3) % PAGE_ENTRIES
}

/// Sets of a thread's own cache of recent rules (two entries each).
const RECENT_SETS: usize = 256;

/// A thread's own two-way set-associative cache of the rules it used last, in front of the
/// shared table: the shared table is too large to stay in cache while the program works, and
/// a walk consults it once a frame. Two ways instead of one, in the same 8 KiB: sqlite3's
/// walks missed on 11% of their lookups with 512 direct-mapped entries. Each set keeps its
/// most recently used entry first. Zeroed memory is an empty cache (keys are never 0: the
/// module generation starts at 1).
pub(crate) struct Recent {
    sets: [[(u64, u64); 2]; RECENT_SETS],
}

impl Recent {
    pub(crate) const fn new() -> Self {
        Self { sets: [[(0, 0); 2]; RECENT_SETS] }
    }
}

/// A view of the rule cache for one stack walk (the module list is read once per walk).
pub(crate) struct Rules {
    modules: &'static Modules,
    table: Option<&'static [Entry]>,
}

impl Rules {
    pub(crate) fn new() -> Self {
        Self { modules: modules::current(), table: table() }
    }

    /// The module list generation the rules belong to.
    pub(crate) fn generation(&self) -> u32 {
        self.modules.generation
    }

    /// The rule for the frame whose (lookup) address is `pc`, from the thread's `recent`
    /// rules or the shared table.
    #[inline(always)]
    pub(crate) fn get(&self, recent: &mut Recent, pc: u64) -> Rule {
        let key = pc | (self.modules.generation as u64) << 48;
        let set =
            &mut recent.sets[(key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - RECENT_SETS.trailing_zeros())) as usize];
        if set[0].0 == key {
            return Rule::unpack(set[0].1);
        }
        if set[1].0 == key {
            set.swap(0, 1);
            return Rule::unpack(set[0].1);
        }
        let rule = self.shared(key, pc);
        if rule != Rule::Later {
            set[1] = set[0];
            set[0] = (key, rule.pack());
        }
        rule
    }

    #[inline(always)]
    fn shared(&self, key: u64, pc: u64) -> Rule {
        let Some(table) = self.table else {
            return computed(self.modules, pc).map_or(Rule::Later, |(rule, _)| rule);
        };
        let e = &table[slot(key)];
        let seq = e.seq.load(Ordering::Acquire);
        if seq & 1 == 0 && e.key.load(Ordering::Acquire) == key {
            let rule = e.rule.load(Ordering::Acquire);
            if e.seq.load(Ordering::Acquire) == seq {
                return Rule::unpack(rule);
            }
        }
        miss(self.modules, pc, key, e)
    }
}

/// The rule for the frame whose (lookup) address is `pc`, from the shared table.
pub(crate) fn lookup(pc: u64) -> Rule {
    let rules = Rules::new();
    rules.shared(pc | (rules.generation() as u64) << 48, pc)
}

/// Stack a rule's computation may take below the frame that asks for it: gimli's state, held
/// in place ([`InPlace`]), and the rows its table copies by value take 7 KiB (measured by
/// `tests::a_rule_is_computed_well_within_its_room`; 13 KiB with gimli's boxed rows of 192
/// registers, and a thread on a 16 KiB stack died of them).
const COMPUTE_ROOM: u64 = 16 << 10;

/// The rule for `pc` and whether to cache it, computed on this thread's stack if it has
/// [`COMPUTE_ROOM`] left, else on the spare one ([`crate::spare_stack::for_a_rule`]); `None`
/// when neither can be had.
fn computed(modules: &'static Modules, pc: u64) -> Option<(Rule, bool)> {
    let mut found = None;
    let mut find = || {
        found = Some(match compute(modules, pc) {
            Some(rule) => (rule, true),
            // Code outside every known module: maybe a library opened since; look once more,
            // if the loader has loaded or unloaded anything since the list was read (a rule
            // found there is cached under the new generation next time).
            None if modules.stale() => compute(modules::refresh(), pc).map_or((Rule::NoTable, true), |r| (r, false)),
            None => (Rule::NoTable, true),
        })
    };
    if super::stack_room() >= COMPUTE_ROOM {
        find();
    } else {
        crate::spare_stack::for_a_rule(&mut find);
    }
    found
}

#[cold]
fn miss(modules: &'static Modules, pc: u64, key: u64, e: &Entry) -> Rule {
    let Some((rule, cache)) = computed(modules, pc) else { return Rule::Later };
    if !cache {
        return rule;
    }
    // Publish; a writer that finds the entry busy just skips caching.
    let seq = e.seq.load(Ordering::Relaxed);
    if seq & 1 == 0 && e.seq.compare_exchange(seq, seq + 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
        e.key.store(key, Ordering::Release);
        e.rule.store(rule.pack(), Ordering::Release);
        e.seq.store(seq + 2, Ordering::Release);
    }
    rule
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_pack_and_unpack() {
        for r in [
            Rule::Rsp { cfa: 8, rbp: 0 },
            Rule::Rbp { cfa: 16, rbp: 16 },
            Rule::Rsp { cfa: 70_000, rbp: 48 },
            Rule::Stop,
            Rule::NoTable,
            Rule::Signal,
        ] {
            assert_eq!(Rule::unpack(r.pack()), r);
        }
    }

    #[inline(never)]
    fn here() -> u64 {
        let pc: u64;
        // SAFETY: reads the instruction pointer.
        unsafe { core::arch::asm!("lea {}, [rip]", out(reg) pc) };
        pc
    }

    /// Bytes of stack `f` takes below this frame: the stack below is painted first, and the
    /// lowest word `f` wrote is where it reached.
    #[inline(never)]
    fn stack_taken(f: &mut dyn FnMut()) -> u64 {
        const PAINT: u64 = 0x5A5A_5A5A_5A5A_5A5A;
        const PAINTED: u64 = 128 << 10;
        let sp = crate::unwind::current_sp();
        let low = (sp - PAINTED) & !7;
        let mut at = low;
        while at < sp - 256 {
            // SAFETY: the unused part of this thread's stack, which the test made large enough.
            unsafe { core::ptr::write_volatile(at as *mut u64, PAINT) };
            at += 8;
        }
        core::hint::black_box(&mut *f)();
        let mut at = low;
        // SAFETY: as above; `f` has returned.
        while at < sp && unsafe { core::ptr::read_volatile(at as *const u64) } == PAINT {
            at += 8;
        }
        sp - at
    }

    #[test]
    fn a_rule_is_computed_well_within_its_room() {
        let libc_pc = libc::qsort as *const () as u64 + 16;
        let taken = std::thread::Builder::new()
            .stack_size(1 << 20)
            .spawn(move || {
                let modules = modules::current();
                let mut taken = [here(), libc_pc].map(|pc| {
                    let mut rule = None;
                    let taken = stack_taken(&mut || rule = compute(modules, pc));
                    assert!(matches!(rule, Some(Rule::Rsp { .. } | Rule::Rbp { .. })), "{pc:#x}: {rule:?}");
                    taken
                });
                taken[0] = taken[0].max(stack_taken(&mut || {
                    modules::refresh();
                }));
                taken
            })
            .unwrap()
            .join()
            .unwrap();
        // 13 KiB with gimli's boxed storage, 7 KiB in place (2026-12-05); what `computed`
        // adds between its check of the room and `compute` is a few small frames.
        assert!(taken.iter().all(|&t| t < COMPUTE_ROOM - (4 << 10)), "{taken:?} bytes");
    }

    /// The C library's PLT, whose FDE computes the CFA by an expression of RSP and the pc: a
    /// signal that struck there ended its stack (review helper 74). Every address of an FDE
    /// whose CFA is an expression that reads no memory has an RSP rule, of 8 or 16 there.
    #[test]
    fn the_plts_expression_is_an_rsp_rule() {
        let modules = modules::current();
        let (bases, hdr, eh_frame) = tables_of(modules.find(libc::qsort as *const () as u64).unwrap()).unwrap();
        let table = hdr.table().unwrap();
        let (mut entries, mut by_expression) = (table.iter(&bases), 0);
        while let Some((start, _)) = entries.next().unwrap() {
            let Ok(fde) = table.fde_for_address(&eh_frame, &bases, start.pointer(), EhFrame::cie_from_offset) else {
                continue;
            };
            let mut context = UnwindContext::<_, InPlace>::new_in();
            let mut rows = fde.rows(&eh_frame, &bases, &mut context).unwrap();
            while let Some(row) = rows.next_row().unwrap() {
                let CfaRule::Expression(expression) = row.cfa() else { continue };
                let reads_memory =
                    expression.get(&eh_frame).unwrap().0.slice().contains(&gimli::constants::DW_OP_deref.0);
                if fde.is_signal_trampoline() || reads_memory {
                    continue;
                }
                for pc in row.start_address()..row.end_address() {
                    let rule = compute(modules, pc);
                    assert!(matches!(rule, Some(Rule::Rsp { cfa: 8 | 16, rbp: 0 })), "{pc:#x}: {rule:?}");
                    by_expression += 1;
                }
            }
        }
        assert!(by_expression > 0, "no CFA expression in the C library's unwind tables");
    }

    #[test]
    fn a_function_of_this_binary_has_a_followable_rule() {
        let rule = lookup(here());
        assert!(matches!(rule, Rule::Rsp { .. } | Rule::Rbp { .. }), "{rule:?}");
        assert_eq!(lookup(here()), rule, "cached");
    }
}
