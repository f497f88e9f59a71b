//! `mallocspy run`.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use clap::Args;
use mallocspy::leaks::Suppressions;

pub const EXAMPLES: &str = "Examples:
  mallocspy run -- ./leaky
  mallocspy run --exitcode 23 -- make test        # fail a CI step on leaks
  mallocspy run --json --log 'leaks.%p.json' -- python3 script.py
  mallocspy run --suppressions lsan.supp -- sqlite3 db.sqlite '.read x.sql'

Each process (children too) writes its own report at exit; %p in --log is its pid.";

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
    /// Exit with N when definitely or indirectly lost blocks remain (LeakSanitizer uses 23).
    #[arg(long, value_name = "N")]
    exitcode: Option<u8>,
    /// Frames recorded per allocation.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=128))]
    stack_depth: u32,
    /// List still-reachable records in the text report too.
    #[arg(long)]
    show_reachable: bool,
    /// The preload library (default: libmallocspy_preload.so next to this executable).
    #[arg(long, value_name = "PATH")]
    shim: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM")]
    program: Vec<OsString>,
}

fn fail(message: &str, code: u8) -> ExitCode {
    eprintln!("mallocspy: {message}");
    ExitCode::from(code)
}

fn default_shim() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let shim = exe.parent()?.join("libmallocspy_preload.so");
    shim.exists().then_some(shim)
}

pub fn run(args: RunArgs) -> ExitCode {
    let Some(shim) = args.shim.clone().or_else(default_shim) else {
        return fail("cannot find libmallocspy_preload.so next to this executable; give --shim PATH", 2);
    };
    if !shim.exists() {
        return fail(&format!("no shim at '{}'", shim.display()), 2);
    }
    let shim = shim.canonicalize().unwrap_or(shim);
    let mut options = vec!["spy=leaks".to_string(), format!("stack_depth={}", args.stack_depth)];
    if args.json {
        options.push("report_format=json".into());
    }
    if args.show_reachable {
        options.push("show_reachable=1".into());
    }
    if let Some(log) = &args.log {
        options.push(format!("log_path={log}"));
    }
    if let Some(code) = args.exitcode {
        options.push(format!("exitcode={code}"));
    }
    if let Some(path) = &args.suppressions {
        // Checked here, so that a typo fails before the program runs, not after.
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => return fail(&format!("cannot read suppressions file '{}': {e}", path.display()), 2),
        };
        if let Err(e) = Suppressions::parse(&text) {
            return fail(&format!("suppressions file '{}': {e}", path.display()), 2);
        }
        let absolute = path.canonicalize().unwrap_or_else(|_| path.clone());
        options.push(format!("suppressions={}", absolute.display()));
    }
    let mut preload = OsString::from(&shim);
    if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
        preload.push(" ");
        preload.push(existing);
    }
    let program = &args.program[0];
    let mut child = Command::new(program);
    child.args(&args.program[1..]).env("LD_PRELOAD", preload).env("MALLOCSPY_OPTIONS", options.join(":"));
    let status = match child.status() {
        Ok(s) => s,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 };
            return fail(&format!("cannot run '{}': {e}", program.to_string_lossy()), code);
        }
    };
    if let Some(code) = status.code() {
        return ExitCode::from(code as u8);
    }
    // Killed by a signal: die of the same one, so that our parent sees what happened.
    if let Some(signal) = status.signal() {
        // SAFETY: restoring the default action and raising a signal in our own process.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
        return ExitCode::from(128 + signal as u8);
    }
    ExitCode::FAILURE
}
