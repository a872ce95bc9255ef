//! The Linux driver: programs iptables (legacy or nft backend) and ipsets in Calico's layout.
//!
//! `on_update` records the desired state and marks what changed; `apply` renders only the
//! changed policies, profiles and endpoints into chains, then programs in Felix's order: IP sets
//! created and updated, then the tables (one `iptables-restore` per changed table), then unused
//! IP sets destroyed. Every table and the sets keep a view of the kernel and write only
//! differences; `request_refresh` drops those views so the next apply reads the kernel back and
//! repairs out-of-band changes. All IO goes through a [`runner::CommandRunner`].

pub mod fake;
pub mod ipsets;
pub mod iptables;
pub mod rules;
pub mod runner;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use felix_proto::to_dataplane::Payload;
use felix_proto::{HostEndpoint, Policy, Profile, ToDataplane, WorkloadEndpoint};
use tracing::{debug, info, warn};

use self::ipsets::{IpSets, SetKind};
use self::iptables::{Backend, Table};
use self::rules::endpoint::{self, ALL_INTERFACES};
use self::rules::policy::{self, RenderConfig};
use self::rules::static_chains::{self, StaticConfig};
use self::rules::{Chain, IpVersion};
use self::runner::CommandRunner;
use super::{Driver, DriverError, EndpointStatuses, WorkloadEndpointKey};

/// Settings of the Linux driver.
#[derive(Clone, Debug)]
pub struct LinuxOptions {
    pub backend: Backend,
    /// Program ip6tables and IPv6 sets too.
    pub ipv6: bool,
    /// How often the kernel is read back and repaired.
    pub refresh_interval: Duration,
    pub statics: StaticConfig,
    pub render: RenderConfig,
    /// Seconds `iptables-restore` waits for the xtables lock.
    pub lock_wait_secs: u32,
}

impl Default for LinuxOptions {
    fn default() -> Self {
        Self {
            backend: Backend::Auto,
            ipv6: true,
            refresh_interval: Duration::from_secs(90),
            statics: StaticConfig::default(),
            render: RenderConfig::default(),
            lock_wait_secs: 10,
        }
    }
}

type PolicyKey = (String, String, String);

fn policy_key(id: &felix_proto::PolicyId) -> PolicyKey {
    (id.kind.clone(), id.namespace.clone(), id.name.clone())
}

fn policy_id(k: &PolicyKey) -> felix_proto::PolicyId {
    felix_proto::PolicyId {
        kind: k.0.clone(),
        namespace: k.1.clone(),
        name: k.2.clone(),
    }
}

const TABLE_NAMES: [&str; 3] = ["filter", "raw", "mangle"];

/// Totals of what is programmed, for logs and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    pub rules: usize,
    pub ipsets: usize,
    pub ipset_members: usize,
}

/// Programs iptables and ipsets.
pub struct LinuxDriver {
    opts: LinuxOptions,
    runner: Box<dyn CommandRunner>,
    backend: Option<Backend>,
    versions: Vec<IpVersion>,
    ipsets: IpSets,
    tables: Vec<Table>,
    statics_set: bool,

    policies: HashMap<PolicyKey, Policy>,
    dirty_policies: HashSet<PolicyKey>,
    profiles: HashMap<String, Profile>,
    dirty_profiles: HashSet<String>,
    weps: BTreeMap<WorkloadEndpointKey, WorkloadEndpoint>,
    dirty_weps: HashSet<WorkloadEndpointKey>,
    /// Interface each workload's chains were rendered for.
    wep_ifaces: HashMap<WorkloadEndpointKey, String>,
    heps: BTreeMap<String, HostEndpoint>,
    dirty_heps: HashSet<String>,
    hep_ifaces: HashMap<String, String>,
    dispatch_dirty: bool,

    /// Endpoints whose chains are in the kernel as last rendered.
    programmed_weps: HashSet<WorkloadEndpointKey>,
    /// Set when the last apply failed (endpoints changed since then report "error").
    last_error: Option<String>,
}

impl LinuxDriver {
    pub fn new(opts: LinuxOptions, runner: Box<dyn CommandRunner>) -> Self {
        let versions = if opts.ipv6 {
            IpVersion::BOTH.to_vec()
        } else {
            vec![IpVersion::V4]
        };
        let mut tables = Vec::new();
        for v in &versions {
            for name in TABLE_NAMES {
                let mut t = Table::new(name, *v);
                t.lock_wait_secs = opts.lock_wait_secs;
                tables.push(t);
            }
        }
        let backend = match opts.backend {
            Backend::Auto => None,
            b => Some(b),
        };
        Self {
            ipsets: IpSets::new(versions.clone()),
            opts,
            runner,
            backend,
            versions,
            tables,
            statics_set: false,
            policies: HashMap::new(),
            dirty_policies: HashSet::new(),
            profiles: HashMap::new(),
            dirty_profiles: HashSet::new(),
            weps: BTreeMap::new(),
            dirty_weps: HashSet::new(),
            wep_ifaces: HashMap::new(),
            heps: BTreeMap::new(),
            dirty_heps: HashSet::new(),
            hep_ifaces: HashMap::new(),
            dispatch_dirty: true,
            programmed_weps: HashSet::new(),
            last_error: None,
        }
    }

    /// The backend in use (after detection).
    pub fn backend(&self) -> Option<Backend> {
        self.backend
    }

    /// What is programmed (desired state after the last apply).
    pub fn programmed(&self) -> Programmed {
        let (ipsets, ipset_members) = self.ipsets.counts();
        Programmed {
            rules: self.tables.iter().map(Table::rule_count).sum(),
            ipsets,
            ipset_members,
        }
    }

    fn table(&mut self, v: IpVersion, name: &str) -> &mut Table {
        self.tables
            .iter_mut()
            .find(|t| t.version() == v && t.name() == name)
            .expect("tables exist for every programmed family")
    }

    fn render_statics(&mut self) {
        for v in self.versions.clone() {
            let (chains, hooks) = static_chains::filter(&self.opts.statics, v);
            let t = self.table(v, "filter");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
            let (chains, hooks) = static_chains::raw(&self.opts.statics);
            let t = self.table(v, "raw");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
            let (chains, hooks) = static_chains::mangle(&self.opts.statics);
            let t = self.table(v, "mangle");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
        }
        self.statics_set = true;
    }

    fn remove_everywhere(&mut self, v: IpVersion, names: &[String]) {
        for t in self.tables.iter_mut().filter(|t| t.version() == v) {
            for n in names {
                t.remove_chain(n);
            }
        }
    }

    fn render_policies(&mut self) {
        for key in std::mem::take(&mut self.dirty_policies) {
            let id = policy_id(&key);
            for v in self.versions.clone() {
                let names = [
                    rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &id),
                    rules::policy_chain_name(rules::POLICY_OUTBOUND_PFX, &id),
                ];
                self.remove_everywhere(v, &names);
                let Some(p) = self.policies.get(&key) else {
                    continue;
                };
                // Felix puts a policy in the table of the chains that use it.
                let table = if p.untracked {
                    "raw"
                } else if p.pre_dnat {
                    "mangle"
                } else {
                    "filter"
                };
                let chains = policy::policy_chains(&self.opts.render, &id, p, v);
                let t = self.table(v, table);
                chains.into_iter().for_each(|c| t.set_chain(c));
            }
        }
    }

    fn render_profiles(&mut self) {
        for name in std::mem::take(&mut self.dirty_profiles) {
            for v in self.versions.clone() {
                let names = [
                    rules::profile_chain_name(rules::PROFILE_INBOUND_PFX, &name),
                    rules::profile_chain_name(rules::PROFILE_OUTBOUND_PFX, &name),
                ];
                self.remove_everywhere(v, &names);
                let Some(p) = self.profiles.get(&name) else {
                    continue;
                };
                let chains = policy::profile_chains(&self.opts.render, &name, p, v);
                let t = self.table(v, "filter");
                chains.into_iter().for_each(|c| t.set_chain(c));
            }
        }
    }

    fn render_workloads(&mut self) {
        for key in std::mem::take(&mut self.dirty_weps) {
            self.programmed_weps.remove(&key);
            if let Some(old) = self.wep_ifaces.remove(&key) {
                let names = [
                    rules::endpoint_chain_name(endpoint::WORKLOAD_TO_PFX, &old),
                    rules::endpoint_chain_name(endpoint::WORKLOAD_FROM_PFX, &old),
                ];
                for v in self.versions.clone() {
                    self.table(v, "filter").remove_chain(&names[0]);
                    self.table(v, "filter").remove_chain(&names[1]);
                }
            }
            let Some(wep) = self.weps.get(&key) else {
                continue;
            };
            if wep.name.is_empty() {
                warn!(endpoint = %key, "workload endpoint has no interface name; not programmed");
                continue;
            }
            let admin_up = wep.state == "active";
            let iface = wep.name.clone();
            let mut sets = Vec::new();
            for _ in &self.versions {
                sets.push(endpoint::workload_chains(
                    &self.opts.render,
                    &iface,
                    admin_up,
                    &wep.tiers,
                    &wep.profile_ids,
                ));
            }
            for (v, chains) in self.versions.clone().into_iter().zip(sets) {
                let t = self.table(v, "filter");
                chains.into_iter().for_each(|c| t.set_chain(c));
            }
            self.wep_ifaces.insert(key, iface);
        }
    }

    fn render_hosts(&mut self) {
        for id in std::mem::take(&mut self.dirty_heps) {
            if let Some(old) = self.hep_ifaces.remove(&id) {
                let names: Vec<String> = [
                    endpoint::HOST_TO_PFX,
                    endpoint::HOST_FROM_PFX,
                    endpoint::HOST_TO_FWD_PFX,
                    endpoint::HOST_FROM_FWD_PFX,
                ]
                .iter()
                .map(|p| rules::endpoint_chain_name(p, &old))
                .collect();
                for v in self.versions.clone() {
                    self.remove_everywhere(v, &names);
                }
            }
            let Some(hep) = self.heps.get(&id) else {
                continue;
            };
            let iface = if hep.name.is_empty() || hep.name == "*" {
                ALL_INTERFACES.to_owned()
            } else {
                hep.name.clone()
            };
            let cfg = &self.opts.render;
            let filter = endpoint::host_filter_chains(
                cfg,
                &iface,
                &hep.tiers,
                &hep.forward_tiers,
                &hep.profile_ids,
            );
            let raw = (!hep.untracked_tiers.is_empty())
                .then(|| endpoint::host_raw_chains(cfg, &iface, &hep.untracked_tiers));
            let mangle = (!hep.pre_dnat_tiers.is_empty())
                .then(|| endpoint::host_mangle_chain(cfg, &iface, &hep.pre_dnat_tiers));
            for v in self.versions.clone() {
                let t = self.table(v, "filter");
                filter.iter().cloned().for_each(|c| t.set_chain(c));
                if let Some(raw) = &raw {
                    let t = self.table(v, "raw");
                    raw.iter().cloned().for_each(|c| t.set_chain(c));
                }
                if let Some(m) = &mangle {
                    self.table(v, "mangle").set_chain(m.clone());
                }
            }
            self.hep_ifaces.insert(id, iface);
        }
    }

    fn render_dispatch(&mut self) {
        let wl_ifaces: Vec<String> = self.wep_ifaces.values().cloned().collect();
        let hep_iface = |h: &HostEndpoint| {
            if h.name.is_empty() {
                "*".to_owned()
            } else {
                h.name.clone()
            }
        };
        let all: Vec<String> = self.heps.values().map(hep_iface).collect();
        let untracked: Vec<String> = self
            .heps
            .values()
            .filter(|h| !h.untracked_tiers.is_empty())
            .map(hep_iface)
            .collect();
        let pre_dnat: Vec<String> = self
            .heps
            .values()
            .filter(|h| !h.pre_dnat_tiers.is_empty())
            .map(hep_iface)
            .collect();
        let mut filter: Vec<Chain> = static_chains::workload_dispatch(&wl_ifaces).into();
        filter.extend(static_chains::host_dispatch(&all));
        filter.extend(static_chains::host_forward_dispatch(&all));
        let raw: Vec<Chain> = static_chains::host_dispatch(&untracked).into();
        let [mangle_from, _] = static_chains::host_dispatch(&pre_dnat);
        for v in self.versions.clone() {
            let t = self.table(v, "filter");
            filter.iter().cloned().for_each(|c| t.set_chain(c));
            let t = self.table(v, "raw");
            raw.iter().cloned().for_each(|c| t.set_chain(c));
            self.table(v, "mangle").set_chain(mangle_from.clone());
        }
        self.dispatch_dirty = false;
    }

    fn program(&mut self) -> Result<(), DriverError> {
        if self.backend.is_none() {
            let b = iptables::detect_backend(self.runner.as_mut());
            info!(backend = b.name(), "iptables backend detected");
            self.backend = Some(b);
        }
        let backend = self.backend.expect("resolved above");
        if !self.statics_set {
            self.render_statics();
        }
        self.render_policies();
        self.render_profiles();
        let endpoints_changed = !self.dirty_weps.is_empty() || !self.dirty_heps.is_empty();
        self.render_workloads();
        self.render_hosts();
        if endpoints_changed || self.dispatch_dirty {
            self.render_dispatch();
        }

        let st = self
            .ipsets
            .apply_updates(self.runner.as_mut())
            .map_err(|e| DriverError::Other(e.to_string()))?;
        if st != Default::default() {
            debug!(?st, "ipsets updated");
        }
        // Read back every table that needs it before writing any: one save per family, and
        // while the kernel is still small (an nft save costs as much as the whole ruleset).
        for v in self.versions.clone() {
            if self
                .tables
                .iter()
                .any(|t| t.version() == v && t.needs_read_back())
            {
                let text = iptables::save_all(self.runner.as_mut(), backend, v)
                    .map_err(|e| DriverError::Other(e.to_string()))?;
                for t in self
                    .tables
                    .iter_mut()
                    .filter(|t| t.version() == v && t.needs_read_back())
                {
                    t.load_kernel_view(&text);
                }
            }
        }
        let mut first_error = None;
        for t in &mut self.tables {
            match t.apply(self.runner.as_mut(), backend) {
                Ok(s) if s != Default::default() => {
                    debug!(
                        table = t.name(),
                        v = t.version().number(),
                        ?s,
                        "table programmed"
                    );
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(table = t.name(), v = t.version().number(), error = %e, "table not programmed");
                    first_error.get_or_insert(e.to_string());
                }
            }
        }
        if let Some(e) = first_error {
            return Err(DriverError::Other(e));
        }
        let destroyed = self
            .ipsets
            .apply_deletions(self.runner.as_mut())
            .map_err(|e| DriverError::Other(e.to_string()))?;
        if destroyed > 0 {
            debug!(destroyed, "unused ipsets destroyed");
        }
        Ok(())
    }
}

impl Driver for LinuxDriver {
    fn on_update(&mut self, msg: &ToDataplane) {
        let Some(payload) = &msg.payload else {
            return;
        };
        match payload {
            Payload::IpsetUpdate(u) => {
                self.ipsets
                    .replace(&u.id, SetKind::from_proto(u.r#type), &u.members);
            }
            Payload::IpsetDeltaUpdate(u) => {
                self.ipsets
                    .delta(&u.id, &u.added_members, &u.removed_members);
            }
            Payload::IpsetRemove(u) => self.ipsets.remove(&u.id),
            Payload::ActivePolicyUpdate(u) => {
                let (Some(id), Some(p)) = (&u.id, &u.policy) else {
                    return;
                };
                let k = policy_key(id);
                self.policies.insert(k.clone(), p.clone());
                self.dirty_policies.insert(k);
            }
            Payload::ActivePolicyRemove(u) => {
                if let Some(id) = &u.id {
                    let k = policy_key(id);
                    self.policies.remove(&k);
                    self.dirty_policies.insert(k);
                }
            }
            Payload::ActiveProfileUpdate(u) => {
                let (Some(id), Some(p)) = (&u.id, &u.profile) else {
                    return;
                };
                self.profiles.insert(id.name.clone(), p.clone());
                self.dirty_profiles.insert(id.name.clone());
            }
            Payload::ActiveProfileRemove(u) => {
                if let Some(id) = &u.id {
                    self.profiles.remove(&id.name);
                    self.dirty_profiles.insert(id.name.clone());
                }
            }
            Payload::WorkloadEndpointUpdate(u) => {
                let key = WorkloadEndpointKey::from_proto(u.id.as_ref());
                if let Some(ep) = &u.endpoint {
                    self.weps.insert(key.clone(), ep.clone());
                    self.dirty_weps.insert(key);
                }
            }
            Payload::WorkloadEndpointRemove(u) => {
                let key = WorkloadEndpointKey::from_proto(u.id.as_ref());
                self.weps.remove(&key);
                self.dirty_weps.insert(key);
            }
            Payload::HostEndpointUpdate(u) => {
                let id =
                    u.id.as_ref()
                        .map(|i| i.endpoint_id.clone())
                        .unwrap_or_default();
                if let Some(ep) = &u.endpoint {
                    self.heps.insert(id.clone(), ep.clone());
                    self.dirty_heps.insert(id);
                }
            }
            Payload::HostEndpointRemove(u) => {
                let id =
                    u.id.as_ref()
                        .map(|i| i.endpoint_id.clone())
                        .unwrap_or_default();
                self.heps.remove(&id);
                self.dirty_heps.insert(id);
            }
            _ => {}
        }
    }

    fn apply(&mut self) -> Result<(), DriverError> {
        match self.program() {
            Ok(()) => {
                self.last_error = None;
                self.programmed_weps = self.weps.keys().cloned().collect();
                Ok(())
            }
            Err(e) => {
                self.last_error = Some(e.to_string());
                Err(e)
            }
        }
    }

    fn endpoint_statuses(&self) -> EndpointStatuses {
        let mut out = EndpointStatuses::default();
        for (key, wep) in &self.weps {
            let status = if !self.programmed_weps.contains(key) {
                if self.last_error.is_some() {
                    "error"
                } else {
                    "down"
                }
            } else if wep.state == "active" {
                "up"
            } else {
                "down"
            };
            out.workloads.insert(key.clone(), status.to_owned());
        }
        for id in self.heps.keys() {
            let status = if self.last_error.is_some() && self.dirty_heps.contains(id) {
                "error"
            } else {
                "up"
            };
            out.hosts.insert(id.clone(), status.to_owned());
        }
        out
    }

    fn workload_endpoint(&self, id: &WorkloadEndpointKey) -> Option<WorkloadEndpoint> {
        self.weps.get(id).cloned()
    }

    fn refresh_interval(&self) -> Option<Duration> {
        Some(self.opts.refresh_interval)
    }

    fn request_refresh(&mut self) {
        for t in &mut self.tables {
            t.invalidate();
        }
        self.ipsets.invalidate();
    }
}
