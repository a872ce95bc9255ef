//! Asks the kernel whether an IPv4 address is in an IP set, over the ipset netlink protocol
//! (nfnetlink subsystem `NFNL_SUBSYS_IPSET`, command `IPSET_CMD_TEST`): one datagram each way
//! on a socket kept open, a few microseconds, where spawning `ipset test` costs milliseconds.
//! The socket belongs to the network namespace of the thread that opens it.

use std::io;
use std::net::Ipv4Addr;

use dataplane_agent::driver::linux::bench::attr;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

/// `NFNL_SUBSYS_IPSET << 8 | IPSET_CMD_TEST`.
const MSG_TYPE: u16 = (6 << 8) | 11;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_F_NET_BYTEORDER: u16 = 0x4000;
/// `IPSET_PROTOCOL` of the kernel's `ip_set.h` (the kernel accepts 6 and 7).
const IPSET_PROTOCOL: u8 = 7;
const IPSET_ATTR_PROTOCOL: u16 = 1;
const IPSET_ATTR_SETNAME: u16 = 2;
const IPSET_ATTR_DATA: u16 = 7;
const IPSET_ATTR_IP: u16 = 1;
const IPSET_ATTR_IPADDR_IPV4: u16 = 1;
/// The kernel's answer to a test of an element that is not in the set (`-IPSET_ERR_EXIST`).
const IPSET_ERR_EXIST: i32 = 4096 + 7;
const AF_INET: u8 = 2;

/// The `IPSET_CMD_TEST` request for `ip` in `set` (sequence number 0; set per send).
pub fn test_request(set: &str, ip: Ipv4Addr) -> Vec<u8> {
    let mut body = vec![AF_INET, 0, 0, 0]; // nfgenmsg: family, version 0, res_id 0
    attr(&mut body, IPSET_ATTR_PROTOCOL, &[IPSET_PROTOCOL]);
    let mut name = set.as_bytes().to_vec();
    name.push(0);
    attr(&mut body, IPSET_ATTR_SETNAME, &name);
    let mut addr = Vec::new();
    attr(
        &mut addr,
        IPSET_ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER,
        &ip.octets(),
    );
    let mut data = Vec::new();
    attr(&mut data, IPSET_ATTR_IP | NLA_F_NESTED, &addr);
    attr(&mut body, IPSET_ATTR_DATA | NLA_F_NESTED, &data);
    let len = u32::try_from(16 + body.len()).expect("small message");
    let mut msg = Vec::with_capacity(len as usize);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&MSG_TYPE.to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // sequence number
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
    msg.extend_from_slice(&body);
    msg
}

/// The answer to request `seq` in a received datagram: `Some(Ok(true))` in the set,
/// `Some(Ok(false))` not in it, `Some(Err)` another error, `None` not the answer to `seq`.
pub fn parse_answer(datagram: &[u8], seq: u32) -> Option<io::Result<bool>> {
    let mut rest = datagram;
    while rest.len() >= 20 {
        let len = u32::from_ne_bytes(rest[0..4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(rest[4..6].try_into().ok()?);
        let got_seq = u32::from_ne_bytes(rest[8..12].try_into().ok()?);
        if kind == NLMSG_ERROR && got_seq == seq {
            let code = i32::from_ne_bytes(rest[16..20].try_into().ok()?);
            return Some(match -code {
                0 => Ok(true),
                IPSET_ERR_EXIST => Ok(false),
                e if e > 0 && e < 4096 => Err(io::Error::from_raw_os_error(e)),
                e => Err(io::Error::other(format!("ipset netlink error {e}"))),
            });
        }
        let step = len.div_ceil(4) * 4;
        if step == 0 || step > rest.len() {
            break;
        }
        rest = &rest[step..];
    }
    None
}

/// A netlink socket asking the kernel whether one address is in one set.
pub struct IpsetTester {
    socket: Socket,
    request: Vec<u8>,
    buf: Vec<u8>,
    seq: u32,
}

impl IpsetTester {
    /// Opens the socket (in the calling thread's network namespace).
    pub fn new(set: &str, ip: Ipv4Addr) -> io::Result<IpsetTester> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(IpsetTester {
            socket,
            request: test_request(set, ip),
            buf: Vec::with_capacity(8192),
            seq: 0,
        })
    }

    /// Whether the address is in the set now.
    pub fn test(&mut self) -> io::Result<bool> {
        self.seq = self.seq.wrapping_add(1);
        self.request[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        self.socket.send(&self.request, 0)?;
        loop {
            self.buf.clear();
            self.socket.recv(&mut self.buf, 0)?;
            if let Some(answer) = parse_answer(&self.buf, self.seq) {
                return answer;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_laid_out_as_the_kernel_parses_it() {
        let m = test_request("cali40s:x", Ipv4Addr::new(10, 67, 0, 1));
        assert!(m.len().is_multiple_of(4));
        assert_eq!(
            u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), 0x060b);
        assert_eq!(u16::from_ne_bytes(m[6..8].try_into().unwrap()), 5);
        assert_eq!(&m[16..20], &[2, 0, 0, 0]);
        // protocol attribute: len 5, type 1, value 7, padded
        assert_eq!(&m[20..28], &[5, 0, 1, 0, 7, 0, 0, 0]);
        // set name: len 4 + 10 (NUL included), type 2
        assert_eq!(&m[28..32], &[14, 0, 2, 0]);
        assert_eq!(&m[32..42], b"cali40s:x\0");
        // data (nested) → ip (nested) → IPv4 in network order
        let data = &m[44..];
        assert_eq!(
            data,
            &[16, 0, 7, 0x80, 12, 0, 1, 0x80, 8, 0, 1, 0x40, 10, 67, 0, 1]
        );
    }

    fn answer(seq: u32, code: i32) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&36u32.to_ne_bytes());
        m.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&code.to_ne_bytes());
        m.extend_from_slice(&[0; 16]);
        m
    }

    #[test]
    fn answers_are_read_by_sequence_number() {
        assert!(parse_answer(&answer(3, 0), 3).unwrap().unwrap());
        assert!(!parse_answer(&answer(3, -4103), 3).unwrap().unwrap());
        assert!(parse_answer(&answer(3, -2), 3).unwrap().is_err());
        assert!(parse_answer(&answer(2, 0), 3).is_none());
    }
}
