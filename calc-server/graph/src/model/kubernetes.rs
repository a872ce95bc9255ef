//! Kubernetes policy objects as Calico converts them (`libcalico-go/lib/backend/k8s/conversion`):
//! the NetworkPolicy spec, which both the Kubernetes datastore (`networking.k8s.io/v1`
//! NetworkPolicy) and Calico's `StagedKubernetesNetworkPolicy` carry. Pure: the result is a
//! Calico policy spec (JSON) that the ordinary decoder and validator then read, plus a warning
//! for each rule that could not be converted (the rule is dropped; the policy only gets
//! stricter).
//!
//! The whole objects too, once for every datastore ([`Native`]): a NetworkPolicy becomes the
//! Calico NetworkPolicy `knp.default.<name>` ([`network_policy_object`]) and a Namespace the
//! Profile `kns.<name>` carrying its labels ([`namespace_profile`]). The Kubernetes datastore
//! converts what it watches with them; `Resource::from_value` converts the same objects written
//! as manifests (the file datastore, `validate`, `compute`), so both give the same policy.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{Map, Value, json};

use super::LABEL_ORCHESTRATOR;
use super::validate::{FieldError, parse_cidr_or_ip};
use crate::untrusted::Untrusted;

/// Kubernetes NetworkPolicies are named with this prefix in Calico's model.
pub const K8S_POLICY_PREFIX: &str = "knp.default.";
/// The order every converted Kubernetes NetworkPolicy gets.
pub const K8S_POLICY_ORDER: f64 = 1000.0;
/// The `apiVersion` of Kubernetes' NetworkPolicy.
pub const NETWORK_POLICY_API_VERSION: &str = "networking.k8s.io/v1";
/// The `apiVersion` of Kubernetes' core kinds (Namespace).
pub const CORE_API_VERSION: &str = "v1";
/// A namespace's profile is named with this prefix (`kns.<namespace>`).
pub const NAMESPACE_PROFILE_PREFIX: &str = "kns.";
/// A namespace's labels reach its endpoints with this prefix (`pcns.<key>`).
pub const NAMESPACE_LABEL_PREFIX: &str = "pcns.";
/// The label (after the prefix) carrying a namespace's or service account's own name.
pub const NAME_LABEL: &str = "projectcalico.org/name";

/// The Kubernetes kinds converted to Calico objects wherever they are read (their own
/// `apiVersion`, not Calico's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Native {
    /// `networking.k8s.io/v1` NetworkPolicy → NetworkPolicy `knp.default.<name>`.
    NetworkPolicy,
    /// `v1` Namespace → Profile `kns.<name>`.
    Namespace,
}

impl Native {
    /// The native kind an object of `kind` and `api_version` is, if any.
    pub fn of(kind: &str, api_version: &str) -> Option<Native> {
        match (kind, api_version) {
            ("NetworkPolicy", NETWORK_POLICY_API_VERSION) => Some(Native::NetworkPolicy),
            ("Namespace", CORE_API_VERSION) => Some(Native::Namespace),
            _ => None,
        }
    }

    /// The Calico kind it becomes.
    pub fn calico_kind(self) -> super::Kind {
        match self {
            Native::NetworkPolicy => super::Kind::NetworkPolicy,
            Native::Namespace => super::Kind::Profile,
        }
    }

    /// The Calico name of the object Kubernetes names `name`.
    pub fn calico_name(self, name: &str) -> String {
        match self {
            Native::NetworkPolicy => format!("{K8S_POLICY_PREFIX}{name}"),
            Native::Namespace => format!("{NAMESPACE_PROFILE_PREFIX}{name}"),
        }
    }
}

/// Calico's `K8sNetworkPolicyToCalico`: the v3 NetworkPolicy `knp.default.<name>` in
/// `namespace` with the spec [`network_policy_spec`] converts (nothing else of the object's
/// metadata is kept, as in Calico), and the conversion's warnings.
pub fn network_policy_object(
    name: &str,
    namespace: &str,
    spec: &NetworkPolicySpec,
) -> Result<(Value, Vec<String>), FieldError> {
    let (spec, warnings) = network_policy_spec(spec)?;
    let value = json!({
        "kind": "NetworkPolicy",
        "apiVersion": super::API_VERSION,
        "metadata": {"name": Native::NetworkPolicy.calico_name(name), "namespace": namespace},
        "spec": spec,
    });
    Ok((value, warnings))
}

/// Calico's `NamespaceToProfile`: the Profile `kns.<name>` allowing both ways, whose
/// `labelsToApply` are the namespace's labels prefixed `pcns.`, plus
/// `pcns.projectcalico.org/name: <name>`.
pub fn namespace_profile(name: &str, labels: &BTreeMap<String, String>) -> Value {
    let mut applied: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (format!("{NAMESPACE_LABEL_PREFIX}{k}"), v.clone()))
        .collect();
    applied.insert(format!("{NAMESPACE_LABEL_PREFIX}{NAME_LABEL}"), name.into());
    json!({
        "kind": "Profile",
        "apiVersion": super::API_VERSION,
        "metadata": {"name": Native::Namespace.calico_name(name)},
        "spec": {
            "ingress": [{"action": "Allow"}],
            "egress": [{"action": "Allow"}],
            "labelsToApply": applied,
        },
    })
}

/// `<cidr>` masked to its network (`10.1.2.3/8` → `10.0.0.0/8`); `None` for a bare IP or junk.
pub fn masked_cidr(s: &str) -> Option<String> {
    if !s.contains('/') {
        return None;
    }
    parse_cidr_or_ip(s.trim()).map(|n| format!("{}/{}", n.network(), n.prefix()))
}

/// A label selector key or value that is not Kubernetes label syntax (shown escaped and cut:
/// it came from the datastore).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LabelSyntaxError {
    #[error("label selector key {:?} is not a Kubernetes label key", Untrusted(.0))]
    Key(String),
    #[error("label selector value {:?} is not a Kubernetes label value", Untrusted(.0))]
    Value(String),
}

/// Why one rule of a Kubernetes NetworkPolicy cannot be converted (Calico drops the rule).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error(transparent)]
    Selector(#[from] LabelSyntaxError),
    #[error("invalid port {0:?}")]
    Port(String),
    #[error("invalid port range {0}:{1}")]
    PortRange(u16, u16),
    #[error("invalid port \"{port}:{end}\": a named port cannot have an endPort")]
    NamedPortRange { port: String, end: i32 },
    #[error("ipBlock.cidr {0:?} is not a CIDR")]
    Cidr(String),
    #[error("ipBlock.except {0:?} is not a CIDR")]
    Except(String),
}

/// Which selector `k8s_selector` builds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum SelectorType {
    Pod,
    Namespace,
}

/// Calico's `k8sSelectorToCalico`: pod selectors always start with
/// `projectcalico.org/orchestrator == 'k8s'`; a nil namespace selector is empty (the policy's
/// namespace), an empty one `all()` (every namespace). Labels are joined with ` && ` in key
/// order, then the expressions in their order.
///
/// Calico pastes keys and values into the selector as they are. Kubernetes validates them for
/// its own NetworkPolicies but not inside a CRD's label selector, so here a key or value that
/// is not Kubernetes label syntax is an error: `x' || all() || a == 'y` as a value would
/// otherwise widen the selector.
pub fn k8s_selector(
    s: Option<&LabelSelector>,
    which: SelectorType,
) -> Result<String, LabelSyntaxError> {
    let mut parts = Vec::new();
    if which == SelectorType::Pod {
        parts.push(format!("{LABEL_ORCHESTRATOR} == 'k8s'"));
    }
    let Some(s) = s else {
        return Ok(parts.join(" && "));
    };
    let labels = s.match_labels.as_ref().filter(|m| !m.is_empty());
    let exprs = s.match_expressions.as_ref().filter(|m| !m.is_empty());
    if which == SelectorType::Namespace && labels.is_none() && exprs.is_none() {
        return Ok("all()".into());
    }
    let key = |k: &str| {
        if is_label_key(k) {
            Ok(())
        } else {
            Err(LabelSyntaxError::Key(k.to_owned()))
        }
    };
    let value = |v: &str| {
        if is_label_value(v) {
            Ok(())
        } else {
            Err(LabelSyntaxError::Value(v.to_owned()))
        }
    };
    for (k, v) in labels.into_iter().flatten() {
        key(k)?;
        value(v)?;
        parts.push(format!("{k} == '{v}'"));
    }
    for e in exprs.into_iter().flatten() {
        key(&e.key)?;
        let values = e.values.clone().unwrap_or_default();
        for v in &values {
            value(v)?;
        }
        let values = values.join("', '");
        match e.operator.as_str() {
            "In" => parts.push(format!("{} in {{ '{values}' }}", e.key)),
            "NotIn" => parts.push(format!("{} not in {{ '{values}' }}", e.key)),
            "Exists" => parts.push(format!("has({})", e.key)),
            "DoesNotExist" => parts.push(format!("! has({})", e.key)),
            // Calico skips operators it does not know.
            _ => {}
        }
    }
    Ok(parts.join(" && "))
}

/// A Kubernetes label value: empty, or at most 63 of `[A-Za-z0-9._-]`, starting and ending
/// alphanumeric.
fn is_label_value(v: &str) -> bool {
    v.is_empty()
        || (v.len() <= 63
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && v.as_bytes()[0].is_ascii_alphanumeric()
            && v.as_bytes()[v.len() - 1].is_ascii_alphanumeric())
}

/// A Kubernetes label key: an optional DNS subdomain prefix and `/`, then a name (a non-empty
/// label value).
fn is_label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            })
    });
    prefix_ok && !name.is_empty() && is_label_value(name)
}

/// Calico's `K8sNetworkPolicyToCalico`, the spec part: the Calico policy spec (as JSON, in the
/// default tier at order 1000, selector from `podSelector`) of a Kubernetes NetworkPolicy spec,
/// and a warning per rule that could not be converted. Each ingress/egress rule becomes one Allow
/// rule per (protocol, peer): ports are grouped by protocol (TCP when unset; `endPort` makes a
/// range; a name is a named port; several numeric ports are merged into ranges), peers give a
/// selector + namespace selector or an ipBlock (`except` → `notNets`). Types: those listed in
/// `policyTypes`, or `[Ingress]` when none are (an empty ingress list is then deny-all ingress).
/// A rule that cannot be converted is dropped and the rest kept, as Calico does (the policy
/// only gets stricter); a `podSelector` that cannot be converted fails the whole spec.
pub fn network_policy_spec(
    spec: &NetworkPolicySpec,
) -> Result<(Map<String, Value>, Vec<String>), FieldError> {
    let mut warnings = Vec::new();
    let mut ingress = Vec::new();
    for (i, r) in spec.ingress.iter().flatten().enumerate() {
        match k8s_rule(r.from.as_deref(), r.ports.as_deref(), true) {
            Ok(rules) => ingress.extend(rules),
            Err(e) => warnings.push(format!("ingress rule {i} dropped: {e}")),
        }
    }
    let mut egress = Vec::new();
    for (i, r) in spec.egress.iter().flatten().enumerate() {
        match k8s_rule(r.to.as_deref(), r.ports.as_deref(), false) {
            Ok(rules) => egress.extend(rules),
            Err(e) => warnings.push(format!("egress rule {i} dropped: {e}")),
        }
    }
    let listed = |t: &str| spec.policy_types.iter().flatten().any(|p| p == t);
    let mut types = Vec::new();
    if listed("Ingress") {
        types.push("Ingress");
    }
    if listed("Egress") {
        types.push("Egress");
    } else if !egress.is_empty() {
        warnings.push("egress rules present but policyTypes lacks Egress: they are ignored".into());
    }
    // A cluster that predates policyTypes meant ingress only.
    if types.is_empty() {
        types.push("Ingress");
    }
    let mut out = Map::new();
    out.insert("tier".into(), "default".into());
    out.insert("order".into(), K8S_POLICY_ORDER.into());
    out.insert(
        "selector".into(),
        k8s_selector(
            Some(&spec.pod_selector.clone().unwrap_or_default()),
            SelectorType::Pod,
        )
        .map_err(|e| FieldError::new("podSelector", e.to_string()))?
        .into(),
    );
    out.insert("ingress".into(), Value::Array(ingress));
    out.insert("egress".into(), Value::Array(egress));
    out.insert("types".into(), json!(types));
    Ok((out, warnings))
}

/// A port of a rule: a number, a range or a name.
#[derive(Clone, Debug, PartialEq)]
pub enum RulePort {
    Range(u16, u16),
    Named(String),
}

impl RulePort {
    pub fn to_value(&self) -> Value {
        match self {
            RulePort::Range(a, b) if a == b => Value::from(*a),
            RulePort::Range(a, b) => Value::from(format!("{a}:{b}")),
            RulePort::Named(n) => Value::from(n.clone()),
        }
    }
}

/// `numorstring.PortFromString` of `<port>` or `<port>:<endPort>`.
fn k8s_port(p: &NetworkPolicyPort) -> Result<Option<RulePort>, RuleError> {
    let Some(port) = &p.port else {
        return Ok(None);
    };
    let number = |s: &str| {
        s.parse::<u16>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| RuleError::Port(s.to_owned()))
    };
    let port = match port {
        IntOrString::Int(n) => n.to_string(),
        IntOrString::String(s) => s.clone(),
    };
    let is_number = port.chars().all(|c| c.is_ascii_digit()) && !port.is_empty();
    match (is_number, p.end_port) {
        (true, None) => {
            let n = number(&port)?;
            Ok(Some(RulePort::Range(n, n)))
        }
        (true, Some(end)) => {
            let (a, b) = (number(&port)?, number(&end.to_string())?);
            if a > b {
                return Err(RuleError::PortRange(a, b));
            }
            Ok(Some(RulePort::Range(a, b)))
        }
        (false, None) => Ok(Some(RulePort::Named(port))),
        (false, Some(end)) => Err(RuleError::NamedPortRange { port, end }),
    }
}

/// Calico's `SimplifyPorts`: with more than one numeric port, named ports first (in order), then
/// the numeric ones merged into sorted, non-overlapping ranges.
pub fn simplify_ports(ports: Vec<RulePort>) -> Vec<RulePort> {
    if ports.len() <= 1 {
        return ports;
    }
    let mut named = Vec::new();
    let mut numbers: Vec<u32> = Vec::new();
    for p in &ports {
        match p {
            RulePort::Named(_) => named.push(p.clone()),
            RulePort::Range(a, b) => numbers.extend(u32::from(*a)..=u32::from(*b)),
        }
    }
    if numbers.len() <= 1 {
        return ports;
    }
    numbers.sort_unstable();
    let mut out = named;
    let mut i = 0;
    while i < numbers.len() {
        let first = numbers[i];
        let mut last = first;
        i += 1;
        while i < numbers.len() && numbers[i] <= last + 1 {
            last = numbers[i];
            i += 1;
        }
        // Both came from u16 ports.
        out.push(RulePort::Range(first as u16, last as u16));
    }
    out
}

/// Calico's `k8sRuleToCalico`: one Allow rule per (protocol, peer).
fn k8s_rule(
    peers: Option<&[NetworkPolicyPeer]>,
    ports: Option<&[NetworkPolicyPort]>,
    ingress: bool,
) -> Result<Vec<Value>, RuleError> {
    // Protocol → ports (None: every port of it). The key "" (no protocol, no ports) exists
    // only when the rule lists no ports at all.
    let mut by_protocol: BTreeMap<String, Option<Vec<RulePort>>> = BTreeMap::new();
    let ports = ports.unwrap_or_default();
    if ports.is_empty() {
        by_protocol.insert(String::new(), None);
    }
    for p in ports {
        // TCP is the documented default; Calico makes it explicit because a port match needs
        // a protocol.
        let proto = p.protocol.clone().unwrap_or_else(|| "TCP".into());
        match k8s_port(p)? {
            None => {
                by_protocol.insert(proto, None);
            }
            Some(port) => match by_protocol.entry(proto).or_insert_with(|| Some(Vec::new())) {
                // Every port of the protocol is already allowed.
                None => {}
                Some(list) => list.push(port),
            },
        }
    }
    let peers: Vec<Option<&NetworkPolicyPeer>> = match peers {
        Some(p) if !p.is_empty() => p.iter().map(Some).collect(),
        _ => vec![None],
    };
    let mut rules = Vec::new();
    for (proto, ports) in by_protocol {
        let ports: Vec<Value> = simplify_ports(ports.unwrap_or_default())
            .iter()
            .map(RulePort::to_value)
            .collect();
        for peer in &peers {
            let mut entity = k8s_peer(*peer)?;
            let mut rule = Map::new();
            rule.insert("action".into(), "Allow".into());
            if !proto.is_empty() {
                rule.insert("protocol".into(), proto.clone().into());
            }
            let mut ports_entity = Map::new();
            if !ports.is_empty() {
                ports_entity.insert("ports".into(), Value::Array(ports.clone()));
            }
            if ingress {
                rule.insert("source".into(), Value::Object(entity));
                rule.insert("destination".into(), Value::Object(ports_entity));
            } else {
                entity.extend(ports_entity);
                rule.insert("destination".into(), Value::Object(entity));
            }
            rules.push(Value::Object(rule));
        }
    }
    Ok(rules)
}

/// Calico's `k8sPeerToCalicoFields`: an ipBlock gives nets (and notNets from `except`);
/// otherwise a pod selector and a namespace selector (see [`k8s_selector`]).
fn k8s_peer(peer: Option<&NetworkPolicyPeer>) -> Result<Map<String, Value>, RuleError> {
    let mut out = Map::new();
    let Some(peer) = peer else {
        return Ok(out);
    };
    if let Some(block) = &peer.ip_block {
        let net = masked_cidr(&block.cidr).ok_or_else(|| RuleError::Cidr(block.cidr.clone()))?;
        out.insert("nets".into(), json!([net]));
        let except = block
            .except
            .iter()
            .flatten()
            .map(|e| masked_cidr(e).ok_or_else(|| RuleError::Except(e.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        if !except.is_empty() {
            out.insert("notNets".into(), json!(except));
        }
        return Ok(out);
    }
    let selector = k8s_selector(peer.pod_selector.as_ref(), SelectorType::Pod)?;
    let ns_selector = k8s_selector(peer.namespace_selector.as_ref(), SelectorType::Namespace)?;
    out.insert("selector".into(), selector.into());
    if !ns_selector.is_empty() {
        out.insert("namespaceSelector".into(), ns_selector.into());
    }
    Ok(out)
}
