//! A node's counters re-read from the store when its agent connects here, so that a node that
//! moves between replicas (fail-over) carries on from what the replica it left saved, not from
//! what this replica read when it started.
//!
//! Contract: [`Hits::reload_started`] (at connect) tracks what the node's streams add from
//! then on; [`Hits::reloaded`] (when the store answered) sets each rule's count on that node to
//! the larger of the stored count and the count held here before the first unanswered connect,
//! plus what its streams added since. Counts only grow and every view comes from the same
//! history, so the larger of two views is the more recent one: nothing is counted twice, and
//! nothing this replica counted since is lost. Until then the node is unverified
//! ([`Hits::unverified`]): its parts are neither written nor is it folded into the departed
//! nodes. A reconnect before the answer keeps what was added and waits for the new stream's
//! answer; an answer for an older stream is ignored; a failed read is asked again
//! ([`Hits::take_reasks`]); entries the store holds that no report could carry are skipped.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use super::saved::{SavedCount, from_ms, valid_owner};
use super::{Counts, Hits, Owner, is_id};

/// What a node's streams added since its first unanswered connect, per rule: packets and
/// bytes; the stream whose answer is awaited; whether a read is under way.
#[derive(Debug, Default)]
pub(super) struct SinceConnect {
    conn: u64,
    added: HashMap<(Owner, bool, u32), (u64, u64)>,
    asked: bool,
}

impl SinceConnect {
    /// Notes a delta `node`'s stream `conn` added to a rule.
    pub(super) fn add(&mut self, conn: u64, key: (Owner, bool, u32), packets: u64, bytes: u64) {
        if conn != self.conn {
            return;
        }
        let e = self.added.entry(key).or_default();
        e.0 = e.0.saturating_add(packets);
        e.1 = e.1.saturating_add(bytes);
    }
}

impl Hits {
    /// `node`'s stream `conn` connected and its stored counts are asked for: what it adds is
    /// tracked until they come (added to what an earlier unanswered stream added).
    pub(in crate::serve::engine) fn reload_started(&mut self, node: &str, conn: u64) {
        let e = self.since_connect.entry(node.to_string()).or_default();
        e.conn = conn;
        e.asked = true;
    }

    /// The nodes whose stored counts are not merged yet (their parts must not be written).
    pub(in crate::serve::engine) fn unverified(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self.since_connect.keys().cloned().collect();
        nodes.sort();
        nodes
    }

    /// The unverified nodes whose last read failed, with the stream to ask for; marked asked.
    pub(in crate::serve::engine) fn take_reasks(&mut self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (node, e) in &mut self.since_connect {
            if !e.asked {
                e.asked = true;
                out.push((node.clone(), e.conn));
            }
        }
        out.sort();
        out
    }

    /// Merges `stored` (the store's counts of `node`, read after the connect of stream `conn`;
    /// `None`: the read failed, to be asked again) as the module documentation says; returns
    /// how many entries were skipped.
    pub(in crate::serve::engine) fn reloaded(
        &mut self,
        node: &str,
        conn: u64,
        stored: Option<Vec<SavedCount>>,
    ) -> usize {
        let Some(e) = self.since_connect.get_mut(node).filter(|e| e.conn == conn) else {
            return 0;
        };
        let Some(stored) = stored else {
            e.asked = false;
            return 0;
        };
        let since = self.since_connect.remove(node).expect("checked just above");
        if !is_id(node) {
            return stored.len();
        }
        let name: Arc<str> = match self.names.get(node) {
            Some(n) => n.clone(),
            None => {
                let n: Arc<str> = Arc::from(node);
                self.names.insert(n.clone());
                n
            }
        };
        let mut skipped = 0;
        for c in stored {
            if c.node.as_deref() != Some(node)
                || !valid_owner(&c.owner)
                || (!c.owner.has_rules() && c.index != 0)
            {
                skipped += 1;
                continue;
            }
            let added = since
                .added
                .get(&(c.owner.clone(), c.egress, c.index))
                .copied()
                .unwrap_or_default();
            let saved = Counts {
                packets: c.packets,
                bytes: c.bytes,
                first: from_ms(c.first_ms),
                last: from_ms(c.last_ms),
            };
            let rules = self.counts.entry(c.owner).or_default();
            match rules.entry((Some(name.clone()), c.egress, c.index)) {
                Entry::Occupied(mut e) => {
                    let here = e.get_mut();
                    let before = (
                        here.packets.saturating_sub(added.0),
                        here.bytes.saturating_sub(added.1),
                    );
                    if (saved.packets, saved.bytes) > before {
                        here.packets = saved.packets.saturating_add(added.0);
                        here.bytes = saved.bytes.saturating_add(added.1);
                        here.first = here.first.min(saved.first);
                        here.last = here.last.max(saved.last);
                        self.changed = true;
                    }
                }
                Entry::Vacant(e) => {
                    e.insert(saved);
                    self.entries += 1;
                    self.changed = true;
                }
            }
        }
        skipped
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{at, hit, policy_owner, two_nodes};
    use super::*;

    fn stored(packets: u64, index: u32) -> SavedCount {
        SavedCount {
            owner: policy_owner("web"),
            node: Some("node-a".into()),
            egress: false,
            index,
            packets,
            bytes: packets * 100,
            first_ms: 1_000,
            last_ms: 2_000,
        }
    }

    /// Reports `packets` on rule 0 of web for node-a's stream `conn`.
    fn report(h: &mut Hits, conn: u64, packets: u64) {
        h.add(
            "node-a",
            conn,
            vec![hit(policy_owner("web"), false, 0, packets, packets * 100)],
            at(10 + packets),
            |_, _, _| None,
        );
    }

    /// node-a's stream `conn` holds web (2 inbound rules).
    fn connect(h: &mut Hits, conn: u64) {
        h.connected("node-a", conn, true);
        h.queued(
            "node-a",
            2,
            &[super::super::tests::policy_update(
                super::super::tests::policy_id("web"),
                "default",
                2,
                1,
            )],
        );
    }

    fn count(h: &Hits, index: u32) -> Option<u64> {
        h.rule(&policy_owner("web"), Some("node-a"), false, index)
            .map(|c| c.packets)
    }

    /// A node that comes back from another replica carries on from the larger view plus what
    /// it reported here since its connect; it is unverified until then; a stale view in the
    /// store changes nothing; another node's entry is skipped.
    #[test]
    fn a_node_that_moves_back_carries_on_from_the_more_recent_view() {
        let mut h = two_nodes();
        // This replica counted 5 on rule 0 before (its stale view of node-a).
        report(&mut h, 1, 5);
        connect(&mut h, 3);
        h.reload_started("node-a", 3);
        assert_eq!(h.unverified(), ["node-a"]);
        report(&mut h, 3, 2);
        // The other replica saved 40 on rule 0 and 9 on rule 1.
        assert_eq!(
            h.reloaded("node-a", 3, Some(vec![stored(40, 0), stored(9, 1)])),
            0
        );
        assert_eq!(
            count(&h, 0),
            Some(42),
            "the stored 40 plus the 2 reported since"
        );
        assert_eq!(count(&h, 1), Some(9));
        assert!(h.unverified().is_empty());
        // A smaller view in the store changes nothing.
        h.reload_started("node-a", 3);
        assert_eq!(h.reloaded("node-a", 3, Some(vec![stored(30, 0)])), 0);
        assert_eq!(count(&h, 0), Some(42));
        // Another node's entry in the answer is skipped.
        h.reload_started("node-a", 3);
        let mut other = stored(7, 0);
        other.node = Some("node-b".into());
        assert_eq!(h.reloaded("node-a", 3, Some(vec![other])), 1);
        assert_eq!(h.rule(&policy_owner("web"), Some("node-b"), false, 0), None);
    }

    /// A reconnect before the answer keeps what the first stream added and waits for the new
    /// stream's answer: the older stream's answer is ignored and does not end the wait; a
    /// failed read leaves the node unverified and is asked again once.
    #[test]
    fn reconnects_and_failed_reads_before_the_answer() {
        let mut h = two_nodes();
        report(&mut h, 1, 5);
        connect(&mut h, 3);
        h.reload_started("node-a", 3);
        report(&mut h, 3, 2);
        connect(&mut h, 4);
        h.reload_started("node-a", 4);
        report(&mut h, 4, 1);
        // The answer for stream 3 comes late: ignored, still waiting for stream 4's.
        assert_eq!(h.reloaded("node-a", 3, Some(vec![stored(1000, 0)])), 0);
        assert_eq!(count(&h, 0), Some(8));
        assert_eq!(h.unverified(), ["node-a"]);
        // Stream 4's read fails: asked again, once.
        assert_eq!(h.take_reasks(), []);
        assert_eq!(h.reloaded("node-a", 4, None), 0);
        assert_eq!(h.take_reasks(), [("node-a".to_string(), 4)]);
        assert_eq!(h.take_reasks(), []);
        // It answers 40: 40 + the 3 both streams reported since the first connect.
        assert_eq!(h.reloaded("node-a", 4, Some(vec![stored(40, 0)])), 0);
        assert_eq!(count(&h, 0), Some(43));
        assert!(h.unverified().is_empty());
    }
}
