//! `mallocspy record`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};

use mallocspy::options::{expand_path, names_pid};

use crate::launch::{self, fail};
use crate::report::text::{path_shown, quoted_path, shell_word};

/// A path in a message, on one line.
fn shown(path: &str) -> String {
    path_shown(Path::new(path))
}

pub const EXAMPLES: &str = "Examples:
  mallocspy record -- sqlite3 db.sqlite '.read x.sql'   # names the trace it wrote
  mallocspy report mallocspy.12345.trace                  # top allocation sites
  mallocspy record --interval 1m --output app.trace -- ./app
  mallocspy report --format flamegraph --output app.svg app.trace

Each process (children too) writes its own trace; %p in --output is its pid.
Without %p the first process writes TRACE and the others TRACE.PID.
An image replaced by exec keeps its trace as TRACE.before-exec
if it recorded anything (a shell's child that execs at once does not).";

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

/// The other traces of the run that wrote `named` from `template`, started at `started_ns`
/// (Unix time) or later: its descendants' (`TRACE.PID`, or the template with their pid) and
/// its images' before an `exec` (`.before-exec`), largest first, each with its program's name
/// and its size. A run of a shell script left dozens, and `record` named only the first process's (review
/// helper 68). Only those in `named`'s directory are looked for (a `%p` in a directory name
/// is not followed). Only those whose options hold `run` (`record_run=PID-START`, which this run's
/// processes inherit): a run beside it in the same directory wrote traces as alike (review
/// helper 89).
fn other_traces(template: &str, named: &str, started_ns: u64, run: &str) -> Vec<(String, String, u64)> {
    const SENTINEL: u32 = 4_000_000_123;
    let pattern = expand_path(template, SENTINEL);
    let sentinel = SENTINEL.to_string();
    let Some(file) = Path::new(&pattern).file_name().and_then(|f| f.to_str()) else { return Vec::new() };
    let dir = match Path::new(&pattern).parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if dir.to_string_lossy().contains(&sentinel) || file.matches(&sentinel).count() > 1 {
        return Vec::new();
    }
    let (before, after) = file.split_once(&sentinel).unwrap_or((file, ""));
    // The file name, less the pid where the template has `%p`, up to what a process adds.
    let ours = |name: &str| -> bool {
        let Some(rest) = name.strip_prefix(before) else { return false };
        let rest = if names_pid(template) {
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits == 0 {
                return false;
            }
            &rest[digits..]
        } else {
            rest
        };
        let Some(rest) = rest.strip_prefix(after) else { return false };
        rest.is_empty() || rest.starts_with('.')
    };
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut found: Vec<(std::cmp::Reverse<u64>, String, String)> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            if !ours(&name) || !e.file_type().ok()?.is_file() {
                return None;
            }
            let path = if file == pattern { name } else { dir.join(name).to_string_lossy().into_owned() };
            // `named` as the template spells it (`dir//t.trace`), `path` as joined.
            if Path::new(&path) == Path::new(named) {
                return None;
            }
            let file = std::fs::File::open(&path).ok()?;
            let size = file.metadata().ok()?.len();
            let header = mallocspy::trace::header_of(file)?;
            let program = header.command.first().map(|c| c.rsplit('/').next().unwrap_or(c).to_string());
            let ours = header.start_unix_ns >= started_ns && header.options.split(':').any(|o| o == run);
            ours.then(|| (std::cmp::Reverse(size), path, program.unwrap_or_default()))
        })
        .collect();
    found.sort();
    found.into_iter().map(|(size, path, program)| (path, program, size.0)).collect()
}

/// How long `record` waits for the program's trace writer to let go of its trace.
const WRITER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits, for [`WRITER_PATIENCE`] at most, until no trace writer holds the trace at `path`
/// (each holds its file's lock for as long as it runs): a program that a signal ended did not
/// wait for its writer to finish, and the size said was the size half-way (review helper 148:
/// 174 bytes said of a trace of 8,414). Whether the writer let go (or none held it).
fn wait_for_writer(path: &str) -> bool {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    // Not blocking: a FIFO at the path has no writer to wait for.
    let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path) else {
        return true;
    };
    let start = std::time::Instant::now();
    // SAFETY: flock on a descriptor we own; the shared lock goes with the file.
    while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK)
    {
        if start.elapsed() >= WRITER_PATIENCE {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    true
}

/// Traces [`other_traces`] names in its line at most.
const OTHERS_LISTED: usize = 5;

pub fn record(args: RecordArgs) -> ExitCode {
    if args.output == "-" {
        // `report -o -` means stdout; here the program's own output would be mixed in.
        return fail("--output '-': a trace cannot go to stdout, which the program writes; name a file", 2);
    }
    let output = match launch::option_template("--output", Path::new(&args.output)) {
        Ok(output) => output,
        Err(code) => return code,
    };
    if let Err(why) = launch::check_writable(&output, true) {
        return fail(&format!("cannot write --output {}: {why}", quoted_path(&output)), 2);
    }
    // Only the flags given: the environment's MALLOCSPY_OPTIONS sets the others, and its
    // spies stay beside the ticks.
    let sampling = args.sampling.map(|s| match s {
        SamplingArg::Poisson => "sampling=poisson".to_string(),
        SamplingArg::Tick => "sampling=tick".to_string(),
    });
    let spies = launch::spies_with("ticks", std::env::var("MALLOCSPY_OPTIONS").ok().as_deref());
    let started_ns =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    // Its pid and start: `record` as a container's pid 1 is pid 1 at every run, and a run took
    // the last one's traces for its own processes' (review helper 157).
    let run = format!("record_run={}-{started_ns}", std::process::id());
    let options: Vec<String> = [spies, format!("trace={output}"), run.clone()]
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
                say!("mallocspy: no trace of {pid} in {} or {}", shown(&trace), shown(&own));
                return launch::forward(status);
            }
        }
    };
    let finished = wait_for_writer(&trace);
    match std::fs::metadata(&trace) {
        Ok(m) => {
            // Its size then is only what was written so far (a writer a process of the program
            // stopped, or one still writing a long queue out).
            let so_far = if finished { "" } else { " so far, its writer still at work" };
            say!(
                "mallocspy: trace of {pid} in {} ({} bytes{so_far}): mallocspy report {}",
                shown(&trace),
                m.len(),
                shell_word(&trace)
            )
        }
        Err(e) => say!("mallocspy: no trace at {}: {e}", shown(&trace)),
    }
    let others = other_traces(&output, &trace, started_ns, &run);
    if !others.is_empty() {
        let listed: Vec<String> = others
            .iter()
            .take(OTHERS_LISTED)
            .map(|(path, program, size)| format!("{} ({program}, {size} bytes)", shell_word(path)))
            .collect();
        let more = others.len().saturating_sub(OTHERS_LISTED);
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        say!(
            "mallocspy: {} other trace(s) of this run (child processes, images before an exec), largest first: {}{more}",
            others.len(),
            listed.join(", ")
        );
    }
    launch::forward(status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mallocspy::trace::{Header, write_header};

    #[test]
    fn the_hint_quotes_a_path_a_shell_would_split() {
        assert_eq!(shell_word("/tmp/a.trace"), "/tmp/a.trace");
        assert_eq!(shell_word("/tmp/my dir/a.trace"), "'/tmp/my dir/a.trace'");
        assert_eq!(shell_word("/tmp/it's.trace"), r"'/tmp/it'\''s.trace'");
        assert_eq!(shell_word("/tmp/a\n==1== b.trace"), r"$'/tmp/a\n==1== b.trace'");
        assert_eq!(shown("/tmp/a\nb.trace"), r"$'/tmp/a\nb.trace'");
    }

    #[test]
    fn the_other_traces_of_a_run_are_those_its_template_names_since_it_started() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, bytes: usize, start_unix_ns: u64| {
            let mut file = Vec::new();
            let command = vec![format!("/bin/{name}-program")];
            let run = if name.contains("beside") { "record_run=8" } else { "record_run=9" };
            let options = format!("spy=ticks:{run}:stack_depth=8");
            write_header(&mut file, &Header { pid: 1, start_unix_ns, command, options, ..Header::default() });
            file.resize(file.len() + bytes, 0);
            std::fs::write(dir.path().join(name), file).unwrap();
        };
        let names = [
            ("m.5.trace", 0),
            ("m.6.trace", 10),
            ("m.5.trace.before-exec", 20),
            ("m.x.trace", 0),
            ("m.7.trace.beside", 0),
        ];
        for (name, bytes) in names {
            write(name, bytes, 1_000);
        }
        write("m.7.trace", 0, 999);
        write("other", 0, 1_000);
        let at = |name: &str| dir.path().join(name).display().to_string();
        // m.7.trace.beside: another run's, the same template in the same directory.
        let found = other_traces(&at("m.%p.trace"), &at("m.5.trace"), 1_000, "record_run=9");
        let names: Vec<(&str, &str)> =
            found.iter().map(|(path, program, _)| (path.rsplit('/').next().unwrap(), program.as_str())).collect();
        assert_eq!(
            names,
            [("m.5.trace.before-exec", "m.5.trace.before-exec-program"), ("m.6.trace", "m.6.trace-program")]
        );
        // Without %p: TRACE.anything.
        let found = other_traces(&at("m.5.trace"), &at("m.5.trace"), 1_000, "record_run=9");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].0.ends_with("m.5.trace.before-exec"));
        // A doubled slash (review helper 69).
        let doubled = format!("{}//m.5.trace", dir.path().display());
        assert_eq!(other_traces(&doubled, &doubled, 1_000, "record_run=9").len(), 1);
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
