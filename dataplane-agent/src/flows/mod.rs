//! Flow logs, agent side: what the NFLOG rules logged and what conntrack counted, aggregated
//! per connection into 15-second intervals as [`FlowRecord`]s (capability `flows`,
//! docs/proto.md). Pure, no IO: every call takes the time (Unix seconds).
//!
//! Inputs:
//! * [`NflogEvent`]: a packet a deciding rule logged (group 1 inbound, 2 outbound, Felix's
//!   prefix, the packet's 5-tuple and length). Each rule that acted logs the same packet once,
//!   so a packet passed by one tier and allowed by the next yields two events, in that order.
//! * [`CtObservation`]: a conntrack entry (original and reply tuples, cumulative packets and
//!   bytes each way, whether it is new or destroyed), from a poll or an event.
//!
//! A connection is keyed by its 5-tuple after DNAT (source and source port of the original
//! direction, destination and destination port as the reply's source: what the policy saw) and
//! the reporting side: group 1 means this node's endpoint is the destination
//! (`reporter_dest`), group 2 the source. A node with both endpoints reports both sides.
//!
//! What a record holds, per (interval, connection, side):
//! * `trace`: each (rule, action) logged for the connection, in the order first logged; the
//!   rule is resolved by the caller (`resolve`: prefix → `RuleRef`; [`parse_prefix`] reads an
//!   unhashed prefix, [`PrefixIndex`] holds the hashed ones). A prefix it cannot resolve (a
//!   policy removed since) counts for `allowed` but is left out of the trace, and counted.
//!   `allowed`: the last action logged is `allow`. At most [`MAX_TRACE`] hits.
//! * Packets and bytes: for an allowed connection, what conntrack counted in the interval
//!   (differences of its cumulative counters), `_in` being what the side's endpoint received
//!   (the original direction on the destination's side, the reply on the source's); for a
//!   denied one, each denied packet logged (received on the destination's side, sent on the
//!   source's): no conntrack entry survives a drop.
//! * `original_dest_ip`/`_port`: the destination the client addressed, once a conntrack
//!   entry shows it translated (DNAT to a Service's backend); it names the destination service.
//! * `connections_started`: 1 in the interval the connection was first logged (again if its
//!   tuple is reused after it completed); `connections_completed`: 1 in the interval conntrack
//!   destroyed it; `connections_live`: 1 when allowed and still open at the interval's end.
//!
//! A connection produces a record for each interval it was active in (logged or observed) and
//! each interval it stayed open; it is forgotten once completed, or after
//! [`FlowSettings::idle_intervals`] intervals without any event (a denied one, or one conntrack
//! never reported). Conntrack entries of connections never logged (started before the agent,
//! or accepted by a rule that does not log) are ignored.
//!
//! Bounds: at most [`FlowSettings::max_connections`] connections tracked (a packet of a new one
//! beyond it is counted in `dropped` and ignored); at most [`FlowSettings::max_queued_records`]
//! records of closed intervals waiting to be sent, the oldest dropped first and counted. The
//! count goes out with the next report ([`FlowAggregator::take_reports`]) and restarts.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;

use felix_proto::{FlowRecord, FlowReport, FlowRuleHit, RuleRef};

use crate::driver::linux::{Direction, RuleId};

pub mod source;
#[cfg(test)]
mod tests;

/// Length of an interval, seconds.
pub const INTERVAL_SECS: i64 = 15;
/// NFLOG group of inbound verdicts (this node's endpoint is the destination).
pub const GROUP_INBOUND: u16 = 1;
/// NFLOG group of outbound verdicts (this node's endpoint is the source).
pub const GROUP_OUTBOUND: u16 = 2;
/// Most hits in one record's trace (the server refuses more; a packet meets one rule per tier).
pub const MAX_TRACE: usize = 64;
/// Most records in one report (the server takes up to 4096).
pub const MAX_RECORDS_PER_REPORT: usize = 1000;
/// Most encoded bytes of one report's records: well under the server's default limit on a
/// message it decodes (`--max-recv-bytes`, 64 KiB), which ends the stream when exceeded.
pub const MAX_REPORT_BYTES: usize = 32 * 1024;
/// A prefix of this length was hashed (`rules::nflog`): only a reverse map can name its rule.
pub const HASHED_PREFIX_LEN: usize = 63;

/// The start of the interval holding `t`: `floor(t / 15) * 15`.
pub fn interval_start(t: i64) -> i64 {
    t.div_euclid(INTERVAL_SECS) * INTERVAL_SECS
}

/// A connection's 5-tuple (ports 0 for protocols without).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
}

/// A packet a rule logged to NFLOG.
#[derive(Clone, Copy, Debug)]
pub struct NflogEvent<'a> {
    pub group: u16,
    pub prefix: &'a str,
    pub tuple: Tuple,
    /// The packet's length (IP header included).
    pub len: u32,
}

/// One conntrack entry as seen: counters are cumulative over the entry's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtObservation {
    pub orig: Tuple,
    pub reply: Tuple,
    pub orig_packets: u64,
    pub orig_bytes: u64,
    pub reply_packets: u64,
    pub reply_bytes: u64,
    /// A new entry (an event of a new connection): counters restart from zero.
    pub new: bool,
    /// The entry was destroyed (the connection completed); these are its final counters.
    pub destroyed: bool,
}

impl CtObservation {
    /// The destination the client addressed when it was translated (DNAT: the original
    /// direction's destination is not where the reply comes from), else `None`.
    pub fn original_dest(&self) -> Option<(IpAddr, u16)> {
        (self.orig.dst != self.reply.src || self.orig.dst_port != self.reply.src_port)
            .then_some((self.orig.dst, self.orig.dst_port))
    }

    /// The tuple the policy saw: the original source, the destination after DNAT.
    pub fn policy_tuple(&self) -> Tuple {
        Tuple {
            src: self.orig.src,
            dst: self.reply.src,
            src_port: self.orig.src_port,
            dst_port: self.reply.src_port,
            protocol: self.orig.protocol,
        }
    }
}

/// What a logged rule did (the prefix's first letter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Allow,
    Deny,
    Pass,
}

impl Action {
    /// From a prefix's first byte.
    pub fn of_prefix(prefix: &str) -> Option<Action> {
        match prefix.as_bytes().first()? {
            b'A' => Some(Action::Allow),
            b'D' => Some(Action::Deny),
            b'P' => Some(Action::Pass),
            _ => None,
        }
    }

    /// As `FlowRuleHit.action` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "allow",
            Action::Deny => "deny",
            Action::Pass => "pass",
        }
    }
}

/// The rule an unhashed prefix names (`<A|D|P><P|R><I|E><index>|<id>`, `<A|D|P>P<I|E>|<tier>`
/// for a tier's end, `DR<I|E>` for the no-profile drop), with its action. `None` for a hashed
/// prefix ([`HASHED_PREFIX_LEN`] bytes: see [`PrefixIndex`]) and anything malformed.
pub fn parse_prefix(prefix: &str) -> Option<(Action, RuleId)> {
    if prefix.len() >= HASHED_PREFIX_LEN {
        return None;
    }
    let action = Action::of_prefix(prefix)?;
    let b = prefix.as_bytes();
    let direction = match b.get(2)? {
        b'I' => Direction::Ingress,
        b'E' => Direction::Egress,
        _ => return None,
    };
    let owner = *b.get(1)?;
    let rest = &prefix[3..];
    if rest.is_empty() {
        return (owner == b'R' && action == Action::Deny)
            .then_some((action, RuleId::NoProfileMatched { direction }));
    }
    let (index, name) = rest.split_once('|')?;
    if name.is_empty() {
        return None;
    }
    let id = if index.is_empty() {
        if owner != b'P' {
            return None;
        }
        RuleId::EndOfTier {
            tier: name.to_owned(),
            direction,
        }
    } else {
        if !index.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let index: u32 = index.parse().ok()?;
        match owner {
            b'P' => RuleId::Policy {
                policy: name.to_owned(),
                direction,
                index,
            },
            b'R' => RuleId::Profile {
                profile: name.to_owned(),
                direction,
                index,
            },
            _ => return None,
        }
    };
    Some((action, id))
}

/// Hashed prefix → rule, for the rules programmed (built from their ids when rendering; a
/// prefix under [`HASHED_PREFIX_LEN`] bytes is read by [`parse_prefix`] instead).
#[derive(Clone, Debug, Default)]
pub struct PrefixIndex {
    hashed: HashMap<String, RuleId>,
}

impl PrefixIndex {
    /// Remembers `prefix` as naming `id` (only hashed prefixes are kept).
    pub fn insert(&mut self, prefix: String, id: RuleId) {
        if prefix.len() >= HASHED_PREFIX_LEN {
            self.hashed.insert(prefix, id);
        }
    }

    /// The rule and action of a prefix, hashed or not.
    pub fn lookup(&self, prefix: &str) -> Option<(Action, RuleId)> {
        match self.hashed.get(prefix) {
            Some(id) => Some((Action::of_prefix(prefix)?, id.clone())),
            None => parse_prefix(prefix),
        }
    }

    /// Hashed prefixes held.
    pub fn len(&self) -> usize {
        self.hashed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashed.is_empty()
    }
}

/// Bounds and timing of the aggregation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowSettings {
    /// Connections tracked at once, both sides counted.
    pub max_connections: usize,
    /// Records of closed intervals held until sent.
    pub max_queued_records: usize,
    /// Intervals without any event after which a connection is forgotten.
    pub idle_intervals: u32,
}

impl Default for FlowSettings {
    /// 50 000 connections, 100 000 queued records, forgotten after 4 idle intervals (1 min).
    fn default() -> Self {
        Self {
            max_connections: 50_000,
            max_queued_records: 100_000,
            idle_intervals: 4,
        }
    }
}

/// One side of one connection.
#[derive(Clone, Debug, Default)]
struct Conn {
    trace: Vec<FlowRuleHit>,
    /// The last logged action was allow.
    allowed: bool,
    /// Conntrack's counters at the last observation (orig packets, orig bytes, reply packets,
    /// reply bytes); `None` before the first one.
    ct_last: Option<[u64; 4]>,
    /// Completed (destroyed by conntrack); forgotten when its interval closes.
    closed: bool,
    /// The interval of the last event.
    last_active: i64,
    /// The destination the client addressed, when conntrack showed it translated (DNAT).
    original_dest: Option<(IpAddr, u16)>,
    // This interval's counts.
    packets_in: u64,
    packets_out: u64,
    bytes_in: u64,
    bytes_out: u64,
    started: u32,
    completed: u32,
}

/// NFLOG events and conntrack observations in, [`FlowReport`]s of closed intervals out.
#[derive(Debug)]
pub struct FlowAggregator {
    settings: FlowSettings,
    /// The open interval (its start); `None` before the first event.
    current: Option<i64>,
    conns: HashMap<(Tuple, bool), Conn>,
    /// Records of closed intervals, oldest first.
    queue: VecDeque<FlowRecord>,
    /// Dropped since the last report.
    dropped: u64,
    /// Dropped since start.
    dropped_total: u64,
    /// Logged packets whose prefix named no rule held, since start.
    unresolved_total: u64,
}

impl FlowAggregator {
    pub fn new(settings: FlowSettings) -> Self {
        Self {
            settings,
            current: None,
            conns: HashMap::new(),
            queue: VecDeque::new(),
            dropped: 0,
            dropped_total: 0,
            unresolved_total: 0,
        }
    }

    /// Connections tracked now.
    pub fn tracked(&self) -> usize {
        self.conns.len()
    }

    /// Records waiting to be sent.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Connections and records dropped since start.
    pub fn dropped_total(&self) -> u64 {
        self.dropped_total
    }

    /// Logged packets whose prefix named no rule held, since start.
    pub fn unresolved_total(&self) -> u64 {
        self.unresolved_total
    }

    fn drop_one(&mut self) {
        self.dropped += 1;
        self.dropped_total += 1;
    }

    /// A packet a rule logged at `now`. `resolve` names the rule of a prefix (`None`: the
    /// action counts, the trace goes without it). A prefix without a known action or a group other than
    /// 1 and 2 is ignored.
    pub fn on_nflog(
        &mut self,
        now: i64,
        ev: &NflogEvent<'_>,
        resolve: impl FnOnce(&str) -> Option<RuleRef>,
    ) {
        let reporter_dest = match ev.group {
            GROUP_INBOUND => true,
            GROUP_OUTBOUND => false,
            _ => return,
        };
        let Some(action) = Action::of_prefix(ev.prefix) else {
            return;
        };
        let at = self.advance(now);
        let key = (ev.tuple, reporter_dest);
        if !self.conns.contains_key(&key) && self.conns.len() >= self.settings.max_connections {
            self.drop_one();
            return;
        }
        let conn = self.conns.entry(key).or_insert_with(|| Conn {
            closed: true, // so that the first event counts as a start, below
            ..Conn::default()
        });
        if conn.closed {
            // New, or the tuple reused after the previous connection completed.
            conn.closed = false;
            conn.ct_last = None;
            conn.started += 1;
        }
        conn.last_active = at;
        match resolve(ev.prefix) {
            Some(rule) => {
                let hit = FlowRuleHit {
                    rule: Some(rule),
                    action: action.as_str().to_owned(),
                };
                if conn.trace.len() < MAX_TRACE && !conn.trace.contains(&hit) {
                    conn.trace.push(hit);
                }
            }
            // A rule no longer held (the server refuses a hit without one): the action still
            // counts, the trace goes without it.
            None => self.unresolved_total += 1,
        }
        match action {
            Action::Allow => conn.allowed = true,
            Action::Deny => {
                conn.allowed = false;
                let len = u64::from(ev.len);
                if reporter_dest {
                    conn.packets_in += 1;
                    conn.bytes_in += len;
                } else {
                    conn.packets_out += 1;
                    conn.bytes_out += len;
                }
            }
            Action::Pass => {}
        }
    }

    /// One event of a [`source::FlowSource`], at its own time.
    pub fn on_event(
        &mut self,
        ev: &source::FlowEvent,
        resolve: impl FnOnce(&str) -> Option<RuleRef>,
    ) {
        match ev {
            source::FlowEvent::Nflog {
                at,
                group,
                prefix,
                tuple,
                len,
            } => self.on_nflog(
                *at,
                &NflogEvent {
                    group: *group,
                    prefix,
                    tuple: *tuple,
                    len: *len,
                },
                resolve,
            ),
            source::FlowEvent::Conntrack { at, entry } => self.on_conntrack(*at, entry),
        }
    }

    /// A conntrack entry seen at `now`: its counters since the last observation go to each
    /// side of the connection that is tracked.
    pub fn on_conntrack(&mut self, now: i64, ct: &CtObservation) {
        let at = self.advance(now);
        let tuple = ct.policy_tuple();
        let counters = [
            ct.orig_packets,
            ct.orig_bytes,
            ct.reply_packets,
            ct.reply_bytes,
        ];
        for reporter_dest in [true, false] {
            let Some(conn) = self.conns.get_mut(&(tuple, reporter_dest)) else {
                continue;
            };
            if conn.closed {
                // A completed connection's entry seen again (a late dump): counted already.
                continue;
            }
            let last = match conn.ct_last {
                Some(l) if !ct.new && counters.iter().zip(l).all(|(c, l)| *c >= l) => l,
                // First seen, new, or counters went down (another entry): all of it is new.
                _ => [0; 4],
            };
            let d: Vec<u64> = counters.iter().zip(last).map(|(c, l)| c - l).collect();
            let (orig, reply) = ((d[0], d[1]), (d[2], d[3]));
            let (inn, out) = if reporter_dest {
                (orig, reply)
            } else {
                (reply, orig)
            };
            conn.packets_in += inn.0;
            conn.bytes_in += inn.1;
            conn.packets_out += out.0;
            conn.bytes_out += out.1;
            conn.ct_last = Some(counters);
            conn.last_active = at;
            if let Some(d) = ct.original_dest() {
                conn.original_dest = Some(d);
            }
            if ct.destroyed {
                conn.closed = true;
                conn.completed += 1;
            }
        }
    }

    /// Moves to the interval holding `now`, closing the ones before (their records queued).
    /// Returns the open interval's start. Time going back stays in the open interval.
    pub fn advance(&mut self, now: i64) -> i64 {
        let at = interval_start(now);
        match self.current {
            None => self.current = Some(at),
            Some(cur) if at > cur => {
                self.close(cur);
                // Intervals in between had no events: only open connections report them.
                let mut next = cur + INTERVAL_SECS;
                while next < at && !self.conns.is_empty() {
                    self.close(next);
                    next += INTERVAL_SECS;
                }
                self.current = Some(at);
            }
            Some(_) => {}
        }
        self.current.unwrap_or(at)
    }

    /// Queues the records of interval `start` and forgets what is done.
    fn close(&mut self, start: i64) {
        let idle_limit = i64::from(self.settings.idle_intervals) * INTERVAL_SECS;
        // Sorted, so that records (and tests) come in a stable order.
        let mut records = BTreeMap::new();
        self.conns.retain(|&(tuple, reporter_dest), c| {
            let live = c.allowed && !c.closed;
            let active = c.last_active == start;
            let idle = start - c.last_active >= idle_limit;
            if active || (live && !idle) {
                records.insert(
                    (tuple, reporter_dest),
                    FlowRecord {
                        interval_start: start,
                        source_ip: tuple.src.to_string(),
                        dest_ip: tuple.dst.to_string(),
                        source_port: u32::from(tuple.src_port),
                        dest_port: u32::from(tuple.dst_port),
                        protocol: u32::from(tuple.protocol),
                        reporter_dest,
                        trace: c.trace.clone(),
                        allowed: c.allowed,
                        packets_in: c.packets_in,
                        packets_out: c.packets_out,
                        bytes_in: c.bytes_in,
                        bytes_out: c.bytes_out,
                        connections_started: c.started,
                        connections_completed: c.completed,
                        connections_live: u32::from(live),
                        original_dest_ip: c
                            .original_dest
                            .map(|(ip, _)| ip.to_string())
                            .unwrap_or_default(),
                        original_dest_port: c.original_dest.map_or(0, |(_, p)| u32::from(p)),
                    },
                );
            }
            let keep = !c.closed && !idle;
            c.packets_in = 0;
            c.packets_out = 0;
            c.bytes_in = 0;
            c.bytes_out = 0;
            c.started = 0;
            c.completed = 0;
            keep
        });
        for r in records.into_values() {
            if self.settings.max_queued_records == 0 {
                self.drop_one();
                continue;
            }
            if self.queue.len() >= self.settings.max_queued_records {
                self.queue.pop_front();
                self.drop_one();
            }
            self.queue.push_back(r);
        }
    }

    /// The closed intervals' records as reports, one per interval, oldest first (at most
    /// `max_records` records and [`MAX_REPORT_BYTES`] encoded bytes each: a larger interval
    /// goes in several), after closing what
    /// `now` closes. The dropped count goes with the first report (a report of its own when
    /// nothing is queued) and restarts. Empty when there is nothing to say.
    pub fn take_reports(&mut self, now: i64, max_records: usize) -> Vec<FlowReport> {
        use felix_proto::prost::Message;
        self.advance(now);
        let max_records = max_records.max(1);
        let mut out: Vec<FlowReport> = Vec::new();
        let mut last_interval = None;
        // The encoded size of the last report's records so far.
        let mut bytes = 0;
        while let Some(r) = self.queue.pop_front() {
            let same = last_interval == Some(r.interval_start);
            // A repeated field's entry: its tag, its length and itself.
            let size =
                1 + felix_proto::prost::length_delimiter_len(r.encoded_len()) + r.encoded_len();
            match out.last_mut() {
                Some(rep)
                    if same
                        && rep.records.len() < max_records
                        && bytes + size <= MAX_REPORT_BYTES =>
                {
                    bytes += size;
                    rep.records.push(r)
                }
                _ => {
                    last_interval = Some(r.interval_start);
                    bytes = size;
                    out.push(FlowReport {
                        records: vec![r],
                        dropped: 0,
                    });
                }
            }
        }
        if self.dropped > 0 {
            match out.first_mut() {
                Some(first) => first.dropped = self.dropped,
                None => out.push(FlowReport {
                    records: Vec::new(),
                    dropped: self.dropped,
                }),
            }
            self.dropped = 0;
        }
        out
    }
}
