#!/usr/bin/env bash
# The compose cluster (docker/compose.yaml): start it, wire the workloads to their nodes as
# Calico's CNI plugin wires pods, write the datastore into etcd in Calico's layout, wait for the
# agents, probe connections, stop it. As root, on the Docker host (nsenter, ip).
#
#   scripts/containers.sh up          etcd, load, the rest (compose up -d), wire, wait
#   scripts/containers.sh wire        veth pairs, addresses and routes (idempotent)
#   scripts/containers.sh load        Tier, Nodes, namespace Profiles, WorkloadEndpoints and
#                                     the two policies into etcd (etcdctl put)
#   scripts/containers.sh open-prod   edit: prod-from-prod also lets dev in
#   scripts/containers.sh wait        until every agent is connected, in sync, programmed
#                                     and its endpoints are up
#   scripts/containers.sh probe FROM TO [PORT]   exit 0 if FROM connects to TO:PORT (8080)
#   scripts/containers.sh status      calc-server status (in the calc-server container)
#   scripts/containers.sh down        compose down -v
#
# Environment: COMPOSE_PROJECT_NAME (default split-felix), SPLIT_FELIX_NET (the bridge
# network's /24 prefix, default 172.31.250; see docker/compose.yaml), WAIT_SECONDS (90).
set -euo pipefail
cd "$(dirname "$0")/.."
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-split-felix}
export SPLIT_FELIX_NET=${SPLIT_FELIX_NET:-172.31.250}
COMPOSE=(docker-compose -f docker/compose.yaml)
P=/calico/resources/v3/projectcalico.org
NODES="node-1 node-2 node-3"

# The workloads: container (and pod) name, node, namespace, app label, address. Node N's
# workload block is 10.65.N.0/24.
WORKLOADS="
web-1  node-1 prod web  10.65.1.10
tool-1 node-1 dev  tool 10.65.1.20
web-2  node-2 prod web  10.65.2.10
web-3  node-3 prod web  10.65.3.10
tool-3 node-3 dev  tool 10.65.3.20
"

log() { echo "containers: $*" >&2; }

# The container of a compose service (compose names it <project>_<service>_1).
cid() {
  local project
  project=$(echo "$COMPOSE_PROJECT_NAME" | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9_-')
  local id
  id=$(docker ps -q --filter "label=com.docker.compose.project=$project" \
    --filter "label=com.docker.compose.service=$1")
  [ -n "$id" ] || { log "no running container for service $1 (project $project)"; return 1; }
  echo "$id"
}
pid_of() { docker inspect -f '{{.State.Pid}}' "$(cid "$1")"; }
node_index() { echo "${1#node-}"; }
node_ip() { echo "$SPLIT_FELIX_NET.1$(node_index "$1")"; }
# Calico's CNI plugin names a pod's host-side veth cali + the first 11 hex digits of
# sha1("<namespace>.<pod>").
iface_of() { echo "cali$(printf '%s.%s' "$1" "$2" | sha1sum | cut -c1-11)"; }
# The workload's eth0 MAC, from its address (0a:58 and the four bytes, as Kubernetes' bridge
# plugins do): the WorkloadEndpoint's `mac`, from which the agent makes a static neighbour.
mac_of() { printf '0a:58:%02x:%02x:%02x:%02x' ${1//./ }; }

wire() {
  local n m npid
  for n in $NODES; do
    npid=$(pid_of "$n")
    for m in $NODES; do
      [ "$m" = "$n" ] && continue
      nsenter -t "$npid" -n ip route replace "10.65.$(node_index "$m").0/24" via "$(node_ip "$m")"
    done
  done
  local name node ns app ip iface wpid tmp k=0
  while read -r name node ns app ip; do
    [ -n "$name" ] || continue
    npid=$(pid_of "$node")
    wpid=$(pid_of "$name")
    iface=$(iface_of "$ns" "$name")
    if nsenter -t "$npid" -n ip link show "$iface" >/dev/null 2>&1; then
      continue
    fi
    # Made in the host's namespace under temporary names, then each end moved into its
    # namespace.
    k=$((k + 1))
    tmp=sf$(printf %05d $(($$ % 100000)))$k
    ip link add "${tmp}h" type veth peer name "${tmp}w"
    ip link set "${tmp}h" netns "$npid"
    ip link set "${tmp}w" netns "$wpid"
    nsenter -t "$wpid" -n ip link set "${tmp}w" name eth0
    nsenter -t "$wpid" -n ip link set eth0 address "$(mac_of "$ip")"
    nsenter -t "$wpid" -n ip addr add "$ip/32" dev eth0
    nsenter -t "$wpid" -n ip link set eth0 up
    nsenter -t "$wpid" -n ip route add 169.254.1.1 dev eth0 scope link
    nsenter -t "$wpid" -n ip route add default via 169.254.1.1 dev eth0
    # The node's side: the settings Calico gives a workload interface (proxy ARP answers for
    # 169.254.1.1 at once, reverse-path filtering), Calico's fixed MAC, then its `cali…` name.
    # The agent checks these settings the moment a `cali…` interface appears, and here it
    # cannot write /proc/sys (docker/compose.yaml): they are set before the name is.
    nsenter -t "$npid" -n sh -c "cd /proc/sys/net/ipv4 && echo 1 >conf/${tmp}h/forwarding && echo 1 >conf/${tmp}h/rp_filter && echo 0 >conf/${tmp}h/route_localnet && echo 1 >conf/${tmp}h/proxy_arp && echo 0 >neigh/${tmp}h/proxy_delay"
    nsenter -t "$npid" -n ip link set "${tmp}h" address ee:ee:ee:ee:ee:ee name "$iface"
    nsenter -t "$npid" -n ip link set "$iface" up
    nsenter -t "$npid" -n ip route replace "$ip/32" dev "$iface"
    log "wired $name ($ns, $ip) to $node as $iface"
  done <<<"$WORKLOADS"
}

put() { docker exec "$ETCD" etcdctl put "$1" "$2" >/dev/null; }

# A policy's metadata as calicoctl writes it in etcd.
policy_meta() {
  local name=$1 ns=${2:-}
  printf '"name":"%s",%s"labels":{"projectcalico.org/tier":"default"},"annotations":{"projectcalico.org/metadata":"{\\"name\\":\\"%s\\"}"}' \
    "$name" "${ns:+\"namespace\":\"$ns\",}" "$name"
}

# Ingress to prod's workloads on 8080 from the namespaces the selector picks.
prod_from() {
  put "$P/globalnetworkpolicies/prod-from-prod" \
    "{\"kind\":\"GlobalNetworkPolicy\",\"apiVersion\":\"projectcalico.org/v3\",\"metadata\":{$(policy_meta prod-from-prod)},\"spec\":{\"order\":100,\"selector\":\"projectcalico.org/namespace == 'prod'\",\"types\":[\"Ingress\"],\"ingress\":[{\"action\":\"Allow\",\"protocol\":\"TCP\",\"source\":{\"namespaceSelector\":\"$1\"},\"destination\":{\"ports\":[8080]}}]}}"
}

load() {
  ETCD=$(cid etcd)
  put "$P/tiers/default" \
    '{"kind":"Tier","apiVersion":"projectcalico.org/v3","metadata":{"name":"default"},"spec":{"order":1000000,"defaultAction":"Deny"}}'
  local n
  for n in $NODES; do
    put "$P/nodes/$n" \
      "{\"kind\":\"Node\",\"apiVersion\":\"projectcalico.org/v3\",\"metadata\":{\"name\":\"$n\",\"labels\":{\"kubernetes.io/hostname\":\"$n\"}},\"spec\":{\"bgp\":{\"ipv4Address\":\"$(node_ip "$n")/24\"}}}"
  done
  local ns
  for ns in prod dev; do
    put "$P/profiles/kns.$ns" \
      "{\"kind\":\"Profile\",\"apiVersion\":\"projectcalico.org/v3\",\"metadata\":{\"name\":\"kns.$ns\"},\"spec\":{\"ingress\":[{\"action\":\"Allow\"}],\"egress\":[{\"action\":\"Allow\"}],\"labelsToApply\":{\"pcns.projectcalico.org/name\":\"$ns\",\"pcns.env\":\"$ns\"}}}"
  done
  local name node app ip wep
  while read -r name node ns app ip; do
    [ -n "$name" ] || continue
    # <node>-k8s-<pod>-<endpoint>, each '-' inside a segment doubled.
    wep="${node//-/--}-k8s-${name//-/--}-eth0"
    put "$P/workloadendpoints/$ns/$wep" \
      "{\"kind\":\"WorkloadEndpoint\",\"apiVersion\":\"projectcalico.org/v3\",\"metadata\":{\"name\":\"$wep\",\"namespace\":\"$ns\",\"labels\":{\"app\":\"$app\",\"projectcalico.org/namespace\":\"$ns\",\"projectcalico.org/orchestrator\":\"k8s\"}},\"spec\":{\"orchestrator\":\"k8s\",\"node\":\"$node\",\"pod\":\"$name\",\"endpoint\":\"eth0\",\"serviceAccountName\":\"default\",\"ipNetworks\":[\"$ip/32\"],\"profiles\":[\"kns.$ns\"],\"interfaceName\":\"$(iface_of "$ns" "$name")\",\"mac\":\"$(mac_of "$ip")\"}}"
  done <<<"$WORKLOADS"
  # prod: 8080 from prod only. dev: 8080 from dev only (a namespaced policy's selectors stay
  # in its namespace).
  prod_from "env == 'prod'"
  put "$P/networkpolicies/dev/dev-from-dev" \
    "{\"kind\":\"NetworkPolicy\",\"apiVersion\":\"projectcalico.org/v3\",\"metadata\":{$(policy_meta dev-from-dev dev)},\"spec\":{\"order\":100,\"selector\":\"all()\",\"types\":[\"Ingress\"],\"ingress\":[{\"action\":\"Allow\",\"protocol\":\"TCP\",\"source\":{\"selector\":\"all()\"},\"destination\":{\"ports\":[8080]}}]}}"
  log "loaded the datastore into etcd"
}

# calc-server status, from the binary in its container (the image has no shell).
status() { docker exec "$(cid calc-server)" calc-server status --server 127.0.0.1:9096 "$@"; }

# Every node connected, in sync, programmed, with its workloads' endpoints up.
ready() {
  local json
  json=$(status --json 2>/dev/null) || return 1
  python3 - "$json" "$WORKLOADS" <<'EOF'
import json, sys
nodes = {n["node"]: n for n in json.loads(sys.argv[1])}
want = {}
for line in sys.argv[2].split("\n"):
    if line.split():
        want[line.split()[1]] = want.get(line.split()[1], 0) + 1
for node, count in want.items():
    n = nodes.get(node)
    if not n or not n["connected"] or not n["dataplane_in_sync"] or n["programmed"] != "yes":
        sys.exit(1)
    up = [s for s in n["workload_endpoints"].values() if s == "up"]
    if len(up) != count:
        sys.exit(1)
EOF
}

wait_etcd() {
  local i
  for i in $(seq 100); do
    docker exec "$(cid etcd)" etcdctl endpoint health >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  log "etcd is not healthy"
  return 1
}

wait_ready() {
  local deadline=$((SECONDS + ${WAIT_SECONDS:-90}))
  until ready; do
    if [ $SECONDS -ge $deadline ]; then
      log "agents not in sync after ${WAIT_SECONDS:-90}s:"
      status >&2 || true
      return 1
    fi
    sleep 0.5
  done
  log "every agent is in sync and programmed, every endpoint up"
}

# Whether FROM's TCP connection to TO:PORT is accepted within a second.
probe() {
  local to_ip
  to_ip=$(awk -v w="$2" '$1 == w {print $5}' <<<"$WORKLOADS")
  docker exec "$(cid "$1")" nc -z -w 1 "${to_ip:-$2}" "${3:-8080}"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up)
    [ "$(id -u)" = 0 ] || { log "needs root (nsenter, ip link set … netns)"; exit 1; }
    # The datastore first, so that each agent finds its node when it starts.
    "${COMPOSE[@]}" up -d etcd
    wait_etcd
    load
    "${COMPOSE[@]}" up -d
    wire
    wait_ready
    ;;
  wire) wire ;;
  load) load ;;
  open-prod) ETCD=$(cid etcd); prod_from "env in {'prod', 'dev'}" ;;
  wait) wait_ready ;;
  probe) probe "$@" ;;
  status) status "$@" ;;
  down) "${COMPOSE[@]}" down -v --remove-orphans ;;
  *)
    sed -n '2,18p' "$0" >&2
    exit 2
    ;;
esac
