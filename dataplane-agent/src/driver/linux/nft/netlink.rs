//! Set and map element changes straight over nfnetlink: one batch (`NFNL_MSG_BATCH_BEGIN`,
//! `NFT_MSG_NEWSETELEM`/`NFT_MSG_DELSETELEM` …, `NFNL_MSG_BATCH_END`) that the kernel commits as
//! one transaction, as `nft -f` would, without `nft`'s cost of loading the whole ruleset into
//! its cache first (which grows with the ruleset: ~16 ms at 2.8k rules, ~450 ms at 211k).
//!
//! Elements of every kind go this way: addresses, address·protocol·port, interface verdicts,
//! and networks of interval sets, which the kernel holds as a start element and an end element
//! (the first address after the network, flagged as an interval end; none when the network
//! reaches the top of the address space), as `nft` sends them. Every structural change stays
//! with `nft -f`. [`ElementWriter`] is the seam; tests use a recording fake.

use std::io;
use std::net::IpAddr;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::TABLE;
use crate::driver::linux::rules::IpVersion;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFT_SET_ELEM_INTERVAL_END: u32 = 1;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NFT_GOTO: i32 = -4;
const NFT_JUMP: i32 = -3;
const IFNAMSIZ: usize = 16;

/// One set's (or map's) elements to add or delete, as the writer prints them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElementOp {
    pub version: IpVersion,
    pub set: String,
    pub add: bool,
    /// The set has `flags interval`: each element is a network (start and end elements).
    pub interval: bool,
    pub elems: Vec<String>,
}

/// Where element batches go (the seam).
pub trait ElementWriter: Send {
    /// Applies every op in one kernel transaction; on error nothing of it applied.
    fn write(&mut self, ops: &[ElementOp]) -> io::Result<()>;
}

/// A netlink socket of the agent's network namespace, opened on first use.
#[derive(Default)]
pub struct NetlinkElements {
    socket: Option<Socket>,
    seq: u32,
    buf: Vec<u8>,
}

impl ElementWriter for NetlinkElements {
    fn write(&mut self, ops: &[ElementOp]) -> io::Result<()> {
        if self.socket.is_none() {
            let mut s = Socket::new(NETLINK_NETFILTER)?;
            s.bind_auto()?;
            s.connect(&SocketAddr::new(0, 0))?;
            self.socket = Some(s);
        }
        self.seq = self.seq.wrapping_add(1000);
        let (batch, acks) = encode(ops, self.seq)?;
        let socket = self.socket.as_mut().expect("opened above");
        if let Err(e) = socket.send(&batch, 0) {
            self.socket = None;
            return Err(e);
        }
        // One ack per element message; the first error is the batch's (nothing applied).
        let mut pending = acks;
        let mut first_error = None;
        self.buf.resize(1 << 16, 0);
        while pending > 0 {
            let n = match socket.recv(&mut &mut self.buf[..], 0) {
                Ok(n) => n,
                Err(e) => {
                    self.socket = None;
                    return Err(e);
                }
            };
            let mut off = 0;
            while off + 16 <= n {
                let len =
                    u32::from_ne_bytes(self.buf[off..off + 4].try_into().expect("4")) as usize;
                let kind = u16::from_ne_bytes(self.buf[off + 4..off + 6].try_into().expect("2"));
                if len < 16 || off + len > n {
                    break;
                }
                if kind == NLMSG_ERROR && len >= 20 {
                    let code =
                        i32::from_ne_bytes(self.buf[off + 16..off + 20].try_into().expect("4"));
                    if code != 0 && first_error.is_none() {
                        first_error = Some(io::Error::from_raw_os_error(-code));
                    }
                    pending -= 1;
                }
                off += (len + 3) & !3;
            }
            if first_error.is_some() {
                // The kernel aborts the batch at the first error; later messages get no ack.
                break;
            }
        }
        match first_error {
            Some(e) => {
                // Drop the socket: unread acks must not be taken for the next batch's.
                self.socket = None;
                Err(e)
            }
            None => Ok(()),
        }
    }
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

fn nested(out: &mut Vec<u8>, kind: u16, body: impl FnOnce(&mut Vec<u8>)) -> io::Result<()> {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    body(out);
    let len = u16::try_from(out.len() - start)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "attribute too long"))?;
    out[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    out[start + 2..start + 4].copy_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    Ok(())
}

fn cstr(s: &str) -> Vec<u8> {
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

fn key_elem(out: &mut Vec<u8>, key: &[u8], flags: u32) -> io::Result<()> {
    nested(out, NFTA_LIST_ELEM, |out| {
        let _ = nested(out, NFTA_SET_ELEM_KEY, |out| {
            attr(out, NFTA_DATA_VALUE, key)
        });
        if flags != 0 {
            attr(out, NFTA_SET_ELEM_FLAGS, &flags.to_be_bytes());
        }
    })
}

/// One network of an interval set: its start element, then its end element.
fn interval_element(out: &mut Vec<u8>, e: &str) -> io::Result<()> {
    let (start, end) = interval_keys(e)?;
    key_elem(out, &start, 0)?;
    if let Some(end) = end {
        key_elem(out, &end, NFT_SET_ELEM_INTERVAL_END)?;
    }
    Ok(())
}

/// One element's attributes: the key (and the verdict of a map element).
fn element(out: &mut Vec<u8>, e: &str) -> io::Result<()> {
    let mut key = Vec::new();
    let mut verdict = None;
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
        verdict = Some((code, chain.to_owned()));
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
    let Some((code, chain)) = verdict else {
        return key_elem(out, &key, 0);
    };
    nested(out, NFTA_LIST_ELEM, |out| {
        let _ = nested(out, NFTA_SET_ELEM_KEY, |out| {
            attr(out, NFTA_DATA_VALUE, &key)
        });
        let _ = nested(out, NFTA_SET_ELEM_DATA, |out| {
            let _ = nested(out, NFTA_DATA_VERDICT, |out| {
                attr(out, NFTA_VERDICT_CODE, &code.to_be_bytes());
                attr(out, NFTA_VERDICT_CHAIN, &cstr(&chain));
            });
        });
    })
}

/// Elements per message (keeps each message well under the 64 KiB attribute limit).
const ELEMENTS_PER_MESSAGE: usize = 500;

/// The batch for `ops` and the number of acks to expect.
pub fn encode(ops: &[ElementOp], seq: u32) -> io::Result<(Vec<u8>, usize)> {
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
    let mut acks = 0;
    for op in ops {
        let family = match op.version {
            IpVersion::V4 => 2,
            IpVersion::V6 => 10,
        };
        let (kind, flags) = if op.add {
            (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE)
        } else {
            (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK)
        };
        for chunk in op.elems.chunks(ELEMENTS_PER_MESSAGE) {
            let mut body = Vec::new();
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
            seq = seq.wrapping_add(1);
            message(
                &mut out,
                (NFNL_SUBSYS_NFTABLES << 8) | kind,
                flags,
                seq,
                family,
                0,
                &body,
            );
            acks += 1;
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
    Ok((out, acks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_encode_as_the_kernel_reads_them() {
        let ops = [ElementOp {
            version: IpVersion::V4,
            set: "cali40n-x".into(),
            add: true,
            interval: false,
            elems: vec!["10.0.0.1 . tcp . 80".into()],
        }];
        let (batch, acks) = encode(&ops, 7).unwrap();
        assert_eq!(acks, 1);
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
        let ops = [ElementOp {
            version: IpVersion::V6,
            set: "filter-cali-to-wl-dispatch".into(),
            add: false,
            interval: false,
            elems: vec!["\"cali1\" : goto filter-cali-tw-cali1".into()],
        }];
        let (batch, _) = encode(&ops, 1).unwrap();
        let mut key = b"cali1".to_vec();
        key.resize(16, 0);
        assert!(batch.windows(16).any(|w| w == key));
        assert!(batch.windows(4).any(|w| w == NFT_GOTO.to_be_bytes()));
        let bad_ops = [ElementOp {
            version: IpVersion::V4,
            set: "s".into(),
            add: true,
            interval: false,
            elems: vec!["not-an-address".into()],
        }];
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
        let ops = [ElementOp {
            version: IpVersion::V4,
            set: "cali40s-x".into(),
            add: true,
            interval: true,
            elems: vec!["10.0.0.0/24".into()],
        }];
        let (batch, _) = encode(&ops, 1).unwrap();
        assert!(
            batch
                .windows(4)
                .any(|w| w == NFT_SET_ELEM_INTERVAL_END.to_be_bytes()),
            "the end element is flagged"
        );
    }
}
