//! The count spy's figures for churn equal churn's own counters, plus the few calls libc makes.

mod common;

use common::*;
use std::process::Command;

#[test]
fn count_spy_matches_churns_own_counters() {
    let churn = bench_dir().join("churn");
    for threads in ["1", "2"] {
        let out = run(Mode::Shim("spy=count"), Command::new(&churn).args([threads, "300000"]));
        assert!(out.status.success());
        let stdout = text(&out.stdout);
        let own = key_values(stdout.lines().find(|l| l.starts_with("calls:")).unwrap());
        let report = count_report(&out.stderr).expect("a count report");
        let spy = |e: &str| calls(&report, e);
        let close = |what: &str, spy: u64, own: u64, libc: u64| {
            assert!(
                spy >= own && spy <= own + libc,
                "{what} with {threads} thread(s): spy {spy}, churn {own} (+ <= {libc} from libc)\n{report}"
            );
        };
        // GCC compiles churn's realloc(NULL, n) into malloc(n): churn counts those as realloc,
        // the program calls malloc. Their sum is exact.
        close("malloc+realloc", spy("malloc") + spy("realloc"), own["malloc"] + own["realloc"], 8);
        close("calloc", spy("calloc"), own["calloc"], 4);
        close("free", spy("free"), own["free"], 8);
        assert_eq!(spy("posix_memalign"), own["posix_memalign"]);
        assert_eq!(spy("aligned_alloc"), own["aligned_alloc"]);
        assert_eq!(report["failed"], 0);
    }
}
