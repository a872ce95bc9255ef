//! The nftables writer: the desired chains ([`Tables`]) and sets ([`Sets`]), programmed as Felix's nftables mode lays them out (one `calico` table per family,
//! chains prefixed with their iptables table, base chains hooked at the iptables priorities,
//! IP sets as native sets, workload dispatch through `ifname` verdict maps).
//!
//! Contract: every [`NftTables::apply`] is one kernel transaction holding only what differs
//! from the kernel view (chains replaced whole, set and map elements added and removed, stale
//! objects deleted), so the kernel moves from one complete state to the next with nothing in
//! between: one nfnetlink batch, or the same transaction as an `nft -f -` script when a rule
//! has no netlink encoding or the kernel refused the batch. When it fails nothing changed and
//! the view is read back before the retry.
//! [`NftTables::invalidate`] makes the next apply read the kernel back (`nft -j list table`) and
//! repair what changed behind our back. Everything in the `calico` tables is ours.

pub(crate) mod expr;
pub(crate) mod netlink;
pub(crate) mod render;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;

use tracing::{debug, warn};

use super::desired::{SetKind, Sets, TableChanges, Tables};
use super::rules::static_chains::{FROM_WL_DISPATCH, TO_WL_DISPATCH};
use netlink::Op;

use super::rules::{Action, Frag, IpVersion, Rule};
use super::runner::CommandRunner;

/// The table of ours in each family.
pub(crate) const TABLE: &str = "calico";

/// Statements per element command (keeps single lines of a big transaction reasonable).
const ELEMENTS_PER_STATEMENT: usize = 1000;

/// Why the nftables state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("could not run nft")]
    Spawn(#[source] std::io::Error),
    #[error("nft {what} failed: {stderr}")]
    Failed { what: &'static str, stderr: String },
    #[error("nft -j list table {family} {TABLE} printed what we cannot read: {reason}")]
    Parse {
        family: &'static str,
        reason: String,
    },
}

/// A base chain's hook, as Felix's nftables mode declares them.
fn base_chain(table: &str, chain: &str) -> Option<netlink::Hook> {
    let (kind, hook, priority) = match (table, chain) {
        ("raw", "PREROUTING") => ("filter", "prerouting", -300),
        ("raw", "OUTPUT") => ("filter", "output", -300),
        ("mangle", "PREROUTING") => ("filter", "prerouting", -150),
        ("mangle", "INPUT") => ("filter", "input", -150),
        ("mangle", "FORWARD") => ("filter", "forward", -150),
        ("mangle", "OUTPUT") => ("route", "output", -150),
        ("mangle", "POSTROUTING") => ("filter", "postrouting", -150),
        ("filter", "INPUT") => ("filter", "input", 0),
        ("filter", "FORWARD") => ("filter", "forward", 0),
        ("filter", "OUTPUT") => ("filter", "output", 0),
        ("nat", "PREROUTING") => ("nat", "prerouting", -100),
        ("nat", "INPUT") => ("nat", "input", -100),
        ("nat", "OUTPUT") => ("nat", "output", 110),
        ("nat", "POSTROUTING") => ("nat", "postrouting", 110),
        _ => return None,
    };
    Some(netlink::Hook {
        kind,
        hook,
        priority,
    })
}

/// One chain as it is written: full rule texts (comment included) and their hashes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Rendered {
    /// The generation of the desired chain it was rendered from, to skip rendering it again.
    source: u64,
    /// The hook of a base chain.
    hook: Option<netlink::Hook>,
    rules: Vec<RenderedRule>,
    hashes: Vec<String>,
    /// The elements (`"iface" : goto chain`) of the verdict map a dispatch chain looks
    /// interfaces up in.
    map: Option<BTreeSet<String>>,
    /// For each rule, the index of the desired rule it renders (a rule with several port
    /// items becomes several); `None` for the verdict-map lookup of a dispatch chain.
    origin: Vec<Option<usize>>,
}

/// One rule as written: its `nft -f` text (comment included), its nfnetlink expressions
/// (`None` when it has no encoding: its transaction then goes by `nft -f`) and userdata, all
/// shared with the ops that write it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RenderedRule {
    text: Arc<str>,
    exprs: Option<Arc<[u8]>>,
    userdata: Arc<[u8]>,
}

/// A set or map in the kernel: its declaration (type and flags) and elements.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct KernelSet {
    decl: String,
    elems: HashSet<String>,
}

/// What one family's `calico` table holds, as last read or written.
#[derive(Clone, Debug, Default)]
struct KernelView {
    exists: bool,
    chains: HashMap<String, Vec<String>>,
    sets: HashMap<String, KernelSet>,
}

struct Family {
    v: IpVersion,
    rendered: HashMap<String, Rendered>,
    kernel: Option<KernelView>,
    /// How many times each chain was written by this process: a written chain's rules count
    /// again from zero, so a counter is only comparable with one of the same write.
    writes: HashMap<String, u64>,
    /// `invalidate` dropped a view we trusted: report drift at the next read back.
    check_drift: bool,
}

/// Counts of what one apply wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NftStats {
    pub chains_written: usize,
    pub chains_deleted: usize,
    pub elements_added: usize,
    pub elements_removed: usize,
    pub sets_created: usize,
    pub sets_deleted: usize,
    pub read_back: bool,
    /// Written as one nfnetlink batch rather than by `nft -f`.
    pub via_netlink: bool,
    /// Microseconds the kernel took to take the batch (it commits inside the `send`): what no
    /// writer can save, reported beside the driver's total by the benchmark.
    pub kernel_us: u64,
}

/// The nftables writer (see the module documentation).
pub(crate) struct NftTables {
    families: Vec<Family>,
    batch: Box<dyn netlink::BatchWriter>,
}

/// The planned transaction of one family (its view already updated to what it leaves).
struct Plan {
    ops: Vec<Op>,
    /// The chains the transaction writes (replaced whole).
    written: Vec<String>,
    /// Every rule has an nfnetlink encoding (else the transaction goes by `nft -f`).
    encodable: bool,
    stats: NftStats,
}

/// Element changes being planned, as ops, and their counts.
struct ElementEdits<'a> {
    v: IpVersion,
    removal_ops: Vec<Op>,
    addition_ops: Vec<Op>,
    stats: &'a mut NftStats,
}

impl ElementEdits<'_> {
    /// Moves the kernel's elements of `set` to `wanted`, recording what that takes.
    fn diff(
        &mut self,
        set: &str,
        interval: bool,
        kernel: &mut HashSet<String>,
        wanted: HashSet<String>,
    ) {
        let mut gone: Vec<String> = kernel.difference(&wanted).cloned().collect();
        let mut new: Vec<String> = wanted.difference(kernel).cloned().collect();
        gone.sort();
        new.sort();
        self.stats.elements_removed += gone.len();
        self.stats.elements_added += new.len();
        self.push_op(set, false, interval, gone);
        self.push_op(set, true, interval, new);
        *kernel = wanted;
    }

    fn push_op(&mut self, set: &str, add: bool, interval: bool, elems: Vec<String>) {
        if elems.is_empty() {
            return;
        }
        let op = Op::Elements(netlink::ElementOp {
            version: self.v,
            set: set.to_owned(),
            add,
            interval,
            elems,
        });
        if add {
            self.addition_ops.push(op);
        } else {
            self.removal_ops.push(op);
        }
    }

    /// Every element of a set or map being (re)created, as `add element` statements.
    fn add_all(&mut self, set: &str, interval: bool, elems: &HashSet<String>) {
        let mut all: Vec<String> = elems.iter().cloned().collect();
        all.sort();
        self.stats.elements_added += all.len();
        self.push_op(set, true, interval, all);
    }
}

impl NftTables {
    pub(crate) fn new(versions: &[IpVersion]) -> Self {
        Self::with_batch(versions, Box::new(netlink::NetlinkBatch::default()))
    }

    /// A writer whose nfnetlink batches go to `batch` (tests pass a fake).
    pub(crate) fn with_batch(versions: &[IpVersion], batch: Box<dyn netlink::BatchWriter>) -> Self {
        Self {
            batch,
            families: versions
                .iter()
                .map(|v| Family {
                    v: *v,
                    rendered: HashMap::new(),
                    kernel: None,
                    writes: HashMap::new(),
                    check_drift: false,
                })
                .collect(),
        }
    }

    /// The next apply reads the kernel back and repairs what differs.
    pub(crate) fn invalidate(&mut self) {
        for f in &mut self.families {
            f.check_drift |= f.kernel.take().is_some();
        }
    }

    /// Writes what differs between the desired chains and sets and the kernel, in one
    /// transaction for every family. Takes the changes the tables and sets recorded since the
    /// last apply, so a small change costs the same whatever the size of the ruleset.
    pub(crate) fn apply(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &mut Tables,
        sets: &mut Sets,
    ) -> Result<NftStats, NftError> {
        let changes = tables.take_changes();
        let set_changes = sets.take_changes();
        let (dirty, removed) = (set_changes.changed, set_changes.removed);
        let mut stats = NftStats::default();
        // Every family is read back before any is planned: planning updates the views and
        // consumes the changes, so a failure after it would leave a view ahead of the kernel.
        let mut full = Vec::with_capacity(self.families.len());
        for i in 0..self.families.len() {
            let f = &mut self.families[i];
            full.push(f.kernel.is_none());
            if f.kernel.is_none() {
                match read_back(runner, f.v) {
                    Ok(view) => f.kernel = Some(view),
                    Err(e) => {
                        self.forget();
                        return Err(e);
                    }
                }
                stats.read_back = true;
            }
        }
        let mut ops: Vec<Op> = Vec::new();
        let mut encodable = true;
        let mut written: Vec<Vec<String>> = Vec::with_capacity(self.families.len());
        for (f, full) in self.families.iter_mut().zip(full) {
            let plan = f.plan(tables, sets, &changes, &dirty, &removed, full);
            if f.check_drift && !plan.ops.is_empty() {
                warn!(
                    family = render::family(f.v),
                    chains = plan.stats.chains_written,
                    elements = plan.stats.elements_added + plan.stats.elements_removed,
                    "nftables state of ours was changed outside the agent; repairing it"
                );
            }
            f.check_drift = false;
            add_stats(&mut stats, &plan.stats);
            encodable &= plan.encodable;
            ops.extend(plan.ops);
            written.push(plan.written);
        }
        if ops.is_empty() {
            return Ok(stats);
        }
        // One nfnetlink batch, without nft's cost of parsing text and loading the ruleset.
        // A rule without an encoding, or a batch the kernel refuses, goes by `nft -f` (whose
        // error message is the one to report), the only time the text is rendered.
        let mut refused = None;
        if encodable {
            match self.batch.write(&ops) {
                Ok(kernel) => {
                    stats.via_netlink = true;
                    stats.kernel_us = u64::try_from(kernel.as_micros()).unwrap_or(u64::MAX);
                    self.record_writes(written);
                    return Ok(stats);
                }
                Err(error) => {
                    debug!(%error, "batch refused over netlink; writing it with nft -f");
                    refused = Some(error);
                }
            }
        }
        let script = script_of(&ops);
        match run(runner, &["-f", "-"], Some(script.as_bytes()), "-f") {
            Ok(_) => {
                if let Some(error) = refused {
                    // nft took what the kernel refused from us: our encoding is wrong somewhere,
                    // and every such change now pays for nft.
                    warn!(%error, "the kernel refused an nfnetlink batch that nft -f then wrote");
                }
                self.record_writes(written);
                Ok(stats)
            }
            Err(e) => {
                // Nothing changed, but the views already hold the plan.
                self.forget();
                Err(e)
            }
        }
    }

    /// Counts the chains a transaction that went in wrote, family by family.
    fn record_writes(&mut self, written: Vec<Vec<String>>) {
        for (f, names) in self.families.iter_mut().zip(written) {
            for n in names {
                *f.writes.entry(n).or_default() += 1;
            }
        }
    }

    /// The counters of every rule of ours that renders a desired rule with a rule id (one
    /// `nft -j -t list table` per family: the rules with their counters, set elements left
    /// out), each keyed by its chain, hash and the chain's write.
    pub(crate) fn read_counts(
        &mut self,
        runner: &mut dyn CommandRunner,
        tables: &Tables,
    ) -> Result<Vec<crate::driver::linux::writer::LineCount>, NftError> {
        let mut out = Vec::new();
        for f in &self.families {
            let fam = render::family(f.v);
            // One rule dump over nfnetlink; `nft -j -t list table` (set elements left out)
            // where there is none (a fake) or it fails.
            let counted = match self.batch.counted_rules(f.v) {
                Ok(rules) => rules
                    .into_iter()
                    .map(|r| (r.chain, r.comment, r.packets, r.bytes))
                    .collect(),
                Err(error) => {
                    debug!(%error, family = fam, "no rule dump over netlink; listing with nft");
                    let listing = run(
                        runner,
                        &["-j", "-t", "list", "table", fam, TABLE],
                        None,
                        "list table",
                    )?;
                    parse_counters(&listing).map_err(|reason| NftError::Parse {
                        family: fam,
                        reason,
                    })?
                }
            };
            for (chain, comment, packets, bytes) in counted {
                let Some((t, c, i)) = self.source_rule_by_comment(f.v, &chain, &comment) else {
                    continue;
                };
                let Some(id) = tables
                    .get(f.v, t)
                    .and_then(|t| t.chain(c))
                    .and_then(|c| c.rules.get(i))
                    .and_then(|r| r.counted_id().cloned())
                else {
                    continue;
                };
                let hash = render::hash_of_comment(&comment).unwrap_or_default();
                let epoch = f.writes.get(&chain).copied().unwrap_or(0);
                out.push(crate::driver::linux::writer::LineCount {
                    line: format!("{}|{chain}|{hash}|{epoch}", f.v.number()),
                    id,
                    packets,
                    bytes,
                });
            }
        }
        Ok(out)
    }

    /// Drops every view (and rendering): the next apply reads back and plans everything.
    fn forget(&mut self) {
        for f in &mut self.families {
            f.kernel = None;
            f.rendered.clear();
        }
    }

    /// The desired rule that the rule at `position` (1-based, in the order `nft list chain`
    /// shows them) of our chain `chain` (`filter-cali-pi-…`) in family `v` renders: its
    /// iptables table, chain and index there. `None` before the chain was rendered, or for a
    /// rule of ours that renders none (a dispatch chain's map lookup, a hook chain's rules).
    pub(crate) fn source_rule(
        &self,
        v: IpVersion,
        chain: &str,
        position: usize,
    ) -> Option<(&str, &str, usize)> {
        let (key, r) = self
            .families
            .iter()
            .find(|f| f.v == v)?
            .rendered
            .get_key_value(chain)?;
        let i = (*r.origin.get(position.checked_sub(1)?)?)?;
        let (table, name) = key.split_once('-')?;
        Some((table, name, i))
    }

    /// [`NftTables::source_rule`] of the rule whose comment (`cali:<hash>; …`, as
    /// `nft list chain` prints it or as the rule's userdata holds it) is `comment`.
    pub(crate) fn source_rule_by_comment(
        &self,
        v: IpVersion,
        chain: &str,
        comment: &str,
    ) -> Option<(&str, &str, usize)> {
        let hash = render::hash_of_comment(comment.trim_matches('"'))?;
        let r = self
            .families
            .iter()
            .find(|f| f.v == v)?
            .rendered
            .get(chain)?;
        let position = r.hashes.iter().position(|h| h == hash)? + 1;
        self.source_rule(v, chain, position)
    }

    /// Rules of ours in the kernel view, all families.
    pub(crate) fn rule_count(&self) -> usize {
        self.families
            .iter()
            .filter_map(|f| f.kernel.as_ref())
            .map(|k| k.chains.values().map(Vec::len).sum::<usize>())
            .sum()
    }
}

fn add_stats(total: &mut NftStats, s: &NftStats) {
    total.chains_written += s.chains_written;
    total.chains_deleted += s.chains_deleted;
    total.elements_added += s.elements_added;
    total.elements_removed += s.elements_removed;
    total.sets_created += s.sets_created;
    total.sets_deleted += s.sets_deleted;
}

impl Family {
    /// Renders what changed since the last apply (everything when `full`: the view was just
    /// read back), diffs it against the kernel view and updates the view to what the
    /// transaction leaves (the caller drops the view if the transaction fails).
    fn plan(
        &mut self,
        tables: &Tables,
        sets: &Sets,
        changes: &[TableChanges],
        dirty: &HashSet<String>,
        removed: &HashSet<String>,
        full: bool,
    ) -> Plan {
        let v = self.v;
        let view = self.kernel.as_mut().expect("read back before planning");
        let mut stats = NftStats::default();

        // Chains to look at: every one after a read back, else those the managers touched.
        let mut touched: BTreeSet<String> = BTreeSet::new();
        let mut desired_names: HashSet<String> = HashSet::new();
        if full {
            touched.extend(view.chains.keys().cloned());
        }
        for t in tables.iter().filter(|t| t.version() == v) {
            let table = t.name();
            let c = changes.iter().find(|c| c.version == v && c.table == table);
            let names: Vec<&str> = if full {
                t.chains().map(|(n, _)| n).collect()
            } else {
                c.map(|c| c.chains.iter().map(String::as_str).collect())
                    .unwrap_or_default()
            };
            for name in names {
                let nft = render::chain_name(table, name);
                match t.chain(name).map(|c| (&c.rules, c.generation)) {
                    Some((rules, generation)) => {
                        if self
                            .rendered
                            .get(&nft)
                            .is_none_or(|r| r.source != generation)
                        {
                            let r = render_chain(table, name, &nft, rules, v, generation);
                            self.rendered.insert(nft.clone(), r);
                        }
                    }
                    None => {
                        self.rendered.remove(&nft);
                    }
                }
                if full {
                    desired_names.insert(nft.clone());
                }
                touched.insert(nft);
            }
            if full || c.is_some_and(|c| c.hooks) {
                let prefix = format!("{table}-");
                self.rendered.retain(|n, r| {
                    let ours = r.hook.is_some() && n.starts_with(&prefix);
                    if ours {
                        touched.insert(n.clone());
                    }
                    !ours
                });
                let hooks = t.hooks();
                let kernel_chains: BTreeSet<&String> =
                    hooks.inserts.keys().chain(hooks.appends.keys()).collect();
                for k in kernel_chains {
                    let Some(hook) = base_chain(table, k) else {
                        warn!(table, chain = %k, "no nftables hook for this chain; its rules are not programmed");
                        continue;
                    };
                    let rules: Vec<Rule> = hooks
                        .inserts
                        .get(k)
                        .into_iter()
                        .chain(hooks.appends.get(k))
                        .flatten()
                        .cloned()
                        .collect();
                    let nft = render::chain_name(table, k);
                    let mut r = render_chain(table, k, &nft, &rules, v, 0);
                    r.hook = Some(hook);
                    self.rendered.insert(nft.clone(), r);
                    touched.insert(nft);
                }
            }
        }

        if full {
            // Renderings kept from before the read back stay valid (keyed by their source);
            // those of chains nobody wants any more go.
            self.rendered
                .retain(|n, r| r.hook.is_some() || desired_names.contains(n));
        }

        // The transaction in the order it must run, as ops (the `nft -f` text of the fallback
        // is rendered from them only when it is needed): declarations, flushes, recreated
        // sets, element removals and additions, rules, deletions.
        let mut decl_ops: Vec<Op> = Vec::new();
        let mut flush_ops: Vec<Op> = Vec::new();
        let mut recreate_ops: Vec<Op> = Vec::new();
        let mut rule_ops: Vec<Op> = Vec::new();
        let mut deletion_ops: Vec<Op> = Vec::new();
        let mut new_set_ops: Vec<Op> = Vec::new();
        let mut encodable = true;
        let mut edits = ElementEdits {
            v,
            removal_ops: Vec::new(),
            addition_ops: Vec::new(),
            stats: &mut stats,
        };

        if !view.exists {
            decl_ops.push(Op::NewTable(v));
            view.exists = true;
        }

        // Sets: created, recreated with a new type, elements added and removed.
        let mut retyped: Vec<String> = Vec::new();
        let mut set_names: Vec<&str> = if full {
            sets.iter().map(|(n, _)| n).collect()
        } else {
            dirty.iter().map(String::as_str).collect()
        };
        set_names.sort_unstable();
        let mut stale_sets: BTreeSet<String> = removed
            .iter()
            .map(|n| render::set_name(n))
            .filter(|n| view.sets.contains_key(n))
            .collect();
        for ipset in set_names {
            let Some(d) = sets.get(ipset) else {
                continue;
            };
            let (kind, sv, members) = (d.kind, d.version, &d.members);
            if sv != v {
                continue;
            }
            let name = render::set_name(ipset);
            stale_sets.remove(&name);
            let decl = set_decl(kind, v);
            let elems = set_elements(kind, members);
            let interval = kind == SetKind::Net;
            let set_type = match kind {
                SetKind::Ip => netlink::SetType::Addr,
                SetKind::Net => netlink::SetType::Net,
                SetKind::IpPort => netlink::SetType::AddrProtoPort,
            };
            match view.sets.get_mut(&name) {
                Some(k) if k.decl == decl => {
                    edits.diff(&name, interval, &mut k.elems, elems);
                }
                Some(_) => {
                    // A new type: recreated once the chains using it are flushed.
                    retyped.push(name.clone());
                    recreate_ops.push(Op::DelSet {
                        version: v,
                        name: name.clone(),
                        map: false,
                    });
                    recreate_ops.push(Op::NewSet {
                        version: v,
                        name: name.clone(),
                        kind: set_type,
                    });
                    edits.stats.sets_created += 1;
                    edits.add_all(&name, interval, &elems);
                    view.sets.insert(name, KernelSet { decl, elems });
                }
                None => {
                    // A new set with its elements (the text fallback writes the two in nft's
                    // block syntax).
                    let mut all: Vec<String> = elems.iter().cloned().collect();
                    all.sort();
                    new_set_ops.push(Op::NewSet {
                        version: v,
                        name: name.clone(),
                        kind: set_type,
                    });
                    if !all.is_empty() {
                        new_set_ops.push(Op::Elements(netlink::ElementOp {
                            version: v,
                            set: name.clone(),
                            add: true,
                            interval,
                            elems: all,
                        }));
                    }
                    edits.stats.sets_created += 1;
                    edits.stats.elements_added += elems.len();
                    view.sets.insert(name, KernelSet { decl, elems });
                }
            }
        }

        // Verdict maps of the dispatch chains that changed.
        for chain in &touched {
            let Some(elems) = self.rendered.get(chain).and_then(|r| r.map.as_ref()) else {
                continue;
            };
            stale_sets.remove(chain);
            let decl = "ifname : verdict".to_owned();
            let elems: HashSet<String> = elems.iter().cloned().collect();
            match view.sets.get_mut(chain) {
                Some(k) if k.decl == decl => edits.diff(chain, false, &mut k.elems, elems),
                existing => {
                    let new_map = Op::NewSet {
                        version: v,
                        name: chain.clone(),
                        kind: netlink::SetType::IfnameVerdict,
                    };
                    let target_ops = if existing.is_some() {
                        recreate_ops.push(Op::DelSet {
                            version: v,
                            name: chain.clone(),
                            map: true,
                        });
                        &mut recreate_ops
                    } else {
                        &mut decl_ops
                    };
                    target_ops.push(new_map);
                    edits.add_all(chain, false, &elems);
                    view.sets.insert(chain.clone(), KernelSet { decl, elems });
                    edits.stats.sets_created += 1;
                }
            }
        }
        if full {
            // Sets and maps in our table that nothing wants.
            let wanted_maps: HashSet<&String> = self
                .rendered
                .iter()
                .filter(|(_, r)| r.map.is_some())
                .map(|(n, _)| n)
                .collect();
            let wanted_sets: HashSet<String> = sets
                .iter()
                .filter(|(_, d)| d.version == v)
                .map(|(n, _)| render::set_name(n))
                .collect();
            stale_sets.extend(
                view.sets
                    .keys()
                    .filter(|n| !wanted_sets.contains(*n) && !wanted_maps.contains(n))
                    .cloned(),
            );
        } else {
            // A dispatch chain that went takes its map along.
            stale_sets.extend(
                touched
                    .iter()
                    .filter(|n| !self.rendered.contains_key(*n) && view.sets.contains_key(*n))
                    .cloned(),
            );
        }

        let ElementEdits {
            removal_ops,
            addition_ops,
            ..
        } = edits;

        // Chains whose rules differ (or that use a set being recreated) are replaced whole.
        let mut writes: BTreeSet<&String> = touched
            .iter()
            .filter(|n| {
                self.rendered
                    .get(*n)
                    .is_some_and(|r| view.chains.get(*n) != Some(&r.hashes))
            })
            .collect();
        for s in &retyped {
            writes.extend(
                self.rendered
                    .iter()
                    .filter(|(_, r)| r.rules.iter().any(|rule| references_set(&rule.text, s)))
                    .map(|(n, _)| n),
            );
        }
        let mut written = Vec::with_capacity(writes.len());
        for name in writes {
            written.push(name.clone());
            let r = &self.rendered[name];
            if let Some(h) = &r.hook {
                decl_ops.push(Op::NewChain {
                    version: v,
                    name: name.clone(),
                    hook: Some(*h),
                });
            } else if !view.chains.contains_key(name) {
                decl_ops.push(Op::NewChain {
                    version: v,
                    name: name.clone(),
                    hook: None,
                });
            }
            if view.chains.contains_key(name) {
                flush_ops.push(Op::FlushChain {
                    version: v,
                    name: name.clone(),
                });
            }
            encodable &= r.rules.iter().all(|rule| rule.exprs.is_some());
            rule_ops.extend(r.rules.iter().map(|rule| Op::Rule {
                version: v,
                chain: name.clone(),
                exprs: rule.exprs.clone(),
                userdata: rule.userdata.clone(),
                text: rule.text.clone(),
            }));
            view.chains.insert(name.clone(), r.hashes.clone());
            stats.chains_written += 1;
        }

        // Stale objects: flushed first, deleted last (maps and sets before the chains they
        // name; chains once nothing jumps to them).
        let stale_chains: Vec<&String> = touched
            .iter()
            .filter(|n| !self.rendered.contains_key(*n) && view.chains.contains_key(*n))
            .collect();
        for name in &stale_chains {
            flush_ops.push(Op::FlushChain {
                version: v,
                name: (*name).clone(),
            });
        }
        for name in &stale_sets {
            let k = view.sets.remove(name).expect("listed from the view");
            deletion_ops.push(Op::DelSet {
                version: v,
                name: name.clone(),
                map: k.decl.contains(" : "),
            });
            stats.sets_deleted += 1;
        }
        for name in &stale_chains {
            deletion_ops.push(Op::DelChain {
                version: v,
                name: (*name).clone(),
            });
            view.chains.remove(*name);
            stats.chains_deleted += 1;
        }

        decl_ops.extend(new_set_ops);
        let ops = [
            decl_ops,
            flush_ops,
            recreate_ops,
            removal_ops,
            addition_ops,
            rule_ops,
            deletion_ops,
        ]
        .concat();
        Plan {
            ops,
            written,
            encodable,
            stats,
        }
    }
}

/// Whether a rendered rule names set `name`.
fn references_set(rule: &str, name: &str) -> bool {
    rule.split(' ').any(|w| w.strip_prefix('@') == Some(name))
}

/// Renders one chain, as text and as nfnetlink expressions; the workload dispatch chains
/// become a verdict-map lookup.
fn render_chain(
    table: &str,
    iptables_name: &str,
    nft: &str,
    rules: &[Rule],
    v: IpVersion,
    source: u64,
) -> Rendered {
    let mut bodies: Vec<String> = Vec::with_capacity(rules.len());
    let mut exprs: Vec<Result<Vec<u8>, expr::Unsupported>> = Vec::with_capacity(rules.len());
    let mut comments: Vec<&[String]> = Vec::with_capacity(rules.len());
    let mut origin: Vec<Option<usize>> = Vec::with_capacity(rules.len());
    let mut map = None;
    let dispatch =
        table == "filter" && (iptables_name == FROM_WL_DISPATCH || iptables_name == TO_WL_DISPATCH);
    let mut rest = rules;
    if dispatch {
        let input = iptables_name == FROM_WL_DISPATCH;
        let mut elems = BTreeSet::new();
        while let Some((r, tail)) = rest.split_first() {
            let Some(e) = dispatch_element(r, table, input) else {
                break;
            };
            elems.insert(e);
            rest = tail;
        }
        let kw = if input { "iifname" } else { "oifname" };
        bodies.push(format!("{kw} vmap @{nft}"));
        exprs.push(Ok(expr::vmap(input, nft)));
        comments.push(&[]);
        origin.push(None);
        map = Some(elems);
    }
    let first = rules.len() - rest.len();
    for (i, r) in rest.iter().enumerate() {
        for frags in render::variants(r) {
            bodies.push(render::body(&frags, &r.action, table, v));
            exprs.push(expr::rule(&frags, &r.action, table, v));
            comments.push(&r.comments);
            origin.push(Some(first + i));
        }
    }
    let hashes = render::hashes(nft, bodies.iter().map(String::as_str));
    let texts: Vec<String> = hashes
        .iter()
        .zip(&comments)
        .map(|(h, c)| render::comment_text(h, c))
        .collect();
    let rules = bodies
        .iter()
        .zip(&texts)
        .zip(exprs)
        .map(|((b, c), e)| RenderedRule {
            text: Arc::from(format!("{b} comment \"{c}\"")),
            exprs: e
                .map_err(|error| debug!(chain = nft, %error, "rule written by nft -f"))
                .ok()
                .map(Arc::from),
            userdata: Arc::from(expr::userdata(c)),
        })
        .collect();
    Rendered {
        source,
        hook: None,
        rules,
        hashes,
        map,
        origin,
    }
}

/// `"iface" : goto chain` for a dispatch rule that sends one exact interface to a chain.
fn dispatch_element(r: &Rule, table: &str, input: bool) -> Option<String> {
    let Action::Goto(target) = &r.action else {
        return None;
    };
    if !r.comments.is_empty() {
        return None;
    }
    let iface = match r.matches.frags() {
        [Frag::InIface(i)] if input => i,
        [Frag::OutIface(i)] if !input => i,
        _ => return None,
    };
    if iface.ends_with('+') {
        return None;
    }
    Some(format!(
        "{} : goto {}",
        render::string(iface),
        render::chain_name(table, target)
    ))
}

/// The declaration as read back compares it: type, and ` interval` for interval sets.
fn set_decl(kind: SetKind, v: IpVersion) -> String {
    let addr = addr_type(v);
    match kind {
        SetKind::Ip => addr.to_owned(),
        SetKind::Net => format!("{addr} interval"),
        SetKind::IpPort => format!("{addr} . inet_proto . inet_service"),
    }
}

fn decl_text(kind: netlink::SetType, v: IpVersion) -> String {
    let addr = addr_type(v);
    match kind {
        netlink::SetType::Addr => format!("type {addr};"),
        netlink::SetType::Net => format!("type {addr}; flags interval;"),
        netlink::SetType::AddrProtoPort => format!("type {addr} . inet_proto . inet_service;"),
        netlink::SetType::IfnameVerdict => "type ifname : verdict;".to_owned(),
    }
}

/// The `nft -f` text of a transaction, for the fallback: the ops in their order, new sets with
/// their elements and rules in nft's block syntax (it parses elements in a block about 40%
/// faster than `add element` statements, and rules about a quarter faster than one `add rule`
/// statement each).
fn script_of(ops: &[Op]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < ops.len() {
        match &ops[i] {
            Op::NewTable(v) => {
                let _ = writeln!(out, "add table {} {TABLE}", render::family(*v));
            }
            Op::NewChain {
                version,
                name,
                hook,
            } => {
                let fam = render::family(*version);
                match hook {
                    Some(h) => {
                        let _ = writeln!(
                            out,
                            "add chain {fam} {TABLE} {name} {{ type {} hook {} priority {}; policy accept; }}",
                            h.kind, h.hook, h.priority
                        );
                    }
                    None => {
                        let _ = writeln!(out, "add chain {fam} {TABLE} {name}");
                    }
                }
            }
            Op::FlushChain { version, name } => {
                let _ = writeln!(
                    out,
                    "flush chain {} {TABLE} {name}",
                    render::family(*version)
                );
            }
            Op::DelChain { version, name } => {
                let _ = writeln!(
                    out,
                    "delete chain {} {TABLE} {name}",
                    render::family(*version)
                );
            }
            Op::DelSet { version, name, map } => {
                let what = if *map { "map" } else { "set" };
                let _ = writeln!(
                    out,
                    "delete {what} {} {TABLE} {name}",
                    render::family(*version)
                );
            }
            Op::NewSet {
                version,
                name,
                kind,
            } => {
                let fam = render::family(*version);
                let decl = decl_text(*kind, *version);
                let with_elements =
                    matches!(ops.get(i + 1), Some(Op::Elements(e)) if e.add && &e.set == name);
                if *kind == netlink::SetType::IfnameVerdict {
                    let _ = writeln!(out, "add map {fam} {TABLE} {name} {{ {decl} }}");
                } else if !with_elements {
                    let _ = writeln!(out, "add set {fam} {TABLE} {name} {{ {decl} }}");
                } else {
                    let Some(Op::Elements(e)) = ops.get(i + 1) else {
                        unreachable!("checked above")
                    };
                    let _ = write!(
                        out,
                        "table {fam} {TABLE} {{\nset {name} {{ {decl} elements = "
                    );
                    braced_list(&mut out, &e.elems);
                    out.push_str(" }\n}\n");
                    i += 1;
                }
            }
            Op::Elements(e) => {
                let op = if e.add { "add" } else { "delete" };
                element_ops(&mut out, op, render::family(e.version), &e.set, &e.elems);
            }
            Op::Rule { version, .. } => {
                // Every rule up to the next other op, chain by chain.
                let _ = writeln!(out, "table {} {TABLE} {{", render::family(*version));
                let mut open: Option<&str> = None;
                while let Some(Op::Rule {
                    version: rv,
                    chain,
                    text,
                    ..
                }) = ops.get(i)
                {
                    if rv != version {
                        break;
                    }
                    if open != Some(chain.as_str()) {
                        if open.is_some() {
                            out.push_str("}\n");
                        }
                        let _ = writeln!(out, "chain {chain} {{");
                        open = Some(chain);
                    }
                    let _ = writeln!(out, "{text}");
                    i += 1;
                }
                out.push_str("}\n}\n");
                continue;
            }
        }
        i += 1;
    }
    out
}

fn addr_type(v: IpVersion) -> &'static str {
    match v {
        IpVersion::V4 => "ipv4_addr",
        IpVersion::V6 => "ipv6_addr",
    }
}

/// Members (as `ipset save` prints them) as nft elements. An interval set refuses elements
/// that overlap, so a network inside another member is left out: the set matches the same
/// addresses.
fn set_elements(kind: SetKind, members: &HashSet<String>) -> HashSet<String> {
    match kind {
        SetKind::Ip => members.clone(),
        SetKind::IpPort => members
            .iter()
            .filter_map(|m| {
                let (addr, rest) = m.split_once(',')?;
                let (proto, port) = rest.split_once(':')?;
                Some(format!("{addr} . {proto} . {port}"))
            })
            .collect(),
        SetKind::Net => without_nested(members),
    }
}

fn parse_net(m: &str) -> Option<(std::net::IpAddr, u8)> {
    match m.split_once('/') {
        Some((a, l)) => Some((a.parse().ok()?, l.parse().ok()?)),
        None => {
            let a: std::net::IpAddr = m.parse().ok()?;
            Some((a, if a.is_ipv4() { 32 } else { 128 }))
        }
    }
}

fn masked(a: std::net::IpAddr, len: u8) -> u128 {
    let (bits, width) = match a {
        std::net::IpAddr::V4(a) => (u128::from(u32::from(a)), 32u32),
        std::net::IpAddr::V6(a) => (u128::from(a), 128u32),
    };
    let shift = width - u32::from(len).min(width);
    if shift >= 128 {
        0
    } else {
        (bits >> shift) << shift
    }
}

fn without_nested(members: &HashSet<String>) -> HashSet<String> {
    let parsed: Vec<(&String, std::net::IpAddr, u8)> = members
        .iter()
        .filter_map(|m| parse_net(m).map(|(a, l)| (m, a, l)))
        .collect();
    let lengths: BTreeSet<u8> = parsed.iter().map(|p| p.2).collect();
    if lengths.len() <= 1 {
        return members.clone();
    }
    let nets: HashSet<(u128, u8)> = parsed
        .iter()
        .map(|(_, a, l)| (masked(*a, *l), *l))
        .collect();
    parsed
        .iter()
        .filter(|(_, a, l)| {
            !lengths
                .range(..*l)
                .any(|shorter| nets.contains(&(masked(*a, *shorter), *shorter)))
        })
        .map(|(m, _, _)| (*m).clone())
        .collect()
}

/// `add|delete element <fam> calico <set> { … }` in batches.
fn element_ops(out: &mut String, op: &str, fam: &str, set: &str, elems: &[String]) {
    for chunk in elems.chunks(ELEMENTS_PER_STATEMENT) {
        let _ = write!(out, "{op} element {fam} {TABLE} {set} ");
        braced_list(out, chunk);
        out.push('\n');
    }
}

/// `{ a, b, c }`.
fn braced_list(out: &mut String, items: &[impl AsRef<str>]) {
    out.push_str("{ ");
    for (i, e) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(e.as_ref());
    }
    out.push_str(" }");
}

fn run(
    runner: &mut dyn CommandRunner,
    args: &[&str],
    stdin: Option<&[u8]>,
    what: &'static str,
) -> Result<Vec<u8>, NftError> {
    let out = runner.run("nft", args, stdin).map_err(NftError::Spawn)?;
    if out.success {
        Ok(out.stdout)
    } else {
        Err(NftError::Failed {
            what,
            stderr: out.stderr_summary(),
        })
    }
}

/// Reads one family's `calico` table back (`nft -j list table`); an absent table is empty.
fn read_back(runner: &mut dyn CommandRunner, v: IpVersion) -> Result<KernelView, NftError> {
    let fam = render::family(v);
    let out = runner
        .run("nft", &["-j", "list", "table", fam, TABLE], None)
        .map_err(NftError::Spawn)?;
    if !out.success {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("No such file or directory") {
            return Ok(KernelView::default());
        }
        return Err(NftError::Failed {
            what: "list table",
            stderr: out.stderr_summary(),
        });
    }
    parse_listing(&out.stdout).map_err(|reason| NftError::Parse {
        family: fam,
        reason,
    })
}

/// The kernel view from `nft -j list table` output.
fn parse_listing(json: &[u8]) -> Result<KernelView, String> {
    let doc: serde_json::Value = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    let items = doc
        .get("nftables")
        .and_then(|v| v.as_array())
        .ok_or("no \"nftables\" array")?;
    let mut view = KernelView {
        exists: true,
        ..KernelView::default()
    };
    let mut rules: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for item in items {
        if let Some(c) = item.get("chain") {
            let name = c["name"].as_str().ok_or("chain without a name")?;
            view.chains.entry(name.to_owned()).or_default();
        } else if let Some(r) = item.get("rule") {
            let chain = r["chain"].as_str().ok_or("rule without a chain")?;
            let hash = r["comment"]
                .as_str()
                .and_then(render::hash_of_comment)
                .unwrap_or("");
            rules
                .entry(chain.to_owned())
                .or_default()
                .push(hash.to_owned());
        } else if let Some(s) = item.get("set") {
            let name = s["name"].as_str().ok_or("set without a name")?;
            let mut decl = type_text(&s["type"]);
            if s["flags"]
                .as_array()
                .is_some_and(|f| f.iter().any(|x| x == "interval"))
            {
                decl.push_str(" interval");
            }
            let elems = s["elem"]
                .as_array()
                .map(|a| a.iter().map(elem_text).collect())
                .unwrap_or_default();
            view.sets.insert(name.to_owned(), KernelSet { decl, elems });
        } else if let Some(m) = item.get("map") {
            let name = m["name"].as_str().ok_or("map without a name")?;
            let decl = format!("{} : {}", type_text(&m["type"]), type_text(&m["map"]));
            let elems = m["elem"]
                .as_array()
                .map(|a| a.iter().map(map_elem_text).collect())
                .unwrap_or_default();
            view.sets.insert(name.to_owned(), KernelSet { decl, elems });
        }
    }
    for (chain, hashes) in rules {
        view.chains.insert(chain, hashes);
    }
    Ok(view)
}

/// (chain, comment, packets, bytes) of every rule with a comment and a counter, from
/// `nft -j list table` output.
fn parse_counters(json: &[u8]) -> Result<Vec<(String, String, u64, u64)>, String> {
    let doc: serde_json::Value = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    let items = doc
        .get("nftables")
        .and_then(|v| v.as_array())
        .ok_or("no \"nftables\" array")?;
    let mut out = Vec::new();
    for r in items.iter().filter_map(|i| i.get("rule")) {
        let (Some(chain), Some(comment)) = (r["chain"].as_str(), r["comment"].as_str()) else {
            continue;
        };
        let Some(counter) = r["expr"]
            .as_array()
            .and_then(|e| e.iter().find_map(|x| x.get("counter")))
        else {
            continue;
        };
        let (Some(packets), Some(bytes)) = (counter["packets"].as_u64(), counter["bytes"].as_u64())
        else {
            continue;
        };
        out.push((chain.to_owned(), comment.to_owned(), packets, bytes));
    }
    Ok(out)
}

fn type_text(t: &serde_json::Value) -> String {
    match t {
        serde_json::Value::Array(parts) => {
            parts.iter().map(type_text).collect::<Vec<_>>().join(" . ")
        }
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A set element as we write it.
fn elem_text(e: &serde_json::Value) -> String {
    match e {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        serde_json::Value::Object(o) => {
            if let Some(p) = o.get("prefix") {
                format!("{}/{}", elem_text(&p["addr"]), p["len"])
            } else if let Some(c) = o.get("concat").and_then(|c| c.as_array()) {
                c.iter().map(elem_text).collect::<Vec<_>>().join(" . ")
            } else if let Some(r) = o.get("range").and_then(|r| r.as_array()) {
                r.iter().map(elem_text).collect::<Vec<_>>().join("-")
            } else if let Some(inner) = o.get("elem") {
                elem_text(&inner["val"])
            } else {
                e.to_string()
            }
        }
        other => other.to_string(),
    }
}

/// A map element as we write it: `"key" : goto chain`.
fn map_elem_text(e: &serde_json::Value) -> String {
    let (Some(key), Some(verdict)) = (e.get(0), e.get(1)) else {
        return e.to_string();
    };
    let verdict = match verdict.as_object().and_then(|o| o.iter().next()) {
        Some((kind, target)) => match target.get("target").and_then(|t| t.as_str()) {
            Some(t) => format!("{kind} {t}"),
            None => kind.clone(),
        },
        None => verdict.to_string(),
    };
    format!("{} : {verdict}", render::string(&elem_text(key)))
}

/// Deletes the `calico` tables of every family (the nftables driver's whole state): used by the
/// iptables driver when a node switches back to it. An absent table or `nft` is not an error.
///
/// One transaction adds each table (a no-op when it exists) and deletes it, so nothing is
/// listed first: `nft list tables` reads the whole ruleset, which with 27k iptables-nft rules
/// loaded took 1.8 s (the add-and-delete takes 0.05 s).
pub(crate) fn remove_tables(runner: &mut dyn CommandRunner) -> Result<(), NftError> {
    let mut script = String::new();
    for fam in ["ip", "ip6"] {
        let _ = writeln!(
            script,
            "add table {fam} {TABLE}\ndelete table {fam} {TABLE}"
        );
    }
    match run(
        runner,
        &["-f", "-"],
        Some(script.as_bytes()),
        "delete table",
    ) {
        Err(NftError::Spawn(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other.map(|_| ()),
    }
}

#[cfg(test)]
mod kernel_tests;
#[cfg(test)]
mod tests;
