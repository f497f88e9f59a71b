//! The text report: what ran, the estimates, and tables of allocation sites (by bytes allocated,
//! live at the peak, left at the end).

use std::io::{self, Write};
use std::path::Path;

use mallocspy::trace::Sampling;

use super::Report;
use super::input::STDIN;
use super::profile::Figures;
use super::sites::{Site, top_live_at_end, top_live_at_peak};
use super::units;

/// Whether `c` is unfit to show: a control character (a terminal runs escape sequences), a
/// bidirectional control (an override or isolate reorders what follows it on the line, so
/// that a name reads as another) or a noncharacter (U+FFFE, U+FFFF and the like, which XML
/// forbids). Names in a trace come from the program and from files on disk, and a damaged
/// trace may hold anything.
pub fn unprintable(c: char) -> bool {
    let n = c as u32;
    let bidi = matches!(n, 0x061c | 0x200e | 0x200f | 0x202a..=0x202e | 0x2066..=0x2069);
    c.is_control() || bidi || (0xfdd0..=0xfdef).contains(&n) || n & 0xfffe == 0xfffe
}

/// `name` with each unprintable character replaced by U+FFFD.
pub fn printable(name: &str) -> String {
    name.chars().map(|c| if unprintable(c) { char::REPLACEMENT_CHARACTER } else { c }).collect()
}

/// A command line as a shell would take it back, on one line: arguments with spaces or quotes
/// in single quotes, with unprintable characters (a `python3 -c` script's newlines) in `$'...'`.
pub fn command_line(args: &[String]) -> String {
    if args.is_empty() {
        return "(unknown)".into();
    }
    args.iter().map(|a| shell_word(a)).collect::<Vec<_>>().join(" ")
}

/// One argument as a shell would take it back, on one line: bare when it is plain, in single
/// quotes when it has spaces or quotes, in `$'...'` when it has unprintable characters.
pub fn shell_word(a: &str) -> String {
    if !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c)) {
        return a.to_owned();
    }
    if !a.chars().any(unprintable) {
        return format!("'{}'", a.replace('\'', r"'\''"));
    }
    let mut q = String::from("$'");
    for c in a.chars() {
        match c {
            '\\' => q.push_str(r"\\"),
            '\'' => q.push_str(r"\'"),
            '\n' => q.push_str(r"\n"),
            '\t' => q.push_str(r"\t"),
            c if unprintable(c) && (c as u32) < 0x10000 => q.push_str(&format!("\\u{:04x}", c as u32)),
            c if unprintable(c) => q.push_str(&format!("\\U{:08x}", c as u32)),
            c => q.push(c),
        }
    }
    q.push('\'');
    q
}

/// A path as messages and the report's first line show it: as given, unless it holds
/// unprintable characters (a newline would split a one-line error in two), then as a shell
/// word; [`STDIN`] is the standard input.
pub fn path_shown(path: &Path) -> String {
    if path == Path::new(STDIN) {
        return "standard input".into();
    }
    let name = path.to_string_lossy();
    if name.chars().any(unprintable) { shell_word(&name) } else { name.into_owned() }
}

/// A path in a one-line message: in single quotes, or as a shell word (`$'...'`) when it holds
/// unprintable characters (a newline split the message in two: review helper 106).
pub fn quoted_path(path: &str) -> String {
    if path.chars().any(unprintable) { shell_word(path) } else { format!("'{path}'") }
}

/// The command line for a chart's title: at most `max` characters.
pub fn title(args: &[String], max: usize) -> String {
    let full = command_line(args);
    if full.chars().count() <= max {
        return full;
    }
    let mut short: String = full.chars().take(max.saturating_sub(1)).collect();
    short.push('…');
    short
}

/// How the trace sampled, in words.
pub fn sampling(report: &Report<'_>) -> String {
    let h = &report.profile.header;
    match h.sampling {
        Sampling::Poisson => format!("poisson, one sample per {} allocated on average", units::bytes(h.interval)),
        Sampling::Tick => format!("tick, one sample per {} allocated per thread and kind", units::bytes(h.interval)),
    }
}

/// Fewer samples than this and the text report says how far its estimates may be off.
const FEW_SAMPLES: u64 = 100;

/// What the estimates from `samples` are worth, when they are few: a short run's one sample
/// read as "100 KiB allocated" beside "3.82 KiB counted" (review helper 95). A poisson
/// estimate of a total is off by about 1/√n of it (one standard error).
fn few_samples(sampling: Sampling, samples: u64) -> Option<String> {
    if sampling != Sampling::Poisson || samples == 0 || samples >= FEW_SAMPLES {
        return None;
    }
    let error = 100.0 / (samples as f64).sqrt();
    Some(format!(
        "from {samples} sample{}: good to about ±{error:.0}% (a smaller --interval samples more)",
        if samples == 1 { "" } else { "s" }
    ))
}

/// Writes the text report.
pub fn write(report: &Report<'_>, out: &mut dyn Write) -> io::Result<()> {
    let p = report.profile;
    let h = &p.header;
    writeln!(out, "mallocspy allocation report: {}", path_shown(report.trace))?;
    writeln!(out)?;
    writeln!(out, "  program      {}", command_line(&h.command))?;
    writeln!(out, "  pid          {}", h.pid)?;
    writeln!(out, "  duration     {}", units::duration(p.duration_ns()))?;
    // Said in the report too (stderr had it alone): a report kept in a file outlives the warning.
    if p.end_ns.is_none() {
        let why = match p.truncated_at {
            Some(offset) => format!("the trace is cut at offset {offset}"),
            None if report.replaced_by_exec() => "an image replaced by exec: no end record".to_string(),
            None => "no end record: the program did not exit normally (killed, or replaced by exec), or still runs"
                .to_string(),
        };
        writeln!(out, "  incomplete   {why}; the figures go up to its last whole event")?;
    }
    if let (skipped @ 1.., Some(first)) = p.skipped_records {
        writeln!(
            out,
            "  skipped      {} record{} of unknown tags, the first at offset {first}: damage, or written by a later mallocspy",
            units::count(skipped),
            if skipped == 1 { "" } else { "s" }
        )?;
    }
    writeln!(out, "  sampling     {}", sampling(report))?;
    let inherited =
        p.inherited.map_or(String::new(), |i| format!(" and {} inherited", units::count(i.at_fork.samples)));
    writeln!(
        out,
        "  ticks        {} sample{}{inherited}, {} of them freed",
        units::count(p.allocated.samples),
        if p.allocated.samples == 1 { "" } else { "s" },
        units::count(p.frees)
    )?;
    writeln!(
        out,
        "  allocated    {} in {} objects (estimated)",
        units::bytes(p.allocated.bytes),
        units::objects(p.allocated.objects)
    )?;
    if let Some(line) = few_samples(h.sampling, p.allocated.samples) {
        writeln!(out, "               {line}")?;
    }
    if let Some((calls, bytes)) = p.counted() {
        // Without an end, the last statistics are not the program's last word.
        let exact = match (p.end_ns, p.heap_stats.iter().map(|s| s.time_ns).max()) {
            (None, Some(at)) => format!("exact at {}, its last heap statistics", units::duration(at)),
            _ => "exact".to_string(),
        };
        writeln!(out, "  counted      {} in {} allocation calls ({exact})", units::bytes(bytes), units::count(calls))?;
        if calls == 0 {
            // The program said why on its stderr, if another module's `malloc` came first. A
            // forked child that only `exec`s or leaves (a daemon's middle process) made none.
            writeln!(
                out,
                "               no allocation reached mallocspy: the process made none, or its malloc is \
                 another module's (an allocator preloaded before mallocspy, or its own)"
            )?;
        }
    } else {
        // The line left out said nothing of why (review helper 75).
        writeln!(
            out,
            "  counted      unknown: the trace has no heap statistics (the program ended or was replaced by \
             exec before taking any, or they were lost)"
        )?;
    }
    if p.allocated.samples > 0 || p.inherited.is_some() {
        writeln!(
            out,
            "  peak live    {} at {} (estimated)",
            units::bytes(p.peak.live_bytes),
            units::duration(p.peak.time_ns)
        )?;
        writeln!(out, "  live at end  {} (estimated)", units::bytes(p.live_at_end.bytes))?;
    }
    if let Some(inherited) = p.inherited {
        writeln!(
            out,
            "  inherited    {} in {} objects live at the fork, from pid {} (estimated; their stacks are in its trace)",
            units::bytes(inherited.at_fork.bytes),
            units::objects(inherited.at_fork.objects),
            inherited.parent
        )?;
    }
    if let Some((last, most)) = p.own_memory() {
        writeln!(
            out,
            "  mallocspy    {} of its own memory at the end, {} at most",
            units::bytes(last),
            units::bytes(most)
        )?;
    }
    if p.lost_events > 0 {
        // A lost free leaves its sample live in the replay for good: its live figures (the
        // peak, the end, each site's) grow, where those of what was allocated fall short.
        writeln!(
            out,
            "  lost         {} events dropped by the writer: the estimates of bytes allocated are low; \
             those of live bytes may be high (frees among the lost)",
            units::count(p.lost_events)
        )?;
        if let Some((peak, last)) = p.stats_live() {
            writeln!(
                out,
                "               the program's own live estimates, at its heap statistics: peak {} by {}, \
                 {} at the last",
                units::bytes(peak.live_bytes),
                units::duration(peak.time_ns),
                units::bytes(last)
            )?;
        }
    }
    writeln!(out)?;

    let sites = report.sites();
    let total = p.allocated.bytes;
    let top: Vec<&Site<'_>> = sites.iter().filter(|s| s.allocated.samples > 0).take(report.top).collect();
    writeln!(out, "Top allocation sites by estimated bytes allocated")?;
    table(out, &top, total, |s| &s.allocated)?;
    writeln!(out)?;

    let live = top_live_at_peak(&sites, report.top);
    if p.peak.live_bytes == 0 {
        writeln!(out, "Top allocation sites by live bytes at peak")?;
    } else {
        writeln!(
            out,
            "Top allocation sites by live bytes at peak ({} at {})",
            units::bytes(p.peak.live_bytes),
            units::duration(p.peak.time_ns)
        )?;
    }
    table(out, &live, p.peak.live_bytes, |s| &s.live_at_peak)?;

    // What the program left unfreed, by site (review helper 111: heaptrack lists its leaks;
    // this report gave only their total).
    if p.live_at_end.bytes > 0 {
        writeln!(out)?;
        writeln!(out, "Top allocation sites by live bytes at end ({})", units::bytes(p.live_at_end.bytes))?;
        table(out, &top_live_at_end(&sites, report.top), p.live_at_end.bytes, |s| &s.live_at_end)?;
    }
    Ok(())
}

/// A table of `sites` by the figures `of` each, as shares of `total` bytes.
fn table(
    out: &mut dyn Write,
    sites: &[&Site<'_>],
    total: u64,
    of: impl for<'s> Fn(&'s Site<'_>) -> &'s Figures,
) -> io::Result<()> {
    if sites.is_empty() {
        return writeln!(out, "  (none)");
    }
    writeln!(out, "  {:>4}  {:>10}  {:>6}  {:>14}  {:>9}  site", "rank", "bytes", "%", "est. objects", "samples")?;
    for (rank, site) in sites.iter().enumerate() {
        let figures = of(site);
        writeln!(
            out,
            "  {:>4}  {:>10}  {:>6}  {:>14}  {:>9}  {}",
            rank + 1,
            units::bytes(figures.bytes),
            units::percent(figures.bytes, total),
            units::objects(figures.objects),
            units::count(figures.samples),
            site.label
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_quote_what_a_shell_would_split() {
        let args = ["python3", "-c", "print('hi')", ""].map(String::from);
        assert_eq!(command_line(&args), r"python3 -c 'print('\''hi'\'')' ''");
        assert_eq!(command_line(&[]), "(unknown)");
        let script = ["python3", "-c", "import os\n\tprint('\\')\u{7}"].map(String::from);
        assert_eq!(command_line(&script), r"python3 -c $'import os\n\tprint(\'\\\')\u0007'");
        assert_eq!(title(&script, 13), "python3 -c $…");
        assert_eq!(title(&script[..1], 12), "python3");
        // XML forbids noncharacters: a title in an SVG must not carry them.
        let odd = ["a\u{fffe}", "\u{10ffff}", "\u{fdd0}b"].map(String::from);
        assert_eq!(command_line(&odd), r"$'a\ufffe' $'\U0010ffff' $'\ufdd0b'");
        assert_eq!(printable("lib\u{1b}[2J\u{ffff}.so"), "lib\u{fffd}[2J\u{fffd}.so");
    }
}
