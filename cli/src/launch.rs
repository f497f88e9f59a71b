//! Running a program with the shim preloaded, for `run` and `record`.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};

/// Prints `mallocspy: MESSAGE` and gives `code`.
pub fn fail(message: &str, code: u8) -> ExitCode {
    eprintln!("mallocspy: {message}");
    ExitCode::from(code)
}

fn default_shim() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let shim = exe.parent()?.join("libmallocspy_preload.so");
    shim.exists().then_some(shim)
}

/// Runs `program` (with its arguments) with the shim (`shim`, or the one next to this
/// executable) first in `LD_PRELOAD` and `options` as `MALLOCSPY_OPTIONS`; waits for it and
/// gives its pid and status. On failure to start, the exit code to leave with (127: not
/// found, 126: not runnable).
pub fn run_preloaded(
    shim: Option<&Path>,
    options: &[String],
    program: &[OsString],
) -> Result<(u32, ExitStatus), ExitCode> {
    let Some(shim) = shim.map(Path::to_path_buf).or_else(default_shim) else {
        return Err(fail("cannot find libmallocspy_preload.so next to this executable; give --shim PATH", 2));
    };
    if !shim.exists() {
        return Err(fail(&format!("no shim at '{}'", shim.display()), 2));
    }
    let shim = shim.canonicalize().unwrap_or(shim);
    let mut preload = OsString::from(&shim);
    if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
        preload.push(" ");
        preload.push(existing);
    }
    let mut child = Command::new(&program[0]);
    child.args(&program[1..]).env("LD_PRELOAD", preload).env("MALLOCSPY_OPTIONS", options.join(":"));
    let mut child = child.spawn().map_err(|e| {
        let code = if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 };
        fail(&format!("cannot run '{}': {e}", program[0].to_string_lossy()), code)
    })?;
    let pid = child.id();
    child.wait().map(|status| (pid, status)).map_err(|e| fail(&format!("cannot wait for the program: {e}"), 2))
}

/// Leaves as the program did: its exit status, or its signal.
pub fn forward(status: ExitStatus) -> ExitCode {
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
