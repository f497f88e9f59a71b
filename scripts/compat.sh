#!/usr/bin/env bash
# Runs the real programs installed on this machine natively and under the shim with each
# given MALLOCSPY_OPTIONS, and checks that stdout and exit status are the same. Programs that
# are not installed, or fail natively, are skipped. Not part of the tests, which keep to what
# scripts/install-deps.sh installs: what this reaches depends on the machine (node, java, gdb,
# rustc, ...). CI runs it after the tests.
#
#   scripts/compat.sh ["OPTIONS" ...]     default: "spy=leaks" "spy=ticks" "spy=guard"
#   SHIM=path/to/libmallocspy_preload.so scripts/compat.sh ...   (another build)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
shim="${SHIM:-$root/target/release/libmallocspy_preload.so}"
[ -f "$shim" ] || (cd "$root" && cargo build --release -q) || exit 2
shim="$(realpath "$shim")"
[ $# -gt 0 ] || set -- "spy=leaks" "spy=ticks" "spy=guard"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
seq 1 200000 | sort -R --random-source=<(yes) > numbers.txt
printf 'fn main() { let v: Vec<String> = (0..1000).map(|i| i.to_string()).collect(); println!("{}", v.len()); }\n' > hello.rs
printf 'public class Hello { public static void main(String[] a) { StringBuilder s = new StringBuilder(); for (int i = 0; i < 100000; i++) s.append(i %% 10); System.out.println(s.length()); } }\n' > Hello.java
printf '#include <map>\n#include <string>\n#include <iostream>\nint main() { std::map<int, std::string> m; for (int i = 0; i < 100000; i++) m[i] = std::to_string(i); std::cout << m.size() << "\\n"; }\n' > map.cc

# "program needed|command"
cases=(
  "perl|perl -e 'my %h; \$h{\$_} = \$_ * 2 for 1..200000; print scalar(keys %h), \"\\n\"'"
  "awk|awk '{ s += \$1 } END { print s }' numbers.txt"
  "tar|tar cf - /usr/include 2>/dev/null | gzip -1 | wc -c"
  "xz|xz -T4 -6 -c numbers.txt | xz -d | md5sum"
  "zstd|zstd -T4 -q -c numbers.txt | zstd -q -d | md5sum"
  "bzip2|bzip2 -c numbers.txt | bzip2 -d | md5sum"
  "sort|sort --parallel=4 -S 1M numbers.txt | md5sum"
  "find|find /usr/share -name '*.txt' 2>/dev/null | sort | md5sum"
  "grep|grep -rc include /usr/include 2>/dev/null | sort | md5sum"
  "jq|jq -n '[range(0; 100000)] | map(. * 2) | add'"
  "openssl|openssl dgst -sha256 numbers.txt"
  "file|file /usr/bin/* 2>/dev/null | md5sum"
  "bc|echo 'scale=1000; 4*a(1)' | bc -l | md5sum"
  "git|git -C '$root' log --oneline -n 50 | md5sum"
  "sqlite3|sqlite3 :memory: 'create table t(a); with recursive c(x) as (select 1 union all select x+1 from c where x<100000) insert into t select x from c; select sum(a) from t;'"
  "python3|python3 -c 'import concurrent.futures as f; print(sum(f.ThreadPoolExecutor(8).map(lambda i: len(str(list(range(i)))), range(2000))))'"
  "python3|python3 -c 'import multiprocessing as m; print(sum(m.Pool(4).map(abs, range(-5000, 5000))))'"
  "node|node -e 'let a = []; for (let i = 0; i < 300000; i++) a.push({i, s: String(i)}); console.log(a.length)'"
  "node|node -e 'const {Worker} = require(\"worker_threads\"); let n = 0; for (let i = 0; i < 4; i++) new Worker(\"require(\\\"worker_threads\\\").parentPort.postMessage([...Array(100000).keys()].map(String).length)\", {eval: true}).on(\"message\", m => { n += m; if (n == 400000) console.log(n) })'"
  "java|java -Xmx256m Hello.java"
  "rustc|rustc -O -o hello_rs hello.rs && ./hello_rs"
  "g++|g++ -O1 -o map map.cc && ./map"
  "gdb|gdb -batch -ex 'info functions ^main\$' \"\$(command -v sqlite3)\" 2>&1 | md5sum"
  "vim|vim -es -c 'normal ggdd' -c 'wq! edited.txt' numbers.txt; md5sum edited.txt"
)
failed=0
for options in "$@"; do
  echo "== MALLOCSPY_OPTIONS=$options"
  for c in "${cases[@]}"; do
    need="${c%%|*}" cmd="${c#*|}"
    if ! command -v "$need" >/dev/null; then echo "skip  ($need not installed) ${cmd:0:60}"; continue; fi
    native=$(bash -c "$cmd" 2>/dev/null); native_rc=$?
    if [ $native_rc != 0 ] || [ -z "$native" ]; then
      # Says nothing of mallocspy (a JRE without the compiler for `java Hello.java`, ...).
      echo "skip  (fails natively, exit $native_rc) ${cmd:0:60}"; continue
    fi
    spied=$(LD_PRELOAD="$shim" MALLOCSPY_OPTIONS="$options:log_path=$work/report.%p" timeout 300 bash -c "$cmd" 2>"$work/stderr"); spied_rc=$?
    if [ "$native" == "$spied" ] && [ $native_rc == $spied_rc ]; then
      echo "same  ${cmd:0:70}"
    else
      failed=1
      echo "DIFF  ${cmd:0:70}: exit $native_rc vs $spied_rc"
      echo "      native: ${native:0:120}"; echo "      spied:  ${spied:0:120}"; tail -3 "$work/stderr" | sed 's/^/      /'
    fi
  done
done
exit $failed
