//! Writing v3 objects into etcd in Calico's key layout
//! (`/calico/resources/v3/projectcalico.org/<plural>/[<ns>/]<name>`, compact JSON values), for
//! `etcd-bench load`, `calc-bench churn --datastore etcd` and `flip-kernel`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use calc_graph::model::{Decoded, Resource};
use etcd_client::{Client, Txn, TxnOp};

/// The prefix of every v3 object Calico stores in etcd.
pub const PREFIX: &str = "/calico/resources/v3/projectcalico.org/";

/// The etcd key of a v3 object; `None` for a kind Calico does not keep there.
pub fn key_of(v: &serde_json::Value) -> anyhow::Result<Option<String>> {
    Ok(match Resource::from_value(v.clone())? {
        Decoded::Resource(key, _) => Some(key.etcd_path()),
        Decoded::Ignored(..) => None,
    })
}

/// The `.json` files of a `gen-cluster` directory, sorted; none is an error.
pub fn json_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    anyhow::ensure!(
        !files.is_empty(),
        "{} holds no .json files: `load` reads a directory written by `calc-bench gen-cluster \
         --out DIR` (JSON arrays of v3 objects)",
        dir.display()
    );
    Ok(files)
}

/// What [`load`] wrote.
#[derive(Debug, Clone, Copy)]
pub struct Loaded {
    pub keys: usize,
    pub bytes: usize,
    pub seconds: f64,
}

/// Writes every object of `files` (JSON arrays of v3 objects, as `gen-cluster` writes them)
/// into etcd, in transactions of `batch` puts, `parallel` in flight.
pub async fn load(
    client: &Client,
    files: Vec<PathBuf>,
    batch: usize,
    parallel: usize,
) -> anyhow::Result<Loaded> {
    let (batch, parallel) = (batch.max(1), parallel.max(1));
    let started = Instant::now();
    let (mut keys, mut bytes) = (0usize, 0usize);
    let mut pending: Vec<(String, String)> = Vec::with_capacity(batch);
    let mut inflight = tokio::task::JoinSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f)?;
        let items: Vec<serde_json::Value> =
            serde_json::from_str(&text).with_context(|| format!("{}", f.display()))?;
        for v in items {
            let Ok(Some(key)) = key_of(&v) else {
                continue;
            };
            let value = serde_json::to_string(&v)?;
            keys += 1;
            bytes += value.len();
            pending.push((key, value));
            if pending.len() == batch {
                if inflight.len() >= parallel
                    && let Some(done) = inflight.join_next().await
                {
                    done??;
                }
                inflight.spawn(put_all(client.clone(), std::mem::take(&mut pending)));
            }
        }
    }
    if !pending.is_empty() {
        inflight.spawn(put_all(client.clone(), pending));
    }
    while let Some(r) = inflight.join_next().await {
        r??;
    }
    Ok(Loaded {
        keys,
        bytes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Puts `kvs` in one transaction.
pub async fn put_all(mut client: Client, kvs: Vec<(String, String)>) -> anyhow::Result<()> {
    let ops: Vec<TxnOp> = kvs
        .into_iter()
        .map(|(k, v)| TxnOp::put(k, v, None))
        .collect();
    client.txn(Txn::new().and_then(ops)).await?;
    Ok(())
}
