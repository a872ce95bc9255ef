//! The per-node sequencer: turns what changed since a node's last flush into that node's next
//! batch of `ToDataplane` messages.
//!
//! Contract: between flushes a node accumulates only dirty *keys* ([`Dirty`]) and, per IP set,
//! a net member delta, so pending work is bounded by state, not by event rate. A flush compares
//! each dirty key's current value with what the node was last sent ([`Subscription`]) and emits
//! the difference in dependency order ([`Batch`]): everything a message refers to is sent before
//! it and removed after it, so the agent never holds a reference to something it does not have.
//! Messages identical for many nodes are built once per flush ([`FlushCache`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use felix_proto as pb;
use pb::to_dataplane::Payload;
use rustc_hash::{FxHashMap, FxHashSet};

use super::messages::{msg, policy_id_proto, profile_messages};
use super::{CalcGraph, Key, Name};
use crate::convert::{EndpointIds, PolicyId, endpoint_ids};
use crate::model::ResourceKey;
use crate::rule_scanner;

pub use super::shared::SharedMessage;

/// Messages for one node from one flush. Sequence numbers are left at 0: the stream that
/// carries them numbers them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeBatch {
    pub node: String,
    pub messages: Vec<SharedMessage>,
    /// Where `messages` holds the whole broadcast state (host metadata, then IPAM pools) a
    /// fresh node is sent: the same messages, in the same order, for every fresh node until
    /// that state changes, so a sender may encode and frame them once for all such nodes.
    pub whole_broadcast: Option<std::ops::Range<usize>>,
}

/// What a subscribed node has been sent.
#[derive(Default)]
pub(super) struct Subscription {
    initialized: bool,
    in_sync_sent: bool,
    config: Option<pb::ConfigUpdate>,
    ipsets: FxHashSet<Name>,
    /// The update each policy and profile was last sent in, to send only what changed.
    pub(super) policies: FxHashMap<Key, SharedMessage>,
    pub(super) profiles: FxHashMap<Name, SharedMessage>,
    /// Per endpoint: a fingerprint of the update last sent. The id its removal names is not
    /// kept: it follows from the key ([`removal_for`]).
    endpoints: FxHashMap<Key, u64>,
}

/// Keys of one node whose state may differ from what it was sent. A mark only says "look
/// again": the flush decides from current state, so marking too much costs work, never
/// correctness, and marking the same key twice costs nothing.
#[derive(Clone, Default)]
pub(super) struct Dirty {
    pub(super) policies: FxHashSet<Key>,
    pub(super) profiles: FxHashSet<Name>,
    pub(super) ipsets: FxHashSet<Name>,
    pub(super) endpoints: FxHashSet<Key>,
}

impl Dirty {
    fn is_empty(&self) -> bool {
        self.policies.is_empty()
            && self.profiles.is_empty()
            && self.ipsets.is_empty()
            && self.endpoints.is_empty()
    }

    /// Drops every mark, keeping the allocations for the next round.
    fn clear(&mut self) {
        self.policies.clear();
        self.profiles.clear();
        self.ipsets.clear();
        self.endpoints.clear();
    }
}

/// One node's output of one flush, by kind. [`Batch::into_parts`] is the one place that
/// fixes the order the agent relies on.
#[derive(Default)]
struct Batch {
    config: Option<SharedMessage>,
    ipset_adds: Vec<SharedMessage>,
    ipset_deltas: Vec<SharedMessage>,
    policy_updates: Vec<SharedMessage>,
    profile_updates: Vec<SharedMessage>,
    endpoint_updates: Vec<SharedMessage>,
    endpoint_removes: Vec<SharedMessage>,
    profile_removes: Vec<SharedMessage>,
    policy_removes: Vec<SharedMessage>,
    ipset_removes: Vec<SharedMessage>,
    broadcast: Vec<SharedMessage>,
    /// `broadcast` is the whole state (a fresh node's), not a difference.
    whole_broadcast: bool,
    in_sync: Option<SharedMessage>,
}

impl Batch {
    /// Config first; then additions in dependency order, IP sets → policies → profiles →
    /// endpoints, so whatever an update refers to already exists; then removals in the reverse
    /// order, so nothing is removed while still referenced; then host metadata and IPAM pools,
    /// which nothing refers to; `InSync` last, once the batch holds the whole span.
    /// Also says where the whole broadcast state is, when the batch carries it.
    fn into_parts(self) -> (Vec<SharedMessage>, Option<std::ops::Range<usize>>) {
        let mut out: Vec<SharedMessage> = Vec::new();
        out.extend(self.config);
        out.extend(self.ipset_adds);
        out.extend(self.ipset_deltas);
        out.extend(self.policy_updates);
        out.extend(self.profile_updates);
        out.extend(self.endpoint_updates);
        out.extend(self.endpoint_removes);
        out.extend(self.profile_removes);
        out.extend(self.policy_removes);
        out.extend(self.ipset_removes);
        let start = out.len();
        out.extend(self.broadcast);
        let whole = (self.whole_broadcast && out.len() > start).then_some(start..out.len());
        out.extend(self.in_sync);
        (out, whole)
    }
}

/// Records a member change in an IP set's pending delta. An add and a remove of one member
/// cancel, so the delta is the net change since the last flush and never grows past the set's
/// size, however often a member flaps.
pub(super) fn record_delta(delta: &mut FxHashMap<Arc<str>, bool>, member: Arc<str>, add: bool) {
    match delta.get(&member) {
        Some(&prev) if prev != add => {
            delta.remove(&member);
        }
        _ => {
            delta.insert(member, add);
        }
    }
}

/// Messages built once per flush and shared by every node that needs them.
#[derive(Default)]
struct FlushCache {
    /// Buffer for endpoint fingerprints.
    scratch: Vec<u8>,
    ipset_full: FxHashMap<Name, SharedMessage>,
    ipset_delta: FxHashMap<Name, Option<SharedMessage>>,
    missing_profiles: FxHashMap<Name, SharedMessage>,
    broadcast_full: Option<Vec<SharedMessage>>,
    broadcast_delta: Option<Vec<SharedMessage>>,
    everywhere_ipsets: Option<FxHashSet<Name>>,
}

impl CalcGraph {
    /// Starts sending a node its span: the next flush sends it a complete snapshot. Calling it
    /// again for a subscribed node restarts it from a fresh snapshot (a resync).
    pub fn subscribe(&mut self, node: &str) {
        if let Some(old) = self.node_mut(node).sub.replace(Subscription::default()) {
            self.forget_sent_ipsets(&old);
        }
    }

    /// Stops tracking what a node was sent.
    pub fn unsubscribe(&mut self, node: &str) {
        if let Some(old) = self.nodes.get_mut(node).and_then(|n| n.sub.take()) {
            self.forget_sent_ipsets(&old);
        }
        self.prune_node(node);
    }

    /// Computes every subscribed node's messages since its last flush. Batches are sorted by
    /// node name; nodes with nothing to send are omitted. Identical messages (IP sets, policies,
    /// profiles, broadcast state) are one shared allocation across nodes.
    pub fn flush(&mut self) -> Vec<NodeBatch> {
        let mut batches = Vec::new();
        self.flush_with(|b| batches.push(b));
        batches
    }

    /// Like [`flush`](Self::flush), handing each node's batch to `sink` as soon as it is built,
    /// so a caller that encodes and sends holds one node's batch at a time.
    pub fn flush_with(&mut self, mut sink: impl FnMut(NodeBatch)) {
        self.policies.refresh_ranks();
        // Without an update since the last flush, nothing shared changed (IP-set deltas,
        // broadcast state, configuration, ranks): only a node that is new, awaits its InSync
        // or was marked can have anything to send.
        let applied = std::mem::take(&mut self.applied_since_flush);
        let in_sync = self.store.in_sync;
        let mut names: Vec<Name> = self
            .nodes
            .iter()
            .filter(|(_, n)| {
                n.sub.as_ref().is_some_and(|sub| {
                    applied
                        || !sub.initialized
                        || (in_sync && !sub.in_sync_sent)
                        || !n.dirty.is_empty()
                })
            })
            .map(|(k, _)| k.clone())
            .collect();
        names.sort();
        let mut cache = FlushCache {
            ipset_full: std::mem::take(&mut self.ipsets.full),
            ..FlushCache::default()
        };
        for name in names {
            let (messages, whole_broadcast) = self.flush_node(&name, &mut cache);
            if !messages.is_empty() {
                sink(NodeBatch {
                    node: name.to_string(),
                    messages,
                    whole_broadcast,
                });
            }
        }
        self.ipsets.full = cache.ipset_full;
        if !applied {
            // Marks, deltas and prunable nodes come from updates (an unsubscribed node is
            // pruned as it goes): nothing else to tidy.
            return;
        }
        // Per-node dirty marks of unsubscribed nodes carry no meaning once flushed.
        for n in self.nodes.values_mut() {
            if n.sub.is_none() {
                n.dirty.clear();
            }
        }
        self.ipsets.deltas.clear();
        self.broadcast.flushed();
        let stale: Vec<Name> = self.nodes.keys().cloned().collect();
        for n in stale {
            self.prune_node(&n);
        }
        self.index.collect_garbage();
    }

    /// Drops the whole IP-set messages kept between flushes (see `IpSets::full`): a caller
    /// that expects no new subscriber for a while gives their memory back. The next flush
    /// that needs one builds it again.
    pub fn release_message_cache(&mut self) {
        self.ipsets.full = FxHashMap::default();
    }

    /// The complete current span of a node, as a fresh subscriber would receive it (snapshot
    /// then `InSync` if the datastore is in sync). Does not disturb subscriptions.
    pub fn snapshot(&mut self, node: &str) -> Vec<SharedMessage> {
        self.policies.refresh_ranks();
        let n = self.node_mut(node);
        let existing = n.sub.take();
        // flush_node consumes the dirty marks; the real subscription still needs them.
        let dirty = n.dirty.clone();
        n.sub = Some(Subscription::default());
        let (out, _) = self.flush_node(&Arc::from(node), &mut FlushCache::default());
        // The throwaway subscription must not count as a receiver of IP-set deltas.
        if let Some(tmp) = self.node_mut(node).sub.take() {
            self.forget_sent_ipsets(&tmp);
        }
        let n = self.node_mut(node);
        n.dirty = dirty;
        n.sub = existing;
        out
    }

    fn forget_sent_ipsets(&mut self, sub: &Subscription) {
        for id in &sub.ipsets {
            if let Some(c) = self.ipsets.sent_count.get_mut(id) {
                *c -= 1;
                if *c == 0 {
                    self.ipsets.sent_count.remove(id);
                }
            }
        }
    }

    fn flush_node(
        &mut self,
        name: &Name,
        cache: &mut FlushCache,
    ) -> (Vec<SharedMessage>, Option<std::ops::Range<usize>>) {
        let Some(node) = self.nodes.get_mut(name) else {
            return (Vec::new(), None);
        };
        let mut sub = node.sub.take().expect("flush_node on a subscribed node");
        let dirty = std::mem::take(&mut node.dirty);
        let fresh = !sub.initialized;
        let mut sent_count_changes: Vec<(Name, bool)> = Vec::new();
        if cache.everywhere_ipsets.is_none() {
            cache.everywhere_ipsets = Some(
                self.policies
                    .everywhere
                    .iter()
                    .filter_map(|k| self.policies.by_key.get(k))
                    .flat_map(|p| p.ipsets.iter().cloned())
                    .collect(),
            );
        }
        let everywhere_ipsets = cache.everywhere_ipsets.take().unwrap_or_default();
        let node = &self.nodes[name];

        let mut batch = Batch::default();
        // Config.
        if fresh || self.broadcast.config_dirty {
            let cfg = self.broadcast.config_for(name);
            if sub.config.as_ref() != Some(&cfg) {
                sub.config = Some(cfg.clone());
                batch.config = Some(SharedMessage::new(msg(Payload::ConfigUpdate(cfg))));
            }
        }

        // IP sets.
        let needed = |id: &Name| {
            self.ipsets.sets.contains_key(id)
                && (node.span.ipset_refs.contains_key(id) || everywhere_ipsets.contains(id))
        };
        let mut ipset_candidates: BTreeSet<Name> = BTreeSet::new();
        if fresh {
            ipset_candidates.extend(node.span.ipset_refs.keys().cloned());
        } else {
            ipset_candidates.extend(dirty.ipsets.iter().cloned());
            for id in self.ipsets.deltas.keys() {
                if sub.ipsets.contains(id) {
                    ipset_candidates.insert(id.clone());
                }
            }
        }
        ipset_candidates.extend(everywhere_ipsets.iter().cloned());
        for id in ipset_candidates {
            let (need, sent) = (needed(&id), sub.ipsets.contains(&id));
            if need && !sent {
                if let Some(m) = self.ipset_full(cache, &id) {
                    batch.ipset_adds.push(m);
                    sub.ipsets.insert(id.clone());
                    sent_count_changes.push((id, true));
                }
            } else if need && sent {
                if let Some(m) = self.ipset_delta(cache, &id) {
                    batch.ipset_deltas.push(m);
                }
            } else if !need && sent {
                batch
                    .ipset_removes
                    .push(SharedMessage::new(msg(Payload::IpsetRemove(
                        pb::IpSetRemove { id: id.to_string() },
                    ))));
                sub.ipsets.remove(&id);
                sent_count_changes.push((id, false));
            }
        }

        // Policies.
        let mut policy_candidates: BTreeSet<Key> = BTreeSet::new();
        if fresh {
            policy_candidates.extend(node.span.policy_refs.keys().cloned());
        } else {
            policy_candidates.extend(dirty.policies.iter().cloned());
        }
        policy_candidates.extend(self.policies.everywhere.iter().cloned());
        for key in policy_candidates {
            let current = self.policies.by_key.get(&key).filter(|_| {
                node.span.policy_refs.contains_key(&key) || self.policies.everywhere.contains(&key)
            });
            match current {
                Some(p) => {
                    let same = sub
                        .policies
                        .get(&key)
                        .is_some_and(|s| SharedMessage::ptr_eq(s, &p.update) || **s == *p.update);
                    if !same {
                        sub.policies.insert(key.clone(), p.update.clone());
                        batch.policy_updates.push(p.update.clone());
                    }
                }
                None => {
                    if sub.policies.remove(&key).is_some() {
                        batch.policy_removes.push(SharedMessage::new(msg(
                            Payload::ActivePolicyRemove(pb::ActivePolicyRemove {
                                id: Some(policy_id_proto(&PolicyId::from_key(&key))),
                            }),
                        )));
                    }
                }
            }
        }

        // Profiles.
        let profile_candidates: BTreeSet<Name> = if fresh {
            node.span.profile_refs.keys().cloned().collect()
        } else {
            dirty.profiles.into_iter().collect()
        };
        for name in profile_candidates {
            if node.span.profile_refs.contains_key(&name) {
                let update = match self.policies.profiles.get(&name) {
                    Some(p) => p.update.clone(),
                    None => cache
                        .missing_profiles
                        .entry(name.clone())
                        .or_insert_with(|| {
                            let (inbound_rules, outbound_rules) =
                                rule_scanner::missing_profile_rules();
                            profile_messages(
                                &name,
                                pb::Profile {
                                    inbound_rules,
                                    outbound_rules,
                                },
                            )
                        })
                        .clone(),
                };
                let same = sub
                    .profiles
                    .get(&name)
                    .is_some_and(|s| SharedMessage::ptr_eq(s, &update) || **s == *update);
                if !same {
                    sub.profiles.insert(name.clone(), update.clone());
                    batch.profile_updates.push(update);
                }
            } else if sub.profiles.remove(&name).is_some() {
                batch
                    .profile_removes
                    .push(SharedMessage::new(msg(Payload::ActiveProfileRemove(
                        pb::ActiveProfileRemove {
                            id: Some(pb::ProfileId {
                                name: name.to_string(),
                            }),
                        },
                    ))));
            }
        }

        // Endpoints.
        let endpoint_candidates: BTreeSet<Key> = if fresh {
            node.span.endpoints.iter().cloned().collect()
        } else {
            dirty.endpoints.into_iter().collect()
        };
        for key in endpoint_candidates {
            let current = node
                .span
                .endpoints
                .contains(&key)
                .then(|| self.endpoint_message(&key))
                .flatten();
            match current {
                Some(m) => {
                    let print = fingerprint(&m, &mut cache.scratch);
                    if sub.endpoints.insert(key, print) != Some(print) {
                        batch.endpoint_updates.push(SharedMessage::new(msg(m)));
                    }
                }
                None => {
                    if sub.endpoints.remove(&key).is_some()
                        && let Some(r) = removal_for(&key)
                    {
                        batch.endpoint_removes.push(SharedMessage::new(msg(r)));
                    }
                }
            }
        }

        batch.broadcast = self.broadcast(cache, fresh);
        batch.whole_broadcast = fresh;
        if self.store.in_sync && !sub.in_sync_sent {
            sub.in_sync_sent = true;
            batch.in_sync = Some(SharedMessage::new(msg(Payload::InSync(pb::InSync {}))));
        }
        sub.initialized = true;
        cache.everywhere_ipsets = Some(everywhere_ipsets);
        for (id, add) in sent_count_changes {
            let c = self.ipsets.sent_count.entry(id.clone()).or_insert(0);
            if add {
                *c += 1;
            } else {
                *c -= 1;
                if *c == 0 {
                    self.ipsets.sent_count.remove(&id);
                }
            }
        }
        self.nodes.get_mut(name).expect("node exists").sub = Some(sub);
        batch.into_parts()
    }

    fn ipset_full(&self, cache: &mut FlushCache, id: &Name) -> Option<SharedMessage> {
        if let Some(m) = cache.ipset_full.get(id) {
            return Some(m.clone());
        }
        let set = self.ipsets.sets.get(id)?;
        let mut members: Vec<String> = set
            .members
            .ids()
            .map(|m| self.ipsets.members.get(m).to_string())
            .collect();
        members.sort_unstable();
        // Held encoded: the member strings live only until the bytes are written.
        let whole = msg(Payload::IpsetUpdate(pb::IpSetUpdate {
            id: id.to_string(),
            members,
            r#type: set.spec.proto_type() as i32,
        }));
        let m = SharedMessage::whole_ipset(id.clone(), &whole);
        cache.ipset_full.insert(id.clone(), m.clone());
        Some(m)
    }

    fn ipset_delta(&self, cache: &mut FlushCache, id: &Name) -> Option<SharedMessage> {
        if let Some(m) = cache.ipset_delta.get(id) {
            return m.clone();
        }
        let m = self.ipsets.deltas.get(id).and_then(|d| {
            let mut added: Vec<String> = d
                .iter()
                .filter(|(_, a)| **a)
                .map(|(m, _)| m.to_string())
                .collect();
            let mut removed: Vec<String> = d
                .iter()
                .filter(|(_, a)| !**a)
                .map(|(m, _)| m.to_string())
                .collect();
            if added.is_empty() && removed.is_empty() {
                return None;
            }
            added.sort_unstable();
            removed.sort_unstable();
            Some(SharedMessage::new(msg(Payload::IpsetDeltaUpdate(
                pb::IpSetDeltaUpdate {
                    id: id.to_string(),
                    added_members: added,
                    removed_members: removed,
                },
            ))))
        });
        cache.ipset_delta.insert(id.clone(), m.clone());
        m
    }

    fn broadcast(&self, cache: &mut FlushCache, fresh: bool) -> Vec<SharedMessage> {
        let slot = if fresh {
            &cache.broadcast_full
        } else {
            &cache.broadcast_delta
        };
        if let Some(v) = slot {
            return v.clone();
        }
        if fresh && let Some(v) = self.broadcast.full.get() {
            cache.broadcast_full = Some(v.clone());
            return v.clone();
        }
        let mut out = Vec::new();
        if !fresh && !self.broadcast.changed {
            cache.broadcast_delta = Some(Vec::new());
            return Vec::new();
        }
        diff_broadcast(
            fresh,
            &self.broadcast.flushed_host_metadata,
            &self.broadcast.host_metadata,
            |u| Payload::HostMetadataUpdate(u.clone()),
            |k, old| {
                Payload::HostMetadataRemove(pb::HostMetadataRemove {
                    hostname: k.to_string(),
                    ipv4_addr: old.ipv4_addr.clone(),
                })
            },
            &mut out,
        );
        diff_broadcast(
            fresh,
            &self.broadcast.flushed_pools,
            &self.broadcast.pools,
            |u| Payload::IpamPoolUpdate(u.clone()),
            |k, _| Payload::IpamPoolRemove(pb::IpamPoolRemove { id: k.to_string() }),
            &mut out,
        );
        let v: Vec<SharedMessage> = out
            .into_iter()
            .map(|p| SharedMessage::new(msg(p)))
            .collect();
        if fresh {
            // Kept by the graph until the state changes (`Broadcast::full`).
            let _ = self.broadcast.full.set(v.clone());
            cache.broadcast_full = Some(v.clone());
        } else {
            cache.broadcast_delta = Some(v.clone());
        }
        v
    }
}

/// A 64-bit fingerprint of a message's encoding: enough to tell "unchanged" without keeping
/// a copy of every endpoint message per node. The encoding goes into `scratch`, reused across
/// endpoints so that fingerprinting allocates nothing.
fn fingerprint(p: &Payload, scratch: &mut Vec<u8>) -> u64 {
    use std::hash::{Hash, Hasher};
    scratch.clear();
    p.encode(scratch);
    let mut h = rustc_hash::FxHasher::default();
    scratch.hash(&mut h);
    h.finish()
}

/// The removal of the endpoint of `key`. The id it names follows from the key alone, as the
/// id of every update sent for that key did (`convert::endpoint_ids`), so no node keeps a copy.
fn removal_for(key: &ResourceKey) -> Option<Payload> {
    match endpoint_ids(key)? {
        EndpointIds::Workload {
            orchestrator_id,
            workload_id,
            endpoint_id,
            ..
        } => Some(Payload::WorkloadEndpointRemove(
            pb::WorkloadEndpointRemove {
                id: Some(pb::WorkloadEndpointId {
                    orchestrator_id,
                    workload_id,
                    endpoint_id,
                }),
            },
        )),
        EndpointIds::Host { endpoint_id } => {
            Some(Payload::HostEndpointRemove(pb::HostEndpointRemove {
                id: Some(pb::HostEndpointId { endpoint_id }),
            }))
        }
    }
}

/// Broadcast maps are the same for every node: a fresh node gets all of `now`; the others get
/// the difference from what every node was given at the last flush.
fn diff_broadcast<T: PartialEq>(
    fresh: bool,
    before: &BTreeMap<String, T>,
    now: &BTreeMap<String, T>,
    update: impl Fn(&T) -> Payload,
    remove: impl Fn(&str, &T) -> Payload,
    out: &mut Vec<Payload>,
) {
    if fresh {
        out.extend(now.values().map(&update));
        return;
    }
    for (k, v) in now {
        if before.get(k) != Some(v) {
            out.push(update(v));
        }
    }
    for (k, v) in before {
        if !now.contains_key(k) {
            out.push(remove(k, v));
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::test_util::{apply, flush_for, gnp, kinds, wep};
    use super::*;
    use crate::graph::Update;

    fn shared(p: Payload) -> SharedMessage {
        SharedMessage::new(msg(p))
    }

    /// A Node resource with its BGP address.
    fn node(name: &str, ip: &str) -> serde_json::Value {
        json!({"apiVersion": "projectcalico.org/v3", "kind": "Node",
               "metadata": {"name": name},
               "spec": {"bgp": {"ipv4Address": format!("{ip}/24")}}})
    }

    #[test]
    fn a_batch_is_emitted_in_dependency_order() {
        let batch = Batch {
            in_sync: Some(shared(Payload::InSync(pb::InSync {}))),
            broadcast: vec![
                shared(Payload::HostMetadataUpdate(Default::default())),
                shared(Payload::IpamPoolUpdate(Default::default())),
            ],
            ipset_removes: vec![shared(Payload::IpsetRemove(Default::default()))],
            policy_removes: vec![shared(Payload::ActivePolicyRemove(Default::default()))],
            profile_removes: vec![shared(Payload::ActiveProfileRemove(Default::default()))],
            endpoint_removes: vec![shared(Payload::WorkloadEndpointRemove(Default::default()))],
            endpoint_updates: vec![shared(Payload::WorkloadEndpointUpdate(Default::default()))],
            profile_updates: vec![shared(Payload::ActiveProfileUpdate(Default::default()))],
            policy_updates: vec![shared(Payload::ActivePolicyUpdate(Default::default()))],
            ipset_deltas: vec![shared(Payload::IpsetDeltaUpdate(Default::default()))],
            ipset_adds: vec![shared(Payload::IpsetUpdate(Default::default()))],
            config: Some(shared(Payload::ConfigUpdate(Default::default()))),
            whole_broadcast: true,
        };
        let (messages, whole) = batch.into_parts();
        assert_eq!(whole, Some(10..12), "host metadata and pools, as one run");
        assert_eq!(
            kinds(&messages),
            [
                "ConfigUpdate",
                "IpsetUpdate",
                "IpsetDeltaUpdate",
                "ActivePolicyUpdate",
                "ActiveProfileUpdate",
                "WorkloadEndpointUpdate",
                "WorkloadEndpointRemove",
                "ActiveProfileRemove",
                "ActivePolicyRemove",
                "IpsetRemove",
                "HostMetadataUpdate",
                "IpamPoolUpdate",
                "InSync",
            ]
        );
    }

    /// Position of the first message of `kind`.
    fn at(kinds: &[String], kind: &str) -> usize {
        kinds
            .iter()
            .position(|k| k == kind)
            .unwrap_or_else(|| panic!("no {kind} in {kinds:?}"))
    }

    #[test]
    fn a_node_gets_what_an_endpoint_refers_to_first_and_loses_it_last() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        apply(&mut g, gnp("db", "role == 'db'", "Allow", "role == 'web'"));
        apply(
            &mut g,
            wep(
                "web",
                "node-2",
                "10.0.0.9",
                json!({"role": "web"}),
                json!([]),
            ),
        );
        let db = apply(
            &mut g,
            wep("db", "node-1", "10.0.0.1", json!({"role": "db"}), json!([])),
        );
        g.apply(Update::InSync).unwrap();

        let k = kinds(&flush_for(&mut g, "node-1"));
        assert!(
            at(&k, "IpsetUpdate") < at(&k, "ActivePolicyUpdate"),
            "{k:?}"
        );
        assert!(
            at(&k, "ActivePolicyUpdate") < at(&k, "WorkloadEndpointUpdate"),
            "{k:?}"
        );
        assert_eq!(k.last().map(String::as_str), Some("InSync"), "{k:?}");

        g.apply(Update::Delete((*db).clone())).unwrap();
        assert_eq!(
            kinds(&flush_for(&mut g, "node-1")),
            [
                "WorkloadEndpointRemove",
                "ActivePolicyRemove",
                "IpsetRemove"
            ]
        );
    }

    #[test]
    fn a_removal_names_the_id_the_endpoint_was_sent_under() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        let key = apply(&mut g, wep("a", "node-1", "10.0.0.1", json!({}), json!([])));
        g.apply(Update::InSync).unwrap();
        let sent = flush_for(&mut g, "node-1");
        let u = sent
            .iter()
            .find_map(|m| match m.payload.as_ref()? {
                Payload::WorkloadEndpointUpdate(u) => Some(u.clone()),
                _ => None,
            })
            .expect("the endpoint is sent");
        g.apply(Update::Delete((*key).clone())).unwrap();
        let out = flush_for(&mut g, "node-1");
        let Some(Payload::WorkloadEndpointRemove(r)) = &out[0].payload else {
            panic!("{out:?}")
        };
        assert_eq!(r.id, u.id);
        assert_eq!(
            u.id.as_ref().map(|id| id.workload_id.as_str()),
            Some("ns/a")
        );
    }

    #[test]
    fn a_host_endpoint_that_moves_is_removed_from_its_old_node() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        g.subscribe("node-2");
        let mut hep = json!({
            "apiVersion": "projectcalico.org/v3", "kind": "HostEndpoint",
            "metadata": {"name": "eth0-host"},
            "spec": {"node": "node-1", "interfaceName": "eth0", "expectedIPs": ["10.0.0.1"]}
        });
        apply(&mut g, hep.clone());
        g.apply(Update::InSync).unwrap();
        g.flush();

        hep["spec"]["node"] = json!("node-2");
        apply(&mut g, hep);
        let out = g.flush();
        let of = |n: &str| {
            let batch = out.iter().find(|b| b.node == n).expect("a batch");
            kinds(&batch.messages)
        };
        assert_eq!(of("node-1"), ["HostEndpointRemove"]);
        assert_eq!(of("node-2"), ["HostEndpointUpdate"]);
        let removed = out.iter().find(|b| b.node == "node-1").and_then(|b| {
            match b.messages[0].payload.as_ref()? {
                Payload::HostEndpointRemove(r) => Some(r.id.clone()?.endpoint_id),
                _ => None,
            }
        });
        assert_eq!(removed.as_deref(), Some("eth0-host"));
    }

    /// The whole-set message `out` carries, if any.
    fn full_set(out: &[SharedMessage]) -> Option<SharedMessage> {
        out.iter()
            .find(|m| matches!(m.payload, Some(Payload::IpsetUpdate(_))))
            .cloned()
    }

    #[test]
    fn a_whole_set_message_is_reused_by_later_flushes_until_the_set_changes() {
        let mut g = CalcGraph::new();
        apply(&mut g, gnp("db", "role == 'db'", "Allow", "role == 'web'"));
        apply(
            &mut g,
            wep(
                "web",
                "node-9",
                "10.0.0.9",
                json!({"role": "web"}),
                json!([]),
            ),
        );
        for n in 1..=4 {
            let node = format!("node-{n}");
            apply(
                &mut g,
                wep(
                    &format!("db{n}"),
                    &node,
                    &format!("10.0.1.{n}"),
                    json!({"role": "db"}),
                    json!([]),
                ),
            );
        }
        g.apply(Update::InSync).unwrap();
        g.subscribe("node-1");
        let first = full_set(&flush_for(&mut g, "node-1")).expect("node-1 gets the set");

        // A node that connects later gets the very message built before.
        g.subscribe("node-2");
        let again = full_set(&flush_for(&mut g, "node-2")).expect("node-2 gets the set");
        assert!(SharedMessage::ptr_eq(&first, &again));

        // A member change makes the next whole set anew, with the member.
        apply(
            &mut g,
            wep(
                "web2",
                "node-9",
                "10.0.0.10",
                json!({"role": "web"}),
                json!([]),
            ),
        );
        g.subscribe("node-3");
        let out = g.flush();
        let changed = out
            .iter()
            .find(|b| b.node == "node-3")
            .and_then(|b| full_set(&b.messages))
            .expect("node-3 gets the set");
        assert!(!SharedMessage::ptr_eq(&first, &changed));
        let Some(Payload::IpsetUpdate(u)) = &changed.payload else {
            unreachable!()
        };
        assert_eq!(u.members, ["10.0.0.10/32", "10.0.0.9/32"]);

        // Released, it is built again the next time (with the same members).
        g.release_message_cache();
        g.subscribe("node-4");
        let rebuilt = full_set(&flush_for(&mut g, "node-4")).expect("node-4 gets the set");
        assert!(!SharedMessage::ptr_eq(&changed, &rebuilt));
        assert_eq!(*changed, *rebuilt);
    }

    #[test]
    fn record_delta_keeps_only_the_net_change() {
        let mut d: FxHashMap<Arc<str>, bool> = FxHashMap::default();
        record_delta(&mut d, "a".into(), true);
        record_delta(&mut d, "a".into(), false);
        record_delta(&mut d, "b".into(), false);
        record_delta(&mut d, "b".into(), true);
        assert!(
            d.is_empty(),
            "opposite changes cancel in either order: {d:?}"
        );
        record_delta(&mut d, "c".into(), true);
        record_delta(&mut d, "d".into(), false);
        assert_eq!(d.get("c"), Some(&true));
        assert_eq!(d.get("d"), Some(&false));
        assert_eq!(d.len(), 2);
    }

    #[test]
    fn a_member_that_comes_and_goes_between_flushes_sends_nothing() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        apply(&mut g, gnp("db", "role == 'db'", "Allow", "role == 'web'"));
        apply(
            &mut g,
            wep("db", "node-1", "10.0.0.1", json!({"role": "db"}), json!([])),
        );
        g.flush();

        let web = apply(
            &mut g,
            wep(
                "web",
                "node-2",
                "10.0.0.9",
                json!({"role": "web"}),
                json!([]),
            ),
        );
        g.apply(Update::Delete((*web).clone())).unwrap();
        assert!(flush_for(&mut g, "node-1").is_empty());

        // The same member arriving for good is sent as a delta of the set node-1 holds.
        apply(
            &mut g,
            wep(
                "web",
                "node-2",
                "10.0.0.9",
                json!({"role": "web"}),
                json!([]),
            ),
        );
        let out = flush_for(&mut g, "node-1");
        assert_eq!(kinds(&out), ["IpsetDeltaUpdate"]);
        let Some(Payload::IpsetDeltaUpdate(d)) = &out[0].payload else {
            unreachable!()
        };
        assert_eq!(d.added_members, ["10.0.0.9/32"]);
        assert!(d.removed_members.is_empty());
    }

    #[test]
    fn a_snapshot_leaves_pending_changes_to_the_subscription() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        apply(&mut g, wep("a", "node-1", "10.0.0.1", json!({}), json!([])));
        g.flush();
        apply(&mut g, wep("a", "node-1", "10.0.0.2", json!({}), json!([])));

        assert_eq!(
            kinds(&g.snapshot("node-1")),
            ["ConfigUpdate", "WorkloadEndpointUpdate"]
        );
        assert_eq!(
            kinds(&flush_for(&mut g, "node-1")),
            ["WorkloadEndpointUpdate"],
            "the subscriber still gets the change the snapshot already showed"
        );
    }

    #[test]
    fn new_subscribers_share_the_broadcast_state_until_it_changes() {
        let mut g = CalcGraph::new();
        apply(&mut g, node("n1", "10.0.0.1"));
        apply(&mut g, node("n2", "10.0.0.2"));
        g.apply(Update::InSync).unwrap();
        // The fresh node's batch says where the whole state is; a subscribed node's change
        // (the difference only) is no such run.
        let hosts = |g: &mut CalcGraph, name: &str| -> Vec<SharedMessage> {
            g.subscribe(name);
            let mut fresh = None;
            for batch in g.flush() {
                if batch.node == name {
                    fresh = Some(batch);
                } else {
                    assert_eq!(batch.whole_broadcast, None, "{}", batch.node);
                }
            }
            let batch = fresh.expect("the fresh node has a batch");
            let whole = batch.whole_broadcast.clone().expect("the whole state");
            let run = batch.messages[whole].to_vec();
            assert_eq!(kinds(&run), ["HostMetadataUpdate", "HostMetadataUpdate"]);
            run
        };
        // Two snapshots in two flushes: the same allocations (encoded once downstream).
        let first = hosts(&mut g, "n1");
        let second = hosts(&mut g, "n2");
        assert_eq!(first.len(), 2);
        assert!(
            first
                .iter()
                .zip(&second)
                .all(|(a, b)| SharedMessage::ptr_eq(a, b))
        );
        // A changed node: the next snapshot is built anew, with the new address.
        apply(&mut g, node("n2", "10.0.0.9"));
        let third = hosts(&mut g, "n1");
        assert!(!SharedMessage::ptr_eq(&first[1], &third[1]));
        match &third[1].payload {
            Some(Payload::HostMetadataUpdate(h)) => assert_eq!(h.ipv4_addr, "10.0.0.9"),
            other => panic!("{other:?}"),
        }
        // Re-applying the same Node keeps the shared state.
        apply(&mut g, node("n2", "10.0.0.9"));
        let fourth = hosts(&mut g, "n2");
        assert!(
            third
                .iter()
                .zip(&fourth)
                .all(|(a, b)| SharedMessage::ptr_eq(a, b))
        );
    }

    #[test]
    fn a_flush_without_updates_sends_only_to_new_subscribers_and_misses_no_later_change() {
        let mut g = CalcGraph::new();
        apply(&mut g, node("n1", "10.0.0.1"));
        apply(
            &mut g,
            wep("a", "n1", "10.1.0.1", json!({"app": "x"}), json!([])),
        );
        apply(&mut g, gnp("p", "app == 'x'", "Allow", "app == 'x'"));
        g.apply(Update::InSync).unwrap();
        g.subscribe("n1");
        let first = g.flush();
        assert_eq!(first.len(), 1);
        assert!(kinds(&first[0].messages).contains(&"InSync".to_string()));
        // Agents connecting, no datastore change: each flush answers the newcomer alone.
        for n in ["n2", "n3"] {
            g.subscribe(n);
            let batches = g.flush();
            assert_eq!(
                batches.iter().map(|b| b.node.as_str()).collect::<Vec<_>>(),
                [n]
            );
            assert!(kinds(&batches[0].messages).contains(&"InSync".to_string()));
        }
        assert!(g.flush().is_empty(), "nothing changed, nothing sent");
        // A change after those flushes still reaches every node it concerns: a new member of
        // the policy's IP set on the node holding it, a new host everywhere.
        apply(
            &mut g,
            wep("b", "n2", "10.1.0.2", json!({"app": "x"}), json!([])),
        );
        apply(&mut g, node("n4", "10.0.0.4"));
        let batches = g.flush();
        let of = |n: &str| {
            batches
                .iter()
                .find(|b| b.node == n)
                .map(|b| kinds(&b.messages))
                .unwrap_or_default()
        };
        for (n, kind) in [
            ("n1", "IpsetDeltaUpdate"),
            ("n1", "HostMetadataUpdate"),
            ("n3", "HostMetadataUpdate"),
            ("n2", "WorkloadEndpointUpdate"),
        ] {
            assert!(of(n).contains(&kind.to_string()), "{n}: {:?}", of(n));
        }
        assert!(g.flush().is_empty());
    }

    #[test]
    fn broadcast_state_is_sent_whole_to_new_nodes_and_as_a_difference_to_others() {
        let host = |name: &str, ip: &str| pb::HostMetadataUpdate {
            hostname: name.into(),
            ipv4_addr: ip.into(),
            ..Default::default()
        };
        let before: BTreeMap<String, _> = [
            ("a".to_string(), host("a", "10.0.0.1")),
            ("b".to_string(), host("b", "10.0.0.2")),
            ("d".to_string(), host("d", "10.0.0.4")),
        ]
        .into();
        let now: BTreeMap<String, _> = [
            ("a".to_string(), host("a", "10.0.0.1")),
            ("b".to_string(), host("b", "10.0.1.2")),
            ("c".to_string(), host("c", "10.0.0.3")),
        ]
        .into();
        let run = |fresh| {
            let mut out = Vec::new();
            diff_broadcast(
                fresh,
                &before,
                &now,
                |u| Payload::HostMetadataUpdate(u.clone()),
                |k, _| {
                    Payload::HostMetadataRemove(pb::HostMetadataRemove {
                        hostname: k.to_string(),
                        ..Default::default()
                    })
                },
                &mut out,
            );
            out.into_iter()
                .map(|p| match p {
                    Payload::HostMetadataUpdate(u) => format!("update {}", u.hostname),
                    Payload::HostMetadataRemove(r) => format!("remove {}", r.hostname),
                    other => panic!("{other:?}"),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(true), ["update a", "update b", "update c"]);
        assert_eq!(run(false), ["update b", "update c", "remove d"]);
    }

    #[test]
    fn a_node_is_known_by_its_endpoints_its_node_resource_or_its_subscription() {
        let mut g = CalcGraph::new();
        apply(
            &mut g,
            wep("a", "with-pod", "10.0.0.1/32", json!({}), json!([])),
        );
        apply(&mut g, node("bare-node", "192.168.0.2"));
        g.subscribe("subscriber");
        for name in ["with-pod", "bare-node", "subscriber", "elsewhere"] {
            let listed = g.known_nodes().iter().any(|n| n == name);
            assert_eq!(g.is_known_node(name), listed, "{name}");
            assert_eq!(listed, name != "elsewhere", "{name}");
        }
    }
}
