//! Calico's v3 resources (`projectcalico.org/v3`) as serde types, Kubernetes' EndpointSlices
//! (`discovery.k8s.io/v1`), and the policy kinds of Kubernetes that Calico converts to its own:
//! StagedKubernetesNetworkPolicy ([`kubernetes`]) and the network-policy-api kinds
//! ([`network_policy_api`], `policy.networking.k8s.io`), each checked against its own
//! `apiVersion` ([`Kind::api_version`]).
//!
//! Contract: [`Resource::from_value`] turns one decoded JSON/YAML object into a typed resource,
//! applies Calico's defaulting (policy `types` inference, empty tier → `default`, namespace
//! `default` for namespaced kinds, Tier `defaultAction` → `Deny`) and returns it together with
//! its [`ResourceKey`]. Unknown fields are ignored, as Calico's own decoder does. Shape errors
//! (a string where a list belongs) fail decoding with the field path; content errors are left
//! to [`validate`](crate::model::validate), which reports all of them at once. Each kind has
//! its own `apiVersion` ([`api_version_of`]); a `v1` Service is accepted and skipped like the
//! Calico kinds the dataplane does not use: Felix reads a Service's members from its
//! EndpointSlices alone. Kubernetes' own NetworkPolicy (`networking.k8s.io/v1`) and Namespace
//! (`v1`) are converted as Calico's Kubernetes datastore converts them
//! ([`kubernetes::Native`]): to the NetworkPolicy `knp.default.<name>` and the Profile
//! `kns.<name>`.

pub mod fields;
pub mod kubernetes;
pub mod network_policy_api;
pub mod rule;
pub mod validate;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use rule::{Action, EntityRule, IcmpFields, Port, Protocol, Rule};
pub use validate::Valid;

/// Label Calico puts on namespaced endpoints and network sets.
pub const LABEL_NAMESPACE: &str = "projectcalico.org/namespace";
/// Label Calico puts on workload endpoints naming their orchestrator.
pub const LABEL_ORCHESTRATOR: &str = "projectcalico.org/orchestrator";

/// The API group and version of Calico's resources (every kind but the network-policy-api
/// ones, see [`Kind::api_version`]).
pub const API_VERSION: &str = "projectcalico.org/v3";
/// The API group and version of Kubernetes' EndpointSlices.
pub const ENDPOINT_SLICE_API_VERSION: &str = "discovery.k8s.io/v1";
/// The `apiVersion` of a Kubernetes Service.
pub const SERVICE_API_VERSION: &str = "v1";
/// The label naming the Service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// The resource kinds the policy dataplane consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    NetworkPolicy,
    GlobalNetworkPolicy,
    StagedNetworkPolicy,
    StagedGlobalNetworkPolicy,
    StagedKubernetesNetworkPolicy,
    Tier,
    Profile,
    WorkloadEndpoint,
    HostEndpoint,
    NetworkSet,
    GlobalNetworkSet,
    IPPool,
    FelixConfiguration,
    Node,
    ClusterInformation,
    /// `discovery.k8s.io/v1` EndpointSlice: the addresses behind a rule's `services` match.
    EndpointSlice,
    /// `v1` Service: its cluster and external IPs and ports, which name the destination
    /// service of a flow (flow logs); no dataplane reads it.
    Service,
    /// `policy.networking.k8s.io/v1alpha2` (see [`network_policy_api`]).
    ClusterNetworkPolicy,
    /// `policy.networking.k8s.io/v1alpha1`, as Calico 3.29–3.31 read it.
    AdminNetworkPolicy,
    BaselineAdminNetworkPolicy,
}

impl Kind {
    /// The `projectcalico.org/v3` kinds (those with an etcd plural).
    pub const ALL: [Kind; 15] = [
        Kind::NetworkPolicy,
        Kind::GlobalNetworkPolicy,
        Kind::StagedNetworkPolicy,
        Kind::StagedGlobalNetworkPolicy,
        Kind::StagedKubernetesNetworkPolicy,
        Kind::Tier,
        Kind::Profile,
        Kind::WorkloadEndpoint,
        Kind::HostEndpoint,
        Kind::NetworkSet,
        Kind::GlobalNetworkSet,
        Kind::IPPool,
        Kind::FelixConfiguration,
        Kind::Node,
        Kind::ClusterInformation,
    ];

    /// Kubernetes kinds the graph reads besides policies (not in [`Kind::ALL`]: no etcd
    /// plural of Calico's).
    pub const KUBERNETES: [Kind; 2] = [Kind::EndpointSlice, Kind::Service];

    /// The Kubernetes network-policy-api kinds (`policy.networking.k8s.io`): not Calico
    /// resources (no etcd plural), read from the Kubernetes API and from manifests.
    pub const NETWORK_POLICY_API: [Kind; 3] = [
        Kind::ClusterNetworkPolicy,
        Kind::AdminNetworkPolicy,
        Kind::BaselineAdminNetworkPolicy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "NetworkPolicy",
            Kind::GlobalNetworkPolicy => "GlobalNetworkPolicy",
            Kind::StagedNetworkPolicy => "StagedNetworkPolicy",
            Kind::StagedGlobalNetworkPolicy => "StagedGlobalNetworkPolicy",
            Kind::StagedKubernetesNetworkPolicy => "StagedKubernetesNetworkPolicy",
            Kind::Tier => "Tier",
            Kind::Profile => "Profile",
            Kind::WorkloadEndpoint => "WorkloadEndpoint",
            Kind::HostEndpoint => "HostEndpoint",
            Kind::NetworkSet => "NetworkSet",
            Kind::GlobalNetworkSet => "GlobalNetworkSet",
            Kind::IPPool => "IPPool",
            Kind::FelixConfiguration => "FelixConfiguration",
            Kind::Node => "Node",
            Kind::ClusterInformation => "ClusterInformation",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Service => "Service",
            Kind::ClusterNetworkPolicy => "ClusterNetworkPolicy",
            Kind::AdminNetworkPolicy => "AdminNetworkPolicy",
            Kind::BaselineAdminNetworkPolicy => "BaselineAdminNetworkPolicy",
        }
    }

    /// The kind of that name: a Calico kind or a network-policy-api one.
    pub fn from_name(s: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .chain(Kind::KUBERNETES)
            .chain(Kind::NETWORK_POLICY_API)
            .find(|k| k.as_str() == s)
    }

    /// The `apiVersion` objects of this kind carry.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::ClusterNetworkPolicy => network_policy_api::CNP_API_VERSION,
            Kind::AdminNetworkPolicy | Kind::BaselineAdminNetworkPolicy => {
                network_policy_api::ANP_API_VERSION
            }
            Kind::EndpointSlice => ENDPOINT_SLICE_API_VERSION,
            Kind::Service => SERVICE_API_VERSION,
            _ => API_VERSION,
        }
    }

    /// The lower-case plural used in etcd keys and URLs (for the network-policy-api kinds, in
    /// Kubernetes URLs only).
    pub fn plural(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networkpolicies",
            Kind::GlobalNetworkPolicy => "globalnetworkpolicies",
            Kind::StagedNetworkPolicy => "stagednetworkpolicies",
            Kind::StagedGlobalNetworkPolicy => "stagedglobalnetworkpolicies",
            Kind::StagedKubernetesNetworkPolicy => "stagedkubernetesnetworkpolicies",
            Kind::Tier => "tiers",
            Kind::Profile => "profiles",
            Kind::WorkloadEndpoint => "workloadendpoints",
            Kind::HostEndpoint => "hostendpoints",
            Kind::NetworkSet => "networksets",
            Kind::GlobalNetworkSet => "globalnetworksets",
            Kind::IPPool => "ippools",
            Kind::FelixConfiguration => "felixconfigurations",
            Kind::Node => "nodes",
            Kind::ClusterInformation => "clusterinformations",
            Kind::EndpointSlice => "endpointslices",
            Kind::Service => "services",
            Kind::ClusterNetworkPolicy => "clusternetworkpolicies",
            Kind::AdminNetworkPolicy => "adminnetworkpolicies",
            Kind::BaselineAdminNetworkPolicy => "baselineadminnetworkpolicies",
        }
    }

    pub fn namespaced(self) -> bool {
        matches!(
            self,
            Kind::NetworkPolicy
                | Kind::StagedNetworkPolicy
                | Kind::StagedKubernetesNetworkPolicy
                | Kind::WorkloadEndpoint
                | Kind::NetworkSet
                | Kind::EndpointSlice
                | Kind::Service
        )
    }

    /// Kinds held as [`Resource::Policy`]: a policy spec selecting endpoints.
    pub fn is_policy(self) -> bool {
        matches!(
            self,
            Kind::NetworkPolicy
                | Kind::GlobalNetworkPolicy
                | Kind::StagedNetworkPolicy
                | Kind::StagedGlobalNetworkPolicy
                | Kind::StagedKubernetesNetworkPolicy
                | Kind::ClusterNetworkPolicy
                | Kind::AdminNetworkPolicy
                | Kind::BaselineAdminNetworkPolicy
        )
    }

    /// A policy kind by its name or Calico's short form (as in chain names): `np`, `gnp`,
    /// `snp`, `sgnp`, `sknp`, `kcnp`.
    pub fn policy_by_name(s: &str) -> Option<Kind> {
        let kind = match s {
            "np" => Kind::NetworkPolicy,
            "gnp" => Kind::GlobalNetworkPolicy,
            "snp" => Kind::StagedNetworkPolicy,
            "sgnp" => Kind::StagedGlobalNetworkPolicy,
            "sknp" => Kind::StagedKubernetesNetworkPolicy,
            "kcnp" | "KubernetesClusterNetworkPolicy" => Kind::ClusterNetworkPolicy,
            other => Kind::from_name(other)?,
        };
        kind.is_policy().then_some(kind)
    }

    /// Staged policies: computed and sent like enforced ones, never programmed.
    pub fn is_staged(self) -> bool {
        matches!(
            self,
            Kind::StagedNetworkPolicy
                | Kind::StagedGlobalNetworkPolicy
                | Kind::StagedKubernetesNetworkPolicy
        )
    }

    /// Whether a policy of this kind has the global policy's fields (`doNotTrack`, `preDNAT`,
    /// `applyOnForward`, `namespaceSelector`); the network-policy-api kinds convert to a global
    /// policy's spec.
    pub fn is_global_policy(self) -> bool {
        matches!(
            self,
            Kind::GlobalNetworkPolicy | Kind::StagedGlobalNetworkPolicy
        ) || self.is_network_policy_api()
    }

    /// The Kubernetes network-policy-api kinds ([`Kind::NETWORK_POLICY_API`]).
    pub fn is_network_policy_api(self) -> bool {
        Kind::NETWORK_POLICY_API.contains(&self)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Calico kinds that are valid but play no part in policy programming. Manifests holding them
/// are accepted and the objects skipped, so an operator's full `calicoctl get -o yaml` dump loads.
pub const IGNORED_KINDS: &[&str] = &[
    "BGPConfiguration",
    "BGPPeer",
    "BGPFilter",
    "KubeControllersConfiguration",
    "IPReservation",
    "IPAMConfiguration",
    "IPAMConfig",
    "CalicoNodeStatus",
    "BlockAffinity",
    "LiveMigration",
];

/// Kubernetes kinds (with their `apiVersion`) accepted and skipped like [`IGNORED_KINDS`]
/// (none at present: a Service is read, for flow logs).
pub const IGNORED_KUBERNETES_KINDS: &[(&str, &str)] = &[];

/// The `apiVersion` an object of kind `kind` must carry (Calico's for every Calico kind and
/// for a kind not known at all).
pub fn api_version_of(kind: &str) -> &'static str {
    if let Some(k) = Kind::from_name(kind) {
        return k.api_version();
    }
    IGNORED_KUBERNETES_KINDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(API_VERSION, |(_, v)| v)
}

/// Identifies one resource: kind, namespace (namespaced kinds only) and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceKey {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub name: String,
}

impl ResourceKey {
    pub fn new(kind: Kind, namespace: Option<&str>, name: &str) -> ResourceKey {
        ResourceKey {
            kind,
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        }
    }

    /// Calico's etcd v3 key: `/calico/resources/v3/projectcalico.org/<plural>/[<ns>/]<name>`.
    pub fn etcd_path(&self) -> String {
        match &self.namespace {
            Some(ns) => format!(
                "/calico/resources/v3/projectcalico.org/{}/{}/{}",
                self.kind.plural(),
                ns,
                self.name
            ),
            None => format!(
                "/calico/resources/v3/projectcalico.org/{}/{}",
                self.kind.plural(),
                self.name
            ),
        }
    }
}

/// `Kind ns/name` or `Kind name`: the form every error message uses.
impl fmt::Display for ResourceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Keys of invalid objects are shown in logs: their names are not yet validated.
        use crate::untrusted::Untrusted;
        match &self.namespace {
            Some(ns) => write!(
                f,
                "{} {}/{}",
                self.kind,
                Untrusted(ns),
                Untrusted(&self.name)
            ),
            None => write!(f, "{} {}", self.kind, Untrusted(&self.name)),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ObjectMeta {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The prefix Kubernetes made the name from (a pod's `generateName`, which Calico's
    /// WorkloadEndpoints carry over): flow logs name a workload by it, followed by `*`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generate_name: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
}

/// Spec of NetworkPolicy and GlobalNetworkPolicy. The GNP-only fields (`doNotTrack`, `preDNAT`,
/// `applyOnForward`, `namespaceSelector`) are not part of Calico's NetworkPolicy type, so on a
/// NetworkPolicy they are dropped at decode time exactly as Calico's decoder drops unknown fields.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PolicySpec {
    pub tier: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order: Option<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<Rule>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<Rule>,
    pub selector: String,
    pub types: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service_account_selector: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub performance_hints: Vec<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub do_not_track: bool,
    #[serde(rename = "preDNAT", skip_serializing_if = "std::ops::Not::not")]
    pub pre_dnat: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub apply_on_forward: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace_selector: String,
    /// Staged kinds only: `Set` (the default), `Delete`, `Learn` or `Ignore`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub staged_action: String,
    /// What converting a Kubernetes policy kind into this spec dropped or changed, one line
    /// per rule (empty for Calico's own kinds). Not part of the object: the adapters log it,
    /// naming the object.
    #[serde(skip)]
    pub conversion_warnings: Vec<String>,
    /// What makes a converted network-policy-api object invalid (a missing tier, too many
    /// rules), with the field paths of the object as written. Not part of the object:
    /// validation reports them.
    #[serde(skip)]
    pub conversion_errors: Vec<validate::FieldError>,
}

impl PolicySpec {
    /// A staged policy whose `stagedAction` is `Delete` stages the removal of the enforced
    /// policy of that name: Calico's syncer does not send it, and neither do we.
    pub fn stages_a_delete(&self) -> bool {
        self.staged_action == "Delete"
    }

    /// Calico's defaulting of `types` on write: egress rules only → `[Egress]`; both → both;
    /// otherwise `[Ingress]` (even with no rules at all).
    pub fn infer_types(&mut self) {
        if !self.types.is_empty() {
            return;
        }
        let (i, e) = (!self.ingress.is_empty(), !self.egress.is_empty());
        self.types = match (i, e) {
            (false, true) => vec!["Egress".into()],
            (true, true) => vec!["Ingress".into(), "Egress".into()],
            _ => vec!["Ingress".into()],
        };
    }

    pub fn applies_to_ingress(&self) -> bool {
        self.types.iter().any(|t| t == "Ingress")
    }

    pub fn applies_to_egress(&self) -> bool {
        self.types.iter().any(|t| t == "Egress")
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TierSpec {
    /// `None` sorts last, as Calico's `TierLess` does for raw data with no order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order: Option<f64>,
    /// `Deny` or `Pass`; defaulted to `Deny`.
    pub default_action: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProfileSpec {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<Rule>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<Rule>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels_to_apply: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EndpointPort {
    pub name: String,
    pub protocol: Option<Protocol>,
    pub port: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_port: Option<i64>,
    #[serde(rename = "hostIP", skip_serializing_if = "Option::is_none")]
    pub host_ip: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IpNat {
    #[serde(rename = "internalIP")]
    pub internal_ip: String,
    #[serde(rename = "externalIP")]
    pub external_ip: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadEndpointSpec {
    pub orchestrator: String,
    pub workload: String,
    pub node: String,
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub pod: String,
    pub endpoint: String,
    pub service_account_name: String,
    pub ip_networks: Vec<String>,
    #[serde(rename = "ipNATs", skip_serializing_if = "Vec::is_empty")]
    pub ip_nats: Vec<IpNat>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub ipv4_gateway: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub ipv6_gateway: String,
    pub profiles: Vec<String>,
    pub interface_name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mac: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<EndpointPort>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow_spoofed_source_prefixes: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HostEndpointSpec {
    pub node: String,
    pub interface_name: String,
    #[serde(rename = "expectedIPs")]
    pub expected_ips: Vec<String>,
    pub profiles: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<EndpointPort>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NetworkSetSpec {
    pub nets: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IpPoolSpec {
    pub cidr: String,
    #[serde(rename = "vxlanMode")]
    pub vxlan_mode: String,
    #[serde(rename = "ipipMode")]
    pub ipip_mode: String,
    pub nat_outgoing: bool,
    pub disabled: bool,
    #[serde(rename = "disableBGPExport")]
    pub disable_bgp_export: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<i64>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub node_selector: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_uses: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub assignment_mode: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeBgpSpec {
    #[serde(rename = "ipv4Address", skip_serializing_if = "String::is_empty")]
    pub ipv4_address: String,
    #[serde(rename = "ipv6Address", skip_serializing_if = "String::is_empty")]
    pub ipv6_address: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub as_number: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeAddress {
    pub address: String,
    #[serde(rename = "type", skip_serializing_if = "String::is_empty")]
    pub address_type: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bgp: Option<NodeBgpSpec>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<NodeAddress>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClusterInformationSpec {
    #[serde(rename = "clusterGUID", skip_serializing_if = "String::is_empty")]
    pub cluster_guid: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub cluster_type: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub calico_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub datastore_ready: Option<bool>,
}

/// The parts of a `discovery.k8s.io/v1` EndpointSlice Felix reads (its Service is the
/// [`LABEL_SERVICE_NAME`] label). Kubernetes puts these fields at the top level of the object,
/// not under `spec`; readiness conditions are not kept: Felix does not read them.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EndpointSliceSpec {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub address_type: String,
    #[serde(deserialize_with = "null_as_default")]
    pub endpoints: Vec<SliceEndpoint>,
    #[serde(
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub ports: Vec<SlicePort>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SliceEndpoint {
    #[serde(deserialize_with = "null_as_default")]
    pub addresses: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SlicePort {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `TCP` (the default), `UDP` or `SCTP`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// No port: the slice's addresses are not restricted to a port (Felix adds no member).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<i64>,
}

/// The parts of a `v1` Service that name a flow's destination service, as Felix's service
/// cache reads them: the addresses it is reached at and its ports. Other fields are ignored.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct ServiceSpec {
    /// `None` for a headless Service.
    #[serde(rename = "clusterIP", skip_serializing_if = "String::is_empty")]
    pub cluster_ip: String,
    #[serde(
        rename = "clusterIPs",
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub cluster_ips: Vec<String>,
    #[serde(
        rename = "externalIPs",
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub external_ips: Vec<String>,
    #[serde(
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub ports: Vec<ServicePort>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct ServicePort {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// `TCP` (the default), `UDP` or `SCTP`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub protocol: String,
    pub port: i64,
    #[serde(rename = "nodePort", skip_serializing_if = "Option::is_none")]
    pub node_port: Option<i64>,
}

/// A JSON `null` (which Kubernetes writes for some empty lists) read as the default.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A typed resource: metadata plus the spec of its kind.
#[derive(Clone, Debug, PartialEq)]
pub enum Resource {
    /// Every policy kind ([`Kind::is_policy`]): enforced, staged or converted.
    Policy(Kind, ObjectMeta, PolicySpec),
    Tier(ObjectMeta, TierSpec),
    Profile(ObjectMeta, ProfileSpec),
    WorkloadEndpoint(ObjectMeta, WorkloadEndpointSpec),
    HostEndpoint(ObjectMeta, HostEndpointSpec),
    NetworkSet(ObjectMeta, NetworkSetSpec),
    GlobalNetworkSet(ObjectMeta, NetworkSetSpec),
    IPPool(ObjectMeta, IpPoolSpec),
    /// Felix settings are passed through as raw config, so the spec stays free-form.
    FelixConfiguration(ObjectMeta, BTreeMap<String, serde_json::Value>),
    Node(ObjectMeta, NodeSpec),
    ClusterInformation(ObjectMeta, ClusterInformationSpec),
    EndpointSlice(ObjectMeta, EndpointSliceSpec),
    Service(ObjectMeta, ServiceSpec),
}

/// Why one object could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "not an object: a manifest document must be a mapping with kind, apiVersion, metadata and spec"
    )]
    NotAnObject,
    #[error("missing kind")]
    MissingKind,
    #[error("unsupported apiVersion {found:?} (expected {expected})")]
    ApiVersion {
        found: String,
        expected: &'static str,
    },
    #[error("unknown kind {0:?}")]
    UnknownKind(String),
    #[error("{kind} has no metadata.name")]
    MissingName { kind: Kind },
    /// The object is named but a field has the wrong shape.
    #[error("{key}: field {path}: {message}")]
    Field {
        key: ResourceKey,
        path: String,
        message: String,
    },
}

/// What decoding one object produced.
// A transient value, consumed at once; boxing would only add an allocation per object.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Decoded {
    Resource(ResourceKey, Resource),
    /// A Calico kind that the policy dataplane does not use; its kind and name.
    Ignored(String, String),
}

impl Resource {
    /// Decodes one v3 object and applies Calico's defaulting.
    pub fn from_value(value: serde_json::Value) -> Result<Decoded, DecodeError> {
        let serde_json::Value::Object(mut obj) = value else {
            return Err(DecodeError::NotAnObject);
        };
        let kind_name = match obj.get("kind") {
            Some(serde_json::Value::String(k)) => k.clone(),
            _ => return Err(DecodeError::MissingKind),
        };
        let api_version = obj
            .get("apiVersion")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default();
        if let Some(native) = kubernetes::Native::of(&kind_name, api_version) {
            return kubernetes_native(native, obj);
        }
        let expected = api_version_of(&kind_name);
        match obj.get("apiVersion") {
            Some(serde_json::Value::String(v)) if v == expected => {}
            other => {
                return Err(DecodeError::ApiVersion {
                    found: other.and_then(|v| v.as_str()).unwrap_or_default().into(),
                    expected,
                });
            }
        }
        let meta_value = obj.remove("metadata").unwrap_or(serde_json::Value::Null);
        let Some(kind) = Kind::from_name(&kind_name) else {
            if IGNORED_KINDS.contains(&kind_name.as_str())
                || IGNORED_KUBERNETES_KINDS
                    .iter()
                    .any(|(k, _)| *k == kind_name)
            {
                let name = meta_value
                    .get("name")
                    .and_then(|n| n.as_str())
                    .unwrap_or_default()
                    .to_string();
                return Ok(Decoded::Ignored(kind_name, name));
            }
            return Err(DecodeError::UnknownKind(kind_name));
        };
        let name = meta_value
            .get("name")
            .and_then(|n| n.as_str())
            .filter(|n| !n.is_empty())
            .ok_or(DecodeError::MissingName { kind })?
            .to_string();
        // The key is known before the body is decoded, so shape errors can name the object.
        let mut key = ResourceKey::new(kind, None, &name);
        if kind.namespaced() {
            let ns = meta_value
                .get("namespace")
                .and_then(|n| n.as_str())
                .filter(|n| !n.is_empty())
                .unwrap_or("default");
            key.namespace = Some(ns.to_string());
        }
        let field_err = |path: String, message: String| DecodeError::Field {
            key: key.clone(),
            path,
            message,
        };
        let mut meta: ObjectMeta =
            decode_at("metadata", meta_value).map_err(|(p, m)| field_err(p, m))?;
        meta.namespace = key.namespace.clone();
        let spec = if kind == Kind::EndpointSlice {
            // Kubernetes keeps an EndpointSlice's fields at the top level.
            let fields = ["addressType", "endpoints", "ports"];
            serde_json::Value::Object(
                fields
                    .into_iter()
                    .filter_map(|f| obj.remove(f).map(|v| (f.to_string(), v)))
                    .collect(),
            )
        } else {
            obj.remove("spec").unwrap_or(serde_json::Value::Null)
        };
        let spec = if spec.is_null() {
            serde_json::Value::Object(Default::default())
        } else {
            spec
        };
        let res = (|| -> Result<Resource, (String, String)> {
            Ok(match kind {
                Kind::StagedKubernetesNetworkPolicy => {
                    Resource::Policy(kind, meta, staged_kubernetes_policy(spec)?)
                }
                Kind::ClusterNetworkPolicy
                | Kind::AdminNetworkPolicy
                | Kind::BaselineAdminNetworkPolicy => {
                    Resource::Policy(kind, meta, network_policy_api::policy_spec(kind, spec)?)
                }
                Kind::NetworkPolicy
                | Kind::GlobalNetworkPolicy
                | Kind::StagedNetworkPolicy
                | Kind::StagedGlobalNetworkPolicy => {
                    let mut s: PolicySpec = decode_at("spec", spec)?;
                    if !kind.is_global_policy() {
                        s.do_not_track = false;
                        s.pre_dnat = false;
                        s.apply_on_forward = false;
                        s.namespace_selector.clear();
                    }
                    if !kind.is_staged() {
                        s.staged_action.clear();
                    }
                    Resource::Policy(kind, meta, s)
                }
                Kind::Tier => Resource::Tier(meta, decode_at("spec", spec)?),
                Kind::Profile => Resource::Profile(meta, decode_at("spec", spec)?),
                Kind::WorkloadEndpoint => {
                    Resource::WorkloadEndpoint(meta, decode_at("spec", spec)?)
                }
                Kind::HostEndpoint => Resource::HostEndpoint(meta, decode_at("spec", spec)?),
                Kind::NetworkSet => Resource::NetworkSet(meta, decode_at("spec", spec)?),
                Kind::GlobalNetworkSet => {
                    Resource::GlobalNetworkSet(meta, decode_at("spec", spec)?)
                }
                Kind::IPPool => Resource::IPPool(meta, decode_at("spec", spec)?),
                Kind::FelixConfiguration => {
                    Resource::FelixConfiguration(meta, decode_at("spec", spec)?)
                }
                Kind::Node => Resource::Node(meta, decode_at("spec", spec)?),
                Kind::ClusterInformation => {
                    Resource::ClusterInformation(meta, decode_at("spec", spec)?)
                }
                Kind::EndpointSlice => Resource::EndpointSlice(meta, decode_at("", spec)?),
                Kind::Service => Resource::Service(meta, decode_at("spec", spec)?),
            })
        })()
        .map_err(|(p, m)| field_err(p, m))?;
        let mut res = res;
        res.apply_defaults();
        Ok(Decoded::Resource(key, res))
    }

    /// Calico's defaulting, applied once at decode time so every consumer sees the same object.
    fn apply_defaults(&mut self) {
        match self {
            Resource::Policy(_, _, s) => {
                s.infer_types();
                if s.tier.is_empty() {
                    s.tier = "default".into();
                }
            }
            Resource::Tier(_, s) if s.default_action.is_empty() => {
                s.default_action = "Deny".into();
            }
            // Calico's client labels every workload endpoint with its namespace and
            // orchestrator on write; policies select on those labels. The namespace label is
            // always overwritten so an endpoint cannot claim another namespace.
            Resource::WorkloadEndpoint(m, s) => {
                if let Some(ns) = m.namespace.clone() {
                    m.labels.insert(LABEL_NAMESPACE.into(), ns);
                }
                if !s.orchestrator.is_empty() {
                    m.labels
                        .entry(LABEL_ORCHESTRATOR.into())
                        .or_insert_with(|| s.orchestrator.clone());
                }
            }
            _ => {}
        }
    }

    pub fn kind(&self) -> Kind {
        match self {
            Resource::Policy(kind, ..) => *kind,
            Resource::Tier(..) => Kind::Tier,
            Resource::Profile(..) => Kind::Profile,
            Resource::WorkloadEndpoint(..) => Kind::WorkloadEndpoint,
            Resource::HostEndpoint(..) => Kind::HostEndpoint,
            Resource::NetworkSet(..) => Kind::NetworkSet,
            Resource::GlobalNetworkSet(..) => Kind::GlobalNetworkSet,
            Resource::IPPool(..) => Kind::IPPool,
            Resource::FelixConfiguration(..) => Kind::FelixConfiguration,
            Resource::Node(..) => Kind::Node,
            Resource::ClusterInformation(..) => Kind::ClusterInformation,
            Resource::EndpointSlice(..) => Kind::EndpointSlice,
            Resource::Service(..) => Kind::Service,
        }
    }

    /// What converting a Kubernetes policy kind dropped or changed (see
    /// [`PolicySpec::conversion_warnings`]); empty for every other object.
    pub fn conversion_warnings(&self) -> &[String] {
        match self {
            Resource::Policy(_, _, s) => &s.conversion_warnings,
            _ => &[],
        }
    }

    pub fn meta(&self) -> &ObjectMeta {
        match self {
            Resource::Policy(_, m, _)
            | Resource::Tier(m, _)
            | Resource::Profile(m, _)
            | Resource::WorkloadEndpoint(m, _)
            | Resource::HostEndpoint(m, _)
            | Resource::NetworkSet(m, _)
            | Resource::GlobalNetworkSet(m, _)
            | Resource::IPPool(m, _)
            | Resource::FelixConfiguration(m, _)
            | Resource::Node(m, _)
            | Resource::ClusterInformation(m, _)
            | Resource::EndpointSlice(m, _)
            | Resource::Service(m, _) => m,
        }
    }

    pub fn key(&self) -> ResourceKey {
        let m = self.meta();
        ResourceKey::new(self.kind(), m.namespace.as_deref(), &m.name)
    }

    /// The v3 JSON form (`kind`, `apiVersion`, `metadata`, `spec`), as calicoctl writes it. A
    /// converted kind (StagedKubernetesNetworkPolicy, the network-policy-api kinds) is written
    /// with its kind and the converted spec, which [`Resource::from_value`] reads back.
    pub fn to_value(&self) -> serde_json::Value {
        fn spec<T: Serialize>(t: &T) -> serde_json::Value {
            serde_json::to_value(t).unwrap_or(serde_json::Value::Null)
        }
        let spec = match self {
            Resource::Policy(_, _, s) => spec(s),
            Resource::Tier(_, s) => spec(s),
            Resource::Profile(_, s) => spec(s),
            Resource::WorkloadEndpoint(_, s) => spec(s),
            Resource::HostEndpoint(_, s) => spec(s),
            Resource::NetworkSet(_, s) | Resource::GlobalNetworkSet(_, s) => spec(s),
            Resource::IPPool(_, s) => spec(s),
            Resource::FelixConfiguration(_, s) => spec(s),
            Resource::Node(_, s) => spec(s),
            Resource::ClusterInformation(_, s) => spec(s),
            Resource::Service(_, s) => spec(s),
            Resource::EndpointSlice(m, s) => {
                // Kubernetes' shape: the fields beside the metadata, no `spec`.
                let mut v = spec(s);
                if let serde_json::Value::Object(o) = &mut v {
                    o.insert("kind".into(), self.kind().as_str().into());
                    o.insert("apiVersion".into(), self.kind().api_version().into());
                    o.insert("metadata".into(), spec_of(m));
                }
                return v;
            }
        };
        serde_json::json!({
            "kind": self.kind().as_str(),
            "apiVersion": self.kind().api_version(),
            "metadata": spec_of(self.meta()),
            "spec": spec,
        })
    }
}

/// A `StagedKubernetesNetworkPolicy` spec (a Kubernetes NetworkPolicy spec plus
/// `stagedAction`) as the Calico policy spec Calico's syncer converts it to.
fn staged_kubernetes_policy(spec: serde_json::Value) -> Result<PolicySpec, (String, String)> {
    let serde_json::Value::Object(mut spec) = spec else {
        return Err(("spec".into(), "expected an object".into()));
    };
    // The converted form, as `to_value` writes it (the file datastore's last-good store): a
    // Calico spec has a `selector` where a Kubernetes one has a `podSelector`. A manifest
    // written that way is refused by the strict decoder (unknown field `selector`).
    if spec.contains_key("selector") && !spec.contains_key("podSelector") {
        return decode_at("spec", serde_json::Value::Object(spec));
    }
    let staged_action = match spec.remove("stagedAction") {
        None | Some(serde_json::Value::Null) => String::new(),
        Some(serde_json::Value::String(a)) => a,
        Some(_) => return Err(("spec.stagedAction".into(), "expected a string".into())),
    };
    let k8s: k8s_openapi::api::networking::v1::NetworkPolicySpec =
        decode_at("spec", serde_json::Value::Object(spec))?;
    let (calico, warnings) =
        kubernetes::network_policy_spec(&k8s).map_err(|e| ("spec".to_string(), e.to_string()))?;
    let mut out: PolicySpec = decode_at("spec", serde_json::Value::Object(calico))?;
    out.staged_action = staged_action;
    out.conversion_warnings = warnings;
    Ok(out)
}

/// A Kubernetes NetworkPolicy or Namespace ([`kubernetes::Native`]), converted as Calico's
/// Kubernetes datastore converts it and decoded as that Calico object: the same key, spec and
/// defaulting whatever datastore it comes from. A shape error names the converted object.
fn kubernetes_native(
    native: kubernetes::Native,
    mut obj: serde_json::Map<String, serde_json::Value>,
) -> Result<Decoded, DecodeError> {
    let kind = native.calico_kind();
    let meta_value = obj.remove("metadata").unwrap_or(serde_json::Value::Null);
    let text = |field: &str| {
        meta_value
            .get(field)
            .and_then(serde_json::Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    let name = text("name").ok_or(DecodeError::MissingName { kind })?;
    let namespace = text("namespace").unwrap_or_else(|| "default".into());
    let key = ResourceKey::new(
        kind,
        kind.namespaced().then_some(namespace.as_str()),
        &native.calico_name(&name),
    );
    let field_err = |(path, message): (String, String)| DecodeError::Field {
        key: key.clone(),
        path,
        message,
    };
    let meta: ObjectMeta = decode_at("metadata", meta_value).map_err(field_err)?;
    let spec = match obj.remove("spec") {
        None | Some(serde_json::Value::Null) => serde_json::Value::Object(Default::default()),
        Some(spec) => spec,
    };
    let (value, warnings) = match native {
        kubernetes::Native::NetworkPolicy => {
            let spec: k8s_openapi::api::networking::v1::NetworkPolicySpec =
                decode_at("spec", spec).map_err(field_err)?;
            kubernetes::network_policy_object(&name, &namespace, &spec)
                .map_err(|e| field_err(("spec".into(), e.to_string())))?
        }
        kubernetes::Native::Namespace => (
            kubernetes::namespace_profile(&name, &meta.labels),
            Vec::new(),
        ),
    };
    Ok(match Resource::from_value(value)? {
        Decoded::Resource(key, Resource::Policy(kind, meta, mut spec)) => {
            spec.conversion_warnings = warnings;
            Decoded::Resource(key, Resource::Policy(kind, meta, spec))
        }
        other => other,
    })
}

fn spec_of(meta: &ObjectMeta) -> serde_json::Value {
    serde_json::to_value(meta).unwrap_or(serde_json::Value::Null)
}

/// Deserialises `value` and, on failure, returns the JSON path of the offending field.
fn decode_at<T: for<'de> Deserialize<'de>>(
    root: &str,
    value: serde_json::Value,
) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let path = if inner == "." || inner.is_empty() {
            root.to_string()
        } else if root.is_empty() {
            inner
        } else {
            format!("{root}.{inner}")
        };
        (path, e.into_inner().to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn decode(v: serde_json::Value) -> (ResourceKey, Resource) {
        match Resource::from_value(v).unwrap() {
            Decoded::Resource(k, r) => (k, r),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn policy_defaults_types_tier_and_namespace() {
        let (key, res) = decode(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
            "metadata": {"name": "p"},
            "spec": {"selector": "app == 'x'", "egress": [{"action": "Allow"}]}
        }));
        assert_eq!(key.to_string(), "NetworkPolicy default/p");
        let Resource::Policy(Kind::NetworkPolicy, meta, spec) = res else {
            panic!()
        };
        assert_eq!(meta.namespace.as_deref(), Some("default"));
        assert_eq!(spec.types, vec!["Egress"]);
        assert_eq!(spec.tier, "default");
    }

    #[test]
    fn types_inference_matches_calico() {
        let mut s = PolicySpec::default();
        s.infer_types();
        assert_eq!(
            s.types,
            vec!["Ingress"],
            "no rules at all still means Ingress"
        );
        let mut s = PolicySpec {
            ingress: vec![Rule::default()],
            egress: vec![Rule::default()],
            ..Default::default()
        };
        s.infer_types();
        assert_eq!(s.types, vec!["Ingress", "Egress"]);
        let mut s = PolicySpec {
            egress: vec![Rule::default()],
            types: vec!["Ingress".into()],
            ..Default::default()
        };
        s.infer_types();
        assert_eq!(s.types, vec!["Ingress"], "explicit types are kept");
    }

    #[test]
    fn gnp_only_fields_are_dropped_on_namespaced_policy() {
        let (_, res) = decode(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": "prod"},
            "spec": {"doNotTrack": true, "namespaceSelector": "all()"}
        }));
        let Resource::Policy(Kind::NetworkPolicy, _, spec) = res else {
            panic!()
        };
        assert!(!spec.do_not_track && spec.namespace_selector.is_empty());
    }

    #[test]
    fn shape_errors_name_the_object_and_field() {
        let err = Resource::from_value(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "bad"},
            "spec": {"ingress": [{"action": "Allow", "source": {"nets": "10.0.0.0/8"}}]}
        }))
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("GlobalNetworkPolicy bad: field spec.ingress[0].source.nets:"),
            "{msg}"
        );
    }

    #[test]
    fn unknown_fields_are_ignored_and_unknown_kinds_rejected() {
        let (_, res) = decode(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "Tier",
            "metadata": {"name": "security", "somethingNew": 1},
            "spec": {"order": 100, "futureField": {"x": 1}}
        }));
        assert_eq!(
            res,
            Resource::Tier(
                ObjectMeta {
                    name: "security".into(),
                    ..Default::default()
                },
                TierSpec {
                    order: Some(100.0),
                    default_action: "Deny".into()
                },
            )
        );
        assert_eq!(
            Resource::from_value(
                json!({"apiVersion": "projectcalico.org/v3", "kind": "Frob", "metadata": {"name": "x"}})
            ),
            Err(DecodeError::UnknownKind("Frob".into()))
        );
        assert_eq!(
            Resource::from_value(
                json!({"apiVersion": "projectcalico.org/v3", "kind": "BGPPeer", "metadata": {"name": "peer"}})
            ),
            Ok(Decoded::Ignored("BGPPeer".into(), "peer".into()))
        );
        assert!(matches!(
            Resource::from_value(json!({"apiVersion": "v1", "kind": "Tier", "metadata": {"name": "x"}})),
            Err(DecodeError::ApiVersion { found, .. }) if found == "v1"
        ));
    }

    #[test]
    fn etcd_paths_follow_calico_layout() {
        assert_eq!(
            ResourceKey::new(Kind::NetworkPolicy, Some("prod"), "allow-frontend").etcd_path(),
            "/calico/resources/v3/projectcalico.org/networkpolicies/prod/allow-frontend"
        );
        assert_eq!(
            ResourceKey::new(Kind::Tier, None, "default").etcd_path(),
            "/calico/resources/v3/projectcalico.org/tiers/default"
        );
    }

    #[test]
    fn round_trips_through_v3_json() {
        let v = json!({
            "kind": "WorkloadEndpoint", "apiVersion": "projectcalico.org/v3",
            "metadata": {"name": "node1-k8s-nginx--5d8f-eth0", "namespace": "default",
                         "labels": {"app": "nginx"}},
            "spec": {"orchestrator": "k8s", "node": "node1", "pod": "nginx-5d8f", "endpoint": "eth0",
                     "ipNetworks": ["10.65.0.5/32"], "profiles": ["kns.default"],
                     "interfaceName": "calia37792c9b43", "mac": "ee:ee:ee:ee:ee:ee",
                     "ports": [{"name": "http", "protocol": "TCP", "port": 80}]}
        });
        let (_, res) = decode(v);
        let (_, again) = decode(res.to_value());
        assert_eq!(res, again);
    }

    #[test]
    fn endpoint_slices_decode_from_kubernetes_shape_and_round_trip() {
        let v = json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-x1", "namespace": "prod",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": false}},
                          {"addresses": ["10.0.0.2"]}],
            "ports": [{"name": "http", "port": 80}, {"protocol": "UDP", "port": 53}]
        });
        let (key, res) = decode(v);
        assert_eq!(key.to_string(), "EndpointSlice prod/web-x1");
        let Resource::EndpointSlice(meta, s) = &res else {
            panic!("{res:?}")
        };
        assert_eq!(meta.labels[LABEL_SERVICE_NAME], "web");
        assert_eq!(s.endpoints[1].addresses, ["10.0.0.2"]);
        assert_eq!(s.ports[1].protocol.as_deref(), Some("UDP"));
        let out = res.to_value();
        assert_eq!(out["apiVersion"], "discovery.k8s.io/v1");
        assert!(out.get("spec").is_none(), "Kubernetes' shape: {out}");
        let (_, again) = decode(out);
        assert_eq!(res, again);
        // Kubernetes writes `null` for empty lists.
        let (_, res) = decode(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "empty", "namespace": "prod"},
            "addressType": "IPv4", "endpoints": null, "ports": null
        }));
        assert_eq!(
            res,
            Resource::EndpointSlice(
                ObjectMeta {
                    name: "empty".into(),
                    namespace: Some("prod".into()),
                    ..Default::default()
                },
                EndpointSliceSpec {
                    address_type: "IPv4".into(),
                    ..Default::default()
                }
            )
        );
    }

    #[test]
    fn each_kind_has_its_api_version() {
        // A Service is read for flow logs: the addresses and ports it is reached at; the
        // fields it does not need (type, selector, …) are ignored.
        let Ok(Decoded::Resource(key, Resource::Service(_, spec))) = Resource::from_value(
            json!({"apiVersion": "v1", "kind": "Service",
                                        "metadata": {"name": "web", "namespace": "prod"},
                                        "spec": {"type": "ClusterIP", "selector": {"app": "web"},
                                                 "clusterIP": "10.96.0.10",
                                                 "clusterIPs": ["10.96.0.10"], "externalIPs": null,
                                                 "ports": [{"name": "http", "port": 80,
                                                            "targetPort": 8080, "nodePort": 30080}]}}),
        ) else {
            panic!("a v1 Service decodes")
        };
        assert_eq!(key.to_string(), "Service prod/web");
        assert_eq!(spec.cluster_ip, "10.96.0.10");
        assert_eq!(
            (
                spec.ports[0].name.as_str(),
                spec.ports[0].port,
                spec.ports[0].node_port
            ),
            ("http", 80, Some(30080))
        );
        assert!(matches!(
            Resource::from_value(
                json!({"apiVersion": "projectcalico.org/v3", "kind": "Service",
                                        "metadata": {"name": "web"}})
            ),
            Err(DecodeError::ApiVersion { expected: "v1", .. })
        ));
        assert_eq!(
            Resource::from_value(json!({"apiVersion": "projectcalico.org/v3",
                                        "kind": "EndpointSlice", "metadata": {"name": "x"}})),
            Err(DecodeError::ApiVersion {
                found: "projectcalico.org/v3".into(),
                expected: ENDPOINT_SLICE_API_VERSION
            })
        );
        assert!(
            Resource::from_value(
                json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                       "metadata": {"name": "x"}, "ports": [{"port": "http"}]})
            )
            .unwrap_err()
            .to_string()
            .contains("field ports[0].port"),
            "shape errors name the top-level field"
        );
        assert!(Kind::ALL.iter().all(|k| k.api_version() == API_VERSION));
        assert_eq!(Kind::from_name("EndpointSlice"), Some(Kind::EndpointSlice));
    }

    #[test]
    fn workload_endpoints_get_calico_labels() {
        let (_, res) = decode(json!({
            "kind": "WorkloadEndpoint", "apiVersion": "projectcalico.org/v3",
            "metadata": {"name": "n-k8s-p-eth0", "namespace": "shop",
                         "labels": {"projectcalico.org/namespace": "other"}},
            "spec": {"orchestrator": "k8s", "node": "n"}
        }));
        let labels = &res.meta().labels;
        assert_eq!(
            labels[LABEL_NAMESPACE], "shop",
            "cannot pretend to be in another namespace"
        );
        assert_eq!(labels[LABEL_ORCHESTRATOR], "k8s");
    }

    #[test]
    fn staged_kubernetes_policies_are_converted_and_round_trip() {
        let (key, res) = decode(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "StagedKubernetesNetworkPolicy",
            "metadata": {"name": "db", "namespace": "prod"},
            "spec": {
                "stagedAction": "Set",
                "podSelector": {"matchLabels": {"app": "db"}},
                "ingress": [
                    {"from": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                     "ports": [{"port": 5432}]},
                    {"ports": [{"port": "http", "endPort": 90}]}
                ],
                "policyTypes": ["Ingress"]
            }
        }));
        assert_eq!(key.to_string(), "StagedKubernetesNetworkPolicy prod/db");
        let Resource::Policy(Kind::StagedKubernetesNetworkPolicy, _, spec) = &res else {
            panic!("{res:?}")
        };
        assert_eq!(spec.staged_action, "Set");
        assert_eq!(
            spec.selector,
            "projectcalico.org/orchestrator == 'k8s' && app == 'db'"
        );
        assert_eq!(spec.ingress.len(), 1, "the bad rule is dropped");
        assert_eq!(spec.conversion_warnings.len(), 1);
        assert!(
            spec.conversion_warnings[0].starts_with("ingress rule 1 dropped"),
            "{:?}",
            spec.conversion_warnings
        );
        // The last-good store writes `to_value` and reads it back.
        let (_, again) = decode(res.to_value());
        let (Resource::Policy(_, _, a), Resource::Policy(_, _, b)) = (&res, &again) else {
            panic!()
        };
        assert_eq!(
            (a.selector.as_str(), &a.ingress, &a.types, &a.staged_action),
            (b.selector.as_str(), &b.ingress, &b.types, &b.staged_action)
        );
    }

    /// Kubernetes' own NetworkPolicy and Namespace, written as manifests, become what the
    /// Kubernetes datastore makes of them: the NetworkPolicy `knp.default.<name>` (conversion
    /// warnings kept) and the Profile `kns.<name>` with the namespace's labels. A malformed
    /// spec names the converted object, so its last good version is found; the last-good
    /// store's form (`to_value`) reads back as the same object.
    #[test]
    fn kubernetes_network_policies_and_namespaces_are_converted() {
        let (key, res) = decode(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "db", "namespace": "prod", "labels": {"a": "b"}},
            "spec": {
                "podSelector": {"matchLabels": {"app": "db"}},
                "ingress": [
                    {"from": [{"namespaceSelector": {"matchLabels": {"team": "web"}}}],
                     "ports": [{"port": 5432}]},
                    {"ports": [{"port": "http", "endPort": 90}]}
                ]
            }
        }));
        assert_eq!(key.to_string(), "NetworkPolicy prod/knp.default.db");
        let Resource::Policy(Kind::NetworkPolicy, meta, spec) = &res else {
            panic!("{res:?}")
        };
        assert!(meta.labels.is_empty(), "Calico keeps no labels: {meta:?}");
        assert_eq!(
            (spec.tier.as_str(), spec.order, spec.types.clone()),
            ("default", Some(1000.0), vec!["Ingress".to_string()])
        );
        assert_eq!(
            spec.selector,
            "projectcalico.org/orchestrator == 'k8s' && app == 'db'"
        );
        assert_eq!(spec.ingress.len(), 1, "the bad rule is dropped");
        assert_eq!(spec.ingress[0].source.namespace_selector, "team == 'web'");
        assert!(
            spec.conversion_warnings[0].starts_with("ingress rule 1 dropped"),
            "{:?}",
            spec.conversion_warnings
        );
        assert!(Valid::check(res.clone()).is_ok());
        let (again_key, again) = decode(res.to_value());
        assert_eq!(again_key, key);
        let (Resource::Policy(_, _, a), Resource::Policy(_, _, b)) = (&res, &again) else {
            panic!()
        };
        assert_eq!(
            (&a.selector, &a.ingress, &a.types, a.order),
            (&b.selector, &b.ingress, &b.types, b.order)
        );

        let (key, res) = decode(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "prod", "labels": {"team": "db"}}
        }));
        assert_eq!(key.to_string(), "Profile kns.prod");
        let Resource::Profile(_, profile) = &res else {
            panic!("{res:?}")
        };
        assert_eq!(
            serde_json::to_value(&profile.labels_to_apply).unwrap(),
            json!({"pcns.team": "db", "pcns.projectcalico.org/name": "prod"})
        );

        // A spec of the wrong shape: the converted object, invalid.
        let err = Resource::from_value(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "db"}, "spec": {"ingress": "all"}
        }))
        .unwrap_err();
        assert!(
            matches!(&err, DecodeError::Field { key, path, .. }
                if key.to_string() == "NetworkPolicy default/knp.default.db" && path == "spec.ingress"),
            "{err:?}"
        );
        // Another apiVersion is not Kubernetes': Calico's NetworkPolicy is still
        // projectcalico.org/v3.
        assert!(matches!(
            Resource::from_value(json!({"apiVersion": "networking.k8s.io/v1beta1",
                "kind": "NetworkPolicy", "metadata": {"name": "db"}})),
            Err(DecodeError::ApiVersion { .. })
        ));
    }

    #[test]
    fn enforced_kinds_do_not_keep_a_staged_action() {
        let (_, res) = decode(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "g"}, "spec": {"stagedAction": "Delete"}
        }));
        let Resource::Policy(_, _, spec) = res else {
            panic!()
        };
        assert!(!spec.stages_a_delete());
    }
}
