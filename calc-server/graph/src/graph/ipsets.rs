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
use super::sequencer::record_delta;
use super::spans::bump;
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
}

pub(super) struct IpSetState {
    pub(super) spec: IpSetSpec,
    pub(super) selector: SelectorId,
    /// Policies and profiles whose rules reference this set.
    pub(super) defined_refs: u32,
    /// Member ids ([`super::members`]) with how many items contribute each.
    pub(super) members: FxHashMap<MemberId, u32>,
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
        let changed = bump(&mut set.members, &mid, add);
        if !changed {
            return;
        }
        if add {
            self.members.hold(mid);
        } else {
            self.members.release(mid);
        }
        if self.sent_count.contains_key(id) {
            record_delta(self.deltas.entry(id.clone()).or_default(), member, add);
        }
    }
}
