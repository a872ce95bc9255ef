//! Policy and profile chains: each proto rule becomes a match that sets a verdict mark, then the
//! verdict (`RETURN` for allow and pass, `DROP` for deny, `LOG` for log) gated on that mark.
//!
//! Where one iptables rule cannot express a proto rule (more than 15 port slots, named ports
//! or-ed with numeric ports, several CIDRs, negated CIDR lists), the rule is split into blocks
//! that combine through the two scratch mark bits, as Felix does: the final rule then also
//! requires the "all blocks passed" bit.

use felix_proto::{PortRange, Protocol, Rule as ProtoRule, protocol, rule};

use super::endpoint::Direction;
use super::nflog::{self, Verdict};
use super::{
    Action, Chain, IpVersion, Match, POLICY_INBOUND_PFX, POLICY_OUTBOUND_PFX, PROFILE_INBOUND_PFX,
    PROFILE_OUTBOUND_PFX, Rule, RuleId, ipset_name, marks, policy_chain_name, policy_id_string,
    profile_chain_name,
};

/// Settings that shape every rendered policy.
#[derive(Clone, Debug)]
pub struct RenderConfig {
    /// Prefix of `LOG` rules.
    pub log_prefix: String,
    /// The action for `deny` and for the end-of-tier and no-profile drops.
    pub deny: Action,
    /// Flow logs: every rule that decides a packet (allow, deny, pass, the end-of-tier and
    /// no-profile verdicts) also sends it to NFLOG, tagged as Felix tags it ([`nflog`]).
    pub flow_logs: bool,
}

impl Default for RenderConfig {
    fn default() -> Self {
        Self {
            log_prefix: "calico-packet".to_owned(),
            deny: Action::Drop,
            flow_logs: false,
        }
    }
}

/// The inbound (`cali-pi-`) and outbound (`cali-po-`) chains of a policy for one family.
pub(crate) fn policy_chains(
    cfg: &RenderConfig,
    id: &felix_proto::PolicyId,
    policy: &felix_proto::Policy,
    v: IpVersion,
) -> [Chain; 2] {
    let who = if id.namespace.is_empty() {
        format!("{} {}", id.kind, id.name)
    } else {
        format!("{} {}/{}", id.kind, id.namespace, id.name)
    };
    // Felix does not log untracked policy's verdicts to NFLOG (the cost on an untracked path).
    let untracked_cfg;
    let cfg = if policy.untracked && cfg.flow_logs {
        untracked_cfg = RenderConfig {
            flow_logs: false,
            ..cfg.clone()
        };
        &untracked_cfg
    } else {
        cfg
    };
    let key = policy_id_string(id);
    let rule_id = |direction| {
        let policy = key.clone();
        move |index| RuleId::Policy {
            policy: policy.clone(),
            direction,
            index,
        }
    };
    [
        Chain::new(
            policy_chain_name(POLICY_INBOUND_PFX, id),
            render_rules(
                cfg,
                &policy.inbound_rules,
                v,
                &format!("{who} ingress"),
                rule_id(Direction::Ingress),
            ),
        ),
        Chain::new(
            policy_chain_name(POLICY_OUTBOUND_PFX, id),
            render_rules(
                cfg,
                &policy.outbound_rules,
                v,
                &format!("{who} egress"),
                rule_id(Direction::Egress),
            ),
        ),
    ]
}

/// The inbound (`cali-pri-`) and outbound (`cali-pro-`) chains of a profile for one family.
pub(crate) fn profile_chains(
    cfg: &RenderConfig,
    name: &str,
    profile: &felix_proto::Profile,
    v: IpVersion,
) -> [Chain; 2] {
    let rule_id = |direction| {
        move |index| RuleId::Profile {
            profile: name.to_owned(),
            direction,
            index,
        }
    };
    [
        Chain::new(
            profile_chain_name(PROFILE_INBOUND_PFX, name),
            render_rules(
                cfg,
                &profile.inbound_rules,
                v,
                &format!("Profile {name} ingress"),
                rule_id(Direction::Ingress),
            ),
        ),
        Chain::new(
            profile_chain_name(PROFILE_OUTBOUND_PFX, name),
            render_rules(
                cfg,
                &profile.outbound_rules,
                v,
                &format!("Profile {name} egress"),
                rule_id(Direction::Egress),
            ),
        ),
    ]
}

/// Renders a rule list into the rule model every writer reads; each rule carries the id
/// `rule_id` gives its index in `rules`. Trailing `RETURN`s are dropped (they decide nothing)
/// and the first rule carries `chain_comment` (an empty chain gets a no-op rule to carry it).
pub(crate) fn render_rules(
    cfg: &RenderConfig,
    rules: &[ProtoRule],
    v: IpVersion,
    chain_comment: &str,
    rule_id: impl Fn(u32) -> RuleId,
) -> Vec<Rule> {
    let mut out: Vec<Rule> = Vec::new();
    for (i, r) in rules.iter().enumerate() {
        let id = rule_id(u32::try_from(i).unwrap_or(u32::MAX));
        let mut rendered = render_rule(cfg, r, v);
        if cfg.flow_logs {
            add_nflog(&mut rendered, r, &id);
        }
        out.extend(rendered.into_iter().map(|rule| rule.with_id(id.clone())));
    }
    while out.last().is_some_and(|r| r.action == Action::Return) {
        out.pop();
    }
    if out.is_empty() {
        // A comment-only rule that does nothing, so the chain says whose it is.
        out.push(Rule::always(Action::Return));
        out[0].comments.push(chain_comment.to_owned());
        // Keep the chain a no-op: a trailing RETURN is harmless here since nothing follows.
    } else {
        out[0].comments.insert(0, chain_comment.to_owned());
    }
    out
}

/// What a proto rule's action decides, and the mark its first line sets: `None` for `log`,
/// which decides nothing. An unknown action renders as deny ([`combine_with_action`]).
fn verdict_of(action: &str) -> Option<(Verdict, u32)> {
    match action {
        "" | "allow" => Some((Verdict::Allow, marks::ACCEPT)),
        "next-tier" | "pass" => Some((Verdict::Pass, marks::PASS)),
        "log" => None,
        _ => Some((Verdict::Deny, marks::DROP)),
    }
}

/// Flow logs: puts the NFLOG line between a rule's `match → set mark` line and its verdict,
/// gated on the same mark, as Felix does. It is not counted (the hit counter stays on the
/// match line) but carries the rule's id like the other lines.
fn add_nflog(rendered: &mut Vec<Rule>, r: &ProtoRule, id: &RuleId) {
    let Some((verdict, mark)) = verdict_of(&r.action) else {
        return;
    };
    let (Some(prefix), Some(verdict_line)) = (nflog::for_rule(id, verdict), rendered.last()) else {
        return;
    };
    let direction = match id {
        RuleId::Policy { direction, .. } | RuleId::Profile { direction, .. } => *direction,
        _ => return,
    };
    let mut line = Rule::new(
        Match::new().mark_set(mark),
        Action::Nflog {
            group: nflog::group(direction),
            prefix,
        },
    )
    .uncounted();
    // Annotations ride on every line of the rule, this one too.
    line.comments = verdict_line.comments.clone();
    let at = rendered.len() - 1;
    rendered.insert(at, line);
}

/// The family-filtered copy of a rule, or `None` when the rule cannot apply to this family
/// (Felix's `FilterRuleToIPVersion`).
fn filter_to_version(r: &ProtoRule, v: IpVersion) -> Option<ProtoRule> {
    match r.ip_version {
        4 if v != IpVersion::V4 => return None,
        6 if v != IpVersion::V6 => return None,
        _ => {}
    }
    let mut copy = r.clone();
    copy.src_net = filter_nets(&r.src_net, v, false)?;
    copy.not_src_net = filter_nets(&r.not_src_net, v, true)?;
    copy.dst_net = filter_nets(&r.dst_net, v, false)?;
    copy.not_dst_net = filter_nets(&r.not_dst_net, v, true)?;
    Some(copy)
}

/// The CIDRs of family `v`; `None` when a non-empty list has none of them (the rule cannot
/// match), or when a negated list holds the catch-all (`! 0.0.0.0/0` matches nothing).
fn filter_nets(nets: &[String], v: IpVersion, negated: bool) -> Option<Vec<String>> {
    if nets.is_empty() {
        return Some(Vec::new());
    }
    let mut kept = Vec::new();
    for n in nets.iter().filter(|n| v.matches(n)) {
        if negated && (n == "0.0.0.0/0" || n == "::/0") {
            return None;
        }
        kept.push(n.clone());
    }
    if kept.is_empty() { None } else { Some(kept) }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Src,
    Dst,
}

/// Builds the OR-blocks that precede a split rule.
struct Blocks {
    rules: Vec<Rule>,
    using: bool,
    done_first_positive: bool,
}

impl Blocks {
    fn new() -> Self {
        Self {
            rules: Vec::new(),
            using: false,
            done_first_positive: false,
        }
    }

    fn start(&mut self, initial: u32) {
        if self.using {
            return;
        }
        self.rules.push(Rule::always(Action::SetMaskedMark {
            mark: initial,
            mask: marks::SCRATCH0 | marks::SCRATCH1,
        }));
        self.using = true;
    }

    /// The first positive block writes "all pass" directly; later ones use the scratch bit and
    /// fold it in at the end.
    fn positive_mark(&self) -> u32 {
        if self.done_first_positive {
            marks::SCRATCH1
        } else {
            marks::SCRATCH0
        }
    }

    fn finish_positive(&mut self) {
        if !self.done_first_positive {
            self.done_first_positive = true;
            return;
        }
        self.rules.push(Rule::new(
            Match::new().mark_clear(marks::SCRATCH1),
            Action::ClearMark(marks::SCRATCH0),
        ));
        // The scratch bit must start clear for the next block.
        self.rules
            .push(Rule::always(Action::ClearMark(marks::SCRATCH1)));
    }

    fn ports(
        &mut self,
        v: IpVersion,
        protocol: Option<&Protocol>,
        splits: &[Vec<PortRange>],
        named: &[String],
        dir: Dir,
    ) {
        self.start(0);
        let mark = self.positive_mark();
        for split in splits {
            let mut m = protocol_match(Match::new(), protocol);
            let ports = render_ports(split);
            m = match dir {
                Dir::Src => m.src_ports(&ports),
                Dir::Dst => m.dst_ports(&ports),
            };
            self.rules.push(Rule::new(m, Action::SetMark(mark)));
        }
        for id in named {
            let set = ipset_name(v, id);
            let m = match dir {
                Dir::Src => Match::new().src_ip_port_set(&set),
                Dir::Dst => Match::new().dst_ip_port_set(&set),
            };
            self.rules.push(Rule::new(m, Action::SetMark(mark)));
        }
        self.finish_positive();
    }

    fn cidrs(&mut self, cidrs: &[String], dir: Dir) {
        self.start(0);
        let mark = self.positive_mark();
        for c in cidrs {
            let m = match dir {
                Dir::Src => Match::new().src_net(c),
                Dir::Dst => Match::new().dst_net(c),
            };
            self.rules.push(Rule::new(m, Action::SetMark(mark)));
        }
        self.finish_positive();
    }

    fn negated_cidrs(&mut self, cidrs: &[String], dir: Dir) {
        // A negated block starts from "pass" and any match clears it.
        self.start(marks::SCRATCH0);
        for c in cidrs {
            let m = match dir {
                Dir::Src => Match::new().src_net(c),
                Dir::Dst => Match::new().dst_net(c),
            };
            self.rules
                .push(Rule::new(m, Action::ClearMark(marks::SCRATCH0)));
        }
    }
}

/// Renders one proto rule for one family (possibly as several rules), without its id.
pub(crate) fn render_rule(cfg: &RenderConfig, pr: &ProtoRule, v: IpVersion) -> Vec<Rule> {
    let Some(mut r) = filter_to_version(pr, v) else {
        return Vec::new();
    };
    let mut blocks = Blocks::new();

    let src_splits = split_ports(&r.src_ports);
    if src_splits.len() + r.src_named_port_ip_set_ids.len() > 1 {
        blocks.ports(
            v,
            r.protocol.as_ref(),
            &src_splits,
            &r.src_named_port_ip_set_ids,
            Dir::Src,
        );
        r.src_ports.clear();
        r.src_named_port_ip_set_ids.clear();
    }
    let dst_splits = split_ports(&r.dst_ports);
    if dst_splits.len() + r.dst_named_port_ip_set_ids.len() > 1 {
        blocks.ports(
            v,
            r.protocol.as_ref(),
            &dst_splits,
            &r.dst_named_port_ip_set_ids,
            Dir::Dst,
        );
        r.dst_ports.clear();
        r.dst_named_port_ip_set_ids.clear();
    }
    if r.src_net.len() > 1 {
        blocks.cidrs(&r.src_net, Dir::Src);
        r.src_net.clear();
    }
    if r.dst_net.len() > 1 {
        blocks.cidrs(&r.dst_net, Dir::Dst);
        r.dst_net.clear();
    }
    if r.src_net.len() + r.not_src_net.len() > 1 {
        blocks.negated_cidrs(&r.not_src_net, Dir::Src);
        r.not_src_net.clear();
    }
    if r.dst_net.len() + r.not_dst_net.len() > 1 {
        blocks.negated_cidrs(&r.not_dst_net, Dir::Dst);
        r.not_dst_net.clear();
    }

    let mut m = rule_match(&r, v);
    if blocks.using {
        m = m.mark_set(marks::SCRATCH0);
    }
    let mut out = blocks.rules;
    out.extend(combine_with_action(cfg, &r, m));
    if let Some(meta) = &pr.metadata {
        let mut annotations: Vec<_> = meta.annotations.iter().collect();
        annotations.sort();
        for rule in &mut out {
            for (k, val) in &annotations {
                rule.comments.push(format!("{k}={val}"));
            }
        }
    }
    out
}

/// The match and its verdict: `match → set mark`, then the action gated on the mark.
fn combine_with_action(cfg: &RenderConfig, r: &ProtoRule, m: Match) -> Vec<Rule> {
    let (mark, action) = match r.action.as_str() {
        "" | "allow" => (marks::ACCEPT, Action::Return),
        "next-tier" | "pass" => (marks::PASS, Action::Return),
        "deny" => (marks::DROP, cfg.deny.clone()),
        "log" => {
            return vec![Rule::new(
                m,
                Action::Log {
                    prefix: cfg.log_prefix.clone(),
                },
            )];
        }
        other => {
            // The server validates actions; an unknown one must never widen access.
            tracing::warn!(action = other, "unknown rule action; rendering as deny");
            (marks::DROP, cfg.deny.clone())
        }
    };
    vec![
        Rule::new(m, Action::SetMark(mark)),
        Rule::new(Match::new().mark_set(mark), action).uncounted(),
    ]
}

fn protocol_match(m: Match, p: Option<&Protocol>) -> Match {
    match p.and_then(|p| p.number_or_name.as_ref()) {
        Some(protocol::NumberOrName::Name(n)) => m.protocol(n),
        Some(protocol::NumberOrName::Number(n)) => m.protocol(&n.to_string()),
        None => m,
    }
}

/// The single-rule part of a (possibly split) proto rule, in Felix's fragment order.
fn rule_match(r: &ProtoRule, v: IpVersion) -> Match {
    let mut m = protocol_match(Match::new(), r.protocol.as_ref());
    if let Some(n) = r.src_net.first() {
        m = m.src_net(n);
    }
    for id in &r.src_ip_set_ids {
        m = m.src_set(&ipset_name(v, id));
    }
    if !r.src_ports.is_empty() {
        m = m.src_ports(&render_ports(&r.src_ports));
    }
    for id in &r.src_named_port_ip_set_ids {
        m = m.src_ip_port_set(&ipset_name(v, id));
    }
    if let Some(n) = r.dst_net.first() {
        m = m.dst_net(n);
    }
    for id in &r.dst_ip_set_ids {
        m = m.dst_set(&ipset_name(v, id));
    }
    for id in &r.dst_ip_port_set_ids {
        m = m.dst_ip_port_set(&ipset_name(v, id));
    }
    if !r.dst_ports.is_empty() {
        m = m.dst_ports(&render_ports(&r.dst_ports));
    }
    for id in &r.dst_named_port_ip_set_ids {
        m = m.dst_ip_port_set(&ipset_name(v, id));
    }
    match &r.icmp {
        Some(rule::Icmp::IcmpType(t)) => m = m.icmp_type(v, *t, None),
        Some(rule::Icmp::IcmpTypeCode(tc)) => m = m.icmp_type(v, tc.r#type, Some(tc.code)),
        None => {}
    }

    match r
        .not_protocol
        .as_ref()
        .and_then(|p| p.number_or_name.as_ref())
    {
        Some(protocol::NumberOrName::Name(n)) => m = m.not_protocol(n),
        Some(protocol::NumberOrName::Number(n)) => m = m.not_protocol(&n.to_string()),
        None => {}
    }
    if let Some(n) = r.not_src_net.first() {
        m = m.not_src_net(n);
    }
    for id in &r.not_src_ip_set_ids {
        m = m.not_src_set(&ipset_name(v, id));
    }
    // Negated port lists are and-ed: "not in any split" = "not in each split".
    for split in split_ports(&r.not_src_ports) {
        m = m.not_src_ports(&render_ports(&split));
    }
    for id in &r.not_src_named_port_ip_set_ids {
        m = m.not_src_ip_port_set(&ipset_name(v, id));
    }
    if let Some(n) = r.not_dst_net.first() {
        m = m.not_dst_net(n);
    }
    for id in &r.not_dst_ip_set_ids {
        m = m.not_dst_set(&ipset_name(v, id));
    }
    for split in split_ports(&r.not_dst_ports) {
        m = m.not_dst_ports(&render_ports(&split));
    }
    for id in &r.not_dst_named_port_ip_set_ids {
        m = m.not_dst_ip_port_set(&ipset_name(v, id));
    }
    match &r.not_icmp {
        Some(rule::NotIcmp::NotIcmpType(t)) => m = m.not_icmp_type(v, *t, None),
        Some(rule::NotIcmp::NotIcmpTypeCode(tc)) => {
            m = m.not_icmp_type(v, tc.r#type, Some(tc.code))
        }
        None => {}
    }
    m
}

/// Splits a port list into multiport-sized groups: 15 slots each, a range taking two.
pub(crate) fn split_ports(ports: &[PortRange]) -> Vec<Vec<PortRange>> {
    let mut splits = Vec::new();
    let mut current: Vec<PortRange> = Vec::new();
    let mut free = 15;
    for p in ports {
        let need = if p.first == p.last { 1 } else { 2 };
        if free < need {
            splits.push(std::mem::take(&mut current));
            free = 15;
        }
        current.push(*p);
        free -= need;
    }
    if !current.is_empty() {
        splits.push(current);
    }
    splits
}

fn render_ports(ports: &[PortRange]) -> String {
    let parts: Vec<String> = ports
        .iter()
        .map(|p| {
            if p.first == p.last {
                p.first.to_string()
            } else {
                format!("{}:{}", p.first, p.last)
            }
        })
        .collect();
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_proto::{IcmpTypeAndCode, PolicyId, RuleMetadata};

    fn tcp() -> Option<Protocol> {
        Some(Protocol {
            number_or_name: Some(protocol::NumberOrName::Name("tcp".into())),
        })
    }

    fn port(p: i32) -> PortRange {
        PortRange { first: p, last: p }
    }

    fn lines(rules: &[Rule]) -> Vec<String> {
        rules.iter().map(|r| r.render_append("c", "")).collect()
    }

    #[test]
    fn allow_tcp_port_from_a_set_renders_mark_then_return() {
        let r = ProtoRule {
            action: "allow".into(),
            protocol: tcp(),
            src_ip_set_ids: vec!["s:abc".into()],
            dst_ports: vec![
                port(80),
                PortRange {
                    first: 8000,
                    last: 8080,
                },
            ],
            ..Default::default()
        };
        let out = render_rule(&RenderConfig::default(), &r, IpVersion::V4);
        assert_eq!(
            lines(&out),
            vec![
                "-A c --protocol tcp -m set --match-set cali40s:abc src \
                 -m multiport --destination-ports 80,8000:8080 \
                 --jump MARK --set-mark 0x10000/0x10000",
                "-A c -m mark --mark 0x10000/0x10000 --jump RETURN",
            ]
        );
    }

    #[test]
    fn deny_pass_and_log_verdicts() {
        let cfg = RenderConfig::default();
        let deny = ProtoRule {
            action: "deny".into(),
            ..Default::default()
        };
        assert_eq!(
            lines(&render_rule(&cfg, &deny, IpVersion::V4)),
            vec![
                "-A c --jump MARK --set-mark 0x40000/0x40000",
                "-A c -m mark --mark 0x40000/0x40000 --jump DROP",
            ]
        );
        let pass = ProtoRule {
            action: "pass".into(),
            ..Default::default()
        };
        assert_eq!(
            lines(&render_rule(&cfg, &pass, IpVersion::V6))[1],
            "-A c -m mark --mark 0x20000/0x20000 --jump RETURN"
        );
        let log = ProtoRule {
            action: "log".into(),
            ..Default::default()
        };
        assert_eq!(
            lines(&render_rule(&cfg, &log, IpVersion::V4)),
            vec!["-A c --jump LOG --log-prefix \"calico-packet: \" --log-level 5"]
        );
    }

    #[test]
    fn rules_of_the_other_family_vanish() {
        let cfg = RenderConfig::default();
        let v6_only = ProtoRule {
            ip_version: 6,
            ..Default::default()
        };
        assert!(render_rule(&cfg, &v6_only, IpVersion::V4).is_empty());
        let v4_net = ProtoRule {
            src_net: vec!["10.0.0.0/8".into()],
            ..Default::default()
        };
        assert!(render_rule(&cfg, &v4_net, IpVersion::V6).is_empty());
        let mixed = ProtoRule {
            src_net: vec!["10.0.0.0/8".into(), "fd00::/64".into()],
            ..Default::default()
        };
        assert_eq!(
            lines(&render_rule(&cfg, &mixed, IpVersion::V6))[0],
            "-A c --source fd00::/64 --jump MARK --set-mark 0x10000/0x10000"
        );
        // "not from anywhere" matches nothing: the rule is dropped.
        let not_all = ProtoRule {
            not_src_net: vec!["0.0.0.0/0".into()],
            ..Default::default()
        };
        assert!(render_rule(&cfg, &not_all, IpVersion::V4).is_empty());
    }

    #[test]
    fn more_than_15_port_slots_become_an_or_block() {
        let ports: Vec<PortRange> = (1..=10)
            .map(|i| PortRange {
                first: i * 100,
                last: i * 100 + 1,
            })
            .collect();
        assert_eq!(split_ports(&ports).len(), 2, "10 ranges = 20 slots");
        let r = ProtoRule {
            protocol: tcp(),
            dst_ports: ports,
            ..Default::default()
        };
        let out = lines(&render_rule(&RenderConfig::default(), &r, IpVersion::V4));
        assert_eq!(out.len(), 5);
        assert_eq!(out[0], "-A c --jump MARK --set-mark 0x0/0x180000");
        assert!(
            out[1].contains("--destination-ports 100:101,") && out[1].ends_with("0x80000/0x80000")
        );
        assert!(out[2].contains("--destination-ports 800:801,900:901,1000:1001"));
        assert_eq!(
            out[3],
            "-A c --protocol tcp -m mark --mark 0x80000/0x80000 --jump MARK --set-mark 0x10000/0x10000"
        );
    }

    #[test]
    fn several_cidrs_and_negations_use_both_scratch_bits() {
        let r = ProtoRule {
            src_net: vec!["10.0.0.0/8".into(), "192.168.0.0/16".into()],
            dst_net: vec!["10.1.0.0/16".into(), "10.2.0.0/16".into()],
            not_src_net: vec!["10.9.0.0/16".into()],
            ..Default::default()
        };
        let out = lines(&render_rule(&RenderConfig::default(), &r, IpVersion::V4));
        assert_eq!(
            out,
            vec![
                "-A c --jump MARK --set-mark 0x0/0x180000",
                "-A c --source 10.0.0.0/8 --jump MARK --set-mark 0x80000/0x80000",
                "-A c --source 192.168.0.0/16 --jump MARK --set-mark 0x80000/0x80000",
                "-A c --destination 10.1.0.0/16 --jump MARK --set-mark 0x100000/0x100000",
                "-A c --destination 10.2.0.0/16 --jump MARK --set-mark 0x100000/0x100000",
                "-A c -m mark --mark 0/0x100000 --jump MARK --set-mark 0/0x80000",
                "-A c --jump MARK --set-mark 0/0x100000",
                "-A c ! --source 10.9.0.0/16 -m mark --mark 0x80000/0x80000 \
                 --jump MARK --set-mark 0x10000/0x10000",
                "-A c -m mark --mark 0x10000/0x10000 --jump RETURN",
            ]
        );
    }

    #[test]
    fn named_ports_or_with_numeric_ports() {
        let r = ProtoRule {
            protocol: tcp(),
            dst_ports: vec![port(80)],
            dst_named_port_ip_set_ids: vec!["n:web".into()],
            ..Default::default()
        };
        let out = lines(&render_rule(&RenderConfig::default(), &r, IpVersion::V4));
        assert_eq!(
            out[1],
            "-A c --protocol tcp -m multiport --destination-ports 80 --jump MARK --set-mark 0x80000/0x80000"
        );
        assert_eq!(
            out[2],
            "-A c -m set --match-set cali40n:web dst,dst --jump MARK --set-mark 0x80000/0x80000"
        );
        // A single named port alone fits in the main rule.
        let single = ProtoRule {
            protocol: tcp(),
            dst_named_port_ip_set_ids: vec!["n:web".into()],
            ..Default::default()
        };
        let out = lines(&render_rule(
            &RenderConfig::default(),
            &single,
            IpVersion::V6,
        ));
        assert_eq!(
            out[0],
            "-A c --protocol tcp -m set --match-set cali60n:web dst,dst --jump MARK --set-mark 0x10000/0x10000"
        );
    }

    #[test]
    fn icmp_negations_and_annotations() {
        let r = ProtoRule {
            protocol: Some(Protocol {
                number_or_name: Some(protocol::NumberOrName::Name("icmp".into())),
            }),
            icmp: Some(rule::Icmp::IcmpTypeCode(IcmpTypeAndCode {
                r#type: 8,
                code: 0,
            })),
            not_dst_ports: vec![port(1)],
            not_src_ip_set_ids: vec!["s:bad".into()],
            metadata: Some(RuleMetadata {
                annotations: [("team".to_owned(), "net".to_owned())].into(),
            }),
            ..Default::default()
        };
        let out = lines(&render_rule(&RenderConfig::default(), &r, IpVersion::V4));
        assert_eq!(
            out[0],
            "-A c -m comment --comment \"team=net\" --protocol icmp -m icmp --icmp-type 8/0 \
             -m set ! --match-set cali40s:bad src -m multiport ! --destination-ports 1 \
             --jump MARK --set-mark 0x10000/0x10000"
        );
    }

    #[test]
    fn policy_chains_trim_trailing_returns_and_carry_a_comment() {
        let id = PolicyId {
            name: "p".into(),
            namespace: "ns".into(),
            kind: "NetworkPolicy".into(),
        };
        let pol = felix_proto::Policy {
            inbound_rules: vec![ProtoRule {
                action: "allow".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let [inb, outb] = policy_chains(&RenderConfig::default(), &id, &pol, IpVersion::V4);
        assert_eq!(inb.name, "cali-pi-np/ns/p");
        // The allow's RETURN is the last rule: trimmed, the chain ends there anyway.
        assert_eq!(inb.rules.len(), 1);
        assert_eq!(inb.rules[0].action, Action::SetMark(marks::ACCEPT));
        assert_eq!(inb.rules[0].comments, vec!["NetworkPolicy ns/p ingress"]);
        assert_eq!(outb.name, "cali-po-np/ns/p");
        assert_eq!(
            outb.rules.len(),
            1,
            "an empty chain keeps one commented no-op"
        );
        assert_eq!(outb.rules[0].action, Action::Return);
    }

    /// Flow logs on: each deciding rule gets an NFLOG line between its mark and its verdict,
    /// uncounted, with Felix's group and prefix; `log` rules and untracked policies get none.
    /// Golden in both syntaxes (iptables-restore and nft).
    #[test]
    fn flow_logs_put_an_nflog_line_before_each_verdict() {
        let cfg = RenderConfig {
            flow_logs: true,
            ..RenderConfig::default()
        };
        let id = PolicyId {
            name: "default.web".into(),
            namespace: "prod".into(),
            kind: "NetworkPolicy".into(),
        };
        let rule = |action: &str| ProtoRule {
            action: action.into(),
            protocol: tcp(),
            ..Default::default()
        };
        let pol = felix_proto::Policy {
            inbound_rules: vec![rule("log"), rule("deny"), rule("pass"), rule("allow")],
            outbound_rules: vec![rule("allow")],
            ..Default::default()
        };
        let [inb, outb] = policy_chains(&cfg, &id, &pol, IpVersion::V4);
        assert_eq!(
            lines(&inb.rules),
            [
                "-A c -m comment --comment \"NetworkPolicy prod/default.web ingress\" --protocol tcp --jump LOG --log-prefix \"calico-packet: \" --log-level 5",
                "-A c --protocol tcp --jump MARK --set-mark 0x40000/0x40000",
                "-A c -m mark --mark 0x40000/0x40000 --jump NFLOG --nflog-group 1 --nflog-prefix \"DPI1|np/prod/default.web\" --nflog-size 80",
                "-A c -m mark --mark 0x40000/0x40000 --jump DROP",
                "-A c --protocol tcp --jump MARK --set-mark 0x20000/0x20000",
                "-A c -m mark --mark 0x20000/0x20000 --jump NFLOG --nflog-group 1 --nflog-prefix \"PPI2|np/prod/default.web\" --nflog-size 80",
                "-A c -m mark --mark 0x20000/0x20000 --jump RETURN",
                "-A c --protocol tcp --jump MARK --set-mark 0x10000/0x10000",
                "-A c -m mark --mark 0x10000/0x10000 --jump NFLOG --nflog-group 1 --nflog-prefix \"API3|np/prod/default.web\" --nflog-size 80",
            ]
        );
        // Only the match lines count; the NFLOG lines carry the rule's id.
        let counted: Vec<_> = inb.rules.iter().filter_map(Rule::counted_id).collect();
        assert_eq!(counted.len(), 4, "log, deny, pass, allow: one line each");
        let nflog: Vec<_> = inb
            .rules
            .iter()
            .filter(|r| matches!(r.action, Action::Nflog { .. }))
            .collect();
        assert!(nflog.iter().all(|r| !r.counts && r.id.is_some()));
        assert_eq!(
            lines(&outb.rules)[1],
            "-A c -m mark --mark 0x10000/0x10000 --jump NFLOG --nflog-group 2 --nflog-prefix \"APE0|np/prod/default.web\" --nflog-size 80"
        );
        // The same line in nft syntax.
        assert_eq!(
            crate::driver::linux::nft::render::rule_bodies(&outb.rules[1], "filter", IpVersion::V4),
            [
                "meta mark & 0x00010000 == 0x00010000 counter log prefix \"APE0|np/prod/default.web\" group 2 snaplen 80"
            ]
        );

        // Off: byte-identical to what was rendered before flow logs existed.
        let [off, _] = policy_chains(&RenderConfig::default(), &id, &pol, IpVersion::V4);
        assert!(
            off.rules
                .iter()
                .all(|r| !matches!(r.action, Action::Nflog { .. }))
        );
        assert_eq!(off.rules.len(), inb.rules.len() - 3);

        // Untracked policy: no NFLOG, as Felix.
        let untracked = felix_proto::Policy {
            untracked: true,
            ..pol.clone()
        };
        let [inb, _] = policy_chains(&cfg, &id, &untracked, IpVersion::V4);
        assert!(
            inb.rules
                .iter()
                .all(|r| !matches!(r.action, Action::Nflog { .. }))
        );

        // Profiles: owner R, the profile's name.
        let prof = felix_proto::Profile {
            inbound_rules: vec![rule("allow"), rule("deny")],
            ..Default::default()
        };
        let [inb, _] = profile_chains(&cfg, "kns.prod", &prof, IpVersion::V4);
        let prefixes: Vec<_> = inb
            .rules
            .iter()
            .filter_map(|r| match &r.action {
                Action::Nflog { group, prefix } => Some((*group, prefix.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(prefixes, [(1, "ARI0|kns.prod"), (1, "DRI1|kns.prod")]);
    }
}
