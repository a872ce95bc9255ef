//! The nodes table (`/ui/nodes?q=&state=`) and one node's page (`/ui/nodes/NAME`: its
//! connection, what was last applied, its endpoints' status), from the status board.

use askama::Template;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::super::super::admin::AdminState;
use super::super::html;
use super::super::query::{node_link, pairs};
use super::{Section, bad_request, not_found, programmed};
use crate::status::NodeStatus;

pub(super) struct NodeRow {
    pub node: String,
    pub link: String,
    pub in_datastore: bool,
    pub connected: bool,
    pub connected_since: String,
    pub in_sync: bool,
    pub programmed: String,
    pub programmed_ok: bool,
    pub agent_version: String,
    pub heartbeat: String,
    pub endpoints: String,
}

fn node_row(n: &NodeStatus) -> NodeRow {
    let up = n
        .workload_endpoints
        .values()
        .chain(n.host_endpoints.values())
        .filter(|s| *s == "up")
        .count();
    NodeRow {
        node: n.node.clone(),
        link: node_link(&n.node),
        in_datastore: n.in_datastore,
        connected: n.connected,
        connected_since: n.connected_since.clone(),
        in_sync: n.dataplane_in_sync,
        programmed: n.programmed.clone(),
        programmed_ok: programmed(n),
        agent_version: n.agent_version.clone(),
        heartbeat: n
            .last_heartbeat_age_seconds
            .map_or_else(|| "never".into(), |s| format!("{s}s ago")),
        endpoints: format!(
            "{up} up / {}",
            n.workload_endpoints.len() + n.host_endpoints.len()
        ),
    }
}

#[derive(Template)]
#[template(path = "nodes.html")]
pub(super) struct Nodes {
    title: String,
    section: Section,
    live: bool,
    q: String,
    state: String,
    total: usize,
    rows: Vec<NodeRow>,
}

/// The nodes whose name contains `q`, in the state asked for (`connected`, `disconnected`,
/// `not-programmed`, or all).
pub(super) fn nodes_page(snapshot: &[NodeStatus], q: &str, state: &str) -> Nodes {
    let rows = snapshot
        .iter()
        .filter(|n| q.is_empty() || n.node.contains(q))
        .filter(|n| match state {
            "connected" => n.connected,
            "disconnected" => !n.connected,
            "not-programmed" => !programmed(n),
            _ => true,
        })
        .map(node_row)
        .collect();
    Nodes {
        title: "Nodes".into(),
        section: Section::Nodes,
        live: true,
        q: q.into(),
        state: state.into(),
        total: snapshot.len(),
        rows,
    }
}

pub(in crate::serve::console) async fn nodes(
    State(s): State<AdminState>,
    RawQuery(query): RawQuery,
) -> Response {
    let (mut q, mut state) = (String::new(), String::new());
    match pairs(query.as_deref()) {
        Ok(p) => {
            for (k, v) in p {
                match k.as_str() {
                    "q" => q = v,
                    "state" => state = v,
                    _ => {
                        return bad_request(Section::Nodes, format!("unknown parameter {k:?}"));
                    }
                }
            }
        }
        Err(e) => return bad_request(Section::Nodes, e),
    }
    let page = nodes_page(&s.board.snapshot(), q.trim(), &state);
    html(StatusCode::OK, page.render())
}

#[derive(Template)]
#[template(path = "node.html")]
pub(super) struct NodePage {
    title: String,
    section: Section,
    live: bool,
    row: NodeRow,
    messages_sent: u64,
    applied_sequence: u64,
    reports_applied: bool,
    apply_error: String,
    last_sequence_received: u64,
    heartbeat_time: String,
    /// (endpoint, status) of workloads then host endpoints (`hep:` prefixed).
    endpoints: Vec<(String, String)>,
}

pub(super) fn node_page(n: &NodeStatus) -> NodePage {
    NodePage {
        title: format!("Node {}", n.node),
        section: Section::Nodes,
        live: true,
        row: node_row(n),
        messages_sent: n.messages_sent,
        applied_sequence: n.applied_sequence,
        reports_applied: n.reports_applied,
        apply_error: n.apply_error.clone(),
        last_sequence_received: n.last_sequence_received,
        heartbeat_time: n
            .last_heartbeat
            .as_ref()
            .map(|h| h.iso_timestamp.clone())
            .unwrap_or_default(),
        endpoints: n
            .workload_endpoints
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(
                n.host_endpoints
                    .iter()
                    .map(|(k, v)| (format!("hep:{k}"), v.clone())),
            )
            .collect(),
    }
}

pub(in crate::serve::console) async fn node(
    State(s): State<AdminState>,
    Path(name): Path<String>,
) -> Response {
    match s.board.snapshot().iter().find(|n| n.node == name) {
        Some(n) => html(StatusCode::OK, node_page(n).render()),
        None => not_found(
            Section::Nodes,
            format!(
                "no node {name:?}: the datastore does not know it and no agent for it connected"
            ),
        ),
    }
}
