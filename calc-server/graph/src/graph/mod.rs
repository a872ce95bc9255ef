//! The calculation graph: one pure, synchronous computation for the whole cluster, projected
//! per node.
//!
//! Contract:
//! - [`CalcGraph::apply`] takes an [`Update`] (`Apply`, `ApplyValid`, `Delete`, `InSync`). It
//!   validates (unless the resource comes as a [`Valid`], validated once by its decoder) and
//!   converts the resource, updates the cluster-wide indexes (label index, IP-set members,
//!   per-node reference counts) and only *marks* per-node state dirty. An invalid object is
//!   refused with a [`Rejection`] (its validation errors, or why it cannot be converted) and the
//!   last good version of that key stays in force (see docs/architecture.md "Invalid updates").
//! - [`CalcGraph::flush`] computes, for every subscribed node, the messages that move it from
//!   what it was last sent to the current state, in dependency order (config → IP sets → policies
//!   → profiles → endpoints, removals reversed, then host metadata and IPAM pools), and `InSync`
//!   once after the datastore is in sync. Pending work is held as dirty keys and net IP-set
//!   deltas, so it is bounded by state, not by event rate, and the output depends only on the
//!   current state and what the node was sent — not on the path taken.
//! - Membership of every IP set referenced by any policy or profile is tracked cluster-wide; a
//!   node gets an IP set, policy or profile only while it is needed by one of its endpoints.
//!
//! - Readers outside the graph (explain, and later hit counters, flow logs, a console) use the
//!   read-only query API, [`GraphView`] ([`CalcGraph::view`]), never the parts themselves.
//!
//! Layout: [`CalcGraph`] is a handful of owned parts, each a module with its own contract:
//! `store` (last good version of every key, in-sync), `ids` (item and selector ids and owners),
//! `items` (endpoints and network sets), `policies` (policies, profiles, tiers), `ipsets` (IP
//! sets, interned `members`, pending deltas), `services` (EndpointSlices → service sets),
//! `broadcast` (config, host metadata, IPAM pools), `spans` (per node: what its endpoints need,
//! dirty marks, what it was sent). The work that crosses parts is one file per job: this module
//! takes updates in (validation, conversion); `indexes` keeps the parts and the label index in
//! step; `spans` counts per node; `sequencer` turns dirty marks into each node's ordered batch;
//! `messages` builds the protobuf payloads; `view` answers read-only queries.

mod broadcast;
mod frontends;
mod ids;
mod indexes;
mod ipsets;
mod items;
mod members;
mod messages;
mod policies;
mod sequencer;
mod services;
mod shared;
mod spans;
mod store;
mod view;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::convert::{self, ConvertError};
use crate::label_index::LabelIndex;
use crate::model::{Kind, Resource, ResourceKey, Valid};
use crate::policy_resolver::TierMeta;
use crate::rule_scanner;

use broadcast::Broadcast;
pub use frontends::ServicePortRef;
use ids::Ids;
use ipsets::IpSets;
use items::Items;
use policies::Policies;
pub use sequencer::{NodeBatch, SharedMessage};
use services::Services;
use spans::Nodes;
use store::Store;
pub use view::{EndpointView, GraphView, PolicyView, SpanItem};

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

/// An update the graph refused: [`Rejection::Invalid`] (validation) or
/// [`Rejection::Unconvertible`]. The previous good version (if any) stays. The same type the
/// decoders and datastore adapters refuse objects with.
pub use crate::rejection::Rejection;

type Key = Arc<ResourceKey>;
type Name = Arc<str>;

/// See the module documentation. Each field is one part, with its own module and contract.
#[derive(Default)]
pub struct CalcGraph {
    /// Which items each selector matches ([`crate::label_index`]).
    index: LabelIndex,
    /// Item and selector ids, and each selector's owner ([`ids`]).
    ids: Ids,
    /// Last good version of every key, and whether the datastore is in sync ([`store`]).
    store: Store,
    /// Endpoints and network sets by item id ([`items`]).
    items: Items,
    /// Policies, profiles and tiers ([`policies`]).
    policies: Policies,
    /// IP sets, their members and pending deltas ([`ipsets`]).
    ipsets: IpSets,
    /// EndpointSlices feeding the Services' IP sets ([`services`]).
    services: Services,
    /// Config, host metadata and IPAM pools, sent to every node ([`broadcast`]).
    broadcast: Broadcast,
    /// Per node: its span, dirty marks and what it was sent ([`spans`], [`sequencer`]).
    nodes: Nodes,
    /// An update was applied since the last flush. Without one, only nodes that are new,
    /// await their `InSync` or carry dirty marks can have anything to send, and a flush looks
    /// at those alone: agents connecting to a large cluster would otherwise cost a pass over
    /// every subscribed node per flush.
    applied_since_flush: bool,
}

impl CalcGraph {
    pub fn new() -> CalcGraph {
        CalcGraph::default()
    }

    fn node_mut(&mut self, node: &str) -> &mut spans::NodeState {
        if !self.nodes.contains_key(node) {
            self.nodes
                .insert(Arc::from(node), spans::NodeState::default());
        }
        self.nodes.get_mut(node).expect("just inserted")
    }

    fn prune_node(&mut self, node: &str) {
        if let Some(n) = self.nodes.get(node)
            && n.sub.is_none()
            && n.span.endpoints.is_empty()
            && n.span.policy_refs.is_empty()
        {
            self.nodes.remove(node);
        }
    }

    /// One Felix setting (by its Felix name, `FeatureGates`) as `node` is sent it: the node's
    /// `node.<name>` FelixConfiguration over the global `default` one.
    pub fn felix_setting(&self, node: &str, key: &str) -> Option<&str> {
        self.broadcast.setting(node, key)
    }

    /// Applies one update. On `Err`, nothing changed.
    pub fn apply(&mut self, update: Update) -> Result<(), Rejection> {
        self.applied_since_flush = true;
        match update {
            Update::InSync => {
                self.store.in_sync = true;
                Ok(())
            }
            Update::Delete(key) => {
                self.delete(Arc::new(key));
                Ok(())
            }
            Update::Apply(res) => match Valid::check(res) {
                Ok(valid) => self.apply(Update::ApplyValid(valid)),
                Err(invalid) => Err(Rejection::Invalid(invalid)),
            },
            Update::ApplyValid(valid) => {
                let res = valid.into_resource();
                let key = Arc::new(res.key());
                // Endpoints and policies are the bulk of a cluster: their converted form is kept
                // (and compared for no-op updates) instead of the whole resource.
                let converted = Store::keeps_converted(key.kind);
                if !converted && self.store.resources.get(&key) == Some(&res) {
                    return Ok(());
                }
                self.install(key.clone(), &res)
                    .map_err(|error| Rejection::Unconvertible {
                        key: (*key).clone(),
                        error: Box::new(error),
                    })?;
                if !converted {
                    self.store.resources.insert(key, res);
                }
                Ok(())
            }
        }
    }

    fn delete(&mut self, key: Key) {
        let converted = Store::keeps_converted(key.kind);
        if !converted && self.store.resources.remove(&key).is_none() {
            return;
        }
        match key.kind {
            Kind::NetworkPolicy
            | Kind::GlobalNetworkPolicy
            | Kind::StagedNetworkPolicy
            | Kind::StagedGlobalNetworkPolicy
            | Kind::StagedKubernetesNetworkPolicy
            | Kind::ClusterNetworkPolicy
            | Kind::AdminNetworkPolicy
            | Kind::BaselineAdminNetworkPolicy => self.remove_policy(&key),
            Kind::WorkloadEndpoint | Kind::HostEndpoint => self.remove_endpoint(&key),
            Kind::NetworkSet | Kind::GlobalNetworkSet => self.remove_netset(&key),
            Kind::Profile => self.set_profile(&key.name, None, &BTreeMap::new()),
            Kind::Tier => {
                self.policies.tiers.remove(&key.name);
                self.touch_tier(&key.name);
            }
            Kind::IPPool => self.broadcast.remove_pool(&key.name),
            Kind::FelixConfiguration => self.broadcast.remove_config(&key.name),
            Kind::Node => self.broadcast.remove_node(&key.name),
            Kind::ClusterInformation => {}
            Kind::EndpointSlice => self.remove_slice(&key),
            Kind::Service => self.services.remove_frontends(&key),
        }
    }

    /// Converts and installs a validated resource (replacing any previous version).
    fn install(&mut self, key: Key, res: &Resource) -> Result<(), ConvertError> {
        match res {
            // A staged delete stages the removal of the enforced policy: nothing to compute
            // or send (Calico's syncer drops it too), but a previous version is withdrawn.
            Resource::Policy(_, _, s) if s.stages_a_delete() => {
                self.remove_policy(&key);
                Ok(())
            }
            Resource::Policy(kind, m, s) => {
                let namespace = if kind.namespaced() {
                    m.namespace.as_deref()
                } else {
                    None
                };
                let model = convert::convert_policy(&key, s, namespace)?;
                Ok(self.set_policy(key, model)?)
            }
            Resource::Tier(_, s) => {
                self.policies.tiers.insert(
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
                self.broadcast.set_pool(&key.name, s);
                Ok(())
            }
            Resource::FelixConfiguration(_, spec) => {
                self.broadcast.set_config(&key.name, spec);
                Ok(())
            }
            Resource::Node(m, s) => {
                self.broadcast.set_node(&key.name, m, s);
                Ok(())
            }
            Resource::ClusterInformation(..) => Ok(()),
            Resource::EndpointSlice(m, s) => {
                self.set_slice(key, m, s);
                Ok(())
            }
            Resource::Service(_, s) => {
                self.services.set_frontends(key, s);
                Ok(())
            }
        }
    }
}

/// Builders shared by the submodules' unit tests.
#[cfg(test)]
mod test_util {
    use std::sync::Arc;

    use serde_json::{Value, json};

    use super::{CalcGraph, Key, SharedMessage, Update};
    use crate::model::{Decoded, Resource};

    pub(super) fn resource(v: Value) -> Resource {
        match Resource::from_value(v.clone()) {
            Ok(Decoded::Resource(_, r)) => r,
            other => panic!("does not decode: {other:?}\n{v}"),
        }
    }

    /// Applies `v` (which must be accepted) and returns its key.
    pub(super) fn apply(g: &mut CalcGraph, v: Value) -> Key {
        let r = resource(v);
        let key = Arc::new(r.key());
        g.apply(Update::Apply(r)).expect("accepted");
        key
    }

    /// Workload endpoint `pod` in namespace `ns` on `node`, with one address.
    pub(super) fn wep(pod: &str, node: &str, ip: &str, labels: Value, profiles: Value) -> Value {
        json!({
            "apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
            "metadata": {
                "name": format!("{}-k8s-{}-eth0", node.replace('-', "--"), pod.replace('-', "--")),
                "namespace": "ns", "labels": labels,
            },
            "spec": {"orchestrator": "k8s", "node": node, "pod": pod, "endpoint": "eth0",
                     "interfaceName": format!("cali-{pod}"), "ipNetworks": [ip],
                     "profiles": profiles}
        })
    }

    /// GlobalNetworkPolicy `name` selecting `selector`, allowing ingress from `source`: the
    /// source selector makes the policy use one IP set.
    pub(super) fn gnp(name: &str, selector: &str, action: &str, source: &str) -> Value {
        json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
            "metadata": {"name": name},
            "spec": {"selector": selector, "types": ["Ingress"],
                     "ingress": [{"action": action, "source": {"selector": source}}]}
        })
    }

    /// The payload variant of each message, e.g. `IpsetUpdate`.
    pub(super) fn kinds(messages: &[SharedMessage]) -> Vec<String> {
        messages
            .iter()
            .map(|m| {
                let p = m.payload.as_ref().expect("every message has a payload");
                let text = format!("{p:?}");
                text[..text.find('(').unwrap_or(text.len())].to_string()
            })
            .collect()
    }

    /// The messages `node` got from one flush (empty when it got no batch).
    pub(super) fn flush_for(g: &mut CalcGraph, node: &str) -> Vec<SharedMessage> {
        g.flush()
            .into_iter()
            .find(|b| b.node == node)
            .map(|b| b.messages)
            .unwrap_or_default()
    }
}
