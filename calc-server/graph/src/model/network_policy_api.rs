//! The Kubernetes network-policy-api kinds (`policy.networking.k8s.io`) as Calico converts them
//! (`libcalico-go/lib/backend/k8s/conversion`): each becomes a Calico global policy spec in a
//! tier of its own, read by the ordinary decoder and validator. Pure.
//!
//! - `ClusterNetworkPolicy` (`v1alpha2`, Calico 3.32+): tier `kube-admin` (`spec.tier: Admin`)
//!   or `kube-baseline` (`Baseline`), order = `spec.priority`, Felix policy kind
//!   `KubernetesClusterNetworkPolicy`, name = the object's name. Actions `Accept` → Allow,
//!   `Deny`, `Pass`; match fields under `protocols` (`tcp`/`udp`/`sctp` with a destination
//!   port number or range).
//! - `AdminNetworkPolicy` (`v1alpha1`, as Calico 3.29–3.31 read it): tier `adminnetworkpolicy`,
//!   order = `spec.priority`, a GlobalNetworkPolicy named `kanp.adminnetworkpolicy.<name>`;
//!   actions `Allow`, `Deny`, `Pass`; ports under `ports` (`portNumber` / `portRange` with a
//!   protocol, TCP by default). `BaselineAdminNetworkPolicy`: tier
//!   `baselineadminnetworkpolicy`, order 1000, `kbanp.baselineadminnetworkpolicy.<name>`,
//!   actions `Allow` and `Deny`.
//!
//! Shared by all three: the subject becomes a namespace selector plus a pod selector (a
//! namespaces-only subject selects `projectcalico.org/orchestrator == 'k8s'`, so host endpoints
//! are never subjects); peers `namespaces`, `pods` and (egress) `networks`; one Calico rule per
//! (protocol, peer), protocols in sorted order, ports merged as Calico's `SimplifyPorts` does;
//! a rule's `name` kept as the rule annotation `name`. A rule that cannot be converted (a
//! `nodes` or `domainNames` peer, a named port, an unknown action, a bad CIDR or port) fails
//! closed, as the API asks: a `Deny` or `Pass` rule becomes a bare Deny rule, an allowing rule
//! is dropped, and either way a warning names the rule.
//!
//! Two deliberate differences from Calico, both failing closed where Calico failed open: an
//! AdminNetworkPolicy `namedPort` (Calico 3.29–3.31 matched every port) and a match entry that
//! sets none of the fields we know (a newer API's field; Calico matched all traffic) make the
//! rule unconvertible.
//!
//! What the API server's CRD schema would refuse (a missing or unknown tier, a priority outside
//! 0–1000, a subject that is not exactly one of `namespaces`/`pods`, more rules, peers or ports
//! than the API allows) makes the object invalid: those errors travel in
//! [`PolicySpec::conversion_errors`](super::PolicySpec::conversion_errors) and validation reports
//! them with their field paths. Unknown fields are ignored here (a peer with only an unknown
//! field fails closed); the strict manifest check (`model::fields`) names them.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::kubernetes::{
    LabelSyntaxError, RulePort, SelectorType, k8s_selector, masked_cidr, simplify_ports,
};
use super::validate::FieldError;
use super::{Kind, LABEL_ORCHESTRATOR, PolicySpec, decode_at};

/// The API group of the network-policy-api kinds.
pub const GROUP: &str = "policy.networking.k8s.io";
/// `apiVersion` of ClusterNetworkPolicy.
pub const CNP_API_VERSION: &str = "policy.networking.k8s.io/v1alpha2";
/// `apiVersion` of AdminNetworkPolicy and BaselineAdminNetworkPolicy.
pub const ANP_API_VERSION: &str = "policy.networking.k8s.io/v1alpha1";

/// Tiers of ClusterNetworkPolicy (`Admin`, `Baseline`).
pub const KUBE_ADMIN_TIER: &str = "kube-admin";
pub const KUBE_BASELINE_TIER: &str = "kube-baseline";
/// Tiers of AdminNetworkPolicy and BaselineAdminNetworkPolicy.
pub const ANP_TIER: &str = "adminnetworkpolicy";
pub const BANP_TIER: &str = "baselineadminnetworkpolicy";

/// Felix policy names of the converted AdminNetworkPolicy / BaselineAdminNetworkPolicy.
pub const ANP_NAME_PREFIX: &str = "kanp.adminnetworkpolicy.";
pub const BANP_NAME_PREFIX: &str = "kbanp.baselineadminnetworkpolicy.";
/// `PolicyID.kind` of a converted ClusterNetworkPolicy (Calico's
/// `model.KindKubernetesClusterNetworkPolicy`).
pub const CNP_POLICY_KIND: &str = "KubernetesClusterNetworkPolicy";
/// The order every BaselineAdminNetworkPolicy gets.
pub const BANP_ORDER: f64 = 1000.0;
/// The rule annotation holding a rule's `name` (Calico's `K8sCNPRuleNameLabel`).
pub const RULE_NAME_ANNOTATION: &str = "name";

/// ClusterNetworkPolicy limits (v1alpha2 CRD): rules per direction, and peers, protocols and
/// networks per rule.
pub const CNP_MAX_RULES: usize = 25;
pub const CNP_MAX_ITEMS: usize = 25;
/// AdminNetworkPolicy / BaselineAdminNetworkPolicy limits (v1alpha1 CRD).
pub const ANP_MAX_RULES: usize = 100;
pub const ANP_MAX_ITEMS: usize = 100;
/// A rule name's length limit (both API versions).
pub const MAX_RULE_NAME: usize = 100;

/// A tier every Calico datastore holds from the start (clientv3 `EnsureInitialized`), whether
/// or not a Tier resource of that name was written.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BuiltinTier {
    pub name: &'static str,
    pub order: f64,
    pub default_action: &'static str,
}

/// The tiers the network-policy-api kinds go in. A Tier resource of the same name replaces
/// its entry. (Calico's `default` tier is deliberately not here: a cluster without that Tier
/// resource keeps the ordering it has today.)
pub const BUILTIN_TIERS: [BuiltinTier; 5] = [
    // Every Calico datastore has the default tier too; without it, baseline policies would
    // sort before NetworkPolicies of the default tier (a tier without a resource sorts last).
    BuiltinTier {
        name: "default",
        order: 1_000_000.0,
        default_action: "Deny",
    },
    BuiltinTier {
        name: KUBE_ADMIN_TIER,
        order: 1_000.0,
        default_action: "Pass",
    },
    BuiltinTier {
        name: ANP_TIER,
        order: 1_000.0,
        default_action: "Pass",
    },
    BuiltinTier {
        name: KUBE_BASELINE_TIER,
        order: 10_000_000.0,
        default_action: "Pass",
    },
    BuiltinTier {
        name: BANP_TIER,
        order: 10_000_000.0,
        default_action: "Pass",
    },
];

/// The built-in tier of that name, if any.
pub fn builtin_tier(name: &str) -> Option<&'static BuiltinTier> {
    BUILTIN_TIERS.iter().find(|t| t.name == name)
}

/// The Felix policy name Calico gives the object `name` of `kind`.
pub fn policy_name(kind: Kind, name: &str) -> String {
    match kind {
        Kind::AdminNetworkPolicy => format!("{ANP_NAME_PREFIX}{name}"),
        Kind::BaselineAdminNetworkPolicy => format!("{BANP_NAME_PREFIX}{name}"),
        _ => name.to_string(),
    }
}

// The CRD shapes, as far as the conversion reads them. Unknown fields are ignored (see the
// module documentation); numbers are read wide so that an out-of-range value is reported, not
// a decode failure.

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Spec {
    /// ClusterNetworkPolicy only.
    tier: Option<String>,
    /// ClusterNetworkPolicy and AdminNetworkPolicy.
    priority: Option<i64>,
    subject: Option<Subject>,
    ingress: Vec<IngressRule>,
    egress: Vec<EgressRule>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Subject {
    namespaces: Option<LabelSelector>,
    pods: Option<NamespacedPod>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct NamespacedPod {
    namespace_selector: LabelSelector,
    pod_selector: LabelSelector,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct IngressRule {
    name: String,
    action: String,
    from: Vec<Peer>,
    /// ClusterNetworkPolicy.
    protocols: Option<Vec<Protocol>>,
    /// AdminNetworkPolicy / BaselineAdminNetworkPolicy.
    ports: Option<Vec<AnpPort>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct EgressRule {
    name: String,
    action: String,
    to: Vec<Peer>,
    protocols: Option<Vec<Protocol>>,
    ports: Option<Vec<AnpPort>>,
}

/// An ingress peer (`namespaces`, `pods`) or an egress one (also `nodes`, `networks`,
/// `domainNames`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Peer {
    namespaces: Option<LabelSelector>,
    pods: Option<NamespacedPod>,
    nodes: Option<LabelSelector>,
    networks: Option<Vec<String>>,
    domain_names: Option<Vec<String>>,
}

/// A ClusterNetworkPolicy match entry: exactly one field set.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Protocol {
    tcp: Option<ProtocolPort>,
    udp: Option<ProtocolPort>,
    sctp: Option<ProtocolPort>,
    destination_named_port: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct ProtocolPort {
    destination_port: Option<CnpPort>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct CnpPort {
    number: Option<i64>,
    range: Option<PortRange>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct PortRange {
    /// AdminNetworkPolicy only (TCP when unset).
    protocol: Option<String>,
    start: i64,
    end: i64,
}

/// An AdminNetworkPolicy port: exactly one field set.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct AnpPort {
    port_number: Option<AnpPortNumber>,
    named_port: Option<String>,
    port_range: Option<PortRange>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct AnpPortNumber {
    protocol: Option<String>,
    port: i64,
}

/// The spec of a `kind` object (one of the three network-policy-api kinds) as the Calico policy
/// spec Calico's conversion gives, with its warnings and (if the object is invalid) errors.
///
/// The converted form itself, as [`Resource::to_value`](super::Resource::to_value) writes it for
/// the file datastore's last-good store, is read back as it is: it has a `selector` where the
/// API's spec has a `subject` (a manifest written that way is refused by the strict decoder:
/// unknown field `selector`).
pub(super) fn policy_spec(kind: Kind, spec: Value) -> Result<PolicySpec, (String, String)> {
    let Value::Object(spec) = spec else {
        return Err(("spec".into(), "expected an object".into()));
    };
    if spec.contains_key("selector") && !spec.contains_key("subject") {
        return decode_at("spec", Value::Object(spec));
    }
    let typed: Spec = decode_at("spec", Value::Object(spec))?;
    let mut c = Conversion {
        kind,
        warnings: Vec::new(),
        errors: Vec::new(),
    };
    let calico = c.spec(&typed);
    let mut out: PolicySpec = decode_at("spec", Value::Object(calico))?;
    out.conversion_warnings = c.warnings;
    out.conversion_errors = c.errors;
    Ok(out)
}

/// What one rule's conversion decides per (protocol, port list) before the peers are combined.
type ProtocolPorts = BTreeMap<String, Option<Vec<RulePort>>>;

/// Why one API rule cannot be converted; it then fails closed, and the warning shows this.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum RuleError {
    #[error("unsupported action {0:?}")]
    Action(String),
    /// A ClusterNetworkPolicy match entry that sets none of the fields we know (a newer API's).
    #[error("protocols[{0}] sets none of tcp, udp, sctp, destinationNamedPort")]
    NoProtocol(usize),
    /// A ClusterNetworkPolicy match entry.
    #[error("protocols[{0}]: {1}")]
    Protocol(usize, PortError),
    /// An AdminNetworkPolicy port.
    #[error("ports[{0}]: {1}")]
    Port(usize, PortError),
    /// A peer (`from[i]`, `to[i]`).
    #[error("{direction}[{index}]: {error}")]
    Peer {
        direction: &'static str,
        index: usize,
        error: PeerError,
    },
}

/// Why a match entry's protocol or port cannot be converted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum PortError {
    #[error("port {0} is outside 1–65535")]
    OutOfRange(i64),
    #[error("port range {0}–{1}: the start is greater than the end")]
    Reversed(u16, u16),
    #[error("unsupported protocol {0:?}")]
    Protocol(String),
    #[error("named ports are not supported")]
    Named,
    #[error("sets none of portNumber, portRange, namedPort")]
    NoPort,
}

/// Why a peer cannot be converted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum PeerError {
    #[error(transparent)]
    Selector(#[from] LabelSyntaxError),
    #[error("networks: {0:?} is not a CIDR")]
    Network(String),
    #[error("nodes peers are not supported")]
    Nodes,
    #[error("domainNames peers are not supported")]
    DomainNames,
    #[error("sets none of the supported peers (namespaces, pods)")]
    NoIngressPeer,
    #[error("sets none of the supported peers (namespaces, pods, networks)")]
    NoEgressPeer,
}

struct Conversion {
    kind: Kind,
    warnings: Vec<String>,
    errors: Vec<FieldError>,
}

impl Conversion {
    fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(FieldError::new(path, message));
    }

    /// A subject's selector; a bad one makes the object invalid (named in its errors), so
    /// the placeholder returned then is never used.
    fn subject_selector(&mut self, sel: Result<String, LabelSyntaxError>) -> String {
        sel.unwrap_or_else(|e| {
            self.error("spec.subject", e.to_string());
            format!("{LABEL_ORCHESTRATOR} == 'k8s'")
        })
    }

    fn limits(&self) -> (usize, usize) {
        match self.kind {
            Kind::ClusterNetworkPolicy => (CNP_MAX_RULES, CNP_MAX_ITEMS),
            _ => (ANP_MAX_RULES, ANP_MAX_ITEMS),
        }
    }

    fn spec(&mut self, s: &Spec) -> Map<String, Value> {
        let (tier, order) = match self.kind {
            Kind::ClusterNetworkPolicy => {
                let tier = match s.tier.as_deref() {
                    Some("Admin") => KUBE_ADMIN_TIER,
                    Some("Baseline") => KUBE_BASELINE_TIER,
                    other => {
                        self.error(
                            "spec.tier",
                            match other {
                                None => "tier is required (Admin or Baseline)".to_string(),
                                Some(t) => format!("tier must be Admin or Baseline, not {t:?}"),
                            },
                        );
                        KUBE_ADMIN_TIER
                    }
                };
                (tier, self.priority(s.priority))
            }
            Kind::AdminNetworkPolicy => (ANP_TIER, self.priority(s.priority)),
            _ => (BANP_TIER, BANP_ORDER),
        };
        let (namespace_selector, selector) = match &s.subject {
            Some(Subject {
                namespaces: Some(ns),
                pods: None,
            }) => (
                self.subject_selector(k8s_selector(Some(ns), SelectorType::Namespace)),
                // Pods only: host endpoints are never subjects.
                self.subject_selector(k8s_selector(None, SelectorType::Pod)),
            ),
            Some(Subject {
                namespaces: None,
                pods: Some(p),
            }) => (
                self.subject_selector(k8s_selector(
                    Some(&p.namespace_selector),
                    SelectorType::Namespace,
                )),
                self.subject_selector(k8s_selector(Some(&p.pod_selector), SelectorType::Pod)),
            ),
            _ => {
                self.error(
                    "spec.subject",
                    "exactly one of subject.namespaces and subject.pods must be set",
                );
                (String::new(), format!("{LABEL_ORCHESTRATOR} == 'k8s'"))
            }
        };
        let (max_rules, _) = self.limits();
        for (field, n) in [("ingress", s.ingress.len()), ("egress", s.egress.len())] {
            if n > max_rules {
                self.error(
                    format!("spec.{field}"),
                    format!(
                        "{n} rules; a {} may have at most {max_rules} {field} rules",
                        self.kind
                    ),
                );
            }
        }
        let mut ingress = Vec::new();
        for (i, r) in s.ingress.iter().enumerate() {
            let path = format!("spec.ingress[{i}]");
            self.rule_checks(&path, &r.name, "from", &r.from);
            let ports = self.ports(&path, r.protocols.as_deref(), r.ports.as_deref());
            let converted = self.rule(&r.name, &r.action, ports, &r.from, true);
            self.collect(&mut ingress, "ingress", i, &r.name, &r.action, converted);
        }
        let mut egress = Vec::new();
        for (i, r) in s.egress.iter().enumerate() {
            let path = format!("spec.egress[{i}]");
            self.rule_checks(&path, &r.name, "to", &r.to);
            let ports = self.ports(&path, r.protocols.as_deref(), r.ports.as_deref());
            let converted = self.rule(&r.name, &r.action, ports, &r.to, false);
            self.collect(&mut egress, "egress", i, &r.name, &r.action, converted);
        }
        // ClusterNetworkPolicy: the directions that have rules after conversion; the older
        // kinds: the directions the object has rules for. None at all is an empty list, which
        // Felix reads as both (their tiers pass by default, so neither decides anything).
        let (has_ingress, has_egress) = match self.kind {
            Kind::ClusterNetworkPolicy => (!ingress.is_empty(), !egress.is_empty()),
            _ => (!s.ingress.is_empty(), !s.egress.is_empty()),
        };
        let types = match (has_ingress, has_egress) {
            (true, false) => vec!["Ingress"],
            (false, true) => vec!["Egress"],
            _ => vec!["Ingress", "Egress"],
        };
        let mut out = Map::new();
        out.insert("tier".into(), tier.into());
        out.insert("order".into(), order.into());
        out.insert("selector".into(), selector.into());
        if !namespace_selector.is_empty() {
            out.insert("namespaceSelector".into(), namespace_selector.into());
        }
        out.insert("ingress".into(), Value::Array(ingress));
        out.insert("egress".into(), Value::Array(egress));
        out.insert("types".into(), json!(types));
        out
    }

    fn priority(&mut self, p: Option<i64>) -> f64 {
        match p {
            Some(p) if (0..=1000).contains(&p) => p as f64,
            Some(p) => {
                self.error("spec.priority", format!("priority {p} is outside 0–1000"));
                0.0
            }
            None => {
                self.error("spec.priority", "priority is required");
                0.0
            }
        }
    }

    /// Checks a rule against the API's limits: its name's length, its number of peers and each
    /// peer's number of networks (the peers themselves are converted, or fail, with the rule).
    fn rule_checks(&mut self, path: &str, name: &str, field: &str, peers: &[Peer]) {
        if name.chars().count() > MAX_RULE_NAME {
            self.error(
                format!("{path}.name"),
                format!("a rule name may have at most {MAX_RULE_NAME} characters"),
            );
        }
        let (_, max) = self.limits();
        if peers.len() > max {
            self.error(
                format!("{path}.{field}"),
                format!("{} peers; a rule may have at most {max}", peers.len()),
            );
        }
        for (i, p) in peers.iter().enumerate() {
            if let Some(n) = &p.networks
                && n.len() > max
            {
                self.error(
                    format!("{path}.{field}[{i}].networks"),
                    format!("{} networks; a peer may have at most {max}", n.len()),
                );
            }
        }
    }

    /// A rule's match fields as protocol → ports (`None`: every port; the key `""`: every
    /// protocol), or why the rule cannot be converted.
    fn ports(
        &mut self,
        path: &str,
        protocols: Option<&[Protocol]>,
        anp_ports: Option<&[AnpPort]>,
    ) -> Result<ProtocolPorts, RuleError> {
        let (_, max) = self.limits();
        let entries: Vec<Result<(String, Option<RulePort>), RuleError>> = match self.kind {
            Kind::ClusterNetworkPolicy => {
                let list = protocols.unwrap_or_default();
                if list.len() > max {
                    self.error(
                        format!("{path}.protocols"),
                        format!("{} entries; a rule may have at most {max}", list.len()),
                    );
                }
                list.iter().enumerate().map(cnp_protocol).collect()
            }
            _ => {
                let list = anp_ports.unwrap_or_default();
                if list.len() > max {
                    self.error(
                        format!("{path}.ports"),
                        format!("{} entries; a rule may have at most {max}", list.len()),
                    );
                }
                list.iter().enumerate().map(anp_port).collect()
            }
        };
        let mut out = ProtocolPorts::new();
        if entries.is_empty() {
            out.insert(String::new(), None);
        }
        for e in entries {
            let (proto, port) = e?;
            match port {
                // Every port of the protocol, whatever else was listed for it.
                None => {
                    out.insert(proto, None);
                }
                Some(p) => {
                    if let Some(list) = out.entry(proto).or_insert_with(|| Some(Vec::new())) {
                        list.push(p);
                    }
                }
            }
        }
        Ok(out)
    }

    /// One API rule → Calico rules (one per protocol and peer), or why it cannot be converted.
    fn rule(
        &self,
        name: &str,
        action: &str,
        ports: Result<ProtocolPorts, RuleError>,
        peers: &[Peer],
        ingress: bool,
    ) -> Result<Vec<Value>, RuleError> {
        let action = self.action(action)?;
        let ports = ports?;
        let mut rules = Vec::new();
        for (proto, ports) in ports {
            let ports: Vec<Value> = simplify_ports(ports.unwrap_or_default())
                .iter()
                .map(RulePort::to_value)
                .collect();
            for (i, peer) in peers.iter().enumerate() {
                let mut entity = peer_fields(peer, ingress).map_err(|error| RuleError::Peer {
                    direction: if ingress { "from" } else { "to" },
                    index: i,
                    error,
                })?;
                let mut rule = Map::new();
                if !name.is_empty() {
                    rule.insert(
                        "metadata".into(),
                        json!({"annotations": {RULE_NAME_ANNOTATION: name}}),
                    );
                }
                rule.insert("action".into(), action.into());
                if !proto.is_empty() {
                    rule.insert("protocol".into(), proto.clone().into());
                }
                if ingress {
                    rule.insert("source".into(), Value::Object(entity));
                    if !ports.is_empty() {
                        rule.insert("destination".into(), json!({"ports": ports}));
                    }
                } else {
                    if !ports.is_empty() {
                        entity.insert("ports".into(), Value::Array(ports.clone()));
                    }
                    rule.insert("destination".into(), Value::Object(entity));
                }
                rules.push(Value::Object(rule));
            }
        }
        Ok(rules)
    }

    /// The Calico action of an API action.
    fn action(&self, action: &str) -> Result<&'static str, RuleError> {
        match (self.kind, action) {
            (Kind::ClusterNetworkPolicy, "Accept") => Ok("Allow"),
            (Kind::ClusterNetworkPolicy | Kind::AdminNetworkPolicy, "Pass") => Ok("Pass"),
            (Kind::AdminNetworkPolicy | Kind::BaselineAdminNetworkPolicy, "Allow") => Ok("Allow"),
            (_, "Deny") => Ok("Deny"),
            _ => Err(RuleError::Action(action.to_owned())),
        }
    }

    /// Adds a converted rule's Calico rules, or fails it closed with a warning.
    fn collect(
        &mut self,
        out: &mut Vec<Value>,
        dir: &str,
        index: usize,
        name: &str,
        action: &str,
        converted: Result<Vec<Value>, RuleError>,
    ) {
        let e = match converted {
            Ok(rules) => {
                out.extend(rules);
                return;
            }
            Err(e) => e,
        };
        let which = if name.is_empty() {
            format!("{dir} rule {index}")
        } else {
            format!("{dir} rule {index} ({name:?})")
        };
        // Deny and Pass fail closed as a bare Deny; anything else (an allowing rule, an
        // unknown action) is dropped, which matches nothing.
        if action == "Deny" || action == "Pass" {
            out.push(json!({"action": "Deny"}));
            self.warnings.push(format!(
                "{which} cannot be converted ({e}): replaced by a rule denying all {dir} traffic"
            ));
        } else {
            self.warnings
                .push(format!("{which} cannot be converted ({e}): dropped"));
        }
    }
}

/// A port number the API allows (1–65535).
fn port_number(n: i64) -> Result<u16, PortError> {
    u16::try_from(n)
        .ok()
        .filter(|p| *p > 0)
        .ok_or(PortError::OutOfRange(n))
}

fn port_range(r: &PortRange) -> Result<RulePort, PortError> {
    let (a, b) = (port_number(r.start)?, port_number(r.end)?);
    if a > b {
        return Err(PortError::Reversed(a, b));
    }
    Ok(RulePort::Range(a, b))
}

/// A ClusterNetworkPolicy match entry → (protocol, port or every port).
fn cnp_protocol((i, p): (usize, &Protocol)) -> Result<(String, Option<RulePort>), RuleError> {
    let (proto, m) = if let Some(m) = &p.tcp {
        ("TCP", m)
    } else if let Some(m) = &p.udp {
        ("UDP", m)
    } else if let Some(m) = &p.sctp {
        ("SCTP", m)
    } else if p.destination_named_port.is_some() {
        return Err(RuleError::Protocol(i, PortError::Named));
    } else {
        return Err(RuleError::NoProtocol(i));
    };
    let port = match &m.destination_port {
        None => None,
        Some(CnpPort {
            number: Some(n), ..
        }) if *n != 0 => {
            let n = port_number(*n).map_err(|e| RuleError::Protocol(i, e))?;
            Some(RulePort::Range(n, n))
        }
        Some(CnpPort { range: Some(r), .. }) => {
            Some(port_range(r).map_err(|e| RuleError::Protocol(i, e))?)
        }
        Some(_) => None,
    };
    Ok((proto.to_string(), port))
}

/// A protocol name of the older API (TCP when unset).
fn anp_protocol(p: Option<&str>) -> Result<String, PortError> {
    match p.unwrap_or("TCP") {
        "" | "TCP" => Ok("TCP".into()),
        p @ ("UDP" | "SCTP") => Ok(p.into()),
        other => Err(PortError::Protocol(other.to_owned())),
    }
}

/// An AdminNetworkPolicy port → (protocol, port).
fn anp_port((i, p): (usize, &AnpPort)) -> Result<(String, Option<RulePort>), RuleError> {
    let at = |e: PortError| RuleError::Port(i, e);
    if let Some(n) = &p.port_number {
        let proto = anp_protocol(n.protocol.as_deref()).map_err(at)?;
        let n = port_number(n.port).map_err(at)?;
        return Ok((proto, Some(RulePort::Range(n, n))));
    }
    if let Some(r) = &p.port_range {
        let proto = anp_protocol(r.protocol.as_deref()).map_err(at)?;
        return Ok((proto, Some(port_range(r).map_err(at)?)));
    }
    if p.named_port.is_some() {
        return Err(at(PortError::Named));
    }
    Err(at(PortError::NoPort))
}

/// A peer → the entity fields of a Calico rule (selector, namespace selector, nets), as
/// Calico reads the peer's fields in order; a peer none of whose supported fields is set
/// cannot be converted.
fn peer_fields(peer: &Peer, ingress: bool) -> Result<Map<String, Value>, PeerError> {
    let mut out = Map::new();
    let mut found = false;
    if let Some(ns) = &peer.namespaces {
        out.insert(
            "namespaceSelector".into(),
            k8s_selector(Some(ns), SelectorType::Namespace)?.into(),
        );
        found = true;
    }
    if let Some(p) = &peer.pods {
        out.insert(
            "selector".into(),
            k8s_selector(Some(&p.pod_selector), SelectorType::Pod)?.into(),
        );
        out.insert(
            "namespaceSelector".into(),
            k8s_selector(Some(&p.namespace_selector), SelectorType::Namespace)?.into(),
        );
        found = true;
    }
    if !ingress && let Some(networks) = peer.networks.as_ref().filter(|n| !n.is_empty()) {
        let nets = networks
            .iter()
            .map(|n| masked_cidr(n).ok_or_else(|| PeerError::Network(n.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        out.insert("nets".into(), json!(nets));
        found = true;
    }
    if found {
        return Ok(out);
    }
    Err(if peer.nodes.is_some() && !ingress {
        PeerError::Nodes
    } else if peer.domain_names.is_some() && !ingress {
        PeerError::DomainNames
    } else if ingress {
        PeerError::NoIngressPeer
    } else {
        PeerError::NoEgressPeer
    })
}

#[cfg(test)]
mod tests;
