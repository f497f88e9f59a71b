//! Start-up and exit of the preloaded shim: read `MALLOCSPY_OPTIONS`, register the built-in
//! spies, write their reports at exit.

use std::sync::OnceLock;

use crate::global::{self, GLOBAL};
use crate::options::Options;
use crate::spies::count::CountSpy;
use crate::spies::guard::GuardSpy;
use crate::spies::stack::SpyStack;
use crate::spy::MallocSpy;
use crate::{os, sink};

/// The built-in spies of this process, kept for their exit reports.
struct Builtins {
    count: Option<&'static CountSpy>,
    guard: Option<&'static GuardSpy>,
}

static BUILTINS: OnceLock<Builtins> = OnceLock::new();

fn say(message: &str) {
    let line = format!("mallocspy: {message}\n");
    os::write_all(2, line.as_bytes());
}

/// Reads `MALLOCSPY_OPTIONS` and registers the spies it names. Called once by the shim's
/// constructor. A malformed value is reported in one line and the program runs unspied.
pub fn init() {
    GLOBAL.heap.warm_up();
    let text = match std::env::var("MALLOCSPY_OPTIONS") {
        Ok(text) => text,
        Err(std::env::VarError::NotPresent) => return,
        Err(std::env::VarError::NotUnicode(_)) => {
            say("MALLOCSPY_OPTIONS is not valid UTF-8; running unspied");
            return;
        }
    };
    let options = match Options::parse(&text) {
        Ok(o) => o,
        Err(e) => {
            say(&format!("MALLOCSPY_OPTIONS: {e}; running unspied"));
            return;
        }
    };
    match &options.log_path {
        Some(path) => {
            if let Err(e) = sink::use_path(path) {
                say(&format!("{e}; reports go to stderr"));
            }
        }
        None => sink::use_stderr(),
    }
    if options.spies.is_empty() {
        return;
    }
    let builtins = Builtins {
        count: options.spies.count.then(CountSpy::new).flatten().map(|s| &*Box::leak(Box::new(s))),
        guard: options.spies.guard.then(GuardSpy::new).flatten().map(|s| &*Box::leak(Box::new(s))),
    };
    if options.spies.count != builtins.count.is_some() || options.spies.guard != builtins.guard.is_some() {
        say("cannot map memory for the spies; running unspied");
        return;
    }
    // Observers outermost, so they see the caller's pointers and sizes.
    let mut layers: Vec<&'static dyn MallocSpy> = Vec::new();
    if let Some(count) = builtins.count {
        layers.push(count);
    }
    if let Some(guard) = builtins.guard {
        layers.push(guard);
    }
    let _ = BUILTINS.set(builtins);
    global::set_fork_child_hook(after_fork_child);
    let spy: &'static dyn MallocSpy =
        if layers.len() == 1 { layers[0] } else { Box::leak(Box::new(SpyStack::new(layers))) };
    let registered = global::register_static_here(spy);
    if let Err(e) = registered {
        say(&format!("cannot register the built-in spies: {e}"));
    }
}

fn after_fork_child() {
    sink::after_fork_child();
    if let Some(count) = BUILTINS.get().and_then(|b| b.count) {
        count.reset();
    }
}

/// Writes the built-in spies' reports. Called once by the shim's destructor, as late as the
/// dynamic loader allows.
pub fn fini() {
    let leaked = GLOBAL.leaked_frees();
    if leaked > 0 {
        say(&format!("{leaked} free(s) made inside a hook could not be completed; their blocks were leaked"));
    }
    let Some(builtins) = BUILTINS.get() else { return };
    if let Some(count) = builtins.count {
        sink::write(count.report().as_bytes());
    }
    if let Some(mut summary) = builtins.guard.and_then(|g| g.report_summary()) {
        sink::write(summary.as_bytes());
    }
}
