#!/usr/bin/env bash
# `make demo-containers`: the compose cluster (docker/compose.yaml) with real packets. Starts
# etcd, calc-server and three agent nodes with their workloads, wires and loads them
# (scripts/containers.sh), shows which connections between workloads on different nodes the
# policies allow, edits a policy in etcd and shows the change, prints `calc-server status`,
# then stops everything (`down -v`), also on Ctrl-C or an error.
# As root, with the images built (`make images`). Environment:
#   DEMO_KEEP=1          leave the cluster running (scripts/containers.sh down stops it)
#   COMPOSE_PROJECT_NAME compose project (default split-felix)
#   SPLIT_FELIX_NET      the bridge network's /24 prefix (default 172.31.250)
set -euo pipefail
cd "$(dirname "$0")/.."
C=./scripts/containers.sh
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-split-felix}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

[ "$(id -u)" = 0 ] || { echo "demo-containers: needs root (nsenter, ip link set … netns)" >&2; exit 1; }
for image in split-felix/calc-server:dev split-felix/dataplane-agent:dev \
  split-felix/etcd:bookworm split-felix/workload:bookworm; do
  docker image inspect "$image" >/dev/null 2>&1 || {
    echo "demo-containers: $image is missing: make images" >&2; exit 1; }
done

stopped=
stop() {
  local rc=${1:-$?}
  trap - INT TERM EXIT
  [ -n "$stopped" ] && exit "$rc"
  stopped=1
  if [ "${DEMO_KEEP:-}" = 1 ] && [ "$rc" = 0 ]; then
    say "Left running (DEMO_KEEP=1): $C status | probe FROM TO | down"
    exit 0
  fi
  [ "$rc" = 0 ] || echo "demo-containers: stopping after an error or interrupt (exit $rc)" >&2
  say "Stop: docker-compose down -v"
  $C down || true
  exit "$rc"
}
trap 'stop 130' INT TERM
trap stop EXIT

say "1. Start etcd, load the cluster in Calico's etcd layout, start calc-server and the nodes, wire the workloads"
$C up

probe() {
  local from=$1 to=$2 want=$3 got
  if $C probe "$from" "$to" 2>/dev/null; then got=allowed; else got=denied; fi
  printf '  %-7s -> %-7s :8080  %-8s (expected %s)\n' "$from" "$to" "$got" "$want"
  [ "$got" = "$want" ]
}
verdicts() {
  local ok=0
  probe web-1 web-2 allowed || ok=1     # prod -> prod (node-2 decides)
  probe web-3 web-1 allowed || ok=1     # prod -> prod (node-1)
  probe tool-1 tool-3 allowed || ok=1   # dev -> dev (node-3)
  probe tool-1 web-2 "$1" || ok=1       # dev -> prod (node-2)
  probe tool-3 web-1 "$1" || ok=1       # dev -> prod (node-1)
  probe web-2 tool-3 denied || ok=1     # prod -> dev (node-3)
  return $ok
}

say "2. Connections between workloads on different nodes (prod-from-prod, dev/dev-from-dev)"
verdicts denied

say "3. Edit prod-from-prod in etcd (etcdctl put): dev may reach prod's 8080 too"
$C open-prod
for _ in $(seq 30); do
  $C probe tool-1 web-2 2>/dev/null && $C probe tool-3 web-1 2>/dev/null && break
  sleep 0.5
done
verdicts allowed

say "4. calc-server status (run in its container)"
$C status
$C status --policies
