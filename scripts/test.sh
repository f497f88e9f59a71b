#!/usr/bin/env bash
# The test command: installs what the tests run, builds everything, runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --release
cargo test --release "$@"
