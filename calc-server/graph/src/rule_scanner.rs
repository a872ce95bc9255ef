//! Rule scanner: model rules → felixbackend `Rule`s whose selectors and named ports are replaced
//! by IP-set ids, plus the definitions of those IP sets.
//!
//! Follows Felix's `rule_scanner.go` and `rule_convert.go`: a negated selector is folded into the
//! positive one when there is one (`(pos) && (!(neg))`); named ports become IP_AND_PORT sets over
//! the positive selector (or `all()`), with the rule's protocol (TCP when unset); the plain
//! selector set is only emitted when there are numeric ports or no named ports; the rule's
//! `rule_id` is Felix's SHA-224 chain over the encoded rules.

use std::collections::BTreeMap;

use base64::Engine;
use felix_proto as pb;
use prost::Message;
use sha2::{Digest, Sha224};

use crate::convert::{BadSelector, ModelRule};
use crate::hash::named_port_ipset_id;
use crate::model::rule::{Port, Protocol};
use crate::selector::Selector;

/// The kind of members an IP set holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum IpSetKind {
    /// CIDRs of matching endpoints and network sets.
    Net,
    /// `ip,proto:port` of matching endpoints' named port.
    NamedPort { protocol: String, name: String },
    /// A Kubernetes Service's endpoint addresses (`<namespace>/<name>`), with its ports for a
    /// destination match (`svc`, IP_AND_PORT) and without for a source match (`svcnoport`,
    /// NET), as Felix's `IPSetData.UniqueID` and `DataplaneProtocolType`. Members come from the
    /// Service's EndpointSlices (`graph::services`); without any, the set is empty and a rule
    /// that uses it matches nothing (never wider).
    Service {
        service: String,
        include_ports: bool,
    },
}

/// One IP set a rule needs.
#[derive(Clone, Debug, PartialEq)]
pub struct IpSetSpec {
    pub id: String,
    pub selector: Selector,
    pub kind: IpSetKind,
}

impl IpSetSpec {
    fn selector(sel: &Selector) -> IpSetSpec {
        IpSetSpec {
            id: sel.unique_id().to_string(),
            selector: sel.clone(),
            kind: IpSetKind::Net,
        }
    }

    fn named_port(sel: &Selector, protocol: &str, name: &str) -> IpSetSpec {
        IpSetSpec {
            id: named_port_ipset_id(sel.unique_id(), protocol, name),
            selector: sel.clone(),
            kind: IpSetKind::NamedPort {
                protocol: protocol.to_string(),
                name: name.to_string(),
            },
        }
    }

    fn service(service: String, include_ports: bool) -> IpSetSpec {
        let prefix = if include_ports { "svc" } else { "svcnoport" };
        IpSetSpec {
            id: crate::hash::make_unique_id(prefix, &service),
            // Not used: service sets are not matched against labels.
            selector: Selector::all(),
            kind: IpSetKind::Service {
                service,
                include_ports,
            },
        }
    }

    pub fn proto_type(&self) -> pb::ip_set_update::IpSetType {
        match self.kind {
            IpSetKind::Net
            | IpSetKind::Service {
                include_ports: false,
                ..
            } => pb::ip_set_update::IpSetType::Net,
            IpSetKind::NamedPort { .. }
            | IpSetKind::Service {
                include_ports: true,
                ..
            } => pb::ip_set_update::IpSetType::IpAndPort,
        }
    }
}

/// Scanned rules of one policy or profile: proto rules and every IP set they reference
/// (de-duplicated, in first-use order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScannedRules {
    pub inbound: Vec<pb::Rule>,
    pub outbound: Vec<pb::Rule>,
    pub ipsets: Vec<IpSetSpec>,
}

/// Scans a policy's or profile's rules. `rule_id_seed` gives Felix's rule-id chains their
/// starting points, e.g. `("pol-in-default/<name>", "pol-out-default/<name>")`.
pub fn scan_rules(
    inbound: &[ModelRule],
    outbound: &[ModelRule],
    rule_id_seeds: (&str, &str),
) -> Result<ScannedRules, BadSelector> {
    let mut out = ScannedRules::default();
    let mut seen = BTreeMap::new();
    for (rules, dest, seed) in [
        (inbound, &mut out.inbound, rule_id_seeds.0),
        (outbound, &mut out.outbound, rule_id_seeds.1),
    ] {
        let mut chain = Sha224::digest(seed.as_bytes()).to_vec();
        dest.reserve_exact(rules.len());
        for r in rules {
            let (mut rule, sets) = scan_rule(r)?;
            let mut h = Sha224::new();
            h.update(&chain);
            h.update(rule.encode_to_vec());
            chain = h.finalize().to_vec();
            let id = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&chain);
            rule.rule_id = id[..16].to_string();
            dest.push(rule);
            for s in sets {
                if !seen.contains_key(&s.id) {
                    seen.insert(s.id.clone(), ());
                    out.ipsets.push(s);
                }
            }
        }
    }
    Ok(out)
}

/// Calico's `combineMatchesIfPossible`.
fn combine(positive: &str, negated: &str) -> (String, String) {
    if positive.is_empty() || negated.is_empty() {
        return (positive.to_string(), negated.to_string());
    }
    (format!("({positive}) && (!({negated}))"), String::new())
}

fn split_ports(ports: &[Port]) -> (Vec<pb::PortRange>, Vec<&str>) {
    let mut numeric = Vec::new();
    let mut named = Vec::new();
    for p in ports {
        match p {
            Port::Range { min, max } => numeric.push(pb::PortRange {
                first: i32::from(*min),
                last: i32::from(*max),
            }),
            Port::Named(n) => named.push(n.as_str()),
            Port::Invalid(_) => {}
        }
    }
    (numeric, named)
}

fn proto_protocol(p: &Option<Protocol>) -> Option<pb::Protocol> {
    p.as_ref().map(|p| pb::Protocol {
        number_or_name: Some(match p {
            Protocol::Number(n) => pb::protocol::NumberOrName::Number(*n as i32),
            Protocol::Name(s) => pb::protocol::NumberOrName::Name(s.to_ascii_lowercase()),
        }),
    })
}

fn ip_version(v: Option<i64>, proto: &Option<Protocol>) -> i32 {
    match v {
        Some(4) => pb::IpVersion::Ipv4 as i32,
        Some(6) => pb::IpVersion::Ipv6 as i32,
        // Felix infers the version from the protocol's name only (`icmp`, `icmpv6`), not
        // from numbers 1 or 58.
        _ => match proto {
            Some(Protocol::Name(n)) if n.eq_ignore_ascii_case("icmp") => pb::IpVersion::Ipv4 as i32,
            Some(Protocol::Name(n)) if n.eq_ignore_ascii_case("icmpv6") => {
                pb::IpVersion::Ipv6 as i32
            }
            _ => pb::IpVersion::Any as i32,
        },
    }
}

fn sel_opt(s: &str) -> Result<Option<Selector>, BadSelector> {
    if s.is_empty() {
        Ok(None)
    } else {
        crate::convert::parse(s).map(Some)
    }
}

/// Converts one rule; returns the proto rule (without `rule_id`) and its IP sets.
pub fn scan_rule(r: &ModelRule) -> Result<(pb::Rule, Vec<IpSetSpec>), BadSelector> {
    let (src_raw, not_src_raw) = combine(&r.src_selector, &r.not_src_selector);
    let (dst_raw, not_dst_raw) = combine(&r.dst_selector, &r.not_dst_selector);
    let src = sel_opt(&src_raw)?;
    let dst = sel_opt(&dst_raw)?;
    let not_src = sel_opt(&not_src_raw)?;
    let not_dst = sel_opt(&not_dst_raw)?;

    let (src_ports, src_named) = split_ports(&r.src_ports);
    let (dst_ports, dst_named) = split_ports(&r.dst_ports);
    let (not_src_ports, not_src_named) = split_ports(&r.not_src_ports);
    let (not_dst_ports, not_dst_named) = split_ports(&r.not_dst_ports);

    // Named ports on endpoints carry a protocol; rules carry it at the top level.
    let np_proto = match r.protocol.as_ref().and_then(Protocol::number) {
        Some(17) => "udp",
        Some(132) => "sctp",
        _ => "tcp",
    };
    let all = Selector::all();
    let named_sets = |names: &[&str], positive: &Option<Selector>| -> Vec<IpSetSpec> {
        let sel = positive.as_ref().unwrap_or(&all);
        names
            .iter()
            .map(|n| IpSetSpec::named_port(sel, np_proto, n))
            .collect()
    };
    let src_np = named_sets(&src_named, &src);
    let dst_np = named_sets(&dst_named, &dst);
    // Negated named ports are filtered by the positive selector too (the rule only matches
    // packets the positive selector allows anyway).
    let not_src_np = named_sets(&not_src_named, &src);
    let not_dst_np = named_sets(&not_dst_named, &dst);

    let src_sel: Vec<IpSetSpec> = if !src_ports.is_empty() || src_named.is_empty() {
        src.iter().map(IpSetSpec::selector).collect()
    } else {
        Vec::new()
    };
    let dst_sel: Vec<IpSetSpec> = if !dst_ports.is_empty() || dst_named.is_empty() {
        dst.iter().map(IpSetSpec::selector).collect()
    } else {
        Vec::new()
    };
    let not_src_sel: Vec<IpSetSpec> = not_src.iter().map(IpSetSpec::selector).collect();
    let not_dst_sel: Vec<IpSetSpec> = not_dst.iter().map(IpSetSpec::selector).collect();
    // Services, as Felix's rule scanner: the destination's addresses and ports, the source's
    // addresses.
    let mut src_sel = src_sel;
    if let Some((name, ns)) = &r.src_service {
        src_sel.push(IpSetSpec::service(format!("{ns}/{name}"), false));
    }
    let dst_port_sets: Vec<IpSetSpec> = r
        .dst_service
        .iter()
        .map(|(name, ns)| IpSetSpec::service(format!("{ns}/{name}"), true))
        .collect();

    let ids = |v: &[IpSetSpec]| v.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
    let icmp = |t: Option<i64>, c: Option<i64>| match (t, c) {
        (Some(t), Some(c)) => Some((t as i32, Some(c as i32))),
        (Some(t), None) => Some((t as i32, None)),
        _ => None,
    };
    let mut rule = pb::Rule {
        action: r.action.clone(),
        ip_version: ip_version(r.ip_version, &r.protocol),
        protocol: proto_protocol(&r.protocol),
        src_net: r.src_nets.clone(),
        src_ports,
        src_named_port_ip_set_ids: ids(&src_np),
        dst_net: r.dst_nets.clone(),
        dst_ports,
        dst_named_port_ip_set_ids: ids(&dst_np),
        src_ip_set_ids: ids(&src_sel),
        dst_ip_set_ids: ids(&dst_sel),
        dst_ip_port_set_ids: ids(&dst_port_sets),
        not_protocol: proto_protocol(&r.not_protocol),
        not_src_net: r.not_src_nets.clone(),
        not_src_ports,
        not_dst_net: r.not_dst_nets.clone(),
        not_dst_ports,
        not_src_ip_set_ids: ids(&not_src_sel),
        not_dst_ip_set_ids: ids(&not_dst_sel),
        not_src_named_port_ip_set_ids: ids(&not_src_np),
        not_dst_named_port_ip_set_ids: ids(&not_dst_np),
        original_src_selector: r.original_src_selector.clone(),
        original_dst_selector: r.original_dst_selector.clone(),
        original_src_namespace_selector: r.original_src_namespace_selector.clone(),
        original_dst_namespace_selector: r.original_dst_namespace_selector.clone(),
        original_not_src_selector: r.original_not_src_selector.clone(),
        original_not_dst_selector: r.original_not_dst_selector.clone(),
        ..Default::default()
    };
    rule.icmp = icmp(r.icmp_type, r.icmp_code).map(|(t, c)| match c {
        Some(code) => pb::rule::Icmp::IcmpTypeCode(pb::IcmpTypeAndCode { r#type: t, code }),
        None => pb::rule::Icmp::IcmpType(t),
    });
    rule.not_icmp = icmp(r.not_icmp_type, r.not_icmp_code).map(|(t, c)| match c {
        Some(code) => pb::rule::NotIcmp::NotIcmpTypeCode(pb::IcmpTypeAndCode { r#type: t, code }),
        None => pb::rule::NotIcmp::NotIcmpType(t),
    });
    if let Some((names, sel)) = &r.src_service_accounts {
        rule.src_service_account_match = Some(pb::ServiceAccountMatch {
            selector: sel.clone(),
            names: names.clone(),
        });
    }
    if let Some((names, sel)) = &r.dst_service_accounts {
        rule.dst_service_account_match = Some(pb::ServiceAccountMatch {
            selector: sel.clone(),
            names: names.clone(),
        });
    }
    if let Some((name, ns)) = &r.src_service {
        rule.original_src_service = name.clone();
        rule.original_src_service_namespace = ns.clone();
    }
    if let Some((name, ns)) = &r.dst_service {
        rule.original_dst_service = name.clone();
        rule.original_dst_service_namespace = ns.clone();
    }
    if let Some((methods, paths)) = &r.http {
        rule.http_match = Some(pb::HttpMatch {
            methods: methods.clone(),
            paths: paths
                .iter()
                .filter_map(|(exact, prefix)| {
                    let m = match (exact, prefix) {
                        (Some(e), _) => pb::http_match::path_match::PathMatch::Exact(e.clone()),
                        (None, Some(p)) => pb::http_match::path_match::PathMatch::Prefix(p.clone()),
                        _ => return None,
                    };
                    Some(pb::http_match::PathMatch {
                        path_match: Some(m),
                    })
                })
                .collect(),
        });
    }
    if !r.annotations.is_empty() {
        rule.metadata = Some(pb::RuleMetadata {
            annotations: r.annotations.clone().into_iter().collect(),
        });
    }
    let mut sets = Vec::new();
    for v in [
        src_np,
        dst_np,
        not_src_np,
        not_dst_np,
        src_sel,
        dst_sel,
        dst_port_sets,
        not_src_sel,
        not_dst_sel,
    ] {
        sets.extend(v);
    }
    Ok((rule, sets))
}

/// Felix's rules for a profile that endpoints reference but that does not exist: deny both ways.
pub fn missing_profile_rules() -> (Vec<pb::Rule>, Vec<pb::Rule>) {
    let deny = || pb::Rule {
        action: "deny".into(),
        ..Default::default()
    };
    (vec![deny()], vec![deny()])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(f: impl FnOnce(&mut ModelRule)) -> ModelRule {
        let mut r = ModelRule {
            action: "allow".into(),
            ..Default::default()
        };
        f(&mut r);
        r
    }

    #[test]
    fn selector_becomes_an_ipset() {
        let (r, sets) = scan_rule(&rule(|r| r.src_selector = "b == 'b'".into())).unwrap();
        assert_eq!(
            r.src_ip_set_ids,
            vec!["s:8Fb8HeM2GAxsfgNYVjbNrgSZ2H4cZJI8ODNBVg"]
        );
        assert_eq!(sets.len(), 1);
        assert_eq!(sets[0].kind, IpSetKind::Net);
    }

    #[test]
    fn negated_selector_folds_into_positive_and_named_ports_filter() {
        // Matches calc_states.json: namedport((all()) && !(foo == 'bar'),tcp,tcpport).
        let (r, sets) = scan_rule(&rule(|r| {
            r.protocol = Some(Protocol::Name("tcp".into()));
            r.src_selector = "all()".into();
            r.not_src_selector = "foo == 'bar'".into();
            r.not_src_ports = vec![Port::Named("tcpport".into())];
        }))
        .unwrap();
        assert_eq!(
            r.not_src_named_port_ip_set_ids,
            vec!["n:F1A5OtAiOojasKFLyQcUqhek4je1_QMdHaiHlA"]
        );
        assert_eq!(
            r.src_ip_set_ids,
            vec!["s:EeWw3YaQcA00fIPOgHiOeeTIYsqHTNsDBYLdDw"]
        );
        assert!(
            r.not_src_ip_set_ids.is_empty(),
            "folded into the positive selector"
        );
        assert_eq!(sets.len(), 2);
    }

    #[test]
    fn named_port_without_selector_uses_all_and_drops_selector_set() {
        let (r, sets) = scan_rule(&rule(|r| {
            r.protocol = Some(Protocol::Name("tcp".into()));
            r.dst_ports = vec![Port::Named("tcpport".into())];
        }))
        .unwrap();
        assert_eq!(
            r.dst_named_port_ip_set_ids,
            vec!["n:RMAIMXhhyW5sWWm_0o9euzK6TlyAbtjf6Ta9Jw"]
        );
        assert!(r.dst_ip_set_ids.is_empty());
        assert_eq!(sets.len(), 1);
        // With numeric ports beside the named one, the plain selector set is kept.
        let (r, _) = scan_rule(&rule(|r| {
            r.protocol = Some(Protocol::Name("udp".into()));
            r.dst_selector = "a == 'b'".into();
            r.dst_ports = vec![Port::Named("dns".into()), Port::single(53)];
        }))
        .unwrap();
        assert_eq!(r.dst_ip_set_ids.len(), 1);
        assert_eq!(
            r.dst_ports,
            vec![pb::PortRange {
                first: 53,
                last: 53
            }]
        );
        assert_eq!(r.dst_named_port_ip_set_ids.len(), 1);
    }

    #[test]
    fn icmp_and_ip_version() {
        let (r, _) = scan_rule(&rule(|r| {
            r.protocol = Some(Protocol::Name("icmp".into()));
            r.icmp_type = Some(8);
        }))
        .unwrap();
        assert_eq!(r.ip_version, pb::IpVersion::Ipv4 as i32);
        assert_eq!(r.icmp, Some(pb::rule::Icmp::IcmpType(8)));
        let (r, _) = scan_rule(&rule(|r| {
            r.protocol = Some(Protocol::Name("icmpv6".into()));
            r.icmp_type = Some(1);
            r.icmp_code = Some(4);
        }))
        .unwrap();
        assert_eq!(r.ip_version, pb::IpVersion::Ipv6 as i32);
        assert_eq!(
            r.icmp,
            Some(pb::rule::Icmp::IcmpTypeCode(pb::IcmpTypeAndCode {
                r#type: 1,
                code: 4
            }))
        );
    }

    #[test]
    fn service_matches_use_service_sets_as_felix_names_them() {
        let (r, sets) = scan_rule(&rule(|r| {
            r.dst_service = Some(("db".into(), "prod".into()));
            r.src_service = Some(("web".into(), "prod".into()));
        }))
        .unwrap();
        assert_eq!(
            r.dst_ip_port_set_ids,
            vec![crate::hash::make_unique_id("svc", "prod/db")]
        );
        assert_eq!(
            r.src_ip_set_ids,
            vec![crate::hash::make_unique_id("svcnoport", "prod/web")]
        );
        assert_eq!(sets.len(), 2);
        // Felix lists the source's sets before the destination's.
        assert_eq!(sets[0].proto_type(), pb::ip_set_update::IpSetType::Net);
        assert_eq!(
            sets[1].proto_type(),
            pb::ip_set_update::IpSetType::IpAndPort
        );
        assert_eq!(r.original_dst_service, "db");
        assert_eq!(r.original_src_service_namespace, "prod");
    }

    #[test]
    fn rule_ids_chain_and_differ_by_position() {
        let r = rule(|_| {});
        let a = scan_rules(
            &[r.clone(), r.clone()],
            &[],
            ("pol-in-default/p", "pol-out-default/p"),
        )
        .unwrap();
        assert_eq!(a.inbound[0].rule_id.len(), 16);
        assert_ne!(a.inbound[0].rule_id, a.inbound[1].rule_id);
        let b = scan_rules(&[r], &[], ("pol-in-default/q", "pol-out-default/q")).unwrap();
        assert_ne!(a.inbound[0].rule_id, b.inbound[0].rule_id);
    }
}
