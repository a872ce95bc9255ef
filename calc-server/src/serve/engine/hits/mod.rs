//! Policy hit counters: the packets and bytes each rule the server sent a node has decided on
//! that node, as its agent reports them (`RuleStats`, capability `stats`; docs/proto.md).
//!
//! This module holds the counting state ([`Hits`]) and report intake; the classification of
//! unused rules lives in [`unused`], the on-disk form in [`saved`]. Callers outside use the
//! re-exports here and never name the submodules.
//!
//! Contract:
//! - [`parse`] turns an agent's untrusted `RuleStats` into typed [`Hit`]s, or refuses the whole
//!   report ([`Malformed`]: more than [`MAX_HITS_PER_REPORT`] hits, a reference without the id
//!   its kind needs, an id that is no id). The service ends the stream on a refusal.
//! - [`Hits`] holds, per rule and per node, the packets and bytes added up from the reports'
//!   deltas, with the receive time of the first and of the last report that carried a non-zero
//!   delta. A node adds only to its own entries (the node is its stream's, never the
//!   report's), and only for what its current stream was sent ([`Hits::queued`]): a rule of a
//!   policy or profile the stream has not sent (or has since removed), an index past the
//!   owner's rules in that direction, the end of a tier none of its sent policies is in, a
//!   staged policy (never programmed), or a report from a replaced stream is dropped and
//!   counted ([`Refused`]), and creates nothing. What a stream was sent is kept only for
//!   streams with the capability, as keyed hashes and rule counts.
//! - Entries are bounded by the rules sent to each node. Counters outlive their node's stream
//!   (history); [`Hits::prune`] drops those of a policy, profile or tier gone from the datastore
//!   and folds those of a node gone from the datastore into one entry per rule, so totals stay.
//! - Observation: per policy and profile, [`Hits`] records when each of its rules was first in
//!   force on a node whose stream reports stats: the receive time of the first
//!   `DataplaneApplied` that covers a message carrying that rule ([`Hits::applied`]; a rule
//!   queued but never applied is not observed). Only the first time is kept: a later gap (the
//!   node's agent gone) is not subtracted. Staged policies are never observed. [`unused`]
//!   classifies rules from this and the last hits.
//! - Per-policy totals by action ([`Hits::series`], the Prometheus counters): each accepted hit
//!   is added under the action its rule has in the datastore's current version of the policy
//!   when the report arrives, so the totals only grow until the policy leaves the datastore.
//! - Persistence ([`saved`]): what survives a restart, and nothing about streams.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::SystemTime;

use calc_graph::graph::{CalcGraph, SpanItem};
use calc_graph::model::{Kind, ResourceKey};
use felix_proto as pb;
use pb::rule_ref::Kind as RefKind;
use pb::to_dataplane::Payload;
use serde::{Deserialize, Serialize};

mod reload;
mod saved;
mod unused;
mod verdicts;

pub(crate) use saved::{SAVED_VERSION, SavedCount, SavedHits, SavedSeen};
pub(super) use unused::Candidate;
pub(crate) use unused::UnusedPolicy;
pub(crate) use verdicts::VerdictHits;

/// Most hits one `RuleStats` may carry.
pub(crate) const MAX_HITS_PER_REPORT: usize = 4096;

/// Longest id (policy name, profile name, tier) a reference may carry: a DNS subdomain's
/// length, the longest name the datastore accepts.
pub(crate) const MAX_ID_BYTES: usize = 253;

/// Whose rule (or which of the dataplane's own verdicts) a hit counts.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Owner {
    /// A policy, by its `PolicyID` (namespace empty for a global kind).
    Policy {
        kind: String,
        namespace: String,
        name: String,
    },
    Profile(String),
    /// No policy of the tier decided: the tier's default drop.
    EndOfTier(String),
    /// No profile of the endpoint accepted.
    NoProfileMatched,
    /// Forwarded traffic accepted by default.
    DefaultAction,
    /// A failsafe port.
    Failsafe,
}

impl Owner {
    /// A policy or a profile: its hits name one of its rules by index. A verdict has none.
    fn has_rules(&self) -> bool {
        matches!(self, Owner::Policy { .. } | Owner::Profile(_))
    }
}

/// A rule's action, as the Prometheus label and the listings spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Action {
    Allow,
    Deny,
    Pass,
    Log,
}

impl Action {
    const ALL: [Action; 4] = [Action::Allow, Action::Deny, Action::Pass, Action::Log];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "allow",
            Action::Deny => "deny",
            Action::Pass => "pass",
            Action::Log => "log",
        }
    }

    /// A sent rule's action (empty: allow; `next-tier`: pass; unknown: deny, as the agent
    /// programs it).
    fn of(rule: &pb::Rule) -> Action {
        match calc_graph::explain::rules::action_name(&rule.action) {
            "Allow" => Action::Allow,
            "Pass" => Action::Pass,
            "Log" => Action::Log,
            _ => Action::Deny,
        }
    }
}

/// An owner's rules as the datastore's current version sends them.
enum RulesNow<'g> {
    Sent(&'g [pb::Rule], &'g [pb::Rule]),
    /// A profile endpoints reference that does not exist: one deny each way
    /// (`calc_graph::rule_scanner::missing_profile_rules`).
    MissingProfile,
}

impl RulesNow<'_> {
    fn len(&self, egress: bool) -> usize {
        match self {
            RulesNow::Sent(i, o) => if egress { o } else { i }.len(),
            RulesNow::MissingProfile => 1,
        }
    }

    fn action(&self, egress: bool, index: usize) -> Option<Action> {
        match self {
            RulesNow::Sent(i, o) => if egress { o } else { i }.get(index).map(Action::of),
            RulesNow::MissingProfile => (index == 0).then_some(Action::Deny),
        }
    }

    fn actions(&self, egress: bool) -> impl Iterator<Item = Action> + '_ {
        (0..self.len(egress)).filter_map(move |i| self.action(egress, i))
    }
}

/// `owner`'s rules in `graph` now (`None`: a verdict, or a policy not in the datastore).
fn rules_now<'g>(graph: &'g CalcGraph, owner: &Owner) -> Option<RulesNow<'g>> {
    match owner {
        Owner::Policy {
            kind,
            namespace,
            name,
        } => {
            let kind = Kind::from_name(kind)?;
            let ns = (!namespace.is_empty()).then_some(namespace.as_str());
            let m = graph
                .view()
                .policy(&ResourceKey::new(kind, ns, name))?
                .message();
            Some(RulesNow::Sent(&m.inbound_rules, &m.outbound_rules))
        }
        Owner::Profile(name) => Some(match graph.view().profile(name) {
            Some(p) => RulesNow::Sent(&p.inbound_rules, &p.outbound_rules),
            None => RulesNow::MissingProfile,
        }),
        _ => None,
    }
}

/// The action of `owner`'s rule `index` in `graph`'s current version (what [`Hits::add`]
/// files a hit's totals under).
pub(super) fn rule_action(
    graph: &CalcGraph,
    owner: &Owner,
    egress: bool,
    index: u32,
) -> Option<Action> {
    rules_now(graph, owner)?.action(egress, index as usize)
}

/// One rule of one policy or profile with its counters (the single-policy status answer).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RuleHits {
    /// `ingress` or `egress`.
    pub direction: String,
    pub index: u32,
    /// `allow`, `deny`, `pass` or `log`.
    pub action: String,
    /// Packets it matched, summed over nodes; `None` (null) for a staged policy.
    pub packets: Option<u64>,
    pub bytes: Option<u64>,
    /// RFC 3339 UTC receive time of the last report with a hit on it.
    pub last_hit: Option<String>,
    /// The nodes where it matched something, sorted; `(departed)` for nodes gone from the
    /// datastore, whose counts are folded.
    pub nodes: Vec<String>,
}

/// One per-policy Prometheus series pair (packets and bytes) of one action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PolicySeries {
    pub tier: String,
    pub policy: String,
    pub kind: String,
    pub action: &'static str,
    pub packets: u64,
    pub bytes: u64,
}

/// What is known of one policy or profile beyond its per-node counters.
#[derive(Debug)]
struct Seen {
    owner: Owner,
    /// Per direction (ingress, egress): when each rule index was first in force on a node
    /// that reports stats (the vector grows as the policy gains rules; never shrinks).
    since: [Vec<SystemTime>; 2],
    /// Packets and bytes by [`Action`] (indexed by its discriminant).
    by_action: [(u64, u64); 4],
}

impl Seen {
    fn new(owner: Owner) -> Seen {
        Seen {
            owner,
            since: [Vec::new(), Vec::new()],
            by_action: [(0, 0); 4],
        }
    }

    /// Whether rules `(inbound, outbound)` are all observed already.
    fn covers(&self, (inbound, outbound): (u32, u32)) -> bool {
        self.since[0].len() >= inbound as usize && self.since[1].len() >= outbound as usize
    }

    /// Rules `(inbound, outbound)` are in force at `at`: the ones not yet observed are from
    /// now. Returns whether any was new.
    fn observe(&mut self, (inbound, outbound): (u32, u32), at: SystemTime) -> bool {
        let mut new = false;
        for (since, n) in self.since.iter_mut().zip([inbound, outbound]) {
            while since.len() < n as usize {
                since.push(at);
                new = true;
            }
        }
        new
    }

    /// When its first rule was first observed.
    fn first(&self) -> Option<SystemTime> {
        self.since.iter().flatten().min().copied()
    }
}

/// A policy or profile update queued on a stats-reporting stream whose rules were not all
/// observed yet: observed once the agent reports `seq` applied.
#[derive(Debug)]
struct Pending {
    seq: u64,
    sig: Sig,
    owner: Owner,
    rules: (u32, u32),
}

fn direction(egress: bool) -> &'static str {
    if egress { "egress" } else { "ingress" }
}

/// One rule's delta in a report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hit {
    pub owner: Owner,
    /// Outbound (egress) rules; inbound otherwise.
    pub egress: bool,
    /// The rule's index among the owner's rules in that direction (0 for a verdict).
    pub index: u32,
    pub packets: u64,
    pub bytes: u64,
}

/// Why a `RuleStats` report is refused whole (the stream ends with INVALID_ARGUMENT). The
/// messages name fields and positions, never the agent's text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Malformed {
    #[error("RuleStats carries {0} hits, more than {MAX_HITS_PER_REPORT}")]
    TooManyHits(usize),
    #[error("RuleStats.hits[{0}] has no rule")]
    NoRule(usize),
    #[error("RuleStats.hits[{at}].rule.kind {kind} is not a RuleRef.Kind")]
    UnknownKind { at: usize, kind: i32 },
    #[error("RuleStats.hits[{at}] is a {kind} without its {field}")]
    Missing {
        at: usize,
        kind: &'static str,
        field: &'static str,
    },
    #[error(
        "RuleStats.hits[{at}].rule.{field} is not a valid id (at most {MAX_ID_BYTES} bytes of printable ASCII; a policy kind; a namespace that is a DNS label)"
    )]
    BadId { at: usize, field: &'static str },
}

impl Malformed {
    /// The `calc_server_rule_stats_refused_total` reason.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Malformed::TooManyHits(_) => "too_many_hits",
            _ => "malformed",
        }
    }
}

/// Why one hit of an accepted report is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Refused {
    /// The report came on a stream that has since been replaced or closed.
    StaleStream,
    /// The node's stream was not sent that policy, profile or tier (or no longer holds it).
    NotSent,
    /// The index is past the owner's rules in that direction, as sent.
    OutOfRange,
    /// A staged policy: agents never program it, so it decides nothing.
    Staged,
}

impl Refused {
    /// The `calc_server_rule_stats_refused_total` reason.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Refused::StaleStream => "stale_stream",
            Refused::NotSent => "not_sent",
            Refused::OutOfRange => "out_of_range",
            Refused::Staged => "staged",
        }
    }
}

/// An id as a reference may carry it: non-empty, bounded, printable ASCII. Only ids equal to
/// one the server sent are ever held, so nothing else about them matters here.
fn is_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_ID_BYTES && s.bytes().all(|b| b.is_ascii_graphic())
}

/// The typed hits of an agent's report, or why it is refused whole.
pub(crate) fn parse(stats: &pb::RuleStats) -> Result<Vec<Hit>, Malformed> {
    if stats.hits.len() > MAX_HITS_PER_REPORT {
        return Err(Malformed::TooManyHits(stats.hits.len()));
    }
    stats
        .hits
        .iter()
        .enumerate()
        .map(|(at, h)| {
            let r = h.rule.as_ref().ok_or(Malformed::NoRule(at))?;
            let kind = RefKind::try_from(r.kind)
                .map_err(|_| Malformed::UnknownKind { at, kind: r.kind })?;
            let id = |s: &str, field| {
                if is_id(s) {
                    Ok(s.to_string())
                } else {
                    Err(Malformed::BadId { at, field })
                }
            };
            let missing = |field| Malformed::Missing {
                at,
                kind: kind.as_str_name(),
                field,
            };
            let owner = match kind {
                RefKind::PolicyRule => {
                    let p = r
                        .policy
                        .as_ref()
                        .filter(|p| !p.name.is_empty())
                        .ok_or_else(|| missing("policy"))?;
                    if !Kind::from_name(&p.kind).is_some_and(Kind::is_policy) {
                        return Err(Malformed::BadId {
                            at,
                            field: "policy.kind",
                        });
                    }
                    if !p.namespace.is_empty()
                        && !calc_graph::model::validate::is_label(&p.namespace)
                    {
                        return Err(Malformed::BadId {
                            at,
                            field: "policy.namespace",
                        });
                    }
                    Owner::Policy {
                        kind: p.kind.clone(),
                        namespace: p.namespace.clone(),
                        name: id(&p.name, "policy.name")?,
                    }
                }
                RefKind::ProfileRule => {
                    let p = r
                        .profile
                        .as_ref()
                        .filter(|p| !p.name.is_empty())
                        .ok_or_else(|| missing("profile"))?;
                    Owner::Profile(id(&p.name, "profile.name")?)
                }
                RefKind::EndOfTier => {
                    if r.tier.is_empty() {
                        return Err(missing("tier"));
                    }
                    Owner::EndOfTier(id(&r.tier, "tier")?)
                }
                RefKind::NoProfileMatched => Owner::NoProfileMatched,
                RefKind::DefaultAction => Owner::DefaultAction,
                RefKind::Failsafe => Owner::Failsafe,
            };
            Ok(Hit {
                index: if owner.has_rules() { r.index } else { 0 },
                owner,
                egress: r.egress,
                packets: h.packets,
                bytes: h.bytes,
            })
        })
        .collect()
}

/// A policy, profile or tier as the sent log holds it: a keyed hash of its id.
type Sig = u64;

/// A policy as one stream was last sent it.
#[derive(Clone, Copy, Debug)]
struct SentPolicy {
    tier: Sig,
    inbound: u32,
    outbound: u32,
    staged: bool,
}

/// What one stream (with the `stats` capability) holds now.
#[derive(Debug, Default)]
struct Sent {
    conn: u64,
    policies: HashMap<Sig, SentPolicy>,
    /// Profile → (inbound, outbound) rule counts.
    profiles: HashMap<Sig, (u32, u32)>,
    /// Tiers of the programmed (not staged) policies sent, with how many of them.
    tiers: HashMap<Sig, u32>,
    /// Updates whose rules are not all observed yet, in sequence order, until applied.
    pending: VecDeque<Pending>,
    /// The most rules of each policy or profile queued in `pending` so far: a later update
    /// with no more rules waits for nothing the earlier one does not, and is not queued (so a
    /// stream whose applies keep failing holds at most a few entries per policy).
    pending_most: HashMap<Sig, (u32, u32)>,
    /// Whether the node reads its counters now (FeatureGates `PolicyHitCounters`): a node that
    /// does not read them observes nothing, since no hit of its could ever arrive.
    paused: bool,
    /// Updates applied while paused, observed when the node counts again (if still held).
    deferred: Vec<Pending>,
}

impl Sent {
    /// Queues `p` unless an update already pending has at least its rules.
    fn push_pending(&mut self, p: Pending) {
        let most = self.pending_most.entry(p.sig).or_default();
        if most.0 >= p.rules.0 && most.1 >= p.rules.1 {
            return;
        }
        *most = (most.0.max(p.rules.0), most.1.max(p.rules.1));
        self.pending.push_back(p);
    }
}

impl Sent {
    fn add_tier(&mut self, p: SentPolicy) {
        if !p.staged {
            *self.tiers.entry(p.tier).or_default() += 1;
        }
    }

    fn remove_tier(&mut self, p: SentPolicy) {
        if p.staged {
            return;
        }
        if let Some(n) = self.tiers.get_mut(&p.tier) {
            *n -= 1;
            if *n == 0 {
                self.tiers.remove(&p.tier);
            }
        }
    }
}

/// One rule's counters on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Counts {
    pub packets: u64,
    pub bytes: u64,
    /// Receive time of the first report that carried a non-zero delta.
    pub first: SystemTime,
    /// Receive time of the last one.
    pub last: SystemTime,
}

impl Counts {
    fn merge(&mut self, other: Counts) {
        self.packets = self.packets.saturating_add(other.packets);
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.first = self.first.min(other.first);
        self.last = self.last.max(other.last);
    }
}

/// A policy's or profile's counters summed over its rules and nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub packets: u64,
    pub bytes: u64,
    pub first: Option<SystemTime>,
    pub last: Option<SystemTime>,
}

/// Where one rule's counters are: a node (`None`: the nodes gone from the datastore, folded),
/// the direction (egress) and the rule's index.
type Slot = (Option<Arc<str>>, bool, u32);

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct Hits {
    /// Keys the sent log's hashes (per process, so an agent cannot aim at a collision).
    keys: RandomState,
    /// Per node with a stats-reporting stream: what that stream holds.
    sent: HashMap<String, Sent>,
    counts: HashMap<Owner, HashMap<Slot, Counts>>,
    /// Node names, shared by their entries.
    names: HashSet<Arc<str>>,
    /// Entries held (the `calc_server_rule_stats_entries` gauge).
    entries: usize,
    /// Per policy and profile ever in force on a stats-reporting node or hit: when its rules
    /// were first in force there, and its totals by action.
    seen: HashMap<Sig, Seen>,
    /// Something [`Hits::saved`] copies changed since [`Hits::take_changed`] last said so.
    changed: bool,
    /// Per node whose stored counts are being re-read: what its new stream added since.
    since_connect: HashMap<String, reload::SinceConnect>,
}

impl Hits {
    fn policy_sig(&self, kind: &str, namespace: &str, name: &str) -> Sig {
        self.keys.hash_one(("policy", kind, namespace, name))
    }

    /// A sent `PolicyID`'s hash, and whether it is a staged policy.
    fn policy_id_sig(&self, id: Option<&pb::PolicyId>) -> (Sig, bool) {
        let (kind, namespace, name) = id.map_or(("", "", ""), |i| {
            (i.kind.as_str(), i.namespace.as_str(), i.name.as_str())
        });
        (
            self.policy_sig(kind, namespace, name),
            Kind::from_name(kind).is_some_and(Kind::is_staged),
        )
    }

    fn profile_sig(&self, name: &str) -> Sig {
        self.keys.hash_one(("profile", name))
    }

    fn tier_sig(&self, name: &str) -> Sig {
        self.keys.hash_one(("tier", name))
    }

    /// A new stream `conn` for `node`: what the old one was sent no longer counts. Only a
    /// stream that `reports` stats is followed.
    pub(super) fn connected(&mut self, node: &str, conn: u64, reports: bool) {
        if reports {
            self.sent.insert(
                node.to_string(),
                Sent {
                    conn,
                    ..Sent::default()
                },
            );
        } else {
            self.sent.remove(node);
        }
    }

    /// Whether `node`'s agent reads its counters now (its FeatureGates), as of `at`. While it
    /// does not, what its stream applies is not observed (no hit of it could arrive, so a rule
    /// in force only there is not yet known rather than unused); when it reads them again,
    /// what it applied meanwhile and still holds is observed from `at`.
    pub(super) fn set_counting(&mut self, node: &str, on: bool, at: SystemTime) {
        let Some(s) = self.sent.get_mut(node) else {
            return;
        };
        if s.paused != on {
            return;
        }
        s.paused = !on;
        if !on {
            return;
        }
        let mut new = false;
        for p in std::mem::take(&mut s.deferred) {
            if s.policies.contains_key(&p.sig) || s.profiles.contains_key(&p.sig) {
                new |= self
                    .seen
                    .entry(p.sig)
                    .or_insert_with(|| Seen::new(p.owner))
                    .observe(p.rules, at);
            }
        }
        self.changed |= new;
    }

    /// The node's stream is gone; its counters stay.
    pub(super) fn disconnected(&mut self, node: &str) {
        self.sent.remove(node);
    }

    /// `msgs` were queued on `node`'s current stream, numbered from `first_seq`.
    pub(super) fn queued<'m>(
        &mut self,
        node: &str,
        first_seq: u64,
        msgs: impl IntoIterator<Item = &'m pb::ToDataplane>,
    ) {
        if !self.sent.contains_key(node) {
            return;
        }
        for (seq, msg) in (first_seq..).zip(msgs) {
            let Some(p) = &msg.payload else { continue };
            // The keys are computed before the node's log is borrowed.
            match p {
                Payload::ActivePolicyUpdate(u) => {
                    let (sig, staged) = self.policy_id_sig(u.id.as_ref());
                    let (tier, inbound, outbound) = u.policy.as_ref().map_or(("", 0, 0), |p| {
                        (
                            p.tier.as_str(),
                            p.inbound_rules.len() as u32,
                            p.outbound_rules.len() as u32,
                        )
                    });
                    let new = SentPolicy {
                        tier: self.tier_sig(tier),
                        inbound,
                        outbound,
                        staged,
                    };
                    // A staged policy is never in force: never observed.
                    let pending =
                        (!staged && !self.observed(sig, (inbound, outbound))).then(|| {
                            let id = u.id.clone().unwrap_or_default();
                            Pending {
                                seq,
                                sig,
                                owner: Owner::Policy {
                                    kind: id.kind,
                                    namespace: id.namespace,
                                    name: id.name,
                                },
                                rules: (inbound, outbound),
                            }
                        });
                    let Some(s) = self.sent.get_mut(node) else {
                        return;
                    };
                    if let Some(old) = s.policies.insert(sig, new) {
                        s.remove_tier(old);
                    }
                    s.add_tier(new);
                    if let Some(p) = pending {
                        s.push_pending(p);
                    }
                }
                Payload::ActivePolicyRemove(r) => {
                    let (sig, _) = self.policy_id_sig(r.id.as_ref());
                    let Some(s) = self.sent.get_mut(node) else {
                        return;
                    };
                    if let Some(old) = s.policies.remove(&sig) {
                        s.remove_tier(old);
                    }
                }
                Payload::ActiveProfileUpdate(u) => {
                    let name = u.id.as_ref().map(|i| i.name.as_str()).unwrap_or_default();
                    let sig = self.profile_sig(name);
                    let rules = u.profile.as_ref().map_or((0, 0), |p| {
                        (p.inbound_rules.len() as u32, p.outbound_rules.len() as u32)
                    });
                    let pending = (!self.observed(sig, rules)).then(|| Pending {
                        seq,
                        sig,
                        owner: Owner::Profile(name.to_string()),
                        rules,
                    });
                    if let Some(s) = self.sent.get_mut(node) {
                        s.profiles.insert(sig, rules);
                        if let Some(p) = pending {
                            s.push_pending(p);
                        }
                    }
                }
                Payload::ActiveProfileRemove(r) => {
                    let name = r.id.as_ref().map(|i| i.name.as_str()).unwrap_or_default();
                    let sig = self.profile_sig(name);
                    if let Some(s) = self.sent.get_mut(node) {
                        s.profiles.remove(&sig);
                    }
                }
                _ => {}
            }
        }
    }

    /// Whether rules `(inbound, outbound)` of the policy or profile `sig` are all observed.
    fn observed(&self, sig: Sig, rules: (u32, u32)) -> bool {
        self.seen.get(&sig).is_some_and(|s| s.covers(rules))
    }

    /// `node`'s stream `conn` reports its dataplane holds everything up to `applied`, received
    /// `at`: the rules of the updates up to there are in force from then, if they were not
    /// already observed. Returns whether any rule was observed for the first time.
    pub(super) fn applied(&mut self, node: &str, conn: u64, applied: u64, at: SystemTime) -> bool {
        let Some(s) = self.sent.get_mut(node).filter(|s| s.conn == conn) else {
            return false;
        };
        let mut new = false;
        while s.pending.front().is_some_and(|p| p.seq <= applied) {
            let p = s.pending.pop_front().expect("checked");
            if s.paused {
                s.deferred.push(p);
                continue;
            }
            new |= self
                .seen
                .entry(p.sig)
                .or_insert_with(|| Seen::new(p.owner))
                .observe(p.rules, at);
        }
        self.changed |= new;
        new
    }

    /// The keyed hash of a policy's or profile's owner (`None`: a verdict).
    fn owner_sig(&self, owner: &Owner) -> Option<Sig> {
        match owner {
            Owner::Policy {
                kind,
                namespace,
                name,
            } => Some(self.policy_sig(kind, namespace, name)),
            Owner::Profile(name) => Some(self.profile_sig(name)),
            _ => None,
        }
    }

    /// Whether `hit` is a rule `node`'s current stream holds.
    fn check(&self, s: &Sent, hit: &Hit) -> Result<(), Refused> {
        let within = |(inbound, outbound): (u32, u32)| {
            if hit.index < if hit.egress { outbound } else { inbound } {
                Ok(())
            } else {
                Err(Refused::OutOfRange)
            }
        };
        match &hit.owner {
            Owner::Policy {
                kind,
                namespace,
                name,
            } => match s.policies.get(&self.policy_sig(kind, namespace, name)) {
                None => Err(Refused::NotSent),
                Some(p) if p.staged => Err(Refused::Staged),
                Some(p) => within((p.inbound, p.outbound)),
            },
            Owner::Profile(name) => match s.profiles.get(&self.profile_sig(name)) {
                None => Err(Refused::NotSent),
                Some(rules) => within(*rules),
            },
            Owner::EndOfTier(tier) => {
                if s.tiers.contains_key(&self.tier_sig(tier)) {
                    Ok(())
                } else {
                    Err(Refused::NotSent)
                }
            }
            Owner::NoProfileMatched | Owner::DefaultAction | Owner::Failsafe => Ok(()),
        }
    }

    /// Adds the deltas `node`'s stream `conn` reported, received `at`; each also goes to its
    /// owner's totals under the action `action` gives its rule (none: only the rule's
    /// counters). Returns what was dropped, by reason (hits whose delta is zero are neither
    /// held nor counted).
    pub(super) fn add(
        &mut self,
        node: &str,
        conn: u64,
        hits: Vec<Hit>,
        at: SystemTime,
        action: impl Fn(&Owner, bool, u32) -> Option<Action>,
    ) -> Vec<(Refused, u64)> {
        let mut refused: HashMap<Refused, u64> = HashMap::new();
        let moved = hits.into_iter().filter(|h| h.packets != 0 || h.bytes != 0);
        let Some(s) = self.sent.get(node).filter(|s| s.conn == conn) else {
            let n = moved.count() as u64;
            return if n == 0 {
                Vec::new()
            } else {
                vec![(Refused::StaleStream, n)]
            };
        };
        let accepted: Vec<Hit> = moved
            .filter(|h| match self.check(s, h) {
                Ok(()) => true,
                Err(why) => {
                    *refused.entry(why).or_default() += 1;
                    false
                }
            })
            .collect();
        if !accepted.is_empty() {
            self.changed = true;
            let name = match self.names.get(node) {
                Some(n) => n.clone(),
                None => {
                    let n: Arc<str> = Arc::from(node);
                    self.names.insert(n.clone());
                    n
                }
            };
            for h in accepted {
                let delta = Counts {
                    packets: h.packets,
                    bytes: h.bytes,
                    first: at,
                    last: at,
                };
                let index = if h.owner.has_rules() { h.index } else { 0 };
                if let Some(sig) = self.owner_sig(&h.owner)
                    && let Some(a) = action(&h.owner, h.egress, index)
                {
                    let seen = self
                        .seen
                        .entry(sig)
                        .or_insert_with(|| Seen::new(h.owner.clone()));
                    let t = &mut seen.by_action[a as usize];
                    t.0 = t.0.saturating_add(h.packets);
                    t.1 = t.1.saturating_add(h.bytes);
                }
                if let Some(since) = self.since_connect.get_mut(node) {
                    since.add(conn, (h.owner.clone(), h.egress, index), h.packets, h.bytes);
                }
                let rules = self.counts.entry(h.owner).or_default();
                match rules.entry((Some(name.clone()), h.egress, index)) {
                    std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().merge(delta),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(delta);
                        self.entries += 1;
                    }
                }
            }
        }
        let mut refused: Vec<(Refused, u64)> = refused.into_iter().collect();
        refused.sort();
        refused
    }

    /// Entries held: one per node (or folded departed nodes) and rule with a non-zero count.
    pub(super) fn entries(&self) -> usize {
        self.entries
    }

    /// One owner's counters summed over its rules and nodes.
    pub(super) fn totals(&self, owner: &Owner) -> Totals {
        let mut t = Totals::default();
        for c in self.counts.get(owner).into_iter().flat_map(|r| r.values()) {
            t.packets = t.packets.saturating_add(c.packets);
            t.bytes = t.bytes.saturating_add(c.bytes);
            t.first = Some(t.first.map_or(c.first, |f| f.min(c.first)));
            t.last = Some(t.last.map_or(c.last, |l| l.max(c.last)));
        }
        t
    }

    /// One rule's counters on one node (`None` node: the folded departed nodes).
    #[cfg(test)]
    pub(super) fn rule(
        &self,
        owner: &Owner,
        node: Option<&str>,
        egress: bool,
        index: u32,
    ) -> Option<Counts> {
        self.counts
            .get(owner)?
            .get(&(node.map(Arc::from), egress, index))
            .copied()
    }

    /// `owner`'s rules as the datastore's current version has them, ingress then egress, each
    /// with its counters summed over nodes and the nodes where it matched something (none for
    /// a `staged` policy, which no dataplane programs).
    pub(super) fn rules(&self, graph: &CalcGraph, owner: &Owner, staged: bool) -> Vec<RuleHits> {
        let Some(now) = rules_now(graph, owner) else {
            return Vec::new();
        };
        let mut per_rule: HashMap<(bool, u32), (Totals, BTreeSet<&str>)> = HashMap::new();
        for ((node, egress, index), c) in self.counts.get(owner).into_iter().flatten() {
            let (t, nodes) = per_rule.entry((*egress, *index)).or_default();
            t.packets = t.packets.saturating_add(c.packets);
            t.bytes = t.bytes.saturating_add(c.bytes);
            t.last = Some(t.last.map_or(c.last, |l| l.max(c.last)));
            nodes.insert(node.as_deref().unwrap_or("(departed)"));
        }
        let mut out = Vec::new();
        for egress in [false, true] {
            for index in 0..now.len(egress) {
                let action = now.action(egress, index).unwrap_or(Action::Deny);
                let index = index as u32;
                let mut rule = RuleHits {
                    direction: direction(egress).into(),
                    index,
                    action: action.as_str().into(),
                    ..RuleHits::default()
                };
                if !staged {
                    let (t, nodes) = per_rule.remove(&(egress, index)).unwrap_or_default();
                    rule.packets = Some(t.packets);
                    rule.bytes = Some(t.bytes);
                    rule.last_hit = t.last.map(common::rfc3339_utc);
                    rule.nodes = nodes.into_iter().map(str::to_string).collect();
                }
                out.push(rule);
            }
        }
        out
    }

    /// The per-policy Prometheus series: for each policy and profile in the datastore that was
    /// in force on a node that reports stats, or was hit, one per action its rules have now or
    /// had when hit, with the packets and bytes filed under it. Staged policies have none.
    pub(super) fn series(&self, graph: &CalcGraph) -> Vec<PolicySeries> {
        let view = graph.view();
        let mut out = Vec::new();
        for s in self.seen.values() {
            let (policy, kind, tier) = match &s.owner {
                Owner::Policy {
                    kind,
                    namespace,
                    name,
                } => {
                    let Some(k) = Kind::from_name(kind).filter(|k| !k.is_staged()) else {
                        continue;
                    };
                    let ns = (!namespace.is_empty()).then_some(namespace.as_str());
                    let Some(p) = view.policy(&ResourceKey::new(k, ns, name)) else {
                        continue;
                    };
                    let label = match ns {
                        Some(ns) => format!("{ns}/{name}"),
                        None => name.clone(),
                    };
                    (label, kind.clone(), p.model().tier.clone())
                }
                Owner::Profile(name) => (name.clone(), "Profile".to_string(), String::new()),
                _ => continue,
            };
            let mut actions: BTreeSet<Action> = rules_now(graph, &s.owner)
                .map(|r| r.actions(false).chain(r.actions(true)).collect())
                .unwrap_or_default();
            actions.extend(
                Action::ALL
                    .into_iter()
                    .filter(|a| s.by_action[*a as usize] != (0, 0)),
            );
            for a in actions {
                let (packets, bytes) = s.by_action[a as usize];
                out.push(PolicySeries {
                    tier: tier.clone(),
                    policy: policy.clone(),
                    kind: kind.clone(),
                    action: a.as_str(),
                    packets,
                    bytes,
                });
            }
        }
        out.sort_by(|a, b| {
            (&a.tier, &a.policy, &a.kind, a.action).cmp(&(&b.tier, &b.policy, &b.kind, b.action))
        });
        out
    }

    /// Drops the counters (and observation) of policies, profiles and tiers gone from the
    /// datastore, and folds those of nodes neither in the datastore nor `connected` into one
    /// entry per rule.
    pub(super) fn prune(&mut self, graph: &CalcGraph, connected: impl Fn(&str) -> bool) {
        let view = graph.view();
        let tiers: HashSet<&str> = view
            .policies_and_tiers()
            .into_iter()
            .map(|(_, t)| t)
            .collect();
        // Profiles nodes are sent without a Profile resource (their rules are the missing
        // profile's): walked only when a counted profile has no resource.
        let mut referenced: Option<HashSet<&str>> = None;
        let mut keep = |owner: &Owner| match owner {
            Owner::Policy {
                kind,
                namespace,
                name,
            } => Kind::from_name(kind).is_some_and(|k| {
                let ns = (!namespace.is_empty()).then_some(namespace.as_str());
                view.policy(&ResourceKey::new(k, ns, name)).is_some()
            }),
            Owner::Profile(p) => {
                view.profile(p).is_some()
                    || referenced
                        .get_or_insert_with(|| {
                            let mut set = HashSet::new();
                            graph.for_each_in_span(|_, item| {
                                if let SpanItem::Profile(p) = item {
                                    set.insert(p);
                                }
                            });
                            set
                        })
                        .contains(p.as_str())
            }
            Owner::EndOfTier(t) => tiers.contains(t.as_str()) || view.tier(t).is_some(),
            Owner::NoProfileMatched | Owner::DefaultAction | Owner::Failsafe => true,
        };
        let before = (self.counts.len(), self.seen.len());
        self.counts.retain(|owner, _| keep(owner));
        self.seen.retain(|_, s| keep(&s.owner));
        let mut changed = before != (self.counts.len(), self.seen.len());
        let known: HashSet<String> = graph.known_nodes().into_iter().collect();
        // A node whose saved counts are not merged yet is not folded: its view here may be
        // stale (see `reload`); it is folded once they are.
        let unverified = &self.since_connect;
        let departed = |n: &str| !known.contains(n) && !connected(n) && !unverified.contains_key(n);
        for rules in self.counts.values_mut() {
            let gone: Vec<Slot> = rules
                .keys()
                .filter(|(n, ..)| n.as_deref().is_some_and(departed))
                .cloned()
                .collect();
            for slot in gone {
                changed = true;
                let Some(c) = rules.remove(&slot) else {
                    continue;
                };
                rules
                    .entry((None, slot.1, slot.2))
                    .and_modify(|f| f.merge(c))
                    .or_insert(c);
            }
        }
        self.entries = self.counts.values().map(HashMap::len).sum();
        self.names.retain(|n| Arc::strong_count(n) > 1);
        self.changed |= changed;
    }

    /// Whether what [`Hits::saved`] copies changed since the last call.
    pub(super) fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// No action for the totals (the tests of the per-rule counters).
    fn no_action(_: &Owner, _: bool, _: u32) -> Option<Action> {
        None
    }

    pub(super) fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    pub(super) fn policy_id(name: &str) -> pb::PolicyId {
        pb::PolicyId {
            name: name.into(),
            namespace: "shop".into(),
            kind: "NetworkPolicy".into(),
        }
    }

    pub(super) fn policy_owner(name: &str) -> Owner {
        Owner::Policy {
            kind: "NetworkPolicy".into(),
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    fn rules(n: usize) -> Vec<pb::Rule> {
        vec![pb::Rule::default(); n]
    }

    fn msg(p: Payload) -> pb::ToDataplane {
        pb::ToDataplane {
            sequence_number: 0,
            payload: Some(p),
        }
    }

    /// An ActivePolicyUpdate for `shop/NAME` in `tier`, with that many rules each way.
    pub(super) fn policy_update(
        id: pb::PolicyId,
        tier: &str,
        inbound: usize,
        outbound: usize,
    ) -> pb::ToDataplane {
        msg(Payload::ActivePolicyUpdate(pb::ActivePolicyUpdate {
            id: Some(id),
            policy: Some(pb::Policy {
                inbound_rules: rules(inbound),
                outbound_rules: rules(outbound),
                tier: tier.into(),
                ..Default::default()
            }),
        }))
    }

    fn profile_update(name: &str, inbound: usize, outbound: usize) -> pb::ToDataplane {
        msg(Payload::ActiveProfileUpdate(pb::ActiveProfileUpdate {
            id: Some(pb::ProfileId { name: name.into() }),
            profile: Some(pb::Profile {
                inbound_rules: rules(inbound),
                outbound_rules: rules(outbound),
            }),
        }))
    }

    pub(super) fn hit(owner: Owner, egress: bool, index: u32, packets: u64, bytes: u64) -> Hit {
        Hit {
            owner,
            egress,
            index,
            packets,
            bytes,
        }
    }

    /// Two stats-reporting nodes, both sent `shop/web` (2 inbound, 1 outbound rules, tier
    /// `default`) and profile `kns.shop` (1 inbound rule).
    pub(super) fn two_nodes() -> Hits {
        let mut h = Hits::default();
        for (node, conn) in [("node-a", 1), ("node-b", 2)] {
            h.connected(node, conn, true);
            h.queued(
                node,
                2,
                &[
                    policy_update(policy_id("web"), "default", 2, 1),
                    profile_update("kns.shop", 1, 0),
                ],
            );
        }
        h
    }

    #[test]
    fn deltas_add_up_across_reports_and_nodes() {
        let mut h = two_nodes();
        let web = policy_owner("web");
        assert!(
            h.add(
                "node-a",
                1,
                vec![hit(web.clone(), false, 0, 3, 300)],
                at(10),
                no_action
            )
            .is_empty()
        );
        assert!(
            h.add(
                "node-a",
                1,
                vec![hit(web.clone(), false, 0, 2, 200)],
                at(20),
                no_action
            )
            .is_empty()
        );
        assert!(
            h.add(
                "node-b",
                2,
                vec![hit(web.clone(), true, 0, 1, 60)],
                at(30),
                no_action
            )
            .is_empty()
        );
        let a = h.rule(&web, Some("node-a"), false, 0).expect("held");
        assert_eq!(
            (a.packets, a.bytes, a.first, a.last),
            (5, 500, at(10), at(20))
        );
        assert_eq!(
            h.totals(&web),
            Totals {
                packets: 6,
                bytes: 560,
                first: Some(at(10)),
                last: Some(at(30)),
            }
        );
        assert_eq!(h.entries(), 2);
        // Nothing counted for a policy nothing hit.
        assert_eq!(h.totals(&policy_owner("db")), Totals::default());
    }

    #[test]
    fn a_zero_delta_neither_creates_an_entry_nor_moves_the_last_hit() {
        let mut h = two_nodes();
        let web = policy_owner("web");
        h.add(
            "node-a",
            1,
            vec![hit(web.clone(), false, 1, 1, 10)],
            at(10),
            no_action,
        );
        h.add(
            "node-a",
            1,
            vec![hit(web.clone(), false, 1, 0, 0)],
            at(20),
            no_action,
        );
        h.add(
            "node-a",
            1,
            vec![hit(web.clone(), false, 0, 0, 0)],
            at(30),
            no_action,
        );
        assert_eq!(h.entries(), 1);
        assert_eq!(h.totals(&web).last, Some(at(10)));
    }

    #[test]
    fn a_node_adds_only_to_its_own_entries_and_only_on_its_current_stream() {
        let mut h = two_nodes();
        let web = policy_owner("web");
        h.add(
            "node-a",
            1,
            vec![hit(web.clone(), false, 0, 7, 700)],
            at(10),
            no_action,
        );
        // node-b reports the same rule: its own entry, node-a's is untouched.
        h.add(
            "node-b",
            2,
            vec![hit(web.clone(), false, 0, 1, 100)],
            at(20),
            no_action,
        );
        let a = h.rule(&web, Some("node-a"), false, 0).unwrap();
        assert_eq!((a.packets, a.last), (7, at(10)));
        assert_eq!(h.rule(&web, Some("node-b"), false, 0).unwrap().packets, 1);
        // A report on node-a's name from another stream (an old or a forged one) is dropped.
        assert_eq!(
            h.add(
                "node-a",
                2,
                vec![hit(web.clone(), false, 0, 9, 900)],
                at(30),
                no_action
            ),
            [(Refused::StaleStream, 1)]
        );
        // A replaced stream's reports are dropped; its counters stay.
        h.connected("node-a", 3, true);
        assert_eq!(
            h.add(
                "node-a",
                1,
                vec![hit(web.clone(), false, 0, 9, 900)],
                at(40),
                no_action
            ),
            [(Refused::StaleStream, 1)]
        );
        // The new stream has been sent nothing yet.
        assert_eq!(
            h.add(
                "node-a",
                3,
                vec![hit(web.clone(), false, 0, 9, 900)],
                at(40),
                no_action
            ),
            [(Refused::NotSent, 1)]
        );
        assert_eq!(h.rule(&web, Some("node-a"), false, 0).unwrap().packets, 7);
        // Disconnected: history stays, nothing more is added.
        h.disconnected("node-b");
        assert_eq!(
            h.add(
                "node-b",
                2,
                vec![hit(web.clone(), false, 0, 1, 1)],
                at(50),
                no_action
            ),
            [(Refused::StaleStream, 1)]
        );
        assert_eq!(h.totals(&web).packets, 8);
        // A stream without the capability is not followed at all.
        h.connected("node-c", 4, false);
        h.queued(
            "node-c",
            2,
            &[policy_update(policy_id("web"), "default", 2, 1)],
        );
        assert_eq!(
            h.add(
                "node-c",
                4,
                vec![hit(web.clone(), false, 0, 1, 1)],
                at(60),
                no_action
            ),
            [(Refused::StaleStream, 1)]
        );
    }

    #[test]
    fn an_unsent_policy_or_an_index_out_of_range_is_refused_and_creates_nothing() {
        let mut h = two_nodes();
        let refused = h.add(
            "node-a",
            1,
            vec![
                // Never sent.
                hit(policy_owner("db"), false, 0, 1, 1),
                // Same name, other kind or namespace: not the policy sent.
                hit(
                    Owner::Policy {
                        kind: "GlobalNetworkPolicy".into(),
                        namespace: String::new(),
                        name: "web".into(),
                    },
                    false,
                    0,
                    1,
                    1,
                ),
                // web has 2 inbound rules and 1 outbound.
                hit(policy_owner("web"), false, 2, 1, 1),
                hit(policy_owner("web"), true, 1, 1, 1),
                hit(Owner::Profile("kns.shop".into()), true, 0, 1, 1),
                hit(Owner::Profile("kns.other".into()), false, 0, 1, 1),
                hit(Owner::EndOfTier("security".into()), false, 0, 1, 1),
            ],
            at(10),
            no_action,
        );
        assert_eq!(refused, [(Refused::NotSent, 4), (Refused::OutOfRange, 3)]);
        assert_eq!(h.entries(), 0, "nothing refused is held");
        assert!(h.counts.is_empty() && h.names.is_empty());

        // Removed from the node: its rules are no longer the node's.
        h.queued(
            "node-a",
            2,
            &[msg(Payload::ActivePolicyRemove(pb::ActivePolicyRemove {
                id: Some(policy_id("web")),
            }))],
        );
        assert_eq!(
            h.add(
                "node-a",
                1,
                vec![hit(policy_owner("web"), false, 0, 1, 1)],
                at(20),
                no_action
            ),
            [(Refused::NotSent, 1)]
        );
        // An update that shrinks the policy bounds the index from then on.
        h.queued(
            "node-b",
            2,
            &[policy_update(policy_id("web"), "default", 1, 1)],
        );
        assert_eq!(
            h.add(
                "node-b",
                2,
                vec![hit(policy_owner("web"), false, 1, 1, 1)],
                at(20),
                no_action
            ),
            [(Refused::OutOfRange, 1)]
        );
        assert_eq!(h.entries(), 0);
    }

    #[test]
    fn a_staged_policy_decides_nothing() {
        let mut h = Hits::default();
        h.connected("node-a", 1, true);
        let staged = pb::PolicyId {
            kind: "StagedNetworkPolicy".into(),
            ..policy_id("web")
        };
        h.queued("node-a", 2, &[policy_update(staged, "security", 1, 1)]);
        let owner = Owner::Policy {
            kind: "StagedNetworkPolicy".into(),
            namespace: "shop".into(),
            name: "web".into(),
        };
        assert_eq!(
            h.add(
                "node-a",
                1,
                vec![
                    hit(owner, false, 0, 1, 1),
                    // Its tier holds no programmed policy of the node.
                    hit(Owner::EndOfTier("security".into()), false, 0, 1, 1),
                ],
                at(10),
                no_action,
            ),
            [(Refused::NotSent, 1), (Refused::Staged, 1)]
        );
        assert_eq!(h.entries(), 0);
    }

    #[test]
    fn verdicts_count_per_direction_and_tiers_while_the_node_has_their_policies() {
        let mut h = two_nodes();
        let verdicts = vec![
            hit(Owner::EndOfTier("default".into()), false, 0, 4, 400),
            hit(Owner::EndOfTier("default".into()), true, 0, 1, 100),
            hit(Owner::NoProfileMatched, false, 0, 2, 200),
            hit(Owner::DefaultAction, true, 0, 3, 300),
            // A verdict's index is not a rule's: any index is the one verdict.
            hit(Owner::Failsafe, false, 7, 5, 500),
            hit(Owner::Failsafe, false, 0, 5, 500),
        ];
        assert!(h.add("node-a", 1, verdicts, at(10), no_action).is_empty());
        let eot = Owner::EndOfTier("default".into());
        assert_eq!(h.rule(&eot, Some("node-a"), false, 0).unwrap().packets, 4);
        assert_eq!(h.rule(&eot, Some("node-a"), true, 0).unwrap().packets, 1);
        assert_eq!(h.totals(&Owner::Failsafe).packets, 10);
        assert_eq!(h.totals(&Owner::NoProfileMatched).bytes, 200);
        assert_eq!(h.entries(), 5);
        // Once the node holds no policy of the tier, its end is not the node's.
        h.queued(
            "node-a",
            2,
            &[msg(Payload::ActivePolicyRemove(pb::ActivePolicyRemove {
                id: Some(policy_id("web")),
            }))],
        );
        assert_eq!(
            h.add(
                "node-a",
                1,
                vec![hit(eot.clone(), false, 0, 1, 1)],
                at(20),
                no_action
            ),
            [(Refused::NotSent, 1)]
        );
        // A policy moved to another tier takes its tier's end along.
        h.queued(
            "node-b",
            2,
            &[policy_update(policy_id("web"), "security", 2, 1)],
        );
        assert_eq!(
            h.add(
                "node-b",
                2,
                vec![
                    hit(eot.clone(), false, 0, 1, 1),
                    hit(Owner::EndOfTier("security".into()), false, 0, 1, 1)
                ],
                at(20),
                no_action
            ),
            [(Refused::NotSent, 1)]
        );
    }

    fn report(hits: Vec<pb::RuleHits>) -> pb::RuleStats {
        pb::RuleStats { hits }
    }

    fn rule_hits(rule: pb::RuleRef) -> pb::RuleHits {
        pb::RuleHits {
            rule: Some(rule),
            packets: 1,
            bytes: 64,
        }
    }

    #[test]
    fn malformed_reports_are_refused_whole() {
        let policy = |id: Option<pb::PolicyId>| pb::RuleRef {
            kind: RefKind::PolicyRule as i32,
            policy: id,
            ..Default::default()
        };
        let cases: Vec<(pb::RuleStats, Malformed)> = vec![
            (
                report(vec![
                    rule_hits(policy(Some(policy_id("web"))));
                    MAX_HITS_PER_REPORT + 1
                ]),
                Malformed::TooManyHits(MAX_HITS_PER_REPORT + 1),
            ),
            (report(vec![pb::RuleHits::default()]), Malformed::NoRule(0)),
            (
                report(vec![rule_hits(pb::RuleRef {
                    kind: 42,
                    ..Default::default()
                })]),
                Malformed::UnknownKind { at: 0, kind: 42 },
            ),
            (
                report(vec![
                    rule_hits(policy(Some(policy_id("web")))),
                    rule_hits(policy(None)),
                ]),
                Malformed::Missing {
                    at: 1,
                    kind: "POLICY_RULE",
                    field: "policy",
                },
            ),
            (
                report(vec![rule_hits(policy(Some(policy_id(""))))]),
                Malformed::Missing {
                    at: 0,
                    kind: "POLICY_RULE",
                    field: "policy",
                },
            ),
            (
                report(vec![rule_hits(pb::RuleRef {
                    kind: RefKind::ProfileRule as i32,
                    // A policy id does not stand in for the profile's.
                    policy: Some(policy_id("web")),
                    ..Default::default()
                })]),
                Malformed::Missing {
                    at: 0,
                    kind: "PROFILE_RULE",
                    field: "profile",
                },
            ),
            (
                report(vec![rule_hits(pb::RuleRef {
                    kind: RefKind::EndOfTier as i32,
                    ..Default::default()
                })]),
                Malformed::Missing {
                    at: 0,
                    kind: "END_OF_TIER",
                    field: "tier",
                },
            ),
            (
                report(vec![rule_hits(policy(Some(policy_id(&"x".repeat(254)))))]),
                Malformed::BadId {
                    at: 0,
                    field: "policy.name",
                },
            ),
            (
                report(vec![rule_hits(policy(Some(policy_id("web\u{1b}[2J"))))]),
                Malformed::BadId {
                    at: 0,
                    field: "policy.name",
                },
            ),
            (
                report(vec![rule_hits(policy(Some(pb::PolicyId {
                    kind: "WorkloadEndpoint".into(),
                    ..policy_id("web")
                })))]),
                Malformed::BadId {
                    at: 0,
                    field: "policy.kind",
                },
            ),
            (
                report(vec![rule_hits(policy(Some(pb::PolicyId {
                    namespace: "Shop!".into(),
                    ..policy_id("web")
                })))]),
                Malformed::BadId {
                    at: 0,
                    field: "policy.namespace",
                },
            ),
            (
                report(vec![rule_hits(pb::RuleRef {
                    kind: RefKind::EndOfTier as i32,
                    tier: "a tier".into(),
                    ..Default::default()
                })]),
                Malformed::BadId {
                    at: 0,
                    field: "tier",
                },
            ),
        ];
        for (stats, want) in cases {
            let got = parse(&stats).unwrap_err();
            assert_eq!(got, want);
            let reason = if matches!(want, Malformed::TooManyHits(_)) {
                "too_many_hits"
            } else {
                "malformed"
            };
            assert_eq!(got.reason(), reason);
        }
        // The bound itself is accepted.
        let full = report(vec![
            rule_hits(policy(Some(policy_id("web"))));
            MAX_HITS_PER_REPORT
        ]);
        assert_eq!(parse(&full).unwrap().len(), MAX_HITS_PER_REPORT);
    }

    #[test]
    fn well_formed_references_parse_to_their_owners() {
        let stats = report(vec![
            rule_hits(pb::RuleRef {
                kind: RefKind::PolicyRule as i32,
                policy: Some(pb::PolicyId {
                    name: "allow-dns".into(),
                    namespace: String::new(),
                    kind: "GlobalNetworkPolicy".into(),
                }),
                egress: true,
                index: 3,
                ..Default::default()
            }),
            rule_hits(pb::RuleRef {
                kind: RefKind::ProfileRule as i32,
                profile: Some(pb::ProfileId {
                    name: "ksa.shop.default".into(),
                }),
                index: 1,
                ..Default::default()
            }),
            rule_hits(pb::RuleRef {
                kind: RefKind::EndOfTier as i32,
                tier: "security".into(),
                index: 9,
                ..Default::default()
            }),
            rule_hits(pb::RuleRef {
                kind: RefKind::NoProfileMatched as i32,
                egress: true,
                ..Default::default()
            }),
        ]);
        let owners: Vec<(Owner, bool, u32)> = parse(&stats)
            .unwrap()
            .into_iter()
            .map(|h| (h.owner, h.egress, h.index))
            .collect();
        assert_eq!(
            owners,
            [
                (
                    Owner::Policy {
                        kind: "GlobalNetworkPolicy".into(),
                        namespace: String::new(),
                        name: "allow-dns".into()
                    },
                    true,
                    3
                ),
                (Owner::Profile("ksa.shop.default".into()), false, 1),
                (Owner::EndOfTier("security".into()), false, 0),
                (Owner::NoProfileMatched, true, 0),
            ]
        );
    }

    fn applied_msgs() -> Vec<pb::ToDataplane> {
        vec![
            policy_update(policy_id("web"), "default", 2, 1),
            profile_update("kns.shop", 1, 0),
        ]
    }

    /// A rule is observed from the first `DataplaneApplied` that covers it on a stats stream;
    /// queued alone it is not in force; a staged policy never is; a rule added later is
    /// observed from later; the first time stays.
    #[test]
    fn rules_are_observed_once_applied_on_a_node_that_reports_stats() {
        let mut h = Hits::default();
        h.connected("node-a", 1, true);
        // Sequence 2 and 3 (the ServerHello is 1).
        h.queued("node-a", 2, &applied_msgs());
        let staged = pb::PolicyId {
            kind: "StagedNetworkPolicy".into(),
            ..policy_id("web")
        };
        h.queued("node-a", 4, &[policy_update(staged, "default", 1, 0)]);
        let web = h.policy_sig("NetworkPolicy", "shop", "web");
        let kns = h.profile_sig("kns.shop");
        assert!(h.seen.is_empty(), "queued is not in force");
        // Another stream's report, or one that covers only the policy.
        assert!(!h.applied("node-a", 9, 3, at(5)));
        assert!(h.applied("node-a", 1, 2, at(10)));
        assert_eq!(h.seen[&web].since, [vec![at(10); 2], vec![at(10)]]);
        assert!(!h.seen.contains_key(&kns));
        assert!(h.applied("node-a", 1, 4, at(20)));
        assert_eq!(h.seen[&kns].since, [vec![at(20)], vec![]]);
        assert_eq!(h.seen.len(), 2, "the staged policy is never observed");
        assert!(h.seen[&web].first() == Some(at(10)));

        // Another node applies it later: the first time stays. An edit with a third ingress
        // rule observes only that rule from then.
        h.connected("node-b", 2, true);
        h.queued("node-b", 2, &applied_msgs());
        assert!(
            h.sent["node-b"].pending.is_empty(),
            "nothing new to observe"
        );
        h.queued(
            "node-b",
            4,
            &[policy_update(policy_id("web"), "default", 3, 1)],
        );
        assert!(h.applied("node-b", 2, 4, at(30)));
        assert_eq!(
            h.seen[&web].since,
            [vec![at(10), at(10), at(30)], vec![at(10)]]
        );
        // Updates that add no rule to one already pending are not queued again.
        h.connected("node-c", 3, true);
        let grown = policy_update(policy_id("web"), "default", 4, 1);
        h.queued("node-c", 2, &[grown.clone(), grown.clone(), grown]);
        assert_eq!(h.sent["node-c"].pending.len(), 1);
        // A stream without the capability observes nothing.
        let mut h = Hits::default();
        h.connected("node-c", 3, false);
        h.queued("node-c", 2, &applied_msgs());
        assert!(!h.applied("node-c", 3, 10, at(10)));
        assert!(h.seen.is_empty());
        // A reconnect forgets what the old stream had not applied.
        let mut h = Hits::default();
        h.connected("node-a", 1, true);
        h.queued("node-a", 2, &applied_msgs());
        h.connected("node-a", 2, true);
        assert!(!h.applied("node-a", 2, 10, at(10)));
        assert!(h.seen.is_empty());
    }

    /// Each accepted hit goes to its owner's totals under the action its rule has; a hit whose
    /// action is not known adds to the rule's counters only.
    #[test]
    fn totals_by_action_add_up_what_was_accepted() {
        let mut h = two_nodes();
        let web = policy_owner("web");
        let action = |_: &Owner, egress: bool, index: u32| match (egress, index) {
            (false, 0) => Some(Action::Allow),
            (false, 1) => Some(Action::Deny),
            _ => None,
        };
        h.add(
            "node-a",
            1,
            vec![
                hit(web.clone(), false, 0, 3, 300),
                hit(web.clone(), false, 1, 1, 100),
                hit(web.clone(), true, 0, 5, 500),
                // Refused (out of range): in no total.
                hit(web.clone(), true, 1, 7, 700),
                // A verdict has no owner totals.
                hit(Owner::Failsafe, false, 0, 9, 900),
            ],
            at(10),
            action,
        );
        h.add(
            "node-b",
            2,
            vec![hit(web.clone(), false, 0, 2, 200)],
            at(20),
            action,
        );
        let sig = h.policy_sig("NetworkPolicy", "shop", "web");
        let seen = &h.seen[&sig];
        assert_eq!(seen.by_action[Action::Allow as usize], (5, 500));
        assert_eq!(seen.by_action[Action::Deny as usize], (1, 100));
        assert_eq!(seen.by_action[Action::Pass as usize], (0, 0));
        assert_eq!(h.totals(&web).packets, 11, "the rule counters have all");
        assert!(seen.first().is_none(), "hit, but not observed as applied");
        assert_eq!(h.seen.len(), 1);
    }
}
