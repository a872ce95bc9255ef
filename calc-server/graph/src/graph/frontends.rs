//! Kubernetes Services by the addresses clients reach them at, for naming a flow's destination
//! service (flow logs), as Felix's service lookups cache answers: a Service's cluster IPs and
//! external IPs with each of its ports, and its node ports.
//!
//! Contract: [`Frontends::at`] answers the Service port reached at `(ip, port, protocol)`,
//! [`Frontends::node_port`] the one a node port leads to; when several Services claim one
//! frontend, the smallest (namespace, name, port name) answers, so the answer does not depend
//! on the order objects arrived in. A headless Service (`None`) and addresses that do not parse
//! add nothing. Nothing here reaches a dataplane.

use std::collections::BTreeSet;
use std::net::IpAddr;

use rustc_hash::FxHashMap;

use super::Key;
use crate::model::ServiceSpec;

/// One port of a Service, as a flow names it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortRef {
    pub namespace: String,
    pub name: String,
    /// The port's name (empty when the Service's only port has none).
    pub port_name: String,
    /// The Service's port (not the target port behind it).
    pub port: u16,
}

/// IP protocol number of a Service port's protocol.
fn proto_number(p: &str) -> u8 {
    match p {
        "UDP" => 17,
        "SCTP" => 132,
        _ => 6,
    }
}

type Frontend = (IpAddr, u16, u8);

/// What one Service added: its frontends, its node ports (port, protocol) and its ports.
#[derive(Default)]
struct Added {
    fronts: Vec<Frontend>,
    nodes: Vec<(u16, u8)>,
    refs: Vec<ServicePortRef>,
}

#[derive(Default)]
pub(super) struct Frontends {
    /// What each Service added, to withdraw it.
    by_key: FxHashMap<Key, Added>,
    at: FxHashMap<Frontend, BTreeSet<ServicePortRef>>,
    node_ports: FxHashMap<(u16, u8), BTreeSet<ServicePortRef>>,
}

impl Frontends {
    pub(super) fn set(&mut self, key: Key, spec: &ServiceSpec) {
        self.remove(&key);
        let ns = key.namespace.clone().unwrap_or_default();
        let ips: BTreeSet<IpAddr> = std::iter::once(&spec.cluster_ip)
            .chain(&spec.cluster_ips)
            .chain(&spec.external_ips)
            .filter_map(|a| a.parse().ok())
            .collect();
        let mut added = Added::default();
        for p in &spec.ports {
            let Ok(port) = u16::try_from(p.port) else {
                continue;
            };
            let proto = proto_number(&p.protocol);
            let r = ServicePortRef {
                namespace: ns.clone(),
                name: key.name.clone(),
                port_name: p.name.clone(),
                port,
            };
            for ip in &ips {
                self.at
                    .entry((*ip, port, proto))
                    .or_default()
                    .insert(r.clone());
                added.fronts.push((*ip, port, proto));
            }
            if let Some(np) = p
                .node_port
                .and_then(|n| u16::try_from(n).ok())
                .filter(|n| *n != 0)
            {
                self.node_ports
                    .entry((np, proto))
                    .or_default()
                    .insert(r.clone());
                added.nodes.push((np, proto));
            }
            added.refs.push(r);
        }
        self.by_key.insert(key, added);
    }

    pub(super) fn remove(&mut self, key: &Key) {
        let Some(Added {
            fronts,
            nodes,
            refs,
        }) = self.by_key.remove(key)
        else {
            return;
        };
        let forget = |set: &mut BTreeSet<ServicePortRef>| set.retain(|r| !refs.contains(r));
        for f in fronts {
            if let Some(set) = self.at.get_mut(&f) {
                forget(set);
                if set.is_empty() {
                    self.at.remove(&f);
                }
            }
        }
        for n in nodes {
            if let Some(set) = self.node_ports.get_mut(&n) {
                forget(set);
                if set.is_empty() {
                    self.node_ports.remove(&n);
                }
            }
        }
    }

    /// The Service port reached at `ip`:`port` over IP protocol `proto`.
    pub(super) fn at(&self, ip: IpAddr, port: u16, proto: u8) -> Option<&ServicePortRef> {
        self.at.get(&(ip, port, proto))?.first()
    }

    /// The Service port a node port leads to.
    pub(super) fn node_port(&self, port: u16, proto: u8) -> Option<&ServicePortRef> {
        self.node_ports.get(&(port, proto))?.first()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Kind, ResourceKey, ServicePort};

    fn key(ns: &str, name: &str) -> Key {
        ResourceKey::new(Kind::Service, Some(ns), name).into()
    }

    fn spec(cluster: &str, ports: &[(&str, &str, i64, Option<i64>)]) -> ServiceSpec {
        ServiceSpec {
            cluster_ip: cluster.into(),
            external_ips: vec!["203.0.113.7".into()],
            ports: ports
                .iter()
                .map(|(name, protocol, port, node_port)| ServicePort {
                    name: (*name).into(),
                    protocol: (*protocol).into(),
                    port: *port,
                    node_port: *node_port,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_service_is_found_at_each_of_its_addresses_and_ports() {
        let mut f = Frontends::default();
        f.set(
            key("shop", "web"),
            &spec(
                "10.96.0.10",
                &[("http", "", 80, Some(30080)), ("dns", "UDP", 53, None)],
            ),
        );
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let web = f.at(ip("10.96.0.10"), 80, 6).unwrap();
        assert_eq!(
            (
                web.namespace.as_str(),
                web.name.as_str(),
                web.port_name.as_str(),
                web.port
            ),
            ("shop", "web", "http", 80)
        );
        assert_eq!(f.at(ip("203.0.113.7"), 80, 6), Some(web));
        assert_eq!(f.at(ip("10.96.0.10"), 53, 17).unwrap().port_name, "dns");
        assert_eq!(f.at(ip("10.96.0.10"), 53, 6), None, "protocol matters");
        assert_eq!(
            f.at(ip("10.96.0.10"), 8080, 6),
            None,
            "the target port is not a frontend"
        );
        assert_eq!(f.node_port(30080, 6).unwrap().name, "web");

        // A second Service on the same frontend: the smaller name answers, whatever the order;
        // removing it gives the first back.
        f.set(
            key("shop", "alias"),
            &spec("10.96.0.10", &[("x", "TCP", 80, None)]),
        );
        assert_eq!(f.at(ip("10.96.0.10"), 80, 6).unwrap().name, "alias");
        f.remove(&key("shop", "alias"));
        assert_eq!(f.at(ip("10.96.0.10"), 80, 6).unwrap().name, "web");

        // A replaced Service loses its old frontends; a headless one has none.
        f.set(key("shop", "web"), &spec("None", &[("http", "", 81, None)]));
        assert_eq!(f.at(ip("10.96.0.10"), 80, 6), None);
        assert_eq!(f.node_port(30080, 6), None);
        assert_eq!(f.at(ip("203.0.113.7"), 81, 6).unwrap().port, 81);
        f.remove(&key("shop", "web"));
        assert!(f.at.is_empty() && f.node_ports.is_empty() && f.by_key.is_empty());
    }
}
