//! What the agents report back, per node, and the file status writer.
//!
//! The board keeps, per node, the latest ProcessStatusUpdate, WorkloadEndpointStatus and
//! HostEndpointStatus, plus connection facts (connected since, dataplane in sync, last sequence
//! number received). It also lists the nodes the datastore knows that never connected, so an
//! operator sees the node that is missing, not only the ones that are there. The admin endpoint reads it; the status writer persists it. The file
//! datastore writes `<node>.json` into the status directory (`--status-dir`, by default `status`
//! inside the datastore directory, which the manifest loader skips), atomically and at most once
//! per interval per node.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::SystemTime;

use felix_proto as pb;
use pb::from_dataplane::Payload;
use serde::Serialize;

/// One node's reported state.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct NodeStatus {
    pub node: String,
    /// The datastore knows the node (a Node resource or endpoints on it).
    pub in_datastore: bool,
    /// Whether an agent is connected now.
    pub connected: bool,
    /// RFC 3339 time the current (or last) stream started.
    pub connected_since: String,
    /// The agent reported DataplaneInSync on the current stream.
    pub dataplane_in_sync: bool,
    /// Highest FromDataplane sequence number received on the current stream.
    pub last_sequence_received: u64,
    /// Messages sent to the node on the current stream.
    pub messages_sent: u64,
    /// The current stream's connection id: reports from an older stream are ignored.
    #[serde(skip)]
    pub conn_id: u64,
    pub agent_version: String,
    /// Latest heartbeat: timestamp and uptime as the agent reported them.
    pub last_heartbeat: Option<Heartbeat>,
    /// Seconds since the latest heartbeat arrived, by the server's clock (admin answers only;
    /// a persisted status file would make it stale).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_age_seconds: Option<u64>,
    #[serde(skip)]
    pub heartbeat_received: Option<std::time::Instant>,
    /// `<orchestrator>/<workload>/<endpoint>` → `up` / `down` / `error`.
    pub workload_endpoints: BTreeMap<String, String>,
    /// Host endpoint id → status.
    pub host_endpoints: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Heartbeat {
    pub iso_timestamp: String,
    pub uptime_seconds: f64,
}

/// Shared between the engine (writer) and the admin endpoint and status writer (readers).
#[derive(Default)]
pub struct Board {
    nodes: Mutex<BTreeMap<String, NodeStatus>>,
    dirty: Mutex<std::collections::BTreeSet<String>>,
    known: Mutex<std::collections::BTreeSet<String>>,
}

fn workload_key(id: &Option<pb::WorkloadEndpointId>) -> String {
    let id = id.clone().unwrap_or_default();
    format!(
        "{}/{}/{}",
        id.orchestrator_id, id.workload_id, id.endpoint_id
    )
}

pub use common::rfc3339_utc as rfc3339;

impl Board {
    fn with(&self, node: &str, f: impl FnOnce(&mut NodeStatus)) {
        let mut nodes = self.nodes.lock();
        let st = nodes.entry(node.to_string()).or_insert_with(|| NodeStatus {
            node: node.to_string(),
            ..Default::default()
        });
        f(st);
        self.dirty.lock().insert(node.to_string());
    }

    /// A new stream for `node` started (replacing any previous one).
    pub fn connected(&self, node: &str, conn_id: u64, agent_version: &str) {
        self.with(node, |s| {
            s.conn_id = conn_id;
            s.connected = true;
            s.connected_since = rfc3339(SystemTime::now());
            s.dataplane_in_sync = false;
            s.last_sequence_received = 1;
            s.messages_sent = 0;
            s.agent_version = agent_version.to_string();
        });
    }

    pub fn disconnected(&self, node: &str) {
        self.with(node, |s| s.connected = false);
    }

    pub fn sent(&self, node: &str, n: u64) {
        if let Some(s) = self.nodes.lock().get_mut(node) {
            s.messages_sent += n;
        }
    }

    /// Marks a node's status for writing again (after a failed write).
    pub fn mark_dirty(&self, node: &str) {
        self.dirty.lock().insert(node.to_string());
    }

    /// Records one report from a node's agent on stream `conn_id`; a report from a stream that
    /// has since been replaced is ignored.
    pub fn report(&self, node: &str, conn_id: u64, msg: &pb::FromDataplane) {
        let current = self
            .nodes
            .lock()
            .get(node)
            .is_some_and(|s| s.conn_id == conn_id);
        if !current {
            return;
        }
        self.with(node, |s| {
            s.last_sequence_received = s.last_sequence_received.max(msg.sequence_number);
            match &msg.payload {
                Some(Payload::ProcessStatusUpdate(p)) => {
                    s.heartbeat_received = Some(std::time::Instant::now());
                    s.last_heartbeat = Some(Heartbeat {
                        iso_timestamp: p.iso_timestamp.clone(),
                        uptime_seconds: p.uptime,
                    });
                }
                Some(Payload::DataplaneInSync(_)) => s.dataplane_in_sync = true,
                Some(Payload::WorkloadEndpointStatusUpdate(u)) => {
                    let status = u.status.clone().unwrap_or_default().status;
                    s.workload_endpoints.insert(workload_key(&u.id), status);
                }
                Some(Payload::WorkloadEndpointStatusRemove(r)) => {
                    s.workload_endpoints.remove(&workload_key(&r.id));
                }
                Some(Payload::HostEndpointStatusUpdate(u)) => {
                    let id = u.id.clone().unwrap_or_default().endpoint_id;
                    s.host_endpoints
                        .insert(id, u.status.clone().unwrap_or_default().status);
                }
                Some(Payload::HostEndpointStatusRemove(r)) => {
                    s.host_endpoints
                        .remove(&r.id.clone().unwrap_or_default().endpoint_id);
                }
                _ => {}
            }
        });
    }

    /// The nodes the datastore knows now (the engine calls it after each datastore batch).
    pub fn set_known(&self, nodes: impl IntoIterator<Item = String>) {
        *self.known.lock() = nodes.into_iter().collect();
    }

    /// Every node that connected at some time or that the datastore knows, by name.
    pub fn snapshot(&self) -> Vec<NodeStatus> {
        let known = self.known.lock().clone();
        let mut all = self.nodes.lock().clone();
        for node in &known {
            all.entry(node.clone()).or_insert_with(|| NodeStatus {
                node: node.clone(),
                ..Default::default()
            });
        }
        all.into_values()
            .map(|mut s| {
                s.in_datastore = known.contains(&s.node);
                s.last_heartbeat_age_seconds = s.heartbeat_received.map(|t| t.elapsed().as_secs());
                s
            })
            .collect()
    }

    /// The nodes whose status changed since the last call (status writers).
    pub fn take_dirty(&self) -> Vec<NodeStatus> {
        let dirty = std::mem::take(&mut *self.dirty.lock());
        let nodes = self.nodes.lock();
        dirty.iter().filter_map(|n| nodes.get(n).cloned()).collect()
    }
}

/// The status directory for the file datastore `file_dir` and `--status-dir` (`None`: no
/// status files). A directory inside `file_dir` other than its `status` is refused: the manifest
/// loader would read the status files as manifests.
pub fn status_dir(file_dir: &Path, flag: Option<&Path>) -> anyhow::Result<Option<PathBuf>> {
    let default = file_dir.join("status");
    let dir = match flag {
        Some(d) if d.as_os_str().is_empty() => return Ok(None),
        Some(d) => d.to_path_buf(),
        None => return Ok(Some(default)),
    };
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let (abs, root) = (canonical(&dir), canonical(file_dir));
    anyhow::ensure!(
        !abs.starts_with(&root) || abs == root.join("status"),
        "--status-dir {} is inside --file-dir {} (only its `status` subdirectory is skipped by \
         the manifest loader); choose a directory outside it",
        dir.display(),
        file_dir.display()
    );
    Ok(Some(dir))
}

/// Writes changed node statuses to `<dir>/<node>.json` every `interval`. A failing directory is
/// reported once (with its path) when it starts failing and once when it recovers, not on every
/// retry.
pub async fn file_writer(board: Arc<Board>, dir: PathBuf, interval: std::time::Duration) {
    let mut tick = tokio::time::interval(interval);
    let mut failing = false;
    loop {
        tick.tick().await;
        for st in board.take_dirty() {
            match write_atomic(&dir, &st).await {
                Err(error) => {
                    if !failing {
                        tracing::error!(%error, dir = %dir.display(), node = %st.node,
                            "cannot write endpoint status files; retrying every --status-interval \
                             (a read-only datastore directory? set --status-dir to a writable one)");
                    }
                    failing = true;
                    board.mark_dirty(&st.node);
                }
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!(dir = %dir.display(), "writing endpoint status files again");
                }
                Ok(()) => {}
            }
        }
    }
}

async fn write_atomic(dir: &Path, st: &NodeStatus) -> std::io::Result<()> {
    tokio::fs::create_dir_all(dir).await?;
    let body = serde_json::to_vec_pretty(st).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!(".{}.json.tmp", st.node));
    tokio::fs::write(&tmp, body).await?;
    tokio::fs::rename(&tmp, dir.join(format!("{}.json", st.node))).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_update_the_board() {
        let b = Board::default();
        b.connected("n1", 7, "0.1.0");
        let id = pb::WorkloadEndpointId {
            orchestrator_id: "k8s".into(),
            workload_id: "ns/pod".into(),
            endpoint_id: "eth0".into(),
        };
        b.report(
            "n1",
            7,
            &pb::FromDataplane {
                sequence_number: 4,
                payload: Some(Payload::WorkloadEndpointStatusUpdate(
                    pb::WorkloadEndpointStatusUpdate {
                        id: Some(id.clone()),
                        status: Some(pb::EndpointStatus {
                            status: "up".into(),
                        }),
                        endpoint: None,
                    },
                )),
            },
        );
        let s = &b.snapshot()[0];
        assert_eq!(s.workload_endpoints["k8s/ns/pod/eth0"], "up");
        assert_eq!(s.last_sequence_received, 4);
        // A report from an older, replaced stream is ignored.
        b.report(
            "n1",
            6,
            &pb::FromDataplane {
                sequence_number: 9,
                payload: Some(Payload::DataplaneInSync(pb::DataplaneInSync {})),
            },
        );
        assert!(!b.snapshot()[0].dataplane_in_sync);
        b.report(
            "n1",
            7,
            &pb::FromDataplane {
                sequence_number: 5,
                payload: Some(Payload::WorkloadEndpointStatusRemove(
                    pb::WorkloadEndpointStatusRemove { id: Some(id) },
                )),
            },
        );
        assert!(b.snapshot()[0].workload_endpoints.is_empty());
    }

    #[test]
    fn the_status_dir_stays_out_of_the_manifests() {
        let root = std::env::temp_dir().join(format!("status-dir-{}", std::process::id()));
        std::fs::create_dir_all(root.join("policies")).unwrap();
        assert_eq!(status_dir(&root, None).unwrap(), Some(root.join("status")));
        assert_eq!(status_dir(&root, Some(Path::new(""))).unwrap(), None);
        assert_eq!(
            status_dir(&root, Some(Path::new("/var/run/calc-status"))).unwrap(),
            Some(PathBuf::from("/var/run/calc-status"))
        );
        assert_eq!(
            status_dir(&root, Some(&root.join("status"))).unwrap(),
            Some(root.join("status"))
        );
        let err = status_dir(&root, Some(&root.join("policies"))).unwrap_err();
        assert!(err.to_string().contains("inside --file-dir"), "{err}");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn known_nodes_that_never_connected_are_listed() {
        let b = Board::default();
        b.connected("n1", 1, "0.1.0");
        b.set_known(["n1".to_string(), "n2".to_string()]);
        let s = b.snapshot();
        assert_eq!(
            s.iter()
                .map(|n| (n.node.as_str(), n.in_datastore, n.connected))
                .collect::<Vec<_>>(),
            [("n1", true, true), ("n2", true, false)]
        );
        // A node that left the datastore but is still connected stays listed, marked.
        b.set_known(["n2".to_string()]);
        assert!(!b.snapshot()[0].in_datastore);
        assert!(b.snapshot()[0].last_heartbeat_age_seconds.is_none());
        b.report(
            "n1",
            1,
            &pb::FromDataplane {
                sequence_number: 2,
                payload: Some(Payload::ProcessStatusUpdate(pb::ProcessStatusUpdate {
                    iso_timestamp: "2026-11-24T10:00:00Z".into(),
                    uptime: 3.0,
                })),
            },
        );
        assert_eq!(b.snapshot()[0].last_heartbeat_age_seconds, Some(0));
    }
}
