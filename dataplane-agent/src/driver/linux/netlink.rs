//! The rtnetlink seam: links, routes and neighbours. [`Netlink`] is what the driver calls
//! (synchronously, from `apply`); [`RtNetlink`] talks to the kernel through the rtnetlink crate
//! on the agent's tokio runtime; `FakeNetlink` (tests and the `test-util` feature) keeps an
//! in-memory routing table.

#[cfg(any(test, feature = "test-util"))]
use std::collections::BTreeSet;
use std::io;
use std::net::IpAddr;

use futures::TryStreamExt as _;
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, LinkMessage, State};
use rtnetlink::packet_route::neighbour::NeighbourState;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
};
use rtnetlink::{Handle, RouteMessageBuilder};

use super::rules::IpVersion;

/// An interface as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    pub index: u32,
    pub name: String,
    /// Operationally up (carrier): a veth whose peer is down is not.
    pub oper_up: bool,
}

/// A route to one address (or prefix) out of one interface, in the main table.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouteEntry {
    pub dst: IpAddr,
    pub prefix: u8,
    pub ifindex: u32,
}

/// Routes, links and neighbours.
pub trait Netlink: Send {
    /// Every link.
    fn links(&mut self) -> io::Result<Vec<LinkInfo>>;
    /// Main-table routes of one family carrying route protocol `protocol`.
    fn routes(&mut self, v: IpVersion, protocol: u8) -> io::Result<Vec<RouteEntry>>;
    /// Adds or replaces a route, tagged with `protocol`.
    fn add_route(&mut self, r: &RouteEntry, protocol: u8) -> io::Result<()>;
    fn del_route(&mut self, r: &RouteEntry, protocol: u8) -> io::Result<()>;
    /// Adds or replaces many routes; the result of each, in order. The default sends them one
    /// by one; the real kernel pipelines them.
    fn add_routes(&mut self, routes: &[RouteEntry], protocol: u8) -> Vec<io::Result<()>> {
        routes.iter().map(|r| self.add_route(r, protocol)).collect()
    }
    /// A permanent neighbour entry (static ARP / NDP).
    fn set_neighbour(&mut self, ifindex: u32, ip: IpAddr, mac: [u8; 6]) -> io::Result<()>;
}

fn nl_err(e: rtnetlink::Error) -> io::Error {
    io::Error::other(e.to_string())
}

/// Whether a link message says the link is operationally up.
pub(crate) fn link_info(msg: &LinkMessage) -> Option<LinkInfo> {
    let mut name = None;
    let mut oper = None;
    for a in &msg.attributes {
        match a {
            LinkAttribute::IfName(n) => name = Some(n.clone()),
            LinkAttribute::OperState(s) => oper = Some(*s),
            _ => {}
        }
    }
    let flags = msg.header.flags;
    let admin_and_carrier = flags.contains(LinkFlags::Up) && flags.contains(LinkFlags::LowerUp);
    let oper_up = match oper {
        Some(State::Up) => true,
        // Some drivers never report an oper state: fall back to the flags.
        Some(State::Unknown) | None => admin_and_carrier,
        Some(_) => false,
    };
    Some(LinkInfo {
        index: msg.header.index,
        name: name?,
        oper_up,
    })
}

/// The real kernel, through rtnetlink on the current tokio runtime.
pub struct RtNetlink {
    handle: Handle,
    runtime: tokio::runtime::Handle,
}

impl RtNetlink {
    /// Opens a netlink connection; must be called inside a tokio runtime.
    pub fn connect() -> io::Result<Self> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| io::Error::other(format!("no async runtime for netlink: {e}")))?;
        let (conn, handle, _) = rtnetlink::new_connection()?;
        runtime.spawn(conn);
        Ok(Self { handle, runtime })
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        // apply runs under block_in_place on a runtime worker, where blocking on the runtime's
        // own handle is allowed.
        tokio::task::block_in_place(|| self.runtime.block_on(f))
    }

    fn route_message(r: &RouteEntry, protocol: u8) -> RouteMessage {
        let mut msg = match r.dst {
            IpAddr::V4(a) => RouteMessageBuilder::<std::net::Ipv4Addr>::new()
                .destination_prefix(a, r.prefix)
                .output_interface(r.ifindex)
                .protocol(RouteProtocol::from(protocol))
                .scope(RouteScope::Link)
                .build(),
            IpAddr::V6(a) => RouteMessageBuilder::<std::net::Ipv6Addr>::new()
                .destination_prefix(a, r.prefix)
                .output_interface(r.ifindex)
                .protocol(RouteProtocol::from(protocol))
                .build(),
        };
        msg.header.table = RouteHeader::RT_TABLE_MAIN;
        msg
    }
}

impl Netlink for RtNetlink {
    fn links(&mut self) -> io::Result<Vec<LinkInfo>> {
        let handle = self.handle.clone();
        self.block_on(async move {
            let msgs: Vec<LinkMessage> = handle
                .link()
                .get()
                .execute()
                .try_collect()
                .await
                .map_err(nl_err)?;
            Ok(msgs.iter().filter_map(link_info).collect())
        })
    }

    fn routes(&mut self, v: IpVersion, protocol: u8) -> io::Result<Vec<RouteEntry>> {
        let handle = self.handle.clone();
        self.block_on(async move {
            let query = match v {
                IpVersion::V4 => RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
                IpVersion::V6 => RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
            };
            let msgs: Vec<RouteMessage> = handle
                .route()
                .get(query)
                .execute()
                .try_collect()
                .await
                .map_err(nl_err)?;
            Ok(msgs
                .iter()
                .filter(|m| {
                    u8::from(m.header.protocol) == protocol
                        && m.header.table == RouteHeader::RT_TABLE_MAIN
                })
                .filter_map(|m| {
                    let mut dst = None;
                    let mut oif = None;
                    for a in &m.attributes {
                        match a {
                            RouteAttribute::Destination(RouteAddress::Inet(x)) => {
                                dst = Some(IpAddr::V4(*x))
                            }
                            RouteAttribute::Destination(RouteAddress::Inet6(x)) => {
                                dst = Some(IpAddr::V6(*x))
                            }
                            RouteAttribute::Oif(i) => oif = Some(*i),
                            _ => {}
                        }
                    }
                    Some(RouteEntry {
                        dst: dst?,
                        prefix: m.header.destination_prefix_length,
                        ifindex: oif?,
                    })
                })
                .collect())
        })
    }

    fn add_route(&mut self, r: &RouteEntry, protocol: u8) -> io::Result<()> {
        let handle = self.handle.clone();
        let msg = Self::route_message(r, protocol);
        self.block_on(async move {
            handle
                .route()
                .add(msg)
                .replace()
                .execute()
                .await
                .map_err(nl_err)
        })
    }

    fn del_route(&mut self, r: &RouteEntry, protocol: u8) -> io::Result<()> {
        let handle = self.handle.clone();
        let msg = Self::route_message(r, protocol);
        self.block_on(async move { handle.route().del(msg).execute().await.map_err(nl_err) })
    }

    fn add_routes(&mut self, routes: &[RouteEntry], protocol: u8) -> Vec<io::Result<()>> {
        use futures::StreamExt as _;
        let handle = self.handle.clone();
        let msgs: Vec<RouteMessage> = routes
            .iter()
            .map(|r| Self::route_message(r, protocol))
            .collect();
        // Many requests in flight on one socket instead of a round trip each.
        self.block_on(async move {
            futures::stream::iter(msgs)
                .map(|m| {
                    let handle = handle.clone();
                    async move {
                        handle
                            .route()
                            .add(m)
                            .replace()
                            .execute()
                            .await
                            .map_err(nl_err)
                    }
                })
                .buffered(128)
                .collect()
                .await
        })
    }

    fn set_neighbour(&mut self, ifindex: u32, ip: IpAddr, mac: [u8; 6]) -> io::Result<()> {
        let handle = self.handle.clone();
        self.block_on(async move {
            handle
                .neighbours()
                .add(ifindex, ip)
                .link_layer_address(&mac)
                .state(NeighbourState::Permanent)
                .replace()
                .execute()
                .await
                .map_err(nl_err)
        })
    }
}

/// An in-memory kernel routing table for tests.
#[cfg(any(test, feature = "test-util"))]
#[derive(Clone, Debug, Default)]
pub(crate) struct FakeNetlink {
    pub links: Vec<LinkInfo>,
    /// (route, protocol)
    pub routes: BTreeSet<(RouteEntry, u8)>,
    pub neighbours: BTreeSet<(u32, IpAddr, [u8; 6])>,
    pub writes: usize,
}

#[cfg(any(test, feature = "test-util"))]
impl Netlink for FakeNetlink {
    fn links(&mut self) -> io::Result<Vec<LinkInfo>> {
        Ok(self.links.clone())
    }
    fn routes(&mut self, v: IpVersion, protocol: u8) -> io::Result<Vec<RouteEntry>> {
        Ok(self
            .routes
            .iter()
            .filter(|(r, p)| *p == protocol && (r.dst.is_ipv6() == (v == IpVersion::V6)))
            .map(|(r, _)| r.clone())
            .collect())
    }
    fn add_route(&mut self, r: &RouteEntry, protocol: u8) -> io::Result<()> {
        if !self.links.iter().any(|l| l.index == r.ifindex) {
            return Err(io::Error::other("No such device"));
        }
        self.writes += 1;
        self.routes
            .retain(|(x, _)| !(x.dst == r.dst && x.prefix == r.prefix));
        self.routes.insert((r.clone(), protocol));
        Ok(())
    }
    fn del_route(&mut self, r: &RouteEntry, protocol: u8) -> io::Result<()> {
        self.writes += 1;
        if self.routes.remove(&(r.clone(), protocol)) {
            Ok(())
        } else {
            Err(io::Error::other("No such process"))
        }
    }
    fn set_neighbour(&mut self, ifindex: u32, ip: IpAddr, mac: [u8; 6]) -> io::Result<()> {
        self.writes += 1;
        self.neighbours
            .retain(|(i, a, _)| !(*i == ifindex && *a == ip));
        self.neighbours.insert((ifindex, ip, mac));
        Ok(())
    }
}
