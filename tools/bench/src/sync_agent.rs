//! A lean simulated agent for `calc-bench bench-sync` and `churn`: one task per agent speaking
//! gRPC over raw HTTP/2 (h2), so thousands fit beside the server on two cores.
//!
//! What it does as a real agent does: one connection and one Sync stream per node, the hello,
//! the snapshot held until `InSync`, a `DataplaneApplied` after each burst of messages it has
//! read (a real agent reports once per apply, not per message), and on a lost or ended stream
//! a reconnect with the agent's back-off (jittered, 200 ms doubling to 10 s, reset by a stream
//! that reached `InSync`; `RESOURCE_EXHAUSTED` retried at once, once) for a fresh snapshot.
//!
//! What it does not do: decode every message. Each gRPC frame is scanned for its sequence
//! number and its payload's field number; only the ServerHello, the marker policy (found by
//! its id's name before decoding) and, with stats, policy and profile updates are decoded.
//! With `track_state`, the agent keeps a digest of what it would have programmed (every
//! object by kind and id with a hash of its bytes; IP sets as a hash of their member set,
//! deltas applied), taken over at `InSync` as a real agent's mark and sweep does: two
//! agents hold the same state exactly when their digests are equal.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use felix_proto as pb;
use pb::prost::Message;
use pb::prost::bytes::{Buf, Bytes};
use pb::to_dataplane::Payload as To;
use tokio::sync::mpsc;

use crate::bench_sync::{Event, SentRules, StatsPlan, next, rule_stats, track_rules};

/// What every simulated agent shares.
#[derive(Clone)]
pub(crate) struct AgentSetup {
    /// `host:port` of the server (or of the forwarder in front of the replicas).
    pub addr: String,
    pub report_applied: bool,
    pub stats: Option<Arc<StatsPlan>>,
    /// Keep a digest of the programmed state in `digests[i]`.
    pub digests: Option<Arc<Vec<AtomicU64>>>,
}

/// The HTTP/2 receive windows, per stream and per connection: those of dataplane-agent's
/// client (tonic over hyper: 2 MiB and 5 MiB).
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;

/// The agent's reconnect back-off (dataplane-agent's defaults).
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(10);

/// How one stream ended.
struct StreamEnd {
    reached_in_sync: bool,
    /// The gRPC status code, when the server sent one.
    code: Option<i32>,
    why: String,
}

/// Runs simulated agent `i` for `node` until the coordinator goes away.
pub(crate) async fn run(
    i: usize,
    node: String,
    setup: AgentSetup,
    events: mpsc::UnboundedSender<Event>,
) {
    let mut backoff = common::Backoff::new(RECONNECT_MIN, RECONNECT_MAX);
    let mut immediate_used = false;
    let mut state = Programmed::default();
    let mut rng = 0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
    loop {
        let end = stream(i, &node, &setup, &events, &mut state, &mut rng).await;
        if events.is_closed() {
            return;
        }
        if end.reached_in_sync {
            backoff.reset();
            immediate_used = false;
        }
        // RESOURCE_EXHAUSTED (8): at once, once; refusals (3 INVALID_ARGUMENT, 5 NOT_FOUND,
        // 7 PERMISSION_DENIED, 12 UNIMPLEMENTED) and ABORTED (10, replaced) wait the longest.
        let delay = match end.code {
            Some(8) if !immediate_used => {
                immediate_used = true;
                Duration::ZERO
            }
            Some(3 | 5 | 7 | 10 | 12) => backoff.max(),
            _ => backoff.next_delay(),
        };
        if events.send(Event::Disconnected(i, end.why)).is_err() {
            return;
        }
        tokio::time::sleep(delay).await;
    }
}

/// A gRPC message frame: the uncompressed flag and the length, then the bytes.
fn grpc_frame(m: &impl Message) -> Bytes {
    let len = m.encoded_len();
    let mut b = Vec::with_capacity(5 + len);
    b.push(0);
    b.extend_from_slice(&(len as u32).to_be_bytes());
    m.encode(&mut b).expect("a Vec grows");
    Bytes::from(b)
}

fn report(seq: u64, payload: pb::from_dataplane::Payload) -> Bytes {
    grpc_frame(&pb::FromDataplane {
        sequence_number: seq,
        payload: Some(payload),
    })
}

/// One connection and one Sync stream, until it ends.
async fn stream(
    i: usize,
    node: &str,
    setup: &AgentSetup,
    events: &mpsc::UnboundedSender<Event>,
    state: &mut Programmed,
    rng: &mut u64,
) -> StreamEnd {
    let mut end = StreamEnd {
        reached_in_sync: false,
        code: None,
        why: String::new(),
    };
    let fail = |mut end: StreamEnd, why: String| {
        end.why = why;
        end
    };
    let tcp = match tokio::net::TcpStream::connect(&setup.addr).await {
        Ok(t) => t,
        Err(e) => return fail(end, format!("connect: {e}")),
    };
    let _ = tcp.set_nodelay(true);
    let mut builder = h2::client::Builder::new();
    builder
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_reset_streams(0);
    let (send, conn) = match builder.handshake::<_, Bytes>(tcp).await {
        Ok(h) => h,
        Err(e) => return fail(end, format!("HTTP/2 handshake: {e}")),
    };
    let mut conn = Box::pin(conn);
    // Drives the connection while `f` runs; `Err` when the connection ends first.
    macro_rules! with_conn {
        ($f:expr) => {
            tokio::select! {
                r = $f => Ok(r),
                r = &mut conn => Err(match r {
                    Ok(()) => "connection closed".to_string(),
                    Err(e) => format!("connection: {e}"),
                }),
            }
        };
    }
    let mut send = match with_conn!(send.ready()) {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return fail(end, format!("HTTP/2 not ready: {e}")),
        Err(e) => return fail(end, e),
    };
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(format!("http://{}/felix.CalcServer/Sync", setup.addr))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a valid request");
    let (response, mut tx) = match send.send_request(request, false) {
        Ok(r) => r,
        Err(e) => return fail(end, format!("sending the request: {e}")),
    };
    let mut capabilities = vec![];
    if setup.report_applied {
        capabilities.push("applied".to_string());
    }
    if setup.stats.is_some() {
        capabilities.push("stats".to_string());
    }
    let hello = report(
        1,
        pb::from_dataplane::Payload::AgentHello(pb::AgentHello {
            node_name: node.to_string(),
            agent_version: "bench-sync".into(),
            capabilities,
        }),
    );
    if let Err(e) = tx.send_data(hello, false) {
        return fail(end, format!("sending the hello: {e}"));
    }
    let response = match with_conn!(response) {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return fail(end, format!("response: {e}")),
        Err(e) => return fail(end, e),
    };
    if let Some(code) = grpc_status(response.headers()) {
        end.code = Some(code.0);
        return fail(end, format!("refused: {}", code.1));
    }
    let mut body = response.into_body();
    // IP sets are the bulk of a snapshot; only the state digest reads them.
    let mut reader = Reader::new(setup.digests.is_none());
    let mut s = Session {
        report_seq: 1,
        ..Session::default()
    };
    let period = setup
        .stats
        .as_ref()
        .map_or(Duration::from_secs(3600), |p| p.period);
    let phase = period.mul_f64((next(rng) % 1000) as f64 / 1000.0);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let chunk = tokio::select! {
            d = body.data() => d,
            r = &mut conn => {
                let why = match r {
                    Ok(()) => "connection closed".to_string(),
                    Err(e) => format!("connection: {e}"),
                };
                end.reached_in_sync = s.in_sync;
                return fail(end, why);
            }
            _ = tick.tick(), if setup.stats.is_some() => {
                if let Some(plan) = &setup.stats
                    && s.in_sync && s.server_takes_stats && plan.on.load(Ordering::Relaxed)
                {
                    let r = rule_stats(&s.sent, plan.max_hits, rng);
                    let n = r.hits.len() as u64;
                    s.report_seq += 1;
                    if tx.send_data(report(s.report_seq, pb::from_dataplane::Payload::RuleStats(r)), false).is_err() {
                        end.reached_in_sync = true;
                        return fail(end, "sending a report".into());
                    }
                    plan.reports.fetch_add(1, Ordering::Relaxed);
                    plan.hits.fetch_add(n, Ordering::Relaxed);
                }
                continue;
            }
        };
        let last_seq = match chunk {
            Some(Ok(data)) => {
                let _ = body.flow_control().release_capacity(data.len());
                // Every whole frame read so far.
                let mut last_seq = None;
                let read = reader.feed(&data, |piece| {
                    last_seq = Some(match piece {
                        Piece::Whole(bytes) => s.message(bytes, i, setup, events, state)?,
                        Piece::Skipped { seq } => seq,
                    });
                    Ok(())
                });
                if let Err(why) = read {
                    end.reached_in_sync = s.in_sync;
                    return fail(end, why);
                }
                last_seq
            }
            Some(Err(e)) => {
                end.reached_in_sync = s.in_sync;
                return fail(end, format!("stream: {e}"));
            }
            None => {
                end.reached_in_sync = s.in_sync;
                let trailers = with_conn!(body.trailers());
                let (code, why) = match trailers {
                    Ok(Ok(Some(t))) => {
                        grpc_status(&t).unwrap_or((0, "ended without a status".into()))
                    }
                    Ok(Ok(None)) => (2, "ended without trailers".into()),
                    Ok(Err(e)) => (2, format!("trailers: {e}")),
                    Err(e) => (2, e),
                };
                end.code = Some(code);
                return fail(end, format!("stream ended: {why}"));
            }
        };
        if s.in_sync {
            end.reached_in_sync = true;
            if let Some(d) = &setup.digests {
                d[i].store(state.digest(), Ordering::Relaxed);
            }
        }
        // One report per burst read, as a real agent reports once per apply.
        if let Some(seq) = last_seq
            && setup.report_applied
            && s.server_takes_reports
            && s.in_sync
        {
            s.report_seq += 1;
            let applied = pb::from_dataplane::Payload::DataplaneApplied(pb::DataplaneApplied {
                applied_sequence_number: seq,
                received_sequence_number: seq,
                ..Default::default()
            });
            if let Err(e) = tx.send_data(report(s.report_seq, applied), false) {
                return fail(end, format!("sending a report: {e}"));
            }
        }
    }
}

/// A message [`Reader::feed`] found: whole, or (an IP set it was told to skip) only its
/// sequence number.
enum Piece<'a> {
    Whole(&'a [u8]),
    Skipped { seq: u64 },
}

/// What [`Reader`] copies of a frame before it decides whether to skip its payload: the
/// prefix and enough of the message for the payload's field number and length (and a
/// sequence number written before them).
const SKIP_DECIDE: usize = 5 + 24;

/// A frame at least this long may be skipped.
const SKIP_MIN: usize = 4 * 1024;

/// The gRPC messages of a stream, read from its DATA frames as they come. A frame that lies
/// within one DATA frame is read where it is; one that spans several is gathered, unless it is
/// a large IP set and `skip_ipsets` is set: then its payload is passed over unread (the bulk of
/// a snapshot, which the simulated agent needs only for its state digest) and only the
/// sequence number after it is kept.
struct Reader {
    skip_ipsets: bool,
    /// The start of a frame that spans DATA frames.
    partial: Vec<u8>,
    skipping: Option<Skip>,
}

/// A frame whose payload is being passed over.
struct Skip {
    /// A sequence number read before the payload (prost writes it after).
    seq: u64,
    payload_left: usize,
    /// What follows the payload in the frame (the sequence number field), gathered.
    tail: Vec<u8>,
    tail_left: usize,
}

impl Reader {
    fn new(skip_ipsets: bool) -> Reader {
        Reader {
            skip_ipsets,
            partial: Vec::new(),
            skipping: None,
        }
    }

    /// Reads `data`, calling `each` for every message it completes, in order.
    fn feed(
        &mut self,
        mut data: &[u8],
        mut each: impl FnMut(Piece<'_>) -> Result<(), String>,
    ) -> Result<(), String> {
        loop {
            if let Some(skip) = &mut self.skipping {
                let n = skip.payload_left.min(data.len());
                skip.payload_left -= n;
                data = &data[n..];
                let n = skip.tail_left.min(data.len());
                skip.tail.extend_from_slice(&data[..n]);
                skip.tail_left -= n;
                data = &data[n..];
                if skip.payload_left > 0 || skip.tail_left > 0 {
                    return Ok(());
                }
                let seq = match scan(&skip.tail)?.seq {
                    0 => skip.seq,
                    seq => seq,
                };
                self.skipping = None;
                each(Piece::Skipped { seq })?;
                continue;
            }
            if self.partial.is_empty() {
                // Whole frames where they lie.
                while let Some(len) = frame_len(data)?
                    && data.len() >= len
                {
                    each(Piece::Whole(&data[5..len]))?;
                    data = &data[len..];
                }
            }
            if data.is_empty() {
                return Ok(());
            }
            // Gather the prefix; then what the decision needs; then the rest of the frame.
            let need = match frame_len(&self.partial)? {
                None => 5,
                Some(len) if self.skip_ipsets && len >= SKIP_MIN => {
                    if self.partial.len() < SKIP_DECIDE {
                        SKIP_DECIDE
                    } else {
                        len
                    }
                }
                Some(len) => len,
            };
            let n = need.saturating_sub(self.partial.len()).min(data.len());
            self.partial.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.partial.len() < need {
                continue;
            }
            let len = frame_len(&self.partial)?.expect("the prefix is in");
            if self.partial.len() == len {
                each(Piece::Whole(&self.partial[5..]))?;
                self.partial.clear();
            } else if self.partial.len() == SKIP_DECIDE
                && let Some(p) = ipset_payload(&self.partial[5..])
                && 5 + p.start + p.len >= SKIP_DECIDE
            {
                let payload_end = 5 + p.start + p.len;
                if payload_end > len {
                    return Err("a payload longer than its message".into());
                }
                self.skipping = Some(Skip {
                    seq: p.seq,
                    payload_left: payload_end - SKIP_DECIDE,
                    tail: Vec::new(),
                    tail_left: len - payload_end,
                });
                self.partial.clear();
            }
        }
    }
}

/// The length of the frame `b` starts with (prefix included), once its prefix is in.
fn frame_len(b: &[u8]) -> Result<Option<usize>, String> {
    if b.len() < 5 {
        return Ok(None);
    }
    if b[0] != 0 {
        return Err("a compressed frame (never asked for)".into());
    }
    Ok(Some(
        5 + u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize,
    ))
}

/// An IP set payload found at a message's beginning.
struct IpSetPayload {
    /// Where it starts in the message, and how long it is.
    start: usize,
    len: usize,
    /// A sequence number before it (0: none).
    seq: u64,
}

/// The payload of the message beginning `b`, when it is an IP set update or delta (fields 2
/// and 3) whose length is within `b`.
fn ipset_payload(b: &[u8]) -> Option<IpSetPayload> {
    use pb::prost::encoding::{WireType, decode_key, decode_varint};
    let mut rest = b;
    let mut seq = 0;
    while !rest.is_empty() {
        match decode_key(&mut rest).ok()? {
            (15, WireType::Varint) => seq = decode_varint(&mut rest).ok()?,
            (2 | 3, WireType::LengthDelimited) => {
                let len = decode_varint(&mut rest).ok()? as usize;
                return Some(IpSetPayload {
                    start: b.len() - rest.len(),
                    len,
                    seq,
                });
            }
            _ => return None,
        }
    }
    None
}

/// The `grpc-status` of a header or trailer map, when there is one and it is not OK.
fn grpc_status(h: &http::HeaderMap) -> Option<(i32, String)> {
    let code: i32 = h.get("grpc-status")?.to_str().ok()?.parse().ok()?;
    let message = h
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or_default();
    Some((code, format!("grpc-status {code}: {message}"))).filter(|_| code != 0)
}

/// What one stream has learned.
#[derive(Default)]
struct Session {
    in_sync: bool,
    server_takes_reports: bool,
    server_takes_stats: bool,
    report_seq: u64,
    sent: SentRules,
    /// The snapshot being received (state tracking), taken over at `InSync`.
    pending: Option<Programmed>,
}

impl Session {
    /// Handles one `ToDataplane`; returns its sequence number.
    fn message(
        &mut self,
        bytes: &[u8],
        i: usize,
        setup: &AgentSetup,
        events: &mpsc::UnboundedSender<Event>,
        state: &mut Programmed,
    ) -> Result<u64, String> {
        let scanned = scan(bytes).map_err(|e| format!("undecodable message: {e}"))?;
        match scanned.tag {
            1 => {
                self.in_sync = true;
                if let Some(p) = self.pending.take() {
                    *state = p;
                }
                let _ = events.send(Event::InSync(i));
            }
            1000 => {
                let m = pb::ToDataplane::decode(bytes).map_err(|e| e.to_string())?;
                if let Some(To::ServerHello(h)) = m.payload {
                    self.server_takes_reports = h.capabilities.iter().any(|c| c == "applied");
                    self.server_takes_stats = h.capabilities.iter().any(|c| c == "stats");
                }
                if setup.digests.is_some() {
                    self.pending = Some(Programmed::default());
                }
            }
            7 if is_marker(scanned.payload) => {
                let m = pb::ToDataplane::decode(bytes).map_err(|e| e.to_string())?;
                if let Some(To::ActivePolicyUpdate(u)) = m.payload {
                    let port = u
                        .policy
                        .as_ref()
                        .and_then(|p| p.inbound_rules.first())
                        .and_then(|r| r.dst_ports.first())
                        .map(|p| p.first);
                    if let Some(p) = port {
                        let _ = events.send(Event::Marker(p));
                    }
                }
            }
            _ => {}
        }
        if setup.stats.is_some() && (5..=8).contains(&scanned.tag) {
            let m = pb::ToDataplane::decode(bytes).map_err(|e| e.to_string())?;
            track_rules(&mut self.sent, &m.payload);
        }
        if setup.digests.is_some() {
            let target = self.pending.as_mut().unwrap_or(state);
            target.apply(scanned.tag, scanned.payload)?;
        }
        Ok(scanned.seq)
    }
}

/// A `ToDataplane` scanned: its sequence number, its payload's field number and bytes.
struct Scanned<'a> {
    seq: u64,
    tag: u32,
    payload: &'a [u8],
}

/// The top-level fields of an encoded `ToDataplane`, without decoding the payload.
fn scan(mut b: &[u8]) -> Result<Scanned<'_>, String> {
    let mut out = Scanned {
        seq: 0,
        tag: 0,
        payload: &[],
    };
    while b.has_remaining() {
        let (tag, wire) = pb::prost::encoding::decode_key(&mut b).map_err(|e| e.to_string())?;
        match (tag, wire) {
            (15, pb::prost::encoding::WireType::Varint) => {
                out.seq = pb::prost::encoding::decode_varint(&mut b).map_err(|e| e.to_string())?;
            }
            (_, pb::prost::encoding::WireType::LengthDelimited) => {
                let len =
                    pb::prost::encoding::decode_varint(&mut b).map_err(|e| e.to_string())? as usize;
                if len > b.len() {
                    return Err("a field longer than its message".into());
                }
                out.tag = tag;
                out.payload = &b[..len];
                b = &b[len..];
            }
            (tag, wire) => {
                pb::prost::encoding::skip_field(wire, tag, &mut b, Default::default())
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(out)
}

/// The length-delimited fields of a message, with their field numbers.
fn fields(mut b: &[u8]) -> Result<Vec<(u32, &[u8])>, String> {
    let mut out = Vec::new();
    while b.has_remaining() {
        let (tag, wire) = pb::prost::encoding::decode_key(&mut b).map_err(|e| e.to_string())?;
        if wire == pb::prost::encoding::WireType::LengthDelimited {
            let len =
                pb::prost::encoding::decode_varint(&mut b).map_err(|e| e.to_string())? as usize;
            if len > b.len() {
                return Err("a field longer than its message".into());
            }
            out.push((tag, &b[..len]));
            b = &b[len..];
        } else {
            pb::prost::encoding::skip_field(wire, tag, &mut b, Default::default())
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(out)
}

/// Whether an `ActivePolicyUpdate`'s id names the marker policy (PolicyID.name is field 2).
fn is_marker(update: &[u8]) -> bool {
    let Ok(f) = fields(update) else { return false };
    f.iter()
        .find(|(t, _)| *t == 1)
        .and_then(|(_, id)| fields(id).ok())
        .is_some_and(|id| {
            id.iter()
                .any(|(t, v)| *t == 2 && *v == b"bench-sync-marker".as_slice())
        })
}

fn hash(parts: &[&[u8]]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    for p in parts {
        p.hash(&mut h);
    }
    h.finish()
}

/// What an agent would have programmed, as a digest per object.
#[derive(Default)]
pub(crate) struct Programmed {
    /// (kind, id) → hash of the update's bytes.
    objects: HashMap<u64, u64>,
    /// IP set id → (hash of the update without members, sum of member hashes, members).
    ipsets: HashMap<u64, (u64, u64, u64)>,
}

/// Which kind an update or remove belongs to, and how its id is found: the field number(s)
/// that make up the id in the update and in the remove (Calico's messages).
fn kind_of(tag: u32) -> Option<(u32, bool)> {
    // (kind, is_remove)
    Some(match tag {
        5 | 6 => (5, tag == 6),
        7 | 8 => (7, tag == 8),
        9 | 10 => (9, tag == 10),
        11 | 12 => (11, tag == 12),
        14 | 18 => (14, tag == 18),
        16 | 17 => (16, tag == 17),
        19 | 20 => (19, tag == 20),
        21 | 22 => (21, tag == 22),
        23 | 24 => (23, tag == 24),
        25 | 26 => (25, tag == 26),
        27 | 28 => (27, tag == 28),
        31 | 32 => (31, tag == 32),
        33 | 34 => (33, tag == 34),
        // Singletons: the config, the global BGP config, the encapsulation.
        13 | 29 | 30 => (tag, false),
        _ => return None,
    })
}

impl Programmed {
    fn apply(&mut self, tag: u32, payload: &[u8]) -> Result<(), String> {
        match tag {
            2 => {
                let f = fields(payload)?;
                let id = f.iter().find(|(t, _)| *t == 1).map_or(&[][..], |x| x.1);
                let (mut sum, mut n) = (0u64, 0u64);
                let mut rest = Vec::new();
                for (t, v) in &f {
                    if *t == 2 {
                        sum = sum.wrapping_add(hash(&[v]));
                        n += 1;
                    } else {
                        rest.push(*v);
                    }
                }
                // The type is a varint (not in `fields`): hash the update's bytes minus members
                // by its length-delimited parts and its whole length minus the members'.
                let ty = hash(&[&rest.concat(), &type_of(payload).to_le_bytes()]);
                self.ipsets.insert(hash(&[b"ipset", id]), (ty, sum, n));
            }
            3 => {
                let f = fields(payload)?;
                let id = f.iter().find(|(t, _)| *t == 1).map_or(&[][..], |x| x.1);
                let set = self.ipsets.entry(hash(&[b"ipset", id])).or_default();
                for (t, v) in &f {
                    match t {
                        2 => {
                            set.1 = set.1.wrapping_add(hash(&[v]));
                            set.2 += 1;
                        }
                        3 => {
                            set.1 = set.1.wrapping_sub(hash(&[v]));
                            set.2 = set.2.wrapping_sub(1);
                        }
                        _ => {}
                    }
                }
            }
            4 => {
                let f = fields(payload)?;
                let id = f.iter().find(|(t, _)| *t == 1).map_or(&[][..], |x| x.1);
                self.ipsets.remove(&hash(&[b"ipset", id]));
            }
            _ => {
                let Some((kind, remove)) = kind_of(tag) else {
                    return Ok(());
                };
                let kind_bytes = kind.to_le_bytes();
                let key = match tag {
                    13 | 29 | 30 => hash(&[&kind_bytes]),
                    _ => {
                        let f = fields(payload)?;
                        // RouteUpdate's dst is field 3, RouteRemove's 2; a Service is named by
                        // its name and namespace (1, 2); the rest by field 1.
                        let want: &[u32] = match tag {
                            23 => &[3],
                            24 => &[2],
                            31 | 32 => &[1, 2],
                            _ => &[1],
                        };
                        let mut parts: Vec<&[u8]> = vec![&kind_bytes];
                        for w in want {
                            parts.push(f.iter().find(|(t, _)| t == w).map_or(&[][..], |x| x.1));
                        }
                        hash(&parts)
                    }
                };
                if remove {
                    self.objects.remove(&key);
                } else {
                    self.objects.insert(key, hash(&[payload]));
                }
            }
        }
        Ok(())
    }

    /// An order-independent digest of everything held.
    fn digest(&self) -> u64 {
        let mut d = 0u64;
        for (k, v) in &self.objects {
            d = d.wrapping_add(hash(&[&k.to_le_bytes(), &v.to_le_bytes()]));
        }
        for (k, (ty, sum, n)) in &self.ipsets {
            d = d.wrapping_add(hash(&[
                &k.to_le_bytes(),
                &ty.to_le_bytes(),
                &sum.to_le_bytes(),
                &n.to_le_bytes(),
            ]));
        }
        d
    }
}

/// IPSetUpdate.type (field 3, a varint), 0 when absent.
fn type_of(mut b: &[u8]) -> u64 {
    let mut ty = 0;
    while b.has_remaining() {
        let Ok((tag, wire)) = pb::prost::encoding::decode_key(&mut b) else {
            return ty;
        };
        if tag == 3 && wire == pb::prost::encoding::WireType::Varint {
            ty = pb::prost::encoding::decode_varint(&mut b).unwrap_or(0);
        } else if pb::prost::encoding::skip_field(wire, tag, &mut b, Default::default()).is_err() {
            return ty;
        }
    }
    ty
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(payload: To) -> Vec<u8> {
        pb::ToDataplane {
            sequence_number: 7,
            payload: Some(payload),
        }
        .encode_to_vec()
    }

    fn ipset(id: &str, members: &[&str]) -> To {
        To::IpsetUpdate(pb::IpSetUpdate {
            id: id.into(),
            members: members.iter().map(|m| m.to_string()).collect(),
            r#type: 0,
        })
    }

    fn apply(p: &mut Programmed, msg: &[u8]) {
        let s = scan(msg).unwrap();
        p.apply(s.tag, s.payload).unwrap();
    }

    /// What a reader makes of `stream` fed in pieces of `chunk` bytes: each whole message's
    /// hash, or a skipped one's sequence number.
    fn read(stream: &[u8], chunk: usize, skip_ipsets: bool) -> Vec<Result<u64, u64>> {
        let mut reader = Reader::new(skip_ipsets);
        let mut out = Vec::new();
        for piece in stream.chunks(chunk) {
            reader
                .feed(piece, |p| {
                    out.push(match p {
                        Piece::Whole(b) => Ok(hash(&[b])),
                        Piece::Skipped { seq } => Err(seq),
                    });
                    Ok(())
                })
                .unwrap();
        }
        out
    }

    #[test]
    fn the_reader_passes_over_large_ip_sets_only_when_told_and_keeps_every_sequence_number() {
        let members: Vec<String> = (0..1000)
            .map(|i| format!("10.1.{}.{}", i / 256, i % 256))
            .collect();
        let members: Vec<&str> = members.iter().map(String::as_str).collect();
        let message = |seq: u64, payload: To| {
            pb::ToDataplane {
                sequence_number: seq,
                payload: Some(payload),
            }
            .encode_to_vec()
        };
        // The server writes the sequence number after the payload; prost, before it.
        let mut payload_first = Vec::new();
        ipset("s:b", &members).encode(&mut payload_first);
        pb::prost::encoding::uint64::encode(15, &4, &mut payload_first);
        let messages = [
            message(1, To::InSync(pb::InSync {})),
            message(2, ipset("s:small", &["10.0.0.1"])),
            message(3, ipset("s:a", &members)),
            payload_first,
            message(5, To::InSync(pb::InSync {})),
        ];
        assert!(messages[3].len() >= SKIP_MIN && messages[2].len() >= SKIP_MIN);
        let mut stream = Vec::new();
        for m in &messages {
            stream.push(0);
            stream.extend_from_slice(&(m.len() as u32).to_be_bytes());
            stream.extend_from_slice(m);
        }
        let whole: Vec<Result<u64, u64>> = messages.iter().map(|m| Ok(hash(&[m]))).collect();
        let mut skipped = whole.clone();
        skipped[2] = Err(3);
        skipped[3] = Err(4);
        for chunk in [1, 3, 5, 29, 30, 1000, 4096] {
            assert_eq!(read(&stream, chunk, false), whole, "chunks of {chunk}");
            assert_eq!(read(&stream, chunk, true), skipped, "chunks of {chunk}");
        }
        // A message that lies within one piece is read where it lies, skipped or not.
        assert_eq!(read(&stream, stream.len(), true), whole);
    }

    #[test]
    fn the_reader_refuses_a_compressed_frame() {
        let mut reader = Reader::new(true);
        let err = reader.feed(&[1, 0, 0, 0, 1, 8], |_| Ok(())).unwrap_err();
        assert!(err.contains("compressed"), "{err}");
    }

    #[test]
    fn a_scan_finds_the_sequence_number_and_the_payload() {
        let m = to(To::InSync(pb::InSync {}));
        let s = scan(&m).unwrap();
        assert_eq!((s.seq, s.tag), (7, 1));
        let m = to(ipset("s:a", &["10.0.0.1"]));
        assert_eq!(scan(&m).unwrap().tag, 2);
    }

    #[test]
    fn the_digest_is_the_state_whatever_the_order_and_the_deltas() {
        let mut a = Programmed::default();
        apply(&mut a, &to(ipset("s:a", &["10.0.0.1", "10.0.0.2"])));
        let mut b = Programmed::default();
        apply(&mut b, &to(ipset("s:a", &["10.0.0.1"])));
        assert_ne!(a.digest(), b.digest());
        apply(
            &mut b,
            &to(To::IpsetDeltaUpdate(pb::IpSetDeltaUpdate {
                id: "s:a".into(),
                added_members: vec!["10.0.0.2".into()],
                removed_members: vec![],
            })),
        );
        assert_eq!(a.digest(), b.digest());
        let policy = |port: i32| {
            to(To::ActivePolicyUpdate(pb::ActivePolicyUpdate {
                id: Some(pb::PolicyId {
                    name: "bench-sync-marker".into(),
                    ..Default::default()
                }),
                policy: Some(pb::Policy {
                    inbound_rules: vec![pb::Rule {
                        dst_ports: vec![pb::PortRange {
                            first: port,
                            last: port,
                        }],
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            }))
        };
        apply(&mut a, &policy(1));
        apply(&mut b, &policy(2));
        assert_ne!(a.digest(), b.digest());
        apply(&mut b, &policy(1));
        assert_eq!(a.digest(), b.digest());
        assert!(is_marker(scan(&policy(1)).unwrap().payload));
        apply(
            &mut a,
            &to(To::ActivePolicyRemove(pb::ActivePolicyRemove {
                id: Some(pb::PolicyId {
                    name: "bench-sync-marker".into(),
                    ..Default::default()
                }),
            })),
        );
        assert_ne!(a.digest(), b.digest());
    }
}
