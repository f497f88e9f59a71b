//! `mallocspy report`: reads a trace written by `mallocspy record` and reports where the
//! program allocated.
//!
//! The trace's ticks are weighted samples, as .NET's GCAllocationTick: each stands for
//! `weight` bytes, so sums of weights estimate the program's totals. The stages, one module
//! each: [`profile`] aggregates the events per stack (with the live heap replayed to its peak),
//! [`symbolize`] resolves the return addresses offline from the modules the trace lists,
//! [`sites`] groups stacks by allocation site; then one module per format writes the report,
//! a pure function of those.

mod envelope;
mod flame;
mod input;
mod json;
mod output;
mod pprof;
mod profile;
mod progress;
mod sites;
mod symbolize;
/// Whether `path` names a trace `record` kept of an image replaced by `exec`: `.before-exec`,
/// or `.before-exec.N` (see `src/trace/writer.rs`).
fn is_kept_before_exec(path: &Path) -> bool {
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    let name = name.trim_end_matches(|c: char| c.is_ascii_digit());
    name.ends_with(".before-exec") || name.ends_with(".before-exec.")
}

/// What a file that is no trace is, when it is another output of mallocspy's: a leak report
/// given to `report` was refused as having "no mallocspy-trace signature", which did not say
/// what to do (review helper 111).
fn not_a_trace_but(bytes: &[u8]) -> Option<&'static str> {
    let start = bytes.get(..bytes.len().min(64))?;
    let text = String::from_utf8_lossy(start);
    let leak_text = text
        .strip_prefix("==")
        .and_then(|t| t.split_once("=="))
        .is_some_and(|(pid, _)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
    let leak_json = text.starts_with("{\"pid\":");
    (leak_text || leak_json || text.starts_with("mallocspy: "))
        .then_some(" (it is a report of `mallocspy run`; `mallocspy record` writes the traces `report` reads)")
}

#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
pub mod text;
mod timeline;
mod units;

use std::io::{self, IsTerminal, Write};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};

use output::Output;
use profile::Profile;
use progress::Progress;
use sites::Site;
use symbolize::Symbols;
use text::path_shown;

pub const EXAMPLES: &str = "Examples:
  mallocspy record -o app.trace -- ./app            # first, the trace
  mallocspy report app.trace                        # top allocation sites, as text
  mallocspy report --top 50 --format json app.trace > report.json
  mallocspy report --format pprof -o heap.pb.gz app.trace && go tool pprof -top heap.pb.gz
  mallocspy report --format flamegraph -o alloc.svg app.trace
  mallocspy report --format folded app.trace | inferno-flamegraph > alloc.svg
  mallocspy report --format timeline -o heap.svg app.trace
  zcat app.trace.gz | mallocspy report -            # a trace on the standard input

Figures are estimates: each sampled allocation (a tick) stands for its weight in bytes.
Symbols come from the program's files as they are now, found by the paths in the trace.";

/// The report's form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Top allocation sites by bytes allocated, by live bytes at the peak and left at the end.
    Text,
    /// The text report's data as one JSON object, with full stacks per site.
    Json,
    /// A gzipped profile.proto for `go tool pprof` (alloc_/inuse_ objects and space).
    Pprof,
    /// Folded stacks weighted by bytes allocated (flamegraph.pl, inferno, speedscope).
    Folded,
    /// A flame graph (SVG) of bytes allocated.
    Flamegraph,
    /// An SVG chart of the live heap over time, per kind, with its peak.
    Timeline,
}

/// `mallocspy report`'s arguments.
#[derive(Args)]
pub struct ReportArgs {
    /// The report's form.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Write the report to FILE instead of stdout (`-`: stdout, as for the trace).
    #[arg(long, short, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Sites in each table of the text and JSON reports.
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    top: u32,
    /// The trace, as written by `mallocspy record` (`-`: the standard input).
    #[arg(value_name = "TRACE")]
    trace: PathBuf,
}

/// What every format is written from.
pub struct Report<'a> {
    /// The trace's path, as given.
    pub trace: &'a Path,
    /// The aggregated events.
    pub profile: &'a Profile,
    /// Their resolved addresses.
    pub symbols: &'a Symbols,
    /// Sites per table.
    pub top: usize,
}

impl<'a> Report<'a> {
    /// The report of a profile whose stacks `symbols` resolved.
    pub fn new(trace: &'a Path, profile: &'a Profile, symbols: &'a Symbols, top: usize) -> Self {
        Report { trace, profile, symbols, top }
    }

    /// Whether the trace is one `record` kept of an image that `exec` replaced
    /// (`PATH.before-exec`, `.before-exec.2`, ...): one without an end record nor exit
    /// statistics, which had read as a killed program (review helper 110).
    pub fn replaced_by_exec(&self) -> bool {
        is_kept_before_exec(self.trace)
    }

    /// Every allocation site, most bytes allocated first.
    pub fn sites(&self) -> Vec<Site<'a>> {
        sites::sites(self.profile, self.symbols)
    }

    /// The report in `format`.
    ///
    /// # Errors
    /// A format that the trace has no data for (one line, for the user).
    pub fn render(&self, format: Format) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let written = match format {
            Format::Text => text::write(self, &mut out),
            Format::Json => json::write(self, &mut out),
            Format::Pprof => pprof::write(self, &mut out),
            // An empty file would go on to the flame graph tool, which says less of why.
            Format::Folded if self.profile.allocated.bytes == 0 => {
                return Err("the trace has no sampled allocations to fold into stacks".into());
            }
            Format::Folded => flame::write_folded(self, &mut out),
            Format::Flamegraph if self.profile.allocated.bytes == 0 => {
                return Err("the trace has no sampled allocations to draw a flame graph of".into());
            }
            Format::Flamegraph => flame::write_flamegraph(self, &mut out),
            Format::Timeline if self.profile.heap_stats.is_empty() && self.profile.replayed_live.is_empty() => {
                return Err("the trace has no heap statistics events or ticks to draw a timeline from".into());
            }
            Format::Timeline => timeline::write(self, &mut out),
        };
        // Every writer writes to memory, which cannot fail; a renderer's own error is a message.
        written.map_err(|e| e.to_string())?;
        Ok(out)
    }
}

/// Runs `mallocspy report`: the report, or one line on stderr and status 1.
pub fn report(args: ReportArgs) -> ExitCode {
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            say!("mallocspy report: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &ReportArgs) -> Result<(), String> {
    let path = &args.trace;
    let shown = path_shown(path);
    let failed = |e: &dyn std::fmt::Display| format!("{shown}: {e}");
    // `-o -` is stdout, as `-` for the trace is stdin (it wrote a file named `-`); so are the
    // names of descriptor 1, written through it: opened anew, a file the shell redirected
    // stdout to was emptied (`>>`), or the shell's next line written over the report (`>`).
    let stdout_names = ["-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"].map(Path::new);
    let output = args.output.as_deref().filter(|&file| !stdout_names.contains(&file));
    match output {
        Some(file) => refuse_the_trace(file, path)?,
        // The runtime put /dev/null there, which would take the report without a word.
        None if crate::launch::closed_at_start(1) => return Err("stdout: Bad file descriptor".into()),
        None => {}
    }
    // A FIFO is read (a shell's `<(zcat trace.gz)` is one); a device never ends or is no file.
    if path == Path::new(input::STDIN) {
        if io::stdin().is_terminal() {
            return Err(failed(&"a terminal, not a trace (pipe one in, or name its file)"));
        }
    } else if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device() || m.file_type().is_block_device()) {
        return Err(failed(&"a device, not a trace"));
    }
    let output = output.map(Output::prepare).transpose()?;
    let input = input::load(path).map_err(|e| failed(&e))?;
    let mut progress = Progress::new();
    let profile = profile::read(&input.bytes, &mut progress)
        .map_err(|e| failed(&format!("{e}{}", not_a_trace_but(&input.bytes).unwrap_or_default())))?;
    drop(input.bytes);
    // The timeline needs no symbols, and symbolizing may be the slow part.
    let symbols =
        if args.format == Format::Timeline { Symbols::default() } else { Symbols::resolve(&profile, &mut progress) };
    progress.finish();
    if input.being_written && profile.end_ns.is_none() {
        say!(
            "mallocspy report: warning: {shown} is still being written (its program is running); reporting the events written so far"
        );
    } else if let Some(offset) = profile.truncated_at {
        say!("mallocspy report: warning: {shown} is cut at offset {offset}; reporting the events before it");
    } else if profile.end_ns.is_none() && is_kept_before_exec(path) {
        say!(
            "mallocspy report: warning: {shown} is the trace of an image replaced by exec: it has no end record nor exit statistics; reporting the events it has"
        );
    } else if profile.end_ns.is_none() {
        say!(
            "mallocspy report: warning: {shown} has no end record: the program did not exit normally (killed, or replaced by exec); reporting the events it has"
        );
    }
    if let (skipped @ 1.., Some(first)) = profile.skipped_records {
        say!(
            "mallocspy report: warning: {shown} has {skipped} record(s) of unknown tags, the first at offset {first}, skipped: damage, or written by a later mallocspy"
        );
    }
    if profile.modules.is_empty() && profile.stacks.iter().any(|stack| !stack.frames.is_empty()) {
        // Its writer read no map of the program: a container's or a chroot's without /proc
        // (review helper 107). Said, not left to bare addresses to tell. (A trace that names
        // no code, a child's with only the samples it inherited, has no module to name.)
        say!(
            "mallocspy report: warning: {shown} names no loaded module (its writer could not read the program's memory map: was /proc mounted?): its frames are bare addresses"
        );
    }
    for (file, why) in symbols.changed_files() {
        say!("mallocspy report: warning: {} is {why}: its frames are named by offset", path_shown(Path::new(file)));
    }
    let report = Report::new(path, &profile, &symbols, args.top as usize);
    let out = report.render(args.format).map_err(|e| failed(&e))?;
    match output {
        Some(output) => output.write(&out),
        None => {
            let mut stdout = io::stdout().lock();
            match stdout.write_all(&out).and_then(|()| stdout.flush()) {
                // A reader that stopped early (`| head`) wanted no more.
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
                result => result.map_err(|e| format!("stdout: {e}")),
            }
        }
    }
}

/// Refuses an `--output` that is the trace itself (by another name too, or as the standard
/// input: `report -o t.trace - < t.trace`): the report would replace the only copy of the
/// recording.
fn refuse_the_trace(file: &Path, trace: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let trace = if trace == Path::new(input::STDIN) { Path::new("/proc/self/fd/0") } else { trace };
    match (std::fs::metadata(file), std::fs::metadata(trace)) {
        (Ok(out), Ok(input)) if (out.dev(), out.ino()) == (input.dev(), input.ino()) => {
            Err(format!("{}: this is the trace being reported; give another --output", path_shown(file)))
        }
        _ => Ok(()),
    }
}
