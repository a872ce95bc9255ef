//! The routes manager: routes, static neighbours and interface sysctls for workloads, and the
//! interface monitor they follow.
//!
//! Contract: nothing here reads the stream itself; [`RouteManager::apply`] takes the workload
//! endpoints the endpoint manager holds and makes the kernel match: a /32 or /128 route per
//! address of an oper-up workload interface (our protocol number marks them; stale ones of ours
//! are swept), a static neighbour per address when the MAC is known, and Calico's per-interface
//! sysctls once per interface index. Before the monitor's first dump it changes nothing (not
//! knowing the interfaces is no reason to delete every route), and an interface that holds
//! host addresses or carries a default route is never configured as a workload's.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use felix_proto::WorkloadEndpoint;
use tracing::{debug, warn};

use super::LinuxOptions;
use super::interfaces::{self, Interfaces};
use super::netlink::{self, Netlink};
use super::routes::{RouteError, Routes};
use super::rules::IpVersion;
use super::sysctl::{self, Sysctl};
use super::validate;
use crate::driver::DriverError;
use crate::message::WorkloadEndpointKey;

pub(crate) struct RouteManager {
    /// Interfaces as the monitor sees them.
    ifaces: Arc<Interfaces>,
    /// Spawn the rtnetlink monitor and connect netlink at the first apply (false when seams
    /// were injected).
    pub(super) start_netlink: bool,
    netlink: Option<Box<dyn Netlink>>,
    pub(super) sysctl: Box<dyn Sysctl>,
    routes: Routes,
    /// Interfaces already given Calico's sysctls: name → ifindex at the time.
    configured_ifaces: HashMap<String, u32>,
    neighbours: HashSet<(u32, IpAddr, [u8; 6])>,
    globals_set: bool,
    /// Interfaces refused at programming time (host addresses on them), to warn once.
    refused_ifaces: HashSet<String>,
}

impl RouteManager {
    pub(crate) fn new(
        ifaces: Arc<Interfaces>,
        netlink: Option<Box<dyn Netlink>>,
        sysctl: Box<dyn Sysctl>,
        route_protocol: u8,
        versions: Vec<IpVersion>,
    ) -> Self {
        Self {
            ifaces,
            start_netlink: false,
            netlink,
            sysctl,
            routes: Routes::new(route_protocol, versions),
            configured_ifaces: HashMap::new(),
            neighbours: HashSet::new(),
            globals_set: false,
            refused_ifaces: HashSet::new(),
        }
    }

    /// The running kernel's release, for feature detection.
    pub(crate) fn kernel_release(&self) -> Option<String> {
        self.sysctl.read("kernel/osrelease").ok()
    }

    /// Starts the interface monitor and opens netlink (once, inside the runtime).
    pub(crate) fn ensure_netlink(&mut self) -> Result<(), DriverError> {
        if !self.start_netlink {
            return Ok(());
        }
        interfaces::spawn_monitor(self.ifaces.clone()).map_err(|source| DriverError::Netlink {
            what: "interface monitor",
            source,
        })?;
        self.netlink = Some(Box::new(netlink::RtNetlink::connect().map_err(
            |source| DriverError::Netlink {
                what: "netlink",
                source,
            },
        )?));
        self.start_netlink = false;
        Ok(())
    }

    /// Routes, neighbours and interface sysctls for the workloads whose interfaces are up.
    pub(crate) fn apply(
        &mut self,
        weps: &BTreeMap<WorkloadEndpointKey, WorkloadEndpoint>,
        opts: &LinuxOptions,
    ) -> Result<(), RouteError> {
        let Some(nl) = self.netlink.as_mut() else {
            return Ok(());
        };
        // Until the monitor's first dump we do not know which interfaces exist: changing
        // nothing is better than deleting every route.
        if !self.ifaces.is_ready() {
            return Ok(());
        }
        if !self.globals_set {
            let mut globals = vec![("net/ipv4/ip_forward", "1")];
            if opts.ipv6 {
                globals.push(("net/ipv6/conf/all/forwarding", "1"));
            }
            for (k, v) in globals {
                if let Err(error) = self.sysctl.write(k, v) {
                    warn!(%error, key = k, "cannot set sysctl");
                }
            }
            self.globals_set = true;
        }
        let mut desired = BTreeSet::new();
        let mut present = HashSet::new();
        for wep in weps.values() {
            let Some(link) = self.ifaces.get(&wep.name) else {
                continue;
            };
            // Checked on receipt too; here against the prefixes in force now, and against the
            // interface itself: one holding host addresses or the default route is the
            // host's, never a workload's.
            let refusal =
                validate::workload_interface("name", &wep.name, &opts.statics.workload_prefixes)
                    .map_err(|e| e.to_string())
                    .err()
                    .or_else(|| {
                        self.ifaces
                            .host_interface_reason(link.index)
                            .map(str::to_owned)
                    });
            if let Some(reason) = refusal {
                if self.refused_ifaces.insert(wep.name.clone()) {
                    warn!(iface = %wep.name, %reason, "not configuring this interface for a workload: no sysctls, routes or neighbours");
                }
                continue;
            }
            self.refused_ifaces.remove(&wep.name);
            present.insert(wep.name.clone());
            if self.configured_ifaces.get(&wep.name) != Some(&link.index) {
                for (k, v) in sysctl::workload_interface_settings(&wep.name, opts.ipv6) {
                    if let Err(error) = self.sysctl.write(&k, v) {
                        warn!(%error, iface = %wep.name, "cannot configure workload interface");
                    }
                }
                self.configured_ifaces.insert(wep.name.clone(), link.index);
            }
            let mac = validate::parse_mac(&wep.mac);
            let nets = wep
                .ipv4_nets
                .iter()
                .chain(if opts.ipv6 { &wep.ipv6_nets[..] } else { &[] });
            for net in nets {
                let Some(ip) = net.split('/').next().and_then(|a| a.parse::<IpAddr>().ok()) else {
                    warn!(net = %net, iface = %wep.name, "unparsable endpoint address; no route");
                    continue;
                };
                if link.oper_up {
                    desired.insert(netlink::RouteEntry {
                        dst: ip,
                        prefix: if ip.is_ipv4() { 32 } else { 128 },
                        ifindex: link.index,
                    });
                }
                if let Some(mac) = mac
                    && self.neighbours.insert((link.index, ip, mac))
                    && let Err(error) = nl.set_neighbour(link.index, ip, mac)
                {
                    warn!(%error, %ip, iface = %wep.name, "cannot set static neighbour");
                    self.neighbours.remove(&(link.index, ip, mac));
                }
            }
        }
        self.configured_ifaces.retain(|n, _| present.contains(n));
        let st = self.routes.apply(nl.as_mut(), &desired)?;
        if st != Default::default() {
            debug!(?st, "routes programmed");
        }
        Ok(())
    }

    /// Routes of ours.
    pub(crate) fn count(&self) -> usize {
        self.routes.count()
    }

    /// The next apply reads the routes back and re-asserts interface settings and neighbours.
    pub(crate) fn invalidate(&mut self) {
        self.routes.invalidate();
        self.configured_ifaces.clear();
        self.neighbours.clear();
    }
}
