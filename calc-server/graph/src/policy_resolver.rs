//! Policy resolver: orders the policies that apply to one endpoint into Felix's tier lists.
//!
//! Tiers sort as Felix's `TierLess`: tiers that have a Tier resource first, then those with an
//! order before those without, by order, then by name. Policies sort as `PolKVLess`: by order
//! (none = last), then by the string `<name>/<namespace>/<kind>`. Each tier becomes a `TierInfo`
//! listing the policies that govern ingress and egress; for host endpoints the policies split
//! into untracked (doNotTrack), pre-DNAT, forward (applyOnForward) and normal tiers, as Felix's
//! `tierInfoToProtoTierInfo` does. Tiers left empty are omitted.

use std::cmp::Ordering;

use felix_proto as pb;

use crate::convert::PolicyModel;

/// What the resolver needs to know about a tier.
#[derive(Clone, Debug, PartialEq)]
pub struct TierMeta {
    pub order: Option<f64>,
    /// `Deny` or `Pass`.
    pub default_action: String,
}

/// A policy as the resolver sees it.
pub struct PolicyRef<'a> {
    pub model: &'a PolicyModel,
    pub sort_string: &'a str,
}

fn cmp_order(a: Option<f64>, b: Option<f64>) -> Ordering {
    match (a, b) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
}

/// Felix's `TierLess`.
pub fn cmp_tiers(a: (&str, Option<&TierMeta>), b: (&str, Option<&TierMeta>)) -> Ordering {
    let key = |t: Option<&TierMeta>| (t.is_none(), t.and_then(|t| t.order).is_none());
    key(a.1)
        .cmp(&key(b.1))
        .then_with(|| cmp_order(a.1.and_then(|t| t.order), b.1.and_then(|t| t.order)))
        .then_with(|| a.0.cmp(b.0))
}

/// The four tier lists of an endpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResolvedTiers {
    pub normal: Vec<pb::TierInfo>,
    pub untracked: Vec<pb::TierInfo>,
    pub pre_dnat: Vec<pb::TierInfo>,
    pub forward: Vec<pb::TierInfo>,
}

fn policy_id(m: &PolicyModel) -> pb::PolicyId {
    pb::PolicyId {
        name: m.id.name.clone(),
        namespace: m.id.namespace.clone(),
        kind: m.id.kind.clone(),
    }
}

/// The total order of policies across tiers: Felix's `TierLess`, then `PolKVLess`.
pub fn cmp_policies(
    (a, ta): (&PolicyRef<'_>, Option<&TierMeta>),
    (b, tb): (&PolicyRef<'_>, Option<&TierMeta>),
) -> Ordering {
    cmp_tiers((&a.model.tier, ta), (&b.model.tier, tb))
        .then_with(|| cmp_order(a.model.order, b.model.order))
        .then_with(|| a.sort_string.cmp(b.sort_string))
}

/// Orders `policies` (all those matching one endpoint) into tier lists. `tier` looks up a tier
/// resource by name.
pub fn resolve<'p, 't>(
    policies: Vec<PolicyRef<'p>>,
    tier: impl Fn(&str) -> Option<&'t TierMeta>,
) -> ResolvedTiers {
    // Each tier is looked up once per policy, not once per comparison.
    let mut keyed: Vec<(Option<&'t TierMeta>, PolicyRef<'p>)> = policies
        .into_iter()
        .map(|p| (tier(&p.model.tier), p))
        .collect();
    keyed.sort_by(|(ta, a), (tb, b)| cmp_policies((a, *ta), (b, *tb)));
    tier_lists(keyed.into_iter().map(|(_, p)| p).collect(), tier)
}

/// Groups policies already in [`cmp_policies`] order into tier lists.
pub fn tier_lists<'p, 't>(
    policies: Vec<PolicyRef<'p>>,
    tier: impl Fn(&str) -> Option<&'t TierMeta>,
) -> ResolvedTiers {
    let mut out = ResolvedTiers::default();
    let mut i = 0;
    while i < policies.len() {
        let name = policies[i].model.tier.clone();
        let default_action = tier(&name)
            .map(|t| t.default_action.clone())
            .unwrap_or_default();
        let new = |action: &str| pb::TierInfo {
            name: name.clone(),
            default_action: action.to_string(),
            ..Default::default()
        };
        let (mut normal, mut untracked, mut pre_dnat, mut forward) = (
            new(&default_action),
            new("Pass"),
            new("Pass"),
            new(&default_action),
        );
        while i < policies.len() && policies[i].model.tier == name {
            let m = policies[i].model;
            let add = |t: &mut pb::TierInfo, egress_allowed: bool| {
                if m.ingress {
                    t.ingress_policies.push(policy_id(m));
                }
                if egress_allowed && m.egress {
                    t.egress_policies.push(policy_id(m));
                }
            };
            if m.untracked {
                add(&mut untracked, true);
            } else if m.pre_dnat {
                add(&mut pre_dnat, false);
            } else {
                if m.apply_on_forward {
                    add(&mut forward, true);
                }
                add(&mut normal, true);
            }
            i += 1;
        }
        for (t, list) in [
            (normal, &mut out.normal),
            (untracked, &mut out.untracked),
            (pre_dnat, &mut out.pre_dnat),
            (forward, &mut out.forward),
        ] {
            if !t.ingress_policies.is_empty() || !t.egress_policies.is_empty() {
                list.push(t);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::PolicyId;
    use crate::selector::Selector;

    fn pol(name: &str, tier: &str, order: Option<f64>) -> PolicyModel {
        PolicyModel {
            id: PolicyId {
                name: name.into(),
                namespace: String::new(),
                kind: "GlobalNetworkPolicy".into(),
            },
            tier: tier.into(),
            order,
            selector: Selector::all(),
            inbound: vec![],
            outbound: vec![],
            ingress: true,
            egress: true,
            untracked: false,
            pre_dnat: false,
            apply_on_forward: false,
            namespace: String::new(),
            performance_hints: vec![],
        }
    }

    fn resolve_all<'a>(
        ps: &'a [PolicyModel],
        tier: impl Fn(&str) -> Option<&'a TierMeta>,
    ) -> ResolvedTiers {
        let sorts: Vec<String> = ps.iter().map(|p| p.id.sort_string()).collect();
        let refs = ps
            .iter()
            .zip(&sorts)
            .map(|(m, s)| PolicyRef {
                model: m,
                sort_string: s,
            })
            .collect();
        resolve(refs, tier)
    }

    fn names(t: &pb::TierInfo) -> Vec<&str> {
        t.ingress_policies.iter().map(|p| p.name.as_str()).collect()
    }

    #[test]
    fn tiers_and_policies_sort_as_felix() {
        let tiers = [
            (
                "a",
                TierMeta {
                    order: Some(20.0),
                    default_action: "Deny".into(),
                },
            ),
            (
                "b",
                TierMeta {
                    order: Some(10.0),
                    default_action: "Pass".into(),
                },
            ),
            (
                "c",
                TierMeta {
                    order: None,
                    default_action: "Deny".into(),
                },
            ),
        ];
        let lookup = |n: &str| tiers.iter().find(|(t, _)| *t == n).map(|(_, m)| m);
        let ps = [
            pol("p3", "a", None),
            pol("p1", "a", Some(5.0)),
            pol("p2", "a", Some(5.0)),
            pol("q", "b", Some(100.0)),
            pol("r", "c", Some(1.0)),
            pol("s", "missing", Some(1.0)),
        ];
        let r = resolve_all(&ps, lookup);
        let order: Vec<&str> = r.normal.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(order, vec!["b", "a", "c", "missing"]);
        assert_eq!(names(&r.normal[1]), vec!["p1", "p2", "p3"]);
        assert_eq!(r.normal[0].default_action, "Pass");
        assert_eq!(
            r.normal[3].default_action, "",
            "no Tier resource: empty default action"
        );
    }

    #[test]
    fn host_endpoint_splits() {
        let mut u = pol("u", "default", Some(1.0));
        u.untracked = true;
        u.apply_on_forward = true;
        let mut d = pol("d", "default", Some(2.0));
        d.pre_dnat = true;
        d.apply_on_forward = true;
        let mut f = pol("f", "default", Some(3.0));
        f.apply_on_forward = true;
        let ps = [u, d, f];
        let r = resolve_all(&ps, |_| None);
        assert_eq!(names(&r.untracked[0]), vec!["u"]);
        assert_eq!(r.untracked[0].default_action, "Pass");
        assert_eq!(names(&r.pre_dnat[0]), vec!["d"]);
        assert!(
            r.pre_dnat[0].egress_policies.is_empty(),
            "pre-DNAT is ingress only"
        );
        assert_eq!(names(&r.forward[0]), vec!["f"]);
        assert_eq!(names(&r.normal[0]), vec!["f"]);
    }
}
