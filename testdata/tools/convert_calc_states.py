#!/usr/bin/env python3
"""Convert the upstream Felix calc-graph test states to Calico v3 API objects.

Input:  testdata/calc_states.json     (libcalico-go v1 *model* KVs, the form the
                                       calc graph consumes after the syncer's
                                       update processors)
Output: testdata/calc_states_v3.json  (the same states as `projectcalico.org/v3`
                                       objects, as calicoctl would write them)

The conversion inverts libcalico-go's update processors
(libcalico-go/lib/backend/syncersv1/updateprocessors/*.go) for the subset of the
model that the fixtures use.  Anything the script does not know how to invert
raises an error instead of being dropped silently, so a new upstream fixture
cannot be converted wrongly without anybody noticing.

Usage (from the repository root or anywhere else):
    python3 testdata/tools/convert_calc_states.py [--check]

With --check the script converts in memory and exits 1 if the file on disk
differs from what it would write.  Python 3 standard library only; the output
is deterministic (no timestamps, no set/dict iteration order dependence beyond
the input's own order).
"""

import argparse
import copy
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.dirname(HERE)
IN_PATH = os.path.join(TESTDATA, "calc_states.json")
OUT_PATH = os.path.join(TESTDATA, "calc_states_v3.json")

API_VERSION = "projectcalico.org/v3"

# v3 WorkloadEndpoints are namespaced but the model key has no namespace (the
# real processor derives WorkloadID = "<namespace>/<workload>").  All fixture
# WEPs are put in this namespace.
WEP_NAMESPACE = "default"

# api/pkg/apis/projectcalico/v3 constants; libcalico-go/lib/validator/v3
# (validateTier) insists on these exact orders for the well-known tiers.
FIXED_TIER_ORDERS = {
    "default": 1000000.0,
    "adminnetworkpolicy": 1000.0,
    "baselineadminnetworkpolicy": 10000000.0,
}

# ---------------------------------------------------------------------------
# Name validation (libcalico-go/lib/validator/v3/validator.go)
# ---------------------------------------------------------------------------
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
LABEL_RE = re.compile("^" + _LABEL + "$")
SUBDOMAIN_RE = re.compile("^" + _LABEL + r"(\." + _LABEL + ")*$")
GNP_NAME_RE = re.compile("^(" + _LABEL + r"\.)?" + _LABEL + "$")


def valid_name(kind, name):
    """True if `name` is a valid metadata.name for `kind`."""
    if not name or len(name) > 253:
        return False
    if kind == "Tier":
        return len(name) <= 63 and bool(LABEL_RE.match(name))
    if kind == "GlobalNetworkPolicy":
        return bool(GNP_NAME_RE.match(name))
    return bool(SUBDOMAIN_RE.match(name))


def sanitise(kind, name):
    """Map an invalid upstream name to a valid v3 one (lower case, invalid
    characters -> '-', trimmed; dots are dropped where the kind forbids them)."""
    out = name.lower()
    allowed = "a-z0-9-" if kind == "Tier" else "a-z0-9.-"
    out = re.sub("[^" + allowed + "]", "-", out)
    if kind == "GlobalNetworkPolicy" and out.count(".") > 1:
        first, rest = out.split(".", 1)
        out = first + "." + rest.replace(".", "-")
    out = re.sub(r"-*\.-*", ".", out).strip("-.")
    if kind == "Tier":
        out = out[:63].strip("-")
    if not valid_name(kind, out):
        raise ValueError("cannot derive a valid %s name from %r" % (kind, name))
    return out


class Renames:
    """Tracks upstream-name -> v3-name renames per namespace of names, so
    that every reference (in resources and expectations) is rewritten the same
    way, and the list can be reported in the output description."""

    def __init__(self):
        self.maps = {}  # category -> {old: new}

    def name(self, category, kind, old):
        if valid_name(kind, old):
            return old
        m = self.maps.setdefault(category, {})
        if old not in m:
            new = sanitise(kind, old)
            if new in m.values():
                raise ValueError("rename collision: %r -> %r" % (old, new))
            m[old] = new
        return m[old]

    def lookup(self, category, old):
        return self.maps.get(category, {}).get(old, old)

    def describe(self):
        out = []
        for cat in sorted(self.maps):
            for old, new in sorted(self.maps[cat].items()):
                out.append("%s %r -> %r" % (cat, old, new))
        return out


# ---------------------------------------------------------------------------
# Small value conversions
# ---------------------------------------------------------------------------
# numorstring.Protocol: the model holds the lower-cased form (Protocol.ToV1()).
V3_PROTOCOLS = {
    "tcp": "TCP",
    "udp": "UDP",
    "icmp": "ICMP",
    "icmpv6": "ICMPv6",
    "sctp": "SCTP",
    "udplite": "UDPLite",
}

# updateprocessors/rules.go ruleActionAPIV2ToBackend: Pass -> "next-tier",
# everything else lower-cased.  An empty model action means Allow (Felix
# renders "" as allow, model.Rule.String() prints it as "Allow").
V3_ACTIONS = {
    "": "Allow",
    "allow": "Allow",
    "deny": "Deny",
    "log": "Log",
    "next-tier": "Pass",
    "pass": "Pass",
}


def v3_protocol(p):
    if isinstance(p, int):
        return p
    if isinstance(p, str) and p.isdigit():
        return int(p)
    try:
        return V3_PROTOCOLS[str(p).lower()]
    except KeyError:
        raise ValueError("unknown protocol %r" % (p,))


def v3_action(a):
    try:
        return V3_ACTIONS[(a or "").lower()]
    except KeyError:
        raise ValueError("unknown rule action %r" % (a,))


def v3_types(model_types):
    out = []
    for t in model_types:
        if t.lower() not in ("ingress", "egress"):
            raise ValueError("unknown policy type %r" % (t,))
        out.append(t[:1].upper() + t[1:].lower())
    return out


def v3_ports(ports):
    """Model numorstring.Port values (ints, "a:b" ranges, names) are already
    in the v3 JSON form; copy them, normalising "n" strings to ints."""
    out = []
    for p in ports:
        if isinstance(p, str) and p.isdigit():
            p = int(p)
        out.append(p)
    return out


def v3_endpoint_ports(ports):
    """[{name, protocol, port}] with the protocol upper-cased."""
    out = []
    for p in ports:
        unknown = set(p) - {"name", "protocol", "port"}
        if unknown:
            raise ValueError("endpoint port has unsupported fields %s" % sorted(unknown))
        q = {"name": p["name"], "protocol": v3_protocol(p["protocol"]), "port": p["port"]}
        out.append(q)
    return out


# ---------------------------------------------------------------------------
# Rules (inverse of updateprocessors/rules.go RuleAPIV2ToBackend for a global
# policy or a profile, i.e. no namespace scoping of selectors)
# ---------------------------------------------------------------------------
# model field -> (v3 EntityRule side, v3 field, kind of value)
ENTITY_FIELDS = {
    "src_selector": ("source", "selector", "str"),
    "!src_selector": ("source", "notSelector", "str"),
    "src_ports": ("source", "ports", "ports"),
    "!src_ports": ("source", "notPorts", "ports"),
    "src_nets": ("source", "nets", "list"),
    "src_net": ("source", "nets", "single"),
    "!src_nets": ("source", "notNets", "list"),
    "!src_net": ("source", "notNets", "single"),
    "dst_selector": ("destination", "selector", "str"),
    "!dst_selector": ("destination", "notSelector", "str"),
    "dst_ports": ("destination", "ports", "ports"),
    "!dst_ports": ("destination", "notPorts", "ports"),
    "dst_nets": ("destination", "nets", "list"),
    "dst_net": ("destination", "nets", "single"),
    "!dst_nets": ("destination", "notNets", "list"),
    "!dst_net": ("destination", "notNets", "single"),
}

# The model also carries the untouched v3 selectors (orig_*); for a global
# policy they equal the fields above, so they carry no extra information.
IGNORED_RULE_FIELDS = {
    "orig_src_selector", "orig_dst_selector",
    "!orig_src_selector", "!orig_dst_selector",
    "orig_src_namespace_selector", "orig_dst_namespace_selector",
    "orig_src_service_acct_names", "orig_src_service_acct_selector",
    "orig_dst_service_acct_names", "orig_dst_service_acct_selector",
}


def v3_rule(mr):
    """Convert one model rule to a v3 Rule (Go struct field order)."""
    handled = set()
    rule = {"action": v3_action(mr.get("action"))}
    handled.add("action")
    if "ip_version" in mr:
        rule["ipVersion"] = mr["ip_version"]
        handled.add("ip_version")
    if "protocol" in mr:
        rule["protocol"] = v3_protocol(mr["protocol"])
        handled.add("protocol")
    icmp = {}
    if "icmp_type" in mr:
        icmp["type"] = mr["icmp_type"]
    if "icmp_code" in mr:
        icmp["code"] = mr["icmp_code"]
    if icmp:
        rule["icmp"] = icmp
    handled |= {"icmp_type", "icmp_code"}
    if "!protocol" in mr:
        rule["notProtocol"] = v3_protocol(mr["!protocol"])
        handled.add("!protocol")
    not_icmp = {}
    if "!icmp_type" in mr:
        not_icmp["type"] = mr["!icmp_type"]
    if "!icmp_code" in mr:
        not_icmp["code"] = mr["!icmp_code"]
    if not_icmp:
        rule["notICMP"] = not_icmp
    handled |= {"!icmp_type", "!icmp_code"}

    sides = {"source": {}, "destination": {}}
    # Nets: model.Rule.AllSrcNets() = src_nets followed by src_net.
    for field in ("src_nets", "src_net", "!src_nets", "!src_net",
                  "dst_nets", "dst_net", "!dst_nets", "!dst_net"):
        if field in mr:
            side, key, shape = ENTITY_FIELDS[field]
            vals = [mr[field]] if shape == "single" else list(mr[field])
            sides[side].setdefault(key, []).extend(vals)
            handled.add(field)
    for field, (side, key, shape) in ENTITY_FIELDS.items():
        if field in mr and shape in ("str", "ports"):
            sides[side][key] = v3_ports(mr[field]) if shape == "ports" else mr[field]
            handled.add(field)
    for side, pre in (("source", "src"), ("destination", "dst")):
        if pre + "_service" in mr:
            svc = {"name": mr[pre + "_service"]}
            if mr.get(pre + "_service_ns"):
                svc["namespace"] = mr[pre + "_service_ns"]
            sides[side]["services"] = svc
        handled |= {pre + "_service", pre + "_service_ns"}
    # EntityRule JSON key order as in the Go struct.
    order = ["nets", "selector", "namespaceSelector", "services", "ports",
             "notNets", "notSelector", "notPorts", "serviceAccounts"]
    for side in ("source", "destination"):
        if sides[side]:
            rule[side] = {k: sides[side][k] for k in order if k in sides[side]}
    if "http" in mr:
        rule["http"] = copy.deepcopy(mr["http"])
        handled.add("http")
    if "metadata" in mr:
        rule["metadata"] = copy.deepcopy(mr["metadata"])
        handled.add("metadata")

    unknown = set(mr) - handled - IGNORED_RULE_FIELDS
    if unknown:
        # e.g. src_tag / dst_tag: tags were removed from the v3 API.
        raise ValueError("rule fields with no v3 equivalent: %s" % sorted(unknown))
    return rule


def v3_rules(model_rules):
    return [v3_rule(r) for r in (model_rules or [])]


# ---------------------------------------------------------------------------
# Resource converters.  Each returns a list of v3 objects (possibly empty when
# the model KV is merged into an object created earlier, e.g. Profile).
# ---------------------------------------------------------------------------
def obj(kind, metadata, spec):
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": spec}


# Model GlobalConfig names whose FelixConfiguration JSON field is not simply
# the name with a lower-case first letter (leading acronyms, renamed fields).
# Only InterfacePrefix occurs in the fixtures; add entries here as needed.
FELIX_FIELD_OVERRIDES = {
    "IPv6Support": "ipv6Support",
    "IPIPEnabled": "ipipEnabled",
    "IPIPMTU": "ipipMTU",
}


def felix_field(name):
    if name in FELIX_FIELD_OVERRIDES:
        return FELIX_FIELD_OVERRIDES[name]
    return name[:1].lower() + name[1:]


class StateConverter:
    def __init__(self, state, renames):
        self.state = state
        self.renames = renames
        self.objects = []
        self.by_ref = {}  # (kind, namespace, name) -> object, for merging
        self.notes = []

    def add(self, o):
        ref = (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
        if ref in self.by_ref:
            raise ValueError("duplicate v3 object %s" % (ref,))
        self.by_ref[ref] = o
        self.objects.append(o)
        return o

    def get_or_add(self, kind, name, make):
        ref = (kind, "", name)
        if ref not in self.by_ref:
            self.add(make())
        return self.by_ref[ref]

    # --- GlobalConfig -> FelixConfiguration "default" ---------------------
    def global_config(self, r):
        fc = self.get_or_add("FelixConfiguration", "default",
                             lambda: obj("FelixConfiguration", {"name": "default"}, {}))
        field = felix_field(r["name"])
        value = r["value"]
        # The model carries raw config strings; FelixConfiguration is typed.
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        elif isinstance(value, str) and re.fullmatch(r"-?\d+", value):
            value = int(value)
        fc["spec"][field] = value

    # --- ReadyFlag -> ClusterInformation "default" ------------------------
    def ready_flag(self, r):
        ci = self.get_or_add("ClusterInformation", "default",
                             lambda: obj("ClusterInformation", {"name": "default"}, {}))
        ci["spec"]["datastoreReady"] = bool(r["value"])

    # --- Tier ---------------------------------------------------------------
    def tier(self, r):
        name = self.renames.name("tier", "Tier", r["key"]["name"])
        v = r["value"]
        spec = {}
        order = v.get("order")
        if name in FIXED_TIER_ORDERS and order != FIXED_TIER_ORDERS[name]:
            self.notes.append(
                "Tier %r: upstream order %r replaced by %s, the only order v3 validation "
                "(validateTier) accepts for this tier; it does not change any tier ordering "
                "in this state (checked)." % (name, order, fmt_num(FIXED_TIER_ORDERS[name])))
            order = FIXED_TIER_ORDERS[name]
        if order is not None:
            spec["order"] = fmt_num(order)
        if v.get("defaultAction"):
            spec["defaultAction"] = v["defaultAction"]
        unknown = set(v) - {"order", "defaultAction"}
        if unknown:
            raise ValueError("tier fields with no v3 equivalent: %s" % sorted(unknown))
        self.add(obj("Tier", {"name": name}, spec))

    # --- Policy -> GlobalNetworkPolicy ------------------------------------
    def policy(self, r):
        k, v = r["key"], r["value"]
        if k.get("kind") != "GlobalNetworkPolicy" or k.get("namespace"):
            # A namespaced model policy has namespace-scoped selectors that
            # would have to be un-scoped; no fixture needs it.
            raise ValueError("unsupported policy key %r" % (k,))
        name = self.renames.name("policy", "GlobalNetworkPolicy", k["name"])
        tier = self.renames.name("tier", "Tier", v.get("tier") or "default")
        known = {"tier", "order", "selector", "inbound_rules", "outbound_rules",
                 "types", "untracked", "pre_dnat", "apply_on_forward",
                 "performance_hints", "namespace"}
        unknown = set(v) - known
        if unknown:
            raise ValueError("policy fields with no v3 equivalent: %s" % sorted(unknown))
        untracked = bool(v.get("untracked"))
        pre_dnat = bool(v.get("pre_dnat"))
        apply_on_forward = bool(v.get("apply_on_forward"))
        ingress = v3_rules(v.get("inbound_rules"))
        egress = v3_rules(v.get("outbound_rules"))
        if v.get("types"):
            types = v3_types(v["types"])
        else:
            # Model policies with no types are treated by Felix as ingress AND
            # egress (policy_sorter.go).  Write that explicitly so the result
            # does not depend on v3 defaulting, which infers from the rules.
            # Pre-DNAT policies are ingress-only (v3 rejects Egress on them
            # and Felix never puts them in egress lists).
            types = ["Ingress"] if pre_dnat else ["Ingress", "Egress"]
            self.notes.append(
                "GlobalNetworkPolicy %r: upstream has no types; written as %s "
                "(Felix's reading of an empty types list%s)."
                % (name, types, ", ingress only for pre-DNAT" if pre_dnat else ""))
        if (untracked or pre_dnat) and not apply_on_forward:
            apply_on_forward = True
            self.notes.append(
                "GlobalNetworkPolicy %r: applyOnForward set to true (v3 requires it with "
                "doNotTrack/preDNAT; Felix ignores it for such policies)." % name)
        spec = {"tier": tier}
        if v.get("order") is not None:
            spec["order"] = fmt_num(v["order"])
        if ingress:
            spec["ingress"] = ingress
        if egress:
            spec["egress"] = egress
        spec["selector"] = v.get("selector", "")
        spec["types"] = types
        if v.get("performance_hints"):
            spec["performanceHints"] = list(v["performance_hints"])
        if untracked:
            spec["doNotTrack"] = True
        if pre_dnat:
            spec["preDNAT"] = True
        if apply_on_forward:
            spec["applyOnForward"] = True
        self.add(obj("GlobalNetworkPolicy", {"name": name}, spec))

    # --- WorkloadEndpoint ---------------------------------------------------
    def workload_endpoint(self, r):
        k, v = r["key"], r["value"]
        known = {"state", "name", "mac", "profile_ids", "ipv4_nets", "ipv6_nets",
                 "labels", "ports", "ipv4_gateway", "ipv6_gateway", "ipv4_nat",
                 "ipv6_nat"}
        unknown = set(v) - known
        if unknown:
            raise ValueError("workload endpoint fields with no v3 equivalent: %s" % sorted(unknown))
        if v.get("state", "active") != "active":
            # v3 has no state field; the WEP processor always writes "active".
            raise ValueError("WEP %r has state %r, which v3 cannot express" % (k, v["state"]))
        name = wep_name(k)
        meta = {"name": name, "namespace": WEP_NAMESPACE}
        if v.get("labels"):
            meta["labels"] = dict(v["labels"])
        spec = {
            "orchestrator": k["orchestrator_id"],
            "workload": k["workload_id"],
            "node": k["hostname"],
            "endpoint": k["endpoint_id"],
            "ipNetworks": list(v.get("ipv4_nets") or []) + list(v.get("ipv6_nets") or []),
        }
        nats = list(v.get("ipv4_nat") or []) + list(v.get("ipv6_nat") or [])
        if nats:
            spec["ipNATs"] = [{"internalIP": n["int_ip"], "externalIP": n["ext_ip"]} for n in nats]
        if v.get("ipv4_gateway"):
            spec["ipv4Gateway"] = v["ipv4_gateway"]
        if v.get("ipv6_gateway"):
            spec["ipv6Gateway"] = v["ipv6_gateway"]
        if v.get("profile_ids"):
            spec["profiles"] = [self.renames.name("profile", "Profile", p) for p in v["profile_ids"]]
        if v.get("name"):
            spec["interfaceName"] = v["name"]
        if v.get("mac"):
            spec["mac"] = v["mac"]
        if v.get("ports"):
            spec["ports"] = v3_endpoint_ports(v["ports"])
        self.add(obj("WorkloadEndpoint", meta, spec))

    # --- HostEndpoint -------------------------------------------------------
    def host_endpoint(self, r):
        k, v = r["key"], r["value"]
        known = {"name", "expected_ipv4_addrs", "expected_ipv6_addrs", "labels",
                 "profile_ids", "ports"}
        unknown = set(v) - known
        if unknown:
            raise ValueError("host endpoint fields with no v3 equivalent: %s" % sorted(unknown))
        name = self.renames.name("hostendpoint", "HostEndpoint", k["endpoint_id"])
        meta = {"name": name}
        if v.get("labels"):
            meta["labels"] = dict(v["labels"])
        spec = {"node": k["hostname"]}
        if v.get("name"):
            spec["interfaceName"] = v["name"]
        ips = list(v.get("expected_ipv4_addrs") or []) + list(v.get("expected_ipv6_addrs") or [])
        if ips:
            spec["expectedIPs"] = ips
        if v.get("profile_ids"):
            spec["profiles"] = [self.renames.name("profile", "Profile", p) for p in v["profile_ids"]]
        if v.get("ports"):
            spec["ports"] = v3_endpoint_ports(v["ports"])
        self.add(obj("HostEndpoint", meta, spec))

    # --- ProfileRules + ProfileLabels -> one Profile ----------------------
    def profile(self, r):
        name = self.renames.name("profile", "Profile", r["key"]["name"])
        p = self.get_or_add("Profile", name, lambda: obj("Profile", {"name": name}, {}))
        v = r["value"]
        if r["type"] == "ProfileRules":
            unknown = set(v) - {"inbound_rules", "outbound_rules"}
            if unknown:
                raise ValueError("profile rule fields with no v3 equivalent: %s" % sorted(unknown))
            if "ingress" in p["spec"] or "egress" in p["spec"]:
                raise ValueError("profile %r has two rule entries" % name)
            spec = {}
            if v.get("inbound_rules"):
                spec["ingress"] = v3_rules(v["inbound_rules"])
            if v.get("outbound_rules"):
                spec["egress"] = v3_rules(v["outbound_rules"])
            spec.update(p["spec"])  # keep Go field order: ingress, egress, labelsToApply
            p["spec"] = spec
        else:  # ProfileLabels
            labels = v.get("labels", v.get("labelsToApply")) or {}
            if labels:
                p["spec"]["labelsToApply"] = dict(labels)

    # --- NetworkSet -> GlobalNetworkSet / NetworkSet ------------------------
    def network_set(self, r):
        k, v = r["key"], r["value"]
        unknown = set(v) - {"nets", "labels", "profile_ids"}
        if unknown:
            raise ValueError("network set fields with no v3 equivalent: %s" % sorted(unknown))
        labels = dict(v.get("labels") or {})
        if "/" in k["name"]:
            ns, name = k["name"].split("/", 1)
            # The processor adds these; v3 forbids the label and has no
            # profiles field (they are derived from the namespace).
            labels.pop("projectcalico.org/namespace", None)
            if set(v.get("profile_ids") or []) - {"kns." + ns}:
                raise ValueError("network set %r has profiles v3 cannot express" % k["name"])
            name = self.renames.name("networkset", "NetworkSet", name)
            meta = {"name": name, "namespace": ns}
            kind = "NetworkSet"
        else:
            if v.get("profile_ids"):
                raise ValueError("global network set %r has profiles" % k["name"])
            meta = {"name": self.renames.name("networkset", "GlobalNetworkSet", k["name"])}
            kind = "GlobalNetworkSet"
        if labels:
            meta["labels"] = labels
        self.add(obj(kind, meta, {"nets": list(v.get("nets") or [])}))

    def convert(self):
        handlers = {
            "GlobalConfig": self.global_config,
            "ReadyFlag": self.ready_flag,
            "Tier": self.tier,
            "Policy": self.policy,
            "WorkloadEndpoint": self.workload_endpoint,
            "HostEndpoint": self.host_endpoint,
            "ProfileRules": self.profile,
            "ProfileLabels": self.profile,
            "NetworkSet": self.network_set,
        }
        for r in self.state["resources"]:
            handler = handlers.get(r["type"])
            if handler is None:
                raise ValueError("unsupported resource type %r" % r["type"])
            handler(r)
        check_tier_order_unchanged(self.state, self.objects, self.renames)
        return self.objects


def fmt_num(x):
    """JSON numbers: keep integral floats as ints (20, 1000000)."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


def escape_dashes(segment):
    """libcalico-go/lib/names/workloadendpoint.go escapeDashes."""
    if not segment or segment[0] == "-" or segment[-1] == "-":
        raise ValueError("WEP name segment %r must not be empty or start/end with '-'" % segment)
    return segment.replace("-", "--")


def wep_name(key):
    """<node>-<orchestrator>-<workload>-<endpoint>, '-' in segments doubled
    (the generic-orchestrator form of CalculateWorkloadEndpointName)."""
    if key["orchestrator_id"] in ("k8s", "cni", "libnetwork"):
        raise ValueError("orchestrator %r uses a different WEP naming scheme" % key["orchestrator_id"])
    name = "-".join(escape_dashes(key[f]) for f in
                    ("hostname", "orchestrator_id", "workload_id", "endpoint_id"))
    if not valid_name("WorkloadEndpoint", name):
        raise ValueError("derived WEP name %r is not a valid v3 name" % name)
    return name


def tier_sort_key(name, order, valid):
    """policy_sorter.go TierLess: valid tiers first, then non-nil order,
    then order ascending, then name."""
    return (not valid, order is None, order if order is not None else 0, name)


def check_tier_order_unchanged(state, objects, renames):
    """Forcing a well-known tier's order must not reorder tiers."""
    before, after = [], []
    for r in state["resources"]:
        if r["type"] == "Tier":
            n = renames.lookup("tier", r["key"]["name"])
            before.append(tier_sort_key(n, r["value"].get("order"), True))
    for o in objects:
        if o["kind"] == "Tier":
            after.append(tier_sort_key(o["metadata"]["name"], o["spec"].get("order"), True))
    if [k[3] for k in sorted(before)] != [k[3] for k in sorted(after)]:
        raise ValueError("tier order changed by the conversion in state %r" % state["name"])


# ---------------------------------------------------------------------------
# Expectations
# ---------------------------------------------------------------------------
TIER_LIST_KEYS = ("endpoint_tiers", "endpoint_untracked_tiers", "endpoint_prednat_tiers",
                  "endpoint_forward_tiers")
POLICY_LIST_KEYS = ("active_policies", "untracked_policies", "prednat_policies")


def rename_policy_id(pid, renames):
    out = dict(pid)
    out["name"] = renames.lookup("policy", pid["name"])
    return out


def rename_endpoint_id(eid, hep_ids, renames):
    # WEP ids ("orch/wl/ep") come from spec fields, which keep the upstream
    # values; HEP ids are the HostEndpoint name.
    return renames.lookup("hostendpoint", eid) if eid in hep_ids else eid


def convert_expect(state, ipset_meta, renames):
    exp = state["expect"]
    ids = exp.get("ipset_ids", {})
    hep_ids = {r["key"]["endpoint_id"] for r in state["resources"] if r["type"] == "HostEndpoint"}
    out = {}
    for key, val in exp.items():
        if key == "ipsets":
            sets = {}
            for sel, members in val.items():
                if sel not in ids:
                    raise ValueError("state %r: ipset %r has no id" % (state["name"], sel))
                set_id = ids[sel]
                meta = ipset_meta.get(sel)
                if meta is not None and meta["id"] != set_id:
                    raise ValueError("ipset %r: state id %s != ipset_meta id %s"
                                     % (sel, set_id, meta["id"]))
                if set_id in sets:
                    raise ValueError("two ipsets share id %s" % set_id)
                sets[set_id] = list(members)
            out["ipsets"] = sets
        elif key in POLICY_LIST_KEYS:
            out[key] = [rename_policy_id(p, renames) for p in val]
        elif key == "active_profiles":
            out[key] = [renames.lookup("profile", p) for p in val]
        elif key in TIER_LIST_KEYS:
            out[key] = {
                rename_endpoint_id(eid, hep_ids, renames): [
                    {
                        "name": renames.lookup("tier", t["name"]),
                        "ingress_policies": [rename_policy_id(p, renames) for p in t["ingress_policies"]],
                        "egress_policies": [rename_policy_id(p, renames) for p in t["egress_policies"]],
                    }
                    for t in tiers
                ]
                for eid, tiers in val.items()
            }
        else:
            # ipset_ids and anything else: carried over unchanged.
            out[key] = copy.deepcopy(val)
    return out


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------
DESCRIPTION = (
    "Felix calculation-graph test states (felix/calc/states_for_test.go, via "
    "testdata/calc_states.json) re-expressed as Calico v3 API objects "
    "(apiVersion projectcalico.org/v3, as calicoctl would write them), so that a graph that "
    "consumes v3 objects can be checked against the upstream expectations. Each state lists "
    "its complete datastore as `resources` (in the input order; ProfileRules+ProfileLabels of "
    "one profile are merged into a single Profile at the position of the first) and the "
    "expected calc-graph output for node `localhostname` as `expect`.\n"
    "Mapping (inverse of libcalico-go/lib/backend/syncersv1/updateprocessors): "
    "GlobalConfig X -> FelixConfiguration 'default' spec.<x> (lowerCamel); ReadyFlag -> "
    "ClusterInformation 'default' spec.datastoreReady; Tier -> Tier (spec.defaultAction only if "
    "the input has one; v3 defaulting makes it Deny, upstream fixtures leave it \"\", and "
    "default_action is not asserted); Policy (all GlobalNetworkPolicy) -> GlobalNetworkPolicy "
    "with spec.tier, order, ingress (inbound_rules), egress (outbound_rules), selector, types "
    "(Ingress/Egress), doNotTrack (untracked), preDNAT (pre_dnat), applyOnForward; model rules -> "
    "v3 Rule (action ''/allow->Allow, deny->Deny, log->Log, next-tier->Pass; protocol tcp->TCP "
    "etc.; src_/dst_selector, !src_/!dst_selector, *_ports, !*_ports, *_net(s), !*_net(s), "
    "icmp_type/code, !icmp_*, ip_version -> source/destination selector, notSelector, ports, "
    "notPorts, nets, notNets, icmp, notICMP, ipVersion); selectors are copied verbatim (a "
    "GlobalNetworkPolicy without namespaceSelector is not re-scoped by the processor). "
    "WorkloadEndpoint key {hostname, orchestrator_id, workload_id, endpoint_id} -> WorkloadEndpoint "
    "in namespace '" + WEP_NAMESPACE + "' named <hostname>-<orch>-<workload>-<endpoint> ('-' "
    "doubled inside segments), spec.node/orchestrator/workload/endpoint from the key, "
    "interfaceName, mac, ipNetworks (v4 then v6), profiles, ports (protocol upper-cased); "
    "metadata.labels are exactly the model labels (no projectcalico.org/* labels are added: the "
    "graph adds projectcalico.org/namespace and projectcalico.org/orchestrator itself). "
    "HostEndpoint key {hostname, endpoint_id} -> HostEndpoint named endpoint_id with spec.node, "
    "interfaceName, expectedIPs (v4 then v6), profiles, ports. NetworkSet 'ns/name' -> "
    "NetworkSet, otherwise GlobalNetworkSet. Policies get no projectcalico.org/tier label "
    "(added by defaulting on write).\n"
    "Endpoint-id convention: expectations key WEPs by '<spec.orchestrator>/<spec.workload>/"
    "<spec.endpoint>' (e.g. 'orch/wl1/ep1') and HEPs by metadata.name. NOTE: real Calico derives "
    "the model key from the v3 *name* and namespace (names.ConvertWorkloadEndpointV3KeyToV1Key: "
    "WorkloadID = '<namespace>/<workload>', i.e. 'orch/" + WEP_NAMESPACE + "/wl1/ep1'); the "
    "graph under test must use the spec-field convention above for these fixtures.\n"
    "Expectations: `ipsets` is keyed by the calc-graph IP set ID (IPSetUpdate.id) taken from the "
    "state's ipset_ids; `ipset_ids` (selector string -> id) is kept for reference and the "
    "top-level `ipset_meta` is re-keyed by ID (with the original key as `selector`). Member "
    "lists, active_policies, active_profiles, endpoint_tiers and all other expectation keys "
    "are carried over unchanged (apart from renames). Upstream routes and the Istio IP set are "
    "omitted, as in the input.\n"
    "Not expressible in v3 / deviations: (1) WorkloadEndpoint model `state` has no v3 field (the "
    "WEP processor always writes 'active'); every input WEP is 'active', so no state relies on "
    "it. (2) The v3 validator requires Tier 'default' to have order 1000000; states that give it "
    "order 20 are written with 1000000 (see each state's conversion_notes; only one tier exists "
    "in those states, so no expectation changes). (3) A model profile can have labels without "
    "rules; in v3 every Profile yields a ProfileRules entry (empty rules if it has none), so it "
    "becomes 'known' with no rules instead of getting DummyDropRules (inbound/outbound deny); only "
    "a profile with no Profile object at all gets DummyDropRules (active_rules_calculator.go "
    "sendProfileUpdate). No input state has a labels-only profile (prof-1 has both rules and "
    "labels; prof-2, prof-3 and prof-missing have neither and are emitted as no object, so they "
    "keep the deny rules). (4) Policies without types are written with explicit types "
    "(Ingress+Egress, or Ingress for pre-DNAT) to preserve Felix's reading of an empty list; "
    "pre-DNAT/untracked policies get applyOnForward: true, which v3 requires and Felix ignores "
    "for them. (5) States without a Tier object keep none (the policies' tier is then unknown to "
    "the graph, as upstream); a real cluster always has Tier 'default'.\n"
)


def convert(doc):
    renames = Renames()
    ipset_meta = doc.get("ipset_meta", {})
    states = []
    for st in doc["states"]:
        conv = StateConverter(st, renames)
        resources = conv.convert()
        out = {
            "name": st["name"],
            "upstream_state": st.get("upstream_state", ""),
            "node": st.get("node", "localhostname"),
            "resources": resources,
            "expect": None,  # filled below, after all renames are known
        }
        if st.get("notes"):
            out["notes"] = st["notes"]
        if conv.notes:
            out["conversion_notes"] = conv.notes
        states.append((st, out))
    for st, out in states:
        out["expect"] = convert_expect(st, ipset_meta, renames)

    meta_by_id = {}
    for sel in sorted(ipset_meta, key=lambda s: ipset_meta[s]["id"]):
        m = dict(ipset_meta[sel])
        set_id = m.pop("id")
        meta_by_id[set_id] = dict({"selector": sel}, **m)

    rename_list = renames.describe()
    description = DESCRIPTION + "Renames (upstream name -> v3 name, applied to resources and " \
        "expectations): " + ("; ".join(rename_list) if rename_list else
                             "none; every upstream name is already a valid v3 name.")
    return {
        "description": description,
        "source": "testdata/calc_states.json (converted by testdata/tools/convert_calc_states.py)",
        "upstream": doc.get("source"),
        "ipset_meta": meta_by_id,
        "states": [out for _, out in states],
    }


def sanity_check(doc, result):
    """Structural checks on the output; raises on the first problem."""
    if len(result["states"]) != len(doc["states"]):
        raise AssertionError("state count differs")
    for st in result["states"]:
        for o in st["resources"]:
            for f in ("apiVersion", "kind", "metadata", "spec"):
                if f not in o:
                    raise AssertionError("%s: object without %s: %r" % (st["name"], f, o))
            if o["apiVersion"] != API_VERSION or not o["metadata"].get("name"):
                raise AssertionError("%s: bad object %r" % (st["name"], o))
            if not valid_name(o["kind"], o["metadata"]["name"]):
                raise AssertionError("%s: invalid name %r" % (st["name"], o["metadata"]["name"]))
        ids = set(st["expect"].get("ipset_ids", {}).values())
        for set_id in st["expect"].get("ipsets", {}):
            if set_id not in ids or set_id not in result["ipset_meta"]:
                raise AssertionError("%s: ipset id %s not declared" % (st["name"], set_id))


def render(result):
    return json.dumps(result, indent=2, ensure_ascii=False) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if %s is not up to date" % os.path.relpath(OUT_PATH))
    args = ap.parse_args()
    with open(IN_PATH, encoding="utf-8") as f:
        doc = json.load(f)
    result = convert(doc)
    sanity_check(doc, result)
    text = render(result)
    if args.check:
        try:
            with open(OUT_PATH, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print("%s is out of date; rerun %s" % (OUT_PATH, sys.argv[0]), file=sys.stderr)
            return 1
        return 0
    with open(OUT_PATH, "w", encoding="utf-8") as f:
        f.write(text)
    print("wrote %s (%d states)" % (OUT_PATH, len(result["states"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
