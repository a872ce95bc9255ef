//! Policy recommendations (issue 45), end to end: `calc-server serve --flow-logs` on a file
//! datastore holding a three-tier application in namespace `shop` (web → api → db, DNS to
//! kube-dns in kube-system, api to an external address in the NetworkSet `payments`), no
//! policy but the namespaces' allow-all profiles; raw gRPC clients stand in for the two
//! nodes' agents and report the application's flows (both sides of each). Then, as an
//! operator would:
//! 1. `calc-server recommend` prints three staged policies, written into the datastore
//!    directory (the server loads them);
//! 2. `calc-server explain` on that directory: every observed pair is allowed, and stays
//!    allowed in the pending verdict; a set of unobserved pairs is allowed now and denied in
//!    the pending verdict;
//! 3. `--promote --file` prints the enforced policies; with them in place of the staged ones,
//!    `explain` allows every observed pair and denies every unobserved one;
//! 4. the flows reported again after staging: `--check` says zero breaks for each policy
//!    (exit 0);
//! 5. a new client of api after staging: `--check` names it as a break of
//!    `recommended-api` (exit 1) within one aggregation interval (15 s) of its report.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use felix_proto as pb;
use integration::stats_agent::StatsAgent;
use integration::{Server, binary};
use serde_json::Value;

const CLUSTER: &str = r#"
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.shop}
spec:
  ingress: [{action: Allow}]
  egress: [{action: Allow}]
  labelsToApply: {pcns.projectcalico.org/name: shop}
---
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.kube-system}
spec:
  ingress: [{action: Allow}]
  egress: [{action: Allow}]
  labelsToApply: {pcns.projectcalico.org/name: kube-system}
---
apiVersion: projectcalico.org/v3
kind: NetworkSet
metadata: {name: payments, namespace: shop, labels: {role: payments-api}}
spec: {nets: [203.0.113.0/24]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--1-k8s-web--7d9f8c6b5--abcde-eth0
  namespace: shop
  generateName: web-7d9f8c6b5-
  labels: {app: web, pod-template-hash: 7d9f8c6b5, projectcalico.org/namespace: shop, projectcalico.org/orchestrator: k8s}
spec:
  orchestrator: k8s
  node: node-1
  pod: web-7d9f8c6b5-abcde
  endpoint: eth0
  interfaceName: caliweb
  ipNetworks: [10.65.1.10/32]
  profiles: [kns.shop]
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--1-k8s-api--1-eth0
  namespace: shop
  labels: {app: api, projectcalico.org/namespace: shop, projectcalico.org/orchestrator: k8s}
spec:
  orchestrator: k8s
  node: node-1
  pod: api-1
  endpoint: eth0
  interfaceName: caliapi
  ipNetworks: [10.65.1.11/32]
  profiles: [kns.shop]
  ports: [{name: http, protocol: TCP, port: 8080}]
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--1-k8s-batch--1-eth0
  namespace: shop
  labels: {app: batch, projectcalico.org/namespace: shop, projectcalico.org/orchestrator: k8s}
spec:
  orchestrator: k8s
  node: node-1
  pod: batch-1
  endpoint: eth0
  interfaceName: calibatch
  ipNetworks: [10.65.1.12/32]
  profiles: [kns.shop]
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--2-k8s-db--0-eth0
  namespace: shop
  labels: {role: db, statefulset.kubernetes.io/pod-name: db-0, projectcalico.org/namespace: shop, projectcalico.org/orchestrator: k8s}
spec:
  orchestrator: k8s
  node: node-2
  pod: db-0
  endpoint: eth0
  interfaceName: calidb
  ipNetworks: [10.65.2.20/32]
  profiles: [kns.shop]
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--2-k8s-coredns--1-eth0
  namespace: kube-system
  labels: {k8s-app: kube-dns, projectcalico.org/namespace: kube-system, projectcalico.org/orchestrator: k8s}
spec:
  orchestrator: k8s
  node: node-2
  pod: coredns-1
  endpoint: eth0
  interfaceName: calidns
  ipNetworks: [10.65.2.53/32]
  profiles: [kns.kube-system]
  ports: [{name: dns, protocol: UDP, port: 53}]
"#;

/// An endpoint or address: the name explain takes, and its address.
type Peer = (&'static str, &'static str);
/// Source, destination, protocol, port.
type Conversation = (Peer, Peer, &'static str, u32);

const WEB: Peer = ("shop/web-7d9f8c6b5-abcde", "10.65.1.10");
const API: Peer = ("shop/api-1", "10.65.1.11");
const BATCH: Peer = ("shop/batch-1", "10.65.1.12");
const DB: Peer = ("shop/db-0", "10.65.2.20");
const DNS: Peer = ("kube-system/coredns-1", "10.65.2.53");
const PAYMENTS: Peer = ("203.0.113.10", "203.0.113.10");

/// The conversations the application has: source, destination, protocol, port.
const OBSERVED: [Conversation; 5] = [
    (WEB, API, "tcp", 8080),
    (API, DB, "tcp", 5432),
    (WEB, DNS, "udp", 53),
    (API, DNS, "udp", 53),
    (API, PAYMENTS, "tcp", 443),
];

/// Conversations never seen: allowed now (the profiles allow everything), denied once the
/// recommendation is enforced.
const UNOBSERVED: [Conversation; 7] = [
    (WEB, DB, "tcp", 5432),
    (DB, WEB, "tcp", 80),
    (BATCH, API, "tcp", 8080),
    (WEB, API, "tcp", 9090),
    (WEB, DNS, "tcp", 53),
    (API, ("198.51.100.7", "198.51.100.7"), "tcp", 443),
    (DB, DNS, "udp", 53),
];

/// The interval that ended most recently.
fn interval() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    now - now % 15 - 15
}

/// The node an address's workload runs on (`None`: not a workload).
fn node_of(ip: &str) -> Option<&'static str> {
    match ip {
        "10.65.1.10" | "10.65.1.11" | "10.65.1.12" => Some("node-1"),
        "10.65.2.20" => Some("node-2"),
        "10.65.2.53" => Some("node-2"),
        _ => None,
    }
}

/// One side's record of a conversation, allowed by the namespace's profile.
fn record(
    at: i64,
    src: &str,
    dst: &str,
    proto: &str,
    port: u32,
    dest_side: bool,
    source_port: u32,
) -> pb::FlowRecord {
    let ip = if dest_side { dst } else { src };
    let profile = if ip == DNS.1 {
        "kns.kube-system"
    } else {
        "kns.shop"
    };
    pb::FlowRecord {
        interval_start: at,
        source_ip: src.into(),
        dest_ip: dst.into(),
        source_port,
        dest_port: port,
        protocol: if proto == "udp" { 17 } else { 6 },
        reporter_dest: dest_side,
        trace: vec![pb::FlowRuleHit {
            rule: Some(pb::RuleRef {
                kind: pb::rule_ref::Kind::ProfileRule as i32,
                profile: Some(pb::ProfileId {
                    name: profile.into(),
                }),
                egress: !dest_side,
                ..Default::default()
            }),
            action: "allow".into(),
        }],
        allowed: true,
        packets_in: 10,
        packets_out: 10,
        bytes_in: 1000,
        bytes_out: 1000,
        connections_started: 1,
        ..Default::default()
    }
}

/// Both sides' records of the conversations, sent by the node each side runs on.
async fn report(
    nodes: &mut [(&str, StatsAgent)],
    at: i64,
    conversations: &[Conversation],
    source_port: u32,
) {
    for (node, agent) in nodes.iter_mut() {
        let mut records = Vec::new();
        for (src, dst, proto, port) in conversations {
            for dest_side in [false, true] {
                let ip = if dest_side { dst.1 } else { src.1 };
                if node_of(ip) == Some(*node) {
                    records.push(record(
                        at,
                        src.1,
                        dst.1,
                        proto,
                        *port,
                        dest_side,
                        source_port,
                    ));
                }
            }
        }
        if !records.is_empty() {
            agent.send_flows(records).await;
        }
    }
}

fn calc_server(args: &[&str]) -> Output {
    Command::new(binary("calc-server"))
        .args(args)
        .output()
        .expect("run calc-server")
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `explain --output json` on a datastore directory.
fn explain(dir: &Path, from: &str, to: &str, proto: &str, port: u32) -> Value {
    let out = calc_server(&[
        "explain",
        "--file-dir",
        dir.to_str().unwrap(),
        "--from",
        from,
        "--to",
        to,
        "--protocol",
        proto,
        "--port",
        &port.to_string(),
        "--output",
        "json",
    ]);
    assert!(
        out.status.success(),
        "explain {from} {to}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// The number of flow keys the server holds.
fn flow_keys(server: &Server) -> usize {
    let (code, body) =
        integration::http_get(&server.admin, "/flows?format=goldmane").expect("admin answers");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["flows"].as_array().map_or(0, Vec::len)
}

/// Polls `f` until it says done; it also says what it saw, for the failure message.
fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> (bool, String)) {
    let deadline = Instant::now() + timeout;
    loop {
        let (done, seen) = f();
        if done {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never: {what}; last seen: {seen}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn observed_flows_become_staged_policies_checked_on_live_traffic_then_enforced() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cluster.yaml"), CLUSTER).unwrap();
    let server = Server::start(dir.path(), &["--flow-logs"]);
    let mut nodes = vec![
        (
            "node-1",
            StatsAgent::connect(&server.grpc, "node-1", &["flows"]).await,
        ),
        (
            "node-2",
            StatsAgent::connect(&server.grpc, "node-2", &["flows"]).await,
        ),
    ];
    let at = interval();
    report(&mut nodes, at, &OBSERVED, 40_000).await;
    // 5 source reports and 4 destination reports (the external address reports nothing).
    wait_for("9 flow keys", Duration::from_secs(10), || {
        let n = flow_keys(&server);
        (n == 9, format!("{n} keys"))
    });

    // 1. The recommendation, into the datastore directory.
    let admin = server.admin.clone();
    let out = calc_server(&["recommend", "--server", &admin, "--namespace", "shop"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = text(&out);
    for name in ["recommended-api", "recommended-db", "recommended-web"] {
        assert!(yaml.contains(&format!("name: \"{name}\"")), "{yaml}");
    }
    assert_eq!(
        yaml.matches("kind: \"StagedNetworkPolicy\"").count(),
        3,
        "{yaml}"
    );
    assert!(
        yaml.contains("namespaceSelector: \"projectcalico.org/name == 'kube-system'\""),
        "DNS is a proper rule: {yaml}"
    );
    assert!(
        yaml.contains("selector: \"role == 'payments-api'\""),
        "{yaml}"
    );
    assert!(yaml.contains("- \"http\""), "the named port: {yaml}");
    std::fs::write(dir.path().join("recommended.yaml"), &yaml).unwrap();
    let out = calc_server(&["validate", dir.path().to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out),
        String::from_utf8_lossy(&out.stderr)
    );

    // 2. Staged: every observed pair allowed, and allowed in the pending verdict; the
    // unobserved ones allowed now, denied in the pending verdict.
    for (src, dst, proto, port) in OBSERVED {
        let v = explain(dir.path(), src.0, dst.0, proto, port);
        assert_eq!(v["verdict"], "allow", "{src:?} → {dst:?} {port}: {v:#}");
        assert_eq!(
            v["pending"]["verdict"], "allow",
            "{src:?} → {dst:?} {port}: {v:#}"
        );
    }
    for (src, dst, proto, port) in UNOBSERVED {
        let v = explain(dir.path(), src.0, dst.0, proto, port);
        assert_eq!(v["verdict"], "allow", "{src:?} → {dst:?} {port}: {v:#}");
        assert_eq!(
            v["pending"]["verdict"], "deny",
            "{src:?} → {dst:?} {port}: {v:#}"
        );
    }

    // 3. Promoted: the enforced policies in place of the staged ones.
    let out = calc_server(&[
        "recommend",
        "--promote",
        "--file",
        dir.path().join("recommended.yaml").to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let enforced = text(&out);
    assert_eq!(
        enforced.matches("kind: \"NetworkPolicy\"").count(),
        3,
        "{enforced}"
    );
    assert!(!enforced.contains("stagedAction"), "{enforced}");
    let promoted = tempfile::tempdir().unwrap();
    std::fs::write(promoted.path().join("cluster.yaml"), CLUSTER).unwrap();
    std::fs::write(promoted.path().join("enforced.yaml"), &enforced).unwrap();
    for (src, dst, proto, port) in OBSERVED {
        let v = explain(promoted.path(), src.0, dst.0, proto, port);
        assert_eq!(v["verdict"], "allow", "{src:?} → {dst:?} {port}: {v:#}");
    }
    for (src, dst, proto, port) in UNOBSERVED {
        let v = explain(promoted.path(), src.0, dst.0, proto, port);
        assert_eq!(v["verdict"], "deny", "{src:?} → {dst:?} {port}: {v:#}");
    }

    // 4. The server loaded the staged policies; the same traffic after staging breaks nothing.
    let check = |since: &str| {
        calc_server(&[
            "recommend",
            "--server",
            &admin,
            "--namespace",
            "shop",
            "--check",
            "--since",
            since,
        ])
    };
    wait_for(
        "the server holds the three staged policies",
        Duration::from_secs(10),
        || {
            let t = text(&check("10m"));
            (t.matches("StagedNetworkPolicy shop/").count() == 3, t)
        },
    );
    let keys_before = flow_keys(&server);
    report(&mut nodes, at, &OBSERVED, 41_000).await;
    // A record whose reporting endpoint a staged policy selects now carries a pending trace,
    // so it is a key of its own: all but coredns' two destination reports (no policy is
    // recommended in kube-system), which add to their keys.
    wait_for("the reports after staging", Duration::from_secs(10), || {
        let n = flow_keys(&server);
        (
            n == keys_before + 7,
            format!("{n} keys, {keys_before} before"),
        )
    });
    let out = check("10m");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        text(&out),
        "StagedNetworkPolicy shop/recommended-api: 0 flows would break: safe to promote\n\
         StagedNetworkPolicy shop/recommended-db: 0 flows would break: safe to promote\n\
         StagedNetworkPolicy shop/recommended-web: 0 flows would break: safe to promote\n"
    );

    // 5. A new client of api, after staging: a break within one aggregation interval.
    let sent = Instant::now();
    report(&mut nodes, interval(), &[(BATCH, API, "tcp", 8080)], 42_000).await;
    let mut last = String::new();
    wait_for(
        "the new flow named as a break",
        Duration::from_secs(15),
        || {
            let out = check("10m");
            last = text(&out);
            (out.status.code() == Some(1), last.clone())
        },
    );
    assert!(sent.elapsed() < Duration::from_secs(15));
    assert_eq!(
        last,
        "StagedNetworkPolicy shop/recommended-api: 1 flow would break\n  \
         shop/batch-1 -> shop/api-1 tcp/8080 (reported by dst, 1 intervals, 20 packets)\n\
         StagedNetworkPolicy shop/recommended-db: 0 flows would break: safe to promote\n\
         StagedNetworkPolicy shop/recommended-web: 0 flows would break: safe to promote\n"
    );
}
