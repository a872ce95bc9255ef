//! The server's metrics, written by the one metrics writer (`common::metrics`, OpenMetrics
//! text) on the admin endpoint's `/metrics`.
//!
//! Counters and histograms are registered once and bumped where things happen (engine,
//! listener, service) with a relaxed atomic add. What is read when scraped (readiness, the
//! rejections and unusable objects the datastore adapter reports, each connected agent's lag,
//! the per-tier realization sums, the per-policy hit totals) is written by a collector
//! ([`Live`]) on each scrape, so a node whose agent left, or a policy deleted, has no series. Names and meanings are listed in `docs/operations.md`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub use crate::datastore::LastGoodHealth;
use crate::datastore::{Health, Rejections, Unusable};

use common::metrics::{self as writer, Histogram};

use super::engine::PolicySeries;

/// One connected agent's queue counters (shared with its connection).
#[derive(Debug)]
struct AgentQueue {
    conn_id: u64,
    queued: Arc<AtomicU64>,
    taken: Arc<AtomicU64>,
}

/// Why a connection or stream was refused before it became an agent's:
/// `limit` (every agent slot taken at hello), `pending_limit` and `pending_per_address`
/// (too many connections not yet agents), `tls_handshake` (failed), `tls_handshake_timeout`
/// (too slow), `preface_timeout` (no HTTP/2 preface in time), `not_http2` (not an HTTP/2
/// client), `hello_timeout` (no accepted AgentHello in time).
pub const REFUSAL_REASONS: [&str; 8] = [
    "limit",
    "pending_limit",
    "pending_per_address",
    "tls_handshake",
    "tls_handshake_timeout",
    "preface_timeout",
    "not_http2",
    "hello_timeout",
];

/// Why an admin connection or request was refused: `connection_limit`
/// (--admin-max-connections), `tls_handshake` and `tls_handshake_timeout`, `unauthenticated`
/// (401: no usable credentials), `forbidden` (403: not an admin identity), `busy` (429: every
/// query slot taken), `timeout` (503: no answer within --admin-query-timeout), `too_large`
/// (413: above --admin-max-response-bytes).
pub const ADMIN_REFUSAL_REASONS: [&str; 8] = [
    "connection_limit",
    "tls_handshake",
    "tls_handshake_timeout",
    "unauthenticated",
    "forbidden",
    "busy",
    "timeout",
    "too_large",
];

/// Why policy hit counts were refused. A report refused whole (its stream ends with
/// INVALID_ARGUMENT), counted once: `too_many_hits` (more than a report may carry),
/// `malformed` (a reference without the id its kind needs, an invalid id), `not_negotiated` (a
/// `RuleStats` on a stream without the `stats` capability). One hit dropped from an accepted
/// report, counted per hit: `stale_stream` (the stream has been replaced or closed),
/// `not_sent` (a policy, profile or tier the node's stream does not hold), `out_of_range` (a
/// rule index past the rules sent), `staged` (a staged policy, never programmed).
pub const RULE_STATS_REFUSAL_REASONS: [&str; 7] = [
    "too_many_hits",
    "malformed",
    "not_negotiated",
    "stale_stream",
    "not_sent",
    "out_of_range",
    "staged",
];

/// Why flow reports or records were refused (`calc_server_flow_reports_refused_total`). A
/// whole report, counted once, ending the stream: `too_many_records`, `malformed` (an address
/// that is not an IP, an interval not a multiple of 15 s, a port or protocol out of range, a
/// trace too long or with an invalid reference or action), `not_negotiated` (a `FlowReport`
/// on a stream without the `flows` capability). One record dropped from an accepted report,
/// counted per record: `rate` (beyond `--flow-max-records-per-second` on its stream),
/// `stale_stream`, `foreign` (its reporting side is no endpoint of the
/// reporting node), `duplicate` (already received: a re-send after a reconnect), `dedup_cap`
/// (too many records remembered for de-duplication), `key_cap` (a new flow key beyond
/// `--flow-max-keys`), `too_old`, `in_future` (outside the hour of buckets kept), `invalid`.
pub const FLOW_REFUSAL_REASONS: [&str; 12] = [
    "too_many_records",
    "malformed",
    "not_negotiated",
    "rate",
    "stale_stream",
    "foreign",
    "duplicate",
    "dedup_cap",
    "key_cap",
    "too_old",
    "in_future",
    "invalid",
];

#[derive(Debug)]
pub struct Metrics {
    /// Every metric below, and [`Live`].
    registry: Registry,
    /// 1 once the datastore snapshot is in the graph: set by [`Self::render`].
    ready: Gauge,
    /// Admin connections and requests refused, by reason (see [`ADMIN_REFUSAL_REASONS`]).
    admin_refused: Vec<Counter>,
    /// Datastore updates applied to the graph (including rejected ones).
    pub updates_processed: Counter,
    /// Complete datastore listings delivered (the first sync and every re-list).
    pub datastore_syncs: Counter,
    /// Objects refused, by stage (shared with the datastore adapter).
    pub rejections: Arc<Rejections>,
    /// Agents refused because their node is not in the datastore.
    pub refused_unknown_nodes: Counter,
    /// Time the engine spent applying one burst of inputs and flushing.
    pub calc_seconds: Histogram,
    /// Connections closed before the gRPC layer, by reason (see [`REFUSAL_REASONS`]).
    refused: Vec<Counter>,
    /// Streams refused with PERMISSION_DENIED (certificate identity vs hello or reports).
    pub permission_denied: Counter,
    /// Messages sent to agents (all streams).
    pub messages_sent: Counter,
    /// Time from a new endpoint's first message to its node's agent reporting it applied.
    pub endpoint_programmed_seconds: Histogram,
    /// `RuleStats` reports accepted (passed to the engine).
    pub rule_stats_reports: Counter,
    /// Rule hit reports and hits refused, by reason (see [`RULE_STATS_REFUSAL_REASONS`]).
    rule_stats_refused: Vec<Counter>,
    /// Policy hit counter entries the engine holds (per node and rule).
    pub rule_stats_entries: Gauge,
    /// Flow reports and records refused, by reason (see [`FLOW_REFUSAL_REASONS`]).
    flow_reports_refused: Vec<Counter>,
    /// Flow records stored.
    pub flow_records: Counter,
    /// Flow records the agents say they dropped (their queue was full).
    pub flow_records_dropped_by_agents: Counter,
    /// Flow keys the store holds.
    pub flow_keys: Gauge,
    /// What is read when scraped.
    live: Arc<Live>,
}

/// The values written when scraped: a collector in the registry.
#[derive(Debug, Default)]
struct Live {
    agents: Mutex<BTreeMap<String, AgentQueue>>,
    /// Per tier: nodes that need its policies, that have applied them, that failed to.
    realization: Mutex<BTreeMap<String, (u64, u64, u64)>>,
    /// Per policy and profile and action: packets and bytes its rules matched, on every node.
    policy_hits: Mutex<Vec<PolicySeries>>,
    /// `--policy-hit-metrics=false`: the series are not exported.
    policy_hits_hidden: std::sync::atomic::AtomicBool,
    rejections: Arc<Rejections>,
    /// What the datastore adapter reports as unusable.
    unusable: Arc<Unusable>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let ready = Gauge::default();
        registry.register(
            "calc_server_ready",
            "1 once the datastore snapshot is in the graph",
            ready.clone(),
        );
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let updates_processed = counter(
            &mut registry,
            "calc_server_datastore_updates",
            "Datastore updates processed by the calculation graph",
        );
        let datastore_syncs = counter(
            &mut registry,
            "calc_server_datastore_syncs",
            "Complete datastore listings delivered to the graph (first sync and every re-list)",
        );
        let messages_sent = counter(
            &mut registry,
            "calc_server_agent_messages_sent",
            "Messages queued to agents, all streams",
        );
        let permission_denied = counter(
            &mut registry,
            "calc_server_permission_denied",
            "Streams refused because the client certificate's node does not match the hello or a report",
        );
        let refused_unknown_nodes = counter(
            &mut registry,
            "calc_server_unknown_node_refusals",
            "Agents refused because their node is not in the datastore (see --allow-unknown-nodes)",
        );
        let refused = writer::counters_by_label(
            &mut registry,
            "calc_server_connections_refused",
            "Connections closed before they became an agent's, by reason",
            "reason",
            &REFUSAL_REASONS,
        );
        let admin_refused = writer::counters_by_label(
            &mut registry,
            "calc_server_admin_refused",
            "Admin connections and requests refused, by reason",
            "reason",
            &ADMIN_REFUSAL_REASONS,
        );
        let calc_seconds = Histogram::default();
        registry.register(
            "calc_server_calc_seconds",
            "Time to apply one burst of inputs to the graph and flush every node's changes",
            calc_seconds.clone(),
        );
        let endpoint_programmed_seconds = Histogram::default();
        registry.register(
            "calc_server_endpoint_programmed_seconds",
            "Time from a new endpoint's first message to its node's agent reporting it in the dataplane",
            endpoint_programmed_seconds.clone(),
        );
        let rule_stats_reports = counter(
            &mut registry,
            "calc_server_rule_stats_reports",
            "RuleStats reports from agents accepted (policy hit counts)",
        );
        let rule_stats_refused = writer::counters_by_label(
            &mut registry,
            "calc_server_rule_stats_refused",
            "Policy hit reports refused whole (too_many_hits, malformed, not_negotiated: the stream ends) and hits dropped (stale_stream, not_sent, out_of_range, staged), by reason",
            "reason",
            &RULE_STATS_REFUSAL_REASONS,
        );
        let rule_stats_entries = Gauge::default();
        registry.register(
            "calc_server_rule_stats_entries",
            "Policy hit counter entries held (one per node and rule that was hit)",
            rule_stats_entries.clone(),
        );
        let flow_reports_refused = writer::counters_by_label(
            &mut registry,
            "calc_server_flow_reports_refused",
            "Flow reports refused whole (too_many_records, malformed, not_negotiated: the stream ends) and flow records dropped (rate, stale_stream, foreign, duplicate, dedup_cap, key_cap, too_old, in_future, invalid), by reason",
            "reason",
            &FLOW_REFUSAL_REASONS,
        );
        let flow_records = counter(
            &mut registry,
            "calc_server_flow_records",
            "Flow records from agents named and stored",
        );
        let flow_records_dropped_by_agents = counter(
            &mut registry,
            "calc_server_flow_records_dropped_by_agents",
            "Flow records the agents report they dropped before sending",
        );
        let flow_keys = Gauge::default();
        registry.register(
            "calc_server_flow_keys",
            "Flow keys the flow store holds",
            flow_keys.clone(),
        );
        let live = Arc::new(Live::default());
        registry.register_collector(Box::new(live.clone()));
        Metrics {
            registry,
            ready,
            admin_refused,
            updates_processed,
            datastore_syncs,
            rejections: live.rejections.clone(),
            refused_unknown_nodes,
            calc_seconds,
            refused,
            permission_denied,
            messages_sent,
            endpoint_programmed_seconds,
            rule_stats_reports,
            rule_stats_refused,
            rule_stats_entries,
            flow_reports_refused,
            flow_records,
            flow_records_dropped_by_agents,
            flow_keys,
            live,
        }
    }
}

impl Metrics {
    /// The per-tier realization counts (desired, realized, failed), as the engine last summed
    /// them.
    pub fn set_realization(&self, tiers: BTreeMap<String, (u64, u64, u64)>) {
        *self.live.realization.lock() = tiers;
    }

    /// The per-policy hit totals, as the engine last published them (sorted); nothing once
    /// [`Metrics::hide_policy_hits`] was called.
    pub(crate) fn set_policy_hits(&self, series: Vec<PolicySeries>) {
        if self
            .live
            .policy_hits_hidden
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        *self.live.policy_hits.lock() = series;
    }

    /// Keeps the per-policy hit totals (and so policy names) off `/metrics`.
    pub(crate) fn hide_policy_hits(&self) {
        self.live
            .policy_hits_hidden
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.live.policy_hits.lock().clear();
    }

    pub fn agent_connected(
        &self,
        node: &str,
        conn_id: u64,
        queued: Arc<AtomicU64>,
        taken: Arc<AtomicU64>,
    ) {
        self.live.agents.lock().insert(
            node.to_string(),
            AgentQueue {
                conn_id,
                queued,
                taken,
            },
        );
    }

    /// Forgets the node's agent (if it is still connection `conn_id`, when given).
    pub fn agent_gone(&self, node: &str, conn_id: Option<u64>) {
        let mut agents = self.live.agents.lock();
        if agents
            .get(node)
            .is_some_and(|a| conn_id.is_none_or(|id| a.conn_id == id))
        {
            agents.remove(node);
        }
    }

    /// Counts a refusal; `reason` is one of [`REFUSAL_REASONS`].
    pub fn refused(&self, reason: &str) {
        if let Some(i) = REFUSAL_REASONS.iter().position(|r| *r == reason) {
            self.refused[i].inc();
        }
    }

    /// Counts an admin refusal; `reason` is one of [`ADMIN_REFUSAL_REASONS`].
    pub fn admin_refused(&self, reason: &str) {
        if let Some(i) = ADMIN_REFUSAL_REASONS.iter().position(|r| *r == reason) {
            self.admin_refused[i].inc();
        }
    }

    /// Counts `n` refused rule hit reports or hits; `reason` is one of
    /// [`RULE_STATS_REFUSAL_REASONS`].
    pub fn rule_stats_refused(&self, reason: &str, n: u64) {
        if let Some(i) = RULE_STATS_REFUSAL_REASONS.iter().position(|r| *r == reason) {
            self.rule_stats_refused[i].inc_by(n);
        }
    }

    /// Counts `n` refused flow reports or records; `reason` is one of
    /// [`FLOW_REFUSAL_REASONS`].
    pub fn flow_reports_refused(&self, reason: &str, n: u64) {
        if let Some(i) = FLOW_REFUSAL_REASONS.iter().position(|r| *r == reason) {
            self.flow_reports_refused[i].inc_by(n);
        }
    }

    /// The part the datastore adapter writes.
    pub fn datastore_health(&self) -> Health {
        Health {
            rejections: self.live.rejections.clone(),
            unusable: self.live.unusable.clone(),
        }
    }

    pub fn last_good(&self) -> LastGoodHealth {
        self.live.unusable.get()
    }

    /// Every metric as OpenMetrics text.
    pub fn render(&self, ready: bool) -> String {
        writer::encode(self.registry_at(ready))
    }

    /// The `/metrics` answer (content type and text).
    pub fn response(&self, ready: bool) -> ([(&'static str, &'static str); 1], String) {
        writer::response(self.registry_at(ready))
    }

    fn registry_at(&self, ready: bool) -> &Registry {
        self.ready.set(i64::from(ready));
        &self.registry
    }
}

impl Collector for Live {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        writer::counters(
            &mut e,
            "calc_server_rejected_objects",
            "Datastore objects rejected, by stage (decode: unreadable; validation: invalid values; unknown_field: a field Calico's API does not define)",
            calc_graph::manifest::RejectStage::ALL
                .map(|stage| ([("stage", stage.as_str())], self.rejections.get(stage))),
        )?;
        let health = self.unusable.get();
        writer::gauge(
            &mut e,
            "calc_server_objects_held_last_good",
            "Objects whose datastore version is unusable; their last good version stays in force",
            health.held_last_good.len() as u64,
        )?;
        writer::gauge(
            &mut e,
            "calc_server_objects_without_last_good",
            "Invalid objects with no known last good version: not in force",
            health.without_last_good.len() as u64,
        )?;
        let realization = self.realization.lock();
        for (i, (name, help)) in [
            (
                "calc_server_policy_nodes_desired",
                "Node-policy pairs where the tier's policies must be in force (their spans)",
            ),
            (
                "calc_server_policy_nodes_realized",
                "Node-policy pairs whose agent reported the policy's current version applied",
            ),
            (
                "calc_server_policy_nodes_failed",
                "Node-policy pairs not realized because the node's last apply failed",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            writer::gauges(
                &mut e,
                name,
                help,
                realization
                    .iter()
                    .map(|(tier, (d, r, f))| ([("tier", tier.as_str())], [*d, *r, *f][i])),
            )?;
        }
        drop(realization);
        let hits = self.policy_hits.lock();
        for (name, help, packets) in [
            (
                "calc_server_policy_hits_packets",
                "Packets the rules of a policy or profile matched, summed over its rules with that action and over every node whose agent reports stats",
                true,
            ),
            (
                "calc_server_policy_hits_bytes",
                "Bytes the rules of a policy or profile matched, summed over its rules with that action and over every node whose agent reports stats",
                false,
            ),
        ] {
            writer::counters(
                &mut e,
                name,
                help,
                hits.iter().map(|s| {
                    (
                        [
                            ("tier", s.tier.as_str()),
                            ("policy", s.policy.as_str()),
                            ("kind", s.kind.as_str()),
                            ("action", s.action),
                        ],
                        if packets { s.packets } else { s.bytes },
                    )
                }),
            )?;
        }
        drop(hits);
        let agents = self.agents.lock();
        writer::gauge(
            &mut e,
            "calc_server_connected_agents",
            "Agents with an accepted Sync stream",
            agents.len() as u64,
        )?;
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
        writer::gauges(
            &mut e,
            "calc_server_agent_lag_messages",
            "Messages queued for the node's agent and not yet taken by its stream",
            agents.iter().map(|(node, a)| {
                (
                    [("node", node.as_str())],
                    c(&a.queued).saturating_sub(c(&a.taken)),
                )
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_openmetrics_text() {
        let m = Metrics::default();
        m.updates_processed.inc_by(3);
        m.calc_seconds.observe(std::time::Duration::from_millis(2));
        m.calc_seconds.observe(std::time::Duration::from_secs(20));
        let q = Arc::new(AtomicU64::new(10));
        let t = Arc::new(AtomicU64::new(4));
        m.agent_connected("node-\"1\"", 1, q, t);
        let text = m.render(true);
        assert!(
            text.contains("calc_server_datastore_updates_total 3\n"),
            "{text}"
        );
        assert!(text.contains("calc_server_calc_seconds_bucket{le=\"0.0025\"} 1\n"));
        assert!(text.contains("calc_server_calc_seconds_bucket{le=\"10.0\"} 1\n"));
        assert!(text.contains("calc_server_calc_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("calc_server_calc_seconds_count 2\n"));
        assert!(text.contains("calc_server_agent_lag_messages{node=\"node-\\\"1\\\"\"} 6\n"));
        assert!(text.contains("calc_server_connected_agents 1\n"));
        // An older connection's departure does not remove the newer one.
        m.agent_gone("node-\"1\"", Some(0));
        assert!(m.render(true).contains("calc_server_connected_agents 1\n"));
        m.agent_gone("node-\"1\"", Some(1));
        assert!(m.render(false).contains("calc_server_connected_agents 0\n"));
        assert!(text.contains("calc_server_ready 1\n"));
        assert!(m.render(false).contains("calc_server_ready 0\n"));
        assert!(text.contains("calc_server_connections_refused_total{reason=\"limit\"} 0\n"));
        assert!(text.contains("calc_server_rejected_objects_total{stage=\"decode\"} 0\n"));
        // Every refusal reason is there from the start; the hit counters' gauge too.
        for reason in RULE_STATS_REFUSAL_REASONS {
            assert!(
                text.contains(&format!(
                    "calc_server_rule_stats_refused_total{{reason=\"{reason}\"}} 0\n"
                )),
                "{text}"
            );
        }
        m.rule_stats_refused("not_sent", 3);
        m.rule_stats_refused("no_such_reason", 1);
        m.rule_stats_entries.set(5);
        let text = m.render(true);
        assert!(text.contains("calc_server_rule_stats_refused_total{reason=\"not_sent\"} 3\n"));
        assert!(
            text.contains("calc_server_rule_stats_entries 5\n"),
            "{text}"
        );
        assert!(text.contains("calc_server_rule_stats_reports_total 0\n"));
        assert!(text.ends_with("\n# EOF\n"), "OpenMetrics: {text}");
        // Every sample line is `name{labels} value` with a number.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }

    /// `--policy-hit-metrics=false` keeps policy names off `/metrics`, whatever the engine
    /// publishes afterwards.
    #[test]
    fn policy_hit_series_can_be_kept_off_metrics() {
        let m = Metrics::default();
        let series = || {
            vec![PolicySeries {
                tier: "security".into(),
                policy: "block-threat-feed".into(),
                kind: "GlobalNetworkPolicy".into(),
                action: "deny",
                packets: 7,
                bytes: 700,
            }]
        };
        m.set_policy_hits(series());
        assert!(m.render(true).contains(
            "calc_server_policy_hits_packets_total{tier=\"security\",policy=\"block-threat-feed\",kind=\"GlobalNetworkPolicy\",action=\"deny\"} 7\n"
        ));
        m.hide_policy_hits();
        m.set_policy_hits(series());
        let text = m.render(true);
        assert!(!text.contains("block-threat-feed"), "{text}");
    }

    /// `/metrics` with 5,000 agents connected: one lag series each, whole and well-formed. It
    /// also prints the time per scrape (a figure for docs/benchmarks.md, not a pass/fail
    /// criterion): `cargo test --release -p calc-server --lib render_time -- --nocapture`.
    #[test]
    fn render_time_with_5000_agents() {
        let m = Metrics::default();
        for i in 0..5000u64 {
            let q = Arc::new(AtomicU64::new(i));
            m.agent_connected(&format!("node-{i}"), i, q, Arc::new(AtomicU64::new(0)));
        }
        let mut tiers = BTreeMap::new();
        tiers.insert("default".to_owned(), (5000, 4990, 10));
        m.set_realization(tiers);
        let rounds = 200;
        let mut bytes = 0;
        let started = std::time::Instant::now();
        for _ in 0..rounds {
            bytes += m.render(true).len();
        }
        let each = started.elapsed() / rounds;
        let text = m.render(true);
        assert!(
            text.ends_with("# EOF\n"),
            "OpenMetrics text ends with # EOF"
        );
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("calc_server_agent_lag_messages{"))
                .count(),
            5000,
            "one lag series per connected agent"
        );
        assert!(text.contains("calc_server_agent_lag_messages{node=\"node-4999\"} 4999\n"));
        println!(
            "render with 5000 agents: {each:?} per scrape, {} bytes",
            bytes / rounds as usize
        );
    }
}
