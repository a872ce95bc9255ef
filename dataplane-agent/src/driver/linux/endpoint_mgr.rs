//! The endpoint manager: workload and host endpoints, their `cali-tw-`/`cali-fw-` and
//! `cali-th-`/`cali-fh-` chains, and the dispatch chains that send each interface's traffic to
//! them.
//!
//! Contract: `on_update` checks each endpoint against the workload prefixes in force
//! (`validate`) and records it; one that fails gets no chains and no dispatch entry, so its
//! interface is unknown and its traffic drops, and it reports `error`. [`EndpointManager::apply`]
//! renders only the endpoints that changed, then the dispatch chains when the set of
//! interfaces may have changed. A host endpoint named by address follows the interface that
//! holds the address (re-checked on every interface change, see `on_wakeup`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use felix_proto::{HostEndpoint, TierInfo, WorkloadEndpoint};
use tracing::{debug, warn};

use super::LinuxOptions;
use super::desired::Tables;
use super::interfaces::Interfaces;
use super::refusals::Refusals;
use super::rules::endpoint::{self, ALL_INTERFACES};
use super::rules::static_chains;
use super::rules::{self, Chain};
use super::validate;
use crate::driver::EndpointStatuses;
use crate::driver::programmed::Collector;
use crate::message::{HostEndpointKey, Message, WorkloadEndpointKey};

pub(crate) struct EndpointManager {
    weps: BTreeMap<WorkloadEndpointKey, WorkloadEndpoint>,
    dirty_weps: HashSet<WorkloadEndpointKey>,
    /// Interface each workload's chains were rendered for.
    wep_ifaces: HashMap<WorkloadEndpointKey, String>,
    heps: BTreeMap<HostEndpointKey, HostEndpoint>,
    dirty_heps: HashSet<HostEndpointKey>,
    hep_ifaces: HashMap<HostEndpointKey, String>,
    dispatch_dirty: bool,
    /// Endpoints whose chains are in the kernel as last rendered.
    programmed_weps: HashSet<WorkloadEndpointKey>,
    /// Endpoints refused by `validate` (reported as "error"), kept to check again when the
    /// workload prefixes change.
    rejected_weps: BTreeMap<WorkloadEndpointKey, WorkloadEndpoint>,
    rejected_heps: HashSet<HostEndpointKey>,
    /// Interfaces as the monitor sees them.
    ifaces: Arc<Interfaces>,
}

impl EndpointManager {
    pub(crate) fn new(ifaces: Arc<Interfaces>) -> Self {
        Self {
            weps: BTreeMap::new(),
            dirty_weps: HashSet::new(),
            wep_ifaces: HashMap::new(),
            heps: BTreeMap::new(),
            dirty_heps: HashSet::new(),
            hep_ifaces: HashMap::new(),
            dispatch_dirty: true,
            programmed_weps: HashSet::new(),
            rejected_weps: BTreeMap::new(),
            rejected_heps: HashSet::new(),
            ifaces,
        }
    }

    /// `prefixes`: the workload interface prefixes in force.
    pub(crate) fn on_update(
        &mut self,
        msg: &Message,
        prefixes: &[String],
        refusals: &mut Refusals,
    ) {
        match msg {
            Message::WorkloadEndpointUpdate { key, endpoint } => {
                self.take_workload(key.clone(), (**endpoint).clone(), prefixes, refusals);
            }
            Message::WorkloadEndpointRemove { key } => {
                refusals.accept(&format!("workload endpoint {key}"));
                self.rejected_weps.remove(key);
                self.weps.remove(key);
                self.dirty_weps.insert(key.clone());
            }
            Message::HostEndpointUpdate {
                key: id,
                endpoint: ep,
            } => {
                let what = format!("host endpoint {id:?}");
                match validate::host_endpoint(id.as_str(), ep) {
                    Ok(()) => {
                        refusals.accept(&what);
                        self.rejected_heps.remove(id);
                        self.heps.insert(id.clone(), (**ep).clone());
                        self.dirty_heps.insert(id.clone());
                    }
                    Err(e) => {
                        refusals.reject(what, e.to_string());
                        if validate::object_name("id", id.as_str()).is_ok() {
                            self.rejected_heps.insert(id.clone());
                            self.heps.remove(id);
                            self.dirty_heps.insert(id.clone());
                        }
                    }
                }
            }
            Message::HostEndpointRemove { key: id } => {
                refusals.accept(&format!("host endpoint {id:?}"));
                self.rejected_heps.remove(id);
                self.heps.remove(id);
                self.dirty_heps.insert(id.clone());
            }
            _ => {}
        }
    }

    /// Takes a workload endpoint from the stream, or again after the prefixes changed: checked
    /// against the prefixes in force, then programmed or refused.
    fn take_workload(
        &mut self,
        key: WorkloadEndpointKey,
        ep: WorkloadEndpoint,
        prefixes: &[String],
        refusals: &mut Refusals,
    ) {
        let what = format!("workload endpoint {key}");
        match validate::workload_endpoint(&ep, prefixes) {
            Ok(()) => {
                refusals.accept(&what);
                self.rejected_weps.remove(&key);
                if self.weps.get(&key) != Some(&ep) {
                    self.weps.insert(key.clone(), ep);
                    self.dirty_weps.insert(key);
                }
            }
            Err(e) => {
                // Failing closed: without its chains and dispatch entry the interface is
                // unknown, and traffic on an unknown workload interface drops.
                refusals.reject(what, e.to_string());
                self.rejected_weps.insert(key.clone(), ep);
                self.weps.remove(&key);
                self.dirty_weps.insert(key);
            }
        }
    }

    /// The workload prefixes in force changed: every endpoint was checked against the old
    /// ones, so each is checked again, and the dispatch chains follow.
    pub(crate) fn recheck_workloads(&mut self, prefixes: &[String], refusals: &mut Refusals) {
        let all: Vec<(WorkloadEndpointKey, WorkloadEndpoint)> = self
            .weps
            .iter()
            .chain(&self.rejected_weps)
            .map(|(k, e)| (k.clone(), e.clone()))
            .collect();
        for (key, ep) in all {
            self.take_workload(key, ep, prefixes, refusals);
        }
        self.dispatch_dirty = true;
    }

    /// Every endpoint's chains must be rendered again (a setting they depend on changed).
    pub(crate) fn dirty_all(&mut self) {
        self.dirty_weps.extend(self.weps.keys().cloned());
        self.dirty_heps.extend(self.heps.keys().cloned());
    }

    /// Renders the endpoints that changed, then the dispatch chains if the interfaces may
    /// have.
    pub(crate) fn apply(&mut self, tables: &mut Tables, opts: &LinuxOptions) {
        let endpoints_changed = !self.dirty_weps.is_empty() || !self.dirty_heps.is_empty();
        self.render_workloads(tables, &opts.render);
        self.render_hosts(tables, &opts.render);
        if endpoints_changed || self.dispatch_dirty {
            self.render_dispatch(tables, &opts.statics.workload_prefixes);
        }
    }

    fn render_workloads(&mut self, tables: &mut Tables, cfg: &rules::policy::RenderConfig) {
        let dirty = std::mem::take(&mut self.dirty_weps);
        // Every old chain goes before any new one is set: an interface that moved from one
        // endpoint to another in this batch must end with the new endpoint's chains, whatever
        // order the keys come in.
        for key in &dirty {
            self.programmed_weps.remove(key);
            if let Some(old) = self.wep_ifaces.remove(key) {
                let names = [
                    rules::endpoint_chain_name(endpoint::WORKLOAD_TO_PFX, &old),
                    rules::endpoint_chain_name(endpoint::WORKLOAD_FROM_PFX, &old),
                ];
                for v in tables.versions().to_vec() {
                    tables.table(v, "filter").remove_chain(&names[0]);
                    tables.table(v, "filter").remove_chain(&names[1]);
                }
            }
        }
        for key in dirty {
            let Some(wep) = self.weps.get(&key) else {
                continue;
            };
            if wep.name.is_empty() {
                warn!(endpoint = %key, "workload endpoint has no interface name; not programmed");
                continue;
            }
            let admin_up = wep.state == "active";
            let iface = wep.name.clone();
            // The chains do not depend on the family: render once, program in each.
            let chains =
                endpoint::workload_chains(cfg, &iface, admin_up, &wep.tiers, &wep.profile_ids);
            let what = format!("workload endpoint {key}");
            for v in tables.versions().to_vec() {
                let t = tables.table(v, "filter");
                chains
                    .iter()
                    .cloned()
                    .for_each(|c| t.set_owned_chain(c, &what));
            }
            self.wep_ifaces.insert(key, iface);
        }
    }

    fn render_hosts(&mut self, tables: &mut Tables, cfg: &rules::policy::RenderConfig) {
        let dirty = std::mem::take(&mut self.dirty_heps);
        // Old chains first, as for workloads.
        for id in &dirty {
            if let Some(old) = self.hep_ifaces.remove(id) {
                let names: Vec<String> = [
                    endpoint::HOST_TO_PFX,
                    endpoint::HOST_FROM_PFX,
                    endpoint::HOST_TO_FWD_PFX,
                    endpoint::HOST_FROM_FWD_PFX,
                ]
                .iter()
                .map(|p| rules::endpoint_chain_name(p, &old))
                .collect();
                for v in tables.versions().to_vec() {
                    tables.remove_everywhere(v, &names);
                }
            }
        }
        for id in dirty {
            let Some(hep) = self.heps.get(&id) else {
                continue;
            };
            let Some(iface) = self.hep_iface(hep) else {
                debug!(host_endpoint = %id, "no interface holds the host endpoint's addresses yet");
                continue;
            };
            let filter = endpoint::host_filter_chains(
                cfg,
                &iface,
                &hep.tiers,
                &hep.forward_tiers,
                &hep.profile_ids,
            );
            // As Felix: doNotTrack and pre-DNAT policy on the `*` endpoint would apply to every
            // packet of the host, loopback included; they are ignored, with a warning.
            let wildcard = hep.name == "*";
            if wildcard && !(hep.untracked_tiers.is_empty() && hep.pre_dnat_tiers.is_empty()) {
                warn!(host_endpoint = %id, "doNotTrack and pre-DNAT policy do not apply to the '*' host endpoint; ignored");
            }
            let raw = (!hep.untracked_tiers.is_empty() && !wildcard)
                .then(|| endpoint::host_raw_chains(cfg, &iface, &hep.untracked_tiers));
            let mangle = (!hep.pre_dnat_tiers.is_empty() && !wildcard)
                .then(|| endpoint::host_mangle_chain(cfg, &iface, &hep.pre_dnat_tiers));
            let mangle_egress =
                endpoint::host_mangle_egress_chain(cfg, &iface, &hep.tiers, &hep.profile_ids);
            let what = format!("host endpoint {id:?}");
            for v in tables.versions().to_vec() {
                let t = tables.table(v, "filter");
                filter
                    .iter()
                    .cloned()
                    .for_each(|c| t.set_owned_chain(c, &what));
                if let Some(raw) = &raw {
                    let t = tables.table(v, "raw");
                    raw.iter()
                        .cloned()
                        .for_each(|c| t.set_owned_chain(c, &what));
                }
                let t = tables.table(v, "mangle");
                if let Some(m) = &mangle {
                    t.set_owned_chain(m.clone(), &what);
                }
                t.set_owned_chain(mangle_egress.clone(), &what);
            }
            self.hep_ifaces.insert(id, iface);
        }
    }

    fn render_dispatch(&mut self, tables: &mut Tables, workload_prefixes: &[String]) {
        let wl_ifaces: Vec<String> = self.wep_ifaces.values().cloned().collect();
        // Dispatch names the interfaces; "*" stands for the catch-all endpoint.
        let hep_iface = |id: &HostEndpointKey| {
            self.hep_ifaces.get(id).map(|i| {
                if i == ALL_INTERFACES {
                    "*".to_owned()
                } else {
                    i.clone()
                }
            })
        };
        let all: Vec<String> = self.heps.keys().filter_map(hep_iface).collect();
        // Felix ignores doNotTrack and pre-DNAT policy on the `*` endpoint (see render_hosts).
        let untracked: Vec<String> = self
            .heps
            .iter()
            .filter(|(_, h)| !h.untracked_tiers.is_empty() && h.name != "*")
            .filter_map(|(id, _)| hep_iface(id))
            .collect();
        let pre_dnat: Vec<String> = self
            .heps
            .iter()
            .filter(|(_, h)| !h.pre_dnat_tiers.is_empty() && h.name != "*")
            .filter_map(|(id, _)| hep_iface(id))
            .collect();
        let mut filter: Vec<Chain> = static_chains::workload_dispatch(&wl_ifaces).into();
        let [from_all, to_all] = static_chains::host_dispatch(&all);
        filter.push(from_all);
        filter.push(to_all);
        let mangle_to = static_chains::host_to_dispatch_for_mangle(&all, workload_prefixes);
        filter.extend(static_chains::host_forward_dispatch(&all));
        let raw: Vec<Chain> = static_chains::host_dispatch(&untracked).into();
        let [mangle_from, _] = static_chains::host_dispatch(&pre_dnat);
        for v in tables.versions().to_vec() {
            let t = tables.table(v, "filter");
            filter.iter().cloned().for_each(|c| t.set_chain(c));
            let t = tables.table(v, "raw");
            raw.iter().cloned().for_each(|c| t.set_chain(c));
            let t = tables.table(v, "mangle");
            t.set_chain(mangle_from.clone());
            // DNAT'd host traffic meets host endpoint egress policy in mangle POSTROUTING.
            t.set_chain(mangle_to.clone());
        }
        self.dispatch_dirty = false;
    }

    /// The interface a host endpoint applies to: its name, `*`, or (no name) the interface
    /// holding one of its expected addresses; `None` while that interface is unknown.
    fn hep_iface(&self, hep: &HostEndpoint) -> Option<String> {
        if hep.name == "*" {
            return Some(ALL_INTERFACES.to_owned());
        }
        if !hep.name.is_empty() {
            return Some(hep.name.clone());
        }
        let ips: Vec<IpAddr> = hep
            .expected_ipv4_addrs
            .iter()
            .chain(&hep.expected_ipv6_addrs)
            .filter_map(|a| a.parse().ok())
            .collect();
        self.ifaces.by_address(&ips)
    }

    /// The last apply succeeded: every workload's chains are in the kernel as rendered.
    pub(crate) fn mark_programmed(&mut self) {
        self.programmed_weps = self.weps.keys().cloned().collect();
    }

    /// Host endpoints found by address may have found (or lost) their interface.
    pub(crate) fn on_wakeup(&mut self) {
        let by_address: Vec<HostEndpointKey> = self
            .heps
            .iter()
            .filter(|(_, h)| h.name.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        self.dirty_heps.extend(by_address);
    }

    /// The workload endpoints programmed (or to be), for routes.
    pub(crate) fn workloads(&self) -> &BTreeMap<WorkloadEndpointKey, WorkloadEndpoint> {
        &self.weps
    }

    /// The host endpoints held, for policy placement.
    pub(crate) fn hosts(&self) -> impl Iterator<Item = &HostEndpoint> + Clone {
        self.heps.values()
    }

    pub(crate) fn workload(&self, id: &WorkloadEndpointKey) -> Option<&WorkloadEndpoint> {
        self.weps.get(id)
    }

    /// Every endpoint's status. `refused`: every object held failing closed; `apply_failed`:
    /// the last apply failed; `link_up`: whether an interface counts as up.
    pub(crate) fn statuses(
        &self,
        refused: &BTreeMap<String, String>,
        apply_failed: bool,
        link_up: impl Fn(&str) -> bool,
    ) -> EndpointStatuses {
        let mut out = EndpointStatuses::default();
        // An endpoint whose chains, or a policy or profile it uses, are held failing closed is
        // not enforced as the datastore says: it reports "error".
        let uses_refused = |what: String, tiers: &[&[TierInfo]], profiles: &[String]| {
            // Usually nothing is refused: skip formatting a key per policy reference then.
            !refused.is_empty()
                && (refused.contains_key(&what)
                    || tiers.iter().flat_map(|t| t.iter()).any(|t| {
                        t.ingress_policies
                            .iter()
                            .chain(&t.egress_policies)
                            .any(|p| {
                                refused
                                    .contains_key(&format!("policy {}", rules::policy_id_string(p)))
                            })
                    })
                    || profiles
                        .iter()
                        .any(|p| refused.contains_key(&format!("profile {p:?}"))))
        };
        for (key, wep) in &self.weps {
            let status = if uses_refused(
                format!("workload endpoint {key}"),
                &[&wep.tiers],
                &wep.profile_ids,
            ) {
                "error"
            } else if !self.programmed_weps.contains(key) {
                if apply_failed { "error" } else { "down" }
            } else if wep.state == "active" && link_up(&wep.name) {
                "up"
            } else {
                "down"
            };
            out.workloads.insert(key.clone(), status.to_owned());
        }
        for (id, hep) in &self.heps {
            let tiers: [&[TierInfo]; 4] = [
                &hep.tiers,
                &hep.forward_tiers,
                &hep.untracked_tiers,
                &hep.pre_dnat_tiers,
            ];
            let status = if (apply_failed && self.dirty_heps.contains(id))
                || uses_refused(format!("host endpoint {id:?}"), &tiers, &hep.profile_ids)
            {
                "error"
            } else {
                match self.hep_iface(hep) {
                    Some(i) if i == ALL_INTERFACES => "up",
                    Some(i) if link_up(&i) => "up",
                    _ => "down",
                }
            };
            out.hosts.insert(id.clone(), status.to_owned());
        }
        // Refused endpoints are reported, so the datastore shows them as broken.
        for key in self.rejected_weps.keys() {
            out.workloads.insert(key.clone(), "error".to_owned());
        }
        for id in &self.rejected_heps {
            out.hosts.insert(id.clone(), "error".to_owned());
        }
        out
    }

    /// Adds every endpoint held; an endpoint has chains once rendered for an interface.
    pub(crate) fn collect(&self, c: &mut Collector) {
        for (key, ep) in &self.weps {
            c.workload(key, ep, self.wep_ifaces.get(key).map(String::as_str));
        }
        for (id, ep) in &self.heps {
            c.host(id.as_str(), ep, self.hep_ifaces.get(id).map(String::as_str));
        }
    }
}
