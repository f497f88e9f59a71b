//! The pprof report: a gzipped `profile.proto` (github.com/google/pprof, `proto/profile.proto`)
//! for `go tool pprof`, with Go's heap-profile sample types, so its `-sample_index` names
//! (`alloc_space`, `inuse_space`, ...) work as they do on a Go heap profile.
//!
//! The messages are written out by hand with prost's derive (no protoc, no build script);
//! field numbers and types mirror the proto. Fields this report never sets (labels, the newer
//! breakdowns) are left out: decoders skip what they do not know, and leaving them out keeps
//! the structs to what is checked.

use std::collections::HashMap;
use std::io::{self, Write};

use flate2::Compression;
use flate2::write::GzEncoder;
use prost::Message;

use super::Report;
use super::profile::RawFrame;
use super::symbolize;
use super::text::command_line;
use super::units;

/// `Profile`: a set of samples over locations, functions and mappings.
#[derive(Clone, PartialEq, Message)]
pub struct Profile {
    /// What each value of a sample measures.
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    /// One per stack.
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    /// The modules.
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    /// The return addresses.
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    /// The functions the locations name.
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    /// Every string; index 0 is "".
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    /// Start of the trace, nanoseconds since the Unix epoch.
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    /// How long the program ran.
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    /// What the period counts.
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    /// The sampling interval.
    #[prost(int64, tag = "12")]
    pub period: i64,
    /// Free text (string table indices).
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    /// The sample type shown by default (string table index of its type).
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

/// `ValueType`: a measure and its unit (string table indices).
#[derive(Clone, PartialEq, Message)]
pub struct ValueType {
    /// e.g. `alloc_space`.
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    /// e.g. `bytes`.
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

/// `Sample`: values at a stack.
#[derive(Clone, PartialEq, Message)]
pub struct Sample {
    /// The stack, leaf first.
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    /// One value per sample type.
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
}

/// `Mapping`: a module's address range.
#[derive(Clone, PartialEq, Message)]
pub struct Mapping {
    /// Nonzero id.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// First run-time address.
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    /// Past the last run-time address.
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    /// Where `memory_start` is in the file.
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    /// The module's path (string table index).
    #[prost(int64, tag = "5")]
    pub filename: i64,
    /// Its build id in hex (string table index).
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    /// Its locations carry function names.
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    /// ... file names.
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    /// ... line numbers.
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    /// ... inlined calls.
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

/// `Location`: one address and the functions there.
#[derive(Clone, PartialEq, Message)]
pub struct Location {
    /// Nonzero id.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Its mapping (0: none).
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    /// The address.
    #[prost(uint64, tag = "3")]
    pub address: u64,
    /// Innermost inlined call first, the function the code is in last.
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
}

/// `Line`: a function and a line in it.
#[derive(Clone, PartialEq, Message)]
pub struct Line {
    /// Its function.
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    /// The line (0: unknown).
    #[prost(int64, tag = "2")]
    pub line: i64,
}

/// `Function`.
#[derive(Clone, PartialEq, Message)]
pub struct Function {
    /// Nonzero id.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Readable name (string table index).
    #[prost(int64, tag = "2")]
    pub name: i64,
    /// Name as the system knows it (string table index).
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    /// Its source file (string table index).
    #[prost(int64, tag = "4")]
    pub filename: i64,
}

/// The sample types, in value order: Go's heap profile's, so that `-sample_index` works alike.
pub const SAMPLE_TYPES: [(&str, &str); 4] =
    [("alloc_objects", "count"), ("alloc_space", "bytes"), ("inuse_objects", "count"), ("inuse_space", "bytes")];

/// The string table under construction.
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Strings::default();
        s.get("");
        s
    }

    fn get(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_owned());
        self.index.insert(s.to_owned(), i);
        i
    }
}

fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The location, made once per name, of no code but a name the reports give: the blocks a
/// forked child inherited, the root of a stack cut at the recorded depth, a stack whose frames
/// were never recorded (without it, its samples counted in the total under no function).
fn named_location(
    name: &str,
    named: &mut HashMap<String, u64>,
    strings: &mut Strings,
    functions: &mut Vec<Function>,
    locations: &mut Vec<Location>,
) -> u64 {
    *named.entry(name.to_owned()).or_insert_with(|| {
        let name = strings.get(name);
        let function_id = functions.len() as u64 + 1;
        functions.push(Function { id: function_id, name, system_name: name, filename: 0 });
        let id = locations.len() as u64 + 1;
        locations.push(Location { id, mapping_id: 0, address: 0, line: vec![Line { function_id, line: 0 }] });
        id
    })
}

/// The profile message of a report.
pub fn profile(report: &Report<'_>) -> Profile {
    let p = report.profile;
    let mut strings = Strings::new();
    let sample_type: Vec<ValueType> =
        SAMPLE_TYPES.iter().map(|(t, u)| ValueType { r#type: strings.get(t), unit: strings.get(u) }).collect();

    // Per module: has_functions, has_filenames, has_line_numbers, has_inline_frames.
    let mut resolution = vec![[false; 4]; p.modules.len()];
    let mut functions: Vec<Function> = Vec::new();
    let mut function_ids: HashMap<(&str, Option<&str>), u64> = HashMap::new();
    let mut locations: Vec<Location> = Vec::new();
    let mut location_ids: HashMap<RawFrame, u64> = HashMap::new();
    let mut samples = Vec::new();
    // A forked child's inherited blocks: live, allocated in the parent (whose trace has their
    // stacks), under one location named as the text report's site.
    let inherited = p.inherited.filter(|i| i.at_fork.samples > 0);
    // Locations of no code, each made once (see `named_location`).
    let mut named: HashMap<String, u64> = HashMap::new();
    for (index, stack) in p.stacks.iter().enumerate() {
        if let Some(i) = inherited.filter(|i| i.stack == index) {
            let label = super::sites::inherited_label(i.parent);
            let id = named_location(&label, &mut named, &mut strings, &mut functions, &mut locations);
            samples.push(Sample {
                location_id: vec![id],
                value: vec![0, 0, signed(units::rounded(stack.live_at_end.objects)), signed(stack.live_at_end.bytes)],
            });
            continue;
        }
        if stack.allocated.samples == 0 {
            continue;
        }
        let mut location_id = Vec::with_capacity(stack.frames.len());
        for &raw in &stack.frames {
            let next_id = locations.len() as u64 + 1;
            let id = *location_ids.entry(raw).or_insert(next_id);
            location_id.push(id);
            if id != next_id {
                continue;
            }
            let resolved = report.symbols.location(raw);
            let mut line = Vec::new();
            // Unresolved addresses get no lines: pprof then shows the address, and may
            // symbolize it itself where it finds the binary (its mapping says it has no functions).
            if resolved.symbolized {
                for f in &resolved.frames {
                    let key = (f.function.as_str(), f.file.as_deref());
                    let next_function = functions.len() as u64 + 1;
                    let function_id = *function_ids.entry(key).or_insert(next_function);
                    if function_id == next_function {
                        let name = strings.get(&f.function);
                        let filename = f.file.as_deref().map_or(0, |file| strings.get(file));
                        functions.push(Function { id: function_id, name, system_name: name, filename });
                    }
                    line.push(Line { function_id, line: f.line.map_or(0, i64::from) });
                }
                if let Some(m) = resolved.module {
                    let r = &mut resolution[m];
                    r[0] = true;
                    r[1] |= resolved.frames.iter().any(|f| f.file.is_some());
                    r[2] |= resolved.frames.iter().any(|f| f.line.is_some());
                    r[3] |= resolved.frames.len() > 1;
                }
            }
            locations.push(Location {
                id,
                mapping_id: resolved.module.map_or(0, |m| m as u64 + 1),
                // The call instruction, not the return address after it: what a symbolizer must
                // look up (the profile's lines were found for it too).
                address: raw.address.saturating_sub(1),
                line,
            });
        }
        if location_id.is_empty() {
            let name = super::profile::NOT_RECORDED;
            location_id.push(named_location(name, &mut named, &mut strings, &mut functions, &mut locations));
        } else if p.is_cut(stack) {
            let name = super::profile::CUT;
            location_id.push(named_location(name, &mut named, &mut strings, &mut functions, &mut locations));
        }
        samples.push(Sample {
            location_id,
            value: vec![
                signed(units::rounded(stack.allocated.objects)),
                signed(stack.allocated.bytes),
                signed(units::rounded(stack.live_at_end.objects)),
                signed(stack.live_at_end.bytes),
            ],
        });
    }

    let mut file_offsets = symbolize::FileOffsets::new(p.header.start_unix_ns);
    let mapping = p
        .modules
        .iter()
        .zip(&resolution)
        .enumerate()
        .map(|(i, (m, r))| {
            let start = m.ranges.iter().map(|r| r.0).min().unwrap_or(m.base);
            let limit = m.ranges.iter().map(|r| r.1).max().unwrap_or(start);
            let build_id: String = m.build_id.iter().map(|b| format!("{b:02x}")).collect();
            Mapping {
                id: i as u64 + 1,
                memory_start: start,
                memory_limit: limit,
                file_offset: file_offsets.of(m, start),
                filename: strings.get(&m.path),
                build_id: strings.get(&build_id),
                has_functions: r[0],
                has_filenames: r[1],
                has_line_numbers: r[2],
                has_inline_frames: r[3],
            }
        })
        .collect();

    let h = &p.header;
    let comment = vec![
        strings.get(&format!("mallocspy: {} (pid {})", command_line(&h.command), h.pid)),
        strings.get("estimates from sampled allocations; inuse = live when the trace ends"),
    ];
    let period_type = Some(ValueType { r#type: strings.get("space"), unit: strings.get("bytes") });
    let default_sample_type = strings.get("alloc_space");
    Profile {
        sample_type,
        sample: samples,
        mapping,
        location: locations,
        function: functions,
        time_nanos: signed(h.start_unix_ns),
        duration_nanos: signed(p.duration_ns()),
        period_type,
        period: signed(h.interval),
        comment,
        default_sample_type,
        string_table: strings.table,
    }
}

/// Writes the gzipped profile.
pub fn write(report: &Report<'_>, out: &mut dyn Write) -> io::Result<()> {
    let mut gz = GzEncoder::new(out, Compression::default());
    gz.write_all(&profile(report).encode_to_vec())?;
    gz.finish()?;
    Ok(())
}
