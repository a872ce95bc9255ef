//! Calico's Kubernetes datastore: the watched collections and what their objects mean.
//!
//! - [`Source`]: one watched collection (a Calico CRD or a native Kubernetes kind), with its
//!   group, version, kind and plural as plain data ([`Source::collection`]); the adapter builds
//!   its client's resource description from them.
//! - [`convert`]: one object of one source → a [`Decision`](crate::Decision), exactly as
//!   Calico's Kubernetes backend converts it (pods → workload endpoints, namespaces and service
//!   accounts → profiles, Kubernetes NetworkPolicy → a `knp.default.` NetworkPolicy, nodes →
//!   Node, EndpointSlices → the graph's EndpointSlice, CRDs → the v3 object they carry, the
//!   network-policy-api kinds → the policy the graph converts them to). Services are not
//!   watched: Felix reads a Service's members from its EndpointSlices alone.
//! - [`put`] and [`delete`]: an object into the [`Mirror`], identified by (source, namespace,
//!   name) and versioned by its `resourceVersion`; each source is listed on its own, so the
//!   mirror's list group is the source.

pub mod convert;

use calc_graph::manifest::RejectStage;
use calc_graph::model::Kind;
use serde_json::Value;

use crate::mirror::Fingerprint;
use crate::{Batch, Problem};
use convert::Converter;

/// The API group of Calico's CRDs.
pub const CRD_GROUP: &str = "crd.projectcalico.org";
/// The API group of the network-policy-api kinds.
pub use calc_graph::model::network_policy_api::GROUP as NETWORK_POLICY_API_GROUP;

/// One watched collection: a Calico CRD or a native Kubernetes kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// A Calico CRD whose spec is the v3 spec of this kind.
    Crd(Kind),
    Pod,
    Namespace,
    ServiceAccount,
    Node,
    /// `networking.k8s.io/v1` NetworkPolicy.
    KubernetesNetworkPolicy,
    /// `discovery.k8s.io/v1` EndpointSlice: the members of rules' `services` matches.
    EndpointSlice,
    /// `v1` Service: the frontends that name a flow's destination service (flow logs). A
    /// cluster role without `services` (403) makes it an empty source, as a 404 does.
    Service,
    /// A network-policy-api kind (`policy.networking.k8s.io`, [`Kind::NETWORK_POLICY_API`]):
    /// ClusterNetworkPolicy (`v1alpha2`), AdminNetworkPolicy and BaselineAdminNetworkPolicy
    /// (`v1alpha1`). A cluster without their CRDs answers 404: an empty source.
    NetworkPolicyApi(Kind),
}

/// Where a collection lives in the Kubernetes API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Collection {
    /// The API group (`""` for the core group).
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
}

impl Collection {
    /// `<group>/<version>`, or the version alone for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.into()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

impl Source {
    /// Every source the adapter watches.
    pub const ALL: [Source; 22] = [
        Source::Crd(Kind::Tier),
        Source::Crd(Kind::GlobalNetworkPolicy),
        Source::Crd(Kind::NetworkPolicy),
        Source::Crd(Kind::StagedGlobalNetworkPolicy),
        Source::Crd(Kind::StagedNetworkPolicy),
        Source::Crd(Kind::StagedKubernetesNetworkPolicy),
        Source::Crd(Kind::GlobalNetworkSet),
        Source::Crd(Kind::NetworkSet),
        Source::Crd(Kind::HostEndpoint),
        Source::Crd(Kind::IPPool),
        Source::Crd(Kind::FelixConfiguration),
        Source::Crd(Kind::ClusterInformation),
        Source::Namespace,
        Source::ServiceAccount,
        Source::Node,
        Source::KubernetesNetworkPolicy,
        Source::EndpointSlice,
        Source::Service,
        Source::NetworkPolicyApi(Kind::ClusterNetworkPolicy),
        Source::NetworkPolicyApi(Kind::AdminNetworkPolicy),
        Source::NetworkPolicyApi(Kind::BaselineAdminNetworkPolicy),
        Source::Pod,
    ];

    /// Whether objects of this source live in a namespace.
    pub fn namespaced(self) -> bool {
        match self {
            Source::Crd(kind) => kind.namespaced(),
            Source::Pod
            | Source::ServiceAccount
            | Source::KubernetesNetworkPolicy
            | Source::EndpointSlice
            | Source::Service => true,
            Source::Namespace | Source::Node | Source::NetworkPolicyApi(_) => false,
        }
    }

    /// Group, version, kind and plural.
    pub fn collection(self) -> Collection {
        let (group, version, kind, plural) = match self {
            Source::Crd(kind) => (CRD_GROUP, "v1", kind.as_str(), kind.plural()),
            Source::Pod => ("", "v1", "Pod", "pods"),
            Source::Namespace => ("", "v1", "Namespace", "namespaces"),
            Source::ServiceAccount => ("", "v1", "ServiceAccount", "serviceaccounts"),
            Source::Node => ("", "v1", "Node", "nodes"),
            Source::KubernetesNetworkPolicy => (
                "networking.k8s.io",
                "v1",
                "NetworkPolicy",
                "networkpolicies",
            ),
            Source::EndpointSlice => ("discovery.k8s.io", "v1", "EndpointSlice", "endpointslices"),
            Source::Service => ("", "v1", "Service", "services"),
            Source::NetworkPolicyApi(kind) => {
                let version = kind.api_version();
                let version = version.rsplit_once('/').map_or(version, |(_, v)| v);
                (
                    NETWORK_POLICY_API_GROUP,
                    version,
                    kind.as_str(),
                    kind.plural(),
                )
            }
        };
        Collection {
            group,
            version,
            kind,
            plural,
        }
    }

    /// `<plural>.<group>` (or the plural alone for the core group), as kubectl names it.
    pub fn name(self) -> String {
        let c = self.collection();
        if c.group.is_empty() {
            c.plural.into()
        } else {
            format!("{}.{}", c.plural, c.group)
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// One watched object: its source and `namespace/name` (or `name`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub source: Source,
    pub name: String,
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.source, self.name)
    }
}

impl ObjectKey {
    /// The key of an object as the API server sends it (metadata.namespace/name).
    pub fn of(source: Source, object: &Value) -> Option<ObjectKey> {
        let meta = object.get("metadata")?;
        let name = meta.get("name").and_then(Value::as_str)?;
        let name = match meta.get("namespace").and_then(Value::as_str) {
            Some(ns) if source.namespaced() && !ns.is_empty() => format!("{ns}/{name}"),
            _ => name.to_string(),
        };
        Some(ObjectKey { source, name })
    }
}

fn resource_version(object: &Value) -> Option<&str> {
    object
        .get("metadata")?
        .get("resourceVersion")?
        .as_str()
        .filter(|s| !s.is_empty())
}

/// What the graph was last given per watched object.
pub type Mirror = crate::mirror::Mirror<ObjectKey, Source>;

/// An empty mirror for the Kubernetes datastore. A pod's resourceVersion moves with every status
/// update, most of which do not change its endpoint: such a version sends nothing.
pub fn new_mirror() -> Mirror {
    Mirror::skipping_unchanged_results()
}

/// An object's current state (from a list or a watch event), converted by `converter` when its
/// resourceVersion changed.
pub fn put(
    mirror: &mut Mirror,
    converter: &Converter,
    source: Source,
    object: Value,
    out: &mut Batch,
) {
    let Some(key) = ObjectKey::of(source, &object) else {
        out.problems.push(Problem {
            key: source.to_string(),
            reason: "object without metadata.name".into(),
            held: false,
            stage: Some(RejectStage::Decode),
        });
        return;
    };
    let version = resource_version(&object).map(|v| Fingerprint::of(v.as_bytes()));
    mirror.put(
        source,
        &key,
        version,
        || converter.convert(source, object),
        out,
    );
}

/// An object was deleted.
pub fn delete(mirror: &mut Mirror, source: Source, object: &Value, out: &mut Batch) {
    if let Some(key) = ObjectKey::of(source, object) {
        mirror.delete(&key, out);
    }
}

#[cfg(test)]
mod tests;
