//! MALLOCSPY_OPTIONS and log_path: bad input gets one clear line and the program runs on,
//! unspied; reports go where they are told, one file per process with `%p`.

mod common;

use common::*;
use std::process::Command;

fn ls() -> Command {
    let mut c = Command::new("ls");
    c.arg("/");
    c
}

#[test]
fn bad_options_are_one_line_and_the_program_runs_unspied() {
    let native = run(Mode::Native, &mut ls());
    for (options, message) in [
        (
            "spy=count:colour=blue",
            "mallocspy: MALLOCSPY_OPTIONS: unknown key 'colour' (known: spy, log_path, report_format, show_reachable, show_below_main, show_mismatched_frees, report_on_signal, suppressions, exitcode, stack_depth, max_memory, sampling, sample_interval, sample_seed, trace, stats_interval_ms, stop_threads, trace_owner, record_run); running unspied\n",
        ),
        (
            "spy=cuont",
            "mallocspy: MALLOCSPY_OPTIONS: bad value 'cuont' for spy (expected a comma-separated list of leaks, count, guard, ticks, none); running unspied\n",
        ),
        (
            "exitcode=x",
            "mallocspy: MALLOCSPY_OPTIONS: bad value 'x' for exitcode (expected a number from 0 to 255); running unspied\n",
        ),
        ("spy", "mallocspy: MALLOCSPY_OPTIONS: 'spy' is not key=value; running unspied\n"),
    ] {
        let out = run(Mode::Shim(Box::leak(options.to_string().into_boxed_str())), &mut ls());
        assert_eq!(out.stdout, native.stdout);
        assert_eq!(out.status.code(), Some(0));
        assert_eq!(text(&out.stderr), message, "for {options:?}");
    }
}

#[test]
fn log_path_with_pid_gets_one_report_per_process() {
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("report.%p.json");
    let options = format!("spy=count:log_path={}", template.display());
    let out = Command::new("bash")
        .args(["-c", "/bin/true; /bin/echo hi; exit 0"])
        .env("LD_PRELOAD", shim())
        .env("MALLOCSPY_OPTIONS", &options)
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "hi\n");
    assert!(out.stderr.is_empty(), "nothing on stderr: {}", text(&out.stderr));
    let reports: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(reports.len() >= 3, "bash, true and echo each wrote a report: {reports:?}");
    for r in reports {
        let body = std::fs::read(&r).unwrap();
        assert!(count_report(&body).is_some(), "{} holds a count report", r.display());
    }
}

/// A program that closes every descriptor it did not open (as daemons and `closefrom` do)
/// closes the log file's too: the report still goes to the log file, not to its stderr.
#[test]
fn the_log_file_is_reopened_when_the_program_closes_every_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("report.log");
    let script = "import os\nos.closerange(3, 1 << 16)\nf = open(os.devnull, 'w')\nprint('ok')";
    let out = Command::new(python())
        .args(["-c", script])
        .env("LD_PRELOAD", shim())
        .env("MALLOCSPY_OPTIONS", format!("spy=leaks:log_path={}", log.display()))
        .output()
        .unwrap();
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "ok\n"));
    assert!(out.stderr.is_empty(), "nothing on the program's stderr: {}", text(&out.stderr));
    let report = std::fs::read_to_string(&log).unwrap();
    assert!(report.contains("LEAK SUMMARY:"), "the report is in the log file: {report:?}");
}

#[test]
fn an_unwritable_log_path_is_one_line_and_the_report_goes_to_stderr() {
    let out = Command::new("ls")
        .arg("/")
        .env("LD_PRELOAD", shim())
        .env("MALLOCSPY_OPTIONS", "spy=count:log_path=/nonexistent/dir/report.%p")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("mallocspy: cannot open log_path '/nonexistent/dir/report.")
            && first.ends_with(": No such file or directory (os error 2); reports go to stderr"),
        "{stderr}"
    );
    assert!(count_report(&out.stderr).is_some(), "{stderr}");
}

/// A log that opens but takes no writes (a full disk; `/dev/full` here): the report goes to
/// stderr, and that is said once. It went there without a word; and from a program that closes
/// its stderr at exit (coreutils' `ls` and `sort` do) it went nowhere, since no copy of stderr
/// was kept beside a log file.
#[test]
fn a_log_that_refuses_the_report_is_said_and_the_report_goes_to_stderr() {
    for mut program in [Command::new(bench_dir().join("leaky")), ls()] {
        let out = program
            .env("LD_PRELOAD", shim())
            .env("MALLOCSPY_OPTIONS", "spy=count:log_path=/dev/full")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{program:?}");
        let stderr = text(&out.stderr);
        assert_eq!(
            stderr.lines().next(),
            Some("mallocspy: writing to the log failed; the report goes to stderr"),
            "{program:?}: {stderr}"
        );
        assert!(count_report(&out.stderr).is_some(), "{program:?}: {stderr}");
    }
}

/// `trace=PATH` is written by the ticks spy only: asked for under another spy, the trace was
/// silently not made.
#[test]
fn a_trace_without_the_ticks_spy_is_said_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.trace");
    let out = run(Mode::Shim(format!("spy=count:trace={}", trace.display()).leak()), &mut ls());
    assert!(out.status.success());
    let said = text(&out.stderr);
    assert!(
        said.starts_with("mallocspy: trace is written by spy=ticks only, which is not among the spies; no trace\n"),
        "{said}"
    );
    assert!(!trace.exists());
}

/// `log_path` and `trace` naming the same file: the reports go to stderr, and that is said.
/// The leak report was appended to the trace, which then no longer read; with `%p` in both,
/// the trace replaced the log file and the report was lost.
#[test]
fn a_log_path_that_is_the_trace_is_said_and_the_report_goes_to_stderr() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["t.trace", "t.%p"] {
        let path = dir.path().join(name);
        let options = format!("spy=ticks,leaks:log_path={0}:trace={0}", path.display());
        let out = run(Mode::Shim(options.leak()), &mut Command::new(bench_dir().join("leaky")));
        assert_eq!(out.status.code(), Some(0));
        let stderr = text(&out.stderr);
        assert_eq!(
            stderr.lines().next(),
            Some("mallocspy: log_path and trace name the same file; reports go to stderr"),
            "{stderr}"
        );
        assert!(stderr.contains("definitely lost"), "{stderr}");
        let trace = path.to_str().unwrap().replace("%p", &out_pid(&stderr));
        let report = Command::new(mallocspy()).args(["report", &trace]).output().unwrap();
        assert!(report.status.success(), "{name}: {}", text(&report.stderr));
    }
}

/// The process id a leak report's lines begin with (`==PID==`).
fn out_pid(report: &str) -> String {
    let line = report.lines().find(|l| l.starts_with("==")).expect("a leak report");
    line.trim_start_matches('=').split('=').next().unwrap().to_string()
}

/// A `max_memory` too small for the threads' slots and counters: one line says the count does
/// not fit, and the program runs unspied. The slots were mapped at the first call, after the
/// spy was made: no thread had one, the report was all zeros, "reached" said and the report
/// marked not complete (review helper 131).
#[test]
fn a_count_that_does_not_fit_in_max_memory_says_so() {
    let out = run(Mode::Shim("spy=count:max_memory=3m"), &mut ls());
    assert!(out.status.success());
    assert!(text(&out.stdout).lines().any(|l| l == "usr"), "the program ran");
    let report = text(&out.stderr);
    assert_eq!(report, "mallocspy: max_memory (3145728 bytes) is less than spy=count needs; running unspied\n");
    let out = run(Mode::Shim("spy=count"), &mut ls());
    assert!(!text(&out.stderr).contains("complete"), "{}", text(&out.stderr));
    // The limit refused the leak tracker's records only: every call was counted.
    let out = run(Mode::Shim("spy=count,leaks:max_memory=8m"), &mut Command::new(c_program("million.c")));
    let report = text(&out.stderr);
    assert!(report.contains("max_memory (8388608 bytes) reached"), "{report}");
    let count = count_report(&out.stderr).expect("a count report");
    assert_eq!((calls(&count, "malloc"), count.get("complete")), (1_000_002, None), "{report}");
}

/// A `max_memory` too small to make the spies at all: one line that says so, and the program
/// runs unspied. It was two, the limit "reached" and then "cannot map memory for the spies",
/// which read as the kernel refusing memory. The spies that fit run: one that did not turned
/// them all off (review helper 121).
#[test]
fn spies_that_do_not_fit_in_max_memory_are_one_line() {
    for (spies, named, running) in [("leaks,ticks", "ticks", "it"), ("leaks,guard,ticks", "ticks,guard", "them")] {
        let out = run(Mode::Shim(format!("spy={spies}:max_memory=2m").leak()), &mut ls());
        assert!(out.status.success());
        let stderr = text(&out.stderr);
        let said = format!(
            "mallocspy: max_memory (2097152 bytes) is less than spy={named} needs; running without {running}\n"
        );
        assert!(stderr.starts_with(&said), "{stderr}");
        // The leak tracker, up to the bound.
        assert!(stderr.contains("max_memory (2097152 bytes) reached"), "{stderr}");
        assert!(stderr.contains("LEAK SUMMARY:"), "{stderr}");
    }
    for (spies, named) in [("ticks", "ticks"), ("count,ticks", "ticks,count"), ("leaks,guard", "leaks,guard")] {
        let out = run(Mode::Shim(format!("spy={spies}:max_memory=1m").leak()), &mut ls());
        assert!(out.status.success());
        assert!(text(&out.stdout).lines().any(|l| l == "usr"), "the program ran");
        assert_eq!(
            text(&out.stderr),
            format!("mallocspy: max_memory (1048576 bytes) is less than spy={named} needs; running unspied\n")
        );
    }
}

#[test]
fn spy_none_is_a_pure_pass_through() {
    let out = run(PASS_THROUGH, &mut ls());
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    assert_eq!(out.stdout, run(Mode::Native, &mut ls()).stdout);
}

#[test]
fn unset_options_track_leaks_as_a_preloaded_lsan_would() {
    let out = run(Mode::Shim(""), &mut ls());
    assert_eq!(out.stdout, run(Mode::Native, &mut ls()).stdout);
    assert!(text(&out.stderr).contains("LEAK SUMMARY:"), "{}", text(&out.stderr));
}

/// A program started with stderr closed: its first file gets descriptor 2, and the report at
/// exit, which has no stderr to go to, must not go into that file.
#[test]
fn a_program_started_without_stderr_gets_no_report_in_its_own_files() {
    use std::os::unix::process::CommandExt;
    let program = c_program("report_into_first_file.c");
    let dir = tempfile::tempdir().unwrap();
    for mode in Mode::ALL {
        let file = dir.path().join("program.out");
        let mut cmd = Command::new(&program);
        cmd.arg(&file);
        // SAFETY: between fork and exec: close() is async-signal-safe and allocates nothing.
        unsafe {
            cmd.pre_exec(|| {
                libc::close(2);
                Ok(())
            });
        }
        let out = run(mode, &mut cmd);
        assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "descriptor 2\n"), "{mode:?}");
        let written = std::fs::read_to_string(&file).unwrap();
        assert_eq!(written, "the program's own line\n", "{mode:?}: the program's file holds only its own line");
    }
}

/// A program that leaves a daemon behind (a child in a session of its own, descriptors 0-2 on
/// /dev/null): its caller, reading the program's stdout and stderr to end of file, gets the
/// end when the program exits, not when the daemon does. The daemon must not hold a copy of
/// the caller's stderr, with a log file (of its own or its parent's) or without.
#[test]
fn a_daemon_left_behind_does_not_hold_its_callers_stderr_open() {
    let program = c_program("daemon_child.c");
    let dir = tempfile::tempdir().unwrap();
    let logs = ["report.%p", "report"].map(|name| {
        let options = format!("spy=count:log_path={}", dir.path().join(name).display());
        Mode::Shim(options.leak())
    });
    for (i, mode) in Mode::ALL.into_iter().chain(logs).enumerate() {
        let (log, release) = (dir.path().join(format!("daemon{i}")), dir.path().join(format!("release{i}")));
        // Reads both pipes to their end, then waits for the program.
        let out = run(mode, Command::new(&program).arg(&log).arg(&release));
        let seen_at_end = std::fs::read_to_string(&log).unwrap();
        std::fs::write(&release, "").unwrap();
        for _ in 0..1000 {
            if std::fs::read_to_string(&log).unwrap().contains("left") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "parent done\n"), "{mode:?}");
        assert_eq!(
            seen_at_end, "daemon\n",
            "{mode:?}: the caller saw the end of the output only when the daemon had left"
        );
    }
}

/// A log or trace path naming a FIFO that nothing reads: opening it for writing would wait for
/// a reader, in the program's start-up, forever. It is one line instead, and the program runs.
#[test]
fn a_fifo_that_nothing_reads_is_one_line_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let status = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(status.success());
    for (options, what) in [("spy=count:log_path", "log_path"), ("spy=ticks:trace", "trace")] {
        let child = Command::new("ls")
            .arg("/")
            .env("LD_PRELOAD", shim())
            .env("MALLOCSPY_OPTIONS", format!("{options}={}", fifo.display()))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = output_within(child, std::time::Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(0), "{what}: the program ran to its end");
        assert_eq!(out.stdout, run(Mode::Native, &mut ls()).stdout, "{what}");
        let first = text(&out.stderr).lines().next().unwrap_or_default().to_string();
        assert_eq!(
            first,
            format!(
                "mallocspy: cannot open {what} '{}': a FIFO that nothing reads; {}",
                fifo.display(),
                if what == "trace" { "sampling without a trace" } else { "reports go to stderr" }
            )
        );
    }
}

/// A server that sends its stderr to a log before forking its workers: a worker's leak report
/// goes where the server's does, to the stderr the program was started with (the worker keeps
/// mallocspy's copy of it), not into the program's log and not nowhere.
#[test]
fn a_worker_forked_after_stderr_was_redirected_reports_to_the_original_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("server.log");
    let out = run(Mode::Shim(""), Command::new(c_program("redirected_fork.c")).arg(&log));
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "served\n"));
    let stderr = text(&out.stderr);
    for lost in ["123 bytes in 1 blocks are definitely lost", "456 bytes in 1 blocks are definitely lost"] {
        assert!(stderr.contains(lost), "{lost}: {stderr}");
    }
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "", "nothing of ours in the program's log");
}
