//! Property tests of the calculation graph's stream, over a small but realistic cluster: three
//! nodes, two namespaces (with their `kns.` profiles), six workload endpoints with labels and
//! named ports, two host endpoints (which can move between nodes), four NetworkPolicies and
//! GlobalNetworkPolicies in two tiers (rule selectors, namespaceSelectors, notSelectors, named
//! ports, nets, Services, Allow/Deny/Pass, untracked/preDNAT/AssumeNeededOnEveryNode
//! variants), a NetworkSet, a GlobalNetworkSet, two EndpointSlices, Nodes, an IPPool and
//! FelixConfigurations. Every object is
//! built from a fixed template (an exhaustive `match` over [`Slot`]) whose knobs the generator
//! turns, so every generated object is valid and failures shrink to readable cases.
//!
//! What is proven, for random operation sequences (apply a random version of a random object,
//! delete a random key, flush, with `InSync` at a random point), with every node subscribed and
//! every flush checked against the stream contract by [`StreamModel`]:
//! 1. Convergence: each node's incrementally built dataplane equals what a fresh graph, given
//!    only the final state (in a shuffled order), sends in one snapshot; also when nodes
//!    subscribe late, unsubscribe and subscribe again.
//! 2. `snapshot(node)` equals the incrementally built dataplane, and taking snapshots (even with
//!    changes pending) neither disturbs the stream nor depends on pending work.
//! 3. Re-subscribing a subscribed node makes the next flush a complete snapshot that, applied to
//!    an empty dataplane, equals the incrementally maintained one; the stream stays correct
//!    afterwards.
//! 4. Rejected updates (bad selectors, rules, ports, CIDRs, tiers, labels, a workload endpoint
//!    whose spec.node contradicts its name...) return `Err`, change nothing that any node is
//!    sent, and leave the last good version in force.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use calc_graph::graph::{CalcGraph, NodeBatch, Update};
use calc_graph::model::{Decoded, Resource, ResourceKey};
use calc_graph::stream_model::StreamModel;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Value, json};

const NODES: [&str; 3] = ["node-1", "node-2", "node-3"];
const NAMESPACES: [&str; 2] = ["ns-a", "ns-b"];

// ---------------------------------------------------------------------------------------------
// The universe: fixed object identities ("slots") whose content the generator varies.
// ---------------------------------------------------------------------------------------------

/// One object identity of the universe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Slot {
    /// Workload endpoint `i` (0..6): node `NODES[i % 3]`, namespace `NAMESPACES[i % 2]`.
    Wep(u8),
    /// Host endpoint `hep-<j>` (0..2).
    Hep(u8),
    /// 0: NetworkPolicy ns-a/allow-app, 1: NetworkPolicy ns-b/deny-app,
    /// 2: GlobalNetworkPolicy guard, 3: GlobalNetworkPolicy host-guard.
    Policy(u8),
    /// Profile `kns.<NAMESPACES[q]>`.
    Profile(u8),
    /// NetworkSet ns-b/backup.
    NetworkSet,
    /// GlobalNetworkSet threats.
    GlobalNetworkSet,
    /// 0: Tier security, 1: Tier default.
    Tier(u8),
    /// Node `NODES[n]` (0..2).
    Node(u8),
    /// IPPool pool-v4.
    IpPool,
    /// 0: FelixConfiguration default, 1: FelixConfiguration node.node-1.
    FelixConfig(u8),
    /// EndpointSlice ns-a/web-<s> (0..2), of Service web (or another).
    Slice(u8),
}

const ALL_SLOTS: [Slot; 25] = [
    Slot::Wep(0),
    Slot::Wep(1),
    Slot::Wep(2),
    Slot::Wep(3),
    Slot::Wep(4),
    Slot::Wep(5),
    Slot::Hep(0),
    Slot::Hep(1),
    Slot::Policy(0),
    Slot::Policy(1),
    Slot::Policy(2),
    Slot::Policy(3),
    Slot::Profile(0),
    Slot::Profile(1),
    Slot::NetworkSet,
    Slot::GlobalNetworkSet,
    Slot::Tier(0),
    Slot::Tier(1),
    Slot::Node(0),
    Slot::Node(1),
    Slot::IpPool,
    Slot::FelixConfig(0),
    Slot::FelixConfig(1),
    Slot::Slice(0),
    Slot::Slice(1),
];

/// Rule templates for policies and profiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RuleT {
    AllowFromAppA,
    DenyToNotRoleX,
    PassFromTeamT1,
    AllowTcpHttp,
    AllowUdpDnsFromAppB,
    DenyNets,
    AllowFromNetSets,
    AllowTcpNotHttpFromRoleY,
    AllowRoleXAnyNamespace,
    DenyAll,
    PassV6Nets,
    AllowNamedPortsInNsB,
    /// From (ingress) or to (egress) Service ns-a/web.
    AllowServiceWeb,
}

const ALL_RULES: [RuleT; 13] = [
    RuleT::AllowFromAppA,
    RuleT::DenyToNotRoleX,
    RuleT::PassFromTeamT1,
    RuleT::AllowTcpHttp,
    RuleT::AllowUdpDnsFromAppB,
    RuleT::DenyNets,
    RuleT::AllowFromNetSets,
    RuleT::AllowTcpNotHttpFromRoleY,
    RuleT::AllowRoleXAnyNamespace,
    RuleT::DenyAll,
    RuleT::PassV6Nets,
    RuleT::AllowNamedPortsInNsB,
    RuleT::AllowServiceWeb,
];

fn rule(t: RuleT, ingress: bool) -> Value {
    match t {
        RuleT::AllowFromAppA => json!({"action": "Allow", "source": {"selector": "app == 'a'"}}),
        RuleT::DenyToNotRoleX => json!({"action": "Deny",
            "destination": {"selector": "has(app)", "notSelector": "role == 'x'"}}),
        RuleT::PassFromTeamT1 => {
            json!({"action": "Pass", "source": {"namespaceSelector": "team == 't1'"}})
        }
        RuleT::AllowTcpHttp => {
            json!({"action": "Allow", "protocol": "TCP", "destination": {"ports": ["http"]}})
        }
        RuleT::AllowUdpDnsFromAppB => json!({"action": "Allow", "protocol": "UDP",
            "source": {"selector": "app == 'b'"}, "destination": {"ports": ["dns", 53]}}),
        RuleT::DenyNets => json!({"action": "Deny", "source": {"nets": ["10.65.0.0/16"]},
            "destination": {"notNets": ["10.65.1.0/24"]}}),
        RuleT::AllowFromNetSets => json!({"action": "Allow",
            "source": {"selector": "feed == 'threats' || role == 'backup'"}}),
        RuleT::AllowTcpNotHttpFromRoleY => json!({"action": "Allow", "protocol": "TCP",
            "source": {"selector": "role == 'y'"}, "destination": {"notPorts": ["http"]}}),
        RuleT::AllowRoleXAnyNamespace => json!({"action": "Allow",
            "source": {"selector": "role == 'x'", "namespaceSelector": "all()"}}),
        RuleT::DenyAll => json!({"action": "Deny"}),
        RuleT::PassV6Nets => json!({"action": "Pass", "source": {"nets": ["fd00:65::/64"]}}),
        RuleT::AllowNamedPortsInNsB => json!({"action": "Allow", "protocol": "TCP",
            "destination": {"namespaceSelector": "projectcalico.org/name == 'ns-b'",
                            "ports": ["http", "metrics"]}}),
        // A Service is a source in ingress rules only, a destination in egress rules only.
        RuleT::AllowServiceWeb => {
            let peer = if ingress { "source" } else { "destination" };
            json!({"action": "Allow", peer: {"services": {"name": "web", "namespace": "ns-a"}}})
        }
    }
}

/// The knobs of one version of an object; each template reads them modulo its choices.
#[derive(Clone, Debug, Default, PartialEq)]
struct Ver {
    k: [u8; 6],
    ingress: Vec<RuleT>,
    egress: Vec<RuleT>,
}

fn pick<T: Clone>(choices: &[T], k: u8) -> T {
    choices[usize::from(k) % choices.len()].clone()
}

/// Labels from optional values.
fn labels(pairs: &[(&str, Option<&str>)]) -> Value {
    let mut m = serde_json::Map::new();
    for (k, v) in pairs {
        if let Some(v) = v {
            m.insert((*k).to_string(), json!(v));
        }
    }
    Value::Object(m)
}

fn rules(ts: &[RuleT], ingress: bool) -> Value {
    Value::Array(ts.iter().map(|t| rule(*t, ingress)).collect())
}

fn wep_name(i: u8) -> (String, &'static str, &'static str) {
    let node = NODES[usize::from(i) % 3];
    let ns = NAMESPACES[usize::from(i) % 2];
    let pod = format!("pod-{i}");
    (
        format!(
            "{}-k8s-{}-eth0",
            node.replace('-', "--"),
            pod.replace('-', "--")
        ),
        node,
        ns,
    )
}

/// The v3 object of `slot` at version `v`.
fn build_value(slot: Slot, v: &Ver) -> Value {
    let k = v.k;
    match slot {
        Slot::Wep(i) => {
            let (name, node, ns) = wep_name(i);
            let other_ns = NAMESPACES[(usize::from(i) + 1) % 2];
            let ips: Vec<String> = match k[2] % 4 {
                0 => vec![format!("10.65.{i}.1/32")],
                1 => vec![format!("10.65.{i}.2/32")],
                2 => vec![format!("10.65.{i}.1/32"), format!("fd00:65::{i}:1/128")],
                _ => vec![format!("10.65.{i}.1")],
            };
            let ports = pick(
                &[
                    json!([]),
                    json!([{"name": "http", "protocol": "TCP", "port": 80}]),
                    json!([{"name": "http", "protocol": "TCP", "port": 8080},
                           {"name": "dns", "protocol": "UDP", "port": 53}]),
                    json!([{"name": "dns", "protocol": "UDP", "port": 5353},
                           {"name": "metrics", "protocol": "TCP", "port": 9090}]),
                ],
                k[3],
            );
            let profiles = pick(
                &[
                    json!([format!("kns.{ns}")]),
                    json!([]),
                    json!([format!("kns.{other_ns}"), format!("kns.{ns}")]),
                ],
                k[4],
            );
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
                "metadata": {"name": name, "namespace": ns, "labels": labels(&[
                    ("app", pick(&[None, Some("a"), Some("b"), Some("c")], k[0])),
                    ("role", pick(&[None, Some("x"), Some("y")], k[1])),
                ])},
                "spec": {
                    "orchestrator": "k8s", "node": node, "pod": format!("pod-{i}"),
                    "endpoint": "eth0", "interfaceName": format!("cali{i:011x}"),
                    "mac": "ee:ee:ee:ee:ee:ee", "ipNetworks": ips, "profiles": profiles,
                    "ports": ports,
                }
            })
        }
        Slot::Hep(j) => {
            let home = NODES[usize::from(j)];
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "HostEndpoint",
                "metadata": {"name": format!("hep-{j}"), "labels": labels(&[
                    ("host-endpoint", pick(&[None, Some("ingress"), Some("egress")], k[1])),
                    ("app", pick(&[None, Some("a")], k[2])),
                ])},
                "spec": {
                    "node": pick(&[home, "node-3"], k[0]),
                    "interfaceName": format!("eth{j}"),
                    "expectedIPs": pick(&[
                        json!([format!("192.168.0.1{j}")]),
                        json!([format!("192.168.0.1{j}"), format!("fd00:168::{j}")]),
                        json!([format!("192.168.0.2{j}")]),
                    ], k[3]),
                    "ports": pick(&[json!([]),
                        json!([{"name": "http", "protocol": "TCP", "port": 80}])], k[4]),
                    "profiles": pick(&[json!([]), json!(["kns.ns-a"])], k[5]),
                }
            })
        }
        Slot::Policy(p) => {
            let global = p >= 2;
            let (kind, ns, name) = match p {
                0 => ("NetworkPolicy", Some("ns-a"), "allow-app"),
                1 => ("NetworkPolicy", Some("ns-b"), "deny-app"),
                2 => ("GlobalNetworkPolicy", None, "guard"),
                _ => ("GlobalNetworkPolicy", None, "host-guard"),
            };
            let selector = if p == 3 {
                pick(
                    &[
                        "has(host-endpoint)",
                        "host-endpoint == 'ingress'",
                        "all()",
                        "app == 'a'",
                    ],
                    k[2],
                )
            } else {
                pick(
                    &[
                        "all()",
                        "app == 'a'",
                        "app in {'a', 'b'}",
                        "has(role)",
                        "role == 'y' || app == 'c'",
                        "!has(app)",
                        "pcns.team == 't1'",
                        "has(host-endpoint)",
                    ],
                    k[2],
                )
            };
            let mut spec = json!({
                "tier": pick(&["default", "security"], k[0]),
                "selector": selector,
                "ingress": rules(&v.ingress, true),
                "egress": rules(&v.egress, false),
            });
            if let Some(order) = pick(&[None, Some(10.0), Some(100.0)], k[1]) {
                spec["order"] = json!(order);
            }
            if k[4] % 2 == 1 {
                spec["types"] = json!(["Ingress", "Egress"]);
            }
            if global {
                let ns_sel = pick(
                    &[
                        "",
                        "team == 't1'",
                        "all()",
                        "projectcalico.org/name == 'ns-b'",
                    ],
                    k[3],
                );
                if !ns_sel.is_empty() {
                    spec["namespaceSelector"] = json!(ns_sel);
                }
                match k[5] % 7 {
                    3 => spec["performanceHints"] = json!(["AssumeNeededOnEveryNode"]),
                    4 => {
                        spec["doNotTrack"] = json!(true);
                        spec["applyOnForward"] = json!(true);
                    }
                    5 => {
                        spec["preDNAT"] = json!(true);
                        spec["applyOnForward"] = json!(true);
                        spec["egress"] = json!([]);
                        spec["types"] = json!(["Ingress"]);
                    }
                    6 => spec["applyOnForward"] = json!(true),
                    _ => {}
                }
            } else if k[5] % 4 == 3 {
                spec["performanceHints"] = json!(["AssumeNeededOnEveryNode"]);
            }
            let mut meta = json!({"name": name});
            if let Some(ns) = ns {
                meta["namespace"] = json!(ns);
            }
            json!({"apiVersion": "projectcalico.org/v3", "kind": kind, "metadata": meta,
                   "spec": spec})
        }
        Slot::Profile(q) => {
            let ns = NAMESPACES[usize::from(q)];
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "Profile",
                "metadata": {"name": format!("kns.{ns}")},
                "spec": {
                    "ingress": rules(&v.ingress, true),
                    "egress": rules(&v.egress, false),
                    "labelsToApply": labels(&[
                        ("pcns.projectcalico.org/name", Some(ns)),
                        ("pcns.team", pick(&[Some("t1"), Some("t2"), None], k[0])),
                        ("pcns.env", pick(&[None, Some("prod")], k[1])),
                    ]),
                }
            })
        }
        Slot::NetworkSet => json!({
            "apiVersion": "projectcalico.org/v3", "kind": "NetworkSet",
            "metadata": {"name": "backup", "namespace": "ns-b", "labels": labels(&[
                ("role", pick(&[Some("backup"), None], k[0])),
                ("feed", pick(&[None, Some("threats")], k[1])),
            ])},
            "spec": {"nets": pick(&[
                json!(["192.168.50.0/24"]),
                json!(["192.168.50.0/24", "10.65.3.0/24"]),
                json!(["192.168.50.7/24"]),
                json!(["fd00:50::/64"]),
                json!([]),
            ], k[2])}
        }),
        Slot::GlobalNetworkSet => json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkSet",
            "metadata": {"name": "threats", "labels": labels(&[
                ("feed", pick(&[Some("threats"), None], k[0])),
                ("role", pick(&[None, Some("backup")], k[1])),
            ])},
            "spec": {"nets": pick(&[
                json!(["198.51.100.0/24"]),
                json!(["198.51.100.0/24", "192.168.50.0/24"]),
                json!(["203.0.113.128/25", "2001:db8:bad::/48"]),
            ], k[2])}
        }),
        Slot::Tier(t) => {
            let (name, orders, actions) = if t == 0 {
                (
                    "security",
                    &[Some(100.0), Some(300.0), None][..],
                    &["Pass", "Deny"][..],
                )
            } else {
                (
                    "default",
                    &[Some(1_000_000.0), Some(50.0)][..],
                    &["Deny", "Pass"][..],
                )
            };
            let mut spec = json!({"defaultAction": pick(actions, k[1])});
            if let Some(o) = pick(orders, k[0]) {
                spec["order"] = json!(o);
            }
            json!({"apiVersion": "projectcalico.org/v3", "kind": "Tier",
                   "metadata": {"name": name}, "spec": spec})
        }
        Slot::Node(n) => {
            let name = NODES[usize::from(n)];
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "Node",
                "metadata": {"name": name, "labels": {"zone": pick(&["z1", "z2"], k[0])}},
                "spec": {"bgp": {"ipv4Address": pick(&[
                    format!("192.168.0.1{n}/24"), format!("192.168.1.1{n}/24"),
                ], k[1])}}
            })
        }
        Slot::IpPool => json!({
            "apiVersion": "projectcalico.org/v3", "kind": "IPPool",
            "metadata": {"name": "pool-v4"},
            "spec": {
                "cidr": pick(&["10.65.0.0/16", "10.66.0.0/16"], k[0]),
                "natOutgoing": pick(&[true, false], k[1]),
                "ipipMode": pick(&["Never", "Always", "CrossSubnet"], k[2]),
                "vxlanMode": "Never",
            }
        }),
        Slot::FelixConfig(f) => {
            let mut spec = json!({"logSeverityScreen": pick(&["Info", "Debug"], k[0])});
            if k[1] % 2 == 1 {
                spec["iptablesRefreshInterval"] = json!("90s");
            }
            json!({"apiVersion": "projectcalico.org/v3", "kind": "FelixConfiguration",
                   "metadata": {"name": if f == 0 { "default" } else { "node.node-1" }},
                   "spec": spec})
        }
        Slot::Slice(i) => {
            // Both slices may hold 10.65.0.1: members are counted per slice.
            let addresses = pick(
                &[
                    json!([{"addresses": ["10.65.0.1"]}]),
                    json!([{"addresses": ["10.65.0.1"]}, {"addresses": [format!("10.65.1.{i}")]}]),
                    json!([{"addresses": ["fd00:65::1"]}]),
                    json!([]),
                ],
                k[1],
            );
            json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("web-{i}"), "namespace": "ns-a", "labels": {
                    "kubernetes.io/service-name": pick(&["web", "web", "other"], k[0]),
                }},
                "addressType": "IPv4",
                "endpoints": addresses,
                "ports": pick(&[
                    json!([{"port": 80}]),
                    json!([{"port": 80}, {"protocol": "UDP", "port": 53}]),
                    json!([{"name": "unset"}]),
                ], k[2]),
            })
        }
    }
}

fn decode(v: Value) -> Resource {
    match Resource::from_value(v.clone()) {
        Ok(Decoded::Resource(_, r)) => r,
        other => panic!("template does not decode: {other:?}\n{v}"),
    }
}

fn build(slot: Slot, v: &Ver) -> Resource {
    decode(build_value(slot, v))
}

fn key_of(slot: Slot) -> ResourceKey {
    build(slot, &Ver::default()).key()
}

// ---------------------------------------------------------------------------------------------
// Operations and their generators.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Apply(Slot, Ver),
    Delete(Slot),
    Flush,
    /// Only generated for the snapshot property: `snapshot(NODES[n])` mid-stream.
    Snapshot(u8),
    /// Only generated for the membership property: `subscribe(NODES[n])` (a resync if already
    /// subscribed) and `unsubscribe(NODES[n])`.
    Subscribe(u8),
    Unsubscribe(u8),
}

/// Which optional operations a generator mixes in.
#[derive(Clone, Copy)]
enum Extras {
    None,
    Snapshots,
    Membership,
}

/// A random history: an initial population (a shuffled subset of the universe), then random
/// operations; `InSync` goes in at `in_sync_at` (modulo the length).
#[derive(Clone, Debug)]
struct Scenario {
    initial: Vec<(Slot, Ver)>,
    ops: Vec<Op>,
    in_sync_at: usize,
    rebuild_seed: u64,
}

fn slot_strategy() -> impl Strategy<Value = Slot> {
    prop_oneof![
        6 => (0u8..6).prop_map(Slot::Wep),
        2 => (0u8..2).prop_map(Slot::Hep),
        6 => (0u8..4).prop_map(Slot::Policy),
        2 => (0u8..2).prop_map(Slot::Profile),
        1 => Just(Slot::NetworkSet),
        1 => Just(Slot::GlobalNetworkSet),
        2 => (0u8..2).prop_map(Slot::Tier),
        1 => (0u8..2).prop_map(Slot::Node),
        1 => Just(Slot::IpPool),
        1 => (0u8..2).prop_map(Slot::FelixConfig),
        2 => (0u8..2).prop_map(Slot::Slice),
    ]
}

fn ver_strategy() -> impl Strategy<Value = Ver> {
    let rule = prop::sample::select(&ALL_RULES[..]);
    (
        prop::array::uniform6(0u8..12),
        prop::collection::vec(rule.clone(), 0..3),
        prop::collection::vec(rule, 0..3),
    )
        .prop_map(|(k, ingress, egress)| Ver { k, ingress, egress })
}

fn op_strategy(extras: Extras) -> impl Strategy<Value = Op> {
    let (snap, member) = match extras {
        Extras::None => (0, 0),
        Extras::Snapshots => (2, 0),
        Extras::Membership => (0, 2),
    };
    prop_oneof![
        12 => (slot_strategy(), ver_strategy()).prop_map(|(s, v)| Op::Apply(s, v)),
        4 => slot_strategy().prop_map(Op::Delete),
        4 => Just(Op::Flush),
        snap => (0u8..3).prop_map(Op::Snapshot),
        member => (0u8..3).prop_map(Op::Subscribe),
        member => (0u8..3).prop_map(Op::Unsubscribe),
    ]
}

fn ops_strategy(max: usize, extras: Extras) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op_strategy(extras), 0..max)
}

fn scenario_strategy(extras: Extras) -> impl Strategy<Value = Scenario> {
    let initial =
        prop::collection::vec((prop::bool::weighted(0.8), ver_strategy()), ALL_SLOTS.len())
            .prop_map(|v| {
                ALL_SLOTS
                    .iter()
                    .zip(v)
                    .filter(|(_, (present, _))| *present)
                    .map(|(s, (_, v))| (*s, v))
                    .collect::<Vec<_>>()
            })
            .prop_shuffle();
    (
        initial,
        ops_strategy(40, extras),
        any::<usize>(),
        any::<u64>(),
    )
        .prop_map(|(initial, ops, in_sync_at, rebuild_seed)| Scenario {
            initial,
            ops,
            in_sync_at,
            rebuild_seed,
        })
}

// ---------------------------------------------------------------------------------------------
// The harness: one graph, every node subscribed, one StreamModel per node.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Step {
    Apply(Box<Resource>),
    Delete(ResourceKey),
    Flush,
    InSync,
    Snapshot(String),
    Subscribe(String),
    Unsubscribe(String),
}

fn steps_of(s: &Scenario) -> Vec<Step> {
    let mut steps: Vec<Step> = s
        .initial
        .iter()
        .map(|(slot, v)| Step::Apply(Box::new(build(*slot, v))))
        .collect();
    steps.extend(s.ops.iter().map(op_step));
    let at = s.in_sync_at % (steps.len() + 1);
    steps.insert(at, Step::InSync);
    steps
}

fn op_step(op: &Op) -> Step {
    match op {
        Op::Apply(slot, v) => Step::Apply(Box::new(build(*slot, v))),
        Op::Delete(slot) => Step::Delete(key_of(*slot)),
        Op::Flush => Step::Flush,
        Op::Snapshot(n) => Step::Snapshot(NODES[usize::from(*n) % 3].to_string()),
        Op::Subscribe(n) => Step::Subscribe(NODES[usize::from(*n) % 3].to_string()),
        Op::Unsubscribe(n) => Step::Unsubscribe(NODES[usize::from(*n) % 3].to_string()),
    }
}

fn describe(step: &Step) -> String {
    match step {
        Step::Apply(r) => format!("apply {}: {}", r.key(), r.to_value()),
        Step::Delete(k) => format!("delete {k}"),
        Step::Flush => "flush".into(),
        Step::InSync => "in-sync".into(),
        Step::Snapshot(n) => format!("snapshot {n}"),
        Step::Subscribe(n) => format!("subscribe {n}"),
        Step::Unsubscribe(n) => format!("unsubscribe {n}"),
    }
}

struct Harness {
    g: CalcGraph,
    /// The dataplane of every subscribed node, as its stream describes it.
    models: BTreeMap<String, StreamModel>,
    state: BTreeMap<ResourceKey, Resource>,
    log: Vec<String>,
    rebuild_seed: u64,
}

impl Harness {
    /// A graph with every node subscribed.
    fn new(rebuild_seed: u64) -> Harness {
        Harness::with_subscribers(rebuild_seed, &NODES)
    }

    fn with_subscribers(rebuild_seed: u64, nodes: &[&str]) -> Harness {
        let mut g = CalcGraph::new();
        for n in nodes {
            g.subscribe(n);
        }
        Harness {
            g,
            models: nodes
                .iter()
                .map(|n| (n.to_string(), StreamModel::default()))
                .collect(),
            state: BTreeMap::new(),
            log: nodes.iter().map(|n| format!("subscribe {n}")).collect(),
            rebuild_seed,
        }
    }

    fn fail(&self, what: impl std::fmt::Display) -> TestCaseError {
        let mut s = format!("{what}\n--- steps ({}) ---\n", self.log.len());
        for (i, l) in self.log.iter().enumerate() {
            let _ = writeln!(s, "{i:3}: {l}");
        }
        TestCaseError::fail(s)
    }

    fn run(&mut self, steps: &[Step]) -> Result<(), TestCaseError> {
        for s in steps {
            self.step(s)?;
        }
        Ok(())
    }

    fn step(&mut self, s: &Step) -> Result<(), TestCaseError> {
        self.log.push(describe(s));
        match s {
            Step::Apply(r) => {
                if let Err(e) = self.g.apply(Update::Apply((**r).clone())) {
                    return Err(self.fail(format!("valid object rejected: {e}")));
                }
                self.state.insert(r.key(), (**r).clone());
            }
            Step::Delete(k) => {
                if let Err(e) = self.g.apply(Update::Delete(k.clone())) {
                    return Err(self.fail(format!("delete rejected: {e}")));
                }
                self.state.remove(k);
            }
            Step::InSync => {
                if let Err(e) = self.g.apply(Update::InSync) {
                    return Err(self.fail(format!("InSync rejected: {e}")));
                }
            }
            Step::Flush => {
                let batches = self.g.flush();
                self.absorb(batches)?;
            }
            Step::Subscribe(node) => {
                self.g.subscribe(node);
                // A new subscription, or a resync: the next flush is a complete snapshot.
                self.models.insert(node.clone(), StreamModel::default());
            }
            Step::Unsubscribe(node) => {
                self.g.unsubscribe(node);
                self.models.remove(node);
            }
            Step::Snapshot(node) => {
                let snap = self.g.snapshot(node);
                let mut fresh = StreamModel::default();
                if let Err(e) = fresh.apply_all(snap.iter().map(|m| &**m)) {
                    return Err(self.fail(format!(
                        "snapshot({node}) breaks the stream contract: {e}\n{snap:#?}"
                    )));
                }
                let rebuilt = self.rebuild()?;
                if fresh != rebuilt[node.as_str()] {
                    return Err(self.fail(format!(
                        "snapshot({node}) differs from a fresh graph of the current state \
                         (left: snapshot, right: rebuilt):\n{}",
                        diff(&fresh, &rebuilt[node.as_str()])
                    )));
                }
            }
        }
        Ok(())
    }

    /// Applies a flush's batches to the nodes' models, checking the contract.
    fn absorb(&mut self, batches: Vec<NodeBatch>) -> Result<(), TestCaseError> {
        for b in batches {
            let Some(dp) = self.models.get_mut(&b.node) else {
                return Err(self.fail(format!("batch for unsubscribed node {}", b.node)));
            };
            if let Err(e) = dp.apply_all(b.messages.iter().map(|m| &**m)) {
                let msgs = format!("{:#?}", b.messages);
                return Err(self.fail(format!(
                    "stream contract broken on {}: {e}\nbatch: {msgs}",
                    b.node
                )));
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), TestCaseError> {
        self.step(&Step::Flush)
    }

    /// What a fresh graph given only the current state (shuffled), `InSync` if this graph is
    /// in sync, then subscribed and flushed once, sends each node.
    fn rebuild(&self) -> Result<BTreeMap<String, StreamModel>, TestCaseError> {
        let mut objects: Vec<&Resource> = self.state.values().collect();
        shuffle(&mut objects, self.rebuild_seed);
        let mut g = CalcGraph::new();
        for r in objects {
            if let Err(e) = g.apply(Update::Apply(r.clone())) {
                return Err(self.fail(format!("fresh graph rejected the final state: {e}")));
            }
        }
        if self.g.in_sync() {
            g.apply(Update::InSync)
                .map_err(|e| self.fail(format!("InSync rejected: {e}")))?;
        }
        for n in NODES {
            g.subscribe(n);
        }
        let mut models: BTreeMap<String, StreamModel> = NODES
            .iter()
            .map(|n| (n.to_string(), StreamModel::default()))
            .collect();
        for b in g.flush() {
            let dp = models.get_mut(&b.node).expect("only subscribed nodes");
            if let Err(e) = dp.apply_all(b.messages.iter().map(|m| &**m)) {
                return Err(self.fail(format!(
                    "fresh graph's snapshot for {} breaks the contract: {e}",
                    b.node
                )));
            }
        }
        Ok(models)
    }

    /// Subscribes any node that is not, flushes, then requires every node's model to equal a
    /// fresh graph's.
    fn check_converged(&mut self, ctx: &str) -> Result<(), TestCaseError> {
        for n in NODES {
            if !self.models.contains_key(n) {
                self.step(&Step::Subscribe(n.to_string()))?;
            }
        }
        self.flush()?;
        let want = self.rebuild()?;
        for n in NODES {
            if self.models[n] != want[n] {
                return Err(self.fail(format!(
                    "{ctx}: {n} did not converge (left: incremental, right: fresh graph of \
                     the final state):\n{}",
                    diff(&self.models[n], &want[n])
                )));
            }
        }
        Ok(())
    }
}

/// Deterministic Fisher-Yates driven by splitmix64.
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut x = seed;
    let mut next = || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..v.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// A readable difference between two dataplanes.
fn diff(a: &StreamModel, b: &StreamModel) -> String {
    fn map<K: Ord + std::fmt::Debug, V: PartialEq + std::fmt::Debug>(
        out: &mut String,
        name: &str,
        a: &BTreeMap<K, V>,
        b: &BTreeMap<K, V>,
    ) {
        for (k, va) in a {
            match b.get(k) {
                None => {
                    let _ = writeln!(out, "{name} {k:?}: only left: {va:?}");
                }
                Some(vb) if vb != va => {
                    let _ = writeln!(out, "{name} {k:?}:\n  left:  {va:?}\n  right: {vb:?}");
                }
                _ => {}
            }
        }
        for (k, vb) in b {
            if !a.contains_key(k) {
                let _ = writeln!(out, "{name} {k:?}: only right: {vb:?}");
            }
        }
    }
    let mut out = String::new();
    map(&mut out, "config", &a.config, &b.config);
    map(&mut out, "ipset", &a.ipsets, &b.ipsets);
    map(&mut out, "policy", &a.policies, &b.policies);
    map(&mut out, "profile", &a.profiles, &b.profiles);
    map(
        &mut out,
        "workload",
        &a.workload_endpoints,
        &b.workload_endpoints,
    );
    map(&mut out, "host", &a.host_endpoints, &b.host_endpoints);
    map(
        &mut out,
        "host-metadata",
        &a.host_metadata,
        &b.host_metadata,
    );
    map(&mut out, "ipam-pool", &a.ipam_pools, &b.ipam_pools);
    if a.in_sync != b.in_sync {
        let _ = writeln!(out, "in_sync: left {} right {}", a.in_sync, b.in_sync);
    }
    out
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // Only this file is ours to write: no regression files next to it.
        failure_persistence: None,
        max_shrink_iters: 20_000,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Invalid versions for the rejection property.
// ---------------------------------------------------------------------------------------------

/// Ways to make an object invalid (by validation, or by conversion in the graph).
#[derive(Clone, Copy, Debug)]
enum Invalid {
    PolicyBadSelector,
    PolicyGlobalInSelector,
    PolicyBadRuleSelector,
    PolicyBadAction,
    PolicyPortsWithoutProtocol,
    PolicyBadPortName,
    PolicyBadCidr,
    PolicyUnmaskedCidr,
    PolicyMixedIpVersions,
    PolicyBadTier,
    PolicyBadType,
    PolicyBadHint,
    GnpBadNamespaceSelector,
    GnpDoNotTrackWithoutApplyOnForward,
    GnpPreDnatWithEgress,
    WepNodeMismatch,
    WepBadIp,
    WepPortWithoutProtocol,
    HepNoNode,
    TierBadDefaultAction,
    ProfileBadLabelKey,
    NetSetBadCidr,
    NetSetReservedLabel,
}

const ALL_INVALID: [Invalid; 23] = [
    Invalid::PolicyBadSelector,
    Invalid::PolicyGlobalInSelector,
    Invalid::PolicyBadRuleSelector,
    Invalid::PolicyBadAction,
    Invalid::PolicyPortsWithoutProtocol,
    Invalid::PolicyBadPortName,
    Invalid::PolicyBadCidr,
    Invalid::PolicyUnmaskedCidr,
    Invalid::PolicyMixedIpVersions,
    Invalid::PolicyBadTier,
    Invalid::PolicyBadType,
    Invalid::PolicyBadHint,
    Invalid::GnpBadNamespaceSelector,
    Invalid::GnpDoNotTrackWithoutApplyOnForward,
    Invalid::GnpPreDnatWithEgress,
    Invalid::WepNodeMismatch,
    Invalid::WepBadIp,
    Invalid::WepPortWithoutProtocol,
    Invalid::HepNoNode,
    Invalid::TierBadDefaultAction,
    Invalid::ProfileBadLabelKey,
    Invalid::NetSetBadCidr,
    Invalid::NetSetReservedLabel,
];

const POLICIES: [Slot; 4] = [
    Slot::Policy(0),
    Slot::Policy(1),
    Slot::Policy(2),
    Slot::Policy(3),
];
const WEPS: [Slot; 6] = [
    Slot::Wep(0),
    Slot::Wep(1),
    Slot::Wep(2),
    Slot::Wep(3),
    Slot::Wep(4),
    Slot::Wep(5),
];

impl Invalid {
    /// The slots this corruption applies to.
    fn slots(self) -> &'static [Slot] {
        match self {
            Invalid::PolicyBadSelector
            | Invalid::PolicyGlobalInSelector
            | Invalid::PolicyBadRuleSelector
            | Invalid::PolicyBadAction
            | Invalid::PolicyPortsWithoutProtocol
            | Invalid::PolicyBadPortName
            | Invalid::PolicyBadCidr
            | Invalid::PolicyUnmaskedCidr
            | Invalid::PolicyMixedIpVersions
            | Invalid::PolicyBadTier
            | Invalid::PolicyBadType
            | Invalid::PolicyBadHint => &POLICIES,
            Invalid::GnpBadNamespaceSelector
            | Invalid::GnpDoNotTrackWithoutApplyOnForward
            | Invalid::GnpPreDnatWithEgress => &POLICIES[2..],
            Invalid::WepNodeMismatch | Invalid::WepBadIp | Invalid::WepPortWithoutProtocol => &WEPS,
            Invalid::HepNoNode => &[Slot::Hep(0), Slot::Hep(1)],
            Invalid::TierBadDefaultAction => &[Slot::Tier(0), Slot::Tier(1)],
            Invalid::ProfileBadLabelKey => &[Slot::Profile(0), Slot::Profile(1)],
            Invalid::NetSetBadCidr => &[Slot::NetworkSet, Slot::GlobalNetworkSet],
            Invalid::NetSetReservedLabel => &[Slot::NetworkSet],
        }
    }

    /// Corrupts the v3 form of a valid object of one of [`Invalid::slots`].
    fn corrupt(self, slot: Slot, v: &mut Value) {
        let push_ingress = |v: &mut Value, r: Value| {
            if !v["spec"]["ingress"].is_array() {
                v["spec"]["ingress"] = json!([]);
            }
            v["spec"]["ingress"]
                .as_array_mut()
                .expect("just made an array")
                .push(r);
        };
        match self {
            Invalid::PolicyBadSelector => v["spec"]["selector"] = json!("a =="),
            Invalid::PolicyGlobalInSelector => v["spec"]["selector"] = json!("global()"),
            Invalid::PolicyBadRuleSelector => push_ingress(
                v,
                json!({"action": "Allow", "source": {"selector": "app == "}}),
            ),
            Invalid::PolicyBadAction => push_ingress(v, json!({"action": "Accept"})),
            Invalid::PolicyPortsWithoutProtocol => push_ingress(
                v,
                json!({"action": "Allow", "destination": {"ports": [80]}}),
            ),
            Invalid::PolicyBadPortName => push_ingress(
                v,
                json!({"action": "Allow", "protocol": "TCP",
                       "destination": {"ports": ["Not_A_Port"]}}),
            ),
            Invalid::PolicyBadCidr => push_ingress(
                v,
                json!({"action": "Deny", "source": {"nets": ["10.0.0.1/33"]}}),
            ),
            Invalid::PolicyUnmaskedCidr => push_ingress(
                v,
                json!({"action": "Deny", "source": {"nets": ["10.65.1.1/16"]}}),
            ),
            Invalid::PolicyMixedIpVersions => push_ingress(
                v,
                json!({"action": "Deny", "source": {"nets": ["10.0.0.0/8", "fd00::/8"]}}),
            ),
            Invalid::PolicyBadTier => v["spec"]["tier"] = json!("Security"),
            Invalid::PolicyBadType => v["spec"]["types"] = json!(["Sideways"]),
            Invalid::PolicyBadHint => v["spec"]["performanceHints"] = json!(["Fast"]),
            Invalid::GnpBadNamespaceSelector => v["spec"]["namespaceSelector"] = json!("team in"),
            Invalid::GnpDoNotTrackWithoutApplyOnForward => {
                v["spec"]["doNotTrack"] = json!(true);
                v["spec"]["preDNAT"] = json!(false);
                v["spec"]["applyOnForward"] = json!(false);
            }
            Invalid::GnpPreDnatWithEgress => {
                v["spec"]["doNotTrack"] = json!(false);
                v["spec"]["preDNAT"] = json!(true);
                v["spec"]["applyOnForward"] = json!(true);
                v["spec"]["egress"] = json!([{"action": "Allow"}]);
            }
            Invalid::WepNodeMismatch => {
                let Slot::Wep(i) = slot else {
                    unreachable!("WEP corruption on {slot:?}")
                };
                v["spec"]["node"] = json!(NODES[(usize::from(i) + 1) % 3]);
            }
            Invalid::WepBadIp => v["spec"]["ipNetworks"] = json!(["10.65.0.300/32"]),
            Invalid::WepPortWithoutProtocol => {
                v["spec"]["ports"] = json!([{"name": "http", "port": 80}]);
            }
            Invalid::HepNoNode => v["spec"]["node"] = json!(""),
            Invalid::TierBadDefaultAction => v["spec"]["defaultAction"] = json!("Allow"),
            Invalid::ProfileBadLabelKey => {
                v["spec"]["labelsToApply"]["bad key!"] = json!("x");
            }
            Invalid::NetSetBadCidr => v["spec"]["nets"] = json!(["192.168.50.0/33"]),
            Invalid::NetSetReservedLabel => {
                v["metadata"]["labels"]["projectcalico.org/namespace"] = json!("ns-b");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The properties.
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(128))]

    /// 1. Whatever the path, every node ends where a fresh graph of the final state puts it,
    ///    and no flush on the way breaks the stream contract.
    #[test]
    fn incremental_stream_converges_to_fresh_snapshot(s in scenario_strategy(Extras::None)) {
        let mut h = Harness::new(s.rebuild_seed);
        h.run(&steps_of(&s))?;
        h.check_converged("end of scenario")?;
    }

    /// 1b. The same with nodes joining late, leaving and re-joining (a re-subscription of a
    ///     subscribed node is a resync): every node that is subscribed at the end converges.
    #[test]
    fn late_joiners_and_leavers_converge(
        s in scenario_strategy(Extras::Membership),
        first in prop::sample::subsequence(NODES.to_vec(), 0..=3),
    ) {
        let mut h = Harness::with_subscribers(s.rebuild_seed, &first);
        h.run(&steps_of(&s))?;
        h.check_converged("end of scenario")?;
    }
}

proptest! {
    #![proptest_config(config(96))]

    /// 2. `snapshot(node)` of the final graph, applied to an empty dataplane, equals the node's
    ///    incrementally built dataplane, and it leaves nothing to flush.
    #[test]
    fn snapshot_equals_incremental(s in scenario_strategy(Extras::None)) {
        let mut h = Harness::new(s.rebuild_seed);
        h.run(&steps_of(&s))?;
        h.flush()?;
        for n in NODES {
            let snap = h.g.snapshot(n);
            let mut dp = StreamModel::default();
            if let Err(e) = dp.apply_all(snap.iter().map(|m| &**m)) {
                return Err(h.fail(format!("snapshot({n}) breaks the contract: {e}")));
            }
            if dp != h.models[n] {
                return Err(h.fail(format!(
                    "snapshot({n}) differs from the incremental dataplane \
                     (left: snapshot, right: incremental):\n{}",
                    diff(&dp, &h.models[n])
                )));
            }
        }
        let after = h.g.flush();
        prop_assert!(
            after.is_empty(),
            "flush after snapshots sent {:?}\n{}", after, h.log.join("\n")
        );
    }

    /// 2b. Snapshots taken mid-stream, with changes pending, equal a fresh graph of the state
    ///     at that point, and do not disturb what the subscribed nodes are later sent.
    #[test]
    fn snapshots_mid_stream_do_not_disturb_the_stream(s in scenario_strategy(Extras::Snapshots)) {
        let mut h = Harness::new(s.rebuild_seed);
        h.run(&steps_of(&s))?;
        h.check_converged("after mid-stream snapshots")?;
    }

    /// 3. Re-subscribing makes the next flush a full snapshot (to be applied to an empty
    ///    dataplane) equal to the incremental state; the stream stays correct afterwards.
    #[test]
    fn resubscribe_is_a_full_resync(
        s in scenario_strategy(Extras::None),
        flush_before in prop::bool::weighted(0.75),
        resub in prop::sample::subsequence(NODES.to_vec(), 1..=3),
        after in ops_strategy(25, Extras::None),
    ) {
        let mut h = Harness::new(s.rebuild_seed);
        h.run(&steps_of(&s))?;
        if flush_before {
            h.flush()?;
        }
        let before = h.models.clone();
        for n in &resub {
            h.log.push(format!("subscribe {n} again"));
            h.g.subscribe(n);
        }
        h.log.push("flush".into());
        let batches = h.g.flush();
        for n in NODES {
            let msgs: Vec<_> = batches
                .iter()
                .filter(|b| b.node == n)
                .flat_map(|b| b.messages.iter().map(|m| &**m))
                .collect();
            if resub.contains(&n) {
                let mut dp = StreamModel::default();
                if let Err(e) = dp.apply_all(msgs.iter().copied()) {
                    return Err(h.fail(format!(
                        "resync of {n} applied to an empty dataplane breaks the contract: {e}"
                    )));
                }
                if flush_before && dp != before[n] {
                    return Err(h.fail(format!(
                        "resync of {n} differs from its incremental dataplane \
                         (left: resync, right: incremental):\n{}",
                        diff(&dp, &before[n])
                    )));
                }
                h.models.insert(n.to_string(), dp);
            } else {
                if flush_before && !msgs.is_empty() {
                    return Err(h.fail(format!(
                        "{n} was not re-subscribed and nothing changed, yet it was sent {msgs:?}"
                    )));
                }
                let dp = h.models.get_mut(n).expect("every node has a model");
                if let Err(e) = dp.apply_all(msgs.iter().copied()) {
                    return Err(h.fail(format!("stream contract broken on {n}: {e}")));
                }
            }
        }
        // Every node, resynced or not, now shows the current state.
        let want = h.rebuild()?;
        for n in NODES {
            if h.models[n] != want[n] {
                return Err(h.fail(format!(
                    "after resync, {n} differs from a fresh graph \
                     (left: stream, right: fresh):\n{}",
                    diff(&h.models[n], &want[n])
                )));
            }
        }
        let steps: Vec<Step> = after.iter().map(op_step).collect();
        h.run(&steps)?;
        h.check_converged("after resync and more operations")?;
    }

    /// 4. An invalid version of an existing object is rejected, the next flush sends nothing to
    ///    any node, and the last good version stays in force.
    #[test]
    fn rejections_never_change_output(
        s in scenario_strategy(Extras::None),
        rejects in prop::collection::vec(
            (prop::sample::select(&ALL_INVALID[..]), any::<u8>()), 1..4),
        after in ops_strategy(20, Extras::None),
    ) {
        let mut h = Harness::new(s.rebuild_seed);
        h.run(&steps_of(&s))?;
        h.flush()?;
        for (bad, choice) in rejects {
            let slot = pick(bad.slots(), choice);
            let key = key_of(slot);
            if !h.state.contains_key(&key) {
                h.step(&Step::Apply(Box::new(build(slot, &Ver::default()))))?;
                h.flush()?;
            }
            let mut v = h.state[&key].to_value();
            bad.corrupt(slot, &mut v);
            let invalid = decode(v);
            h.log.push(format!(
                "apply invalid ({bad:?}) {}: {}",
                invalid.key(),
                invalid.to_value()
            ));
            match h.g.apply(Update::Apply(invalid)) {
                Ok(()) => return Err(h.fail(format!("{bad:?} on {key} was accepted"))),
                Err(rej) => prop_assert_eq!(rej.key(), Some(&key)),
            }
            h.log.push("flush".into());
            let out = h.g.flush();
            if !out.is_empty() {
                return Err(h.fail(format!("flush after a rejection sent {out:#?}")));
            }
        }
        // The last good versions are in force: the nodes show what a fresh graph of them sends.
        let want = h.rebuild()?;
        for n in NODES {
            if h.models[n] != want[n] {
                return Err(h.fail(format!(
                    "after rejections, {n} differs from a fresh graph of the last good versions \
                     (left: stream, right: fresh):\n{}",
                    diff(&h.models[n], &want[n])
                )));
            }
        }
        let steps: Vec<Step> = after.iter().map(op_step).collect();
        h.run(&steps)?;
        h.check_converged("after rejections and more operations")?;
    }
}
