//! The JSON report: the text report's figures as one object, each site with its full
//! symbolized stacks.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::io::{self, Write};

use serde::Serialize;

use super::Report;
use super::profile::{Figures, RawFrame, StackStats};
use super::sites::{Site, top_live_at_end, top_live_at_peak};
use super::symbolize::SymFrame;

#[derive(Serialize)]
struct Json<'a> {
    trace: String,
    program: &'a [String],
    pid: u32,
    options: &'a str,
    sampling: &'static str,
    /// Mean bytes between samples (poisson) or the tick stride (tick).
    interval: u64,
    start_unix_ns: u64,
    duration_ns: u64,
    /// The trace has its end record: the program exited normally.
    complete: bool,
    /// Where the file is cut inside a record, if it is.
    truncated_at: Option<u64>,
    /// Records of tags this mallocspy does not know, skipped (a later version's, or damage).
    skipped_records: u64,
    lost_events: u64,
    /// Threads seen starting (fewer than ran when their events were among the lost).
    threads: u64,
    ticks: u64,
    frees: u64,
    unmatched_frees: u64,
    allocated: JsonFigures,
    /// The exact totals of the newest heap statistics event, if the trace has one.
    counted: Option<JsonCounted>,
    /// mallocspy's own memory in the process (from the heap statistics), if the trace says.
    own_memory: Option<JsonOwnMemory>,
    peak: JsonPeak,
    /// The live heap as the program estimated it from its own samples (at its heap statistics
    /// events), if the trace has one: with events lost, the replay's `peak` and `live_at_end`
    /// keep samples whose frees were lost, these do not.
    program_estimates: Option<JsonProgramEstimates>,
    live_at_end: JsonFigures,
    /// A forked child's: the sampled blocks live in its parent at the fork.
    inherited: Option<JsonInherited>,
    top_by_bytes_allocated: Vec<JsonSite<'a>>,
    top_by_live_at_peak: Vec<JsonSite<'a>>,
    top_by_live_at_end: Vec<JsonSite<'a>>,
}

#[derive(Serialize)]
struct JsonOwnMemory {
    /// Bytes at the newest heap statistics event.
    at_end: u64,
    /// The most any event said.
    most: u64,
}

#[derive(Serialize)]
struct JsonCounted {
    calls: u64,
    bytes: u64,
}

#[derive(Serialize)]
struct JsonInherited {
    parent: u32,
    at_fork: JsonFigures,
}

#[derive(Serialize)]
struct JsonProgramEstimates {
    peak_live_bytes: u64,
    /// The time of the first event that saw the peak: it came at or before then.
    peak_by_ns: u64,
    /// At the newest event.
    live_bytes_at_last: u64,
}

#[derive(Serialize)]
struct JsonPeak {
    live_bytes: u64,
    time_ns: u64,
}

/// Estimates: `objects` is a sum of `weight / size`, so fractional.
#[derive(Serialize)]
struct JsonFigures {
    bytes: u64,
    objects: f64,
    samples: u64,
}

impl From<Figures> for JsonFigures {
    fn from(f: Figures) -> Self {
        JsonFigures { bytes: f.bytes, objects: f.objects.max(0.0), samples: f.samples }
    }
}

#[derive(Serialize)]
struct JsonSite<'a> {
    site: &'a str,
    function: Option<&'a str>,
    file: Option<&'a str>,
    line: Option<u32>,
    module: Option<&'a str>,
    allocated: JsonFigures,
    live_at_peak: JsonFigures,
    live_at_end: JsonFigures,
    /// The site's stacks, most bytes allocated first, at most [`STACKS_PER_SITE`].
    stacks: Vec<JsonStack<'a>>,
    /// How many more it has (their figures are in the site's).
    stacks_not_listed: usize,
}

/// Stacks listed per site: a site that many stacks reach (a wrapper every allocation goes
/// through) listed every one, and a trace of 3 MB made 223 MB of JSON (review helper 36).
const STACKS_PER_SITE: usize = 100;

#[derive(Serialize)]
struct JsonStack<'a> {
    /// The trace's id of the stack, or of the first of those whose frames read the same.
    id: u64,
    /// How many of the trace's stacks these figures sum: 1, or more when stacks read the same
    /// (a library reloaded where it was gives its stacks new ids in each load).
    traced_stacks: u64,
    allocated: JsonFigures,
    live_at_peak: JsonFigures,
    live_at_end: JsonFigures,
    /// Estimated bytes allocated per kind.
    small_bytes: u64,
    large_bytes: u64,
    aligned_bytes: u64,
    /// Innermost first; inlined calls are frames of their own.
    frames: Vec<JsonFrame<'a>>,
    /// Cut at the recorded depth (`stack_depth`): its outermost frames are missing.
    truncated: bool,
}

#[derive(Serialize, PartialEq, Eq, Hash)]
struct JsonFrame<'a> {
    address: String,
    module: Option<&'a str>,
    /// The address in the module's file (run-time address minus the load bias).
    offset: Option<String>,
    function: &'a str,
    file: Option<&'a str>,
    line: Option<u32>,
    /// Inlined into the next frame (same address).
    inlined: bool,
    symbolized: bool,
}

fn stack<'r>(report: &'r Report<'_>, m: &Merged<'r>) -> JsonStack<'r> {
    let modules = &report.profile.modules;
    let mut frames = Vec::new();
    for &raw in &m.first.frames {
        let location = report.symbols.location(raw);
        let module = location.module.map(|m| &modules[m]);
        let last = location.frames.len() - 1;
        for (i, f) in location.frames.iter().enumerate() {
            frames.push(JsonFrame {
                address: format!("{:#x}", location.address),
                module: module.map(|m| m.path.as_str()),
                offset: module.map(|m| format!("{:#x}", location.address.wrapping_sub(m.base))),
                function: &f.function,
                file: f.file.as_deref(),
                line: f.line,
                inlined: i < last,
                symbolized: location.symbolized,
            });
        }
    }
    JsonStack {
        id: m.first.id,
        traced_stacks: m.traced_stacks,
        allocated: m.allocated.into(),
        live_at_peak: m.live_at_peak.into(),
        live_at_end: m.live_at_end.into(),
        small_bytes: m.kind_bytes[0],
        large_bytes: m.kind_bytes[1],
        aligned_bytes: m.kind_bytes[2],
        frames,
        truncated: report.profile.is_cut(m.first),
    }
}

fn site<'r>(report: &'r Report<'_>, site: &'r Site<'_>) -> JsonSite<'r> {
    let frame = site.frame.filter(|f| f.location.symbolized).map(|f| f.frame);
    let stacks = site.stacks.iter().map(|&i| &report.profile.stacks[i]);
    let mut stacks = merged(stacks, |s| s.frames.iter().map(|&raw| reading(report, raw)));
    let stacks_not_listed = stacks.len().saturating_sub(STACKS_PER_SITE);
    stacks.truncate(STACKS_PER_SITE);
    JsonSite {
        site: &site.label,
        function: frame.map(|f| f.function.as_str()),
        file: frame.and_then(|f| f.file.as_deref()),
        line: frame.and_then(|f| f.line),
        module: site.frame.and_then(|f| f.location.module).map(|m| report.profile.modules[m].path.as_str()),
        allocated: site.allocated.into(),
        live_at_peak: site.live_at_peak.into(),
        live_at_end: site.live_at_end.into(),
        // Only those listed are spelled out, frame by frame: all of a site's 335,000 stacks
        // were, before they were merged and cut, and the report took 2.4 GB for a trace of
        // 83 MB (review helper 68).
        stacks: stacks.iter().map(|m| stack(report, m)).collect(),
        stacks_not_listed,
    }
}

/// How one frame of a stack reads in the report, borrowed from the symbols: what its
/// [`JsonFrame`]s show (the offset is the address less the module's base).
#[derive(PartialEq, Eq, Hash)]
struct Reading<'r> {
    address: u64,
    module: Option<(&'r str, u64)>,
    symbolized: bool,
    frames: &'r [SymFrame],
}

fn reading<'r>(report: &'r Report<'_>, raw: RawFrame) -> Reading<'r> {
    let location = report.symbols.location(raw);
    let module = location.module.map(|m| &report.profile.modules[m]).map(|m| (m.path.as_str(), m.base));
    Reading { address: location.address, module, symbolized: location.symbolized, frames: &location.frames }
}

/// Stacks that read the same, as one: the first of them, with the figures of all.
struct Merged<'r> {
    first: &'r StackStats,
    traced_stacks: u64,
    allocated: Figures,
    live_at_peak: Figures,
    live_at_end: Figures,
    kind_bytes: [u64; 3],
}

/// `stacks`, those that read the same by `reads_as` as one, most bytes allocated first (else
/// in the order of their first): a plugin reloaded 18,000 times made a site of 18,000 stacks
/// alike (852 MB of JSON).
fn merged<'r, R: Hash + Eq, I: Iterator<Item = R>>(
    stacks: impl Iterator<Item = &'r StackStats>,
    reads_as: impl Fn(&'r StackStats) -> I,
) -> Vec<Merged<'r>> {
    let hasher = RandomState::new();
    let mut out: Vec<Merged<'r>> = Vec::new();
    let mut by_hash: HashMap<u64, Vec<usize>> = HashMap::new();
    for s in stacks {
        let mut h = hasher.build_hasher();
        reads_as(s).for_each(|r| r.hash(&mut h));
        let candidates = by_hash.entry(h.finish()).or_default();
        match candidates.iter().find(|&&i| reads_as(out[i].first).eq(reads_as(s))) {
            Some(&i) => {
                // Saturating, as every other total: a trace's figures may be anything.
                let into = &mut out[i];
                into.traced_stacks = into.traced_stacks.saturating_add(1);
                into.allocated.add(s.allocated);
                into.live_at_peak.add(s.live_at_peak);
                into.live_at_end.add(s.live_at_end);
                for (sum, bytes) in into.kind_bytes.iter_mut().zip(s.kind_bytes) {
                    *sum = sum.saturating_add(bytes);
                }
            }
            None => {
                candidates.push(out.len());
                out.push(Merged {
                    first: s,
                    traced_stacks: 1,
                    allocated: s.allocated,
                    live_at_peak: s.live_at_peak,
                    live_at_end: s.live_at_end,
                    kind_bytes: s.kind_bytes,
                });
            }
        }
    }
    out.sort_by_key(|m| std::cmp::Reverse(m.allocated.bytes));
    out
}

/// Writes the report as one JSON object (and a newline).
pub fn write(report: &Report<'_>, out: &mut dyn Write) -> io::Result<()> {
    let p = report.profile;
    let h = &p.header;
    let sites = report.sites();
    let json = Json {
        trace: report.trace.display().to_string(),
        program: &h.command,
        pid: h.pid,
        options: &h.options,
        sampling: h.sampling.name(),
        interval: h.interval,
        start_unix_ns: h.start_unix_ns,
        duration_ns: p.duration_ns(),
        complete: p.end_ns.is_some(),
        truncated_at: p.truncated_at,
        skipped_records: p.skipped_records.0,
        lost_events: p.lost_events,
        threads: p.threads,
        ticks: p.allocated.samples,
        frees: p.frees,
        unmatched_frees: p.unmatched_frees,
        allocated: p.allocated.into(),
        counted: p.counted().map(|(calls, bytes)| JsonCounted { calls, bytes }),
        own_memory: p.own_memory().map(|(at_end, most)| JsonOwnMemory { at_end, most }),
        peak: JsonPeak { live_bytes: p.peak.live_bytes, time_ns: p.peak.time_ns },
        program_estimates: p.stats_live().map(|(peak, last)| JsonProgramEstimates {
            peak_live_bytes: peak.live_bytes,
            peak_by_ns: peak.time_ns,
            live_bytes_at_last: last,
        }),
        live_at_end: p.live_at_end.into(),
        inherited: p.inherited.map(|i| JsonInherited { parent: i.parent, at_fork: i.at_fork.into() }),
        top_by_bytes_allocated: sites
            .iter()
            .filter(|s| s.allocated.samples > 0)
            .take(report.top)
            .map(|s| site(report, s))
            .collect(),
        top_by_live_at_peak: top_live_at_peak(&sites, report.top).into_iter().map(|s| site(report, s)).collect(),
        top_by_live_at_end: top_live_at_end(&sites, report.top).into_iter().map(|s| site(report, s)).collect(),
    };
    serde_json::to_writer(&mut *out, &json)?;
    writeln!(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack_of(id: u64, bytes: u64) -> StackStats {
        let figures = Figures { bytes, objects: 1.0, samples: bytes };
        StackStats {
            id,
            frames: Vec::new(),
            allocated: figures,
            kind_bytes: [bytes; 3],
            live_at_peak: figures,
            live_at_end: figures,
        }
    }

    /// Stacks that read the same add up to at most `u64::MAX`: their sum wrapped to 0 beside a
    /// site's saturated total (review helper 36), and panicked with overflow checks.
    #[test]
    fn merged_figures_saturate() {
        let stacks = [stack_of(1, u64::MAX), stack_of(2, 1)];
        let merged = merged(stacks.iter(), |_| std::iter::empty::<u64>());
        let [only] = &merged[..] else { panic!("{} stacks", merged.len()) };
        assert_eq!((only.first.id, only.traced_stacks), (1, 2));
        for sum in [&only.allocated, &only.live_at_peak, &only.live_at_end] {
            assert_eq!((sum.bytes, sum.samples), (u64::MAX, u64::MAX));
        }
        assert_eq!(only.kind_bytes, [u64::MAX; 3]);
    }

    #[test]
    fn stacks_that_read_differently_stay_apart_most_bytes_first() {
        let stacks = [stack_of(1, 10), stack_of(2, 30), stack_of(3, 20)];
        let merged = merged(stacks.iter(), |s| std::iter::once(s.id % 2));
        let listed: Vec<(u64, u64, u64)> =
            merged.iter().map(|m| (m.first.id, m.traced_stacks, m.allocated.bytes)).collect();
        assert_eq!(listed, [(1, 2, 30), (2, 1, 30)]);
    }
}
