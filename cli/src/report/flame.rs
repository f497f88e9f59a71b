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
    folded(report).into_iter().map(|(stack, bytes)| format!("{stack} {bytes}")).collect()
}

/// Each distinct stack's names, root first and joined by `;`, and its bytes.
fn folded(report: &Report<'_>) -> BTreeMap<String, u64> {
    let mut folded: BTreeMap<String, u64> = BTreeMap::new();
    for stack in report.profile.stacks.iter().filter(|s| s.allocated.bytes > 0) {
        let mut names: Vec<String> = Vec::new();
        for &raw in stack.frames.iter().rev() {
            // Root first: the function the code is in before the calls inlined into it.
            names.extend(report.symbols.location(raw).frames.iter().rev().map(|f| frame_name(&f.function)));
        }
        if names.is_empty() {
            names.push(super::profile::NOT_RECORDED.into());
        } else if report.profile.is_cut(stack) {
            names.insert(0, super::profile::CUT.into());
        }
        let bytes: &mut u64 = folded.entry(names.join(";")).or_default();
        *bytes = bytes.saturating_add(stack.allocated.bytes);
    }
    folded
}

/// What the counts of a flame graph are divided by so that inferno, which adds them up in a
/// `usize`, cannot overflow: 1 unless they sum to 2^62 or more, which only a damaged trace's
/// estimates do (a sum that wrapped drew bars of negative width, or none at all).
fn divisor(counts: impl Iterator<Item = u64>) -> u64 {
    let total: u128 = counts.map(u128::from).sum();
    u64::try_from(total >> 62).map_or(u64::MAX, |d| d.saturating_add(1))
}

/// A name that cannot break the line's syntax: `;` separates frames (Rust's `[u8; 4]` has
/// one), a line ends the stack, and a name ending in a number after a space would be read as a
/// count (flamegraph.pl and inferno take a line's last two numbers for a differential flame
/// graph's two counts: review helper 106): that space is a no-break space.
fn frame_name(function: &str) -> String {
    let name = function.replace(';', ",").replace(['\n', '\r'], " ");
    match name.rsplit_once(' ') {
        Some((head, number)) if !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit() || b == b'.') => {
            format!("{head}\u{a0}{number}")
        }
        _ => name,
    }
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
    let folded = folded(report);
    let divisor = divisor(folded.values().copied());
    let lines: Vec<String> =
        folded.into_iter().map(|(stack, bytes)| format!("{stack} {}", (bytes / divisor).max(1))).collect();
    let mut options = Options::default();
    options.title = format!("{}: estimated bytes allocated", title(&report.profile.header.command, 80));
    let scaled = if divisor > 1 { format!(", counts divided by {divisor}") } else { String::new() };
    options.subtitle = Some(format!("mallocspy, pid {}, from sampled allocations{scaled}", report.profile.header.pid));
    options.count_name = "bytes".into();
    options.colors = Palette::Basic(BasicPalette::Mem);
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_that_would_overflow_a_usize_are_divided() {
        assert_eq!(divisor([3, 5].into_iter()), 1);
        assert_eq!(divisor([(1 << 62) - 1].into_iter()), 1);
        assert_eq!(divisor([1 << 63, 1 << 63].into_iter()), 5);
        assert_eq!(divisor([u64::MAX; 4].into_iter()), 16);
    }

    #[test]
    fn names_cannot_split_frames_or_lines() {
        assert_eq!(frame_name("<[u8; 4] as core::fmt::Debug>::fmt"), "<[u8, 4] as core::fmt::Debug>::fmt");
        assert_eq!(frame_name("a\nb"), "a b");
        assert_eq!(frame_name("sp ace 12345 9999"), "sp ace 12345\u{a0}9999");
        assert_eq!(frame_name("operator new(unsigned long)"), "operator new(unsigned long)");
    }
}
