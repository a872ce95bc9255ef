//! Flow-log tagging: the NFLOG group and prefix a deciding rule logs a packet with when flow
//! logs are on, in Felix's format so that a collector written for Felix reads ours unchanged.
//!
//! A prefix is `<action><owner><direction>[<index>]|<id>`: action `A`llow, `D`eny or `P`ass;
//! owner `P`olicy or p`R`ofile; direction `I`ngress or `E`gress; then the rule's index in the
//! policy's rule list and the policy id ([`super::policy_id_string`]) or profile name. The
//! end-of-tier verdicts have no index and name the tier (`DPI|default`, `PPE|security`); the
//! no-profile drop is just `DRI` / `DRE`.
//!
//! The kernel keeps 63 bytes of a prefix (64 with the terminating NUL). A prefix of 63 bytes
//! or more keeps its first and last 10 bytes and puts a hash of the whole prefix between them
//! (`_` + 41 characters of base64url(SHA-256), then `_`): 63 bytes exactly. Exactly 63 is
//! hashed too, so that no unhashed prefix can look like a hashed one. Pure, no IO.

use calico_names::hash::length_limited_id;

use super::RuleId;
use super::endpoint::Direction;

/// NFLOG group of inbound (ingress) verdicts.
pub(crate) const GROUP_INBOUND: u16 = 1;
/// NFLOG group of outbound (egress) verdicts.
pub(crate) const GROUP_OUTBOUND: u16 = 2;
/// Bytes of each packet copied to the listener (Felix's default NFLOG size).
pub(crate) const SNAPLEN: u32 = 80;
/// Bytes of a prefix the kernel stores, its terminating NUL included.
pub(crate) const MAX_PREFIX: usize = 64;

/// Bytes kept in front of and behind the hash of a long prefix.
const KEEP: usize = 10;
/// The hash part of a long prefix, its leading `_` included.
const HASH_PART: usize = MAX_PREFIX - 1 - 2 * KEEP - 1;

/// What a logged verdict did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Allow,
    Deny,
    Pass,
}

impl Verdict {
    fn letter(self) -> char {
        match self {
            Verdict::Allow => 'A',
            Verdict::Deny => 'D',
            Verdict::Pass => 'P',
        }
    }
}

/// The group of a direction: 1 inbound, 2 outbound.
pub(crate) fn group(dir: Direction) -> u16 {
    match dir {
        Direction::Ingress => GROUP_INBOUND,
        Direction::Egress => GROUP_OUTBOUND,
    }
}

fn dir_letter(dir: Direction) -> char {
    match dir {
        Direction::Ingress => 'I',
        Direction::Egress => 'E',
    }
}

/// The prefix of a policy rule (`policy` as [`super::policy_id_string`] spells it).
pub(crate) fn policy_rule(verdict: Verdict, dir: Direction, index: u32, policy: &str) -> String {
    shorten(format!(
        "{}P{}{index}|{policy}",
        verdict.letter(),
        dir_letter(dir)
    ))
}

/// The prefix of a profile rule.
pub(crate) fn profile_rule(verdict: Verdict, dir: Direction, index: u32, profile: &str) -> String {
    shorten(format!(
        "{}R{}{index}|{profile}",
        verdict.letter(),
        dir_letter(dir)
    ))
}

/// The prefix of a tier's end: its default drop (`Deny`) or, when the tier's default action is
/// Pass, the pass to the next tier.
pub(crate) fn end_of_tier(verdict: Verdict, dir: Direction, tier: &str) -> String {
    shorten(format!("{}P{}|{tier}", verdict.letter(), dir_letter(dir)))
}

/// The prefix of the drop when no profile accepted.
pub(crate) fn no_profile_matched(dir: Direction) -> String {
    format!("DR{}", dir_letter(dir))
}

/// The prefix of the rule `id` when it decides `verdict`; `None` for ids that flow logs do
/// not tag (failsafes, the forward default).
pub(crate) fn for_rule(id: &RuleId, verdict: Verdict) -> Option<String> {
    Some(match id {
        RuleId::Policy {
            policy,
            direction,
            index,
        } => policy_rule(verdict, *direction, *index, policy),
        RuleId::Profile {
            profile,
            direction,
            index,
        } => profile_rule(verdict, *direction, *index, profile),
        RuleId::EndOfTier { tier, direction } => end_of_tier(verdict, *direction, tier),
        RuleId::NoProfileMatched { direction } => no_profile_matched(*direction),
        RuleId::Default { .. } | RuleId::Failsafe { .. } => return None,
    })
}

/// A prefix as the kernel can hold it: unchanged below 63 bytes, else the first and last 10
/// bytes around a hash of the whole (module docs).
fn shorten(prefix: String) -> String {
    let b = prefix.as_bytes();
    if b.len() < MAX_PREFIX - 1 {
        return prefix;
    }
    let hash = length_limited_id("", &prefix, HASH_PART);
    let mut out = Vec::with_capacity(MAX_PREFIX - 1);
    out.extend_from_slice(&b[..KEEP]);
    out.extend_from_slice(hash.as_bytes());
    out.push(b'_');
    out.extend_from_slice(&b[b.len() - KEEP..]);
    // Ids are validated ASCII; a multi-byte character cut in two becomes U+FFFD rather than
    // a panic (then the prefix is a few bytes longer and the kernel truncates it).
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use Direction::{Egress, Ingress};

    const CHARS62: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    const CHARS63: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0";

    /// Felix's own expectations (`felix/rules/nflogprefix_test.go`), byte for byte.
    #[test]
    fn rule_prefixes_match_felix() {
        assert_eq!(
            policy_rule(Verdict::Allow, Ingress, 0, "np/namespace1/default.policy"),
            "API0|np/namespace1/default.policy"
        );
        assert_eq!(
            profile_rule(Verdict::Pass, Egress, 999, "short.profile.name"),
            "PRE999|short.profile.name"
        );
        let p = policy_rule(Verdict::Deny, Egress, 88, &format!("gnp/{CHARS62}"));
        assert_eq!(p, format!("DPE88|gnp/{CHARS62}"));
        assert_eq!(p.len(), 62);
        let p = policy_rule(Verdict::Deny, Ingress, 88, &format!("gnp/{CHARS63}"));
        assert_eq!(
            p,
            "DPI88|gnp/_12IXaBPahNM7a7dZhI8zg6PStmHsgneYaax8LVSIq_RSTUVWXYZ0"
        );
        assert_eq!(p.len(), 63);
        assert_eq!(
            policy_rule(
                Verdict::Deny,
                Egress,
                1,
                "gnp/this-is-still-quite-a-long-tier-name-even-though-its-not-required.quite-a-long-policy-name"
            ),
            "DPE1|gnp/t_FSGxA9eGa6t_A5Rj2agPvl4aq8-eohq0An6xEW4n7_olicy-name"
        );
        assert_eq!(
            policy_rule(
                Verdict::Deny,
                Egress,
                2,
                "gnp/this-is-still-quite-a-long-tier-name-even-though-its-not-required.quite-a-long-policy-name2"
            ),
            "DPE2|gnp/t_G4MaamO0BQNQg8Ibyy-r9qg2HIK8-7EaPOVzsy5Nv_licy-name2"
        );
    }

    #[test]
    fn end_of_tier_and_no_profile_prefixes_match_felix() {
        assert_eq!(end_of_tier(Verdict::Deny, Egress, "tier-1"), "DPE|tier-1");
        let t62 = "tier-01234567890123456789012345678901234567890123456789012";
        assert_eq!(
            end_of_tier(Verdict::Deny, Ingress, t62),
            format!("DPI|{t62}")
        );
        assert_eq!(
            end_of_tier(
                Verdict::Deny,
                Ingress,
                "tier-012345678901234567890123456789012345678901234567890123"
            ),
            "DPI|tier-0_phEfG4Vhbq2xh4TQsePNa2X9YRj5peCVw1FgaNSbd_4567890123"
        );
        assert_eq!(
            end_of_tier(Verdict::Pass, Ingress, "default"),
            "PPI|default"
        );
        assert_eq!(no_profile_matched(Ingress), "DRI");
        assert_eq!(no_profile_matched(Egress), "DRE");
        assert_eq!((group(Ingress), group(Egress)), (1, 2));
    }

    #[test]
    fn every_prefix_fits_the_kernel() {
        for n in 0..200 {
            let p = policy_rule(Verdict::Allow, Ingress, 12345, &"x".repeat(n));
            assert!(p.len() < MAX_PREFIX, "{n}: {p}");
            // Long ones are exactly 63 bytes, ending with the id's last 10 bytes.
            if p.len() == MAX_PREFIX - 1 {
                assert!(p.ends_with("_xxxxxxxxxx"));
            }
        }
    }

    #[test]
    fn ids_map_to_their_prefixes() {
        let id = RuleId::Policy {
            policy: "gnp/default.allow".into(),
            direction: Egress,
            index: 3,
        };
        assert_eq!(
            for_rule(&id, Verdict::Allow).as_deref(),
            Some("APE3|gnp/default.allow")
        );
        let id = RuleId::Profile {
            profile: "kns.ns1".into(),
            direction: Ingress,
            index: 0,
        };
        assert_eq!(
            for_rule(&id, Verdict::Deny).as_deref(),
            Some("DRI0|kns.ns1")
        );
        assert_eq!(
            for_rule(&RuleId::Failsafe { direction: Ingress }, Verdict::Allow),
            None
        );
    }
}
