//! The hook path under stress: spies that allocate in every hook, a panicking spy, fork while
//! other threads allocate, malloc in signal handlers, and the loader's own early allocations.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Output};

#[test]
fn a_spy_that_allocates_in_every_hook_neither_recurses_nor_deadlocks() {
    let program = rust_program("spies", "spies");
    let plain = run(Mode::Native, Command::new(&program).arg("plain"));
    let out = run(PASS_THROUGH, Command::new(&program).arg("reentrant"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let checksum = |o: &std::process::Output| text(&o.stdout).split('=').nth(1).map(str::to_string);
    assert_eq!(checksum(&out), checksum(&plain), "same work, same result");
}

#[test]
fn a_panicking_spy_is_reported_once_and_the_program_goes_on() {
    let program = rust_program("spies", "spies");
    let plain = run(Mode::Native, Command::new(&program).arg("plain"));
    let out = run(PASS_THROUGH, Command::new(&program).arg("panicking"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert_eq!(stderr.matches("it is revoked and the program goes on unspied").count(), 1, "{stderr}");
    assert_eq!(text(&out.stdout).split('=').nth(1), text(&plain.stdout).split('=').nth(1));
}

/// A spy registered through the shim that panics in `pre_alloc` or `post_alloc`: the
/// registry takes the panic as it does in-process (the call goes on unspied), not the
/// panic's fallback for the spy's answer. Before, a Post method ran after the Pre method that
/// panicked, and the block whose Post method panicked was freed through the spy: a header
/// spy's blocks overflowed, or glibc aborted on a free.
#[test]
fn a_spy_panicking_through_the_shim_leaves_no_call_half_spied() {
    let program = rust_program("spies", "spies");
    let plain = run(Mode::Native, Command::new(&program).arg("plain"));
    let checksum = |o: &std::process::Output| {
        text(&o.stdout).split("checksum=").nth(1).and_then(|t| t.split_whitespace().next()).map(str::to_string)
    };
    for scenario in ["panics-in-pre", "panics-in-post"] {
        let out = run(PASS_THROUGH, Command::new(&program).arg(scenario));
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{scenario}: {stderr}");
        assert!(stdout.ends_with(" violations=0\n"), "{scenario}: {stdout}");
        assert_eq!(checksum(&out), checksum(&plain), "{scenario}: same work, same result");
        assert_eq!(stderr.matches("it is revoked and the program goes on unspied").count(), 1, "{scenario}: {stderr}");
    }
}

#[test]
fn fork_while_other_threads_are_inside_hooks() {
    let program = c_program("fork_load.c");
    let outputs = same_in_every_mode("fork_load", || Command::new(&program));
    assert_eq!(outputs[0].1.status.code(), Some(0));
}

#[test]
fn a_child_forked_while_another_thread_loads_a_library_leaves_without_hanging() {
    // The child's copies of the loader's locks may be held by the thread left behind: the
    // exit report, which asks the loader, hung in 56 of 200 children (native: none). Such a
    // child now says why it writes no report; the others report as usual.
    let library = c_library("unload_other.c");
    let program = c_program("fork_dlclose.c");
    let native = run(Mode::Native, Command::new(&program).arg(&library));
    assert_eq!(text(&native.stdout), "forks: 100, hung: 0\n");
    let out = run(Mode::Shim(""), Command::new(&program).arg(&library));
    assert_eq!(text(&out.stdout), "forks: 100, hung: 0\n", "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    let skipped = stderr.matches("while another thread held the dynamic loader's lock").count();
    let reported = stderr.matches("LEAK SUMMARY").count();
    // Every child and the parent leave a line: a report or the reason for none.
    assert_eq!(skipped + reported, 101, "{skipped} skipped, {reported} reported:\n{stderr}");
    // In JSON, the reason is a JSON value too: a reader of one per process read a line of
    // text (review helper 63).
    let out = run(Mode::Shim("report_format=json"), Command::new(&program).arg(&library));
    assert_eq!(text(&out.stdout), "forks: 100, hung: 0\n", "{}", text(&out.stderr));
    let values: Vec<serde_json::Value> = serde_json::Deserializer::from_slice(&out.stderr)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{e}: {}", text(&out.stderr)));
    let is_error = |v: &&serde_json::Value| v["error"].as_str().is_some_and(|e| e.contains("dynamic loader's lock"));
    let errors = values.iter().filter(is_error).count();
    let reports = values.iter().filter(|v| v["leaks"].is_array()).count();
    assert_eq!((errors + reports, values.len()), (101, 101), "{errors} errors, {reports} reports");
}

#[test]
fn malloc_and_free_in_signal_handlers() {
    let program = c_program("signal_alloc.c");
    let outputs = same_in_every_mode("signal_alloc", || Command::new(&program));
    assert_eq!(outputs[0].1.status.code(), Some(0));
}

/// A signal handler that frees while its thread is inside the ticks spy's sampled set (every
/// allocation sampled): the free, nested in the hook, must not wait for the lock its own
/// thread holds. A first version of the nested path's sample ending hung here, every run.
#[test]
fn a_signal_handler_that_frees_during_a_sample_does_not_hang() {
    let program = c_program("signal_frees.c");
    let child = Command::new(&program)
        .arg("2000000")
        .env("LD_PRELOAD", shim())
        .env("MALLOCSPY_OPTIONS", "spy=ticks:sample_interval=1")
        .env("GLIBC_TUNABLES", "glibc.malloc.tcache_count=1000")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = output_within(child, std::time::Duration::from_secs(120));
    assert_eq!((out.status.code(), text(&out.stdout)), (Some(0), "done\n".to_string()), "hung, or died");
}

#[test]
fn threads_that_ask_for_their_stack_first_or_leave_by_pthread_exit_or_cancellation() {
    // The JVM's and Rust's threads ask pthread_getattr_np for their stack before anything else;
    // it allocates while holding the thread's lock, which a hook asking the same deadlocked on
    // (java hung at start under spy=leaks). The fixture dies by alarm() if it hangs.
    let program = c_program("thread_stacks.c");
    let outputs = same_in_every_mode("thread_stacks", || Command::new(&program));
    let expected = "stack first: 8 of 8\nown stack: 1\nlibc's pthread_create: 1\npthread_exit: 7\ncancelled: yes\n";
    assert_eq!(text(&outputs[0].1.stdout), expected);
    // main ends by pthread_exit: the report still names the program and finds stdout's buffer
    // reachable from libc's data (it once read an empty /proc/self/maps and called it lost).
    let (_, leaks) = outputs.iter().find(|(m, _)| *m == Mode::Shim("")).unwrap();
    let report = text(&leaks.stderr);
    assert!(report.contains(&format!("leak report for {}", program.display())), "{report}");
    assert!(report.contains("definitely lost: 0 bytes in 0 blocks"), "{report}");
    assert!(report.contains("possibly lost: 0 bytes in 0 blocks"), "{report}");
}

#[test]
fn a_thread_with_a_cancellation_pending_allocates_and_is_cancelled_where_it_would_be() {
    // malloc is not a cancellation point; the system calls a hook makes (the stack's bounds
    // from /proc, the writer's wake-up) must not be either, or the cancellation starts inside
    // the hook and glibc aborts the process.
    let program = c_program("cancel_alloc.c");
    let outputs = same_in_every_mode("cancel_alloc", || Command::new(&program));
    assert_eq!(text(&outputs[0].1.stdout), "reached the cancellation point\ncancelled: yes\n");
    let every = run(Mode::Shim("spy=ticks:sample_interval=1"), &mut Command::new(&program));
    assert_eq!(every.status.code(), Some(0), "{}", text(&every.stderr));
    assert_eq!(every.stdout, outputs[0].1.stdout);
}

/// Hand-written assembly may call the malloc family with the stack 8 bytes off the ABI's
/// alignment; glibc's allocator does not mind, and every spied path crashed on it (compiled
/// Rust stores to the stack with `movaps`). Each call now runs as natively, under every spy,
/// and the leak report names the block's call stack.
#[test]
fn calls_with_a_misaligned_stack_run_as_natively() {
    let program = c_program("misaligned_calls.c");
    let outputs = same_in_every_mode("misaligned_calls", || Command::new(&program));
    assert_eq!(text(&outputs[0].1.stdout), "200 rounds, 0 failures\n");
    let leaks = &outputs.iter().find(|(m, _)| *m == Mode::Shim("")).unwrap().1;
    let report = text(&leaks.stderr);
    assert!(report.contains("4,000 bytes in 1 blocks are definitely lost (malloc)"), "{report}");
    assert!(report.contains(" in leaked_here /") && report.contains(" in main /"), "{report}");
    let every = run(Mode::Shim("spy=ticks:sample_interval=1"), &mut Command::new(&program));
    assert_eq!(every.status.code(), Some(0), "{}", text(&every.stderr));
    assert_eq!(every.stdout, outputs[0].1.stdout);
}

/// After a failed `dlopen`, the program's first `mmap`, `signal` or `at_quick_exit` leaves
/// the message for `dlerror`: the shim looked libc's function up with `dlsym` at that first
/// call, and a successful `dlsym` clears the thread's `dlerror` state.
#[test]
fn the_first_call_of_a_wrapped_function_keeps_the_dlerror_message() {
    let program = c_program("dlerror_kept.c");
    let outputs = same_in_every_mode("dlerror_kept", || Command::new(&program));
    let native = text(&outputs[0].1.stdout);
    assert_eq!(native.matches("message kept").count(), 8, "{native}");
}

#[test]
fn blocks_allocated_by_constructors_before_ours_stay_usable() {
    // libearly's constructor runs before the shim's (the loader initialises it first) and keeps
    // its blocks; the program then frees and reallocates them under the spy.
    let program = c_program_linked("early_main.c", "early.c");
    let outputs = same_in_every_mode("early", || std::process::Command::new(&program));
    assert_eq!(text(&outputs[0].1.stdout), "early: ok\n");
    // From a thread whose stack the program malloc'ed: the guard took the whole heap below
    // that stack for the thread's stack, refused the blocks there as not the heap's ("invalid
    // free"), leaked the freed one and failed the realloc.
    let guarded = run(Mode::Shim("spy=guard"), Command::new(&program).arg("heap_stack"));
    assert_eq!(text(&guarded.stdout), "early: ok\n", "{}", text(&guarded.stderr));
    assert_eq!(text(&guarded.stderr), "");
}

/// A free of a pointer into the thread's own frame is an invalid free, also from a signal
/// handler on an alternate stack above the thread's: the guard bounded the thread's stack from
/// its own frame up, which there is above the whole stack, and glibc aborted the program.
#[test]
fn guard_reports_frees_of_the_threads_stack_from_an_alternate_signal_stack() {
    let program = c_program("guard_altstack.c");
    let out = run(Mode::Shim("spy=guard"), &mut Command::new(&program));
    let stderr = text(&out.stderr);
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "survived\n"), "{stderr}");
    assert_eq!(stderr.matches("mallocspy: guard: invalid-free at ").count(), 2, "{stderr}");
}

/// A block overrun (or underrun) and never freed is reported at exit: the canaries were checked
/// only by a free or a realloc, and such a program ran without a word (review helper 81).
#[test]
fn the_guard_refuses_a_free_of_where_its_real_block_starts() {
    // `free(p - 16)` named the start of the real allocator's block under `p`: glibc took it,
    // and the next malloc handed `p`'s memory out again while `p` was in use (review helper 90);
    // under a block aligned past a page too (helper 129).
    let program = c_program("guard_real_start.c");
    let out = run(Mode::Shim("spy=guard"), &mut Command::new(&program));
    assert_eq!(
        text(&out.stdout),
        "malloc: kept, not handed out again\nmemalign: kept, not handed out again\n\
         valloc: kept, not handed out again\nmemalign 64 KiB: kept, not handed out again\n"
    );
    assert_eq!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    let findings: Vec<&str> = stderr.lines().filter(|l| l.contains(": not a live block (in free")).collect();
    assert_eq!(findings.len(), 4, "{stderr}");
    assert!(stderr.contains("4 finding(s): 0 overflow, 0 underflow, 0 double-free, 4 invalid-free"), "{stderr}");
}

/// Blocks the guard never saw (a tick callback's, a signal handler's on a little alternate
/// stack) at addresses of guarded blocks freed before: their frees and `realloc`s were double
/// frees, refused (the blocks leaked, each `realloc` NULL), and `malloc_usable_size` said 0
/// (review helper 129: 6,740 findings and 3,370 refused `realloc`s in 7,486 records).
#[test]
fn blocks_the_guard_never_saw_are_freed_reallocated_and_measured_as_natively() {
    let program = c_program("guard_unseen_blocks.c");
    let out = run(Mode::Shim("spy=guard,ticks:sample_interval=4096:sample_seed=1"), &mut Command::new(&program));
    let stderr = text(&out.stderr);
    assert_eq!(text(&out.stdout), "made over 10000, refused 0, unmeasured 0\n", "{stderr}");
    assert_eq!(out.status.code(), Some(0));
    assert!(!stderr.contains("mallocspy: guard:"), "{stderr}");
}

/// A tick callback that allocates hundreds of blocks a sample and frees one of the program's
/// guarded blocks: the blocks it allocated were parked for the guard in the ring where such
/// frees wait, and crowded them out (review helper 132: 2,000 of 2,000 frees leaked with 300
/// blocks a sample).
#[test]
fn a_callbacks_burst_of_allocations_leaves_its_frees_to_be_done() {
    let program = c_program("callback_burst.c");
    let out = run(Mode::Shim("spy=guard,ticks:sample_interval=1"), Command::new(&program).arg("300"));
    let stderr = text(&out.stderr);
    assert_eq!(text(&out.stdout), "the callback freed 2000 blocks and kept 600000\n", "{stderr}");
    assert!(!stderr.contains("could not be completed"), "{stderr}");
    assert!(!stderr.contains("mallocspy: guard:"), "{stderr}");
    // Past the 1,024 blocks the guard can be told of between two hooks, its double frees at
    // their addresses may be none: said (review helper 133: 17 findings, and not a word).
    let out = run(Mode::Shim("spy=guard,ticks:sample_interval=1"), Command::new(&program).arg("1100"));
    let stderr = text(&out.stderr);
    assert_eq!(text(&out.stdout), "the callback freed 2000 blocks and kept 1048576\n", "{stderr}");
    assert!(stderr.contains("were served while the spy could not be told"), "{stderr}");
}

/// A double free of an address where the real block under a later guarded block started,
/// that block freed since: glibc's free lists hold a chunk there, and a first fix of the test
/// above, which told a live unspied block by a chunk of glibc's starting at the address, gave
/// this double free to glibc (review helper 130: an abort in tcache, a block handed out twice
/// from a fastbin).
#[test]
fn a_double_free_where_the_real_heap_has_a_free_chunk_now_is_still_found() {
    let program = c_program("double_free_after_reuse.c");
    for (mode, args) in [("spy=guard", "tcache"), ("spy=leaks,guard", "fastbin"), ("spy=guard", "fastbin")] {
        let out = run(Mode::Shim(mode), Command::new(&program).arg(args));
        let stderr = text(&out.stderr);
        assert_eq!(
            (out.status.code(), text(&out.stdout).as_str()),
            (Some(0), "blocks handed out twice: 0\n"),
            "{stderr}"
        );
        assert_eq!(stderr.matches("mallocspy: guard: double-free at ").count(), 1, "{mode} {args}: {stderr}");
    }
}

/// A double free by a thread that frees seldom, while another frees much, is found: the
/// seldom freer kept its chunk of the ring's places while the other thread's frees went round
/// the ring, and its free was forgotten a few hundred frees later, its double free said to be
/// an invalid free (review helper 160). 90,000 frees between the two are within what the
/// guard remembers (about the last 100,000).
#[test]
fn a_double_free_by_a_thread_that_frees_seldom_is_found() {
    let program = c_program("guard_seldom_freer.c");
    for lap_and_gap in [["60000", "200"], ["100000", "90000"], ["0", "90000"]] {
        finds_one_double_free(&program, &lap_and_gap);
    }
}

/// Runs `program` with `args` under the guard: it ends well, saying "done", and the guard
/// finds one double free and no invalid free.
fn finds_one_double_free(program: &Path, args: &[&str]) {
    let out = run(Mode::Shim("spy=guard"), Command::new(program).args(args));
    let stderr = text(&out.stderr);
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "done\n"), "{args:?}: {stderr}");
    assert_eq!(stderr.matches("mallocspy: guard: double-free at ").count(), 1, "{args:?}: {stderr}");
    assert!(!stderr.contains("guard: invalid-free at "), "{args:?}: {stderr}");
}

/// A double free among many threads that free in turn is found: taking chunks of the ring's
/// places, with a bound on how far a chunk may lag, they pushed each other's chunks past it, and
/// the ring went round in about 2,000 frees (200 threads, 6,000 frees between the two: an
/// invalid free; review helper 161).
#[test]
fn a_double_free_among_many_threads_freeing_in_turn_is_found() {
    let program = c_program("guard_many_freers.c");
    for threads_and_rounds in [["200", "30"], ["1000", "40"], ["8", "5000"]] {
        finds_one_double_free(&program, &threads_and_rounds);
    }
}

#[test]
fn exitcode_fails_a_run_in_which_the_guard_found_misuse() {
    // As valgrind's --error-exitcode: a test suite run under the guard passed despite its
    // findings (review helper 90).
    let program = c_program("guard_real_start.c");
    let found = run(Mode::Shim("spy=guard:exitcode=23"), &mut Command::new(&program));
    assert_eq!(found.status.code(), Some(23), "{}", text(&found.stderr));
    assert!(text(&found.stdout).ends_with("64 KiB: kept, not handed out again\n"), "{}", text(&found.stdout));
    let clean = run(Mode::Shim("spy=guard:exitcode=23"), Command::new("sort").arg("/etc/passwd"));
    assert_eq!(clean.status.code(), Some(0), "{}", text(&clean.stderr));
    assert!(!text(&clean.stdout).is_empty());
}

#[test]
fn guard_checks_the_blocks_still_live_at_exit() {
    let program = c_program("guard_live_damage.c");
    let out = run(Mode::Shim("spy=guard"), &mut Command::new(&program));
    assert_eq!(out.status.code(), Some(0));
    let stdout = text(&out.stdout);
    let blocks: Vec<&str> = stdout.strip_prefix("blocks at ").expect(&stdout).split_whitespace().collect();
    let stderr = text(&out.stderr);
    let mut lines: Vec<&str> = stderr.lines().collect();
    // The blocks are listed in the live table's order.
    let listed = lines.len().min(2);
    lines[..listed].sort_unstable();
    assert_eq!(
        lines,
        [
            format!(
                "mallocspy: guard: heap-buffer-overflow at {}, size 10: trailer canary damaged (in a block still live \
                 at exit)",
                blocks[0]
            ),
            format!(
                "mallocspy: guard: heap-buffer-underflow at {}: header canary damaged (in a block still live at exit)",
                blocks[1]
            ),
            "mallocspy: guard: 2 finding(s): 1 overflow, 1 underflow, 0 double-free, 0 invalid-free, 0 alloc-dealloc-mismatch, \
             0 new-delete-type-mismatch, 0 free-size-mismatch"
                .to_owned(),
        ],
        "{stderr}"
    );
}

/// With the leak tracker beside the guard (`MALLOCSPY_OPTIONS=spy=guard mallocspy run`), a
/// block found damaged at exit is named by the call that allocated it, and its stack is listed
/// (review helper 109: an address and a size were all the guard said).
#[test]
fn a_block_damaged_and_live_at_exit_is_named_by_its_allocation_with_the_leak_tracker() {
    let program = c_program("guard_live_damage.c");
    let out = run(Mode::Shim("spy=leaks,guard"), &mut Command::new(&program));
    assert_eq!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/guard_live_damage.c")).unwrap();
    let line_of = |call: &str| 1 + source.lines().position(|l| l.contains(call)).expect(call);
    for (what, detail, call) in [
        ("heap-buffer-overflow", "size 10: trailer canary damaged", "over = malloc(10)"),
        ("heap-buffer-underflow", "header canary damaged", "under = malloc(32)"),
    ] {
        let said = stderr.lines().find(|l| l.starts_with(&format!("mallocspy: guard: {what} at 0x"))).expect(&stderr);
        assert!(
            said.contains(&format!("{detail} (in a block still live at exit, allocated from guard_live_damage+0x")),
            "{said}"
        );
        let site = format!("mallocspy: guard: {what} in a block still live at exit (1 time), allocated at:\n");
        let (_, frames) = stderr.split_once(&site).expect(&stderr);
        let first = frames.lines().next().unwrap();
        assert!(
            first.contains(" in main ") && first.ends_with(&format!("/guard_live_damage.c:{}", line_of(call))),
            "{first}"
        );
    }
}

/// A block the leak tracker did not record (its thread got no record: `max_memory`) is not
/// named by the record of the block that was at its address before (review helper 112: "allocated
/// from" the earlier block's call).
#[test]
fn a_damaged_block_the_tracker_did_not_record_is_not_named_by_an_earlier_one() {
    let program = c_program("freed_by_an_untracked_thread.c");
    let out = run(Mode::Shim("spy=leaks,guard:max_memory=4m"), Command::new(&program).args(["30000", "overrun"]));
    assert_eq!(text(&out.stdout), "same address: yes\nkept 30000 blocks\n");
    let stderr = text(&out.stderr);
    let finding = stderr.lines().find(|l| l.starts_with("mallocspy: guard: heap-buffer-overflow at")).expect(&stderr);
    assert!(finding.ends_with("size 24: trailer canary damaged (in a block still live at exit)"), "{finding}");
    assert!(!stderr.contains("allocate_first"), "{stderr}");
}

/// Each finding is one line, naming the module and offset of the call; at exit each distinct
/// call stack of a finding is listed, named (before, a finding said only the entry point).
#[test]
fn guard_reports_misuse_in_one_line_each_and_the_program_goes_on() {
    let program = c_program("guard_findings.c");
    let out = run(Mode::Shim("spy=guard"), &mut Command::new(&program));
    assert_eq!(
        text(&out.stdout),
        "realloc of a freed block -> NULL\nusable size of a freed block: 0\n\
         usable size of a block with a damaged header: 0\nsurvived\n"
    );
    assert_eq!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    let (said, sites) = stderr.split_once("mallocspy: guard: where the findings were made:\n").expect(&stderr);
    let findings: Vec<&str> = said.lines().filter(|l| l.starts_with("mallocspy: guard:")).collect();
    let called = ", called from guard_findings+0x";
    let expect = [
        ("heap-buffer-overflow at 0x", "size 48: trailer canary damaged (in free"),
        ("heap-buffer-underflow at 0x", ": header canary damaged, the block is leaked (in free"),
        ("double-free", "size 64 (in free"),
        ("invalid-free", "(in free"),
        // glibc aborted: "free(): invalid size".
        ("invalid-free", "(in free"),
        ("double-free", "size 20 (in realloc"),
        ("heap-buffer-underflow", "(in free"),
        ("heap-buffer-underflow", "(in free"),
        ("double-free", "size 10 (in free"),
        ("invalid-free", "(in free"),
        ("invalid-free at 0x10000: not a live block", "(in free"),
        ("double-free", "size 10 (in realloc"),
        // It crashed in malloc_usable_size before the free (review helper 37).
        ("heap-buffer-underflow", "(in free"),
        // Named "realloc" before.
        ("heap-buffer-overflow", "size 20: trailer canary damaged (in reallocarray"),
        ("double-free", "size 24 (in free"),
        ("double-free", "size 24 (in free"),
    ];
    assert_eq!(findings.len(), expect.len() + 1, "{findings:#?}");
    for (line, (what, place)) in findings.iter().zip(expect) {
        assert!(
            line.contains(what) && line.contains(&format!("{place}{called}")),
            "{line:?} should report {what} {place}"
        );
    }
    assert!(findings[expect.len()].ends_with(
        "16 finding(s): 2 overflow, 4 underflow, 6 double-free, 4 invalid-free, 0 alloc-dealloc-mismatch, \
             0 new-delete-type-mismatch, 0 free-size-mismatch"
    ));
    // Each site: its finding, then its frames, each naming a line of the fixture that frees.
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/guard_findings.c")).unwrap();
    let source: Vec<&str> = source.lines().collect();
    let line_of = |frame: &str| -> &str {
        let n: usize = frame.rsplit_once("guard_findings.c:").expect(frame).1.parse().expect(frame);
        source[n - 1]
    };
    let mut listed: Vec<(String, Vec<String>)> = Vec::new();
    for line in sites.lines() {
        let line = line.strip_prefix("mallocspy: guard: ").expect(line);
        match line.trim_start().strip_prefix('#') {
            Some(frame) => listed.last_mut().expect(line).1.push(frame.to_owned()),
            None => listed.push((line.to_owned(), Vec::new())),
        }
    }
    assert_eq!(listed.len(), 15, "{sites}");
    for ((site, frames), (what, place)) in listed[..14].iter().zip(&expect) {
        assert!(site.starts_with(what.split(" at ").next().unwrap()) && site.ends_with("(1 time)"), "{site}");
        let call = place.rsplit_once("(in ").unwrap().1;
        assert!(
            frames[0].contains(" in main ") && line_of(&frames[0]).contains(&format!("{call}(")),
            "{site}: {frames:?}"
        );
    }
    let (site, frames) = &listed[14];
    assert_eq!(site, "double-free (2 times)");
    assert!(frames[0].contains(" in release ") && line_of(&frames[0]).contains("free(p);"), "{frames:?}");
    assert!(frames[1].contains(" in main ") && line_of(&frames[1]).contains("release(p); /* twice"), "{frames:?}");
}

/// A stack walk on a 16 KiB stack (a thread's, or a handler's alternate one) ran out of it:
/// the unwinder's first look at a new return address takes about 14 KiB, and the guard's
/// finding more (review helper 41: SIGSEGV under `spy=leaks` with no misuse at all, and under
/// `spy=guard` at a double free). The walk now stops where the stack has no room for it.
#[test]
fn small_stacks_survive_the_stack_walks() {
    let program = c_program("small_stacks.c");
    for (options, arg) in [("spy=leaks", "once"), ("spy=guard", "once"), ("spy=guard", "double")] {
        let out = run(Mode::Shim(options), Command::new(&program).arg(arg));
        let stderr = text(&out.stderr);
        assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "done\n"), "{options} {arg}: {stderr}");
        let findings = stderr.lines().filter(|l| l.contains("guard: double-free at")).count();
        assert_eq!(findings, if arg == "double" { 2 } else { 0 }, "{options} {arg}: {stderr}");
    }
}

/// The main thread's room below a frame was counted from where its stack started, not from the
/// top of its mapping, which lies above the arguments and the environment: under `ulimit -s 64`
/// with a 12 KB environment, a walk that thought it had room to compute a rule died of it; so
/// did one after a `dlopen`, which took 20 KiB then (review helper 44).
#[test]
fn a_walk_knows_the_main_threads_room_under_a_small_stack_limit() {
    let program = c_program("little_room.c");
    let big = "x".repeat(12_000);
    for (room, stack) in [("8", "0"), ("12", "0"), ("16", "0"), ("20", "0"), ("24", "0"), ("20", "64"), ("28", "64")] {
        let mut cmd = Command::new("sh");
        // Only the 12 KB variable: the walks, not the program, are short of room.
        cmd.args(["-c", "ulimit -s 64 && exec \"$0\" \"$@\"", program.to_str().unwrap(), room, stack])
            .env_clear()
            .env("BIG", &big);
        let out = run(Mode::Shim("spy=leaks"), &mut cmd);
        let stderr = text(&out.stderr);
        assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "done\n"), "{room} KiB left: {stderr}");
    }
}

/// The shim's constructor built the spies, their 4 KiB tables inline, on the program's main
/// stack, in one frame of 36 KiB: under `ulimit -s 28` every program died of a segmentation
/// fault before `main` (`sort` itself runs under `ulimit -s 20`), whatever the spy, `none`
/// included.
#[test]
fn every_spy_starts_under_a_small_stack_limit() {
    let input: String = (0..5_000u32).map(|i| format!("{}\n", i.wrapping_mul(2_654_435_761) % 100_000)).collect();
    let dir = std::env::temp_dir().join(format!("mallocspy-small-stack-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("in.txt");
    std::fs::write(&file, input).unwrap();
    let outputs = same_in_every_mode("sort under ulimit -s 28", || {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "ulimit -s 28 && exec sort \"$0\"", file.to_str().unwrap()]);
        cmd
    });
    assert_eq!(outputs[0].1.status.code(), Some(0), "{}", text(&outputs[0].1.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `realloc` of a pointer that is no block (16-aligned, in mapped memory: a global buffer,
/// a pointer into a block) is an invalid free, and the call fails, as under valgrind: glibc,
/// which reads the word before it as a chunk's size, aborts the program natively. (It went
/// to glibc's checks; before that, the guard measured it with `malloc_usable_size` and the
/// program died of a segmentation fault inside mallocspy: review helper 60.)
#[test]
fn the_guard_refuses_a_realloc_of_no_block_and_the_program_goes_on() {
    use std::os::unix::process::ExitStatusExt;
    let program = c_program("realloc_not_a_block.c");
    for (case, said) in [("global", ": not a live block"), ("inside", ": 16 bytes inside a block of size 128")] {
        let native = run(Mode::Native, Command::new(&program).arg(case));
        assert_eq!(native.status.signal(), Some(libc::SIGABRT), "{case}: {}", text(&native.stderr));
        let guarded = run(Mode::Shim("spy=guard"), Command::new(&program).arg(case));
        let stderr = text(&guarded.stderr);
        assert_eq!(
            (guarded.status.code(), text(&guarded.stdout).as_str()),
            (Some(0), "realloc gave (nil)\n"),
            "{case}: {stderr}"
        );
        assert!(stderr.starts_with("mallocspy: guard: invalid-free at 0x"), "{case}: {stderr}");
        assert!(
            stderr.lines().next().unwrap().contains(&format!("{said} (in realloc, called from ")),
            "{case}: {stderr}"
        );
    }
}

/// A guard finding in a child forked while another thread held the loader's lock waited for
/// it for ever, naming the caller's module (review helper 41: 5 children of 5).
#[test]
fn a_guard_finding_in_a_child_forked_during_a_module_walk_does_not_hang() {
    let program = c_program("fork_while_iterating.c");
    let out = run(Mode::Shim("spy=guard"), Command::new(&program).arg("12"));
    assert_eq!(text(&out.stdout), "children that did not leave: 0 of 12\n", "{}", text(&out.stderr));
}

/// A finding's frame in a library unloaded before the exit report was named after whatever
/// was loaded there by then (review helper 41: `other_function` of the library loaded where
/// the bad one had been).
#[test]
fn a_findings_frame_in_a_library_unloaded_since_is_not_named_after_another() {
    let program = c_program_with("finding_then_unload.c", &["-ldl"]);
    let (bad, other) = (c_library("bad_free_lib.c"), c_library("other_lib.c"));
    let out = run(Mode::Shim("spy=guard"), Command::new(&program).arg(&bad).arg(&other));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("called from libbad_free_lib.so+0x"), "{stderr}");
    let listed = stderr.split_once("where the findings were made:\n").expect(&stderr).1;
    let first = listed.lines().nth(1).expect(listed);
    assert!(first.contains("in ?? (a library unloaded since+0x"), "{first}\n{stderr}");
    assert!(!listed.contains("other_function"), "{stderr}");
    assert!(listed.contains("in main "), "the program's frames are named: {stderr}");
}

/// Under the guard, once the live-block table cannot grow (a small `max_memory`): a realloc
/// whose block it could not record left it in the guard's layout, and its free made glibc
/// abort ("munmap_chunk(): invalid pointer", review helper 38); a block served unspied at the
/// address of a guarded block freed before was reported as a double free (helper 37).
#[test]
fn a_full_block_table_under_the_guard_leaves_a_correct_program_alone() {
    let program = c_program("table_full.c");
    let out = run(Mode::Shim("spy=guard:max_memory=8m"), &mut Command::new(&program));
    let stderr = text(&out.stderr);
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "ok\n"), "{stderr}");
    let said: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        said,
        [
            "mallocspy: max_memory (8388608 bytes) reached: what does not fit from here on goes unspied",
            "mallocspy: no room left for the live-block table: blocks allocated or reallocated from now on may go unspied",
        ],
        "one line each, and no finding"
    );
}

#[test]
fn thousands_of_short_lived_threads_reuse_the_per_thread_records() {
    // glibc frees a thread's own buffers after its key destructors, through the exported
    // `free`: a slot given back by the destructor was taken again by the dying thread and
    // never returned, and every thread that ever lived kept a slot and the spies' records of
    // it (python3 starting 16,000 threads grew to 1.1 GB under spy=leaks).
    let program = c_program("thread_turnover.c");
    let outputs = same_in_every_mode("thread_turnover", || Command::new(&program));
    assert_eq!(text(&outputs[0].1.stdout), "threads: 6000, checksum: 240000\n");
    let (_, leaks) = outputs.iter().find(|(m, _)| *m == Mode::Shim("")).unwrap();
    let stderr = text(&leaks.stderr);
    let growth: u64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix("own memory growth: ")?.strip_suffix(" bytes")?.parse().ok())
        .unwrap_or_else(|| panic!("no memory figure:\n{stderr}"));
    // One thread's records take about 60 KiB: 5,600 threads after the first 400 must fit in
    // the slots those left behind.
    assert!(growth < 1 << 20, "mallocspy's memory grew by {growth} bytes over 5,600 threads");
    assert!(stderr.contains("definitely lost: 0 bytes in 0 blocks"), "{stderr}");
}

#[test]
fn exit_from_a_signal_handler_that_interrupts_the_allocator() {
    // The handler mostly interrupts the leak tracker's hook, sometimes while it holds a lock
    // of the live table that the exit report takes: the exit hung (1 run in 6). Now the
    // report is left out, and said so, when the exit comes from inside mallocspy.
    let program = c_program("signal_exit.c");
    let mut skipped = 0;
    for _ in 0..20 {
        let mut cmd = Command::new("timeout");
        cmd.arg("20").arg(&program);
        let out = run(Mode::Shim(""), &mut cmd);
        assert_eq!(out.status.code(), Some(0), "hung or failed: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), "allocating until the timer fires\n");
        let stderr = text(&out.stderr);
        if stderr.contains("mallocspy: the process exited from a signal handler that interrupted mallocspy; no report")
        {
            skipped += 1;
        } else {
            assert!(stderr.contains("LEAK SUMMARY:"), "{stderr}");
        }
    }
    assert!(skipped > 0, "the timer never interrupted a hook in 20 runs");
}

/// Under a descriptor limit that leaves no room above the program's first free descriptor
/// (`ulimit -n 4`), the copy of stderr took it: the program could open no file (review helper
/// 128). Under a small limit with room, the copy is kept in its top quarter: a program that
/// closes its stderr still gets its report (under `ulimit -n 32` and below, it found no room
/// and lost it: review helper 132).
#[test]
fn under_a_tiny_descriptor_limit_the_program_gets_every_descriptor() {
    let closes = c_program("closes_stderr.c");
    for limit in [8, 32] {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(format!("ulimit -n {limit} && exec \"$0\"")).arg(&closes);
        let out = run(Mode::Shim(""), &mut cmd);
        assert!(
            text(&out.stderr).contains("definitely lost: 77 bytes in 1 blocks"),
            "ulimit -n {limit}: {}",
            text(&out.stderr)
        );
    }
    let program = c_program("opens_until_refused.c");
    for limit in [4] {
        let outputs: Vec<Output> =
            [Mode::Native, PASS_THROUGH, Mode::Shim("spy=count"), Mode::Shim("spy=guard"), Mode::Shim("spy=ticks")]
                .into_iter()
                .map(|mode| {
                    let mut cmd = Command::new("sh");
                    cmd.arg("-c").arg(format!("ulimit -n {limit} && exec \"$0\"")).arg(&program);
                    run(mode, &mut cmd)
                })
                .collect();
        assert_eq!(text(&outputs[0].stdout), format!("first 3, {} in all\n", limit - 3));
        for out in &outputs[1..] {
            assert_eq!(out.stdout, outputs[0].stdout, "ulimit -n {limit}: {}", text(&out.stderr));
        }
    }
}

/// A program that limits its own address space and data while it runs: mallocspy's first
/// arena, 1 GiB reserved at start (untouched, so it cost no memory), counted against both,
/// and under any limit below about 1.1 GB every allocation failed (review helper 128: 0 of
/// 993 MiB under a limit of 1000 MB; python3 under its own limit of 1 GiB, `MemoryError`).
#[test]
fn a_limit_the_program_sets_itself_leaves_it_its_room() {
    let program = c_program("lowers_its_limit.c");
    let outputs = same_in_every_mode("lowers_its_limit", || Command::new(&program));
    assert_eq!(text(&outputs[0].1.stdout), "256 of 256 MiB under a limit of 512 MiB\n");
}

#[test]
fn a_limit_on_the_address_space_leaves_the_program_room() {
    // mallocspy reserved its pool in 1 GiB arenas (untouched, so they cost no memory), which
    // a limit on the address space refuses: under `ulimit -v 400000` every process aborted
    // ("memory allocation of 29 bytes failed"). The threads' stacks must still fit.
    //
    // glibc is held to one arena: otherwise each thread's arena (64 MiB) takes whatever the
    // limit leaves (natively the fixture peaks at 199 of its 195 MiB), and whether the last
    // thread's stack still fits depends on which thread maps first, with or without the
    // shim's 10 MB: 12 runs in 20 failed under `spy=none`, none natively.
    let program = c_program("thread_stacks.c");
    let outputs = same_in_every_mode("thread_stacks under ulimit -v 200000", || {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg("ulimit -v 200000 && exec \"$0\"").arg(&program).env("MALLOC_ARENA_MAX", "1");
        cmd
    });
    assert_eq!(outputs[0].1.status.code(), Some(0));
}

#[test]
fn threads_that_never_allocate_get_no_arena_of_their_own() {
    // glibc gives a thread an arena (64 MiB of address space) at its first malloc. mallocspy
    // asked glibc for each new thread's stack, which allocates: every thread had an arena, and
    // under `ulimit -v` a program's later threads failed to start. Since Linux 6.11 the kernel
    // is asked instead; older kernels still ask glibc (README, first section).
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let version: Vec<u32> = release.split(['.', '-']).take(2).map(|n| n.trim().parse().unwrap_or(0)).collect();
    if version < vec![6, 11] {
        eprintln!("kernel {release}: older than 6.11, new threads ask glibc for their stacks");
        return;
    }
    let program = c_program("idle_threads.c");
    let outputs = same_in_every_mode("idle_threads", || Command::new(&program));
    assert_eq!(text(&outputs[0].1.stdout), "idle threads: 8, arenas: 1\n");
}

/// Valgrind's memcheck sees no error of the shim's own, with no spy and with a trace (its
/// writer is forked by a raw `clone`). mallocspy's memory came from a variadic `syscall`
/// whose `int` offset left half of its stack slot unwritten, and memcheck failed every
/// program under the shim (review helper 87). The leak tracker is left out: a conservative
/// scan reads words the program never wrote, as LeakSanitizer's would.
#[test]
fn memcheck_finds_no_error_in_the_shim() {
    let dir = tempfile::tempdir().unwrap();
    for options in ["spy=none", &format!("spy=ticks:trace={}/t.%p", dir.path().display())] {
        let out = Command::new("valgrind")
            .args(["-q", "--error-exitcode=9", "ls", "/usr/include/linux"])
            .env("LD_PRELOAD", shim())
            .env("MALLOCSPY_OPTIONS", options)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{options}: {}", text(&out.stderr));
        assert!(text(&out.stdout).lines().any(|l| l == "mman.h"), "{options}");
    }
}

/// A signal handler on an alternate stack of `MINSIGSTKSZ` and 1 KiB that allocates: natively
/// it has room to spare. A hook it ran inside an interrupted allocator call looked for the
/// thread's stack, reading the memory map into a 4 KiB buffer on that stack, and overflowed
/// it; the leak tracker's record of the block, its stack walk included, did not fit in the
/// few hundred bytes a stack of `MINSIGSTKSZ` leaves (review helper 97). Such a handler's
/// allocations go to the real allocator, and the leak report says how many.
#[test]
fn a_handler_allocating_on_a_small_alternate_stack_runs_as_natively() {
    let program = c_program("small_altstack.c");
    // Not the guard: its header and trailer move the main thread's 24-byte block into the bin
    // of the handler's 48-byte one, which the handler, short of room, takes from the real
    // allocator unguarded: the two then meet in glibc's thread cache, the fixture's one
    // assumption (a program whose handler allocates relies on it natively too), and about one
    // run in twenty crashed, with the guard of every build.
    for mode in [JSON_REPORT, Mode::Shim("spy=count"), Mode::Shim("spy=ticks")] {
        // Three runs: the overflow needed the signal to land inside the real allocator.
        for _ in 0..3 {
            let out = run(mode, &mut Command::new(&program));
            let stderr = text(&out.stderr);
            assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "ok\n"), "{mode:?}: {stderr}");
            if mode == JSON_REPORT {
                let note = "were made by signal handlers while mallocspy's hooks ran, which they interrupted, \
                            or on a small alternate signal stack";
                assert!(stderr.contains(note), "{stderr}");
            }
        }
    }
}

/// Blocks a handler frees or moves on an alternate stack with little room left, where
/// mallocspy runs no hook, still end the leak tracker's records and the ticks spy's samples:
/// 43 of the 64 blocks were reported definitely lost and 64 samples stayed live to the end.
#[test]
fn blocks_released_on_a_small_alternate_stack_leave_no_record_behind() {
    let program = c_program("released_on_small_altstack.c");
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.trace");
    for how in ["free", "realloc"] {
        let out = run(JSON_REPORT, Command::new(&program).arg(how));
        assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "ok\n"), "{how}: {}", text(&out.stderr));
        let report = json_report(&out);
        assert_eq!(report["summary"]["definitely_lost"]["blocks"], 0, "{how}: {report}");
        let options = format!("spy=ticks:sample_interval=1:trace={}", trace.display());
        let out = Command::new(&program).arg(how).env("LD_PRELOAD", shim()).env("MALLOCSPY_OPTIONS", &options).output();
        let out = out.unwrap();
        assert_eq!(out.status.code(), Some(0), "{how}: {}", text(&out.stderr));
        let out = Command::new(mallocspy()).args(["report", "--format", "json"]).arg(&trace).output().unwrap();
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        // stdout's buffer alone.
        assert_eq!(report["live_at_end"]["samples"], 1, "{how}: {report}");
    }
}

/// The guard's `finding` lines in `stderr` are, in order, one per `(what, place)` of `expect`:
/// what follows the address, and the function that released the block, called from `program`.
fn assert_finding_lines(stderr: &str, finding: &str, program: &str, expect: &[(&str, &str)]) {
    let start = format!("mallocspy: guard: {finding} at 0x");
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with(&start)).collect();
    assert_eq!(lines.len(), expect.len(), "{stderr}");
    for (line, (what, place)) in lines.iter().zip(expect) {
        assert!(
            line.contains(&format!(", {what} (in {place}, called from {program}+0x")),
            "{line:?}: {what} in {place}"
        );
    }
}

/// `delete` of what `new D[3]` returned, 8 bytes past the block's start (C++'s array cookie):
/// said as inside that block, as valgrind says it, where it was "not a live block" (review
/// helper 129); of what `new D[0]` returned, the end of a block of the cookie alone, as just
/// after it (review helper 139). Natively glibc aborts; the guard's program goes on.
#[test]
fn a_delete_of_a_new_arrays_pointer_is_said_to_be_inside_its_block() {
    let program = c_program("cxx_array_cookie.cpp");
    for (count, said) in [("3", ": 8 bytes inside a block of size 32"), ("0", ": 0 bytes after a block of size 8")] {
        let out = run(Mode::Shim("spy=guard"), Command::new(&program).arg(count));
        assert_eq!((text(&out.stdout), out.status.code()), ("went on\n".to_string(), Some(0)));
        let stderr = text(&out.stderr);
        let line = stderr.lines().find(|l| l.starts_with("mallocspy: guard: invalid-free at 0x")).expect(&stderr);
        let said =
            format!("{said} (a delete of what new[] returned?) (in operator delete, called from cxx_array_cookie");
        assert!(line.contains(&said), "{stderr}");
        let native = run(Mode::Native, Command::new(&program).arg(count));
        assert_ne!(native.status.code(), Some(0), "glibc aborts: {}", text(&native.stderr));
    }
}

/// C++'s operators are the shim's: a block given back by a function of another family than the
/// one that allocated it (`delete` of `new[]`'s, `free` and `realloc` of `new`'s, `delete` of
/// `malloc`'s, `delete[]` of an aligned `new`'s) is a finding naming both, at the line of the
/// release, and is freed all the same; matching pairs (`nothrow` and aligned forms among them)
/// are none. Before, the operators were the C++ runtime's, and their blocks `malloc`'s.
#[test]
fn the_guard_finds_blocks_given_back_by_another_family_than_the_one_that_allocated_them() {
    let program = c_program("cxx_mismatch.cpp");
    let native = run(Mode::Native, &mut Command::new(&program));
    let out = run(Mode::Shim("spy=guard"), &mut Command::new(&program));
    assert_eq!((text(&out.stdout), out.status.code()), (text(&native.stdout), Some(3)));
    let stderr = text(&out.stderr);
    let expect = [
        ("size 100: allocated by operator new[]", "operator delete"),
        ("size 4: allocated by operator new", "free"),
        ("size 10: allocated by malloc", "operator delete"),
        ("size 4: allocated by operator new", "realloc"),
        ("size 128: allocated by operator new", "operator delete[]"),
    ];
    assert_finding_lines(&stderr, "alloc-dealloc-mismatch", "cxx_mismatch", &expect);
    assert!(
        stderr.contains(
            "5 finding(s): 0 overflow, 0 underflow, 0 double-free, 0 invalid-free, 5 alloc-dealloc-mismatch, \
                       0 new-delete-type-mismatch"
        ),
        "{stderr}"
    );
    // Each site's innermost frame is the line that releases, marked in the source.
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/cxx_mismatch.cpp")).unwrap();
    let source: Vec<&str> = source.lines().collect();
    let marked: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("mallocspy: guard:    #0 "))
        .map(|l| {
            let n: usize = l.rsplit_once("cxx_mismatch.cpp:").expect(l).1.parse().expect(l);
            source[n - 1].split_once("// MISMATCH ").expect(source[n - 1]).1
        })
        .collect();
    assert_eq!(marked, ["new[] delete", "new free", "malloc delete", "new realloc", "new delete[]"], "{stderr}");
    // As valgrind's `--show-mismatched-frees=no`.
    let out = run(Mode::Shim("spy=guard:show_mismatched_frees=0"), &mut Command::new(&program));
    assert_eq!(
        (text(&out.stdout), out.status.code(), text(&out.stderr)),
        (text(&native.stdout), Some(3), String::new())
    );
}

/// A sized or aligned `delete` that says another size or alignment than the block's
/// allocation (a `Derived` deleted through a `Base*` whose destructor is not virtual, an
/// aligned `new`'s block given to the plain `delete`...) is AddressSanitizer's
/// new-delete-type-mismatch: the guard finds the same five, at the same lines, with the same
/// sizes and alignments, and none among the matching pairs (aligned types, arrays with a
/// count, virtual destructors, a vector of strings). `show_mismatched_frees=0` silences them.
#[test]
fn the_guard_finds_deletes_of_another_size_or_alignment_as_address_sanitizer_does() {
    let program = c_program("cxx_type_mismatch.cpp");
    let out = run(Mode::Shim("spy=guard"), &mut Command::new(&program));
    assert_eq!((text(&out.stdout), out.status.code()), ("1000\n".to_string(), Some(0)));
    let stderr = text(&out.stderr);
    let expect = [
        ("size 64: deleted as an object of 8 bytes", "operator delete"),
        ("size 100: allocated with alignment 64, deleted default-aligned", "operator delete"),
        ("size 48: allocated default-aligned, deleted with alignment 64", "operator delete"),
        ("size 80: deleted as an object of 40 bytes", "operator delete[]"),
        ("size 64: allocated with alignment 128, deleted with alignment 256", "operator delete"),
    ];
    assert_finding_lines(&stderr, "new-delete-type-mismatch", "cxx_type_mismatch", &expect);
    assert!(stderr.contains("0 alloc-dealloc-mismatch, 5 new-delete-type-mismatch"), "{stderr}");
    let lines_after = |text: &str, header: &str, frame: &str| -> Vec<usize> {
        text.split(header)
            .skip(1)
            .map(|report| {
                let at = report.lines().find(|l| l.contains(frame)).expect(report);
                at.rsplit_once("cxx_type_mismatch.cpp:").expect(at).1.trim().parse().expect(at)
            })
            .collect()
    };
    let ours = lines_after(&stderr, "guard: new-delete-type-mismatch (1 time)", "#0 ");
    let asan =
        c_program_variant("cxx_type_mismatch.cpp", "asan", &["-fsanitize=address", "-fsanitize-recover=address"]);
    let by_asan = Command::new(&asan).env("ASAN_OPTIONS", "detect_leaks=0:halt_on_error=0").output().unwrap();
    let asan_err = text(&by_asan.stderr);
    // The release's line: the frame after the operator's own (#0).
    let theirs = lines_after(&asan_err, "ERROR: AddressSanitizer: new-delete-type-mismatch", "#1 ");
    assert_eq!(ours, theirs, "{stderr}\n{asan_err}");
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/cxx_type_mismatch.cpp")).unwrap();
    let marked = source.lines().enumerate().filter(|(_, l)| l.contains("// TYPE-MISMATCH ")).map(|(i, _)| i + 1);
    assert_eq!(ours, marked.collect::<Vec<_>>());
    let out = run(Mode::Shim("spy=guard:show_mismatched_frees=0"), &mut Command::new(&program));
    assert_eq!((text(&out.stdout), text(&out.stderr)), ("1000\n".to_string(), String::new()));
}

/// C23's `free_sized` and `free_aligned_sized` must be told the size (and the alignment) the
/// block was allocated with: a free that says another is a free-size-mismatch, named after
/// the function that freed, as a sized `delete`'s is a new-delete-type-mismatch. (glibc 2.43
/// ignores the size; a future allocator may trust it.)
#[test]
fn the_guard_finds_sized_frees_of_another_size_or_alignment() {
    let program = c_program("free_sized.c");
    let out = run(Mode::Shim("spy=guard"), Command::new(&program).arg("wrong"));
    assert_eq!((text(&out.stdout), out.status.code()), ("freed 8 blocks, 6 of them wrongly\n".to_string(), Some(0)));
    let stderr = text(&out.stderr);
    let expect = [
        ("size 100: freed as a block of 64 bytes", "free_sized"),
        ("size 128: allocated with alignment 64, freed with alignment 256", "free_aligned_sized"),
        ("size 128: freed as a block of 192 bytes", "free_aligned_sized"),
        ("size 48: allocated default-aligned, freed with alignment 64", "free_aligned_sized"),
        ("size 64: allocated with alignment 64, freed default-aligned", "free_sized"),
        ("size 10: freed as a block of 0 bytes", "free_sized"),
    ];
    assert_finding_lines(&stderr, "free-size-mismatch", "free_sized", &expect);
    assert!(stderr.contains("0 new-delete-type-mismatch, 6 free-size-mismatch"), "{stderr}");
    // Told right, the thousand pairs of the plain run are no finding.
    let out = run(Mode::Shim("spy=guard"), &mut Command::new(&program));
    assert_eq!(text(&out.stdout), "freed 1000 pairs with the sized frees\n");
    assert!(!text(&out.stderr).contains("guard: "), "{}", text(&out.stderr));
}

/// Blocks the guard cannot lay out (its table full at `max_memory`) are the real allocator's,
/// and their frees raise no finding, wherever they lie: a header of one of the guard's freed
/// blocks, left in memory given back to the top of the heap, made 290 of them invalid frees
/// (review helper 121).
#[test]
fn frees_of_blocks_the_guard_could_not_lay_out_raise_no_finding() {
    let program = c_program("guard_table_full.c");
    let out = run(Mode::Shim("spy=guard:max_memory=6m:exitcode=9"), &mut Command::new(&program));
    let stderr = text(&out.stderr);
    assert_eq!((out.status.code(), text(&out.stdout).as_str()), (Some(0), "ok\n"), "{stderr}");
    assert!(stderr.contains("no room left for the live-block table"), "the table never filled: {stderr}");
    assert!(!stderr.contains("mallocspy: guard:"), "{stderr}");
}

/// The guard and the leak tracker side by side (`spy=guard,leaks`) keep their per-call words
/// apart: they shared three, and every `realloc` went uncounted as a free (100 frees said of
/// 1,100) while the guard read the tracker's record as the releasing function.
#[test]
fn the_guard_beside_the_leak_tracker_counts_every_realloc_as_the_tracker_alone_does() {
    let program = c_program("realloc_chain.c");
    let usage = |spies: &'static str| {
        let out = run(Mode::Shim(spies), &mut Command::new(&program));
        assert_eq!((text(&out.stdout), out.status.code()), ("done\n".to_string(), Some(0)));
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("mallocspy: guard:"), "{stderr}");
        let usage = stderr.lines().find(|l| l.contains("total heap usage:")).expect(&stderr);
        usage.split_once("total heap usage:").unwrap().1.to_string()
    };
    let alone = usage("spy=leaks");
    assert_eq!(alone, " 1,101 allocs, 1,100 frees, 419,346 bytes allocated");
    for spies in ["spy=guard,leaks", "spy=leaks,guard"] {
        assert_eq!(usage(spies), alone, "{spies}");
    }
}

/// C++'s answers to an allocation that cannot be served are kept under every spy: `new`
/// throws `bad_alloc` through the shim's operator (after the program's new-handler), `nothrow`
/// gives NULL, and the aligned forms give aligned blocks.
#[test]
fn cxx_new_still_throws_bad_alloc_and_calls_the_new_handler() {
    let program = c_program("cxx_out_of_memory.cpp");
    let outputs = same_in_every_mode("cxx_out_of_memory", || Command::new(&program));
    assert_eq!(
        text(&outputs[0].1.stdout),
        "new[]: bad_alloc caught\nnew: bad_alloc caught\nnothrow new[]: NULL\n\
         new[]: bad_alloc caught after the new-handler ran 1 time(s)\naligned new: 0 bytes off 256\n\
         aligned nothrow new[]: 0 bytes off 256\n"
    );
}

/// A new-handler that frees memory lets `new` succeed on its next try: the block is the
/// operator's (before, the C++ runtime's operator retried through `malloc`, and the guard
/// called the program's matching `delete` a mismatch), and the run is the native one under an
/// address-space limit (before, the pool's 1 GiB arena took most of the program's room: it got
/// one 100 MiB block where it gets eleven natively).
#[test]
fn a_new_handler_that_frees_memory_lets_new_succeed_as_natively() {
    let program = c_program("cxx_new_handler.cpp");
    let outputs = same_in_every_mode("cxx_new_handler under ulimit -v 1200000", || {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg("ulimit -v 1200000 && exec \"$0\"").arg(&program);
        cmd
    });
    assert_eq!(
        text(&outputs[0].1.stdout),
        "bad_alloc at the end: yes; blocks allocated after the handler freed memory: yes\n"
    );
    // The stack of a block allocated after the handler ran (whose `free`s noted their own
    // stacks) is the program's: it was walked from a dead frame.
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg("ulimit -v 1200000 && exec \"$0\" leak").arg(&program);
    let report = json_report(&run(JSON_REPORT, &mut cmd));
    let leaks = report["leaks"].as_array().unwrap();
    let lost = leaks.iter().find(|r| r["kind"] == "definitely_lost").unwrap_or_else(|| panic!("{report}"));
    assert_eq!(lost["bytes"], 100 << 20, "{report}");
    let functions: Vec<&str> =
        lost["stack"].as_array().unwrap().iter().filter_map(|f| f["function"].as_str()).collect();
    assert!(functions.starts_with(&["allocate(int, unsigned long)", "main"]), "{functions:?}");
}
