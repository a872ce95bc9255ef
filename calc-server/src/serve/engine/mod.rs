//! The engine: the one owner of the calculation graph (architecture invariant 2), as a synchronous
//! state machine.
//!
//! [`Engine::step`] takes a burst of [`Input`]s (datastore updates, agent connections and
//! disconnections), applies them to the graph, admits waiting snapshots, flushes, and queues each
//! node's batch on that node's connection. Its effects go out through the handles the inputs
//! carry: a connection's queue ([`Out`]) and a connect reply. Nothing here is async or knows the
//! transport: `run` drives it from channels and `service` maps [`CloseReason`]s and
//! [`Refusal`]s to gRPC statuses, so the whole state machine is unit-tested without a network.
//!
//! Rules it keeps:
//! - Each connection has an unbounded queue whose length is tracked in messages and encoded
//!   bytes: when an agent falls further behind than either backlog limit, its stream is closed
//!   ([`CloseReason::TooFarBehind`]) and its node unsubscribed, so a stalled agent costs bounded
//!   memory; the agent reconnects and receives a fresh snapshot. The bytes limit is
//!   `--agent-backlog-bytes` when set, else sized per node from the snapshot it was last sent
//!   ([`BacklogSizing`]): what a stalled agent may cost follows that node's state.
//! - A second connection for a node replaces the first ([`CloseReason::Replaced`]).
//! - Snapshots are admitted a few at a time (`max_concurrent_snapshots`): a node's snapshot is
//!   under way until its queue has drained, so a thousand agents connecting at once do not put a
//!   thousand snapshots in flight at once.
//! - A message several nodes receive in one step is queued as one [`Outbound`]: the first
//!   stream that sends it encodes it ([`felix_proto::framed::Encoded`]) and the others reuse the
//!   bytes, each stamping its own sequence number. A message for one node is encoded by its
//!   stream when sent. Encoding at send time keeps a queued snapshot as small as before.
//! - While snapshots are admitted (a connect storm, a mass reconnect), the shared messages'
//!   encodings are kept across steps ([`SnapshotCache`]): a policy, profile or IP set that
//!   every snapshot carries is encoded once per graph generation, not once per step, so a
//!   thousand snapshots cost one encoding of each shared message plus each node's own
//!   messages. What is reused is exactly what the node gets now: the cache holds the message
//!   it encoded, is keyed by that message (or, for a full IP set, by its id, whose members only
//!   a datastore batch changes), and is emptied by every datastore batch and once no snapshot
//!   is waiting or under way.
//! - The whole broadcast state a fresh node is sent (host metadata and IPAM pools, marked by the
//!   graph in the batch) is queued as one [`Block`], kept in the [`SnapshotCache`] like the
//!   shared messages and encoded once: a connect storm on a 5,000-node cluster costs one queue
//!   entry per snapshot for it, not 5,000. The stream sends it one numbered message at a time.
//! - Every message queued is numbered as its stream will number it, so what agents report
//!   applied (`DataplaneApplied`) says which policy versions are in force where
//!   ([`realization`]).
//! - Rule hit counts an agent reports (`RuleStats`) count only for rules its current stream
//!   was sent, on its own node's entries ([`hits`]); `/status/policies` sums them per policy
//!   and profile, a single policy's answer has them per rule, `/status/unused` lists the rules
//!   nothing matched within a window (from when each was first in force on a node that reports
//!   stats, as its `DataplaneApplied` says), and the per-policy Prometheus totals are
//!   republished at most once a second.
//! - With a place to keep them ([`Engine::save_hits_every`]), the hit counters are copied
//!   ([`SavedHits`]) at most once per save interval when they changed, and once more in the
//!   step that shuts down, and handed to the writer task through a `watch` channel (latest
//!   wins): the engine never waits on a disk or a datastore. What was saved before comes in
//!   through [`Engine::restore_hits`] (`Input::RestoreHits`), whenever the store could be read:
//!   it is merged into what was counted meanwhile (counts add up, observation times take the
//!   earliest), and no copy is handed over before it, so a store is never overwritten by a
//!   server that has not read it. With a shared store, a connecting node's saved counts are
//!   asked for and merged the same way (`Input::NodeHits`, see `hits::reload`); until then
//!   each copy ([`SaveCopy`]) names the node, whose parts the writer leaves alone. Counters are
//!   pruned only once the datastore is in sync, so restored ones are not dropped before their
//!   policies are known.

#[doc(hidden)]
pub mod flows;
mod hits;
mod realization;
pub(crate) mod recommend;
mod run;
#[cfg(test)]
mod tests;

pub(crate) use flows::{FlowBatch, parse as parse_flow_report, policy_kind};
pub(crate) use hits::{
    Hit, PolicySeries, SAVED_VERSION, SavedCount, SavedHits, SavedSeen, UnusedPolicy, VerdictHits,
    parse as parse_rule_stats,
};
pub(crate) use realization::{FindError, PolicyRealization};

pub(super) use run::run;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use calc_graph::graph::{CalcGraph, SharedMessage, Update};
use felix_proto::encoded::Encoded;
use tokio::sync::{mpsc, oneshot};

use super::metrics::Metrics;
use super::status::Board;

/// A message on its way to the streams of one step, encoded once by the first that sends it.
#[derive(Debug)]
pub(super) struct Outbound {
    message: SharedMessage,
    /// The encoded length without a sequence number (what backlogs are measured in).
    len: u64,
    encoded: OnceLock<Encoded>,
    /// Counts the encodings made (the engine's; tests read it).
    encodings: Arc<AtomicU64>,
}

impl Outbound {
    fn new(message: SharedMessage, encodings: Arc<AtomicU64>) -> Outbound {
        let len = message.encoded_len() as u64;
        // A message the graph holds encoded (a whole IP set) is sent as those very bytes.
        let encoded = OnceLock::new();
        if let Some(bytes) = message.encoded() {
            let _ = encoded.set(bytes.clone());
        }
        Outbound {
            message,
            len,
            encoded,
            encodings,
        }
    }

    pub(super) fn message(&self) -> &SharedMessage {
        &self.message
    }

    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// The bytes to send (encoded on the first call, shared afterwards).
    pub(super) fn encoded(&self) -> &Encoded {
        self.encoded.get_or_init(|| {
            self.encodings.fetch_add(1, Ordering::Relaxed);
            Encoded::new(&self.message)
        })
    }
}

/// A run of messages every fresh node of a graph generation is sent alike, in the same order
/// (the whole broadcast state: 5,000 host metadata messages on a 5,000-node cluster): queued
/// as one entry and encoded once, by the first stream that sends it. Each stream still sends
/// them as separate messages, numbered in turn.
#[derive(Debug)]
pub(super) struct Block {
    messages: Vec<SharedMessage>,
    /// Their encoded lengths without sequence numbers, summed.
    len: u64,
    encoded: OnceLock<Vec<Encoded>>,
    encodings: Arc<AtomicU64>,
}

impl Block {
    fn new(messages: Vec<SharedMessage>, encodings: Arc<AtomicU64>) -> Block {
        let len = messages.iter().map(|m| m.encoded_len() as u64).sum();
        Block {
            messages,
            len,
            encoded: OnceLock::new(),
            encodings,
        }
    }

    pub(super) fn messages(&self) -> &[SharedMessage] {
        &self.messages
    }

    /// The bytes of each message (encoded on the first call, shared afterwards).
    pub(super) fn encoded(&self) -> &[Encoded] {
        self.encoded.get_or_init(|| {
            self.encodings.fetch_add(1, Ordering::Relaxed);
            self.messages
                .iter()
                .map(|m| m.encoded().cloned().unwrap_or_else(|| Encoded::new(m)))
                .collect()
        })
    }
}

/// Which shared message a [`SnapshotCache`] entry is: the graph's own allocation (a policy or
/// profile update, held by the graph between flushes), or a full IP set by its id (built anew
/// by each flush, the same members within one graph generation).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum CacheKey {
    Ptr(usize),
    IpSet(String),
    /// A [`Block`]: the address of its first message (held by the graph, or by the block)
    /// and how many.
    Run(usize, usize),
}

/// The shared messages' encodings kept across steps while snapshots are admitted (see the
/// module documentation).
#[derive(Default)]
pub(super) struct SnapshotCache {
    /// The graph generation the entries belong to.
    generation: u64,
    entries: rustc_hash::FxHashMap<CacheKey, Arc<Outbound>>,
    blocks: rustc_hash::FxHashMap<CacheKey, Arc<Block>>,
    /// Encodings made by shared messages (all of them, cached or not).
    encodings: Arc<AtomicU64>,
}

impl SnapshotCache {
    /// Which key a message queued on `n` connections of this step would be cached under:
    /// `None` for a message built for one node only (encoded by its stream).
    fn key(message: &SharedMessage, carried: u32) -> Option<CacheKey> {
        if let Some(id) = message.ipset_id() {
            return Some(CacheKey::IpSet(id.to_string()));
        }
        // Held by the graph (or by another batch of this step): others will send it too.
        (carried > 1 || message.holders() > carried as usize)
            .then_some(CacheKey::Ptr(message.addr()))
    }

    /// Starts a step at graph `generation`: entries of an older one are dropped.
    fn at(&mut self, generation: u64) {
        if self.generation != generation {
            self.entries.clear();
            self.blocks.clear();
            self.generation = generation;
        }
    }

    /// The queued form of `message`: a shared encoding (reused, or new and kept) or the
    /// message alone.
    fn outbound(&mut self, message: SharedMessage, carried: u32) -> Out {
        let Some(key) = Self::key(&message, carried) else {
            let len = message.encoded_len() as u64;
            return Out::Msg(message, len);
        };
        let encodings = &self.encodings;
        let o = self
            .entries
            .entry(key)
            .or_insert_with(|| Arc::new(Outbound::new(message, encodings.clone())));
        Out::Shared(o.clone())
    }

    /// The queued form of a run every fresh node of this generation is sent alike: one block,
    /// shared by every stream that sends it.
    fn block(&mut self, run: Vec<SharedMessage>) -> Out {
        let key = CacheKey::Run(run.first().map_or(0, SharedMessage::addr), run.len());
        let encodings = &self.encodings;
        let entry = self
            .blocks
            .entry(key)
            .or_insert_with(|| Arc::new(Block::new(run, encodings.clone())));
        Out::Block(entry.clone())
    }

    fn clear(&mut self) {
        if !self.blocks.is_empty() {
            self.blocks = rustc_hash::FxHashMap::default();
        }
        if !self.entries.is_empty() {
            self.entries = rustc_hash::FxHashMap::default();
        }
    }

    /// Shared messages encoded so far.
    #[cfg(test)]
    pub(super) fn encodings(&self) -> u64 {
        self.encodings.load(Ordering::Relaxed)
    }

    /// Entries kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// What a connection's outgoing stream carries.
pub(super) enum Out {
    /// A message only this stream sends in its step (with its encoded length): encoded when
    /// sent, as it would be anyway.
    Msg(SharedMessage, u64),
    /// A message several streams send in the same step: encoded once, by the first.
    Shared(Arc<Outbound>),
    /// Messages every fresh node is sent alike (see [`Block`]).
    Block(Arc<Block>),
    /// End the stream for this reason.
    Close(CloseReason),
}

impl Out {
    /// The message, unless this is a block or a close. Reading a message the graph holds encoded
    /// decodes it (see [`Out::held_message`]).
    pub(super) fn message(&self) -> Option<&SharedMessage> {
        match self {
            Out::Msg(m, _) => Some(m),
            Out::Shared(o) => Some(o.message()),
            Out::Block(_) | Out::Close(_) => None,
        }
    }

    /// Every message this entry sends, in order (a block's, one by one).
    pub(super) fn messages(&self) -> impl Iterator<Item = &SharedMessage> {
        let block = match self {
            Out::Block(b) => b.messages(),
            _ => &[],
        };
        self.message().into_iter().chain(block)
    }

    /// How many messages (sequence numbers) this entry takes.
    #[cfg(test)]
    pub(super) fn count(&self) -> u64 {
        match self {
            Out::Msg(..) | Out::Shared(_) => 1,
            Out::Block(b) => b.messages().len() as u64,
            Out::Close(_) => 0,
        }
    }

    /// The message when it is held as one: what a stream inspects as it sends, without
    /// decoding a whole IP set the graph holds encoded.
    pub(super) fn held_message(&self) -> Option<&felix_proto::ToDataplane> {
        self.message().and_then(SharedMessage::held_message)
    }

    /// The encoded length without a sequence number (what backlogs are measured in).
    pub(super) fn len(&self) -> u64 {
        match self {
            Out::Msg(_, len) => *len,
            Out::Shared(o) => o.len(),
            Out::Block(b) => b.len,
            Out::Close(_) => 0,
        }
    }

    /// The bytes to send, unless this is a block (see [`Block::encoded`]) or a close.
    pub(super) fn encoded(&self) -> Option<Encoded> {
        match self {
            Out::Msg(m, _) => Some(m.encoded().cloned().unwrap_or_else(|| Encoded::new(m))),
            Out::Shared(o) => Some(o.encoded().clone()),
            Out::Block(_) | Out::Close(_) => None,
        }
    }
}

/// What the realization and hit trackers read of a queued message: the message when held as
/// one; for a whole IP set the graph holds encoded (which neither tracks), a message without a
/// payload, so that its sequence number still counts and nothing is decoded.
fn inspected(m: &SharedMessage) -> &felix_proto::ToDataplane {
    static ENCODED: felix_proto::ToDataplane = felix_proto::ToDataplane {
        sequence_number: 0,
        payload: None,
    };
    m.held_message().unwrap_or(&ENCODED)
}

/// Why the engine ends a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum CloseReason {
    /// The server is stopping.
    ShuttingDown,
    /// A newer connection for the same node took over.
    Replaced { node: String },
    /// The agent's queue passed a backlog limit; it must reconnect for a fresh snapshot.
    TooFarBehind {
        node: String,
        limit: u64,
        bytes_limit: u64,
    },
}

/// Why the engine refused an agent's connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The node is neither a Node resource nor the node of any endpoint.
    UnknownNode { node: String },
}

const MIB: u64 = 1024 * 1024;

/// A full realization table, with the realization and graph generations it was computed at,
/// and when.
struct KeptTable {
    realization: u64,
    graph: u64,
    at: std::time::Instant,
    rows: Vec<PolicyRealization>,
}

/// How old a realization table the console's policy board accepts while the datastore has not
/// changed (agents applying updates move the counts all the time on a busy cluster; the
/// per-tier gauges are refreshed as often).
const BOARD_TABLE_AGE: std::time::Duration = std::time::Duration::from_secs(1);

/// Pending traces of flow records (explain's walk with staged policies enforced, about 0.4 ms
/// each on the 2-core bench machine) computed per engine step at most: a burst of new
/// conversations under staged policies holds the engine for tens of milliseconds per step, and
/// the rest waits for the next steps (10 ms apart) instead of delaying every node's updates.
const EXPLAINS_PER_STEP: usize = 100;

/// How a node's backlog bound in bytes is sized when `--agent-backlog-bytes` is not set:
/// `factor` times the encoded size of the snapshot the node's stream was sent, at most `max`,
/// and at least that snapshot plus `min` (the snapshot itself is in the backlog until the
/// stream has taken it, and changes made meanwhile must still fit, or a node whose snapshot is
/// larger than the bound could never finish one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BacklogSizing {
    pub factor: u64,
    pub min: u64,
    pub max: u64,
}

impl Default for BacklogSizing {
    /// Four times the node's snapshot, at most 256 MiB, at least the snapshot plus 16 MiB.
    fn default() -> Self {
        Self {
            factor: 4,
            min: 16 * MIB,
            max: 256 * MIB,
        }
    }
}

impl BacklogSizing {
    /// The bound for a node whose snapshot encoded to `snapshot` bytes (`None`: not sent yet).
    pub(super) fn bound(&self, snapshot: Option<u64>) -> u64 {
        let snapshot = snapshot.unwrap_or(0);
        snapshot
            .saturating_mul(self.factor)
            .min(self.max)
            .max(snapshot.saturating_add(self.min))
    }
}

/// One agent connection, as the engine sees it.
pub(super) struct Conn {
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
    /// The encoded size of the snapshot queued on this connection, once it has been queued.
    pub snapshot_bytes: Option<u64>,
    /// The agent offered the `applied` capability: it reports what its dataplane holds.
    pub reports_applied: bool,
    /// The agent offered the `stats` capability: it reports rule hit counts.
    pub reports_stats: bool,
}

impl Conn {
    pub(super) fn new(
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
            snapshot_bytes: None,
            reports_applied: false,
            reports_stats: false,
        }
    }

    /// The agent reports what it applied (`DataplaneApplied`).
    pub(super) fn reporting_applied(mut self, reports: bool) -> Conn {
        self.reports_applied = reports;
        self
    }

    /// The agent reports rule hit counts (`RuleStats`).
    pub(super) fn reporting_stats(mut self, reports: bool) -> Conn {
        self.reports_stats = reports;
        self
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

    fn close(&self, reason: CloseReason) {
        // A stream that is already gone needs no reason.
        let _ = self.tx.send(Out::Close(reason));
    }
}

pub(super) enum Input {
    /// A batch of datastore updates.
    Datastore(Vec<Update>),
    /// An agent said hello; `reply` says whether it is accepted.
    Connect {
        node: String,
        agent_version: String,
        conn: Conn,
        reply: oneshot::Sender<Result<(), Refusal>>,
    },
    /// Stream `id` of `node` ended (its outgoing side is gone, or the gRPC layer closed it for
    /// a protocol error in the agent's reports).
    Disconnect { node: String, id: u64 },
    /// An explain query over the current state (answered after the datastore batches that
    /// came before it).
    Explain {
        request: calc_graph::explain::Request,
        reply: oneshot::Sender<Result<serde_json::Value, calc_graph::explain::QueryError>>,
    },
    /// Stream `id` of `node` reports its dataplane holds everything up to `applied` (and, with
    /// `error`, that its last apply failed).
    Applied {
        node: String,
        id: u64,
        applied: u64,
        error: Option<String>,
    },
    /// Stream `id` of `node` reports what its rules decided since its previous report
    /// (validated by [`parse_rule_stats`]), received at `at`.
    Hits {
        node: String,
        id: u64,
        hits: Vec<Hit>,
        at: std::time::SystemTime,
    },
    /// Stream `id` of `node` reports flow records (checked by [`parse_flow_report`]), received
    /// at `at`: named and stored when flow logs are on ([`Engine::enable_flows`]).
    Flows {
        node: String,
        id: u64,
        batch: FlowBatch,
        at: std::time::SystemTime,
    },
    /// A Goldmane `Flows.List` over the flow store (`None`: flow logs are off).
    FlowList {
        request: crate::flows::FlowListRequest,
        reply: oneshot::Sender<
            Option<Result<crate::flows::FlowListResult, crate::flows::InvalidRequest>>,
        >,
    },
    /// A Goldmane `Flows.FilterHints` over the flow store (`None`: flow logs are off).
    FlowHints {
        request: crate::flows::FilterHintsRequest,
        reply: oneshot::Sender<
            Option<Result<crate::flows::FilterHintsResult, crate::flows::InvalidRequest>>,
        >,
    },
    /// A Goldmane `Statistics.List` over the flow store (`None`: flow logs are off).
    FlowStats {
        request: crate::flows::StatisticsRequest,
        reply: oneshot::Sender<
            Option<Result<Vec<crate::flows::StatisticsResult>, crate::flows::InvalidRequest>>,
        >,
    },
    /// Where policies are in force: all of them, or one (`[NAMESPACE/]NAME`) with its lagging
    /// nodes and its rules' hit counts.
    Realization {
        only: Option<String>,
        reply: oneshot::Sender<Result<Vec<PolicyRealization>, FindError>>,
    },
    /// The policies and profiles in force whose rules nothing matched within `window` before
    /// now (`None`: all recorded history), and those not observed long enough to tell.
    Unused {
        window: Option<std::time::Duration>,
        reply: oneshot::Sender<Vec<UnusedPolicy>>,
    },
    /// The console's policy board: every policy's realization with its hits (as
    /// `/status/policies`), the unused classification over all history (as `/status/unused`),
    /// and every policy's selector and place in evaluation order.
    PolicyBoard { reply: oneshot::Sender<PolicyBoard> },
    /// What a policy recommendation, or the staged policies' would-break lists, for a
    /// namespace are made from (`/recommend`, `/recommend/check`; `None`: flow logs are off;
    /// `Err`: the 400 text).
    Recommend {
        question: recommend::Question,
        reply: oneshot::Sender<Option<Result<recommend::Gathered, String>>>,
    },
    /// The dataplane's own verdicts that counted something (`/status/verdicts`).
    Verdicts {
        reply: oneshot::Sender<Vec<VerdictHits>>,
    },
    /// The hit counters saved by an earlier server (empty: none), to merge into these.
    RestoreHits(SavedHits),
    /// `node`'s counters as the store held them after its stream `conn` connected (asked for
    /// through [`Engine::reload_node_hits`]), to merge into these; `None`: the store could not
    /// be read (asked again at the next save).
    NodeHits {
        node: String,
        conn: u64,
        counts: Option<Vec<SavedCount>>,
    },
    /// Close every stream (server shutting down).
    Shutdown,
}

/// What [`Input::PolicyBoard`] answers.
#[derive(Debug, Default)]
pub(crate) struct PolicyBoard {
    /// `/status/policies`' rows (policies by tier and name, then profiles).
    pub rows: Vec<PolicyRealization>,
    /// `/status/unused`'s answer over each rule's whole observed history.
    pub unused: Vec<UnusedPolicy>,
    /// Every policy in evaluation order.
    pub order: Vec<OrderedPolicy>,
}

/// One policy's place in evaluation order.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct OrderedPolicy {
    /// `namespace/name` or `name`, as in [`PolicyRealization::policy`].
    pub policy: String,
    pub kind: String,
    pub tier: String,
    /// The Tier resource's order (`None`: no order, or no Tier resource).
    pub tier_order: Option<f64>,
    /// The policy's own order (`None`: last in its tier).
    pub order: Option<f64>,
    /// The selector, canonical (as `explain --policy` shows it).
    pub selector: String,
}

/// The engine's settings.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    /// Messages an agent may fall behind before it is cut off.
    pub backlog: u64,
    /// Encoded bytes an agent may fall behind before it is cut off (`None`: sized per node,
    /// [`BacklogSizing`]).
    pub backlog_bytes: Option<u64>,
    /// Snapshots in flight at once.
    pub concurrent_snapshots: usize,
    /// Whether a node not in the datastore may connect (it then gets config and InSync only).
    pub allow_unknown_nodes: bool,
}

/// Where the hit counters go to be saved, and when they last went.
struct HitsSave {
    tx: tokio::sync::watch::Sender<Option<SaveCopy>>,
    /// Where a connecting node's stored counters are asked for (stores that can answer).
    reload: Option<mpsc::UnboundedSender<(String, u64)>>,
    every: std::time::Duration,
    last: Option<std::time::Instant>,
    /// They changed since they were last handed over.
    due: bool,
    /// The saved counters were merged in ([`Engine::restore_hits`]): nothing is handed over
    /// before, so that the store is never overwritten by a copy that lacks them.
    restored: bool,
}

/// A copy of the hit counters to save, and the nodes whose parts must be left as the store
/// has them: their saved counts are not merged here yet (`hits::reload`), so this server's view
/// of them may be stale.
#[derive(Clone, Debug)]
pub(crate) struct SaveCopy {
    pub doc: Arc<SavedHits>,
    pub skip: Vec<String>,
}

/// What one step did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Step {
    /// A shutdown was asked for: every stream has been closed.
    pub stopped: bool,
}

pub(super) struct Engine {
    graph: CalcGraph,
    conns: HashMap<String, Conn>,
    board: Arc<Board>,
    limits: Limits,
    /// How each node's backlog bound in bytes is sized when `limits.backlog_bytes` is `None`.
    backlog_sizing: BacklogSizing,
    /// A datastore batch arrived since the status board last learned the known nodes.
    datastore_changed: bool,
    /// Datastore batches applied (the graph may have changed with each).
    graph_generation: u64,
    /// The last full realization table: `/status/policies`, `/status/unused` and the
    /// console's board reuse it (see [`Engine::full_table`]).
    table_cache: Option<KeptTable>,
    /// Set once the datastore's snapshot is in the graph (readiness).
    ready: Arc<AtomicBool>,
    /// Connected nodes waiting for their snapshot to start.
    waiting: VecDeque<String>,
    /// Nodes whose snapshot is being delivered.
    snapshotting: HashSet<String>,
    /// Shared messages' encodings kept while snapshots are admitted.
    snapshot_cache: SnapshotCache,
    metrics: Arc<Metrics>,
    realization: realization::Realization,
    /// Policy hit counters, per node and rule.
    hits: hits::Hits,
    /// A datastore batch or a departure since the hit counters were last pruned.
    hits_prune_due: bool,
    /// When the hit counters were last pruned.
    hits_pruned: Option<std::time::Instant>,
    /// The per-policy hit totals changed since they were last published to the metrics.
    hit_series_dirty: bool,
    /// When they were last published.
    hit_series_published: Option<std::time::Instant>,
    /// Where the hit counters are handed to be saved (`None`: they are not).
    hits_save: Option<HitsSave>,
    /// Flow logs: the flow store and what was received (`None`: off).
    flows: Option<flows::FlowIngest>,
    /// When the per-tier realization gauges were last summed.
    realization_summed: Option<std::time::Instant>,
    /// When the current step started.
    now: std::time::Instant,
    /// The same, by the wall clock (rule observation and `/status/unused`'s window).
    wall: std::time::SystemTime,
    /// A fixed wall clock for tests and the console benchmark.
    wall_override: Option<std::time::SystemTime>,
}

impl Engine {
    pub(super) fn new(
        limits: Limits,
        board: Arc<Board>,
        ready: Arc<AtomicBool>,
        metrics: Arc<Metrics>,
    ) -> Engine {
        Engine {
            graph: CalcGraph::new(),
            conns: HashMap::new(),
            board,
            limits: Limits {
                concurrent_snapshots: limits.concurrent_snapshots.max(1),
                ..limits
            },
            backlog_sizing: BacklogSizing::default(),
            datastore_changed: false,
            ready,
            waiting: VecDeque::new(),
            snapshotting: HashSet::new(),
            snapshot_cache: SnapshotCache::default(),
            metrics,
            realization: realization::Realization::default(),
            graph_generation: 0,
            table_cache: None,
            hits: hits::Hits::default(),
            hits_prune_due: false,
            hits_pruned: None,
            hit_series_dirty: false,
            hit_series_published: None,
            hits_save: None,
            flows: None,
            realization_summed: None,
            now: std::time::Instant::now(),
            wall: std::time::SystemTime::now(),
            wall_override: None,
        }
    }

    /// Turns flow logs on: a flow store of at most `max_keys` keys, remembering at most
    /// `max_seen` records for de-duplication.
    pub(super) fn enable_flows(&mut self, max_keys: usize, max_seen: usize) {
        self.flows = Some(flows::FlowIngest::new(max_keys, max_seen));
    }

    /// Sizes nodes' backlog bounds with `sizing` (tests use small ones).
    #[cfg(test)]
    pub(super) fn set_backlog_sizing(&mut self, sizing: BacklogSizing) {
        self.backlog_sizing = sizing;
    }

    /// Fixes the wall clock of the steps that follow (`None`: the real one); tests, and the
    /// console benchmark (`console::bench`), whose flow records carry a fixed time.
    pub(super) fn set_wall(&mut self, at: Option<std::time::SystemTime>) {
        self.wall_override = at;
    }

    /// The backlog bound in bytes of a connection.
    fn bytes_limit(&self, conn: &Conn) -> u64 {
        self.limits
            .backlog_bytes
            .unwrap_or_else(|| self.backlog_sizing.bound(conn.snapshot_bytes))
    }

    /// The shared encodings kept while snapshots are admitted.
    #[cfg(test)]
    pub(super) fn snapshot_cache(&self) -> &SnapshotCache {
        &self.snapshot_cache
    }

    /// Whether snapshots are waiting or under way.
    pub(super) fn busy(&self) -> bool {
        !self.waiting.is_empty() || !self.snapshotting.is_empty()
    }

    /// Hands the hit counters to the returned receiver at most `every` when they changed, and
    /// in the step that shuts down (see the module documentation).
    pub(super) fn save_hits_every(
        &mut self,
        every: std::time::Duration,
    ) -> tokio::sync::watch::Receiver<Option<SaveCopy>> {
        let (tx, rx) = tokio::sync::watch::channel(None);
        self.hits_save = Some(HitsSave {
            tx,
            every,
            last: None,
            due: false,
            restored: false,
            reload: None,
        });
        rx
    }

    /// From now on, each stats-reporting node that connects has its stored counters asked for
    /// on the returned channel (node, connection); the answer comes back as `Input::NodeHits`
    /// (see `hits::reload`). Needs [`Engine::save_hits_every`] first.
    pub(super) fn reload_node_hits(&mut self) -> mpsc::UnboundedReceiver<(String, u64)> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(save) = &mut self.hits_save {
            save.reload = Some(tx);
        }
        rx
    }

    /// Merges saved hit counters into those counted so far (see the module documentation);
    /// returns how many entries were skipped as invalid. Those of what is no longer in the
    /// datastore are pruned once it is in sync. From now on copies are handed over to be saved.
    pub(super) fn restore_hits(&mut self, saved: SavedHits) -> usize {
        let counted_before = self.hits.entries() > 0;
        let skipped = self.hits.restore(saved);
        self.hits.take_changed();
        if let Some(save) = &mut self.hits_save {
            // What this server counted before the merge is not in the store yet.
            save.due |= counted_before;
            save.restored = true;
        }
        self.hits_prune_due = true;
        self.hit_series_dirty = true;
        self.metrics
            .rule_stats_entries
            .set(self.hits.entries() as i64);
        skipped
    }

    /// Whether changed hit counters wait for their save interval: the driver wakes to save
    /// them even without input.
    pub(super) fn wants_save_tick(&self) -> bool {
        self.hits_save.as_ref().is_some_and(|s| s.due && s.restored)
    }

    /// Whether the driver should step periodically even without input: to notice drained
    /// queues and admit the next snapshots, or to sum stale realization gauges or publish
    /// changed hit totals.
    pub(super) fn wants_tick(&self) -> bool {
        self.busy()
            || self.realization.dirty
            || self.hit_series_dirty
            || self.flows.as_ref().is_some_and(|f| f.deferred() > 0)
    }

    /// Stores flow records that waited for their pending trace, within this step's budget.
    fn drain_flows(&mut self) {
        let Some(flows) = &mut self.flows else {
            return;
        };
        if flows.deferred() == 0 {
            return;
        }
        let (stored, dropped) = flows.drain(&self.graph, unix_seconds(self.wall));
        for (reason, k) in dropped {
            self.metrics.flow_reports_refused(reason, k);
        }
        self.metrics.flow_records.inc_by(stored);
        self.metrics.flow_keys.set(flows.store.num_keys() as i64);
    }

    /// Applies a burst of inputs and flushes once for all of them.
    pub(super) fn step(&mut self, inputs: impl IntoIterator<Item = Input>) -> Step {
        let started = std::time::Instant::now();
        self.now = started;
        self.wall = std::time::SystemTime::now();
        if let Some(at) = self.wall_override {
            self.wall = at;
        }
        if let Some(flows) = &mut self.flows {
            flows.start_step(Some(EXPLAINS_PER_STEP));
        }
        let mut stop = false;
        for input in inputs {
            stop |= self.handle(input);
        }
        self.drain_flows();
        self.sweep_closed();
        self.admit();
        self.flush();
        if !self.busy() {
            // No snapshot waits or is under way: nothing will reuse the kept encodings, nor
            // the graph's whole IP-set messages they were made from.
            self.snapshot_cache.clear();
            self.graph.release_message_cache();
        }
        self.sum_realization();
        self.prune_hits();
        self.publish_hit_series();
        self.save_hits(stop);
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
                conn.close(CloseReason::ShuttingDown);
                self.board.disconnected(&node);
                self.metrics.agent_gone(&node, None);
            }
            self.waiting.clear();
            self.snapshotting.clear();
        }
        Step { stopped: stop }
    }

    /// Refreshes the per-tier realization gauges, at most once a second: summing walks every
    /// node's span.
    fn sum_realization(&mut self) {
        const EVERY: std::time::Duration = std::time::Duration::from_secs(1);
        if !self.realization.dirty
            || self
                .realization_summed
                .is_some_and(|t| self.now.duration_since(t) < EVERY)
        {
            return;
        }
        self.realization_summed = Some(self.now);
        // The same walk as the full table: kept for the console's board.
        let rows = self.realization.table(&self.graph, None);
        self.realization.dirty = false;
        let tiers = realization::Realization::tiers(&rows)
            .into_iter()
            .map(|(t, c)| (t, (c.desired, c.realized, c.failed)))
            .collect();
        self.metrics.set_realization(tiers);
        self.keep_table(rows);
    }

    /// Drops the hit counters of what left the datastore, at most once a minute and only after
    /// a datastore batch or a departure: it walks every counter.
    fn prune_hits(&mut self) {
        const EVERY: std::time::Duration = std::time::Duration::from_secs(60);
        if !self.hits_prune_due
            || !self.graph.in_sync()
            || self
                .hits_pruned
                .is_some_and(|t| self.now.duration_since(t) < EVERY)
        {
            return;
        }
        self.hits_prune_due = false;
        self.hits_pruned = Some(self.now);
        let conns = &self.conns;
        self.hits.prune(&self.graph, |n| conns.contains_key(n));
        self.metrics
            .rule_stats_entries
            .set(self.hits.entries() as i64);
        self.hit_series_dirty = true;
    }

    /// Hands a copy of the hit counters to the writer when they changed, at most once per save
    /// interval, and in the step that shuts down (`stopping`).
    fn save_hits(&mut self, stopping: bool) {
        let Some(save) = &mut self.hits_save else {
            return;
        };
        save.due |= self.hits.take_changed();
        if !save.due
            || !save.restored
            || (!stopping
                && save
                    .last
                    .is_some_and(|t| self.now.duration_since(t) < save.every))
        {
            return;
        }
        save.due = false;
        save.last = Some(self.now);
        // Nodes whose read failed are asked again, at most once per save.
        if let Some(reload) = &save.reload {
            for ask in self.hits.take_reasks() {
                let _ = reload.send(ask);
            }
        }
        // The writer may be gone (shutting down): nothing to do then.
        let _ = save.tx.send(Some(SaveCopy {
            doc: Arc::new(self.hits.saved()),
            skip: self.hits.unverified(),
        }));
    }

    /// Publishes the per-policy hit totals to the metrics, at most once a second and only
    /// when something changed: it walks every policy observed.
    fn publish_hit_series(&mut self) {
        const EVERY: std::time::Duration = std::time::Duration::from_secs(1);
        if !self.hit_series_dirty
            || self
                .hit_series_published
                .is_some_and(|t| self.now.duration_since(t) < EVERY)
        {
            return;
        }
        self.hit_series_dirty = false;
        self.hit_series_published = Some(self.now);
        self.metrics.set_policy_hits(self.hits.series(&self.graph));
    }

    /// The hit counters' owner of a realization row.
    fn owner_of(r: &PolicyRealization) -> hits::Owner {
        if r.kind == "Profile" {
            hits::Owner::Profile(r.policy.clone())
        } else {
            let (namespace, name) = r.policy.split_once('/').unwrap_or(("", &r.policy));
            hits::Owner::Policy {
                kind: r.kind.clone(),
                namespace: namespace.to_string(),
                name: name.to_string(),
            }
        }
    }

    /// The policies' and profiles' hit counts, on realization rows (a staged policy has no
    /// rules in any dataplane: its counts come from the flows' pending traces, with flow logs
    /// on, else none); with `per_rule` (a single policy's answer), its
    /// rules with theirs.
    fn with_hits(&self, rows: &mut [PolicyRealization], per_rule: bool) {
        for r in rows {
            let staged = r.phase == "Staged";
            let owner = Self::owner_of(r);
            if per_rule {
                r.rules = Some(self.hits.rules(&self.graph, &owner, staged));
            }
            if staged {
                // From the flows' pending traces, when flow logs are on.
                if let (
                    Some(flows),
                    hits::Owner::Policy {
                        kind,
                        namespace,
                        name,
                    },
                ) = (&self.flows, &owner)
                {
                    let t = flows.staged_hits(kind, namespace, name);
                    r.hits = Some(t.packets);
                    r.bytes = Some(t.bytes);
                    r.last_hit = (t.last > 0).then(|| {
                        common::rfc3339_utc(
                            std::time::UNIX_EPOCH + std::time::Duration::from_secs(t.last as u64),
                        )
                    });
                }
                continue;
            }
            let t = self.hits.totals(&owner);
            r.hits = Some(t.packets);
            r.bytes = Some(t.bytes);
            r.last_hit = t.last.map(common::rfc3339_utc);
        }
    }

    /// Every policy (staged ones included) in evaluation order across tiers (Felix's
    /// `TierLess`, then `PolKVLess`: [`calc_graph::policy_resolver::cmp_policies`]), with its
    /// selector as explain shows it.
    fn policy_order(&self) -> Vec<OrderedPolicy> {
        use calc_graph::policy_resolver::{PolicyRef, cmp_policies};
        let view = self.graph.view();
        let mut keyed: Vec<_> = view
            .policies()
            .map(|p| {
                let r = PolicyRef {
                    model: p.model(),
                    sort_string: p.sort_string(),
                };
                (view.tier(&p.model().tier), r, p.key())
            })
            .collect();
        keyed.sort_by(|(ta, a, _), (tb, b, _)| cmp_policies((a, *ta), (b, *tb)));
        keyed
            .into_iter()
            .map(|(tier, r, k)| OrderedPolicy {
                policy: match &k.namespace {
                    Some(ns) => format!("{ns}/{}", k.name),
                    None => k.name.clone(),
                },
                kind: k.kind.as_str().to_string(),
                tier: r.model.tier.clone(),
                tier_order: tier.and_then(|t| t.order),
                order: r.model.order,
                selector: r.model.selector.canonical().to_string(),
            })
            .collect()
    }

    /// Every policy's and profile's realization counts (no lagging nodes, no hits): the last
    /// table computed while nothing that moves the counts has changed since, or (with
    /// `max_age`) one computed at most that long ago while the datastore has not changed;
    /// else a new one.
    fn full_table(&mut self, max_age: Option<std::time::Duration>) -> Vec<PolicyRealization> {
        let (realization, graph) = (self.realization.generation, self.graph_generation);
        if let Some(t) = &self.table_cache
            && t.graph == graph
            && (t.realization == realization
                || max_age.is_some_and(|age| self.now.duration_since(t.at) <= age))
        {
            return t.rows.clone();
        }
        let rows = self.realization.table(&self.graph, None);
        self.keep_table(rows.clone());
        rows
    }

    fn keep_table(&mut self, rows: Vec<PolicyRealization>) {
        self.table_cache = Some(KeptTable {
            realization: self.realization.generation,
            graph: self.graph_generation,
            at: self.now,
            rows,
        });
    }

    /// `/status/unused`: the policies and profiles needed on at least one node (not staged)
    /// among realization `rows`, classified by [`hits::Hits::unused`].
    fn unused_of(
        &self,
        rows: &[PolicyRealization],
        window: Option<std::time::Duration>,
    ) -> Vec<UnusedPolicy> {
        let candidates = rows
            .iter()
            .filter(|r| r.desired > 0 && r.phase != "Staged")
            .map(|r| hits::Candidate {
                owner: Self::owner_of(r),
                policy: r.policy.clone(),
                kind: r.kind.clone(),
                tier: r.tier.clone(),
            })
            .collect();
        self.hits.unused(&self.graph, candidates, self.wall, window)
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
        while self.snapshotting.len() < self.limits.concurrent_snapshots {
            let Some(node) = self.waiting.pop_front() else {
                break;
            };
            if self.conns.contains_key(&node) {
                self.graph.subscribe(&node);
                self.snapshotting.insert(node);
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
        self.realization.disconnected(node);
        self.hits.disconnected(node);
        self.hits_prune_due = true;
        Some(conn)
    }

    fn handle(&mut self, input: Input) -> bool {
        match input {
            Input::Datastore(updates) => self.apply(updates),
            Input::Connect {
                node,
                agent_version,
                conn,
                reply,
            } => {
                let verdict = self.connect(node, &agent_version, conn);
                // The agent may have gone while it waited: nothing to tell then.
                let _ = reply.send(verdict);
            }
            Input::Disconnect { node, id } => {
                if self.conns.get(&node).is_some_and(|c| c.id == id) {
                    self.drop_conn(&node);
                }
            }
            Input::Applied {
                node,
                id,
                applied,
                error,
            } => {
                if self.hits.applied(&node, id, applied, self.wall) {
                    self.hit_series_dirty = true;
                }
                for waited in self
                    .realization
                    .applied(&node, id, applied, error, self.now)
                {
                    self.metrics.endpoint_programmed_seconds.observe(waited);
                }
            }
            Input::Hits { node, id, hits, at } => {
                let graph = &self.graph;
                let action =
                    |o: &hits::Owner, egress, index| hits::rule_action(graph, o, egress, index);
                self.hit_series_dirty = true;
                for (why, n) in self.hits.add(&node, id, hits, at, action) {
                    tracing::debug!(%node, conn = id, reason = why.reason(), hits = n, "dropped rule hits");
                    self.metrics.rule_stats_refused(why.reason(), n);
                }
                self.metrics
                    .rule_stats_entries
                    .set(self.hits.entries() as i64);
            }
            Input::Flows {
                node,
                id,
                batch,
                at,
            } => {
                let n = batch.records.len() as u64;
                self.metrics
                    .flow_records_dropped_by_agents
                    .inc_by(batch.agent_dropped);
                let Some(flows) = &mut self.flows else {
                    self.metrics.flow_reports_refused("not_negotiated", n);
                    return false;
                };
                if self.conns.get(&node).is_none_or(|c| c.id != id) {
                    self.metrics.flow_reports_refused("stale_stream", n);
                    return false;
                }
                let now = unix_seconds(at);
                let waiting = flows.deferred();
                let dropped = flows.add(&self.graph, &node, batch.records, now);
                let refused: u64 = dropped.values().sum();
                let deferred = flows.deferred().saturating_sub(waiting) as u64;
                for (reason, k) in dropped {
                    tracing::debug!(%node, conn = id, reason, records = k, "dropped flow records");
                    self.metrics.flow_reports_refused(reason, k);
                }
                // Those waiting for a pending trace are counted when stored.
                self.metrics.flow_records.inc_by(n - refused - deferred);
                self.metrics.flow_keys.set(flows.store.num_keys() as i64);
            }
            Input::FlowList { request, reply } => {
                let now = unix_seconds(self.wall);
                let answer = self.flows.as_mut().map(|f| f.store.list(&request, now));
                let _ = reply.send(answer);
            }
            Input::FlowHints { request, reply } => {
                let now = unix_seconds(self.wall);
                let answer = self
                    .flows
                    .as_mut()
                    .map(|f| f.store.filter_hints(&request, now));
                let _ = reply.send(answer);
            }
            Input::FlowStats { request, reply } => {
                let now = unix_seconds(self.wall);
                let answer = self
                    .flows
                    .as_mut()
                    .map(|f| f.store.statistics(&request, now));
                let _ = reply.send(answer);
            }
            Input::Realization { only, reply } => {
                let per_rule = only.is_some();
                let mut answer = match only {
                    None => Ok(self.full_table(None)),
                    Some(name) => realization::Realization::find(&self.graph, &name)
                        .map(|t| self.realization.table(&self.graph, Some(&t))),
                };
                if let Ok(rows) = &mut answer {
                    self.with_hits(rows, per_rule);
                }
                let _ = reply.send(answer);
            }
            Input::Unused { window, reply } => {
                let rows = self.full_table(None);
                let _ = reply.send(self.unused_of(&rows, window));
            }
            Input::PolicyBoard { reply } => {
                let mut rows = self.full_table(Some(BOARD_TABLE_AGE));
                let unused = self.unused_of(&rows, None);
                self.with_hits(&mut rows, false);
                let _ = reply.send(PolicyBoard {
                    rows,
                    unused,
                    order: self.policy_order(),
                });
            }
            Input::Recommend { question, reply } => {
                let span = tracing::debug_span!("recommend", check = question.check);
                let _enter = span.enter();
                let now = unix_seconds(self.wall);
                let graph = &self.graph;
                let answer = self
                    .flows
                    .as_mut()
                    .map(|f| recommend::gather(graph, &mut f.store, &question, now));
                let _ = reply.send(answer);
            }
            Input::Verdicts { reply } => {
                let _ = reply.send(self.hits.verdicts());
            }
            Input::Explain { request, reply } => {
                let span = tracing::debug_span!("explain");
                let _enter = span.enter();
                // The asker may have given up: nothing to tell then.
                let _ = reply.send(self.graph.answer(&request));
            }
            Input::NodeHits { node, conn, counts } => {
                let skipped = self.hits.reloaded(&node, conn, counts);
                if skipped > 0 {
                    tracing::warn!(%node, skipped, "stored policy hit counters with invalid names were skipped");
                }
                if let Some(save) = &mut self.hits_save {
                    save.due = true;
                }
                self.hit_series_dirty = true;
                self.metrics
                    .rule_stats_entries
                    .set(self.hits.entries() as i64);
            }
            Input::RestoreHits(saved) => {
                let skipped = self.restore_hits(saved);
                if skipped > 0 {
                    tracing::warn!(
                        skipped,
                        "saved policy hit counters with invalid names were skipped"
                    );
                }
            }
            Input::Shutdown => return true,
        }
        false
    }

    fn apply(&mut self, updates: Vec<Update>) {
        self.datastore_changed = true;
        self.graph_generation += 1;
        if let Some(flows) = &mut self.flows {
            flows.graph_changed();
        }
        self.hits_prune_due = true;
        // A policy's tier or rules' actions may have changed.
        self.hit_series_dirty = true;
        let span = tracing::debug_span!("datastore_batch", updates = updates.len());
        let _enter = span.enter();
        self.metrics.updates_processed.inc_by(updates.len() as u64);
        let felix_config = updates.iter().any(|u| {
            let kind = match u {
                Update::Apply(r) => Some(r.kind()),
                Update::ApplyValid(v) => Some(v.resource().kind()),
                Update::Delete(key) => Some(key.kind),
                Update::InSync => None,
            };
            kind == Some(calc_graph::model::Kind::FelixConfiguration)
        });
        for u in updates {
            if matches!(u, Update::InSync) {
                self.metrics.datastore_syncs.inc();
            }
            if let Err(rejection) = self.graph.apply(u) {
                self.metrics.rejections.count(rejection.stage());
                tracing::warn!(error = %rejection, "rejected datastore object; the last good version stays");
            }
        }
        if felix_config {
            let nodes: Vec<String> = self.conns.keys().cloned().collect();
            for node in nodes {
                self.hits
                    .set_counting(&node, self.counts_hits_on(&node), self.wall);
            }
        }
    }

    /// Whether `node`'s agent reads its rule counters, by the FeatureGates it is sent (a value
    /// the agent refuses leaves its default, on).
    fn counts_hits_on(&self, node: &str) -> bool {
        let gates = self
            .graph
            .felix_setting(node, calico_names::felix_config::FEATURE_GATES);
        calico_names::felix_config::hit_counters_enabled(gates).unwrap_or(true)
    }

    fn connect(&mut self, node: String, agent_version: &str, conn: Conn) -> Result<(), Refusal> {
        if !self.limits.allow_unknown_nodes
            && self.graph.in_sync()
            && !self.graph.is_known_node(&node)
        {
            tracing::warn!(
                %node,
                conn = conn.id,
                "refused an agent: the node is not in the datastore (no Node resource \
                 and no endpoints); check the agent's --node against the Node names, \
                 or start the server with --allow-unknown-nodes"
            );
            self.metrics.refused_unknown_nodes.inc();
            return Err(Refusal::UnknownNode { node });
        }
        if let Some(old) = self.conns.remove(&node) {
            tracing::info!(%node, old = old.id, new = conn.id, "a newer connection replaces the node's stream");
            old.close(CloseReason::Replaced { node: node.clone() });
        }
        // The snapshot starts when there is room (admit); until then nothing is sent.
        self.graph.unsubscribe(&node);
        self.snapshotting.remove(&node);
        self.waiting.retain(|n| n != &node);
        self.waiting.push_back(node.clone());
        self.board
            .connected(&node, conn.id, agent_version, conn.reports_applied);
        self.realization
            .connected(&node, conn.id, conn.reports_applied);
        self.hits.connected(&node, conn.id, conn.reports_stats);
        self.hits
            .set_counting(&node, self.counts_hits_on(&node), self.wall);
        if conn.reports_stats
            && let Some(save) = self.hits_save.as_mut()
            && let Some(reload) = &save.reload
            && reload.send((node.clone(), conn.id)).is_ok()
        {
            self.hits.reload_started(&node, conn.id);
        }
        self.metrics
            .agent_connected(&node, conn.id, conn.queued.clone(), conn.taken.clone());
        self.conns.insert(node, conn);
        Ok(())
    }

    fn flush(&mut self) {
        let mut batches = Vec::new();
        self.graph.flush_with(|batch| batches.push(batch));
        // Which messages more than one batch of this step carries: only those are worth one
        // shared encoding; a message for one node is encoded by its stream, as before, and
        // costs no extra allocation. Every message stays alive in `batches` (or in the cache)
        // until it is queued or its batch dropped, and none is created after this point, so
        // an address names one message for the whole step.
        // Keyed by address, once per message of every batch: a fast hash, not SipHash.
        let mut carried: rustc_hash::FxHashMap<usize, u32> = rustc_hash::FxHashMap::default();
        for batch in &batches {
            let run = block_run(batch);
            for (_, m) in (0..).zip(&batch.messages).filter(|(i, _)| !run.contains(i)) {
                *carried.entry(m.addr()).or_default() += 1;
            }
        }
        // Kept across steps only while snapshots are admitted (see `step`).
        let mut cache = std::mem::take(&mut self.snapshot_cache);
        cache.at(self.graph_generation);
        let limit = self.limits.backlog;
        let mut overflowed = Vec::new();
        for batch in batches {
            let Some(conn) = self.conns.get(&batch.node) else {
                continue;
            };
            let bytes_limit = self.bytes_limit(conn);
            let Some(conn) = self.conns.get_mut(&batch.node) else {
                continue;
            };
            let n = batch.messages.len() as u64;
            // Taken apart by value: a message's holders tell the cache whether it is shared.
            let run = block_run(&batch);
            let mut head = batch.messages;
            let tail = head.split_off(run.end);
            let block = head.split_off(run.start);
            let mut outs: Vec<Out> = Vec::with_capacity(head.len() + 1 + tail.len());
            let single = |cache: &mut SnapshotCache, m: SharedMessage| {
                let n = carried.get(&m.addr()).copied().unwrap_or(1);
                cache.outbound(m, n)
            };
            outs.extend(head.into_iter().map(|m| single(&mut cache, m)));
            if !block.is_empty() {
                outs.push(cache.block(block));
            }
            outs.extend(tail.into_iter().map(|m| single(&mut cache, m)));
            let bytes: u64 = outs.iter().map(Out::len).sum();
            let (backlog, backlog_bytes) = (conn.backlog(), conn.backlog_bytes());
            // An empty queue always takes the batch: a snapshot larger than the limits must
            // still be deliverable.
            if backlog > 0 && (backlog + n > limit || backlog_bytes + bytes > bytes_limit) {
                overflowed.push((batch.node.clone(), backlog, backlog_bytes, bytes_limit));
                continue;
            }
            let queued = conn.queued.fetch_add(n, Ordering::Relaxed) + n;
            conn.queued_bytes += bytes;
            self.metrics.messages_sent.inc_by(n);
            // The node's first batch after it was admitted is its snapshot.
            let snapshot = conn.snapshot_end.is_none() && self.snapshotting.contains(&batch.node);
            if snapshot {
                conn.snapshot_end = Some(queued);
                conn.snapshot_bytes = Some(bytes);
            }
            // The ServerHello is sequence number 1; queued message k (from 1) is k + 1.
            self.realization.queued(
                &batch.node,
                queued - n + 2,
                outs.iter().flat_map(Out::messages).map(inspected),
                snapshot,
                self.now,
            );
            self.hits.queued(
                &batch.node,
                queued - n + 2,
                outs.iter().flat_map(Out::messages).map(inspected),
            );
            self.board.sent(&batch.node, n);
            for out in outs {
                let _ = conn.tx.send(out);
            }
        }
        self.snapshot_cache = cache;
        for (node, backlog, backlog_bytes, bytes_limit) in overflowed {
            if let Some(conn) = self.drop_conn(&node) {
                tracing::warn!(%node, backlog, backlog_bytes, limit, bytes_limit, "agent fell too far behind; closing its stream so it resyncs");
                conn.close(CloseReason::TooFarBehind {
                    node,
                    limit,
                    bytes_limit,
                });
            }
        }
    }
}

/// Where a batch holds messages queued as one [`Block`]: the whole broadcast state of a fresh
/// node, when it is more than one message (empty otherwise).
fn block_run(batch: &calc_graph::graph::NodeBatch) -> std::ops::Range<usize> {
    batch
        .whole_broadcast
        .clone()
        .filter(|r| r.len() > 1 && r.end <= batch.messages.len())
        .unwrap_or(0..0)
}

/// Seconds since the Unix epoch (zero before it).
fn unix_seconds(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}
