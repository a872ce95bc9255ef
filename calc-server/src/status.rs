//! What the agents report back, per node: the status board.
//!
//! The board keeps, per node, the latest ProcessStatusUpdate, WorkloadEndpointStatus and
//! HostEndpointStatus, plus connection facts (connected since, dataplane in sync, last sequence
//! number received). It also lists the nodes the datastore knows that never connected, so an
//! operator sees the node that is missing, not only the ones that are there. The admin endpoint
//! reads it; the datastore's status writer persists it.

use parking_lot::Mutex;
use std::collections::BTreeMap;
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
    /// The agent reports what its dataplane holds (`DataplaneApplied`).
    pub reports_applied: bool,
    /// Highest sequence number of the current stream the agent reported in its dataplane.
    pub applied_sequence: u64,
    /// Why the agent's last apply failed (empty when it succeeded).
    pub apply_error: String,
    /// `yes` when the agent has applied everything sent to it, else why not (not connected,
    /// snapshot not applied, last apply failed…); filled in by [`Board::snapshot`].
    pub programmed: String,
}

impl NodeStatus {
    /// Whether the node's dataplane holds what it was sent, else why not: the same reasons the
    /// agent's `/readiness` gives.
    fn programmed(&self) -> String {
        // The ServerHello is sequence number 1; the stream numbers what follows from 2.
        let last_sent = self.messages_sent + 1;
        if !self.connected {
            "no: not connected".into()
        } else if !self.apply_error.is_empty() {
            format!("no: last apply failed: {}", self.apply_error)
        } else if !self.dataplane_in_sync {
            "no: snapshot not applied yet".into()
        } else if !self.reports_applied {
            "yes (snapshot; the agent does not report later applies)".into()
        } else if self.applied_sequence < last_sent {
            format!(
                "behind: applied up to {} of {last_sent}",
                self.applied_sequence
            )
        } else {
            "yes".into()
        }
    }
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
    pub fn connected(&self, node: &str, conn_id: u64, agent_version: &str, reports_applied: bool) {
        self.with(node, |s| {
            s.reports_applied = reports_applied;
            s.applied_sequence = 0;
            s.apply_error.clear();
            s.conn_id = conn_id;
            s.connected = true;
            s.connected_since = common::rfc3339_utc(SystemTime::now());
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
                Some(Payload::DataplaneApplied(a)) => {
                    s.applied_sequence = s.applied_sequence.max(a.applied_sequence_number);
                    s.apply_error = a.error.clone();
                }
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

    /// Whether `name` is a node: one the datastore knows or whose agent connected at some time.
    pub fn is_node(&self, name: &str) -> bool {
        self.known.lock().contains(name) || self.nodes.lock().contains_key(name)
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
                s.programmed = s.programmed();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_update_the_board() {
        let b = Board::default();
        b.connected("n1", 7, "0.1.0", false);
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
    fn known_nodes_that_never_connected_are_listed() {
        let b = Board::default();
        b.connected("n1", 1, "0.1.0", false);
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
