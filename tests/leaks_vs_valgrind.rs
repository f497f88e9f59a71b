//! The compatibility matrix's real programs under the leak tracker: no definite leak that
//! valgrind memcheck does not report too. (Identical stdout and exit status under the
//! tracker is checked by `real_programs.rs`, where it is one of the modes.)

mod common;

use common::*;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// Definitely lost blocks of a run (all its processes), and the functions that allocated
/// them (the first named frame past the allocator's own wrappers); and the possibly lost.
#[derive(Debug, Default)]
struct Definite {
    blocks: u64,
    bytes: u64,
    functions: BTreeSet<String>,
    /// Possibly lost (blocks, bytes).
    possibly: (u64, u64),
}

/// Frames that name nothing of the program: the allocator's wrappers, and what lies below
/// `main` (valgrind calls it "(below main)"; a stripped program has no other names).
fn is_uninformative(function: &str) -> bool {
    function.starts_with("__libc_start") || function == "_start" || function == "(below main)" || is_allocator(function)
}

fn is_allocator(function: &str) -> bool {
    let f = function.trim_start_matches("__libc_").trim_start_matches("__GI_");
    [
        "malloc",
        "calloc",
        "realloc",
        "reallocarray",
        "strdup",
        "strndup",
        "xmalloc",
        "xcalloc",
        "xrealloc",
        "xstrdup",
        "xmemdup",
        "memalign",
        "posix_memalign",
        "aligned_alloc",
    ]
    .contains(&f)
        || f.starts_with("operator new")
        || f.starts_with("__rust_alloc")
        || f.starts_with("alloc::")
}

fn ours(dir: &Path, make: &dyn Fn(&Path) -> Command) -> Definite {
    let logs = dir.join("ours");
    std::fs::create_dir_all(&logs).unwrap();
    let mut cmd = make(dir);
    let out = cmd
        .env("LD_PRELOAD", shim())
        .env("MALLOCSPY_OPTIONS", format!("report_format=json:log_path={}/%p.json", logs.display()))
        .output()
        .unwrap();
    assert!(out.status.code().is_some(), "{cmd:?} was killed: {}", text(&out.stderr));
    let mut d = Definite::default();
    for entry in std::fs::read_dir(&logs).unwrap() {
        let body = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in body.lines() {
            let report: serde_json::Value = serde_json::from_str(line).unwrap();
            d.blocks += report["summary"]["definitely_lost"]["blocks"].as_u64().unwrap();
            d.bytes += report["summary"]["definitely_lost"]["bytes"].as_u64().unwrap();
            d.possibly.0 += report["summary"]["possibly_lost"]["blocks"].as_u64().unwrap();
            d.possibly.1 += report["summary"]["possibly_lost"]["bytes"].as_u64().unwrap();
            for r in report["leaks"].as_array().unwrap().iter().filter(|r| r["kind"] == "definitely_lost") {
                let named = r["stack"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|f| f["function"].as_str())
                    .find(|f| !is_uninformative(f));
                if let Some(f) = named {
                    d.functions.insert(f.to_string());
                }
            }
        }
    }
    d
}

fn valgrind(dir: &Path, make: &dyn Fn(&Path) -> Command) -> Definite {
    let logs = dir.join("valgrind");
    std::fs::create_dir_all(&logs).unwrap();
    let inner = make(dir);
    let mut cmd = Command::new("valgrind");
    cmd.args(["--leak-check=full", "--show-leak-kinds=definite", "--trace-children=yes", "--num-callers=24"])
        .arg(format!("--log-file={}/%p.log", logs.display()))
        .arg(inner.get_program())
        .args(inner.get_args())
        .envs(inner.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .env_remove("LD_PRELOAD")
        .current_dir(inner.get_current_dir().unwrap_or(dir));
    let out = cmd.output().unwrap();
    assert!(out.status.code().is_some(), "valgrind {:?}: {}", inner.get_program(), text(&out.stderr));
    let mut d = Definite::default();
    for entry in std::fs::read_dir(&logs).unwrap() {
        let log = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        let mut in_record = false;
        for line in log.lines() {
            let body = line.split_once("== ").map_or(line, |(_, b)| b).trim();
            // "1,234 bytes in 5 blocks"
            let numbers = |rest: &str| -> Vec<u64> {
                rest.split_whitespace().filter_map(|w| w.replace(',', "").parse().ok()).collect()
            };
            if let Some(rest) = body.strip_prefix("definitely lost: ") {
                let nums = numbers(rest);
                d.bytes += nums[0];
                d.blocks += nums[1];
            }
            if let Some(rest) = body.strip_prefix("possibly lost: ") {
                let nums = numbers(rest);
                d.possibly = (d.possibly.0 + nums[1], d.possibly.1 + nums[0]);
            }
            if body.contains("are definitely lost in loss record") {
                in_record = true;
                continue;
            }
            if in_record {
                // "at 0x4848899: malloc (vg_replace_malloc.c:381)" / "by 0x...: foo (file.c:12)"
                match body.split_once(": ") {
                    Some((at, function)) if at.starts_with("at 0x") || at.starts_with("by 0x") => {
                        let name = function.rsplit_once(" (").map_or(function, |(n, _)| n);
                        d.functions.insert(name.to_string());
                    }
                    _ => in_record = false,
                }
            }
        }
    }
    d
}

/// Runs `make`'s program under both tools and checks mallocspy's definite leaks are among
/// valgrind's.
fn compare(what: &str, make: &dyn Fn(&Path) -> Command) {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let ours = ours(&a, make);
    let theirs = valgrind(&b, make);
    assert!(
        ours.blocks <= theirs.blocks && ours.bytes <= theirs.bytes,
        "{what}: mallocspy reports {} definitely lost blocks ({} bytes), valgrind {} ({} bytes)\nours: {:?}\nvalgrind: {:?}",
        ours.blocks,
        ours.bytes,
        theirs.blocks,
        theirs.bytes,
        ours.functions,
        theirs.functions
    );
    let unknown: Vec<&String> = ours.functions.iter().filter(|f| !theirs.functions.contains(*f)).collect();
    assert!(
        unknown.is_empty(),
        "{what}: definite leaks at {unknown:?} that valgrind does not report ({:?})",
        theirs.functions
    );
}

/// C++ keeps a `new[]` array of objects with destructors by a pointer to the word after the
/// element count that starts the block, and an object by a pointer to its second base:
/// memcheck's `newarray` and `multipleinheritance` heuristics (on by default) count such
/// blocks reachable. mallocspy called what `cxx_arrays.cpp` keeps so possibly lost: 4 blocks
/// of 300 bytes where memcheck reports the one malloc'ed block kept by a pointer into its
/// middle, 100 bytes (3 of 260 with the `newarray` heuristic alone).
#[test]
fn possibly_lost_blocks_of_a_cxx_program_are_memchecks() {
    let program = c_program("cxx_arrays.cpp");
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let (ours, theirs) = (ours(&a, &|_| Command::new(&program)), valgrind(&b, &|_| Command::new(&program)));
    assert_eq!(theirs.possibly, (1, 100), "valgrind: {theirs:?}");
    assert_eq!(ours.possibly, theirs.possibly, "ours: {ours:?}");
}

#[test]
fn python3() {
    compare("python3", &|_| {
        let mut c = Command::new(python());
        c.args(["-c", "import json; d = {str(i): [i] * 3 for i in range(3000)}; print(len(json.dumps(d)))"])
            .env("PYTHONMALLOC", "malloc");
        c
    });
}

#[test]
fn sqlite3() {
    compare("sqlite3", &|dir| {
        let sql = dir.join("small.sql");
        let mut body =
            String::from("CREATE TABLE t(a INTEGER PRIMARY KEY, b TEXT);\nCREATE INDEX tb ON t(b);\nBEGIN;\n");
        for i in 0..3000 {
            body.push_str(&format!("INSERT INTO t(b) VALUES('row {i} {}');\n", i * 7919 % 1000));
        }
        body.push_str("COMMIT;\nSELECT count(*), count(DISTINCT b) FROM t;\n");
        std::fs::write(&sql, body).unwrap();
        let mut c = Command::new("sqlite3");
        c.arg(":memory:").arg(format!(".read {}", sql.display())).current_dir(dir);
        c
    });
}

#[test]
fn git() {
    compare("git", &|dir| {
        let mut c = Command::new("bash");
        c.args(["-c", "git init -q -b main . && seq 1 500 > f && git add f && git -c user.name=a -c user.email=a@b commit -q -m m && git log --oneline | wc -l"])
            .current_dir(dir)
            .env("HOME", dir)
            .env("GIT_CONFIG_NOSYSTEM", "1");
        c
    });
}

#[test]
fn sort_and_ls_and_bash() {
    compare("sort", &|_| {
        let mut c = Command::new("sort");
        c.arg("/etc/passwd");
        c
    });
    compare("ls", &|_| {
        let mut c = Command::new("ls");
        c.args(["-la", "/usr/lib"]);
        c
    });
    compare("bash", &|_| {
        let mut c = Command::new("bash");
        c.args(["-c", "for i in 1 2 3; do ( echo $i ); done; x=$(echo hi | tr a-z A-Z); echo $x"]);
        c
    });
}

#[test]
fn gcc() {
    compare("gcc", &|dir| {
        let mut c = Command::new("gcc");
        c.args(["-O2", "-c", "-o"]).arg(dir.join("m.o")).arg(root().join("tests/fixtures/matrix.c"));
        c
    });
}

#[test]
fn churn_cxx_and_rust() {
    let churn = bench_dir().join("churn");
    compare("churn", &|_| {
        let mut c = Command::new(&churn);
        c.args(["2", "20000"]);
        c
    });
    let cxx = c_program("cxx_stress.cpp");
    compare("cxx_stress", &|_| Command::new(&cxx));
    let aligned = rust_program("spies", "aligned");
    compare("rust aligned", &|_| Command::new(&aligned));
}

/// The shim preloaded into a program that valgrind runs sees none of its allocations (the
/// tool replaces the malloc family by the code): its report says so, under the program's
/// name, where it read as a clean bill for valgrind's own executable (review helper 103).
#[test]
fn under_valgrind_the_report_says_it_saw_nothing() {
    let program = c_program("lose_one.c");
    let out = Command::new("valgrind")
        .args(["-q", "--leak-check=no"])
        .arg(&program)
        .arg("100")
        .env("LD_PRELOAD", shim())
        .env("MALLOCSPY_OPTIONS", "report_format=json")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report = json_report(&out);
    let notes = report["notes"].to_string();
    assert!(notes.contains("malloc resolves to valgrind's replacements"), "{report}");
    assert!(report["program"].as_str().is_some_and(|p| p.ends_with("/lose_one")), "{report}");
}

/// Under valgrind no spy can be registered, through the shim or in a program that is its own
/// interposer: the tool's replacements serve the malloc family, and a spy registered there was
/// never called (review helper 164).
#[test]
fn under_valgrind_registering_a_spy_answers_not_interposed() {
    let through_the_shim = Command::new("valgrind")
        .args(["-q", "--leak-check=no"])
        .arg(c_program("register.c"))
        .env("LD_PRELOAD", shim())
        .env("MALLOCSPY_OPTIONS", "spy=none")
        .output()
        .unwrap();
    assert_eq!(
        (through_the_shim.status.code(), text(&through_the_shim.stdout).as_str()),
        (Some(2), "no interposer\n"),
        "{}",
        text(&through_the_shim.stderr)
    );
    let program = rust_program("interposer", "rust-interposer");
    let own = Command::new("valgrind").args(["-q", "--leak-check=no"]).arg(&program).arg("register").output().unwrap();
    assert_eq!(text(&own.stdout), "Err(NotInterposed)\n", "{}", text(&own.stderr));
    let native = Command::new(&program).arg("register").output().unwrap();
    assert_eq!(text(&native.stdout), "Ok(())\n");
}

/// The guard's alloc-dealloc-mismatch findings are memcheck's "Mismatched free() / delete /
/// delete []" errors, release for release.
#[test]
fn mismatched_releases_are_memchecks() {
    let program = c_program("cxx_mismatch.cpp");
    let memcheck = Command::new("valgrind").args(["-q", "--leak-check=no"]).arg(&program).output().unwrap();
    assert_eq!(memcheck.status.code(), Some(3), "{}", text(&memcheck.stderr));
    let memcheck = text(&memcheck.stderr);
    let guard =
        Command::new(&program).env("LD_PRELOAD", shim()).env("MALLOCSPY_OPTIONS", "spy=guard").output().unwrap();
    assert_eq!(guard.status.code(), Some(3));
    let guard = text(&guard.stderr);
    // Where each was released: memcheck's first frame below the release, the guard's site.
    let lines = |report: &str, error: &str, frame: &str| -> Vec<String> {
        let mut found = Vec::new();
        let mut after_error = false;
        for line in report.lines() {
            if line.contains(error) {
                after_error = true;
            } else if after_error && line.contains(frame) && line.contains("cxx_mismatch.cpp:") {
                found.push(line.rsplit_once("cxx_mismatch.cpp:").unwrap().1.trim_end_matches(')').to_owned());
                after_error = false;
            }
        }
        found
    };
    let by_memcheck = lines(&memcheck, "Mismatched free() / delete / delete []", "by 0x");
    let by_guard = lines(&guard, "guard: alloc-dealloc-mismatch (", "#0 ");
    assert_eq!(by_memcheck.len(), 5, "{memcheck}");
    assert_eq!(by_guard, by_memcheck, "{guard}\n{memcheck}");
}
