//! The nftables writer: the desired chains and sets as one transaction per apply in Felix's
//! nftables layout ([`crate::driver::linux::nft`]); once its state is in place, the iptables
//! driver's state goes.

use std::collections::BTreeMap;

use tracing::info;

use super::{KernelWriter, Rerender, RuleAt};
use crate::driver::DriverError;
use crate::driver::linux::ipsets::IpSets;
use crate::driver::linux::ipsets_mgr::IpSetsManager;
use crate::driver::linux::iptables::{self, Backend};
use crate::driver::linux::nft::{self, NftStats, NftTables};
use crate::driver::linux::rules::{IpVersion, RuleId};
use crate::driver::linux::runner::CommandRunner;
use crate::driver::linux::tables::{self, Tables};

/// Writes nftables (see the module documentation).
pub(crate) struct NftWriter {
    nft: NftTables,
    /// What the last write did.
    stats: NftStats,
    /// The `--iptables-backend` asked for, to find the iptables driver's state to remove.
    backend: Backend,
    /// The iptables driver's state is still to be removed, after our first complete write.
    sweep_other: bool,
}

impl NftWriter {
    pub(crate) fn new(versions: &[IpVersion], backend: Backend) -> Self {
        Self {
            nft: NftTables::new(versions),
            stats: NftStats::default(),
            backend,
            sweep_other: true,
        }
    }
}

#[cfg(test)]
impl NftWriter {
    /// A writer over `nft` (tests: its batches go to a fake).
    pub(crate) fn with_tables(nft: NftTables) -> Self {
        Self {
            nft,
            stats: NftStats::default(),
            backend: Backend::Auto,
            sweep_other: false,
        }
    }
}

impl KernelWriter for NftWriter {
    fn detect_fully_random(
        &mut self,
        _runner: &mut dyn CommandRunner,
        kernel_release: Option<&str>,
    ) -> bool {
        // nft's `masquerade fully-random` needs no iptables; the kernel is the limit.
        let supported = iptables::kernel_supports_fully_random(kernel_release);
        info!(
            masquerade_random_fully = supported,
            "nftables dataplane; features detected"
        );
        supported
    }

    fn write(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &mut Tables,
        ipsets: &mut IpSetsManager,
        _rerender: &mut Rerender<'_>,
        refused: &mut BTreeMap<String, String>,
    ) -> Result<(), DriverError> {
        let stats = self
            .nft
            .apply(runner, tables, ipsets.sets_mut())
            .map_err(DriverError::Nftables)?;
        if stats != Default::default() {
            // The one log of what each apply wrote (and whether it read the kernel back).
            tracing::debug!(?stats, "nftables transaction applied");
        }
        self.stats = stats;
        // One transaction: all of it went in.
        refused.clear();
        Ok(())
    }

    fn finish(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &Tables,
        _ipsets: &mut IpSetsManager,
    ) -> Result<(), DriverError> {
        if self.sweep_other {
            match sweep_iptables(runner, tables.versions(), self.backend) {
                Ok(()) => self.sweep_other = false,
                Err(error) => tracing::warn!(
                    error = %error,
                    "could not remove the iptables driver's rules and IP sets; will retry"
                ),
            }
        }
        Ok(())
    }

    fn invalidate(&mut self) {
        self.nft.invalidate();
    }

    /// nftables splits multi-port rules: what the kernel holds.
    fn rule_count(&self, _tables: &Tables) -> usize {
        self.nft.rule_count()
    }

    /// nftables holds each chain under its table's prefix (`filter-cali-pi-…`), in every
    /// table the chain is placed in.
    fn kernel_chain_names(&self, tables: &Tables, chains: &mut Vec<String>) {
        let v = tables.versions()[0];
        let mut named: Vec<String> = chains
            .iter()
            .flat_map(|c| {
                let mut in_tables: Vec<String> = tables::TABLE_NAMES
                    .iter()
                    .filter(|t| tables.get(v, t).is_some_and(|t| t.has_chain(c)))
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
    }

    fn rule_id(
        &self,
        tables: &Tables,
        v: IpVersion,
        table: &str,
        chain: &str,
        at: RuleAt<'_>,
    ) -> Option<RuleId> {
        if table != nft::TABLE {
            return None;
        }
        let (t, c, i) = match at {
            RuleAt::Position(p) => self.nft.source_rule(v, chain, p),
            RuleAt::Comment(comment) => self.nft.source_rule_by_comment(v, chain, comment),
        }?;
        let (rules, _) = tables.get(v, t)?.desired_chain(c)?;
        rules.get(i)?.id.clone()
    }

    fn nft_stats(&self) -> NftStats {
        self.stats
    }
}

/// Removes the iptables driver's state (our chains, our rules in the kernel's chains, our IP
/// sets; recognised by name and rule comment as that driver does) by programming empty tables
/// and sets. Used by the nftables driver once its own rules are in place. A machine without
/// iptables or ipset has nothing to remove.
fn sweep_iptables(
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
        let mut tables = Tables::new(versions, 10);
        tables.read_back(runner, backend)?;
        tables.apply(runner, backend)?;
    }
    if installed(runner, "ipset") {
        let mut sets = IpSets::new(versions.to_vec());
        sets.apply_updates(runner)?;
        let n = sets.apply_deletions(runner)?;
        if n > 0 {
            info!(sets = n, "IP sets of the iptables driver destroyed");
        }
    }
    Ok(())
}
