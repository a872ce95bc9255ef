//! The server's metrics, rendered as Prometheus text on the admin endpoint's `/metrics`.
//!
//! Counters are plain atomics bumped where things happen (engine, listener, service); the
//! per-agent lag is read live from each connection's queue counters. Names and meanings are
//! listed in `docs/operations.md`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

pub use crate::datastore::LastGoodHealth;
use crate::datastore::{Health, Rejections, Unusable};

use common::Histogram;

/// One connected agent's queue counters (shared with its connection).
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

#[derive(Default)]
pub struct Metrics {
    /// Admin connections and requests refused, by reason (see [`ADMIN_REFUSAL_REASONS`]).
    admin_refused: [AtomicU64; ADMIN_REFUSAL_REASONS.len()],
    /// Datastore updates applied to the graph (including rejected ones).
    pub updates_processed: AtomicU64,
    /// Complete datastore listings delivered (the first sync and every re-list).
    pub datastore_syncs: AtomicU64,
    /// Objects refused, by stage (shared with the datastore adapter).
    pub rejections: Arc<Rejections>,
    /// Agents refused because their node is not in the datastore.
    pub refused_unknown_nodes: AtomicU64,
    /// Time the engine spent applying one burst of inputs and flushing.
    pub calc_seconds: Histogram,
    /// Connections closed before the gRPC layer, by reason (see [`REFUSAL_REASONS`]).
    refused: [AtomicU64; REFUSAL_REASONS.len()],
    /// Streams refused with PERMISSION_DENIED (certificate identity vs hello or reports).
    pub permission_denied: AtomicU64,
    /// Messages sent to agents (all streams).
    pub messages_sent: AtomicU64,
    agents: Mutex<BTreeMap<String, AgentQueue>>,
    /// Time from a new endpoint's first message to its node's agent reporting it applied.
    pub endpoint_programmed_seconds: Histogram,
    /// Per tier: nodes that need its policies, that have applied them, that failed to.
    realization: Mutex<BTreeMap<String, (u64, u64, u64)>>,
    /// What the datastore adapter reports as unusable.
    unusable: Arc<Unusable>,
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// The per-tier realization counts (desired, realized, failed), as the engine last summed
    /// them.
    pub fn set_realization(&self, tiers: BTreeMap<String, (u64, u64, u64)>) {
        *self.realization.lock() = tiers;
    }

    pub fn agent_connected(
        &self,
        node: &str,
        conn_id: u64,
        queued: Arc<AtomicU64>,
        taken: Arc<AtomicU64>,
    ) {
        self.agents.lock().insert(
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
        let mut agents = self.agents.lock();
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
            self.refused[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts an admin refusal; `reason` is one of [`ADMIN_REFUSAL_REASONS`].
    pub fn admin_refused(&self, reason: &str) {
        if let Some(i) = ADMIN_REFUSAL_REASONS.iter().position(|r| *r == reason) {
            self.admin_refused[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The part the datastore adapter writes.
    pub fn datastore_health(&self) -> Health {
        Health {
            rejections: self.rejections.clone(),
            unusable: self.unusable.clone(),
        }
    }

    pub fn last_good(&self) -> LastGoodHealth {
        self.unusable.get()
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self, ready: bool) -> String {
        let mut out = String::new();
        let mut one = |name: &str, kind: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
        one(
            "calc_server_ready",
            "gauge",
            "1 once the datastore snapshot is in the graph.",
            u64::from(ready),
        );
        one(
            "calc_server_datastore_updates_total",
            "counter",
            "Datastore updates processed by the calculation graph.",
            c(&self.updates_processed),
        );
        one(
            "calc_server_datastore_syncs_total",
            "counter",
            "Complete datastore listings delivered to the graph (first sync and every re-list).",
            c(&self.datastore_syncs),
        );
        one(
            "calc_server_agent_messages_sent_total",
            "counter",
            "Messages queued to agents, all streams.",
            c(&self.messages_sent),
        );
        one(
            "calc_server_permission_denied_total",
            "counter",
            "Streams refused because the client certificate's node does not match the hello or a report.",
            c(&self.permission_denied),
        );
        one(
            "calc_server_unknown_node_refusals_total",
            "counter",
            "Agents refused because their node is not in the datastore (see --allow-unknown-nodes).",
            c(&self.refused_unknown_nodes),
        );
        let _ = writeln!(
            out,
            "# HELP calc_server_rejected_objects_total Datastore objects rejected, by stage (decode: unreadable; validation: invalid values; unknown_field: a field Calico's API does not define).\n# TYPE calc_server_rejected_objects_total counter"
        );
        for stage in calc_graph::manifest::RejectStage::ALL {
            let _ = writeln!(
                out,
                "calc_server_rejected_objects_total{{stage=\"{}\"}} {}",
                stage.as_str(),
                self.rejections.get(stage)
            );
        }
        let _ = writeln!(
            out,
            "# HELP calc_server_connections_refused_total Connections closed before they became an agent's, by reason.\n# TYPE calc_server_connections_refused_total counter"
        );
        for (reason, n) in REFUSAL_REASONS.iter().zip(&self.refused) {
            let _ = writeln!(
                out,
                "calc_server_connections_refused_total{{reason=\"{reason}\"}} {}",
                c(n)
            );
        }
        let _ = writeln!(
            out,
            "# HELP calc_server_admin_refused_total Admin connections and requests refused, by reason.\n# TYPE calc_server_admin_refused_total counter"
        );
        for (reason, n) in ADMIN_REFUSAL_REASONS.iter().zip(&self.admin_refused) {
            let _ = writeln!(
                out,
                "calc_server_admin_refused_total{{reason=\"{reason}\"}} {}",
                c(n)
            );
        }
        let health = self.last_good();
        let _ = writeln!(
            out,
            "# HELP calc_server_objects_held_last_good Objects whose datastore version is unusable; their last good version stays in force.\n# TYPE calc_server_objects_held_last_good gauge\ncalc_server_objects_held_last_good {}\n# HELP calc_server_objects_without_last_good Invalid objects with no known last good version: not in force.\n# TYPE calc_server_objects_without_last_good gauge\ncalc_server_objects_without_last_good {}",
            health.held_last_good.len(),
            health.without_last_good.len()
        );
        self.calc_seconds.render(
            &mut out,
            "calc_server_calc_seconds",
            "Time to apply one burst of inputs to the graph and flush every node's changes.",
        );
        self.endpoint_programmed_seconds.render(
            &mut out,
            "calc_server_endpoint_programmed_seconds",
            "Time from a new endpoint's first message to its node's agent reporting it in the dataplane.",
        );
        let realization = self.realization.lock();
        for (i, (name, help)) in [
            (
                "calc_server_policy_nodes_desired",
                "Node-policy pairs where the tier's policies must be in force (their spans).",
            ),
            (
                "calc_server_policy_nodes_realized",
                "Node-policy pairs whose agent reported the policy's current version applied.",
            ),
            (
                "calc_server_policy_nodes_failed",
                "Node-policy pairs not realized because the node's last apply failed.",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (tier, (d, r, f)) in realization.iter() {
                let v = [d, r, f][i];
                let _ = writeln!(out, "{name}{{tier=\"{}\"}} {v}", escape_label(tier));
            }
        }
        drop(realization);
        let agents = self.agents.lock();
        let _ = writeln!(
            out,
            "# HELP calc_server_connected_agents Agents with an accepted Sync stream.\n# TYPE calc_server_connected_agents gauge\ncalc_server_connected_agents {}",
            agents.len()
        );
        let _ = writeln!(
            out,
            "# HELP calc_server_agent_lag_messages Messages queued for the node's agent and not yet taken by its stream.\n# TYPE calc_server_agent_lag_messages gauge"
        );
        for (node, a) in agents.iter() {
            let lag = c(&a.queued).saturating_sub(c(&a.taken));
            let _ = writeln!(
                out,
                "calc_server_agent_lag_messages{{node=\"{}\"}} {lag}",
                escape_label(node)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.updates_processed.fetch_add(3, Ordering::Relaxed);
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
        assert!(text.contains("calc_server_calc_seconds_bucket{le=\"10\"} 1\n"));
        assert!(text.contains("calc_server_calc_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("calc_server_calc_seconds_count 2\n"));
        assert!(text.contains("calc_server_agent_lag_messages{node=\"node-\\\"1\\\"\"} 6\n"));
        assert!(text.contains("calc_server_connected_agents 1\n"));
        // An older connection's departure does not remove the newer one.
        m.agent_gone("node-\"1\"", Some(0));
        assert!(m.render(true).contains("calc_server_connected_agents 1\n"));
        m.agent_gone("node-\"1\"", Some(1));
        assert!(m.render(false).contains("calc_server_connected_agents 0\n"));
        // Every sample line is `name{labels} value` with a number.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }

    /// The time to render `/metrics` with 5,000 agents connected (one lag series each). Run
    /// with `cargo test --release -p calc-server --lib -- --ignored render_time`.
    #[test]
    #[ignore = "a timing, not a check"]
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
        println!(
            "render with 5000 agents: {each:?} per scrape, {} bytes",
            bytes / rounds as usize
        );
    }
}
