//! `mallocspy report` as a user runs it: the built command on trace files written here, whose
//! frames are addresses of this test's own functions (so the command symbolizes this file
//! from the test binary on disk), and on damaged, cut and foreign files.

use std::any::type_name_of_val;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use mallocspy::trace::{Event, Header, HeapStats, Kind, KindStats, Module, Sampling, Tick, write_event, write_header};

/// An allocation site.
#[inline(never)]
fn parse_row(n: u64) -> u64 {
    // Plain operators: a call inlined at the entry would be the innermost frame there.
    n ^ 0x5151
}

/// Its caller.
#[inline(never)]
fn load_table(n: u64) -> u64 {
    parse_row(n) ^ 3
}

/// A return address in `f`, whose call byte is `f`'s entry.
fn in_fn(f: fn(u64) -> u64) -> u64 {
    f as usize as u64 + 1
}

/// This executable as a trace module.
fn this_executable() -> Module {
    mallocspy::trace::this_executable().expect("the test binary is in its own map")
}

/// A program that allocated 3000 bytes at `parse_row` (3 samples), freed one block, and kept
/// two; heap statistics at 0.5 s and 1 s; ended at 1.25 s.
fn events() -> Vec<Event> {
    let tick = |time_ns, address| {
        Event::Tick(Tick {
            time_ns,
            thread: 0,
            kind: Kind::Small as u8,
            entry: 0,
            size: 64,
            address,
            weight: 1000,
            stack: 1,
        })
    };
    let stats = |time_ns, live_bytes| {
        let mut kinds = [KindStats::default(); 3];
        kinds[0].live_bytes = live_bytes;
        Event::HeapStats(HeapStats { time_ns, kinds, in_use_bytes: live_bytes, ..HeapStats::default() })
    };
    vec![
        Event::ModuleLoad { time_ns: 0, module: this_executable() },
        Event::Stack { id: 1, frames: vec![in_fn(parse_row), in_fn(load_table)] },
        tick(10, 0xa0),
        tick(20, 0xb0),
        Event::Free { time_ns: 30, thread: 0, address: 0xa0 },
        tick(40, 0xc0),
        stats(500_000_000, 2000),
        stats(1_000_000_000, 2000),
        Event::End { time_ns: 1_250_000_000 },
    ]
}

fn trace(events: &[Event]) -> Vec<u8> {
    let mut file = Vec::new();
    let header = Header {
        pid: 77,
        command: vec!["./loader".into(), "table.csv".into()],
        sampling: Sampling::Poisson,
        interval: 512,
        ..Header::default()
    };
    write_header(&mut file, &header);
    for e in events {
        write_event(&mut file, e);
    }
    file
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn mallocspy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mallocspy")).arg("report").args(args).output().expect("runs")
}

fn stderr_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr).lines().map(str::to_owned).collect()
}

#[test]
fn the_text_report_names_this_tests_functions() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ok.trace", &trace(&events()));
    let out = mallocspy(&[path.to_str().unwrap()]);
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stderr_lines(&out), Vec::<String>::new());
    assert!(stdout.contains("  program      ./loader table.csv\n"), "{stdout}");
    let site = format!("{} (", type_name_of_val(&parse_row));
    let row = stdout.lines().find(|l| l.contains(&site)).unwrap_or_else(|| panic!("no {site} in\n{stdout}"));
    let fields: Vec<&str> = row.split_whitespace().collect();
    // 3 samples of weight 1000 and size 64: 3000 bytes, 47 objects (46.875); 2 live at the peak.
    assert_eq!(fields[..6], ["1", "2.93", "KiB", "100.0%", "47", "3"], "{stdout}");
    assert!(row.contains("tests/report.rs:"), "{row}");
    assert!(stdout.contains("Top allocation sites by live bytes at peak (1.95 KiB at 20 ns)"), "{stdout}");
}

#[test]
fn a_cut_trace_gives_a_warning_and_the_report_of_what_is_before_the_cut() {
    let dir = tempfile::tempdir().unwrap();
    let whole = trace(&events());
    let path = write(dir.path(), "cut.trace", &whole[..whole.len() - 3]);
    let out = mallocspy(&[path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let mut end = Vec::new();
    write_event(&mut end, &Event::End { time_ns: 1_250_000_000 });
    let cut_at = whole.len() - end.len();
    assert_eq!(
        stderr_lines(&out),
        [format!(
            "mallocspy report: warning: {} is cut at offset {cut_at}; reporting the events before it",
            path.display()
        )]
    );
    assert!(String::from_utf8(out.stdout).unwrap().contains(type_name_of_val(&parse_row)));
}

#[test]
fn a_trace_without_its_end_record_gives_a_warning_and_a_report() {
    let dir = tempfile::tempdir().unwrap();
    let mut events = events();
    events.pop();
    let path = write(dir.path(), "killed.trace", &trace(&events));
    let out = mallocspy(&["--format", "folded", path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("has no end record: the program did not exit normally"), "{lines:?}");
    let folded = String::from_utf8(out.stdout).unwrap();
    assert_eq!(folded, format!("{};{} 3000\n", type_name_of_val(&load_table), type_name_of_val(&parse_row)));
}

#[test]
fn random_bytes_and_missing_files_are_one_error_line_and_status_1() {
    let dir = tempfile::tempdir().unwrap();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let noise = write(dir.path(), "noise.bin", &noise);
    let out = mallocspy(&[noise.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert_eq!(
        stderr_lines(&out),
        [format!(
            "mallocspy report: {}: not a readable mallocspy trace: no mallocspy-trace signature at offset 0",
            noise.display()
        )]
    );

    // A valid start, then a record whose fields are nonsense: an error, not a partial report.
    let mut damaged = trace(&events()[..1]);
    damaged.extend_from_slice(&[5, 3, 0xff, 0xff, 0xff]);
    let damaged = write(dir.path(), "damaged.trace", &damaged);
    let out = mallocspy(&[damaged.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with(&format!("mallocspy report: {}: not a readable", damaged.display())), "{lines:?}");

    let missing = dir.path().join("missing.trace");
    let out = mallocspy(&[missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with(&format!("mallocspy report: {}: No such file", missing.display())), "{lines:?}");
}

#[test]
fn every_format_writes_its_output_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ok.trace", &trace(&events()));
    let run = |format: &str| {
        let output = dir.path().join(format!("out.{format}"));
        let out = mallocspy(&["--format", format, "--output", output.to_str().unwrap(), path.to_str().unwrap()]);
        assert!(out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(), "{format}: {out:?}");
        std::fs::read(output).unwrap()
    };
    let json: serde_json::Value = serde_json::from_slice(&run("json")).unwrap();
    assert_eq!(json["top_by_bytes_allocated"][0]["function"], type_name_of_val(&parse_row));
    assert_eq!(json["peak"]["live_bytes"], 2000);
    assert_eq!(run("pprof")[..2], [0x1f, 0x8b]);
    let flame = String::from_utf8(run("flamegraph")).unwrap();
    assert!(flame.starts_with("<?xml") && flame.contains("./loader table.csv: estimated bytes allocated"));
    let timeline = String::from_utf8(run("timeline")).unwrap();
    assert!(timeline.starts_with("<?xml") && timeline.contains(">peak 1.95 KiB at 500 ms</text>"), "{timeline}");
    let text = String::from_utf8(run("text")).unwrap();
    assert!(text.contains(type_name_of_val(&parse_row)));
}

#[test]
fn a_timeline_of_a_trace_without_heap_statistics_is_one_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let events: Vec<Event> = events().into_iter().filter(|e| !matches!(e, Event::HeapStats(_))).collect();
    let path = write(dir.path(), "nostats.trace", &trace(&events));
    let out = mallocspy(&["--format", "timeline", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert_eq!(
        stderr_lines(&out),
        [format!(
            "mallocspy report: {}: the trace has no heap statistics events to draw a timeline from",
            path.display()
        )]
    );
}

/// `go tool pprof` reads the profile, when Go is installed (Debian: golang-go).
#[test]
fn go_tool_pprof_reads_the_profile() {
    if Command::new("go").arg("version").output().is_err() {
        eprintln!("skipped: no `go` on PATH to run `go tool pprof`");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ok.trace", &trace(&events()));
    let profile = dir.path().join("heap.pb.gz");
    let out = mallocspy(&["--format", "pprof", "-o", profile.to_str().unwrap(), path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    // `-unit B`: bytes as bytes, not rounded to kB.
    let top = |options: &[&str]| {
        let out = Command::new("go")
            .args(["tool", "pprof", "-top"])
            .args(options)
            .arg(&profile)
            .env("PPROF_TMPDIR", dir.path())
            .env("HOME", dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let alloc = top(&["-unit", "B", "-sample_index", "alloc_space"]);
    let row = alloc.lines().find(|l| l.ends_with(type_name_of_val(&parse_row))).unwrap_or_else(|| panic!("{alloc}"));
    // flat, flat%, sum%, cum, cum%, name.
    assert!(row.split_whitespace().take(2).eq(["3000B", "100%"]), "{alloc}");
    let inuse = top(&["-unit", "B", "-sample_index", "inuse_space"]);
    assert!(
        inuse.lines().any(|l| l.trim_start().starts_with("2000B") && l.ends_with(type_name_of_val(&parse_row))),
        "{inuse}"
    );
    let objects = top(&["-sample_index", "alloc_objects"]);
    assert!(
        objects.lines().any(|l| l.trim_start().starts_with("47 ") && l.ends_with(type_name_of_val(&parse_row))),
        "{objects}"
    );
}
