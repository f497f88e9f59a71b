//! `mallocspy run`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use mallocspy::leaks::Suppressions;

use crate::launch::{self, fail};
use crate::report::text::quoted_path;

pub const EXAMPLES: &str = "Examples:
  mallocspy run -- ./leaky
  mallocspy run --exitcode 23 -- make test        # a test that leaks fails, and so make
  mallocspy run --json --log 'leaks.%p.json' -- python3 script.py
  mallocspy run --suppressions lsan.supp -- sqlite3 db.sqlite '.read x.sql'

Each process (children too) writes its own report at exit; %p in --log is its pid.
--exitcode is each process's own status, as LeakSanitizer's: a leaking child fails the run
only if its parent passes the failure on (make does; a pipeline's status is its last command's).";

/// Options mirror `MALLOCSPY_OPTIONS`.
#[derive(Args)]
pub struct RunArgs {
    /// Write the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// Write the reports to PATH (%p = process id) instead of stderr.
    #[arg(long, value_name = "PATH")]
    log: Option<String>,
    /// Leave out leaks matching LeakSanitizer-style `leak:PATTERN` lines.
    #[arg(long, value_name = "FILE")]
    suppressions: Option<PathBuf>,
    /// Exit with N when definitely or indirectly lost blocks remain, or `spy=guard` found
    /// misuse (LeakSanitizer uses 23; 0 leaves the program's status alone); in each process,
    /// for its own.
    #[arg(long, value_name = "N")]
    exitcode: Option<u8>,
    /// Frames recorded per allocation [default: 32].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=128))]
    stack_depth: Option<u32>,
    /// List still-reachable records in the text report too.
    #[arg(long)]
    show_reachable: bool,
    /// Keep the frames below main (the C library's start-up) in the stacks.
    #[arg(long)]
    show_below_main: bool,
    /// The preload library (default: libmallocspy_preload.so next to this executable).
    #[arg(long, value_name = "PATH")]
    shim: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM")]
    program: Vec<OsString>,
}

pub fn run(args: RunArgs) -> ExitCode {
    // Only the flags given: the environment's MALLOCSPY_OPTIONS sets the others. Its spies
    // stay, with the leak tracker added: `spy=leaks,guard` there lost its guard unsaid (review
    // helper 77).
    let mut options = vec![launch::spies_with("leaks", std::env::var("MALLOCSPY_OPTIONS").ok().as_deref())];
    if let Some(depth) = args.stack_depth {
        options.push(format!("stack_depth={depth}"));
    }
    if args.json {
        options.push("report_format=json".into());
    }
    if args.show_reachable {
        options.push("show_reachable=1".into());
    }
    if args.show_below_main {
        options.push("show_below_main=1".into());
    }
    if let Some(log) = &args.log {
        match launch::option_template("--log", Path::new(log)) {
            Ok(log) => match launch::check_writable(&log, false) {
                Ok(()) => options.push(format!("log_path={log}")),
                Err(why) => return fail(&format!("cannot write --log {}: {why}", quoted_path(&log)), 2),
            },
            Err(code) => return code,
        }
    }
    if let Some(code) = args.exitcode {
        options.push(format!("exitcode={code}"));
    }
    if let Some(path) = &args.suppressions {
        // Checked here, so that a typo fails before the program runs, not after.
        let text = match Suppressions::read(path) {
            Ok(t) => t,
            Err(e) => return fail(&format!("cannot read suppressions file '{}': {e}", path.display()), 2),
        };
        if let Err(e) = Suppressions::parse(&text) {
            return fail(&format!("suppressions file '{}': {e}", path.display()), 2);
        }
        match launch::option_path("--suppressions", &path.canonicalize().unwrap_or_else(|_| path.clone())) {
            Ok(path) => options.push(format!("suppressions={path}")),
            Err(code) => return code,
        }
    }
    launch::exec_preloaded(args.shim.as_deref(), &options, &args.program)
}
