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
