#!/usr/bin/env bash
# Benchmarks mallocspy against the native run: builds the shim and the shared workloads,
# then prints median wall-clock ratios and extra ns per allocator call (see scripts/bench.py).
#   scripts/bench.sh [--rounds N] [--iters N]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --release -q
shared=${MALLOCSPY_SHARED:-../shared}
mkdir -p target/bench
make -s -C "$shared/bench" OUT="$PWD/target/bench"
exec python3 scripts/bench.py "$@" target/release/libmallocspy_preload.so target/bench
