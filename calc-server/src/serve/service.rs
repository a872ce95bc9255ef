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

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::Duration;

use felix_proto as pb;
use pb::framed::{Encoded, Frame};
use pb::from_dataplane::Payload as FromPayload;
use pb::to_dataplane::Payload as ToPayload;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::engine::{CloseReason, Conn, Input, Out, Refusal};
use super::listener::PeerInfo;
use super::metrics::Metrics;
use super::status::Board;
use calc_graph::untrusted::Untrusted;

/// The capability token for `DataplaneApplied` reports (docs/proto.md, "Capabilities").
pub(super) const APPLIED: &str = "applied";

pub(super) struct SyncService {
    pub engine: mpsc::Sender<Input>,
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

type OutStream = Pin<Box<dyn Stream<Item = Result<Frame, Status>> + Send>>;

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
/// or when the engine drops the queue. Polled directly by the transport, so a message costs no
/// extra task hop. Messages are sent as [`Frame`]s: the shared encoding plus this stream's
/// sequence number.
struct Outgoing {
    hello: Option<pb::ToDataplane>,
    rx: mpsc::UnboundedReceiver<Out>,
    fault: Option<oneshot::Receiver<Status>>,
    taken: Arc<AtomicU64>,
    taken_bytes: Arc<AtomicU64>,
    seq: u64,
    done: bool,
    sent_endpoints: SentEndpoints,
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
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Out::Close(reason))) => {
                self.done = true;
                Poll::Ready(Some(Err(close_status(reason))))
            }
            Poll::Ready(Some(out)) => {
                self.taken.fetch_add(1, Ordering::Relaxed);
                self.taken_bytes.fetch_add(out.len(), Ordering::Relaxed);
                match out.message().and_then(|m| m.payload.as_ref()) {
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
                Poll::Ready(Some(Ok(Frame {
                    sequence_number: self.seq,
                    body: out.encoded().unwrap_or_default(),
                })))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

fn outgoing(
    hello: pb::ToDataplane,
    rx: mpsc::UnboundedReceiver<Out>,
    fault: oneshot::Receiver<Status>,
    taken: Arc<AtomicU64>,
    taken_bytes: Arc<AtomicU64>,
    sent_endpoints: SentEndpoints,
) -> OutStream {
    Box::pin(Outgoing {
        hello: Some(hello),
        rx,
        fault: Some(fault),
        taken,
        taken_bytes,
        seq: 0,
        done: false,
        sent_endpoints,
    })
}

#[tonic::async_trait]
impl pb::framed::server::calc_server_server::CalcServer for SyncService {
    type SyncStream = OutStream;

    async fn sync(
        &self,
        request: Request<Streaming<pb::FromDataplane>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
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
        let reports_applied = hello.capabilities.iter().any(|c| c == APPLIED);
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
                    .reporting_applied(reports_applied),
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
                capabilities: if reports_applied {
                    vec![APPLIED.to_string()]
                } else {
                    Vec::new()
                },
                node_name: node,
            })),
        };
        Ok(Response::new(outgoing(
            server_hello,
            rx,
            fault_rx,
            taken,
            taken_bytes,
            sent_endpoints,
        )))
    }
}
