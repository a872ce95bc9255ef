//! Rules as nftables expressions, for writing them over nfnetlink without `nft`.
//!
//! [`rule`] turns one nft rule (the fragments [`render::variants`] gives, and an action) into the
//! `NFTA_RULE_EXPRESSIONS` list, choosing the expressions `nft` itself generates for the text
//! [`render`] writes (the same registers, loads and comparisons), so `nft list` shows both the
//! same. What it cannot encode faithfully it refuses ([`Unsupported`]) and the writer falls back
//! to `nft -f` for that transaction. No string is interpreted here: names are copied as bytes
//! after the same cleaning the text renderer applies.

use std::net::IpAddr;

use super::netlink::{NFT_GOTO, NFT_JUMP, NFTA_DATA_VALUE, NFTA_LIST_ELEM, attr, cstr, nested};
use super::render;
use crate::driver::linux::rules::{Action, Dir, Frag, IpVersion, MarkTest};

/// A fragment or action this encoder does not write; the text path (`nft -f`) does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no nfnetlink encoding for {0}")]
pub(crate) struct Unsupported(pub &'static str);

const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;

const REG_VERDICT: u32 = 0;
const REG_1: u32 = 1;

const META_MARK: u32 = 3;
const META_IIFNAME: u32 = 6;
const META_OIFNAME: u32 = 7;
const META_L4PROTO: u32 = 16;

const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;
const CMP_LTE: u32 = 3;
const CMP_GTE: u32 = 5;
const RANGE_NEQ: u32 = 1;

const BASE_NETWORK: u32 = 1;
const BASE_TRANSPORT: u32 = 2;

const CT_STATE: u32 = 0;
const CT_STATUS: u32 = 2;

const FIB_SADDR: u32 = 1;
const FIB_MARK: u32 = 4;
const FIB_IIF: u32 = 8;
const FIB_RESULT_OIF: u32 = 1;

const LOOKUP_INV: u32 = 1;
const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;
const LOG_LEVEL_NOTICE: u32 = 5;

const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_RETURN: i32 = -5;

/// `NFTNL_UDATA_RULE_COMMENT`: the rule userdata TLV `nft` keeps a comment in.
const UDATA_RULE_COMMENT: u8 = 0;

/// The expressions of one rule: `frags` (positive port lists of one item each, see
/// [`render::variants`]) then `action`, in a table of family `v` whose chains it names are in
/// the iptables table `table`.
pub(crate) fn rule(
    frags: &[Frag],
    action: &Action,
    table: &str,
    v: IpVersion,
) -> Result<Vec<u8>, Unsupported> {
    let mut e = Exprs(Vec::with_capacity(256));
    // Which transport protocol earlier fragments pinned (nft adds a dependency otherwise).
    let mut l4: Option<u8> = None;
    for f in frags {
        e.frag(f, v, frags, &mut l4)?;
    }
    e.action(action, table)?;
    Ok(e.0)
}

/// The rule userdata holding `comment` (unquoted; [`render::comment_text`]).
pub(crate) fn userdata(comment: &str) -> Vec<u8> {
    let bytes = comment.as_bytes();
    // The kernel keeps at most 256 bytes of userdata: type, length, text, NUL.
    let len = bytes.len().min(253);
    let mut out = Vec::with_capacity(len + 3);
    out.push(UDATA_RULE_COMMENT);
    out.push(u8::try_from(len + 1).expect("bounded above"));
    out.extend_from_slice(&bytes[..len]);
    out.push(0);
    out
}

struct Exprs(Vec<u8>);

impl Exprs {
    fn expr(&mut self, name: &str, body: impl FnOnce(&mut Vec<u8>)) {
        let _ = nested(&mut self.0, NFTA_LIST_ELEM, |out| {
            attr(out, NFTA_EXPR_NAME, &cstr(name));
            let _ = nested(out, NFTA_EXPR_DATA, body);
        });
    }

    fn meta_load(&mut self, key: u32, dreg: u32) {
        self.expr("meta", |o| {
            attr(o, 2, &key.to_be_bytes());
            attr(o, 1, &dreg.to_be_bytes());
        });
    }

    fn meta_set(&mut self, key: u32, sreg: u32) {
        self.expr("meta", |o| {
            attr(o, 2, &key.to_be_bytes());
            attr(o, 3, &sreg.to_be_bytes());
        });
    }

    fn cmp(&mut self, op: u32, data: &[u8]) {
        self.expr("cmp", |o| {
            attr(o, 1, &REG_1.to_be_bytes());
            attr(o, 2, &op.to_be_bytes());
            let _ = nested(o, 3, |o| attr(o, NFTA_DATA_VALUE, data));
        });
    }

    fn payload(&mut self, base: u32, offset: u32, len: u32, dreg: u32) {
        self.expr("payload", |o| {
            attr(o, 1, &dreg.to_be_bytes());
            attr(o, 2, &base.to_be_bytes());
            attr(o, 3, &offset.to_be_bytes());
            attr(o, 4, &len.to_be_bytes());
        });
    }

    /// `reg1 = (reg1 & mask) ^ xor`, over `mask.len()` bytes.
    fn bitwise(&mut self, mask: &[u8], xor: &[u8]) {
        self.expr("bitwise", |o| {
            attr(o, 1, &REG_1.to_be_bytes());
            attr(o, 2, &REG_1.to_be_bytes());
            attr(
                o,
                3,
                &u32::try_from(mask.len()).expect("small").to_be_bytes(),
            );
            let _ = nested(o, 4, |o| attr(o, NFTA_DATA_VALUE, mask));
            let _ = nested(o, 5, |o| attr(o, NFTA_DATA_VALUE, xor));
        });
    }

    fn lookup(&mut self, set: &str, negated: bool) {
        self.expr("lookup", |o| {
            attr(o, 1, &cstr(set));
            attr(o, 2, &REG_1.to_be_bytes());
            if negated {
                attr(o, 5, &LOOKUP_INV.to_be_bytes());
            }
        });
    }

    fn ct_load(&mut self, key: u32) {
        self.expr("ct", |o| {
            attr(o, 1, &REG_1.to_be_bytes());
            attr(o, 2, &key.to_be_bytes());
        });
    }

    fn verdict(&mut self, code: i32, chain: Option<&str>) {
        self.expr("immediate", |o| {
            attr(o, 1, &REG_VERDICT.to_be_bytes());
            let _ = nested(o, 2, |o| super::netlink::verdict(o, code, chain));
        });
    }

    /// `meta l4proto <n>` unless an earlier fragment already pinned the protocol, as nft adds
    /// a protocol dependency before a transport header match.
    fn depend_l4(&mut self, proto: u8, l4: &mut Option<u8>) -> Result<(), Unsupported> {
        match *l4 {
            Some(p) if p == proto => Ok(()),
            Some(_) => Err(Unsupported("a transport match of another protocol")),
            None => {
                self.meta_load(META_L4PROTO, REG_1);
                self.cmp(CMP_EQ, &[proto]);
                *l4 = Some(proto);
                Ok(())
            }
        }
    }

    fn frag(
        &mut self,
        f: &Frag,
        v: IpVersion,
        all: &[Frag],
        l4: &mut Option<u8>,
    ) -> Result<(), Unsupported> {
        match f {
            Frag::InIface(i) => self.iface(META_IIFNAME, i)?,
            Frag::OutIface(i) => self.iface(META_OIFNAME, i)?,
            Frag::Mark(test, bits) => {
                self.meta_load(META_MARK, REG_1);
                self.bitwise(&bits.to_ne_bytes(), &[0; 4]);
                let (op, want) = match test {
                    MarkTest::Clear => (CMP_EQ, 0),
                    MarkTest::Set => (CMP_EQ, *bits),
                    MarkTest::NotClear => (CMP_NEQ, 0),
                };
                self.cmp(op, &want.to_ne_bytes());
            }
            Frag::RpfFailed => {
                self.expr("fib", |o| {
                    attr(o, 1, &REG_1.to_be_bytes());
                    attr(o, 2, &FIB_RESULT_OIF.to_be_bytes());
                    attr(o, 3, &(FIB_SADDR | FIB_MARK | FIB_IIF).to_be_bytes());
                });
                self.cmp(CMP_EQ, &0u32.to_ne_bytes());
            }
            Frag::CtState { state, negated } => {
                let (mut states, mut status) = (0u32, 0u32);
                for s in state.split(',') {
                    match render::ct_word(s) {
                        Some(render::CtWord::State(bit)) => states |= bit,
                        Some(render::CtWord::Status(bit)) => status |= bit,
                        None => return Err(Unsupported("an unknown conntrack state")),
                    }
                }
                // Any of the states (a flag test); negated, none of them.
                let op = if *negated { CMP_EQ } else { CMP_NEQ };
                for (key, bits) in [(CT_STATE, states), (CT_STATUS, status)] {
                    if bits != 0 {
                        self.ct_load(key);
                        self.bitwise(&bits.to_ne_bytes(), &[0; 4]);
                        self.cmp(op, &[0; 4]);
                    }
                }
            }
            Frag::Protocol { proto, negated } => {
                let n: u8 = render::protocol_number(proto)
                    .parse()
                    .map_err(|_| Unsupported("a protocol without a number"))?;
                self.meta_load(META_L4PROTO, REG_1);
                self.cmp(if *negated { CMP_NEQ } else { CMP_EQ }, &[n]);
                if !*negated {
                    *l4 = Some(n);
                }
            }
            Frag::Net { dir, cidr, negated } => self.net(v, *dir, cidr, *negated)?,
            Frag::Set {
                dir,
                name,
                ip_port,
                negated,
            } => {
                self.payload(BASE_NETWORK, addr_offset(v, *dir), addr_len(v), REG_1);
                if *ip_port {
                    // Each concatenated field in its own 32-bit register after the address.
                    let (proto_reg, port_reg) = match v {
                        IpVersion::V4 => (9, 10),
                        IpVersion::V6 => (2, 13),
                    };
                    self.meta_load(META_L4PROTO, proto_reg);
                    self.payload(BASE_TRANSPORT, port_offset(*dir), 2, port_reg);
                }
                self.lookup(&render::set_name(name), *negated);
            }
            Frag::Ports {
                dir,
                ports,
                negated,
            } => {
                let proto = match render::port_keyword(all) {
                    "tcp" => Some(6),
                    "udp" => Some(17),
                    "sctp" => Some(132),
                    _ => None,
                };
                for item in ports.split(',').filter(|p| !p.is_empty()) {
                    let (lo, hi) = port_range(item)?;
                    if let Some(p) = proto {
                        self.depend_l4(p, l4)?;
                    }
                    self.payload(BASE_TRANSPORT, port_offset(*dir), 2, REG_1);
                    match (lo == hi, *negated) {
                        (true, neg) => {
                            self.cmp(if neg { CMP_NEQ } else { CMP_EQ }, &lo.to_be_bytes())
                        }
                        (false, false) => {
                            self.cmp(CMP_GTE, &lo.to_be_bytes());
                            self.cmp(CMP_LTE, &hi.to_be_bytes());
                        }
                        (false, true) => self.expr("range", |o| {
                            attr(o, 1, &REG_1.to_be_bytes());
                            attr(o, 2, &RANGE_NEQ.to_be_bytes());
                            let _ = nested(o, 3, |o| attr(o, NFTA_DATA_VALUE, &lo.to_be_bytes()));
                            let _ = nested(o, 4, |o| attr(o, NFTA_DATA_VALUE, &hi.to_be_bytes()));
                        }),
                    }
                }
            }
            Frag::Icmp {
                ty, code, negated, ..
            } => {
                let proto = match v {
                    IpVersion::V4 => 1,
                    IpVersion::V6 => 58,
                };
                let byte = |n: i32| u8::try_from(n).map_err(|_| Unsupported("an icmp value"));
                let ty = byte(*ty)?;
                self.depend_l4(proto, l4)?;
                match code {
                    None => {
                        self.payload(BASE_TRANSPORT, 0, 1, REG_1);
                        self.cmp(if *negated { CMP_NEQ } else { CMP_EQ }, &[ty]);
                    }
                    // Type and code are adjacent: one two-byte comparison, as nft merges them.
                    Some(c) if !*negated => {
                        self.payload(BASE_TRANSPORT, 0, 2, REG_1);
                        self.cmp(CMP_EQ, &[ty, byte(*c)?]);
                    }
                    // nft lists a negated two-byte comparison as two negated ones (which means
                    // something else); the text path writes it as a set lookup instead.
                    Some(_) => return Err(Unsupported("a negated icmp type and code")),
                }
            }
        }
        Ok(())
    }

    fn iface(&mut self, key: u32, name: &str) -> Result<(), Unsupported> {
        let clean = render::string_content(name);
        let (bytes, wildcard) = match clean.strip_suffix('+') {
            Some(prefix) => (prefix.as_bytes().to_vec(), true),
            None => (clean.as_bytes().to_vec(), false),
        };
        if bytes.len() >= 16 || (wildcard && bytes.is_empty()) {
            return Err(Unsupported("an interface name"));
        }
        self.meta_load(key, REG_1);
        let mut data = bytes;
        if !wildcard {
            data.resize(16, 0);
        }
        self.cmp(CMP_EQ, &data);
        Ok(())
    }

    fn net(
        &mut self,
        v: IpVersion,
        dir: Dir,
        cidr: &str,
        negated: bool,
    ) -> Result<(), Unsupported> {
        let bad = Unsupported("a network");
        let (addr, len) = match cidr.split_once('/') {
            Some((a, l)) => (a, Some(l.parse::<u32>().map_err(|_| bad)?)),
            None => (cidr, None),
        };
        let octets = match (addr.parse::<IpAddr>().map_err(|_| bad)?, v) {
            (IpAddr::V4(a), IpVersion::V4) => a.octets().to_vec(),
            (IpAddr::V6(a), IpVersion::V6) => a.octets().to_vec(),
            _ => return Err(bad),
        };
        let width = u32::try_from(octets.len() * 8).expect("small");
        let len = len.unwrap_or(width);
        if len > width {
            return Err(bad);
        }
        let op = if negated { CMP_NEQ } else { CMP_EQ };
        let off = addr_offset(v, dir);
        if len % 8 == 0 && len > 0 {
            // A whole-byte prefix: nft loads just those bytes (and masks the whole address
            // with zeros for `/0`, below).
            let n = (len / 8) as usize;
            self.payload(BASE_NETWORK, off, len / 8, REG_1);
            self.cmp(op, &octets[..n]);
        } else {
            let mask: Vec<u8> = (0..octets.len())
                .map(|i| {
                    let bits = len.saturating_sub(8 * i as u32).min(8);
                    (0xffu16 << (8 - bits)) as u8
                })
                .collect();
            let masked: Vec<u8> = octets.iter().zip(&mask).map(|(a, m)| a & m).collect();
            self.payload(BASE_NETWORK, off, width / 8, REG_1);
            self.bitwise(&mask, &vec![0; mask.len()]);
            self.cmp(op, &masked);
        }
        Ok(())
    }

    fn action(&mut self, a: &Action, table: &str) -> Result<(), Unsupported> {
        self.expr("counter", |_| {});
        match a {
            Action::Accept => self.verdict(NF_ACCEPT, None),
            Action::Drop => self.verdict(NF_DROP, None),
            Action::Return => self.verdict(NFT_RETURN, None),
            Action::Jump(c) => self.verdict(NFT_JUMP, Some(&render::chain_name(table, c))),
            Action::Goto(c) => self.verdict(NFT_GOTO, Some(&render::chain_name(table, c))),
            Action::SetMark(m) => self.mark(!m, *m),
            Action::ClearMark(m) => self.mark(!m, 0),
            Action::SetMaskedMark { mark, mask } => self.mark(!mask, mark & mask),
            Action::Log { prefix } => {
                let prefix = render::string_content(&format!("{prefix}: "));
                self.expr("log", |o| {
                    attr(o, 2, &cstr(&prefix));
                    attr(o, 5, &LOG_LEVEL_NOTICE.to_be_bytes());
                });
            }
            Action::Nflog { group, prefix } => {
                let prefix = render::string_content(prefix);
                // NFTA_LOG_GROUP, NFTA_LOG_PREFIX, NFTA_LOG_SNAPLEN: what `nft` sends for
                // `log prefix "…" group N snaplen 80`.
                self.expr("log", |o| {
                    attr(o, 1, &group.to_be_bytes());
                    attr(o, 2, &cstr(&prefix));
                    attr(
                        o,
                        3,
                        &crate::driver::linux::rules::nflog::SNAPLEN.to_be_bytes(),
                    );
                });
            }
            Action::NoTrack => self.expr("notrack", |_| {}),
            Action::Masquerade { fully_random } => self.expr("masq", |o| {
                if *fully_random {
                    attr(o, 1, &NF_NAT_RANGE_PROTO_RANDOM_FULLY.to_be_bytes());
                }
            }),
        }
        Ok(())
    }

    /// `meta mark set meta mark & keep | set`.
    fn mark(&mut self, keep: u32, set: u32) {
        self.meta_load(META_MARK, REG_1);
        self.bitwise(&keep.to_ne_bytes(), &set.to_ne_bytes());
        self.meta_set(META_MARK, REG_1);
    }
}

fn addr_offset(v: IpVersion, dir: Dir) -> u32 {
    match (v, dir) {
        (IpVersion::V4, Dir::Src) => 12,
        (IpVersion::V4, Dir::Dst) => 16,
        (IpVersion::V6, Dir::Src) => 8,
        (IpVersion::V6, Dir::Dst) => 24,
    }
}

fn addr_len(v: IpVersion) -> u32 {
    match v {
        IpVersion::V4 => 4,
        IpVersion::V6 => 16,
    }
}

fn port_offset(dir: Dir) -> u32 {
    match dir {
        Dir::Src => 0,
        Dir::Dst => 2,
    }
}

/// `80` or `8000:8080` as (first, last).
fn port_range(item: &str) -> Result<(u16, u16), Unsupported> {
    let n = |s: &str| s.trim().parse::<u16>().map_err(|_| Unsupported("a port"));
    match item.split_once(':') {
        Some((a, b)) => Ok((n(a)?, n(b)?)),
        None => {
            let p = n(item)?;
            Ok((p, p))
        }
    }
}

/// `iifname vmap @<map>` (or `oifname`): the interface name looked up in a verdict map.
pub(crate) fn vmap(input: bool, map: &str) -> Vec<u8> {
    let mut e = Exprs(Vec::with_capacity(96));
    e.meta_load(if input { META_IIFNAME } else { META_OIFNAME }, REG_1);
    e.expr("lookup", |o| {
        attr(o, 1, &cstr(map));
        attr(o, 2, &REG_1.to_be_bytes());
        attr(o, 3, &REG_VERDICT.to_be_bytes());
    });
    e.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::linux::rules::Match;

    #[test]
    fn hostile_strings_reach_netlink_as_the_text_path_writes_them() {
        // An interface name and a log prefix with a quote, a NUL and a newline: cleaned as
        // `render::string` cleans them, and nothing past them survives as a string end.
        let m = Match::new().in_iface("ab\"\0c");
        let bytes = rule(
            m.frags(),
            &Action::Log {
                prefix: "p\n\0x".into(),
            },
            "filter",
            IpVersion::V4,
        )
        .unwrap();
        let mut iface = b"ab__c".to_vec();
        iface.resize(16, 0);
        assert!(bytes.windows(16).any(|w| w == iface), "{bytes:?}");
        assert!(bytes.windows(7).any(|w| w == b"p__x: \0"), "{bytes:?}");
        // Names the kernel could not hold are refused (the text path's nft refuses them too).
        let long = Match::new().in_iface(&"x".repeat(16));
        assert!(rule(long.frags(), &Action::Accept, "filter", IpVersion::V4).is_err());
        // A comment longer than the kernel's userdata limit is cut to fit.
        assert_eq!(userdata(&"c".repeat(400)).len(), 256);
    }
}
