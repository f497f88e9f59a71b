//! CoRegisterMallocSpy semantics from C (through the header), from a dlopen'ed plugin, from a
//! second preloaded library, from Rust through the shim, and from a Rust program that is its
//! own interposer.

mod common;

use common::*;
use std::process::Command;

fn assert_all_ok(what: &str, out: &std::process::Output) {
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{what} failed ({:?}):\n{stdout}\n{}", out.status, text(&out.stderr));
    assert!(!stdout.contains("FAILED"), "{what}:\n{stdout}");
    assert!(stdout.lines().filter(|l| l.ends_with(": ok")).count() >= 10, "{what} ran its checks:\n{stdout}");
}

/// A registered C spy whose function makes a cancellation point (a `write`) on a thread with a
/// cancellation pending: the thread is cancelled at its next cancellation point after the
/// hook, as natively, where glibc's unwinding from inside the hook aborted the process
/// ("FATAL: exception not rethrown", review helper 101).
#[test]
fn a_spy_making_a_cancellation_point_leaves_the_cancellation_to_the_program() {
    let program = c_program("cancel_in_spy.c");
    let mut cmd = Command::new(&program);
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    PASS_THROUGH.apply(&mut cmd);
    let out = output_within(cmd.spawn().unwrap(), std::time::Duration::from_secs(60));
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "cancelled\n"), "{}", text(&out.stderr));
}

#[test]
fn a_c_program_registers_a_header_spy_through_the_header() {
    let program = c_program("register.c");
    assert_all_ok("register.c", &run(PASS_THROUGH, &mut Command::new(&program)));
    // Without the shim there is no interposer to register with.
    let native = run(Mode::Native, &mut Command::new(&program));
    assert_eq!(text(&native.stdout).trim(), "no interposer");
}

/// The README's C spy, as written there, compiled and run through every entry point. The
/// example it showed had no realloc members: the first `realloc` of a program that copied it
/// aborted (`realloc(): invalid pointer`).
#[test]
fn the_readme_c_spy_runs_every_entry_point() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let section = readme.split("## A spy in C").nth(1).expect("the README's C section");
    let code = section.split("```c\n").nth(1).and_then(|c| c.split("```\n").next()).expect("its C block");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("readme_spy.c"), code).unwrap();
    let program = dir.path().join("readme_spy");
    let status = Command::new("gcc")
        .args(["-O2", "-g", "-fno-builtin", "-w", "-I"])
        .arg(root().join("include"))
        .arg("-I")
        .arg(dir.path())
        .arg("-o")
        .arg(&program)
        .arg(root().join("tests/fixtures/readme_spy_main.c"))
        .status()
        .unwrap();
    assert!(status.success(), "the README's spy compiles");
    let out = run(PASS_THROUGH, &mut Command::new(&program));
    assert_eq!(text(&out.stdout), "ok\n", "{}", text(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
}

/// The README's Rust spy, as written there (the fixture's `build.rs` takes it out), run
/// through every entry point by a Rust program under the shim. The example it showed left
/// its realloc members to a comment: a program that copied it aborted at its first realloc.
#[test]
fn the_readme_rust_spy_runs_every_entry_point() {
    let out = run(PASS_THROUGH, &mut Command::new(rust_program("spies", "readme_spy")));
    assert_eq!(text(&out.stdout), "ok\n", "{}", text(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
}

/// A handle no `dlclose` unloads, the program's own (`dlopen(NULL)`), is closed as usual
/// though the spy's code is in the program: it was refused, with a line saying the program
/// stays loaded.
#[test]
fn closing_the_programs_own_handle_is_not_refused() {
    let out = run(PASS_THROUGH, &mut Command::new(c_program_with("self_close.c", &["-ldl"])));
    assert_eq!(text(&out.stdout), "closed: 0\n", "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "");
}

/// A program that revokes mallocspy's own spies gets reports that say so: the leak report
/// listed the leak before the revoke and not the one after, as if that were all. The guard,
/// which writes no report when it found nothing, gets the line too (it spoke of "this
/// report").
#[test]
fn reports_say_when_the_program_revoked_the_built_in_spies() {
    let program = c_program("revoke_builtin.c");
    let out = run(Mode::Shim("report_format=json"), &mut Command::new(&program));
    assert_eq!(text(&out.stdout), "revoke: 0\n", "{}", text(&out.stderr));
    let report = text(&out.stderr);
    let json: serde_json::Value = serde_json::from_str(report.lines().find(|l| l.starts_with('{')).unwrap()).unwrap();
    assert_eq!(json["summary"]["definitely_lost"]["bytes"], 111, "{report}");
    let said = "the program revoked mallocspy's spies (revoke_spy): they saw nothing it did afterwards";
    assert_eq!(json["notes"], serde_json::json!([said]), "{report}");
    let out = run(Mode::Shim("spy=count"), &mut Command::new(&program));
    assert!(text(&out.stderr).contains(&format!("mallocspy: {said}\n")), "{}", text(&out.stderr));
    let out = run(Mode::Shim("spy=guard"), &mut Command::new(&program));
    assert_eq!(text(&out.stderr), format!("mallocspy: {said}\n"));
}

/// A library's constructor, run before the shim's, registered its own spy: the built-in
/// spies, which cannot register then, make no trace file and print no report (they printed
/// an empty one, "total heap usage: 0 allocs", or zero counts), only the line that says why.
#[test]
fn built_in_spies_that_cannot_register_say_so_and_report_nothing() {
    let host = c_program("plugin_host.c");
    let plugin = c_library("plugin.c");
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.%p.trace");
    for spies in ["spy=leaks", "spy=count", "spy=guard", &format!("spy=ticks:trace={}", trace.display())] {
        let out = Command::new(&host)
            .arg("preloaded")
            .env("LD_PRELOAD", format!("{} {}", shim().display(), plugin.display()))
            .env("PLUGIN_AUTOREGISTER", "1")
            .env("MALLOCSPY_OPTIONS", spies)
            .output()
            .unwrap();
        assert_eq!(text(&out.stdout), "spy saw 1000 mallocs\n", "{spies}: {}", text(&out.stderr));
        assert_eq!(
            text(&out.stderr),
            "mallocspy: cannot register the built-in spies: the program registered a malloc spy first; \
             no mallocspy report\n",
            "{spies}"
        );
        assert_eq!(out.status.code(), Some(0), "{spies}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no trace file");
}

#[test]
fn a_dlopened_plugin_registers_the_spy_the_interposer_calls() {
    let host = c_program("plugin_host.c");
    let plugin = c_library("plugin.c");
    let out = run(PASS_THROUGH, Command::new(&host).arg("dlopen").arg(&plugin));
    assert_eq!(text(&out.stdout), "register: 0\nspy saw 1000 mallocs\n", "{}", text(&out.stderr));
}

/// A plugin unloaded while its spy is registered stays loaded until the spy is released:
/// unmapped, its spy's code was called at the next allocation, and the program died of
/// SIGSEGV inside `dlclose` (the loader's own `free`). So does a spy in a dependency of the
/// closed library (that segfaulted even once a `dlclose` of the spy's own library was
/// refused), and a plugin opened twice goes once closed twice and its spy released (a
/// refused `dlclose` never gave its reference back).
#[test]
fn a_plugin_closed_with_its_spy_registered_stays_loaded_until_the_spy_is_released() {
    let host = c_program("plugin_host.c");
    let plugin = c_library("plugin.c");
    let outer = c_library_needing("plugin_outer.c", "plugin.c");
    for (mode, library) in [("dlclose", &plugin), ("dlclose2", &plugin), ("dlclose", &outer)] {
        let out = run(PASS_THROUGH, Command::new(&host).arg(mode).arg(library));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{mode} {}: {stderr}", library.display());
        let closes = if mode == "dlclose2" { "dlclose: 0\ndlclose: 0\n" } else { "dlclose: 0\n" };
        assert_eq!(
            text(&out.stdout),
            format!(
                "register: 0\nspy saw 1000 mallocs\n{closes}after dlclose, spy saw 1000 more mallocs\nrevoke: 0\n\
                 after revoke, the spy's code is unmapped\n"
            ),
            "{mode} {}: {stderr}",
            library.display()
        );
        assert_eq!(stderr, "", "{mode} {}", library.display());
    }
}

/// A plugin whose function is the tick callback stays loaded once `dlclose`d: mallocspy may
/// call it at any allocation (its `dlclose` was refused, the reference never given back).
#[test]
fn a_plugin_closed_with_its_tick_callback_set_stays_loaded() {
    let host = c_program("plugin_host.c");
    let plugin = c_library("plugin.c");
    let out = run(Mode::Shim("spy=ticks:sample_interval=64k"), Command::new(&host).arg("ticks").arg(&plugin));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let expected = "watch: 0\ndlclose: 0\nafter dlclose, the callback's code is mapped and saw ticks\n";
    assert_eq!(text(&out.stdout), expected, "{stderr}");
    assert!(!stderr.contains("stays loaded"), "{stderr}");
}

/// A thread inside `dlopen` holds the loader's lock while a library's constructor waits for
/// the hooks in flight (freeing a revoked spy's last block, or revoking a spy). A hook on
/// another thread that then needs that lock hung both, every run: a spy's `pre_free` calling
/// `register_spy`, which took a reference on the spy's library; and the free that dropped a
/// spy, which gave its library back with `dlclose`. Neither is done inside a hook now.
#[test]
fn no_hook_waits_for_the_loader_lock_of_a_thread_waiting_for_it() {
    let program = c_program_with("loader_lock.c", &["-rdynamic", "-ldl"]);
    let (constructor, spy) = (c_library("loader_lock_ctor.c"), c_library("loader_lock_spy.c"));
    for (mode, said) in [
        ("register", "register from the spy's pre_free: 0x800401fc\n"),
        ("release", "revoke from the constructor: done\n"),
    ] {
        let mut cmd = Command::new("timeout");
        cmd.args(["60", program.to_str().unwrap(), mode, constructor.to_str().unwrap(), spy.to_str().unwrap()]);
        let out = run(PASS_THROUGH, &mut cmd);
        assert_eq!(out.status.code(), Some(0), "{mode}: hung or failed: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), said, "{mode}");
    }
}

/// A child forked while another thread was revoking a spy (between claiming it and dropping
/// it) inherited the revoke half done, with no thread to finish it: every registration in the
/// child failed (`E_OBJISREG`) for good: 299 children of 300 here.
#[test]
fn a_child_forked_during_a_revoke_can_register() {
    let program = c_program("fork_registry.c");
    let out = run(PASS_THROUGH, Command::new(&program).arg("300"));
    assert_eq!(text(&out.stdout), "children that could not register: 0 of 300\n", "{}", text(&out.stderr));
}

/// A realloc of a block the spy never saw, on another thread, counted itself among the blocks
/// in flight while the revoked spy's last block was freed: that free found a block still
/// live and left the release to the realloc, which never did it; every later register failed
/// (review helper 39: on the first round, in 4 runs of 4).
#[test]
fn a_pending_revoke_ends_while_another_thread_reallocates() {
    let program = c_program("revoke_during_realloc.c");
    let out = run(PASS_THROUGH, Command::new(&program).arg("100"));
    assert_eq!(text(&out.stdout), "rounds that left the spy unreleased: 0 of 100\n", "{}", text(&out.stderr));
}

/// A spy that revokes itself from its `pre_alloc` while another thread frees its other block:
/// that free found the revoke settled and no block live, and released the spy while the
/// allocation went on to return a block with the spy's header, whose free then reached glibc
/// past it (SIGSEGV), or reached the next spy registered as the first one's (review helper 125).
#[test]
fn a_spy_that_revokes_itself_in_pre_alloc_lives_until_that_allocations_block_is_freed() {
    let program = c_program("revoke_in_pre_alloc.c");
    let out = run(PASS_THROUGH, &mut Command::new(&program));
    assert_eq!(
        text(&out.stdout),
        "start\nbefore its free: revoke pending 1, header 1, released 0, live 1, another refused 1\n\
         after: spied frees 2, released 1, another registered 1\n",
        "{:?} {}",
        out.status,
        text(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0));
}

/// A spy's `release` that registers a successor and revokes it: the revoke, made inside a
/// hook but not from a method of the successor, settles it at once, and the successor is
/// released. Left to a hook end that never retires it, it stayed registered for good, every
/// later registration refused (review helper 127).
#[test]
fn a_successor_registered_and_revoked_by_a_release_is_released() {
    let program = c_program("release_registers_and_revokes.c");
    let out = run(PASS_THROUGH, &mut Command::new(&program));
    assert_eq!(
        text(&out.stdout),
        "start\nrevoke pending 1, first released 1, successor registered 0 revoked 0 released 1, last registered 1\n",
        "{:?} {}",
        out.status,
        text(&out.stderr)
    );
}

#[test]
fn a_second_preloaded_library_registers_the_spy_the_interposer_calls() {
    let host = c_program("plugin_host.c");
    let plugin = c_library("plugin.c");
    let out = Command::new(&host)
        .arg("preloaded")
        .env("LD_PRELOAD", format!("{} {}", shim().display(), plugin.display()))
        .env("PLUGIN_AUTOREGISTER", "1")
        .env_remove("MALLOCSPY_OPTIONS")
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "spy saw 1000 mallocs\n", "{}", text(&out.stderr));
}

#[test]
fn a_rust_program_registers_through_the_preloaded_shim() {
    let program = rust_program("spies", "spies");
    assert_all_ok("spies registry", &run(PASS_THROUGH, Command::new(&program).arg("registry")));
}

/// Through the shim as in-process: a spy that revokes itself from inside its own method is
/// dropped once, after its last use (it was dropped inside the revoke, and the rest of the
/// call ran on freed memory), and an observer keeps its role (the shim took every remote spy
/// for one that interposes).
#[test]
fn through_the_shim_a_spy_may_revoke_itself_and_an_observer_keeps_its_role() {
    let program = rust_program("spies", "spies");
    let out = run(PASS_THROUGH, Command::new(&program).arg("api"));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert_eq!(stdout.lines().filter(|l| l.ends_with(": ok")).count(), 8, "{stdout}");
}

/// See `restart_scenario` in the fixture.
#[test]
fn a_refused_start_installs_nothing_and_a_restart_begins_afresh() {
    let program = rust_program("interposer", "rust-interposer");
    let out = Command::new(&program).arg("restart").env_remove("LD_PRELOAD").output().unwrap();
    assert_all_ok("rust-interposer restart", &out);
}

/// See `ticks_at_exit_scenario` in the fixture.
#[test]
fn an_own_interposers_statistics_callback_is_called_at_exit() {
    let program = rust_program("interposer", "rust-interposer");
    let out = Command::new(&program).arg("ticks-exit").env_remove("LD_PRELOAD").output().unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    let [refused, "main returns", at_exit] = lines[..] else { panic!("{stdout}") };
    assert_eq!(refused, "an interval beyond 2^62 refused: ok");
    let allocs: u64 = at_exit.strip_prefix("statistics: ").and_then(|l| l.split(' ').next()).unwrap().parse().unwrap();
    assert!(allocs >= 5001, "the run's allocations: {at_exit}");
}

#[test]
fn a_rust_program_is_its_own_interposer_and_sees_strdup() {
    let program = rust_program("interposer", "rust-interposer");
    let out = run(Mode::Native, &mut Command::new(&program));
    assert_all_ok("rust-interposer", &out);
    assert!(text(&out.stdout).contains("strdup's malloc seen by the spy: ok"));
}
