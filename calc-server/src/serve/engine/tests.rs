//! The engine's rules, step by step, with in-memory queues standing in for agent streams.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use calc_graph::graph::Update;
use calc_graph::manifest::{Outcome, decode_and_validate};
use felix_proto::prost::Message as _;
use felix_proto::to_dataplane::Payload;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use super::super::metrics::Metrics;
use super::{BacklogSizing, CloseReason, Conn, Engine, Input, Limits, Out, Refusal};
use crate::status::Board;

const LIMITS: Limits = Limits {
    backlog: 1000,
    backlog_bytes: Some(1 << 30),
    concurrent_snapshots: 8,
    allow_unknown_nodes: false,
};

fn apply(value: serde_json::Value) -> Update {
    match decode_and_validate(value) {
        Outcome::Valid(_, res) => Update::ApplyValid(res),
        _ => panic!("test object must be valid"),
    }
}

fn workload(node: &str, pod: &str, ip: &str) -> Update {
    apply(json!({
        "apiVersion": "projectcalico.org/v3",
        "kind": "WorkloadEndpoint",
        "metadata": {
            // Calico's WorkloadEndpoint name: dashes inside each part doubled.
            "name": format!("{}-k8s-{}-eth0", node.replace('-', "--"), pod.replace('-', "--")),
            "namespace": "shop",
            "labels": {"app": "web", "projectcalico.org/namespace": "shop"},
        },
        "spec": {
            "orchestrator": "k8s", "node": node, "pod": pod, "endpoint": "eth0",
            "interfaceName": format!("cali{pod}"), "ipNetworks": [format!("{ip}/32")],
        },
    }))
}

fn node(name: &str) -> Update {
    apply(json!({
        "apiVersion": "projectcalico.org/v3", "kind": "Node",
        "metadata": {"name": name}, "spec": {},
    }))
}

fn web_policy(port: u16) -> Update {
    apply(json!({
        "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
        "metadata": {"name": "web"},
        "spec": {
            "selector": "app == 'web'",
            "ingress": [{"action": "Allow", "protocol": "TCP", "destination": {"ports": [port]}}],
        },
    }))
}

/// Two nodes with a web pod each, the policy selecting both, in sync.
fn cluster() -> Vec<Update> {
    vec![
        node("node-a"),
        node("node-b"),
        web_policy(80),
        workload("node-a", "web-1", "10.0.0.1"),
        workload("node-b", "web-2", "10.0.0.2"),
        Update::InSync,
    ]
}

struct Harness {
    engine: Engine,
    board: Arc<Board>,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    next_id: u64,
}

/// An agent stream as the engine sees it: the queue's receiving end and the stream's counters.
struct Agent {
    id: u64,
    rx: mpsc::UnboundedReceiver<Out>,
    taken: Arc<AtomicU64>,
    taken_bytes: Arc<AtomicU64>,
}

impl Agent {
    /// Everything queued so far, as the stream would take it.
    fn take(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        while let Ok(o) = self.rx.try_recv() {
            // A block is taken message by message, as the stream sends it.
            if let Out::Block(block) = &o {
                assert_eq!(o.count(), block.messages().len() as u64);
                let mut bytes = 0;
                for (msg, body) in block.messages().iter().zip(block.encoded()) {
                    let sent = felix_proto::ToDataplane::decode(body.as_slice()).expect("decodes");
                    assert_eq!(sent.payload, msg.payload, "the encoding is this message's");
                    self.taken.fetch_add(1, Ordering::Relaxed);
                    self.taken_bytes
                        .fetch_add(body.len() as u64, Ordering::Relaxed);
                    bytes += body.len() as u64;
                    out.push(Out::Msg(msg.clone(), body.len() as u64));
                }
                assert_eq!(o.len(), bytes, "backlogs count the bytes sent");
                continue;
            }
            if let (Some(msg), Some(body)) = (o.message(), o.encoded()) {
                // What goes on the wire is exactly the message the graph meant for this node.
                let sent = felix_proto::ToDataplane::decode(body.as_slice()).expect("decodes");
                assert_eq!(sent.payload, msg.payload, "the encoding is this message's");
                assert_eq!(o.len(), body.len() as u64, "backlogs count the bytes sent");
                self.taken.fetch_add(1, Ordering::Relaxed);
                self.taken_bytes
                    .fetch_add(body.len() as u64, Ordering::Relaxed);
            }
            out.push(o);
        }
        out
    }

    /// The payload kinds taken, in order ("close:<reason>" for a close).
    fn kinds(&mut self) -> Vec<String> {
        self.take()
            .into_iter()
            .map(|o| match o {
                Out::Close(reason) => format!("close:{reason:?}"),
                msg => kind(
                    msg.message()
                        .and_then(|m| m.payload.as_ref())
                        .expect("payload"),
                ),
            })
            .collect()
    }
}

fn kind(p: &Payload) -> String {
    format!("{p:?}")
        .split('(')
        .next()
        .unwrap_or_default()
        .to_string()
}

impl Harness {
    fn new(limits: Limits) -> Harness {
        let (board, metrics) = (Arc::new(Board::default()), Arc::new(Metrics::default()));
        let ready = Arc::new(AtomicBool::new(false));
        Harness {
            engine: Engine::new(limits, board.clone(), ready.clone(), metrics.clone()),
            board,
            metrics,
            ready,
            next_id: 1,
        }
    }

    fn datastore(&mut self, updates: Vec<Update>) {
        self.engine.step([Input::Datastore(updates)]);
        assert_eq!(
            self.metrics.rejections.total(),
            0,
            "every test object is accepted"
        );
    }

    /// Connects an agent for `node` and steps once; returns the verdict and the stream.
    fn connect(&mut self, node: &str) -> (Result<(), Refusal>, Agent) {
        let (tx, rx) = mpsc::unbounded_channel();
        let agent = Agent {
            id: self.next_id,
            rx,
            taken: Arc::new(AtomicU64::new(0)),
            taken_bytes: Arc::new(AtomicU64::new(0)),
        };
        self.next_id += 1;
        let conn = Conn::new(agent.id, tx, agent.taken.clone(), agent.taken_bytes.clone());
        let (reply, mut verdict) = oneshot::channel();
        self.engine.step([Input::Connect {
            node: node.into(),
            agent_version: "test".into(),
            conn,
            reply,
        }]);
        (
            verdict
                .try_recv()
                .expect("the engine answers in the same step"),
            agent,
        )
    }
}

#[test]
fn an_agent_gets_its_snapshot_then_deltas() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    assert!(
        h.ready.load(Ordering::Relaxed),
        "ready once the datastore is in sync"
    );
    let (verdict, mut a) = h.connect("node-a");
    assert_eq!(verdict, Ok(()));
    let snapshot = a.kinds();
    assert_eq!(snapshot.last().map(String::as_str), Some("InSync"));
    for needed in ["ActivePolicyUpdate", "WorkloadEndpointUpdate"] {
        assert!(
            snapshot.iter().any(|k| k == needed),
            "{needed} in {snapshot:?}"
        );
    }
    // A change to the node's pod arrives as a delta, not a new snapshot.
    h.datastore(vec![Update::Delete(
        match workload("node-a", "web-1", "10.0.0.1") {
            Update::ApplyValid(res) => res.resource().key(),
            _ => unreachable!(),
        },
    )]);
    let delta = a.kinds();
    assert!(
        delta.contains(&"WorkloadEndpointRemove".to_string()),
        "{delta:?}"
    );
    assert!(!delta.contains(&"InSync".to_string()), "{delta:?}");
    assert_eq!(h.board.snapshot().iter().filter(|n| n.connected).count(), 1);
}

#[test]
fn an_unknown_node_is_refused_once_the_datastore_is_in_sync() {
    let mut h = Harness::new(LIMITS);
    // Before the datastore is in sync nobody can tell: the agent waits for its snapshot.
    let (early, _early_agent) = h.connect("node-x");
    assert_eq!(early, Ok(()));
    h.datastore(cluster());
    let (verdict, mut agent) = h.connect("node-y");
    assert_eq!(
        verdict,
        Err(Refusal::UnknownNode {
            node: "node-y".into()
        })
    );
    assert!(agent.kinds().is_empty(), "a refused agent is sent nothing");
    assert_eq!(h.metrics.refused_unknown_nodes.get(), 1);

    let mut open = Harness::new(Limits {
        allow_unknown_nodes: true,
        ..LIMITS
    });
    open.datastore(cluster());
    let (verdict, mut agent) = open.connect("node-y");
    assert_eq!(verdict, Ok(()));
    // Config and InSync only: no endpoint lives there.
    let kinds = agent.kinds();
    assert_eq!(kinds.last().map(String::as_str), Some("InSync"));
    assert!(
        !kinds.iter().any(|k| k.starts_with("WorkloadEndpoint")),
        "{kinds:?}"
    );
}

#[test]
fn snapshots_are_admitted_a_few_at_a_time() {
    let mut h = Harness::new(Limits {
        concurrent_snapshots: 1,
        ..LIMITS
    });
    h.datastore(cluster());
    let (_, mut a) = h.connect("node-a");
    let (_, mut b) = h.connect("node-b");
    // node-a's snapshot is queued but not yet taken: node-b waits.
    let a_first: Vec<Out> = std::iter::from_fn(|| a.rx.try_recv().ok()).collect();
    assert!(!a_first.is_empty());
    h.engine.step([]);
    assert!(
        b.kinds().is_empty(),
        "node-b must wait while node-a's snapshot is in flight"
    );
    assert!(h.engine.busy());
    // node-a's stream takes its whole snapshot: the next step admits node-b.
    let messages: u64 = a_first.iter().map(Out::count).sum();
    a.taken.fetch_add(messages, Ordering::Relaxed);
    h.engine.step([]);
    let kinds = b.kinds();
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("InSync"),
        "{kinds:?}"
    );
    h.engine.step([]);
    assert!(!h.engine.busy(), "both snapshots delivered");
}

#[test]
fn the_default_backlog_bound_is_a_multiple_of_the_nodes_snapshot_within_its_limits() {
    let sizing = BacklogSizing::default();
    const MIB: u64 = 1024 * 1024;
    // Before a snapshot: 16 MiB.
    assert_eq!(sizing.bound(None), 16 * MIB);
    // A small node: its snapshot plus 16 MiB, far below the old 256 MiB for every node.
    assert_eq!(sizing.bound(Some(200 * 1024)), 16 * MIB + 200 * 1024);
    // Four times a mid-sized node's snapshot.
    assert_eq!(sizing.bound(Some(10 * MIB)), 40 * MIB);
    // The ceiling for a large one.
    assert_eq!(sizing.bound(Some(100 * MIB)), 256 * MIB);
    // A node whose snapshot is larger than the ceiling: the snapshot plus 16 MiB, so its
    // snapshot and the changes made while it is taken fit (else it could never finish one).
    assert_eq!(sizing.bound(Some(300 * MIB)), 316 * MIB);
    assert_eq!(sizing.bound(Some(u64::MAX)), u64::MAX);
}

#[test]
fn unset_the_backlog_bytes_bound_follows_each_nodes_snapshot() {
    let mut h = Harness::new(Limits {
        backlog_bytes: None,
        ..LIMITS
    });
    let sizing = BacklogSizing {
        factor: 2,
        min: 1,
        max: 1 << 20,
    };
    h.engine.set_backlog_sizing(sizing);
    let mut updates = cluster();
    // node-b holds more: a larger snapshot, so a larger bound.
    updates.splice(
        0..0,
        (0..20).map(|i| workload("node-b", &format!("extra-{i}"), &format!("10.1.0.{i}"))),
    );
    h.datastore(updates);
    let (_, mut a) = h.connect("node-a");
    let (_, mut b) = h.connect("node-b");
    // Each snapshot queued, none taken: the whole snapshot is the backlog.
    let snapshot = |agent: &mut Agent| -> u64 {
        std::iter::from_fn(|| agent.rx.try_recv().ok())
            .map(|o| o.len())
            .sum()
    };
    let (sa, sb) = (snapshot(&mut a), snapshot(&mut b));
    assert!(sb > sa, "{sb} > {sa}");
    // Policy changes until each is cut off: the bound each names is two times its snapshot.
    let mut limits = [None, None];
    let mut queued = [0u64, 0u64];
    for port in 81..2000 {
        h.datastore(vec![web_policy(port)]);
        for (i, agent) in [&mut a, &mut b].into_iter().enumerate() {
            while let Ok(o) = agent.rx.try_recv() {
                match o {
                    Out::Close(CloseReason::TooFarBehind { bytes_limit, .. }) => {
                        limits[i].get_or_insert(bytes_limit);
                    }
                    o => queued[i] += o.len(),
                }
            }
        }
        if limits.iter().all(Option::is_some) {
            break;
        }
    }
    assert_eq!(limits, [Some(2 * sa), Some(2 * sb)]);
    // Changes were taken behind each snapshot up to (not past) its bound.
    for (i, s) in [sa, sb].into_iter().enumerate() {
        assert!(
            queued[i] > 0 && s + queued[i] <= 2 * s,
            "{} queued behind {s}",
            queued[i]
        );
    }
}

#[test]
fn an_agent_too_far_behind_is_cut_off_and_resyncs_on_reconnect() {
    let mut h = Harness::new(Limits {
        backlog: 3,
        ..LIMITS
    });
    h.datastore(cluster());
    // The snapshot is larger than the limit but the queue was empty: it is still delivered.
    let (_, mut a) = h.connect("node-a");
    let pending: Vec<Out> = std::iter::from_fn(|| a.rx.try_recv().ok()).collect();
    assert!(pending.len() > 3, "snapshot of {} messages", pending.len());
    // Nothing taken: the next change does not fit behind the backlog.
    h.datastore(vec![web_policy(81)]);
    let rest = a.take();
    assert!(
        matches!(
            rest.last(),
            Some(Out::Close(CloseReason::TooFarBehind { node, limit: 3, .. })) if node == "node-a"
        ),
        "the stream is closed for being too far behind"
    );
    assert!(
        !h.board.snapshot().iter().any(|n| n.connected),
        "node-a disconnected"
    );
    // Reconnecting gives a fresh snapshot with the current policy.
    let (_, mut again) = h.connect("node-a");
    let fresh = again.take();
    assert!(
        matches!(fresh.last(), Some(o) if matches!(o.message().and_then(|m| m.payload.as_ref()), Some(Payload::InSync(_))))
    );
    let ports: Vec<String> = fresh
        .iter()
        .filter_map(|o| match o.message().and_then(|m| m.payload.as_ref()) {
            Some(Payload::ActivePolicyUpdate(u)) => Some(format!("{:?}", u.policy)),
            _ => None,
        })
        .collect();
    assert!(ports.iter().any(|p| p.contains("81")), "{ports:?}");
}

#[test]
fn a_newer_connection_replaces_the_old_one() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let (_, mut old) = h.connect("node-a");
    old.take();
    let (verdict, mut new) = h.connect("node-a");
    assert_eq!(verdict, Ok(()));
    let closed = old.kinds();
    assert_eq!(
        closed,
        vec![format!(
            "close:{:?}",
            CloseReason::Replaced {
                node: "node-a".into()
            }
        )]
    );
    assert_eq!(new.kinds().last().map(String::as_str), Some("InSync"));
    // The old stream going away later must not disconnect the new one.
    h.engine.step([Input::Disconnect {
        node: "node-a".into(),
        id: old.id,
    }]);
    h.datastore(vec![web_policy(82)]);
    assert!(new.kinds().contains(&"ActivePolicyUpdate".to_string()));
}

#[test]
fn a_reconnecting_agent_gets_the_current_state_not_what_it_missed() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let (_, mut a) = h.connect("node-a");
    a.take();
    // The agent goes away (its stream is dropped); the engine notices on its next step.
    drop(a);
    h.datastore(vec![workload("node-a", "web-3", "10.0.0.3")]);
    assert!(!h.board.snapshot().iter().any(|n| n.connected));
    let (_, mut again) = h.connect("node-a");
    let kinds = again.kinds();
    let endpoints = kinds
        .iter()
        .filter(|k| *k == "WorkloadEndpointUpdate")
        .count();
    assert_eq!(endpoints, 2, "both pods, in one snapshot: {kinds:?}");
    assert!(!kinds.iter().any(|k| k.ends_with("Remove")), "{kinds:?}");
}

#[test]
fn a_message_shared_by_nodes_is_encoded_once() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let (_, mut a) = h.connect("node-a");
    let (_, mut b) = h.connect("node-b");
    a.take();
    b.take();
    h.datastore(vec![web_policy(8080)]);
    let policy = |outs: Vec<Out>| {
        outs.into_iter()
            .find_map(|o| match o {
                Out::Shared(m)
                    if matches!(m.message().payload, Some(Payload::ActivePolicyUpdate(_))) =>
                {
                    Some(m)
                }
                _ => None,
            })
            .expect("the policy change reaches both nodes")
    };
    let (pa, pb) = (policy(a.take()), policy(b.take()));
    assert!(Arc::ptr_eq(&pa, &pb), "one message for both streams");
    assert_eq!(
        pa.encoded().as_slice().as_ptr(),
        pb.encoded().as_slice().as_ptr(),
        "encoded once, the bytes shared"
    );
}

/// A policy whose rule selects the web pods: an IP set every node holding it gets.
fn from_web_policy(port: u16) -> Update {
    apply(json!({
        "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
        "metadata": {"name": "from-web"},
        "spec": {
            "selector": "app == 'web'",
            "ingress": [{"action": "Allow", "protocol": "TCP",
                         "source": {"selector": "app == 'web'"},
                         "destination": {"ports": [port]}}],
        },
    }))
}

/// The shared messages of a snapshot, by payload kind.
fn shared_of(outs: &[Out]) -> Vec<(String, Arc<super::Outbound>)> {
    outs.iter()
        .filter_map(|o| match o {
            Out::Shared(m) => Some((kind(m.message().payload.as_ref()?), m.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_snapshot_admitted_in_a_later_step_reuses_the_shared_encodings() {
    let mut h = Harness::new(Limits {
        concurrent_snapshots: 1,
        ..LIMITS
    });
    let mut c = cluster();
    c.insert(3, from_web_policy(443));
    h.datastore(c);
    let (_, mut a) = h.connect("node-a");
    let (_, mut b) = h.connect("node-b");
    let a_outs = a.take();
    let encoded = h.engine.snapshot_cache().encodings();
    assert!(
        h.engine.snapshot_cache().len() > 0,
        "kept while node-b waits"
    );
    // node-a's stream took its snapshot: node-b's is admitted in a later step.
    h.engine.step([]);
    let b_outs = b.take();
    let (sa, sb) = (shared_of(&a_outs), shared_of(&b_outs));
    let kinds: Vec<&str> = sb.iter().map(|(k, _)| k.as_str()).collect();
    for k in ["IpsetUpdate", "ActivePolicyUpdate"] {
        assert!(kinds.contains(&k), "{k} is shared: {kinds:?}");
    }
    for (k, m) in &sb {
        let same = sa.iter().find(|(_, o)| Arc::ptr_eq(o, m));
        assert!(same.is_some(), "node-b's {k} is node-a's, encoded once");
    }
    assert_eq!(
        h.engine.snapshot_cache().encodings(),
        encoded,
        "node-b's snapshot encoded no shared message again"
    );
    // Once no snapshot waits or is under way, nothing is kept.
    h.engine.step([]);
    assert!(!h.engine.busy());
    assert_eq!(h.engine.snapshot_cache().len(), 0);
}

#[test]
fn a_datastore_change_invalidates_the_kept_encodings() {
    let mut h = Harness::new(Limits {
        concurrent_snapshots: 1,
        ..LIMITS
    });
    let mut c = cluster();
    c.insert(3, from_web_policy(443));
    h.datastore(c);
    let (_, mut a) = h.connect("node-a");
    let (_, mut b) = h.connect("node-b");
    let a_outs = a.take();
    // The policy and its IP set change before node-b's snapshot starts.
    h.datastore(vec![
        from_web_policy(8443),
        workload("node-a", "web-3", "10.0.0.3"),
    ]);
    h.engine.step([]);
    let b_outs = b.take();
    let (sa, sb) = (shared_of(&a_outs), shared_of(&b_outs));
    for (k, m) in &sb {
        assert!(
            !sa.iter().any(|(_, o)| Arc::ptr_eq(o, m)),
            "node-b's {k} is of the new generation"
        );
    }
    let policy = b_outs
        .iter()
        .filter_map(Out::message)
        .find_map(|m| match &m.payload {
            Some(Payload::ActivePolicyUpdate(u)) if u.id.as_ref()?.name == "from-web" => {
                u.policy.clone()
            }
            _ => None,
        })
        .expect("node-b gets the policy");
    assert_eq!(policy.inbound_rules[0].dst_ports[0].first, 8443);
    let members = b_outs
        .iter()
        .filter_map(Out::message)
        .find_map(|m| match &m.payload {
            Some(Payload::IpsetUpdate(u)) => Some(u.members.len()),
            _ => None,
        });
    assert_eq!(members, Some(3), "the IP set as it is now");
}

#[test]
fn shutdown_closes_every_stream() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let (_, mut a) = h.connect("node-a");
    let (_, mut b) = h.connect("node-b");
    assert!(h.engine.step([Input::Shutdown]).stopped);
    for agent in [&mut a, &mut b] {
        let last = agent.kinds().pop();
        assert_eq!(last, Some(format!("close:{:?}", CloseReason::ShuttingDown)));
    }
    assert!(!h.board.snapshot().iter().any(|n| n.connected));
}

#[test]
fn a_node_cut_off_mid_flush_does_not_lend_its_encodings_to_the_next() {
    // Several stalled nodes overflow in the same flushes as healthy ones: the messages of a
    // dropped batch are freed mid-flush, and the healthy nodes' fresh messages must still be
    // sent with their own bytes (checked by `Agent::take` on every message).
    let mut h = Harness::new(Limits {
        backlog: 2,
        ..LIMITS
    });
    let nodes: Vec<String> = (0..8).map(|i| format!("node-{i}")).collect();
    let mut updates: Vec<Update> = nodes.iter().map(|n| node(n)).collect();
    updates.push(web_policy(80));
    updates.push(Update::InSync);
    h.datastore(updates);
    let mut agents: Vec<Agent> = nodes.iter().map(|n| h.connect(n).1).collect();
    // Even nodes read their snapshot; odd ones never read anything.
    for (i, agent) in agents.iter_mut().enumerate() {
        if i % 2 == 0 {
            agent.take();
        }
    }
    for round in 0..3 {
        let pods: Vec<Update> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| workload(n, &format!("p{round}-{i}"), &format!("10.{round}.0.{i}")))
            .collect();
        h.datastore(pods);
        for agent in agents.iter_mut().step_by(2) {
            let kinds = agent.kinds();
            assert!(
                kinds.contains(&"WorkloadEndpointUpdate".to_string()),
                "{kinds:?}"
            );
        }
    }
    for agent in agents.iter_mut().skip(1).step_by(2) {
        let last = agent.kinds().pop().unwrap_or_default();
        assert!(
            last.starts_with("close:TooFarBehind"),
            "stalled node ends with {last}"
        );
    }
}

impl Harness {
    /// Connects an agent that reports what it applied, and takes its snapshot.
    fn connect_reporting(&mut self, node: &str) -> Agent {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut agent = Agent {
            id: self.next_id,
            rx,
            taken: Arc::new(AtomicU64::new(0)),
            taken_bytes: Arc::new(AtomicU64::new(0)),
        };
        self.next_id += 1;
        let conn = Conn::new(agent.id, tx, agent.taken.clone(), agent.taken_bytes.clone())
            .reporting_applied(true);
        let (reply, _verdict) = oneshot::channel();
        self.engine.step([Input::Connect {
            node: node.into(),
            agent_version: "test".into(),
            conn,
            reply,
        }]);
        let snapshot = agent.kinds();
        assert_eq!(snapshot.last().map(String::as_str), Some("InSync"));
        agent
    }

    /// The agent on `node` reports everything it has taken as applied (or the error).
    fn ack(&mut self, node: &str, a: &Agent, error: Option<&str>) {
        // The ServerHello is 1; the stream numbers what it takes from 2.
        let applied = a.taken.load(Ordering::Relaxed) + 1;
        self.engine.step([Input::Applied {
            node: node.into(),
            id: a.id,
            applied: if error.is_some() { 0 } else { applied },
            error: error.map(str::to_string),
        }]);
    }

    fn realization(&mut self, only: Option<&str>) -> Vec<super::PolicyRealization> {
        let (reply, mut answer) = oneshot::channel();
        self.engine.step([Input::Realization {
            only: only.map(str::to_string),
            reply,
        }]);
        answer
            .try_recv()
            .expect("answered in the step")
            .expect("a known policy")
    }

    /// (desired, realized, failed, phase) of the `web` policy.
    fn web(&mut self) -> (u32, u32, u32, String) {
        let rows = self.realization(Some("web"));
        let r = &rows[0];
        (r.desired, r.realized, r.failed, r.phase.clone())
    }
}

#[test]
fn a_policy_edit_is_realizing_until_every_node_applies_it() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let mut a = h.connect_reporting("node-a");
    let mut b = h.connect_reporting("node-b");
    assert_eq!(
        h.web(),
        (2, 0, 0, "Realizing".into()),
        "snapshots not applied yet"
    );
    h.ack("node-a", &a, None);
    assert_eq!(h.web(), (2, 1, 0, "Realizing".into()));
    h.ack("node-b", &b, None);
    assert_eq!(h.web(), (2, 2, 0, "Realized".into()));

    // An edit goes out to both: realizing again until each applies the new version.
    h.datastore(vec![web_policy(8080)]);
    assert!(a.kinds().contains(&"ActivePolicyUpdate".to_string()));
    assert!(b.kinds().contains(&"ActivePolicyUpdate".to_string()));
    assert_eq!(h.web(), (2, 0, 0, "Realizing".into()));
    let detail = &h.realization(Some("web"))[0];
    assert_eq!(detail.lagging.len(), 2);
    assert!(
        detail.lagging[0]
            .reason
            .starts_with("update sent at sequence"),
        "{detail:?}"
    );
    h.ack("node-a", &a, None);
    h.ack("node-b", &b, None);
    assert_eq!(h.web(), (2, 2, 0, "Realized".into()));
    // The per-tier gauges follow (summed at most once a second, and at the first change).
    let text = h.metrics.render(true);
    assert!(
        text.contains("calc_server_policy_nodes_desired{tier=\"default\"} 2"),
        "{text}"
    );
}

#[test]
fn a_node_whose_apply_fails_is_failed_with_the_error() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let a = h.connect_reporting("node-a");
    let b = h.connect_reporting("node-b");
    h.ack("node-a", &a, None);
    h.ack("node-b", &b, Some("iptables-restore: line 3 failed"));
    assert_eq!(h.web(), (2, 1, 1, "Failed".into()));
    let detail = &h.realization(Some("web"))[0];
    assert_eq!(detail.lagging.len(), 1);
    assert_eq!(detail.lagging[0].node, "node-b");
    assert_eq!(detail.lagging[0].state, "failed");
    assert_eq!(
        detail.lagging[0].reason,
        "last apply failed: iptables-restore: line 3 failed"
    );
    // A later success clears it.
    h.ack("node-b", &b, None);
    assert_eq!(h.web(), (2, 2, 0, "Realized".into()));
    // A node that is not connected is pending, not failed.
    drop(b);
    h.engine.step([]);
    let detail = &h.realization(Some("web"))[0];
    assert_eq!(
        (detail.realized, detail.lagging[0].reason.as_str()),
        (1, "not connected")
    );
}

#[test]
fn a_node_that_leaves_the_span_stops_counting() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let a = h.connect_reporting("node-a");
    let _b = h.connect_reporting("node-b");
    h.ack("node-a", &a, None);
    assert_eq!(h.web(), (2, 1, 0, "Realizing".into()));
    h.datastore(vec![Update::Delete(calc_graph::model::ResourceKey::new(
        calc_graph::model::Kind::WorkloadEndpoint,
        Some("shop"),
        "node--b-k8s-web--2-eth0",
    ))]);
    assert_eq!(h.web(), (1, 1, 0, "Realized".into()));
}

#[test]
fn a_new_endpoint_is_timed_until_its_node_applies_it() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let mut a = h.connect_reporting("node-a");
    h.ack("node-a", &a, None);
    let count = |h: &Harness| {
        let text = h.metrics.render(true);
        text.lines()
            .find(|l| l.starts_with("calc_server_endpoint_programmed_seconds_count"))
            .map(|l| l.rsplit(' ').next().unwrap().to_string())
    };
    assert_eq!(
        count(&h).as_deref(),
        Some("0"),
        "snapshot endpoints are not new"
    );
    h.datastore(vec![workload("node-a", "web-3", "10.0.0.3")]);
    assert!(a.kinds().contains(&"WorkloadEndpointUpdate".to_string()));
    assert_eq!(count(&h).as_deref(), Some("0"), "not applied yet");
    h.ack("node-a", &a, None);
    assert_eq!(count(&h).as_deref(), Some("1"));
}

/// A NetworkPolicy and a StagedNetworkPolicy of one name: two rows told apart by kind, the
/// staged one in phase `Staged` (no agent programs it), and a kind prefix picks either.
#[test]
fn a_staged_policy_is_its_own_row_and_phase_and_a_kind_picks_it() {
    let mut h = Harness::new(LIMITS);
    let mut updates = cluster();
    updates.insert(
        3,
        apply(json!({
            "apiVersion": "projectcalico.org/v3",
            "kind": "NetworkPolicy",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"selector": "app == 'web'", "ingress": [{"action": "Allow"}]},
        })),
    );
    updates.insert(
        3,
        apply(json!({
            "apiVersion": "projectcalico.org/v3",
            "kind": "StagedNetworkPolicy",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"selector": "app == 'web'", "ingress": [{"action": "Deny"}]},
        })),
    );
    h.datastore(updates);
    let a = h.connect_reporting("node-a");
    let b = h.connect_reporting("node-b");
    h.ack("node-a", &a, None);
    h.ack("node-b", &b, None);
    let rows: Vec<(String, String, String)> = h
        .realization(None)
        .into_iter()
        .filter(|r| r.policy == "shop/web")
        .map(|r| (r.kind, r.phase, r.tier))
        .collect();
    assert_eq!(
        rows,
        [
            ("NetworkPolicy".into(), "Realized".into(), "default".into()),
            (
                "StagedNetworkPolicy".into(),
                "Staged".into(),
                "default".into()
            ),
        ]
    );
    for (name, kind) in [
        ("snp:shop/web", "StagedNetworkPolicy"),
        ("StagedNetworkPolicy:shop/web", "StagedNetworkPolicy"),
        ("np:shop/web", "NetworkPolicy"),
    ] {
        let rows = h.realization(Some(name));
        assert_eq!(rows.len(), 1, "{name}");
        assert_eq!(rows[0].kind, kind, "{name}");
    }
    // Unqualified, the name is ambiguous, and the answer says how to qualify it.
    let (reply, mut answer) = oneshot::channel();
    h.engine.step([Input::Realization {
        only: Some("shop/web".into()),
        reply,
    }]);
    let err = answer.try_recv().unwrap().unwrap_err();
    let super::FindError::Ambiguous { found, .. } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(found.len(), 2, "{err}");
    assert!(
        err.to_string().contains("StagedNetworkPolicy:shop/web"),
        "{err}"
    );
}

impl Harness {
    /// Connects an agent that reports rule hits (and what it applied), and takes its snapshot.
    fn connect_stats(&mut self, node: &str) -> Agent {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut agent = Agent {
            id: self.next_id,
            rx,
            taken: Arc::new(AtomicU64::new(0)),
            taken_bytes: Arc::new(AtomicU64::new(0)),
        };
        self.next_id += 1;
        let conn = Conn::new(agent.id, tx, agent.taken.clone(), agent.taken_bytes.clone())
            .reporting_applied(true)
            .reporting_stats(true);
        let (reply, _verdict) = oneshot::channel();
        self.engine.step([Input::Connect {
            node: node.into(),
            agent_version: "test".into(),
            conn,
            reply,
        }]);
        let snapshot = agent.kinds();
        assert_eq!(snapshot.last().map(String::as_str), Some("InSync"));
        agent
    }

    /// `node`'s stream `a` reports `hits`, received `secs` seconds into the test's epoch.
    fn hits(&mut self, node: &str, a: &Agent, hits: Vec<super::Hit>, secs: u64) {
        self.engine.step([Input::Hits {
            node: node.into(),
            id: a.id,
            hits,
            at: std::time::SystemTime::UNIX_EPOCH
                + std::time::Duration::from_secs(1_800_000_000 + secs),
        }]);
    }

    /// The realization row of `kind` `policy`.
    fn row(&mut self, policy: &str, kind: &str) -> super::PolicyRealization {
        self.realization(None)
            .into_iter()
            .find(|r| r.policy == policy && r.kind == kind)
            .unwrap_or_else(|| panic!("no row for {kind} {policy}"))
    }

    fn metric(&self, series: &str) -> String {
        let text = self.metrics.render(true);
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{series} ")))
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
            .to_string()
    }
}

fn web_hit(egress: bool, index: u32, packets: u64, bytes: u64) -> super::Hit {
    super::Hit {
        owner: super::hits::Owner::Policy {
            kind: "GlobalNetworkPolicy".into(),
            namespace: String::new(),
            name: "web".into(),
        },
        egress,
        index,
        packets,
        bytes,
    }
}

/// Hits reported by two nodes add up on the policy's row, with the last report's time; what a
/// node was not sent is dropped and counted; the counters outlive the node's stream.
#[test]
fn policy_rows_carry_the_hits_their_nodes_reported() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let a = h.connect_stats("node-a");
    let b = h.connect_stats("node-b");
    let row = h.row("web", "GlobalNetworkPolicy");
    assert_eq!(
        (row.hits, row.bytes, row.last_hit),
        (Some(0), Some(0), None),
        "nothing hit yet"
    );

    h.hits("node-a", &a, vec![web_hit(false, 0, 3, 300)], 10);
    h.hits("node-b", &b, vec![web_hit(false, 0, 2, 200)], 20);
    h.hits("node-a", &a, vec![web_hit(false, 0, 1, 100)], 30);
    let row = h.row("web", "GlobalNetworkPolicy");
    assert_eq!(
        (row.hits, row.bytes, row.last_hit.as_deref()),
        (Some(6), Some(600), Some("2027-01-15T08:00:30Z"))
    );
    // The JSON the CLI reads.
    let json = serde_json::to_value(&row).unwrap();
    assert_eq!(
        (&json["hits"], &json["bytes"], &json["last_hit"]),
        (&json!(6), &json!(600), &json!("2027-01-15T08:00:30Z"))
    );
    assert_eq!(h.metric("calc_server_rule_stats_entries"), "2");

    // web has one ingress rule and no egress rule; db was never sent: dropped, no state.
    let db = super::Hit {
        owner: super::hits::Owner::Policy {
            kind: "GlobalNetworkPolicy".into(),
            namespace: String::new(),
            name: "db".into(),
        },
        ..web_hit(false, 0, 1, 1)
    };
    h.hits(
        "node-a",
        &a,
        vec![web_hit(false, 1, 1, 1), web_hit(true, 0, 1, 1), db],
        40,
    );
    assert_eq!(
        h.metric("calc_server_rule_stats_refused_total{reason=\"out_of_range\"}"),
        "2"
    );
    assert_eq!(
        h.metric("calc_server_rule_stats_refused_total{reason=\"not_sent\"}"),
        "1"
    );
    assert_eq!(h.metric("calc_server_rule_stats_entries"), "2");
    assert_eq!(h.row("web", "GlobalNetworkPolicy").hits, Some(6));

    // A node gone: its counters are history and stay; its old stream adds nothing more.
    drop(b);
    h.engine.step([]);
    let old_b = Agent {
        id: 2,
        rx: mpsc::unbounded_channel().1,
        taken: Arc::new(AtomicU64::new(0)),
        taken_bytes: Arc::new(AtomicU64::new(0)),
    };
    h.hits("node-b", &old_b, vec![web_hit(false, 0, 5, 5)], 50);
    assert_eq!(
        h.metric("calc_server_rule_stats_refused_total{reason=\"stale_stream\"}"),
        "1"
    );
    assert_eq!(h.row("web", "GlobalNetworkPolicy").hits, Some(6));
    drop(a);
}

/// A staged policy has no rules in any dataplane: no counts (null), and a hit reported for it
/// is dropped.
#[test]
fn a_staged_policy_has_no_hits() {
    let mut h = Harness::new(LIMITS);
    let mut updates = cluster();
    updates.insert(
        3,
        apply(json!({
            "apiVersion": "projectcalico.org/v3",
            "kind": "StagedGlobalNetworkPolicy",
            "metadata": {"name": "web-staged"},
            "spec": {"selector": "app == 'web'", "ingress": [{"action": "Deny"}]},
        })),
    );
    h.datastore(updates);
    let a = h.connect_stats("node-a");
    let staged = super::Hit {
        owner: super::hits::Owner::Policy {
            kind: "StagedGlobalNetworkPolicy".into(),
            namespace: String::new(),
            name: "web-staged".into(),
        },
        ..web_hit(false, 0, 1, 1)
    };
    h.hits("node-a", &a, vec![staged], 10);
    assert_eq!(
        h.metric("calc_server_rule_stats_refused_total{reason=\"staged\"}"),
        "1"
    );
    let row = h.row("web-staged", "StagedGlobalNetworkPolicy");
    assert_eq!(row.phase, "Staged");
    assert_eq!(
        (row.hits, row.bytes, row.last_hit.as_deref()),
        (None, None, None)
    );
    let json = serde_json::to_value(&row).unwrap();
    assert!(
        json["hits"].is_null() && json["last_hit"].is_null(),
        "{json}"
    );
}

/// Counters of a policy deleted from the datastore are dropped; those of a node gone from it
/// are folded, so the policy's totals stay.
#[test]
fn hit_counters_follow_the_datastore() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let a = h.connect_stats("node-a");
    let b = h.connect_stats("node-b");
    h.hits("node-a", &a, vec![web_hit(false, 0, 3, 300)], 10);
    h.hits("node-b", &b, vec![web_hit(false, 0, 2, 200)], 20);
    assert_eq!(h.engine.hits.entries(), 2);

    // node-b leaves: its stream, then its endpoint and Node resource.
    drop(b);
    h.engine.step([]);
    h.engine.hits_pruned = None;
    h.datastore(vec![
        Update::Delete(calc_graph::model::ResourceKey::new(
            calc_graph::model::Kind::WorkloadEndpoint,
            Some("shop"),
            "node--b-k8s-web--2-eth0",
        )),
        Update::Delete(calc_graph::model::ResourceKey::new(
            calc_graph::model::Kind::Node,
            None,
            "node-b",
        )),
    ]);
    let web = web_hit(false, 0, 0, 0).owner;
    assert!(h.engine.hits.rule(&web, Some("node-b"), false, 0).is_none());
    assert_eq!(
        h.engine.hits.rule(&web, None, false, 0).map(|c| c.packets),
        Some(2),
        "folded into the departed nodes' entry"
    );
    assert_eq!(h.row("web", "GlobalNetworkPolicy").hits, Some(5));

    // The policy deleted: its counters go with it.
    h.engine.hits_pruned = None;
    h.datastore(vec![Update::Delete(calc_graph::model::ResourceKey::new(
        calc_graph::model::Kind::GlobalNetworkPolicy,
        None,
        "web",
    ))]);
    assert_eq!(h.engine.hits.entries(), 0);
    assert_eq!(h.metric("calc_server_rule_stats_entries"), "0");
    drop(a);
}

fn gnp(name: &str, selector: &str, spec: serde_json::Value) -> Update {
    let mut spec = spec;
    spec["selector"] = json!(selector);
    apply(json!({
        "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
        "metadata": {"name": name}, "spec": spec,
    }))
}

/// A hit on GlobalNetworkPolicy `name`'s rule, 100 bytes a packet.
fn owner_hit(name: &str, egress: bool, index: u32, packets: u64) -> super::Hit {
    super::Hit {
        owner: super::hits::Owner::Policy {
            kind: "GlobalNetworkPolicy".into(),
            namespace: String::new(),
            name: name.into(),
        },
        ..web_hit(egress, index, packets, packets * 100)
    }
}

/// The cluster, plus `mixed` (ingress Allow and Deny, egress Pass), `idle` (one rule nothing
/// hits), `nowhere` (selects nothing) and a staged policy, all but `nowhere` on both nodes.
/// node-a's agent reports stats and applies its snapshot at day 0; node-b's reports none.
fn observed_cluster() -> (Harness, Agent, Agent) {
    let mut h = Harness::new(LIMITS);
    h.engine.set_wall(Some(day(0)));
    let mut updates = cluster();
    updates.insert(
        3,
        gnp(
            "mixed",
            "app == 'web'",
            json!({
                "ingress": [{"action": "Allow", "protocol": "TCP", "destination": {"ports": [443]}},
                            {"action": "Deny"}],
                "egress": [{"action": "Pass"}],
            }),
        ),
    );
    updates.insert(
        3,
        gnp(
            "idle",
            "app == 'web'",
            json!({"ingress": [{"action": "Deny", "source": {"nets": ["192.0.2.0/24"]}}]}),
        ),
    );
    updates.insert(
        3,
        gnp(
            "nowhere",
            "app == 'db'",
            json!({"ingress": [{"action": "Allow"}]}),
        ),
    );
    updates.insert(
        3,
        apply(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "StagedGlobalNetworkPolicy",
            "metadata": {"name": "web-staged"},
            "spec": {"selector": "app == 'web'", "ingress": [{"action": "Deny"}]},
        })),
    );
    h.datastore(updates);
    let a = h.connect_stats("node-a");
    h.ack("node-a", &a, None);
    let b = h.connect_reporting("node-b");
    h.ack("node-b", &b, None);
    (h, a, b)
}

fn day(d: u64) -> std::time::SystemTime {
    std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000 + d * 86_400)
}

impl Harness {
    fn unused(&mut self, days: Option<u64>) -> Vec<super::UnusedPolicy> {
        let (reply, mut answer) = oneshot::channel();
        self.engine.step([Input::Unused {
            window: days.map(|d| std::time::Duration::from_secs(d * 86_400)),
            reply,
        }]);
        answer.try_recv().expect("answered in the step")
    }
}

/// `(policy, state, unused rules as direction/index, observed days)` of an answer.
fn unused_summary(rows: &[super::UnusedPolicy]) -> Vec<(String, String, Vec<String>, Option<u64>)> {
    rows.iter()
        .map(|r| {
            (
                r.policy.clone(),
                r.state.clone(),
                r.unused_rules
                    .iter()
                    .map(|u| format!("{}/{}", u.direction, u.index))
                    .collect(),
                r.observed_seconds.map(|s| s / 86_400),
            )
        })
        .collect()
}

/// What nothing matched within a window, from when node-a (the node that reports stats)
/// applied each policy: a rule hit before the window is unused within it; a window longer than
/// the observation says not yet known; no window means all history.
#[test]
fn unused_policies_and_rules_follow_the_window() {
    let (mut h, a, b) = observed_cluster();
    // Reports carry their receive time: web's at day 1, mixed's ingress 0 at day 9.
    h.engine.step([Input::Hits {
        node: "node-a".into(),
        id: a.id,
        hits: vec![owner_hit("web", false, 0, 3)],
        at: day(1),
    }]);
    h.engine.step([Input::Hits {
        node: "node-a".into(),
        id: a.id,
        hits: vec![owner_hit("mixed", false, 0, 1)],
        at: day(9),
    }]);
    h.engine.set_wall(Some(day(10)));
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    // The last week: web's one hit (day 1) is before it; mixed's ingress 0 is within.
    assert_eq!(
        unused_summary(&h.unused(Some(7))),
        [
            ("idle".into(), "unused".into(), s(&["ingress/0"]), Some(10)),
            ("web".into(), "unused".into(), s(&["ingress/0"]), Some(10)),
            (
                "mixed".into(),
                "partly-unused".into(),
                s(&["ingress/1", "egress/0"]),
                Some(10)
            ),
        ]
    );
    // 30 days: observed for 10 only. idle is not yet known; web and mixed were hit within.
    let month = h.unused(Some(30));
    assert_eq!(
        unused_summary(&month),
        [("idle".into(), "not-yet-known".into(), vec![], Some(10))]
    );
    assert_eq!(month[0].not_yet_known_rules.len(), 1);
    // All history: web was hit once, so it is in use.
    assert_eq!(
        unused_summary(&h.unused(None)),
        [
            ("idle".into(), "unused".into(), s(&["ingress/0"]), Some(10)),
            (
                "mixed".into(),
                "partly-unused".into(),
                s(&["ingress/1", "egress/0"]),
                Some(10)
            ),
        ]
    );
    // The JSON the CLI reads: the window's rules with their action and last hit.
    let week = h.unused(Some(7));
    let web = serde_json::to_value(&week[1]).unwrap();
    assert_eq!(
        web,
        json!({"policy": "web", "kind": "GlobalNetworkPolicy", "tier": "default",
               "state": "unused", "observed_since": "2027-01-15T08:00:00Z",
               "observed_seconds": 864_000, "rule_count": 1,
               "unused_rules": [{"direction": "ingress", "index": 0, "action": "allow",
                                 "last_hit": "2027-01-16T08:00:00Z"}],
               "not_yet_known_rules": []})
    );
    // Neither the staged policy nor one in force nowhere is listed.
    for w in [Some(1), Some(7), None] {
        assert!(
            h.unused(w)
                .iter()
                .all(|r| r.policy != "web-staged" && r.policy != "nowhere")
        );
    }
    drop((a, b));
}

/// Without a node that reports stats, nothing is observed: not yet known, never unused.
#[test]
fn policies_no_stats_node_holds_are_not_yet_known() {
    let mut h = Harness::new(LIMITS);
    h.engine.set_wall(Some(day(0)));
    h.datastore(cluster());
    let b = h.connect_reporting("node-b");
    h.ack("node-b", &b, None);
    h.engine.set_wall(Some(day(100)));
    for w in [Some(1), None] {
        let rows = h.unused(w);
        assert_eq!(
            unused_summary(&rows),
            [("web".into(), "not-yet-known".into(), vec![], None)]
        );
        assert!(rows[0].observed_since.is_none());
    }
}

fn node_gates(node: &str, gates: &str) -> Update {
    apply(json!({
        "apiVersion": "projectcalico.org/v3", "kind": "FelixConfiguration",
        "metadata": {"name": format!("node.{node}")},
        "spec": {"featureGates": gates},
    }))
}

/// A node whose FelixConfiguration turns its counters off (FeatureGates
/// `PolicyHitCounters=Disabled`) observes nothing: what is in force only there stays not yet
/// known. Turned on again, what it holds is observed from then on.
#[test]
fn a_node_with_its_counters_off_observes_nothing_until_they_are_on() {
    let mut h = Harness::new(LIMITS);
    h.engine.set_wall(Some(day(0)));
    let mut updates = cluster();
    updates.push(node_gates("node-a", "PolicyHitCounters=Disabled"));
    h.datastore(updates);
    let a = h.connect_stats("node-a");
    h.ack("node-a", &a, None);
    h.engine.set_wall(Some(day(100)));
    assert_eq!(
        unused_summary(&h.unused(Some(7))),
        [("web".into(), "not-yet-known".into(), vec![], None)]
    );
    // The gate is lifted on day 100: observed from then.
    h.datastore(vec![node_gates("node-a", "PolicyHitCounters=Enabled")]);
    h.ack("node-a", &a, None);
    h.engine.set_wall(Some(day(108)));
    assert_eq!(
        unused_summary(&h.unused(Some(7))),
        [(
            "web".into(),
            "unused".into(),
            vec!["ingress/0".to_string()],
            Some(8)
        )]
    );
    // Off again: what was observed stays observed.
    h.datastore(vec![node_gates("node-a", "PolicyHitCounters=false")]);
    h.engine.set_wall(Some(day(120)));
    assert_eq!(unused_summary(&h.unused(Some(7)))[0].3, Some(20));
    drop(a);
}

/// A single policy's answer has its rules, ingress then egress, with their counts and the
/// nodes where they matched; a staged policy's rules have no counts.
#[test]
fn one_policys_answer_has_its_rules_with_their_hits() {
    let (mut h, a, b) = observed_cluster();
    h.engine.step([Input::Hits {
        node: "node-a".into(),
        id: a.id,
        hits: vec![owner_hit("mixed", false, 0, 4)],
        at: day(2),
    }]);
    let rows = h.realization(Some("mixed"));
    let rules = rows[0].rules.clone().expect("per rule");
    let brief: Vec<_> = rules
        .iter()
        .map(|r| {
            (
                r.direction.as_str(),
                r.index,
                r.action.as_str(),
                r.packets,
                r.bytes,
                r.last_hit.as_deref(),
                r.nodes.clone(),
            )
        })
        .collect();
    assert_eq!(
        brief,
        [
            (
                "ingress",
                0,
                "allow",
                Some(4),
                Some(400),
                Some("2027-01-17T08:00:00Z"),
                vec!["node-a".to_string()]
            ),
            ("ingress", 1, "deny", Some(0), Some(0), None, vec![]),
            ("egress", 0, "pass", Some(0), Some(0), None, vec![]),
        ]
    );
    let json = serde_json::to_value(&rows[0]).unwrap();
    assert_eq!(
        json["rules"][0],
        json!({"direction": "ingress", "index": 0, "action": "allow", "packets": 4,
               "bytes": 400, "last_hit": "2027-01-17T08:00:00Z", "nodes": ["node-a"]})
    );
    // The list of every policy carries no rules.
    assert!(h.row("mixed", "GlobalNetworkPolicy").rules.is_none());
    assert!(
        serde_json::to_value(h.row("mixed", "GlobalNetworkPolicy"))
            .unwrap()
            .get("rules")
            .is_none()
    );
    // Staged: its rules, no counts.
    let staged = h.realization(Some("web-staged"));
    let rules = staged[0].rules.clone().expect("per rule");
    assert_eq!(rules.len(), 1);
    assert_eq!(
        (rules[0].action.as_str(), rules[0].packets, rules[0].bytes),
        ("deny", None, None)
    );
    drop((a, b));
}

/// Per policy and action, the packets and bytes summed over nodes and rules: a series for each
/// action its rules have once a node that reports stats holds it; none for a staged policy or
/// one no such node holds.
#[test]
fn per_policy_totals_reach_the_metrics_by_action() {
    let (mut h, a, b) = observed_cluster();
    h.engine.step([Input::Hits {
        node: "node-a".into(),
        id: a.id,
        hits: vec![
            owner_hit("mixed", false, 0, 4),
            owner_hit("mixed", false, 1, 2),
            owner_hit("web", false, 0, 1),
        ],
        at: day(2),
    }]);
    h.engine.hit_series_published = None;
    h.engine.step([]);
    let series = |name: &str, policy: &str, action: &str| {
        format!(
            "calc_server_policy_hits_{name}_total{{tier=\"default\",policy=\"{policy}\",kind=\"GlobalNetworkPolicy\",action=\"{action}\"}}"
        )
    };
    assert_eq!(h.metric(&series("packets", "mixed", "allow")), "4");
    assert_eq!(h.metric(&series("bytes", "mixed", "allow")), "400");
    assert_eq!(h.metric(&series("packets", "mixed", "deny")), "2");
    assert_eq!(h.metric(&series("packets", "mixed", "pass")), "0");
    assert_eq!(h.metric(&series("packets", "web", "allow")), "1");
    assert_eq!(h.metric(&series("packets", "idle", "deny")), "0");
    let text = h.metrics.render(true);
    assert!(!text.contains("web-staged"), "{text}");
    assert!(!text.contains("policy=\"nowhere\""), "{text}");
    assert!(!text.contains("action=\"log\""), "{text}");
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("calc_server_policy_hits_packets_total{"))
            .count(),
        5,
        "per policy and action, not per rule or node:\n{text}"
    );
    // A policy deleted from the datastore: its series go.
    h.engine.hits_pruned = None;
    h.datastore(vec![Update::Delete(calc_graph::model::ResourceKey::new(
        calc_graph::model::Kind::GlobalNetworkPolicy,
        None,
        "mixed",
    ))]);
    h.engine.hit_series_published = None;
    h.engine.step([]);
    assert!(!h.metrics.render(true).contains("policy=\"mixed\""));
    drop((a, b));
}

/// The hit counters are handed over to be saved when they change (at most once per interval)
/// and at shutdown; restored in a new engine they show again, and restored entries of what the
/// datastore no longer has are pruned once it is in sync, not before.
#[test]
fn saved_hit_counters_survive_a_restart() {
    let mut h = Harness::new(LIMITS);
    let saved = h
        .engine
        .save_hits_every(std::time::Duration::from_secs(3600));
    h.datastore(cluster());
    let a = h.connect_stats("node-a");
    assert!(saved.borrow().is_none(), "nothing counted yet");
    h.hits("node-a", &a, vec![web_hit(false, 0, 3, 300)], 10);
    assert!(
        saved.borrow().is_none(),
        "nothing is handed over before the store was read"
    );
    // The store held nothing (a first start): what was counted is handed over at once.
    h.engine.step([Input::RestoreHits(super::SavedHits {
        version: super::SAVED_VERSION,
        counts: vec![],
        seen: vec![],
    })]);
    let first = saved
        .borrow()
        .clone()
        .expect("the first change is saved at once");
    assert_eq!(first.doc.counts.len(), 1);
    h.hits("node-a", &a, vec![web_hit(false, 0, 1, 100)], 20);
    assert_eq!(
        saved.borrow().as_ref().map(|d| d.doc.counts[0].packets),
        Some(3),
        "within the interval: not yet"
    );
    assert!(h.engine.wants_save_tick());
    h.engine.step([Input::Shutdown]);
    let mut last = (*saved.borrow().clone().expect("saved at shutdown").doc).clone();
    assert_eq!(last.counts[0].packets, 4);
    drop(a);

    // A counter of a policy the datastore no longer has, restored with the rest.
    let mut gone = last.counts[0].clone();
    gone.owner = super::hits::Owner::Policy {
        kind: "GlobalNetworkPolicy".into(),
        namespace: String::new(),
        name: "gone".into(),
    };
    last.counts.push(gone);
    let mut h = Harness::new(LIMITS);
    assert_eq!(h.engine.restore_hits(last), 0);
    h.engine.step([]);
    assert_eq!(
        h.engine.hits.entries(),
        2,
        "not pruned before the datastore is in sync"
    );
    h.datastore(cluster());
    assert_eq!(h.engine.hits.entries(), 1, "pruned once it is");
    let row = h.row("web", "GlobalNetworkPolicy");
    assert_eq!(
        (row.hits, row.bytes, row.last_hit.as_deref()),
        (Some(4), Some(400), Some("2027-01-15T08:00:20Z"))
    );
    assert_eq!(h.metric("calc_server_rule_stats_entries"), "1");
}

/// A store read late (it was unreachable at start) is merged into what was counted meanwhile:
/// counts add up, and the merged state is what is handed over next.
#[test]
fn saved_counters_read_late_add_to_those_counted_meanwhile() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let a = h.connect_stats("node-a");
    h.hits("node-a", &a, vec![web_hit(false, 0, 3, 300)], 10);
    let mut earlier = h.engine.hits.saved();
    earlier.counts[0].packets = 40;
    earlier.counts[0].bytes = 4_000;

    let mut h = Harness::new(LIMITS);
    let saved = h
        .engine
        .save_hits_every(std::time::Duration::from_secs(3600));
    h.datastore(cluster());
    let a = h.connect_stats("node-a");
    h.hits("node-a", &a, vec![web_hit(false, 0, 2, 200)], 30);
    assert!(saved.borrow().is_none());
    h.engine.step([Input::RestoreHits(earlier)]);
    let row = h.row("web", "GlobalNetworkPolicy");
    assert_eq!((row.hits, row.bytes), (Some(42), Some(4_200)));
    let handed = saved
        .borrow()
        .clone()
        .expect("the merged state is handed over");
    assert_eq!(
        (handed.doc.counts[0].packets, handed.doc.counts[0].bytes),
        (42, 4_200)
    );
    drop(a);
}

/// With a store replicas share, a node that connects has its stored counts asked for; until
/// they are merged its parts are left alone (copies name it), a failed read is asked again at
/// the next save, and the answer is merged (the larger view plus what it reported since).
#[test]
fn a_connecting_node_has_its_stored_counts_merged() {
    let mut h = Harness::new(LIMITS);
    let saved = h
        .engine
        .save_hits_every(std::time::Duration::from_secs(3600));
    let mut asks = h.engine.reload_node_hits();
    h.engine.step([Input::RestoreHits(super::SavedHits {
        version: super::SAVED_VERSION,
        counts: vec![],
        seen: vec![],
    })]);
    h.datastore(cluster());
    let a = h.connect_stats("node-a");
    assert_eq!(asks.try_recv().unwrap(), ("node-a".to_string(), a.id));
    h.hits("node-a", &a, vec![web_hit(false, 0, 2, 200)], 10);
    let first = saved.borrow().clone().expect("counting is saved at once");
    assert_eq!(
        first.skip,
        ["node-a"],
        "node-a's parts are left as they are"
    );
    // The read fails: asked again at the next save.
    h.engine.step([Input::NodeHits {
        node: "node-a".into(),
        conn: a.id,
        counts: None,
    }]);
    h.engine.step([Input::Shutdown]);
    assert_eq!(asks.try_recv().unwrap(), ("node-a".to_string(), a.id));
    let mut stored = h.engine.hits.saved().counts;
    stored[0].packets = 40;
    stored[0].bytes = 4_000;
    h.engine.step([Input::NodeHits {
        node: "node-a".into(),
        conn: a.id,
        counts: Some(stored),
    }]);
    let row = h.row("web", "GlobalNetworkPolicy");
    assert_eq!((row.hits, row.bytes), (Some(42), Some(4_200)));
    drop(a);
}

#[test]
fn pending_traces_beyond_a_steps_budget_are_stored_in_later_steps() {
    use super::EXPLAINS_PER_STEP;
    use super::flows::{FlowBatch, FlowIn};
    let mut h = Harness::new(LIMITS);
    h.engine.enable_flows(10_000, 10_000);
    let mut updates = cluster();
    updates.insert(
        0,
        apply(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "StagedGlobalNetworkPolicy",
            "metadata": {"name": "web-trial"},
            "spec": {"selector": "app == 'web'", "ingress": [{"action": "Deny"}]},
        })),
    );
    h.datastore(updates);
    let (verdict, mut agent) = h.connect("node-a");
    assert_eq!(verdict, Ok(()));
    agent.take();
    // New conversations with web-1, which the staged policy selects: each needs explain.
    let n = EXPLAINS_PER_STEP + 30;
    let records: Vec<FlowIn> = (0..n)
        .map(|i| FlowIn {
            interval: 1_800_000_000,
            src: format!("198.51.{}.{}", i / 250, i % 250 + 1)
                .parse()
                .unwrap(),
            dst: "10.0.0.1".parse().unwrap(),
            src_port: 40_000,
            dst_port: 80,
            proto: 6,
            reporter_dest: true,
            allowed: true,
            trace: Vec::new(),
            tally: crate::flows::Tally {
                packets_in: 1,
                ..Default::default()
            },
            original_dest: None,
        })
        .collect();
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_010);
    h.engine.set_wall(Some(at));
    h.engine.step([Input::Flows {
        node: "node-a".into(),
        id: agent.id,
        batch: FlowBatch {
            records,
            agent_dropped: 0,
        },
        at,
    }]);
    assert_eq!(h.metrics.flow_records.get(), EXPLAINS_PER_STEP as u64);
    assert!(h.engine.wants_tick(), "the rest waits for the next step");
    // The next step (the run loop's tick) stores the rest; then nothing is left to do.
    h.engine.step([]);
    assert_eq!(h.metrics.flow_records.get(), n as u64);
    assert!(!h.engine.wants_tick());
}

#[test]
fn the_board_may_lag_agents_by_a_second_but_never_the_datastore() {
    let mut h = Harness::new(LIMITS);
    h.datastore(cluster());
    let board = |h: &mut Harness| {
        let (reply, mut rx) = oneshot::channel();
        h.engine.step([Input::PolicyBoard { reply }]);
        rx.try_recv().expect("answered in the step").rows
    };
    let exact = |h: &mut Harness| {
        let (reply, mut rx) = oneshot::channel();
        h.engine.step([Input::Realization { only: None, reply }]);
        rx.try_recv()
            .expect("answered in the step")
            .expect("a table")
    };
    let web = |rows: &[super::PolicyRealization]| {
        rows.iter()
            .find(|r| r.policy == "web")
            .map(|r| (r.desired, r.realized))
            .expect("the web policy's row")
    };
    assert_eq!(web(&board(&mut h)), (2, 0));
    // node-a connects and applies its snapshot: /status/policies says so at once; the board
    // may show the table of up to a second ago.
    let (verdict, mut a) = h.connect("node-a");
    assert_eq!(verdict, Ok(()));
    a.take();
    let now = exact(&mut h);
    let seen = board(&mut h);
    assert!(web(&seen) == web(&now) || web(&seen) == (2, 0), "{seen:?}");
    // A datastore change is never hidden: a new policy is on the next board.
    h.datastore(vec![apply(json!({
        "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
        "metadata": {"name": "added"},
        "spec": {"selector": "app == 'web'", "ingress": [{"action": "Allow"}]},
    }))]);
    let rows = board(&mut h);
    assert!(rows.iter().any(|r| r.policy == "added"), "{rows:?}");
    assert_eq!(web(&rows), web(&exact(&mut h)));
}

#[test]
fn fresh_snapshots_share_the_whole_broadcast_state_as_one_block() {
    let mut h = Harness::new(Limits {
        concurrent_snapshots: 1,
        ..LIMITS
    });
    h.datastore(cluster());
    // The queue as the engine left it, blocks not taken apart.
    let raw = |agent: &mut Agent| -> Vec<Out> {
        std::iter::from_fn(|| agent.rx.try_recv().ok()).collect()
    };
    let blocks = |outs: &[Out]| -> Vec<Arc<super::Block>> {
        outs.iter()
            .filter_map(|o| match o {
                Out::Block(b) => Some(b.clone()),
                _ => None,
            })
            .collect()
    };
    let (_, mut a) = h.connect("node-a");
    // node-b waits while node-a's snapshot is under way.
    let (_, mut b) = h.connect("node-b");
    let a_outs = raw(&mut a);
    let a_blocks = blocks(&a_outs);
    assert_eq!(
        a_blocks.len(),
        1,
        "the two nodes' host metadata, as one entry"
    );
    let hosts: Vec<String> = a_blocks[0]
        .messages()
        .iter()
        .map(|m| kind(m.payload.as_ref().unwrap()))
        .collect();
    assert_eq!(hosts, ["HostMetadataUpdate", "HostMetadataUpdate"]);
    let before = h.engine.snapshot_cache().encodings();
    assert_eq!(a_blocks[0].encoded().len(), 2);
    assert_eq!(
        h.engine.snapshot_cache().encodings(),
        before + 1,
        "encoded once, as a whole"
    );
    // node-a's stream takes its snapshot; node-b's, admitted later, queues the same block.
    assert!(raw(&mut b).is_empty());
    let messages: u64 = a_outs.iter().map(Out::count).sum();
    a.taken.fetch_add(messages, Ordering::Relaxed);
    h.engine.step([]);
    let b_blocks = blocks(&raw(&mut b));
    assert_eq!(b_blocks.len(), 1);
    assert!(
        Arc::ptr_eq(&a_blocks[0], &b_blocks[0]),
        "one block for both"
    );
    b_blocks[0].encoded();
    assert_eq!(
        h.engine.snapshot_cache().encodings(),
        before + 1,
        "not encoded again"
    );
    // A change reaches a subscribed node as the difference, message by message.
    h.datastore(vec![node("node-c")]);
    let change = raw(&mut a);
    assert!(blocks(&change).is_empty());
    let kinds: Vec<String> = change
        .iter()
        .filter_map(|o| o.message()?.payload.as_ref().map(kind))
        .collect();
    assert_eq!(kinds, ["HostMetadataUpdate"]);
}
