//! The gRPC `CalcServer.Sync` service: one bidirectional stream per agent.
//!
//! The agent's first message must be an AgentHello (within the hello timeout) naming its node;
//! the server answers with a ServerHello, then whatever the engine sends for that node (its
//! snapshot, InSync, deltas), numbering every message from 1. Reports coming back go to the
//! status board. Protocol errors end the stream with a status that says what was wrong.
//!
//! Node identity: over mutual TLS the node is the one the client certificate names (see
//! `listener`); an AgentHello naming another node is refused with PERMISSION_DENIED (an empty
//! hello node name takes the certificate's). Whatever the transport, an agent may report status
//! only for endpoints this stream has sent it (its own node's); a status update for any other
//! endpoint ends the stream with PERMISSION_DENIED.
//!
//! Rule hit counts (`RuleStats`, capability [`STATS`]) are untrusted: a report with more hits
//! than a report may carry, a reference without the id its kind needs or with an invalid id,
//! or any report on a stream that did not negotiate the capability ends the stream with
//! INVALID_ARGUMENT (counted in `calc_server_rule_stats_refused_total`). A valid one goes to
//! the engine with its receive time, which adds only what this node's stream was sent.
//!
//! Flow records (`FlowReport`, capability [`FLOWS`], offered only with `--flow-logs`) are
//! untrusted too: a report on a stream that did not negotiate the capability, with more
//! records than a report may carry, or with a record that does not parse (an address that is
//! not an IP, an interval not a multiple of 15 s, a port or protocol out of range, a trace too
//! long or with an invalid reference or action) ends the stream with INVALID_ARGUMENT (counted
//! in `calc_server_flow_reports_refused_total`). A valid one goes to the engine, which keeps
//! only records whose reporting side is one of the node's own endpoints.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::{Duration, SystemTime};

use felix_proto as pb;
use pb::framed::{Encoded, Frame};
use pb::from_dataplane::Payload as FromPayload;
use pb::to_dataplane::Payload as ToPayload;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Status, Streaming};

use super::engine::{
    Block, CloseReason, Conn, FlowBatch, Hit, Input, Out, Refusal, parse_flow_report,
    parse_rule_stats,
};
use super::listener::PeerInfo;
use super::metrics::Metrics;
use super::status::Board;
use calc_graph::untrusted::Untrusted;

/// The capability token for `DataplaneApplied` reports (docs/proto.md, "Capabilities").
pub(super) const APPLIED: &str = "applied";

/// The capability token for `RuleStats` reports (docs/proto.md, "Capabilities").
pub(super) const STATS: &str = "stats";

/// The capability token for `FlowReport`s (docs/proto.md, "Capabilities").
pub(super) const FLOWS: &str = "flows";

/// The capabilities the server lists in its hello: those of its own (`flows` only with flow
/// logs on) the agent offered.
fn agreed_capabilities(offered: &[String], flow_logs: bool) -> Vec<String> {
    [APPLIED, STATS]
        .into_iter()
        .chain(flow_logs.then_some(FLOWS))
        .filter(|c| offered.iter().any(|o| o == c))
        .map(str::to_string)
        .collect()
}

/// A `RuleStats` report the stream must refuse: (the metric's reason, why).
#[derive(Debug, PartialEq, Eq)]
struct RefusedStats {
    reason: &'static str,
    why: String,
}

/// The hits of a `RuleStats` report on a stream that negotiated `stats` (or not), or why the
/// report ends the stream.
fn rule_stats(stats: &pb::RuleStats, negotiated: bool) -> Result<Vec<Hit>, RefusedStats> {
    if !negotiated {
        return Err(RefusedStats {
            reason: "not_negotiated",
            why: format!(
                "RuleStats on a stream without the {STATS:?} capability (the AgentHello did not offer it)"
            ),
        });
    }
    parse_rule_stats(stats).map_err(|e| RefusedStats {
        reason: e.reason(),
        why: e.to_string(),
    })
}

/// The records of a `FlowReport` on a stream that negotiated `flows` (or not), or why the
/// report ends the stream: (the metric's reason, why).
fn flow_report(report: &pb::FlowReport, negotiated: bool) -> Result<FlowBatch, RefusedStats> {
    if !negotiated {
        return Err(RefusedStats {
            reason: "not_negotiated",
            why: format!(
                "FlowReport on a stream without the {FLOWS:?} capability (the server runs without --flow-logs, or the AgentHello did not offer it)"
            ),
        });
    }
    parse_flow_report(report).map_err(|e| RefusedStats {
        reason: e.reason(),
        why: e.to_string(),
    })
}

/// A per-stream bound on flow records: a token bucket refilled at `rate` records a second,
/// holding at most 15 seconds' worth (agents send an interval's records at once).
#[derive(Debug)]
struct FlowRate {
    rate: f64,
    tokens: f64,
    last: std::time::Instant,
}

impl FlowRate {
    fn new(rate: u32, now: std::time::Instant) -> FlowRate {
        let rate = f64::from(rate);
        FlowRate {
            rate,
            tokens: rate * 15.0,
            last: now,
        }
    }

    /// How many of `n` records may pass at `now` (the rest are dropped).
    fn take(&mut self, n: usize, now: std::time::Instant) -> usize {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.rate * 15.0);
        let allowed = (self.tokens.floor() as usize).min(n);
        self.tokens -= allowed as f64;
        allowed
    }
}

pub(super) struct SyncService {
    pub engine: mpsc::Sender<Input>,
    /// Offer the `flows` capability (`--flow-logs`).
    pub flow_logs: bool,
    /// Flow records one stream may send per second (`--flow-max-records-per-second`).
    pub flow_rate: u32,
    pub board: Arc<Board>,
    pub hello_timeout: Duration,
    pub next_id: AtomicU64,
    pub metrics: Arc<Metrics>,
    /// Per-agent tasks run in the agent's span and stop with the rest.
    pub tasks: common::Tasks,
}

/// Endpoints a stream has sent its agent (`w:<orch>/<workload>/<endpoint>`, `h:<id>`): the
/// ones it may report status for.
type SentEndpoints = Arc<Mutex<HashSet<String>>>;

fn workload_key(id: Option<&pb::WorkloadEndpointId>) -> String {
    let id = id.cloned().unwrap_or_default();
    format!(
        "w:{}/{}/{}",
        id.orchestrator_id, id.workload_id, id.endpoint_id
    )
}

fn host_key(id: Option<&pb::HostEndpointId>) -> String {
    format!(
        "h:{}",
        id.map(|i| i.endpoint_id.as_str()).unwrap_or_default()
    )
}

/// A status update for an endpoint this stream never sent: which one.
fn foreign_report(m: &pb::FromDataplane, sent: &SentEndpoints) -> Option<String> {
    let key = match &m.payload {
        Some(FromPayload::WorkloadEndpointStatusUpdate(u)) => workload_key(u.id.as_ref()),
        Some(FromPayload::HostEndpointStatusUpdate(u)) => host_key(u.id.as_ref()),
        _ => return None,
    };
    let known = sent.lock().contains(&key);
    (!known).then(|| key[2..].to_string())
}

/// Longest `DataplaneApplied.error` accepted (the agent cuts its error to this).
const MAX_APPLY_ERROR: usize = 256;

/// A `DataplaneApplied` that cannot be true of this stream: why. `last_sent` is the highest
/// sequence number the stream has sent.
fn impossible_applied(a: &pb::DataplaneApplied, last_sent: u64) -> Option<String> {
    if a.error.len() > MAX_APPLY_ERROR {
        Some(format!(
            "DataplaneApplied.error is longer than {MAX_APPLY_ERROR} bytes"
        ))
    } else if a.applied_sequence_number > a.received_sequence_number {
        Some(format!(
            "DataplaneApplied: applied {} is beyond received {}",
            a.applied_sequence_number, a.received_sequence_number
        ))
    } else if a.received_sequence_number > last_sent {
        Some(format!(
            "DataplaneApplied: received {} is beyond the {last_sent} messages sent",
            a.received_sequence_number
        ))
    } else {
        None
    }
}

/// Longest text field accepted in a report (a status is `up`/`down`/`error`, a timestamp is
/// RFC 3339): anything longer is refused, not stored and served back from `/status`.
const MAX_REPORT_TEXT: usize = 64;

/// A report field longer than [`MAX_REPORT_TEXT`]: which one.
fn oversized_report(m: &pb::FromDataplane) -> Option<&'static str> {
    let too_long = |s: &str| s.len() > MAX_REPORT_TEXT;
    let status = |s: &Option<pb::EndpointStatus>| s.as_ref().is_some_and(|s| too_long(&s.status));
    match &m.payload {
        Some(FromPayload::ProcessStatusUpdate(p)) if too_long(&p.iso_timestamp) => {
            Some("ProcessStatusUpdate.iso_timestamp")
        }
        Some(FromPayload::WorkloadEndpointStatusUpdate(u)) if status(&u.status) => {
            Some("WorkloadEndpointStatusUpdate.status")
        }
        Some(FromPayload::HostEndpointStatusUpdate(u)) if status(&u.status) => {
            Some("HostEndpointStatusUpdate.status")
        }
        _ => None,
    }
}

/// The gRPC status an agent is told when the engine ends its stream.
fn close_status(reason: CloseReason) -> Status {
    match reason {
        CloseReason::ShuttingDown => Status::unavailable("calc-server is shutting down"),
        CloseReason::Replaced { node } => {
            Status::aborted(format!("replaced by a newer connection for node {node}"))
        }
        CloseReason::TooFarBehind {
            node,
            limit,
            bytes_limit,
        } => Status::resource_exhausted(format!(
            "node {node} fell more than {limit} messages or {bytes_limit} bytes behind; reconnect for a fresh snapshot"
        )),
    }
}

/// The gRPC status a refused agent is told.
fn refusal_status(refusal: Refusal) -> Status {
    match refusal {
        // The agent's operator reads this, not the server's log: say what to do.
        Refusal::UnknownNode { node } => Status::not_found(format!(
            "node {node:?} is not in the datastore (no Node resource and no endpoints): check \
             the agent's --node against the cluster's Node names, or run calc-server serve \
             with --allow-unknown-nodes"
        )),
    }
}

/// The outgoing stream: the ServerHello, then the node's queue, numbering every message;
/// it ends at a Close (with that status), at a protocol error the report reader found (`fault`)
/// or when the engine drops the queue. Polled by the response body (`sync_route::SyncBody`) in
/// the connection's task, so a message costs no extra task hop. Messages are sent as
/// [`Frame`]s: the shared encoding plus this stream's sequence number; a [`Block`] one message
/// at a time.
pub(super) struct Outgoing {
    hello: Option<pb::ToDataplane>,
    rx: mpsc::UnboundedReceiver<Out>,
    fault: Option<oneshot::Receiver<Status>>,
    taken: Arc<AtomicU64>,
    taken_bytes: Arc<AtomicU64>,
    seq: u64,
    done: bool,
    sent_endpoints: SentEndpoints,
    /// A block being sent, and the index of its next message.
    block: Option<(Arc<Block>, usize)>,
}

impl Outgoing {
    /// The frame of the next message taken from the queue (`held`: the message, when it is
    /// held as one), counted as taken and numbered.
    fn frame(&mut self, held: Option<&pb::ToDataplane>, body: Encoded) -> Frame {
        self.taken.fetch_add(1, Ordering::Relaxed);
        self.taken_bytes
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        match held.and_then(|m| m.payload.as_ref()) {
            Some(ToPayload::WorkloadEndpointUpdate(u)) => {
                let key = workload_key(u.id.as_ref());
                self.sent_endpoints.lock().insert(key);
            }
            Some(ToPayload::HostEndpointUpdate(u)) => {
                let key = host_key(u.id.as_ref());
                self.sent_endpoints.lock().insert(key);
            }
            _ => {}
        }
        self.seq += 1;
        Frame {
            sequence_number: self.seq,
            body,
        }
    }

    /// The next message of the block under way, if any.
    fn next_of_block(&mut self) -> Option<Frame> {
        let (block, i) = self.block.take()?;
        let body = block.encoded().get(i)?.clone();
        let frame = self.frame(block.messages()[i].held_message(), body);
        if i + 1 < block.messages().len() {
            self.block = Some((block, i + 1));
        }
        Some(frame)
    }
}

impl Stream for Outgoing {
    type Item = Result<Frame, Status>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if self.done {
            return Poll::Ready(None);
        }
        if let Some(hello) = self.hello.take() {
            self.seq = 1;
            return Poll::Ready(Some(Ok(Frame {
                sequence_number: 1,
                body: Encoded::new(&hello),
            })));
        }
        // A protocol error in the agent's reports ends the stream before anything else queued.
        if let Some(fault) = self.fault.as_mut()
            && let Poll::Ready(fault) = Pin::new(fault).poll(cx)
        {
            // Without a fault the reader just finished: only the queue matters from now on.
            self.fault = None;
            if let Ok(status) = fault {
                self.done = true;
                return Poll::Ready(Some(Err(status)));
            }
        }
        loop {
            if let Some(frame) = self.next_of_block() {
                return Poll::Ready(Some(Ok(frame)));
            }
            return match self.rx.poll_recv(cx) {
                Poll::Ready(Some(Out::Close(reason))) => {
                    self.done = true;
                    Poll::Ready(Some(Err(close_status(reason))))
                }
                Poll::Ready(Some(Out::Block(block))) => {
                    self.block = Some((block, 0));
                    continue;
                }
                Poll::Ready(Some(out)) => {
                    let body = out.encoded().unwrap_or_default();
                    let frame = self.frame(out.held_message(), body);
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(None) => {
                    self.done = true;
                    Poll::Ready(None)
                }
                Poll::Pending => Poll::Pending,
            };
        }
    }
}

pub(super) fn outgoing(
    hello: pb::ToDataplane,
    rx: mpsc::UnboundedReceiver<Out>,
    fault: oneshot::Receiver<Status>,
    taken: Arc<AtomicU64>,
    taken_bytes: Arc<AtomicU64>,
    sent_endpoints: SentEndpoints,
) -> Outgoing {
    Outgoing {
        hello: Some(hello),
        rx,
        fault: Some(fault),
        taken,
        taken_bytes,
        seq: 0,
        done: false,
        sent_endpoints,
        block: None,
    }
}

impl SyncService {
    /// Opens one agent's stream (see the module documentation): the messages to send, or the
    /// status that refuses the stream.
    pub(super) async fn open(
        &self,
        request: Request<Streaming<pb::FromDataplane>>,
    ) -> Result<Outgoing, Status> {
        let peer_info = request.extensions().get::<PeerInfo>().cloned();
        let peer = peer_info.as_ref().and_then(|p| p.remote);
        let admission = peer_info.as_ref().and_then(|p| p.admission.clone());
        let cert_node = peer_info.and_then(|p| p.identity);
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(self.hello_timeout, inbound.next())
            .await
            .map_err(|_| Status::deadline_exceeded("no AgentHello within the hello timeout"))?
            .ok_or_else(|| Status::invalid_argument("stream ended before the AgentHello"))?
            .map_err(|e| {
                Status::invalid_argument(format!(
                    "could not read the first message: {}",
                    e.message()
                ))
            })?;
        let mut hello = match first.payload {
            Some(FromPayload::AgentHello(h)) => h,
            other => {
                let what = other.map_or("an empty message".to_string(), |p| {
                    format!("{p:?}")
                        .split('(')
                        .next()
                        .unwrap_or("?")
                        .to_string()
                });
                tracing::warn!(?peer, got = %what, "refused a stream that did not start with AgentHello");
                return Err(Status::invalid_argument(format!(
                    "the first message must be an AgentHello, got {what}"
                )));
            }
        };
        match &cert_node {
            None => {}
            Some(Err(why)) => {
                self.metrics.permission_denied.inc();
                tracing::warn!(?peer, hello_node = %Untrusted(&hello.node_name), reason = %Untrusted(&why.to_string()), "refused: the client certificate names no node");
                return Err(Status::permission_denied(format!(
                    "the client certificate names no node: {why}"
                )));
            }
            Some(Ok(node)) if hello.node_name.is_empty() => hello.node_name = node.clone(),
            Some(Ok(node)) if *node != hello.node_name => {
                self.metrics.permission_denied.inc();
                tracing::warn!(?peer, certificate_node = %Untrusted(node), hello_node = %Untrusted(&hello.node_name), "refused: AgentHello names another node than the client certificate");
                return Err(Status::permission_denied(format!(
                    "the client certificate is for node {node:?}; it may not sync node {:?}",
                    hello.node_name
                )));
            }
            Some(Ok(_)) => {}
        }
        if !calc_graph::model::validate::is_subdomain(&hello.node_name) {
            return Err(Status::invalid_argument(format!(
                "AgentHello.node_name {:?} is not a valid node name (a DNS subdomain)",
                Untrusted(&hello.node_name)
            )));
        }
        // A valid hello moves the connection from the pending pool to an agent slot.
        if let Some(admission) = &admission
            && !admission.admit()
        {
            self.metrics.refused("limit");
            tracing::warn!(?peer, node = %Untrusted(&hello.node_name), "refused: every --max-connections agent slot is taken");
            return Err(Status::resource_exhausted(
                "calc-server has --max-connections agents connected; retry later",
            ));
        }
        let node = hello.node_name.clone();
        let capabilities = agreed_capabilities(&hello.capabilities, self.flow_logs);
        let reports_applied = capabilities.iter().any(|c| c == APPLIED);
        let reports_stats = capabilities.iter().any(|c| c == STATS);
        let reports_flows = capabilities.iter().any(|c| c == FLOWS);
        let mut flow_rate = FlowRate::new(self.flow_rate, std::time::Instant::now());
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let span = tracing::info_span!("agent", %node, conn = id);
        let (tx, rx) = mpsc::unbounded_channel();
        let taken = Arc::new(AtomicU64::new(0));
        let taken_bytes = Arc::new(AtomicU64::new(0));
        let sent_endpoints = SentEndpoints::default();
        // When the outgoing stream goes away (the agent left, or this handshake was abandoned
        // even after the engine accepted it), the engine forgets the connection.
        {
            let watch = tx.clone();
            let engine = self.engine.clone();
            let node = node.clone();
            self.tasks.spawn(span.clone(), async move {
                watch.closed().await;
                let _ = engine.send(Input::Disconnect { node, id }).await;
            });
        }
        let (reply_tx, reply_rx) = oneshot::channel();
        self.engine
            .send(Input::Connect {
                node: node.clone(),
                agent_version: hello.agent_version.clone(),
                conn: Conn::new(id, tx, taken.clone(), taken_bytes.clone())
                    .reporting_applied(reports_applied)
                    .reporting_stats(reports_stats),
                reply: reply_tx,
            })
            .await
            .map_err(|_| Status::unavailable("calc-server is shutting down"))?;
        reply_rx
            .await
            .map_err(|_| Status::unavailable("calc-server is shutting down"))?
            .map_err(refusal_status)?;
        span.in_scope(|| {
            tracing::info!(?peer, agent_version = %Untrusted(&hello.agent_version), capabilities = ?hello.capabilities.iter().take(32).map(|c| Untrusted(c)).collect::<Vec<_>>(), tls = cert_node.is_some(), "agent connected")
        });

        // Reports back: to the board. A protocol error ends the stream with its reason; an
        // agent that only closes its sending side keeps receiving.
        let engine = self.engine.clone();
        let board = self.board.clone();
        let reader_node = node.clone();
        let sent = sent_endpoints.clone();
        let metrics = self.metrics.clone();
        let stream_taken = taken.clone();
        let (fault_tx, fault_rx) = oneshot::channel();
        self.tasks.spawn(span, async move {
            let mut last = first.sequence_number;
            let failure = loop {
                match inbound.next().await {
                    Some(Ok(m)) => {
                        if m.sequence_number != last + 1 {
                            let why = format!(
                                "sequence number {} after {last}: reports must be numbered one by one",
                                m.sequence_number
                            );
                            break Some((why.clone(), Status::invalid_argument(why)));
                        }
                        last = m.sequence_number;
                        if let Some(field) = oversized_report(&m) {
                            let why = format!("{field} is longer than {MAX_REPORT_TEXT} bytes");
                            tracing::warn!(reason = %why, "refused a report");
                            break Some((why.clone(), Status::invalid_argument(why)));
                        }
                        let mut m = m;
                        if let Some(FromPayload::DataplaneApplied(a)) = &mut m.payload {
                            // The ServerHello is 1; the stream has taken `taken` more.
                            let last_sent = stream_taken.load(Ordering::Relaxed) + 1;
                            if let Some(why) = impossible_applied(a, last_sent) {
                                tracing::warn!(reason = %why, "refused a report");
                                break Some((why.clone(), Status::invalid_argument(why)));
                            }
                            // The agent's text is shown in tables and logs: escaped once, here.
                            a.error = Untrusted(&a.error).to_string();
                            let _ = engine
                                .send(Input::Applied {
                                    node: reader_node.clone(),
                                    id,
                                    applied: a.applied_sequence_number,
                                    error: (!a.error.is_empty()).then(|| a.error.clone()),
                                })
                                .await;
                        }
                        if let Some(FromPayload::FlowReport(report)) = &m.payload {
                            let at = SystemTime::now();
                            match flow_report(report, reports_flows) {
                                Ok(mut batch) => {
                                    let n = batch.records.len();
                                    let kept = flow_rate.take(n, std::time::Instant::now());
                                    if kept < n {
                                        batch.records.truncate(kept);
                                        metrics.flow_reports_refused("rate", (n - kept) as u64);
                                        tracing::debug!(dropped = n - kept, "flow records beyond --flow-max-records-per-second dropped");
                                    }
                                    let _ = engine
                                        .send(Input::Flows {
                                            node: reader_node.clone(),
                                            id,
                                            batch,
                                            at,
                                        })
                                        .await;
                                }
                                Err(refused) => {
                                    metrics.flow_reports_refused(refused.reason, 1);
                                    tracing::warn!(reason = %refused.why, "refused a report");
                                    break Some((
                                        refused.why.clone(),
                                        Status::invalid_argument(refused.why),
                                    ));
                                }
                            }
                        }
                        if let Some(FromPayload::RuleStats(stats)) = &m.payload {
                            let at = SystemTime::now();
                            match rule_stats(stats, reports_stats) {
                                Ok(hits) => {
                                    metrics.rule_stats_reports.inc();
                                    let _ = engine
                                        .send(Input::Hits {
                                            node: reader_node.clone(),
                                            id,
                                            hits,
                                            at,
                                        })
                                        .await;
                                }
                                Err(refused) => {
                                    metrics.rule_stats_refused(refused.reason, 1);
                                    tracing::warn!(reason = %refused.why, "refused a report");
                                    break Some((
                                        refused.why.clone(),
                                        Status::invalid_argument(refused.why),
                                    ));
                                }
                            }
                        }
                        if let Some(endpoint) = foreign_report(&m, &sent) {
                            metrics.permission_denied.inc();
                            tracing::warn!(%endpoint, "refused: status report for an endpoint not on this node");
                            break Some((
                                format!("status for endpoint {endpoint} not on this node"),
                                Status::permission_denied(format!(
                                    "node {reader_node} may only report status for its own endpoints; {endpoint} is not one"
                                )),
                            ));
                        }
                        board.report(&reader_node, id, &m);
                    }
                    // Oversized or undecodable messages: the agent is told why.
                    Some(Err(e)) => {
                        break Some((
                            format!("receive error: {}", e.message()),
                            Status::new(e.code(), e.message().to_string()),
                        ));
                    }
                    None => break None,
                }
            };
            match failure {
                Some((reason, status)) => {
                    tracing::info!(%reason, "agent disconnected");
                    // The stream ends with the reason; then the engine forgets the node.
                    let _ = fault_tx.send(status);
                    let _ = engine
                        .send(Input::Disconnect {
                            node: reader_node,
                            id,
                        })
                        .await;
                }
                None => tracing::debug!("agent closed its sending side"),
            }
        });

        let server_hello = pb::ToDataplane {
            sequence_number: 0,
            payload: Some(ToPayload::ServerHello(pb::ServerHello {
                server_version: env!("CARGO_PKG_VERSION").to_string(),
                // Only what this stream will use: a subset of what the agent offered.
                capabilities,
                node_name: node,
            })),
        };
        Ok(outgoing(
            server_hello,
            rx,
            fault_rx,
            taken,
            taken_bytes,
            sent_endpoints,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    use pb::rule_ref::Kind as RefKind;

    use super::super::engine::{Engine, Limits, run};
    use super::super::listener;

    fn policy_hit(name: &str) -> pb::RuleHits {
        pb::RuleHits {
            rule: Some(pb::RuleRef {
                kind: RefKind::PolicyRule as i32,
                policy: Some(pb::PolicyId {
                    name: name.into(),
                    namespace: "shop".into(),
                    kind: "NetworkPolicy".into(),
                }),
                ..Default::default()
            }),
            packets: 1,
            bytes: 64,
        }
    }

    #[test]
    fn the_server_agrees_only_to_its_own_capabilities_the_agent_offered() {
        let offered = |c: &[&str]| {
            agreed_capabilities(&c.iter().map(|s| s.to_string()).collect::<Vec<_>>(), false)
        };
        assert_eq!(
            offered(&["stats", "x-future", "applied"]),
            ["applied", "stats"]
        );
        assert_eq!(offered(&["stats"]), ["stats"]);
        assert!(offered(&["statistics", "stats:v2"]).is_empty());
        assert!(offered(&[]).is_empty());
        let all = ["applied", "flows", "stats"].map(String::from);
        assert_eq!(
            agreed_capabilities(&all, true),
            ["applied", "stats", "flows"]
        );
        assert_eq!(agreed_capabilities(&all, false), ["applied", "stats"]);
    }

    fn flow_record(src: &str, dst: &str) -> pb::FlowRecord {
        pb::FlowRecord {
            interval_start: 1_800_000_000,
            source_ip: src.into(),
            dest_ip: dst.into(),
            source_port: 40_000,
            dest_port: 80,
            protocol: 6,
            reporter_dest: true,
            trace: vec![pb::FlowRuleHit {
                rule: policy_hit("web").rule,
                action: "allow".into(),
            }],
            allowed: true,
            packets_in: 3,
            ..Default::default()
        }
    }

    #[test]
    fn flow_reports_are_refused_unless_negotiated_and_well_formed() {
        let report = |records: Vec<pb::FlowRecord>| pb::FlowReport {
            records,
            dropped: 2,
        };
        let ok = report(vec![flow_record("10.0.0.1", "10.0.0.2")]);
        let batch = flow_report(&ok, true).unwrap();
        assert_eq!((batch.records.len(), batch.agent_dropped), (1, 2));
        assert_eq!(batch.records[0].dst_port, 80);
        let refused = flow_report(&ok, false).unwrap_err();
        assert_eq!(refused.reason, "not_negotiated");
        assert!(refused.why.contains("\"flows\" capability"), "{refused:?}");

        let too_many = report(vec![flow_record("10.0.0.1", "10.0.0.2"); 4097]);
        let refused = flow_report(&too_many, true).unwrap_err();
        assert_eq!(
            (refused.reason, refused.why.as_str()),
            (
                "too_many_records",
                "FlowReport carries 4097 records, more than 4096"
            )
        );
        let why = |f: &dyn Fn(&mut pb::FlowRecord)| {
            let mut r = flow_record("10.0.0.1", "10.0.0.2");
            f(&mut r);
            let refused = flow_report(&report(vec![flow_record("10.0.0.1", "10.0.0.2"), r]), true)
                .unwrap_err();
            assert_eq!(refused.reason, "malformed");
            refused.why
        };
        assert_eq!(
            why(&|r| r.source_ip = "10.0.0.300".into()),
            "FlowReport.records[1].source_ip: not an IP address"
        );
        assert_eq!(
            why(&|r| r.dest_ip = "x".repeat(65)),
            "FlowReport.records[1].dest_ip: longer than 64 bytes"
        );
        assert_eq!(
            why(&|r| r.dest_ip = "fd00::1".into()),
            "FlowReport.records[1].dest_ip: not of the source's IP version"
        );
        assert_eq!(
            why(&|r| r.interval_start += 1),
            "FlowReport.records[1].interval_start: not a non-negative multiple of 15 seconds"
        );
        assert_eq!(
            why(&|r| r.dest_port = 65_536),
            "FlowReport.records[1].dest_port: above 65535"
        );
        assert_eq!(
            why(&|r| r.protocol = 256),
            "FlowReport.records[1].protocol: above 255"
        );
        assert_eq!(
            why(&|r| r.trace = vec![r.trace[0].clone(); 65]),
            "FlowReport.records[1].trace: 65 hits, more than 64"
        );
        assert_eq!(
            why(&|r| r.trace[0].action = "drop".into()),
            "FlowReport.records[1].trace: hits[0].action is not allow, deny or pass"
        );
        assert_eq!(
            why(&|r| r.trace[0].rule = policy_hit("").rule),
            "FlowReport.records[1].trace: hits[0] is a POLICY_RULE without its policy"
        );
    }

    #[test]
    fn flow_records_are_bounded_per_second_with_fifteen_seconds_of_burst() {
        let t0 = std::time::Instant::now();
        let mut rate = FlowRate::new(10, t0);
        assert_eq!(rate.take(100, t0), 100);
        assert_eq!(rate.take(100, t0), 50, "150 records of burst");
        assert_eq!(rate.take(10, t0), 0);
        assert_eq!(rate.take(100, t0 + Duration::from_secs(2)), 20);
        // Refilled to the burst at most.
        assert_eq!(rate.take(1000, t0 + Duration::from_secs(600)), 150);
    }

    #[test]
    fn rule_stats_are_refused_with_a_reason_for_the_metric() {
        let ok = pb::RuleStats {
            hits: vec![policy_hit("web")],
        };
        assert_eq!(rule_stats(&ok, true).map(|h| h.len()), Ok(1));
        let refused = rule_stats(&ok, false).unwrap_err();
        assert_eq!(refused.reason, "not_negotiated");
        let too_many = pb::RuleStats {
            hits: vec![policy_hit("web"); 4097],
        };
        let refused = rule_stats(&too_many, true).unwrap_err();
        assert_eq!(refused.reason, "too_many_hits");
        assert_eq!(refused.why, "RuleStats carries 4097 hits, more than 4096");
        let no_policy = pb::RuleStats {
            hits: vec![policy_hit(""), policy_hit("web")],
        };
        let refused = rule_stats(&no_policy, true).unwrap_err();
        assert_eq!(
            (refused.reason, refused.why.as_str()),
            (
                "malformed",
                "RuleStats.hits[0] is a POLICY_RULE without its policy"
            )
        );
    }

    /// A Sync service on a loopback port, with its engine (no datastore; any node may
    /// connect): its gRPC URL and metrics.
    async fn start() -> (String, Arc<Metrics>, common::Tasks) {
        let metrics = Arc::new(Metrics::default());
        let board = Arc::new(Board::default());
        let tasks = common::Tasks::new();
        let (engine_tx, engine_rx) = mpsc::channel(64);
        let (datastore_tx, datastore_rx) = mpsc::channel(1);
        let engine = Engine::new(
            Limits {
                backlog: 1000,
                backlog_bytes: None,
                concurrent_snapshots: 4,
                allow_unknown_nodes: true,
            },
            board.clone(),
            Arc::new(AtomicBool::new(false)),
            metrics.clone(),
        );
        tasks.spawn(tracing::info_span!("engine"), async move {
            // The datastore channel stays open as long as the engine runs.
            let _datastore = datastore_tx;
            run(engine, engine_rx, datastore_rx).await
        });
        let service = SyncService {
            engine: engine_tx,
            flow_logs: false,
            flow_rate: 1000,
            board,
            hello_timeout: Duration::from_secs(5),
            next_id: AtomicU64::new(1),
            metrics: metrics.clone(),
            tasks: tasks.clone(),
        };
        let socket = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", socket.local_addr().unwrap());
        let incoming = listener::incoming(
            socket,
            None,
            listener::Limits::new(8, 8, 8, metrics.clone()),
            listener::Deadlines {
                handshake: Duration::from_secs(5),
                hello: Duration::from_secs(5),
            },
            metrics.clone(),
            &tasks,
        );
        let route = super::super::sync_route::SyncRoute::new(service, 4 * 1024 * 1024);
        let settings = super::super::sync_server::Settings {
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            max_concurrent_streams: 8,
        };
        tasks.spawn(tracing::info_span!("grpc"), async move {
            super::super::sync_server::serve(incoming, route, settings, std::future::pending())
                .await;
        });
        (url, metrics, tasks)
    }

    /// Says hello for `node` offering `capabilities`, then sends `reports` (numbered from 2)
    /// and keeps its sending side open; returns what the server listed and how the stream
    /// ended.
    async fn sync(
        url: &str,
        capabilities: &[&str],
        reports: Vec<FromPayload>,
    ) -> (Vec<String>, Status) {
        let mut client = pb::calc_server_client::CalcServerClient::connect(url.to_string())
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(8);
        tx.send(pb::FromDataplane {
            sequence_number: 1,
            payload: Some(FromPayload::AgentHello(pb::AgentHello {
                node_name: "node-a".into(),
                agent_version: "test".into(),
                capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
            })),
        })
        .await
        .unwrap();
        let mut inbound = client
            .sync(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("accepted")
            .into_inner();
        let hello = match inbound.next().await {
            Some(Ok(pb::ToDataplane {
                payload: Some(ToPayload::ServerHello(h)),
                ..
            })) => h,
            other => panic!("expected a ServerHello, got {other:?}"),
        };
        for (seq, payload) in (2..).zip(reports) {
            tx.send(pb::FromDataplane {
                sequence_number: seq,
                payload: Some(payload),
            })
            .await
            .unwrap();
        }
        let end = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match inbound.next().await {
                    Some(Ok(_)) => continue,
                    Some(Err(status)) => return status,
                    None => return Status::ok("stream ended"),
                }
            }
        })
        .await
        .expect("the stream ends");
        drop(tx);
        (hello.capabilities, end)
    }

    fn refused(metrics: &Metrics, reason: &str) -> String {
        let text = metrics.render(true);
        let series = format!("calc_server_rule_stats_refused_total{{reason=\"{reason}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .unwrap_or_default()
            .to_string()
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn malformed_or_unnegotiated_rule_stats_end_the_stream() {
        let (url, metrics, tasks) = start().await;

        // Offered and listed; a report past the bound ends the stream.
        let (listed, end) = sync(
            &url,
            &["applied", "stats"],
            vec![FromPayload::RuleStats(pb::RuleStats {
                hits: vec![policy_hit("web"); 4097],
            })],
        )
        .await;
        assert_eq!(listed, ["applied", "stats"]);
        assert_eq!(end.code(), tonic::Code::InvalidArgument, "{end:?}");
        assert!(end.message().contains("more than 4096"), "{end:?}");
        assert_eq!(refused(&metrics, "too_many_hits"), "1");

        // A policy rule without its policy.
        let (_, end) = sync(
            &url,
            &["stats"],
            vec![FromPayload::RuleStats(pb::RuleStats {
                hits: vec![policy_hit("")],
            })],
        )
        .await;
        assert_eq!(end.code(), tonic::Code::InvalidArgument, "{end:?}");
        assert!(end.message().contains("without its policy"), "{end:?}");
        assert_eq!(refused(&metrics, "malformed"), "1");

        // Not offered: not listed, and a report is refused.
        let (listed, end) = sync(
            &url,
            &["applied"],
            vec![FromPayload::RuleStats(pb::RuleStats {
                hits: vec![policy_hit("web")],
            })],
        )
        .await;
        assert_eq!(listed, ["applied"]);
        assert_eq!(end.code(), tonic::Code::InvalidArgument, "{end:?}");
        assert!(end.message().contains("\"stats\" capability"), "{end:?}");
        assert_eq!(refused(&metrics, "not_negotiated"), "1");

        // A well-formed report for a policy this node was never sent: accepted as a report,
        // its hit dropped in the engine, and the stream carries on (a heartbeat after it is
        // taken, then the test's own deadline ends the wait).
        let (_, end) = tokio::time::timeout(
            Duration::from_secs(2),
            sync(
                &url,
                &["stats"],
                vec![FromPayload::RuleStats(pb::RuleStats {
                    hits: vec![policy_hit("web")],
                })],
            ),
        )
        .await
        .map_or((Vec::new(), Status::ok("still open")), |r| r);
        assert_eq!(end.code(), tonic::Code::Ok, "{end:?}");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while refused(&metrics, "not_sent") != "1" {
            assert!(
                std::time::Instant::now() < deadline,
                "{}",
                metrics.render(true)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            metrics
                .render(true)
                .contains("calc_server_rule_stats_reports_total 1\n")
        );
        assert!(
            metrics
                .render(true)
                .contains("calc_server_rule_stats_entries 0\n")
        );
        tasks.shutdown(Duration::from_secs(2)).await;
    }
}
