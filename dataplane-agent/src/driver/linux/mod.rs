//! The Linux driver: programs iptables (legacy or nft backend), ipsets, routes and interface
//! settings in Calico's layout, as Felix's internal dataplane does: through managers.
//!
//! Each manager owns one part of the desired state ([`desired`]: chains and IP sets, in no
//! writer's syntax) and has Felix's two phases: `on_update` records a message and marks what
//! changed (no IO), `apply` works it out. The driver hands every message to every manager
//! (each ignores what is not its own) and, in `apply`, runs them in dependency order:
//!
//! 1. [`config_mgr`]: FelixConfiguration over the flags (new prefixes re-check endpoints, a new
//!    log prefix re-renders policy);
//! 2. [`masq_mgr`]: IPAM pools into the pool sets, then the static chains ([`config_mgr`]);
//! 3. [`policy_mgr`]: changed policies and profiles into their chains;
//! 4. [`endpoint_mgr`]: changed endpoints into their chains, then the dispatch chains;
//! 5. the kernel writer chosen at start (`writer::KernelWriter`: iptables and ipsets, or
//!    nftables) writes the desired sets and chains (iptables: one `ipset restore`, then one
//!    `iptables-restore` per changed table, IP sets changing type move their rules to a copy
//!    first; nftables: one transaction). Sets the kernel refuses go to [`ipsets_mgr`], and the
//!    rules using them are rendered again, failing closed, in the same apply;
//! 6. [`routes_mgr`]: routes, neighbours and interface sysctls;
//! 7. the writer finishes: unused IP sets destroyed, and once the other writer's state removed.
//!
//! The writer keeps its own view of the kernel and writes only differences;
//! `request_refresh` drops that view so the next apply reads the kernel back and repairs
//! out-of-band changes. All IO goes through the seams: [`runner::CommandRunner`],
//! [`netlink::Netlink`], [`sysctl::Sysctl`].

pub(crate) mod config;
pub(crate) mod config_mgr;
pub(crate) mod desired;
pub(crate) mod endpoint_mgr;
#[cfg(any(test, feature = "test-util"))]
pub mod fake;
pub mod flow_source;
pub(crate) mod hits;
pub(crate) mod interfaces;
pub(crate) mod ipsets;
pub(crate) mod ipsets_mgr;
pub(crate) mod iptables;
pub(crate) mod masq_mgr;
pub(crate) mod netlink;
pub(crate) mod nft;
pub(crate) mod policy_mgr;
pub(crate) mod refusals;
pub(crate) mod routes;
pub(crate) mod routes_mgr;
pub(crate) mod rules;
pub(crate) mod runner;
pub(crate) mod sysctl;
pub(crate) mod validate;
mod writer;

pub use self::iptables::Backend;
pub use self::nft::NftStats;
pub use self::rules::RuleId;
pub use self::rules::endpoint::Direction;
pub use self::writer::RuleAt;

/// What the benchmarks (`tools/bench`) reach below the driver, to measure its parts against
/// the bare tools. Not an API: it follows the driver's internals.
pub mod bench {
    pub use super::netlink::{Netlink, RouteEntry, RtNetlink};
    pub use super::nft::netlink::attr;
    pub use super::routes::Routes;
    pub use super::rules::IpVersion;
    pub use super::runner::{CommandRunner, Output, SystemRunner};
}

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use felix_proto::WorkloadEndpoint;

use self::config_mgr::ConfigManager;
use self::desired::{Sets, Tables};
use self::endpoint_mgr::EndpointManager;
use self::interfaces::Interfaces;
use self::ipsets_mgr::{IpSetsManager, SetUse};
use self::masq_mgr::MasqManager;
use self::netlink::Netlink;
use self::policy::RenderConfig;
use self::policy_mgr::PolicyManager;
use self::refusals::Refusals;
use self::routes_mgr::RouteManager;
use self::rules::policy;
use self::rules::static_chains::StaticConfig;
use self::rules::{IpVersion, ipset_name};
use self::runner::CommandRunner;
use self::sysctl::Sysctl;
use self::writer::{IptablesWriter, KernelWriter, NftWriter};
use super::{Driver, DriverError, EndpointStatuses, WorkloadEndpointKey};
use crate::flows::source::FlowSource;
use crate::flows::{FlowAggregator, FlowSettings, MAX_RECORDS_PER_REPORT, PrefixIndex};
use crate::message::Message;

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
    /// Program nftables (`table ip calico`, native sets) instead of iptables and ipsets.
    pub nftables: bool,
    /// Read the rules' hit counters (FeatureGates `PolicyHitCounters`; on unless disabled).
    pub hit_counters: bool,
    /// Bounds of flow-log collection (used when a flow source is set).
    pub flows: FlowSettings,
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
            nftables: false,
            hit_counters: true,
            flows: FlowSettings::default(),
        }
    }
}

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

/// Programs iptables, ipsets and routes through its managers.
pub struct LinuxDriver {
    runner: Box<dyn CommandRunner>,
    /// Writes the desired state to the kernel: iptables and ipsets, or nftables; chosen once.
    writer: Box<dyn KernelWriter>,
    /// Whether iptables and the kernel take `MASQUERADE --random-fully`; `None` until it is
    /// detected, with the backend, at the first apply.
    random_fully_supported: Option<bool>,
    /// Interfaces as the monitor sees them (the managers that need them hold them too).
    ifaces: Arc<Interfaces>,
    /// The desired chains and IP sets the managers write and the writer reads.
    tables: Tables,
    sets: Sets,
    refusals: Refusals,
    config: ConfigManager,
    masq: MasqManager,
    ipsets: IpSetsManager,
    policy: PolicyManager,
    endpoints: EndpointManager,
    routes: RouteManager,
    /// The last apply failed (endpoints changed since then report "error").
    apply_failed: bool,
    /// The kernel's counters at the last collection (`collect_hits`).
    hits: hits::HitTracker,
    /// Flow logs: where the kernel's NFLOG and conntrack events come from, and what they
    /// add up to (`collect_flows`); `None` until a source is given.
    flows: Option<FlowCollector>,
}

/// Flow-log collection of the Linux driver (see [`crate::flows`]).
struct FlowCollector {
    source: Box<dyn FlowSource>,
    settings: FlowSettings,
    agg: FlowAggregator,
    /// Hashed NFLOG prefix → rule, from the rules as rendered; rebuilt after each apply.
    index: Option<PrefixIndex>,
}

impl LinuxDriver {
    pub fn new(opts: LinuxOptions, runner: Box<dyn CommandRunner>) -> Self {
        let manage_routes = opts.manage_routes;
        let mut d = Self::with_seams(
            opts,
            runner,
            None,
            Box::new(sysctl::ProcSysctl),
            Interfaces::new(),
        );
        d.routes.start_netlink = manage_routes;
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
        // The one place the writer is chosen.
        let writer: Box<dyn KernelWriter> = if opts.nftables {
            Box::new(NftWriter::new(&versions, opts.backend))
        } else {
            Box::new(IptablesWriter::new(
                &versions,
                opts.backend,
                opts.lock_wait_secs,
            ))
        };
        Self {
            runner,
            writer,
            random_fully_supported: None,
            tables: Tables::new(&versions),
            sets: Sets::new(versions.clone()),
            refusals: Refusals::default(),
            masq: MasqManager::default(),
            ipsets: IpSetsManager::default(),
            policy: PolicyManager::default(),
            endpoints: EndpointManager::new(ifaces.clone()),
            routes: RouteManager::new(
                ifaces.clone(),
                netlink,
                sysctl,
                opts.route_protocol,
                versions,
            ),
            ifaces,
            config: ConfigManager::new(opts),
            apply_failed: false,
            hits: hits::HitTracker::default(),
            flows: None,
        }
    }

    /// Collects flow logs from `source` (the driver then offers them: `collects_flows`),
    /// within `settings`. Whether they are collected is the flow-logs setting (the flag or
    /// FelixConfiguration `FlowLogsGoldmaneServer`).
    pub fn set_flow_source(&mut self, source: Box<dyn FlowSource>, settings: FlowSettings) {
        self.flows = Some(FlowCollector {
            source,
            settings,
            agg: FlowAggregator::new(settings),
            index: None,
        });
    }

    /// The hashed NFLOG prefixes of the rules as rendered, with the rule each names.
    fn prefix_index(&self) -> PrefixIndex {
        let mut idx = PrefixIndex::default();
        for table in self.tables.iter() {
            for (_, chain) in table.chains() {
                for r in &chain.rules {
                    if let (rules::Action::Nflog { prefix, .. }, Some(id)) = (&r.action, &r.id) {
                        idx.insert(prefix.clone(), id.clone());
                    }
                }
            }
        }
        idx
    }

    /// What the last apply of the nftables driver wrote (zero for the iptables driver).
    pub fn nft_stats(&self) -> nft::NftStats {
        self.writer.nft_stats()
    }

    /// The stream rule or verdict (see [`rules::RuleId`]) a rule of ours in the kernel enforces:
    /// family `v`, `table` as the kernel names it (`filter`, … for iptables; `calico` for
    /// nftables), the chain as the kernel names it, and the rule's position or comment. What
    /// hit counters and flow logs report against. `None` for a rule that only steers.
    pub fn rule_id(
        &self,
        v: IpVersion,
        table: &str,
        chain: &str,
        at: RuleAt<'_>,
    ) -> Option<rules::RuleId> {
        self.writer.rule_id(&self.tables, v, table, chain, at)
    }

    /// What is programmed (desired state after the last apply).
    pub fn programmed(&self) -> Programmed {
        let (ipsets, ipset_members) = self.sets.counts();
        Programmed {
            rules: self.writer.rule_count(&self.tables),
            ipsets,
            ipset_members,
            routes: self.routes.count(),
        }
    }

    /// Objects refused, "<kind> <key>" → reason: on receipt, for the IP sets they use, or by
    /// the kernel.
    pub fn rejected(&self) -> BTreeMap<String, String> {
        let mut all = self.refusals.rejected().clone();
        for (k, v) in self
            .policy
            .set_refused()
            .iter()
            .chain(&self.refusals.kernel)
        {
            all.entry(k.clone()).or_insert_with(|| v.clone());
        }
        all
    }

    /// The managers' work, in dependency order (see the module documentation).
    fn program(&mut self) -> Result<(), DriverError> {
        let changes = self.config.apply(&self.ifaces);
        if changes.prefixes {
            let prefixes = &self.config.opts().statics.workload_prefixes;
            self.endpoints
                .recheck_workloads(prefixes, &mut self.refusals);
        }
        if changes.render {
            self.policy.dirty_all();
        }
        if changes.endpoints {
            self.endpoints.dirty_all();
        }
        if self.random_fully_supported.is_none() {
            let release = self.routes.kernel_release();
            self.random_fully_supported = Some(
                self.writer
                    .detect_fully_random(self.runner.as_mut(), release.as_deref()),
            );
        }
        if self.masq.apply(&mut self.sets) {
            self.config.mark_statics_dirty();
        }
        let fully_random = self.config.masq_fully_random(self.random_fully_supported);
        let masq = &self.masq;
        self.config
            .apply_statics(&mut self.tables, |v| masq.masquerading(v), fully_random);
        self.routes.ensure_netlink()?;
        self.policy.refresh_mangle_refs(self.endpoints.hosts());
        let opts = self.config.opts();
        let usable = SetUse {
            mgr: &self.ipsets,
            sets: &self.sets,
        };
        self.policy.apply(&mut self.tables, &opts.render, &usable);
        self.endpoints.apply(&mut self.tables, opts);
        let (policy, config, ipsets) = (&mut self.policy, &self.config, &mut self.ipsets);
        let mut rerender = |refused: &BTreeSet<String>, tables: &mut Tables, sets: &Sets| {
            let changed = ipsets.set_kernel_refused(refused.clone());
            if changed.is_empty() {
                return;
            }
            policy.dirty_users_of_sets(|id| {
                IpVersion::BOTH
                    .iter()
                    .any(|v| changed.contains(&ipset_name(*v, id)))
            });
            let usable = SetUse { mgr: ipsets, sets };
            policy.apply(tables, &config.opts().render, &usable);
        };
        self.writer.write(
            self.runner.as_mut(),
            &mut self.tables,
            &mut self.sets,
            &mut rerender,
            &mut self.refusals.kernel,
        )?;
        self.routes
            .apply(self.endpoints.workloads(), self.config.opts())
            .map_err(DriverError::Routes)?;
        self.writer
            .finish(self.runner.as_mut(), &self.tables, &mut self.sets)
    }
}

impl Driver for LinuxDriver {
    /// Every manager sees every message and ignores what is not its own.
    fn on_update(&mut self, msg: &Message) {
        self.config.on_update(msg);
        self.masq.on_update(msg, &mut self.refusals);
        if let Some(id) = self
            .ipsets
            .on_update(msg, &mut self.sets, &mut self.refusals)
        {
            self.policy.dirty_users_of_set(&id);
        }
        self.policy.on_update(msg, &mut self.refusals);
        let prefixes = &self.config.opts().statics.workload_prefixes;
        self.endpoints.on_update(msg, prefixes, &mut self.refusals);
    }

    fn apply(&mut self) -> Result<(), DriverError> {
        match self.program() {
            Ok(()) => {
                self.apply_failed = false;
                self.endpoints.mark_programmed();
                if let Some(f) = &mut self.flows {
                    f.index = None;
                }
                Ok(())
            }
            Err(e) => {
                self.apply_failed = true;
                Err(e)
            }
        }
    }

    fn endpoint_statuses(&self) -> EndpointStatuses {
        // With interface monitoring an endpoint is up only while its interface is oper-up.
        let manage_routes = self.config.opts().manage_routes;
        let link_up =
            |name: &str| !manage_routes || self.ifaces.get(name).is_some_and(|l| l.oper_up);
        self.endpoints
            .statuses(&self.rejected(), self.apply_failed, link_up)
    }

    fn workload_endpoint(&self, id: &WorkloadEndpointKey) -> Option<WorkloadEndpoint> {
        self.endpoints.workload(id).cloned()
    }

    /// From the state as rendered: an endpoint has chains once rendered for an interface.
    /// Objects held failing closed are listed too: their chains exist (and drop).
    fn programmed_objects(&self) -> Option<crate::driver::ProgrammedObjects> {
        let mut c = crate::driver::programmed::Collector::default();
        self.policy.collect(&mut c);
        self.endpoints.collect(&mut c);
        let mut objects = c.finish();
        for chains in objects
            .policies
            .iter_mut()
            .map(|p| &mut p.chains)
            .chain(objects.profiles.iter_mut().map(|p| &mut p.chains))
            .chain(objects.endpoints.iter_mut().map(|e| &mut e.chains))
        {
            self.writer.kernel_chain_names(&self.tables, chains);
        }
        Some(objects)
    }

    fn metrics(&self) -> crate::driver::DriverMetrics {
        let p = self.programmed();
        crate::driver::DriverMetrics {
            rejected: Some(self.rejected().len() as u64),
            rules: Some(p.rules as u64),
            ipsets: Some(p.ipsets as u64),
            ipset_members: Some(p.ipset_members as u64),
            routes: self.config.opts().manage_routes.then_some(p.routes as u64),
        }
    }

    /// Both writers read the kernel's counters.
    fn counts_hits(&self) -> bool {
        true
    }

    /// Reads the kernel's counters through the writer and reports, by rule of the stream, what
    /// moved (see [`hits`]). A policy no longer held when its counters are read is left out.
    fn collect_hits(&mut self) -> Result<Vec<felix_proto::RuleHits>, DriverError> {
        if !self.config.opts().hit_counters {
            // Off per FelixConfiguration: nothing is read. Turned on again, the first read is
            // a baseline, so what passed while it was off is not reported as a burst.
            self.hits = hits::HitTracker::default();
            return Ok(Vec::new());
        }
        let counts = self
            .writer
            .read_counts(self.runner.as_mut(), &self.tables)?;
        let deltas = self.hits.deltas(counts);
        if deltas.is_empty() {
            return Ok(Vec::new());
        }
        let policies = self.policy.policy_ids();
        Ok(deltas
            .into_iter()
            .filter_map(|(id, (packets, bytes))| {
                Some(felix_proto::RuleHits {
                    rule: Some(rule_ref(&id, &policies)?),
                    packets,
                    bytes,
                })
            })
            .collect())
    }

    fn collects_flows(&self) -> bool {
        self.flows.is_some()
    }

    /// Reads the source's events, names each logged rule (its prefix, parsed or looked up in
    /// the rules as rendered, as the stream names it) and hands the closed intervals' records
    /// over. While flow logs are off the source is closed (nothing is read) and what was held
    /// is forgotten.
    fn collect_flows(&mut self, now: i64) -> Result<Vec<felix_proto::FlowReport>, DriverError> {
        let on = self.config.opts().render.flow_logs;
        let index = match &self.flows {
            Some(f) if on && f.index.is_none() => Some(self.prefix_index()),
            _ => None,
        };
        let Some(f) = &mut self.flows else {
            return Ok(Vec::new());
        };
        if !on {
            f.source.close();
            if f.agg.tracked() > 0 || f.agg.queued() > 0 {
                f.agg = FlowAggregator::new(f.settings);
            }
            return Ok(Vec::new());
        }
        let mut events = Vec::new();
        f.source.read(&mut events).map_err(DriverError::Flows)?;
        if index.is_some() {
            f.index = index;
        }
        let index = f.index.get_or_insert_with(PrefixIndex::default);
        let policies = self.policy.policy_ids();
        for ev in &events {
            f.agg.on_event(ev, |prefix| {
                let (_, id) = index.lookup(prefix)?;
                rule_ref(&id, &policies)
            });
        }
        Ok(f.agg.take_reports(now, MAX_RECORDS_PER_REPORT))
    }

    fn refresh_interval(&self) -> Option<Duration> {
        Some(self.config.opts().refresh_interval)
    }

    fn request_refresh(&mut self) {
        self.writer.invalidate();
        // Routes, and interface settings and neighbours too.
        self.routes.invalidate();
    }

    fn wakeup(&self) -> Option<Arc<tokio::sync::Notify>> {
        self.config
            .opts()
            .manage_routes
            .then(|| self.ifaces.changed())
    }

    fn on_wakeup(&mut self) {
        self.endpoints.on_wakeup();
    }
}

/// The stream's name for a rule id (`RuleRef`); `None` for a policy not held.
fn rule_ref(
    id: &rules::RuleId,
    policies: &std::collections::HashMap<String, felix_proto::PolicyId>,
) -> Option<felix_proto::RuleRef> {
    use felix_proto::rule_ref::Kind;
    use rules::RuleId;
    let egress = |d: &Direction| matches!(d, Direction::Egress);
    let mut r = felix_proto::RuleRef::default();
    match id {
        RuleId::Policy {
            policy,
            direction,
            index,
        } => {
            r.set_kind(Kind::PolicyRule);
            r.policy = Some(policies.get(policy)?.clone());
            r.egress = egress(direction);
            r.index = *index;
        }
        RuleId::Profile {
            profile,
            direction,
            index,
        } => {
            r.set_kind(Kind::ProfileRule);
            r.profile = Some(felix_proto::ProfileId {
                name: profile.clone(),
            });
            r.egress = egress(direction);
            r.index = *index;
        }
        RuleId::EndOfTier { tier, direction } => {
            r.set_kind(Kind::EndOfTier);
            r.tier = tier.clone();
            r.egress = egress(direction);
        }
        RuleId::NoProfileMatched { direction } => {
            r.set_kind(Kind::NoProfileMatched);
            r.egress = egress(direction);
        }
        RuleId::Default { direction } => {
            r.set_kind(Kind::DefaultAction);
            r.egress = egress(direction);
        }
        RuleId::Failsafe { direction } => {
            r.set_kind(Kind::Failsafe);
            r.egress = egress(direction);
        }
    }
    Some(r)
}

#[cfg(test)]
mod tests;
