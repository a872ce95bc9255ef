//! The iptables half of the iptables writer: one [`KernelTable`] per table and family, kept
//! equal to that table's desired chains ([`desired::Table`]).
//!
//! Contract: [`KernelTable::take_changes`] takes the desired table's change log and hashes the
//! changed chains (the `cali:` hashes are this writer's own: nothing else computes them);
//! [`KernelTable::apply`] reads the kernel back with `iptables-save` when it has no trusted
//! view (first apply, after a failure, after [`KernelTable::invalidate`]), then writes one
//! `iptables-restore --noflush` transaction holding only the chains whose rule hashes differ,
//! the hook rules that are missing or out of place, and the deletion of chains of ours
//! (`cali-…`) that are no longer wanted. Rules and chains that are not ours are never touched.
//!
//! When the kernel refuses that transaction, no single chain may hold the rest back: the
//! chains are written again in halves (dependencies first) down to the single chains that are
//! refused on their own. Such a chain is reported by [`KernelTable::refused`] with the object it
//! renders; a stream object's chain is replaced by a DROP (fail closed), one of our own keeps
//! its kernel version. It is tried again when its content changes or after `invalidate`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use super::desired;
use super::rules::{IpVersion, Rule, RuleId, quote, rule_hashes};
use super::runner::CommandRunner;

/// Chains we own start with this.
pub(crate) const OUR_CHAIN_PREFIX: &str = "cali-";

/// Which iptables implementation the iptables writer runs (`--driver linux`); not to be
/// confused with the nftables writer (`--driver nftables`). The flag values `auto`, `legacy`
/// and `nft` are a contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Detect as Felix does: follow whichever backend already holds rules, else what
    /// `iptables --version` reports.
    Auto,
    /// `iptables-legacy-*` (x_tables).
    #[value(name = "legacy")]
    IptablesLegacy,
    /// `iptables-nft-*` (nf_tables, iptables-compatible rules).
    #[value(name = "nft")]
    IptablesNft,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::IptablesLegacy => "legacy",
            Backend::IptablesNft => "nft",
        }
    }

    /// `iptables-legacy-save`, `ip6tables-nft-restore`, …
    pub fn program(self, v: IpVersion, tool: &str) -> String {
        let family = match v {
            IpVersion::V4 => "iptables",
            IpVersion::V6 => "ip6tables",
        };
        match self {
            Backend::Auto => format!("{family}-{tool}"),
            Backend::IptablesLegacy | Backend::IptablesNft => {
                format!("{family}-{}-{tool}", self.name())
            }
        }
    }
}

/// Picks legacy or nft. Kubernetes' hint chain wins when present, then whichever backend holds
/// more rules, then the mode `iptables --version` reports.
///
/// Each backend is read with a bare `*-save`, which dumps only the tables that exist: asking
/// for a table by name (`-t filter`) makes the legacy kernel create it, and an empty legacy
/// table on an nft host makes every later `iptables-save` warn "iptables-legacy tables
/// present". Detection must look without touching.
pub(crate) fn detect_backend(runner: &mut dyn CommandRunner) -> Backend {
    let mut count = |b: Backend| -> (usize, bool) {
        let mut rules = 0;
        let mut hint = false;
        for v in IpVersion::BOTH {
            let prog = b.program(v, "save");
            if let Ok(out) = runner.run(&prog, &[], None) {
                let text = String::from_utf8_lossy(&out.stdout);
                rules += text.lines().filter(|l| l.starts_with("-A ")).count();
                hint |=
                    text.contains(":KUBE-IPTABLES-HINT") || text.contains(":KUBE-KUBELET-CANARY");
            }
        }
        (rules, hint)
    };
    let (legacy_rules, legacy_hint) = count(Backend::IptablesLegacy);
    let (nft_rules, nft_hint) = count(Backend::IptablesNft);
    if nft_hint && !legacy_hint {
        return Backend::IptablesNft;
    }
    if legacy_hint && !nft_hint {
        return Backend::IptablesLegacy;
    }
    if legacy_rules > nft_rules {
        return Backend::IptablesLegacy;
    }
    if nft_rules > legacy_rules {
        return Backend::IptablesNft;
    }
    match runner.run("iptables", &["--version"], None) {
        Ok(out) if String::from_utf8_lossy(&out.stdout).contains("nf_tables") => {
            Backend::IptablesNft
        }
        Ok(out) if out.success => Backend::IptablesLegacy,
        _ => Backend::IptablesNft,
    }
}

/// Whether `MASQUERADE --random-fully` can be programmed: as Felix detects it, iptables 1.6.2 or
/// later (the restore tool this backend uses) and Linux 3.14 or later. Anything unreadable
/// counts as unsupported: plain MASQUERADE works everywhere.
pub(crate) fn supports_masquerade_fully_random(
    runner: &mut dyn CommandRunner,
    backend: Backend,
    kernel_release: Option<&str>,
) -> bool {
    let tool = backend.program(IpVersion::V4, "restore");
    let iptables = match runner.run(&tool, &["--version"], None) {
        Ok(out) if out.success => parse_version(&String::from_utf8_lossy(&out.stdout)),
        _ => None,
    };
    iptables.is_some_and(|i| i >= (1, 6, 2)) && kernel_supports_fully_random(kernel_release)
}

/// Whether the kernel takes fully random source ports for masquerading (Linux 3.14 or later);
/// all nftables needs besides its own support.
pub(crate) fn kernel_supports_fully_random(kernel_release: Option<&str>) -> bool {
    kernel_release
        .and_then(parse_version)
        .is_some_and(|k| k >= (3, 14, 0))
}

/// The first `major.minor[.patch]` in text such as `iptables-restore v1.8.9 (nf_tables)` or
/// `6.1.0-13-amd64`.
fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    text.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .find_map(|word| {
            let mut parts = word.split('.').map(|p| p.parse::<u32>().ok());
            let major = parts.next()??;
            let minor = parts.next()??;
            let patch = parts.next().flatten().unwrap_or(0);
            Some((major, minor, patch))
        })
}

/// Why a table could not be programmed.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("{program}: cannot run: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{program} failed: {stderr}")]
    Failed { program: String, stderr: String },
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

/// A kernel rule as read back: its `cali:` hash if it carries one, and the full rule line.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KernelRule {
    hash: Option<String>,
    /// The rule's spec without the leading `-A <chain> `.
    spec: String,
}

/// What the kernel holds, as far as we care.
#[derive(Clone, Debug, Default)]
struct KernelView {
    /// Our chains: name → rule hashes ("" for a rule without one).
    ours: HashMap<String, Vec<String>>,
    /// Every other chain that holds rules of ours or that we hook: name → rules.
    others: HashMap<String, Vec<KernelRule>>,
}

/// Our chains and hook rules that differ between two kernel views: chains changed, removed or
/// added, and kernel chains whose rules of ours (by hash) changed.
fn drift(before: &KernelView, now: &KernelView) -> Vec<String> {
    let mut out = std::collections::BTreeSet::new();
    for (name, hashes) in &before.ours {
        if now.ours.get(name) != Some(hashes) {
            out.insert(name.clone());
        }
    }
    out.extend(
        now.ours
            .keys()
            .filter(|n| !before.ours.contains_key(*n))
            .cloned(),
    );
    let hooks = |v: &KernelView, chain: &str| -> Vec<String> {
        v.others
            .get(chain)
            .into_iter()
            .flatten()
            .filter_map(|r| r.hash.clone())
            .collect()
    };
    for chain in before.others.keys().chain(now.others.keys()) {
        if hooks(before, chain) != hooks(now, chain) {
            out.insert(format!("{chain} (our rules in it)"));
        }
    }
    out.into_iter().collect()
}

/// Extracts the `cali:` hash from a rule line, if any.
fn hash_of(line: &str) -> Option<&str> {
    let i = line
        .find("--comment \"cali:")
        .map(|i| i + 16)
        .or_else(|| line.find("--comment cali:").map(|i| i + 15))?;
    let rest = &line[i..];
    let end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

/// The `*<table>` … `COMMIT` section of a multi-table save (empty if absent).
fn table_section(text: &str, table: &str) -> String {
    let header = format!("*{table}");
    let mut out = String::new();
    let mut inside = false;
    for line in text.lines() {
        if line == header {
            inside = true;
        } else if inside && line == "COMMIT" {
            break;
        } else if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Reads every table of a family with one `iptables-save`.
pub(crate) fn save_all(
    runner: &mut dyn CommandRunner,
    backend: Backend,
    v: IpVersion,
) -> Result<String, TableError> {
    run_save(runner, backend, v, &[])
}

/// One rule of ours as `iptables-save -c` shows it: where it is and what it counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CountedRule {
    pub table: String,
    pub chain: String,
    /// The rule's `cali:` hash.
    pub hash: String,
    pub packets: u64,
    pub bytes: u64,
}

/// Every table of a family with its counters (`-save -c`): the exact per-rule counts the
/// kernel keeps for both backends.
pub(crate) fn save_counted(
    runner: &mut dyn CommandRunner,
    backend: Backend,
    v: IpVersion,
) -> Result<Vec<CountedRule>, TableError> {
    Ok(parse_counted(&run_save(runner, backend, v, &["-c"])?))
}

/// The rules of our chains that carry a `cali:` hash, from `-save -c` output
/// (`[packets:bytes] -A chain spec`).
fn parse_counted(text: &str) -> Vec<CountedRule> {
    let mut out = Vec::new();
    let mut table = "";
    for line in text.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t;
            continue;
        }
        let Some(rest) = line.strip_prefix('[') else {
            continue;
        };
        let Some((counts, rule)) = rest.split_once("] -A ") else {
            continue;
        };
        let Some((p, b)) = counts.split_once(':') else {
            continue;
        };
        let (Ok(packets), Ok(bytes)) = (p.parse(), b.parse()) else {
            continue;
        };
        let (chain, spec) = rule.split_once(' ').unwrap_or((rule, ""));
        if !chain.starts_with(OUR_CHAIN_PREFIX) {
            continue;
        }
        if let Some(hash) = hash_of(spec) {
            out.push(CountedRule {
                table: table.to_owned(),
                chain: chain.to_owned(),
                hash: hash.to_owned(),
                packets,
                bytes,
            });
        }
    }
    out
}

/// `ip[6]tables-<backend>-save args…`, its output as text.
fn run_save(
    runner: &mut dyn CommandRunner,
    backend: Backend,
    v: IpVersion,
    args: &[&str],
) -> Result<String, TableError> {
    let program = backend.program(v, "save");
    let out = runner
        .run(&program, args, None)
        .map_err(|source| TableError::Spawn {
            program: program.clone(),
            source,
        })?;
    if !out.success {
        return Err(TableError::Failed {
            program,
            stderr: out.stderr_summary(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Parses `iptables-save -t <table>` output.
fn parse_save(text: &str) -> KernelView {
    let mut view = KernelView::default();
    for line in text.lines() {
        if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap_or_default();
            if name.starts_with(OUR_CHAIN_PREFIX) {
                view.ours.entry(name.to_owned()).or_default();
            }
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let (chain, spec) = rest.split_once(' ').unwrap_or((rest, ""));
            if chain.starts_with(OUR_CHAIN_PREFIX) {
                view.ours
                    .entry(chain.to_owned())
                    .or_default()
                    .push(hash_of(spec).unwrap_or_default().to_owned());
            } else {
                view.others
                    .entry(chain.to_owned())
                    .or_default()
                    .push(KernelRule {
                        hash: hash_of(spec).map(str::to_owned),
                        spec: spec.to_owned(),
                    });
            }
        }
    }
    view
}

/// A chain the kernel refused on its own, kept out until its content changes or the table is
/// invalidated (the next refresh tries it again).
#[derive(Clone, Debug)]
struct Refused {
    /// The desired hashes that were refused.
    hashes: Vec<String>,
    /// Hashes of the DROP written in its place.
    fallback: Vec<String>,
    error: String,
}

/// The rule a refused chain of a stream object is replaced by.
static DROP_RULE: std::sync::LazyLock<Rule> =
    std::sync::LazyLock::new(|| Rule::always(super::rules::Action::Drop));

/// The part of a transaction after the chain writes.
struct Tail {
    script: String,
    stale: Vec<String>,
    hook_fixes: Vec<String>,
}

/// Counts of what one apply wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ApplyStats {
    pub chains_written: usize,
    pub chains_deleted: usize,
    pub hooks_fixed: usize,
    /// Chains the kernel refused on their own (see [`Table::refused`]).
    pub chains_refused: usize,
    pub read_back: bool,
}

/// What the kernel holds of one table (`filter`, `raw`, `mangle`, `nat`) of one family, and
/// the hashes of the desired chains it is compared with.
pub(crate) struct KernelTable {
    name: &'static str,
    version: IpVersion,
    /// The `cali:` hashes of each desired chain's rules, kept up to date from the change log.
    hashes: HashMap<String, Vec<String>>,
    /// Hashes of the hook rules: kernel chain → (inserts, appends).
    hook_hashes: BTreeMap<String, (Vec<String>, Vec<String>)>,
    kernel: Option<KernelView>,
    /// The kernel view `invalidate` dropped: what the next read back is compared with, so
    /// changes made behind our back are reported when they are repaired.
    last_known: Option<KernelView>,
    refused: BTreeMap<String, Refused>,
    /// The kernel view was loaded by `load_kernel_view` and no apply has reported it yet.
    loaded: bool,
    /// Seconds `iptables-restore` waits for the xtables lock.
    lock_wait_secs: u32,
    /// How many times each chain of ours was written by this process: a written chain's rules
    /// count again from zero, so counters are told apart by it (see [`KernelTable::epoch`]).
    writes: HashMap<String, u64>,
}

impl KernelTable {
    pub(crate) fn new(name: &'static str, version: IpVersion, lock_wait_secs: u32) -> Self {
        Self {
            name,
            version,
            hashes: HashMap::new(),
            hook_hashes: BTreeMap::new(),
            kernel: None,
            last_known: None,
            refused: BTreeMap::new(),
            loaded: false,
            lock_wait_secs,
            writes: HashMap::new(),
        }
    }

    /// How many times this process wrote `chain`: its rules' counters started from zero at
    /// the last write, so a counter read is only comparable with one of the same epoch.
    pub(crate) fn epoch(&self, chain: &str) -> u64 {
        self.writes.get(chain).copied().unwrap_or(0)
    }

    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    pub(crate) fn version(&self) -> IpVersion {
        self.version
    }

    /// Takes the desired table's change log: hashes the chains set since the last call (new
    /// content is worth trying again if the kernel refused the old), forgets removed ones, and
    /// hashes the hook rules if they were set.
    pub(crate) fn take_changes(&mut self, d: &mut desired::Table) {
        let (chains, hooks) = d.take_changes();
        for name in chains {
            match d.chain(&name) {
                Some(c) => {
                    let hashes = rule_hashes(&name, &c.rules);
                    if self.refused.get(&name).is_some_and(|r| r.hashes != hashes) {
                        self.refused.remove(&name);
                    }
                    self.hashes.insert(name, hashes);
                }
                None => {
                    self.hashes.remove(&name);
                    self.refused.remove(&name);
                }
            }
        }
        if hooks {
            let hooks = d.hooks();
            let mut hashes = BTreeMap::new();
            let kernel_chains: std::collections::BTreeSet<&String> =
                hooks.inserts.keys().chain(hooks.appends.keys()).collect();
            for k in kernel_chains {
                let ins = hooks
                    .inserts
                    .get(k)
                    .map(|r| rule_hashes(k, r))
                    .unwrap_or_default();
                let app = hooks
                    .appends
                    .get(k)
                    .map(|r| rule_hashes(&format!("{k}*appends*"), r))
                    .unwrap_or_default();
                hashes.insert(k.clone(), (ins, app));
            }
            self.hook_hashes = hashes;
        }
    }

    /// The rule id of the rule at `position` (1-based, as `iptables -L --line-numbers` and
    /// `iptables-save` order them) of our chain `chain`, as this writer puts it in the kernel
    /// (a chain the kernel refused and that fails closed holds a DROP without an id).
    pub(crate) fn rule_id_at<'a>(
        &'a self,
        d: &'a desired::Table,
        chain: &str,
        position: usize,
    ) -> Option<&'a RuleId> {
        let (rules, _) = self.wanted(d, chain)?;
        rules.get(position.checked_sub(1)?)?.id.as_ref()
    }

    /// The rule id of the rule of our chain `chain` that carries `comment`: its `cali:<hash>`
    /// comment, or a whole rule line from `iptables-save` holding it.
    pub(crate) fn rule_id_by_comment<'a>(
        &'a self,
        d: &'a desired::Table,
        chain: &str,
        comment: &str,
    ) -> Option<&'a RuleId> {
        self.rule_by_comment(d, chain, comment)?.id.as_ref()
    }

    /// The rule of our chain `chain` that carries `comment` (see
    /// [`KernelTable::rule_id_by_comment`]).
    pub(crate) fn rule_by_comment<'a>(
        &'a self,
        d: &'a desired::Table,
        chain: &str,
        comment: &str,
    ) -> Option<&'a Rule> {
        let hash = hash_of(comment)
            .or_else(|| comment.strip_prefix("cali:"))
            .unwrap_or(comment);
        let (rules, hashes) = self.wanted(d, chain)?;
        let i = hashes.iter().position(|h| h == hash)?;
        rules.get(i)
    }

    /// Forgets the kernel view: the next apply reads the kernel back, repairs differences and
    /// tries refused chains again.
    pub(crate) fn invalidate(&mut self) {
        if let Some(k) = self.kernel.take() {
            self.last_known = Some(k);
        }
        self.refused.clear();
    }

    /// Takes a fresh read-back as the kernel view, reporting what changed behind our back since
    /// the view `invalidate` dropped (an operator's hand edit, another tool): it is about to be
    /// repaired, and an operator should hear of it without debug logging.
    fn set_kernel_view(&mut self, view: KernelView) {
        if let Some(before) = self.last_known.take() {
            let changed = drift(&before, &view);
            if !changed.is_empty() {
                let shown: Vec<&str> = changed.iter().take(10).map(String::as_str).collect();
                tracing::warn!(
                    table = self.name,
                    v = self.version.number(),
                    count = changed.len(),
                    chains = %shown.join(", "),
                    "iptables chains of ours were changed outside the agent; repairing them"
                );
            }
        }
        self.kernel = Some(view);
    }

    /// Whether the next apply must read the kernel back first.
    pub(crate) fn needs_read_back(&self) -> bool {
        self.kernel.is_none()
    }

    /// Takes the kernel view from `iptables-save` output covering this table (other tables'
    /// sections in the same text are ignored). Lets the caller read every table of a family
    /// with one save: with nft, each save costs as much as the whole ruleset.
    pub(crate) fn load_kernel_view(&mut self, save_output: &str) {
        self.set_kernel_view(parse_save(&table_section(save_output, self.name)));
        self.loaded = true;
    }

    /// Brings the kernel in line with the desired chains (see the module doc). When the
    /// transaction fails, the chains responsible are found and refused (see
    /// [`Table::refused`]) and everything else is applied; an error is returned only when the
    /// tool fails as such or our own hooks cannot be written.
    pub(crate) fn apply(
        &mut self,
        d: &desired::Table,
        runner: &mut dyn CommandRunner,
        backend: Backend,
    ) -> Result<ApplyStats, TableError> {
        let result = self.apply_inner(d, runner, backend);
        if result.is_err() {
            // We no longer know what the kernel holds: read it back before the retry.
            self.kernel = None;
        }
        result
    }

    fn apply_inner(
        &mut self,
        d: &desired::Table,
        runner: &mut dyn CommandRunner,
        backend: Backend,
    ) -> Result<ApplyStats, TableError> {
        let mut stats = ApplyStats {
            read_back: std::mem::take(&mut self.loaded),
            ..ApplyStats::default()
        };
        if self.kernel.is_none() {
            let view = self.read_back(runner, backend)?;
            self.set_kernel_view(view);
            stats.read_back = true;
        }
        let writes = self.chain_writes(d);
        let tail = self.tail(d);
        if writes.is_empty() && tail.script.is_empty() {
            return Ok(stats);
        }
        let script = format!("{}{}", self.write_script(d, &writes), tail.script);
        match self.restore(runner, backend, &script) {
            Ok(()) => {
                self.record_writes(d, &writes);
                self.record_tail(d, &tail);
                stats.chains_written = writes.len();
            }
            Err(error) if !writes.is_empty() => {
                tracing::warn!(table = self.name, v = self.version.number(), %error, chains = writes.len(), "restore failed; finding the chains responsible");
                // The tool itself failing (lock, missing binary) is not any chain's fault.
                self.restore(runner, backend, "")?;
                let (written, refused) = self.isolate(d, runner, backend, writes);
                stats.chains_written = written;
                stats.chains_refused = refused;
                // The hooks and deletions, now that every chain is in, or failing closed.
                let tail = self.tail(d);
                if !tail.script.is_empty() {
                    self.restore(runner, backend, &tail.script)?;
                    self.record_tail(d, &tail);
                }
                stats.chains_deleted = tail.stale.len();
                stats.hooks_fixed = tail.hook_fixes.len();
                return Ok(stats);
            }
            Err(error) => return Err(error),
        }
        stats.chains_deleted = tail.stale.len();
        stats.hooks_fixed = tail.hook_fixes.len();
        Ok(stats)
    }

    /// The rules and hashes we want in the kernel for `name`: the desired chain, a single DROP
    /// in its place when the kernel refused it and it renders a stream object, or `None` when
    /// the kernel refused it and it is one of our own (its kernel version is left alone).
    fn wanted<'a>(
        &'a self,
        d: &'a desired::Table,
        name: &str,
    ) -> Option<(&'a [Rule], &'a [String])> {
        let c = d.chain(name)?;
        let hashes = self.hashes.get(name)?;
        match self.refused.get(name) {
            Some(r) if &r.hashes == hashes => c
                .owner
                .as_ref()
                .map(|_| (std::slice::from_ref(&*DROP_RULE), r.fallback.as_slice())),
            _ => Some((&c.rules, hashes)),
        }
    }

    /// Chains whose kernel version differs from what we want, in an order where every chain
    /// comes after the chains it jumps to (so any prefix of the list can be written alone).
    fn chain_writes(&self, d: &desired::Table) -> Vec<String> {
        let kernel = self.kernel.as_ref().expect("read back before planning");
        let mut differ: Vec<&str> = d
            .chains()
            .map(|(n, _)| n)
            .filter(|n| {
                self.wanted(d, n)
                    .is_some_and(|(_, h)| kernel.ours.get(*n).map(Vec::as_slice) != Some(h))
            })
            .collect();
        differ.sort();
        let wanted: std::collections::HashSet<&str> = differ.iter().copied().collect();
        let mut order = Vec::with_capacity(differ.len());
        let mut seen = std::collections::HashSet::new();
        for name in differ {
            self.visit(d, name, &wanted, &mut seen, &mut order);
        }
        order
    }

    fn visit<'a>(
        &'a self,
        d: &'a desired::Table,
        name: &'a str,
        wanted: &std::collections::HashSet<&str>,
        seen: &mut std::collections::HashSet<&'a str>,
        order: &mut Vec<String>,
    ) {
        if !seen.insert(name) {
            return;
        }
        if let Some((rules, _)) = self.wanted(d, name) {
            for t in rules.iter().filter_map(|r| r.action.target_chain()) {
                if wanted.contains(t) {
                    let t = d.chain_key(t).expect("wanted");
                    self.visit(d, t, wanted, seen, order);
                }
            }
        }
        order.push(name.to_owned());
    }

    /// Declarations (which flush under `--noflush`) and rules of the given chains.
    fn write_script(&self, d: &desired::Table, names: &[String]) -> String {
        let mut decls = String::new();
        let mut body = String::new();
        for name in names {
            let (rules, hashes) = self.wanted(d, name).expect("planned chains are wanted");
            let _ = writeln!(decls, ":{name} - [0:0]");
            for (rule, hash) in rules.iter().zip(hashes) {
                body.push_str(&rule.render_with_hash(name, hash));
                body.push('\n');
            }
        }
        decls + &body
    }

    fn record_writes(&mut self, d: &desired::Table, names: &[String]) {
        for name in names {
            let hashes = self.wanted(d, name).expect("written").1.to_vec();
            let kernel = self.kernel.as_mut().expect("read back above");
            kernel.ours.insert(name.clone(), hashes);
            *self.writes.entry(name.clone()).or_default() += 1;
        }
    }

    /// Writes the chains in `order` with as few transactions as it takes to find the ones the
    /// kernel refuses on their own: the whole list, then each half, down to single chains.
    /// A refused chain is recorded (and replaced by its fallback right away, so the chains
    /// after it that jump to it can go in). Returns (written, refused).
    fn isolate(
        &mut self,
        d: &desired::Table,
        runner: &mut dyn CommandRunner,
        backend: Backend,
        order: Vec<String>,
    ) -> (usize, usize) {
        let mut written = 0;
        let mut refused = 0;
        let mut work = vec![order];
        while let Some(batch) = work.pop() {
            match self.restore(runner, backend, &self.write_script(d, &batch)) {
                Ok(()) => {
                    self.record_writes(d, &batch);
                    written += batch.len();
                }
                Err(error) if batch.len() == 1 => {
                    refused += 1;
                    self.refuse(d, runner, backend, &batch[0], &error);
                }
                Err(_) => {
                    // Left half first: the right half may jump into it.
                    let mut left = batch;
                    let right = left.split_off(left.len() / 2);
                    work.push(right);
                    work.push(left);
                }
            }
        }
        (written, refused)
    }

    fn refuse(
        &mut self,
        d: &desired::Table,
        runner: &mut dyn CommandRunner,
        backend: Backend,
        name: &str,
        error: &TableError,
    ) {
        let owner = d.chain(name).and_then(|c| c.owner.clone());
        let error = match error {
            TableError::Failed { stderr, .. } => stderr.clone(),
            other => other.to_string(),
        };
        tracing::warn!(table = self.name, v = self.version.number(), chain = %name, object = owner.as_deref().unwrap_or("-"), %error, "the kernel refused a chain; failing closed for it");
        self.refused.insert(
            name.to_owned(),
            Refused {
                hashes: self.hashes.get(name).cloned().unwrap_or_default(),
                fallback: rule_hashes(name, std::slice::from_ref(&*DROP_RULE)),
                error,
            },
        );
        if owner.is_some() {
            let names = [name.to_owned()];
            match self.restore(runner, backend, &self.write_script(d, &names)) {
                Ok(()) => self.record_writes(d, &names),
                Err(error) => {
                    tracing::error!(table = self.name, chain = %name, %error, "could not replace a refused chain by a DROP");
                }
            }
        }
    }

    /// Chains the kernel refused: (chain, object it renders, the kernel's error).
    pub(crate) fn refused<'a>(
        &'a self,
        d: &'a desired::Table,
    ) -> impl Iterator<Item = (&'a str, Option<&'a str>, &'a str)> {
        self.refused.iter().map(move |(name, r)| {
            let owner = d.chain(name).and_then(|c| c.owner.as_deref());
            (name.as_str(), owner, r.error.as_str())
        })
    }

    /// The transaction's second part: flushing stale chains of ours, fixing hook rules in the
    /// kernel's chains, and deleting the stale chains.
    fn tail(&self, d: &desired::Table) -> Tail {
        let kernel = self.kernel.as_ref().expect("read back before planning");
        let mut script = String::new();
        // Stale chains of ours: flushed now, deleted at the end. One that a desired chain still
        // jumps to is left alone until nothing does (deleting it would fail the transaction).
        let mut stale: Vec<String> = kernel
            .ours
            .keys()
            .filter(|n| !d.has_chain(n))
            .cloned()
            .collect();
        if !stale.is_empty() {
            let referenced: std::collections::HashSet<&str> = d
                .chains()
                .flat_map(|(_, c)| c.rules.iter().filter_map(|r| r.action.target_chain()))
                .collect();
            stale.retain(|n| {
                let keep = referenced.contains(n.as_str());
                if keep {
                    tracing::warn!(table = self.name, chain = %n, "unwanted chain is still referenced; kept for now");
                }
                !keep
            });
        }
        stale.sort();
        for name in &stale {
            let _ = writeln!(script, ":{name} - [0:0]");
        }

        // Hook rules in the kernel's chains.
        let mut hook_fixes: Vec<String> = Vec::new();
        let mut kernel_chains: Vec<&String> = self
            .hook_hashes
            .keys()
            .chain(
                kernel
                    .others
                    .iter()
                    .filter(|(_, r)| r.iter().any(|r| r.hash.is_some()))
                    .map(|(k, _)| k),
            )
            .collect();
        kernel_chains.sort();
        kernel_chains.dedup();
        for chain in kernel_chains {
            let empty = (Vec::new(), Vec::new());
            let (ins, app) = self.hook_hashes.get(chain).unwrap_or(&empty);
            let rules = kernel.others.get(chain).map(Vec::as_slice).unwrap_or(&[]);
            if hooks_in_place(rules, ins, app) {
                continue;
            }
            // Remove every rule of ours (by value: positions may shift under other writers),
            // then insert ours at the top in reverse order and append the appends.
            for r in rules
                .iter()
                .filter(|r| r.hash.is_some() || r.spec.contains("-j cali-"))
            {
                let _ = writeln!(script, "-D {chain} {}", r.spec);
            }
            if let Some(inserts) = d.hooks().inserts.get(chain) {
                for (rule, hash) in inserts.iter().zip(ins).rev() {
                    let line = rule.render_with_hash(chain, hash);
                    let prefix = format!("-A {}", quote::arg(chain));
                    let _ = writeln!(script, "-I {chain} 1{}", &line[prefix.len()..]);
                }
            }
            if let Some(appends) = d.hooks().appends.get(chain) {
                for (rule, hash) in appends.iter().zip(app) {
                    script.push_str(&rule.render_with_hash(chain, hash));
                    script.push('\n');
                }
            }
            hook_fixes.push(chain.clone());
        }
        for name in &stale {
            let _ = writeln!(script, "-X {name}");
        }
        Tail {
            script,
            stale,
            hook_fixes,
        }
    }

    /// Records what a successful tail did to the kernel.
    fn record_tail(&mut self, d: &desired::Table, tail: &Tail) {
        let kernel = self.kernel.as_mut().expect("read back above");
        for name in &tail.stale {
            kernel.ours.remove(name);
        }
        for chain in &tail.hook_fixes {
            let mut rules: Vec<KernelRule> = Vec::new();
            let empty = (Vec::new(), Vec::new());
            let (ins, app) = self.hook_hashes.get(chain).unwrap_or(&empty);
            if let Some(inserts) = d.hooks().inserts.get(chain) {
                rules.extend(
                    inserts
                        .iter()
                        .zip(ins)
                        .map(|(r, h)| kernel_rule(chain, r, h)),
                );
            }
            let foreign = kernel
                .others
                .get(chain)
                .into_iter()
                .flatten()
                .filter(|r| r.hash.is_none() && !r.spec.contains("-j cali-"))
                .cloned()
                .collect::<Vec<_>>();
            rules.extend(foreign);
            if let Some(appends) = d.hooks().appends.get(chain) {
                rules.extend(
                    appends
                        .iter()
                        .zip(app)
                        .map(|(r, h)| kernel_rule(chain, r, h)),
                );
            }
            kernel.others.insert(chain.clone(), rules);
        }
    }

    /// One `--noflush` transaction (an empty one checks that the tool works at all). Both
    /// backends commit a table atomically: a refused transaction changes nothing.
    fn restore(
        &self,
        runner: &mut dyn CommandRunner,
        backend: Backend,
        script: &str,
    ) -> Result<(), TableError> {
        let input = format!("*{}\n{script}COMMIT\n", self.name);
        let program = backend.program(self.version, "restore");
        let wait = format!("--wait={}", self.lock_wait_secs);
        let out = runner
            .run(&program, &["--noflush", &wait], Some(input.as_bytes()))
            .map_err(|source| TableError::Spawn {
                program: program.clone(),
                source,
            })?;
        if !out.success {
            tracing::debug!(table = self.name, input = %input, "failed restore input");
            return Err(TableError::Failed {
                program,
                stderr: out.stderr_summary(),
            });
        }
        Ok(())
    }

    fn read_back(
        &self,
        runner: &mut dyn CommandRunner,
        backend: Backend,
    ) -> Result<KernelView, TableError> {
        let text = run_save(runner, backend, self.version, &["-t", self.name])?;
        Ok(parse_save(&text))
    }
}

fn kernel_rule(chain: &str, rule: &Rule, hash: &str) -> KernelRule {
    let line = rule.render_with_hash(chain, hash);
    KernelRule {
        hash: Some(hash.to_owned()),
        spec: line[4 + chain.len()..].to_owned(),
    }
}

/// Our inserts are the first rules of the chain, in order; our appends come after every other
/// rule of ours, in order; and there are no other rules of ours.
fn hooks_in_place(rules: &[KernelRule], inserts: &[String], appends: &[String]) -> bool {
    if rules.len() < inserts.len() {
        return false;
    }
    let top_ok = rules
        .iter()
        .zip(inserts)
        .all(|(r, h)| r.hash.as_deref() == Some(h.as_str()));
    if !top_ok {
        return false;
    }
    let rest: Vec<&str> = rules[inserts.len()..]
        .iter()
        .filter_map(|r| r.hash.as_deref())
        .collect();
    let stray_jumps = rules[inserts.len()..]
        .iter()
        .any(|r| r.hash.is_none() && r.spec.contains("-j cali-"));
    !stray_jumps && rest == appends.iter().map(String::as_str).collect::<Vec<_>>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::linux::fake::FakeKernel;
    use crate::driver::linux::rules::static_chains::Hooks;
    use crate::driver::linux::rules::{Action, Chain, Match};

    /// A desired filter table and the writer's view of it, as the iptables writer pairs them.
    struct T {
        d: desired::Table,
        k: KernelTable,
    }

    impl T {
        fn new() -> Self {
            Self {
                d: desired::Table::new("filter", IpVersion::V4),
                k: KernelTable::new("filter", IpVersion::V4, 10),
            }
        }
        fn set_chain(&mut self, c: Chain) {
            self.d.set_chain(c);
        }
        fn set_owned_chain(&mut self, c: Chain, owner: &str) {
            self.d.set_owned_chain(c, owner);
        }
        fn set_hooks(&mut self, h: Hooks) {
            self.d.set_hooks(h);
        }
        fn remove_chain(&mut self, name: &str) {
            self.d.remove_chain(name);
        }
        fn invalidate(&mut self) {
            self.k.invalidate();
        }
        fn apply(
            &mut self,
            runner: &mut dyn CommandRunner,
            backend: Backend,
        ) -> Result<ApplyStats, TableError> {
            self.k.take_changes(&mut self.d);
            self.k.apply(&self.d, runner, backend)
        }
        fn refused(&self) -> impl Iterator<Item = (&str, Option<&str>, &str)> {
            self.k.refused(&self.d)
        }
    }

    fn chain(name: &str, n: usize) -> Chain {
        Chain::new(
            name,
            (0..n)
                .map(|i| Rule::new(Match::new().src_net(&format!("10.0.0.{i}")), Action::Accept))
                .collect(),
        )
    }

    fn hooks() -> Hooks {
        let mut h = Hooks::default();
        h.inserts.insert(
            "INPUT".into(),
            vec![Rule::always(Action::Jump("cali-INPUT".into()))],
        );
        h
    }

    /// Backend detection reads each backend whole: never a table by name, which would make
    /// the legacy kernel create it.
    #[test]
    fn detecting_the_backend_never_names_a_table() {
        struct Recorder(Vec<(String, Vec<String>)>);
        impl CommandRunner for Recorder {
            fn run(
                &mut self,
                program: &str,
                args: &[&str],
                _stdin: Option<&[u8]>,
            ) -> std::io::Result<crate::driver::linux::runner::Output> {
                self.0.push((
                    program.to_string(),
                    args.iter().map(|a| a.to_string()).collect(),
                ));
                let stdout = if program == "iptables-nft-save" {
                    b"*filter\n:KUBE-IPTABLES-HINT - [0:0]\n-A INPUT -j ACCEPT\nCOMMIT\n".to_vec()
                } else {
                    Vec::new()
                };
                Ok(crate::driver::linux::runner::Output {
                    success: true,
                    code: Some(0),
                    stdout,
                    stderr: Vec::new(),
                })
            }
        }
        let mut r = Recorder(Vec::new());
        assert_eq!(detect_backend(&mut r), Backend::IptablesNft);
        assert!(
            r.0.iter().any(|(p, _)| p == "iptables-legacy-save"),
            "legacy is looked at: {:?}",
            r.0
        );
        for (program, args) in &r.0 {
            assert!(
                !args.iter().any(|a| a == "-t"),
                "{program} {args:?} names a table"
            );
        }
    }

    #[test]
    fn random_fully_needs_iptables_1_6_2_and_linux_3_14() {
        let mut k = FakeKernel::new();
        // The fake's restore tool says v1.8.9.
        assert!(supports_masquerade_fully_random(
            &mut k,
            Backend::IptablesNft,
            Some("6.1.0-13-amd64")
        ));
        assert!(!supports_masquerade_fully_random(
            &mut k,
            Backend::IptablesNft,
            Some("3.13.11")
        ));
        assert!(!supports_masquerade_fully_random(
            &mut k,
            Backend::IptablesNft,
            None
        ));
        assert_eq!(parse_version("iptables-restore v1.6.1"), Some((1, 6, 1)));
        assert_eq!(parse_version("iptables v1.6.2 (legacy)"), Some((1, 6, 2)));
        assert_eq!(parse_version("4.19"), Some((4, 19, 0)));
        assert_eq!(parse_version("no version here"), None);
    }

    #[test]
    fn counted_rules_of_ours_are_read_with_their_table() {
        let text = "*filter\n:cali-pi-x - [0:0]\n\
            [12:3400] -A cali-pi-x -m comment --comment \"cali:abc\" -j ACCEPT\n\
            [5:60] -A INPUT -m comment --comment \"cali:hook\" -j cali-INPUT\n\
            [7:70] -A cali-pi-x -j MARK --set-xmark 0x0/0x10000\n\
            COMMIT\n*mangle\n\
            [1:2] -A cali-po-y -m comment --comment \"cali:def\" -j DROP\nCOMMIT\n";
        assert_eq!(
            parse_counted(text),
            vec![
                CountedRule {
                    table: "filter".into(),
                    chain: "cali-pi-x".into(),
                    hash: "abc".into(),
                    packets: 12,
                    bytes: 3400
                },
                CountedRule {
                    table: "mangle".into(),
                    chain: "cali-po-y".into(),
                    hash: "def".into(),
                    packets: 1,
                    bytes: 2
                },
            ]
        );
    }

    #[test]
    fn hash_extraction_handles_both_quotings() {
        assert_eq!(
            hash_of("-m comment --comment \"cali:abc-_1\" -j X"),
            Some("abc-_1")
        );
        assert_eq!(hash_of("-m comment --comment cali:xyz -j X"), Some("xyz"));
        assert_eq!(hash_of("-j ACCEPT"), None);
    }

    #[test]
    fn only_changed_chains_are_written() {
        let mut k = FakeKernel::new();
        let mut t = T::new();
        t.set_chain(chain("cali-INPUT", 1));
        t.set_chain(chain("cali-a", 3));
        t.set_chain(chain("cali-b", 3));
        t.set_hooks(hooks());
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!((s.chains_written, s.hooks_fixed, s.read_back), (3, 1, true));
        assert_eq!(k.chain_rules(IpVersion::V4, "filter", "cali-a").len(), 3);
        assert!(k.chain_rules(IpVersion::V4, "filter", "INPUT")[0].contains("cali-INPUT"));

        // Nothing changed: no restore at all.
        let calls = k.restore_calls();
        assert_eq!(
            t.apply(&mut k, Backend::IptablesNft).unwrap(),
            ApplyStats::default()
        );
        assert_eq!(k.restore_calls(), calls);

        // One chain changes: only it is in the transaction.
        t.set_chain(chain("cali-b", 4));
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!(s.chains_written, 1);
        let input = k.last_restore_input();
        assert!(input.contains(":cali-b - [0:0]"));
        assert!(!input.contains("cali-a"), "{input}");
        assert_eq!(k.chain_rules(IpVersion::V4, "filter", "cali-b").len(), 4);
    }

    #[test]
    fn stale_chains_go_and_foreign_rules_stay() {
        let mut k = FakeKernel::new();
        k.exec_restore(IpVersion::V4, "*filter\n:cali-old - [0:0]\n:KUBE-X - [0:0]\n-A INPUT -j KUBE-X\n-A cali-old -j ACCEPT\nCOMMIT\n").unwrap();
        let mut t = T::new();
        t.set_chain(chain("cali-INPUT", 1));
        t.set_hooks(hooks());
        let s = t.apply(&mut k, Backend::IptablesLegacy).unwrap();
        assert_eq!(s.chains_deleted, 1);
        assert!(!k.has_chain(IpVersion::V4, "filter", "cali-old"));
        let input = k.chain_rules(IpVersion::V4, "filter", "INPUT");
        assert_eq!(input.len(), 2);
        assert!(input[0].contains("cali-INPUT"), "ours go first: {input:?}");
        assert_eq!(input[1], "-j KUBE-X");
    }

    #[test]
    fn out_of_band_changes_are_repaired_after_invalidate() {
        let mut k = FakeKernel::new();
        k.exec_restore(
            IpVersion::V4,
            "*filter\n:KUBE-X - [0:0]\n-A INPUT -j KUBE-X\nCOMMIT\n",
        )
        .unwrap();
        let mut t = T::new();
        t.set_chain(chain("cali-INPUT", 1));
        t.set_chain(chain("cali-a", 3));
        t.set_hooks(hooks());
        t.apply(&mut k, Backend::IptablesNft).unwrap();
        // Someone deletes a rule of ours and moves our hook below theirs.
        k.exec_restore(IpVersion::V4, "*filter\n-D cali-a 2\nCOMMIT\n")
            .unwrap();
        let hook = k.chain_rules(IpVersion::V4, "filter", "INPUT")[0].clone();
        k.exec_restore(
            IpVersion::V4,
            &format!("*filter\n-D INPUT {hook}\n-A INPUT {hook}\nCOMMIT\n"),
        )
        .unwrap();
        // Without a read-back we trust our view.
        assert_eq!(
            t.apply(&mut k, Backend::IptablesNft).unwrap(),
            ApplyStats::default()
        );
        t.invalidate();
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!((s.chains_written, s.hooks_fixed), (1, 1));
        assert!(
            !k.last_restore_input().contains("cali-INPUT - [0:0]"),
            "the intact chain is left alone"
        );
        assert_eq!(k.chain_rules(IpVersion::V4, "filter", "cali-a").len(), 3);
        let input = k.chain_rules(IpVersion::V4, "filter", "INPUT");
        assert!(
            input[0].contains("cali-INPUT") && input[1] == "-j KUBE-X",
            "{input:?}"
        );
    }

    #[test]
    fn changes_behind_our_back_are_named() {
        let before = parse_save(
            "*filter\n:cali-a - [0:0]\n:cali-b - [0:0]\n\
             -A INPUT -m comment --comment \"cali:h0\" -j cali-a\n\
             -A cali-a -m comment --comment \"cali:h1\" -j ACCEPT\n\
             -A cali-b -m comment --comment \"cali:h2\" -j DROP\nCOMMIT\n",
        );
        assert!(drift(&before, &before).is_empty());
        // cali-a edited, cali-b deleted, cali-x added, our hook in INPUT removed.
        let now = parse_save(
            "*filter\n:cali-a - [0:0]\n:cali-x - [0:0]\n\
             -A INPUT -j KUBE-X\n\
             -A cali-a -j ACCEPT\nCOMMIT\n",
        );
        assert_eq!(
            drift(&before, &now),
            ["INPUT (our rules in it)", "cali-a", "cali-b", "cali-x"]
        );
    }

    #[test]
    fn a_stale_chain_still_referenced_is_kept_until_it_is_not() {
        let mut k = FakeKernel::new();
        let mut t = T::new();
        t.set_chain(chain("cali-target", 1));
        t.set_chain(Chain::new(
            "cali-user",
            vec![Rule::always(Action::Jump("cali-target".into()))],
        ));
        t.apply(&mut k, Backend::IptablesNft).unwrap();
        // Inconsistent input: the target goes while a chain still jumps to it.
        t.remove_chain("cali-target");
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!(s.chains_deleted, 0);
        assert_eq!(
            k.chain_rules(IpVersion::V4, "filter", "cali-target").len(),
            1
        );
        t.remove_chain("cali-user");
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!(s.chains_deleted, 2);
        assert!(!k.has_chain(IpVersion::V4, "filter", "cali-target"));
    }

    #[test]
    fn a_tool_failure_is_an_error_and_forces_a_read_back() {
        let mut k = FakeKernel::new();
        let mut t = T::new();
        t.set_chain(chain("cali-a", 1));
        t.set_chain(chain("cali-b", 1));
        t.apply(&mut k, Backend::IptablesNft).unwrap();
        t.set_chain(chain("cali-a", 2));
        t.set_chain(chain("cali-b", 2));
        k.fail_restores = Some("Another app is currently holding the xtables lock".into());
        let calls = k.restore_calls();
        let err = t
            .apply(&mut k, Backend::IptablesNft)
            .unwrap_err()
            .to_string();
        assert!(err.contains("xtables lock"), "{err}");
        // The whole batch, then an empty one showing the tool itself fails: no bisecting.
        assert_eq!(k.restore_calls() - calls, 2);
        assert_eq!(t.refused().count(), 0, "no chain is blamed");
        k.fail_restores = None;
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert!(s.read_back);
        assert_eq!(s.chains_written, 2);
    }

    fn chain_from(name: &str, addrs: &[&str]) -> Chain {
        Chain::new(
            name,
            addrs
                .iter()
                .map(|a| Rule::new(Match::new().src_net(a), Action::Accept))
                .collect(),
        )
    }

    #[test]
    fn a_chain_the_kernel_refuses_fails_closed_and_the_rest_goes_in() {
        let mut k = FakeKernel::new();
        k.refuse.push("10.9.9.9".into());
        let mut t = T::new();
        t.set_hooks(hooks());
        t.set_chain(chain("cali-INPUT", 1));
        t.set_owned_chain(chain_from("cali-pi-bad", &["10.9.9.9"]), "policy bad");
        t.set_owned_chain(chain("cali-pi-good", 2), "policy good");
        // An endpoint chain that jumps to both: it sorts first, but goes in after them.
        let endpoint = Chain::new(
            "cali-fw-x",
            vec![
                Rule::always(Action::Jump("cali-pi-bad".into())),
                Rule::always(Action::Jump("cali-pi-good".into())),
            ],
        );
        t.set_owned_chain(endpoint.clone(), "workload endpoint x");
        for n in 0..6 {
            t.set_owned_chain(chain(&format!("cali-pi-other{n}"), 1), "policy other");
        }
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!((s.chains_written, s.chains_refused), (9, 1));
        assert_eq!(
            k.chain_rules(IpVersion::V4, "filter", "cali-pi-bad"),
            vec![format!(
                "-m comment --comment \"cali:{}\" --jump DROP",
                rule_hashes("cali-pi-bad", &[Rule::always(Action::Drop)])[0]
            )],
            "the refused chain is a DROP"
        );
        assert_eq!(
            k.chain_rules(IpVersion::V4, "filter", "cali-pi-good").len(),
            2
        );
        assert_eq!(k.chain_rules(IpVersion::V4, "filter", "cali-fw-x").len(), 2);
        assert!(k.chain_rules(IpVersion::V4, "filter", "INPUT")[0].contains("cali-INPUT"));
        let refused: Vec<_> = t.refused().collect();
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].0, "cali-pi-bad");
        assert_eq!(refused[0].1, Some("policy bad"));
        assert!(
            refused[0].2.contains("refused by the kernel"),
            "{refused:?}"
        );

        // Kept out: the next apply does not try it (or anything) again.
        let calls = k.restore_calls();
        assert_eq!(
            t.apply(&mut k, Backend::IptablesNft).unwrap(),
            ApplyStats::default()
        );
        assert_eq!(k.restore_calls(), calls);

        // An unrelated change goes in with one transaction.
        t.set_owned_chain(chain("cali-pi-good", 3), "policy good");
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!((s.chains_written, s.chains_refused), (1, 0));
        assert_eq!(k.restore_calls(), calls + 1);

        // New content for the refused chain is tried again, and the refusal clears.
        t.set_owned_chain(chain_from("cali-pi-bad", &["10.1.1.1"]), "policy bad");
        t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!(t.refused().count(), 0);
        assert!(k.chain_rules(IpVersion::V4, "filter", "cali-pi-bad")[0].contains("10.1.1.1"));
    }

    #[test]
    fn a_refused_chain_of_our_own_keeps_its_kernel_version() {
        let mut k = FakeKernel::new();
        let mut t = T::new();
        t.set_chain(chain("cali-static", 2));
        t.apply(&mut k, Backend::IptablesNft).unwrap();
        k.refuse.push("10.9.9.9".into());
        t.set_chain(chain_from("cali-static", &["10.9.9.9"]));
        let s = t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!(s.chains_refused, 1);
        assert_eq!(
            k.chain_rules(IpVersion::V4, "filter", "cali-static").len(),
            2
        );
        assert_eq!(t.refused().next().map(|r| r.1), Some(None));
        // A refresh tries it again.
        k.refuse.clear();
        t.invalidate();
        t.apply(&mut k, Backend::IptablesNft).unwrap();
        assert_eq!(t.refused().count(), 0);
        assert!(k.chain_rules(IpVersion::V4, "filter", "cali-static")[0].contains("10.9.9.9"));
    }
}
