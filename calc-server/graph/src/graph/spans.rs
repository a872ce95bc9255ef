//! Per-node spans: what each node needs because of the endpoints it hosts.
//!
//! Contract: a policy is in a node's span while at least one endpoint on the node is selected by
//! it; a profile while at least one endpoint on it lists the profile; an IP set while at least
//! one policy or profile in the span uses it (the IP sets of policies hinted
//! `AssumeNeededOnEveryNode` are not counted: the sequencer treats those policies and their sets
//! as needed on every node, including nodes that appear later). Counts are kept rather than sets
//! so that an endpoint leaving cannot drop what another endpoint still needs, and only a count
//! crossing zero marks the key dirty: churn between 1 and n sends nothing.

use rustc_hash::{FxHashMap, FxHashSet};

use super::sequencer::{Dirty, Subscription};
use super::{CalcGraph, Key, Name};

/// Every node the graph keeps: those with endpoints, a subscriber or a policy reference.
pub(super) type Nodes = FxHashMap<Name, NodeState>;

/// Everything the graph keeps about one node: what it needs ([`Span`]), what changed since its
/// last flush ([`Dirty`]) and, if subscribed, what it was sent ([`Subscription`]).
#[derive(Default)]
pub(super) struct NodeState {
    pub(super) span: Span,
    pub(super) dirty: Dirty,
    pub(super) sub: Option<Subscription>,
}

/// What one node needs: its endpoints and, per policy, profile and IP set, how many of the
/// things above it on this node need it.
#[derive(Default)]
pub(super) struct Span {
    pub(super) endpoints: FxHashSet<Key>,
    pub(super) policy_refs: FxHashMap<Key, u32>,
    pub(super) profile_refs: FxHashMap<Name, u32>,
    pub(super) ipset_refs: FxHashMap<Name, u32>,
}

/// Adds a reference (`up`) or drops one; true when the count went from or to zero. Dropping
/// an absent key is a no-op.
pub(super) fn bump<K: std::hash::Hash + Eq + Clone>(
    map: &mut FxHashMap<K, u32>,
    key: &K,
    up: bool,
) -> bool {
    if up {
        let c = map.entry(key.clone()).or_insert(0);
        *c += 1;
        return *c == 1;
    }
    match map.get_mut(key) {
        Some(c) if *c > 1 => {
            *c -= 1;
            false
        }
        Some(_) => {
            map.remove(key);
            true
        }
        None => false,
    }
}

impl CalcGraph {
    /// One more (`up`) or one fewer reference to an IP set on a node.
    fn node_ipset_ref(&mut self, node: &str, id: &Name, up: bool) {
        let n = self.node_mut(node);
        if bump(&mut n.span.ipset_refs, id, up) {
            n.dirty.ipsets.insert(id.clone());
        }
    }

    pub(super) fn node_ipset_inc(&mut self, node: &str, id: &Name) {
        self.node_ipset_ref(node, id, true);
    }

    pub(super) fn node_ipset_dec(&mut self, node: &str, id: &Name) {
        self.node_ipset_ref(node, id, false);
    }

    /// One more or one fewer endpoint on a node selected by a policy; the policy's IP sets
    /// follow its activation there (hinted policies' sets are needed everywhere, not counted).
    fn node_policy_ref(&mut self, node: &str, pkey: &Key, up: bool) {
        let n = self.node_mut(node);
        if !bump(&mut n.span.policy_refs, pkey, up) {
            return;
        }
        n.dirty.policies.insert(pkey.clone());
        if self.policies.everywhere.contains(pkey) {
            return;
        }
        let ipsets = self
            .policies
            .by_key
            .get(pkey)
            .map(|p| p.ipsets.clone())
            .unwrap_or_default();
        for id in &ipsets {
            self.node_ipset_ref(node, id, up);
        }
    }

    pub(super) fn node_policy_inc(&mut self, node: &str, pkey: &Key) {
        self.node_policy_ref(node, pkey, true);
    }

    pub(super) fn node_policy_dec(&mut self, node: &str, pkey: &Key) {
        self.node_policy_ref(node, pkey, false);
    }

    /// One more or one fewer endpoint on a node listing a profile; its IP sets follow.
    fn node_profile_ref(&mut self, node: &str, name: &Name, up: bool) {
        let n = self.node_mut(node);
        if !bump(&mut n.span.profile_refs, name, up) {
            return;
        }
        n.dirty.profiles.insert(name.clone());
        let ipsets = self
            .policies
            .profiles
            .get(name)
            .map(|p| p.ipsets.clone())
            .unwrap_or_default();
        for id in &ipsets {
            self.node_ipset_ref(node, id, up);
        }
    }

    pub(super) fn node_profile_inc(&mut self, node: &str, name: &Name) {
        self.node_profile_ref(node, name, true);
    }

    pub(super) fn node_profile_dec(&mut self, node: &str, name: &Name) {
        self.node_profile_ref(node, name, false);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::test_util::{apply, flush_for, gnp, kinds, wep};
    use super::*;
    use crate::graph::Update;

    #[test]
    fn bump_reports_only_the_zero_crossings() {
        let mut m: FxHashMap<&str, u32> = FxHashMap::default();
        assert!(bump(&mut m, &"p", true), "0 → 1 is a crossing");
        assert!(!bump(&mut m, &"p", true), "1 → 2 is not");
        assert!(!bump(&mut m, &"p", false), "2 → 1 is not");
        assert_eq!(m.get("p"), Some(&1));
        assert!(bump(&mut m, &"p", false), "1 → 0 is a crossing");
        assert!(m.is_empty(), "a zero count is not kept");
        assert!(
            !bump(&mut m, &"p", false),
            "dropping an absent key changes nothing"
        );
        assert!(m.is_empty());
    }

    #[test]
    fn a_policy_and_its_ip_set_stay_while_any_endpoint_on_the_node_needs_them() {
        let mut g = CalcGraph::new();
        let pol = apply(&mut g, gnp("db", "role == 'db'", "Allow", "role == 'web'"));
        let db1 = apply(
            &mut g,
            wep(
                "db-1",
                "node-1",
                "10.0.0.1",
                json!({"role": "db"}),
                json!([]),
            ),
        );
        let span = &g.nodes["node-1"].span;
        assert_eq!(span.policy_refs.get(&pol), Some(&1));
        assert_eq!(
            span.ipset_refs.len(),
            1,
            "the policy's source set follows it"
        );
        assert!(g.nodes["node-1"].dirty.policies.contains(&pol));

        // A second endpoint needing the policy only counts: the node's span does not change.
        g.flush();
        let db2 = apply(
            &mut g,
            wep(
                "db-2",
                "node-1",
                "10.0.0.2",
                json!({"role": "db"}),
                json!([]),
            ),
        );
        let n = &g.nodes["node-1"];
        assert_eq!(n.span.policy_refs.get(&pol), Some(&2));
        assert_eq!(n.span.ipset_refs.values().collect::<Vec<_>>(), [&1]);
        assert!(n.dirty.policies.is_empty() && n.dirty.ipsets.is_empty());
        assert!(n.dirty.endpoints.contains(&db2));

        g.apply(Update::Delete((*db1).clone())).unwrap();
        let span = &g.nodes["node-1"].span;
        assert_eq!(span.policy_refs.get(&pol), Some(&1), "db-2 still needs it");
        assert_eq!(span.ipset_refs.len(), 1);

        g.apply(Update::Delete((*db2).clone())).unwrap();
        assert!(
            !g.nodes.contains_key("node-1"),
            "an unsubscribed node that needs nothing is forgotten"
        );
    }

    #[test]
    fn a_profiles_ip_sets_follow_the_endpoints_listing_it() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        apply(
            &mut g,
            json!({"apiVersion": "projectcalico.org/v3", "kind": "Profile",
                   "metadata": {"name": "kns.ns"},
                   "spec": {"ingress": [{"action": "Allow",
                                         "source": {"selector": "role == 'web'"}}]}}),
        );
        let ep = apply(
            &mut g,
            wep("a", "node-1", "10.0.0.1", json!({}), json!(["kns.ns"])),
        );
        let span = &g.nodes["node-1"].span;
        assert_eq!(span.profile_refs.get("kns.ns"), Some(&1));
        assert_eq!(span.ipset_refs.len(), 1);

        g.apply(Update::Delete((*ep).clone())).unwrap();
        let span = &g.nodes["node-1"].span;
        assert!(span.profile_refs.is_empty());
        assert!(
            span.ipset_refs.is_empty(),
            "the set goes with the last profile using it"
        );
    }

    #[test]
    fn a_hinted_policy_reaches_every_node_without_counting_its_ip_sets() {
        let mut g = CalcGraph::new();
        g.subscribe("node-3");
        let mut p = gnp("guard", "role == 'db'", "Allow", "role == 'web'");
        p["spec"]["performanceHints"] = json!(["AssumeNeededOnEveryNode"]);
        let pol = apply(&mut g, p);
        apply(
            &mut g,
            wep("db", "node-1", "10.0.0.1", json!({"role": "db"}), json!([])),
        );

        let span = &g.nodes["node-1"].span;
        assert_eq!(span.policy_refs.get(&pol), Some(&1));
        assert!(
            span.ipset_refs.is_empty(),
            "a hinted policy's sets are needed everywhere, not counted per node"
        );
        // node-3 has no endpoint at all and still gets the policy and its set.
        let k = kinds(&flush_for(&mut g, "node-3"));
        assert!(k.contains(&"IpsetUpdate".to_string()), "{k:?}");
        assert!(k.contains(&"ActivePolicyUpdate".to_string()), "{k:?}");
    }
}
