//! Broadcast state: what every node is sent alike — Felix configuration, host metadata and
//! IPAM pools — and what was last flushed of it.
//!
//! Contract: each is kept as the messages it becomes (`pb::HostMetadataUpdate`,
//! `pb::IpamPoolUpdate`, per-source config maps), replaced whole by a new version of its
//! resource. The sequencer sends a node the difference between the state as of the last flush
//! (`flushed_*`, updated by [`Broadcast::flushed`]) and now, or all of it to a fresh node; a
//! configuration change marks `config_dirty` until the next flush, when each subscribed node
//! is sent its merged configuration if it differs from what it has.

use std::collections::BTreeMap;

use felix_proto as pb;
use rustc_hash::FxHashMap;

use super::messages::{config_value, felix_param_name, host_metadata};
use crate::model::{IpPoolSpec, NodeSpec, ObjectMeta};

#[derive(Default)]
pub(super) struct Broadcast {
    /// Per FelixConfiguration name (`default`, `node.<name>`), Felix's parameters.
    pub(super) felix_config: BTreeMap<String, BTreeMap<String, String>>,
    pub(super) config_dirty: bool,
    pub(super) host_metadata: BTreeMap<String, pb::HostMetadataUpdate>,
    pub(super) pools: BTreeMap<String, pb::IpamPoolUpdate>,
    /// IPPool resource name → pool id (CIDR with '-').
    pool_ids: FxHashMap<String, String>,
    /// Host metadata and pools as of the last flush.
    pub(super) flushed_host_metadata: BTreeMap<String, pb::HostMetadataUpdate>,
    pub(super) flushed_pools: BTreeMap<String, pb::IpamPoolUpdate>,
    /// Host metadata or pools may differ from what was last flushed: a flush compares the two
    /// (one entry per node of the cluster) only then.
    pub(super) changed: bool,
    /// The messages of the whole state a new subscriber is sent (host metadata, then pools),
    /// built once and kept until either changes: every snapshot shares these allocations, so
    /// a server encodes them once however many snapshots it sends.
    pub(super) full: std::sync::OnceLock<Vec<super::SharedMessage>>,
}

impl Broadcast {
    pub(super) fn set_config(&mut self, name: &str, spec: &BTreeMap<String, serde_json::Value>) {
        let cfg = spec
            .iter()
            .map(|(k, v)| (felix_param_name(k), config_value(v)))
            .collect();
        self.felix_config.insert(name.to_string(), cfg);
        self.config_dirty = true;
    }

    pub(super) fn remove_config(&mut self, name: &str) {
        self.felix_config.remove(name);
        self.config_dirty = true;
    }

    pub(super) fn set_node(&mut self, name: &str, meta: &ObjectMeta, spec: &NodeSpec) {
        let m = host_metadata(meta, spec);
        if self.host_metadata.get(name) != Some(&m) {
            self.host_metadata.insert(name.to_string(), m);
            self.full.take();
            self.changed = true;
        }
    }

    pub(super) fn remove_node(&mut self, name: &str) {
        if self.host_metadata.remove(name).is_some() {
            self.full.take();
            self.changed = true;
        }
    }

    /// Installs (or replaces) the IPPool `name`; a CIDR that does not parse adds no pool.
    pub(super) fn set_pool(&mut self, name: &str, s: &IpPoolSpec) {
        self.remove_pool(name);
        self.full.take();
        self.changed = true;
        if let Some(net) = crate::model::validate::parse_cidr_or_ip(&s.cidr) {
            let cidr = net.to_string();
            let id = cidr.replace('/', "-");
            self.pools.insert(
                id.clone(),
                pb::IpamPoolUpdate {
                    id,
                    pool: Some(pb::IpamPool {
                        cidr,
                        masquerade: s.nat_outgoing,
                        ipip_mode: s.ipip_mode.clone(),
                        vxlan_mode: s.vxlan_mode.clone(),
                        allowed_uses: s.allowed_uses.clone(),
                    }),
                },
            );
            self.pool_ids
                .insert(name.to_string(), net.to_string().replace('/', "-"));
        }
    }

    pub(super) fn remove_pool(&mut self, name: &str) {
        if let Some(id) = self.pool_ids.remove(name) {
            self.pools.remove(&id);
            self.full.take();
            self.changed = true;
        }
    }

    /// A flush has sent the current state to every subscribed node.
    pub(super) fn flushed(&mut self) {
        self.config_dirty = false;
        if !std::mem::take(&mut self.changed) {
            return;
        }
        if self.flushed_host_metadata != self.host_metadata {
            self.flushed_host_metadata = self.host_metadata.clone();
        }
        if self.flushed_pools != self.pools {
            self.flushed_pools = self.pools.clone();
        }
    }

    /// One Felix setting as `node` is sent it: the node's FelixConfiguration over the global.
    pub(super) fn setting(&self, node: &str, key: &str) -> Option<&str> {
        self.felix_config
            .get(&format!("node.{node}"))
            .and_then(|c| c.get(key))
            .or_else(|| self.felix_config.get("default").and_then(|c| c.get(key)))
            .map(String::as_str)
    }

    /// The configuration `node` is sent: the global FelixConfiguration, overlaid by the node's.
    pub(super) fn config_for(&self, node: &str) -> pb::ConfigUpdate {
        let global = self
            .felix_config
            .get("default")
            .cloned()
            .unwrap_or_default();
        let local = self
            .felix_config
            .get(&format!("node.{node}"))
            .cloned()
            .unwrap_or_default();
        let mut config = global.clone();
        config.extend(local.clone());
        let mut raw = BTreeMap::new();
        if !global.is_empty() {
            raw.insert(
                1,
                pb::RawConfig {
                    source: "DatastoreGlobal".into(),
                    config: global,
                },
            );
        }
        if !local.is_empty() {
            raw.insert(
                3,
                pb::RawConfig {
                    source: "DatastorePerHost".into(),
                    config: local,
                },
            );
        }
        pb::ConfigUpdate {
            config,
            source_to_raw_config: raw,
            message: String::new(),
        }
    }
}
