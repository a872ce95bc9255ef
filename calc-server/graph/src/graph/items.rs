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
use crate::convert::EndpointModel;
use crate::label_index::ItemId;
use crate::model::ResourceKey;

#[derive(Default)]
pub(super) struct Items {
    pub(super) item_of: FxHashMap<Key, ItemId>,
    /// Boxed: the table then holds pointers, so its spare capacity and the copy made when it
    /// grows are 8 bytes per slot instead of a whole endpoint.
    pub(super) endpoints: FxHashMap<ItemId, Box<EndpointState>>,
    pub(super) netsets: FxHashMap<ItemId, NetSetState>,
}

pub(super) struct EndpointState {
    pub(super) key: Key,
    /// The converted endpoint without its labels, which the label index holds.
    pub(super) model: EndpointModel,
    pub(super) node: Name,
    pub(super) policies: KeySet,
    /// The endpoint's CIDRs as shared strings: its members of every selector IP set.
    pub(super) nets: Vec<Arc<str>>,
}

pub(super) struct NetSetState {
    pub(super) nets: Vec<Arc<str>>,
}

/// A small set of keys, sorted by value in a vector of its exact length: an endpoint is
/// selected by a few to a few dozen policies, and a hash set's buckets and spare capacity took
/// three times the room (this is per endpoint, so it counts at 100,000 endpoints).
#[derive(Default)]
pub(super) struct KeySet(Vec<Key>);

impl KeySet {
    /// Adds `key`; false if it was there.
    pub(super) fn insert(&mut self, key: &Key) -> bool {
        match self.0.binary_search_by(|k| (**k).cmp(key)) {
            Ok(_) => false,
            Err(at) => {
                self.0.reserve_exact(1);
                self.0.insert(at, key.clone());
                true
            }
        }
    }

    /// Removes `key`; false if it was not there.
    pub(super) fn remove(&mut self, key: &ResourceKey) -> bool {
        match self.0.binary_search_by(|k| (**k).cmp(key)) {
            Ok(at) => {
                self.0.remove(at);
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
