//! The kernel writers: what turns the desired state the managers recorded into kernel state.
//!
//! ```text
//!  config_mgr · masq_mgr · policy_mgr · endpoint_mgr · ipsets_mgr      (on_update: no IO)
//!         │ chains (with their owners) and hooks      │ sets and members
//!         ▼                                            ▼
//!  desired state (no writer's syntax): desired::Tables · desired::Sets, each with a change log
//!         │
//!         ▼  one KernelWriter, chosen once at start (--driver)
//!  ┌──────────────┴────────────────────┐
//!  IptablesWriter                       NftWriter
//!  iptables::KernelTable + ipsets::IpSets   nft::NftTables
//!  iptables-restore + ipset             one nfnetlink batch (nft -f fallback)
//! ```
//!
//! Each writer keeps its own view of the kernel and its own rendering (the iptables writer its
//! `cali:` hashes, the nftables writer its rendered chains and ops), takes the change logs, and
//! reads nothing of the other. The driver runs the managers, then [`KernelWriter::write`], then
//! routes, then [`KernelWriter::finish`]; nothing outside the choice in
//! [`super::LinuxDriver::with_seams`] asks which writer is in force.

mod iptables;
mod nftables;

pub(crate) use self::iptables::IptablesWriter;
pub(crate) use self::nftables::NftWriter;

use std::collections::{BTreeMap, BTreeSet};

use super::desired::{Sets, Tables};
use super::nft::NftStats;
use super::rules::{IpVersion, RuleId};
use super::runner::CommandRunner;
use crate::driver::DriverError;

/// What one kernel rule of ours counted, with the rule it enforces. `line` names the kernel
/// rule and the write that created it (a rewritten rule counts again from zero under a new
/// `line`), so a tracker compares a count only with the same line's previous count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LineCount {
    pub line: String,
    pub id: RuleId,
    pub packets: u64,
    pub bytes: u64,
}

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

/// Told the kernel names of the IP sets the kernel refuses, renders again, into the tables and
/// in the same apply, the rules whose sets were refused or taken back.
pub(crate) type Rerender<'a> = dyn FnMut(&BTreeSet<String>, &mut Tables, &Sets) + 'a;

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
    /// for [`KernelWriter::finish`]), taking the desired state's change logs. `rerender` is
    /// told which sets the kernel refuses, once they are written. `refused` is set to what the
    /// kernel refused on its own ("<object>" → reason; those objects fail closed) once the
    /// writer knows it.
    fn write(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &mut Tables,
        sets: &mut Sets,
        rerender: &mut Rerender<'_>,
        refused: &mut BTreeMap<String, String>,
    ) -> Result<(), DriverError>;

    /// After routes: sets nothing uses any more go, and, once, the other writer's state.
    fn finish(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &Tables,
        sets: &mut Sets,
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

    /// The counters of every rule of ours whose counter is its rule's (see `Rule::counts`), as
    /// the kernel holds them now.
    fn read_counts(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &Tables,
    ) -> Result<Vec<LineCount>, DriverError>;

    /// What the last nftables write did (zero for any other writer).
    fn nft_stats(&self) -> NftStats {
        NftStats::default()
    }
}
