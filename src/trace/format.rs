//! The trace file: a versioned stream of length-prefixed records.
//!
//! ```text
//! file   := MAGIC version:u32le record*
//! record := tag:u8 length:varint payload[length]
//! ```
//!
//! Every integer in a payload is an unsigned LEB128 varint (frames are zigzag deltas), every
//! string and byte string a varint length and its bytes. A record is whole or absent: a file
//! cut anywhere reads up to its last whole record. A reader skips tags it does not know, so
//! later versions may add records; a changed meaning of an existing record bumps
//! [`VERSION`]. The first record is always [`Header`]. No record has tag 0: a zero byte
//! where a record starts is a file not fully written (a crash can leave its last blocks
//! zero-filled), read as a cut there rather than as records of an unknown tag, one per byte.

use std::fmt;

/// The first bytes of every trace.
pub const MAGIC: &[u8; 16] = b"mallocspy-trace\0";
/// The format version written by this build. Version 2 adds the process's identity to the
/// header ([`Header::pid_namespace`], [`Header::process_start_ticks`]); version 3 a CRC-32 of
/// the header's fields after them (a damaged byte of a header read as another command line,
/// pid or interval, with no word: review helper 162). Versions 1 and 2 are read too.
pub const VERSION: u32 = 3;

const TAG_HEADER: u8 = 1;
const TAG_MODULE_LOAD: u8 = 2;
const TAG_MODULE_UNLOAD: u8 = 3;
const TAG_STACK: u8 = 4;
const TAG_TICK: u8 = 5;
const TAG_FREE: u8 = 6;
const TAG_HEAP_STATS: u8 = 7;
const TAG_THREAD_START: u8 = 8;
const TAG_THREAD_EXIT: u8 = 9;
const TAG_LOST: u8 = 10;
const TAG_END: u8 = 11;
const TAG_INHERITED: u8 = 12;

/// Most frames of a stack record: what a tick can carry, with room to spare.
pub const MAX_FRAMES: usize = 1024;
const _: () = assert!(super::message::MAX_FRAMES <= MAX_FRAMES);

/// The longest module path kept whole: what `open` takes (`PATH_MAX` less its NUL). The
/// report repeats a module's path in each of its frames, and a longer one could not be opened
/// to symbolize anyway. The map can show longer ones: a library renamed or deleted
/// (` (deleted)`) after the writer first read its file.
pub const MAX_PATH: usize = 4095;

/// Most arguments of a header's command line: more than the kernel passes to a program
/// (`ARG_MAX`, two megabytes of at least two bytes each, by default); each costs the report
/// far more memory than its byte in the file.
pub const MAX_ARGS: usize = 1 << 20;

/// The unit in which a file system writes a file's data out: after a crash, the file's
/// unwritten tail reads as zeros from a multiple of it on (the smallest page size; a larger
/// one only makes a reader cut a whole last record it could have read).
const WRITTEN_PAGE: usize = 4096;

/// The longest payload a record of `tag` can have: a record claiming more is damaged, not
/// cut (a flipped bit in a length would otherwise pass for the end of the file).
fn max_payload(tag: u8) -> u64 {
    /// The longest varint.
    const INT: u64 = 10;
    match tag {
        TAG_TICK => 8 * INT,
        TAG_FREE | TAG_THREAD_START => 3 * INT,
        TAG_MODULE_UNLOAD | TAG_THREAD_EXIT | TAG_LOST => 2 * INT,
        TAG_END => INT,
        TAG_INHERITED => 5 * INT,
        TAG_HEAP_STATS => 20 * INT,
        TAG_STACK => (2 + MAX_FRAMES as u64) * INT,
        // A path (the memory map's, which may be longer than `MAX_PATH`), its executable
        // ranges and a build id.
        TAG_MODULE_LOAD => 1 << 20,
        // A command line: the kernel allows a few megabytes of arguments.
        TAG_HEADER => MAX_PAYLOAD,
        // Records of later versions, which keep to this. Not megabytes: a damaged tag
        // claiming the rest of the file passed for a cut there, its events dropped with a
        // warning of a cut rather than the error (review helper 123).
        _ => MAX_UNKNOWN_PAYLOAD,
    }
}

/// The longest payload of a record of a tag this version does not know.
const MAX_UNKNOWN_PAYLOAD: u64 = 64 << 10;

/// The longest payload of any record.
const MAX_PAYLOAD: u64 = 64 << 20;

/// How allocations are chosen for a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Sampling {
    /// Each byte with probability 1/interval (exponential gaps per thread): unbiased.
    #[default]
    Poisson,
    /// A tick each time a thread's bytes of one kind cross the interval (.NET's
    /// GCAllocationTick): biased towards whatever allocation completes the interval.
    Tick,
}

impl Sampling {
    /// The option's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Sampling::Poisson => "poisson",
            Sampling::Tick => "tick",
        }
    }
}

/// The allocation kinds of a tick, after GCAllocationTick's small, large and pinned heaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// Served from the allocator's arenas.
    Small = 0,
    /// At or above the allocator's mmap threshold.
    Large = 1,
    /// From the memalign family (`posix_memalign`, `aligned_alloc`, `memalign`, `valloc`,
    /// `pvalloc`): the analogue of the pinned heap.
    Aligned = 2,
}

impl Kind {
    /// Every kind, in index order.
    pub const ALL: [Kind; 3] = [Kind::Small, Kind::Large, Kind::Aligned];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Small => "small",
            Kind::Large => "large",
            Kind::Aligned => "aligned",
        }
    }

    fn from_index(i: u64) -> Option<Kind> {
        Kind::ALL.get(i as usize).copied()
    }
}

/// The header of the trace `file` reads, read from its start only: a few hundred bytes
/// usually, up to the command line's length (megabytes at most, never more than the longest
/// header record); `None` when `file` is not a trace.
pub fn header_of(file: impl std::io::Read) -> Option<Header> {
    use std::io::Read;
    // The signature, the version, a header record's tag and length, and its longest payload.
    let longest = 20 + 11 + max_payload(TAG_HEADER);
    let mut file = file;
    let mut start = Vec::new();
    let mut want: u64 = 64 << 10;
    loop {
        let missing = want - start.len() as u64;
        let read = (&mut file).take(missing).read_to_end(&mut start).ok()? as u64;
        match Reader::new(&start) {
            Ok(reader) => return Some(reader.header),
            // Cut inside the header record, and more to read: a longer command line than
            // read so far (not another record's length, nor zeros after the version).
            Err(e)
                if e.what == HEADER_CUT && read == missing && start.get(20) == Some(&TAG_HEADER) && want < longest =>
            {
                want = (want * 8).min(longest);
            }
            Err(_) => return None,
        }
    }
}

/// Whether bytes that come after `read`, a trace's start read from a stream, could be read as
/// more of its events: not once its events end at damage, nor where they stop further before
/// the end of `read` than the longest record reaches (zeros, text or another file after the
/// trace: `cat app.trace /dev/zero | mallocspy report -` was read into memory without end).
pub fn read_on(read: &[u8]) -> bool {
    let mut reader = match Reader::new(read) {
        Ok(reader) => reader,
        Err(e) => return e.what == HEADER_CUT,
    };
    // Where the last event this version knows ends: records of unknown tags are skipped, and
    // text is a run of them (`yes` after a trace was read on without end: review helper 88).
    let mut known_end = reader.offset();
    while let Some(event) = reader.next() {
        if event.is_err() {
            return false;
        }
        known_end = reader.offset();
    }
    // A tag, the longest length, the longest payload.
    read.len() as u64 - known_end <= 1 + 10 + MAX_PAYLOAD
}

/// Why [`Reader::new`] stopped, when the header record goes on past the bytes it was given.
const HEADER_CUT: &str = "the file ends before its header is whole";

/// What the trace is of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The traced process.
    pub pid: u32,
    /// Its command line.
    pub command: Vec<String>,
    /// `MALLOCSPY_OPTIONS` as given.
    pub options: String,
    /// The sampling mode.
    pub sampling: Sampling,
    /// Mean bytes between samples (poisson) or the tick stride (tick).
    pub interval: u64,
    /// Period of the heap statistics events.
    pub stats_interval_ms: u64,
    /// Wall-clock start, nanoseconds since the Unix epoch; event times count from it.
    pub start_unix_ns: u64,
    /// The inode of the process's pid namespace (`/proc/self/ns/pid`): `pid` is its number
    /// there, which a process of another namespace may have too. 0 when unknown.
    pub pid_namespace: u64,
    /// When the process began (its `fork`; an `exec` keeps it), in clock ticks since boot
    /// (`/proc/self/stat`'s `starttime`): with the pid and its namespace, which process this
    /// is, through its `exec`s. 0 when unknown.
    pub process_start_ticks: u64,
}

impl Default for Header {
    /// The options' defaults, of no process.
    fn default() -> Self {
        let defaults = crate::options::Options::default();
        Self {
            pid: 0,
            command: Vec::new(),
            options: String::new(),
            sampling: Sampling::default(),
            interval: defaults.sample_interval,
            stats_interval_ms: defaults.stats_interval_ms,
            start_unix_ns: 0,
            pid_namespace: 0,
            process_start_ticks: 0,
        }
    }
}

/// A module (the executable or a shared library) mapped into the process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Module {
    /// Its number in this trace (unloads name it).
    pub id: u64,
    /// Its path, as the loader knows it (the executable's from `/proc/self/exe`).
    pub path: String,
    /// The load bias: a run-time address minus this is the address in the file.
    pub base: u64,
    /// Its executable address ranges `[start, end)`, run-time addresses.
    pub ranges: Vec<(u64, u64)>,
    /// Its GNU build id (empty if it has none), to find its debug file.
    pub build_id: Vec<u8>,
}

/// One sampled allocation (GCAllocationTick_V3, mapped to malloc).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tick {
    /// Nanoseconds since the start.
    pub time_ns: u64,
    /// The allocating thread's index (GCAllocationTick's heap index).
    pub thread: u32,
    /// small, large or aligned.
    pub kind: u8,
    /// The entry point ([`crate::Entry`] index).
    pub entry: u8,
    /// Bytes asked for by the allocation that ticked (`amount`).
    pub size: u64,
    /// The block's address.
    pub address: u64,
    /// Bytes this sample stands for: sums of weights estimate true totals.
    pub weight: u64,
    /// Its call stack ([`Event::Stack`] id).
    pub stack: u64,
}

impl Tick {
    /// The kind, if the trace's byte is one.
    pub fn kind(&self) -> Option<Kind> {
        Kind::from_index(self.kind as u64)
    }
}

/// Per-kind figures of a [`HeapStats`] event.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindStats {
    /// Live bytes, estimated from the live samples' weights.
    pub live_bytes: u64,
    /// Live blocks, estimated likewise.
    pub live_blocks: u64,
    /// Allocating calls so far (exact).
    pub allocs: u64,
    /// Bytes they asked for (exact).
    pub bytes: u64,
}

/// The heap's state at one moment (GCHeapStats_V2, mapped to malloc).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeapStats {
    /// Nanoseconds since the start.
    pub time_ns: u64,
    /// small, large, aligned.
    pub kinds: [KindStats; 3],
    /// Blocks freed so far (exact): every free seen, including those of blocks allocated
    /// before the spy started or by a tick or statistics callback, which no `allocs` counts;
    /// so `allocs - frees` is no count of live blocks (`live_blocks` estimates that).
    pub frees: u64,
    /// Largest estimated live bytes so far: each sample raises it, so a peak between two
    /// events is in the next.
    pub peak_live_bytes: u64,
    /// The real allocator's view (`mallinfo2`, as last taken: see the README): bytes of its
    /// arenas (`arena`).
    pub arena_bytes: u64,
    /// Bytes in blocks it mapped on their own (`hblkhd`).
    pub mmapped_bytes: u64,
    /// Bytes free in its arenas (`fordblks`).
    pub free_bytes: u64,
    /// Bytes in use from its arenas (`uordblks`).
    pub in_use_bytes: u64,
    /// mallocspy's own memory (its pool, its own heap included, and the trace's queue; never
    /// the watched heap).
    pub own_bytes: u64,
}

impl HeapStats {
    /// Estimated live bytes over all kinds.
    pub fn live_bytes(&self) -> u64 {
        self.kinds.iter().fold(0, |sum: u64, k| sum.saturating_add(k.live_bytes))
    }
}

/// One record of a trace (after the header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A module was mapped (at start, or by `dlopen`).
    ModuleLoad {
        /// Nanoseconds since the start.
        time_ns: u64,
        /// The module.
        module: Module,
    },
    /// A module was unmapped (`dlclose`).
    ModuleUnload {
        /// Nanoseconds since the start.
        time_ns: u64,
        /// Its id.
        id: u64,
    },
    /// A call stack, before the first tick that names it.
    Stack {
        /// Its id.
        id: u64,
        /// Return addresses, innermost first (the allocator's caller first).
        frames: Vec<u64>,
    },
    /// A sampled allocation.
    Tick(Tick),
    /// A sampled block live in the parent when this process was forked: live here too, but
    /// not allocated here (its stack is in the parent's trace). They come before the child's
    /// own events.
    Inherited {
        /// The parent's pid.
        parent: u32,
        /// small, large or aligned.
        kind: u8,
        /// Bytes its allocation asked for.
        size: u64,
        /// The block's address.
        address: u64,
        /// Bytes its sample stands for.
        weight: u64,
    },
    /// A sampled block was freed (or moved by `realloc`).
    Free {
        /// Nanoseconds since the start.
        time_ns: u64,
        /// The freeing thread.
        thread: u32,
        /// The block.
        address: u64,
    },
    /// Heap statistics.
    HeapStats(HeapStats),
    /// A thread made its first allocator call.
    ThreadStart {
        /// Nanoseconds since the start.
        time_ns: u64,
        /// Its index (ticks name it).
        thread: u32,
        /// Its kernel thread id.
        tid: u32,
    },
    /// A thread ended.
    ThreadExit {
        /// Nanoseconds since the start.
        time_ns: u64,
        /// Its index.
        thread: u32,
    },
    /// Events dropped because the writer fell behind (the buffer was full).
    Lost {
        /// Nanoseconds since the start.
        time_ns: u64,
        /// How many.
        events: u64,
    },
    /// The process ended and the trace is complete.
    End {
        /// Nanoseconds since the start.
        time_ns: u64,
    },
}

impl Event {
    /// When it happened (nanoseconds since the start), for the events that say.
    pub fn time_ns(&self) -> Option<u64> {
        match self {
            Event::ModuleLoad { time_ns, .. }
            | Event::ModuleUnload { time_ns, .. }
            | Event::Free { time_ns, .. }
            | Event::ThreadStart { time_ns, .. }
            | Event::ThreadExit { time_ns, .. }
            | Event::Lost { time_ns, .. }
            | Event::End { time_ns } => Some(*time_ns),
            Event::Tick(tick) => Some(tick.time_ns),
            Event::HeapStats(stats) => Some(stats.time_ns),
            Event::Stack { .. } | Event::Inherited { .. } => None,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Writing

fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    (v >> 1) as i64 ^ -((v & 1) as i64)
}

/// Appends one record: its tag, its payload's length, its payload (written by `payload`).
fn record(out: &mut Vec<u8>, tag: u8, payload: impl FnOnce(&mut Vec<u8>)) {
    out.push(tag);
    let len_at = out.len();
    // Payloads are short: reserve one length byte, widen it if needed.
    out.push(0);
    let start = out.len();
    payload(out);
    let len = out.len() - start;
    if len < 0x80 {
        out[len_at] = len as u8;
    } else {
        let mut prefix = Vec::with_capacity(10);
        put(&mut prefix, len as u64);
        out.splice(len_at..start, prefix);
    }
}

/// Appends the file's beginning: magic, version and the header record.
pub fn write_header(out: &mut Vec<u8>, h: &Header) {
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    record(out, TAG_HEADER, |o| {
        let fields_start = o.len();
        put(o, h.pid as u64);
        put(o, h.command.len() as u64);
        for arg in &h.command {
            put_bytes(o, arg.as_bytes());
        }
        put_bytes(o, h.options.as_bytes());
        put(o, h.sampling as u64);
        put(o, h.interval);
        put(o, h.stats_interval_ms);
        put(o, h.start_unix_ns);
        put(o, h.pid_namespace);
        put(o, h.process_start_ticks);
        let crc = crc32fast::hash(&o[fields_start..]);
        put(o, u64::from(crc));
    });
}

/// Appends one event record.
pub fn write_event(out: &mut Vec<u8>, e: &Event) {
    match e {
        Event::ModuleLoad { time_ns, module: m } => record(out, TAG_MODULE_LOAD, |o| {
            put(o, *time_ns);
            put(o, m.id);
            put_bytes(o, m.path.as_bytes());
            put(o, m.base);
            put(o, m.ranges.len() as u64);
            for &(s, e) in &m.ranges {
                put(o, s);
                put(o, e - s);
            }
            put_bytes(o, &m.build_id);
        }),
        Event::ModuleUnload { time_ns, id } => record(out, TAG_MODULE_UNLOAD, |o| {
            put(o, *time_ns);
            put(o, *id);
        }),
        Event::Stack { id, frames } => record(out, TAG_STACK, |o| {
            put(o, *id);
            put(o, frames.len() as u64);
            let mut prev = 0u64;
            for &f in frames {
                put(o, zigzag(f.wrapping_sub(prev) as i64));
                prev = f;
            }
        }),
        Event::Tick(t) => record(out, TAG_TICK, |o| {
            for v in [t.time_ns, t.thread as u64, t.kind as u64, t.entry as u64, t.size, t.address, t.weight, t.stack] {
                put(o, v);
            }
        }),
        Event::Inherited { parent, kind, size, address, weight } => record(out, TAG_INHERITED, |o| {
            for v in [*parent as u64, *kind as u64, *size, *address, *weight] {
                put(o, v);
            }
        }),
        Event::Free { time_ns, thread, address } => record(out, TAG_FREE, |o| {
            for v in [*time_ns, *thread as u64, *address] {
                put(o, v);
            }
        }),
        Event::HeapStats(s) => record(out, TAG_HEAP_STATS, |o| {
            put(o, s.time_ns);
            for k in &s.kinds {
                for v in [k.live_bytes, k.live_blocks, k.allocs, k.bytes] {
                    put(o, v);
                }
            }
            for v in
                [s.frees, s.peak_live_bytes, s.arena_bytes, s.mmapped_bytes, s.free_bytes, s.in_use_bytes, s.own_bytes]
            {
                put(o, v);
            }
        }),
        Event::ThreadStart { time_ns, thread, tid } => record(out, TAG_THREAD_START, |o| {
            for v in [*time_ns, *thread as u64, *tid as u64] {
                put(o, v);
            }
        }),
        Event::ThreadExit { time_ns, thread } => record(out, TAG_THREAD_EXIT, |o| {
            put(o, *time_ns);
            put(o, *thread as u64);
        }),
        Event::Lost { time_ns, events } => record(out, TAG_LOST, |o| {
            put(o, *time_ns);
            put(o, *events);
        }),
        Event::End { time_ns } => record(out, TAG_END, |o| put(o, *time_ns)),
    }
}

// ---------------------------------------------------------------------------------------
// Reading

/// Why a trace cannot be read; displays as one line naming the offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    /// Byte offset in the file where reading failed.
    pub offset: u64,
    /// What was wrong there.
    pub what: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not a readable mallocspy trace: {} at offset {}", self.what, self.offset)
    }
}

impl std::error::Error for TraceError {}

/// A cursor over one record's payload.
struct Fields<'a> {
    bytes: &'a [u8],
    at: usize,
    /// File offset of `bytes[0]`, for errors.
    base: u64,
    /// Whether the fields did not fit the record: one ran past its end, or they ended before
    /// it did.
    misfit: bool,
}

impl<'a> Fields<'a> {
    fn error(&self, what: impl Into<String>) -> TraceError {
        TraceError { offset: self.base + self.at as u64, what: what.into() }
    }

    fn int(&mut self) -> Result<u64, TraceError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&b) = self.bytes.get(self.at) else {
                self.misfit = true;
                return Err(self.error("a number runs past the end of its record"));
            };
            self.at += 1;
            // The tenth byte holds the 64th bit only.
            if shift == 63 && b > 1 {
                self.at -= 10;
                return Err(self.error("a number longer than 64 bits"));
            }
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.error("a number longer than 64 bits"))
    }

    fn int_u32(&mut self) -> Result<u32, TraceError> {
        let at = self.at;
        let v = self.int()?;
        u32::try_from(v).map_err(|_| TraceError { offset: self.base + at as u64, what: format!("{v} is not a u32") })
    }

    fn bytes(&mut self) -> Result<&'a [u8], TraceError> {
        let at = self.at;
        let len = self.int()? as usize;
        let end = self.at.checked_add(len).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            self.at = at;
            self.misfit = true;
            return Err(self.error("a string runs past the end of its record"));
        };
        let b = &self.bytes[self.at..end];
        self.at = end;
        Ok(b)
    }

    fn string(&mut self) -> Result<String, TraceError> {
        let at = self.at;
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| {
            // A string cut inside a character, zeros after it, does not fit what was written.
            self.misfit = true;
            TraceError { offset: self.base + at as u64, what: "a string that is not UTF-8".into() }
        })
    }

    /// A count of items that each take at least `min_bytes`, checked against what is left.
    fn count(&mut self, min_bytes: usize) -> Result<usize, TraceError> {
        let at = self.at;
        let n = self.int()?;
        if n.saturating_mul(min_bytes as u64) > (self.bytes.len() - self.at) as u64 {
            self.at = at;
            self.misfit = true;
            return Err(self.error(format!("a count of {n} items that do not fit in the record")));
        }
        Ok(n as usize)
    }
}

/// The header of a file of `version`.
fn read_header(f: &mut Fields<'_>, version: u32) -> Result<Header, TraceError> {
    let pid = f.int_u32()?;
    let at = f.at;
    let n = f.count(1)?;
    if n > MAX_ARGS {
        f.at = at;
        return Err(f.error(format!("a command line of {n} arguments (at most {MAX_ARGS})")));
    }
    let command = (0..n).map(|_| f.string()).collect::<Result<_, _>>()?;
    let options = f.string()?;
    let sampling = match f.int()? {
        0 => Sampling::Poisson,
        1 => Sampling::Tick,
        other => return Err(f.error(format!("unknown sampling mode {other}"))),
    };
    // What `sample_interval` takes: a header with another was not written by mallocspy (one
    // of 0 was reported as "one sample per 0 B allocated on average", review helper 154).
    let at = f.at;
    let interval = f.int()?;
    if !(1..=crate::options::MAX_SAMPLE_INTERVAL as u64).contains(&interval) {
        f.at = at;
        return Err(f.error(format!("a sampling interval of {interval} bytes (from 1 to 2^62)")));
    }
    let (stats_interval_ms, start_unix_ns) = (f.int()?, f.int()?);
    let (pid_namespace, process_start_ticks) = if version >= 2 { (f.int()?, f.int()?) } else { (0, 0) };
    if version >= 3 {
        let crc = crc32fast::hash(&f.bytes[..f.at]);
        if f.int()? != u64::from(crc) {
            return Err(TraceError {
                // The header record's start: the damage is anywhere in it.
                offset: 20,
                what: "a header whose checksum does not match its fields (damaged)".into(),
            });
        }
    }
    Ok(Header {
        pid,
        command,
        options,
        sampling,
        interval,
        stats_interval_ms,
        start_unix_ns,
        pid_namespace,
        process_start_ticks,
    })
}

fn read_event(tag: u8, f: &mut Fields<'_>) -> Result<Option<Event>, TraceError> {
    Ok(Some(match tag {
        TAG_MODULE_LOAD => {
            let time_ns = f.int()?;
            let id = f.int()?;
            let mut path = f.string()?;
            if path.len() > MAX_PATH {
                // Cut, and marked with `…`: no longer the file's name, its frames are named by
                // their offsets.
                let cut = (0..=MAX_PATH).rev().find(|&i| path.is_char_boundary(i)).unwrap_or(0);
                path.truncate(cut);
                path.push('…');
            }
            let base = f.int()?;
            let n = f.count(2)?;
            let mut ranges = Vec::with_capacity(n);
            for _ in 0..n {
                let start = f.int()?;
                let len = f.int()?;
                ranges.push((start, start.saturating_add(len)));
            }
            let build_id = f.bytes()?.to_vec();
            Event::ModuleLoad { time_ns, module: Module { id, path, base, ranges, build_id } }
        }
        TAG_MODULE_UNLOAD => Event::ModuleUnload { time_ns: f.int()?, id: f.int()? },
        TAG_STACK => {
            let id = f.int()?;
            let at = f.at;
            let n = f.count(1)?;
            if n > MAX_FRAMES {
                f.at = at;
                return Err(f.error(format!("a stack of {n} frames (at most {MAX_FRAMES})")));
            }
            let mut frames = Vec::with_capacity(n);
            let mut prev = 0u64;
            for _ in 0..n {
                prev = prev.wrapping_add(unzigzag(f.int()?) as u64);
                frames.push(prev);
            }
            Event::Stack { id, frames }
        }
        TAG_TICK => {
            let time_ns = f.int()?;
            let thread = f.int_u32()?;
            let kind = f.int()?;
            if Kind::from_index(kind).is_none() {
                return Err(f.error(format!("unknown allocation kind {kind}")));
            }
            let entry = f.int()?;
            if entry as usize >= crate::Entry::ALL.len() {
                return Err(f.error(format!("unknown entry point {entry}")));
            }
            Event::Tick(Tick {
                time_ns,
                thread,
                kind: kind as u8,
                entry: entry as u8,
                size: f.int()?,
                address: f.int()?,
                weight: f.int()?,
                stack: f.int()?,
            })
        }
        TAG_FREE => Event::Free { time_ns: f.int()?, thread: f.int_u32()?, address: f.int()? },
        TAG_INHERITED => {
            let parent = f.int_u32()?;
            let kind = f.int()?;
            if Kind::from_index(kind).is_none() {
                return Err(f.error(format!("unknown allocation kind {kind}")));
            }
            Event::Inherited { parent, kind: kind as u8, size: f.int()?, address: f.int()?, weight: f.int()? }
        }
        TAG_HEAP_STATS => {
            let mut s = HeapStats { time_ns: f.int()?, ..HeapStats::default() };
            for k in &mut s.kinds {
                *k = KindStats { live_bytes: f.int()?, live_blocks: f.int()?, allocs: f.int()?, bytes: f.int()? };
            }
            s.frees = f.int()?;
            s.peak_live_bytes = f.int()?;
            s.arena_bytes = f.int()?;
            s.mmapped_bytes = f.int()?;
            s.free_bytes = f.int()?;
            s.in_use_bytes = f.int()?;
            s.own_bytes = f.int()?;
            Event::HeapStats(s)
        }
        TAG_THREAD_START => Event::ThreadStart { time_ns: f.int()?, thread: f.int_u32()?, tid: f.int_u32()? },
        TAG_THREAD_EXIT => Event::ThreadExit { time_ns: f.int()?, thread: f.int_u32()? },
        TAG_LOST => Event::Lost { time_ns: f.int()?, events: f.int()? },
        TAG_END => Event::End { time_ns: f.int()? },
        TAG_HEADER => return Err(f.error("a second header")),
        _ => return Ok(None),
    }))
}

/// Reads a trace record by record.
///
/// ```
/// use mallocspy::trace::{Reader, Header, Event, write_header, write_event};
/// let mut file = Vec::new();
/// write_header(&mut file, &Header { pid: 7, interval: 102400, ..Header::default() });
/// write_event(&mut file, &Event::End { time_ns: 5 });
/// let mut reader = Reader::new(&file)?;
/// assert_eq!(reader.header().pid, 7);
/// assert_eq!(reader.next().unwrap()?, Event::End { time_ns: 5 });
/// assert!(reader.next().is_none() && reader.truncated().is_none());
/// # Ok::<(), mallocspy::trace::TraceError>(())
/// ```
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    header: Header,
    /// Where the file stops in the middle of a record.
    truncated: Option<u64>,
    failed: bool,
    /// Where the file's tail of zeros starts (its length, without one).
    zeros_from: usize,
    /// Where the pages of that tail start: blocks the file system gave the file but never
    /// filled (a crash of the machine). A record that reaches into them was never written
    /// whole.
    written_end: usize,
    /// Records of tags this version does not know, skipped: how many, and where the first
    /// starts.
    skipped: u64,
    first_skipped: Option<u64>,
    /// The latest time of the events read so far.
    latest_ns: u64,
}

impl<'a> Reader<'a> {
    /// Checks the magic and version and reads the header.
    ///
    /// # Errors
    /// A file that is not a mallocspy trace, of another version, or whose header is damaged.
    pub fn new(bytes: &'a [u8]) -> Result<Self, TraceError> {
        let err = |offset: usize, what: &str| TraceError { offset: offset as u64, what: what.into() };
        if bytes.is_empty() {
            // Not "no signature": a trace whose writer never wrote is empty, and says so.
            return Err(err(0, "the file is empty, no signature"));
        }
        if bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes) {
            return Err(err(0, "the file ends inside its signature"));
        }
        if bytes.starts_with(&[0x1f, 0x8b]) {
            // A trace compressed for keeping or sending (review helper 131).
            return Err(err(0, "gzip-compressed (zcat FILE | mallocspy report -)"));
        }
        if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
            return Err(err(0, "no mallocspy-trace signature"));
        }
        let Some(v) = bytes.get(16..20) else { return Err(err(16, "the file ends inside its version")) };
        let version = u32::from_le_bytes(v.try_into().expect("4 bytes"));
        if !(1..=VERSION).contains(&version) {
            return Err(err(16, &format!("version {version}, this mallocspy reads versions 1 to {VERSION}")));
        }
        let zeros_from = bytes.iter().rposition(|&b| b != 0).map_or(0, |last| last + 1);
        // Pages are written whole: the zeros of the page that holds the last byte that is not
        // zero were written (a record's last fields may be zeros).
        let written_end = zeros_from.next_multiple_of(WRITTEN_PAGE).min(bytes.len());
        let mut reader = Reader {
            bytes,
            at: 20,
            header: Header::default(),
            truncated: None,
            failed: false,
            zeros_from,
            written_end,
            skipped: 0,
            first_skipped: None,
            latest_ns: 0,
        };
        match reader.raw() {
            Some(Ok((TAG_HEADER, mut f))) => {
                let read = read_header(&mut f, version).and_then(|header| {
                    if f.at != f.bytes.len() {
                        f.misfit = true;
                        return Err(f.error("a header longer than its fields"));
                    }
                    Ok(header)
                });
                // Cut, then zero-filled, as a record may be (see `next`): whatever its zeros
                // read as (a sampling interval of 0), the header was not written whole.
                if read.is_err() && reader.at > zeros_from {
                    return Err(err(20, HEADER_CUT));
                }
                reader.header = read?;
            }
            Some(Ok(_)) => return Err(err(20, "no header record")),
            Some(Err(e)) => return Err(e),
            None => return Err(err(20, HEADER_CUT)),
        }
        Ok(reader)
    }

    /// The trace's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Bytes read so far (for progress).
    pub fn offset(&self) -> u64 {
        self.at as u64
    }

    /// If the file ends inside a record: the offset where that record starts (the last
    /// whole event ends there). Known once [`Reader::next`] has returned `None`.
    pub fn truncated(&self) -> Option<u64> {
        self.truncated
    }

    /// Records of tags this version does not know, skipped so far: how many, and the offset
    /// of the first. A later version's, or damage: a changed bit of a tag makes a known
    /// record unknown, its event lost with no other sign (review helper 123).
    pub fn skipped(&self) -> (u64, Option<u64>) {
        (self.skipped, self.first_skipped)
    }

    /// The next record's tag and payload; `None` at the end (or where a record is cut).
    fn raw(&mut self) -> Option<Result<(u8, Fields<'a>), TraceError>> {
        let start = self.at;
        let &tag = self.bytes.get(start)?;
        if self.bytes[start..].starts_with(MAGIC) {
            // Read as a record of unknown tag `m`, another trace's start was skipped and its
            // records taken for this one's (`cat a.trace b.trace`).
            return Some(Err(TraceError {
                offset: start as u64,
                what: "another trace starts here (traces joined into one file?)".into(),
            }));
        }
        if tag == 0 {
            // A crash can leave the file's tail zero-filled (its size written, its blocks
            // not): the events end there. A zero tag with data after it is damage, not a cut.
            if start < self.zeros_from {
                return Some(Err(TraceError {
                    offset: start as u64,
                    what: "a record of tag 0 with data after it".into(),
                }));
            }
            self.truncated = Some(start as u64);
            return None;
        }
        let mut len_field = Fields { bytes: &self.bytes[start + 1..], at: 0, base: start as u64 + 1, misfit: false };
        let len = match len_field.int() {
            Ok(len) => len,
            Err(_) if len_field.bytes.len() < 10 => {
                self.truncated = Some(start as u64);
                return None;
            }
            Err(e) => return Some(Err(e)),
        };
        if len > max_payload(tag) {
            return Some(Err(TraceError {
                offset: start as u64 + 1,
                what: format!("a record of tag {tag} claiming {len} bytes (at most {})", max_payload(tag)),
            }));
        }
        let payload = start + 1 + len_field.at;
        let end = (payload as u64).checked_add(len).filter(|&e| e <= self.bytes.len() as u64);
        let Some(end) = end else {
            if self.ends_with_an_end_record_after(start) {
                return Some(Err(TraceError {
                    offset: start as u64 + 1,
                    what: format!("a record of tag {tag} claiming {len} bytes, past the trace's end record"),
                }));
            }
            self.truncated = Some(start as u64);
            return None;
        };
        self.at = end as usize;
        Some(Ok((
            tag,
            Fields { bytes: &self.bytes[payload..end as usize], at: 0, base: payload as u64, misfit: false },
        )))
    }
}

impl Reader<'_> {
    /// Whether the file ends with a whole End record that starts after `start`, later than
    /// every event read: a record at `start` that claims to run past the file's end was then
    /// damaged, not cut (review helper 162: a stack's length byte set to 0xff dropped half a
    /// trace with a warning of a cut). The bytes of a cut record could end with what reads as
    /// an End record: none of 10.6 million cuts of four recorded traces did (review helper
    /// 165), and one that did would also have to be later than every event before it.
    fn ends_with_an_end_record_after(&self, start: usize) -> bool {
        let Some(tail) = self.bytes.get(start + 1..) else { return false };
        (1..=10).any(|len| {
            let Some(at) = tail.len().checked_sub(2 + len) else { return false };
            let mut time = Fields { bytes: &tail[at + 2..], at: 0, base: 0, misfit: false };
            tail[at] == TAG_END
                && usize::from(tail[at + 1]) == len
                && time.int().is_ok_and(|t| self.latest_ns != 0 && t >= self.latest_ns)
                && time.at == len
        })
    }

    /// A tick's size and weight as sampling can make them: a damaged one summed into the
    /// estimates made exbibytes of them, and overflowed a pprof profile's totals.
    fn check(&self, tick: &Tick, start: usize) -> Result<(), TraceError> {
        let what = if tick.size > isize::MAX as u64 {
            format!("a tick of {} bytes (no allocation is so large)", tick.size)
        } else if tick.weight > max_weight(tick.size, self.header.interval) {
            format!(
                "a tick of {} bytes weighing {} (sampled every {} bytes)",
                tick.size, tick.weight, self.header.interval
            )
        } else {
            return Ok(());
        };
        Err(TraceError { offset: start as u64, what })
    }
}

/// More than any tick of `size` bytes sampled every `interval` bytes weighs: `size / (1 -
/// e^(-size/interval))` is below `size + interval` in poisson mode, the bytes since the last
/// tick are below it in tick mode; twice that leaves room for rounding.
fn max_weight(size: u64, interval: u64) -> u64 {
    size.saturating_add(interval.max(1)).saturating_mul(2)
}

impl Iterator for Reader<'_> {
    type Item = Result<Event, TraceError>;

    /// The next event; records of unknown tags are skipped. After an error, `None`.
    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        loop {
            let start = self.at;
            let mut misfit = false;
            let result = match self.raw()? {
                Ok((tag, mut f)) => {
                    let read = read_event(tag, &mut f).and_then(|e| {
                        if e.is_some() && f.at != f.bytes.len() {
                            f.misfit = true;
                            Err(f.error("a record longer than its fields"))
                        } else if let Some(Event::Tick(tick)) = &e {
                            self.check(tick, start).map(|()| e)
                        } else {
                            Ok(e)
                        }
                    });
                    misfit = f.misfit;
                    read
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(Some(event)) => {
                    self.latest_ns = self.latest_ns.max(event.time_ns().unwrap_or(0));
                    return Some(Ok(event));
                }
                Ok(None) => {
                    self.skipped += 1;
                    self.first_skipped.get_or_insert(start as u64);
                    continue;
                }
                // A record that reaches into the unwritten pages and does not read (their
                // zeros taken for its last fields) was never written whole: the file is cut
                // there. One that reads is taken: a whole record's last bytes may be zeros past
                // a page boundary too. So is one that reaches into the file's tail of zeros
                // before that page's end when its fields do not fit it (zeros read as numbers
                // of one byte each): the rest of the last block written before a crash is zeros
                // past where the file ended then, and the file may have grown beyond since.
                Err(_) if self.at > self.written_end || misfit && self.at > self.zeros_from => {
                    self.truncated = Some(start as u64);
                    return None;
                }
                Err(e) => {
                    self.failed = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `header_of` reads of a file that is a trace only in its first 20 bytes: no more
    /// than its first read (it read on while the header "was cut", up to 2 GiB of a damaged
    /// or zero-filled file).
    #[test]
    fn a_header_that_is_not_one_is_read_no_further_than_a_cut_one() {
        let mut start = MAGIC.to_vec();
        start.extend(VERSION.to_le_bytes());
        // Zeros, a header too long for its fields, another record first, one of a later
        // version's tags claiming 60 MiB.
        for rest in [&[0u8][..], &[TAG_HEADER, 200, 1, 7], &[9, 1, 0], &[200, 0x80, 0x80, 0x80, 0x1e, 1]] {
            use std::io::Read;
            let mut file = start.chain(rest).chain(std::io::repeat(*rest.last().unwrap()));
            let mut counter = Counting { inner: &mut file, read: 0 };
            assert!(header_of(&mut counter).is_none(), "{rest:?}");
            assert!(counter.read <= 64 << 10, "{rest:?}: {} bytes read", counter.read);
        }
        // A header record cut by the first read: read on, as far as its length says.
        let long = Header { command: vec!["a".repeat(100_000); 12], ..Header::default() };
        let mut file = Vec::new();
        write_header(&mut file, &long);
        let mut counter = Counting { inner: &file[..], read: 0 };
        assert_eq!(header_of(&mut counter).map(|h| h.command.len()), Some(12));
    }

    struct Counting<R> {
        inner: R,
        read: u64,
    }

    impl<R: std::io::Read> std::io::Read for Counting<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.read += n as u64;
            Ok(n)
        }
    }

    fn sample_file() -> (Vec<u8>, Vec<Event>) {
        let header = Header {
            pid: 4242,
            command: vec!["sqlite3".into(), ":memory:".into()],
            options: "spy=ticks:trace=x".into(),
            sampling: Sampling::Tick,
            interval: 102_400,
            stats_interval_ms: 100,
            start_unix_ns: 1_764_000_000_000_000_000,
            pid_namespace: 4_026_531_836,
            process_start_ticks: 123_456,
        };
        let events = vec![
            Event::ModuleLoad {
                time_ns: 1,
                module: Module {
                    id: 0,
                    path: "/usr/bin/sqlite3".into(),
                    base: 0x5555_0000_0000,
                    ranges: vec![(0x5555_0000_1000, 0x5555_0002_0000)],
                    build_id: vec![0xab, 0xcd],
                },
            },
            Event::Inherited {
                parent: 4241,
                kind: Kind::Aligned as u8,
                size: 64,
                address: 0x7f00_0000_1000,
                weight: 102_400,
            },
            Event::ThreadStart { time_ns: 2, thread: 0, tid: 4242 },
            Event::Stack { id: 1, frames: vec![0x5555_0000_1234, 0x7fff_0000_0010, 0x5555_0000_1000] },
            Event::Tick(Tick {
                time_ns: 3,
                thread: 0,
                kind: Kind::Large as u8,
                entry: 0,
                size: 200_000,
                address: 0x7f00_0000_0010,
                weight: 200_000,
                stack: 1,
            }),
            Event::Free { time_ns: 4, thread: 0, address: 0x7f00_0000_0010 },
            Event::HeapStats(HeapStats {
                time_ns: 5,
                kinds: [KindStats { live_bytes: 1, live_blocks: 2, allocs: 3, bytes: 4 }; 3],
                frees: 6,
                peak_live_bytes: 7,
                arena_bytes: 8,
                mmapped_bytes: 9,
                free_bytes: 10,
                in_use_bytes: 11,
                own_bytes: 12,
            }),
            Event::Lost { time_ns: 6, events: 3 },
            Event::ModuleUnload { time_ns: 7, id: 0 },
            Event::ThreadExit { time_ns: 8, thread: 0 },
            Event::End { time_ns: 9 },
        ];
        let mut file = Vec::new();
        write_header(&mut file, &header);
        for e in &events {
            write_event(&mut file, e);
        }
        (file, events)
    }

    #[test]
    fn every_event_reads_back_as_written() {
        let (file, events) = sample_file();
        let mut reader = Reader::new(&file).unwrap();
        assert_eq!(reader.header().command, ["sqlite3", ":memory:"]);
        assert_eq!(reader.header().sampling, Sampling::Tick);
        let read: Vec<Event> = reader.by_ref().map(Result::unwrap).collect();
        assert_eq!(read, events);
        assert_eq!(reader.truncated(), None);
    }

    #[test]
    fn a_file_cut_anywhere_reads_up_to_its_last_whole_record() {
        let (file, events) = sample_file();
        let header_end = Reader::new(&file).unwrap().at;
        let mut boundaries = vec![header_end];
        for e in &events {
            let mut record = Vec::new();
            write_event(&mut record, e);
            boundaries.push(boundaries.last().unwrap() + record.len());
        }
        for cut in header_end..file.len() {
            let mut reader = Reader::new(&file[..cut]).unwrap();
            let read: Vec<Event> = reader.by_ref().map(Result::unwrap).collect();
            let whole = boundaries.iter().filter(|&&b| b <= cut).count() - 1;
            assert_eq!(read[..], events[..whole], "cut at {cut}");
            let at_boundary = boundaries.contains(&cut);
            assert_eq!(reader.truncated(), (!at_boundary).then_some(boundaries[whole] as u64), "cut at {cut}");
        }
        for cut in 0..header_end {
            assert!(Reader::new(&file[..cut]).is_err(), "header cut at {cut}");
        }
    }

    /// A tail of zeros (blocks the file system allocated but the writer never filled) ends
    /// the trace where it starts, as a cut does.
    #[test]
    fn a_tail_of_zeros_is_read_as_a_cut() {
        let (mut file, events) = sample_file();
        let end = file.len();
        file.resize(end + (1 << 16), 0);
        let mut reader = Reader::new(&file).unwrap();
        let read: Vec<Event> = reader.by_ref().map(Result::unwrap).collect();
        assert_eq!(read, events);
        assert_eq!(reader.truncated(), Some(end as u64));
    }

    /// A header with any byte of its record changed is an error, not another header: its
    /// fields' ranges alone let half such changes of a recorded trace's header pass.
    #[test]
    fn every_damaged_byte_of_a_header_is_an_error() {
        let (sample, _) = sample_file();
        let reader = Reader::new(&sample).unwrap();
        let (header, end) = (reader.header().clone(), reader.offset() as usize);
        for at in 20..end {
            for value in [sample[at] ^ 1, sample[at] ^ 0x40, sample[at] ^ 0x80, 0, 0xff] {
                let mut file = sample.clone();
                file[at] = value;
                match Reader::new(&file) {
                    Ok(read) => assert!(value == sample[at] && read.header() == &header, "byte {at} set to {value:#x}"),
                    Err(e) => assert!(e.offset <= end as u64, "{e}"),
                }
            }
        }
        let mut file = sample.clone();
        file[end - 8] ^= 1;
        assert_eq!(
            Reader::new(&file).err().unwrap().to_string(),
            "not a readable mallocspy trace: a header whose checksum does not match its fields (damaged) at offset 20"
        );
    }

    /// A trace of version 1, whose header does not say which process it is, is read (its
    /// identity unknown, 0), as are its events; and one of version 2, whose header has no
    /// checksum.
    #[test]
    fn traces_of_versions_1_and_2_are_read() {
        let (sample, events) = sample_file();
        let mut reader = Reader::new(&sample).unwrap();
        let header = reader.header().clone();
        assert_eq!((header.pid_namespace, header.process_start_ticks), (4_026_531_836, 123_456));
        let body = &sample[reader.offset() as usize..];
        assert!(reader.by_ref().all(|e| e.is_ok()));
        // The file as `version` wrote it: version 1's header ends before the identity.
        let of_version = |version: u32| {
            let mut file = MAGIC.to_vec();
            file.extend(version.to_le_bytes());
            record(&mut file, TAG_HEADER, |o| {
                put(o, header.pid as u64);
                put(o, header.command.len() as u64);
                header.command.iter().for_each(|arg| put_bytes(o, arg.as_bytes()));
                put_bytes(o, header.options.as_bytes());
                put(o, header.sampling as u64);
                put(o, header.interval);
                put(o, header.stats_interval_ms);
                put(o, header.start_unix_ns);
                if version == 2 {
                    put(o, header.pid_namespace);
                    put(o, header.process_start_ticks);
                }
            });
            file.extend_from_slice(body);
            file
        };
        let without_identity = Header { pid_namespace: 0, process_start_ticks: 0, ..header.clone() };
        for (version, expected) in [(1, &without_identity), (2, &header)] {
            let file = of_version(version);
            let mut reader = Reader::new(&file).unwrap();
            assert_eq!(reader.header(), expected, "version {version}");
            assert_eq!(reader.by_ref().collect::<Result<Vec<_>, _>>().unwrap(), events);
        }
        // And a later version is refused, in one line.
        let mut v4 = sample.clone();
        v4[16..20].copy_from_slice(&4u32.to_le_bytes());
        let error = Reader::new(&v4).err().unwrap().to_string();
        assert_eq!(
            error,
            "not a readable mallocspy trace: version 4, this mallocspy reads versions 1 to 3 at offset 16"
        );
    }

    /// A file cut anywhere, then zero-filled (its size grown by writes that a crash kept from
    /// the disk, the last block written holding zeros past where the file ended then), is read
    /// up to the record the cut fell in, as a cut: it was "a record longer than its fields"
    /// wherever the cut was not on a page boundary (review helper 154: 32 cuts of 40), or
    /// inside a character of a path "a string that is not UTF-8" (review helper 155). Cut in
    /// its header, it is said to be.
    #[test]
    fn a_cut_anywhere_then_zeros_is_read_as_a_cut() {
        let (sample, mut events) = sample_file();
        let Event::ModuleLoad { module, .. } = &mut events[0] else { panic!("a module first") };
        module.path = "/usr/bin/sqlité3".into();
        let mut whole = Vec::new();
        write_header(&mut whole, Reader::new(&sample).unwrap().header());
        let header_end = whole.len();
        events.iter().for_each(|e| write_event(&mut whole, e));
        for cut in 20..header_end {
            let mut file = whole[..cut].to_vec();
            file.resize(cut + 5000, 0);
            // Or read, its zeroed last fields as numbers.
            if let Err(e) = Reader::new(&file) {
                assert_eq!(e.to_string(), format!("not a readable mallocspy trace: {HEADER_CUT} at offset 20"));
            }
        }
        for cut in header_end..whole.len() {
            let mut file = whole[..cut].to_vec();
            file.resize(cut + 5000, 0);
            let mut reader = Reader::new(&file).unwrap();
            let read: Vec<Event> =
                reader.by_ref().collect::<Result<_, _>>().unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
            // The record the cut fell in may read, its zeroed fields as numbers.
            assert!(events.starts_with(&read[..read.len().saturating_sub(1)]), "cut at {cut}");
            assert!(reader.truncated().is_some(), "cut at {cut}");
        }
    }

    /// A crash leaves the pages it did not write as zeros, from a page boundary on, which may
    /// fall inside a record: the file is cut at that record where its zeros do not read as its
    /// fields (they read as "a record longer than its fields"), and nothing before it is lost.
    /// A whole record whose own last bytes are zeros past the boundary is read.
    #[test]
    fn unwritten_pages_from_inside_a_record_cut_the_file_at_that_record() {
        let (whole, events) = sample_file();
        let mut reader = Reader::new(&whole).unwrap();
        let header_end = reader.offset() as usize;
        let mut starts = vec![header_end];
        while reader.next().is_some() {
            starts.push(reader.offset() as usize);
        }
        assert_eq!(starts.len(), events.len() + 1);
        // An unknown record (readers skip it) of `total` bytes, at least 131.
        let filler = |total: usize| {
            let len = total - 3;
            let mut r = vec![200u8, (len as u8) | 0x80, (len >> 7) as u8];
            r.resize(total, 0xee);
            r
        };
        for (i, window) in starts.windows(2).enumerate() {
            let (record, next) = (window[0], window[1]);
            for into in 1..next - record {
                // Record `i` starts `into` bytes before the page boundary.
                let mut file = whole[..header_end].to_vec();
                file.extend(filler(WRITTEN_PAGE - into - record));
                file.extend(&whole[header_end..]);
                let record_at = WRITTEN_PAGE - into;
                file.truncate(WRITTEN_PAGE);
                file.resize(WRITTEN_PAGE * 3, 0);
                let mut reader = Reader::new(&file).unwrap();
                let read: Vec<Event> = reader.by_ref().map(Result::unwrap).collect();
                let at = format!("unwritten from {into} bytes into record {i}");
                assert_eq!(read[..i], events[..i], "{at}");
                // Cut at the record, or (its zeroed fields read as numbers) after it.
                let cut_at = if read.len() == i { record_at } else { record_at + next - record };
                assert!(read.len() <= i + 1, "{at}");
                assert_eq!(reader.truncated(), Some(cut_at as u64), "{at}");
            }
        }
        // A whole last record whose last byte, a zero, is past a page boundary: read.
        let mut file = whole[..header_end].to_vec();
        let mut exit = Vec::new();
        write_event(&mut exit, &Event::ThreadExit { time_ns: 5, thread: 0 });
        assert_eq!(exit.last(), Some(&0));
        file.extend(filler(WRITTEN_PAGE - (exit.len() - 1) - header_end));
        file.extend(&exit);
        let mut reader = Reader::new(&file).unwrap();
        let read: Vec<Event> = reader.by_ref().map(Result::unwrap).collect();
        assert_eq!((read, reader.truncated()), (vec![Event::ThreadExit { time_ns: 5, thread: 0 }], None));
        // Zeros that end a written page are data: a last record ending in them is read.
        let mut file = whole.clone();
        file.extend(filler(WRITTEN_PAGE - whole.len()));
        let last = file.len() - 1;
        file[last] = 0;
        let mut reader = Reader::new(&file).unwrap();
        let read: Vec<Event> = reader.by_ref().map(Result::unwrap).collect();
        assert_eq!((read, reader.truncated()), (events, None));
    }

    #[test]
    fn random_bytes_are_one_line_errors_never_panics() {
        let e = Reader::new(b"PK\x03\x04 a zip file, not a trace").err().unwrap();
        assert_eq!(e.to_string(), "not a readable mallocspy trace: no mallocspy-trace signature at offset 0");
        let e = Reader::new(b"\x1f\x8b\x08\x00 a gzipped trace").err().unwrap();
        let gzip = "not a readable mallocspy trace: gzip-compressed (zcat FILE | mallocspy report -) at offset 0";
        assert_eq!(e.to_string(), gzip);
        let e = Reader::new(b"").err().unwrap();
        assert_eq!(e.to_string(), "not a readable mallocspy trace: the file is empty, no signature at offset 0");
        let e = Reader::new(b"mallocspy-").err().unwrap();
        assert_eq!(e.to_string(), "not a readable mallocspy trace: the file ends inside its signature at offset 0");
        // Two traces in one file: the second's signature is no record of this one's.
        let (file, _) = sample_file();
        let joined = [file.as_slice(), file.as_slice()].concat();
        let e = Reader::new(&joined).unwrap().find_map(Result::err).expect("an error");
        let joined_at = format!("another trace starts here (traces joined into one file?) at offset {}", file.len());
        assert_eq!(e.to_string(), format!("not a readable mallocspy trace: {joined_at}"));
        // Damage inside records: every byte flipped in turn errs or reads, never panics.
        let (file, _) = sample_file();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for i in 0..file.len() {
            let mut damaged = file.clone();
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            damaged[i] ^= (x as u8) | 1;
            if let Ok(reader) = Reader::new(&damaged) {
                for e in reader {
                    if let Err(e) = e {
                        assert!(!e.to_string().contains('\n'));
                    }
                }
            }
        }
    }

    /// Damage that a cut cannot explain is an error naming where it is, not a quiet end.
    #[test]
    fn damage_is_told_from_a_cut() {
        let error = |file: &[u8]| match Reader::new(file) {
            Err(e) => e.to_string(),
            Ok(reader) => reader.filter_map(Result::err).map(|e| e.to_string()).collect::<Vec<_>>().join("|"),
        };
        let mut header = Vec::new();
        write_header(&mut header, &Header::default());
        // A tick's length claiming more than its eight numbers can take, the file going on.
        let mut file = header.clone();
        let tick = file.len();
        write_event(&mut file, &Event::End { time_ns: 1 });
        file[tick] = TAG_TICK;
        file[tick + 1] = 0x95;
        file.extend_from_slice(&[7; 300]);
        assert_eq!(
            error(&file),
            format!(
                "not a readable mallocspy trace: a record of tag 5 claiming 149 bytes (at most 80) at offset {}",
                tick + 1
            )
        );
        // Bytes after the header's fields (not zeros: a header whose record reaches into the
        // file's tail of zeros and does not read is taken for a cut one).
        let mut file = header.clone();
        file[21] += 1;
        file.push(7);
        assert_eq!(
            error(&file),
            format!("not a readable mallocspy trace: a header longer than its fields at offset {}", header.len())
        );
        // Another record where the header should be.
        let mut file = header.clone();
        file[20] = TAG_MODULE_LOAD;
        assert_eq!(error(&file), "not a readable mallocspy trace: no header record at offset 20");
        // A length damaged to reach past the end record: damage, not a cut.
        let mut file = header.clone();
        write_event(&mut file, &Event::ThreadStart { time_ns: 5_000, thread: 0, tid: 7 });
        let stack = file.len();
        write_event(&mut file, &Event::Stack { id: 1, frames: vec![0x1000; 3] });
        write_event(&mut file, &Event::End { time_ns: 9_000 });
        file[stack + 1] = 0x7f;
        assert_eq!(
            error(&file),
            format!(
                "not a readable mallocspy trace: a record of tag {TAG_STACK} claiming 127 bytes, past the trace's end \
                 record at offset {}",
                stack + 1
            )
        );
        // Bytes that read as an End record earlier than the events before: a cut.
        let end = file.len();
        file.truncate(end - 3);
        write_event(&mut file, &Event::End { time_ns: 137 });
        let mut reader = Reader::new(&file).unwrap();
        assert!(reader.by_ref().all(|e| e.is_ok()));
        assert_eq!(reader.truncated(), Some(stack as u64));
        // A number of more than 64 bits.
        let mut file = header.clone();
        file.extend_from_slice(&[TAG_END, 10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02]);
        assert_eq!(
            error(&file),
            format!("not a readable mallocspy trace: a number longer than 64 bits at offset {}", header.len() + 2)
        );
        // A stack deeper than any tick carries.
        let mut file = header.clone();
        write_event(&mut file, &Event::Stack { id: 1, frames: vec![0x1000; MAX_FRAMES + 1] });
        assert!(error(&file).contains("a stack of 1025 frames (at most 1024)"), "{}", error(&file));
        // A zero where a record starts, with records after it: the events after it are not
        // dropped as if the file ended there.
        let mut file = header.clone();
        write_event(&mut file, &Event::End { time_ns: 1 });
        let zero = file.len();
        file.push(0);
        write_event(&mut file, &Event::End { time_ns: 2 });
        assert_eq!(
            error(&file),
            format!("not a readable mallocspy trace: a record of tag 0 with data after it at offset {zero}")
        );
        // A module path longer than any file can be opened by, to be repeated in its frames, is
        // cut (a library renamed while it was loaded shows a longer one).
        let mut file = header.clone();
        let module = Module { path: format!("/{}", "é".repeat(MAX_PATH)), ..Module::default() };
        write_event(&mut file, &Event::ModuleLoad { time_ns: 1, module });
        let Some(Ok(Event::ModuleLoad { module, .. })) = Reader::new(&file).unwrap().next() else { panic!("no load") };
        assert_eq!(module.path, format!("/{}…", "é".repeat((MAX_PATH - 1) / 2)));
        // A record of a tag this version does not know, claiming the rest of a long file: damage,
        // not a cut that drops the records after it.
        let mut file = header.clone();
        let unknown = file.len();
        file.extend_from_slice(&[0x85, 0xff, 0xff, 0x7f]);
        for time_ns in 0..100_000 {
            write_event(&mut file, &Event::ThreadExit { time_ns, thread: 1 });
        }
        assert_eq!(
            error(&file),
            format!(
                "not a readable mallocspy trace: a record of tag 133 claiming 2097151 bytes (at most 65536) at offset {}",
                unknown + 1
            )
        );
        // Ticks no sampling makes: larger than an allocation can be, or weighing more than
        // twice their size and the interval.
        let big = 1u64 << 63;
        for ((taken, refused), what) in [
            (((big - 1, 1), (big, 1)), format!("a tick of {big} bytes (no allocation is so large)")),
            (
                ((100, 205_000), (100, 205_001)),
                "a tick of 100 bytes weighing 205001 (sampled every 102400 bytes)".into(),
            ),
        ] {
            let mut file = Vec::new();
            write_header(&mut file, &Header { interval: 102_400, ..Header::default() });
            let (size, weight) = taken;
            write_event(&mut file, &Event::Tick(Tick { size, weight, ..Tick::default() }));
            assert_eq!(error(&file), "");
            let tick = file.len();
            let (size, weight) = refused;
            write_event(&mut file, &Event::Tick(Tick { size, weight, ..Tick::default() }));
            assert_eq!(error(&file), format!("not a readable mallocspy trace: {what} at offset {tick}"));
        }
        // A sampling interval `sample_interval` does not take (one of 0 was reported as "one
        // sample per 0 B", one of 2^64 - 1 let any tick weigh anything).
        for interval in [0, (1 << 62) + 1, u64::MAX] {
            let mut file = Vec::new();
            write_header(&mut file, &Header { interval, ..Header::default() });
            write_event(&mut file, &Event::End { time_ns: 1 });
            let said = format!("a sampling interval of {interval} bytes (from 1 to 2^62)");
            assert!(error(&file).contains(&said), "{}", error(&file));
        }
        // More arguments than a program can be given, each a string the report would make.
        let mut file = Vec::new();
        write_header(&mut file, &Header { command: vec![String::new(); MAX_ARGS + 1], ..Header::default() });
        write_event(&mut file, &Event::End { time_ns: 1 });
        assert!(error(&file).contains("a command line of 1048577 arguments (at most 1048576)"), "{}", error(&file));
    }

    /// A record of an unknown tag is skipped, and counted: a changed bit of a tick's tag lost
    /// its event with no sign.
    #[test]
    fn records_of_unknown_tags_are_skipped_and_counted() {
        let mut file = Vec::new();
        write_header(&mut file, &Header { interval: 102_400, ..Header::default() });
        let tick = Event::Tick(Tick { size: 64, weight: 102_400, ..Tick::default() });
        let events = [tick.clone(), Event::End { time_ns: 1 }];
        let tick_at = file.len();
        for e in &events {
            write_event(&mut file, e);
        }
        let mut reader = Reader::new(&file).unwrap();
        assert_eq!(
            (reader.by_ref().map(Result::unwrap).collect::<Vec<_>>(), reader.skipped()),
            (events.to_vec(), (0, None))
        );
        file[tick_at] |= 0x80;
        let mut reader = Reader::new(&file).unwrap();
        let read = reader.by_ref().map(Result::unwrap).collect::<Vec<_>>();
        assert_eq!((read, reader.skipped()), (events[1..].to_vec(), (1, Some(tick_at as u64))));
    }

    #[test]
    fn long_payloads_get_wide_length_prefixes() {
        let frames: Vec<u64> = (0..100).map(|i| 0x7f00_0000_0000 + i * 0x1_0000).collect();
        let mut file = Vec::new();
        write_header(&mut file, &Header::default());
        write_event(&mut file, &Event::Stack { id: 9, frames: frames.clone() });
        let read: Vec<Event> = Reader::new(&file).unwrap().map(Result::unwrap).collect();
        assert_eq!(read, [Event::Stack { id: 9, frames }]);
    }
}
