//! Label index with inheritance: which items (endpoints, network sets) each registered selector
//! matches, kept up to date incrementally.
//!
//! An item's effective labels are its own labels, then each parent's (profile's `labelsToApply`)
//! in parent order, the first definition of a label winning — Felix's `InheritIndex`. Every
//! change that alters a match produces a [`MatchEvent`]; the caller drains them with
//! [`LabelIndex::take_events`] and updates whatever depends on the match.
//!
//! Both directions are indexed so neither a new selector nor a changed item scans everything:
//! a selector's necessary condition (`label == v`, `label in {…}` or `has(label)` from its
//! top-level conjunction, the most selective one) picks candidate items from a (label, value)
//! index, and a changed item picks candidate selectors from the reverse index; selectors with
//! no such condition are checked against every item.

use std::collections::BTreeMap;
use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::selector::{Labels, Node, Selector};

pub type ItemId = u32;
pub type SelectorId = u32;
type Sym = Arc<str>;

/// What an item is: policy selectors only match endpoints; IP-set selectors match both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemClass {
    Endpoint,
    NetworkSet,
}

/// A selector started or stopped matching an item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatchEvent {
    pub selector: SelectorId,
    pub item: ItemId,
    pub matched: bool,
}

/// Effective labels, sorted by key, for evaluation without allocation.
struct Effective<'a>(&'a [(Sym, Sym)]);

impl Labels for Effective<'_> {
    fn get_label(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()
            .map(|i| &*self.0[i].1)
    }
}

struct Item {
    class: ItemClass,
    own: Vec<(Sym, Sym)>,
    parents: Vec<Sym>,
    effective: Vec<(Sym, Sym)>,
    matched: FxHashSet<SelectorId>,
}

#[derive(Default)]
struct Parent {
    labels: Vec<(Sym, Sym)>,
    children: FxHashSet<ItemId>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Restriction {
    /// Matches only items with one of these (label, value) pairs.
    AnyOf(Vec<(Sym, Sym)>),
    /// Matches only items that have this label.
    HasKey(Sym),
    None,
}

struct SelEntry {
    sel: Selector,
    endpoints_only: bool,
    restriction: Restriction,
    matches: FxHashSet<ItemId>,
}

/// Sizes of the index, and how many selector evaluations it has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub items: usize,
    pub selectors: usize,
    pub unrestricted_selectors: usize,
    pub key_restricted_selectors: usize,
    pub evaluations: u64,
}

/// See the module documentation.
#[derive(Default)]
pub struct LabelIndex {
    evaluations: u64,
    items: FxHashMap<ItemId, Item>,
    parents: FxHashMap<Sym, Parent>,
    selectors: FxHashMap<SelectorId, SelEntry>,
    items_by_kv: FxHashMap<(Sym, Sym), FxHashSet<ItemId>>,
    items_by_key: FxHashMap<Sym, FxHashSet<ItemId>>,
    sels_by_kv: FxHashMap<(Sym, Sym), FxHashSet<SelectorId>>,
    sels_by_key: FxHashMap<Sym, FxHashSet<SelectorId>>,
    unrestricted: FxHashSet<SelectorId>,
    interned: FxHashSet<Sym>,
    /// Interned strings after the last clean-up (see `collect_garbage`).
    interned_after_gc: usize,
    events: Vec<MatchEvent>,
}

impl LabelIndex {
    pub fn new() -> LabelIndex {
        LabelIndex::default()
    }

    fn intern(&mut self, s: &str) -> Sym {
        if let Some(x) = self.interned.get(s) {
            return x.clone();
        }
        let x: Sym = Arc::from(s);
        self.interned.insert(x.clone());
        x
    }

    /// Forgets interned label strings nothing uses any more, once the table has doubled since
    /// the last clean-up: labels with unique values (pod hashes, job ids) must not make the
    /// index grow for ever. Cheap to call often.
    pub fn collect_garbage(&mut self) {
        if self.interned.len() <= 2 * self.interned_after_gc + 1024 {
            return;
        }
        self.interned.retain(|s| Arc::strong_count(s) > 1);
        self.interned_after_gc = self.interned.len();
    }

    /// Drains the match events produced since the last call, in the order they happened.
    pub fn take_events(&mut self) -> Vec<MatchEvent> {
        std::mem::take(&mut self.events)
    }

    /// The items a selector currently matches.
    pub fn matches(&self, sel: SelectorId) -> impl Iterator<Item = ItemId> + '_ {
        self.selectors
            .get(&sel)
            .into_iter()
            .flat_map(|e| e.matches.iter().copied())
    }

    /// Number of items a selector currently matches.
    pub fn match_count(&self, sel: SelectorId) -> usize {
        self.selectors.get(&sel).map_or(0, |e| e.matches.len())
    }

    /// Sizes, for metrics and benchmarks.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            items: self.items.len(),
            selectors: self.selectors.len(),
            unrestricted_selectors: self.unrestricted.len(),
            key_restricted_selectors: self.sels_by_key.values().map(|s| s.len()).sum(),
            evaluations: self.evaluations,
        }
    }

    /// An item's effective labels (own, then inherited), for display.
    pub fn effective_labels(&self, item: ItemId) -> Option<BTreeMap<String, String>> {
        self.items.get(&item).map(|i| {
            i.effective
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
    }

    /// Picks the selector's most selective necessary condition. With items indexed, the
    /// smallest candidate set wins; before that (a snapshot usually brings policies before
    /// endpoints), a static ranking: namespace equality, other equality, `in`, namespace- or
    /// service-account-level equality (few distinct values), then `has()`.
    fn restriction_of(&mut self, node: &Node) -> Restriction {
        fn conjuncts<'n>(n: &'n Node, out: &mut Vec<&'n Node>) {
            match n {
                Node::And(children) => children.iter().for_each(|c| conjuncts(c, out)),
                other => out.push(other),
            }
        }
        let mut terms = Vec::new();
        conjuncts(node, &mut terms);
        let data_driven = self.items.len() >= 100;
        let mut best: Option<((usize, usize), Restriction)> = None;
        for t in terms {
            let (r, class) = match t {
                Node::Eq { label, value } => {
                    let class = if label == crate::model::LABEL_NAMESPACE {
                        0
                    } else if label.starts_with("pcns.") || label.starts_with("pcsa.") {
                        3
                    } else {
                        1
                    };
                    (
                        Restriction::AnyOf(vec![(self.intern(label), self.intern(value))]),
                        class,
                    )
                }
                Node::In { label, values } => {
                    let l = self.intern(label);
                    let kvs = values
                        .as_slice()
                        .iter()
                        .map(|v| (l.clone(), self.intern(v)))
                        .collect();
                    (Restriction::AnyOf(kvs), 2)
                }
                Node::Has { label } => (Restriction::HasKey(self.intern(label)), 4),
                _ => continue,
            };
            let size = match &r {
                Restriction::AnyOf(kvs) => kvs
                    .iter()
                    .map(|kv| self.items_by_kv.get(kv).map_or(0, |s| s.len()))
                    .sum(),
                Restriction::HasKey(k) => self.items_by_key.get(k).map_or(0, |s| s.len()),
                Restriction::None => usize::MAX,
            };
            let score = if data_driven {
                (size, class)
            } else {
                (class, size)
            };
            if best.as_ref().is_none_or(|(b, _)| score < *b) {
                best = Some((score, r));
            }
        }
        best.map_or(Restriction::None, |(_, r)| r)
    }

    /// Registers a selector and computes its matches (emitting a match event for each).
    /// Re-registering an id replaces the previous selector.
    pub fn add_selector(&mut self, id: SelectorId, sel: Selector, endpoints_only: bool) {
        if self.selectors.contains_key(&id) {
            self.remove_selector(id);
        }
        let restriction = self.restriction_of(sel.root());
        let candidates: Vec<ItemId> = match &restriction {
            Restriction::AnyOf(kvs) => {
                for kv in kvs {
                    self.sels_by_kv.entry(kv.clone()).or_default().insert(id);
                }
                let mut c: FxHashSet<ItemId> = FxHashSet::default();
                for kv in kvs {
                    if let Some(s) = self.items_by_kv.get(kv) {
                        c.extend(s.iter().copied());
                    }
                }
                c.into_iter().collect()
            }
            Restriction::HasKey(k) => {
                self.sels_by_key.entry(k.clone()).or_default().insert(id);
                self.items_by_key
                    .get(k)
                    .map(|s| s.iter().copied().collect())
                    .unwrap_or_default()
            }
            Restriction::None => {
                self.unrestricted.insert(id);
                self.items.keys().copied().collect()
            }
        };
        let mut matches = FxHashSet::default();
        for item_id in candidates {
            let item = self.items.get_mut(&item_id).expect("indexed item exists");
            self.evaluations += 1;
            if (!endpoints_only || item.class == ItemClass::Endpoint)
                && sel.evaluate(&Effective(&item.effective))
            {
                item.matched.insert(id);
                matches.insert(item_id);
                self.events.push(MatchEvent {
                    selector: id,
                    item: item_id,
                    matched: true,
                });
            }
        }
        self.selectors.insert(
            id,
            SelEntry {
                sel,
                endpoints_only,
                restriction,
                matches,
            },
        );
    }

    /// Unregisters a selector, emitting an unmatch event for each item it matched.
    pub fn remove_selector(&mut self, id: SelectorId) {
        let Some(entry) = self.selectors.remove(&id) else {
            return;
        };
        match &entry.restriction {
            Restriction::AnyOf(kvs) => {
                for kv in kvs {
                    remove_from(&mut self.sels_by_kv, kv, id);
                }
            }
            Restriction::HasKey(k) => remove_from(&mut self.sels_by_key, k, id),
            Restriction::None => {
                self.unrestricted.remove(&id);
            }
        }
        let mut items: Vec<ItemId> = entry.matches.into_iter().collect();
        items.sort_unstable();
        for item_id in items {
            if let Some(item) = self.items.get_mut(&item_id) {
                item.matched.remove(&id);
            }
            self.events.push(MatchEvent {
                selector: id,
                item: item_id,
                matched: false,
            });
        }
    }

    fn effective_of(&self, own: &[(Sym, Sym)], parents: &[Sym]) -> Vec<(Sym, Sym)> {
        if parents.is_empty() {
            return own.to_vec();
        }
        let mut m: BTreeMap<Sym, Sym> = own.iter().cloned().collect();
        for p in parents {
            if let Some(parent) = self.parents.get(p) {
                for (k, v) in &parent.labels {
                    m.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
        }
        m.into_iter().collect()
    }

    fn unindex_labels(&mut self, id: ItemId, labels: &[(Sym, Sym)]) {
        for (k, v) in labels {
            remove_from(&mut self.items_by_kv, &(k.clone(), v.clone()), id);
            remove_from(&mut self.items_by_key, k, id);
        }
    }

    fn index_labels(&mut self, id: ItemId, labels: &[(Sym, Sym)]) {
        for (k, v) in labels {
            self.items_by_kv
                .entry((k.clone(), v.clone()))
                .or_default()
                .insert(id);
            self.items_by_key.entry(k.clone()).or_default().insert(id);
        }
    }

    /// Adds or replaces an item with its own labels and its parents (in priority order).
    pub fn set_item(
        &mut self,
        id: ItemId,
        class: ItemClass,
        labels: &BTreeMap<String, String>,
        parents: &[String],
    ) {
        let own: Vec<(Sym, Sym)> = labels
            .iter()
            .map(|(k, v)| (self.intern(k), self.intern(v)))
            .collect();
        let parents: Vec<Sym> = parents.iter().map(|p| self.intern(p)).collect();
        if let Some(old) = self.items.get(&id) {
            let old_parents = old.parents.clone();
            for p in &old_parents {
                if let Some(parent) = self.parents.get_mut(p) {
                    parent.children.remove(&id);
                    if parent.children.is_empty()
                        && parent.labels.is_empty()
                        && !parents.contains(p)
                    {
                        self.parents.remove(p);
                    }
                }
            }
        }
        for p in &parents {
            self.parents
                .entry(p.clone())
                .or_default()
                .children
                .insert(id);
        }
        self.parents
            .retain(|_, p| !p.children.is_empty() || !p.labels.is_empty());
        let effective = self.effective_of(&own, &parents);
        match self.items.get_mut(&id) {
            Some(item) => {
                item.own = own;
                item.parents = parents;
                item.class = class;
                self.update_effective(id, effective, true);
            }
            None => {
                self.items.insert(
                    id,
                    Item {
                        class,
                        own,
                        parents,
                        effective: Vec::new(),
                        matched: FxHashSet::default(),
                    },
                );
                self.update_effective(id, effective, true);
            }
        }
    }

    /// Installs new effective labels for an item and re-evaluates the selectors that could
    /// change their verdict.
    fn update_effective(&mut self, id: ItemId, effective: Vec<(Sym, Sym)>, force: bool) {
        let item = self.items.get_mut(&id).expect("item exists");
        if !force && item.effective == effective {
            return;
        }
        let old = std::mem::replace(&mut item.effective, effective.clone());
        self.unindex_labels(id, &old);
        self.index_labels(id, &effective);
        let item = self.items.get(&id).expect("item exists");
        let mut candidates: FxHashSet<SelectorId> = item.matched.clone();
        candidates.extend(self.unrestricted.iter().copied());
        for (k, v) in &effective {
            if let Some(s) = self.sels_by_kv.get(&(k.clone(), v.clone())) {
                candidates.extend(s.iter().copied());
            }
            if let Some(s) = self.sels_by_key.get(k) {
                candidates.extend(s.iter().copied());
            }
        }
        let mut candidates: Vec<SelectorId> = candidates.into_iter().collect();
        candidates.sort_unstable();
        let item = self.items.get_mut(&id).expect("item exists");
        for sid in candidates {
            let Some(entry) = self.selectors.get_mut(&sid) else {
                continue;
            };
            self.evaluations += 1;
            let now = (!entry.endpoints_only || item.class == ItemClass::Endpoint)
                && entry.sel.evaluate(&Effective(&item.effective));
            let before = item.matched.contains(&sid);
            if now != before {
                if now {
                    item.matched.insert(sid);
                    entry.matches.insert(id);
                } else {
                    item.matched.remove(&sid);
                    entry.matches.remove(&id);
                }
                self.events.push(MatchEvent {
                    selector: sid,
                    item: id,
                    matched: now,
                });
            }
        }
    }

    /// Removes an item, emitting an unmatch event for each selector that matched it.
    pub fn remove_item(&mut self, id: ItemId) {
        let Some(item) = self.items.remove(&id) else {
            return;
        };
        self.unindex_labels(id, &item.effective);
        for p in &item.parents {
            if let Some(parent) = self.parents.get_mut(p) {
                parent.children.remove(&id);
            }
        }
        self.parents
            .retain(|_, p| !p.children.is_empty() || !p.labels.is_empty());
        let mut matched: Vec<SelectorId> = item.matched.into_iter().collect();
        matched.sort_unstable();
        for sid in matched {
            if let Some(entry) = self.selectors.get_mut(&sid) {
                entry.matches.remove(&id);
            }
            self.events.push(MatchEvent {
                selector: sid,
                item: id,
                matched: false,
            });
        }
    }

    /// Sets the labels a parent (profile) gives its children; empty removes them.
    pub fn set_parent_labels(&mut self, name: &str, labels: &BTreeMap<String, String>) {
        let labels: Vec<(Sym, Sym)> = labels
            .iter()
            .map(|(k, v)| (self.intern(k), self.intern(v)))
            .collect();
        let name = self.intern(name);
        let parent = self.parents.entry(name.clone()).or_default();
        if parent.labels == labels {
            return;
        }
        parent.labels = labels;
        let mut children: Vec<ItemId> = parent.children.iter().copied().collect();
        children.sort_unstable();
        if parent.labels.is_empty() && parent.children.is_empty() {
            self.parents.remove(&name);
        }
        for child in children {
            let item = &self.items[&child];
            let effective = self.effective_of(&item.own, &item.parents);
            self.update_effective(child, effective, false);
        }
    }
}

fn remove_from<K: std::hash::Hash + Eq>(map: &mut FxHashMap<K, FxHashSet<u32>>, key: &K, id: u32) {
    if let Some(set) = map.get_mut(key) {
        set.remove(&id);
        if set.is_empty() {
            map.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::parse;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn matched(ix: &LabelIndex, sel: SelectorId) -> Vec<ItemId> {
        let mut v: Vec<ItemId> = ix.matches(sel).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn selectors_and_items_in_either_order() {
        let mut ix = LabelIndex::new();
        ix.add_selector(1, parse("app == 'web'").unwrap(), false);
        ix.set_item(10, ItemClass::Endpoint, &labels(&[("app", "web")]), &[]);
        ix.set_item(11, ItemClass::Endpoint, &labels(&[("app", "db")]), &[]);
        ix.add_selector(2, parse("has(app)").unwrap(), false);
        ix.add_selector(3, parse("app != 'web'").unwrap(), false);
        assert_eq!(matched(&ix, 1), vec![10]);
        assert_eq!(matched(&ix, 2), vec![10, 11]);
        assert_eq!(matched(&ix, 3), vec![11]);
        // Label flip moves the item between selectors, with events.
        ix.take_events();
        ix.set_item(10, ItemClass::Endpoint, &labels(&[("app", "db")]), &[]);
        let ev = ix.take_events();
        assert!(ev.contains(&MatchEvent {
            selector: 1,
            item: 10,
            matched: false
        }));
        assert!(ev.contains(&MatchEvent {
            selector: 3,
            item: 10,
            matched: true
        }));
        assert_eq!(ev.len(), 2, "has(app) still matches: no event");
        ix.remove_item(11);
        assert_eq!(matched(&ix, 2), vec![10]);
        ix.remove_selector(2);
        assert_eq!(
            ix.take_events().iter().filter(|e| e.selector == 2).count(),
            2
        );
    }

    #[test]
    fn inheritance_own_labels_win_then_parents_in_order() {
        let mut ix = LabelIndex::new();
        ix.set_parent_labels("kns.a", &labels(&[("pcns.team", "x"), ("color", "red")]));
        ix.set_parent_labels("ksa.a.b", &labels(&[("color", "blue"), ("pcsa.role", "r")]));
        ix.add_selector(
            1,
            parse("pcns.team == 'x' && pcsa.role == 'r'").unwrap(),
            false,
        );
        ix.add_selector(2, parse("color == 'red'").unwrap(), false);
        ix.add_selector(3, parse("color == 'green'").unwrap(), false);
        ix.set_item(
            1,
            ItemClass::Endpoint,
            &labels(&[]),
            &["kns.a".into(), "ksa.a.b".into()],
        );
        ix.set_item(
            2,
            ItemClass::Endpoint,
            &labels(&[("color", "green")]),
            &["kns.a".into()],
        );
        assert_eq!(matched(&ix, 1), vec![1]);
        assert_eq!(matched(&ix, 2), vec![1], "first parent wins");
        assert_eq!(matched(&ix, 3), vec![2], "own label wins");
        // A parent's labels change: children re-evaluated.
        ix.set_parent_labels("kns.a", &labels(&[("pcns.team", "y")]));
        assert_eq!(matched(&ix, 1), Vec::<ItemId>::new());
        assert_eq!(
            matched(&ix, 2),
            Vec::<ItemId>::new(),
            "now blue from the second parent"
        );
        // Parent labels defined after the child exists.
        ix.set_parent_labels("late", &labels(&[("color", "red")]));
        ix.set_item(3, ItemClass::Endpoint, &labels(&[]), &["late".into()]);
        assert_eq!(matched(&ix, 2), vec![3]);
    }

    #[test]
    fn unused_interned_strings_are_collected() {
        let mut ix = LabelIndex::new();
        for i in 0..5000u32 {
            ix.set_item(
                1,
                ItemClass::Endpoint,
                &labels(&[("pod-hash", &format!("h{i}"))]),
                &[],
            );
        }
        ix.collect_garbage();
        assert!(
            ix.interned.len() < 10,
            "only live strings stay: {}",
            ix.interned.len()
        );
    }

    #[test]
    fn endpoints_only_selectors_skip_network_sets() {
        let mut ix = LabelIndex::new();
        ix.set_item(1, ItemClass::NetworkSet, &labels(&[("a", "b")]), &[]);
        ix.set_item(2, ItemClass::Endpoint, &labels(&[("a", "b")]), &[]);
        ix.add_selector(1, parse("a == 'b'").unwrap(), true);
        ix.add_selector(2, parse("a == 'b'").unwrap(), false);
        assert_eq!(matched(&ix, 1), vec![2]);
        assert_eq!(matched(&ix, 2), vec![1, 2]);
    }

    #[test]
    fn restrictions_choose_the_smallest_candidate_set() {
        let mut ix = LabelIndex::new();
        for i in 0..10 {
            ix.set_item(
                i,
                ItemClass::Endpoint,
                &labels(&[
                    ("ns", "big"),
                    ("app", if i == 0 { "rare" } else { "common" }),
                ]),
                &[],
            );
        }
        let sel = parse("ns == 'big' && app == 'rare'").unwrap();
        let r = ix.restriction_of(sel.root());
        assert_eq!(
            r,
            Restriction::AnyOf(vec![(Arc::from("app"), Arc::from("rare"))])
        );
        ix.add_selector(7, sel, false);
        assert_eq!(matched(&ix, 7), vec![0]);
        // Unrestricted selectors still see every item.
        ix.add_selector(8, parse("!has(x)").unwrap(), false);
        assert_eq!(ix.match_count(8), 10);
    }
}
