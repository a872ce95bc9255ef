//! A node's counters re-read from the store when its agent connects here, so that a node that
//! moves between replicas (fail-over) carries on from what the replica it left saved, not from
//! what this replica read when it started.
//!
//! Contract: [`Hits::reload_started`] (at connect) tracks what the node's new stream adds;
//! [`Hits::reloaded`] (when the store answered) sets each rule's count on that node to the
//! larger of the stored count and the count held here before the connect, plus what the
//! stream added since. Counts only grow and every view comes from the same history, so the
//! larger of two views is the more recent one: nothing is counted twice, and nothing this
//! replica counted since the connect is lost. A reload answered for an older stream of the
//! node is ignored; entries the store holds that no report could carry are skipped.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use super::saved::{SavedCount, from_ms, valid_owner};
use super::{Counts, Hits, Owner, is_id};

/// What one stream added since its connect, per rule: packets and bytes.
#[derive(Debug, Default)]
pub(super) struct SinceConnect {
    conn: u64,
    added: HashMap<(Owner, bool, u32), (u64, u64)>,
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
    /// `node`'s stream `conn` connected: what it adds is tracked until its stored counts come.
    pub(in crate::serve::engine) fn reload_started(&mut self, node: &str, conn: u64) {
        self.since_connect.insert(
            node.to_string(),
            SinceConnect {
                conn,
                added: HashMap::new(),
            },
        );
    }

    /// Merges `stored` (the store's counts of `node`, read after the connect of stream `conn`)
    /// as the module documentation says; returns how many entries were skipped.
    pub(in crate::serve::engine) fn reloaded(
        &mut self,
        node: &str,
        conn: u64,
        stored: Vec<SavedCount>,
    ) -> usize {
        let Some(since) = self.since_connect.remove(node).filter(|s| s.conn == conn) else {
            return 0;
        };
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

    /// A node that comes back from another replica carries on from the larger view plus what
    /// it reported here since its connect; a stale view in the store changes nothing; a
    /// reload for an older stream is ignored.
    #[test]
    fn a_node_that_moves_back_carries_on_from_the_more_recent_view() {
        let mut h = two_nodes();
        let web = policy_owner("web");
        // This replica counted 5 on rule 0 before (its stale view of node-a).
        h.add(
            "node-a",
            1,
            vec![hit(web.clone(), false, 0, 5, 500)],
            at(10),
            |_, _, _| None,
        );
        // node-a reconnects (stream 3) and reports 2 before the store answers.
        h.connected("node-a", 3, true);
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
        h.reload_started("node-a", 3);
        h.add(
            "node-a",
            3,
            vec![hit(web.clone(), false, 0, 2, 200)],
            at(20),
            |_, _, _| None,
        );
        // The other replica saved 40 on rule 0 and 9 on rule 1.
        assert_eq!(
            h.reloaded("node-a", 3, vec![stored(40, 0), stored(9, 1)]),
            0
        );
        let count = |h: &Hits, i| h.rule(&web, Some("node-a"), false, i).map(|c| c.packets);
        assert_eq!(
            count(&h, 0),
            Some(42),
            "the stored 40 plus the 2 reported since"
        );
        assert_eq!(count(&h, 1), Some(9));
        // A reload that arrives for an older stream, or with a smaller view, changes nothing.
        assert_eq!(h.reloaded("node-a", 1, vec![stored(1000, 0)]), 0);
        assert_eq!(count(&h, 0), Some(42));
        h.reload_started("node-a", 3);
        assert_eq!(h.reloaded("node-a", 3, vec![stored(30, 0)]), 0);
        assert_eq!(count(&h, 0), Some(42));
        // Another node's entry in the answer is skipped.
        h.reload_started("node-a", 3);
        let mut other = stored(7, 0);
        other.node = Some("node-b".into());
        assert_eq!(h.reloaded("node-a", 3, vec![other]), 1);
        assert_eq!(h.rule(&web, Some("node-b"), false, 0), None);
    }
}
