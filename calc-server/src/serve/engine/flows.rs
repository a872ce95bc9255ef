//! Flow records from the agents (issue 42, capability `flows`): checked ([`parse`], by the
//! stream, before anything reaches the engine), then named from the graph and put in the flow
//! store ([`crate::flows::FlowStore`]) keyed as Calico's Goldmane keys them ([`FlowIngest`]).
//!
//! Naming each side of a record (pure, from the graph as it is when the record arrives):
//! - an address of a workload endpoint: its pod's `generateName` followed by `*` (Calico's
//!   aggregate, so every replica of a Deployment is one name), or the pod's name when it has
//!   none; its namespace; its effective labels (`key=value`, without Calico's own
//!   `projectcalico.org/…` labels); type `WorkloadEndpoint`;
//! - an address of a host endpoint: its node's name (as Felix's aggregated name), namespace
//!   `-`, type `HostEndpoint`;
//! - an address in a NetworkSet or GlobalNetworkSet: that set's name, namespace (`-` for a
//!   global one) and labels (the longest matching prefix wins; ties by key), type `NetworkSet`;
//! - otherwise `pvt` for an address in 10/8, 172.16/12 or 192.168/16 and `pub` for any other
//!   (IPv6 included, as Felix), namespace `-`, type `Network`.
//!
//! The destination service (as Felix): when the record carries what the client addressed
//! (`original_dest`: the connection was translated), the Service port whose cluster or
//! external IP and port that is, else the one whose node port it is; `-` (port 0) when none.
//! Joined: a destination report without one (its node saw the connection already translated)
//! takes the service a source report of the same connection (5-tuple after DNAT) named in the
//! same interval or a neighbouring one. When the destination report came first, it is moved
//! (its counts taken from the key without a service and added to the key with it) when the
//! source report arrives, within 90 s. What is remembered for this is bounded by `max_seen`
//! too.
//!
//! The reporting side (the destination when `reporter_dest`, else the source) must be an
//! endpoint of the reporting node: a record that is not is dropped and counted (`foreign`), so
//! one node cannot forge another's flows. When an address belongs to several endpoints, the
//! reporting node's own comes first, then the smallest key.
//!
//! The enforced trace: each hit becomes a Goldmane `PolicyHit` in trace order; `policy_index`
//! is the hit's position in the trace. Kinds: Calico NetworkPolicy → `CalicoNetworkPolicy`, a
//! Kubernetes NetworkPolicy (`knp.default.<name>`) → `NetworkPolicy` named `<name>`,
//! GlobalNetworkPolicy → `GlobalNetworkPolicy`, the network-policy-api kinds →
//! `ClusterNetworkPolicyAdminTier` or `…BaselineTier` by tier, a profile rule → `Profile` (tier
//! `__PROFILE__`). A policy's tier is the graph's. An end-of-tier hit is `EndOfTier` with the
//! tier, and its `trigger` is the first policy of that tier earlier in the trace or, when none
//! is, the first enforced (not staged) policy of that tier in the reporting endpoint's tier
//! list for that direction (ingress for a destination report). A no-profile-matched drop is `EndOfTier` of tier
//! `__PROFILE__` without a trigger. Failsafe and default-action verdicts are left out of the
//! trace (they decide no policy).
//!
//! The pending trace ([`pending`]): the reporting side's walk with staged policies enforced,
//! from explain (`calc_graph::explain`), converted the same way (an end of tier's trigger: the
//! tier's policy earlier in the trace, else the first of the tier selecting the endpoint,
//! staged ones included). When no staged policy applies on the path it is the enforced trace
//! itself, as Felix reports it; explain does not even run unless a staged policy selects the
//! reporting endpoint or some host endpoint (whose pre-DNAT or forward policies any path may
//! meet). The records of one report share one [`explain::Explainer`] (policy order worked out
//! once). The engine bounds how many pending traces one step computes
//! ([`FlowIngest::start_step`]); records beyond wait, oldest first, for later steps
//! ([`FlowIngest::drain`]), at most 100,000 (`explain_backlog` beyond). It is the graph's evaluation of the record's first packet
//! (5-tuple), not of what the node's dataplane did.
//!
//! Cost: what depends only on the graph is computed once per graph generation and kept until
//! [`FlowIngest::graph_changed`]: the address index (endpoints' and network sets' nets parsed
//! once), each address's name (per node for its own side; at most 100,000 addresses, then
//! started again), each pending trace (per node, by 5-tuple without the source port unless
//! some rule matches source ports, and side; at most 100,000), and each conversation's flow
//! key (per node, by the record's fields that decide it: addresses, destination port,
//! protocol, side, verdict, trace and service; at most 200,000 over all nodes, then all are
//! started again). A record of a known conversation is thus a few map lookups and a counter
//! update: its key is checked, hashed and shared with the store once ([`PreparedFlow`]), and
//! its sides' labels are one shared copy per address.
//!
//! De-duplication: one record per (interval, 5-tuple, reporting node and side); a record seen
//! again (an agent re-sending after a reconnect) is dropped and counted (`duplicate`). What is
//! remembered is bounded ([`FlowIngest::new`]'s `max_seen`; beyond it: `dedup_cap`) and
//! forgotten with the buckets.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;

use calc_graph::convert::EndpointKind;
use calc_graph::explain;
use calc_graph::graph::{CalcGraph, EndpointView, GraphView, ServicePortRef};
use calc_graph::model::{Kind, ResourceKey};
use felix_proto as pb;
use felix_proto::goldmane::{
    Action as GAction, EndpointType, FlowKey, PolicyHit, PolicyKind, PolicyTrace, Reporter,
};
use pb::to_dataplane::Payload;

use super::hits::{self, Owner};
use crate::flows::store::{FastMap, FastSet, Labels, PreparedFlow, Tally, labels};
use crate::flows::{BUCKET_SECONDS, FlowStore, Refused};

/// Most records one `FlowReport` may carry.
pub(crate) const MAX_RECORDS_PER_REPORT: usize = 4096;
/// Longest address text accepted (an IPv6 address with an IPv4 tail is 45 bytes).
const MAX_IP_TEXT: usize = 64;
/// The tier Calico's flow logs give profile rules.
const PROFILE_TIER: &str = "__PROFILE__";

/// What a rule did to a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HitAction {
    Allow,
    Deny,
    Pass,
}

/// One checked hit of a record's trace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TraceHit {
    pub owner: Owner,
    pub egress: bool,
    pub index: u32,
    pub action: HitAction,
}

/// One checked flow record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowIn {
    pub interval: i64,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub reporter_dest: bool,
    pub allowed: bool,
    pub trace: Vec<TraceHit>,
    /// Packets, bytes and connections.
    pub tally: Tally,
    /// What the client addressed, when the connection was translated (DNAT).
    pub original_dest: Option<(IpAddr, u16)>,
}

/// A checked report: its records and what the agent says it dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowBatch {
    pub records: Vec<FlowIn>,
    pub agent_dropped: u64,
}

/// Why a whole `FlowReport` is refused (the stream ends with INVALID_ARGUMENT). The messages
/// name fields and positions, never the agent's text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("FlowReport carries {0} records, more than {MAX_RECORDS_PER_REPORT}")]
    TooManyRecords(usize),
    #[error("FlowReport.records[{at}].{field}: {why}")]
    Field {
        at: usize,
        field: &'static str,
        why: &'static str,
    },
    #[error("FlowReport.records[{at}].trace: {why}")]
    Trace { at: usize, why: String },
}

impl Malformed {
    /// The `calc_server_flow_reports_refused_total` reason.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Malformed::TooManyRecords(_) => "too_many_records",
            _ => "malformed",
        }
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Checks a `FlowReport`: bounded, every address an IP, every interval a multiple of 15 s,
/// ports and protocol in range, every trace bounded and every hit a well-formed reference
/// (as `RuleStats` hits are checked) with an action of `allow`, `deny` or `pass`.
pub fn parse(report: &pb::FlowReport) -> Result<FlowBatch, Malformed> {
    if report.records.len() > MAX_RECORDS_PER_REPORT {
        return Err(Malformed::TooManyRecords(report.records.len()));
    }
    let mut records = Vec::with_capacity(report.records.len());
    for (at, r) in report.records.iter().enumerate() {
        let field = |field, why| Malformed::Field { at, field, why };
        let ip = |s: &str, name| {
            if s.len() > MAX_IP_TEXT {
                return Err(field(name, "longer than 64 bytes"));
            }
            s.parse::<IpAddr>()
                .map_err(|_| field(name, "not an IP address"))
        };
        let src = ip(&r.source_ip, "source_ip")?;
        let dst = ip(&r.dest_ip, "dest_ip")?;
        if src.is_ipv4() != dst.is_ipv4() {
            return Err(field("dest_ip", "not of the source's IP version"));
        }
        if r.interval_start < 0 || r.interval_start % BUCKET_SECONDS != 0 {
            return Err(field(
                "interval_start",
                "not a non-negative multiple of 15 seconds",
            ));
        }
        let port = |p: u32, name| u16::try_from(p).map_err(|_| field(name, "above 65535"));
        let src_port = port(r.source_port, "source_port")?;
        let dst_port = port(r.dest_port, "dest_port")?;
        let proto = u8::try_from(r.protocol).map_err(|_| field("protocol", "above 255"))?;
        let original_dest = if r.original_dest_ip.is_empty() {
            None
        } else {
            let ip = ip(&r.original_dest_ip, "original_dest_ip")?;
            if ip.is_ipv4() != dst.is_ipv4() {
                return Err(field("original_dest_ip", "not of the record's IP version"));
            }
            Some((ip, port(r.original_dest_port, "original_dest_port")?))
        };
        if r.trace.len() > crate::flows::limits::MAX_HITS {
            return Err(Malformed::Trace {
                at,
                why: format!(
                    "{} hits, more than {}",
                    r.trace.len(),
                    crate::flows::limits::MAX_HITS
                ),
            });
        }
        // The references are checked as a RuleStats report's are.
        let refs = pb::RuleStats {
            hits: r
                .trace
                .iter()
                .map(|h| pb::RuleHits {
                    rule: h.rule.clone(),
                    packets: 0,
                    bytes: 0,
                })
                .collect(),
        };
        let parsed = hits::parse(&refs).map_err(|e| Malformed::Trace {
            at,
            why: e.to_string().replace("RuleStats.hits", "hits"),
        })?;
        let mut trace = Vec::with_capacity(parsed.len());
        for (i, (h, raw)) in parsed.into_iter().zip(&r.trace).enumerate() {
            let action = match raw.action.as_str() {
                "allow" => HitAction::Allow,
                "deny" => HitAction::Deny,
                "pass" => HitAction::Pass,
                _ => {
                    return Err(Malformed::Trace {
                        at,
                        why: format!("hits[{i}].action is not allow, deny or pass"),
                    });
                }
            };
            trace.push(TraceHit {
                owner: h.owner,
                egress: h.egress,
                index: h.index,
                action,
            });
        }
        records.push(FlowIn {
            interval: r.interval_start,
            src,
            dst,
            src_port,
            dst_port,
            proto,
            reporter_dest: r.reporter_dest,
            allowed: r.allowed,
            trace,
            tally: Tally {
                packets_in: to_i64(r.packets_in),
                packets_out: to_i64(r.packets_out),
                bytes_in: to_i64(r.bytes_in),
                bytes_out: to_i64(r.bytes_out),
                started: i64::from(r.connections_started),
                completed: i64::from(r.connections_completed),
                live: i64::from(r.connections_live),
            },
            original_dest,
        });
    }
    Ok(FlowBatch {
        records,
        agent_dropped: report.dropped,
    })
}

/// One side of a flow, named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Side {
    pub name: String,
    pub namespace: String,
    pub kind: EndpointType,
    pub labels: Labels,
}

/// Whether Felix counts `ip` as private (`pvt`): the three RFC 1918 IPv4 blocks only; every
/// other address, IPv6 ones included, is public (`pub`).
pub(crate) fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            o[0] == 10 || (o[0] == 172 && (o[1] & 0xf0) == 16) || (o[0] == 192 && o[1] == 168)
        }
        IpAddr::V6(_) => false,
    }
}

/// The namespace Calico's flow logs give what has none (a host endpoint, a global network
/// set, an address no endpoint or set holds).
pub(crate) const NO_NAMESPACE: &str = "-";

/// Labels as flow logs show them: `key=value`, without Calico's own `projectcalico.org/…`
/// labels, bounded.
fn flow_labels(l: Option<BTreeMap<String, String>>) -> Labels {
    labels(
        l.unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| !k.starts_with("projectcalico.org/"))
            .take(crate::flows::limits::MAX_LABELS)
            .map(|(k, v)| format!("{k}={v}"))
            .filter(|l| l.len() <= crate::flows::limits::MAX_LABEL)
            .collect(),
    )
}

/// A network parsed once: its family, its address as bits, its prefix length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Net {
    v4: bool,
    bits: u128,
    len: u8,
}

impl Net {
    /// `a.b.c.d/n`, an IPv6 net, or a bare address (a /32 or /128).
    fn parse(cidr: &str) -> Option<Net> {
        let (addr, len) = cidr.split_once('/').unwrap_or((cidr, ""));
        let ip: IpAddr = addr.parse().ok()?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let len: u8 = if len.is_empty() {
            max
        } else {
            len.parse().ok()?
        };
        (len <= max).then_some(Net {
            v4: ip.is_ipv4(),
            bits: bits(ip),
            len,
        })
    }

    fn contains(self, ip: IpAddr) -> bool {
        if self.v4 != ip.is_ipv4() {
            return false;
        }
        let shift = u32::from(if self.v4 { 32 } else { 128 } - self.len);
        shift >= 128 || (self.bits >> shift) == (bits(ip) >> shift)
    }
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v) => u128::from(u32::from(v)),
        IpAddr::V6(v) => u128::from(v),
    }
}

fn endpoint_side(e: EndpointView<'_>) -> Side {
    let labels = flow_labels(e.labels());
    match &e.model().kind {
        EndpointKind::Workload {
            workload_id,
            generate_name,
            ..
        } => Side {
            name: if generate_name.is_empty() {
                workload_id
                    .rsplit_once('/')
                    .map_or(workload_id.as_str(), |(_, pod)| pod)
                    .to_string()
            } else {
                format!("{generate_name}*")
            },
            namespace: e.key().namespace.clone().unwrap_or_default(),
            kind: EndpointType::WorkloadEndpoint,
            labels,
        },
        EndpointKind::Host { .. } => Side {
            name: e.node().to_string(),
            namespace: NO_NAMESPACE.to_string(),
            kind: EndpointType::HostEndpoint,
            labels,
        },
    }
}

/// Endpoints by address, built from the graph when first needed after a datastore change:
/// single addresses (`/32`, `/128`: nearly every endpoint's) in a map, wider nets in a list
/// searched in order.
#[derive(Default)]
pub(crate) struct IpIndex {
    exact: HashMap<IpAddr, Vec<ResourceKey>>,
    wide: Vec<(Net, ResourceKey)>,
    /// Every (Global)NetworkSet's nets, parsed.
    netsets: Vec<(Net, ResourceKey)>,
    built: bool,
}

impl IpIndex {
    fn build(&mut self, view: GraphView<'_>) {
        if self.built {
            return;
        }
        self.exact.clear();
        self.wide.clear();
        self.netsets.clear();
        for e in view.endpoints() {
            for net in e.nets() {
                let Some(n) = Net::parse(net) else {
                    continue;
                };
                if n.len == if n.v4 { 32 } else { 128 } {
                    let ip = if n.v4 {
                        IpAddr::from(std::net::Ipv4Addr::from(n.bits as u32))
                    } else {
                        IpAddr::from(std::net::Ipv6Addr::from(n.bits))
                    };
                    self.exact.entry(ip).or_default().push(e.key().clone());
                } else {
                    self.wide.push((n, e.key().clone()));
                }
            }
        }
        for (k, nets) in view.network_sets() {
            for n in nets.iter().filter_map(|n| Net::parse(n)) {
                self.netsets.push((n, k.clone()));
            }
        }
        self.built = true;
    }

    /// The endpoints holding `ip`.
    fn at<'g>(&self, view: GraphView<'g>, ip: IpAddr) -> impl Iterator<Item = EndpointView<'g>> {
        self.exact
            .get(&ip)
            .into_iter()
            .flatten()
            .chain(
                self.wide
                    .iter()
                    .filter(move |(net, _)| net.contains(ip))
                    .map(|(_, k)| k),
            )
            .filter_map(move |k| view.endpoint(k))
            .collect::<Vec<_>>()
            .into_iter()
    }
}

/// The endpoint holding `ip`: `node`'s own first, then the smallest key (by a scan of every
/// endpoint: what [`IpIndex`] answers faster).
#[cfg(test)]
fn endpoint_with_ip<'g>(
    view: GraphView<'g>,
    ip: IpAddr,
    node: Option<&str>,
) -> Option<EndpointView<'g>> {
    pick(view.endpoints_with_ip(ip), node)
}

fn pick<'g>(
    endpoints: impl Iterator<Item = EndpointView<'g>>,
    node: Option<&str>,
) -> Option<EndpointView<'g>> {
    endpoints.min_by(|a, b| {
        let own = |e: &EndpointView<'_>| node != Some(e.node());
        (own(a), a.key()).cmp(&(own(b), b.key()))
    })
}

/// Names an address that is not the reporting side's: an endpoint, a network set, else
/// `pub`/`pvt` (by a scan of every endpoint).
#[cfg(test)]
pub(crate) fn name_ip(view: GraphView<'_>, ip: IpAddr) -> Side {
    let mut index = IpIndex::default();
    index.build(view);
    name_ip_with(view, &index, endpoint_with_ip(view, ip, None), ip)
}

/// [`name_ip`] with the endpoint holding `ip` already looked up, and the network sets from
/// the index.
fn name_ip_with(
    view: GraphView<'_>,
    index: &IpIndex,
    endpoint: Option<EndpointView<'_>>,
    ip: IpAddr,
) -> Side {
    if let Some(e) = endpoint {
        return endpoint_side(e);
    }
    // The longest prefix; between equals, the smallest key.
    let best = index
        .netsets
        .iter()
        .filter(|(n, _)| n.contains(ip))
        .map(|(n, k)| (n.len, k))
        .max_by(|(la, ka), (lb, kb)| la.cmp(lb).then_with(|| kb.cmp(ka)));
    if let Some((_, k)) = best {
        return Side {
            name: k.name.clone(),
            namespace: k
                .namespace
                .clone()
                .unwrap_or_else(|| NO_NAMESPACE.to_string()),
            kind: EndpointType::NetworkSet,
            labels: flow_labels(view.network_set_labels(k)),
        };
    }
    Side {
        name: if is_private(ip) { "pvt" } else { "pub" }.to_string(),
        namespace: NO_NAMESPACE.to_string(),
        kind: EndpointType::Network,
        labels: Labels::default(),
    }
}

fn action(a: HitAction) -> GAction {
    match a {
        HitAction::Allow => GAction::Allow,
        HitAction::Deny => GAction::Deny,
        HitAction::Pass => GAction::Pass,
    }
}

/// A policy's Goldmane kind, and its name as Calico's flow logs show it.
pub(crate) fn policy_kind(kind: Kind, name: &str, tier: &str) -> (PolicyKind, String) {
    match kind {
        Kind::NetworkPolicy => match name.strip_prefix("knp.default.") {
            Some(k8s) => (PolicyKind::NetworkPolicy, k8s.to_string()),
            None => (PolicyKind::CalicoNetworkPolicy, name.to_string()),
        },
        Kind::GlobalNetworkPolicy => (PolicyKind::GlobalNetworkPolicy, name.to_string()),
        Kind::StagedNetworkPolicy => (PolicyKind::StagedNetworkPolicy, name.to_string()),
        Kind::StagedGlobalNetworkPolicy => {
            (PolicyKind::StagedGlobalNetworkPolicy, name.to_string())
        }
        Kind::StagedKubernetesNetworkPolicy => {
            (PolicyKind::StagedKubernetesNetworkPolicy, name.to_string())
        }
        Kind::ClusterNetworkPolicy
        | Kind::AdminNetworkPolicy
        | Kind::BaselineAdminNetworkPolicy
            if tier.contains("baseline") =>
        {
            (
                PolicyKind::ClusterNetworkPolicyBaselineTier,
                name.to_string(),
            )
        }
        Kind::ClusterNetworkPolicy
        | Kind::AdminNetworkPolicy
        | Kind::BaselineAdminNetworkPolicy => {
            (PolicyKind::ClusterNetworkPolicyAdminTier, name.to_string())
        }
        _ => (PolicyKind::KindUnspecified, name.to_string()),
    }
}

/// The Goldmane hit of a policy, without its indexes.
fn policy_hit(view: GraphView<'_>, kind: &str, namespace: &str, name: &str) -> PolicyHit {
    let kind = Kind::from_name(kind).unwrap_or(Kind::NetworkPolicy);
    let ns = (!namespace.is_empty()).then_some(namespace);
    let tier = view
        .policy(&ResourceKey::new(kind, ns, name))
        .map(|p| p.model().tier.clone())
        .unwrap_or_default();
    let (gkind, gname) = policy_kind(kind, name, &tier);
    PolicyHit {
        kind: gkind as i32,
        namespace: namespace.to_string(),
        name: gname,
        tier,
        ..Default::default()
    }
}

/// An endpoint's tier lists (none for no endpoint).
pub(crate) fn endpoint_tiers(e: Option<EndpointView<'_>>) -> Vec<pb::TierInfo> {
    match e.and_then(|e| e.update()) {
        Some(Payload::WorkloadEndpointUpdate(u)) => u.endpoint.map(|e| e.tiers),
        Some(Payload::HostEndpointUpdate(u)) => u.endpoint.map(|e| e.tiers),
        _ => None,
    }
    .unwrap_or_default()
}

/// The first policy of `tier` in an endpoint's tier lists ([`endpoint_tiers`]) for that
/// direction (staged ones only with `staged`: the lists carry them, but they are not
/// enforced).
fn first_of_tier(
    view: GraphView<'_>,
    tiers: &[pb::TierInfo],
    tier: &str,
    egress: bool,
    staged: bool,
) -> Option<PolicyHit> {
    let t = tiers.iter().find(|t| t.name == tier)?;
    let ids = if egress {
        &t.egress_policies
    } else {
        &t.ingress_policies
    };
    let id = ids
        .iter()
        .find(|id| staged || !Kind::from_name(&id.kind).is_some_and(Kind::is_staged))?;
    Some(policy_hit(view, &id.kind, &id.namespace, &id.name))
}

/// The enforced trace of a record as Goldmane hits.
pub(crate) fn enforced(
    view: GraphView<'_>,
    reporter_tiers: &[pb::TierInfo],
    trace: &[TraceHit],
) -> Vec<PolicyHit> {
    let mut out: Vec<PolicyHit> = Vec::with_capacity(trace.len());
    for (i, h) in trace.iter().enumerate() {
        let mut hit = match &h.owner {
            Owner::Policy {
                kind,
                namespace,
                name,
            } => PolicyHit {
                rule_index: i64::from(h.index),
                ..policy_hit(view, kind, namespace, name)
            },
            Owner::Profile(name) => PolicyHit {
                kind: PolicyKind::Profile as i32,
                name: name.clone(),
                tier: PROFILE_TIER.to_string(),
                rule_index: i64::from(h.index),
                ..Default::default()
            },
            Owner::EndOfTier(tier) => {
                let trigger = out
                    .iter()
                    .find(|p| p.tier == *tier && p.kind != PolicyKind::EndOfTier as i32)
                    .map(|p| PolicyHit {
                        trigger: None,
                        ..p.clone()
                    })
                    .or_else(|| first_of_tier(view, reporter_tiers, tier, h.egress, false));
                PolicyHit {
                    kind: PolicyKind::EndOfTier as i32,
                    tier: tier.clone(),
                    trigger: trigger.map(Box::new),
                    ..Default::default()
                }
            }
            Owner::NoProfileMatched => PolicyHit {
                kind: PolicyKind::EndOfTier as i32,
                tier: PROFILE_TIER.to_string(),
                ..Default::default()
            },
            Owner::DefaultAction | Owner::Failsafe => continue,
        };
        hit.action = action(h.action) as i32;
        hit.policy_index = i as i64;
        out.push(hit);
    }
    out
}

/// The pending trace of a record: the walk of its reporting side with staged policies
/// enforced, as explain computes it (`calc_graph::explain`'s pending verdict), in Goldmane
/// hits. Empty when no staged policy applies on the path (explain then has no pending verdict)
/// or when explain cannot place the packet.
pub(crate) fn pending(
    graph: &CalcGraph,
    explainer: &explain::Explainer<'_>,
    reporter_tiers: &[pb::TierInfo],
    r: &FlowIn,
) -> Vec<PolicyHit> {
    let ports = matches!(r.proto, 6 | 17 | 132);
    let query = explain::Query {
        from: r.src.to_string(),
        to: r.dst.to_string(),
        protocol: Some(r.proto.to_string()),
        port: ports.then(|| r.dst_port.to_string()),
        source_port: ports.then(|| r.src_port.to_string()),
    };
    let Ok(answer) = explainer.explain(&query) else {
        return Vec::new();
    };
    let Some(pending) = answer.pending else {
        return Vec::new();
    };
    let side = if r.reporter_dest {
        pending.ingress
    } else {
        pending.egress
    };
    let view = graph.view();
    let action_of = |a: &str| match a {
        "Allow" | "allow" => Some(GAction::Allow),
        "Pass" | "pass" => Some(GAction::Pass),
        "Deny" | "deny" => Some(GAction::Deny),
        _ => None,
    };
    let mut out: Vec<PolicyHit> = Vec::new();
    let mut first_selected: Vec<(String, PolicyHit)> = Vec::new();
    for step in &side.steps {
        let mut hit = match (&step.policy, &step.profile, &step.rule) {
            (Some(label), _, rule) => {
                let (namespace, name) = label.split_once('/').unwrap_or(("", label));
                let kind = step.kind.as_deref().unwrap_or_default();
                let base = policy_hit(view, kind, namespace, name);
                if step.selected == Some(true)
                    && let Some(tier) = &step.tier
                    && !first_selected.iter().any(|(t, _)| t == tier)
                {
                    first_selected.push((tier.clone(), base.clone()));
                }
                let Some(rule) = rule else { continue };
                let Some(a) = action_of(&rule.action) else {
                    continue;
                };
                PolicyHit {
                    action: a as i32,
                    rule_index: rule.index as i64,
                    ..base
                }
            }
            (None, Some(profile), Some(rule)) => {
                let Some(a) = action_of(&rule.action) else {
                    continue;
                };
                PolicyHit {
                    kind: PolicyKind::Profile as i32,
                    name: profile.clone(),
                    tier: PROFILE_TIER.to_string(),
                    action: a as i32,
                    rule_index: rule.index as i64,
                    ..Default::default()
                }
            }
            (None, None, _) if step.outcome.starts_with("end of tier (") => {
                let tier = step.tier.clone().unwrap_or_default();
                let trigger = out
                    .iter()
                    .find(|p| p.tier == tier && p.kind != PolicyKind::EndOfTier as i32)
                    .map(|p| PolicyHit {
                        trigger: None,
                        ..p.clone()
                    })
                    .or_else(|| {
                        first_selected
                            .iter()
                            .find(|(t, _)| *t == tier)
                            .map(|(_, h)| h.clone())
                    })
                    .or_else(|| first_of_tier(view, reporter_tiers, &tier, !r.reporter_dest, true));
                PolicyHit {
                    kind: PolicyKind::EndOfTier as i32,
                    tier,
                    action: GAction::Deny as i32,
                    trigger: trigger.map(Box::new),
                    ..Default::default()
                }
            }
            // "deny: no profile matched", "deny: no policy and no profile".
            (None, None, _) if step.outcome.starts_with("deny: no ") => PolicyHit {
                kind: PolicyKind::EndOfTier as i32,
                tier: PROFILE_TIER.to_string(),
                action: GAction::Deny as i32,
                ..Default::default()
            },
            _ => continue,
        };
        hit.policy_index = out.len() as i64;
        out.push(hit);
        if out.len() >= crate::flows::limits::MAX_HITS {
            break;
        }
    }
    out
}

/// The protocol's name as Calico's flow logs write it, else its number.
pub(crate) fn proto_name(p: u8) -> String {
    match p {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmp6".into(),
        132 => "sctp".into(),
        n => n.to_string(),
    }
}

/// What the pending traces say a staged policy decided.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StagedHits {
    pub packets: u64,
    pub bytes: u64,
    /// End of the latest interval counted (Unix seconds).
    pub last: i64,
}

/// The staged kind a pending hit names, as the graph spells it.
fn staged_kind(kind: i32) -> Option<&'static str> {
    match PolicyKind::try_from(kind).ok()? {
        PolicyKind::StagedNetworkPolicy => Some("StagedNetworkPolicy"),
        PolicyKind::StagedGlobalNetworkPolicy => Some("StagedGlobalNetworkPolicy"),
        PolicyKind::StagedKubernetesNetworkPolicy => Some("StagedKubernetesNetworkPolicy"),
        _ => None,
    }
}

/// The de-duplication key (per interval): reporting node (its number), 5-tuple and side.
type Seen = (u32, IpAddr, IpAddr, u16, u16, u8, bool);

/// A connection as both its sides report it: the 5-tuple after DNAT.
type Conn = (IpAddr, IpAddr, u16, u16, u8);

/// The Service port a record's destination names, as Felix looks it up: what the client
/// addressed (only known when the connection was translated) as a cluster or external IP of
/// a Service, else as a node port.
fn dest_service(view: GraphView<'_>, r: &FlowIn) -> Option<ServicePortRef> {
    let (ip, port) = r.original_dest?;
    view.service_at(ip, port, r.proto)
        .or_else(|| view.node_port_service(port, r.proto))
        .cloned()
}

/// Fills a flow key's destination service as Calico's flow logs do: `-` for what is not
/// known (no service, or a port without a name) and port 0.
fn set_dest_service(key: &mut FlowKey, service: Option<&ServicePortRef>) {
    let dash = || NO_NAMESPACE.to_string();
    let or_dash = |s: &str| if s.is_empty() { dash() } else { s.to_string() };
    match service {
        Some(s) => {
            key.dest_service_name = s.name.clone();
            key.dest_service_namespace = s.namespace.clone();
            key.dest_service_port_name = or_dash(&s.port_name);
            key.dest_service_port = i64::from(s.port);
        }
        None => {
            key.dest_service_name = dash();
            key.dest_service_namespace = dash();
            key.dest_service_port_name = dash();
            key.dest_service_port = 0;
        }
    }
}

/// What a pending trace depends on besides the graph: the reporting node, the 5-tuple (the
/// source port only when some rule matches source ports) and the reporting side.
type PendingKey = (IpAddr, IpAddr, u8, u16, Option<u16>, bool);

/// Most pending traces remembered until the graph changes (then all are forgotten).
const MAX_PENDING_CACHED: usize = 100_000;
/// Most addresses whose names are remembered (per node for its own side); beyond, the cache
/// starts again: peers on the internet are many, and an agent may report any address.
const MAX_NAMES_CACHED: usize = 100_000;

/// Whether any rule of a policy or profile matches on source ports (then a pending trace
/// depends on the source port too).
fn rules_match_source_ports(view: GraphView<'_>) -> bool {
    let any = |rules: &[pb::Rule]| {
        rules.iter().any(|r| {
            !r.src_ports.is_empty()
                || !r.not_src_ports.is_empty()
                || !r.src_named_port_ip_set_ids.is_empty()
                || !r.not_src_named_port_ip_set_ids.is_empty()
        })
    };
    view.policies().any(|p| {
        let m = p.message();
        any(&m.inbound_rules) || any(&m.outbound_rules)
    }) || view
        .profiles()
        .any(|p| any(&p.inbound_rules) || any(&p.outbound_rules))
}

/// One conversation of a node, as far as it decides the flow key: the reporting side's and
/// the peer's addresses, the destination port, the source port only when some rule matches
/// source ports (the pending trace may depend on it), protocol, side, verdict, trace and
/// destination service. Records that agree on these get the same key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Conversation {
    own: IpAddr,
    other: IpAddr,
    dst_port: u16,
    src_port: Option<u16>,
    proto: u8,
    reporter_dest: bool,
    allowed: bool,
    trace: Vec<TraceHit>,
    service: Option<ServicePortRef>,
}

/// A staged policy by kind (as the graph spells it), namespace and name.
type StagedId = (String, String, String);

/// What a conversation's records are stored as: the checked flow key with both sides'
/// labels, and the staged policies its pending trace names (each once).
#[derive(Debug)]
struct Conversed {
    flow: Arc<PreparedFlow>,
    staged: Vec<StagedId>,
}

/// Most conversations whose keys are remembered, over all nodes (then all are forgotten).
const MAX_CONVERSATIONS_CACHED: usize = 200_000;

/// What is remembered for one node.
#[derive(Default)]
struct NodeCache {
    /// The node's number in the de-duplication keys (kept for the server's life).
    id: u32,
    // Until the graph changes (cleared by `graph_changed`):
    /// Its own endpoint at an address (its key and named side), or none.
    own: FastMap<IpAddr, Option<(ResourceKey, Side)>>,
    /// The tier lists of its endpoint at an address (what an end of tier's trigger is read
    /// from), and whether a staged policy selects that endpoint.
    tiers: FastMap<IpAddr, (Arc<[pb::TierInfo]>, bool)>,
    /// The pending traces computed.
    pending: FastMap<PendingKey, Vec<PolicyHit>>,
    /// Each conversation's key, or why it was refused.
    conversations: FastMap<Conversation, Result<Arc<Conversed>, Refused>>,
}

impl NodeCache {
    fn clear(&mut self) {
        self.own.clear();
        self.tiers.clear();
        self.pending.clear();
        self.conversations.clear();
    }
}

/// The flow store and what was already received.
pub struct FlowIngest {
    pub store: FlowStore,
    index: IpIndex,
    /// Per staged policy (kind, namespace, name): the packets and bytes of the flows its rules
    /// decided in their pending traces, and the end of the latest such interval (Unix seconds).
    staged_hits: HashMap<StagedId, StagedHits>,
    seen: BTreeMap<i64, FastSet<Seen>>,
    seen_count: usize,
    max_seen: usize,
    /// Per interval, the destination service source reports named, by connection: a
    /// destination report of the same connection (whose node saw no translation) takes it.
    joined: BTreeMap<i64, FastMap<Conn, ServicePortRef>>,
    joined_count: usize,
    /// Per interval, the destination reports stored without a service, by connection, with
    /// what they counted: a source report of the same connection naming one later moves them
    /// to the key with it. Kept for the last intervals only ([`JOIN_SECONDS`]).
    unjoined: BTreeMap<i64, FastMap<Conn, (Arc<Conversed>, Tally)>>,
    unjoined_count: usize,
    /// Per node, what is remembered of it.
    nodes: HashMap<String, NodeCache>,
    /// How many pending traces and conversations the node caches hold, over all nodes.
    pending_count: usize,
    conversations_count: usize,
    // Until the graph changes (cleared by `graph_changed`):
    /// Addresses named as the other side of a flow.
    sides: FastMap<IpAddr, Side>,
    /// The staged policies; `None` until first needed.
    staged: Option<StagedPolicies>,
    /// Pending traces that may still be computed in this engine step (`None`: no limit; see
    /// [`FlowIngest::start_step`]).
    explain_budget: Option<usize>,
    /// Records whose pending trace waits for a later step's budget, oldest first, with their
    /// node.
    deferred: VecDeque<(String, FlowIn)>,
}

/// How long a destination report without a service waits for its source report (seconds
/// before `now`): an interval's reports arrive within about 20 s of its end.
const JOIN_SECONDS: i64 = 90;

/// Most records waiting for a pending trace; beyond, a record is dropped (`explain_backlog`).
const MAX_DEFERRED: usize = 100_000;

/// Why a record was dropped: the `calc_server_flow_reports_refused_total` reason.
pub(crate) fn refused_reason(r: &Refused) -> &'static str {
    match r {
        Refused::KeyCap { .. } => "key_cap",
        Refused::TooOld { .. } => "too_old",
        Refused::InFuture { .. } => "in_future",
        Refused::Invalid { .. } => "invalid",
    }
}

/// The staged policies of the graph, as the ingest needs them (once per graph generation).
struct StagedPolicies {
    keys: Vec<ResourceKey>,
    /// Whether some rule matches source ports (then a pending trace depends on the source
    /// port too).
    by_source_port: bool,
    /// Whether one selects a host endpoint (then any path may meet it, in a host's pre-DNAT or
    /// forward policies).
    on_host_endpoints: bool,
}

impl StagedPolicies {
    fn of(view: GraphView<'_>) -> StagedPolicies {
        let keys: Vec<ResourceKey> = view
            .policies()
            .filter(|p| p.key().kind.is_staged())
            .map(|p| p.key().clone())
            .collect();
        let on_host_endpoints = view.endpoints().any(|e| {
            matches!(e.model().kind, EndpointKind::Host { .. })
                && keys.iter().any(|k| e.selected_by(k))
        });
        StagedPolicies {
            by_source_port: !keys.is_empty() && rules_match_source_ports(view),
            on_host_endpoints,
            keys,
        }
    }
}

/// What naming a conversation reads and fills besides the node's cache.
struct Naming<'a, 'g> {
    graph: &'g CalcGraph,
    index: &'a IpIndex,
    sides: &'a mut FastMap<IpAddr, Side>,
    pending_count: &'a mut usize,
    staged: &'a StagedPolicies,
    /// Explain over this graph state, made when a first pending trace is needed.
    explainer: &'a std::cell::OnceCell<explain::Explainer<'g>>,
    /// Pending traces that may still be computed in this engine step (`None`: no limit).
    explain_budget: &'a mut Option<usize>,
}

/// The Goldmane key of a conversation first seen (both sides named, both traces), checked;
/// `None` when its pending trace needs explain and this step's budget for it is spent.
fn converse(
    n: &mut Naming<'_, '_>,
    cache: &mut NodeCache,
    own: (&ResourceKey, &Side),
    c: &Conversation,
    r: &FlowIn,
) -> Option<Result<Arc<Conversed>, Refused>> {
    let graph = n.graph;
    let (index, staged) = (n.index, n.staged);
    let view = graph.view();
    let (tiers, staged_selects) = cache
        .tiers
        .entry(c.own)
        .or_insert_with(|| {
            let e = view.endpoint(own.0);
            let selects = e.is_some_and(|e| staged.keys.iter().any(|k| e.selected_by(k)));
            (endpoint_tiers(e).into(), selects)
        })
        .clone();
    let sides = &mut *n.sides;
    let other_side = sides
        .entry(c.other)
        .or_insert_with(|| name_ip_with(view, index, pick(index.at(view, c.other), None), c.other))
        .clone();
    let (src, dst) = if c.reporter_dest {
        (other_side, own.1.clone())
    } else {
        (own.1.clone(), other_side)
    };
    let enforced_policies = enforced(view, &tiers, &c.trace);
    // Without a staged policy on the path the pending walk is the enforced one (Felix reports
    // it so); explain runs only when one may be met: one selects the reporting endpoint, or
    // some host endpoint.
    let mut walked = None;
    if staged_selects || staged.on_host_endpoints {
        let key: PendingKey = (
            r.src,
            r.dst,
            r.proto,
            r.dst_port,
            staged.by_source_port.then_some(r.src_port),
            r.reporter_dest,
        );
        walked = match cache.pending.get(&key) {
            Some(hit) => Some(hit.clone()),
            None => {
                if let Some(budget) = n.explain_budget.as_mut() {
                    *budget = budget.checked_sub(1)?;
                }
                let explainer = n.explainer.get_or_init(|| graph.explainer());
                let computed = pending(graph, explainer, &tiers, r);
                if *n.pending_count < MAX_PENDING_CACHED {
                    *n.pending_count += 1;
                    cache.pending.insert(key, computed.clone());
                }
                Some(computed)
            }
        };
    }
    let pending_policies = walked
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| enforced_policies.clone());
    let mut staged_ids: Vec<StagedId> = Vec::new();
    for h in &pending_policies {
        if let Some(kind) = staged_kind(h.kind) {
            let id = (kind.to_string(), h.namespace.clone(), h.name.clone());
            if !staged_ids.contains(&id) {
                staged_ids.push(id);
            }
        }
    }
    let mut key = FlowKey {
        source_name: src.name,
        source_namespace: src.namespace,
        source_type: src.kind as i32,
        dest_name: dst.name,
        dest_namespace: dst.namespace,
        dest_type: dst.kind as i32,
        dest_port: i64::from(c.dst_port),
        proto: proto_name(c.proto),
        reporter: if c.reporter_dest {
            Reporter::Dst
        } else {
            Reporter::Src
        } as i32,
        action: if c.allowed {
            GAction::Allow
        } else {
            GAction::Deny
        } as i32,
        policies: Some(PolicyTrace {
            enforced_policies,
            pending_policies,
        }),
        ..Default::default()
    };
    set_dest_service(&mut key, c.service.as_ref());
    Some(PreparedFlow::new(key, src.labels, dst.labels).map(|flow| {
        Arc::new(Conversed {
            flow,
            staged: staged_ids,
        })
    }))
}

impl FlowIngest {
    /// A store of at most `max_keys` flow keys; at most `max_seen` records remembered for
    /// de-duplication.
    pub fn new(max_keys: usize, max_seen: usize) -> FlowIngest {
        FlowIngest {
            store: FlowStore::new(max_keys, 0),
            index: IpIndex::default(),
            staged_hits: HashMap::new(),
            seen: BTreeMap::new(),
            seen_count: 0,
            max_seen,
            joined: BTreeMap::new(),
            joined_count: 0,
            unjoined: BTreeMap::new(),
            unjoined_count: 0,
            nodes: HashMap::new(),
            pending_count: 0,
            conversations_count: 0,
            sides: FastMap::default(),
            staged: None,
            explain_budget: None,
            deferred: VecDeque::new(),
        }
    }

    /// A new engine step: at most `budget` pending traces are computed by explain until the
    /// next (`None`: no limit). Records beyond it wait ([`FlowIngest::drain`]), so a burst of
    /// new conversations under staged policies does not hold the engine.
    pub(crate) fn start_step(&mut self, budget: Option<usize>) {
        self.explain_budget = budget;
    }

    /// Records waiting for a pending trace.
    pub(crate) fn deferred(&self) -> usize {
        self.deferred.len()
    }

    /// Stores waiting records, oldest first, while this step's budget lasts; returns how many
    /// were stored and what was dropped, by reason.
    pub(crate) fn drain(
        &mut self,
        graph: &CalcGraph,
        now: i64,
    ) -> (u64, BTreeMap<&'static str, u64>) {
        let (mut stored, mut dropped) = (0, BTreeMap::new());
        while self.explain_budget != Some(0) {
            let Some((node, r)) = self.deferred.pop_front() else {
                break;
            };
            let waiting = self.deferred.len();
            let d = self.add(graph, &node, vec![r], now);
            if self.deferred.len() > waiting {
                // Waits again: back to the front, in its turn.
                if let Some(again) = self.deferred.pop_back() {
                    self.deferred.push_front(again);
                }
                break;
            }
            if d.is_empty() {
                stored += 1;
            }
            for (reason, k) in d {
                *dropped.entry(reason).or_default() += k;
            }
        }
        (stored, dropped)
    }

    /// The service a source report of `conn` named in `interval` or the one either side of it
    /// (two nodes' clocks may put one connection's reports in neighbouring intervals).
    fn joined_service(&self, interval: i64, conn: &Conn) -> Option<&ServicePortRef> {
        [
            interval,
            interval - BUCKET_SECONDS,
            interval + BUCKET_SECONDS,
        ]
        .iter()
        .find_map(|i| self.joined.get(i)?.get(conn))
    }

    /// The datastore changed: endpoints' addresses are looked up afresh.
    pub(crate) fn graph_changed(&mut self) {
        self.index.built = false;
        for cache in self.nodes.values_mut() {
            cache.clear();
        }
        self.sides.clear();
        self.pending_count = 0;
        self.conversations_count = 0;
        self.staged = None;
    }

    /// What the pending traces say a staged policy (its kind as the graph spells it) decided.
    pub(crate) fn staged_hits(&self, kind: &str, namespace: &str, name: &str) -> StagedHits {
        self.staged_hits
            .get(&(kind.to_string(), namespace.to_string(), name.to_string()))
            .copied()
            .unwrap_or_default()
    }

    fn forget_old(&mut self, now: i64) {
        let oldest = self.store.oldest_bucket(now);
        while let Some(entry) = self.seen.first_entry() {
            if *entry.key() >= oldest {
                break;
            }
            self.seen_count -= entry.get().len();
            entry.remove();
        }
        while let Some(entry) = self.joined.first_entry() {
            if *entry.key() >= oldest {
                break;
            }
            self.joined_count -= entry.get().len();
            entry.remove();
        }
        let recent = now.saturating_sub(JOIN_SECONDS);
        while let Some(entry) = self.unjoined.first_entry() {
            if *entry.key() >= recent {
                break;
            }
            self.unjoined_count -= entry.get().len();
            entry.remove();
        }
    }

    /// A source report of `conn` in `interval` named `service`: a destination report of the
    /// same connection stored before without one (in that interval or either neighbour) moves
    /// to the key with it.
    fn join_late(&mut self, interval: i64, conn: &Conn, service: &ServicePortRef, now: i64) {
        for at in [
            interval,
            interval - BUCKET_SECONDS,
            interval + BUCKET_SECONDS,
        ] {
            let Some((old, tally)) = self.unjoined.get_mut(&at).and_then(|m| m.remove(conn)) else {
                continue;
            };
            self.unjoined_count -= 1;
            let mut key = old.flow.key().clone();
            set_dest_service(&mut key, Some(service));
            let (source_labels, dest_labels) = old.flow.labels();
            let Ok(flow) = PreparedFlow::new(key, source_labels, dest_labels) else {
                continue;
            };
            self.store.subtract(&old.flow, &tally, at);
            // The same counts under the new key: refused only when the key cap is reached
            // (the old key's entry was just freed, so rarely), then they stay lost.
            let _ = self.store.insert_prepared(&flow, &tally, at, now);
        }
    }

    /// Names `node`'s records and stores them at `now` (Unix seconds); returns what was
    /// dropped, by reason.
    pub fn add(
        &mut self,
        graph: &CalcGraph,
        node: &str,
        records: Vec<FlowIn>,
        now: i64,
    ) -> BTreeMap<&'static str, u64> {
        self.forget_old(now);
        let view = graph.view();
        if !self.index.built {
            // Forget the counts of staged policies that are gone.
            self.staged_hits.retain(|(kind, ns, name), _| {
                Kind::from_name(kind).is_some_and(|k| {
                    view.policy(&ResourceKey::new(k, (!ns.is_empty()).then_some(ns), name))
                        .is_some()
                })
            });
        }
        self.index.build(view);
        // Taken out while `self` is borrowed record by record (put back at the end).
        let staged_now = self
            .staged
            .take()
            .unwrap_or_else(|| StagedPolicies::of(view));
        let staged = &staged_now;
        let explainer = std::cell::OnceCell::new();
        // The node's own caches, taken out while `self` is borrowed record by record.
        let next_id = u32::try_from(self.nodes.len()).unwrap_or(u32::MAX);
        let mut cache = self.nodes.remove(node).unwrap_or_else(|| NodeCache {
            id: next_id,
            ..NodeCache::default()
        });
        if cache.own.len() > MAX_NAMES_CACHED {
            cache.own.clear();
        }
        if self.sides.len() > MAX_NAMES_CACHED {
            self.sides.clear();
        }
        let mut dropped = BTreeMap::new();
        for mut r in records {
            let (own_ip, other_ip) = if r.reporter_dest {
                (r.dst, r.src)
            } else {
                (r.src, r.dst)
            };
            let index = &self.index;
            let own_entry = cache.own.entry(own_ip).or_insert_with(|| {
                pick(index.at(view, own_ip), Some(node))
                    .filter(|e| e.node() == node)
                    .map(|e| (e.key().clone(), endpoint_side(e)))
            });
            let Some(own) = own_entry.as_ref() else {
                *dropped.entry("foreign").or_default() += 1;
                continue;
            };
            let seen: Seen = (
                cache.id,
                r.src,
                r.dst,
                r.src_port,
                r.dst_port,
                r.proto,
                r.reporter_dest,
            );
            if self
                .seen
                .get(&r.interval)
                .is_some_and(|s| s.contains(&seen))
            {
                *dropped.entry("duplicate").or_default() += 1;
                continue;
            }
            if self.seen_count >= self.max_seen {
                *dropped.entry("dedup_cap").or_default() += 1;
                continue;
            }
            let conn: Conn = (r.src, r.dst, r.src_port, r.dst_port, r.proto);
            let service = dest_service(view, &r).or_else(|| {
                r.reporter_dest
                    .then(|| self.joined_service(r.interval, &conn).cloned())
                    .flatten()
            });
            if !r.reporter_dest
                && let Some(svc) = &service
            {
                if self.joined_count < self.max_seen
                    && self
                        .joined
                        .entry(r.interval)
                        .or_default()
                        .insert(conn, svc.clone())
                        .is_none()
                {
                    self.joined_count += 1;
                }
                if self.unjoined_count > 0 {
                    self.join_late(r.interval, &conn, svc, now);
                }
            }
            let unjoined = r.reporter_dest && service.is_none();
            let conversation = Conversation {
                own: own_ip,
                other: other_ip,
                dst_port: r.dst_port,
                src_port: staged.by_source_port.then_some(r.src_port),
                proto: r.proto,
                reporter_dest: r.reporter_dest,
                allowed: r.allowed,
                trace: std::mem::take(&mut r.trace),
                service,
            };
            let conversed = match cache.conversations.get(&conversation) {
                Some(c) => c.clone(),
                None => {
                    let (own_key, own_side) = (own.0.clone(), own.1.clone());
                    let mut naming = Naming {
                        graph,
                        index: &self.index,
                        sides: &mut self.sides,
                        pending_count: &mut self.pending_count,
                        staged,
                        explainer: &explainer,
                        explain_budget: &mut self.explain_budget,
                    };
                    let Some(c) = converse(
                        &mut naming,
                        &mut cache,
                        (&own_key, &own_side),
                        &conversation,
                        &r,
                    ) else {
                        // This step's explain budget is spent: the record waits for the next.
                        r.trace = conversation.trace;
                        if self.deferred.len() < MAX_DEFERRED {
                            self.deferred.push_back((node.to_string(), r));
                        } else {
                            *dropped.entry("explain_backlog").or_default() += 1;
                        }
                        continue;
                    };
                    if self.conversations_count >= MAX_CONVERSATIONS_CACHED {
                        for other in self.nodes.values_mut() {
                            other.conversations.clear();
                        }
                        cache.conversations.clear();
                        self.conversations_count = 0;
                    }
                    self.conversations_count += 1;
                    cache.conversations.insert(conversation, c.clone());
                    c
                }
            };
            let conversed = match conversed {
                Ok(c) => c,
                Err(e) => {
                    let e = self.store.refuse(e);
                    *dropped.entry(refused_reason(&e)).or_default() += 1;
                    continue;
                }
            };
            let t = &r.tally;
            match self
                .store
                .insert_prepared(&conversed.flow, t, r.interval, now)
            {
                Ok(()) => {
                    self.seen.entry(r.interval).or_default().insert(seen);
                    self.seen_count += 1;
                    if unjoined
                        && self.unjoined_count < self.max_seen
                        && self
                            .unjoined
                            .entry(r.interval)
                            .or_default()
                            .insert(conn, (conversed.clone(), *t))
                            .is_none()
                    {
                        self.unjoined_count += 1;
                    }
                    let end = r.interval + BUCKET_SECONDS;
                    for id in &conversed.staged {
                        let e = match self.staged_hits.get_mut(id) {
                            Some(e) => e,
                            None => self.staged_hits.entry(id.clone()).or_default(),
                        };
                        e.packets = e
                            .packets
                            .saturating_add(t.packets_in.saturating_add(t.packets_out) as u64);
                        e.bytes = e
                            .bytes
                            .saturating_add(t.bytes_in.saturating_add(t.bytes_out) as u64);
                        e.last = e.last.max(end);
                    }
                }
                Err(e) => *dropped.entry(refused_reason(&e)).or_default() += 1,
            }
        }
        self.nodes.insert(node.to_string(), cache);
        self.staged = Some(staged_now);
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calc_graph::graph::{CalcGraph, Update};
    use calc_graph::manifest::{Outcome, decode_and_validate};
    use serde_json::json;

    fn apply(g: &mut CalcGraph, value: serde_json::Value) {
        match decode_and_validate(value) {
            Outcome::Valid(_, res) => g.apply(Update::ApplyValid(res)).unwrap(),
            _ => panic!("test object must be valid"),
        }
    }

    /// node-a: pod shop/web-1 (10.0.0.1) and host endpoint a-eth0 (192.168.1.1); node-b: pod
    /// shop/db-1 (10.0.0.2); a NetworkSet shop/partners (203.0.113.0/24) inside a
    /// GlobalNetworkSet wide (203.0.0.0/16); tier security with a policy selecting web.
    fn graph() -> CalcGraph {
        let mut g = CalcGraph::new();
        for (node, pod, ip) in [
            ("node-a", "web-1", "10.0.0.1"),
            ("node-b", "db-1", "10.0.0.2"),
        ] {
            apply(
                &mut g,
                json!({
                    "apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
                    "metadata": {
                        "name": format!("{}-k8s-{}-eth0", node.replace('-', "--"), pod.replace('-', "--")),
                        "namespace": "shop",
                        "labels": {"app": pod.split('-').next().unwrap(), "projectcalico.org/namespace": "shop"},
                        "generateName": if pod == "db-1" { Some("db-") } else { None },
                    },
                    "spec": {
                        "orchestrator": "k8s", "node": node, "pod": pod, "endpoint": "eth0",
                        "interfaceName": format!("cali{pod}"), "ipNetworks": [format!("{ip}/32")],
                    },
                }),
            );
        }
        apply(
            &mut g,
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "HostEndpoint",
                "metadata": {"name": "a-eth0", "labels": {"host": "a"}},
                "spec": {"node": "node-a", "interfaceName": "eth0", "expectedIPs": ["192.168.1.1"]},
            }),
        );
        apply(
            &mut g,
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "NetworkSet",
                "metadata": {"name": "partners", "namespace": "shop", "labels": {"kind": "partner"}},
                "spec": {"nets": ["203.0.113.0/24"]},
            }),
        );
        apply(
            &mut g,
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkSet",
                "metadata": {"name": "wide"},
                "spec": {"nets": ["203.0.0.0/16"]},
            }),
        );
        apply(
            &mut g,
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "Tier",
                "metadata": {"name": "security"}, "spec": {"order": 10},
            }),
        );
        apply(
            &mut g,
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
                "metadata": {"name": "security.guard"},
                "spec": {"tier": "security", "selector": "app == 'web'",
                         "ingress": [{"action": "Pass", "protocol": "TCP"}]},
            }),
        );
        g.apply(Update::InSync).unwrap();
        g
    }

    /// [`graph`] with a staged policy in tier security denying TCP to web on port 80.
    fn with_staged() -> CalcGraph {
        let mut g = graph();
        apply(
            &mut g,
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "StagedGlobalNetworkPolicy",
                "metadata": {"name": "security.trial"},
                "spec": {"tier": "security", "order": 1, "selector": "app == 'web'",
                         "ingress": [{"action": "Deny", "protocol": "TCP",
                                      "destination": {"ports": [80]}}]},
            }),
        );
        g
    }

    /// The traces of the first flow the store lists at `now`.
    fn first_trace(ingest: &mut FlowIngest, now: i64) -> PolicyTrace {
        let list = ingest
            .store
            .list(&crate::flows::FlowListRequest::default(), now)
            .unwrap();
        let key = list.flows[0].flow.as_ref().unwrap().key.as_ref().unwrap();
        key.policies.clone().unwrap()
    }

    #[test]
    fn explain_runs_only_where_a_staged_policy_may_be_met() {
        let g = with_staged();
        let staged = StagedPolicies::of(g.view());
        assert_eq!(staged.keys.len(), 1);
        assert!(!staged.on_host_endpoints && !staged.by_source_port);
        // db (node-b) is not selected by the staged policy: its pending trace is its
        // enforced one, as the agent reported it.
        let r = record("10.0.0.1", "10.0.0.2", true, vec![guard(HitAction::Pass)]);
        let mut ingest = FlowIngest::new(100, 100);
        assert!(ingest.add(&g, "node-b", vec![r], 1_800_000_020).is_empty());
        let trace = first_trace(&mut ingest, 1_800_000_020);
        assert_eq!(trace.pending_policies, trace.enforced_policies);
        assert_eq!(trace.enforced_policies[0].name, "security.guard");
        // A staged policy selecting a host endpoint may be met on any path.
        let mut g = with_staged();
        apply(
            &mut g,
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "StagedGlobalNetworkPolicy",
                "metadata": {"name": "security.hosts"},
                "spec": {"tier": "security", "order": 2, "selector": "host == 'a'",
                         "applyOnForward": true, "ingress": [{"action": "Deny"}]},
            }),
        );
        let staged = StagedPolicies::of(g.view());
        assert_eq!(staged.keys.len(), 2);
        assert!(staged.on_host_endpoints);
    }

    #[test]
    fn pending_traces_beyond_a_steps_budget_wait_for_the_next_step() {
        let g = with_staged();
        let now = 1_800_000_020;
        let to_web = |src: &str, src_port: u16| FlowIn {
            src_port,
            ..record(src, "10.0.0.1", true, vec![guard(HitAction::Pass)])
        };
        let mut ingest = FlowIngest::new(100, 100);
        ingest.start_step(Some(1));
        // Two new conversations with web, which a staged policy selects: one explain allowed.
        let d = ingest.add(
            &g,
            "node-a",
            vec![to_web("203.0.113.9", 1000), to_web("203.0.113.10", 1000)],
            now,
        );
        assert!(d.is_empty(), "{d:?}");
        assert_eq!((ingest.store.num_keys(), ingest.deferred()), (1, 1));
        // A further record of the first conversation needs no explain: stored at once.
        assert!(
            ingest
                .add(&g, "node-a", vec![to_web("203.0.113.9", 1001)], now)
                .is_empty()
        );
        assert_eq!(ingest.deferred(), 1);
        // The budget spent, nothing drains; the next step's budget stores the waiting record.
        assert_eq!(ingest.drain(&g, now), (0, BTreeMap::new()));
        ingest.start_step(Some(5));
        assert_eq!(ingest.drain(&g, now), (1, BTreeMap::new()));
        assert_eq!(ingest.deferred(), 0);
        // Both peers are in the network set `partners`: one key, three records of 3 packets.
        let list = ingest
            .store
            .list(&crate::flows::FlowListRequest::default(), now)
            .unwrap();
        let flow = list.flows[0].flow.as_ref().unwrap();
        assert_eq!((list.flows.len(), flow.packets_in), (1, 9));
        let key = flow.key.as_ref().unwrap();
        let pending = &key.policies.as_ref().unwrap().pending_policies;
        assert_eq!(pending[0].name, "security.trial", "{key:?}");
        // Without a budget (the default) nothing waits.
        let mut unbounded = FlowIngest::new(100, 100);
        unbounded.add(&g, "node-a", vec![to_web("203.0.113.11", 1)], now);
        assert_eq!(unbounded.deferred(), 0);
    }

    #[test]
    fn the_pending_trace_enforces_staged_policies() {
        let g = with_staged();
        let web = endpoint_with_ip(g.view(), ip("10.0.0.1"), Some("node-a"));
        let r = record(
            "203.0.113.9",
            "10.0.0.1",
            true,
            vec![guard(HitAction::Pass)],
        );
        assert_eq!(
            pending(&g, &g.explainer(), &endpoint_tiers(web), &r),
            [PolicyHit {
                kind: PolicyKind::StagedGlobalNetworkPolicy as i32,
                name: "security.trial".into(),
                tier: "security".into(),
                action: GAction::Deny as i32,
                ..Default::default()
            }]
        );
        // Port 81: the staged policy does not match; guard passes; web has no policy in
        // another tier and no profile: the final drop.
        let other = FlowIn {
            dst_port: 81,
            ..r.clone()
        };
        let hits = pending(&g, &g.explainer(), &endpoint_tiers(web), &other);
        assert_eq!(
            hits.iter()
                .map(|h| (
                    h.kind,
                    h.name.as_str(),
                    h.tier.as_str(),
                    h.action,
                    h.policy_index
                ))
                .collect::<Vec<_>>(),
            [
                (
                    PolicyKind::GlobalNetworkPolicy as i32,
                    "security.guard",
                    "security",
                    GAction::Pass as i32,
                    0
                ),
                (
                    PolicyKind::EndOfTier as i32,
                    "",
                    "__PROFILE__",
                    GAction::Deny as i32,
                    1
                ),
            ],
            "{hits:?}"
        );
        // Without a staged policy there is no pending trace.
        let plain = graph();
        assert!(pending(&plain, &plain.explainer(), &endpoint_tiers(web), &r).is_empty());
        // Stored with the record.
        let mut ingest = FlowIngest::new(100, 100);
        assert!(ingest.add(&g, "node-a", vec![r], 1_800_000_020).is_empty());
        let trace = first_trace(&mut ingest, 1_800_000_020);
        assert_eq!(trace.pending_policies.len(), 1);
        assert_eq!(trace.enforced_policies.len(), 1);
        // The staged policy's hits: the record's packets and bytes, in and out.
        assert_eq!(
            ingest.staged_hits("StagedGlobalNetworkPolicy", "", "security.trial"),
            StagedHits {
                packets: 3,
                bytes: 180,
                last: 1_800_000_015
            }
        );
        assert_eq!(
            ingest.staged_hits("StagedGlobalNetworkPolicy", "", "other"),
            StagedHits::default()
        );
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn each_side_is_named_from_the_graph() {
        let g = graph();
        let v = g.view();
        let side = |a: &str| {
            let s = name_ip(v, ip(a));
            (s.name, s.namespace, s.kind, s.labels.to_vec())
        };
        assert_eq!(
            side("10.0.0.2"),
            (
                // A pod made from a generateName is named by it, as Calico aggregates replicas;
                // Calico's own labels are left out.
                "db-*".into(),
                "shop".into(),
                EndpointType::WorkloadEndpoint,
                vec!["app=db".to_string()]
            )
        );
        assert_eq!(
            side("10.0.0.1").0,
            "web-1",
            "no generateName: the pod's name"
        );
        // A host endpoint is named by its node, in no namespace.
        assert_eq!(
            side("192.168.1.1"),
            (
                "node-a".into(),
                "-".into(),
                EndpointType::HostEndpoint,
                vec!["host=a".to_string()]
            )
        );
        // The longest prefix wins: the namespaced /24 over the global /16; a set's labels.
        assert_eq!(
            side("203.0.113.9"),
            (
                "partners".into(),
                "shop".into(),
                EndpointType::NetworkSet,
                vec!["kind=partner".to_string()]
            )
        );
        assert_eq!(
            (side("203.0.7.7").0, side("203.0.7.7").1),
            ("wide".into(), "-".into())
        );
        assert_eq!(
            side("8.8.8.8"),
            (
                "pub".into(),
                "-".into(),
                EndpointType::Network,
                Vec::<String>::new()
            )
        );
        for private in ["10.9.9.9", "172.16.0.1", "172.31.255.255", "192.168.7.7"] {
            assert_eq!(side(private).0, "pvt", "{private}");
        }
        // Felix's private blocks are IPv4 only: a unique local IPv6 address is public.
        for public in [
            "172.32.0.1",
            "11.0.0.1",
            "2001:db8::1",
            "fe80::1",
            "fd00::1",
        ] {
            assert_eq!(side(public).0, "pub", "{public}");
        }
        // The index answers as the scan does.
        let mut index = IpIndex::default();
        index.build(v);
        for a in [
            "10.0.0.1",
            "10.0.0.2",
            "192.168.1.1",
            "203.0.113.9",
            "8.8.8.8",
        ] {
            let indexed = name_ip_with(v, &index, pick(index.at(v, ip(a)), None), ip(a));
            assert_eq!(indexed, name_ip(v, ip(a)), "{a}");
        }
    }

    #[test]
    fn a_new_endpoint_is_named_after_the_graph_changes() {
        let mut g = graph();
        let mut ingest = FlowIngest::new(100, 100);
        let now = 1_800_000_020;
        let to_new = || record("10.0.0.1", "10.0.0.9", false, vec![]);
        assert!(ingest.add(&g, "node-a", vec![to_new()], now).is_empty());
        apply(
            &mut g,
            json!({
                "apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
                "metadata": {"name": "node--b-k8s-new--1-eth0", "namespace": "shop",
                             "labels": {"projectcalico.org/namespace": "shop"}},
                "spec": {"orchestrator": "k8s", "node": "node-b", "pod": "new-1",
                         "endpoint": "eth0", "interfaceName": "calinew",
                         "ipNetworks": ["10.0.0.9/32"]},
            }),
        );
        ingest.graph_changed();
        let again = FlowIn {
            src_port: 40_001,
            ..to_new()
        };
        assert!(ingest.add(&g, "node-a", vec![again], now).is_empty());
        let list = ingest
            .store
            .list(&crate::flows::FlowListRequest::default(), now)
            .unwrap();
        let mut names: Vec<String> = list
            .flows
            .iter()
            .map(|r| {
                r.flow
                    .as_ref()
                    .unwrap()
                    .key
                    .as_ref()
                    .unwrap()
                    .dest_name
                    .clone()
            })
            .collect();
        names.sort();
        assert_eq!(names, ["new-1", "pvt"]);
    }

    fn record(src: &str, dst: &str, reporter_dest: bool, trace: Vec<TraceHit>) -> FlowIn {
        FlowIn {
            interval: 1_800_000_000,
            src: ip(src),
            dst: ip(dst),
            src_port: 40_000,
            dst_port: 80,
            proto: 6,
            reporter_dest,
            allowed: false,
            trace,
            tally: Tally {
                packets_in: 3,
                bytes_in: 180,
                started: 1,
                live: 1,
                ..Tally::default()
            },
            original_dest: None,
        }
    }

    fn guard(action: HitAction) -> TraceHit {
        TraceHit {
            owner: Owner::Policy {
                kind: "GlobalNetworkPolicy".into(),
                namespace: String::new(),
                name: "security.guard".into(),
            },
            egress: false,
            index: 0,
            action,
        }
    }

    fn end_of_tier(tier: &str) -> TraceHit {
        TraceHit {
            owner: Owner::EndOfTier(tier.into()),
            egress: false,
            index: 0,
            action: HitAction::Deny,
        }
    }

    #[test]
    fn the_trace_names_tiers_kinds_indexes_and_end_of_tier_triggers() {
        let g = graph();
        let v = g.view();
        let web = endpoint_with_ip(v, ip("10.0.0.1"), Some("node-a"));
        let guard_hit = PolicyHit {
            kind: PolicyKind::GlobalNetworkPolicy as i32,
            name: "security.guard".into(),
            tier: "security".into(),
            action: GAction::Pass as i32,
            ..Default::default()
        };
        let web = &endpoint_tiers(web);
        let hits = enforced(
            v,
            web,
            &[
                guard(HitAction::Pass),
                end_of_tier("default"),
                TraceHit {
                    owner: Owner::Profile("kns.shop".into()),
                    egress: false,
                    index: 2,
                    action: HitAction::Allow,
                },
            ],
        );
        assert_eq!(hits.len(), 3);
        assert_eq!(hits[0], guard_hit);
        // No policy of tier default in the trace or selecting web: no trigger.
        assert_eq!(
            hits[1],
            PolicyHit {
                kind: PolicyKind::EndOfTier as i32,
                tier: "default".into(),
                action: GAction::Deny as i32,
                policy_index: 1,
                ..Default::default()
            }
        );
        assert_eq!(
            hits[2],
            PolicyHit {
                kind: PolicyKind::Profile as i32,
                name: "kns.shop".into(),
                tier: "__PROFILE__".into(),
                action: GAction::Allow as i32,
                policy_index: 2,
                rule_index: 2,
                ..Default::default()
            }
        );
        // The trigger of an end of tier: the tier's policy earlier in the trace, else the
        // first of the tier selecting the endpoint.
        let after = enforced(v, web, &[guard(HitAction::Deny), end_of_tier("security")]);
        let from_graph = enforced(v, web, &[end_of_tier("security")]);
        let trigger = Some(Box::new(PolicyHit {
            action: GAction::Deny as i32,
            ..guard_hit.clone()
        }));
        assert_eq!(after[1].trigger, trigger);
        assert_eq!(
            from_graph[0].trigger,
            Some(Box::new(PolicyHit {
                action: 0,
                ..guard_hit
            }))
        );
        assert_eq!(
            policy_kind(Kind::NetworkPolicy, "knp.default.db", "default"),
            (PolicyKind::NetworkPolicy, "db".into())
        );
        assert_eq!(
            policy_kind(Kind::NetworkPolicy, "db", "default"),
            (PolicyKind::CalicoNetworkPolicy, "db".into())
        );
    }

    /// Ingest cost per record: `cargo test -p calc-server --release --lib
    /// ingest_rate -- --ignored --nocapture`. 1,000 pods on 10 nodes, reports of 500
    /// records (a pod to another pod, new 5-tuples), no staged policy.
    #[test]
    #[ignore = "a measurement, run by hand"]
    fn ingest_rate() {
        let mut g = CalcGraph::new();
        for i in 0..1000u32 {
            let node = format!("node-{}", i % 10);
            apply(
                &mut g,
                json!({
                    "apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
                    "metadata": {
                        "name": format!("{}-k8s-pod--{i}-eth0", node.replace('-', "--")),
                        "namespace": "shop",
                        "labels": {"app": format!("a{}", i % 20), "projectcalico.org/namespace": "shop"},
                    },
                    "spec": {
                        "orchestrator": "k8s", "node": node, "pod": format!("pod-{i}"),
                        "endpoint": "eth0", "interfaceName": format!("cali{i}"),
                        "ipNetworks": [format!("10.1.{}.{}/32", i / 250, i % 250)],
                    },
                }),
            );
        }
        g.apply(Update::InSync).unwrap();
        let mut ingest = FlowIngest::new(1_000_000, 4_000_000);
        let now = 1_800_000_030;
        let total = 200_000u32;
        let start = std::time::Instant::now();
        for batch in 0..total / 500 {
            let node_i = batch % 10;
            let records: Vec<FlowIn> = (0..500u32)
                .map(|k| {
                    let dst = node_i + 10 * ((batch * 7 + k) % 100);
                    let src = (dst + 1 + k % 997) % 1000;
                    FlowIn {
                        src_port: (10_000 + batch * 500 + k) as u16,
                        dst_port: (80 + k % 3) as u16,
                        ..record(
                            &format!("10.1.{}.{}", src / 250, src % 250),
                            &format!("10.1.{}.{}", dst / 250, dst % 250),
                            true,
                            vec![guard(HitAction::Allow)],
                        )
                    }
                })
                .collect();
            let dropped = ingest.add(&g, &format!("node-{node_i}"), records, now);
            assert!(dropped.is_empty(), "{dropped:?}");
        }
        let took = start.elapsed();
        eprintln!(
            "{total} records in {took:?}: {:.2} µs per record, {:.0} records/s, {} keys",
            took.as_secs_f64() * 1e6 / f64::from(total),
            f64::from(total) / took.as_secs_f64(),
            ingest.store.num_keys()
        );
    }

    #[test]
    fn a_node_reports_only_its_own_side_and_once_per_interval() {
        let g = graph();
        let mut ingest = FlowIngest::new(100, 100);
        let now = 1_800_000_000 + 20;
        let inbound = record(
            "203.0.113.9",
            "10.0.0.1",
            true,
            vec![guard(HitAction::Deny)],
        );
        let dropped = ingest.add(&g, "node-a", vec![inbound.clone()], now);
        assert!(dropped.is_empty(), "{dropped:?}");
        // node-b may not report web-1's side, nor a side that is no endpoint.
        let dropped = ingest.add(
            &g,
            "node-b",
            vec![inbound.clone(), record("10.0.0.2", "8.8.8.8", true, vec![])],
            now,
        );
        assert_eq!(dropped, BTreeMap::from([("foreign", 2)]));
        // The same record again (a re-send after a reconnect) counts once.
        let dropped = ingest.add(&g, "node-a", vec![inbound.clone()], now);
        assert_eq!(dropped, BTreeMap::from([("duplicate", 1)]));
        // The source's own report is another record of the same interval.
        let outbound = record("10.0.0.2", "10.0.0.1", false, vec![]);
        assert!(ingest.add(&g, "node-b", vec![outbound], now).is_empty());
        let list = ingest
            .store
            .list(&crate::flows::FlowListRequest::default(), now)
            .unwrap();
        assert_eq!(list.flows.len(), 2);
        let key = |i: usize| list.flows[i].flow.as_ref().unwrap().key.clone().unwrap();
        let keys = [key(0), key(1)];
        let denied = keys
            .iter()
            .find(|k| k.reporter == Reporter::Dst as i32)
            .unwrap();
        assert_eq!(
            (
                denied.source_name.as_str(),
                denied.source_namespace.as_str(),
                denied.source_type,
                denied.dest_name.as_str(),
                denied.dest_port,
                denied.proto.as_str(),
                denied.action,
            ),
            (
                "partners",
                "shop",
                EndpointType::NetworkSet as i32,
                "web-1",
                80,
                "tcp",
                GAction::Deny as i32
            )
        );
        let f = list
            .flows
            .iter()
            .map(|r| r.flow.as_ref().unwrap())
            .find(|f| f.key.as_ref().unwrap().reporter == Reporter::Dst as i32)
            .unwrap();
        assert_eq!((f.packets_in, f.bytes_in), (3, 180));
        // Records remembered are bounded.
        let mut small = FlowIngest::new(100, 1);
        let two = vec![
            record("203.0.113.9", "10.0.0.1", true, vec![]),
            record("203.0.113.8", "10.0.0.1", true, vec![]),
        ];
        assert_eq!(
            small.add(&g, "node-a", two, now),
            BTreeMap::from([("dedup_cap", 1)])
        );
    }

    #[test]
    fn the_destination_service_is_named_and_joined_to_the_destination_report() {
        let mut g = graph();
        apply(
            &mut g,
            json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "web", "namespace": "shop"},
                "spec": {"clusterIP": "10.96.0.10",
                         "ports": [{"name": "http", "port": 8080, "nodePort": 30080},
                                   {"port": 9090}]},
            }),
        );
        let mut ingest = FlowIngest::new(100, 100);
        let now = 1_800_000_000 + 20;
        let service_of = |ingest: &mut FlowIngest, reporter: Reporter, port: i64| {
            let list = ingest
                .store
                .list(&crate::flows::FlowListRequest::default(), now)
                .unwrap();
            list.flows
                .iter()
                .filter_map(|r| r.flow.as_ref()?.key.clone())
                .find(|k| k.reporter == reporter as i32 && k.dest_port == port)
                .map(|k| {
                    (
                        k.dest_service_name,
                        k.dest_service_namespace,
                        k.dest_service_port_name,
                        k.dest_service_port,
                    )
                })
                .unwrap_or_else(|| panic!("no {reporter:?} flow to port {port}"))
        };
        // db-1 (node-b) dialled the Service's cluster IP; the policy saw web-1:80.
        let mut src = record("10.0.0.2", "10.0.0.1", false, vec![]);
        src.original_dest = Some((ip("10.96.0.10"), 8080));
        assert!(ingest.add(&g, "node-b", vec![src], now).is_empty());
        let web = (
            "web".to_string(),
            "shop".to_string(),
            "http".to_string(),
            8080,
        );
        assert_eq!(service_of(&mut ingest, Reporter::Src, 80), web);
        // web-1's node saw no translation: its report of the same connection is joined.
        let dst = record("10.0.0.2", "10.0.0.1", true, vec![]);
        assert!(ingest.add(&g, "node-a", vec![dst], now).is_empty());
        assert_eq!(service_of(&mut ingest, Reporter::Dst, 80), web);
        // The other order: web-1's report of a second connection (port 8081) comes first,
        // without a service, then db-1's naming it. It moves to the key with the service;
        // none stays without.
        let mut late_src = record("10.0.0.2", "10.0.0.1", false, vec![]);
        late_src.dst_port = 8081;
        late_src.original_dest = Some((ip("10.96.0.10"), 8080));
        let mut early_dst = record("10.0.0.2", "10.0.0.1", true, vec![]);
        early_dst.dst_port = 8081;
        assert!(ingest.add(&g, "node-a", vec![early_dst], now).is_empty());
        let none = ("-".to_string(), "-".to_string(), "-".to_string(), 0);
        assert_eq!(service_of(&mut ingest, Reporter::Dst, 8081), none);
        let keys = ingest.store.num_keys();
        assert!(ingest.add(&g, "node-b", vec![late_src], now).is_empty());
        assert_eq!(service_of(&mut ingest, Reporter::Dst, 8081), web);
        let dst_flows: Vec<_> = ingest
            .store
            .list(&crate::flows::FlowListRequest::default(), now)
            .unwrap()
            .flows
            .into_iter()
            .filter_map(|r| r.flow)
            .filter(|f| {
                f.key
                    .as_ref()
                    .is_some_and(|k| k.reporter == Reporter::Dst as i32 && k.dest_port == 8081)
            })
            .collect();
        assert_eq!(dst_flows.len(), 1, "{dst_flows:?}");
        assert_eq!(dst_flows[0].packets_in, 3);
        // One key more (the source report's); the destination's moved, not added.
        assert_eq!(ingest.store.num_keys(), keys + 1);
        // A node port leads to the Service too; a port without a name shows `-`.
        let mut by_node_port = record("10.0.0.2", "10.0.0.1", false, vec![]);
        by_node_port.dst_port = 81;
        by_node_port.original_dest = Some((ip("192.168.1.1"), 30080));
        let mut unnamed = record("10.0.0.2", "10.0.0.1", false, vec![]);
        unnamed.dst_port = 82;
        unnamed.original_dest = Some((ip("10.96.0.10"), 9090));
        // Translated to somewhere that is no Service, and not translated at all: `-`.
        let mut elsewhere = record("10.0.0.2", "10.0.0.1", false, vec![]);
        elsewhere.dst_port = 83;
        elsewhere.original_dest = Some((ip("10.96.0.99"), 8080));
        let mut plain = record("10.0.0.2", "10.0.0.1", false, vec![]);
        plain.dst_port = 84;
        assert!(
            ingest
                .add(
                    &g,
                    "node-b",
                    vec![by_node_port, unnamed, elsewhere, plain],
                    now
                )
                .is_empty()
        );
        assert_eq!(service_of(&mut ingest, Reporter::Src, 81), web);
        assert_eq!(
            service_of(&mut ingest, Reporter::Src, 82),
            ("web".into(), "shop".into(), "-".into(), 9090)
        );
        assert_eq!(service_of(&mut ingest, Reporter::Src, 83), none);
        assert_eq!(service_of(&mut ingest, Reporter::Src, 84), none);
        // Parsing: an original destination of the other IP version is refused.
        let mut bad = pb::FlowRecord {
            interval_start: 1_800_000_000,
            source_ip: "10.0.0.2".into(),
            dest_ip: "10.0.0.1".into(),
            protocol: 6,
            original_dest_ip: "fd00::1".into(),
            ..Default::default()
        };
        let report = |r: &pb::FlowRecord| pb::FlowReport {
            records: vec![r.clone()],
            dropped: 0,
        };
        assert_eq!(
            parse(&report(&bad)).unwrap_err().to_string(),
            "FlowReport.records[0].original_dest_ip: not of the record's IP version"
        );
        bad.original_dest_ip = "10.96.0.10".into();
        bad.original_dest_port = 8080;
        assert_eq!(
            parse(&report(&bad)).unwrap().records[0].original_dest,
            Some((ip("10.96.0.10"), 8080))
        );
    }

    #[test]
    fn nets_are_parsed_once_and_matched_by_prefix() {
        let net = |s: &str| Net::parse(s);
        assert!(net("10.0.0.0/8").unwrap().contains(ip("10.9.9.9")));
        assert!(!net("10.0.0.0/8").unwrap().contains(ip("11.0.0.1")));
        assert!(net("0.0.0.0/0").unwrap().contains(ip("203.0.113.1")));
        assert!(!net("0.0.0.0/0").unwrap().contains(ip("fd00::1")), "family");
        assert!(net("::/0").unwrap().contains(ip("2001:db8::1")));
        assert!(net("fd00::/8").unwrap().contains(ip("fd12::1")));
        let host = net("10.0.0.1").unwrap();
        assert_eq!(host.len, 32, "a bare address is a /32");
        assert!(host.contains(ip("10.0.0.1")) && !host.contains(ip("10.0.0.2")));
        for bad in ["10.0.0.0/33", "fd00::/129", "nope", "10.0.0.0/x", ""] {
            assert_eq!(net(bad), None, "{bad}");
        }
    }
}
