//! The session: follows a calc-server's `CalcServer.Sync` stream and drives a [`Driver`].
//!
//! One stream at a time (docs/proto.md): send `AgentHello`, expect `ServerHello`, feed the
//! snapshot to the driver, and at `InSync` sweep what the previous streams left behind and apply;
//! then apply deltas in bursts. Reports go back on the same stream: `DataplaneInSync` once per
//! stream after the first successful apply, endpoint status changes after every apply, and a
//! `ProcessStatusUpdate` heartbeat every `heartbeat_interval`.
//!
//! Realization (capability `applied`, docs/proto.md): the agent always offers it; when the
//! server's hello lists it too, every apply attempt once the stream is in sync ends its reports
//! with a `DataplaneApplied` (after `DataplaneInSync` and the endpoint statuses of that apply):
//! the highest sequence number of this stream in the dataplane, the highest handed to the
//! driver, the error of a failed apply (the same short line `/readiness` shows) and what is
//! still pending. A report identical to the previous one on the stream is not sent again.
//!
//! The session never opens a window (architecture invariant 6): `apply` is not called before the
//! process's first `InSync`, nor while a reconnect's snapshot is arriving; on a lost server the
//! dataplane stays as it is until the next stream's `InSync`.
//!
//! Reconnects use jittered exponential back-off between `reconnect_min_delay` and
//! `reconnect_max_delay`, moving to the next `--server` URL after each failed or ended stream.
//! A stream that reached `InSync` resets the back-off. Special cases:
//!
//! * `RESOURCE_EXHAUSTED` ("you fell behind"): reconnect to the same server at once, without
//!   back-off (once; if the retry also ends that way before `InSync`, normal back-off applies);
//! * `PERMISSION_DENIED`, `INVALID_ARGUMENT`, `NOT_FOUND`, or a `ServerHello` bound to another
//!   node: logged as errors, next attempt after `reconnect_max_delay`.
//!
//! A server cannot hold the agent with a snapshot that never ends. The snapshot is kept in the
//! session, not given to the driver, until its `InSync` arrives: the driver (and the tracker)
//! only ever hold complete snapshots, so a stream that ends early leaves nothing behind and the
//! dataplane's upkeep keeps using the last complete state. A stream whose `InSync` has not come
//! `snapshot_timeout` after its `ServerHello`, or whose messages before `InSync` add up to more
//! than the snapshot bound (encoded size), is dropped with an error and retried with normal
//! back-off. The bound is `max_snapshot_bytes` when set, else sized from the node's own state
//! ([`SnapshotSizing`]): a multiple of the last complete snapshot, within a floor and a
//! ceiling, so what a server that never finishes can make the agent hold follows the node.
//!
//! Every message is converted once, on receipt, into a typed [`Message`] (`message.rs`). One
//! the conversion refuses (no id, an update without its object, an unknown enum value) fails
//! closed the way a sequence gap does: it is logged by kind and key, the stream is dropped with
//! its unfinished snapshot (the driver never sees the bad message nor anything after it; the
//! dataplane stays as it is) and the agent reconnects after `reconnect_max_delay`, as after a
//! refusal, for a fresh snapshot. Nothing is default-filled or guessed.
//!
//! Liveness: the session marks progress in [`AgentMetrics`] whenever its loop turns (a watchdog
//! tick while connecting, streaming or backing off, a batch of messages, a heartbeat, an apply).
//! Only a loop stuck in a blocking call (an apply that never returns) stops the marks.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime};

use felix_proto::calc_server_client::CalcServerClient;
use felix_proto::from_dataplane::Payload as Report;
use felix_proto::{
    AgentHello, DataplaneApplied, DataplaneInSync, EndpointStatus, FromDataplane,
    HostEndpointStatusRemove, HostEndpointStatusUpdate, ProcessStatusUpdate, ToDataplane,
    WorkloadEndpointStatusRemove, WorkloadEndpointStatusUpdate,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::Code;
use tonic::transport::Endpoint;
use tracing::{debug, error, info, warn};

use crate::admin::AgentMetrics;
use crate::driver::{Driver, EndpointStatuses};
use crate::message::{Inbound, InvalidMessage, Message, Received};
use crate::tls::{ClientTls, ConnectionErrors};
use crate::tracker::Tracker;
use common::{Backoff, rfc3339_utc};
use std::sync::Arc;

/// Default [`SessionConfig::snapshot_timeout`]: a 100k-endpoint node's snapshot arrives in
/// seconds to a minute; five minutes leaves room for a loaded server.
pub const DEFAULT_SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);

const MIB: u64 = 1024 * 1024;

/// The snapshot bound of a process's first stream, before any complete snapshot says how large
/// this node's state is: 256 MiB encoded (about 1.3 GiB held, decoded). An extreme legitimate
/// node snapshot (100k dual-stack endpoints, 5,000 policies, 4 million IP set members) encodes
/// to about 230 MiB (the unit test `a_large_node_snapshot_fits_under_the_ceiling`).
pub const FIRST_SNAPSHOT_BOUND: u64 = 256 * MIB;

/// After a complete snapshot of S bytes the bound is this many times S (room for the node's
/// state to grow between resyncs), ...
pub const SNAPSHOT_BOUND_FACTOR: u64 = 4;

/// ... and at least this: 64 MiB (one large IP set message is up to `max_recv_bytes`).
pub const MIN_SNAPSHOT_BOUND: u64 = 64 * MIB;

/// The sized bound never exceeds this: 512 MiB encoded (about 2.5 GiB held). More than twice
/// the extreme node above; a node beyond it sets `--max-snapshot-bytes`.
pub const MAX_SNAPSHOT_BOUND: u64 = 512 * MIB;

/// How the snapshot bound is sized when `--max-snapshot-bytes` is not set (the defaults are
/// the constants above; tests use small ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotSizing {
    /// Before any complete snapshot.
    pub first: u64,
    /// Times the last complete snapshot.
    pub factor: u64,
    /// The least bound after a complete snapshot.
    pub min: u64,
    /// The most, ever.
    pub max: u64,
}

impl Default for SnapshotSizing {
    fn default() -> Self {
        Self {
            first: FIRST_SNAPSHOT_BOUND,
            factor: SNAPSHOT_BOUND_FACTOR,
            min: MIN_SNAPSHOT_BOUND,
            max: MAX_SNAPSHOT_BOUND,
        }
    }
}

impl SnapshotSizing {
    /// The bound from what this process has seen: `first` before any complete snapshot, else
    /// `factor` times the last complete one, at least `min`; doubled for each stream cut at the
    /// bound since (a node whose state really grew past it syncs after a few attempts instead
    /// of never); never above `max`.
    pub fn bound(&self, last_complete: Option<u64>, cut_since: u32) -> u64 {
        let base = match last_complete {
            None => self.first,
            Some(bytes) => bytes.saturating_mul(self.factor).max(self.min),
        };
        base.saturating_mul(1u64 << cut_since.min(16)).min(self.max)
    }
}

/// Default [`SessionConfig::watchdog_timeout`], as Felix's `DataplaneWatchdogTimeout`.
pub const DEFAULT_WATCHDOG_TIMEOUT: Duration = Duration::from_secs(90);

/// The capability token for `DataplaneApplied` reports (docs/proto.md, "Capabilities"). The
/// agent always offers it and reports only when the server's hello lists it.
pub const CAPABILITY_APPLIED: &str = "applied";

/// The capability token for `RuleStats` reports (docs/proto.md, "Capabilities"): offered when
/// the driver counts what its rules decide and `stats_interval` is set.
pub const CAPABILITY_STATS: &str = "stats";

/// The capability token for `FlowReport`s (docs/proto.md, "Capabilities"): offered when the
/// driver collects flows ([`Driver::collects_flows`]) and `flows_interval` is set.
pub const CAPABILITY_FLOWS: &str = "flows";

/// Most rules in one `RuleStats` (the server refuses more); a longer list goes in several.
pub const MAX_HITS_PER_REPORT: usize = 4096;

/// The longest `DataplaneApplied.error` the protocol allows (the server refuses longer ones).
pub const MAX_APPLIED_ERROR_BYTES: usize = 256;

/// Everything the session needs; build with [`SessionConfig::new`] and adjust the fields.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// calc-server URLs, tried in order and cycled through on failure. A URL without a scheme
    /// gets `http://`.
    pub servers: Vec<String>,
    /// This node's name, sent in `AgentHello`.
    pub node_name: String,
    /// Sent in `AgentHello.agent_version`.
    pub agent_version: String,
    /// Further tokens for `AgentHello.capabilities`, after the ones the agent always offers
    /// ([`CAPABILITY_APPLIED`]).
    pub capabilities: Vec<String>,
    /// How often to send a `ProcessStatusUpdate`.
    pub heartbeat_interval: Duration,
    /// How often to read the rules' counters and send what moved (`RuleStats`); `None`: never.
    pub stats_interval: Option<Duration>,
    /// How often to ask the driver for the flow records of closed 15-second intervals and send
    /// them (`FlowReport`); `None`: never.
    pub flows_interval: Option<Duration>,
    /// Shortest reconnect (and apply retry) delay.
    pub reconnect_min_delay: Duration,
    /// Longest reconnect (and apply retry) delay.
    pub reconnect_max_delay: Duration,
    /// Limit for establishing the connection.
    pub connect_timeout: Duration,
    /// Limit for the response headers, and then the `ServerHello`, to arrive after the stream
    /// opened.
    pub hello_timeout: Duration,
    /// Largest message the agent accepts from the server. A network set's IP set is one
    /// message: a million IPv6 members take about 47 MB.
    pub max_recv_bytes: usize,
    /// HTTP/2 keep-alive ping interval (a dead peer is noticed within interval + timeout).
    pub keepalive_interval: Duration,
    /// HTTP/2 keep-alive ping timeout.
    pub keepalive_timeout: Duration,
    /// Apply after at most this many messages even if more are already queued.
    pub max_batch: usize,
    /// Longest time from a stream's `ServerHello` to its `InSync`; a snapshot that takes longer
    /// is dropped (the stream ends, the agent reconnects with back-off).
    pub snapshot_timeout: Duration,
    /// Most bytes (encoded messages, the `ServerHello` included) a stream may send before its
    /// `InSync`. The unfinished snapshot is held in memory, so this bounds what a server that
    /// never finishes its snapshot can make the agent keep. `None`: sized from the node's own
    /// snapshots ([`SnapshotSizing`]).
    pub max_snapshot_bytes: Option<u64>,
    /// How the bound is sized when `max_snapshot_bytes` is `None`.
    pub snapshot_sizing: SnapshotSizing,
    /// `/liveness` fails when the session loop has made no progress for this long (a blocking
    /// apply that does not return).
    pub watchdog_timeout: Duration,
    /// When the process started, for `ProcessStatusUpdate.uptime`.
    pub process_start: Instant,
    /// Mutual TLS for `https://` servers (`None`: plaintext `http://` only).
    pub tls: Option<ClientTls>,
    /// Health and counters for the admin endpoint.
    pub metrics: Arc<AgentMetrics>,
}

impl SessionConfig {
    /// Defaults: heartbeat 5 s, reconnect 200 ms..10 s, connect and hello timeouts 10 s / 30 s,
    /// keep-alive 20 s / 10 s, messages up to 128 MiB, batches of at most 10 000 messages,
    /// snapshots within 5 min and a bound sized from the node's snapshots, watchdog 90 s, no
    /// capabilities beyond the built-in ones.
    pub fn new(servers: Vec<String>, node_name: impl Into<String>) -> Self {
        Self {
            servers,
            node_name: node_name.into(),
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            capabilities: Vec::new(),
            heartbeat_interval: Duration::from_secs(5),
            stats_interval: Some(Duration::from_secs(10)),
            flows_interval: Some(Duration::from_secs(5)),
            reconnect_min_delay: Duration::from_millis(200),
            reconnect_max_delay: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(30),
            max_recv_bytes: 128 * 1024 * 1024,
            keepalive_interval: Duration::from_secs(20),
            keepalive_timeout: Duration::from_secs(10),
            max_batch: 10_000,
            snapshot_timeout: DEFAULT_SNAPSHOT_TIMEOUT,
            max_snapshot_bytes: None,
            snapshot_sizing: SnapshotSizing::default(),
            watchdog_timeout: DEFAULT_WATCHDOG_TIMEOUT,
            process_start: Instant::now(),
            tls: None,
            metrics: Arc::default(),
        }
    }
}

/// Why a `--server` value is not a calc-server URL.
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("empty server URL")]
    Empty,
    #[error("{url}: {}", error_chain(error))]
    Invalid {
        url: String,
        error: tonic::transport::Error,
    },
    /// Without a port the URL means 80 or 443, never a calc-server's.
    #[error(
        "{0}: no port; give the calc-server's --listen port (the default is 50051), e.g. {0}:50051"
    )]
    NoPort(String),
}

/// Why a connection to a calc-server could not be made (logged; the session retries).
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error("timed out after {0:?}")]
    TimedOut(Duration),
    #[error("{0}: TLS is configured, so the server URL must be https://")]
    NeedsHttps(String),
    #[error(
        "{0}: an https:// server needs --tls-ca-file, --tls-cert-file, --tls-key-file and --tls-server-cn"
    )]
    NeedsTls(String),
    #[error(transparent)]
    Tls(#[from] crate::tls::ConnectError),
    /// The connection itself, its cause chain on one line.
    #[error("{}", error_chain(.0))]
    Transport(tonic::transport::Error),
}

/// Adds `http://` to a URL without a scheme and checks that tonic accepts it.
pub fn normalize_server_url(url: &str) -> Result<String, UrlError> {
    let url = url.trim();
    if url.is_empty() {
        return Err(UrlError::Empty);
    }
    let url = if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    };
    let endpoint = match Endpoint::from_shared(url.clone()) {
        Ok(e) => e,
        Err(error) => return Err(UrlError::Invalid { url, error }),
    };
    // Without a port the URL means 80 or 443, never a calc-server's: say so instead.
    if endpoint.uri().port_u16().is_none() {
        return Err(UrlError::NoPort(url));
    }
    Ok(url)
}

/// Runs the session until `shutdown` completes, then returns the driver. The dataplane is left
/// as it is. Never gives up on its own: every failure is retried.
pub async fn run<D: Driver>(
    config: SessionConfig,
    mut driver: D,
    shutdown: impl Future<Output = ()>,
) -> D {
    tokio::pin!(shutdown);
    if config.servers.is_empty() {
        error!("no calc-server URL configured; waiting for shutdown");
        shutdown.await;
        return driver;
    }
    let mut agent = AgentState::new(&config);
    let wake = driver.wakeup();
    let refresh_every = driver.refresh_interval().filter(|d| !d.is_zero());
    let mut offline_refresh = tokio::time::interval_at(
        tokio::time::Instant::now() + refresh_every.unwrap_or(Duration::from_secs(3600)),
        refresh_every.unwrap_or(Duration::from_secs(3600)),
    );
    offline_refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut backoff = Backoff::new(config.reconnect_min_delay, config.reconnect_max_delay);
    let mut index = 0usize;
    let mut immediate_used = false;
    config
        .metrics
        .set_liveness_limits(config.watchdog_timeout, config.snapshot_timeout);
    config.metrics.set_session_running(true);
    // Ticks whenever the session task is polled and not blocked: connecting, waiting for the
    // hello, streaming and backing off all count as progress; a blocking call does not.
    let mut watchdog = tokio::time::interval(watchdog_tick(config.watchdog_timeout));
    watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        config.metrics.progress();
        let url = config.servers[index % config.servers.len()].clone();
        let result = {
            let stream = run_stream(&config, &url, &mut driver, &mut agent);
            tokio::pin!(stream);
            loop {
                tokio::select! {
                    () = &mut shutdown => break None,
                    r = &mut stream => break Some(r),
                    _ = watchdog.tick() => config.metrics.progress(),
                }
            }
        };
        let Some(result) = result else { break };
        if result.reached_in_sync {
            backoff.reset();
            immediate_used = false;
        }
        let (delay, same_server) = match &result.end {
            StreamEnd::Status(status) if status.code() == Code::ResourceExhausted => {
                if immediate_used {
                    (backoff.next_delay(), false)
                } else {
                    immediate_used = true;
                    (Duration::ZERO, true)
                }
            }
            StreamEnd::Status(status)
                if matches!(
                    status.code(),
                    Code::PermissionDenied
                        | Code::InvalidArgument
                        | Code::NotFound
                        | Code::Unimplemented
                ) =>
            {
                (backoff.max(), false)
            }
            // Another agent for this node replaced our stream: wait the longest delay so two
            // agents for one node do not keep replacing each other at the shortest one.
            StreamEnd::Status(status) if status.code() == Code::Aborted => (backoff.max(), false),
            StreamEnd::Rejected(_) => (backoff.max(), false),
            // A server that sent one invalid message will most likely send it again in the
            // next snapshot: do not hammer it.
            StreamEnd::Invalid { .. } => (backoff.max(), false),
            _ => (backoff.next_delay(), false),
        };
        result.log(&url, delay);
        if !same_server {
            index = index.wrapping_add(1);
        }
        if !delay.is_zero() {
            let deadline = tokio::time::Instant::now() + delay;
            // While disconnected the dataplane keeps its last complete desired state; the
            // driver's refreshes and wakeups still run against it. The driver never holds an
            // unfinished snapshot (it is kept in the stream until InSync), so only a failed
            // apply leaves work pending: then we wait for the server.
            let upkeep = agent.ever_in_sync && agent.pending == 0;
            let stop = loop {
                tokio::select! {
                    () = &mut shutdown => break true,
                    () = tokio::time::sleep_until(deadline) => break false,
                    _ = watchdog.tick() => config.metrics.progress(),
                    () = wake_signal(wake.as_ref()), if upkeep => {
                        driver.on_wakeup();
                        apply_offline(&mut driver, "interface change", &config.metrics);
                    }
                    _ = offline_refresh.tick(), if upkeep && refresh_every.is_some() => {
                        driver.request_refresh();
                        apply_offline(&mut driver, "periodic refresh", &config.metrics);
                    }
                }
            };
            if stop {
                break;
            }
        }
    }
    config.metrics.set_session_running(false);
    info!("shutting down; the dataplane is left as it is");
    driver
}

/// How often the session marks progress while it waits: often enough that a healthy loop
/// never looks stalled.
fn watchdog_tick(watchdog_timeout: Duration) -> Duration {
    (watchdog_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(5))
}

/// Why a stream ended.
#[derive(Debug)]
enum StreamEnd {
    /// The connection could not be made.
    Connect(ConnectError),
    /// The call was rejected or the stream ended with a gRPC status.
    Status(tonic::Status),
    /// The server ended the stream cleanly.
    Closed,
    /// The server broke the protocol (first message not a hello, sequence gap, …).
    Protocol(String),
    /// The server bound the stream to another node.
    Rejected(String),
    /// The server sent a message the typed boundary refuses.
    Invalid { seq: u64, error: InvalidMessage },
    /// No `InSync` within `snapshot_timeout` of the `ServerHello`.
    SnapshotTimeout {
        timeout: Duration,
        messages: u64,
        bytes: u64,
    },
    /// The messages before `InSync` exceeded `max_snapshot_bytes`.
    SnapshotTooLarge {
        limit: u64,
        bytes: u64,
        messages: u64,
    },
}

struct StreamResult {
    end: StreamEnd,
    reached_in_sync: bool,
    /// The first error the stream's TLS connection met, if any.
    connection_error: Option<String>,
    /// The server answered the call (response headers).
    answered: bool,
}

impl StreamResult {
    /// The status's reason chain, with what the connection met and, for the failures whose
    /// cause the transport hides, what they usually mean.
    fn explain(&self, url: &str, s: &tonic::Status) -> String {
        let reason = with_connection_error(status_reason(s), self.connection_error.as_deref());
        let transport = matches!(
            s.code(),
            Code::Unknown | Code::Cancelled | Code::Unavailable
        );
        // The TLS connection failed after its handshake and before the server answered.
        let tls_lost_before_answer = !self.answered && self.connection_error.is_some();
        if tls_lost_before_answer && transport && !reason.contains("alert") {
            // A server refusing our certificate sends an alert and closes; when its reset
            // overtakes the alert, the reset is all the kernel lets us read.
            format!(
                "{reason}; the server dropped the TLS connection right after the handshake, as a \
                 server that refuses this agent's client certificate (--tls-cert-file) does: see \
                 the server's log"
            )
        } else if url.starts_with("http://")
            && !self.answered
            && reason.contains("frame with invalid size")
        {
            // A TLS server's alert, read as an HTTP/2 frame header.
            format!("{reason}; the server may expect TLS (https:// and the --tls-* flags)")
        } else if s.code() == Code::Unimplemented && reason.contains("HTTP status code 404") {
            // An HTTP server without the gRPC service: calc-server's admin port, most often.
            format!(
                "{reason}; this address answers HTTP but has no CalcServer.Sync: it looks like \
                 calc-server's admin port (--admin-listen); --server takes serve's --listen address"
            )
        } else if s.code() == Code::Unimplemented {
            format!(
                "{reason}; the server does not implement felix.CalcServer/Sync: is it a calc-server?"
            )
        } else {
            reason
        }
    }

    fn log(&self, url: &str, delay: Duration) {
        let retry_in = format!("{delay:?}");
        let status_reason = |s: &tonic::Status| self.explain(url, s);
        match &self.end {
            StreamEnd::Connect(e) => {
                warn!(server = url, error = %e, retry_in, "cannot connect to calc-server")
            }
            StreamEnd::Status(s)
                if matches!(
                    s.code(),
                    Code::PermissionDenied
                        | Code::InvalidArgument
                        | Code::NotFound
                        | Code::Unimplemented
                ) =>
            {
                error!(server = url, code = ?s.code(), error = %status_reason(s), retry_in, "calc-server refused the stream")
            }
            StreamEnd::Status(s) if s.code() == Code::ResourceExhausted => {
                warn!(
                    server = url,
                    error = %status_reason(s),
                    retry_in,
                    "fell behind the calc-server; reconnecting for a fresh snapshot"
                )
            }
            StreamEnd::Status(s) if s.code() == Code::Aborted => {
                warn!(
                    server = url,
                    error = %status_reason(s),
                    retry_in,
                    "another connection for this node replaced the stream"
                )
            }
            StreamEnd::Status(s) => {
                warn!(server = url, code = ?s.code(), error = %status_reason(s), retry_in, "stream ended")
            }
            StreamEnd::Closed => info!(server = url, retry_in, "calc-server ended the stream"),
            StreamEnd::Protocol(e) => {
                warn!(server = url, error = %e, retry_in, "protocol error; ending the stream")
            }
            StreamEnd::Rejected(e) => error!(server = url, error = %e, retry_in, "stream rejected"),
            StreamEnd::Invalid { seq, error } => warn!(
                server = url,
                %error,
                kind = error.kind(),
                key = %error.key().unwrap_or("none"),
                seq,
                retry_in,
                "invalid message from calc-server; dropping the stream and its unfinished \
                 snapshot (the dataplane stays as it is)"
            ),
            StreamEnd::SnapshotTimeout {
                timeout,
                messages,
                bytes,
            } => error!(
                server = url,
                timeout = ?timeout,
                messages,
                bytes,
                retry_in,
                "no InSync within --snapshot-timeout of the ServerHello; dropping the stream and its \
                 unfinished snapshot (the dataplane stays as it is)"
            ),
            StreamEnd::SnapshotTooLarge {
                limit,
                bytes,
                messages,
            } => error!(
                server = url,
                limit_bytes = limit,
                bytes,
                messages,
                retry_in,
                "the snapshot exceeds --max-snapshot-bytes before its InSync (unless set, sized \
                 from the last complete snapshot; it doubles for the next attempt, up to its \
                 ceiling); dropping the stream and its unfinished snapshot (the dataplane stays \
                 as it is)"
            ),
        }
    }
}

/// State that outlives one stream.
struct AgentState {
    tracker: Tracker,
    /// The process has seen an `InSync`: applies are allowed (while a stream is in sync).
    ever_in_sync: bool,
    /// Messages given to the driver since its last successful apply.
    pending: usize,
    /// Endpoint statuses as last reported (on this or an earlier stream).
    reported: EndpointStatuses,
    apply_backoff: Backoff,
    process_start: Instant,
    metrics: Arc<AgentMetrics>,
    /// Encoded bytes of the last complete snapshot (from `ServerHello` to `InSync`).
    last_snapshot_bytes: Option<u64>,
    /// Streams cut at the snapshot bound since the last complete snapshot.
    snapshot_cuts: u32,
    /// The flow reports of the last interval sent (records only), sent again on the next
    /// stream: the protocol has no acknowledgement, and the server keeps one record per
    /// (interval, connection, reporter).
    last_flows: Vec<felix_proto::FlowReport>,
}

impl AgentState {
    fn new(config: &SessionConfig) -> Self {
        Self {
            tracker: Tracker::default(),
            ever_in_sync: false,
            pending: 0,
            reported: EndpointStatuses::default(),
            apply_backoff: Backoff::new(config.reconnect_min_delay, config.reconnect_max_delay),
            process_start: config.process_start,
            metrics: config.metrics.clone(),
            last_snapshot_bytes: None,
            snapshot_cuts: 0,
            last_flows: Vec::new(),
        }
    }
}

/// Reports back to the server, numbering them.
struct Outbound {
    tx: mpsc::UnboundedSender<FromDataplane>,
    seq: u64,
}

impl Outbound {
    fn send(&mut self, payload: Report) {
        self.seq += 1;
        // If the stream is gone the receive side reports why; nothing to do here.
        let _ = self.tx.send(FromDataplane {
            payload: Some(payload),
            sequence_number: self.seq,
        });
    }
}

/// Per-stream state.
struct StreamState {
    out: Outbound,
    /// Next expected `ToDataplane.sequence_number`.
    expected_seq: u64,
    in_sync: bool,
    dataplane_in_sync_sent: bool,
    /// Statuses not yet sent on this stream: the next report sends all of them.
    resend_statuses: bool,
    retry_at: Option<tokio::time::Instant>,
    messages: u64,
    /// The snapshot so far, held here until the stream's `InSync` and then given to the driver
    /// at once: dropping the stream drops it, and the driver never holds half a snapshot.
    snapshot: Vec<Message>,
    /// Encoded bytes received on this stream before its `InSync` (the `ServerHello` included).
    snapshot_bytes: u64,
    /// The server listed [`CAPABILITY_APPLIED`]: send `DataplaneApplied` after applies.
    report_applied: bool,
    /// The highest sequence number of this stream the driver has been handed, or ignored once
    /// in sync (see `handle`); 0 before `InSync`, as the snapshot is held here until then.
    handled_seq: u64,
    /// `handled_seq` as of this stream's last successful apply (0: none yet).
    applied_seq: u64,
    /// The last `DataplaneApplied` sent on this stream, so an identical one is not resent.
    last_applied_report: Option<DataplaneApplied>,
    /// The previous stream's last flow interval was sent again on this one.
    flows_resent: bool,
}

/// `e` and its `source()` chain on one line, each cause once (wrappers often repeat their
/// cause's text).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = String::new();
    push_chain(&mut s, Some(e));
    s
}

/// Appends `first` and its sources to `out`, skipping texts `out` already holds.
fn push_chain(out: &mut String, first: Option<&dyn std::error::Error>) {
    let mut source = first;
    while let Some(inner) = source {
        let text = one_line(&inner.to_string());
        if !text.is_empty() && !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        source = inner.source();
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `e`'s chain on one line, cut to [`MAX_APPLIED_ERROR_BYTES`] on a char boundary (ending in
/// `…` when cut): what `DataplaneApplied.error` and `/readiness` say. The log has it whole.
fn short_error(e: &dyn std::error::Error) -> String {
    let mut text = error_chain(e);
    if text.is_empty() {
        // An empty error would read as "no error" to the server.
        text = "apply failed without an error message".to_owned();
    }
    if text.len() > MAX_APPLIED_ERROR_BYTES {
        let mut end = MAX_APPLIED_ERROR_BYTES - '…'.len_utf8();
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// The tokens for `AgentHello.capabilities`: the built-in ones (`stats` and `flows` when this
/// agent will send them), then the configured ones, each once.
fn offered_capabilities(configured: &[String], stats: bool, flows: bool) -> Vec<String> {
    let mut out = vec![CAPABILITY_APPLIED.to_owned()];
    if stats {
        out.push(CAPABILITY_STATS.to_owned());
    }
    if flows {
        out.push(CAPABILITY_FLOWS.to_owned());
    }
    for c in configured {
        if !out.contains(c) {
            out.push(c.clone());
        }
    }
    out
}

/// `reason`, plus what the connection itself met when the reason does not already say it.
fn with_connection_error(reason: String, connection: Option<&str>) -> String {
    match connection {
        Some(c) if !reason.contains(c) => format!("{reason}; connection: {c}"),
        _ => reason,
    }
}

/// A gRPC status's message followed by its cause chain, on one line. A connection that failed
/// under the call (a TLS alert from a server refusing our certificate, a reset) surfaces as
/// "transport error" or "operation was canceled"; the reason is only in the sources.
fn status_reason(status: &tonic::Status) -> String {
    let mut out = one_line(status.message());
    push_chain(&mut out, std::error::Error::source(status));
    if out.is_empty() {
        out = format!("{:?}", status.code());
    }
    out
}

/// A client for `url`, with the record of its TLS connections' errors when it uses TLS.
async fn connect(
    config: &SessionConfig,
    url: &str,
) -> Result<
    (
        CalcServerClient<tonic::transport::Channel>,
        Option<ConnectionErrors>,
    ),
    ConnectError,
> {
    let url = normalize_server_url(url)?;
    let settings = |e: Endpoint| {
        e.connect_timeout(config.connect_timeout)
            .http2_keep_alive_interval(config.keepalive_interval)
            .keep_alive_timeout(config.keepalive_timeout)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true)
    };
    // No silent fallback: an https:// server needs TLS settings and TLS settings need https://.
    match (&config.tls, url.starts_with("https://")) {
        (Some(tls), true) => {
            return match tokio::time::timeout(config.connect_timeout, tls.connect(&url, settings))
                .await
            {
                Ok(Ok((channel, errors))) => Ok((client(config, channel), Some(errors))),
                Ok(Err(e)) => Err(e.into()),
                Err(_) => Err(ConnectError::TimedOut(config.connect_timeout)),
            };
        }
        (Some(_), false) => return Err(ConnectError::NeedsHttps(url)),
        (None, true) => return Err(ConnectError::NeedsTls(url)),
        (None, false) => {}
    }
    let endpoint = settings(Endpoint::from_shared(url).map_err(ConnectError::Transport)?);
    match tokio::time::timeout(config.connect_timeout, endpoint.connect()).await {
        Ok(Ok(channel)) => Ok((client(config, channel), None)),
        Ok(Err(e)) => Err(ConnectError::Transport(e)),
        Err(_) => Err(ConnectError::TimedOut(config.connect_timeout)),
    }
}

fn client(
    config: &SessionConfig,
    channel: tonic::transport::Channel,
) -> CalcServerClient<tonic::transport::Channel> {
    CalcServerClient::new(channel).max_decoding_message_size(config.max_recv_bytes)
}

/// Polls `stream` once: `Some(item)` if something was ready, `None` if it would wait.
async fn poll_ready<S: Stream + Unpin>(stream: &mut S) -> Option<Option<S::Item>> {
    std::future::poll_fn(|cx| match Pin::new(&mut *stream).poll_next(cx) {
        Poll::Ready(item) => Poll::Ready(Some(item)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}

/// Runs `f`, letting the runtime move other tasks off this thread if it can (apply may block).
fn run_blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

async fn run_stream<D: Driver>(
    config: &SessionConfig,
    url: &str,
    driver: &mut D,
    agent: &mut AgentState,
) -> StreamResult {
    let mut outcome = Outcome::default();
    let end = stream_inner(config, url, driver, agent, &mut outcome).await;
    config.metrics.stream_ended();
    let connection_error = outcome
        .connection
        .as_ref()
        .and_then(ConnectionErrors::first);
    StreamResult {
        end,
        reached_in_sync: outcome.reached_in_sync,
        answered: outcome.answered,
        connection_error,
    }
}

/// What a stream leaves beside its end.
#[derive(Default)]
struct Outcome {
    reached_in_sync: bool,
    /// The server answered the call (response headers).
    answered: bool,
    /// The TLS connections' errors (TLS only).
    connection: Option<ConnectionErrors>,
}

async fn stream_inner<D: Driver>(
    config: &SessionConfig,
    url: &str,
    driver: &mut D,
    agent: &mut AgentState,
    outcome: &mut Outcome,
) -> StreamEnd {
    debug!(server = url, "connecting");
    let mut client = match connect(config, url).await {
        Ok((c, errors)) => {
            outcome.connection = errors;
            c
        }
        Err(e) => return StreamEnd::Connect(e),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let mut out = Outbound { tx, seq: 0 };
    out.send(Report::AgentHello(AgentHello {
        node_name: config.node_name.clone(),
        agent_version: config.agent_version.clone(),
        capabilities: offered_capabilities(
            &config.capabilities,
            config.stats_interval.is_some() && driver.counts_hits(),
            config.flows_interval.is_some() && driver.collects_flows(),
        ),
    }));
    // A server that accepts the connection but never answers must not hold the agent.
    let opened = tokio::time::timeout(
        config.hello_timeout,
        client.sync(UnboundedReceiverStream::new(rx)),
    );
    let mut inbound = match opened.await {
        Ok(Ok(response)) => {
            outcome.answered = true;
            response.into_inner()
        }
        Ok(Err(status)) => return StreamEnd::Status(status),
        Err(_) => {
            return StreamEnd::Protocol(format!(
                "no response headers within {:?}",
                config.hello_timeout
            ));
        }
    };

    // The ServerHello comes first, numbered 1.
    let first: ToDataplane = match tokio::time::timeout(config.hello_timeout, inbound.next()).await
    {
        Err(_) => {
            return StreamEnd::Protocol(format!(
                "no ServerHello within {:?}",
                config.hello_timeout
            ));
        }
        Ok(None) => return StreamEnd::Closed,
        Ok(Some(Err(status))) => return StreamEnd::Status(status),
        Ok(Some(Ok(msg))) => msg,
    };
    let hello_bytes = encoded_len(&first);
    let first = match Inbound::try_from(first) {
        Ok(first) => first,
        Err(error) => return StreamEnd::Invalid { seq: 1, error },
    };
    let hello = match first.received {
        Received::ServerHello(h) if first.sequence_number == 1 => h,
        Received::ServerHello(_) => {
            return StreamEnd::Protocol(format!(
                "ServerHello carries sequence number {}, expected 1",
                first.sequence_number
            ));
        }
        other => {
            return StreamEnd::Protocol(format!(
                "first message is not a ServerHello: {}",
                other.kind()
            ));
        }
    };
    if !hello.node_name.is_empty() && hello.node_name != config.node_name {
        return StreamEnd::Rejected(format!(
            "the server bound the stream to node {:?}, this agent is {:?}",
            hello.node_name, config.node_name
        ));
    }
    info!(
        server = url,
        server_version = %hello.server_version,
        capabilities = ?hello.capabilities,
        node = %config.node_name,
        "connected to calc-server"
    );
    config.metrics.stream_started();
    // An older server, or a Felix-shaped one, does not list the token: it gets no new messages.
    // Exact match: a token with a `:value` suffix would be a variant this agent does not know.
    let report_applied = hello.capabilities.iter().any(|c| c == CAPABILITY_APPLIED);
    let stats_every = config.stats_interval.filter(|_| {
        driver.counts_hits() && hello.capabilities.iter().any(|c| c == CAPABILITY_STATS)
    });
    let flows_every = config.flows_interval.filter(|_| {
        driver.collects_flows() && hello.capabilities.iter().any(|c| c == CAPABILITY_FLOWS)
    });
    // The snapshot's deadline runs from the hello: a server that keeps the stream busy (or
    // idle) without ever finishing its snapshot is left.
    let snapshot_deadline = tokio::time::sleep(config.snapshot_timeout);
    tokio::pin!(snapshot_deadline);
    if agent.ever_in_sync {
        info!(
            known_objects = agent.tracker.known_len(),
            "resyncing: the dataplane stays as it is until the new snapshot is complete"
        );
    }
    agent.tracker.begin_stream();

    let snapshot_bound = config.max_snapshot_bytes.unwrap_or_else(|| {
        config
            .snapshot_sizing
            .bound(agent.last_snapshot_bytes, agent.snapshot_cuts)
    });
    debug!(server = url, snapshot_bound, "stream open");
    let mut st = StreamState {
        out,
        expected_seq: 2,
        in_sync: false,
        dataplane_in_sync_sent: false,
        resend_statuses: true,
        retry_at: None,
        messages: 0,
        snapshot: Vec::new(),
        snapshot_bytes: hello_bytes,
        report_applied,
        handled_seq: 0,
        applied_seq: 0,
        last_applied_report: None,
        flows_resent: false,
    };
    // The first tick is immediate: a heartbeat right after the hello, then one per interval.
    let mut heartbeat =
        tokio::time::interval(config.heartbeat_interval.max(Duration::from_millis(1)));
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Periodic read-back and repair, for drivers that want it.
    let refresh_every = driver.refresh_interval().filter(|d| !d.is_zero());
    let mut refresh = tokio::time::interval_at(
        tokio::time::Instant::now() + refresh_every.unwrap_or(Duration::from_secs(3600)),
        refresh_every.unwrap_or(Duration::from_secs(3600)),
    );
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The driver's own "something changed under me" signal (interfaces).
    let wake = driver.wakeup();
    // What the rules matched, when the server takes it.
    let stats_period = stats_every.unwrap_or(Duration::from_secs(3600));
    let mut stats =
        tokio::time::interval_at(tokio::time::Instant::now() + stats_period, stats_period);
    stats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The connections the rules decided, when the server takes them.
    let flows_period = flows_every.unwrap_or(Duration::from_secs(3600));
    let mut flows =
        tokio::time::interval_at(tokio::time::Instant::now() + flows_period, flows_period);
    flows.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        let retry_at = st.retry_at;
        let retry = async move {
            match retry_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            item = inbound.next() => {
                let mut item = item;
                let mut batch = 0usize;
                loop {
                    let msg = match item {
                        Some(Ok(msg)) => msg,
                        end => {
                            // What arrived before the end is complete (the stream is in
                            // sync): apply it now, not at the next stream's InSync.
                            if batch > 0 && st.retry_at.is_none() {
                                maybe_apply(&mut st, driver, agent);
                            }
                            return match end {
                                Some(Err(status)) => StreamEnd::Status(status),
                                _ => StreamEnd::Closed,
                            };
                        }
                    };
                    config.metrics.message();
                    if !st.in_sync {
                        st.snapshot_bytes = st.snapshot_bytes.saturating_add(encoded_len(&msg));
                        if st.snapshot_bytes > snapshot_bound {
                            agent.snapshot_cuts = agent.snapshot_cuts.saturating_add(1);
                            return StreamEnd::SnapshotTooLarge {
                                limit: snapshot_bound,
                                bytes: st.snapshot_bytes,
                                messages: st.messages + 1,
                            };
                        }
                    }
                    if let Err(end) = handle(msg, &mut st, driver, agent) {
                        return end;
                    }
                    if st.in_sync {
                        outcome.reached_in_sync = true;
                    }
                    batch += 1;
                    if batch >= config.max_batch {
                        break;
                    }
                    match poll_ready(&mut inbound).await {
                        Some(next) => item = next,
                        None => break,
                    }
                }
                config.metrics.progress();
                if st.retry_at.is_none() {
                    maybe_apply(&mut st, driver, agent);
                }
            }
            () = &mut snapshot_deadline, if !st.in_sync => {
                return StreamEnd::SnapshotTimeout {
                    timeout: config.snapshot_timeout,
                    messages: st.messages,
                    bytes: st.snapshot_bytes,
                };
            }
            _ = heartbeat.tick() => {
                config.metrics.progress();
                st.out.send(Report::ProcessStatusUpdate(ProcessStatusUpdate {
                    iso_timestamp: rfc3339_utc(SystemTime::now()),
                    uptime: agent.process_start.elapsed().as_secs_f64(),
                }));
            }
            () = retry => {
                st.retry_at = None;
                maybe_apply(&mut st, driver, agent);
            }
            () = wake_signal(wake.as_ref()) => {
                if st.in_sync && agent.ever_in_sync {
                    driver.on_wakeup();
                    agent.pending += 1;
                    if st.retry_at.is_none() {
                        maybe_apply(&mut st, driver, agent);
                    }
                }
            }
            _ = stats.tick(), if stats_every.is_some() => {
                if st.in_sync && agent.ever_in_sync {
                    report_hits(&mut st, driver);
                }
            }
            _ = flows.tick(), if flows_every.is_some() => {
                if st.in_sync && agent.ever_in_sync {
                    report_flows(&mut st, driver, agent);
                }
            }
            _ = refresh.tick(), if refresh_every.is_some() => {
                if st.in_sync && agent.ever_in_sync {
                    debug!("periodic dataplane refresh");
                    driver.request_refresh();
                    agent.pending += 1;
                    if st.retry_at.is_none() {
                        maybe_apply(&mut st, driver, agent);
                    }
                }
            }
        }
    }
}

/// Reads what the rules matched since the last collection and sends it, in reports of at most
/// [`MAX_HITS_PER_REPORT`] rules. A failed read is logged; the next one covers its interval
/// (counts are compared with the last successful read).
fn report_hits<D: Driver>(st: &mut StreamState, driver: &mut D) {
    let started = Instant::now();
    match run_blocking(|| driver.collect_hits()) {
        Ok(hits) => {
            debug!(
                rules = hits.len(),
                elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
                "rule counters read"
            );
            let mut hits = hits;
            while !hits.is_empty() {
                let rest = hits.split_off(hits.len().min(MAX_HITS_PER_REPORT));
                st.out
                    .send(Report::RuleStats(felix_proto::RuleStats { hits }));
                hits = rest;
            }
        }
        Err(error) => {
            warn!(error = %error_chain(&error), "could not read the rules' counters; the next read covers this interval")
        }
    }
}

/// Sends the flow records of the intervals the driver closed since the last call, one
/// `FlowReport` per interval (at most [`crate::flows::MAX_RECORDS_PER_REPORT`] records each),
/// after sending the previous stream's last interval again, once per stream (records only: its
/// dropped count was sent). The last interval sent is kept for the next stream. A failed
/// collection is logged; the driver keeps its records for the next call.
fn report_flows<D: Driver>(st: &mut StreamState, driver: &mut D, agent: &mut AgentState) {
    if !st.flows_resent {
        st.flows_resent = true;
        for report in &agent.last_flows {
            st.out.send(Report::FlowReport(report.clone()));
        }
        if !agent.last_flows.is_empty() {
            debug!(
                reports = agent.last_flows.len(),
                "flow records of the last interval sent again"
            );
        }
    }
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let reports = match run_blocking(|| driver.collect_flows(now)) {
        Ok(r) => r,
        Err(error) => {
            warn!(error = %error_chain(&error), "could not collect flow records");
            return;
        }
    };
    if reports.is_empty() {
        return;
    }
    let records: usize = reports.iter().map(|r| r.records.len()).sum();
    let dropped: u64 = reports.iter().map(|r| r.dropped).sum();
    debug!(
        reports = reports.len(),
        records, dropped, "flow records sent"
    );
    if dropped > 0 {
        warn!(
            dropped,
            "flow records dropped by the agent (caps on connections or queue)"
        );
    }
    // The last interval with records: what a new stream gets again.
    let last = reports
        .iter()
        .filter_map(|r| r.records.first().map(|x| x.interval_start))
        .max();
    if let Some(last) = last {
        agent.last_flows = reports
            .iter()
            .filter(|r| r.records.first().is_some_and(|x| x.interval_start == last))
            .map(|r| felix_proto::FlowReport {
                records: r.records.clone(),
                dropped: 0,
            })
            .collect();
    }
    for report in reports {
        st.out.send(Report::FlowReport(report));
    }
}

/// Applies while no server is connected (nothing to report to; statuses go out on the next
/// stream). A failure is logged and left to the next attempt.
fn apply_offline<D: Driver>(driver: &mut D, why: &str, metrics: &AgentMetrics) {
    let started = Instant::now();
    match run_blocking(|| driver.apply()) {
        Ok(()) => {
            debug!(
                why,
                elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                "applied while disconnected"
            );
            // An interface change can give a host endpoint its chains.
            metrics.publish_programmed(|| driver.programmed_objects());
        }
        Err(e) => {
            warn!(why, error = %error_chain(&e), "apply while disconnected failed; will retry")
        }
    }
}

/// Completes when the driver signals a change; never without a signal.
async fn wake_signal(wake: Option<&std::sync::Arc<tokio::sync::Notify>>) {
    match wake {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// Checks the sequence number, converts the message, and gives it to the driver (and the
/// tracker). A stream that must end comes back as `Err`.
fn handle<D: Driver>(
    msg: ToDataplane,
    st: &mut StreamState,
    driver: &mut D,
    agent: &mut AgentState,
) -> Result<(), StreamEnd> {
    if msg.sequence_number != st.expected_seq {
        return Err(StreamEnd::Protocol(format!(
            "sequence gap: expected {}, got {}",
            st.expected_seq, msg.sequence_number
        )));
    }
    let seq = msg.sequence_number;
    st.expected_seq += 1;
    st.messages += 1;
    let received = match Inbound::try_from(msg) {
        Ok(inbound) => inbound.received,
        Err(error) => return Err(StreamEnd::Invalid { seq, error }),
    };
    match received {
        Received::Unknown => {
            debug!(seq, "message with an unknown or empty payload; ignored");
        }
        Received::Staged(key) => {
            debug!(seq, policy = %key, "staged policy: computed by the server, never programmed");
        }
        Received::ServerHello(_) => {
            return Err(StreamEnd::Protocol(
                "a second ServerHello on one stream".to_owned(),
            ));
        }
        Received::Message(Message::InSync) if st.in_sync => {
            warn!(seq, "a second InSync on one stream; ignored");
        }
        Received::Message(msg @ Message::InSync) => {
            // The snapshot is complete: the driver gets all of it now, then InSync, then the
            // removes for what it lacks.
            let snapshot = std::mem::take(&mut st.snapshot);
            agent.pending += snapshot.len();
            for m in snapshot {
                agent.tracker.observe(&m);
                driver.on_update(&m);
            }
            driver.on_update(&msg);
            agent.pending += 1;
            let stale = agent.tracker.sweep();
            for remove in &stale {
                debug!(message = ?remove, "sweeping an object the new snapshot lacks");
                driver.on_update(remove);
            }
            agent.pending += stale.len();
            if agent.ever_in_sync {
                info!(
                    snapshot_messages = st.messages,
                    snapshot_bytes = st.snapshot_bytes,
                    removed_stale = stale.len(),
                    "resync complete"
                );
            } else {
                info!(
                    snapshot_messages = st.messages,
                    snapshot_bytes = st.snapshot_bytes,
                    "in sync with calc-server"
                );
            }
            // The node's real state: what sizes the next stream's snapshot bound.
            agent.last_snapshot_bytes = Some(st.snapshot_bytes);
            agent.snapshot_cuts = 0;
            agent.metrics.in_sync(agent.ever_in_sync);
            st.in_sync = true;
            agent.ever_in_sync = true;
        }
        Received::Message(msg) if !st.in_sync => st.snapshot.push(msg),
        Received::Message(msg) => {
            agent.tracker.observe(&msg);
            driver.on_update(&msg);
            agent.pending += 1;
        }
    }
    // Once in sync, everything up to this message is with the driver: the snapshot and InSync
    // went to it together just above, later messages one by one. An ignored one (unknown
    // payload, a second InSync) counts too: it asks nothing of the dataplane, so it is in force
    // as soon as what came before it is, and the server need not wait on it.
    if st.in_sync {
        st.handled_seq = seq;
    }
    Ok(())
}

/// The message's size on the wire (the gRPC frame's payload).
fn encoded_len(msg: &ToDataplane) -> u64 {
    u64::try_from(felix_proto::prost::Message::encoded_len(msg)).unwrap_or(u64::MAX)
}

/// Applies if the stream is in sync and something is pending, then reports.
fn maybe_apply<D: Driver>(st: &mut StreamState, driver: &mut D, agent: &mut AgentState) {
    if !(st.in_sync && agent.ever_in_sync) || agent.pending == 0 {
        return;
    }
    let started = Instant::now();
    let changes = agent.pending;
    let result = run_blocking(|| driver.apply());
    agent.metrics.progress();
    let error = result.as_ref().err().map(|e| short_error(e));
    agent.metrics.applied(
        started.elapsed(),
        error.as_deref().map_or(Ok(()), Err),
        driver.metrics(),
    );
    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    match result {
        Ok(()) => {
            info!(changes, elapsed_ms, "applied");
            agent
                .metrics
                .publish_programmed(|| driver.programmed_objects());
            agent.pending = 0;
            st.applied_seq = st.handled_seq;
            agent.apply_backoff.reset();
            if !st.dataplane_in_sync_sent {
                st.dataplane_in_sync_sent = true;
                st.out.send(Report::DataplaneInSync(DataplaneInSync {}));
                info!("dataplane in sync; reported to calc-server");
            }
        }
        Err(e) => {
            let delay = agent.apply_backoff.next_delay();
            warn!(error = %error_chain(&e), changes, elapsed_ms, retry_in = ?delay, "apply failed; will retry");
            st.retry_at = Some(tokio::time::Instant::now() + delay);
        }
    }
    report_statuses(st, driver, agent);
    // Last, so that when the server reads it the apply's statuses are already in.
    report_applied(st, agent.pending, error);
}

/// Tells a server that asked for it (capability `applied`) what the dataplane holds after an
/// apply attempt. A report identical to the last one on this stream is skipped: retries that
/// keep failing the same way, and refreshes that change nothing, would otherwise flood the
/// server with copies.
fn report_applied(st: &mut StreamState, pending: usize, error: Option<String>) {
    if !st.report_applied {
        return;
    }
    let report = DataplaneApplied {
        applied_sequence_number: st.applied_seq,
        received_sequence_number: st.handled_seq,
        error: error.unwrap_or_default(),
        pending_changes: u64::try_from(pending).unwrap_or(u64::MAX),
    };
    if st.last_applied_report.as_ref() == Some(&report) {
        return;
    }
    debug!(
        applied = report.applied_sequence_number,
        received = report.received_sequence_number,
        pending = report.pending_changes,
        error = %report.error,
        "dataplane applied reported"
    );
    st.out.send(Report::DataplaneApplied(report.clone()));
    st.last_applied_report = Some(report);
}

/// Sends what changed in the endpoint statuses since the last report (everything, once per
/// stream), including removes for endpoints that are gone.
fn report_statuses<D: Driver>(st: &mut StreamState, driver: &D, agent: &mut AgentState) {
    let now = driver.endpoint_statuses();
    let all = std::mem::replace(&mut st.resend_statuses, false);
    let prev = &agent.reported;
    let mut sent = 0usize;
    for (key, status) in &now.workloads {
        if all || prev.workloads.get(key) != Some(status) {
            st.out.send(Report::WorkloadEndpointStatusUpdate(
                WorkloadEndpointStatusUpdate {
                    id: Some(key.to_proto()),
                    status: Some(EndpointStatus {
                        status: status.clone(),
                    }),
                    endpoint: driver.workload_endpoint(key),
                },
            ));
            sent += 1;
        }
    }
    for key in prev.workloads.keys() {
        if !now.workloads.contains_key(key) {
            st.out.send(Report::WorkloadEndpointStatusRemove(
                WorkloadEndpointStatusRemove {
                    id: Some(key.to_proto()),
                },
            ));
            sent += 1;
        }
    }
    for (id, status) in &now.hosts {
        if all || prev.hosts.get(id) != Some(status) {
            st.out
                .send(Report::HostEndpointStatusUpdate(HostEndpointStatusUpdate {
                    id: Some(id.to_proto()),
                    status: Some(EndpointStatus {
                        status: status.clone(),
                    }),
                }));
            sent += 1;
        }
    }
    for id in prev.hosts.keys() {
        if !now.hosts.contains_key(id) {
            st.out
                .send(Report::HostEndpointStatusRemove(HostEndpointStatusRemove {
                    id: Some(id.to_proto()),
                }));
            sent += 1;
        }
    }
    if sent > 0 {
        debug!(reports = sent, "endpoint status reported");
    }
    agent.reported = now;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::DriverError;

    #[test]
    fn urls_get_a_scheme() {
        assert_eq!(
            normalize_server_url("calc:50051").unwrap(),
            "http://calc:50051"
        );
        assert_eq!(
            normalize_server_url(" https://calc.example:443 ").unwrap(),
            "https://calc.example:443"
        );
        assert!(matches!(normalize_server_url(""), Err(UrlError::Empty)));
        let bad = normalize_server_url("http://bad host").unwrap_err();
        assert!(matches!(bad, UrlError::Invalid { .. }), "{bad}");
        assert!(bad.to_string().starts_with("http://bad host: "), "{bad}");
    }

    #[test]
    fn the_snapshot_bound_follows_the_node_within_its_floor_and_ceiling() {
        // The first snapshot: the floor for a node the agent knows nothing of yet.
        assert_eq!(
            SnapshotSizing::default().bound(None, 0),
            FIRST_SNAPSHOT_BOUND
        );
        // A small node: the minimum, far below the first bound and the old 2 GiB.
        assert_eq!(
            SnapshotSizing::default().bound(Some(300 * 1024), 0),
            MIN_SNAPSHOT_BOUND
        );
        assert_eq!(
            SnapshotSizing::default().bound(Some(0), 0),
            MIN_SNAPSHOT_BOUND
        );
        // A larger one: four times its last snapshot.
        assert_eq!(
            SnapshotSizing::default().bound(Some(40 * MIB), 0),
            160 * MIB
        );
        // Never above the ceiling, whatever the last snapshot.
        assert_eq!(
            SnapshotSizing::default().bound(Some(200 * MIB), 0),
            MAX_SNAPSHOT_BOUND
        );
        assert_eq!(
            SnapshotSizing::default().bound(Some(u64::MAX), 0),
            MAX_SNAPSHOT_BOUND
        );
        // Each cut doubles it (a node that grew past its bound syncs after a few attempts),
        // up to the ceiling and no further, however many cuts.
        assert_eq!(
            SnapshotSizing::default().bound(Some(MIB), 1),
            2 * MIN_SNAPSHOT_BOUND
        );
        assert_eq!(
            SnapshotSizing::default().bound(Some(MIB), 2),
            4 * MIN_SNAPSHOT_BOUND
        );
        assert_eq!(SnapshotSizing::default().bound(None, 1), MAX_SNAPSHOT_BOUND);
        assert_eq!(
            SnapshotSizing::default().bound(Some(MIB), u32::MAX),
            MAX_SNAPSHOT_BOUND
        );
        // Ordered as documented.
        const {
            assert!(MIN_SNAPSHOT_BOUND <= FIRST_SNAPSHOT_BOUND);
            assert!(FIRST_SNAPSHOT_BOUND <= MAX_SNAPSHOT_BOUND);
        }
    }

    #[test]
    fn a_large_node_snapshot_fits_under_the_ceiling() {
        use felix_proto::to_dataplane::Payload;
        use felix_proto::{
            ActivePolicyUpdate, ActiveProfileUpdate, IpSetUpdate, Policy, PolicyId, PortRange,
            Profile, ProfileId, Rule, TierInfo, WorkloadEndpoint, WorkloadEndpointId,
            WorkloadEndpointUpdate,
        };
        let len = |p: Payload| {
            encoded_len(&ToDataplane {
                sequence_number: 1_000_000,
                payload: Some(p),
            })
        };
        let pid = |i: usize| PolicyId {
            kind: "NetworkPolicy".into(),
            namespace: format!("namespace-{:04}", i % 1000),
            name: format!("allow-frontend-to-backend-{i:05}"),
        };
        // A generous node: 100k dual-stack endpoints in two tiers of five policies each way,
        // 5,000 policies of ten rules, 2,000 profiles, and 4 million IP set members (each
        // endpoint address in 20 sets) in sets of 400.
        let endpoint = len(Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
            id: Some(WorkloadEndpointId {
                orchestrator_id: "k8s".into(),
                workload_id: "namespace-0123/frontend-7d9f8b6c5-x2x4z".into(),
                endpoint_id: "eth0".into(),
            }),
            endpoint: Some(WorkloadEndpoint {
                state: "active".into(),
                name: "cali1a2b3c4d5e6".into(),
                mac: "ee:ee:ee:ee:ee:ee".into(),
                profile_ids: vec![
                    "kns.namespace-0123".into(),
                    "ksa.namespace-0123.frontend-service-account".into(),
                ],
                ipv4_nets: vec!["10.244.123.45/32".into()],
                ipv6_nets: vec!["fd00:10:244:7b::2d/128".into()],
                tiers: (0..2)
                    .map(|t| TierInfo {
                        name: format!("tier-{t}"),
                        ingress_policies: (0..5).map(pid).collect(),
                        egress_policies: (5..10).map(pid).collect(),
                        default_action: "Deny".into(),
                    })
                    .collect(),
                annotations: [("kubernetes.io/psp".to_owned(), "restricted".to_owned())].into(),
                ..Default::default()
            }),
        }));
        let rule = Rule {
            action: "allow".into(),
            dst_ports: vec![PortRange {
                first: 8080,
                last: 8080,
            }],
            src_ip_set_ids: vec!["s:Vb7nDTxVQ2NhmpNAL4ICJm9pW1BQpW5tFYx7cQ".into()],
            dst_ip_set_ids: vec!["s:Xc8oEUyWR3OinqOBM5JDKn0qX2CRqX6uGZy8dR".into()],
            original_src_selector: "app == 'frontend' && tier in {'web', 'edge'}".into(),
            original_dst_selector: "app == 'backend' && has(team)".into(),
            rule_id: "Zm9vYmFyYmF6cXV4cXV1eA".into(),
            ..Default::default()
        };
        let policy = len(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pid(1)),
            policy: Some(Policy {
                tier: "tier-0".into(),
                inbound_rules: vec![rule.clone(); 5],
                outbound_rules: vec![rule.clone(); 5],
                ..Default::default()
            }),
        }));
        let profile = len(Payload::ActiveProfileUpdate(ActiveProfileUpdate {
            id: Some(ProfileId {
                name: "kns.namespace-0123".into(),
            }),
            profile: Some(Profile {
                inbound_rules: vec![rule.clone()],
                outbound_rules: vec![rule],
            }),
        }));
        let set = |v6: bool| {
            len(Payload::IpsetUpdate(IpSetUpdate {
                id: "s:Vb7nDTxVQ2NhmpNAL4ICJm9pW1BQpW5tFYx7cQ".into(),
                members: (0..400u32)
                    .map(|i| {
                        if v6 {
                            format!("fd00:10:244:{:x}::{:x}", i / 200, i % 200)
                        } else {
                            format!("10.244.{}.{}", i / 200, i % 200)
                        }
                    })
                    .collect(),
                r#type: 0,
            }))
        };
        let total = 100_000 * endpoint
            + 5_000 * policy
            + 2_000 * profile
            + 5_000 * set(false)
            + 5_000 * set(true);
        let mib = total / (1024 * 1024);
        assert!(
            (100..700).contains(&mib),
            "the estimate is {mib} MiB: revisit the default bound"
        );
        assert!(
            2 * total < MAX_SNAPSHOT_BOUND,
            "{mib} MiB leaves less than 2x headroom under the sized bound's ceiling"
        );
        // Its first snapshot fits the first bound, or the doubled one after one cut.
        assert!(total < 2 * FIRST_SNAPSHOT_BOUND, "{mib} MiB");
    }

    #[test]
    fn status_reasons_name_the_cause_on_one_line() {
        #[derive(Debug)]
        struct Alert;
        impl std::fmt::Display for Alert {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("received fatal alert: UnknownCA")
            }
        }
        impl std::error::Error for Alert {}
        #[derive(Debug)]
        struct Transport(Alert);
        impl std::fmt::Display for Transport {
            // As hyper does: the wrapper repeats its cause.
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "connection error:\n {}", self.0)
            }
        }
        impl std::error::Error for Transport {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let status = tonic::Status::from_error(Box::new(Transport(Alert)));
        let reason = status_reason(&status);
        assert_eq!(reason, "connection error: received fatal alert: UnknownCA");
        let bare = tonic::Status::cancelled("operation was canceled");
        assert_eq!(status_reason(&bare), "operation was canceled");
        assert_eq!(
            with_connection_error(status_reason(&bare), Some("Broken pipe (os error 32)")),
            "operation was canceled; connection: Broken pipe (os error 32)"
        );
        assert_eq!(
            with_connection_error(reason.clone(), Some("received fatal alert: UnknownCA")),
            reason,
            "said once"
        );
        assert_eq!(status_reason(&tonic::Status::unknown("")), "Unknown");
    }

    #[test]
    fn apply_errors_are_cut_to_the_protocol_limit_on_a_char_boundary() {
        let short = DriverError::Other("xtables lock\n held".into());
        assert_eq!(short_error(&short), "xtables lock held", "one line");
        // 'é' is two bytes: a cut at 253 bytes would split one.
        let long = DriverError::Other("é".repeat(300));
        let text = short_error(&long);
        assert_eq!(text.len(), 252 + '…'.len_utf8(), "{text}");
        assert!(text.starts_with("éé") && text.ends_with('…'), "{text}");
        let exact = DriverError::Other("a".repeat(MAX_APPLIED_ERROR_BYTES));
        assert_eq!(
            short_error(&exact).len(),
            MAX_APPLIED_ERROR_BYTES,
            "at the limit: not cut"
        );
        assert!(!short_error(&DriverError::Other(String::new())).is_empty());
    }

    #[test]
    fn the_agent_always_offers_applied() {
        assert_eq!(offered_capabilities(&[], false, false), ["applied"]);
        assert_eq!(
            offered_capabilities(&["x-test".to_owned(), "applied".to_owned()], false, false),
            ["applied", "x-test"],
            "configured ones kept, each once"
        );
        assert_eq!(
            offered_capabilities(&["stats".to_owned()], true, false),
            ["applied", "stats"],
            "stats when the driver counts, once"
        );
        assert_eq!(
            offered_capabilities(&["flows".to_owned()], true, true),
            ["applied", "stats", "flows"],
            "flows when the driver collects them, once"
        );
    }

    #[test]
    fn the_watchdog_ticks_several_times_per_timeout() {
        assert_eq!(
            watchdog_tick(Duration::from_secs(90)),
            Duration::from_secs(5)
        );
        assert_eq!(
            watchdog_tick(Duration::from_secs(1)),
            Duration::from_millis(250)
        );
        assert_eq!(
            watchdog_tick(Duration::from_millis(1)),
            Duration::from_millis(10)
        );
    }
}
