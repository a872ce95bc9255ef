//! The agent's check of what the stream asks it to program: the stream is untrusted input.
//!
//! The calc-server validates every object the way Calico does; a compromised or buggy server
//! must still not be able to make this agent write a rule, a set, a route or a sysctl path that
//! the message did not describe. Every value that reaches `iptables-restore`, `ipset restore`,
//! netlink or `/proc/sys` is checked here, per object, before the driver records it. A message
//! that fails is rejected by key with a reason ([`Invalid`]); the driver then fails closed for
//! that object (see `LinuxDriver::on_update`) and applies everything else.
//!
//! Pure functions, no IO.

use calico_names::validate::shown;
use std::net::IpAddr;

use felix_proto::{HostEndpoint, IpamPool, Policy, Profile, Rule, TierInfo, WorkloadEndpoint};

/// Why an object from the stream was refused: the field and what is wrong with it — the same
/// `FieldError` the calc-server's validation reports.
pub(crate) type Invalid = calico_names::FieldError;

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Invalid {
    Invalid::new(field, reason)
}

/// Longest Linux interface name (IFNAMSIZ less the NUL).
pub(crate) const MAX_IFACE_LEN: usize = 15;

/// A Linux interface name as Calico accepts one: 1 to 15 of `[A-Za-z0-9_.-]` (Calico's
/// `interfaceRegex`), so no wildcard, no path separator, nothing to quote.
pub(crate) fn interface_name(field: &str, name: &str) -> Result<(), Invalid> {
    if name.is_empty() || name.len() > MAX_IFACE_LEN {
        return Err(invalid(
            field,
            format!(
                "interface name {} must be 1 to {MAX_IFACE_LEN} characters",
                shown(name)
            ),
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(invalid(
            field,
            format!(
                "interface name {} may only contain letters, digits, '_', '.' and '-'",
                shown(name)
            ),
        ));
    }
    Ok(())
}

/// A workload interface: a valid name that one of the workload prefixes claims, and never the
/// loopback. Felix manages no other interface; neither do we.
pub(crate) fn workload_interface(
    field: &str,
    name: &str,
    prefixes: &[String],
) -> Result<(), Invalid> {
    interface_name(field, name)?;
    if name == "lo" {
        return Err(invalid(
            field,
            "the loopback interface is never a workload interface",
        ));
    }
    if !prefixes
        .iter()
        .any(|p| name.starts_with(p.as_str()) && name.len() > p.len())
    {
        return Err(invalid(
            field,
            format!(
                "interface {} does not match the workload interface prefixes ({})",
                shown(name),
                prefixes.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Names of policies, profiles, namespaces and tiers as they reach chain names and comments:
/// 1 to 253 of `[A-Za-z0-9._:-]` (every Calico and Kubernetes name fits; `/` is our separator).
pub(crate) fn object_name(field: &str, name: &str) -> Result<(), Invalid> {
    if name.is_empty() || name.len() > 253 {
        return Err(invalid(
            field,
            format!("name {} must be 1 to 253 characters", shown(name)),
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
    {
        return Err(invalid(
            field,
            format!(
                "name {} may only contain letters, digits, '.', '_', ':' and '-'",
                shown(name)
            ),
        ));
    }
    Ok(())
}

/// An IP set id: 1 to 64 of `[A-Za-z0-9:_-]` (the calc-server's ids are `s:`/`n:` hashes and a
/// few fixed names). The kernel name is `cali40`/`cali60` + the id, cut to 31.
pub(crate) fn ipset_id(field: &str, id: &str) -> Result<(), Invalid> {
    if id.is_empty()
        || id.len() > 64
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b':' | b'_' | b'-'))
    {
        return Err(invalid(
            field,
            format!("IP set id {} must be 1 to 64 of [A-Za-z0-9:_-]", shown(id)),
        ));
    }
    Ok(())
}

/// Why an address, CIDR or IP set member is refused (the value as given, shown safely).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AddrError {
    #[error("{} is not an IP address", shown(.0))]
    Addr(String),
    #[error("{} is not an IP address or CIDR", shown(.0))]
    Cidr(String),
    #[error("prefix length in {} must be 0 to {max}", shown(.cidr))]
    PrefixLength { cidr: String, max: u8 },
    #[error("{} is an IPv4-mapped range shorter than /96", shown(.0))]
    MappedRange(String),
    #[error("{} is a network, not an address", shown(.0))]
    NotAnAddress(String),
    #[error("{} is not <ip>,<protocol>:<port>", shown(.0))]
    NotIpPort(String),
    #[error("protocol {} in {} must be tcp, udp or sctp", shown(.protocol), shown(.member))]
    Protocol { protocol: String, member: String },
    #[error("port in {} must be 0 to 65535", shown(.0))]
    Port(String),
}

/// The kinds of IP set member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MemberKind {
    Ip,
    Net,
    IpPort,
}

/// One IP set member, normalised as the kernel will hold it, or why it is refused. A CIDR's
/// host bits are cleared and an IPv4-mapped IPv6 address is taken as IPv4 (Calico's
/// normalisation); `/0`, which a `hash:net` set cannot hold, becomes its two halves.
pub(crate) fn ipset_members(kind: MemberKind, member: &str) -> Result<Vec<String>, AddrError> {
    let m = member.trim();
    match kind {
        MemberKind::Ip => {
            // A host route is accepted for an address, as the stream sometimes writes one.
            let (addr, len) = parse_cidr(m)?;
            let full = if addr.is_ipv4() { 32 } else { 128 };
            if len != full {
                return Err(AddrError::NotAnAddress(m.to_owned()));
            }
            Ok(vec![addr.to_string()])
        }
        MemberKind::Net => {
            let (addr, len) = parse_cidr(m)?;
            Ok(net_members(addr, len))
        }
        MemberKind::IpPort => {
            let mut parts = m.splitn(2, ',');
            let addr = parse_addr(parts.next().unwrap_or_default())?;
            let not_ip_port = || AddrError::NotIpPort(m.to_owned());
            let rest = parts.next().ok_or_else(not_ip_port)?;
            let (proto, port) = rest.split_once(':').ok_or_else(not_ip_port)?;
            let proto = proto.to_ascii_lowercase();
            if !matches!(proto.as_str(), "tcp" | "udp" | "sctp") {
                return Err(AddrError::Protocol {
                    protocol: proto,
                    member: m.to_owned(),
                });
            }
            let port: u16 = port.parse().map_err(|_| AddrError::Port(m.to_owned()))?;
            Ok(vec![format!("{addr},{proto}:{port}")])
        }
    }
}

fn parse_addr(s: &str) -> Result<IpAddr, AddrError> {
    let a: IpAddr = s.parse().map_err(|_| AddrError::Addr(s.to_owned()))?;
    Ok(unmap(a))
}

/// An IPv4-mapped IPv6 address as the IPv4 address it carries.
fn unmap(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a, IpAddr::V4),
        v4 => v4,
    }
}

/// A CIDR (or a bare address, taken as a host route), checked and with host bits cleared.
pub(crate) fn parse_cidr(s: &str) -> Result<(IpAddr, u8), AddrError> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let raw: IpAddr = addr.parse().map_err(|_| AddrError::Cidr(s.to_owned()))?;
    let mapped = matches!(raw, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some());
    let max = if raw.is_ipv4() { 32 } else { 128 };
    let len =
        match len {
            None => max,
            Some(l) => l.parse::<u8>().ok().filter(|l| *l <= max).ok_or_else(|| {
                AddrError::PrefixLength {
                    cidr: s.to_owned(),
                    max,
                }
            })?,
        };
    let (addr, len) = if mapped {
        if len < 96 {
            return Err(AddrError::MappedRange(s.to_owned()));
        }
        (unmap(raw), len - 96)
    } else {
        (raw, len)
    };
    Ok((mask(addr, len), len))
}

fn mask(addr: IpAddr, len: u8) -> IpAddr {
    ipnetwork::IpNetwork::new(addr, len).map_or(addr, |n| n.network())
}

/// The `hash:net` members for a network: itself, or both halves of a `/0`.
fn net_members(addr: IpAddr, len: u8) -> Vec<String> {
    if len != 0 {
        return vec![format!("{addr}/{len}")];
    }
    if addr.is_ipv4() {
        vec!["0.0.0.0/1".into(), "128.0.0.0/1".into()]
    } else {
        vec!["::/1".into(), "8000::/1".into()]
    }
}

/// A CIDR in a rule, normalised (host bits cleared, mapped addresses unmapped).
pub(crate) fn rule_cidr(field: &str, s: &str) -> Result<String, Invalid> {
    let (addr, len) = parse_cidr(s.trim()).map_err(|r| invalid(field, r.to_string()))?;
    Ok(format!("{addr}/{len}"))
}

const PROTOCOL_NAMES: [&str; 6] = ["tcp", "udp", "icmp", "icmpv6", "sctp", "udplite"];

fn protocol(field: &str, p: &felix_proto::Protocol) -> Result<(), Invalid> {
    use felix_proto::protocol::NumberOrName;
    match &p.number_or_name {
        None => Ok(()),
        Some(NumberOrName::Number(n)) if (1..=255).contains(n) => Ok(()),
        Some(NumberOrName::Number(n)) => Err(invalid(
            field,
            format!("protocol number {n} must be 1 to 255"),
        )),
        Some(NumberOrName::Name(n))
            if PROTOCOL_NAMES.contains(&n.to_ascii_lowercase().as_str()) =>
        {
            Ok(())
        }
        Some(NumberOrName::Name(n)) => Err(invalid(
            field,
            format!(
                "protocol {} must be one of {}",
                shown(n),
                PROTOCOL_NAMES.join(", ")
            ),
        )),
    }
}

fn ports(field: &str, ranges: &[felix_proto::PortRange]) -> Result<(), Invalid> {
    for r in ranges {
        let ok =
            (0..=65535).contains(&r.first) && (0..=65535).contains(&r.last) && r.first <= r.last;
        if !ok {
            return Err(invalid(
                field,
                format!(
                    "port range {}:{} must be 0 to 65535, first not after last",
                    r.first, r.last
                ),
            ));
        }
    }
    Ok(())
}

fn icmp(field: &str, ty: i32, code: Option<i32>) -> Result<(), Invalid> {
    if !(0..=255).contains(&ty) {
        return Err(invalid(field, format!("ICMP type {ty} must be 0 to 255")));
    }
    if let Some(c) = code.filter(|c| !(0..=255).contains(c)) {
        return Err(invalid(field, format!("ICMP code {c} must be 0 to 255")));
    }
    Ok(())
}

const ACTIONS: [&str; 6] = ["", "allow", "deny", "pass", "next-tier", "log"];

/// One rule: everything the renderer writes into a restore line.
pub(crate) fn rule(field: &str, r: &Rule) -> Result<(), Invalid> {
    let f = |name: &str| format!("{field}.{name}");
    if !ACTIONS.contains(&r.action.as_str()) {
        return Err(invalid(
            f("action"),
            format!(
                "action {} must be one of allow, deny, pass, next-tier, log",
                shown(&r.action)
            ),
        ));
    }
    if let Some(p) = &r.protocol {
        protocol(&f("protocol"), p)?;
    }
    if let Some(p) = &r.not_protocol {
        protocol(&f("not_protocol"), p)?;
    }
    for (name, nets) in [
        ("src_net", &r.src_net),
        ("dst_net", &r.dst_net),
        ("not_src_net", &r.not_src_net),
        ("not_dst_net", &r.not_dst_net),
    ] {
        for n in nets {
            rule_cidr(&f(name), n)?;
        }
    }
    for (name, p) in [
        ("src_ports", &r.src_ports),
        ("dst_ports", &r.dst_ports),
        ("not_src_ports", &r.not_src_ports),
        ("not_dst_ports", &r.not_dst_ports),
    ] {
        ports(&f(name), p)?;
    }
    use felix_proto::rule::{Icmp, NotIcmp};
    match &r.icmp {
        Some(Icmp::IcmpType(t)) => icmp(&f("icmp_type"), *t, None)?,
        Some(Icmp::IcmpTypeCode(tc)) => icmp(&f("icmp_type_code"), tc.r#type, Some(tc.code))?,
        None => {}
    }
    match &r.not_icmp {
        Some(NotIcmp::NotIcmpType(t)) => icmp(&f("not_icmp_type"), *t, None)?,
        Some(NotIcmp::NotIcmpTypeCode(tc)) => {
            icmp(&f("not_icmp_type_code"), tc.r#type, Some(tc.code))?
        }
        None => {}
    }
    for (name, ids) in rule_set_ids(r) {
        for id in ids {
            ipset_id(&f(name), id)?;
        }
    }
    Ok(())
}

/// Every IP set id a rule names, by field.
pub(crate) fn rule_set_ids(r: &Rule) -> [(&'static str, &Vec<String>); 9] {
    [
        ("src_ip_set_ids", &r.src_ip_set_ids),
        ("dst_ip_set_ids", &r.dst_ip_set_ids),
        ("src_named_port_ip_set_ids", &r.src_named_port_ip_set_ids),
        ("dst_named_port_ip_set_ids", &r.dst_named_port_ip_set_ids),
        ("dst_ip_port_set_ids", &r.dst_ip_port_set_ids),
        ("not_src_ip_set_ids", &r.not_src_ip_set_ids),
        ("not_dst_ip_set_ids", &r.not_dst_ip_set_ids),
        (
            "not_src_named_port_ip_set_ids",
            &r.not_src_named_port_ip_set_ids,
        ),
        (
            "not_dst_named_port_ip_set_ids",
            &r.not_dst_named_port_ip_set_ids,
        ),
    ]
}

fn rules(field: &str, inbound: &[Rule], outbound: &[Rule]) -> Result<(), Invalid> {
    for (dir, list) in [("inbound_rules", inbound), ("outbound_rules", outbound)] {
        for (i, r) in list.iter().enumerate() {
            rule(&format!("{field}{dir}[{i}]"), r)?;
        }
    }
    Ok(())
}

/// A policy's id and rules.
pub(crate) fn policy(id: &felix_proto::PolicyId, p: &Policy) -> Result<(), Invalid> {
    object_name("id.name", &id.name)?;
    if !id.namespace.is_empty() {
        object_name("id.namespace", &id.namespace)?;
    }
    if !id.kind.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(invalid(
            "id.kind",
            format!("kind {} must be letters only", shown(&id.kind)),
        ));
    }
    if !p.tier.is_empty() {
        object_name("tier", &p.tier)?;
    }
    rules("", &p.inbound_rules, &p.outbound_rules)
}

/// A profile's name and rules.
pub(crate) fn profile(name: &str, p: &Profile) -> Result<(), Invalid> {
    object_name("id.name", name)?;
    rules("", &p.inbound_rules, &p.outbound_rules)
}

fn tiers(field: &str, tiers: &[TierInfo]) -> Result<(), Invalid> {
    for (i, t) in tiers.iter().enumerate() {
        let f = format!("{field}[{i}]");
        object_name(&format!("{f}.name"), &t.name)?;
        for id in t.ingress_policies.iter().chain(&t.egress_policies) {
            object_name(&format!("{f}.policies"), &id.name)?;
            if !id.namespace.is_empty() {
                object_name(&format!("{f}.policies"), &id.namespace)?;
            }
        }
    }
    Ok(())
}

/// A workload endpoint: its interface (see [`workload_interface`]), MAC, addresses, profiles
/// and tiers.
pub(crate) fn workload_endpoint(ep: &WorkloadEndpoint, prefixes: &[String]) -> Result<(), Invalid> {
    workload_interface("name", &ep.name, prefixes)?;
    if !ep.mac.is_empty() && parse_mac(&ep.mac).is_none() {
        return Err(invalid(
            "mac",
            format!("{} is not a MAC address", shown(&ep.mac)),
        ));
    }
    for (field, nets) in [("ipv4_nets", &ep.ipv4_nets), ("ipv6_nets", &ep.ipv6_nets)] {
        for n in nets {
            parse_cidr(n).map_err(|r| invalid(field, r.to_string()))?;
        }
    }
    for p in &ep.profile_ids {
        object_name("profile_ids", p)?;
    }
    tiers("tiers", &ep.tiers)
}

/// A host endpoint: `*` or a valid interface name (never a wildcard of ours), addresses, tiers.
pub(crate) fn host_endpoint(id: &str, ep: &HostEndpoint) -> Result<(), Invalid> {
    object_name("id", id)?;
    if !ep.name.is_empty() && ep.name != "*" {
        interface_name("name", &ep.name)?;
    }
    for a in ep.expected_ipv4_addrs.iter().chain(&ep.expected_ipv6_addrs) {
        parse_addr(a).map_err(|r| invalid("expected_addrs", r.to_string()))?;
    }
    for p in &ep.profile_ids {
        object_name("profile_ids", p)?;
    }
    for (field, t) in [
        ("tiers", &ep.tiers),
        ("untracked_tiers", &ep.untracked_tiers),
        ("pre_dnat_tiers", &ep.pre_dnat_tiers),
        ("forward_tiers", &ep.forward_tiers),
    ] {
        tiers(field, t)?;
    }
    Ok(())
}

/// An IPAM pool: a CIDR.
pub(crate) fn ipam_pool(id: &str, pool: &IpamPool) -> Result<(), Invalid> {
    ipset_id("id", id).or_else(|_| object_name("id", id))?;
    parse_cidr(&pool.cidr).map_err(|r| invalid("cidr", r.to_string()))?;
    Ok(())
}

/// `aa:bb:cc:dd:ee:ff`.
pub(crate) fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return None;
    }
    let mut mac = [0u8; 6];
    for (b, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    Some(mac)
}

/// The FelixConfiguration rules the calc-server applies too (one definition for both ends).
pub(crate) use calico_names::validate::{interface_prefix, log_prefix};

#[cfg(test)]
mod tests {
    use super::*;

    fn prefixes() -> Vec<String> {
        vec!["cali".into(), "tap".into()]
    }

    #[test]
    fn workload_interfaces_must_be_ours() {
        assert!(workload_interface("name", "cali12345", &prefixes()).is_ok());
        assert!(workload_interface("name", "tap0", &prefixes()).is_ok());
        for bad in [
            "eth0",
            "lo",
            "cali",
            "cali+",
            "cali 1",
            "cali\n-A",
            "cali../x",
            "cali0123456789ab",
            "",
        ] {
            let e = workload_interface("name", bad, &prefixes()).unwrap_err();
            assert_eq!(e.field, "name", "{bad:?}");
        }
    }

    #[test]
    fn members_are_normalised_and_zero_prefixes_split() {
        assert_eq!(
            ipset_members(MemberKind::Net, "0.0.0.0/0").unwrap(),
            ["0.0.0.0/1", "128.0.0.0/1"]
        );
        assert_eq!(
            ipset_members(MemberKind::Net, "::/0").unwrap(),
            ["::/1", "8000::/1"]
        );
        assert_eq!(
            ipset_members(MemberKind::Net, "10.1.2.3/8").unwrap(),
            ["10.0.0.0/8"]
        );
        assert_eq!(
            ipset_members(MemberKind::Net, "::ffff:10.0.0.0/104").unwrap(),
            ["10.0.0.0/8"]
        );
        assert_eq!(
            ipset_members(MemberKind::Ip, "::ffff:1.2.3.4").unwrap(),
            ["1.2.3.4"]
        );
        assert_eq!(
            ipset_members(MemberKind::IpPort, "10.0.0.1,TCP:80").unwrap(),
            ["10.0.0.1,tcp:80"]
        );
        for bad in [
            "1.2.3.4/40",
            "1.2.3.4/",
            "x",
            "1.2.3.4/8\ndestroy",
            "fd00::/129",
        ] {
            assert!(ipset_members(MemberKind::Net, bad).is_err(), "{bad:?}");
        }
        for bad in [
            "1.2.3.4,tcp\ndestroy x:80",
            "1.2.3.4,icmp:8",
            "1.2.3.4,tcp:65536",
            "1.2.3.4",
        ] {
            assert!(ipset_members(MemberKind::IpPort, bad).is_err(), "{bad:?}");
        }
    }

    /// The refusal an operator reads names the value, shown safely, and what is wrong.
    #[test]
    fn member_refusals_name_the_value_and_the_reason() {
        let said = |kind, m: &str| ipset_members(kind, m).unwrap_err().to_string();
        assert_eq!(
            said(MemberKind::Ip, "10.0.0.0/8"),
            "\"10.0.0.0/8\" is a network, not an address"
        );
        assert_eq!(
            said(MemberKind::Net, "10.0.0.0/33"),
            "prefix length in \"10.0.0.0/33\" must be 0 to 32"
        );
        assert_eq!(
            said(MemberKind::IpPort, "1.2.3.4,icmp:8"),
            "protocol \"icmp\" in \"1.2.3.4,icmp:8\" must be tcp, udp or sctp"
        );
        let hostile = said(MemberKind::Net, "1.2.3.4\ndestroy");
        assert!(!hostile.contains('\n'), "{hostile}");
        assert!(
            hostile.ends_with("is not an IP address or CIDR"),
            "{hostile}"
        );
    }

    #[test]
    fn rules_with_out_of_range_values_are_refused() {
        let ok = Rule {
            action: "allow".into(),
            ..Rule::default()
        };
        assert!(rule("r", &ok).is_ok());
        let cases: Vec<(Rule, &str)> = vec![
            (
                Rule {
                    dst_ports: vec![felix_proto::PortRange {
                        first: 1,
                        last: 65536,
                    }],
                    ..ok.clone()
                },
                "r.dst_ports",
            ),
            (
                Rule {
                    src_ports: vec![felix_proto::PortRange {
                        first: 90,
                        last: 80,
                    }],
                    ..ok.clone()
                },
                "r.src_ports",
            ),
            (
                Rule {
                    icmp: Some(felix_proto::rule::Icmp::IcmpType(256)),
                    ..ok.clone()
                },
                "r.icmp_type",
            ),
            (
                Rule {
                    protocol: Some(felix_proto::Protocol {
                        number_or_name: Some(felix_proto::protocol::NumberOrName::Number(256)),
                    }),
                    ..ok.clone()
                },
                "r.protocol",
            ),
            (
                Rule {
                    protocol: Some(felix_proto::Protocol {
                        number_or_name: Some(felix_proto::protocol::NumberOrName::Name(
                            "tcp -j ACCEPT".into(),
                        )),
                    }),
                    ..ok.clone()
                },
                "r.protocol",
            ),
            (
                Rule {
                    src_net: vec!["10.0.0.0/40".into()],
                    ..ok.clone()
                },
                "r.src_net",
            ),
            (
                Rule {
                    dst_ip_set_ids: vec!["s:a b".into()],
                    ..ok.clone()
                },
                "r.dst_ip_set_ids",
            ),
            (
                Rule {
                    action: "allow\n-A INPUT".into(),
                    ..ok.clone()
                },
                "r.action",
            ),
        ];
        for (r, field) in cases {
            assert_eq!(rule("r", &r).unwrap_err().field, field, "{r:?}");
        }
    }

    #[test]
    fn prefixes_never_claim_the_loopback() {
        assert!(interface_prefix("cali").is_ok());
        for bad in ["l", "lo", "", "cali+", "a b", "abcdefghijklmno"] {
            assert!(interface_prefix(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn log_prefixes_follow_calico() {
        assert!(log_prefix("calico-packet").is_ok());
        assert!(log_prefix("drop %t: x/y").is_ok());
        for bad in ["a\"b", "a\nb", "a\\", &"x".repeat(28)] {
            assert!(log_prefix(bad).is_err(), "{bad:?}");
        }
    }
}
