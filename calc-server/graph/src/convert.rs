//! Model conversion: v3 resources → the internal form the calculation graph works on.
//!
//! This is where Calico's syncer update processors live in Felix: namespaced policies are scoped
//! to their namespace, `namespaceSelector` and `serviceAccountSelector` become `pcns.`/`pcsa.`
//! prefixed label selectors, actions get their model spelling (`Pass` → `next-tier`), CIDRs are
//! masked, and workload endpoints get their Felix key (`<orch>/<namespace>/<workload>/<endpoint>`
//! from the resource name). Selector strings are built exactly as Calico builds them, so the
//! canonical forms, and therefore every IP-set id, match Felix's.
//!
//! Contract: input is a validated resource; anything that still cannot be converted comes back
//! as a [`ConvertError`], never a panic.

use std::collections::BTreeMap;

use ipnetwork::IpNetwork;

use crate::model::rule::{Action, EntityRule, Port, Protocol, Rule};
use crate::model::validate::parse_cidr_or_ip;
use crate::model::{
    HostEndpointSpec, Kind, ObjectMeta, PolicySpec, ResourceKey, WorkloadEndpointSpec,
};
use crate::selector::{self, Selector};

pub use crate::model::{LABEL_NAMESPACE, LABEL_ORCHESTRATOR};
pub const LABEL_SERVICE_ACCOUNT: &str = "projectcalico.org/serviceaccount";
pub const NAMESPACE_LABEL_PREFIX: &str = "pcns.";
pub const SERVICE_ACCOUNT_LABEL_PREFIX: &str = "pcsa.";

/// Felix's policy id: name, namespace (empty for global kinds) and the v3 kind.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyId {
    pub name: String,
    pub namespace: String,
    pub kind: String,
}

impl PolicyId {
    /// The id Calico's syncer gives the policy stored under `key`: a staged Kubernetes policy
    /// is named as the enforced one it stages (`knp.default.<name>`); a ClusterNetworkPolicy
    /// keeps its name under the kind `KubernetesClusterNetworkPolicy`; an AdminNetworkPolicy
    /// or BaselineAdminNetworkPolicy is the GlobalNetworkPolicy `kanp.adminnetworkpolicy.<name>`
    /// / `kbanp.baselineadminnetworkpolicy.<name>` Calico converted it to.
    pub fn from_key(key: &ResourceKey) -> PolicyId {
        use crate::model::network_policy_api as npa;
        let (name, kind) = match key.kind {
            Kind::StagedKubernetesNetworkPolicy => (
                format!(
                    "{}{}",
                    crate::model::kubernetes::K8S_POLICY_PREFIX,
                    key.name
                ),
                key.kind.as_str(),
            ),
            Kind::ClusterNetworkPolicy => (key.name.clone(), npa::CNP_POLICY_KIND),
            Kind::AdminNetworkPolicy | Kind::BaselineAdminNetworkPolicy => (
                npa::policy_name(key.kind, &key.name),
                Kind::GlobalNetworkPolicy.as_str(),
            ),
            _ => (key.name.clone(), key.kind.as_str()),
        };
        PolicyId {
            name,
            namespace: key.namespace.clone().unwrap_or_default(),
            kind: kind.to_string(),
        }
    }

    /// The key of the resource this id was made from ([`PolicyId::from_key`] read backwards);
    /// `None` for a kind no resource has.
    pub fn to_key(&self) -> Option<ResourceKey> {
        use crate::model::network_policy_api as npa;
        let ns = (!self.namespace.is_empty()).then_some(self.namespace.as_str());
        let (kind, name) = match self.kind.as_str() {
            npa::CNP_POLICY_KIND => (Kind::ClusterNetworkPolicy, self.name.as_str()),
            // A GlobalNetworkPolicy's own name has at most one '.', so these prefixes are
            // never a GlobalNetworkPolicy's.
            "GlobalNetworkPolicy" if self.name.starts_with(npa::ANP_NAME_PREFIX) => (
                Kind::AdminNetworkPolicy,
                &self.name[npa::ANP_NAME_PREFIX.len()..],
            ),
            "GlobalNetworkPolicy" if self.name.starts_with(npa::BANP_NAME_PREFIX) => (
                Kind::BaselineAdminNetworkPolicy,
                &self.name[npa::BANP_NAME_PREFIX.len()..],
            ),
            "StagedKubernetesNetworkPolicy" => (
                Kind::StagedKubernetesNetworkPolicy,
                self.name
                    .strip_prefix(crate::model::kubernetes::K8S_POLICY_PREFIX)
                    .unwrap_or(&self.name),
            ),
            other => (Kind::from_name(other)?, self.name.as_str()),
        };
        Some(ResourceKey::new(kind, ns, name))
    }

    /// Calico's tie-break string for policies of equal order: `<name>/<namespace>/<kind>`.
    pub fn sort_string(&self) -> String {
        format!("{}/{}/{}", self.name, self.namespace, self.kind)
    }
}

/// HTTP match of a rule: methods, and paths as (exact, prefix).
pub type HttpMatch = (Vec<String>, Vec<(Option<String>, Option<String>)>);

/// A rule after model conversion: selectors scoped and combined, nets masked, still holding
/// selector strings (the rule scanner turns those into IP sets).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelRule {
    /// `allow`, `deny`, `next-tier` or `log`.
    pub action: String,
    pub ip_version: Option<i64>,
    pub protocol: Option<Protocol>,
    pub not_protocol: Option<Protocol>,
    pub icmp_type: Option<i64>,
    pub icmp_code: Option<i64>,
    pub not_icmp_type: Option<i64>,
    pub not_icmp_code: Option<i64>,
    pub src_nets: Vec<String>,
    pub dst_nets: Vec<String>,
    pub not_src_nets: Vec<String>,
    pub not_dst_nets: Vec<String>,
    pub src_ports: Vec<Port>,
    pub dst_ports: Vec<Port>,
    pub not_src_ports: Vec<Port>,
    pub not_dst_ports: Vec<Port>,
    pub src_selector: String,
    pub dst_selector: String,
    pub not_src_selector: String,
    pub not_dst_selector: String,
    pub original_src_selector: String,
    pub original_dst_selector: String,
    pub original_src_namespace_selector: String,
    pub original_dst_namespace_selector: String,
    pub original_not_src_selector: String,
    pub original_not_dst_selector: String,
    pub src_service_accounts: Option<(Vec<String>, String)>,
    pub dst_service_accounts: Option<(Vec<String>, String)>,
    pub src_service: Option<(String, String)>,
    pub dst_service: Option<(String, String)>,
    pub http: Option<HttpMatch>,
    pub annotations: BTreeMap<String, String>,
}

/// A policy after model conversion.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyModel {
    pub id: PolicyId,
    pub tier: String,
    pub order: Option<f64>,
    /// The scoped selector the policy applies to.
    pub selector: Selector,
    pub inbound: Vec<ModelRule>,
    pub outbound: Vec<ModelRule>,
    pub ingress: bool,
    pub egress: bool,
    pub untracked: bool,
    pub pre_dnat: bool,
    pub apply_on_forward: bool,
    /// The namespace of a NetworkPolicy; empty for global kinds.
    pub namespace: String,
    pub performance_hints: Vec<String>,
}

impl PolicyModel {
    pub fn assume_needed_on_every_node(&self) -> bool {
        self.performance_hints
            .iter()
            .any(|h| h == "AssumeNeededOnEveryNode")
    }
}

/// A selector the graph built or was given that does not parse (shown with the selector, then
/// the parser's reason).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("selector {selector:?}: {0}", selector = .0.input)]
pub struct BadSelector(pub selector::ParseError);

/// Why a validated resource still cannot be converted. Validation refuses each of these first;
/// one that gets through is refused by the graph, which keeps the last good version.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Selector(#[from] BadSelector),
    #[error("invalid action {0:?}")]
    Action(String),
    /// A WorkloadEndpoint name that is not four dash-separated parts.
    #[error(
        "name {0:?} is not of the form <node>-<orchestrator>-<workload>-<endpoint> (with '-' inside a part written '--')"
    )]
    EndpointName(String),
    /// A WorkloadEndpoint whose `spec.node` is not the node its name holds.
    #[error("spec.node {spec:?} does not match the node {in_name:?} in the endpoint's name")]
    EndpointNode { spec: String, in_name: String },
}

pub(crate) fn parse(sel: &str) -> Result<Selector, BadSelector> {
    selector::parse(sel).map_err(BadSelector)
}

/// Parses `s` and prefixes every label with `prefix`, returning the canonical string
/// (Calico's `parseSelectorAttachPrefix`).
pub(crate) fn attach_prefix(s: &str, prefix: &str) -> Result<String, BadSelector> {
    Ok(parse(s)?.with_label_prefix(prefix).canonical().to_string())
}

/// Calico's `prefixAndAppendSelector`.
fn prefix_and_append(current: String, new: &str, prefix: &str) -> Result<String, BadSelector> {
    if new.is_empty() {
        return Ok(current);
    }
    let prefixed = attach_prefix(new, prefix)?;
    Ok(if current.is_empty() {
        prefixed
    } else {
        format!("({current}) && {prefixed}")
    })
}

/// Converts a NetworkPolicy (`namespace` set) or GlobalNetworkPolicy (`namespace` `None`).
pub fn convert_policy(
    key: &ResourceKey,
    spec: &PolicySpec,
    namespace: Option<&str>,
) -> Result<PolicyModel, ConvertError> {
    let mut sel = spec.selector.clone();
    let rule_ns = namespace.unwrap_or("");
    match namespace {
        Some(ns) => {
            let ns_sel = format!("{LABEL_NAMESPACE} == '{ns}'");
            sel = if sel.is_empty() {
                ns_sel
            } else {
                format!("({sel}) && {ns_sel}")
            };
            sel = prefix_and_append(
                sel,
                &spec.service_account_selector,
                SERVICE_ACCOUNT_LABEL_PREFIX,
            )?;
        }
        None => {
            if !spec.namespace_selector.is_empty() {
                sel = prefix_and_append(sel, &spec.namespace_selector, NAMESPACE_LABEL_PREFIX)?;
                sel = sel.replace("all()", &format!("has({LABEL_NAMESPACE})"));
            }
            if !spec.service_account_selector.is_empty() {
                sel = prefix_and_append(
                    sel,
                    &spec.service_account_selector,
                    SERVICE_ACCOUNT_LABEL_PREFIX,
                )?;
                sel = sel.replace("all()", &format!("has({LABEL_SERVICE_ACCOUNT})"));
            }
        }
    }
    let selector = parse(&sel)?;
    let convert_rules = |rules: &[Rule]| convert_rules(rules, rule_ns);
    // Types are defaulted at decode time; an empty list (raw data) means both, as in Felix.
    let (ingress, egress) = if spec.types.is_empty() {
        (true, true)
    } else {
        (spec.applies_to_ingress(), spec.applies_to_egress())
    };
    Ok(PolicyModel {
        id: PolicyId::from_key(key),
        tier: if spec.tier.is_empty() {
            "default".into()
        } else {
            spec.tier.clone()
        },
        order: spec.order,
        selector,
        inbound: convert_rules(&spec.ingress)?,
        outbound: convert_rules(&spec.egress)?,
        ingress,
        egress,
        untracked: namespace.is_none() && spec.do_not_track,
        pre_dnat: namespace.is_none() && spec.pre_dnat,
        // Calico sets applyOnForward for every namespaced policy.
        apply_on_forward: namespace.is_some() || spec.apply_on_forward,
        namespace: rule_ns.to_string(),
        performance_hints: spec.performance_hints.clone(),
    })
}

/// Converts profile rules (never namespaced).
pub fn convert_profile_rules(rules: &[Rule]) -> Result<Vec<ModelRule>, ConvertError> {
    convert_rules(rules, "")
}

/// The rules converted, in a vector of exactly their number: the model keeps them for the
/// policy's life, and collecting through `Result` would reserve four (a `ModelRule` is 848
/// bytes, so a one-rule policy held 3.4 KB).
fn convert_rules(rules: &[Rule], namespace: &str) -> Result<Vec<ModelRule>, ConvertError> {
    let mut out = Vec::with_capacity(rules.len());
    for r in rules {
        out.push(convert_rule(r, namespace)?);
    }
    Ok(out)
}

/// Calico's `parseServiceAccounts`.
fn service_account_selector(names: &[String], sel: &str) -> Result<String, BadSelector> {
    let prefixed = if sel.is_empty() {
        String::new()
    } else {
        attach_prefix(sel, SERVICE_ACCOUNT_LABEL_PREFIX)?
    };
    if names.is_empty() {
        return Ok(prefixed);
    }
    let set = format!("{LABEL_SERVICE_ACCOUNT} in {{ '{}' }}", names.join("', '"));
    let set = parse(&set)?.canonical().to_string();
    Ok(if prefixed.is_empty() {
        set
    } else {
        format!("({prefixed}) && ({set})")
    })
}

/// Calico's `getEndpointSelector`: one selector for everything an EntityRule selects.
fn entity_selector(er: &EntityRule, ns: &str) -> Result<String, BadSelector> {
    let sa = match &er.service_accounts {
        Some(m) => service_account_selector(&m.names, &m.selector)?,
        None => String::new(),
    };
    let ns_sel = if !er.namespace_selector.is_empty() {
        attach_prefix(&er.namespace_selector, NAMESPACE_LABEL_PREFIX)?
            .replace("all()", &format!("has({LABEL_NAMESPACE})"))
            .replace("global()", &format!("!has({LABEL_NAMESPACE})"))
    } else if !ns.is_empty() {
        format!("{LABEL_NAMESPACE} == '{ns}'")
    } else {
        String::new()
    };
    let parts: Vec<&str> = [sa.as_str(), er.selector.as_str()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    let mut sel = match parts.len() {
        0 => String::new(),
        1 => parts[0].to_string(),
        _ => format!("({})", parts.join(") && (")),
    };
    if !ns_sel.is_empty()
        && (!sel.is_empty() || !er.not_selector.is_empty() || !er.namespace_selector.is_empty())
    {
        sel = if sel.is_empty() {
            ns_sel
        } else {
            format!("({ns_sel}) && ({sel})")
        };
    }
    Ok(sel)
}

/// Masks each CIDR to its network; unparseable entries are skipped, as Calico does.
fn mask_nets(nets: &[String]) -> Vec<String> {
    nets.iter()
        .filter_map(|n| parse_cidr_or_ip(n))
        .filter_map(|n| IpNetwork::new(n.network(), n.prefix()).ok())
        .map(|n| n.to_string())
        .collect()
}

fn v1_protocol(p: &Option<Protocol>) -> Option<Protocol> {
    p.as_ref().map(|p| match p {
        Protocol::Name(s) => Protocol::Name(s.to_ascii_lowercase()),
        n => n.clone(),
    })
}

fn convert_rule(r: &Rule, ns: &str) -> Result<ModelRule, ConvertError> {
    let action = Action::parse(&r.action)
        .ok_or_else(|| ConvertError::Action(r.action.clone()))?
        .proto_name()
        .to_string();
    let sa = |er: &EntityRule| {
        er.service_accounts
            .as_ref()
            .map(|m| (m.names.clone(), m.selector.clone()))
    };
    // A service named in a namespaced policy without a namespace is in the policy's.
    let svc = |er: &EntityRule| {
        er.services.as_ref().map(|s| {
            let ns = if s.namespace.is_empty() {
                ns.to_string()
            } else {
                s.namespace.clone()
            };
            (s.name.clone(), ns)
        })
    };
    Ok(ModelRule {
        action,
        ip_version: r.ip_version,
        protocol: v1_protocol(&r.protocol),
        not_protocol: v1_protocol(&r.not_protocol),
        icmp_type: r.icmp.as_ref().and_then(|i| i.icmp_type),
        icmp_code: r.icmp.as_ref().and_then(|i| i.code),
        not_icmp_type: r.not_icmp.as_ref().and_then(|i| i.icmp_type),
        not_icmp_code: r.not_icmp.as_ref().and_then(|i| i.code),
        src_nets: mask_nets(&r.source.nets),
        dst_nets: mask_nets(&r.destination.nets),
        not_src_nets: mask_nets(&r.source.not_nets),
        not_dst_nets: mask_nets(&r.destination.not_nets),
        src_ports: r.source.ports.clone(),
        dst_ports: r.destination.ports.clone(),
        not_src_ports: r.source.not_ports.clone(),
        not_dst_ports: r.destination.not_ports.clone(),
        src_selector: entity_selector(&r.source, ns)?,
        dst_selector: entity_selector(&r.destination, ns)?,
        not_src_selector: r.source.not_selector.clone(),
        not_dst_selector: r.destination.not_selector.clone(),
        original_src_selector: r.source.selector.clone(),
        original_dst_selector: r.destination.selector.clone(),
        original_src_namespace_selector: r.source.namespace_selector.clone(),
        original_dst_namespace_selector: r.destination.namespace_selector.clone(),
        original_not_src_selector: r.source.not_selector.clone(),
        original_not_dst_selector: r.destination.not_selector.clone(),
        src_service_accounts: sa(&r.source),
        dst_service_accounts: sa(&r.destination),
        src_service: svc(&r.source),
        dst_service: svc(&r.destination),
        http: r.http.as_ref().map(|h| {
            (
                h.methods.clone(),
                h.paths
                    .iter()
                    .map(|p| (p.exact.clone(), p.prefix.clone()))
                    .collect(),
            )
        }),
        annotations: r
            .metadata
            .as_ref()
            .map(|m| m.annotations.clone())
            .unwrap_or_default(),
    })
}

/// A named port on an endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamedPort {
    pub name: String,
    /// `tcp`, `udp` or `sctp`: a constant, not a string per port of every endpoint.
    pub protocol: &'static str,
    pub port: u16,
}

/// What the graph needs of a workload or host endpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointModel {
    pub node: String,
    /// Own labels, after Calico's filtering (no `pcns.`/`pcsa.` labels, service account added).
    pub labels: BTreeMap<String, String>,
    pub profile_ids: Vec<String>,
    pub ipv4_nets: Vec<String>,
    pub ipv6_nets: Vec<String>,
    pub ports: Vec<NamedPort>,
    pub kind: EndpointKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum EndpointKind {
    Workload {
        orchestrator_id: String,
        workload_id: String,
        /// The pod's `generateName` when it is a valid name prefix, else empty (flow logs
        /// aggregate a workload under it; it reaches no dataplane).
        generate_name: String,
        endpoint_id: String,
        interface_name: String,
        mac: String,
        ipv4_nat: Vec<(String, String)>,
        ipv6_nat: Vec<(String, String)>,
        allow_spoofed_source_prefixes: Vec<String>,
    },
    Host {
        endpoint_id: String,
        interface_name: String,
        expected_ipv4: Vec<String>,
        expected_ipv6: Vec<String>,
    },
}

/// Calico's `ExtractDashSeparatedParms`: splits a name on single dashes, where `--` stands for
/// a literal dash inside a segment. Returns `None` unless there are exactly `n` segments.
pub fn split_dashed_name(name: &str, n: usize) -> Option<Vec<String>> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '-' {
            if chars.peek() == Some(&'-') {
                chars.next();
                cur.push('-');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    (parts.len() == n && parts.iter().all(|p| !p.is_empty())).then_some(parts)
}

fn named_ports(ports: &[crate::model::EndpointPort]) -> Vec<NamedPort> {
    let mut out: Vec<NamedPort> = ports
        .iter()
        .filter(|p| !p.name.is_empty())
        .filter_map(|p| {
            // Numeric protocols match as Felix's named-port index does (6, 17, 132).
            let proto = match p.protocol.as_ref()?.number()? {
                6 => "tcp",
                17 => "udp",
                132 => "sctp",
                _ => return None,
            };
            Some(NamedPort {
                name: p.name.clone(),
                protocol: proto,
                port: u16::try_from(p.port).ok()?,
            })
        })
        .collect();
    // Kept for the endpoint's life (a filtered collect reserves four).
    out.shrink_to_fit();
    out
}

/// Whether `s` can be the start of a Kubernetes object name: 1–253 characters of lower-case
/// letters, digits, `-` and `.` (a `generateName`, whose tail may be a `-`).
fn is_name_prefix(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

fn split_nets(nets: &[String]) -> (Vec<String>, Vec<String>) {
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    for n in mask_nets(nets) {
        if n.contains(':') {
            v6.push(n);
        } else {
            v4.push(n);
        }
    }
    // Kept for the endpoint's life: a pushed vector reserves four, most endpoints have one.
    v4.shrink_to_fit();
    v6.shrink_to_fit();
    (v4, v6)
}

/// The ids an endpoint is sent under, which follow from its key alone: a workload endpoint's
/// from its name (`<node>-<orchestrator>-<workload>-<endpoint>`, dashes inside a part doubled)
/// and namespace, a host endpoint's from its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointIds {
    Workload {
        node: String,
        orchestrator_id: String,
        /// `<namespace>/<workload>`.
        workload_id: String,
        endpoint_id: String,
    },
    Host {
        endpoint_id: String,
    },
}

/// The ids of the endpoint of `key` ([`EndpointIds`]); `None` for another kind, or a workload
/// endpoint name that does not split into four parts (such an endpoint is refused).
pub fn endpoint_ids(key: &ResourceKey) -> Option<EndpointIds> {
    match key.kind {
        Kind::WorkloadEndpoint => workload_ids(key.namespace.as_deref(), &key.name),
        Kind::HostEndpoint => Some(EndpointIds::Host {
            endpoint_id: key.name.clone(),
        }),
        _ => None,
    }
}

fn workload_ids(namespace: Option<&str>, name: &str) -> Option<EndpointIds> {
    let mut parts = split_dashed_name(name, 4)?.into_iter();
    let mut next = || parts.next();
    let (node, orchestrator_id, workload, endpoint_id) = (next()?, next()?, next()?, next()?);
    Some(EndpointIds::Workload {
        node,
        orchestrator_id,
        workload_id: format!("{}/{workload}", namespace.unwrap_or("default")),
        endpoint_id,
    })
}

/// Converts a WorkloadEndpoint. `Ok(None)` when Calico filters it out (no IP networks yet).
pub fn convert_workload_endpoint(
    meta: &ObjectMeta,
    spec: &WorkloadEndpointSpec,
) -> Result<Option<EndpointModel>, ConvertError> {
    let Some(EndpointIds::Workload {
        node,
        orchestrator_id,
        workload_id,
        endpoint_id,
    }) = workload_ids(meta.namespace.as_deref(), &meta.name)
    else {
        return Err(ConvertError::EndpointName(meta.name.clone()));
    };
    // Felix keys the endpoint by the node in its name; a spec that disagrees is a mistake.
    if !spec.node.is_empty() && spec.node != node {
        return Err(ConvertError::EndpointNode {
            spec: spec.node.clone(),
            in_name: node,
        });
    }
    if spec.ip_networks.is_empty() {
        return Ok(None);
    }
    let mut labels: BTreeMap<String, String> = meta
        .labels
        .iter()
        .filter(|(k, _)| {
            !k.starts_with(NAMESPACE_LABEL_PREFIX) && !k.starts_with(SERVICE_ACCOUNT_LABEL_PREFIX)
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !spec.service_account_name.is_empty() {
        labels.insert(
            LABEL_SERVICE_ACCOUNT.into(),
            spec.service_account_name.clone(),
        );
    }
    let (ipv4_nets, ipv6_nets) = split_nets(&spec.ip_networks);
    let (mut ipv4_nat, mut ipv6_nat) = (Vec::new(), Vec::new());
    for nat in &spec.ip_nats {
        let pair = (nat.external_ip.clone(), nat.internal_ip.clone());
        if nat.internal_ip.contains(':') {
            ipv6_nat.push(pair);
        } else {
            ipv4_nat.push(pair);
        }
    }
    Ok(Some(EndpointModel {
        node,
        labels,
        profile_ids: spec.profiles.clone(),
        ipv4_nets,
        ipv6_nets,
        ports: named_ports(&spec.ports),
        kind: EndpointKind::Workload {
            orchestrator_id,
            workload_id,
            generate_name: meta
                .generate_name
                .as_deref()
                .filter(|g| is_name_prefix(g))
                .unwrap_or_default()
                .to_string(),
            endpoint_id,
            interface_name: spec.interface_name.clone(),
            mac: spec.mac.clone(),
            ipv4_nat,
            ipv6_nat,
            allow_spoofed_source_prefixes: mask_nets(&spec.allow_spoofed_source_prefixes),
        },
    }))
}

/// Converts a HostEndpoint.
pub fn convert_host_endpoint(meta: &ObjectMeta, spec: &HostEndpointSpec) -> EndpointModel {
    // Canonical text ("FD00::1" → "fd00::1") so a host and a workload with one address make
    // one IP-set member.
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    for ip in spec
        .expected_ips
        .iter()
        .filter_map(|ip| ip.parse::<std::net::IpAddr>().ok())
    {
        if ip.is_ipv6() {
            v6.push(ip.to_string());
        } else {
            v4.push(ip.to_string());
        }
    }
    let as_nets = |ips: &[String], bits: u8| -> Vec<String> {
        ips.iter().map(|ip| format!("{ip}/{bits}")).collect()
    };
    EndpointModel {
        node: spec.node.clone(),
        labels: meta.labels.clone(),
        profile_ids: spec.profiles.clone(),
        ipv4_nets: as_nets(&v4, 32),
        ipv6_nets: as_nets(&v6, 128),
        ports: named_ports(&spec.ports),
        kind: EndpointKind::Host {
            endpoint_id: meta.name.clone(),
            interface_name: spec.interface_name.clone(),
            expected_ipv4: v4,
            expected_ipv6: v6,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Kind;
    use crate::model::rule::{EntityRule, ServiceAccountMatch};

    fn rule_src(er: EntityRule) -> Rule {
        Rule {
            action: "Allow".into(),
            source: er,
            ..Default::default()
        }
    }

    #[test]
    fn namespaced_policy_selector_is_scoped() {
        let key = ResourceKey::new(Kind::NetworkPolicy, Some("prod"), "p");
        let spec = PolicySpec {
            selector: "app == 'web'".into(),
            service_account_selector: "role == 'x'".into(),
            types: vec!["Ingress".into()],
            ..Default::default()
        };
        let m = convert_policy(&key, &spec, Some("prod")).unwrap();
        assert_eq!(
            m.selector.canonical(),
            "((app == \"web\" && projectcalico.org/namespace == \"prod\") && pcsa.role == \"x\")"
        );
        assert!(m.apply_on_forward && m.ingress && !m.egress);
        let empty = PolicySpec::default();
        let m = convert_policy(&key, &empty, Some("prod")).unwrap();
        assert_eq!(
            m.selector.canonical(),
            "projectcalico.org/namespace == \"prod\""
        );
    }

    #[test]
    fn gnp_namespace_selector_rewrites_all() {
        let key = ResourceKey::new(Kind::GlobalNetworkPolicy, None, "g");
        let spec = PolicySpec {
            namespace_selector: "all()".into(),
            ..Default::default()
        };
        let m = convert_policy(&key, &spec, None).unwrap();
        assert_eq!(m.selector.canonical(), "has(projectcalico.org/namespace)");
        let spec = PolicySpec {
            selector: "app == 'a'".into(),
            namespace_selector: "team == 't'".into(),
            ..Default::default()
        };
        let m = convert_policy(&key, &spec, None).unwrap();
        assert_eq!(
            m.selector.canonical(),
            "(app == \"a\" && pcns.team == \"t\")"
        );
    }

    #[test]
    fn entity_rules_scope_like_calico() {
        // Namespaced policy, plain selector: ANDed with the namespace.
        let r = convert_rule(
            &rule_src(EntityRule {
                selector: "app == 'a'".into(),
                ..Default::default()
            }),
            "ns1",
        )
        .unwrap();
        assert_eq!(
            r.src_selector,
            "(projectcalico.org/namespace == 'ns1') && (app == 'a')"
        );
        // Only a notSelector: the namespace term alone, notSelector passed through.
        let r = convert_rule(
            &rule_src(EntityRule {
                not_selector: "app == 'a'".into(),
                ..Default::default()
            }),
            "ns1",
        )
        .unwrap();
        assert_eq!(r.src_selector, "projectcalico.org/namespace == 'ns1'");
        assert_eq!(r.not_src_selector, "app == 'a'");
        // Nothing selected: no selector at all (nets-only rules match anything).
        let r = convert_rule(&rule_src(EntityRule::default()), "ns1").unwrap();
        assert_eq!(r.src_selector, "");
        // namespaceSelector global() in a global policy.
        let r = convert_rule(
            &rule_src(EntityRule {
                namespace_selector: "global()".into(),
                ..Default::default()
            }),
            "",
        )
        .unwrap();
        assert_eq!(r.src_selector, "!has(projectcalico.org/namespace)");
        // Service accounts: names and selector, plus an endpoint selector.
        let r = convert_rule(
            &rule_src(EntityRule {
                selector: "app == 'a'".into(),
                service_accounts: Some(ServiceAccountMatch {
                    names: vec!["b".into(), "a".into()],
                    selector: "role == 'r'".into(),
                }),
                ..Default::default()
            }),
            "ns1",
        )
        .unwrap();
        assert_eq!(
            r.src_selector,
            "(projectcalico.org/namespace == 'ns1') && (((pcsa.role == \"r\") && (projectcalico.org/serviceaccount in {\"a\", \"b\"})) && (app == 'a'))"
        );
        assert_eq!(r.action, "allow");
    }

    #[test]
    fn workload_keys_come_from_the_name() {
        assert_eq!(
            split_dashed_name("node--1-k8s-web--1-eth0", 4).unwrap(),
            vec!["node-1", "k8s", "web-1", "eth0"]
        );
        assert!(split_dashed_name("a-b-c", 4).is_none());
        let meta = ObjectMeta {
            name: "node--1-k8s-web--1-eth0".into(),
            namespace: Some("shop".into()),
            generate_name: Some("web-5d9f8-".into()),
            labels: [("app", "web"), ("pcns.x", "y"), ("pcsa.z", "w")]
                .into_iter()
                .map(|(a, b)| (a.into(), b.into()))
                .collect(),
            ..Default::default()
        };
        let spec = WorkloadEndpointSpec {
            node: "node-1".into(),
            ip_networks: vec!["10.0.0.5".into(), "fd00::5/128".into()],
            service_account_name: "sa".into(),
            ..Default::default()
        };
        let ep = convert_workload_endpoint(&meta, &spec).unwrap().unwrap();
        assert_eq!(ep.ipv4_nets, vec!["10.0.0.5/32"]);
        assert_eq!(ep.ipv6_nets, vec!["fd00::5/128"]);
        assert_eq!(
            ep.labels.len(),
            2,
            "pcns./pcsa. stripped, service account added"
        );
        assert_eq!(ep.labels[LABEL_SERVICE_ACCOUNT], "sa");
        match ep.kind {
            EndpointKind::Workload {
                workload_id,
                orchestrator_id,
                endpoint_id,
                generate_name,
                ..
            } => {
                assert_eq!(generate_name, "web-5d9f8-");
                assert_eq!(
                    (
                        orchestrator_id.as_str(),
                        workload_id.as_str(),
                        endpoint_id.as_str()
                    ),
                    ("k8s", "shop/web-1", "eth0")
                );
            }
            _ => panic!(),
        }
        // A generateName that is no name prefix is dropped, the endpoint kept.
        let odd = ObjectMeta {
            generate_name: Some("Web_\u{1b}[2J-".into()),
            ..meta.clone()
        };
        let ep = convert_workload_endpoint(&odd, &spec).unwrap().unwrap();
        assert!(
            matches!(&ep.kind, EndpointKind::Workload { generate_name, .. } if generate_name.is_empty())
        );
        let no_ips = WorkloadEndpointSpec {
            node: "node-1".into(),
            ..Default::default()
        };
        assert_eq!(convert_workload_endpoint(&meta, &no_ips).unwrap(), None);
        let other_node = WorkloadEndpointSpec {
            node: "node-2".into(),
            ip_networks: vec!["10.0.0.1".into()],
            ..Default::default()
        };
        let err = convert_workload_endpoint(&meta, &other_node).unwrap_err();
        assert_eq!(
            err.to_string(),
            "spec.node \"node-2\" does not match the node \"node-1\" in the endpoint's name"
        );
        let no_ips = WorkloadEndpointSpec::default();
        assert_eq!(convert_workload_endpoint(&meta, &no_ips).unwrap(), None);
    }
}
