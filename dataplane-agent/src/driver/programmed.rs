//! What a driver has programmed, by stream object: the admin endpoint's `GET /programmed`.
//!
//! Each policy and profile with the iptables chains it renders to and the endpoints that use
//! it; each endpoint with its interface, its own chains, and the tiers and profiles it runs.
//! An operator reading `iptables-save` can so map a chain name (`cali-pi-…`, `cali-po-…`,
//! `cali-pri-…`, `cali-pro-…`, `cali-tw-…`, `cali-fw-…`, host `cali-th-…` …; hashed once an id
//! is too long for a chain name) back to the object it came from.
//!
//! Contract: chain names are Calico's and come from the rules renderer's own naming functions
//! ([`rules::policy_chain_name`] and friends), whichever driver builds the dump, so the dry-run
//! driver shows the names the linux driver programs. The nftables driver lists them as nft holds
//! them: `<table>-<chain>` (`filter-cali-pi-…`), once per table the chain is placed in. Top-level lists and every list of names
//! are sorted and free of duplicates, so the JSON is stable and diffs cleanly; tiers, and the
//! policies within a tier, stay in evaluation order. Names are as the stream sent them: serde
//! escapes them in the JSON.

use std::collections::{BTreeMap, BTreeSet};

use felix_proto::{HostEndpoint, Policy, PolicyId, TierInfo, WorkloadEndpoint};
use serde::Serialize;

use super::WorkloadEndpointKey;
use super::linux::rules::{self, endpoint};
use crate::message::PolicyKey;

/// The dump: everything a driver programmed from the stream, by object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProgrammedObjects {
    /// Sorted by id.
    pub policies: Vec<ProgrammedPolicy>,
    /// Sorted by name.
    pub profiles: Vec<ProgrammedProfile>,
    /// Sorted by kind, then id.
    pub endpoints: Vec<ProgrammedEndpoint>,
}

/// One policy and where it went.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProgrammedPolicy {
    /// `<kind>/<name>`, or `<kind>/<namespace>/<name>` for a namespaced policy: the key of the
    /// dry-run state file, and what endpoints' tiers name.
    pub id: String,
    /// The policy's tier (from the policy, else from the endpoints that use it).
    pub tier: String,
    /// The v3 kind, e.g. `GlobalNetworkPolicy`.
    pub kind: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub name: String,
    /// The inbound (`cali-pi-`) and outbound (`cali-po-`) chains.
    pub chains: Vec<String>,
    /// Ids of the endpoints whose tiers list it.
    pub endpoints: Vec<String>,
}

/// One profile and where it went.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProgrammedProfile {
    pub name: String,
    /// The inbound (`cali-pri-`) and outbound (`cali-pro-`) chains.
    pub chains: Vec<String>,
    /// Ids of the endpoints that list it.
    pub endpoints: Vec<String>,
}

/// One endpoint, its chains and the policy it runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProgrammedEndpoint {
    /// `workload` or `host`.
    pub kind: &'static str,
    /// `<orchestrator>/<workload>/<endpoint>` for a workload; the host endpoint's id.
    pub id: String,
    /// The interface its chains are named after (`*` for a host endpoint on every interface);
    /// empty when there is none (a host endpoint's interface not known yet), and then it has no
    /// chains.
    pub interface: String,
    /// `cali-tw-`/`cali-fw-` (workload), `cali-th-`/`cali-fh-`/`cali-thfw-`/`cali-fhfw-` (host).
    pub chains: Vec<String>,
    /// Normal policy, in evaluation order.
    pub tiers: Vec<ProgrammedTier>,
    /// Host endpoints: doNotTrack policy (raw table).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub untracked_tiers: Vec<ProgrammedTier>,
    /// Host endpoints: pre-DNAT policy (mangle table).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pre_dnat_tiers: Vec<ProgrammedTier>,
    /// Host endpoints: applyOnForward policy for forwarded traffic.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub forward_tiers: Vec<ProgrammedTier>,
    /// In the order they are evaluated.
    pub profiles: Vec<String>,
}

/// One tier of an endpoint: policy ids (as [`ProgrammedPolicy::id`]) in evaluation order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProgrammedTier {
    pub name: String,
    pub ingress: Vec<String>,
    pub egress: Vec<String>,
}

/// Gathers a driver's objects into a [`ProgrammedObjects`]; the cross-references (which
/// endpoints use a policy or profile) are worked out in [`Collector::finish`].
#[derive(Debug, Default)]
pub struct Collector {
    policies: BTreeMap<String, ProgrammedPolicy>,
    profiles: BTreeMap<String, ProgrammedProfile>,
    endpoints: Vec<ProgrammedEndpoint>,
}

impl Collector {
    /// A policy the driver holds.
    pub fn policy(&mut self, key: &PolicyKey, policy: &Policy) {
        let proto = key.to_proto();
        let chains = [rules::POLICY_INBOUND_PFX, rules::POLICY_OUTBOUND_PFX]
            .map(|pfx| rules::policy_chain_name(pfx, &proto))
            .into();
        let id = key.to_string();
        self.policies.insert(
            id.clone(),
            ProgrammedPolicy {
                id,
                tier: policy.tier.clone(),
                kind: key.kind.clone(),
                namespace: key.namespace.clone(),
                name: key.name.clone(),
                chains,
                endpoints: Vec::new(),
            },
        );
    }

    /// A profile the driver holds.
    pub fn profile(&mut self, name: &str) {
        let chains = [rules::PROFILE_INBOUND_PFX, rules::PROFILE_OUTBOUND_PFX]
            .map(|pfx| rules::profile_chain_name(pfx, name))
            .into();
        self.profiles.insert(
            name.to_owned(),
            ProgrammedProfile {
                name: name.to_owned(),
                chains,
                endpoints: Vec::new(),
            },
        );
    }

    /// A workload endpoint whose chains are named after `interface` (`None`: it has none, as
    /// an endpoint without an interface name).
    pub fn workload(
        &mut self,
        key: &WorkloadEndpointKey,
        ep: &WorkloadEndpoint,
        interface: Option<&str>,
    ) {
        let chains = interface.map_or_else(Vec::new, |iface| {
            [endpoint::WORKLOAD_TO_PFX, endpoint::WORKLOAD_FROM_PFX]
                .map(|pfx| rules::endpoint_chain_name(pfx, iface))
                .into()
        });
        self.endpoints.push(ProgrammedEndpoint {
            kind: "workload",
            id: key.to_string(),
            interface: interface.unwrap_or_default().to_owned(),
            chains,
            tiers: tiers(&ep.tiers),
            profiles: ep.profile_ids.clone(),
            ..ProgrammedEndpoint::default()
        });
    }

    /// A host endpoint; `interface` is the one its chains are named after
    /// ([`endpoint::ALL_INTERFACES`] for `*`), `None` while it is not known.
    pub fn host(&mut self, id: &str, ep: &HostEndpoint, interface: Option<&str>) {
        let chains = interface.map_or_else(Vec::new, |iface| {
            [
                endpoint::HOST_TO_PFX,
                endpoint::HOST_FROM_PFX,
                endpoint::HOST_TO_FWD_PFX,
                endpoint::HOST_FROM_FWD_PFX,
            ]
            .map(|pfx| rules::endpoint_chain_name(pfx, iface))
            .into()
        });
        let shown = match interface {
            Some(endpoint::ALL_INTERFACES) => "*",
            other => other.unwrap_or_default(),
        };
        self.endpoints.push(ProgrammedEndpoint {
            kind: "host",
            id: id.to_owned(),
            interface: shown.to_owned(),
            chains,
            tiers: tiers(&ep.tiers),
            untracked_tiers: tiers(&ep.untracked_tiers),
            pre_dnat_tiers: tiers(&ep.pre_dnat_tiers),
            forward_tiers: tiers(&ep.forward_tiers),
            profiles: ep.profile_ids.clone(),
        });
    }

    /// The dump, cross-referenced and sorted.
    pub fn finish(mut self) -> ProgrammedObjects {
        for ep in &self.endpoints {
            let all_tiers = ep
                .tiers
                .iter()
                .chain(&ep.untracked_tiers)
                .chain(&ep.pre_dnat_tiers)
                .chain(&ep.forward_tiers);
            for tier in all_tiers {
                for policy in tier.ingress.iter().chain(&tier.egress) {
                    // The stream sends a policy before any endpoint that uses it; one it did
                    // not send is not programmed and has nothing to show.
                    if let Some(p) = self.policies.get_mut(policy) {
                        p.endpoints.push(ep.id.clone());
                        if p.tier.is_empty() {
                            p.tier.clone_from(&tier.name);
                        }
                    }
                }
            }
            for profile in &ep.profiles {
                if let Some(p) = self.profiles.get_mut(profile) {
                    p.endpoints.push(ep.id.clone());
                }
            }
        }
        let mut endpoints = self.endpoints;
        endpoints.sort_by(|a, b| (a.kind, &a.id).cmp(&(b.kind, &b.id)));
        for ep in &mut endpoints {
            sort_dedup(&mut ep.chains);
        }
        ProgrammedObjects {
            policies: self
                .policies
                .into_values()
                .map(|mut p| {
                    sort_dedup(&mut p.chains);
                    sort_dedup(&mut p.endpoints);
                    p
                })
                .collect(),
            profiles: self
                .profiles
                .into_values()
                .map(|mut p| {
                    sort_dedup(&mut p.chains);
                    sort_dedup(&mut p.endpoints);
                    p
                })
                .collect(),
            endpoints,
        }
    }
}

fn tiers(tiers: &[TierInfo]) -> Vec<ProgrammedTier> {
    let ids = |ids: &[PolicyId]| {
        ids.iter()
            .map(|id| PolicyKey::from(id).to_string())
            .collect()
    };
    tiers
        .iter()
        .map(|t| ProgrammedTier {
            name: t.name.clone(),
            ingress: ids(&t.ingress_policies),
            egress: ids(&t.egress_policies),
        })
        .collect()
}

fn sort_dedup(names: &mut Vec<String>) {
    let set: BTreeSet<String> = std::mem::take(names).into_iter().collect();
    names.extend(set);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gnp(name: &str) -> PolicyId {
        PolicyId {
            name: name.into(),
            namespace: String::new(),
            kind: "GlobalNetworkPolicy".into(),
        }
    }

    #[test]
    fn endpoints_are_cross_referenced_and_everything_is_sorted() {
        let mut c = Collector::default();
        let np = PolicyId {
            name: "web".into(),
            namespace: "shop".into(),
            kind: "NetworkPolicy".into(),
        };
        c.policy(&PolicyKey::from(&np), &Policy::default());
        c.policy(
            &PolicyKey::from(gnp("allow-dns")),
            &Policy {
                tier: "platform".into(),
                ..Policy::default()
            },
        );
        c.profile("kns.shop");
        let tier = |name: &str, ingress: Vec<PolicyId>, egress: Vec<PolicyId>| TierInfo {
            name: name.into(),
            ingress_policies: ingress,
            egress_policies: egress,
            default_action: String::new(),
        };
        let wep = WorkloadEndpoint {
            name: "cali1234".into(),
            tiers: vec![
                tier("platform", vec![], vec![gnp("allow-dns")]),
                tier("default", vec![np.clone()], vec![np.clone()]),
            ],
            profile_ids: vec!["kns.shop".into(), "never-sent".into()],
            ..WorkloadEndpoint::default()
        };
        let key = WorkloadEndpointKey {
            orchestrator_id: "k8s".into(),
            workload_id: "shop/web-0".into(),
            endpoint_id: "eth0".into(),
        };
        c.workload(&key, &wep, Some("cali1234"));
        let hep = HostEndpoint {
            name: "*".into(),
            tiers: vec![tier("platform", vec![gnp("allow-dns")], vec![])],
            ..HostEndpoint::default()
        };
        c.host("all-interfaces", &hep, Some(endpoint::ALL_INTERFACES));
        c.host("eth9", &HostEndpoint::default(), None);
        let dump = c.finish();

        let ids: Vec<&str> = dump.policies.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(
            ids,
            ["GlobalNetworkPolicy/allow-dns", "NetworkPolicy/shop/web"]
        );
        let web = &dump.policies[1];
        assert_eq!(web.tier, "default", "from the endpoint that uses it");
        assert_eq!(web.endpoints, ["k8s/shop/web-0/eth0"], "listed once");
        assert_eq!(
            web.chains,
            [
                rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &np),
                rules::policy_chain_name(rules::POLICY_OUTBOUND_PFX, &np),
            ]
        );
        assert_eq!(web.chains, ["cali-pi-np/shop/web", "cali-po-np/shop/web"]);
        let dns = &dump.policies[0];
        assert_eq!(dns.tier, "platform");
        assert_eq!(dns.endpoints, ["all-interfaces", "k8s/shop/web-0/eth0"]);
        assert_eq!(dump.profiles[0].endpoints, ["k8s/shop/web-0/eth0"]);
        assert_eq!(
            dump.profiles[0].chains,
            ["cali-pri-kns.shop", "cali-pro-kns.shop"]
        );

        let eps: Vec<(&str, &str)> = dump
            .endpoints
            .iter()
            .map(|e| (e.kind, e.id.as_str()))
            .collect();
        assert_eq!(
            eps,
            [
                ("host", "all-interfaces"),
                ("host", "eth9"),
                ("workload", "k8s/shop/web-0/eth0")
            ]
        );
        let star = &dump.endpoints[0];
        assert_eq!(star.interface, "*");
        assert!(
            star.chains.contains(&rules::endpoint_chain_name(
                endpoint::HOST_FROM_PFX,
                endpoint::ALL_INTERFACES
            )),
            "{star:?}"
        );
        assert!(dump.endpoints[1].chains.is_empty(), "interface not known");
        let wl = &dump.endpoints[2];
        assert_eq!(wl.chains, ["cali-fw-cali1234", "cali-tw-cali1234"]);
        assert_eq!(wl.tiers[0].name, "platform", "evaluation order kept");
        assert_eq!(wl.tiers[1].ingress, ["NetworkPolicy/shop/web"]);

        let json = serde_json::to_value(&dump).unwrap();
        assert!(
            json["endpoints"][2].get("untracked_tiers").is_none(),
            "empty host-only lists are left out"
        );
        assert!(
            json["policies"][0].get("namespace").is_none(),
            "global policies have no namespace"
        );
        assert_eq!(json["policies"][1]["namespace"], "shop");
    }

    #[test]
    fn hostile_names_stay_inside_their_json_strings() {
        let mut c = Collector::default();
        let id = gnp("x\",\"injected\":\"</script>\n");
        c.policy(&PolicyKey::from(&id), &Policy::default());
        let json = serde_json::to_string(&c.finish()).unwrap();
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back["policies"][0]["name"], id.name.as_str());
        assert!(back["policies"][0].get("injected").is_none());
        let chains = back["policies"][0]["chains"].as_array().unwrap();
        assert!(
            chains
                .iter()
                .all(|c| c.as_str().unwrap().len() <= rules::MAX_CHAIN_NAME),
            "{chains:?}"
        );
    }
}
