//! `MALLOCSPY_OPTIONS`: colon-separated `key=value` pairs, read once at start-up.
//!
//! | key | values | default | meaning |
//! |---|---|---|---|
//! | `spy` | comma-separated: `leaks`, `count`, `guard`, `ticks`, `none` | `leaks` | built-in spies to register; several combine into one |
//! | `log_path` | a path; `%p` is the process id | stderr | where reports go (appended) |
//! | `report_format` | `text`, `json` | `text` | the leak report's format |
//! | `show_reachable` | `0`, `1` | `0` | list still-reachable records in the text report (JSON always has them) |
//! | `show_below_main` | `0`, `1` | `0` | keep the frames below `main` (the C library's start-up) in reported stacks |
//! | `show_mismatched_frees` | `0`, `1` | `1` | the guard's alloc-dealloc-mismatch findings (valgrind's `--show-mismatched-frees`) |
//! | `report_on_signal` | `0`, `1` | `1` | write the reports when `HUP`, `INT`, `PIPE`, `QUIT` or `TERM` ends the process by its default action |
//! | `suppressions` | a file of `leak:PATTERN` lines | none | leaks to leave out of the report |
//! | `exitcode` | 0-255 | none | exit with this status when definite or indirect leaks remain (LSan uses 23), or the guard found misuse; 0 leaves the status alone |
//! | `stack_depth` | 1-128 | 32 | frames recorded per allocation |
//! | `max_memory` | bytes, `k`/`m`/`g` suffixes | `4g`, at most a quarter of `ulimit -v`/`-d` | cap on mallocspy's own memory |
//! | `sampling` | `poisson`, `tick` | `poisson` | how `ticks` chooses allocations (see [`crate::trace::Sampling`]) |
//! | `sample_interval` | bytes, `k`/`m`/`g` suffixes | `102400` | mean bytes between ticks |
//! | `sample_seed` | a number | from the clock | seeds the poisson gaps (for reproducible runs) |
//! | `trace` | a path; `%p` is the process id | none | the trace file of `ticks` |
//! | `stats_interval_ms` | 1-60000 | 100 | least time between heap statistics events (taken at a sample) |
//! | `stop_threads` | `auto`, `ptrace`, `signal` | `auto` | how a leak check stops the other threads (see [`StopThreads`]) |
//!
//! With `MALLOCSPY_OPTIONS` unset the shim tracks leaks, as a preloaded LeakSanitizer does.
//! Any unknown key or bad value is reported in one line and the program runs unspied.

use core::fmt;

/// The built-in spies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpySet {
    /// `leaks`: live blocks with their stacks; the leak report at exit.
    pub leaks: bool,
    /// `count`: calls per entry point, bytes requested, failures; a JSON line at exit.
    pub count: bool,
    /// `guard`: header and trailer canaries, double and invalid frees.
    pub guard: bool,
    /// `ticks`: sampled allocations and heap statistics, for a trace file.
    pub ticks: bool,
}

impl SpySet {
    /// True when no spy is chosen.
    pub fn is_empty(&self) -> bool {
        *self == SpySet::default()
    }
}

/// The leak report's format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReportFormat {
    /// valgrind's layout.
    #[default]
    Text,
    /// One JSON object on one line.
    Json,
}

/// How a leak check stops the program's other threads while it scans their stacks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StopThreads {
    /// With ptrace, unless the calling thread runs under a seccomp filter installed with
    /// `no_new_privs` (a sandbox's, which may kill the process at the tracer's `clone`).
    #[default]
    Auto,
    /// With ptrace where the kernel allows it (a filter that refuses `clone` or `ptrace` with
    /// an error falls back to the signal; one that kills, kills).
    Ptrace,
    /// With a signal, whose handler also stops threads that ptrace cannot reach. A `sleep`,
    /// `poll` or `epoll_wait` it cuts short fails with EINTR, but in the exit report, which
    /// makes it again.
    Signal,
}

/// `max_memory` when none is given and no address-space limit asks for less.
pub const DEFAULT_MAX_MEMORY: usize = 4 << 30;

/// Parsed `MALLOCSPY_OPTIONS`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Built-in spies to register.
    pub spies: SpySet,
    /// Report destination (`%p` not yet expanded); stderr when `None`.
    pub log_path: Option<String>,
    /// The leak report's format.
    pub report_format: ReportFormat,
    /// List still-reachable records in the text report.
    pub show_reachable: bool,
    /// Keep the frames below `main` in reported stacks (valgrind's `--show-below-main`).
    pub show_below_main: bool,
    /// The guard reports a block given back by another family than the one that allocated it
    /// (valgrind's `--show-mismatched-frees`): not for a program whose own C++ operators,
    /// linked in with `-static-libstdc++`, serve blocks that a library's `delete` gives back,
    /// or the other way round (memcheck's false positives too).
    pub show_mismatched_frees: bool,
    /// Write the reports when a signal's default action ends the process.
    pub report_on_signal: bool,
    /// Suppressions file.
    pub suppressions: Option<String>,
    /// Exit status when definite or indirect leaks remain or the guard found misuse (never 0:
    /// `exitcode=0` leaves the program's status alone, as LeakSanitizer's does, rather than
    /// hide its failure).
    pub exitcode: Option<u8>,
    /// Frames recorded per allocation.
    pub stack_depth: usize,
    /// Cap on mallocspy's own memory, in bytes; `None`: [`DEFAULT_MAX_MEMORY`], or less under
    /// an address-space limit (see `preload::memory_limit`).
    pub max_memory: Option<usize>,
    /// How `ticks` samples.
    pub sampling: crate::trace::Sampling,
    /// Mean bytes between ticks.
    pub sample_interval: u64,
    /// Seed of the poisson gaps; `None`: from the clock.
    pub sample_seed: Option<u64>,
    /// The trace file (`%p` not yet expanded).
    pub trace: Option<String>,
    /// The process that took a `trace` path without `%p`, set by mallocspy in that process's
    /// environment for its descendants (see [`crate::trace`]'s writer); 0: none.
    pub trace_owner: u32,
    /// Period of the heap statistics events.
    pub stats_interval_ms: u64,
    /// How a leak check stops the other threads.
    pub stop_threads: StopThreads,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            spies: SpySet { leaks: true, ..SpySet::default() },
            log_path: None,
            report_format: ReportFormat::Text,
            show_reachable: false,
            show_below_main: false,
            show_mismatched_frees: true,
            report_on_signal: true,
            suppressions: None,
            exitcode: None,
            stack_depth: crate::spies::leaks::DEFAULT_DEPTH,
            max_memory: None,
            sampling: crate::trace::Sampling::Poisson,
            sample_interval: 102_400,
            sample_seed: None,
            trace: None,
            trace_owner: 0,
            stats_interval_ms: 100,
            stop_threads: StopThreads::Auto,
        }
    }
}

/// A malformed `MALLOCSPY_OPTIONS`; displays as one line.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OptionsError {
    /// A key this version does not know.
    UnknownKey(String),
    /// A known key with a value it cannot take.
    BadValue {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What the key accepts.
        expected: &'static str,
    },
    /// A pair without `=`.
    Malformed(String),
}

const KEYS: &str = "spy, log_path, report_format, show_reachable, show_below_main, show_mismatched_frees, \
                    report_on_signal, \
                    suppressions, exitcode, stack_depth, max_memory, sampling, sample_interval, sample_seed, \
                    trace, stats_interval_ms, stop_threads, trace_owner, record_run";

impl fmt::Display for OptionsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OptionsError::UnknownKey(k) => write!(f, "unknown key '{}' (known: {KEYS})", shown(k)),
            OptionsError::BadValue { key, value, expected } => {
                write!(f, "bad value '{}' for {key} (expected {expected})", shown(value))
            }
            OptionsError::Malformed(p) => write!(f, "'{}' is not key=value", shown(p)),
        }
    }
}

impl std::error::Error for OptionsError {}

/// Text from the user as an error line shows it: its first `LIMIT` characters and how many
/// more there are (a `MALLOCSPY_OPTIONS` of a megabyte made an error line as long; so did a
/// `log_path` of 70,000 characters, and a binary file given as suppressions), [`Escaped`].
pub(crate) struct Shown<'a, const LIMIT: usize>(&'a str);

/// An option's value (or a line of a file of them) as an error line shows it.
pub(crate) fn shown(text: &str) -> Shown<'_, 60> {
    Shown(text)
}

/// A path as an error line shows it: paths run longer than option values.
pub(crate) fn shown_path(text: &str) -> Shown<'_, 240> {
    Shown(text)
}

impl<const LIMIT: usize> fmt::Display for Shown<'_, LIMIT> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(LIMIT) {
            Some((cut, _)) => {
                write!(f, "{}... ({} more characters)", Escaped(&self.0[..cut]), self.0[cut..].chars().count())
            }
            None => write!(f, "{}", Escaped(self.0)),
        }
    }
}

/// Text from the user (an option, a path) in a line of mallocspy's, its control characters
/// escaped: a newline in it made the line two, an escape sequence reached the terminal.
pub(crate) struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if c.is_control() { write!(f, "{}", c.escape_default())? } else { write!(f, "{c}")? }
        }
        Ok(())
    }
}

/// The largest `sample_interval`, 2^62 bytes: the countdowns are signed 64-bit, and an
/// interval of 2^63 or more wrapped to a negative one (every allocation sampled).
pub const MAX_SAMPLE_INTERVAL: usize = 1 << 62;

/// What a `log_path` or `trace` value may be.
const PATH_TEMPLATE: &str = "a file path, with % only in %p (the process id) or %% (a %)";

/// Whether `value` is a path whose every `%` is one of `%p` or `%%`: another, a `%t` meant as a
/// time or `%n` as valgrind's sequence number, was taken as it stood and the files had names
/// nobody looked for (review helper 131).
pub fn is_path_template(value: &str) -> bool {
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        if c == '%' && !matches!(chars.next(), Some('p' | '%')) {
            return false;
        }
    }
    !value.is_empty()
}

/// A `log_path` or `trace` path for process `pid`: `%p` is replaced with the pid and `%%`
/// with `%`; any other `%` stays (the options refuse it).
pub fn expand_path(template: &str, pid: u32) -> String {
    let mut out = String::with_capacity(template.len() + 8);
    let mut chars = template.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('p') => out.push_str(&pid.to_string()),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Whether `template` names each process's own file (holds a `%p` that `%%` does not escape).
pub fn names_pid(template: &str) -> bool {
    expand_path(template, 1) != expand_path(template, 2)
}

/// Parses a byte count with an optional `k`, `m` or `g` suffix (powers of 1024).
pub fn parse_size(value: &str) -> Option<usize> {
    let v = value.trim().to_ascii_lowercase();
    let (digits, shift) = match v.as_bytes().last()? {
        b'k' => (&v[..v.len() - 1], 10),
        b'm' => (&v[..v.len() - 1], 20),
        b'g' => (&v[..v.len() - 1], 30),
        _ => (&v[..], 0),
    };
    digits.parse::<usize>().ok()?.checked_mul(1 << shift)
}

impl Options {
    /// Parses the text of `MALLOCSPY_OPTIONS`.
    pub fn parse(text: &str) -> Result<Options, OptionsError> {
        let mut o = Options::default();
        for pair in text.split(':').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| OptionsError::Malformed(pair.to_string()))?;
            let value = value.trim();
            let bad = |key: &'static str, expected: &'static str| OptionsError::BadValue {
                key,
                value: value.to_string(),
                expected,
            };
            match key.trim() {
                "spy" => o.spies = parse_spies(value)?,
                "log_path" if is_path_template(value) => o.log_path = Some(value.to_string()),
                "log_path" => return Err(bad("log_path", PATH_TEMPLATE)),
                "stop_threads" => {
                    o.stop_threads = match value {
                        "auto" => StopThreads::Auto,
                        "ptrace" => StopThreads::Ptrace,
                        "signal" => StopThreads::Signal,
                        _ => return Err(bad("stop_threads", "auto, ptrace or signal")),
                    };
                }
                "report_format" => {
                    o.report_format = match value {
                        "text" => ReportFormat::Text,
                        "json" => ReportFormat::Json,
                        _ => return Err(bad("report_format", "text or json")),
                    }
                }
                "show_reachable" => {
                    o.show_reachable = match value {
                        "0" => false,
                        "1" => true,
                        _ => return Err(bad("show_reachable", "0 or 1")),
                    }
                }
                "show_below_main" => {
                    o.show_below_main = match value {
                        "0" => false,
                        "1" => true,
                        _ => return Err(bad("show_below_main", "0 or 1")),
                    }
                }
                "show_mismatched_frees" => {
                    o.show_mismatched_frees = match value {
                        "0" => false,
                        "1" => true,
                        _ => return Err(bad("show_mismatched_frees", "0 or 1")),
                    }
                }
                "report_on_signal" => {
                    o.report_on_signal = match value {
                        "0" => false,
                        "1" => true,
                        _ => return Err(bad("report_on_signal", "0 or 1")),
                    }
                }
                "suppressions" if !value.is_empty() => o.suppressions = Some(value.to_string()),
                "suppressions" => return Err(bad("suppressions", "a file path")),
                "exitcode" => {
                    let code: u8 = value.parse().map_err(|_| bad("exitcode", "a number from 0 to 255"))?;
                    o.exitcode = (code != 0).then_some(code);
                }
                "stack_depth" => {
                    o.stack_depth = value
                        .parse()
                        .ok()
                        .filter(|d| (1..=crate::spies::leaks::MAX_DEPTH).contains(d))
                        .ok_or_else(|| bad("stack_depth", "a number from 1 to 128"))?
                }
                "max_memory" => {
                    o.max_memory = Some(
                        parse_size(value)
                            .filter(|&n| n >= 1 << 20)
                            .ok_or_else(|| bad("max_memory", "a size of at least 1m"))?,
                    )
                }
                "sampling" => {
                    o.sampling = match value {
                        "poisson" => crate::trace::Sampling::Poisson,
                        "tick" => crate::trace::Sampling::Tick,
                        _ => return Err(bad("sampling", "poisson or tick")),
                    }
                }
                "sample_interval" => {
                    o.sample_interval = parse_size(value)
                        .filter(|&n| (1..=MAX_SAMPLE_INTERVAL).contains(&n))
                        .ok_or_else(|| bad("sample_interval", "a size from 1 byte to 4 EiB"))?
                        as u64
                }
                "sample_seed" => o.sample_seed = Some(value.parse().map_err(|_| bad("sample_seed", "a number"))?),
                "trace" if is_path_template(value) => o.trace = Some(value.to_string()),
                "trace" => return Err(bad("trace", PATH_TEMPLATE)),
                "trace_owner" => o.trace_owner = value.parse().map_err(|_| bad("trace_owner", "a process id"))?,
                // Read by `mallocspy record` in the traces' headers, which keep the options.
                "record_run" => {
                    let (pid, start) = value.split_once('-').unwrap_or((value, "0"));
                    if pid.parse::<u32>().is_err() || start.parse::<u64>().is_err() {
                        return Err(bad("record_run", "a process id and its start (PID-NS)"));
                    }
                }
                "stats_interval_ms" => {
                    o.stats_interval_ms = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=60_000).contains(n))
                        .ok_or_else(|| bad("stats_interval_ms", "a number from 1 to 60000"))?
                }
                other => return Err(OptionsError::UnknownKey(other.to_string())),
            }
        }
        Ok(o)
    }
}

fn parse_spies(value: &str) -> Result<SpySet, OptionsError> {
    let mut set = SpySet::default();
    for name in value.split(',').map(str::trim) {
        match name {
            "leaks" => set.leaks = true,
            "count" => set.count = true,
            "guard" => set.guard = true,
            "ticks" => set.ticks = true,
            "none" => {}
            _ => {
                return Err(OptionsError::BadValue {
                    key: "spy",
                    value: value.to_string(),
                    expected: "a comma-separated list of leaks, count, guard, ticks, none",
                });
            }
        }
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_expand_pid_and_percent() {
        assert_eq!(expand_path("/tmp/r.%p.log", 42), "/tmp/r.42.log");
        assert_eq!(expand_path("100%%-%p-%x%", 7), "100%-7-%x%");
        assert!(names_pid("t.%p") && names_pid("%%%p"));
        assert!(!names_pid("t.trace") && !names_pid("t.%%p") && !names_pid("%"));
    }

    #[test]
    fn parses_every_key() {
        let o = Options::parse(
            "spy=count,guard:log_path=/tmp/x.%p:report_format=json:show_reachable=1:show_below_main=1:show_mismatched_frees=0:report_on_signal=0:suppressions=s.txt:exitcode=23:stack_depth=8:max_memory=64m",
        )
        .unwrap();
        assert!(!o.report_on_signal && Options::default().report_on_signal);
        assert_eq!(o.spies, SpySet { count: true, guard: true, ..SpySet::default() });
        assert_eq!(o.log_path.as_deref(), Some("/tmp/x.%p"));
        assert_eq!(o.report_format, ReportFormat::Json);
        assert!(o.show_reachable && !Options::default().show_below_main);
        assert!(o.show_below_main);
        assert!(!o.show_mismatched_frees && Options::default().show_mismatched_frees);
        assert_eq!(o.suppressions.as_deref(), Some("s.txt"));
        assert_eq!(o.exitcode, Some(23));
        // LeakSanitizer's `exitcode=0`: report, and leave the status alone.
        assert_eq!(Options::parse("exitcode=0").unwrap().exitcode, None);
        assert_eq!(o.stack_depth, 8);
        assert_eq!(o.max_memory, Some(64 << 20));
        assert_eq!(Options::parse("").unwrap(), Options::default());
        assert!(Options::default().spies.leaks, "leak tracking by default");
        assert!(Options::parse("spy=none").unwrap().spies.is_empty());
        let o = Options::parse(
            "spy=ticks:sampling=tick:sample_interval=512k:sample_seed=7:trace=t.%p:stats_interval_ms=20",
        )
        .unwrap();
        assert_eq!(o.spies, SpySet { ticks: true, ..SpySet::default() });
        assert_eq!(o.sampling, crate::trace::Sampling::Tick);
        assert_eq!((o.sample_interval, o.sample_seed, o.stats_interval_ms), (512 << 10, Some(7), 20));
        assert_eq!(o.trace.as_deref(), Some("t.%p"));
        assert_eq!((o.trace_owner, Options::parse("trace_owner=4242").unwrap().trace_owner), (0, 4242));
        assert_eq!(Options::default().sample_interval, 102_400);
        assert_eq!(Options::default().stop_threads, StopThreads::Auto);
        assert_eq!(Options::parse("stop_threads=signal").unwrap().stop_threads, StopThreads::Signal);
        assert_eq!(Options::parse("stop_threads=ptrace").unwrap().stop_threads, StopThreads::Ptrace);
        assert_eq!(
            Options::parse("stop_threads=gdb").unwrap_err().to_string(),
            "bad value 'gdb' for stop_threads (expected auto, ptrace or signal)"
        );
    }

    #[test]
    fn rejects_bad_input_with_one_line_messages() {
        let e = Options::parse("spy=count:colour=blue").unwrap_err();
        assert_eq!(e.to_string(), format!("unknown key 'colour' (known: {KEYS})"));
        let e = Options::parse("spy=count,bogus").unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad value 'count,bogus' for spy (expected a comma-separated list of leaks, count, guard, ticks, none)"
        );
        assert_eq!(Options::parse("spy").unwrap_err().to_string(), "'spy' is not key=value");
        // A long value is shown by its start: the line stays a line.
        let long = format!("spy={}", "é".repeat(100_000));
        let e = Options::parse(&long).unwrap_err().to_string();
        assert!(e.starts_with(&format!("bad value '{}... (99940 more characters)' for spy", "é".repeat(60))), "{e}");
        assert!(e.len() < 300, "{e}");
        // Control characters are escaped: a newline made the line two, an escape sequence
        // reached the terminal (review helper 79).
        let e = Options::parse("spy=\x1b[31mred\nlead").unwrap_err().to_string();
        assert!(e.starts_with("bad value '\\u{1b}[31mred\\nlead' for spy"), "{e}");
        assert_eq!(
            Options::parse("exitcode=300").unwrap_err().to_string(),
            "bad value '300' for exitcode (expected a number from 0 to 255)"
        );
        assert!(Options::parse("stack_depth=0").is_err());
        assert!(Options::parse("stack_depth=129").is_err());
        assert!(Options::parse("report_format=xml").is_err());
        assert!(Options::parse("max_memory=12q").is_err());
        assert!(Options::parse("log_path=").is_err());
        for bad in ["log_path=/tmp/r.%t.log", "trace=t.%", "trace=100%.trace", "log_path=%P"] {
            let e = Options::parse(bad).unwrap_err().to_string();
            assert!(e.ends_with("(expected a file path, with % only in %p (the process id) or %% (a %))"), "{e}");
        }
        assert_eq!(Options::parse("trace=100%%-%p.t").unwrap().trace.as_deref(), Some("100%%-%p.t"));
        assert!(Options::parse("sampling=random").is_err());
        assert!(Options::parse("sample_interval=0").is_err());
        assert!(Options::parse("sample_interval=18446744073709551615").is_err());
        assert!(Options::parse("sample_interval=9223372036854775808").is_err());
        assert_eq!(Options::parse("sample_interval=4611686018427387904").unwrap().sample_interval, 1 << 62);
        assert!(Options::parse("stats_interval_ms=0").is_err());
        assert!(Options::parse("trace=").is_err());
        assert!(Options::parse("trace_owner=-1").is_err());
        assert!(Options::parse("record_run=4242").is_ok() && Options::parse("record_run=x").is_err());
        assert!(Options::parse("record_run=4242-1765100000").is_ok() && Options::parse("record_run=1-x").is_err());
        assert_eq!(parse_size("4g"), Some(4 << 30));
        assert_eq!(parse_size("100k"), Some(102400));
    }
}
