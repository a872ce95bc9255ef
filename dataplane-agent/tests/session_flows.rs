//! Flow reports on the Sync stream (capability `flows`), against the fake calc-server
//! (`test_support::sync_server`): offered only when the driver collects flows, sent only when
//! the server's hello lists the token, one report per interval as the driver gives them, and
//! the last interval sent again (without its dropped count) on the next stream.

use std::sync::Arc;
use std::time::Duration;

use dataplane_agent::driver::{Driver, DriverError, DryRunDriver, EndpointStatuses};
use dataplane_agent::message::Message;
use dataplane_agent::session::{self, SessionConfig};
use felix_proto::from_dataplane::Payload as Report;
use felix_proto::to_dataplane::Payload;
use felix_proto::{FlowRecord, FlowReport, FromDataplane, InSync};
use parking_lot::Mutex;
use test_support::sync_server::{self, Step, SyncServer};
use tokio::sync::oneshot;

const NODE: &str = "node-1";
const WAIT: Duration = Duration::from_secs(5);

/// The dry-run driver, collecting flows from a queue the test fills: each `collect_flows` call
/// takes the next batch (nothing once empty).
struct FlowDriver {
    inner: DryRunDriver,
    collects: bool,
    batches: Arc<Mutex<Vec<Vec<FlowReport>>>>,
    calls: Arc<Mutex<usize>>,
}

impl Driver for FlowDriver {
    fn on_update(&mut self, msg: &Message) {
        self.inner.on_update(msg);
    }
    fn apply(&mut self) -> Result<(), DriverError> {
        self.inner.apply()
    }
    fn endpoint_statuses(&self) -> EndpointStatuses {
        self.inner.endpoint_statuses()
    }
    fn collects_flows(&self) -> bool {
        self.collects
    }
    fn collect_flows(&mut self, now: i64) -> Result<Vec<FlowReport>, DriverError> {
        assert!(now > 1_700_000_000, "Unix seconds: {now}");
        *self.calls.lock() += 1;
        let mut b = self.batches.lock();
        Ok(if b.is_empty() {
            Vec::new()
        } else {
            b.remove(0)
        })
    }
}

struct Agent {
    batches: Arc<Mutex<Vec<Vec<FlowReport>>>>,
    calls: Arc<Mutex<usize>>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<FlowDriver>,
}

fn start_agent(url: String, collects: bool, batches: Vec<Vec<FlowReport>>) -> Agent {
    let mut config = SessionConfig::new(vec![url], NODE);
    config.heartbeat_interval = Duration::from_secs(3600);
    config.stats_interval = None;
    config.flows_interval = Some(Duration::from_millis(20));
    config.reconnect_min_delay = Duration::from_millis(20);
    config.reconnect_max_delay = Duration::from_millis(100);
    config.connect_timeout = Duration::from_secs(2);
    config.hello_timeout = Duration::from_secs(2);
    let batches = Arc::new(Mutex::new(batches));
    let calls = Arc::new(Mutex::new(0));
    let driver = FlowDriver {
        inner: DryRunDriver::new(NODE, None),
        collects,
        batches: batches.clone(),
        calls: calls.clone(),
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(session::run(config, driver, async move {
        let _ = stopped.await;
    }));
    Agent {
        batches,
        calls,
        stop,
        task,
    }
}

impl Agent {
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(1), self.task)
            .await
            .expect("agent stops promptly")
            .expect("agent task");
    }
}

fn record(interval_start: i64, source_port: u32) -> FlowRecord {
    FlowRecord {
        interval_start,
        source_ip: "10.65.0.2".into(),
        dest_ip: "10.65.1.3".into(),
        source_port,
        dest_port: 80,
        protocol: 6,
        reporter_dest: true,
        allowed: true,
        packets_in: 3,
        connections_started: 1,
        ..Default::default()
    }
}

fn report(records: Vec<FlowRecord>, dropped: u64) -> FlowReport {
    FlowReport { records, dropped }
}

fn flow_reports(reports: &[FromDataplane]) -> Vec<FlowReport> {
    reports
        .iter()
        .filter_map(|m| match &m.payload {
            Some(Report::FlowReport(r)) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

fn capabilities(reports: &[FromDataplane]) -> Vec<String> {
    match &reports[0].payload {
        Some(Report::AgentHello(h)) => h.capabilities.clone(),
        other => panic!("first report must be AgentHello, got {other:?}"),
    }
}

/// Hello (offering `caps`), InSync.
fn handshake(caps: &[&str]) -> Vec<Step> {
    vec![
        Step::hello_received(),
        Step::Send(sync_server::server_hello("fake", NODE, caps)),
        Step::Send(Payload::InSync(InSync {})),
        Step::programmed(),
    ]
}

fn wait_flow_reports(n: usize) -> Step {
    Step::wait_for("flow reports", move |r| flow_reports(r).len() >= n)
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn flow_reports_go_out_per_interval_and_the_last_one_again_after_a_reconnect() {
    let mut first = handshake(&["applied", "flows"]);
    first.extend([wait_flow_reports(3), Step::End(None)]);
    let mut second = handshake(&["flows"]);
    second.extend([Step::Hold]);
    let fake = SyncServer::scripted(vec![first, second]).wait_limit(WAIT);
    let url = fake.spawn().await;
    // Interval 0 (with what the driver dropped), then interval 15 in two reports.
    let agent = start_agent(
        url,
        true,
        vec![
            vec![report(vec![record(0, 1)], 3)],
            vec![
                report(vec![record(15, 2)], 0),
                report(vec![record(15, 3)], 0),
            ],
        ],
    );
    eventually("the second stream got the last interval again", || {
        fake.connection_count() >= 2 && flow_reports(&fake.received(1)).len() >= 2
    })
    .await;
    let first = fake.received(0);
    assert_eq!(capabilities(&first), ["applied", "flows"]);
    assert_eq!(
        flow_reports(&first),
        [
            report(vec![record(0, 1)], 3),
            report(vec![record(15, 2)], 0),
            report(vec![record(15, 3)], 0),
        ]
    );
    // A new interval on the second stream comes after the resent one.
    agent
        .batches
        .lock()
        .push(vec![report(vec![record(30, 4)], 1)]);
    eventually("the new interval", || {
        flow_reports(&fake.received(1)).len() >= 3
    })
    .await;
    assert_eq!(
        flow_reports(&fake.received(1)),
        [
            report(vec![record(15, 2)], 0),
            report(vec![record(15, 3)], 0),
            report(vec![record(30, 4)], 1),
        ],
        "the last interval once again, its dropped count not again"
    );
    agent.stop().await;
}

#[tokio::test]
async fn without_the_servers_capability_no_flows_are_collected_or_sent() {
    let ready = Arc::new(tokio::sync::Notify::new());
    let mut script = handshake(&["applied"]);
    script.extend([Step::Signal(ready.clone()), Step::Hold]);
    let fake = SyncServer::scripted(vec![script]).wait_limit(WAIT);
    let url = fake.spawn().await;
    let agent = start_agent(url, true, vec![vec![report(vec![record(0, 1)], 0)]]);
    ready.notified().await;
    // Several flow periods pass.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let received = fake.received(0);
    assert_eq!(capabilities(&received), ["applied", "flows"]);
    assert!(flow_reports(&received).is_empty());
    assert_eq!(*agent.calls.lock(), 0, "the driver is not asked");
    assert_eq!(agent.batches.lock().len(), 1);
    agent.stop().await;
}

#[tokio::test]
async fn a_driver_that_collects_no_flows_does_not_offer_them() {
    let ready = Arc::new(tokio::sync::Notify::new());
    let mut script = handshake(&["applied", "flows"]);
    script.extend([Step::Signal(ready.clone()), Step::Hold]);
    let fake = SyncServer::scripted(vec![script]).wait_limit(WAIT);
    let url = fake.spawn().await;
    let agent = start_agent(url, false, vec![vec![report(vec![record(0, 1)], 0)]]);
    ready.notified().await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let received = fake.received(0);
    assert_eq!(capabilities(&received), ["applied"]);
    assert!(flow_reports(&received).is_empty());
    assert_eq!(*agent.calls.lock(), 0);
    agent.stop().await;
}
