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
            "mallocspy: MALLOCSPY_OPTIONS: unknown key 'colour' (known: spy, log_path, report_format, show_reachable, show_below_main, report_on_signal, suppressions, exitcode, stack_depth, max_memory, sampling, sample_interval, sample_seed, trace, stats_interval_ms); running unspied\n",
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
