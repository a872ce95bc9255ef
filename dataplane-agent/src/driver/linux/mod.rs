//! The Linux driver: programs iptables (legacy or nft backend), ipsets, routes and interface
//! settings in Calico's layout, as Felix's internal dataplane does: through managers.
//!
//! Each manager owns one part of the desired state and has Felix's two phases: `on_update`
//! records a message and marks what changed (no IO), `apply` works it out. The driver hands
//! every message to every manager (each ignores what is not its own) and, in `apply`, runs
//! them in dependency order:
//!
//! 1. [`config_mgr`]: FelixConfiguration over the flags (new prefixes re-check endpoints, a new
//!    log prefix re-renders policy);
//! 2. [`masq_mgr`]: IPAM pools into the pool sets, then the static chains ([`config_mgr`]);
//! 3. [`policy_mgr`]: changed policies and profiles into their chains;
//! 4. [`endpoint_mgr`]: changed endpoints into their chains, then the dispatch chains;
//! 5. [`ipsets_mgr`]: IP sets created and updated (rules using a set the kernel refused are
//!    rendered again, failing closed);
//! 6. the [`tables`]: read back where needed, one `iptables-restore` per changed table (IP sets
//!    changing type move their rules to a copy first);
//! 7. [`routes_mgr`]: routes, neighbours and interface sysctls;
//! 8. [`ipsets_mgr`]: unused IP sets destroyed.
//!
//! Every table and the sets keep a view of the kernel and write only differences;
//! `request_refresh` drops those views so the next apply reads the kernel back and repairs
//! out-of-band changes. All IO goes through the seams: [`runner::CommandRunner`],
//! [`netlink::Netlink`], [`sysctl::Sysctl`].

pub mod config;
pub mod config_mgr;
pub mod endpoint_mgr;
#[cfg(any(test, feature = "test-util"))]
pub mod fake;
pub mod interfaces;
pub mod ipsets;
pub mod ipsets_mgr;
pub mod iptables;
pub mod masq_mgr;
pub mod netlink;
pub mod nft;
pub mod policy_mgr;
pub mod refusals;
pub mod routes;
pub mod routes_mgr;
pub mod rules;
pub mod runner;
pub mod sysctl;
pub mod tables;
pub mod validate;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use felix_proto::WorkloadEndpoint;
use tracing::info;

use self::config_mgr::ConfigManager;
use self::endpoint_mgr::EndpointManager;
use self::interfaces::Interfaces;
use self::ipsets_mgr::IpSetsManager;
use self::iptables::Backend;
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
use self::tables::Tables;
use super::{Driver, DriverError, EndpointStatuses, WorkloadEndpointKey};
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
    backend: Option<Backend>,
    /// Whether iptables and the kernel take `MASQUERADE --random-fully`; `None` until it is
    /// detected, with the backend, at the first apply.
    random_fully_supported: Option<bool>,
    /// Interfaces as the monitor sees them (the managers that need them hold them too).
    ifaces: Arc<Interfaces>,
    tables: Tables,
    refusals: Refusals,
    config: ConfigManager,
    masq: MasqManager,
    ipsets: IpSetsManager,
    policy: PolicyManager,
    endpoints: EndpointManager,
    routes: RouteManager,
    /// The last apply failed (endpoints changed since then report "error").
    apply_failed: bool,
    /// The nftables writer, when the driver programs nftables instead of iptables.
    nft: Option<nft::NftTables>,
    /// What the last nftables apply wrote.
    nft_stats: nft::NftStats,
    /// The other dataplane's state of ours (iptables and ipsets under nftables, the `calico`
    /// tables under iptables) is still to be removed, after our first complete apply.
    sweep_other: bool,
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
        let backend = match opts.backend {
            Backend::Auto => None,
            b => Some(b),
        };
        let nft = opts.nftables.then(|| nft::NftTables::new(&versions));
        Self {
            runner,
            backend,
            random_fully_supported: None,
            tables: Tables::new(&versions, opts.lock_wait_secs),
            refusals: Refusals::default(),
            masq: MasqManager::default(),
            ipsets: IpSetsManager::new(versions.clone()),
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
            nft,
            nft_stats: nft::NftStats::default(),
            sweep_other: true,
            config: ConfigManager::new(opts),
            apply_failed: false,
        }
    }

    /// What the last apply of the nftables driver wrote (zero for the iptables driver).
    pub fn nft_stats(&self) -> nft::NftStats {
        self.nft_stats
    }

    /// What is programmed (desired state after the last apply).
    pub fn programmed(&self) -> Programmed {
        let (ipsets, ipset_members) = self.ipsets.counts();
        Programmed {
            // nftables splits multi-port rules: count what the kernel holds.
            rules: self
                .nft
                .as_ref()
                .map_or_else(|| self.tables.rule_count(), nft::NftTables::rule_count),
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
        if self.random_fully_supported.is_none() && self.nft.is_some() {
            // nft's `masquerade fully-random` needs no iptables; the kernel is the limit.
            let supported =
                iptables::kernel_supports_fully_random(self.routes.kernel_release().as_deref());
            info!(
                masquerade_random_fully = supported,
                "nftables dataplane; features detected"
            );
            self.random_fully_supported = Some(supported);
        }
        if self.random_fully_supported.is_none() {
            let b = match self.backend {
                Some(b) => b,
                None => iptables::detect_backend(self.runner.as_mut()),
            };
            let supported = iptables::supports_masquerade_fully_random(
                self.runner.as_mut(),
                b,
                self.routes.kernel_release().as_deref(),
            );
            info!(
                backend = b.name(),
                masquerade_random_fully = supported,
                "iptables backend and features detected"
            );
            self.backend = Some(b);
            self.random_fully_supported = Some(supported);
        }
        if self.masq.apply(&mut self.ipsets) {
            self.config.mark_statics_dirty();
        }
        let fully_random = self.config.masq_fully_random(self.random_fully_supported);
        let masq = &self.masq;
        self.config
            .apply_statics(&mut self.tables, |v| masq.masquerading(v), fully_random);
        self.routes.ensure_netlink()?;
        self.policy.refresh_mangle_refs(self.endpoints.hosts());
        let opts = self.config.opts();
        self.policy
            .apply(&mut self.tables, &opts.render, &self.ipsets);
        self.endpoints.apply(&mut self.tables, opts);
        if self.nft.is_some() {
            return self.program_nftables();
        }
        let backend = self.backend.expect("resolved above");

        // Sets the kernel refused (or took back): the rules using them fail closed (or open
        // up again) in this same apply.
        let changed = self
            .ipsets
            .apply_updates(self.runner.as_mut())
            .map_err(|source| DriverError::IpSets {
                stage: "programmed",
                source,
            })?;
        if !changed.is_empty() {
            self.policy.dirty_users_of_sets(|id| {
                IpVersion::BOTH
                    .iter()
                    .any(|v| changed.contains(&ipset_name(*v, id)))
            });
            self.policy
                .apply(&mut self.tables, &self.config.opts().render, &self.ipsets);
        }
        self.tables
            .read_back(self.runner.as_mut(), backend)
            .map_err(DriverError::Tables)?;
        // IP sets that changed type: the rules move to the copy built beside the old set, the
        // set is recreated under its name, and the rules move back.
        let migrations = self.ipsets.migrations().to_vec();
        for m in &migrations {
            self.tables.rename_set(m.version, &m.name, &m.temp);
        }
        let mut result = self.tables.apply(self.runner.as_mut(), backend);
        if !migrations.is_empty() {
            if result.is_ok() {
                match self.ipsets.finish_migrations(self.runner.as_mut()) {
                    Ok(()) => info!(
                        sets = migrations.len(),
                        "IP sets recreated with their new type"
                    ),
                    Err(error) => {
                        tracing::warn!(%error, "IP sets could not be recreated with their new type; will retry")
                    }
                }
            } else {
                self.ipsets.abandon_migrations();
            }
            for m in &migrations {
                self.tables.rename_set(m.version, &m.temp, &m.name);
            }
            if result.is_ok() {
                result = self.tables.apply(self.runner.as_mut(), backend);
            }
        }
        self.refusals.kernel = BTreeMap::new();
        for t in self.tables.iter() {
            for (chain, owner, error) in t.refused() {
                let what = owner.map_or_else(|| format!("chain {chain}"), str::to_owned);
                self.refusals
                    .kernel
                    .entry(what)
                    .or_insert_with(|| format!("the kernel refused chain {chain}: {error}"));
            }
        }
        for (name, id, error) in self.ipsets.kernel_refused() {
            self.refusals.kernel.insert(
                format!("ipset {id:?}"),
                format!("the kernel refused IP set {name}: {error}"),
            );
        }
        result.map_err(DriverError::Tables)?;
        self.routes
            .apply(self.endpoints.workloads(), self.config.opts())
            .map_err(DriverError::Routes)?;
        self.ipsets
            .apply_deletions(self.runner.as_mut())
            .map_err(|source| DriverError::IpSets {
                stage: "destroyed",
                source,
            })?;
        if self.sweep_other {
            // Our nftables tables, from a time this node ran `--driver nftables`: removed only
            // now that iptables enforces everything, so there is no moment without policy.
            match nft::remove_tables(self.runner.as_mut()) {
                Ok(n) => {
                    if n > 0 {
                        info!(tables = n, "nftables state of the nftables driver removed");
                    }
                    self.sweep_other = false;
                }
                Err(error) => {
                    tracing::warn!(%error, "could not remove the nftables driver's tables; will retry")
                }
            }
        }
        Ok(())
    }

    /// The nftables half of [`LinuxDriver::program`]: one transaction for every chain and set,
    /// then routes; then, once, the iptables driver's state goes.
    fn program_nftables(&mut self) -> Result<(), DriverError> {
        let nft = self.nft.as_mut().expect("nftables mode");
        let stats = nft
            .apply(
                self.runner.as_mut(),
                &mut self.tables,
                self.ipsets.sets_mut(),
            )
            .map_err(DriverError::Nftables)?;
        if stats != Default::default() {
            // The one log of what each apply wrote (and whether it read the kernel back).
            tracing::debug!(?stats, "nftables transaction applied");
        }
        self.nft_stats = stats;
        self.refusals.kernel = BTreeMap::new();
        self.routes
            .apply(self.endpoints.workloads(), self.config.opts())
            .map_err(DriverError::Routes)?;
        if self.sweep_other {
            match sweep_iptables(self.runner.as_mut(), self.tables.versions(), self.backend) {
                Ok(()) => self.sweep_other = false,
                Err(error) => tracing::warn!(
                    error = %error,
                    "could not remove the iptables driver's rules and IP sets; will retry"
                ),
            }
        }
        Ok(())
    }
}

/// Removes the iptables driver's state (our chains, our rules in the kernel's chains, our IP
/// sets; recognised by name and rule comment as that driver does) by programming empty tables
/// and sets. Used by the nftables driver once its own rules are in place. A machine without
/// iptables or ipset has nothing to remove.
fn sweep_iptables(
    runner: &mut dyn CommandRunner,
    versions: &[IpVersion],
    backend: Option<Backend>,
) -> anyhow::Result<()> {
    let installed = |runner: &mut dyn CommandRunner, tool: &str| !matches!(runner.run(tool, &["--version"], None), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
    if installed(runner, "iptables-save") || installed(runner, "iptables-legacy-save") {
        let backend = backend.unwrap_or_else(|| iptables::detect_backend(runner));
        let mut tables = Tables::new(versions, 10);
        tables.read_back(runner, backend)?;
        tables.apply(runner, backend)?;
    }
    if installed(runner, "ipset") {
        let mut sets = ipsets::IpSets::new(versions.to_vec());
        sets.apply_updates(runner)?;
        let n = sets.apply_deletions(runner)?;
        if n > 0 {
            info!(sets = n, "IP sets of the iptables driver destroyed");
        }
    }
    Ok(())
}

impl Driver for LinuxDriver {
    /// Every manager sees every message and ignores what is not its own.
    fn on_update(&mut self, msg: &Message) {
        self.config.on_update(msg);
        self.masq.on_update(msg, &mut self.refusals);
        if let Some(id) = self.ipsets.on_update(msg, &mut self.refusals) {
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
        if self.nft.is_some() {
            // nftables holds each chain under its table's prefix (`filter-cali-pi-…`), in
            // every table the chain is placed in.
            let v = self.tables.versions()[0];
            let nft_names = |chains: &mut Vec<String>| {
                let mut named: Vec<String> = chains
                    .iter()
                    .flat_map(|c| {
                        let mut in_tables: Vec<String> = tables::TABLE_NAMES
                            .iter()
                            .filter(|t| self.tables.get(v, t).is_some_and(|t| t.has_chain(c)))
                            .map(|t| nft::render::chain_name(t, c))
                            .collect();
                        if in_tables.is_empty() {
                            in_tables.push(nft::render::chain_name("filter", c));
                        }
                        in_tables
                    })
                    .collect();
                named.sort();
                named.dedup();
                *chains = named;
            };
            objects
                .policies
                .iter_mut()
                .for_each(|p| nft_names(&mut p.chains));
            objects
                .profiles
                .iter_mut()
                .for_each(|p| nft_names(&mut p.chains));
            objects
                .endpoints
                .iter_mut()
                .for_each(|e| nft_names(&mut e.chains));
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

    fn refresh_interval(&self) -> Option<Duration> {
        Some(self.config.opts().refresh_interval)
    }

    fn request_refresh(&mut self) {
        if let Some(nft) = &mut self.nft {
            nft.invalidate();
        }
        self.tables.invalidate();
        self.ipsets.invalidate();
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

#[cfg(test)]
mod tests;
