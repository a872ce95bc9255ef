//! The interface monitor: an rtnetlink multicast subscription (links, addresses and routes)
//! plus an initial dump, kept in [`Interfaces`], shared with the driver. Every change wakes the session
//! (through [`Interfaces::changed`]) so routes and endpoint status follow a link at once; no
//! polling.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;

use futures::{StreamExt as _, TryStreamExt as _};
use rtnetlink::MulticastGroup;
use rtnetlink::packet_core::NetlinkPayload;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage, RouteType};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::netlink::{LinkInfo, link_info};

#[derive(Debug, Default)]
struct State {
    links: BTreeMap<String, LinkInfo>,
    /// ifindex → addresses.
    addrs: BTreeMap<u32, BTreeSet<IpAddr>>,
    /// Default routes: (out interface, IPv6, table, metric), one per next hop.
    default_routes: BTreeSet<(u32, bool, u32, u32)>,
    /// The monitor has done its initial dump.
    ready: bool,
}

/// What the monitor knows about the host's interfaces.
#[derive(Debug, Default)]
pub struct Interfaces {
    state: Mutex<State>,
    changed: Arc<Notify>,
}

impl Interfaces {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Notified on every change.
    pub fn changed(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    pub fn get(&self, name: &str) -> Option<LinkInfo> {
        self.state.lock().links.get(name).cloned()
    }

    /// The name of the interface holding one of `ips`, if any.
    pub fn by_address(&self, ips: &[IpAddr]) -> Option<String> {
        let st = self.state.lock();
        let index = st
            .addrs
            .iter()
            .find(|(_, set)| ips.iter().any(|ip| set.contains(ip)))
            .map(|(i, _)| *i)?;
        st.links
            .values()
            .find(|l| l.index == index)
            .map(|l| l.name.clone())
    }

    /// Whether the interface holds an address other than an IPv6 link-local one: the host's
    /// own interfaces do, a workload's host-side veth never does (Calico routes to it and
    /// answers ARP by proxy). The agent never takes over such an interface.
    pub fn has_host_addresses(&self, index: u32) -> bool {
        let st = self.state.lock();
        st.addrs.get(&index).is_some_and(|set| {
            set.iter().any(|ip| match ip {
                IpAddr::V4(_) => true,
                IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
            })
        })
    }

    /// Whether a default route (any table, either family) leaves through the interface: the
    /// host's uplink, which the agent never takes over.
    pub fn carries_default_route(&self, index: u32) -> bool {
        let st = self.state.lock();
        st.default_routes.iter().any(|(oif, ..)| *oif == index)
    }

    /// Why the interface is the host's rather than a workload's, if it is.
    pub fn host_interface_reason(&self, index: u32) -> Option<&'static str> {
        if self.carries_default_route(index) {
            Some("the host's default route leaves through it")
        } else if self.has_host_addresses(index) {
            Some("it holds host addresses")
        } else {
            None
        }
    }

    /// Host interfaces (see [`Interfaces::host_interface_reason`]) whose name starts with
    /// `prefix`, with the reason.
    pub fn host_interfaces_matching(&self, prefix: &str) -> Vec<(String, &'static str)> {
        let links: Vec<LinkInfo> = {
            let st = self.state.lock();
            st.links
                .values()
                .filter(|l| l.name.starts_with(prefix))
                .cloned()
                .collect()
        };
        links
            .into_iter()
            .filter_map(|l| self.host_interface_reason(l.index).map(|r| (l.name, r)))
            .collect()
    }

    /// Records a route from a dump or an event; only default routes are kept.
    pub fn route(&self, msg: &RouteMessage, present: bool) {
        if msg.header.destination_prefix_length != 0 || msg.header.kind != RouteType::Unicast {
            return;
        }
        let v6 = msg.header.address_family == AddressFamily::Inet6;
        let mut table = u32::from(msg.header.table);
        let mut metric = 0;
        let mut oifs = Vec::new();
        for a in &msg.attributes {
            match a {
                RouteAttribute::Table(t) => table = *t,
                RouteAttribute::Priority(p) => metric = *p,
                RouteAttribute::Oif(i) => oifs.push(*i),
                RouteAttribute::MultiPath(hops) => {
                    oifs.extend(hops.iter().map(|h| h.interface_index))
                }
                _ => {}
            }
        }
        let mut st = self.state.lock();
        let mut changed = false;
        for oif in oifs {
            let key = (oif, v6, table, metric);
            changed |= if present {
                st.default_routes.insert(key)
            } else {
                st.default_routes.remove(&key)
            };
        }
        drop(st);
        if changed {
            debug!(present, v6, "default route update");
            self.changed.notify_one();
        }
    }

    pub fn is_ready(&self) -> bool {
        self.state.lock().ready
    }

    /// Records a link (new or changed).
    pub fn upsert(&self, link: LinkInfo) {
        let mut st = self.state.lock();
        // An index can be reused under another name: drop the stale entry.
        st.links
            .retain(|n, l| !(l.index == link.index && *n != link.name));
        if st.links.get(&link.name) == Some(&link) {
            return;
        }
        debug!(iface = %link.name, index = link.index, oper_up = link.oper_up, "interface update");
        st.links.insert(link.name.clone(), link);
        drop(st);
        self.changed.notify_one();
    }

    pub fn remove(&self, name: &str) {
        let mut st = self.state.lock();
        if let Some(l) = st.links.remove(name) {
            st.addrs.remove(&l.index);
            drop(st);
            debug!(iface = %name, "interface gone");
            self.changed.notify_one();
        }
    }

    pub(super) fn address(&self, msg: &AddressMessage, present: bool) {
        let ip = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        let Some(ip) = ip else { return };
        let mut st = self.state.lock();
        let set = st.addrs.entry(msg.header.index).or_default();
        let changed = if present {
            set.insert(ip)
        } else {
            set.remove(&ip)
        };
        drop(st);
        if changed {
            self.changed.notify_one();
        }
    }

    /// Marks the initial dump done (what the monitor does; for tests that feed links).
    #[cfg(any(test, feature = "test-util"))]
    pub fn mark_ready_for_tests(&self) {
        self.set_ready();
    }

    fn set_ready(&self) {
        self.state.lock().ready = true;
        self.changed.notify_one();
    }
}

/// Subscribes to link and address events, dumps the current links and addresses, then keeps
/// `ifaces` up to date until the process ends. Must be called inside a tokio runtime.
pub(crate) fn spawn_monitor(ifaces: Arc<Interfaces>) -> std::io::Result<()> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|e| std::io::Error::other(format!("no async runtime: {e}")))?;
    let (conn, handle, mut messages) = rtnetlink::new_multicast_connection(&[
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv6Ifaddr,
        MulticastGroup::Ipv4Route,
        MulticastGroup::Ipv6Route,
    ])?;
    runtime.spawn(conn);
    runtime.spawn(async move {
        // Subscribed first, so nothing between the dump and the events is lost.
        match handle.link().get().execute().try_collect::<Vec<_>>().await {
            Ok(links) => {
                for l in links.iter().filter_map(link_info) {
                    ifaces.upsert(l);
                }
            }
            Err(error) => warn!(%error, "interface dump failed"),
        }
        match handle
            .address()
            .get()
            .execute()
            .try_collect::<Vec<_>>()
            .await
        {
            Ok(addrs) => {
                for a in &addrs {
                    ifaces.address(a, true);
                }
            }
            Err(error) => warn!(%error, "address dump failed"),
        }
        for query in [
            rtnetlink::RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
            rtnetlink::RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
        ] {
            match handle
                .route()
                .get(query)
                .execute()
                .try_collect::<Vec<_>>()
                .await
            {
                Ok(routes) => routes.iter().for_each(|r| ifaces.route(r, true)),
                Err(error) => warn!(%error, "route dump failed"),
            }
        }
        ifaces.set_ready();
        info!("interface monitor running");
        while let Some((msg, _)) = messages.next().await {
            let NetlinkPayload::InnerMessage(inner) = msg.payload else {
                continue;
            };
            match inner {
                RouteNetlinkMessage::NewLink(l) => {
                    if let Some(info) = link_info(&l) {
                        ifaces.upsert(info);
                    }
                }
                RouteNetlinkMessage::DelLink(l) => {
                    if let Some(info) = link_info(&l) {
                        ifaces.remove(&info.name);
                    }
                }
                RouteNetlinkMessage::NewAddress(a) => ifaces.address(&a, true),
                RouteNetlinkMessage::DelAddress(a) => ifaces.address(&a, false),
                RouteNetlinkMessage::NewRoute(r) => ifaces.route(&r, true),
                RouteNetlinkMessage::DelRoute(r) => ifaces.route(&r, false),
                _ => {}
            }
        }
        warn!("interface monitor stream ended");
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upserts_notify_only_on_change_and_reused_indexes_replace_names() {
        let ifaces = Interfaces::new();
        let link = |name: &str, index, up| LinkInfo {
            index,
            name: name.into(),
            oper_up: up,
        };
        ifaces.upsert(link("cali1", 5, true));
        assert!(ifaces.get("cali1").unwrap().oper_up);
        ifaces.upsert(link("cali1", 5, false));
        assert!(!ifaces.get("cali1").unwrap().oper_up);
        // Index 5 now belongs to another name.
        ifaces.upsert(link("cali2", 5, true));
        assert!(ifaces.get("cali1").is_none());
        ifaces.remove("cali2");
        assert!(ifaces.get("cali2").is_none());
    }
}
