//! What the graph was last given for each watched Kubernetes object, so that any (re-)list of a
//! source reconciles by mark and sweep and only differences are sent.
//!
//! Per object (source, namespace, name) the mirror keeps the `resourceVersion` it last processed,
//! a fingerprint of what its conversion produced, and the resource key it delivered:
//! - a re-list marks every object it sees; one whose resourceVersion is unchanged is not
//!   converted again and nothing is sent; objects of that source not seen are swept as `Delete`;
//! - a changed object is converted; if the result is the same as before (a pod whose status
//!   churned without touching its endpoint) nothing is sent, otherwise `Apply`;
//! - an object that converts to nothing (a pod that lost its IP) deletes what it delivered.
//!
//! A rejected object is reported (reason + object, counter bumped) and the last good version
//! stays in the graph. Its resourceVersion is remembered so a re-list does not report it again.
//!
//! Two objects can name the same resource (a Calico NetworkPolicy CRD named `knp.default.x`
//! beside the Kubernetes NetworkPolicy `x`; a legacy `default.p` policy beside `p`). The graph
//! holds the latest one; when it goes and another still names the resource, that other object
//! is forgotten and [`Mirror::take_relists`] names its source, whose re-list re-sends it.

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use calc_graph::graph::Update;
use calc_graph::model::{Resource, ResourceKey};
use serde_json::Value;

use super::Source;
use super::convert::{Converter, Decision};
use crate::etcd::mirror::{Batch, Problem};

/// One watched object: its source and `namespace/name` (or `name`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub source: Source,
    pub name: String,
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.source, self.name)
    }
}

impl ObjectKey {
    /// The key of an object as the API server sends it (metadata.namespace/name).
    pub fn of(source: Source, object: &Value) -> Option<ObjectKey> {
        let meta = object.get("metadata")?;
        let name = meta.get("name").and_then(Value::as_str)?;
        let name = match meta.get("namespace").and_then(Value::as_str) {
            Some(ns) if source.namespaced() && !ns.is_empty() => format!("{ns}/{name}"),
            _ => name.to_string(),
        };
        Some(ObjectKey { source, name })
    }
}

fn resource_version(object: &Value) -> Option<&str> {
    object
        .get("metadata")?
        .get("resourceVersion")?
        .as_str()
        .filter(|s| !s.is_empty())
}

/// A fingerprint of a converted resource (its Debug form: maps are ordered, so it is stable).
fn fingerprint(res: &Resource) -> u64 {
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

struct Entry {
    /// resourceVersion last processed (None: forget it, convert again next time).
    version: Option<String>,
    /// Fingerprint of what was delivered, and the resource it delivered.
    delivered: Option<(u64, ResourceKey)>,
    /// Generation of the list of its source that last saw it.
    seen: u64,
    /// Its current version is rejected (`delivered` is then its last good version's).
    rejected: bool,
}

pub struct Mirror {
    converter: Converter,
    entries: HashMap<ObjectKey, Entry>,
    /// Resource → the objects naming it; the last one is the one the graph holds.
    owners: HashMap<ResourceKey, Vec<ObjectKey>>,
    generations: HashMap<Source, u64>,
    relists: BTreeSet<Source>,
    rejected: Arc<crate::datastore::Rejections>,
    /// An object became, or stopped being, rejected since [`Mirror::take_unusable`].
    unusable_changed: bool,
}

impl Mirror {
    /// `rejected` counts every rejected object (a metric).
    pub fn new(converter: Converter, rejected: Arc<crate::datastore::Rejections>) -> Mirror {
        Mirror {
            converter,
            entries: HashMap::new(),
            owners: HashMap::new(),
            generations: HashMap::new(),
            relists: BTreeSet::new(),
            rejected,
            unusable_changed: false,
        }
    }

    /// Objects the mirror tracks.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Rejected objects: those whose last good version stays in force, and those without one
    /// (the API server keeps no history to find one in).
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

    /// Sources that must be re-listed to restore a resource another object still names.
    pub fn take_relists(&mut self) -> BTreeSet<Source> {
        std::mem::take(&mut self.relists)
    }

    /// Starts a (re-)list of `source`: its objects not passed to [`Mirror::put`] before
    /// [`Mirror::sweep`] are deleted.
    pub fn begin_list(&mut self, source: Source) {
        *self.generations.entry(source).or_default() += 1;
    }

    fn generation(&self, source: Source) -> u64 {
        self.generations.get(&source).copied().unwrap_or(0)
    }

    /// An object's current state (from a list or a watch event).
    pub fn put(&mut self, source: Source, object: Value, out: &mut Batch) {
        let Some(key) = ObjectKey::of(source, &object) else {
            self.rejected
                .count(calc_graph::manifest::RejectStage::Decode);
            out.problems.push(Problem {
                key: source.to_string(),
                reason: "object without metadata.name".into(),
                held: false,
            });
            return;
        };
        let generation = self.generation(source);
        let version = resource_version(&object).map(str::to_string);
        if let Some(e) = self.entries.get_mut(&key) {
            e.seen = generation;
            if version.is_some() && e.version == version {
                return;
            }
        }
        match self.converter.convert(source, object) {
            Decision::Skip => {
                self.remove(&key, out);
                // Remembered (delivering nothing) so a re-list does not convert it again.
                self.entries.insert(
                    key,
                    Entry {
                        version,
                        delivered: None,
                        seen: generation,
                        rejected: false,
                    },
                );
            }
            Decision::Reject(rejection) => {
                self.rejected.count(rejection.stage);
                let reason = rejection.reason;
                self.unusable_changed = true;
                let e = self.entries.entry(key.clone()).or_insert(Entry {
                    version: None,
                    delivered: None,
                    seen: generation,
                    rejected: false,
                });
                e.version = version;
                e.seen = generation;
                e.rejected = true;
                out.problems.push(Problem {
                    key: key.to_string(),
                    reason,
                    held: e.delivered.is_some(),
                });
            }
            Decision::Apply { resource, warnings } => {
                for w in warnings {
                    out.problems.push(Problem {
                        key: key.to_string(),
                        reason: w,
                        held: true,
                    });
                }
                let rk = resource.key();
                let fp = fingerprint(&resource);
                let e = self.entries.entry(key.clone()).or_insert(Entry {
                    version: None,
                    delivered: None,
                    seen: generation,
                    rejected: false,
                });
                e.version = version;
                e.seen = generation;
                self.unusable_changed |= e.rejected;
                e.rejected = false;
                let previous = e.delivered.replace((fp, rk.clone()));
                let is_current = self
                    .owners
                    .get(&rk)
                    .and_then(|o| o.last())
                    .is_some_and(|k| *k == key);
                if previous.as_ref() == Some(&(fp, rk.clone())) && is_current {
                    return; // Same result as last time: nothing to send.
                }
                if let Some((_, old)) = previous.filter(|(_, old)| *old != rk) {
                    self.release(&old, &key, out);
                }
                let owners = self.owners.entry(rk.clone()).or_default();
                owners.retain(|k| *k != key);
                if !owners.is_empty() {
                    tracing::warn!(object = %key, resource = %rk, others = ?owners, "several objects name the same resource; the latest wins");
                }
                owners.push(key);
                out.updates.push(Update::Apply(resource));
            }
        }
    }

    /// An object was deleted.
    pub fn delete(&mut self, source: Source, object: &Value, out: &mut Batch) {
        if let Some(key) = ObjectKey::of(source, object) {
            self.remove(&key, out);
        }
    }

    /// Ends a (re-)list of `source`: its objects not seen since [`Mirror::begin_list`] are
    /// deleted.
    pub fn sweep(&mut self, source: Source, out: &mut Batch) {
        let generation = self.generation(source);
        let gone: Vec<ObjectKey> = self
            .entries
            .iter()
            .filter(|(k, e)| k.source == source && e.seen != generation)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.remove(&k, out);
        }
    }

    fn remove(&mut self, key: &ObjectKey, out: &mut Batch) {
        let Some(e) = self.entries.remove(key) else {
            return;
        };
        self.unusable_changed |= e.rejected;
        if let Some((_, rk)) = e.delivered {
            self.release(&rk, key, out);
        }
    }

    /// `key` no longer names `rk`.
    fn release(&mut self, rk: &ResourceKey, key: &ObjectKey, out: &mut Batch) {
        let Some(owners) = self.owners.get_mut(rk) else {
            return;
        };
        let was_current = owners.last() == Some(key);
        owners.retain(|k| k != key);
        match owners.last().cloned() {
            None => {
                self.owners.remove(rk);
                out.updates.push(Update::Delete(rk.clone()));
            }
            Some(other) if was_current => {
                // The graph holds the departed object's version; the other's must come back.
                if let Some(e) = self.entries.get_mut(&other) {
                    e.version = None;
                    e.delivered = None;
                }
                if let Some(o) = self.owners.get_mut(rk) {
                    o.retain(|k| *k != other);
                    if o.is_empty() {
                        self.owners.remove(rk);
                    }
                }
                self.relists.insert(other.source);
            }
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calc_graph::model::Kind;
    use serde_json::json;

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
        (Mirror::new(Converter::default(), c.clone()), c)
    }

    fn ns(name: &str, rv: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "resourceVersion": rv, "labels": labels}})
    }

    fn pod(name: &str, rv: &str, ip: Option<&str>, phase: &str) -> Value {
        let mut status = json!({"phase": phase});
        if let Some(ip) = ip {
            status["podIP"] = ip.into();
        }
        json!({
            "metadata": {"name": name, "namespace": "shop", "resourceVersion": rv,
                         "labels": {"app": "web"}},
            "spec": {"nodeName": "node1", "serviceAccountName": "default",
                     "containers": [{"name": "c"}]},
            "status": status,
        })
    }

    #[test]
    fn relists_send_only_differences_per_source() {
        let (mut m, _) = mirror();
        let mut out = Batch::default();
        m.begin_list(Source::Namespace);
        m.put(Source::Namespace, ns("a", "1", json!({})), &mut out);
        m.put(Source::Namespace, ns("b", "2", json!({})), &mut out);
        m.sweep(Source::Namespace, &mut out);
        m.begin_list(Source::Pod);
        m.put(
            Source::Pod,
            pod("p", "3", Some("10.0.0.1"), "Running"),
            &mut out,
        );
        m.sweep(Source::Pod, &mut out);
        assert_eq!(
            summary(&out),
            [
                "apply Profile kns.a",
                "apply Profile kns.b",
                "apply WorkloadEndpoint shop/node1-k8s-p-eth0"
            ]
        );
        // Re-list of namespaces: a unchanged, b changed, c new, (missing) nothing else; the
        // pods are untouched by a namespace re-list.
        let mut out = Batch::default();
        m.begin_list(Source::Namespace);
        m.put(Source::Namespace, ns("a", "1", json!({})), &mut out);
        m.put(Source::Namespace, ns("c", "5", json!({})), &mut out);
        m.sweep(Source::Namespace, &mut out);
        assert_eq!(
            summary(&out),
            ["apply Profile kns.c", "delete Profile kns.b"]
        );
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn unchanged_conversions_are_not_resent_and_lost_ips_delete() {
        let (mut m, _) = mirror();
        let mut out = Batch::default();
        m.put(
            Source::Pod,
            pod("p", "1", Some("10.0.0.1"), "Running"),
            &mut out,
        );
        // Status churn: a new resourceVersion, the same endpoint.
        m.put(
            Source::Pod,
            pod("p", "2", Some("10.0.0.1"), "Running"),
            &mut out,
        );
        assert_eq!(
            summary(&out),
            ["apply WorkloadEndpoint shop/node1-k8s-p-eth0"]
        );
        // The pod finishes: its endpoint goes; watching it finish again sends nothing.
        let mut out = Batch::default();
        m.put(
            Source::Pod,
            pod("p", "3", Some("10.0.0.1"), "Succeeded"),
            &mut out,
        );
        m.put(
            Source::Pod,
            pod("p", "4", Some("10.0.0.1"), "Succeeded"),
            &mut out,
        );
        assert_eq!(
            summary(&out),
            ["delete WorkloadEndpoint shop/node1-k8s-p-eth0"]
        );
        // Deleting a pod that delivers nothing sends nothing.
        let mut out = Batch::default();
        m.delete(Source::Pod, &pod("p", "5", None, "Succeeded"), &mut out);
        assert!(out.updates.is_empty());
    }

    #[test]
    fn a_rejected_object_keeps_the_last_good_version_and_is_reported_once() {
        let (mut m, rejected) = mirror();
        let tier = |rv: &str, order: Value| {
            json!({"apiVersion": "crd.projectcalico.org/v1", "kind": "Tier",
                   "metadata": {"name": "security", "resourceVersion": rv},
                   "spec": {"order": order}})
        };
        let src = Source::Crd(Kind::Tier);
        let mut out = Batch::default();
        m.begin_list(src);
        m.put(src, tier("1", json!(100)), &mut out);
        m.put(src, tier("2", json!("high")), &mut out);
        m.sweep(src, &mut out);
        assert_eq!(summary(&out), ["apply Tier security"]);
        assert_eq!(out.problems.len(), 1);
        assert!(
            out.problems[0]
                .key
                .contains("tiers.crd.projectcalico.org security"),
            "{:?}",
            out.problems
        );
        assert_eq!(rejected.total(), 1);
        assert!(out.problems[0].held);
        let held = vec!["tiers.crd.projectcalico.org security".to_owned()];
        assert_eq!(m.unusable(), (held, vec![]));
        // The same bad version on a re-list: not reported again, nothing deleted.
        let mut out = Batch::default();
        m.begin_list(src);
        m.put(src, tier("2", json!("high")), &mut out);
        m.sweep(src, &mut out);
        assert!(out.updates.is_empty() && out.problems.is_empty());
        // A later valid version applies; deleting the object deletes the tier.
        m.put(src, tier("3", json!(200)), &mut out);
        m.delete(src, &tier("4", json!(200)), &mut out);
        assert_eq!(
            summary(&out),
            ["apply Tier security", "delete Tier security"]
        );
        assert_eq!(m.unusable(), (vec![], vec![]));
        // Bad from its first version (as after a restart): not in force, and listed.
        let mut out = Batch::default();
        m.put(src, tier("5", json!("high")), &mut out);
        assert!(out.updates.is_empty() && !out.problems[0].held);
        let without = vec!["tiers.crd.projectcalico.org security".to_owned()];
        assert_eq!(m.take_unusable(), Some((vec![], without)));
        assert_eq!(m.take_unusable(), None, "published once");
        m.delete(src, &tier("6", json!(200)), &mut out);
        assert_eq!(m.take_unusable(), Some((vec![], vec![])), "deleted");
    }

    #[test]
    fn two_objects_naming_one_policy() {
        let (mut m, _) = mirror();
        let crd = json!({"apiVersion": "crd.projectcalico.org/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "knp.default.deny", "namespace": "shop", "resourceVersion": "1"},
            "spec": {"selector": "all()"}});
        let knp = json!({"metadata": {"name": "deny", "namespace": "shop", "resourceVersion": "2"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}});
        let mut out = Batch::default();
        m.put(Source::Crd(Kind::NetworkPolicy), crd.clone(), &mut out);
        m.put(Source::KubernetesNetworkPolicy, knp.clone(), &mut out);
        assert_eq!(
            summary(&out),
            [
                "apply NetworkPolicy shop/knp.default.deny",
                "apply NetworkPolicy shop/knp.default.deny"
            ]
        );
        // The Kubernetes one goes: the CRD's version must come back through a re-list.
        let mut out = Batch::default();
        m.delete(Source::KubernetesNetworkPolicy, &knp, &mut out);
        assert!(out.updates.is_empty());
        let relists = m.take_relists();
        assert_eq!(
            relists.into_iter().collect::<Vec<_>>(),
            [Source::Crd(Kind::NetworkPolicy)]
        );
        let mut out = Batch::default();
        m.begin_list(Source::Crd(Kind::NetworkPolicy));
        m.put(Source::Crd(Kind::NetworkPolicy), crd.clone(), &mut out);
        m.sweep(Source::Crd(Kind::NetworkPolicy), &mut out);
        assert_eq!(summary(&out), ["apply NetworkPolicy shop/knp.default.deny"]);
        let mut out = Batch::default();
        m.delete(Source::Crd(Kind::NetworkPolicy), &crd, &mut out);
        assert_eq!(
            summary(&out),
            ["delete NetworkPolicy shop/knp.default.deny"]
        );
    }
}
