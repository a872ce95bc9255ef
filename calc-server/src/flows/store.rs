//! The buckets, the keys they hold, and what was refused.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use felix_proto::goldmane::{self, Flow, FlowKey, PolicyHit};
use felix_proto::prost::Message;

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

/// The counters of one key in one bucket (or, in a query, over several buckets).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Counters {
    pub(super) packets_in: i64,
    pub(super) packets_out: i64,
    pub(super) bytes_in: i64,
    pub(super) bytes_out: i64,
    pub(super) started: i64,
    pub(super) completed: i64,
    pub(super) live: i64,
    pub(super) source_labels: BTreeSet<String>,
    pub(super) dest_labels: BTreeSet<String>,
}

impl Counters {
    fn from_record(r: &Flow) -> Self {
        Counters {
            packets_in: r.packets_in,
            packets_out: r.packets_out,
            bytes_in: r.bytes_in,
            bytes_out: r.bytes_out,
            started: r.num_connections_started,
            completed: r.num_connections_completed,
            live: r.num_connections_live,
            source_labels: r.source_labels.iter().cloned().collect(),
            dest_labels: r.dest_labels.iter().cloned().collect(),
        }
    }

    /// Adds a record of the same key in the same bucket (as [`Counters::add`] with its
    /// counters, without copying its labels).
    fn add_record(&mut self, r: &Flow) {
        self.packets_in = self.packets_in.saturating_add(r.packets_in);
        self.packets_out = self.packets_out.saturating_add(r.packets_out);
        self.bytes_in = self.bytes_in.saturating_add(r.bytes_in);
        self.bytes_out = self.bytes_out.saturating_add(r.bytes_out);
        self.started = self.started.saturating_add(r.num_connections_started);
        self.completed = self.completed.saturating_add(r.num_connections_completed);
        self.live = self.live.saturating_add(r.num_connections_live);
        self.source_labels.retain(|l| r.source_labels.contains(l));
        self.dest_labels.retain(|l| r.dest_labels.contains(l));
    }

    /// Adds `other` (same key): counters sum, labels intersect. `live_sums` false keeps the
    /// later live count instead (adding buckets over time in a query).
    pub(super) fn add(&mut self, other: &Counters, live_sums: bool) {
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
        self.source_labels
            .retain(|l| other.source_labels.contains(l));
        self.dest_labels.retain(|l| other.dest_labels.contains(l));
    }
}

/// A key held by the store.
pub(super) struct KeyEntry {
    pub(super) id: i64,
    pub(super) key: FlowKey,
    /// How many buckets hold a counter set of this key; at zero the key is forgotten.
    buckets: u32,
}

/// Flow records in 15-second buckets, bounded in keys. See the module doc.
pub struct FlowStore {
    max_keys: usize,
    num_buckets: usize,
    /// Encoded key → id. prost's encoding of one message is deterministic, so equal keys give
    /// equal bytes.
    ids: HashMap<Vec<u8>, i64>,
    pub(super) keys: HashMap<i64, KeyEntry>,
    /// Bucket start → counters per key id.
    pub(super) buckets: BTreeMap<i64, HashMap<i64, Counters>>,
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
            ids: HashMap::new(),
            keys: HashMap::new(),
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
                    self.ids.remove(&k.key.encode_to_vec());
                }
            }
        }
    }

    /// Stores one record at `now`; a refusal is also counted in [`FlowStore::drops`].
    pub fn insert(&mut self, record: &FlowRecord, now: i64) -> Result<(), Refused> {
        self.expire(now);
        let result = self.try_insert(record, now);
        if let Err(e) = &result {
            let c = match e {
                Refused::KeyCap { .. } => &mut self.drops.key_cap,
                Refused::TooOld { .. } => &mut self.drops.too_old,
                Refused::InFuture { .. } => &mut self.drops.in_future,
                Refused::Invalid { .. } => &mut self.drops.invalid,
            };
            *c += 1;
        }
        result
    }

    fn try_insert(&mut self, record: &FlowRecord, now: i64) -> Result<(), Refused> {
        validate_record(record)?;
        let key = record.key.as_ref().expect("validated");
        let start = bucket_start(record.start_time);
        let oldest = self.oldest_bucket(now);
        let newest = Self::newest_bucket(now);
        if start < oldest {
            return Err(Refused::TooOld {
                start_time: record.start_time,
                oldest,
            });
        }
        if start > newest {
            return Err(Refused::InFuture {
                start_time: record.start_time,
                newest,
            });
        }
        let encoded = key.encode_to_vec();
        let id = match self.ids.get(&encoded) {
            Some(id) => *id,
            None => {
                if self.keys.len() >= self.max_keys {
                    return Err(Refused::KeyCap { cap: self.max_keys });
                }
                let id = self.next_id;
                self.next_id += 1;
                self.ids.insert(encoded, id);
                self.keys.insert(
                    id,
                    KeyEntry {
                        id,
                        key: key.clone(),
                        buckets: 0,
                    },
                );
                id
            }
        };
        let bucket = self.buckets.entry(start).or_default();
        match bucket.get_mut(&id) {
            Some(c) => c.add_record(record),
            None => {
                bucket.insert(id, Counters::from_record(record));
                if let Some(k) = self.keys.get_mut(&id) {
                    k.buckets += 1;
                }
            }
        }
        Ok(())
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

fn validate_record(r: &Flow) -> Result<(), Refused> {
    let Some(k) = &r.key else {
        return Err(invalid("Key", "none", "missing"));
    };
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
    for (field, labels) in [
        ("source_labels", &r.source_labels),
        ("dest_labels", &r.dest_labels),
    ] {
        if labels.len() > MAX_LABELS {
            return Err(invalid(field, labels.len(), "too many labels"));
        }
        for l in labels {
            check_str(field, l, MAX_LABEL)?;
        }
    }
    for (field, v) in [
        ("packets_in", r.packets_in),
        ("packets_out", r.packets_out),
        ("bytes_in", r.bytes_in),
        ("bytes_out", r.bytes_out),
        ("num_connections_started", r.num_connections_started),
        ("num_connections_completed", r.num_connections_completed),
        ("num_connections_live", r.num_connections_live),
    ] {
        if v < 0 {
            return Err(invalid(field, v, "negative"));
        }
    }
    Ok(())
}
