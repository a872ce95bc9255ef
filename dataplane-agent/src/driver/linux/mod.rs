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

#[cfg(test)]
mod tests {
    use super::fake::FakeKernel;
    use super::*;
    use felix_proto::{
        ActivePolicyRemove, ActivePolicyUpdate, IpSetUpdate, PolicyId, Rule, TierInfo,
        WorkloadEndpointId, WorkloadEndpointRemove, WorkloadEndpointUpdate,
    };
    use std::sync::{Arc, Mutex};

    /// A runner over a shared fake kernel, so the test can look at it while the driver owns
    /// the runner.
    #[derive(Clone)]
    struct Shared(Arc<Mutex<FakeKernel>>);

    impl CommandRunner for Shared {
        fn run(
            &mut self,
            program: &str,
            args: &[&str],
            stdin: Option<&[u8]>,
        ) -> std::io::Result<runner::Output> {
            self.0.lock().unwrap().run(program, args, stdin)
        }
    }

    fn msg(p: Payload) -> ToDataplane {
        ToDataplane {
            sequence_number: 1,
            payload: Some(p),
        }
    }

    fn pol_id() -> PolicyId {
        PolicyId {
            name: "web".into(),
            namespace: "prod".into(),
            kind: "NetworkPolicy".into(),
        }
    }

    fn policy(untracked: bool) -> ToDataplane {
        msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pol_id()),
            policy: Some(Policy {
                inbound_rules: vec![Rule {
                    action: "allow".into(),
                    src_ip_set_ids: vec!["s:clients".into()],
                    ..Default::default()
                }],
                untracked,
                ..Default::default()
            }),
        }))
    }

    fn wep_id() -> WorkloadEndpointId {
        WorkloadEndpointId {
            orchestrator_id: "k8s".into(),
            workload_id: "prod/web".into(),
            endpoint_id: "eth0".into(),
        }
    }

    fn wep(iface: &str) -> ToDataplane {
        msg(Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
            id: Some(wep_id()),
            endpoint: Some(WorkloadEndpoint {
                state: "active".into(),
                name: iface.into(),
                ipv4_nets: vec!["10.65.0.2/32".into()],
                tiers: vec![TierInfo {
                    name: "default".into(),
                    ingress_policies: vec![pol_id()],
                    egress_policies: vec![],
                    default_action: "Deny".into(),
                }],
                ..Default::default()
            }),
        }))
    }

    fn driver() -> (LinuxDriver, Arc<Mutex<FakeKernel>>) {
        let kernel = Arc::new(Mutex::new(FakeKernel::new()));
        let opts = LinuxOptions {
            backend: Backend::Nft,
            ..LinuxOptions::default()
        };
        (
            LinuxDriver::new(opts, Box::new(Shared(kernel.clone()))),
            kernel,
        )
    }

    #[test]
    fn programs_endpoints_policies_and_sets_then_cleans_up() {
        let (mut d, k) = driver();
        d.on_update(&msg(Payload::IpsetUpdate(IpSetUpdate {
            id: "s:clients".into(),
            members: vec!["10.65.0.1/32".into(), "fd00::1/128".into()],
            r#type: 2,
        })));
        d.on_update(&policy(false));
        d.on_update(&wep("caliweb"));
        d.apply().unwrap();
        {
            let k = k.lock().unwrap();
            let v4 = IpVersion::V4;
            assert!(k.has_chain(v4, "filter", "cali-pi-np/prod/web"));
            assert!(k.has_chain(v4, "filter", "cali-tw-caliweb"));
            assert!(k.has_chain(IpVersion::V6, "filter", "cali-tw-caliweb"));
            let dispatch = k.chain_rules(v4, "filter", "cali-to-wl-dispatch");
            assert!(dispatch[0].contains("--out-interface caliweb --goto cali-tw-caliweb"));
            assert!(dispatch.last().unwrap().contains("Unknown interface"));
            assert_eq!(k.set("cali40s:clients").unwrap().members.len(), 1);
            assert_eq!(k.set("cali60s:clients").unwrap().members.len(), 1);
        }
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["up"]
        );

        // The interface is renamed: old chains go, new ones come, dispatch follows.
        d.on_update(&wep("caliweb2"));
        d.apply().unwrap();
        {
            let k = k.lock().unwrap();
            assert!(!k.has_chain(IpVersion::V4, "filter", "cali-tw-caliweb"));
            assert!(k.has_chain(IpVersion::V4, "filter", "cali-tw-caliweb2"));
        }

        // An untracked policy moves to the raw table (workloads never use untracked policy: the
        // server sends the endpoint without it in the same batch).
        d.on_update(&policy(true));
        d.on_update(&msg(Payload::WorkloadEndpointUpdate(
            WorkloadEndpointUpdate {
                id: Some(wep_id()),
                endpoint: Some(WorkloadEndpoint {
                    state: "active".into(),
                    name: "caliweb2".into(),
                    ..Default::default()
                }),
            },
        )));
        d.apply().unwrap();
        {
            let k = k.lock().unwrap();
            assert!(!k.has_chain(IpVersion::V4, "filter", "cali-pi-np/prod/web"));
            assert!(k.has_chain(IpVersion::V4, "raw", "cali-pi-np/prod/web"));
        }

        // Everything removed: our chains and sets go; the hooks and static chains stay.
        d.on_update(&msg(Payload::WorkloadEndpointRemove(
            WorkloadEndpointRemove { id: Some(wep_id()) },
        )));
        d.on_update(&msg(Payload::ActivePolicyRemove(ActivePolicyRemove {
            id: Some(pol_id()),
        })));
        d.on_update(&msg(Payload::IpsetRemove(felix_proto::IpSetRemove {
            id: "s:clients".into(),
        })));
        d.apply().unwrap();
        let k = k.lock().unwrap();
        let chains = k.chain_names(IpVersion::V4, "filter");
        assert!(
            !chains
                .iter()
                .any(|c| c.starts_with("cali-tw-") || c.starts_with("cali-pi-")),
            "{chains:?}"
        );
        assert!(!k.has_chain(IpVersion::V4, "raw", "cali-pi-np/prod/web"));
        assert!(k.set_names().is_empty());
        assert!(k.chain_rules(IpVersion::V4, "filter", "FORWARD")[0].contains("cali-FORWARD"));
        assert!(d.endpoint_statuses().workloads.is_empty());
    }

    #[test]
    fn a_failed_apply_reports_error_and_the_retry_converges() {
        let (mut d, k) = driver();
        d.on_update(&policy(false));
        d.on_update(&wep("caliweb"));
        k.lock().unwrap().fail_restores =
            Some("Another app is currently holding the xtables lock".into());
        let err = d.apply().unwrap_err().to_string();
        assert!(err.contains("xtables lock"), "{err}");
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["error"]
        );
        k.lock().unwrap().fail_restores = None;
        d.apply().unwrap();
        assert!(
            k.lock()
                .unwrap()
                .has_chain(IpVersion::V4, "filter", "cali-tw-caliweb")
        );
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["up"]
        );
        // Nothing to do: no restore at all.
        let calls = k.lock().unwrap().restore_calls();
        d.apply().unwrap();
        assert_eq!(k.lock().unwrap().restore_calls(), calls);
        // A refresh reads back (saves) but, with nothing changed, writes nothing.
        d.request_refresh();
        d.apply().unwrap();
        assert_eq!(k.lock().unwrap().restore_calls(), calls);
    }
}
