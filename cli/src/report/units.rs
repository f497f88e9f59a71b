//! Numbers for people: byte sizes in binary units, durations, counts with separators.

/// `bytes` in the largest binary unit it reaches, to three significant digits: `512 B`,
/// `1.50 KiB`, `12.3 MiB`, `123 GiB`.
pub fn bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    // 1023.95 KiB would print as "1024 KiB": move up a unit before rounding does.
    while value >= 999.95 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{} {}", three_digits(value), UNITS[unit])
}

/// Nanoseconds as `20 ns`, `5.00 µs`, `850 ms`, `1.42 s`, `125 s`.
pub fn duration(ns: u64) -> String {
    // Three digits round 999.5 up to 1000: from there on, the next unit reads better.
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..999_500 => format!("{} µs", three_digits(ns as f64 / 1e3)),
        999_500..999_500_000 => format!("{} ms", three_digits(ns as f64 / 1e6)),
        _ => format!("{} s", three_digits(ns as f64 / 1e9)),
    }
}

/// `value` with three significant digits (at least the integer part).
fn three_digits(value: f64) -> String {
    if value < 9.995 {
        format!("{value:.2}")
    } else if value < 99.95 {
        format!("{value:.1}")
    } else {
        format!("{value:.0}")
    }
}

/// `1234567` as `1,234,567`, as the leak report prints counts.
pub fn count(n: u64) -> String {
    mallocspy::leaks::grouped(n)
}

/// An estimated number of objects, rounded; sums of `weight / size` carry rounding residue
/// (and tiny negatives after subtraction), which must not print as `-0`.
pub fn objects(estimate: f64) -> String {
    count(rounded(estimate))
}

/// An estimate rounded to a whole number, never below zero.
pub fn rounded(estimate: f64) -> u64 {
    estimate.max(0.0).round() as u64
}

/// `part` as a percentage of `whole`, one decimal (`0.0%` when `whole` is zero).
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 { "0.0%".into() } else { format!("{:.1}%", part as f64 * 100.0 / whole as f64) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_take_three_significant_digits() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.00 KiB");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(12_897_485), "12.3 MiB");
        assert_eq!(bytes(1024 * 1024 - 1), "1.00 MiB");
        assert_eq!(bytes(300 * 1024 * 1024 * 1024), "300 GiB");
        assert_eq!(bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn durations_counts_and_percentages() {
        assert_eq!(duration(1_420_000_000), "1.42 s");
        assert_eq!(duration(5_000_000), "5.00 ms");
        assert_eq!(duration(999_900_000), "1.00 s");
        assert_eq!(duration(999_400_000), "999 ms");
        assert_eq!(duration(20), "20 ns");
        assert_eq!(duration(1_500), "1.50 µs");
        assert_eq!(duration(25_000_000), "25.0 ms");
        assert_eq!(count(0), "0");
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(count(100_000), "100,000");
        assert_eq!(objects(-1e-12), "0");
        assert_eq!(objects(2.5), "3");
        assert_eq!(percent(1, 3), "33.3%");
        assert_eq!(percent(1, 0), "0.0%");
    }
}
