//! A progress bar on stderr for long reports, and only for them.
//!
//! Short reports must not flicker a bar, and redirected stderr must not fill with control codes:
//! the bar draws nowhere at first and moves to stderr once work has taken more than a second,
//! if stderr is a terminal.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How long work runs before the bar shows.
const QUIET_FOR: Duration = Duration::from_secs(1);

/// The bar and when work started.
pub struct Progress {
    bar: ProgressBar,
    started: Instant,
    /// Stderr is a terminal: the bar may show.
    may_show: bool,
    shown: bool,
}

impl Progress {
    /// A bar that shows on stderr after a second, if stderr is a terminal.
    pub fn new() -> Self {
        Self::with_terminal(std::io::stderr().is_terminal())
    }

    fn with_terminal(may_show: bool) -> Self {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::hidden());
        let style = ProgressStyle::with_template("{msg:>12} [{bar:40}] {percent:>3}% {elapsed}")
            .expect("a valid template")
            .progress_chars("=> ");
        bar.set_style(style);
        Progress { bar, started: Instant::now(), may_show, shown: false }
    }

    /// A bar that never shows (tests).
    #[cfg(test)]
    pub fn hidden() -> Self {
        Self::with_terminal(false)
    }

    /// Starts a stage of `len` units (bytes read, addresses resolved).
    pub fn stage(&mut self, what: &'static str, len: u64) {
        self.bar.set_message(what);
        self.bar.set_length(len);
        self.bar.set_position(0);
        self.show_if_slow();
    }

    /// `done` units of the current stage are done.
    pub fn set(&mut self, done: u64) {
        self.bar.set_position(done);
        self.show_if_slow();
    }

    fn show_if_slow(&mut self) {
        if self.may_show && !self.shown && self.started.elapsed() > QUIET_FOR {
            self.shown = true;
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    /// Removes the bar, so that what follows on stderr starts on a clean line.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
