//! The endpoint and network-set tables: what the graph keeps of every item the label index
//! holds, by dense item id.
//!
//! Contract: an item is in exactly one of `endpoints` or `netsets`, under the id `item_of`
//! gives its key, for as long as the label index holds it; its labels live in the label index
//! only (interned), never here. An endpoint's `policies` is the set of policies whose selector
//! matches it, kept in step with the index's match events; its `nets` are its members of every
//! address IP set that selects it.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::{Key, Name};
use crate::convert::{EndpointIds, EndpointKind, EndpointModel, NamedPort, endpoint_ids};
use crate::label_index::ItemId;
use crate::model::ResourceKey;

#[derive(Default)]
pub(super) struct Items {
    pub(super) item_of: FxHashMap<Key, ItemId>,
    /// By item id, which the graph hands out densely: a slot is one pointer (boxed, so spare
    /// capacity and the copy made when the table grows are 8 bytes per slot instead of a whole
    /// endpoint), where a hash map spent 17 bytes and more per entry.
    pub(super) endpoints: ItemTable<EndpointState>,
    pub(super) netsets: FxHashMap<ItemId, NetSetState>,
}

pub(super) struct EndpointState {
    pub(super) key: Key,
    /// What the converted endpoint holds that neither its key, its node, its nets nor the
    /// label index gives ([`StoredEndpoint`]).
    pub(super) model: StoredEndpoint,
    pub(super) node: Name,
    pub(super) policies: KeySet,
    /// The endpoint's CIDRs as shared strings: its members of every selector IP set.
    pub(super) nets: Box<[Arc<str>]>,
}

/// Boxed values by dense item id ([`Items::endpoints`]).
pub(super) struct ItemTable<T> {
    slots: Vec<Option<Box<T>>>,
}

impl<T> Default for ItemTable<T> {
    fn default() -> Self {
        ItemTable { slots: Vec::new() }
    }
}

impl<T> ItemTable<T> {
    pub(super) fn get(&self, id: &ItemId) -> Option<&T> {
        self.slots.get(*id as usize)?.as_deref()
    }

    pub(super) fn get_mut(&mut self, id: &ItemId) -> Option<&mut T> {
        self.slots.get_mut(*id as usize)?.as_deref_mut()
    }

    pub(super) fn contains_key(&self, id: &ItemId) -> bool {
        self.get(id).is_some()
    }

    pub(super) fn insert(&mut self, id: ItemId, value: Box<T>) {
        let i = id as usize;
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some(value);
    }

    pub(super) fn remove(&mut self, id: &ItemId) -> Option<Box<T>> {
        self.slots.get_mut(*id as usize)?.take()
    }

    /// The values with their ids, in id order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (ItemId, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i as ItemId, s.as_deref()?)))
    }
}

impl<T> std::ops::Index<&ItemId> for ItemTable<T> {
    type Output = T;

    fn index(&self, id: &ItemId) -> &T {
        self.get(id).expect("an item of this table")
    }
}

/// The part of an [`EndpointModel`] that must be kept. Its node is the state's `node`, its
/// nets are the state's `nets` (IPv4 first, as converted), its labels and its profile ids (the
/// item's parents, interned) live in the label index, and its ids follow from its key
/// (`convert::endpoint_ids`): keeping each again, as strings in growable vectors, cost about
/// 400 bytes per endpoint (issue 44). Boxed slices and strings, since nothing here grows after
/// conversion.
#[derive(Debug, PartialEq)]
pub(super) struct StoredEndpoint {
    pub(super) ports: Box<[NamedPort]>,
    pub(super) kind: StoredKind,
}

#[derive(Debug, PartialEq)]
pub(super) enum StoredKind {
    Workload {
        generate_name: Box<str>,
        interface_name: Box<str>,
        mac: Box<str>,
        ipv4_nat: Box<[(String, String)]>,
        ipv6_nat: Box<[(String, String)]>,
        allow_spoofed_source_prefixes: Box<[String]>,
    },
    Host {
        interface_name: Box<str>,
        expected_ipv4: Box<[String]>,
        expected_ipv6: Box<[String]>,
    },
}

impl StoredEndpoint {
    /// Splits `model` into what is kept, its node, its nets and its profile ids. The labels
    /// must have been taken out already.
    pub(super) fn split(
        model: EndpointModel,
    ) -> (StoredEndpoint, String, Box<[Arc<str>]>, Vec<String>) {
        let EndpointModel {
            node,
            labels: _,
            profile_ids,
            ipv4_nets,
            ipv6_nets,
            ports,
            kind,
        } = model;
        let nets = ipv4_nets
            .iter()
            .chain(&ipv6_nets)
            .map(|n| Arc::from(n.as_str()))
            .collect();
        let kind = match kind {
            EndpointKind::Workload {
                generate_name,
                interface_name,
                mac,
                ipv4_nat,
                ipv6_nat,
                allow_spoofed_source_prefixes,
                ..
            } => StoredKind::Workload {
                generate_name: generate_name.into(),
                interface_name: interface_name.into(),
                mac: mac.into(),
                ipv4_nat: ipv4_nat.into(),
                ipv6_nat: ipv6_nat.into(),
                allow_spoofed_source_prefixes: allow_spoofed_source_prefixes.into(),
            },
            EndpointKind::Host {
                interface_name,
                expected_ipv4,
                expected_ipv6,
                ..
            } => StoredKind::Host {
                interface_name: interface_name.into(),
                expected_ipv4: expected_ipv4.into(),
                expected_ipv6: expected_ipv6.into(),
            },
        };
        let stored = StoredEndpoint {
            ports: ports.into(),
            kind,
        };
        (stored, node, nets, profile_ids)
    }
}

impl EndpointState {
    /// The endpoint's nets of one family, as converted.
    pub(super) fn nets_of(&self, v6: bool) -> Vec<String> {
        self.nets
            .iter()
            .filter(|n| n.contains(':') == v6)
            .map(|n| n.to_string())
            .collect()
    }

    /// The converted endpoint again, without its labels; its profile ids are the label index's
    /// parents of the item.
    pub(super) fn model(&self, profile_ids: Vec<String>) -> EndpointModel {
        let m = &self.model;
        let kind = match (&m.kind, endpoint_ids(&self.key)) {
            (
                StoredKind::Workload {
                    generate_name,
                    interface_name,
                    mac,
                    ipv4_nat,
                    ipv6_nat,
                    allow_spoofed_source_prefixes,
                },
                Some(EndpointIds::Workload {
                    orchestrator_id,
                    workload_id,
                    endpoint_id,
                    ..
                }),
            ) => EndpointKind::Workload {
                orchestrator_id,
                workload_id,
                generate_name: generate_name.to_string(),
                endpoint_id,
                interface_name: interface_name.to_string(),
                mac: mac.to_string(),
                ipv4_nat: ipv4_nat.to_vec(),
                ipv6_nat: ipv6_nat.to_vec(),
                allow_spoofed_source_prefixes: allow_spoofed_source_prefixes.to_vec(),
            },
            (
                StoredKind::Host {
                    interface_name,
                    expected_ipv4,
                    expected_ipv6,
                },
                _,
            ) => EndpointKind::Host {
                endpoint_id: self.key.name.clone(),
                interface_name: interface_name.to_string(),
                expected_ipv4: expected_ipv4.to_vec(),
                expected_ipv6: expected_ipv6.to_vec(),
            },
            (StoredKind::Workload { .. }, _) => {
                unreachable!("a workload endpoint is stored only under a key that gives its ids")
            }
        };
        EndpointModel {
            node: self.node.to_string(),
            labels: Default::default(),
            profile_ids,
            ipv4_nets: self.nets_of(false),
            ipv6_nets: self.nets_of(true),
            ports: m.ports.to_vec(),
            kind,
        }
    }
}

pub(super) struct NetSetState {
    pub(super) nets: Vec<Arc<str>>,
}

/// A small set of keys, sorted by value in a vector of its exact length: an endpoint is
/// selected by a few to a few dozen policies, and a hash set's buckets and spare capacity took
/// three times the room (this is per endpoint, so it counts at 100,000 endpoints).
#[derive(Default)]
pub(super) struct KeySet(Box<[Key]>);

impl KeySet {
    /// Adds `key`; false if it was there.
    pub(super) fn insert(&mut self, key: &Key) -> bool {
        match self.0.binary_search_by(|k| (**k).cmp(key)) {
            Ok(_) => false,
            Err(at) => {
                let mut v = std::mem::take(&mut self.0).into_vec();
                v.reserve_exact(1);
                v.insert(at, key.clone());
                self.0 = v.into_boxed_slice();
                true
            }
        }
    }

    /// Removes `key`; false if it was not there.
    pub(super) fn remove(&mut self, key: &ResourceKey) -> bool {
        match self.0.binary_search_by(|k| (**k).cmp(key)) {
            Ok(at) => {
                let mut v = std::mem::take(&mut self.0).into_vec();
                v.remove(at);
                self.0 = v.into_boxed_slice();
                true
            }
            Err(_) => false,
        }
    }

    pub(super) fn contains(&self, key: &ResourceKey) -> bool {
        self.0.binary_search_by(|k| (**k).cmp(key)).is_ok()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Key> {
        self.0.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Kind;

    fn key(name: &str) -> Key {
        Arc::new(ResourceKey::new(Kind::GlobalNetworkPolicy, None, name))
    }

    #[test]
    fn a_key_set_holds_each_key_once_in_order() {
        let mut s = KeySet::default();
        assert!(s.insert(&key("b")));
        assert!(s.insert(&key("a")));
        assert!(s.insert(&key("c")));
        // Equal by value, not by pointer: a policy's key is a new Arc after each update.
        assert!(!s.insert(&key("a")));
        assert!(s.contains(&key("c")));
        assert!(s.remove(&key("b")));
        assert!(!s.remove(&key("b")));
        assert!(!s.contains(&key("b")));
        let names: Vec<&str> = s.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
    }
}
