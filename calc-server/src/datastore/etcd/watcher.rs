//! The etcd IO: list at one revision (paginated), watch from the next revision, and re-list
//! whenever the watch cannot be trusted to continue.
//!
//! ```text
//! connect ─► list @R (pages of --etcd-page-size, all at revision R) ─► mirror: mark & sweep
//!    ▲          │ first time: default-allow profile + every object, then InSync
//!    │          ▼
//!    │       watch from R+1 (prev_kv) ─► events ─► mirror ─► updates
//!    │          │ compacted / cancelled / new cluster ID / anti-entropy timer ─► list again
//!    └──────────┘ error or stream end (etcd down, restarted) ─► back off (jittered) ─► connect
//! ```
//!
//! Every re-list is reconciled by the [`Mirror`]: deletes that happened meanwhile become
//! `Delete`, changed objects `Apply`, unchanged ones nothing, so a resync costs the agents
//! nothing when nothing changed. The watch is never resumed across a re-list or a reconnect, so
//! a changed cluster ID (etcd restored or replaced) can only lead to a full re-list.
//!
//! Last good versions come from etcd's history, not from a store of our own: a key whose
//! current value is rejected and whose last good version the mirror does not hold (the server
//! just started, or another replica took over) is read again at older revisions, newest first,
//! back to its creation, until a valid version is found, etcd says the revision was compacted,
//! or [`MAX_HISTORY_STEPS`] versions were tried. Every replica reads the same history, so all
//! agree on the version in force. Keys left without one are reported on `/metrics`,
//! `/status/datastore` and `/readiness` (degraded) and logged as errors by key.
//!
//! Decoding (JSON parsing and validation) runs off the async workers (`block_in_place`), so a
//! page of large values delays no agent's stream.

use std::time::Duration;

use anyhow::Context;
use calc_graph::graph::Update;
use common::Tasks;
use etcd_client::{Client, EventType, GetOptions, KeyValue, KvClient, WatchOptions};
use tokio::sync::mpsc;
use tokio::time::Instant;

use calc_ingest::etcd::{self as ingest, Mirror};
use calc_ingest::{Batch, Decision, Problem, default_allow_profile};

use common::Backoff;

use super::{RESOURCE_PREFIX, connect};
use crate::args::EtcdArgs;
use crate::datastore::{Health, Sink, off_runtime};

/// How long one range request may take before the connection is considered lost.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Most earlier versions of one rejected key read while looking for its last good version.
pub const MAX_HISTORY_STEPS: usize = 32;

/// Largest response accepted from etcd (gRPC's default is 4 MiB: one page of large values or
/// the watch response of a large transaction exceeds it). A page that is still too large is
/// retried with half as many keys.
pub const MAX_RESPONSE_BYTES: usize = 256 * 1024 * 1024;

/// A KV client that accepts large responses.
pub fn kv_client(client: &Client) -> KvClient {
    client
        .kv_client()
        .max_decoding_message_size(MAX_RESPONSE_BYTES)
}

fn too_large(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::ResourceExhausted || s.message().contains("too large"))
}

/// The end of the range that holds every key starting with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

#[derive(Debug)]
enum ListError {
    /// The revision being listed was compacted meanwhile; start again at a new one.
    Compacted,
    /// The pages came from different clusters; start again.
    ClusterChanged,
    Other(anyhow::Error),
}

impl std::fmt::Display for ListError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListError::Compacted => f.write_str("the listed revision was compacted"),
            ListError::ClusterChanged => f.write_str("the etcd cluster ID changed while listing"),
            ListError::Other(e) => write!(f, "{e:#}"),
        }
    }
}

fn is_compacted(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == tonic::Code::OutOfRange || s.message().contains("compacted")
        }
        _ => false,
    }
}

/// A paginated range read of one prefix at one revision.
pub struct Lister {
    next_key: Vec<u8>,
    end: Vec<u8>,
    page_size: i64,
    /// The revision every page is read at (from the first page's header).
    pub revision: i64,
    pub cluster_id: u64,
    /// How many keys the whole list holds (from the first page: etcd counts the range).
    pub total: i64,
    done: bool,
}

impl Lister {
    pub fn new(prefix: &str, page_size: i64) -> Lister {
        Lister {
            next_key: prefix.as_bytes().to_vec(),
            end: prefix_end(prefix.as_bytes()),
            page_size: page_size.max(1),
            revision: 0,
            total: 0,
            cluster_id: 0,
            done: false,
        }
    }

    /// The next page, or `None` when the range is exhausted.
    async fn next_page(&mut self, kv: &mut KvClient) -> Result<Option<Vec<KeyValue>>, ListError> {
        if self.done {
            return Ok(None);
        }
        let mut resp = loop {
            let mut opts = GetOptions::new()
                .with_range(self.end.clone())
                .with_limit(self.page_size);
            if self.revision > 0 {
                opts = opts.with_revision(self.revision);
            }
            let resp =
                tokio::time::timeout(REQUEST_TIMEOUT, kv.get(self.next_key.clone(), Some(opts)))
                    .await
                    .map_err(|_| {
                        ListError::Other(anyhow::anyhow!("etcd range request timed out"))
                    })?;
            match resp {
                Ok(r) => break r,
                Err(e) if self.revision > 0 && is_compacted(&e) => {
                    return Err(ListError::Compacted);
                }
                Err(e) if too_large(&e) && self.page_size > 1 => {
                    self.page_size = (self.page_size / 2).max(1);
                    tracing::info!(
                        page_size = self.page_size,
                        "etcd page too large; halving the page size"
                    );
                }
                Err(e) => {
                    return Err(ListError::Other(
                        anyhow::Error::new(e).context("etcd range"),
                    ));
                }
            }
        };
        let header = resp.take_header().ok_or_else(|| {
            ListError::Other(anyhow::anyhow!("etcd range response without header"))
        })?;
        if self.revision == 0 {
            self.revision = header.revision();
            self.cluster_id = header.cluster_id();
            self.total = resp.count();
        } else if header.cluster_id() != self.cluster_id {
            return Err(ListError::ClusterChanged);
        }
        let more = resp.more();
        let kvs = resp.take_kvs();
        match kvs.last() {
            Some(last) if more => {
                let mut k = last.key().to_vec();
                k.push(0);
                self.next_key = k;
            }
            _ => self.done = true,
        }
        Ok(Some(kvs))
    }
}

/// One page of a list, with the revision and cluster it was read from.
struct Page {
    kvs: Vec<KeyValue>,
    revision: i64,
    cluster_id: u64,
    /// Keys in the whole list.
    total: i64,
}

/// What the page fetcher sends: a page, the end of the list, or why it stopped.
type PageResult = Result<Option<Page>, ListError>;

/// Fetches the pages of one list in a task of its own (span `etcd_list`, under the caller's),
/// a page ahead of the consumer, so reading etcd overlaps with decoding (and, when serving,
/// with the graph applying).
fn prefetch(mut lister: Lister, mut kv: KvClient, tasks: &Tasks) -> mpsc::Receiver<PageResult> {
    let (tx, rx) = mpsc::channel(1);
    tasks.spawn(tracing::info_span!("etcd_list"), async move {
        loop {
            let result = lister.next_page(&mut kv).await;
            let last = !matches!(result, Ok(Some(_)));
            let msg = result.map(|page| {
                page.map(|kvs| Page {
                    kvs,
                    revision: lister.revision,
                    cluster_id: lister.cluster_id,
                    total: lister.total,
                })
            });
            if tx.send(msg).await.is_err() || last {
                return;
            }
        }
    });
    rx
}

/// The next message of a prefetching list.
async fn next_page(rx: &mut mpsc::Receiver<PageResult>) -> PageResult {
    rx.recv().await.unwrap_or_else(|| {
        Err(ListError::Other(anyhow::anyhow!(
            "the etcd list task stopped"
        )))
    })
}

/// Lists every graph resource once (for `compute`): the default-allow profile and every valid
/// object as `Apply`, then `InSync`; rejected keys with their reasons.
pub async fn snapshot(args: &EtcdArgs) -> anyhow::Result<(Vec<Update>, Vec<Problem>)> {
    let client = connect(args).await?;
    // A one-shot read on its own runtime: its list tasks need no shared tracker.
    let tasks = Tasks::new();
    let started = std::time::Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut mirror = Mirror::new();
        let mut out = Batch::default();
        out.updates
            .push(Update::ApplyValid(default_allow_profile()));
        let mut pages = prefetch(
            Lister::new(RESOURCE_PREFIX, args.etcd_page_size),
            kv_client(&client),
            &tasks,
        );
        mirror.begin_list(());
        let mut revision = 0;
        let result = loop {
            match next_page(&mut pages).await {
                Ok(Some(page)) => {
                    revision = page.revision;
                    // An update per key at most: one allocation, not a doubling copy of
                    // updates of half a kilobyte each as they arrive. The count is etcd's
                    // word: bounded (a quarter of a million keys, ~150 MB), beyond which the
                    // vector grows as it must.
                    let want = usize::try_from(page.total).unwrap_or(0).min(1 << 18) + 2;
                    if out.updates.capacity() < want {
                        out.updates.reserve(want - out.updates.len());
                    }
                    let orphans = put_page(&mut mirror, &page.kvs, &mut out);
                    recover(&mut mirror, &mut kv_client(&client), orphans, &mut out).await;
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        match result {
            Ok(()) => {
                out.updates.push(Update::InSync);
                tracing::info!(
                    revision,
                    objects = mirror.len(),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "etcd snapshot read"
                );
                return Ok((out.updates, out.problems));
            }
            Err(ListError::Compacted | ListError::ClusterChanged) if attempts < 5 => continue,
            Err(e) => {
                return Err(anyhow::anyhow!("{e}")).with_context(|| {
                    format!(
                        "reading {RESOURCE_PREFIX} from etcd at {}",
                        args.etcd_endpoints.join(",")
                    )
                });
            }
        }
    }
}

/// A rejected key with no last good version in the mirror, and where its history lies.
struct Orphan {
    key: String,
    /// The rejected value's revision.
    mod_revision: i64,
    /// Where the key's current incarnation starts: older versions belong to a deleted object.
    create_revision: i64,
}

/// Puts every key of a page (or a watch response) into the mirror, decoding off the async
/// workers (a page's changed values on every core); returns the rejected keys without a last
/// good version.
fn put_page<'a>(
    mirror: &mut Mirror,
    items: impl IntoIterator<Item = &'a KeyValue>,
    out: &mut Batch,
) -> Vec<Orphan> {
    let mut kvs: Vec<&KeyValue> = Vec::new();
    let mut pairs: Vec<(&str, &[u8])> = Vec::new();
    for item in items {
        let Ok(key) = item.key_str() else {
            tracing::debug!(key = ?String::from_utf8_lossy(item.key()), "skipping a key that is not UTF-8");
            continue;
        };
        kvs.push(item);
        pairs.push((key, item.value()));
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    off_runtime(|| {
        let mut orphans = Vec::new();
        let mut before = out.problems.len();
        ingest::put_many(mirror, &pairs, threads, out, |i, out| {
            if out.problems[before..].iter().any(|p| !p.held) {
                orphans.push(Orphan {
                    key: pairs[i].0.to_owned(),
                    mod_revision: kvs[i].mod_revision(),
                    create_revision: kvs[i].create_revision(),
                });
            }
            before = out.problems.len();
        });
        orphans
    })
}

/// What etcd's history holds for a rejected key.
enum History {
    /// A valid earlier version, at this revision.
    Found(i64, Vec<u8>),
    /// None; why.
    Nothing(String),
}

/// Reads `orphan`'s earlier versions, newest first, for the last valid one (see the module
/// documentation).
async fn last_good_in_history(kv: &mut KvClient, orphan: &Orphan) -> History {
    let mut revision = orphan.mod_revision - 1;
    for _ in 0..MAX_HISTORY_STEPS {
        if revision < orphan.create_revision.max(1) {
            return History::Nothing("no earlier version in etcd's history".into());
        }
        let opts = GetOptions::new().with_revision(revision);
        let resp = tokio::time::timeout(REQUEST_TIMEOUT, kv.get(orphan.key.as_str(), Some(opts)));
        let mut resp = match resp.await {
            Err(_) => return History::Nothing("reading etcd's history timed out".into()),
            Ok(Err(e)) if is_compacted(&e) => {
                return History::Nothing(format!(
                    "etcd's history before revision {} is compacted",
                    revision + 1
                ));
            }
            Ok(Err(e)) => return History::Nothing(format!("reading etcd's history: {e}")),
            Ok(Ok(r)) => r,
        };
        let Some(item) = resp.take_kvs().into_iter().next() else {
            return History::Nothing("no earlier version in etcd's history".into());
        };
        if matches!(
            off_runtime(|| ingest::decode(&orphan.key, item.value())),
            Decision::Apply { .. }
        ) {
            return History::Found(item.mod_revision(), item.value().to_vec());
        }
        revision = item.mod_revision() - 1;
    }
    History::Nothing(format!(
        "none of its last {MAX_HISTORY_STEPS} versions in etcd's history is valid"
    ))
}

/// Finds the last good version of each orphan in etcd's history and puts it in force; each
/// orphan's problem says what was found.
async fn recover(mirror: &mut Mirror, kv: &mut KvClient, orphans: Vec<Orphan>, out: &mut Batch) {
    for orphan in orphans {
        let outcome = match last_good_in_history(kv, &orphan).await {
            History::Found(revision, value) => {
                if off_runtime(|| ingest::adopt_last_good(mirror, &orphan.key, &value, out)) {
                    Ok(revision)
                } else {
                    Err("its earlier version could not be used".to_owned())
                }
            }
            History::Nothing(why) => Err(why),
        };
        for p in out.problems.iter_mut().filter(|p| p.key == orphan.key) {
            match &outcome {
                Ok(revision) => {
                    p.held = true;
                    p.reason = format!(
                        "{}; its last good version (etcd revision {revision}) stays in force",
                        p.reason
                    );
                }
                Err(why) => {
                    p.reason = format!("{}; no last good version ({why}): not in force", p.reason);
                }
            }
        }
    }
}

/// The serving watcher's settings.
pub struct WatchConfig {
    pub args: EtcdArgs,
    pub resync_interval: Duration,
    pub min_backoff: Duration,
    pub max_backoff: Duration,
}

/// Why a watch session ended.
enum End {
    /// The engine is gone: stop.
    EngineGone,
    /// Re-list now (compaction, cancelled watch, new cluster, anti-entropy, owner conflict).
    Relist(&'static str),
    /// Connection-level failure: back off, reconnect, re-list.
    Failed(anyhow::Error),
}

pub struct Watcher {
    cfg: WatchConfig,
    mirror: Mirror,
    out: Sink,
    /// Whether the first complete snapshot (and InSync) has been delivered.
    synced: bool,
    cluster_id: Option<u64>,
    /// Rejected values (counter) and unusable keys (gauges, readiness).
    health: Health,
    /// Where the list prefetch tasks are spawned.
    tasks: Tasks,
}

impl Watcher {
    pub fn new(cfg: WatchConfig, out: Sink, health: Health, tasks: Tasks) -> Watcher {
        Watcher {
            cfg,
            mirror: Mirror::new(),
            out,
            synced: false,
            cluster_id: None,
            health,
            tasks,
        }
    }

    /// Runs until the receiver of the updates goes away.
    pub async fn run(mut self) {
        let mut backoff = Backoff::new(self.cfg.min_backoff, self.cfg.max_backoff);
        let endpoints = self.cfg.args.etcd_endpoints.join(",");
        loop {
            let client = match connect(&self.cfg.args).await {
                Ok(c) => c,
                Err(error) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(error = %format!("{error:#}"), retry_in = ?delay, "etcd: cannot connect");
                    tokio::time::sleep(delay).await;
                    continue;
                }
            };
            match self.session(&client, &mut backoff).await {
                End::EngineGone => return,
                // Sessions handle re-lists themselves.
                End::Relist(_) => {}
                End::Failed(error) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(%endpoints, error = %format!("{error:#}"), retry_in = ?delay, "etcd connection lost; will reconnect and resync");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// List, watch, re-list … on one client until something fails.
    async fn session(&mut self, client: &Client, backoff: &mut Backoff) -> End {
        let mut reason = if self.synced {
            "reconnected"
        } else {
            "initial sync"
        };
        loop {
            let revision = match self.list(client, reason).await {
                Ok(r) => r,
                Err(end) => return end,
            };
            match self.watch(client, revision, backoff).await {
                End::Relist(why) => reason = why,
                end => return end,
            }
        }
    }

    /// A full list at one revision, reconciled into the mirror; returns the revision.
    async fn list(&mut self, client: &Client, reason: &str) -> Result<i64, End> {
        let started = std::time::Instant::now();
        let mut attempts = 0;
        'again: loop {
            attempts += 1;
            let first = !self.synced;
            let mut pages = prefetch(
                Lister::new(RESOURCE_PREFIX, self.cfg.args.etcd_page_size),
                kv_client(client),
                &self.tasks,
            );
            let mut revision = 0;
            self.mirror.begin_list(());
            let mut changes = 0usize;
            let mut out = Batch::default();
            if first {
                out.updates
                    .push(Update::ApplyValid(default_allow_profile()));
            }
            loop {
                let page = match next_page(&mut pages).await {
                    Ok(Some(p)) => p,
                    Ok(None) => break,
                    Err(ListError::Compacted | ListError::ClusterChanged) if attempts < 5 => {
                        // Whatever was sent stays valid (it is real data at a real revision);
                        // the next attempt reconciles the rest.
                        continue 'again;
                    }
                    Err(e) => return Err(End::Failed(anyhow::anyhow!("{e}"))),
                };
                if let Some(old) = self.cluster_id.filter(|c| *c != page.cluster_id) {
                    tracing::warn!(
                        old = format!("{old:x}"),
                        new = format!("{:x}", page.cluster_id),
                        "etcd cluster ID changed: full re-list"
                    );
                }
                self.cluster_id = Some(page.cluster_id);
                revision = page.revision;
                let orphans = put_page(&mut self.mirror, &page.kvs, &mut out);
                recover(&mut self.mirror, &mut kv_client(client), orphans, &mut out).await;
                self.report(&mut out.problems);
                // Pipeline: the engine applies this page while the next one is fetched.
                changes += out.updates.len();
                if !out.updates.is_empty() && self.send(std::mem::take(&mut out.updates)).await {
                    return Err(End::EngineGone);
                }
            }
            self.mirror.sweep((), &mut out);
            self.report(&mut out.problems);
            if !self.synced {
                out.updates.push(Update::InSync);
                self.synced = true;
            } else {
                changes += out.updates.len();
            }
            if !out.updates.is_empty() && self.send(out.updates).await {
                return Err(End::EngineGone);
            }
            tracing::info!(
                reason,
                revision,
                objects = self.mirror.len(),
                changes,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "etcd listed"
            );
            return Ok(revision);
        }
    }

    /// Watches from `revision + 1` until the watch must be replaced by a re-list. The back-off
    /// is reset once the watch answers, so a server that lists but cannot watch is not
    /// re-listed in a tight loop.
    async fn watch(&mut self, client: &Client, revision: i64, backoff: &mut Backoff) -> End {
        let mut wc = client
            .watch_client()
            .max_decoding_message_size(MAX_RESPONSE_BYTES);
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1)
            .with_prev_key();
        let mut stream = match wc.watch(RESOURCE_PREFIX, Some(opts)).await {
            Ok(s) => s,
            Err(e) => return End::Failed(anyhow::Error::new(e).context("starting the etcd watch")),
        };
        let resync_at = Instant::now() + self.cfg.resync_interval;
        loop {
            if !self.mirror.take_relists().is_empty() {
                return End::Relist("restoring a resource another key still names");
            }
            let msg = tokio::select! {
                m = stream.message() => m,
                () = tokio::time::sleep_until(resync_at) => return End::Relist("anti-entropy"),
            };
            let resp = match msg {
                Ok(Some(r)) => {
                    backoff.reset();
                    r
                }
                Ok(None) => return End::Failed(anyhow::anyhow!("etcd closed the watch stream")),
                Err(e) => return End::Failed(anyhow::Error::new(e).context("etcd watch")),
            };
            if let Some(h) = resp.header()
                && Some(h.cluster_id()) != self.cluster_id
                && h.cluster_id() != 0
            {
                tracing::warn!(
                    new = format!("{:x}", h.cluster_id()),
                    "etcd cluster ID changed under the watch: full re-list"
                );
                return End::Relist("cluster ID changed");
            }
            if resp.compact_revision() != 0 {
                tracing::info!(
                    compact_revision = resp.compact_revision(),
                    watched_from = revision + 1,
                    "etcd watch fell behind a compaction: re-listing"
                );
                return End::Relist("compacted");
            }
            if resp.canceled() {
                tracing::warn!(
                    reason = resp.cancel_reason(),
                    "etcd cancelled the watch: re-listing"
                );
                return End::Relist("watch cancelled");
            }
            let mut out = Batch::default();
            let mut orphans = Vec::new();
            for ev in resp.events() {
                let Some(item) = ev.kv() else { continue };
                match ev.event_type() {
                    EventType::Put => {
                        orphans.extend(put_page(&mut self.mirror, [item], &mut out));
                    }
                    EventType::Delete => match item.key_str() {
                        Ok(key) => self.mirror.delete(key, &mut out),
                        Err(_) => continue,
                    },
                }
            }
            // A key deleted later in the same response is no longer an orphan.
            orphans.retain(|o| self.mirror.is_rejected_without_last_good(o.key.as_str()));
            recover(&mut self.mirror, &mut kv_client(client), orphans, &mut out).await;
            self.report(&mut out.problems);
            if !out.updates.is_empty() {
                tracing::debug!(changes = out.updates.len(), "etcd watch events");
                if self.send(out.updates).await {
                    return End::EngineGone;
                }
            }
        }
    }

    /// Sends a batch; `true` if the receiver is gone.
    async fn send(&self, updates: Vec<Update>) -> bool {
        self.out.send(updates).await.is_err()
    }

    /// Counts and logs rejected values by key and publishes the keys left unusable.
    fn report(&mut self, problems: &mut Vec<Problem>) {
        for stage in problems.iter().filter_map(|p| p.stage) {
            self.health.rejections.count(stage);
        }
        let rejected_total = self.health.rejections.total();
        for p in problems.drain(..) {
            if p.held {
                tracing::warn!(key = %p.key, reason = %p.reason, rejected_total, "rejected etcd value; its last good version stays in force");
            } else {
                tracing::error!(key = %p.key, reason = %p.reason, rejected_total, "rejected etcd value with no last good version: the object is not in force");
            }
        }
        if let Some((held, without)) = self.mirror.take_unusable() {
            self.health.unusable.publish(held, without);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/calico/"), b"/calico0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
