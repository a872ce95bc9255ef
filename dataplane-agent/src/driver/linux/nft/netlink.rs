//! Our nftables state written straight over nfnetlink: one batch (`NFNL_MSG_BATCH_BEGIN`, the
//! messages, `NFNL_MSG_BATCH_END`) that the kernel commits as one transaction, as `nft -f` would,
//! without `nft`'s cost of parsing text and loading the whole ruleset into its cache first
//! (which grows with the ruleset: ~16 ms at 1.8k rules, ~175 ms at 107k).
//!
//! [`Op`] is everything the writer does: the table, base and regular chains, chains flushed and
//! deleted, rules (expressions from [`super::expr`], the comment as userdata), sets and maps
//! of the four kinds we use, and their elements: addresses, address·protocol·port,
//! interface verdicts, and networks of interval sets, which the kernel holds as a start
//! element and an end element (the first address after the network, flagged as an interval
//! end; none when the network reaches the top of the address space), as `nft` sends them.
//! Messages carry no ACK request: the kernel handles a batch inside the `send`, so the errors
//! are queued when it returns and are read without waiting. [`BatchWriter`] is the seam; tests
//! use a recording fake.

use std::io;
use std::net::IpAddr;
use std::sync::Arc;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::TABLE;
use crate::driver::linux::rules::IpVersion;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_DELRULE: u16 = 8;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_DELSET: u16 = 11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_DONE: u16 = 3;
const NFT_MSG_GETRULE: u16 = 7;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_COUNTER_BYTES: u16 = 1;
const NFTA_COUNTER_PACKETS: u16 = 2;
/// `NFTNL_UDATA_RULE_COMMENT`: the userdata TLV holding a rule's comment.
const UDATA_RULE_COMMENT: u8 = 0;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLMSG_ERROR: u16 = 2;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DATA_TYPE: u16 = 6;
const NFTA_SET_DATA_LEN: u16 = 7;
const NFTA_SET_ID: u16 = 10;
const NFTA_SET_USERDATA: u16 = 13;
const NFT_SET_INTERVAL: u32 = 4;
const NFT_SET_MAP: u32 = 8;
const NFT_DATA_VERDICT_TYPE: u32 = 0xffff_ff00;
const NF_ACCEPT: u32 = 1;
const MSG_DONTWAIT: i32 = 0x40;
const NLA_F_NESTED: u16 = 0x8000;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub(super) const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFT_SET_ELEM_INTERVAL_END: u32 = 1;
pub(super) const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
pub(super) const NFT_GOTO: i32 = -4;
pub(super) const NFT_JUMP: i32 = -3;
const IFNAMSIZ: usize = 16;

/// One set's (or map's) elements to add or delete, as the writer prints them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ElementOp {
    pub version: IpVersion,
    pub set: String,
    pub add: bool,
    /// The set has `flags interval`: each element is a network (start and end elements).
    pub interval: bool,
    pub elems: Vec<String>,
}

/// The kinds of set and map we create (their key types as `nft` declares them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SetType {
    /// `type ipv4_addr;` / `type ipv6_addr;`
    Addr,
    /// The same with `flags interval;`.
    Net,
    /// `type ipv4_addr . inet_proto . inet_service;`
    AddrProtoPort,
    /// `type ifname : verdict;` (a verdict map).
    IfnameVerdict,
}

/// A base chain's hook (`type filter hook forward priority 0; policy accept;`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hook {
    pub kind: &'static str,
    pub hook: &'static str,
    pub priority: i32,
}

/// One change to a family's `calico` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    NewTable(IpVersion),
    NewChain {
        version: IpVersion,
        name: String,
        hook: Option<Hook>,
    },
    /// Deletes every rule of the chain.
    FlushChain {
        version: IpVersion,
        name: String,
    },
    DelChain {
        version: IpVersion,
        name: String,
    },
    /// Appends a rule: its expressions ([`super::expr::rule`], `None` when it has no
    /// nfnetlink encoding), its userdata (the comment) and its `nft -f` text (for the
    /// fallback).
    Rule {
        version: IpVersion,
        chain: String,
        exprs: Option<Arc<[u8]>>,
        userdata: Arc<[u8]>,
        text: Arc<str>,
    },
    NewSet {
        version: IpVersion,
        name: String,
        kind: SetType,
    },
    /// A set, or a map (`map`: only `nft -f` tells them apart).
    DelSet {
        version: IpVersion,
        name: String,
        map: bool,
    },
    Elements(ElementOp),
}

/// One rule of a family's `calico` table with its counter, as a rule dump gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CountedRule {
    pub chain: String,
    /// The rule's comment (from its userdata).
    pub comment: String,
    pub packets: u64,
    pub bytes: u64,
}

/// Where batches go, and where rule counters come from (the seam).
pub(crate) trait BatchWriter: Send {
    /// Applies every op in one kernel transaction; on error nothing of it applied. Returns
    /// how long the kernel took (the `send`, in which it commits, and reading its answers).
    fn write(&mut self, ops: &[Op]) -> io::Result<std::time::Duration>;

    /// Every rule of family `v`'s `calico` table that has a comment and a counter (one
    /// `NFT_MSG_GETRULE` dump). Unsupported by default: the caller lists the table with `nft`.
    fn counted_rules(&mut self, _v: IpVersion) -> io::Result<Vec<CountedRule>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "no rule dump on this writer",
        ))
    }
}

/// A netlink socket of the agent's network namespace, opened on first use.
#[derive(Default)]
pub(crate) struct NetlinkBatch {
    socket: Option<Socket>,
    sndbuf: usize,
    seq: u32,
    buf: Vec<u8>,
}

impl BatchWriter for NetlinkBatch {
    fn counted_rules(&mut self, v: IpVersion) -> io::Result<Vec<CountedRule>> {
        Self::dump_rules(v)
    }

    fn write(&mut self, ops: &[Op]) -> io::Result<std::time::Duration> {
        self.seq = self.seq.wrapping_add(1 << 20);
        let batch = encode(ops, self.seq)?;
        let result = self.send(&batch);
        if result.is_err() {
            // Unread errors must not be taken for the next batch's.
            self.socket = None;
        }
        result
    }
}

impl NetlinkBatch {
    /// One `NFT_MSG_GETRULE` dump of the `calico` table of family `v` on a socket of its own
    /// (the kernel answers with every rule, expressions and userdata included, then
    /// `NLMSG_DONE`).
    fn dump_rules(v: IpVersion) -> io::Result<Vec<CountedRule>> {
        let mut s = Socket::new(NETLINK_NETFILTER)?;
        s.bind_auto()?;
        s.connect(&SocketAddr::new(0, 0))?;
        let mut body = Vec::new();
        attr(&mut body, NFTA_RULE_TABLE, &cstr(TABLE));
        let mut req = Vec::new();
        message(
            &mut req,
            (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETRULE,
            NLM_F_REQUEST | NLM_F_DUMP,
            1,
            family_of(v),
            0,
            &body,
        );
        s.send(&req, 0)?;
        let mut buf = vec![0u8; 1 << 17];
        let mut out = Vec::new();
        loop {
            let n = s.recv(&mut &mut buf[..], 0)?;
            let mut off = 0;
            while off + 16 <= n {
                let len = u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4")) as usize;
                let kind = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().expect("2"));
                if len < 16 || off + len > n {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a rule dump message cut short",
                    ));
                }
                match kind {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let code = buf
                            .get(off + 16..off + 20)
                            .map(|b| i32::from_ne_bytes(b.try_into().expect("4")))
                            .unwrap_or(-libc_eio());
                        if code != 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                    }
                    // nlmsghdr (16) and nfgenmsg (4), then the rule's attributes.
                    _ if len >= 20 => {
                        if let Some(r) = counted_rule(&buf[off + 20..off + len]) {
                            out.push(r);
                        }
                    }
                    _ => {}
                }
                off += (len + 3) & !3;
            }
        }
    }

    fn send(&mut self, batch: &[u8]) -> io::Result<std::time::Duration> {
        if self.socket.is_none() {
            let mut s = Socket::new(NETLINK_NETFILTER)?;
            s.bind_auto()?;
            s.connect(&SocketAddr::new(0, 0))?;
            self.socket = Some(s);
            self.sndbuf = 0;
        }
        let socket = self.socket.as_mut().expect("opened above");
        // The kernel refuses a message larger than the send buffer; a full ruleset is one
        // message of megabytes (nft raises the buffer the same way).
        if batch.len() + 4096 > self.sndbuf {
            let want = (batch.len() + 4096).next_power_of_two();
            nix::sys::socket::setsockopt(&*socket, nix::sys::socket::sockopt::SndBufForce, &want)
                .map_err(io::Error::from)?;
            self.sndbuf = want;
        }
        let started = std::time::Instant::now();
        socket.send(batch, 0)?;
        // The batch was handled inside `send`: whatever the kernel answered is queued now.
        self.buf.resize(1 << 16, 0);
        loop {
            let n = match socket.recv(&mut &mut self.buf[..], MSG_DONTWAIT) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(started.elapsed()),
                Err(e) => return Err(e),
            };
            let mut off = 0;
            while off + 16 <= n {
                let len =
                    u32::from_ne_bytes(self.buf[off..off + 4].try_into().expect("4")) as usize;
                let kind = u16::from_ne_bytes(self.buf[off + 4..off + 6].try_into().expect("2"));
                // The error code comes first, so it is read even from an answer cut short by
                // the buffer (the kernel echoes the refused message after it).
                if kind == NLMSG_ERROR && off + 20 <= n {
                    let code =
                        i32::from_ne_bytes(self.buf[off + 16..off + 20].try_into().expect("4"));
                    if code != 0 {
                        // The kernel aborted the whole batch.
                        return Err(io::Error::from_raw_os_error(-code));
                    }
                }
                if len < 16 || off + len > n {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "an nfnetlink answer cut short",
                    ));
                }
                off += (len + 3) & !3;
            }
        }
    }
}

/// `EIO`, for an error message too short to hold its code.
fn libc_eio() -> i32 {
    5
}

/// The attributes of a buffer: (type without flags, payload).
fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let kind = u16::from_ne_bytes([b[2], b[3]]) & !NLA_F_NESTED;
        if len < 4 || len > b.len() {
            return None;
        }
        let payload = &b[4..len];
        b = &b[((len + 3) & !3).min(b.len())..];
        Some((kind, payload))
    })
}

/// The chain, comment and counter of a rule message's attributes; `None` for a rule without
/// a comment or a counter.
fn counted_rule(b: &[u8]) -> Option<CountedRule> {
    let (mut chain, mut comment, mut counter) = (None, None, None);
    for (kind, payload) in attrs(b) {
        match kind {
            NFTA_RULE_CHAIN => {
                chain =
                    Some(String::from_utf8_lossy(payload.split(|c| *c == 0).next()?).into_owned());
            }
            NFTA_RULE_USERDATA => {
                // TLVs of (type, length, value); the comment's value ends with a NUL.
                let mut u = payload;
                while u.len() >= 2 {
                    let (t, l) = (u[0], u[1] as usize);
                    let value = u.get(2..2 + l)?;
                    if t == UDATA_RULE_COMMENT {
                        let text = value.split(|c| *c == 0).next().unwrap_or_default();
                        comment = Some(String::from_utf8_lossy(text).into_owned());
                    }
                    u = &u[2 + l..];
                }
            }
            NFTA_RULE_EXPRESSIONS => {
                for (_, elem) in attrs(payload) {
                    let mut name = None;
                    let mut data = None;
                    for (k, p) in attrs(elem) {
                        match k {
                            NFTA_EXPR_NAME => name = Some(p),
                            NFTA_EXPR_DATA => data = Some(p),
                            _ => {}
                        }
                    }
                    if name.is_some_and(|n| n.starts_with(b"counter\0")) {
                        let (mut packets, mut bytes) = (0, 0);
                        for (k, p) in attrs(data.unwrap_or_default()) {
                            let value = u64::from_be_bytes(p.get(..8)?.try_into().ok()?);
                            match k {
                                NFTA_COUNTER_BYTES => bytes = value,
                                NFTA_COUNTER_PACKETS => packets = value,
                                _ => {}
                            }
                        }
                        counter = Some((packets, bytes));
                    }
                }
            }
            _ => {}
        }
    }
    let (packets, bytes) = counter?;
    Some(CountedRule {
        chain: chain?,
        comment: comment?,
        packets,
        bytes,
    })
}

/// A verdict (`NFTA_DATA_VERDICT`: its code, and the chain of a jump or goto), as a map
/// element's data and an `immediate` expression's.
pub(super) fn verdict(out: &mut Vec<u8>, code: i32, chain: Option<&str>) {
    let _ = nested(out, NFTA_DATA_VERDICT, |out| {
        attr(out, NFTA_VERDICT_CODE, &code.to_be_bytes());
        if let Some(c) = chain {
            attr(out, NFTA_VERDICT_CHAIN, &cstr(c));
        }
    });
}

/// One netlink attribute (length, type, payload, padding to 4 bytes); shared with the
/// benchmarks' ipset netlink client.
pub fn attr(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = u16::try_from(4 + payload.len()).expect("small attribute");
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

pub(crate) fn nested(
    out: &mut Vec<u8>,
    kind: u16,
    body: impl FnOnce(&mut Vec<u8>),
) -> io::Result<()> {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    body(out);
    let len = u16::try_from(out.len() - start)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "attribute too long"))?;
    out[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    out[start + 2..start + 4].copy_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    Ok(())
}

pub(crate) fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

fn message(
    out: &mut Vec<u8>,
    kind: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    body: &[u8],
) {
    let len = u32::try_from(16 + 4 + body.len()).expect("bounded by the chunking");
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.push(family);
    out.push(0);
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(body);
}

fn bad(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("cannot encode element {what:?}"),
    )
}

fn addr_bytes(s: &str) -> io::Result<Vec<u8>> {
    match s.parse::<IpAddr>().map_err(|_| bad(s))? {
        IpAddr::V4(a) => Ok(a.octets().to_vec()),
        IpAddr::V6(a) => Ok(a.octets().to_vec()),
    }
}

/// A network's start and end keys (`None` for the end when the network reaches the top of
/// the address space).
fn interval_keys(e: &str) -> io::Result<(Vec<u8>, Option<Vec<u8>>)> {
    let (addr, len) = match e.split_once('/') {
        Some((a, l)) => (a, Some(l.parse::<u32>().map_err(|_| bad(e))?)),
        None => (e, None),
    };
    let ip: IpAddr = addr.parse().map_err(|_| bad(e))?;
    let (bits, width): (u128, u32) = match ip {
        IpAddr::V4(a) => (u128::from(u32::from(a)), 32),
        IpAddr::V6(a) => (u128::from(a), 128),
    };
    let len = len.unwrap_or(width);
    if len > width {
        return Err(bad(e));
    }
    let host = width - len;
    let start = if host >= 128 {
        0
    } else {
        (bits >> host) << host
    };
    let size: Option<u128> = if host >= 128 {
        None
    } else {
        Some(1u128 << host)
    };
    let end = size.and_then(|s| start.checked_add(s));
    let bytes = |v: u128| -> Vec<u8> {
        if width == 32 {
            (v as u32).to_be_bytes().to_vec()
        } else {
            v.to_be_bytes().to_vec()
        }
    };
    let top = if width == 32 {
        u128::from(u32::MAX)
    } else {
        u128::MAX
    };
    let end = end.filter(|e| *e <= top).map(bytes);
    Ok((bytes(start), end))
}

/// One element: its key, its flags, and the verdict of a map element.
fn key_elem(
    out: &mut Vec<u8>,
    key: &[u8],
    flags: u32,
    target: Option<(i32, &str)>,
) -> io::Result<()> {
    nested(out, NFTA_LIST_ELEM, |out| {
        let _ = nested(out, NFTA_SET_ELEM_KEY, |out| {
            attr(out, NFTA_DATA_VALUE, key)
        });
        if flags != 0 {
            attr(out, NFTA_SET_ELEM_FLAGS, &flags.to_be_bytes());
        }
        if let Some((code, chain)) = target {
            let _ = nested(out, NFTA_SET_ELEM_DATA, |out| {
                verdict(out, code, Some(chain));
            });
        }
    })
}

/// One network of an interval set: its start element, then its end element.
fn interval_element(out: &mut Vec<u8>, e: &str) -> io::Result<()> {
    let (start, end) = interval_keys(e)?;
    key_elem(out, &start, 0, None)?;
    if let Some(end) = end {
        key_elem(out, &end, NFT_SET_ELEM_INTERVAL_END, None)?;
    }
    Ok(())
}

/// One element's attributes: the key (and the verdict of a map element).
fn element(out: &mut Vec<u8>, e: &str) -> io::Result<()> {
    let mut key = Vec::new();
    let mut target = None;
    if let Some((k, v)) = e.split_once(" : ") {
        // `"iface" : goto chain`: an ifname key is IFNAMSIZ bytes, zero-padded.
        let name = k.trim_matches('"');
        if name.len() >= IFNAMSIZ {
            return Err(bad(e));
        }
        key.extend_from_slice(name.as_bytes());
        key.resize(IFNAMSIZ, 0);
        let (code, chain) = match v.split_once(' ') {
            Some(("goto", c)) => (NFT_GOTO, c),
            Some(("jump", c)) => (NFT_JUMP, c),
            _ => return Err(bad(e)),
        };
        target = Some((code, chain.to_owned()));
    } else {
        let parts: Vec<&str> = e.split(" . ").collect();
        match parts.as_slice() {
            [a] => key = addr_bytes(a)?,
            [a, proto, port] => {
                // Concatenations put each field in its own 4-byte register.
                key = addr_bytes(a)?;
                let p: u8 = match *proto {
                    "tcp" => 6,
                    "udp" => 17,
                    "sctp" => 132,
                    other => other.parse().map_err(|_| bad(e))?,
                };
                key.extend_from_slice(&[p, 0, 0, 0]);
                let port: u16 = port.parse().map_err(|_| bad(e))?;
                key.extend_from_slice(&port.to_be_bytes());
                key.extend_from_slice(&[0, 0]);
            }
            _ => return Err(bad(e)),
        }
    }
    key_elem(
        out,
        &key,
        0,
        target.as_ref().map(|(code, chain)| (*code, chain.as_str())),
    )
}

/// Elements per message (keeps each message well under the 64 KiB attribute limit).
const ELEMENTS_PER_MESSAGE: usize = 500;

fn family_of(v: IpVersion) -> u8 {
    match v {
        IpVersion::V4 => 2,
        IpVersion::V6 => 10,
    }
}

fn hook_number(hook: &str) -> io::Result<u32> {
    Ok(match hook {
        "prerouting" => 0,
        "input" => 1,
        "forward" => 2,
        "output" => 3,
        "postrouting" => 4,
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no hook {other:?}"),
            ));
        }
    })
}

/// A set's key type, key length, flags and the userdata `nft` stores with it (the byte order
/// it prints elements in), as `nft` 1.0 sends them for these declarations.
fn set_decl(kind: SetType, v: IpVersion) -> (u32, u32, u32, &'static [u8]) {
    // nft's datatype numbers: ipv4_addr 7, ipv6_addr 8, inet_proto 12, inet_service 13,
    // ifname 41; a concatenation packs them 6 bits apart.
    let (addr, addr_len) = match v {
        IpVersion::V4 => (7u32, 4u32),
        IpVersion::V6 => (8, 16),
    };
    const BIG_ENDIAN_KEY: &[u8] = &[0, 4, 2, 0, 0, 0];
    match kind {
        SetType::Addr => (addr, addr_len, 0, BIG_ENDIAN_KEY),
        SetType::Net => (addr, addr_len, NFT_SET_INTERVAL, BIG_ENDIAN_KEY),
        SetType::AddrProtoPort => (
            (addr << 12) | (12 << 6) | 13,
            addr_len + 8,
            0,
            &[0, 4, 0, 0, 0, 0, 3, 8, 0, 4, 13, 0, 0, 0, 1, 0],
        ),
        SetType::IfnameVerdict => (
            41,
            16,
            NFT_SET_MAP,
            &[0, 4, 1, 0, 0, 0, 1, 4, 0, 0, 0, 0, 6, 4, 0, 0, 0, 0],
        ),
    }
}

/// The batch for `ops`.
pub(crate) fn encode(ops: &[Op], seq: u32) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut seq = seq;
    message(
        &mut out,
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
        &[],
    );
    let mut set_id: u32 = 0;
    let mut body = Vec::new();
    for op in ops {
        let mut push = |out: &mut Vec<u8>, kind: u16, flags: u16, v: IpVersion, body: &[u8]| {
            seq = seq.wrapping_add(1);
            message(
                out,
                (NFNL_SUBSYS_NFTABLES << 8) | kind,
                NLM_F_REQUEST | flags,
                seq,
                family_of(v),
                0,
                body,
            );
        };
        body.clear();
        match op {
            Op::NewTable(v) => {
                attr(&mut body, NFTA_TABLE_NAME, &cstr(TABLE));
                attr(&mut body, NFTA_TABLE_FLAGS, &0u32.to_be_bytes());
                push(&mut out, NFT_MSG_NEWTABLE, NLM_F_CREATE, *v, &body);
            }
            Op::NewChain {
                version,
                name,
                hook,
            } => {
                attr(&mut body, NFTA_CHAIN_TABLE, &cstr(TABLE));
                attr(&mut body, NFTA_CHAIN_NAME, &cstr(name));
                if let Some(h) = hook {
                    attr(&mut body, NFTA_CHAIN_TYPE, &cstr(h.kind));
                    attr(&mut body, NFTA_CHAIN_POLICY, &NF_ACCEPT.to_be_bytes());
                    let num = hook_number(h.hook)?;
                    nested(&mut body, NFTA_CHAIN_HOOK, |o| {
                        attr(o, NFTA_HOOK_HOOKNUM, &num.to_be_bytes());
                        attr(o, NFTA_HOOK_PRIORITY, &h.priority.to_be_bytes());
                    })?;
                }
                push(&mut out, NFT_MSG_NEWCHAIN, NLM_F_CREATE, *version, &body);
            }
            Op::FlushChain { version, name } => {
                attr(&mut body, NFTA_RULE_TABLE, &cstr(TABLE));
                attr(&mut body, NFTA_RULE_CHAIN, &cstr(name));
                push(&mut out, NFT_MSG_DELRULE, 0, *version, &body);
            }
            Op::DelChain { version, name } => {
                attr(&mut body, NFTA_CHAIN_TABLE, &cstr(TABLE));
                attr(&mut body, NFTA_CHAIN_NAME, &cstr(name));
                push(&mut out, NFT_MSG_DELCHAIN, 0, *version, &body);
            }
            Op::Rule {
                version,
                chain,
                exprs,
                userdata,
                ..
            } => {
                let Some(exprs) = exprs else {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("a rule of {chain} has no nfnetlink encoding"),
                    ));
                };
                attr(&mut body, NFTA_RULE_TABLE, &cstr(TABLE));
                attr(&mut body, NFTA_RULE_CHAIN, &cstr(chain));
                nested(&mut body, NFTA_RULE_EXPRESSIONS, |o| {
                    o.extend_from_slice(exprs)
                })?;
                attr(&mut body, NFTA_RULE_USERDATA, userdata);
                push(
                    &mut out,
                    NFT_MSG_NEWRULE,
                    NLM_F_CREATE | NLM_F_APPEND,
                    *version,
                    &body,
                );
            }
            Op::NewSet {
                version,
                name,
                kind,
            } => {
                let (key_type, key_len, flags, udata) = set_decl(*kind, *version);
                set_id += 1;
                attr(&mut body, NFTA_SET_TABLE, &cstr(TABLE));
                attr(&mut body, NFTA_SET_NAME, &cstr(name));
                attr(&mut body, NFTA_SET_FLAGS, &flags.to_be_bytes());
                attr(&mut body, NFTA_SET_KEY_TYPE, &key_type.to_be_bytes());
                attr(&mut body, NFTA_SET_KEY_LEN, &key_len.to_be_bytes());
                if *kind == SetType::IfnameVerdict {
                    attr(
                        &mut body,
                        NFTA_SET_DATA_TYPE,
                        &NFT_DATA_VERDICT_TYPE.to_be_bytes(),
                    );
                    attr(&mut body, NFTA_SET_DATA_LEN, &0u32.to_be_bytes());
                }
                attr(&mut body, NFTA_SET_ID, &set_id.to_be_bytes());
                attr(&mut body, NFTA_SET_USERDATA, udata);
                push(&mut out, NFT_MSG_NEWSET, NLM_F_CREATE, *version, &body);
            }
            Op::DelSet { version, name, .. } => {
                attr(&mut body, NFTA_SET_TABLE, &cstr(TABLE));
                attr(&mut body, NFTA_SET_NAME, &cstr(name));
                push(&mut out, NFT_MSG_DELSET, 0, *version, &body);
            }
            Op::Elements(op) => {
                let (kind, flags) = if op.add {
                    (NFT_MSG_NEWSETELEM, NLM_F_CREATE)
                } else {
                    (NFT_MSG_DELSETELEM, 0)
                };
                for chunk in op.elems.chunks(ELEMENTS_PER_MESSAGE) {
                    body.clear();
                    attr(&mut body, NFTA_SET_ELEM_LIST_TABLE, &cstr(TABLE));
                    attr(&mut body, NFTA_SET_ELEM_LIST_SET, &cstr(&op.set));
                    let mut result = Ok(());
                    nested(&mut body, NFTA_SET_ELEM_LIST_ELEMENTS, |out| {
                        for e in chunk {
                            let encoded = if op.interval {
                                interval_element(out, e)
                            } else {
                                element(out, e)
                            };
                            if let Err(err) = encoded {
                                result = Err(err);
                                return;
                            }
                        }
                    })?;
                    result?;
                    push(&mut out, kind, flags, op.version, &body);
                }
            }
        }
    }
    seq = seq.wrapping_add(1);
    message(
        &mut out,
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
        &[],
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_encode_as_the_kernel_reads_them() {
        let ops = [Op::Elements(ElementOp {
            version: IpVersion::V4,
            set: "cali40n-x".into(),
            add: true,
            interval: false,
            elems: vec!["10.0.0.1 . tcp . 80".into()],
        })];
        let batch = encode(&ops, 7).unwrap();
        // begin (20 bytes), the element message, end (20 bytes).
        let len = u32::from_ne_bytes(batch[20..24].try_into().unwrap()) as usize;
        assert_eq!(batch.len(), 20 + len + 20);
        let key = [10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0];
        assert!(
            batch.windows(12).any(|w| w == key),
            "the 12-byte concatenated key"
        );
        assert_eq!(
            u16::from_ne_bytes(batch[24..26].try_into().unwrap()),
            (10 << 8) | 12
        );
    }

    #[test]
    fn map_elements_carry_a_goto_verdict_and_bad_ones_are_refused() {
        let ops = [Op::Elements(ElementOp {
            version: IpVersion::V6,
            set: "filter-cali-to-wl-dispatch".into(),
            add: false,
            interval: false,
            elems: vec!["\"cali1\" : goto filter-cali-tw-cali1".into()],
        })];
        let batch = encode(&ops, 1).unwrap();
        let mut key = b"cali1".to_vec();
        key.resize(16, 0);
        assert!(batch.windows(16).any(|w| w == key));
        assert!(batch.windows(4).any(|w| w == NFT_GOTO.to_be_bytes()));
        let bad_ops = [Op::Elements(ElementOp {
            version: IpVersion::V4,
            set: "s".into(),
            add: true,
            interval: false,
            elems: vec!["not-an-address".into()],
        })];
        assert!(encode(&bad_ops, 1).is_err());
    }

    #[test]
    fn networks_are_a_start_and_an_end_element() {
        assert_eq!(
            interval_keys("10.0.0.0/24").unwrap(),
            (vec![10, 0, 0, 0], Some(vec![10, 0, 1, 0]))
        );
        assert_eq!(
            interval_keys("10.0.0.7").unwrap(),
            (vec![10, 0, 0, 7], Some(vec![10, 0, 0, 8]))
        );
        // The top of the address space has no end element.
        assert_eq!(
            interval_keys("128.0.0.0/1").unwrap(),
            (vec![128, 0, 0, 0], None)
        );
        let (start, end) = interval_keys("fd00::/64").unwrap();
        assert_eq!(start.len(), 16);
        assert_eq!(end.unwrap()[7], 1);
        assert!(interval_keys("10.0.0.0/33").is_err());
        let ops = [Op::Elements(ElementOp {
            version: IpVersion::V4,
            set: "cali40s-x".into(),
            add: true,
            interval: true,
            elems: vec!["10.0.0.0/24".into()],
        })];
        let batch = encode(&ops, 1).unwrap();
        assert!(
            batch
                .windows(4)
                .any(|w| w == NFT_SET_ELEM_INTERVAL_END.to_be_bytes()),
            "the end element is flagged"
        );
    }
}
