//! The IP sets manager: the stream's IP sets (and the agent's own pool sets) as the kernel
//! should hold them, in Calico's `cali40…`/`cali60…` names.
//!
//! Contract: `on_update` checks each set's id and members and records them; a set with a
//! refused member is *poisoned* until a full update comes back clean, and the ids whose poison
//! changed are returned so the driver re-renders the policies that use them (they fail closed
//! meanwhile). `apply` is split in two around the tables, as Felix does: [`IpSetsManager::apply_updates`]
//! creates and fills sets before any rule refers to them, [`IpSetsManager::apply_deletions`]
//! destroys unused ones after no rule does. A set the kernel refuses is reported by kernel name
//! so the rules using it fail closed in the same apply.

use std::collections::{BTreeSet, HashSet};

use tracing::debug;

use super::ipsets::{IpSetError, IpSets, Migration, SetKind};
use super::refusals::Refusals;
use super::rules::IpVersion;
use super::runner::CommandRunner;
use super::validate;
use crate::message::Message;

pub(crate) struct IpSetsManager {
    sets: IpSets,
    /// IP sets some of whose members were refused: policies that use one fail closed.
    poisoned: HashSet<String>,
    /// Kernel names of the IP sets the kernel refused at the last apply.
    refused: BTreeSet<String>,
}

impl IpSetsManager {
    pub(crate) fn new(versions: Vec<IpVersion>) -> Self {
        Self {
            sets: IpSets::new(versions),
            poisoned: HashSet::new(),
            refused: BTreeSet::new(),
        }
    }

    /// Records an IP set message. Returns the id of a set whose poisoned state changed: the
    /// policies and profiles that use it must be rendered again.
    pub(crate) fn on_update(&mut self, msg: &Message, refusals: &mut Refusals) -> Option<String> {
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
                let refused =
                    self.sets
                        .replace(id.as_str(), SetKind::from_proto(*set_type), members);
                self.members_checked(id.as_str(), key, refused, true, refusals)
            }
            Message::IpSetDeltaUpdate { id, added, removed } => {
                let key = format!("ipset {id:?}");
                if let Err(e) = validate::ipset_id("id", id.as_str()) {
                    refusals.reject(key, e.to_string());
                    return None;
                }
                let refused = self.sets.delta(id.as_str(), added, removed);
                self.members_checked(id.as_str(), key, refused, false, refusals)
            }
            Message::IpSetRemove { id } => {
                refusals.accept(&format!("ipset {id:?}"));
                if validate::ipset_id("id", id.as_str()).is_ok() {
                    self.sets.remove(id.as_str());
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

    /// Replaces one of the agent's own sets (not from the stream; its members are trusted).
    pub(crate) fn replace_local(&mut self, id: &str, kind: SetKind, members: &[String]) {
        self.sets.replace(id, kind, members);
    }

    /// Whether rules may use the set as sent: known, not poisoned, not refused by the kernel.
    pub(crate) fn usable(&self, id: &str) -> bool {
        !(self.poisoned.contains(id) || !self.sets.contains(id) || self.sets.is_refused(id))
    }

    /// Creates and updates sets. Returns the kernel names whose refusal by the kernel changed
    /// (the rules using them must fail closed, or open up again, in this same apply).
    pub(crate) fn apply_updates(
        &mut self,
        runner: &mut dyn CommandRunner,
    ) -> Result<BTreeSet<String>, IpSetError> {
        let st = self.sets.apply_updates(runner)?;
        if st != Default::default() {
            debug!(?st, "ipsets updated");
        }
        let refused: BTreeSet<String> = self
            .sets
            .refused()
            .map(|(name, _, _)| name.to_owned())
            .collect();
        if refused == self.refused {
            return Ok(BTreeSet::new());
        }
        let changed = refused
            .symmetric_difference(&self.refused)
            .cloned()
            .collect();
        self.refused = refused;
        Ok(changed)
    }

    /// Type changes built beside the old sets by the last `apply_updates`.
    pub(crate) fn migrations(&self) -> &[Migration] {
        self.sets.migrations()
    }

    pub(crate) fn finish_migrations(
        &mut self,
        runner: &mut dyn CommandRunner,
    ) -> Result<(), IpSetError> {
        self.sets.finish_migrations(runner)
    }

    pub(crate) fn abandon_migrations(&mut self) {
        self.sets.abandon_migrations();
    }

    /// Destroys the sets nothing wants any more (after the tables stopped using them).
    pub(crate) fn apply_deletions(
        &mut self,
        runner: &mut dyn CommandRunner,
    ) -> Result<(), IpSetError> {
        let destroyed = self.sets.apply_deletions(runner)?;
        if destroyed > 0 {
            debug!(destroyed, "unused ipsets destroyed");
        }
        Ok(())
    }

    /// Sets the kernel refused: (kernel name, the calc-server's id, the kernel's error).
    pub(crate) fn kernel_refused(&self) -> impl Iterator<Item = (&str, &str, &str)> {
        self.sets.refused()
    }

    /// The sets themselves, for the nftables writer (which programs them as nft sets).
    pub(crate) fn sets_mut(&mut self) -> &mut IpSets {
        &mut self.sets
    }

    /// (sets, members) of ours.
    pub(crate) fn counts(&self) -> (usize, usize) {
        self.sets.counts()
    }

    /// The next apply reads the kernel back and repairs what differs.
    pub(crate) fn invalidate(&mut self) {
        self.sets.invalidate();
    }
}
