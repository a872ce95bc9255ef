//! The chains that do not depend on policy: the top-level `cali-INPUT`/`cali-FORWARD`/
//! `cali-OUTPUT` (and raw/mangle `cali-PREROUTING`/`cali-OUTPUT`), the hook rules that send the
//! kernel's chains to them, the failsafe chains and the per-interface dispatch chains.

use std::collections::BTreeMap;

use super::endpoint::{
    ALL_INTERFACES, Direction, FAILSAFE_IN, FAILSAFE_OUT, HOST_FROM_FWD_PFX, HOST_FROM_PFX,
    HOST_TO_FWD_PFX, HOST_TO_PFX, WORKLOAD_FROM_PFX, WORKLOAD_TO_PFX,
};
use super::{Action, Chain, IpVersion, Match, Rule, RuleId, endpoint_chain_name, marks};

pub(crate) const FROM_WL_DISPATCH: &str = "cali-from-wl-dispatch";
pub(crate) const TO_WL_DISPATCH: &str = "cali-to-wl-dispatch";
pub(crate) const FROM_HOST_DISPATCH: &str = "cali-from-host-endpoint";
pub(crate) const TO_HOST_DISPATCH: &str = "cali-to-host-endpoint";
pub(crate) const FROM_HEP_FWD_DISPATCH: &str = "cali-from-hep-forward";
pub(crate) const TO_HEP_FWD_DISPATCH: &str = "cali-to-hep-forward";
pub(crate) const WL_TO_HOST: &str = "cali-wl-to-host";
pub(crate) const CIDR_BLOCK: &str = "cali-cidr-block";
/// Raw-table escape from the RPF check (Felix fills it for workloads allowed to spoof; empty
/// here: no endpoint field asks for it yet).
pub(crate) const RPF_SKIP: &str = "cali-rpf-skip";

/// What happens to traffic from a workload to its own host once egress policy allowed it
/// (Felix's `DefaultEndpointToHostAction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EndpointToHostAction {
    Drop,
    Accept,
    Return,
}

pub(crate) use calico_names::felix_config::{
    DEFAULT_FAILSAFES_IN, DEFAULT_FAILSAFES_OUT, Failsafe, default_failsafes_in,
    default_failsafes_out,
};

/// Settings for the static chains.
#[derive(Clone, Debug)]
pub struct StaticConfig {
    /// Workload interface prefixes (`cali`); each becomes a `cali+` style wildcard.
    pub workload_prefixes: Vec<String>,
    pub endpoint_to_host: EndpointToHostAction,
    pub failsafe_in: Vec<Failsafe>,
    pub failsafe_out: Vec<Failsafe>,
    /// The agent's own calc-servers (TCP): always open, whatever host endpoint policy says,
    /// so no policy can cut the agent off from the server that could undo it.
    pub control_plane: Vec<std::net::SocketAddr>,
}

impl Default for StaticConfig {
    fn default() -> Self {
        Self {
            workload_prefixes: vec!["cali".to_owned()],
            endpoint_to_host: EndpointToHostAction::Drop,
            failsafe_in: default_failsafes_in(),
            failsafe_out: default_failsafes_out(),
            control_plane: Vec::new(),
        }
    }
}

/// Rules we own inside a kernel chain (`INPUT`, `FORWARD`…): inserted at the top, appended at
/// the bottom.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Hooks {
    pub inserts: BTreeMap<String, Vec<Rule>>,
    pub appends: BTreeMap<String, Vec<Rule>>,
}

impl Hooks {
    fn insert(&mut self, kernel: &str, rule: Rule) {
        self.inserts
            .entry(kernel.to_owned())
            .or_default()
            .push(rule);
    }
    fn append(&mut self, kernel: &str, rule: Rule) {
        self.appends
            .entry(kernel.to_owned())
            .or_default()
            .push(rule);
    }
}

fn jump(c: &str) -> Rule {
    Rule::always(Action::Jump(c.to_owned()))
}

/// The filter table's static chains and hooks for one family.
pub(crate) fn filter(cfg: &StaticConfig, v: IpVersion) -> (Vec<Chain>, Hooks) {
    let mut hooks = Hooks::default();
    hooks.insert("INPUT", jump("cali-INPUT"));
    hooks.insert("FORWARD", jump("cali-FORWARD"));
    hooks.insert("OUTPUT", jump("cali-OUTPUT"));
    hooks.append(
        "FORWARD",
        Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Accept)
            .comment("Policy explicitly accepted packet."),
    );
    hooks.append("FORWARD", Rule::always(Action::SetMark(marks::ACCEPT)));

    let mut forward = vec![
        Rule::always(Action::ClearMark(marks::CALICO & !marks::ACCEPT)),
        Rule::new(
            Match::new().mark_clear(marks::ACCEPT),
            Action::Jump(FROM_HEP_FWD_DISPATCH.to_owned()),
        ),
    ];
    for p in &cfg.workload_prefixes {
        let wild = format!("{p}+");
        forward.push(
            Rule::new(
                Match::new().in_iface(&wild),
                Action::Jump(FROM_WL_DISPATCH.to_owned()),
            )
            .comment("From workload"),
        );
        forward.push(
            Rule::new(
                Match::new().out_iface(&wild),
                Action::Jump(TO_WL_DISPATCH.to_owned()),
            )
            .comment("To workload"),
        );
    }
    forward.push(jump(TO_HEP_FWD_DISPATCH));
    forward.push(jump(CIDR_BLOCK));

    let mut input = Vec::new();
    for p in &cfg.workload_prefixes {
        input.push(Rule::new(
            Match::new().in_iface(&format!("{p}+")),
            Action::Goto(WL_TO_HOST.to_owned()),
        ));
    }
    input.push(Rule::new(
        Match::new().mark_set(marks::ACCEPT),
        Action::Accept,
    ));
    input.push(Rule::always(Action::ClearMark(marks::CALICO)));
    input.push(jump(FROM_HOST_DISPATCH));
    input.push(
        Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Accept)
            .comment("Host endpoint policy accepted packet."),
    );

    let mut output = vec![Rule::new(
        Match::new().mark_set(marks::ACCEPT),
        Action::Accept,
    )];
    for p in &cfg.workload_prefixes {
        output.push(Rule::new(
            Match::new().out_iface(&format!("{p}+")),
            Action::Return,
        ));
    }
    output.push(Rule::always(Action::ClearMark(marks::CALICO)));
    output.push(Rule::new(
        Match::new().not_conntrack_state("DNAT"),
        Action::Jump(TO_HOST_DISPATCH.to_owned()),
    ));
    output.push(
        Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Accept)
            .comment("Host endpoint policy accepted packet."),
    );

    let mut wl_to_host = Vec::new();
    if v == IpVersion::V6 {
        // Neighbour discovery and MLD must reach the host or IPv6 cannot work at all.
        for ty in [130, 131, 132, 133, 135, 136] {
            wl_to_host.push(Rule::new(
                Match::new().protocol("ipv6-icmp").icmp_type(v, ty, None),
                Action::Accept,
            ));
        }
    }
    wl_to_host.push(jump(FROM_WL_DISPATCH));
    wl_to_host.push(
        Rule::always(match cfg.endpoint_to_host {
            EndpointToHostAction::Drop => Action::Drop,
            EndpointToHostAction::Accept => Action::Accept,
            EndpointToHostAction::Return => Action::Return,
        })
        .comment("Configured DefaultEndpointToHostAction"),
    );

    let chains = vec![
        Chain::new("cali-FORWARD", forward),
        Chain::new("cali-INPUT", input),
        Chain::new("cali-OUTPUT", output),
        Chain::new(WL_TO_HOST, wl_to_host),
        Chain::new(CIDR_BLOCK, Vec::new()),
        failsafe_in(cfg, v),
        failsafe_out(cfg, v),
    ];
    (chains, hooks)
}

/// The raw table: untracked host endpoint policy.
pub(crate) fn raw(cfg: &StaticConfig, v: IpVersion) -> (Vec<Chain>, Hooks) {
    let mut hooks = Hooks::default();
    hooks.insert("PREROUTING", jump("cali-PREROUTING"));
    hooks.insert("OUTPUT", jump("cali-OUTPUT"));
    let mut pre = vec![Rule::always(Action::ClearMark(marks::CALICO))];
    for p in &cfg.workload_prefixes {
        // Remember "from a workload" so host endpoint policy skips it.
        pre.push(Rule::new(
            Match::new().in_iface(&format!("{p}+")),
            Action::SetMark(marks::SCRATCH0),
        ));
    }
    // Strict RPF for workload traffic: a workload cannot spoof its source (a privileged
    // container or a VM could), in both families.
    pre.push(Rule::new(
        Match::new().mark_set(marks::SCRATCH0),
        Action::Jump(RPF_SKIP.to_owned()),
    ));
    pre.push(Rule::new(
        Match::new().mark_set(marks::SCRATCH0).rpf_check_failed(),
        Action::Drop,
    ));
    pre.push(Rule::new(
        Match::new().mark_clear(marks::SCRATCH0),
        Action::Jump(FROM_HOST_DISPATCH.to_owned()),
    ));
    pre.push(Rule::new(
        Match::new().mark_set(marks::ACCEPT),
        Action::Accept,
    ));
    let out = vec![
        Rule::always(Action::ClearMark(marks::CALICO)),
        jump(TO_HOST_DISPATCH),
        Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Accept),
    ];
    let chains = vec![
        Chain::new("cali-PREROUTING", pre),
        Chain::new("cali-OUTPUT", out),
        Chain::new(RPF_SKIP, Vec::new()),
        raw_failsafe_in(cfg, v),
        raw_failsafe_out(cfg, v),
    ];
    (chains, hooks)
}

/// The mangle table: pre-DNAT host endpoint policy, and host endpoint egress policy for host
/// traffic that was DNAT'd (in filter OUTPUT the outgoing interface is still the one chosen
/// before DNAT; by mangle POSTROUTING the kernel has routed it again).
pub(crate) fn mangle(cfg: &StaticConfig, v: IpVersion) -> (Vec<Chain>, Hooks) {
    let mut hooks = Hooks::default();
    hooks.insert("PREROUTING", jump("cali-PREROUTING"));
    hooks.insert("POSTROUTING", jump("cali-POSTROUTING"));
    // RETURN, not ACCEPT, as Felix does here: other mangle rules may still need the packet.
    let post = vec![
        // Forwarded traffic (filter FORWARD sets the accept bit at its end) is not host traffic.
        Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Return),
        Rule::always(Action::ClearMark(marks::CALICO)),
        Rule::new(
            Match::new().conntrack_state("DNAT"),
            Action::Jump(TO_HOST_DISPATCH.to_owned()),
        ),
        Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Return)
            .comment("Host endpoint policy accepted packet."),
    ];
    let pre = vec![
        Rule::new(
            Match::new().conntrack_state("RELATED,ESTABLISHED"),
            Action::Accept,
        ),
        Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Accept),
        jump(FROM_HOST_DISPATCH),
        Rule::new(Match::new().mark_set(marks::ACCEPT), Action::Accept)
            .comment("Host endpoint policy accepted packet."),
    ];
    let chains = vec![
        Chain::new("cali-PREROUTING", pre),
        Chain::new("cali-POSTROUTING", post),
        failsafe_in(cfg, v),
        failsafe_out(cfg, v),
    ];
    (chains, hooks)
}

/// The nat table: masquerade traffic from natOutgoing pools to anywhere outside the pools
/// workloads and tunnels use. The rule exists only while the family has a natOutgoing pool
/// (`active`).
pub(crate) fn nat(
    masq_set: &str,
    network_pools_set: &str,
    active: bool,
    fully_random: bool,
) -> (Vec<Chain>, Hooks) {
    let mut hooks = Hooks::default();
    hooks.insert("POSTROUTING", jump("cali-POSTROUTING"));
    let masquerade = active.then(|| {
        Rule::new(
            Match::new()
                .src_set(masq_set)
                .not_dst_set(network_pools_set),
            Action::Masquerade { fully_random },
        )
    });
    let chains = vec![
        Chain::new("cali-POSTROUTING", vec![jump("cali-nat-outgoing")]),
        Chain::new("cali-nat-outgoing", masquerade.into_iter().collect()),
    ];
    (chains, hooks)
}

/// Inbound failsafes open a port on this host; outbound ones a port on the remote side: both
/// match the destination port. Both chains also hold the agent's connections to its
/// calc-servers of this family, in both directions (the server may be on this host): packets to
/// the server's address and port, and packets from them.
fn failsafe_in(cfg: &StaticConfig, v: IpVersion) -> Chain {
    failsafe_chain(FAILSAFE_IN, &cfg.failsafe_in, cfg, v)
}

fn failsafe_out(cfg: &StaticConfig, v: IpVersion) -> Chain {
    failsafe_chain(FAILSAFE_OUT, &cfg.failsafe_out, cfg, v)
}

/// The raw table's failsafes also accept the replies: raw runs before conntrack, so a reply
/// that fell through to a doNotTrack policy would be dropped (or leave half a connection
/// untracked). Inbound: replies from the outbound failsafe ports; outbound: replies from ours.
fn raw_failsafe_in(cfg: &StaticConfig, v: IpVersion) -> Chain {
    let mut c = failsafe_in(cfg, v);
    c.rules.extend(reply_rules(&cfg.failsafe_out));
    c
}

fn raw_failsafe_out(cfg: &StaticConfig, v: IpVersion) -> Chain {
    let mut c = failsafe_out(cfg, v);
    c.rules.extend(reply_rules(&cfg.failsafe_in));
    c
}

fn reply_rules(ports: &[Failsafe]) -> impl Iterator<Item = Rule> + '_ {
    ports.iter().map(|f| {
        let m = Match::new()
            .protocol(&f.protocol)
            .src_ports(&f.port.to_string());
        Rule::new(m, Action::Accept)
    })
}

fn failsafe_chain(name: &str, ports: &[Failsafe], cfg: &StaticConfig, v: IpVersion) -> Chain {
    let id = RuleId::Failsafe {
        direction: if name == FAILSAFE_IN {
            Direction::Ingress
        } else {
            Direction::Egress
        },
    };
    let mut rules: Vec<Rule> = ports
        .iter()
        .map(|f| {
            let m = Match::new()
                .protocol(&f.protocol)
                .dst_ports(&f.port.to_string());
            Rule::new(m, Action::Accept).with_id(id.clone())
        })
        .collect();
    for addr in &cfg.control_plane {
        let net = match addr.ip() {
            std::net::IpAddr::V4(ip) if v == IpVersion::V4 => format!("{ip}/32"),
            std::net::IpAddr::V6(ip) if v == IpVersion::V6 => format!("{ip}/128"),
            _ => continue,
        };
        let port = addr.port().to_string();
        let tcp = || Match::new().protocol("tcp");
        for m in [
            tcp().dst_net(&net).dst_ports(&port),
            tcp().src_net(&net).src_ports(&port),
        ] {
            rules.push(
                Rule::new(m, Action::Accept)
                    .comment("The calc-server of this agent.")
                    .with_id(id.clone()),
            );
        }
    }
    Chain::new(name, rules)
}

/// `cali-from-wl-dispatch` and `cali-to-wl-dispatch`: one goto per workload interface (sorted),
/// then a drop, so an interface with no endpoint yet gets no traffic through.
pub(crate) fn workload_dispatch(ifaces: &[String]) -> [Chain; 2] {
    let mut sorted: Vec<&String> = ifaces.iter().collect();
    sorted.sort();
    sorted.dedup();
    let mut from = Vec::with_capacity(sorted.len() + 1);
    let mut to = Vec::with_capacity(sorted.len() + 1);
    for i in sorted {
        from.push(Rule::new(
            Match::new().in_iface(i),
            Action::Goto(endpoint_chain_name(WORKLOAD_FROM_PFX, i)),
        ));
        to.push(Rule::new(
            Match::new().out_iface(i),
            Action::Goto(endpoint_chain_name(WORKLOAD_TO_PFX, i)),
        ));
    }
    from.push(Rule::always(Action::Drop).comment("Unknown interface"));
    to.push(Rule::always(Action::Drop).comment("Unknown interface"));
    [
        Chain::new(FROM_WL_DISPATCH, from),
        Chain::new(TO_WL_DISPATCH, to),
    ]
}

/// Host endpoint dispatch (`cali-from-host-endpoint` / `cali-to-host-endpoint`). Interfaces
/// with no host endpoint fall through (host traffic is not policed there); a `*` endpoint
/// catches the rest.
pub(crate) fn host_dispatch(ifaces: &[String]) -> [Chain; 2] {
    dispatch_pair(
        ifaces,
        (FROM_HOST_DISPATCH, HOST_FROM_PFX),
        (TO_HOST_DISPATCH, HOST_TO_PFX),
        true,
    )
}

/// Forward host endpoint dispatch (`cali-from-hep-forward` / `cali-to-hep-forward`); as in
/// Felix, forwarded traffic through any other interface goes to the `*` endpoint's forward
/// chains when there is one.
pub(crate) fn host_forward_dispatch(ifaces: &[String]) -> [Chain; 2] {
    dispatch_pair(
        ifaces,
        (FROM_HEP_FWD_DISPATCH, HOST_FROM_FWD_PFX),
        (TO_HEP_FWD_DISPATCH, HOST_TO_FWD_PFX),
        true,
    )
}

/// The mangle table's `cali-to-host-endpoint` (DNAT'd host traffic): like the filter one, but
/// the `*` endpoint's normal policy never applies to traffic going to a local workload.
pub(crate) fn host_to_dispatch_for_mangle(
    ifaces: &[String],
    workload_prefixes: &[String],
) -> Chain {
    let [_, mut to] = host_dispatch(ifaces);
    if ifaces.iter().any(|i| i == "*") {
        let wildcard = to.rules.pop().expect("the wildcard goto is last");
        for p in workload_prefixes {
            to.rules.push(
                Rule::new(Match::new().out_iface(&format!("{p}+")), Action::Return)
                    .comment("Skip egress WHEP policy for traffic to local workload"),
            );
        }
        to.rules.push(wildcard);
    }
    to
}

fn dispatch_pair(
    ifaces: &[String],
    (from_name, from_pfx): (&str, &str),
    (to_name, to_pfx): (&str, &str),
    with_wildcard: bool,
) -> [Chain; 2] {
    let mut sorted: Vec<&String> = ifaces.iter().filter(|i| i.as_str() != "*").collect();
    sorted.sort();
    sorted.dedup();
    let mut from = Vec::new();
    let mut to = Vec::new();
    for i in sorted {
        from.push(Rule::new(
            Match::new().in_iface(i),
            Action::Goto(endpoint_chain_name(from_pfx, i)),
        ));
        to.push(Rule::new(
            Match::new().out_iface(i),
            Action::Goto(endpoint_chain_name(to_pfx, i)),
        ));
    }
    if with_wildcard && ifaces.iter().any(|i| i == "*") {
        from.push(Rule::always(Action::Goto(endpoint_chain_name(
            from_pfx,
            ALL_INTERFACES,
        ))));
        to.push(Rule::always(Action::Goto(endpoint_chain_name(
            to_pfx,
            ALL_INTERFACES,
        ))));
    }
    [Chain::new(from_name, from), Chain::new(to_name, to)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(c: &Chain) -> Vec<String> {
        c.rules
            .iter()
            .map(|r| r.render_append(&c.name, ""))
            .collect()
    }

    #[test]
    fn dispatch_ends_in_a_drop_for_unknown_interfaces() {
        let [from, to] = workload_dispatch(&["calib".into(), "calia".into()]);
        assert_eq!(
            text(&from),
            vec![
                "-A cali-from-wl-dispatch --in-interface calia --goto cali-fw-calia",
                "-A cali-from-wl-dispatch --in-interface calib --goto cali-fw-calib",
                "-A cali-from-wl-dispatch -m comment --comment \"Unknown interface\" --jump DROP",
            ]
        );
        assert_eq!(
            text(&to)[0],
            "-A cali-to-wl-dispatch --out-interface calia --goto cali-tw-calia"
        );
        let [empty_from, _] = workload_dispatch(&[]);
        assert_eq!(empty_from.rules.len(), 1);
    }

    #[test]
    fn host_dispatch_falls_through_and_wildcard_goes_last() {
        let [from, to] = host_dispatch(&["*".into(), "eth0".into()]);
        assert_eq!(
            text(&from),
            vec![
                "-A cali-from-host-endpoint --in-interface eth0 --goto cali-fh-eth0",
                "-A cali-from-host-endpoint --goto cali-fh-any-interface-at-all",
            ]
        );
        assert_eq!(to.rules.len(), 2);
        // Forwarded traffic through any interface goes to the `*` endpoint's forward chains.
        let [fwd_from, fwd_to] = host_forward_dispatch(&["*".into()]);
        assert_eq!(
            text(&fwd_from),
            vec![format!(
                "-A cali-from-hep-forward --goto {}",
                endpoint_chain_name(HOST_FROM_FWD_PFX, ALL_INTERFACES)
            )]
        );
        assert_eq!(
            text(&fwd_to),
            vec![format!(
                "-A cali-to-hep-forward --goto {}",
                endpoint_chain_name(HOST_TO_FWD_PFX, ALL_INTERFACES)
            )]
        );
        // In mangle (DNAT'd host traffic), `*` never applies to traffic to a local workload.
        let mangle = text(&host_to_dispatch_for_mangle(
            &["*".into(), "eth0".into()],
            &["cali".into()],
        ));
        assert_eq!(
            mangle,
            vec![
                "-A cali-to-host-endpoint --out-interface eth0 --goto cali-th-eth0",
                "-A cali-to-host-endpoint -m comment --comment \"Skip egress WHEP policy for traffic to local workload\" --out-interface cali+ --jump RETURN",
                "-A cali-to-host-endpoint --goto cali-th-any-interface-at-all",
            ]
        );
    }

    #[test]
    fn the_agents_calc_server_is_a_failsafe_in_its_own_family() {
        let cfg = StaticConfig {
            control_plane: vec![
                "10.0.0.5:50051".parse().unwrap(),
                "[fd00::5]:443".parse().unwrap(),
            ],
            ..StaticConfig::default()
        };
        let lines = |c: &Chain| {
            c.rules
                .iter()
                .map(|r| r.render_append(&c.name, ""))
                .collect::<Vec<_>>()
        };
        for (chains, v) in [
            (filter(&cfg, IpVersion::V4).0, IpVersion::V4),
            (raw(&cfg, IpVersion::V4).0, IpVersion::V4),
            (filter(&cfg, IpVersion::V6).0, IpVersion::V6),
        ] {
            let get = |n: &str| lines(chains.iter().find(|c| c.name == n).unwrap());
            let (addr, port) = match v {
                IpVersion::V4 => ("10.0.0.5/32", "50051"),
                IpVersion::V6 => ("fd00::5/128", "443"),
            };
            let inbound = get(FAILSAFE_IN);
            let outbound = get(FAILSAFE_OUT);
            for chain in [&inbound, &outbound] {
                let ours: Vec<&String> =
                    chain.iter().filter(|l| l.contains("calc-server")).collect();
                assert_eq!(ours.len(), 2, "{chain:?}");
                assert!(
                    ours[0].contains(&format!("--destination {addr}"))
                        && ours[0].contains(&format!("--destination-ports {port}")),
                    "{ours:?}"
                );
                assert!(
                    ours[1].contains(&format!("--source {addr}"))
                        && ours[1].contains(&format!("--source-ports {port}")),
                    "{ours:?}"
                );
            }
        }
    }

    #[test]
    fn raw_prerouting_checks_rpf_for_workloads_and_raw_failsafes_pass_replies() {
        for v in IpVersion::BOTH {
            let (chains, _) = raw(&StaticConfig::default(), v);
            let get = |n: &str| text(chains.iter().find(|c| c.name == n).unwrap());
            let pre = get("cali-PREROUTING");
            let skip = pre
                .iter()
                .position(|l| l.ends_with("--jump cali-rpf-skip"))
                .unwrap();
            let rpf = pre
                .iter()
                .position(|l| {
                    l.contains("-m rpfilter --validmark --invert") && l.ends_with("--jump DROP")
                })
                .unwrap();
            let dispatch = pre
                .iter()
                .position(|l| l.ends_with("--jump cali-from-host-endpoint"))
                .unwrap();
            assert!(skip < rpf && rpf < dispatch, "{pre:?}");
            assert!(
                pre[rpf].contains("-m mark --mark 0x80000/0x80000"),
                "only workload traffic"
            );
            assert!(get(RPF_SKIP).is_empty());
            // Replies: SSH (an inbound failsafe) answered from port 22 leaves through the raw
            // outbound failsafe; DNS answers (outbound failsafe 53) come in through the inbound.
            let out = get(FAILSAFE_OUT);
            assert!(
                out.iter()
                    .any(|l| l.contains("--protocol tcp") && l.contains("--source-ports 22")),
                "{out:?}"
            );
            let inbound = get(FAILSAFE_IN);
            assert!(
                inbound
                    .iter()
                    .any(|l| l.contains("--protocol udp") && l.contains("--source-ports 53")),
                "{inbound:?}"
            );
        }
        // The filter table's failsafes stay one-way (conntrack handles replies there).
        let (chains, _) = filter(&StaticConfig::default(), IpVersion::V4);
        let out = text(chains.iter().find(|c| c.name == FAILSAFE_OUT).unwrap());
        assert!(!out.iter().any(|l| l.contains("--source-ports")), "{out:?}");
    }

    #[test]
    fn filter_hooks_and_forward_chain() {
        let (chains, hooks) = filter(&StaticConfig::default(), IpVersion::V4);
        assert_eq!(
            hooks.inserts["INPUT"][0].action,
            Action::Jump("cali-INPUT".into())
        );
        assert_eq!(hooks.appends["FORWARD"].len(), 2);
        let fwd = chains.iter().find(|c| c.name == "cali-FORWARD").unwrap();
        assert_eq!(
            text(fwd),
            vec![
                "-A cali-FORWARD --jump MARK --set-mark 0/0x1a0000",
                "-A cali-FORWARD -m mark --mark 0/0x10000 --jump cali-from-hep-forward",
                "-A cali-FORWARD -m comment --comment \"From workload\" --in-interface cali+ --jump cali-from-wl-dispatch",
                "-A cali-FORWARD -m comment --comment \"To workload\" --out-interface cali+ --jump cali-to-wl-dispatch",
                "-A cali-FORWARD --jump cali-to-hep-forward",
                "-A cali-FORWARD --jump cali-cidr-block",
            ]
        );
        let (v6, _) = filter(&StaticConfig::default(), IpVersion::V6);
        let wl = v6.iter().find(|c| c.name == WL_TO_HOST).unwrap();
        assert!(text(wl)[0].contains("--icmpv6-type 130"));
        assert!(text(wl).last().unwrap().ends_with("--jump DROP"));
    }
}
