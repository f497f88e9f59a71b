//! Every entry point x {no spy, counting spy, header+trailer spy} x {normal, zero size, huge
//! size, overflow, bad alignment, NULL}: the answers under the shim are glibc's.

mod common;

use common::*;
use std::process::Command;

#[test]
fn every_entry_point_answers_as_glibc_does_under_every_spy() {
    let matrix = c_program("matrix.c");
    let outputs = same_in_every_mode("matrix", || Command::new(&matrix));
    let native = text(&outputs[0].1.stdout);
    assert!(native.lines().count() > 70, "the matrix printed too little:\n{native}");
    assert_eq!(outputs[0].1.status.code(), Some(0));
}

#[test]
fn the_count_spy_counts_every_call_of_the_matrix() {
    let matrix = c_program("matrix.c");
    let out = run(Mode::Shim("spy=count"), &mut Command::new(&matrix));
    let stdout = text(&out.stdout);
    let own = key_values(stdout.lines().find(|l| l.starts_with("calls:")).expect("the matrix prints its counts"));
    let report = count_report(&out.stderr).expect("a count report");
    for (entry, n) in &own {
        let counted = calls(&report, entry);
        // stdio allocates its stdout buffer once: one malloc more than the program made.
        let libc_extra = if entry == "malloc" { 1 } else { 0 };
        assert_eq!(counted, n + libc_extra, "calls of {entry}: spy {counted}, program {n}\n{report}");
    }
    assert!(report["failed"].as_u64().unwrap() >= 20, "the failing cases are counted: {report}");
}
