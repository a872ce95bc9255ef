//! The iptables+ipset writer: one `ipset restore` for the sets, one `iptables-restore
//! --noflush` per changed table (legacy or nft backend), unused sets destroyed after routes.
//! It keeps its own view of the kernel ([`KernelTable`] per table and family, [`IpSets`]) and
//! its own `cali:` hashes, fed from the desired state's change log.

use std::collections::BTreeMap;

use tracing::{debug, info, warn};

use super::{KernelWriter, LineCount, Rerender, RuleAt};
use crate::driver::DriverError;
use crate::driver::linux::desired::{Sets, TABLE_NAMES, Tables};
use crate::driver::linux::ipsets::IpSets;
use crate::driver::linux::iptables::{self, Backend, KernelTable, TableApplyError};
use crate::driver::linux::nft;
use crate::driver::linux::rules::{IpVersion, RuleId};
use crate::driver::linux::runner::CommandRunner;

/// Writes iptables and ipsets (see the module documentation).
pub(crate) struct IptablesWriter {
    /// `None` until detected at the first write (`--iptables-backend auto`).
    backend: Option<Backend>,
    /// The nftables driver's tables are still to be removed, after our first complete write.
    sweep_other: bool,
    tables: KernelTables,
    ipsets: IpSets,
}

impl IptablesWriter {
    pub(crate) fn new(versions: &[IpVersion], backend: Backend, lock_wait_secs: u32) -> Self {
        Self {
            backend: (backend != Backend::Auto).then_some(backend),
            sweep_other: true,
            tables: KernelTables::new(versions, lock_wait_secs),
            ipsets: IpSets::default(),
        }
    }

    fn backend(&mut self, runner: &mut dyn CommandRunner) -> Backend {
        *self
            .backend
            .get_or_insert_with(|| iptables::detect_backend(runner))
    }
}

impl KernelWriter for IptablesWriter {
    fn detect_fully_random(
        &mut self,
        runner: &mut dyn CommandRunner,
        kernel_release: Option<&str>,
    ) -> bool {
        let b = self.backend(runner);
        let supported = iptables::supports_masquerade_fully_random(runner, b, kernel_release);
        info!(
            backend = b.name(),
            masquerade_random_fully = supported,
            "iptables backend and features detected"
        );
        supported
    }

    fn write(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &mut Tables,
        sets: &mut Sets,
        rerender: &mut Rerender<'_>,
        refused: &mut BTreeMap<String, String>,
    ) -> Result<(), DriverError> {
        let backend = self.backend(runner);
        self.ipsets.take_changes(sets.take_changes());
        let st = self
            .ipsets
            .apply_updates(runner, sets)
            .map_err(|source| DriverError::IpSets {
                stage: "programmed",
                source,
            })?;
        if st != Default::default() {
            debug!(?st, "ipsets updated");
        }
        // Sets the kernel refused (or took back): the rules using them fail closed (or open
        // up again) in this same apply.
        rerender(&self.ipsets.refused_names(), tables, sets);
        self.tables.take_changes(tables);
        self.tables
            .read_back(runner, backend)
            .map_err(DriverError::Tables)?;
        // IP sets that changed type: the rules move to the copy built beside the old set, the
        // set is recreated under its name, and the rules move back.
        let migrations = self.ipsets.migrations().to_vec();
        for m in &migrations {
            tables.rename_set(m.version, &m.name, &m.temp);
        }
        self.tables.take_changes(tables);
        let mut result = self.tables.apply(tables, runner, backend);
        if !migrations.is_empty() {
            if result.is_ok() {
                match self.ipsets.finish_migrations(runner, sets) {
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
                tables.rename_set(m.version, &m.temp, &m.name);
            }
            self.tables.take_changes(tables);
            if result.is_ok() {
                result = self.tables.apply(tables, runner, backend);
            }
        }
        *refused = self.kernel_refusals(tables, sets);
        result.map_err(DriverError::Tables)
    }

    fn finish(
        &mut self,
        runner: &mut dyn CommandRunner,
        _tables: &Tables,
        sets: &mut Sets,
    ) -> Result<(), DriverError> {
        self.ipsets.take_changes(sets.take_changes());
        let destroyed = self
            .ipsets
            .apply_deletions(runner, sets)
            .map_err(|source| DriverError::IpSets {
                stage: "destroyed",
                source,
            })?;
        if destroyed > 0 {
            debug!(destroyed, "unused ipsets destroyed");
        }
        if self.sweep_other {
            // Our nftables tables, from a time this node ran `--driver nftables`: removed only
            // now that iptables enforces everything, so there is no moment without policy.
            match nft::remove_tables(runner) {
                Ok(()) => {
                    debug!("nftables state of the nftables driver removed, if there was any");
                    self.sweep_other = false;
                }
                Err(error) => {
                    warn!(%error, "could not remove the nftables driver's tables; will retry")
                }
            }
        }
        Ok(())
    }

    fn invalidate(&mut self) {
        self.tables.invalidate();
        self.ipsets.invalidate();
    }

    fn rule_count(&self, tables: &Tables) -> usize {
        tables.rule_count()
    }

    /// One `-save -c` per family: the kernel's exact per-rule counters, for both backends.
    fn read_counts(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &Tables,
    ) -> Result<Vec<LineCount>, DriverError> {
        let backend = self.backend(runner);
        let mut out = Vec::new();
        for v in tables.versions().to_vec() {
            let counted =
                iptables::save_counted(runner, backend, v).map_err(DriverError::Counters)?;
            for c in counted {
                let (Some(k), Some(d)) = (self.tables.get(v, &c.table), tables.get(v, &c.table))
                else {
                    continue;
                };
                let Some(id) = k
                    .rule_by_comment(d, &c.chain, &c.hash)
                    .and_then(|r| r.counted_id())
                else {
                    continue;
                };
                out.push(LineCount {
                    line: format!(
                        "{}|{}|{}|{}|{}",
                        v.number(),
                        c.table,
                        c.chain,
                        c.hash,
                        k.epoch(&c.chain)
                    ),
                    id: id.clone(),
                    packets: c.packets,
                    bytes: c.bytes,
                });
            }
        }
        Ok(out)
    }

    fn rule_id(
        &self,
        tables: &Tables,
        v: IpVersion,
        table: &str,
        chain: &str,
        at: RuleAt<'_>,
    ) -> Option<RuleId> {
        let d = tables.get(v, table)?;
        let k = self.tables.get(v, table)?;
        match at {
            RuleAt::Position(p) => k.rule_id_at(d, chain, p),
            RuleAt::Comment(c) => k.rule_id_by_comment(d, chain, c),
        }
        .cloned()
    }
}

impl IptablesWriter {
    /// What the kernel refused on its own, by object: chains (a stream object's chain by its
    /// object) and IP sets.
    fn kernel_refusals(&self, tables: &Tables, sets: &Sets) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for k in &self.tables.tables {
            let Some(d) = tables.get(k.version(), k.name()) else {
                continue;
            };
            for (chain, owner, error) in k.refused(d) {
                let what = owner.map_or_else(|| format!("chain {chain}"), str::to_owned);
                out.entry(what)
                    .or_insert_with(|| format!("the kernel refused chain {chain}: {error}"));
            }
        }
        for (name, id, error) in self.ipsets.refused(sets) {
            out.insert(
                format!("ipset {id:?}"),
                format!("the kernel refused IP set {name}: {error}"),
            );
        }
        out
    }
}

/// The writer's view of every table of every family in force.
struct KernelTables {
    versions: Vec<IpVersion>,
    tables: Vec<KernelTable>,
}

impl KernelTables {
    fn new(versions: &[IpVersion], lock_wait_secs: u32) -> Self {
        let tables = versions
            .iter()
            .flat_map(|v| {
                TABLE_NAMES
                    .iter()
                    .map(move |name| KernelTable::new(name, *v, lock_wait_secs))
            })
            .collect();
        Self {
            versions: versions.to_vec(),
            tables,
        }
    }

    fn get(&self, v: IpVersion, name: &str) -> Option<&KernelTable> {
        self.tables
            .iter()
            .find(|t| t.version() == v && t.name() == name)
    }

    /// Takes every desired table's change log.
    fn take_changes(&mut self, d: &mut Tables) {
        for k in &mut self.tables {
            k.take_changes(d.table(k.version(), k.name()));
        }
    }

    fn invalidate(&mut self) {
        for t in &mut self.tables {
            t.invalidate();
        }
    }

    /// Reads back every table that needs it, one save per family, before any is written: an
    /// nft save costs as much as the whole ruleset, so it is done while the kernel is small.
    fn read_back(
        &mut self,
        runner: &mut dyn CommandRunner,
        backend: Backend,
    ) -> Result<(), TableApplyError> {
        for v in self.versions.clone() {
            if self
                .tables
                .iter()
                .any(|t| t.version() == v && t.needs_read_back())
            {
                let text = iptables::save_all(runner, backend, v).map_err(|source| {
                    TableApplyError::ReadBack {
                        version: v.number(),
                        source,
                    }
                })?;
                for t in self
                    .tables
                    .iter_mut()
                    .filter(|t| t.version() == v && t.needs_read_back())
                {
                    t.load_kernel_view(&text);
                }
            }
        }
        Ok(())
    }

    /// Writes every table (after [`KernelTables::take_changes`]); the first error, after
    /// trying them all, so one table's trouble does not hold back the others.
    fn apply(
        &mut self,
        d: &Tables,
        runner: &mut dyn CommandRunner,
        backend: Backend,
    ) -> Result<(), TableApplyError> {
        let mut first_error = None;
        for t in &mut self.tables {
            let Some(dt) = d.get(t.version(), t.name()) else {
                continue;
            };
            match t.apply(dt, runner, backend) {
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
                    first_error.get_or_insert(TableApplyError::Restore {
                        table: t.name(),
                        version: t.version().number(),
                        source: e,
                    });
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Removes the iptables driver's state (our chains, our rules in the kernel's chains, our IP
/// sets; recognised by name and rule comment) by programming empty tables and sets. Used by
/// the nftables writer once its own rules are in place. A machine without iptables or ipset
/// has nothing to remove.
pub(crate) fn sweep(
    runner: &mut dyn CommandRunner,
    versions: &[IpVersion],
    backend: Backend,
) -> anyhow::Result<()> {
    let installed = |runner: &mut dyn CommandRunner, tool: &str| !matches!(runner.run(tool, &["--version"], None), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
    if installed(runner, "iptables-save") || installed(runner, "iptables-legacy-save") {
        let backend = match backend {
            Backend::Auto => iptables::detect_backend(runner),
            b => b,
        };
        let empty = Tables::new(versions);
        let mut kernel = KernelTables::new(versions, 10);
        kernel.read_back(runner, backend)?;
        kernel.apply(&empty, runner, backend)?;
    }
    if installed(runner, "ipset") {
        let empty = Sets::new(versions.to_vec());
        let mut sets = IpSets::default();
        sets.apply_updates(runner, &empty)?;
        let n = sets.apply_deletions(runner, &empty)?;
        if n > 0 {
            info!(sets = n, "IP sets of the iptables driver destroyed");
        }
    }
    Ok(())
}
