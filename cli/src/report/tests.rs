//! Every format of the report of one synthetic trace over this binary's own code
//! ([`super::testing`]), checked against the figures worked out there by hand.

use std::any::type_name_of_val;
use std::io::Read;
use std::path::Path;

use mallocspy::trace::{Event, HeapStats, Module, write_event, write_header};
use prost::Message;

use super::profile::{self, Profile};
use super::progress::Progress;
use super::symbolize::Symbols;
use super::testing::{self, SITE_ONE_LINE, outer_caller, return_address_in, site_one, site_two};
use super::{Format, Report, pprof};

fn load(file: &[u8]) -> (Profile, Symbols) {
    let mut progress = Progress::hidden();
    let profile = profile::read(file, &mut progress).expect("a valid trace");
    let symbols = Symbols::resolve(&profile, &mut progress);
    (profile, symbols)
}

fn render(file: &[u8], format: Format) -> Vec<u8> {
    let (profile, symbols) = load(file);
    Report::new(Path::new("sites.trace"), &profile, &symbols, 20).render(format).expect("renders")
}

fn text(file: &[u8], format: Format) -> String {
    String::from_utf8(render(file, format)).expect("UTF-8")
}

/// The two table rows (after the header row) of the table under `title`.
fn table_rows<'a>(report: &'a str, title: &str) -> Vec<&'a str> {
    let start = report.find(title).unwrap_or_else(|| panic!("no {title:?} in\n{report}"));
    report[start..].lines().skip(2).take_while(|l| !l.is_empty()).collect()
}

#[test]
fn frames_resolve_to_this_binarys_functions_and_lines() {
    let (profile, symbols) = load(&testing::trace());
    let location = symbols.location(profile.stacks[0].frames[0]);
    assert!(location.symbolized);
    let frame = location.frames.last().unwrap();
    assert_eq!(frame.function, type_name_of_val(&site_one));
    assert!(frame.file.as_deref().is_some_and(|f| f.ends_with("report/testing.rs")), "{frame:?}");
    let line = frame.line.expect("a line");
    assert!((SITE_ONE_LINE..=SITE_ONE_LINE + 1).contains(&line), "line {line}, fn at {SITE_ONE_LINE}");
    let caller = symbols.location(profile.stacks[0].frames[1]);
    assert_eq!(caller.frames.last().unwrap().function, type_name_of_val(&outer_caller));
}

#[test]
fn the_text_report_ranks_sites_by_bytes_allocated_live_at_peak_and_left_at_end() {
    let report = text(&testing::trace(), Format::Text);
    assert!(report.contains("  program      ./sites --fast\n"), "{report}");
    assert!(report.contains("  pid          4242\n"), "{report}");
    assert!(report.contains("  duration     2.00 s\n"), "{report}");
    assert!(report.contains("poisson, one sample per 1.00 KiB allocated on average"), "{report}");
    assert!(report.contains("  allocated    4.88 KiB in 34 objects (estimated)\n"), "{report}");
    // Four samples: the estimates are worth little, and the report says so.
    assert!(
        report.contains(
            "  allocated    4.88 KiB in 34 objects (estimated)\n               from 4 samples: good to about ±50%"
        ),
        "{report}"
    );
    assert!(report.contains("  peak live    2.93 KiB at 20 ns"), "{report}");
    let one = type_name_of_val(&site_one);
    let two = type_name_of_val(&site_two);

    let allocated = table_rows(&report, "Top allocation sites by estimated bytes allocated");
    assert_eq!(allocated.len(), 2, "{report}");
    let row: Vec<&str> = allocated[0].split_whitespace().collect();
    assert_eq!(row[..6], ["1", "2.93", "KiB", "60.0%", "30", "3"], "{report}");
    assert_eq!(row[6], one);
    assert!(row[7].starts_with('(') && row[7].contains("report/testing.rs:"), "{report}");
    let row: Vec<&str> = allocated[1].split_whitespace().collect();
    assert_eq!(row[..7], ["2", "1.95", "KiB", "40.0%", "4", "1", two], "{report}");

    let live = table_rows(&report, "Top allocation sites by live bytes at peak (2.93 KiB at 20 ns)");
    assert_eq!(live.len(), 2, "{report}");
    let row: Vec<&str> = live[0].split_whitespace().collect();
    assert_eq!(row[..7], ["1", "1.95", "KiB", "66.7%", "4", "1", two], "{report}");
    let row: Vec<&str> = live[1].split_whitespace().collect();
    assert_eq!(row[..7], ["2", "1000", "B", "33.3%", "10", "1", one], "{report}");

    // What was left at the end: stack 1's two samples alone.
    let left = table_rows(&report, "Top allocation sites by live bytes at end (1.95 KiB)");
    assert_eq!(left.len(), 1, "{report}");
    let row: Vec<&str> = left[0].split_whitespace().collect();
    assert_eq!(row[..7], ["1", "1.95", "KiB", "100.0%", "20", "2", one], "{report}");
}

#[test]
fn json_carries_the_figures_and_full_stacks() {
    let json: serde_json::Value = serde_json::from_slice(&render(&testing::trace(), Format::Json)).unwrap();
    assert_eq!(json["pid"], 4242);
    assert_eq!(json["complete"], true);
    assert_eq!(json["ticks"], 4);
    assert_eq!(json["allocated"]["bytes"], 5000);
    assert_eq!(json["peak"], serde_json::json!({"live_bytes": 3000, "time_ns": 20}));
    assert_eq!(json["live_at_end"]["bytes"], 2000);
    assert_eq!(json["top_by_live_at_end"].as_array().map(Vec::len), Some(1));
    assert_eq!(json["top_by_live_at_end"][0]["function"], type_name_of_val(&site_one));
    assert_eq!(json["top_by_live_at_end"][0]["live_at_end"]["bytes"], 2000);
    let first = &json["top_by_bytes_allocated"][0];
    assert_eq!(first["function"], type_name_of_val(&site_one));
    assert_eq!(first["allocated"], serde_json::json!({"bytes": 3000, "objects": 30.0, "samples": 3}));
    assert_eq!(first["live_at_peak"], serde_json::json!({"bytes": 1000, "objects": 10.0, "samples": 1}));
    assert_eq!(first["live_at_end"]["bytes"], 2000);
    let frames = first["stacks"][0]["frames"].as_array().unwrap();
    let names: Vec<&str> =
        frames.iter().filter(|f| f["inlined"] == false).map(|f| f["function"].as_str().unwrap()).collect();
    assert_eq!(names, [type_name_of_val(&site_one), type_name_of_val(&outer_caller)]);
    assert_eq!(frames[0]["address"], format!("{:#x}", return_address_in(site_one)));
    let live = &json["top_by_live_at_peak"][0];
    assert_eq!(live["function"], type_name_of_val(&site_two));
    assert_eq!(live["live_at_peak"], serde_json::json!({"bytes": 2000, "objects": 4.0, "samples": 1}));
    assert_eq!(live["live_at_end"]["bytes"], 0);
}

/// Stacks whose frames read the same are one in a site's list: a plugin reloaded where it was
/// gives its stacks new ids in each load, and a site listed each of them (18,417 alike: 852 MB
/// of JSON).
#[test]
fn json_lists_stacks_that_read_the_same_once() {
    let mut events = testing::events(&testing::this_executable());
    let end = events.pop().unwrap();
    let frames = vec![return_address_in(site_one), return_address_in(outer_caller)];
    events.extend([Event::Stack { id: 3, frames }, testing::tick(70, 0xe000, 100, 1000, 3), end]);
    let json: serde_json::Value = serde_json::from_slice(&render(&trace_of(&events), Format::Json)).unwrap();
    let first = &json["top_by_bytes_allocated"][0];
    assert_eq!(first["function"], type_name_of_val(&site_one));
    let stacks = first["stacks"].as_array().unwrap();
    assert_eq!(stacks.len(), 1, "{stacks:?}");
    assert_eq!((stacks[0]["id"].as_u64(), stacks[0]["traced_stacks"].as_u64()), (Some(1), Some(2)));
    assert_eq!(stacks[0]["allocated"], serde_json::json!({"bytes": 4000, "objects": 40.0, "samples": 4}));
    assert_eq!(stacks[0]["live_at_end"], first["live_at_end"]);
}

/// A site that many stacks reach lists the hundred that allocated most, and says how many
/// more it has: it listed every one (223 MB of JSON from a trace of 3 MB).
#[test]
fn json_lists_at_most_a_hundred_stacks_a_site() {
    let mut events = testing::events(&testing::this_executable());
    let end = events.pop().unwrap();
    // 150 more callers of site_one, told apart by the return address in the caller.
    for n in 0..150u64 {
        let frames = vec![return_address_in(site_one), return_address_in(outer_caller) + 1 + n];
        events.push(Event::Stack { id: 100 + n, frames });
        events.push(testing::tick(80 + n, 0x10_0000 + n * 0x100, 100, 1000 + n, 100 + n));
    }
    events.push(end);
    let json: serde_json::Value = serde_json::from_slice(&render(&trace_of(&events), Format::Json)).unwrap();
    let first = &json["top_by_bytes_allocated"][0];
    assert_eq!(first["function"], type_name_of_val(&site_one));
    let stacks = first["stacks"].as_array().unwrap();
    assert_eq!((stacks.len(), first["stacks_not_listed"].as_u64()), (100, Some(51)));
    // Most bytes first: the stack of testing::events, then 1149, 1148, ... 1051 bytes.
    let bytes: Vec<u64> = stacks.iter().map(|s| s["allocated"]["bytes"].as_u64().unwrap()).collect();
    assert_eq!((bytes[0], bytes[1], bytes[99]), (3000, 1149, 1051));
}

/// mallocspy's own memory, which every heap statistics event carries, is in the report.
#[test]
fn the_report_says_mallocspys_own_memory() {
    let stats = |time_ns, own_bytes| Event::HeapStats(HeapStats { time_ns, own_bytes, ..HeapStats::default() });
    let file = trace_of(&[stats(5, 3 << 20), stats(9, 2 << 20), stats(7, 5 << 20)]);
    let report = text(&file, Format::Text);
    assert!(report.contains("\n  mallocspy    2.00 MiB of its own memory at the end, 5.00 MiB at most\n"), "{report}");
    let json: serde_json::Value = serde_json::from_str(&text(&file, Format::Json)).unwrap();
    assert_eq!(json["own_memory"], serde_json::json!({"at_end": 2 << 20, "most": 5 << 20}));
    let without: serde_json::Value = serde_json::from_str(&text(&trace_of(&[]), Format::Json)).unwrap();
    assert_eq!(without["own_memory"], serde_json::Value::Null);
}

#[test]
fn folded_lines_go_root_first_with_bytes_allocated() {
    let folded = text(&testing::trace(), Format::Folded);
    let outer = type_name_of_val(&outer_caller);
    let expected =
        format!("{outer};{} 3000\n{outer};{} 2000\n", type_name_of_val(&site_one), type_name_of_val(&site_two));
    assert_eq!(folded, expected);
}

#[test]
fn pprof_decodes_back_with_the_four_sample_types_and_the_estimates() {
    let gz = render(&testing::trace(), Format::Pprof);
    assert_eq!(gz[..2], [0x1f, 0x8b], "gzip");
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut raw).unwrap();
    let p = pprof::Profile::decode(&raw[..]).expect("a profile message");
    let s = |i: i64| p.string_table[i as usize].as_str();
    assert_eq!(s(0), "");
    let types: Vec<(&str, &str)> = p.sample_type.iter().map(|t| (s(t.r#type), s(t.unit))).collect();
    assert_eq!(types, pprof::SAMPLE_TYPES);
    let period_type = p.period_type.as_ref().unwrap();
    assert_eq!((s(period_type.r#type), s(period_type.unit)), ("space", "bytes"));
    assert_eq!(p.period, 1024);
    assert_eq!(p.time_nanos, 1_764_000_000_000_000_000);
    assert_eq!(p.duration_nanos, 2_000_000_000);
    assert_eq!(s(p.default_sample_type), "alloc_space");

    let exe = testing::this_executable();
    assert_eq!(p.mapping.len(), 1);
    assert_eq!(s(p.mapping[0].filename), exe.path);
    assert!(p.mapping[0].has_functions && p.mapping[0].has_line_numbers);
    assert_eq!(p.mapping[0].memory_start, exe.ranges.iter().map(|r| r.0).min().unwrap());

    // Each sample's leaf function, and its values.
    let leaf = |sample: &pprof::Sample| {
        let location = p.location.iter().find(|l| l.id == sample.location_id[0]).unwrap();
        assert_eq!(location.mapping_id, p.mapping[0].id);
        let line = location.line.last().unwrap();
        let function = p.function.iter().find(|f| f.id == line.function_id).unwrap();
        assert!(s(function.filename).ends_with("report/testing.rs"));
        s(function.name).to_owned()
    };
    let mut samples: Vec<(String, Vec<i64>)> = p.sample.iter().map(|x| (leaf(x), x.value.clone())).collect();
    samples.sort();
    let mut expected = vec![
        (type_name_of_val(&site_one).to_owned(), vec![30, 3000, 20, 2000]),
        (type_name_of_val(&site_two).to_owned(), vec![4, 2000, 0, 0]),
    ];
    expected.sort();
    assert_eq!(samples, expected);
    assert!(p.sample.iter().all(|x| x.location_id.len() == 2));
}

/// A forked child's inherited blocks are in the profile's `inuse_*` values (live at the end),
/// under a location named as the text report's site, with nothing allocated: the in-use total
/// left them out and fell short of the text report's "live at end".
#[test]
fn pprof_counts_the_inherited_blocks_in_use() {
    let mut file = Vec::new();
    write_header(&mut file, &testing::header());
    let mut events = testing::events(&testing::this_executable());
    let end = events.pop().unwrap();
    events.insert(1, Event::Inherited { parent: 77, kind: 0, size: 100, address: 0xe000, weight: 5000 });
    events.push(end);
    for e in &events {
        write_event(&mut file, e);
    }
    let gz = render(&file, Format::Pprof);
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut raw).unwrap();
    let p = pprof::Profile::decode(&raw[..]).unwrap();
    let s = |i: i64| p.string_table[i as usize].as_str();
    let inherited: Vec<&pprof::Sample> = p
        .sample
        .iter()
        .filter(|x| {
            let location = p.location.iter().find(|l| l.id == x.location_id[0]).unwrap();
            let function = p.function.iter().find(|f| f.id == location.line[0].function_id).unwrap();
            s(function.name) == "[inherited from pid 77 at fork]"
        })
        .collect();
    assert_eq!(inherited.len(), 1);
    assert_eq!(inherited[0].value, [0, 0, 50, 5000]);
    let in_use: i64 = p.sample.iter().map(|x| x.value[3]).sum();
    assert_eq!(in_use, 2000 + 5000);
}

/// A stack cut at the recorded depth (`stack_depth=2` here) is shown under a root that says
/// so, and a tick whose stack the trace lacks under a name: in the folded stacks and pprof, a
/// cut stack's outermost recorded frame was a root of its own, and in pprof the tick counted
/// in the total under no function (review helper 75). JSON marks the cut stacks. The depth is
/// read from the options an earlier version wrote, whose `trace` path this one would refuse.
#[test]
fn cut_and_unrecorded_stacks_are_named_in_every_tree() {
    let options = "spy=ticks:trace=/tmp/t.%t: stack_depth = 2".into();
    let header = mallocspy::trace::Header { options, ..testing::header() };
    let events = [
        Event::ModuleLoad { time_ns: 0, module: testing::this_executable() },
        Event::Stack { id: 1, frames: vec![return_address_in(site_one), return_address_in(outer_caller)] },
        Event::Stack { id: 2, frames: vec![return_address_in(site_two)] },
        testing::tick(1, 0xa0, 10, 500, 1),
        testing::tick(2, 0xb0, 10, 400, 2),
        testing::tick(3, 0xc0, 10, 300, 9),
    ];
    let file = trace_with(&header, &events);
    let folded = text(&file, Format::Folded);
    let lines: Vec<&str> = folded.lines().collect();
    let cut = format!("{};", profile::CUT);
    assert_eq!(lines.iter().filter(|l| l.starts_with(&cut)).count(), 1, "{folded}");
    assert!(lines.iter().any(|l| l.starts_with(&cut) && l.ends_with(" 500")), "{folded}");
    assert!(lines.iter().any(|l| l.starts_with(type_name_of_val(&site_two)) && l.ends_with(" 400")), "{folded}");
    assert!(lines.contains(&"[stack not recorded] 300"), "{folded}");

    let json: serde_json::Value = serde_json::from_str(&text(&file, Format::Json)).unwrap();
    let truncated: Vec<(u64, bool)> = json["top_by_bytes_allocated"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|site| site["stacks"].as_array().unwrap().iter())
        .map(|stack| (stack["id"].as_u64().unwrap(), stack["truncated"].as_bool().unwrap()))
        .collect();
    assert!(truncated.contains(&(1, true)) && truncated.contains(&(2, false)), "{truncated:?}");

    let gz = render(&file, Format::Pprof);
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut raw).unwrap();
    let p = pprof::Profile::decode(&raw[..]).unwrap();
    let name_of = |location_id: u64| {
        let location = p.location.iter().find(|l| l.id == location_id).unwrap();
        let function = p.function.iter().find(|f| f.id == location.line[0].function_id).unwrap();
        p.string_table[function.name as usize].as_str()
    };
    let roots: Vec<(&str, i64)> =
        p.sample.iter().map(|x| (name_of(*x.location_id.last().unwrap()), x.value[1])).collect();
    assert!(roots.contains(&(profile::CUT, 500)), "{roots:?}");
    assert!(roots.contains(&(type_name_of_val(&site_two), 400)), "{roots:?}");
    assert!(roots.contains(&(profile::NOT_RECORDED, 300)), "{roots:?}");
}

#[test]
fn the_flame_graph_is_an_svg_of_bytes_allocated() {
    let svg = text(&testing::trace(), Format::Flamegraph);
    assert!(svg.starts_with("<?xml"), "{}", &svg[..100]);
    assert!(svg.contains("<svg"));
    assert!(svg.contains("./sites --fast: estimated bytes allocated"));
    assert!(svg.contains(&format!("{} (3,000 bytes, 60.00%)", type_name_of_val(&site_one))));
    assert!(svg.trim_end().ends_with("</svg>"));
}

#[test]
fn the_timeline_charts_the_live_heap_and_marks_its_peak() {
    let svg = text(&testing::trace(), Format::Timeline);
    assert!(svg.starts_with("<?xml"), "{svg}");
    assert!(svg.contains("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    // The report's peak: 3000 live bytes at 20 ns, which the heap statistics see at 25 ms
    // (then 2000 at 1.5 s).
    assert!(svg.contains(">peak 2.93 KiB at 20 ns</text>"), "{svg}");
    assert!(svg.contains(">time (s)</text>") && svg.contains(">2 KiB</text>"), "{svg}");
    assert_eq!(svg.matches("<path ").count(), 2, "one area per kind with live bytes: small and large");
    assert!(svg.contains(">small (estimated)</text>") && !svg.contains(">aligned (estimated)</text>"), "{svg}");
    assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    assert!(svg.trim_end().ends_with("</svg>"));
}

/// With events lost, the replay keeps samples whose frees were lost live for good: the report
/// said the estimates were low while its peak was 141 MiB of a heap whose own estimates
/// never passed 83 MiB (review helper 40). It now says live figures may be high and gives the
/// program's own, and the timeline draws those alone. Their peak is the events' own
/// `peak_live_bytes`: the highest live bytes of an event missed a peak between two events
/// (review helper 67: 37.1 MiB of a program whose estimates peaked at 40.4 MiB).
#[test]
fn with_events_lost_the_live_heap_comes_from_the_programs_own_estimates() {
    let mut events = testing::events(&testing::this_executable());
    // The free of 0xb000 (2000 bytes) is lost: the replay keeps it live to the end, and its
    // peak, 4000 bytes at 60 ns, is higher than any estimate of the program's.
    events.retain(|e| !matches!(e, Event::Free { address: 0xb000, .. }));
    // The program's estimate peaked at 3000 bytes, but had fallen to 1000 by the first event.
    for e in &mut events {
        if let Event::HeapStats(s) = e {
            s.peak_live_bytes = 3000;
            if s.time_ns == 25_000_000 {
                s.kinds[1].live_bytes = 0;
            }
        }
    }
    let at = events.iter().position(|e| matches!(e, Event::HeapStats(s) if s.time_ns == 1_500_000_000)).unwrap();
    events.insert(at, Event::Lost { time_ns: 70, events: 1 });
    let file = trace_of(&events);
    let report = text(&file, Format::Text);
    assert!(report.contains("those of live bytes may be high (frees among the lost)"), "{report}");
    assert!(
        report.contains(
            "the program's own live estimates, at its heap statistics: peak 2.93 KiB by 25.0 ms, 1.95 KiB at the last"
        ),
        "{report}"
    );
    let json: serde_json::Value = serde_json::from_str(&text(&file, Format::Json)).unwrap();
    assert_eq!(
        json["program_estimates"],
        serde_json::json!({"peak_live_bytes": 3000, "peak_by_ns": 25_000_000, "live_bytes_at_last": 2000})
    );
    let svg = text(&file, Format::Timeline);
    assert!(svg.contains(">peak 2.93 KiB by 25.0 ms</text>"), "{svg}");
}

/// With events lost, a stretch without heap statistics in which the writer said it dropped
/// some is hatched as unknown: the chart joined across it, or began late as if the program had
/// had no heap before (review helper 110: a run's first 0.7 s left blank). A stretch as long
/// without a loss in it (a program that stopped allocating) is drawn as before.
#[test]
fn a_stretch_of_the_timeline_whose_events_were_lost_is_drawn_as_unknown() {
    let whole = testing::events(&testing::this_executable());
    let plain = text(&trace_of(&whole), Format::Timeline);
    assert!(!plain.contains("class=\"lost\"") && !plain.contains("events lost"), "{plain}");
    let mut events = whole;
    let at = events.iter().position(|e| matches!(e, Event::HeapStats(s) if s.time_ns == 1_500_000_000)).unwrap();
    events.insert(at, Event::Lost { time_ns: 1_000_000_000, events: 5 });
    let svg = text(&trace_of(&events), Format::Timeline);
    assert_eq!(svg.matches("<rect class=\"lost\"").count(), 1, "{svg}");
    assert!(svg.contains("<title>events lost: the heap from 25.0 ms to 1.50 s is unknown</title>"), "{svg}");
    assert!(svg.contains(">events lost</text>"), "{svg}");
    // Lost before the first statistics: from the start.
    let mut events = testing::events(&testing::this_executable());
    let first = events.iter().position(|e| matches!(e, Event::HeapStats(_))).unwrap();
    events.insert(first, Event::Lost { time_ns: 20, events: 1 });
    events.retain(|e| !matches!(e, Event::HeapStats(s) if s.time_ns == 25_000_000));
    let svg = text(&trace_of(&events), Format::Timeline);
    assert!(svg.contains("<title>events lost: the heap from the start to 1.50 s is unknown</title>"), "{svg}");
    // Stamped after an event that followed the drops (the writer drained it first): the gap
    // before that event, within two intervals of the stamp, is the unknown one.
    let mut events = testing::events(&testing::this_executable());
    let end = events.iter().position(|e| matches!(e, Event::End { .. })).unwrap();
    events.insert(end, Event::Lost { time_ns: 1_550_000_000, events: 1 });
    let svg = text(&trace_of(&events), Format::Timeline);
    assert_eq!(svg.matches("<rect class=\"lost\"").count(), 2, "{svg}");
    assert!(svg.contains("<title>events lost: the heap from 25.0 ms to 1.50 s is unknown</title>"), "{svg}");
    assert!(svg.contains("<title>events lost: the heap from 1.50 s to 2.00 s is unknown</title>"), "{svg}");
}

/// A trace without an end (the program was killed): its last statistics are exact as of
/// their time only, not the program's totals (review helper 40: "counted 401 calls (exact)" of a
/// program that made 501).
#[test]
fn the_exact_totals_of_a_trace_without_an_end_say_when_they_were_taken() {
    let mut events = testing::events(&testing::this_executable());
    events.retain(|e| !matches!(e, Event::End { .. }));
    let report = text(&trace_of(&events), Format::Text);
    assert!(report.contains("allocation calls (exact at 1.50 s, its last heap statistics)\n"), "{report}");
    let whole = text(&testing::trace(), Format::Text);
    assert!(whole.contains("allocation calls (exact)\n"), "{whole}");
}

/// Heap statistics whose allocator view is all zero (another allocator served the calls)
/// draw no allocator line: a flat line at zero said the allocator held nothing.
#[test]
fn a_timeline_without_the_allocators_view_draws_no_allocator_line() {
    let with_view = text(&testing::trace(), Format::Timeline);
    assert!(
        with_view.contains("allocator: in use + mmapped") && with_view.contains(r#"class="allocator""#),
        "{with_view}"
    );
    let events: Vec<Event> = testing::events(&testing::this_executable())
        .into_iter()
        .map(|e| match e {
            Event::HeapStats(s) => {
                Event::HeapStats(HeapStats { arena_bytes: 0, mmapped_bytes: 0, free_bytes: 0, in_use_bytes: 0, ..s })
            }
            e => e,
        })
        .collect();
    let svg = text(&trace_of(&events), Format::Timeline);
    assert!(svg.contains(">peak 2.93 KiB at 20 ns</text>"), "{svg}");
    assert!(!svg.contains("allocator") && !svg.contains("<polyline"), "{svg}");
}

/// The allocator's line joins the heap statistics that came at their interval only; one alone
/// is a dot (review helper 57: a line of one point showed nothing, and one across a quiet half
/// second drew a steady growth no event saw).
#[test]
fn the_allocators_line_joins_only_statistics_at_their_interval() {
    let mut events = testing::events(&testing::this_executable());
    // Statistics at 25 ms (in the events), 100 ms and 200 ms, then 1.5 s; every 100 ms.
    let at = events.iter().position(|e| matches!(e, Event::HeapStats(s) if s.time_ns == 1_500_000_000)).unwrap();
    events.splice(at..at, [testing::stats(100_000_000, 2000, 0), testing::stats(200_000_000, 3000, 0)]);
    let svg = text(&trace_of(&events), Format::Timeline);
    let marks: Vec<&str> = svg.lines().filter(|l| l.contains(r#"class="allocator""#)).collect();
    assert_eq!(marks.len(), 2, "{marks:#?}");
    let joined = marks[0].split_once("points=\"").unwrap().1.split_once('"').unwrap().0;
    assert!(marks[0].starts_with("<polyline") && joined.split(' ').count() == 3, "{}", marks[0]);
    assert!(marks[1].starts_with("<circle"), "{}", marks[1]);
}

/// The exact totals of the newest heap statistics are shown beside the estimate: in tick mode
/// 2000 threads that each ended before their first tick left no tick, and the report said
/// "allocated 0 B" of a program that allocated 95 MiB.
#[test]
fn the_exact_totals_of_the_heap_statistics_are_shown_beside_the_estimate() {
    let stats = |time_ns, allocs, bytes| {
        let mut kinds = [mallocspy::trace::KindStats::default(); 3];
        (kinds[0].allocs, kinds[0].bytes) = (allocs, bytes);
        Event::HeapStats(HeapStats { time_ns, kinds, ..HeapStats::default() })
    };
    // The newest event by time, not the last in the file: threads queue them out of order.
    let end = Event::End { time_ns: 10 };
    let file = trace_of(&[stats(5, 100, 1000), stats(9, 100_002, 100_004_384), stats(7, 90_000, 9_000_000), end]);
    let report = text(&file, Format::Text);
    assert!(report.contains("  allocated    0 B in 0 objects (estimated)\n"), "{report}");
    assert!(report.contains("  counted      95.4 MiB in 100,002 allocation calls (exact)\n"), "{report}");
    let json: serde_json::Value = serde_json::from_str(&text(&file, Format::Json)).unwrap();
    assert_eq!(json["counted"], serde_json::json!({"calls": 100_002, "bytes": 100_004_384}));
    let without: serde_json::Value = serde_json::from_str(&text(&trace_of(&[]), Format::Json)).unwrap();
    assert_eq!(without["counted"], serde_json::Value::Null);
    assert!(!report.contains("no allocation reached mallocspy"), "{report}");
    // Heap statistics that counted nothing: the program's malloc may not be ours to count.
    let report = text(&trace_of(&[stats(5, 0, 0), Event::End { time_ns: 6 }]), Format::Text);
    assert!(report.contains("  counted      0 B in 0 allocation calls (exact)\n               no allocation reached mallocspy: the process made none, or its malloc"), "{report}");
}

fn trace_of(events: &[Event]) -> Vec<u8> {
    trace_with(&testing::header(), events)
}

fn trace_with(header: &mallocspy::trace::Header, events: &[Event]) -> Vec<u8> {
    let mut file = Vec::new();
    write_header(&mut file, header);
    for e in events {
        write_event(&mut file, e);
    }
    file
}

/// Module 1, at 0x7f00_0000_0000, whose file is not on this machine.
fn missing_module(path: &str, build_id: &[u8]) -> Module {
    Module {
        id: 1,
        path: path.into(),
        base: 0x7f00_0000_0000,
        ranges: vec![(0x7f00_0000_1000, 0x7f00_0000_9000)],
        build_id: build_id.to_vec(),
    }
}

#[test]
fn formats_without_their_data_fail_with_one_line() {
    let events: Vec<Event> = testing::events(&testing::this_executable())
        .into_iter()
        .filter(|e| !matches!(e, Event::HeapStats(_) | Event::Tick(_) | Event::Free { .. }))
        .collect();
    let (profile, symbols) = load(&trace_of(&events));
    let report = Report::new(Path::new("t"), &profile, &symbols, 20);
    assert_eq!(
        report.render(Format::Timeline).unwrap_err(),
        "the trace has no heap statistics events or ticks to draw a timeline from"
    );
    let (profile, symbols) = load(&trace_of(&[]));
    let report = Report::new(Path::new("t"), &profile, &symbols, 20);
    assert!(report.render(Format::Flamegraph).unwrap_err().contains("no sampled allocations"));
    assert!(report.render(Format::Folded).unwrap_err().contains("no sampled allocations"));
    let text = String::from_utf8(report.render(Format::Text).unwrap()).unwrap();
    assert!(text.contains("Top allocation sites by estimated bytes allocated\n  (none)\n"), "{text}");
    assert!(text.contains("  counted      unknown: the trace has no heap statistics"), "{text}");
}

#[test]
fn sites_skip_the_c_runtime_and_missing_or_changed_files_give_module_offsets() {
    let libc = missing_module("/nonexistent/libc.so.6", &[1, 2, 3]);
    let mut rebuilt = testing::this_executable();
    rebuilt.id = 2;
    rebuilt.build_id = vec![0xde, 0xad, 0xbe, 0xef];
    let exe_name = rebuilt.path.rsplit('/').next().unwrap().to_owned();
    let events = [
        Event::ModuleLoad { time_ns: 0, module: testing::this_executable() },
        Event::ModuleLoad { time_ns: 0, module: libc },
        // A libc frame first: the site is the program's frame under it.
        Event::Stack {
            id: 1,
            frames: vec![0x7f00_0000_1235, return_address_in(site_one), return_address_in(outer_caller)],
        },
        testing::tick(1, 0xa0, 10, 500, 1),
        // Only libc: the allocator's caller names the site, by module and offset.
        Event::Stack { id: 2, frames: vec![0x7f00_0000_2001] },
        testing::tick(2, 0xb0, 10, 400, 2),
        Event::ModuleUnload { time_ns: 3, id: 0 },
        // The executable as another build: its file is not the one that ran.
        Event::ModuleLoad { time_ns: 3, module: rebuilt.clone() },
        Event::Stack { id: 3, frames: vec![return_address_in(site_two)] },
        testing::tick(4, 0xc0, 10, 300, 3),
    ];
    let (profile, symbols) = load(&trace_of(&events));
    let report = Report::new(Path::new("t"), &profile, &symbols, 20);
    let labels: Vec<String> = report.sites().into_iter().map(|s| s.label).collect();
    assert_eq!(labels.len(), 3, "{labels:?}");
    assert!(labels[0].starts_with(&format!("{} (", type_name_of_val(&site_one))), "{labels:?}");
    assert_eq!(labels[1], "libc.so.6+0x2001");
    let offset = return_address_in(site_two) - rebuilt.base;
    assert_eq!(labels[2], format!("{exe_name}+{offset:#x}"));
    // Both are said: the one that is gone, and the one rebuilt.
    let said: Vec<&str> = symbols.changed_files().iter().map(|(_, why)| *why).collect();
    assert_eq!(said, ["gone since the run (no such file)", "rebuilt since the run: another build id"]);
}

/// A damaged or crafted trace's numbers and names cannot make a report that is wrong, unsafe
/// to show or not well-formed (review helper 13): totals past 2^64 saturate, a flame graph's
/// counts are divided until inferno can add them, and control characters and noncharacters
/// are neither written to a terminal nor into an SVG.
#[test]
fn damaged_numbers_and_names_make_sound_reports() {
    // A right-to-left override reorders the rest of a terminal's line.
    let hostile = missing_module("/nonexistent/lib\u{1b}]0;owned\u{7}\u{fffe}\u{202e}.so", &[]);
    let mut kinds = [mallocspy::trace::KindStats::default(); 3];
    (kinds[0].allocs, kinds[1].allocs) = (u64::MAX, u64::MAX);
    (kinds[0].live_bytes, kinds[0].bytes) = (1000, 10);
    let events = [
        Event::ModuleLoad { time_ns: 0, module: hostile },
        Event::Stack { id: 1, frames: vec![0x7f00_0000_1235] },
        Event::Stack { id: 2, frames: vec![0x7f00_0000_2235] },
        // As large as a tick can weigh: the sums saturate.
        testing::tick(1, 0xa0, 1 << 62, 1 << 63, 1),
        testing::tick(2, 0xb0, 1 << 62, 1 << 63, 2),
        Event::HeapStats(HeapStats { time_ns: 3, kinds, ..HeapStats::default() }),
    ];
    let command = vec!["prog\u{fffe}".to_string(), "\u{1b}[2J".to_string(), "\u{2067}txt.exe".to_string()];
    let file = trace_with(&mallocspy::trace::Header { command, ..testing::header() }, &events);
    let shown = |s: &str| s.chars().all(|c| c == '\n' || c == '\t' || !super::text::unprintable(c));

    let report = text(&file, Format::Text);
    assert!(shown(&report), "{report:?}");
    assert!(report.contains("in 18,446,744,073,709,551,615 allocation calls (exact"), "{report}");
    assert!(report.contains("lib\u{fffd}]0;owned\u{fffd}\u{fffd}\u{fffd}.so+0x1235"), "{report}");
    assert!(report.contains("$'prog\\ufffe' $'\\u001b[2J' $'\\u2067txt.exe'"), "{report}");

    let svg = text(&file, Format::Flamegraph);
    assert!(shown(&svg), "{svg:?}");
    assert!(svg.contains("counts divided by 5"), "{svg}");
    assert!(!svg.contains("width=\"-"), "{svg}");
    let svg = text(&file, Format::Timeline);
    assert!(shown(&svg), "{svg:?}");
}
