//! The policy tables: every policy (with its place in the cluster-wide order), profile and
//! tier, as converted and scanned once for all nodes.
//!
//! Contract: `by_key` holds the last good version of every policy (staged ones included) with
//! its proto message and ActivePolicyUpdate built once and shared by every node that needs
//! it; `everywhere` the policies hinted `AssumeNeededOnEveryNode`; `profiles` every Profile
//! that exists (a profile an endpoint lists and nobody defines is sent deny-both-ways by the
//! sequencer). Each policy's `rank` is its position in the order endpoints list policies, valid
//! while `ranks_stale` is false (see [`Policies::refresh_ranks`]). Tiers are looked up
//! in one place, [`Policies::tier`].

use std::collections::BTreeSet;

use felix_proto as pb;
use pb::to_dataplane::Payload;
use rustc_hash::FxHashMap;

use super::{Key, Name, SharedMessage};
use crate::convert::PolicyModel;
use crate::label_index::SelectorId;
use crate::policy_resolver::{PolicyRef, TierMeta, cmp_policies};

/// [`network_policy_api::BUILTIN_TIERS`](crate::model::network_policy_api::BUILTIN_TIERS) as
/// the resolver reads tiers.
static BUILTIN_TIERS: std::sync::LazyLock<Vec<(&'static str, TierMeta)>> =
    std::sync::LazyLock::new(|| {
        crate::model::network_policy_api::BUILTIN_TIERS
            .iter()
            .map(|t| {
                (
                    t.name,
                    TierMeta {
                        order: Some(t.order),
                        default_action: t.default_action.to_string(),
                    },
                )
            })
            .collect()
    });

#[derive(Default)]
pub(super) struct Policies {
    /// Boxed, as `Items::endpoints` (spare capacity and growth copies cost a pointer per slot).
    pub(super) by_key: FxHashMap<Key, Box<PolicyState>>,
    /// Policies with the AssumeNeededOnEveryNode hint: active on every node.
    pub(super) everywhere: BTreeSet<Key>,
    pub(super) profiles: FxHashMap<Name, ProfileState>,
    pub(super) tiers: FxHashMap<String, TierMeta>,
    /// Policy ranks need recomputing ([`Policies::refresh_ranks`]).
    pub(super) ranks_stale: bool,
}

pub(super) struct PolicyState {
    pub(super) model: PolicyModel,
    pub(super) sort_string: String,
    /// Position in the order of every policy ([`Policies::refresh_ranks`]); valid
    /// while `ranks_stale` is false.
    pub(super) rank: u32,
    pub(super) selector: SelectorId,
    pub(super) ipsets: Vec<Name>,
    /// The ActivePolicyUpdate, built once and shared by every node; the one holder of the
    /// policy's rules as sent ([`PolicyState::message`]).
    pub(super) update: SharedMessage,
}

impl PolicyState {
    /// The policy as the nodes are sent it.
    pub(super) fn message(&self) -> &pb::Policy {
        policy_of(&self.update)
    }
}

pub(super) struct ProfileState {
    /// The ActiveProfileUpdate, built once and shared by every node; the one holder of the
    /// profile's rules as sent ([`ProfileState::message`]).
    pub(super) update: SharedMessage,
    pub(super) ipsets: Vec<Name>,
}

impl ProfileState {
    /// The profile as the nodes are sent it.
    pub(super) fn message(&self) -> &pb::Profile {
        profile_of(&self.update)
    }
}

/// The policy an ActivePolicyUpdate carries. The graph builds every one with its policy
/// (`set_policy`), so the empty default is never seen.
pub(super) fn policy_of(update: &pb::ToDataplane) -> &pb::Policy {
    static EMPTY: std::sync::LazyLock<pb::Policy> = std::sync::LazyLock::new(Default::default);
    match &update.payload {
        Some(Payload::ActivePolicyUpdate(u)) => u.policy.as_ref(),
        _ => None,
    }
    .unwrap_or(&EMPTY)
}

/// The profile an ActiveProfileUpdate carries (built with it by `profile_messages`).
pub(super) fn profile_of(update: &pb::ToDataplane) -> &pb::Profile {
    static EMPTY: std::sync::LazyLock<pb::Profile> = std::sync::LazyLock::new(Default::default);
    match &update.payload {
        Some(Payload::ActiveProfileUpdate(u)) => u.profile.as_ref(),
        _ => None,
    }
    .unwrap_or(&EMPTY)
}

impl Policies {
    /// The tier of that name: its Tier resource, else the built-in tier every Calico
    /// datastore holds under that name (`model::network_policy_api::BUILTIN_TIERS`), else
    /// none (sorted last, as Felix sorts a tier it has no data for).
    pub(super) fn tier(&self, name: &str) -> Option<&TierMeta> {
        self.tiers.get(name).or_else(|| {
            BUILTIN_TIERS
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, t)| t)
        })
    }

    /// Numbers every policy in the order endpoints list them (tiers, then order, then name),
    /// so building an endpoint's tier lists sorts integers. Recomputed only after a policy's
    /// placement or a tier changed.
    pub(super) fn refresh_ranks(&mut self) {
        if !self.ranks_stale {
            return;
        }
        let mut order: Vec<(Option<&TierMeta>, PolicyRef<'_>, &Key)> = self
            .by_key
            .iter()
            .map(|(k, p)| {
                let r = PolicyRef {
                    model: &p.model,
                    sort_string: &p.sort_string,
                };
                (self.tier(&p.model.tier), r, k)
            })
            .collect();
        order.sort_by(|(ta, a, _), (tb, b, _)| cmp_policies((a, *ta), (b, *tb)));
        let keys: Vec<Key> = order.into_iter().map(|(_, _, k)| k.clone()).collect();
        for (rank, k) in keys.iter().enumerate() {
            if let Some(p) = self.by_key.get_mut(k) {
                p.rank = u32::try_from(rank).expect("fewer than 2^32 policies");
            }
        }
        self.ranks_stale = false;
    }
}
