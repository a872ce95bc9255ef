//! Which objects the driver holds, for mark and sweep across reconnects.
//!
//! Every stream starts with a full snapshot. The tracker remembers the key of every object the
//! driver was given (the *known* set) and, while a stream's snapshot is arriving, which keys that
//! snapshot contained (the *seen* set). At the stream's `InSync` every known key the snapshot did
//! not contain is stale: [`Tracker::sweep`] turns those into synthetic `*Remove` messages, ordered
//! so that users go before what they use (endpoints, profiles, policies, then IP sets, then the
//! rest). Only keys are kept, never object bodies.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActivePolicyRemove, ActiveProfileRemove, HostEndpointId, HostEndpointRemove,
    HostMetadataRemove, IpSetRemove, IpamPoolRemove, NamespaceId, NamespaceRemove, PolicyId,
    ProfileId, RouteRemove, ServiceAccountId, ServiceAccountRemove, ServiceRemove, ToDataplane,
    VxlanTunnelEndpointRemove, WireguardEndpointRemove, WireguardEndpointV6Remove,
    WorkloadEndpointRemove,
};

use crate::driver::WorkloadEndpointKey;

/// The identity of one removable object. The variant order is the order stale objects are
/// removed in (dependency-safe: users first, then what they use).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key {
    /// A workload endpoint.
    WorkloadEndpoint(WorkloadEndpointKey),
    /// A host endpoint, by endpoint id.
    HostEndpoint(String),
    /// A profile, by name.
    Profile(String),
    /// A policy: (kind, namespace, name).
    Policy(String, String, String),
    /// An IP set, by id.
    IpSet(String),
    /// A service account: (namespace, name).
    ServiceAccount(String, String),
    /// A namespace, by name.
    Namespace(String),
    /// A route, by destination.
    Route(String),
    /// A VXLAN tunnel endpoint, by node.
    Vtep(String),
    /// A wireguard peer, by hostname.
    WireguardEndpoint(String),
    /// A wireguard v6 peer, by hostname.
    WireguardEndpointV6(String),
    /// Host metadata, by hostname.
    HostMetadata(String),
    /// An IPAM pool, by id.
    IpamPool(String),
    /// A Kubernetes service: (namespace, name).
    Service(String, String),
}

/// What a message does to the set of objects the driver holds.
enum Effect {
    Upsert(Key),
    Remove(Key),
}

fn policy_key(id: Option<&PolicyId>) -> Key {
    let id = id.cloned().unwrap_or_default();
    Key::Policy(id.kind, id.namespace, id.name)
}

fn effect(payload: &Payload) -> Option<Effect> {
    use Effect::{Remove, Upsert};
    Some(match payload {
        Payload::IpsetUpdate(u) => Upsert(Key::IpSet(u.id.clone())),
        Payload::IpsetRemove(u) => Remove(Key::IpSet(u.id.clone())),
        Payload::ActivePolicyUpdate(u) => Upsert(policy_key(u.id.as_ref())),
        Payload::ActivePolicyRemove(u) => Remove(policy_key(u.id.as_ref())),
        Payload::ActiveProfileUpdate(u) => Upsert(Key::Profile(
            u.id.as_ref().map(|i| i.name.clone()).unwrap_or_default(),
        )),
        Payload::ActiveProfileRemove(u) => Remove(Key::Profile(
            u.id.as_ref().map(|i| i.name.clone()).unwrap_or_default(),
        )),
        Payload::WorkloadEndpointUpdate(u) => Upsert(Key::WorkloadEndpoint(
            WorkloadEndpointKey::from_proto(u.id.as_ref()),
        )),
        Payload::WorkloadEndpointRemove(u) => Remove(Key::WorkloadEndpoint(
            WorkloadEndpointKey::from_proto(u.id.as_ref()),
        )),
        Payload::HostEndpointUpdate(u) => Upsert(Key::HostEndpoint(
            u.id.as_ref()
                .map(|i| i.endpoint_id.clone())
                .unwrap_or_default(),
        )),
        Payload::HostEndpointRemove(u) => Remove(Key::HostEndpoint(
            u.id.as_ref()
                .map(|i| i.endpoint_id.clone())
                .unwrap_or_default(),
        )),
        Payload::ServiceAccountUpdate(u) => {
            let id = u.id.clone().unwrap_or_default();
            Upsert(Key::ServiceAccount(id.namespace, id.name))
        }
        Payload::ServiceAccountRemove(u) => {
            let id = u.id.clone().unwrap_or_default();
            Remove(Key::ServiceAccount(id.namespace, id.name))
        }
        Payload::NamespaceUpdate(u) => Upsert(Key::Namespace(
            u.id.as_ref().map(|i| i.name.clone()).unwrap_or_default(),
        )),
        Payload::NamespaceRemove(u) => Remove(Key::Namespace(
            u.id.as_ref().map(|i| i.name.clone()).unwrap_or_default(),
        )),
        Payload::RouteUpdate(u) => Upsert(Key::Route(u.dst.clone())),
        Payload::RouteRemove(u) => Remove(Key::Route(u.dst.clone())),
        Payload::VtepUpdate(u) => Upsert(Key::Vtep(u.node.clone())),
        Payload::VtepRemove(u) => Remove(Key::Vtep(u.node.clone())),
        Payload::WireguardEndpointUpdate(u) => Upsert(Key::WireguardEndpoint(u.hostname.clone())),
        Payload::WireguardEndpointRemove(u) => Remove(Key::WireguardEndpoint(u.hostname.clone())),
        Payload::WireguardEndpointV6Update(u) => {
            Upsert(Key::WireguardEndpointV6(u.hostname.clone()))
        }
        Payload::WireguardEndpointV6Remove(u) => {
            Remove(Key::WireguardEndpointV6(u.hostname.clone()))
        }
        Payload::HostMetadataUpdate(u) => Upsert(Key::HostMetadata(u.hostname.clone())),
        Payload::HostMetadataRemove(u) => Remove(Key::HostMetadata(u.hostname.clone())),
        Payload::IpamPoolUpdate(u) => Upsert(Key::IpamPool(u.id.clone())),
        Payload::IpamPoolRemove(u) => Remove(Key::IpamPool(u.id.clone())),
        Payload::ServiceUpdate(u) => Upsert(Key::Service(u.namespace.clone(), u.name.clone())),
        Payload::ServiceRemove(u) => Remove(Key::Service(u.namespace.clone(), u.name.clone())),
        // Singletons that are replaced, never removed (config, encapsulation, BGP config), set
        // deltas (the set's key is unchanged), markers and the hello.
        _ => return None,
    })
}

/// Known and seen keys; see the module documentation.
#[derive(Debug, Default)]
pub struct Tracker {
    known: BTreeSet<Key>,
    seen: HashSet<Key>,
    /// True while a stream's snapshot is arriving (between its start and its `InSync`).
    marking: bool,
    /// Last known IPv4 address per host, so a synthetic `HostMetadataRemove` carries it too.
    host_ipv4: BTreeMap<String, String>,
}

impl Tracker {
    /// A new stream started: its snapshot begins.
    pub fn begin_stream(&mut self) {
        self.seen.clear();
        self.marking = true;
    }

    /// Records what `msg` does to the driver's objects. Call for every message given to the
    /// driver.
    pub fn observe(&mut self, msg: &ToDataplane) {
        let Some(payload) = &msg.payload else { return };
        if let Payload::HostMetadataUpdate(u) = payload {
            self.host_ipv4
                .insert(u.hostname.clone(), u.ipv4_addr.clone());
        }
        match effect(payload) {
            Some(Effect::Upsert(key)) => {
                if self.marking {
                    self.seen.insert(key.clone());
                }
                self.known.insert(key);
            }
            Some(Effect::Remove(key)) => {
                if let Key::HostMetadata(host) = &key {
                    self.host_ipv4.remove(host);
                }
                self.seen.remove(&key);
                self.known.remove(&key);
            }
            None => {}
        }
    }

    /// The stream's `InSync` arrived: forgets every known key its snapshot did not contain and
    /// returns the synthetic removes for them, in dependency-safe order.
    pub fn sweep(&mut self) -> Vec<ToDataplane> {
        self.marking = false;
        let seen = std::mem::take(&mut self.seen);
        let stale: Vec<Key> = self
            .known
            .iter()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        stale
            .into_iter()
            .map(|key| {
                self.known.remove(&key);
                let payload = self.remove_payload(key);
                ToDataplane {
                    payload: Some(payload),
                    sequence_number: 0,
                }
            })
            .collect()
    }

    /// How many objects the driver holds.
    pub fn known_len(&self) -> usize {
        self.known.len()
    }

    fn remove_payload(&mut self, key: Key) -> Payload {
        match key {
            Key::WorkloadEndpoint(k) => Payload::WorkloadEndpointRemove(WorkloadEndpointRemove {
                id: Some(k.to_proto()),
            }),
            Key::HostEndpoint(endpoint_id) => Payload::HostEndpointRemove(HostEndpointRemove {
                id: Some(HostEndpointId { endpoint_id }),
            }),
            Key::Profile(name) => Payload::ActiveProfileRemove(ActiveProfileRemove {
                id: Some(ProfileId { name }),
            }),
            Key::Policy(kind, namespace, name) => Payload::ActivePolicyRemove(ActivePolicyRemove {
                id: Some(PolicyId {
                    name,
                    namespace,
                    kind,
                }),
            }),
            Key::IpSet(id) => Payload::IpsetRemove(IpSetRemove { id }),
            Key::ServiceAccount(namespace, name) => {
                Payload::ServiceAccountRemove(ServiceAccountRemove {
                    id: Some(ServiceAccountId { namespace, name }),
                })
            }
            Key::Namespace(name) => Payload::NamespaceRemove(NamespaceRemove {
                id: Some(NamespaceId { name }),
            }),
            Key::Route(dst) => Payload::RouteRemove(RouteRemove { dst }),
            Key::Vtep(node) => Payload::VtepRemove(VxlanTunnelEndpointRemove { node }),
            Key::WireguardEndpoint(hostname) => {
                Payload::WireguardEndpointRemove(WireguardEndpointRemove { hostname })
            }
            Key::WireguardEndpointV6(hostname) => {
                Payload::WireguardEndpointV6Remove(WireguardEndpointV6Remove { hostname })
            }
            Key::HostMetadata(hostname) => {
                let ipv4_addr = self.host_ipv4.remove(&hostname).unwrap_or_default();
                Payload::HostMetadataRemove(HostMetadataRemove {
                    hostname,
                    ipv4_addr,
                })
            }
            Key::IpamPool(id) => Payload::IpamPoolRemove(IpamPoolRemove { id }),
            Key::Service(namespace, name) => {
                Payload::ServiceRemove(ServiceRemove { name, namespace })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_proto::{
        ActivePolicyUpdate, ActiveProfileUpdate, HostMetadataUpdate, IpSetUpdate,
        WorkloadEndpointId, WorkloadEndpointUpdate,
    };

    fn m(payload: Payload) -> ToDataplane {
        ToDataplane {
            payload: Some(payload),
            sequence_number: 1,
        }
    }
    fn ipset(id: &str) -> ToDataplane {
        m(Payload::IpsetUpdate(IpSetUpdate {
            id: id.into(),
            ..Default::default()
        }))
    }
    fn policy(name: &str) -> ToDataplane {
        m(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(PolicyId {
                kind: "GlobalNetworkPolicy".into(),
                namespace: String::new(),
                name: name.into(),
            }),
            policy: None,
        }))
    }
    fn profile(name: &str) -> ToDataplane {
        m(Payload::ActiveProfileUpdate(ActiveProfileUpdate {
            id: Some(ProfileId { name: name.into() }),
            profile: None,
        }))
    }
    fn wep(wl: &str) -> ToDataplane {
        m(Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
            id: Some(WorkloadEndpointId {
                orchestrator_id: "k8s".into(),
                workload_id: wl.into(),
                endpoint_id: "eth0".into(),
            }),
            endpoint: None,
        }))
    }
    fn kinds(msgs: &[ToDataplane]) -> Vec<String> {
        msgs.iter()
            .map(|msg| match msg.payload.as_ref().expect("payload") {
                Payload::WorkloadEndpointRemove(r) => {
                    format!("wep:{}", r.id.as_ref().expect("id").workload_id)
                }
                Payload::ActiveProfileRemove(r) => {
                    format!("profile:{}", r.id.as_ref().expect("id").name)
                }
                Payload::ActivePolicyRemove(r) => {
                    format!("policy:{}", r.id.as_ref().expect("id").name)
                }
                Payload::IpsetRemove(r) => format!("ipset:{}", r.id),
                Payload::HostMetadataRemove(r) => format!("host:{}:{}", r.hostname, r.ipv4_addr),
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn first_stream_sweeps_nothing() {
        let mut t = Tracker::default();
        t.begin_stream();
        for msg in [ipset("a"), policy("p"), wep("w")] {
            t.observe(&msg);
        }
        assert!(t.sweep().is_empty());
        assert_eq!(t.known_len(), 3);
    }

    #[test]
    fn resync_removes_what_the_new_snapshot_lacks_in_dependency_order() {
        let mut t = Tracker::default();
        t.begin_stream();
        for msg in [
            ipset("a"),
            ipset("b"),
            policy("p1"),
            policy("p2"),
            profile("pr1"),
            wep("w1"),
            wep("w2"),
            m(Payload::HostMetadataUpdate(HostMetadataUpdate {
                hostname: "h1".into(),
                ipv4_addr: "10.0.0.1".into(),
                ..Default::default()
            })),
        ] {
            t.observe(&msg);
        }
        assert!(t.sweep().is_empty());
        // Deltas after InSync are not "seen" bookkeeping, just known.
        t.observe(&ipset("c"));

        t.begin_stream();
        for msg in [ipset("a"), policy("p1"), wep("w1")] {
            t.observe(&msg);
        }
        let removes = t.sweep();
        assert_eq!(
            kinds(&removes),
            vec![
                "wep:w2",
                "profile:pr1",
                "policy:p2",
                "ipset:b",
                "ipset:c",
                "host:h1:10.0.0.1"
            ]
        );
        assert!(removes.iter().all(|r| r.sequence_number == 0));
        assert_eq!(t.known_len(), 3);
        // Nothing left to sweep on a repeat of the same snapshot.
        t.begin_stream();
        for msg in [ipset("a"), policy("p1"), wep("w1")] {
            t.observe(&msg);
        }
        assert!(t.sweep().is_empty());
    }

    #[test]
    fn partial_stream_leftovers_are_swept_by_the_next_complete_one() {
        let mut t = Tracker::default();
        t.begin_stream();
        t.observe(&ipset("a"));
        t.observe(&ipset("old"));
        // Stream breaks before InSync; the next one does not mention "old".
        t.begin_stream();
        t.observe(&ipset("a"));
        assert_eq!(kinds(&t.sweep()), vec!["ipset:old"]);
    }

    #[test]
    fn removes_in_the_snapshot_are_honoured() {
        let mut t = Tracker::default();
        t.begin_stream();
        t.observe(&ipset("a"));
        t.observe(&m(Payload::IpsetRemove(IpSetRemove { id: "a".into() })));
        assert!(t.sweep().is_empty());
        assert_eq!(t.known_len(), 0);
    }
}
