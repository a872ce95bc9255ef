//! The iptables tables the managers render into: one [`Table`] per table name and family.
//!
//! Managers only declare chains here (`set_chain`, `set_owned_chain`, `remove_chain`); the
//! driver writes every table to the kernel once per apply, after the IP sets exist. Contract:
//! [`Tables::table`] exists for every table in [`TABLE_NAMES`] and every family in force, and
//! [`Tables::apply`] tries every table before it reports the first failure, so one table's
//! trouble does not hold back the others.

use tracing::{debug, warn};

use super::iptables::{self, Backend, Table, TableError};
use super::rules::IpVersion;
use super::runner::CommandRunner;

/// Every table we program, in the order they are written.
pub(crate) const TABLE_NAMES: [&str; 4] = ["filter", "raw", "mangle", "nat"];

/// The desired tables and what the kernel holds, for every family in force.
pub(crate) struct Tables {
    versions: Vec<IpVersion>,
    tables: Vec<Table>,
}

/// The chains of one table set or removed since the last look, and whether its hook rules
/// were set.
#[derive(Clone, Debug)]
pub(crate) struct TableChanges {
    pub table: &'static str,
    pub version: IpVersion,
    pub chains: std::collections::HashSet<String>,
    pub hooks: bool,
}

/// Why the tables could not be read back or written.
#[derive(Debug, thiserror::Error)]
pub enum TableApplyError {
    /// `iptables-save` for one family failed.
    #[error("reading back the IPv{version} tables")]
    ReadBack {
        version: u8,
        #[source]
        source: TableError,
    },
    /// The first table whose restore failed (every table was tried).
    #[error("table {table} (IPv{version})")]
    Restore {
        table: &'static str,
        version: u8,
        #[source]
        source: TableError,
    },
}

impl Tables {
    pub(crate) fn new(versions: &[IpVersion], lock_wait_secs: u32) -> Self {
        let mut tables = Vec::new();
        for v in versions {
            for name in TABLE_NAMES {
                let mut t = Table::new(name, *v);
                t.lock_wait_secs = lock_wait_secs;
                tables.push(t);
            }
        }
        Self {
            versions: versions.to_vec(),
            tables,
        }
    }

    /// The families programmed (IPv4, and IPv6 unless it is off).
    pub(crate) fn versions(&self) -> &[IpVersion] {
        &self.versions
    }

    pub(crate) fn table(&mut self, v: IpVersion, name: &str) -> &mut Table {
        self.tables
            .iter_mut()
            .find(|t| t.version() == v && t.name() == name)
            .expect("tables exist for every programmed family")
    }

    /// The table, if that family is programmed.
    pub(crate) fn get(&self, v: IpVersion, name: &str) -> Option<&Table> {
        self.tables
            .iter()
            .find(|t| t.version() == v && t.name() == name)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Table> {
        self.tables.iter()
    }

    /// Removes the named chains from every table of family `v`.
    pub(crate) fn remove_everywhere(&mut self, v: IpVersion, names: &[String]) {
        for t in self.tables.iter_mut().filter(|t| t.version() == v) {
            for n in names {
                t.remove_chain(n);
            }
        }
    }

    /// Points every rule of family `v` that matches set `from` at set `to`.
    pub(crate) fn rename_set(&mut self, v: IpVersion, from: &str, to: &str) {
        for t in self.tables.iter_mut().filter(|t| t.version() == v) {
            t.rename_set(from, to);
        }
    }

    /// The tables are written by a writer other than iptables (see
    /// [`Table::skip_iptables_hashes`]).
    pub(crate) fn skip_iptables_hashes(&mut self) {
        for t in &mut self.tables {
            t.skip_iptables_hashes();
        }
    }

    /// Rules of ours, all tables and families.
    pub(crate) fn rule_count(&self) -> usize {
        self.tables.iter().map(Table::rule_count).sum()
    }

    /// Starts recording changes in every table (for [`Tables::take_changes`]).
    pub(crate) fn track_changes(&mut self) {
        for t in &mut self.tables {
            t.track_changes();
        }
    }

    /// What changed in each table since the last call (tables without changes left out).
    pub(crate) fn take_changes(&mut self) -> Vec<TableChanges> {
        self.tables
            .iter_mut()
            .filter_map(|t| {
                let (chains, hooks) = t.take_changes();
                (hooks || !chains.is_empty()).then(|| TableChanges {
                    table: t.name(),
                    version: t.version(),
                    chains,
                    hooks,
                })
            })
            .collect()
    }

    /// Forgets what the kernel holds: the next apply reads every table back.
    pub(crate) fn invalidate(&mut self) {
        for t in &mut self.tables {
            t.invalidate();
        }
    }

    /// Reads back every table that needs it, one save per family, before any is written: an
    /// nft save costs as much as the whole ruleset, so it is done while the kernel is small.
    pub(crate) fn read_back(
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

    /// Writes every table; the first error, after trying them all.
    pub(crate) fn apply(
        &mut self,
        runner: &mut dyn CommandRunner,
        backend: Backend,
    ) -> Result<(), TableApplyError> {
        let mut first_error = None;
        for t in &mut self.tables {
            match t.apply(runner, backend) {
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
