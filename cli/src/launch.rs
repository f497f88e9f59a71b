//! Running a program with the shim preloaded, for `run` and `record`.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};

/// `path`, given as `flag`, as `MALLOCSPY_OPTIONS` carries it: absolute (each process of the
/// program resolves it where it starts, and a program may change directory first), and
/// refused if it holds ':' (the options' separator) or ends in white space (trimmed there);
/// refused, the program would run unspied. Refused too if it is not UTF-8, as the options
/// must be: passed with its bytes replaced, it named another file.
pub fn option_path(flag: &str, path: &Path) -> Result<String, ExitCode> {
    absolute_option(flag, path, false)
}

/// [`option_path`] for a `log_path` or `trace` template: the `%` of the current directory put
/// before a relative path are escaped (`%%`), as only the user's own `%p` is meant (a run in
/// `50%off/` was refused, and one in a directory named with `%p` wrote elsewhere; review
/// helper 138).
pub fn option_template(flag: &str, path: &Path) -> Result<String, ExitCode> {
    absolute_option(flag, path, true)
}

fn absolute_option(flag: &str, path: &Path, template: bool) -> Result<String, ExitCode> {
    let utf8 = |p: &Path| match p.to_str() {
        Some(p) => Ok(p.to_string()),
        None => {
            let why = "is not valid UTF-8, which MALLOCSPY_OPTIONS cannot carry";
            Err(fail(&format!("{flag} '{}' {why}", p.display()), 2))
        }
    };
    let bad = |e: std::io::Error| fail(&format!("bad {flag} '{}': {e}", path.display()), 2);
    let absolute = utf8(&std::path::absolute(path).map_err(bad)?)?;
    let absolute = match std::env::current_dir() {
        // The directory's part, put before a relative path, is not the user's template.
        Ok(cwd) if template && path.is_relative() => match cwd.to_str().and_then(|dir| absolute.strip_prefix(dir)) {
            Some(rest) => format!("{}{rest}", cwd.to_string_lossy().replace('%', "%%")),
            None => absolute,
        },
        _ => absolute,
    };
    if absolute.contains(':') || absolute.trim_end() != absolute {
        return Err(fail(
            &format!(
                "{flag} {} holds ':' or ends in white space, which MALLOCSPY_OPTIONS cannot carry",
                crate::report::text::quoted_path(&absolute)
            ),
            2,
        ));
    }
    Ok(absolute)
}

/// Whether the file `output` (absolute, `%p` unexpanded) can be written, asked before the
/// program runs: each of its processes could only say so on its stderr (a trace's run would
/// be lost; a log's warning came once per process). `regular_only`: a FIFO or a device
/// (`/dev/full`) is no trace, but may take a log.
pub fn check_writable(output: &str, regular_only: bool) -> Result<(), String> {
    use mallocspy::options::{expand_path, is_path_template, names_pid};
    use std::fs::OpenOptions;
    use std::io::ErrorKind;
    if !is_path_template(output) {
        return Err("a % in it is neither %p (the process id) nor %% (a %)".into());
    }
    // As the program will read it (`%%` is `%`); any pid will do for the directory.
    let expanded = expand_path(output, std::process::id());
    let path = Path::new(&expanded);
    let dir = path.parent().unwrap_or(Path::new("/"));
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{} is not a directory", dir.display())),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    }
    // With %p the file is each process's own: ask the directory instead.
    let file = if names_pid(output) {
        dir.join(format!(".mallocspy-check-{}", std::process::id()))
    } else {
        path.to_path_buf()
    };
    match std::fs::metadata(&file) {
        Ok(m) if m.is_dir() => Err("it is a directory".into()),
        Ok(m) if regular_only && !m.is_file() => Err("it is not a regular file".into()),
        // A FIFO or a device is asked, not opened: a FIFO's open waited for a reader (the
        // program never started), and one with a reader got its end of file from this open's
        // close, before the report (review helper 106).
        Ok(m) if !m.is_file() => may_write(&file),
        Ok(_) => OpenOptions::new().append(true).open(&file).map(drop).map_err(|e| e.to_string()),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            // A dangling symbolic link (or a chain of them): the writer will create the last
            // one's target, so ask there.
            let (mut file, mut what) = (file, String::new());
            for _ in 0..40 {
                let Ok(target) = std::fs::read_link(&file) else { break };
                file = file.parent().unwrap_or(Path::new("/")).join(target);
                what = format!("its target '{}': ", file.display());
            }
            OpenOptions::new().write(true).create_new(true).open(&file).map_err(|e| format!("{what}{e}"))?;
            std::fs::remove_file(&file).map_err(|e| e.to_string())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Whether this process may write `file`, by its permissions alone (`faccessat` with the
/// effective ids).
fn may_write(file: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let c =
        std::ffi::CString::new(file.as_os_str().as_bytes()).map_err(|_| "the path contains a NUL byte".to_string())?;
    // SAFETY: a NUL-terminated path; faccessat reads nothing else.
    if unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::W_OK, libc::AT_EACCESS) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().to_string())
    }
}

/// The `spy=` option of a command whose own spy is `own`, with the spies the environment's
/// `MALLOCSPY_OPTIONS` names besides: the command's options come after the environment's, and
/// a later `spy=` replaces an earlier one (`spy=leaks,guard` there lost its guard under `run`,
/// review helper 77; `spy=leaks:exitcode=23` its leak tracker, and a CI its leak check, under
/// `record`, review helper 89).
pub fn spies_with(own: &str, environment: Option<&str>) -> String {
    let mut spy = format!("spy={own}");
    let named = environment.filter(|text| text.split(':').any(|kv| kv.trim_start().starts_with("spy=")));
    if let Some(options) = named.and_then(|text| mallocspy::options::Options::parse(text).ok()) {
        let s = options.spies;
        for (on, name) in [(s.leaks, "leaks"), (s.count, "count"), (s.guard, "guard"), (s.ticks, "ticks")] {
            if on && name != own {
                spy.push(',');
                spy.push_str(name);
            }
        }
    }
    spy
}

/// Prints `mallocspy: MESSAGE` and gives `code`.
pub fn fail(message: &str, code: u8) -> ExitCode {
    say!("mallocspy: {message}");
    ExitCode::from(code)
}

/// The shim beside this executable: found by `/proc/self/exe`, or where `/proc` is not mounted
/// (a container's or a chroot's) by `argv[0]`, as the shell found it (review helper 107).
fn default_shim() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok().or_else(exe_by_argv0)?;
    let shim = exe.parent()?.join("libmallocspy_preload.so");
    shim.exists().then_some(shim)
}

/// This executable as `argv[0]` names it (a path, or a name found in `PATH`), links followed.
fn exe_by_argv0() -> Option<PathBuf> {
    let arg0 = PathBuf::from(std::env::args_os().next()?);
    let named = if arg0.components().count() > 1 {
        arg0
    } else {
        std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(&arg0)).find(|exe| exe.is_file())?
    };
    std::fs::canonicalize(named).ok()
}

/// Runs `program` (with its arguments) with the shim (`shim`, or the one next to this
/// executable) first in `LD_PRELOAD` and `options` as `MALLOCSPY_OPTIONS`; waits for it and
/// gives its pid and status; meanwhile, signals sent to this process are passed on to it
/// ([`relay`]). On failure to start, the exit code to leave with (127: not
/// found, 126: not runnable).
pub fn run_preloaded(
    shim: Option<&Path>,
    options: &[String],
    program: &[OsString],
) -> Result<(u32, ExitStatus), ExitCode> {
    let mut command = preloaded(shim, options, program)?;
    let parent = std::process::id();
    // The program ends with us: SIGKILLed (`timeout -s KILL`, the OOM killer), we had left it
    // running, orphaned, where natively the signal would have ended it (review helper 151).
    // SAFETY: prctl, getppid and raise are async-signal-safe system calls on this process.
    unsafe {
        command.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // Gone before the request: it would never come.
            if libc::getppid() as u32 != parent {
                libc::raise(libc::SIGKILL);
            }
            Ok(())
        })
    };
    let mut child = command.spawn().map_err(|e| cannot_run(program, &e))?;
    let pid = child.id();
    relay_signals_to(pid);
    // This process's own lines past `RLIMIT_FSIZE` then fail (EFBIG) rather than end it by
    // SIGXFSZ: its exit status is to be the program's. Set after the spawn, which would have
    // passed the ignored signal on to the program.
    // SAFETY: setting a standard signal's disposition to SIG_IGN touches no memory.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    child.wait().map(|status| (pid, status)).map_err(|e| fail(&format!("cannot wait for the program: {e}"), 2))
}

/// Becomes `program`, as [`run_preloaded`] would run it: for `run`, which has nothing to do
/// once the program ends (the shim writes the reports). The program is then what its caller
/// started: signals sent to its process group reach it once, not once more through us, and a
/// core it dumps is its own. Returns only on failure, with the exit code to leave with.
pub fn exec_preloaded(shim: Option<&Path>, options: &[String], program: &[OsString]) -> ExitCode {
    match preloaded(shim, options, program) {
        Ok(mut command) => cannot_run(program, &command.exec()),
        Err(code) => code,
    }
}

/// `program` as a command with the shim preloaded, `options` (after those of the environment,
/// which they override) as `MALLOCSPY_OPTIONS`, and the state this process started in.
fn preloaded(shim: Option<&Path>, options: &[String], program: &[OsString]) -> Result<Command, ExitCode> {
    let Some(shim) = shim.map(Path::to_path_buf).or_else(default_shim) else {
        return Err(fail("cannot find libmallocspy_preload.so next to this executable; give --shim PATH", 2));
    };
    if !shim.is_file() {
        // A directory or a missing file: the loader would say so in every process, and run it unspied.
        return Err(fail(&format!("no shim at '{}'", shim.display()), 2));
    }
    if !is_the_shim(&shim) {
        // Another file: the loader's "invalid ELF header" in every process, or another library
        // preloaded, and the program run unspied.
        return Err(fail(&format!("'{}' is not mallocspy's shim (no mallocspy_api_v1 in it)", shim.display()), 2));
    }
    let shim = shim.canonicalize().unwrap_or(shim);
    if shim.to_string_lossy().contains([' ', ':']) {
        // LD_PRELOAD splits at both: the loader would look for pieces of the path.
        return Err(fail(
            &format!(
                "the shim's path '{}' holds a space or ':', which LD_PRELOAD cannot carry; install mallocspy elsewhere or give --shim",
                shim.display()
            ),
            2,
        ));
    }
    let mut preload = OsString::from(&shim);
    if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
        preload.push(" ");
        preload.push(existing);
    }
    let options = with_the_environment(options)?;
    if let Some(why) = out_of_reach(Path::new(&program[0])) {
        say!("mallocspy: warning: '{}' {why}; it runs unspied", program[0].to_string_lossy());
    }
    let mut command = Command::new(&program[0]);
    command.args(&program[1..]).env("LD_PRELOAD", preload).env("MALLOCSPY_OPTIONS", options);
    // SAFETY: the closure only calls close, sigaction and sigprocmask, which are
    // async-signal-safe, with data this process noted before its runtime started.
    unsafe {
        command.pre_exec(|| {
            restore_start_state();
            Ok(())
        })
    };
    Ok(command)
}

/// `ours` after the user's own `MALLOCSPY_OPTIONS`, which would otherwise be lost (a later
/// key wins); options the shim would refuse are refused here, before the program runs.
fn with_the_environment(ours: &[String]) -> Result<String, ExitCode> {
    let ours = ours.join(":");
    let Some(theirs) = std::env::var_os("MALLOCSPY_OPTIONS").filter(|o| !o.is_empty()) else { return Ok(ours) };
    let Some(theirs) = theirs.to_str() else {
        return Err(fail("MALLOCSPY_OPTIONS is not valid UTF-8", 2));
    };
    if let Err(e) = mallocspy::options::Options::parse(theirs) {
        return Err(fail(&format!("MALLOCSPY_OPTIONS: {e}"), 2));
    }
    // The trace's owner, which a traced process adds for its descendants: this program starts
    // a trace of its own (a `record` under `record`), and its trace goes where it was asked to.
    let mut options: Vec<&str> = theirs.split(':').filter(|o| !o.trim_start().starts_with("trace_owner=")).collect();
    options.push(&ours);
    Ok(options.join(":"))
}

/// The exit code for a program that could not be started (127: not found, 126: not
/// runnable), said.
fn cannot_run(program: &[OsString], e: &std::io::Error) -> ExitCode {
    let code = if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 };
    fail(&format!("cannot run '{}': {e}", program[0].to_string_lossy()), code)
}

/// What this process started with that Rust's runtime changes before `main` and the program
/// must start with as it would natively: which of descriptors 0, 1 and 2 were closed (bit `n`
/// for `n`: the runtime opens `/dev/null` on them, and `echo hi >&-` must fail, a program's
/// first `open` get 0), whether `SIGPIPE` was ignored (the runtime ignores it, and a spawned
/// program gets the default: `yes` under `trap '' PIPE` must see EPIPE, not die), and the
/// signals it had blocked (a spawned program gets none).
struct StartState {
    closed: u8,
    pipe_ignored: bool,
    blocked: libc::sigset_t,
}

static START: OnceLock<StartState> = OnceLock::new();

/// Runs before Rust's runtime, as a constructor: notes [`START`].
#[used]
#[unsafe(link_section = ".init_array")]
static NOTE_START_STATE: extern "C" fn() = note_start_state;

extern "C" fn note_start_state() {
    // SAFETY: F_GETFD only reads the descriptor table; a closed descriptor fails with EBADF.
    let closed = (0..3).filter(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0).fold(0, |m, fd| m | 1 << fd);
    // SAFETY: sigaction and sigprocmask with a null new value only read into plain data.
    let (pipe, blocked) = unsafe {
        let mut pipe: libc::sigaction = core::mem::zeroed();
        let mut blocked: libc::sigset_t = core::mem::zeroed();
        libc::sigaction(libc::SIGPIPE, core::ptr::null(), &mut pipe);
        libc::sigprocmask(libc::SIG_BLOCK, core::ptr::null(), &mut blocked);
        (pipe, blocked)
    };
    let _ = START.set(StartState { closed, pipe_ignored: pipe.sa_sigaction == libc::SIG_IGN, blocked });
}

/// Whether descriptor `fd` (0, 1 or 2) was closed when this process started (the runtime
/// has put `/dev/null` there since).
pub fn closed_at_start(fd: u8) -> bool {
    START.get().is_some_and(|start| start.closed & 1 << fd != 0)
}

/// In the child, just before the program is executed: puts back [`START`].
fn restore_start_state() {
    let Some(start) = START.get() else { return };
    (0..3).filter(|fd| start.closed & 1 << fd != 0).for_each(|fd| {
        // SAFETY: closes a descriptor the child does not otherwise use (the runtime opened
        // /dev/null there).
        unsafe { libc::close(fd) };
    });
    // SAFETY: setting a disposition and the signal mask this process started with.
    unsafe {
        if start.pipe_ignored {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        libc::sigprocmask(libc::SIG_SETMASK, &start.blocked, core::ptr::null_mut());
    }
}

/// The program `run_preloaded` waits for, for [`relay`].
static CHILD: AtomicI32 = AtomicI32::new(0);

/// Signals a process sends to this one, passed on to the program.
const RELAYED: [libc::c_int; 7] =
    [libc::SIGHUP, libc::SIGINT, libc::SIGQUIT, libc::SIGTERM, libc::SIGUSR1, libc::SIGUSR2, libc::SIGALRM];

/// Passes a signal another process sent us (`kill`: a supervisor, a CI runner stopping the
/// job) on to the program, which would otherwise run on, orphaned, after we died. One the
/// kernel sent (`^C` at the terminal, a hang-up: `si_code` `SI_KERNEL`) reached the program's
/// process group, the program with it, and is not sent twice; as `sudo` does.
extern "C" fn relay(signal: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    let child = CHILD.load(Ordering::Relaxed);
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let (code, sender) = unsafe { ((*info).si_code, (*info).si_pid()) };
    if child > 0 && code <= 0 && sender != child {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(child, signal) };
    }
}

/// From now on, [`relay`] the signals of [`RELAYED`] to `child`: this process lives until
/// the program has ended, to forward its status (and, for `run`, its report's exit code).
fn relay_signals_to(child: u32) {
    CHILD.store(child as i32, Ordering::Relaxed);
    for signal in RELAYED {
        // SAFETY: sigaction is plain data; `relay` has the SA_SIGINFO signature and only
        // calls async-signal-safe functions.
        unsafe {
            let mut action: libc::sigaction = core::mem::zeroed();
            action.sa_sigaction = relay as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigaction(signal, &action, core::ptr::null_mut());
        }
    }
}

/// Why the loader will not preload the shim into `program`, if it can tell: the program is
/// statically linked (no loader at all), or it is set-user-ID or set-group-ID to someone else
/// or has file capabilities (the loader then ignores `LD_PRELOAD` paths). A script, or a file
/// it cannot read, passes.
fn out_of_reach(program: &Path) -> Option<&'static str> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let path = if program.components().count() > 1 {
        program.to_path_buf()
    } else {
        std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(program)).find(|p| p.is_file())?
    };
    let meta = std::fs::metadata(&path).ok().filter(|m| m.is_file())?;
    // SAFETY: geteuid and getegid have no preconditions.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if (meta.mode() & libc::S_ISUID != 0 && meta.uid() != euid)
        || (meta.mode() & libc::S_ISGID != 0 && meta.gid() != egid)
    {
        return Some("is set-user-ID or set-group-ID, so the loader ignores LD_PRELOAD");
    }
    // Capabilities the program gains from its file make the kernel ask for a secure exec, as
    // set-user-ID does, for any user but root (`ping`'s cap_net_raw on most distributions).
    if euid != 0 && has_file_capabilities(&path) {
        return Some("has file capabilities (setcap), so the loader ignores LD_PRELOAD");
    }
    let mut head = Vec::with_capacity(64 << 10);
    std::fs::File::open(&path).ok()?.take(64 << 10).read_to_end(&mut head).ok()?;
    // The dynamic loader names no interpreter either: run as a command (`ld.so ./prog`), it
    // loads the program and the shim with it (review helper 107).
    (elf_interpreter(&head) == Some(false) && !is_dynamic_loader(&path))
        .then_some("is statically linked, so no LD_PRELOAD library reaches its malloc")
}

/// Whether `path` names a dynamic loader, by its name or the name of the file it links to.
fn is_dynamic_loader(path: &Path) -> bool {
    let named = |p: &Path| p.file_name().and_then(|n| n.to_str()).is_some_and(mallocspy::leaks::is_dynamic_loader_name);
    named(path) || std::fs::canonicalize(path).is_ok_and(|p| named(&p))
}

/// Whether the file at `path` carries capabilities (`security.capability`).
fn has_file_capabilities(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
    // SAFETY: both names are NUL-terminated; a NULL buffer of size 0 asks for the size only.
    unsafe { libc::getxattr(path.as_ptr(), c"security.capability".as_ptr(), core::ptr::null_mut(), 0) > 0 }
}

/// Whether the file at `path` is mallocspy's shim: a library exporting its API's table. The
/// file is mapped, not read: of its megabytes (debug information) only the headers and the
/// dynamic symbols are looked at, and reading it whole cost every run milliseconds.
fn is_the_shim(path: &Path) -> bool {
    use object::{Object, ObjectSymbol};
    let Ok(file) = std::fs::File::open(path) else { return false };
    // SAFETY: a private read-only mapping of the shim, which nothing truncates while we look.
    let Ok(map) = (unsafe { memmap2::Mmap::map(&file) }) else { return false };
    object::File::parse(&*map)
        .is_ok_and(|f| f.dynamic_symbols().any(|s| s.is_definition() && s.name() == Ok("mallocspy_api_v1")))
}

/// Whether a 64-bit ELF file (its first bytes, `head`) names a program interpreter
/// (`PT_INTERP`): `None` when it is not such a file or its program headers lie beyond `head`.
fn elf_interpreter(head: &[u8]) -> Option<bool> {
    use object::read::elf::{FileHeader, ProgramHeader};
    let header = object::elf::FileHeader64::<object::Endianness>::parse(head).ok()?;
    let endian = header.endian().ok()?;
    let headers = header.program_headers(endian, head).ok()?;
    Some(headers.iter().any(|ph| ph.p_type(endian) == object::elf::PT_INTERP))
}

/// Leaves as the program did: its exit status, or its signal.
pub fn forward(status: ExitStatus) -> ExitCode {
    if let Some(code) = status.code() {
        return ExitCode::from(code as u8);
    }
    // Killed by a signal: die of the same one, so that our parent sees what happened; with no
    // core of our own, which would overwrite the program's. Unblocked first: we inherited the
    // mask the program started with, and one that blocks the signal would leave it pending.
    if let Some(signal) = status.signal() {
        // SAFETY: setting our own core limit, default action and mask, and raising a signal in
        // our own process; the set is plain data.
        unsafe {
            let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::setrlimit(libc::RLIMIT_CORE, &none);
            libc::signal(signal, libc::SIG_DFL);
            let mut only: libc::sigset_t = core::mem::zeroed();
            libc::sigemptyset(&mut only);
            libc::sigaddset(&mut only, signal);
            libc::sigprocmask(libc::SIG_UNBLOCK, &only, core::ptr::null_mut());
            libc::raise(signal);
        }
        return ExitCode::from(128 + signal as u8);
    }
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environments_spies_stay_beside_the_commands_own() {
        assert_eq!(spies_with("leaks", None), "spy=leaks");
        assert_eq!(spies_with("leaks", Some("log_path=x")), "spy=leaks");
        assert_eq!(spies_with("leaks", Some("spy=leaks,guard")), "spy=leaks,guard");
        assert_eq!(spies_with("leaks", Some("spy=ticks,count:trace=t")), "spy=leaks,count,ticks");
        assert_eq!(spies_with("leaks", Some("spy=none")), "spy=leaks");
        // The default spy is the leak tracker, but only named it stays beside the ticks.
        assert_eq!(spies_with("ticks", Some("exitcode=23")), "spy=ticks");
        assert_eq!(spies_with("ticks", Some("spy=leaks:exitcode=23")), "spy=ticks,leaks");
        assert_eq!(spies_with("ticks", Some("spy=ticks,guard")), "spy=ticks,guard");
    }

    #[test]
    fn a_dynamic_program_is_in_reach_and_garbage_is_not_judged() {
        assert_eq!(out_of_reach(Path::new("sh")), None);
        let own = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert_eq!(elf_interpreter(&own), Some(true));
        assert_eq!(elf_interpreter(b"#!/bin/sh\n"), None);
        assert_eq!(elf_interpreter(&own[..0x40]), None, "program headers cut off");
        assert!(is_dynamic_loader(Path::new("/lib64/ld-linux-x86-64.so.2")));
        assert!(!is_dynamic_loader(Path::new("/usr/bin/ldd")) && !is_dynamic_loader(&std::env::current_exe().unwrap()));
    }
}
