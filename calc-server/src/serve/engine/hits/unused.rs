//! Unused policies and rules: the `/status/unused` answer (`policies --unused`).
//!
//! Contract:
//! - A rule is classified against a window from its last hit on any node and the time it was
//!   first in force on a node that reports stats ([`rule_use`]): hit within the window, used;
//!   observed for at least the window and not hit within it, unused; otherwise not yet known.
//!   A hit before the window does not make it used within it.
//! - A policy or profile follows from its rules ([`policy_use`]): one used rule makes it in
//!   use (listing any unused ones, `partly-unused`); with none used, one rule not yet known
//!   makes it not yet known, never unused.
//! - [`Hits::unused`] answers for the candidates the engine names (in force, not staged), with
//!   the rules of the datastore's current version; it reads the counting state and changes
//!   nothing.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use calc_graph::graph::CalcGraph;
use serde::{Deserialize, Serialize};

use super::{Action, Hits, Owner, Seen, direction, rules_now};

/// How a rule fared within a window (see [`rule_use`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RuleUse {
    /// A packet matched it within the window.
    Used,
    /// Observed for at least the whole window, and no packet matched it within.
    Unused,
    /// Not observed for the whole window (or never), and not hit within it: no verdict.
    NotYetKnown,
}

/// A rule's use within the `window` before `now` (`None`: its whole observed history), from its
/// last hit on any node and the time it was first in force on a node that reports stats
/// (`since`). A hit before the window does not make the rule used within it.
pub(crate) fn rule_use(
    last_hit: Option<SystemTime>,
    since: Option<SystemTime>,
    now: SystemTime,
    window: Option<Duration>,
) -> RuleUse {
    let Some(window) = window else {
        return match (last_hit, since) {
            (Some(_), _) => RuleUse::Used,
            (None, Some(_)) => RuleUse::Unused,
            (None, None) => RuleUse::NotYetKnown,
        };
    };
    let from = now.checked_sub(window).unwrap_or(SystemTime::UNIX_EPOCH);
    if last_hit.is_some_and(|l| l >= from) {
        RuleUse::Used
    } else if since.is_some_and(|s| s <= from) {
        RuleUse::Unused
    } else {
        RuleUse::NotYetKnown
    }
}

/// What `policies --unused` says of a policy whose rules fared so (`None`: nothing to report:
/// every rule known is used, or it has no rules). One used rule makes it in use, with any
/// unused ones listed (`partly-unused`); with none used, one rule not yet known makes the
/// whole policy not yet known, never unused.
pub(crate) fn policy_use(rules: &[RuleUse]) -> Option<&'static str> {
    let any = |u: RuleUse| rules.contains(&u);
    if rules.is_empty() {
        None
    } else if any(RuleUse::Used) {
        any(RuleUse::Unused).then_some("partly-unused")
    } else if any(RuleUse::NotYetKnown) {
        Some("not-yet-known")
    } else {
        Some("unused")
    }
}

/// One rule in a `/status/unused` answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct UnusedRule {
    pub direction: String,
    pub index: u32,
    pub action: String,
    /// Its last hit, before the window (`None`: never).
    pub last_hit: Option<String>,
}

/// One policy or profile in a `/status/unused` answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct UnusedPolicy {
    /// `namespace/name` or `name` (a profile's name).
    pub policy: String,
    pub kind: String,
    /// Empty for a profile.
    pub tier: String,
    /// `unused`, `partly-unused` or `not-yet-known` ([`policy_use`]).
    pub state: String,
    /// When it was first in force on a node that reports stats (RFC 3339 UTC), and how long
    /// ago; `None` (null) when never.
    pub observed_since: Option<String>,
    pub observed_seconds: Option<u64>,
    /// Its rules, both directions.
    pub rule_count: u32,
    /// The rules no packet matched within the window, observed for all of it.
    pub unused_rules: Vec<UnusedRule>,
    /// The rules neither hit within the window nor observed for all of it.
    pub not_yet_known_rules: Vec<UnusedRule>,
}

/// A policy or profile `policies --unused` considers: in force somewhere, not staged.
pub(in crate::serve::engine) struct Candidate {
    pub owner: Owner,
    pub policy: String,
    pub kind: String,
    pub tier: String,
}

impl Hits {
    /// Of the `candidates` (policies and profiles in force somewhere, not staged), those with
    /// rules no packet matched within the `window` before `now` (`None`: all recorded history),
    /// and those not observed long enough to tell ([`rule_use`], [`policy_use`]), by state,
    /// then policies before profiles, tier, name and kind. A candidate without rules matches
    /// nothing itself and is left out.
    pub(in crate::serve::engine) fn unused(
        &self,
        graph: &CalcGraph,
        candidates: Vec<Candidate>,
        now: SystemTime,
        window: Option<Duration>,
    ) -> Vec<UnusedPolicy> {
        let mut out = Vec::new();
        for c in candidates {
            let Some(rules) = rules_now(graph, &c.owner) else {
                continue;
            };
            let mut last: HashMap<(bool, u32), SystemTime> = HashMap::new();
            for ((_, egress, index), n) in self.counts.get(&c.owner).into_iter().flatten() {
                let l = last.entry((*egress, *index)).or_insert(n.last);
                *l = (*l).max(n.last);
            }
            let seen = self.owner_sig(&c.owner).and_then(|s| self.seen.get(&s));
            let (mut uses, mut unused_rules, mut not_yet_known_rules) =
                (Vec::new(), Vec::new(), Vec::new());
            for egress in [false, true] {
                for index in 0..rules.len(egress) {
                    let since = seen.and_then(|s| s.since[usize::from(egress)].get(index).copied());
                    let action = rules.action(egress, index).unwrap_or(Action::Deny);
                    let index = index as u32;
                    let last_hit = last.get(&(egress, index)).copied();
                    let u = rule_use(last_hit, since, now, window);
                    uses.push(u);
                    let rule = UnusedRule {
                        direction: direction(egress).into(),
                        index,
                        action: action.as_str().into(),
                        last_hit: last_hit.map(common::rfc3339_utc),
                    };
                    match u {
                        RuleUse::Used => {}
                        RuleUse::Unused => unused_rules.push(rule),
                        RuleUse::NotYetKnown => not_yet_known_rules.push(rule),
                    }
                }
            }
            let Some(state) = policy_use(&uses) else {
                continue;
            };
            let first = seen.and_then(Seen::first);
            out.push(UnusedPolicy {
                policy: c.policy,
                kind: c.kind,
                tier: c.tier,
                state: state.into(),
                observed_since: first.map(common::rfc3339_utc),
                observed_seconds: first
                    .map(|f| now.duration_since(f).unwrap_or_default().as_secs()),
                rule_count: uses.len() as u32,
                unused_rules,
                not_yet_known_rules,
            });
        }
        let rank = |s: &str| match s {
            "unused" => 0,
            "partly-unused" => 1,
            _ => 2,
        };
        out.sort_by(|a, b| {
            (
                rank(&a.state),
                a.kind == "Profile",
                &a.tier,
                &a.policy,
                &a.kind,
            )
                .cmp(&(
                    rank(&b.state),
                    b.kind == "Profile",
                    &b.tier,
                    &b.policy,
                    &b.kind,
                ))
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::engine::hits::tests::at;

    const DAY: Duration = Duration::from_secs(86_400);

    /// The window decides: a rule hit within it is used; one observed for at least the window
    /// and not hit within it is unused, even if it was hit before the window; one observed for
    /// less is not yet known. Without a window, its whole observed history counts.
    #[test]
    fn a_rule_is_used_unused_or_not_yet_known_within_the_window() {
        let now = at(30 * 86_400);
        let days_ago = |d: u32| now - DAY * d;
        let week = Some(7 * DAY);
        // Observed 10 days, hit 2 days ago: used within a week.
        assert_eq!(
            rule_use(Some(days_ago(2)), Some(days_ago(10)), now, week),
            RuleUse::Used
        );
        // Observed 10 days, never hit: unused within a week, and over its whole history.
        assert_eq!(
            rule_use(None, Some(days_ago(10)), now, week),
            RuleUse::Unused
        );
        assert_eq!(
            rule_use(None, Some(days_ago(10)), now, None),
            RuleUse::Unused
        );
        // Hit 9 days ago, outside the week: unused within it; used over its whole history.
        assert_eq!(
            rule_use(Some(days_ago(9)), Some(days_ago(10)), now, week),
            RuleUse::Unused
        );
        assert_eq!(
            rule_use(Some(days_ago(9)), Some(days_ago(10)), now, None),
            RuleUse::Used
        );
        // Observed 3 days (less than the window), never hit: not yet known, never unused…
        assert_eq!(
            rule_use(None, Some(days_ago(3)), now, week),
            RuleUse::NotYetKnown
        );
        // …unless the window is shorter than what was observed.
        assert_eq!(
            rule_use(None, Some(days_ago(3)), now, Some(DAY)),
            RuleUse::Unused
        );
        // Observed exactly the window: known.
        assert_eq!(
            rule_use(None, Some(days_ago(7)), now, week),
            RuleUse::Unused
        );
        // Hit within the window although observed less than it: used.
        assert_eq!(
            rule_use(Some(days_ago(1)), Some(days_ago(3)), now, week),
            RuleUse::Used
        );
        // Never observed: not yet known, whatever the window.
        assert_eq!(rule_use(None, None, now, week), RuleUse::NotYetKnown);
        assert_eq!(rule_use(None, None, now, None), RuleUse::NotYetKnown);
        // A window longer than the clock's history.
        assert_eq!(
            rule_use(None, Some(days_ago(10)), now, Some(Duration::MAX)),
            RuleUse::NotYetKnown
        );
    }

    #[test]
    fn a_policy_is_unused_only_when_every_rule_is_known_unused() {
        use RuleUse::{NotYetKnown as N, Unused as U, Used};
        assert_eq!(policy_use(&[U, U]), Some("unused"));
        assert_eq!(policy_use(&[U, N]), Some("not-yet-known"));
        assert_eq!(policy_use(&[N]), Some("not-yet-known"));
        assert_eq!(policy_use(&[Used, U, N]), Some("partly-unused"));
        assert_eq!(policy_use(&[Used, N]), None);
        assert_eq!(policy_use(&[Used]), None);
        assert_eq!(policy_use(&[]), None, "no rules: nothing to say");
    }
}
