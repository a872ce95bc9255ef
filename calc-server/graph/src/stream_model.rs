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
    pub policies: BTreeMap<(String, String, String), pb::Policy>,
    pub profiles: BTreeMap<String, pb::Profile>,
    pub workload_endpoints: BTreeMap<EndpointKey, pb::WorkloadEndpoint>,
    pub host_endpoints: BTreeMap<EndpointKey, pb::HostEndpoint>,
    pub host_metadata: BTreeMap<String, pb::HostMetadataUpdate>,
    pub ipam_pools: BTreeMap<String, pb::IpamPool>,
    pub in_sync: bool,
}

fn pid(id: &Option<pb::PolicyId>) -> (String, String, String) {
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

fn tier_policies(t: &[pb::TierInfo]) -> impl Iterator<Item = (String, String, String)> + '_ {
    t.iter().flat_map(|t| {
        t.ingress_policies
            .iter()
            .chain(&t.egress_policies)
            .map(|p| (p.name.clone(), p.namespace.clone(), p.kind.clone()))
    })
}

impl StreamModel {
    /// Applies one message; `Err` describes a contract violation (the model is unchanged).
    pub fn apply(&mut self, m: &pb::ToDataplane) -> Result<(), String> {
        let Some(p) = &m.payload else {
            return Err("message without payload".into());
        };
        match p {
            Payload::InSync(_) => {
                if self.in_sync {
                    return Err("InSync sent twice".into());
                }
                self.in_sync = true;
            }
            Payload::ConfigUpdate(c) => self.config = c.config.clone().into_iter().collect(),
            Payload::IpsetUpdate(u) => {
                if self.ipsets.contains_key(&u.id) {
                    return Err(format!("IPSetUpdate for {} which already exists", u.id));
                }
                self.ipsets.insert(
                    u.id.clone(),
                    (u.r#type, u.members.iter().cloned().collect()),
                );
            }
            Payload::IpsetDeltaUpdate(d) => {
                let Some((_, members)) = self.ipsets.get(&d.id) else {
                    return Err(format!("IPSetDeltaUpdate for unknown set {}", d.id));
                };
                for a in &d.added_members {
                    if members.contains(a) {
                        return Err(format!("delta adds {a} already in {}", d.id));
                    }
                }
                for r in &d.removed_members {
                    if !members.contains(r) {
                        return Err(format!("delta removes {r} not in {}", d.id));
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
                    return Err(format!("IPSetRemove of unknown set {}", r.id));
                }
                if let Some(user) = self.ipset_user(&r.id) {
                    return Err(format!("IPSetRemove of {} still used by {user}", r.id));
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
                    return Err(format!("ActivePolicyRemove of unknown policy {id:?}"));
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
                    return Err(format!(
                        "ActivePolicyRemove of {id:?} still used by an endpoint"
                    ));
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
                    return Err(format!("ActiveProfileRemove of unknown profile {name}"));
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
                    return Err(format!(
                        "ActiveProfileRemove of {name} still used by an endpoint"
                    ));
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
                self.workload_endpoints
                    .remove(&key)
                    .ok_or_else(|| format!("WorkloadEndpointRemove of unknown {key}"))?;
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
                self.host_endpoints
                    .remove(&id)
                    .ok_or_else(|| format!("HostEndpointRemove of unknown {id}"))?;
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

    fn check_rules<'a>(&self, rules: impl Iterator<Item = &'a pb::Rule>) -> Result<(), String> {
        for r in rules {
            for id in rule_ipsets(r) {
                if !self.ipsets.contains_key(id) {
                    return Err(format!("rule references IP set {id} not yet sent"));
                }
            }
        }
        Ok(())
    }

    fn check_endpoint(
        &self,
        profiles: &[String],
        policies: impl Iterator<Item = (String, String, String)>,
    ) -> Result<(), String> {
        for p in profiles {
            if !self.profiles.contains_key(p) {
                return Err(format!("endpoint references profile {p} not yet sent"));
            }
        }
        for p in policies {
            if !self.policies.contains_key(&p) {
                return Err(format!("endpoint references policy {p:?} not yet sent"));
            }
        }
        Ok(())
    }

    fn ipset_user(&self, id: &str) -> Option<String> {
        for (k, p) in &self.policies {
            if p.inbound_rules
                .iter()
                .chain(&p.outbound_rules)
                .any(|r| rule_ipsets(r).any(|x| x == id))
            {
                return Some(format!("policy {k:?}"));
            }
        }
        for (k, p) in &self.profiles {
            if p.inbound_rules
                .iter()
                .chain(&p.outbound_rules)
                .any(|r| rule_ipsets(r).any(|x| x == id))
            {
                return Some(format!("profile {k}"));
            }
        }
        None
    }

    /// Applies a batch, stopping at the first violation.
    pub fn apply_all<'a>(
        &mut self,
        msgs: impl IntoIterator<Item = &'a pb::ToDataplane>,
    ) -> Result<(), String> {
        for m in msgs {
            self.apply(m)?;
        }
        Ok(())
    }
}
