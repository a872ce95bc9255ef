//! Id allocation: the dense ids the label index works with, and who owns each selector.
//!
//! Contract: an item id (an endpoint or network set) and a selector id (a policy's or an IP
//! set's) is handed out by [`Ids::item`] / [`Ids::selector`] and given back by
//! [`Ids::free_item`] / [`Ids::free_selector`] when its owner goes; freed ids are reused first,
//! so ids stay small (they index the label index's vectors) and never run out however many
//! updates a long-running server sees. A selector's owner is recorded while it is allocated.

use rustc_hash::FxHashMap;

use super::{Key, Name};
use crate::label_index::{ItemId, SelectorId};

/// What a label-index selector stands for: its match events go there.
pub(super) enum SelectorOwner {
    Policy(Key),
    IpSet(Name),
}

#[derive(Default)]
pub(super) struct Ids {
    pub(super) next_item: ItemId,
    pub(super) next_selector: SelectorId,
    free_items: Vec<ItemId>,
    free_selectors: Vec<SelectorId>,
    owners: FxHashMap<SelectorId, SelectorOwner>,
}

impl Ids {
    pub(super) fn item(&mut self) -> ItemId {
        if let Some(id) = self.free_items.pop() {
            return id;
        }
        self.next_item += 1;
        self.next_item
    }

    pub(super) fn free_item(&mut self, id: ItemId) {
        self.free_items.push(id);
    }

    /// A selector id owned by `owner`.
    pub(super) fn selector(&mut self, owner: SelectorOwner) -> SelectorId {
        let id = match self.free_selectors.pop() {
            Some(id) => id,
            None => {
                self.next_selector += 1;
                self.next_selector
            }
        };
        self.owners.insert(id, owner);
        id
    }

    pub(super) fn free_selector(&mut self, id: SelectorId) {
        self.owners.remove(&id);
        self.free_selectors.push(id);
    }

    pub(super) fn owner(&self, id: SelectorId) -> Option<&SelectorOwner> {
        self.owners.get(&id)
    }
}
