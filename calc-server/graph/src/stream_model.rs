//! A reference consumer of the `ToDataplane` stream: applies messages to an in-memory picture
//! of a node's dataplane and checks the stream contract as it goes.
//!
//! The contract (docs/proto.md): an IP set, policy or profile is never referenced before it has
//! been sent, nor removed while still referenced; IP-set deltas only touch existing sets and
//! only add absent members or remove present ones; `InSync` comes at most once. Tests use this
//! to check the graph's output; the dry-run driver can use it to hold desired state.

use std::collections::{BTreeMap, BTreeSet};

use felix_proto as pb;
use pb::to_dataplane::Payload;

/// Key of an endpoint: `orchestrator/workload/endpoint` for workloads, the id for hosts.
pub type EndpointKey = String;

/// A node's dataplane as the stream describes it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamModel {
    pub config: BTreeMap<String, String>,
    pub ipsets: BTreeMap<String, (i32, BTreeSet<String>)>,
    pub policies: BTreeMap<PolicyKey, pb::Policy>,
    pub profiles: BTreeMap<String, pb::Profile>,
    pub workload_endpoints: BTreeMap<EndpointKey, pb::WorkloadEndpoint>,
    pub host_endpoints: BTreeMap<EndpointKey, pb::HostEndpoint>,
    pub host_metadata: BTreeMap<String, pb::HostMetadataUpdate>,
    pub ipam_pools: BTreeMap<String, pb::IpamPool>,
    pub in_sync: bool,
}

/// A policy's `(name, namespace, kind)`.
pub type PolicyKey = (String, String, String);

/// A message that breaks the stream contract, naming what it touched. The model is unchanged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("message without payload")]
    NoPayload,
    #[error("InSync sent twice")]
    InSyncTwice,
    #[error("IPSetUpdate for {0} which already exists")]
    IpSetExists(String),
    #[error("IPSetDeltaUpdate for unknown set {0}")]
    DeltaOfUnknownSet(String),
    #[error("delta adds {member} already in {set}")]
    DeltaAddsPresent { member: String, set: String },
    #[error("delta removes {member} not in {set}")]
    DeltaRemovesAbsent { member: String, set: String },
    #[error("IPSetRemove of unknown set {0}")]
    RemoveOfUnknownSet(String),
    #[error("IPSetRemove of {set} still used by {user}")]
    IpSetInUse { set: String, user: IpSetUser },
    #[error("ActivePolicyRemove of unknown policy {0:?}")]
    RemoveOfUnknownPolicy(PolicyKey),
    #[error("ActivePolicyRemove of {0:?} still used by an endpoint")]
    PolicyInUse(PolicyKey),
    #[error("ActiveProfileRemove of unknown profile {0}")]
    RemoveOfUnknownProfile(String),
    #[error("ActiveProfileRemove of {0} still used by an endpoint")]
    ProfileInUse(String),
    #[error("WorkloadEndpointRemove of unknown {0}")]
    RemoveOfUnknownWorkload(EndpointKey),
    #[error("HostEndpointRemove of unknown {0}")]
    RemoveOfUnknownHost(EndpointKey),
    #[error("rule references IP set {0} not yet sent")]
    IpSetNotSent(String),
    #[error("endpoint references profile {0} not yet sent")]
    ProfileNotSent(String),
    #[error("endpoint references policy {0:?} not yet sent")]
    PolicyNotSent(PolicyKey),
}

/// The policy or profile whose rules use an IP set.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IpSetUser {
    #[error("policy {0:?}")]
    Policy(PolicyKey),
    #[error("profile {0}")]
    Profile(String),
}

fn pid(id: &Option<pb::PolicyId>) -> PolicyKey {
    let id = id.clone().unwrap_or_default();
    (id.name, id.namespace, id.kind)
}

pub fn workload_key(id: &Option<pb::WorkloadEndpointId>) -> EndpointKey {
    let id = id.clone().unwrap_or_default();
    format!(
        "{}/{}/{}",
        id.orchestrator_id, id.workload_id, id.endpoint_id
    )
}

fn rule_ipsets(r: &pb::Rule) -> impl Iterator<Item = &String> {
    r.src_ip_set_ids
        .iter()
        .chain(&r.dst_ip_set_ids)
        .chain(&r.not_src_ip_set_ids)
        .chain(&r.not_dst_ip_set_ids)
        .chain(&r.src_named_port_ip_set_ids)
        .chain(&r.dst_named_port_ip_set_ids)
        .chain(&r.not_src_named_port_ip_set_ids)
        .chain(&r.not_dst_named_port_ip_set_ids)
        .chain(&r.dst_ip_port_set_ids)
}

fn tier_policies(t: &[pb::TierInfo]) -> impl Iterator<Item = PolicyKey> + '_ {
    t.iter().flat_map(|t| {
        t.ingress_policies
            .iter()
            .chain(&t.egress_policies)
            .map(|p| (p.name.clone(), p.namespace.clone(), p.kind.clone()))
    })
}

impl StreamModel {
    /// Applies one message; `Err` is the contract violation (the model is unchanged).
    pub fn apply(&mut self, m: &pb::ToDataplane) -> Result<(), Violation> {
        let Some(p) = &m.payload else {
            return Err(Violation::NoPayload);
        };
        match p {
            Payload::InSync(_) => {
                if self.in_sync {
                    return Err(Violation::InSyncTwice);
                }
                self.in_sync = true;
            }
            Payload::ConfigUpdate(c) => self.config = c.config.clone().into_iter().collect(),
            Payload::IpsetUpdate(u) => {
                if self.ipsets.contains_key(&u.id) {
                    return Err(Violation::IpSetExists(u.id.clone()));
                }
                self.ipsets.insert(
                    u.id.clone(),
                    (u.r#type, u.members.iter().cloned().collect()),
                );
            }
            Payload::IpsetDeltaUpdate(d) => {
                let Some((_, members)) = self.ipsets.get(&d.id) else {
                    return Err(Violation::DeltaOfUnknownSet(d.id.clone()));
                };
                for a in &d.added_members {
                    if members.contains(a) {
                        return Err(Violation::DeltaAddsPresent {
                            member: a.clone(),
                            set: d.id.clone(),
                        });
                    }
                }
                for r in &d.removed_members {
                    if !members.contains(r) {
                        return Err(Violation::DeltaRemovesAbsent {
                            member: r.clone(),
                            set: d.id.clone(),
                        });
                    }
                }
                let members = &mut self.ipsets.get_mut(&d.id).expect("checked").1;
                for r in &d.removed_members {
                    members.remove(r);
                }
                members.extend(d.added_members.iter().cloned());
            }
            Payload::IpsetRemove(r) => {
                if !self.ipsets.contains_key(&r.id) {
                    return Err(Violation::RemoveOfUnknownSet(r.id.clone()));
                }
                if let Some(user) = self.ipset_user(&r.id) {
                    return Err(Violation::IpSetInUse {
                        set: r.id.clone(),
                        user,
                    });
                }
                self.ipsets.remove(&r.id);
            }
            Payload::ActivePolicyUpdate(u) => {
                let pol = u.policy.clone().unwrap_or_default();
                self.check_rules(pol.inbound_rules.iter().chain(&pol.outbound_rules))?;
                self.policies.insert(pid(&u.id), pol);
            }
            Payload::ActivePolicyRemove(r) => {
                let id = pid(&r.id);
                if !self.policies.contains_key(&id) {
                    return Err(Violation::RemoveOfUnknownPolicy(id));
                }
                let used = self
                    .workload_endpoints
                    .values()
                    .any(|e| tier_policies(&e.tiers).any(|p| p == id))
                    || self.host_endpoints.values().any(|e| {
                        tier_policies(&e.tiers)
                            .chain(tier_policies(&e.untracked_tiers))
                            .chain(tier_policies(&e.pre_dnat_tiers))
                            .chain(tier_policies(&e.forward_tiers))
                            .any(|p| p == id)
                    });
                if used {
                    return Err(Violation::PolicyInUse(id));
                }
                self.policies.remove(&id);
            }
            Payload::ActiveProfileUpdate(u) => {
                let prof = u.profile.clone().unwrap_or_default();
                self.check_rules(prof.inbound_rules.iter().chain(&prof.outbound_rules))?;
                self.profiles
                    .insert(u.id.clone().unwrap_or_default().name, prof);
            }
            Payload::ActiveProfileRemove(r) => {
                let name = r.id.clone().unwrap_or_default().name;
                if !self.profiles.contains_key(&name) {
                    return Err(Violation::RemoveOfUnknownProfile(name));
                }
                let used = self
                    .workload_endpoints
                    .values()
                    .any(|e| e.profile_ids.contains(&name))
                    || self
                        .host_endpoints
                        .values()
                        .any(|e| e.profile_ids.contains(&name));
                if used {
                    return Err(Violation::ProfileInUse(name));
                }
                self.profiles.remove(&name);
            }
            Payload::WorkloadEndpointUpdate(u) => {
                let ep = u.endpoint.clone().unwrap_or_default();
                self.check_endpoint(&ep.profile_ids, tier_policies(&ep.tiers))?;
                self.workload_endpoints.insert(workload_key(&u.id), ep);
            }
            Payload::WorkloadEndpointRemove(r) => {
                let key = workload_key(&r.id);
                if self.workload_endpoints.remove(&key).is_none() {
                    return Err(Violation::RemoveOfUnknownWorkload(key));
                }
            }
            Payload::HostEndpointUpdate(u) => {
                let ep = u.endpoint.clone().unwrap_or_default();
                let pols: Vec<_> = tier_policies(&ep.tiers)
                    .chain(tier_policies(&ep.untracked_tiers))
                    .chain(tier_policies(&ep.pre_dnat_tiers))
                    .chain(tier_policies(&ep.forward_tiers))
                    .collect();
                self.check_endpoint(&ep.profile_ids, pols.into_iter())?;
                self.host_endpoints
                    .insert(u.id.clone().unwrap_or_default().endpoint_id, ep);
            }
            Payload::HostEndpointRemove(r) => {
                let id = r.id.clone().unwrap_or_default().endpoint_id;
                if self.host_endpoints.remove(&id).is_none() {
                    return Err(Violation::RemoveOfUnknownHost(id));
                }
            }
            Payload::HostMetadataUpdate(u) => {
                self.host_metadata.insert(u.hostname.clone(), u.clone());
            }
            Payload::HostMetadataRemove(r) => {
                self.host_metadata.remove(&r.hostname);
            }
            Payload::IpamPoolUpdate(u) => {
                self.ipam_pools
                    .insert(u.id.clone(), u.pool.clone().unwrap_or_default());
            }
            Payload::IpamPoolRemove(r) => {
                self.ipam_pools.remove(&r.id);
            }
            _ => {}
        }
        Ok(())
    }

    fn check_rules<'a>(&self, rules: impl Iterator<Item = &'a pb::Rule>) -> Result<(), Violation> {
        for r in rules {
            for id in rule_ipsets(r) {
                if !self.ipsets.contains_key(id) {
                    return Err(Violation::IpSetNotSent(id.clone()));
                }
            }
        }
        Ok(())
    }

    fn check_endpoint(
        &self,
        profiles: &[String],
        policies: impl Iterator<Item = PolicyKey>,
    ) -> Result<(), Violation> {
        for p in profiles {
            if !self.profiles.contains_key(p) {
                return Err(Violation::ProfileNotSent(p.clone()));
            }
        }
        for p in policies {
            if !self.policies.contains_key(&p) {
                return Err(Violation::PolicyNotSent(p));
            }
        }
        Ok(())
    }

    fn ipset_user(&self, id: &str) -> Option<IpSetUser> {
        for (k, p) in &self.policies {
            if p.inbound_rules
                .iter()
                .chain(&p.outbound_rules)
                .any(|r| rule_ipsets(r).any(|x| x == id))
            {
                return Some(IpSetUser::Policy(k.clone()));
            }
        }
        for (k, p) in &self.profiles {
            if p.inbound_rules
                .iter()
                .chain(&p.outbound_rules)
                .any(|r| rule_ipsets(r).any(|x| x == id))
            {
                return Some(IpSetUser::Profile(k.clone()));
            }
        }
        None
    }

    /// Applies a batch, stopping at the first violation.
    pub fn apply_all<'a>(
        &mut self,
        msgs: impl IntoIterator<Item = &'a pb::ToDataplane>,
    ) -> Result<(), Violation> {
        for m in msgs {
            self.apply(m)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(p: Payload) -> pb::ToDataplane {
        pb::ToDataplane {
            payload: Some(p),
            ..Default::default()
        }
    }

    #[test]
    fn violations_name_what_they_touch() {
        let mut m = StreamModel::default();
        assert_eq!(
            m.apply(&pb::ToDataplane::default()),
            Err(Violation::NoPayload)
        );
        let remove = msg(Payload::IpsetRemove(pb::IpSetRemove { id: "s:a".into() }));
        let err = m.apply(&remove).unwrap_err();
        assert_eq!(err, Violation::RemoveOfUnknownSet("s:a".into()));
        assert_eq!(err.to_string(), "IPSetRemove of unknown set s:a");
        let insync = msg(Payload::InSync(pb::InSync {}));
        assert_eq!(m.apply_all([&insync, &insync]), Err(Violation::InSyncTwice));
        assert!(m.in_sync, "the first InSync applied");
    }
}
