//! Datastore adapters: each turns its source into graph [`Update`]s. Thin by design
//! (architecture invariant 2): reading and decoding only; validation and meaning live in the graph,
//! and what keys and objects mean in `calc_ingest`.
//!
//! - [`file`](mod@file): a directory of Calico v3 manifests (the embedded default);
//! - [`etcd`]: etcd v3 in Calico's layout, and the status writer to Felix's status keys;
//! - [`kubernetes`]: the Kubernetes API (Calico CRDs and native objects).
//!
//! Contract: the adapter `serve` starts ([`start_adapter`]) sends its updates, as batches, into
//! one [`Sink`]: the engine's datastore receiver. The first batches hold the complete snapshot
//! and end with `InSync`; later ones hold changes. It reports what it refused and what is left
//! unusable through [`Health`], and writes the agents' status from the board back to its
//! datastore. For `compute`, [`snapshot`] reads a datastore once.
//!
//! Adapters take their settings from `crate::args` and report through types of this module:
//! nothing here imports the serving layer.

pub mod etcd;
pub mod file;
pub mod kubernetes;

use std::sync::Arc;

use parking_lot::Mutex;

use calc_graph::graph::Update;
use calc_graph::manifest::RejectStage;
use common::Tasks;

use crate::args::{DatastoreArgs, EtcdArgs, KubeArgs, ServeArgs, StoreArgs};
use crate::status::Board;

pub use crate::args::DatastoreType;

/// Where every adapter sends its batches of updates: the engine's datastore input.
pub type Sink = tokio::sync::mpsc::Sender<Vec<Update>>;

/// Checks `args`' datastore settings and starts its adapter (and status writer) through
/// `tasks`, sending into `sink`. Fails on what retrying cannot fix (a missing directory, bad
/// URLs or TLS files, a broken kubeconfig); an unreachable datastore is retried by the adapter.
/// Returns how to name the datastore in logs.
///
/// The adapter's tasks run in the span `datastore{type="file"|"etcd"|"kubernetes"}` (the
/// watcher) or a child of it (`file_watch`, `status_writer`, …), and stop when `tasks` is
/// cancelled.
pub async fn start_adapter(
    args: &ServeArgs,
    board: Arc<Board>,
    health: Health,
    sink: Sink,
    tasks: &Tasks,
) -> anyhow::Result<String> {
    match args.datastore.datastore_type {
        DatastoreType::File => file::start(args, board, health, sink, tasks),
        DatastoreType::Etcdv3 => etcd::start(args, board, health, sink, tasks).await,
        // Calico's Kubernetes datastore keeps no endpoint status: reports stay on the status
        // board (admin /status) only.
        DatastoreType::Kubernetes => kubernetes::start(args, health, sink, tasks).await,
    }
}

/// A complete snapshot: every object in force as an `Apply`, then `InSync`; problems by name.
/// An object whose datastore version is unusable is at the last good version a server would
/// keep in force when the reader can find it (the file datastore's last-good store, etcd's
/// history), said in `held`; `caveats` say where a running server may differ.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub updates: Vec<Update>,
    pub problems: Vec<String>,
    /// Objects taken at their last good version (or left out for want of one), one line each.
    pub held: Vec<String>,
    /// Where the answer may differ from what a running server enforces: invalid objects left
    /// out whose last good versions a running server may still hold.
    pub caveats: Vec<String>,
}

/// Reads the whole datastore once (`store`: where the file datastore's last-good store is).
pub fn snapshot(args: &DatastoreArgs, store: &StoreArgs) -> anyhow::Result<Snapshot> {
    match args.datastore_type {
        DatastoreType::File => {
            let dirs = file::OutputDirs::check(
                &args.file_dir,
                store.status_dir.as_deref(),
                store.last_good_dir.as_deref(),
            )?;
            file::snapshot(&args.file_dir, &dirs)
        }
        DatastoreType::Etcdv3 => etcd_snapshot(&args.etcd),
        DatastoreType::Kubernetes => kube_snapshot(&args.kube),
    }
}

/// At most this many names in one caveat line (then how many more).
const LISTED: usize = 20;

/// `names`, comma-separated, at most [`LISTED`] of them.
pub(crate) fn listed(names: &[String]) -> String {
    let mut out = names
        .iter()
        .take(LISTED)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > LISTED {
        out.push_str(&format!(" and {} more", names.len() - LISTED));
    }
    out
}

/// The problems of an etcd or Kubernetes snapshot, and the caveat for the rejected objects it
/// found no last good version of (`why`: why a running server may still hold one).
fn ingest_problems(problems: Vec<calc_ingest::Problem>, why: &str) -> Snapshot {
    let without: Vec<String> = problems
        .iter()
        .filter(|p| p.stage.is_some() && !p.held)
        .map(|p| calc_graph::untrusted::Untrusted(&p.key).to_string())
        .collect();
    let problems = problems
        .into_iter()
        .map(|p| format!("{}: {}", p.key, p.reason))
        .collect();
    let caveats = if without.is_empty() {
        Vec::new()
    } else {
        vec![format!(
            "{why}: these invalid objects are left out here, but a running server may still hold \
             their last good versions in force: {}",
            listed(&without)
        )]
    };
    Snapshot {
        problems,
        caveats,
        ..Snapshot::default()
    }
}

fn etcd_snapshot(args: &EtcdArgs) -> anyhow::Result<Snapshot> {
    // Two workers: one fetches the next page while the other decodes the current one.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (updates, problems) = rt.block_on(etcd::watcher::snapshot(args))?;
    Ok(Snapshot {
        updates,
        ..ingest_problems(
            problems,
            "etcd's history holds no valid earlier version of them (compacted, or never valid)",
        )
    })
}

fn kube_snapshot(args: &KubeArgs) -> anyhow::Result<Snapshot> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (updates, problems) = rt.block_on(kubernetes::watcher::snapshot(args))?;
    Ok(Snapshot {
        updates,
        ..ingest_problems(
            problems,
            "the Kubernetes API keeps no earlier versions to read (a server keeps them in memory)",
        )
    })
}

/// Runs CPU-bound adapter work (decoding, converting, validating) without holding up the
/// runtime's other tasks (agent streams, the admin endpoint): on a multi-threaded runtime the
/// worker hands its other tasks over first.
pub fn off_runtime<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// What an adapter reports about the objects it reads, shared with the admin endpoint
/// (`/metrics`, `/status/datastore`, `/readiness`).
#[derive(Clone, Debug, Default)]
pub struct Health {
    pub rejections: Arc<Rejections>,
    pub unusable: Arc<Unusable>,
}

/// Objects whose datastore version is unusable, as the adapter last reported them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct LastGoodHealth {
    /// Invalid (or possibly in an unreadable file) with their last good version in force.
    pub held_last_good: Vec<String>,
    /// Invalid with no known last good version: not in force at all.
    pub without_last_good: Vec<String>,
}

/// The adapter's latest [`LastGoodHealth`].
#[derive(Debug, Default)]
pub struct Unusable(Mutex<LastGoodHealth>);

impl Unusable {
    /// Records the adapter's view of unusable objects; true when it changed.
    pub fn set(&self, held: Vec<String>, without: Vec<String>) -> bool {
        let new = LastGoodHealth {
            held_last_good: held,
            without_last_good: without,
        };
        let mut cur = self.0.lock();
        let changed = *cur != new;
        *cur = new;
        changed
    }

    /// [`Self::set`], logging the objects without a last good version as an error whenever
    /// that list changes (not on every re-list).
    pub fn publish(&self, held: Vec<String>, without: Vec<String>) {
        let shown = (!without.is_empty()).then(|| without.clone());
        if self.set(held, without)
            && let Some(objects) = shown
        {
            tracing::error!(
                ?objects,
                "invalid objects with no known last good version are not in force; fix them (a \
                 deny policy among them is not enforced)"
            );
        }
    }

    pub fn get(&self) -> LastGoodHealth {
        self.0.lock().clone()
    }
}

/// Objects the datastore refused, by stage: the `calc_server_rejected_objects_total` counter.
/// Each refusal counts once: a new bad value (etcd, Kubernetes) or a changed file read again.
#[derive(Debug, Default)]
pub struct Rejections([std::sync::atomic::AtomicU64; 3]);

impl Rejections {
    fn slot(stage: RejectStage) -> usize {
        RejectStage::ALL
            .iter()
            .position(|s| *s == stage)
            .expect("every stage is in ALL")
    }

    pub fn count(&self, stage: RejectStage) {
        self.0[Self::slot(stage)].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn get(&self, stage: RejectStage) -> u64 {
        self.0[Self::slot(stage)].load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn total(&self) -> u64 {
        RejectStage::ALL.iter().map(|s| self.get(*s)).sum()
    }
}
