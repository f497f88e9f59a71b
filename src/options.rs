//! `MALLOCSPY_OPTIONS`: colon-separated `key=value` pairs, read once at start-up.
//!
//! | key | values | default | meaning |
//! |---|---|---|---|
//! | `spy` | comma-separated: `count`, `guard`, `none` | none | built-in spies to register; several combine into one |
//! | `log_path` | a path; `%p` is the process id | stderr | where reports go (appended) |
//!
//! Any unknown key or bad value is reported in one line and the program runs unspied.

use core::fmt;

/// The built-in spies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpySet {
    /// `count`: calls per entry point, bytes requested, failures; a JSON line at exit.
    pub count: bool,
    /// `guard`: header and trailer canaries, double and invalid frees.
    pub guard: bool,
}

impl SpySet {
    /// True when no spy is chosen.
    pub fn is_empty(&self) -> bool {
        *self == SpySet::default()
    }
}

/// Parsed `MALLOCSPY_OPTIONS`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Built-in spies to register.
    pub spies: SpySet,
    /// Report destination (`%p` not yet expanded); stderr when `None`.
    pub log_path: Option<String>,
}

/// A malformed `MALLOCSPY_OPTIONS`; displays as one line.
#[derive(Clone, Debug, PartialEq, Eq)]
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

const KEYS: &str = "spy, log_path";

impl fmt::Display for OptionsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OptionsError::UnknownKey(k) => write!(f, "unknown key '{k}' (known: {KEYS})"),
            OptionsError::BadValue { key, value, expected } => {
                write!(f, "bad value '{value}' for {key} (expected {expected})")
            }
            OptionsError::Malformed(p) => write!(f, "'{p}' is not key=value"),
        }
    }
}

impl std::error::Error for OptionsError {}

impl Options {
    /// Parses the text of `MALLOCSPY_OPTIONS`.
    pub fn parse(text: &str) -> Result<Options, OptionsError> {
        let mut options = Options::default();
        for pair in text.split(':').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| OptionsError::Malformed(pair.to_string()))?;
            match key.trim() {
                "spy" => options.spies = parse_spies(value.trim())?,
                "log_path" => {
                    if value.is_empty() {
                        return Err(OptionsError::BadValue {
                            key: "log_path",
                            value: value.to_string(),
                            expected: "a file path",
                        });
                    }
                    options.log_path = Some(value.to_string());
                }
                other => return Err(OptionsError::UnknownKey(other.to_string())),
            }
        }
        Ok(options)
    }
}

fn parse_spies(value: &str) -> Result<SpySet, OptionsError> {
    let mut set = SpySet::default();
    for name in value.split(',').map(str::trim) {
        match name {
            "count" => set.count = true,
            "guard" => set.guard = true,
            "none" => {}
            _ => {
                return Err(OptionsError::BadValue {
                    key: "spy",
                    value: value.to_string(),
                    expected: "a comma-separated list of count, guard, none",
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
    fn parses_spies_and_log_path() {
        let o = Options::parse("spy=count,guard:log_path=/tmp/x.%p").unwrap();
        assert_eq!(o.spies, SpySet { count: true, guard: true });
        assert_eq!(o.log_path.as_deref(), Some("/tmp/x.%p"));
        assert_eq!(Options::parse("").unwrap(), Options::default());
        assert!(Options::parse("spy=none").unwrap().spies.is_empty());
    }

    #[test]
    fn rejects_bad_input_with_one_line_messages() {
        let e = Options::parse("spy=count:colour=blue").unwrap_err();
        assert_eq!(e.to_string(), "unknown key 'colour' (known: spy, log_path)");
        let e = Options::parse("spy=count,bogus").unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad value 'count,bogus' for spy (expected a comma-separated list of count, guard, none)"
        );
        assert_eq!(Options::parse("spy").unwrap_err().to_string(), "'spy' is not key=value");
        assert!(Options::parse("log_path=").is_err());
    }
}
