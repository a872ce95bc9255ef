//! Hit tracking: the kernel's per-rule counters (absolute, per kernel rule) turned into what
//! each stream rule decided since the previous collection (deltas, per [`RuleId`]).
//!
//! Contract: a count is compared only with the previous count of the same kernel line, which
//! includes the write that created it (`LineCount::line`): a chain rewritten by a policy change
//! starts a new line, whose whole count is new; a line whose count went down (zeroed behind our
//! back) counts from zero. Nothing is ever counted twice. The first collection of a process only
//! records the counts (what an earlier agent process counted was reported by it, or is lost
//! with it). Packets a rule counted after the last collection and before its chain was
//! rewritten are not seen by anyone: the rewrite resets the kernel's counter. Pure, no IO.

use std::collections::{BTreeMap, HashMap};

use super::rules::RuleId;
use super::writer::LineCount;

/// The previous count of every kernel line.
#[derive(Default)]
pub(crate) struct HitTracker {
    last: HashMap<String, (u64, u64)>,
    started: bool,
}

impl HitTracker {
    /// What moved since the previous call, by rule (rules that did not move are left out).
    pub(crate) fn deltas(&mut self, now: Vec<LineCount>) -> BTreeMap<RuleId, (u64, u64)> {
        let mut out: BTreeMap<RuleId, (u64, u64)> = BTreeMap::new();
        let mut next = HashMap::with_capacity(now.len());
        for c in now {
            let (p, b) = match self.last.get(&c.line) {
                Some(&(lp, lb)) if c.packets >= lp && c.bytes >= lb => {
                    (c.packets - lp, c.bytes - lb)
                }
                // Zeroed behind our back: everything it holds is new.
                Some(_) => (c.packets, c.bytes),
                // A line written since the last collection started from zero.
                None if self.started => (c.packets, c.bytes),
                None => (0, 0),
            };
            if p > 0 || b > 0 {
                let e = out.entry(c.id).or_default();
                e.0 += p;
                e.1 += b;
            }
            next.insert(c.line, (c.packets, c.bytes));
        }
        self.last = next;
        self.started = true;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::linux::rules::endpoint::Direction;

    fn line(line: &str, tier: &str, packets: u64) -> LineCount {
        LineCount {
            line: line.into(),
            id: RuleId::EndOfTier {
                tier: tier.into(),
                direction: Direction::Ingress,
            },
            packets,
            bytes: packets * 100,
        }
    }

    fn tier(t: &str) -> RuleId {
        RuleId::EndOfTier {
            tier: t.into(),
            direction: Direction::Ingress,
        }
    }

    #[test]
    fn the_first_collection_is_a_baseline_then_deltas_add_up_by_rule() {
        let mut t = HitTracker::default();
        assert!(t.deltas(vec![line("a|0", "x", 50)]).is_empty());
        // Two kernel lines (v4 and v6) of the same rule add up; an unmoved line is left out.
        let d = t.deltas(vec![
            line("a|0", "x", 57),
            line("b|0", "x", 3),
            line("c|0", "y", 0),
        ]);
        assert_eq!(d, BTreeMap::from([(tier("x"), (10, 1000))]));
        assert!(
            t.deltas(vec![line("a|0", "x", 57), line("b|0", "x", 3)])
                .is_empty()
        );
    }

    #[test]
    fn a_rewritten_chain_never_counts_twice_nor_loses_what_was_read() {
        let mut t = HitTracker::default();
        t.deltas(vec![line("a|1", "x", 40)]);
        assert_eq!(t.deltas(vec![line("a|1", "x", 45)])[&tier("x")], (5, 500));
        // Rewritten (epoch 2): the new line's 7 are new; the old line's 45 were reported.
        assert_eq!(t.deltas(vec![line("a|2", "x", 7)])[&tier("x")], (7, 700));
        // Zeroed behind our back: counts from zero again.
        assert_eq!(t.deltas(vec![line("a|2", "x", 2)])[&tier("x")], (2, 200));
        assert_eq!(t.deltas(vec![line("a|2", "x", 9)])[&tier("x")], (7, 700));
    }
}
