//! The desired chains: one [`Table`] per table name (`filter`, `raw`, `mangle`, `nat`) and
//! family, each holding our chains (structured rules, the stream object they render) and the
//! rules we keep in the kernel's own chains ([`Hooks`]).
//!
//! Contract: [`Tables::table`] exists for every table in [`TABLE_NAMES`] and every family in
//! force. Setting a chain to the rules it already has changes nothing; any other set or
//! removal bumps the chain's generation and enters the change log that
//! [`Tables::take_changes`] hands to the writer.

use std::collections::{HashMap, HashSet};

use crate::driver::linux::rules::static_chains::Hooks;
use crate::driver::linux::rules::{Chain, IpVersion, Rule};

/// Every table we program, in the order they are written.
pub(crate) const TABLE_NAMES: [&str; 4] = ["filter", "raw", "mangle", "nat"];

/// One desired chain.
#[derive(Clone, Debug)]
pub(crate) struct DesiredChain {
    pub rules: Vec<Rule>,
    /// Bumped whenever the rules change: what a writer keys its own rendering by.
    pub generation: u64,
    /// The stream object the chain renders ("policy …"), if any. A writer that cannot program
    /// a chain with an owner makes its traffic fail closed; one without (our static and
    /// dispatch chains) keeps whatever version the kernel has.
    pub owner: Option<String>,
}

/// The chains of one table set or removed since the last look, and whether its hook rules
/// were set.
#[derive(Clone, Debug)]
pub(crate) struct TableChanges {
    pub table: &'static str,
    pub version: IpVersion,
    pub chains: HashSet<String>,
    pub hooks: bool,
}

/// The desired content of one table of one family.
pub(crate) struct Table {
    name: &'static str,
    version: IpVersion,
    chains: HashMap<String, DesiredChain>,
    hooks: Hooks,
    /// Chains set or removed since the last `take_changes`.
    changed: HashSet<String>,
    /// The hooks were set since the last `take_changes`.
    hooks_changed: bool,
    /// The last generation given to a chain.
    generation: u64,
}

impl Table {
    pub(crate) fn new(name: &'static str, version: IpVersion) -> Self {
        Self {
            name,
            version,
            chains: HashMap::new(),
            hooks: Hooks::default(),
            changed: HashSet::new(),
            hooks_changed: false,
            generation: 0,
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    pub(crate) fn version(&self) -> IpVersion {
        self.version
    }

    /// Sets (or replaces) one of our own chains (static or dispatch).
    pub(crate) fn set_chain(&mut self, chain: Chain) {
        self.put_chain(chain, None);
    }

    /// Sets (or replaces) a chain that renders the stream object `owner` ("policy …").
    pub(crate) fn set_owned_chain(&mut self, chain: Chain, owner: &str) {
        self.put_chain(chain, Some(owner));
    }

    fn put_chain(&mut self, chain: Chain, owner: Option<&str>) {
        if let Some(existing) = self.chains.get_mut(&chain.name)
            && existing.rules == chain.rules
        {
            if existing.owner.as_deref() != owner {
                existing.owner = owner.map(str::to_owned);
            }
            return;
        }
        self.changed.insert(chain.name.clone());
        self.generation += 1;
        self.chains.insert(
            chain.name,
            DesiredChain {
                rules: chain.rules,
                generation: self.generation,
                owner: owner.map(str::to_owned),
            },
        );
    }

    /// Points every rule that matches IP set `from` at set `to` instead (an IP set changing
    /// type is rebuilt beside the old one, then the rules move to it). Returns how many chains
    /// changed.
    pub(crate) fn rename_set(&mut self, from: &str, to: &str) -> usize {
        let changed: Vec<(Chain, Option<String>)> = self
            .chains
            .iter()
            .filter_map(|(name, d)| {
                let mut any = false;
                let rules: Vec<Rule> = d
                    .rules
                    .iter()
                    .map(|r| match r.matches.with_set_renamed(from, to) {
                        Some(m) => {
                            any = true;
                            Rule {
                                matches: m,
                                ..r.clone()
                            }
                        }
                        None => r.clone(),
                    })
                    .collect();
                any.then(|| (Chain::new(name.clone(), rules), d.owner.clone()))
            })
            .collect();
        let n = changed.len();
        for (chain, owner) in changed {
            self.put_chain(chain, owner.as_deref());
        }
        n
    }

    /// Our desired chains by name.
    pub(crate) fn chains(&self) -> impl Iterator<Item = (&str, &DesiredChain)> {
        self.chains.iter().map(|(n, d)| (n.as_str(), d))
    }

    /// One desired chain.
    pub(crate) fn chain(&self, name: &str) -> Option<&DesiredChain> {
        self.chains.get(name)
    }

    /// The chain's name as this table stores it (a borrow that outlives `name`).
    pub(crate) fn chain_key(&self, name: &str) -> Option<&str> {
        self.chains.get_key_value(name).map(|(k, _)| k.as_str())
    }

    /// The rules we keep in the kernel's own chains.
    pub(crate) fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    /// Sets the rules we keep in the kernel's own chains.
    pub(crate) fn set_hooks(&mut self, hooks: Hooks) {
        self.hooks_changed = true;
        self.hooks = hooks;
    }

    pub(crate) fn remove_chain(&mut self, name: &str) {
        if self.chains.remove(name).is_some() {
            self.changed.insert(name.to_owned());
        }
    }

    pub(crate) fn has_chain(&self, name: &str) -> bool {
        self.chains.contains_key(name)
    }

    /// Number of rules in our desired chains.
    pub(crate) fn rule_count(&self) -> usize {
        self.chains.values().map(|c| c.rules.len()).sum()
    }

    /// The chains set or removed, and whether the hooks were set, since the last call.
    pub(crate) fn take_changes(&mut self) -> (HashSet<String>, bool) {
        (
            std::mem::take(&mut self.changed),
            std::mem::take(&mut self.hooks_changed),
        )
    }
}

/// The desired tables, for every family in force.
pub(crate) struct Tables {
    versions: Vec<IpVersion>,
    tables: Vec<Table>,
}

impl Tables {
    pub(crate) fn new(versions: &[IpVersion]) -> Self {
        let tables = versions
            .iter()
            .flat_map(|v| TABLE_NAMES.iter().map(|name| Table::new(name, *v)))
            .collect();
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

    /// Every table, in [`TABLE_NAMES`] order within each family.
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

    /// Rules of ours, all tables and families.
    pub(crate) fn rule_count(&self) -> usize {
        self.tables.iter().map(Table::rule_count).sum()
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::linux::rules::Action;

    fn chain(name: &str, n: usize) -> Chain {
        Chain::new(name, vec![Rule::always(Action::Accept); n])
    }

    #[test]
    fn only_real_changes_enter_the_log_and_bump_the_generation() {
        let mut t = Table::new("filter", IpVersion::V4);
        t.set_chain(chain("cali-a", 1));
        let g = t.chain("cali-a").unwrap().generation;
        assert_eq!(t.take_changes().0, HashSet::from(["cali-a".to_owned()]));
        // The same rules again: no change, even with a new owner.
        t.set_owned_chain(chain("cali-a", 1), "policy p");
        assert!(t.take_changes().0.is_empty());
        assert_eq!(t.chain("cali-a").unwrap().generation, g);
        assert_eq!(
            t.chain("cali-a").unwrap().owner.as_deref(),
            Some("policy p")
        );
        t.set_chain(chain("cali-a", 2));
        assert!(t.chain("cali-a").unwrap().generation > g);
        t.remove_chain("cali-a");
        t.remove_chain("cali-never");
        assert_eq!(t.take_changes().0, HashSet::from(["cali-a".to_owned()]));
        t.set_hooks(Hooks::default());
        assert!(t.take_changes().1);
        assert!(!t.take_changes().1);
    }
}
