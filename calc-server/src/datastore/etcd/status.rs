//! The etcd status writer: what agents report (on the status [`Board`]) goes to Calico's status
//! keys, as Felix's status reporter and daemon write them.
//!
//! | data | key | value |
//! |---|---|---|
//! | workload endpoint | `/calico/felix/v2/no-region/host/<node>/workload/<orch>/<workload>/endpoint/<ep>` | `{"status":"up"}` |
//! | host endpoint | `/calico/felix/v1/host/<node>/endpoint/<id>` | `{"status":"up"}` |
//! | node liveness | `/calico/felix/v2/no-region/host/<node>/status` (lease, TTL 90 s) and `…/last_reported_status` | `{"time":…,"uptime":…,"first_update":…}` |
//!
//! Each name segment is escaped (`%` → `%25`, `/` → `%2f`; Kubernetes workload ids are
//! `ns/pod`). Writes are rate limited: once per tick (`--status-interval`) the nodes whose
//! reports changed are written, endpoint keys as the difference against what was written
//! before (puts and deletes, in transactions). A node is only written while its agent is
//! connected to this server, so replicas do not fight over a node that moved. The first write
//! after a node (re)connects, every write after a failure, and a periodic resync
//! (`--etcd-status-resync-interval`) list the node's own endpoint status keys instead and
//! rewrite the ones that differ and delete stale ones.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use etcd_client::{Client, GetOptions, PutOptions, Txn, TxnOp};

use super::connect;
use super::watcher::prefix_end;
use crate::args::EtcdArgs;
use crate::status::{Board, Heartbeat, NodeStatus};

/// Felix's `ReportingTTLSecs`: the liveness key expires when reports stop.
pub const STATUS_TTL: Duration = Duration::from_secs(90);

/// Operations per transaction (etcd's default limit is 128).
const TXN_OPS: usize = 100;

/// `%` → `%25`, `/` → `%2f` (libcalico-go's `escapeName`).
pub fn escape(segment: &str) -> String {
    segment.replace('%', "%25").replace('/', "%2f")
}

/// The prefix of a node's workload endpoint status keys.
pub fn workload_prefix(node: &str) -> String {
    format!("/calico/felix/v2/no-region/host/{}/workload/", escape(node))
}

/// The prefix of a node's host endpoint status keys.
pub fn host_endpoint_prefix(node: &str) -> String {
    format!("/calico/felix/v1/host/{}/endpoint/", escape(node))
}

/// `/calico/felix/v2/no-region/host/<node>/status`.
pub fn liveness_key(node: &str) -> String {
    format!("/calico/felix/v2/no-region/host/{}/status", escape(node))
}

/// `/calico/felix/v2/no-region/host/<node>/last_reported_status`.
pub fn last_reported_key(node: &str) -> String {
    format!(
        "/calico/felix/v2/no-region/host/{}/last_reported_status",
        escape(node)
    )
}

fn status_value(status: &str) -> String {
    serde_json::json!({ "status": status }).to_string()
}

/// Every endpoint status key the node should have, with its value.
pub fn desired_keys(st: &NodeStatus) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let wl = workload_prefix(&st.node);
    for (id, status) in &st.workload_endpoints {
        // The board's id is `<orch>/<workload>/<endpoint>`; the workload may hold a `/`.
        let Some((orch, rest)) = id.split_once('/') else {
            continue;
        };
        let Some((workload, endpoint)) = rest.rsplit_once('/') else {
            continue;
        };
        if status.is_empty() {
            continue; // An empty status is a delete, as in Felix.
        }
        out.insert(
            format!(
                "{wl}{}/{}/endpoint/{}",
                escape(orch),
                escape(workload),
                escape(endpoint)
            ),
            status_value(status),
        );
    }
    let hp = host_endpoint_prefix(&st.node);
    for (id, status) in &st.host_endpoints {
        if !status.is_empty() {
            out.insert(format!("{hp}{}", escape(id)), status_value(status));
        }
    }
    out
}

/// The liveness value Felix writes.
pub fn liveness_value(hb: &Heartbeat, first_update: bool) -> String {
    format!(
        "{{\"time\":{},\"uptime\":{},\"first_update\":{first_update}}}",
        serde_json::Value::from(hb.iso_timestamp.as_str()),
        serde_json::Value::from(hb.uptime_seconds)
    )
}

#[derive(Default)]
struct NodeState {
    /// The stream this state belongs to; a new connection starts afresh.
    connected_since: String,
    /// Endpoint status keys as written.
    written: BTreeMap<String, String>,
    /// Whether `written` is known to match etcd (false: list and repair on the next write).
    reconciled: bool,
    /// The heartbeat last written (liveness).
    heartbeat: Option<Heartbeat>,
}

/// Settings of the writer.
pub struct StatusConfig {
    pub args: EtcdArgs,
    /// Rate limit: changed nodes are written once per interval.
    pub interval: Duration,
    /// How often every connected node's status keys are listed and repaired.
    pub resync_interval: Duration,
}

pub struct StatusWriter {
    board: Arc<Board>,
    cfg: StatusConfig,
    client: Option<Client>,
    nodes: HashMap<String, NodeState>,
    /// Nodes whose last write failed (retried every tick).
    retry: BTreeSet<String>,
}

impl StatusWriter {
    pub fn new(board: Arc<Board>, cfg: StatusConfig) -> StatusWriter {
        StatusWriter {
            board,
            cfg,
            client: None,
            nodes: HashMap::new(),
            retry: BTreeSet::new(),
        }
    }

    /// Runs forever (the task is dropped with the runtime).
    pub async fn run(mut self) {
        let mut tick = tokio::time::interval(self.cfg.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut resync = tokio::time::interval_at(
            tokio::time::Instant::now() + self.cfg.resync_interval,
            self.cfg.resync_interval,
        );
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let full = tokio::select! {
                _ = tick.tick() => false,
                _ = resync.tick() => true,
            };
            self.pass(full).await;
        }
    }

    /// One write pass: the dirty nodes, the failed ones, or every node when `full`.
    pub async fn pass(&mut self, full: bool) {
        let mut todo: BTreeMap<String, NodeStatus> = self
            .board
            .take_dirty()
            .into_iter()
            .map(|s| (s.node.clone(), s))
            .collect();
        if full || !self.retry.is_empty() {
            for s in self.board.snapshot() {
                if full || self.retry.contains(&s.node) {
                    todo.insert(s.node.clone(), s);
                }
            }
        }
        if full {
            for n in self.nodes.values_mut() {
                n.reconciled = false;
            }
        }
        if todo.is_empty() {
            return;
        }
        if self.client.is_none() {
            match connect(&self.cfg.args).await {
                Ok(c) => self.client = Some(c),
                Err(error) => {
                    tracing::warn!(error = %format!("{error:#}"), "etcd status writer cannot connect; will retry");
                    self.retry.extend(todo.into_keys());
                    return;
                }
            }
        }
        for (node, st) in todo {
            match self.write_node(&st).await {
                Ok(()) => {
                    self.retry.remove(&node);
                }
                Err(error) => {
                    if self.retry.insert(node.clone()) {
                        tracing::warn!(%node, error = %format!("{error:#}"), "writing endpoint status to etcd failed; will retry");
                    }
                    if let Some(n) = self.nodes.get_mut(&node) {
                        n.reconciled = false;
                    }
                }
            }
        }
    }

    async fn write_node(&mut self, st: &NodeStatus) -> anyhow::Result<()> {
        if !st.connected {
            // Another replica may own the node now; its keys are left as they are (the liveness
            // key expires with its lease).
            self.nodes.remove(&st.node);
            return Ok(());
        }
        let client = self.client.clone().context("no etcd client")?;
        let mut kv = super::watcher::kv_client(&client);
        let ns = self.nodes.entry(st.node.clone()).or_default();
        let first_update = ns.connected_since != st.connected_since;
        if first_update {
            *ns = NodeState {
                connected_since: st.connected_since.clone(),
                ..NodeState::default()
            };
        }
        let desired = desired_keys(st);
        let actual: BTreeMap<String, String> = if ns.reconciled {
            ns.written.clone()
        } else {
            let mut actual = BTreeMap::new();
            for prefix in [workload_prefix(&st.node), host_endpoint_prefix(&st.node)] {
                let mut resp = kv
                    .get(
                        prefix.as_bytes(),
                        Some(GetOptions::new().with_range(prefix_end(prefix.as_bytes()))),
                    )
                    .await
                    .context("listing status keys")?;
                for item in resp.take_kvs() {
                    actual.insert(
                        String::from_utf8_lossy(item.key()).into_owned(),
                        String::from_utf8_lossy(item.value()).into_owned(),
                    );
                }
            }
            actual
        };
        let mut ops = Vec::new();
        for (k, v) in &desired {
            if actual.get(k) != Some(v) {
                ops.push(TxnOp::put(k.as_str(), v.as_str(), None));
            }
        }
        for k in actual.keys() {
            if !desired.contains_key(k) {
                ops.push(TxnOp::delete(k.as_str(), None));
            }
        }
        let changed = ops.len();
        for chunk in ops.chunks(TXN_OPS) {
            kv.txn(Txn::new().and_then(chunk.to_vec()))
                .await
                .context("writing status keys")?;
        }
        if changed > 0 {
            tracing::debug!(node = %st.node, changed, "endpoint status written to etcd");
        }
        ns.written = desired;
        ns.reconciled = true;

        if let Some(hb) = &st.last_heartbeat
            && ns.heartbeat.as_ref() != Some(hb)
        {
            let value = liveness_value(hb, ns.heartbeat.is_none());
            let mut lease = client.lease_client();
            let granted = lease
                .grant(STATUS_TTL.as_secs() as i64, None)
                .await
                .context("granting the liveness lease")?;
            kv.put(
                liveness_key(&st.node),
                value.as_str(),
                Some(PutOptions::new().with_lease(granted.id())),
            )
            .await
            .context("writing the liveness key")?;
            kv.put(last_reported_key(&st.node), value.as_str(), None)
                .await
                .context("writing last_reported_status")?;
            ns.heartbeat = Some(hb.clone());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_escaped_per_segment() {
        let mut st = NodeStatus {
            node: "node-1".into(),
            ..Default::default()
        };
        st.workload_endpoints
            .insert("k8s/prod/backend-1/eth0".into(), "up".into());
        st.workload_endpoints
            .insert("k8s/odd%ns/p/eth0".into(), "down".into());
        st.workload_endpoints.insert("broken".into(), "up".into());
        st.host_endpoints
            .insert("node-1-eth0".into(), "error".into());
        let keys = desired_keys(&st);
        assert_eq!(
            keys.into_iter().collect::<Vec<_>>(),
            [
                (
                    "/calico/felix/v1/host/node-1/endpoint/node-1-eth0".to_string(),
                    r#"{"status":"error"}"#.to_string()
                ),
                (
                    "/calico/felix/v2/no-region/host/node-1/workload/k8s/odd%25ns%2fp/endpoint/eth0"
                        .to_string(),
                    r#"{"status":"down"}"#.to_string()
                ),
                (
                    "/calico/felix/v2/no-region/host/node-1/workload/k8s/prod%2fbackend-1/endpoint/eth0"
                        .to_string(),
                    r#"{"status":"up"}"#.to_string()
                ),
            ]
        );
    }

    #[test]
    fn liveness_value_is_felix_shaped() {
        let hb = Heartbeat {
            iso_timestamp: "2026-01-02T03:04:05Z".into(),
            uptime_seconds: 12.5,
        };
        let v: serde_json::Value = serde_json::from_str(&liveness_value(&hb, true)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"time": "2026-01-02T03:04:05Z", "uptime": 12.5, "first_update": true})
        );
    }
}
