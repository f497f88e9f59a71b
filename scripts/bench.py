#!/usr/bin/env python3
"""Wall-clock benchmark of mallocspy against the native run, on workloads with known call counts.

Each workload runs under every variant in turn (native, shim, shim + spy, ...), round after round,
so that the machine's drift touches all variants alike; the figures are medians over the rounds.
Ratios are to the native median of the same run, and "extra ns/call" divides the difference by
the number of allocator calls the workload makes (churn prints them). Wall clock is what users
see; CPU time (user + sys of the process) is less disturbed by other tenants of the machine.
Page faults are shown because the heap's layout alone moves them, and with them the time.

usage: bench.py [--rounds N] [--iters N] [--only NAME] SHIM BENCH_DIR
"""
import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time


def run(cmd, env, cwd):
    """Runs cmd; returns (wall s, cpu s, minor page faults, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed with {p.returncode}: {p.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu, after.ru_minflt - before.ru_minflt, p.stdout


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
        wall = {v: [] for v, _ in variants}
        cpu = {v: [] for v, _ in variants}
        faults = {}
        calls = None
        for _ in range(a.rounds):
            for v, env in variants:
                t, c, f, out = run(cmd, env, a.bench_dir)
                wall[v].append(t)
                cpu[v].append(c)
                faults[v] = f
                calls = calls or churn_calls(out)
        native_wall = statistics.median(wall["native"])
        native_cpu = statistics.median(cpu["native"])
        print(f"\n{name}  ({calls:,} allocator calls)")
        print(f"  {'variant':<18} {'wall s':>7} {'ratio':>7} {'extra ns/call':>14}   {'cpu s':>7} {'ratio':>7} {'extra ns/call':>14}  {'page faults':>11}")
        for v, _ in variants:
            w, c = statistics.median(wall[v]), statistics.median(cpu[v])
            print(
                f"  {v:<18} {w:7.3f} {w / native_wall:6.3f}x {(w - native_wall) / calls * 1e9:14.1f}"
                f"   {c:7.3f} {c / native_cpu:6.3f}x {(c - native_cpu) / calls * 1e9:14.1f}  {faults[v]:11,}"
            )


if __name__ == "__main__":
    main()
