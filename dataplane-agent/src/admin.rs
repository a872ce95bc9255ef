//! The agent's health and metrics: [`AgentMetrics`] (updated by the session) and the admin HTTP
//! endpoint (`--admin-listen`): `/liveness`, `/readiness`, `/metrics` (OpenMetrics text, by the
//! one metrics writer, `common::metrics`) and
//! `/programmed` (JSON: what the driver programmed, by policy, profile and endpoint, with the
//! iptables chain names; see [`crate::driver::programmed`]). Other paths answer 404.
//!
//! `/programmed` is a snapshot the session publishes after each successful apply (the session
//! stays the driver's only owner), and only once the endpoint is served: 503 before the first
//! apply, 501 for a driver that cannot say.
//!
//! Ready means: connected to a calc-server, that stream is in sync (its InSync arrived), the
//! last apply succeeded, and the session is live. Before the first InSync, while reconnecting,
//! or while an apply is failing, `/readiness` answers 503 with the reason ([`NotReady`]); for a
//! failing apply that is `the last apply failed: <error>`, the same short line the session
//! reports to the calc-server in `DataplaneApplied.error`.
//!
//! Live means the session task runs and its loop makes progress: the session marks progress
//! ([`AgentMetrics::progress`]) on every turn of its loop — a watchdog tick while connecting,
//! streaming or backing off, each batch of messages, each heartbeat, each apply — so a healthy
//! agent idle on a quiet server, or reconnecting with back-off to an absent one, stays live
//! (not ready). `/liveness` answers 503 with a one-line reason ([`NotLive`]) when the session
//! has not marked progress for the watchdog timeout (`--dataplane-watchdog-timeout`: the loop is
//! stuck in a blocking call, e.g. an apply waiting on a lock), or when a stream's snapshot has
//! been arriving for longer than the snapshot deadline plus the watchdog timeout (the session
//! should have dropped it at the deadline).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use common::metrics::{self as writer, Histogram};
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::driver::{DriverMetrics, ProgrammedObjects};

/// The apply-time buckets: an agent's applies run from a millisecond to tens of seconds.
const APPLY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Why the agent is not live: `/liveness` answers 503 with this line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotLive {
    #[error("session not running")]
    SessionNotRunning,
    /// The session loop has not marked progress for longer than the watchdog timeout.
    #[error(
        "session loop stalled: no progress for {secs:.1}s (watchdog timeout {watchdog:?})",
        secs = idle.as_secs_f64()
    )]
    Stalled { idle: Duration, watchdog: Duration },
    /// A stream's snapshot has been arriving for longer than its deadline plus the watchdog.
    #[error(
        "snapshot stuck: the stream's snapshot has been arriving for {secs:.1}s without InSync \
         (snapshot timeout {deadline:?})",
        secs = age.as_secs_f64()
    )]
    SnapshotStuck { age: Duration, deadline: Duration },
}

/// Why the agent is not ready: `/readiness` answers 503 with this line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    #[error("the session loop is stuck (see /liveness)")]
    Stuck,
    #[error("not connected to a calc-server")]
    NotConnected,
    #[error("waiting for the calc-server's snapshot (InSync)")]
    NoSnapshot,
    /// The last apply failed: its error, the one line the session reports to the calc-server
    /// in `DataplaneApplied.error` (it says what to fix without a trip to the log).
    #[error("the last apply failed: {0}")]
    ApplyFailed(String),
    #[error("the dataplane has not been programmed yet")]
    NotProgrammed,
}

/// The outcome of the last apply.
#[derive(Debug)]
enum LastApply {
    Succeeded,
    /// Its error on one short line, as the session reports it.
    Failed(String),
}

/// Health and counters shared by the session (writer) and the admin endpoint (reader).
#[derive(Debug)]
pub struct AgentMetrics {
    connected: AtomicBool,
    stream_in_sync: AtomicBool,
    /// `None` before the first apply.
    last_apply: Mutex<Option<LastApply>>,
    session_running: AtomicBool,
    /// Apply durations, in [`APPLY_BUCKETS`].
    applies: Histogram,
    apply_failures: Counter,
    resyncs: Counter,
    streams: Counter,
    messages: Counter,
    /// What the driver reported after the last apply (written when scraped).
    driver: Arc<DriverSizes>,
    /// Every metric, for `/metrics`.
    exported: Exported,
    health: Mutex<Health>,
    /// What `/programmed` shows.
    programmed: Mutex<ProgrammedView>,
    /// `/programmed` is served: until it is, the session builds no dumps.
    programmed_wanted: AtomicBool,
}

/// The registry `/metrics` encodes, and the gauges set just before each encode.
#[derive(Debug)]
struct Exported {
    registry: Registry,
    ready: Gauge,
    connected: Gauge,
}

/// The driver's sizes after the last apply: a collector writing those the driver reports.
#[derive(Debug, Default)]
struct DriverSizes(Mutex<DriverMetrics>);

impl Default for AgentMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let (ready, connected) = (Gauge::default(), Gauge::default());
        registry.register(
            "dataplane_agent_ready",
            "1 when connected, in sync and the last apply succeeded",
            ready.clone(),
        );
        registry.register(
            "dataplane_agent_connected",
            "1 while a Sync stream to a calc-server is open",
            connected.clone(),
        );
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let streams = counter(
            &mut registry,
            "dataplane_agent_streams",
            "Sync streams opened (ServerHello accepted)",
        );
        let resyncs = counter(
            &mut registry,
            "dataplane_agent_resyncs",
            "Snapshots received after the first one (reconnects, fail-overs, fell-behind resyncs)",
        );
        let messages = counter(
            &mut registry,
            "dataplane_agent_messages",
            "Messages received from calc-servers",
        );
        let apply_failures = counter(
            &mut registry,
            "dataplane_agent_apply_failures",
            "Applies that failed (retried with back-off)",
        );
        let applies = Histogram::new(APPLY_BUCKETS);
        registry.register(
            "dataplane_agent_apply_seconds",
            "Time of each apply (programming the dataplane), failed ones included",
            applies.clone(),
        );
        let driver = Arc::new(DriverSizes::default());
        registry.register_collector(Box::new(driver.clone()));
        AgentMetrics {
            connected: AtomicBool::default(),
            stream_in_sync: AtomicBool::default(),
            last_apply: Mutex::default(),
            session_running: AtomicBool::default(),
            applies,
            apply_failures,
            resyncs,
            streams,
            messages,
            driver,
            exported: Exported {
                registry,
                ready,
                connected,
            },
            health: Mutex::default(),
            programmed: Mutex::default(),
            programmed_wanted: AtomicBool::default(),
        }
    }
}

impl Collector for DriverSizes {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let d = *self.0.lock();
        for (name, help, v) in [
            (
                "dataplane_agent_programmed_rules",
                "Rules of ours after the last apply: iptables rules in all tables and families (linux driver), or nftables rules in our tables (nftables driver)",
                d.rules,
            ),
            (
                "dataplane_agent_programmed_ipsets",
                "IP sets of ours after the last apply",
                d.ipsets,
            ),
            (
                "dataplane_agent_programmed_ipset_members",
                "Members of our IP sets after the last apply",
                d.ipset_members,
            ),
            (
                "dataplane_agent_programmed_routes",
                "Routes of ours after the last apply",
                d.routes,
            ),
            (
                "dataplane_agent_rejected_objects",
                "Objects from the calc-server the agent refused to program as sent (held failing closed); the log names each with its reason",
                d.rejected,
            ),
        ] {
            if let Some(v) = v {
                writer::gauge(&mut e, name, help, v)?;
            }
        }
        Ok(())
    }
}

/// The session's last published dump.
#[derive(Clone, Debug, Default)]
enum ProgrammedView {
    #[default]
    NotYet,
    /// The driver cannot say.
    Unsupported,
    /// Shared so a request serialises it without holding the lock the session publishes under.
    Objects(Arc<ProgrammedObjects>),
}

/// What liveness is judged on.
#[derive(Debug, Default)]
struct Health {
    /// When the session loop last made progress (`None` before it started).
    progress: Option<Instant>,
    /// When the current stream's snapshot began (its ServerHello), until its InSync.
    snapshot_since: Option<Instant>,
    /// No progress for this long is a stall (`None`: never judged stalled).
    watchdog: Option<Duration>,
    /// The session drops a snapshot this long after its ServerHello.
    snapshot_timeout: Option<Duration>,
}

impl AgentMetrics {
    /// A stream's ServerHello was accepted.
    pub fn stream_started(&self) {
        self.connected.store(true, Ordering::Relaxed);
        self.stream_in_sync.store(false, Ordering::Relaxed);
        self.streams.inc();
        self.health().snapshot_since = Some(Instant::now());
    }

    /// The stream ended (or could not be made).
    pub fn stream_ended(&self) {
        self.connected.store(false, Ordering::Relaxed);
        self.stream_in_sync.store(false, Ordering::Relaxed);
        self.health().snapshot_since = None;
    }

    /// The stream's InSync arrived; `resync` when an earlier stream had been in sync.
    pub fn in_sync(&self, resync: bool) {
        self.stream_in_sync.store(true, Ordering::Relaxed);
        self.health().snapshot_since = None;
        if resync {
            self.resyncs.inc();
        }
    }

    /// One message from the server was handled.
    pub fn message(&self) {
        self.messages.inc();
    }

    /// An apply finished: `Ok`, or `Err` with why it failed on one short line (readiness shows
    /// it as given).
    pub fn applied(&self, took: Duration, outcome: Result<(), &str>, driver: DriverMetrics) {
        self.applies.observe(took);
        if outcome.is_err() {
            self.apply_failures.inc();
        }
        *self.last_apply.lock() = Some(match outcome {
            Ok(()) => LastApply::Succeeded,
            Err(error) => LastApply::Failed(error.to_owned()),
        });
        *self.driver.0.lock() = driver;
    }

    /// After a successful apply: `dump` gives the driver's [`ProgrammedObjects`] for
    /// `/programmed`. It is called only while that endpoint is served.
    pub fn publish_programmed(&self, dump: impl FnOnce() -> Option<ProgrammedObjects>) {
        if !self.programmed_wanted.load(Ordering::Relaxed) {
            return;
        }
        let view = match dump() {
            Some(objects) => ProgrammedView::Objects(Arc::new(objects)),
            None => ProgrammedView::Unsupported,
        };
        *self.programmed.lock() = view;
    }

    /// The session task runs (liveness).
    pub fn set_session_running(&self, running: bool) {
        self.session_running.store(running, Ordering::Relaxed);
    }

    /// The limits liveness is judged by: no progress for `watchdog`, or a snapshot older than
    /// `snapshot_timeout + watchdog`, is not live. Also counts as progress.
    pub fn set_liveness_limits(&self, watchdog: Duration, snapshot_timeout: Duration) {
        let mut h = self.health();
        h.watchdog = Some(watchdog);
        h.snapshot_timeout = Some(snapshot_timeout);
        h.progress = Some(Instant::now());
    }

    /// The session loop made progress (see the module documentation).
    pub fn progress(&self) {
        self.health().progress = Some(Instant::now());
    }

    fn health(&self) -> parking_lot::MutexGuard<'_, Health> {
        self.health.lock()
    }

    /// `Ok` when live, else why not.
    pub fn live(&self) -> Result<(), NotLive> {
        self.live_at(Instant::now())
    }

    /// [`AgentMetrics::live`] as `/liveness` shows it: `Err` is its one-line answer.
    pub fn liveness(&self) -> Result<(), String> {
        self.live().map_err(|e| e.to_string())
    }

    fn live_at(&self, now: Instant) -> Result<(), NotLive> {
        if !self.session_running.load(Ordering::Relaxed) {
            return Err(NotLive::SessionNotRunning);
        }
        self.stall_at(now)
    }

    /// Why the running session counts as stuck, if it does.
    fn stall_at(&self, now: Instant) -> Result<(), NotLive> {
        let h = self.health();
        let Some(watchdog) = h.watchdog else {
            return Ok(());
        };
        if let Some(last) = h.progress {
            let idle = now.saturating_duration_since(last);
            if idle > watchdog {
                return Err(NotLive::Stalled { idle, watchdog });
            }
        }
        if let (Some(since), Some(deadline)) = (h.snapshot_since, h.snapshot_timeout) {
            let age = now.saturating_duration_since(since);
            if age > deadline.saturating_add(watchdog) {
                return Err(NotLive::SnapshotStuck { age, deadline });
            }
        }
        Ok(())
    }

    /// `Ok` when ready, else why not.
    pub fn ready(&self) -> Result<(), NotReady> {
        if self.stall_at(Instant::now()).is_err() {
            return Err(NotReady::Stuck);
        }
        if !self.connected.load(Ordering::Relaxed) {
            return Err(NotReady::NotConnected);
        }
        if !self.stream_in_sync.load(Ordering::Relaxed) {
            return Err(NotReady::NoSnapshot);
        }
        match &*self.last_apply.lock() {
            Some(LastApply::Succeeded) => Ok(()),
            // The error says what to fix (a held xtables lock, a refused table) without a trip
            // to the log.
            Some(LastApply::Failed(error)) => Err(NotReady::ApplyFailed(error.clone())),
            None => Err(NotReady::NotProgrammed),
        }
    }

    /// [`AgentMetrics::ready`] as `/readiness` shows it: `Err` is its one-line answer.
    pub fn readiness(&self) -> Result<(), String> {
        self.ready().map_err(|e| e.to_string())
    }

    /// Every metric as OpenMetrics text.
    pub fn render(&self) -> String {
        writer::encode(self.registry_now())
    }

    /// The registry, with the gauges read from the session's state set to their values now.
    fn registry_now(&self) -> &Registry {
        let e = &self.exported;
        e.ready.set(i64::from(self.ready().is_ok()));
        e.connected
            .set(i64::from(self.connected.load(Ordering::Relaxed)));
        &e.registry
    }
}

async fn readiness(State(m): State<Arc<AgentMetrics>>) -> (StatusCode, String) {
    match m.ready() {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

async fn liveness(State(m): State<Arc<AgentMetrics>>) -> (StatusCode, String) {
    match m.live() {
        Ok(()) => (StatusCode::OK, "alive\n".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

async fn metrics_text(State(m): State<Arc<AgentMetrics>>) -> impl axum::response::IntoResponse {
    writer::response(m.registry_now())
}

async fn programmed(State(m): State<Arc<AgentMetrics>>) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let view = m.programmed.lock().clone();
    match view {
        ProgrammedView::NotYet => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the dataplane has not been programmed yet\n",
        )
            .into_response(),
        ProgrammedView::Unsupported => (
            StatusCode::NOT_IMPLEMENTED,
            "this driver does not report what it programmed\n",
        )
            .into_response(),
        ProgrammedView::Objects(objects) => {
            // Serialising plain strings and lists cannot fail.
            let mut body = serde_json::to_string_pretty(&*objects).unwrap_or_default();
            body.push('\n');
            (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response()
        }
    }
}

/// The admin routes. Serving them makes the session publish `/programmed` dumps.
pub fn router(metrics: Arc<AgentMetrics>) -> axum::Router {
    metrics.programmed_wanted.store(true, Ordering::Relaxed);
    axum::Router::new()
        .route("/liveness", get(liveness))
        .route("/readiness", get(readiness))
        .route("/metrics", get(metrics_text))
        .route("/programmed", get(programmed))
        .with_state(metrics)
}

/// Binds `addr` and serves the admin routes in a background task.
pub async fn serve(addr: SocketAddr, metrics: Arc<AgentMetrics>) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router(metrics)).await {
            tracing::error!(%error, "admin endpoint failed");
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_the_session() {
        let m = AgentMetrics::default();
        assert_eq!(m.ready(), Err(NotReady::NotConnected));
        m.stream_started();
        assert_eq!(
            m.readiness(),
            Err("waiting for the calc-server's snapshot (InSync)".to_owned())
        );
        m.in_sync(false);
        assert_eq!(m.ready(), Err(NotReady::NotProgrammed));
        let driver = DriverMetrics {
            ipsets: Some(2),
            ..DriverMetrics::default()
        };
        m.applied(Duration::from_millis(3), Ok(()), driver);
        assert_eq!(m.readiness(), Ok(()));
        m.applied(
            Duration::from_millis(3),
            Err("iptables not programmed: xtables lock held"),
            driver,
        );
        assert_eq!(
            m.readiness(),
            Err("the last apply failed: iptables not programmed: xtables lock held".to_owned()),
            "the reason carries the apply's error"
        );
        m.applied(Duration::from_millis(3), Ok(()), driver);
        assert_eq!(m.readiness(), Ok(()), "a success clears the error");
        m.stream_ended();
        assert_eq!(
            m.readiness(),
            Err("not connected to a calc-server".to_owned())
        );
        m.stream_started();
        m.in_sync(true);
        let text = m.render();
        assert!(text.contains("dataplane_agent_resyncs_total 1\n"), "{text}");
        assert!(text.contains("dataplane_agent_apply_failures_total 1\n"));
        assert!(text.contains("dataplane_agent_apply_seconds_count 3\n"));
        assert!(text.contains("dataplane_agent_apply_seconds_bucket{le=\"0.005\"} 3\n"));
        assert!(text.contains("dataplane_agent_programmed_ipsets 2\n"));
        assert!(
            !text.contains("dataplane_agent_programmed_rules"),
            "unknown counts are not exported"
        );
        assert!(text.contains("dataplane_agent_streams_total 2\n"));
        assert!(text.contains("dataplane_agent_ready 1\n"));
        assert!(text.contains("dataplane_agent_connected 1\n"));
        assert!(text.ends_with("\n# EOF\n"), "OpenMetrics: {text}");
    }

    #[test]
    fn liveness_fails_on_a_stalled_loop_or_an_overdue_snapshot() {
        let m = AgentMetrics::default();
        assert_eq!(m.live(), Err(NotLive::SessionNotRunning));
        assert_eq!(m.liveness(), Err("session not running".to_owned()));
        m.set_session_running(true);
        assert_eq!(m.liveness(), Ok(()), "no limits set: running is live");

        let watchdog = Duration::from_secs(90);
        let deadline = Duration::from_secs(300);
        m.set_liveness_limits(watchdog, deadline);
        let start = Instant::now();
        m.health().progress = Some(start);
        assert_eq!(m.live_at(start + watchdog), Ok(()));
        let why = m
            .live_at(start + watchdog + Duration::from_millis(1500))
            .unwrap_err();
        assert_eq!(
            why,
            NotLive::Stalled {
                idle: watchdog + Duration::from_millis(1500),
                watchdog
            }
        );
        assert_eq!(
            why.to_string(),
            "session loop stalled: no progress for 91.5s (watchdog timeout 90s)"
        );

        // A snapshot still arriving well past its deadline, though the loop turns: the session
        // failed to drop it.
        m.stream_started();
        let since = m.health().snapshot_since.expect("snapshot started");
        let late = since + deadline + watchdog + Duration::from_secs(1);
        m.health().progress = Some(late);
        let why = m.live_at(late).unwrap_err().to_string();
        assert!(why.starts_with("snapshot stuck: "), "{why}");
        assert!(why.contains("391.0s") && why.contains("300s"), "{why}");
        assert!(!why.contains('\n'));
        assert_eq!(m.live_at(since + deadline), Ok(()), "within the margin");
        m.in_sync(false);
        assert_eq!(m.live_at(late), Ok(()), "InSync ends the snapshot");
        m.stream_started();
        m.stream_ended();
        assert_eq!(m.live_at(late), Ok(()), "so does the stream's end");

        // A stalled loop is not ready either.
        m.applied(Duration::from_millis(1), Ok(()), DriverMetrics::default());
        m.stream_started();
        m.in_sync(true);
        m.progress();
        assert_eq!(m.readiness(), Ok(()));
        m.health().progress = Some(Instant::now() - watchdog - Duration::from_secs(1));
        assert_eq!(m.ready(), Err(NotReady::Stuck));
        assert_eq!(
            m.readiness(),
            Err("the session loop is stuck (see /liveness)".to_owned())
        );
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text() {
        use tower::ServiceExt as _;
        let request = axum::http::Request::get("/metrics")
            .body(axum::body::Body::empty())
            .unwrap();
        let response = router(Arc::new(AgentMetrics::default()))
            .oneshot(request)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()[axum::http::header::CONTENT_TYPE],
            writer::CONTENT_TYPE
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let text = String::from_utf8(body.to_vec()).unwrap();
        assert!(text.contains("\ndataplane_agent_ready 0\n"), "{text}");
        assert!(text.ends_with("\n# EOF\n"), "{text}");
    }

    #[tokio::test]
    async fn programmed_serves_the_last_published_dump() {
        use tower::ServiceExt as _;
        let get = |m: &Arc<AgentMetrics>, path: &'static str| {
            let router = router(m.clone());
            async move {
                let request = axum::http::Request::get(path)
                    .body(axum::body::Body::empty())
                    .unwrap();
                let response = router.oneshot(request).await.unwrap();
                let status = response.status();
                let body = axum::body::to_bytes(response.into_body(), 1 << 20)
                    .await
                    .unwrap();
                (status, String::from_utf8(body.to_vec()).unwrap())
            }
        };
        let m = Arc::new(AgentMetrics::default());
        let mut built = 0;
        m.publish_programmed(|| {
            built += 1;
            None
        });
        assert_eq!(built, 0, "no dump is built while nobody serves it");

        let (status, body) = get(&m, "/programmed").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        let objects = ProgrammedObjects {
            profiles: vec![crate::driver::programmed::ProgrammedProfile {
                name: "kns.default".into(),
                chains: vec!["cali-pri-kns.default".into(), "cali-pro-kns.default".into()],
                endpoints: vec![],
            }],
            ..ProgrammedObjects::default()
        };
        m.publish_programmed(|| Some(objects.clone()));
        let (status, body) = get(&m, "/programmed").await;
        assert_eq!(status, StatusCode::OK);
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(json["profiles"][0]["chains"][1], "cali-pro-kns.default");
        assert_eq!(json["policies"], serde_json::json!([]));

        m.publish_programmed(|| None);
        let (status, _) = get(&m, "/programmed").await;
        assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
        let (status, _) = get(&m, "/programmed/x").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "unknown paths stay 404");
        let (status, _) = get(&m, "/nope").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
}
