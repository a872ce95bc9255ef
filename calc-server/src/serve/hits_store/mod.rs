//! Where `serve` keeps the policy hit counters across a restart and a fail-over, by datastore:
//! - the file datastore: `_hits.json` in the status directory ([`file`]; none without one);
//! - etcd: parts under [`etcd::PREFIX`] in the same etcd ([`etcd`], [`parts`]);
//! - Kubernetes: the same parts as labelled ConfigMaps in the server's namespace ([`kube`]).
//!
//! Contract ([`run`]): the store is read first, retried while it cannot be reached (a store
//! that answers with a damaged document is not retried: what it held is named and left out),
//! and what it held goes to the engine (`Input::RestoreHits`), which merges it into whatever it
//! counted meanwhile. Only then does the engine hand over copies, and this task writes each
//! (the latest wins; a failed write is logged once and retried with the next copy). So a
//! store is never overwritten by a server that has not read it. The last copy comes as the
//! engine stops; the serve task awaits this one after the engine.
//!
//! Fail-over: the etcd and Kubernetes stores are shared by replicas, and a node's agent may
//! move from one to another. When one connects here, the engine asks for that node's stored
//! counts ([`Store::load_node`]); they go back as `Input::NodeHits`, and the engine merges
//! them (`hits::reload`). Until then the node is unverified: each copy names the unverified
//! nodes, and their parts are neither written nor deleted, so a stale view of a node that moved
//! here never replaces what the replica it left saved. Requests queued for one node are served
//! once, for its latest stream; a read that fails is answered `None` and asked again by the
//! engine at its next save.

pub(super) mod etcd;
pub(super) mod file;
pub(super) mod kube;
pub(super) mod parts;

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use super::engine::{Input, SAVED_VERSION, SaveCopy, SavedCount, SavedHits};
#[cfg(test)]
use crate::args::EtcdArgs;
use crate::args::{DatastoreType, ServeArgs};

/// Where one server keeps its hit counters.
pub(super) enum Store {
    File(PathBuf),
    Etcd(Box<etcd::EtcdStore>),
    Kube(Box<kube::KubeStore>),
}

/// Why a store could not be read.
#[derive(Debug, thiserror::Error)]
enum LoadError {
    /// Worth retrying: the store did not answer.
    #[error("cannot reach it: {0:#}")]
    Unreachable(anyhow::Error),
    /// It answered with something this server refuses: starting from zero.
    #[error(transparent)]
    Refused(file::LoadError),
}

impl Store {
    /// `args`' store (`None`: the counters live in memory only).
    pub(super) fn for_args(args: &ServeArgs) -> Option<Store> {
        match args.datastore.datastore_type {
            DatastoreType::File => file::path(args).map(Store::File),
            DatastoreType::Etcdv3 => Some(Store::Etcd(Box::new(etcd::EtcdStore::new(
                args.datastore.etcd.clone(),
            )))),
            DatastoreType::Kubernetes => Some(Store::Kube(Box::new(kube::KubeStore::new(
                args.datastore.kube.clone(),
                args.kube.hits_namespace.clone(),
            )))),
        }
    }

    /// How logs name it.
    pub(super) fn describe(&self) -> String {
        match self {
            Store::File(path) => path.display().to_string(),
            Store::Etcd(_) => format!("etcd {}", etcd::PREFIX),
            Store::Kube(store) => store.describe(),
        }
    }

    /// What it holds (`None`: nothing yet, a first start).
    async fn load(&mut self) -> Result<Option<SavedHits>, LoadError> {
        match self {
            Store::File(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || file::load(&path))
                    .await
                    .map_err(|e| LoadError::Unreachable(e.into()))?
                    .map_err(LoadError::Refused)
            }
            Store::Etcd(store) => store.load().await.map_err(LoadError::Unreachable),
            Store::Kube(store) => store.load().await.map_err(LoadError::Unreachable),
        }
    }

    /// Whether [`Store::load_node`] answers (a store replicas share).
    pub(super) fn reloads_nodes(&self) -> bool {
        !matches!(self, Store::File(_))
    }

    /// `node`'s counts as the store holds them now.
    async fn load_node(&mut self, node: &str) -> anyhow::Result<Vec<SavedCount>> {
        match self {
            Store::File(_) => Ok(Vec::new()),
            Store::Etcd(store) => store.load_node(node).await,
            Store::Kube(store) => store.load_node(node).await,
        }
    }

    /// Saves `copy`, leaving the parts of its unverified nodes as they are.
    async fn write(&mut self, copy: SaveCopy) -> anyhow::Result<()> {
        match self {
            // Not shared between replicas: there is nothing to re-read, hence nothing to skip.
            Store::File(path) => {
                let to = path.clone();
                tokio::task::spawn_blocking(move || file::write_atomic(&to, &copy.doc)).await??;
                Ok(())
            }
            Store::Etcd(store) => store.write(&copy.doc, &copy.skip).await,
            Store::Kube(store) => store.write(&copy.doc, &copy.skip).await,
        }
    }
}

/// First delay between attempts to read an unreachable store; doubled up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Reads the store into the engine, then writes each copy the engine hands over and answers
/// each node the engine asks for, until the engine is gone (see the module documentation).
pub(super) async fn run(
    mut store: Store,
    engine: mpsc::Sender<Input>,
    mut copies: watch::Receiver<Option<SaveCopy>>,
    mut reloads: Option<mpsc::UnboundedReceiver<(String, u64)>>,
) {
    let name = store.describe();
    let mut delay = RETRY_FIRST;
    let mut warned = false;
    let saved = loop {
        match store.load().await {
            Ok(saved) => {
                if saved.is_some() {
                    tracing::info!(store = %name, "policy hit counters restored");
                }
                break saved;
            }
            Err(LoadError::Refused(reason)) => {
                tracing::warn!(store = %name, %reason, "cannot load the saved policy hit counters; they start from zero");
                break None;
            }
            Err(LoadError::Unreachable(error)) => {
                if !warned {
                    tracing::warn!(store = %name, error = %format!("{error:#}"),
                        "cannot read the saved policy hit counters yet; counting goes on and \
                         nothing is saved until they are read (retrying)");
                    warned = true;
                }
                // The engine may stop meanwhile: nothing was read, so nothing is written.
                if engine.is_closed() {
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RETRY_MAX);
            }
        }
    };
    let saved = saved.unwrap_or(SavedHits {
        version: SAVED_VERSION,
        counts: Vec::new(),
        seen: Vec::new(),
    });
    if engine.send(Input::RestoreHits(saved)).await.is_err() {
        return;
    }
    let mut failing = false;
    loop {
        let request = async {
            match reloads.as_mut() {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            Some(first) = request => {
                // Everything queued now, one read per node, for its latest stream.
                let mut latest: std::collections::BTreeMap<String, u64> = [first].into();
                if let Some(rx) = reloads.as_mut() {
                    while let Ok((node, conn)) = rx.try_recv() {
                        latest.insert(node, conn);
                    }
                }
                for (node, conn) in latest {
                    let counts = match store.load_node(&node).await {
                        Ok(counts) => Some(counts),
                        Err(error) => {
                            tracing::warn!(%node, store = %name, error = %format!("{error:#}"),
                                "cannot read the node's saved policy hit counters; its parts are \
                                 left as they are until they can be read (asked again)");
                            None
                        }
                    };
                    if engine.send(Input::NodeHits { node, conn, counts }).await.is_err() {
                        return;
                    }
                }
            }
            changed = copies.changed() => {
                if changed.is_err() {
                    return;
                }
                let Some(copy) = copies.borrow_and_update().clone() else {
                    continue;
                };
                match store.write(copy).await {
                    Err(error) => {
                        if !failing {
                            tracing::error!(error = %format!("{error:#}"), store = %name,
                                "cannot save the policy hit counters; a restart would start them from \
                                 what was last saved (retrying with the next change)");
                        }
                        failing = true;
                    }
                    Ok(()) if failing => {
                        failing = false;
                        tracing::info!(store = %name, "saving the policy hit counters again");
                    }
                    Ok(()) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn copy(doc: SavedHits) -> Option<SaveCopy> {
        Some(SaveCopy {
            doc: Arc::new(doc),
            skip: Vec::new(),
        })
    }

    /// The saved document reaches the engine before anything is written; then each copy is
    /// written, the last one as the engine goes.
    #[tokio::test]
    async fn the_store_is_read_into_the_engine_then_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(file::FILE_NAME);
        file::write_atomic(&path, &file::tests::doc()).unwrap();
        let (engine, mut inputs) = mpsc::channel(4);
        let (tx, rx) = watch::channel(None);
        let task = tokio::spawn(run(Store::File(path.clone()), engine, rx, None));
        match inputs.recv().await {
            Some(Input::RestoreHits(saved)) => assert_eq!(saved, file::tests::doc()),
            _ => panic!("the saved counters go to the engine first"),
        }
        let mut last = file::tests::doc();
        last.counts[0].packets = 99;
        tx.send(copy(file::tests::doc())).unwrap();
        tx.send(copy(last.clone())).unwrap();
        drop(tx);
        task.await.unwrap();
        assert_eq!(file::load(&path).unwrap(), Some(last));
    }

    /// A store that cannot be read is retried and never written: the engine gets nothing, and
    /// when it goes the task ends without a write.
    #[tokio::test]
    async fn an_unreachable_store_is_never_written() {
        let args = EtcdArgs {
            etcd_endpoints: vec!["http://127.0.0.1:1".into()],
            etcd_ca_file: None,
            etcd_cert_file: None,
            etcd_key_file: None,
            etcd_page_size: 4000,
        };
        let (engine, mut inputs) = mpsc::channel(4);
        let (tx, rx) = watch::channel(None);
        let task = tokio::spawn(run(
            Store::Etcd(Box::new(etcd::EtcdStore::new(args))),
            engine,
            rx,
            None,
        ));
        tx.send(copy(file::tests::doc())).unwrap();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(inputs.try_recv().is_err(), "nothing was read");
        drop(inputs);
        drop(tx);
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the task ends once the engine is gone")
            .unwrap();
    }

    /// Each node the engine asks for is answered, once per node for its latest stream.
    #[tokio::test]
    async fn each_node_asked_for_is_answered_once_for_its_latest_stream() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(file::FILE_NAME);
        let (engine, mut inputs) = mpsc::channel(8);
        let (tx, rx) = watch::channel(None);
        let (ask, asks) = mpsc::unbounded_channel();
        // Queued before the store is read: served after the restore.
        ask.send(("node-a".to_string(), 7)).unwrap();
        ask.send(("node-a".to_string(), 8)).unwrap();
        ask.send(("node-b".to_string(), 9)).unwrap();
        let task = tokio::spawn(run(Store::File(path.clone()), engine, rx, Some(asks)));
        assert!(matches!(inputs.recv().await, Some(Input::RestoreHits(_))));
        let mut answers = Vec::new();
        for _ in 0..2 {
            match inputs.recv().await {
                Some(Input::NodeHits { node, conn, counts }) => {
                    answers.push((node, conn, counts.map(|c| c.len())));
                }
                _ => panic!("the nodes' stored counts are answered"),
            }
        }
        assert_eq!(
            answers,
            [
                ("node-a".to_string(), 8, Some(0)),
                ("node-b".to_string(), 9, Some(0))
            ]
        );
        drop(tx);
        task.await.unwrap();
        assert!(inputs.try_recv().is_err(), "one answer per node");
    }
}
