//! Flow logs on the calc-server (issue 42), end to end: `calc-server serve --flow-logs` on a
//! small file datastore, raw gRPC clients standing in for two nodes' agents: they offer
//! `flows`, read their snapshot, and send `FlowReport`s. Asserted with exact values: the admin
//! `/flows` answer (names, namespaces, types, labels, port, action, counters, the enforced
//! trace with an end-of-tier trigger), `calc-server flows` in text, `--trace` and JSON, a
//! record whose reporting side is another node's endpoint refused and counted, a re-sent
//! interval not counted twice, a malformed report ending the stream, and a server without
//! `--flow-logs` not agreeing to `flows`.
//!
//! Nothing to install; a missing or stale binary fails.

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use felix_proto as pb;
use felix_proto::calc_server_client::CalcServerClient;
use felix_proto::goldmane as gm;
use integration::{Server, binary, http_get, metric};
use pb::from_dataplane::Payload as From;
use pb::to_dataplane::Payload as To;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

const CLUSTER: &str = r#"
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: security}
spec: {order: 100, defaultAction: Deny}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: security.guard}
spec:
  tier: security
  order: 10
  selector: app == 'db'
  ingress:
  - action: Pass
    protocol: TCP
    source: {selector: app == 'web'}
---
apiVersion: projectcalico.org/v3
kind: StagedGlobalNetworkPolicy
metadata: {name: security.trial}
spec:
  tier: security
  order: 1
  selector: app == 'db'
  ingress:
  - action: Deny
    protocol: TCP
    destination: {ports: [5432]}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: db-allow, namespace: shop}
spec:
  selector: app == 'db'
  ingress:
  - action: Allow
    protocol: TCP
    destination: {ports: [5432]}
---
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.shop}
spec:
  ingress: [{action: Allow}]
  egress: [{action: Allow}]
---
apiVersion: projectcalico.org/v3
kind: NetworkSet
metadata: {name: partners, namespace: shop}
spec: {nets: [203.0.113.0/24]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--1-k8s-web--1-eth0
  namespace: shop
  labels: {app: web, projectcalico.org/namespace: shop, projectcalico.org/orchestrator: k8s}
spec:
  orchestrator: k8s
  node: node-1
  pod: web-1
  endpoint: eth0
  interfaceName: caliweb1
  ipNetworks: [10.65.1.10/32]
  profiles: [kns.shop]
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--2-k8s-db--1-eth0
  namespace: shop
  labels: {app: db, projectcalico.org/namespace: shop, projectcalico.org/orchestrator: k8s}
spec:
  orchestrator: k8s
  node: node-2
  pod: db-1
  endpoint: eth0
  interfaceName: calidb1
  ipNetworks: [10.65.2.20/32]
  profiles: [kns.shop]
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec:
  clusterIP: 10.96.0.20
  ports: [{name: pg, port: 5432, targetPort: 5432}]
"#;

fn datastore() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("cluster.yaml"), CLUSTER).expect("write");
    dir
}

struct Agent {
    tx: mpsc::Sender<pb::FromDataplane>,
    rx: tonic::Streaming<pb::ToDataplane>,
    out: u64,
}

impl Agent {
    /// Says hello for `node` offering `flows`, reads the snapshot to InSync; returns the
    /// capabilities the server agreed to.
    async fn connect(url: &str, node: &str) -> (Agent, Vec<String>) {
        let mut client = CalcServerClient::connect(url.to_string())
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(16);
        tx.send(pb::FromDataplane {
            sequence_number: 1,
            payload: Some(From::AgentHello(pb::AgentHello {
                node_name: node.into(),
                agent_version: "test".into(),
                capabilities: vec!["flows".into()],
            })),
        })
        .await
        .unwrap();
        let mut rx = client
            .sync(ReceiverStream::new(rx))
            .await
            .expect("Sync")
            .into_inner();
        let mut agreed = Vec::new();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(10), rx.next())
                .await
                .expect("a message within 10 s")
                .expect("stream open")
                .expect("no error");
            match m.payload.expect("payload") {
                To::ServerHello(h) => agreed = h.capabilities,
                To::InSync(_) => break,
                _ => {}
            }
        }
        (Agent { tx, rx, out: 1 }, agreed)
    }

    async fn send(&mut self, records: Vec<pb::FlowRecord>) {
        self.out += 1;
        self.tx
            .send(pb::FromDataplane {
                sequence_number: self.out,
                payload: Some(From::FlowReport(pb::FlowReport {
                    records,
                    dropped: 0,
                })),
            })
            .await
            .expect("stream open");
    }

    /// The status the server ended the stream with (`None`: still open after 10 s).
    async fn ended(&mut self) -> Option<tonic::Status> {
        loop {
            match tokio::time::timeout(Duration::from_secs(10), self.rx.next()).await {
                Err(_) => return None,
                Ok(None) => return Some(tonic::Status::ok("")),
                Ok(Some(Err(e))) => return Some(e),
                Ok(Some(Ok(_))) => {}
            }
        }
    }
}

fn policy_rule(kind: &str, ns: &str, name: &str, index: u32, action: &str) -> pb::FlowRuleHit {
    pb::FlowRuleHit {
        rule: Some(pb::RuleRef {
            kind: pb::rule_ref::Kind::PolicyRule as i32,
            policy: Some(pb::PolicyId {
                name: name.into(),
                namespace: ns.into(),
                kind: kind.into(),
            }),
            index,
            ..Default::default()
        }),
        action: action.into(),
    }
}

fn end_of_tier(tier: &str) -> pb::FlowRuleHit {
    pb::FlowRuleHit {
        rule: Some(pb::RuleRef {
            kind: pb::rule_ref::Kind::EndOfTier as i32,
            tier: tier.into(),
            ..Default::default()
        }),
        action: "deny".into(),
    }
}

/// The interval that ended most recently (well inside the hour the server keeps).
fn interval() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    now - now % 15 - 15
}

/// web-1 → db-1:5432, allowed (security.guard passes, db-allow rule 0 allows), as db-1's
/// node reports it.
fn allowed(at: i64) -> pb::FlowRecord {
    pb::FlowRecord {
        interval_start: at,
        source_ip: "10.65.1.10".into(),
        dest_ip: "10.65.2.20".into(),
        source_port: 40_000,
        dest_port: 5432,
        protocol: 6,
        reporter_dest: true,
        trace: vec![
            policy_rule("GlobalNetworkPolicy", "", "security.guard", 0, "pass"),
            policy_rule("NetworkPolicy", "shop", "db-allow", 0, "allow"),
        ],
        allowed: true,
        packets_in: 10,
        packets_out: 8,
        bytes_in: 1000,
        bytes_out: 800,
        connections_started: 1,
        connections_completed: 1,
        connections_live: 0,
        // db-1's node saw no translation.
        original_dest_ip: String::new(),
        original_dest_port: 0,
    }
}

/// partners (203.0.113.9) → db-1:22, denied at the end of tier security.
fn denied(at: i64) -> pb::FlowRecord {
    pb::FlowRecord {
        interval_start: at,
        source_ip: "203.0.113.9".into(),
        dest_ip: "10.65.2.20".into(),
        source_port: 50_000,
        dest_port: 22,
        protocol: 6,
        reporter_dest: true,
        trace: vec![end_of_tier("security")],
        allowed: false,
        packets_in: 2,
        bytes_in: 120,
        connections_started: 1,
        ..Default::default()
    }
}

fn flows(server: &Server, query: &str) -> Value {
    let query = format!("/flows?format=goldmane{}", query.replacen('?', "&", 1));
    let (code, body) = http_get(&server.admin, &query).expect("admin answers");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("JSON")
}

fn wait_flows(server: &Server, n: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = flows(server, "");
        if v["flows"].as_array().map_or(0, Vec::len) == n {
            return v;
        }
        assert!(Instant::now() < deadline, "never {n} flows: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn refused(server: &Server, reason: &str) -> f64 {
    let (_, text) = http_get(&server.admin, "/metrics").expect("metrics");
    metric(
        &text,
        &format!("calc_server_flow_reports_refused_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

fn cli(server: &Server, args: &[&str]) -> String {
    let out = Command::new(binary("calc-server"))
        .args(["flows", "--server", &server.admin])
        .args(args)
        .output()
        .expect("run calc-server flows");
    assert!(
        out.status.success(),
        "flows {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

#[tokio::test(flavor = "multi_thread")]
async fn flow_reports_are_named_counted_once_and_listed() {
    let dir = datastore();
    let server = Server::start(dir.path(), &["--flow-logs"]);
    let (mut node2, agreed) = Agent::connect(&server.grpc, "node-2").await;
    assert_eq!(agreed, ["flows"]);
    let (mut node1, _) = Agent::connect(&server.grpc, "node-1").await;
    let at = interval();

    node2.send(vec![allowed(at), denied(at)]).await;
    // The same interval again, as after a reconnect: not counted twice.
    node2.send(vec![allowed(at)]).await;
    // node-1 may not report db-1's side (a forgery); its own side of web-1 is fine.
    node1
        .send(vec![
            denied(at),
            pb::FlowRecord {
                reporter_dest: false,
                trace: vec![pb::FlowRuleHit {
                    rule: Some(pb::RuleRef {
                        kind: pb::rule_ref::Kind::ProfileRule as i32,
                        profile: Some(pb::ProfileId {
                            name: "kns.shop".into(),
                        }),
                        egress: true,
                        ..Default::default()
                    }),
                    action: "allow".into(),
                }],
                // web-1 dialled the Service db; its node translated that to db-1.
                original_dest_ip: "10.96.0.20".into(),
                original_dest_port: 5432,
                ..allowed(at)
            },
        ])
        .await;
    let v = wait_flows(&server, 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    while refused(&server, "duplicate") < 1.0 || refused(&server, "foreign") < 1.0 {
        assert!(Instant::now() < deadline, "refusals never counted");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(refused(&server, "duplicate"), 1.0);
    assert_eq!(refused(&server, "foreign"), 1.0);

    let all: Vec<&Value> = v["flows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["flow"])
        .collect();
    let find = |port: &str, reporter: &str| {
        *all.iter()
            .find(|f| f["Key"]["dest_port"] == port && f["Key"]["reporter"] == reporter)
            .unwrap_or_else(|| panic!("no flow to {port} reported by {reporter}: {v}"))
    };
    let allowed_dst = find("5432", "Dst");
    assert_eq!(
        allowed_dst["Key"],
        json!({
            "source_name": "web-1", "source_namespace": "shop", "source_type": "WorkloadEndpoint",
            "dest_name": "db-1", "dest_namespace": "shop", "dest_type": "WorkloadEndpoint",
            "dest_port": "5432", "proto": "tcp", "reporter": "Dst", "action": "Allow",
            // Sent before the source's report, which names the Service: not joined.
            "dest_service_name": "-", "dest_service_namespace": "-",
            "dest_service_port_name": "-",
            "policies": {"enforced_policies": [
                {"kind": "GlobalNetworkPolicy", "name": "security.guard", "tier": "security",
                 "action": "Pass"},
                {"kind": "CalicoNetworkPolicy", "namespace": "shop", "name": "db-allow",
                 "tier": "default", "action": "Allow", "policy_index": "1"},
            ],
            // The staged policy, enforced, would deny it.
            "pending_policies": [
                {"kind": "StagedGlobalNetworkPolicy", "name": "security.trial",
                 "tier": "security", "action": "Deny"},
            ]},
        })
    );
    assert_eq!(allowed_dst["start_time"], at.to_string());
    assert_eq!(allowed_dst["end_time"], (at + 15).to_string());
    assert_eq!(
        (
            &allowed_dst["packets_in"],
            &allowed_dst["packets_out"],
            &allowed_dst["bytes_in"],
            &allowed_dst["bytes_out"],
            &allowed_dst["num_connections_started"],
            &allowed_dst["num_connections_completed"],
        ),
        (
            &json!("10"),
            &json!("8"),
            &json!("1000"),
            &json!("800"),
            &json!("1"),
            &json!("1")
        ),
        "counted once: {allowed_dst}"
    );
    // Calico's own labels are left out, as in Calico's flow logs.
    assert_eq!(allowed_dst["source_labels"], json!(["app=web"]));
    let denied_dst = find("22", "Dst");
    assert_eq!(denied_dst["Key"]["source_name"], "partners");
    assert_eq!(denied_dst["Key"]["source_namespace"], "shop");
    assert_eq!(denied_dst["Key"]["source_type"], "NetworkSet");
    assert_eq!(denied_dst["Key"]["action"], "Deny");
    assert_eq!(
        denied_dst["Key"]["policies"]["enforced_policies"],
        json!([{"kind": "EndOfTier", "tier": "security", "action": "Deny",
                "trigger": {"kind": "GlobalNetworkPolicy", "name": "security.guard",
                            "tier": "security"}}])
    );
    // Pending, the staged policy is the first of the tier to select db-1: it triggers.
    assert_eq!(
        denied_dst["Key"]["policies"]["pending_policies"],
        json!([{"kind": "EndOfTier", "tier": "security", "action": "Deny",
                "trigger": {"kind": "StagedGlobalNetworkPolicy", "name": "security.trial",
                            "tier": "security"}}])
    );
    let from_web = find("5432", "Src");
    assert_eq!(from_web["Key"]["source_name"], "web-1");
    assert_eq!(from_web["Key"]["dest_name"], "db-1");
    // The address web-1 dialled names the destination Service.
    assert_eq!(
        (
            &from_web["Key"]["dest_service_name"],
            &from_web["Key"]["dest_service_namespace"],
            &from_web["Key"]["dest_service_port_name"],
            &from_web["Key"]["dest_service_port"]
        ),
        (&json!("db"), &json!("shop"), &json!("pg"), &json!("5432")),
        "{from_web}"
    );

    // The staged policy's hit counts come from the pending traces: the allowed flow its rule
    // would deny, 10 + 8 packets, 1000 + 800 bytes.
    let (code, body) = http_get(&server.admin, "/status/policies").expect("admin answers");
    assert_eq!(code, 200, "{body}");
    let rows: Value = serde_json::from_str(&body).expect("JSON");
    let trial = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["policy"] == "security.trial")
        .unwrap_or_else(|| panic!("no row for security.trial: {rows}"));
    assert_eq!(
        (&trial["kind"], &trial["hits"], &trial["bytes"]),
        (
            &json!("StagedGlobalNetworkPolicy"),
            &json!(18),
            &json!(1800)
        ),
        "{trial}"
    );

    // Filters as query parameters.
    let denies = flows(&server, "?action=deny");
    assert_eq!(denies["flows"].as_array().unwrap().len(), 1, "{denies}");
    let by_policy = flows(&server, "?policy=np:shop/db-allow");
    assert_eq!(
        by_policy["flows"].as_array().unwrap().len(),
        1,
        "{by_policy}"
    );

    // The flows as Whisker's backend serves them, with Whisker's filter parameter.
    let whisker = |path: &str| -> Value {
        let (code, body) = http_get(&server.admin, path).expect("admin answers");
        assert_eq!(code, 200, "{path}: {body}");
        serde_json::from_str(&body).expect("JSON")
    };
    let denied = whisker(
        "/flows?filters=%7B%22actions%22%3A%5B%22Deny%22%5D%7D&sortBy=DestName&startTimeGte=-3600",
    );
    assert_eq!(
        denied["total"],
        json!({"totalPages": 1, "totalResults": 1}),
        "{denied}"
    );
    let w = &denied["items"][0];
    assert_eq!(
        (&w["source_name"], &w["source_namespace"], &w["dest_name"]),
        (&json!("partners"), &json!("shop"), &json!("db-1")),
        "{w}"
    );
    assert_eq!(
        (
            &w["action"],
            &w["reporter"],
            &w["protocol"],
            &w["dest_port"]
        ),
        (&json!("Deny"), &json!("Dst"), &json!("tcp"), &json!(22)),
        "{w}"
    );
    assert_eq!(
        w["policies"]["enforced"][0]["trigger"]["name"], "security.guard",
        "{w}"
    );
    assert!(
        w["start_time"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{w}"
    );
    // A filter Whisker's backend does not know is refused, naming it.
    let (code, body) = http_get(&server.admin, "/flows?filters=%7B%22colour%22%3A%5B%5D%7D")
        .expect("admin answers");
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("colour"), "{body}");

    // Filter hints, as Whisker's backend serves them (its type names, and ours).
    for kind in ["SourceName", "source_name"] {
        let hints = whisker(&format!("/flows-filter-hints?type={kind}"));
        assert_eq!(
            hints["items"],
            json!([{"value": "partners"}, {"value": "web-1"}]),
            "{hints}"
        );
        assert_eq!(hints["total"]["totalResults"], 2, "{hints}");
    }
    let (code, body) = http_get(
        &server.admin,
        "/flows-filter-hints?type=SourceName&format=goldmane",
    )
    .expect("admin answers");
    assert_eq!(code, 200, "{body}");
    let hints: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(hints["hints"].as_array().map(Vec::len), Some(2), "{hints}");

    // Goldmane's gRPC API on the admin endpoint, as a client generated from its schema
    // calls it.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.admin))
        .unwrap()
        .connect()
        .await
        .expect("connect to the admin endpoint");
    let mut goldmane = gm::flows_client::FlowsClient::new(channel.clone());
    let listed = goldmane
        .list(gm::FlowListRequest {
            filter: Some(gm::Filter {
                actions: vec![gm::Action::Deny as i32],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("Flows.List")
        .into_inner();
    assert_eq!(listed.flows.len(), 1);
    let key = listed.flows[0].flow.as_ref().unwrap().key.clone().unwrap();
    assert_eq!(
        (
            key.source_name.as_str(),
            key.dest_name.as_str(),
            key.dest_port
        ),
        ("partners", "db-1", 22)
    );
    let hints = goldmane
        .filter_hints(gm::FilterHintsRequest {
            r#type: gm::FilterType::DestName as i32,
            ..Default::default()
        })
        .await
        .expect("Flows.FilterHints")
        .into_inner();
    assert_eq!(
        hints
            .hints
            .iter()
            .map(|h| h.value.as_str())
            .collect::<Vec<_>>(),
        ["db-1"]
    );
    let mut stats = gm::statistics_client::StatisticsClient::new(channel)
        .list(gm::StatisticsRequest {
            r#type: gm::StatisticType::PacketCount as i32,
            group_by: gm::StatisticsGroupBy::Policy as i32,
            policy_match: Some(gm::PolicyMatch {
                name: "db-allow".into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("Statistics.List")
        .into_inner();
    let first = stats.next().await.expect("one result").expect("no error");
    assert_eq!(first.policy.as_ref().unwrap().name, "db-allow");
    // db-1's ingress report: 10 packets in, 8 out, allowed by db-allow.
    assert_eq!(
        (first.allowed_in.clone(), first.allowed_out.clone()),
        (vec![10], vec![8])
    );
    assert!(stats.next().await.is_none());

    // The CLI: one line per flow, the deciding rule last.
    let text = cli(&server, &["--action", "deny", "--since", "10m"]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    let cells: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        cells[1..],
        [
            "netset:shop/partners",
            "shop/db-1",
            "tcp/22",
            "deny",
            "dst",
            "2/0",
            "120/0",
            "security",
            "end-of-tier",
            "deny",
            "(after",
            "GlobalNetworkPolicy",
            "security.guard)"
        ],
        "{text}"
    );
    let text = cli(&server, &["--port", "5432", "--name", "db-1", "--trace"]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 7, "two flows of db-1 on 5432: {text}");
    // The two flows come in the order they were stored (same time): find each one's block.
    let dst = lines
        .iter()
        .position(|l| l.contains("  dst  "))
        .expect("the destination's flow");
    assert_eq!(
        lines[dst + 1..dst + 4],
        [
            "  enforced 0: security GlobalNetworkPolicy security.guard rule 0 pass",
            "  enforced 1: default CalicoNetworkPolicy shop/db-allow rule 0 allow",
            "  pending 0: security StagedGlobalNetworkPolicy security.trial rule 0 deny",
        ],
        "{text}"
    );
    let src = lines
        .iter()
        .position(|l| l.contains("  src  "))
        .expect("the source's flow");
    assert!(
        lines[src].ends_with("  1000/800  __PROFILE__ Profile kns.shop rule 0 allow"),
        "{text}"
    );
    assert_eq!(
        lines[src + 1..src + 3],
        [
            "  enforced 0: __PROFILE__ Profile kns.shop rule 0 allow",
            "  pending 0: __PROFILE__ Profile kns.shop rule 0 allow"
        ],
        "{text}"
    );
    let json_out = cli(&server, &["--namespace", "shop", "--output", "json"]);
    let objects: Vec<Value> = json_out
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(objects.len(), 3);
    assert!(objects.iter().all(|o| o["Key"]["action"].is_string()));

    // A malformed report ends the stream with INVALID_ARGUMENT and is counted.
    node1
        .send(vec![pb::FlowRecord {
            interval_start: at + 1,
            ..allowed(at)
        }])
        .await;
    let status = node1.ended().await.expect("the stream ends");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("interval_start"),
        "{}",
        status.message()
    );
    assert_eq!(refused(&server, "malformed"), 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_flow_logs_the_server_takes_no_flow_reports() {
    let dir = datastore();
    let server = Server::start(dir.path(), &[]);
    let (mut agent, agreed) = Agent::connect(&server.grpc, "node-2").await;
    assert!(agreed.is_empty(), "{agreed:?}");
    agent.send(vec![allowed(interval())]).await;
    let status = agent.ended().await.expect("the stream ends");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("\"flows\" capability"),
        "{}",
        status.message()
    );
    assert_eq!(refused(&server, "not_negotiated"), 1.0);
    let (code, body) = http_get(&server.admin, "/flows").expect("admin answers");
    assert_eq!(code, 404, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn follow_prints_closed_intervals_as_they_come() {
    use std::io::BufRead;
    let dir = datastore();
    let server = Server::start(dir.path(), &["--flow-logs"]);
    let (mut node2, _) = Agent::connect(&server.grpc, "node-2").await;
    // Two intervals that closed well before now.
    let old = interval() - 30;
    node2.send(vec![allowed(old - 15), allowed(old)]).await;
    wait_flows(&server, 1);
    let mut child = Command::new(binary("calc-server"))
        .args(["flows", "--server", &server.admin, "--follow"])
        .args(["--output", "json", "--port", "5432"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run calc-server flows --follow");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            if tx.send(line.expect("UTF-8")).is_err() {
                return;
            }
        }
    });
    let mut starts = Vec::new();
    for _ in 0..2 {
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a flow within 10 s");
        let f: Value = serde_json::from_str(&line).expect("JSON");
        assert_eq!(f["Key"]["dest_name"], "db-1");
        starts.push(f["start_time"].as_str().unwrap().to_string());
    }
    // One line per interval, oldest first, each once.
    assert_eq!(starts, [(old - 15).to_string(), old.to_string()]);
    assert!(
        rx.recv_timeout(Duration::from_secs(6)).is_err(),
        "printed once"
    );
    let _ = child.kill();
    let _ = child.wait();

    // /flows?watch=true: server-sent events, one per flow and interval, each a flow as
    // Whisker's backend writes it.
    {
        use std::io::{Read, Write};
        let mut sock = std::net::TcpStream::connect(&server.admin).expect("connect");
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        write!(
            sock,
            "GET /flows?watch=true&dest_port=5432 HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        .unwrap();
        let mut seen = String::new();
        let mut buf = [0u8; 4096];
        while seen.matches("data: ").count() < 2 {
            let n = sock.read(&mut buf).expect("events within 10 s");
            assert!(n > 0, "closed early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
        assert!(seen.contains("content-type: text/event-stream"), "{seen}");
        let events: Vec<Value> = seen
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).expect("JSON"))
            .collect();
        let starts: Vec<&str> = events
            .iter()
            .map(|e| e["start_time"].as_str().expect("an RFC 3339 start"))
            .collect();
        assert!(
            starts.len() == 2 && starts[0] < starts[1],
            "two intervals, oldest first: {seen}"
        );
        assert!(
            events
                .iter()
                .all(|e| e["dest_name"] == "db-1" && e["dest_port"] == 5432),
            "{seen}"
        );
    }

    // Goldmane's Flows.Stream: the same two intervals, oldest first, then nothing new.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.admin))
        .unwrap()
        .connect()
        .await
        .expect("connect to the admin endpoint");
    let mut stream = gm::flows_client::FlowsClient::new(channel)
        .stream(gm::FlowStreamRequest {
            start_time_gte: -600,
            ..Default::default()
        })
        .await
        .expect("Flows.Stream")
        .into_inner();
    let mut starts = Vec::new();
    for _ in 0..2 {
        let r = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("a flow within 10 s")
            .expect("stream open")
            .expect("no error");
        let f = r.flow.unwrap();
        assert_eq!(f.key.unwrap().dest_name, "db-1");
        starts.push(f.start_time);
    }
    assert_eq!(starts, [old - 15, old]);
    assert!(
        tokio::time::timeout(Duration::from_secs(6), stream.next())
            .await
            .is_err(),
        "each interval sent once"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_sends_at_most_its_rate_of_records() {
    let dir = datastore();
    // One record a second: 15 of burst.
    let server = Server::start(
        dir.path(),
        &["--flow-logs", "--flow-max-records-per-second", "1"],
    );
    let (mut node2, _) = Agent::connect(&server.grpc, "node-2").await;
    let at = interval();
    let records: Vec<pb::FlowRecord> = (0..20)
        .map(|i| pb::FlowRecord {
            source_port: 40_000 + i,
            ..allowed(at)
        })
        .collect();
    node2.send(records).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while refused(&server, "rate") < 5.0 {
        assert!(Instant::now() < deadline, "rate refusals never counted");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The 15 kept are one flow key (ports other than the destination's are not in it).
    let v = wait_flows(&server, 1);
    assert_eq!(v["flows"][0]["flow"]["packets_in"], "150", "{v}");
    assert_eq!(refused(&server, "rate"), 5.0);
    assert!(node2.ended().await.is_none(), "the stream stays open");
}

#[tokio::test(flavor = "multi_thread")]
async fn goldmanes_api_has_a_listener_of_its_own_on_request() {
    let dir = datastore();
    let port = integration::free_port();
    let listen = format!("127.0.0.1:{port}");
    let server = Server::start(dir.path(), &["--flow-logs", "--flows-listen", &listen]);
    let (mut node2, _) = Agent::connect(&server.grpc, "node-2").await;
    node2.send(vec![allowed(interval())]).await;
    wait_flows(&server, 1);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{listen}"))
        .unwrap()
        .connect()
        .await
        .expect("connect to --flows-listen");
    let listed = gm::flows_client::FlowsClient::new(channel)
        .list(gm::FlowListRequest::default())
        .await
        .expect("Flows.List")
        .into_inner();
    assert_eq!(listed.flows.len(), 1);
    // Only Goldmane's services there.
    let (code, _) = http_get(&listen, "/status").expect("answers");
    assert_eq!(code, 404);

    // Not on a non-loopback address without admin authentication.
    let out = Command::new(binary("calc-server"))
        .args(["serve", "--file-dir", dir.path().to_str().unwrap()])
        .args(["--flow-logs", "--flows-listen", "0.0.0.0:0"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .output()
        .expect("run calc-server serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--flows-listen 0.0.0.0:0 is not a loopback address"),
        "{err}"
    );
}
