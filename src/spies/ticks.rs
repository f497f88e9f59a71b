//! `spy=ticks`: allocation ticks, the malloc analogue of .NET's GCAllocationTick event.
//!
//! Every allocation counts its bytes (per thread and per kind: exact totals); now and then one
//! is *sampled*: its stack is captured and interned, it is remembered until its free, and a
//! tick goes to the trace writer's queue. Two ways to choose:
//!
//! * `poisson` (default): each byte is sampled with probability 1/interval. A thread draws
//!   exponential gaps (memoryless, so a gap may restart at the end of each sampled block); an
//!   allocation of `size` bytes is sampled with probability `p = 1 - e^(-size/interval)` and
//!   stands for `size / p` bytes, so sums of weights are unbiased estimates of true totals
//!   whatever the allocation pattern (the scheme of tcmalloc, jemalloc's prof and heapprofd).
//! * `tick`: .NET's rule: a tick when a thread's bytes of one kind since its last tick reach
//!   the interval; the tick stands for those bytes. Totals are exact but for each thread's
//!   last stride of each kind, short of the interval, which no tick carries; and a periodic
//!   pattern whose period divides the interval ticks the same site every time.
//!
//! Frees look up the sampled blocks only when a bitmap says the address may be one
//! ([`crate::spies::sampled`]). When this spy is the only one, [`crate::gate`] does the
//! counting of unsampled calls on the entry points themselves, and only the calls that sample,
//! or free a maybe-sampled block, come here.
//!
//! Heap statistics are taken here too, at the first sample once `stats_interval_ms` has passed
//! since the last (and at exit): no thread of ours wakes the program, nor even exists in it
//! (a second thread would turn glibc's malloc from its single-thread fast path to locking).
//! Ticks, frees of sampled blocks and statistics go to the trace writer, a process of its
//! own, through a queue in shared memory.

use core::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::gate::{self, TickCounters};
use crate::spies::leaks::MAX_DEPTH;
use crate::spies::sampled::SampledBlocks;
use crate::spy::{Call, Entry, MallocSpy, Role};
use crate::stacks::{Capture, Stacks};
use crate::thread_records::{Owned, ThreadRecords, Zeroed, bump};
use crate::trace::ring::{Push, Ring};
use crate::trace::{self, Kind, Sampling, message, writer};
use crate::{os, process_mark, threads};
use crate::{pool, tls};

/// How the spy samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Config {
    pub sampling: Sampling,
    /// Mean bytes between samples (poisson) or the tick stride.
    pub interval: u64,
    pub depth: usize,
    /// Seeds the threads' random gaps (poisson).
    pub seed: u64,
    /// Least time between two heap statistics events.
    pub stats_interval_ns: u64,
}

/// What is kept of a sampled block until its free.
#[derive(Clone, Copy)]
struct Sample {
    weight: u64,
    /// Size in the high 62 bits, kind in the low 2.
    size_kind: u64,
}

/// Per-thread counters (read by the statistics; the gate counts into them too), the thread's
/// share of the live estimates and the owner's sampling state. The countdowns are in the
/// thread's TLS, where the gate reads them.
#[repr(C)]
struct PerThread {
    counters: TickCounters,
    live: LiveShare,
    own: Owned<Own>,
}

/// A share of the live estimates: the weights of the samples a thread took, less those of
/// the sampled blocks it freed (whoever took them), so each counter may wrap below zero; the
/// estimates are the sums of all shares. A thread's own share takes plain stores, where
/// shared counters took three locked additions at a sample and two at its free, on a line
/// that threads on other cores took away: a sample and its free cost 11 ns less on one
/// thread, 42 ns less on each of two (`sample_cost`, and a two-thread copy of it).
#[derive(Default)]
#[repr(C)]
struct LiveShare {
    /// Per kind.
    bytes: [AtomicU64; 3],
    /// Per kind, in 1/1024ths of a block.
    blocks_k: [AtomicU64; 3],
    /// Samples taken.
    ticks: AtomicU64,
}

impl LiveShare {
    /// The owner's sample of `weight` bytes (`blocks_k` 1/1024ths of a block).
    fn add_own(&self, kind: usize, weight: u64, blocks_k: u64) {
        bump(&self.bytes[kind], weight);
        bump(&self.blocks_k[kind], blocks_k);
        bump(&self.ticks, 1);
    }

    /// The owner frees a sampled block.
    fn take_own(&self, kind: usize, weight: u64, blocks_k: u64) {
        bump(&self.bytes[kind], weight.wrapping_neg());
        bump(&self.blocks_k[kind], blocks_k.wrapping_neg());
    }

    /// Any thread frees a sampled block (a share with no owner).
    fn take_shared(&self, kind: usize, weight: u64, blocks_k: u64) {
        self.bytes[kind].fetch_sub(weight, Ordering::Relaxed);
        self.blocks_k[kind].fetch_sub(blocks_k, Ordering::Relaxed);
    }
}

struct Own {
    rng: u64,
    unflushed: Unflushed,
    /// The kernel thread id a `ThreadStart` was sent for (slots are reused by new threads),
    /// with [`EXITED`] once its `ThreadExit` was sent.
    started: u32,
    capture: Capture,
}

// SAFETY: atomics, integers, arrays of them and an `Owned` (an `UnsafeCell`) of such: zero
// is valid.
unsafe impl Zeroed for PerThread {}

/// Marks [`Own::started`] once the thread's exit was sent (kernel thread ids stay below 2^22):
/// a sample the dying thread still takes after its key destructors (glibc frees its buffers
/// then) sends no second start.
const EXITED: u32 = 1 << 31;

/// A sampled allocation, as [`crate::on_allocation_tick`] callbacks see it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct AllocationTick {
    /// Nanoseconds since the spy started.
    pub time_ns: u64,
    /// The allocating thread's index (GCAllocationTick's heap index).
    pub thread: u32,
    /// 0 small, 1 large, 2 aligned ([`trace::Kind`]).
    pub kind: u8,
    /// The entry point ([`Entry`] index).
    pub entry: u8,
    /// Bytes asked for.
    pub size: u64,
    /// The block.
    pub address: u64,
    /// Bytes this sample stands for.
    pub weight: u64,
    /// Return addresses, innermost first (`frame_count` of them), valid during the call.
    pub frames: *const u64,
    /// Number of frames.
    pub frame_count: usize,
}

/// A function called for every tick, inside the allocator (see [`crate::on_allocation_tick`]).
pub type TickCallback = extern "C" fn(&AllocationTick);

/// A function called with every heap statistics event, inside the allocator (see
/// [`crate::on_heap_stats`]).
pub type StatsCallback = extern "C" fn(&trace::HeapStats);

/// What threads flush their change of the live estimate to, and samples raise the peak of, on a
/// line of its own. Spread over the spy's lines, these words were written next to the
/// configuration, the queue and the callbacks that every sample and every spied call reads:
/// with threads on two cores, each write then took those lines away from the other core too.
#[derive(Default)]
#[repr(C, align(64))]
struct Estimates {
    /// Estimated live bytes, all kinds (the sum of the live samples' weights), for the peak:
    /// less what threads have not flushed ([`Own::unflushed`]), so a wrapping count that may
    /// read below zero for a while (a thread flushed the free of a block another sampled).
    live: AtomicU64,
    /// Largest estimate of the live bytes so far, raised by samples.
    peak_live: AtomicU64,
}

/// Intervals of change to the live estimate a thread keeps to itself before it adds them to
/// the shared total: a locked addition on a line every core writes, which a sample and the
/// free of its block each made (14 ns a sample on one thread, 20 ns on each of two, with one
/// allocation in twenty sampled: a two-thread copy of `sample_cost`). A program that
/// allocates and frees as fast as it samples (churn, a server in its steady state) then
/// hardly ever flushes. The peak is still exact with one thread; with more, it may miss what
/// the others have not flushed, this many intervals each at most: a few samples' worth, of an
/// estimate whose own error is the square root of its samples.
const FLUSH_INTERVALS: u64 = 4;

/// A thread's change to the live estimate not yet added to the shared total
/// ([`Estimates::live`]): a wrapping count, below zero when it freed more than it sampled.
#[derive(Default)]
struct Unflushed(u64);

impl Estimates {
    /// A thread (its change: `mine`) samples `weight` more bytes: raises the peak if the
    /// estimate, its own change included, is above it.
    fn add(&self, mine: &mut Unflushed, weight: u64, flush_at: u64) {
        mine.0 = mine.0.wrapping_add(weight);
        if mine.0 as i64 >= flush_at as i64 {
            self.flush(mine);
        }
        let live = self.live.load(Ordering::Relaxed).wrapping_add(mine.0) as i64;
        if live > self.peak_live.load(Ordering::Relaxed) as i64 {
            self.peak_live.fetch_max(live as u64, Ordering::Relaxed);
        }
    }

    /// A sampled block of `weight` bytes is freed: by a thread with a record (its change:
    /// `mine`), or by one without.
    fn take(&self, mine: Option<&mut Unflushed>, weight: u64, flush_at: u64) {
        match mine {
            Some(mine) => {
                mine.0 = mine.0.wrapping_sub(weight);
                if mine.0 as i64 <= (flush_at as i64).wrapping_neg() {
                    self.flush(mine);
                }
            }
            None => {
                self.live.fetch_sub(weight, Ordering::Relaxed);
            }
        }
    }

    /// Adds the change a thread kept to the shared total.
    fn flush(&self, mine: &mut Unflushed) {
        let change = core::mem::take(&mut mine.0);
        if change != 0 {
            self.live.fetch_add(change, Ordering::Relaxed);
        }
    }
}

/// The ticks spy.
pub(crate) struct TickSpy {
    pub(crate) config: Config,
    per_thread: ThreadRecords<PerThread>,
    /// The sampled blocks until their free, and the bitmap the gate reads.
    sampled: SampledBlocks<Sample>,
    /// The epoch of the gate opened for this spy (0: none, when it is one of several spies).
    gate_epoch: AtomicU32,
    /// Mixed into the generators' seed: 0, or the pid of a forked child (see `after_fork_child`).
    fork_salt: AtomicU64,
    /// Threads started on a generator so far: each draws from a stream of its own (see `mine`).
    streams: AtomicU64,
    pub(crate) stacks: Stacks,
    estimates: Estimates,
    /// Frees of threads without a record (none inside the shim's hooks), and their share of
    /// the live estimates.
    frees_elsewhere: AtomicU64,
    /// Allocations and their bytes by kind made before any spy was registered
    /// ([`TickSpy::count_before`]).
    allocs_before: [AtomicU64; 3],
    bytes_before: [AtomicU64; 3],
    live_elsewhere: LiveShare,
    /// Allocations of threads that got a slot but no record (past `max_memory`): in no total,
    /// and said so at exit rather than lost without a word. (A thread with no slot never
    /// reaches a spy: the pool says when the limit refuses it.)
    uncounted: AtomicU64,
    /// The queue to the trace writer (a leaked `Ring`); null without one.
    ring: AtomicPtr<Ring>,
    callback: AtomicUsize,
    stats_callback: AtomicUsize,
    /// When the last statistics were taken, since the start.
    last_stats_ns: AtomicU64,
    /// The allocator's own view as last taken (see [`TickSpy::allocator_view`]).
    mallinfo: [AtomicU64; 4],
    /// When the statistics may take that view again, since the start.
    mallinfo_next_ns: AtomicU64,
    /// Where the times of ticks and statistics count from: the start, or the `fork` of this
    /// process (its trace is its own).
    start_ns: AtomicU64,
}

// SAFETY: per-thread records are written by their owners only (counters are atomics read
// by anyone); tables and queue are Sync.
unsafe impl Send for TickSpy {}
// SAFETY: as above.
unsafe impl Sync for TickSpy {}

/// xorshift64*: a thread's private generator (no state shared, nothing to lock).
fn next_random(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// The generator state of the thread given `stream` under `seed`: splitmix64 of the two, so
/// that every bit of the seed counts (`sample_seed=2` and `3` once gave the same samples) and
/// no two threads share a stream.
fn thread_seed(seed: u64, stream: u64) -> u64 {
    let mut z = seed.wrapping_add(stream.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    // xorshift's one forbidden state.
    (z ^ (z >> 31)).max(1)
}

/// An exponential gap of mean `interval` bytes.
fn gap(state: &mut u64, interval: u64) -> i64 {
    // 53 random bits in (0, 1].
    let u = ((next_random(state) >> 11) + 1) as f64 / (1u64 << 53) as f64;
    (-u.ln() * interval as f64).min(i64::MAX as f64 / 2.0) as i64 + 1
}

/// The bytes a poisson sample of `size` stands for: `size / P(sampled)`, to the nearest byte.
pub(crate) fn poisson_weight(size: u64, interval: u64) -> u64 {
    let p = -(-(size as f64) / interval as f64).exp_m1();
    // `+ 0.5` and truncation, not `f64::round`: a call to libm's `round` on x86_64's baseline,
    // 24 instructions of a sample's 1,470 (cachegrind, churn).
    if p <= 0.0 { interval } else { (size as f64 / p + 0.5) as u64 }
}

fn kind_of(call: &Call) -> Kind {
    if call.align != 0 || matches!(call.entry, Entry::Valloc | Entry::Pvalloc) {
        Kind::Aligned
    } else if gate::kind_of(call.size) == gate::LARGE {
        Kind::Large
    } else {
        Kind::Small
    }
}

impl TickSpy {
    /// A spy sampling as `config` says; `None` if its memory cannot be mapped.
    pub(crate) fn new(config: Config) -> Option<Self> {
        Some(Self {
            config: Config { depth: config.depth.clamp(1, MAX_DEPTH), interval: config.interval.max(1), ..config },
            per_thread: ThreadRecords::new()?,
            sampled: SampledBlocks::new()?,
            gate_epoch: AtomicU32::new(0),
            fork_salt: AtomicU64::new(0),
            streams: AtomicU64::new(0),
            stacks: Stacks::new()?,
            estimates: Estimates::default(),
            frees_elsewhere: AtomicU64::new(0),
            allocs_before: [const { AtomicU64::new(0) }; 3],
            bytes_before: [const { AtomicU64::new(0) }; 3],
            live_elsewhere: LiveShare::default(),
            uncounted: AtomicU64::new(0),
            ring: AtomicPtr::new(core::ptr::null_mut()),
            callback: AtomicUsize::new(0),
            stats_callback: AtomicUsize::new(0),
            last_stats_ns: AtomicU64::new(0),
            mallinfo: Default::default(),
            mallinfo_next_ns: AtomicU64::new(0),
            start_ns: AtomicU64::new(os::monotonic_ns()),
        })
    }

    /// The queue to the trace writer, if one runs.
    #[inline]
    pub(crate) fn ring(&self) -> Option<&'static Ring> {
        // A child forked without atfork handlers shares its parent's queue: what it does is
        // not the parent's.
        if !process_mark::set_up_here() {
            return None;
        }
        // SAFETY: only `set_ring` stores here: null or a leaked ring, never freed.
        unsafe { self.ring.load(Ordering::Acquire).as_ref() }
    }

    /// Sends the ticks to `ring` from now on (`None`: to no writer), from this process.
    pub(crate) fn set_ring(&self, ring: Option<&'static Ring>) {
        if ring.is_some() {
            process_mark::set_here();
        }
        self.ring.store(ring.map_or(core::ptr::null_mut(), |r| r as *const Ring as *mut Ring), Ordering::Release);
    }

    /// After a message was pushed to the writer's queue: wakes the writer if it sleeps or if
    /// the queue is filling, and says whether the message was queued.
    fn sent(pushed: Push) -> bool {
        if pushed.wakes() {
            writer::wake();
        }
        pushed.queued()
    }

    /// Allocations that no total counts: their threads got no record.
    pub(crate) fn uncounted(&self) -> u64 {
        self.uncounted.load(Ordering::Relaxed)
    }

    /// Samples taken so far.
    pub(crate) fn ticks(&self) -> u64 {
        self.all_threads().map(|t| t.live.ticks.load(Ordering::Relaxed)).fold(0, u64::wrapping_add)
    }

    /// How far a thread's change to the live estimate may go before it is flushed.
    #[inline]
    fn flush_at(&self) -> u64 {
        self.config.interval.saturating_mul(FLUSH_INTERVALS)
    }

    /// Nanoseconds since the spy started.
    pub(crate) fn elapsed_ns(&self) -> u64 {
        os::monotonic_ns().saturating_sub(self.start_ns.load(Ordering::Relaxed))
    }

    /// Calls `f` for every tick from now on (inside the allocator).
    pub(crate) fn set_callback(&self, f: Option<TickCallback>) {
        self.callback.store(f.map_or(0, |f| f as usize), Ordering::Release);
    }

    /// Lets `gate` count the calls this spy would only count (when it is the only spy).
    pub(crate) fn open_gate(&self, gate: &gate::Gate) {
        let epoch = gate.open(self.sampled.bitmap(), self.config.sampling == Sampling::Tick);
        self.gate_epoch.store(epoch, Ordering::Release);
    }

    /// The calling thread's record, leased the first time its slot is used; and, the first
    /// time this thread is seen, its countdowns started and its TLS pointed at the record.
    fn mine(&self) -> Option<(u32, &PerThread)> {
        let index = threads::current_index()?;
        let t = self.per_thread.get_or_lease(index)?;
        let ts = tls::state();
        let epoch = self.gate_epoch.load(Ordering::Acquire);
        if ts.tick_record.get() != &t.counters as *const TickCounters as usize || ts.tick_seen.get() != epoch {
            // SAFETY: the calling thread owns the record (its slot), inside its hook.
            let own = unsafe { t.own.get() };
            // A stream per thread, not per slot: a thread that took over the slot of one that
            // ended replayed that one's gaps, and sampled the very allocations it had (a
            // thread pool's or a thread-per-request server's estimates then moved together).
            let stream = self.streams.fetch_add(1, Ordering::Relaxed);
            own.rng = thread_seed(self.config.seed ^ self.fork_salt.load(Ordering::Relaxed), stream);
            for until in &ts.tick_until {
                until.set(match self.config.sampling {
                    Sampling::Poisson => gap(&mut own.rng, self.config.interval),
                    Sampling::Tick => self.config.interval as i64,
                });
            }
            ts.tick_record.set(&t.counters as *const TickCounters as usize);
            // Last: from here on the gate may count this thread's calls into the record.
            ts.tick_seen.set(epoch);
        }
        Some((index, t))
    }

    fn all_threads(&self) -> impl Iterator<Item = &PerThread> {
        self.per_thread.iter()
    }

    fn stack_id(&self, own: &mut Own) -> u32 {
        own.capture.stack_id(self.config.depth, &self.stacks)
    }

    /// The weight of the allocation of `size` bytes at `ptr` if it is to be sampled (the same
    /// countdown rule as the gate's, which let every earlier call of this thread through).
    #[inline(always)]
    fn decide(&self, own: &mut Own, ptr: usize, size: u64, kind: Kind) -> Option<u64> {
        let interval = self.config.interval;
        let ts = tls::state();
        let until = &ts.tick_until[if self.config.sampling == Sampling::Tick { kind as usize } else { 0 }];
        let left = until.get() - size as i64;
        if left > 0 {
            until.set(left);
            return None;
        }
        // The sampled set's line for `ptr` is likely out of cache (a third of `sample`'s time
        // went to it on churn when the insert came right after the stack): asked for here, it
        // comes while the gap's logarithm, the weight's exponential and the stack are worked
        // out, and the insert comes last, which may be done at any point before the block is
        // returned.
        self.sampled.prefetch(ptr);
        Some(match self.config.sampling {
            Sampling::Poisson => {
                until.set(gap(&mut own.rng, interval));
                poisson_weight(size, interval)
            }
            Sampling::Tick => {
                // The bytes since the last tick, this allocation's included.
                until.set(interval as i64);
                (interval as i64 - left) as u64
            }
        })
    }

    #[cold]
    #[inline(never)]
    fn sample(&self, index: u32, t: &PerThread, own: &mut Own, call: &Call, kind: Kind, weight: u64) {
        // A forked child's first sample starts its writer. While another thread starts it,
        // no sample: its tick would have nowhere to go, and its free nothing to match.
        writer::start_deferred(false);
        if writer::deferred() {
            return;
        }
        let ptr = call.result as usize;
        let stack = self.stack_id(own);
        let size = call.size as u64;
        t.live.add_own(kind as usize, weight, blocks_k(weight, size));
        // The estimate grows only here, so its peak is raised only here.
        self.estimates.add(&mut own.unflushed, weight, self.flush_at());
        // The time is for the trace and the callbacks: without them, no clock (a fifth of an
        // untraced sample's cost).
        let (ring, callback) = (self.ring(), self.callback.load(Ordering::Acquire));
        let timed = ring.is_some() || callback != 0 || self.stats_callback.load(Ordering::Relaxed) != 0;
        let time_ns = if timed { self.elapsed_ns() } else { 0 };
        if let Some(ring) = ring {
            let tid = tls::tid();
            if own.started & !EXITED != tid {
                own.started = tid;
                Self::sent(ring.push_one(&message::thread_start(time_ns, index, tid)));
            }
            let tick = trace::Tick {
                time_ns,
                thread: index,
                kind: kind as u8,
                entry: call.entry as u8,
                size,
                address: ptr as u64,
                weight,
                stack: stack as u64,
            };
            // The frames go with a stack's first tick only; a tick of another thread that
            // sees the mark queues behind the one that carried them.
            let frames = if self.stacks.is_sent(stack) { &[][..] } else { self.stacks.frames(stack) };
            let frames = &frames[..frames.len().min(message::MAX_FRAMES)];
            let head = message::tick(&tick, frames.len());
            if frames.is_empty() {
                Self::sent(ring.push_one(&head));
            } else if Self::sent(ring.push(&head, frames)) {
                self.stacks.mark_sent(stack);
            }
        }
        self.stats_if_due(time_ns);
        if callback != 0 {
            // SAFETY: only `set_callback` stores here, always a TickCallback.
            let f: TickCallback = unsafe { core::mem::transmute::<usize, TickCallback>(callback) };
            let frames = self.stacks.frames(stack);
            let tick = AllocationTick {
                time_ns,
                thread: index,
                kind: kind as u8,
                entry: call.entry as u8,
                size,
                address: ptr as u64,
                weight,
                frames: frames.as_ptr(),
                frame_count: frames.len(),
            };
            in_callback(|| f(&tick));
        }
        if let Some(old) = self.sampled.insert(ptr, Sample { weight, size_kind: size << 2 | kind as u64 }) {
            // A block freed before we noticed (cannot happen while frees are seen): drop it.
            self.forget(old, Some((&t.live, &mut own.unflushed)), None);
        }
    }

    /// Takes a sampled block's weight out of the live estimates: out of the calling thread's
    /// own share and change, if it has a record (`mine`).
    fn forget(&self, s: Sample, mine: Option<(&LiveShare, &mut Unflushed)>, freed_by: Option<(u32, usize)>) {
        let (size, kind) = (s.size_kind >> 2, (s.size_kind & 3) as usize);
        let blocks = blocks_k(s.weight, size);
        let unflushed = match mine {
            Some((share, unflushed)) => {
                share.take_own(kind, s.weight, blocks);
                Some(unflushed)
            }
            None => {
                self.live_elsewhere.take_shared(kind, s.weight, blocks);
                None
            }
        };
        self.estimates.take(unflushed, s.weight, self.flush_at());
        if let (Some((thread, ptr)), Some(ring)) = (freed_by, self.ring()) {
            Self::sent(ring.push_one(&message::free(self.elapsed_ns(), thread, ptr as u64)));
        }
    }

    /// A block goes back (freed by `by`, the calling thread, if it has a record): if it was
    /// sampled, it is no longer live.
    #[inline(always)]
    fn released(&self, ptr: usize, by: Option<(u32, &PerThread)>) {
        if self.sampled.may_hold(ptr) {
            self.released_maybe_sampled(ptr, by);
        }
    }

    #[cold]
    #[inline(never)]
    fn released_maybe_sampled(&self, ptr: usize, by: Option<(u32, &PerThread)>) {
        if writer::deferred() && self.sampled.contains(ptr) {
            // A forked child freeing a block its parent sampled: its writer starts first, and
            // its trace with the blocks the child inherited, this one among them.
            writer::start_deferred(false);
        }
        if let Some(s) = self.sampled.remove(ptr) {
            // SAFETY: `by` is the calling thread's record, inside its hook, and no other view of
            // it is in use (a free is not nested in a sample).
            let mine = by.map(|(_, t)| (&t.live, unsafe { &mut t.own.get().unflushed }));
            self.forget(s, mine, Some((by.map_or(u32::MAX, |(index, _)| index), ptr)));
        }
    }

    /// Takes the heap statistics if `stats_interval_ms` has passed since the last: to the
    /// writer and to the callback.
    fn stats_if_due(&self, time_ns: u64) {
        let last = self.last_stats_ns.load(Ordering::Relaxed);
        if !self.listening()
            || time_ns < last.saturating_add(self.config.stats_interval_ns)
            || self.last_stats_ns.compare_exchange(last, time_ns, Ordering::Relaxed, Ordering::Relaxed).is_err()
        {
            return;
        }
        self.emit_stats();
    }

    /// Whether anyone reads the statistics events: the trace writer or a callback.
    fn listening(&self) -> bool {
        self.ring().is_some() || writer::deferred() || self.stats_callback.load(Ordering::Relaxed) != 0
    }

    /// Takes the heap statistics now: to the writer and to the callback (also at exit).
    pub(crate) fn emit_stats(&self) -> trace::HeapStats {
        writer::start_deferred(false);
        let stats = self.stats_to_callback();
        if let Some(ring) = self.ring() {
            Self::sent(ring.push(&message::stats(&stats), &[]));
        }
        stats
    }

    /// Takes the heap statistics now, to the callback only: the exit's, which the writer's
    /// `finish` queues, waiting for room as for the end record (pushed once, into a full
    /// queue, they were lost, and with them the trace's exact totals).
    pub(crate) fn stats_to_callback(&self) -> trace::HeapStats {
        let stats = self.stats_now();
        let callback = self.stats_callback.load(Ordering::Acquire);
        if callback != 0 {
            // SAFETY: only `set_stats_callback` stores here, always a StatsCallback.
            let f: StatsCallback = unsafe { core::mem::transmute::<usize, StatsCallback>(callback) };
            in_callback(|| f(&stats));
        }
        stats
    }

    /// Calls `f` with every statistics event from now on.
    pub(crate) fn set_stats_callback(&self, f: Option<StatsCallback>) {
        self.stats_callback.store(f.map_or(0, |f| f as usize), Ordering::Release);
    }

    /// Counts the calls made before any spy was registered in the exact totals, as `spy=count`
    /// does ([`crate::spies::count::CountSpy::count_before`]). Not sampled: no stack could be
    /// walked then.
    pub(crate) fn count_before(&self, live: &crate::early::Live) {
        let (allocs, bytes) = live.kinds();
        for k in 0..3 {
            self.allocs_before[k].fetch_add(allocs[k], Ordering::Relaxed);
            self.bytes_before[k].fetch_add(bytes[k], Ordering::Relaxed);
        }
        self.frees_elsewhere.fetch_add(live.totals().2, Ordering::Relaxed);
    }

    /// The heap's state now, with its time and the peak so far (the allocator's own view maybe
    /// as last taken).
    pub(crate) fn stats_now(&self) -> trace::HeapStats {
        let mut stats = self.stats();
        stats.time_ns = self.elapsed_ns();
        let live = stats.live_bytes();
        // Kept as the peak: this live figure counts what threads have not flushed, and the
        // next event's peak must not read below it (it did, with threads on both cores:
        // review helper 94).
        stats.peak_live_bytes = self.estimates.peak_live.fetch_max(live, Ordering::Relaxed).max(live);
        stats
    }

    /// The real allocator's own view, `[arena, mmapped, free, in use]` bytes from `mallinfo2`.
    ///
    /// `mallinfo2` walks every free chunk of every arena under the arena's lock: about a
    /// millisecond on python3's fragmented heap, 2 ms there at exit, 13 ms on a heap of half a
    /// million free chunks (`tests/fixtures/fragmented.c`). The first event takes it; later
    /// ones, the last at exit included, only once the time since it was last taken is
    /// [`MALLINFO_SPACING`] times what it cost then, and repeat its figures in between: after
    /// the first, it adds at most 0.1% to a run, its end included; and never again once it
    /// cost more than [`MALLINFO_BUDGET_NS`] (see [`next_mallinfo_ns`]). Nor is it taken when
    /// only the exit summary reads the statistics (it does not show it).
    fn allocator_view(&self) -> [u64; 4] {
        let start = self.elapsed_ns();
        if self.listening() && start >= self.mallinfo_next_ns.load(Ordering::Relaxed) {
            let cpu_start = os::thread_cpu_ns();
            // SAFETY: mallinfo2 only reads the allocator's state (under its own locks).
            let m = unsafe { libc::mallinfo2() };
            let cost = self.elapsed_ns().saturating_sub(start);
            let cpu_cost = os::thread_cpu_ns().saturating_sub(cpu_start);
            for (slot, v) in self.mallinfo.iter().zip([m.arena, m.hblkhd, m.fordblks, m.uordblks]) {
                slot.store(v as u64, Ordering::Relaxed);
            }
            self.mallinfo_next_ns.store(next_mallinfo_ns(start, cost, cpu_cost), Ordering::Relaxed);
        }
        self.mallinfo.each_ref().map(|v| v.load(Ordering::Relaxed))
    }

    /// The heap's state now (estimates and exact totals; `time_ns` and the peak are the
    /// caller's to fill).
    fn stats(&self) -> trace::HeapStats {
        let mut s = trace::HeapStats::default();
        for t in self.all_threads() {
            let c = &t.counters;
            for (k, stats) in s.kinds.iter_mut().enumerate() {
                stats.allocs += c.allocs[k].load(Ordering::Relaxed);
                stats.bytes += c.bytes[k].load(Ordering::Relaxed);
            }
            s.frees += c.frees.load(Ordering::Relaxed);
        }
        s.frees += self.frees_elsewhere.load(Ordering::Relaxed);
        for (k, stats) in s.kinds.iter_mut().enumerate() {
            stats.allocs += self.allocs_before[k].load(Ordering::Relaxed);
            stats.bytes += self.bytes_before[k].load(Ordering::Relaxed);
        }
        let (bytes, blocks) = self.live_sums();
        for (k, stats) in s.kinds.iter_mut().enumerate() {
            stats.live_bytes = at_least_zero(bytes[k]);
            stats.live_blocks = at_least_zero(blocks[k]) >> 10;
        }
        [s.arena_bytes, s.mmapped_bytes, s.free_bytes, s.in_use_bytes] = self.allocator_view();
        // The pool, and the trace's queue, shared with the writer (review helper 67).
        s.own_bytes = (pool::usage().0 + os::shared_bytes()) as u64;
        s
    }

    /// The live estimates per kind, summed over the threads' shares: bytes, and blocks in
    /// 1/1024ths (wrapping counts: see [`at_least_zero`]).
    fn live_sums(&self) -> ([u64; 3], [u64; 3]) {
        let shares = self.all_threads().map(|t| &t.live).chain([&self.live_elsewhere]);
        let (mut bytes, mut blocks) = ([0u64; 3], [0u64; 3]);
        for share in shares {
            for k in 0..3 {
                bytes[k] = bytes[k].wrapping_add(share.bytes[k].load(Ordering::Relaxed));
                blocks[k] = blocks[k].wrapping_add(share.blocks_k[k].load(Ordering::Relaxed));
            }
        }
        (bytes, blocks)
    }

    /// Child side of `fork`: threads other than the caller are gone, and so are their walks.
    pub(crate) fn after_fork_child(&self) {
        self.sampled.force_unlock();
        self.stacks.force_unlock();
        tls::state().tid.set(0);
        // The queue is the parent's: the child gets a writer of its own, or none.
        self.set_ring(None);
        self.stacks.forget_sent();
        // Its trace starts now, and so do its times (they counted from the parent's start,
        // and a subshell of 3 ms ended at 48 ms), its statistics too. Its heap is the parent's,
        // and so is the cost of walking it: the next walk keeps the parent's time, on the
        // child's clock (every child of a server with a fragmented heap would walk it at once).
        let now = os::monotonic_ns();
        let forked_at = now.saturating_sub(self.start_ns.swap(now, Ordering::Relaxed));
        self.last_stats_ns.store(0, Ordering::Relaxed);
        let next_walk = self.mallinfo_next_ns.load(Ordering::Relaxed);
        self.mallinfo_next_ns.store(next_walk.saturating_sub(forked_at), Ordering::Relaxed);
        // Its totals count from the fork as well, as `spy=count`'s do (a child forked after its
        // parent had allocated 64 MiB counted them as its own); its live estimates are the heap
        // it inherited. The threads that did not come along will never flush their change to
        // the shared estimate, so that is taken afresh from the shares, and the child's peak
        // starts from it.
        for t in self.all_threads() {
            let c = &t.counters;
            c.allocs
                .iter()
                .chain(&c.bytes)
                .chain([&c.frees, &t.live.ticks])
                .for_each(|n| n.store(0, Ordering::Relaxed));
            // SAFETY: the child has one thread, the caller, which is in no hook (it forked):
            // no owner holds a view of any record.
            unsafe { t.own.get() }.unflushed = Unflushed::default();
        }
        self.frees_elsewhere.store(0, Ordering::Relaxed);
        self.allocs_before.iter().chain(&self.bytes_before).for_each(|n| n.store(0, Ordering::Relaxed));
        self.uncounted.store(0, Ordering::Relaxed);
        let live = at_least_zero(self.live_sums().0.into_iter().fold(0, u64::wrapping_add));
        self.estimates.live.store(live, Ordering::Relaxed);
        self.estimates.peak_live.store(live, Ordering::Relaxed);
        // Its samples are its own: going on from its parent's generator and countdown, it
        // sampled the very allocations its parent sampled, and the workers a server forks in
        // a row each other's, so that their estimates moved together instead of averaging out.
        // Its thread starts them afresh at its next allocation (see `mine`), on a seed of its
        // own (with `sample_seed` too).
        self.fork_salt.store(u64::from(os::getpid()), Ordering::Relaxed);
        let ts = tls::state();
        ts.tick_record.set(0);
        ts.tick_seen.set(0);
    }

    /// Child side of `fork`, its writer started on `ring`: the sampled blocks it inherited from
    /// `parent` go first in its trace, so that their frees match and its live heap is whole. A
    /// sample keeps no stack: their stacks are in the parent's trace. The queue may fill here
    /// (a server's heap may hold tens of thousands of samples), and the child waits for room
    /// rather than drop them: a second at most in all, should its writer not drain.
    pub(crate) fn send_inherited(&self, ring: &Ring, parent: u32) {
        let mut waited_ms = 0;
        self.sampled.for_each(|ptr, s| {
            let message = message::inherited(parent, (s.size_kind & 3) as u8, s.size_kind >> 2, ptr as u64, s.weight);
            while !ring.has_room(1) && waited_ms < 1000 {
                waited_ms += 1;
                writer::wake();
                let pause = libc::timespec { tv_sec: 0, tv_nsec: 1_000_000 };
                // SAFETY: nanosleep with a valid request.
                unsafe { libc::nanosleep(&pause, core::ptr::null_mut()) };
            }
            Self::sent(ring.push_one(&message));
        });
    }

    /// The thread of slot `index` is leaving (its key destructor runs); the slot's next owner,
    /// another thread, sends its own start.
    pub(crate) fn thread_exit(&self, index: u32) {
        let Some(t) = self.per_thread.get(index) else { return };
        // SAFETY: called by the exiting owner, outside any hook.
        let own = unsafe { t.own.get() };
        // Samples it takes after this (glibc frees its buffers later) are flushed by the
        // slot's next owner, or not at all: only the peak may miss them.
        self.estimates.flush(&mut own.unflushed);
        if own.started != 0 && own.started & EXITED == 0 {
            own.started |= EXITED;
            if let Some(ring) = self.ring() {
                Self::sent(ring.push_one(&message::thread_exit(self.elapsed_ns(), index)));
            }
        }
    }
}

/// How many times its own cost the time between two `mallinfo2` calls is at least: they take
/// at most 0.1% of the run. At 256 (0.4% at most) `perf` put them at 0.15% of churn's time and
/// of python3's.
const MALLINFO_SPACING: u64 = 1024;

/// The longest `mallinfo2` walk that is taken again: the allocation call that takes the
/// statistics waits for the whole walk.
const MALLINFO_BUDGET_NS: u64 = 2_000_000;

/// When the allocator's view may be taken again, after a walk that started at `start_ns` and
/// took `cost_ns` (`cpu_ns` of them on the thread's CPU): [`MALLINFO_SPACING`] times its cost
/// later, or never once a walk's own work took longer than [`MALLINFO_BUDGET_NS`]. The spacing
/// bounds the walks' share of the run, not one walk: a heap that fragmented between two walks
/// (five million free chunks) made one `malloc` wait 70 ms, again every 70 s, against 0.45 ms
/// natively (review helper 11). The view then stays as that walk found it. CPU time, not the
/// clock's: a walk of 0.8 ms pre-empted by another process on its core read over 2 ms, and
/// froze the view of a heap that went on growing (review helper 12).
fn next_mallinfo_ns(start_ns: u64, cost_ns: u64, cpu_ns: u64) -> u64 {
    if cpu_ns > MALLINFO_BUDGET_NS {
        u64::MAX
    } else {
        start_ns.saturating_add(cost_ns.saturating_mul(MALLINFO_SPACING))
    }
}

/// A sum of wrapping counts, read one after another while threads sample and free: it may miss
/// a sample whose free it counts, and below zero it is none.
fn at_least_zero(sum: u64) -> u64 {
    (sum as i64).max(0) as u64
}

/// Estimated blocks of a sample, in 1/1024ths.
fn blocks_k(weight: u64, size: u64) -> u64 {
    (weight << 10) / size.max(1)
}

impl MallocSpy for TickSpy {
    fn role(&self) -> Role {
        Role::Observe
    }

    #[inline]
    fn before_release(&self, _entry: Entry, ptr: *mut core::ffi::c_void, _spied: bool) {
        // Before the real free: once it runs, another thread may get this address and sample it.
        // (A realloc that then fails keeps a block no longer sampled: it is only unweighted;
        // `after_call` takes back the free.)
        if ptr.is_null() {
            return;
        }
        let mine = self.mine();
        match mine {
            Some((_, t)) => bump(&t.counters.frees, 1),
            None => {
                self.frees_elsewhere.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.released(ptr as usize, mine);
    }

    #[inline]
    fn after_call(&self, call: &Call) {
        if call.failed && !call.ptr.is_null() && matches!(call.entry, Entry::Realloc | Entry::Reallocarray) {
            // The block is still the caller's: not a free after all (its sample, dropped in
            // `before_release`, stays dropped).
            match self.mine() {
                Some((_, t)) => bump(&t.counters.frees, u64::MAX),
                None => {
                    self.frees_elsewhere.fetch_sub(1, Ordering::Relaxed);
                }
            }
            return;
        }
        if call.failed || call.result.is_null() || matches!(call.entry, Entry::MallocUsableSize | Entry::MallocTrim) {
            return;
        }
        let Some((index, t)) = self.mine() else {
            self.uncounted.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let kind = kind_of(call);
        let size = call.size as u64;
        bump(&t.counters.allocs[kind as usize], 1);
        bump(&t.counters.bytes[kind as usize], size);
        // SAFETY: `t` is the calling thread's record, inside its hook.
        let own = unsafe { t.own.get() };
        if let Some(weight) = self.decide(own, call.result as usize, size, kind) {
            self.sample(index, t, own, call, kind, weight);
        }
    }
}

/// The process's ticks spy: a `&'static TickSpy`, or null.
static SPY: core::sync::atomic::AtomicPtr<TickSpy> = core::sync::atomic::AtomicPtr::new(core::ptr::null_mut());

/// Makes `spy` the process's ticks spy (for the API and the thread-exit hook): the newest one
/// started.
pub(crate) fn set_spy(spy: &'static TickSpy) {
    let first = SPY.swap((spy as *const TickSpy).cast_mut(), Ordering::AcqRel).is_null();
    if first {
        threads::set_exit_hook(|index| {
            if let Some(spy) = self::spy() {
                spy.thread_exit(index);
            }
        });
    }
}

/// The process's ticks spy, if one was started in this module.
pub(crate) fn spy() -> Option<&'static TickSpy> {
    // SAFETY: only `&'static` spies are stored.
    unsafe { SPY.load(Ordering::Acquire).as_ref() }
}

/// Runs a program's callback with its thread marked as inside one (see [`released_unseen`]).
fn in_callback(call: impl FnOnce()) {
    let ts = tls::state();
    let outer = ts.in_tick_callback.replace(1);
    call();
    ts.in_tick_callback.set(outer);
}

/// A block freed (or moved by `realloc`) inside the allocator, where no spy sees it: if a tick
/// or statistics callback freed it, the free counts (the exact totals missed 999 of a
/// callback's 1000, review helper 67), and if it was sampled, its sample ends here, or it
/// stayed live in the estimates for good.
///
/// Also a block freed outside any hook (on a nearly full alternate signal stack, by a thread
/// without a slot): its sample ends, and its free is not counted, as that thread's allocations
/// there are not. Not from a signal handler that interrupted a hook, which may hold the very
/// lock the sample's end takes (a program whose handler frees hung for good, spinning on its
/// own lock): see [`crate::dispatch::following_unseen`].
#[inline]
pub(crate) fn released_unseen(ptr: usize) {
    if ptr == 0 {
        return;
    }
    let Some(spy) = spy() else { return };
    let in_callback = tls::state().in_tick_callback.get() != 0;
    crate::dispatch::following_unseen(|| {
        if in_callback {
            spy.frees_elsewhere.fetch_add(1, Ordering::Relaxed);
        }
        spy.released(ptr, None);
    });
}

/// Asks for the line where the process's ticks spy would keep `ptr`: for a free the gate
/// sends to the spy, which reaches that line only after the whole dispatch (on churn, the miss
/// there was most of the spy's time on such a free).
#[inline]
pub(crate) fn prefetch_sampled(ptr: usize) {
    if let Some(spy) = spy() {
        spy.sampled.prefetch(ptr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_walk_over_budget_is_not_taken_again() {
        assert_eq!(next_mallinfo_ns(1_000, 1_000, 900), 1_000 + 1_000 * MALLINFO_SPACING);
        let budget = MALLINFO_BUDGET_NS;
        assert_eq!(next_mallinfo_ns(1_000, budget, budget), 1_000 + budget * MALLINFO_SPACING);
        assert_eq!(next_mallinfo_ns(1_000, budget + 1, budget + 1), u64::MAX);
        // Pre-empted: long by the clock, short on the CPU. Spaced by the clock, not stopped.
        assert_eq!(next_mallinfo_ns(1_000, 3 * budget, budget / 4), 1_000 + 3 * budget * MALLINFO_SPACING);
        assert_eq!(next_mallinfo_ns(u64::MAX - 5, 10, 10), u64::MAX);
    }

    #[test]
    fn poisson_weights_make_unbiased_estimates() {
        // Small blocks stand for about the interval, blocks far above it for themselves.
        assert!((poisson_weight(16, 102_400) as f64 / 102_400.0 - 1.0).abs() < 0.001);
        assert_eq!(poisson_weight(10 << 20, 102_400), 10 << 20);
        // Expected weight = P(sampled) * weight = size, for every size.
        for size in [1u64, 100, 50_000, 102_400, 300_000] {
            let p = 1.0 - (-(size as f64) / 102_400.0).exp();
            let expected = p * poisson_weight(size, 102_400) as f64;
            assert!((expected / size as f64 - 1.0).abs() < 0.01, "size {size}: {expected}");
        }
    }

    #[test]
    fn every_seed_and_thread_has_its_own_stream() {
        let states: HashSet<u64> = (0..64u64).flat_map(|seed| (0..64).map(move |i| thread_seed(seed, i))).collect();
        assert_eq!(states.len(), 64 * 64);
        assert!(!states.contains(&0));
    }

    #[test]
    fn the_allocator_view_is_retaken_within_its_budget_only_at_exit_too() {
        extern "C" fn listen(_: &trace::HeapStats) {}
        let config =
            Config { sampling: Sampling::Poisson, interval: 1 << 40, depth: 8, seed: 1, stats_interval_ns: u64::MAX };
        let spy = TickSpy::new(config).unwrap();
        spy.set_stats_callback(Some(listen));
        let view = |s: &trace::HeapStats| [s.arena_bytes, s.mmapped_bytes, s.free_bytes, s.in_use_bytes];
        let first = spy.emit_stats();
        assert!(first.arena_bytes > 0 && first.in_use_bytes > 0, "the first event takes it: {first:?}");
        // As after a walk too dear to repeat yet: the last event repeats the figures.
        let earlier = [1 << 40, 2 << 40, 3 << 40, 4 << 40];
        for (slot, v) in spy.mallinfo.iter().zip(earlier) {
            slot.store(v, Ordering::Relaxed);
        }
        spy.mallinfo_next_ns.store(u64::MAX, Ordering::Relaxed);
        assert_eq!(view(&spy.emit_stats()), earlier);
        // Once the budget allows, it is taken again.
        spy.mallinfo_next_ns.store(0, Ordering::Relaxed);
        assert_ne!(view(&spy.emit_stats()), earlier);
    }

    #[test]
    fn a_forked_childs_clock_starts_at_the_fork_and_keeps_the_parents_time_for_the_next_walk() {
        extern "C" fn listen(_: &trace::HeapStats) {}
        let config = Config {
            sampling: Sampling::Poisson,
            interval: 1 << 40,
            depth: 8,
            seed: 1,
            stats_interval_ns: 100_000_000,
        };
        let spy = TickSpy::new(config).unwrap();
        spy.set_stats_callback(Some(listen));
        // A parent 10 s into its run, which last walked its heap with a budget of 5 s more.
        let second = 1_000_000_000;
        spy.start_ns.store(os::monotonic_ns() - 10 * second, Ordering::Relaxed);
        spy.last_stats_ns.store(10 * second - 1, Ordering::Relaxed);
        spy.mallinfo_next_ns.store(15 * second, Ordering::Relaxed);
        let walked = [1 << 40, 2 << 40, 3 << 40, 4 << 40];
        for (slot, v) in spy.mallinfo.iter().zip(walked) {
            slot.store(v, Ordering::Relaxed);
        }
        spy.after_fork_child();
        assert!(spy.elapsed_ns() < second, "the child's clock: {}", spy.elapsed_ns());
        assert_eq!(spy.last_stats_ns.load(Ordering::Relaxed), 0, "statistics due from the fork on");
        let next = spy.mallinfo_next_ns.load(Ordering::Relaxed);
        assert!((4 * second..=5 * second).contains(&next), "the parent's time for the next walk: {next}");
        let view = |s: &trace::HeapStats| [s.arena_bytes, s.mmapped_bytes, s.free_bytes, s.in_use_bytes];
        assert_eq!(view(&spy.emit_stats()), walked, "the inherited heap is not walked again yet");
    }

    /// An event's peak counts the live bytes threads have not flushed; the next event's may
    /// not read below it (one read 4,299 after one of 8,598: review helper 94).
    #[test]
    fn an_events_peak_is_never_below_an_earlier_ones() {
        let config = Config { sampling: Sampling::Poisson, interval: 1000, depth: 8, seed: 1, stats_interval_ns: 0 };
        let spy = TickSpy::new(config).unwrap();
        let _hook = crate::dispatch::Scope::enter().unwrap();
        let (_, t) = spy.mine().unwrap();
        // Samples of another thread's, not flushed to the shared total: the peak there is less.
        t.live.add_own(gate::SMALL, 8000, 8 << 10);
        spy.estimates.peak_live.store(4000, Ordering::Relaxed);
        assert_eq!(spy.stats_now().peak_live_bytes, 8000);
        t.live.take_own(gate::SMALL, 8000, 8 << 10);
        assert_eq!(spy.stats_now().peak_live_bytes, 8000, "the peak an event gave stays");
    }

    #[test]
    fn a_forked_childs_totals_count_from_its_fork_and_its_live_estimate_is_what_it_inherited() {
        extern "C" fn listen(_: &trace::HeapStats) {}
        let config = Config { sampling: Sampling::Poisson, interval: 1000, depth: 8, seed: 1, stats_interval_ns: 0 };
        let spy = TickSpy::new(config).unwrap();
        spy.set_stats_callback(Some(listen));
        // As inside a hook, where the spy leases the thread's record.
        let _hook = crate::dispatch::Scope::enter().unwrap();
        let (_, t) = spy.mine().unwrap();
        // The parent: 10 calls of 5,000 bytes, 4 frees, two samples still live (3,000 and
        // 1,000 bytes), and the peak of 9,000 it once had; 500 bytes of this thread's change
        // not yet flushed, and 700 of another thread, which does not come along.
        bump(&t.counters.allocs[gate::SMALL], 10);
        bump(&t.counters.bytes[gate::SMALL], 5000);
        bump(&t.counters.frees, 4);
        t.live.add_own(gate::SMALL, 3000, 3 << 10);
        t.live.add_own(gate::LARGE, 1000, 1 << 10);
        spy.frees_elsewhere.store(2, Ordering::Relaxed);
        spy.estimates.live.store(2800, Ordering::Relaxed);
        spy.estimates.peak_live.store(9000, Ordering::Relaxed);
        // SAFETY: this thread owns the record and holds no other view of it.
        unsafe { t.own.get() }.unflushed = Unflushed(500);
        let before = spy.stats_now();
        assert_eq!((before.kinds[0].allocs, before.kinds[0].bytes, before.frees), (10, 5000, 6));
        spy.after_fork_child();
        let child = spy.stats_now();
        let totals = child.kinds.iter().map(|k| (k.allocs, k.bytes)).fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        assert_eq!((totals, child.frees, spy.ticks()), ((0, 0), 0, 0), "nothing counted since the fork");
        assert_eq!([child.kinds[0].live_bytes, child.kinds[1].live_bytes], [3000, 1000], "the inherited heap");
        assert_eq!([child.kinds[0].live_blocks, child.kinds[1].live_blocks], [3, 1]);
        assert_eq!(spy.estimates.live.load(Ordering::Relaxed), 4000, "taken afresh from the shares");
        assert_eq!(child.peak_live_bytes, 4000, "the child's peak starts at what it inherited");
        // SAFETY: as above.
        assert_eq!(unsafe { t.own.get() }.unflushed.0, 0);
    }

    #[test]
    fn the_peak_counts_the_sampling_threads_unflushed_change_and_never_a_wrapped_total() {
        let e = Estimates::default();
        let (mut a, mut b, mut c) = (Unflushed::default(), Unflushed::default(), Unflushed::default());
        let flush_at = 400;
        // One thread: exact, though nothing is flushed yet.
        e.add(&mut a, 100, flush_at);
        e.add(&mut a, 150, flush_at);
        assert_eq!((e.live.load(Ordering::Relaxed), e.peak_live.load(Ordering::Relaxed)), (0, 250));
        e.take(Some(&mut a), 100, flush_at);
        e.add(&mut a, 200, flush_at);
        assert_eq!(e.peak_live.load(Ordering::Relaxed), 350);
        // Reaching the bound flushes: 350 + 100.
        e.add(&mut a, 100, flush_at);
        assert_eq!((a.0, e.live.load(Ordering::Relaxed), e.peak_live.load(Ordering::Relaxed)), (0, 450, 450));
        // Another thread frees all of it and flushes: the total is 0 again.
        e.take(Some(&mut b), 450, flush_at);
        assert_eq!((b.0, e.live.load(Ordering::Relaxed)), (0, 0));
        // It frees blocks a third sampled and has not flushed: the shared total goes below zero.
        e.add(&mut c, 300, flush_at);
        e.take(Some(&mut b), 300, flush_at);
        e.take(Some(&mut b), 100, flush_at);
        assert_eq!(e.live.load(Ordering::Relaxed) as i64, -400);
        // Samples read -400 + 50 and -400 + 310: no new peak, and not a wrapped one.
        e.add(&mut a, 50, flush_at);
        e.add(&mut c, 10, flush_at);
        assert_eq!(e.peak_live.load(Ordering::Relaxed), 450);
        // The third thread's flush brings the total back to 0; the first keeps its 50.
        e.add(&mut c, 90, flush_at);
        assert_eq!((c.0, e.live.load(Ordering::Relaxed) as i64), (0, 0));
        // A thread without a record frees straight from the total.
        e.take(None, 50, flush_at);
        assert_eq!(e.live.load(Ordering::Relaxed) as i64, -50);
    }

    #[test]
    fn gaps_average_the_interval() {
        let mut rng = 0x1234_5678_9abc_def1;
        let n = 100_000;
        let mean = (0..n).map(|_| gap(&mut rng, 102_400) as f64).sum::<f64>() / n as f64;
        assert!((mean / 102_400.0 - 1.0).abs() < 0.02, "mean gap {mean}");
    }
}
