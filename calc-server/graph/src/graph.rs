//! The calculation graph: one pure, synchronous computation for the whole cluster, projected
//! per node.
//!
//! Contract:
//! - [`CalcGraph::apply`] takes an [`Update`] (`Apply`, `ApplyValid`, `Delete`, `InSync`). It
//!   validates (unless the resource comes as a [`Valid`], validated once by its decoder) and
//!   converts the resource, updates the cluster-wide indexes (label index, IP-set members,
//!   per-node reference counts) and only *marks* per-node state dirty. An invalid object is
//!   rejected with a reason and the last good version of that key stays in force (see
//!   docs/architecture.md "Invalid updates").
//! - [`CalcGraph::flush`] computes, for every subscribed node, the messages that move it from
//!   what it was last sent to the current state, in dependency order (config → IP sets → policies
//!   → profiles → endpoints, removals reversed, then host metadata and IPAM pools), and `InSync`
//!   once after the datastore is in sync. Pending work is held as dirty keys and net IP-set
//!   deltas, so it is bounded by state, not by event rate, and the output depends only on the
//!   current state and what the node was sent — not on the path taken.
//! - Membership of every IP set referenced by any policy or profile is tracked cluster-wide; a
//!   node gets an IP set, policy or profile only while it is needed by one of its endpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use felix_proto as pb;
use pb::to_dataplane::Payload;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::convert::{self, EndpointKind, EndpointModel, LABEL_NAMESPACE, PolicyId, PolicyModel};
use crate::label_index::{ItemClass, ItemId, LabelIndex, SelectorId};
use crate::model::{Kind, NodeSpec, ObjectMeta, Resource, ResourceKey, Valid};
use crate::policy_resolver::{self, PolicyRef, TierMeta};
use crate::rule_scanner::{self, IpSetKind, IpSetSpec, ScannedRules};

/// One input to the graph.
// Updates are consumed at once; boxing the resource would only add an allocation per update.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    /// A resource the graph validates first.
    Apply(Resource),
    /// A resource validated on its way in (see [`Valid`]): not validated again.
    ApplyValid(Valid),
    Delete(ResourceKey),
    /// The datastore has delivered its complete snapshot.
    InSync,
}

/// An update the graph refused, with the reason. The previous good version (if any) stays.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct Rejection {
    pub key: ResourceKey,
    pub reason: String,
}

type Key = Arc<ResourceKey>;
type Name = Arc<str>;

struct EndpointState {
    key: Key,
    model: EndpointModel,
    node: Name,
    policies: FxHashSet<Key>,
    /// The endpoint's CIDRs as shared strings: its members of every selector IP set.
    nets: Vec<Arc<str>>,
}

struct NetSetState {
    nets: Vec<Arc<str>>,
}

struct PolicyState {
    model: PolicyModel,
    sort_string: String,
    selector: SelectorId,
    ipsets: Vec<Name>,
    message: Arc<pb::Policy>,
    /// The ActivePolicyUpdate, built once and shared by every node.
    update: SharedMessage,
}

struct ProfileState {
    message: Arc<pb::Profile>,
    update: SharedMessage,
    ipsets: Vec<Name>,
}

struct IpSetState {
    spec: IpSetSpec,
    selector: SelectorId,
    /// Policies and profiles whose rules reference this set.
    defined_refs: u32,
    members: FxHashMap<Arc<str>, u32>,
}

enum SelectorOwner {
    Policy(Key),
    IpSet(Name),
}

/// Per-node reference counts and dirty marks, kept for every node that has endpoints or
/// subscribers.
#[derive(Default)]
struct NodeState {
    endpoints: FxHashSet<Key>,
    policy_refs: FxHashMap<Key, u32>,
    profile_refs: FxHashMap<Name, u32>,
    ipset_refs: FxHashMap<Name, u32>,
    dirty_policies: FxHashSet<Key>,
    dirty_profiles: FxHashSet<Name>,
    dirty_ipsets: FxHashSet<Name>,
    dirty_endpoints: FxHashSet<Key>,
    sub: Option<Subscription>,
}

/// What a subscribed node has been sent.
#[derive(Default)]
struct Subscription {
    initialized: bool,
    in_sync_sent: bool,
    config: Option<pb::ConfigUpdate>,
    ipsets: FxHashSet<Name>,
    policies: FxHashMap<Key, Arc<pb::Policy>>,
    profiles: FxHashMap<Name, Arc<pb::Profile>>,
    /// Per endpoint: its removal message and a fingerprint of the update last sent.
    endpoints: FxHashMap<Key, (Payload, u64)>,
}

/// See the module documentation.
#[derive(Default)]
pub struct CalcGraph {
    index: LabelIndex,
    next_item: ItemId,
    next_selector: SelectorId,
    /// Ids given back by deleted items and selectors, reused first so ids stay small and never
    /// run out however many updates a long-running server sees.
    free_items: Vec<ItemId>,
    free_selectors: Vec<SelectorId>,
    /// Last good version of every accepted resource except endpoints (kept converted).
    resources: FxHashMap<Key, Resource>,
    item_of: FxHashMap<Key, ItemId>,
    endpoints: FxHashMap<ItemId, EndpointState>,
    netsets: FxHashMap<ItemId, NetSetState>,
    policies: FxHashMap<Key, PolicyState>,
    /// Policies with the AssumeNeededOnEveryNode hint: active on every node.
    everywhere: BTreeSet<Key>,
    profiles: FxHashMap<Name, ProfileState>,
    tiers: FxHashMap<String, TierMeta>,
    ipsets: FxHashMap<Name, IpSetState>,
    selector_owner: FxHashMap<SelectorId, SelectorOwner>,
    /// Net member changes since the last flush, per IP set id: `true` added, `false` removed.
    /// Only kept for sets some subscribed node holds (`ipset_sent_count`); others are sent whole.
    ipset_deltas: FxHashMap<Name, FxHashMap<Arc<str>, bool>>,
    /// How many subscribed nodes hold each IP set.
    ipset_sent_count: FxHashMap<Name, u32>,
    nodes: FxHashMap<Name, NodeState>,
    felix_config: BTreeMap<String, BTreeMap<String, String>>,
    config_dirty: bool,
    host_metadata: BTreeMap<String, pb::HostMetadataUpdate>,
    pools: BTreeMap<String, pb::IpamPoolUpdate>,
    /// IPPool resource name → pool id (CIDR with '-').
    pool_ids: FxHashMap<String, String>,
    /// Broadcast state as of the last flush, and the keys changed since.
    flushed_host_metadata: BTreeMap<String, pb::HostMetadataUpdate>,
    flushed_pools: BTreeMap<String, pb::IpamPoolUpdate>,
    in_sync: bool,
}

fn msg(p: Payload) -> pb::ToDataplane {
    pb::ToDataplane {
        sequence_number: 0,
        payload: Some(p),
    }
}

impl CalcGraph {
    pub fn new() -> CalcGraph {
        CalcGraph::default()
    }

    /// Label-index sizes and work done, for metrics and benchmarks.
    pub fn index_stats(&self) -> crate::label_index::IndexStats {
        self.index.stats()
    }

    /// Whether the datastore has reported in-sync.
    pub fn in_sync(&self) -> bool {
        self.in_sync
    }

    /// Nodes that have at least one endpoint, sorted.
    pub fn nodes_with_endpoints(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, n)| !n.endpoints.is_empty())
            .map(|(k, _)| k.to_string())
            .collect();
        v.sort();
        v
    }

    /// Every node the graph knows of: with endpoints, Node resources or subscribers; sorted.
    pub fn known_nodes(&self) -> Vec<String> {
        let mut v: BTreeSet<String> = self.nodes.keys().map(|k| k.to_string()).collect();
        v.extend(self.host_metadata.keys().cloned());
        v.into_iter().collect()
    }

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

    fn node_mut(&mut self, node: &str) -> &mut NodeState {
        if !self.nodes.contains_key(node) {
            self.nodes.insert(Arc::from(node), NodeState::default());
        }
        self.nodes.get_mut(node).expect("just inserted")
    }

    fn prune_node(&mut self, node: &str) {
        if let Some(n) = self.nodes.get(node)
            && n.sub.is_none()
            && n.endpoints.is_empty()
            && n.policy_refs.is_empty()
        {
            self.nodes.remove(node);
        }
    }

    /// Applies one update. On `Err`, nothing changed.
    pub fn apply(&mut self, update: Update) -> Result<(), Rejection> {
        match update {
            Update::InSync => {
                self.in_sync = true;
                Ok(())
            }
            Update::Delete(key) => {
                self.delete(Arc::new(key));
                Ok(())
            }
            Update::Apply(res) => match Valid::check(res) {
                Ok(valid) => self.apply(Update::ApplyValid(valid)),
                Err(invalid) => {
                    let reason = invalid
                        .errors
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; ");
                    Err(Rejection {
                        key: invalid.key,
                        reason,
                    })
                }
            },
            Update::ApplyValid(valid) => {
                let res = valid.into_resource();
                let key = Arc::new(res.key());
                // Endpoints are the bulk of a cluster: their converted form is kept (and compared
                // for no-op updates) instead of the whole resource.
                let endpoint = matches!(key.kind, Kind::WorkloadEndpoint | Kind::HostEndpoint);
                if !endpoint && self.resources.get(&key) == Some(&res) {
                    return Ok(());
                }
                self.install(key.clone(), &res)
                    .map_err(|reason| Rejection {
                        key: (*key).clone(),
                        reason,
                    })?;
                if !endpoint {
                    self.resources.insert(key, res);
                }
                Ok(())
            }
        }
    }

    fn delete(&mut self, key: Key) {
        let endpoint = matches!(key.kind, Kind::WorkloadEndpoint | Kind::HostEndpoint);
        if !endpoint && self.resources.remove(&key).is_none() {
            return;
        }
        match key.kind {
            Kind::NetworkPolicy | Kind::GlobalNetworkPolicy => self.remove_policy(&key),
            Kind::WorkloadEndpoint | Kind::HostEndpoint => self.remove_endpoint(&key),
            Kind::NetworkSet | Kind::GlobalNetworkSet => self.remove_netset(&key),
            Kind::Profile => self.set_profile(&key.name, None, &BTreeMap::new()),
            Kind::Tier => {
                self.tiers.remove(&key.name);
                self.touch_tier(&key.name);
            }
            Kind::IPPool => {
                if let Some(id) = self.pool_ids.remove(&key.name) {
                    self.pools.remove(&id);
                }
            }
            Kind::FelixConfiguration => {
                self.felix_config.remove(&key.name);
                self.config_dirty = true;
            }
            Kind::Node => {
                self.host_metadata.remove(&key.name);
            }
            Kind::ClusterInformation => {}
        }
    }

    /// Converts and installs a validated resource (replacing any previous version).
    fn install(&mut self, key: Key, res: &Resource) -> Result<(), String> {
        match res {
            Resource::NetworkPolicy(m, s) => {
                let model = convert::convert_policy(&key, s, m.namespace.as_deref())?;
                self.set_policy(key, model)
            }
            Resource::GlobalNetworkPolicy(_, s) => {
                let model = convert::convert_policy(&key, s, None)?;
                self.set_policy(key, model)
            }
            Resource::Tier(_, s) => {
                self.tiers.insert(
                    key.name.clone(),
                    TierMeta {
                        order: s.order,
                        default_action: if s.default_action == "Pass" {
                            "Pass".into()
                        } else {
                            "Deny".into()
                        },
                    },
                );
                self.touch_tier(&key.name);
                Ok(())
            }
            Resource::Profile(_, s) => {
                let inbound = convert::convert_profile_rules(&s.ingress)?;
                let outbound = convert::convert_profile_rules(&s.egress)?;
                let scanned = rule_scanner::scan_rules(
                    &inbound,
                    &outbound,
                    (
                        &format!("prof-in-{}", key.name),
                        &format!("prof-out-{}", key.name),
                    ),
                )?;
                self.set_profile(&key.name, Some(scanned), &s.labels_to_apply);
                Ok(())
            }
            Resource::WorkloadEndpoint(m, s) => {
                match convert::convert_workload_endpoint(m, s)? {
                    Some(ep) => self.set_endpoint(key, ep),
                    // No IPs yet: Felix filters it out, exactly as if it were deleted.
                    None => self.remove_endpoint(&key),
                }
                Ok(())
            }
            Resource::HostEndpoint(m, s) => {
                self.set_endpoint(key, convert::convert_host_endpoint(m, s));
                Ok(())
            }
            Resource::NetworkSet(m, s) | Resource::GlobalNetworkSet(m, s) => {
                self.set_netset(key, m, &s.nets);
                Ok(())
            }
            Resource::IPPool(_, s) => {
                if let Some(id) = self.pool_ids.remove(&key.name) {
                    self.pools.remove(&id);
                }
                if let Some(net) = crate::model::validate::parse_cidr_or_ip(&s.cidr) {
                    let cidr = net.to_string();
                    let id = cidr.replace('/', "-");
                    self.pools.insert(
                        id.clone(),
                        pb::IpamPoolUpdate {
                            id,
                            pool: Some(pb::IpamPool {
                                cidr,
                                masquerade: s.nat_outgoing,
                                ipip_mode: s.ipip_mode.clone(),
                                vxlan_mode: s.vxlan_mode.clone(),
                                allowed_uses: s.allowed_uses.clone(),
                            }),
                        },
                    );
                    self.pool_ids
                        .insert(key.name.clone(), net.to_string().replace('/', "-"));
                }
                Ok(())
            }
            Resource::FelixConfiguration(_, spec) => {
                let cfg = spec
                    .iter()
                    .map(|(k, v)| (felix_param_name(k), config_value(v)))
                    .collect();
                self.felix_config.insert(key.name.clone(), cfg);
                self.config_dirty = true;
                Ok(())
            }
            Resource::Node(m, s) => {
                self.host_metadata
                    .insert(key.name.clone(), host_metadata(m, s));
                Ok(())
            }
            Resource::ClusterInformation(..) => Ok(()),
        }
    }
}

/// Adds a reference (`up`) or drops one; true when the count went from or to zero. Dropping
/// an absent key is a no-op.
fn bump<K: std::hash::Hash + Eq + Clone>(map: &mut FxHashMap<K, u32>, key: &K, up: bool) -> bool {
    if up {
        let c = map.entry(key.clone()).or_insert(0);
        *c += 1;
        return *c == 1;
    }
    match map.get_mut(key) {
        Some(c) if *c > 1 => {
            *c -= 1;
            false
        }
        Some(_) => {
            map.remove(key);
            true
        }
        None => false,
    }
}

/// Felix's parameter name for a FelixConfiguration field: `iptablesRefreshInterval` →
/// `IptablesRefreshInterval`.
fn felix_param_name(field: &str) -> String {
    let mut c = field.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

fn config_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn host_metadata(m: &ObjectMeta, s: &NodeSpec) -> pb::HostMetadataUpdate {
    let strip = |a: &str| a.split('/').next().unwrap_or_default().to_string();
    let bgp = s.bgp.clone().unwrap_or_default();
    pb::HostMetadataUpdate {
        hostname: m.name.clone(),
        ipv4_addr: strip(&bgp.ipv4_address),
        ipv6_addr: strip(&bgp.ipv6_address),
        asnumber: bgp.as_number.map(|a| config_value(&a)).unwrap_or_default(),
        labels: m.labels.clone().into_iter().collect(),
    }
}

/// IP-set members an item contributes to a set of the given kind.
fn members_of(
    ep: Option<&EndpointState>,
    ns: Option<&NetSetState>,
    kind: &IpSetKind,
) -> Vec<Arc<str>> {
    match (kind, ep, ns) {
        (IpSetKind::Net, Some(ep), _) => ep.nets.clone(),
        (IpSetKind::Net, None, Some(ns)) => ns.nets.clone(),
        (IpSetKind::NamedPort { protocol, name }, Some(ep), _) => {
            let mut out = Vec::new();
            for p in ep
                .model
                .ports
                .iter()
                .filter(|p| &p.name == name && &p.protocol == protocol)
            {
                for net in &ep.nets {
                    let ip = net.split('/').next().unwrap_or_default();
                    out.push(Arc::from(format!("{ip},{}:{}", p.protocol, p.port)));
                }
            }
            out
        }
        _ => Vec::new(),
    }
}

impl CalcGraph {
    fn alloc_selector(&mut self) -> SelectorId {
        if let Some(id) = self.free_selectors.pop() {
            return id;
        }
        self.next_selector += 1;
        self.next_selector
    }

    fn alloc_item(&mut self) -> ItemId {
        if let Some(id) = self.free_items.pop() {
            return id;
        }
        self.next_item += 1;
        self.next_item
    }

    /// Routes the label index's match events to their owners.
    fn process_events(&mut self) {
        loop {
            let events = self.index.take_events();
            if events.is_empty() {
                return;
            }
            for ev in events {
                match self.selector_owner.get(&ev.selector) {
                    Some(SelectorOwner::Policy(pkey)) => {
                        let pkey = pkey.clone();
                        let Some(ep) = self.endpoints.get_mut(&ev.item) else {
                            continue;
                        };
                        let node = ep.node.clone();
                        let ekey = ep.key.clone();
                        if ev.matched {
                            ep.policies.insert(pkey.clone());
                            self.node_policy_inc(&node, &pkey);
                        } else {
                            ep.policies.remove(&pkey);
                            self.node_policy_dec(&node, &pkey);
                        }
                        self.node_mut(&node).dirty_endpoints.insert(ekey);
                    }
                    Some(SelectorOwner::IpSet(id)) => {
                        let id = id.clone();
                        let Some(set) = self.ipsets.get(&id) else {
                            continue;
                        };
                        let members = members_of(
                            self.endpoints.get(&ev.item),
                            self.netsets.get(&ev.item),
                            &set.spec.kind,
                        );
                        for m in members {
                            self.member_change(&id, m, ev.matched);
                        }
                    }
                    None => {}
                }
            }
        }
    }

    fn member_change(&mut self, id: &Name, member: Arc<str>, add: bool) {
        let Some(set) = self.ipsets.get_mut(id) else {
            return;
        };
        let changed = if add {
            let c = set.members.entry(member.clone()).or_insert(0);
            *c += 1;
            *c == 1
        } else {
            match set.members.get_mut(&member) {
                Some(c) if *c > 1 => {
                    *c -= 1;
                    false
                }
                Some(_) => {
                    set.members.remove(&member);
                    true
                }
                None => false,
            }
        };
        if changed && self.ipset_sent_count.contains_key(id) {
            let d = self.ipset_deltas.entry(id.clone()).or_default();
            // An add then a remove of the same member (or the reverse) cancels out.
            match d.get(&member) {
                Some(&prev) if prev != add => {
                    d.remove(&member);
                }
                _ => {
                    d.insert(member, add);
                }
            }
        }
    }

    fn define_ipsets(&mut self, specs: &[IpSetSpec]) -> Vec<Name> {
        let mut ids = Vec::with_capacity(specs.len());
        for spec in specs {
            let id: Name = Arc::from(spec.id.as_str());
            if let Some(set) = self.ipsets.get_mut(&id) {
                set.defined_refs += 1;
            } else {
                let sel = self.alloc_selector();
                self.selector_owner
                    .insert(sel, SelectorOwner::IpSet(id.clone()));
                self.ipsets.insert(
                    id.clone(),
                    IpSetState {
                        spec: spec.clone(),
                        selector: sel,
                        defined_refs: 1,
                        members: FxHashMap::default(),
                    },
                );
                // Service sets have no label selector (and no members until services are tracked).
                if !matches!(spec.kind, IpSetKind::Service { .. }) {
                    let endpoints_only = matches!(spec.kind, IpSetKind::NamedPort { .. });
                    self.index
                        .add_selector(sel, spec.selector.clone(), endpoints_only);
                    self.process_events();
                }
            }
            ids.push(id);
        }
        ids
    }

    fn undefine_ipsets(&mut self, ids: &[Name]) {
        for id in ids {
            let Some(set) = self.ipsets.get_mut(id) else {
                continue;
            };
            set.defined_refs -= 1;
            if set.defined_refs == 0 {
                let sel = set.selector;
                self.index.remove_selector(sel);
                self.process_events();
                self.selector_owner.remove(&sel);
                self.free_selectors.push(sel);
                self.ipsets.remove(id);
            }
        }
    }

    /// One more (`up`) or one fewer reference to an IP set on a node.
    fn node_ipset_ref(&mut self, node: &str, id: &Name, up: bool) {
        let n = self.node_mut(node);
        if bump(&mut n.ipset_refs, id, up) {
            n.dirty_ipsets.insert(id.clone());
        }
    }

    fn node_ipset_inc(&mut self, node: &str, id: &Name) {
        self.node_ipset_ref(node, id, true);
    }

    fn node_ipset_dec(&mut self, node: &str, id: &Name) {
        self.node_ipset_ref(node, id, false);
    }

    /// One more or one fewer endpoint on a node selected by a policy; the policy's IP sets
    /// follow its activation there (hinted policies' sets are needed everywhere, not counted).
    fn node_policy_ref(&mut self, node: &str, pkey: &Key, up: bool) {
        let n = self.node_mut(node);
        if !bump(&mut n.policy_refs, pkey, up) {
            return;
        }
        n.dirty_policies.insert(pkey.clone());
        if self.everywhere.contains(pkey) {
            return;
        }
        let ipsets = self
            .policies
            .get(pkey)
            .map(|p| p.ipsets.clone())
            .unwrap_or_default();
        for id in &ipsets {
            self.node_ipset_ref(node, id, up);
        }
    }

    fn node_policy_inc(&mut self, node: &str, pkey: &Key) {
        self.node_policy_ref(node, pkey, true);
    }

    fn node_policy_dec(&mut self, node: &str, pkey: &Key) {
        self.node_policy_ref(node, pkey, false);
    }

    /// One more or one fewer endpoint on a node listing a profile; its IP sets follow.
    fn node_profile_ref(&mut self, node: &str, name: &Name, up: bool) {
        let n = self.node_mut(node);
        if !bump(&mut n.profile_refs, name, up) {
            return;
        }
        n.dirty_profiles.insert(name.clone());
        let ipsets = self
            .profiles
            .get(name)
            .map(|p| p.ipsets.clone())
            .unwrap_or_default();
        for id in &ipsets {
            self.node_ipset_ref(node, id, up);
        }
    }

    fn node_profile_inc(&mut self, node: &str, name: &Name) {
        self.node_profile_ref(node, name, true);
    }

    fn node_profile_dec(&mut self, node: &str, name: &Name) {
        self.node_profile_ref(node, name, false);
    }

    fn set_policy(&mut self, key: Key, model: PolicyModel) -> Result<(), String> {
        let scanned = rule_scanner::scan_rules(
            &model.inbound,
            &model.outbound,
            (
                &format!("pol-in-default/{}", model.id.name),
                &format!("pol-out-default/{}", model.id.name),
            ),
        )?;
        // Define the new IP sets before dropping the old ones so shared sets keep their members.
        let ipsets = self.define_ipsets(&scanned.ipsets);
        if self
            .policies
            .get(&key)
            .is_some_and(|old| same_placement(&old.model, &model))
        {
            self.replace_policy_rules(&key, model, &scanned, ipsets);
            return Ok(());
        }
        self.remove_policy(&key);
        let message = Arc::new(policy_message(&model, &scanned));
        let update = Arc::new(msg(Payload::ActivePolicyUpdate(pb::ActivePolicyUpdate {
            id: Some(policy_id_proto(&model.id)),
            policy: Some((*message).clone()),
        })));
        let sel = self.alloc_selector();
        self.selector_owner
            .insert(sel, SelectorOwner::Policy(key.clone()));
        let everywhere = model.assume_needed_on_every_node();
        let selector = model.selector.clone();
        self.policies.insert(
            key.clone(),
            PolicyState {
                sort_string: model.id.sort_string(),
                model,
                selector: sel,
                ipsets: ipsets.clone(),
                message,
                update,
            },
        );
        if everywhere {
            // Needed on every node, including nodes that appear later: not reference counted
            // per node; flush treats the policy and its IP sets as needed everywhere.
            self.everywhere.insert(key.clone());
            self.mark_everywhere_dirty(&key, &ipsets);
        }
        self.index.add_selector(sel, selector, true);
        self.process_events();
        // Nodes that were sent the previous version need the new content.
        self.touch_policy(&key, false);
        Ok(())
    }

    /// A new version of a policy that applies to the same endpoints in the same place (only
    /// its rules differ): swap the rules and IP sets in place. Endpoints are untouched, so a
    /// rule edit costs the nodes running the policy, not every endpoint it selects.
    fn replace_policy_rules(
        &mut self,
        key: &Key,
        model: PolicyModel,
        scanned: &ScannedRules,
        ipsets: Vec<Name>,
    ) {
        let message = Arc::new(policy_message(&model, scanned));
        let update = Arc::new(msg(Payload::ActivePolicyUpdate(pb::ActivePolicyUpdate {
            id: Some(policy_id_proto(&model.id)),
            policy: Some((*message).clone()),
        })));
        let state = self.policies.get_mut(key).expect("checked by the caller");
        let old_ipsets = std::mem::replace(&mut state.ipsets, ipsets.clone());
        state.model = model;
        state.message = message;
        state.update = update;
        if self.everywhere.contains(key) {
            let both: Vec<Name> = ipsets.iter().chain(&old_ipsets).cloned().collect();
            self.mark_everywhere_dirty(key, &both);
        } else {
            let active_on: Vec<Name> = self
                .nodes
                .iter()
                .filter(|(_, n)| n.policy_refs.contains_key(key))
                .map(|(k, _)| k.clone())
                .collect();
            for node in &active_on {
                for id in &ipsets {
                    self.node_ipset_inc(node, id);
                }
                for id in &old_ipsets {
                    self.node_ipset_dec(node, id);
                }
            }
        }
        self.undefine_ipsets(&old_ipsets);
        self.touch_policy(key, false);
    }

    fn mark_everywhere_dirty(&mut self, key: &Key, ipsets: &[Name]) {
        for n in self.nodes.values_mut() {
            n.dirty_policies.insert(key.clone());
            n.dirty_ipsets.extend(ipsets.iter().cloned());
        }
    }

    fn remove_policy(&mut self, key: &Key) {
        let Some(sel) = self.policies.get(key).map(|p| p.selector) else {
            return;
        };
        self.index.remove_selector(sel);
        self.process_events();
        self.selector_owner.remove(&sel);
        self.free_selectors.push(sel);
        let state = self.policies.remove(key).expect("checked above");
        if self.everywhere.remove(key) {
            self.mark_everywhere_dirty(key, &state.ipsets);
        }
        self.undefine_ipsets(&state.ipsets);
        self.touch_policy(key, false);
    }

    /// Marks a policy dirty on every node that runs it or was sent it and, with `endpoints`,
    /// the endpoints it applies to (their tier lists change when its tier is reordered).
    fn touch_policy(&mut self, key: &Key, endpoints: bool) {
        let sel = self.policies.get(key).map(|p| p.selector);
        for n in self.nodes.values_mut() {
            if n.policy_refs.contains_key(key)
                || n.sub.as_ref().is_some_and(|s| s.policies.contains_key(key))
                || self.everywhere.contains(key)
            {
                n.dirty_policies.insert(key.clone());
            }
        }
        if let Some(sel) = sel.filter(|_| endpoints) {
            let items: Vec<ItemId> = self.index.matches(sel).collect();
            for item in items {
                if let Some(ep) = self.endpoints.get(&item) {
                    let (node, ekey) = (ep.node.clone(), ep.key.clone());
                    self.node_mut(&node).dirty_endpoints.insert(ekey);
                }
            }
        }
    }

    /// A tier's order or default action changed: every endpoint with a policy in it is dirty.
    fn touch_tier(&mut self, tier: &str) {
        let keys: Vec<Key> = self
            .policies
            .iter()
            .filter(|(_, p)| p.model.tier == tier)
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            self.touch_policy(&k, true);
        }
    }

    fn set_profile(
        &mut self,
        name: &str,
        scanned: Option<ScannedRules>,
        labels: &BTreeMap<String, String>,
    ) {
        let name: Name = Arc::from(name);
        let (messages, new_ipsets) = match &scanned {
            Some(s) => (
                profile_messages(
                    &name,
                    pb::Profile {
                        inbound_rules: s.inbound.clone(),
                        outbound_rules: s.outbound.clone(),
                    },
                ),
                self.define_ipsets(&s.ipsets),
            ),
            None => (profile_messages(&name, pb::Profile::default()), Vec::new()),
        };
        let old_ipsets = self
            .profiles
            .get(&name)
            .map(|p| p.ipsets.clone())
            .unwrap_or_default();
        let active_on: Vec<Name> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.profile_refs.contains_key(&name))
            .map(|(k, _)| k.clone())
            .collect();
        for node in &active_on {
            for id in &new_ipsets {
                self.node_ipset_inc(node, id);
            }
            for id in &old_ipsets {
                self.node_ipset_dec(node, id);
            }
        }
        match scanned {
            Some(_) => {
                let (message, update) = messages;
                self.profiles.insert(
                    name.clone(),
                    ProfileState {
                        message,
                        update,
                        ipsets: new_ipsets,
                    },
                );
            }
            None => {
                self.profiles.remove(&name);
            }
        }
        self.undefine_ipsets(&old_ipsets);
        for n in self.nodes.values_mut() {
            if n.profile_refs.contains_key(&name)
                || n.sub
                    .as_ref()
                    .is_some_and(|s| s.profiles.contains_key(&name))
            {
                n.dirty_profiles.insert(name.clone());
            }
        }
        self.index.set_parent_labels(&name, labels);
        self.process_events();
    }

    fn set_endpoint(&mut self, key: Key, model: EndpointModel) {
        if let Some(item) = self.item_of.get(&key)
            && self.endpoints.get(item).is_some_and(|e| e.model == model)
        {
            return;
        }
        self.remove_endpoint(&key);
        let item = self.alloc_item();
        let node: Name = Arc::from(model.node.as_str());
        let labels = model.labels.clone();
        let profiles = model.profile_ids.clone();
        {
            let n = self.node_mut(&node);
            n.endpoints.insert(key.clone());
            n.dirty_endpoints.insert(key.clone());
        }
        for p in &profiles {
            self.node_profile_inc(&node, &Arc::from(p.as_str()));
        }
        self.item_of.insert(key.clone(), item);
        let nets = model
            .ipv4_nets
            .iter()
            .chain(&model.ipv6_nets)
            .map(|n| Arc::from(n.as_str()))
            .collect();
        self.endpoints.insert(
            item,
            EndpointState {
                key,
                model,
                node,
                policies: FxHashSet::default(),
                nets,
            },
        );
        self.index
            .set_item(item, ItemClass::Endpoint, &labels, &profiles);
        self.process_events();
    }

    fn remove_endpoint(&mut self, key: &Key) {
        let Some(item) = self.item_of.get(key).copied() else {
            return;
        };
        if !self.endpoints.contains_key(&item) {
            return;
        }
        self.index.remove_item(item);
        self.process_events();
        self.item_of.remove(key);
        let ep = self.endpoints.remove(&item).expect("checked above");
        self.free_items.push(item);
        {
            let n = self.node_mut(&ep.node);
            n.endpoints.remove(key);
            n.dirty_endpoints.insert(key.clone());
        }
        for p in &ep.model.profile_ids {
            self.node_profile_dec(&ep.node, &Arc::from(p.as_str()));
        }
        self.prune_node(&ep.node.clone());
    }

    fn set_netset(&mut self, key: Key, meta: &ObjectMeta, nets: &[String]) {
        self.remove_netset(&key);
        let item = self.alloc_item();
        let mut labels = meta.labels.clone();
        let mut parents = Vec::new();
        if let Some(ns) = &key.namespace {
            labels.insert(LABEL_NAMESPACE.into(), ns.clone());
            parents.push(format!("kns.{ns}"));
        }
        let mut masked: Vec<String> = nets
            .iter()
            .filter_map(|n| crate::model::validate::parse_cidr_or_ip(n))
            .filter_map(|n| ipnetwork::IpNetwork::new(n.network(), n.prefix()).ok())
            .map(|n| n.to_string())
            .collect();
        masked.sort();
        masked.dedup();
        self.item_of.insert(key, item);
        let nets = masked.iter().map(|n| Arc::from(n.as_str())).collect();
        self.netsets.insert(item, NetSetState { nets });
        self.index
            .set_item(item, ItemClass::NetworkSet, &labels, &parents);
        self.process_events();
    }

    fn remove_netset(&mut self, key: &Key) {
        let Some(item) = self.item_of.get(key).copied() else {
            return;
        };
        if !self.netsets.contains_key(&item) {
            return;
        }
        self.index.remove_item(item);
        self.process_events();
        self.item_of.remove(key);
        self.netsets.remove(&item);
        self.free_items.push(item);
    }
}

/// Whether two versions of a policy select the same endpoints and sit in the same place in
/// their tier lists (so only the rules can differ).
fn same_placement(a: &PolicyModel, b: &PolicyModel) -> bool {
    a.id == b.id
        && a.tier == b.tier
        && a.order.map(f64::to_bits) == b.order.map(f64::to_bits)
        && a.selector.canonical() == b.selector.canonical()
        && a.ingress == b.ingress
        && a.egress == b.egress
        && a.untracked == b.untracked
        && a.pre_dnat == b.pre_dnat
        && a.apply_on_forward == b.apply_on_forward
        && a.performance_hints == b.performance_hints
}

fn policy_message(model: &PolicyModel, scanned: &ScannedRules) -> pb::Policy {
    pb::Policy {
        inbound_rules: scanned.inbound.clone(),
        outbound_rules: scanned.outbound.clone(),
        untracked: model.untracked,
        pre_dnat: model.pre_dnat,
        namespace: model.namespace.clone(),
        original_selector: model.selector.canonical().to_string(),
        perf_hints: model.performance_hints.clone(),
        tier: model.tier.clone(),
    }
}

fn profile_messages(name: &str, profile: pb::Profile) -> (Arc<pb::Profile>, SharedMessage) {
    let update = Arc::new(msg(Payload::ActiveProfileUpdate(pb::ActiveProfileUpdate {
        id: Some(pb::ProfileId {
            name: name.to_string(),
        }),
        profile: Some(profile.clone()),
    })));
    (Arc::new(profile), update)
}

fn policy_id_proto(id: &PolicyId) -> pb::PolicyId {
    pb::PolicyId {
        name: id.name.clone(),
        namespace: id.namespace.clone(),
        kind: id.kind.clone(),
    }
}

/// A message shared by every node that receives it in one flush (encode once, send many).
pub type SharedMessage = Arc<pb::ToDataplane>;

/// Messages for one node from one flush. Sequence numbers are left at 0: the stream that
/// carries them numbers them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeBatch {
    pub node: String,
    pub messages: Vec<SharedMessage>,
}

/// Messages built once per flush and shared by every node that needs them.
#[derive(Default)]
struct FlushCache {
    ipset_full: FxHashMap<Name, SharedMessage>,
    ipset_delta: FxHashMap<Name, Option<SharedMessage>>,
    missing_profiles: FxHashMap<Name, (Arc<pb::Profile>, SharedMessage)>,
    broadcast_full: Option<Vec<SharedMessage>>,
    broadcast_delta: Option<Vec<SharedMessage>>,
    everywhere_ipsets: Option<FxHashSet<Name>>,
}

impl CalcGraph {
    fn endpoint_message(&self, key: &Key) -> Option<Payload> {
        let item = self.item_of.get(key)?;
        let ep = self.endpoints.get(item)?;
        let refs: Vec<PolicyRef<'_>> = ep
            .policies
            .iter()
            .filter_map(|k| self.policies.get(k))
            .map(|p| PolicyRef {
                model: &p.model,
                sort_string: &p.sort_string,
            })
            .collect();
        let tiers = policy_resolver::resolve(refs, |t| self.tiers.get(t));
        let m = &ep.model;
        Some(match &m.kind {
            EndpointKind::Workload {
                orchestrator_id,
                workload_id,
                endpoint_id,
                interface_name,
                mac,
                ipv4_nat,
                ipv6_nat,
                allow_spoofed_source_prefixes,
            } => {
                let nat = |v: &Vec<(String, String)>| {
                    v.iter()
                        .map(|(ext, int)| pb::NatInfo {
                            ext_ip: ext.clone(),
                            int_ip: int.clone(),
                        })
                        .collect()
                };
                Payload::WorkloadEndpointUpdate(pb::WorkloadEndpointUpdate {
                    id: Some(pb::WorkloadEndpointId {
                        orchestrator_id: orchestrator_id.clone(),
                        workload_id: workload_id.clone(),
                        endpoint_id: endpoint_id.clone(),
                    }),
                    endpoint: Some(pb::WorkloadEndpoint {
                        state: "active".into(),
                        name: interface_name.clone(),
                        mac: mac.clone(),
                        profile_ids: m.profile_ids.clone(),
                        ipv4_nets: m.ipv4_nets.clone(),
                        ipv6_nets: m.ipv6_nets.clone(),
                        tiers: tiers.normal,
                        ipv4_nat: nat(ipv4_nat),
                        ipv6_nat: nat(ipv6_nat),
                        allow_spoofed_source_prefixes: allow_spoofed_source_prefixes.clone(),
                        ..Default::default()
                    }),
                })
            }
            EndpointKind::Host {
                endpoint_id,
                interface_name,
                expected_ipv4,
                expected_ipv6,
            } => Payload::HostEndpointUpdate(pb::HostEndpointUpdate {
                id: Some(pb::HostEndpointId {
                    endpoint_id: endpoint_id.clone(),
                }),
                endpoint: Some(pb::HostEndpoint {
                    name: interface_name.clone(),
                    profile_ids: m.profile_ids.clone(),
                    tiers: tiers.normal,
                    expected_ipv4_addrs: expected_ipv4.clone(),
                    expected_ipv6_addrs: expected_ipv6.clone(),
                    untracked_tiers: tiers.untracked,
                    pre_dnat_tiers: tiers.pre_dnat,
                    forward_tiers: tiers.forward,
                    ..Default::default()
                }),
            }),
        })
    }

    fn config_for(&self, node: &str) -> pb::ConfigUpdate {
        let global = self
            .felix_config
            .get("default")
            .cloned()
            .unwrap_or_default();
        let local = self
            .felix_config
            .get(&format!("node.{node}"))
            .cloned()
            .unwrap_or_default();
        let mut config = global.clone();
        config.extend(local.clone());
        let mut raw = BTreeMap::new();
        if !global.is_empty() {
            raw.insert(
                1,
                pb::RawConfig {
                    source: "DatastoreGlobal".into(),
                    config: global,
                },
            );
        }
        if !local.is_empty() {
            raw.insert(
                3,
                pb::RawConfig {
                    source: "DatastorePerHost".into(),
                    config: local,
                },
            );
        }
        pb::ConfigUpdate {
            config,
            source_to_raw_config: raw,
            message: String::new(),
        }
    }

    fn ipset_full(&self, cache: &mut FlushCache, id: &Name) -> Option<SharedMessage> {
        if let Some(m) = cache.ipset_full.get(id) {
            return Some(m.clone());
        }
        let set = self.ipsets.get(id)?;
        let mut members: Vec<String> = set.members.keys().map(|m| m.to_string()).collect();
        members.sort_unstable();
        let m = Arc::new(msg(Payload::IpsetUpdate(pb::IpSetUpdate {
            id: id.to_string(),
            members,
            r#type: set.spec.proto_type() as i32,
        })));
        cache.ipset_full.insert(id.clone(), m.clone());
        Some(m)
    }

    fn ipset_delta(&self, cache: &mut FlushCache, id: &Name) -> Option<SharedMessage> {
        if let Some(m) = cache.ipset_delta.get(id) {
            return m.clone();
        }
        let m = self.ipset_deltas.get(id).and_then(|d| {
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
            Some(Arc::new(msg(Payload::IpsetDeltaUpdate(
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
        let mut out = Vec::new();
        diff_broadcast(
            fresh,
            &self.flushed_host_metadata,
            &self.host_metadata,
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
            &self.flushed_pools,
            &self.pools,
            |u| Payload::IpamPoolUpdate(u.clone()),
            |k, _| Payload::IpamPoolRemove(pb::IpamPoolRemove { id: k.to_string() }),
            &mut out,
        );
        let v: Vec<SharedMessage> = out.into_iter().map(|p| Arc::new(msg(p))).collect();
        if fresh {
            cache.broadcast_full = Some(v.clone());
        } else {
            cache.broadcast_delta = Some(v.clone());
        }
        v
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
        let mut names: Vec<Name> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.sub.is_some())
            .map(|(k, _)| k.clone())
            .collect();
        names.sort();
        let mut cache = FlushCache::default();
        for name in names {
            let messages = self.flush_node(&name, &mut cache);
            if !messages.is_empty() {
                sink(NodeBatch {
                    node: name.to_string(),
                    messages,
                });
            }
        }
        // Per-node dirty marks of unsubscribed nodes carry no meaning once flushed.
        for n in self.nodes.values_mut() {
            if n.sub.is_none() {
                n.dirty_endpoints.clear();
                n.dirty_ipsets.clear();
                n.dirty_policies.clear();
                n.dirty_profiles.clear();
            }
        }
        self.ipset_deltas.clear();
        self.config_dirty = false;
        if self.flushed_host_metadata != self.host_metadata {
            self.flushed_host_metadata = self.host_metadata.clone();
        }
        if self.flushed_pools != self.pools {
            self.flushed_pools = self.pools.clone();
        }
        let stale: Vec<Name> = self.nodes.keys().cloned().collect();
        for n in stale {
            self.prune_node(&n);
        }
        self.index.collect_garbage();
    }

    /// The complete current span of a node, as a fresh subscriber would receive it (snapshot
    /// then `InSync` if the datastore is in sync). Does not disturb subscriptions.
    pub fn snapshot(&mut self, node: &str) -> Vec<SharedMessage> {
        let n = self.node_mut(node);
        let existing = n.sub.take();
        // flush_node consumes the dirty marks; the real subscription still needs them.
        let dirty = (
            n.dirty_ipsets.clone(),
            n.dirty_policies.clone(),
            n.dirty_profiles.clone(),
            n.dirty_endpoints.clone(),
        );
        n.sub = Some(Subscription::default());
        let out = self.flush_node(&Arc::from(node), &mut FlushCache::default());
        // The throwaway subscription must not count as a receiver of IP-set deltas.
        if let Some(tmp) = self.node_mut(node).sub.take() {
            self.forget_sent_ipsets(&tmp);
        }
        let n = self.node_mut(node);
        (
            n.dirty_ipsets,
            n.dirty_policies,
            n.dirty_profiles,
            n.dirty_endpoints,
        ) = dirty;
        n.sub = existing;
        out
    }

    fn forget_sent_ipsets(&mut self, sub: &Subscription) {
        for id in &sub.ipsets {
            if let Some(c) = self.ipset_sent_count.get_mut(id) {
                *c -= 1;
                if *c == 0 {
                    self.ipset_sent_count.remove(id);
                }
            }
        }
    }

    fn flush_node(&mut self, name: &Name, cache: &mut FlushCache) -> Vec<SharedMessage> {
        let Some(node) = self.nodes.get_mut(name) else {
            return Vec::new();
        };
        let mut sub = node.sub.take().expect("flush_node on a subscribed node");
        let dirty_ipsets = std::mem::take(&mut node.dirty_ipsets);
        let dirty_policies = std::mem::take(&mut node.dirty_policies);
        let dirty_profiles = std::mem::take(&mut node.dirty_profiles);
        let dirty_endpoints = std::mem::take(&mut node.dirty_endpoints);
        let fresh = !sub.initialized;
        let mut sent_count_changes: Vec<(Name, bool)> = Vec::new();
        if cache.everywhere_ipsets.is_none() {
            cache.everywhere_ipsets = Some(
                self.everywhere
                    .iter()
                    .filter_map(|k| self.policies.get(k))
                    .flat_map(|p| p.ipsets.iter().cloned())
                    .collect(),
            );
        }
        let everywhere_ipsets = cache.everywhere_ipsets.take().unwrap_or_default();
        let node = &self.nodes[name];

        let mut out: Vec<SharedMessage> = Vec::new();
        // Config.
        if fresh || self.config_dirty {
            let cfg = self.config_for(name);
            if sub.config.as_ref() != Some(&cfg) {
                sub.config = Some(cfg.clone());
                out.push(Arc::new(msg(Payload::ConfigUpdate(cfg))));
            }
        }

        // IP sets.
        let needed = |id: &Name| {
            self.ipsets.contains_key(id)
                && (node.ipset_refs.contains_key(id) || everywhere_ipsets.contains(id))
        };
        let mut ipset_candidates: BTreeSet<Name> = BTreeSet::new();
        if fresh {
            ipset_candidates.extend(node.ipset_refs.keys().cloned());
        } else {
            ipset_candidates.extend(dirty_ipsets.iter().cloned());
            for id in self.ipset_deltas.keys() {
                if sub.ipsets.contains(id) {
                    ipset_candidates.insert(id.clone());
                }
            }
        }
        ipset_candidates.extend(everywhere_ipsets.iter().cloned());
        let (mut ipset_adds, mut ipset_deltas, mut ipset_removes) =
            (Vec::new(), Vec::new(), Vec::new());
        for id in ipset_candidates {
            let (need, sent) = (needed(&id), sub.ipsets.contains(&id));
            if need && !sent {
                if let Some(m) = self.ipset_full(cache, &id) {
                    ipset_adds.push(m);
                    sub.ipsets.insert(id.clone());
                    sent_count_changes.push((id, true));
                }
            } else if need && sent {
                if let Some(m) = self.ipset_delta(cache, &id) {
                    ipset_deltas.push(m);
                }
            } else if !need && sent {
                ipset_removes.push(Arc::new(msg(Payload::IpsetRemove(pb::IpSetRemove {
                    id: id.to_string(),
                }))));
                sub.ipsets.remove(&id);
                sent_count_changes.push((id, false));
            }
        }

        // Policies.
        let mut policy_candidates: BTreeSet<Key> = BTreeSet::new();
        if fresh {
            policy_candidates.extend(node.policy_refs.keys().cloned());
        } else {
            policy_candidates.extend(dirty_policies.iter().cloned());
        }
        policy_candidates.extend(self.everywhere.iter().cloned());
        let (mut policy_updates, mut policy_removes) = (Vec::new(), Vec::new());
        for key in policy_candidates {
            let current = self
                .policies
                .get(&key)
                .filter(|_| node.policy_refs.contains_key(&key) || self.everywhere.contains(&key));
            match current {
                Some(p) => {
                    let same = sub
                        .policies
                        .get(&key)
                        .is_some_and(|s| Arc::ptr_eq(s, &p.message) || **s == *p.message);
                    if !same {
                        sub.policies.insert(key.clone(), p.message.clone());
                        policy_updates.push(p.update.clone());
                    }
                }
                None => {
                    if sub.policies.remove(&key).is_some() {
                        policy_removes.push(Arc::new(msg(Payload::ActivePolicyRemove(
                            pb::ActivePolicyRemove {
                                id: Some(policy_id_proto(&PolicyId::from_key(&key))),
                            },
                        ))));
                    }
                }
            }
        }

        // Profiles.
        let profile_candidates: BTreeSet<Name> = if fresh {
            node.profile_refs.keys().cloned().collect()
        } else {
            dirty_profiles.into_iter().collect()
        };
        let (mut profile_updates, mut profile_removes) = (Vec::new(), Vec::new());
        for name in profile_candidates {
            if node.profile_refs.contains_key(&name) {
                let (message, update) = match self.profiles.get(&name) {
                    Some(p) => (p.message.clone(), p.update.clone()),
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
                    .is_some_and(|s| Arc::ptr_eq(s, &message) || **s == *message);
                if !same {
                    sub.profiles.insert(name.clone(), message);
                    profile_updates.push(update);
                }
            } else if sub.profiles.remove(&name).is_some() {
                profile_removes.push(Arc::new(msg(Payload::ActiveProfileRemove(
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
            node.endpoints.iter().cloned().collect()
        } else {
            dirty_endpoints.into_iter().collect()
        };
        let (mut ep_updates, mut ep_removes) = (Vec::new(), Vec::new());
        for key in endpoint_candidates {
            let current = node
                .endpoints
                .contains(&key)
                .then(|| self.endpoint_message(&key))
                .flatten();
            match current {
                Some(m) => {
                    let print = fingerprint(&m);
                    if sub.endpoints.get(&key).map(|(_, f)| *f) != Some(print) {
                        if let Some(r) = removal_for(&m) {
                            sub.endpoints.insert(key.clone(), (r, print));
                        }
                        ep_updates.push(Arc::new(msg(m)));
                    }
                }
                None => {
                    if let Some((r, _)) = sub.endpoints.remove(&key) {
                        ep_removes.push(Arc::new(msg(r)));
                    }
                }
            }
        }

        let broadcast = self.broadcast(cache, fresh);
        out.extend(ipset_adds);
        out.extend(ipset_deltas);
        out.extend(policy_updates);
        out.extend(profile_updates);
        out.extend(ep_updates);
        out.extend(ep_removes);
        out.extend(profile_removes);
        out.extend(policy_removes);
        out.extend(ipset_removes);
        out.extend(broadcast);
        if self.in_sync && !sub.in_sync_sent {
            sub.in_sync_sent = true;
            out.push(Arc::new(msg(Payload::InSync(pb::InSync {}))));
        }
        sub.initialized = true;
        cache.everywhere_ipsets = Some(everywhere_ipsets);
        for (id, add) in sent_count_changes {
            let c = self.ipset_sent_count.entry(id.clone()).or_insert(0);
            if add {
                *c += 1;
            } else {
                *c -= 1;
                if *c == 0 {
                    self.ipset_sent_count.remove(&id);
                }
            }
        }
        self.nodes.get_mut(name).expect("node exists").sub = Some(sub);
        out
    }
}

/// A 64-bit fingerprint of a message's encoding: enough to tell "unchanged" without keeping
/// a copy of every endpoint message per node.
fn fingerprint(p: &Payload) -> u64 {
    use prost::Message;
    use std::hash::{Hash, Hasher};
    let bytes = msg(p.clone()).encode_to_vec();
    let mut h = rustc_hash::FxHasher::default();
    bytes.hash(&mut h);
    h.finish()
}

fn removal_for(update: &Payload) -> Option<Payload> {
    match update {
        Payload::WorkloadEndpointUpdate(u) => Some(Payload::WorkloadEndpointRemove(
            pb::WorkloadEndpointRemove { id: u.id.clone() },
        )),
        Payload::HostEndpointUpdate(u) => {
            Some(Payload::HostEndpointRemove(pb::HostEndpointRemove {
                id: u.id.clone(),
            }))
        }
        _ => None,
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
