//! Session tests against an in-process fake calc-server.
//!
//! The fake (`test_support::sync_server`) implements `CalcServer.Sync` with tonic on
//! 127.0.0.1:0 and plays one script per accepted stream (send messages, wait for reports, wait for the test, end with a status). The
//! agent runs the real session with a recording wrapper around the dry-run driver, so the tests
//! see both what reached the driver (and when `apply` ran) and the state file it wrote.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use dataplane_agent::admin::AgentMetrics;
use dataplane_agent::driver::{
    Driver, DriverError, DryRunDriver, EndpointStatuses, WorkloadEndpointKey,
};
use dataplane_agent::message::Message;
use dataplane_agent::session::{self, SessionConfig};
use felix_proto::from_dataplane::Payload as Report;
use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActivePolicyUpdate, ActiveProfileUpdate, ConfigUpdate, DataplaneApplied, FromDataplane,
    HostEndpoint, HostEndpointId, HostEndpointUpdate, HostMetadataUpdate, InSync, IpSetDeltaUpdate,
    IpSetUpdate, IpamPool, IpamPoolUpdate, Policy, PolicyId, Profile, ProfileId, Rule, ToDataplane,
    WorkloadEndpoint, WorkloadEndpointUpdate,
};
use serde_json::Value;
use test_support::sync_server::{self, Step, SyncServer, is_dataplane_in_sync};
use tokio::sync::{Notify, oneshot};
use tonic::Status;

const NODE: &str = "node-1";
const WAIT: Duration = Duration::from_secs(5);

// ------------------------------------------------------------------------------------------------
// The fake calc-server (test_support::sync_server, shared with the namespace tests)
// ------------------------------------------------------------------------------------------------

/// Starts a fake calc-server that plays `scripts`, one per accepted stream, in order; a wait
/// of a script gives up (panics) after [`WAIT`].
async fn start_fake(scripts: Vec<Vec<Step>>) -> (String, SyncServer) {
    let fake = SyncServer::scripted(scripts).wait_limit(WAIT);
    (fake.spawn().await, fake)
}

// ------------------------------------------------------------------------------------------------
// The agent side: a recording wrapper around the dry-run driver
// ------------------------------------------------------------------------------------------------

#[derive(Default)]
struct Log {
    updates: Vec<Message>,
    /// How many updates had been recorded at each successful apply.
    applied_at: Vec<usize>,
    failed_applies: usize,
    /// How many refreshes the session requested.
    refreshes: usize,
}

struct Recording {
    inner: DryRunDriver,
    log: Arc<Mutex<Log>>,
    /// The next this many applies fail (the test may change it while the agent runs).
    fail_applies: Arc<Mutex<usize>>,
    refresh: Option<Duration>,
    /// Applies block this long first (an `iptables-restore` waiting on the xtables lock).
    apply_blocks_for: Arc<Mutex<Duration>>,
}

impl Driver for Recording {
    fn on_update(&mut self, msg: &Message) {
        self.log.lock().updates.push(msg.clone());
        self.inner.on_update(msg);
    }
    fn apply(&mut self) -> Result<(), DriverError> {
        let block = *self.apply_blocks_for.lock();
        if !block.is_zero() {
            std::thread::sleep(block);
        }
        let mut log = self.log.lock();
        let mut fail = self.fail_applies.lock();
        if *fail > 0 {
            *fail -= 1;
            log.failed_applies += 1;
            return Err(DriverError::Other("injected failure".into()));
        }
        self.inner.apply()?;
        let n = log.updates.len();
        log.applied_at.push(n);
        Ok(())
    }
    fn endpoint_statuses(&self) -> EndpointStatuses {
        self.inner.endpoint_statuses()
    }
    fn workload_endpoint(&self, id: &WorkloadEndpointKey) -> Option<WorkloadEndpoint> {
        self.inner.workload_endpoint(id)
    }
    fn refresh_interval(&self) -> Option<Duration> {
        self.refresh
    }
    fn request_refresh(&mut self) {
        self.log.lock().refreshes += 1;
    }
}

struct Agent {
    log: Arc<Mutex<Log>>,
    metrics: Arc<AgentMetrics>,
    fail_applies: Arc<Mutex<usize>>,
    apply_blocks_for: Arc<Mutex<Duration>>,
    state_file: PathBuf,
    dir: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Recording>,
}

impl Agent {
    fn applies(&self) -> usize {
        self.log.lock().applied_at.len()
    }
    fn updates(&self) -> Vec<Message> {
        self.log.lock().updates.clone()
    }
    fn state(&self) -> Option<Value> {
        read_state(&self.state_file)
    }
    /// Messages the session received from servers after their ServerHellos (all streams).
    fn received(&self) -> u64 {
        let text = self.metrics.render();
        text.lines()
            .find_map(|l| l.strip_prefix("dataplane_agent_messages_total "))
            .and_then(|v| v.parse().ok())
            .expect("messages counter")
    }
    /// Stops the session; returns the driver and the directory holding the state file.
    async fn stop(mut self) -> (Recording, tempfile::TempDir) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let driver = tokio::time::timeout(Duration::from_secs(1), self.task)
            .await
            .expect("agent stops promptly")
            .expect("agent task");
        (driver, self.dir)
    }
}

fn test_config(servers: Vec<String>) -> SessionConfig {
    let mut config = SessionConfig::new(servers, NODE);
    config.heartbeat_interval = Duration::from_secs(3600);
    config.reconnect_min_delay = Duration::from_millis(20);
    config.reconnect_max_delay = Duration::from_millis(100);
    config.connect_timeout = Duration::from_secs(2);
    config.hello_timeout = Duration::from_secs(2);
    config
}

fn start_agent(config: SessionConfig, fail_applies: usize) -> Agent {
    start_agent_with(config, fail_applies, None)
}

fn start_agent_with(
    config: SessionConfig,
    fail_applies: usize,
    refresh: Option<Duration>,
) -> Agent {
    let dir = tempfile::tempdir().expect("tempdir");
    let state_file = dir.path().join("state.json");
    let log = Arc::new(Mutex::new(Log::default()));
    let apply_blocks_for = Arc::new(Mutex::new(Duration::ZERO));
    let fail_applies = Arc::new(Mutex::new(fail_applies));
    let driver = Recording {
        inner: DryRunDriver::new(NODE, Some(state_file.clone())),
        log: log.clone(),
        fail_applies: fail_applies.clone(),
        refresh,
        apply_blocks_for: apply_blocks_for.clone(),
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let metrics = config.metrics.clone();
    let task = tokio::spawn(session::run(config, driver, async move {
        let _ = stopped.await;
    }));
    Agent {
        log,
        metrics,
        fail_applies,
        apply_blocks_for,
        state_file,
        dir,
        stop: Some(stop),
        task,
    }
}

fn read_state(path: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(serde_json::from_str(&text).expect("state file is JSON"))
}

async fn eventually(what: &str, check: impl FnMut() -> bool) {
    eventually_within(what, WAIT, check).await;
}

/// [`eventually`] with its own deadline, for work whose time is the machine's, not the
/// agent's (a million members decoded in a debug build on a loaded machine).
async fn eventually_within(what: &str, wait: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + wait;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ------------------------------------------------------------------------------------------------
// Messages
// ------------------------------------------------------------------------------------------------

fn server_hello(node: &str) -> Payload {
    server_hello_with(node, &[])
}

fn server_hello_with(node: &str, capabilities: &[&str]) -> Payload {
    sync_server::server_hello("fake", node, capabilities)
}

fn in_sync() -> Payload {
    Payload::InSync(InSync {})
}

fn config(marker: &str) -> Payload {
    Payload::ConfigUpdate(ConfigUpdate {
        config: [("Marker".to_owned(), marker.to_owned())].into(),
        ..Default::default()
    })
}

fn ipset(id: &str, members: &[&str]) -> Payload {
    Payload::IpsetUpdate(IpSetUpdate {
        id: id.into(),
        members: members.iter().map(|m| m.to_string()).collect(),
        r#type: 0,
    })
}

fn pid(name: &str) -> PolicyId {
    PolicyId {
        name: name.into(),
        namespace: String::new(),
        kind: "GlobalNetworkPolicy".into(),
    }
}

fn policy(name: &str, ipset: &str) -> Payload {
    Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(pid(name)),
        policy: Some(Policy {
            tier: "default".into(),
            inbound_rules: vec![Rule {
                action: "allow".into(),
                src_ip_set_ids: vec![ipset.into()],
                ..Default::default()
            }],
            ..Default::default()
        }),
    })
}

fn profile(name: &str) -> Payload {
    Payload::ActiveProfileUpdate(ActiveProfileUpdate {
        id: Some(ProfileId { name: name.into() }),
        profile: Some(Profile::default()),
    })
}

fn wep(workload: &str, ip: &str, policy: &str, profile: &str) -> Payload {
    test_support::wep(workload)
        .active()
        .iface(&format!("cali-{}", workload.replace('/', "-")))
        .ipv4(ip)
        .profile(profile)
        .ingress_tier("default", &[pid(policy)])
        .update()
}

fn hep(id: &str) -> Payload {
    Payload::HostEndpointUpdate(HostEndpointUpdate {
        id: Some(HostEndpointId {
            endpoint_id: id.into(),
        }),
        endpoint: Some(HostEndpoint {
            name: "eth0".into(),
            ..Default::default()
        }),
    })
}

fn host_metadata(host: &str, ip: &str) -> Payload {
    Payload::HostMetadataUpdate(HostMetadataUpdate {
        hostname: host.into(),
        ipv4_addr: ip.into(),
        ..Default::default()
    })
}

fn ipam_pool(cidr: &str) -> Payload {
    Payload::IpamPoolUpdate(IpamPoolUpdate {
        id: cidr.replace('/', "-"),
        pool: Some(IpamPool {
            cidr: cidr.into(),
            masquerade: true,
            ..Default::default()
        }),
    })
}

/// Wait for the AgentHello, answer with a ServerHello.
fn handshake() -> Vec<Step> {
    vec![Step::hello_received(), Step::Send(server_hello(NODE))]
}

/// [`handshake`] by a server that wants `DataplaneApplied` reports.
fn handshake_applied() -> Vec<Step> {
    vec![
        Step::hello_received(),
        Step::Send(server_hello_with(NODE, &["applied"])),
    ]
}

fn script(parts: Vec<Vec<Step>>) -> Vec<Step> {
    parts.into_iter().flatten().collect()
}

fn sends(payloads: Vec<Payload>) -> Vec<Step> {
    payloads.into_iter().map(Step::Send).collect()
}

fn applied_reports(reports: &[FromDataplane]) -> Vec<DataplaneApplied> {
    reports
        .iter()
        .filter_map(|m| match &m.payload {
            Some(Report::DataplaneApplied(a)) => Some(a.clone()),
            _ => None,
        })
        .collect()
}

/// A `DataplaneApplied` as the test expects it.
fn applied(applied: u64, received: u64, error: &str, pending: u64) -> DataplaneApplied {
    DataplaneApplied {
        applied_sequence_number: applied,
        received_sequence_number: received,
        error: error.into(),
        pending_changes: pending,
    }
}

/// Waits on the fake's side for a `DataplaneApplied` equal to `want`.
fn wait_applied(what: &'static str, want: DataplaneApplied) -> Step {
    Step::WaitFor(what, Box::new(move |r| applied_reports(r).contains(&want)))
}

fn count(reports: &[FromDataplane], f: impl Fn(&Report) -> bool) -> usize {
    reports
        .iter()
        .filter(|m| m.payload.as_ref().is_some_and(&f))
        .count()
}

fn wep_status_update(workload: &'static str) -> impl Fn(&Report) -> bool {
    move |p| matches!(p, Report::WorkloadEndpointStatusUpdate(u) if u.id.as_ref().is_some_and(|id| id.workload_id == workload))
}

fn wep_status_remove(workload: &'static str) -> impl Fn(&Report) -> bool {
    move |p| matches!(p, Report::WorkloadEndpointStatusRemove(u) if u.id.as_ref().is_some_and(|id| id.workload_id == workload))
}

fn assert_sequence_numbers(reports: &[FromDataplane]) {
    let seqs: Vec<u64> = reports.iter().map(|m| m.sequence_number).collect();
    let expected: Vec<u64> = (1..=reports.len() as u64).collect();
    assert_eq!(
        seqs, expected,
        "FromDataplane numbered 1, 2, 3, … per stream"
    );
}

fn keys(v: &Value) -> Vec<String> {
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

// ------------------------------------------------------------------------------------------------
// Tests
// ------------------------------------------------------------------------------------------------

/// Hello first; the snapshot is held by the session (the driver sees none of it, nothing is
/// applied, no state file) until InSync; then the driver gets it whole, one apply for the whole
/// snapshot, DataplaneInSync, and deltas reach the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_snapshot_in_sync_then_deltas() {
    let gate = Arc::new(Notify::new());
    let deltas = Arc::new(Notify::new());
    let (url, fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![
            config("one"),
            ipset("s:a", &["10.0.0.1"]),
            policy("allow-a", "s:a"),
            profile("kns.default"),
            wep("default/web-0", "10.0.0.1/32", "allow-a", "kns.default"),
        ]),
        vec![Step::Gate(gate.clone()), Step::Send(in_sync())],
        vec![Step::programmed(), Step::Gate(deltas.clone())],
        sends(vec![
            Payload::IpsetDeltaUpdate(IpSetDeltaUpdate {
                id: "s:a".into(),
                added_members: vec!["10.0.0.2".into()],
                removed_members: vec!["10.0.0.1".into()],
            }),
            wep("default/web-1", "10.0.0.2/32", "allow-a", "kns.default"),
            test_support::wep("default/web-0").remove(),
        ]),
        vec![Step::Hold],
    ])])
    .await;
    let agent = start_agent(test_config(vec![url]), 0);

    eventually("the snapshot reaches the agent", || agent.received() == 5).await;
    // Give the session every chance to (wrongly) apply before InSync.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        agent.updates().is_empty(),
        "the driver holds no half snapshot"
    );
    assert_eq!(agent.applies(), 0, "nothing applied before InSync");
    assert!(agent.state().is_none(), "no state file before InSync");

    let hello = &fake.received(0)[0];
    assert_eq!(hello.sequence_number, 1);
    match &hello.payload {
        Some(Report::AgentHello(h)) => {
            assert_eq!(h.node_name, NODE);
            assert_eq!(h.agent_version, env!("CARGO_PKG_VERSION"));
            assert_eq!(h.capabilities, ["applied"], "always offered");
        }
        other => panic!("first report must be AgentHello, got {other:?}"),
    }

    gate.notify_one();
    eventually("the state file is written", || agent.state().is_some()).await;
    let state = agent.state().expect("state");
    assert_eq!(state["node"], NODE);
    assert_eq!(state["in_sync"], true);
    assert_eq!(state["config"]["Marker"], "one");
    assert_eq!(
        state["ipsets"]["s:a"]["members"],
        serde_json::json!(["10.0.0.1"])
    );
    assert_eq!(
        keys(&state["policies"]),
        vec!["GlobalNetworkPolicy/allow-a"]
    );
    assert_eq!(
        keys(&state["workload_endpoints"]),
        vec!["k8s/default/web-0/eth0"]
    );
    assert_eq!(
        agent.log.lock().applied_at.first().copied(),
        Some(6),
        "the first apply covers the whole snapshot and InSync at once"
    );

    deltas.notify_one();

    eventually("deltas reach the state file", || {
        agent.state().is_some_and(|s| {
            s["ipsets"]["s:a"]["members"] == serde_json::json!(["10.0.0.2"])
                && keys(&s["workload_endpoints"]) == vec!["k8s/default/web-1/eth0"]
        })
    })
    .await;

    let reports = fake.received(0);
    assert_eq!(
        reports.iter().filter(|m| is_dataplane_in_sync(m)).count(),
        1
    );
    assert_sequence_numbers(&reports);

    let (driver, _dir) = agent.stop().await;
    assert!(driver.inner.in_sync());
    assert_eq!(fake.connection_count(), 1);
}

/// A first message that is not a ServerHello is a protocol error: nothing from that stream
/// reaches the driver and the agent reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_hello_must_come_first() {
    let (url, fake) = start_fake(vec![
        script(vec![
            vec![Step::hello_received()],
            sends(vec![config("bad"), in_sync()]),
            vec![Step::Hold],
        ]),
        script(vec![
            handshake(),
            sends(vec![config("good"), ipset("s:x", &[]), in_sync()]),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let agent = start_agent(test_config(vec![url]), 0);
    eventually("the second stream is applied", || {
        agent
            .state()
            .is_some_and(|s| s["config"]["Marker"] == "good")
    })
    .await;
    assert_eq!(fake.connection_count(), 2);
    let marker_bad = agent.updates().iter().any(|m| {
        matches!(m, Message::Config(c) if c.config.get("Marker").map(String::as_str) == Some("bad"))
    });
    assert!(
        !marker_bad,
        "nothing from the broken stream reached the driver"
    );
    assert_eq!(agent.applies(), 1);
    // Each stream opens with a fresh AgentHello numbered 1.
    for conn in 0..2 {
        let first = &fake.received(conn)[0];
        assert_eq!(first.sequence_number, 1);
        assert!(matches!(first.payload, Some(Report::AgentHello(_))));
    }
    agent.stop().await;
}

/// Mark and sweep: the second stream's snapshot lacks some objects; they stay until its InSync
/// (no apply, no remove before), then are removed in dependency order; the rest is kept/updated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resync_sweeps_objects_missing_from_the_new_snapshot() {
    let gate = Arc::new(Notify::new());
    let first = script(vec![
        handshake(),
        sends(vec![
            ipset("s:a", &["10.0.0.1"]),
            ipset("s:b", &["10.0.0.2"]),
            policy("p1", "s:a"),
            policy("p2", "s:b"),
            profile("pr1"),
            profile("pr2"),
            wep("ns/w1", "10.0.0.1/32", "p1", "pr1"),
            wep("ns/w2", "10.0.0.2/32", "p2", "pr2"),
            hep("h1"),
            host_metadata("n1", "192.168.0.1"),
            host_metadata("n2", "192.168.0.2"),
            ipam_pool("10.0.0.0/16"),
            ipam_pool("10.1.0.0/16"),
            in_sync(),
        ]),
        vec![Step::programmed(), Step::End(None)],
    ]);
    let second_snapshot = vec![
        ipset("s:a", &["10.0.0.1", "10.0.0.9"]),
        policy("p1", "s:a"),
        profile("pr1"),
        wep("ns/w1", "10.0.0.9/32", "p1", "pr1"),
        host_metadata("n1", "192.168.0.1"),
        ipam_pool("10.0.0.0/16"),
    ];
    let second_len = second_snapshot.len();
    let second = script(vec![
        handshake(),
        sends(second_snapshot),
        vec![Step::Gate(gate.clone()), Step::Send(in_sync()), Step::Hold],
    ]);
    let (url, fake) = start_fake(vec![first, second]).await;
    let agent = start_agent(test_config(vec![url]), 0);

    let first_updates = 14;
    eventually("the second snapshot reaches the agent", || {
        agent.received() == (first_updates + second_len) as u64
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        agent.updates().len(),
        first_updates,
        "the resync's snapshot waits for its InSync"
    );
    assert_eq!(
        agent.applies(),
        1,
        "no apply while the resync snapshot arrives"
    );
    let removes_before = agent
        .updates()
        .iter()
        .filter(|m| m.kind().ends_with("Remove"))
        .count();
    assert_eq!(removes_before, 0, "nothing removed before the new InSync");
    let state = agent.state().expect("state from the first stream");
    assert_eq!(keys(&state["ipsets"]), vec!["s:a", "s:b"]);
    assert_eq!(
        keys(&state["workload_endpoints"]),
        vec!["k8s/ns/w1/eth0", "k8s/ns/w2/eth0"]
    );

    gate.notify_one();
    eventually("the sweep reaches the state file", || {
        agent
            .state()
            .is_some_and(|s| keys(&s["ipsets"]) == vec!["s:a"])
    })
    .await;
    let state = agent.state().expect("state");
    assert_eq!(keys(&state["policies"]), vec!["GlobalNetworkPolicy/p1"]);
    assert_eq!(keys(&state["profiles"]), vec!["pr1"]);
    assert_eq!(keys(&state["workload_endpoints"]), vec!["k8s/ns/w1/eth0"]);
    assert_eq!(keys(&state["host_endpoints"]), Vec::<String>::new());
    assert_eq!(keys(&state["host_metadata"]), vec!["n1"]);
    assert_eq!(keys(&state["ipam_pools"]), vec!["10.0.0.0-16"]);
    assert_eq!(
        state["ipsets"]["s:a"]["members"],
        serde_json::json!(["10.0.0.1", "10.0.0.9"]),
        "kept objects take the new snapshot's content"
    );
    assert_eq!(
        state["workload_endpoints"]["k8s/ns/w1/eth0"]["ipv4Nets"],
        serde_json::json!(["10.0.0.9/32"])
    );

    // The synthetic removes follow the second InSync, users before what they use.
    let updates = agent.updates();
    let in_syncs: Vec<usize> = updates
        .iter()
        .enumerate()
        .filter(|(_, m)| matches!(m, Message::InSync))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(in_syncs.len(), 2);
    let sweep: Vec<String> = updates[in_syncs[1] + 1..]
        .iter()
        .map(|m| match m {
            Message::WorkloadEndpointRemove { key } => format!("wep {}", key.workload_id),
            Message::HostEndpointRemove { key } => format!("hep {key}"),
            Message::ProfileRemove { key } => format!("profile {key}"),
            Message::PolicyRemove { key } => format!("policy {}", key.name),
            Message::IpSetRemove { id } => format!("ipset {id}"),
            Message::HostMetadataRemove { host, ipv4_addr } => {
                format!("host {host} {ipv4_addr}")
            }
            Message::IpamPoolRemove { id } => format!("pool {id}"),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(
        sweep,
        vec![
            "wep ns/w2",
            "hep h1",
            "profile pr2",
            "policy p2",
            "ipset s:b",
            "host n2 192.168.0.2",
            "pool 10.1.0.0-16",
        ]
    );

    // The new stream gets DataplaneInSync and a full status report again, plus removes.
    eventually("status reports on the second stream", || {
        let r = fake.received(1);
        r.iter().any(is_dataplane_in_sync)
            && count(&r, wep_status_update("ns/w1")) == 1
            && count(&r, wep_status_remove("ns/w2")) == 1
            && count(&r, |p| matches!(p, Report::HostEndpointStatusRemove(_))) == 1
    })
    .await;
    assert_sequence_numbers(&fake.received(1));
    assert_eq!(agent.applies(), 2);
    agent.stop().await;
}

/// The first --server refuses connections; the agent fails over to the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_over_to_the_next_server() {
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        format!("http://{addr}")
    };
    let (url, fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![ipset("s:failover", &["10.9.9.9"]), in_sync()]),
        vec![Step::Hold],
    ])])
    .await;
    let started = Instant::now();
    let agent = start_agent(test_config(vec![refused, url]), 0);
    eventually("the snapshot from the second server is applied", || {
        agent
            .state()
            .is_some_and(|s| s["ipsets"].get("s:failover").is_some())
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(fake.connection_count(), 1);
    agent.stop().await;
}

/// A gap in the server's sequence numbers ends the stream; the message after the gap never
/// reaches the driver, and the agent resyncs on a new stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_gap_reconnects() {
    let (url, fake) = start_fake(vec![
        script(vec![
            handshake(),
            sends(vec![ipset("s:before-gap", &[])]),
            vec![
                Step::SendRaw(ToDataplane {
                    payload: Some(ipset("s:after-gap", &[])),
                    sequence_number: 4,
                }),
                Step::Send(in_sync()),
                Step::Hold,
            ],
        ]),
        script(vec![
            handshake(),
            sends(vec![ipset("s:second", &[]), in_sync()]),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let agent = start_agent(test_config(vec![url]), 0);
    eventually("the second stream is applied", || {
        agent
            .state()
            .is_some_and(|s| s["ipsets"].get("s:second").is_some())
    })
    .await;
    assert_eq!(fake.connection_count(), 2);
    let updates = format!("{:?}", agent.updates());
    assert!(!updates.contains("s:after-gap"), "{updates}");
    let state = agent.state().expect("state");
    assert_eq!(
        keys(&state["ipsets"]),
        vec!["s:second"],
        "the partial first stream's set is swept at the second InSync"
    );
    assert_eq!(agent.applies(), 1, "the broken stream never applied");
    agent.stop().await;
}

/// Heartbeats, DataplaneInSync and endpoint status (updates, then changes only) reach the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_heartbeats_in_sync_and_endpoint_status() {
    let done = Arc::new(Notify::new());
    let (url, fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![
            ipset("s:a", &[]),
            policy("p", "s:a"),
            profile("pr"),
            wep("ns/w1", "10.0.0.1/32", "p", "pr"),
            wep("ns/w2", "10.0.0.2/32", "p", "pr"),
            hep("h1"),
            in_sync(),
        ]),
        vec![Step::WaitFor(
            "DataplaneInSync, statuses and two heartbeats",
            Box::new(|r| {
                r.iter().any(is_dataplane_in_sync)
                    && count(r, wep_status_update("ns/w1")) == 1
                    && count(r, wep_status_update("ns/w2")) == 1
                    && count(r, |p| matches!(p, Report::HostEndpointStatusUpdate(_))) == 1
                    && count(r, |p| matches!(p, Report::ProcessStatusUpdate(_))) >= 2
            }),
        )],
        sends(vec![
            test_support::wep("ns/w1").remove(),
            wep("ns/w3", "10.0.0.3/32", "p", "pr"),
        ]),
        vec![
            Step::WaitFor(
                "status remove of w1 and update of w3",
                Box::new(|r| {
                    count(r, wep_status_remove("ns/w1")) == 1
                        && count(r, wep_status_update("ns/w3")) == 1
                }),
            ),
            Step::Signal(done.clone()),
            Step::Hold,
        ],
    ])])
    .await;
    let mut config = test_config(vec![url]);
    config.heartbeat_interval = Duration::from_millis(50);
    let agent = start_agent(config, 0);
    tokio::time::timeout(WAIT, done.notified())
        .await
        .expect("the fake saw every report");

    let reports = fake.received(0);
    assert_sequence_numbers(&reports);
    assert_eq!(
        reports.iter().filter(|m| is_dataplane_in_sync(m)).count(),
        1
    );
    // Unchanged endpoints are not re-reported after the second apply.
    assert_eq!(count(&reports, wep_status_update("ns/w2")), 1);
    let in_sync_at = reports
        .iter()
        .position(is_dataplane_in_sync)
        .expect("in sync");
    let first_status = reports
        .iter()
        .position(|m| matches!(m.payload, Some(Report::WorkloadEndpointStatusUpdate(_))))
        .expect("status");
    assert!(in_sync_at < first_status);
    for m in &reports {
        match &m.payload {
            Some(Report::WorkloadEndpointStatusUpdate(u)) => {
                assert_eq!(u.status.as_ref().expect("status").status, "up");
                let ep = u.endpoint.as_ref().expect("endpoint sent along");
                assert_eq!(ep.ipv4_nets.len(), 1);
            }
            Some(Report::HostEndpointStatusUpdate(u)) => {
                assert_eq!(u.id.as_ref().expect("id").endpoint_id, "h1");
                assert_eq!(u.status.as_ref().expect("status").status, "up");
            }
            _ => {}
        }
    }
    let heartbeats: Vec<(String, f64)> = reports
        .iter()
        .filter_map(|m| match &m.payload {
            Some(Report::ProcessStatusUpdate(p)) => Some((p.iso_timestamp.clone(), p.uptime)),
            _ => None,
        })
        .collect();
    assert!(heartbeats.len() >= 2);
    for (ts, _) in &heartbeats {
        let b = ts.as_bytes();
        assert!(
            ts.len() == 20
                && b[4] == b'-'
                && b[7] == b'-'
                && b[10] == b'T'
                && b[13] == b':'
                && b[16] == b':'
                && b[19] == b'Z'
                && ts.starts_with("20"),
            "RFC 3339 UTC timestamp: {ts}"
        );
    }
    assert!(
        heartbeats.windows(2).all(|w| w[0].1 <= w[1].1),
        "uptime grows"
    );
    agent.stop().await;
}

/// RESOURCE_EXHAUSTED means "fell behind": reconnect at once, ignoring the (long) back-off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_exhausted_reconnects_without_back_off() {
    let (url, fake) = start_fake(vec![
        script(vec![
            handshake(),
            sends(vec![ipset("s:a", &[]), in_sync()]),
            vec![
                Step::programmed(),
                Step::End(Some(Status::resource_exhausted("agent fell behind"))),
            ],
        ]),
        script(vec![
            handshake(),
            sends(vec![ipset("s:b", &[]), in_sync()]),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let mut config = test_config(vec![url]);
    config.reconnect_min_delay = Duration::from_secs(3);
    config.reconnect_max_delay = Duration::from_secs(6);
    let agent = start_agent(config, 0);
    eventually("the fresh snapshot is applied", || {
        agent
            .state()
            .is_some_and(|s| keys(&s["ipsets"]) == vec!["s:b"])
    })
    .await;
    let (_, ended) = fake.times(0);
    let (opened, _) = fake.times(1);
    let gap = opened.expect("opened") - ended.expect("ended");
    assert!(gap < Duration::from_secs(1), "reconnected after {gap:?}");
    agent.stop().await;
}

/// Ends the first stream with `status`, then serves a normal one; asserts the agent waited
/// the maximum delay (400 ms here) before reconnecting.
async fn assert_backs_off_at_the_max_delay(status: Status) {
    let (url, fake) = start_fake(vec![
        vec![Step::End(Some(status))],
        script(vec![
            handshake(),
            sends(vec![ipset("s:a", &[]), in_sync()]),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let mut config = test_config(vec![url]);
    config.reconnect_min_delay = Duration::from_millis(10);
    config.reconnect_max_delay = Duration::from_millis(400);
    let agent = start_agent(config, 0);
    eventually("the second stream is applied", || agent.state().is_some()).await;
    let (_, ended) = fake.times(0);
    let (opened, _) = fake.times(1);
    let gap = opened.expect("opened") - ended.expect("ended");
    assert!(gap >= Duration::from_millis(380), "retried after {gap:?}");
    agent.stop().await;
}

/// PERMISSION_DENIED is logged as an error and retried only after the maximum delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permission_denied_backs_off_at_the_max_delay() {
    assert_backs_off_at_the_max_delay(Status::permission_denied("certificate is for another node"))
        .await;
}

/// ABORTED (another agent for this node replaced our stream) waits the maximum delay too, so
/// two agents for one node do not keep replacing each other at the shortest delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_stream_backs_off_at_the_max_delay() {
    assert_backs_off_at_the_max_delay(Status::aborted(
        "replaced by a newer connection for node node-1",
    ))
    .await;
}

/// A ServerHello bound to another node is refused like PERMISSION_DENIED; nothing of that
/// stream reaches the driver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_hello_for_another_node_is_refused() {
    let (url, fake) = start_fake(vec![
        script(vec![
            vec![
                Step::hello_received(),
                Step::Send(server_hello("someone-else")),
            ],
            sends(vec![ipset("s:foreign", &[]), in_sync()]),
            vec![Step::Hold],
        ]),
        script(vec![
            handshake(),
            sends(vec![ipset("s:mine", &[]), in_sync()]),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let mut config = test_config(vec![url]);
    config.reconnect_min_delay = Duration::from_millis(10);
    config.reconnect_max_delay = Duration::from_millis(300);
    let started = Instant::now();
    let agent = start_agent(config, 0);
    eventually("the second stream is applied", || agent.state().is_some()).await;
    assert!(started.elapsed() >= Duration::from_millis(280));
    assert_eq!(fake.connection_count(), 2);
    assert!(!format!("{:?}", agent.updates()).contains("s:foreign"));
    agent.stop().await;
}

/// A failing apply is retried with back-off; DataplaneInSync waits for the first success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_apply_is_retried_and_in_sync_waits_for_success() {
    let (url, fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![ipset("s:a", &["10.0.0.1"]), in_sync()]),
        vec![Step::Hold],
    ])])
    .await;
    let agent = start_agent(test_config(vec![url]), 2);
    eventually("DataplaneInSync", || {
        fake.received(0).iter().any(is_dataplane_in_sync)
    })
    .await;
    let log = agent.log.clone();
    assert_eq!(log.lock().failed_applies, 2);
    assert_eq!(agent.applies(), 1);
    assert!(agent.state().is_some());
    assert_eq!(
        fake.connection_count(),
        1,
        "apply failures do not drop the stream"
    );
    agent.stop().await;
}

/// Shutdown returns promptly and leaves the dataplane (the state file) as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_the_dataplane_in_place() {
    let (url, _fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![ipset("s:a", &["10.0.0.1"]), in_sync()]),
        vec![Step::Hold],
    ])])
    .await;
    let agent = start_agent(test_config(vec![url]), 0);
    eventually("applied", || agent.state().is_some()).await;
    let path = agent.state_file.clone();
    let before = std::fs::read_to_string(&path).expect("state");
    let (driver, _dir) = agent.stop().await;
    assert_eq!(driver.log.lock().applied_at.len(), 1);
    assert!(driver.inner.in_sync());
    assert_eq!(
        std::fs::read_to_string(&path).expect("state file still there"),
        before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_asking_for_refreshes_gets_them_only_once_in_sync() {
    let gate = Arc::new(Notify::new());
    let (url, _fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![ipset("s:a", &["10.0.0.1"])]),
        vec![Step::Gate(gate.clone()), Step::Send(in_sync())],
        vec![Step::Hold],
    ])])
    .await;
    let agent = start_agent_with(test_config(vec![url]), 0, Some(Duration::from_millis(50)));
    eventually("the snapshot reaches the agent", || agent.received() == 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        agent.log.lock().refreshes,
        0,
        "no refresh (and so no apply) before InSync"
    );
    assert_eq!(agent.applies(), 0);
    gate.notify_one();
    // Each refresh is followed by an apply even though nothing new arrived.
    eventually("refreshes and applies keep coming", || {
        agent.log.lock().refreshes >= 3 && agent.applies() >= 4
    })
    .await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refreshes_continue_while_the_server_is_gone() {
    // One complete stream, then the server has nothing more to say: every later connection is
    // refused (UNAVAILABLE) and the agent backs off.
    let (url, _fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![ipset("s:a", &["10.0.0.1"])]),
        vec![Step::Send(in_sync())],
        vec![Step::programmed(), Step::End(None)],
    ])])
    .await;
    let mut config = test_config(vec![url]);
    // Long back-off: the agent spends its time disconnected.
    config.reconnect_min_delay = Duration::from_secs(30);
    config.reconnect_max_delay = Duration::from_secs(30);
    let agent = start_agent_with(config, 0, Some(Duration::from_millis(50)));
    eventually("the first apply", || agent.applies() >= 1).await;
    let before = agent.applies();
    eventually("refresh applies while disconnected", || {
        agent.log.lock().refreshes >= 3 && agent.applies() >= before + 3
    })
    .await;
    agent.stop().await;
}

/// A resync whose snapshot is cut short leaves nothing behind in the driver: while
/// disconnected, its refreshes keep applying the last complete state, without the cut-short
/// snapshot's objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_short_resync_leaves_the_last_complete_state_in_force() {
    let (url, _fake) = start_fake(vec![
        script(vec![
            handshake(),
            sends(vec![ipset("s:a", &["10.0.0.1"])]),
            vec![Step::Send(in_sync())],
            vec![Step::programmed(), Step::End(None)],
        ]),
        // The resync's snapshot is cut short: s:b arrives, InSync never comes.
        script(vec![
            handshake(),
            sends(vec![
                ipset("s:a", &["10.0.0.66"]),
                ipset("s:b", &["10.0.0.2"]),
            ]),
            vec![Step::End(None)],
        ]),
    ])
    .await;
    let mut config = test_config(vec![url]);
    config.reconnect_min_delay = Duration::from_millis(300);
    config.reconnect_max_delay = Duration::from_millis(300);
    let agent = start_agent_with(config, 0, Some(Duration::from_millis(50)));
    eventually("the cut-short snapshot reaches the agent", || {
        agent.received() >= 4
    })
    .await;
    let (refreshes, applies) = {
        let log = agent.log.lock();
        (log.refreshes, log.applied_at.len())
    };
    eventually("refreshes and applies continue while disconnected", || {
        let log = agent.log.lock();
        log.refreshes >= refreshes + 2 && log.applied_at.len() >= applies + 2
    })
    .await;
    let seen_by_driver: Vec<String> = agent
        .updates()
        .iter()
        .filter_map(|m| match m {
            Message::IpSetUpdate { id, members, .. } => Some(format!("{id} {members:?}")),
            _ => None,
        })
        .collect();
    assert_eq!(
        seen_by_driver,
        vec!["s:a [\"10.0.0.1\"]"],
        "nothing of the cut-short snapshot reached the driver"
    );
    let state = agent.state().expect("state");
    assert_eq!(keys(&state["ipsets"]), vec!["s:a"]);
    assert_eq!(
        state["ipsets"]["s:a"]["members"],
        serde_json::json!(["10.0.0.1"])
    );
    agent.stop().await;
}

/// A network set of a million members (far over gRPC's default 4 MiB message limit) syncs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_member_ip_set_syncs() {
    let members: Vec<String> = (0..1_000_000u32)
        .map(|i| format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255))
        .collect();
    let refs: Vec<&str> = members.iter().map(String::as_str).collect();
    let big = ipset("s:big", &refs);
    // Each member is a length-delimited string: its bytes plus a tag and a length byte.
    let encoded: usize = members.iter().map(|m| m.len() + 2).sum();
    assert!(encoded > 4 * 1024 * 1024, "{encoded} bytes");
    let (url, fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![big, in_sync()]),
        vec![Step::Hold],
    ])])
    .await;
    let agent = start_agent(test_config(vec![url]), 0);
    eventually_within(
        "DataplaneInSync after the big set",
        Duration::from_secs(60),
        || fake.received(0).iter().any(is_dataplane_in_sync),
    )
    .await;
    let updates = agent.updates();
    let got = updates.iter().find_map(|m| match m {
        Message::IpSetUpdate { id, members, .. } if id.as_str() == "s:big" => Some(members.len()),
        _ => None,
    });
    assert_eq!(got, Some(1_000_000));
    assert_eq!(fake.connection_count(), 1, "no reconnect on the way");
    agent.stop().await;
}

/// A peer that accepts the connection and never answers does not hold the agent: it gives up
/// after the hello timeout and moves to the next server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_is_left_after_the_hello_timeout() {
    // Accepts TCP and HTTP/2 never starts: the agent's request gets no response headers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = held.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = silent.accept().await {
            keep.lock().push(sock);
        }
    });
    let (url, fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![ipset("s:a", &[]), in_sync()]),
        vec![Step::Hold],
    ])])
    .await;
    let mut config = test_config(vec![format!("http://{silent_addr}"), url]);
    config.hello_timeout = Duration::from_millis(500);
    config.connect_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let agent = start_agent(config, 0);
    eventually("the second server's stream is applied", || {
        agent.state().is_some()
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(4));
    assert!(!held.lock().is_empty(), "the silent server was tried first");
    assert_eq!(fake.connection_count(), 1);
    agent.stop().await;
}

fn ipset_updates(agent: &Agent) -> Vec<String> {
    agent
        .updates()
        .iter()
        .filter_map(|m| match m {
            Message::IpSetUpdate { id, members, .. } => Some(format!("{id} {members:?}")),
            _ => None,
        })
        .collect()
}

/// A stream whose InSync does not come within the snapshot deadline is dropped, its snapshot
/// never reaches the driver, and the agent reconnects; a stream in sync is never timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_without_in_sync_is_dropped_at_the_deadline() {
    let (url, fake) = start_fake(vec![
        script(vec![
            handshake(),
            sends(vec![ipset("s:a", &["10.0.0.1"]), in_sync()]),
            vec![Step::programmed(), Step::End(None)],
        ]),
        // A snapshot that never ends: a few objects, then silence.
        script(vec![
            handshake(),
            sends(vec![
                ipset("s:a", &["10.0.0.66"]),
                ipset("s:stuck", &["10.0.0.67"]),
            ]),
            vec![Step::Hold],
        ]),
        script(vec![
            handshake(),
            sends(vec![ipset("s:a", &["10.0.0.2"]), in_sync()]),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let mut config = test_config(vec![url]);
    config.snapshot_timeout = Duration::from_millis(300);
    let agent = start_agent(config, 0);
    eventually("the third stream is applied", || {
        agent
            .state()
            .is_some_and(|s| s["ipsets"]["s:a"]["members"] == serde_json::json!(["10.0.0.2"]))
    })
    .await;
    let (stuck_opened, _) = fake.times(1);
    let (next_opened, _) = fake.times(2);
    let held = next_opened.expect("opened") - stuck_opened.expect("opened");
    assert!(
        held >= Duration::from_millis(300),
        "the stuck stream was left only at its deadline ({held:?})"
    );
    assert_eq!(
        ipset_updates(&agent),
        vec!["s:a [\"10.0.0.1\"]", "s:a [\"10.0.0.2\"]"],
        "nothing of the unfinished snapshot reached the driver"
    );
    assert_eq!(agent.applies(), 2);
    // In sync, the deadline no longer applies.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(fake.connection_count(), 3);
    assert!(agent.metrics.liveness().is_ok());
    agent.stop().await;
}

/// More bytes before InSync than the bound: the stream is dropped at once (long before the
/// deadline) and nothing of it reaches the driver. After InSync the bound does not apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_over_the_byte_bound_is_dropped() {
    let members: Vec<String> = (0..1000)
        .map(|i| format!("10.1.{}.{}", i / 256, i % 256))
        .collect();
    let member_refs: Vec<&str> = members.iter().map(String::as_str).collect();
    let flood = |n: usize| -> Vec<Payload> {
        (0..n)
            .map(|i| ipset(&format!("s:flood-{i}"), &member_refs))
            .collect()
    };
    let deltas: Vec<Payload> = (0..20)
        .map(|i| {
            Payload::IpsetDeltaUpdate(IpSetDeltaUpdate {
                id: "s:a".into(),
                added_members: member_refs
                    .iter()
                    .map(|m| format!("{m}{i}"))
                    .take(1000)
                    .collect(),
                removed_members: vec![],
            })
        })
        .collect();
    let (url, fake) = start_fake(vec![
        script(vec![handshake(), sends(flood(40)), vec![Step::Hold]]),
        script(vec![
            handshake(),
            sends(vec![ipset("s:a", &["10.0.0.1"]), in_sync()]),
            vec![Step::programmed()],
            sends(deltas),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let mut config = test_config(vec![url]);
    config.max_snapshot_bytes = Some(64 * 1024);
    let started = Instant::now();
    let agent = start_agent(config, 0);
    eventually("the second stream is applied", || agent.applies() >= 1).await;
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(
        ipset_updates(&agent),
        vec!["s:a [\"10.0.0.1\"]"],
        "nothing of the oversized snapshot reached the driver"
    );
    eventually("deltas after InSync, far over the bound, are taken", || {
        agent
            .updates()
            .iter()
            .filter(|m| matches!(m, Message::IpSetDeltaUpdate { .. }))
            .count()
            == 20
    })
    .await;
    assert_eq!(fake.connection_count(), 2);
    agent.stop().await;
}

/// Unset, the snapshot bound follows the node: after a small complete snapshot the next
/// stream's bound is a multiple of it (here well below the first stream's), so a bigger
/// snapshot is cut; the next attempt's bound doubles and the grown snapshot gets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_bound_is_sized_from_the_last_complete_snapshot() {
    let members: Vec<String> = (0..1000)
        .map(|i| format!("10.1.{}.{}", i / 256, i % 256))
        .collect();
    let member_refs: Vec<&str> = members.iter().map(String::as_str).collect();
    // About 12 KB each, encoded.
    let sets = |n: usize| -> Vec<Payload> {
        (0..n)
            .map(|i| ipset(&format!("s:set-{i}"), &member_refs))
            .chain([in_sync()])
            .collect()
    };
    // Two sets (about 25 KB), then twelve (about 150 KB), twice.
    let (url, fake) = start_fake(vec![
        script(vec![
            handshake(),
            sends(sets(2)),
            vec![Step::programmed(), Step::End(None)],
        ]),
        script(vec![handshake(), sends(sets(12)), vec![Step::Hold]]),
        script(vec![
            handshake(),
            sends(sets(12)),
            vec![Step::programmed(), Step::Hold],
        ]),
    ])
    .await;
    let mut config = test_config(vec![url]);
    config.max_snapshot_bytes = None;
    config.snapshot_sizing = session::SnapshotSizing {
        first: 256 * 1024,
        factor: 4,
        min: 16 * 1024,
        max: 1024 * 1024,
    };
    let agent = start_agent(config, 0);
    eventually("the third stream's snapshot is applied", || {
        agent
            .updates()
            .iter()
            .filter(|m| matches!(m, Message::IpSetUpdate { .. }))
            .count()
            == 2 + 12
    })
    .await;
    // Twelve sets fit the first bound (256 KiB) but not four times the two-set snapshot: the
    // second stream was cut, the third (its bound doubled) went through.
    assert_eq!(fake.connection_count(), 3);
    let set_updates = ipset_updates(&agent);
    assert_eq!(
        set_updates.len(),
        14,
        "nothing of the cut snapshot reached the driver"
    );
    agent.stop().await;
}

fn liveness_always(agent: &Agent) -> Result<(), String> {
    agent.metrics.liveness()
}

/// Idle on a quiet stream (no heartbeat due for an hour) the agent stays live; an apply that
/// blocks past the watchdog makes /liveness and /readiness fail with the reason, and they
/// recover when it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_fails_while_the_session_loop_is_stuck() {
    let change = Arc::new(Notify::new());
    let (url, _fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![ipset("s:a", &["10.0.0.1"]), in_sync()]),
        vec![Step::Gate(change.clone())],
        sends(vec![ipset("s:a", &["10.0.0.2"])]),
        vec![Step::Hold],
    ])])
    .await;
    let mut config = test_config(vec![url]);
    config.watchdog_timeout = Duration::from_millis(500);
    let agent = start_agent(config, 0);
    eventually("in sync and ready", || agent.metrics.readiness().is_ok()).await;
    for _ in 0..40 {
        assert_eq!(liveness_always(&agent), Ok(()), "idle is not stuck");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    *agent.apply_blocks_for.lock() = Duration::from_millis(1500);
    change.notify_one();
    eventually("liveness fails while the apply blocks", || {
        agent.metrics.liveness().is_err()
    })
    .await;
    let why = agent.metrics.liveness().unwrap_err();
    assert!(why.contains("session loop stalled"), "{why}");
    assert!(!why.contains('\n'), "one line: {why}");
    assert!(agent.metrics.readiness().is_err());
    *agent.apply_blocks_for.lock() = Duration::ZERO;
    eventually("live again once the apply returned", || {
        agent.metrics.liveness().is_ok() && agent.metrics.readiness().is_ok()
    })
    .await;
    assert_eq!(agent.applies(), 2);
    agent.stop().await;
}

/// Backing off from a server that is not there is live, not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnecting_to_an_absent_server_is_live_not_ready() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let mut config = test_config(vec![format!("http://{addr}")]);
    // Each wait between attempts is longer than the watchdog timeout.
    config.reconnect_min_delay = Duration::from_millis(600);
    config.reconnect_max_delay = Duration::from_millis(600);
    config.watchdog_timeout = Duration::from_millis(250);
    let agent = start_agent(config, 0);
    eventually("the session runs", || liveness_always(&agent).is_ok()).await;
    for _ in 0..60 {
        assert_eq!(liveness_always(&agent), Ok(()));
        assert_eq!(
            agent.metrics.readiness(),
            Err("not connected to a calc-server".to_owned())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    agent.stop().await;
}

/// A server that ends the stream right behind its InSync: the complete snapshot is applied at
/// once, not left pending until some later stream's InSync. The server asked for
/// `DataplaneApplied`: the report of that apply has no stream to go to, and that is harmless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ending_right_after_in_sync_is_applied() {
    let (url, _fake) = start_fake(vec![script(vec![
        handshake_applied(),
        sends(vec![ipset("s:a", &["10.0.0.1"]), in_sync()]),
        vec![Step::End(None)],
    ])])
    .await;
    let mut config = test_config(vec![url]);
    // Later connections are refused: only the first stream can bring the state.
    config.reconnect_min_delay = Duration::from_secs(30);
    config.reconnect_max_delay = Duration::from_secs(30);
    let agent = start_agent(config, 0);
    eventually("the snapshot is applied", || agent.state().is_some()).await;
    assert_eq!(agent.applies(), 1);
    agent.stop().await;
}

/// Warnings the agent logs, for tests that check what an operator reads. One subscriber for the
/// whole test binary (the session's tasks run on the runtime's threads, so a thread-local one
/// would miss them); each test looks only for its own keys.
fn captured_warnings() -> Arc<Mutex<Vec<u8>>> {
    use std::sync::OnceLock;
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || CaptureWriter(writer.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        buf
    })
    .clone()
}

struct CaptureWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for CaptureWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log_lines_with(log: &Arc<Mutex<Vec<u8>>>, needle: &str) -> Vec<String> {
    String::from_utf8_lossy(&log.lock())
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

/// A snapshot message that does not say which object it is about is refused, not
/// default-filled: the stream is dropped with its whole unfinished snapshot (the driver sees
/// none of it), the refusal is logged with the payload kind, and the agent resyncs after the
/// longest delay, as after a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_an_id_drops_the_stream_before_the_driver_sees_it() {
    let log = captured_warnings();
    let (url, fake) = start_fake(vec![
        script(vec![
            handshake(),
            sends(vec![
                ipset("s:first-stream", &["10.0.0.1"]),
                Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
                    id: None,
                    endpoint: Some(WorkloadEndpoint {
                        name: "cali-no-id".into(),
                        ..Default::default()
                    }),
                }),
                in_sync(),
            ]),
            vec![Step::Hold],
        ]),
        script(vec![
            handshake(),
            sends(vec![ipset("s:second-stream", &[]), in_sync()]),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let mut config = test_config(vec![url]);
    config.reconnect_min_delay = Duration::from_millis(10);
    config.reconnect_max_delay = Duration::from_millis(400);
    let agent = start_agent(config, 0);
    eventually("the second stream is applied", || agent.state().is_some()).await;
    let updates = format!("{:?}", agent.updates());
    assert!(!updates.contains("s:first-stream"), "{updates}");
    assert!(!updates.contains("cali-no-id"), "{updates}");
    let state = agent.state().expect("state");
    assert_eq!(keys(&state["ipsets"]), vec!["s:second-stream"]);
    assert_eq!(keys(&state["workload_endpoints"]), Vec::<String>::new());
    let (_, ended) = fake.times(0);
    let (opened, _) = fake.times(1);
    let gap = opened.expect("opened") - ended.expect("ended");
    assert!(gap >= Duration::from_millis(380), "retried after {gap:?}");
    let lines = log_lines_with(&log, "WorkloadEndpointUpdate without an id");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("invalid message from calc-server"),
        "{lines:?}"
    );
    assert!(lines[0].contains("seq=3"), "{lines:?}");
    agent.stop().await;
}

/// A delta that lacks its object after InSync: the dataplane keeps the last applied state (the
/// bad message and everything after it never reach the driver), the refusal is logged with the
/// object's key, and the next stream's snapshot replaces the state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_without_its_object_leaves_the_dataplane_as_it_is() {
    let log = captured_warnings();
    let (url, fake) = start_fake(vec![
        script(vec![
            handshake(),
            sends(vec![ipset("s:a", &[]), policy("keep-me", "s:a"), in_sync()]),
            vec![Step::programmed()],
            sends(vec![
                Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                    id: Some(pid("lost-its-body")),
                    policy: None,
                }),
                ipset("s:after-the-bad-one", &[]),
            ]),
            vec![Step::Hold],
        ]),
        script(vec![
            handshake(),
            sends(vec![ipset("s:b", &[]), in_sync()]),
            vec![Step::Hold],
        ]),
    ])
    .await;
    let agent = start_agent(test_config(vec![url]), 0);
    eventually("the second stream is applied", || {
        agent
            .state()
            .is_some_and(|s| s["ipsets"].get("s:b").is_some())
    })
    .await;
    assert_eq!(fake.connection_count(), 2);
    let updates = format!("{:?}", agent.updates());
    assert!(!updates.contains("lost-its-body"), "{updates}");
    assert!(!updates.contains("s:after-the-bad-one"), "{updates}");
    assert_eq!(agent.applies(), 2, "one apply per complete snapshot");
    let lines = log_lines_with(&log, "lost-its-body");
    assert_eq!(lines.len(), 1, "{lines:?}");
    for part in [
        "error=ActivePolicyUpdate \"GlobalNetworkPolicy/lost-its-body\" without its policy",
        "kind=\"ActivePolicyUpdate\"",
        "key=\"GlobalNetworkPolicy/lost-its-body\"",
    ] {
        assert!(lines[0].contains(part), "{part} in {lines:?}");
    }
    agent.stop().await;
}

// ------------------------------------------------------------------------------------------------
// Realization reports (capability "applied")
// ------------------------------------------------------------------------------------------------

/// A server offering `applied` learns, after the snapshot, that the InSync's sequence number is
/// in the dataplane, then each delta's number once it is applied. DataplaneInSync comes before
/// the first report, and each report follows the endpoint statuses of its apply. Refresh
/// applies that change nothing send no copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_reports_follow_the_snapshot_and_each_delta() {
    let (url, fake) = start_fake(vec![script(vec![
        handshake_applied(),
        // ServerHello is 1; the snapshot 2..=5; InSync 6.
        sends(vec![
            ipset("s:a", &["10.0.0.1"]),
            policy("p", "s:a"),
            profile("pr"),
            wep("ns/w1", "10.0.0.1/32", "p", "pr"),
            in_sync(),
        ]),
        vec![wait_applied("the snapshot applied", applied(6, 6, "", 0))],
        // One delta, number 7.
        sends(vec![wep("ns/w2", "10.0.0.2/32", "p", "pr")]),
        vec![
            wait_applied("the delta applied", applied(7, 7, "", 0)),
            Step::Hold,
        ],
    ])])
    .await;
    let agent = start_agent_with(test_config(vec![url]), 0, Some(Duration::from_millis(20)));
    eventually("the delta is reported applied", || {
        applied_reports(&fake.received(0)).contains(&applied(7, 7, "", 0))
    })
    .await;
    let after = agent.log.lock().refreshes;
    eventually("more refresh applies", || {
        agent.log.lock().refreshes >= after + 3
    })
    .await;

    let reports = fake.received(0);
    assert_sequence_numbers(&reports);
    assert_eq!(
        applied_reports(&reports),
        [applied(6, 6, "", 0), applied(7, 7, "", 0)],
        "one report per change; successful refreshes repeat nothing"
    );
    let position = |f: &dyn Fn(&Report) -> bool| {
        reports
            .iter()
            .position(|m| m.payload.as_ref().is_some_and(f))
            .expect("reported")
    };
    let first_applied = position(&|p| matches!(p, Report::DataplaneApplied(_)));
    assert!(position(&|p| matches!(p, Report::DataplaneInSync(_))) < first_applied);
    assert!(position(&wep_status_update("ns/w1")) < first_applied);
    let second_applied = reports
        .iter()
        .rposition(|m| matches!(m.payload, Some(Report::DataplaneApplied(_))))
        .expect("reported");
    assert!(position(&wep_status_update("ns/w2")) < second_applied);
    agent.stop().await;
}

/// An apply that fails is reported with its error and the number still in the dataplane; the
/// retries that fail the same way are not reported again, a message arriving meanwhile is;
/// `/readiness` gives the same error; the success after it clears the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_apply_reports_its_error_and_what_is_still_applied() {
    let first_delta = Arc::new(Notify::new());
    let second_delta = Arc::new(Notify::new());
    let (url, fake) = start_fake(vec![script(vec![
        handshake_applied(),
        // ServerHello 1, IP set 2, InSync 3.
        sends(vec![ipset("s:a", &["10.0.0.1"]), in_sync()]),
        vec![Step::Gate(first_delta.clone())],
        sends(vec![ipset("s:a", &["10.0.0.2"])]),
        vec![Step::Gate(second_delta.clone())],
        sends(vec![ipset("s:a", &["10.0.0.3"])]),
        vec![Step::Hold],
    ])])
    .await;
    let agent = start_agent(test_config(vec![url]), 0);
    let reports = || applied_reports(&fake.received(0));
    eventually("the snapshot applied", || {
        reports().contains(&applied(3, 3, "", 0))
    })
    .await;
    assert_eq!(agent.metrics.readiness(), Ok(()));

    // Every apply fails from now until the test says otherwise.
    *agent.fail_applies.lock() = usize::MAX;
    first_delta.notify_one();
    let failing = applied(3, 4, "injected failure", 1);
    eventually("the failure reported", || reports().contains(&failing)).await;
    assert_eq!(
        agent.metrics.readiness(),
        Err("the last apply failed: injected failure".to_owned())
    );
    let failed = agent.log.lock().failed_applies;
    eventually("several retries", || {
        agent.log.lock().failed_applies >= failed + 3
    })
    .await;
    assert_eq!(
        reports(),
        [applied(3, 3, "", 0), failing.clone()],
        "retries failing the same way are not reported again"
    );

    // A message arriving while the apply fails: the next retry's report says so.
    second_delta.notify_one();
    let still_failing = applied(3, 5, "injected failure", 2);
    eventually("the new message reported", || {
        reports().contains(&still_failing)
    })
    .await;

    *agent.fail_applies.lock() = 0;
    eventually("the recovery reported", || {
        reports().contains(&applied(5, 5, "", 0))
    })
    .await;
    assert_eq!(
        reports(),
        [
            applied(3, 3, "", 0),
            failing,
            still_failing,
            applied(5, 5, "", 0)
        ]
    );
    eventually("ready again", || agent.metrics.readiness().is_ok()).await;
    assert_eq!(
        agent.state().expect("state")["ipsets"]["s:a"]["members"],
        serde_json::json!(["10.0.0.3"])
    );
    agent.stop().await;
}

/// A server that does not list `applied` (an older one, or a Felix-shaped one) never gets a
/// `DataplaneApplied`, after failed applies, the snapshot's or a delta's, though the agent
/// offered the capability.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_servers_capability_no_applied_reports_are_sent() {
    let (url, fake) = start_fake(vec![script(vec![
        handshake(),
        sends(vec![
            ipset("s:a", &[]),
            policy("p", "s:a"),
            profile("pr"),
            in_sync(),
        ]),
        vec![Step::programmed()],
        sends(vec![wep("ns/w1", "10.0.0.1/32", "p", "pr")]),
        vec![
            // Reports go out in order on one stream: a heartbeat after the delta's status
            // comes after anything that apply sent.
            Step::WaitFor(
                "a heartbeat after the delta's status",
                Box::new(|r| {
                    r.iter()
                        .position(|m| m.payload.as_ref().is_some_and(wep_status_update("ns/w1")))
                        .is_some_and(|at| {
                            count(&r[at..], |p| matches!(p, Report::ProcessStatusUpdate(_))) > 0
                        })
                }),
            ),
            Step::Hold,
        ],
    ])])
    .await;
    let mut config = test_config(vec![url]);
    config.heartbeat_interval = Duration::from_millis(20);
    let agent = start_agent(config, 2);
    eventually("the delta's apply reported", || {
        let r = fake.received(0);
        r.iter()
            .position(|m| m.payload.as_ref().is_some_and(wep_status_update("ns/w1")))
            .is_some_and(|at| count(&r[at..], |p| matches!(p, Report::ProcessStatusUpdate(_))) > 0)
    })
    .await;
    assert_eq!(agent.log.lock().failed_applies, 2);
    assert_eq!(agent.applies(), 2);
    let reports = fake.received(0);
    match &reports[0].payload {
        Some(Report::AgentHello(h)) => assert_eq!(h.capabilities, ["applied"]),
        other => panic!("first report must be AgentHello, got {other:?}"),
    }
    assert!(applied_reports(&reports).is_empty(), "{reports:?}");
    assert_eq!(
        reports.iter().filter(|m| is_dataplane_in_sync(m)).count(),
        1
    );
    agent.stop().await;
}
