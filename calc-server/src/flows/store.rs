//! The buckets, the keys they hold, and what was refused.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use felix_proto::goldmane::{self, Flow, FlowKey, PolicyHit, PolicyTrace};

use super::limits::{MAX_HITS, MAX_LABEL, MAX_LABELS, MAX_NAME, MAX_PROTO};

/// Width of a bucket in seconds.
pub const BUCKET_SECONDS: i64 = 15;
/// The fewest buckets a store keeps: 240 of history, the one filling now and one ahead of now
/// (about an hour, as Goldmane).
pub const MIN_BUCKETS: usize = 242;

/// A flow record as the server receives it from an agent after naming: Goldmane's `Flow`. Its
/// `start_time` picks the bucket; its `end_time` is ignored.
pub type FlowRecord = Flow;

/// Why a record was not stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("flow key cap of {cap} reached: record of a new key dropped")]
    KeyCap { cap: usize },
    #[error("start_time {start_time} is before the oldest bucket held ({oldest})")]
    TooOld { start_time: i64, oldest: i64 },
    #[error("start_time {start_time} is after the newest bucket held ({newest})")]
    InFuture { start_time: i64, newest: i64 },
    #[error("invalid record: {field} = {value}: {reason}")]
    Invalid {
        field: &'static str,
        value: String,
        reason: &'static str,
    },
}

/// Records refused, by reason, since the store was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropCounts {
    /// New keys beyond the key cap.
    pub key_cap: u64,
    /// Start time before the oldest bucket held.
    pub too_old: u64,
    /// Start time after the newest bucket held.
    pub in_future: u64,
    /// Failed validation.
    pub invalid: u64,
}

/// A map with a fast keyed hash (foldhash, seeded per process): the store's maps are looked up
/// once or more per record, and SipHash cost more than the rest of an insert.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
/// A set with the same hash.
pub(crate) type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// One side's labels (`key=value`), sorted and without duplicates. Shared: every record and
/// bucket of a key that carries the same set points at one copy.
pub type Labels = Arc<[String]>;

/// Labels in the store's form: sorted, without duplicates.
pub(crate) fn labels(mut l: Vec<String>) -> Labels {
    l.sort_unstable();
    l.dedup();
    l.into()
}

/// The labels both sets hold (a copy only when they differ).
fn intersect(a: &Labels, b: &Labels) -> Labels {
    if Arc::ptr_eq(a, b) || a == b {
        return a.clone();
    }
    a.iter()
        .filter(|l| b.binary_search(l).is_ok())
        .cloned()
        .collect()
}

/// What one record counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub packets_in: i64,
    pub packets_out: i64,
    pub bytes_in: i64,
    pub bytes_out: i64,
    pub started: i64,
    pub completed: i64,
    pub live: i64,
}

impl Tally {
    fn of(r: &Flow) -> Tally {
        Tally {
            packets_in: r.packets_in,
            packets_out: r.packets_out,
            bytes_in: r.bytes_in,
            bytes_out: r.bytes_out,
            started: r.num_connections_started,
            completed: r.num_connections_completed,
            live: r.num_connections_live,
        }
    }

    /// Adds `other`: every counter sums, except the live connections when `live_sums` is
    /// false (then `other`'s, the later, are kept).
    fn add(&mut self, other: &Tally, live_sums: bool) {
        self.packets_in = self.packets_in.saturating_add(other.packets_in);
        self.packets_out = self.packets_out.saturating_add(other.packets_out);
        self.bytes_in = self.bytes_in.saturating_add(other.bytes_in);
        self.bytes_out = self.bytes_out.saturating_add(other.bytes_out);
        self.started = self.started.saturating_add(other.started);
        self.completed = self.completed.saturating_add(other.completed);
        self.live = if live_sums {
            self.live.saturating_add(other.live)
        } else {
            other.live
        };
    }

    /// Takes `other` away (never below zero); whether every counter is then zero.
    fn sub(&mut self, other: &Tally) -> bool {
        for (mine, theirs) in [
            (&mut self.packets_in, other.packets_in),
            (&mut self.packets_out, other.packets_out),
            (&mut self.bytes_in, other.bytes_in),
            (&mut self.bytes_out, other.bytes_out),
            (&mut self.started, other.started),
            (&mut self.completed, other.completed),
            (&mut self.live, other.live),
        ] {
            *mine = mine.saturating_sub(theirs).max(0);
        }
        *self == Tally::default()
    }

    fn validate(&self) -> Result<(), Refused> {
        for (field, v) in [
            ("packets_in", self.packets_in),
            ("packets_out", self.packets_out),
            ("bytes_in", self.bytes_in),
            ("bytes_out", self.bytes_out),
            ("num_connections_started", self.started),
            ("num_connections_completed", self.completed),
            ("num_connections_live", self.live),
        ] {
            if v < 0 {
                return Err(invalid(field, v, "negative"));
            }
        }
        Ok(())
    }
}

/// The counters of one key in one bucket (or, in a query, over several buckets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Counters {
    pub(super) tally: Tally,
    pub(super) source_labels: Labels,
    pub(super) dest_labels: Labels,
}

impl Counters {
    fn new(flow: &PreparedFlow, t: &Tally) -> Self {
        Counters {
            tally: *t,
            source_labels: flow.source_labels.clone(),
            dest_labels: flow.dest_labels.clone(),
        }
    }

    /// Adds a record of the same key in the same bucket: counters sum (live ones too: each
    /// record is one node's), labels intersect.
    fn add_record(&mut self, flow: &PreparedFlow, t: &Tally) {
        self.tally.add(t, true);
        self.source_labels = intersect(&self.source_labels, &flow.source_labels);
        self.dest_labels = intersect(&self.dest_labels, &flow.dest_labels);
    }

    /// Adds `other` (same key): counters sum, labels intersect. `live_sums` false keeps the
    /// later live count instead (adding buckets over time in a query).
    pub(super) fn add(&mut self, other: &Counters, live_sums: bool) {
        self.tally.add(&other.tally, live_sums);
        self.source_labels = intersect(&self.source_labels, &other.source_labels);
        self.dest_labels = intersect(&self.dest_labels, &other.dest_labels);
    }
}

/// A checked flow key with its labels, ready to be stored any number of times: validated and
/// hashed once.
#[derive(Debug)]
pub struct PreparedFlow {
    key: FlowKey,
    /// The key's hash (every field, under the process's seed).
    hash: u64,
    source_labels: Labels,
    dest_labels: Labels,
}

/// The seed every key is hashed with: one per process, so hashes compare across stores.
static KEY_HASH: std::sync::LazyLock<foldhash::fast::RandomState> =
    std::sync::LazyLock::new(foldhash::fast::RandomState::default);

impl PreparedFlow {
    /// Checks a key and its labels (bounds, enum values; see the module doc).
    pub fn new(
        key: FlowKey,
        source_labels: Labels,
        dest_labels: Labels,
    ) -> Result<Arc<PreparedFlow>, Refused> {
        validate_key(&key)?;
        for (field, labels) in [
            ("source_labels", &source_labels),
            ("dest_labels", &dest_labels),
        ] {
            if labels.len() > MAX_LABELS {
                return Err(invalid(field, labels.len(), "too many labels"));
            }
            for l in labels.iter() {
                check_str(field, l, MAX_LABEL)?;
            }
            if !labels.is_sorted_by(|a, b| a < b) {
                return Err(invalid(field, labels.len(), "not sorted"));
            }
        }
        let mut h = KEY_HASH.build_hasher();
        hash_key(&key, &mut h);
        Ok(Arc::new(PreparedFlow {
            hash: h.finish(),
            key,
            source_labels,
            dest_labels,
        }))
    }

    pub fn key(&self) -> &FlowKey {
        &self.key
    }

    /// The source's and the destination's labels.
    pub fn labels(&self) -> (Labels, Labels) {
        (self.source_labels.clone(), self.dest_labels.clone())
    }

    /// The same key: the same allocation, or equal hashes and fields.
    fn same_key(self: &Arc<Self>, other: &Arc<PreparedFlow>) -> bool {
        Arc::ptr_eq(self, other) || (self.hash == other.hash && self.key == other.key)
    }

    /// Its labels, sharing `held`'s allocations where they are equal.
    fn labels_like(&self, held: &PreparedFlow) -> (Labels, Labels) {
        let pick = |mine: &Labels, theirs: &Labels| {
            if mine == theirs {
                theirs.clone()
            } else {
                mine.clone()
            }
        };
        (
            pick(&self.source_labels, &held.source_labels),
            pick(&self.dest_labels, &held.dest_labels),
        )
    }
}

/// Feeds every field of a key to `h`, lists with their lengths (destructured, so that a
/// field added to the proto cannot be left out silently).
fn hash_key(k: &FlowKey, h: &mut impl Hasher) {
    let FlowKey {
        source_name,
        source_namespace,
        source_type,
        dest_name,
        dest_namespace,
        dest_type,
        dest_port,
        dest_service_name,
        dest_service_namespace,
        dest_service_port_name,
        dest_service_port,
        proto,
        reporter,
        action,
        policies,
    } = k;
    for s in [
        source_name,
        source_namespace,
        dest_name,
        dest_namespace,
        dest_service_name,
        dest_service_namespace,
        dest_service_port_name,
        proto,
    ] {
        s.hash(h);
    }
    for v in [*source_type, *dest_type, *reporter, *action] {
        v.hash(h);
    }
    dest_port.hash(h);
    dest_service_port.hash(h);
    match policies {
        None => h.write_u8(0),
        Some(PolicyTrace {
            enforced_policies,
            pending_policies,
        }) => {
            h.write_u8(1);
            for hits in [enforced_policies, pending_policies] {
                h.write_usize(hits.len());
                for hit in hits {
                    hash_hit(hit, h);
                }
            }
        }
    }
}

fn hash_hit(p: &PolicyHit, h: &mut impl Hasher) {
    let PolicyHit {
        kind,
        namespace,
        name,
        tier,
        action,
        policy_index,
        rule_index,
        trigger,
    } = p;
    (
        kind,
        namespace,
        name,
        tier,
        action,
        policy_index,
        rule_index,
    )
        .hash(h);
    match trigger {
        None => h.write_u8(0),
        Some(t) => {
            h.write_u8(1);
            hash_hit(t, h);
        }
    }
}

/// A key held by the store.
pub(super) struct KeyEntry {
    pub(super) id: i64,
    pub(super) flow: Arc<PreparedFlow>,
    /// How many buckets hold a counter set of this key; at zero the key is forgotten.
    buckets: u32,
}

/// Flow records in 15-second buckets, bounded in keys. See the module doc.
pub struct FlowStore {
    max_keys: usize,
    num_buckets: usize,
    /// Key hash → the ids of the keys with that hash (nearly always one).
    ids: FastMap<u64, Vec<i64>>,
    pub(super) keys: FastMap<i64, KeyEntry>,
    /// Bucket start → counters per key id.
    pub(super) buckets: BTreeMap<i64, FastMap<i64, Counters>>,
    next_id: i64,
    drops: DropCounts,
}

/// The start of the bucket holding `t`.
pub(super) fn bucket_start(t: i64) -> i64 {
    t.div_euclid(BUCKET_SECONDS) * BUCKET_SECONDS
}

impl FlowStore {
    /// A store holding at most `max_keys` distinct flow keys, over `num_buckets` buckets (raised
    /// to [`MIN_BUCKETS`] if lower).
    pub fn new(max_keys: usize, num_buckets: usize) -> Self {
        FlowStore {
            max_keys,
            num_buckets: num_buckets.max(MIN_BUCKETS),
            ids: FastMap::default(),
            keys: FastMap::default(),
            buckets: BTreeMap::new(),
            next_id: 1,
            drops: DropCounts::default(),
        }
    }

    pub fn num_buckets(&self) -> usize {
        self.num_buckets
    }

    /// Distinct keys held now.
    pub fn num_keys(&self) -> usize {
        self.keys.len()
    }

    pub fn drops(&self) -> DropCounts {
        self.drops
    }

    /// Start of the newest bucket that accepts records at `now`: one ahead of now's.
    pub fn newest_bucket(now: i64) -> i64 {
        bucket_start(now).saturating_add(BUCKET_SECONDS)
    }

    /// Start of the oldest bucket kept at `now`.
    pub fn oldest_bucket(&self, now: i64) -> i64 {
        let span = (self.num_buckets as i64 - 1).saturating_mul(BUCKET_SECONDS);
        Self::newest_bucket(now).saturating_sub(span)
    }

    /// Drops the buckets older than the window at `now`, and the keys only they held.
    pub fn expire(&mut self, now: i64) {
        let oldest = self.oldest_bucket(now);
        while let Some(entry) = self.buckets.first_entry() {
            if *entry.key() >= oldest {
                break;
            }
            for id in entry.remove().into_keys() {
                let gone = match self.keys.get_mut(&id) {
                    Some(k) => {
                        k.buckets -= 1;
                        k.buckets == 0
                    }
                    None => false,
                };
                if gone && let Some(k) = self.keys.remove(&id) {
                    self.forget_id(k.flow.hash, id);
                }
            }
        }
    }

    /// Stores one record at `now`; a refusal is also counted in [`FlowStore::drops`].
    pub fn insert(&mut self, record: &FlowRecord, now: i64) -> Result<(), Refused> {
        let prepared = match record.key.clone() {
            Some(key) => PreparedFlow::new(
                key,
                labels(record.source_labels.clone()),
                labels(record.dest_labels.clone()),
            ),
            None => Err(invalid("Key", "none", "missing")),
        };
        match prepared {
            Ok(flow) => self.insert_prepared(&flow, &Tally::of(record), record.start_time, now),
            Err(e) => Err(self.refuse(e)),
        }
    }

    /// Stores what one record of `flow` counts in the bucket of `start_time`, at `now`; a
    /// refusal is also counted in [`FlowStore::drops`].
    pub fn insert_prepared(
        &mut self,
        flow: &Arc<PreparedFlow>,
        tally: &Tally,
        start_time: i64,
        now: i64,
    ) -> Result<(), Refused> {
        self.expire(now);
        self.try_insert(flow, tally, start_time, now)
            .map_err(|e| self.refuse(e))
    }

    /// Counts a refusal in [`FlowStore::drops`] (also one decided before the store, such as a
    /// key that failed [`PreparedFlow::new`]).
    pub fn refuse(&mut self, e: Refused) -> Refused {
        let c = match e {
            Refused::KeyCap { .. } => &mut self.drops.key_cap,
            Refused::TooOld { .. } => &mut self.drops.too_old,
            Refused::InFuture { .. } => &mut self.drops.in_future,
            Refused::Invalid { .. } => &mut self.drops.invalid,
        };
        *c += 1;
        e
    }

    fn try_insert(
        &mut self,
        flow: &Arc<PreparedFlow>,
        tally: &Tally,
        start_time: i64,
        now: i64,
    ) -> Result<(), Refused> {
        tally.validate()?;
        let start = bucket_start(start_time);
        let oldest = self.oldest_bucket(now);
        let newest = Self::newest_bucket(now);
        if start < oldest {
            return Err(Refused::TooOld { start_time, oldest });
        }
        if start > newest {
            return Err(Refused::InFuture { start_time, newest });
        }
        let held = self.ids.get(&flow.hash).and_then(|ids| {
            ids.iter()
                .find(|id| self.keys.get(id).is_some_and(|k| k.flow.same_key(flow)))
        });
        let id = match held {
            Some(id) => *id,
            None => {
                if self.keys.len() >= self.max_keys {
                    return Err(Refused::KeyCap { cap: self.max_keys });
                }
                let id = self.next_id;
                self.next_id += 1;
                self.ids.entry(flow.hash).or_default().push(id);
                self.keys.insert(
                    id,
                    KeyEntry {
                        id,
                        flow: flow.clone(),
                        buckets: 0,
                    },
                );
                id
            }
        };
        let bucket = self.buckets.entry(start).or_default();
        match bucket.get_mut(&id) {
            Some(c) => c.add_record(flow, tally),
            None => {
                let mut c = Counters::new(flow, tally);
                if let Some(k) = self.keys.get_mut(&id) {
                    k.buckets += 1;
                    (c.source_labels, c.dest_labels) = flow.labels_like(&k.flow);
                }
                bucket.insert(id, c);
            }
        }
        Ok(())
    }

    /// Takes back what a record of `flow` counted in the bucket of `start_time` (it is to
    /// count under another key); a bucket entry left with nothing is removed, and a key no
    /// bucket holds any more is forgotten. The labels stay as intersected.
    pub fn subtract(&mut self, flow: &Arc<PreparedFlow>, tally: &Tally, start_time: i64) {
        let start = bucket_start(start_time);
        let Some(id) = self.ids.get(&flow.hash).and_then(|ids| {
            ids.iter()
                .copied()
                .find(|id| self.keys.get(id).is_some_and(|k| k.flow.same_key(flow)))
        }) else {
            return;
        };
        let Some(bucket) = self.buckets.get_mut(&start) else {
            return;
        };
        let Some(c) = bucket.get_mut(&id) else {
            return;
        };
        if !c.tally.sub(tally) {
            return;
        }
        bucket.remove(&id);
        if bucket.is_empty() {
            self.buckets.remove(&start);
        }
        let gone = self.keys.get_mut(&id).is_some_and(|k| {
            k.buckets -= 1;
            k.buckets == 0
        });
        if gone && let Some(k) = self.keys.remove(&id) {
            self.forget_id(k.flow.hash, id);
        }
    }

    fn forget_id(&mut self, hash: u64, id: i64) {
        if let Some(ids) = self.ids.get_mut(&hash) {
            ids.retain(|i| *i != id);
            if ids.is_empty() {
                self.ids.remove(&hash);
            }
        }
    }
}

fn invalid(field: &'static str, value: impl ToString, reason: &'static str) -> Refused {
    Refused::Invalid {
        field,
        value: value.to_string(),
        reason,
    }
}

/// Shows at most 64 characters of a value in an error.
pub(super) fn shown(s: &str) -> String {
    if s.chars().count() <= 64 {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(64).collect();
        format!("{head:?}… ({} bytes)", s.len())
    }
}

fn check_str(field: &'static str, s: &str, max: usize) -> Result<(), Refused> {
    if s.len() > max {
        return Err(invalid(field, shown(s), "too long"));
    }
    Ok(())
}

fn check_enum(field: &'static str, v: i32, known: bool) -> Result<(), Refused> {
    if !known {
        return Err(invalid(field, v, "unknown enum value"));
    }
    Ok(())
}

fn check_hit(field: &'static str, h: &PolicyHit, depth: u32) -> Result<(), Refused> {
    check_enum(
        field,
        h.kind,
        goldmane::PolicyKind::try_from(h.kind).is_ok(),
    )?;
    check_enum(
        field,
        h.action,
        goldmane::Action::try_from(h.action).is_ok(),
    )?;
    check_str(field, &h.namespace, MAX_NAME)?;
    check_str(field, &h.name, MAX_NAME)?;
    check_str(field, &h.tier, MAX_NAME)?;
    if let Some(t) = &h.trigger {
        if depth > 0 {
            return Err(invalid(
                field,
                shown(&t.name),
                "a trigger may not have a trigger",
            ));
        }
        check_hit(field, t, depth + 1)?;
    }
    Ok(())
}

fn validate_key(k: &FlowKey) -> Result<(), Refused> {
    for (field, s) in [
        ("Key.source_name", &k.source_name),
        ("Key.source_namespace", &k.source_namespace),
        ("Key.dest_name", &k.dest_name),
        ("Key.dest_namespace", &k.dest_namespace),
        ("Key.dest_service_name", &k.dest_service_name),
        ("Key.dest_service_namespace", &k.dest_service_namespace),
        ("Key.dest_service_port_name", &k.dest_service_port_name),
    ] {
        check_str(field, s, MAX_NAME)?;
    }
    check_str("Key.proto", &k.proto, MAX_PROTO)?;
    for (field, p) in [
        ("Key.dest_port", k.dest_port),
        ("Key.dest_service_port", k.dest_service_port),
    ] {
        if !(0..=65535).contains(&p) {
            return Err(invalid(field, p, "not a port"));
        }
    }
    let endpoint = |v| goldmane::EndpointType::try_from(v).is_ok();
    check_enum("Key.source_type", k.source_type, endpoint(k.source_type))?;
    check_enum("Key.dest_type", k.dest_type, endpoint(k.dest_type))?;
    check_enum(
        "Key.reporter",
        k.reporter,
        goldmane::Reporter::try_from(k.reporter).is_ok(),
    )?;
    check_enum(
        "Key.action",
        k.action,
        goldmane::Action::try_from(k.action).is_ok(),
    )?;
    if let Some(t) = &k.policies {
        for (field, hits) in [
            ("Key.policies.enforced_policies", &t.enforced_policies),
            ("Key.policies.pending_policies", &t.pending_policies),
        ] {
            if hits.len() > MAX_HITS {
                return Err(invalid(field, hits.len(), "too many hits"));
            }
            for h in hits {
                check_hit(field, h, 0)?;
            }
        }
    }
    Ok(())
}
