#!/usr/bin/env bash
# The demo on the embedded default datastore (the YAML directory examples/cluster).
# Today it runs the calculation offline (compute) and the tools; `serve` and the agents join it
# with the Sync stream.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-./target/debug/calc-server}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }

say "1. Validate the example cluster (Calico v3 YAML, 2 nodes, 3 namespaces, 3 tiers)"
run "$BIN" validate examples/cluster || exit 1

say "2. The same tool on a file of common mistakes: every problem, with object and field"
run "$BIN" validate examples/broken
echo "(exit code $? : 1 means invalid objects were found)"

say "3. Selectors: canonical form and the IP-set id Calico would use"
run "$BIN" selector normalize "app=='web'&&has(version)"
run "$BIN" selector normalize " all() "

say "4. Selectors: evaluate against an endpoint's labels (its own, then its profiles')"
labels='{"app":"api","version":"v2","projectcalico.org/namespace":"shop","pcns.team":"storefront","pcsa.role":"backend"}'
run "$BIN" selector eval --labels "$labels" "app == 'api' && pcns.team == 'storefront'"
run "$BIN" selector eval --labels "$labels" "app in {'web', 'postgres'}"
run "$BIN" selector eval --labels "$labels" "has(pcsa.role) && version starts with 'v'"

say "5. The calculation: what each node would be sent (snapshot through InSync)"
for node in node-1 node-2; do
  printf '$ %s compute --file-dir examples/cluster --node %s | <count by message type>\n' "$BIN" "$node"
  "$BIN" compute --file-dir examples/cluster --node "$node" \
    | sed -E 's/^\{"sequenceNumber":"[0-9]+","([a-zA-Z]+)".*/\1/' | sort | uniq -c | sort -rn
done

say "6. One endpoint's stream entry, as proto3 JSON (node-2's postgres pod)"
run sh -c "$BIN compute --file-dir examples/cluster --node node-2 | grep -m1 'postgres-0'"

say "Try your own: edit examples/cluster/policies.yaml and re-run"
echo "  $BIN compute --file-dir examples/cluster --node node-1"
echo "  $BIN selector eval --labels '{\"a\":\"b\"}' \"a == 'b'\""
