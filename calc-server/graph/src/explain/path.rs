//! Explain queries over the graph's state: resolving names and addresses to endpoints, and
//! composing the chains a packet meets on its way (see [`crate::explain`]).
//!
//! Contract: read-only. The tier lists, rules and IP-set members walked are exactly the ones
//! the graph sends the nodes involved. The path is the Linux dataplane's:
//! - a workload's egress (`cali-fw-`) and ingress (`cali-tw-`) chains;
//! - forwarded traffic (to, from or between workloads, on each node it crosses) also meets the
//!   node's `*` host endpoint's forward policy (`cali-fhfw-` before, `cali-thfw-` after);
//! - traffic to a host endpoint from off the node meets its doNotTrack, pre-DNAT and normal
//!   ingress policy (an allow in the first two accepts at once); from a workload on the same
//!   node, `DefaultEndpointToHostAction` instead; traffic from a host endpoint meets its
//!   doNotTrack and normal egress policy; traffic between a host and its own workloads is not
//!   policed by host endpoints or by the workload's ingress policy.
//!
//! A named host endpoint's interface is not known to the server: on a forwarded path only the
//! node's `*` endpoint is taken into account.

use std::net::IpAddr;
use std::rc::Rc;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use felix_proto as pb;
use pb::to_dataplane::Payload;

use super::{CalcGraph, Key};
use crate::convert::EndpointKind;
use crate::explain::rules::{Sets, cidr_contains, protocol_name, protocol_number};
use crate::explain::walk::{self, Chain, Failsafe, Outcome, State, policy_label};
use crate::explain::{
    DecidedBy, Dir, Explanation, Packet, Peer, Query, QueryError, Side, Stage, Step, Verdict,
    parse_protocol_and_ports,
};
use crate::model::{Kind, ResourceKey};
use crate::policy_resolver::{self, PolicyRef, ResolvedTiers};

/// A query's source or destination.
enum Subject {
    /// An endpoint, and the address the query named it by, if it did.
    Endpoint(Key, Option<IpAddr>),
    Outside(IpAddr),
}

/// An endpoint as the path needs it.
struct Ep {
    name: String,
    node: String,
    host: bool,
    wildcard: bool,
    v4: Vec<IpAddr>,
    v6: Vec<IpAddr>,
    endpoint: Payload,
}

impl Ep {
    fn tiers(&self) -> (&[pb::TierInfo], &[String]) {
        match &self.endpoint {
            Payload::WorkloadEndpointUpdate(u) => {
                let e = u.endpoint.as_ref().expect("built with an endpoint");
                (&e.tiers, &e.profile_ids)
            }
            Payload::HostEndpointUpdate(u) => {
                let e = u.endpoint.as_ref().expect("built with an endpoint");
                (&e.tiers, &e.profile_ids)
            }
            _ => (&[], &[]),
        }
    }

    fn host(&self) -> Option<&pb::HostEndpoint> {
        match &self.endpoint {
            Payload::HostEndpointUpdate(u) => u.endpoint.as_ref(),
            _ => None,
        }
    }
}

fn first_ip(nets: &[String]) -> Vec<IpAddr> {
    nets.iter()
        .filter_map(|n| n.split('/').next()?.parse().ok())
        .collect()
}

/// The graph as the walk reads it, with every policy ordered once for the query.
struct View<'g> {
    g: &'g CalcGraph,
    all: Rc<ResolvedTiers>,
    /// Each active policy's key by its `PolicyID` (a converted kind's id is not its key).
    keys: Rc<FxHashMap<(&'g str, &'g str, &'g str), &'g Key>>,
    /// The pending verdict: staged policies evaluated as if enforced.
    pending: bool,
}

impl Sets for View<'_> {
    fn selects_endpoint(&self, selector: &crate::selector::Selector, ip: IpAddr) -> Option<bool> {
        let mut any = None;
        for (item, e) in &self.g.endpoints {
            if !e.nets.iter().any(|n| cidr_contains(n, ip)) {
                continue;
            }
            let labels = self.g.index.effective_labels(*item)?;
            // An IP set holds the address if any endpoint there is selected.
            if selector.evaluate(&labels) {
                return Some(true);
            }
            any = Some(false);
        }
        any
    }

    fn has_ip(&self, id: &str, ip: IpAddr) -> bool {
        self.g.ipsets.get(id).is_some_and(|s| {
            s.members
                .keys()
                .any(|m| cidr_contains(self.g.members.get(*m), ip))
        })
    }

    fn has_ip_port(&self, id: &str, ip: IpAddr, protocol: u8, port: u16) -> bool {
        let Some(set) = self.g.ipsets.get(id) else {
            return false;
        };
        set.members.keys().any(|m| {
            let Some((addr, rest)) = self.g.members.get(*m).split_once(',') else {
                return false;
            };
            let Some((proto, p)) = rest.split_once(':') else {
                return false;
            };
            addr.parse::<IpAddr>().is_ok_and(|a| a == ip)
                && protocol_number(proto) == Some(protocol)
                && p.parse::<u16>().is_ok_and(|p| p == port)
        })
    }
}

impl State for View<'_> {
    fn policy(&self, id: &pb::PolicyId) -> Option<Arc<pb::Policy>> {
        let key = self.key(id)?;
        self.g.policies.get(key).map(|p| p.message.clone())
    }

    fn enforce_staged(&self) -> bool {
        self.pending
    }

    fn profile(&self, name: &str) -> Arc<pb::Profile> {
        match self.g.profiles.get(name) {
            Some(p) => p.message.clone(),
            None => {
                let (inbound_rules, outbound_rules) = crate::rule_scanner::missing_profile_rules();
                Arc::new(pb::Profile {
                    inbound_rules,
                    outbound_rules,
                })
            }
        }
    }

    fn tier_policies(&self, tier: &str, stage: Stage, dir: Dir) -> Vec<(pb::PolicyId, String)> {
        let Some(t) = self.lists(stage).iter().find(|t| t.name == tier) else {
            return Vec::new();
        };
        let ids = match dir {
            Dir::Ingress => &t.ingress_policies,
            Dir::Egress => &t.egress_policies,
        };
        ids.iter()
            .map(|id| {
                let selector = self
                    .key(id)
                    .and_then(|k| self.g.policies.get(k))
                    .map(|p| p.model.selector.canonical().to_string())
                    .unwrap_or_default();
                (id.clone(), selector)
            })
            .collect()
    }

    fn tiers(&self, stage: Stage, dir: Dir) -> Vec<String> {
        self.lists(stage)
            .iter()
            .filter(|t| match dir {
                Dir::Ingress => !t.ingress_policies.is_empty(),
                Dir::Egress => !t.egress_policies.is_empty(),
            })
            .map(|t| t.name.clone())
            .collect()
    }
}

impl View<'_> {
    fn key(&self, id: &pb::PolicyId) -> Option<&Key> {
        self.keys
            .get(&(id.kind.as_str(), id.namespace.as_str(), id.name.as_str()))
            .copied()
    }

    /// The same view, for the pending verdict.
    fn pending(&self) -> Self {
        View {
            g: self.g,
            all: self.all.clone(),
            keys: self.keys.clone(),
            pending: true,
        }
    }

    fn lists(&self, stage: Stage) -> &[pb::TierInfo] {
        match stage {
            Stage::Normal => &self.all.normal,
            Stage::Untracked => &self.all.untracked,
            Stage::PreDnat => &self.all.pre_dnat,
            Stage::Forward => &self.all.forward,
        }
    }
}

/// The failsafes the node's agent programs: FelixConfiguration's value read as the agent reads
/// it, else Felix's default (an agent keeps its flag's value, by default Felix's, when the
/// configured one is invalid).
fn failsafes(config: &pb::ConfigUpdate, name: &str, default: &str) -> Vec<Failsafe> {
    use calico_names::felix_config::parse_failsafes;
    let list = config
        .config
        .get(name)
        .and_then(|v| parse_failsafes(v).ok())
        .or_else(|| parse_failsafes(default).ok())
        .unwrap_or_default();
    list.iter()
        .filter_map(|f| {
            Some(Failsafe {
                protocol: protocol_number(&f.protocol)?,
                port: f.port,
            })
        })
        .collect()
}

/// Steps of one side, and the first verdict among its chains.
struct SideBuilder {
    endpoint: Option<String>,
    steps: Vec<Step>,
    decided: Option<(Verdict, DecidedBy)>,
}

impl SideBuilder {
    fn new(endpoint: Option<String>) -> Self {
        SideBuilder {
            endpoint,
            steps: Vec::new(),
            decided: None,
        }
    }

    fn done(&self) -> bool {
        matches!(self.decided, Some((Verdict::Deny, _)))
    }

    /// Walks a chain; a deny ends the side, an allow is remembered unless a later chain
    /// denies (`final_allow`: the allow is the last word, as an accept in raw or mangle is).
    fn chain(
        &mut self,
        who: &str,
        c: &Chain<'_>,
        p: &Packet,
        view: &View<'_>,
        final_allow: bool,
    ) -> bool {
        if self.done() {
            return true;
        }
        let start = self.steps.len();
        let outcome = walk::walk(c, p, view, &mut self.steps);
        for s in &mut self.steps[start..] {
            s.endpoint = Some(who.to_string());
        }
        match outcome {
            Outcome::Deny(d) => {
                self.decided = Some((Verdict::Deny, d));
                true
            }
            Outcome::Allow(d) => {
                // The endpoint's own policy explains more than a host endpoint's default.
                let keep = matches!(&self.decided, Some((_, by)) if !matches!(by, DecidedBy::Default { .. }))
                    || (self.decided.is_some() && matches!(d, DecidedBy::Default { .. }));
                if !keep {
                    self.decided = Some((Verdict::Allow, d));
                }
                final_allow
            }
            Outcome::Continue => false,
        }
    }

    fn note(&mut self, stage: &str, outcome: String) {
        self.steps.push(Step {
            stage: stage.to_string(),
            outcome,
            ..Step::default()
        });
    }

    fn decide(&mut self, v: Verdict, default: &str) {
        self.decided = Some((
            v,
            DecidedBy::Default {
                default: default.to_string(),
            },
        ));
    }

    fn finish(self, fallback: &str) -> Side {
        let (verdict, decided_by) = self.decided.unwrap_or((
            Verdict::Allow,
            DecidedBy::Default {
                default: fallback.to_string(),
            },
        ));
        Side {
            endpoint: self.endpoint,
            verdict,
            decided_by,
            steps: self.steps,
        }
    }
}

impl CalcGraph {
    /// Why traffic from `q.from` to `q.to` is allowed or denied.
    pub fn explain(&self, q: &Query) -> Result<Explanation, QueryError> {
        let (protocol, dst_port, src_port) = parse_protocol_and_ports(q)?;
        let from = self.resolve(&q.from)?;
        let to = self.resolve(&q.to)?;
        let (src_ep, dst_ep) = (self.ep(&from), self.ep(&to));
        let (src, dst) = pick_addresses(&from, src_ep.as_ref(), &to, dst_ep.as_ref())?;
        let icmp = match protocol {
            1 => Some((8, 0)),
            58 => Some((128, 0)),
            _ => None,
        };
        let packet = Packet {
            src,
            dst,
            protocol,
            src_port,
            dst_port,
            icmp,
        };
        let view = self.view();
        let sides = |view: &View<'_>| {
            let egress = self.egress_side(src_ep.as_ref(), dst_ep.as_ref(), &packet, view);
            let ingress = self.ingress_side(src_ep.as_ref(), dst_ep.as_ref(), &packet, view);
            let verdict = if egress.verdict == Verdict::Allow && ingress.verdict == Verdict::Allow {
                Verdict::Allow
            } else {
                Verdict::Deny
            };
            (verdict, egress, ingress)
        };
        let (verdict, egress, ingress) = sides(&view);
        // The pending verdict is shown when a staged policy selects an endpoint on the path.
        let (pending_verdict, pending_egress, pending_ingress) = sides(&view.pending());
        let met_staged = |side: &Side| {
            side.steps.iter().any(|s| {
                s.selected == Some(true)
                    && s.kind
                        .as_deref()
                        .is_some_and(calico_names::is_staged_policy_kind)
            })
        };
        let pending = (met_staged(&pending_egress) || met_staged(&pending_ingress)).then_some(
            crate::explain::Pending {
                verdict: pending_verdict,
                egress: pending_egress,
                ingress: pending_ingress,
            },
        );
        Ok(Explanation {
            pending,
            verdict,
            from: self.peer(src_ep.as_ref(), src),
            to: self.peer(dst_ep.as_ref(), dst),
            protocol: protocol_name(protocol),
            port: dst_port,
            egress,
            ingress,
        })
    }

    fn view(&self) -> View<'_> {
        let refs: Vec<PolicyRef<'_>> = self
            .policies
            .values()
            .map(|p| PolicyRef {
                model: &p.model,
                sort_string: &p.sort_string,
            })
            .collect();
        let keys = self
            .policies
            .iter()
            .map(|(k, p)| {
                let id = &p.model.id;
                (
                    (id.kind.as_str(), id.namespace.as_str(), id.name.as_str()),
                    k,
                )
            })
            .collect();
        View {
            g: self,
            all: Rc::new(policy_resolver::resolve(refs, |t| self.tier(t))),
            keys: Rc::new(keys),
            pending: false,
        }
    }

    fn peer(&self, ep: Option<&Ep>, ip: IpAddr) -> Peer {
        match ep {
            Some(e) => Peer {
                kind: if e.host { "host endpoint" } else { "workload" }.into(),
                name: e.name.clone(),
                node: Some(e.node.clone()),
                ip: ip.to_string(),
                network_sets: Vec::new(),
            },
            None => Peer {
                kind: "outside the cluster".into(),
                name: ip.to_string(),
                node: None,
                ip: ip.to_string(),
                network_sets: self.network_sets_holding(ip),
            },
        }
    }

    fn network_sets_holding(&self, ip: IpAddr) -> Vec<String> {
        let mut out: Vec<String> = self
            .item_of
            .iter()
            .filter(|(k, _)| matches!(k.kind, Kind::NetworkSet | Kind::GlobalNetworkSet))
            .filter(|(_, item)| {
                self.netsets
                    .get(item)
                    .is_some_and(|ns| ns.nets.iter().any(|n| cidr_contains(n, ip)))
            })
            .map(|(k, _)| match &k.namespace {
                Some(ns) => format!("{ns}/{}", k.name),
                None => k.name.clone(),
            })
            .collect();
        out.sort();
        out
    }

    /// Resolves `namespace/pod`, a WorkloadEndpoint name (optionally `namespace/`-prefixed),
    /// `hep:NAME` or an IP address.
    fn resolve(&self, what: &str) -> Result<Subject, QueryError> {
        let what = what.trim();
        if what.is_empty() {
            return Err(QueryError::Bad("an empty endpoint name".into()));
        }
        let mut found: Vec<Key> = Vec::new();
        if let Some(name) = what.strip_prefix("hep:") {
            let key = ResourceKey::new(Kind::HostEndpoint, None, name);
            if let Some((k, _)) = self.item_of.get_key_value(&key) {
                found.push(k.clone());
            }
        } else if let Ok(ip) = what.parse::<IpAddr>() {
            for e in self.endpoints.values() {
                if e.nets.iter().any(|n| cidr_contains(n, ip)) {
                    found.push(e.key.clone());
                }
            }
            if found.is_empty() {
                return Ok(Subject::Outside(ip));
            }
        } else {
            let (ns, name) = match what.split_once('/') {
                Some((ns, name)) => (Some(ns), name),
                None => (None, what),
            };
            for e in self.endpoints.values() {
                let EndpointKind::Workload { workload_id, .. } = &e.model.kind else {
                    continue;
                };
                let by_pod = ns.is_some() && workload_id == what;
                let by_name = e.key.name == name
                    && ns.is_none_or(|ns| e.key.namespace.as_deref() == Some(ns));
                if by_pod || by_name {
                    found.push(e.key.clone());
                }
            }
        }
        found.sort();
        found.dedup();
        match found.len() {
            0 => Err(QueryError::Unknown(what.to_string())),
            1 => Ok(Subject::Endpoint(found.remove(0), what.parse().ok())),
            _ => Err(QueryError::Ambiguous {
                what: what.to_string(),
                candidates: found.iter().map(|k| full_name(k)).collect(),
            }),
        }
    }

    fn ep(&self, s: &Subject) -> Option<Ep> {
        let Subject::Endpoint(key, _) = s else {
            return None;
        };
        let state = self.endpoints.get(self.item_of.get(key)?)?;
        let endpoint = self.endpoint_message(key)?;
        let m = &state.model;
        let (name, host, wildcard) = match &m.kind {
            EndpointKind::Workload { workload_id, .. } => {
                let name = if workload_id.contains('/') {
                    workload_id.clone()
                } else {
                    full_name(key)
                };
                (name, false, false)
            }
            EndpointKind::Host { interface_name, .. } => {
                (format!("hep:{}", key.name), true, interface_name == "*")
            }
        };
        let (v4, v6) = match &m.kind {
            EndpointKind::Host {
                expected_ipv4,
                expected_ipv6,
                ..
            } => (first_ip(expected_ipv4), first_ip(expected_ipv6)),
            EndpointKind::Workload { .. } => (first_ip(&m.ipv4_nets), first_ip(&m.ipv6_nets)),
        };
        Some(Ep {
            name,
            node: m.node.clone(),
            host,
            wildcard,
            v4,
            v6,
            endpoint,
        })
    }

    /// The node's `*` host endpoint, which polices traffic forwarded through the node.
    fn wildcard_hep(&self, node: &str) -> Option<Ep> {
        let mut heps: Vec<&Key> = self
            .endpoints
            .values()
            .filter(|e| {
                e.model.node == node
                    && matches!(&e.model.kind, EndpointKind::Host { interface_name, .. } if interface_name == "*")
            })
            .map(|e| &e.key)
            .collect();
        heps.sort();
        heps.first()
            .and_then(|k| self.ep(&Subject::Endpoint((*k).clone(), None)))
    }

    fn failsafes_of(&self, node: &str, dir: Dir) -> Vec<Failsafe> {
        let config = self.config_for(node);
        match dir {
            Dir::Ingress => failsafes(
                &config,
                "FailsafeInboundHostPorts",
                calico_names::felix_config::DEFAULT_FAILSAFES_IN,
            ),
            Dir::Egress => failsafes(
                &config,
                "FailsafeOutboundHostPorts",
                calico_names::felix_config::DEFAULT_FAILSAFES_OUT,
            ),
        }
    }

    /// The forward chain of `node`'s `*` host endpoint, if it has one.
    fn forward_stage(
        &self,
        node: &str,
        dir: Dir,
        side: &mut SideBuilder,
        p: &Packet,
        view: &View<'_>,
    ) {
        let Some(h) = self.wildcard_hep(node) else {
            return;
        };
        let forward = &h.host().expect("a host endpoint").forward_tiers;
        let c = Chain {
            stage: Stage::Forward,
            dir,
            tiers: forward,
            profiles: &[],
            failsafes: &[],
            drop_encap: false,
        };
        side.chain(
            &format!("{} (node {node}, forwarded)", h.name),
            &c,
            p,
            view,
            false,
        );
    }

    fn egress_side(&self, src: Option<&Ep>, dst: Option<&Ep>, p: &Packet, view: &View<'_>) -> Side {
        let Some(s) = src else {
            let mut side = SideBuilder::new(None);
            side.note(
                "outside",
                "allow: the source is outside the cluster; no policy of ours applies there".into(),
            );
            return side.finish("no policy");
        };
        let mut side = SideBuilder::new(Some(s.name.clone()));
        let same_node = dst.is_some_and(|d| d.node == s.node);
        let (tiers, profiles) = s.tiers();
        if !s.host {
            // Forwarded from a workload: the node's `*` endpoint's forward ingress first,
            // unless the packet goes to the host itself.
            let to_own_host = same_node && dst.is_some_and(|d| d.host);
            if !to_own_host {
                self.forward_stage(&s.node, Dir::Ingress, &mut side, p, view);
            }
            let c = Chain {
                stage: Stage::Normal,
                dir: Dir::Egress,
                tiers,
                profiles,
                failsafes: &[],
                drop_encap: true,
            };
            side.chain(&s.name, &c, p, view, false);
            // Leaving the node (a local destination meets this after its own ingress).
            if !same_node {
                self.forward_stage(&s.node, Dir::Egress, &mut side, p, view);
            }
            return side.finish("no policy");
        }
        // From the host through its host endpoint.
        if same_node && dst.is_some_and(|d| !d.host) {
            side.note(
                "host",
                "allow: traffic from a host to its own workloads skips host endpoint policy".into(),
            );
            return side.finish("host to local workload");
        }
        self.host_side(side, s, Dir::Egress, p, view)
    }

    fn ingress_side(
        &self,
        src: Option<&Ep>,
        dst: Option<&Ep>,
        p: &Packet,
        view: &View<'_>,
    ) -> Side {
        let Some(d) = dst else {
            let mut side = SideBuilder::new(None);
            side.note(
                "outside",
                "allow: the destination is outside the cluster; no policy of ours applies there"
                    .into(),
            );
            return side.finish("no policy");
        };
        let mut side = SideBuilder::new(Some(d.name.clone()));
        let same_node = src.is_some_and(|s| s.node == d.node);
        let (tiers, profiles) = d.tiers();
        if !d.host {
            if same_node && src.is_some_and(|s| s.host) {
                side.note(
                    "host",
                    "allow: traffic from a host to its own workloads is not policed".into(),
                );
                return side.finish("host to local workload");
            }
            // Forwarded to a workload: from another node, the node's `*` endpoint's forward
            // ingress first (a local workload's packet met it on the egress side).
            if !same_node {
                self.forward_stage(&d.node, Dir::Ingress, &mut side, p, view);
            }
            let c = Chain {
                stage: Stage::Normal,
                dir: Dir::Ingress,
                tiers,
                profiles,
                failsafes: &[],
                drop_encap: false,
            };
            side.chain(&d.name, &c, p, view, false);
            self.forward_stage(&d.node, Dir::Egress, &mut side, p, view);
            return side.finish("no policy");
        }
        // To the host through its host endpoint.
        if same_node && src.is_some_and(|s| !s.host) {
            let action = self
                .config_for(&d.node)
                .config
                .get("DefaultEndpointToHostAction")
                .cloned()
                .unwrap_or_else(|| "Drop".into());
            let what = format!("DefaultEndpointToHostAction {action}");
            if action.eq_ignore_ascii_case("drop") {
                side.note("host", format!("deny: {what} (workload to its own host)"));
                side.decide(Verdict::Deny, &what);
            } else {
                side.note("host", format!("allow: {what} (workload to its own host)"));
                side.decide(Verdict::Allow, &what);
            }
            return side.finish(&what);
        }
        if same_node {
            side.note(
                "host",
                "allow: traffic from the host to itself is not policed".into(),
            );
            return side.finish("host to itself");
        }
        self.host_side(side, d, Dir::Ingress, p, view)
    }

    /// A host endpoint's chains for traffic to or from its own host: doNotTrack (and, inbound,
    /// pre-DNAT) policy, whose Allow is final, then its normal policy and profiles; each opens
    /// with the failsafes.
    fn host_side(
        &self,
        mut side: SideBuilder,
        e: &Ep,
        dir: Dir,
        p: &Packet,
        view: &View<'_>,
    ) -> Side {
        let h = e.host().expect("a host endpoint");
        let failsafes = self.failsafes_of(&e.node, dir);
        let mut early: Vec<(Stage, &[pb::TierInfo])> = vec![(Stage::Untracked, &h.untracked_tiers)];
        if dir == Dir::Ingress {
            early.push((Stage::PreDnat, &h.pre_dnat_tiers));
        }
        // As in Felix, doNotTrack and pre-DNAT policy do not apply to the `*` endpoint.
        if !e.wildcard {
            for (stage, tiers) in early.into_iter().filter(|(_, t)| !t.is_empty()) {
                let c = Chain {
                    stage,
                    dir,
                    tiers,
                    profiles: &[],
                    failsafes: &failsafes,
                    drop_encap: false,
                };
                if side.chain(&e.name, &c, p, view, true) {
                    return side.finish("no policy");
                }
            }
        }
        let (tiers, profiles) = e.tiers();
        let c = Chain {
            stage: Stage::Normal,
            dir,
            tiers,
            profiles,
            failsafes: &failsafes,
            drop_encap: false,
        };
        side.chain(&e.name, &c, p, view, false);
        side.finish("no policy")
    }
}

impl CalcGraph {
    /// Answers any explain request, as JSON (an [`Explanation`], an
    /// [`crate::explain::EndpointPolicies`] or a [`crate::explain::PolicyReach`]).
    pub fn answer(&self, r: &crate::explain::Request) -> Result<serde_json::Value, QueryError> {
        use crate::explain::Request;
        let value = match r {
            Request::Path(q) => serde_json::to_value(self.explain(q)?),
            Request::Endpoint(e) => serde_json::to_value(self.explain_endpoint(e)?),
            Request::Policy(p) => serde_json::to_value(self.explain_policy(p)?),
        };
        Ok(value.expect("explain answers are plain data"))
    }

    /// The tiers, policies and profiles that apply to an endpoint, per chain and direction.
    pub fn explain_endpoint(
        &self,
        what: &str,
    ) -> Result<crate::explain::EndpointPolicies, QueryError> {
        let subject = self.resolve(what)?;
        if let Subject::Outside(ip) = &subject {
            return Err(QueryError::Bad(format!(
                "{ip} is not an endpoint's address: no policy of ours applies to it"
            )));
        }
        let ep = self
            .ep(&subject)
            .ok_or_else(|| QueryError::Unknown(what.to_string()))?;
        let view = self.view();
        let brief = |t: &pb::TierInfo, dir: Dir| crate::explain::TierPolicies {
            tier: t.name.clone(),
            default_action: t.default_action.clone(),
            policies: match dir {
                Dir::Ingress => &t.ingress_policies,
                Dir::Egress => &t.egress_policies,
            }
            .iter()
            .map(|id| crate::explain::PolicyBrief {
                policy: policy_label(id),
                kind: id.kind.clone(),
                selector: view
                    .key(id)
                    .and_then(|k| self.policies.get(k))
                    .map(|p| p.model.selector.canonical().to_string())
                    .unwrap_or_default(),
            })
            .collect(),
        };
        let chain = |stage: Stage, tiers: &[pb::TierInfo]| crate::explain::ChainPolicies {
            stage: stage.label(),
            ingress: tiers
                .iter()
                .filter(|t| !t.ingress_policies.is_empty())
                .map(|t| brief(t, Dir::Ingress))
                .collect(),
            egress: tiers
                .iter()
                .filter(|t| !t.egress_policies.is_empty())
                .map(|t| brief(t, Dir::Egress))
                .collect(),
        };
        let (tiers, profiles) = ep.tiers();
        let mut chains = vec![chain(Stage::Normal, tiers)];
        if let Some(h) = ep.host() {
            chains.push(chain(Stage::Untracked, &h.untracked_tiers));
            chains.push(chain(Stage::PreDnat, &h.pre_dnat_tiers));
            chains.push(chain(Stage::Forward, &h.forward_tiers));
        }
        let first = ep.v4.first().or(ep.v6.first()).copied();
        let mut endpoint = self.peer(Some(&ep), first.unwrap_or(IpAddr::from([0, 0, 0, 0])));
        if first.is_none() {
            endpoint.ip = String::new();
        }
        Ok(crate::explain::EndpointPolicies {
            endpoint,
            addresses: ep.v4.iter().chain(&ep.v6).map(|a| a.to_string()).collect(),
            chains,
            profiles: profiles.to_vec(),
        })
    }

    /// The endpoints a policy selects and the nodes where it is active.
    /// `what` is `NAME` (a global policy), `NAMESPACE/NAME`, either optionally preceded by
    /// a kind and a colon (`StagedNetworkPolicy:prod/trial`, or Calico's short form `snp:`), to
    /// pick one of several policies of the same name.
    pub fn explain_policy(&self, what: &str) -> Result<crate::explain::PolicyReach, QueryError> {
        let (kind, rest) = match what.trim().split_once(':') {
            Some((k, rest)) => {
                let kind = Kind::policy_by_name(k).ok_or_else(|| {
                    QueryError::Bad(format!(
                        "unknown policy kind {k:?} in {what:?} (a kind such as NetworkPolicy or StagedGlobalNetworkPolicy, or Calico's short form: np, gnp, snp, sgnp, sknp, kcnp)"
                    ))
                })?;
                (Some(kind), rest)
            }
            None => (None, what.trim()),
        };
        let (ns, name) = match rest.split_once('/') {
            Some((ns, name)) => (Some(ns), name),
            None => (None, rest),
        };
        let mut found: Vec<&Key> = self
            .policies
            .keys()
            .filter(|k| {
                (k.name == name || self.policies[*k].model.id.name == name)
                    && (ns.is_none() || k.namespace.as_deref() == ns)
                    && kind.is_none_or(|kind| k.kind == kind)
            })
            .collect();
        found.sort();
        let key = match found.as_slice() {
            [] => {
                return Err(QueryError::Bad(format!(
                    "no policy {what:?} in the datastore (give NAME for a global policy, NAMESPACE/NAME for a namespaced one)"
                )));
            }
            [k] => (*k).clone(),
            many => {
                return Err(QueryError::Ambiguous {
                    what: what.to_string(),
                    candidates: many
                        .iter()
                        .map(|k| format!("{}:{}", k.kind.as_str(), full_name(k)))
                        .collect(),
                });
            }
        };
        let p = &self.policies[&key];
        let mut endpoints: Vec<String> = self
            .endpoints
            .values()
            .filter(|e| e.policies.contains(&key))
            .filter_map(|e| {
                self.ep(&Subject::Endpoint(e.key.clone(), None))
                    .map(|e| e.name)
            })
            .collect();
        endpoints.sort();
        let mut nodes: Vec<String> = if self.everywhere.contains(&key) {
            self.known_nodes()
        } else {
            self.nodes
                .iter()
                .filter(|(_, n)| n.span.policy_refs.contains_key(&key))
                .map(|(name, _)| name.to_string())
                .collect()
        };
        nodes.sort();
        let mut types = Vec::new();
        if p.model.ingress {
            types.push(Dir::Ingress);
        }
        if p.model.egress {
            types.push(Dir::Egress);
        }
        Ok(crate::explain::PolicyReach {
            policy: full_name(&key),
            kind: key.kind.as_str().to_string(),
            tier: p.model.tier.clone(),
            selector: p.model.selector.canonical().to_string(),
            types,
            endpoints,
            nodes,
        })
    }
}

/// `namespace/name` of a namespaced key, else its name.
fn full_name(k: &ResourceKey) -> String {
    match &k.namespace {
        Some(ns) => format!("{ns}/{}", k.name),
        None => k.name.clone(),
    }
}

/// The packet's addresses: an address given in the query as is; an endpoint's first address of
/// the family both sides have (IPv4 first).
fn pick_addresses(
    from: &Subject,
    src: Option<&Ep>,
    to: &Subject,
    dst: Option<&Ep>,
) -> Result<(IpAddr, IpAddr), QueryError> {
    let given = |s: &Subject| match s {
        Subject::Outside(ip) | Subject::Endpoint(_, Some(ip)) => Some(*ip),
        Subject::Endpoint(_, None) => None,
    };
    let candidates = |s: &Subject, e: Option<&Ep>| -> Vec<IpAddr> {
        match (given(s), e) {
            (Some(ip), _) => vec![ip],
            (None, Some(e)) => e.v4.iter().chain(&e.v6).copied().collect(),
            (None, None) => Vec::new(),
        }
    };
    let (a, b) = (candidates(from, src), candidates(to, dst));
    for v6 in [false, true] {
        let pa = a.iter().find(|ip| ip.is_ipv6() == v6);
        let pb = b.iter().find(|ip| ip.is_ipv6() == v6);
        if let (Some(x), Some(y)) = (pa, pb) {
            return Ok((*x, *y));
        }
    }
    let name = |e: Option<&Ep>, s: &Subject| {
        e.map(|e| e.name.clone())
            .or_else(|| given(s).map(|ip| ip.to_string()))
            .unwrap_or_default()
    };
    Err(QueryError::Bad(format!(
        "{} and {} have no address family in common (or an endpoint has no address)",
        name(src, from),
        name(dst, to)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explain::{Verdict::*, render_endpoint_text, render_text};
    use crate::graph::Update;
    use crate::manifest::parse_manifest;

    /// Namespaces `prod` and `dev` (profiles with labels, allow-all), and workloads:
    /// prod/web (10.0.0.1, app=web, named port http=8080), prod/client (10.0.0.2,
    /// app=client), dev/client (10.0.1.2, app=client), prod/db on node-b (10.0.2.1, app=db).
    const BASE: &str = r#"
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.prod}
spec:
  ingress: [{action: Allow}]
  egress: [{action: Allow}]
  labelsToApply: {pcns.projectcalico.org/name: prod, pcns.env: prod}
---
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.dev}
spec:
  ingress: [{action: Allow}]
  egress: [{action: Allow}]
  labelsToApply: {pcns.projectcalico.org/name: dev, pcns.env: dev}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-web-eth0, namespace: prod, labels: {app: web, projectcalico.org/namespace: prod, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-a, pod: web, endpoint: eth0, interfaceName: caliweb, ipNetworks: [10.0.0.1/32], profiles: [kns.prod], ports: [{name: http, protocol: TCP, port: 8080}]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-client-eth0, namespace: prod, labels: {app: client, projectcalico.org/namespace: prod, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-a, pod: client, endpoint: eth0, interfaceName: caliclient, ipNetworks: [10.0.0.2/32], profiles: [kns.prod]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-client-eth0, namespace: dev, labels: {app: client, projectcalico.org/namespace: dev, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-a, pod: client, endpoint: eth0, interfaceName: calidevclient, ipNetworks: [10.0.1.2/32], profiles: [kns.dev]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--b-k8s-db-eth0, namespace: prod, labels: {app: db, projectcalico.org/namespace: prod, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-b, pod: db, endpoint: eth0, interfaceName: calidb, ipNetworks: [10.0.2.1/32], profiles: [kns.prod]}
"#;

    fn graph(extra: &str) -> CalcGraph {
        let mut g = CalcGraph::new();
        for text in [BASE, extra] {
            for entry in parse_manifest(text).expect("manifest parses") {
                // A kind the graph does not use (a Service) is skipped.
                if let Some(valid) = entry.outcome.into_resource().expect("valid object") {
                    g.apply(Update::ApplyValid(valid)).expect("accepted");
                }
            }
        }
        g.apply(Update::InSync).expect("in sync");
        g
    }

    fn ask(g: &CalcGraph, from: &str, to: &str, protocol: &str, port: Option<u16>) -> Explanation {
        g.explain(&Query {
            from: from.into(),
            to: to.into(),
            protocol: Some(protocol.into()),
            port: port.map(|p| p.to_string()),
            source_port: None,
        })
        .unwrap_or_else(|e| panic!("{from} -> {to}: {e}"))
    }

    fn by_policy(tier: &str, policy: &str, index: usize, action: &str) -> DecidedBy {
        DecidedBy::Policy {
            tier: tier.into(),
            policy: policy.into(),
            kind: if policy.contains('/') {
                "NetworkPolicy"
            } else {
                "GlobalNetworkPolicy"
            }
            .into(),
            rule: crate::explain::RuleRef {
                index,
                action: action.into(),
            },
        }
    }

    fn default(what: &str) -> DecidedBy {
        DecidedBy::Default {
            default: what.into(),
        }
    }

    #[test]
    fn no_policy_means_the_namespace_profile_decides() {
        let g = graph("");
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(80));
        assert_eq!(e.verdict, Allow);
        assert_eq!(
            e.ingress.decided_by,
            DecidedBy::Profile {
                profile: "kns.prod".into(),
                rule: crate::explain::RuleRef {
                    index: 0,
                    action: "Allow".into()
                }
            }
        );
        assert_eq!(e.from.ip, "10.0.0.2");
        assert_eq!(e.to.node.as_deref(), Some("node-a"));
    }

    const TIERS: &str = r#"
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: security}
spec: {order: 100, defaultAction: Deny}
---
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: platform}
spec: {order: 200, defaultAction: Pass}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: pass-prod}
spec:
  tier: security
  order: 10
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Pass
    source: {namespaceSelector: env == 'prod'}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: platform-watch}
spec:
  tier: platform
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Deny
    protocol: TCP
    destination: {ports: [9999]}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-http, namespace: prod}
spec:
  order: 100
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {selector: app == 'client'}
    destination: {ports: [http]}
"#;

    /// A rule that is missed names the part of its selector that fails, in the order Calico's
    /// combined selector tests them, never a part that matches.
    #[test]
    fn a_missed_rule_names_the_part_of_its_selector_that_fails() {
        let g = graph(
            r#"
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: db-guard, namespace: prod}
spec:
  selector: app == 'db'
  types: [Ingress]
  ingress:
  - action: Allow
    source:
      namespaceSelector: env == 'prod'
      serviceAccounts: {selector: role == 'backend'}
  - action: Allow
    source:
      namespaceSelector: env == 'prod'
      serviceAccounts: {names: [backup]}
  - action: Allow
    source: {namespaceSelector: env == 'prod', selector: app == 'web'}
"#,
        );
        let misses = |from: &str| -> Vec<String> {
            let e = ask(&g, from, "prod/db", "tcp", Some(9999));
            let step = e
                .ingress
                .steps
                .iter()
                .find(|s| s.policy.as_deref() == Some("prod/db-guard"))
                .expect("the policy is walked")
                .clone();
            step.not_matched.iter().map(|m| m.why.clone()).collect()
        };
        // prod/client is in a namespace labelled env=prod: the namespace is not the miss.
        let why = misses("prod/client");
        assert_eq!(why.len(), 3, "{why:?}");
        assert!(
            why[0].contains("serviceAccounts.selector `role == 'backend'`"),
            "{why:?}"
        );
        assert!(why[1].contains("serviceAccounts.names [backup]"), "{why:?}");
        assert!(why[2].contains("selector `app == 'web'`"), "{why:?}");
        assert!(
            !why.iter().any(|w| w.contains("namespaceSelector")),
            "{why:?}"
        );
        // dev/client fails the namespace first, whatever else it would fail.
        for w in misses("dev/client") {
            assert!(w.contains("namespaceSelector `env == 'prod'`"), "{w}");
        }
    }

    #[test]
    fn pass_moves_to_the_next_tier_and_a_deny_tier_drops_at_its_end() {
        let g = graph(TIERS);
        // prod/client: passed by security, nothing in platform (default Pass), allowed by the
        // default tier's named-port rule.
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(8080));
        assert_eq!(e.verdict, Allow, "{}", render_text(&e));
        assert_eq!(
            e.ingress.decided_by,
            by_policy("default", "prod/web-http", 0, "Allow")
        );
        let outcomes: Vec<(Option<&str>, &str)> = e
            .ingress
            .steps
            .iter()
            .map(|s| (s.tier.as_deref(), s.outcome.as_str()))
            .collect();
        assert_eq!(
            outcomes,
            [
                (Some("security"), "pass: on to the next tier"),
                (Some("platform"), "no rule matched: next policy"),
                (
                    Some("platform"),
                    "end of tier (default action Pass): next tier"
                ),
                (Some("default"), "allow"),
            ]
        );
        // The named port: 80 is not `http`.
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(80));
        assert_eq!(e.ingress.decided_by, default("end-of-tier default"));
        let web_http = e
            .ingress
            .steps
            .iter()
            .find(|s| s.policy.as_deref() == Some("prod/web-http"))
            .expect("visited");
        assert!(
            web_http.not_matched[0].why.contains("destination port 80"),
            "{web_http:?}"
        );
        // dev/client is not in a prod namespace: security's end-of-tier drop.
        let e = ask(&g, "dev/client", "prod/web", "tcp", Some(8080));
        assert_eq!(e.verdict, Deny);
        assert_eq!(e.ingress.decided_by, default("end-of-tier security"));
        let pass = &e.ingress.steps[0];
        assert!(
            pass.not_matched[0].why.contains("env == 'prod'"),
            "{pass:?}"
        );
        // The platform tier's deny, after a pass.
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(9999));
        assert_eq!(
            e.ingress.decided_by,
            by_policy("platform", "platform-watch", 0, "Deny")
        );
        // The egress side has no policy: the profile allows.
        assert_eq!(e.egress.verdict, Allow);
    }

    #[test]
    fn nil_order_sorts_last_and_ties_go_by_name() {
        let g = graph(
            r#"
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: a-no-order}
spec: {selector: app == 'web', types: [Ingress], ingress: [{action: Allow}]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: z-deny}
spec: {order: 5, selector: app == 'web', types: [Ingress], ingress: [{action: Deny}]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: b-deny}
spec: {order: 5, selector: app == 'web', types: [Ingress], ingress: [{action: Deny}]}
"#,
        );
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(80));
        assert_eq!(
            e.ingress.decided_by,
            by_policy("default", "b-deny", 0, "Deny")
        );
        let visited: Vec<&str> = e
            .ingress
            .steps
            .iter()
            .filter_map(|s| s.policy.as_deref())
            .collect();
        assert_eq!(visited, ["b-deny"], "evaluation stops at the first deny");
    }

    #[test]
    fn unselected_policies_are_shown_as_passed_over() {
        let g = graph(TIERS);
        let e = ask(&g, "prod/web", "prod/client", "tcp", Some(80));
        // No tier applies to prod/client's ingress: the tiers are listed as not applied.
        assert!(
            e.ingress
                .steps
                .iter()
                .any(|s| s.tier.as_deref() == Some("security")
                    && s.outcome.starts_with("not applied"))
        );
        assert_eq!(
            e.ingress.decided_by,
            DecidedBy::Profile {
                profile: "kns.prod".into(),
                rule: crate::explain::RuleRef {
                    index: 0,
                    action: "Allow".into()
                },
            }
        );
        // A policy in a visited tier that does not select the endpoint is listed as such.
        let g = graph(&format!(
            "{TIERS}---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {{name: db-only}}
spec: {{tier: security, order: 1, selector: app == 'db', types: [Ingress], ingress: [{{action: Allow}}]}}
"
        ));
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(8080));
        let first = &e.ingress.steps[0];
        assert_eq!(first.policy.as_deref(), Some("db-only"));
        assert_eq!(first.selected, Some(false));
        assert_eq!(first.selector.as_deref(), Some("app == \"db\""));
    }

    #[test]
    fn egress_policies_negations_and_network_sets() {
        let g = graph(
            r#"
apiVersion: projectcalico.org/v3
kind: GlobalNetworkSet
metadata: {name: partners, labels: {kind: partner}}
spec: {nets: [192.0.2.0/24]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: client-out}
spec:
  order: 1
  selector: app == 'client' && projectcalico.org/namespace == 'prod'
  types: [Egress]
  egress:
  - action: Deny
    protocol: TCP
    destination: {notPorts: [443], selector: kind == 'partner'}
  - action: Allow
    destination: {selector: kind == 'partner'}
  - action: Allow
    destination: {notSelector: app == 'db', namespaceSelector: env == 'prod'}
"#,
        );
        // To a partner address on 443: the deny's notPorts excludes it, rule 1 allows.
        let e = ask(&g, "prod/client", "192.0.2.7", "tcp", Some(443));
        assert_eq!(
            e.egress.decided_by,
            by_policy("default", "client-out", 1, "Allow")
        );
        assert_eq!(e.to.kind, "outside the cluster");
        assert_eq!(e.to.network_sets, ["partners"]);
        assert_eq!(e.ingress.decided_by, default("no policy"));
        assert_eq!(e.verdict, Allow);
        // On 80, rule 0 denies.
        let e = ask(&g, "prod/client", "192.0.2.7", "tcp", Some(80));
        assert_eq!(
            e.egress.decided_by,
            by_policy("default", "client-out", 0, "Deny")
        );
        // Elsewhere outside: no rule matches, the tier drops at its end.
        let e = ask(&g, "prod/client", "198.51.100.1", "udp", Some(53));
        assert_eq!(e.egress.decided_by, default("end-of-tier default"));
        // notSelector: prod/web yes (named by its address), prod/db no.
        let e = ask(&g, "prod/client", "10.0.0.1", "tcp", Some(80));
        assert_eq!(e.to.name, "prod/web");
        assert_eq!(
            e.egress.decided_by,
            by_policy("default", "client-out", 2, "Allow")
        );
        let e = ask(&g, "prod/client", "prod/db", "tcp", Some(80));
        assert_eq!(e.egress.decided_by, default("end-of-tier default"));
        let miss = &e.egress.steps.last().expect("steps");
        assert!(miss.outcome.contains("end of tier"), "{miss:?}");
    }

    #[test]
    fn icmp_and_missing_profiles() {
        let g = graph(
            r#"
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: ping}
spec:
  selector: app == 'web'
  types: [Ingress]
  ingress: [{action: Allow, protocol: ICMP, icmp: {type: 8}}]
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-orphan-eth0, namespace: prod, labels: {app: orphan, projectcalico.org/namespace: prod, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-a, pod: orphan, endpoint: eth0, interfaceName: caliorphan, ipNetworks: [10.0.0.9/32], profiles: [kns.gone]}
"#,
        );
        let e = ask(&g, "prod/client", "prod/web", "icmp", None);
        assert_eq!(
            e.ingress.decided_by,
            by_policy("default", "ping", 0, "Allow")
        );
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(22));
        assert!(
            e.ingress.steps[0].not_matched[0]
                .why
                .contains("protocol: rule wants ICMP")
        );
        // A profile that does not exist: Felix's deny-all rules.
        let e = ask(&g, "prod/client", "prod/orphan", "tcp", Some(80));
        assert_eq!(
            e.ingress.decided_by,
            DecidedBy::Profile {
                profile: "kns.gone".into(),
                rule: crate::explain::RuleRef {
                    index: 0,
                    action: "Deny".into()
                }
            }
        );
    }

    /// Services prod/web (10.0.0.1 on TCP 8080; 10.0.2.1 too, in a second slice, on UDP 53
    /// only) and prod/client (10.0.0.2), and policies that name them.
    const SERVICES: &str = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a1, namespace: prod, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.0.0.1], conditions: {ready: true}}]
ports: [{name: http, protocol: TCP, port: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-b2, namespace: prod, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.0.2.1]}]
ports: [{name: dns, protocol: UDP, port: 53}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: client-c3, namespace: prod, labels: {kubernetes.io/service-name: client}}
addressType: IPv4
endpoints: [{addresses: [10.0.0.2]}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: prod}
spec: {selector: {app: web}, ports: [{port: 80, targetPort: http}]}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: client-to-web, namespace: prod}
spec:
  selector: app == 'client'
  types: [Egress]
  egress:
  - action: Allow
    destination: {services: {name: web}}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: web-from-client}
spec:
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {services: {name: client, namespace: prod}}
"#;

    #[test]
    fn service_rules_match_the_endpoints_and_ports_of_the_service() {
        let g = graph(SERVICES);
        // To web's endpoint on web's port, from client's endpoint: both rules allow.
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(8080));
        assert_eq!(e.verdict, Allow, "{}", render_text(&e));
        assert_eq!(
            e.egress.decided_by,
            by_policy("default", "prod/client-to-web", 0, "Allow")
        );
        assert_eq!(
            e.ingress.decided_by,
            by_policy("default", "web-from-client", 0, "Allow")
        );
        // Another port of the same endpoint is not the service's.
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(9090));
        assert_eq!(e.verdict, Deny);
        assert_eq!(e.egress.decided_by, default("end-of-tier default"));
        let why = &e.egress.steps[0].not_matched[0].why;
        assert_eq!(why, "destination is not an endpoint of service prod/web");
        // prod/db is web's endpoint on UDP 53 only (its slice's port).
        assert_eq!(
            ask(&g, "prod/client", "prod/db", "udp", Some(53))
                .egress
                .verdict,
            Allow
        );
        assert_eq!(
            ask(&g, "prod/client", "prod/db", "tcp", Some(8080))
                .egress
                .verdict,
            Deny
        );
        // dev/client is not an endpoint of prod/client.
        let e = ask(&g, "dev/client", "prod/web", "tcp", Some(8080));
        assert_eq!(e.ingress.verdict, Deny);
        assert_eq!(
            e.ingress.steps[0].not_matched[0].why,
            "source 10.0.1.2 is not an endpoint of service prod/client"
        );
    }

    #[test]
    fn endpoint_and_policy_listings() {
        let g = graph(TIERS);
        let e = g.explain_endpoint("prod/web").expect("known");
        assert_eq!(e.addresses, ["10.0.0.1"]);
        assert_eq!(e.profiles, ["kns.prod"]);
        let tiers: Vec<(&str, Vec<&str>)> = e.chains[0]
            .ingress
            .iter()
            .map(|t| {
                (
                    t.tier.as_str(),
                    t.policies.iter().map(|p| p.policy.as_str()).collect(),
                )
            })
            .collect();
        assert_eq!(
            tiers,
            [
                ("security", vec!["pass-prod"]),
                ("platform", vec!["platform-watch"]),
                ("default", vec!["prod/web-http"]),
            ]
        );
        assert!(e.chains[0].egress.is_empty());
        assert!(render_endpoint_text(&e).contains("tier security (end of tier: Deny)"));

        let p = g.explain_policy("prod/web-http").expect("known");
        assert_eq!(p.endpoints, ["prod/web"]);
        assert_eq!(p.nodes, ["node-a"]);
        assert_eq!(p.types, [Dir::Ingress]);
        let p = g
            .explain_policy("web-http")
            .expect("a unique name needs no namespace");
        assert_eq!(p.policy, "prod/web-http");
        assert!(g.explain_policy("nope").is_err());
        assert!(g.explain_endpoint("203.0.113.1").is_err());
    }

    const HOSTS: &str = r#"
apiVersion: projectcalico.org/v3
kind: HostEndpoint
metadata: {name: a-eth0, labels: {role: node}}
spec: {node: node-a, interfaceName: eth0, expectedIPs: [192.168.0.1], profiles: []}
---
apiVersion: projectcalico.org/v3
kind: HostEndpoint
metadata: {name: b-all, labels: {role: gateway}}
spec: {node: node-b, interfaceName: "*", expectedIPs: [192.168.0.2]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: untracked-trusted}
spec:
  selector: role == 'node'
  doNotTrack: true
  applyOnForward: true
  types: [Ingress]
  ingress: [{action: Allow, source: {nets: [10.9.0.0/16]}}]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: prednat-block}
spec:
  selector: role == 'node'
  preDNAT: true
  applyOnForward: true
  types: [Ingress]
  ingress: [{action: Deny, source: {nets: [10.66.0.0/16]}}]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: node-web}
spec:
  selector: role == 'node'
  types: [Ingress]
  ingress: [{action: Allow, protocol: TCP, destination: {ports: [443]}}]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: gateway-forward}
spec:
  selector: role == 'gateway'
  applyOnForward: true
  types: [Ingress]
  ingress: [{action: Deny, protocol: TCP, destination: {ports: [25]}}]
---
apiVersion: projectcalico.org/v3
kind: FelixConfiguration
metadata: {name: default}
spec:
  defaultEndpointToHostAction: Accept
  failsafeInboundHostPorts: [{protocol: TCP, port: 2222}]
"#;

    #[test]
    fn host_endpoints_meet_untracked_pre_dnat_normal_and_forward_policy() {
        let g = graph(HOSTS);
        // doNotTrack allows at once: no later chain is walked.
        let e = ask(&g, "10.9.1.1", "hep:a-eth0", "tcp", Some(80));
        assert_eq!(
            e.ingress.decided_by,
            by_policy("default", "untracked-trusted", 0, "Allow")
        );
        assert!(
            e.ingress.steps.iter().all(|s| s.stage == "untracked"),
            "{}",
            render_text(&e)
        );
        // pre-DNAT denies before normal policy.
        let e = ask(&g, "10.66.1.1", "hep:a-eth0", "tcp", Some(443));
        assert_eq!(
            e.ingress.decided_by,
            by_policy("default", "prednat-block", 0, "Deny")
        );
        // Otherwise normal policy (no profile: the end of the tier drops what it does not allow).
        assert_eq!(
            ask(&g, "10.1.1.1", "hep:a-eth0", "tcp", Some(443)).verdict,
            Allow
        );
        let e = ask(&g, "10.1.1.1", "hep:a-eth0", "tcp", Some(80));
        assert_eq!(e.ingress.decided_by, default("end-of-tier default"));
        // The failsafes FelixConfiguration sets replace Felix's defaults.
        let e = ask(&g, "10.1.1.1", "hep:a-eth0", "tcp", Some(2222));
        assert_eq!(e.ingress.decided_by, default("failsafe tcp:2222"));
        assert_eq!(
            ask(&g, "10.1.1.1", "hep:a-eth0", "tcp", Some(22)).verdict,
            Deny
        );
        // A workload to its own host: DefaultEndpointToHostAction, not host endpoint policy.
        let e = ask(&g, "prod/web", "hep:a-eth0", "tcp", Some(80));
        assert_eq!(
            e.ingress.decided_by,
            default("DefaultEndpointToHostAction Accept")
        );
        // The `*` endpoint's forward policy meets traffic forwarded to node-b's workload.
        let e = ask(&g, "10.1.1.1", "prod/db", "tcp", Some(25));
        assert_eq!(
            e.ingress.decided_by,
            by_policy("default", "gateway-forward", 0, "Deny")
        );
        assert_eq!(e.ingress.steps[0].stage, "forward");
        // Forward chains drop at the end of a tier too.
        let e = ask(&g, "10.1.1.1", "prod/db", "tcp", Some(80));
        assert_eq!(e.ingress.decided_by, default("end-of-tier default"));
        assert_eq!(e.ingress.steps[1].stage, "forward");
        // Traffic between node-a's workloads never reaches node-b's gateway.
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(25));
        assert!(e.ingress.steps.iter().all(|s| s.stage != "forward"));
    }

    #[test]
    fn failsafes_are_read_as_the_agent_reads_them() {
        let config = |v: &str| pb::ConfigUpdate {
            config: [("FailsafeInboundHostPorts".to_string(), v.to_string())].into(),
            ..Default::default()
        };
        let ports = |v: &str| -> Vec<u16> {
            failsafes(&config(v), "FailsafeInboundHostPorts", "tcp:22")
                .iter()
                .map(|f| f.port)
                .collect()
        };
        assert_eq!(ports("udp:68,tcp:443"), [68, 443]);
        assert!(ports("none").is_empty());
        // An invalid value is refused whole by the agent, which keeps the default.
        assert_eq!(ports("tcp:443,icmp:1"), [22]);
    }

    #[test]
    fn bad_queries_say_what_is_wrong() {
        let g = graph("");
        let q = |from: &str, to: &str, protocol: &str, port: Option<&str>| Query {
            from: from.into(),
            to: to.into(),
            protocol: Some(protocol.into()),
            port: port.map(Into::into),
            source_port: None,
        };
        let err = |q: Query| g.explain(&q).expect_err("refused").to_string();
        assert!(
            err(q("prod/nope", "prod/web", "tcp", Some("80")))
                .contains("no endpoint \"prod/nope\"")
        );
        // Two namespaces hold a node--a-k8s-client-eth0.
        let e = err(q("node--a-k8s-client-eth0", "prod/web", "tcp", Some("80")));
        assert!(
            e.contains("ambiguous")
                && e.contains("dev/node--a-k8s-client-eth0")
                && e.contains("prod/node--a-k8s-client-eth0"),
            "{e}"
        );
        assert!(err(q("prod/client", "prod/web", "tcp", Some("0"))).contains("not a port number"));
        assert!(
            err(q("prod/client", "prod/web", "tcp", None)).contains("needs a destination port")
        );
        assert!(err(q("prod/client", "prod/web", "icmp", Some("80"))).contains("has no ports"));
        assert!(
            err(q("prod/client", "prod/web", "bogus", Some("80"))).contains("unknown protocol")
        );
        assert!(
            err(q("prod/client", "2001:db8::1", "tcp", Some("80")))
                .contains("no address family in common")
        );
        // The full name with its namespace is not ambiguous.
        let e = ask(
            &g,
            "dev/node--a-k8s-client-eth0",
            "prod/web",
            "tcp",
            Some(80),
        );
        assert_eq!(e.from.name, "dev/client");
    }

    const STAGED: &str = r#"
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: default}
spec: {order: 1000000, defaultAction: Deny}
---
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: trial}
spec: {order: 50, defaultAction: Deny}
---
# Enforced: web accepts 8080 from prod.
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-http, namespace: prod}
spec:
  selector: app == 'web'
  ingress: [{action: Allow, protocol: TCP, source: {selector: all()}, destination: {ports: [8080]}}]
---
# Staged in the enforced tier: would deny the client.
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata: {name: lock-client, namespace: prod}
spec:
  stagedAction: Set
  order: 1
  selector: app == 'web'
  ingress: [{action: Deny, source: {selector: app == 'client'}}]
---
# A tier of staged policies only: no end-of-tier drop while staged.
apiVersion: projectcalico.org/v3
kind: StagedGlobalNetworkPolicy
metadata: {name: trial-db}
spec:
  tier: trial
  selector: app == 'db'
  ingress: [{action: Allow, source: {selector: app == 'web'}}]
---
# A staged Kubernetes policy: a Kubernetes spec plus stagedAction.
apiVersion: projectcalico.org/v3
kind: StagedKubernetesNetworkPolicy
metadata: {name: db-ingress, namespace: prod}
spec:
  stagedAction: Set
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
---
# A staged delete: not sent at all.
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata: {name: web-http, namespace: prod}
spec:
  stagedAction: Delete
  selector: app == 'web'
"#;

    fn staged_ids(g: &mut CalcGraph, node: &str) -> Vec<String> {
        g.subscribe(node);
        let mut ids = Vec::new();
        for m in g.snapshot(node) {
            match &m.payload {
                Some(Payload::ActivePolicyUpdate(u)) => {
                    let id = u.id.as_ref().unwrap();
                    ids.push(format!("{}:{}/{}", id.kind, id.namespace, id.name));
                }
                Some(Payload::WorkloadEndpointUpdate(u)) => {
                    for t in &u.endpoint.as_ref().unwrap().tiers {
                        for id in t.ingress_policies.iter() {
                            ids.push(format!(
                                "{} tier {}: {}:{}/{}",
                                u.id.as_ref().unwrap().workload_id,
                                t.name,
                                id.kind,
                                id.namespace,
                                id.name
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
        ids.sort();
        ids
    }

    #[test]
    fn staged_policies_are_sent_with_their_kind_and_never_change_the_enforced_verdict() {
        let mut g = graph(STAGED);
        let a = staged_ids(&mut g, "node-a");
        for want in [
            "NetworkPolicy:prod/web-http",
            "StagedNetworkPolicy:prod/lock-client",
            "prod/web tier default: StagedNetworkPolicy:prod/lock-client",
            "prod/web tier default: NetworkPolicy:prod/web-http",
        ] {
            assert!(a.iter().any(|i| i == want), "{want} missing from {a:#?}");
        }
        let b = staged_ids(&mut g, "node-b");
        for want in [
            "StagedGlobalNetworkPolicy:/trial-db",
            "StagedKubernetesNetworkPolicy:prod/knp.default.db-ingress",
            "prod/db tier trial: StagedGlobalNetworkPolicy:/trial-db",
            "prod/db tier default: StagedKubernetesNetworkPolicy:prod/knp.default.db-ingress",
        ] {
            assert!(b.iter().any(|i| i == want), "{want} missing from {b:#?}");
        }
        // The staged Delete of web-http is not sent: web-http itself still is.
        assert_eq!(
            a.iter().filter(|i| i.contains("web-http")).count(),
            2,
            "{a:#?}"
        );

        // Enforced: the staged deny is passed over; pending: it denies.
        let e = ask(&g, "prod/client", "prod/web", "tcp", Some(8080));
        assert_eq!(e.verdict, Allow, "{}", render_text(&e));
        assert_eq!(
            e.ingress.decided_by,
            by_policy("default", "prod/web-http", 0, "Allow")
        );
        let staged_step = e
            .ingress
            .steps
            .iter()
            .find(|s| s.policy.as_deref() == Some("prod/lock-client"))
            .expect("shown");
        assert!(staged_step.outcome.starts_with("staged: not enforced"));
        let pending = e.pending.as_ref().expect("a staged policy is on the path");
        assert_eq!(pending.verdict, Deny);
        assert_eq!(
            pending.ingress.decided_by,
            DecidedBy::Policy {
                tier: "default".into(),
                policy: "prod/lock-client".into(),
                kind: "StagedNetworkPolicy".into(),
                rule: crate::explain::RuleRef {
                    index: 0,
                    action: "Deny".into()
                },
            }
        );
        let text = render_text(&e);
        assert!(
            text.contains("pending (staged policies enforced): DENY"),
            "{text}"
        );

        // A tier of staged policies only has no end-of-tier drop while staged; the staged
        // Kubernetes policy (ingress, no rules) would deny everything else.
        let e = ask(&g, "prod/client", "prod/db", "tcp", Some(5432));
        assert_eq!(e.verdict, Allow, "{}", render_text(&e));
        assert_eq!(e.pending.as_ref().map(|p| p.verdict), Some(Deny));
        let e = ask(&g, "prod/web", "prod/db", "tcp", Some(5432));
        assert_eq!(e.verdict, Allow);
        assert_eq!(
            e.pending.as_ref().map(|p| p.verdict),
            Some(Allow),
            "trial-db allows web before the staged Kubernetes policy is reached"
        );

        // No staged policy on the path: no pending verdict.
        let e = ask(&g, "prod/web", "prod/client", "tcp", Some(80));
        assert!(e.pending.is_none(), "{:?}", e.pending);

        // explain --policy finds staged policies; a kind prefix picks one of a name.
        let r = g.explain_policy("trial-db").unwrap();
        assert_eq!(r.kind, "StagedGlobalNetworkPolicy");
        assert_eq!(r.endpoints, ["prod/db"]);
        assert_eq!(r.nodes, ["node-b"]);
        let r = g.explain_policy("sknp:prod/db-ingress").unwrap();
        assert_eq!(r.endpoints, ["prod/db"]);
        let r = g.explain_policy("NetworkPolicy:prod/web-http").unwrap();
        assert_eq!(r.kind, "NetworkPolicy");
        assert!(g.explain_policy("frob:prod/web-http").is_err());
    }
}
