//! Explain: why traffic between two endpoints (or an endpoint and an address) is allowed or
//! denied, answered from the calculation graph's state, and which policies apply where.
//!
//! Contract: the answer interprets exactly what the graph sends the nodes involved — each
//! endpoint's tier lists, the active policies' and profiles' proto rules and the IP-set
//! members — the way the Linux dataplane renders them (see [`walk`] and [`rules`]), so it
//! agrees with the kernel. It covers the first packet of a connection (conntrack lets replies
//! through). Pure: the graph is queried, not re-computed; the query, the answer and its text
//! form are plain values ([`Query`], [`Explanation`], [`render_text`]) that travel as JSON.
//!
//! Layout: this module holds the questions, answers and their text form, and the entry points
//! ([`CalcGraph::explain`], [`CalcGraph::explain_endpoint`], [`CalcGraph::explain_policy`],
//! [`CalcGraph::answer`]); `render` their text form; `listing` the per-endpoint and per-policy listings; `path` resolves names and addresses to endpoints and composes the
//! chains a packet meets; [`walk`] walks one chain; [`rules`] matches one rule. The graph is
//! read only through its query API ([`crate::graph::GraphView`]).

mod listing;
mod path;
mod render;
pub mod rule_text;
pub mod rules;
#[cfg(test)]
mod tests;
pub mod walk;

pub use render::{render_endpoint_text, render_policy_text, render_text};

use crate::graph::CalcGraph;

/// Explain for many queries over one state of the graph: the policy order and the labels at
/// each address asked about are worked out once, not per query.
pub struct Explainer<'g>(path::Ask<'g>);

impl Explainer<'_> {
    /// As [`CalcGraph::explain`].
    pub fn explain(&self, q: &Query) -> Result<Explanation, QueryError> {
        self.0.explain(q)
    }
}

impl CalcGraph {
    /// An [`Explainer`] for this state of the graph.
    pub fn explainer(&self) -> Explainer<'_> {
        Explainer(path::Ask::new(self.view()))
    }

    /// Why traffic from `q.from` to `q.to` is allowed or denied.
    pub fn explain(&self, q: &Query) -> Result<Explanation, QueryError> {
        path::Ask::new(self.view()).explain(q)
    }

    /// The tiers, policies and profiles that apply to an endpoint, per chain and direction.
    pub fn explain_endpoint(&self, what: &str) -> Result<EndpointPolicies, QueryError> {
        path::Ask::new(self.view()).explain_endpoint(what)
    }

    /// The endpoints a policy selects and the nodes where it is active.
    /// `what` is `NAME` (a global policy), `NAMESPACE/NAME`, either optionally preceded by
    /// a kind and a colon (`StagedNetworkPolicy:prod/trial`, or Calico's short form `snp:`), to
    /// pick one of several policies of the same name.
    pub fn explain_policy(&self, what: &str) -> Result<PolicyReach, QueryError> {
        path::Ask::new(self.view()).explain_policy(what)
    }

    /// Answers any explain request, as JSON (an [`Explanation`], an [`EndpointPolicies`] or a
    /// [`PolicyReach`]).
    pub fn answer(&self, r: &Request) -> Result<serde_json::Value, QueryError> {
        let value = match r {
            Request::Path(q) => serde_json::to_value(self.explain(q)?),
            Request::Endpoint(e) => serde_json::to_value(self.explain_endpoint(e)?),
            Request::Policy(p) => serde_json::to_value(self.explain_policy(p)?),
        };
        Ok(value.expect("explain answers are plain data"))
    }
}

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// The packet a query stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    pub src_port: Option<u16>,
    pub dst_port: Option<u16>,
    /// ICMP type and code (an echo request unless the query says otherwise).
    pub icmp: Option<(u8, u8)>,
}

/// Which of an endpoint's chains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Filter-table policy: a workload's, or a host endpoint's for traffic to or from the host.
    Normal,
    /// A host endpoint's doNotTrack policy (raw table).
    Untracked,
    /// A host endpoint's preDNAT policy (mangle table, ingress only).
    PreDnat,
    /// A host endpoint's applyOnForward policy, for traffic forwarded through the host.
    Forward,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dir {
    Ingress,
    Egress,
}

impl Stage {
    pub fn label(self) -> String {
        match self {
            Stage::Normal => "policy",
            Stage::Untracked => "untracked",
            Stage::PreDnat => "pre-DNAT",
            Stage::Forward => "forward",
        }
        .to_string()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Allow,
    Deny,
}

/// A rule by its index in the policy's (or profile's) rules for the direction, and its action.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleRef {
    pub index: usize,
    pub action: String,
}

/// A rule that did not match, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleMiss {
    pub index: usize,
    pub action: String,
    pub why: String,
}

/// What decided a direction's verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DecidedBy {
    Policy {
        tier: String,
        policy: String,
        kind: String,
        rule: RuleRef,
    },
    Profile {
        profile: String,
        rule: RuleRef,
    },
    /// No rule: `end-of-tier <tier>`, `no policy`, `no profile matched`, a failsafe…
    Default {
        default: String,
    },
}

/// One tier, policy or profile visited (or passed over), in evaluation order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// Which chain: `policy`, `untracked`, `pre-DNAT`, `forward`, or a host-level stage.
    pub stage: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Whether the policy's selector selects the endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selected: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The rule that matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<RuleRef>,
    /// Rules evaluated before a match (or all of them) that did not match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_matched: Vec<RuleMiss>,
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// One side of the path: the source's egress or the destination's ingress.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Side {
    /// The endpoint whose policy applies; `None` for an address outside the cluster.
    pub endpoint: Option<String>,
    pub verdict: Verdict,
    pub decided_by: DecidedBy,
    pub steps: Vec<Step>,
}

/// A query's source or destination, resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    /// `workload`, `host endpoint` or `outside the cluster`.
    pub kind: String,
    /// `namespace/pod` (a workload), the host endpoint's name, or the address.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The address the packet uses.
    pub ip: String,
    /// Network sets (`namespace/name` or global `name`) the address falls in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network_sets: Vec<String>,
}

/// The answer to an explain query.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Explanation {
    pub verdict: Verdict,
    pub from: Peer,
    pub to: Peer,
    pub protocol: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    pub egress: Side,
    pub ingress: Side,
    /// The verdict with staged policies enforced, as Calico's flow logs report it; present
    /// when a staged policy selects an endpoint on the path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<Pending>,
}

/// The pending verdict: every staged policy evaluated as if it were enforced (staged
/// `Delete`s are not sent, so the policies they would remove still count).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    pub verdict: Verdict,
    pub egress: Side,
    pub ingress: Side,
}

/// One tier's policies that apply to an endpoint in one direction and chain, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierPolicies {
    pub tier: String,
    /// `Deny`, `Pass`, or empty when no Tier resource exists (then Deny).
    pub default_action: String,
    pub policies: Vec<PolicyBrief>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyBrief {
    pub policy: String,
    pub kind: String,
    pub selector: String,
}

/// The policies of one chain of an endpoint, per direction.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainPolicies {
    /// `policy` (normal), `untracked`, `pre-DNAT` or `forward`.
    pub stage: String,
    pub ingress: Vec<TierPolicies>,
    pub egress: Vec<TierPolicies>,
}

/// `explain --endpoint`: what applies to an endpoint, in evaluation order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointPolicies {
    pub endpoint: Peer,
    /// Every address of the endpoint.
    pub addresses: Vec<String>,
    pub chains: Vec<ChainPolicies>,
    /// Evaluated after the normal tiers, in order.
    pub profiles: Vec<String>,
}

/// `explain --policy`: where a policy is in force.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyReach {
    pub policy: String,
    pub kind: String,
    pub tier: String,
    pub selector: String,
    pub types: Vec<Dir>,
    /// The endpoints it selects (`namespace/pod`, `hep:NAME`), sorted.
    pub endpoints: Vec<String>,
    /// Nodes where it is active (it selects an endpoint there, or it is hinted to be needed
    /// everywhere), sorted.
    pub nodes: Vec<String>,
    /// Its rules, ingress then egress, each with its text ([`rule_text::rule_text`]); absent
    /// from an older server's answer.
    #[serde(default)]
    pub rules: Vec<RuleLine>,
}

/// One rule of a policy as `explain --policy` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleLine {
    pub direction: Dir,
    pub index: u32,
    /// `allow`, `deny`, `pass` or `log`.
    pub action: String,
    pub text: String,
}

/// An explain query, as the CLI and `/explain` take it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Query {
    pub from: String,
    pub to: String,
    /// `tcp`, `udp`, `sctp`, `icmp`, `icmpv6` or a number; default `tcp`.
    #[serde(default)]
    pub protocol: Option<String>,
    /// The destination port (TCP, UDP, SCTP).
    #[serde(default)]
    pub port: Option<String>,
    /// The source port; when absent, rules that match source ports do not match.
    #[serde(default)]
    pub source_port: Option<String>,
}

/// One explain request: a path between two peers, what applies to an endpoint, or where a
/// policy is in force. The server's `/explain` and the offline command answer the same.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Request {
    Path(Query),
    Endpoint(String),
    Policy(String),
}

/// A query that cannot be answered as asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("{0}")]
    Bad(String),
    #[error(
        "no endpoint {0:?} in the datastore (a workload as namespace/pod or its WorkloadEndpoint name, a host endpoint as hep:NAME, or an IP address)"
    )]
    Unknown(String),
    #[error("{what:?} is ambiguous: it names {}", candidates.join(", "))]
    Ambiguous {
        what: String,
        candidates: Vec<String>,
    },
}

/// The protocol number and ports a query asks for.
pub fn parse_protocol_and_ports(q: &Query) -> Result<(u8, Option<u16>, Option<u16>), QueryError> {
    let name = q.protocol.as_deref().unwrap_or("tcp");
    let protocol = rules::protocol_number(name).ok_or_else(|| {
        QueryError::Bad(format!(
            "unknown protocol {name:?}: use tcp, udp, sctp, icmp, icmpv6 or a number 0-255"
        ))
    })?;
    let port = |what: &str, v: &Option<String>| -> Result<Option<u16>, QueryError> {
        let Some(v) = v else { return Ok(None) };
        match v.parse::<u16>() {
            Ok(p) if p > 0 => Ok(Some(p)),
            _ => Err(QueryError::Bad(format!(
                "{what} {v:?} is not a port number (1-65535)"
            ))),
        }
    };
    let dst = port("port", &q.port)?;
    let src = port("source port", &q.source_port)?;
    let has_ports = matches!(protocol, 6 | 17 | 132 | 136);
    if !has_ports && (dst.is_some() || src.is_some()) {
        return Err(QueryError::Bad(format!(
            "protocol {} has no ports; drop --port",
            rules::protocol_name(protocol)
        )));
    }
    if has_ports && dst.is_none() {
        return Err(QueryError::Bad(format!(
            "protocol {} needs a destination port (--port N)",
            rules::protocol_name(protocol)
        )));
    }
    Ok((protocol, dst, src))
}
