//! Realization: where each policy and profile is in force, and how long a new endpoint waits
//! for its node to program it.
//!
//! Contract: the engine tells this module which sequence number carried each message to each
//! node ([`Realization::queued`]) and what each agent reports it has applied
//! ([`Realization::applied`], from `DataplaneApplied`). A policy's *desired* nodes are its span
//! in the graph (the nodes that need it); a desired node has *realized* it when its agent has
//! applied its snapshot and every update of the policy sent to it since. Only messages not yet
//! acknowledged are remembered (per node, in sequence order), so the cost is bounded by what is
//! in flight, not by nodes × policies. A node whose last apply failed counts as *failed* for
//! every policy it has not realized, with the agent's error; anything else is pending, with the
//! reason (not connected, not reporting, snapshot not applied, update not applied yet).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use calc_graph::graph::{CalcGraph, SpanItem};
use calc_graph::model::ResourceKey;
use felix_proto as pb;
use pb::to_dataplane::Payload;
use serde::{Deserialize, Serialize};

/// A policy or profile as the in-flight log holds it: a hash of `kind/namespace/name` (the
/// same from a `PolicyId` on the wire and from the graph's key). Two keys sharing a hash would
/// only make one wait for the other's acknowledgement: never a policy counted as realized
/// early.
type Tracked = u64;

fn hash_of(kind: &str, namespace: &str, name: &str) -> Tracked {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    (kind, namespace, name).hash(&mut h);
    h.finish()
}

fn policy_id_key(id: &pb::PolicyId) -> Tracked {
    hash_of(&id.kind, &id.namespace, &id.name)
}

fn resource_key(k: &ResourceKey) -> Tracked {
    hash_of(
        k.kind.as_str(),
        k.namespace.as_deref().unwrap_or_default(),
        &k.name,
    )
}

fn profile_key(name: &str) -> Tracked {
    hash_of("Profile", "", name)
}

fn full_name(k: &ResourceKey) -> String {
    match &k.namespace {
        Some(ns) => format!("{ns}/{}", k.name),
        None => k.name.clone(),
    }
}

fn key_text(k: &ResourceKey) -> String {
    match &k.namespace {
        Some(ns) => format!("{} {ns}/{}", k.kind.as_str(), k.name),
        None => format!("{} {}", k.kind.as_str(), k.name),
    }
}

/// Why `[KIND:][NAMESPACE/]NAME` names no policy or profile (the admin endpoint's 400 answer).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FindError {
    #[error(
        "unknown policy kind {kind:?} in {name:?} (a kind such as NetworkPolicy or StagedNetworkPolicy, or Calico's short form: np, gnp, snp, sgnp, sknp, kcnp)"
    )]
    UnknownKind { kind: String, name: String },
    #[error("no policy {0:?} in the datastore")]
    NoPolicy(String),
    /// Several policies of that name; `found` is sorted.
    #[error(
        "{name:?} is ambiguous: it names {named}; qualify it with its kind, e.g. {qualified}",
        named = found.iter().map(key_text).collect::<Vec<_>>().join(", "),
        qualified = found
            .iter()
            .map(|k| format!("{}:{}", k.kind.as_str(), full_name(k)))
            .collect::<Vec<_>>()
            .join(" or ")
    )]
    Ambiguous {
        name: String,
        found: Vec<ResourceKey>,
    },
}

/// What one node's agent has acknowledged, and what it still has to.
#[derive(Debug, Default)]
struct NodeTrack {
    conn: u64,
    /// The agent offered the `applied` capability.
    reports: bool,
    /// The stream's InSync, once queued: the snapshot is applied when this is.
    in_sync_seq: Option<u64>,
    /// The highest sequence number queued on the stream.
    last_queued: u64,
    applied: u64,
    error: Option<String>,
    /// Policy and profile updates sent after the snapshot and not yet applied, in sequence
    /// order (the snapshot's are covered by its InSync).
    inflight: VecDeque<(u64, Tracked)>,
    inflight_count: HashMap<Tracked, u32>,
    /// New endpoints sent and not yet applied: (sequence number, first seen).
    new_endpoints: VecDeque<(u64, Instant)>,
}

impl NodeTrack {
    fn snapshot_applied(&self) -> bool {
        self.in_sync_seq.is_some_and(|s| self.applied >= s)
    }

    /// Whether `key` lags on this node and, if so, whether because the last apply failed:
    /// [`Self::lag`] without its reason (the table's counts need no text).
    fn lags(&self, key: Tracked) -> Option<bool> {
        if !self.reports {
            return Some(false);
        }
        if self.snapshot_applied() && !self.inflight_count.contains_key(&key) {
            return None;
        }
        Some(self.error.is_some())
    }

    /// Why `key` is not realized on this node (`None`: it is).
    fn lag(&self, key: Tracked) -> Option<(bool, String)> {
        if !self.reports {
            return Some((
                false,
                "the agent does not report what it applied (no \"applied\" capability)".into(),
            ));
        }
        let pending_update = self.inflight_count.contains_key(&key);
        if self.snapshot_applied() && !pending_update {
            return None;
        }
        if let Some(e) = &self.error {
            return Some((true, format!("last apply failed: {e}")));
        }
        Some((
            false,
            if self.snapshot_applied() {
                let seq = self
                    .inflight
                    .iter()
                    .rev()
                    .find(|(_, k)| *k == key)
                    .map_or(0, |(s, _)| *s);
                format!(
                    "update sent at sequence {seq}, applied up to {}",
                    self.applied
                )
            } else {
                format!(
                    "snapshot not applied yet (applied up to {} of {})",
                    self.applied,
                    self.in_sync_seq.unwrap_or(self.last_queued)
                )
            },
        ))
    }
}

/// A policy or a profile, as a single-policy query names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Target {
    Policy(ResourceKey),
    Profile(String),
}

/// One policy's (or profile's) realization across its nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PolicyRealization {
    /// `namespace/name` or `name`.
    pub policy: String,
    pub kind: String,
    /// The tier (empty for a profile).
    pub tier: String,
    pub desired: u32,
    pub realized: u32,
    pub failed: u32,
    /// `Realized`, `Realizing`, `Failed`, or `Staged` for a staged policy (never programmed).
    pub phase: String,
    /// The nodes that lag, with why (only in a single-policy answer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lagging: Vec<NodeLag>,
    /// Packets its rules decided, summed over its rules and nodes, as the agents reported them
    /// (capability `stats`); `None` (null) for a staged policy, which no dataplane programs.
    #[serde(default)]
    pub hits: Option<u64>,
    /// Bytes, likewise.
    #[serde(default)]
    pub bytes: Option<u64>,
    /// RFC 3339 UTC receive time of the last report with a hit on one of its rules; `None`
    /// (null) when none has.
    #[serde(default)]
    pub last_hit: Option<String>,
    /// Its rules, ingress then egress, each with its hit counts and the nodes where it matched
    /// (only in a single-policy answer; counts null for a staged policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<Vec<super::hits::RuleHits>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NodeLag {
    pub node: String,
    /// `failed` or `pending`.
    pub state: String,
    pub reason: String,
}

/// Desired, realized and failed node counts of one tier's policies (Prometheus gauges).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TierCounts {
    pub desired: u64,
    pub realized: u64,
    pub failed: u64,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct Realization {
    nodes: HashMap<String, NodeTrack>,
    /// Every endpoint any node has been sent (hashed ids): one sent for the first time outside
    /// a snapshot is a new endpoint, whose time to be programmed is measured.
    seen_endpoints: HashSet<u64>,
    /// Something changed since the last [`Realization::tiers`].
    pub(super) dirty: bool,
    /// Counts the changes that can move a policy's counts (each time `dirty` is set): the
    /// engine keeps the last full table for as long as it stays the same.
    pub(super) generation: u64,
}

fn workload_hash(i: &pb::WorkloadEndpointId) -> u64 {
    hash_of(&i.orchestrator_id, &i.workload_id, &i.endpoint_id)
}

fn host_hash(i: &pb::HostEndpointId) -> u64 {
    hash_of("HostEndpoint", "", &i.endpoint_id)
}

fn endpoint_id(p: &Payload) -> Option<u64> {
    match p {
        Payload::WorkloadEndpointUpdate(u) => u.id.as_ref().map(workload_hash),
        Payload::HostEndpointUpdate(u) => u.id.as_ref().map(host_hash),
        _ => None,
    }
}

fn removed_endpoint_id(p: &Payload) -> Option<u64> {
    match p {
        Payload::WorkloadEndpointRemove(u) => u.id.as_ref().map(workload_hash),
        Payload::HostEndpointRemove(u) => u.id.as_ref().map(host_hash),
        _ => None,
    }
}

impl Realization {
    /// A new stream for `node`: what the old one acknowledged no longer counts.
    pub(super) fn connected(&mut self, node: &str, conn: u64, reports: bool) {
        self.nodes.insert(
            node.to_string(),
            NodeTrack {
                conn,
                reports,
                ..NodeTrack::default()
            },
        );
        self.dirty = true;
        self.generation += 1;
    }

    pub(super) fn disconnected(&mut self, node: &str) {
        self.nodes.remove(node);
        self.dirty = true;
        self.generation += 1;
    }

    /// `msgs` were queued for `node`, numbered from `first_seq`; `snapshot` when they are
    /// the node's snapshot; `now` is when the step that produced them started.
    pub(super) fn queued<'m>(
        &mut self,
        node: &str,
        first_seq: u64,
        msgs: impl IntoIterator<Item = &'m pb::ToDataplane>,
        snapshot: bool,
        now: Instant,
    ) {
        let Some(t) = self.nodes.get_mut(node) else {
            return;
        };
        for (seq, msg) in (first_seq..).zip(msgs) {
            t.last_queued = t.last_queued.max(seq);
            let Some(p) = &msg.payload else { continue };
            // The snapshot's policies are in force once its InSync is applied: only what
            // follows it needs remembering.
            let after_snapshot = t.in_sync_seq.is_some();
            let key = match p {
                Payload::InSync(_) => {
                    t.in_sync_seq.get_or_insert(seq);
                    continue;
                }
                Payload::ActivePolicyUpdate(u) => u.id.as_ref().map(policy_id_key),
                Payload::ActiveProfileUpdate(u) => u.id.as_ref().map(|i| profile_key(&i.name)),
                other => {
                    if let Some(id) = endpoint_id(other) {
                        let new = self.seen_endpoints.insert(id);
                        if new && !snapshot && t.reports {
                            t.new_endpoints.push_back((seq, now));
                        }
                    } else if let Some(id) = removed_endpoint_id(other) {
                        self.seen_endpoints.remove(&id);
                    }
                    continue;
                }
            };
            if let Some(key) = key
                && t.reports
                && after_snapshot
            {
                *t.inflight_count.entry(key).or_default() += 1;
                t.inflight.push_back((seq, key));
                self.dirty = true;
                self.generation += 1;
            }
        }
    }

    /// `node`'s agent on stream `conn` reports its dataplane holds everything up to `applied`
    /// (and, if `error`, that its last apply failed). Returns how long each new endpoint it now
    /// holds waited, from the step that first sent it.
    pub(super) fn applied(
        &mut self,
        node: &str,
        conn: u64,
        applied: u64,
        error: Option<String>,
        now: Instant,
    ) -> Vec<Duration> {
        let Some(t) = self.nodes.get_mut(node) else {
            return Vec::new();
        };
        if t.conn != conn {
            return Vec::new();
        }
        self.dirty = true;
        self.generation += 1;
        t.applied = t.applied.max(applied);
        t.error = error;
        while t.inflight.front().is_some_and(|(s, _)| *s <= t.applied) {
            let (_, key) = t.inflight.pop_front().expect("checked");
            if let Some(c) = t.inflight_count.get_mut(&key) {
                *c -= 1;
                if *c == 0 {
                    t.inflight_count.remove(&key);
                }
            }
        }
        let mut waited = Vec::new();
        while t
            .new_endpoints
            .front()
            .is_some_and(|(s, _)| *s <= t.applied)
        {
            let (_, first) = t.new_endpoints.pop_front().expect("checked");
            waited.push(now.saturating_duration_since(first));
        }
        waited
    }

    /// Every policy's and profile's realization, by the graph's spans. With `only`, just that
    /// one, with its lagging nodes.
    pub(super) fn table(&self, graph: &CalcGraph, only: Option<&Target>) -> Vec<PolicyRealization> {
        // Looked up once per (node, policy) pair: a fast hash, not SipHash.
        let mut policies: Vec<PolicyRealization> = Vec::new();
        let mut index: rustc_hash::FxHashMap<&ResourceKey, usize> =
            rustc_hash::FxHashMap::default();
        let mut profiles: BTreeMap<&str, PolicyRealization> = BTreeMap::new();
        for (k, tier) in graph.policies_and_tiers() {
            if only.is_some_and(|o| *o != Target::Policy(k.clone())) {
                continue;
            }
            index.insert(k, policies.len());
            policies.push(PolicyRealization {
                policy: match &k.namespace {
                    Some(ns) => format!("{ns}/{}", k.name),
                    None => k.name.clone(),
                },
                kind: k.kind.as_str().to_string(),
                tier: tier.to_string(),
                ..PolicyRealization::default()
            });
        }
        let detail = only.is_some();
        // The span lists each node's items together: its track is looked up once per node.
        let mut current: Option<(&str, Option<&NodeTrack>)> = None;
        // Spans share the graph's keys: a key's address, once seen, finds its row without
        // hashing its text (a cluster's table is millions of (node, policy) pairs). Any other
        // address of an equal key is looked up by content once, then remembered too.
        let mut by_address: rustc_hash::FxHashMap<usize, Option<usize>> =
            rustc_hash::FxHashMap::default();
        graph.for_each_in_span(|node, item| {
            let row = match item {
                SpanItem::Policy(k) => {
                    let at = std::ptr::from_ref(k) as usize;
                    let i = *by_address
                        .entry(at)
                        .or_insert_with(|| index.get(k).copied());
                    match i {
                        Some(i) => &mut policies[i],
                        None => return,
                    }
                }
                SpanItem::Profile(p) => {
                    if only.is_some_and(|o| *o != Target::Profile(p.to_string())) {
                        return;
                    }
                    profiles.entry(p).or_insert_with(|| PolicyRealization {
                        policy: p.to_string(),
                        kind: "Profile".into(),
                        ..PolicyRealization::default()
                    })
                }
            };
            row.desired += 1;
            let track = match current {
                Some((n, t)) if std::ptr::eq(n, node) || n == node => t,
                _ => {
                    let t = self.nodes.get(node);
                    current = Some((node, t));
                    t
                }
            };
            let tracked = || match item {
                SpanItem::Policy(k) => resource_key(k),
                SpanItem::Profile(p) => profile_key(p),
            };
            // The common case needs no key: everything the node was sent is applied.
            let applied_all =
                |t: &NodeTrack| t.reports && t.snapshot_applied() && t.inflight.is_empty();
            if !detail {
                match track {
                    None => {}
                    Some(t) if applied_all(t) => row.realized += 1,
                    Some(t) => match t.lags(tracked()) {
                        None => row.realized += 1,
                        Some(failed) => row.failed += u32::from(failed),
                    },
                }
                return;
            }
            let lag = match track {
                None => Some((false, "not connected".to_string())),
                Some(t) if applied_all(t) => None,
                Some(t) => t.lag(tracked()),
            };
            match lag {
                None => row.realized += 1,
                Some((failed, reason)) => {
                    if failed {
                        row.failed += 1;
                    }
                    row.lagging.push(NodeLag {
                        node: node.to_string(),
                        state: if failed { "failed" } else { "pending" }.into(),
                        reason,
                    });
                }
            }
        });
        let mut rows = policies;
        rows.sort_by(|a, b| (&a.tier, &a.policy, &a.kind).cmp(&(&b.tier, &b.policy, &b.kind)));
        rows.extend(profiles.into_values());
        for r in &mut rows {
            let staged = calc_graph::model::Kind::from_name(&r.kind).is_some_and(|k| k.is_staged());
            // No agent programs a staged policy: it is evaluated, never in force.
            r.phase = if staged {
                "Staged"
            } else if r.failed > 0 {
                "Failed"
            } else if r.realized == r.desired {
                "Realized"
            } else {
                "Realizing"
            }
            .into();
            r.lagging.sort_by(|a, b| a.node.cmp(&b.node));
        }
        rows
    }

    /// What `[NAMESPACE/]NAME` names: a policy, or else a profile.
    /// `KIND:` before the name picks one of several policies of the same name, as in
    /// `explain --policy` (`StagedNetworkPolicy:shop/x` or Calico's short form `snp:shop/x`).
    pub(super) fn find(graph: &CalcGraph, name: &str) -> Result<Target, FindError> {
        let (kind, rest) = match name.split_once(':') {
            Some((k, rest)) => match calc_graph::model::Kind::policy_by_name(k) {
                Some(kind) => (Some(kind), rest),
                None => {
                    return Err(FindError::UnknownKind {
                        kind: k.to_string(),
                        name: name.to_string(),
                    });
                }
            },
            None => (None, name),
        };
        let (ns, n) = match rest.split_once('/') {
            Some((ns, n)) => (Some(ns), n),
            None => (None, rest),
        };
        let mut found: Vec<ResourceKey> = graph
            .policies_and_tiers()
            .into_iter()
            .filter(|(k, _)| {
                k.name == n
                    && (ns.is_none() || k.namespace.as_deref() == ns)
                    && kind.is_none_or(|kind| k.kind == kind)
            })
            .map(|(k, _)| k.clone())
            .collect();
        found.sort();
        match found.len() {
            1 => Ok(Target::Policy(found.remove(0))),
            0 if ns.is_none() && kind.is_none() => Ok(Target::Profile(n.to_string())),
            0 => Err(FindError::NoPolicy(name.to_string())),
            _ => Err(FindError::Ambiguous {
                name: name.to_string(),
                found,
            }),
        }
    }

    /// Desired, realized and failed counts per tier (policies only), from a full table.
    pub(super) fn tiers(rows: &[PolicyRealization]) -> BTreeMap<String, TierCounts> {
        let mut out: BTreeMap<String, TierCounts> = BTreeMap::new();
        for row in rows {
            if row.kind == "Profile" {
                continue;
            }
            let t = match out.get_mut(&row.tier) {
                Some(t) => t,
                None => out.entry(row.tier.clone()).or_default(),
            };
            t.desired += u64::from(row.desired);
            t.realized += u64::from(row.realized);
            t.failed += u64::from(row.failed);
        }
        out
    }
}
