//! What the graph was last given for each etcd key, so that any re-list reconciles by mark and
//! sweep and only differences are sent.
//!
//! Per etcd key the mirror keeps a fingerprint of the raw value it last processed (a 64-bit
//! hash plus the length: the comparison is per key, so a collision would need one key's new
//! value to collide with its own previous one) and the resource key it delivered. A re-list marks
//! every key it sees; a value whose fingerprint is unchanged is not decoded again and nothing is
//! sent; a changed one is decoded and sent as `Apply`; keys not seen are swept as `Delete`.
//!
//! A value that cannot be used is rejected (reason + etcd key reported, counter bumped) and the
//! last good version stays in the graph: nothing is sent. Its fingerprint is remembered so the
//! next re-list does not report it again; a later valid value is applied as usual. A rejected
//! key with no last good version in memory (the server just started) is reported with
//! `held: false`; the caller may find one in etcd's history and hand it to
//! [`Mirror::adopt_last_good`]. [`Mirror::unusable`] lists the rejected keys either way.
//!
//! Two etcd keys can name the same resource (a legacy `default.foo` policy key beside `foo`).
//! The graph holds the value of the key that was applied last; when that key goes and another
//! still names the resource, the other one's fingerprint is invalidated and
//! [`Mirror::needs_relist`] asks the caller for a re-list, which re-sends it.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use calc_graph::graph::Update;
use calc_graph::model::ResourceKey;

use super::decode::{Decision, decode};

/// A cheap fingerprint of a raw value (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Fingerprint(u64, u32);

impl Fingerprint {
    /// Never equal to a real value's fingerprint (lengths fit in u32 only up to 4 GiB, and etcd
    /// values are at most 1.5 MiB by default).
    const INVALID: Fingerprint = Fingerprint(0, u32::MAX);

    fn of(value: &[u8]) -> Fingerprint {
        let mut h = std::hash::DefaultHasher::new();
        value.hash(&mut h);
        Fingerprint(h.finish(), value.len().min(u32::MAX as usize - 1) as u32)
    }
}

struct Entry {
    value: Fingerprint,
    /// The resource this key's last good value delivered (None: only ever rejected).
    delivered: Option<ResourceKey>,
    /// Generation of the list or event that last saw the key.
    seen: u64,
    /// The key's current value is rejected (`delivered` is then its last good version's).
    rejected: bool,
}

/// One key whose value was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub reason: String,
    /// A last good version of the key stays in force.
    pub held: bool,
}

/// Updates and problems produced by one batch of keys.
#[derive(Default)]
pub struct Batch {
    pub updates: Vec<Update>,
    pub problems: Vec<Problem>,
}

pub struct Mirror {
    entries: HashMap<Box<str>, Entry>,
    /// Resource → the etcd keys naming it; the last one is the key whose value the graph holds.
    owners: HashMap<ResourceKey, Vec<Box<str>>>,
    generation: u64,
    relist: bool,
    rejected: Arc<crate::datastore::Rejections>,
    /// A key became, or stopped being, rejected since [`Mirror::take_unusable`].
    unusable_changed: bool,
}

impl Mirror {
    /// `rejected` counts every rejected value (a metric).
    pub fn new(rejected: Arc<crate::datastore::Rejections>) -> Mirror {
        Mirror {
            entries: HashMap::new(),
            owners: HashMap::new(),
            generation: 0,
            relist: false,
            rejected,
            unusable_changed: false,
        }
    }

    /// Keys the mirror tracks (graph kinds, including rejected ones).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether a re-list is needed to restore a resource another key still names.
    pub fn needs_relist(&self) -> bool {
        self.relist
    }

    /// Starts a re-list: keys not passed to [`Mirror::put`] before [`Mirror::sweep`] are deleted.
    pub fn begin_list(&mut self) {
        self.generation += 1;
        self.relist = false;
    }

    /// A key's current value (from a list page or a watch event).
    pub fn put(&mut self, key: &str, value: &[u8], out: &mut Batch) {
        let fp = Fingerprint::of(value);
        let generation = self.generation;
        if let Some(e) = self.entries.get_mut(key) {
            e.seen = generation;
            if e.value == fp {
                return;
            }
        }
        match decode(key, value) {
            Decision::Skip => {
                // Not (or no longer) something the graph reads.
                self.remove(key, out);
            }
            Decision::Reject(rejection) => {
                self.rejected.count(rejection.stage);
                let reason = rejection.reason;
                self.unusable_changed = true;
                let e = self.entries.entry(key.into()).or_insert(Entry {
                    value: fp,
                    delivered: None,
                    seen: generation,
                    rejected: true,
                });
                e.value = fp;
                e.seen = generation;
                e.rejected = true;
                out.problems.push(Problem {
                    key: key.to_string(),
                    reason,
                    held: e.delivered.is_some(),
                });
            }
            Decision::Apply(res) => self.deliver(key, fp, res, false, out),
        }
    }

    /// `value` is an earlier version of `key` (from etcd's history) to keep in force while the
    /// key's current value, rejected by [`Mirror::put`], stays unusable. Ignored unless the key
    /// is rejected with no last good version and `value` is valid; true if adopted.
    pub fn adopt_last_good(&mut self, key: &str, value: &[u8], out: &mut Batch) -> bool {
        let Some(e) = self.entries.get(key) else {
            return false;
        };
        if !e.rejected || e.delivered.is_some() {
            return false;
        }
        let fp = e.value;
        match decode(key, value) {
            Decision::Apply(res) => {
                self.deliver(key, fp, res, true, out);
                true
            }
            Decision::Skip | Decision::Reject(_) => false,
        }
    }

    /// Whether `key`'s current value is rejected and no last good version of it is in force.
    pub fn is_rejected_without_last_good(&self, key: &str) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.rejected && e.delivered.is_none())
    }

    /// Rejected keys: those whose last good version stays in force, and those without one.
    pub fn unusable(&self) -> (Vec<String>, Vec<String>) {
        crate::datastore::split_unusable(
            self.entries
                .iter()
                .filter(|(_, e)| e.rejected)
                .map(|(key, e)| (key.to_string(), e.delivered.is_some())),
        )
    }

    /// [`Self::unusable`] if it may have changed since the last call, so a watcher publishes it
    /// per change, not per batch (it walks every tracked key).
    pub fn take_unusable(&mut self) -> Option<(Vec<String>, Vec<String>)> {
        std::mem::take(&mut self.unusable_changed).then(|| self.unusable())
    }

    /// Sends `res` as `key`'s version in force; `fp` is the key's current value's fingerprint
    /// (`rejected`: that value is unusable and `res` is its last good version).
    fn deliver(
        &mut self,
        key: &str,
        fp: Fingerprint,
        res: calc_graph::model::Resource,
        rejected: bool,
        out: &mut Batch,
    ) {
        let generation = self.generation;
        let rk = res.key();
        let previous = match self.entries.get_mut(key) {
            Some(e) => {
                e.value = fp;
                e.seen = generation;
                self.unusable_changed |= e.rejected || rejected;
                e.rejected = rejected;
                e.delivered.replace(rk.clone())
            }
            None => {
                self.unusable_changed |= rejected;
                self.entries.insert(
                    key.into(),
                    Entry {
                        value: fp,
                        delivered: Some(rk.clone()),
                        seen: generation,
                        rejected,
                    },
                );
                None
            }
        };
        if let Some(old) = previous.filter(|old| *old != rk) {
            self.release(&old, key, out);
        }
        let owners = self.owners.entry(rk.clone()).or_default();
        owners.retain(|k| &**k != key);
        if !owners.is_empty() {
            tracing::warn!(%key, resource = %rk, others = ?owners, "several etcd keys name the same resource; the latest write wins");
        }
        owners.push(key.into());
        out.updates.push(Update::Apply(res));
    }

    /// A key was deleted.
    pub fn delete(&mut self, key: &str, out: &mut Batch) {
        self.remove(key, out);
    }

    /// Ends a re-list: every key not seen since [`Mirror::begin_list`] is deleted.
    pub fn sweep(&mut self, out: &mut Batch) {
        let generation = self.generation;
        let gone: Vec<Box<str>> = self
            .entries
            .iter()
            .filter(|(_, e)| e.seen != generation)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.remove(&k, out);
        }
    }

    fn remove(&mut self, key: &str, out: &mut Batch) {
        let Some(e) = self.entries.remove(key) else {
            return;
        };
        self.unusable_changed |= e.rejected;
        if let Some(rk) = e.delivered {
            self.release(&rk, key, out);
        }
    }

    /// `key` no longer names `rk`.
    fn release(&mut self, rk: &ResourceKey, key: &str, out: &mut Batch) {
        let Some(owners) = self.owners.get_mut(rk) else {
            return;
        };
        let was_current = owners.last().is_some_and(|k| &**k == key);
        owners.retain(|k| &**k != key);
        match owners.last() {
            None => {
                self.owners.remove(rk);
                out.updates.push(Update::Delete(rk.clone()));
            }
            Some(other) if was_current => {
                // The graph holds the departed key's version; the other key's must come back.
                if let Some(e) = self.entries.get_mut(other) {
                    e.value = Fingerprint::INVALID;
                }
                self.relist = true;
            }
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::RESOURCE_PREFIX as P;
    use calc_graph::model::Kind;

    fn gnp(name: &str, selector: &str) -> String {
        format!(
            r#"{{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{{"name":"{name}"}},"spec":{{"selector":"{selector}"}}}}"#
        )
    }

    fn summary(b: &Batch) -> Vec<String> {
        b.updates
            .iter()
            .map(|u| match u {
                Update::Apply(r) => format!("apply {}", r.key()),
                Update::Delete(k) => format!("delete {k}"),
                Update::InSync => "in-sync".into(),
            })
            .collect()
    }

    fn mirror() -> (Mirror, Arc<crate::datastore::Rejections>) {
        let c = Arc::new(crate::datastore::Rejections::default());
        (Mirror::new(c.clone()), c)
    }

    #[test]
    fn relist_sends_only_differences() {
        let (mut m, _) = mirror();
        let (a, b, c) = (
            format!("{P}globalnetworkpolicies/a"),
            format!("{P}globalnetworkpolicies/b"),
            format!("{P}globalnetworkpolicies/c"),
        );
        let mut out = Batch::default();
        m.begin_list();
        m.put(&a, gnp("a", "all()").as_bytes(), &mut out);
        m.put(&b, gnp("b", "all()").as_bytes(), &mut out);
        m.put(&format!("{P}bgppeers/x"), b"{}", &mut out);
        m.sweep(&mut out);
        assert_eq!(
            summary(&out),
            ["apply GlobalNetworkPolicy a", "apply GlobalNetworkPolicy b"]
        );
        assert_eq!(m.len(), 2);

        // Re-list: a unchanged, b changed, c new; a key missing from the list is deleted.
        let mut out = Batch::default();
        m.begin_list();
        m.put(&b, gnp("b", "has(x)").as_bytes(), &mut out);
        m.put(&c, gnp("c", "all()").as_bytes(), &mut out);
        m.sweep(&mut out);
        assert_eq!(
            summary(&out),
            [
                "apply GlobalNetworkPolicy b",
                "apply GlobalNetworkPolicy c",
                "delete GlobalNetworkPolicy a"
            ]
        );
        // Same list again: nothing at all.
        let mut out = Batch::default();
        m.begin_list();
        m.put(&b, gnp("b", "has(x)").as_bytes(), &mut out);
        m.put(&c, gnp("c", "all()").as_bytes(), &mut out);
        m.sweep(&mut out);
        assert!(out.updates.is_empty());
    }

    #[test]
    fn a_rejected_value_keeps_the_last_good_one_and_is_counted_once() {
        let (mut m, rejected) = mirror();
        let a = format!("{P}globalnetworkpolicies/a");
        let mut out = Batch::default();
        m.put(&a, gnp("a", "all()").as_bytes(), &mut out);
        m.put(&a, b"{oops", &mut out);
        assert_eq!(summary(&out), ["apply GlobalNetworkPolicy a"]);
        assert_eq!(out.problems.len(), 1);
        assert_eq!(out.problems[0].key, a);
        assert!(out.problems[0].held, "the last good version stays");
        assert_eq!(m.unusable(), (vec![a.clone()], vec![]));
        assert_eq!(rejected.total(), 1);
        // A re-list that sees the same bad value reports nothing new and deletes nothing.
        let mut out = Batch::default();
        m.begin_list();
        m.put(&a, b"{oops", &mut out);
        m.sweep(&mut out);
        assert!(out.updates.is_empty() && out.problems.is_empty());
        assert_eq!(rejected.total(), 1);
        // A later valid value is applied; deleting the key deletes the resource.
        m.put(&a, gnp("a", "has(y)").as_bytes(), &mut out);
        assert_eq!(m.unusable(), (vec![], vec![]));
        m.delete(&a, &mut out);
        assert_eq!(
            summary(&out),
            [
                "apply GlobalNetworkPolicy a",
                "delete GlobalNetworkPolicy a"
            ]
        );
        // A key that was only ever bad deletes nothing.
        let mut out = Batch::default();
        let b = format!("{P}globalnetworkpolicies/b");
        m.put(&b, b"[]", &mut out);
        m.delete(&b, &mut out);
        assert!(out.updates.is_empty());
    }

    #[test]
    fn two_keys_naming_one_policy() {
        let (mut m, _) = mirror();
        let legacy = format!("{P}globalnetworkpolicies/default.p");
        let new = format!("{P}globalnetworkpolicies/p");
        let mut out = Batch::default();
        m.put(&new, gnp("p", "all()").as_bytes(), &mut out);
        m.put(&legacy, gnp("default.p", "has(old)").as_bytes(), &mut out);
        assert_eq!(
            summary(&out),
            ["apply GlobalNetworkPolicy p", "apply GlobalNetworkPolicy p"]
        );
        // The legacy key goes: the graph holds its version, so `p`'s must be re-sent.
        let mut out = Batch::default();
        m.delete(&legacy, &mut out);
        assert!(out.updates.is_empty());
        assert!(m.needs_relist());
        let mut out = Batch::default();
        m.begin_list();
        m.put(&new, gnp("p", "all()").as_bytes(), &mut out);
        m.sweep(&mut out);
        assert_eq!(summary(&out), ["apply GlobalNetworkPolicy p"]);
        assert!(!m.needs_relist());
        // The last key goes: the policy is deleted.
        let mut out = Batch::default();
        m.delete(&new, &mut out);
        assert_eq!(summary(&out), ["delete GlobalNetworkPolicy p"]);
    }

    #[test]
    fn a_value_that_renames_its_resource_deletes_the_old_name() {
        let (mut m, _) = mirror();
        let key = format!("{P}globalnetworkpolicies/default.q");
        let mut out = Batch::default();
        m.put(&key, gnp("default.q", "all()").as_bytes(), &mut out);
        let annotated = r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"default.q","annotations":{"projectcalico.org/metadata":"{\"name\":\"renamed\"}"}},"spec":{"selector":"all()"}}"#;
        m.put(&key, annotated.as_bytes(), &mut out);
        assert_eq!(
            summary(&out),
            [
                "apply GlobalNetworkPolicy q",
                "delete GlobalNetworkPolicy q",
                "apply GlobalNetworkPolicy renamed"
            ]
        );
        assert!(
            matches!(&out.updates[2], Update::Apply(r) if r.kind() == Kind::GlobalNetworkPolicy)
        );
    }

    /// After a restart the mirror knows only the bad value; the caller finds an earlier valid
    /// one in etcd's history and adopts it: applied, the bad value still remembered (a re-list
    /// sends nothing), and a later valid value replaces it.
    #[test]
    fn a_last_good_version_from_history_is_adopted_for_a_rejected_key_only() {
        let (mut m, _) = mirror();
        let a = format!("{P}globalnetworkpolicies/a");
        let b = format!("{P}globalnetworkpolicies/b");
        let mut out = Batch::default();
        m.begin_list();
        m.put(&a, b"{oops", &mut out);
        m.put(&b, gnp("b", "all()").as_bytes(), &mut out);
        assert!(!out.problems[0].held, "nothing to hold yet");
        assert!(m.is_rejected_without_last_good(&a));
        assert_eq!(m.unusable(), (vec![], vec![a.clone()]));
        // Neither an invalid old version nor a valid key's takes effect.
        assert!(!m.adopt_last_good(&a, b"[]", &mut out));
        assert!(!m.adopt_last_good(&b, gnp("b", "has(x)").as_bytes(), &mut out));
        assert!(m.adopt_last_good(&a, gnp("a", "has(x)").as_bytes(), &mut out));
        assert!(
            !m.adopt_last_good(&a, gnp("a", "all()").as_bytes(), &mut out),
            "once"
        );
        m.sweep(&mut out);
        assert_eq!(
            summary(&out),
            ["apply GlobalNetworkPolicy b", "apply GlobalNetworkPolicy a"]
        );
        assert_eq!(m.unusable(), (vec![a.clone()], vec![]));
        assert_eq!(m.take_unusable(), Some((vec![a.clone()], vec![])));

        let mut out = Batch::default();
        m.begin_list();
        m.put(&a, b"{oops", &mut out);
        m.put(&b, gnp("b", "all()").as_bytes(), &mut out);
        m.sweep(&mut out);
        assert!(out.updates.is_empty() && out.problems.is_empty());
        assert_eq!(
            m.take_unusable(),
            None,
            "nothing changed: nothing to publish"
        );

        m.put(&a, gnp("a", "all()").as_bytes(), &mut out);
        assert_eq!(summary(&out), ["apply GlobalNetworkPolicy a"]);
        assert_eq!(m.take_unusable(), Some((vec![], vec![])), "repaired");
        // A key only ever bad, then deleted, leaves the lists too.
        let c = format!("{P}globalnetworkpolicies/c");
        m.put(&c, b"[]", &mut out);
        assert_eq!(m.take_unusable(), Some((vec![], vec![c.clone()])));
        m.delete(&c, &mut out);
        assert_eq!(m.take_unusable(), Some((vec![], vec![])));
    }
}
