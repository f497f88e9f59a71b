#!/usr/bin/env python3
"""Wall-clock benchmarks of mallocspy against the native run, on workloads with known call counts.

Each workload runs under every variant in turn, round after round, so that the machine's drift
touches all variants alike; the figures are medians over the rounds. Ratios are to the native
median of the same run, and "extra ns/call" divides the difference by the number of allocator
calls the workload makes (counted once under spy=count). Wall clock is what users see; CPU time
(user + sys of the process and every process below it, on any core: heaptrack's interpreter,
mallocspy's trace writer, which this script adopts as a subreaper) is less disturbed by other
tenants of the machine.

Suites:
  interposer  the shim alone, and with spy=count (issue 2): churn 1 and 2 threads; a malloc and
              a free under each spy, on one thread and on two (`--only pair`); then what the
              shim and each spy add to a process's start and exit (/bin/true from a shell)
  leaks       heaptrack and `mallocspy run` (full stacks, leak report at exit) on churn 1 and 2
              threads, sqlite3 on insert.sql and python3 with PYTHONMALLOC=malloc (issue 3);
              then the exit report (`--only exit`) of a process with 1 million live blocks,
              with the tracker's memory per live block and per stack, and of a Python process
              with 3 million objects in its own arenas
  ticks       spy=ticks at the default interval (allocation ticks and heap statistics into a
              trace file, issue 4) on the same four workloads; target 1.05x native; the
              trace's size per second of run; and what one sample and its free cost, timed
              inside a process (`--only sample`)
  cost        the same four workloads, shortened, under valgrind's cachegrind: instructions and
              simulated cache misses per allocator call that the shim and each spy add, per call
              of the difference between a run and one a quarter its size (so that start-up and
              the exit report cancel out). Counts, not times: the same on every run and every
              machine, where the wall-clock suites swing by 10% or more on a shared machine. Not
              part of `all`.

usage: bench.py [--suite NAME] [--rounds N] [--iters N] [--only TEXT] RELEASE_DIR BENCH_DIR
"""
import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))


def become_subreaper():
    """Makes processes orphaned below us (mallocspy's trace writer, forked twice so that the
    program never sees it as its child) our children, so that their CPU time is counted."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans():
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def run(cmd, env, cwd):
    """Runs cmd; returns (wall s, cpu s of it and every process below it, stdout, stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    reap_orphans()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed with {p.returncode}: {p.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu, p.stdout, p.stderr


def count_calls(cmd, env, cwd, shim):
    """Allocator calls the workload makes (allocating calls and frees), counted by spy=count."""
    _, _, _, err = run(cmd, dict(env, LD_PRELOAD=shim, MALLOCSPY_OPTIONS="spy=count"), cwd)
    counts = [json.loads(line) for line in err.splitlines() if line.startswith('{"calls"')]
    if not counts:
        sys.exit(f"bench: no spy=count report from {' '.join(cmd)}")
    # The workload's own process is the one that made the most calls.
    calls = max(counts, key=lambda c: sum(c["calls"].values()))["calls"]
    return sum(n for name, n in calls.items() if name not in ("malloc_usable_size", "malloc_trim"))


def python3():
    """The real interpreter behind `python3` (not a wrapper such as pyenv's shim)."""
    out = subprocess.run(["python3", "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
    return out.stdout.strip() or "python3"


def median_interval(values, level=0.95):
    """A distribution-free confidence interval of the median of `values`: between the k-th
    smallest and the k-th largest, k the largest rank such that a Binomial(n, 1/2) falls
    below it with probability at most (1 - level) / 2. None when n is too small."""
    xs, n = sorted(values), len(values)
    below, k = 0.0, 0
    while True:
        below += math.comb(n, k) / 2**n
        if below > (1 - level) / 2:
            break
        k += 1
    return (xs[k - 1], xs[n - k]) if k > 0 else None


def compare(name, cmd, env, calls, variants, rounds, cwd):
    """Runs cmd under each variant `rounds` times, alternating; prints medians and ratios.
    A variant is (name, wrap), wrap(cmd, env) giving the argv and environment to run.
    Returns each variant's extra ns per call (from the medians of wall and of CPU time) and
    its wall times by round."""
    wall = {v: [] for v, _ in variants}
    cpu = {v: [] for v, _ in variants}
    for r in range(rounds):
        # Every other round in reverse order: whatever the run before leaves behind (memory the
        # kernel is still reclaiming, a cooled cache) falls on each variant alike.
        for v, wrap in variants if r % 2 == 0 else variants[::-1]:
            t, c, _, _ = run(*wrap(cmd, env), cwd)
            wall[v].append(t)
            cpu[v].append(c)
    native_wall = statistics.median(wall["native"])
    native_cpu = statistics.median(cpu["native"])
    print(f"\n{name}  ({calls:,} allocator calls)")
    print(
        f"  {'variant':<18} {'wall s':>7} {'ratio':>7} {'extra ns/call':>14}   {'cpu s':>7} {'ratio':>7} {'extra ns/call':>14}"
        f"   {'paired':>7} {'95% interval':>15}"
    )
    extra, extra_cpu = {}, {}
    for v, _ in variants:
        w, c = statistics.median(wall[v]), statistics.median(cpu[v])
        extra[v] = (w - native_wall) / calls * 1e9
        extra_cpu[v] = (c - native_cpu) / calls * 1e9
        # The median of each round's ratio to the native run of that round: a machine whose
        # speed drifts between rounds moves both runs of a round alike.
        # The interval says how far the noise leaves that median uncertain.
        ratios = [x / n for x, n in zip(wall[v], wall["native"])]
        paired = statistics.median(ratios)
        interval = median_interval(ratios)
        interval = f"{interval[0]:.3f}-{interval[1]:.3f}x" if interval else "-"
        print(
            f"  {v:<18} {w:7.3f} {w / native_wall:6.3f}x {extra[v]:14.1f}"
            f"   {c:7.3f} {c / native_cpu:6.3f}x {extra_cpu[v]:14.1f}   {paired:6.3f}x {interval:>15}"
        )
    return extra, extra_cpu, wall


def process_cost(a, base, shim):
    """What the shim adds to each process's start and exit: a shell that runs /bin/true 200
    times, every process of it preloaded, as a build or a configure script runs."""
    n = 200
    cmd = ["sh", "-c", f"i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done"]
    scratch = tempfile.mkdtemp(prefix="mallocspy-bench-")
    trace = f"spy=ticks:trace={scratch}/t.%p"
    options = ("spy=none", "spy=ticks", trace, "spy=leaks")
    variants = [("native", {})] + [(o, {"LD_PRELOAD": shim, "MALLOCSPY_OPTIONS": f"{o}:log_path=/dev/null"}) for o in options]
    wall = {v: [] for v, _ in variants}
    cpu = {v: [] for v, _ in variants}
    for r in range(a.rounds):
        for v, extra in variants if r % 2 == 0 else variants[::-1]:
            t, c, _, _ = run(cmd, dict(base, **extra), a.bench_dir)
            wall[v].append(t / n * 1e3)
            cpu[v].append(c / n * 1e3)
        for name in os.listdir(scratch):
            os.unlink(os.path.join(scratch, name))
    os.rmdir(scratch)
    print(f"\nprocess start and exit ({n} runs of /bin/true from sh, all preloaded): ms per process")
    print(f"  {'variant':<18} {'wall ms':>8} {'extra':>7}   {'cpu ms':>7} {'extra':>7}")
    for v, _ in variants:
        w, c = statistics.median(wall[v]), statistics.median(cpu[v])
        v = "spy=ticks, trace" if v == trace else v
        print(f"  {v:<18} {w:8.3f} {w - statistics.median(wall['native']):7.3f}   {c:7.3f} {c - statistics.median(cpu['native']):7.3f}")


def interposer_suite(a, base, shim):
    variants = [
        ("native", lambda cmd, env: (cmd, env)),
        ("shim, no spy", lambda cmd, env: (cmd, dict(env, LD_PRELOAD=shim, MALLOCSPY_OPTIONS="spy=none"))),
        ("shim, spy=count", lambda cmd, env: (cmd, dict(env, LD_PRELOAD=shim, MALLOCSPY_OPTIONS="spy=count"))),
    ]
    print("\n== interposer: the shim alone and with spy=count ==")
    for threads in (1, 2):
        cmd = ["./churn", str(threads), str(a.iters)]
        name = f"churn {threads} thread{'s' if threads > 1 else ''}"
        if a.only and a.only not in name:
            continue
        compare(name, cmd, base, count_calls(cmd, base, a.bench_dir, shim), variants, a.rounds, a.bench_dir)
    if not a.only or a.only in "pair cost":
        pair_cost(a, base, shim)
    if not a.only or a.only in "process start and exit":
        process_cost(a, base, shim)


def pair_cost(a, base, shim):
    """A malloc and a free and nothing else between them (sample_cost.c, warm L1, no samples),
    on one thread and on two at once, under each spy: what the dispatch and the spy cost a
    call, and whether two threads slow each other down (each thread's figure is what one
    thread alone pays when they do not: counters of different threads sharing a line made
    spy=count's 13 times slower, the guard's shared ring and the tracker's peak 2.3 and 1.4)."""
    spies = ("none", "count", "ticks", "leaks", "guard")
    variants = [("native", None)] + [(s, f"spy={s}:log_path=/dev/null") for s in spies]
    print("\ncost of a malloc and a free (sample_cost.c, warm L1: fastest of 5 passes, ns per pair)")
    print(f"  {'threads':<10}" + "".join(f"{v:>10}" for v, _ in variants))
    for threads in (1, 2):
        ns = {v: [] for v, _ in variants}
        for r in range(a.rounds):
            for v, options in variants if r % 2 == 0 else variants[::-1]:
                env = base if options is None else dict(base, LD_PRELOAD=shim, MALLOCSPY_OPTIONS=options)
                _, _, out, _ = run(["./sample_cost", "200000", "0", str(threads)], env, a.bench_dir)
                ns[v].append(float(re.search(r"ns_per_pair=([\d.]+)", out).group(1)))
        print(f"  {threads:<10}" + "".join(f"{statistics.median(ns[v]):>10.1f}" for v, _ in variants))


def real_workloads(a, base):
    """churn with 1 and 2 threads, sqlite3 on insert.sql, python3 with PYTHONMALLOC=malloc."""
    py_env = dict(base, PYTHONMALLOC="malloc")
    return [
        ("churn 1 thread", ["./churn", "1", str(a.iters)], base),
        ("churn 2 threads", ["./churn", "2", str(a.iters)], base),
        ("sqlite3 insert.sql", ["sqlite3", ":memory:", ".read insert.sql"], base),
        ("python3 workload.py", [python3(), os.path.join(SCRIPTS, "workload.py")], py_env),
    ]


def leaks_suite(a, base, shim, mallocspy):
    if not shutil.which("heaptrack"):
        sys.exit("bench: heaptrack is not installed (scripts/install-deps.sh installs it)")
    scratch = tempfile.mkdtemp(prefix="mallocspy-bench-")
    variants = [
        ("native", lambda cmd, env: (cmd, env)),
        ("heaptrack", lambda cmd, env: (["heaptrack", "-o", os.path.join(scratch, "heaptrack"), *cmd], env)),
        ("mallocspy run", lambda cmd, env: ([mallocspy, "run", "--log", os.path.join(scratch, "report"), "--", *cmd], env)),
    ]
    workloads = real_workloads(a, base)
    print("\n== leaks: heaptrack and mallocspy run (full stacks, report at exit) ==")
    print("target: mallocspy's extra ns/call at most 1/3 of heaptrack's")
    for name, cmd, env in workloads:
        if a.only and a.only not in name:
            continue
        extra, extra_cpu, wall = compare(
            name, cmd, env, count_calls(cmd, env, a.bench_dir, shim), variants, a.rounds, a.bench_dir
        )
        share = extra["mallocspy run"] / extra["heaptrack"] if extra["heaptrack"] > 0 else float("nan")
        # In CPU time, heaptrack's interpreter on the second core counts too.
        cpu_share = extra_cpu["mallocspy run"] / extra_cpu["heaptrack"] if extra_cpu["heaptrack"] > 0 else float("nan")
        # The same share within each round (its three runs alternate, close in time), whose
        # median a machine that changes speed between rounds moves less than the medians'.
        by_round = [
            (m - n) / (h - n) for n, h, m in zip(wall["native"], wall["heaptrack"], wall["mallocspy run"]) if h > n
        ]
        paired = statistics.median(by_round) if by_round else float("nan")
        print(
            f"  mallocspy / heaptrack extra cost: {share:.2f} ({'within' if share <= 1 / 3 else 'above'} 1/3);"
            f" round by round: median {paired:.2f}; in CPU time: {cpu_share:.2f}"
        )
    shutil.rmtree(scratch, ignore_errors=True)
    if not a.only or a.only == "exit":
        exit_report(a, base, shim, mallocspy)


def ticks_suite(a, base, shim, mallocspy):
    scratch = tempfile.mkdtemp(prefix="mallocspy-bench-")
    trace = os.path.join(scratch, "trace")
    variants = [
        ("native", lambda cmd, env: (cmd, env)),
        ("mallocspy record", lambda cmd, env: ([mallocspy, "record", "--output", trace, "--", *cmd], env)),
    ]
    workloads = real_workloads(a, base)
    print("\n== ticks: mallocspy record (spy=ticks, poisson, 100 KiB interval, trace file) ==")
    print("target: at most 1.05x native wall clock")
    for name, cmd, env in workloads:
        if a.only and a.only not in name:
            continue
        compare(name, cmd, env, count_calls(cmd, env, a.bench_dir, shim), variants, a.rounds, a.bench_dir)
        wall, _, _, _ = run(variants[1][1](cmd, env)[0], env, a.bench_dir)
        size = os.path.getsize(trace)
        lost = lost_events(mallocspy, trace)
        print(f"  trace: {size:,} bytes in {wall:.2f} s = {size / wall / 1024:.1f} KiB/s, events lost: {lost}")
    if not a.only or a.only in "sample cost":
        sample_cost(a, base, shim, mallocspy, trace)
    shutil.rmtree(scratch, ignore_errors=True)


def lost_events(mallocspy, trace):
    """The events a trace says its writer could not take (its queue was full)."""
    report = subprocess.run([mallocspy, "report", "--format", "json", trace], capture_output=True, text=True)
    return json.loads(report.stdout)["lost_events"] if report.returncode == 0 else "unknown"


def sample_cost(a, base, shim, mallocspy, trace):
    """What a sample and the free of its block cost, timed inside a process (sample_cost.c):
    an allocation and a free with every allocation sampled, less the same with none, with the
    L1 cache warm and cold. The writer drains every 2 ms here: at this rate of samples its
    queue fills in 10 ms (a dropped message costs nothing, which would flatter the figure);
    the events lost are counted from the last trace of each row. The last row runs two threads
    at once, each in its own arena as a server's workers are, untraced: two threads sampling
    every allocation outrun one writer on the machine's other core, so a traced figure there
    would count dropped messages as free."""
    every = f"spy=ticks:sample_interval=1:trace={trace}:stats_interval_ms=2"
    variants = [
        ("native", None),
        ("no samples", "spy=ticks:sample_interval=1024m"),
        ("every allocation", "spy=ticks:sample_interval=1"),
        ("every, traced", every),
    ]
    print("\ncost of a sample (sample_cost.c: fastest of 5 passes of an allocation and a free, ns per pair)")
    print(f"  {'L1 cache':<16}" + "".join(f"{v:>18}" for v, _ in variants) + f"{'a sample':>12}{'traced':>10}")
    rows = (("warm", 200000, 0, 1), ("cold", 40000, 65536, 1), ("warm, 2 threads", 200000, 0, 2))
    for label, calls, scrub, threads in rows:
        row = variants if threads == 1 else variants[:-1]
        ns = {v: [] for v, _ in row}
        for r in range(a.rounds):
            for v, options in row if r % 2 == 0 else row[::-1]:
                env = base if options is None else dict(base, LD_PRELOAD=shim, MALLOCSPY_OPTIONS=options)
                _, _, out, _ = run(["./sample_cost", str(calls), str(scrub), str(threads)], env, a.bench_dir)
                ns[v].append(float(re.search(r"ns_per_pair=([\d.]+)", out).group(1)))
        med = {v: statistics.median(t) for v, t in ns.items()}
        none = med["no samples"]
        cells = "".join(f"{med[v]:>18.1f}" if v in med else f"{'-':>18}" for v, _ in variants)
        if threads == 1:
            traced = f"{med['every, traced'] - none:>10.1f}   (events lost: {lost_events(mallocspy, trace)})"
        else:
            traced = f"{'-':>10}"
        print(f"  {label:<16}{cells}{med['every allocation'] - none:>12.1f}{traced}")


def cachegrind(cmd, env, cwd):
    """Instructions, D1 misses and misses of a 2 MiB last level (the Xeon's L2: what comes from
    the L3 or memory) of one run under cachegrind."""
    with tempfile.NamedTemporaryFile(prefix="mallocspy-cg-") as out:
        argv = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--LL=2097152,16,64"]
        argv += [f"--cachegrind-out-file={out.name}", *cmd]
        p = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            sys.exit(f"bench: cachegrind of {' '.join(cmd)} failed with {p.returncode}: {p.stderr.strip()[-500:]}")
        for line in open(out.name):
            if line.startswith("summary:"):
                # Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw
                n = [int(x) for x in line.split()[1:]]
                return n[0], n[4] + n[7], n[5] + n[8]
    sys.exit(f"bench: no cachegrind summary for {' '.join(cmd)}")


def cost_suite(a, base, shim):
    """Instructions and cache misses per allocator call, counted by cachegrind. Each workload
    runs at two sizes and the counts are taken per call of the difference: what a process
    pays once, at start and at exit, cancels out (under valgrind the leak scan at exit reads
    valgrind's own memory as the program's, hundreds of MB that dwarfed the calls)."""
    if not shutil.which("valgrind"):
        sys.exit("bench: valgrind is not installed (scripts/install-deps.sh installs it)")
    shared = os.environ.get("MALLOCSPY_SHARED", os.path.join(SCRIPTS, "..", "..", "shared"))
    for rows in (3000, 12000):
        sql = os.path.join(a.bench_dir, f"insert-{rows}.sql")
        if not os.path.exists(sql):
            subprocess.run(["python3", os.path.join(shared, "bench", "gen_sql.py"), str(rows), sql], check=True)
    # A fixed hash seed: with a random one python3's dicts probe differently, and so its
    # instruction counts move, from run to run.
    py_env = dict(base, PYTHONMALLOC="malloc", PYTHONHASHSEED="0")
    py = [python3(), os.path.join(SCRIPTS, "workload.py")]
    sql = ["sqlite3", ":memory:"]
    # (name, the workload at its full size and at a quarter of it, environment)
    workloads = [
        ("churn 1 thread", ["./churn", "1", "100000"], ["./churn", "1", "25000"], base),
        ("sqlite3 insert.sql, 12,000 rows", [*sql, ".read insert-12000.sql"], [*sql, ".read insert-3000.sql"], base),
        ("python3 workload.py 4", [*py, "4"], [*py, "1"], py_env),
    ]

    def spied(options):
        return lambda env: dict(env, LD_PRELOAD=shim, MALLOCSPY_OPTIONS=options)

    variants = [
        ("native", lambda env: env),
        ("shim, no spy", spied("spy=none")),
        ("spy=ticks", spied("spy=ticks:sample_seed=1")),
        ("spy=leaks", spied("spy=leaks:log_path=/dev/null")),
    ]
    print("\n== cost: instructions and cache misses per allocator call (cachegrind; counts, not times) ==")
    for name, full, quarter, env in workloads:
        if a.only and a.only not in name:
            continue
        calls = count_calls(full, env, a.bench_dir, shim) - count_calls(quarter, env, a.bench_dir, shim)
        print(f"\n{name}  ({calls:,} allocator calls between the two sizes)")
        print(
            f"  {'variant':<14} {'instructions':>14} {'ratio':>7} {'extra/call':>11}   {'D1 misses':>11} {'extra/call':>11}"
            f"   {'LL misses':>10} {'extra/call':>11}"
        )
        native = None
        for v, wrap in variants:
            big, small = (cachegrind(cmd, wrap(env), a.bench_dir) for cmd in (full, quarter))
            ir, d1, ll = (b - s for b, s in zip(big, small))
            native = native or (ir, d1, ll)
            print(
                f"  {v:<14} {ir:14,} {ir / native[0]:6.3f}x {(ir - native[0]) / calls:11.1f}"
                f"   {d1:11,} {(d1 - native[1]) / calls:11.2f}   {ll:10,} {(ll - native[2]) / calls:11.3f}"
            )


def exit_report(a, base, shim, mallocspy):
    """Time from the program's last act to its exit, with and without the leak report: for
    1 million live blocks, and for a Python heap of 3 million objects in pymalloc's arenas
    (roots the scan reads word by word)."""
    programs = [
        ("million: 1,000,000 live blocks at exit (1,000 stacks, half lost)", ["./million"], r"main returns at (\d+\.\d+)"),
        (
            "python3: 3,000,000 objects alive at exit in pymalloc's arenas (about 200 MiB of roots)",
            [python3(), os.path.join(SCRIPTS, "exit_heap.py")],
            r"exits at (\d+\.\d+)",
        ),
    ]
    for title, program, last_act in programs:
        print(f"\n{title}")
        times = {"native": [], "mallocspy run": []}
        tracker = ""
        for r in range(a.rounds):
            for v in times if r % 2 == 0 else list(times)[::-1]:
                argv = program if v == "native" else [mallocspy, "run", "--log", os.devnull, "--", *program]
                _, _, out, _ = run(argv, base, a.bench_dir)
                end = time.clock_gettime(time.CLOCK_MONOTONIC)
                times[v].append(end - float(re.search(last_act, out).group(1)))
                tracker = next((line for line in out.splitlines() if line.startswith("tracker:")), tracker)
        for v, t in times.items():
            print(f"  {v:<18} last act to exit: median {statistics.median(t):.3f} s (min {min(t):.3f}, max {max(t):.3f})")
        if tracker:
            print(f"  {tracker}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["all", "interposer", "leaks", "ticks", "cost"], default="all")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=1500000, help="churn iterations per thread")
    ap.add_argument("--only", help="run only workloads whose name contains this")
    ap.add_argument("release_dir", help="where cargo put libmallocspy_preload.so and mallocspy")
    ap.add_argument("bench_dir", help="the built workloads of ../shared/bench, million and sample_cost")
    a = ap.parse_args()
    # A bare run on a fresh checkout stopped with a traceback after minutes of workloads.
    built = ("churn", "insert.sql", "million", "sample_cost", "libmallocspy_preload.so", "mallocspy")
    dirs = {"libmallocspy_preload.so": a.release_dir, "mallocspy": a.release_dir}
    missing = [name for name in built if not os.path.exists(os.path.join(dirs.get(name, a.bench_dir), name))]
    if missing:
        sys.exit(f"bench.py: not built: {', '.join(missing)} (scripts/bench.sh builds everything, then runs this)")
    become_subreaper()

    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOCSPY_OPTIONS", "PYTHONMALLOC")}
    shim = os.path.abspath(os.path.join(a.release_dir, "libmallocspy_preload.so"))
    mallocspy = os.path.abspath(os.path.join(a.release_dir, "mallocspy"))
    print(f"mallocspy benchmark: median of {a.rounds} alternating rounds; {os.cpu_count()} CPUs")
    if a.suite in ("all", "interposer"):
        interposer_suite(a, base, shim)
    if a.suite in ("all", "leaks"):
        leaks_suite(a, base, shim, mallocspy)
    if a.suite in ("all", "ticks"):
        ticks_suite(a, base, shim, mallocspy)
    if a.suite == "cost":
        cost_suite(a, base, shim)


if __name__ == "__main__":
    main()
