//! IP sets: every set some policy or profile defines, its members, and the net change each
//! subscribed node has still to be sent.
//!
//! Contract: a set exists while at least one policy or profile references it
//! (`defined_refs`); its members are interned ([`super::members`]) and counted per
//! contributing item or EndpointSlice, so two contributors of one address make one member.
//! `deltas` holds, per set, the net member change since the last flush (an add and a remove
//! of one member cancel), and only for sets some subscribed node holds (`sent_count`); a set
//! no node holds is sent whole when a node first needs it.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::Name;
use super::members::{MemberId, Members};
use super::sequencer::{SharedMessage, record_delta};
use crate::label_index::SelectorId;
use crate::rule_scanner::IpSetSpec;

#[derive(Default)]
pub(super) struct IpSets {
    pub(super) sets: FxHashMap<Name, IpSetState>,
    /// Every IP-set member string, once.
    pub(super) members: Members,
    /// Net member changes since the last flush, per IP set id: `true` added, `false` removed.
    pub(super) deltas: FxHashMap<Name, FxHashMap<Arc<str>, bool>>,
    /// How many subscribed nodes hold each IP set.
    pub(super) sent_count: FxHashMap<Name, u32>,
    /// Whole-set messages built by earlier flushes, kept until the set's members change or it
    /// goes, or the caller releases them ([`super::CalcGraph::release_message_cache`]): while
    /// agents keep connecting, each flush would otherwise list and sort every set again.
    pub(super) full: FxHashMap<Name, SharedMessage>,
}

pub(super) struct IpSetState {
    pub(super) spec: IpSetSpec,
    pub(super) selector: SelectorId,
    /// Policies and profiles whose rules reference this set.
    pub(super) defined_refs: u32,
    /// Member ids ([`super::members`]) with how many items contribute each.
    pub(super) members: MemberCounts,
}

/// Member ids with their contributor counts. Nearly every member has one contributor (one
/// endpoint per address), so membership is a compressed bitmap of the ids (ids are dense) and
/// only counts above one sit in a map: about 2 bytes per member instead of a hash map's 12 to
/// 20, for every membership of every endpoint in every set that selects it.
#[derive(Default)]
pub(super) struct MemberCounts {
    members: roaring::RoaringBitmap,
    /// Contributors beyond the first, for the members that have more than one.
    extra: FxHashMap<MemberId, u32>,
}

impl MemberCounts {
    /// One contributor more (`add`) or fewer of `id`; true when it became or stopped being a
    /// member. Dropping an absent id is a no-op.
    pub(super) fn bump(&mut self, id: MemberId, add: bool) -> bool {
        if add {
            if self.members.insert(id) {
                return true;
            }
            *self.extra.entry(id).or_insert(0) += 1;
            return false;
        }
        match self.extra.get_mut(&id) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.extra.remove(&id);
            }
            None => return self.members.remove(id),
        }
        false
    }

    pub(super) fn contains(&self, id: MemberId) -> bool {
        self.members.contains(id)
    }

    #[cfg(test)]
    /// How many items contribute `id` (0 when it is not a member).
    pub(super) fn count(&self, id: MemberId) -> u32 {
        match self.members.contains(id) {
            true => 1 + self.extra.get(&id).copied().unwrap_or(0),
            false => 0,
        }
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = MemberId> + '_ {
        self.members.iter()
    }
}

impl IpSets {
    /// One contributor more (`add`) or fewer of `member` in set `id`; only the member's first
    /// arrival and last departure change the set, and then the pending delta.
    pub(super) fn member_change(&mut self, id: &Name, member: Arc<str>, add: bool) {
        let Some(set) = self.sets.get_mut(id) else {
            return;
        };
        let mid = if add {
            self.members.id(&member)
        } else {
            match self.members.existing(&member) {
                Some(mid) => mid,
                None => return,
            }
        };
        // Members are reference counted: two endpoints with one address make one member, and
        // only its first arrival and last departure change the set.
        let changed = set.members.bump(mid, add);
        if !changed {
            return;
        }
        if add {
            self.members.hold(mid);
        } else {
            self.members.release(mid);
        }
        self.full.remove(id);
        if self.sent_count.contains_key(id) {
            record_delta(self.deltas.entry(id.clone()).or_default(), member, add);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_stays_until_its_last_contributor_leaves() {
        let mut m = MemberCounts::default();
        assert!(m.bump(7, true), "first contributor: a new member");
        assert!(!m.bump(7, true));
        assert!(!m.bump(7, true));
        assert_eq!(m.count(7), 3);
        assert!(!m.bump(7, false));
        assert!(!m.bump(7, false));
        assert!(m.contains(7));
        assert!(m.bump(7, false), "last contributor: no longer a member");
        assert_eq!(m.count(7), 0);
        assert!(!m.bump(7, false), "dropping an absent member is a no-op");
        assert!(m.bump(3, true));
        assert!(m.bump(9, true));
        assert_eq!(m.ids().collect::<Vec<_>>(), [3, 9]);
    }
}
