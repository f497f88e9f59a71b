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
/// A tick of stack 1 on thread 0.
fn tick(time_ns: u64, kind: Kind, size: u64, address: u64, weight: u64) -> Event {
    Event::Tick(Tick { time_ns, thread: 0, kind: kind as u8, entry: 0, size, address, weight, stack: 1 })
}

fn events() -> Vec<Event> {
    let tick = |time_ns, address| tick(time_ns, Kind::Small, 64, address, 1000);
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

/// A trace whose writer read no memory map of the program (no /proc in its container) names
/// its frames by bare addresses: said in a warning, not left for the reader to guess.
#[test]
fn a_trace_without_modules_is_said_to_have_bare_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let events: Vec<Event> = events().into_iter().filter(|e| !matches!(e, Event::ModuleLoad { .. })).collect();
    let path = write(dir.path(), "no-modules.trace", &trace(&events));
    let out = mallocspy(&[path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let warning = format!(
        "mallocspy report: warning: {} names no loaded module (its writer could not read the program's memory map: was /proc mounted?): its frames are bare addresses",
        path.display()
    );
    assert_eq!(stderr_lines(&out), vec![warning]);
    // One that names no code has no module to name: a forked child's that took no sample of
    // its own, only the samples it inherited (its writer reads the modules for a stack).
    let inherited = Event::Inherited { parent: 1, kind: 0, size: 4096, address: 0x1000, weight: 102400 };
    let path = write(dir.path(), "inherited.trace", &trace(&[inherited, Event::End { time_ns: 5 }]));
    let out = mallocspy(&[path.to_str().unwrap()]);
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
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
    let report = String::from_utf8(out.stdout).unwrap();
    assert!(report.contains(type_name_of_val(&parse_row)));
    // The report says so itself (helper 28: a report kept in a file lost the warning).
    let said =
        format!("  incomplete   the trace is cut at offset {cut_at}; the figures go up to its last whole event\n");
    assert!(report.contains(&said), "{report}");
}

/// A tick whose tag lost a bit reads as a record of an unknown tag, skipped: said, in a warning
/// and in the report, where its bytes went missing from the estimates with no sign (review
/// helper 123: one changed bit in each of 1000 ticks took 98 of a site's 306 MiB).
#[test]
fn records_of_unknown_tags_are_said_to_be_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let events = events();
    let before_tick: Vec<Event> = events.iter().take_while(|e| !matches!(e, Event::Tick(_))).cloned().collect();
    let tick_at = trace(&before_tick).len();
    let mut file = trace(&events);
    file[tick_at] |= 0x80;
    let path = write(dir.path(), "flipped.trace", &file);
    let out = mallocspy(&[path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let warning = format!(
        "mallocspy report: warning: {} has 1 record(s) of unknown tags, the first at offset {tick_at}, skipped: damage, or written by a later mallocspy",
        path.display()
    );
    assert_eq!(stderr_lines(&out), [warning]);
    let report = String::from_utf8(out.stdout).unwrap();
    let said = format!(
        "  skipped      1 record of unknown tags, the first at offset {tick_at}: damage, or written by a later mallocspy\n"
    );
    assert!(report.contains(&said), "{report}");
    let out = mallocspy(&["--format", "json", path.to_str().unwrap()]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((json["skipped_records"].as_u64(), json["ticks"].as_u64()), (Some(1), Some(2)), "{json}");
}

/// A trace whose last blocks are zeros (the file system gave the file room the writer never
/// filled: a crash of the machine) is cut where the zeros start. Before, each zero byte read
/// as a record of an unknown tag, skipped: a gigabyte of them took a minute and the report
/// said nothing.
#[test]
fn a_trace_ending_in_zeros_is_cut_where_they_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut events = events();
    events.pop();
    let mut file = trace(&events);
    let zeros_at = file.len();
    file.resize(zeros_at + (1 << 20), 0);
    let path = write(dir.path(), "zeros.trace", &file);
    let out = mallocspy(&[path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stderr_lines(&out),
        [format!(
            "mallocspy report: warning: {} is cut at offset {zeros_at}; reporting the events before it",
            path.display()
        )]
    );
    assert!(String::from_utf8(out.stdout).unwrap().contains(type_name_of_val(&parse_row)));

    // The same with a terabyte of hole after it (`truncate -s`, or the unwritten tail of a
    // crashed file): read a mapped page of zeros at a time, it would take hours (a 5 GiB hole
    // took 12.5 s); where the data ends is asked of the file system.
    let sparse = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    sparse.set_len(1 << 40).unwrap();
    let out = mallocspy(&[path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stderr_lines(&out).len(), 1, "{out:?}");
    assert!(stderr_lines(&out)[0].ends_with(&format!("is cut at offset {zeros_at}; reporting the events before it")));
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
    let text = String::from_utf8(mallocspy(&[path.to_str().unwrap()]).stdout).unwrap();
    assert!(text.contains("  incomplete   no end record: the program did not exit normally (killed, or replaced by exec), or still runs;"), "{text}");

    // Kept by `record` of an image that `exec` replaced: said so (review helper 110).
    for name in ["app.trace.before-exec", "app.trace.before-exec.3"] {
        let kept = write(dir.path(), name, &trace(&events));
        let out = mallocspy(&[kept.to_str().unwrap()]);
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            stderr_lines(&out),
            [format!(
                "mallocspy report: warning: {} is the trace of an image replaced by exec: it has no end record nor exit \
                 statistics; reporting the events it has",
                kept.display()
            )]
        );
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains("  incomplete   an image replaced by exec: no end record; the figures go"), "{text}");
    }

    // While its writer holds the file (an exclusive flock, as mallocspy's writer keeps one
    // until it closes the trace), the program is still running: no end record yet is no news.
    let writer = std::fs::File::open(&path).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor `writer` owns.
    assert_eq!(unsafe { libc::flock(writer.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let out = mallocspy(&["--format", "folded", path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("is still being written (its program is running)"), "{lines:?}");
    assert_eq!(String::from_utf8(out.stdout).unwrap(), folded);
    // The report let go of the file at once: a new writer finds it free.
    drop(writer);
    let again = std::fs::File::open(&path).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::flock(again.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
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

    // A leak report of `run`, text or JSON, is said to be one (review helper 111).
    for (name, report) in
        [("leaks.txt", "==4242== mallocspy leak report for ./prog\n"), ("leaks.json", "{\"pid\":4242}\n")]
    {
        let file = write(dir.path(), name, report.as_bytes());
        let out = mallocspy(&[file.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            stderr_lines(&out),
            [format!(
                "mallocspy report: {}: not a readable mallocspy trace: no mallocspy-trace signature at offset 0 (it is \
                 a report of `mallocspy run`; `mallocspy record` writes the traces `report` reads)",
                file.display()
            )]
        );
    }

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

/// A stream that is no trace is refused at its first bytes: `report - < /dev/zero` read it
/// whole first, gigabytes a second without end (helper 52). Two traces joined into one file
/// are said to be, where the second was skipped as a record of unknown tag and the report
/// went on as if the file were cut.
#[test]
fn an_endless_stream_or_two_joined_traces_are_refused_in_one_line() {
    let zeros = std::fs::File::open("/dev/zero").unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_mallocspy"))
        .args(["report", "-"])
        .stdin(zeros)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut child = child;
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "still reading");
    assert_eq!(
        stderr_lines(&out),
        ["mallocspy report: standard input: not a readable mallocspy trace: no mallocspy-trace signature at offset 0"]
    );

    let dir = tempfile::tempdir().unwrap();
    let one = trace(&events());
    let joined = write(dir.path(), "joined.trace", &[one.as_slice(), one.as_slice()].concat());
    let out = mallocspy(&[joined.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_lines(&out),
        [format!(
            "mallocspy report: {}: not a readable mallocspy trace: another trace starts here (traces joined into one file?) at offset {}",
            joined.display(),
            one.len()
        )]
    );
}

/// `-` reads the trace from the standard input (`zcat app.trace.gz | mallocspy report -`), and a
/// path with a newline in it is shown quoted, so that an error stays one line.
#[test]
fn a_trace_on_the_standard_input_reports_and_odd_paths_stay_on_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let whole = trace(&events());
    let piped = |bytes: &[u8]| {
        let path = write(dir.path(), "piped.trace", bytes);
        let stdin = std::fs::File::open(path).unwrap();
        Command::new(env!("CARGO_BIN_EXE_mallocspy")).args(["report", "-"]).stdin(stdin).output().expect("runs")
    };
    let out = piped(&whole);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stderr_lines(&out), Vec::<String>::new());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.starts_with("mallocspy allocation report: standard input\n"), "{stdout}");
    assert!(stdout.contains(type_name_of_val(&parse_row)), "{stdout}");

    let out = piped(&whole[..whole.len() - 3]);
    assert!(out.status.success(), "{out:?}");
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("mallocspy report: warning: standard input is cut at offset "), "{lines:?}");

    // The trace on the standard input is not replaced by its report either.
    let path = write(dir.path(), "kept.trace", &whole);
    let out = Command::new(env!("CARGO_BIN_EXE_mallocspy"))
        .args(["report", "-o", path.to_str().unwrap(), "-"])
        .stdin(std::fs::File::open(&path).unwrap())
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_lines(&out),
        [format!("mallocspy report: {}: this is the trace being reported; give another --output", path.display())]
    );
    assert_eq!(std::fs::read(&path).unwrap(), whole);
    // `-o -` is the standard output (it wrote a file named `-`).
    let out = Command::new(env!("CARGO_BIN_EXE_mallocspy"))
        .args(["report", "-o", "-", path.to_str().unwrap()])
        .current_dir(dir.path())
        .output()
        .expect("runs");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains(type_name_of_val(&parse_row)),
        "{out:?}"
    );
    assert!(!dir.path().join("-").exists());

    let odd = write(dir.path(), "bad\nname.trace", b"not a trace");
    let out = mallocspy(&[odd.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let shown = format!("$'{}'", odd.display()).replace('\n', "\\n");
    assert_eq!(
        stderr_lines(&out),
        [format!(
            "mallocspy report: {shown}: not a readable mallocspy trace: no mallocspy-trace signature at offset 0"
        )]
    );
}

/// A device is refused at once (`/dev/zero` never ends), and a module path that names
/// something other than a file (a FIFO: opening it would wait for a writer forever) is left
/// unsymbolized; a trace read from a pipe, as `<(zcat t.gz)` gives it, reports.
#[test]
fn devices_and_fifos_never_hang_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = mallocspy(&["/dev/zero"]);
    assert_eq!(
        (out.status.code(), stderr_lines(&out)),
        (Some(1), vec!["mallocspy report: /dev/zero: a device, not a trace".to_string()])
    );

    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let mut fifo_module = events();
    let Event::ModuleLoad { module, .. } = &mut fifo_module[0] else { panic!("a module first") };
    module.path = fifo.to_str().unwrap().into();
    module.build_id.clear();
    let path = write(dir.path(), "fifo-module.trace", &trace(&fifo_module));
    let mut child = Command::new(env!("CARGO_BIN_EXE_mallocspy"))
        .args(["report", path.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed().as_secs() > 20 {
            child.kill().unwrap();
            panic!("the report waits on the module's FIFO");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("fifo+0x"), "unsymbolized, by module and offset");

    let ok = write(dir.path(), "ok.trace", &trace(&events()));
    let piped = Command::new("sh")
        .arg("-c")
        .arg(format!("cat '{}' | '{}' report /dev/stdin", ok.display(), env!("CARGO_BIN_EXE_mallocspy")))
        .output()
        .unwrap();
    assert!(piped.status.success(), "{piped:?}");
}

/// A trace of many modules, each loaded, used by a stack and unloaded (a long-running program
/// that loads plugins, or a crafted file), is reported in seconds: the modules' ranges are
/// kept in order as they come and go, not sorted again for each stack.
#[test]
fn a_trace_of_many_modules_coming_and_going_is_reported_in_seconds() {
    const MODULES: u64 = 40_000;
    let dir = tempfile::tempdir().unwrap();
    let mut events = Vec::new();
    for i in 0..MODULES {
        // Scattered over the address space, four ranges each: what sorting finds slowest.
        let start = 0x10_0000_0000 + (i * 7919 % MODULES) * 0x10_0000;
        let module = Module {
            id: i,
            path: format!("/nonexistent/plugin{i}.so"),
            base: start,
            ranges: (0..4).map(|r| (start + r * 0x2000, start + r * 0x2000 + 0x1000)).collect(),
            build_id: Vec::new(),
        };
        events.push(Event::ModuleLoad { time_ns: i, module });
        events.push(Event::Stack { id: i + 1, frames: vec![start + 0x10] });
        events.push(Event::Tick(Tick {
            time_ns: i,
            size: 64,
            address: i * 64,
            weight: 100,
            stack: i + 1,
            ..Tick::default()
        }));
        if i % 2 == 1 {
            events.push(Event::ModuleUnload { time_ns: i, id: i });
        }
    }
    events.push(Event::End { time_ns: MODULES });
    let path = write(dir.path(), "plugins.trace", &trace(&events));
    let mut child = Command::new(env!("CARGO_BIN_EXE_mallocspy"))
        .args(["report", "--format", "json", path.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed().as_secs() > 30 {
            child.kill().unwrap();
            panic!("the report of {MODULES} modules took more than 30 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["ticks"], MODULES);
    // Every frame is found in its module (a site of its own, each of one sample).
    for site in json["top_by_bytes_allocated"].as_array().unwrap() {
        assert_eq!(site["allocated"]["bytes"], 100, "{site}");
        assert!(site["module"].as_str().unwrap_or_default().starts_with("/nonexistent/plugin"), "{site}");
    }
}

/// A malformed command line is one line too (clap's usage and hint would follow it), status 2.
#[test]
fn a_malformed_command_line_is_one_line_and_status_2() {
    for (args, line) in [
        (
            &["--format", "svg", "x.trace"][..],
            "mallocspy: invalid value 'svg' for '--format <FORMAT>' [possible values: text, json, pprof, folded, flamegraph, timeline]; see --help",
        ),
        (&[][..], "mallocspy: the following required arguments were not provided: <TRACE>; see --help"),
        (&["--top"][..], "mallocspy: a value is required for '--top <N>' but none was supplied; see --help"),
        (
            &["--frobnicate", "x.trace"][..],
            "mallocspy: unexpected argument '--frobnicate' found (tip: a similar argument exists: '--format'); see --help",
        ),
    ] {
        let out = mallocspy(args);
        assert_eq!((out.status.code(), stderr_lines(&out)), (Some(2), vec![line.to_string()]), "{args:?}");
    }
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
    // The report's peak (2000 bytes live at 20 ns), which the statistics, taken later, do not see.
    assert!(timeline.starts_with("<?xml") && timeline.contains(">peak 1.95 KiB at 20 ns</text>"), "{timeline}");
    let text = String::from_utf8(run("text")).unwrap();
    assert!(text.contains(type_name_of_val(&parse_row)));
}

/// With stdout closed (`>&-`) the report has nowhere to go, and says so, as `cat` does: Rust's
/// runtime had put `/dev/null` there, which took the report with status 0.
#[test]
fn a_closed_stdout_is_one_line_and_status_1() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ok.trace", &trace(&events()));
    let out = Command::new("sh")
        .args(["-c", r#"exec "$0" report "$1" >&-"#, env!("CARGO_BIN_EXE_mallocspy")])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr_lines(&out), ["mallocspy report: stdout: Bad file descriptor"]);
    // With an --output, a closed stdout does not matter.
    let output = dir.path().join("report.txt");
    let out = Command::new("sh")
        .args(["-c", r#"exec "$0" report -o "$2" "$1" >&-"#, env!("CARGO_BIN_EXE_mallocspy")])
        .args([&path, &output])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(std::fs::read_to_string(&output).unwrap().contains(type_name_of_val(&parse_row)));
}

/// `--output` naming the trace itself (directly or by a symbolic link) is refused: the report
/// would replace the recording. A device that refuses the report is one line.
#[test]
fn the_output_never_replaces_the_trace() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = trace(&events());
    let path = write(dir.path(), "ok.trace", &bytes);
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    for output in [&path, &link] {
        let out = mallocspy(&["--output", output.to_str().unwrap(), path.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            stderr_lines(&out),
            [format!(
                "mallocspy report: {}: this is the trace being reported; give another --output",
                output.display()
            )]
        );
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "the trace is as it was");
    }
    let report = dir.path().join("report.txt");
    let out = mallocspy(&["--output", report.to_str().unwrap(), path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8(std::fs::read(&report).unwrap()).unwrap().contains(type_name_of_val(&parse_row)));
    // A link to a file not yet made: written through, the link left as it was.
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let to_new = dir.path().join("to_new");
    std::os::unix::fs::symlink("sub/new.txt", &to_new).unwrap();
    let out = mallocspy(&["--output", to_new.to_str().unwrap(), path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(std::fs::symlink_metadata(&to_new).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read(dir.path().join("sub/new.txt")).unwrap(), std::fs::read(&report).unwrap());
    let out = mallocspy(&["--output", "/dev/full", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr_lines(&out), ["mallocspy report: /dev/full: No space left on device (os error 28)"]);
}

/// A trace too large for the memory the command may have ends it with one line and status 1:
/// it died by SIGABRT, with Rust's "memory allocation of N bytes failed" (and a backtrace of
/// seventy lines under RUST_BACKTRACE; review helper 36).
#[test]
fn a_report_out_of_memory_says_so_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    // 3,000 stacks of 1,000 frames each: 3 million frames, 24 bytes each once read.
    let mut events = vec![Event::ModuleLoad { time_ns: 0, module: this_executable() }];
    for id in 1..=3000u64 {
        let frames = (0..1000).map(|i| 0x10_0000 + id * 0x1_0000 + i * 16).collect();
        events.push(Event::Stack { id, frames });
        events.push(Event::Tick(Tick {
            time_ns: id,
            thread: 0,
            kind: 0,
            entry: 0,
            size: 64,
            address: id << 8,
            weight: 64,
            stack: id,
        }));
    }
    let path = write(dir.path(), "large.trace", &trace(&events));
    let out = Command::new("bash")
        .args(["-c", r#"ulimit -v 40000; exec "$0" report --format json "$1""#])
        .arg(env!("CARGO_BIN_EXE_mallocspy"))
        .arg(&path)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let lines = stderr_lines(&out);
    assert_eq!(out.status.code(), Some(1), "{lines:?}");
    assert!(
        lines.len() == 1
            && lines[0].starts_with("mallocspy: out of memory (")
            && lines[0].ends_with(" bytes more were needed)"),
        "{lines:?}"
    );
    assert!(out.stdout.is_empty());
}

/// An output that cannot be written fails before the trace is read (review helper 36: after
/// minutes of reading and symbolizing). The report is written in place: an existing file
/// keeps its mode and its hard links. `/dev/stdout` is written through the descriptor, as
/// `-o -`: opened anew, the file a shell appends stdout to was emptied (and a new file renamed
/// over the old one, tried for a write that fails half way, replaced it: review helper 38).
#[test]
fn the_output_is_checked_first_and_written_in_place() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ok.trace", &trace(&events()));
    let not_a_trace = write(dir.path(), "random", &[0x5a; 4096]);
    for (output, why) in [
        (dir.path().join("no such directory/report.txt"), "No such file or directory (os error 2)".to_string()),
        (dir.path().to_path_buf(), "it is a directory".to_string()),
        (dir.path().join("no such directory/"), "it is a directory".to_string()),
        (not_a_trace.join("report.txt"), "Not a directory (os error 20)".to_string()),
    ] {
        // The trace is not one at all: the output is what is said.
        let out = mallocspy(&["-o", output.to_str().unwrap(), not_a_trace.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(stderr_lines(&out), [format!("mallocspy report: {}: {why}", output.display())]);
    }
    let report = write(dir.path(), "report.txt", b"an earlier report\n");
    std::fs::set_permissions(&report, std::fs::Permissions::from_mode(0o640)).unwrap();
    let other_name = dir.path().join("hard link");
    std::fs::hard_link(&report, &other_name).unwrap();
    let out = mallocspy(&["-o", report.to_str().unwrap(), path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(std::fs::read_to_string(&other_name).unwrap().contains(type_name_of_val(&parse_row)));
    assert_eq!(std::fs::metadata(&report).unwrap().permissions().mode() & 0o777, 0o640);
    let appended = write(dir.path(), "appended.txt", b"HEADER\n");
    let out = Command::new("bash")
        .args(["-c", r#"{ "$0" report -o /dev/stdout "$1" && echo FOOTER; } >> "$2""#])
        .arg(env!("CARGO_BIN_EXE_mallocspy"))
        .args([&path, &appended])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = std::fs::read_to_string(&appended).unwrap();
    assert!(text.starts_with("HEADER\n") && text.ends_with("FOOTER\n"), "{text}");
    assert!(text.contains(type_name_of_val(&parse_row)), "{text}");
}

/// A spike between two heap statistics events is drawn, and the timeline marks the peak the
/// text report names: it drew the statistics alone, and marked their highest (review helper 28).
#[test]
fn the_timeline_shows_a_spike_between_statistics_and_marks_the_reports_peak() {
    let dir = tempfile::tempdir().unwrap();
    let mut events = events();
    let spike = |time_ns, weight| tick(time_ns, Kind::Large, 4 << 20, 0xd0, weight);
    // Between the statistics at 500 ms and 1 s: 4 MiB live from 600 ms to 700 ms.
    let at = events.iter().position(|e| matches!(e, Event::HeapStats(s) if s.time_ns == 1_000_000_000)).unwrap();
    events
        .splice(at..at, [spike(600_000_000, 4 << 20), Event::Free { time_ns: 700_000_000, thread: 0, address: 0xd0 }]);
    let path = write(dir.path(), "spike.trace", &trace(&events));
    let json: serde_json::Value =
        serde_json::from_slice(&mallocspy(&["--format", "json", path.to_str().unwrap()]).stdout).unwrap();
    assert_eq!(
        (json["peak"]["live_bytes"].as_u64(), json["peak"]["time_ns"].as_u64()),
        (Some((4 << 20) + 2000), Some(600_000_000))
    );
    let out = mallocspy(&["--format", "timeline", path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let svg = String::from_utf8(out.stdout).unwrap();
    assert!(svg.contains(">peak 4.00 MiB at 600 ms</text>"), "{svg}");
    // The large kind's area rises to the spike: its path has a point above the 2000 bytes.
    let large = svg.lines().find(|l| l.contains("<title>large</title>")).unwrap();
    let tops: Vec<f64> = large.split(['M', 'L', ' ']).filter_map(|p| p.split_once(',')?.1.parse().ok()).collect();
    let lowest_y = tops.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(lowest_y < 200.0, "the spike is drawn: {large}");
}

/// Between two heap statistics events the timeline follows the replayed heap down as well as up:
/// it kept only the highest moment of each stretch and its two neighbours, so a heap freed just
/// after one statistics event sloped down to the next, drawn live where nothing was, and the
/// rise before the first was cut to its top (review helper 57: 24 MiB drawn live at 450 ms of a
/// program that had freed all at 300 ms).
#[test]
fn the_timeline_follows_the_heap_down_between_statistics_and_up_before_the_first() {
    let dir = tempfile::tempdir().unwrap();
    const MIB: u64 = 1 << 20;
    let large = |time_ns, address| tick(time_ns, Kind::Large, 2 * MIB, address, 2 * MIB);
    let free = |time_ns, address| Event::Free { time_ns, thread: 0, address };
    let stats = |time_ns, live_bytes| {
        let mut kinds = [KindStats::default(); 3];
        kinds[1].live_bytes = live_bytes;
        Event::HeapStats(HeapStats { time_ns, kinds, ..HeapStats::default() })
    };
    let ms = 1_000_000;
    let events = vec![
        Event::ModuleLoad { time_ns: 0, module: this_executable() },
        Event::Stack { id: 1, frames: vec![in_fn(parse_row), in_fn(load_table)] },
        large(100 * ms, 0xd0),
        large(110 * ms, 0xe0),
        large(120 * ms, 0xf0),
        stats(250 * ms, 6 * MIB),
        free(300 * ms, 0xd0),
        free(301 * ms, 0xe0),
        free(302 * ms, 0xf0),
        stats(1000 * ms, 0),
        Event::End { time_ns: 1250 * ms },
    ];
    let path = write(dir.path(), "drop.trace", &trace(&events));
    let out = mallocspy(&["--format", "timeline", path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let svg = String::from_utf8(out.stdout).unwrap();
    let area = svg.lines().find(|l| l.contains("<title>large</title>")).unwrap();
    let d = area.split_once(" d=\"").unwrap().1.split_once('"').unwrap().0;
    let points: Vec<(f64, f64)> = d
        .split(['M', 'L', ' ', 'Z'])
        .filter_map(|p| p.split_once(','))
        .map(|(x, y)| (x.parse().unwrap(), y.parse().unwrap()))
        .collect();
    // The top edge, in time order, then the bottom edge back.
    let top = &points[..points.len() / 2];
    // The axes: 0-1.4 s over x 90-930, 0-6 MiB over y 490-96.
    let x = |seconds: f64| 90.0 + seconds / 1.4 * 840.0;
    let y = |mib: f64| 490.0 - mib / 6.0 * 394.0;
    let at =
        |seconds: f64, mib: f64| top.iter().any(|&(px, py)| (px - x(seconds)).abs() < 0.2 && (py - y(mib)).abs() < 0.2);
    for (seconds, mib) in [(0.100, 2.0), (0.110, 4.0), (0.120, 6.0), (0.300, 4.0), (0.301, 2.0), (0.302, 0.0)] {
        assert!(at(seconds, mib), "{mib} MiB at {seconds} s: {top:?}");
    }
}

/// A trace without heap statistics (one cut before the first) still has a timeline: the live
/// heap replayed from its ticks and frees, without the allocator's line. One with no ticks
/// either is one error line.
#[test]
fn a_timeline_without_heap_statistics_is_replayed_from_the_ticks() {
    let dir = tempfile::tempdir().unwrap();
    let events: Vec<Event> = events().into_iter().filter(|e| !matches!(e, Event::HeapStats(_))).collect();
    let path = write(dir.path(), "nostats.trace", &trace(&events));
    let out = mallocspy(&["--format", "timeline", path.to_str().unwrap()]);
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
    let svg = String::from_utf8(out.stdout).unwrap();
    // Ticks of 1000 bytes at 10 and 20 ns, the first freed at 30, another at 40: 2000 at most.
    assert!(svg.contains(">peak 1.95 KiB at 20 ns</text>"), "{svg}");
    assert!(svg.contains("replayed from the ticks and frees") && !svg.contains("allocator: in use"), "{svg}");
    let events: Vec<Event> = events.into_iter().filter(|e| !matches!(e, Event::Tick(_) | Event::Free { .. })).collect();
    let path = write(dir.path(), "noticks.trace", &trace(&events));
    let out = mallocspy(&["--format", "timeline", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert_eq!(
        stderr_lines(&out),
        [format!(
            "mallocspy report: {}: the trace has no heap statistics events or ticks to draw a timeline from",
            path.display()
        )]
    );
}

/// `go tool pprof` reads the profile (an acceptance item: Go must be installed, and a machine
/// without it fails here rather than passing unchecked).
#[test]
fn go_tool_pprof_reads_the_profile() {
    assert!(
        Command::new("go").arg("version").output().is_ok(),
        "no `go` on PATH to run `go tool pprof`: install golang-go (scripts/install-deps.sh does)"
    );
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

/// The first of `names` on PATH.
fn on_path(names: &[&'static str]) -> Option<&'static str> {
    let path = std::env::var_os("PATH")?;
    names.iter().copied().find(|name| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()))
}

/// Runs headless Chromium on `svg` with `args`, within two minutes (a browser that hangs fails
/// the test instead of holding the run); its output goes to `out`, whose text is returned.
fn chromium_on(chromium: &str, svg: &Path, dir: &Path, args: &[&str], out: &Path) -> String {
    // A file URL: the characters a path may hold that a URL reads otherwise, escaped.
    let url =
        svg.canonicalize().unwrap().display().to_string().replace('%', "%25").replace(' ', "%20").replace('#', "%23");
    let status = Command::new("timeout")
        .args(["-k", "10", "120", chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .args(args)
        .arg(format!("file://{url}"))
        .env("HOME", dir)
        // Files, not pipes: a helper process of the browser that outlives it cannot hold them.
        .stdout(std::fs::File::create(out).unwrap())
        .stderr(std::fs::File::create(dir.join("chromium.err")).unwrap())
        .status()
        .unwrap();
    let err = std::fs::read_to_string(dir.join("chromium.err")).unwrap_or_default();
    assert!(status.success(), "{chromium} {args:?} on {}: {status}\n{err}", svg.display());
    std::fs::read_to_string(out).unwrap_or_default()
}

/// Headless Chromium's screenshot of `svg`, as RGB pixels, once its DOM shows that the browser
/// read the whole file: a file it cannot parse is drawn up to the error, under an error box.
fn screenshot(chromium: &str, svg: &Path, dir: &Path) -> Vec<[u8; 3]> {
    let dom = chromium_on(chromium, svg, dir, &["--dump-dom"], &dir.join("dom.txt"));
    assert!(dom.contains("<svg") && !dom.contains("parsererror"), "{}: {dom}", svg.display());
    let png = dir.join(format!("{}.png", svg.file_stem().unwrap().to_str().unwrap()));
    let shot = format!("--screenshot={}", png.display());
    chromium_on(chromium, svg, dir, &["--window-size=1300,900", &shot], &dir.join("shot.txt"));
    let mut decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    // Some versions' headless mode took the height of the browser's bars off the window's.
    assert!(info.width == 1300 && info.height >= 800, "{}: {info:?}", png.display());
    let channels = info.color_type.samples();
    assert!(channels >= 3, "{info:?}");
    buf[..info.buffer_size()].chunks(channels).map(|p| [p[0], p[1], p[2]]).collect()
}

/// The colour `#rrggbb`, drawn at `opacity` over white.
fn over_white(hex: &str, opacity: f64) -> [u8; 3] {
    let channel = |i: usize| u8::from_str_radix(&hex[1 + 2 * i..3 + 2 * i], 16).unwrap() as f64;
    [0, 1, 2].map(|i| (channel(i) * opacity + 255.0 * (1.0 - opacity)).round() as u8)
}

/// Pixels within a few levels of `color` on every channel.
fn near(pixels: &[[u8; 3]], color: [u8; 3]) -> usize {
    pixels.iter().filter(|p| p.iter().zip(&color).all(|(&a, &b)| a.abs_diff(b) <= 4)).count()
}

/// The flame graphs and timelines open in a browser, as the README's images must: headless
/// Chromium's screenshots of those under `docs/` (python3, recorded) and of those drawn here
/// show the frames' boxes in the memory palette's greens, the kinds' areas in their colours
/// and the peak's red mark, and their DOMs no parser error.
#[test]
fn the_svgs_render_in_headless_chromium() {
    let chromium = on_path(&["chromium", "chromium-browser"])
        .expect("no Chromium on PATH: install chromium (scripts/install-deps.sh does)");
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ok.trace", &trace(&events()));
    let draw = |format: &str| {
        let svg = dir.path().join(format!("drawn-{format}.svg"));
        let out = mallocspy(&["--format", format, "--output", svg.to_str().unwrap(), path.to_str().unwrap()]);
        assert!(out.status.success(), "{out:?}");
        svg
    };
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let shot = |svg: &Path| screenshot(chromium, svg, dir.path());
    // The memory palette: no red, green from 190 up (and any blue); its background is pale.
    let frames = |pixels: &[[u8; 3]]| pixels.iter().filter(|p| p[0] < 40 && p[1] > 150).count();
    for svg in [docs.join("flamegraph.svg"), draw("flamegraph")] {
        let pixels = shot(&svg);
        let share = frames(&pixels) as f64 / pixels.len() as f64;
        eprintln!("{}: frames cover {:.1}% of the screenshot", svg.display(), share * 100.0);
        assert!(share > 0.02, "{}: frames cover {:.2}% of the screenshot", svg.display(), share * 100.0);
    }
    // The kinds' areas and their legend's swatches, at three quarters' opacity.
    let kinds = ["#4e79a7", "#f28e2b", "#59a14f"].map(|k| over_white(k, 0.75));
    for svg in [docs.join("timeline.svg"), draw("timeline")] {
        let pixels = shot(&svg);
        let kinds: Vec<usize> = kinds.iter().map(|&k| near(&pixels, k)).collect();
        let peak = near(&pixels, over_white("#d62728", 1.0));
        eprintln!("{}: the kinds' pixels {kinds:?}, the peak's {peak}", svg.display());
        // Every kind in the legend (those with live bytes) has its swatch (14 by 10); small,
        // the first, has an area too.
        let listed = std::fs::read_to_string(&svg).unwrap().matches(" (estimated)</text>").count();
        let drawn = kinds.iter().filter(|&&n| n >= 100).count();
        assert!(listed >= 1 && drawn >= listed && kinds[0] > pixels.len() / 100, "{}: {kinds:?}", svg.display());
        assert!(peak >= 20, "{}: the peak's mark has {peak} pixels", svg.display());
    }
}
