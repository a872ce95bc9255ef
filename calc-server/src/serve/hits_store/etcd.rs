//! The etcd store of the hit counters: the [`parts`](super::parts) of the saved document as
//! keys under [`PREFIX`] (`…/counts/<node>/<i>`, `…/departed/<i>`, `…/seen/<bucket>/<i>`), in
//! the etcd the server reads its policy from.
//!
//! Contract: [`EtcdStore::load`] lists the prefix and joins the parts; those it refuses are
//! logged by name and left out. [`EtcdStore::write`] puts only the parts whose bytes differ
//! from what this server last read or wrote there, and deletes only parts it knew of that are
//! gone from its copy (a node folded into the departed ones): a part written by another
//! replica since is not deleted, and a node's part is rewritten only when its counts moved,
//! that is by the replica its agent reports to. Writes go in transactions of at most
//! [`TXN_OPS`] operations and [`TXN_BYTES`] bytes (etcd's default request limit is 1.5 MiB);
//! a failed transaction leaves its parts to be written with the next copy.

use std::collections::BTreeMap;

use anyhow::Context;
use etcd_client::{Client, GetOptions, Txn, TxnOp};

use super::parts;
use crate::args::EtcdArgs;
use crate::datastore::etcd::{connect, watcher};
use crate::serve::engine::{SavedCount, SavedHits};

/// Where the parts live: under Calico's prefix, which a Calico etcd user may write.
pub(crate) const PREFIX: &str = "/calico/calc-server/v1/hits/";

/// Operations per transaction (etcd's default limit is 128).
const TXN_OPS: usize = 100;
/// Bytes of values per transaction.
const TXN_BYTES: usize = 1 << 20;

pub(crate) struct EtcdStore {
    args: EtcdArgs,
    client: Option<Client>,
    /// The parts as this server last read or wrote them, by name.
    known: BTreeMap<String, Vec<u8>>,
}

impl EtcdStore {
    pub(crate) fn new(args: EtcdArgs) -> EtcdStore {
        EtcdStore {
            args,
            client: None,
            known: BTreeMap::new(),
        }
    }

    async fn client(&mut self) -> anyhow::Result<Client> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let c = connect(&self.args).await?;
        self.client = Some(c.clone());
        Ok(c)
    }

    /// The saved document (`None`: no parts, a first start). `Err`: etcd did not answer.
    pub(crate) async fn load(&mut self) -> anyhow::Result<Option<SavedHits>> {
        let client = self.client().await?;
        let resp = watcher::kv_client(&client)
            .get(PREFIX, Some(GetOptions::new().with_prefix()))
            .await
            .inspect_err(|_| self.client = None)
            .context("listing the saved hit counters")?;
        let mut found = BTreeMap::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            let name = key.strip_prefix(PREFIX).unwrap_or(&key).to_string();
            found.insert(name, kv.value().to_vec());
        }
        if found.is_empty() {
            return Ok(None);
        }
        Ok(Some(parts::absorb(&mut self.known, found, None)))
    }

    /// `node`'s counts as etcd holds them now (its `counts/<node>/` parts); what this server
    /// knows of those parts becomes what it read.
    pub(crate) async fn load_node(&mut self, node: &str) -> anyhow::Result<Vec<SavedCount>> {
        let client = self.client().await?;
        let group = parts::node_group(node);
        let prefix = format!("{PREFIX}{group}/");
        let resp = watcher::kv_client(&client)
            .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
            .inspect_err(|_| self.client = None)
            .with_context(|| format!("reading the saved hit counters of node {node}"))?;
        let mut found = BTreeMap::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            let name = key.strip_prefix(PREFIX).unwrap_or(&key).to_string();
            found.insert(name, kv.value().to_vec());
        }
        Ok(parts::absorb(&mut self.known, found, Some(&group)).counts)
    }

    /// Writes what changed in `doc` since the parts were last read or written here, leaving
    /// the parts of the nodes in `skip` as they are.
    pub(crate) async fn write(&mut self, doc: &SavedHits, skip: &[String]) -> anyhow::Result<()> {
        let ops = parts::changes(&self.known, &parts::split(doc), skip);
        if ops.is_empty() {
            return Ok(());
        }
        let client = self.client().await?;
        let mut kv = watcher::kv_client(&client);
        let mut batch: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        let mut bytes = 0;
        let mut rest = ops.into_iter().peekable();
        while let Some(op) = rest.next() {
            bytes += op.1.as_ref().map_or(0, Vec::len);
            batch.push(op);
            let full = rest.peek().is_none_or(|next| {
                batch.len() >= TXN_OPS || bytes + next.1.as_ref().map_or(0, Vec::len) > TXN_BYTES
            });
            if !full {
                continue;
            }
            let txn = Txn::new().and_then(
                batch
                    .iter()
                    .map(|(name, body)| {
                        let key = format!("{PREFIX}{name}");
                        match body {
                            Some(b) => TxnOp::put(key, b.clone(), None),
                            None => TxnOp::delete(key, None),
                        }
                    })
                    .collect::<Vec<_>>(),
            );
            if let Err(e) = kv.txn(txn).await {
                self.client = None;
                return Err(e).context("writing the hit counters to etcd");
            }
            for (name, body) in batch.drain(..) {
                match body {
                    Some(b) => self.known.insert(name, b),
                    None => self.known.remove(&name),
                };
            }
            bytes = 0;
        }
        Ok(())
    }
}
