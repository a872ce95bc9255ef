//! The Linux driver: programs iptables (legacy or nft backend) and ipsets in Calico's layout.
//!
//! `on_update` records the desired state and marks what changed; `apply` renders only the
//! changed policies, profiles and endpoints into chains, then programs in Felix's order: IP sets
//! created and updated, then the tables (one `iptables-restore` per changed table), then unused
//! IP sets destroyed. Every table and the sets keep a view of the kernel and write only
//! differences; `request_refresh` drops those views so the next apply reads the kernel back and
//! repairs out-of-band changes. All IO goes through a [`runner::CommandRunner`].

pub mod config;
pub mod fake;
pub mod interfaces;
pub mod ipsets;
pub mod iptables;
pub mod netlink;
pub mod routes;
pub mod rules;
pub mod runner;
pub mod sysctl;
pub mod validate;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use felix_proto::{HostEndpoint, Policy, Profile, WorkloadEndpoint};
use tracing::{debug, info, warn};

use self::interfaces::Interfaces;
use self::ipsets::{IpSets, SetKind};
use self::iptables::{Backend, Table};
use self::netlink::Netlink;
use self::routes::Routes;
use self::rules::endpoint::{self, ALL_INTERFACES};
use self::rules::policy::{self, RenderConfig};
use self::rules::static_chains::{self, StaticConfig};
use self::rules::{Chain, IpVersion};
use self::runner::CommandRunner;
use self::sysctl::Sysctl;
use super::{Driver, DriverError, EndpointStatuses, WorkloadEndpointKey};
use crate::message::{HostEndpointKey, IpamPoolId, Message, PolicyKey, ProfileKey};

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
    /// Program workload routes, neighbours and interface sysctls, and watch interfaces.
    pub manage_routes: bool,
    /// The route protocol number our routes carry (how we recognise them).
    pub route_protocol: u8,
    /// Felix setting names given explicitly (flag or environment): the datastore's
    /// FelixConfiguration does not override them.
    pub pinned: std::collections::BTreeSet<String>,
    /// Felix's `FeatureDetectOverride` for `MASQFullyRandom`: `None` detects it.
    pub masq_fully_random: Option<bool>,
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
            manage_routes: true,
            route_protocol: 80,
            pinned: Default::default(),
            masq_fully_random: None,
        }
    }
}

/// A rule that denies everything.
fn deny_all() -> felix_proto::Rule {
    felix_proto::Rule {
        action: "deny".to_owned(),
        ..Default::default()
    }
}

/// What a refused policy is programmed as: its place in the tiers is kept, but whatever
/// reaches it is denied, so a policy we cannot render never lets traffic through.
fn fail_closed_policy(p: &felix_proto::Policy) -> felix_proto::Policy {
    felix_proto::Policy {
        inbound_rules: vec![deny_all()],
        outbound_rules: vec![deny_all()],
        untracked: p.untracked,
        pre_dnat: p.pre_dnat,
        ..Default::default()
    }
}

const TABLE_NAMES: [&str; 4] = ["filter", "raw", "mangle", "nat"];

/// Agent-local IP sets of IPAM pools (for natOutgoing), named as Calico 3.34 names them:
/// the natOutgoing pools, and the pools workloads and tunnels use (Calico 3.31 and older called
/// the second `all-ipam-pools` and put LoadBalancer-only pools in it too).
const MASQ_POOLS_SET: &str = "masq-ipam-pools";
const NETWORK_POOLS_SET: &str = "network-ip-pools";

/// Totals of what is programmed, for logs and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    pub rules: usize,
    pub ipsets: usize,
    pub ipset_members: usize,
    pub routes: usize,
}

/// Programs iptables and ipsets.
pub struct LinuxDriver {
    /// The options in force (flags and defaults, with datastore settings applied).
    opts: LinuxOptions,
    /// The options from flags and defaults alone.
    base_opts: LinuxOptions,
    /// The last FelixConfiguration map from the server, not yet applied.
    pending_config: Option<BTreeMap<String, String>>,
    /// The FelixConfiguration settings last reported as not applied.
    config_not_applied: Option<String>,
    runner: Box<dyn CommandRunner>,
    backend: Option<Backend>,
    /// Whether iptables and the kernel take `MASQUERADE --random-fully`; `None` until it is
    /// detected, with the backend, at the first apply.
    random_fully_supported: Option<bool>,
    versions: Vec<IpVersion>,
    ipsets: IpSets,
    tables: Vec<Table>,
    statics_set: bool,

    policies: HashMap<PolicyKey, Policy>,
    dirty_policies: HashSet<PolicyKey>,
    profiles: HashMap<ProfileKey, Profile>,
    dirty_profiles: HashSet<ProfileKey>,
    weps: BTreeMap<WorkloadEndpointKey, WorkloadEndpoint>,
    dirty_weps: HashSet<WorkloadEndpointKey>,
    /// Interface each workload's chains were rendered for.
    wep_ifaces: HashMap<WorkloadEndpointKey, String>,
    heps: BTreeMap<HostEndpointKey, HostEndpoint>,
    dirty_heps: HashSet<HostEndpointKey>,
    /// Normal policies and profiles some host endpoint uses for egress: their outbound chains
    /// are also in the mangle table, for DNAT'd host traffic (Felix puts every policy in every
    /// table and programs what is used; we place only what is used).
    mangle_policies: HashSet<PolicyKey>,
    mangle_profiles: HashSet<ProfileKey>,
    hep_ifaces: HashMap<HostEndpointKey, String>,
    dispatch_dirty: bool,

    /// Endpoints whose chains are in the kernel as last rendered.
    programmed_weps: HashSet<WorkloadEndpointKey>,
    /// Set when the last apply failed (endpoints changed since then report "error").
    last_error: Option<String>,

    pools: BTreeMap<IpamPoolId, felix_proto::IpamPool>,
    pools_dirty: bool,

    /// Interfaces as the monitor sees them.
    ifaces: Arc<Interfaces>,
    /// Spawn the rtnetlink monitor and connect netlink at the first apply (false when seams
    /// were injected).
    start_netlink: bool,
    netlink: Option<Box<dyn Netlink>>,
    sysctl: Box<dyn Sysctl>,
    routes: Routes,
    /// Interfaces already given Calico's sysctls: name → ifindex at the time.
    configured_ifaces: HashMap<String, u32>,
    neighbours: HashSet<(u32, IpAddr, [u8; 6])>,
    globals_set: bool,

    /// Objects from the stream refused by `validate`, "<kind> <key>" → reason. Each is held
    /// failing closed (see `on_update`) until a valid version arrives or it is removed.
    rejected: BTreeMap<String, String>,
    /// Policies and profiles held failing closed because an IP set they use is unknown or
    /// poisoned, "<kind> <key>" → reason (kept apart from `rejected`: it clears on its own
    /// once the set is programmed as sent).
    set_refused: BTreeMap<String, String>,
    /// Objects some of whose chains the kernel refused, "<kind> <key>" → reason (rebuilt after
    /// every table apply from [`Table::refused`]; those chains fail closed).
    kernel_refused: BTreeMap<String, String>,
    /// Kernel names of the IP sets the kernel refused at the last apply.
    refused_sets: BTreeSet<String>,
    /// IP sets some of whose members were refused: policies that use one fail closed.
    poisoned_sets: HashSet<String>,
    /// Interfaces refused at programming time (host addresses on them), to warn once.
    refused_ifaces: HashSet<String>,
    /// Endpoints refused by `validate` (reported as "error"), kept to check again when the
    /// workload prefixes change.
    rejected_weps: BTreeMap<WorkloadEndpointKey, WorkloadEndpoint>,
    rejected_heps: HashSet<HostEndpointKey>,
}

impl LinuxDriver {
    pub fn new(opts: LinuxOptions, runner: Box<dyn CommandRunner>) -> Self {
        let mut d = Self::with_seams(
            opts,
            runner,
            None,
            Box::new(sysctl::ProcSysctl),
            Interfaces::new(),
        );
        d.start_netlink = d.opts.manage_routes;
        d
    }

    /// A driver over injected seams (tests): no monitor is spawned; `ifaces` is fed by the
    /// caller and `netlink` used as is.
    pub fn with_seams(
        opts: LinuxOptions,
        runner: Box<dyn CommandRunner>,
        netlink: Option<Box<dyn Netlink>>,
        sysctl: Box<dyn Sysctl>,
        ifaces: Arc<Interfaces>,
    ) -> Self {
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
        let route_protocol = opts.route_protocol;
        let route_versions = versions.clone();
        Self {
            ipsets: IpSets::new(versions.clone()),
            base_opts: opts.clone(),
            pending_config: None,
            config_not_applied: None,
            opts,
            runner,
            backend,
            random_fully_supported: None,
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
            mangle_policies: HashSet::new(),
            mangle_profiles: HashSet::new(),
            hep_ifaces: HashMap::new(),
            dispatch_dirty: true,
            programmed_weps: HashSet::new(),
            last_error: None,
            pools: BTreeMap::new(),
            pools_dirty: true,
            ifaces,
            start_netlink: false,
            routes: Routes::new(route_protocol, route_versions),
            netlink,
            sysctl,
            configured_ifaces: HashMap::new(),
            neighbours: HashSet::new(),
            globals_set: false,
            rejected: BTreeMap::new(),
            set_refused: BTreeMap::new(),
            kernel_refused: BTreeMap::new(),
            refused_sets: BTreeSet::new(),
            poisoned_sets: HashSet::new(),
            refused_ifaces: HashSet::new(),
            rejected_weps: BTreeMap::new(),
            rejected_heps: HashSet::new(),
        }
    }

    /// What is programmed (desired state after the last apply).
    pub fn programmed(&self) -> Programmed {
        let (ipsets, ipset_members) = self.ipsets.counts();
        Programmed {
            rules: self.tables.iter().map(Table::rule_count).sum(),
            ipsets,
            ipset_members,
            routes: self.routes.count(),
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
            let (chains, hooks) = static_chains::raw(&self.opts.statics, v);
            let t = self.table(v, "raw");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
            let (chains, hooks) = static_chains::mangle(&self.opts.statics, v);
            let t = self.table(v, "mangle");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
            let fully_random = self.masq_fully_random();
            let active = self
                .pools
                .values()
                .any(|p| p.masquerade && v.matches(&p.cidr));
            let (chains, hooks) = static_chains::nat(
                &rules::ipset_name(v, MASQ_POOLS_SET),
                &rules::ipset_name(v, NETWORK_POOLS_SET),
                active,
                fully_random,
            );
            let t = self.table(v, "nat");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
        }
        self.statics_set = true;
    }

    /// Writes every table; the first error, after trying them all.
    fn apply_tables(&mut self, backend: Backend) -> Option<String> {
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
        first_error
    }

    fn rename_set_in_tables(&mut self, v: IpVersion, from: &str, to: &str) {
        for t in self.tables.iter_mut().filter(|t| t.version() == v) {
            t.rename_set(from, to);
        }
    }

    /// MASQUERADE gets `--random-fully` where supported, unless the operator says otherwise.
    fn masq_fully_random(&self) -> bool {
        self.opts
            .masq_fully_random
            .or(self.random_fully_supported)
            .unwrap_or(false)
    }

    fn remove_everywhere(&mut self, v: IpVersion, names: &[String]) {
        for t in self.tables.iter_mut().filter(|t| t.version() == v) {
            for n in names {
                t.remove_chain(n);
            }
        }
    }

    /// Takes a workload endpoint from the stream, or again after the prefixes changed: checked
    /// against the prefixes in force, then programmed or refused.
    fn take_workload(&mut self, key: WorkloadEndpointKey, ep: WorkloadEndpoint) {
        let what = format!("workload endpoint {key}");
        match validate::workload_endpoint(&ep, &self.opts.statics.workload_prefixes) {
            Ok(()) => {
                self.accept(&what);
                self.rejected_weps.remove(&key);
                if self.weps.get(&key) != Some(&ep) {
                    self.weps.insert(key.clone(), ep);
                    self.dirty_weps.insert(key);
                }
            }
            Err(e) => {
                // Failing closed: without its chains and dispatch entry the interface is
                // unknown, and traffic on an unknown workload interface drops.
                self.reject(what, e.to_string());
                self.rejected_weps.insert(key.clone(), ep);
                self.weps.remove(&key);
                self.dirty_weps.insert(key);
            }
        }
    }

    /// Records that the stream sent something this agent will not program as sent.
    fn reject(&mut self, what: String, reason: String) {
        warn!(object = %what, %reason, "refused an object from the calc-server; failing closed for it");
        self.rejected.insert(what, reason);
    }

    /// A valid version of `what` arrived (or it went away): no longer refused.
    fn accept(&mut self, what: &str) {
        if self.rejected.remove(what).is_some() {
            info!(object = %what, "object from the calc-server is valid again");
        }
    }

    /// After an IP set's members were checked: a set with refused members is poisoned, and the
    /// policies and profiles that use it fail closed until a full update comes back clean.
    fn members_checked(&mut self, id: &str, what: String, refused: Vec<String>, full: bool) {
        if !refused.is_empty() {
            let reason = format!(
                "{} member(s) refused: {}",
                refused.len(),
                refused.join("; ")
            );
            self.reject(what, reason);
            if self.poisoned_sets.insert(id.to_owned()) {
                self.dirty_users_of_set(id);
            }
        } else if full {
            self.accept(&what);
            if self.poisoned_sets.remove(id) {
                self.dirty_users_of_set(id);
            }
        }
    }

    /// Marks for re-rendering every policy and profile whose rules name the set.
    fn dirty_users_of_set(&mut self, id: &str) {
        self.dirty_users_of_sets(|i| i == id);
    }

    /// Marks the policies and profiles that use a set `affected` says yes to for re-rendering.
    fn dirty_users_of_sets(&mut self, affected: impl Fn(&str) -> bool) {
        let uses = |rules: &[felix_proto::Rule]| {
            rules.iter().any(|r| {
                validate::rule_set_ids(r)
                    .iter()
                    .any(|(_, ids)| ids.iter().any(|i| affected(i)))
            })
        };
        for (k, p) in &self.policies {
            if uses(&p.inbound_rules) || uses(&p.outbound_rules) {
                self.dirty_policies.insert(k.clone());
            }
        }
        for (k, p) in &self.profiles {
            if uses(&p.inbound_rules) || uses(&p.outbound_rules) {
                self.dirty_profiles.insert(k.clone());
            }
        }
    }

    /// Whether every IP set the rules name is programmed as sent (known and not poisoned).
    /// Records a refusal of `what` when not, and clears an earlier one of this kind when so;
    /// a refusal from `validate` on receipt is kept apart and left alone.
    fn sets_usable(
        &mut self,
        what: String,
        inbound: &[felix_proto::Rule],
        outbound: &[felix_proto::Rule],
    ) -> bool {
        let unusable = inbound.iter().chain(outbound).find_map(|r| {
            validate::rule_set_ids(r).into_iter().find_map(|(_, ids)| {
                ids.iter().find(|i| {
                    self.poisoned_sets.contains(*i)
                        || !self.ipsets.contains(i)
                        || self.ipsets.is_refused(i)
                })
            })
        });
        match unusable {
            Some(set) => {
                let reason = format!("uses IP set {set:?}, which was refused or never sent");
                if self.set_refused.get(&what) != Some(&reason) {
                    warn!(object = %what, %reason, "refused an object from the calc-server; failing closed for it");
                    self.set_refused.insert(what, reason);
                }
                false
            }
            None => {
                if self.set_refused.remove(&what).is_some() {
                    info!(object = %what, "the IP sets it uses are programmed again");
                }
                true
            }
        }
    }

    /// Objects refused, "<kind> <key>" → reason: on receipt, for the IP sets they use, or by
    /// the kernel.
    pub fn rejected(&self) -> BTreeMap<String, String> {
        let mut all = self.rejected.clone();
        for (k, v) in self.set_refused.iter().chain(&self.kernel_refused) {
            all.entry(k.clone()).or_insert_with(|| v.clone());
        }
        all
    }

    /// Recomputes which policies and profiles host endpoint egress uses, and marks the ones
    /// that joined or left that set for re-rendering.
    fn refresh_mangle_refs(&mut self) {
        let policies: HashSet<PolicyKey> = self
            .heps
            .values()
            .flat_map(|h| h.tiers.iter().flat_map(|t| &t.egress_policies))
            .map(PolicyKey::from)
            .collect();
        let profiles: HashSet<ProfileKey> = self
            .heps
            .values()
            .flat_map(|h| h.profile_ids.iter().map(ProfileKey::new))
            .collect();
        self.dirty_policies.extend(
            policies
                .symmetric_difference(&self.mangle_policies)
                .cloned(),
        );
        self.dirty_profiles.extend(
            profiles
                .symmetric_difference(&self.mangle_profiles)
                .cloned(),
        );
        self.mangle_policies = policies;
        self.mangle_profiles = profiles;
    }

    fn render_policies(&mut self) {
        for key in std::mem::take(&mut self.dirty_policies) {
            let id = key.to_proto();
            let names = [
                rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &id),
                rules::policy_chain_name(rules::POLICY_OUTBOUND_PFX, &id),
            ];
            let what = format!("policy {}", rules::policy_id_string(&id));
            let p = self.policies.get(&key).cloned();
            if p.is_none() {
                self.set_refused.remove(&what);
            }
            let p = p.map(|p| {
                if self.sets_usable(what.clone(), &p.inbound_rules, &p.outbound_rules) {
                    p
                } else {
                    fail_closed_policy(&p)
                }
            });
            for v in self.versions.clone() {
                self.remove_everywhere(v, &names);
                let Some(p) = &p else {
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
                if table == "filter" && self.mangle_policies.contains(&key) {
                    let t = self.table(v, "mangle");
                    chains
                        .iter()
                        .filter(|c| c.name.starts_with(rules::POLICY_OUTBOUND_PFX))
                        .for_each(|c| t.set_owned_chain(c.clone(), &what));
                }
                let t = self.table(v, table);
                chains.into_iter().for_each(|c| t.set_owned_chain(c, &what));
            }
        }
    }

    fn render_profiles(&mut self) {
        for name in std::mem::take(&mut self.dirty_profiles) {
            let names = [
                rules::profile_chain_name(rules::PROFILE_INBOUND_PFX, name.as_str()),
                rules::profile_chain_name(rules::PROFILE_OUTBOUND_PFX, name.as_str()),
            ];
            let what = format!("profile {name:?}");
            let p = self.profiles.get(&name).cloned();
            if p.is_none() {
                self.set_refused.remove(&what);
            }
            let p = p.map(|p| {
                if self.sets_usable(what.clone(), &p.inbound_rules, &p.outbound_rules) {
                    p
                } else {
                    felix_proto::Profile {
                        inbound_rules: vec![deny_all()],
                        outbound_rules: vec![deny_all()],
                    }
                }
            });
            for v in self.versions.clone() {
                self.remove_everywhere(v, &names);
                let Some(p) = &p else {
                    continue;
                };
                let chains = policy::profile_chains(&self.opts.render, name.as_str(), p, v);
                if self.mangle_profiles.contains(&name) {
                    let t = self.table(v, "mangle");
                    chains
                        .iter()
                        .filter(|c| c.name.starts_with(rules::PROFILE_OUTBOUND_PFX))
                        .for_each(|c| t.set_owned_chain(c.clone(), &what));
                }
                let t = self.table(v, "filter");
                chains.into_iter().for_each(|c| t.set_owned_chain(c, &what));
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
            // The chains do not depend on the family: render once, program in each.
            let chains = endpoint::workload_chains(
                &self.opts.render,
                &iface,
                admin_up,
                &wep.tiers,
                &wep.profile_ids,
            );
            let what = format!("workload endpoint {key}");
            for v in self.versions.clone() {
                let t = self.table(v, "filter");
                chains
                    .iter()
                    .cloned()
                    .for_each(|c| t.set_owned_chain(c, &what));
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
            let Some(iface) = self.hep_iface(hep) else {
                debug!(host_endpoint = %id, "no interface holds the host endpoint's addresses yet");
                continue;
            };
            let cfg = &self.opts.render;
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
            for v in self.versions.clone() {
                let t = self.table(v, "filter");
                filter
                    .iter()
                    .cloned()
                    .for_each(|c| t.set_owned_chain(c, &what));
                if let Some(raw) = &raw {
                    let t = self.table(v, "raw");
                    raw.iter()
                        .cloned()
                        .for_each(|c| t.set_owned_chain(c, &what));
                }
                let t = self.table(v, "mangle");
                if let Some(m) = &mangle {
                    t.set_owned_chain(m.clone(), &what);
                }
                t.set_owned_chain(mangle_egress.clone(), &what);
            }
            self.hep_ifaces.insert(id, iface);
        }
    }

    fn render_dispatch(&mut self) {
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
        let mangle_to =
            static_chains::host_to_dispatch_for_mangle(&all, &self.opts.statics.workload_prefixes);
        filter.extend(static_chains::host_forward_dispatch(&all));
        let raw: Vec<Chain> = static_chains::host_dispatch(&untracked).into();
        let [mangle_from, _] = static_chains::host_dispatch(&pre_dnat);
        for v in self.versions.clone() {
            let t = self.table(v, "filter");
            filter.iter().cloned().for_each(|c| t.set_chain(c));
            let t = self.table(v, "raw");
            raw.iter().cloned().for_each(|c| t.set_chain(c));
            let t = self.table(v, "mangle");
            t.set_chain(mangle_from.clone());
            // DNAT'd host traffic meets host endpoint egress policy in mangle POSTROUTING.
            t.set_chain(mangle_to.clone());
        }
        self.dispatch_dirty = false;
    }

    /// The pool sets, and the nat chains whose MASQUERADE rule exists only while a family has
    /// a natOutgoing pool (as Felix renders it).
    fn render_pools(&mut self) {
        // A pool only LoadBalancer addresses come from is outside the network: traffic to it
        // from a natOutgoing pool is masqueraded.
        let network: Vec<String> = self
            .pools
            .values()
            .filter(|p| {
                p.allowed_uses.is_empty() || p.allowed_uses.iter().any(|u| u != "LoadBalancer")
            })
            .map(|p| p.cidr.clone())
            .collect();
        let masq: Vec<String> = self
            .pools
            .values()
            .filter(|p| p.masquerade)
            .map(|p| p.cidr.clone())
            .collect();
        self.ipsets
            .replace(NETWORK_POOLS_SET, SetKind::Net, &network);
        self.ipsets.replace(MASQ_POOLS_SET, SetKind::Net, &masq);
        self.statics_set = false;
        self.pools_dirty = false;
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

    /// Starts the interface monitor and opens netlink (once, inside the runtime).
    fn ensure_netlink(&mut self) -> Result<(), DriverError> {
        if !self.start_netlink {
            return Ok(());
        }
        interfaces::spawn_monitor(self.ifaces.clone())
            .map_err(|e| DriverError::Other(format!("interface monitor: {e}")))?;
        self.netlink = Some(Box::new(
            netlink::RtNetlink::connect()
                .map_err(|e| DriverError::Other(format!("netlink: {e}")))?,
        ));
        self.start_netlink = false;
        Ok(())
    }

    /// Routes, neighbours and interface sysctls for the workloads whose interfaces are up.
    fn program_routes(&mut self) -> Result<(), DriverError> {
        let Some(nl) = self.netlink.as_mut() else {
            return Ok(());
        };
        // Until the monitor's first dump we do not know which interfaces exist: changing
        // nothing is better than deleting every route.
        if !self.ifaces.is_ready() {
            return Ok(());
        }
        if !self.globals_set {
            let mut globals = vec![("net/ipv4/ip_forward", "1")];
            if self.opts.ipv6 {
                globals.push(("net/ipv6/conf/all/forwarding", "1"));
            }
            for (k, v) in globals {
                if let Err(error) = self.sysctl.write(k, v) {
                    warn!(%error, key = k, "cannot set sysctl");
                }
            }
            self.globals_set = true;
        }
        let mut desired = std::collections::BTreeSet::new();
        let mut present = HashSet::new();
        for wep in self.weps.values() {
            let Some(link) = self.ifaces.get(&wep.name) else {
                continue;
            };
            // Checked on receipt too; here against the prefixes in force now, and against the
            // interface itself: one holding host addresses or the default route is the
            // host's, never a workload's.
            let refusal = validate::workload_interface(
                "name",
                &wep.name,
                &self.opts.statics.workload_prefixes,
            )
            .map_err(|e| e.to_string())
            .err()
            .or_else(|| {
                self.ifaces
                    .host_interface_reason(link.index)
                    .map(str::to_owned)
            });
            if let Some(reason) = refusal {
                if self.refused_ifaces.insert(wep.name.clone()) {
                    warn!(iface = %wep.name, %reason, "not configuring this interface for a workload: no sysctls, routes or neighbours");
                }
                continue;
            }
            self.refused_ifaces.remove(&wep.name);
            present.insert(wep.name.clone());
            if self.configured_ifaces.get(&wep.name) != Some(&link.index) {
                for (k, v) in sysctl::workload_interface_settings(&wep.name, self.opts.ipv6) {
                    if let Err(error) = self.sysctl.write(&k, v) {
                        warn!(%error, iface = %wep.name, "cannot configure workload interface");
                    }
                }
                self.configured_ifaces.insert(wep.name.clone(), link.index);
            }
            let mac = validate::parse_mac(&wep.mac);
            let nets = wep.ipv4_nets.iter().chain(if self.opts.ipv6 {
                &wep.ipv6_nets[..]
            } else {
                &[]
            });
            for net in nets {
                let Some(ip) = net.split('/').next().and_then(|a| a.parse::<IpAddr>().ok()) else {
                    warn!(net = %net, iface = %wep.name, "unparsable endpoint address; no route");
                    continue;
                };
                if link.oper_up {
                    desired.insert(netlink::RouteEntry {
                        dst: ip,
                        prefix: if ip.is_ipv4() { 32 } else { 128 },
                        ifindex: link.index,
                    });
                }
                if let Some(mac) = mac
                    && self.neighbours.insert((link.index, ip, mac))
                    && let Err(error) = nl.set_neighbour(link.index, ip, mac)
                {
                    warn!(%error, %ip, iface = %wep.name, "cannot set static neighbour");
                    self.neighbours.remove(&(link.index, ip, mac));
                }
            }
        }
        self.configured_ifaces.retain(|n, _| present.contains(n));
        let st = self
            .routes
            .apply(nl.as_mut(), &desired)
            .map_err(|e| DriverError::Other(e.to_string()))?;
        if st != Default::default() {
            debug!(?st, "routes programmed");
        }
        Ok(())
    }

    /// Applies a FelixConfiguration map from the server (see `config`): a change to the static
    /// chains' settings re-renders them; a new log prefix re-renders every policy and profile.
    fn apply_datastore_config(&mut self) {
        let Some(ds) = self.pending_config.take() else {
            return;
        };
        let (mut next, mut problems) =
            config::effective(&self.base_opts, &self.base_opts.pinned, &ds);
        // A prefix matching one of the host's own interfaces would hand it to workload
        // dispatch (its traffic dropped as "unknown workload"): refused, flag value kept.
        if next.statics.workload_prefixes != self.base_opts.statics.workload_prefixes {
            let clash = next.statics.workload_prefixes.iter().find_map(|p| {
                self.ifaces
                    .host_interfaces_matching(p)
                    .into_iter()
                    .next()
                    .map(|(iface, why)| (p.clone(), iface, why))
            });
            if let Some((prefix, iface, why)) = clash {
                problems.push(format!(
                    "FelixConfiguration InterfacePrefix: {prefix:?} matches host interface {iface:?} ({why})"
                ));
                next.statics.workload_prefixes = self.base_opts.statics.workload_prefixes.clone();
            }
        }
        for p in problems {
            warn!(problem = %p, "datastore setting ignored");
        }
        let (unused, by_flag, at_start) = config::not_applied(&self.base_opts.pinned, &ds);
        let summary = format!(
            "not used by this agent: {}; pinned by a flag: {}; read at start only (use the flag): {}",
            list_or_none(&unused),
            list_or_none(&by_flag),
            list_or_none(&at_start)
        );
        // Once per change of what is not applied, not on every ConfigUpdate.
        if !(unused.is_empty() && by_flag.is_empty() && at_start.is_empty())
            && self.config_not_applied.as_deref() != Some(summary.as_str())
        {
            info!(settings = %summary, "FelixConfiguration settings not applied");
        }
        self.config_not_applied = Some(summary);
        let statics_changed = next.statics.workload_prefixes != self.opts.statics.workload_prefixes
            || next.statics.endpoint_to_host != self.opts.statics.endpoint_to_host
            || next.statics.failsafe_in != self.opts.statics.failsafe_in
            || next.statics.failsafe_out != self.opts.statics.failsafe_out
            || next.masq_fully_random != self.opts.masq_fully_random;
        let render_changed = next.render.log_prefix != self.opts.render.log_prefix;
        if statics_changed || render_changed {
            info!(
                endpoint_to_host = ?next.statics.endpoint_to_host,
                prefixes = ?next.statics.workload_prefixes,
                log_prefix = %next.render.log_prefix,
                "datastore settings applied"
            );
        }
        let prefixes_changed =
            next.statics.workload_prefixes != self.opts.statics.workload_prefixes;
        self.opts.statics = next.statics;
        self.opts.render = next.render;
        self.opts.masq_fully_random = next.masq_fully_random;
        if statics_changed {
            self.statics_set = false;
        }
        if prefixes_changed {
            // Endpoints were checked against the old prefixes: check every one again.
            let all: Vec<(WorkloadEndpointKey, WorkloadEndpoint)> = self
                .weps
                .iter()
                .chain(&self.rejected_weps)
                .map(|(k, e)| (k.clone(), e.clone()))
                .collect();
            for (key, ep) in all {
                self.take_workload(key, ep);
            }
            self.dispatch_dirty = true;
        }
        if render_changed {
            self.dirty_policies.extend(self.policies.keys().cloned());
            self.dirty_profiles.extend(self.profiles.keys().cloned());
        }
    }

    fn program(&mut self) -> Result<(), DriverError> {
        self.apply_datastore_config();
        if self.random_fully_supported.is_none() {
            let b = match self.backend {
                Some(b) => b,
                None => iptables::detect_backend(self.runner.as_mut()),
            };
            let supported = iptables::supports_masquerade_fully_random(
                self.runner.as_mut(),
                b,
                self.sysctl.read("kernel/osrelease").ok().as_deref(),
            );
            info!(
                backend = b.name(),
                masquerade_random_fully = supported,
                "iptables backend and features detected"
            );
            self.backend = Some(b);
            self.random_fully_supported = Some(supported);
        }
        let backend = self.backend.expect("resolved above");
        if self.pools_dirty {
            self.render_pools();
        }
        if !self.statics_set {
            self.render_statics();
        }
        self.ensure_netlink()?;
        self.refresh_mangle_refs();
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
        // Sets the kernel refused (or took back): the rules using them fail closed (or open
        // up again) in this same apply.
        let refused_sets: BTreeSet<String> = self
            .ipsets
            .refused()
            .map(|(name, _, _)| name.to_owned())
            .collect();
        if refused_sets != self.refused_sets {
            let changed: BTreeSet<String> = refused_sets
                .symmetric_difference(&self.refused_sets)
                .cloned()
                .collect();
            self.dirty_users_of_sets(|id| {
                IpVersion::BOTH
                    .iter()
                    .any(|v| changed.contains(&rules::ipset_name(*v, id)))
            });
            self.refused_sets = refused_sets;
            self.render_policies();
            self.render_profiles();
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
        // IP sets that changed type: the rules move to the copy built beside the old set, the
        // set is recreated under its name, and the rules move back.
        let migrations = self.ipsets.migrations().to_vec();
        for m in &migrations {
            self.rename_set_in_tables(m.version, &m.name, &m.temp);
        }
        let mut first_error = self.apply_tables(backend);
        if !migrations.is_empty() {
            if first_error.is_none() {
                match self.ipsets.finish_migrations(self.runner.as_mut()) {
                    Ok(()) => info!(
                        sets = migrations.len(),
                        "IP sets recreated with their new type"
                    ),
                    Err(error) => {
                        warn!(%error, "IP sets could not be recreated with their new type; will retry")
                    }
                }
            } else {
                self.ipsets.abandon_migrations();
            }
            for m in &migrations {
                self.rename_set_in_tables(m.version, &m.temp, &m.name);
            }
            if first_error.is_none() {
                first_error = self.apply_tables(backend);
            }
        }
        self.kernel_refused = BTreeMap::new();
        for t in &self.tables {
            for (chain, owner, error) in t.refused() {
                let what = owner.map_or_else(|| format!("chain {chain}"), str::to_owned);
                self.kernel_refused
                    .entry(what)
                    .or_insert_with(|| format!("the kernel refused chain {chain}: {error}"));
            }
        }
        for (name, id, error) in self.ipsets.refused() {
            self.kernel_refused.insert(
                format!("ipset {id:?}"),
                format!("the kernel refused IP set {name}: {error}"),
            );
        }
        if let Some(e) = first_error {
            return Err(DriverError::Other(e));
        }
        self.program_routes()?;
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
    fn on_update(&mut self, msg: &Message) {
        match msg {
            Message::IpSetUpdate {
                id,
                set_type,
                members,
            } => {
                let key = format!("ipset {id:?}");
                if let Err(e) = validate::ipset_id("id", id.as_str()) {
                    return self.reject(key, e.to_string());
                }
                let refused =
                    self.ipsets
                        .replace(id.as_str(), SetKind::from_proto(*set_type), members);
                self.members_checked(id.as_str(), key, refused, true);
            }
            Message::IpSetDeltaUpdate { id, added, removed } => {
                let key = format!("ipset {id:?}");
                if let Err(e) = validate::ipset_id("id", id.as_str()) {
                    return self.reject(key, e.to_string());
                }
                let refused = self.ipsets.delta(id.as_str(), added, removed);
                self.members_checked(id.as_str(), key, refused, false);
            }
            Message::IpSetRemove { id } => {
                self.accept(&format!("ipset {id:?}"));
                if validate::ipset_id("id", id.as_str()).is_ok() {
                    self.ipsets.remove(id.as_str());
                    if self.poisoned_sets.remove(id.as_str()) {
                        self.dirty_users_of_set(id.as_str());
                    }
                }
            }
            Message::PolicyUpdate { key: k, policy: p } => {
                let id = k.to_proto();
                let key = format!("policy {}", rules::policy_id_string(&id));
                let p = match validate::policy(&id, p) {
                    Ok(()) => {
                        self.accept(&key);
                        p.clone()
                    }
                    Err(e) => {
                        self.reject(key, e.to_string());
                        fail_closed_policy(p)
                    }
                };
                self.policies.insert(k.clone(), p);
                self.dirty_policies.insert(k.clone());
            }
            Message::PolicyRemove { key: k } => {
                self.accept(&format!(
                    "policy {}",
                    rules::policy_id_string(&k.to_proto())
                ));
                self.policies.remove(k);
                self.dirty_policies.insert(k.clone());
            }
            Message::ProfileUpdate {
                key: id,
                profile: p,
            } => {
                let key = format!("profile {id:?}");
                let p = match validate::profile(id.as_str(), p) {
                    Ok(()) => {
                        self.accept(&key);
                        p.clone()
                    }
                    Err(e) => {
                        self.reject(key, e.to_string());
                        felix_proto::Profile {
                            inbound_rules: vec![deny_all()],
                            outbound_rules: vec![deny_all()],
                        }
                    }
                };
                self.profiles.insert(id.clone(), p);
                self.dirty_profiles.insert(id.clone());
            }
            Message::ProfileRemove { key: id } => {
                self.accept(&format!("profile {id:?}"));
                self.profiles.remove(id);
                self.dirty_profiles.insert(id.clone());
            }
            Message::WorkloadEndpointUpdate { key, endpoint } => {
                self.take_workload(key.clone(), (**endpoint).clone());
            }
            Message::WorkloadEndpointRemove { key } => {
                self.accept(&format!("workload endpoint {key}"));
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
                        self.accept(&what);
                        self.rejected_heps.remove(id);
                        self.heps.insert(id.clone(), (**ep).clone());
                        self.dirty_heps.insert(id.clone());
                    }
                    Err(e) => {
                        self.reject(what, e.to_string());
                        if validate::object_name("id", id.as_str()).is_ok() {
                            self.rejected_heps.insert(id.clone());
                            self.heps.remove(id);
                            self.dirty_heps.insert(id.clone());
                        }
                    }
                }
            }
            Message::HostEndpointRemove { key: id } => {
                self.accept(&format!("host endpoint {id:?}"));
                self.rejected_heps.remove(id);
                self.heps.remove(id);
                self.dirty_heps.insert(id.clone());
            }
            Message::Config(u) => {
                self.pending_config = Some(u.config.clone().into_iter().collect());
            }
            Message::IpamPoolUpdate { id, pool } => {
                let what = format!("IPAM pool {id:?}");
                if let Err(e) = validate::ipam_pool(id.as_str(), pool) {
                    return self.reject(what, e.to_string());
                }
                self.accept(&what);
                self.pools.insert(id.clone(), pool.clone());
                self.pools_dirty = true;
            }
            Message::IpamPoolRemove { id } => {
                if self.pools.remove(id).is_some() {
                    self.pools_dirty = true;
                }
            }
            // Not programmed by this driver: the session's tracker still sweeps them.
            Message::InSync
            | Message::HostMetadataUpdate { .. }
            | Message::HostMetadataRemove { .. }
            | Message::ServiceAccountUpdate { .. }
            | Message::ServiceAccountRemove { .. }
            | Message::NamespaceUpdate { .. }
            | Message::NamespaceRemove { .. }
            | Message::RouteUpdate { .. }
            | Message::RouteRemove { .. }
            | Message::VtepUpdate { .. }
            | Message::VtepRemove { .. }
            | Message::WireguardEndpointUpdate { .. }
            | Message::WireguardEndpointRemove { .. }
            | Message::WireguardEndpointV6Update { .. }
            | Message::WireguardEndpointV6Remove { .. }
            | Message::GlobalBgpConfig(_)
            | Message::Encapsulation(_)
            | Message::ServiceUpdate { .. }
            | Message::ServiceRemove { .. } => {}
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
        // With interface monitoring an endpoint is up only while its interface is oper-up.
        let link_up = |name: &str| {
            !self.opts.manage_routes || self.ifaces.get(name).is_some_and(|l| l.oper_up)
        };
        // An endpoint whose chains, or a policy or profile it uses, are held failing closed is
        // not enforced as the datastore says: it reports "error".
        let refused = self.rejected();
        let uses_refused = |what: String,
                            tiers: &[&[felix_proto::TierInfo]],
                            profiles: &[String]| {
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
                if self.last_error.is_some() {
                    "error"
                } else {
                    "down"
                }
            } else if wep.state == "active" && link_up(&wep.name) {
                "up"
            } else {
                "down"
            };
            out.workloads.insert(key.clone(), status.to_owned());
        }
        for (id, hep) in &self.heps {
            let tiers: [&[felix_proto::TierInfo]; 4] = [
                &hep.tiers,
                &hep.forward_tiers,
                &hep.untracked_tiers,
                &hep.pre_dnat_tiers,
            ];
            let status = if (self.last_error.is_some() && self.dirty_heps.contains(id))
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

    fn workload_endpoint(&self, id: &WorkloadEndpointKey) -> Option<WorkloadEndpoint> {
        self.weps.get(id).cloned()
    }

    /// From the state as rendered: an endpoint has chains once rendered for an interface.
    /// Objects held failing closed are listed too: their chains exist (and drop).
    fn programmed_objects(&self) -> Option<crate::driver::ProgrammedObjects> {
        let mut c = crate::driver::programmed::Collector::default();
        for (key, policy) in &self.policies {
            c.policy(key, policy);
        }
        self.profiles
            .keys()
            .for_each(|name| c.profile(name.as_str()));
        for (key, ep) in &self.weps {
            c.workload(key, ep, self.wep_ifaces.get(key).map(String::as_str));
        }
        for (id, ep) in &self.heps {
            c.host(id.as_str(), ep, self.hep_ifaces.get(id).map(String::as_str));
        }
        Some(c.finish())
    }

    fn metrics(&self) -> crate::driver::DriverMetrics {
        let p = self.programmed();
        crate::driver::DriverMetrics {
            rejected: Some(self.rejected().len() as u64),
            rules: Some(p.rules as u64),
            ipsets: Some(p.ipsets as u64),
            ipset_members: Some(p.ipset_members as u64),
            routes: self.opts.manage_routes.then_some(p.routes as u64),
        }
    }

    fn refresh_interval(&self) -> Option<Duration> {
        Some(self.opts.refresh_interval)
    }

    fn request_refresh(&mut self) {
        for t in &mut self.tables {
            t.invalidate();
        }
        self.ipsets.invalidate();
        self.routes.invalidate();
        // Re-assert interface settings and neighbours too.
        self.configured_ifaces.clear();
        self.neighbours.clear();
    }

    fn wakeup(&self) -> Option<Arc<tokio::sync::Notify>> {
        self.opts.manage_routes.then(|| self.ifaces.changed())
    }

    fn on_wakeup(&mut self) {
        // Host endpoints found by address may have found (or lost) their interface.
        let by_address: Vec<HostEndpointKey> = self
            .heps
            .iter()
            .filter(|(_, h)| h.name.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        self.dirty_heps.extend(by_address);
    }
}

/// `"a", "b"` or `none`. The names come from the datastore: quoted and escaped, so a control
/// character cannot forge log output.
fn list_or_none(items: &[&str]) -> String {
    if items.is_empty() {
        "none".into()
    } else {
        items
            .iter()
            .map(|i| format!("{i:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeKernel;
    use super::*;
    use felix_proto::to_dataplane::Payload;
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

    fn msg(p: Payload) -> Message {
        Message::try_from(p).expect("a valid message")
    }

    fn pol_id() -> PolicyId {
        PolicyId {
            name: "web".into(),
            namespace: "prod".into(),
            kind: "NetworkPolicy".into(),
        }
    }

    fn policy(untracked: bool) -> Message {
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

    /// The set `policy()` uses.
    fn clients_set() -> Message {
        msg(Payload::IpsetUpdate(IpSetUpdate {
            id: "s:clients".into(),
            members: vec!["10.65.0.1/32".into()],
            r#type: 2,
        }))
    }

    fn wep_id() -> WorkloadEndpointId {
        WorkloadEndpointId {
            orchestrator_id: "k8s".into(),
            workload_id: "prod/web".into(),
            endpoint_id: "eth0".into(),
        }
    }

    fn wep(iface: &str) -> Message {
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

    /// Netlink over a shared fake routing table.
    #[derive(Clone)]
    struct SharedNl(Arc<Mutex<netlink::FakeNetlink>>);

    impl Netlink for SharedNl {
        fn links(&mut self) -> std::io::Result<Vec<netlink::LinkInfo>> {
            self.0.lock().unwrap().links()
        }
        fn routes(&mut self, v: IpVersion, p: u8) -> std::io::Result<Vec<netlink::RouteEntry>> {
            self.0.lock().unwrap().routes(v, p)
        }
        fn add_route(&mut self, r: &netlink::RouteEntry, p: u8) -> std::io::Result<()> {
            self.0.lock().unwrap().add_route(r, p)
        }
        fn del_route(&mut self, r: &netlink::RouteEntry, p: u8) -> std::io::Result<()> {
            self.0.lock().unwrap().del_route(r, p)
        }
        fn set_neighbour(&mut self, i: u32, ip: IpAddr, mac: [u8; 6]) -> std::io::Result<()> {
            self.0.lock().unwrap().set_neighbour(i, ip, mac)
        }
    }

    struct Rig {
        nl: Arc<Mutex<netlink::FakeNetlink>>,
        ifaces: Arc<Interfaces>,
    }

    fn rig() -> (LinuxDriver, Arc<Mutex<FakeKernel>>, Rig) {
        rig_with(LinuxOptions {
            backend: Backend::Nft,
            ..LinuxOptions::default()
        })
    }

    fn rig_with(opts: LinuxOptions) -> (LinuxDriver, Arc<Mutex<FakeKernel>>, Rig) {
        let kernel = Arc::new(Mutex::new(FakeKernel::new()));
        let nl = Arc::new(Mutex::new(netlink::FakeNetlink::default()));
        let ifaces = Interfaces::new();
        let mut sysctl = sysctl::FakeSysctl::default();
        sysctl
            .values
            .insert("kernel/osrelease".into(), "6.1.0-13-amd64".into());
        let d = LinuxDriver::with_seams(
            opts,
            Box::new(Shared(kernel.clone())),
            Some(Box::new(SharedNl(nl.clone()))),
            Box::new(sysctl),
            ifaces.clone(),
        );
        (d, kernel, Rig { nl, ifaces })
    }

    fn driver() -> (LinuxDriver, Arc<Mutex<FakeKernel>>) {
        let (d, k, rig) = rig();
        // Interfaces known and up for the endpoints the tests use.
        for (i, name) in ["caliweb", "caliweb2"].iter().enumerate() {
            rig.ifaces.upsert(netlink::LinkInfo {
                index: 10 + i as u32,
                name: (*name).into(),
                oper_up: true,
            });
        }
        rig.ifaces.upsert(netlink::LinkInfo {
            index: 1,
            name: "lo".into(),
            oper_up: true,
        });
        (d, k)
    }

    #[test]
    fn programmed_objects_name_the_chains_the_renderer_programs() {
        let (mut d, k) = driver();
        let long = PolicyId {
            name: "allow-the-frontend-to-reach-the-backend".into(),
            namespace: "prod".into(),
            kind: "NetworkPolicy".into(),
        };
        d.on_update(&clients_set());
        d.on_update(&policy(false));
        d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(long.clone()),
            policy: Some(Policy {
                tier: "default".into(),
                ..Default::default()
            }),
        })));
        d.on_update(&msg(Payload::ActiveProfileUpdate(
            felix_proto::ActiveProfileUpdate {
                id: Some(felix_proto::ProfileId {
                    name: "kns.prod".into(),
                }),
                profile: Some(Profile::default()),
            },
        )));
        let mut ep = wep("caliweb");
        if let Message::WorkloadEndpointUpdate { endpoint: e, .. } = &mut ep {
            e.tiers[0].egress_policies.push(long.clone());
            e.profile_ids.push("kns.prod".into());
        }
        d.on_update(&ep);
        d.apply().unwrap();

        let dump = d.programmed_objects().expect("the linux driver reports");
        let p = dump
            .policies
            .iter()
            .find(|p| p.name == long.name)
            .expect("listed");
        let mut expected = vec![
            rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &long),
            rules::policy_chain_name(rules::POLICY_OUTBOUND_PFX, &long),
        ];
        expected.sort();
        assert_eq!(p.chains, expected);
        assert!(
            p.chains.iter().all(|c| !c.contains(&long.name)),
            "a long id is hashed, which is why the dump exists: {:?}",
            p.chains
        );
        assert_eq!(
            (p.tier.as_str(), p.kind.as_str(), p.namespace.as_str()),
            ("default", "NetworkPolicy", "prod")
        );
        assert_eq!(p.endpoints, ["k8s/prod/web/eth0"]);
        let web = dump.policies.iter().find(|p| p.name == "web").unwrap();
        assert_eq!(web.tier, "default", "from the endpoint's tier");
        let profile = &dump.profiles[0];
        assert_eq!(
            profile.chains,
            [
                rules::profile_chain_name(rules::PROFILE_INBOUND_PFX, "kns.prod"),
                rules::profile_chain_name(rules::PROFILE_OUTBOUND_PFX, "kns.prod"),
            ]
        );
        let [endpoint] = dump.endpoints.as_slice() else {
            panic!("one endpoint: {:?}", dump.endpoints)
        };
        assert_eq!(endpoint.interface, "caliweb");
        // Every chain the dump names is in the kernel, in both families.
        let kernel = k.lock().unwrap();
        let named = dump
            .policies
            .iter()
            .flat_map(|p| &p.chains)
            .chain(dump.profiles.iter().flat_map(|p| &p.chains))
            .chain(&endpoint.chains);
        for chain in named {
            for v in IpVersion::BOTH {
                assert!(kernel.has_chain(v, "filter", chain), "{chain} (v{v:?})");
            }
        }
        drop(kernel);

        d.on_update(&msg(Payload::WorkloadEndpointRemove(
            WorkloadEndpointRemove { id: Some(wep_id()) },
        )));
        d.apply().unwrap();
        let dump = d.programmed_objects().unwrap();
        assert!(dump.endpoints.is_empty());
        assert!(dump.policies.iter().all(|p| p.endpoints.is_empty()));
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
        // Only the (empty) IPAM pool sets of the NAT rule remain.
        assert_eq!(
            k.set_names(),
            vec![
                "cali40masq-ipam-pools",
                "cali40network-ip-pools",
                "cali60masq-ipam-pools",
                "cali60network-ip-pools"
            ]
        );
        assert!(k.chain_rules(IpVersion::V4, "filter", "FORWARD")[0].contains("cali-FORWARD"));
        assert!(d.endpoint_statuses().workloads.is_empty());
    }

    fn rule_with(f: impl FnOnce(&mut Rule)) -> Rule {
        let mut r = Rule {
            action: "allow".into(),
            ..Default::default()
        };
        f(&mut r);
        r
    }

    fn policy_named(name: &str, rule: Rule) -> Message {
        msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(PolicyId {
                name: name.into(),
                namespace: String::new(),
                kind: "GlobalNetworkPolicy".into(),
            }),
            policy: Some(Policy {
                inbound_rules: vec![rule],
                ..Default::default()
            }),
        }))
    }

    /// A hostile stream: every refused object is named with its reason and held failing
    /// closed, every valid one is programmed, and no restore line carries anything the
    /// messages did not describe.
    #[test]
    fn hostile_messages_are_refused_by_key_and_the_rest_applies() {
        use felix_proto::protocol::NumberOrName;
        let (mut d, k) = driver();
        let set = |id: &str, members: &[&str]| {
            msg(Payload::IpsetUpdate(IpSetUpdate {
                id: id.into(),
                members: members.iter().map(|m| (*m).to_owned()).collect(),
                r#type: 2,
            }))
        };
        d.on_update(&set("s:clients", &["10.65.0.1/32"]));
        d.on_update(&set("s:x\ndestroy", &["10.0.0.1"]));
        d.on_update(&set("s:bad", &["0.0.0.0/0", "10.0.0.0/40"]));
        d.on_update(&set("s:all", &["0.0.0.0/0"]));
        d.on_update(&policy(false));
        d.on_update(&policy_named(
            "uses-bad",
            rule_with(|r| r.src_ip_set_ids = vec!["s:bad".into()]),
        ));
        d.on_update(&policy_named(
            "uses-missing",
            rule_with(|r| r.src_ip_set_ids = vec!["s:never-sent".into()]),
        ));
        d.on_update(&policy_named(
            "proto",
            rule_with(|r| {
                r.protocol = Some(felix_proto::Protocol {
                    number_or_name: Some(NumberOrName::Name("tcp\n-A INPUT -j ACCEPT".into())),
                })
            }),
        ));
        d.on_update(&policy_named(
            "port",
            rule_with(|r| {
                r.dst_ports = vec![felix_proto::PortRange {
                    first: 1,
                    last: 65536,
                }]
            }),
        ));
        d.on_update(&policy_named(
            "annotated",
            rule_with(|r| {
                r.metadata = Some(felix_proto::RuleMetadata {
                    annotations: [(
                        "note".to_owned(),
                        "ends in \\\" \n-A INPUT -j ACCEPT\0".to_owned(),
                    )]
                    .into(),
                })
            }),
        ));
        d.on_update(&wep("caliweb"));
        d.on_update(&msg(Payload::WorkloadEndpointUpdate(
            WorkloadEndpointUpdate {
                id: Some(WorkloadEndpointId {
                    workload_id: "prod/hijack".into(),
                    ..wep_id()
                }),
                endpoint: Some(WorkloadEndpoint {
                    state: "active".into(),
                    name: "eth0".into(),
                    ..Default::default()
                }),
            },
        )));
        d.on_update(&msg(Payload::ConfigUpdate(felix_proto::ConfigUpdate {
            config: [(
                "LogPrefix".to_owned(),
                "x\"\n-I INPUT 1 -j ACCEPT".to_owned(),
            )]
            .into(),
            ..Default::default()
        })));
        d.apply().expect("everything valid applies");

        let rejected = d.rejected();
        let refused: Vec<&str> = rejected.keys().map(String::as_str).collect();
        assert_eq!(
            refused,
            [
                "ipset \"s:bad\"",
                "ipset \"s:x\\ndestroy\"",
                "policy gnp/port",
                "policy gnp/proto",
                "policy gnp/uses-bad",
                "policy gnp/uses-missing",
                "workload endpoint k8s/prod/hijack/eth0",
            ]
        );
        assert!(d.rejected()["policy gnp/port"].contains("65536"));
        assert!(d.rejected()["workload endpoint k8s/prod/hijack/eth0"].contains("prefixes"));
        let statuses = d.endpoint_statuses().workloads;
        assert_eq!(statuses.values().collect::<Vec<_>>(), ["error", "up"]);
        assert_eq!(d.metrics().rejected, Some(7));

        let k = k.lock().unwrap();
        let v4 = IpVersion::V4;
        // The valid objects are programmed.
        assert!(k.has_chain(v4, "filter", "cali-tw-caliweb"));
        assert!(k.has_chain(v4, "filter", "cali-pi-np/prod/web"));
        assert!(!k.has_chain(v4, "filter", "cali-tw-eth0"));
        // Refused policies keep their chains, which drop whatever reaches them.
        for name in ["uses-bad", "uses-missing", "proto", "port"] {
            let rules = k.chain_rules(v4, "filter", &format!("cali-pi-gnp/{name}"));
            assert!(
                rules.iter().any(|r| r.ends_with("--jump DROP")),
                "{name}: {rules:?}"
            );
            assert!(
                !rules
                    .iter()
                    .any(|r| r.contains("ACCEPT") || r.contains("0x10000/0x10000")),
                "{name}: {rules:?}"
            );
        }
        // A /0 becomes its two halves; the refused member is left out.
        let members = |name: &str| {
            let mut m: Vec<String> = k.set(name).unwrap().members.iter().cloned().collect();
            m.sort();
            m
        };
        assert_eq!(members("cali40s:all"), ["0.0.0.0/1", "128.0.0.0/1"]);
        assert_eq!(members("cali40s:bad"), ["0.0.0.0/1", "128.0.0.0/1"]);
        assert!(k.set("cali40s:x\ndestroy").is_none());
        // No restore line says anything it was not built to say: read back as the tools read
        // them, every rule is in a chain of ours or jumps to one, and no ipset command names a
        // set that is not ours.
        for (program, args, input) in &k.calls {
            for line in input.lines() {
                if program.contains("tables") && line.starts_with('-') {
                    let a = rules::quote::split_restore_line(line).unwrap();
                    let ours = a[1].starts_with("cali")
                        || a.iter().any(|x| x.starts_with("cali:"))
                        || a.windows(2).any(|w| {
                            matches!(w[0].as_str(), "--jump" | "--goto" | "-j" | "-g")
                                && w[1].starts_with("cali-")
                        });
                    assert!(ours, "{program}: {line}");
                }
                if program == "ipset" && args.iter().any(|a| a == "restore") {
                    let words: Vec<&str> = line.split_whitespace().collect();
                    assert!(
                        words.len() < 2 || words[1].starts_with("cali"),
                        "ipset: {line}"
                    );
                }
            }
        }
        let annotated = k.chain_rules(v4, "filter", "cali-pi-gnp/annotated");
        assert!(
            annotated
                .iter()
                .any(|r| r.contains("note=ends in __ _-A INPUT -j ACCEPT_")),
            "{annotated:?}"
        );
        let log_prefix_lines = k
            .calls
            .iter()
            .flat_map(|c| c.2.lines())
            .filter(|l| l.contains("--log-prefix"))
            .count();
        assert_eq!(log_prefix_lines, 0, "no LOG rule was asked for");
        drop(k);

        // The poisoned set comes back clean: the policy using it is programmed as sent again
        // and no longer reported.
        d.on_update(&set("s:bad", &["10.0.0.0/8"]));
        d.apply().unwrap();
        let rejected = d.rejected();
        assert!(!rejected.contains_key("ipset \"s:bad\""), "{rejected:?}");
        assert!(
            !rejected.contains_key("policy gnp/uses-bad"),
            "{rejected:?}"
        );
        assert!(
            rejected.contains_key("policy gnp/uses-missing"),
            "{rejected:?}"
        );
        assert_eq!(d.metrics().rejected, Some(5));
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;

        /// Text an attacker would try: restore syntax, quotes, escapes, control bytes, names
        /// of other tables' chains, and ordinary values, mixed.
        fn text() -> impl Strategy<Value = String> {
            prop_oneof![
                Just(String::new()),
                "[a-z0-9:/.-]{1,12}",
                "(tcp|udp|icmp|10\\.0\\.0\\.0/8|fd00::/64|s:[a-z]{3})",
                "[ -~]{0,20}",
                any::<String>(),
                Just("x\"\n-A INPUT -j ACCEPT\n".to_owned()),
                Just("\\".to_owned()),
                Just("a\0b".to_owned()),
            ]
        }

        fn ports() -> impl Strategy<Value = Vec<felix_proto::PortRange>> {
            prop::collection::vec(
                (-2i32..70000, -2i32..70000)
                    .prop_map(|(first, last)| felix_proto::PortRange { first, last }),
                0..3,
            )
        }

        prop_compose! {
            fn rule()(action in prop_oneof![Just("allow".to_owned()), Just("deny".to_owned()), text()],
                      proto in prop::option::of(text()), proto_n in prop::option::of(-5i32..300),
                      src_net in prop::collection::vec(text(), 0..3), dst_net in prop::collection::vec(text(), 0..2),
                      src_ports in ports(), dst_ports in ports(),
                      icmp in prop::option::of((-5i32..300, prop::option::of(-5i32..300))),
                      sets in prop::collection::vec(prop_oneof![Just("s:known".to_owned()), text()], 0..2),
                      note in text()) -> Rule {
                use felix_proto::protocol::NumberOrName;
                Rule {
                    action,
                    protocol: proto.map(|p| felix_proto::Protocol { number_or_name: Some(NumberOrName::Name(p)) })
                        .or(proto_n.map(|n| felix_proto::Protocol { number_or_name: Some(NumberOrName::Number(n)) })),
                    src_net, dst_net, src_ports, dst_ports,
                    icmp: icmp.map(|(t, c)| match c {
                        Some(code) => felix_proto::rule::Icmp::IcmpTypeCode(felix_proto::IcmpTypeAndCode { r#type: t, code }),
                        None => felix_proto::rule::Icmp::IcmpType(t),
                    }),
                    src_ip_set_ids: sets.clone(),
                    not_dst_ip_set_ids: sets,
                    metadata: Some(felix_proto::RuleMetadata { annotations: [("note".to_owned(), note)].into() }),
                    ..Default::default()
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

            /// Whatever a policy message holds, the apply succeeds, the policy's two chains
            /// exist (its own rules if it is valid, a drop if not), and every restore line
            /// reads back as one rule of a chain of ours.
            #[test]
            fn any_policy_message_applies_safely(name in text(), rules in prop::collection::vec(rule(), 0..4)) {
                let (mut d, k) = driver();
                d.on_update(&msg(Payload::IpsetUpdate(IpSetUpdate { id: "s:known".into(), members: vec!["10.0.0.1".into()], r#type: 2 })));
                let id = PolicyId { name: name.clone(), namespace: String::new(), kind: "GlobalNetworkPolicy".into() };
                let valid = validate::policy(&id, &Policy { inbound_rules: rules.clone(), ..Default::default() }).is_ok()
                    && rules.iter().all(|r| validate::rule_set_ids(r).iter().all(|(_, ids)| ids.iter().all(|i| i == "s:known")));
                d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                    id: Some(id.clone()),
                    policy: Some(Policy { inbound_rules: rules.clone(), ..Default::default() }),
                })));
                prop_assert!(d.apply().is_ok());
                prop_assert_eq!(d.rejected().is_empty(), valid, "{:?}", d.rejected());
                let k = k.lock().unwrap();
                let chain = rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &id);
                prop_assert!(chain.bytes().all(rules::quote::is_bare));
                prop_assert!(k.has_chain(IpVersion::V4, "filter", &chain));
                let got = k.chain_rules(IpVersion::V4, "filter", &chain);
                if !valid {
                    prop_assert!(got.iter().any(|r| r.ends_with("--jump DROP")));
                    prop_assert!(!got.iter().any(|r| r.contains("0x10000/0x10000")));
                }
                for (program, _, input) in &k.calls {
                    if !program.contains("tables") {
                        continue;
                    }
                    for line in input.lines().filter(|l| l.starts_with("-A") || l.starts_with("-I")) {
                        let a = rules::quote::split_restore_line(line).unwrap();
                        prop_assert!(a[1].starts_with("cali") || a.iter().any(|x| x.starts_with("cali:")), "{}", line);
                    }
                }
            }
        }
    }

    /// What the kernel refuses, that the agent's checks let through, holds back nothing else:
    /// the chain or set is found, fails closed, and is reported by the object it renders.
    #[test]
    fn what_the_kernel_refuses_fails_closed_by_name_and_the_rest_applies() {
        let (mut d, k) = driver();
        k.lock().unwrap().refuse.push("10.66.6.6".into());
        d.on_update(&clients_set());
        d.on_update(&policy(false));
        d.on_update(&wep("caliweb"));
        d.apply().unwrap();
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["up"]
        );

        // A policy whose chain the kernel refuses.
        let other_id = PolicyId {
            name: "other".into(),
            ..pol_id()
        };
        let policy_with = |id: &PolicyId, net: &str| {
            msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                id: Some(id.clone()),
                policy: Some(Policy {
                    inbound_rules: vec![Rule {
                        action: "allow".into(),
                        src_net: vec![net.into()],
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            }))
        };
        d.on_update(&policy_with(&pol_id(), "10.66.6.6/32"));
        d.on_update(&policy_with(&other_id, "10.1.0.0/16"));
        d.apply().expect("a refused chain does not fail the apply");
        {
            let k = k.lock().unwrap();
            let bad = k.chain_rules(IpVersion::V4, "filter", "cali-pi-np/prod/web");
            assert_eq!(bad.len(), 1);
            assert!(bad[0].ends_with("--jump DROP"), "{bad:?}");
            let other = k.chain_rules(IpVersion::V4, "filter", "cali-pi-np/prod/other");
            assert!(other.iter().any(|r| r.contains("10.1.0.0/16")), "{other:?}");
        }
        let rejected = d.rejected();
        let reason = &rejected["policy np/prod/web"];
        assert!(
            reason.contains("the kernel refused chain cali-pi-np/prod/web"),
            "{reason}"
        );
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["error"],
            "the endpoint using it is not enforced as written"
        );
        assert_eq!(d.metrics().rejected, Some(1));

        // Fixed: programmed as sent, and the endpoint is up again.
        d.on_update(&policy_with(&pol_id(), "10.65.0.0/16"));
        d.apply().unwrap();
        assert!(d.rejected().is_empty());
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["up"]
        );

        // An IP set the kernel refuses: the policy using it fails closed in the same apply,
        // and the set is named.
        d.on_update(&policy(false));
        d.on_update(&msg(Payload::IpsetUpdate(IpSetUpdate {
            id: "s:clients".into(),
            members: vec!["10.65.0.1/32".into(), "10.66.6.6/32".into()],
            r#type: 2,
        })));
        d.apply().unwrap();
        let rejected = d.rejected();
        assert!(
            rejected["ipset \"s:clients\""].contains("cali40s:clients"),
            "{rejected:?}"
        );
        assert!(
            rejected["policy np/prod/web"].contains("s:clients"),
            "{rejected:?}"
        );
        {
            let k = k.lock().unwrap();
            let web = k.chain_rules(IpVersion::V4, "filter", "cali-pi-np/prod/web");
            assert!(!web.iter().any(|r| r.contains("--match-set")), "{web:?}");
            assert!(web.iter().any(|r| r.contains("DROP")), "{web:?}");
        }
        d.on_update(&clients_set());
        d.apply().unwrap();
        assert!(d.rejected().is_empty(), "{:?}", d.rejected());
        let k = k.lock().unwrap();
        let web = k.chain_rules(IpVersion::V4, "filter", "cali-pi-np/prod/web");
        assert!(web.iter().any(|r| r.contains("cali40s:clients")), "{web:?}");
    }

    #[test]
    fn a_failed_apply_reports_error_and_the_retry_converges() {
        let (mut d, k) = driver();
        d.on_update(&clients_set());
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

    #[test]
    fn routes_follow_interfaces_and_status_follows_the_link() {
        let (mut d, _k, rig) = rig();
        d.on_update(&clients_set());
        d.on_update(&policy(false));
        d.on_update(&wep("caliweb"));
        // The monitor has not dumped yet: nothing is touched, the endpoint is down.
        d.apply().unwrap();
        assert!(rig.nl.lock().unwrap().routes.is_empty());
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["down"]
        );

        rig.ifaces.upsert(netlink::LinkInfo {
            index: 10,
            name: "caliweb".into(),
            oper_up: true,
        });
        rig.nl.lock().unwrap().links.push(netlink::LinkInfo {
            index: 10,
            name: "caliweb".into(),
            oper_up: true,
        });
        // Ready only after the monitor's dump.
        rig.ifaces.mark_ready_for_tests();
        d.apply().unwrap();
        {
            let nl = rig.nl.lock().unwrap();
            let routes: Vec<_> = nl
                .routes
                .iter()
                .map(|(r, p)| (r.dst.to_string(), r.prefix, r.ifindex, *p))
                .collect();
            assert_eq!(routes, vec![("10.65.0.2".to_owned(), 32, 10, 80)]);
        }
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["up"]
        );

        // Link down: route withdrawn, status down; up again: both back.
        rig.ifaces.upsert(netlink::LinkInfo {
            index: 10,
            name: "caliweb".into(),
            oper_up: false,
        });
        d.on_wakeup();
        d.apply().unwrap();
        assert!(rig.nl.lock().unwrap().routes.is_empty());
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["down"]
        );
        rig.ifaces.upsert(netlink::LinkInfo {
            index: 10,
            name: "caliweb".into(),
            oper_up: true,
        });
        d.apply().unwrap();
        assert_eq!(rig.nl.lock().unwrap().routes.len(), 1);

        // Deleted by hand: the refresh puts it back.
        rig.nl.lock().unwrap().routes.clear();
        d.request_refresh();
        d.apply().unwrap();
        assert_eq!(rig.nl.lock().unwrap().routes.len(), 1);

        // Endpoint removed: route and status gone.
        d.on_update(&msg(Payload::WorkloadEndpointRemove(
            WorkloadEndpointRemove { id: Some(wep_id()) },
        )));
        d.apply().unwrap();
        assert!(rig.nl.lock().unwrap().routes.is_empty());
        assert!(d.endpoint_statuses().workloads.is_empty());
    }

    #[test]
    fn felix_configuration_from_the_datastore_reshapes_the_static_chains() {
        let (mut d, k) = driver();
        d.apply().unwrap();
        let last = |k: &FakeKernel| {
            k.chain_rules(IpVersion::V4, "filter", "cali-wl-to-host")
                .last()
                .cloned()
                .unwrap()
        };
        assert!(last(&k.lock().unwrap()).ends_with("--jump DROP"));
        d.on_update(&msg(Payload::ConfigUpdate(felix_proto::ConfigUpdate {
            config: [
                (
                    "DefaultEndpointToHostAction".to_owned(),
                    "Accept".to_owned(),
                ),
                ("InterfacePrefix".to_owned(), "cali,tap".to_owned()),
            ]
            .into(),
            ..Default::default()
        })));
        d.apply().unwrap();
        let k = k.lock().unwrap();
        assert!(last(&k).ends_with("--jump ACCEPT"), "{}", last(&k));
        let fwd = k.chain_rules(IpVersion::V4, "filter", "cali-FORWARD");
        assert!(
            fwd.iter().any(|r| r.contains("--in-interface tap+")),
            "{fwd:?}"
        );
    }

    fn pool(cidr: &str, masquerade: bool, uses: &[&str]) -> Payload {
        Payload::IpamPoolUpdate(felix_proto::IpamPoolUpdate {
            id: cidr.replace('/', "-"),
            pool: Some(felix_proto::IpamPool {
                cidr: cidr.into(),
                masquerade,
                allowed_uses: uses.iter().map(|u| (*u).to_owned()).collect(),
                ..Default::default()
            }),
        })
    }

    fn members(k: &FakeKernel, set: &str) -> Vec<String> {
        k.set(set).unwrap().members.iter().cloned().collect()
    }

    #[test]
    fn nat_outgoing_pools_fill_the_pool_sets() {
        let (mut d, k) = driver();
        d.apply().unwrap();
        // No natOutgoing pool: Felix's chain is empty.
        assert!(
            k.lock()
                .unwrap()
                .chain_rules(IpVersion::V4, "nat", "cali-nat-outgoing")
                .is_empty()
        );

        d.on_update(&msg(pool("10.65.0.0/16", true, &[])));
        d.on_update(&msg(pool("10.66.0.0/16", false, &["Workload", "Tunnel"])));
        // LoadBalancer addresses are outside the network: traffic to them is masqueraded.
        d.on_update(&msg(pool("10.96.100.0/24", false, &["LoadBalancer"])));
        d.apply().unwrap();
        let k = k.lock().unwrap();
        assert_eq!(members(&k, "cali40masq-ipam-pools"), vec!["10.65.0.0/16"]);
        assert_eq!(
            members(&k, "cali40network-ip-pools"),
            vec!["10.65.0.0/16", "10.66.0.0/16"]
        );
        let rules = k.chain_rules(IpVersion::V4, "nat", "cali-nat-outgoing");
        assert_eq!(rules.len(), 1, "{rules:?}");
        assert!(
            rules[0].contains("--match-set cali40masq-ipam-pools src")
                && rules[0].contains("! --match-set cali40network-ip-pools dst")
                && rules[0].contains("--jump MASQUERADE --random-fully"),
            "{}",
            rules[0]
        );
        // The IPv6 family has no natOutgoing pool.
        assert!(
            k.chain_rules(IpVersion::V6, "nat", "cali-nat-outgoing")
                .is_empty()
        );
        assert!(k.chain_rules(IpVersion::V4, "nat", "POSTROUTING")[0].contains("cali-POSTROUTING"));
    }

    /// The first rule of the NAT-outgoing chain in the fake kernel.
    fn nat_outgoing_rule(k: &Arc<Mutex<FakeKernel>>) -> String {
        k.lock()
            .unwrap()
            .chain_rules(IpVersion::V4, "nat", "cali-nat-outgoing")[0]
            .clone()
    }

    #[test]
    fn settings_named_in_logs_are_escaped() {
        assert_eq!(list_or_none(&[]), "none");
        assert_eq!(
            list_or_none(&["BPFEnabled", "X\u{1b}[2Jy"]),
            "\"BPFEnabled\", \"X\\u{1b}[2Jy\""
        );
    }

    #[test]
    fn masquerade_random_fully_follows_the_override_and_the_kernel() {
        let (mut d, k, _) = rig_with(LinuxOptions {
            backend: Backend::Nft,
            masq_fully_random: Some(false),
            ..LinuxOptions::default()
        });
        d.on_update(&msg(pool("10.65.0.0/16", true, &[])));
        d.apply().unwrap();
        let rule = nat_outgoing_rule(&k);
        assert!(rule.ends_with("--jump MASQUERADE"), "{rule}");

        // The datastore's FeatureDetectOverride applies (no flag pins it here).
        let mut ds = BTreeMap::new();
        ds.insert(
            "FeatureDetectOverride".to_owned(),
            "MASQFullyRandom=true".to_owned(),
        );
        d.on_update(&msg(Payload::ConfigUpdate(felix_proto::ConfigUpdate {
            config: ds,
            ..Default::default()
        })));
        d.apply().unwrap();
        let rule = nat_outgoing_rule(&k);
        assert!(rule.ends_with("--jump MASQUERADE --random-fully"), "{rule}");

        // An old kernel: detected as unsupported.
        let (mut d, k, _) = rig();
        d.sysctl = Box::new(sysctl::FakeSysctl {
            values: [("kernel/osrelease".to_owned(), "3.10.0-1160.el7".to_owned())].into(),
        });
        d.on_update(&msg(pool("10.65.0.0/16", true, &[])));
        d.apply().unwrap();
        let rule = nat_outgoing_rule(&k);
        assert!(rule.ends_with("--jump MASQUERADE"), "{rule}");
    }

    fn default_route_via(ifaces: &Interfaces, index: u32) {
        use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage, RouteType};
        let mut r = RouteMessage::default();
        r.header.kind = RouteType::Unicast;
        r.header.address_family = rtnetlink::packet_route::AddressFamily::Inet;
        r.header.table = 254;
        r.attributes.push(RouteAttribute::Oif(index));
        ifaces.route(&r, true);
    }

    fn host_address_on(ifaces: &Interfaces, index: u32, ip: IpAddr) {
        use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
        let mut a = AddressMessage::default();
        a.header.index = index;
        a.attributes.push(AddressAttribute::Address(ip));
        ifaces.address(&a, true);
    }

    fn config(pairs: &[(&str, &str)]) -> Message {
        msg(Payload::ConfigUpdate(felix_proto::ConfigUpdate {
            config: pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        }))
    }

    /// An endpoint naming one of the host's own interfaces (it carries the default route or
    /// host addresses) gets its policy chains but never sysctls, routes or neighbours.
    #[test]
    fn the_hosts_own_interfaces_are_never_taken_over() {
        let (mut d, _k, rig) = rig();
        for (index, name) in [(20, "caliuplink"), (21, "caliaddr"), (22, "caliweb")] {
            let link = netlink::LinkInfo {
                index,
                name: name.into(),
                oper_up: true,
            };
            rig.ifaces.upsert(link.clone());
            rig.nl.lock().unwrap().links.push(link);
        }
        default_route_via(&rig.ifaces, 20);
        host_address_on(&rig.ifaces, 21, "192.168.1.10".parse().unwrap());
        rig.ifaces.mark_ready_for_tests();
        assert!(rig.ifaces.carries_default_route(20) && !rig.ifaces.carries_default_route(22));
        for (n, iface) in ["caliuplink", "caliaddr", "caliweb"].iter().enumerate() {
            d.on_update(&msg(Payload::WorkloadEndpointUpdate(
                WorkloadEndpointUpdate {
                    id: Some(WorkloadEndpointId {
                        endpoint_id: format!("eth{n}"),
                        ..wep_id()
                    }),
                    endpoint: Some(WorkloadEndpoint {
                        state: "active".into(),
                        name: (*iface).into(),
                        mac: "ee:ee:ee:ee:ee:ee".into(),
                        ipv4_nets: vec![format!("10.65.0.{}/32", n + 1)],
                        ..Default::default()
                    }),
                },
            )));
        }
        d.apply().unwrap();
        let nl = rig.nl.lock().unwrap();
        let routed: Vec<u32> = nl.routes.iter().map(|(r, _)| r.ifindex).collect();
        assert_eq!(routed, vec![22], "only the workload's veth gets a route");
        let neighbours: Vec<u32> = nl.neighbours.iter().map(|(i, _, _)| *i).collect();
        assert_eq!(neighbours, vec![22]);
    }

    /// The workload prefixes can change at runtime: every endpoint is checked again, and a
    /// prefix that matches one of the host's own interfaces is refused.
    #[test]
    fn interface_prefix_changes_recheck_endpoints_and_never_match_the_host() {
        let (mut d, k, rig) = rig();
        for (index, name) in [(2, "eth0"), (30, "tap0")] {
            let link = netlink::LinkInfo {
                index,
                name: name.into(),
                oper_up: true,
            };
            rig.ifaces.upsert(link.clone());
            rig.nl.lock().unwrap().links.push(link);
        }
        default_route_via(&rig.ifaces, 2);
        rig.ifaces.mark_ready_for_tests();
        d.on_update(&clients_set());
        d.on_update(&policy(false));
        d.on_update(&wep("tap0"));
        d.apply().unwrap();
        let what = "workload endpoint k8s/prod/web/eth0";
        assert!(d.rejected().contains_key(what), "{:?}", d.rejected());
        assert!(
            !k.lock()
                .unwrap()
                .has_chain(IpVersion::V4, "filter", "cali-tw-tap0")
        );

        d.on_update(&config(&[("InterfacePrefix", "cali,tap")]));
        d.apply().unwrap();
        assert!(!d.rejected().contains_key(what), "{:?}", d.rejected());
        assert!(
            k.lock()
                .unwrap()
                .has_chain(IpVersion::V4, "filter", "cali-tw-tap0")
        );

        // "eth" would hand the uplink to workload dispatch: refused, the flag value is used.
        d.on_update(&config(&[("InterfacePrefix", "eth,tap")]));
        d.apply().unwrap();
        let k = k.lock().unwrap();
        let fwd = k.chain_rules(IpVersion::V4, "filter", "cali-FORWARD");
        assert!(!fwd.iter().any(|r| r.contains("eth+")), "{fwd:?}");
        assert!(fwd.iter().any(|r| r.contains("cali+")), "{fwd:?}");
        assert!(!k.has_chain(IpVersion::V4, "filter", "cali-tw-tap0"));
        assert!(d.rejected().contains_key(what));
        assert_eq!(
            d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
            vec!["error"]
        );
    }

    /// Host endpoint egress policy is also in mangle (for DNAT'd host traffic), only while a
    /// host endpoint uses it.
    #[test]
    fn host_endpoint_egress_policy_is_placed_in_mangle_while_used() {
        let (mut d, k) = driver();
        d.on_update(&clients_set());
        d.on_update(&policy(false));
        let hep = |tiers: Vec<TierInfo>| {
            msg(Payload::HostEndpointUpdate(
                felix_proto::HostEndpointUpdate {
                    id: Some(felix_proto::HostEndpointId {
                        endpoint_id: "lo-ep".into(),
                    }),
                    endpoint: Some(felix_proto::HostEndpoint {
                        name: "lo".into(),
                        tiers,
                        ..Default::default()
                    }),
                },
            ))
        };
        d.on_update(&hep(vec![TierInfo {
            name: "default".into(),
            egress_policies: vec![pol_id()],
            ..Default::default()
        }]));
        d.apply().unwrap();
        {
            let k = k.lock().unwrap();
            assert!(k.has_chain(IpVersion::V4, "mangle", "cali-po-np/prod/web"));
            assert!(!k.has_chain(IpVersion::V4, "mangle", "cali-pi-np/prod/web"));
            let th = k.chain_rules(IpVersion::V4, "mangle", "cali-th-lo");
            assert!(
                th.iter().any(|r| r.contains("cali-po-np/prod/web")),
                "{th:?}"
            );
            let post = k.chain_rules(IpVersion::V4, "mangle", "cali-POSTROUTING");
            assert!(
                post.iter()
                    .any(|r| r.contains("--ctstate DNAT") && r.contains("cali-to-host-endpoint")),
                "{post:?}"
            );
            assert!(
                k.chain_rules(IpVersion::V4, "mangle", "POSTROUTING")[0]
                    .contains("cali-POSTROUTING")
            );
        }
        d.on_update(&hep(vec![]));
        d.apply().unwrap();
        let k = k.lock().unwrap();
        assert!(!k.has_chain(IpVersion::V4, "mangle", "cali-po-np/prod/web"));
        assert!(k.has_chain(IpVersion::V4, "filter", "cali-po-np/prod/web"));
    }
}
