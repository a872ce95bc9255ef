//! The Kubernetes store of the hit counters: each [`part`](super::parts) of the saved document
//! is a ConfigMap in the server's namespace (`--hits-namespace`, else the client's default: the
//! pod's own namespace in a cluster), named `calc-server-hits-<hash of the part name>`, with the
//! label [`LABEL`]`=v1`, the part's name in the annotation [`PART_ANNOTATION`] and the document
//! in `data["hits.json"]`; the label [`GROUP_LABEL`] lets one node's parts be listed alone.
//!
//! Contract: as the etcd store ([`super::etcd`]): [`KubeStore::load`] lists the labelled
//! ConfigMaps and joins their parts (a ConfigMap without the annotation or the data is named and
//! left out); [`KubeStore::write`] applies (server-side apply, field manager `calc-server`) only
//! the parts whose bytes changed since this server last read or wrote them and deletes only
//! those it knew that are gone. A part is at most 256 KiB, well under a ConfigMap's 1 MiB. A
//! failed call leaves what it did not do to the next copy.

use std::collections::BTreeMap;

use anyhow::Context;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams,
};

use super::parts;
use crate::args::KubeArgs;
use crate::serve::engine::{SavedCount, SavedHits};

/// The label every part carries (value `v1`), by which they are listed.
pub(crate) const LABEL: &str = "calc-server.projectcalico.org/hits";
/// The label naming the part's group (a hash of its name without `/<i>`: one node's counts
/// are one group), by which one node's parts are listed.
pub(crate) const GROUP_LABEL: &str = "calc-server.projectcalico.org/hits-group";
/// The annotation holding the part's name.
pub(crate) const PART_ANNOTATION: &str = "calc-server.projectcalico.org/part";
/// The data key holding the part's document.
const DATA_KEY: &str = "hits.json";

/// Longest one API call may take: the kube client retries 429/503/504 by itself, for minutes;
/// past this the store's own retry (and its warning) takes over.
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// ConfigMaps per list call.
const PAGE: u32 = 200;

/// `call`, or an error once [`CALL_TIMEOUT`] has passed.
async fn bounded<T>(
    what: &str,
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> anyhow::Result<Result<T, kube::Error>> {
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| anyhow::anyhow!("{what}: no answer within {CALL_TIMEOUT:?}"))
}

fn config_maps() -> ApiResource {
    ApiResource {
        group: String::new(),
        version: "v1".into(),
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        plural: "configmaps".into(),
    }
}

/// `calc-server-hits-<16 hex digits>`: a valid object name whatever the part's name holds.
pub(crate) fn object_name(part: &str) -> String {
    format!(
        "calc-server-hits-{:016x}",
        parts::stable_hash(part.as_bytes())
    )
}

/// The [`GROUP_LABEL`] value of a part (`counts/node-1/0` → the hash of `counts/node-1`).
fn group_label(part: &str) -> String {
    let group = part.rsplit_once('/').map_or(part, |(g, _)| g);
    format!("{:016x}", parts::stable_hash(group.as_bytes()))
}

pub(crate) struct KubeStore {
    args: KubeArgs,
    namespace: Option<String>,
    api: Option<Api<DynamicObject>>,
    /// The parts as this server last read or wrote them, by name.
    known: BTreeMap<String, Vec<u8>>,
}

impl KubeStore {
    pub(crate) fn new(args: KubeArgs, namespace: Option<String>) -> KubeStore {
        KubeStore {
            args,
            namespace,
            api: None,
            known: BTreeMap::new(),
        }
    }

    /// Where the parts live, for logs.
    pub(crate) fn describe(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("ConfigMaps {LABEL}=v1 in namespace {ns}"),
            None => format!("ConfigMaps {LABEL}=v1 in the client's namespace"),
        }
    }

    async fn api(&mut self) -> anyhow::Result<Api<DynamicObject>> {
        if let Some(api) = &self.api {
            return Ok(api.clone());
        }
        let client = crate::datastore::kubernetes::client(&self.args).await?;
        let ns = self
            .namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_string());
        let api = Api::namespaced_with(client, &ns, &config_maps());
        self.api = Some(api.clone());
        Ok(api)
    }

    /// The parts the ConfigMaps `selector` selects hold, by part name (those whose name,
    /// annotation or data is amiss are logged and left out).
    async fn list(&mut self, selector: &str) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
        let api = self.api().await?;
        // In pages, each call bounded: a large store is read however long it takes in all.
        let mut items = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut params = ListParams::default().labels(selector).limit(PAGE);
            if let Some(t) = &token {
                params = params.continue_token(t);
            }
            let page = bounded("listing the saved hit counters", api.list(&params))
                .await?
                .context("listing the saved hit counters")?;
            items.extend(page.items);
            token = page.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                break;
            }
        }
        let mut found = BTreeMap::new();
        for cm in items {
            let object = cm.metadata.name.clone().unwrap_or_default();
            let part = cm
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(PART_ANNOTATION))
                .cloned();
            let body = cm.data["data"][DATA_KEY].as_str().map(str::to_owned);
            match (part, body) {
                (Some(part), Some(body)) if object_name(&part) == object => {
                    found.insert(part, body.into_bytes());
                }
                _ => tracing::warn!(
                    configmap = %object,
                    "a ConfigMap labelled as saved policy hit counters has no part name matching its \
                     name or no {DATA_KEY}; left out"
                ),
            }
        }
        Ok(found)
    }

    /// The saved document (`None`: no parts, a first start). `Err`: the API did not answer.
    pub(crate) async fn load(&mut self) -> anyhow::Result<Option<SavedHits>> {
        let found = self.list(&format!("{LABEL}=v1")).await?;
        if found.is_empty() {
            return Ok(None);
        }
        Ok(Some(parts::absorb(&mut self.known, found, None)))
    }

    /// `node`'s counts as the ConfigMaps hold them now; what this server knows of its parts
    /// becomes what it read.
    pub(crate) async fn load_node(&mut self, node: &str) -> anyhow::Result<Vec<SavedCount>> {
        let group = parts::node_group(node);
        let found = self
            .list(&format!(
                "{LABEL}=v1,{GROUP_LABEL}={}",
                group_label(&format!("{group}/0"))
            ))
            .await?;
        Ok(parts::absorb(&mut self.known, found, Some(&group)).counts)
    }

    /// Writes what changed in `doc` since the parts were last read or written here, leaving
    /// the parts of the nodes in `skip` as they are.
    pub(crate) async fn write(&mut self, doc: &SavedHits, skip: &[String]) -> anyhow::Result<()> {
        let ops = parts::changes(&self.known, &parts::split(doc), skip);
        if ops.is_empty() {
            return Ok(());
        }
        let api = self.api().await?;
        let apply = PatchParams::apply("calc-server").force();
        for (part, body) in ops {
            let name = object_name(&part);
            match &body {
                Some(b) => {
                    let mut object = DynamicObject::new(&name, &config_maps());
                    object.metadata = ObjectMeta {
                        name: Some(name.clone()),
                        labels: Some(
                            [
                                (LABEL.to_string(), "v1".to_string()),
                                (GROUP_LABEL.to_string(), group_label(&part)),
                            ]
                            .into(),
                        ),
                        annotations: Some([(PART_ANNOTATION.to_string(), part.clone())].into()),
                        ..ObjectMeta::default()
                    };
                    object.data = serde_json::json!({
                        "data": { DATA_KEY: String::from_utf8_lossy(b) }
                    });
                    bounded(
                        "saving the hit counters",
                        api.patch(&name, &apply, &Patch::Apply(&object)),
                    )
                    .await?
                    .with_context(|| format!("saving ConfigMap {name} (part {part})"))?;
                }
                None => match bounded(
                    "deleting a hit counters part",
                    api.delete(&name, &DeleteParams::default()),
                )
                .await?
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.is_not_found() => {}
                    Err(e) => {
                        return Err(e)
                            .with_context(|| format!("deleting ConfigMap {name} (part {part})"));
                    }
                },
            }
            match body {
                Some(b) => self.known.insert(part, b),
                None => self.known.remove(&part),
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Object names are valid DNS labels whatever the part name holds, and distinct per part.
    #[test]
    fn object_names_are_valid_and_distinct() {
        let a = object_name("counts/node-1/0");
        let b = object_name("counts/node-1/1");
        assert_ne!(a, b);
        for n in [a, b, object_name("counts/a%2fb\u{7}/0")] {
            assert!(n.len() <= 63, "{n}");
            assert!(
                n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{n}"
            );
        }
    }
}
