//! The kernel writers: what turns the desired state the managers recorded into kernel state.
//!
//! ```text
//!  config_mgr · masq_mgr · policy_mgr · endpoint_mgr · ipsets_mgr      (on_update: no IO)
//!         │ chains (with their owners) and hooks      │ sets and members
//!         ▼                                            ▼
//!  desired state: tables::Tables (per table and family) · ipsets_mgr::IpSetsManager
//!         │
//!         ▼  one KernelWriter, chosen once at start (--driver)
//!  ┌──────────────┴───────────────┐
//!  IptablesWriter                  NftWriter
//!  iptables-restore + ipset        one nfnetlink batch (nft -f fallback)
//! ```
//!
//! The driver runs the managers, then [`KernelWriter::write`], then routes, then
//! [`KernelWriter::finish`]; nothing outside the choice in [`super::LinuxDriver::with_seams`]
//! asks which writer is in force.

mod iptables;
mod nftables;

pub(crate) use self::iptables::IptablesWriter;
pub(crate) use self::nftables::NftWriter;

use std::collections::{BTreeMap, BTreeSet};

use super::ipsets_mgr::IpSetsManager;
use super::nft::NftStats;
use super::rules::{IpVersion, RuleId};
use super::runner::CommandRunner;
use super::tables::Tables;
use crate::driver::DriverError;

/// Where a rule sits in a kernel chain, as counters and logs find it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleAt<'a> {
    /// 1-based, in the order the kernel lists the chain (`iptables -L --line-numbers`,
    /// `iptables-save`, `nft -a list chain`).
    Position(usize),
    /// The rule's comment (`cali:<hash>` for iptables, `cali:<hash>; …` for nftables), or an
    /// `iptables-save` rule line holding it.
    Comment(&'a str),
}

/// Renders the rules that use the given kernel set names again (their sets were refused by
/// the kernel, or taken back), into the tables, in the same apply.
pub(crate) type Rerender<'a> = dyn FnMut(&BTreeSet<String>, &mut Tables, &IpSetsManager) + 'a;

/// One way of writing the desired state to the kernel.
pub(crate) trait KernelWriter: Send {
    /// Detects, once before the first write, whether masquerading may use fully random source
    /// ports through this writer (the tool and the kernel).
    fn detect_fully_random(
        &mut self,
        runner: &mut dyn CommandRunner,
        kernel_release: Option<&str>,
    ) -> bool;

    /// Writes the chains and sets (everything but the destruction of unused sets, which waits
    /// for [`KernelWriter::finish`]). `rerender` is called when rules must be rendered again
    /// because the kernel refused (or took back) a set they use. `refused` is set to what the
    /// kernel refused on its own ("<object>" → reason; those objects fail closed) once the
    /// writer knows it.
    fn write(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &mut Tables,
        ipsets: &mut IpSetsManager,
        rerender: &mut Rerender<'_>,
        refused: &mut BTreeMap<String, String>,
    ) -> Result<(), DriverError>;

    /// After routes: sets nothing uses any more go, and, once, the other writer's state.
    fn finish(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &Tables,
        ipsets: &mut IpSetsManager,
    ) -> Result<(), DriverError>;

    /// The next write reads the kernel back and repairs what differs.
    fn invalidate(&mut self);

    /// Rules of ours in the kernel as this writer lays them out.
    fn rule_count(&self, tables: &Tables) -> usize;

    /// Renames the chains of one object to the names this writer gives them in the kernel.
    fn kernel_chain_names(&self, _tables: &Tables, _chains: &mut Vec<String>) {}

    /// The id of a rule of ours in the kernel, found in `table` (the iptables table, or
    /// `calico` for nftables), chain `chain` as the kernel names it, family `v`.
    fn rule_id(
        &self,
        tables: &Tables,
        v: IpVersion,
        table: &str,
        chain: &str,
        at: RuleAt<'_>,
    ) -> Option<RuleId>;

    /// What the last nftables write did (zero for any other writer).
    fn nft_stats(&self) -> NftStats {
        NftStats::default()
    }
}
