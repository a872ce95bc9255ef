//! The nftables writer: the desired chains and sets as one transaction per apply in Felix's
//! nftables layout ([`crate::driver::linux::nft`]); once its state is in place, the iptables
//! driver's state goes (programmed empty by the iptables writer's own [`super::iptables::sweep`]).

use std::collections::BTreeMap;

use tracing::info;

use super::{KernelWriter, Rerender, RuleAt};
use crate::driver::DriverError;
use crate::driver::linux::desired::{Sets, TABLE_NAMES, Tables};
use crate::driver::linux::iptables::{self, Backend};
use crate::driver::linux::nft::{self, NftStats, NftTables};
use crate::driver::linux::rules::{IpVersion, RuleId};
use crate::driver::linux::runner::CommandRunner;

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
        sets: &mut Sets,
        _rerender: &mut Rerender<'_>,
        refused: &mut BTreeMap<String, String>,
    ) -> Result<(), DriverError> {
        let stats = self
            .nft
            .apply(runner, tables, sets)
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
        _sets: &mut Sets,
    ) -> Result<(), DriverError> {
        if self.sweep_other {
            match super::iptables::sweep(runner, tables.versions(), self.backend) {
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
                let mut in_tables: Vec<String> = TABLE_NAMES
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
        tables.get(v, t)?.chain(c)?.rules.get(i)?.id.clone()
    }

    fn read_counts(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &Tables,
    ) -> Result<Vec<super::LineCount>, DriverError> {
        self.nft
            .read_counts(runner, tables)
            .map_err(DriverError::NftCounters)
    }

    fn nft_stats(&self) -> NftStats {
        self.stats
    }
}
