//! The leak report: blocks grouped by allocation stack and kind, symbolized, as text or JSON.
//! Building and rendering are pure functions of the classified blocks and the tracker's totals.

use crate::fixed_hash::{HashMap, HashSet};
use std::collections::hash_map::Entry as Slot;
use std::fmt::Write;
use std::hash::{Hash, Hasher};

use serde::Serialize;

use super::scan::LeakKind;
use super::suppress::Suppressions;
use super::symbols::{self, Frame, Symbolizer};
use crate::options::Escaped;
use crate::spy::Entry;

/// Blocks and bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Number of blocks.
    pub blocks: u64,
    /// Bytes in them (as asked for).
    pub bytes: u64,
}

impl Tally {
    fn add(&mut self, bytes: u64) {
        self.blocks += 1;
        self.bytes += bytes;
    }
}

/// Totals of a report, keyed as valgrind's LEAK SUMMARY. (`#[repr(C)]`: the C API's
/// `struct mallocspy_leak_summary`.)
#[repr(C)]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// No pointer to them anywhere.
    pub definitely_lost: Tally,
    /// Reachable only from lost blocks.
    pub indirectly_lost: Tally,
    /// Reachable only through interior pointers.
    pub possibly_lost: Tally,
    /// Reachable from a root.
    pub still_reachable: Tally,
    /// Lost blocks whose stack matched a suppression (not counted above).
    pub suppressed: Tally,
    /// Allocating calls (a realloc is one allocation and one free).
    pub total_allocs: u64,
    /// Frees of tracked blocks.
    pub total_frees: u64,
    /// Bytes allocated in all.
    pub total_bytes_allocated: u64,
}

impl Summary {
    fn tally(&mut self, kind: LeakKind) -> &mut Tally {
        match kind {
            LeakKind::DefinitelyLost => &mut self.definitely_lost,
            LeakKind::IndirectlyLost => &mut self.indirectly_lost,
            LeakKind::PossiblyLost => &mut self.possibly_lost,
            LeakKind::StillReachable => &mut self.still_reachable,
        }
    }

    /// Definitely plus indirectly lost blocks (what `exitcode` is about).
    pub fn lost_blocks(&self) -> u64 {
        self.definitely_lost.blocks + self.indirectly_lost.blocks
    }
}

/// One allocation stack's blocks of one kind.
#[derive(Clone, Debug, Serialize)]
pub struct LeakRecord {
    /// `definitely_lost`, `indirectly_lost`, `possibly_lost` or `still_reachable`.
    #[serde(serialize_with = "kind_name")]
    pub kind: LeakKind,
    /// Blocks allocated at this stack and left in this state.
    pub blocks: u64,
    /// Bytes in them.
    pub bytes: u64,
    /// The entry point that allocated the first of them.
    #[serde(serialize_with = "entry_name")]
    pub entry: Entry,
    /// The allocation stack, innermost first, starting at the allocator's caller.
    pub stack: Vec<Frame>,
    /// For definitely lost records: the bytes of the indirectly lost blocks their groups hold
    /// (reachable only through them), as memcheck's "232 (16 direct, 216 indirect) bytes".
    #[serde(skip_serializing_if = "is_zero")]
    pub indirect_bytes: u64,
    /// For still-reachable records (with `show_reachable` or in JSON): how the first of the
    /// blocks is retained, from a root (a global, a thread's stack) through the blocks that
    /// point to it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub retained_by: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn kind_name<S: serde::Serializer>(k: &LeakKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(k.name())
}

fn entry_name<S: serde::Serializer>(e: &Entry, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(e.name())
}

/// A leak report.
#[derive(Clone, Debug, Serialize)]
pub struct LeakReport {
    /// The process reported on.
    pub pid: u32,
    /// Its executable.
    pub program: String,
    /// Totals.
    pub summary: Summary,
    /// Records, by bytes (largest first).
    pub leaks: Vec<LeakRecord>,
    /// What limited the report (threads that could not be stopped, untracked allocations).
    pub notes: Vec<String>,
    /// The suppressions that matched, with what each took out (LeakSanitizer's "Suppressions
    /// used"), by bytes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub suppressions_used: Vec<SuppressionUsed>,
}

/// A suppression that matched, and the blocks it took out of the report.
#[derive(Clone, Debug, Serialize)]
pub struct SuppressionUsed {
    /// The pattern, as in the file.
    pub pattern: String,
    /// Blocks it took out.
    pub blocks: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// How a report treats the stacks it shows.
#[derive(Clone, Copy)]
pub(crate) struct StackOptions<'a> {
    /// Lost records whose stack matches one of these are counted as suppressed.
    pub suppressions: &'a Suppressions,
    /// Keep the frames below `main`.
    pub below_main: bool,
}

/// A classified live block, as the report needs it.
pub(crate) struct Classified {
    pub size: u64,
    pub stack: u32,
    pub entry: Entry,
    pub kind: LeakKind,
    /// For a suppressed block: the stack of the suppressed leak it was found from (its own,
    /// for one of those).
    pub suppressed_by: Option<u32>,
    /// For an indirectly lost block: the stack of the definitely lost block whose group holds it.
    pub group_leader: Option<u32>,
}

/// Names the stacks of a report: symbolized, and ending at `main` unless `below_main`.
pub(crate) struct Namer {
    symbolizer: Symbolizer,
    start_up: Option<symbols::StartUp>,
}

impl Namer {
    /// For a report of `stack_ids`, whose frames below `main` are learnt from them all.
    pub(crate) fn new(stacks: StackOptions, stack_ids: &[u32], frames_of: &impl Fn(u32) -> Vec<u64>) -> Self {
        let mut start_up = if stacks.below_main { None } else { symbols::StartUp::find() };
        if let Some(start_up) = &mut start_up {
            let mut learnt = HashSet::default();
            for &id in stack_ids.iter().filter(|&&id| learnt.insert(id)) {
                start_up.learn(&frames_of(id));
            }
        }
        Self { symbolizer: Symbolizer::default(), start_up }
    }

    /// The frames shown of stack `stack_id`.
    pub(crate) fn frames(&mut self, stack_id: u32, frames_of: &impl Fn(u32) -> Vec<u64>) -> Vec<Frame> {
        let addrs = frames_of(stack_id);
        // Below `main` is the C library's start-up, the same under every stack: as valgrind
        // does by default, it is left out, and so is reading the library's debug information
        // only to name it (libc6-dbg's, compressed: 217 million instructions to inflate, half
        // of python3's exit report).
        let shown = self.start_up.map_or(addrs.len(), |s| s.frames_above(&addrs));
        let mut stack = Vec::new();
        for &addr in &addrs[..shown] {
            stack.extend_from_slice(self.symbolizer.frames_of_stack(stack_id, addr));
        }
        stack
    }

    /// How many of a stack's addresses (innermost first) are shown: those above `main`,
    /// unless frames below it are kept.
    pub(crate) fn shown(&self, addrs: &[u64]) -> usize {
        self.start_up.map_or(addrs.len(), |s| s.frames_above(addrs))
    }

    /// The frames of return address `addr` of a stack kept outside the stack table, named from
    /// the modules loaded now.
    pub(crate) fn frames_of_address(&mut self, addr: u64) -> &[Frame] {
        self.symbolizer.frames(addr)
    }
}

/// The suppression that a frame shown of each of `stack_ids` matches, for those one does.
pub(crate) fn suppression_patterns(
    namer: &mut Namer,
    stack_ids: impl IntoIterator<Item = u32>,
    frames_of: &impl Fn(u32) -> Vec<u64>,
    suppressions: &Suppressions,
) -> HashMap<u32, String> {
    let mut patterns = HashMap::default();
    if suppressions.is_empty() {
        return patterns;
    }
    let mut seen = HashSet::default();
    for id in stack_ids.into_iter().filter(|&id| seen.insert(id)) {
        let pattern = namer.frames(id, frames_of).iter().find_map(|f| {
            let texts = [f.function.as_deref(), f.file.as_deref(), f.module.as_deref()];
            suppressions.matching(texts.into_iter().flatten()).map(str::to_owned)
        });
        patterns.extend(pattern.map(|p| (id, p)));
    }
    patterns
}

/// Memory a frame of a record takes, named (its strings) and in the text report, about.
const NAMED_FRAME_BYTES: usize = 512;

/// Groups blocks by (stack, kind), symbolizes (still-reachable stacks only when `reachable`
/// is given, with the retention path of each: a text report does not show them), and counts
/// the suppressed blocks apart, by the pattern of their own stack or else of the suppressed
/// leak they were found from (`patterns`, [`suppression_patterns`] of the lost stacks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn build(
    pid: u32,
    blocks: &[Classified],
    totals: (u64, u64, u64),
    frames_of: impl Fn(u32) -> Vec<u64>,
    namer: &mut Namer,
    patterns: &HashMap<u32, String>,
    reachable: Option<&HashMap<u32, Vec<String>>>,
    notes: Vec<String>,
) -> LeakReport {
    let mut summary = Summary {
        total_allocs: totals.0,
        total_frees: totals.1,
        total_bytes_allocated: totals.2,
        ..Summary::default()
    };
    let pattern = |stack_id: u32| patterns.get(&stack_id).map(String::as_str);
    let mut groups: HashMap<(u32, LeakKind), (Tally, Entry)> = HashMap::default();
    let mut used: HashMap<&str, Tally> = HashMap::default();
    // The indirectly lost bytes of the groups led by each stack's definitely lost blocks.
    let mut indirect_under: HashMap<u32, u64> = HashMap::default();
    for b in blocks {
        let lost = b.kind != LeakKind::StillReachable;
        let suppressed = b.suppressed_by.and_then(|by| pattern(b.stack).or_else(|| pattern(by)));
        if let Some(pattern) = suppressed.filter(|_| lost) {
            summary.suppressed.add(b.size);
            used.entry(pattern).or_default().add(b.size);
        } else {
            groups.entry((b.stack, b.kind)).or_insert((Tally::default(), b.entry)).0.add(b.size);
            if let Some(leader) = b.group_leader.filter(|_| b.kind == LeakKind::IndirectlyLost) {
                *indirect_under.entry(leader).or_default() += b.size;
            }
        }
    }
    // The frames the records will show, named, and their text: under an address-space limit
    // a report of many distinct stacks did not fit, and the program aborted at its exit with
    // "memory allocation failed" (100,000 leaks from as many stacks took 900 MB: review
    // helper 97). Without room for them, the records go without stacks, one for each kind.
    let shown = |&(_, kind): &(u32, LeakKind)| kind != LeakKind::StillReachable || reachable.is_some();
    let frames: usize = groups.keys().filter(|g| shown(g)).map(|&(id, _)| namer.shown(&frames_of(id))).sum();
    let fits = frames == 0 || crate::pool::has_room(frames.saturating_mul(NAMED_FRAME_BYTES));
    let mut notes = notes;
    if !fits {
        notes.push(format!(
            "the records' {} frames, named, would need about {} MiB more than this process may map (its \
             address-space limit, ulimit -v, or the system's commit limit): the records go without their stacks",
            grouped(frames as u64),
            grouped((frames.saturating_mul(NAMED_FRAME_BYTES) >> 20) as u64)
        ));
    }
    let mut leaks: Vec<LeakRecord> = Vec::new();
    // Stacks with the same frames are one record: after a `dlclose` the same call sites get
    // stacks of their own (a library loaded where the closed one was may have other code at
    // its addresses, and then other frames). Known by a hash of the frames, compared on a
    // hit: a copy of each record's frames as the key cost half again the report's memory
    // (review helper 30).
    let mut record_of: HashMap<u64, usize> = HashMap::default();
    for ((stack_id, kind), (tally, entry)) in groups {
        let lost = kind != LeakKind::StillReachable;
        let indirect_bytes =
            if kind == LeakKind::DefinitelyLost { indirect_under.get(&stack_id).copied().unwrap_or(0) } else { 0 };
        let stack = if fits && shown(&(stack_id, kind)) { namer.frames(stack_id, &frames_of) } else { Vec::new() };
        let t = summary.tally(kind);
        t.blocks += tally.blocks;
        t.bytes += tally.bytes;
        if !stack.is_empty() || !fits {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            (kind, &stack).hash(&mut hasher);
            match record_of.entry(hasher.finish()) {
                Slot::Occupied(at) if leaks[*at.get()].kind == kind && leaks[*at.get()].stack == stack => {
                    let record = &mut leaks[*at.get()];
                    record.blocks += tally.blocks;
                    record.bytes += tally.bytes;
                    record.indirect_bytes += indirect_bytes;
                    continue;
                }
                // Another stack with the same hash keeps the entry: this one stays apart.
                Slot::Occupied(_) => {}
                Slot::Vacant(slot) => {
                    slot.insert(leaks.len());
                }
            }
        }
        let path = reachable.filter(|_| !lost).and_then(|paths| paths.get(&stack_id));
        let retained_by = path.cloned().unwrap_or_default();
        leaks.push(LeakRecord {
            kind,
            blocks: tally.blocks,
            bytes: tally.bytes,
            indirect_bytes,
            entry,
            stack,
            retained_by,
        });
    }
    // Ties go by the stacks' names, the same from run to run (the records come from a hash
    // map, whose order is not): reports of two runs can be compared line by line.
    type Named<'a> = (Option<&'a str>, Option<&'a str>, Option<u32>, Option<&'a str>, Option<u64>);
    fn named(f: &Frame) -> Named<'_> {
        (f.function.as_deref(), f.file.as_deref(), f.line, f.module.as_deref(), f.offset)
    }
    // By the bytes each record takes with it, its group's included (as memcheck orders them).
    leaks.sort_by(|a, b| {
        (b.bytes.saturating_add(b.indirect_bytes))
            .cmp(&a.bytes.saturating_add(a.indirect_bytes))
            .then(b.blocks.cmp(&a.blocks))
            .then(a.kind.cmp(&b.kind))
            .then_with(|| a.stack.iter().map(named).cmp(b.stack.iter().map(named)))
    });
    let mut suppressions_used: Vec<SuppressionUsed> = used
        .into_iter()
        .map(|(pattern, t)| SuppressionUsed { pattern: pattern.to_owned(), blocks: t.blocks, bytes: t.bytes })
        .collect();
    suppressions_used.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.pattern.cmp(&b.pattern)));
    let program = super::kept::program();
    LeakReport { pid, program, summary, leaks, notes, suppressions_used }
}

impl LeakReport {
    /// One line of JSON.
    pub fn to_json(&self) -> String {
        let mut json = Vec::new();
        self.write_json(&mut |chunk| json.extend_from_slice(chunk));
        String::from_utf8_lossy(&json).into_owned()
    }

    /// [`Self::to_json`], given to `emit` 64 KiB at a time, as
    /// [`Self::write_text`] gives the text.
    pub fn write_json(&self, emit: &mut dyn FnMut(&[u8])) {
        struct Chunks<'a> {
            buffer: Vec<u8>,
            emit: &'a mut dyn FnMut(&[u8]),
        }
        impl std::io::Write for Chunks<'_> {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.buffer.extend_from_slice(bytes);
                if self.buffer.len() >= TEXT_CHUNK {
                    self.flush()?;
                }
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                (self.emit)(&self.buffer);
                self.buffer.clear();
                Ok(())
            }
        }
        let mut out = Chunks { buffer: Vec::with_capacity(TEXT_CHUNK + 4096), emit };
        // Plain data into a writer that never fails: nothing to fail on.
        let _ = serde_json::to_writer(&mut out, self);
        out.buffer.push(b'\n');
        let _ = std::io::Write::flush(&mut out);
    }

    /// The text report: every lost record, still-reachable ones when `show_reachable`, then
    /// the summary (valgrind's layout, prefixed by the pid).
    pub fn to_text(&self, show_reachable: bool) -> String {
        let mut text = String::new();
        self.write_text(show_reachable, &mut |chunk| text.push_str(chunk));
        text
    }

    /// [`Self::to_text`], given to `emit` a part at a time (whole records, 64 KiB or so): a
    /// report of 100,000 records with deep stacks is hundreds of megabytes of text, which made
    /// at once did not fit under an address-space limit (review helper 97).
    pub fn write_text(&self, show_reachable: bool, emit: &mut dyn FnMut(&str)) {
        let p = format!("=={}==", self.pid);
        let mut out = String::new();
        let _ = writeln!(out, "{p} mallocspy leak report for {}", Escaped(&self.program));
        let mut hidden = Tally::default();
        for r in &self.leaks {
            if r.kind == LeakKind::StillReachable && !show_reachable {
                hidden.add(0);
                continue;
            }
            let what = match r.kind {
                LeakKind::DefinitelyLost => "definitely lost",
                LeakKind::IndirectlyLost => "indirectly lost",
                LeakKind::PossiblyLost => "possibly lost",
                LeakKind::StillReachable => "still reachable",
            };
            // memcheck's form, for a leak that takes others with it.
            let bytes = if r.indirect_bytes > 0 {
                format!(
                    "{} ({} direct, {} indirect)",
                    grouped(r.bytes.saturating_add(r.indirect_bytes)),
                    grouped(r.bytes),
                    grouped(r.indirect_bytes)
                )
            } else {
                grouped(r.bytes)
            };
            let _ = writeln!(out, "{p}\n{p} {bytes} bytes in {} blocks are {what} ({})", grouped(r.blocks), r.entry);
            for (i, f) in r.stack.iter().enumerate() {
                write_frame(&mut out, &p, i, f);
            }
            if !r.retained_by.is_empty() {
                let hops: Vec<String> = r.retained_by.iter().map(|hop| Escaped(hop).to_string()).collect();
                let hops = hops.join(&format!("\n{p}               -> "));
                let _ = writeln!(out, "{p}  retained by: {hops} -> this block");
            }
            if out.len() >= TEXT_CHUNK {
                emit(&out);
                out.clear();
            }
        }
        let s = &self.summary;
        let _ = writeln!(out, "{p}\n{p} LEAK SUMMARY:");
        for (name, t) in [
            ("definitely lost", s.definitely_lost),
            ("indirectly lost", s.indirectly_lost),
            ("possibly lost", s.possibly_lost),
            ("still reachable", s.still_reachable),
            ("suppressed", s.suppressed),
        ] {
            let _ = writeln!(out, "{p}    {name:>15}: {} bytes in {} blocks", grouped(t.bytes), grouped(t.blocks));
        }
        if hidden.blocks > 0 {
            let _ = writeln!(
                out,
                "{p}    ({} still-reachable records not shown: show_reachable=1, or run --show-reachable)",
                hidden.blocks
            );
        }
        if !self.suppressions_used.is_empty() {
            let _ = writeln!(out, "{p} suppressions used:\n{p}    {:>10} {:>12}  pattern", "blocks", "bytes");
            for u in &self.suppressions_used {
                let _ = writeln!(out, "{p}    {:>10} {:>12}  {}", grouped(u.blocks), grouped(u.bytes), u.pattern);
            }
        }
        let _ = writeln!(
            out,
            "{p} total heap usage: {} allocs, {} frees, {} bytes allocated",
            grouped(s.total_allocs),
            grouped(s.total_frees),
            grouped(s.total_bytes_allocated)
        );
        for note in &self.notes {
            let _ = writeln!(out, "{p} note: {note}");
        }
        emit(&out);
    }
}

/// About how much of the text report [`LeakReport::write_text`] gives at a time.
const TEXT_CHUNK: usize = 64 << 10;

/// Frame `i` of a stack as the text reports print it, after `prefix`: `#i 0x... in function
/// file:line`, or the module where the line is not known. Names come from the program's files
/// and may hold anything: a newline in one forged a line of the report (review helper 106).
pub(crate) fn write_frame(out: &mut String, prefix: &str, i: usize, f: &Frame) {
    let _ = write!(out, "{prefix}    #{i} {} in {}", f.address, Escaped(f.function.as_deref().unwrap_or("??")));
    let (file, module) = (f.file.as_deref().map(Escaped), f.module.as_deref().map(Escaped));
    match (file, f.line, module) {
        // Named from the file of a library unloaded since: which one, and that it is gone.
        (Some(file), Some(line), Some(module)) if f.unloaded => {
            let _ = writeln!(out, " {file}:{line} ({module} (unloaded))");
        }
        (Some(file), Some(line), _) => {
            let _ = writeln!(out, " {file}:{line}");
        }
        (_, _, Some(module)) => {
            let unloaded = if f.unloaded { " (unloaded)" } else { "" };
            match f.offset {
                Some(offset) => {
                    let _ = writeln!(out, " ({module}{unloaded}+{offset:#x})");
                }
                None => {
                    let _ = writeln!(out, " ({module}{unloaded})");
                }
            }
        }
        _ => out.push('\n'),
    }
}

/// `1234567` as `1,234,567`, as every report of mallocspy prints counts.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(size: u64, stack: u32, kind: LeakKind) -> Classified {
        Classified { size, stack, entry: Entry::Malloc, kind, suppressed_by: None, group_leader: None }
    }

    /// memcheck's "232 (16 direct, 216 indirect) bytes in 1 blocks are definitely lost": what a
    /// leak takes with it, said on its record and ordered by (review helper 111: the parent's
    /// 16 bytes said nothing of the 216 lost through it).
    #[test]
    fn a_definitely_lost_record_counts_the_indirectly_lost_blocks_of_its_groups() {
        let led_by = |size, stack, leader| Classified {
            group_leader: Some(leader),
            ..block(size, stack, LeakKind::IndirectlyLost)
        };
        let blocks = [
            block(16, 1, LeakKind::DefinitelyLost),
            led_by(200, 2, 1),
            led_by(16, 3, 1),
            block(100, 4, LeakKind::DefinitelyLost),
            block(150, 5, LeakKind::DefinitelyLost),
        ];
        let stacks = StackOptions { suppressions: &Suppressions::default(), below_main: false };
        let mut namer = Namer::new(stacks, &[], &|_| Vec::new());
        let report = build(7, &blocks, (5, 0, 482), |_| Vec::new(), &mut namer, &HashMap::default(), None, vec![]);
        let records: Vec<(u64, u64)> = report.leaks.iter().map(|r| (r.bytes, r.indirect_bytes)).collect();
        assert_eq!(records, [(16, 216), (200, 0), (150, 0), (100, 0), (16, 0)]);
        assert_eq!(report.summary.definitely_lost, Tally { blocks: 3, bytes: 266 }, "direct bytes only");
        let text = report.to_text(false);
        assert!(
            text.contains("==7== 232 (16 direct, 216 indirect) bytes in 1 blocks are definitely lost (malloc)"),
            "{text}"
        );
        assert!(text.contains("==7== 150 bytes in 1 blocks are definitely lost (malloc)"), "{text}");
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(json["leaks"][0]["indirect_bytes"], 216);
        assert!(json["leaks"][2].get("indirect_bytes").is_none(), "none without a group");
    }

    #[test]
    fn groups_by_stack_and_kind_sorts_by_bytes_and_suppresses_lost_only() {
        let blocks = [
            block(48, 1, LeakKind::DefinitelyLost),
            block(48, 1, LeakKind::DefinitelyLost),
            block(4096, 2, LeakKind::DefinitelyLost),
            block(100, 3, LeakKind::StillReachable),
            block(10, 3, LeakKind::IndirectlyLost),
        ];
        let retained = HashMap::from_iter([(3, vec!["global table (prog)".to_owned()])]);
        let stacks = StackOptions { suppressions: &Suppressions::default(), below_main: false };
        let mut namer = Namer::new(stacks, &[], &|_| Vec::new());
        let report = build(
            7,
            &blocks,
            (50, 21, 18288),
            |_| Vec::new(),
            &mut namer,
            &HashMap::default(),
            Some(&retained),
            vec![],
        );
        assert_eq!(report.summary.definitely_lost, Tally { blocks: 3, bytes: 4192 });
        assert_eq!(report.summary.indirectly_lost, Tally { blocks: 1, bytes: 10 });
        assert_eq!(report.summary.still_reachable, Tally { blocks: 1, bytes: 100 });
        let sizes: Vec<u64> = report.leaks.iter().map(|r| r.bytes).collect();
        assert_eq!(sizes, [4096, 100, 96, 10]);
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(json["summary"]["definitely_lost"]["bytes"], 4192);
        assert_eq!(json["leaks"][0]["kind"], "definitely_lost");
        assert_eq!(json["summary"]["total_allocs"], 50);
        let text = report.to_text(false);
        assert!(text.contains("==7== 4,096 bytes in 1 blocks are definitely lost (malloc)"), "{text}");
        assert!(text.contains("definitely lost: 4,192 bytes in 3 blocks"), "{text}");
        assert!(text.contains("total heap usage: 50 allocs, 21 frees, 18,288 bytes allocated"), "{text}");
        assert!(!text.contains("still reachable (malloc)"), "reachable records hidden by default");
        let text = report.to_text(true);
        assert!(text.contains("==7==  retained by: global table (prog) -> this block"), "{text}");
        assert_eq!(json["leaks"][1]["retained_by"][0], "global table (prog)");
        assert!(json["leaks"][0].get("retained_by").is_none(), "only reachable records have a path");
    }

    #[test]
    fn numbers_are_grouped_by_thousands() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(18288), "18,288");
        assert_eq!(grouped(1234567), "1,234,567");
    }
}
