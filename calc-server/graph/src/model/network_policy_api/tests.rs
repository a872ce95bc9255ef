//! Tests of the network-policy-api conversion: each kind, its rules and its refusals.

use serde_json::{Value, json};

use super::*;
use crate::convert::PolicyId;
use crate::manifest::{Outcome, decode_and_validate, decode_and_validate_strict};
use crate::model::{DecodeError, Decoded, Resource, ResourceKey};

fn cnp(name: &str, spec: Value) -> Value {
    json!({"apiVersion": CNP_API_VERSION, "kind": "ClusterNetworkPolicy",
           "metadata": {"name": name}, "spec": spec})
}

fn anp(kind: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": ANP_API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": spec})
}

/// The decoded (not validated) policy spec.
fn spec_of(v: Value) -> PolicySpec {
    match Resource::from_value(v) {
        Ok(Decoded::Resource(_, Resource::Policy(_, _, s))) => s,
        other => panic!("not a policy: {other:?}"),
    }
}

/// The converted spec as the v3 JSON a user would write (for readable comparisons).
fn calico(s: &PolicySpec) -> Value {
    serde_json::to_value(s).unwrap()
}

fn errors(v: Value) -> Vec<String> {
    match decode_and_validate(v) {
        Outcome::Invalid(inv) => inv.errors.iter().map(ToString::to_string).collect(),
        other => panic!("expected invalid, got {other:?}"),
    }
}

#[test]
fn cluster_network_policy_converts_as_calico_does() {
    let s = spec_of(cnp(
        "sensitive-ns",
        json!({
            "tier": "Admin", "priority": 30,
            "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "sensitive"}}},
            "ingress": [{
                "name": "deny-from-others", "action": "Deny",
                "from": [{"namespaces": {}},
                         {"pods": {"namespaceSelector": {"matchLabels": {"team": "a"}},
                                   "podSelector": {"matchLabels": {"app": "x"}}}}],
                "protocols": [{"udp": {"destinationPort": {"number": 53}}},
                              {"tcp": {"destinationPort": {"number": 80}}},
                              {"tcp": {"destinationPort": {"range": {"start": 81, "end": 90}}}}],
            }],
            "egress": [{"action": "Accept", "to": [{"networks": ["10.1.2.3/8", "fd00::1/64"]}]}],
        }),
    ));
    assert!(s.conversion_warnings.is_empty() && s.conversion_errors.is_empty());
    let deny = |protocol: &str, ports: Value, source: Value| {
        json!({"action": "Deny", "protocol": protocol, "source": source,
               "destination": {"ports": ports},
               "metadata": {"annotations": {"name": "deny-from-others"}}})
    };
    let all_ns = json!({"namespaceSelector": "all()"});
    let team_a = json!({"selector": "projectcalico.org/orchestrator == 'k8s' && app == 'x'",
                        "namespaceSelector": "team == 'a'"});
    assert_eq!(
        calico(&s),
        json!({
            "tier": "kube-admin", "order": 30.0,
            "selector": "projectcalico.org/orchestrator == 'k8s'",
            "namespaceSelector": "kubernetes.io/metadata.name == 'sensitive'",
            "types": ["Ingress", "Egress"],
            // One rule per (protocol, peer), protocols sorted, ports merged.
            "ingress": [
                deny("TCP", json!(["80:90"]), all_ns.clone()),
                deny("TCP", json!(["80:90"]), team_a.clone()),
                deny("UDP", json!([53]), all_ns),
                deny("UDP", json!([53]), team_a),
            ],
            "egress": [{"action": "Allow",
                        "destination": {"nets": ["10.0.0.0/8", "fd00::/64"]}}],
        })
    );
}

#[test]
fn subjects_peers_and_tiers() {
    let s = spec_of(cnp(
        "p",
        json!({"tier": "Baseline", "priority": 0,
               "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "db"}}}},
               "egress": [{"action": "Pass", "to": [{"pods": {"podSelector": {}}}]}]}),
    ));
    assert_eq!(s.tier, KUBE_BASELINE_TIER);
    assert_eq!(s.order, Some(0.0));
    assert_eq!(
        s.selector,
        "projectcalico.org/orchestrator == 'k8s' && app == 'db'"
    );
    assert_eq!(s.namespace_selector, "all()");
    assert_eq!(s.types, ["Egress"], "only the direction with rules");
    assert_eq!(
        calico(&s)["egress"],
        json!([{"action": "Pass", "destination": {
            "selector": "projectcalico.org/orchestrator == 'k8s'", "namespaceSelector": "all()"}}])
    );
    // No rules at all: an empty type list in Calico, which Felix reads as both.
    let s = spec_of(cnp(
        "q",
        json!({"tier": "Admin", "priority": 1, "subject": {"namespaces": {}}}),
    ));
    assert_eq!(s.types, ["Ingress", "Egress"]);
}

#[test]
fn unconvertible_rules_fail_closed_with_a_warning_naming_the_rule() {
    let s = spec_of(cnp(
        "p",
        json!({
            "tier": "Admin", "priority": 5, "subject": {"namespaces": {}},
            "ingress": [
                {"name": "named", "action": "Accept", "from": [{"namespaces": {}}],
                 "protocols": [{"destinationNamedPort": "http"}]},
            ],
            "egress": [
                {"name": "to-nodes", "action": "Deny", "to": [{"nodes": {}}]},
                {"action": "Pass", "to": [{"domainNames": ["example.com"]}]},
                {"name": "dns", "action": "Accept", "to": [{"domainNames": ["example.com"]}]},
                {"name": "bad-cidr", "action": "Accept", "to": [{"networks": ["10.0.0.1"]}]},
                {"name": "newer-peer", "action": "Deny", "to": [{"externalThing": {}}]},
                {"name": "ok", "action": "Accept", "to": [{"namespaces": {}}]},
            ],
        }),
    ));
    assert_eq!(
        calico(&s)["egress"],
        json!([{"action": "Deny"}, {"action": "Deny"}, {"action": "Deny"},
               {"action": "Allow", "destination": {"namespaceSelector": "all()"},
                "metadata": {"annotations": {"name": "ok"}}}]),
        "Deny and Pass become a bare Deny, Accept is dropped"
    );
    assert!(s.ingress.is_empty());
    assert_eq!(s.types, ["Egress"], "no ingress rule survived");
    assert_eq!(
        s.conversion_warnings,
        [
            "ingress rule 0 (\"named\") cannot be converted (protocols[0]: named ports are not supported): dropped",
            "egress rule 0 (\"to-nodes\") cannot be converted (to[0]: nodes peers are not supported): replaced by a rule denying all egress traffic",
            "egress rule 1 cannot be converted (to[0]: domainNames peers are not supported): replaced by a rule denying all egress traffic",
            "egress rule 2 (\"dns\") cannot be converted (to[0]: domainNames peers are not supported): dropped",
            "egress rule 3 (\"bad-cidr\") cannot be converted (to[0]: networks: \"10.0.0.1\" is not a CIDR): dropped",
            "egress rule 4 (\"newer-peer\") cannot be converted (to[0]: sets none of the supported peers (namespaces, pods, networks)): replaced by a rule denying all egress traffic",
        ]
    );
    // The object itself is valid: only the rules fail.
    assert!(matches!(
        decode_and_validate(cnp(
            "p",
            json!({"tier": "Admin", "priority": 5, "subject": {"namespaces": {}},
                   "egress": [{"action": "Deny", "to": [{"nodes": {}}]}]})
        )),
        Outcome::Valid(..)
    ));
}

#[test]
fn bad_ports_and_unknown_actions_fail_the_rule() {
    let s = spec_of(cnp(
        "p",
        json!({"tier": "Admin", "priority": 5, "subject": {"namespaces": {}},
        "ingress": [
            {"action": "Deny", "from": [{"namespaces": {}}],
             "protocols": [{"tcp": {"destinationPort": {"range": {"start": 90, "end": 80}}}}]},
            {"action": "Allow", "from": [{"namespaces": {}}]},
            {"action": "Pass", "from": [{"namespaces": {}}], "protocols": [{"icmp": {}}]},
            {"action": "Accept", "from": [{"namespaces": {}}],
             "protocols": [{"sctp": {}}, {"tcp": {"destinationPort": {"number": 70000}}}]},
        ]}),
    ));
    assert_eq!(
        calico(&s)["ingress"],
        json!([{"action": "Deny"}, {"action": "Deny"}])
    );
    assert!(s.conversion_warnings[1].contains("unsupported action \"Allow\""));
    assert!(s.conversion_warnings[2].contains("protocols[0] sets none of tcp, udp, sctp"));
    assert!(s.conversion_warnings[3].contains("port 70000 is outside 1–65535"));
}

#[test]
fn what_the_api_forbids_makes_the_object_invalid() {
    let rule = json!({"action": "Deny", "from": [{"namespaces": {}}]});
    let mut e = errors(cnp(
        "p",
        json!({"priority": 1001,
               "subject": {"namespaces": {}, "pods": {"podSelector": {}}},
               "ingress": vec![rule.clone(); 26],
               "egress": [{"name": "x".repeat(101), "action": "Deny",
                           "to": std::iter::once(json!({"networks": vec!["10.0.0.0/8"; 26]}))
                               .chain(vec![json!({"namespaces": {}}); 25])
                               .collect::<Vec<_>>()}]}),
    ));
    e.sort();
    assert_eq!(
        e,
        [
            "spec.egress[0].name: a rule name may have at most 100 characters",
            "spec.egress[0].to: 26 peers; a rule may have at most 25",
            "spec.egress[0].to[0].networks: 26 networks; a peer may have at most 25",
            "spec.ingress: 26 rules; a ClusterNetworkPolicy may have at most 25 ingress rules",
            "spec.priority: priority 1001 is outside 0–1000",
            "spec.subject: exactly one of subject.namespaces and subject.pods must be set",
            "spec.tier: tier is required (Admin or Baseline)",
        ]
    );
    let e = errors(cnp(
        "p",
        json!({"tier": "Developer", "subject": {"namespaces": {}}, "ingress": [rule]}),
    ));
    assert_eq!(
        e,
        [
            "spec.tier: tier must be Admin or Baseline, not \"Developer\"",
            "spec.priority: priority is required",
        ]
    );
    // The older API allows 100 rules.
    assert!(matches!(
        decode_and_validate(anp(
            "AdminNetworkPolicy",
            "a",
            json!({"priority": 1, "subject": {"namespaces": {}},
                   "ingress": vec![json!({"action": "Deny", "from": [{"namespaces": {}}]}); 100]})
        )),
        Outcome::Valid(..)
    ));
    let e = errors(anp(
        "AdminNetworkPolicy",
        "a",
        json!({"priority": 1, "subject": {"namespaces": {}},
               "egress": vec![json!({"action": "Deny", "to": [{"namespaces": {}}]}); 101]}),
    ));
    assert_eq!(
        e,
        ["spec.egress: 101 rules; a AdminNetworkPolicy may have at most 100 egress rules"]
    );
}

#[test]
fn admin_network_policy_as_calico_3_29_converted_it() {
    let v = anp(
        "AdminNetworkPolicy",
        "cluster-control",
        json!({
            "priority": 100,
            "subject": {"pods": {"namespaceSelector": {"matchLabels": {"env": "prod"}},
                                 "podSelector": {"matchExpressions": [
                                     {"key": "app", "operator": "In", "values": ["a", "b"]}]}}},
            "ingress": [{"name": "allow-monitoring", "action": "Allow",
                         "from": [{"namespaces": {"matchLabels": {"team": "mon"}}}],
                         "ports": [{"portNumber": {"port": 9090}},
                                   {"portRange": {"protocol": "UDP", "start": 1000, "end": 2000}},
                                   {"portNumber": {"protocol": "TCP", "port": 9091}}]},
                        {"name": "pass-the-rest", "action": "Pass", "from": [{"namespaces": {}}]},
                        {"name": "named", "action": "Deny", "from": [{"namespaces": {}}],
                         "ports": [{"namedPort": "http"}]}],
            "egress": [{"action": "Deny", "to": [{"networks": ["192.168.0.0/16"]}]}],
        }),
    );
    let (key, res) = match Resource::from_value(v).unwrap() {
        Decoded::Resource(k, r) => (k, r),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        key,
        ResourceKey::new(Kind::AdminNetworkPolicy, None, "cluster-control")
    );
    let Resource::Policy(_, _, s) = res else {
        panic!()
    };
    assert_eq!(
        calico(&s),
        json!({
            "tier": "adminnetworkpolicy", "order": 100.0,
            "selector": "projectcalico.org/orchestrator == 'k8s' && app in { 'a', 'b' }",
            "namespaceSelector": "env == 'prod'",
            "types": ["Ingress", "Egress"],
            "ingress": [
                {"action": "Allow", "protocol": "TCP", "source": {"namespaceSelector": "team == 'mon'"},
                 "destination": {"ports": ["9090:9091"]},
                 "metadata": {"annotations": {"name": "allow-monitoring"}}},
                {"action": "Allow", "protocol": "UDP", "source": {"namespaceSelector": "team == 'mon'"},
                 "destination": {"ports": ["1000:2000"]},
                 "metadata": {"annotations": {"name": "allow-monitoring"}}},
                {"action": "Pass", "source": {"namespaceSelector": "all()"},
                 "metadata": {"annotations": {"name": "pass-the-rest"}}},
                // Calico 3.29 matched every port for a named port; we fail closed.
                {"action": "Deny"},
            ],
            "egress": [{"action": "Deny", "destination": {"nets": ["192.168.0.0/16"]}}],
        })
    );
    assert_eq!(s.conversion_warnings.len(), 1);
    assert_eq!(
        PolicyId::from_key(&key),
        PolicyId {
            name: "kanp.adminnetworkpolicy.cluster-control".into(),
            namespace: String::new(),
            kind: "GlobalNetworkPolicy".into()
        }
    );
}

#[test]
fn baseline_admin_network_policy() {
    let s = spec_of(anp(
        "BaselineAdminNetworkPolicy",
        "default",
        json!({"subject": {"namespaces": {}},
               "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]},
                           {"action": "Pass", "from": [{"namespaces": {}}],
                            "ports": [{"portNumber": {"port": 80}}]},
                           {"action": "Allow", "from": [{"namespaces": {}}]}]}),
    ));
    assert_eq!((s.tier.as_str(), s.order), (BANP_TIER, Some(BANP_ORDER)));
    assert_eq!(s.types, ["Ingress"]);
    // Baseline rules allow or deny; a Pass fails closed.
    let actions: Vec<&str> = s.ingress.iter().map(|r| r.action.as_str()).collect();
    assert_eq!(actions, ["Deny", "Deny", "Allow"]);
    assert!(s.ingress[1].source.is_empty(), "the bare fail-closed Deny");
}

#[test]
fn policy_ids_follow_calico_and_read_back() {
    for (kind, name, id_name, id_kind) in [
        (
            Kind::ClusterNetworkPolicy,
            "p",
            "p",
            "KubernetesClusterNetworkPolicy",
        ),
        (
            Kind::AdminNetworkPolicy,
            "a.b",
            "kanp.adminnetworkpolicy.a.b",
            "GlobalNetworkPolicy",
        ),
        (
            Kind::BaselineAdminNetworkPolicy,
            "default",
            "kbanp.baselineadminnetworkpolicy.default",
            "GlobalNetworkPolicy",
        ),
        (Kind::GlobalNetworkPolicy, "g", "g", "GlobalNetworkPolicy"),
    ] {
        let key = ResourceKey::new(kind, None, name);
        let id = PolicyId::from_key(&key);
        assert_eq!((id.name.as_str(), id.kind.as_str()), (id_name, id_kind));
        assert_eq!(id.to_key(), Some(key));
    }
    let key = ResourceKey::new(Kind::StagedKubernetesNetworkPolicy, Some("ns"), "s");
    assert_eq!(PolicyId::from_key(&key).to_key(), Some(key));
    let key = ResourceKey::new(Kind::NetworkPolicy, Some("ns"), "knp.default.x");
    assert_eq!(PolicyId::from_key(&key).to_key(), Some(key));
}

#[test]
fn each_kind_has_its_api_version() {
    for (api, kind) in [
        ("projectcalico.org/v3", "ClusterNetworkPolicy"),
        (ANP_API_VERSION, "ClusterNetworkPolicy"),
        (CNP_API_VERSION, "AdminNetworkPolicy"),
        (CNP_API_VERSION, "GlobalNetworkPolicy"),
    ] {
        let err = Resource::from_value(json!({"apiVersion": api, "kind": kind,
                                              "metadata": {"name": "x"}, "spec": {}}))
        .unwrap_err();
        assert!(matches!(err, DecodeError::ApiVersion { .. }), "{err}");
    }
    assert_eq!(
        Resource::from_value(
            json!({"apiVersion": CNP_API_VERSION, "kind": "ClusterNetworkPolicy",
                                    "metadata": {"name": "x"}, "spec": {}})
        )
        .map(|_| ())
        .err(),
        None
    );
    assert_eq!(
        Resource::from_value(
            json!({"apiVersion": "projectcalico.org/v3", "kind": "AdminNetworkPolicy",
                                    "metadata": {"name": "x"}})
        )
        .unwrap_err()
        .to_string(),
        "unsupported apiVersion \"projectcalico.org/v3\" (expected policy.networking.k8s.io/v1alpha1)"
    );
    assert_eq!(
        Resource::from_value(json!({"apiVersion": ANP_API_VERSION, "kind": "BGPPeer",
                                    "metadata": {"name": "x"}})),
        Err(DecodeError::ApiVersion {
            found: ANP_API_VERSION.into(),
            expected: crate::model::API_VERSION
        })
    );
}

#[test]
fn the_converted_form_round_trips_and_manifests_cannot_use_it() {
    for v in [
        cnp(
            "p",
            json!({"tier": "Admin", "priority": 3, "subject": {"namespaces": {}},
                   "egress": [{"name": "n", "action": "Pass", "to": [{"nodes": {}}]},
                              {"action": "Accept", "to": [{"networks": ["10.0.0.0/8"]}],
                               "protocols": [{"udp": {"destinationPort": {"number": 53}}}]}]}),
        ),
        anp(
            "AdminNetworkPolicy",
            "a",
            json!({"priority": 3, "subject": {"namespaces": {}}}),
        ),
        anp(
            "BaselineAdminNetworkPolicy",
            "default",
            json!({"subject": {"namespaces": {}},
                   "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]}),
        ),
    ] {
        let Outcome::Valid(key, valid) = decode_and_validate_strict(v) else {
            panic!("valid")
        };
        let res = valid.into_resource();
        let written = res.to_value();
        let Outcome::Valid(again_key, again) = decode_and_validate(written.clone()) else {
            panic!("the last-good store reads back what it wrote: {written}")
        };
        let mut first = res.clone();
        let mut second = again.into_resource();
        // Warnings are reported when the object is read, not stored.
        for r in [&mut first, &mut second] {
            if let Resource::Policy(_, _, s) = r {
                s.conversion_warnings.clear();
            }
        }
        assert_eq!((again_key, second), (key, first));
        let Outcome::Invalid(inv) = decode_and_validate_strict(written) else {
            panic!("a manifest in the converted form is refused")
        };
        assert!(
            inv.errors.iter().any(|e| e.field == "spec.selector"),
            "{inv}"
        );
    }
}

#[test]
fn manifests_name_typos_but_accept_every_field_of_the_api() {
    let Outcome::Invalid(inv) = decode_and_validate_strict(cnp(
        "p",
        json!({"tier": "Admin", "priority": 1, "subjct": {"namespaces": {}},
               "ingress": [{"action": "Deny", "form": [{"namespaces": {}}]}]}),
    )) else {
        panic!("typos refused")
    };
    let mut got: Vec<String> = inv.errors.iter().map(ToString::to_string).collect();
    got.sort();
    assert!(
        got.contains(&"spec.subjct: unknown field (did you mean \"subject\"?)".to_string())
            && got.contains(&"spec.ingress[0].form: unknown field".to_string()),
        "{got:?}"
    );
    let full = cnp(
        "p",
        json!({"tier": "Admin", "priority": 1,
               "subject": {"pods": {"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                                    "podSelector": {"matchLabels": {"b": "c"}}}},
               "ingress": [{"name": "i", "action": "Accept", "from": [{"namespaces": {}}, {"pods": {"podSelector": {}}}],
                            "protocols": [{"tcp": {"destinationPort": {"number": 1}}},
                                          {"udp": {"destinationPort": {"range": {"start": 1, "end": 2}}}},
                                          {"sctp": {}}, {"destinationNamedPort": "x"}]}],
               "egress": [{"name": "e", "action": "Deny",
                           "to": [{"nodes": {}}, {"networks": ["10.0.0.0/8"]}, {"domainNames": ["a.b"]}]}]}),
    );
    assert!(crate::model::fields::unknown_fields(&full).is_empty());
    let full = anp(
        "AdminNetworkPolicy",
        "a",
        json!({"priority": 1, "subject": {"namespaces": {}},
               "ingress": [{"name": "i", "action": "Allow", "from": [{"namespaces": {}}],
                            "ports": [{"portNumber": {"protocol": "TCP", "port": 1}},
                                      {"portRange": {"protocol": "UDP", "start": 1, "end": 2}},
                                      {"namedPort": "x"}]}],
               "egress": [{"action": "Deny", "to": [{"pods": {"namespaceSelector": {}, "podSelector": {}}}]}]}),
    );
    assert!(crate::model::fields::unknown_fields(&full).is_empty());
}

#[test]
fn label_selectors_cannot_smuggle_selector_syntax() {
    // A label value that would widen the selector: the rule fails closed (a Deny stays a
    // bare Deny), with a warning.
    let s = spec_of(cnp(
        "p",
        json!({"tier": "Admin", "priority": 1, "subject": {"namespaces": {}},
               "ingress": [{"name": "sneaky", "action": "Deny", "from": [{"namespaces": {
                   "matchLabels": {"team": "x' || all() || a == 'y"}}}]},
                          {"name": "sneaky-accept", "action": "Accept", "from": [{"pods": {
                   "namespaceSelector": {}, "podSelector": {"matchExpressions": [
                       {"key": "a) || all() || has(b", "operator": "Exists"}]}}}]}]}),
    ));
    assert_eq!(calico(&s)["ingress"], json!([{"action": "Deny"}]));
    assert_eq!(
        s.conversion_warnings.len(),
        2,
        "{:?}",
        s.conversion_warnings
    );
    assert!(
        s.conversion_warnings[0].contains("not a Kubernetes label value"),
        "{:?}",
        s.conversion_warnings
    );
    // In the subject, the object is invalid, naming the field.
    let errs = errors(cnp(
        "p",
        json!({"tier": "Admin", "priority": 1,
               "subject": {"namespaces": {"matchLabels": {"env": "prod' || all() || a == 'b"}}}}),
    ));
    assert!(
        errs.iter()
            .any(|e| e.starts_with("spec.subject:") && e.contains("label value")),
        "{errs:?}"
    );
    // Ordinary keys and values still convert.
    let s = spec_of(cnp(
        "p",
        json!({"tier": "Admin", "priority": 1,
               "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "prod-1.a_b"}}}}),
    ));
    assert_eq!(
        s.namespace_selector,
        "kubernetes.io/metadata.name == 'prod-1.a_b'"
    );
}
