//! IP sets: the calc-server's set ids (one id, v4 and v6 members mixed) become kernel sets
//! `cali40<id>` / `cali60<id>` cut to 31 characters, as Calico names them.
//!
//! Contract: `replace`/`delta`/`remove` only record. [`IpSets::apply_updates`] (before the
//! iptables tables) creates missing sets and writes membership deltas with one `ipset restore`;
//! a set whose kernel type or family is wrong is built beside it in a temporary set
//! (`cali4t0`…), the rules move to it and back ([`Migration`]), so they never lose the set. [`IpSets::apply_deletions`] (after the
//! tables, once no rule refers to them) destroys sets of ours that are no longer wanted. The
//! kernel view is read back with `ipset save` on the first apply, after a failure and after
//! [`IpSets::invalidate`], which is how out-of-band changes get repaired. When a batch fails
//! (`ipset restore` is not atomic), the kernel is read back and each set is written on its
//! own; a set the kernel refuses is reported by [`IpSets::refused`], and the driver makes the
//! rules that use it fail closed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use super::rules::{IpVersion, ipset_name};
use super::runner::CommandRunner;
use super::validate::{self, MemberKind};

/// Sets we own start with one of these.
const OUR_SET_PREFIXES: [&str; 4] = ["cali40", "cali60", "cali4t", "cali6t"];

/// The kernel set type of a proto set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SetKind {
    Ip,
    IpPort,
    Net,
}

impl SetKind {
    /// From `IPSetUpdate.type`.
    pub(crate) fn from_proto(t: crate::message::IpSetType) -> Self {
        use crate::message::IpSetType;
        match t {
            IpSetType::Ip => SetKind::Ip,
            IpSetType::IpAndPort => SetKind::IpPort,
            IpSetType::Net => SetKind::Net,
        }
    }

    fn kernel_type(self) -> &'static str {
        match self {
            SetKind::Ip => "hash:ip",
            SetKind::IpPort => "hash:ip,port",
            SetKind::Net => "hash:net",
        }
    }
}

fn family(v: IpVersion) -> &'static str {
    match v {
        IpVersion::V4 => "inet",
        IpVersion::V6 => "inet6",
    }
}

/// A member in the form `ipset save` prints it, with its family, checked and normalised by
/// [`validate::ipset_members`] (a `/0` gives two members); the reason when it is refused.
pub(crate) fn normalize_member(
    kind: SetKind,
    member: &str,
) -> Result<Vec<(IpVersion, String)>, String> {
    let vkind = match kind {
        SetKind::Ip => MemberKind::Ip,
        SetKind::IpPort => MemberKind::IpPort,
        SetKind::Net => MemberKind::Net,
    };
    Ok(validate::ipset_members(vkind, member)?
        .into_iter()
        .map(|m| {
            let addr_end = m.find([',', '/']).unwrap_or(m.len());
            let version = if m[..addr_end].contains(':') {
                IpVersion::V6
            } else {
                IpVersion::V4
            };
            // `ipset save` leaves out a full-length prefix.
            let m = match version {
                IpVersion::V4 => m.strip_suffix("/32").map(str::to_owned).unwrap_or(m),
                IpVersion::V6 => m.strip_suffix("/128").map(str::to_owned).unwrap_or(m),
            };
            (version, m)
        })
        .collect())
}

/// Members of `members` that [`normalize_member`] refuses, with the reasons.
fn normalized(
    kind: SetKind,
    members: &[String],
    refused: &mut Vec<String>,
) -> Vec<(IpVersion, String)> {
    let mut out = Vec::with_capacity(members.len());
    for m in members {
        match normalize_member(kind, m) {
            Ok(ms) => out.extend(ms),
            Err(reason) => refused.push(reason),
        }
    }
    out
}

#[derive(Clone, Debug)]
struct DesiredSet {
    /// The calc-server's id of the set.
    id: String,
    kind: SetKind,
    version: IpVersion,
    members: HashSet<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct KernelSet {
    kind: String,
    family: String,
    members: HashSet<String>,
}

/// Why the sets could not be programmed.
#[derive(Debug, thiserror::Error)]
pub enum IpSetError {
    #[error("ipset: cannot run: {0}")]
    Spawn(std::io::Error),
    #[error("ipset {what} failed: {stderr}")]
    Failed { what: &'static str, stderr: String },
}

/// What one `apply_updates` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct IpSetStats {
    pub created: usize,
    pub rewritten: usize,
    pub added: usize,
    pub removed: usize,
    pub read_back: bool,
}

/// An IP set whose type or family changed. The kernel cannot swap sets of different types, and
/// cannot destroy or rename one that rules use, so the new version is built beside the old one
/// as `temp`; the driver points the rules at `temp`, then [`IpSets::finish_migrations`]
/// recreates `name` with the new type and the rules move back. The old set keeps enforcing
/// until the rules leave it: there is no moment without the set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Migration {
    pub version: IpVersion,
    pub name: String,
    pub temp: String,
}

/// Our kernel IP sets.
pub(crate) struct IpSets {
    desired: HashMap<String, DesiredSet>,
    kernel: Option<HashMap<String, KernelSet>>,
    /// `invalidate` dropped a kernel view we trusted: the next read back reports the sets that
    /// changed behind our back.
    check_drift: bool,
    dirty: HashSet<String>,
    /// Sets the kernel refused on their own: kernel name → error. Left out until they change
    /// (`replace`, `delta`, `remove`) or `invalidate`.
    refused: BTreeMap<String, String>,
    /// Families to program (IPv6 sets are skipped when IPv6 is off).
    versions: Vec<IpVersion>,
    /// Type changes built beside the old sets by the last `apply_updates`, not yet finished.
    migrations: Vec<Migration>,
    pub max_elem: u32,
    /// Kernel names of sets removed since the last `take_removed`, for a writer that works
    /// from changes (nftables); `None` until one asks.
    removed: Option<HashSet<String>>,
}

impl IpSets {
    pub(crate) fn new(versions: Vec<IpVersion>) -> Self {
        Self {
            desired: HashMap::new(),
            kernel: None,
            check_drift: false,
            dirty: HashSet::new(),
            refused: BTreeMap::new(),
            versions,
            migrations: Vec::new(),
            max_elem: 1_048_576,
            removed: None,
        }
    }

    /// Replaces a set's type and members (`IPSetUpdate`). Returns the reasons members were
    /// refused (they are left out).
    pub(crate) fn replace(&mut self, id: &str, kind: SetKind, members: &[String]) -> Vec<String> {
        let mut refused = Vec::new();
        let members = normalized(kind, members, &mut refused);
        for v in self.versions.clone() {
            let name = ipset_name(v, id);
            let set = DesiredSet {
                id: id.to_owned(),
                kind,
                version: v,
                members: members
                    .iter()
                    .filter(|(mv, _)| *mv == v)
                    .map(|(_, m)| m.clone())
                    .collect(),
            };
            self.desired.insert(name.clone(), set);
            self.refused.remove(&name);
            self.dirty.insert(name);
        }
        refused
    }

    /// Adds and removes members (`IPSetDeltaUpdate`). Returns the reasons members were refused.
    pub(crate) fn delta(&mut self, id: &str, added: &[String], removed: &[String]) -> Vec<String> {
        let mut refused = Vec::new();
        let Some(kind) = self
            .versions
            .iter()
            .find_map(|v| self.desired.get(&ipset_name(*v, id)).map(|s| s.kind))
        else {
            return refused;
        };
        let removed = normalized(kind, removed, &mut refused);
        let added = normalized(kind, added, &mut refused);
        for v in self.versions.clone() {
            let name = ipset_name(v, id);
            let Some(set) = self.desired.get_mut(&name) else {
                continue;
            };
            for (mv, m) in &removed {
                if *mv == v {
                    set.members.remove(m);
                }
            }
            for (mv, m) in &added {
                if *mv == v {
                    set.members.insert(m.clone());
                }
            }
            self.refused.remove(&name);
            self.dirty.insert(name);
        }
        refused
    }

    /// Our desired sets by kernel name: type, family and members (normalised as `ipset save`
    /// prints them), for a writer other than `ipset restore` (the nftables one).
    pub(crate) fn desired_sets(
        &self,
    ) -> impl Iterator<Item = (&str, SetKind, IpVersion, &HashSet<String>)> {
        self.desired
            .iter()
            .map(|(n, d)| (n.as_str(), d.kind, d.version, &d.members))
    }

    /// One desired set by kernel name: type, family and members.
    pub(crate) fn desired_set(&self, name: &str) -> Option<(SetKind, IpVersion, &HashSet<String>)> {
        self.desired
            .get(name)
            .map(|d| (d.kind, d.version, &d.members))
    }

    /// Starts recording removed sets (see [`IpSets::take_removed`]).
    pub(crate) fn track_removals(&mut self) {
        self.removed.get_or_insert_with(HashSet::new);
    }

    /// Kernel names of the sets removed since the last call.
    pub(crate) fn take_removed(&mut self) -> HashSet<String> {
        self.removed
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The sets changed since the last call (by kernel name), for a writer that does not use
    /// [`IpSets::apply_updates`].
    pub(crate) fn take_dirty(&mut self) -> HashSet<String> {
        std::mem::take(&mut self.dirty)
    }

    /// Whether the set is known (given by an `IPSetUpdate` and not removed).
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.versions
            .iter()
            .any(|v| self.desired.contains_key(&ipset_name(*v, id)))
    }

    /// Forgets a set (`IPSetRemove`); it is destroyed by the next `apply_deletions`.
    pub(crate) fn remove(&mut self, id: &str) {
        for v in IpVersion::BOTH {
            let name = ipset_name(v, id);
            if let Some(removed) = &mut self.removed
                && self.desired.contains_key(&name)
            {
                removed.insert(name.clone());
            }
            self.desired.remove(&name);
            self.refused.remove(&name);
            self.dirty.remove(&name);
        }
    }

    /// The next apply reads the kernel back, repairs what differs and tries refused sets again.
    pub(crate) fn invalidate(&mut self) {
        self.check_drift |= self.kernel.take().is_some();
        self.refused.clear();
    }

    /// Our sets, with no change pending, that the kernel holds otherwise than we programmed
    /// them (missing, another type, other members): changed behind our back.
    fn drifted(&self, kernel: &HashMap<String, KernelSet>) -> Vec<String> {
        let mut out: Vec<String> = self
            .desired
            .iter()
            .filter(|(name, _)| !self.dirty.contains(*name) && !self.refused.contains_key(*name))
            .filter(|(name, d)| match kernel.get(*name) {
                None => true,
                Some(k) => {
                    k.kind != d.kind.kernel_type()
                        || k.family != family(d.version)
                        || k.members != d.members
                }
            })
            .map(|(name, _)| name.clone())
            .collect();
        out.sort();
        out
    }

    /// Number of sets and members we want in the kernel.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (
            self.desired.len(),
            self.desired.values().map(|s| s.members.len()).sum(),
        )
    }

    fn read_back(
        &self,
        runner: &mut dyn CommandRunner,
    ) -> Result<HashMap<String, KernelSet>, IpSetError> {
        let out = runner
            .run("ipset", &["save"], None)
            .map_err(IpSetError::Spawn)?;
        if !out.success {
            return Err(IpSetError::Failed {
                what: "save",
                stderr: out.stderr_summary(),
            });
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut sets: HashMap<String, KernelSet> = HashMap::new();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            match (words.next(), words.next()) {
                (Some("create"), Some(name)) if is_ours(name) => {
                    let kind = words.next().unwrap_or_default().to_owned();
                    let rest: Vec<&str> = words.collect();
                    let family = rest
                        .windows(2)
                        .find(|w| w[0] == "family")
                        .map(|w| w[1].to_owned())
                        .unwrap_or_default();
                    sets.insert(
                        name.to_owned(),
                        KernelSet {
                            kind,
                            family,
                            members: HashSet::new(),
                        },
                    );
                }
                (Some("add"), Some(name)) => {
                    if let (Some(set), Some(m)) = (sets.get_mut(name), words.next()) {
                        set.members.insert(m.to_owned());
                    }
                }
                _ => {}
            }
        }
        Ok(sets)
    }

    /// Creates and updates sets (see the module doc). When the batch fails, each set is
    /// written on its own; the ones the kernel refuses are reported by [`IpSets::refused`]
    /// and left out until they change or the sets are invalidated. An error is returned only
    /// when `ipset` fails as such.
    pub(crate) fn apply_updates(
        &mut self,
        runner: &mut dyn CommandRunner,
    ) -> Result<IpSetStats, IpSetError> {
        let result = self.apply_updates_inner(runner);
        if result.is_err() {
            self.kernel = None;
        }
        result
    }

    fn apply_updates_inner(
        &mut self,
        runner: &mut dyn CommandRunner,
    ) -> Result<IpSetStats, IpSetError> {
        let mut stats = IpSetStats::default();
        // A migration left unfinished (its tables failed) starts again from the kernel.
        for m in std::mem::take(&mut self.migrations) {
            self.dirty.insert(m.name);
        }
        if self.kernel.is_none() {
            let kernel = self.read_back(runner)?;
            if std::mem::take(&mut self.check_drift) {
                let changed = self.drifted(&kernel);
                if !changed.is_empty() {
                    let shown: Vec<&str> = changed.iter().take(10).map(String::as_str).collect();
                    tracing::warn!(
                        count = changed.len(),
                        sets = %shown.join(", "),
                        "IP sets of ours were changed outside the agent; repairing them"
                    );
                }
            }
            self.kernel = Some(kernel);
            stats.read_back = true;
            self.dirty = self.desired.keys().cloned().collect();
        }
        let mut names: Vec<String> = self
            .dirty
            .drain()
            .filter(|n| self.desired.contains_key(n))
            .collect();
        names.sort();
        if names.is_empty() {
            return Ok(stats);
        }
        let mut migrations = Vec::new();
        let script = self.script(&names, &mut stats, &mut migrations);
        if script.is_empty() {
            return Ok(stats);
        }
        let Err(error) = self.restore(runner, &script, "restore") else {
            self.migrations = migrations;
            names.iter().for_each(|n| self.record(n));
            return Ok(stats);
        };
        tracing::warn!(%error, sets = names.len(), "ipset restore failed; writing the sets one by one");
        // `ipset restore` is not atomic: part of the batch went in. Start again from the kernel.
        self.restore(runner, "", "restore")?;
        self.kernel = Some(self.read_back(runner)?);
        stats = IpSetStats {
            read_back: true,
            ..IpSetStats::default()
        };
        for name in names {
            let mut one = IpSetStats::default();
            let mut migration = Vec::new();
            let script = self.script(std::slice::from_ref(&name), &mut one, &mut migration);
            match self.restore(runner, &script, "restore") {
                Ok(()) => {
                    self.migrations.extend(migration);
                    self.record(&name);
                    stats.created += one.created;
                    stats.rewritten += one.rewritten;
                    stats.added += one.added;
                    stats.removed += one.removed;
                }
                Err(error) => {
                    tracing::warn!(set = %name, %error, "the kernel refused an IP set; the rules using it fail closed");
                    let error = match error {
                        IpSetError::Failed { stderr, .. } => stderr,
                        other => other.to_string(),
                    };
                    self.refused.insert(name, error);
                    self.kernel = Some(self.read_back(runner)?);
                }
            }
        }
        Ok(stats)
    }

    /// The restore lines that bring the named sets from their kernel version to the desired
    /// one; a set whose type or family changed is built beside it (`migrations`).
    fn script(
        &self,
        names: &[String],
        stats: &mut IpSetStats,
        migrations: &mut Vec<Migration>,
    ) -> String {
        let kernel = self.kernel.as_ref().expect("read back above");
        let mut script = String::new();
        for name in names {
            let Some(d) = self.desired.get(name) else {
                continue;
            };
            let ty = d.kind.kernel_type();
            let fam = family(d.version);
            match kernel.get(name) {
                None => {
                    self.write_whole(&mut script, name, d);
                    stats.created += 1;
                    stats.added += d.members.len();
                }
                Some(k) if k.kind != ty || k.family != fam => {
                    // Built beside the old set, which keeps enforcing until the rules move.
                    let temp = (0..)
                        .map(|n| format!("cali{}t{n}", d.version.number()))
                        .find(|t| {
                            !kernel.contains_key(t) && !migrations.iter().any(|m| &m.temp == t)
                        })
                        .expect("an unused temporary name");
                    self.write_whole(&mut script, &temp, d);
                    migrations.push(Migration {
                        version: d.version,
                        name: name.clone(),
                        temp,
                    });
                    stats.rewritten += 1;
                    stats.added += d.members.len();
                }
                Some(k) => {
                    for m in sorted_diff(&k.members, &d.members) {
                        let _ = writeln!(script, "del {name} {m}");
                        stats.removed += 1;
                    }
                    for m in sorted_diff(&d.members, &k.members) {
                        let _ = writeln!(script, "add {name} {m}");
                        stats.added += 1;
                    }
                }
            }
        }
        script
    }

    /// The restore lines that create `name` as the desired set `d`, members included.
    fn write_whole(&self, script: &mut String, name: &str, d: &DesiredSet) {
        let _ = writeln!(
            script,
            "create {name} {} family {} maxelem {}",
            d.kind.kernel_type(),
            family(d.version),
            self.max_elem
        );
        for m in sorted(&d.members) {
            let _ = writeln!(script, "add {name} {m}");
        }
    }

    /// Records that the kernel now holds the desired version of `name` (under its temporary
    /// name while it migrates).
    fn record(&mut self, name: &str) {
        let kernel = self.kernel.as_mut().expect("read back above");
        let holder = self
            .migrations
            .iter()
            .find(|m| m.name == name)
            .map_or(name, |m| m.temp.as_str());
        if let Some(d) = self.desired.get(name) {
            kernel.insert(
                holder.to_owned(),
                KernelSet {
                    kind: d.kind.kernel_type().to_owned(),
                    family: family(d.version).to_owned(),
                    members: d.members.clone(),
                },
            );
        }
    }

    /// Type changes built by the last [`IpSets::apply_updates`]: the driver points the rules
    /// using `name` at `temp` and applies the tables before [`IpSets::finish_migrations`].
    pub(crate) fn migrations(&self) -> &[Migration] {
        &self.migrations
    }

    /// Once no rule uses the old sets: recreates each migrated set under its own name with the
    /// new type (the rules then move back, and the temporary sets go with the deletions). On
    /// failure the sets are read back and tried again at the next apply.
    pub(crate) fn finish_migrations(
        &mut self,
        runner: &mut dyn CommandRunner,
    ) -> Result<(), IpSetError> {
        let migrations = std::mem::take(&mut self.migrations);
        let mut script = String::new();
        for m in &migrations {
            let Some(d) = self.desired.get(&m.name) else {
                continue;
            };
            let _ = writeln!(script, "destroy {}", m.name);
            self.write_whole(&mut script, &m.name, d);
        }
        if script.is_empty() {
            return Ok(());
        }
        if let Err(error) = self.restore(runner, &script, "restore") {
            self.kernel = None;
            self.dirty.extend(migrations.into_iter().map(|m| m.name));
            return Err(error);
        }
        for m in &migrations {
            self.record(&m.name);
        }
        Ok(())
    }

    /// The tables could not move to the temporary sets: the migrations start again next time
    /// (the temporary sets go with the deletions).
    pub(crate) fn abandon_migrations(&mut self) {
        for m in std::mem::take(&mut self.migrations) {
            self.dirty.insert(m.name);
        }
    }

    /// Sets the kernel refused: (kernel name, the calc-server's id, the kernel's error).
    pub(crate) fn refused(&self) -> impl Iterator<Item = (&str, &str, &str)> {
        self.refused.iter().map(|(name, error)| {
            let id = self.desired.get(name).map_or("", |d| d.id.as_str());
            (name.as_str(), id, error.as_str())
        })
    }

    /// Whether the kernel refused the v4 or v6 set of `id`.
    pub(crate) fn is_refused(&self, id: &str) -> bool {
        IpVersion::BOTH
            .iter()
            .any(|v| self.refused.contains_key(&ipset_name(*v, id)))
    }

    /// Destroys sets of ours nothing wants any more. A set still in use by a rule that is not
    /// ours is kept and retried next time (logged), rather than failing the whole apply.
    pub(crate) fn apply_deletions(
        &mut self,
        runner: &mut dyn CommandRunner,
    ) -> Result<usize, IpSetError> {
        let Some(kernel) = self.kernel.as_ref() else {
            return Ok(0);
        };
        let mut stale: Vec<String> = kernel
            .keys()
            .filter(|n| !self.desired.contains_key(*n))
            .cloned()
            .collect();
        if stale.is_empty() {
            return Ok(0);
        }
        stale.sort();
        let mut script = String::new();
        for n in &stale {
            let _ = writeln!(script, "destroy {n}");
        }
        match self.restore(runner, &script, "destroy") {
            Ok(()) => {
                let kernel = self.kernel.as_mut().expect("checked above");
                for n in &stale {
                    kernel.remove(n);
                }
                Ok(stale.len())
            }
            Err(error) => {
                // Some may have gone before the failing line: re-read next time.
                tracing::warn!(%error, sets = stale.len(), "could not destroy unused IP sets; will retry");
                self.kernel = None;
                Ok(0)
            }
        }
    }

    fn restore(
        &self,
        runner: &mut dyn CommandRunner,
        script: &str,
        what: &'static str,
    ) -> Result<(), IpSetError> {
        let out = runner
            .run("ipset", &["-exist", "restore"], Some(script.as_bytes()))
            .map_err(IpSetError::Spawn)?;
        if !out.success {
            return Err(IpSetError::Failed {
                what,
                stderr: out.stderr_summary(),
            });
        }
        Ok(())
    }
}

fn is_ours(name: &str) -> bool {
    OUR_SET_PREFIXES.iter().any(|p| name.starts_with(p))
}

fn sorted(set: &HashSet<String>) -> Vec<&String> {
    let mut v: Vec<&String> = set.iter().collect();
    v.sort();
    v
}

fn sorted_diff<'a>(a: &'a HashSet<String>, b: &'a HashSet<String>) -> Vec<&'a String> {
    let mut v: Vec<&String> = a.difference(b).collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::linux::fake::FakeKernel;

    fn both() -> IpSets {
        IpSets::new(IpVersion::BOTH.to_vec())
    }

    #[test]
    fn members_are_normalized_as_ipset_prints_them() {
        assert_eq!(
            normalize_member(SetKind::Net, "10.65.0.2/32"),
            Ok(vec![(IpVersion::V4, "10.65.0.2".into())])
        );
        assert_eq!(
            normalize_member(SetKind::Net, "10.65.1.7/24"),
            Ok(vec![(IpVersion::V4, "10.65.1.0/24".into())])
        );
        assert_eq!(
            normalize_member(SetKind::Net, "fd00:0:0::1/128"),
            Ok(vec![(IpVersion::V6, "fd00::1".into())])
        );
        assert_eq!(
            normalize_member(SetKind::IpPort, "10.0.0.1,TCP:8080"),
            Ok(vec![(IpVersion::V4, "10.0.0.1,tcp:8080".into())])
        );
        assert_eq!(
            normalize_member(SetKind::IpPort, "fd00::1,udp:53"),
            Ok(vec![(IpVersion::V6, "fd00::1,udp:53".into())])
        );
        assert!(normalize_member(SetKind::Net, "nonsense").is_err());
        assert_eq!(
            normalize_member(SetKind::Net, "0.0.0.0/0"),
            Ok(vec![
                (IpVersion::V4, "0.0.0.0/1".into()),
                (IpVersion::V4, "128.0.0.0/1".into())
            ])
        );
        // The protocol of an IP-and-port member reaches the restore input: only real ones.
        assert!(normalize_member(SetKind::IpPort, "10.0.0.1,tcp\nflush:80").is_err());
    }

    #[test]
    fn one_id_becomes_a_v4_and_a_v6_set_and_deltas_are_minimal() {
        let mut k = FakeKernel::new();
        let mut s = both();
        s.replace(
            "s:abc",
            SetKind::Net,
            &["10.0.0.1/32".into(), "fd00::1/128".into()],
        );
        let st = s.apply_updates(&mut k).unwrap();
        assert_eq!((st.created, st.added), (2, 2));
        assert_eq!(k.set("cali40s:abc").unwrap().members.len(), 1);
        assert_eq!(k.set("cali60s:abc").unwrap().family, "inet6");

        s.delta("s:abc", &["10.0.0.2/32".into()], &["10.0.0.1/32".into()]);
        let st = s.apply_updates(&mut k).unwrap();
        assert_eq!((st.added, st.removed), (1, 1));
        assert_eq!(
            k.last_ipset_input(),
            "del cali40s:abc 10.0.0.1\nadd cali40s:abc 10.0.0.2\n"
        );
        // Nothing dirty: no ipset call at all.
        let calls = k.calls.len();
        s.apply_updates(&mut k).unwrap();
        assert_eq!(k.calls.len(), calls);
    }

    #[test]
    fn a_set_of_the_wrong_type_is_built_beside_it_then_recreated() {
        let mut k = FakeKernel::new();
        k.exec_ipset(
            "create cali40s:x hash:ip family inet\nadd cali40s:x 10.0.0.9\n",
            false,
        )
        .unwrap();
        let mut s = IpSets::new(vec![IpVersion::V4]);
        s.replace("s:x", SetKind::Net, &["10.0.0.0/24".into()]);
        let st = s.apply_updates(&mut k).unwrap();
        assert_eq!(st.rewritten, 1);
        // The old set is untouched (rules may still use it); the new version is beside it.
        assert_eq!(k.set("cali40s:x").unwrap().kind, "hash:ip");
        assert_eq!(k.set("cali4t0").unwrap().kind, "hash:net");
        assert_eq!(
            s.migrations(),
            [Migration {
                version: IpVersion::V4,
                name: "cali40s:x".into(),
                temp: "cali4t0".into(),
            }]
        );
        s.finish_migrations(&mut k).unwrap();
        let set = k.set("cali40s:x").unwrap();
        assert_eq!(set.kind, "hash:net");
        assert_eq!(set.members.iter().collect::<Vec<_>>(), vec!["10.0.0.0/24"]);
        assert!(s.migrations().is_empty());
        assert_eq!(s.apply_deletions(&mut k).unwrap(), 1);
        assert!(k.set("cali4t0").is_none());
        // Settled: nothing more to write.
        let calls = k.calls.len();
        s.apply_updates(&mut k).unwrap();
        assert_eq!(k.calls.len(), calls);
    }

    #[test]
    fn an_abandoned_migration_starts_again() {
        let mut k = FakeKernel::new();
        k.exec_ipset("create cali40s:x hash:ip family inet\n", false)
            .unwrap();
        let mut s = IpSets::new(vec![IpVersion::V4]);
        s.replace("s:x", SetKind::Net, &["10.0.0.0/24".into()]);
        s.apply_updates(&mut k).unwrap();
        s.abandon_migrations();
        s.apply_updates(&mut k).unwrap();
        // cali4t0 is still there (unused, destroyed with the deletions): a fresh name.
        assert_eq!(s.migrations()[0].temp, "cali4t1");
    }

    #[test]
    fn removed_members_out_of_band_come_back_after_invalidate() {
        let mut k = FakeKernel::new();
        let mut s = IpSets::new(vec![IpVersion::V4]);
        s.replace("s:x", SetKind::Net, &["10.0.0.1".into(), "10.0.0.2".into()]);
        s.apply_updates(&mut k).unwrap();
        k.exec_ipset("del cali40s:x 10.0.0.1\nadd cali40s:x 10.9.9.9\n", false)
            .unwrap();
        s.invalidate();
        // The edited set is named; a set with a change of ours pending is not.
        s.replace("s:y", SetKind::Net, &["10.0.0.3".into()]);
        let kernel = s.read_back(&mut k).unwrap();
        assert_eq!(s.drifted(&kernel), ["cali40s:x"]);
        s.remove("s:y");
        let st = s.apply_updates(&mut k).unwrap();
        assert_eq!((st.read_back, st.added, st.removed), (true, 1, 1));
        let members: Vec<_> = k
            .set("cali40s:x")
            .unwrap()
            .members
            .iter()
            .cloned()
            .collect();
        assert_eq!(members, vec!["10.0.0.1", "10.0.0.2"]);
    }

    #[test]
    fn unwanted_sets_of_ours_are_destroyed_and_foreign_sets_kept() {
        let mut k = FakeKernel::new();
        k.exec_ipset(
            "create cali40s:old hash:net family inet\ncreate kube-x hash:ip family inet\n",
            false,
        )
        .unwrap();
        let mut s = IpSets::new(vec![IpVersion::V4]);
        s.replace("s:new", SetKind::Net, &[]);
        s.apply_updates(&mut k).unwrap();
        assert_eq!(s.apply_deletions(&mut k).unwrap(), 1);
        assert_eq!(k.set_names(), vec!["cali40s:new", "kube-x"]);
        s.remove("s:new");
        assert_eq!(s.apply_deletions(&mut k).unwrap(), 1);
        assert_eq!(k.set_names(), vec!["kube-x"]);
    }

    #[test]
    fn a_set_the_kernel_refuses_is_left_out_and_the_others_go_in() {
        let mut k = FakeKernel::new();
        k.refuse.push("10.9.9.9".into());
        let mut s = IpSets::new(vec![IpVersion::V4]);
        s.replace("s:a", SetKind::Net, &["10.0.0.1".into()]);
        s.replace("s:b", SetKind::Net, &["10.0.0.2".into(), "10.9.9.9".into()]);
        s.replace("s:c", SetKind::Net, &["10.0.0.3".into()]);
        // The batch fails part-way (`ipset restore` is not atomic): read back, one by one.
        assert!(s.apply_updates(&mut k).unwrap().read_back);
        assert_eq!(k.set("cali40s:a").unwrap().members.len(), 1);
        assert_eq!(k.set("cali40s:c").unwrap().members.len(), 1);
        let refused: Vec<_> = s.refused().collect();
        assert_eq!(refused.len(), 1);
        assert_eq!((refused[0].0, refused[0].1), ("cali40s:b", "s:b"));
        assert!(s.is_refused("s:b") && !s.is_refused("s:a"));

        // Left out until it changes: nothing is written again.
        let calls = k.calls.len();
        s.apply_updates(&mut k).unwrap();
        assert_eq!(k.calls.len(), calls);
        s.delta("s:b", &[], &["10.9.9.9".into()]);
        s.apply_updates(&mut k).unwrap();
        assert!(!s.is_refused("s:b"));
        assert_eq!(
            k.set("cali40s:b")
                .unwrap()
                .members
                .iter()
                .collect::<Vec<_>>(),
            vec!["10.0.0.2"]
        );
    }
}
