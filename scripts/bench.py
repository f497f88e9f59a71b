#!/usr/bin/env python3
"""Wall-clock benchmark of mallocspy against the native run, on workloads with known call counts.

Each workload runs under every variant in turn (native, shim, shim + spy, ...), round after round,
so that the machine's drift touches all variants alike; the figures are medians over the rounds.
Ratios are to the native median of the same run, and "extra ns/call" divides the wall-clock
difference by the number of allocator calls the workload makes (churn prints them).

usage: bench.py [--rounds N] [--iters N] [--only NAME] SHIM BENCH_DIR
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time


def run(cmd, env, cwd):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed with {p.returncode}: {p.stderr.strip()[-500:]}")
    return elapsed, p.stdout


def churn_calls(stdout):
    m = re.search(r"free=(\d+) alloc_calls_total=(\d+)", stdout)
    return int(m.group(1)) + int(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=1500000, help="churn iterations per thread")
    ap.add_argument("--only", help="run only workloads whose name contains this")
    ap.add_argument("shim")
    ap.add_argument("bench_dir")
    a = ap.parse_args()

    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOCSPY_OPTIONS")}
    shim = os.path.abspath(a.shim)
    variants = [
        ("native", dict(base)),
        ("shim, no spy", dict(base, LD_PRELOAD=shim)),
        ("shim, spy=count", dict(base, LD_PRELOAD=shim, MALLOCSPY_OPTIONS="spy=count")),
    ]
    workloads = [
        (f"churn 1 thread", ["./churn", "1", str(a.iters)]),
        (f"churn 2 threads", ["./churn", "2", str(a.iters)]),
    ]
    print(f"mallocspy benchmark: median of {a.rounds} alternating rounds; {os.cpu_count()} CPUs")
    for name, cmd in workloads:
        if a.only and a.only not in name:
            continue
        times = {v: [] for v, _ in variants}
        calls = None
        for _ in range(a.rounds):
            for v, env in variants:
                t, out = run(cmd, env, a.bench_dir)
                times[v].append(t)
                calls = calls or churn_calls(out)
        native = statistics.median(times["native"])
        print(f"\n{name}  ({calls:,} allocator calls)")
        print(f"  {'variant':<18} {'median s':>9} {'ratio':>7} {'extra ns/call':>14}")
        for v, _ in variants:
            m = statistics.median(times[v])
            extra = (m - native) / calls * 1e9
            print(f"  {v:<18} {m:9.3f} {m / native:6.3f}x {extra:14.1f}")


if __name__ == "__main__":
    main()
