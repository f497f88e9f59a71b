//! Suppressions in LeakSanitizer's syntax: one `leak:PATTERN` per line, `#` comments.
//!
//! A pattern matches a frame when it matches the frame's function name, source file or
//! module path: as a substring, with `*` matching any run of characters, `^` anchoring at the
//! start and `$` at the end (as LSan's `TemplateMatch`). A leak is suppressed when any frame
//! of its allocation stack matches any pattern.

use std::fmt;

use crate::options::shown;

/// A set of `leak:` patterns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Suppressions {
    patterns: Vec<String>,
}

/// A malformed suppressions file, as one line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuppressionError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for SuppressionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

impl Suppressions {
    /// The text of the suppressions file at `path`, bytes that are not UTF-8 read as U+FFFD,
    /// as the names they are matched against are (LeakSanitizer reads such files too).
    pub fn read(path: impl AsRef<std::path::Path>) -> std::io::Result<String> {
        std::fs::read(path).map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Parses the text of a suppressions file.
    pub fn parse(text: &str) -> Result<Self, SuppressionError> {
        let mut patterns = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match line.split_once(':') {
                Some(("leak", pattern)) if !pattern.trim().is_empty() => patterns.push(pattern.trim().to_string()),
                Some(("leak", _)) => return Err(SuppressionError { line: i + 1, message: "empty pattern".into() }),
                Some((kind, _)) => {
                    return Err(SuppressionError {
                        line: i + 1,
                        message: format!("unknown kind '{}' (only leak: is supported)", shown(kind)),
                    });
                }
                // valgrind's blocks (`{`, a name, `Memcheck:Leak`, `fun:` lines, `}`) match
                // frame by frame; said, not left to "not kind:pattern" (review helper 111).
                None if line == "{" => {
                    return Err(SuppressionError {
                        line: i + 1,
                        message: "a valgrind suppression block: mallocspy reads LeakSanitizer's format, a \
                                  leak:PATTERN line each (a function, file or module name; * wildcards)"
                            .into(),
                    });
                }
                None => {
                    let message = format!("'{}' is not kind:pattern", shown(line));
                    return Err(SuppressionError { line: i + 1, message });
                }
            }
        }
        Ok(Self { patterns })
    }

    /// True when there are no patterns.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The first pattern matching any of `texts` (function, file, module of a frame).
    pub fn matching<'a>(&self, texts: impl IntoIterator<Item = &'a str> + Clone) -> Option<&str> {
        self.patterns.iter().find(|p| texts.clone().into_iter().any(|t| template_match(p, t))).map(String::as_str)
    }
}

/// LSan's template match: `*` wildcard, `^` and `$` anchors, else substring.
fn template_match(pattern: &str, text: &str) -> bool {
    let (start, pattern) = pattern.strip_prefix('^').map_or((false, pattern), |p| (true, p));
    let (end, pattern) = pattern.strip_suffix('$').map_or((false, pattern), |p| (true, p));
    let glob = format!("{}{pattern}{}", if start { "" } else { "*" }, if end { "" } else { "*" });
    glob_match(glob.as_bytes(), text.as_bytes())
}

/// Whole-text match with `*` (any run of bytes), the classic two-pointer backtracking.
fn glob_match(p: &[u8], t: &[u8]) -> bool {
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lsan_files_and_matches_like_lsan() {
        let s = Suppressions::parse("# third party\nleak:libpython*\n\nleak:^leak_small$\nleak:leaky.c\n").unwrap();
        assert_eq!(s.matching(["leak_small"]), Some("^leak_small$"));
        assert_eq!(s.matching(["leak_smaller"]), None);
        assert_eq!(s.matching(["/usr/lib/libpython3.11.so.1.0"]), Some("libpython*"));
        assert_eq!(s.matching(["main", "/work/shared/bench/leaky.c"]), Some("leaky.c"));
        assert_eq!(s.matching(["other"]), None);
        assert!(template_match("a*c", "xxabbbcxx"));
        assert!(!template_match("^a*c$", "xxabbbcxx"));
        assert!(template_match("^a*c$", "abbbc"));
    }

    #[test]
    fn malformed_lines_are_reported_with_their_number() {
        assert_eq!(
            Suppressions::parse("leak:x\nrace:y\n").unwrap_err().to_string(),
            "line 2: unknown kind 'race' (only leak: is supported)"
        );
        assert_eq!(Suppressions::parse("oops\n").unwrap_err().to_string(), "line 1: 'oops' is not kind:pattern");
        // A binary file's first line: escaped and cut, not copied to the terminal whole.
        let binary = format!("\x1b[31m\u{1}{}\n", "z".repeat(5000));
        assert_eq!(
            Suppressions::parse(&binary).unwrap_err().to_string(),
            format!("line 1: '\\u{{1b}}[31m\\u{{1}}{}... (4946 more characters)' is not kind:pattern", "z".repeat(54))
        );
        let valgrind = "# from --gen-suppressions\n{\n   zlib\n   Memcheck:Leak\n   fun:malloc\n}\n";
        assert!(
            Suppressions::parse(valgrind)
                .unwrap_err()
                .to_string()
                .starts_with("line 2: a valgrind suppression block: mallocspy reads LeakSanitizer's format")
        );
        assert_eq!(Suppressions::parse("leak:\n").unwrap_err().to_string(), "line 1: empty pattern");
    }
}
