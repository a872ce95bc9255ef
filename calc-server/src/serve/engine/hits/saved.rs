//! Persistence of the hit counters: the document `serve` keeps across a restart (in the status
//! directory, or in etcd as parts).
//!
//! Contract:
//! - [`Hits::saved`] copies the counters, observation times and totals by action into a
//!   [`SavedHits`] (versioned JSON, [`SAVED_VERSION`]), sorted so that equal state saves equal
//!   bytes; `serve` writes it off the engine. What a stream was sent is never saved (streams
//!   do not outlive the process). Times are milliseconds since the Unix epoch.
//! - [`Hits::restore`] merges one into what is counted (counts and totals add up, each rule's
//!   observation time is the earlier of the two), whenever the store could be read: before
//!   the first report or after some. The document is untrusted: entries with an owner no
//!   agent report could name, a node that is no id, or a verdict with a rule index are
//!   skipped and counted. Restored entries of policies, profiles, tiers and nodes gone from the
//!   datastore are pruned like any others.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use calc_graph::model::Kind;
use serde::{Deserialize, Serialize};

use super::{Counts, Hits, Owner, Seen, is_id};

/// The version of [`SavedHits`] this build writes and reads.
pub(crate) const SAVED_VERSION: u32 = 1;

/// Milliseconds since the Unix epoch (how [`SavedHits`] spells times).
fn to_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(super) fn from_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

/// One rule's counters on one node, as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedCount {
    pub owner: Owner,
    /// `None` (null): the folded departed nodes.
    pub node: Option<String>,
    pub egress: bool,
    pub index: u32,
    pub packets: u64,
    pub bytes: u64,
    /// Receive times of the first and last report with a hit, in ms since the Unix epoch.
    pub first_ms: u64,
    pub last_ms: u64,
}

/// What is known of one policy or profile beyond its counters, as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedSeen {
    pub owner: Owner,
    /// When each ingress and egress rule was first in force on a node that reports stats, in
    /// ms since the Unix epoch, by index.
    pub ingress_since_ms: Vec<u64>,
    pub egress_since_ms: Vec<u64>,
    /// Packets and bytes by action: allow, deny, pass, log.
    pub by_action: [(u64, u64); 4],
}

/// The hit counters as `serve` keeps them on disk: see the module documentation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedHits {
    /// [`SAVED_VERSION`]; a reader refuses any other.
    pub version: u32,
    pub counts: Vec<SavedCount>,
    pub seen: Vec<SavedSeen>,
}

/// Whether a saved owner is one an agent's report could have named ([`parse`]'s checks): a
/// damaged or foreign file cannot put anything else in memory.
pub(super) fn valid_owner(owner: &Owner) -> bool {
    match owner {
        Owner::Policy {
            kind,
            namespace,
            name,
        } => {
            Kind::from_name(kind).is_some_and(Kind::is_policy)
                && (namespace.is_empty() || calc_graph::model::validate::is_label(namespace))
                && is_id(name)
        }
        Owner::Profile(id) | Owner::EndOfTier(id) => is_id(id),
        Owner::NoProfileMatched | Owner::DefaultAction | Owner::Failsafe => true,
    }
}

impl Hits {
    /// A copy of what survives a restart (see [`SavedHits`]), sorted so that equal state
    /// saves equal bytes.
    pub(in crate::serve::engine) fn saved(&self) -> SavedHits {
        let mut counts: Vec<SavedCount> = self
            .counts
            .iter()
            .flat_map(|(owner, rules)| {
                rules.iter().map(|((node, egress, index), c)| SavedCount {
                    owner: owner.clone(),
                    node: node.as_deref().map(str::to_string),
                    egress: *egress,
                    index: *index,
                    packets: c.packets,
                    bytes: c.bytes,
                    first_ms: to_ms(c.first),
                    last_ms: to_ms(c.last),
                })
            })
            .collect();
        counts.sort_by(|a, b| {
            (&a.owner, &a.node, a.egress, a.index).cmp(&(&b.owner, &b.node, b.egress, b.index))
        });
        let mut seen: Vec<SavedSeen> = self
            .seen
            .values()
            .map(|s| SavedSeen {
                owner: s.owner.clone(),
                ingress_since_ms: s.since[0].iter().copied().map(to_ms).collect(),
                egress_since_ms: s.since[1].iter().copied().map(to_ms).collect(),
                by_action: s.by_action,
            })
            .collect();
        seen.sort_by(|a, b| a.owner.cmp(&b.owner));
        SavedHits {
            version: SAVED_VERSION,
            counts,
            seen,
        }
    }

    /// Adds a saved document's counters and observation to what is held (at start: nothing).
    /// Entries with an owner no report could name, a node that is no id, or an owner that has
    /// no rules but a non-zero index are skipped; returns how many.
    pub(in crate::serve::engine) fn restore(&mut self, saved: SavedHits) -> usize {
        let mut skipped = 0;
        for c in saved.counts {
            if !valid_owner(&c.owner)
                || c.node.as_deref().is_some_and(|n| !is_id(n))
                || (!c.owner.has_rules() && c.index != 0)
            {
                skipped += 1;
                continue;
            }
            let node = c.node.map(|n| match self.names.get(n.as_str()) {
                Some(n) => n.clone(),
                None => {
                    let n: Arc<str> = Arc::from(n);
                    self.names.insert(n.clone());
                    n
                }
            });
            let counts = Counts {
                packets: c.packets,
                bytes: c.bytes,
                first: from_ms(c.first_ms),
                last: from_ms(c.last_ms),
            };
            let rules = self.counts.entry(c.owner).or_default();
            match rules.entry((node, c.egress, c.index)) {
                std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().merge(counts),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(counts);
                }
            }
        }
        for s in saved.seen {
            let Some(sig) = self.owner_sig(&s.owner).filter(|_| valid_owner(&s.owner)) else {
                skipped += 1;
                continue;
            };
            let seen = self
                .seen
                .entry(sig)
                .or_insert_with(|| Seen::new(s.owner.clone()));
            for (since, saved) in seen
                .since
                .iter_mut()
                .zip([s.ingress_since_ms, s.egress_since_ms])
            {
                // Each rule's earliest observation, here or in the saved copy.
                for (i, t) in saved.into_iter().map(from_ms).enumerate() {
                    match since.get_mut(i) {
                        Some(s) => *s = (*s).min(t),
                        None => since.push(t),
                    }
                }
            }
            for (t, (p, b)) in seen.by_action.iter_mut().zip(s.by_action) {
                t.0 = t.0.saturating_add(p);
                t.1 = t.1.saturating_add(b);
            }
        }
        self.entries = self.counts.values().map(HashMap::len).sum();
        skipped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::engine::hits::Action;
    use crate::serve::engine::hits::tests::{
        at, hit, policy_id, policy_owner, policy_update, two_nodes,
    };

    /// The saved document holds the counters (per node, folded departed nodes, verdicts),
    /// observation times and totals by action; restored into a fresh `Hits` (new hash keys)
    /// it reads the same, through JSON, and no stream is assumed.
    #[test]
    fn saved_counters_restore_the_same_state() {
        let mut h = two_nodes();
        let web = policy_owner("web");
        let allow = |_: &Owner, _: bool, _: u32| Some(Action::Allow);
        h.add(
            "node-a",
            1,
            vec![
                hit(web.clone(), false, 1, 3, 300),
                hit(Owner::Failsafe, true, 0, 2, 120),
            ],
            at(10),
            allow,
        );
        h.add(
            "node-b",
            2,
            vec![hit(web.clone(), true, 0, 5, 500)],
            at(20),
            allow,
        );
        assert!(h.applied("node-a", 1, 3, at(5)));
        assert!(h.take_changed());
        assert!(!h.take_changed(), "taken");
        let saved = h.saved();
        assert_eq!(saved.version, SAVED_VERSION);
        assert_eq!(saved.counts.len(), 3);
        assert_eq!(saved.seen.len(), 2);
        assert_eq!(h.saved(), saved, "the same state saves the same document");

        let json = serde_json::to_string(&saved).unwrap();
        let back: SavedHits = serde_json::from_str(&json).unwrap();
        let mut r = Hits::default();
        assert_eq!(r.restore(back), 0);
        assert_eq!(r.saved(), saved);
        assert_eq!(r.entries(), h.entries());
        assert_eq!(r.totals(&web), h.totals(&web));
        assert_eq!(
            r.rule(&web, Some("node-b"), true, 0),
            h.rule(&web, Some("node-b"), true, 0)
        );
        let sig = r.policy_sig("NetworkPolicy", "shop", "web");
        assert_eq!(r.seen[&sig].since, [vec![at(5); 2], vec![at(5)]]);
        assert_eq!(r.seen[&sig].by_action[Action::Allow as usize], (8, 800));
        assert!(r.sent.is_empty(), "streams do not outlive the process");
        assert!(!r.take_changed(), "restoring is no change to save");
        // A report after the restart adds to the restored counters.
        r.connected("node-a", 7, true);
        r.queued(
            "node-a",
            2,
            &[policy_update(policy_id("web"), "default", 2, 1)],
        );
        r.add(
            "node-a",
            7,
            vec![hit(web.clone(), false, 1, 1, 100)],
            at(30),
            allow,
        );
        let c = r.rule(&web, Some("node-a"), false, 1).unwrap();
        assert_eq!(
            (c.packets, c.bytes, c.first, c.last),
            (4, 400, at(10), at(30))
        );
    }

    /// Entries no report could have made are skipped, not loaded.
    #[test]
    fn restoring_skips_entries_with_invalid_names() {
        let count = |owner: Owner, node: Option<&str>, index: u32| SavedCount {
            owner,
            node: node.map(str::to_string),
            egress: false,
            index,
            packets: 1,
            bytes: 1,
            first_ms: 0,
            last_ms: 0,
        };
        let bad_kind = Owner::Policy {
            kind: "WorkloadEndpoint".into(),
            namespace: String::new(),
            name: "web".into(),
        };
        let saved = SavedHits {
            version: SAVED_VERSION,
            counts: vec![
                count(policy_owner("web"), Some("node-a"), 0),
                count(bad_kind.clone(), Some("node-a"), 0),
                count(Owner::Profile("a b".into()), None, 0),
                count(policy_owner("web"), Some(&"n".repeat(300)), 0),
                count(Owner::Failsafe, None, 3),
            ],
            seen: vec![SavedSeen {
                owner: bad_kind,
                ingress_since_ms: vec![1],
                egress_since_ms: vec![],
                by_action: [(0, 0); 4],
            }],
        };
        let mut h = Hits::default();
        assert_eq!(h.restore(saved), 5);
        assert_eq!(h.entries(), 1);
        assert!(h.seen.is_empty());
    }
}
