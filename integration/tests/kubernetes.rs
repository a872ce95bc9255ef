//! The Kubernetes datastore end to end: the real `calc-server` (and so the real kube client)
//! against the in-process fake API server of `integration::fake_kube`, which speaks the
//! API's list/watch JSON over HTTP. No kube-apiserver binary can be installed here; this is
//! the honest substitute, and `docs/operations.md` says so.
//!
//! The cluster holds the Kubernetes documentation's NetworkPolicy examples (default deny,
//! allow from a namespace, ipBlock with except, named port, a port range), pods in every state
//! Calico treats specially, namespaces, service accounts, nodes and Calico CRDs (one not
//! installed). `compute` must produce the per-node stream Calico's conversion implies; `serve`
//! must follow ADDED/MODIFIED/DELETED events, ignore bookmarks, and recover an event lost while
//! a watch expired (410 Gone) by re-listing and sweeping.

use std::time::Duration;

use felix_proto as pb;
use felix_proto::calc_server_client::CalcServerClient;
use integration::fake_kube::{
    ADMIN_NETWORK_POLICIES, CLUSTER_NETWORK_POLICIES, ENDPOINT_SLICES, FakeKube, NAMESPACES,
    NETWORK_POLICIES, NODES, PODS, SERVICE_ACCOUNTS, crd,
};
use integration::{Server, binary, free_port};
use pb::from_dataplane::Payload as From;
use pb::to_dataplane::Payload as To;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

/// Every CRD but HostEndpoint, which this cluster has not installed (its list answers 404).
const INSTALLED_CRDS: &[&str] = &[
    "networkpolicies",
    "globalnetworkpolicies",
    "tiers",
    "networksets",
    "globalnetworksets",
    "ippools",
    "felixconfigurations",
    "clusterinformations",
];

fn namespace(name: &str, labels: Value) -> Value {
    let mut labels = labels;
    labels["kubernetes.io/metadata.name"] = name.into();
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

fn pod(
    ns: &str,
    name: &str,
    node: Option<&str>,
    labels: Value,
    ip: Option<&str>,
    phase: &str,
) -> Value {
    let mut status = json!({"phase": phase});
    if let Some(ip) = ip {
        status["podIP"] = ip.into();
        status["podIPs"] = json!([{"ip": ip}]);
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, "serviceAccountName": "default",
                 "containers": [{"name": "main", "image": "app",
                                 "ports": [{"name": "redis", "containerPort": 6379}]}]},
        "status": status,
    })
}

fn knp(ns: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

/// The cluster every test starts from.
fn seed(fake: &FakeKube) {
    fake.apply(NAMESPACES, namespace("default", json!({})));
    fake.apply(
        NAMESPACES,
        namespace("myproject", json!({"project": "myproject"})),
    );
    for ns in ["default", "myproject"] {
        fake.apply(
            SERVICE_ACCOUNTS,
            json!({"metadata": {"name": "default", "namespace": ns}}),
        );
    }
    fake.apply(
        NODES,
        json!({"metadata": {"name": "node1", "labels": {"kubernetes.io/hostname": "node1"},
               "annotations": {"projectcalico.org/IPv4Address": "10.0.0.11/24"}},
               "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.11"}]}}),
    );
    fake.apply(NODES, json!({"metadata": {"name": "node2"}}));
    // Endpoints on node1 and node2, and pods Calico does not turn into endpoints.
    fake.apply(
        PODS,
        pod(
            "default",
            "db-0",
            Some("node1"),
            json!({"role": "db"}),
            Some("10.65.0.10"),
            "Running",
        ),
    );
    fake.apply(
        PODS,
        pod(
            "default",
            "frontend-0",
            Some("node1"),
            json!({"role": "frontend"}),
            Some("10.65.0.11"),
            "Running",
        ),
    );
    fake.apply(
        PODS,
        pod(
            "myproject",
            "client-0",
            Some("node2"),
            json!({"app": "client"}),
            Some("10.65.1.5"),
            "Running",
        ),
    );
    let mut host = pod(
        "default",
        "hostnet",
        Some("node1"),
        json!({"role": "db"}),
        Some("10.0.0.11"),
        "Running",
    );
    host["spec"]["hostNetwork"] = true.into();
    fake.apply(PODS, host);
    fake.apply(
        PODS,
        pod(
            "default",
            "pending",
            None,
            json!({"role": "db"}),
            None,
            "Pending",
        ),
    );
    fake.apply(
        PODS,
        pod(
            "default",
            "no-ip-yet",
            Some("node1"),
            json!({"role": "db"}),
            None,
            "Pending",
        ),
    );
    fake.apply(
        PODS,
        pod(
            "default",
            "job-done",
            Some("node1"),
            json!({"role": "db"}),
            Some("10.65.0.99"),
            "Succeeded",
        ),
    );

    // The Kubernetes documentation's examples.
    fake.apply(
        NETWORK_POLICIES,
        knp(
            "default",
            "default-deny-ingress",
            json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
        ),
    );
    fake.apply(
        NETWORK_POLICIES,
        knp("default", "test-network-policy", json!({
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
        })),
    );
    fake.apply(
        NETWORK_POLICIES,
        knp(
            "default",
            "allow-from-any-namespace",
            json!({
                "podSelector": {"matchLabels": {"role": "frontend"}},
                "ingress": [{"from": [{"namespaceSelector": {}}]}]
            }),
        ),
    );
    fake.apply(
        NETWORK_POLICIES,
        knp(
            "default",
            "named-port",
            json!({
                "podSelector": {"matchLabels": {"role": "db"}},
                "ingress": [{"ports": [{"port": "redis"}]}]
            }),
        ),
    );
    fake.apply(
        NETWORK_POLICIES,
        knp(
            "default",
            "multi-port-egress",
            json!({
                "podSelector": {"matchLabels": {"role": "db"}},
                "policyTypes": ["Egress"],
                "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
                            "ports": [{"protocol": "TCP", "port": 32000, "endPort": 32768}]}]
            }),
        ),
    );

    // Calico CRDs: a tier and a global policy written by Calico's client (backend name with
    // the tier prefix, v3 name in the metadata annotation).
    fake.apply(
        &crd("tiers"),
        json!({"metadata": {"name": "security"}, "spec": {"order": 100}}),
    );
    fake.apply(
        &crd("globalnetworkpolicies"),
        json!({"metadata": {"name": "security.allow-dns",
                            "annotations": {"projectcalico.org/metadata": "{\"name\":\"security.allow-dns\"}"}},
               "spec": {"tier": "security", "selector": "all()", "types": ["Egress"],
                        "egress": [{"action": "Allow", "protocol": "UDP", "destination": {"ports": [53]}},
                                   {"action": "Pass"}]}}),
    );
    fake.apply(
        &crd("clusterinformations"),
        json!({"metadata": {"name": "default"}, "spec": {"datastoreReady": true}}),
    );
}

/// `calc-server compute` against the fake server for `node`: one JSON message per line.
fn compute(fake: &FakeKube, dir: &std::path::Path, node: &str) -> Vec<Value> {
    let out = std::process::Command::new(binary("calc-server"))
        .args(["compute", "--datastore-type", "kubernetes", "--node", node])
        .arg("--kubeconfig")
        .arg(fake.kubeconfig(dir))
        .output()
        .expect("run calc-server compute");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "compute failed: {stderr}");
    String::from_utf8(out.stdout)
        .expect("UTF-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON message per line"))
        .collect()
}

fn payloads<'a>(msgs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    msgs.iter().filter_map(|m| m.get(kind)).collect()
}

fn policy<'a>(msgs: &'a [Value], name: &str) -> &'a Value {
    payloads(msgs, "activePolicyUpdate")
        .into_iter()
        .find(|p| p["id"]["name"] == name)
        .unwrap_or_else(|| panic!("no ActivePolicyUpdate for {name}"))
}

#[test]
fn compute_streams_the_kubernetes_docs_policies_per_node() {
    let fake = FakeKube::start(INSTALLED_CRDS);
    seed(&fake);
    let dir = tempfile::tempdir().unwrap();
    let msgs = compute(&fake, dir.path(), "node1");
    assert!(
        msgs.last().unwrap().get("inSync").is_some(),
        "ends with InSync"
    );

    // Endpoints: only the scheduled, non-host-network pods that own an IP, on node1.
    let weps: Vec<&Value> = payloads(&msgs, "workloadEndpointUpdate");
    let mut ids: Vec<&str> = weps
        .iter()
        .map(|w| w["id"]["workloadId"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["default/db-0", "default/frontend-0"]);
    let db = weps
        .iter()
        .find(|w| w["id"]["workloadId"] == "default/db-0")
        .unwrap();
    assert_eq!(db["id"]["orchestratorId"], "k8s");
    assert_eq!(db["id"]["endpointId"], "eth0");
    let ep = &db["endpoint"];
    let expected_iface = {
        // cali + 11 hex digits of SHA-1("default.db-0"), computed independently below.
        "cali".to_string() + &sha1_hex("default.db-0")[..11]
    };
    assert_eq!(ep["name"], expected_iface.as_str());
    assert_eq!(ep["ipv4Nets"], json!(["10.65.0.10/32"]));
    assert_eq!(
        ep["profileIds"],
        json!(["kns.default", "ksa.default.default"])
    );

    // The namespace and service-account profiles are sent; kns. allows both ways.
    let profiles = payloads(&msgs, "activeProfileUpdate");
    let kns = profiles
        .iter()
        .find(|p| p["id"]["name"] == "kns.default")
        .expect("kns.default");
    assert_eq!(kns["profile"]["inboundRules"][0]["action"], "allow");
    assert_eq!(kns["profile"]["outboundRules"][0]["action"], "allow");
    assert!(
        profiles
            .iter()
            .any(|p| p["id"]["name"] == "ksa.default.default")
    );

    // Default deny: no inbound rules, so an isolated pod drops what no other policy allows.
    let deny = policy(&msgs, "knp.default.default-deny-ingress");
    assert_eq!(deny["id"]["namespace"], "default");
    assert!(
        deny["policy"]
            .get("inboundRules")
            .is_none_or(|r| r.as_array().unwrap().is_empty())
    );
    // The docs' test-network-policy: ipBlock with except, namespace and pod peers, port 6379.
    let test = &policy(&msgs, "knp.default.test-network-policy")["policy"];
    let inbound = test["inboundRules"].as_array().unwrap();
    assert_eq!(inbound.len(), 3);
    assert_eq!(inbound[0]["srcNet"], json!(["172.17.0.0/16"]));
    assert_eq!(inbound[0]["notSrcNet"], json!(["172.17.1.0/24"]));
    for r in inbound {
        assert_eq!(r["dstPorts"], json!([{"first": 6379, "last": 6379}]));
        assert_eq!(r["protocol"]["name"], "tcp");
    }
    assert_eq!(
        inbound[1]["originalSrcNamespaceSelector"], "project == 'myproject'",
        "{}",
        inbound[1]
    );
    assert_eq!(inbound[1]["srcIpSetIds"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        inbound[2]["originalSrcSelector"],
        "projectcalico.org/orchestrator == 'k8s' && role == 'frontend'"
    );
    assert_eq!(test["outboundRules"][0]["dstNet"], json!(["10.0.0.0/24"]));
    // Allow from every namespace.
    let any_ns = &policy(&msgs, "knp.default.allow-from-any-namespace")["policy"];
    assert_eq!(
        any_ns["inboundRules"][0]["originalSrcNamespaceSelector"],
        "all()"
    );
    // Named port: a named-port IP set over the policy's namespace.
    let named = &policy(&msgs, "knp.default.named-port")["policy"];
    assert_eq!(
        named["inboundRules"][0]["dstNamedPortIpSetIds"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    // endPort: a port range, egress only.
    let range = &policy(&msgs, "knp.default.multi-port-egress")["policy"];
    assert_eq!(
        range["outboundRules"][0]["dstPorts"],
        json!([{"first": 32000, "last": 32768}])
    );
    assert!(
        range
            .get("inboundRules")
            .is_none_or(|r| r.as_array().unwrap().is_empty())
    );

    // The Calico CRD policy in its tier, ahead of the default tier for db-0.
    let dns = policy(&msgs, "security.allow-dns");
    assert_eq!(dns["id"]["kind"], "GlobalNetworkPolicy");
    let tiers = &db["endpoint"]["tiers"];
    let names: Vec<&str> = tiers
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["security", "default"]);
    let default_tier = &tiers[1];
    let ingress: Vec<&str> = default_tier["ingressPolicies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    // Order 1000 for all; ties by name.
    assert_eq!(
        ingress,
        [
            "knp.default.default-deny-ingress",
            "knp.default.named-port",
            "knp.default.test-network-policy"
        ]
    );

    // Host metadata from the node's Calico annotation.
    let hosts = payloads(&msgs, "hostMetadataUpdate");
    let node1 = hosts
        .iter()
        .find(|h| h["hostname"] == "node1")
        .expect("node1 host metadata");
    assert_eq!(node1["ipv4Addr"], "10.0.0.11");

    // node2 sees its own endpoint and the policies that select it, nothing of node1's.
    let msgs2 = compute(&fake, dir.path(), "node2");
    let weps2: Vec<&str> = payloads(&msgs2, "workloadEndpointUpdate")
        .iter()
        .map(|w| w["id"]["workloadId"].as_str().unwrap())
        .collect();
    assert_eq!(weps2, ["myproject/client-0"]);
    assert!(
        payloads(&msgs2, "activePolicyUpdate")
            .iter()
            .all(|p| p["id"]["namespace"] != "default")
    );
}

/// EndpointSlice `name` of Service `service` in `default`, as the EndpointSlice controller
/// writes it (native items carry no kind/apiVersion in lists).
fn endpoint_slice(name: &str, service: &str, addresses: &[&str], port: u16) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "default", "generateName": format!("{service}-"),
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": addresses.iter()
            .map(|a| json!({"addresses": [a], "conditions": {"ready": true}, "nodeName": "node1"}))
            .collect::<Vec<_>>(),
        "ports": [{"name": "redis", "protocol": "TCP", "port": port}],
    })
}

#[test]
fn compute_fills_a_service_rule_from_endpoint_slices() {
    let fake = FakeKube::start(INSTALLED_CRDS);
    seed(&fake);
    fake.apply(
        ENDPOINT_SLICES,
        endpoint_slice("db-7xk2p", "db", &["10.65.0.10"], 6379),
    );
    fake.apply(
        ENDPOINT_SLICES,
        endpoint_slice("cache-a1b2c", "cache", &["10.65.0.99"], 11211),
    );
    fake.apply(
        &crd("networkpolicies"),
        json!({"metadata": {"name": "frontend-to-db", "namespace": "default"},
               "spec": {"selector": "role == 'frontend'", "types": ["Egress"],
                        "egress": [{"action": "Allow", "destination": {"services": {"name": "db"}}}]}}),
    );
    let dir = tempfile::tempdir().unwrap();
    let msgs = compute(&fake, dir.path(), "node1");
    let rule = &policy(&msgs, "frontend-to-db")["policy"]["outboundRules"][0];
    assert_eq!(rule["originalDstService"], "db");
    let id = rule["dstIpPortSetIds"][0].as_str().expect("a service set");
    assert!(id.starts_with("svc:"), "{rule}");
    let set = payloads(&msgs, "ipsetUpdate")
        .into_iter()
        .find(|s| s["id"] == id)
        .expect("the service's set is sent");
    assert_eq!(set["type"], "IP_AND_PORT");
    assert_eq!(
        set["members"],
        json!(["10.65.0.10,tcp:6379"]),
        "db's endpoint on db's port, not cache's"
    );
}

/// SHA-1 of a short string, written out here so the test does not trust the code under test.
fn sha1_hex(s: &str) -> String {
    let out = std::process::Command::new("sha1sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(s.as_bytes())?;
            c.wait_with_output()
        })
        .expect("sha1sum");
    String::from_utf8(out.stdout).unwrap()[..40].to_string()
}

/// The network-policy-api kinds are read when their CRDs are installed (the test above runs
/// without them: their 404s count as empty collections, and compute still gets in sync).
#[test]
fn compute_reads_the_network_policy_api_kinds() {
    let fake = FakeKube::start(INSTALLED_CRDS);
    seed(&fake);
    fake.serve(CLUSTER_NETWORK_POLICIES, "ClusterNetworkPolicy");
    fake.serve(ADMIN_NETWORK_POLICIES, "AdminNetworkPolicy");
    // BaselineAdminNetworkPolicy stays uninstalled (404).
    fake.apply(
        CLUSTER_NETWORK_POLICIES,
        json!({"metadata": {"name": "protect-db"},
               "spec": {"tier": "Admin", "priority": 5,
                        "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "db"}}}},
                        "ingress": [{"name": "no-myproject", "action": "Deny",
                                     "from": [{"namespaces": {"matchLabels": {"project": "myproject"}}}]}],
                        "egress": [{"name": "no-nodes", "action": "Deny", "to": [{"nodes": {}}]}]}}),
    );
    fake.apply(
        ADMIN_NETWORK_POLICIES,
        json!({"metadata": {"name": "pass-all"},
               "spec": {"priority": 1, "subject": {"namespaces": {}},
                        "ingress": [{"action": "Pass", "from": [{"namespaces": {}}]}]}}),
    );
    let dir = tempfile::tempdir().unwrap();
    let msgs = compute(&fake, dir.path(), "node1");
    assert!(msgs.last().unwrap().get("inSync").is_some());
    let cnp = payloads(&msgs, "activePolicyUpdate")
        .into_iter()
        .find(|p| p["id"]["name"] == "protect-db")
        .expect("the ClusterNetworkPolicy is sent to node1, where db-0 runs");
    assert_eq!(cnp["id"]["kind"], "KubernetesClusterNetworkPolicy");
    let outbound = cnp["policy"]["outboundRules"].as_array().unwrap();
    assert_eq!(
        outbound.len(),
        1,
        "the nodes rule failed closed: {outbound:?}"
    );
    assert_eq!(outbound[0]["action"], "deny");
    assert_eq!(
        policy(&msgs, "kanp.adminnetworkpolicy.pass-all")["id"]["kind"],
        "GlobalNetworkPolicy"
    );
    let db = payloads(&msgs, "workloadEndpointUpdate")
        .into_iter()
        .find(|w| w["id"]["workloadId"] == "default/db-0")
        .unwrap();
    let tiers: Vec<&str> = db["endpoint"]["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    // The built-in tiers (order 1,000) after security (100); this cluster has no Tier
    // resource `default`, so that tier sorts last.
    assert_eq!(
        tiers,
        ["security", "adminnetworkpolicy", "kube-admin", "default"]
    );
}

#[test]
fn compute_fails_clearly_when_the_api_server_is_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kubeconfig.yaml");
    let port = free_port();
    std::fs::write(
        &cfg,
        format!("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{port}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\n"),
    )
    .unwrap();
    let out = std::process::Command::new(binary("calc-server"))
        .args([
            "compute",
            "--datastore-type",
            "kubernetes",
            "--node",
            "node1",
            "--kubeconfig",
        ])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error: listing"), "{stderr}");
}

struct Agent {
    _tx: mpsc::Sender<pb::FromDataplane>,
    rx: tonic::Streaming<pb::ToDataplane>,
}

impl Agent {
    async fn connect(url: &str, node: &str) -> Agent {
        let mut client = CalcServerClient::connect(url.to_string())
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(16);
        tx.send(pb::FromDataplane {
            sequence_number: 1,
            payload: Some(From::AgentHello(pb::AgentHello {
                node_name: node.into(),
                agent_version: "test".into(),
                capabilities: vec![],
            })),
        })
        .await
        .unwrap();
        let rx = client
            .sync(ReceiverStream::new(rx))
            .await
            .expect("sync")
            .into_inner();
        Agent { _tx: tx, rx }
    }

    async fn next(&mut self) -> To {
        tokio::time::timeout(Duration::from_secs(20), self.rx.next())
            .await
            .expect("a message within 20 s")
            .expect("stream open")
            .expect("message")
            .payload
            .expect("payload")
    }

    /// Messages until `pred` matches one (which is returned last).
    async fn until(&mut self, what: &str, pred: impl Fn(&To) -> bool) -> Vec<To> {
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; saw {seen:?}"
            );
            let m = self.next().await;
            let done = pred(&m);
            seen.push(m);
            if done {
                return seen;
            }
        }
    }
}

fn is_wep_update(m: &To, workload: &str) -> bool {
    matches!(m, To::WorkloadEndpointUpdate(u) if u.id.as_ref().is_some_and(|i| i.workload_id == workload))
}

fn is_wep_remove(m: &To, workload: &str) -> bool {
    matches!(m, To::WorkloadEndpointRemove(u) if u.id.as_ref().is_some_and(|i| i.workload_id == workload))
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_follows_watch_events_and_relists_after_410() {
    let fake = FakeKube::start(INSTALLED_CRDS);
    seed(&fake);
    let dir = tempfile::tempdir().unwrap();
    let cfg = fake.kubeconfig(dir.path());
    let server = Server::start_with(
        &[
            "--datastore-type",
            "kubernetes",
            "--kubeconfig",
            cfg.to_str().unwrap(),
        ],
        dir.path().join("server.log"),
        free_port(),
        &[],
    );
    let mut agent = Agent::connect(&server.grpc, "node1").await;
    let snapshot = agent.until("InSync", |m| matches!(m, To::InSync(_))).await;
    assert!(snapshot.iter().any(|m| is_wep_update(m, "default/db-0")));
    assert!(!snapshot.iter().any(|m| is_wep_update(m, "default/hostnet")));
    let pod_lists = fake.lists(PODS);
    assert!(fake.watches(PODS) >= 1, "the server watches pods");

    // ADDED: a new pod on node1.
    fake.apply(
        PODS,
        pod(
            "default",
            "db-1",
            Some("node1"),
            json!({"role": "db"}),
            Some("10.65.0.12"),
            "Running",
        ),
    );
    agent
        .until("db-1 added", |m| is_wep_update(m, "default/db-1"))
        .await;
    // MODIFIED: the pod finishes, so it no longer owns its IP.
    fake.apply(
        PODS,
        pod(
            "default",
            "db-1",
            Some("node1"),
            json!({"role": "db"}),
            Some("10.65.0.12"),
            "Succeeded",
        ),
    );
    agent
        .until("db-1 finished", |m| is_wep_remove(m, "default/db-1"))
        .await;
    // DELETED: a Kubernetes NetworkPolicy goes.
    fake.delete(NETWORK_POLICIES, "default/named-port");
    agent
        .until("named-port removed", |m| {
            matches!(m, To::ActivePolicyRemove(r) if r.id.as_ref().is_some_and(|i| i.name == "knp.default.named-port"))
        })
        .await;
    // A bookmark moves the watch's resourceVersion along and is not a change.
    fake.bookmark();
    fake.apply(
        PODS,
        pod(
            "default",
            "db-2",
            Some("node1"),
            json!({"role": "db"}),
            Some("10.65.0.13"),
            "Running",
        ),
    );
    agent
        .until("db-2 added", |m| is_wep_update(m, "default/db-2"))
        .await;
    assert_eq!(fake.lists(PODS), pod_lists, "no re-list without a reason");

    // A change nobody is told about, then the watch expires (410 Gone): the server must list
    // again and sweep db-2, whose deletion it never saw as an event.
    fake.delete_silently(PODS, "default/db-2");
    fake.apply_silently(
        PODS,
        pod(
            "default",
            "db-3",
            Some("node1"),
            json!({"role": "db"}),
            Some("10.65.0.14"),
            "Running",
        ),
    );
    fake.expire();
    let after = agent
        .until("db-2 swept", |m| is_wep_remove(m, "default/db-2"))
        .await;
    let rest = if after.iter().any(|m| is_wep_update(m, "default/db-3")) {
        after
    } else {
        agent
            .until("db-3 listed", |m| is_wep_update(m, "default/db-3"))
            .await
    };
    assert!(
        rest.iter().all(|m| !is_wep_update(m, "default/db-0")),
        "unchanged objects are not resent: {rest:?}"
    );
    assert!(fake.lists(PODS) > pod_lists, "the expiry caused a re-list");
    let log = server.log_text();
    assert!(log.contains("410") || log.contains("re-listing"), "{log}");
    assert!(
        log.contains("hostendpoints.crd.projectcalico.org") && log.contains("not served"),
        "the missing CRD is reported: {log}"
    );
}

/// A deny every endpoint meets, as a GlobalNetworkPolicy CRD object.
fn deny_crd(spec: Value) -> Value {
    json!({"metadata": {"name": "deny-ssh",
                        "annotations": {"projectcalico.org/metadata": "{\"name\":\"deny-ssh\"}"}},
           "spec": spec})
}

fn deny_spec() -> Value {
    json!({"order": 1, "selector": "all()", "types": ["Ingress"],
           "ingress": [{"action": "Deny", "protocol": "TCP", "destination": {"ports": [22]}}]})
}

/// Invalid new versions of an enforced deny CRD, each followed by a valid change to another
/// object of the same collection (one watch, events in order: once the agent has that change,
/// the server has processed the bad version): the agents keep the deny exactly as it was, the
/// object is reported as held, and a 410 re-list does not drop it either. Deleting the object is
/// how the deny goes. Real server and dry-run agent against the fake API server.
#[test]
fn invalid_crd_versions_of_a_deny_leave_it_in_force_on_the_agents() {
    use integration::Agent as DryRunAgent;
    let fake = FakeKube::start(INSTALLED_CRDS);
    seed(&fake);
    let gnps = crd("globalnetworkpolicies");
    fake.apply(&gnps, deny_crd(deny_spec()));
    let dir = tempfile::tempdir().unwrap();
    let cfg = fake.kubeconfig(dir.path());
    let server = Server::start_with(
        &[
            "--datastore-type",
            "kubernetes",
            "--kubeconfig",
            cfg.to_str().unwrap(),
        ],
        dir.path().join("server.log"),
        free_port(),
        &[],
    );
    let agent = DryRunAgent::start(dir.path(), &server.grpc, "node1");
    let policies = |s: &Value| -> Vec<String> {
        s["policies"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    };
    const DENY: &str = "GlobalNetworkPolicy/deny-ssh";
    let before = agent.wait_for("the deny in force", |s| {
        s["in_sync"] == true && policies(s).iter().any(|p| p == DENY)
    })["policies"][DENY]
        .clone();
    assert!(before.to_string().contains("deny"), "{before}");

    let mut selector_typo = deny_spec();
    selector_typo["selectr"] = selector_typo["selector"].take();
    let bad_versions = [
        ("a selector that does not parse", {
            let mut s = deny_spec();
            s["selector"] = "all(".into();
            deny_crd(s)
        }),
        ("a misspelt field", deny_crd(selector_typo)),
        ("an unknown action", {
            let mut s = deny_spec();
            s["ingress"][0]["action"] = "Maybe".into();
            deny_crd(s)
        }),
        ("a v3 name with a newline", {
            let mut o = deny_crd(deny_spec());
            o["metadata"]["annotations"]["projectcalico.org/metadata"] =
                "{\"name\":\"deny-ssh\\nx\"}".into();
            o
        }),
        ("a metadata annotation that is not JSON", {
            let mut o = deny_crd(deny_spec());
            o["metadata"]["annotations"]["projectcalico.org/metadata"] = "{".into();
            o
        }),
        (
            "a spec that is not an object",
            deny_crd(json!("deny everything")),
        ),
    ];
    let marker = |n: usize| {
        json!({"metadata": {"name": format!("marker-{n}")},
               "spec": {"selector": "all()", "types": ["Ingress"], "ingress": [{"action": "Allow"}]}})
    };
    for (n, (what, bad)) in bad_versions.into_iter().enumerate() {
        fake.apply(&gnps, bad);
        fake.apply(&gnps, marker(n));
        let name = format!("GlobalNetworkPolicy/marker-{n}");
        let state = agent.wait_for(&format!("the marker after {what}"), |s| {
            policies(s).contains(&name)
        });
        assert_eq!(
            state["policies"][DENY], before,
            "{what}: the deny must stay in force as it was"
        );
        let (_, body) = integration::http_get(&server.admin, "/status/datastore").unwrap();
        assert!(
            body.contains("deny-ssh") && body.contains("held_last_good"),
            "{what}: {body}"
        );
        let health: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            health["held_last_good"].as_array().map(Vec::len),
            Some(1),
            "{what}: {health}"
        );
    }

    // Never taken out, even for a moment: the agent added it once and never changed it.
    let changes = agent
        .log_text()
        .lines()
        .filter(|l| l.contains("dry-run: policy") && l.contains("deny-ssh"))
        .count();
    assert_eq!(changes, 1, "{}", agent.log_text());

    // The watch expires: the re-list sees the same bad version and keeps the deny.
    let lists = fake.lists(&gnps);
    fake.expire();
    fake.apply(&gnps, marker(100));
    let state = agent.wait_for("the marker after the re-list", |s| {
        policies(s).contains(&"GlobalNetworkPolicy/marker-100".to_string())
    });
    assert!(fake.lists(&gnps) > lists, "the expiry caused a re-list");
    assert_eq!(state["policies"][DENY], before, "kept across the re-list");

    // Deleting the object is how the deny goes.
    fake.delete(&gnps, "deny-ssh");
    agent.wait_for("the deny deleted", |s| {
        !policies(s).iter().any(|p| p == DENY)
    });
}
