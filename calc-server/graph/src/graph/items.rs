//! The endpoint and network-set tables: what the graph keeps of every item the label index
//! holds, by dense item id.
//!
//! Contract: an item is in exactly one of `endpoints` or `netsets`, under the id `item_of`
//! gives its key, for as long as the label index holds it; its labels live in the label index
//! only (interned), never here. An endpoint's `policies` is the set of policies whose selector
//! matches it, kept in step with the index's match events; its `nets` are its members of every
//! address IP set that selects it.

use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use super::{Key, Name};
use crate::convert::EndpointModel;
use crate::label_index::ItemId;

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
    pub(super) policies: FxHashSet<Key>,
    /// The endpoint's CIDRs as shared strings: its members of every selector IP set.
    pub(super) nets: Vec<Arc<str>>,
}

pub(super) struct NetSetState {
    pub(super) nets: Vec<Arc<str>>,
}
