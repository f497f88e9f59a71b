//! Synthetic traces for the report's tests, over real code: the frames are addresses of
//! functions in this test binary, and its module record comes from the process's own map
//! (`/proc/self/maps`), so symbolization runs against real DWARF.

use mallocspy::trace::{Event, Header, HeapStats, Kind, KindStats, Module, Sampling, Tick, write_event, write_header};

/// The line of `site_one`'s `fn`, where its entry's line information points.
pub const SITE_ONE_LINE: u32 = line!() + 3;
/// The first allocation site.
#[inline(never)]
pub fn site_one(n: u64) -> u64 {
    // Plain operators: a call inlined at the entry (`black_box`, `wrapping_mul`) would be the
    // innermost frame there.
    n ^ 0x1111
}

/// The second allocation site.
#[inline(never)]
pub fn site_two(n: u64) -> u64 {
    n ^ 0x2222
}

/// The caller of both.
#[inline(never)]
pub fn outer_caller(n: u64) -> u64 {
    site_one(n) ^ site_two(n)
}

/// A return address inside `f`: the byte after its first, so that the call's byte (one
/// earlier) is the function's entry.
pub fn return_address_in(f: fn(u64) -> u64) -> u64 {
    f as usize as u64 + 1
}

/// This executable as the trace's module 0: path, load bias, executable ranges.
pub fn this_executable() -> Module {
    mallocspy::trace::this_executable().expect("the test binary is in its own map")
}

pub fn header() -> Header {
    Header {
        pid: 4242,
        command: vec!["./sites".into(), "--fast".into()],
        options: "spy=ticks".into(),
        sampling: Sampling::Poisson,
        interval: 1024,
        stats_interval_ms: 100,
        start_unix_ns: 1_764_000_000_000_000_000,
        ..Header::default()
    }
}

pub fn tick(time_ns: u64, address: u64, size: u64, weight: u64, stack: u64) -> Event {
    Event::Tick(Tick { time_ns, thread: 0, kind: Kind::Small as u8, entry: 0, size, address, weight, stack })
}

pub fn stats(time_ns: u64, small: u64, large: u64) -> Event {
    let mut kinds = [KindStats::default(); 3];
    kinds[0].live_bytes = small;
    kinds[1].live_bytes = large;
    Event::HeapStats(HeapStats {
        time_ns,
        kinds,
        in_use_bytes: small + 4096,
        mmapped_bytes: large,
        ..HeapStats::default()
    })
}

/// The events of a small program:
/// - stack 1 (`site_one` called from `outer_caller`) allocates 3000 bytes in 3 samples of
///   100-byte blocks (weight 1000 each: 30 objects), frees the first, keeps two to the end;
/// - stack 2 (`site_two` called from `outer_caller`) allocates 2000 bytes in 1 sample of a
///   500-byte block (4 objects), freed before the end.
///
/// The live heap replayed: 1000, 3000, 2000, 3000 (not higher), 1000, 2000: the peak is 3000
/// bytes at 20 ns, with stack 1 holding 1000 bytes and stack 2 2000 then; at the end stack 1
/// holds 2000 and stack 2 nothing.
pub fn events(module: &Module) -> Vec<Event> {
    vec![
        Event::ModuleLoad { time_ns: 0, module: module.clone() },
        Event::ThreadStart { time_ns: 1, thread: 0, tid: 4242 },
        Event::Stack { id: 1, frames: vec![return_address_in(site_one), return_address_in(outer_caller)] },
        tick(10, 0xa000, 100, 1000, 1),
        Event::Stack { id: 2, frames: vec![return_address_in(site_two), return_address_in(outer_caller)] },
        tick(20, 0xb000, 500, 2000, 2),
        stats(25_000_000, 1000, 2000),
        Event::Free { time_ns: 30, thread: 0, address: 0xa000 },
        tick(40, 0xc000, 100, 1000, 1),
        Event::Free { time_ns: 50, thread: 0, address: 0xb000 },
        tick(60, 0xd000, 100, 1000, 1),
        stats(1_500_000_000, 2000, 0),
        Event::End { time_ns: 2_000_000_000 },
    ]
}

/// [`events`] as a trace file.
pub fn trace() -> Vec<u8> {
    let mut file = Vec::new();
    write_header(&mut file, &header());
    for e in events(&this_executable()) {
        write_event(&mut file, &e);
    }
    file
}
