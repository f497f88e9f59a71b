//! The timeline: a self-contained SVG chart of the live heap over time.
//!
//! The heap statistics events give, at each moment, the estimated live bytes per kind (small,
//! large, aligned: stacked areas, whose top is the estimated live heap) and the allocator's own
//! view (`mallinfo2`'s in-use arena bytes plus its mmapped blocks: a dashed line), so that the
//! sampled estimate can be read against what the allocator holds. Between them, the live heap
//! replayed from the ticks and frees is drawn too (its envelope: see
//! [`super::envelope`]): a spike shorter than `stats_interval_ms` showed nowhere, and a heap
//! freed just after one statistics event sloped down to the next. The peak marked is the
//! report's (the replay's highest). A trace without heap statistics (cut before the first) is
//! drawn from the replay alone, without the allocator's line.

use std::fmt::Write as _;
use std::io::{self, Write};

use mallocspy::trace::Kind;

use super::Report;
use super::profile::Profile;
use super::text;
use super::units;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 540.0;
/// The plot area.
const LEFT: f64 = 90.0;
const RIGHT: f64 = WIDTH - 30.0;
const TOP: f64 = 96.0;
const BOTTOM: f64 = HEIGHT - 50.0;

/// Area colors of small, large and aligned.
const KIND_COLORS: [&str; 3] = ["#4e79a7", "#f28e2b", "#59a14f"];
const ALLOCATOR_COLOR: &str = "#b6403a";

/// Text for SVG: the program's name may hold anything.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if text::unprintable(c) => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// The smallest of 1, 2 and 5 times a power of ten that is at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * power).find(|&s| s >= raw * (1.0 - 1e-9)).unwrap_or(10.0 * power)
}

/// Decimals that show a multiple of `step` exactly.
fn decimals(step: f64) -> usize {
    if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize }
}

/// An axis: `ticks` steps of `step` from zero to `max`, in a unit.
struct Axis {
    step: f64,
    max: f64,
    /// Bytes (or seconds) per axis unit.
    unit: f64,
    unit_name: &'static str,
}

impl Axis {
    /// About `ticks` gridlines over `0..=data_max` (in the unit's measure).
    fn new(data_max: f64, ticks: f64, unit: f64, unit_name: &'static str) -> Axis {
        let in_units = data_max / unit;
        let step = nice_step(in_units / ticks);
        let max = ((in_units / step).ceil() * step).max(step);
        Axis { step, max, unit, unit_name }
    }

    /// For byte values: the largest binary unit the maximum reaches.
    fn bytes(max_bytes: u64) -> Axis {
        const UNITS: [(&str, f64); 5] =
            [("B", 1.0), ("KiB", 1024.0), ("MiB", 1048576.0), ("GiB", 1073741824.0), ("TiB", 1099511627776.0)];
        let max = max_bytes.max(1024) as f64;
        let (name, unit) = UNITS.into_iter().rev().find(|&(_, u)| max >= u).unwrap_or(UNITS[0]);
        Axis::new(max, 5.0, unit, name)
    }

    fn values(&self) -> impl Iterator<Item = f64> + '_ {
        let n = (self.max / self.step).round() as usize;
        (0..=n).map(move |i| i as f64 * self.step)
    }

    fn label(&self, v: f64) -> String {
        let d = decimals(self.step);
        if self.unit_name.is_empty() { format!("{v:.d$}") } else { format!("{v:.d$} {}", self.unit_name) }
    }

    /// Where `measure` (bytes or seconds) falls between 0 and 1.
    fn fraction(&self, measure: f64) -> f64 {
        measure / self.unit / self.max
    }
}

/// One moment of the chart.
struct Point {
    time_ns: u64,
    seconds: f64,
    kinds: [u64; 3],
    /// The allocator's in-use and mmapped bytes, where known.
    allocator: Option<u64>,
}

/// A damaged trace's figures may reach 2^64 together: they stop there, not wrap to a small one.
fn saturating_sum(values: &[u64]) -> u64 {
    values.iter().fold(0, |sum, &v| sum.saturating_add(v))
}

impl Point {
    fn total(&self) -> u64 {
        saturating_sum(&self.kinds)
    }
}

fn points(profile: &Profile) -> Vec<Point> {
    let point = |time_ns: u64, kinds, allocator| Point { time_ns, seconds: time_ns as f64 / 1e9, kinds, allocator };
    // With events lost, the replay keeps the samples whose frees were lost live for good:
    // the heap statistics alone, the program's own estimates, draw the chart.
    let replay =
        if profile.lost_events > 0 && !profile.heap_stats.is_empty() { &[][..] } else { &profile.replayed_live[..] };
    let replayed = replay.iter().map(|&(time_ns, kinds)| point(time_ns, kinds, None));
    let mut points: Vec<Point> = if profile.heap_stats.is_empty() {
        replayed.collect()
    } else {
        let stats = &profile.heap_stats;
        // All zero: not glibc's view (jemalloc or tcmalloc serves the calls, and glibc's
        // `mallinfo2` describes an empty heap), or never taken. A flat line at zero beside
        // megabytes of live heap would say the allocator held nothing.
        let known = stats.iter().any(|s| s.arena_bytes | s.mmapped_bytes | s.in_use_bytes != 0);
        stats
            .iter()
            .map(|s| {
                let allocator = known.then(|| s.in_use_bytes.saturating_add(s.mmapped_bytes));
                point(s.time_ns, Kind::ALL.map(|k| s.kinds[k as usize].live_bytes), allocator)
            })
            .chain(replayed)
            .collect()
    };
    // Events from several threads may arrive slightly out of order.
    points.sort_by_key(|p| p.time_ns);
    points
}

/// Keeps at most a few points per pixel column (`column` of each, in time order): the first
/// and last of each, and those with its lowest and highest top and allocator line, so that the
/// chart's envelope, and with it the peak, is drawn as before. A run of a few minutes has
/// millions of points: a 45 MB trace's chart was a 234 MB SVG for 840 columns.
fn thin(points: Vec<Point>, column: impl Fn(&Point) -> i64) -> Vec<Point> {
    let mut keep = vec![false; points.len()];
    let mut start = 0;
    while start < points.len() {
        let c = column(&points[start]);
        let end = start + points[start..].iter().take_while(|p| column(p) == c).count();
        let run = start..end;
        let top = |i: &usize| points[*i].total();
        let allocator = |i: &usize| points[*i].allocator.unwrap_or(0);
        let extremes = [
            run.clone().min_by_key(top),
            run.clone().max_by_key(top),
            run.clone().min_by_key(allocator),
            run.clone().max_by_key(allocator),
        ];
        for i in [Some(start), Some(end - 1)].into_iter().chain(extremes).flatten() {
            keep[i] = true;
        }
        start = end;
    }
    points.into_iter().zip(keep).filter_map(|(p, kept)| kept.then_some(p)).collect()
}

/// The points with the allocator's view, in runs to be joined by a line: the statistics come
/// every `stats_interval_ms` only while the program allocates, and across a longer gap a line
/// would draw what no event saw (a program that allocated 30 MB in a few milliseconds after a
/// quiet half second was drawn growing steadily to its exit). A run of one point is a dot.
/// Without the interval (0: a damaged header), all are one run.
fn allocator_runs(points: &[Point], stats_interval_ms: u64) -> Vec<Vec<&Point>> {
    let longest_gap_ns = stats_interval_ms.saturating_mul(2_000_000);
    let mut runs: Vec<Vec<&Point>> = Vec::new();
    let mut previous_ns = None;
    for point in points.iter().filter(|p| p.allocator.is_some()) {
        match (runs.last_mut(), previous_ns) {
            (Some(run), Some(t)) if longest_gap_ns == 0 || point.time_ns.saturating_sub(t) <= longest_gap_ns => {
                run.push(point)
            }
            _ => runs.push(vec![point]),
        }
        previous_ns = Some(point.time_ns);
    }
    runs
}

/// The stretches of a trace with events lost where the chart cannot know the heap, `(from,
/// to)` in nanoseconds: each gap longer than two `stats_interval_ms` between two heap
/// statistics events (or the run's start or end) that meets the time before a `Lost` record
/// in which its drops happened. The writer stamps the record when it drains the queue, after
/// the drops it counts and after the events it drained, some of which may have come after
/// the drops; it drains at least every `stats_interval_ms`, so the drops lie within two of
/// them before the stamp (review helper 112). Undrawn, such a gap read as a heap that was not
/// there (a run's first 0.7 s left blank, review helper 110) or as one that grew steadily
/// across it. A damaged header's interval of 0 makes every gap with a stamp in it one.
fn unknown_stretches(profile: &Profile) -> Vec<(u64, u64)> {
    if profile.lost_events == 0 || profile.heap_stats.is_empty() {
        return Vec::new();
    }
    let two_intervals_ns = profile.header.stats_interval_ms.saturating_mul(2_000_000);
    let mut lost = profile.lost_at_ns.clone();
    lost.sort_unstable();
    let mut times: Vec<u64> = profile.heap_stats.iter().map(|s| s.time_ns).collect();
    times.sort_unstable();
    let bounds = std::iter::once(0).chain(times).chain(std::iter::once(profile.duration_ns()));
    let mut stretches = Vec::new();
    let mut from = None;
    for to in bounds {
        if let Some(from) = from
            && to.saturating_sub(from) > two_intervals_ns
            // The first stamp after the gap's start, if the drops before it may lie in the gap.
            && lost.get(lost.partition_point(|&t| t <= from)).is_some_and(|&t| t - two_intervals_ns.min(t) <= to)
        {
            stretches.push((from, to));
        }
        from = Some(to);
    }
    stretches
}

/// Writes the chart.
///
/// # Errors
/// Those of `out`, and `InvalidData` when the trace has neither heap statistics nor ticks
/// (the caller checks first).
pub fn write(report: &Report<'_>, out: &mut dyn Write) -> io::Result<()> {
    let p = report.profile;
    let points = points(p);
    let Some(top) = points.iter().reduce(|best, x| if x.total() > best.total() { x } else { best }) else {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "no heap statistics events or ticks"));
    };
    // The report's peak, which the replay's points hold; without ticks, or with events lost,
    // the highest point, or the program's own peak if that came between two events (the line
    // joins the events, below it): marked at the first event that saw it.
    let replayed_peak = p.peak.live_bytes > 0 && (p.lost_events == 0 || p.heap_stats.is_empty());
    let (peak_ns, peak_total, between) = match p.stats_live() {
        _ if replayed_peak => (p.peak.time_ns, p.peak.live_bytes, false),
        Some((peak, _)) if peak.live_bytes > top.total() => (peak.time_ns, peak.live_bytes, true),
        _ => (top.time_ns, top.total(), false),
    };
    let allocator_known = points.iter().any(|p| p.allocator.is_some());
    let unknown = unknown_stretches(p);
    let last_seconds = points.last().map_or(0.0, |p| p.seconds);
    let time = Axis::new(last_seconds.max(p.duration_ns() as f64 / 1e9).max(1e-3), 8.0, 1.0, "");
    let bytes_max = points.iter().map(|p| p.total().max(p.allocator.unwrap_or(0))).max().unwrap_or(0).max(peak_total);
    let space = Axis::bytes(bytes_max);
    let x = |seconds: f64| LEFT + time.fraction(seconds) * (RIGHT - LEFT);
    let y = |bytes: u64| BOTTOM - space.fraction(bytes as f64) * (BOTTOM - TOP);
    let peak_seconds = peak_ns as f64 / 1e9;
    // A kind with no live bytes ever has no area, and no entry in the legend: its outline,
    // drawn at zero height along the top of the kinds below it, painted a malloc-only
    // program's heap in the colour of `aligned` (review helper 68).
    let present: Vec<bool> = (0..KIND_COLORS.len()).map(|k| points.iter().any(|p| p.kinds[k] > 0)).collect();
    let present = |k: usize| present[k] || !present.contains(&true);
    let points = thin(points, |p| x(p.seconds).floor() as i64);

    let mut svg = String::new();
    let title = format!("{}: live heap over time", text::title(&p.header.command, 80));
    // Writing to a String cannot fail.
    let _ = writeln!(svg, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Verdana, sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, "<title>{}</title>", escape(&title));
    let _ = writeln!(svg, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="28" font-size="17" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        escape(&title)
    );
    let subtitle = if allocator_known {
        "dashed: the allocator's in-use and mmapped bytes"
    } else {
        "replayed from the ticks and frees: the trace has no heap statistics events"
    };
    let _ = writeln!(
        svg,
        r##"<text x="{}" y="48" fill="#555555" text-anchor="middle">estimated from sampled allocations by mallocspy (pid {}); {subtitle}</text>"##,
        WIDTH / 2.0,
        p.header.pid
    );

    // Gridlines and their labels.
    let _ = writeln!(svg, r##"<g stroke="#dddddd" stroke-width="1">"##);
    for v in space.values() {
        let gy = BOTTOM - v / space.max * (BOTTOM - TOP);
        let _ = writeln!(svg, r#"<line x1="{LEFT}" y1="{gy:.1}" x2="{RIGHT}" y2="{gy:.1}"/>"#);
    }
    for v in time.values() {
        let gx = LEFT + v / time.max * (RIGHT - LEFT);
        let _ = writeln!(svg, r#"<line x1="{gx:.1}" y1="{TOP}" x2="{gx:.1}" y2="{BOTTOM}"/>"#);
    }
    let _ = writeln!(svg, "</g>");
    for v in space.values() {
        let gy = BOTTOM - v / space.max * (BOTTOM - TOP);
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            gy + 4.0,
            space.label(v)
        );
    }
    for v in time.values() {
        let gx = LEFT + v / time.max * (RIGHT - LEFT);
        let _ =
            writeln!(svg, r#"<text x="{gx:.1}" y="{}" text-anchor="middle">{}</text>"#, BOTTOM + 18.0, time.label(v));
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">time (s)</text>"#,
        (LEFT + RIGHT) / 2.0,
        BOTTOM + 40.0
    );

    // The kinds, stacked: each area between the running sums below and with it.
    for (k, color) in KIND_COLORS.iter().enumerate().filter(|&(k, _)| present(k)) {
        let below = |p: &Point| saturating_sum(&p.kinds[..k]);
        let with = |p: &Point| saturating_sum(&p.kinds[..=k]);
        let mut d = String::new();
        for (i, p) in points.iter().enumerate() {
            let _ = write!(d, "{}{:.1},{:.1} ", if i == 0 { "M" } else { "L" }, x(p.seconds), y(with(p)));
        }
        for p in points.iter().rev() {
            let _ = write!(d, "L{:.1},{:.1} ", x(p.seconds), y(below(p)));
        }
        let _ = writeln!(
            svg,
            r#"<path d="{}Z" fill="{}" fill-opacity="0.75" stroke="{}" stroke-width="1"><title>{}</title></path>"#,
            d,
            color,
            color,
            Kind::ALL[k].name()
        );
    }
    if allocator_known {
        for run in allocator_runs(&points, p.header.stats_interval_ms) {
            let at = |point: &Point| (x(point.seconds), y(point.allocator.unwrap_or(0)));
            if let [single] = run.as_slice() {
                let (cx, cy) = at(single);
                let _ = writeln!(
                    svg,
                    r#"<circle class="allocator" cx="{cx:.1}" cy="{cy:.1}" r="2.5" fill="{ALLOCATOR_COLOR}"/>"#
                );
            } else {
                let line: Vec<String> = run.iter().map(|p| at(p)).map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
                let _ = writeln!(
                    svg,
                    r#"<polyline class="allocator" points="{}" fill="none" stroke="{ALLOCATOR_COLOR}" stroke-width="1.5" stroke-dasharray="6 4"/>"#,
                    line.join(" ")
                );
            }
        }
    }
    if !unknown.is_empty() {
        let _ = writeln!(
            svg,
            r##"<defs><pattern id="lost" width="8" height="8" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="3" height="8" fill="#777777" fill-opacity="0.45"/></pattern></defs>"##
        );
        for &(from, to) in &unknown {
            let (x0, x1) = (x(from as f64 / 1e9), x(to as f64 / 1e9));
            let _ = writeln!(
                svg,
                r##"<rect class="lost" x="{x0:.1}" y="{TOP}" width="{:.1}" height="{}" fill="url(#lost)" stroke="none"><title>events lost: the heap from {} to {} is unknown</title></rect>"##,
                (x1 - x0).max(1.0),
                BOTTOM - TOP,
                if from == 0 { "the start".to_owned() } else { units::duration(from) },
                units::duration(to)
            );
        }
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{TOP}" width="{}" height="{}" fill="none" stroke="#888888"/>"##,
        RIGHT - LEFT,
        BOTTOM - TOP
    );

    // The legend, in one row above the plot; each entry as wide as its text (about 7 pixels a
    // character at this size).
    let mut lx = LEFT;
    let ly = TOP - 18.0;
    for (kind, color) in Kind::ALL.iter().zip(KIND_COLORS).filter(|&(&kind, _)| present(kind as usize)) {
        let text = format!("{} (estimated)", kind.name());
        let _ = writeln!(
            svg,
            r#"<rect x="{lx}" y="{}" width="14" height="10" fill="{}" fill-opacity="0.75"/><text x="{}" y="{ly}">{text}</text>"#,
            ly - 9.0,
            color,
            lx + 19.0,
        );
        lx += 19.0 + 7.0 * text.len() as f64 + 24.0;
    }
    if allocator_known {
        let _ = writeln!(
            svg,
            r#"<line x1="{lx}" y1="{}" x2="{}" y2="{}" stroke="{ALLOCATOR_COLOR}" stroke-width="1.5" stroke-dasharray="6 4"/><text x="{}" y="{ly}">allocator: in use + mmapped</text>"#,
            ly - 4.0,
            lx + 14.0,
            ly - 4.0,
            lx + 19.0
        );
        lx += 19.0 + 7.0 * "allocator: in use + mmapped".len() as f64 + 24.0;
    }
    if !unknown.is_empty() {
        let _ = writeln!(
            svg,
            r##"<rect x="{lx}" y="{}" width="14" height="10" fill="url(#lost)" stroke="#777777" stroke-width="0.5"/><text x="{}" y="{ly}">events lost</text>"##,
            ly - 9.0,
            lx + 19.0,
        );
    }

    // The peak: a dot on the top of the stack, and its label beside it, kept inside the plot.
    let (px, py) = (x(peak_seconds), y(peak_total));
    let when = if between { "by" } else { "at" };
    let label = format!("peak {} {when} {}", units::bytes(peak_total), units::duration(peak_ns));
    let (tx, anchor) = if px > RIGHT - 240.0 { (px - 8.0, "end") } else { (px + 8.0, "start") };
    let ty = if py < TOP + 20.0 { py + 18.0 } else { py - 8.0 };
    let _ = writeln!(
        svg,
        r##"<circle cx="{px:.1}" cy="{py:.1}" r="4.5" fill="#d62728" stroke="#ffffff" stroke-width="1.5"/>"##
    );
    let _ = writeln!(svg, r#"<text x="{tx:.1}" y="{ty:.1}" text-anchor="{anchor}" font-weight="bold">{label}</text>"#);
    let _ = writeln!(svg, "</svg>");
    out.write_all(svg.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_one_two_or_five_times_a_power_of_ten() {
        assert_eq!(nice_step(0.13), 0.2);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(5.0), 5.0);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(nice_step(0.0), 1.0);
        assert_eq!(decimals(0.2), 1);
        assert_eq!(decimals(0.05), 2);
        assert_eq!(decimals(5.0), 0);
    }

    #[test]
    fn byte_axes_take_the_unit_of_their_maximum() {
        let a = Axis::bytes(12 * 1024 * 1024 + 5);
        assert_eq!(a.unit_name, "MiB");
        assert_eq!((a.step, a.max), (5.0, 15.0));
        assert_eq!(a.values().map(|v| a.label(v)).collect::<Vec<_>>(), ["0 MiB", "5 MiB", "10 MiB", "15 MiB"]);
        let small = Axis::bytes(100);
        assert_eq!((small.unit_name, small.max), ("KiB", 1.0));
        assert_eq!(small.label(0.2), "0.2 KiB");
    }

    #[test]
    fn a_long_run_is_thinned_to_its_envelope_per_column() {
        // A saw of a million points over 100 columns: 10,000 to a column.
        let points: Vec<Point> = (0..1_000_000u64)
            .map(|i| Point {
                time_ns: i,
                seconds: i as f64,
                kinds: [i % 977 * 1000, i % 13, 0],
                allocator: Some(i % 501),
            })
            .collect();
        let column = |p: &Point| (p.time_ns / 10_000) as i64;
        let highest: Vec<u64> = points.chunks(10_000).map(|c| c.iter().map(Point::total).max().unwrap()).collect();
        let lowest: Vec<u64> = points.chunks(10_000).map(|c| c.iter().map(Point::total).min().unwrap()).collect();
        let thinned = thin(points, column);
        assert!(thinned.len() <= 6 * 100, "{} points", thinned.len());
        assert!(thinned.windows(2).all(|w| w[0].time_ns < w[1].time_ns), "in time order");
        for (c, (high, low)) in highest.iter().zip(&lowest).enumerate() {
            let kept: Vec<&Point> = thinned.iter().filter(|p| column(p) == c as i64).collect();
            assert_eq!(kept.iter().map(|p| p.total()).max(), Some(*high), "column {c}");
            assert_eq!(kept.iter().map(|p| p.total()).min(), Some(*low), "column {c}");
            assert_eq!(kept.iter().map(|p| p.allocator.unwrap()).max(), Some(500), "column {c}");
        }
    }

    #[test]
    fn svg_text_is_escaped() {
        assert_eq!(escape("a<b & 'c'\n"), "a&lt;b &amp; &apos;c&apos; ");
    }
}
