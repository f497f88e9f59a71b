//! Shared helpers of the integration tests: build the shim and the fixtures, run programs
//! natively and under LD_PRELOAD, compare what they did.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `target/<profile>` of this test build.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

fn is_release() -> bool {
    target_dir().file_name().is_some_and(|n| n == "release")
}

fn cargo(args: &[&str], dir: &Path, target: Option<&Path>) {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(args).current_dir(dir);
    if is_release() {
        cmd.arg("--release");
    }
    if let Some(t) = target {
        cmd.env("CARGO_TARGET_DIR", t);
    }
    let out = cmd.output().expect("cargo runs");
    assert!(out.status.success(), "cargo {args:?} in {}:\n{}", dir.display(), String::from_utf8_lossy(&out.stderr));
}

/// `libmallocspy_preload.so`, built once per test process from the current sources, with the
/// `mallocspy` command next to it. The whole workspace is built, as `cargo build` builds it:
/// the shim's package alone would get other features of the dependencies it shares with the
/// command, and each build would then undo the other's (half a minute each time).
pub fn shim() -> PathBuf {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        cargo(&["build", "-q"], &root(), None);
        let shim = target_dir().join("libmallocspy_preload.so");
        assert!(shim.exists(), "{} was not built", shim.display());
        shim
    })
    .clone()
}

/// The `mallocspy` command, built with [`shim`].
pub fn mallocspy() -> PathBuf {
    shim();
    target_dir().join("mallocspy")
}

/// Where compiled fixtures go.
pub fn fixture_dir() -> PathBuf {
    let dir = target_dir().join("fixtures");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

static BUILD_LOCK: Mutex<()> = Mutex::new(());

/// Compiles `tests/fixtures/<source>` (C or C++) with `extra` flags into `<out>`, unless an
/// up-to-date build exists. Written under a temporary name and renamed, so that test processes
/// running at once never see half a binary.
fn compile(source: &str, out: &str, extra: &[&str]) -> PathBuf {
    let _guard = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let src = root().join("tests/fixtures").join(source);
    let dst = fixture_dir().join(out);
    let fresh = |p: &Path| {
        let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((m(p), m(&src), m(&root().join("include/mallocspy.h"))), (Some(b), Some(s), Some(h)) if b > s && b > h)
    };
    if fresh(&dst) {
        return dst;
    }
    let cc = if source.ends_with(".cpp") { "g++" } else { "gcc" };
    let tmp = fixture_dir().join(format!(".{out}.{}", std::process::id()));
    let status = Command::new(cc)
        // -fno-builtin: keep every allocator call the source makes (GCC folds realloc(NULL, n)
        // into malloc and drops unused malloc/free pairs).
        .args(["-O2", "-g", "-fno-builtin", "-fno-omit-frame-pointer", "-pthread", "-w", "-I"])
        .arg(root().join("include"))
        .args(extra.iter().filter(|a| !a.starts_with("-l") && !a.starts_with("-Wl,")))
        .arg("-o")
        .arg(&tmp)
        .arg(&src)
        .args(extra.iter().filter(|a| a.starts_with("-l") || a.starts_with("-Wl,")))
        .status()
        .expect("the C compiler runs");
    assert!(status.success(), "compiling {source} failed");
    std::fs::rename(&tmp, &dst).unwrap();
    dst
}

/// A C/C++ fixture program.
pub fn c_program(source: &str) -> PathBuf {
    c_program_with(source, &[])
}

/// A C/C++ fixture program built with extra compiler flags (libraries to link).
pub fn c_program_with(source: &str, extra: &[&str]) -> PathBuf {
    let name = source.rsplit_once('.').unwrap().0;
    compile(source, name, extra)
}

/// A C fixture program linked to the fixture library built from `library` (`lib<name>.so`),
/// which the program finds by its run path.
pub fn c_program_linked(source: &str, library: &str) -> PathBuf {
    let built = c_library(library);
    let dir = built.parent().unwrap().display().to_string();
    let name = library.rsplit_once('.').unwrap().0;
    c_program_with(source, &[&format!("-L{dir}"), &format!("-l{name}"), &format!("-Wl,-rpath,{dir}")])
}

/// A C fixture built with `extra` flags as `<name>-<variant>`, beside its plain build.
pub fn c_program_variant(source: &str, variant: &str, extra: &[&str]) -> PathBuf {
    let name = source.rsplit_once('.').unwrap().0;
    compile(source, &format!("{name}-{variant}"), extra)
}

/// A C fixture built as a fixed-address executable (`<name>-no-pie`): its code lies at the
/// addresses of its file, 0x400000 and up, at another offset in the file.
pub fn fixed_address_c_program(source: &str) -> PathBuf {
    c_program_variant(source, "no-pie", &["-fno-pie", "-no-pie"])
}

/// A C fixture linked statically (`<name>-static`): no loader, so no `LD_PRELOAD`.
pub fn static_c_program(source: &str) -> PathBuf {
    c_program_variant(source, "static", &["-static"])
}

/// A C fixture built as a shared library `lib<name>.so`.
pub fn c_library(source: &str) -> PathBuf {
    let name = source.rsplit_once('.').unwrap().0;
    compile(source, &format!("lib{name}.so"), &["-shared", "-fPIC"])
}

/// A C fixture library `lib<name>.so` that needs the fixture library built from `library`,
/// which it finds by its run path.
pub fn c_library_needing(source: &str, library: &str) -> PathBuf {
    let built = c_library(library);
    let dir = built.parent().unwrap().display().to_string();
    let (name, needed) = (source.rsplit_once('.').unwrap().0, library.rsplit_once('.').unwrap().0);
    let (search, link, run_path) = (format!("-L{dir}"), format!("-l{needed}"), format!("-Wl,-rpath,{dir}"));
    compile(source, &format!("lib{name}.so"), &["-shared", "-fPIC", &search, "-Wl,--no-as-needed", &link, &run_path])
}

/// A binary of one of the Rust fixture workspaces under `tests/fixtures/rust/`.
pub fn rust_program(workspace: &str, bin: &str) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let target = root().join("target/fixtures-rust");
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.iter().any(|w| w == workspace) {
        cargo(&["build", "-q"], &root().join("tests/fixtures/rust").join(workspace), Some(&target));
        built.push(workspace.to_string());
    }
    target.join(if is_release() { "release" } else { "debug" }).join(bin)
}

/// The read-only workloads of `../shared/bench` (or `$MALLOCSPY_SHARED/bench`), built into
/// `target/bench` once.
pub fn bench_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shared =
            std::env::var_os("MALLOCSPY_SHARED").map(PathBuf::from).unwrap_or_else(|| root().join("../shared"));
        let out = root().join("target/bench");
        std::fs::create_dir_all(&out).unwrap();
        let status = Command::new("make")
            .arg("-s")
            .arg("-C")
            .arg(shared.join("bench"))
            .arg(format!("OUT={}", out.display()))
            .status()
            .expect("make runs");
        assert!(status.success(), "building the shared bench workloads failed");
        out
    })
    .clone()
}

/// The real Python executable (the `python3` on PATH may be a shell shim, e.g. pyenv's).
pub fn python() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let out =
            Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().expect("python3 runs");
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

/// How a program runs: natively, or under the shim with `MALLOCSPY_OPTIONS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Native,
    Shim(&'static str),
}

/// The shim with no spy: a pure pass-through.
pub const PASS_THROUGH: Mode = Mode::Shim("spy=none");

/// The shim's default spy (the leak tracker), reporting in JSON (read it with [`json_report`]).
pub const JSON_REPORT: Mode = Mode::Shim("report_format=json");

impl Mode {
    /// Native, the shim with no spy, and the shim with each built-in spy (options unset is
    /// the leak tracker, as a preloaded LeakSanitizer; ticks without a trace file writes a
    /// summary line).
    pub const ALL: [Mode; 6] = [
        Mode::Native,
        PASS_THROUGH,
        Mode::Shim("spy=count"),
        Mode::Shim("spy=guard"),
        Mode::Shim(""),
        Mode::Shim("spy=ticks"),
    ];

    pub fn apply(self, cmd: &mut Command) {
        cmd.env_remove("LD_PRELOAD").env_remove("MALLOCSPY_OPTIONS");
        if let Mode::Shim(options) = self {
            cmd.env("LD_PRELOAD", shim());
            if !options.is_empty() {
                cmd.env("MALLOCSPY_OPTIONS", options);
            }
        }
    }
}

/// Waits for `child` until `limit` has passed, then kills it (a hang fails the caller's
/// assertions on its status rather than the whole test run); its output.
pub fn output_within(mut child: std::process::Child, limit: std::time::Duration) -> Output {
    let deadline = std::time::Instant::now() + limit;
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = child.kill();
    child.wait_with_output().unwrap()
}

/// Runs `cmd` in `mode`.
pub fn run(mode: Mode, cmd: &mut Command) -> Output {
    mode.apply(cmd);
    cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

/// Runs the command `make()` builds in every mode and checks stdout and exit status are the
/// native ones. Returns the outputs, native first.
pub fn same_in_every_mode(what: &str, make: impl Fn() -> Command) -> Vec<(Mode, Output)> {
    let outputs: Vec<(Mode, Output)> = Mode::ALL.iter().map(|&m| (m, run(m, &mut make()))).collect();
    let native = &outputs[0].1;
    for (mode, out) in &outputs[1..] {
        assert_eq!(
            out.status.code(),
            native.status.code(),
            "{what} under {mode:?}: exit status differs\nstderr: {}",
            text(&out.stderr)
        );
        if out.stdout != native.stdout {
            panic!(
                "{what} under {mode:?}: stdout differs from the native run\n--- native ({} bytes)\n{}\n--- {mode:?} ({} bytes)\n{}\nstderr: {}",
                native.stdout.len(),
                head(&native.stdout),
                out.stdout.len(),
                head(&out.stdout),
                text(&out.stderr)
            );
        }
        if *mode == Mode::Shim("spy=count") {
            count_report(&out.stderr)
                .unwrap_or_else(|| panic!("{what}: no count report on stderr:\n{}", text(&out.stderr)));
        }
        if *mode == Mode::Shim("spy=guard") {
            assert!(!text(&out.stderr).contains("mallocspy: guard:"), "{what}: guard findings:\n{}", text(&out.stderr));
        }
        if *mode == Mode::Shim("spy=ticks") {
            assert!(
                text(&out.stderr).contains("mallocspy: ticks: "),
                "{what}: no ticks summary on stderr:\n{}",
                text(&out.stderr)
            );
        }
        if *mode == Mode::Shim("") {
            assert!(
                text(&out.stderr).contains("LEAK SUMMARY:"),
                "{what}: no leak report on stderr:\n{}",
                text(&out.stderr)
            );
        }
    }
    outputs
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn head(bytes: &[u8]) -> String {
    let t = text(bytes);
    t.lines().take(40).collect::<Vec<_>>().join("\n")
}

/// The last count-spy report (a JSON line with "calls") in `stderr`.
pub fn count_report(stderr: &[u8]) -> Option<serde_json::Value> {
    text(stderr).lines().rev().filter(|l| l.starts_with("{\"calls\"")).find_map(|l| serde_json::from_str(l).ok())
}

/// A count from a count-spy report.
pub fn calls(report: &serde_json::Value, entry: &str) -> u64 {
    report["calls"][entry].as_u64().unwrap_or_else(|| panic!("no calls.{entry} in {report}"))
}

/// `key=value` pairs of a line such as churn's `calls: malloc=1 free=2`.
pub fn key_values(line: &str) -> std::collections::HashMap<String, u64> {
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

/// The JSON leak report (`report_format=json`) among what the process wrote on stderr.
pub fn json_report(out: &Output) -> serde_json::Value {
    let stderr = text(&out.stderr);
    let line =
        stderr.lines().find(|l| l.starts_with("{\"pid\"")).unwrap_or_else(|| panic!("no JSON report:\n{stderr}"));
    serde_json::from_str(line).unwrap()
}
