//! Datastore adapters: each turns its source into graph [`Update`]s. Thin by design
//! (DESIGN.md invariant 2): reading and decoding only; validation and meaning live in the graph,
//! and what keys and objects mean in `calc_ingest`.
//!
//! - [`file`]: a directory of Calico v3 manifests (the embedded default);
//! - [`etcd`]: etcd v3 in Calico's layout, and the status writer to Felix's status keys;
//! - [`kubernetes`]: the Kubernetes API (Calico CRDs and native objects).
//!
//! Contract: every adapter `serve` runs sends its updates, as batches, into one [`Sink`]: the
//! engine's datastore receiver. The first batches hold the complete snapshot and end with
//! `InSync`; later ones hold changes. For `compute`, [`snapshot`] reads a datastore once.

pub mod etcd;
pub mod file;
pub mod kubernetes;

use std::path::PathBuf;

use calc_graph::graph::Update;

use self::etcd::EtcdArgs;
use self::kubernetes::KubeArgs;

/// Where every adapter sends its batches of updates: the engine's datastore input.
pub type Sink = tokio::sync::mpsc::Sender<Vec<Update>>;

/// Which datastore to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DatastoreType {
    /// A directory of Calico v3 YAML/JSON manifests (the embedded default).
    File,
    /// Calico's etcd v3 layout (`/calico/resources/v3/projectcalico.org/...`).
    Etcdv3,
    /// The Kubernetes API: Calico CRDs (crd.projectcalico.org/v1) and pods, namespaces,
    /// service accounts, nodes and NetworkPolicies, as Calico's Kubernetes datastore reads them.
    Kubernetes,
}

/// Datastore selection flags shared by `compute` and `serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct DatastoreArgs {
    /// Where the cluster's Calico resources come from.
    #[arg(long, env = "DATASTORE_TYPE", value_enum, default_value = "file")]
    pub datastore_type: DatastoreType,
    /// Directory of manifests for the file datastore (searched recursively; `status/` ignored).
    #[arg(long, env = "CALC_SERVER_FILE_DIR", default_value = "examples/cluster")]
    pub file_dir: PathBuf,
    /// etcd connection (for `--datastore-type etcdv3`).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Kubernetes API connection (for `--datastore-type kubernetes`).
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// A complete snapshot: every valid object as an `Apply`, then `InSync`; problems by name.
pub struct Snapshot {
    pub updates: Vec<Update>,
    pub problems: Vec<String>,
}

/// Reads the whole datastore once.
pub fn snapshot(args: &DatastoreArgs) -> anyhow::Result<Snapshot> {
    match args.datastore_type {
        DatastoreType::File => file::snapshot(&args.file_dir),
        DatastoreType::Etcdv3 => etcd_snapshot(&args.etcd),
        DatastoreType::Kubernetes => kube_snapshot(&args.kube),
    }
}

fn etcd_snapshot(args: &EtcdArgs) -> anyhow::Result<Snapshot> {
    // Two workers: one fetches the next page while the other decodes the current one.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (updates, problems) = rt.block_on(etcd::watcher::snapshot(args))?;
    let problems = problems
        .into_iter()
        .map(|p| format!("{}: {}", p.key, p.reason))
        .collect();
    Ok(Snapshot { updates, problems })
}

fn kube_snapshot(args: &KubeArgs) -> anyhow::Result<Snapshot> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (updates, problems) = rt.block_on(kubernetes::watcher::snapshot(args))?;
    let problems = problems
        .into_iter()
        .map(|p| format!("{}: {}", p.key, p.reason))
        .collect();
    Ok(Snapshot { updates, problems })
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

/// Objects the datastore refused, by stage: the `calc_server_rejected_objects_total` counter.
/// Each refusal counts once: a new bad value (etcd, Kubernetes) or a changed file read again.
#[derive(Debug, Default)]
pub struct Rejections([std::sync::atomic::AtomicU64; 3]);

impl Rejections {
    fn slot(stage: calc_graph::manifest::RejectStage) -> usize {
        calc_graph::manifest::RejectStage::ALL
            .iter()
            .position(|s| *s == stage)
            .expect("every stage is in ALL")
    }

    pub fn count(&self, stage: calc_graph::manifest::RejectStage) {
        self.0[Self::slot(stage)].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn get(&self, stage: calc_graph::manifest::RejectStage) -> u64 {
        self.0[Self::slot(stage)].load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn total(&self) -> u64 {
        calc_graph::manifest::RejectStage::ALL
            .iter()
            .map(|s| self.get(*s))
            .sum()
    }
}
