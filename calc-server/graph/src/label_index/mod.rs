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
//!
//! Label keys, values and parent names are interned ([`compiled::Symbols`]) and selectors are
//! compiled to compare symbols ([`compiled::Cond`]), so indexing and evaluation compare and hash
//! integers, not strings.

mod compiled;

use std::collections::BTreeMap;

use roaring::RoaringBitmap;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::selector::{Node, Selector};
use compiled::{Cond, Sym, Symbols};

pub type ItemId = u32;
pub type SelectorId = u32;

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

/// Labels are `(key, value)` symbol pairs sorted by key.
type LabelPairs = Vec<(Sym, Sym)>;

/// Own, parent and effective labels are replaced whole, never grown, so they are boxed slices:
/// 8 bytes less each in every slot of the item table (issue 44).
struct Item {
    class: ItemClass,
    own: Box<[(Sym, Sym)]>,
    parents: Box<[Sym]>,
    effective: Box<[(Sym, Sym)]>,
    /// Sorted: an endpoint matches a few dozen selectors at most.
    matched: Vec<SelectorId>,
}

#[derive(Default)]
struct Parent {
    labels: LabelPairs,
    children: RoaringBitmap,
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
    cond: Cond,
    endpoints_only: bool,
    restriction: Restriction,
    matches: RoaringBitmap,
}

/// Values keyed by small dense ids (the graph hands out item and selector ids from 1 and
/// reuses freed ones), stored in a vector instead of a hash map.
struct Dense<T> {
    slots: Vec<Option<T>>,
    len: usize,
}

impl<T> Default for Dense<T> {
    fn default() -> Self {
        Dense {
            slots: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Dense<T> {
    fn get(&self, id: u32) -> Option<&T> {
        self.slots.get(id as usize)?.as_ref()
    }

    fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        self.slots.get_mut(id as usize)?.as_mut()
    }

    fn insert(&mut self, id: u32, value: T) {
        let i = id as usize;
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        if self.slots[i].replace(value).is_none() {
            self.len += 1;
        }
    }

    fn remove(&mut self, id: u32) -> Option<T> {
        let old = self.slots.get_mut(id as usize)?.take();
        if old.is_some() {
            self.len -= 1;
        }
        old
    }

    fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(i, _)| i as u32)
    }

    fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().flatten()
    }
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
    syms: Symbols,
    items: Dense<Item>,
    parents: FxHashMap<Sym, Parent>,
    selectors: Dense<SelEntry>,
    /// Items by (label, value) and by label: compressed id sets, since every endpoint is in
    /// a dozen of them (and in the `matches` of a few dozen selectors).
    items_by_kv: FxHashMap<(Sym, Sym), RoaringBitmap>,
    items_by_key: FxHashMap<Sym, RoaringBitmap>,
    sels_by_kv: FxHashMap<(Sym, Sym), FxHashSet<SelectorId>>,
    sels_by_key: FxHashMap<Sym, FxHashSet<SelectorId>>,
    unrestricted: FxHashSet<SelectorId>,
    events: Vec<MatchEvent>,
}

impl LabelIndex {
    pub fn new() -> LabelIndex {
        LabelIndex::default()
    }

    fn intern_labels(&mut self, labels: &BTreeMap<String, String>) -> LabelPairs {
        let mut v: LabelPairs = labels
            .iter()
            .map(|(k, v)| (self.syms.intern(k), self.syms.intern(v)))
            .collect();
        v.sort_unstable_by_key(|(k, _)| *k);
        v
    }

    /// Forgets interned label strings nothing uses any more, once the table has doubled since
    /// the last clean-up: labels with unique values (pod hashes, job ids) must not make the
    /// index grow for ever. Cheap to call often.
    pub fn collect_garbage(&mut self) {
        if !self.syms.wants_sweep() {
            return;
        }
        let mut live = vec![false; self.syms.capacity()];
        let mut mark = |s: Sym| live[s as usize] = true;
        for item in self.items.values() {
            for (k, v) in item.own.iter().chain(&item.effective) {
                mark(*k);
                mark(*v);
            }
            item.parents.iter().for_each(|p| mark(*p));
        }
        for (name, parent) in &self.parents {
            mark(*name);
            for (k, v) in &parent.labels {
                mark(*k);
                mark(*v);
            }
        }
        for sel in self.selectors.values() {
            sel.cond.for_each_sym(&mut mark);
            match &sel.restriction {
                Restriction::AnyOf(kvs) => kvs.iter().for_each(|(k, v)| {
                    mark(*k);
                    mark(*v)
                }),
                Restriction::HasKey(k) => mark(*k),
                Restriction::None => {}
            }
        }
        self.syms.sweep(&live);
    }

    /// Drains the match events produced since the last call, in the order they happened.
    pub fn take_events(&mut self) -> Vec<MatchEvent> {
        std::mem::take(&mut self.events)
    }

    /// The items a selector currently matches.
    pub fn matches(&self, sel: SelectorId) -> impl Iterator<Item = ItemId> + '_ {
        self.selectors
            .get(sel)
            .into_iter()
            .flat_map(|e| e.matches.iter())
    }

    /// Number of items a selector currently matches.
    pub fn match_count(&self, sel: SelectorId) -> usize {
        self.selectors
            .get(sel)
            .map_or(0, |e| e.matches.len() as usize)
    }

    /// Sizes, for metrics and benchmarks.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            items: self.items.len,
            selectors: self.selectors.len,
            unrestricted_selectors: self.unrestricted.len(),
            key_restricted_selectors: self.sels_by_key.values().map(|s| s.len()).sum(),
            evaluations: self.evaluations,
        }
    }

    /// An item's effective labels (own, then inherited), for display.
    pub fn effective_labels(&self, item: ItemId) -> Option<BTreeMap<String, String>> {
        self.items.get(item).map(|i| {
            i.effective
                .iter()
                .map(|(k, v)| (self.syms.str(*k).to_string(), self.syms.str(*v).to_string()))
                .collect()
        })
    }

    /// An item's parents (its profiles), in the order [`Self::set_item`] was given them: the
    /// graph keeps an endpoint's profile ids here only.
    pub fn parents(&self, item: ItemId) -> impl Iterator<Item = &str> + '_ {
        self.items
            .get(item)
            .into_iter()
            .flat_map(|i| i.parents.iter())
            .map(|p| self.syms.str(*p))
    }

    /// Whether an item's parents are exactly `parents`, in order.
    pub fn has_parents(&self, item: ItemId, parents: &[String]) -> bool {
        self.items.get(item).is_some_and(|i| {
            i.parents.len() == parents.len()
                && i.parents
                    .iter()
                    .zip(parents)
                    .all(|(s, p)| self.syms.get(p) == Some(*s))
        })
    }

    /// Whether an item's own labels are exactly `labels`.
    pub fn has_own_labels(&self, item: ItemId, labels: &BTreeMap<String, String>) -> bool {
        let Some(item) = self.items.get(item) else {
            return false;
        };
        item.own.len() == labels.len()
            && labels.iter().all(|(k, v)| {
                let (Some(k), Some(v)) = (self.syms.get(k), self.syms.get(v)) else {
                    return false;
                };
                item.own
                    .binary_search_by_key(&k, |(key, _)| *key)
                    .is_ok_and(|i| item.own[i].1 == v)
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
        let data_driven = self.items.len >= 100;
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
                        Restriction::AnyOf(vec![(
                            self.syms.intern(label),
                            self.syms.intern(value),
                        )]),
                        class,
                    )
                }
                Node::In { label, values } => {
                    let l = self.syms.intern(label);
                    let kvs = values
                        .as_slice()
                        .iter()
                        .map(|v| (l, self.syms.intern(v)))
                        .collect();
                    (Restriction::AnyOf(kvs), 2)
                }
                Node::Has { label } => (Restriction::HasKey(self.syms.intern(label)), 4),
                _ => continue,
            };
            let size = match &r {
                Restriction::AnyOf(kvs) => kvs
                    .iter()
                    .map(|kv| self.items_by_kv.get(kv).map_or(0, |s| s.len() as usize))
                    .sum(),
                Restriction::HasKey(k) => self.items_by_key.get(k).map_or(0, |s| s.len() as usize),
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
        if self.selectors.get(id).is_some() {
            self.remove_selector(id);
        }
        let restriction = self.restriction_of(sel.root());
        let cond = Cond::compile(sel.root(), &mut self.syms);
        let mut candidates: Vec<ItemId> = match &restriction {
            Restriction::AnyOf(kvs) => {
                for kv in kvs {
                    self.sels_by_kv.entry(*kv).or_default().insert(id);
                }
                kvs.iter()
                    .filter_map(|kv| self.items_by_kv.get(kv))
                    .flat_map(|s| s.iter())
                    .collect()
            }
            Restriction::HasKey(k) => {
                self.sels_by_key.entry(*k).or_default().insert(id);
                self.items_by_key
                    .get(k)
                    .map(|s| s.iter().collect())
                    .unwrap_or_default()
            }
            Restriction::None => {
                self.unrestricted.insert(id);
                self.items.ids().collect()
            }
        };
        candidates.sort_unstable();
        candidates.dedup();
        let mut matches = RoaringBitmap::new();
        for item_id in candidates {
            let item = self.items.get_mut(item_id).expect("indexed item exists");
            self.evaluations += 1;
            if (!endpoints_only || item.class == ItemClass::Endpoint)
                && cond.evaluate(&item.effective, &self.syms)
            {
                insert_sorted(&mut item.matched, id);
                add(&mut matches, item_id);
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
                cond,
                endpoints_only,
                restriction,
                matches,
            },
        );
    }

    /// Unregisters a selector, emitting an unmatch event for each item it matched.
    pub fn remove_selector(&mut self, id: SelectorId) {
        let Some(entry) = self.selectors.remove(id) else {
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
        // Ascending already.
        let items: Vec<ItemId> = entry.matches.into_iter().collect();
        for item_id in items {
            if let Some(item) = self.items.get_mut(item_id) {
                remove_sorted(&mut item.matched, id);
            }
            self.events.push(MatchEvent {
                selector: id,
                item: item_id,
                matched: false,
            });
        }
    }

    /// Own labels first, then each parent's in order; the first definition of a key wins.
    fn effective_of(&self, own: &[(Sym, Sym)], parents: &[Sym]) -> LabelPairs {
        if parents.is_empty() {
            return own.to_vec();
        }
        // Reserved whole: the result is kept, and growing it by doubling left up to half of it
        // unused (the allocator does not move a block for a shrink of less than half).
        let inherited: usize = parents
            .iter()
            .filter_map(|p| self.parents.get(p))
            .map(|p| p.labels.len())
            .sum();
        let mut v = Vec::with_capacity(own.len() + inherited);
        v.extend_from_slice(own);
        for p in parents {
            if let Some(parent) = self.parents.get(p) {
                v.extend_from_slice(&parent.labels);
            }
        }
        // Stable: of equal keys, the earliest (highest-priority) definition is kept.
        v.sort_by_key(|(k, _)| *k);
        v.dedup_by_key(|(k, _)| *k);
        v
    }

    /// Moves an item's entries in the (label, value) and label indexes from `old` to `new`,
    /// touching only the pairs that differ.
    fn reindex_labels(&mut self, id: ItemId, old: &[(Sym, Sym)], new: &[(Sym, Sym)]) {
        let value_in = |labels: &[(Sym, Sym)], k: Sym| {
            labels
                .binary_search_by_key(&k, |(key, _)| *key)
                .ok()
                .map(|i| labels[i].1)
        };
        for &(k, v) in old {
            match value_in(new, k) {
                Some(nv) if nv == v => {}
                Some(_) => remove_item(&mut self.items_by_kv, &(k, v), id),
                None => {
                    remove_item(&mut self.items_by_kv, &(k, v), id);
                    remove_item(&mut self.items_by_key, &k, id);
                }
            }
        }
        for &(k, v) in new {
            match value_in(old, k) {
                Some(ov) if ov == v => {}
                Some(_) => {
                    add(self.items_by_kv.entry((k, v)).or_default(), id);
                }
                None => {
                    add(self.items_by_kv.entry((k, v)).or_default(), id);
                    add(self.items_by_key.entry(k).or_default(), id);
                }
            }
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
        let own = self.intern_labels(labels);
        let parents: Vec<Sym> = parents.iter().map(|p| self.syms.intern(p)).collect();
        for p in &parents {
            add(&mut self.parents.entry(*p).or_default().children, id);
        }
        let old_parents = match self.items.get_mut(id) {
            Some(old) => std::mem::take(&mut old.parents),
            None => Box::default(),
        };
        for p in old_parents.iter().filter(|p| !parents.contains(p)) {
            if let Some(parent) = self.parents.get_mut(p) {
                parent.children.remove(id);
                if parent.children.is_empty() && parent.labels.is_empty() {
                    self.parents.remove(p);
                }
            }
        }
        let effective = self.effective_of(&own, &parents);
        match self.items.get_mut(id) {
            Some(item) => {
                item.own = own.into();
                item.parents = parents.into();
                item.class = class;
            }
            None => self.items.insert(
                id,
                Item {
                    class,
                    own: own.into(),
                    parents: parents.into(),
                    effective: Box::default(),
                    matched: Vec::new(),
                },
            ),
        }
        self.update_effective(id, effective, true);
    }

    /// Installs new effective labels for an item and re-evaluates the selectors that could
    /// change their verdict.
    fn update_effective(&mut self, id: ItemId, effective: LabelPairs, force: bool) {
        let item = self.items.get_mut(id).expect("item exists");
        if !force && *item.effective == *effective {
            return;
        }
        // The old labels leave the item for the re-indexing; the new ones go in after it.
        let old = std::mem::take(&mut item.effective);
        let mut candidates: Vec<SelectorId> = item.matched.clone();
        self.reindex_labels(id, &old, &effective);
        candidates.extend(self.unrestricted.iter().copied());
        for (k, v) in &effective {
            if let Some(s) = self.sels_by_kv.get(&(*k, *v)) {
                candidates.extend(s.iter().copied());
            }
            if let Some(s) = self.sels_by_key.get(k) {
                candidates.extend(s.iter().copied());
            }
        }
        candidates.sort_unstable();
        candidates.dedup();
        let item = self.items.get_mut(id).expect("item exists");
        item.effective = effective.into();
        for sid in candidates {
            let Some(entry) = self.selectors.get_mut(sid) else {
                continue;
            };
            self.evaluations += 1;
            let now = (!entry.endpoints_only || item.class == ItemClass::Endpoint)
                && entry.cond.evaluate(&item.effective, &self.syms);
            let before = item.matched.binary_search(&sid).is_ok();
            if now != before {
                if now {
                    insert_sorted(&mut item.matched, sid);
                    add(&mut entry.matches, id);
                } else {
                    remove_sorted(&mut item.matched, sid);
                    entry.matches.remove(id);
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
        let Some(item) = self.items.remove(id) else {
            return;
        };
        self.reindex_labels(id, &item.effective, &[]);
        for p in &item.parents {
            if let Some(parent) = self.parents.get_mut(p) {
                parent.children.remove(id);
                if parent.children.is_empty() && parent.labels.is_empty() {
                    self.parents.remove(p);
                }
            }
        }
        for sid in item.matched {
            if let Some(entry) = self.selectors.get_mut(sid) {
                entry.matches.remove(id);
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
        let labels = self.intern_labels(labels);
        let name = self.syms.intern(name);
        let parent = self.parents.entry(name).or_default();
        if parent.labels == labels {
            if parent.labels.is_empty() && parent.children.is_empty() {
                self.parents.remove(&name);
            }
            return;
        }
        parent.labels = labels;
        // Ascending already.
        let children: Vec<ItemId> = parent.children.iter().collect();
        if parent.labels.is_empty() && parent.children.is_empty() {
            self.parents.remove(&name);
        }
        for child in children {
            let Some(item) = self.items.get(child) else {
                continue;
            };
            let effective = self.effective_of(&item.own, &item.parents);
            self.update_effective(child, effective, false);
        }
    }
}

fn insert_sorted(v: &mut Vec<u32>, x: u32) {
    if let Err(i) = v.binary_search(&x) {
        v.insert(i, x);
    }
}

fn remove_sorted(v: &mut Vec<u32>, x: u32) {
    if let Ok(i) = v.binary_search(&x) {
        v.remove(i);
    }
}

/// Puts `id` in `set`. A plain insert, not `try_push`: ids mostly come in ascending order, so
/// an array container's insert is a short search and no shift, while `try_push` on a bitmap
/// container (a set past 4,096 members) first finds its maximum by scanning its 1,024 words from
/// the top, over a thousand instructions per id for a label every endpoint carries.
fn add(set: &mut RoaringBitmap, id: u32) {
    set.insert(id);
}

/// Takes `id` out of the item set at `key`, dropping the set once empty.
fn remove_item<K: std::hash::Hash + Eq>(map: &mut FxHashMap<K, RoaringBitmap>, key: &K, id: u32) {
    if let Some(set) = map.get_mut(key) {
        set.remove(id);
        if set.is_empty() {
            map.remove(key);
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
            ix.syms.len() < 10,
            "only live strings stay: {}",
            ix.syms.len()
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
        let (app, rare) = (ix.syms.get("app").unwrap(), ix.syms.get("rare").unwrap());
        assert_eq!(r, Restriction::AnyOf(vec![(app, rare)]));
        ix.add_selector(7, sel, false);
        assert_eq!(matched(&ix, 7), vec![0]);
        // Unrestricted selectors still see every item.
        ix.add_selector(8, parse("!has(x)").unwrap(), false);
        assert_eq!(ix.match_count(8), 10);
    }
}
