//! The overview (`/ui/`): readiness and its reason, the datastore's held and invalid objects,
//! node counts and the nodes not programmed, policies by phase, and recent changes (agent
//! streams started last, policies hit last), from the status board, `/readiness`' text, the
//! datastore's last-good health and the realization rows.

use askama::Template;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;

use super::super::super::admin::{AdminState, ask, readiness_text};
use super::super::super::engine::{Input, PolicyRealization};
use super::super::html;
use super::super::query::{node_link, policy_link};
use super::{Section, programmed};
use crate::status::NodeStatus;

pub(super) struct NodeCounts {
    pub total: usize,
    pub in_datastore: usize,
    pub connected: usize,
    pub in_sync: usize,
    pub programmed: usize,
}

pub(super) struct NodeLine {
    pub node: String,
    pub link: String,
    pub what: String,
}

pub(super) struct HitLine {
    pub policy: String,
    pub kind: String,
    pub link: String,
    pub last_hit: String,
}

#[derive(Template)]
#[template(path = "overview.html")]
pub(super) struct Overview {
    title: String,
    section: Section,
    live: bool,
    ready: bool,
    readiness: String,
    held_last_good: Vec<String>,
    without_last_good: Vec<String>,
    counts: NodeCounts,
    /// Nodes not programmed, with why.
    lagging: Vec<NodeLine>,
    /// Streams most recently started.
    connections: Vec<NodeLine>,
    /// Policies by phase, when the engine answered.
    phases: Option<Vec<(String, usize)>>,
    recent_hits: Vec<HitLine>,
}

/// The overview from the board, the readiness text, the datastore's health and the
/// realization rows (`None` when the engine could not answer).
pub(super) fn overview_page(
    snapshot: &[NodeStatus],
    (ready, readiness): (bool, String),
    health: crate::datastore::LastGoodHealth,
    rows: Option<&[PolicyRealization]>,
) -> Overview {
    let counts = NodeCounts {
        total: snapshot.len(),
        in_datastore: snapshot.iter().filter(|n| n.in_datastore).count(),
        connected: snapshot.iter().filter(|n| n.connected).count(),
        in_sync: snapshot.iter().filter(|n| n.dataplane_in_sync).count(),
        programmed: snapshot.iter().filter(|n| programmed(n)).count(),
    };
    let lagging = snapshot
        .iter()
        .filter(|n| !programmed(n))
        .take(20)
        .map(|n| NodeLine {
            node: n.node.clone(),
            link: node_link(&n.node),
            what: n.programmed.clone(),
        })
        .collect();
    let mut started: Vec<&NodeStatus> = snapshot
        .iter()
        .filter(|n| !n.connected_since.is_empty())
        .collect();
    started.sort_by(|a, b| b.connected_since.cmp(&a.connected_since));
    let connections = started
        .into_iter()
        .take(10)
        .map(|n| NodeLine {
            node: n.node.clone(),
            link: node_link(&n.node),
            what: format!(
                "{} {}",
                if n.connected {
                    "connected since"
                } else {
                    "disconnected; last connected"
                },
                n.connected_since
            ),
        })
        .collect();
    let phases = rows.map(|rows| {
        let mut by: std::collections::BTreeMap<String, usize> = Default::default();
        for r in rows.iter().filter(|r| r.kind != "Profile") {
            *by.entry(r.phase.clone()).or_default() += 1;
        }
        by.into_iter().collect()
    });
    let mut hit: Vec<&PolicyRealization> = rows
        .unwrap_or_default()
        .iter()
        .filter(|r| r.last_hit.is_some())
        .collect();
    hit.sort_by(|a, b| b.last_hit.cmp(&a.last_hit));
    let recent_hits = hit
        .into_iter()
        .take(10)
        .map(|r| HitLine {
            policy: r.policy.clone(),
            kind: r.kind.clone(),
            link: policy_link(&r.kind, &r.policy),
            last_hit: r.last_hit.clone().unwrap_or_default(),
        })
        .collect();
    Overview {
        title: "Overview".into(),
        section: Section::Overview,
        live: true,
        ready,
        readiness: readiness.trim_end().to_string(),
        held_last_good: health.held_last_good,
        without_last_good: health.without_last_good,
        counts,
        lagging,
        connections,
        phases,
        recent_hits,
    }
}

pub(in crate::serve::console) async fn overview(State(s): State<AdminState>) -> Response {
    let (code, text) = readiness_text(&s);
    let rows = ask(&s, |reply| Input::Realization { only: None, reply })
        .await
        .ok()
        .and_then(Result::ok);
    let page = overview_page(
        &s.board.snapshot(),
        (code == StatusCode::OK, text),
        s.metrics.last_good(),
        rows.as_deref(),
    );
    html(StatusCode::OK, page.render())
}
