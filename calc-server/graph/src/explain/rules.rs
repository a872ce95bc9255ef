//! One proto rule against one packet, as the Linux dataplane renders it (Felix's
//! `rules/policy.go`): every field present must match (negated ones must not), several CIDRs
//! or several port ranges/named ports are or-ed, several IP sets are and-ed, and a rule whose
//! nets name no CIDR of the packet's family cannot match at all (`FilterRuleToIPVersion`).
//!
//! Contract: pure; IP-set membership comes from the caller ([`Sets`]). A mismatch names the
//! first field that failed, in the order the dataplane tests them, with the rule's original
//! selector text where there is one, so a user reads "source not selected by `role ==
//! 'frontend'`" rather than an IP-set id.

use std::net::IpAddr;

use felix_proto as pb;
use pb::{PortRange, Protocol, protocol::NumberOrName, rule};

use super::Packet;

/// IP-set membership, as the node's kernel sets hold it.
pub trait Sets {
    /// Whether `ip` is in the (net or address) set `id`.
    fn has_ip(&self, id: &str, ip: IpAddr) -> bool;
    /// Whether `ip,protocol:port` is in the (named-port or service) set `id`.
    fn has_ip_port(&self, id: &str, ip: IpAddr, protocol: u8, port: u16) -> bool;
    /// Whether `selector` selects an endpoint at `ip` (by its labels, inherited ones
    /// included); `None` when no endpoint is there. Lets a mismatch name the one part of a
    /// rule's selector that fails.
    fn selects_endpoint(&self, _selector: &crate::selector::Selector, _ip: IpAddr) -> Option<bool> {
        None
    }
}

/// Protocol numbers of the names Calico accepts.
pub fn protocol_number(name: &str) -> Option<u8> {
    Some(match name.to_ascii_lowercase().as_str() {
        "tcp" => 6,
        "udp" => 17,
        "icmp" => 1,
        "icmpv6" | "ipv6-icmp" => 58,
        "sctp" => 132,
        "udplite" => 136,
        n => return n.parse().ok(),
    })
}

/// The name Calico uses for a protocol number, else the number.
pub fn protocol_name(n: u8) -> String {
    match n {
        6 => "TCP".into(),
        17 => "UDP".into(),
        1 => "ICMP".into(),
        58 => "ICMPv6".into(),
        132 => "SCTP".into(),
        136 => "UDPLite".into(),
        n => n.to_string(),
    }
}

fn proto_of(p: &Option<Protocol>) -> Option<(u8, String)> {
    match p.as_ref()?.number_or_name.as_ref()? {
        NumberOrName::Number(n) => Some((u8::try_from(*n).ok()?, n.to_string())),
        NumberOrName::Name(name) => Some((protocol_number(name)?, name.to_uppercase())),
    }
}

/// Whether `ip` is in `cidr` (a bare address counts as a /32 or /128).
pub(crate) fn cidr_contains(cidr: &str, ip: IpAddr) -> bool {
    match cidr.parse::<ipnetwork::IpNetwork>() {
        Ok(net) => net.contains(ip),
        // A bare address is a /32 or /128.
        Err(_) => cidr.parse::<IpAddr>().is_ok_and(|a| a == ip),
    }
}

fn same_family(cidr: &str, ip: IpAddr) -> bool {
    cidr.contains(':') == ip.is_ipv6()
}

fn in_ranges(ranges: &[PortRange], port: u16) -> bool {
    ranges
        .iter()
        .any(|r| i32::from(port) >= r.first && i32::from(port) <= r.last.max(r.first))
}

fn show_ranges(ranges: &[PortRange]) -> String {
    let parts: Vec<String> = ranges
        .iter()
        .map(|r| {
            if r.last <= r.first {
                r.first.to_string()
            } else {
                format!("{}:{}", r.first, r.last)
            }
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// The rule's selector as its author wrote it (the IP-set ids when the rule has none).
fn selector_text(original: &str, namespace: &str, ids: &[String]) -> String {
    match (original.is_empty(), namespace.is_empty()) {
        (true, true) => ids.join(", "),
        (false, true) => format!("`{original}`"),
        (true, false) => format!("namespaceSelector `{namespace}`"),
        (false, false) => format!("`{original}` in namespaceSelector `{namespace}`"),
    }
}

/// The parts a rule's source or destination selector is made of, in the order Calico's
/// combined selector tests them (`getEndpointSelector`: namespace, then service accounts,
/// then the selector): each as the user wrote it and as evaluated on an endpoint's labels.
fn selector_parts(
    selector: &str,
    namespace: &str,
    service_accounts: Option<&pb::ServiceAccountMatch>,
) -> Vec<(String, String)> {
    use crate::convert::{
        LABEL_NAMESPACE, LABEL_SERVICE_ACCOUNT, NAMESPACE_LABEL_PREFIX,
        SERVICE_ACCOUNT_LABEL_PREFIX, attach_prefix,
    };
    let mut parts = Vec::new();
    if !namespace.is_empty()
        && let Ok(prefixed) = attach_prefix(namespace, NAMESPACE_LABEL_PREFIX)
    {
        let prefixed = prefixed
            .replace("all()", &format!("has({LABEL_NAMESPACE})"))
            .replace("global()", &format!("!has({LABEL_NAMESPACE})"));
        parts.push((format!("namespaceSelector `{namespace}`"), prefixed));
    }
    if let Some(sa) = service_accounts {
        if !sa.selector.is_empty()
            && let Ok(prefixed) = attach_prefix(&sa.selector, SERVICE_ACCOUNT_LABEL_PREFIX)
        {
            parts.push((
                format!("serviceAccounts.selector `{}`", sa.selector),
                prefixed,
            ));
        }
        if !sa.names.is_empty() {
            let quoted: Vec<String> = sa.names.iter().map(|n| format!("'{n}'")).collect();
            parts.push((
                format!("serviceAccounts.names [{}]", sa.names.join(", ")),
                format!("{LABEL_SERVICE_ACCOUNT} in {{ {} }}", quoted.join(", ")),
            ));
        }
    }
    if !selector.is_empty() {
        parts.push((format!("selector `{selector}`"), selector.to_string()));
    }
    parts
}

/// Why `ip` is not in a rule's selector sets: the first part of the selector that fails on
/// the endpoint at `ip`, when the sets can say; else the whole selector as written.
fn not_selected(
    side: &str,
    ip: IpAddr,
    parts: &[(String, String)],
    whole: String,
    sets: &dyn Sets,
) -> Mismatch {
    for (label, text) in parts {
        let Ok(sel) = crate::selector::parse(text) else {
            continue;
        };
        match sets.selects_endpoint(&sel, ip) {
            Some(false) => return format!("{side} {ip} not selected by {label}"),
            Some(true) => {}
            None => break,
        }
    }
    format!("{side} {ip} not selected by {whole}")
}

/// Why a rule does not match the packet.
pub type Mismatch = String;

/// Whether `r` matches `p`; if not, the first reason.
pub fn rule_matches(r: &pb::Rule, p: &Packet, sets: &dyn Sets) -> Result<(), Mismatch> {
    let v6 = p.src.is_ipv6();
    match r.ip_version {
        4 if v6 => return Err("rule is for IPv4 only".into()),
        6 if !v6 => return Err("rule is for IPv6 only".into()),
        _ => {}
    }
    // A CIDR list with none of the packet's family: the rule is not rendered for it.
    for (nets, what) in [
        (&r.src_net, "source nets"),
        (&r.not_src_net, "source notNets"),
        (&r.dst_net, "destination nets"),
        (&r.not_dst_net, "destination notNets"),
    ] {
        if !nets.is_empty() && !nets.iter().any(|n| same_family(n, p.src)) {
            return Err(format!(
                "{what} have no {} CIDR",
                if v6 { "IPv6" } else { "IPv4" }
            ));
        }
    }
    let catch_all = if v6 { "::/0" } else { "0.0.0.0/0" };
    if r.not_src_net
        .iter()
        .chain(&r.not_dst_net)
        .any(|n| n == catch_all)
    {
        return Err(format!("negated nets hold {catch_all}: matches nothing"));
    }

    if let Some((n, name)) = proto_of(&r.protocol)
        && n != p.protocol
    {
        return Err(format!(
            "protocol: rule wants {name}, packet is {}",
            protocol_name(p.protocol)
        ));
    }

    // Source.
    if !r.src_net.is_empty() && !r.src_net.iter().any(|n| cidr_contains(n, p.src)) {
        return Err(format!("source {} not in nets {:?}", p.src, r.src_net));
    }
    if !r.src_ip_set_ids.iter().all(|id| sets.has_ip(id, p.src)) {
        // A source Service is the rule's only source set (no selector beside it).
        if !r.original_src_service.is_empty() {
            return Err(format!(
                "source {} is not an endpoint of service {}/{}",
                p.src, r.original_src_service_namespace, r.original_src_service
            ));
        }
        let parts = selector_parts(
            &r.original_src_selector,
            &r.original_src_namespace_selector,
            r.src_service_account_match.as_ref(),
        );
        let whole = selector_text(
            &r.original_src_selector,
            &r.original_src_namespace_selector,
            &r.src_ip_set_ids,
        );
        return Err(not_selected("source", p.src, &parts, whole, sets));
    }
    if !r.src_ports.is_empty() || !r.src_named_port_ip_set_ids.is_empty() {
        let ok = p.src_port.is_some_and(|port| {
            in_ranges(&r.src_ports, port)
                || r.src_named_port_ip_set_ids
                    .iter()
                    .any(|id| sets.has_ip_port(id, p.src, p.protocol, port))
        });
        if !ok {
            return Err(match p.src_port {
                Some(port) => format!("source port {port} not in the rule's source ports"),
                None => "the rule matches source ports and the query gives none".into(),
            });
        }
    }

    // Destination.
    if !r.dst_net.is_empty() && !r.dst_net.iter().any(|n| cidr_contains(n, p.dst)) {
        return Err(format!("destination {} not in nets {:?}", p.dst, r.dst_net));
    }
    if !r.dst_ip_set_ids.iter().all(|id| sets.has_ip(id, p.dst)) {
        let parts = selector_parts(
            &r.original_dst_selector,
            &r.original_dst_namespace_selector,
            r.dst_service_account_match.as_ref(),
        );
        let whole = selector_text(
            &r.original_dst_selector,
            &r.original_dst_namespace_selector,
            &r.dst_ip_set_ids,
        );
        return Err(not_selected("destination", p.dst, &parts, whole, sets));
    }
    if !r.dst_ip_port_set_ids.is_empty() {
        let ok = p.dst_port.is_some_and(|port| {
            r.dst_ip_port_set_ids
                .iter()
                .all(|id| sets.has_ip_port(id, p.dst, p.protocol, port))
        });
        if !ok {
            return Err(format!(
                "destination is not an endpoint of service {}/{}",
                r.original_dst_service_namespace, r.original_dst_service
            ));
        }
    }
    if !r.dst_ports.is_empty() || !r.dst_named_port_ip_set_ids.is_empty() {
        let ok = p.dst_port.is_some_and(|port| {
            in_ranges(&r.dst_ports, port)
                || r.dst_named_port_ip_set_ids
                    .iter()
                    .any(|id| sets.has_ip_port(id, p.dst, p.protocol, port))
        });
        if !ok {
            let wanted = match (
                r.dst_ports.is_empty(),
                r.dst_named_port_ip_set_ids.is_empty(),
            ) {
                (false, true) => show_ranges(&r.dst_ports),
                (true, _) => "the rule's named ports (on this destination)".to_string(),
                (false, false) => format!(
                    "{} or the rule's named ports (on this destination)",
                    show_ranges(&r.dst_ports)
                ),
            };
            return Err(match p.dst_port {
                Some(port) => format!("destination port {port} not in {wanted}"),
                None => "the rule matches destination ports and the query gives none".into(),
            });
        }
    }
    match &r.icmp {
        Some(rule::Icmp::IcmpType(t)) if p.icmp.is_none_or(|(ty, _)| i32::from(ty) != *t) => {
            return Err(format!("ICMP type: rule wants {t}"));
        }
        Some(rule::Icmp::IcmpTypeCode(tc))
            if p.icmp.is_none_or(|(ty, code)| {
                i32::from(ty) != tc.r#type || i32::from(code) != tc.code
            }) =>
        {
            return Err(format!(
                "ICMP type/code: rule wants {}/{}",
                tc.r#type, tc.code
            ));
        }
        _ => {}
    }

    // Negations.
    if let Some((n, name)) = proto_of(&r.not_protocol)
        && n == p.protocol
    {
        return Err(format!("notProtocol {name}"));
    }
    if r.not_src_net.iter().any(|n| cidr_contains(n, p.src)) {
        return Err(format!(
            "source {} is in notNets {:?}",
            p.src, r.not_src_net
        ));
    }
    if r.not_src_ip_set_ids.iter().any(|id| sets.has_ip(id, p.src)) {
        return Err(format!(
            "source {} selected by notSelector {}",
            p.src,
            selector_text(&r.original_not_src_selector, "", &r.not_src_ip_set_ids)
        ));
    }
    if let Some(port) = p.src_port
        && (in_ranges(&r.not_src_ports, port)
            || r.not_src_named_port_ip_set_ids
                .iter()
                .any(|id| sets.has_ip_port(id, p.src, p.protocol, port)))
    {
        return Err(format!("source port {port} is in the rule's notPorts"));
    }
    if r.not_dst_net.iter().any(|n| cidr_contains(n, p.dst)) {
        return Err(format!(
            "destination {} is in notNets {:?}",
            p.dst, r.not_dst_net
        ));
    }
    if r.not_dst_ip_set_ids.iter().any(|id| sets.has_ip(id, p.dst)) {
        return Err(format!(
            "destination {} selected by notSelector {}",
            p.dst,
            selector_text(&r.original_not_dst_selector, "", &r.not_dst_ip_set_ids)
        ));
    }
    if let Some(port) = p.dst_port
        && (in_ranges(&r.not_dst_ports, port)
            || r.not_dst_named_port_ip_set_ids
                .iter()
                .any(|id| sets.has_ip_port(id, p.dst, p.protocol, port)))
    {
        return Err(format!("destination port {port} is in the rule's notPorts"));
    }
    match &r.not_icmp {
        Some(rule::NotIcmp::NotIcmpType(t))
            if p.icmp.is_some_and(|(ty, _)| i32::from(ty) == *t) =>
        {
            Err(format!("notICMP type {t}"))
        }
        Some(rule::NotIcmp::NotIcmpTypeCode(tc))
            if p.icmp.is_some_and(|(ty, code)| {
                i32::from(ty) == tc.r#type && i32::from(code) == tc.code
            }) =>
        {
            Err(format!("notICMP type/code {}/{}", tc.r#type, tc.code))
        }
        _ => Ok(()),
    }
}

/// A rule's action as a v3 user writes it.
pub fn action_name(action: &str) -> &'static str {
    match action {
        "" | "allow" => "Allow",
        "deny" => "Deny",
        "next-tier" | "pass" => "Pass",
        "log" => "Log",
        // The agent renders an unknown action as a deny: never wider.
        _ => "Deny",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::Selector;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// One endpoint at `ip` with these labels; the rule's one selector set holds it when the
    /// combined selector (as Calico builds it from the parts) selects those labels.
    struct OneEndpoint {
        ip: IpAddr,
        labels: BTreeMap<String, String>,
        combined: Selector,
    }

    impl Sets for OneEndpoint {
        fn has_ip(&self, _id: &str, ip: IpAddr) -> bool {
            ip == self.ip && self.combined.evaluate(&self.labels)
        }
        fn has_ip_port(&self, _: &str, _: IpAddr, _: u8, _: u16) -> bool {
            false
        }
        fn selects_endpoint(&self, selector: &Selector, ip: IpAddr) -> Option<bool> {
            (ip == self.ip).then(|| selector.evaluate(&self.labels))
        }
    }

    fn value() -> impl Strategy<Value = Option<&'static str>> {
        prop_oneof![Just(None), Just(Some("a")), Just(Some("b"))]
    }

    proptest! {
        /// Whatever labels the source has and whichever parts the rule has, a reported
        /// selector miss names a part that fails when evaluated alone, and every part before
        /// it (in Calico's order) passes; a source every part selects is not reported.
        #[test]
        fn each_reported_selector_miss_is_a_part_that_fails_alone(
            ns_label in value(), sa_label in value(), app in value(), sa_name in value(),
            want_ns in value(), want_sa in value(), want_app in value(), want_name in value(),
        ) {
            let ip: IpAddr = "10.0.0.1".parse().unwrap();
            let mut labels = BTreeMap::new();
            for (k, v) in [("pcns.team", ns_label), ("pcsa.role", sa_label), ("app", app),
                           ("projectcalico.org/serviceaccount", sa_name)] {
                if let Some(v) = v {
                    labels.insert(k.to_string(), v.to_string());
                }
            }
            let namespace = want_ns.map(|v| format!("team == '{v}'")).unwrap_or_default();
            let selector = want_app.map(|v| format!("app == '{v}'")).unwrap_or_default();
            let sa = (want_sa.is_some() || want_name.is_some()).then(|| pb::ServiceAccountMatch {
                selector: want_sa.map(|v| format!("role == '{v}'")).unwrap_or_default(),
                names: want_name.map(|n| vec![n.to_string()]).unwrap_or_default(),
            });
            let parts = selector_parts(&selector, &namespace, sa.as_ref());
            let combined = if parts.is_empty() {
                Selector::all()
            } else {
                crate::selector::and(parts.iter().map(|(_, t)| crate::selector::parse(t).unwrap()).collect())
            };
            let sets = OneEndpoint { ip, labels: labels.clone(), combined };
            let rule = pb::Rule {
                action: "allow".into(),
                src_ip_set_ids: vec!["s:combined".into()],
                original_src_selector: selector.clone(),
                original_src_namespace_selector: namespace.clone(),
                src_service_account_match: sa.clone(),
                ..Default::default()
            };
            let packet = Packet {
                src: ip, dst: "10.0.0.2".parse().unwrap(), protocol: 6,
                src_port: None, dst_port: Some(80), icmp: None,
            };
            let alone = |text: &str| crate::selector::parse(text).unwrap().evaluate(&labels);
            match rule_matches(&rule, &packet, &sets) {
                Ok(()) => prop_assert!(parts.iter().all(|(_, t)| alone(t))),
                Err(why) => {
                    let k = parts.iter().position(|(label, _)| why.ends_with(label.as_str()));
                    let k = k.unwrap_or_else(|| panic!("{why:?} names no part of {parts:?}"));
                    prop_assert!(!alone(&parts[k].1), "{why}: that part selects {labels:?}");
                    for (label, t) in &parts[..k] {
                        prop_assert!(alone(t), "{why}: the earlier part {label} fails too");
                    }
                }
            }
        }
    }
}
