//! Listings: the policies that apply to one endpoint, per chain and direction, and the
//! endpoints and nodes one policy reaches.
//!
//! Contract: read-only, through the graph's query API; the tier lists shown are the ones the
//! endpoint's node is sent, the nodes those where the policy is active (its span).

use std::net::IpAddr;

use felix_proto as pb;

use super::path::{Ask, Subject, full_name};
use super::walk::policy_label;
use super::{Dir, QueryError, Stage};
use crate::model::{Kind, ResourceKey};

type Key = ResourceKey;

impl<'g> Ask<'g> {
    /// The tiers, policies and profiles that apply to an endpoint, per chain and direction.
    pub(super) fn explain_endpoint(
        &self,
        what: &str,
    ) -> Result<super::EndpointPolicies, QueryError> {
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
        let brief = |t: &pb::TierInfo, dir: Dir| super::TierPolicies {
            tier: t.name.clone(),
            default_action: t.default_action.clone(),
            policies: match dir {
                Dir::Ingress => &t.ingress_policies,
                Dir::Egress => &t.egress_policies,
            }
            .iter()
            .map(|id| super::PolicyBrief {
                policy: policy_label(id),
                kind: id.kind.clone(),
                selector: view
                    .key(id)
                    .and_then(|k| self.g.policy(k))
                    .map(|p| p.model().selector.canonical().to_string())
                    .unwrap_or_default(),
            })
            .collect(),
        };
        let chain = |stage: Stage, tiers: &[pb::TierInfo]| super::ChainPolicies {
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
        Ok(super::EndpointPolicies {
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
    pub(super) fn explain_policy(&self, what: &str) -> Result<super::PolicyReach, QueryError> {
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
            .g
            .policies()
            .filter(|p| {
                let k = p.key();
                (k.name == name || p.model().id.name == name)
                    && (ns.is_none() || k.namespace.as_deref() == ns)
                    && kind.is_none_or(|kind| k.kind == kind)
            })
            .map(|p| p.key())
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
        let p = self.g.policy(&key).expect("found above").model();
        let mut endpoints: Vec<String> = self
            .g
            .endpoints()
            .filter(|e| e.selected_by(&key))
            .filter_map(|e| {
                self.ep(&Subject::Endpoint(e.key().clone(), None))
                    .map(|e| e.name)
            })
            .collect();
        endpoints.sort();
        let nodes = self.g.policy_nodes(&key);
        let mut types = Vec::new();
        if p.ingress {
            types.push(Dir::Ingress);
        }
        if p.egress {
            types.push(Dir::Egress);
        }
        Ok(super::PolicyReach {
            policy: full_name(&key),
            kind: key.kind.as_str().to_string(),
            tier: p.tier.clone(),
            selector: p.selector.canonical().to_string(),
            types,
            endpoints,
            nodes,
            rules: [(Dir::Ingress, &p.inbound), (Dir::Egress, &p.outbound)]
                .into_iter()
                .flat_map(|(direction, rules)| {
                    rules.iter().enumerate().map(move |(i, r)| super::RuleLine {
                        direction,
                        index: u32::try_from(i).unwrap_or(u32::MAX),
                        action: super::rules::action_name(&r.action).to_ascii_lowercase(),
                        text: super::rule_text::rule_text(r),
                    })
                })
                .collect(),
        })
    }
}
