//! Policy recommendations (issue 45): from the flows a namespace's workloads made and received
//! to least-privilege `StagedNetworkPolicy` objects, and back again: which flows a staged
//! policy would deny that the enforced policies allow ([`check`]), and the enforced form of a
//! staged policy ([`promote`]). Pure: no IO, no clock; the caller lists the flows (Goldmane
//! records, one per key and 15 s interval) and the inventory (pods, network sets) and gets
//! values back. Every string of a flow or of the inventory is hostile: label keys and values
//! are checked before they reach a selector, and what cannot be expressed is left out and
//! said so, never written.
//!
//! # Groups
//! A policy is recommended per workload group of the namespace: the pods sharing the first of
//! the labels `app.kubernetes.io/name`, `app`, `k8s-app` (the names Kubernetes, Helm and the
//! cluster add-ons use for "the application"), selected by that one label; else the pods of
//! one owner, named by their `generateName` (a ReplicaSet's `web-7d9f8c6b5-` is the
//! Deployment `web`: the `pod-template-hash` is cut; a StatefulSet's `db-0` is `db`),
//! selected by the labels all of them share, less the per-revision ones (`pod-template-hash`,
//! `controller-revision-hash`, …) and Calico's own (`projectcalico.org/…`, and the `pcns.`/
//! `pcsa.` copies of namespace and service-account labels). A label group's
//! selector leaves out pods grouped by an earlier label that carry its label too
//! (`&& !has(app.kubernetes.io/name)`, only when the inventory holds one); a selector that
//! still selects another group's pods is named in the notes. A flow's side is put
//! in a group the same way, from the labels and the aggregated name (`web-7d9f8c6b5-*`) the
//! flow carries.
//!
//! # Rules
//! Egress rules come from the flows the namespace's workloads reported as source, ingress
//! rules from those they reported as destination: one `Allow` rule per peer and protocol,
//! listing the destination ports seen (by name when every pod of the destination group that
//! declares that port calls it by the same name). Peers: a group of the same namespace by its
//! selector; of another namespace with `namespaceSelector: projectcalico.org/name == '<ns>'`;
//! a NetworkSet by its labels (a GlobalNetworkSet with `namespaceSelector: global()`), or by
//! its nets when it has no labels. Each rule carries `metadata.annotations` naming the flows
//! that justify it (`recommend.calc-server/flows`, at most 20, then how many more; the Service
//! a flow went through is named there) and their count; each policy the group, the window and
//! the number of flows. A flow to a workload of the namespace that only its source reported
//! (the destination's node sends no flow logs) gives no ingress rule: the notes say so.
//!
//! # Guard rails
//! - A flow the enforced policies denied is not allowed unless [`Options::include_denied`].
//! - No peer is ever "everything": every peer has a selector with at least one label
//!   comparison or nets; a namespace selector is one namespace or `global()`.
//! - Left out, with the reason ([`Reason`]): flows seen in fewer intervals than
//!   [`Options::min_samples`], host endpoints (and host-networked pods, which flows name as
//!   their host), addresses no NetworkSet holds (Goldmane's `pub`/`pvt`: a flow carries no
//!   address for them, so no `/32` can be written; put the address in a NetworkSet), peers or
//!   workloads without labels a selector can use, protocols a rule cannot name.
//! - Every object is run through the datastore's own decoder and validator before it is
//!   returned; one that fails is dropped and named in [`Recommendation::notes`].
//!
//! Output is deterministic: the same flows and inventory give the same objects, byte for byte
//! (groups, rules, ports and flows are sorted; names are derived, not random).

pub mod yaml;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

use felix_proto::goldmane::{Action, EndpointType, Flow, PolicyHit, PolicyKind, Reporter};
use serde::Serialize;
use serde_json::{Map, Value, json};

/// The annotation prefix of everything a recommendation writes.
pub const ANNOTATION_PREFIX: &str = "recommend.calc-server";
/// The labels that name an application, in order of preference.
pub const GROUP_LABELS: [&str; 3] = ["app.kubernetes.io/name", "app", "k8s-app"];
/// Labels that change with every revision of a workload: never part of a selector.
const REVISION_LABELS: [&str; 6] = [
    "pod-template-hash",
    "controller-revision-hash",
    "pod-template-generation",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
    "batch.kubernetes.io/controller-uid",
];
/// Flows named in one rule's annotation before "and N more".
const FLOWS_PER_ANNOTATION: usize = 20;

/// A pod (a workload endpoint) as the recommendation needs it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    /// The pod's `generateName` (empty: none).
    pub generate_name: String,
    /// Its own labels.
    pub labels: BTreeMap<String, String>,
    pub ports: Vec<NamedPort>,
}

/// A port a pod declares by name.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedPort {
    pub name: String,
    /// `tcp`, `udp` or `sctp`.
    pub protocol: String,
    pub port: u16,
}

/// A NetworkSet (`namespace: Some`) or GlobalNetworkSet (`None`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NetworkSet {
    pub namespace: Option<String>,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub nets: Vec<String>,
}

/// What the cluster holds, for selectors and named ports.
#[derive(Clone, Debug, Default)]
pub struct Inventory {
    pub pods: Vec<Pod>,
    pub network_sets: Vec<NetworkSet>,
}

/// What to recommend.
#[derive(Clone, Debug)]
pub struct Options {
    pub namespace: String,
    /// The tier of the policies (`default` unless chosen).
    pub tier: String,
    /// Also allow flows the enforced policies denied.
    pub include_denied: bool,
    /// A flow must have been seen in at least this many 15 s intervals.
    pub min_samples: u32,
    /// The window, as the operator gave it (written in an annotation), e.g. `1h`.
    pub window: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            namespace: String::new(),
            tier: "default".into(),
            include_denied: false,
            min_samples: 1,
            window: String::new(),
        }
    }
}

/// Why a question cannot be answered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    #[error("namespace {0:?}: not a Kubernetes namespace name (a DNS label)")]
    Namespace(String),
    #[error("tier {0:?}: not a tier name (a DNS label)")]
    Tier(String),
}

impl Options {
    pub fn check(&self) -> Result<(), OptionsError> {
        if !is_dns_label(&self.namespace) {
            return Err(OptionsError::Namespace(clip(&self.namespace)));
        }
        if !is_dns_label(&self.tier) {
            return Err(OptionsError::Tier(clip(&self.tier)));
        }
        Ok(())
    }
}

/// Why a flow was left out of the recommendation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The enforced policies denied it (see `--include-denied`).
    DeniedByEnforcedPolicy,
    /// Seen in fewer intervals than asked for.
    TooFewSamples,
    /// A host endpoint or host-networked pod on the other side.
    HostEndpoint,
    /// An address no NetworkSet holds (`pub`, `pvt`).
    UnnamedAddress,
    /// The other side has no label a selector can use (and no nets).
    PeerWithoutLabels,
    /// The workload itself has no label a selector can use.
    WorkloadWithoutLabels,
    /// A protocol or port a rule cannot name.
    UnsupportedProtocol,
}

impl Reason {
    pub fn text(self) -> &'static str {
        match self {
            Reason::DeniedByEnforcedPolicy => {
                "denied by the enforced policies (--include-denied allows it)"
            }
            Reason::TooFewSamples => "seen in fewer intervals than --min-samples",
            Reason::HostEndpoint => "host endpoint or host-networked peer",
            Reason::UnnamedAddress => {
                "address no NetworkSet holds (the flow carries no address: put it in a NetworkSet)"
            }
            Reason::PeerWithoutLabels => "peer has no label a selector can use",
            Reason::WorkloadWithoutLabels => "workload has no label a selector can use",
            Reason::UnsupportedProtocol => "protocol or port a rule cannot name",
        }
    }
}

/// One flow (one key over the window) as the recommendation shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SeenFlow {
    /// `namespace/name` of the source (`-/pub` for an unnamed address).
    pub source: String,
    pub dest: String,
    pub protocol: String,
    pub port: i64,
    /// `Allow`, `Deny` or `Pass`, as the enforced policies decided.
    pub action: String,
    /// `src` or `dst`.
    pub reporter: String,
    /// The destination Service (`namespace/name`), when the flow went through one.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// The 15 s intervals it was seen in.
    pub samples: u32,
    pub packets: i64,
    pub bytes: i64,
    pub connections: i64,
}

impl SeenFlow {
    /// `shop/web-* -> shop/api-* tcp/8080`.
    pub fn line(&self) -> String {
        let port = if self.port > 0 {
            format!("/{}", self.port)
        } else {
            String::new()
        };
        format!("{} -> {} {}{port}", self.source, self.dest, self.protocol)
    }
}

/// A flow left out, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LeftOut {
    pub reason: Reason,
    pub why: &'static str,
    pub flow: SeenFlow,
}

/// One recommended rule and the flows behind it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RuleEvidence {
    /// `ingress` or `egress`.
    pub direction: &'static str,
    /// Its index in that direction's rules.
    pub index: usize,
    /// The rule, as written in the policy.
    pub rule: Value,
    pub flows: Vec<SeenFlow>,
}

/// One recommended policy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RecommendedPolicy {
    pub name: String,
    /// How the group was formed: `app=web`, or `owner web`.
    pub group: String,
    pub selector: String,
    /// The `StagedNetworkPolicy` object.
    pub object: Value,
    pub rules: Vec<RuleEvidence>,
}

/// What [`recommend`] answers.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Recommendation {
    pub namespace: String,
    pub tier: String,
    pub policies: Vec<RecommendedPolicy>,
    pub left_out: Vec<LeftOut>,
    /// Labels that could not be expressed, names that had to change, objects dropped.
    pub notes: Vec<String>,
}

impl Recommendation {
    /// The policy objects alone.
    pub fn objects(&self) -> Vec<Value> {
        self.policies.iter().map(|p| p.object.clone()).collect()
    }
}

/// A group of pods of one namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum GroupKey {
    /// Pods sharing the value of one of [`GROUP_LABELS`].
    Label(&'static str, String),
    /// Pods of one owner (the generateName or name, revision cut off).
    Owner(String),
}

impl GroupKey {
    fn describe(&self) -> String {
        match self {
            GroupKey::Label(k, v) => format!("{k}={v}"),
            GroupKey::Owner(o) => format!("owner {o}"),
        }
    }

    fn base_name(&self) -> &str {
        match self {
            GroupKey::Label(_, v) => v,
            GroupKey::Owner(o) => o,
        }
    }
}

/// The group of a pod or flow side: its labels, and its generateName (a pod's, or a flow's
/// aggregated name without the `*`) or else its name.
fn group_key(labels: &BTreeMap<String, String>, generate_name: &str, name: &str) -> GroupKey {
    for k in GROUP_LABELS {
        if let Some(v) = labels.get(k)
            && is_label_value(v)
            && !v.is_empty()
        {
            return GroupKey::Label(k, v.clone());
        }
    }
    let owner = if generate_name.is_empty() {
        // A StatefulSet's pod: `db-0` is `db`.
        match (
            labels.get("statefulset.kubernetes.io/pod-name"),
            name.rsplit_once('-'),
        ) {
            (Some(_), Some((base, ord))) if ord.bytes().all(|b| b.is_ascii_digit()) => base,
            _ => name,
        }
    } else {
        let base = generate_name.trim_end_matches('-');
        match (labels.get("pod-template-hash"), base.rsplit_once('-')) {
            (Some(hash), Some((owner, tail))) if tail == hash => owner,
            _ => base,
        }
    };
    GroupKey::Owner(owner.to_string())
}

/// A Kubernetes label key (`[prefix/]name`), which Calico's selector grammar accepts as is.
pub fn is_label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    prefix.is_none_or(is_dns_subdomain) && is_label_value(name) && !name.is_empty()
}

/// A Kubernetes label value: at most 63 characters, alphanumerics with `-`, `_`, `.` inside.
/// Such a value holds no quote, so `'value'` is always a valid Calico selector literal.
pub fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    v.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b.first().is_none_or(u8::is_ascii_alphanumeric)
        && b.last().is_none_or(u8::is_ascii_alphanumeric)
}

/// A DNS-1123 label (namespaces, tiers, policy name parts).
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    (1..=63).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// At most 64 characters of hostile text, for a message.
fn clip(s: &str) -> String {
    s.chars()
        .take(64)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// `k == 'v' && …` of the labels, or `None` when none can be used; `notes` gets the labels
/// that could not be expressed.
fn selector_of(
    labels: &BTreeMap<String, String>,
    what: &str,
    notes: &mut BTreeSet<String>,
) -> Option<String> {
    let mut parts = Vec::new();
    for (k, v) in labels {
        if calicos_own(k) || REVISION_LABELS.contains(&k.as_str()) {
            continue;
        }
        if !is_label_key(k) || !is_label_value(v) {
            notes.insert(format!(
                "{what}: label {:?}={:?} cannot be written in a selector; left out of it",
                clip(k),
                clip(v)
            ));
            continue;
        }
        parts.push(format!("{k} == '{v}'"));
    }
    (!parts.is_empty()).then(|| parts.join(" && "))
}

/// Calico's own labels: derived from the namespace, the service account or the profiles
/// (`projectcalico.org/…`, and the `pcns.`/`pcsa.` copies of namespace and service-account
/// labels): a selector names them through `namespaceSelector`, never directly.
fn calicos_own(k: &str) -> bool {
    k.starts_with("projectcalico.org/") || k.starts_with("pcns.") || k.starts_with("pcsa.")
}

fn intersect(into: &mut Option<BTreeMap<String, String>>, labels: &BTreeMap<String, String>) {
    match into {
        None => *into = Some(labels.clone()),
        Some(have) => have.retain(|k, v| labels.get(k) == Some(v)),
    }
}

/// A flow side's labels (`key=value` strings).
fn flow_labels(list: &[String]) -> BTreeMap<String, String> {
    list.iter()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// What the inventory says of one group.
#[derive(Default)]
struct GroupInfo {
    /// Labels every pod of the group has.
    common: Option<BTreeMap<String, String>>,
    /// (protocol, port) → the names pods give it.
    ports: BTreeMap<(String, u16), BTreeSet<String>>,
}

/// One side of a flow, borrowed.
struct Side<'a> {
    namespace: &'a str,
    name: &'a str,
    kind: EndpointType,
    labels: &'a [String],
}

/// A rule's peer, in the order rules are written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Peer {
    namespace_selector: String,
    selector: String,
    nets: Vec<String>,
}

impl Peer {
    /// A peer that would match every pod of every namespace (or anything at all).
    fn too_wide(&self) -> bool {
        let everything = |s: &str| s.is_empty() || s.trim() == "all()";
        self.nets.is_empty() && everything(&self.selector)
    }

    fn entity(&self) -> Map<String, Value> {
        let mut m = Map::new();
        if !self.nets.is_empty() {
            m.insert("nets".into(), json!(self.nets));
        }
        if !self.namespace_selector.is_empty() {
            m.insert("namespaceSelector".into(), json!(self.namespace_selector));
        }
        if !self.selector.is_empty() {
            m.insert("selector".into(), json!(self.selector));
        }
        m
    }
}

/// A destination port in a rule: numbers first, then names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum PortKey {
    Number(u16),
    Name(String),
}

#[derive(Default)]
struct RuleAcc {
    ports: BTreeSet<PortKey>,
    flows: Vec<SeenFlow>,
}

#[derive(Default)]
struct PolicyAcc {
    /// (egress?, peer, protocol) → rule.
    rules: BTreeMap<(bool, Peer, String), RuleAcc>,
    flows: usize,
}

/// A flow key's counters over the window.
#[derive(Default)]
struct Agg<'a> {
    starts: BTreeSet<i64>,
    packets: i64,
    bytes: i64,
    connections: i64,
    src_labels: Option<&'a [String]>,
    dst_labels: Option<&'a [String]>,
    service: String,
}

type AggKey<'a> = (
    i32,
    &'a str,
    &'a str,
    i32,
    &'a str,
    &'a str,
    i32,
    i64,
    &'a str,
    i32,
);

/// Adds up the records of each flow key (the trace aside) over the window.
fn aggregate(flows: &[Flow]) -> BTreeMap<AggKey<'_>, Agg<'_>> {
    let mut out: BTreeMap<AggKey<'_>, Agg<'_>> = BTreeMap::new();
    for f in flows {
        let Some(k) = &f.key else { continue };
        let key = (
            k.reporter,
            k.source_namespace.as_str(),
            k.source_name.as_str(),
            k.source_type,
            k.dest_namespace.as_str(),
            k.dest_name.as_str(),
            k.dest_type,
            k.dest_port,
            k.proto.as_str(),
            k.action,
        );
        let a = out.entry(key).or_default();
        a.starts.insert(f.start_time);
        a.packets = a
            .packets
            .saturating_add(f.packets_in.saturating_add(f.packets_out));
        a.bytes = a
            .bytes
            .saturating_add(f.bytes_in.saturating_add(f.bytes_out));
        a.connections = a.connections.saturating_add(f.num_connections_started);
        a.src_labels.get_or_insert(&f.source_labels);
        a.dst_labels.get_or_insert(&f.dest_labels);
        if a.service.is_empty() && !k.dest_service_name.is_empty() && k.dest_service_name != "-" {
            a.service = format!("{}/{}", k.dest_service_namespace, k.dest_service_name);
        }
    }
    out
}

fn action_name(a: i32) -> &'static str {
    match Action::try_from(a) {
        Ok(Action::Allow) => "Allow",
        Ok(Action::Deny) => "Deny",
        Ok(Action::Pass) => "Pass",
        _ => "-",
    }
}

fn seen(key: &AggKey<'_>, a: &Agg<'_>) -> SeenFlow {
    SeenFlow {
        source: format!("{}/{}", key.1, key.2),
        dest: format!("{}/{}", key.4, key.5),
        protocol: key.8.to_ascii_lowercase(),
        port: key.7,
        action: action_name(key.9).into(),
        reporter: if key.0 == Reporter::Dst as i32 {
            "dst"
        } else {
            "src"
        }
        .into(),
        service: a.service.clone(),
        samples: u32::try_from(a.starts.len()).unwrap_or(u32::MAX),
        packets: a.packets,
        bytes: a.bytes,
        connections: a.connections,
    }
}

/// Calico's name of a flow's protocol, and whether it has ports.
fn protocol(p: &str) -> Option<(String, bool)> {
    let lower = p.to_ascii_lowercase();
    Some(match lower.as_str() {
        "tcp" | "6" => ("TCP".into(), true),
        "udp" | "17" => ("UDP".into(), true),
        "sctp" | "132" => ("SCTP".into(), true),
        "icmp" | "1" => ("ICMP".into(), false),
        "icmpv6" | "58" => ("ICMPv6".into(), false),
        n => match n.parse::<u8>() {
            Ok(n) if n > 0 => (n.to_string(), false),
            _ => return None,
        },
    })
}

/// The inventory's groups: (namespace, group) → info.
fn index(inv: &Inventory) -> BTreeMap<(&str, GroupKey), GroupInfo> {
    let mut groups: BTreeMap<(&str, GroupKey), GroupInfo> = BTreeMap::new();
    for p in &inv.pods {
        let g = group_key(&p.labels, &p.generate_name, &p.name);
        let info = groups.entry((p.namespace.as_str(), g)).or_default();
        intersect(&mut info.common, &p.labels);
        for np in &p.ports {
            info.ports
                .entry((np.protocol.to_ascii_lowercase(), np.port))
                .or_default()
                .insert(np.name.clone());
        }
    }
    groups
}

/// The group of a workload side of a flow.
fn side_group(s: &Side<'_>) -> GroupKey {
    let labels = flow_labels(s.labels);
    match s.name.strip_suffix('*') {
        Some(generate) => group_key(&labels, generate, s.name),
        None => group_key(&labels, "", s.name),
    }
}

/// The selector of a group: one label for a label group; else the labels all its pods share
/// (from the inventory, or from the flows when none of its pods is left). Worked out once per
/// group ([`Selectors`]).
fn group_selector(
    key: &GroupKey,
    inventory: Option<&GroupInfo>,
    from_flows: Option<&BTreeMap<String, String>>,
    what: &str,
    notes: &mut BTreeSet<String>,
) -> Option<String> {
    match key {
        GroupKey::Label(k, v) => Some(format!("{k} == '{v}'")),
        GroupKey::Owner(_) => {
            let labels = inventory.and_then(|i| i.common.as_ref()).or(from_flows)?;
            selector_of(labels, what, notes)
        }
    }
}

/// Each group's selector, worked out once.
struct Selectors<'i> {
    groups: &'i BTreeMap<(&'i str, GroupKey), GroupInfo>,
    /// The inventory's pods by namespace, with their group.
    pods: BTreeMap<&'i str, Vec<(&'i Pod, GroupKey)>>,
    from_flows: BTreeMap<(String, GroupKey), Option<BTreeMap<String, String>>>,
    known: BTreeMap<(String, GroupKey), Option<String>>,
}

impl<'i> Selectors<'i> {
    fn new(
        inventory: &'i Inventory,
        groups: &'i BTreeMap<(&'i str, GroupKey), GroupInfo>,
        from_flows: BTreeMap<(String, GroupKey), Option<BTreeMap<String, String>>>,
    ) -> Selectors<'i> {
        let mut pods: BTreeMap<&str, Vec<(&Pod, GroupKey)>> = BTreeMap::new();
        for p in &inventory.pods {
            pods.entry(p.namespace.as_str())
                .or_default()
                .push((p, group_key(&p.labels, &p.generate_name, &p.name)));
        }
        Selectors {
            groups,
            pods,
            from_flows,
            known: BTreeMap::new(),
        }
    }

    fn get(&mut self, ns: &str, g: &GroupKey, notes: &mut BTreeSet<String>) -> Option<String> {
        let key = (ns.to_string(), g.clone());
        if let Some(s) = self.known.get(&key) {
            return s.clone();
        }
        let what = format!("{} group {}", clip(ns), clip(&g.describe()));
        let mut sel = group_selector(
            g,
            self.groups.get(&(ns, g.clone())),
            self.from_flows.get(&key).and_then(Option::as_ref),
            &what,
            notes,
        );
        if let Some(text) = &mut sel {
            self.narrow(ns, g, text, &what, notes);
        }
        self.known.insert(key, sel.clone());
        sel
    }

    /// A label group's selector excludes the pods grouped by an earlier label that carry its
    /// label too (`app == 'web' && !has(app.kubernetes.io/name)`, only when such a pod
    /// exists); a selector that still selects pods of other groups is noted.
    fn narrow(
        &self,
        ns: &str,
        g: &GroupKey,
        text: &mut String,
        what: &str,
        notes: &mut BTreeSet<String>,
    ) {
        let pods = self.pods.get(ns).map(Vec::as_slice).unwrap_or_default();
        if let GroupKey::Label(k, v) = g {
            let earlier: Vec<&str> = GROUP_LABELS
                .iter()
                .copied()
                .take_while(|e| e != k)
                .collect();
            let shadowed = pods
                .iter()
                .any(|(p, pg)| pg != g && p.labels.get(*k) == Some(v));
            if shadowed {
                for e in earlier {
                    text.push_str(&format!(" && !has({e})"));
                }
            }
        }
        let Ok(parsed) = calc_graph::selector::parse(text) else {
            return;
        };
        let others: Vec<&str> = pods
            .iter()
            .filter(|(p, pg)| pg != g && parsed.evaluate(&p.labels))
            .map(|(p, _)| p.name.as_str())
            .collect();
        if let Some(first) = others.first() {
            notes.insert(format!(
                "{what}: its selector also selects {} pod(s) of other groups (such as {}); they get this policy's rules too",
                others.len(),
                clip(first)
            ));
        }
    }
}

/// Recommends staged policies for `opts.namespace` from `flows` (any order; records of one key
/// in several intervals count as several samples) and the inventory.
pub fn recommend(
    flows: &[Flow],
    inventory: &Inventory,
    opts: &Options,
) -> Result<Recommendation, OptionsError> {
    opts.check()?;
    let ns = opts.namespace.as_str();
    let groups = index(inventory);
    let aggs = aggregate(flows);
    let mut cx = Context {
        ns,
        groups: &groups,
        netsets: inventory
            .network_sets
            .iter()
            .map(|s| ((s.namespace.as_deref().unwrap_or("-"), s.name.as_str()), s))
            .collect(),
        selectors: Selectors::new(inventory, &groups, flow_group_labels(&aggs)),
        notes: BTreeSet::new(),
    };
    let mut left_out = Vec::new();
    let mut policies: BTreeMap<GroupKey, PolicyAcc> = BTreeMap::new();
    for (key, a) in &aggs {
        let egress = key.0 == Reporter::Src as i32;
        let (src, dst) = sides(key, a);
        let (own, peer) = if egress { (&src, &dst) } else { (&dst, &src) };
        if own.namespace != ns || own.kind != EndpointType::WorkloadEndpoint {
            continue; // another namespace's policy
        }
        let flow = seen(key, a);
        match cx.rule_of(key, &flow, egress, own, peer, opts) {
            Ok((own_group, peer_rule, proto, port)) => {
                let acc = policies.entry(own_group).or_default();
                acc.flows += 1;
                let rule = acc.rules.entry((egress, peer_rule, proto)).or_default();
                rule.ports.extend(port);
                rule.flows.push(flow);
            }
            Err(reason) => left_out.push(LeftOut {
                reason,
                why: reason.text(),
                flow,
            }),
        }
    }
    note_unreported(&aggs, ns, &mut cx.notes);
    let mut out = Recommendation {
        namespace: ns.to_string(),
        tier: opts.tier.clone(),
        ..Default::default()
    };
    let mut used_names = BTreeSet::new();
    for (group, acc) in policies {
        let Some(selector) = cx.selectors.get(ns, &group, &mut cx.notes) else {
            continue;
        };
        let name = policy_name(
            &opts.tier,
            group.base_name(),
            &mut used_names,
            &mut cx.notes,
        );
        let (object, rules) = policy_object(&name, &group, &selector, acc, opts);
        if let Err(why) = valid(&object) {
            cx.notes
                .insert(format!("{name}: dropped, not a valid policy: {why}"));
            continue;
        }
        out.policies.push(RecommendedPolicy {
            name,
            group: group.describe(),
            selector,
            object,
            rules,
        });
    }
    left_out.sort_by(|a, b| left_key(a).cmp(&left_key(b)));
    out.policies.sort_by(|a, b| a.name.cmp(&b.name));
    out.left_out = left_out;
    out.notes = cx.notes.into_iter().collect();
    Ok(out)
}

/// The order of left-out flows: by reason, then the flow.
fn left_key(l: &LeftOut) -> (Reason, &str, &str, i64, &str, &str, &str) {
    let f = &l.flow;
    (
        l.reason,
        &f.source,
        &f.dest,
        f.port,
        &f.protocol,
        &f.reporter,
        &f.action,
    )
}

/// The order of the flows behind a rule.
fn flow_key(f: &SeenFlow) -> (&str, &str, i64, &str, &str) {
    (&f.source, &f.dest, f.port, &f.protocol, &f.reporter)
}

/// The two sides of a flow key.
fn sides<'a>(key: &AggKey<'a>, a: &Agg<'a>) -> (Side<'a>, Side<'a>) {
    let kind = |k: i32| EndpointType::try_from(k).unwrap_or(EndpointType::Unspecified);
    (
        Side {
            namespace: key.1,
            name: key.2,
            kind: kind(key.3),
            labels: a.src_labels.unwrap_or_default(),
        },
        Side {
            namespace: key.4,
            name: key.5,
            kind: kind(key.6),
            labels: a.dst_labels.unwrap_or_default(),
        },
    )
}

/// The labels every flow gives each workload group (namespace, group), for groups none of
/// whose pods is in the inventory any more.
fn flow_group_labels(
    aggs: &BTreeMap<AggKey<'_>, Agg<'_>>,
) -> BTreeMap<(String, GroupKey), Option<BTreeMap<String, String>>> {
    let mut out: BTreeMap<(String, GroupKey), Option<BTreeMap<String, String>>> = BTreeMap::new();
    for (key, a) in aggs {
        let (src, dst) = sides(key, a);
        for side in [src, dst] {
            if side.kind != EndpointType::WorkloadEndpoint {
                continue;
            }
            let g = side_group(&side);
            intersect(
                out.entry((side.namespace.to_string(), g)).or_default(),
                &flow_labels(side.labels),
            );
        }
    }
    out
}

/// What one call of [`recommend`] works with.
struct Context<'i> {
    ns: &'i str,
    groups: &'i BTreeMap<(&'i str, GroupKey), GroupInfo>,
    netsets: BTreeMap<(&'i str, &'i str), &'i NetworkSet>,
    selectors: Selectors<'i>,
    notes: BTreeSet<String>,
}

impl Context<'_> {
    /// The group, peer, protocol and port of the rule a flow of the namespace calls for, or
    /// why it is left out.
    fn rule_of(
        &mut self,
        key: &AggKey<'_>,
        flow: &SeenFlow,
        egress: bool,
        own: &Side<'_>,
        peer: &Side<'_>,
        opts: &Options,
    ) -> Result<(GroupKey, Peer, String, Option<PortKey>), Reason> {
        let allowed = key.9 == Action::Allow as i32;
        let denied = key.9 == Action::Deny as i32;
        if !(allowed || (denied && opts.include_denied)) {
            return Err(Reason::DeniedByEnforcedPolicy);
        }
        if flow.samples < opts.min_samples {
            return Err(Reason::TooFewSamples);
        }
        let (proto, has_ports) = protocol(key.8).ok_or(Reason::UnsupportedProtocol)?;
        let port = match u16::try_from(key.7) {
            Ok(p) if p > 0 => Some(p),
            _ if has_ports => return Err(Reason::UnsupportedProtocol),
            _ => None,
        };
        let own_group = side_group(own);
        if self
            .selectors
            .get(self.ns, &own_group, &mut self.notes)
            .is_none()
        {
            return Err(Reason::WorkloadWithoutLabels);
        }
        let peer_rule = self.peer(peer)?;
        if peer_rule.too_wide() {
            // Never reached with the selectors built here; kept as the last word.
            return Err(Reason::PeerWithoutLabels);
        }
        // A named port: the destination group's pods all call it by one name.
        let dest_info = if !egress {
            self.groups.get(&(self.ns, own_group.clone()))
        } else if peer.kind == EndpointType::WorkloadEndpoint {
            self.groups.get(&(peer.namespace, side_group(peer)))
        } else {
            None
        };
        let port = port.map(|p| {
            let names = dest_info.and_then(|i| i.ports.get(&(key.8.to_ascii_lowercase(), p)));
            match names.map(|n| n.iter().collect::<Vec<_>>()).as_deref() {
                Some([name]) if is_dns_label(name) && name.len() <= 15 => {
                    PortKey::Name((*name).clone())
                }
                _ => PortKey::Number(p),
            }
        });
        Ok((own_group, peer_rule, proto, port))
    }

    /// The rule's peer for the other side of a flow.
    fn peer(&mut self, peer: &Side<'_>) -> Result<Peer, Reason> {
        let namespace_selector = |ns: &str| {
            if ns == self.ns {
                String::new()
            } else {
                format!("projectcalico.org/name == '{ns}'")
            }
        };
        match peer.kind {
            EndpointType::WorkloadEndpoint => {
                let g = side_group(peer);
                match self.selectors.get(peer.namespace, &g, &mut self.notes) {
                    Some(selector) if is_dns_label(peer.namespace) => Ok(Peer {
                        namespace_selector: namespace_selector(peer.namespace),
                        selector,
                        nets: Vec::new(),
                    }),
                    _ => Err(Reason::PeerWithoutLabels),
                }
            }
            EndpointType::NetworkSet => {
                let set = self.netsets.get(&(peer.namespace, peer.name)).copied();
                let labels = set.map_or_else(|| flow_labels(peer.labels), |s| s.labels.clone());
                let global = peer.namespace == "-";
                let what = format!("NetworkSet {}/{}", clip(peer.namespace), clip(peer.name));
                match (selector_of(&labels, &what, &mut self.notes), set) {
                    (Some(selector), _) if global || is_dns_label(peer.namespace) => Ok(Peer {
                        namespace_selector: if global {
                            "global()".into()
                        } else {
                            namespace_selector(peer.namespace)
                        },
                        selector,
                        nets: Vec::new(),
                    }),
                    (None, Some(s)) if !s.nets.is_empty() && s.nets.iter().all(|n| is_net(n)) => {
                        Ok(Peer {
                            namespace_selector: String::new(),
                            selector: String::new(),
                            nets: s.nets.clone(),
                        })
                    }
                    _ => Err(Reason::PeerWithoutLabels),
                }
            }
            EndpointType::HostEndpoint => Err(Reason::HostEndpoint),
            _ => Err(Reason::UnnamedAddress),
        }
    }
}

/// Notes the workloads of the namespace that allowed flows reached with only their source
/// reporting: no ingress rule can include those (the destination's verdict is unknown).
fn note_unreported(aggs: &BTreeMap<AggKey<'_>, Agg<'_>>, ns: &str, notes: &mut BTreeSet<String>) {
    let reported_by_dest: BTreeSet<(&str, &str, &str, &str, i64, &str)> = aggs
        .keys()
        .filter(|k| k.0 == Reporter::Dst as i32)
        .map(|k| (k.1, k.2, k.4, k.5, k.7, k.8))
        .collect();
    let mut unreported: BTreeMap<&str, usize> = BTreeMap::new();
    for k in aggs.keys().filter(|k| {
        k.0 == Reporter::Src as i32
            && k.4 == ns
            && k.6 == EndpointType::WorkloadEndpoint as i32
            && k.9 == Action::Allow as i32
    }) {
        if !reported_by_dest.contains(&(k.1, k.2, k.4, k.5, k.7, k.8)) {
            *unreported.entry(k.5).or_default() += 1;
        }
    }
    for (dest, n) in unreported {
        notes.insert(format!(
            "{n} flow(s) to {ns}/{} were reported only by their source: no ingress rule covers them (does the destination's node send flow logs?)",
            clip(dest)
        ));
    }
}

/// One rule: `Allow`, the protocol, the peer on its side, the ports, the flows behind it.
fn rule_object(egress: bool, peer: &Peer, proto: &str, r: &RuleAcc) -> Value {
    let mut rule = Map::new();
    rule.insert("action".into(), json!("Allow"));
    rule.insert("protocol".into(), proto_value(proto));
    let mut dest = if egress { peer.entity() } else { Map::new() };
    if !r.ports.is_empty() {
        let ports: Vec<Value> = r
            .ports
            .iter()
            .map(|p| match p {
                PortKey::Number(n) => json!(n),
                PortKey::Name(s) => json!(s),
            })
            .collect();
        dest.insert("ports".into(), Value::Array(ports));
    }
    if !egress {
        rule.insert("source".into(), Value::Object(peer.entity()));
    }
    if !dest.is_empty() {
        rule.insert("destination".into(), Value::Object(dest));
    }
    rule.insert(
        "metadata".into(),
        json!({"annotations": rule_annotations(&r.flows)}),
    );
    Value::Object(rule)
}

/// A group's `StagedNetworkPolicy` and the flows behind each of its rules (ingress first, in
/// the object's order).
fn policy_object(
    name: &str,
    group: &GroupKey,
    selector: &str,
    acc: PolicyAcc,
    opts: &Options,
) -> (Value, Vec<RuleEvidence>) {
    let mut ingress = Vec::new();
    let mut egress = Vec::new();
    let mut rules = Vec::new();
    // Keys sort ingress (false) before egress.
    for ((is_egress, peer, proto), mut r) in acc.rules {
        r.flows.sort_by(|a, b| flow_key(a).cmp(&flow_key(b)));
        let rule = rule_object(is_egress, &peer, &proto, &r);
        let list = if is_egress { &mut egress } else { &mut ingress };
        rules.push(RuleEvidence {
            direction: if is_egress { "egress" } else { "ingress" },
            index: list.len(),
            rule: rule.clone(),
            flows: r.flows,
        });
        list.push(rule);
    }
    let mut spec = Map::new();
    spec.insert("stagedAction".into(), json!("Set"));
    spec.insert("tier".into(), json!(opts.tier));
    spec.insert("selector".into(), json!(selector));
    spec.insert("types".into(), json!(["Ingress", "Egress"]));
    if !ingress.is_empty() {
        spec.insert("ingress".into(), Value::Array(ingress));
    }
    if !egress.is_empty() {
        spec.insert("egress".into(), Value::Array(egress));
    }
    let object = json!({
        "apiVersion": "projectcalico.org/v3",
        "kind": "StagedNetworkPolicy",
        "metadata": {
            "name": name,
            "namespace": opts.namespace,
            "annotations": {
                format!("{ANNOTATION_PREFIX}/group"): group.describe(),
                format!("{ANNOTATION_PREFIX}/window"): opts.window,
                format!("{ANNOTATION_PREFIX}/flows"): acc.flows.to_string(),
            },
        },
        "spec": Value::Object(spec),
    });
    (object, rules)
}

/// Calico's `protocol` value: a name, or a number.
fn proto_value(p: &str) -> Value {
    match p.parse::<u8>() {
        Ok(n) => json!(n),
        Err(_) => json!(p),
    }
}

fn is_net(n: &str) -> bool {
    let (addr, len) = n.split_once('/').unwrap_or((n, ""));
    addr.parse::<std::net::IpAddr>().is_ok() && (len.is_empty() || len.parse::<u8>().is_ok())
}

/// `recommend.calc-server/flows` (the flows, at most [`FLOWS_PER_ANNOTATION`]) and `…/count`.
fn rule_annotations(flows: &[SeenFlow]) -> Value {
    let mut lines: Vec<String> = flows
        .iter()
        .take(FLOWS_PER_ANNOTATION)
        .map(|f| {
            let via = if f.service.is_empty() {
                String::new()
            } else {
                format!(" via service {}", f.service)
            };
            format!(
                "{}{via} ({}, {} intervals, {} packets)",
                f.line(),
                f.reporter,
                f.samples,
                f.packets
            )
        })
        .collect();
    if flows.len() > FLOWS_PER_ANNOTATION {
        lines.push(format!("and {} more", flows.len() - FLOWS_PER_ANNOTATION));
    }
    json!({
        format!("{ANNOTATION_PREFIX}/flows"): lines.join("; "),
        format!("{ANNOTATION_PREFIX}/count"): flows.len().to_string(),
    })
}

/// `recommended-<group>`, `<tier>.recommended-<group>` outside the default tier (Calico's
/// rule), made a DNS label and unique.
fn policy_name(
    tier: &str,
    base: &str,
    used: &mut BTreeSet<String>,
    notes: &mut BTreeSet<String>,
) -> String {
    let mut clean: String = base
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    clean = clean.trim_matches('-').chars().take(40).collect();
    let clean = clean.trim_end_matches('-');
    let stem = if clean.is_empty() {
        "recommended".to_string()
    } else {
        format!("recommended-{clean}")
    };
    let mut name = stem.clone();
    let mut n = 2;
    while used.contains(&name) {
        name = format!("{stem}-{n}");
        n += 1;
    }
    if name != format!("recommended-{base}") {
        notes.insert(format!(
            "group {:?} is named {name} (policy names are DNS labels and unique)",
            clip(base)
        ));
    }
    used.insert(name.clone());
    if tier == "default" {
        name
    } else {
        format!("{tier}.{name}")
    }
}

/// Whether the datastore's decoder and validator accept the object.
fn valid(object: &Value) -> Result<(), String> {
    use calc_graph::manifest::{Outcome, decode_and_validate};
    match decode_and_validate(object.clone()) {
        Outcome::Valid(..) => Ok(()),
        Outcome::Ignored(k, _) => Err(format!("kind {k} ignored")),
        Outcome::Undecodable(e) => Err(e.to_string()),
        Outcome::Invalid(e) => Err(format!("{e:?}")),
    }
}

/// A staged policy of the namespace, as `--check` lists it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct StagedRef {
    /// `StagedNetworkPolicy` or `StagedKubernetesNetworkPolicy`.
    pub kind: String,
    pub name: String,
}

/// One staged policy's verdict on the window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyCheck {
    pub kind: String,
    pub name: String,
    /// Flows the enforced policies allow and this staged policy would deny: what enforcing it
    /// would break. Empty: safe to promote (for the traffic of the window).
    pub breaks: Vec<SeenFlow>,
}

fn staged_kind(kind: i32) -> Option<&'static str> {
    match PolicyKind::try_from(kind).ok()? {
        PolicyKind::StagedNetworkPolicy => Some("StagedNetworkPolicy"),
        PolicyKind::StagedKubernetesNetworkPolicy => Some("StagedKubernetesNetworkPolicy"),
        _ => None,
    }
}

/// The staged policies of `namespace` named by a pending trace's deciding hit: the hit
/// itself, or the policy that triggered the end of its tier.
fn deciding_staged<'a>(hit: &'a PolicyHit, namespace: &str) -> Option<(&'static str, &'a str)> {
    let h = if hit.kind == PolicyKind::EndOfTier as i32 {
        hit.trigger.as_deref()?
    } else {
        hit
    };
    (h.namespace == namespace).then_some(())?;
    Some((staged_kind(h.kind)?, h.name.as_str()))
}

/// For each staged policy of `namespace` (`staged`), the flows of the window that the
/// enforced policies allowed and whose pending trace (the walk with staged policies enforced)
/// ends in a deny decided by that policy: a deny rule of it, or the end of its tier after it
/// selected the endpoint without an allow. Policies in `staged` with no break are listed with
/// none.
pub fn check(flows: &[Flow], namespace: &str, staged: &[StagedRef]) -> Vec<PolicyCheck> {
    let mut breaks: BTreeMap<StagedRef, Vec<&Flow>> =
        staged.iter().map(|s| (s.clone(), Vec::new())).collect();
    for f in flows {
        let Some(k) = &f.key else { continue };
        if k.action != Action::Allow as i32 {
            continue;
        }
        let Some(last) = k.policies.as_ref().and_then(|p| p.pending_policies.last()) else {
            continue;
        };
        if last.action != Action::Deny as i32 {
            continue;
        }
        if let Some((kind, name)) = deciding_staged(last, namespace) {
            let r = StagedRef {
                kind: kind.into(),
                name: name.into(),
            };
            breaks.entry(r).or_default().push(f);
        }
    }
    breaks
        .into_iter()
        .map(|(r, fs)| {
            let owned: Vec<Flow> = fs.into_iter().cloned().collect();
            let aggs = aggregate(&owned);
            PolicyCheck {
                kind: r.kind,
                name: r.name,
                breaks: aggs.iter().map(|(k, a)| seen(k, a)).collect(),
            }
        })
        .collect()
}

/// Why a staged policy cannot be promoted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PromoteError {
    #[error(
        "{0:?} is not a staged Calico policy kind (StagedNetworkPolicy, StagedGlobalNetworkPolicy)"
    )]
    Kind(String),
    #[error(
        "{0}: stagedAction Delete stages the removal of the enforced policy: delete it instead"
    )]
    StagesDelete(String),
    #[error("not a policy object (no kind, metadata or spec)")]
    Shape,
}

/// The enforced equivalent of a staged policy, as Calico converts it: the kind without
/// `Staged`, `stagedAction` dropped, the rest kept (names, tier, rules and their
/// annotations); the server-set metadata (`resourceVersion`, `uid`, `creationTimestamp`) is
/// dropped so the object can be applied.
pub fn promote(staged: &Value) -> Result<Value, PromoteError> {
    let kind = staged["kind"].as_str().ok_or(PromoteError::Shape)?;
    let enforced = match kind {
        "StagedNetworkPolicy" => "NetworkPolicy",
        "StagedGlobalNetworkPolicy" => "GlobalNetworkPolicy",
        other => return Err(PromoteError::Kind(clip(other))),
    };
    let mut out = staged.clone();
    let Some(obj) = out.as_object_mut() else {
        return Err(PromoteError::Shape);
    };
    let name = clip(staged["metadata"]["name"].as_str().unwrap_or_default());
    let spec = obj
        .get_mut("spec")
        .and_then(Value::as_object_mut)
        .ok_or(PromoteError::Shape)?;
    if spec.get("stagedAction").and_then(Value::as_str) == Some("Delete") {
        return Err(PromoteError::StagesDelete(name));
    }
    spec.remove("stagedAction");
    obj.insert("kind".into(), json!(enforced));
    obj.insert("apiVersion".into(), json!("projectcalico.org/v3"));
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in [
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "generation",
            "managedFields",
        ] {
            meta.remove(k);
        }
    } else {
        return Err(PromoteError::Shape);
    }
    Ok(out)
}
