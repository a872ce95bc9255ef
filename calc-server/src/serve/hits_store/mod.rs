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
//! them (`hits::reload`); the engine hands over no copy while an answer is outstanding, so a
//! stale view of a node that moved here never replaces what the replica it left saved. Every
//! request is answered: a node whose counts cannot be read with none (logged), and the view
//! held here stands.

pub(super) mod etcd;
pub(super) mod file;
pub(super) mod kube;
pub(super) mod parts;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use super::engine::{Input, SAVED_VERSION, SavedCount, SavedHits};
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

    async fn write(&mut self, doc: Arc<SavedHits>) -> anyhow::Result<()> {
        match self {
            Store::File(path) => {
                let to = path.clone();
                tokio::task::spawn_blocking(move || file::write_atomic(&to, &doc)).await??;
                Ok(())
            }
            Store::Etcd(store) => store.write(&doc).await,
            Store::Kube(store) => store.write(&doc).await,
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
    mut copies: watch::Receiver<Option<Arc<SavedHits>>>,
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
            Some((node, conn)) = request => {
                let counts = match store.load_node(&node).await {
                    Ok(counts) => counts,
                    Err(error) => {
                        tracing::warn!(%node, store = %name, error = %format!("{error:#}"),
                            "cannot read the node's stored policy hit counters; the counts held here stand");
                        Vec::new()
                    }
                };
                if engine.send(Input::NodeHits { node, conn, counts }).await.is_err() {
                    return;
                }
            }
            changed = copies.changed() => {
                if changed.is_err() {
                    return;
                }
                let Some(doc) = copies.borrow_and_update().clone() else {
                    continue;
                };
                match store.write(doc).await {
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
        tx.send(Some(Arc::new(file::tests::doc()))).unwrap();
        tx.send(Some(Arc::new(last.clone()))).unwrap();
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
        tx.send(Some(Arc::new(file::tests::doc()))).unwrap();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(inputs.try_recv().is_err(), "nothing was read");
        drop(inputs);
        drop(tx);
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the task ends once the engine is gone")
            .unwrap();
    }

    /// Each node the engine asks for is answered, with what the store holds of it.
    #[tokio::test]
    async fn each_node_asked_for_is_answered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(file::FILE_NAME);
        let (engine, mut inputs) = mpsc::channel(4);
        let (tx, rx) = watch::channel(None);
        let (ask, asks) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(Store::File(path.clone()), engine, rx, Some(asks)));
        assert!(matches!(inputs.recv().await, Some(Input::RestoreHits(_))));
        ask.send(("node-a".to_string(), 7)).unwrap();
        match inputs.recv().await {
            Some(Input::NodeHits { node, conn, counts }) => {
                assert_eq!((node.as_str(), conn, counts.len()), ("node-a", 7, 0));
            }
            _ => panic!("the node's stored counts are answered"),
        }
        drop(tx);
        task.await.unwrap();
    }
}
