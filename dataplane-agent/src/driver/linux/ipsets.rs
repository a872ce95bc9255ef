//! The ipset half of the iptables writer: what the kernel holds of our IP sets, brought to the
//! desired [`Sets`] with `ipset restore`.
//!
//! Contract: [`IpSets::take_changes`] takes the desired state's change log; nothing else is
//! recorded here but the kernel's side. [`IpSets::apply_updates`] (before the iptables tables)
//! creates missing sets and writes membership deltas with one `ipset restore`; a set whose
//! kernel type or family is wrong is built beside it in a temporary set (`cali4t0`…), the rules
//! move to it and back ([`Migration`]), so they never lose the set.
//! [`IpSets::apply_deletions`] (after the tables, once no rule refers to them) destroys sets of
//! ours that are no longer wanted. The kernel view is read back with `ipset save` on the first
//! apply, after a failure and after [`IpSets::invalidate`], which is how out-of-band changes
//! get repaired. When a batch fails (`ipset restore` is not atomic), the kernel is read back and
//! each set is written on its own; a set the kernel refuses is reported by [`IpSets::refused`],
//! and the driver makes the rules that use it fail closed.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;

use super::desired::sets::DesiredSet;
use super::desired::{SetChanges, SetKind, Sets};
use super::rules::IpVersion;
use super::runner::CommandRunner;

/// Sets we own start with one of these.
const OUR_SET_PREFIXES: [&str; 4] = ["cali40", "cali60", "cali4t", "cali6t"];

/// The `ipset` type of a set.
fn kernel_type(kind: SetKind) -> &'static str {
    match kind {
        SetKind::Ip => "hash:ip",
        SetKind::IpPort => "hash:ip,port",
        SetKind::Net => "hash:net",
    }
}

fn family(v: IpVersion) -> &'static str {
    match v {
        IpVersion::V4 => "inet",
        IpVersion::V6 => "inet6",
    }
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

/// The kernel side of our IP sets.
pub(crate) struct IpSets {
    kernel: Option<HashMap<String, KernelSet>>,
    /// `invalidate` dropped a kernel view we trusted: the next read back reports the sets that
    /// changed behind our back.
    check_drift: bool,
    /// Sets (by kernel name) to bring to their desired version at the next apply.
    pending: HashSet<String>,
    /// Sets the kernel refused on their own: kernel name → error. Left out until they change
    /// or `invalidate`.
    refused: BTreeMap<String, String>,
    /// Type changes built beside the old sets by the last `apply_updates`, not yet finished.
    migrations: Vec<Migration>,
    pub max_elem: u32,
}

impl Default for IpSets {
    fn default() -> Self {
        Self {
            kernel: None,
            check_drift: false,
            pending: HashSet::new(),
            refused: BTreeMap::new(),
            migrations: Vec::new(),
            max_elem: 1_048_576,
        }
    }
}

impl IpSets {
    /// Takes the desired sets' change log: changed sets are written (and tried again if the
    /// kernel refused them), removed ones are no longer written.
    pub(crate) fn take_changes(&mut self, changes: SetChanges) {
        for name in changes.removed {
            self.refused.remove(&name);
            self.pending.remove(&name);
        }
        for name in changes.changed {
            self.refused.remove(&name);
            self.pending.insert(name);
        }
    }

    /// The next apply reads the kernel back, repairs what differs and tries refused sets again.
    pub(crate) fn invalidate(&mut self) {
        self.check_drift |= self.kernel.take().is_some();
        self.refused.clear();
    }

    /// Our sets, with no change pending, that the kernel holds otherwise than we programmed
    /// them (missing, another type, other members): changed behind our back.
    fn drifted(&self, desired: &Sets, kernel: &HashMap<String, KernelSet>) -> Vec<String> {
        let mut out: Vec<String> = desired
            .iter()
            .filter(|(name, _)| !self.pending.contains(*name) && !self.refused.contains_key(*name))
            .filter(|(name, d)| match kernel.get(*name) {
                None => true,
                Some(k) => {
                    k.kind != kernel_type(d.kind)
                        || k.family != family(d.version)
                        || k.members != d.members
                }
            })
            .map(|(name, _)| name.to_owned())
            .collect();
        out.sort();
        out
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
        desired: &Sets,
    ) -> Result<IpSetStats, IpSetError> {
        let result = self.apply_updates_inner(runner, desired);
        if result.is_err() {
            self.kernel = None;
        }
        result
    }

    fn apply_updates_inner(
        &mut self,
        runner: &mut dyn CommandRunner,
        desired: &Sets,
    ) -> Result<IpSetStats, IpSetError> {
        let mut stats = IpSetStats::default();
        // A migration left unfinished (its tables failed) starts again from the kernel.
        for m in std::mem::take(&mut self.migrations) {
            self.pending.insert(m.name);
        }
        if self.kernel.is_none() {
            let kernel = self.read_back(runner)?;
            if std::mem::take(&mut self.check_drift) {
                let changed = self.drifted(desired, &kernel);
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
            self.pending = desired.iter().map(|(n, _)| n.to_owned()).collect();
        }
        let mut names: Vec<String> = self.pending.drain().filter(|n| desired.wants(n)).collect();
        names.sort();
        if names.is_empty() {
            return Ok(stats);
        }
        let mut migrations = Vec::new();
        let script = self.script(desired, &names, &mut stats, &mut migrations);
        if script.is_empty() {
            return Ok(stats);
        }
        let Err(error) = self.restore(runner, &script, "restore") else {
            self.migrations = migrations;
            names.iter().for_each(|n| self.record(desired, n));
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
            let script = self.script(
                desired,
                std::slice::from_ref(&name),
                &mut one,
                &mut migration,
            );
            match self.restore(runner, &script, "restore") {
                Ok(()) => {
                    self.migrations.extend(migration);
                    self.record(desired, &name);
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
        desired: &Sets,
        names: &[String],
        stats: &mut IpSetStats,
        migrations: &mut Vec<Migration>,
    ) -> String {
        let kernel = self.kernel.as_ref().expect("read back above");
        let mut script = String::new();
        for name in names {
            let Some(d) = desired.get(name) else {
                continue;
            };
            let ty = kernel_type(d.kind);
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
            kernel_type(d.kind),
            family(d.version),
            self.max_elem
        );
        for m in sorted(&d.members) {
            let _ = writeln!(script, "add {name} {m}");
        }
    }

    /// Records that the kernel now holds the desired version of `name` (under its temporary
    /// name while it migrates).
    fn record(&mut self, desired: &Sets, name: &str) {
        let kernel = self.kernel.as_mut().expect("read back above");
        let holder = self
            .migrations
            .iter()
            .find(|m| m.name == name)
            .map_or(name, |m| m.temp.as_str());
        if let Some(d) = desired.get(name) {
            kernel.insert(
                holder.to_owned(),
                KernelSet {
                    kind: kernel_type(d.kind).to_owned(),
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
        desired: &Sets,
    ) -> Result<(), IpSetError> {
        let migrations = std::mem::take(&mut self.migrations);
        let mut script = String::new();
        for m in &migrations {
            let Some(d) = desired.get(&m.name) else {
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
            self.pending.extend(migrations.into_iter().map(|m| m.name));
            return Err(error);
        }
        for m in &migrations {
            self.record(desired, &m.name);
        }
        Ok(())
    }

    /// The tables could not move to the temporary sets: the migrations start again next time
    /// (the temporary sets go with the deletions).
    pub(crate) fn abandon_migrations(&mut self) {
        for m in std::mem::take(&mut self.migrations) {
            self.pending.insert(m.name);
        }
    }

    /// Sets the kernel refused: (kernel name, the calc-server's id, the kernel's error).
    pub(crate) fn refused<'a>(
        &'a self,
        desired: &'a Sets,
    ) -> impl Iterator<Item = (&'a str, &'a str, &'a str)> {
        self.refused.iter().map(|(name, error)| {
            let id = desired.get(name).map_or("", |d| d.id.as_str());
            (name.as_str(), id, error.as_str())
        })
    }

    /// Kernel names of the sets the kernel refused.
    pub(crate) fn refused_names(&self) -> BTreeSet<String> {
        self.refused.keys().cloned().collect()
    }

    /// Destroys sets of ours nothing wants any more. A set still in use by a rule that is not
    /// ours is kept and retried next time (logged), rather than failing the whole apply.
    pub(crate) fn apply_deletions(
        &mut self,
        runner: &mut dyn CommandRunner,
        desired: &Sets,
    ) -> Result<usize, IpSetError> {
        let Some(kernel) = self.kernel.as_ref() else {
            return Ok(0);
        };
        let mut stale: Vec<String> = kernel
            .keys()
            .filter(|n| !desired.wants(n))
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

    /// The desired sets and the ipset writer's side, as the driver pairs them.
    struct W {
        d: Sets,
        k: IpSets,
    }

    impl W {
        fn new(versions: &[IpVersion]) -> Self {
            Self {
                d: Sets::new(versions.to_vec()),
                k: IpSets::default(),
            }
        }
        fn replace(&mut self, id: &str, kind: SetKind, members: &[String]) {
            self.d.replace(id, kind, members);
        }
        fn delta(&mut self, id: &str, added: &[String], removed: &[String]) {
            self.d.delta(id, added, removed);
        }
        fn remove(&mut self, id: &str) {
            self.d.remove(id);
        }
        fn sync(&mut self) {
            self.k.take_changes(self.d.take_changes());
        }
        fn apply_updates(&mut self, k: &mut FakeKernel) -> Result<IpSetStats, IpSetError> {
            self.sync();
            self.k.apply_updates(k, &self.d)
        }
        fn finish_migrations(&mut self, k: &mut FakeKernel) -> Result<(), IpSetError> {
            self.k.finish_migrations(k, &self.d)
        }
        fn apply_deletions(&mut self, k: &mut FakeKernel) -> Result<usize, IpSetError> {
            self.sync();
            self.k.apply_deletions(k, &self.d)
        }
        fn migrations(&self) -> &[Migration] {
            self.k.migrations()
        }
        fn abandon_migrations(&mut self) {
            self.k.abandon_migrations();
        }
        fn is_refused(&self, id: &str) -> bool {
            let names = self.k.refused_names();
            IpVersion::BOTH
                .iter()
                .any(|v| names.contains(&crate::driver::linux::rules::ipset_name(*v, id)))
        }
    }

    fn both() -> W {
        W::new(&IpVersion::BOTH)
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
        let mut s = W::new(&[IpVersion::V4]);
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
        let mut s = W::new(&[IpVersion::V4]);
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
        let mut s = W::new(&[IpVersion::V4]);
        s.replace("s:x", SetKind::Net, &["10.0.0.1".into(), "10.0.0.2".into()]);
        s.apply_updates(&mut k).unwrap();
        k.exec_ipset("del cali40s:x 10.0.0.1\nadd cali40s:x 10.9.9.9\n", false)
            .unwrap();
        s.k.invalidate();
        // The edited set is named; a set with a change of ours pending is not.
        s.replace("s:y", SetKind::Net, &["10.0.0.3".into()]);
        s.sync();
        let kernel = s.k.read_back(&mut k).unwrap();
        assert_eq!(s.k.drifted(&s.d, &kernel), ["cali40s:x"]);
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
        let mut s = W::new(&[IpVersion::V4]);
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
        let mut s = W::new(&[IpVersion::V4]);
        s.replace("s:a", SetKind::Net, &["10.0.0.1".into()]);
        s.replace("s:b", SetKind::Net, &["10.0.0.2".into(), "10.9.9.9".into()]);
        s.replace("s:c", SetKind::Net, &["10.0.0.3".into()]);
        // The batch fails part-way (`ipset restore` is not atomic): read back, one by one.
        assert!(s.apply_updates(&mut k).unwrap().read_back);
        assert_eq!(k.set("cali40s:a").unwrap().members.len(), 1);
        assert_eq!(k.set("cali40s:c").unwrap().members.len(), 1);
        let refused: Vec<_> = s.k.refused(&s.d).collect();
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
