//! Which objects the driver holds, for mark and sweep across reconnects.
//!
//! Every stream starts with a full snapshot. The tracker remembers the key of every object the
//! driver was given (the *known* set) and, while a stream's snapshot is arriving, which keys that
//! snapshot contained (the *seen* set). At the stream's `InSync` every known key the snapshot did
//! not contain is stale: [`Tracker::sweep`] turns those into synthetic `*Remove` messages, ordered
//! so that users go before what they use (endpoints, profiles, policies, then IP sets, then the
//! rest). Only keys are kept, never object bodies.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use crate::message::{
    HostEndpointKey, HostName, IpSetId, IpamPoolId, Message, NamespaceKey, PolicyKey, ProfileKey,
    RouteDst, ServiceAccountKey, ServiceKey, VtepNode, WorkloadEndpointKey,
};

/// The identity of one removable object. The variant order is the order stale objects are
/// removed in (dependency-safe: users first, then what they use).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key {
    WorkloadEndpoint(WorkloadEndpointKey),
    HostEndpoint(HostEndpointKey),
    Profile(ProfileKey),
    Policy(PolicyKey),
    IpSet(IpSetId),
    ServiceAccount(ServiceAccountKey),
    Namespace(NamespaceKey),
    Route(RouteDst),
    Vtep(VtepNode),
    WireguardEndpoint(HostName),
    WireguardEndpointV6(HostName),
    HostMetadata(HostName),
    IpamPool(IpamPoolId),
    Service(ServiceKey),
}

/// What a message does to the set of objects the driver holds.
enum Effect {
    Upsert(Key),
    Remove(Key),
    /// Singletons that are replaced, never removed (config, encapsulation, BGP config), set
    /// deltas (the set's key is unchanged) and markers.
    None,
}

fn effect(msg: &Message) -> Effect {
    use Effect::{Remove, Upsert};
    match msg {
        Message::IpSetUpdate { id, .. } => Upsert(Key::IpSet(id.clone())),
        Message::IpSetRemove { id } => Remove(Key::IpSet(id.clone())),
        Message::PolicyUpdate { key, .. } => Upsert(Key::Policy(key.clone())),
        Message::PolicyRemove { key } => Remove(Key::Policy(key.clone())),
        Message::ProfileUpdate { key, .. } => Upsert(Key::Profile(key.clone())),
        Message::ProfileRemove { key } => Remove(Key::Profile(key.clone())),
        Message::WorkloadEndpointUpdate { key, .. } => Upsert(Key::WorkloadEndpoint(key.clone())),
        Message::WorkloadEndpointRemove { key } => Remove(Key::WorkloadEndpoint(key.clone())),
        Message::HostEndpointUpdate { key, .. } => Upsert(Key::HostEndpoint(key.clone())),
        Message::HostEndpointRemove { key } => Remove(Key::HostEndpoint(key.clone())),
        Message::ServiceAccountUpdate { key, .. } => Upsert(Key::ServiceAccount(key.clone())),
        Message::ServiceAccountRemove { key } => Remove(Key::ServiceAccount(key.clone())),
        Message::NamespaceUpdate { key, .. } => Upsert(Key::Namespace(key.clone())),
        Message::NamespaceRemove { key } => Remove(Key::Namespace(key.clone())),
        Message::RouteUpdate { dst, .. } => Upsert(Key::Route(dst.clone())),
        Message::RouteRemove { dst } => Remove(Key::Route(dst.clone())),
        Message::VtepUpdate { node, .. } => Upsert(Key::Vtep(node.clone())),
        Message::VtepRemove { node } => Remove(Key::Vtep(node.clone())),
        Message::WireguardEndpointUpdate { host, .. } => {
            Upsert(Key::WireguardEndpoint(host.clone()))
        }
        Message::WireguardEndpointRemove { host } => Remove(Key::WireguardEndpoint(host.clone())),
        Message::WireguardEndpointV6Update { host, .. } => {
            Upsert(Key::WireguardEndpointV6(host.clone()))
        }
        Message::WireguardEndpointV6Remove { host } => {
            Remove(Key::WireguardEndpointV6(host.clone()))
        }
        Message::HostMetadataUpdate { host, .. } => Upsert(Key::HostMetadata(host.clone())),
        Message::HostMetadataRemove { host, .. } => Remove(Key::HostMetadata(host.clone())),
        Message::IpamPoolUpdate { id, .. } => Upsert(Key::IpamPool(id.clone())),
        Message::IpamPoolRemove { id } => Remove(Key::IpamPool(id.clone())),
        Message::ServiceUpdate { key, .. } => Upsert(Key::Service(key.clone())),
        Message::ServiceRemove { key } => Remove(Key::Service(key.clone())),
        Message::InSync
        | Message::Config(_)
        | Message::IpSetDeltaUpdate { .. }
        | Message::GlobalBgpConfig(_)
        | Message::Encapsulation(_) => Effect::None,
    }
}

/// Known and seen keys; see the module documentation.
#[derive(Debug, Default)]
pub struct Tracker {
    known: BTreeSet<Key>,
    seen: HashSet<Key>,
    /// True while a stream's snapshot is arriving (between its start and its `InSync`).
    marking: bool,
    /// Last known IPv4 address per host, so a synthetic `HostMetadataRemove` carries it too.
    host_ipv4: BTreeMap<HostName, String>,
}

impl Tracker {
    /// A new stream started: its snapshot begins.
    pub fn begin_stream(&mut self) {
        self.seen.clear();
        self.marking = true;
    }

    /// Records what `msg` does to the driver's objects. Call for every message given to the
    /// driver.
    pub fn observe(&mut self, msg: &Message) {
        if let Message::HostMetadataUpdate { host, metadata } = msg {
            self.host_ipv4
                .insert(host.clone(), metadata.ipv4_addr.clone());
        }
        match effect(msg) {
            Effect::Upsert(key) => {
                if self.marking {
                    self.seen.insert(key.clone());
                }
                self.known.insert(key);
            }
            Effect::Remove(key) => {
                if let Key::HostMetadata(host) = &key {
                    self.host_ipv4.remove(host);
                }
                self.seen.remove(&key);
                self.known.remove(&key);
            }
            Effect::None => {}
        }
    }

    /// The stream's `InSync` arrived: forgets every known key its snapshot did not contain and
    /// returns the synthetic removes for them, in dependency-safe order.
    pub fn sweep(&mut self) -> Vec<Message> {
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
                self.remove_message(key)
            })
            .collect()
    }

    /// How many objects the driver holds.
    pub fn known_len(&self) -> usize {
        self.known.len()
    }

    fn remove_message(&mut self, key: Key) -> Message {
        match key {
            Key::WorkloadEndpoint(key) => Message::WorkloadEndpointRemove { key },
            Key::HostEndpoint(key) => Message::HostEndpointRemove { key },
            Key::Profile(key) => Message::ProfileRemove { key },
            Key::Policy(key) => Message::PolicyRemove { key },
            Key::IpSet(id) => Message::IpSetRemove { id },
            Key::ServiceAccount(key) => Message::ServiceAccountRemove { key },
            Key::Namespace(key) => Message::NamespaceRemove { key },
            Key::Route(dst) => Message::RouteRemove { dst },
            Key::Vtep(node) => Message::VtepRemove { node },
            Key::WireguardEndpoint(host) => Message::WireguardEndpointRemove { host },
            Key::WireguardEndpointV6(host) => Message::WireguardEndpointV6Remove { host },
            Key::HostMetadata(host) => {
                let ipv4_addr = self.host_ipv4.remove(&host).unwrap_or_default();
                Message::HostMetadataRemove { host, ipv4_addr }
            }
            Key::IpamPool(id) => Message::IpamPoolRemove { id },
            Key::Service(key) => Message::ServiceRemove { key },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_proto::to_dataplane::Payload;
    use felix_proto::{
        ActivePolicyUpdate, ActiveProfileUpdate, HostMetadataUpdate, IpSetRemove, IpSetUpdate,
        Policy, PolicyId, Profile, ProfileId,
    };

    fn m(payload: Payload) -> Message {
        Message::try_from(payload).expect("a valid message")
    }
    fn ipset(id: &str) -> Message {
        m(Payload::IpsetUpdate(IpSetUpdate {
            id: id.into(),
            ..Default::default()
        }))
    }
    fn policy(name: &str) -> Message {
        m(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(PolicyId {
                kind: "GlobalNetworkPolicy".into(),
                namespace: String::new(),
                name: name.into(),
            }),
            policy: Some(Policy::default()),
        }))
    }
    fn profile(name: &str) -> Message {
        m(Payload::ActiveProfileUpdate(ActiveProfileUpdate {
            id: Some(ProfileId { name: name.into() }),
            profile: Some(Profile::default()),
        }))
    }
    fn wep(wl: &str) -> Message {
        m(test_support::wep(wl).update())
    }
    fn kinds(msgs: &[Message]) -> Vec<String> {
        msgs.iter()
            .map(|msg| match msg {
                Message::WorkloadEndpointRemove { key } => format!("wep:{}", key.workload_id),
                Message::ProfileRemove { key } => format!("profile:{key}"),
                Message::PolicyRemove { key } => format!("policy:{}", key.name),
                Message::IpSetRemove { id } => format!("ipset:{id}"),
                Message::HostMetadataRemove { host, ipv4_addr } => {
                    format!("host:{host}:{ipv4_addr}")
                }
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
