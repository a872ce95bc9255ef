#!/usr/bin/env bash
# The demo on the embedded default datastore (the YAML directory examples/cluster):
# calc-server serves it, one dry-run agent per example node follows its stream, and edits to
# the manifests reach the agents live. Ctrl-C stops everything cleanly.
# Environment:
#   DEMO_GRPC=HOST:PORT   calc-server's gRPC address (default 127.0.0.1:50051)
#   DEMO_ADMIN=HOST:PORT  its admin address (default 127.0.0.1:9096)
#   DEMO_SECONDS=N        stop after N seconds instead of waiting for Ctrl-C (for scripts)
#   BIN=DIR               where the binaries are (default ./target/debug)
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-./target/debug}
DIR=examples/cluster
GRPC=${DEMO_GRPC:-127.0.0.1:50051}
ADMIN=${DEMO_ADMIN:-127.0.0.1:9096}
WORK=$(mktemp -d)
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

pids=()
cleanup() {
  local rc=${1:-$?}
  trap - INT TERM EXIT
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK"
  [ "$rc" = 0 ] && printf '\nstopped (agents keep their dataplane; nothing was programmed: dry-run)\n'
  exit "$rc"
}
trap 'cleanup 0' INT TERM
trap cleanup EXIT

say "1. Validate the example cluster (Calico v3 YAML: 2 nodes, 3 namespaces, 3 tiers)"
"$BIN/calc-server" validate "$DIR" || exit 1

# Something already on our ports (an earlier demo, a real server) would answer in our place.
for addr in "$GRPC" "$ADMIN"; do
  if (exec 3<>"/dev/tcp/${addr%:*}/${addr##*:}") 2>/dev/null; then
    echo "demo: $addr is already in use (another calc-server or demo?); stop it, or choose" >&2
    echo "      other addresses with DEMO_GRPC=HOST:PORT and DEMO_ADMIN=HOST:PORT" >&2
    exit 1
  fi
done

say "2. Start calc-server on $DIR (gRPC $GRPC, admin http://$ADMIN)"
"$BIN/calc-server" serve --file-dir "$DIR" --listen "$GRPC" --admin-listen "$ADMIN" \
  --status-dir "$WORK/status" --file-poll-interval 300ms >"$WORK/server.log" 2>&1 &
server=$!
pids+=($server)
for _ in $(seq 100); do
  "$BIN/calc-server" status --server "$ADMIN" >/dev/null 2>&1 && break
  if ! kill -0 "$server" 2>/dev/null; then
    echo "demo: calc-server exited:" >&2
    cat "$WORK/server.log" >&2
    exit 1
  fi
  sleep 0.1
done

say "3. Start one dry-run agent per node"
for node in node-1 node-2; do
  "$BIN/dataplane-agent" --server "$GRPC" --node "$node" --driver dry-run \
    --state-file "$WORK/$node.json" >"$WORK/$node.log" 2>&1 &
  pids+=($!)
  echo "$node: state file $WORK/$node.json"
done
for _ in $(seq 100); do
  [ -s "$WORK/node-1.json" ] && [ -s "$WORK/node-2.json" ] && break
  sleep 0.1
done
sleep 0.5

say "4. What each node would program (from the dry-run driver)"
for node in node-1 node-2; do
  echo "-- $node"
  grep -h "would program" "$WORK/$node.log" | sed -E 's/\x1b\[[0-9;]*m//g; s/.*would program the dataplane/  would program:/'
  grep -o '"k8s/[^"]*": {' "$WORK/$node.json" | sed 's/: {//; s/^/  endpoint /'
done

say "5. calc-server status"
"$BIN/calc-server" status --server "$ADMIN"

say "6. Why is Prometheus's scrape of the shop API denied? (calc-server explain, docs/explain.md)"
"$BIN/calc-server" explain --server "$ADMIN" --from monitoring/prometheus-0 --to shop/api-1 --port 9090 |
  grep -E '^(ALLOW|DENY)|^(egress|ingress) of|Pass\) matched|end of tier \(default action Deny\)'

say "Now edit a manifest and watch the change arrive, e.g. in another terminal:"
echo "  sed -i 's/ports: \[80, 443\]/ports: [80, 8443]/' $DIR/policies.yaml"
echo "  (undo with: git checkout $DIR)"
echo "Agent logs follow; Ctrl-C stops the demo."
tail -n 0 -f "$WORK/node-1.log" "$WORK/node-2.log" | sed -u -E 's/\x1b\[[0-9;]*m//g' &
pids+=($!)
if [ -n "${DEMO_SECONDS:-}" ]; then
  sleep "$DEMO_SECONDS"
else
  wait
fi
