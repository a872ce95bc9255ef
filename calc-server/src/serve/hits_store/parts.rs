//! The hit counters as parts, for a store whose values are bounded (an etcd value): one
//! [`SavedHits`] document per part, each at most [`PART_BYTES`], named for what it holds so that
//! a change rewrites only the parts it touched.
//!
//! Contract:
//! - [`split`] groups the counts by node (`counts/<node>/<i>`; the folded departed nodes are
//!   `departed/<i>`) and the observations by a stable hash of their owner into
//!   [`SEEN_BUCKETS`] groups (`seen/<bucket>/<i>`), then cuts each group into parts in order.
//!   Equal state gives equal parts, byte for byte. Node names in part names are escaped (`%`,
//!   `/`) as in Calico's etcd keys.
//! - [`join`] reads parts back, each checked as a whole document ([`super::file::parse`]): a
//!   part that is refused is named with its reason and left out (and not counted as known, so
//!   a save never deletes it), the others are kept, up to [`PARTS_MAX_BYTES`] in all. Parts
//!   are written one by one, so after a crash a group may hold an entry twice (an old part not
//!   yet deleted): the same rule on the same node, or the same owner, is kept once, with the
//!   larger count (counters only grow).

use std::collections::{BTreeMap, HashMap};

use crate::serve::engine::{SAVED_VERSION, SavedCount, SavedHits, SavedSeen};

/// Largest part written: below etcd's default request limit (1.5 MiB) with room for a few
/// parts in one transaction.
pub(crate) const PART_BYTES: usize = 256 << 10;

/// Most bytes of parts read in all (a hostile or runaway store cannot take the memory).
pub(crate) const PARTS_MAX_BYTES: u64 = 1 << 30;

/// How many groups the observations are spread over.
pub(crate) const SEEN_BUCKETS: u64 = 16;

/// `%` → `%25`, `/` → `%2f`.
fn escape(node: &str) -> String {
    node.replace('%', "%25").replace('/', "%2f")
}

/// The group (part name prefix, without the trailing `/`) of `node`'s counts.
pub(crate) fn node_group(node: &str) -> String {
    format!("counts/{}", escape(node))
}

/// FNV-1a of `bytes`: stable across builds and platforms (the std hasher is not), so equal
/// names hash alike in every replica and release. Bucket and object names are made with it.
pub(crate) fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The observation bucket of an owner (its JSON).
fn bucket(bytes: &[u8]) -> u64 {
    stable_hash(bytes) % SEEN_BUCKETS
}

/// Cuts `items` (already JSON) into documents of at most [`PART_BYTES`], named `group/<i>`;
/// `field` is the list they go in (`counts` or `seen`).
fn cut(group: &str, field: &str, items: &[String], out: &mut BTreeMap<String, Vec<u8>>) {
    let (head, tail) = match field {
        "counts" => (
            format!("{{\"version\":{SAVED_VERSION},\"counts\":["),
            "],\"seen\":[]}",
        ),
        _ => (
            format!("{{\"version\":{SAVED_VERSION},\"counts\":[],\"seen\":["),
            "]}",
        ),
    };
    let mut part = String::new();
    let mut index = 0;
    let mut flush = |part: &mut String, index: &mut usize| {
        if part.is_empty() {
            return;
        }
        let body = format!("{head}{part}{tail}");
        out.insert(format!("{group}/{index}"), body.into_bytes());
        part.clear();
        *index += 1;
    };
    for item in items {
        if !part.is_empty() && head.len() + part.len() + 1 + item.len() + tail.len() > PART_BYTES {
            flush(&mut part, &mut index);
        }
        if !part.is_empty() {
            part.push(',');
        }
        part.push_str(item);
    }
    flush(&mut part, &mut index);
}

/// `doc` as named parts (see the module documentation).
pub(crate) fn split(doc: &SavedHits) -> BTreeMap<String, Vec<u8>> {
    let mut by_node: BTreeMap<Option<&str>, Vec<String>> = BTreeMap::new();
    for c in &doc.counts {
        let json = serde_json::to_string(c).expect("plain data serializes");
        by_node.entry(c.node.as_deref()).or_default().push(json);
    }
    let mut by_bucket: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for s in &doc.seen {
        let owner = serde_json::to_vec(&s.owner).expect("plain data serializes");
        let json = serde_json::to_string(s).expect("plain data serializes");
        by_bucket.entry(bucket(&owner)).or_default().push(json);
    }
    let mut out = BTreeMap::new();
    for (node, items) in &by_node {
        let group = match node {
            Some(n) => node_group(n),
            None => "departed".to_string(),
        };
        cut(&group, "counts", items, &mut out);
    }
    for (b, items) in &by_bucket {
        cut(&format!("seen/{b:x}"), "seen", items, &mut out);
    }
    out
}

/// What brings a store that holds `known` to `now`: a put for each part whose bytes differ,
/// a delete (`None`) for each known part that `now` no longer has. Parts the store may hold
/// but that are not `known` (another replica's, or refused when read) are left alone, and so
/// are the parts of the nodes in `skip` (their saved counts are not merged here yet).
pub(crate) fn changes(
    known: &BTreeMap<String, Vec<u8>>,
    now: &BTreeMap<String, Vec<u8>>,
    skip: &[String],
) -> Vec<(String, Option<Vec<u8>>)> {
    let skipped: Vec<String> = skip.iter().map(|n| format!("{}/", node_group(n))).collect();
    let free = |name: &str| !skipped.iter().any(|g| name.starts_with(g.as_str()));
    let mut ops: Vec<(String, Option<Vec<u8>>)> = now
        .iter()
        .filter(|(name, body)| free(name) && known.get(*name) != Some(*body))
        .map(|(name, body)| (name.clone(), Some(body.clone())))
        .collect();
    ops.extend(
        known
            .keys()
            .filter(|name| free(name) && !now.contains_key(*name))
            .map(|name| (name.clone(), None)),
    );
    ops
}

/// What [`join`] read: the document, one line per part left out, and the names of the parts
/// taken (the only ones a save may then replace or delete).
#[derive(Debug)]
pub(crate) struct Joined {
    pub doc: SavedHits,
    pub problems: Vec<String>,
    pub taken: Vec<String>,
}

/// Reads `found` (every part, or with `group` only the parts of that group) into `known`:
/// the parts taken replace what was known of them (of that group, or all); those left out are
/// logged and forgotten, so that no save replaces or deletes them. Returns the document.
pub(crate) fn absorb(
    known: &mut BTreeMap<String, Vec<u8>>,
    found: BTreeMap<String, Vec<u8>>,
    group: Option<&str>,
) -> SavedHits {
    let inside = |name: &str| group.is_none_or(|g| name.starts_with(&format!("{g}/")));
    let joined = join(
        found
            .iter()
            .filter(|(name, _)| inside(name))
            .map(|(k, v)| (k.as_str(), v.as_slice())),
    );
    for problem in &joined.problems {
        tracing::warn!(%problem, "a part of the saved policy hit counters is left out");
    }
    known.retain(|name, _| !inside(name));
    let taken: std::collections::BTreeSet<&String> = joined.taken.iter().collect();
    known.extend(found.into_iter().filter(|(name, _)| taken.contains(name)));
    joined.doc
}

/// The document the parts hold together (see the module documentation).
pub(crate) fn join<'a>(parts: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Joined {
    let mut problems = Vec::new();
    let mut taken = Vec::new();
    let mut counts: HashMap<String, SavedCount> = HashMap::new();
    let mut seen: HashMap<String, SavedSeen> = HashMap::new();
    let mut total: u64 = 0;
    for (name, body) in parts {
        total += body.len() as u64;
        if total > PARTS_MAX_BYTES {
            problems.push(format!(
                "part {name:?} and those after it: the parts take more than {PARTS_MAX_BYTES} bytes"
            ));
            break;
        }
        let doc = match super::file::parse(body) {
            Ok(doc) => doc,
            Err(why) => {
                problems.push(format!("part {name:?}: {why}"));
                continue;
            }
        };
        taken.push(name.to_string());
        for c in doc.counts {
            let key = serde_json::to_string(&(&c.owner, &c.node, c.egress, c.index))
                .expect("plain data serializes");
            match counts.get(&key) {
                Some(have) if (have.packets, have.bytes) >= (c.packets, c.bytes) => {}
                _ => {
                    counts.insert(key, c);
                }
            }
        }
        for s in doc.seen {
            let key = serde_json::to_string(&s.owner).expect("plain data serializes");
            let sum = |s: &SavedSeen| s.by_action.iter().map(|(p, _)| *p).sum::<u64>();
            match seen.get(&key) {
                Some(have) if sum(have) >= sum(&s) => {}
                _ => {
                    seen.insert(key, s);
                }
            }
        }
    }
    let mut counts: Vec<(String, SavedCount)> = counts.into_iter().collect();
    counts.sort_by(|a, b| a.0.cmp(&b.0));
    let mut seen: Vec<(String, SavedSeen)> = seen.into_iter().collect();
    seen.sort_by(|a, b| a.0.cmp(&b.0));
    Joined {
        doc: SavedHits {
            version: SAVED_VERSION,
            counts: counts.into_iter().map(|(_, c)| c).collect(),
            seen: seen.into_iter().map(|(_, s)| s).collect(),
        },
        problems,
        taken,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(nodes: usize, rules: u32) -> SavedHits {
        let mut counts = Vec::new();
        let mut seen = Vec::new();
        for n in 0..nodes {
            for i in 0..rules {
                counts.push(
                    serde_json::from_value(serde_json::json!({
                        "owner": {"policy": {"kind": "NetworkPolicy", "namespace": "shop",
                                             "name": format!("web-{i}")}},
                        "node": if n == 0 { None } else { Some(format!("node-{n}")) },
                        "egress": false, "index": 0,
                        "packets": 3 + u64::from(i), "bytes": 300, "first_ms": 1000,
                        "last_ms": 2000
                    }))
                    .unwrap(),
                );
            }
        }
        for i in 0..rules {
            seen.push(
                serde_json::from_value(serde_json::json!({
                    "owner": {"policy": {"kind": "NetworkPolicy", "namespace": "shop",
                                         "name": format!("web-{i}")}},
                    "ingress_since_ms": [500], "egress_since_ms": [],
                    "by_action": [[1, 2], [0, 0], [0, 0], [0, 0]]
                }))
                .unwrap(),
            );
        }
        SavedHits {
            version: SAVED_VERSION,
            counts,
            seen,
        }
    }

    fn sorted(mut d: SavedHits) -> SavedHits {
        let key = |c: &SavedCount| serde_json::to_string(&(&c.owner, &c.node, c.egress, c.index));
        d.counts.sort_by_key(|c| key(c).unwrap());
        d.seen
            .sort_by_key(|s| serde_json::to_string(&s.owner).unwrap());
        d
    }

    /// Parts are bounded, named by node and bucket, and join back to the same document.
    #[test]
    fn parts_are_bounded_and_join_back() {
        let d = doc(3, 2_000);
        let parts = split(&d);
        assert!(parts.values().all(|p| p.len() <= PART_BYTES));
        assert!(parts.contains_key("departed/0"));
        assert!(parts.contains_key("counts/node-1/0"));
        assert!(
            parts.contains_key("counts/node-1/1"),
            "2,000 counts of a node take more than one part"
        );
        assert!(parts.keys().any(|k| k.starts_with("seen/")));
        let joined = join(parts.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
        assert!(joined.problems.is_empty(), "{:?}", joined.problems);
        assert_eq!(joined.taken.len(), parts.len());
        assert_eq!(sorted(joined.doc), sorted(d.clone()));
        assert_eq!(split(&d), parts, "equal state, equal parts");
    }

    /// One node's new counts rewrite that node's parts only; a node folded into the departed
    /// ones deletes its parts; parts nobody here knew of are left alone.
    #[test]
    fn a_change_on_one_node_touches_its_parts_only() {
        let d = doc(3, 10);
        let mut changed = d.clone();
        for c in changed.counts.iter_mut() {
            if c.node.as_deref() == Some("node-2") {
                c.packets += 1;
            }
        }
        let (a, b) = (split(&d), split(&changed));
        let names = |ops: Vec<(String, Option<Vec<u8>>)>| -> Vec<(String, bool)> {
            ops.into_iter().map(|(n, b)| (n, b.is_some())).collect()
        };
        assert_eq!(
            names(changes(&a, &b, &[])),
            [("counts/node-2/0".into(), true)]
        );
        assert!(changes(&b, &b, &[]).is_empty());
        assert!(
            changes(&a, &b, &["node-2".into()]).is_empty(),
            "an unverified node's parts are left alone"
        );
        let mut folded = changed.clone();
        for c in folded.counts.iter_mut() {
            if c.node.as_deref() == Some("node-2") {
                c.node = None;
                c.index = 1;
            }
        }
        let mut known = b.clone();
        known.remove("counts/node-1/0");
        assert_eq!(
            names(changes(&known, &split(&folded), &[])),
            [
                ("counts/node-1/0".into(), true),
                ("departed/0".into(), true),
                ("counts/node-2/0".into(), false)
            ]
        );
    }

    /// A damaged part is named and left out; an entry found twice (an old part a crash left
    /// behind) is kept once, with the larger count; a hostile node name stays in its segment.
    #[test]
    fn damaged_parts_and_duplicates() {
        let d = doc(2, 3);
        let mut parts = split(&d);
        let old = parts["counts/node-1/0"].clone();
        let newer = String::from_utf8(old.clone())
            .unwrap()
            .replace("\"packets\":3,", "\"packets\":30,");
        parts.insert("counts/node-1/0".into(), newer.into_bytes());
        parts.insert("counts/node-1/1".into(), old);
        parts.insert("seen/0/7".into(), b"{broken".to_vec());
        let joined = join(parts.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
        let (back, problems) = (joined.doc, joined.problems);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("part \"seen/0/7\": not a hit counters document"),
            "{problems:?}"
        );
        // The refused part is not known: a save neither replaces nor deletes it.
        let mut known = BTreeMap::new();
        absorb(&mut known, parts.clone(), None);
        assert!(!known.contains_key("seen/0/7"));
        assert_eq!(known.len(), parts.len() - 1);
        assert!(
            changes(&known, &BTreeMap::new(), &[])
                .iter()
                .all(|(name, _)| name != "seen/0/7")
        );
        assert_eq!(back.counts.len(), d.counts.len());
        let web0 = back
            .counts
            .iter()
            .filter(|c| c.node.as_deref() == Some("node-1") && c.packets >= 3)
            .map(|c| c.packets)
            .max();
        assert_eq!(web0, Some(30));
        let mut odd = doc(2, 1);
        odd.counts[1].node = Some("a/b%c".into());
        assert!(split(&odd).contains_key("counts/a%2fb%25c/0"));
    }
}
