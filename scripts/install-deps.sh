#!/usr/bin/env bash
# Installs the Debian packages the tests and benchmarks run: the real programs of the
# compatibility matrix, the allocators mallocspy composes with (libc6-dev: headers, and
# libc.a for the statically linked fixture), and the readers of the reports (Go's pprof,
# Chromium for screenshots of the SVGs), strace (a tracer already there, under which the
# leak check stops threads with a signal) and universal-ctags (whose sandbox is a libseccomp
# filter). Skips what is present.
set -euo pipefail

packages=(gcc g++ libc6-dev make git sqlite3 python3 valgrind heaptrack libjemalloc2 libtcmalloc-minimal4 golang-go libc6-dbg chromium strace libcap2-bin universal-ctags)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}" >&2
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
