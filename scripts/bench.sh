#!/usr/bin/env bash
# Benchmarks (figures for docs/benchmarks.md). Measures; never fails on time.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p calc-server -p calc-graph --benches --bins >/dev/null 2>&1 || cargo build --release -p calc-server
BIN=./target/release/calc-server
WORK=${BENCH_DIR:-$(mktemp -d)}
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r)"

echo; echo "== selectors"
cargo bench -q -p calc-graph --bench selectors 2>/dev/null | grep selector

run() { # name nodes eps policies namespaces
  local dir="$WORK/$1"
  "$BIN" gen-cluster --nodes "$2" --endpoints-per-node "$3" --policies "$4" --namespaces "$5" --out "$dir" >/dev/null 2>&1
  echo; echo "== calculation graph: $2 nodes x $3 endpoints, $4 policies, $5 namespaces"
  "$BIN" bench --file-dir "$dir" | tee "$WORK/$1.out"
}
run c10k 100 100 1000 100
run c100k 100 1000 1000 100
a=$(awk '/retained_rss_bytes/ {print $2}' "$WORK/c10k.out")
b=$(awk '/retained_rss_bytes/ {print $2}' "$WORK/c100k.out")
echo; echo "memory per endpoint (slope 10k -> 100k endpoints): $(( (b - a) / 90000 )) bytes"
