//! The policy manager: active policies and profiles, rendered into their `cali-pi-`/`cali-po-`
//! and `cali-pri-`/`cali-pro-` chains.
//!
//! Contract: `on_update` checks each policy and profile (`validate`) and records it; one that
//! fails is kept in place as a single deny (its place in the tiers is kept, whatever reaches it
//! is denied). [`PolicyManager::apply`] renders only what changed, into the table Felix puts it
//! in (raw for doNotTrack, mangle for preDNAT, filter otherwise; outbound chains also in mangle
//! while a host endpoint's egress uses them). A policy or profile naming an IP set that is not
//! programmed as sent (never sent, poisoned, refused by the kernel) fails closed the same way
//! until the set is usable again.

use std::collections::{BTreeMap, HashMap, HashSet};

use felix_proto::{HostEndpoint, Policy, Profile, Rule};
use tracing::{info, warn};

use super::desired::Tables;
use super::ipsets_mgr::SetUse;
use super::refusals::Refusals;
use super::rules::policy::{self, RenderConfig};
use super::rules::{self};
use super::validate;
use crate::driver::programmed::Collector;
use crate::message::{Message, PolicyKey, ProfileKey};

/// A rule that denies everything.
fn deny_all() -> Rule {
    Rule {
        action: "deny".to_owned(),
        ..Default::default()
    }
}

/// What a refused policy is programmed as: its place in the tiers is kept, but whatever
/// reaches it is denied, so a policy we cannot render never lets traffic through.
fn fail_closed_policy(p: &Policy) -> Policy {
    Policy {
        inbound_rules: vec![deny_all()],
        outbound_rules: vec![deny_all()],
        untracked: p.untracked,
        pre_dnat: p.pre_dnat,
        ..Default::default()
    }
}

/// What a refused profile is programmed as.
fn fail_closed_profile() -> Profile {
    Profile {
        inbound_rules: vec![deny_all()],
        outbound_rules: vec![deny_all()],
    }
}

#[derive(Default)]
pub(crate) struct PolicyManager {
    policies: HashMap<PolicyKey, Policy>,
    dirty_policies: HashSet<PolicyKey>,
    profiles: HashMap<ProfileKey, Profile>,
    dirty_profiles: HashSet<ProfileKey>,
    /// Normal policies and profiles some host endpoint uses for egress: their outbound chains
    /// are also in the mangle table, for DNAT'd host traffic (Felix puts every policy in every
    /// table and programs what is used; we place only what is used).
    mangle_policies: HashSet<PolicyKey>,
    mangle_profiles: HashSet<ProfileKey>,
    /// Policies and profiles held failing closed because an IP set they use is unknown or
    /// poisoned, "<kind> <key>" → reason (kept apart from the refusals on receipt: it clears
    /// on its own once the set is programmed as sent).
    set_refused: BTreeMap<String, String>,
}

impl PolicyManager {
    pub(crate) fn on_update(&mut self, msg: &Message, refusals: &mut Refusals) {
        match msg {
            Message::PolicyUpdate { key: k, policy: p } => {
                let id = k.to_proto();
                let key = format!("policy {}", rules::policy_id_string(&id));
                let p = match validate::policy(&id, p) {
                    Ok(()) => {
                        refusals.accept(&key);
                        p.clone()
                    }
                    Err(e) => {
                        refusals.reject(key, e.to_string());
                        fail_closed_policy(p)
                    }
                };
                self.policies.insert(k.clone(), p);
                self.dirty_policies.insert(k.clone());
            }
            Message::PolicyRemove { key: k } => {
                refusals.accept(&format!(
                    "policy {}",
                    rules::policy_id_string(&k.to_proto())
                ));
                self.policies.remove(k);
                self.dirty_policies.insert(k.clone());
            }
            Message::ProfileUpdate {
                key: id,
                profile: p,
            } => {
                let key = format!("profile {id:?}");
                let p = match validate::profile(id.as_str(), p) {
                    Ok(()) => {
                        refusals.accept(&key);
                        p.clone()
                    }
                    Err(e) => {
                        refusals.reject(key, e.to_string());
                        fail_closed_profile()
                    }
                };
                self.profiles.insert(id.clone(), p);
                self.dirty_profiles.insert(id.clone());
            }
            Message::ProfileRemove { key: id } => {
                refusals.accept(&format!("profile {id:?}"));
                self.profiles.remove(id);
                self.dirty_profiles.insert(id.clone());
            }
            _ => {}
        }
    }

    /// Marks for re-rendering every policy and profile whose rules name the set.
    pub(crate) fn dirty_users_of_set(&mut self, id: &str) {
        self.dirty_users_of_sets(|i| i == id);
    }

    /// Marks the policies and profiles that use a set `affected` says yes to for re-rendering.
    pub(crate) fn dirty_users_of_sets(&mut self, affected: impl Fn(&str) -> bool) {
        let uses = |rules: &[Rule]| {
            rules.iter().any(|r| {
                validate::rule_set_ids(r)
                    .iter()
                    .any(|(_, ids)| ids.iter().any(|i| affected(i)))
            })
        };
        for (k, p) in &self.policies {
            if uses(&p.inbound_rules) || uses(&p.outbound_rules) {
                self.dirty_policies.insert(k.clone());
            }
        }
        for (k, p) in &self.profiles {
            if uses(&p.inbound_rules) || uses(&p.outbound_rules) {
                self.dirty_profiles.insert(k.clone());
            }
        }
    }

    /// Every policy and profile renders differently (the log prefix changed).
    pub(crate) fn dirty_all(&mut self) {
        self.dirty_policies.extend(self.policies.keys().cloned());
        self.dirty_profiles.extend(self.profiles.keys().cloned());
    }

    /// Recomputes which policies and profiles host endpoint egress uses, and marks the ones
    /// that joined or left that set for re-rendering.
    pub(crate) fn refresh_mangle_refs<'a>(
        &mut self,
        heps: impl Iterator<Item = &'a HostEndpoint> + Clone,
    ) {
        let policies: HashSet<PolicyKey> = heps
            .clone()
            .flat_map(|h| h.tiers.iter().flat_map(|t| &t.egress_policies))
            .map(PolicyKey::from)
            .collect();
        let profiles: HashSet<ProfileKey> = heps
            .flat_map(|h| h.profile_ids.iter().map(ProfileKey::new))
            .collect();
        self.dirty_policies.extend(
            policies
                .symmetric_difference(&self.mangle_policies)
                .cloned(),
        );
        self.dirty_profiles.extend(
            profiles
                .symmetric_difference(&self.mangle_profiles)
                .cloned(),
        );
        self.mangle_policies = policies;
        self.mangle_profiles = profiles;
    }

    /// Renders the policies and profiles that changed into `tables`.
    pub(crate) fn apply(
        &mut self,
        tables: &mut Tables,
        render: &RenderConfig,
        ipsets: &SetUse<'_>,
    ) {
        self.render_policies(tables, render, ipsets);
        self.render_profiles(tables, render, ipsets);
    }

    fn render_policies(&mut self, tables: &mut Tables, render: &RenderConfig, ipsets: &SetUse<'_>) {
        for key in std::mem::take(&mut self.dirty_policies) {
            let id = key.to_proto();
            let names = [
                rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &id),
                rules::policy_chain_name(rules::POLICY_OUTBOUND_PFX, &id),
            ];
            let what = format!("policy {}", rules::policy_id_string(&id));
            let p = self.policies.get(&key).cloned();
            if p.is_none() {
                self.set_refused.remove(&what);
            }
            let p = p.map(|p| {
                if self.sets_usable(what.clone(), &p.inbound_rules, &p.outbound_rules, ipsets) {
                    p
                } else {
                    fail_closed_policy(&p)
                }
            });
            for v in tables.versions().to_vec() {
                tables.remove_everywhere(v, &names);
                let Some(p) = &p else {
                    continue;
                };
                // Felix puts a policy in the table of the chains that use it.
                let table = if p.untracked {
                    "raw"
                } else if p.pre_dnat {
                    "mangle"
                } else {
                    "filter"
                };
                let chains = policy::policy_chains(render, &id, p, v);
                if table == "filter" && self.mangle_policies.contains(&key) {
                    let t = tables.table(v, "mangle");
                    chains
                        .iter()
                        .filter(|c| c.name.starts_with(rules::POLICY_OUTBOUND_PFX))
                        .for_each(|c| t.set_owned_chain(c.clone(), &what));
                }
                let t = tables.table(v, table);
                chains.into_iter().for_each(|c| t.set_owned_chain(c, &what));
            }
        }
    }

    fn render_profiles(&mut self, tables: &mut Tables, render: &RenderConfig, ipsets: &SetUse<'_>) {
        for name in std::mem::take(&mut self.dirty_profiles) {
            let names = [
                rules::profile_chain_name(rules::PROFILE_INBOUND_PFX, name.as_str()),
                rules::profile_chain_name(rules::PROFILE_OUTBOUND_PFX, name.as_str()),
            ];
            let what = format!("profile {name:?}");
            let p = self.profiles.get(&name).cloned();
            if p.is_none() {
                self.set_refused.remove(&what);
            }
            let p = p.map(|p| {
                if self.sets_usable(what.clone(), &p.inbound_rules, &p.outbound_rules, ipsets) {
                    p
                } else {
                    fail_closed_profile()
                }
            });
            for v in tables.versions().to_vec() {
                tables.remove_everywhere(v, &names);
                let Some(p) = &p else {
                    continue;
                };
                let chains = policy::profile_chains(render, name.as_str(), p, v);
                if self.mangle_profiles.contains(&name) {
                    let t = tables.table(v, "mangle");
                    chains
                        .iter()
                        .filter(|c| c.name.starts_with(rules::PROFILE_OUTBOUND_PFX))
                        .for_each(|c| t.set_owned_chain(c.clone(), &what));
                }
                let t = tables.table(v, "filter");
                chains.into_iter().for_each(|c| t.set_owned_chain(c, &what));
            }
        }
    }

    /// Whether every IP set the rules name is programmed as sent (known and not poisoned).
    /// Records a refusal of `what` when not, and clears an earlier one of this kind when so;
    /// a refusal from `validate` on receipt is kept apart and left alone.
    fn sets_usable(
        &mut self,
        what: String,
        inbound: &[Rule],
        outbound: &[Rule],
        ipsets: &SetUse<'_>,
    ) -> bool {
        let unusable = inbound.iter().chain(outbound).find_map(|r| {
            validate::rule_set_ids(r)
                .into_iter()
                .find_map(|(_, ids)| ids.iter().find(|i| !ipsets.usable(i)))
        });
        match unusable {
            Some(set) => {
                let reason = format!("uses IP set {set:?}, which was refused or never sent");
                if self.set_refused.get(&what) != Some(&reason) {
                    warn!(object = %what, %reason, "refused an object from the calc-server; failing closed for it");
                    self.set_refused.insert(what, reason);
                }
                false
            }
            None => {
                if self.set_refused.remove(&what).is_some() {
                    info!(object = %what, "the IP sets it uses are programmed again");
                }
                true
            }
        }
    }

    /// Policies and profiles held failing closed for the IP sets they use.
    /// The proto id of every policy held, by the key its rule ids carry
    /// ([`rules::policy_id_string`]).
    pub(crate) fn policy_ids(&self) -> HashMap<String, felix_proto::PolicyId> {
        self.policies
            .keys()
            .map(|k| {
                let id = k.to_proto();
                (rules::policy_id_string(&id), id)
            })
            .collect()
    }

    pub(crate) fn set_refused(&self) -> &BTreeMap<String, String> {
        &self.set_refused
    }

    /// Adds every policy and profile held (failing closed or not: their chains exist).
    pub(crate) fn collect(&self, c: &mut Collector) {
        for (key, policy) in &self.policies {
            c.policy(key, policy);
        }
        self.profiles
            .keys()
            .for_each(|name| c.profile(name.as_str()));
    }
}
