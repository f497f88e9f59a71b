//! mallocspy over jemalloc and tcmalloc: `LD_PRELOAD="<shim> <allocator>"` runs programs with
//! every block served (and introspected) by that allocator, with and without spies.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Output};

const JEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";
const TCMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4";

fn require(lib: &str) {
    assert!(Path::new(lib).exists(), "{lib} is missing: install libjemalloc2 and libtcmalloc-minimal4 (.ci/run does)");
}

/// Runs `cmd` with the allocator preloaded alone, or behind the shim with `options`.
fn with(allocator: &str, shim_options: Option<&str>, cmd: &mut Command) -> Output {
    cmd.env_remove("MALLOCSPY_OPTIONS");
    match shim_options {
        None => cmd.env("LD_PRELOAD", allocator),
        Some(o) => cmd.env("LD_PRELOAD", format!("{} {allocator}", shim().display())).env("MALLOCSPY_OPTIONS", o),
    };
    cmd.output().unwrap()
}

fn composes_with(allocator: &str, name: &str) {
    require(allocator);
    let owner = c_program("allocator_owner.c");
    let bench = bench_dir();
    let python_script = "import json; d = {i: str(i) * 5 for i in range(30000)}; print(len(json.dumps(d)))";
    for options in ["", "spy=count", "spy=guard"] {
        let out = with(allocator, Some(options), Command::new(&owner).arg(name));
        assert_eq!(text(&out.stdout), format!("allocator_owner: {name} ok\n"), "{options}: {}", text(&out.stderr));

        let base =
            with(allocator, None, Command::new("sqlite3").args([":memory:", ".read insert.sql"]).current_dir(&bench));
        let spied = with(
            allocator,
            Some(options),
            Command::new("sqlite3").args([":memory:", ".read insert.sql"]).current_dir(&bench),
        );
        assert!(base.status.success() && !base.stdout.is_empty());
        assert_eq!(
            (spied.status.code(), &spied.stdout),
            (base.status.code(), &base.stdout),
            "sqlite3 over {name} with {options:?}"
        );

        let py =
            |o| with(allocator, o, Command::new(python()).args(["-c", python_script]).env("PYTHONMALLOC", "malloc"));
        let (base, spied) = (py(None), py(Some(options)));
        assert_eq!(
            (spied.status.code(), &spied.stdout),
            (base.status.code(), &base.stdout),
            "python3 over {name} with {options:?}"
        );
    }
}

#[test]
fn over_jemalloc() {
    composes_with(JEMALLOC, "jemalloc");
}

#[test]
fn over_tcmalloc() {
    composes_with(TCMALLOC, "tcmalloc");
}

#[test]
fn over_glibc() {
    let owner = c_program("allocator_owner.c");
    for mode in Mode::ALL {
        let out = run(mode, Command::new(&owner).arg("glibc"));
        assert_eq!(text(&out.stdout), "allocator_owner: glibc ok\n", "{mode:?}: {}", text(&out.stderr));
    }
}

/// Another allocator preloaded before the shim serves every call itself: the reports saw
/// nothing of the program's heap and would read as a clean bill ("0 allocs"), so mallocspy
/// names that allocator: a note of the leak report (its JSON stays JSON), a line above the
/// others. A wrapper preloaded before the shim that passes its calls on (heaptrack's preload
/// does) is spied on as ever, and nothing is said; a program's own allocator is named as such.
#[test]
fn an_allocator_preloaded_before_the_shim_is_named_beside_the_empty_reports() {
    const BYPASSED: &str = "no allocation reached mallocspy: malloc resolves to";
    let lose_one = c_program("lose_one.c");
    let preloaded = |first: &Path, options: &str| {
        Command::new(&lose_one)
            .arg("40")
            .env("LD_PRELOAD", format!("{} {}", first.display(), shim().display()))
            .env("MALLOCSPY_OPTIONS", options)
            .output()
            .unwrap()
    };
    for allocator in [JEMALLOC, TCMALLOC] {
        require(allocator);
        let said = format!("{BYPASSED} {allocator}, ahead of mallocspy (put libmallocspy_preload.so first");
        for options in ["spy=ticks", "spy=count"] {
            let out = preloaded(Path::new(allocator), options);
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(0), "{allocator} {options}: {stderr}");
            let first = stderr.lines().next().unwrap_or_default();
            assert!(first.starts_with(&format!("mallocspy: {said}")), "{options}: {stderr}");
            assert_eq!(stderr.matches(BYPASSED).count(), 1, "{options}: {stderr}");
        }
        let stderr = text(&preloaded(Path::new(allocator), "spy=leaks").stderr);
        assert!(stderr.contains("total heap usage: 0 allocs") && stderr.contains(&format!("note: {said}")), "{stderr}");
        let json: serde_json::Value =
            serde_json::from_slice(&preloaded(Path::new(allocator), "spy=leaks:report_format=json").stderr).unwrap();
        assert!(json["notes"][0].as_str().unwrap().starts_with(&said), "{json}");
    }
    let wrapper = c_library("forwarding_malloc.c");
    for options in ["spy=leaks", "spy=ticks:sample_interval=1g"] {
        let out = preloaded(&wrapper, options);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert!(!stderr.contains(BYPASSED), "{options}: {stderr}");
    }
    assert!(text(&preloaded(&wrapper, "spy=leaks").stderr).contains("40 bytes in 1 blocks are definitely lost"));
    let own = Command::new(c_program("own_allocator.c"))
        .env("LD_PRELOAD", shim())
        .env("MALLOCSPY_OPTIONS", "spy=count")
        .output()
        .unwrap();
    assert_eq!(text(&own.stdout), "own_allocator ok\n");
    assert!(text(&own.stderr).contains("malloc resolves to the program's own ("), "{}", text(&own.stderr));
}

/// jemalloc and tcmalloc define no `reallocarray`: preloaded before the shim, the program's
/// calls come to the shim's, which handed their blocks to glibc's `realloc` (`sort` crashed
/// with a segmentation fault), where glibc's own would call theirs. So too C23's sized frees,
/// which jemalloc 5 does not define: the shim's gave its blocks to glibc's `free`, which
/// aborted (review helper 139).
#[test]
fn reallocarray_reaches_the_allocator_preloaded_before_the_shim() {
    let input: String = (0..20_000u32).map(|i| format!("{}\n", i.wrapping_mul(2_654_435_761) % 100_000)).collect();
    let dir = std::env::temp_dir().join(format!("mallocspy-sort-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("in.txt");
    std::fs::write(&file, input).unwrap();
    let native = Command::new("sort").arg(&file).output().unwrap();
    assert!(native.status.success());
    for allocator in [JEMALLOC, TCMALLOC] {
        require(allocator);
        for options in ["", "spy=leaks"] {
            let out = Command::new("sort")
                .arg(&file)
                .env("LD_PRELOAD", format!("{allocator} {}", shim().display()))
                .env("MALLOCSPY_OPTIONS", options)
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(0), "{allocator} {options:?}: {}", text(&out.stderr));
            assert!(out.stdout == native.stdout, "{allocator} {options:?}");
            let sized = Command::new(c_program("free_sized.c"))
                .env("LD_PRELOAD", format!("{allocator} {}", shim().display()))
                .env("MALLOCSPY_OPTIONS", options)
                .output()
                .unwrap();
            assert_eq!(
                (sized.status.code(), text(&sized.stdout).as_str()),
                (Some(0), "freed 1000 pairs with the sized frees\n"),
                "{allocator} {options:?}: {}",
                text(&sized.stderr)
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Leaks made on a thread, over jemalloc: all three were reported still reachable, kept by
/// the stale addresses in jemalloc's thread caches (metadata it maps inside its calls, which
/// the scan took for the program's own memory: review helper 95). Over each allocator, the
/// report is glibc's.
#[test]
fn leaks_made_on_threads_are_lost_over_every_allocator() {
    let lost = |allocator: Option<&str>, program: &Path| {
        let mut cmd = Command::new(program);
        cmd.env("MALLOCSPY_OPTIONS", "report_format=json");
        match allocator {
            Some(a) => cmd.env("LD_PRELOAD", format!("{} {a}", shim().display())),
            None => cmd.env("LD_PRELOAD", shim()),
        };
        let report = json_report(&cmd.output().unwrap());
        let summary = &report["summary"];
        // With the whole report, for a failure's message.
        ((summary["definitely_lost"].clone(), summary["indirectly_lost"]["bytes"].clone()), report.to_string())
    };
    for (fixture, bytes) in [("thread_leak.c", 100), ("small_stack_leak.c", 4321), ("deep_then_shallow.c", 10010)] {
        let program = c_program(fixture);
        let (native, _) = lost(None, &program);
        assert_eq!(native.0["bytes"], bytes, "{fixture}");
        for allocator in [JEMALLOC, TCMALLOC] {
            require(allocator);
            // jemalloc caches the keys of its radix tree in each thread's TLS: addresses
            // rounded down to 1 GiB. A block that starts at such a boundary (one run in a few
            // hundred: 9 in 4,400 of small_stack_leak under load) is pointed at by the main
            // thread's TLS, and is reachable, as it is to memcheck and LeakSanitizer, which
            // scan TLS too. Three runs in a row find it so about once in a hundred million.
            let mut run = lost(Some(allocator), &program);
            for _ in 1..3 {
                if run.0 == native {
                    break;
                }
                run = lost(Some(allocator), &program);
            }
            assert_eq!(run.0, native, "{fixture} over {allocator}: {}", run.1);
        }
    }
}

/// A library preloaded after the shim that wraps `fstat` and `clock_gettime` and whose state
/// its destructor ends (libfaketime: `faketime DATE mallocspy run -- prog` preloads it so)
/// leaves the program's exit alone: the reports at exit make those calls themselves, and
/// crashed in its wrappers, the program's buffered output lost (review helper 103).
#[test]
fn a_wrapper_preloaded_after_the_shim_and_ended_before_its_reports_is_not_called() {
    let wrapper = c_library("late_wrapper.c");
    let program = c_program("lose_one.c");
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.trace");
    let trace_option = format!("spy=ticks:sample_interval=1:trace={}", trace.display());
    for options in ["report_format=json", "spy=count", trace_option.as_str()] {
        let out = Command::new(&program)
            .arg("100")
            .env("LD_PRELOAD", format!("{} {}", shim().display(), wrapper.display()))
            .env("MALLOCSPY_OPTIONS", options)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{options}: {:?} {}", out.status, text(&out.stderr));
        if options == "report_format=json" {
            assert_eq!(json_report(&out)["summary"]["definitely_lost"]["bytes"], 100, "{}", text(&out.stderr));
        }
    }
    assert!(std::fs::metadata(&trace).unwrap().len() > 0);
}

/// A C++ program's leaks over jemalloc and tcmalloc are its leaks over glibc: both define
/// C++'s operators, which served the program's `new` unseen before the shim exported its own
/// (no leak at all was found). Their own calls of `new` stay theirs: tcmalloc's start-up leaks
/// a `MallocExtension` of 8 bytes, which is not the program's.
#[test]
fn cxx_leaks_are_found_over_allocators_that_define_the_operators() {
    let program = c_program("cxx_leaks.cpp");
    let lost = |preload: String| {
        let out = Command::new(&program)
            .env("LD_PRELOAD", preload)
            .env("MALLOCSPY_OPTIONS", "report_format=json")
            .output()
            .unwrap();
        assert_eq!(text(&out.stdout), "0 0 0 1\n");
        json_report(&out)["summary"]["definitely_lost"].clone()
    };
    let native = lost(shim().display().to_string());
    assert_eq!((native["blocks"].as_u64(), native["bytes"].as_u64()), (Some(4), Some(100 + 40 + 64 + 77)));
    for allocator in [JEMALLOC, TCMALLOC] {
        require(allocator);
        assert_eq!(lost(format!("{} {allocator}", shim().display())), native, "over {allocator}");
    }
}
