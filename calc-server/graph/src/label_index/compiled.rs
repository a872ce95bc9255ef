//! Interned label strings and selectors compiled against them.
//!
//! Contract: [`Symbols`] gives every label key, value and parent name the index holds a small
//! integer, so effective labels are sorted `(key, value)` integer pairs and a [`Cond`] compares
//! integers instead of strings. Equal strings always get the same symbol while both are alive;
//! a symbol is only reused after [`Symbols::sweep`] found nothing referring to it. [`Cond`]
//! evaluates exactly as the [`Node`] it was compiled from.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::selector::Node;

pub(super) type Sym = u32;

#[derive(Default)]
pub(super) struct Symbols {
    strings: Vec<Arc<str>>,
    ids: FxHashMap<Arc<str>, Sym>,
    free: Vec<Sym>,
    /// Live symbols after the last sweep (see [`Symbols::wants_sweep`]).
    after_sweep: usize,
}

impl Symbols {
    pub(super) fn intern(&mut self, s: &str) -> Sym {
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let text: Arc<str> = Arc::from(s);
        let id = match self.free.pop() {
            Some(id) => {
                self.strings[id as usize] = text.clone();
                id
            }
            None => {
                self.strings.push(text.clone());
                Sym::try_from(self.strings.len() - 1).expect("fewer than 2^32 label strings")
            }
        };
        self.ids.insert(text, id);
        id
    }

    /// The symbol of `s`, if interned.
    pub(super) fn get(&self, s: &str) -> Option<Sym> {
        self.ids.get(s).copied()
    }

    pub(super) fn str(&self, id: Sym) -> &str {
        &self.strings[id as usize]
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the table has doubled since the last sweep: labels with unique values (pod
    /// hashes, job ids) must not make the index grow for ever.
    pub(super) fn wants_sweep(&self) -> bool {
        self.ids.len() > 2 * self.after_sweep + 1024
    }

    /// Frees every symbol `live` does not mark (`live[id]`), for reuse.
    pub(super) fn sweep(&mut self, live: &[bool]) {
        let empty: Arc<str> = Arc::from("");
        for (id, s) in self.strings.iter_mut().enumerate() {
            let id = id as Sym;
            // A slot freed earlier holds "" and is not in `ids` under its own number: it is
            // neither freed twice nor allowed to unmap a live "".
            if !live.get(id as usize).copied().unwrap_or(false) && self.ids.get(&**s) == Some(&id) {
                self.ids.remove(&**s);
                *s = empty.clone();
                self.free.push(id);
            }
        }
        self.after_sweep = self.ids.len();
    }

    /// One more than the highest symbol ever given out (the size of a mark table).
    pub(super) fn capacity(&self) -> usize {
        self.strings.len()
    }
}

/// A selector over interned labels: the same tree as [`Node`], with symbols for labels and for
/// the values compared for equality.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Cond {
    Eq(Sym, Sym),
    Ne(Sym, Sym),
    Contains(Sym, Box<str>),
    StartsWith(Sym, Box<str>),
    EndsWith(Sym, Box<str>),
    /// Sorted symbols.
    In(Sym, Box<[Sym]>),
    NotIn(Sym, Box<[Sym]>),
    Has(Sym),
    True,
    Not(Box<Cond>),
    And(Box<[Cond]>),
    Or(Box<[Cond]>),
}

impl Cond {
    /// Compiles `node`, interning every label and compared value (so an item that later gets
    /// that value gets the same symbol).
    pub(super) fn compile(node: &Node, syms: &mut Symbols) -> Cond {
        match node {
            Node::Eq { label, value } => Cond::Eq(syms.intern(label), syms.intern(value)),
            Node::Ne { label, value } => Cond::Ne(syms.intern(label), syms.intern(value)),
            Node::Contains { label, value } => {
                Cond::Contains(syms.intern(label), value.as_str().into())
            }
            Node::StartsWith { label, value } => {
                Cond::StartsWith(syms.intern(label), value.as_str().into())
            }
            Node::EndsWith { label, value } => {
                Cond::EndsWith(syms.intern(label), value.as_str().into())
            }
            Node::In { label, values } => {
                Cond::In(syms.intern(label), set(values.as_slice(), syms))
            }
            Node::NotIn { label, values } => {
                Cond::NotIn(syms.intern(label), set(values.as_slice(), syms))
            }
            Node::Has { label } => Cond::Has(syms.intern(label)),
            Node::All | Node::Global => Cond::True,
            Node::Not(n) => Cond::Not(Box::new(Cond::compile(n, syms))),
            Node::And(ns) => Cond::And(ns.iter().map(|n| Cond::compile(n, syms)).collect()),
            Node::Or(ns) => Cond::Or(ns.iter().map(|n| Cond::compile(n, syms)).collect()),
        }
    }

    /// Evaluates against effective labels sorted by key symbol.
    pub(super) fn evaluate(&self, labels: &[(Sym, Sym)], syms: &Symbols) -> bool {
        let get = |k: &Sym| {
            labels
                .binary_search_by_key(k, |(key, _)| *key)
                .ok()
                .map(|i| labels[i].1)
        };
        match self {
            Cond::Eq(k, v) => get(k) == Some(*v),
            Cond::Ne(k, v) => get(k) != Some(*v),
            Cond::Contains(k, s) => get(k).is_some_and(|v| syms.str(v).contains(&**s)),
            Cond::StartsWith(k, s) => get(k).is_some_and(|v| syms.str(v).starts_with(&**s)),
            Cond::EndsWith(k, s) => get(k).is_some_and(|v| syms.str(v).ends_with(&**s)),
            Cond::In(k, vs) => get(k).is_some_and(|v| vs.binary_search(&v).is_ok()),
            Cond::NotIn(k, vs) => get(k).is_none_or(|v| vs.binary_search(&v).is_err()),
            Cond::Has(k) => get(k).is_some(),
            Cond::True => true,
            Cond::Not(c) => !c.evaluate(labels, syms),
            Cond::And(cs) => cs.iter().all(|c| c.evaluate(labels, syms)),
            Cond::Or(cs) => cs.iter().any(|c| c.evaluate(labels, syms)),
        }
    }

    /// Calls `mark` with every symbol the condition holds.
    pub(super) fn for_each_sym(&self, mark: &mut impl FnMut(Sym)) {
        match self {
            Cond::Eq(k, v) | Cond::Ne(k, v) => {
                mark(*k);
                mark(*v);
            }
            Cond::Contains(k, _) | Cond::StartsWith(k, _) | Cond::EndsWith(k, _) | Cond::Has(k) => {
                mark(*k)
            }
            Cond::In(k, vs) | Cond::NotIn(k, vs) => {
                mark(*k);
                vs.iter().for_each(|v| mark(*v));
            }
            Cond::True => {}
            Cond::Not(c) => c.for_each_sym(mark),
            Cond::And(cs) | Cond::Or(cs) => cs.iter().for_each(|c| c.for_each_sym(mark)),
        }
    }
}

fn set(values: &[String], syms: &mut Symbols) -> Box<[Sym]> {
    let mut v: Vec<Sym> = values.iter().map(|s| syms.intern(s)).collect();
    v.sort_unstable();
    v.dedup();
    v.into_boxed_slice()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::{Labels, parse};
    use std::collections::BTreeMap;

    /// Every selector form gives the same verdict compiled as parsed, on label sets that
    /// exercise presence, absence, empty values and substrings.
    #[test]
    fn compiled_selectors_agree_with_the_parsed_ones() {
        let selectors = [
            "a == 'x'",
            "a != 'x'",
            "a contains 'y'",
            "a starts with 'x'",
            "a ends with 'z'",
            "a in {'x', 'xyz', ''}",
            "a not in {'x'}",
            "has(a)",
            "!has(a)",
            "all()",
            "global()",
            "a == 'x' && b == ''",
            "a == 'q' || has(b)",
            "!(a == 'x' || b in {'1'})",
            "a in {}",
            "a not in {}",
            "b == 'never-seen'",
        ];
        let label_sets: [&[(&str, &str)]; 6] = [
            &[],
            &[("a", "x")],
            &[("a", "xyz")],
            &[("a", ""), ("b", "")],
            &[("a", "q"), ("b", "1")],
            &[("b", "x"), ("c", "a")],
        ];
        let mut syms = Symbols::default();
        for text in selectors {
            let sel = parse(text).unwrap();
            let cond = Cond::compile(sel.root(), &mut syms);
            for set in label_sets {
                let map: BTreeMap<String, String> = set
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                let mut interned: Vec<(Sym, Sym)> = set
                    .iter()
                    .map(|(k, v)| (syms.intern(k), syms.intern(v)))
                    .collect();
                interned.sort_unstable();
                assert_eq!(
                    cond.evaluate(&interned, &syms),
                    sel.evaluate(&map),
                    "{text} on {set:?} (map says {:?})",
                    map.get_label("a")
                );
            }
        }
    }

    #[test]
    fn a_second_sweep_neither_frees_a_slot_twice_nor_unmaps_a_live_empty_string() {
        let mut syms = Symbols::default();
        let dead = syms.intern("dead");
        let empty = syms.intern("");
        let mut live = vec![false; syms.capacity()];
        live[empty as usize] = true;
        syms.sweep(&live);
        // The freed slot now holds "", like the live symbol: sweeping again must leave both.
        syms.sweep(&live);
        assert_eq!(syms.get(""), Some(empty), "the live \"\" keeps its symbol");
        let a = syms.intern("a");
        let b = syms.intern("b");
        assert_eq!(a, dead, "the freed number is reused once");
        assert_ne!(a, b, "and only once");
    }

    #[test]
    fn swept_symbols_are_reused_and_live_ones_kept() {
        let mut syms = Symbols::default();
        let a = syms.intern("a");
        let b = syms.intern("b");
        let mut live = vec![false; syms.capacity()];
        live[a as usize] = true;
        syms.sweep(&live);
        assert_eq!(syms.get("b"), None);
        assert_eq!(syms.intern("a"), a, "a live symbol keeps its number");
        assert_eq!(syms.intern("c"), b, "a freed number is reused");
        assert_eq!(syms.str(b), "c");
    }
}
