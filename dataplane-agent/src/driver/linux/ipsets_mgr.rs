//! The IP sets manager: the stream's IP sets (and the agent's own pool sets) into the desired
//! [`Sets`], and which sets rules may use.
//!
//! Contract: `on_update` checks each set's id and members and records them; a set with a
//! refused member is *poisoned* until a full update comes back clean, and the ids whose poison
//! changed are returned so the driver re-renders the policies that use them (they fail closed
//! meanwhile). The kernel writer reports the sets the kernel refused
//! ([`IpSetsManager::set_kernel_refused`]); the rules using one fail closed in the same apply.

use std::collections::{BTreeSet, HashSet};

use super::desired::{SetKind, Sets};
use super::refusals::Refusals;
use super::rules::{IpVersion, ipset_name};
use super::validate;
use crate::message::Message;

#[derive(Default)]
pub(crate) struct IpSetsManager {
    /// IP sets some of whose members were refused: policies that use one fail closed.
    poisoned: HashSet<String>,
    /// Kernel names of the IP sets the kernel refused at the last apply.
    refused: BTreeSet<String>,
}

/// Which IP sets rules may use: the manager's verdicts over the desired sets.
pub(crate) struct SetUse<'a> {
    pub mgr: &'a IpSetsManager,
    pub sets: &'a Sets,
}

impl SetUse<'_> {
    /// Whether rules may use the set as sent: known, not poisoned, not refused by the kernel.
    pub(crate) fn usable(&self, id: &str) -> bool {
        let refused = IpVersion::BOTH
            .iter()
            .any(|v| self.mgr.refused.contains(&ipset_name(*v, id)));
        !(self.mgr.poisoned.contains(id) || !self.sets.contains(id) || refused)
    }
}

impl IpSetsManager {
    /// Records an IP set message. Returns the id of a set whose poisoned state changed: the
    /// policies and profiles that use it must be rendered again.
    pub(crate) fn on_update(
        &mut self,
        msg: &Message,
        sets: &mut Sets,
        refusals: &mut Refusals,
    ) -> Option<String> {
        match msg {
            Message::IpSetUpdate {
                id,
                set_type,
                members,
            } => {
                let key = format!("ipset {id:?}");
                if let Err(e) = validate::ipset_id("id", id.as_str()) {
                    refusals.reject(key, e.to_string());
                    return None;
                }
                let refused = sets.replace(id.as_str(), SetKind::from_proto(*set_type), members);
                self.members_checked(id.as_str(), key, refused, true, refusals)
            }
            Message::IpSetDeltaUpdate { id, added, removed } => {
                let key = format!("ipset {id:?}");
                if let Err(e) = validate::ipset_id("id", id.as_str()) {
                    refusals.reject(key, e.to_string());
                    return None;
                }
                let refused = sets.delta(id.as_str(), added, removed);
                self.members_checked(id.as_str(), key, refused, false, refusals)
            }
            Message::IpSetRemove { id } => {
                refusals.accept(&format!("ipset {id:?}"));
                if validate::ipset_id("id", id.as_str()).is_ok() {
                    sets.remove(id.as_str());
                    if self.poisoned.remove(id.as_str()) {
                        return Some(id.as_str().to_owned());
                    }
                }
                None
            }
            _ => None,
        }
    }

    /// After an IP set's members were checked: a set with refused members is poisoned, and the
    /// policies and profiles that use it fail closed until a full update comes back clean.
    fn members_checked(
        &mut self,
        id: &str,
        what: String,
        refused: Vec<String>,
        full: bool,
        refusals: &mut Refusals,
    ) -> Option<String> {
        if !refused.is_empty() {
            let reason = format!(
                "{} member(s) refused: {}",
                refused.len(),
                refused.join("; ")
            );
            refusals.reject(what, reason);
            if self.poisoned.insert(id.to_owned()) {
                return Some(id.to_owned());
            }
        } else if full {
            refusals.accept(&what);
            if self.poisoned.remove(id) {
                return Some(id.to_owned());
            }
        }
        None
    }

    /// The kernel names of the sets the kernel refused, as the writer found them. Returns the
    /// names whose refusal changed (the rules using them must fail closed, or open up again,
    /// in this same apply).
    pub(crate) fn set_kernel_refused(&mut self, refused: BTreeSet<String>) -> BTreeSet<String> {
        if refused == self.refused {
            return BTreeSet::new();
        }
        let changed = refused
            .symmetric_difference(&self.refused)
            .cloned()
            .collect();
        self.refused = refused;
        changed
    }
}
