//! Validation of v3 resources, following Calico's v3 validator.
//!
//! Contract: [`validate`] returns every problem of one object at once, each with the field
//! path (`spec.ingress[0].destination.ports[1]`) and a reason, wrapped in [`Invalid`] that names
//! the object (`NetworkPolicy prod/allow-frontend`). It never panics and never stops at the
//! first problem, so `calc-server validate` gives a user the whole list in one run.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use ipnetwork::IpNetwork;

use super::rule::{Action, EntityRule, IcmpFields, Port, Protocol, Rule};
use super::{
    EndpointPort, EndpointSliceSpec, HostEndpointSpec, IpPoolSpec, Kind, NetworkSetSpec,
    ObjectMeta, PolicySpec, ProfileSpec, Resource, ResourceKey, ServiceSpec, TierSpec,
    WorkloadEndpointSpec,
};
use crate::selector;

/// Largest total size of an object's (or a rule's) annotations, keys and values together.
pub const MAX_ANNOTATIONS_BYTES: usize = 256 * 1024;

/// Calico's CRDs (3.33) cap a selector at 1,024 characters.
pub const MAX_SELECTOR_LEN: usize = 1024;
/// Calico's CRDs (3.33) cap a policy's `ingress` and `egress` lists at 1,024 rules each.
pub const MAX_RULES: usize = 1024;
/// The staged actions Calico defines (empty means `Set`).
const STAGED_ACTIONS: [&str; 4] = ["Set", "Delete", "Learn", "Ignore"];

/// Kubernetes' caps on an EndpointSlice: endpoints, addresses per endpoint, ports.
pub const MAX_SLICE_ENDPOINTS: usize = 1000;
pub const MAX_SLICE_ADDRESSES: usize = 100;
pub const MAX_SLICE_PORTS: usize = 100;

/// One problem: where (the field path) and why; the shape the agent reports too.
pub use calico_names::FieldError;

/// A resource that passed [`validate`], and the proof of it: the only ways to build one are
/// [`Valid::check`] and the manifest decoders (`crate::manifest::decode_and_validate`), which
/// both run [`validate`] on exactly this value, and it cannot be changed afterwards (no
/// `DerefMut`, no public field, no `Deserialize`). A clone is as valid as the original.
///
/// Why: the datastore adapters validate every object as they decode it (to report and count a
/// rejection by name, and keep the last good version); handing the graph a `Valid`
/// (`Update::ApplyValid`) lets it skip a second identical validation, while a plain `Resource`
/// (`Update::Apply`) from any other producer is still validated by the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Valid(Resource);

impl Valid {
    /// Validates `res`.
    pub fn check(res: Resource) -> Result<Valid, Invalid> {
        validate(&res)?;
        Ok(Valid(res))
    }

    pub fn resource(&self) -> &Resource {
        &self.0
    }

    /// The resource, no longer carrying the proof (to change it, or to store it).
    pub fn into_resource(self) -> Resource {
        self.0
    }
}

impl std::ops::Deref for Valid {
    type Target = Resource;

    fn deref(&self) -> &Resource {
        &self.0
    }
}

/// An object that failed validation, with all of its problems.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct Invalid {
    pub key: ResourceKey,
    pub errors: Vec<FieldError>,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is invalid: ", self.key)?;
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// Validates one resource. `Ok(())` when Calico would accept it.
pub fn validate(res: &Resource) -> Result<(), Invalid> {
    let mut v = Validator::default();
    let meta = res.meta();
    v.crd_limits = match res.kind() {
        Kind::NetworkPolicy => !meta.name.starts_with(super::kubernetes::K8S_POLICY_PREFIX),
        Kind::GlobalNetworkPolicy | Kind::StagedNetworkPolicy | Kind::StagedGlobalNetworkPolicy => {
            true
        }
        _ => false,
    };
    v.meta(res.kind(), meta);
    match res {
        Resource::Policy(kind, _, s) => {
            for e in &s.conversion_errors {
                v.err(e.field.clone(), e.reason.clone());
            }
            v.policy(s, kind.is_global_policy());
            if kind.is_staged()
                && !s.staged_action.is_empty()
                && !STAGED_ACTIONS.contains(&s.staged_action.as_str())
            {
                v.err(
                    "spec.stagedAction",
                    format!(
                        "invalid staged action {:?} (expected Set, Delete, Learn or Ignore)",
                        s.staged_action
                    ),
                );
            }
        }
        Resource::Tier(_, s) => v.tier(s),
        Resource::Profile(_, s) => v.profile(s),
        Resource::WorkloadEndpoint(_, s) => v.workload_endpoint(s),
        Resource::HostEndpoint(_, s) => v.host_endpoint(s),
        Resource::NetworkSet(m, s) | Resource::GlobalNetworkSet(m, s) => v.network_set(m, s),
        Resource::IPPool(_, s) => v.ip_pool(s),
        Resource::Node(_, s) => {
            if let Some(bgp) = &s.bgp {
                for (f, a) in [
                    ("ipv4Address", &bgp.ipv4_address),
                    ("ipv6Address", &bgp.ipv6_address),
                ] {
                    if !a.is_empty() && parse_cidr_or_ip(a).is_none() {
                        v.err(
                            format!("spec.bgp.{f}"),
                            format!("{a:?} is not an IP address or CIDR"),
                        );
                    }
                }
            }
        }
        Resource::FelixConfiguration(_, spec) => v.felix_configuration(spec),
        Resource::ClusterInformation(..) => {}
        Resource::EndpointSlice(_, s) => v.endpoint_slice(s),
        Resource::Service(_, s) => v.service(s),
    }
    if v.errors.is_empty() {
        Ok(())
    } else {
        Err(Invalid {
            key: res.key(),
            errors: v.errors,
        })
    }
}

#[derive(Default)]
struct Validator {
    errors: Vec<FieldError>,
    /// Calico's CRD caps (rules per direction, selector length) apply: the object is a policy
    /// a user wrote in Calico's form. Policies converted from Kubernetes kinds are not held to
    /// them (Calico's conversion checks no sizes, and refusing one would drop its denies).
    crd_limits: bool,
}

const DNS1123_SUBDOMAIN_MAX: usize = 253;

impl Validator {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        // Messages quote the offending value: bounded here so a 50 MB label value is not
        // echoed whole into every log line and status that shows the error.
        self.errors.push(FieldError::new(
            crate::untrusted::clip(path.into(), 512),
            crate::untrusted::clip(message.into(), 1024),
        ));
    }

    fn meta(&mut self, kind: Kind, m: &ObjectMeta) {
        if m.name.len() > DNS1123_SUBDOMAIN_MAX {
            self.err(
                "metadata.name",
                format!(
                    "name is too long by {} bytes",
                    m.name.len() - DNS1123_SUBDOMAIN_MAX
                ),
            );
        }
        let (ok, what) = match kind {
            Kind::NetworkPolicy | Kind::StagedNetworkPolicy => (
                is_label(&m.name)
                    || m.name
                        .split_once('.')
                        .is_some_and(|(a, b)| is_label(a) && is_label(b))
                    || ["knp.default.", "ossg.default."]
                        .iter()
                        .any(|p| m.name.strip_prefix(p).is_some_and(is_subdomain)),
                "lower case alphanumeric characters or '-', with at most one '.'",
            ),
            Kind::GlobalNetworkPolicy | Kind::StagedGlobalNetworkPolicy => (
                is_label(&m.name)
                    || m.name
                        .split_once('.')
                        .is_some_and(|(a, b)| is_label(a) && is_label(b)),
                "lower case alphanumeric characters or '-', with at most one '.'",
            ),
            Kind::Tier => (
                is_label(&m.name),
                "lower case alphanumeric characters or '-'",
            ),
            _ => (
                is_subdomain(&m.name),
                "lower case alphanumeric characters, '-' or '.'",
            ),
        };
        if !ok {
            self.err(
                "metadata.name",
                format!("invalid name {:?}: must consist of {what}", m.name),
            );
        }
        if let Some(ns) = &m.namespace
            && !is_label(ns)
        {
            self.err("metadata.namespace", format!("invalid namespace {ns:?}"));
        }
        for (k, val) in &m.labels {
            if let Err(e) = qualified_name(k) {
                self.err(
                    format!("metadata.labels[{k:?}]"),
                    format!("invalid label key: {e}"),
                );
            }
            if let Err(e) = label_value(val) {
                self.err(
                    format!("metadata.labels[{k:?}]"),
                    format!("invalid label value {val:?}: {e}"),
                );
            }
        }
        // Kubernetes' (and so Calico's) limit on an object's annotations, all together.
        let size: usize = m.annotations.iter().map(|(k, v)| k.len() + v.len()).sum();
        if size > MAX_ANNOTATIONS_BYTES {
            self.err(
                "metadata.annotations",
                format!("total size {size} bytes exceeds {MAX_ANNOTATIONS_BYTES}"),
            );
        }
        for k in m.annotations.keys() {
            if let Err(e) = qualified_name(&k.to_ascii_lowercase()) {
                self.err(
                    format!("metadata.annotations[{k:?}]"),
                    format!("invalid annotation key: {e}"),
                );
            }
        }
    }

    fn selector(&mut self, path: &str, s: &str) -> Option<selector::Selector> {
        if self.crd_limits && s.len() > MAX_SELECTOR_LEN {
            self.err(
                path,
                format!(
                    "selector is {} characters long; at most {MAX_SELECTOR_LEN} are allowed",
                    s.len()
                ),
            );
            return None;
        }
        match selector::parse(s) {
            Ok(sel) => Some(sel),
            Err(e) => {
                self.err(path, format!("invalid selector: {e}"));
                None
            }
        }
    }

    /// `global()` is only meaningful as a rule's namespaceSelector.
    fn selector_without_global(&mut self, path: &str, s: &str) {
        self.selector(path, s);
        if s.contains("global()") {
            self.err(
                path,
                "global() can only be used in an EntityRule namespaceSelector",
            );
        }
    }

    fn policy(&mut self, s: &PolicySpec, global: bool) {
        for (field, rules) in [("ingress", &s.ingress), ("egress", &s.egress)] {
            if self.crd_limits && rules.len() > MAX_RULES {
                self.err(
                    format!("spec.{field}"),
                    format!(
                        "{} rules; a policy may have at most {MAX_RULES} {field} rules",
                        rules.len()
                    ),
                );
            }
        }
        if !is_label(&s.tier) {
            self.err("spec.tier", format!("invalid tier name {:?}", s.tier));
        }
        if s.order.is_some_and(|o| !o.is_finite()) {
            self.err("spec.order", "order must be a finite number");
        }
        self.selector_without_global("spec.selector", &s.selector);
        if !s.service_account_selector.is_empty() {
            self.selector_without_global(
                "spec.serviceAccountSelector",
                &s.service_account_selector,
            );
        }
        if global && !s.namespace_selector.is_empty() {
            self.selector_without_global("spec.namespaceSelector", &s.namespace_selector);
        }
        let mut seen = Vec::new();
        for (i, t) in s.types.iter().enumerate() {
            if t != "Ingress" && t != "Egress" {
                self.err(
                    format!("spec.types[{i}]"),
                    format!("unknown policy type {t:?} (expected Ingress or Egress)"),
                );
            } else if seen.contains(&t) {
                self.err(
                    format!("spec.types[{i}]"),
                    format!("{t:?} type specified more than once"),
                );
            }
            seen.push(t);
        }
        for (i, h) in s.performance_hints.iter().enumerate() {
            if h != "AssumeNeededOnEveryNode" {
                self.err(
                    format!("spec.performanceHints[{i}]"),
                    format!("unknown performance hint {h:?}"),
                );
            }
        }
        if global {
            if s.do_not_track && s.pre_dnat {
                self.err("spec.preDNAT", "preDNAT and doNotTrack cannot both be true");
            }
            if s.pre_dnat && !s.egress.is_empty() {
                self.err("spec.egress", "a preDNAT policy cannot have egress rules");
            }
            if s.pre_dnat && s.applies_to_egress() {
                self.err("spec.types", "a preDNAT policy cannot have the Egress type");
            }
            if !s.apply_on_forward && (s.do_not_track || s.pre_dnat) {
                self.err(
                    "spec.applyOnForward",
                    "applyOnForward must be true when preDNAT or doNotTrack is true",
                );
            }
        }
        for (i, r) in s.ingress.iter().enumerate() {
            let p = format!("spec.ingress[{i}]");
            if r.destination.services.is_some() {
                self.err(
                    format!("{p}.destination.services"),
                    "not allowed in an ingress rule destination",
                );
            }
            if global
                && r.source
                    .services
                    .as_ref()
                    .is_some_and(|s| s.namespace.is_empty())
            {
                self.err(
                    format!("{p}.source.services.namespace"),
                    "must specify a namespace in a global policy",
                );
            }
            self.rule(&p, r);
        }
        for (i, r) in s.egress.iter().enumerate() {
            let p = format!("spec.egress[{i}]");
            if r.source.services.is_some() {
                self.err(
                    format!("{p}.source.services"),
                    "not allowed in an egress rule source",
                );
            }
            if r.http.is_some() {
                self.err(
                    format!("{p}.http"),
                    "HTTP matches are not allowed in egress rules",
                );
            }
            if global
                && r.destination
                    .services
                    .as_ref()
                    .is_some_and(|s| s.namespace.is_empty())
            {
                self.err(
                    format!("{p}.destination.services.namespace"),
                    "must specify a namespace in a global policy",
                );
            }
            self.rule(&p, r);
        }
    }

    fn rules(&mut self, prefix: &str, rules: &[Rule]) {
        for (i, r) in rules.iter().enumerate() {
            self.rule(&format!("{prefix}[{i}]"), r);
        }
    }

    fn rule(&mut self, p: &str, r: &Rule) {
        let action = Action::parse(&r.action);
        if action.is_none() {
            self.err(
                format!("{p}.action"),
                format!(
                    "invalid action {:?} (expected Allow, Deny, Log or Pass)",
                    r.action
                ),
            );
        }
        if let Some(v) = r.ip_version
            && v != 4
            && v != 6
        {
            self.err(
                format!("{p}.ipVersion"),
                format!("invalid IP version {v} (expected 4 or 6)"),
            );
        }
        for (f, proto) in [("protocol", &r.protocol), ("notProtocol", &r.not_protocol)] {
            if let Some(proto) = proto
                && !proto.is_valid()
            {
                self.err(
                    format!("{p}.{f}"),
                    format!(
                        "invalid protocol {proto} (expected one of {} or a number 1-255)",
                        Protocol::NAMES.join(", ")
                    ),
                );
            }
        }
        if !r.protocol.as_ref().is_some_and(Protocol::supports_ports) {
            for (f, ports) in [
                ("source.ports", &r.source.ports),
                ("source.notPorts", &r.source.not_ports),
                ("destination.ports", &r.destination.ports),
                ("destination.notPorts", &r.destination.not_ports),
            ] {
                if !ports.is_empty() {
                    self.err(
                        format!("{p}.{f}"),
                        "rules that specify ports must set protocol to TCP, UDP, SCTP or UDPLite",
                    );
                }
            }
        }
        if r.http.is_some() {
            if r.protocol.as_ref().is_some_and(|pr| pr.number() != Some(6)) {
                self.err(
                    format!("{p}.protocol"),
                    "rules that specify HTTP fields must set protocol to TCP or leave it empty",
                );
            }
            if action != Some(Action::Allow) {
                self.err(
                    format!("{p}.http"),
                    "HTTP matches are only valid for Allow rules",
                );
            }
        }
        let is_icmp_proto =
            |pr: &Option<Protocol>| pr.as_ref().is_some_and(|x| x.is_icmp() || x.is_icmpv6());
        if r.icmp.is_some() && !is_icmp_proto(&r.protocol) {
            self.err(
                format!("{p}.icmp"),
                "rules that specify ICMP fields must set protocol to ICMP or ICMPv6",
            );
        }
        if r.not_icmp.is_some() && !is_icmp_proto(&r.protocol) && !is_icmp_proto(&r.not_protocol) {
            self.err(
                format!("{p}.notICMP"),
                "rules that specify ICMP fields must set protocol to ICMP or ICMPv6",
            );
        }
        let any = |f: fn(&Protocol) -> bool| {
            [&r.protocol, &r.not_protocol]
                .iter()
                .any(|x| x.as_ref().is_some_and(f))
        };
        if any(Protocol::is_icmp) && r.ip_version.is_some_and(|v| v != 4) {
            self.err(
                format!("{p}.ipVersion"),
                "must set ipVersion to 4 with protocol ICMP",
            );
        }
        if any(Protocol::is_icmpv6) && r.ip_version.is_some_and(|v| v != 6) {
            self.err(
                format!("{p}.ipVersion"),
                "must set ipVersion to 6 with protocol ICMPv6",
            );
        }
        for (f, icmp) in [("icmp", &r.icmp), ("notICMP", &r.not_icmp)] {
            if let Some(icmp) = icmp {
                self.icmp(&format!("{p}.{f}"), icmp);
            }
        }
        // All CIDRs of one rule must share one IP version (and match ipVersion when set).
        let (mut seen4, mut seen6) = (false, false);
        for (f, nets) in [
            ("source.nets", &r.source.nets),
            ("source.notNets", &r.source.not_nets),
            ("destination.nets", &r.destination.nets),
            ("destination.notNets", &r.destination.not_nets),
        ] {
            let (mut v4, mut v6) = (false, false);
            for (i, n) in nets.iter().enumerate() {
                match parse_cidr_or_ip(n) {
                    None => self.err(format!("{p}.{f}[{i}]"), format!("invalid CIDR {n:?}")),
                    Some(net) => {
                        if net.network() != net.ip() {
                            self.err(
                                format!("{p}.{f}[{i}]"),
                                format!(
                                    "CIDR {n:?} is not strictly masked (did you mean {}/{}?)",
                                    net.network(),
                                    net.prefix()
                                ),
                            );
                        }
                        v4 |= net.is_ipv4();
                        v6 |= net.is_ipv6();
                    }
                }
            }
            if r.ip_version
                .is_some_and(|v| (v4 && v != 4) || (v6 && v != 6))
            {
                self.err(
                    format!("{p}.{f}"),
                    "rule IP version doesn't match CIDR version",
                );
            }
            if (v4 && seen6) || (v6 && seen4) || (v4 && v6) {
                self.err(format!("{p}.{f}"), "rule contains both IPv4 and IPv6 CIDRs");
            }
            seen4 |= v4;
            seen6 |= v6;
        }
        self.entity(&format!("{p}.source"), &r.source);
        self.entity(&format!("{p}.destination"), &r.destination);
        if r.destination.services.is_some() && !r.destination.ports.is_empty() {
            self.err(
                format!("{p}.destination.ports"),
                "cannot specify ports with a service match",
            );
        }
        if r.destination.services.is_some() && !r.destination.not_ports.is_empty() {
            self.err(
                format!("{p}.destination.notPorts"),
                "cannot specify notPorts with a service match",
            );
        }
        if let Some(m) = &r.metadata {
            // Calico's limit on annotations (Kubernetes' total size rule).
            let size: usize = m.annotations.iter().map(|(k, v)| k.len() + v.len()).sum();
            if size > MAX_ANNOTATIONS_BYTES {
                self.err(
                    format!("{p}.metadata.annotations"),
                    format!("total size {size} bytes exceeds {MAX_ANNOTATIONS_BYTES}"),
                );
            }
            for k in m.annotations.keys() {
                if let Err(e) = qualified_name(&k.to_ascii_lowercase()) {
                    self.err(
                        format!("{p}.metadata.annotations[{k:?}]"),
                        format!("invalid annotation key: {e}"),
                    );
                }
            }
        }
    }

    fn icmp(&mut self, p: &str, icmp: &IcmpFields) {
        if icmp.code.is_some() && icmp.icmp_type.is_none() {
            self.err(
                format!("{p}.code"),
                "ICMP code specified without an ICMP type",
            );
        }
        if let Some(t) = icmp.icmp_type
            && !(0..=254).contains(&t)
        {
            self.err(
                format!("{p}.type"),
                format!("ICMP type {t} out of range 0-254"),
            );
        }
        if let Some(c) = icmp.code
            && !(0..=255).contains(&c)
        {
            self.err(
                format!("{p}.code"),
                format!("ICMP code {c} out of range 0-255"),
            );
        }
    }

    fn entity(&mut self, p: &str, e: &EntityRule) {
        if !e.selector.is_empty() {
            self.selector_without_global(&format!("{p}.selector"), &e.selector);
        }
        if !e.not_selector.is_empty() {
            self.selector_without_global(&format!("{p}.notSelector"), &e.not_selector);
        }
        if !e.namespace_selector.is_empty() {
            let path = format!("{p}.namespaceSelector");
            if let Some(sel) = self.selector(&path, &e.namespace_selector)
                && sel.canonical().contains("global()")
                && sel.canonical() != "global()"
            {
                self.err(path, "global() cannot be combined with other selectors");
            }
        }
        if let Some(sa) = &e.service_accounts
            && !sa.selector.is_empty()
        {
            self.selector_without_global(&format!("{p}.serviceAccounts.selector"), &sa.selector);
        }
        if let Some(svc) = &e.services {
            let sp = format!("{p}.services");
            if svc.name.is_empty() {
                self.err(format!("{sp}.name"), "must specify a service name");
            }
            if !e.namespace_selector.is_empty() {
                self.err(
                    &sp,
                    "cannot specify namespaceSelector and services on the same rule",
                );
            }
            if !e.selector.is_empty() || !e.not_selector.is_empty() {
                self.err(
                    &sp,
                    "cannot specify selector/notSelector and services on the same rule",
                );
            }
            if e.service_accounts.is_some() {
                self.err(
                    &sp,
                    "cannot specify serviceAccounts and services on the same rule",
                );
            }
            if !e.nets.is_empty() || !e.not_nets.is_empty() {
                self.err(
                    &sp,
                    "cannot specify nets/notNets and services on the same rule",
                );
            }
        }
        for (f, ports) in [("ports", &e.ports), ("notPorts", &e.not_ports)] {
            for (i, port) in ports.iter().enumerate() {
                match port {
                    Port::Invalid(s) => self.err(
                        format!("{p}.{f}[{i}]"),
                        format!("invalid port {s:?} (expected a number 0-65535, a \"min:max\" range with min <= max, or a port name)"),
                    ),
                    Port::Named(n) => {
                        if let Err(why) = port_name(n) {
                            self.err(format!("{p}.{f}[{i}]"), format!("invalid port name {n:?}: {why}"));
                        }
                    }
                    Port::Range { .. } => {}
                }
            }
        }
    }

    /// The FelixConfiguration fields that reach the kernel through the agent, checked as
    /// Calico's validator and Felix's config parser do: a value outside their character sets
    /// and ranges would otherwise be written into restore input.
    fn felix_configuration(&mut self, spec: &BTreeMap<String, serde_json::Value>) {
        let text = |v: &serde_json::Value| v.as_str().map(str::to_owned);
        if let Some(v) = spec.get("logPrefix") {
            match text(v).map(|p| log_prefix(&p)) {
                Some(Ok(())) => {}
                Some(Err(reason)) => self.err("spec.logPrefix", reason.to_string()),
                None => self.err("spec.logPrefix", "must be a string"),
            }
        }
        if let Some(v) = spec.get("interfacePrefix") {
            match text(v) {
                None => self.err("spec.interfacePrefix", "must be a string"),
                Some(list) => {
                    let prefixes: Vec<&str> = list
                        .split(',')
                        .map(str::trim)
                        .filter(|p| !p.is_empty())
                        .collect();
                    if prefixes.is_empty() {
                        self.err(
                            "spec.interfacePrefix",
                            "must name at least one interface prefix",
                        );
                    }
                    for reason in prefixes
                        .into_iter()
                        .filter_map(|p| interface_prefix(p).err())
                    {
                        self.err("spec.interfacePrefix", reason.to_string());
                    }
                }
            }
        }
        for field in ["failsafeInboundHostPorts", "failsafeOutboundHostPorts"] {
            let Some(v) = spec.get(field) else { continue };
            let Some(list) = v.as_array() else {
                if !v.is_null() {
                    self.err(
                        format!("spec.{field}"),
                        "must be a list of {protocol, port}",
                    );
                }
                continue;
            };
            for (i, item) in list.iter().enumerate() {
                let proto = item
                    .get("protocol")
                    .and_then(|p| p.as_str())
                    .unwrap_or("TCP");
                if !matches!(proto.to_ascii_uppercase().as_str(), "TCP" | "UDP" | "SCTP") {
                    self.err(
                        format!("spec.{field}[{i}].protocol"),
                        format!("{proto:?} must be TCP, UDP or SCTP"),
                    );
                }
                if item
                    .get("port")
                    .and_then(|p| p.as_u64())
                    .is_none_or(|p| p > 65535)
                {
                    self.err(
                        format!("spec.{field}[{i}].port"),
                        "must be a port number 0 to 65535",
                    );
                }
            }
        }
        if let Some(v) = spec.get("defaultEndpointToHostAction")
            && !matches!(v.as_str(), Some("Drop" | "Accept" | "Return"))
        {
            self.err(
                "spec.defaultEndpointToHostAction",
                format!("{v} must be Drop, Accept or Return"),
            );
        }
    }

    fn tier(&mut self, s: &TierSpec) {
        if s.order.is_some_and(|o| !o.is_finite()) {
            self.err("spec.order", "order must be a finite number");
        }
        if s.default_action != "Deny" && s.default_action != "Pass" {
            self.err(
                "spec.defaultAction",
                format!(
                    "invalid default action {:?} (expected Deny or Pass)",
                    s.default_action
                ),
            );
        }
    }

    fn profile(&mut self, s: &ProfileSpec) {
        self.rules("spec.ingress", &s.ingress);
        self.rules("spec.egress", &s.egress);
        for (k, v) in &s.labels_to_apply {
            if let Err(e) = qualified_name(k) {
                self.err(
                    format!("spec.labelsToApply[{k:?}]"),
                    format!("invalid label key: {e}"),
                );
            }
            if let Err(e) = label_value(v) {
                self.err(
                    format!("spec.labelsToApply[{k:?}]"),
                    format!("invalid label value {v:?}: {e}"),
                );
            }
        }
    }

    fn endpoint_ports(&mut self, ports: &[EndpointPort], workload: bool) {
        for (i, port) in ports.iter().enumerate() {
            let p = format!("spec.ports[{i}]");
            if !port
                .protocol
                .as_ref()
                .is_some_and(|pr| pr.is_valid() && pr.supports_ports())
            {
                self.err(
                    format!("{p}.protocol"),
                    "endpoint port protocol must be TCP, UDP, SCTP or UDPLite",
                );
            }
            if !(0..=65535).contains(&port.port) {
                self.err(
                    format!("{p}.port"),
                    format!("port {} out of range 0-65535", port.port),
                );
            }
            let needs_name = !workload || port.host_port.unwrap_or(0) == 0;
            if port.name.is_empty() {
                if needs_name {
                    self.err(format!("{p}.name"), "a port must have a name");
                }
            } else if let Err(why) = port_name(&port.name) {
                self.err(
                    format!("{p}.name"),
                    format!("invalid port name {:?}: {why}", port.name),
                );
            }
        }
    }

    fn workload_endpoint(&mut self, s: &WorkloadEndpointSpec) {
        if s.node.is_empty() {
            self.err(
                "spec.node",
                "required: the endpoint must name the node it runs on",
            );
        } else if !is_subdomain(&s.node) {
            self.err("spec.node", format!("invalid node name {:?}", s.node));
        }
        if !s.interface_name.is_empty() && !is_interface(&s.interface_name) {
            self.err(
                "spec.interfaceName",
                format!(
                    "invalid interface name {:?} (1-15 of [a-zA-Z0-9_.-])",
                    s.interface_name
                ),
            );
        }
        if !s.mac.is_empty() && !is_mac(&s.mac) {
            self.err("spec.mac", format!("invalid MAC address {:?}", s.mac));
        }
        for (i, n) in s.ip_networks.iter().enumerate() {
            if parse_cidr_or_ip(n).is_none() {
                self.err(
                    format!("spec.ipNetworks[{i}]"),
                    format!("invalid CIDR {n:?}"),
                );
            }
        }
        for (i, n) in s.allow_spoofed_source_prefixes.iter().enumerate() {
            if parse_cidr_or_ip(n).is_none() {
                self.err(
                    format!("spec.allowSpoofedSourcePrefixes[{i}]"),
                    format!("invalid CIDR {n:?}"),
                );
            }
        }
        for (i, nat) in s.ip_nats.iter().enumerate() {
            for (f, ip) in [
                ("internalIP", &nat.internal_ip),
                ("externalIP", &nat.external_ip),
            ] {
                if ip.parse::<IpAddr>().is_err() {
                    self.err(
                        format!("spec.ipNATs[{i}].{f}"),
                        format!("invalid IP address {ip:?}"),
                    );
                }
            }
            let inside = nat.internal_ip.parse::<IpAddr>().ok().is_some_and(|ip| {
                s.ip_networks
                    .iter()
                    .filter_map(|n| parse_cidr_or_ip(n))
                    .any(|n| n.contains(ip))
            });
            if !inside {
                self.err(
                    format!("spec.ipNATs[{i}].internalIP"),
                    "NAT is not in the endpoint networks",
                );
            }
        }
        for (i, prof) in s.profiles.iter().enumerate() {
            if !is_subdomain(prof) {
                self.err(
                    format!("spec.profiles[{i}]"),
                    format!("invalid profile name {prof:?}"),
                );
            }
        }
        self.endpoint_ports(&s.ports, true);
    }

    fn host_endpoint(&mut self, s: &HostEndpointSpec) {
        if s.interface_name.is_empty() && s.expected_ips.is_empty() {
            self.err(
                "spec.interfaceName",
                "no interface or expected IPs have been specified",
            );
        }
        if !s.interface_name.is_empty()
            && s.interface_name != "*"
            && !is_interface(&s.interface_name)
        {
            self.err(
                "spec.interfaceName",
                format!("invalid interface name {:?}", s.interface_name),
            );
        }
        if s.node.is_empty() {
            self.err("spec.node", "no node has been specified");
        }
        for (i, ip) in s.expected_ips.iter().enumerate() {
            if ip.parse::<IpAddr>().is_err() {
                self.err(
                    format!("spec.expectedIPs[{i}]"),
                    format!("invalid IP address {ip:?}"),
                );
            }
        }
        for (i, prof) in s.profiles.iter().enumerate() {
            if !is_subdomain(prof) {
                self.err(
                    format!("spec.profiles[{i}]"),
                    format!("invalid profile name {prof:?}"),
                );
            }
        }
        self.endpoint_ports(&s.ports, false);
    }

    fn network_set(&mut self, m: &ObjectMeta, s: &NetworkSetSpec) {
        if m.labels.contains_key("projectcalico.org/namespace") {
            self.err(
                "metadata.labels[\"projectcalico.org/namespace\"]",
                "projectcalico.org/namespace is reserved: it is derived from the object's namespace",
            );
        }
        for (i, n) in s.nets.iter().enumerate() {
            if parse_cidr_or_ip(n).is_none() {
                self.err(format!("spec.nets[{i}]"), format!("invalid CIDR {n:?}"));
            }
        }
    }

    /// What Kubernetes checks of the fields Felix reads: port numbers. Addresses are not
    /// checked: Felix skips one it cannot parse (an `FQDN` slice's names, say).
    fn endpoint_slice(&mut self, s: &EndpointSliceSpec) {
        // Kubernetes' own caps (the API server refuses more): they bound the members one
        // slice adds to a Service's IP sets (endpoints × addresses × ports).
        if s.endpoints.len() > MAX_SLICE_ENDPOINTS {
            self.err(
                "endpoints",
                format!(
                    "{} endpoints; an EndpointSlice holds at most {MAX_SLICE_ENDPOINTS}",
                    s.endpoints.len()
                ),
            );
        }
        for (i, e) in s.endpoints.iter().enumerate() {
            if e.addresses.len() > MAX_SLICE_ADDRESSES {
                self.err(
                    format!("endpoints[{i}].addresses"),
                    format!(
                        "{} addresses; an endpoint has at most {MAX_SLICE_ADDRESSES}",
                        e.addresses.len()
                    ),
                );
            }
        }
        if s.ports.len() > MAX_SLICE_PORTS {
            self.err(
                "ports",
                format!(
                    "{} ports; an EndpointSlice has at most {MAX_SLICE_PORTS}",
                    s.ports.len()
                ),
            );
        }
        for (i, p) in s.ports.iter().enumerate() {
            if let Some(n) = p.port
                && !(1..=65535).contains(&n)
            {
                self.err(
                    format!("ports[{i}].port"),
                    format!("invalid port {n}: must be 1-65535"),
                );
            }
        }
    }

    /// What Kubernetes checks of the fields flow logs read: addresses (`None` and empty
    /// allowed: a headless Service), port numbers and protocols, and bounds on the lists.
    fn service(&mut self, s: &ServiceSpec) {
        const MAX_IPS: usize = 16;
        const MAX_PORTS: usize = 256;
        let ips = std::iter::once(("spec.clusterIP".to_string(), &s.cluster_ip))
            .chain(
                s.cluster_ips
                    .iter()
                    .enumerate()
                    .map(|(i, a)| (format!("spec.clusterIPs[{i}]"), a)),
            )
            .chain(
                s.external_ips
                    .iter()
                    .enumerate()
                    .map(|(i, a)| (format!("spec.externalIPs[{i}]"), a)),
            );
        for (field, a) in ips {
            if !a.is_empty() && a != "None" && a.parse::<IpAddr>().is_err() {
                self.err(field, format!("{a:?} is not an IP address"));
            }
        }
        for (field, n) in [
            ("spec.clusterIPs", s.cluster_ips.len()),
            ("spec.externalIPs", s.external_ips.len()),
        ] {
            if n > MAX_IPS {
                self.err(field, format!("{n} addresses; at most {MAX_IPS} are read"));
            }
        }
        if s.ports.len() > MAX_PORTS {
            self.err(
                "spec.ports",
                format!("{} ports; at most {MAX_PORTS} are read", s.ports.len()),
            );
        }
        for (i, p) in s.ports.iter().enumerate() {
            if !(1..=65535).contains(&p.port) {
                self.err(
                    format!("spec.ports[{i}].port"),
                    format!("invalid port {}: must be 1-65535", p.port),
                );
            }
            if let Some(n) = p.node_port
                && !(0..=65535).contains(&n)
            {
                self.err(
                    format!("spec.ports[{i}].nodePort"),
                    format!("invalid port {n}: must be 0-65535"),
                );
            }
            if !matches!(p.protocol.as_str(), "" | "TCP" | "UDP" | "SCTP") {
                self.err(
                    format!("spec.ports[{i}].protocol"),
                    format!("{:?}: TCP, UDP or SCTP", p.protocol),
                );
            }
            if p.name.len() > 63 {
                self.err(
                    format!("spec.ports[{i}].name"),
                    "longer than 63 characters".to_string(),
                );
            }
        }
    }

    fn ip_pool(&mut self, s: &IpPoolSpec) {
        let Some(net) = parse_cidr_or_ip(&s.cidr) else {
            self.err(
                "spec.cidr",
                format!("IP pool CIDR must be a valid subnet, got {:?}", s.cidr),
            );
            return;
        };
        if net.network() != net.ip() {
            self.err("spec.cidr", "IP pool CIDR is not strictly masked");
        }
        for (f, mode) in [("ipipMode", &s.ipip_mode), ("vxlanMode", &s.vxlan_mode)] {
            if !["", "Never", "Always", "CrossSubnet"].contains(&mode.as_str()) {
                self.err(
                    format!("spec.{f}"),
                    format!("invalid mode {mode:?} (expected Always, CrossSubnet or Never)"),
                );
            } else if net.is_ipv6() && !mode.is_empty() && mode != "Never" && f == "ipipMode" {
                self.err(format!("spec.{f}"), "IPIP is not supported on an IPv6 pool");
            }
        }
        let enabled = |m: &str| m == "Always" || m == "CrossSubnet";
        if enabled(&s.ipip_mode) && enabled(&s.vxlan_mode) {
            self.err(
                "spec.ipipMode",
                "IPIP and VXLAN cannot both be enabled on the same IP pool",
            );
        }
        let block = s.block_size.unwrap_or(if net.is_ipv4() { 26 } else { 122 });
        let max = if net.is_ipv4() { 32 } else { 128 };
        if !(0..=max).contains(&block) {
            self.err(
                "spec.blockSize",
                format!("block size {block} out of range 0-{max}"),
            );
        } else if !s.disabled && i64::from(net.prefix()) > block {
            self.err("spec.cidr", "IP pool is smaller than its block size");
        }
        let link_local: IpNetwork = if net.is_ipv4() {
            "169.254.0.0/16".parse().expect("constant")
        } else {
            "fe80::/10".parse().expect("constant")
        };
        if link_local.contains(net.network()) || net.contains(link_local.network()) {
            self.err(
                "spec.cidr",
                format!("IP pool range overlaps with the link-local range {link_local}"),
            );
        }
        for (i, u) in s.allowed_uses.iter().enumerate() {
            if !["Workload", "Tunnel", "LoadBalancer"].contains(&u.as_str()) {
                self.err(
                    format!("spec.allowedUses[{i}]"),
                    format!("unknown use {u:?}"),
                );
            }
        }
        if !s.node_selector.is_empty() {
            self.selector("spec.nodeSelector", &s.node_selector);
        }
    }
}

/// A CIDR or a bare IP (taken as /32 or /128), as Calico's `ParseCIDROrIP`.
pub fn parse_cidr_or_ip(s: &str) -> Option<IpNetwork> {
    if s.contains('/') {
        s.parse::<IpNetwork>().ok()
    } else {
        s.parse::<IpAddr>().ok().map(IpNetwork::from)
    }
}

/// DNS-1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// DNS-1123 subdomain: dot-separated labels, at most 253 characters.
pub fn is_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= DNS1123_SUBDOMAIN_MAX
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

// Shared with the agent, which re-checks the same settings on the stream it receives.
use calico_names::validate::is_interface_name as is_interface;
pub use calico_names::validate::{interface_prefix, log_prefix, shown};

fn is_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split([':', '-']).collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|c| c.is_ascii_hexdigit()))
}

/// The character rule of a label value and of a qualified name's name part.
const LABEL_CHARACTERS: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";

/// Why a label key (a qualified name) or a label value breaks Kubernetes' rules.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("prefix {0:?} must be a DNS subdomain")]
    Prefix(String),
    #[error("name part must not be empty")]
    EmptyName,
    #[error("name part must be no more than 63 characters")]
    LongName,
    #[error("name part {LABEL_CHARACTERS}")]
    NameCharacters,
    #[error("must be no more than 63 characters")]
    LongValue,
    #[error("{LABEL_CHARACTERS}")]
    ValueCharacters,
}

/// Kubernetes' qualified-name rule for label and annotation keys: `[prefix/]name`.
pub fn qualified_name(s: &str) -> Result<(), LabelError> {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if let Some(p) = prefix
        && !is_subdomain(&p.to_ascii_lowercase())
    {
        return Err(LabelError::Prefix(p.to_owned()));
    }
    if name.is_empty() {
        return Err(LabelError::EmptyName);
    }
    if name.len() > 63 {
        return Err(LabelError::LongName);
    }
    if !label_chars(name) {
        return Err(LabelError::NameCharacters);
    }
    Ok(())
}

/// Kubernetes' label-value rule: empty, or up to 63 of `[A-Za-z0-9_.-]` starting and ending
/// alphanumeric.
pub fn label_value(s: &str) -> Result<(), LabelError> {
    if s.is_empty() {
        return Ok(());
    }
    if s.len() > 63 {
        return Err(LabelError::LongValue);
    }
    if !label_chars(s) {
        return Err(LabelError::ValueCharacters);
    }
    Ok(())
}

/// Whether a non-empty `s` keeps [`LABEL_CHARACTERS`].
fn label_chars(s: &str) -> bool {
    let b = s.as_bytes();
    let ok_inner = b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
    ok_inner && b[0].is_ascii_alphanumeric() && b[b.len() - 1].is_ascii_alphanumeric()
}

/// IANA service name, as Kubernetes validates port names: 1-15 of `[a-z0-9-]`, at least one
/// letter, no leading, trailing or doubled '-'.
pub fn port_name(s: &str) -> Result<(), &'static str> {
    if s.is_empty() || s.len() > 15 {
        return Err("must be 1-15 characters");
    }
    if !s
        .bytes()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
    {
        return Err("must contain only lower-case letters, digits and '-'");
    }
    if !s.bytes().any(|c| c.is_ascii_lowercase()) {
        return Err("must contain at least one letter");
    }
    if s.starts_with('-') || s.ends_with('-') || s.contains("--") {
        return Err("must not begin or end with '-' or contain '--'");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Decoded;
    use serde_json::json;

    fn check(v: serde_json::Value) -> Result<(), Invalid> {
        match Resource::from_value(v).expect("decodes") {
            Decoded::Resource(_, r) => validate(&r),
            Decoded::Ignored(..) => panic!("ignored"),
        }
    }

    fn paths(r: Result<(), Invalid>) -> Vec<String> {
        r.unwrap_err().errors.into_iter().map(|e| e.field).collect()
    }

    #[test]
    fn calicos_limits_on_rules_and_selectors() {
        let rules = |n: usize| vec![json!({"action": "Allow"}); n];
        assert!(
            check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
                "metadata": {"name": "p"},
                "spec": {"ingress": rules(MAX_RULES), "egress": rules(MAX_RULES)}
            }))
            .is_ok()
        );
        let err = check(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": "prod"},
            "spec": {"ingress": rules(MAX_RULES + 1), "egress": rules(MAX_RULES + 1)}
        }))
        .unwrap_err();
        assert_eq!(
            err.errors
                .iter()
                .map(|e| e.field.as_str())
                .collect::<Vec<_>>(),
            ["spec.ingress", "spec.egress"]
        );
        assert!(err.errors[0].reason.contains("at most 1024"), "{err}");
        let long = format!("a == '{}'", "x".repeat(MAX_SELECTOR_LEN));
        let err = check(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "p"},
            "spec": {"selector": long, "ingress": [{"action": "Allow", "source": {"selector": long}}]}
        }))
        .unwrap_err();
        assert_eq!(
            paths(Err(err.clone())),
            ["spec.selector", "spec.ingress[0].source.selector"]
        );
        assert!(err.errors[0].reason.contains("at most 1024"), "{err}");
        let fits = format!("a == '{}'", "x".repeat(MAX_SELECTOR_LEN - 7));
        assert_eq!(fits.len(), MAX_SELECTOR_LEN);
        assert!(
            check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
                "metadata": {"name": "p"}, "spec": {"selector": fits}
            }))
            .is_ok()
        );
    }

    #[test]
    fn converted_kubernetes_policies_are_not_held_to_the_crd_caps() {
        // A Kubernetes selector converts to more than 1,024 characters; Calico's conversion
        // checks no sizes, and refusing the policy would drop what it isolates.
        let values: Vec<String> = (0..200).map(|i| format!("value-{i:03}")).collect();
        assert!(
            check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "StagedKubernetesNetworkPolicy",
                "metadata": {"name": "many.values", "namespace": "ns"},
                "spec": {"podSelector": {"matchExpressions": [
                    {"key": "app", "operator": "In", "values": values}]}}
            }))
            .is_ok()
        );
        let long = format!("a == '{}'", "x".repeat(MAX_SELECTOR_LEN));
        assert!(
            check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
                "metadata": {"name": "knp.default.long", "namespace": "ns"},
                "spec": {"selector": long}
            }))
            .is_ok()
        );
    }

    #[test]
    fn endpoint_slices_are_held_to_kubernetes_caps() {
        let slice = |endpoints: usize, addresses: usize, ports: usize| {
            json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "s", "namespace": "ns",
                             "labels": {"kubernetes.io/service-name": "svc"}},
                "addressType": "IPv4",
                "endpoints": vec![json!({"addresses": vec!["10.0.0.1"; addresses]}); endpoints],
                "ports": vec![json!({"port": 80, "protocol": "TCP"}); ports],
            })
        };
        assert!(
            check(slice(
                MAX_SLICE_ENDPOINTS,
                MAX_SLICE_ADDRESSES,
                MAX_SLICE_PORTS
            ))
            .is_ok()
        );
        assert_eq!(
            paths(check(slice(
                MAX_SLICE_ENDPOINTS + 1,
                1,
                MAX_SLICE_PORTS + 1
            ))),
            ["endpoints", "ports"]
        );
        assert_eq!(
            paths(check(slice(1, MAX_SLICE_ADDRESSES + 1, 1))),
            ["endpoints[0].addresses"]
        );
    }

    #[test]
    fn staged_actions_are_calicos() {
        for action in ["", "Set", "Delete", "Learn", "Ignore"] {
            assert!(
                check(json!({
                    "apiVersion": "projectcalico.org/v3", "kind": "StagedGlobalNetworkPolicy",
                    "metadata": {"name": "p"}, "spec": {"stagedAction": action}
                }))
                .is_ok(),
                "{action}"
            );
        }
        assert_eq!(
            paths(check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "StagedNetworkPolicy",
                "metadata": {"name": "p", "namespace": "ns"}, "spec": {"stagedAction": "Maybe"}
            }))),
            ["spec.stagedAction"]
        );
    }

    #[test]
    fn valid_policy_passes() {
        check(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
            "metadata": {"name": "allow-frontend", "namespace": "prod"},
            "spec": {"order": 100, "selector": "app == 'backend'",
                     "ingress": [{"action": "Allow", "protocol": "TCP",
                                  "source": {"selector": "role == 'frontend'"},
                                  "destination": {"ports": [8080, "http", "9000:9100"]}}]}
        }))
        .unwrap();
    }

    #[test]
    fn every_problem_is_reported_with_its_path() {
        let err = check(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "Bad_Name"},
            "spec": {"selector": "app ==", "preDNAT": true, "types": ["Ingress", "Ingress"],
                     "ingress": [{"action": "allow",
                                  "source": {"nets": ["10.0.0.1/8", "fd00::/8"], "ports": [80]},
                                  "icmp": {"code": 3}}],
                     "egress": [{"action": "Deny"}]}
        }))
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("GlobalNetworkPolicy Bad_Name is invalid: "),
            "{msg}"
        );
        let p: Vec<&str> = err.errors.iter().map(|e| e.field.as_str()).collect();
        for want in [
            "metadata.name",
            "spec.selector",
            "spec.types[1]",
            "spec.egress",
            "spec.applyOnForward",
            "spec.ingress[0].action",
            "spec.ingress[0].source.ports",
            "spec.ingress[0].icmp",
            "spec.ingress[0].icmp.code",
            "spec.ingress[0].source.nets[0]",
            "spec.ingress[0].source.nets",
        ] {
            assert!(p.contains(&want), "missing {want} in {p:?}");
        }
    }

    #[test]
    fn selector_errors_say_where() {
        let err = check(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "p"}, "spec": {"selector": "a == 'b' && ("}
        }))
        .unwrap_err();
        assert_eq!(err.errors.len(), 1);
        assert!(
            err.errors[0].reason.starts_with("invalid selector:"),
            "{}",
            err.errors[0].reason
        );
    }

    #[test]
    fn global_selector_only_in_namespace_selector() {
        assert_eq!(
            paths(check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
                "metadata": {"name": "p"},
                "spec": {"selector": "global()",
                         "ingress": [{"action": "Allow", "source": {"namespaceSelector": "global() && a == 'b'"}},
                                     {"action": "Allow", "source": {"namespaceSelector": "global()"}}]}
            }))),
            vec!["spec.selector", "spec.ingress[0].source.namespaceSelector"]
        );
    }

    #[test]
    fn icmp_and_ip_version_must_agree() {
        assert_eq!(
            paths(check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
                "metadata": {"name": "p"},
                "spec": {"ingress": [{"action": "Allow", "protocol": "ICMPv6", "ipVersion": 4,
                                      "icmp": {"type": 255}}]}
            }))),
            vec!["spec.ingress[0].ipVersion", "spec.ingress[0].icmp.type"]
        );
    }

    #[test]
    fn endpoints_need_a_node_and_valid_addresses() {
        assert_eq!(
            paths(check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
                "metadata": {"name": "wep", "namespace": "ns"},
                "spec": {"ipNetworks": ["10.0.0.300/32"], "interfaceName": "cali-much-too-long-name",
                         "mac": "zz", "ports": [{"name": "HTTP", "protocol": "ICMP", "port": 80}]}
            }))),
            vec![
                "spec.node",
                "spec.interfaceName",
                "spec.mac",
                "spec.ipNetworks[0]",
                "spec.ports[0].protocol",
                "spec.ports[0].name"
            ]
        );
        assert_eq!(
            paths(check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "HostEndpoint",
                "metadata": {"name": "hep"}, "spec": {}
            }))),
            vec!["spec.interfaceName", "spec.node"]
        );
    }

    #[test]
    fn tiers_pools_and_sets() {
        assert_eq!(
            paths(check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "Tier",
                "metadata": {"name": "a.b"}, "spec": {"defaultAction": "Allow"}
            }))),
            vec!["metadata.name", "spec.defaultAction"]
        );
        assert_eq!(
            paths(check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "IPPool",
                "metadata": {"name": "pool"},
                "spec": {"cidr": "10.0.0.1/16", "ipipMode": "Always", "vxlanMode": "Always"}
            }))),
            vec!["spec.cidr", "spec.ipipMode"]
        );
        assert_eq!(
            paths(check(json!({
                "apiVersion": "projectcalico.org/v3", "kind": "NetworkSet",
                "metadata": {"name": "ns1", "labels": {"projectcalico.org/namespace": "x"}},
                "spec": {"nets": ["10.0.0.0/8", "bogus"]}
            }))),
            vec![
                "metadata.labels[\"projectcalico.org/namespace\"]",
                "spec.nets[1]"
            ]
        );
    }

    #[test]
    fn felix_configuration_fields_that_reach_the_kernel() {
        let ok = serde_json::json!({"apiVersion": "projectcalico.org/v3", "kind": "FelixConfiguration",
            "metadata": {"name": "default"},
            "spec": {"logPrefix": "calico-drop", "interfacePrefix": "cali,tap",
                     "failsafeInboundHostPorts": [{"protocol": "TCP", "port": 22}],
                     "defaultEndpointToHostAction": "Accept"}});
        assert!(check(ok).is_ok());
        let bad = serde_json::json!({"apiVersion": "projectcalico.org/v3", "kind": "FelixConfiguration",
            "metadata": {"name": "default"},
            "spec": {"logPrefix": "x\"\n-I INPUT 1 -j ACCEPT", "interfacePrefix": "cali,lo",
                     "failsafeInboundHostPorts": [{"protocol": "TCP", "port": 70000}],
                     "defaultEndpointToHostAction": "Allow"}});
        assert_eq!(
            paths(check(bad)),
            [
                "spec.logPrefix",
                "spec.interfacePrefix",
                "spec.failsafeInboundHostPorts[0].port",
                "spec.defaultEndpointToHostAction"
            ]
        );
    }

    #[test]
    fn name_rules() {
        assert!(is_label("a-1") && !is_label("-a") && !is_label("A") && !is_label(""));
        assert!(is_subdomain("kns.default") && !is_subdomain("a..b"));
        assert!(qualified_name("projectcalico.org/namespace").is_ok());
        assert!(qualified_name("a/b/c").is_err());
        assert!(label_value("").is_ok() && label_value("-x").is_err());
        assert_eq!(
            qualified_name("a/-b").unwrap_err().to_string(),
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start \
             and end with an alphanumeric character"
        );
        assert_eq!(
            qualified_name("Bad_Prefix/x").unwrap_err().to_string(),
            "prefix \"Bad_Prefix\" must be a DNS subdomain"
        );
        assert!(
            port_name("http").is_ok() && port_name("80").is_err() && port_name("a--b").is_err()
        );
    }

    #[test]
    fn service_fields_flow_logs_read_are_checked() {
        let svc = |spec: serde_json::Value| {
            check(json!({"apiVersion": "v1", "kind": "Service",
                         "metadata": {"name": "web", "namespace": "shop"}, "spec": spec}))
        };
        assert!(svc(json!({"clusterIP": "None", "ports": [{"port": 80}]})).is_ok());
        assert_eq!(
            paths(svc(json!({
                "clusterIP": "10.96.0.300", "externalIPs": ["x"],
                "ports": [{"port": 0}, {"port": 53, "protocol": "QUIC", "nodePort": 70000}]
            }))),
            [
                "spec.clusterIP",
                "spec.externalIPs[0]",
                "spec.ports[0].port",
                "spec.ports[1].nodePort",
                "spec.ports[1].protocol"
            ]
        );
    }
}
