//! `mallocspy record`.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};

use mallocspy::options::{expand_path, names_pid};

use crate::launch::{self, fail};

pub const EXAMPLES: &str = "Examples:
  mallocspy record -- sqlite3 db.sqlite '.read x.sql'   # names the trace it wrote
  mallocspy report mallocspy.12345.trace                  # top allocation sites
  mallocspy record --interval 1m --output app.trace -- ./app
  mallocspy report --format flamegraph --output app.svg app.trace

Each process (children too) writes its own trace; %p in --output is its pid.
Without %p the first process writes TRACE and the others TRACE.PID.";

#[derive(Clone, Copy, ValueEnum)]
enum SamplingArg {
    /// Each byte with probability 1/interval: unbiased estimates.
    Poisson,
    /// .NET's GCAllocationTick: a tick every interval bytes per thread and kind.
    Tick,
}

/// Options mirror `MALLOCSPY_OPTIONS` (`spy=ticks`).
#[derive(Args)]
pub struct RecordArgs {
    /// Mean bytes between samples (suffixes k, m, g) [default: 102400].
    #[arg(long, value_name = "BYTES", value_parser = parse_interval)]
    interval: Option<u64>,
    /// How allocations are chosen [default: poisson].
    #[arg(long, value_enum)]
    sampling: Option<SamplingArg>,
    /// The trace file (%p = process id).
    #[arg(long, short, value_name = "TRACE", default_value = "mallocspy.%p.trace")]
    output: String,
    /// Period of the heap statistics events [default: 100].
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=60000))]
    stats_interval_ms: Option<u64>,
    /// Frames recorded per sample [default: 32].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=128))]
    stack_depth: Option<u32>,
    /// The preload library (default: libmallocspy_preload.so next to this executable).
    #[arg(long, value_name = "PATH")]
    shim: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM")]
    program: Vec<OsString>,
}

fn parse_interval(text: &str) -> Result<u64, String> {
    mallocspy::options::parse_size(text)
        .filter(|&n| (1..=mallocspy::options::MAX_SAMPLE_INTERVAL).contains(&n))
        .map(|n| n as u64)
        .ok_or_else(|| format!("'{text}' is not a size from 1 byte to 4 EiB (e.g. 102400, 100k, 1m)"))
}

/// Whether the trace `output` (absolute, `%p` unexpanded) can be written, asked before the
/// program runs: the program's writer could only say so on the program's stderr, and the run
/// would be lost. Only regular files: a FIFO or a device (`/dev/full`) is not a trace.
fn check_output(output: &str) -> Result<(), String> {
    // As the program will read it (`%%` is `%`); any pid will do for the directory.
    let expanded = expand_path(output, std::process::id());
    let path = Path::new(&expanded);
    let dir = path.parent().unwrap_or(Path::new("/"));
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{} is not a directory", dir.display())),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    }
    // With %p the file is each process's own: ask the directory instead.
    let file = if names_pid(output) {
        dir.join(format!(".mallocspy-record-{}", std::process::id()))
    } else {
        path.to_path_buf()
    };
    match std::fs::metadata(&file) {
        Ok(m) if m.is_dir() => Err("it is a directory".into()),
        Ok(m) if !m.is_file() => Err("it is not a regular file".into()),
        Ok(_) => OpenOptions::new().append(true).open(&file).map(drop).map_err(|e| e.to_string()),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            // A dangling symbolic link (or a chain of them): the writer will create the last
            // one's target, so ask there.
            let (mut file, mut what) = (file, String::new());
            for _ in 0..40 {
                let Ok(target) = std::fs::read_link(&file) else { break };
                file = file.parent().unwrap_or(Path::new("/")).join(target);
                what = format!("its target '{}': ", file.display());
            }
            OpenOptions::new().write(true).create_new(true).open(&file).map_err(|e| format!("{what}{e}"))?;
            std::fs::remove_file(&file).map_err(|e| e.to_string())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Of `candidates`, the trace that process `pid` ended with: the one whose header names it
/// and started last. A program that `exec`s keeps its pid, and without %p each image may
/// write either file (TRACE when it is free, TRACE.PID when an earlier image's writer still
/// holds it); the image that ran last is the program the user asked for. `None` when no
/// candidate is a trace of `pid` (TRACE may be another process's: a child's, when the
/// program failed to open it).
fn last_trace_of(pid: u32, candidates: &[String]) -> Option<String> {
    let started = |path: &String| -> Option<u64> {
        let header = mallocspy::trace::header_of(std::fs::File::open(path).ok()?)?;
        (header.pid == pid).then_some(header.start_unix_ns)
    };
    candidates.iter().filter_map(|c| Some((started(c)?, c))).max().map(|(_, c)| c.clone())
}

/// `path` as a shell reads it back: as is when it has no character a shell treats specially,
/// else in single quotes (the hint after a trace's name is to be pasted).
fn shell_quoted(path: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_./%+,:=@-".contains(c);
    if !path.is_empty() && path.chars().all(plain) {
        path.to_string()
    } else {
        format!("'{}'", path.replace('\'', r"'\''"))
    }
}

pub fn record(args: RecordArgs) -> ExitCode {
    if args.output == "-" {
        // `report -o -` means stdout; here the program's own output would be mixed in.
        return fail("--output '-': a trace cannot go to stdout, which the program writes; name a file", 2);
    }
    let output = match launch::option_path("--output", Path::new(&args.output)) {
        Ok(output) => output,
        Err(code) => return code,
    };
    if let Err(why) = check_output(&output) {
        return fail(&format!("cannot write --output '{output}': {why}"), 2);
    }
    // Only the flags given: the environment's MALLOCSPY_OPTIONS sets the others.
    let sampling = args.sampling.map(|s| match s {
        SamplingArg::Poisson => "sampling=poisson".to_string(),
        SamplingArg::Tick => "sampling=tick".to_string(),
    });
    let options: Vec<String> = ["spy=ticks".to_string(), format!("trace={output}")]
        .into_iter()
        .chain(sampling)
        .chain(args.interval.map(|n| format!("sample_interval={n}")))
        .chain(args.stats_interval_ms.map(|ms| format!("stats_interval_ms={ms}")))
        .chain(args.stack_depth.map(|n| format!("stack_depth={n}")))
        .collect();
    let (pid, status) = match launch::run_preloaded(args.shim.as_deref(), &options, &args.program) {
        Ok(done) => done,
        Err(code) => return code,
    };
    let trace = expand_path(&output, pid);
    // Without %p, the program writes TRACE.PID when another process's writer holds TRACE.
    let trace = if names_pid(&output) {
        trace
    } else {
        let own = format!("{trace}.{pid}");
        match last_trace_of(pid, &[trace.clone(), own.clone()]) {
            Some(found) => found,
            None => {
                say!("mallocspy: no trace of {pid} in {trace} or {own}");
                return launch::forward(status);
            }
        }
    };
    match std::fs::metadata(&trace) {
        Ok(m) => {
            say!("mallocspy: trace of {pid} in {trace} ({} bytes): mallocspy report {}", m.len(), shell_quoted(&trace))
        }
        Err(e) => say!("mallocspy: no trace at {trace}: {e}"),
    }
    launch::forward(status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mallocspy::trace::{Header, write_header};

    #[test]
    fn the_hint_quotes_a_path_a_shell_would_split() {
        assert_eq!(shell_quoted("/tmp/a.trace"), "/tmp/a.trace");
        assert_eq!(shell_quoted("/tmp/my dir/a.trace"), "'/tmp/my dir/a.trace'");
        assert_eq!(shell_quoted("/tmp/it's.trace"), r"'/tmp/it'\''s.trace'");
    }

    #[test]
    fn the_trace_named_is_the_last_image_of_the_process() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, pid: u32, start_unix_ns: u64| {
            let mut bytes = Vec::new();
            write_header(&mut bytes, &Header { pid, start_unix_ns, ..Header::default() });
            let path = dir.path().join(name).display().to_string();
            std::fs::write(&path, bytes).unwrap();
            path
        };
        // An exec chain: the first image took TRACE, the second found it held and wrote
        // TRACE.7, the third found it free again and took TRACE over.
        let (trace, own) = (write("t", 7, 300), write("t.7", 7, 200));
        assert_eq!(last_trace_of(7, &[trace.clone(), own.clone()]), Some(trace.clone()));
        let own = write("t.7", 7, 400);
        assert_eq!(last_trace_of(7, &[trace.clone(), own.clone()]), Some(own.clone()));
        // Another process's trace in TRACE, or none at all.
        let trace = write("t", 8, 900);
        assert_eq!(last_trace_of(7, &[trace.clone(), own.clone()]), Some(own));
        assert_eq!(last_trace_of(9, &[trace]), None);
        let missing = dir.path().join("none").display().to_string();
        assert_eq!(last_trace_of(7, &[missing.clone(), format!("{missing}.7")]), None);
    }
}
