//! The dataplane's own verdicts as the agents count them: a tier's end (no policy of the tier
//! decided: drop), no profile matched (drop), the default action of forwarded traffic and the
//! failsafe ports (accept). They belong to no policy, so `/status/policies` does not show
//! them; `/status/verdicts` (`status --verdicts`) does.
//!
//! Contract: one row per verdict (per tier for a tier's end) and direction that counted
//! anything, summed over nodes with the nodes where it did, in a fixed order: tiers' ends by
//! tier name, then no profile matched, default action, failsafe; ingress before egress.

use std::collections::BTreeSet;

use serde::Serialize;

use super::{Hits, Owner, Totals, direction};

/// One verdict's counters in one direction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct VerdictHits {
    /// `end-of-tier`, `no-profile-matched`, `default-action` or `failsafe`.
    pub verdict: &'static str,
    /// The tier, for `end-of-tier`.
    pub tier: Option<String>,
    /// `ingress` or `egress`.
    pub direction: &'static str,
    /// What the verdict does: `deny` or `allow`.
    pub action: &'static str,
    pub packets: u64,
    pub bytes: u64,
    pub last_hit: Option<String>,
    pub nodes: Vec<String>,
}

/// The name, tier, action and sort rank of a verdict owner (`None`: a policy or profile).
fn verdict_of(owner: &Owner) -> Option<(&'static str, Option<&str>, &'static str, u8)> {
    Some(match owner {
        Owner::EndOfTier(tier) => ("end-of-tier", Some(tier.as_str()), "deny", 0),
        Owner::NoProfileMatched => ("no-profile-matched", None, "deny", 1),
        Owner::DefaultAction => ("default-action", None, "allow", 2),
        Owner::Failsafe => ("failsafe", None, "allow", 3),
        Owner::Policy { .. } | Owner::Profile(_) => return None,
    })
}

/// Where a row sorts: the verdict's rank, its tier, egress after ingress.
type SortKey = (u8, Option<String>, bool);

impl Hits {
    /// Every verdict that counted something (see the module documentation).
    pub(in crate::serve::engine) fn verdicts(&self) -> Vec<VerdictHits> {
        let mut rows: Vec<(SortKey, VerdictHits)> = Vec::new();
        for (owner, rules) in &self.counts {
            let Some((verdict, tier, action, rank)) = verdict_of(owner) else {
                continue;
            };
            for egress in [false, true] {
                let mut t = Totals::default();
                let mut nodes = BTreeSet::new();
                for ((node, e, _), c) in rules {
                    if *e != egress {
                        continue;
                    }
                    t.packets = t.packets.saturating_add(c.packets);
                    t.bytes = t.bytes.saturating_add(c.bytes);
                    t.last = Some(t.last.map_or(c.last, |l| l.max(c.last)));
                    nodes.insert(node.as_deref().unwrap_or("(departed)").to_string());
                }
                if t.packets == 0 && t.bytes == 0 {
                    continue;
                }
                rows.push((
                    (rank, tier.map(str::to_string), egress),
                    VerdictHits {
                        verdict,
                        tier: tier.map(str::to_string),
                        direction: direction(egress),
                        action,
                        packets: t.packets,
                        bytes: t.bytes,
                        last_hit: t.last.map(common::rfc3339_utc),
                        nodes: nodes.into_iter().collect(),
                    },
                ));
            }
        }
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        rows.into_iter().map(|(_, r)| r).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{at, hit, policy_owner, two_nodes};
    use super::*;

    /// Verdicts are summed over nodes per direction, in a fixed order; policies are not
    /// verdicts; a verdict that counted nothing is not listed.
    #[test]
    fn verdicts_are_summed_per_direction_in_a_fixed_order() {
        let mut h = two_nodes();
        let tier = |t: &str| Owner::EndOfTier(t.into());
        for (node, conn) in [("node-a", 1), ("node-b", 2)] {
            h.add(
                node,
                conn,
                vec![
                    hit(tier("default"), false, 0, 5, 500),
                    hit(Owner::Failsafe, false, 0, 2, 120),
                    hit(policy_owner("web"), false, 0, 9, 900),
                ],
                at(10),
                |_, _, _| None,
            );
        }
        h.add(
            "node-a",
            1,
            vec![hit(Owner::NoProfileMatched, true, 0, 1, 60)],
            at(20),
            |_, _, _| None,
        );
        let rows: Vec<String> = h
            .verdicts()
            .into_iter()
            .map(|r| {
                format!(
                    "{} {:?} {} {} {} {}",
                    r.verdict,
                    r.tier,
                    r.direction,
                    r.packets,
                    r.bytes,
                    r.nodes.join(",")
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                "end-of-tier Some(\"default\") ingress 10 1000 node-a,node-b",
                "no-profile-matched None egress 1 60 node-a",
                "failsafe None ingress 4 240 node-a,node-b",
            ]
        );
    }
}
