//! Folded stacks (the input of flamegraph.pl, inferno and speedscope) and a flame graph of
//! them, weighted by estimated bytes allocated.

use std::collections::BTreeMap;
use std::io::{self, Write};

use inferno::flamegraph::color::{BasicPalette, Palette};
use inferno::flamegraph::{self, Options};

use super::Report;
use super::text::title;

/// One line per distinct stack, `root;...;leaf BYTES`, sorted (inferno requires it of
/// `from_lines`). Inlined calls are frames of their own; stacks whose names coincide merge.
pub fn lines(report: &Report<'_>) -> Vec<String> {
    let mut folded: BTreeMap<String, u64> = BTreeMap::new();
    for stack in report.profile.stacks.iter().filter(|s| s.allocated.bytes > 0) {
        let mut names: Vec<String> = Vec::new();
        for &raw in stack.frames.iter().rev() {
            // Root first: the function the code is in before the calls inlined into it.
            names.extend(report.symbols.location(raw).frames.iter().rev().map(|f| frame_name(&f.function)));
        }
        if names.is_empty() {
            names.push("[stack not recorded]".into());
        }
        let bytes: &mut u64 = folded.entry(names.join(";")).or_default();
        *bytes = bytes.saturating_add(stack.allocated.bytes);
    }
    folded.into_iter().map(|(stack, bytes)| format!("{stack} {bytes}")).collect()
}

/// A name that cannot break the line's syntax: `;` separates frames (Rust's `[u8; 4]` has
/// one) and a line ends the stack.
fn frame_name(function: &str) -> String {
    function.replace(';', ",").replace(['\n', '\r'], " ")
}

/// Writes the folded lines.
pub fn write_folded(report: &Report<'_>, out: &mut dyn Write) -> io::Result<()> {
    for line in lines(report) {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// Writes the flame graph (SVG).
///
/// # Errors
/// Those of `out`, and `InvalidData` when no stack allocated anything (the caller checks first).
pub fn write_flamegraph(report: &Report<'_>, out: &mut dyn Write) -> io::Result<()> {
    let lines = lines(report);
    let mut options = Options::default();
    options.title = format!("{}: estimated bytes allocated", title(&report.profile.header.command, 80));
    options.subtitle = Some(format!("mallocspy, pid {}, from sampled allocations", report.profile.header.pid));
    options.count_name = "bytes".into();
    options.colors = Palette::Basic(BasicPalette::Mem);
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cannot_split_frames_or_lines() {
        assert_eq!(frame_name("<[u8; 4] as core::fmt::Debug>::fmt"), "<[u8, 4] as core::fmt::Debug>::fmt");
        assert_eq!(frame_name("a\nb"), "a b");
    }
}
