//! The kernel's side of flow logs ([`crate::flows::source::FlowSource`]): the packets our NFLOG
//! rules log (groups 1 and 2, bound on a netfilter netlink socket of the agent's namespace)
//! and the conntrack table (dumped over ctnetlink at each read, each entry with its counters).
//!
//! Written on `netlink-sys` like the nftables writer's netlink: the messages are a few fixed
//! attributes, parsed here (pure functions, unit-tested on bytes). The `netlink-packet-netfilter`
//! crate has NFLOG and conntrack messages too, but no conntrack counters.
//!
//! Conntrack is polled, as Felix polls it: an entry gone since the previous dump completed with
//! its last counters (what it counted between that dump and its end is not seen). Counters need
//! `net.netfilter.nf_conntrack_acct`, which the source turns on when it opens. Sockets open on
//! the first read and close with [`KernelFlowSource::close`]; a full NFLOG socket buffer loses
//! packets (counted, logged). The kernel sends logged packets in batches, at the latest after a
//! second (nfnetlink_log's defaults).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::flows::source::{FlowEvent, FlowSource};
use crate::flows::{CtObservation, GROUP_INBOUND, GROUP_OUTBOUND, Tuple};

const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_F_NESTED: u16 = 1 << 15;
const NLA_F_NET_BYTEORDER: u16 = 1 << 14;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const NFNL_SUBSYS_ULOG: u16 = 4;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_COPY_PACKET: u8 = 2;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;

const IPCTNL_MSG_CT_GET: u16 = 1;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_COUNTERS_ORIG: u16 = 9;
const CTA_COUNTERS_REPLY: u16 = 10;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_COUNTERS_PACKETS: u16 = 1;
const CTA_COUNTERS_BYTES: u16 = 2;
const CTA_COUNTERS32_PACKETS: u16 = 3;
const CTA_COUNTERS32_BYTES: u16 = 4;

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// Bytes of each logged packet copied (the rules ask for 80 too).
const COPY_RANGE: u32 = 80;

/// One netlink message: header (len, type, flags, seq, pid) then nfgenmsg (family, version,
/// res_id) then `body`.
fn message(kind: u16, flags: u16, seq: u32, family: u8, res_id: u16, body: &[u8]) -> Vec<u8> {
    let len = u32::try_from(20 + body.len()).expect("small");
    let mut out = Vec::with_capacity(20 + body.len());
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.push(family);
    out.push(0);
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(body);
    out
}

fn attr(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = u16::try_from(4 + payload.len()).expect("small");
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// The attributes of a buffer: (type without flags, payload).
fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let kind = u16::from_ne_bytes([b[2], b[3]]) & !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);
        if len < 4 || len > b.len() {
            return None;
        }
        let payload = &b[4..len];
        b = &b[((len + 3) & !3).min(b.len())..];
        Some((kind, payload))
    })
}

/// The messages of one datagram: (type, nfgenmsg res_id, attributes after the nfgenmsg), and
/// the error code of any `NLMSG_ERROR` (0 for an ack).
fn messages(buf: &[u8]) -> Vec<Msg<'_>> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4")) as usize;
        let kind = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().expect("2"));
        if len < 16 || off + len > buf.len() {
            break;
        }
        let body = &buf[off + 16..off + len];
        out.push(match kind {
            NLMSG_ERROR => Msg::Error(
                body.get(..4)
                    .map_or(-5, |b| i32::from_ne_bytes(b.try_into().expect("4"))),
            ),
            NLMSG_DONE => Msg::Done,
            _ if body.len() >= 4 => Msg::Nf {
                kind,
                family: body[0],
                res_id: u16::from_be_bytes([body[2], body[3]]),
                attrs: &body[4..],
            },
            _ => Msg::Other,
        });
        off += (len + 3) & !3;
    }
    out
}

#[derive(Debug, PartialEq, Eq)]
enum Msg<'a> {
    Error(i32),
    Done,
    Nf {
        kind: u16,
        family: u8,
        res_id: u16,
        attrs: &'a [u8],
    },
    Other,
}

/// A logged packet's group (`res_id`), prefix, 5-tuple and length, from an NFLOG message's
/// attributes. `None` for a packet whose headers were not copied or are not IP.
fn parse_nflog(res_id: u16, attributes: &[u8]) -> Option<(u16, String, Tuple, u32)> {
    let (mut prefix, mut payload) = (None, None);
    for (kind, p) in attrs(attributes) {
        match kind {
            NFULA_PREFIX => {
                let end = p.iter().position(|&c| c == 0).unwrap_or(p.len());
                prefix = Some(String::from_utf8_lossy(&p[..end]).into_owned());
            }
            NFULA_PAYLOAD => payload = Some(p),
            _ => {}
        }
    }
    let (tuple, len) = packet_tuple(payload?)?;
    Some((res_id, prefix?, tuple, len))
}

/// The 5-tuple and total length of an IP packet's first bytes (ports for TCP, UDP and SCTP;
/// 0 otherwise).
fn packet_tuple(p: &[u8]) -> Option<(Tuple, u32)> {
    let version = p.first()? >> 4;
    let (src, dst, protocol, len, l4) = match version {
        4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if p.len() < 20 || ihl < 20 {
                return None;
            }
            let src = IpAddr::V4(Ipv4Addr::new(p[12], p[13], p[14], p[15]));
            let dst = IpAddr::V4(Ipv4Addr::new(p[16], p[17], p[18], p[19]));
            let len = u32::from(u16::from_be_bytes([p[2], p[3]]));
            (src, dst, p[9], len, p.get(ihl..))
        }
        6 => {
            if p.len() < 40 {
                return None;
            }
            let a = |o: usize| -> IpAddr {
                let b: [u8; 16] = p[o..o + 16].try_into().expect("16");
                IpAddr::V6(Ipv6Addr::from(b))
            };
            let len = 40 + u32::from(u16::from_be_bytes([p[4], p[5]]));
            // Extension headers are not followed: their ports read as 0.
            (a(8), a(24), p[6], len, p.get(40..))
        }
        _ => return None,
    };
    let (src_port, dst_port) = match (protocol, l4) {
        (6 | 17 | 132, Some(l4)) if l4.len() >= 4 => (
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        ),
        _ => (0, 0),
    };
    Some((
        Tuple {
            src,
            dst,
            src_port,
            dst_port,
            protocol,
        },
        len,
    ))
}

fn ct_tuple(b: &[u8]) -> Option<Tuple> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, 0, 0);
    for (kind, p) in attrs(b) {
        match kind {
            CTA_TUPLE_IP => {
                for (k, a) in attrs(p) {
                    let ip = match (k, a.len()) {
                        (CTA_IP_V4_SRC | CTA_IP_V4_DST, 4) => {
                            IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
                        }
                        (CTA_IP_V6_SRC | CTA_IP_V6_DST, 16) => {
                            let b: [u8; 16] = a.try_into().expect("16");
                            IpAddr::V6(Ipv6Addr::from(b))
                        }
                        _ => continue,
                    };
                    if matches!(k, CTA_IP_V4_SRC | CTA_IP_V6_SRC) {
                        src = Some(ip);
                    } else {
                        dst = Some(ip);
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (k, a) in attrs(p) {
                    match (k, a.len()) {
                        (CTA_PROTO_NUM, 1) => proto = Some(a[0]),
                        (CTA_PROTO_SRC_PORT, 2) => sport = u16::from_be_bytes([a[0], a[1]]),
                        (CTA_PROTO_DST_PORT, 2) => dport = u16::from_be_bytes([a[0], a[1]]),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Tuple {
        src: src?,
        dst: dst?,
        src_port: sport,
        dst_port: dport,
        protocol: proto?,
    })
}

/// (packets, bytes) of a `CTA_COUNTERS_*` attribute.
fn ct_counters(b: &[u8]) -> (u64, u64) {
    let (mut packets, mut bytes) = (0, 0);
    for (k, a) in attrs(b) {
        let v = match a.len() {
            8 => u64::from_be_bytes(a.try_into().expect("8")),
            4 => u64::from(u32::from_be_bytes(a.try_into().expect("4"))),
            _ => continue,
        };
        match k {
            CTA_COUNTERS_PACKETS | CTA_COUNTERS32_PACKETS => packets = v,
            CTA_COUNTERS_BYTES | CTA_COUNTERS32_BYTES => bytes = v,
            _ => {}
        }
    }
    (packets, bytes)
}

/// A conntrack entry of a dump (neither new nor destroyed: the poll decides).
fn parse_ct(attributes: &[u8]) -> Option<CtObservation> {
    let (mut orig, mut reply, mut co, mut cr) = (None, None, (0, 0), (0, 0));
    for (kind, p) in attrs(attributes) {
        match kind {
            CTA_TUPLE_ORIG => orig = ct_tuple(p),
            CTA_TUPLE_REPLY => reply = ct_tuple(p),
            CTA_COUNTERS_ORIG => co = ct_counters(p),
            CTA_COUNTERS_REPLY => cr = ct_counters(p),
            _ => {}
        }
    }
    Some(CtObservation {
        orig: orig?,
        reply: reply?,
        orig_packets: co.0,
        orig_bytes: co.1,
        reply_packets: cr.0,
        reply_bytes: cr.1,
        new: false,
        destroyed: false,
    })
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The NFLOG socket's receive buffer: 16 MiB, about 15 s of logged packets at 2,000 new
/// connections a second.
const NFLOG_RCVBUF: usize = 16 << 20;

fn open_socket() -> io::Result<Socket> {
    let mut s = Socket::new(NETLINK_NETFILTER)?;
    s.bind_auto()?;
    s.connect(&SocketAddr::new(0, 0))?;
    Ok(s)
}

/// Sends `req` and waits for its ack (an error code other than 0 is the error).
fn request_ack(s: &mut Socket, req: &[u8], buf: &mut [u8]) -> io::Result<()> {
    s.send(req, 0)?;
    let n = s.recv(&mut &mut buf[..], 0)?;
    for m in messages(&buf[..n]) {
        if let Msg::Error(code) = m {
            if code != 0 {
                return Err(io::Error::from_raw_os_error(-code));
            }
            return Ok(());
        }
    }
    Ok(())
}

/// Reads NFLOG groups 1 and 2 and the conntrack table of the agent's network namespace.
pub struct KernelFlowSource {
    nflog: Option<Socket>,
    buf: Vec<u8>,
    /// The previous dump: (orig, reply) → the entry as last seen.
    last_dump: HashMap<(Tuple, Tuple), CtObservation>,
    /// The most entries of a dump remembered until the next (an entry not remembered that goes
    /// away is not seen completing: its connection expires as idle instead).
    max_remembered: usize,
    /// The previous dump had more entries than were remembered: an entry not remembered may
    /// be an old one, so it is not called new.
    last_truncated: bool,
    /// NFLOG packets lost to a full socket buffer since start.
    pub overruns: u64,
}

impl Default for KernelFlowSource {
    /// Remembers 200 000 entries (4 × the default connection cap).
    fn default() -> Self {
        Self::new(200_000)
    }
}

impl KernelFlowSource {
    pub fn new(max_remembered: usize) -> Self {
        Self {
            nflog: None,
            buf: Vec::new(),
            last_dump: HashMap::new(),
            max_remembered,
            last_truncated: false,
            overruns: 0,
        }
    }

    /// Binds the NFLOG groups (copying [`COPY_RANGE`] bytes of each packet) and turns
    /// conntrack accounting on.
    fn open(&mut self) -> io::Result<()> {
        if let Err(e) = std::fs::write("/proc/sys/net/netfilter/nf_conntrack_acct", "1") {
            tracing::warn!(error = %e, "cannot turn conntrack accounting on; flow logs count no packets");
        }
        let mut s = open_socket()?;
        self.buf.resize(1 << 16, 0);
        for (i, group) in [GROUP_INBOUND, GROUP_OUTBOUND].into_iter().enumerate() {
            let seq = 1 + 2 * u32::try_from(i).expect("2");
            let mut body = Vec::new();
            attr(&mut body, NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]);
            let kind = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG;
            let req = message(kind, NLM_F_REQUEST | NLM_F_ACK, seq, 0, group, &body);
            request_ack(&mut s, &req, &mut self.buf)?;
            let mut mode = Vec::new();
            mode.extend_from_slice(&COPY_RANGE.to_be_bytes());
            mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
            let mut body = Vec::new();
            attr(&mut body, NFULA_CFG_MODE, &mode);
            let req = message(kind, NLM_F_REQUEST | NLM_F_ACK, seq + 1, 0, group, &body);
            request_ack(&mut s, &req, &mut self.buf)?;
        }
        // The socket is read once per flows interval (5 s): at a thousand new connections a
        // second the logged packets of an interval are megabytes, beyond the default buffer.
        // As root the buffer may exceed `net.core.rmem_max` (SO_RCVBUFFORCE); else the
        // capped size is what the kernel grants, and overruns are counted.
        use nix::sys::socket::{setsockopt, sockopt};
        if let Err(e) = setsockopt(&s, sockopt::RcvBufForce, &NFLOG_RCVBUF)
            .or_else(|_| setsockopt(&s, sockopt::RcvBuf, &NFLOG_RCVBUF))
        {
            tracing::warn!(error = %e, "cannot enlarge the NFLOG socket's buffer");
        }
        self.nflog = Some(s);
        Ok(())
    }

    /// Releases the NFLOG groups (flow logs turned off).
    pub fn close(&mut self) {
        self.nflog = None;
        self.last_dump.clear();
        self.last_truncated = false;
    }

    fn read_nflog(&mut self, out: &mut Vec<FlowEvent>) -> io::Result<()> {
        let Some(s) = self.nflog.as_mut() else {
            return Ok(());
        };
        let at = now_secs();
        loop {
            let n = match s.recv(&mut &mut self.buf[..], nix::libc::MSG_DONTWAIT) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.raw_os_error() == Some(nix::libc::ENOBUFS) => {
                    self.overruns += 1;
                    tracing::warn!("NFLOG socket buffer full: logged packets were lost");
                    continue;
                }
                Err(e) => return Err(e),
            };
            for m in messages(&self.buf[..n]) {
                if let Msg::Nf {
                    kind,
                    res_id,
                    attrs,
                    ..
                } = m
                    && kind == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET
                    && let Some((group, prefix, tuple, len)) = parse_nflog(res_id, attrs)
                {
                    out.push(FlowEvent::Nflog {
                        at,
                        group,
                        prefix,
                        tuple,
                        len,
                    });
                }
            }
        }
    }

    /// One dump of the conntrack table of family `family`.
    fn dump_ct(&mut self, family: u8) -> io::Result<Vec<CtObservation>> {
        let s = open_socket()?;
        let kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET;
        s.send(
            &message(kind, NLM_F_REQUEST | NLM_F_DUMP, 1, family, 0, &[]),
            0,
        )?;
        let mut buf = vec![0u8; 1 << 17];
        let mut out = Vec::new();
        loop {
            let n = s.recv(&mut &mut buf[..], 0)?;
            for m in messages(&buf[..n]) {
                match m {
                    Msg::Done => return Ok(out),
                    Msg::Error(0) => {}
                    Msg::Error(code) => return Err(io::Error::from_raw_os_error(-code)),
                    Msg::Nf { attrs, .. } => out.extend(parse_ct(attrs)),
                    Msg::Other => {}
                }
            }
            if n == 0 {
                return Ok(out);
            }
        }
    }

    fn read_conntrack(&mut self, out: &mut Vec<FlowEvent>) -> io::Result<()> {
        let at = now_secs();
        let mut dump = self.dump_ct(AF_INET)?;
        dump.extend(self.dump_ct(AF_INET6)?);
        self.diff_dump(at, dump, out);
        Ok(())
    }

    /// The events of one dump against the previous one: every entry (new when the previous
    /// dump did not have it), then the entries gone since, destroyed with their last counters.
    fn diff_dump(&mut self, at: i64, dump: Vec<CtObservation>, out: &mut Vec<FlowEvent>) {
        let truncated = dump.len() > self.max_remembered;
        let mut next = HashMap::with_capacity(dump.len().min(self.max_remembered));
        for mut e in dump {
            let key = (e.orig, e.reply);
            let known = self.last_dump.remove(&key).is_some();
            e.new = !known && !self.last_truncated;
            out.push(FlowEvent::Conntrack { at, entry: e });
            e.new = false;
            if next.len() < self.max_remembered {
                next.insert(key, e);
            }
        }
        // What is left was not in this dump: completed, with the counters last seen.
        for (_, mut e) in std::mem::replace(&mut self.last_dump, next) {
            e.destroyed = true;
            out.push(FlowEvent::Conntrack { at, entry: e });
        }
        self.last_truncated = truncated;
    }
}

impl FlowSource for KernelFlowSource {
    /// NFLOG first (the packets that created the connections), then the conntrack dump.
    fn read(&mut self, out: &mut Vec<FlowEvent>) -> io::Result<()> {
        if self.nflog.is_none() {
            self.open()?;
        }
        self.read_nflog(out)?;
        self.read_conntrack(out)
    }

    fn close(&mut self) {
        KernelFlowSource::close(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(kind: u16, inner: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        attr(&mut out, kind | NLA_F_NESTED, inner);
        out
    }

    /// An IPv4 TCP SYN's first bytes, 60 bytes long in total.
    fn syn() -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 60, 0, 0, 0x40, 0, 64, 6, 0, 0];
        p.extend([10, 65, 1, 9, 10, 65, 0, 2]);
        p.extend(40000u16.to_be_bytes());
        p.extend(80u16.to_be_bytes());
        p.extend([0; 16]);
        p
    }

    #[test]
    fn an_nflog_packet_gives_group_prefix_tuple_and_length() {
        let mut attrs = Vec::new();
        attr(&mut attrs, NFULA_PREFIX, b"API0|np/prod/web\0");
        attr(&mut attrs, NFULA_PAYLOAD, &syn());
        let msg = message(
            (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET,
            0,
            0,
            2,
            1,
            &attrs,
        );
        let ms = messages(&msg);
        let Msg::Nf {
            kind,
            res_id,
            attrs,
            ..
        } = ms[0]
        else {
            panic!("{ms:?}")
        };
        assert_eq!((kind, res_id), (0x400, 1));
        let (group, prefix, tuple, len) = parse_nflog(res_id, attrs).unwrap();
        assert_eq!((group, prefix.as_str(), len), (1, "API0|np/prod/web", 60));
        assert_eq!(
            tuple,
            Tuple {
                src: "10.65.1.9".parse().unwrap(),
                dst: "10.65.0.2".parse().unwrap(),
                src_port: 40000,
                dst_port: 80,
                protocol: 6
            }
        );
        // No payload (or not IP): nothing.
        let mut attrs = Vec::new();
        attr(&mut attrs, NFULA_PREFIX, b"DRI\0");
        assert_eq!(parse_nflog(2, &attrs), None);
        attr(&mut attrs, NFULA_PAYLOAD, &[0x00; 40]);
        assert_eq!(parse_nflog(2, &attrs), None);
    }

    #[test]
    fn an_ipv6_udp_packet_and_icmp_without_ports() {
        let mut p = vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        p.extend("fd00::1".parse::<Ipv6Addr>().unwrap().octets());
        p.extend("fd00::2".parse::<Ipv6Addr>().unwrap().octets());
        p.extend([0x13, 0x88, 0x00, 0x35, 0, 8, 0, 0]);
        let (t, len) = packet_tuple(&p).unwrap();
        assert_eq!(
            (t.src_port, t.dst_port, t.protocol, len),
            (5000, 53, 17, 48)
        );
        let mut icmp = syn();
        icmp[9] = 1;
        let (t, _) = packet_tuple(&icmp).unwrap();
        assert_eq!((t.src_port, t.dst_port, t.protocol), (0, 0, 1));
    }

    fn ct_tuple_attr(kind: u16, src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
        let mut ip = Vec::new();
        attr(&mut ip, CTA_IP_V4_SRC, &src);
        attr(&mut ip, CTA_IP_V4_DST, &dst);
        let mut proto = Vec::new();
        attr(&mut proto, CTA_PROTO_NUM, &[6]);
        attr(&mut proto, CTA_PROTO_SRC_PORT, &sport.to_be_bytes());
        attr(&mut proto, CTA_PROTO_DST_PORT, &dport.to_be_bytes());
        let mut t = nested(CTA_TUPLE_IP, &ip);
        t.extend(nested(CTA_TUPLE_PROTO, &proto));
        nested(kind, &t)
    }

    fn counters(kind: u16, packets: u64, bytes: u64) -> Vec<u8> {
        let mut c = Vec::new();
        attr(&mut c, CTA_COUNTERS_PACKETS, &packets.to_be_bytes());
        attr(&mut c, CTA_COUNTERS_BYTES, &bytes.to_be_bytes());
        nested(kind, &c)
    }

    #[test]
    fn a_conntrack_entry_gives_both_tuples_and_counters() {
        // The client dialled a service (10.96.0.10:8080), DNATed to the pod.
        let mut a = ct_tuple_attr(CTA_TUPLE_ORIG, [10, 65, 1, 9], [10, 96, 0, 10], 40000, 8080);
        a.extend(ct_tuple_attr(
            CTA_TUPLE_REPLY,
            [10, 65, 0, 2],
            [10, 65, 1, 9],
            80,
            40000,
        ));
        a.extend(counters(CTA_COUNTERS_ORIG, 6, 600));
        a.extend(counters(CTA_COUNTERS_REPLY, 4, 4000));
        let e = parse_ct(&a).unwrap();
        assert_eq!(
            (e.orig_packets, e.orig_bytes, e.reply_packets, e.reply_bytes),
            (6, 600, 4, 4000)
        );
        let t = e.policy_tuple();
        assert_eq!(
            (t.src.to_string(), t.src_port, t.dst.to_string(), t.dst_port),
            ("10.65.1.9".into(), 40000, "10.65.0.2".into(), 80)
        );
        // Without counters (accounting off): zeros. Without a tuple: nothing.
        assert_eq!(
            parse_ct(&a[..a.len() - 2 * counters(CTA_COUNTERS_ORIG, 0, 0).len()])
                .map(|e| e.orig_packets),
            Some(0)
        );
        assert_eq!(parse_ct(&counters(CTA_COUNTERS_ORIG, 1, 1)), None);
    }

    /// A network namespace entered by the calling thread (and the commands it starts); deleted
    /// on drop.
    struct Namespace(String);

    impl Namespace {
        fn enter(name: &str) -> Namespace {
            let ip = |args: &[&str]| {
                std::process::Command::new("ip")
                    .args(args)
                    .status()
                    .is_ok_and(|s| s.success())
            };
            let _ = ip(&["netns", "del", name]);
            assert!(
                ip(&["netns", "add", name]),
                "ip netns add {name} (needs root)"
            );
            let file = std::fs::File::open(format!("/run/netns/{name}")).expect("netns file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            assert!(ip(&["link", "set", "lo", "up"]));
            Namespace(name.to_owned())
        }
    }

    impl Drop for Namespace {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.0])
                .status();
        }
    }

    /// The kernel logs a new connection's first packet to group 1 with the rule's prefix, and
    /// conntrack counts both directions; aggregated, one record with the trace and the bytes.
    /// Needs root (a namespace of its own) and iptables.
    #[test]
    #[ignore = "needs root: cargo test -p dataplane-agent --lib -- --ignored flow_source"]
    fn a_tcp_connection_in_a_namespace_is_logged_and_counted() {
        use std::io::{Read, Write};

        use crate::flows::{FlowAggregator, FlowSettings, parse_prefix};
        let _ns = Namespace::enter("agent-flow-source-test");
        let ok = std::process::Command::new("iptables")
            .args([
                "-A",
                "INPUT",
                "-p",
                "tcp",
                "--dport",
                "18080",
                "-m",
                "conntrack",
                "--ctstate",
                "NEW",
                "-j",
                "NFLOG",
                "--nflog-group",
                "1",
                "--nflog-prefix",
                "API0|np/prod/web",
                "--nflog-size",
                "80",
            ])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "iptables");
        let mut source = KernelFlowSource::default();
        let mut events = Vec::new();
        source.read(&mut events).expect("open and first read");
        let accounting = std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_acct");
        assert_eq!(accounting.unwrap().trim(), "1");

        let listener = std::net::TcpListener::bind("127.0.0.1:18080").unwrap();
        let mut client = std::net::TcpStream::connect("127.0.0.1:18080").unwrap();
        let client_port = client.local_addr().unwrap().port();
        let (mut server, _) = listener.accept().unwrap();
        client.write_all(&[7u8; 1000]).unwrap();
        let mut got = [0u8; 1000];
        server.read_exact(&mut got).unwrap();
        server.write_all(&[9u8; 500]).unwrap();
        let mut back = [0u8; 500];
        client.read_exact(&mut back).unwrap();

        // The kernel batches logged packets for up to a second (nfnetlink_log's default).
        std::thread::sleep(std::time::Duration::from_millis(1300));
        let mut events = Vec::new();
        source.read(&mut events).expect("read");
        let tuple = Tuple {
            src: "127.0.0.1".parse().unwrap(),
            dst: "127.0.0.1".parse().unwrap(),
            src_port: client_port,
            dst_port: 18080,
            protocol: 6,
        };
        let logged: Vec<_> = events
            .iter()
            .filter(|e| matches!(e, FlowEvent::Nflog { .. }))
            .collect();
        assert_eq!(logged.len(), 1, "the SYN only: {events:?}");
        let FlowEvent::Nflog {
            group,
            prefix,
            tuple: t,
            len,
            ..
        } = logged[0]
        else {
            unreachable!()
        };
        assert_eq!(
            (*group, prefix.as_str(), *t, *len),
            (1, "API0|np/prod/web", tuple, 60)
        );
        let entry = events
            .iter()
            .find_map(|e| match e {
                FlowEvent::Conntrack { entry, .. } if entry.policy_tuple() == tuple => Some(*entry),
                _ => None,
            })
            .expect("the connection's conntrack entry");
        assert!(entry.new);
        // SYN, ACK, the data (and the ACK of the reply); bytes include the IP headers.
        assert!(entry.orig_packets >= 3, "{entry:?}");
        assert!(entry.orig_bytes >= 1000 + 3 * 40, "{entry:?}");
        assert!(entry.reply_bytes >= 500 + 2 * 40, "{entry:?}");

        let mut agg = FlowAggregator::new(FlowSettings::default());
        for e in &events {
            agg.on_event(e, |p| {
                let (_, id) = parse_prefix(p)?;
                Some(felix_proto::RuleRef {
                    tier: format!("{id:?}"),
                    ..Default::default()
                })
            });
        }
        let reports = agg.take_reports(now_secs() + 15, 100);
        let r = reports
            .iter()
            .flat_map(|r| &r.records)
            .find(|r| r.source_port == u32::from(client_port))
            .expect("a record of the connection");
        assert!(r.reporter_dest && r.allowed);
        assert_eq!(r.trace.len(), 1);
        assert_eq!(r.trace[0].action, "allow");
        assert_eq!(
            (r.packets_in, r.bytes_in, r.packets_out, r.bytes_out),
            (
                entry.orig_packets,
                entry.orig_bytes,
                entry.reply_packets,
                entry.reply_bytes
            )
        );
        assert_eq!((r.connections_started, r.connections_live), (1, 1));
        drop(client);
        drop(server);
    }

    #[test]
    fn dumps_are_diffed_into_new_seen_and_destroyed_within_the_memory_bound() {
        let entry = |port: u16, packets: u64| {
            let t = |a: [u8; 4], b: [u8; 4], sp, dp| Tuple {
                src: IpAddr::V4(a.into()),
                dst: IpAddr::V4(b.into()),
                src_port: sp,
                dst_port: dp,
                protocol: 6,
            };
            CtObservation {
                orig: t([10, 0, 0, 1], [10, 0, 0, 2], port, 80),
                reply: t([10, 0, 0, 2], [10, 0, 0, 1], 80, port),
                orig_packets: packets,
                orig_bytes: packets * 100,
                reply_packets: 0,
                reply_bytes: 0,
                new: false,
                destroyed: false,
            }
        };
        let seen = |out: &[FlowEvent]| -> Vec<(u16, u64, bool, bool)> {
            out.iter()
                .map(|e| match e {
                    FlowEvent::Conntrack { entry: c, .. } => {
                        (c.orig.src_port, c.orig_packets, c.new, c.destroyed)
                    }
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        let mut src = KernelFlowSource::new(2);
        let mut out = Vec::new();
        src.diff_dump(0, vec![entry(1, 1), entry(2, 1)], &mut out);
        assert_eq!(seen(&out), [(1, 1, true, false), (2, 1, true, false)]);
        out.clear();
        // 1 goes on, 2 is gone, 3 is new.
        src.diff_dump(5, vec![entry(1, 4), entry(3, 1)], &mut out);
        assert_eq!(
            seen(&out),
            [
                (1, 4, false, false),
                (3, 1, true, false),
                (2, 1, false, true)
            ]
        );
        out.clear();
        // Over the bound (2): 5 is not remembered, and not taken for gone or new later.
        src.diff_dump(10, vec![entry(1, 5), entry(3, 2), entry(5, 1)], &mut out);
        assert_eq!(
            seen(&out),
            [
                (1, 5, false, false),
                (3, 2, false, false),
                (5, 1, true, false)
            ]
        );
        out.clear();
        src.diff_dump(15, vec![entry(1, 6), entry(3, 3), entry(5, 2)], &mut out);
        assert_eq!(
            seen(&out),
            [
                (1, 6, false, false),
                (3, 3, false, false),
                (5, 2, false, false)
            ]
        );
    }

    #[test]
    fn acks_errors_and_done_are_told_apart() {
        let mut buf = message(NLMSG_ERROR, 0, 1, 0, 0, &[]);
        // An error message's body starts with the code (-EPERM), where nfgenmsg would be.
        buf[16..20].copy_from_slice(&(-1i32).to_ne_bytes());
        buf.extend(message(NLMSG_DONE, 0, 1, 0, 0, &[]));
        assert_eq!(messages(&buf), [Msg::Error(-1), Msg::Done]);
    }
}
