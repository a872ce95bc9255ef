//! Explain queries over the graph's state: resolving names and addresses to endpoints, and
//! composing the chains a packet meets on its way (see [`crate::explain`]).
//!
//! Contract: read-only, and only through the graph's query API ([`Ask`] holds a [`GraphView`]).
//! The tier lists, rules and IP-set members walked are exactly the ones the graph sends the
//! nodes involved. The path is the Linux dataplane's:
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

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::rc::Rc;

use rustc_hash::FxHashMap;

use felix_proto as pb;
use pb::to_dataplane::Payload;

use super::rules::{Sets, cidr_contains, protocol_name, protocol_number};
use super::walk::{self, Chain, Failsafe, Outcome, State};
use super::{
    DecidedBy, Dir, Explanation, Packet, Peer, Query, QueryError, Side, Stage, Step, Verdict,
    parse_protocol_and_ports,
};
use crate::convert::EndpointKind;
use crate::graph::GraphView;
use crate::model::{Kind, ResourceKey};
use crate::policy_resolver::{self, PolicyRef, ResolvedTiers};

/// The graph's state as explain reads it: only through its query API.
#[derive(Clone)]
pub(super) struct Ask<'g> {
    pub(super) g: GraphView<'g>,
    /// The walk's view, built when first needed and kept for further queries.
    view: std::cell::OnceCell<View<'g>>,
}

impl<'g> Ask<'g> {
    pub(super) fn new(g: GraphView<'g>) -> Self {
        Ask {
            g,
            view: std::cell::OnceCell::new(),
        }
    }
}

type Key = ResourceKey;

/// A query's source or destination.
pub(super) enum Subject {
    /// An endpoint, and the address the query named it by, if it did.
    Endpoint(Key, Option<IpAddr>),
    Outside(IpAddr),
}

/// An endpoint as the path needs it.
pub(super) struct Ep {
    pub(super) name: String,
    node: String,
    pub(super) host: bool,
    wildcard: bool,
    pub(super) v4: Vec<IpAddr>,
    pub(super) v6: Vec<IpAddr>,
    endpoint: Payload,
}

impl Ep {
    pub(super) fn tiers(&self) -> (&[pb::TierInfo], &[String]) {
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

    pub(super) fn host(&self) -> Option<&pb::HostEndpoint> {
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
#[derive(Clone)]
pub(super) struct View<'g> {
    g: GraphView<'g>,
    all: Rc<ResolvedTiers>,
    /// Each active policy's key by its `PolicyID` (a converted kind's id is not its key).
    keys: Rc<FxHashMap<(&'g str, &'g str, &'g str), &'g Key>>,
    /// The pending verdict: staged policies evaluated as if enforced.
    pending: bool,
    /// The labels of the endpoints at each address asked about (a query asks about its two
    /// addresses, once per rule that names a selector): looked up once.
    labels_at: Rc<RefCell<Vec<(IpAddr, LabelsAt)>>>,
}

/// The labels of each endpoint at an address, in the graph's order (`None`: it has none).
type LabelsAt = Rc<[Option<BTreeMap<String, String>>]>;

impl View<'_> {
    fn labels_at(&self, ip: IpAddr) -> LabelsAt {
        if let Some((_, l)) = self.labels_at.borrow().iter().find(|(a, _)| *a == ip) {
            return l.clone();
        }
        let l: LabelsAt = self.g.endpoints_with_ip(ip).map(|e| e.labels()).collect();
        self.labels_at.borrow_mut().push((ip, l.clone()));
        l
    }
}

impl Sets for View<'_> {
    fn selects_endpoint(&self, selector: &crate::selector::Selector, ip: IpAddr) -> Option<bool> {
        let mut any = None;
        for labels in self.labels_at(ip).iter() {
            let labels = labels.as_ref()?;
            // An IP set holds the address if any endpoint there is selected.
            if selector.evaluate(labels) {
                return Some(true);
            }
            any = Some(false);
        }
        any
    }

    fn has_ip(&self, id: &str, ip: IpAddr) -> bool {
        // Members are canonical text, nearly all single addresses: look the address up, then
        // parse only the wider nets (a set of a thousand endpoints is not parsed per rule).
        let host = if ip.is_ipv4() { "/32" } else { "/128" };
        if self.g.ipset_has_member(id, &format!("{ip}{host}")) {
            return true;
        }
        self.g
            .ipset_members(id)
            .is_some_and(|mut members| members.any(|m| !m.ends_with(host) && cidr_contains(m, ip)))
    }

    fn has_ip_port(&self, id: &str, ip: IpAddr, protocol: u8, port: u16) -> bool {
        let Some(mut members) = self.g.ipset_members(id) else {
            return false;
        };
        members.any(|m| {
            let Some((addr, rest)) = m.split_once(',') else {
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
    fn policy(&self, id: &pb::PolicyId) -> Option<&pb::Policy> {
        let key = self.key(id)?;
        self.g.policy(key).map(|p| p.message())
    }

    fn enforce_staged(&self) -> bool {
        self.pending
    }

    fn profile(&self, name: &str) -> Cow<'_, pb::Profile> {
        match self.g.profile(name) {
            Some(p) => Cow::Borrowed(p),
            None => {
                let (inbound_rules, outbound_rules) = crate::rule_scanner::missing_profile_rules();
                Cow::Owned(pb::Profile {
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
                    .and_then(|k| self.g.policy(k))
                    .map(|p| p.model().selector.canonical().to_string())
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
    pub(super) fn key(&self, id: &pb::PolicyId) -> Option<&Key> {
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
            labels_at: self.labels_at.clone(),
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
pub(super) fn failsafes(config: &pb::ConfigUpdate, name: &str, default: &str) -> Vec<Failsafe> {
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

impl<'g> Ask<'g> {
    /// Why traffic from `q.from` to `q.to` is allowed or denied.
    pub(super) fn explain(&self, q: &Query) -> Result<Explanation, QueryError> {
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
            super::Pending {
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

    /// The walk's view (shared: built once per `Ask`).
    pub(super) fn view(&self) -> View<'g> {
        self.view.get_or_init(|| self.build_view()).clone()
    }

    fn build_view(&self) -> View<'g> {
        let g = self.g;
        let refs: Vec<PolicyRef<'g>> = g
            .policies()
            .map(|p| PolicyRef {
                model: p.model(),
                sort_string: p.sort_string(),
            })
            .collect();
        let keys = g
            .policies()
            .map(|p| {
                let id = &p.model().id;
                (
                    (id.kind.as_str(), id.namespace.as_str(), id.name.as_str()),
                    p.key(),
                )
            })
            .collect();
        View {
            g,
            all: Rc::new(policy_resolver::resolve(refs, |t| g.tier(t))),
            keys: Rc::new(keys),
            pending: false,
            labels_at: Rc::default(),
        }
    }

    pub(super) fn peer(&self, ep: Option<&Ep>, ip: IpAddr) -> Peer {
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
            .g
            .network_sets()
            .filter(|(_, nets)| nets.iter().any(|n| cidr_contains(n, ip)))
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
    pub(super) fn resolve(&self, what: &str) -> Result<Subject, QueryError> {
        let what = what.trim();
        if what.is_empty() {
            return Err(QueryError::Bad("an empty endpoint name".into()));
        }
        let mut found: Vec<Key> = Vec::new();
        if let Some(name) = what.strip_prefix("hep:") {
            let key = ResourceKey::new(Kind::HostEndpoint, None, name);
            if self.g.endpoint(&key).is_some() {
                found.push(key);
            }
        } else if let Ok(ip) = what.parse::<IpAddr>() {
            found.extend(self.g.endpoints_with_ip(ip).map(|e| e.key().clone()));
            if found.is_empty() {
                return Ok(Subject::Outside(ip));
            }
        } else {
            let (ns, name) = match what.split_once('/') {
                Some((ns, name)) => (Some(ns), name),
                None => (None, what),
            };
            for e in self.g.endpoints() {
                let m = e.model();
                let EndpointKind::Workload { workload_id, .. } = &m.kind else {
                    continue;
                };
                let key = e.key();
                let by_pod = ns.is_some() && workload_id == what;
                let by_name =
                    key.name == name && ns.is_none_or(|ns| key.namespace.as_deref() == Some(ns));
                if by_pod || by_name {
                    found.push(key.clone());
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
                candidates: found.iter().map(full_name).collect(),
            }),
        }
    }

    pub(super) fn ep(&self, s: &Subject) -> Option<Ep> {
        let Subject::Endpoint(key, _) = s else {
            return None;
        };
        let e = self.g.endpoint(key)?;
        let endpoint = e.update()?;
        let m = e.model();
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
            .g
            .endpoints()
            .filter(|e| {
                e.node() == node
                    && matches!(&e.model().kind, EndpointKind::Host { interface_name, .. } if interface_name == "*")
            })
            .map(|e| e.key())
            .collect();
        heps.sort();
        heps.first()
            .and_then(|k| self.ep(&Subject::Endpoint((*k).clone(), None)))
    }

    fn failsafes_of(&self, node: &str, dir: Dir) -> Vec<Failsafe> {
        let config = self.g.config(node);
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
                .g
                .config(&d.node)
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

/// `namespace/name` of a namespaced key, else its name.
pub(super) fn full_name(k: &ResourceKey) -> String {
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
