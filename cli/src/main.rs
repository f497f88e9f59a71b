//! `mallocspy`: run a program with the shim preloaded and its leak tracker on.
//!
//! The command only sets the program's environment (`LD_PRELOAD`, `MALLOCSPY_OPTIONS`) and
//! forwards its exit status; the report is written by each process of the program itself, at
//! its exit (see the `mallocspy` crate).

/// `eprintln!` that drops the line when stderr refuses it (a full disk, a closed pipe):
/// `eprintln!` panics then, and `mallocspy record` lost the program's exit status to the panic.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod launch;
mod out_of_memory;
mod record;
mod report;
mod run;

#[global_allocator]
static ALLOCATOR: out_of_memory::ExitWhenOut = out_of_memory::ExitWhenOut;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mallocspy: COM's IMallocSpy for Linux. Spies on the malloc family of unmodified programs.
#[derive(Parser)]
#[command(name = "mallocspy", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run PROGRAM with the leak tracker and print its leak report when it exits.
    #[command(after_help = run::EXAMPLES)]
    Run(run::RunArgs),
    /// Run PROGRAM sampling its allocations (allocation ticks) into a trace file.
    #[command(after_help = record::EXAMPLES)]
    Record(record::RecordArgs),
    /// Report where a recorded program allocated, from its trace file.
    #[command(after_help = report::EXAMPLES)]
    Report(report::ReportArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version, asked for or for want of a command: as clap prints them.
        Err(e) if !e.use_stderr() || e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            e.exit()
        }
        Err(e) => return launch::fail(&one_line(&e.render().to_string()), 2),
    };
    match cli.command {
        Command::Run(args) => run::run(args),
        Command::Record(args) => record::record(args),
        Command::Report(args) => report::report(args),
    }
}

/// clap's error in one line: its message and value lists, and its tips in parentheses,
/// without the usage and the hint that follow (`--help` gives those).
fn one_line(rendered: &str) -> String {
    let message: Vec<String> = rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .map(|l| if l.starts_with("tip:") { format!("({l})") } else { l.to_string() })
        .collect();
    let message = message.join(" ");
    format!("{}; see --help", message.strip_prefix("error: ").unwrap_or(&message))
}
