//! The one place where rules become `nft -f` input: the same [`Rule`]s the iptables driver
//! writes, in the syntax and names of Felix's nftables mode (`table ip calico`, chains
//! prefixed with their iptables table, sets named like the ipsets with `:` as `-`).
//!
//! `nft` reads identifiers bare (letters, digits, `_ - / . :`, starting with a letter) and
//! strings between double quotes with no escape. Names reaching here are validated upstream;
//! here every identifier is checked once more ([`ident`]) and every string loses the bytes
//! that could end it ([`string`]), so no stream value can add a statement or a rule.

use std::fmt::Write as _;

use crate::driver::linux::rules::{Action, Dir, Frag, IpVersion, MarkTest, Rule};

/// Longest comment nft keeps (`NFT_USERDATA_MAXLEN` is 256; Felix cuts to 128).
pub(crate) const MAX_COMMENT_LEN: usize = 128;

/// nft's family keyword for a table of this IP version.
pub(crate) fn family(v: IpVersion) -> &'static str {
    match v {
        IpVersion::V4 => "ip",
        IpVersion::V6 => "ip6",
    }
}

/// The nft name of an iptables chain of table `table` (`filter-cali-FORWARD`).
pub(crate) fn chain_name(table: &str, chain: &str) -> String {
    ident(&format!("{table}-{chain}"))
}

/// The nft name of a kernel IP set (`cali40s:abc` → `cali40s-abc`), as Felix legalises it.
pub(crate) fn set_name(ipset: &str) -> String {
    ident(&ipset.replace(':', "-"))
}

/// `s` as a bare nft identifier: bytes nft would not read as part of one become `_`, and a
/// name not starting with a letter gets an `x` in front. Our names never need either.
pub(crate) fn ident(s: &str) -> String {
    let mut out: String = s
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'/' | b'.') {
                b as char
            } else {
                '_'
            }
        })
        .collect();
    if !out.starts_with(|c: char| c.is_ascii_alphabetic()) {
        out.insert(0, 'x');
    }
    out
}

/// `s` as an nft double-quoted string: quotes, backslashes and control characters become `_`.
pub(crate) fn string(s: &str) -> String {
    format!("\"{}\"", string_content(s))
}

/// What [`string`] puts between the quotes (also what netlink carries for the same value, so
/// both paths write the same bytes).
pub(crate) fn string_content(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c == '"' || c == '\\' || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// A conntrack word of iptables' `--ctstate` as nftables holds it: a `ct state` bit, or a
/// `ct status` bit for iptables' virtual states SNAT and DNAT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CtWord {
    State(u32),
    Status(u32),
}

pub(crate) fn ct_word(word: &str) -> Option<CtWord> {
    Some(match word.trim().to_ascii_lowercase().as_str() {
        "invalid" => CtWord::State(1),
        "established" => CtWord::State(2),
        "related" => CtWord::State(4),
        "new" => CtWord::State(8),
        "untracked" => CtWord::State(64),
        "snat" => CtWord::Status(0x10),
        "dnat" => CtWord::Status(0x20),
        _ => return None,
    })
}

/// An interface name, iptables' `+` wildcard as nft's `*`.
fn iface(name: &str) -> String {
    match name.strip_suffix('+') {
        Some(prefix) => string(&format!("{prefix}*")),
        None => string(name),
    }
}

/// Protocol numbers for the names policies use: nft would otherwise resolve names through
/// `/etc/protocols`, which minimal images lack.
pub(crate) fn protocol_number(p: &str) -> String {
    let n = match p.to_ascii_lowercase().as_str() {
        "icmp" => "1",
        "tcp" => "6",
        "udp" => "17",
        "icmpv6" | "ipv6-icmp" => "58",
        "sctp" => "132",
        "udplite" => "136",
        _ => return ident_or_number(p),
    };
    n.to_owned()
}

fn ident_or_number(p: &str) -> String {
    if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) {
        p.to_owned()
    } else {
        ident(p)
    }
}

/// `80,443,8000:8080` as nft port items: `80`, `443`, `8000-8080`.
fn port_items(ports: &str) -> Vec<String> {
    ports
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.split(':')
                .map(|n| {
                    n.trim()
                        .parse::<u16>()
                        .map_or_else(|_| "0".into(), |n| n.to_string())
                })
                .collect::<Vec<_>>()
                .join("-")
        })
        .collect()
}

fn not(negated: bool) -> &'static str {
    if negated { "!= " } else { "" }
}

/// The transport keyword ports are matched with: the protocol's own (as Felix writes them)
/// when the rule names tcp, udp or sctp, else the generic transport header.
pub(crate) fn port_keyword(frags: &[Frag]) -> &'static str {
    for f in frags {
        if let Frag::Protocol {
            proto,
            negated: false,
        } = f
        {
            return match proto.to_ascii_lowercase().as_str() {
                "tcp" | "6" => "tcp",
                "udp" | "17" => "udp",
                "sctp" | "132" => "sctp",
                _ => "th",
            };
        }
    }
    "th"
}

/// One match fragment in nft syntax, for a table of family `v`.
fn frag(out: &mut String, f: &Frag, v: IpVersion, ports_kw: &str) {
    let ip = family(v);
    let d = |dir: Dir| match dir {
        Dir::Src => ("saddr", "sport"),
        Dir::Dst => ("daddr", "dport"),
    };
    let _ = match f {
        Frag::InIface(i) => write!(out, "iifname {}", iface(i)),
        Frag::OutIface(i) => write!(out, "oifname {}", iface(i)),
        Frag::Mark(MarkTest::Clear, b) => write!(out, "meta mark & {b:#010x} == 0x00000000"),
        Frag::Mark(MarkTest::Set, b) => write!(out, "meta mark & {b:#010x} == {b:#010x}"),
        Frag::Mark(MarkTest::NotClear, b) => write!(out, "meta mark & {b:#010x} != 0x00000000"),
        Frag::RpfFailed => write!(out, "fib saddr . mark . iif oif 0"),
        Frag::CtState { state, negated } => {
            // iptables' virtual states SNAT and DNAT are conntrack status bits in nft. Both
            // keys are flag words: a negated list is "none of these bits" (`!=` would compare
            // the whole word, which is true for nearly every packet).
            let (status, states): (Vec<String>, Vec<String>) = state
                .split(',')
                .map(|s| ident(&s.trim().to_ascii_lowercase()))
                .partition(|s| s == "snat" || s == "dnat");
            let mut parts = Vec::new();
            for (key, words) in [("state", states), ("status", status)] {
                match words.as_slice() {
                    [] => {}
                    [one] if *negated => parts.push(format!("ct {key} & {one} == 0")),
                    many if *negated => parts.push(format!("ct {key} & ({}) == 0", many.join("|"))),
                    many => parts.push(format!("ct {key} {}", many.join(","))),
                }
            }
            write!(out, "{}", parts.join(" "))
        }
        Frag::Protocol { proto, negated } => {
            write!(
                out,
                "meta l4proto {}{}",
                not(*negated),
                protocol_number(proto)
            )
        }
        Frag::Net { dir, cidr, negated } => {
            let cidr: String = cidr
                .chars()
                .filter(|c| c.is_ascii_hexdigit() || matches!(c, '.' | ':' | '/'))
                .collect();
            write!(out, "{ip} {} {}{cidr}", d(*dir).0, not(*negated))
        }
        Frag::Set {
            dir,
            name,
            ip_port,
            negated,
        } => {
            let (addr, port) = d(*dir);
            if *ip_port {
                write!(
                    out,
                    "{ip} {addr} . meta l4proto . th {port} {}@{}",
                    not(*negated),
                    set_name(name)
                )
            } else {
                write!(out, "{ip} {addr} {}@{}", not(*negated), set_name(name))
            }
        }
        // No anonymous sets: nft 1.0 names and caches each one, which made a 25k-rule
        // ruleset take minutes to load and every later `nft -f` seconds. A negated list is
        // one comparison per item (all must differ); a positive list with several items is
        // split into one rule per item by `rule_bodies`, so here it has one.
        Frag::Ports {
            dir,
            ports,
            negated,
        } => {
            let parts: Vec<String> = port_items(ports)
                .iter()
                .map(|i| format!("{ports_kw} {} {}{i}", d(*dir).1, not(*negated)))
                .collect();
            write!(out, "{}", parts.join(" "))
        }
        Frag::Icmp {
            v: _,
            ty,
            code,
            negated,
        } => {
            let kw = match v {
                IpVersion::V4 => "icmp",
                IpVersion::V6 => "icmpv6",
            };
            match code {
                // Not (type and code): a concatenation is only compared with a set in nft; the
                // one-element set keeps iptables' meaning (a rare rule, so its cost is fine).
                Some(c) if *negated => write!(out, "{kw} type . {kw} code != {{ {ty} . {c} }}"),
                Some(c) => write!(out, "{kw} type {ty} {kw} code {c}"),
                None => write!(out, "{kw} type {}{ty}", not(*negated)),
            }
        }
    };
}

/// The action in nft syntax; chains it names are in the same iptables `table`.
fn action(out: &mut String, a: &Action, table: &str) {
    let _ = match a {
        Action::Accept => write!(out, "counter accept"),
        Action::Drop => write!(out, "counter drop"),
        Action::Return => write!(out, "counter return"),
        Action::Jump(c) => write!(out, "counter jump {}", chain_name(table, c)),
        Action::Goto(c) => write!(out, "counter goto {}", chain_name(table, c)),
        Action::SetMark(m) => write!(out, "counter meta mark set meta mark | {m:#010x}"),
        Action::ClearMark(m) => write!(out, "counter meta mark set meta mark & {:#010x}", !m),
        Action::SetMaskedMark { mark, mask } => write!(
            out,
            "counter meta mark set meta mark & {:#010x} | {:#010x}",
            !mask,
            mark & mask
        ),
        Action::Log { prefix } => write!(
            out,
            "counter log prefix {} level notice",
            string(&format!("{prefix}: "))
        ),
        Action::Nflog { group, prefix } => write!(
            out,
            "counter log prefix {} group {group} snaplen {}",
            string(prefix),
            crate::driver::linux::rules::nflog::SNAPLEN
        ),
        Action::NoTrack => write!(out, "counter notrack"),
        Action::Masquerade { fully_random } => {
            if *fully_random {
                write!(out, "counter masquerade fully-random")
            } else {
                write!(out, "counter masquerade")
            }
        }
    };
}

/// A rule's statement without its comment (what its hash covers), from fragments whose
/// positive port lists have one item each (see [`variants`]).
pub(crate) fn body(frags: &[Frag], a: &Action, table: &str, v: IpVersion) -> String {
    let mut out = String::with_capacity(96);
    let kw = port_keyword(frags);
    for f in frags {
        frag(&mut out, f, v, kw);
        out.push(' ');
    }
    action(&mut out, a, table);
    out
}

/// The nft rules one rule becomes: one, or one per combination of items of its positive port
/// lists (iptables' multiport ORs its items; nft without anonymous sets cannot). The rules
/// match the same packets; a packet matching two overlapping items runs the action twice,
/// which changes nothing for marks and verdicts.
#[cfg(test)]
pub(crate) fn rule_bodies(rule: &Rule, table: &str, v: IpVersion) -> Vec<String> {
    variants(rule)
        .iter()
        .map(|frags| body(frags, &rule.action, table, v))
        .collect()
}

/// The fragments of each nft rule one rule becomes (see [`rule_bodies`]).
pub(crate) fn variants(rule: &Rule) -> Vec<Vec<Frag>> {
    let frags = rule.matches.frags();
    let mut variants: Vec<Vec<Frag>> = vec![Vec::with_capacity(frags.len())];
    for f in frags {
        match f {
            Frag::Ports {
                dir,
                ports,
                negated: false,
            } if ports.contains(',') => {
                let items: Vec<&str> = ports.split(',').filter(|p| !p.is_empty()).collect();
                variants = variants
                    .into_iter()
                    .flat_map(|base| {
                        items.iter().map(move |item| {
                            let mut next = base.clone();
                            next.push(Frag::Ports {
                                dir: *dir,
                                ports: (*item).to_owned(),
                                negated: false,
                            });
                            next
                        })
                    })
                    .collect();
            }
            other => {
                for var in &mut variants {
                    var.push(other.clone());
                }
            }
        }
    }
    variants
}

/// The rule's comment, between its quotes (what netlink writes as the rule's userdata):
/// `cali:<hash>;` and the rule's own comments, cut to [`MAX_COMMENT_LEN`] bytes.
pub(crate) fn comment_text(hash: &str, comments: &[String]) -> String {
    let mut c = format!("cali:{hash};");
    for extra in comments {
        c.push(' ');
        c.push_str(&crate::driver::linux::rules::quote::comment(extra));
    }
    if c.len() > MAX_COMMENT_LEN {
        let mut cut = MAX_COMMENT_LEN;
        while !c.is_char_boundary(cut) {
            cut -= 1;
        }
        c.truncate(cut);
    }
    string_content(&c)
}

/// The hash a rule's comment carries: the comment text before the first `;`, less `cali:`.
pub(crate) fn hash_of_comment(comment: &str) -> Option<&str> {
    comment
        .split(';')
        .next()
        .and_then(|h| h.strip_prefix("cali:"))
}

/// Position-dependent hashes of rule bodies, as the iptables driver's: a SHA-224 chain seeded
/// by the chain name.
pub(crate) fn hashes<'a>(chain: &str, bodies: impl Iterator<Item = &'a str>) -> Vec<String> {
    use base64::Engine as _;
    use sha2::{Digest, Sha224};
    let mut hash = Sha224::digest(chain.as_bytes());
    bodies
        .map(|body| {
            let mut h = Sha224::new();
            h.update(hash);
            h.update(body.as_bytes());
            hash = h.finalize();
            let mut s = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(hash);
            s.truncate(crate::driver::linux::rules::HASH_LEN);
            s
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::linux::rules::{Match, marks};

    fn body(rule: Rule, v: IpVersion) -> String {
        let [one] = rule_bodies(&rule, "filter", v)
            .try_into()
            .expect("one nft rule");
        one
    }

    #[test]
    fn policy_rules_render_as_felix_nft_rules() {
        let r = Rule::new(
            Match::new()
                .protocol("tcp")
                .src_set("cali40s:abc")
                .dst_ports("80,443,8000:8080"),
            Action::SetMark(marks::ACCEPT),
        );
        assert_eq!(
            rule_bodies(&r, "filter", IpVersion::V4),
            ["80", "443", "8000-8080"].map(|p| format!(
                "meta l4proto 6 ip saddr @cali40s-abc tcp dport {p} \
                 counter meta mark set meta mark | 0x00010000"
            ))
        );
        let not_ports = Rule::new(
            Match::new().protocol("udp").not_src_ports("53,1000:2000"),
            Action::Drop,
        );
        assert_eq!(
            body(not_ports, IpVersion::V4),
            "meta l4proto 17 udp sport != 53 udp sport != 1000-2000 counter drop"
        );
        let named = Rule::new(
            Match::new()
                .mark_clear(marks::PASS | marks::ACCEPT)
                .not_dst_ip_port_set("cali60n:port"),
            Action::Goto("cali-pi-x".into()),
        );
        assert_eq!(
            body(named, IpVersion::V6),
            "meta mark & 0x00030000 == 0x00000000 ip6 daddr . meta l4proto . th dport != @cali60n-port \
             counter goto filter-cali-pi-x"
        );
    }

    #[test]
    fn wildcards_marks_and_icmp_keep_iptables_meaning() {
        let r = Rule::new(
            Match::new()
                .in_iface("cali+")
                .not_icmp_type(IpVersion::V4, 8, Some(0)),
            Action::SetMaskedMark {
                mark: 0x100,
                mask: 0xff00,
            },
        );
        assert_eq!(
            body(r, IpVersion::V4),
            "iifname \"cali*\" icmp type . icmp code != { 8 . 0 } \
             counter meta mark set meta mark & 0xffff00ff | 0x00000100"
        );
        let ct = Rule::new(
            Match::new().conntrack_state("RELATED,ESTABLISHED"),
            Action::Accept,
        );
        assert_eq!(
            body(ct, IpVersion::V4),
            "ct state related,established counter accept"
        );
        let dnat = Rule::new(Match::new().not_conntrack_state("DNAT"), Action::Return);
        assert_eq!(
            body(dnat, IpVersion::V4),
            "ct status & dnat == 0 counter return"
        );
    }

    #[test]
    fn hostile_strings_cannot_leave_their_token() {
        let r = Rule::new(
            Match::new().in_iface("x\" accept; add rule ip calico"),
            Action::Log {
                prefix: "p\"\n drop".into(),
            },
        );
        let text = body(r, IpVersion::V4);
        assert_eq!(text.matches('"').count(), 4, "{text}");
        assert!(!text.contains('\n'));
        assert_eq!(ident("a;b c\"d"), "a_b_c_d");
        assert_eq!(ident("9x"), "x9x");
        let c = comment_text(&"h".repeat(16), &["a\"b".repeat(100)]);
        assert!(c.len() <= MAX_COMMENT_LEN && !c.contains('"'));
        assert_eq!(hash_of_comment("cali:abc; extra"), Some("abc"));
    }

    #[test]
    fn names_follow_felix() {
        assert_eq!(chain_name("filter", "cali-FORWARD"), "filter-cali-FORWARD");
        assert_eq!(set_name("cali40s:Ab-_9"), "cali40s-Ab-_9");
        assert_eq!(
            chain_name("filter", "cali-pi-gnp/pol-1"),
            "filter-cali-pi-gnp/pol-1"
        );
    }
}
