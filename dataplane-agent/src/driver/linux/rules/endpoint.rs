//! Per-endpoint chains: `cali-tw-`/`cali-fw-` for workloads, `cali-th-`/`cali-fh-` (and the
//! forward `cali-thfw-`/`cali-fhfw-`) for host endpoints, in the filter table; untracked host
//! endpoint chains in raw and pre-DNAT ones in mangle.
//!
//! Body (Felix's `endpointIptablesChain`): conntrack accept/drop (tracked chains), failsafes
//! (host endpoints), clear the verdict marks, then per tier: clear pass, jump to each policy
//! unless pass is set, return once accepted, and drop at the end of the tier unless a policy
//! passed or the tier's default action is Pass; then the profiles, first accept wins; then drop.

use felix_proto::TierInfo;

use super::nflog::{self, Verdict};
use super::policy::RenderConfig;
use super::{
    Action, Chain, Match, POLICY_INBOUND_PFX, POLICY_OUTBOUND_PFX, PROFILE_INBOUND_PFX,
    PROFILE_OUTBOUND_PFX, Rule, RuleId, endpoint_chain_name, marks, policy_chain_name,
    profile_chain_name,
};

pub(crate) const WORKLOAD_TO_PFX: &str = "cali-tw-";
pub(crate) const WORKLOAD_FROM_PFX: &str = "cali-fw-";
pub(crate) const HOST_TO_PFX: &str = "cali-th-";
pub(crate) const HOST_FROM_PFX: &str = "cali-fh-";
pub(crate) const HOST_TO_FWD_PFX: &str = "cali-thfw-";
pub(crate) const HOST_FROM_FWD_PFX: &str = "cali-fhfw-";
pub(crate) const FAILSAFE_IN: &str = "cali-failsafe-in";
pub(crate) const FAILSAFE_OUT: &str = "cali-failsafe-out";
/// The interface name standing for a host endpoint with `interfaceName: "*"`.
pub(crate) const ALL_INTERFACES: &str = "any-interface-at-all";

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// Policies' inbound rules, profiles' inbound rules.
    Ingress,
    Egress,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Normal,
    Untracked,
    PreDnat,
    Forward,
}

struct Spec<'a> {
    name: String,
    tiers: &'a [TierInfo],
    profiles: &'a [String],
    dir: Direction,
    kind: Kind,
    failsafe: Option<&'static str>,
    admin_up: bool,
    allow: Action,
    drop_vxlan_ipip: bool,
}

/// `cali-tw-<iface>` (ingress policy) and `cali-fw-<iface>` (egress policy) of a workload.
pub(crate) fn workload_chains(
    cfg: &RenderConfig,
    iface: &str,
    admin_up: bool,
    tiers: &[TierInfo],
    profiles: &[String],
) -> [Chain; 2] {
    let base = |name: String, dir, drop_encap| Spec {
        name,
        tiers,
        profiles,
        dir,
        kind: Kind::Normal,
        failsafe: None,
        admin_up,
        allow: Action::Accept,
        drop_vxlan_ipip: drop_encap,
    };
    [
        render(
            cfg,
            base(
                endpoint_chain_name(WORKLOAD_TO_PFX, iface),
                Direction::Ingress,
                false,
            ),
        ),
        render(
            cfg,
            base(
                endpoint_chain_name(WORKLOAD_FROM_PFX, iface),
                Direction::Egress,
                true,
            ),
        ),
    ]
}

/// A host endpoint's filter chains: `cali-th-`, `cali-fh-`, `cali-thfw-`, `cali-fhfw-`.
pub(crate) fn host_filter_chains(
    cfg: &RenderConfig,
    iface: &str,
    tiers: &[TierInfo],
    forward_tiers: &[TierInfo],
    profiles: &[String],
) -> [Chain; 4] {
    let spec = |pfx: &str, tiers, dir, kind, failsafe| Spec {
        name: endpoint_chain_name(pfx, iface),
        tiers,
        profiles,
        dir,
        kind,
        failsafe,
        admin_up: true,
        allow: Action::Accept,
        drop_vxlan_ipip: false,
    };
    [
        render(
            cfg,
            spec(
                HOST_TO_PFX,
                tiers,
                Direction::Egress,
                Kind::Normal,
                Some(FAILSAFE_OUT),
            ),
        ),
        render(
            cfg,
            spec(
                HOST_FROM_PFX,
                tiers,
                Direction::Ingress,
                Kind::Normal,
                Some(FAILSAFE_IN),
            ),
        ),
        render(
            cfg,
            spec(
                HOST_TO_FWD_PFX,
                forward_tiers,
                Direction::Egress,
                Kind::Forward,
                None,
            ),
        ),
        render(
            cfg,
            spec(
                HOST_FROM_FWD_PFX,
                forward_tiers,
                Direction::Ingress,
                Kind::Forward,
                None,
            ),
        ),
    ]
}

/// A host endpoint's untracked chains (raw table): `cali-th-` and `cali-fh-`.
pub(crate) fn host_raw_chains(
    cfg: &RenderConfig,
    iface: &str,
    untracked: &[TierInfo],
) -> [Chain; 2] {
    let spec = |pfx: &str, dir, failsafe| Spec {
        name: endpoint_chain_name(pfx, iface),
        tiers: untracked,
        profiles: &[],
        dir,
        kind: Kind::Untracked,
        failsafe: Some(failsafe),
        admin_up: true,
        allow: Action::Accept,
        drop_vxlan_ipip: false,
    };
    [
        render(cfg, spec(HOST_TO_PFX, Direction::Egress, FAILSAFE_OUT)),
        render(cfg, spec(HOST_FROM_PFX, Direction::Ingress, FAILSAFE_IN)),
    ]
}

/// A host endpoint's egress chain in the mangle table (`cali-th-`), for host traffic that was
/// DNAT'd: its normal egress policy and profiles, allowing with RETURN as Felix does there.
pub(crate) fn host_mangle_egress_chain(
    cfg: &RenderConfig,
    iface: &str,
    tiers: &[TierInfo],
    profiles: &[String],
) -> Chain {
    render(
        cfg,
        Spec {
            name: endpoint_chain_name(HOST_TO_PFX, iface),
            tiers,
            profiles,
            dir: Direction::Egress,
            kind: Kind::Normal,
            failsafe: Some(FAILSAFE_OUT),
            admin_up: true,
            allow: Action::Return,
            drop_vxlan_ipip: false,
        },
    )
}

/// A host endpoint's pre-DNAT chain (mangle table): `cali-fh-` (ingress only).
pub(crate) fn host_mangle_chain(cfg: &RenderConfig, iface: &str, pre_dnat: &[TierInfo]) -> Chain {
    render(
        cfg,
        Spec {
            name: endpoint_chain_name(HOST_FROM_PFX, iface),
            tiers: pre_dnat,
            profiles: &[],
            dir: Direction::Ingress,
            kind: Kind::PreDnat,
            failsafe: Some(FAILSAFE_IN),
            admin_up: true,
            allow: Action::Accept,
            drop_vxlan_ipip: false,
        },
    )
}

fn render(cfg: &RenderConfig, s: Spec<'_>) -> Chain {
    let mut rules = Vec::new();
    if !s.admin_up {
        rules.push(Rule::always(cfg.deny.clone()).comment("Endpoint admin disabled"));
        return Chain::new(s.name, rules);
    }
    if s.kind != Kind::Untracked {
        rules.push(Rule::new(
            Match::new().conntrack_state("RELATED,ESTABLISHED"),
            s.allow.clone(),
        ));
        rules.push(Rule::new(
            Match::new().conntrack_state("INVALID"),
            cfg.deny.clone(),
        ));
    }
    if let Some(fs) = s.failsafe {
        rules.push(Rule::always(Action::Jump(fs.to_owned())));
    }
    rules.push(Rule::always(Action::ClearMark(marks::ACCEPT | marks::PASS)));
    if s.drop_vxlan_ipip {
        rules.push(
            Rule::new(
                Match::new().protocol("17").dst_ports("4789"),
                cfg.deny.clone(),
            )
            .comment("Drop VXLAN encapped packets originating in workloads"),
        );
        rules.push(
            Rule::new(Match::new().protocol("4"), cfg.deny.clone())
                .comment("Drop IPinIP encapped packets originating in workloads"),
        );
    }
    let (pol_pfx, prof_pfx) = match s.dir {
        Direction::Ingress => (POLICY_INBOUND_PFX, PROFILE_INBOUND_PFX),
        Direction::Egress => (POLICY_OUTBOUND_PFX, PROFILE_OUTBOUND_PFX),
    };
    for tier in s.tiers {
        let policies = match s.dir {
            Direction::Ingress => &tier.ingress_policies,
            Direction::Egress => &tier.egress_policies,
        };
        if policies.is_empty() {
            continue;
        }
        rules.push(
            Rule::always(Action::ClearMark(marks::PASS))
                .comment(format!("Start of tier {}", tier.name)),
        );
        for id in policies {
            rules.push(Rule::new(
                Match::new().mark_clear(marks::PASS),
                Action::Jump(policy_chain_name(pol_pfx, id)),
            ));
            if s.kind == Kind::Untracked {
                rules.push(Rule::new(
                    Match::new().mark_set(marks::ACCEPT),
                    Action::NoTrack,
                ));
            }
            rules.push(
                Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Return)
                    .comment("Return if policy accepted"),
            );
        }
        let decides = matches!(s.kind, Kind::Normal | Kind::Forward);
        let end_of_tier_drop = decides && !tier.default_action.eq_ignore_ascii_case("pass");
        if decides && cfg.flow_logs {
            // Felix logs the tier's end either way: its drop, or (default action Pass) the
            // pass to the next tier.
            let verdict = if end_of_tier_drop {
                Verdict::Deny
            } else {
                Verdict::Pass
            };
            let line = Rule::new(
                Match::new().mark_clear(marks::PASS),
                Action::Nflog {
                    group: nflog::group(s.dir),
                    prefix: nflog::end_of_tier(verdict, s.dir, &tier.name),
                },
            )
            .uncounted();
            rules.push(if end_of_tier_drop {
                line.with_id(RuleId::EndOfTier {
                    tier: tier.name.clone(),
                    direction: s.dir,
                })
            } else {
                line
            });
        }
        if end_of_tier_drop {
            rules.push(
                Rule::new(Match::new().mark_clear(marks::PASS), cfg.deny.clone())
                    .comment("Drop if no policies passed packet")
                    .with_id(RuleId::EndOfTier {
                        tier: tier.name.clone(),
                        direction: s.dir,
                    }),
            );
        }
    }
    // Felix allows forwarded traffic by default only when the endpoint has no forward tiers at
    // all; with forward policy in the other direction only, the chain ends here and the packet
    // falls through to the rest of FORWARD.
    if s.tiers.is_empty() && s.kind == Kind::Forward {
        rules.push(
            Rule::always(Action::SetMark(marks::ACCEPT))
                .comment("Allow forwarded traffic by default")
                .with_id(RuleId::Default { direction: s.dir }),
        );
        rules.push(Rule::always(Action::Return).comment("Return for accepted forward traffic"));
    }
    if s.kind == Kind::Normal {
        for p in s.profiles {
            rules.push(Rule::always(Action::Jump(profile_chain_name(prof_pfx, p))));
            rules.push(
                Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Return)
                    .comment("Return if profile accepted"),
            );
        }
        if cfg.flow_logs {
            rules.push(
                Rule::always(Action::Nflog {
                    group: nflog::group(s.dir),
                    prefix: nflog::no_profile_matched(s.dir),
                })
                .uncounted()
                .with_id(RuleId::NoProfileMatched { direction: s.dir }),
            );
        }
        rules.push(
            Rule::always(cfg.deny.clone())
                .comment("Drop if no profiles matched")
                .with_id(RuleId::NoProfileMatched { direction: s.dir }),
        );
    }
    Chain::new(s.name, rules)
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_proto::PolicyId;

    fn pid(name: &str) -> PolicyId {
        PolicyId {
            name: name.into(),
            namespace: String::new(),
            kind: "GlobalNetworkPolicy".into(),
        }
    }

    fn text(c: &Chain) -> Vec<String> {
        c.rules
            .iter()
            .map(|r| r.render_append(&c.name, ""))
            .collect()
    }

    /// The golden layout of a workload with two tiers (the second defaults to Pass) and a
    /// profile: what an operator sees in `iptables-save`, minus the hash comments.
    #[test]
    fn workload_chain_golden() {
        let tiers = vec![
            TierInfo {
                name: "security".into(),
                ingress_policies: vec![pid("a"), pid("b")],
                egress_policies: vec![],
                default_action: "Deny".into(),
            },
            TierInfo {
                name: "platform".into(),
                ingress_policies: vec![pid("c")],
                egress_policies: vec![pid("c")],
                default_action: "Pass".into(),
            },
        ];
        let [tw, fw] = workload_chains(
            &RenderConfig::default(),
            "cali1234",
            true,
            &tiers,
            &["kns.prod".to_owned()],
        );
        assert_eq!(tw.name, "cali-tw-cali1234");
        assert_eq!(
            text(&tw),
            vec![
                "-A cali-tw-cali1234 -m conntrack --ctstate RELATED,ESTABLISHED --jump ACCEPT",
                "-A cali-tw-cali1234 -m conntrack --ctstate INVALID --jump DROP",
                "-A cali-tw-cali1234 --jump MARK --set-mark 0/0x30000",
                "-A cali-tw-cali1234 -m comment --comment \"Start of tier security\" --jump MARK --set-mark 0/0x20000",
                "-A cali-tw-cali1234 -m mark --mark 0/0x20000 --jump cali-pi-gnp/a",
                "-A cali-tw-cali1234 -m comment --comment \"Return if policy accepted\" -m mark --mark 0x10000/0x10000 --jump RETURN",
                "-A cali-tw-cali1234 -m mark --mark 0/0x20000 --jump cali-pi-gnp/b",
                "-A cali-tw-cali1234 -m comment --comment \"Return if policy accepted\" -m mark --mark 0x10000/0x10000 --jump RETURN",
                "-A cali-tw-cali1234 -m comment --comment \"Drop if no policies passed packet\" -m mark --mark 0/0x20000 --jump DROP",
                "-A cali-tw-cali1234 -m comment --comment \"Start of tier platform\" --jump MARK --set-mark 0/0x20000",
                "-A cali-tw-cali1234 -m mark --mark 0/0x20000 --jump cali-pi-gnp/c",
                "-A cali-tw-cali1234 -m comment --comment \"Return if policy accepted\" -m mark --mark 0x10000/0x10000 --jump RETURN",
                "-A cali-tw-cali1234 --jump cali-pri-kns.prod",
                "-A cali-tw-cali1234 -m comment --comment \"Return if profile accepted\" -m mark --mark 0x10000/0x10000 --jump RETURN",
                "-A cali-tw-cali1234 -m comment --comment \"Drop if no profiles matched\" --jump DROP",
            ]
        );
        // Egress: only the platform tier has egress policies; encapsulated traffic is dropped.
        let fw_text = text(&fw);
        assert_eq!(fw.name, "cali-fw-cali1234");
        assert!(
            fw_text[3].contains("--protocol 17 -m multiport --destination-ports 4789 --jump DROP")
        );
        assert!(fw_text[4].contains("--protocol 4 --jump DROP"));
        assert!(fw_text.iter().any(|l| l.ends_with("--jump cali-po-gnp/c")));
        assert!(!fw_text.iter().any(|l| l.contains("tier security")));
        assert!(
            fw_text
                .iter()
                .any(|l| l.ends_with("--jump cali-pro-kns.prod"))
        );
    }

    #[test]
    fn admin_down_workload_drops_everything() {
        let [tw, fw] = workload_chains(&RenderConfig::default(), "caliX", false, &[], &[]);
        for c in [tw, fw] {
            assert_eq!(
                text(&c),
                vec![format!(
                    "-A {} -m comment --comment \"Endpoint admin disabled\" --jump DROP",
                    c.name
                )]
            );
        }
    }

    #[test]
    fn host_endpoint_chains() {
        let tiers = vec![TierInfo {
            name: "default".into(),
            ingress_policies: vec![pid("h")],
            egress_policies: vec![],
            default_action: String::new(),
        }];
        let [th, fh, thfw, fhfw] =
            host_filter_chains(&RenderConfig::default(), "eth0", &tiers, &[], &[]);
        assert_eq!(th.name, "cali-th-eth0");
        assert!(text(&fh)[2].ends_with("--jump cali-failsafe-in"));
        assert!(text(&th)[2].ends_with("--jump cali-failsafe-out"));
        // No forward tiers: forwarded traffic is allowed.
        assert!(
            text(&fhfw)
                .iter()
                .any(|l| l.contains("Allow forwarded traffic by default"))
        );
        assert_eq!(thfw.name, "cali-thfw-eth0");
        // Untracked: no conntrack, NOTRACK on accept, no end-of-tier drop, no profiles.
        let [_rth, rfh] = host_raw_chains(&RenderConfig::default(), "eth0", &tiers);
        let raw = text(&rfh);
        assert!(!raw.iter().any(|l| l.contains("conntrack")));
        assert!(raw.iter().any(|l| l.contains("--jump NOTRACK")));
        assert!(!raw.iter().any(|l| l.contains("Drop if")));
        let mangle = text(&host_mangle_chain(&RenderConfig::default(), "eth0", &tiers));
        assert!(!mangle.iter().any(|l| l.contains("Drop if")));
    }

    #[test]
    fn forward_policy_in_one_direction_does_not_open_the_other() {
        let tiers = vec![TierInfo {
            name: "default".into(),
            ingress_policies: vec![pid("fwd-in")],
            egress_policies: vec![],
            default_action: String::new(),
        }];
        let [_, _, thfw, fhfw] =
            host_filter_chains(&RenderConfig::default(), "eth0", &[], &tiers, &[]);
        let egress = text(&thfw);
        // Conntrack, invalid, mark clear, and nothing more: no egress forward policy, so the
        // packet falls through to the rest of FORWARD rather than being accepted here.
        assert_eq!(egress.len(), 3, "{egress:?}");
        assert!(egress[2].ends_with("--set-mark 0/0x30000"), "{egress:?}");
        assert!(text(&fhfw).iter().any(|l| l.contains("cali-pi-gnp/fwd-in")));
    }
}
