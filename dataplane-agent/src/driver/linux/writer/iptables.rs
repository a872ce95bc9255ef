//! The iptables+ipset writer: one `ipset restore` for the sets, one `iptables-restore
//! --noflush` per changed table (legacy or nft backend), unused sets destroyed after routes.

use std::collections::BTreeMap;

use tracing::info;

use super::{KernelWriter, Rerender, RuleAt};
use crate::driver::DriverError;
use crate::driver::linux::ipsets_mgr::IpSetsManager;
use crate::driver::linux::iptables::{self, Backend};
use crate::driver::linux::nft;
use crate::driver::linux::rules::{IpVersion, RuleId};
use crate::driver::linux::runner::CommandRunner;
use crate::driver::linux::tables::Tables;

/// Writes iptables and ipsets (see the module documentation).
pub(crate) struct IptablesWriter {
    /// `None` until detected at the first write (`--iptables-backend auto`).
    backend: Option<Backend>,
    /// The nftables driver's tables are still to be removed, after our first complete write.
    sweep_other: bool,
}

impl IptablesWriter {
    pub(crate) fn new(backend: Backend) -> Self {
        Self {
            backend: (backend != Backend::Auto).then_some(backend),
            sweep_other: true,
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
        ipsets: &mut IpSetsManager,
        rerender: &mut Rerender<'_>,
        refused: &mut BTreeMap<String, String>,
    ) -> Result<(), DriverError> {
        let backend = self.backend(runner);
        // Sets the kernel refused (or took back): the rules using them fail closed (or open
        // up again) in this same apply.
        let changed = ipsets
            .apply_updates(runner)
            .map_err(|source| DriverError::IpSets {
                stage: "programmed",
                source,
            })?;
        if !changed.is_empty() {
            rerender(&changed, tables, ipsets);
        }
        tables
            .read_back(runner, backend)
            .map_err(DriverError::Tables)?;
        // IP sets that changed type: the rules move to the copy built beside the old set, the
        // set is recreated under its name, and the rules move back.
        let migrations = ipsets.migrations().to_vec();
        for m in &migrations {
            tables.rename_set(m.version, &m.name, &m.temp);
        }
        let mut result = tables.apply(runner, backend);
        if !migrations.is_empty() {
            if result.is_ok() {
                match ipsets.finish_migrations(runner) {
                    Ok(()) => info!(
                        sets = migrations.len(),
                        "IP sets recreated with their new type"
                    ),
                    Err(error) => {
                        tracing::warn!(%error, "IP sets could not be recreated with their new type; will retry")
                    }
                }
            } else {
                ipsets.abandon_migrations();
            }
            for m in &migrations {
                tables.rename_set(m.version, &m.temp, &m.name);
            }
            if result.is_ok() {
                result = tables.apply(runner, backend);
            }
        }
        *refused = kernel_refusals(tables, ipsets);
        result.map_err(DriverError::Tables)
    }
    fn finish(
        &mut self,
        runner: &mut dyn CommandRunner,
        _tables: &Tables,
        ipsets: &mut IpSetsManager,
    ) -> Result<(), DriverError> {
        ipsets
            .apply_deletions(runner)
            .map_err(|source| DriverError::IpSets {
                stage: "destroyed",
                source,
            })?;
        if self.sweep_other {
            // Our nftables tables, from a time this node ran `--driver nftables`: removed only
            // now that iptables enforces everything, so there is no moment without policy.
            match nft::remove_tables(runner) {
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

    fn invalidate(&mut self) {
        // The kernel views live beside the desired chains and sets (`Tables`, `IpSets`), which
        // the driver invalidates for every writer.
    }

    fn rule_count(&self, tables: &Tables) -> usize {
        tables.rule_count()
    }

    fn rule_id(
        &self,
        tables: &Tables,
        v: IpVersion,
        table: &str,
        chain: &str,
        at: RuleAt<'_>,
    ) -> Option<RuleId> {
        let t = tables.get(v, table)?;
        match at {
            RuleAt::Position(p) => t.rule_id_at(chain, p),
            RuleAt::Comment(c) => t.rule_id_by_comment(chain, c),
        }
        .cloned()
    }
}

/// What the kernel refused on its own, by object: chains (a stream object's chain by its
/// object) and IP sets.
fn kernel_refusals(tables: &Tables, ipsets: &IpSetsManager) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for t in tables.iter() {
        for (chain, owner, error) in t.refused() {
            let what = owner.map_or_else(|| format!("chain {chain}"), str::to_owned);
            out.entry(what)
                .or_insert_with(|| format!("the kernel refused chain {chain}: {error}"));
        }
    }
    for (name, id, error) in ipsets.kernel_refused() {
        out.insert(
            format!("ipset {id:?}"),
            format!("the kernel refused IP set {name}: {error}"),
        );
    }
    out
}
