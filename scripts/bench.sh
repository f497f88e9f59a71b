#!/usr/bin/env bash
# Benchmarks mallocspy against the native run (and heaptrack): builds mallocspy, the shared
# workloads and the fixtures million and sample_cost, then prints median wall-clock ratios and
# extra ns per allocator call (see scripts/bench.py).
#   scripts/bench.sh [--suite interposer|leaks|ticks|cost] [--rounds N] [--iters N] [--only TEXT]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --release -q
export MALLOCSPY_SHARED=${MALLOCSPY_SHARED:-../shared}
shared=$MALLOCSPY_SHARED
mkdir -p target/bench
make -s -C "$shared/bench" OUT="$PWD/target/bench"
gcc -O2 -g -Iinclude -o target/bench/million tests/fixtures/million.c
gcc -O2 -g -pthread -o target/bench/sample_cost tests/fixtures/sample_cost.c
exec python3 scripts/bench.py "$@" target/release target/bench
