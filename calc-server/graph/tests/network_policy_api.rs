//! The Kubernetes network-policy-api kinds through the whole graph, asked with `explain`: a few
//! scenarios of the API's conformance suite (kubernetes-sigs/network-policy-api
//! `conformance/tests`), rewritten here as manifests. The verdict is what the dataplane would
//! enforce: it is read from the tier lists, rules and IP sets the nodes are sent.
//!
//! The cluster: namespaces `gryffindor`, `slytherin` and `ravenclaw` (namespace profiles that
//! allow everything, as Calico's Kubernetes datastore makes them), pods `gryffindor/harry-0`
//! and `gryffindor/harry-1`, `slytherin/draco-0`, `ravenclaw/luna-0`, and Calico's `default`
//! tier as every Calico datastore holds it. Kubernetes NetworkPolicies are written as
//! Kubernetes objects and converted as the Kubernetes datastore converts them.

use calc_graph::explain::{DecidedBy, Explanation, Query, RuleRef, Verdict};
use calc_graph::graph::{CalcGraph, Update};
use calc_graph::manifest::{Outcome, decode_and_validate_strict};
use calc_graph::model::Resource;
use serde_json::{Value, json};

fn namespace(ns: &str) -> Value {
    json!({"apiVersion": "projectcalico.org/v3", "kind": "Profile",
           "metadata": {"name": format!("kns.{ns}")},
           "spec": {"ingress": [{"action": "Allow"}], "egress": [{"action": "Allow"}],
                    "labelsToApply": {"pcns.projectcalico.org/name": ns,
                                      "pcns.kubernetes.io/metadata.name": ns}}})
}

fn pod(ns: &str, name: &str, ip: &str) -> Value {
    json!({"apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
           "metadata": {"name": format!("node--a-k8s-{}-eth0", name.replace('-', "--")), "namespace": ns,
                        "labels": {"app": name}},
           "spec": {"orchestrator": "k8s", "node": "node-a", "pod": name, "endpoint": "eth0",
                    "interfaceName": format!("cali{}", name.replace('-', "")),
                    "ipNetworks": [format!("{ip}/32")], "profiles": [format!("kns.{ns}")]}})
}

fn base() -> Vec<Value> {
    vec![
        json!({"apiVersion": "projectcalico.org/v3", "kind": "Tier",
               "metadata": {"name": "default"}, "spec": {"order": 1_000_000, "defaultAction": "Deny"}}),
        namespace("gryffindor"),
        namespace("slytherin"),
        namespace("ravenclaw"),
        pod("gryffindor", "harry-0", "10.1.0.10"),
        pod("gryffindor", "harry-1", "10.1.0.11"),
        pod("slytherin", "draco-0", "10.2.0.10"),
        pod("ravenclaw", "luna-0", "10.3.0.10"),
    ]
}

/// A Kubernetes NetworkPolicy, as the Kubernetes datastore converts it (`knp.default.<name>`).
fn knp(ns: &str, name: &str, spec: Value) -> Value {
    let spec: k8s_openapi::api::networking::v1::NetworkPolicySpec =
        serde_json::from_value(spec).expect("a NetworkPolicy spec");
    let (spec, warnings) =
        calc_graph::model::kubernetes::network_policy_spec(&spec).expect("converts");
    assert!(warnings.is_empty(), "{warnings:?}");
    json!({"apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
           "metadata": {"name": format!("knp.default.{name}"), "namespace": ns}, "spec": spec})
}

fn cnp(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
           "metadata": {"name": name}, "spec": spec})
}

fn ns(name: &str) -> Value {
    json!({"matchLabels": {"kubernetes.io/metadata.name": name}})
}

/// The graph of `base()` plus `extra`, each object decoded as a manifest is; returns the
/// conversion warnings too.
fn graph_with_warnings(extra: Vec<Value>) -> (CalcGraph, Vec<String>) {
    let mut g = CalcGraph::new();
    let mut warnings = Vec::new();
    for v in base().into_iter().chain(extra) {
        let Outcome::Valid(_, valid) = decode_and_validate_strict(v.clone()) else {
            panic!("invalid: {v}");
        };
        if let Resource::Policy(_, _, s) = valid.resource() {
            warnings.extend(s.conversion_warnings.iter().cloned());
        }
        g.apply(Update::ApplyValid(valid)).expect("accepted");
    }
    g.apply(Update::InSync).unwrap();
    (g, warnings)
}

fn graph(extra: Vec<Value>) -> CalcGraph {
    graph_with_warnings(extra).0
}

fn ask(g: &CalcGraph, from: &str, to: &str, protocol: &str, port: u16) -> Explanation {
    g.explain(&Query {
        from: from.into(),
        to: to.into(),
        protocol: Some(protocol.into()),
        port: Some(port.to_string()),
        source_port: None,
    })
    .unwrap_or_else(|e| panic!("{from} -> {to}: {e}"))
}

fn cnp_rule(tier: &str, policy: &str, index: usize, action: &str) -> DecidedBy {
    DecidedBy::Policy {
        tier: tier.into(),
        policy: policy.into(),
        kind: "KubernetesClusterNetworkPolicy".into(),
        rule: RuleRef {
            index,
            action: action.into(),
        },
    }
}

fn allow_from_slytherin() -> Value {
    knp(
        "gryffindor",
        "allow-slytherin",
        json!({"podSelector": {"matchLabels": {"app": "harry-0"}},
               "ingress": [{"from": [{"namespaceSelector": ns("slytherin")}]}],
               "policyTypes": ["Ingress"]}),
    )
}

#[test]
fn admin_deny_beats_a_network_policy_allow() {
    let g = graph(vec![
        allow_from_slytherin(),
        cnp(
            "deny-slytherin",
            json!({"tier": "Admin", "priority": 10, "subject": {"namespaces": ns("gryffindor")},
                   "ingress": [{"name": "deny-from-slytherin", "action": "Deny",
                                "from": [{"namespaces": ns("slytherin")}]}]}),
        ),
    ]);
    let e = ask(&g, "slytherin/draco-0", "gryffindor/harry-0", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Deny);
    assert_eq!(
        e.ingress.decided_by,
        cnp_rule("kube-admin", "deny-slytherin", 0, "Deny")
    );
    // Traffic the admin rule does not match falls through the tier (default Pass) to the
    // NetworkPolicy, which selects harry-0 and allows only slytherin.
    let e = ask(&g, "ravenclaw/luna-0", "gryffindor/harry-0", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Deny);
    assert_eq!(
        e.ingress.decided_by,
        DecidedBy::Default {
            default: "end-of-tier default".into()
        }
    );
}

#[test]
fn admin_pass_defers_to_the_network_policy() {
    let g = graph(vec![
        allow_from_slytherin(),
        cnp(
            "pass-slytherin",
            json!({"tier": "Admin", "priority": 5, "subject": {"namespaces": ns("gryffindor")},
                   "ingress": [{"action": "Pass", "from": [{"namespaces": ns("slytherin")}]}]}),
        ),
        cnp(
            "deny-all",
            json!({"tier": "Admin", "priority": 50, "subject": {"namespaces": ns("gryffindor")},
                   "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]}),
        ),
    ]);
    // Pass skips the rest of the admin tier (deny-all); the NetworkPolicy allows.
    let e = ask(&g, "slytherin/draco-0", "gryffindor/harry-0", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Allow, "{e:#?}");
    assert!(matches!(&e.ingress.decided_by,
        DecidedBy::Policy { tier, policy, .. } if tier == "default" && policy == "gryffindor/knp.default.allow-slytherin"));
    // harry-1 has no NetworkPolicy: the namespace profile allows what the admin tier passed.
    let e = ask(&g, "slytherin/draco-0", "gryffindor/harry-1", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Allow);
    // Without the Pass, deny-all decides.
    let e = ask(&g, "ravenclaw/luna-0", "gryffindor/harry-0", "tcp", 80);
    assert_eq!(
        e.ingress.decided_by,
        cnp_rule("kube-admin", "deny-all", 0, "Deny")
    );
}

#[test]
fn baseline_deny_applies_only_where_no_network_policy_decides() {
    let g = graph(vec![
        allow_from_slytherin(),
        cnp(
            "baseline-isolate",
            json!({"tier": "Baseline", "priority": 10, "subject": {"namespaces": ns("gryffindor")},
                   "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]}),
        ),
    ]);
    // harry-0 is selected by a NetworkPolicy that allows slytherin: the baseline is not reached.
    let e = ask(&g, "slytherin/draco-0", "gryffindor/harry-0", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Allow);
    // harry-1 is selected by no NetworkPolicy: the baseline denies.
    let e = ask(&g, "slytherin/draco-0", "gryffindor/harry-1", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Deny);
    assert_eq!(
        e.ingress.decided_by,
        cnp_rule("kube-baseline", "baseline-isolate", 0, "Deny")
    );
    // An admin Accept is final: it beats the baseline.
    let g = graph(vec![
        cnp(
            "baseline-isolate",
            json!({"tier": "Baseline", "priority": 10, "subject": {"namespaces": ns("gryffindor")},
                   "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]}),
        ),
        cnp(
            "admin-allow-ravenclaw",
            json!({"tier": "Admin", "priority": 10, "subject": {"namespaces": ns("gryffindor")},
                   "ingress": [{"action": "Accept", "from": [{"namespaces": ns("ravenclaw")}]}]}),
        ),
    ]);
    assert_eq!(
        ask(&g, "ravenclaw/luna-0", "gryffindor/harry-1", "tcp", 80).verdict,
        Verdict::Allow
    );
    assert_eq!(
        ask(&g, "slytherin/draco-0", "gryffindor/harry-1", "tcp", 80).verdict,
        Verdict::Deny
    );
}

#[test]
fn lower_priority_numbers_decide_first() {
    let policies = |accept: u32, deny: u32| {
        vec![
            cnp(
                "accept-slytherin",
                json!({"tier": "Admin", "priority": accept, "subject": {"namespaces": ns("gryffindor")},
                       "ingress": [{"action": "Accept", "from": [{"namespaces": ns("slytherin")}]}]}),
            ),
            cnp(
                "deny-slytherin",
                json!({"tier": "Admin", "priority": deny, "subject": {"namespaces": ns("gryffindor")},
                       "ingress": [{"action": "Deny", "from": [{"namespaces": ns("slytherin")}]}]}),
            ),
        ]
    };
    let e = ask(
        &graph(policies(20, 10)),
        "slytherin/draco-0",
        "gryffindor/harry-0",
        "tcp",
        80,
    );
    assert_eq!(
        e.ingress.decided_by,
        cnp_rule("kube-admin", "deny-slytherin", 0, "Deny")
    );
    let e = ask(
        &graph(policies(10, 20)),
        "slytherin/draco-0",
        "gryffindor/harry-0",
        "tcp",
        80,
    );
    assert_eq!(
        e.ingress.decided_by,
        cnp_rule("kube-admin", "accept-slytherin", 0, "Allow")
    );
}

#[test]
fn port_ranges_and_protocols() {
    let g = graph(vec![cnp(
        "deny-range",
        json!({"tier": "Admin", "priority": 10, "subject": {"pods": {
                   "namespaceSelector": ns("gryffindor"), "podSelector": {"matchLabels": {"app": "harry-0"}}}},
               "ingress": [{"action": "Deny", "from": [{"pods": {"namespaceSelector": {}, "podSelector": {}}}],
                            "protocols": [{"tcp": {"destinationPort": {"range": {"start": 8080, "end": 8090}}}},
                                          {"udp": {"destinationPort": {"number": 53}}}]}]}),
    )]);
    let from = "slytherin/draco-0";
    let verdict = |to: &str, proto: &str, port: u16| ask(&g, from, to, proto, port).verdict;
    assert_eq!(verdict("gryffindor/harry-0", "tcp", 8080), Verdict::Deny);
    assert_eq!(verdict("gryffindor/harry-0", "tcp", 8085), Verdict::Deny);
    assert_eq!(verdict("gryffindor/harry-0", "tcp", 8090), Verdict::Deny);
    assert_eq!(verdict("gryffindor/harry-0", "tcp", 8091), Verdict::Allow);
    assert_eq!(verdict("gryffindor/harry-0", "udp", 53), Verdict::Deny);
    assert_eq!(verdict("gryffindor/harry-0", "tcp", 53), Verdict::Allow);
    assert_eq!(
        verdict("gryffindor/harry-1", "tcp", 8085),
        Verdict::Allow,
        "not a subject"
    );
}

#[test]
fn egress_to_networks() {
    let g = graph(vec![cnp(
        "egress-networks",
        json!({"tier": "Admin", "priority": 10, "subject": {"namespaces": ns("gryffindor")},
               "egress": [{"action": "Accept", "to": [{"networks": ["192.0.2.128/25"]}]},
                          {"action": "Deny", "to": [{"networks": ["192.0.2.0/24", "10.3.0.0/16"]}]}]}),
    )]);
    let from = "gryffindor/harry-0";
    assert_eq!(
        ask(&g, from, "192.0.2.200", "tcp", 443).verdict,
        Verdict::Allow
    );
    let e = ask(&g, from, "192.0.2.10", "tcp", 443);
    assert_eq!(e.verdict, Verdict::Deny);
    assert_eq!(
        e.egress.decided_by,
        cnp_rule("kube-admin", "egress-networks", 1, "Deny")
    );
    // Networks match cluster addresses too.
    assert_eq!(
        ask(&g, from, "ravenclaw/luna-0", "tcp", 80).verdict,
        Verdict::Deny
    );
    assert_eq!(
        ask(&g, from, "198.51.100.1", "tcp", 443).verdict,
        Verdict::Allow
    );
}

#[test]
fn unsupported_peers_fail_closed() {
    let (g, warnings) = graph_with_warnings(vec![
        cnp(
            "deny-to-nodes",
            json!({"tier": "Admin", "priority": 10, "subject": {"pods": {
                       "namespaceSelector": ns("gryffindor"), "podSelector": {"matchLabels": {"app": "harry-0"}}}},
                   "egress": [{"name": "nodes", "action": "Deny",
                               "to": [{"nodes": {"matchLabels": {"role": "control-plane"}}}]}]}),
        ),
        cnp(
            "accept-domains",
            json!({"tier": "Admin", "priority": 5, "subject": {"namespaces": ns("slytherin")},
                   "egress": [{"name": "domains", "action": "Accept", "to": [{"domainNames": ["example.com"]}]}]}),
        ),
        cnp(
            "deny-slytherin-egress",
            json!({"tier": "Admin", "priority": 20, "subject": {"namespaces": ns("slytherin")},
                   "egress": [{"action": "Deny", "to": [{"networks": ["0.0.0.0/0"]}]}]}),
        ),
    ]);
    assert_eq!(
        warnings,
        [
            "egress rule 0 (\"nodes\") cannot be converted (to[0]: nodes peers are not supported): replaced by a rule denying all egress traffic",
            "egress rule 0 (\"domains\") cannot be converted (to[0]: domainNames peers are not supported): dropped",
        ]
    );
    // The Deny stays a Deny: harry-0 can send nothing at all.
    let e = ask(&g, "gryffindor/harry-0", "ravenclaw/luna-0", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Deny);
    assert_eq!(
        e.egress.decided_by,
        cnp_rule("kube-admin", "deny-to-nodes", 0, "Deny")
    );
    assert_eq!(
        ask(&g, "gryffindor/harry-1", "ravenclaw/luna-0", "tcp", 80).verdict,
        Verdict::Allow
    );
    // The Accept is dropped: it allows nothing, so the later Deny decides.
    let e = ask(&g, "slytherin/draco-0", "93.184.216.34", "tcp", 443);
    assert_eq!(
        e.egress.decided_by,
        cnp_rule("kube-admin", "deny-slytherin-egress", 0, "Deny")
    );
}

#[test]
fn admin_and_baseline_admin_network_policies_in_their_tiers() {
    let g = graph(vec![
        allow_from_slytherin(),
        json!({"apiVersion": "policy.networking.k8s.io/v1alpha1", "kind": "AdminNetworkPolicy",
               "metadata": {"name": "deny-ravenclaw"},
               "spec": {"priority": 10, "subject": {"namespaces": ns("gryffindor")},
                        "ingress": [{"action": "Deny", "from": [{"namespaces": ns("ravenclaw")}],
                                     "ports": [{"portNumber": {"port": 80}}]}]}}),
        json!({"apiVersion": "policy.networking.k8s.io/v1alpha1", "kind": "BaselineAdminNetworkPolicy",
               "metadata": {"name": "default"},
               "spec": {"subject": {"namespaces": {}},
                        "ingress": [{"action": "Deny", "from": [{"namespaces": ns("slytherin")}]}]}}),
    ]);
    let e = ask(&g, "ravenclaw/luna-0", "gryffindor/harry-1", "tcp", 80);
    assert_eq!(
        e.ingress.decided_by,
        DecidedBy::Policy {
            tier: "adminnetworkpolicy".into(),
            policy: "kanp.adminnetworkpolicy.deny-ravenclaw".into(),
            kind: "GlobalNetworkPolicy".into(),
            rule: RuleRef {
                index: 0,
                action: "Deny".into()
            },
        }
    );
    assert_eq!(
        ask(&g, "ravenclaw/luna-0", "gryffindor/harry-1", "tcp", 81).verdict,
        Verdict::Allow
    );
    // The baseline denies slytherin wherever no NetworkPolicy decides.
    assert_eq!(
        ask(&g, "slytherin/draco-0", "gryffindor/harry-0", "tcp", 80).verdict,
        Verdict::Allow
    );
    let e = ask(&g, "slytherin/draco-0", "ravenclaw/luna-0", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Deny);
    assert!(matches!(&e.ingress.decided_by,
        DecidedBy::Policy { tier, policy, .. }
            if tier == "baselineadminnetworkpolicy" && policy == "kbanp.baselineadminnetworkpolicy.default"));
}

#[test]
fn a_tier_resource_overrides_the_built_in_tier() {
    let policy = cnp(
        "allow-slytherin",
        json!({"tier": "Admin", "priority": 10, "subject": {"namespaces": ns("gryffindor")},
               "ingress": [{"action": "Accept", "from": [{"namespaces": ns("slytherin")}]}]}),
    );
    // Built in: kube-admin passes what its policies do not decide.
    let g = graph(vec![policy.clone()]);
    assert_eq!(
        ask(&g, "ravenclaw/luna-0", "gryffindor/harry-0", "tcp", 80).verdict,
        Verdict::Allow
    );
    // A Tier resource of that name replaces it: here, deny by default.
    let tier = json!({"apiVersion": "projectcalico.org/v3", "kind": "Tier",
                      "metadata": {"name": "kube-admin"},
                      "spec": {"order": 1000, "defaultAction": "Deny"}});
    let mut g = graph(vec![policy, tier.clone()]);
    let e = ask(&g, "ravenclaw/luna-0", "gryffindor/harry-0", "tcp", 80);
    assert_eq!(e.verdict, Verdict::Deny);
    // Deleting the resource brings the built-in tier back.
    g.apply(Update::Delete(calc_graph::model::ResourceKey::new(
        calc_graph::model::Kind::Tier,
        None,
        "kube-admin",
    )))
    .unwrap();
    assert_eq!(
        ask(&g, "ravenclaw/luna-0", "gryffindor/harry-0", "tcp", 80).verdict,
        Verdict::Allow
    );
}
