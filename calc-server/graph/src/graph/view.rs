//! The read-only query API over the graph's state ([`GraphView`], from [`CalcGraph::view`]).
//!
//! Contract: nothing here changes the graph or what any node was sent or has dirty; every
//! answer is the state the next flush would project (an endpoint's update is the one its node
//! would be sent, a policy's rules the ones in its ActivePolicyUpdate). This is the only way
//! readers outside the graph's own parts (explain, the server's realization tables and node
//! lists, and later hit counters, flow logs, a console) see the graph: they never reach into
//! its tables. `CalcGraph`'s own read-only methods here delegate to the view.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use felix_proto as pb;
use pb::to_dataplane::Payload;

use super::CalcGraph;
use super::items::EndpointState;
use super::policies::PolicyState;
use crate::convert::{EndpointModel, PolicyModel};
use crate::label_index::ItemId;
use crate::model::{Kind, ResourceKey};
use crate::policy_resolver::TierMeta;

/// A read-only view of a [`CalcGraph`].
#[derive(Clone, Copy)]
pub struct GraphView<'g> {
    g: &'g CalcGraph,
}

/// One endpoint (workload or host) as the graph holds it.
#[derive(Clone, Copy)]
pub struct EndpointView<'g> {
    g: &'g CalcGraph,
    item: ItemId,
    state: &'g EndpointState,
}

/// One policy as the graph holds it.
#[derive(Clone, Copy)]
pub struct PolicyView<'g> {
    key: &'g ResourceKey,
    state: &'g PolicyState,
}

/// A policy or profile a node needs ([`GraphView::for_each_in_span`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanItem<'a> {
    Policy(&'a ResourceKey),
    Profile(&'a str),
}

impl CalcGraph {
    /// The graph's read-only query API.
    pub fn view(&self) -> GraphView<'_> {
        GraphView { g: self }
    }

    /// Label-index sizes and work done, for metrics and benchmarks.
    pub fn index_stats(&self) -> crate::label_index::IndexStats {
        self.index.stats()
    }

    /// See [`GraphView::in_sync`].
    pub fn in_sync(&self) -> bool {
        self.view().in_sync()
    }

    /// See [`GraphView::nodes_with_endpoints`].
    pub fn nodes_with_endpoints(&self) -> Vec<String> {
        self.view().nodes_with_endpoints()
    }

    /// See [`GraphView::known_nodes`].
    pub fn known_nodes(&self) -> Vec<String> {
        self.view().known_nodes()
    }

    /// See [`GraphView::is_known_node`].
    pub fn is_known_node(&self, node: &str) -> bool {
        self.view().is_known_node(node)
    }

    /// See [`GraphView::policies_and_tiers`].
    pub fn policies_and_tiers(&self) -> Vec<(&ResourceKey, &str)> {
        self.view().policies_and_tiers()
    }

    /// See [`GraphView::for_each_in_span`].
    pub fn for_each_in_span<'g>(&'g self, f: impl FnMut(&'g str, SpanItem<'g>)) {
        self.view().for_each_in_span(f)
    }
}

impl<'g> GraphView<'g> {
    /// Every endpoint, in no particular order.
    pub fn endpoints(self) -> impl Iterator<Item = EndpointView<'g>> + 'g {
        let g = self.g;
        g.items
            .endpoints
            .iter()
            .map(move |(item, state)| EndpointView { g, item, state })
    }

    /// The endpoint of that key (a WorkloadEndpoint or HostEndpoint key).
    pub fn endpoint(self, key: &ResourceKey) -> Option<EndpointView<'g>> {
        let item = *self.g.items.item_of.get(key)?;
        let state = self.g.items.endpoints.get(&item)?;
        Some(EndpointView {
            g: self.g,
            item,
            state,
        })
    }

    /// Every endpoint one of whose addresses contains `ip`. The graph holds nets masked and
    /// in their canonical text, so a single address (`/32`, `/128`: nearly every endpoint's)
    /// is compared as text and only wider nets are parsed.
    pub fn endpoints_with_ip(
        self,
        ip: std::net::IpAddr,
    ) -> impl Iterator<Item = EndpointView<'g>> + 'g {
        let host = format!("{ip}/{}", if ip.is_ipv4() { 32 } else { 128 });
        self.endpoints().filter(move |e| {
            e.nets().iter().any(|n| {
                let single = n.ends_with("/128") || (n.ends_with("/32") && !n.contains(':'));
                if single {
                    **n == *host
                } else {
                    cidr_contains(n, ip)
                }
            })
        })
    }

    /// Every network set (global or namespaced) with its CIDRs, masked and sorted.
    pub fn network_sets(self) -> impl Iterator<Item = (&'g ResourceKey, &'g [Arc<str>])> + 'g {
        let g = self.g;
        g.items
            .item_of
            .iter()
            .filter(|(k, _)| matches!(k.kind, Kind::NetworkSet | Kind::GlobalNetworkSet))
            .filter_map(move |(k, item)| g.items.netsets.get(item).map(|ns| (&**k, &ns.nets[..])))
    }

    /// The Service port reached at `ip`:`port` over IP protocol `proto` (a cluster or
    /// external IP of a Service; flow logs' destination service).
    pub fn service_at(
        self,
        ip: std::net::IpAddr,
        port: u16,
        proto: u8,
    ) -> Option<&'g super::ServicePortRef> {
        self.g.services.frontends.at(ip, port, proto)
    }

    /// The Service port a node port leads to.
    pub fn node_port_service(self, port: u16, proto: u8) -> Option<&'g super::ServicePortRef> {
        self.g.services.frontends.node_port(port, proto)
    }

    /// A NetworkSet's or GlobalNetworkSet's labels (flow logs show them for an address the
    /// set names).
    pub fn network_set_labels(self, key: &ResourceKey) -> Option<BTreeMap<String, String>> {
        let item = self.g.items.item_of.get(key)?;
        self.g.items.netsets.get(item)?;
        self.g.index.effective_labels(*item)
    }

    /// Every policy (staged ones included), in no particular order.
    pub fn policies(self) -> impl Iterator<Item = PolicyView<'g>> + 'g {
        self.g
            .policies
            .by_key
            .iter()
            .map(|(k, state)| PolicyView { key: k, state })
    }

    pub fn policy(self, key: &ResourceKey) -> Option<PolicyView<'g>> {
        let (k, state) = self.g.policies.by_key.get_key_value(key)?;
        Some(PolicyView { key: k, state })
    }

    /// The nodes where a policy is active, sorted: those with an endpoint it selects, or every
    /// known node for a policy hinted `AssumeNeededOnEveryNode`.
    pub fn policy_nodes(self, key: &ResourceKey) -> Vec<String> {
        let mut nodes: Vec<String> = if self.g.policies.everywhere.contains(key) {
            self.known_nodes()
        } else {
            self.g
                .nodes
                .iter()
                .filter(|(_, n)| n.span.policy_refs.contains_key(key))
                .map(|(name, _)| name.to_string())
                .collect()
        };
        nodes.sort();
        nodes
    }

    /// A profile's rules as the nodes are sent them; `None` when no Profile of that name
    /// exists (nodes are then sent [`crate::rule_scanner::missing_profile_rules`]).
    /// Every profile's message, in no particular order.
    pub fn profiles(self) -> impl Iterator<Item = &'g pb::Profile> + 'g {
        self.g.policies.profiles.values().map(|p| p.message())
    }

    pub fn profile(self, name: &str) -> Option<&'g pb::Profile> {
        self.g.policies.profiles.get(name).map(|p| p.message())
    }

    /// The tier of that name as the resolver orders it: its Tier resource, else the built-in
    /// tier of that name, else none.
    pub fn tier(self, name: &str) -> Option<&'g TierMeta> {
        self.g.policies.tier(name)
    }

    /// The members of an IP set (addresses, CIDRs or `addr,proto:port`), or `None` when no
    /// policy or profile defines it.
    /// Whether IP set `id` holds `member` (its canonical text), without a scan.
    pub fn ipset_has_member(self, id: &str, member: &str) -> bool {
        let g = self.g;
        g.ipsets.sets.get(id).is_some_and(|set| {
            g.ipsets
                .members
                .existing(member)
                .is_some_and(|m| set.members.contains(m))
        })
    }

    pub fn ipset_members(self, id: &str) -> Option<impl Iterator<Item = &'g str> + 'g> {
        let g = self.g;
        let set = g.ipsets.sets.get(id)?;
        Some(set.members.ids().map(move |m| &**g.ipsets.members.get(m)))
    }

    /// The configuration `node` is sent.
    pub fn config(self, node: &str) -> pb::ConfigUpdate {
        self.g.broadcast.config_for(node)
    }

    /// Whether the datastore has reported in-sync.
    pub fn in_sync(self) -> bool {
        self.g.store.in_sync
    }

    /// Nodes that have at least one endpoint, sorted.
    pub fn nodes_with_endpoints(self) -> Vec<String> {
        let mut v: Vec<String> = self
            .g
            .nodes
            .iter()
            .filter(|(_, n)| !n.span.endpoints.is_empty())
            .map(|(k, _)| k.to_string())
            .collect();
        v.sort();
        v
    }

    /// Every node the graph knows of: with endpoints, Node resources or subscribers; sorted.
    pub fn known_nodes(self) -> Vec<String> {
        let mut v: BTreeSet<String> = self.g.nodes.keys().map(|k| k.to_string()).collect();
        v.extend(self.g.broadcast.host_metadata.keys().cloned());
        v.into_iter().collect()
    }

    /// Whether `node` is one of [`GraphView::known_nodes`], without listing them (an agent's
    /// connect asks this: listing 5,000 nodes per connect made a connect storm quadratic).
    pub fn is_known_node(self, node: &str) -> bool {
        self.g.nodes.contains_key(node) || self.g.broadcast.host_metadata.contains_key(node)
    }

    /// Every policy with its tier (for realization tables: a policy that selects nothing is
    /// listed too).
    pub fn policies_and_tiers(self) -> Vec<(&'g ResourceKey, &'g str)> {
        self.g
            .policies
            .by_key
            .iter()
            .map(|(k, p)| (&**k, p.model.tier.as_str()))
            .collect()
    }

    /// Calls `f(node, item)` for every policy and profile each node needs (its span; a policy
    /// hinted `AssumeNeededOnEveryNode` on every node the graph holds): the realization
    /// tables' input.
    pub fn for_each_in_span(self, mut f: impl FnMut(&'g str, SpanItem<'g>)) {
        let g = self.g;
        for (name, n) in &g.nodes {
            for k in n.span.policy_refs.keys() {
                if !g.policies.everywhere.contains(k) {
                    f(name, SpanItem::Policy(k));
                }
            }
            for k in &g.policies.everywhere {
                f(name, SpanItem::Policy(k));
            }
            for p in n.span.profile_refs.keys() {
                f(name, SpanItem::Profile(p));
            }
        }
    }
}

impl<'g> EndpointView<'g> {
    pub fn key(self) -> &'g ResourceKey {
        &self.state.key
    }

    /// The converted endpoint, rebuilt from what the graph keeps; its `labels` are empty (see
    /// [`Self::labels`]).
    pub fn model(self) -> EndpointModel {
        self.state.model(
            self.g
                .index
                .parents(self.item)
                .map(str::to_string)
                .collect(),
        )
    }

    pub fn node(self) -> &'g str {
        &self.state.node
    }

    /// The endpoint's CIDRs, as its members of every selector IP set.
    pub fn nets(self) -> &'g [Arc<str>] {
        &self.state.nets
    }

    /// Its effective labels: its own and those its profiles apply.
    pub fn labels(self) -> Option<BTreeMap<String, String>> {
        self.g.index.effective_labels(self.item)
    }

    /// Whether the policy of that key selects it.
    pub fn selected_by(self, policy: &ResourceKey) -> bool {
        self.state.policies.contains(policy)
    }

    /// The WorkloadEndpointUpdate or HostEndpointUpdate its node is sent (tier lists
    /// included).
    pub fn update(self) -> Option<Payload> {
        self.g.endpoint_message(&self.state.key)
    }
}

impl<'g> PolicyView<'g> {
    pub fn key(self) -> &'g ResourceKey {
        self.key
    }

    pub fn model(self) -> &'g PolicyModel {
        &self.state.model
    }

    /// The policy's key for the resolver's name order.
    pub fn sort_string(self) -> &'g str {
        &self.state.sort_string
    }

    /// The policy as the nodes are sent it.
    pub fn message(self) -> &'g pb::Policy {
        self.state.message()
    }
}

/// Whether `cidr` (an address or `addr/len`) contains `ip`.
fn cidr_contains(cidr: &str, ip: std::net::IpAddr) -> bool {
    crate::explain::rules::cidr_contains(cidr, ip)
}
