//! One Kubernetes object → a graph resource, as Calico's Kubernetes datastore converts it
//! (`libcalico-go/lib/backend/k8s/conversion` and `k8s/resources`). Pure: no IO, no clock.
//!
//! Every conversion builds the v3 object Calico's backend would hand to Felix and passes it
//! through [`decode_and_validate`], the path manifests and etcd values take, so defaulting and
//! validation are shared and the graph cannot tell the datastores apart.
//!
//! - Calico CRDs (`crd.projectcalico.org/v1`): the spec is the v3 spec. Metadata is restored
//!   from the `projectcalico.org/metadata` annotation Calico's client writes (its labels and
//!   annotations merged over the CR's own; its name, when set, is the v3 name). Policies without
//!   that name lose a legacy `default.` prefix in the default tier, as the etcd adapter does.
//! - Pod → WorkloadEndpoint `<node>-k8s-<pod>-eth0` (dashes in a part doubled), interface
//!   `<prefix>` + 11 hex digits of `SHA-1("<namespace>.<pod>")`, IPs from `status.podIPs`, then
//!   `status.podIP`, then Calico's and AWS's annotations; profiles `kns.<ns>` and
//!   `ksa.<ns>.<sa>`; labels plus `projectcalico.org/{namespace,orchestrator,serviceaccount}`;
//!   named (and host) container ports. Not endpoints ([`Decision::Skip`]): host-network pods,
//!   pods not scheduled yet, pods without an IP, and finished pods (phase Succeeded, Failed or
//!   Completed, or being deleted after the CNI plugin released the IP), which no longer own it.
//! - Namespace → Profile `kns.<ns>`: allow both ways, labels `pcns.<k>` and
//!   `pcns.projectcalico.org/name`. ServiceAccount → Profile `ksa.<ns>.<sa>`: labels `pcsa.<k>`
//!   and `pcsa.projectcalico.org/name`, no rules.
//! - Kubernetes NetworkPolicy → NetworkPolicy `knp.default.<name>` in the default tier at order
//!   1000 (see `k8s_network_policy`).
//! - Node → Node: labels, BGP addresses and AS number from Calico's node annotations, addresses.
//! - EndpointSlice → the graph's EndpointSlice: name, namespace, labels (the
//!   `kubernetes.io/service-name` label names its Service), address type, endpoint addresses and
//!   ports. Conditions, topology and owner are dropped (Felix does not read them), so a slice
//!   whose readiness alone changes sends nothing.
//! - ClusterNetworkPolicy, AdminNetworkPolicy, BaselineAdminNetworkPolicy: the object itself
//!   (its kind and apiVersion added when the list omits them, metadata reduced to the name as
//!   Calico's conversion keeps it), which the graph's decoder converts
//!   (`calc_graph::model::network_policy_api`). Read without the strict field check: the API
//!   server has already pruned what its CRD does not define, and a field of a newer CRD must
//!   make a rule fail closed, not the whole policy be refused.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use calc_graph::manifest::{Rejection, decode_and_validate, decode_and_validate_strict};
use calc_graph::model::kubernetes::{self, masked_cidr};
use calc_graph::model::validate::{FieldError, parse_cidr_or_ip};
use calc_graph::model::{API_VERSION, ENDPOINT_SLICE_API_VERSION, Kind, SERVICE_API_VERSION};
use k8s_openapi::api::core::v1::{Container, Namespace, Node, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy as K8sNetworkPolicy;
use serde_json::{Map, Value, json};
use sha1::{Digest, Sha1};

use super::Source;
use crate::Decision;

/// The annotation Calico's client stores a CRD-backed object's v3 metadata in.
pub const METADATA_ANNOTATION: &str = "projectcalico.org/metadata";
/// Profile name prefixes and label prefixes of Calico's Kubernetes conversion (the namespace's,
/// and the label carrying a namespace's or service account's own name, are the graph's: it
/// converts namespaces and NetworkPolicies written as manifests the same way).
pub const SERVICE_ACCOUNT_PROFILE_PREFIX: &str = "ksa.";
pub const SERVICE_ACCOUNT_LABEL_PREFIX: &str = "pcsa.";
pub use calc_graph::model::kubernetes::{
    K8S_POLICY_ORDER, K8S_POLICY_PREFIX, NAME_LABEL, NAMESPACE_LABEL_PREFIX,
    NAMESPACE_PROFILE_PREFIX,
};

const LABEL_NAMESPACE: &str = "projectcalico.org/namespace";
const LABEL_ORCHESTRATOR: &str = "projectcalico.org/orchestrator";
const LABEL_SERVICE_ACCOUNT: &str = "projectcalico.org/serviceaccount";
const ANNOTATION_POD_IP: &str = "cni.projectcalico.org/podIP";
const ANNOTATION_POD_IPS: &str = "cni.projectcalico.org/podIPs";
const ANNOTATION_AWS_POD_IPS: &str = "vpc.amazonaws.com/pod-ips";
const ANNOTATION_CONTAINER_ID: &str = "cni.projectcalico.org/containerID";
const ANNOTATION_FLOATING_IPS: &str = "cni.projectcalico.org/floatingIPs";
const ANNOTATION_SOURCE_PREFIXES: &str = "cni.projectcalico.org/allowedSourcePrefixes";
const NODE_IPV4_ANNOTATION: &str = "projectcalico.org/IPv4Address";
const NODE_IPV6_ANNOTATION: &str = "projectcalico.org/IPv6Address";
const NODE_ASN_ANNOTATION: &str = "projectcalico.org/ASNumber";
const NODE_LABELS_ANNOTATION: &str = "projectcalico.org/labels";

/// Why a Kubernetes object cannot be converted: it is refused before decoding, and its last
/// good version stays in force. Values from the object are shown quoted and escaped.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("cannot decode the object: {0}")]
    Undecodable(serde_json::Error),
    #[error("pod IP {0:?} is not an IP address")]
    PodIp(String),
    /// An annotation that must hold a JSON list of strings.
    #[error("annotation {annotation}: {value:?} is not a JSON list of strings: {error}")]
    NotAList {
        annotation: &'static str,
        value: String,
        error: serde_json::Error,
    },
    #[error("annotation {annotation}: {value:?} is not a CIDR")]
    NotACidr {
        annotation: &'static str,
        value: String,
    },
    #[error("annotation {METADATA_ANNOTATION} is not JSON: {0}")]
    Metadata(serde_json::Error),
    #[error("metadata is missing or not a JSON object")]
    NoMetadata,
    #[error("not a JSON object")]
    NotAnObject,
    /// A list item whose `kind` is not the listed collection's.
    #[error("kind {found} listed as {plural}.{group}", plural = listed.plural())]
    OtherKind {
        found: Value,
        listed: Kind,
        group: &'static str,
    },
    /// A Kubernetes NetworkPolicy whose pod selector cannot be converted.
    #[error(transparent)]
    NetworkPolicy(FieldError),
}

/// Conversion settings.
#[derive(Clone, Debug)]
pub struct Converter {
    /// Host-side interface name prefix of pods (`cali`).
    pub interface_prefix: String,
}

impl Default for Converter {
    fn default() -> Self {
        Converter {
            interface_prefix: "cali".into(),
        }
    }
}

impl Converter {
    /// Converts one object of `source` (its full JSON, as the API server sends it).
    pub fn convert(&self, source: Source, object: Value) -> Decision {
        // A Calico CRD's spec is the user's v3 spec: a field the API does not define (kept by a
        // CRD that preserves unknown fields, or an old CRD version) is refused by name. The
        // other sources are converted by us and hold only fields we wrote.
        let strict = matches!(source, Source::Crd(_));
        let result = match source {
            Source::Crd(kind) => crd(kind, object),
            Source::Pod => typed::<Pod>(object).and_then(|p| self.pod(&p)),
            Source::Namespace => typed::<Namespace>(object).and_then(|n| namespace(&n)),
            Source::ServiceAccount => {
                typed::<ServiceAccount>(object).and_then(|s| service_account(&s))
            }
            Source::Node => typed::<Node>(object).and_then(|n| node(&n)),
            Source::KubernetesNetworkPolicy => {
                typed::<K8sNetworkPolicy>(object).and_then(|np| k8s_network_policy(&np))
            }
            Source::EndpointSlice => typed::<EndpointSlice>(object).map(|s| endpoint_slice(&s)),
            Source::Service => typed::<Service>(object).map(|s| service(&s)),
            Source::NetworkPolicyApi(kind) => network_policy_api(kind, object),
        };
        match result {
            Ok(Converted::Value(v, warnings)) => {
                let outcome = if strict {
                    decode_and_validate_strict(v)
                } else {
                    decode_and_validate(v)
                };
                Decision::from_outcome(outcome, warnings)
            }
            Ok(Converted::Skip) => Decision::Skip,
            Err(e) => Decision::Reject(Rejection::datastore(e)),
        }
    }

    /// Calico's `VethNameForWorkload`.
    pub fn interface_name(&self, namespace: &str, pod: &str) -> String {
        let digest = Sha1::digest(format!("{namespace}.{pod}").as_bytes());
        let mut hex = String::with_capacity(40);
        for b in digest {
            let _ = write!(hex, "{b:02x}");
        }
        format!("{}{}", self.interface_prefix, &hex[..11])
    }

    fn pod(&self, pod: &Pod) -> Result<Converted, ConvertError> {
        let meta = &pod.metadata;
        let name = meta.name.as_deref().unwrap_or_default();
        let ns = meta.namespace.as_deref().unwrap_or("default");
        let Some(spec) = &pod.spec else {
            return Ok(Converted::Skip);
        };
        // Host-networked pods share the node's interfaces: they are not endpoints. Pods that
        // are not scheduled have no node (and no interface) yet.
        if spec.host_network == Some(true) {
            return Ok(Converted::Skip);
        }
        let node = spec.node_name.as_deref().unwrap_or_default();
        if node.is_empty() {
            return Ok(Converted::Skip);
        }
        let annotations = meta.annotations.clone().unwrap_or_default();
        let ips = pod_ips(pod, &annotations)?;
        // A finished pod no longer owns its IP (it may already belong to another pod), so it
        // must not be an endpoint; Calico keeps it without IPs and Felix drops it.
        if ips.is_empty() || is_finished(pod, &annotations) {
            return Ok(Converted::Skip);
        }
        let sa = spec.service_account_name.as_deref().unwrap_or_default();
        let mut profiles = vec![format!("{NAMESPACE_PROFILE_PREFIX}{ns}")];
        if !sa.is_empty() {
            profiles.push(service_account_profile(ns, sa));
        }
        let mut labels: BTreeMap<String, String> = meta.labels.clone().unwrap_or_default();
        labels.insert(LABEL_NAMESPACE.into(), ns.into());
        labels.insert(LABEL_ORCHESTRATOR.into(), "k8s".into());
        if !sa.is_empty() && sa.len() < 63 {
            labels.insert(LABEL_SERVICE_ACCOUNT.into(), sa.into());
        }
        let mut ports = Vec::new();
        for c in spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
        {
            container_ports(c, &mut ports);
        }
        let ip_nats = floating_ips(&annotations, &ips)?;
        let spoof = source_prefixes(&annotations)?;
        let value = json!({
            "kind": "WorkloadEndpoint",
            "apiVersion": API_VERSION,
            "metadata": {
                "name": workload_endpoint_name(node, name),
                "namespace": ns,
                "generateName": meta.generate_name,
                "labels": labels,
            },
            "spec": {
                "orchestrator": "k8s",
                "node": node,
                "pod": name,
                "containerID": annotations.get(ANNOTATION_CONTAINER_ID).cloned().unwrap_or_default(),
                "endpoint": "eth0",
                "interfaceName": self.interface_name(ns, name),
                "serviceAccountName": sa,
                "profiles": profiles,
                "ipNetworks": ips,
                "ipNATs": ip_nats,
                "ports": ports,
                "allowSpoofedSourcePrefixes": spoof,
            },
        });
        Ok(Converted::Value(value, Vec::new()))
    }
}

/// A converted object before decoding: the v3 JSON and any warnings, or nothing to send.
enum Converted {
    Value(Value, Vec<String>),
    Skip,
}

/// The typed Kubernetes object (k8s-openapi's types ignore unknown fields, as the API does).
fn typed<T: serde::de::DeserializeOwned>(object: Value) -> Result<T, ConvertError> {
    serde_json::from_value(object).map_err(ConvertError::Undecodable)
}

/// `names.WorkloadEndpointIdentifiers{Node, Orchestrator: k8s, Pod, Endpoint: eth0}`'s name.
pub fn workload_endpoint_name(node: &str, pod: &str) -> String {
    let esc = |s: &str| s.replace('-', "--");
    format!("{}-k8s-{}-eth0", esc(node), esc(pod))
}

/// `ksa.<ns>.<sa>` (an empty namespace counts as `default`).
pub fn service_account_profile(ns: &str, sa: &str) -> String {
    let ns = if ns.is_empty() { "default" } else { ns };
    format!("{SERVICE_ACCOUNT_PROFILE_PREFIX}{ns}.{sa}")
}

/// A CIDR or bare IP as the network Calico stores (`10.0.0.5` → `10.0.0.5/32`).
fn ip_net(s: &str) -> Option<String> {
    parse_cidr_or_ip(s.trim()).map(|n| format!("{}/{}", n.ip(), n.prefix()))
}

/// Calico's `getPodIPs`: the first source that has any, each parsed as CIDR or IP.
fn pod_ips(pod: &Pod, annotations: &BTreeMap<String, String>) -> Result<Vec<String>, ConvertError> {
    let status = pod.status.as_ref();
    let from_status: Vec<String> = status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|ips| ips.iter().map(|i| i.ip.clone()).collect())
        .unwrap_or_default();
    let single = status.and_then(|s| s.pod_ip.clone()).unwrap_or_default();
    let split = |s: &String| s.split(',').map(str::to_string).collect::<Vec<_>>();
    let raw: Vec<String> = if !from_status.is_empty() {
        from_status
    } else if !single.is_empty() {
        vec![single]
    } else if let Some(ips) = annotations
        .get(ANNOTATION_POD_IPS)
        .filter(|s| !s.is_empty())
    {
        split(ips)
    } else if let Some(ip) = annotations.get(ANNOTATION_POD_IP).filter(|s| !s.is_empty()) {
        vec![ip.clone()]
    } else if let Some(ips) = annotations
        .get(ANNOTATION_AWS_POD_IPS)
        .filter(|s| !s.is_empty())
    {
        split(ips)
    } else {
        Vec::new()
    };
    raw.iter()
        .map(|ip| ip_net(ip).ok_or_else(|| ConvertError::PodIp(ip.clone())))
        .collect()
}

/// Calico's `IsFinished`.
fn is_finished(pod: &Pod, annotations: &BTreeMap<String, String>) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        // The CNI plugin blanks its annotation the moment the pod loses its IP.
        let released = |k: &str| annotations.get(k).is_some_and(|v| v.is_empty());
        if released(ANNOTATION_POD_IP) || released(ANNOTATION_AWS_POD_IPS) {
            return true;
        }
    }
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded" | "Completed")
    )
}

/// Calico's `appendEndpointPorts`: named or host ports with a known protocol.
fn container_ports(c: &Container, out: &mut Vec<Value>) {
    for p in c.ports.iter().flatten() {
        let name = p.name.as_deref().unwrap_or_default();
        let host_port = p.host_port.unwrap_or(0);
        if p.container_port == 0 || (host_port == 0 && name.is_empty()) {
            continue;
        }
        let proto = match p.protocol.as_deref().unwrap_or("") {
            "TCP" | "" => "TCP",
            "UDP" => "UDP",
            "SCTP" => "SCTP",
            _ => continue,
        };
        let mut port = json!({"name": name, "protocol": proto, "port": p.container_port});
        if host_port != 0 {
            port["hostPort"] = host_port.into();
        }
        if let Some(ip) = p.host_ip.as_deref().filter(|s| !s.is_empty()) {
            port["hostIP"] = ip.into();
        }
        out.push(port);
    }
}

/// `cni.projectcalico.org/floatingIPs`: JSON list of external IPs, each NATed to the pod's
/// address of the same family.
fn floating_ips(
    annotations: &BTreeMap<String, String>,
    ips: &[String],
) -> Result<Value, ConvertError> {
    let Some(raw) = annotations.get(ANNOTATION_FLOATING_IPS) else {
        return Ok(json!([]));
    };
    let external: Vec<String> =
        serde_json::from_str(raw).map_err(|error| ConvertError::NotAList {
            annotation: ANNOTATION_FLOATING_IPS,
            value: raw.clone(),
            error,
        })?;
    let addr = |v6: bool| {
        ips.iter()
            .find(|n| n.contains(':') == v6)
            .map(|n| n.split('/').next().unwrap_or_default().to_string())
    };
    let nats: Vec<Value> = external
        .iter()
        .filter_map(|ext| {
            addr(ext.contains(':')).map(|int| json!({"internalIP": int, "externalIP": ext}))
        })
        .collect();
    Ok(Value::Array(nats))
}

/// `cni.projectcalico.org/allowedSourcePrefixes`: JSON list of CIDRs, normalised.
fn source_prefixes(annotations: &BTreeMap<String, String>) -> Result<Vec<String>, ConvertError> {
    let Some(raw) = annotations
        .get(ANNOTATION_SOURCE_PREFIXES)
        .filter(|s| !s.is_empty())
    else {
        return Ok(Vec::new());
    };
    let list: Vec<String> = serde_json::from_str(raw).map_err(|error| ConvertError::NotAList {
        annotation: ANNOTATION_SOURCE_PREFIXES,
        value: raw.clone(),
        error,
    })?;
    list.iter()
        .map(|p| {
            masked_cidr(p).ok_or_else(|| ConvertError::NotACidr {
                annotation: ANNOTATION_SOURCE_PREFIXES,
                value: p.clone(),
            })
        })
        .collect()
}

/// Calico's `NamespaceToProfile` ([`kubernetes::namespace_profile`]).
fn namespace(ns: &Namespace) -> Result<Converted, ConvertError> {
    let name = ns.metadata.name.as_deref().unwrap_or_default();
    let labels = ns.metadata.labels.clone().unwrap_or_default();
    Ok(Converted::Value(
        kubernetes::namespace_profile(name, &labels),
        Vec::new(),
    ))
}

/// Calico's `ServiceAccountToProfile`.
fn service_account(sa: &ServiceAccount) -> Result<Converted, ConvertError> {
    let name = sa.metadata.name.as_deref().unwrap_or_default();
    let ns = sa.metadata.namespace.as_deref().unwrap_or_default();
    let mut labels: BTreeMap<String, String> = sa
        .metadata
        .labels
        .iter()
        .flatten()
        .map(|(k, v)| (format!("{SERVICE_ACCOUNT_LABEL_PREFIX}{k}"), v.clone()))
        .collect();
    labels.insert(
        format!("{SERVICE_ACCOUNT_LABEL_PREFIX}{NAME_LABEL}"),
        name.into(),
    );
    Ok(Converted::Value(
        json!({
            "kind": "Profile",
            "apiVersion": API_VERSION,
            "metadata": {"name": service_account_profile(ns, name)},
            "spec": {"labelsToApply": labels},
        }),
        Vec::new(),
    ))
}

/// Calico's `K8sNodeToCalico` (the parts Felix uses): labels (Calico's own, stored in an
/// annotation, under the Kubernetes ones), BGP addresses and AS number from Calico's
/// annotations (an invalid one is ignored, as Calico does), and the node's addresses.
fn node(n: &Node) -> Result<Converted, ConvertError> {
    let name = n.metadata.name.as_deref().unwrap_or_default();
    let annotations = n.metadata.annotations.clone().unwrap_or_default();
    let mut labels: BTreeMap<String, String> = annotations
        .get(NODE_LABELS_ANNOTATION)
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default();
    labels.extend(n.metadata.labels.clone().unwrap_or_default());
    let cidr_of = |key: &str, v6: bool| {
        annotations
            .get(key)
            .filter(|s| s.contains('/') && s.contains(':') == v6)
            .filter(|s| parse_cidr_or_ip(s).is_some())
            .cloned()
    };
    let mut bgp = Map::new();
    let mut addresses = Vec::new();
    if let Some(a) = cidr_of(NODE_IPV4_ANNOTATION, false) {
        bgp.insert("ipv4Address".into(), a.clone().into());
        addresses.push(json!({"address": a, "type": "CalicoNodeIP"}));
    }
    if let Some(a) = cidr_of(NODE_IPV6_ANNOTATION, true) {
        bgp.insert("ipv6Address".into(), a.clone().into());
        addresses.push(json!({"address": a, "type": "CalicoNodeIP"}));
    }
    if let Some(asn) = annotations
        .get(NODE_ASN_ANNOTATION)
        .and_then(|s| parse_as_number(s))
    {
        bgp.insert("asNumber".into(), asn.into());
    }
    for a in n
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
    {
        match a.type_.as_str() {
            "InternalIP" | "ExternalIP" => {
                addresses.push(json!({"address": a.address, "type": a.type_}))
            }
            _ => {}
        }
    }
    let mut spec = Map::new();
    if !bgp.is_empty() {
        spec.insert("bgp".into(), Value::Object(bgp));
    }
    spec.insert("addresses".into(), Value::Array(addresses));
    Ok(Converted::Value(
        json!({
            "kind": "Node",
            "apiVersion": API_VERSION,
            "metadata": {"name": name, "labels": labels},
            "spec": spec,
        }),
        Vec::new(),
    ))
}

/// An AS number: plain (`64512`) or dotted (`1.10` = 1·65536 + 10), as `numorstring` parses.
fn parse_as_number(s: &str) -> Option<u64> {
    match s.split_once('.') {
        Some((hi, lo)) => {
            let (hi, lo): (u16, u16) = (hi.parse().ok()?, lo.parse().ok()?);
            Some(u64::from(hi) << 16 | u64::from(lo))
        }
        None => s.parse::<u32>().ok().map(u64::from),
    }
}

/// Calico's `K8sNetworkPolicyToCalico`: a NetworkPolicy `knp.default.<name>` in the same
/// namespace ([`kubernetes::network_policy_object`], which manifests go through too).
fn k8s_network_policy(np: &K8sNetworkPolicy) -> Result<Converted, ConvertError> {
    let name = np.metadata.name.as_deref().unwrap_or_default();
    let ns = np.metadata.namespace.as_deref().unwrap_or("default");
    let (value, warnings) =
        kubernetes::network_policy_object(name, ns, &np.spec.clone().unwrap_or_default())
            .map_err(ConvertError::NetworkPolicy)?;
    Ok(Converted::Value(value, warnings))
}

/// An EndpointSlice as the graph reads it (see the module documentation).
fn endpoint_slice(s: &EndpointSlice) -> Converted {
    let meta = &s.metadata;
    let endpoints: Vec<Value> = s
        .endpoints
        .iter()
        .flatten()
        .map(|e| json!({"addresses": e.addresses}))
        .collect();
    let ports: Vec<Value> = s
        .ports
        .iter()
        .flatten()
        .map(|p| json!({"name": p.name, "protocol": p.protocol, "port": p.port}))
        .collect();
    Converted::Value(
        json!({
            "kind": "EndpointSlice",
            "apiVersion": ENDPOINT_SLICE_API_VERSION,
            "metadata": {
                "name": meta.name,
                "namespace": meta.namespace.as_deref().unwrap_or("default"),
                "labels": meta.labels.clone().unwrap_or_default(),
            },
            "addressType": s.address_type,
            "endpoints": endpoints,
            "ports": ports,
        }),
        Vec::new(),
    )
}

/// A Service as flow logs read it: where it is reached (cluster and external IPs, ports and
/// node ports); its selector, type and the rest are not needed.
fn service(s: &Service) -> Converted {
    let meta = &s.metadata;
    let spec = s.spec.clone().unwrap_or_default();
    let ports: Vec<Value> = spec
        .ports
        .iter()
        .flatten()
        .map(|p| json!({"name": p.name, "protocol": p.protocol, "port": p.port, "nodePort": p.node_port}))
        .collect();
    Converted::Value(
        json!({
            "kind": "Service",
            "apiVersion": SERVICE_API_VERSION,
            "metadata": {
                "name": meta.name,
                "namespace": meta.namespace.as_deref().unwrap_or("default"),
            },
            "spec": {
                "clusterIP": spec.cluster_ip,
                "clusterIPs": spec.cluster_ips,
                "externalIPs": spec.external_ips,
                "ports": ports,
            },
        }),
        Vec::new(),
    )
}

/// A network-policy-api object → the same object as the graph's decoder reads it (see the
/// module documentation).
fn network_policy_api(kind: Kind, object: Value) -> Result<Converted, ConvertError> {
    let mut obj = listed_object(kind, super::NETWORK_POLICY_API_GROUP, object)?;
    let name = obj
        .get("metadata")
        .and_then(|m| m.get("name"))
        .cloned()
        .unwrap_or_default();
    obj.insert("kind".into(), kind.as_str().into());
    obj.insert("apiVersion".into(), kind.api_version().into());
    obj.insert("metadata".into(), json!({"name": name}));
    obj.remove("status");
    Ok(Converted::Value(Value::Object(obj), Vec::new()))
}

/// An object listed as `kind` in `group`: a JSON object whose `kind`, when a list item carries
/// one, is that kind.
fn listed_object(
    kind: Kind,
    group: &'static str,
    object: Value,
) -> Result<Map<String, Value>, ConvertError> {
    let Value::Object(obj) = object else {
        return Err(ConvertError::NotAnObject);
    };
    match obj.get("kind") {
        None | Some(Value::Null) => Ok(obj),
        Some(Value::String(k)) if k == kind.as_str() => Ok(obj),
        Some(other) => Err(ConvertError::OtherKind {
            found: other.clone(),
            listed: kind,
            group,
        }),
    }
}

/// A Calico CRD object → the v3 object it stores (see the module documentation).
fn crd(kind: Kind, object: Value) -> Result<Converted, ConvertError> {
    let mut obj = listed_object(kind, super::CRD_GROUP, object)?;
    obj.insert("kind".into(), kind.as_str().into());
    obj.insert("apiVersion".into(), API_VERSION.into());
    obj.remove("status");
    let tier = obj
        .get("spec")
        .and_then(|s| s.get("tier"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let Some(Value::Object(meta)) = obj.remove("metadata") else {
        return Err(ConvertError::NoMetadata);
    };
    let cr_name = meta.get("name").and_then(Value::as_str).unwrap_or_default();
    let mut labels = string_map(meta.get("labels"));
    let mut annotations = string_map(meta.get("annotations"));
    let mut name = String::new();
    if let Some(raw) = annotations.remove(METADATA_ANNOTATION) {
        let stored: Value = serde_json::from_str(&raw).map_err(ConvertError::Metadata)?;
        labels.extend(string_map(stored.get("labels")));
        annotations.extend(string_map(stored.get("annotations")));
        name = stored
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
    }
    if name.is_empty() {
        name = cr_name.to_string();
        // The backend name of a default-tier policy written by older clients.
        if matches!(kind, Kind::NetworkPolicy | Kind::GlobalNetworkPolicy)
            && (tier.is_empty() || tier == "default")
            && let Some(stripped) = name.strip_prefix("default.").filter(|s| !s.is_empty())
        {
            name = stripped.to_string();
        }
    }
    let mut m = Map::new();
    m.insert("name".into(), name.into());
    if let Some(ns) = meta.get("namespace").and_then(Value::as_str) {
        m.insert("namespace".into(), ns.into());
    }
    m.insert("labels".into(), json!(labels));
    m.insert("annotations".into(), json!(annotations));
    obj.insert("metadata".into(), Value::Object(m));
    Ok(Converted::Value(Value::Object(obj), Vec::new()))
}

/// A JSON object of strings (anything else is ignored).
fn string_map(v: Option<&Value>) -> BTreeMap<String, String> {
    v.and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
