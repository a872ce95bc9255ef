//! Regression tests for graph and conversion bugs found in review: host endpoint addresses in
//! canonical form, numeric named-port protocols, and service matches that must never widen a
//! rule to "anywhere".

use std::collections::BTreeSet;

use calc_graph::graph::{CalcGraph, Update};
use calc_graph::model::{Decoded, Resource};
use calc_graph::stream_model::StreamModel;
use felix_proto as pb;
use serde_json::{Value, json};

fn decode(v: Value) -> Resource {
    match Resource::from_value(v.clone()) {
        Ok(Decoded::Resource(_, r)) => r,
        other => panic!("does not decode: {other:?}\n{v}"),
    }
}

fn apply(g: &mut CalcGraph, v: Value) {
    g.apply(Update::Apply(decode(v))).expect("accepted");
}

/// Flushes and feeds `node`'s batch to `model`, checking the stream contract.
fn flush_into(g: &mut CalcGraph, node: &str, model: &mut StreamModel) {
    for b in g.flush() {
        if b.node == node {
            for m in &b.messages {
                model.apply(m).expect("stream contract");
            }
        }
    }
}

fn wep(name: &str, ns: &str, node: &str, ip: &str, labels: Value, ports: Value) -> Value {
    json!({
        "apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"node": node, "orchestrator": "k8s", "endpoint": "eth0",
                 "interfaceName": "cali0", "ipNetworks": [ip], "ports": ports}
    })
}

fn all_members(model: &StreamModel) -> BTreeSet<String> {
    model
        .ipsets
        .values()
        .flat_map(|(_, m)| m.iter().cloned())
        .collect()
}

/// convert.rs:509-520 (convert_host_endpoint): expectedIPs are used verbatim, not canonicalised.
/// "FD00::1" (valid: it parses as an IpAddr) becomes the member "FD00::1/128", while a workload
/// with the same address contributes "fd00::1/128": one address, two members, and the
/// member ref-count (graph/indexes.rs member_change) no longer dedupes them. Felix stores HEP
/// addresses as parsed IPs (ip.FromNetIP(addr).AsCIDR()), i.e. canonical text.
#[test]
fn host_endpoint_expected_ips_are_canonicalised() {
    let mut g = CalcGraph::new();
    g.subscribe("node-1");
    apply(
        &mut g,
        json!({"apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
               "metadata": {"name": "p"},
               "spec": {"selector": "all()", "types": ["Ingress"],
                        "ingress": [{"action": "Allow", "source": {"selector": "role == 'x'"}}]}}),
    );
    apply(
        &mut g,
        json!({"apiVersion": "projectcalico.org/v3", "kind": "HostEndpoint",
               "metadata": {"name": "hep", "labels": {"role": "x"}},
               "spec": {"node": "node-1", "interfaceName": "eth0", "expectedIPs": ["FD00::1"]}}),
    );
    apply(
        &mut g,
        wep(
            "node--1-k8s-pod-eth0",
            "default",
            "node-1",
            "fd00::1/128",
            json!({"role": "x"}),
            json!([]),
        ),
    );
    g.apply(Update::InSync).unwrap();
    let mut model = StreamModel::default();
    flush_into(&mut g, "node-1", &mut model);
    assert_eq!(
        all_members(&model),
        BTreeSet::from(["fd00::1/128".to_string()]),
        "one address must be one (canonical) member"
    );
}

/// convert.rs:415-428 (named_ports): an endpoint port whose protocol is numeric (17, which the
/// validator accepts: supports_ports() is true for 6/17/132/136) is silently dropped because
/// `lowercase_name()` is None for numbers. Felix's named-port index matches numeric protocols
/// (IPSetPortProtocol.MatchesModelProtocol compares NumVal), so the member is missing here and
/// a rule allowing `dns` never allows anything.
#[test]
fn numeric_endpoint_port_protocol_feeds_named_port_sets() {
    let mut g = CalcGraph::new();
    g.subscribe("node-1");
    apply(
        &mut g,
        json!({"apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
               "metadata": {"name": "p"},
               "spec": {"selector": "all()", "types": ["Egress"],
                        "egress": [{"action": "Allow", "protocol": "UDP",
                                    "destination": {"ports": ["dns"]}}]}}),
    );
    apply(
        &mut g,
        wep(
            "node--1-k8s-dns-eth0",
            "default",
            "node-1",
            "10.0.0.53/32",
            json!({"app": "dns"}),
            json!([{"name": "dns", "protocol": 17, "port": 53}]),
        ),
    );
    g.apply(Update::InSync).unwrap();
    let mut model = StreamModel::default();
    flush_into(&mut g, "node-1", &mut model);
    assert!(
        all_members(&model).contains("10.0.0.53,udp:53"),
        "named port with protocol 17 must be a member; sets: {:?}",
        model.ipsets
    );
}

/// convert.rs:298-302 / rule_scanner.rs:270-277: a `destination.services` match (accepted by
/// validate.rs) is only copied into the `original_dst_service*` fields; no IP set is made, so
/// the proto rule has no destination constraint at all and an egress Allow "to service X"
/// allows egress to EVERY destination. Felix adds a service IP_AND_PORT set
/// (DstIPPortSetIDs) that is empty when the service is unknown, i.e. the rule matches nothing.
#[test]
fn service_match_does_not_widen_to_allow_all() {
    let mut g = CalcGraph::new();
    g.subscribe("node-1");
    apply(
        &mut g,
        json!({"apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
               "metadata": {"name": "to-svc", "namespace": "default"},
               "spec": {"selector": "all()", "types": ["Egress"],
                        "egress": [{"action": "Allow",
                                    "destination": {"services": {"name": "db", "namespace": "default"}}}]}}),
    );
    apply(
        &mut g,
        wep(
            "node--1-k8s-pod-eth0",
            "default",
            "node-1",
            "10.0.0.1/32",
            json!({}),
            json!([]),
        ),
    );
    g.apply(Update::InSync).unwrap();
    let mut model = StreamModel::default();
    flush_into(&mut g, "node-1", &mut model);
    let pol = model.policies.values().next().expect("policy sent");
    let r: &pb::Rule = &pol.outbound_rules[0];
    let constrained = !r.dst_ip_set_ids.is_empty()
        || !r.dst_ip_port_set_ids.is_empty()
        || !r.dst_named_port_ip_set_ids.is_empty()
        || !r.dst_net.is_empty()
        || !r.dst_ports.is_empty();
    assert!(
        constrained,
        "an Allow to a service must not become an Allow to anywhere: {r:?}"
    );
}

/// Validation runs once on the way in, and the graph still refuses every invalid object: a
/// plain resource is validated by the graph, and the only way past that check, a `Valid`,
/// cannot be made from an invalid resource.
#[test]
fn invalid_objects_are_refused_whichever_way_they_come() {
    let policy = |selector: &str| {
        decode(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "p"}, "spec": {"selector": selector}
        }))
    };
    let (good, bad) = (policy("all()"), policy("a ="));
    assert!(calc_graph::model::Valid::check(bad.clone()).is_err());
    let valid = calc_graph::model::Valid::check(good).expect("valid");
    let mut g = CalcGraph::new();
    g.apply(Update::ApplyValid(valid)).expect("accepted");
    let rejection = g.apply(Update::Apply(bad)).expect_err("refused");
    let calc_graph::graph::Rejection::Invalid(invalid) = &rejection else {
        panic!("refused by validation: {rejection:?}");
    };
    assert_eq!(invalid.key.to_string(), "GlobalNetworkPolicy p");
    assert_eq!(invalid.errors[0].field, "spec.selector", "{rejection}");
}
