//! Real programs, run natively and with the shim preloaded (no spy, spy=count, spy=guard):
//! same stdout, same exit status, a count report, no guard finding.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

#[test]
fn python3_with_pythonmalloc_malloc() {
    let script = r#"
import json, re, collections
d = {str(i): [i, i * i, str(i) * 3] for i in range(20000)}
s = json.dumps(d, sort_keys=True)
back = json.loads(s)
words = re.findall(r"[0-9]+", s)
c = collections.Counter(w[-1] for w in words)
print(len(s), len(back), sorted(c.items())[:3], sum(len(v[2]) for v in back.values()))
class Node:
    def __init__(self, v, nxt): self.v, self.nxt = v, nxt
head = None
for i in range(50000): head = Node(i, head)
total = 0
while head: total += head.v; head = head.nxt
print(total, sorted(set(range(0, 100000, 7)) & set(range(0, 100000, 11)))[:5])
"#;
    same_in_every_mode("python3", || {
        let mut c = Command::new(python());
        c.args(["-c", script]).env("PYTHONMALLOC", "malloc").env("PYTHONHASHSEED", "0");
        c
    });
}

#[test]
fn sqlite3_on_the_insert_script() {
    let bench = bench_dir();
    let outputs = same_in_every_mode("sqlite3", || {
        let mut c = Command::new("sqlite3");
        c.args([":memory:", ".read insert.sql"]).current_dir(&bench);
        c
    });
    assert!(!outputs[0].1.stdout.is_empty(), "sqlite3 printed its aggregate");
}

/// A git session: init, add, commit, log, gc, in a fresh directory per mode.
fn git_session(dir: &Path) -> Command {
    let script = r#"
set -e
git init -q -b main .
for i in 1 2 3; do
  seq 1 $((i * 1000)) > file$i.txt
  git add file$i.txt
  git commit -q -m "commit $i"
done
git log --format='%H %s'
git gc -q
git count-objects -v | grep -E '^(count|in-pack|packs)'
git fsck --no-progress && echo fsck ok
"#;
    let mut c = Command::new("bash");
    c.args(["-c", script]).current_dir(dir);
    for (k, v) in [
        ("GIT_AUTHOR_NAME", "Spy"),
        ("GIT_AUTHOR_EMAIL", "spy@example.com"),
        ("GIT_COMMITTER_NAME", "Spy"),
        ("GIT_COMMITTER_EMAIL", "spy@example.com"),
        ("GIT_AUTHOR_DATE", "2026-01-01T00:00:00Z"),
        ("GIT_COMMITTER_DATE", "2026-01-01T00:00:00Z"),
        ("GIT_CONFIG_NOSYSTEM", "1"),
        ("HOME", dir.to_str().unwrap()),
    ] {
        c.env(k, v);
    }
    c
}

#[test]
fn git_init_add_commit_log_gc() {
    let dirs: Vec<_> = (0..Mode::ALL.len()).map(|_| tempfile::tempdir().unwrap()).collect();
    let next = std::cell::Cell::new(0);
    let outputs = same_in_every_mode("git", || {
        let i = next.get();
        next.set(i + 1);
        git_session(dirs[i].path())
    });
    assert!(text(&outputs[0].1.stdout).contains("fsck ok"));
}

#[test]
fn sort_a_large_file() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("numbers.txt");
    let mut x: u64 = 1;
    let lines: Vec<String> = (0..200_000)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            format!("{} line{}", x >> 40, x % 97)
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    same_in_every_mode("sort", || {
        let mut c = Command::new("sort");
        c.arg("-n").arg(&input).env("LC_ALL", "C");
        c
    });
}

#[test]
fn gcc_compiles_a_file() {
    let dirs: Vec<_> = (0..Mode::ALL.len()).map(|_| tempfile::tempdir().unwrap()).collect();
    let next = std::cell::Cell::new(0);
    same_in_every_mode("gcc", || {
        let i = next.get();
        next.set(i + 1);
        let mut c = Command::new("gcc");
        c.args(["-O2", "-c", "-o"]).arg(dirs[i].path().join("matrix.o")).arg(root().join("tests/fixtures/matrix.c"));
        c
    });
    let objects: Vec<Vec<u8>> = dirs.iter().map(|d| std::fs::read(d.path().join("matrix.o")).unwrap()).collect();
    assert!(objects.iter().all(|o| o == &objects[0]), "gcc produced the same object in every mode");
}

#[test]
fn churn_multithreaded_with_cross_thread_frees() {
    let churn = bench_dir().join("churn");
    same_in_every_mode("churn", || {
        let mut c = Command::new(&churn);
        c.args(["2", "200000"]);
        c
    });
}

#[test]
fn cxx_new_delete_exceptions_threads() {
    let program = c_program("cxx_stress.cpp");
    same_in_every_mode("cxx_stress", || Command::new(&program));
}

#[test]
fn rust_over_aligned_allocations() {
    let program = rust_program("spies", "aligned");
    same_in_every_mode("rust aligned", || Command::new(&program));
}

#[test]
fn bash_forks_and_execs_children() {
    let script = r#"
for i in 1 2 3 4 5; do
  ( echo "subshell $i $(echo nested $i)" )
  /bin/echo "exec $i"
done
x=$(seq 1 1000 | sort -rn | head -3 | tr '\n' ' ')
echo "pipeline: $x"
f() { local v; v=$(printf '%s' "$1" | tr a-z A-Z); echo "$v"; }
f hello
exit 7
"#;
    let outputs = same_in_every_mode("bash", || {
        let mut c = Command::new("bash");
        c.args(["-c", script]);
        c
    });
    assert_eq!(outputs[0].1.status.code(), Some(7));
    // Every process of the session wrote its own count report (bash, subshells, the execs).
    let reports = text(&outputs[2].1.stderr).lines().filter(|l| l.starts_with("{\"calls\"")).count();
    assert!(reports >= 10, "one count report per process, got {reports}");
}

#[test]
fn ls_closes_stderr_early_and_the_report_still_arrives() {
    same_in_every_mode("ls", || {
        let mut c = Command::new("ls");
        c.args(["-la", "/usr/lib", "/usr/bin/"]);
        c
    });
}

/// The shim's own start-up allocations stay out of the program's heap, so without a spy,
/// with the counting spy, and with a malformed option the program's blocks land where they
/// land natively (glibc's trimming follows the layout: one stray block once cost churn 13%
/// more page faults).
#[test]
fn the_program_heap_layout_is_untouched_by_the_shim_and_the_counting_spy() {
    let program = c_program("heap_layout.c");
    let native = run(Mode::Native, &mut Command::new(&program));
    assert!(native.status.success() && text(&native.stdout).contains("first block at page offset"));
    for mode in [PASS_THROUGH, Mode::Shim("spy=count"), Mode::Shim("spy=count:no_such_option=1")] {
        let out = run(mode, &mut Command::new(&program));
        assert_eq!(
            text(&out.stdout),
            text(&native.stdout),
            "{mode:?}: the heap layout differs from the native run\nstderr: {}",
            text(&out.stderr)
        );
    }
}

/// A Go program with cgo leaves by the exit system call, past C's exit, and no report was
/// written, without a word (review helper 96): it now says so at start; one that calls C's
/// exit gets its report.
#[test]
fn a_go_program_is_told_apart_and_its_report_comes_with_cs_exit() {
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("go_cgo");
    let built = Command::new("go")
        .arg("build")
        .arg("-o")
        .arg(&program)
        .arg(root().join("tests/fixtures/go_cgo.go"))
        .env("CGO_ENABLED", "1")
        .env("GOCACHE", root().join("target/go-cache"))
        .env("GOPATH", dir.path())
        .env("GOFLAGS", "-mod=mod")
        .env("GO111MODULE", "off")
        .output()
        .expect("go (golang-go) runs");
    assert!(built.status.success(), "{}", text(&built.stderr));
    let said = "mallocspy: this is a Go program, which leaves by the exit system call, past C's exit";
    let out = run(Mode::Shim(""), &mut Command::new(&program));
    let stderr = text(&out.stderr);
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "done\n"), "{stderr}");
    assert!(stderr.starts_with(said) && !stderr.contains("LEAK SUMMARY"), "{stderr}");
    let out = run(Mode::Shim(""), Command::new(&program).arg("exit"));
    let stderr = text(&out.stderr);
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "done\n"), "{stderr}");
    assert!(stderr.contains("LEAK SUMMARY") && stderr.contains("4,242 bytes"), "{stderr}");
}

/// universal-ctags's sandbox (`--_interactive=sandbox`) puts the process under a libseccomp
/// filter, installed by the `seccomp` system call through libc's `syscall`, that kills every
/// call it does not list: under every spy the program died of SIGSYS at its exit (the
/// reports' `getpid`), and under the guard at a `free` (the return of a region's pages), where
/// natively it exits 0. The filter is now seen as `prctl`'s is: the reports are given up, in one
/// line.
#[test]
fn universal_ctags_in_its_seccomp_sandbox_ends_as_natively() {
    let dir = tempfile::tempdir().unwrap();
    let source = "int main(void) { return 0; }\nstatic int counter;\n";
    std::fs::write(dir.path().join("a.c"), source).unwrap();
    let request = format!("{{\"command\":\"generate-tags\",\"filename\":\"a.c\",\"size\":{}}}\n{source}", source.len());
    std::fs::write(dir.path().join("request"), request).unwrap();
    let trace = format!("spy=ticks:trace={}/t.%p.trace", dir.path().display());
    let traced: &'static str = Box::leak(trace.into_boxed_str());
    let ctags = |mode: Mode| {
        let mut c = Command::new("ctags");
        c.arg("--_interactive=sandbox")
            .current_dir(dir.path())
            .stdin(std::fs::File::open(dir.path().join("request")).unwrap());
        run(mode, &mut c)
    };
    let native = ctags(Mode::Native);
    assert!(
        native.status.success() && text(&native.stdout).contains("\"name\": \"counter\""),
        "ctags natively (install universal-ctags: scripts/install-deps.sh does): {native:?}"
    );
    for mode in Mode::ALL[1..].iter().copied().chain([Mode::Shim(traced)]) {
        let out = ctags(mode);
        assert_eq!((out.status.code(), &out.stdout), (Some(0), &native.stdout), "{mode:?}: {}", text(&out.stderr));
        let said = if mode == PASS_THROUGH {
            ""
        } else {
            "mallocspy: the program puts itself under a seccomp filter that may kill it for a system call it does not \
             expect; the reports at its end make such calls, so they are given up\n"
        };
        assert_eq!(text(&out.stderr), said, "{mode:?}");
    }
    // A run outlasting the statistics' interval, a sample at each allocation: its messages
    // after the filter woke the writer through the queue's futex, and its statistics took
    // the CPU clock, neither of which the sandbox allows (SIGSYS in 2 runs of 3; once in CI).
    let busy = format!("spy=ticks:stats_interval_ms=1:sample_interval=1:trace={}/b.%p.trace", dir.path().display());
    let busy: &'static str = Box::leak(busy.into_boxed_str());
    for _ in 0..5 {
        let out = ctags(Mode::Shim(busy));
        assert_eq!((out.status.code(), &out.stdout), (Some(0), &native.stdout), "{}", text(&out.stderr));
    }
}
