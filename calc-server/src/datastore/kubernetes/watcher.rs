//! The Kubernetes IO: one kube-runtime watcher per [`Source`], merged into one stream of graph
//! updates.
//!
//! ```text
//! per source:  list (pages, at a resourceVersion) ─► watch from it (bookmarks keep it fresh)
//!                 ▲    410 Gone / stream ended ─► list again (Init … InitApply … InitDone)
//!                 └──── errors: jittered exponential back-off (kube-runtime's default)
//! merged:      Init ─► mirror.begin_list(source) · InitApply/Apply ─► put · Delete ─► delete
//!              InitDone ─► mirror.sweep(source) (mark and sweep) · all sources listed ─► InSync
//! ```
//!
//! A Calico CRD that is not installed (404 on list) counts as an empty source, so a cluster
//! without, say, HostEndpoints still gets in sync; its watcher keeps retrying and picks the CRD
//! up once it appears. Any other error is logged with its source and retried; in sync waits for
//! every source, because claiming a complete view without one would let agents sweep state.
//! Re-lists reconcile through the [`Mirror`], so a resync sends only what changed.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use crate::args::KubeArgs;
use crate::datastore::{Health, Sink, off_runtime};
use anyhow::Context;
use calc_graph::graph::Update;
use common::Tasks;
use kube::api::{Api, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::Value;
use tokio::sync::{Notify, mpsc};
use tokio_stream::StreamExt;

use calc_ingest::kubernetes::convert::Converter;
use calc_ingest::kubernetes::{self as ingest, Mirror};
use calc_ingest::{Batch, Problem, default_allow_profile};

use super::{Source, api_resource, client};

/// What one source's watcher reports.
#[derive(Debug)]
enum Report {
    /// A (re-)list starts.
    Init,
    /// An object from a list page or a watch event.
    Apply(Value),
    Delete(Value),
    /// The list is complete.
    InitDone,
    /// The collection does not exist (CRD not installed): an empty source.
    Absent,
    /// Something failed; the watcher retries after a back-off. `gone`: the watch expired (410)
    /// and a re-list follows.
    Error {
        message: String,
        gone: bool,
    },
}

fn to_value(obj: DynamicObject) -> Option<Value> {
    serde_json::to_value(obj).ok()
}

/// Runs one source's watcher until the receiver goes away. `relist` restarts it with a fresh
/// list.
async fn watch_source(
    client: kube::Client,
    source: Source,
    tx: mpsc::Sender<(Source, Report)>,
    relist: Arc<Notify>,
) {
    let api: Api<DynamicObject> = Api::all_with(client, &api_resource(source));
    loop {
        let stream = watcher::watcher(api.clone(), watcher::Config::default()).default_backoff();
        let mut stream = std::pin::pin!(stream);
        loop {
            let item = tokio::select! {
                item = stream.next() => item,
                () = relist.notified() => break,
            };
            let report = match item {
                // The watcher never ends on its own; start again if it does.
                None => break,
                Some(Ok(Event::Init)) => Report::Init,
                Some(Ok(Event::InitApply(o) | Event::Apply(o))) => match to_value(o) {
                    Some(v) => Report::Apply(v),
                    None => continue,
                },
                Some(Ok(Event::Delete(o))) => match to_value(o) {
                    Some(v) => Report::Delete(v),
                    None => continue,
                },
                Some(Ok(Event::InitDone)) => Report::InitDone,
                Some(Err(watcher::Error::InitialListFailed(kube::Error::Api(status))))
                    if status.is_not_found() =>
                {
                    Report::Absent
                }
                // Services only name flows' destination services: a cluster role granted
                // before they were read must not keep the server out of sync.
                Some(Err(watcher::Error::InitialListFailed(kube::Error::Api(status))))
                    if source == Source::Service && status.is_forbidden() =>
                {
                    tracing::warn!(%source, "not allowed to list services (grant list and watch on services): flows name no destination service");
                    Report::Absent
                }
                Some(Err(e)) => {
                    let gone = matches!(&e, watcher::Error::WatchError(s) if s.code == 410);
                    Report::Error {
                        message: e.to_string(),
                        gone,
                    }
                }
            };
            if tx.send((source, report)).await.is_err() {
                return;
            }
        }
    }
}

/// The running per-source watchers: their merged reports, each one's re-list trigger, and the
/// tasks (stopped when this is dropped).
struct Sources {
    rx: mpsc::Receiver<(Source, Report)>,
    triggers: HashMap<Source, Arc<Notify>>,
    _tasks: AbortOnDrop,
}

/// Starts every source's watcher (span `watch{source}`, under the caller's).
fn start(client: &kube::Client, tasks: &Tasks) -> Sources {
    let (tx, rx) = mpsc::channel(1024);
    let mut triggers = HashMap::new();
    let mut handles = Vec::new();
    for source in Source::ALL {
        let relist = Arc::new(Notify::new());
        triggers.insert(source, relist.clone());
        handles.push(tasks.spawn(
            tracing::info_span!("watch", %source),
            watch_source(client.clone(), source, tx.clone(), relist),
        ));
    }
    Sources {
        rx,
        triggers,
        _tasks: AbortOnDrop(handles),
    }
}

/// The merged state: the mirror and which sources have completed a list.
struct Merge {
    converter: Converter,
    mirror: Mirror,
    listed: BTreeSet<Source>,
    absent: BTreeSet<Source>,
    in_sync: bool,
}

impl Merge {
    fn new(converter: Converter) -> Merge {
        Merge {
            converter,
            mirror: ingest::new_mirror(),
            listed: BTreeSet::new(),
            absent: BTreeSet::new(),
            in_sync: false,
        }
    }

    /// Applies one report; returns the error message of an `Error` report that is not a 410.
    fn handle(&mut self, source: Source, report: Report, out: &mut Batch) -> Option<String> {
        match report {
            Report::Init => {
                if self.listed.contains(&source) {
                    tracing::info!(%source, "re-listing");
                }
                self.mirror.begin_list(source);
            }
            Report::Apply(v) => ingest::put(&mut self.mirror, &self.converter, source, v, out),
            Report::Delete(v) => ingest::delete(&mut self.mirror, source, &v, out),
            Report::InitDone => {
                self.mirror.sweep(source, out);
                self.listed.insert(source);
                if self.absent.remove(&source) {
                    tracing::info!(%source, "now served: watching it");
                }
            }
            Report::Absent => {
                if self.absent.insert(source) {
                    tracing::info!(%source, "not served by the API server (CRD not installed?): treated as empty until it appears");
                    self.mirror.begin_list(source);
                    self.mirror.sweep(source, out);
                }
                self.listed.insert(source);
            }
            Report::Error { message, gone } => {
                if gone {
                    tracing::info!(%source, error = %message, "watch expired (410 Gone): re-listing");
                    return None;
                }
                tracing::warn!(%source, error = %message, "Kubernetes watch failed; retrying with back-off");
                return Some(message);
            }
        }
        if !self.in_sync && self.listed.len() == Source::ALL.len() {
            self.in_sync = true;
            out.updates.push(Update::InSync);
        }
        None
    }
}

/// Lists every source once (for `compute`): the default-allow profile and every valid object as
/// `Apply`, then `InSync`; rejected objects with their reasons. Fails on the first error other
/// than a missing CRD or an expired watch.
pub async fn snapshot(args: &KubeArgs) -> anyhow::Result<(Vec<Update>, Vec<Problem>)> {
    let client = client(args).await?;
    let started = std::time::Instant::now();
    let converter = Converter {
        interface_prefix: args.interface_prefix(),
    };
    let mut merge = Merge::new(converter);
    // A one-shot read on its own runtime: its watchers need no shared tracker.
    let mut sources = start(&client, &Tasks::new());
    let mut out = Batch::default();
    out.updates
        .push(Update::ApplyValid(default_allow_profile()));
    let result = loop {
        let Some((source, report)) = sources.rx.recv().await else {
            break Err(anyhow::anyhow!("the Kubernetes watchers stopped"));
        };
        if let Some(error) = merge.handle(source, report, &mut out) {
            break Err(anyhow::anyhow!("{error}")).with_context(|| format!("listing {source}"));
        }
        if merge.in_sync {
            break Ok(());
        }
    };
    drop(sources);
    result?;
    tracing::info!(
        objects = merge.mirror.len(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "Kubernetes snapshot read"
    );
    Ok((out.updates, out.problems))
}

/// The serving watcher's settings.
pub struct WatchConfig {
    pub args: KubeArgs,
    /// Re-list every source this often (zero: never).
    pub resync_interval: Duration,
}

/// Watches every source and sends update batches until the receiver goes away.
pub struct Watcher {
    cfg: WatchConfig,
    out: Sink,
    /// Rejected objects (counter) and unusable ones (gauges, readiness).
    health: Health,
    /// Where the per-source watchers are spawned.
    tasks: Tasks,
}

impl Watcher {
    pub fn new(cfg: WatchConfig, out: Sink, health: Health, tasks: Tasks) -> Watcher {
        Watcher {
            cfg,
            out,
            health,
            tasks,
        }
    }

    /// Runs until the receiver of the updates goes away. `client` comes from [`client`].
    pub async fn run(self, client: kube::Client) {
        let converter = Converter {
            interface_prefix: self.cfg.args.interface_prefix(),
        };
        let mut merge = Merge::new(converter);
        // `_tasks` is bound (not `..`) so the watchers live as long as this loop.
        let Sources {
            mut rx,
            triggers,
            _tasks,
        } = start(&client, &self.tasks);
        if self
            .out
            .send(vec![Update::ApplyValid(default_allow_profile())])
            .await
            .is_err()
        {
            return;
        }
        let resync = (!self.cfg.resync_interval.is_zero()).then_some(self.cfg.resync_interval);
        let mut next_resync = resync.map(|d| tokio::time::Instant::now() + d);
        loop {
            let first = tokio::select! {
                m = rx.recv() => m,
                () = sleep_until(next_resync) => {
                    tracing::info!("anti-entropy: re-listing every source");
                    for t in triggers.values() {
                        t.notify_one();
                    }
                    next_resync = resync.map(|d| tokio::time::Instant::now() + d);
                    continue;
                }
            };
            let Some((source, report)) = first else {
                return;
            };
            let mut out = Batch::default();
            // Converting and validating run off the async workers.
            off_runtime(|| {
                merge.handle(source, report, &mut out);
                // Take whatever else is already waiting, so a list page becomes one batch.
                for _ in 0..4096 {
                    match rx.try_recv() {
                        Ok((source, report)) => {
                            merge.handle(source, report, &mut out);
                        }
                        Err(_) => break,
                    }
                }
            });
            for source in merge.mirror.take_relists() {
                if let Some(t) = triggers.get(&source) {
                    t.notify_one();
                }
            }
            for stage in out.problems.iter().filter_map(|p| p.stage) {
                self.health.rejections.count(stage);
            }
            let rejected_total = self.health.rejections.total();
            for p in out.problems.drain(..) {
                if p.held {
                    tracing::warn!(object = %p.key, reason = %p.reason, rejected_total, "Kubernetes object not used as is; its last good version stays in force");
                } else {
                    tracing::error!(object = %p.key, reason = %p.reason, rejected_total, "rejected Kubernetes object with no last good version: the object is not in force");
                }
            }
            if let Some((held, without)) = merge.mirror.take_unusable() {
                self.health.unusable.publish(held, without);
            }
            if !out.updates.is_empty() {
                tracing::debug!(changes = out.updates.len(), "Kubernetes changes");
                if self.out.send(out.updates).await.is_err() {
                    return;
                }
            }
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Stops the per-source watchers when the merged watcher ends.
struct AbortOnDrop(Vec<tokio::task::JoinHandle<Option<()>>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn summary(b: &Batch) -> Vec<String> {
        b.updates
            .iter()
            .map(|u| match u {
                Update::ApplyValid(r) => format!("apply {}", r.key()),
                Update::Apply(r) => format!("apply (not validated) {}", r.key()),
                Update::Delete(k) => format!("delete {k}"),
                Update::InSync => "in-sync".into(),
            })
            .collect()
    }

    #[test]
    fn in_sync_waits_for_every_source_and_absent_crds_count_as_empty() {
        let mut m = Merge::new(Converter::default());
        let mut out = Batch::default();
        let ns = json!({"metadata": {"name": "shop", "resourceVersion": "1"}});
        for (i, source) in Source::ALL.into_iter().enumerate() {
            // Every other source is absent (a CRD or API group not installed), but not the
            // namespaces this test lists one object from.
            if i % 2 == 0 && source != Source::Namespace {
                assert!(m.handle(source, Report::Absent, &mut out).is_none());
            } else {
                m.handle(source, Report::Init, &mut out);
                if source == Source::Namespace {
                    m.handle(source, Report::Apply(ns.clone()), &mut out);
                }
                m.handle(source, Report::InitDone, &mut out);
            }
            let synced = summary(&out).contains(&"in-sync".to_string());
            assert_eq!(synced, i == Source::ALL.len() - 1, "after {source}");
        }
        assert_eq!(summary(&out), ["apply Profile kns.shop", "in-sync"]);
        // A 410 is routine; other errors are reported (compute fails on them).
        let gone = Report::Error {
            message: "expired".into(),
            gone: true,
        };
        assert!(m.handle(Source::Pod, gone, &mut out).is_none());
        let forbidden = Report::Error {
            message: "403".into(),
            gone: false,
        };
        assert_eq!(
            m.handle(Source::Pod, forbidden, &mut out).as_deref(),
            Some("403")
        );
    }

    #[test]
    fn a_relist_after_expiry_sweeps_what_was_missed() {
        let mut m = Merge::new(Converter::default());
        let mut out = Batch::default();
        let ns = |n: &str, rv: &str| json!({"metadata": {"name": n, "resourceVersion": rv}});
        m.handle(Source::Namespace, Report::Init, &mut out);
        m.handle(Source::Namespace, Report::Apply(ns("a", "1")), &mut out);
        m.handle(Source::Namespace, Report::Apply(ns("b", "2")), &mut out);
        m.handle(Source::Namespace, Report::InitDone, &mut out);
        let mut out = Batch::default();
        // The watch expired; b was deleted while nobody watched; c was added.
        m.handle(
            Source::Namespace,
            Report::Error {
                message: "gone".into(),
                gone: true,
            },
            &mut out,
        );
        m.handle(Source::Namespace, Report::Init, &mut out);
        m.handle(Source::Namespace, Report::Apply(ns("a", "1")), &mut out);
        m.handle(Source::Namespace, Report::Apply(ns("c", "7")), &mut out);
        m.handle(Source::Namespace, Report::InitDone, &mut out);
        assert_eq!(
            summary(&out),
            ["apply Profile kns.c", "delete Profile kns.b"]
        );
    }
}
