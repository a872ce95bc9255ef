//! Keeping the parts in step: installing and removing endpoints, network sets, policies,
//! profiles and IP sets across the label index ([`super::ids`], [`super::items`],
//! [`super::policies`], [`super::ipsets`]) and the per-node spans.
//!
//! Contract: each `set_*` / `remove_*` leaves the indexes as if the resource had always had its
//! new version (or never existed), whatever came before. Match events from the label index are
//! routed here at once, so IP-set members and per-node spans never lag the selectors. Nothing
//! here builds a node's output; changes that a node might see only go through the span counts
//! ([`super::spans`]) or a dirty mark, which the sequencer reads at the next flush.

use std::collections::BTreeMap;
use std::sync::Arc;

use felix_proto as pb;
use pb::to_dataplane::Payload;

use super::SharedMessage;
use super::ids::SelectorOwner;
use super::ipsets::IpSetState;
use super::items::{EndpointState, KeySet, NetSetState, StoredEndpoint};
use super::messages::{msg, policy_id_proto, policy_message, profile_messages};
use super::policies::{PolicyState, ProfileState};
use super::{CalcGraph, Key, Name};
use crate::convert::{BadSelector, EndpointModel, LABEL_NAMESPACE, PolicyModel};
use crate::label_index::{ItemClass, ItemId};
use crate::model::ObjectMeta;
use crate::rule_scanner::{self, IpSetKind, IpSetSpec, ScannedRules};

/// IP-set members an item contributes to a set of the given kind.
fn members_of(
    ep: Option<&EndpointState>,
    ns: Option<&NetSetState>,
    kind: &IpSetKind,
) -> Vec<Arc<str>> {
    match (kind, ep, ns) {
        (IpSetKind::Net, Some(ep), _) => ep.nets.to_vec(),
        (IpSetKind::Net, None, Some(ns)) => ns.nets.clone(),
        (IpSetKind::NamedPort { protocol, name }, Some(ep), _) => {
            let mut out = Vec::new();
            for p in ep
                .model
                .ports
                .iter()
                .filter(|p| &p.name == name && p.protocol == protocol.as_str())
            {
                for net in &ep.nets {
                    let ip = net.split('/').next().unwrap_or_default();
                    out.push(Arc::from(format!("{ip},{}:{}", p.protocol, p.port)));
                }
            }
            out
        }
        _ => Vec::new(),
    }
}

impl CalcGraph {
    /// Routes the label index's match events to their owners. Events come in runs for one
    /// item (an endpoint's label change), so the endpoint and its node are looked up once per
    /// run, not once per policy.
    fn process_events(&mut self) {
        loop {
            let events = self.index.take_events();
            if events.is_empty() {
                return;
            }
            let mut policy_run: Vec<(Key, bool)> = Vec::new();
            let mut run_item = None;
            for ev in events {
                match self.ids.owner(ev.selector) {
                    Some(SelectorOwner::Policy(pkey)) => {
                        let pkey = pkey.clone();
                        if run_item != Some(ev.item) {
                            if let Some(item) = run_item {
                                self.policy_matches_changed(item, &mut policy_run);
                            }
                            run_item = Some(ev.item);
                        }
                        policy_run.push((pkey, ev.matched));
                    }
                    Some(SelectorOwner::IpSet(id)) => {
                        let id = id.clone();
                        self.ipset_match_changed(&id, ev.item, ev.matched);
                    }
                    None => {}
                }
            }
            if let Some(item) = run_item {
                self.policy_matches_changed(item, &mut policy_run);
            }
        }
    }

    /// Policies started (`true`) or stopped selecting one endpoint; drains `changes`.
    fn policy_matches_changed(&mut self, item: ItemId, changes: &mut Vec<(Key, bool)>) {
        let Some(ep) = self.items.endpoints.get_mut(&item) else {
            changes.clear();
            return;
        };
        let node = ep.node.clone();
        let ekey = ep.key.clone();
        for (pkey, matched) in changes.iter() {
            if *matched {
                ep.policies.insert(pkey);
            } else {
                ep.policies.remove(pkey);
            }
        }
        for (pkey, matched) in changes.drain(..) {
            if matched {
                self.node_policy_inc(&node, &pkey);
            } else {
                self.node_policy_dec(&node, &pkey);
            }
        }
        self.node_mut(&node).dirty.endpoints.insert(ekey);
    }

    /// An IP set's selector started or stopped matching an endpoint or network set.
    fn ipset_match_changed(&mut self, id: &Name, item: ItemId, matched: bool) {
        let Some(set) = self.ipsets.sets.get(id) else {
            return;
        };
        let (ep, ns) = (
            self.items.endpoints.get(&item),
            self.items.netsets.get(&item),
        );
        let members: Vec<Arc<str>> = match (&set.spec.kind, ep, ns) {
            // The common case, an address set: the item's CIDRs as they are.
            (IpSetKind::Net, Some(ep), _) => ep.nets.to_vec(),
            (IpSetKind::Net, None, Some(ns)) => ns.nets.clone(),
            (kind, ep, ns) => members_of(ep, ns, kind),
        };
        for m in members {
            self.ipsets.member_change(id, m, matched);
        }
    }

    fn define_ipsets(&mut self, specs: &[IpSetSpec]) -> Vec<Name> {
        let mut ids = Vec::with_capacity(specs.len());
        for spec in specs {
            let id: Name = Arc::from(spec.id.as_str());
            if let Some(set) = self.ipsets.sets.get_mut(&id) {
                set.defined_refs += 1;
            } else {
                let sel = self.ids.selector(SelectorOwner::IpSet(id.clone()));
                self.ipsets.sets.insert(
                    id.clone(),
                    IpSetState {
                        spec: spec.clone(),
                        selector: sel,
                        defined_refs: 1,
                        members: Default::default(),
                    },
                );
                // Service sets have no label selector: their members come from EndpointSlices.
                if matches!(spec.kind, IpSetKind::Service { .. }) {
                    self.service_set_defined(&id, true);
                } else {
                    let endpoints_only = matches!(spec.kind, IpSetKind::NamedPort { .. });
                    self.index
                        .add_selector(sel, spec.selector.clone(), endpoints_only);
                    self.process_events();
                }
            }
            ids.push(id);
        }
        ids
    }

    fn undefine_ipsets(&mut self, ids: &[Name]) {
        for id in ids {
            let Some(set) = self.ipsets.sets.get_mut(id) else {
                continue;
            };
            set.defined_refs -= 1;
            if set.defined_refs == 0 {
                let sel = set.selector;
                self.service_set_defined(id, false);
                self.index.remove_selector(sel);
                self.process_events();
                self.ids.free_selector(sel);
                // The unmatch events above emptied it; whatever is left is released too.
                self.ipsets.full.remove(id);
                if let Some(set) = self.ipsets.sets.remove(id) {
                    set.members
                        .ids()
                        .for_each(|m| self.ipsets.members.release(m));
                }
            }
        }
    }

    pub(super) fn set_policy(&mut self, key: Key, model: PolicyModel) -> Result<(), BadSelector> {
        // The converted model is the stored version (`Store::keeps_converted`): the same one
        // again is a no-op.
        if self
            .policies
            .by_key
            .get(&key)
            .is_some_and(|old| old.model == model)
        {
            return Ok(());
        }
        let scanned = rule_scanner::scan_rules(
            &model.inbound,
            &model.outbound,
            (
                &format!("pol-in-default/{}", model.id.name),
                &format!("pol-out-default/{}", model.id.name),
            ),
        )?;
        // Define the new IP sets before dropping the old ones so shared sets keep their members.
        let ipsets = self.define_ipsets(&scanned.ipsets);
        if self
            .policies
            .by_key
            .get(&key)
            .is_some_and(|old| same_placement(&old.model, &model))
        {
            self.replace_policy_rules(&key, model, &scanned, ipsets);
            return Ok(());
        }
        self.remove_policy(&key);
        self.policies.ranks_stale = true;
        let update = SharedMessage::new(msg(Payload::ActivePolicyUpdate(pb::ActivePolicyUpdate {
            id: Some(policy_id_proto(&model.id)),
            policy: Some(policy_message(&model, &scanned)),
        })));
        let sel = self.ids.selector(SelectorOwner::Policy(key.clone()));
        let everywhere = model.assume_needed_on_every_node();
        let selector = model.selector.clone();
        self.policies.by_key.insert(
            key.clone(),
            Box::new(PolicyState {
                sort_string: model.id.sort_string(),
                rank: 0,
                model,
                selector: sel,
                ipsets: ipsets.clone(),
                update,
            }),
        );
        if everywhere {
            // Needed on every node, including nodes that appear later: not reference counted
            // per node; flush treats the policy and its IP sets as needed everywhere.
            self.policies.everywhere.insert(key.clone());
            self.mark_everywhere_dirty(&key, &ipsets);
        }
        self.index.add_selector(sel, selector, true);
        self.process_events();
        // Nodes that were sent the previous version need the new content.
        self.touch_policy(&key, false);
        Ok(())
    }

    /// A new version of a policy that applies to the same endpoints in the same place (only
    /// its rules differ): swap the rules and IP sets in place. Endpoints are untouched, so a
    /// rule edit costs the nodes running the policy, not every endpoint it selects.
    fn replace_policy_rules(
        &mut self,
        key: &Key,
        model: PolicyModel,
        scanned: &ScannedRules,
        ipsets: Vec<Name>,
    ) {
        let update = SharedMessage::new(msg(Payload::ActivePolicyUpdate(pb::ActivePolicyUpdate {
            id: Some(policy_id_proto(&model.id)),
            policy: Some(policy_message(&model, scanned)),
        })));
        let state = self
            .policies
            .by_key
            .get_mut(key)
            .expect("checked by the caller");
        let old_ipsets = std::mem::replace(&mut state.ipsets, ipsets.clone());
        state.model = model;
        state.update = update;
        if self.policies.everywhere.contains(key) {
            let both: Vec<Name> = ipsets.iter().chain(&old_ipsets).cloned().collect();
            self.mark_everywhere_dirty(key, &both);
        } else {
            let active_on: Vec<Name> = self
                .nodes
                .iter()
                .filter(|(_, n)| n.span.policy_refs.contains_key(key))
                .map(|(k, _)| k.clone())
                .collect();
            for node in &active_on {
                for id in &ipsets {
                    self.node_ipset_inc(node, id);
                }
                for id in &old_ipsets {
                    self.node_ipset_dec(node, id);
                }
            }
        }
        self.undefine_ipsets(&old_ipsets);
        self.touch_policy(key, false);
    }

    fn mark_everywhere_dirty(&mut self, key: &Key, ipsets: &[Name]) {
        for n in self.nodes.values_mut() {
            n.dirty.policies.insert(key.clone());
            n.dirty.ipsets.extend(ipsets.iter().cloned());
        }
    }

    pub(super) fn remove_policy(&mut self, key: &Key) {
        let Some(sel) = self.policies.by_key.get(key).map(|p| p.selector) else {
            return;
        };
        self.index.remove_selector(sel);
        self.process_events();
        self.ids.free_selector(sel);
        let state = self.policies.by_key.remove(key).expect("checked above");
        if self.policies.everywhere.remove(key) {
            self.mark_everywhere_dirty(key, &state.ipsets);
        }
        self.undefine_ipsets(&state.ipsets);
        self.touch_policy(key, false);
    }

    /// Marks a policy dirty on every node that runs it or was sent it and, with `endpoints`,
    /// the endpoints it applies to (their tier lists change when its tier is reordered).
    fn touch_policy(&mut self, key: &Key, endpoints: bool) {
        let sel = self.policies.by_key.get(key).map(|p| p.selector);
        for n in self.nodes.values_mut() {
            if n.span.policy_refs.contains_key(key)
                || n.sub.as_ref().is_some_and(|s| s.policies.contains_key(key))
                || self.policies.everywhere.contains(key)
            {
                n.dirty.policies.insert(key.clone());
            }
        }
        if let Some(sel) = sel.filter(|_| endpoints) {
            let items: Vec<ItemId> = self.index.matches(sel).collect();
            for item in items {
                if let Some(ep) = self.items.endpoints.get(&item) {
                    let (node, ekey) = (ep.node.clone(), ep.key.clone());
                    self.node_mut(&node).dirty.endpoints.insert(ekey);
                }
            }
        }
    }

    /// A tier's order or default action changed: every endpoint with a policy in it is dirty.
    pub(super) fn touch_tier(&mut self, tier: &str) {
        self.policies.ranks_stale = true;
        let keys: Vec<Key> = self
            .policies
            .by_key
            .iter()
            .filter(|(_, p)| p.model.tier == tier)
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            self.touch_policy(&k, true);
        }
    }

    pub(super) fn set_profile(
        &mut self,
        name: &str,
        scanned: Option<ScannedRules>,
        labels: &BTreeMap<String, String>,
    ) {
        let name: Name = Arc::from(name);
        let (messages, new_ipsets) = match &scanned {
            Some(s) => (
                profile_messages(
                    &name,
                    pb::Profile {
                        inbound_rules: s.inbound.clone(),
                        outbound_rules: s.outbound.clone(),
                    },
                ),
                self.define_ipsets(&s.ipsets),
            ),
            None => (profile_messages(&name, pb::Profile::default()), Vec::new()),
        };
        let old_ipsets = self
            .policies
            .profiles
            .get(&name)
            .map(|p| p.ipsets.clone())
            .unwrap_or_default();
        let active_on: Vec<Name> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.span.profile_refs.contains_key(&name))
            .map(|(k, _)| k.clone())
            .collect();
        for node in &active_on {
            for id in &new_ipsets {
                self.node_ipset_inc(node, id);
            }
            for id in &old_ipsets {
                self.node_ipset_dec(node, id);
            }
        }
        match scanned {
            Some(_) => {
                self.policies.profiles.insert(
                    name.clone(),
                    ProfileState {
                        update: messages,
                        ipsets: new_ipsets,
                    },
                );
            }
            None => {
                self.policies.profiles.remove(&name);
            }
        }
        self.undefine_ipsets(&old_ipsets);
        for n in self.nodes.values_mut() {
            if n.span.profile_refs.contains_key(&name)
                || n.sub
                    .as_ref()
                    .is_some_and(|s| s.profiles.contains_key(&name))
            {
                n.dirty.profiles.insert(name.clone());
            }
        }
        self.index.set_parent_labels(&name, labels);
        self.process_events();
    }

    pub(super) fn set_endpoint(&mut self, key: Key, mut model: EndpointModel) {
        // The labels live in the label index only (interned); the kept model has none.
        let labels = std::mem::take(&mut model.labels);
        let (model, node, nets, profiles) = StoredEndpoint::split(model);
        if let Some(item) = self.items.item_of.get(&key)
            && self
                .items
                .endpoints
                .get(item)
                .is_some_and(|e| e.model == model && *e.node == *node && e.nets == nets)
            && self.index.has_own_labels(*item, &labels)
            && self.index.has_parents(*item, &profiles)
        {
            return;
        }
        self.remove_endpoint(&key);
        let item = self.ids.item();
        // The node table's own name, so the endpoints of a node share one allocation.
        self.node_mut(&node);
        let (node, _) = self
            .nodes
            .get_key_value(node.as_str())
            .expect("just ensured");
        let node = node.clone();
        {
            let n = self.node_mut(&node);
            n.span.endpoints.insert(key.clone());
            n.dirty.endpoints.insert(key.clone());
        }
        for p in &profiles {
            self.node_profile_inc(&node, &Arc::from(p.as_str()));
        }
        self.items.item_of.insert(key.clone(), item);
        self.items.endpoints.insert(
            item,
            Box::new(EndpointState {
                key,
                model,
                node,
                policies: KeySet::default(),
                nets,
            }),
        );
        self.index
            .set_item(item, ItemClass::Endpoint, &labels, &profiles);
        self.process_events();
    }

    pub(super) fn remove_endpoint(&mut self, key: &Key) {
        let Some(item) = self.items.item_of.get(key).copied() else {
            return;
        };
        if !self.items.endpoints.contains_key(&item) {
            return;
        }
        let profiles: Vec<Name> = self.index.parents(item).map(Arc::from).collect();
        self.index.remove_item(item);
        self.process_events();
        self.items.item_of.remove(key);
        let ep = self.items.endpoints.remove(&item).expect("checked above");
        self.ids.free_item(item);
        {
            let n = self.node_mut(&ep.node);
            n.span.endpoints.remove(key);
            n.dirty.endpoints.insert(key.clone());
        }
        for p in &profiles {
            self.node_profile_dec(&ep.node, p);
        }
        self.prune_node(&ep.node.clone());
    }

    pub(super) fn set_netset(&mut self, key: Key, meta: &ObjectMeta, nets: &[String]) {
        self.remove_netset(&key);
        let item = self.ids.item();
        let mut labels = meta.labels.clone();
        let mut parents = Vec::new();
        if let Some(ns) = &key.namespace {
            labels.insert(LABEL_NAMESPACE.into(), ns.clone());
            parents.push(format!("kns.{ns}"));
        }
        let mut masked: Vec<String> = nets
            .iter()
            .filter_map(|n| crate::model::validate::parse_cidr_or_ip(n))
            .filter_map(|n| ipnetwork::IpNetwork::new(n.network(), n.prefix()).ok())
            .map(|n| n.to_string())
            .collect();
        masked.sort();
        masked.dedup();
        self.items.item_of.insert(key, item);
        let nets = masked.iter().map(|n| Arc::from(n.as_str())).collect();
        self.items.netsets.insert(item, NetSetState { nets });
        self.index
            .set_item(item, ItemClass::NetworkSet, &labels, &parents);
        self.process_events();
    }

    pub(super) fn remove_netset(&mut self, key: &Key) {
        let Some(item) = self.items.item_of.get(key).copied() else {
            return;
        };
        if !self.items.netsets.contains_key(&item) {
            return;
        }
        self.index.remove_item(item);
        self.process_events();
        self.items.item_of.remove(key);
        self.items.netsets.remove(&item);
        self.ids.free_item(item);
    }
}

/// Whether two versions of a policy select the same endpoints and sit in the same place in
/// their tier lists (so only the rules can differ).
fn same_placement(a: &PolicyModel, b: &PolicyModel) -> bool {
    a.id == b.id
        && a.tier == b.tier
        && a.order.map(f64::to_bits) == b.order.map(f64::to_bits)
        && a.selector.canonical() == b.selector.canonical()
        && a.ingress == b.ingress
        && a.egress == b.egress
        && a.untracked == b.untracked
        && a.pre_dnat == b.pre_dnat
        && a.apply_on_forward == b.apply_on_forward
        && a.performance_hints == b.performance_hints
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::test_util::{apply, flush_for, gnp, kinds, wep};
    use super::*;
    use crate::graph::Update;

    #[test]
    fn a_rule_only_edit_resends_the_policy_but_not_the_endpoints_it_selects() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        apply(&mut g, gnp("db", "role == 'db'", "Allow", "role == 'web'"));
        apply(
            &mut g,
            wep(
                "db-1",
                "node-1",
                "10.0.0.1",
                json!({"role": "db"}),
                json!([]),
            ),
        );
        apply(
            &mut g,
            wep(
                "db-2",
                "node-1",
                "10.0.0.2",
                json!({"role": "db"}),
                json!([]),
            ),
        );
        g.flush();

        apply(&mut g, gnp("db", "role == 'db'", "Deny", "role == 'web'"));
        assert!(
            g.nodes["node-1"].dirty.endpoints.is_empty(),
            "a rule edit costs the nodes running the policy, not every endpoint it selects"
        );
        assert_eq!(kinds(&flush_for(&mut g, "node-1")), ["ActivePolicyUpdate"]);

        // Moving the policy to other endpoints does touch the endpoints.
        apply(&mut g, gnp("db", "role == 'none'", "Deny", "role == 'web'"));
        let k = kinds(&flush_for(&mut g, "node-1"));
        assert_eq!(
            k.iter().filter(|k| *k == "WorkloadEndpointUpdate").count(),
            2,
            "{k:?}"
        );
    }

    /// The tier names and policy names of node-1's last endpoint update.
    fn tier_lists(g: &mut CalcGraph) -> Vec<(String, Vec<String>)> {
        let msgs = flush_for(g, "node-1");
        let ep = msgs
            .iter()
            .rev()
            .find_map(|m| match &m.payload {
                Some(Payload::WorkloadEndpointUpdate(u)) => u.endpoint.clone(),
                _ => None,
            })
            .expect("an endpoint update");
        ep.tiers
            .iter()
            .map(|t| {
                let names = t.ingress_policies.iter().map(|p| p.name.clone()).collect();
                (t.name.clone(), names)
            })
            .collect()
    }

    #[test]
    fn tier_lists_follow_tier_and_policy_order_changes() {
        let tier = |name: &str, order: f64| {
            json!({"apiVersion": "projectcalico.org/v3", "kind": "Tier",
                   "metadata": {"name": name}, "spec": {"order": order}})
        };
        let pol = |name: &str, tier: &str, order: f64| {
            let mut v = gnp(name, "all()", "Allow", "all()");
            v["metadata"]["name"] = json!(format!("{tier}.{name}"));
            v["spec"]["tier"] = json!(tier);
            v["spec"]["order"] = json!(order);
            v
        };
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        apply(&mut g, tier("a", 10.0));
        apply(&mut g, tier("b", 20.0));
        apply(&mut g, pol("p1", "a", 1.0));
        apply(&mut g, pol("p2", "a", 2.0));
        apply(&mut g, pol("q", "b", 1.0));
        apply(&mut g, wep("w", "node-1", "10.0.0.1", json!({}), json!([])));
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            tier_lists(&mut g),
            [
                ("a".into(), names(&["a.p1", "a.p2"])),
                ("b".into(), names(&["b.q"]))
            ]
        );
        apply(&mut g, tier("a", 30.0));
        assert_eq!(
            tier_lists(&mut g),
            [
                ("b".into(), names(&["b.q"])),
                ("a".into(), names(&["a.p1", "a.p2"]))
            ],
            "tier a now comes after b"
        );
        apply(&mut g, pol("p1", "a", 3.0));
        assert_eq!(
            tier_lists(&mut g),
            [
                ("b".into(), names(&["b.q"])),
                ("a".into(), names(&["a.p2", "a.p1"]))
            ],
            "p1's new order puts it after p2"
        );
    }

    #[test]
    fn an_unchanged_endpoint_is_a_no_op_and_a_label_change_is_not() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        apply(&mut g, gnp("db", "role == 'db'", "Allow", "role == 'web'"));
        let pod = |labels| wep("db-1", "node-1", "10.0.0.1", labels, json!([]));
        apply(&mut g, pod(json!({"role": "db", "team": "a"})));
        g.flush();

        apply(&mut g, pod(json!({"role": "db", "team": "a"})));
        assert!(
            flush_for(&mut g, "node-1").is_empty(),
            "same labels: nothing to send"
        );

        // Same number of labels, one value changed: the policy no longer applies.
        apply(&mut g, pod(json!({"role": "web", "team": "a"})));
        let k = kinds(&flush_for(&mut g, "node-1"));
        assert!(k.contains(&"ActivePolicyRemove".to_string()), "{k:?}");
        // A label dropped is a change too.
        apply(&mut g, pod(json!({"role": "web"})));
        let item = g.items.item_of.values().next().copied().unwrap();
        let labels = g.index.effective_labels(item).unwrap();
        assert_eq!(labels.get("role").map(String::as_str), Some("web"));
        assert!(
            !labels.contains_key("team"),
            "the index holds the new labels: {labels:?}"
        );
    }

    #[test]
    fn ids_of_deleted_items_and_selectors_are_reused() {
        let mut g = CalcGraph::new();
        for _ in 0..100 {
            let pol = apply(&mut g, gnp("db", "role == 'db'", "Allow", "role == 'web'"));
            let ep = apply(
                &mut g,
                wep("db", "node-1", "10.0.0.1", json!({}), json!([])),
            );
            g.apply(Update::Delete((*ep).clone())).unwrap();
            g.apply(Update::Delete((*pol).clone())).unwrap();
        }
        assert_eq!(
            g.ids.next_item, 1,
            "one endpoint at a time needs one item id"
        );
        assert_eq!(
            g.ids.next_selector, 2,
            "a policy and its IP set need two selector ids"
        );
    }

    #[test]
    fn a_member_shared_by_two_endpoints_stays_until_both_go() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        apply(&mut g, gnp("db", "role == 'db'", "Allow", "role == 'web'"));
        apply(
            &mut g,
            wep("db", "node-1", "10.0.0.1", json!({"role": "db"}), json!([])),
        );
        let web = |pod: &str| wep(pod, "node-2", "10.0.0.9", json!({"role": "web"}), json!([]));
        let w1 = apply(&mut g, web("web-1"));
        apply(&mut g, web("web-2"));
        g.flush();

        g.apply(Update::Delete((*w1).clone())).unwrap();
        assert!(
            flush_for(&mut g, "node-1").is_empty(),
            "web-2 still has the address: the set does not change"
        );
        let set = g.ipsets.sets.values().next().expect("one IP set");
        let mid = g.ipsets.members.existing("10.0.0.9/32").expect("interned");
        assert_eq!(set.members.count(mid), 1);
    }
}
