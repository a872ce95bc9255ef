//! Conversion tests, one group per kind. Expected values come from Calico's conversion code
//! and its documented examples (libcalico-go's conversion and names).

use super::*;
use calc_graph::model::rule::Port;
use calc_graph::model::{ObjectMeta, PolicySpec, Resource, ResourceKey};

fn conv() -> Converter {
    Converter::default()
}

fn applied(source: Source, v: Value) -> Resource {
    match conv().convert(source, v.clone()) {
        Decision::Apply { resource, warnings } => {
            assert!(warnings.is_empty(), "{warnings:?}");
            resource.into_resource()
        }
        other => panic!("{source} {v}: expected Apply, got {other:?}"),
    }
}

fn applied_with_warnings(source: Source, v: Value) -> (Resource, Vec<String>) {
    match conv().convert(source, v) {
        Decision::Apply { resource, warnings } => (resource.into_resource(), warnings),
        other => panic!("expected Apply, got {other:?}"),
    }
}

fn skipped(source: Source, v: Value) {
    match conv().convert(source, v.clone()) {
        Decision::Skip => {}
        other => panic!("{v}: expected Skip, got {other:?}"),
    }
}

fn rejected(source: Source, v: Value) -> String {
    match conv().convert(source, v) {
        Decision::Reject(r) => r.to_string(),
        other => panic!("expected Reject, got {other:?}"),
    }
}

fn pod(extra_meta: Value, spec: Value, status: Value) -> Value {
    let mut meta = json!({"name": "nginx-5d8f", "namespace": "default", "uid": "u", "resourceVersion": "7",
                          "labels": {"app": "nginx"}});
    for (k, v) in extra_meta.as_object().unwrap() {
        meta[k] = v.clone();
    }
    let mut s = json!({"nodeName": "node1", "serviceAccountName": "default",
                       "containers": [{"name": "web", "image": "nginx"}]});
    for (k, v) in spec.as_object().unwrap() {
        s[k] = v.clone();
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": s, "status": status})
}

fn running(ip: &str) -> Value {
    json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]})
}

fn wep(r: &Resource) -> (&ObjectMeta, &calc_graph::model::WorkloadEndpointSpec) {
    match r {
        Resource::WorkloadEndpoint(m, s) => (m, s),
        other => panic!("not a workload endpoint: {other:?}"),
    }
}

#[test]
fn interface_names_are_calicos_veth_names() {
    // Calico names pod nginx-5d8f in default calia37792c9b43 (libcalico-go's interface name).
    assert_eq!(
        conv().interface_name("default", "nginx-5d8f"),
        "calia37792c9b43"
    );
    let eni = Converter {
        interface_prefix: "eni".into(),
    };
    assert_eq!(
        eni.interface_name("default", "nginx-5d8f"),
        "enia37792c9b43"
    );
}

#[test]
fn a_pod_becomes_the_workload_endpoint_calico_stores() {
    let r = applied(
        Source::Pod,
        pod(
            json!({"annotations": {"cni.projectcalico.org/containerID": "4a1b"}}),
            json!({"containers": [
                {"name": "web", "ports": [
                    {"name": "http", "containerPort": 80},
                    {"containerPort": 8443, "hostPort": 443, "protocol": "TCP", "hostIP": "10.0.0.1"},
                    {"containerPort": 9000},
                    {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                    {"name": "weird", "containerPort": 7, "protocol": "QUIC"}
                ]}],
                "initContainers": [{"name": "init", "ports": [{"name": "metrics", "containerPort": 9100, "protocol": "SCTP"}]}]}),
            running("10.65.0.5"),
        ),
    );
    // The same object calicoctl shows for this pod (as libcalico-go converts it), through the same
    // decoding the etcd adapter uses.
    let stored = crate::etcd::decode::decode(
        "/calico/resources/v3/projectcalico.org/workloadendpoints/default/node1-k8s-nginx--5d8f-eth0",
        br#"{"kind":"WorkloadEndpoint","apiVersion":"projectcalico.org/v3","metadata":{"name":"node1-k8s-nginx--5d8f-eth0","namespace":"default","labels":{"app":"nginx","projectcalico.org/namespace":"default","projectcalico.org/orchestrator":"k8s","projectcalico.org/serviceaccount":"default"}},"spec":{"orchestrator":"k8s","node":"node1","containerID":"4a1b","pod":"nginx-5d8f","endpoint":"eth0","serviceAccountName":"default","ipNetworks":["10.65.0.5/32"],"profiles":["kns.default","ksa.default.default"],"interfaceName":"calia37792c9b43"}}"#,
    );
    let Decision::Apply { resource, .. } = stored else {
        panic!("the reference example decodes")
    };
    let Resource::WorkloadEndpoint(stored_meta, stored_spec) = resource.into_resource() else {
        panic!("the reference example is a workload endpoint")
    };
    let (meta, spec) = wep(&r);
    assert_eq!(
        r.key(),
        ResourceKey::new(
            Kind::WorkloadEndpoint,
            Some("default"),
            "node1-k8s-nginx--5d8f-eth0"
        )
    );
    assert_eq!(meta, &stored_meta);
    let mut without_ports = spec.clone();
    without_ports.ports.clear();
    assert_eq!(without_ports, stored_spec);
    // Named ports and host ports, TCP by default, unknown protocols and plain ports left out.
    let ports: Vec<(String, String, i64, Option<i64>)> = spec
        .ports
        .iter()
        .map(|p| {
            (
                p.name.clone(),
                p.protocol
                    .as_ref()
                    .map(|p| p.to_string())
                    .unwrap_or_default(),
                p.port,
                p.host_port,
            )
        })
        .collect();
    assert_eq!(
        ports,
        [
            ("http".into(), "TCP".into(), 80, None),
            (String::new(), "TCP".into(), 8443, Some(443)),
            ("dns".into(), "UDP".into(), 53, None),
            ("metrics".into(), "SCTP".into(), 9100, None),
        ]
    );
    assert_eq!(spec.ports[1].host_ip.as_deref(), Some("10.0.0.1"));
}

#[test]
fn a_pods_generate_name_is_kept_for_flow_logs() {
    let r = applied(
        Source::Pod,
        pod(
            json!({"name": "nginx-5d8f-x7k2q", "generateName": "nginx-5d8f-"}),
            json!({}),
            running("10.65.0.6"),
        ),
    );
    assert_eq!(wep(&r).0.generate_name.as_deref(), Some("nginx-5d8f-"));
    let r = applied(Source::Pod, pod(json!({}), json!({}), running("10.65.0.7")));
    assert_eq!(wep(&r).0.generate_name, None);
}

#[test]
fn pod_ips_come_from_status_then_annotations() {
    let dual = applied(
        Source::Pod,
        pod(
            json!({}),
            json!({}),
            json!({"phase": "Running", "podIP": "10.0.0.9",
            "podIPs": [{"ip": "10.0.0.9"}, {"ip": "fd00::9"}]}),
        ),
    );
    assert_eq!(wep(&dual).1.ip_networks, ["10.0.0.9/32", "fd00::9/128"]);
    let annotated = applied(
        Source::Pod,
        pod(
            json!({"annotations": {"cni.projectcalico.org/podIPs": "10.0.0.7,fd00::7"}}),
            json!({}),
            json!({"phase": "Pending"}),
        ),
    );
    assert_eq!(
        wep(&annotated).1.ip_networks,
        ["10.0.0.7/32", "fd00::7/128"]
    );
    let aws = applied(
        Source::Pod,
        pod(
            json!({"annotations": {"vpc.amazonaws.com/pod-ips": "10.1.0.7"}}),
            json!({}),
            json!({}),
        ),
    );
    assert_eq!(wep(&aws).1.ip_networks, ["10.1.0.7/32"]);
    let r = rejected(
        Source::Pod,
        pod(json!({}), json!({}), json!({"podIP": "10.0.0.300"})),
    );
    assert!(r.contains("10.0.0.300"), "{r}");
}

#[test]
fn pods_that_are_not_endpoints_are_skipped() {
    // Host network, not scheduled, no IP yet.
    skipped(
        Source::Pod,
        pod(json!({}), json!({"hostNetwork": true}), running("10.0.0.2")),
    );
    skipped(
        Source::Pod,
        pod(
            json!({}),
            json!({"nodeName": null}),
            json!({"phase": "Pending"}),
        ),
    );
    skipped(
        Source::Pod,
        pod(json!({}), json!({}), json!({"phase": "Pending"})),
    );
    // Finished pods no longer own their IPs.
    for phase in ["Succeeded", "Failed", "Completed"] {
        skipped(
            Source::Pod,
            pod(
                json!({}),
                json!({}),
                json!({"phase": phase, "podIP": "10.0.0.2"}),
            ),
        );
    }
    // Being deleted: an endpoint until the CNI plugin blanks its IP annotation.
    let deleting = |annotations: Value| {
        pod(
            json!({"deletionTimestamp": "2025-06-01T12:00:00Z", "annotations": annotations}),
            json!({}),
            running("10.0.0.2"),
        )
    };
    applied(
        Source::Pod,
        deleting(json!({"cni.projectcalico.org/podIP": "10.0.0.2/32"})),
    );
    skipped(
        Source::Pod,
        deleting(json!({"cni.projectcalico.org/podIP": ""})),
    );
    skipped(
        Source::Pod,
        deleting(json!({"vpc.amazonaws.com/pod-ips": ""})),
    );
}

#[test]
fn pod_labels_profiles_and_annotations() {
    let r = applied(
        Source::Pod,
        pod(
            json!({"namespace": "shop", "name": "cart-0", "labels": {"app": "cart", "projectcalico.org/namespace": "evil"},
                   "annotations": {"cni.projectcalico.org/floatingIPs": "[\"192.0.2.10\", \"2001:db8::1\"]",
                                   "cni.projectcalico.org/allowedSourcePrefixes": "[\"10.9.0.1/16\"]"}}),
            json!({"serviceAccountName": "cart-sa", "nodeName": "worker-1"}),
            running("10.0.0.3"),
        ),
    );
    let (meta, spec) = wep(&r);
    assert_eq!(meta.name, "worker--1-k8s-cart--0-eth0");
    assert_eq!(meta.labels["projectcalico.org/namespace"], "shop");
    assert_eq!(meta.labels["projectcalico.org/orchestrator"], "k8s");
    assert_eq!(meta.labels["projectcalico.org/serviceaccount"], "cart-sa");
    assert_eq!(spec.profiles, ["kns.shop", "ksa.shop.cart-sa"]);
    // Only the floating IP of a family the pod has is NATed.
    assert_eq!(spec.ip_nats.len(), 1);
    assert_eq!(spec.ip_nats[0].external_ip, "192.0.2.10");
    assert_eq!(spec.ip_nats[0].internal_ip, "10.0.0.3");
    assert_eq!(spec.allow_spoofed_source_prefixes, ["10.9.0.0/16"]);
    // No service account: no ksa. profile, no label.
    let r = applied(
        Source::Pod,
        pod(
            json!({}),
            json!({"serviceAccountName": null}),
            running("10.0.0.4"),
        ),
    );
    assert_eq!(wep(&r).1.profiles, ["kns.default"]);
    assert!(
        !wep(&r)
            .0
            .labels
            .contains_key("projectcalico.org/serviceaccount")
    );
    let bad = rejected(
        Source::Pod,
        pod(
            json!({"annotations": {"cni.projectcalico.org/floatingIPs": "not json"}}),
            json!({}),
            running("10.0.0.4"),
        ),
    );
    assert!(bad.contains("floatingIPs"), "{bad}");
}

#[test]
fn namespaces_and_service_accounts_become_profiles() {
    let r = applied(
        Source::Namespace,
        json!({"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": "shop", "labels": {"kubernetes.io/metadata.name": "shop", "team": "a"}}}),
    );
    let Resource::Profile(m, s) = &r else {
        panic!()
    };
    assert_eq!(m.name, "kns.shop");
    assert_eq!(s.ingress.len(), 1);
    assert_eq!(s.ingress[0].action, "Allow");
    assert_eq!(s.egress.len(), 1);
    assert_eq!(s.egress[0].action, "Allow");
    assert_eq!(
        s.labels_to_apply,
        BTreeMap::from([
            (
                "pcns.kubernetes.io/metadata.name".to_string(),
                "shop".to_string()
            ),
            (
                "pcns.projectcalico.org/name".to_string(),
                "shop".to_string()
            ),
            ("pcns.team".to_string(), "a".to_string()),
        ])
    );
    let r = applied(
        Source::ServiceAccount,
        json!({"metadata": {"name": "cart-sa", "namespace": "shop", "labels": {"role": "db"}}}),
    );
    let Resource::Profile(m, s) = &r else {
        panic!()
    };
    assert_eq!(m.name, "ksa.shop.cart-sa");
    assert!(s.ingress.is_empty() && s.egress.is_empty());
    assert_eq!(
        s.labels_to_apply,
        BTreeMap::from([
            (
                "pcsa.projectcalico.org/name".to_string(),
                "cart-sa".to_string()
            ),
            ("pcsa.role".to_string(), "db".to_string()),
        ])
    );
}

#[test]
fn nodes_carry_calicos_bgp_annotations_and_labels() {
    let r = applied(
        Source::Node,
        json!({"metadata": {"name": "node1", "labels": {"zone": "a"},
            "annotations": {"projectcalico.org/IPv4Address": "10.0.0.11/24",
                            "projectcalico.org/IPv6Address": "not-an-ip",
                            "projectcalico.org/ASNumber": "64512",
                            "projectcalico.org/labels": "{\"rack\": \"r1\", \"zone\": \"calico\"}"}},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.11"},
                                     {"type": "Hostname", "address": "node1"}]}}),
    );
    let Resource::Node(m, s) = &r else { panic!() };
    assert_eq!(m.name, "node1");
    assert_eq!(m.labels["zone"], "a", "Kubernetes labels win");
    assert_eq!(m.labels["rack"], "r1");
    let bgp = s.bgp.as_ref().unwrap();
    assert_eq!(bgp.ipv4_address, "10.0.0.11/24");
    assert_eq!(bgp.ipv6_address, "", "an invalid annotation is ignored");
    assert_eq!(bgp.as_number, Some(json!(64512)));
    let addrs: Vec<&str> = s.addresses.iter().map(|a| a.address.as_str()).collect();
    assert_eq!(addrs, ["10.0.0.11/24", "10.0.0.11"]);
    // A node Calico has not annotated: no BGP spec.
    let r = applied(Source::Node, json!({"metadata": {"name": "node2"}}));
    let Resource::Node(_, s) = &r else { panic!() };
    assert!(s.bgp.is_none());
    assert_eq!(parse_as_number("1.10"), Some(65546));
}

fn policy(v: Value) -> (ResourceKey, PolicySpec) {
    match applied(Source::KubernetesNetworkPolicy, v) {
        r @ Resource::Policy(Kind::NetworkPolicy, ..) => {
            let k = r.key();
            let Resource::Policy(Kind::NetworkPolicy, _, s) = r else {
                unreachable!()
            };
            (k, s)
        }
        other => panic!("{other:?}"),
    }
}

fn knp(name: &str, ns: &str, spec: Value) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"name": name, "namespace": ns, "resourceVersion": "3"}, "spec": spec})
}

fn rule_json(r: &calc_graph::model::Rule) -> Value {
    serde_json::to_value(r).unwrap()
}

#[test]
fn default_deny_ingress_from_the_kubernetes_docs() {
    let (key, s) = policy(knp(
        "default-deny-ingress",
        "shop",
        json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
    ));
    assert_eq!(
        key,
        ResourceKey::new(
            Kind::NetworkPolicy,
            Some("shop"),
            "knp.default.default-deny-ingress"
        )
    );
    assert_eq!(s.tier, "default");
    assert_eq!(s.order, Some(1000.0));
    assert_eq!(s.selector, "projectcalico.org/orchestrator == 'k8s'");
    assert!(
        s.ingress.is_empty(),
        "an empty ingress list denies all ingress"
    );
    assert_eq!(s.types, ["Ingress"]);
    // Without policyTypes (older clusters): ingress only, even with egress rules.
    let (r, warnings) = applied_with_warnings(
        Source::KubernetesNetworkPolicy,
        knp("old", "shop", json!({"podSelector": {}, "egress": [{}]})),
    );
    let Resource::Policy(Kind::NetworkPolicy, _, s) = r else {
        panic!()
    };
    assert_eq!(s.types, ["Ingress"]);
    assert!(warnings[0].contains("lacks Egress"), "{warnings:?}");
    // Default deny all egress; allow all ingress.
    let (_, s) = policy(knp(
        "deny-egress",
        "shop",
        json!({"podSelector": {}, "policyTypes": ["Egress"]}),
    ));
    assert_eq!(s.types, ["Egress"]);
    assert!(s.egress.is_empty());
    let (_, s) = policy(knp(
        "allow-all",
        "shop",
        json!({"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress"]}),
    ));
    assert_eq!(s.ingress.len(), 1);
    assert_eq!(rule_json(&s.ingress[0]), json!({"action": "Allow"}));
}

#[test]
fn the_kubernetes_docs_example_policy() {
    // `test-network-policy` from the Kubernetes NetworkPolicy documentation.
    let (_, s) = policy(knp(
        "test-network-policy",
        "default",
        json!({
            "podSelector": {"matchLabels": {"role": "db"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [
                    {"ipBlock": {"cidr": "172.17.0.0/16", "except": ["172.17.1.0/24"]}},
                    {"namespaceSelector": {"matchLabels": {"project": "myproject"}}},
                    {"podSelector": {"matchLabels": {"role": "frontend"}}}
                ],
                "ports": [{"protocol": "TCP", "port": 6379}]
            }],
            "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/24"}}], "ports": [{"protocol": "TCP", "port": 5978}]}]
        }),
    ));
    assert_eq!(
        s.selector,
        "projectcalico.org/orchestrator == 'k8s' && role == 'db'"
    );
    assert_eq!(s.types, ["Ingress", "Egress"]);
    let ingress: Vec<Value> = s.ingress.iter().map(rule_json).collect();
    assert_eq!(
        ingress,
        [
            json!({"action": "Allow", "protocol": "TCP",
                   "source": {"nets": ["172.17.0.0/16"], "notNets": ["172.17.1.0/24"]},
                   "destination": {"ports": [6379]}}),
            json!({"action": "Allow", "protocol": "TCP",
                   "source": {"selector": "projectcalico.org/orchestrator == 'k8s'", "namespaceSelector": "project == 'myproject'"},
                   "destination": {"ports": [6379]}}),
            json!({"action": "Allow", "protocol": "TCP",
                   "source": {"selector": "projectcalico.org/orchestrator == 'k8s' && role == 'frontend'"},
                   "destination": {"ports": [6379]}}),
        ]
    );
    assert_eq!(
        s.egress.iter().map(rule_json).collect::<Vec<_>>(),
        [
            json!({"action": "Allow", "protocol": "TCP", "destination": {"nets": ["10.0.0.0/24"], "ports": [5978]}})
        ]
    );
}

#[test]
fn namespace_selectors_and_expressions() {
    let (_, s) = policy(knp(
        "allow-from-ns",
        "shop",
        json!({
            "podSelector": {"matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["web", "api"]},
                {"key": "env", "operator": "NotIn", "values": ["dev"]},
                {"key": "canary", "operator": "DoesNotExist"},
                {"key": "app", "operator": "Exists"}]},
            "ingress": [{"from": [
                {"namespaceSelector": {}},
                {"namespaceSelector": {"matchLabels": {"team": "ops"}}, "podSelector": {"matchLabels": {"app": "mon"}}}
            ]}]
        }),
    ));
    assert_eq!(
        s.selector,
        "projectcalico.org/orchestrator == 'k8s' && tier in { 'web', 'api' } && env not in { 'dev' } && ! has(canary) && has(app)"
    );
    assert_eq!(
        s.ingress.iter().map(rule_json).collect::<Vec<_>>(),
        [
            json!({"action": "Allow", "source": {"selector": "projectcalico.org/orchestrator == 'k8s'", "namespaceSelector": "all()"}}),
            json!({"action": "Allow", "source": {"selector": "projectcalico.org/orchestrator == 'k8s' && app == 'mon'", "namespaceSelector": "team == 'ops'"}}),
        ]
    );
}

#[test]
fn ports_named_ranges_and_protocols() {
    let (_, s) = policy(knp(
        "ports",
        "shop",
        json!({
            "podSelector": {},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"ports": [
                {"port": "http"},
                {"port": 81}, {"port": 80}, {"port": 82, "protocol": "TCP"}, {"port": 9090},
                {"protocol": "UDP", "port": 53},
                {"protocol": "SCTP"}
            ]}],
            "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.7/24"}}], "ports": [{"protocol": "TCP", "port": 32000, "endPort": 32768}]}]
        }),
    ));
    // One rule per protocol, in protocol order; named ports first, numbers merged to ranges.
    assert_eq!(
        s.ingress.iter().map(rule_json).collect::<Vec<_>>(),
        [
            json!({"action": "Allow", "protocol": "SCTP"}),
            json!({"action": "Allow", "protocol": "TCP", "destination": {"ports": ["http", "80:82", 9090]}}),
            json!({"action": "Allow", "protocol": "UDP", "destination": {"ports": [53]}}),
        ]
    );
    // endPort is a range; ipBlock CIDRs are masked as Go's ParseCIDR does.
    assert_eq!(
        s.egress.iter().map(rule_json).collect::<Vec<_>>(),
        [
            json!({"action": "Allow", "protocol": "TCP", "destination": {"nets": ["10.0.0.0/24"], "ports": ["32000:32768"]}})
        ]
    );
    assert_eq!(
        s.egress[0].destination.ports,
        [Port::Range {
            min: 32000,
            max: 32768
        }]
    );
    // A port for every TCP port wins over single ports of TCP.
    let (_, s) = policy(knp(
        "all-tcp",
        "shop",
        json!({"podSelector": {}, "ingress": [{"ports": [{"port": 80}, {"protocol": "TCP"}]}]}),
    ));
    assert_eq!(
        s.ingress.iter().map(rule_json).collect::<Vec<_>>(),
        [json!({"action": "Allow", "protocol": "TCP"})]
    );
}

#[test]
fn a_rule_that_cannot_be_converted_is_dropped_and_reported() {
    let (r, warnings) = applied_with_warnings(
        Source::KubernetesNetworkPolicy,
        knp(
            "bad",
            "shop",
            json!({"podSelector": {}, "ingress": [
                {"ports": [{"port": "http", "endPort": 90}]},
                {"from": [{"ipBlock": {"cidr": "not-a-cidr"}}]},
                {"ports": [{"port": 443}]}
            ]}),
        ),
    );
    let Resource::Policy(Kind::NetworkPolicy, _, s) = r else {
        panic!()
    };
    assert_eq!(s.ingress.len(), 1, "only the good rule stays");
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].contains("ingress rule 0") && warnings[0].contains("endPort"),
        "{warnings:?}"
    );
    assert!(warnings[1].contains("not-a-cidr"), "{warnings:?}");
}

fn crd(kind: &str, meta: Value, spec: Value) -> Value {
    json!({"apiVersion": "crd.projectcalico.org/v1", "kind": kind, "metadata": meta, "spec": spec})
}

#[test]
fn calico_crds_carry_v3_specs() {
    let t = applied(
        Source::Crd(Kind::Tier),
        crd(
            "Tier",
            json!({"name": "security", "resourceVersion": "9", "uid": "x"}),
            json!({"order": 100}),
        ),
    );
    assert_eq!(t.key(), ResourceKey::new(Kind::Tier, None, "security"));
    let Resource::Tier(m, s) = &t else { panic!() };
    assert_eq!(s.order, Some(100.0));
    assert_eq!(s.default_action, "Deny");
    assert!(
        m.resource_version.is_none() && m.uid.is_none(),
        "no per-write metadata"
    );
    // Metadata restored from Calico's annotation: the v3 name and labels.
    let gnp = applied(
        Source::Crd(Kind::GlobalNetworkPolicy),
        crd(
            "GlobalNetworkPolicy",
            json!({"name": "default.allow-dns", "labels": {"projectcalico.org/tier": "default"},
                   "annotations": {"projectcalico.org/metadata": "{\"name\":\"allow-dns\",\"labels\":{\"team\":\"net\"},\"annotations\":{\"note\":\"x\"}}"}}),
            json!({"tier": "default", "selector": "all()", "egress": [{"action": "Allow", "protocol": "UDP", "destination": {"ports": [53]}}]}),
        ),
    );
    assert_eq!(
        gnp.key(),
        ResourceKey::new(Kind::GlobalNetworkPolicy, None, "allow-dns")
    );
    assert_eq!(gnp.meta().labels["team"], "net");
    assert_eq!(gnp.meta().labels["projectcalico.org/tier"], "default");
    assert_eq!(gnp.meta().annotations["note"], "x");
    assert!(!gnp.meta().annotations.contains_key(METADATA_ANNOTATION));
    // No annotation: the backend's `default.` prefix is dropped in the default tier only.
    let np = applied(
        Source::Crd(Kind::NetworkPolicy),
        crd(
            "NetworkPolicy",
            json!({"name": "default.legacy", "namespace": "shop"}),
            json!({"selector": "all()"}),
        ),
    );
    assert_eq!(
        np.key(),
        ResourceKey::new(Kind::NetworkPolicy, Some("shop"), "legacy")
    );
    let other = applied(
        Source::Crd(Kind::NetworkPolicy),
        crd(
            "NetworkPolicy",
            json!({"name": "security.block", "namespace": "shop"}),
            json!({"tier": "security", "selector": "all()"}),
        ),
    );
    assert_eq!(other.meta().name, "security.block");
    // Every listed kind decodes as its v3 kind.
    for (kind, spec) in [
        (Kind::GlobalNetworkSet, json!({"nets": ["10.0.0.0/8"]})),
        (Kind::NetworkSet, json!({"nets": ["192.0.2.0/24"]})),
        (
            Kind::HostEndpoint,
            json!({"node": "node1", "interfaceName": "eth0", "expectedIPs": ["10.0.0.11"]}),
        ),
        (
            Kind::IPPool,
            json!({"cidr": "10.65.0.0/16", "vxlanMode": "Always"}),
        ),
        (
            Kind::FelixConfiguration,
            json!({"logSeverityScreen": "Info"}),
        ),
        (Kind::ClusterInformation, json!({"datastoreReady": true})),
    ] {
        let meta = if kind.namespaced() {
            json!({"name": "x", "namespace": "shop"})
        } else {
            json!({"name": "default"})
        };
        let r = applied(Source::Crd(kind), crd(kind.as_str(), meta, spec));
        assert_eq!(r.kind(), kind);
    }
}

#[test]
fn staged_policy_crds_are_read_and_a_staged_kubernetes_policy_is_converted() {
    for (kind, spec) in [
        (
            Kind::StagedNetworkPolicy,
            json!({"stagedAction": "Set", "selector": "app == 'db'"}),
        ),
        (
            Kind::StagedGlobalNetworkPolicy,
            json!({"stagedAction": "Delete", "selector": "all()", "doNotTrack": true, "applyOnForward": true}),
        ),
    ] {
        let meta = if kind.namespaced() {
            json!({"name": "trial", "namespace": "shop"})
        } else {
            json!({"name": "trial"})
        };
        let r = applied(Source::Crd(kind), crd(kind.as_str(), meta, spec));
        assert_eq!(r.kind(), kind);
    }
    // A Kubernetes spec plus stagedAction; a rule that cannot be converted is reported.
    let (r, warnings) = applied_with_warnings(
        Source::Crd(Kind::StagedKubernetesNetworkPolicy),
        crd(
            "StagedKubernetesNetworkPolicy",
            json!({"name": "db", "namespace": "shop"}),
            json!({"stagedAction": "Set", "podSelector": {"matchLabels": {"app": "db"}},
                   "ingress": [{"ports": [{"port": 5432}]}, {"from": [{"ipBlock": {"cidr": "junk"}}]}],
                   "policyTypes": ["Ingress"]}),
        ),
    );
    assert_eq!(
        r.key(),
        ResourceKey::new(Kind::StagedKubernetesNetworkPolicy, Some("shop"), "db")
    );
    let Resource::Policy(_, _, s) = &r else {
        panic!()
    };
    assert_eq!(s.ingress.len(), 1);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("ingress rule 1 dropped"),
        "{warnings:?}"
    );
}

#[test]
fn a_crd_with_a_misspelt_field_is_rejected_by_name() {
    let Decision::Reject(r) = conv().convert(
        Source::Crd(Kind::GlobalNetworkPolicy),
        crd(
            "GlobalNetworkPolicy",
            json!({"name": "typo"}),
            json!({"selectr": "app == 'web'", "ingress": [{"action": "Allow"}]}),
        ),
    ) else {
        panic!("a CRD with an unknown spec field must be rejected");
    };
    assert_eq!(r.stage(), calc_graph::manifest::RejectStage::UnknownField);
    let reason = r.to_string();
    assert!(
        reason.contains("spec.selectr") && reason.contains("did you mean \"selector\""),
        "{reason}"
    );
}

#[test]
fn bad_crds_are_rejected_with_the_reason() {
    let r = rejected(
        Source::Crd(Kind::GlobalNetworkPolicy),
        crd(
            "GlobalNetworkPolicy",
            json!({"name": "p"}),
            json!({"selector": "a ="}),
        ),
    );
    assert!(r.contains("GlobalNetworkPolicy p"), "{r}");
    let r = rejected(
        Source::Crd(Kind::Tier),
        crd("Profile", json!({"name": "t"}), json!({})),
    );
    assert!(r.contains("tiers.crd.projectcalico.org"), "{r}");
    let r = rejected(
        Source::Crd(Kind::Tier),
        crd(
            "Tier",
            json!({"name": "t", "annotations": {"projectcalico.org/metadata": "{"}}),
            json!({}),
        ),
    );
    assert!(r.contains("projectcalico.org/metadata"), "{r}");
    let r = rejected(
        Source::Pod,
        json!({"metadata": {"name": "p"}, "spec": {"containers": "nope"}}),
    );
    assert!(r.contains("cannot decode"), "{r}");
}

#[test]
fn services_keep_where_they_are_reached() {
    let r = applied(
        Source::Service,
        json!({
            "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "4",
                         "labels": {"app": "web"}},
            "spec": {"type": "NodePort", "selector": {"app": "web"}, "clusterIP": "10.96.0.10",
                     "clusterIPs": ["10.96.0.10", "fd00:96::10"], "ipFamilies": ["IPv4", "IPv6"],
                     "externalIPs": ["203.0.113.7"],
                     "ports": [{"name": "http", "protocol": "TCP", "port": 80,
                                "targetPort": 8080, "nodePort": 30080}]},
            "status": {"loadBalancer": {}},
        }),
    );
    assert_eq!(
        r.key(),
        ResourceKey::new(Kind::Service, Some("shop"), "web")
    );
    let Resource::Service(meta, s) = &r else {
        panic!("{r:?}")
    };
    assert!(meta.labels.is_empty(), "only what flow logs read is kept");
    assert_eq!(s.cluster_ip, "10.96.0.10");
    assert_eq!(s.cluster_ips, ["10.96.0.10", "fd00:96::10"]);
    assert_eq!(s.external_ips, ["203.0.113.7"]);
    assert_eq!(
        (
            s.ports[0].name.as_str(),
            s.ports[0].protocol.as_str(),
            s.ports[0].port,
            s.ports[0].node_port
        ),
        ("http", "TCP", 80, Some(30080))
    );
}

#[test]
fn endpoint_slices_keep_what_felix_reads() {
    let r = applied(
        Source::EndpointSlice,
        json!({
            "metadata": {"name": "web-x1", "namespace": "shop", "resourceVersion": "9",
                         "generateName": "web-",
                         "labels": {"kubernetes.io/service-name": "web",
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": false},
                           "nodeName": "node1", "targetRef": {"kind": "Pod", "name": "web-1"}}],
            "ports": [{"name": "http", "protocol": "TCP", "port": 8080, "appProtocol": "http"},
                      {"name": "dns", "protocol": "UDP", "port": 53}],
        }),
    );
    assert_eq!(
        r.key(),
        ResourceKey::new(Kind::EndpointSlice, Some("shop"), "web-x1")
    );
    let Resource::EndpointSlice(meta, s) = &r else {
        panic!("{r:?}")
    };
    assert_eq!(meta.labels["kubernetes.io/service-name"], "web");
    assert_eq!(s.endpoints[0].addresses, ["10.0.0.1"]);
    assert_eq!(
        s.ports
            .iter()
            .map(|p| (
                p.protocol.clone().unwrap_or_default(),
                p.port.unwrap_or_default()
            ))
            .collect::<Vec<_>>(),
        [("TCP".to_string(), 8080), ("UDP".to_string(), 53)]
    );
    // No endpoints and no ports (a Service whose pods are all gone).
    let r = applied(
        Source::EndpointSlice,
        json!({"metadata": {"name": "web-x2", "namespace": "shop"}, "addressType": "IPv4",
               "endpoints": null}),
    );
    let Resource::EndpointSlice(_, s) = &r else {
        panic!("{r:?}")
    };
    assert!(s.endpoints.is_empty() && s.ports.is_empty());
}

#[test]
fn network_policy_api_objects_are_converted_by_the_graph() {
    // As a list sends them: no kind or apiVersion on the items, server-side metadata.
    let cnp = Source::NetworkPolicyApi(Kind::ClusterNetworkPolicy);
    let (r, warnings) = applied_with_warnings(
        cnp,
        json!({"metadata": {"name": "protect", "uid": "u", "resourceVersion": "7",
                            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                            "managedFields": []},
               "spec": {"tier": "Admin", "priority": 10,
                        "subject": {"namespaces": {"matchLabels": {"env": "prod"}}},
                        "egress": [{"name": "to-nodes", "action": "Deny", "to": [{"nodes": {}}]},
                                   {"action": "Accept", "to": [{"newPeerKind": {}}]}]},
               "status": {"conditions": []}}),
    );
    assert_eq!(
        r.key(),
        ResourceKey::new(Kind::ClusterNetworkPolicy, None, "protect")
    );
    assert_eq!(
        r.meta(),
        &ObjectMeta {
            name: "protect".into(),
            ..Default::default()
        },
        "metadata as Calico's conversion keeps it"
    );
    let Resource::Policy(_, _, s) = &r else {
        panic!()
    };
    assert_eq!((s.tier.as_str(), s.order), ("kube-admin", Some(10.0)));
    assert_eq!(rule_json(&s.egress[0]), json!({"action": "Deny"}));
    assert_eq!(
        s.egress.len(),
        1,
        "the Accept with an unknown peer is dropped"
    );
    // Both failed rules are reported; a field of a newer CRD fails the rule, not the object.
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings[0].contains("\"to-nodes\"") && warnings[0].contains("nodes peers"));

    let anp = applied(
        Source::NetworkPolicyApi(Kind::AdminNetworkPolicy),
        json!({"apiVersion": "policy.networking.k8s.io/v1alpha1", "kind": "AdminNetworkPolicy",
               "metadata": {"name": "a"},
               "spec": {"priority": 3, "subject": {"namespaces": {}},
                        "ingress": [{"action": "Allow", "from": [{"namespaces": {}}]}]}}),
    );
    assert_eq!(
        anp.key(),
        ResourceKey::new(Kind::AdminNetworkPolicy, None, "a")
    );

    // What the CRD forbids is rejected at validation, naming the field.
    let Decision::Reject(r) = conv().convert(
        cnp,
        json!({"metadata": {"name": "big"},
               "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {}},
                        "ingress": vec![json!({"action": "Deny", "from": [{"namespaces": {}}]}); 26]}}),
    ) else {
        panic!("too many rules")
    };
    assert_eq!(r.stage(), calc_graph::manifest::RejectStage::Validation);
    assert!(r.to_string().contains("spec.ingress: 26 rules"), "{r}");
    // A kind listed in the wrong collection.
    let r = rejected(
        cnp,
        json!({"kind": "AdminNetworkPolicy", "metadata": {"name": "x"}, "spec": {}}),
    );
    assert!(
        r.contains("clusternetworkpolicies.policy.networking.k8s.io"),
        "{r}"
    );
}
