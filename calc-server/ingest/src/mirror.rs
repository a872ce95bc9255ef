//! What the graph was last given for each datastore object, so that any (re-)list reconciles by
//! mark and sweep and only differences are sent. One algorithm for every listed-and-watched
//! datastore: etcd keys (one list covers the whole prefix) and Kubernetes objects (one list per
//! collection, the *group* of [`Mirror::begin_list`] and [`Mirror::sweep`]).
//!
//! Per object the mirror keeps a [`Fingerprint`] of the version it last processed (an etcd
//! value's bytes, a Kubernetes `resourceVersion`), the resource key its last good version
//! delivered and the generation of the list or event that last saw it:
//! - a re-list marks every object it sees; one whose version is unchanged is not decoded again
//!   and nothing is sent; objects of the listed group not seen are swept as `Delete`;
//! - a changed object is decided (decoded, converted, validated) and sent as `Apply`; with
//!   [`Mirror::skipping_unchanged_results`], not when the result equals what was sent (a pod
//!   whose status churned without touching its endpoint);
//! - an object that decides to nothing (a pod that lost its IP) deletes what it delivered.
//!
//! A value that cannot be used is rejected (a [`Problem`] naming the object, with the stage for
//! the caller to count) and the last good version stays in the graph: nothing is sent. Its
//! fingerprint is remembered so the next re-list does not report it again; a later valid value
//! is applied as usual. A rejected object with no last good version in memory (the server just
//! started) is reported with `held: false`; a caller that can find one (etcd's history) hands it
//! to [`Mirror::adopt_last_good`]. [`Mirror::unusable`] lists the rejected objects either way.
//!
//! Two objects can name the same resource (a legacy `default.p` policy key beside `p`; a Calico
//! NetworkPolicy CRD named `knp.default.x` beside the Kubernetes NetworkPolicy `x`). The graph
//! holds the version of the one applied last. When that one goes and another still names the
//! resource, the other stays its owner but its fingerprint is forgotten, and
//! [`Mirror::take_relists`] names its group: the re-list decodes it again and re-sends it.

use std::borrow::Borrow;
use std::collections::{BTreeSet, HashMap};
use std::fmt::{Debug, Display};
use std::hash::{Hash, Hasher};

use calc_graph::graph::Update;
use calc_graph::model::{Resource, ResourceKey, Valid};

use crate::{Batch, Decision, Problem};

/// A cheap fingerprint of an object's raw version: a 64-bit hash plus the length. The
/// comparison is per object, so a collision would need one object's new version to collide with
/// its own previous one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint(u64, u32);

impl Fingerprint {
    pub fn of(version: &[u8]) -> Fingerprint {
        let mut h = std::hash::DefaultHasher::new();
        version.hash(&mut h);
        Fingerprint(h.finish(), version.len().min(u32::MAX as usize) as u32)
    }
}

/// A fingerprint of a decided resource (its Debug form: maps are ordered, so it is stable).
fn result_fingerprint(res: &Resource) -> u64 {
    struct HashWriter<'a>(&'a mut std::hash::DefaultHasher);
    impl std::fmt::Write for HashWriter<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            s.hash(self.0);
            Ok(())
        }
    }
    let mut h = std::hash::DefaultHasher::new();
    let _ = std::fmt::write(&mut HashWriter(&mut h), format_args!("{res:?}"));
    h.finish()
}

struct Entry<G> {
    group: G,
    /// The version last processed (None: unknown, decide again next time).
    version: Option<Fingerprint>,
    /// The resource this object's last good version delivered (None: nothing in force).
    delivered: Option<ResourceKey>,
    /// Fingerprint of what was delivered, when results are compared (None: send again).
    result: Option<u64>,
    /// Generation of the list of its group (or the event) that last saw it.
    seen: u64,
    /// Its current version is rejected (`delivered` is then its last good version's).
    rejected: bool,
}

/// The mirror of one datastore: objects identified by `K`, listed in groups `G` (see the
/// module documentation).
pub struct Mirror<K, G = ()> {
    entries: HashMap<K, Entry<G>>,
    /// Resource → the objects naming it; the last one is the one whose version the graph holds.
    owners: HashMap<ResourceKey, Vec<K>>,
    generations: HashMap<G, u64>,
    relists: BTreeSet<G>,
    /// Whether an unchanged result of a changed version is sent again.
    skip_unchanged_results: bool,
    /// An object became, or stopped being, rejected since [`Mirror::take_unusable`].
    unusable_changed: bool,
}

impl<K, G> Default for Mirror<K, G> {
    fn default() -> Self {
        Mirror {
            entries: HashMap::new(),
            owners: HashMap::new(),
            generations: HashMap::new(),
            relists: BTreeSet::new(),
            skip_unchanged_results: false,
            unusable_changed: false,
        }
    }
}

impl<K, G> Mirror<K, G>
where
    K: Clone + Eq + Hash + Display + Debug,
    G: Copy + Eq + Hash + Ord,
{
    /// Every changed version is sent: right where the version is the resource (an etcd value).
    pub fn new() -> Self {
        Self::default()
    }

    /// A changed version whose decided resource equals what was sent sends nothing: right where
    /// versions change for reasons the resource does not show (a Kubernetes object's
    /// resourceVersion moves with every status update). Costs a fingerprint per decision.
    pub fn skipping_unchanged_results() -> Self {
        Mirror {
            skip_unchanged_results: true,
            ..Self::default()
        }
    }

    /// Objects the mirror tracks (including rejected ones and ones that deliver nothing).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn generation(&self, group: G) -> u64 {
        self.generations.get(&group).copied().unwrap_or(0)
    }

    /// Starts a (re-)list of `group`: its objects not passed to [`Mirror::put`] before
    /// [`Mirror::sweep`] are deleted. A re-list asked for by [`Mirror::take_relists`] is
    /// satisfied by it (every object of the group is decided again if forgotten).
    pub fn begin_list(&mut self, group: G) {
        *self.generations.entry(group).or_default() += 1;
        self.relists.remove(&group);
    }

    /// Groups that must be re-listed to restore a resource another object still names.
    pub fn take_relists(&mut self) -> BTreeSet<G> {
        std::mem::take(&mut self.relists)
    }

    /// True if `id` was last put with `version`: putting it again would decide nothing.
    pub fn is_current<Q>(&self, id: &Q, version: Fingerprint) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        self.entries
            .get(id)
            .is_some_and(|e| e.version == Some(version))
    }

    /// An object's current version (from a list or a watch event). `version`: its fingerprint
    /// (`None`: unknown, always decide); `decide` is called only when the version changed.
    pub fn put<Q>(
        &mut self,
        group: G,
        id: &Q,
        version: Option<Fingerprint>,
        decide: impl FnOnce() -> Decision,
        out: &mut Batch,
    ) where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq + Display + ToOwned,
        Q::Owned: Into<K>,
    {
        let generation = self.generation(group);
        if let Some(e) = self.entries.get_mut(id) {
            e.seen = generation;
            if version.is_some() && e.version == version {
                return;
            }
        }
        match decide() {
            Decision::Skip => {
                self.remove(id, out);
                // Remembered (delivering nothing) so a re-list does not decide it again.
                let e = self.entry(group, id);
                e.version = version;
            }
            Decision::Reject(rejection) => {
                self.unusable_changed = true;
                let e = self.entry(group, id);
                e.version = version;
                e.rejected = true;
                out.problems.push(Problem {
                    key: id.to_string(),
                    reason: rejection.to_string(),
                    held: e.delivered.is_some(),
                    stage: Some(rejection.stage()),
                });
            }
            Decision::Apply { resource, warnings } => {
                for w in warnings {
                    out.problems.push(Problem {
                        key: id.to_string(),
                        reason: w,
                        held: true,
                        stage: None,
                    });
                }
                self.deliver(group, id, version, resource, false, out);
            }
        }
    }

    /// `id`'s entry, created (delivering nothing) if new; marked seen by the current list.
    fn entry<Q>(&mut self, group: G, id: &Q) -> &mut Entry<G>
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq + ToOwned,
        Q::Owned: Into<K>,
    {
        let seen = self.generation(group);
        if !self.entries.contains_key(id) {
            self.entries.insert(
                id.to_owned().into(),
                Entry {
                    group,
                    version: None,
                    delivered: None,
                    result: None,
                    seen,
                    rejected: false,
                },
            );
        }
        let e = self.entries.get_mut(id).expect("inserted above");
        e.seen = seen;
        e
    }

    /// An earlier version of `id` (found by the caller, e.g. in etcd's history) to keep in
    /// force while its current version, rejected by [`Mirror::put`], stays unusable. Ignored
    /// unless `id` is rejected with no last good version and `decide` applies; true if adopted.
    pub fn adopt_last_good<Q>(
        &mut self,
        id: &Q,
        decide: impl FnOnce() -> Decision,
        out: &mut Batch,
    ) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq + Display + ToOwned,
        Q::Owned: Into<K>,
    {
        let Some(e) = self.entries.get(id) else {
            return false;
        };
        if !e.rejected || e.delivered.is_some() {
            return false;
        }
        let (group, version) = (e.group, e.version);
        match decide() {
            Decision::Apply { resource, .. } => {
                self.deliver(group, id, version, resource, true, out);
                true
            }
            Decision::Skip | Decision::Reject(_) => false,
        }
    }

    /// Whether `id`'s current version is rejected and no last good version of it is in force.
    pub fn is_rejected_without_last_good<Q>(&self, id: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        self.entries
            .get(id)
            .is_some_and(|e| e.rejected && e.delivered.is_none())
    }

    /// Rejected objects: those whose last good version stays in force, and those without one.
    pub fn unusable(&self) -> (Vec<String>, Vec<String>) {
        crate::split_unusable(
            self.entries
                .iter()
                .filter(|(_, e)| e.rejected)
                .map(|(id, e)| (id.to_string(), e.delivered.is_some())),
        )
    }

    /// [`Self::unusable`] if it may have changed since the last call, so a watcher publishes it
    /// per change, not per batch (it walks every tracked object).
    pub fn take_unusable(&mut self) -> Option<(Vec<String>, Vec<String>)> {
        std::mem::take(&mut self.unusable_changed).then(|| self.unusable())
    }

    /// Sends `res` as `id`'s version in force; `version` is its current version's fingerprint
    /// (`rejected`: that version is unusable and `res` is its last good one).
    fn deliver<Q>(
        &mut self,
        group: G,
        id: &Q,
        version: Option<Fingerprint>,
        res: Valid,
        rejected: bool,
        out: &mut Batch,
    ) where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq + Display + ToOwned,
        Q::Owned: Into<K>,
    {
        let rk = res.key();
        let result = self
            .skip_unchanged_results
            .then(|| result_fingerprint(&res));
        let e = self.entry(group, id);
        e.version = version;
        let was_rejected = std::mem::replace(&mut e.rejected, rejected);
        let previous = e.delivered.replace(rk.clone());
        let previous_result = std::mem::replace(&mut e.result, result);
        self.unusable_changed |= was_rejected || rejected;
        let is_current = self
            .owners
            .get(&rk)
            .and_then(|o| o.last())
            .is_some_and(|k| k.borrow() == id);
        if result.is_some()
            && previous_result == result
            && previous.as_ref() == Some(&rk)
            && is_current
        {
            return; // The graph already holds exactly this.
        }
        if let Some(old) = previous.filter(|old| *old != rk) {
            self.release(&old, id, out);
        }
        let owners = self.owners.entry(rk.clone()).or_default();
        owners.retain(|k| k.borrow() != id);
        if !owners.is_empty() {
            tracing::warn!(object = %id, resource = %rk, others = ?owners, "several datastore objects name the same resource; the latest one wins");
        }
        owners.push(id.to_owned().into());
        out.updates.push(Update::ApplyValid(res));
    }

    /// An object was deleted.
    pub fn delete<Q>(&mut self, id: &Q, out: &mut Batch)
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        self.remove(id, out);
    }

    /// Ends a (re-)list of `group`: its objects not seen since [`Mirror::begin_list`] are
    /// deleted.
    pub fn sweep(&mut self, group: G, out: &mut Batch) {
        let generation = self.generation(group);
        let gone: Vec<K> = self
            .entries
            .iter()
            .filter(|(_, e)| e.group == group && e.seen != generation)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.remove(&k, out);
        }
    }

    fn remove<Q>(&mut self, id: &Q, out: &mut Batch)
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        let Some(e) = self.entries.remove(id) else {
            return;
        };
        self.unusable_changed |= e.rejected;
        if let Some(rk) = e.delivered {
            self.release(&rk, id, out);
        }
    }

    /// `id` no longer names `rk`.
    ///
    /// When the graph holds `id`'s version and another object still names `rk`, that other
    /// object must come back. It stays an owner of `rk` and only its fingerprints are
    /// forgotten, so that (a) the re-list this asks for decides and sends it again, and
    /// (b) if it is deleted before that re-list, deleting it still deletes `rk`. Forgetting it
    /// as an owner instead (what the Kubernetes mirror once did) loses (b): the graph would keep
    /// the departed object's version of a resource no object names any more.
    fn release<Q>(&mut self, rk: &ResourceKey, id: &Q, out: &mut Batch)
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        let Some(owners) = self.owners.get_mut(rk) else {
            return;
        };
        let was_current = owners.last().is_some_and(|k| k.borrow() == id);
        owners.retain(|k| k.borrow() != id);
        match owners.last() {
            None => {
                self.owners.remove(rk);
                out.updates.push(Update::Delete(rk.clone()));
            }
            Some(other) if was_current => {
                if let Some(e) = self.entries.get_mut::<K>(other) {
                    e.version = None;
                    e.result = None;
                    self.relists.insert(e.group);
                }
            }
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summary;
    use calc_graph::manifest::{Rejection, decode_and_validate};
    use calc_graph::model::DecodeError;
    use serde_json::json;

    /// A GlobalNetworkPolicy `name` with `selector`.
    fn gnp(name: &str, selector: &str) -> impl FnOnce() -> Decision {
        let v = json!({"kind": "GlobalNetworkPolicy", "apiVersion": "projectcalico.org/v3",
                       "metadata": {"name": name}, "spec": {"selector": selector}});
        move || Decision::from_outcome(decode_and_validate(v), Vec::new())
    }

    fn v(s: &str) -> Option<Fingerprint> {
        Some(Fingerprint::of(s.as_bytes()))
    }

    /// The graph holds B's version of a resource A also names; B goes. The resource must
    /// neither disappear (A still names it) nor stay B's forever: A is re-sent by the re-list
    /// asked for, and if A goes first, the resource goes with it. This is the `release` both
    /// former mirrors needed; the Kubernetes one forgot A as an owner, so deleting A before the
    /// re-list left B's version in the graph with no object naming it.
    #[test]
    fn the_other_owner_stays_an_owner_until_it_is_listed_again() {
        for relist_first in [true, false] {
            let mut m: Mirror<String, u8> = Mirror::skipping_unchanged_results();
            let mut out = Batch::default();
            m.put(1, "a", v("1"), gnp("p", "all()"), &mut out);
            m.put(2, "b", v("1"), gnp("p", "has(b)"), &mut out);
            let mut out = Batch::default();
            m.delete("b", &mut out);
            assert!(out.updates.is_empty(), "A still names p");
            assert_eq!(m.take_relists().into_iter().collect::<Vec<_>>(), [1]);
            let mut out = Batch::default();
            if relist_first {
                // Same version, same result: sent anyway, because the graph holds B's.
                m.begin_list(1);
                m.put(1, "a", v("1"), gnp("p", "all()"), &mut out);
                m.sweep(1, &mut out);
                assert_eq!(summary(&out), ["apply GlobalNetworkPolicy p"]);
                let mut out = Batch::default();
                m.delete("a", &mut out);
                assert_eq!(summary(&out), ["delete GlobalNetworkPolicy p"]);
            } else {
                m.delete("a", &mut out);
                assert_eq!(summary(&out), ["delete GlobalNetworkPolicy p"]);
            }
            assert!(m.is_empty());
        }
    }

    /// A re-list that began after the request satisfies it: asking again would re-list twice.
    #[test]
    fn a_list_of_the_group_satisfies_a_pending_relist() {
        let mut m: Mirror<String> = Mirror::new();
        let mut out = Batch::default();
        m.put((), "a", v("1"), gnp("p", "all()"), &mut out);
        m.put((), "b", v("1"), gnp("p", "has(b)"), &mut out);
        m.delete("b", &mut out);
        m.begin_list(());
        assert!(m.take_relists().is_empty());
        m.put((), "a", v("1"), gnp("p", "all()"), &mut out);
        assert_eq!(
            summary(&out),
            [
                "apply GlobalNetworkPolicy p",
                "apply GlobalNetworkPolicy p",
                "apply GlobalNetworkPolicy p"
            ]
        );
    }

    #[test]
    fn versions_and_results_decide_what_is_sent_again() {
        // By version only: a changed version with the same result is sent again.
        let mut m: Mirror<String> = Mirror::new();
        let mut out = Batch::default();
        m.put((), "a", v("1"), gnp("p", "all()"), &mut out);
        m.put(
            (),
            "a",
            v("1"),
            || unreachable!("unchanged: not decided"),
            &mut out,
        );
        m.put((), "a", v("2"), gnp("p", "all()"), &mut out);
        assert_eq!(out.updates.len(), 2);
        // Comparing results: not sent; an unknown version is always decided.
        let mut m: Mirror<String> = Mirror::skipping_unchanged_results();
        let mut out = Batch::default();
        m.put((), "a", v("1"), gnp("p", "all()"), &mut out);
        m.put((), "a", v("2"), gnp("p", "all()"), &mut out);
        m.put((), "a", None, gnp("p", "has(x)"), &mut out);
        assert_eq!(out.updates.len(), 2);
    }

    #[test]
    fn sweeps_are_per_group_and_rejections_carry_their_stage() {
        let mut m: Mirror<String, u8> = Mirror::new();
        let mut out = Batch::default();
        m.put(1, "a", v("1"), gnp("a", "all()"), &mut out);
        m.put(2, "b", v("1"), gnp("b", "all()"), &mut out);
        m.put(
            2,
            "c",
            v("1"),
            || Decision::Reject(Rejection::Undecodable(DecodeError::MissingKind)),
            &mut out,
        );
        assert_eq!(
            out.problems,
            [Problem {
                key: "c".into(),
                reason: "missing kind".into(),
                held: false,
                stage: Some(calc_graph::manifest::RejectStage::Decode),
            }]
        );
        let mut out = Batch::default();
        m.begin_list(1);
        m.sweep(1, &mut out);
        assert_eq!(summary(&out), ["delete GlobalNetworkPolicy a"]);
        assert_eq!(m.len(), 2, "group 2 untouched");
    }
}
