#!/usr/bin/env bash
# Benchmarks (figures for docs/benchmarks.md). Measures; never fails on time.
#   scripts/bench.sh [all|calc|sync|stats|flows]   (make bench, make bench-calc, make bench-sync,
#                                                   make bench-stats, make bench-flows)
# calc: the calculation graph at 10k and 100k endpoints; sync: the Sync stream with 1,000 then
# 5,000 simulated agents on one server, then 3,000 agents on three replicas behind one address
# with one replica killed;
# stats: the same 1,000 agents reporting rule stats every second (STATS_SECONDS, default 20);
# flows: flow logs: calc-server's ingest on one core (time and callgrind instructions per
# record), memory per flow key, and the agent's CPU per 1,000 new connections/s (root).
# all adds the churn, the Linux driver and the label flip to the kernel (the last two as root).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
case "$MODE" in all|calc|sync|stats|flows) ;; *) echo "usage: $0 [all|calc|sync|stats|flows]" >&2; exit 2 ;; esac
cargo build --release -p calc-server -p bench-tools -p calc-graph --benches --bins >/dev/null 2>&1 || cargo build --release -p calc-server -p bench-tools
BIN=./target/release/calc-server
BENCH=./target/release/calc-bench
WORK=${BENCH_DIR:-$(mktemp -d)}
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r)"

if [ "$MODE" = all ]; then
  echo; echo "== selectors"
  cargo bench -q -p calc-graph --bench selectors 2>/dev/null | grep selector
fi

run() { # name nodes eps policies namespaces
  local dir="$WORK/$1"
  "$BENCH" gen-cluster --nodes "$2" --endpoints-per-node "$3" --policies "$4" --namespaces "$5" --out "$dir" >/dev/null 2>&1
  echo; echo "== calculation graph: $2 nodes x $3 endpoints, $4 policies, $5 namespaces"
  "$BENCH" bench --file-dir "$dir" | tee "$WORK/$1.out"
}
if [ "$MODE" = all ] || [ "$MODE" = calc ]; then
  run c10k 100 100 1000 100
  run c100k 100 1000 1000 100
  a=$(awk '/retained_rss_bytes/ {print $2}' "$WORK/c10k.out")
  b=$(awk '/retained_rss_bytes/ {print $2}' "$WORK/c100k.out")
  echo; echo "(slope of the retained memory from 10k to 100k endpoints)"
  echo "memory per endpoint: $(( (b - a) / 90000 )) bytes"
  "$BENCH" gen-cluster --shape antrea --nodes 1000 --namespaces 25000 --out "$WORK/antrea" >/dev/null 2>&1
  echo; echo "== calculation graph: Antrea's controller benchmark shape (25000 namespaces, 100000 pods, 75000 NetworkPolicies, 1000 nodes)"
  "$BENCH" bench --file-dir "$WORK/antrea" --name antrea --flips 200
fi

if [ "$MODE" = all ] || [ "$MODE" = flows ]; then
  echo; echo "== Flow logs: calc-server ingest on one core (parse + FlowIngest::add) and memory per flow key"
  "$BENCH" flows
  echo; echo "== Flow logs: instructions per record (callgrind, the same records, one round)"
  if command -v valgrind >/dev/null; then
    cg() { # label records staged-records: instructions in ingest_all per record
      valgrind --tool=callgrind --callgrind-out-file="$WORK/flows.callgrind" --collect-atstart=no \
        --toggle-collect='*flows_bench::ingest_all*' "$BENCH" flows --records "$2" --staged-records "$3" \
        --rounds 1 --memory-keys 0 >/dev/null 2>"$WORK/flows.callgrind.log"
      local ir n=$(( $2 + $3 ))
      ir=$(awk '/^(summary|totals):/ {print $2; exit}' "$WORK/flows.callgrind")
      echo "$1: $(( ir / n )) per record ($ir for $n records)"
    }
    cg "flows ingest instructions" "${FLOWS_CALLGRIND_RECORDS:-20000}" 0
    cg "flows ingest with staged policies instructions" 0 "${FLOWS_CALLGRIND_STAGED_RECORDS:-100}"
  else
    echo "skipped: valgrind is not installed"
  fi
  echo; echo "== Flow logs: the agent's CPU per 1,000 new connections/s (fresh network namespaces)"
  if [ "$(id -u)" = 0 ]; then
    cargo build --release -p calc-server -p dataplane-agent >/dev/null 2>&1
    cargo bench -q -p bench-tools --bench agent_flows
  else
    echo "skipped: needs root (network namespaces, iptables, ipset)"
  fi
fi
if [ "$MODE" = all ]; then
  echo; echo "== Policy recommendations: one namespace of 1,000 pods from 100,000 flow records (pure, one thread)"
  "$BENCH" recommend
fi
case "$MODE" in calc|flows) exit 0 ;; esac

PORT=${BENCH_GRPC_PORT:-50771}
SERVER=
REPLICAS=
trap '[ -n "$SERVER" ] && kill $SERVER 2>/dev/null; for r in $REPLICAS; do kill "$r" 2>/dev/null; done' EXIT
# 5,000 agents hold 5,000 connections in the bench and as many in the server.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
"$BENCH" gen-cluster --nodes 1000 --endpoints-per-node 10 --policies 1000 --namespaces 100 --out "$WORK/s1k" >/dev/null 2>&1
# Every simulated agent connects from 127.0.0.1 within a second: the pending-connection limits
# (per address 64, in all 1024 by default) would close most of them at accept, and they would
# come back with back-off; a real fleet connects from one address per node.
serve() { # datastore-dir grpc-port log [serve flags]: starts a server in the background, waits for its admin endpoint
  local dir=$1 port=$2 log=$3; shift 3
  "$BIN" serve --file-dir "$dir" --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$((port + 1))" \
    --file-poll-interval 10ms --max-pending-per-address 8192 --max-pending-connections 8192 --log-level warn "$@" >"$log" 2>&1 &
  SERVED=$!
  for _ in $(seq 300); do
    "$BIN" status --server "127.0.0.1:$((port + 1))" >/dev/null 2>&1 && break
    sleep 0.1
  done
  # A port in the ephemeral range may be held by a connection of an earlier run: say so.
  kill -0 "$SERVED" 2>/dev/null || { echo "calc-server on port $port did not start: $(tail -1 "$log")" >&2; exit 1; }
}
sync_bench() { # nodes datastore-dir [extra bench-sync flags]
  local nodes=$1 dir=$2; shift 2
  serve "$dir" "$PORT" "$WORK/serve.log"
  SERVER=$SERVED
  "$BENCH" bench-sync --server "http://127.0.0.1:$PORT" --nodes "$nodes" --file-dir "$dir" --server-pid "$SERVER" --changes 20 \
    --admin "127.0.0.1:$((PORT + 1))" "$@"
  kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true
  SERVER=
}
if [ "$MODE" != stats ]; then
  echo; echo "== Sync stream: 1000 simulated agents (1000 nodes x 10 endpoints, 1000 policies)"
  sync_bench 1000 "$WORK/s1k"
  "$BENCH" gen-cluster --nodes 5000 --endpoints-per-node 10 --policies 1000 --namespaces 100 --out "$WORK/s5k" >/dev/null 2>&1
  echo; echo "== Sync stream: 5000 simulated agents on one server (5000 nodes x 10 endpoints, 1000 policies)"
  sync_bench 5000 "$WORK/s5k" --contract-change-p99
  echo; echo "== Sync stream: 3 replicas behind one address, 3000 agents (of the 5000-node cluster), one replica killed"
  pids=() addrs=() admins=()
  for k in 0 1 2; do
    p=$((PORT + 10 + 2 * k))
    serve "$WORK/s5k" "$p" "$WORK/replica-$k.log"
    pids+=("$SERVED") addrs+=("127.0.0.1:$p") admins+=("127.0.0.1:$((p + 1))")
    REPLICAS="$REPLICAS $SERVED"
  done
  "$BENCH" bench-sync --nodes 3000 --file-dir "$WORK/s5k" \
    --failover-replicas "$(IFS=,; echo "${addrs[*]}")" --failover-pids "$(IFS=,; echo "${pids[*]}")" \
    --failover-admins "$(IFS=,; echo "${admins[*]}")"
  for r in $REPLICAS; do kill "$r" 2>/dev/null; wait "$r" 2>/dev/null || true; done
  REPLICAS=
fi
if [ "$MODE" != sync ]; then
  echo; echo "== Rule stats: the same 1000 agents each report every rule they were sent, once a second"
  sync_bench 1000 "$WORK/s1k" --stats-period 1s --stats-seconds "${STATS_SECONDS:-20}"
fi
[ "$MODE" = all ] || exit 0

echo; echo "== Churn: 100 agents on the 10k cluster, label flips and policy edits at increasing rates"
CPORT=$((PORT + 2))
wait_admin() { # admin port
  for _ in $(seq 100); do
    "$BIN" status --server "127.0.0.1:$1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
}
churn() { # datastore, then calc-bench churn flags
  local store=$1; shift
  "$BENCH" churn --datastore "$store" --server "http://127.0.0.1:$CPORT" --admin "127.0.0.1:$((CPORT + 1))" \
    --nodes 100 --seconds "${CHURN_SECONDS:-20}" ${CHURN_RATES:+--rates "$CHURN_RATES"} --server-pid "$SERVER" "$@"
}
"$BIN" serve --file-dir "$WORK/c10k" --listen "127.0.0.1:$CPORT" --admin-listen "127.0.0.1:$((CPORT + 1))" \
  --file-watch "${CHURN_FILE_WATCH:-inotify}" --file-poll-interval 10ms --max-pending-per-address 1024 \
  --log-level warn >"$WORK/churn-serve.log" 2>&1 &
SERVER=$!
wait_admin $((CPORT + 1))
churn file --file-dir "$WORK/c10k"
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true
SERVER=

echo
ETCD_BIN=$(command -v etcd || true)
[ -z "$ETCD_BIN" ] && [ -x /usr/bin/etcd ] && ETCD_BIN=/usr/bin/etcd
if [ -z "$ETCD_BIN" ]; then
  echo "churn etcd: skipped: etcd is not installed (make deps installs it)"
else
  # etcd's data in memory when possible: the bench times the server, not this machine's fsync.
  EDIR=$(mktemp -d "$( [ -d /dev/shm ] && echo /dev/shm || echo "${TMPDIR:-/tmp}")/churn-etcd.XXXXXX")
  EPORT=$((PORT + 4))
  "$ETCD_BIN" --name churn --data-dir "$EDIR" \
    --listen-client-urls "http://127.0.0.1:$EPORT" --advertise-client-urls "http://127.0.0.1:$EPORT" \
    --listen-peer-urls "http://127.0.0.1:$((EPORT + 1))" --initial-advertise-peer-urls "http://127.0.0.1:$((EPORT + 1))" \
    --initial-cluster "churn=http://127.0.0.1:$((EPORT + 1))" --log-level error >"$WORK/churn-etcd.log" 2>&1 &
  ETCD=$!
  trap '[ -n "$SERVER" ] && kill $SERVER 2>/dev/null; kill $ETCD 2>/dev/null; rm -rf "$EDIR"' EXIT
  ok=
  for _ in $(seq 100); do
    ./target/release/etcd-bench --endpoints "http://127.0.0.1:$EPORT" load --dir "$WORK/c10k" >"$WORK/churn-etcd-load.out" 2>&1 && { ok=1; break; }
    sleep 0.2
  done
  if [ -z "$ok" ]; then
    echo "churn etcd: skipped: etcd did not start or the cluster could not be loaded (see $WORK/churn-etcd.log)"
  else
    "$BIN" serve --datastore-type etcdv3 --etcd-endpoints "http://127.0.0.1:$EPORT" --listen "127.0.0.1:$CPORT" \
      --admin-listen "127.0.0.1:$((CPORT + 1))" --max-pending-per-address 1024 --log-level warn >"$WORK/churn-serve-etcd.log" 2>&1 &
    SERVER=$!
    wait_admin $((CPORT + 1))
    churn etcd --etcd-endpoint "http://127.0.0.1:$EPORT"
    kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true
    SERVER=
  fi
  kill $ETCD 2>/dev/null; wait $ETCD 2>/dev/null || true
  rm -rf "$EDIR"
fi

echo; echo "== etcd v3 cold start: calc-server's snapshot read of the 100k cluster against a bare paginated list"
if command -v etcd >/dev/null; then
  cargo build --release -p bench-tools --bin etcd-bench >/dev/null 2>&1
  EPORT=$((PORT + 10))
  etcd --name bench --data-dir "$WORK/etcd" --listen-client-urls "http://127.0.0.1:$EPORT" \
    --advertise-client-urls "http://127.0.0.1:$EPORT" --listen-peer-urls "http://127.0.0.1:$((EPORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((EPORT + 1))" \
    --initial-cluster "bench=http://127.0.0.1:$((EPORT + 1))" --quota-backend-bytes 8589934592 \
    >"$WORK/etcd.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 100); do
    ./target/release/etcd-bench --endpoints "http://127.0.0.1:$EPORT" list --runs 1 >/dev/null 2>&1 && break
    sleep 0.1
  done
  ./target/release/etcd-bench --endpoints "http://127.0.0.1:$EPORT" load --dir "$WORK/c100k" | tail -1
  ./target/release/etcd-bench --endpoints "http://127.0.0.1:$EPORT" cold-start --runs "${ETCD_RUNS:-5}"
  kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true
  SERVER=
else
  echo "etcd cold start: skipped: etcd is not installed (make deps installs it)"
fi

echo; echo "== Linux driver vs bare ipset/iptables-restore (nft backend, fresh network namespaces)"
if [ "$(id -u)" = 0 ]; then
  cargo build --release -p bench-tools --bin linux-bench >/dev/null 2>&1
  ./target/release/linux-bench --runs 5
  echo; echo "== nftables driver vs bare nft -f (1k, 10k and 100k rules, fresh network namespaces)"
  ./target/release/linux-bench --driver nftables --runs 3
else
  echo "skipped: needs root (network namespaces, iptables, ipset)"
fi

echo; echo "== Label flip to kernel: datastore write until the agent's kernel IP set has it (fresh network namespace)"
if [ "$(id -u)" = 0 ]; then
  cargo build --release -p bench-tools -p calc-server -p dataplane-agent >/dev/null 2>&1
  if command -v etcd >/dev/null; then
    "$BENCH" flip-kernel --datastore-type etcdv3 --flips 200
  else
    echo "etcdv3: skipped: etcd is not installed (make deps installs it)"
  fi
  echo
  "$BENCH" flip-kernel --datastore-type file --file-poll-interval 10ms --flips 200
else
  echo "skipped: needs root (network namespaces, iptables, ipset)"
fi
