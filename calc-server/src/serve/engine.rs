//! The engine: the one task that owns the calculation graph (DESIGN.md invariant 2).
//!
//! It receives datastore updates, agent connections and disconnections, applies them to the
//! graph, flushes, and hands each node's batch to that node's connection. Each connection has
//! an unbounded queue whose length is tracked in messages and encoded bytes: when an agent falls
//! further behind than either backlog limit, its stream is closed with RESOURCE_EXHAUSTED and its node unsubscribed, so a
//! stalled agent costs bounded memory; the agent reconnects and receives a fresh snapshot.
//! A second connection for a node replaces the first (closed with ABORTED).
//! Snapshots are admitted a few at a time (`max_concurrent_snapshots`): a node's snapshot is
//! under way until its queue has drained, so a thousand agents connecting at once do not put a
//! thousand snapshots in flight at once.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use calc_graph::graph::{CalcGraph, SharedMessage, Update};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use super::metrics::Metrics;
use super::status::Board;

/// What a connection's outgoing stream carries.
pub enum Out {
    /// A message and its encoded size.
    Msg(SharedMessage, u64),
    /// End the stream with this status.
    Close(Status),
}

/// One agent connection, as the engine sees it.
pub struct Conn {
    pub id: u64,
    pub tx: mpsc::UnboundedSender<Out>,
    /// Messages the stream has taken from the queue (counted by the stream).
    pub taken: Arc<AtomicU64>,
    /// Messages the engine has queued (shared with the metrics: lag = queued - taken).
    pub queued: Arc<AtomicU64>,
    /// Encoded bytes queued, and taken by the stream: the backlog in bytes.
    pub queued_bytes: u64,
    pub taken_bytes: Arc<AtomicU64>,
    /// Where the node's snapshot ends in the queue, once it has been queued.
    pub snapshot_end: Option<u64>,
}

impl Conn {
    pub fn new(
        id: u64,
        tx: mpsc::UnboundedSender<Out>,
        taken: Arc<AtomicU64>,
        taken_bytes: Arc<AtomicU64>,
    ) -> Conn {
        Conn {
            id,
            tx,
            taken,
            queued: Arc::new(AtomicU64::new(0)),
            queued_bytes: 0,
            taken_bytes,
            snapshot_end: None,
        }
    }

    fn backlog(&self) -> u64 {
        self.queued
            .load(Ordering::Relaxed)
            .saturating_sub(self.taken.load(Ordering::Relaxed))
    }

    fn backlog_bytes(&self) -> u64 {
        self.queued_bytes
            .saturating_sub(self.taken_bytes.load(Ordering::Relaxed))
    }
}

pub enum Input {
    /// A batch of datastore updates.
    Datastore(Vec<Update>),
    /// An agent said hello; `reply` says whether it is accepted.
    Connect {
        node: String,
        agent_version: String,
        conn: Conn,
        reply: oneshot::Sender<Result<(), Status>>,
    },
    /// The agent's side of stream `id` ended; `status`, when set, is sent to the agent as the
    /// reason its stream is closed (a protocol error on its side).
    Disconnect {
        node: String,
        id: u64,
        status: Option<Status>,
    },
    /// Close every stream (server shutting down).
    Shutdown,
}

pub struct Engine {
    graph: CalcGraph,
    conns: HashMap<String, Conn>,
    board: Arc<Board>,
    backlog_limit: usize,
    backlog_bytes_limit: u64,
    /// Whether a node not in the datastore may connect (it then gets config and InSync only).
    allow_unknown_nodes: bool,
    /// A datastore batch arrived since the status board last learned the known nodes.
    datastore_changed: bool,
    /// Set once the datastore's snapshot is in the graph (readiness).
    ready: Arc<std::sync::atomic::AtomicBool>,
    max_concurrent_snapshots: usize,
    /// Connected nodes waiting for their snapshot to start.
    waiting: VecDeque<String>,
    /// Nodes whose snapshot is being delivered.
    snapshotting: HashSet<String>,
    metrics: Arc<Metrics>,
}

impl Engine {
    pub fn new(
        board: Arc<Board>,
        backlog_limit: usize,
        backlog_bytes_limit: u64,
        allow_unknown_nodes: bool,
        ready: Arc<std::sync::atomic::AtomicBool>,
        max_concurrent_snapshots: usize,
        metrics: Arc<Metrics>,
    ) -> Engine {
        Engine {
            graph: CalcGraph::new(),
            conns: HashMap::new(),
            board,
            backlog_limit,
            backlog_bytes_limit,
            allow_unknown_nodes,
            datastore_changed: false,
            ready,
            max_concurrent_snapshots: max_concurrent_snapshots.max(1),
            waiting: VecDeque::new(),
            snapshotting: HashSet::new(),
            metrics,
        }
    }

    /// Ends finished snapshots and starts waiting ones, up to the limit. A snapshot is
    /// finished when the stream has taken its last message, whatever came after it.
    fn admit(&mut self) {
        let conns = &self.conns;
        self.snapshotting.retain(|n| {
            conns.get(n).is_some_and(|c| {
                c.snapshot_end
                    .is_none_or(|end| c.taken.load(Ordering::Relaxed) < end)
            })
        });
        while self.snapshotting.len() < self.max_concurrent_snapshots {
            let Some(node) = self.waiting.pop_front() else {
                break;
            };
            if self.conns.contains_key(&node) {
                self.graph.subscribe(&node);
                self.snapshotting.insert(node);
            }
        }
    }

    /// Runs until the input channel closes or a Shutdown arrives. `datastore` carries the
    /// adapter's batches of updates (`crate::datastore::Sink` is its sender); the engine goes on
    /// serving what it has if the adapter stops.
    pub async fn run(
        mut self,
        mut rx: mpsc::Receiver<Input>,
        mut datastore: mpsc::Receiver<Vec<Update>>,
    ) {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut datastore_open = true;
        loop {
            let busy = !self.waiting.is_empty() || !self.snapshotting.is_empty();
            let first = tokio::select! {
                i = rx.recv() => match i {
                    Some(i) => Some(i),
                    None => return,
                },
                batch = datastore.recv(), if datastore_open => match batch {
                    Some(batch) => Some(Input::Datastore(batch)),
                    None => {
                        datastore_open = false;
                        None
                    }
                },
                _ = tick.tick(), if busy => None,
            };
            let mut inputs: Vec<Input> = first.into_iter().collect();
            // Take everything already waiting: one flush for the whole burst.
            while inputs.len() < 4096 {
                match datastore.try_recv() {
                    Ok(batch) => inputs.push(Input::Datastore(batch)),
                    Err(_) => break,
                }
            }
            while inputs.len() < 4096 {
                match rx.try_recv() {
                    Ok(i) => inputs.push(i),
                    Err(_) => break,
                }
            }
            let mut stop = false;
            let started = std::time::Instant::now();
            for input in inputs {
                stop |= self.handle(input);
            }
            self.sweep_closed();
            self.admit();
            self.flush();
            self.metrics.calc_seconds.observe(started.elapsed());
            if self.graph.in_sync() {
                self.ready.store(true, Ordering::Relaxed);
                // Only datastore input changes which nodes exist: not on every connect.
                if std::mem::take(&mut self.datastore_changed) {
                    self.board.set_known(self.graph.known_nodes());
                }
            }
            if stop {
                for (node, conn) in self.conns.drain() {
                    let _ = conn.tx.send(Out::Close(Status::unavailable(
                        "calc-server is shutting down",
                    )));
                    self.board.disconnected(&node);
                    self.metrics.agent_gone(&node, None);
                }
                return;
            }
        }
    }

    /// Forgets connections whose stream is gone (the agent went away, or the handshake was
    /// abandoned after the engine accepted it).
    fn sweep_closed(&mut self) {
        let closed: Vec<String> = self
            .conns
            .iter()
            .filter(|(_, c)| c.tx.is_closed())
            .map(|(n, _)| n.clone())
            .collect();
        for node in closed {
            self.drop_conn(&node);
        }
    }

    fn drop_conn(&mut self, node: &str) -> Option<Conn> {
        let conn = self.conns.remove(node)?;
        self.graph.unsubscribe(node);
        self.snapshotting.remove(node);
        self.waiting.retain(|n| n != node);
        self.board.disconnected(node);
        self.metrics.agent_gone(node, Some(conn.id));
        Some(conn)
    }

    fn handle(&mut self, input: Input) -> bool {
        match input {
            Input::Datastore(updates) => {
                self.datastore_changed = true;
                let span = tracing::debug_span!("datastore_batch", updates = updates.len());
                let _enter = span.enter();
                self.metrics
                    .updates_processed
                    .fetch_add(updates.len() as u64, Ordering::Relaxed);
                for u in updates {
                    if matches!(u, Update::InSync) {
                        self.metrics.datastore_syncs.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Err(rejection) = self.graph.apply(u) {
                        self.metrics
                            .rejections
                            .count(calc_graph::manifest::RejectStage::Validation);
                        tracing::warn!(error = %rejection, "rejected datastore object; the last good version stays");
                    }
                }
            }
            Input::Connect {
                node,
                agent_version,
                conn,
                reply,
            } => {
                if !self.allow_unknown_nodes
                    && self.graph.in_sync()
                    && !self.graph.known_nodes().iter().any(|n| n == &node)
                {
                    tracing::warn!(
                        %node,
                        conn = conn.id,
                        "refused an agent: the node is not in the datastore (no Node resource \
                         and no endpoints); check the agent's --node against the Node names, \
                         or start the server with --allow-unknown-nodes"
                    );
                    self.metrics
                        .refused_unknown_nodes
                        .fetch_add(1, Ordering::Relaxed);
                    let _ = reply.send(Err(Status::not_found(format!(
                        "node {node:?} is not in the datastore (no Node resource and no endpoints)"
                    ))));
                    return false;
                }
                if let Some(old) = self.conns.remove(&node) {
                    tracing::info!(%node, old = old.id, new = conn.id, "a newer connection replaces the node's stream");
                    let _ = old.tx.send(Out::Close(Status::aborted(format!(
                        "replaced by a newer connection for node {node}"
                    ))));
                }
                // The snapshot starts when there is room (admit); until then nothing is sent.
                self.graph.unsubscribe(&node);
                self.snapshotting.remove(&node);
                self.waiting.retain(|n| n != &node);
                self.waiting.push_back(node.clone());
                self.board.connected(&node, conn.id, &agent_version);
                self.metrics.agent_connected(
                    &node,
                    conn.id,
                    conn.queued.clone(),
                    conn.taken.clone(),
                );
                self.conns.insert(node, conn);
                let _ = reply.send(Ok(()));
            }
            Input::Disconnect { node, id, status } => {
                if self.conns.get(&node).is_some_and(|c| c.id == id)
                    && let Some(conn) = self.drop_conn(&node)
                    && let Some(status) = status
                {
                    let _ = conn.tx.send(Out::Close(status));
                }
            }
            Input::Shutdown => return true,
        }
        false
    }

    fn flush(&mut self) {
        let conns = &mut self.conns;
        let board = &self.board;
        let snapshotting = &self.snapshotting;
        let limit = self.backlog_limit as u64;
        let bytes_limit = self.backlog_bytes_limit;
        let metrics = &self.metrics;
        let mut overflowed = Vec::new();
        // A shared message is sized once per flush however many nodes it goes to.
        let mut sizes: HashMap<*const felix_proto::ToDataplane, u64> = HashMap::new();
        self.graph.flush_with(|batch| {
            let Some(conn) = conns.get_mut(&batch.node) else {
                return;
            };
            let n = batch.messages.len() as u64;
            let sized: Vec<(SharedMessage, u64)> = batch
                .messages
                .into_iter()
                .map(|m| {
                    let len = *sizes
                        .entry(Arc::as_ptr(&m))
                        .or_insert_with(|| felix_proto::prost::Message::encoded_len(&*m) as u64);
                    (m, len)
                })
                .collect();
            let bytes: u64 = sized.iter().map(|(_, l)| l).sum();
            let (backlog, backlog_bytes) = (conn.backlog(), conn.backlog_bytes());
            // An empty queue always takes the batch: a snapshot larger than the limits must
            // still be deliverable.
            if backlog > 0 && (backlog + n > limit || backlog_bytes + bytes > bytes_limit) {
                overflowed.push((batch.node.clone(), backlog, backlog_bytes));
                return;
            }
            let queued = conn.queued.fetch_add(n, Ordering::Relaxed) + n;
            conn.queued_bytes += bytes;
            metrics.messages_sent.fetch_add(n, Ordering::Relaxed);
            // The node's first batch after it was admitted is its snapshot.
            if conn.snapshot_end.is_none() && snapshotting.contains(&batch.node) {
                conn.snapshot_end = Some(queued);
            }
            board.sent(&batch.node, n);
            for (m, len) in sized {
                let _ = conn.tx.send(Out::Msg(m, len));
            }
        });
        for (node, backlog, backlog_bytes) in overflowed {
            if let Some(conn) = self.drop_conn(&node) {
                tracing::warn!(%node, backlog, backlog_bytes, limit, bytes_limit, "agent fell too far behind; closing its stream so it resyncs");
                let _ = conn.tx.send(Out::Close(Status::resource_exhausted(format!(
                    "node {node} fell more than {limit} messages or {bytes_limit} bytes behind; reconnect for a fresh snapshot"
                ))));
            }
        }
    }
}
