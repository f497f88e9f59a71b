//! Aggregation: a trace's events into per-stack estimates.
//!
//! A tick is a weighted sample, as .NET's GCAllocationTick: it stands for `weight` bytes
//! allocated, so sums of weights estimate the program's true totals, and `weight / size`
//! estimates how many blocks of that size the sample stands for. A `Free` names a sampled
//! block; the live heap is replayed from both to find its largest moment (the peak) and what was
//! live then, per stack.

use std::collections::{BTreeMap, HashMap};

use mallocspy::trace::{Event, Header, HeapStats, Module, Reader, Tick, TraceError};

use super::envelope::{Envelope, total};
use super::progress::Progress;

/// Estimates of a set of allocations.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Figures {
    /// Estimated bytes: the samples' weights summed.
    pub bytes: u64,
    /// Estimated blocks: each sample's `weight / size`, summed.
    pub objects: f64,
    /// Samples (ticks) counted.
    pub samples: u64,
}

impl Figures {
    fn of(tick: &Tick) -> Figures {
        // A sampled allocation asked for at least one byte; guard the division all the same.
        Figures { bytes: tick.weight, objects: tick.weight as f64 / tick.size.max(1) as f64, samples: 1 }
    }

    /// Adds `other` in.
    pub fn add(&mut self, other: Figures) {
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.objects += other.objects;
        self.samples = self.samples.saturating_add(other.samples);
    }

    fn sub(&mut self, other: Figures) {
        self.bytes = self.bytes.saturating_sub(other.bytes);
        self.objects -= other.objects;
        self.samples = self.samples.saturating_sub(other.samples);
        self.settle();
    }

    /// No sample, no object: the sum of fractions added and taken away leaves a residue
    /// (`"objects": 5.684341886080802e-14` with nothing live; review helper 85).
    fn settle(&mut self) {
        if self.samples == 0 {
            self.objects = 0.0;
        }
    }
}

/// One frame of a recorded stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawFrame {
    /// The return address.
    pub address: u64,
    /// The module (index into [`Profile::modules`]) mapped at that address when the stack was
    /// recorded: a later `dlclose` and `dlopen` may put another module there.
    pub module: Option<usize>,
}

/// The figures of one recorded call stack.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StackStats {
    /// Its id in the trace.
    pub id: u64,
    /// Innermost first; the first frame is the allocator's caller.
    pub frames: Vec<RawFrame>,
    /// Everything its ticks stand for.
    pub allocated: Figures,
    /// Estimated bytes allocated per kind (small, large, aligned).
    pub kind_bytes: [u64; 3],
    /// Live at the moment the estimated live heap was largest.
    pub live_at_peak: Figures,
    /// Live when the trace ends.
    pub live_at_end: Figures,
}

/// The largest estimated live heap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peak {
    /// Estimated live bytes then.
    pub live_bytes: u64,
    /// When, nanoseconds since the start.
    pub time_ns: u64,
}

/// Everything a report is made from.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// The trace's header.
    pub header: Header,
    /// Every module loaded, in trace order (frames refer to them by index).
    pub modules: Vec<Module>,
    /// One entry per recorded stack.
    pub stacks: Vec<StackStats>,
    /// The heap statistics events, in order.
    pub heap_stats: Vec<HeapStats>,
    /// The estimated live bytes per kind replayed from the ticks and frees, `(time, bytes)`,
    /// thinned to its envelope ([`Envelope`]): taken every `stats_interval_ms`, and only when
    /// the program allocates, the statistics miss a short spike (the peak among them), and a
    /// heap freed just after one of them.
    pub replayed_live: Vec<(u64, [u64; 3])>,
    /// All ticks together.
    pub allocated: Figures,
    /// Sampled blocks not freed by the end.
    pub live_at_end: Figures,
    /// The largest estimated live heap.
    pub peak: Peak,
    /// Frees that matched a live sampled block.
    pub frees: u64,
    /// Frees of addresses no live tick had (ignored: their tick was lost, or the free came
    /// after a `realloc` moved a block that was sampled before the trace began).
    pub unmatched_frees: u64,
    /// Events the writer dropped.
    pub lost_events: u64,
    /// When the writer said it had dropped some (each time after the drops it counts).
    pub lost_at_ns: Vec<u64>,
    /// Threads that started.
    pub threads: u64,
    /// The `End` record's time, if the trace has one.
    pub end_ns: Option<u64>,
    /// The latest time of any event.
    pub last_time_ns: u64,
    /// Where the file is cut inside a record, if it is.
    pub truncated_at: Option<u64>,
    /// Records of tags this mallocspy does not know, skipped: how many, and where the first
    /// starts (a later version's, or damage).
    pub skipped_records: (u64, Option<u64>),
    /// The trace of a forked child: its parent's pid and the pseudo-stack (an index into
    /// [`Profile::stacks`], without frames) of the sampled blocks it inherited, live here too.
    pub inherited: Option<Inherited>,
    /// The most frames the program kept of a stack: its `stack_depth` option.
    pub stack_depth: usize,
}

/// The sampled blocks a forked child inherited from its parent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Inherited {
    /// The parent's pid (its trace has their stacks).
    pub parent: u32,
    /// Their pseudo-stack in [`Profile::stacks`]: what of them was live at the peak and at
    /// the end.
    pub stack: usize,
    /// All of them, live at the fork.
    pub at_fork: Figures,
}

/// The name the tree-shaped reports give the missing root of a stack cut at the recorded depth.
pub const CUT: &str = "[deeper frames not recorded]";
/// The name the reports give a stack whose frames the trace does not have.
pub const NOT_RECORDED: &str = "[stack not recorded]";

impl Profile {
    /// Whether `stack` was cut at the recorded depth, its outermost frames missing: the root
    /// the flame graph and pprof show it under is then not the program's (a program's stacks
    /// took a dozen roots). A stack exactly that deep is taken for one cut too.
    pub fn is_cut(&self, stack: &StackStats) -> bool {
        self.stack_depth > 0 && !stack.frames.is_empty() && stack.frames.len() >= self.stack_depth
    }

    /// How long the program ran: until its `End` record, or its last event when it has none.
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.unwrap_or(self.last_time_ns).max(self.last_time_ns)
    }

    /// mallocspy's own memory in the process, from the heap statistics: at the last event and
    /// the most any said.
    pub fn own_memory(&self) -> Option<(u64, u64)> {
        let last = self.heap_stats.iter().max_by_key(|s| s.time_ns)?;
        Some((last.own_bytes, self.heap_stats.iter().map(|s| s.own_bytes).max().unwrap_or(0)))
    }

    /// The live heap as the program estimated it from its own live samples, which no dropped
    /// event touched: its peak, with the time of the first heap statistics event that saw it
    /// (the peak came at or before it, after the event before), and the live bytes at the
    /// newest event. `None` without one. The peak is the events' own `peak_live_bytes`, which
    /// each sample raises: the highest `live_bytes` of the events missed a peak between two of
    /// them (review helper 67: 37.1 MiB of a 40.4 MiB peak).
    pub fn stats_live(&self) -> Option<(Peak, u64)> {
        let last = self.heap_stats.iter().max_by_key(|s| s.time_ns)?;
        let peak_of = |s: &HeapStats| s.peak_live_bytes.max(s.live_bytes());
        let top = self.heap_stats.iter().max_by_key(|s| (peak_of(s), std::cmp::Reverse(s.time_ns)))?;
        Some((Peak { live_bytes: peak_of(top), time_ns: top.time_ns }, last.live_bytes()))
    }

    /// The exact totals, `(allocation calls, bytes)`, of the newest heap statistics event (they
    /// only grow); `None` without one. Where the estimate falls short, they do not: in tick
    /// mode each thread's bytes since its last tick are in no tick (a thread pool's threads
    /// that end before their first tick leave an estimate of nothing).
    pub fn counted(&self) -> Option<(u64, u64)> {
        let last = self.heap_stats.iter().max_by_key(|s| s.time_ns)?;
        // Saturating: a damaged trace may hold any numbers.
        Some(last.kinds.iter().fold((0, 0), |(calls, bytes): (u64, u64), k| {
            (calls.saturating_add(k.allocs), bytes.saturating_add(k.bytes))
        }))
    }
}

/// Reads a whole trace, reporting progress by bytes read.
///
/// # Errors
/// A file that is not a trace, or a damaged record. A file cut inside a record is not an
/// error: the events before the cut make the profile, and [`Profile::truncated_at`] says where.
pub fn read(bytes: &[u8], progress: &mut Progress) -> Result<Profile, TraceError> {
    let mut reader = Reader::new(bytes)?;
    progress.stage("reading", bytes.len() as u64);
    let mut aggregator = Aggregator::new(reader.header().clone());
    let mut events = 0u64;
    // Not `for`: the loop asks the reader for its offset.
    while let Some(event) = reader.next() {
        aggregator.add(event?);
        events += 1;
        if events.is_multiple_of(4096) {
            progress.set(reader.offset());
        }
    }
    progress.set(reader.offset());
    let mut profile = aggregator.finish();
    profile.truncated_at = reader.truncated();
    profile.skipped_records = reader.skipped();
    Ok(profile)
}

/// A sampled block that is live.
struct Live {
    stack: usize,
    kind: usize,
    figures: Figures,
}

/// How a stack's live figures changed since the last peak. Bytes and samples count modulo
/// 2^64 (a stack may lose what it held at the peak before it gains), which comes out right once
/// added to what it held at the peak.
#[derive(Clone, Copy, Default)]
struct SincePeak {
    bytes: u64,
    objects: f64,
    samples: u64,
    touched: bool,
}

/// Hashes addresses and stack ids with one multiplication: they are distinct numbers, not
/// attacker input, and looking them up is the aggregation's hot path.
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        // Fibonacci hashing: the odd multiplier spreads the bits into the high ones, which
        // the table uses first.
        self.0 = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type IdMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Builds a [`Profile`] one event at a time.
pub struct Aggregator {
    profile: Profile,
    stack_index: IdMap<usize>,
    /// The indices of the modules loaded now, by their id (an id loaded twice without an
    /// unload, in a damaged trace, has both).
    loaded: IdMap<Vec<usize>>,
    /// The loaded modules' ranges: start, to end and module index. Kept in order as modules
    /// come and go, so that a load, an unload or a frame's lookup costs a logarithm of the
    /// ranges (sorting them all again for each stack after a load was quadratic: a trace of
    /// 40,000 plugins took over 30 s).
    ranges: BTreeMap<u64, (u64, usize)>,
    live: IdMap<Live>,
    /// The live sampled bytes per kind (small, large, aligned).
    live_kinds: [u64; 3],
    /// Per stack, the changes since the last peak, and the stacks they touched: a new peak
    /// brings `live_at_peak` up to date from them, so the figures at the peak take one pass
    /// over the events and memory per stack, not per event.
    since_peak: Vec<SincePeak>,
    touched: Vec<usize>,
    /// The replayed live heap (see [`Profile::replayed_live`]).
    replayed: Envelope,
}

/// The stack depth the run's options set: its own key only, as a trace recorded by an earlier
/// version may hold an option this one refuses (a `trace` path with `%t`, review helper 138);
/// the default's for a damaged or missing one (no stack is taken for cut unless it is that
/// deep).
fn stack_depth_of(options: &str) -> usize {
    options
        .split(':')
        .filter_map(|pair| pair.split_once('=').filter(|(key, _)| key.trim() == "stack_depth").map(|(_, value)| value))
        .next_back()
        .and_then(|value| mallocspy::options::Options::parse(&format!("stack_depth={value}")).ok())
        .unwrap_or_default()
        .stack_depth
}

impl Aggregator {
    /// An empty aggregate of the trace with this header.
    pub fn new(header: Header) -> Self {
        Aggregator {
            profile: Profile { stack_depth: stack_depth_of(&header.options), header, ..Profile::default() },
            stack_index: IdMap::default(),
            loaded: IdMap::default(),
            ranges: BTreeMap::new(),
            live: IdMap::default(),
            live_kinds: [0; 3],
            since_peak: Vec::new(),
            touched: Vec::new(),
            replayed: Envelope::default(),
        }
    }

    /// Takes in the next event.
    pub fn add(&mut self, event: Event) {
        if let Some(t) = event.time_ns() {
            self.profile.last_time_ns = self.profile.last_time_ns.max(t);
        }
        match event {
            Event::ModuleLoad { module, .. } => {
                let index = self.profile.modules.len();
                // A range starting where another does replaces it: the older module must
                // have been unmapped for the newer one to be mapped there.
                self.ranges.extend(module.ranges.iter().map(|&(start, end)| (start, (end, index))));
                self.loaded.entry(module.id).or_default().push(index);
                self.profile.modules.push(module);
            }
            Event::ModuleUnload { id, .. } => {
                for index in self.loaded.remove(&id).unwrap_or_default() {
                    for &(start, _) in &self.profile.modules[index].ranges {
                        if self.ranges.get(&start).is_some_and(|&(_, m)| m == index) {
                            self.ranges.remove(&start);
                        }
                    }
                }
            }
            Event::Stack { id, frames } => {
                let frames = frames.into_iter().map(|address| RawFrame { address, module: self.module_at(address) });
                let stack = StackStats { id, frames: frames.collect(), ..StackStats::default() };
                // A repeated id (it should not happen) starts a new stack: ticks before it keep the old frames.
                self.stack_index.insert(id, self.profile.stacks.len());
                self.profile.stacks.push(stack);
                self.since_peak.push(SincePeak::default());
            }
            Event::Tick(tick) => self.tick(&tick),
            Event::Inherited { parent, kind, size, address, weight } => {
                let figures = Figures { bytes: weight, objects: weight as f64 / size.max(1) as f64, samples: 1 };
                let stack = self.inherited_stack(parent, figures);
                self.born(address, Live { stack, kind: usize::from(kind).min(2), figures }, 0);
            }
            Event::Free { time_ns, address, .. } => match self.live.remove(&address) {
                Some(block) => {
                    self.profile.frees += 1;
                    self.release(block);
                    self.replay(time_ns);
                }
                None => self.profile.unmatched_frees += 1,
            },
            Event::HeapStats(stats) => self.profile.heap_stats.push(stats),
            Event::ThreadStart { .. } => self.profile.threads += 1,
            Event::ThreadExit { .. } => {}
            Event::Lost { time_ns, events } => {
                self.profile.lost_events = self.profile.lost_events.saturating_add(events);
                self.profile.lost_at_ns.push(time_ns);
            }
            Event::End { time_ns } => self.profile.end_ns = Some(time_ns),
        }
    }

    /// The loaded module whose executable ranges hold return address `address`.
    fn module_at(&self, address: u64) -> Option<usize> {
        // A return address follows its call: a call that ends a function (to a function that does not
        // return) leaves one just past the range, so look up the call's own last byte.
        let at = address.checked_sub(1)?;
        let (_, &(end, module)) = self.ranges.range(..=at).next_back()?;
        (at < end).then_some(module)
    }

    fn stack_of(&mut self, id: u64) -> usize {
        if let Some(&i) = self.stack_index.get(&id) {
            return i;
        }
        // The Stack record was lost: keep the figures, under a stack with no frames.
        let i = self.profile.stacks.len();
        self.profile.stacks.push(StackStats { id, ..StackStats::default() });
        self.since_peak.push(SincePeak::default());
        self.stack_index.insert(id, i);
        i
    }

    /// The pseudo-stack of the inherited blocks, made at the first of them.
    fn inherited_stack(&mut self, parent: u32, figures: Figures) -> usize {
        let inherited = self.profile.inherited.get_or_insert_with(|| {
            self.profile.stacks.push(StackStats { id: u64::MAX, ..StackStats::default() });
            self.since_peak.push(SincePeak::default());
            Inherited { parent, stack: self.profile.stacks.len() - 1, at_fork: Figures::default() }
        });
        inherited.at_fork.add(figures);
        inherited.stack
    }

    fn tick(&mut self, tick: &Tick) {
        let stack = self.stack_of(tick.stack);
        let figures = Figures::of(tick);
        let kind = usize::from(tick.kind).min(2);
        let s = &mut self.profile.stacks[stack];
        s.allocated.add(figures);
        s.kind_bytes[kind] = s.kind_bytes[kind].saturating_add(tick.weight);
        self.profile.allocated.add(figures);
        self.born(tick.address, Live { stack, kind, figures }, tick.time_ns);
    }

    /// A sampled block at `address` is live from `time_ns`.
    fn born(&mut self, address: u64, block: Live, time_ns: u64) {
        // The allocator never hands out a live block twice: the free of the old one was lost.
        if let Some(old) = self.live.remove(&address) {
            self.release(old);
        }
        let (stack, kind, figures) = (block.stack, block.kind, block.figures);
        self.profile.stacks[stack].live_at_end.add(figures);
        self.live.insert(address, block);
        self.live_kinds[kind] = self.live_kinds[kind].saturating_add(figures.bytes);
        self.replay(time_ns);
        self.changed(stack, figures, true);
        // Only new blocks raise the live heap, so only they can make a new peak.
        let live_bytes = total(&self.live_kinds);
        if live_bytes > self.profile.peak.live_bytes {
            self.profile.peak = Peak { live_bytes, time_ns };
            for stack in self.touched.drain(..) {
                let change = std::mem::take(&mut self.since_peak[stack]);
                let at_peak = &mut self.profile.stacks[stack].live_at_peak;
                at_peak.bytes = at_peak.bytes.wrapping_add(change.bytes);
                at_peak.objects += change.objects;
                at_peak.samples = at_peak.samples.wrapping_add(change.samples);
                at_peak.settle();
            }
        }
    }

    fn changed(&mut self, stack: usize, figures: Figures, allocated: bool) {
        let change = &mut self.since_peak[stack];
        if !change.touched {
            change.touched = true;
            self.touched.push(stack);
        }
        if allocated {
            change.bytes = change.bytes.wrapping_add(figures.bytes);
            change.objects += figures.objects;
            change.samples = change.samples.wrapping_add(1);
        } else {
            change.bytes = change.bytes.wrapping_sub(figures.bytes);
            change.objects -= figures.objects;
            change.samples = change.samples.wrapping_sub(1);
        }
    }

    fn release(&mut self, block: Live) {
        self.profile.stacks[block.stack].live_at_end.sub(block.figures);
        self.live_kinds[block.kind] = self.live_kinds[block.kind].saturating_sub(block.figures.bytes);
        self.changed(block.stack, block.figures, false);
    }

    /// Notes the live heap per kind at `time_ns`.
    fn replay(&mut self, time_ns: u64) {
        self.replayed.note((time_ns, self.live_kinds));
    }

    /// The profile of the events taken in.
    pub fn finish(mut self) -> Profile {
        self.profile.replayed_live = self.replayed.finish();
        for s in &self.profile.stacks {
            self.profile.live_at_end.add(s.live_at_end);
        }
        self.profile
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mallocspy::trace::{Kind, write_event, write_header};

    fn tick(time_ns: u64, address: u64, size: u64, weight: u64, stack: u64) -> Event {
        Event::Tick(Tick { time_ns, thread: 0, kind: Kind::Small as u8, entry: 0, size, address, weight, stack })
    }

    fn free(time_ns: u64, address: u64) -> Event {
        Event::Free { time_ns, thread: 0, address }
    }

    fn aggregate(events: Vec<Event>) -> Profile {
        let mut a = Aggregator::new(Header::default());
        for e in events {
            a.add(e);
        }
        a.finish()
    }

    #[test]
    fn weights_sum_to_bytes_and_weight_over_size_to_objects() {
        let p = aggregate(vec![
            Event::Stack { id: 1, frames: vec![0x1000] },
            Event::Stack { id: 2, frames: vec![0x2000] },
            tick(1, 0xa0, 100, 1000, 1),
            tick(2, 0xb0, 300, 900, 1),
            tick(3, 0xc0, 64, 640, 2),
        ]);
        let s1 = &p.stacks[0];
        assert_eq!((s1.allocated.bytes, s1.allocated.samples), (1900, 2));
        assert!((s1.allocated.objects - 13.0).abs() < 1e-9, "{}", s1.allocated.objects);
        assert_eq!(p.stacks[1].allocated.bytes, 640);
        assert!((p.stacks[1].allocated.objects - 10.0).abs() < 1e-9);
        assert_eq!(p.allocated.bytes, 2540);
        assert_eq!(p.allocated.samples, 3);
    }

    #[test]
    fn nothing_live_is_no_objects_whatever_the_fractions_left() {
        let mut events = vec![Event::Stack { id: 1, frames: vec![0x1000] }];
        // 100/3 objects each: in floating point, three added and taken away leave -1.4e-14.
        events.extend((0..3).map(|i| tick(i, 0xa0 + i * 16, 3, 100, 1)));
        events.extend((0..3).map(|i| free(10 + i, 0xa0 + i * 16)));
        let s = &aggregate(events).stacks[0];
        assert_eq!((s.live_at_end.samples, s.live_at_end.objects), (0, 0.0));
        assert!((s.live_at_peak.objects - 100.0).abs() < 1e-9, "{}", s.live_at_peak.objects);
    }

    #[test]
    fn inherited_blocks_are_live_not_allocated_and_their_frees_match() {
        let inherited = |address, weight| Event::Inherited { parent: 7, kind: 0, size: 100, address, weight };
        let p = aggregate(vec![
            inherited(0xa0, 1000),
            inherited(0xb0, 500),
            Event::Stack { id: 1, frames: vec![0x1000] },
            free(1, 0xa0),
            tick(2, 0xc0, 100, 200, 1),
        ]);
        let i = p.inherited.expect("inherited blocks");
        assert_eq!((i.parent, i.at_fork.bytes, i.at_fork.samples), (7, 1500, 2));
        assert_eq!((p.allocated.bytes, p.frees, p.unmatched_frees), (200, 1, 0));
        assert_eq!(p.peak, Peak { live_bytes: 1500, time_ns: 0 });
        let s = &p.stacks[i.stack];
        assert_eq!((s.allocated.samples, s.live_at_peak.bytes, s.live_at_end.bytes), (0, 1500, 500));
        assert_eq!(p.live_at_end.bytes, 700);
    }

    #[test]
    fn the_peak_is_the_largest_replayed_live_heap_with_its_stacks_then() {
        // Stack 1 holds 1000 bytes, frees them, then stack 2 grows to 800: the peak is at
        // time 2 (1000 + 500), not at the end, and stack 2 had only its first 500 then.
        let p = aggregate(vec![
            Event::Stack { id: 1, frames: vec![0x1000] },
            Event::Stack { id: 2, frames: vec![0x2000] },
            tick(1, 0xa0, 100, 1000, 1),
            tick(2, 0xb0, 50, 500, 2),
            free(3, 0xa0),
            tick(4, 0xc0, 30, 300, 2),
            free(5, 0x999), // unknown: ignored
        ]);
        assert_eq!(p.peak, Peak { live_bytes: 1500, time_ns: 2 });
        assert_eq!(p.stacks[0].live_at_peak.bytes, 1000);
        assert_eq!(p.stacks[0].live_at_peak.samples, 1);
        assert_eq!(p.stacks[1].live_at_peak.bytes, 500);
        assert!((p.stacks[1].live_at_peak.objects - 10.0).abs() < 1e-9);
        assert_eq!(p.stacks[0].live_at_end.bytes, 0);
        assert_eq!(p.stacks[1].live_at_end.bytes, 800);
        assert_eq!(p.live_at_end.bytes, 800);
        assert_eq!((p.frees, p.unmatched_frees), (1, 1));
    }

    #[test]
    fn a_later_peak_replaces_an_earlier_one() {
        let p = aggregate(vec![
            Event::Stack { id: 1, frames: vec![0x1000] },
            tick(1, 0xa0, 10, 100, 1),
            free(2, 0xa0),
            tick(3, 0xb0, 10, 100, 1),
            tick(4, 0xc0, 10, 100, 1),
        ]);
        assert_eq!(p.peak, Peak { live_bytes: 200, time_ns: 4 });
        assert_eq!(p.stacks[0].live_at_peak, Figures { bytes: 200, objects: 20.0, samples: 2 });
    }

    #[test]
    fn live_at_peak_matches_a_naive_replay_of_random_traces() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for round in 0..200 {
            let mut events: Vec<Event> = (1..=4).map(|id| Event::Stack { id, frames: vec![id * 0x100] }).collect();
            // The naive model: the live blocks after each event, the peak's copy of them.
            let mut live: HashMap<u64, (u64, u64)> = HashMap::new();
            let (mut peak, mut at_peak) = (0u64, HashMap::new());
            for t in 0..300 {
                if next(3) == 0 {
                    // Mostly live blocks, sometimes unknown ones.
                    let address = live.keys().copied().nth(next(live.len() as u64 + 1) as usize).unwrap_or(0xdead);
                    live.remove(&address);
                    events.push(free(t, address));
                } else {
                    // Few addresses, so that some are reused without their free.
                    let (address, stack, weight) = (next(64) * 16, 1 + next(4), 1 + next(5000));
                    live.insert(address, (stack, weight));
                    events.push(tick(t, address, 1 + next(100), weight, stack));
                    let total: u64 = live.values().map(|v| v.1).sum();
                    if total > peak {
                        peak = total;
                        at_peak = live.clone();
                    }
                }
            }
            let p = aggregate(events);
            assert_eq!(p.peak.live_bytes, peak, "round {round}");
            for (i, s) in p.stacks.iter().enumerate() {
                let blocks = at_peak.values().filter(|v| v.0 == i as u64 + 1);
                let expected = blocks.clone().map(|v| v.1).sum::<u64>();
                assert_eq!(s.live_at_peak.bytes, expected, "round {round}, stack {}", i + 1);
                assert_eq!(s.live_at_peak.samples, blocks.count() as u64, "round {round}, stack {}", i + 1);
                let at_end: u64 = live.values().filter(|v| v.0 == i as u64 + 1).map(|v| v.1).sum();
                assert_eq!(s.live_at_end.bytes, at_end, "round {round}, stack {}", i + 1);
            }
        }
    }

    #[test]
    fn a_reused_address_without_its_free_replaces_the_old_block() {
        let p = aggregate(vec![
            Event::Stack { id: 1, frames: vec![0x1000] },
            tick(1, 0xa0, 10, 100, 1),
            tick(2, 0xa0, 10, 100, 1),
        ]);
        assert_eq!(p.peak.live_bytes, 100);
        assert_eq!(p.live_at_end.bytes, 100);
        assert_eq!(p.allocated.bytes, 200);
    }

    #[test]
    fn frames_belong_to_the_module_loaded_at_their_address_at_the_time() {
        let module = |id, path: &str| Module {
            id,
            path: path.into(),
            base: 0x10_0000,
            ranges: vec![(0x10_1000, 0x10_2000)],
            build_id: Vec::new(),
        };
        let p = aggregate(vec![
            Event::ModuleLoad { time_ns: 0, module: module(7, "a.so") },
            Event::Stack { id: 1, frames: vec![0x10_1800, 0x10_2000, 0x10_1000] },
            Event::ModuleUnload { time_ns: 1, id: 7 },
            Event::ModuleLoad { time_ns: 2, module: module(8, "b.so") },
            Event::Stack { id: 2, frames: vec![0x10_1800] },
            Event::ModuleUnload { time_ns: 3, id: 8 },
            Event::Stack { id: 3, frames: vec![0x10_1800] },
        ]);
        let modules: Vec<Vec<Option<usize>>> =
            p.stacks.iter().map(|s| s.frames.iter().map(|f| f.module).collect()).collect();
        // 0x10_2000 returns from a call whose last byte is the range's last: still a.so's;
        // 0x10_1000 returns from before the range.
        assert_eq!(modules, [vec![Some(0), Some(0), None], vec![Some(1)], vec![None]]);
    }

    #[test]
    fn ticks_of_a_lost_stack_record_still_count() {
        let p = aggregate(vec![tick(1, 0xa0, 10, 100, 42)]);
        assert_eq!(p.stacks.len(), 1);
        assert_eq!((p.stacks[0].id, p.stacks[0].frames.len(), p.stacks[0].allocated.bytes), (42, 0, 100));
    }

    #[test]
    fn a_cut_file_reads_up_to_the_cut_and_says_where() {
        let mut file = Vec::new();
        write_header(&mut file, &Header { pid: 3, interval: 100, ..Header::default() });
        write_event(&mut file, &Event::Stack { id: 1, frames: vec![0x1000] });
        write_event(&mut file, &tick(1, 0xa0, 10, 100, 1));
        let whole = file.len();
        write_event(&mut file, &tick(2, 0xb0, 10, 100, 1));
        let p = read(&file[..file.len() - 2], &mut Progress::hidden()).unwrap();
        assert_eq!(p.truncated_at, Some(whole as u64));
        assert_eq!(p.allocated.samples, 1);
        assert_eq!(p.end_ns, None);
        assert_eq!(p.header.pid, 3);
    }
}
