//! The console's pages: each handler reads its query, asks for the state through the same
//! functions the JSON endpoints use (the status board's snapshot, `/readiness`' text, the
//! datastore's last-good health, and the engine's realization, unused, explain and flow
//! answers through `admin::ask`), shapes it into rows, and renders its template.
//!
//! Contract: a template gets only plain values (strings, numbers, flags, links already
//! percent-encoded by `query`); askama escapes each one as it is written. A missing node or
//! policy is a 404 page naming what was not found; a bad parameter a 400 page naming it; an
//! engine that cannot answer (not loaded yet, busy, stopping) a page with its reason and the
//! same status code as the JSON endpoint.

use std::sync::atomic::Ordering;

use askama::Template;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::super::admin::{AdminState, ask, flow_request, readiness_text};
use super::super::engine::{Input, OrderedPolicy, PolicyBoard, PolicyRealization};
use super::html;
use super::query::{build, escape, node_link, pairs, policy_link};
use crate::status::NodeStatus;

/// Rows per page of the flows table unless `page_size` says otherwise.
pub(super) const FLOWS_PAGE: usize = 100;
/// Policies per page of the board.
pub(super) const BOARD_PAGE: usize = 250;

/// The top bar's sections, for `aria-current`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Section {
    Overview,
    Nodes,
    Policies,
    Flows,
    Explain,
}

impl Section {
    /// The section's name, as the top bar's links name it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Section::Overview => "overview",
            Section::Nodes => "nodes",
            Section::Policies => "policies",
            Section::Flows => "flows",
            Section::Explain => "explain",
        }
    }
}

/// What failed: the error page.
#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage {
    title: String,
    section: Section,
    live: bool,
    message: String,
}

fn error_page(status: StatusCode, section: Section, title: &str, message: String) -> Response {
    html(
        status,
        ErrorPage {
            title: title.into(),
            section,
            live: false,
            message,
        }
        .render(),
    )
}

fn not_found(section: Section, message: String) -> Response {
    error_page(StatusCode::NOT_FOUND, section, "Not found", message)
}

fn bad_request(section: Section, message: String) -> Response {
    error_page(StatusCode::BAD_REQUEST, section, "Bad request", message)
}

/// The engine's refusal (a JSON answer from `admin::ask`) as a page with the same status.
async fn refused(section: Section, answer: Response) -> Response {
    let status = answer.status();
    let body = axum::body::to_bytes(answer.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
    error_page(status, section, "Not available", message)
}

/// Any path under `/ui/` that is not a page.
pub(super) async fn unknown(Path(rest): Path<String>) -> Response {
    not_found(Section::Overview, format!("no console page /ui/{rest}"))
}

// ---------------------------------------------------------------------------------------
// Overview

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

fn programmed(n: &NodeStatus) -> bool {
    n.programmed.starts_with("yes")
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

pub(super) async fn overview(State(s): State<AdminState>) -> Response {
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

// ---------------------------------------------------------------------------------------
// Nodes

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

pub(super) async fn nodes(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
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

pub(super) async fn node(State(s): State<AdminState>, Path(name): Path<String>) -> Response {
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

// ---------------------------------------------------------------------------------------
// Policies

pub(super) struct BoardRow {
    pub policy: String,
    pub link: String,
    pub kind: String,
    pub staged: bool,
    pub order: String,
    pub selector: String,
    pub desired: u32,
    pub realized: u32,
    pub failed: u32,
    pub phase: String,
    pub hits: String,
    pub last_hit: String,
    /// `unused`, `partly-unused`, `not-yet-known` or empty.
    pub unused: String,
}

pub(super) struct TierGroup {
    pub tier: String,
    pub order: String,
    pub rows: Vec<BoardRow>,
}

#[derive(Template)]
#[template(path = "policies.html")]
pub(super) struct Policies {
    title: String,
    section: Section,
    live: bool,
    q: String,
    total: usize,
    shown: usize,
    page: usize,
    pages: usize,
    prev: String,
    next: String,
    tiers: Vec<TierGroup>,
}

fn order_text(o: Option<f64>) -> String {
    o.map_or_else(|| "none".into(), |o| o.to_string())
}

fn board_row(r: &PolicyRealization, o: Option<&OrderedPolicy>, unused: &str) -> BoardRow {
    BoardRow {
        policy: r.policy.clone(),
        link: policy_link(&r.kind, &r.policy),
        kind: r.kind.clone(),
        staged: r.phase == "Staged",
        order: o.map_or_else(String::new, |o| order_text(o.order)),
        selector: o.map(|o| o.selector.clone()).unwrap_or_default(),
        desired: r.desired,
        realized: r.realized,
        failed: r.failed,
        phase: r.phase.clone(),
        hits: r.hits.map_or_else(|| "-".into(), |h| h.to_string()),
        last_hit: r.last_hit.clone().unwrap_or_else(|| "never".into()),
        unused: unused.into(),
    }
}

/// The board: policies in evaluation order grouped by tier, then the profiles in use; `q`
/// keeps those whose name, kind, tier or selector contains it; paged by [`BOARD_PAGE`].
pub(super) fn policies_page(board: &PolicyBoard, q: &str, page: usize) -> Policies {
    use std::collections::HashMap;
    let rows: HashMap<(&str, &str), &PolicyRealization> = board
        .rows
        .iter()
        .map(|r| ((r.policy.as_str(), r.kind.as_str()), r))
        .collect();
    let unused: HashMap<(&str, &str), &str> = board
        .unused
        .iter()
        .map(|u| ((u.policy.as_str(), u.kind.as_str()), u.state.as_str()))
        .collect();
    let wanted = |policy: &str, kind: &str, tier: &str, selector: &str| {
        q.is_empty()
            || policy.contains(q)
            || kind.contains(q)
            || tier.contains(q)
            || selector.contains(q)
    };
    // What matches, in evaluation order, then the profiles; rows are built for the page only.
    type Match<'b> = (Option<&'b OrderedPolicy>, &'b PolicyRealization, &'b str);
    let mut all: Vec<Match<'_>> = Vec::new();
    for o in &board.order {
        let Some(r) = rows.get(&(o.policy.as_str(), o.kind.as_str())) else {
            continue;
        };
        if !wanted(&o.policy, &o.kind, &o.tier, &o.selector) {
            continue;
        }
        let u = unused
            .get(&(o.policy.as_str(), o.kind.as_str()))
            .copied()
            .unwrap_or_default();
        all.push((Some(o), r, u));
    }
    for r in board.rows.iter().filter(|r| r.kind == "Profile") {
        if !wanted(&r.policy, &r.kind, "", "") {
            continue;
        }
        let u = unused
            .get(&(r.policy.as_str(), r.kind.as_str()))
            .copied()
            .unwrap_or_default();
        all.push((None, r, u));
    }
    let total = all.len();
    let pages = total.div_ceil(BOARD_PAGE).max(1);
    let page = page.min(pages - 1);
    let mut tiers: Vec<TierGroup> = Vec::new();
    for (o, r, u) in all.into_iter().skip(page * BOARD_PAGE).take(BOARD_PAGE) {
        let (tier, order) = match o {
            Some(o) => (o.tier.as_str(), order_text(o.tier_order)),
            None => ("(profiles)", String::new()),
        };
        let row = board_row(r, o, u);
        match tiers.last_mut() {
            Some(t) if t.tier == tier => t.rows.push(row),
            _ => tiers.push(TierGroup {
                tier: tier.to_string(),
                order,
                rows: vec![row],
            }),
        }
    }
    let link = |p: usize| {
        format!(
            "/ui/policies{}",
            build(&[("q", q), ("page", &p.to_string())])
        )
    };
    Policies {
        title: "Policies".into(),
        section: Section::Policies,
        live: true,
        q: q.into(),
        total,
        shown: tiers.iter().map(|t| t.rows.len()).sum(),
        page,
        pages,
        prev: if page > 0 {
            link(page - 1)
        } else {
            String::new()
        },
        next: if page + 1 < pages {
            link(page + 1)
        } else {
            String::new()
        },
        tiers,
    }
}

pub(super) async fn policies(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    let (mut q, mut page) = (String::new(), 0usize);
    match pairs(query.as_deref()) {
        Ok(p) => {
            for (k, v) in p {
                match k.as_str() {
                    "q" => q = v.trim().to_string(),
                    "page" => match v.parse() {
                        Ok(n) => page = n,
                        Err(_) => {
                            return bad_request(
                                Section::Policies,
                                "parameter page: not a whole number".into(),
                            );
                        }
                    },
                    _ => {
                        return bad_request(Section::Policies, format!("unknown parameter {k:?}"));
                    }
                }
            }
        }
        Err(e) => return bad_request(Section::Policies, e),
    }
    match ask(&s, |reply| Input::PolicyBoard { reply }).await {
        Ok(board) => html(StatusCode::OK, policies_page(&board, &q, page).render()),
        Err(answer) => refused(Section::Policies, answer).await,
    }
}

pub(super) struct RuleRow {
    pub direction: String,
    pub index: u32,
    pub action: String,
    pub text: String,
    pub packets: String,
    pub bytes: String,
    pub last_hit: String,
    pub nodes: String,
}

pub(super) struct LagRow {
    pub node: String,
    pub link: String,
    pub state: String,
    pub reason: String,
}

#[derive(Template)]
#[template(path = "policy.html")]
pub(super) struct PolicyPage {
    title: String,
    section: Section,
    live: bool,
    kind: String,
    staged: bool,
    tier: String,
    selector: String,
    phase: String,
    desired: u32,
    realized: u32,
    failed: u32,
    hits: String,
    last_hit: String,
    rules: Vec<RuleRow>,
    lagging: Vec<LagRow>,
    endpoints: Vec<String>,
    more_endpoints: usize,
    flows_link: String,
}

/// Endpoints listed on a policy's page (the rest counted).
const ENDPOINTS_SHOWN: usize = 200;

/// A policy's page from its single-policy realization row (rules with hits, lagging nodes)
/// and, when explain knows it (not for a profile), its reach (selector, rules' text,
/// endpoints).
pub(super) fn policy_page(
    row: &PolicyRealization,
    reach: Option<&calc_graph::explain::PolicyReach>,
) -> PolicyPage {
    let text_of = |dir: &str, index: u32| {
        reach
            .and_then(|p| {
                p.rules.iter().find(|l| {
                    l.index == index
                        && serde_json::to_value(l.direction).ok().as_ref()
                            == Some(&serde_json::Value::from(dir))
                })
            })
            .map(|l| l.text.clone())
            .unwrap_or_default()
    };
    let count = |c: Option<u64>| c.map_or_else(|| "-".into(), |c| c.to_string());
    let rules = row
        .rules
        .iter()
        .flatten()
        .map(|r| RuleRow {
            text: text_of(&r.direction, r.index),
            direction: r.direction.clone(),
            index: r.index,
            action: r.action.clone(),
            packets: count(r.packets),
            bytes: count(r.bytes),
            last_hit: r.last_hit.clone().unwrap_or_else(|| "never".into()),
            nodes: if r.nodes.is_empty() {
                "-".into()
            } else {
                r.nodes.join(", ")
            },
        })
        .collect();
    let endpoints = reach.map(|p| p.endpoints.as_slice()).unwrap_or_default();
    let flows_policy = if row.kind == "Profile" {
        String::new()
    } else {
        row.policy.clone()
    };
    PolicyPage {
        title: format!("Policy {}", row.policy),
        section: Section::Policies,
        live: true,
        kind: row.kind.clone(),
        staged: row.phase == "Staged",
        tier: row.tier.clone(),
        selector: reach.map(|p| p.selector.clone()).unwrap_or_default(),
        phase: row.phase.clone(),
        desired: row.desired,
        realized: row.realized,
        failed: row.failed,
        hits: count(row.hits),
        last_hit: row.last_hit.clone().unwrap_or_else(|| "never".into()),
        rules,
        lagging: row
            .lagging
            .iter()
            .map(|l| LagRow {
                node: l.node.clone(),
                link: node_link(&l.node),
                state: l.state.clone(),
                reason: l.reason.clone(),
            })
            .collect(),
        endpoints: endpoints.iter().take(ENDPOINTS_SHOWN).cloned().collect(),
        more_endpoints: endpoints.len().saturating_sub(ENDPOINTS_SHOWN),
        flows_link: if flows_policy.is_empty() {
            String::new()
        } else {
            format!("/ui/flows{}", build(&[("policy", &flows_policy)]))
        },
    }
}

pub(super) async fn policy(State(s): State<AdminState>, Path(name): Path<String>) -> Response {
    use super::super::engine::FindError;
    let only = Some(name.clone());
    let row = match ask(&s, |reply| Input::Realization { only, reply }).await {
        Ok(Ok(mut rows)) => match rows.pop() {
            Some(row) => row,
            None => {
                return not_found(
                    Section::Policies,
                    format!("no policy {name:?}, and no profile of that name is in use"),
                );
            }
        },
        Ok(Err(e @ FindError::NoPolicy(_))) => return not_found(Section::Policies, e.to_string()),
        Ok(Err(e)) => return bad_request(Section::Policies, e.to_string()),
        Err(answer) => return refused(Section::Policies, answer).await,
    };
    // Explain's reach for the selector, the rules' text and the endpoints (asked by kind and
    // name, so that it is the same policy); a profile has none.
    let reach = if row.kind == "Profile" {
        None
    } else {
        let request = calc_graph::explain::Request::Policy(format!("{}:{}", row.kind, row.policy));
        match ask(&s, |reply| Input::Explain { request, reply }).await {
            Ok(Ok(v)) => serde_json::from_value(v).ok(),
            _ => None,
        }
    };
    html(StatusCode::OK, policy_page(&row, reach.as_ref()).render())
}

// ---------------------------------------------------------------------------------------
// Flows

pub(super) struct HitItem {
    pub text: String,
    /// The policy's page, when the hit names a policy.
    pub link: String,
}

pub(super) struct FlowRow {
    pub key: String,
    pub start: String,
    pub source: String,
    pub dest: String,
    pub port: String,
    pub action: String,
    pub reporter: String,
    pub packets: String,
    pub bytes: String,
    pub rule: String,
    pub source_labels: String,
    pub dest_labels: String,
    pub enforced: Vec<HitItem>,
    pub pending: Vec<HitItem>,
}

/// The flows filter form's values (as given, for the form and the links).
#[derive(Default)]
pub(super) struct FlowFilters {
    pub namespace: String,
    pub name: String,
    pub action: String,
    pub policy: String,
    pub port: String,
    /// Seconds back from now.
    pub since: String,
    pub page: usize,
    pub page_size: usize,
}

impl FlowFilters {
    fn parse(query: Option<&str>) -> Result<FlowFilters, String> {
        let mut f = FlowFilters {
            since: "3600".into(),
            page_size: FLOWS_PAGE,
            ..Default::default()
        };
        for (k, v) in pairs(query)? {
            let v = v.trim().to_string();
            match k.as_str() {
                "namespace" => f.namespace = v,
                "name" => f.name = v,
                "action" => f.action = v,
                "policy" => f.policy = v,
                "port" => f.port = v,
                "since" => f.since = v,
                "page" => {
                    f.page = v
                        .parse()
                        .map_err(|_| "parameter page: not a whole number".to_string())?;
                }
                "page_size" => {
                    f.page_size = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or("parameter page_size: a whole number from 1 to 1000")?;
                }
                _ => return Err(format!("unknown parameter {k:?}")),
            }
        }
        Ok(f)
    }

    /// The store's question: everything but namespace and name, which match either side
    /// (as `calc-server flows --namespace/--name`) and are applied here.
    fn request(&self) -> Result<crate::flows::FlowListRequest, String> {
        let mut q = Vec::new();
        if !self.since.is_empty() {
            let secs: u64 = self
                .since
                .parse()
                .ok()
                .filter(|s| *s > 0)
                .ok_or("parameter since: a whole number of seconds above 0")?;
            q.push(format!("start_time_gte=-{secs}"));
        }
        for (k, v) in [
            ("action", &self.action),
            ("policy", &self.policy),
            ("dest_port", &self.port),
        ] {
            if !v.is_empty() {
                q.push(format!("{k}={}", escape(v)));
            }
        }
        let local = !self.namespace.is_empty() || !self.name.is_empty();
        if !local {
            q.push(format!("page={}&page_size={}", self.page, self.page_size));
        }
        flow_request(&q.join("&")).map_err(|e| e.replace("dest_port", "port"))
    }

    fn link(&self, page: usize) -> String {
        let page = page.to_string();
        let size = if self.page_size == FLOWS_PAGE {
            String::new()
        } else {
            self.page_size.to_string()
        };
        format!(
            "/ui/flows{}",
            build(&[
                ("namespace", &self.namespace),
                ("name", &self.name),
                ("action", &self.action),
                ("policy", &self.policy),
                ("port", &self.port),
                ("since", &self.since),
                ("page", if page == "0" { "" } else { &page }),
                ("page_size", &size),
            ])
        )
    }
}

#[derive(Template)]
#[template(path = "flows.html")]
pub(super) struct Flows {
    title: String,
    section: Section,
    live: bool,
    f: FlowFilters,
    off: bool,
    total: usize,
    page: usize,
    pages: usize,
    prev: String,
    next: String,
    rows: Vec<FlowRow>,
}

/// `/ui/policies/…` for a trace hit (`None` for an end of tier or a profile).
fn hit_link(h: &serde_json::Value) -> String {
    let text = |k: &str| h[k].as_str().unwrap_or_default();
    let (ns, name) = (text("namespace"), text("name"));
    let policy = if ns.is_empty() || ns == "-" {
        name.to_string()
    } else {
        format!("{ns}/{name}")
    };
    let kind = match text("kind") {
        "CalicoNetworkPolicy" => "NetworkPolicy",
        "GlobalNetworkPolicy" => "GlobalNetworkPolicy",
        "StagedNetworkPolicy" => "StagedNetworkPolicy",
        "StagedGlobalNetworkPolicy" => "StagedGlobalNetworkPolicy",
        "StagedKubernetesNetworkPolicy" => "StagedKubernetesNetworkPolicy",
        // A Kubernetes NetworkPolicy is Calico's `knp.default.NAME`.
        "NetworkPolicy" => {
            let k8s = if ns.is_empty() {
                format!("knp.default.{name}")
            } else {
                format!("{ns}/knp.default.{name}")
            };
            return policy_link("NetworkPolicy", &k8s);
        }
        "ClusterNetworkPolicyAdminTier" | "ClusterNetworkPolicyBaselineTier" => "",
        _ => return String::new(),
    };
    if kind.is_empty() {
        format!("/ui/policies/{}", super::query::escape_path(&policy))
    } else {
        policy_link(kind, &policy)
    }
}

fn flow_row(r: &crate::flows::FlowResult) -> FlowRow {
    let v = serde_json::to_value(r).unwrap_or_default();
    let f = &v["flow"];
    let cells = crate::flows::words::row(f);
    let trace = |field: &str| -> Vec<HitItem> {
        f["Key"]["policies"][field]
            .as_array()
            .into_iter()
            .flatten()
            .map(|h| HitItem {
                text: crate::flows::words::hit(h),
                link: hit_link(h),
            })
            .collect()
    };
    let labels = |k: &str| {
        f[k].as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let cell = |i: usize| cells.get(i).cloned().unwrap_or_default();
    FlowRow {
        key: format!("{}-{}", r.id, cell(0)),
        start: cell(0),
        source: cell(1),
        dest: cell(2),
        port: cell(3),
        action: cell(4),
        reporter: cell(5),
        packets: cell(6),
        bytes: cell(7),
        rule: cell(8),
        source_labels: labels("source_labels"),
        dest_labels: labels("dest_labels"),
        enforced: trace("enforced_policies"),
        pending: trace("pending_policies"),
    }
}

/// Whether a flow's source or destination has the namespace and the name asked for.
fn flow_matches(r: &crate::flows::FlowResult, f: &FlowFilters) -> bool {
    let Some(k) = r.flow.as_ref().and_then(|f| f.key.as_ref()) else {
        return false;
    };
    (f.namespace.is_empty() || k.source_namespace == f.namespace || k.dest_namespace == f.namespace)
        && (f.name.is_empty() || k.source_name == f.name || k.dest_name == f.name)
}

/// The flows page from the store's answer (`None`: flow logs are off). Without a namespace or
/// name filter the store paged it; with one, it answered every match and the page is cut here.
pub(super) fn flows_page(f: FlowFilters, answer: Option<crate::flows::FlowListResult>) -> Flows {
    let off = answer.is_none();
    let answer = answer.unwrap_or_default();
    let local = !f.namespace.is_empty() || !f.name.is_empty();
    let (total, pages, rows): (usize, usize, Vec<FlowRow>) = if local {
        let matched: Vec<&crate::flows::FlowResult> = answer
            .flows
            .iter()
            .filter(|r| flow_matches(r, &f))
            .collect();
        let total = matched.len();
        let rows = matched
            .into_iter()
            .skip(f.page * f.page_size)
            .take(f.page_size)
            .map(flow_row)
            .collect();
        (total, total.div_ceil(f.page_size), rows)
    } else {
        let meta = answer.meta.unwrap_or_default();
        (
            usize::try_from(meta.total_results).unwrap_or_default(),
            usize::try_from(meta.total_pages).unwrap_or_default(),
            answer.flows.iter().map(flow_row).collect(),
        )
    };
    let pages = pages.max(1);
    Flows {
        title: "Flows".into(),
        section: Section::Flows,
        live: true,
        off,
        total,
        page: f.page,
        pages,
        prev: if f.page > 0 {
            f.link(f.page - 1)
        } else {
            String::new()
        },
        next: if f.page + 1 < pages {
            f.link(f.page + 1)
        } else {
            String::new()
        },
        rows,
        f,
    }
}

pub(super) async fn flows(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    let (filters, request) =
        match FlowFilters::parse(query.as_deref()).and_then(|f| Ok((f.request()?, f))) {
            Ok((r, f)) => (f, r),
            Err(e) => return bad_request(Section::Flows, e),
        };
    match ask(&s, |reply| Input::FlowList { request, reply }).await {
        Ok(Some(Ok(result))) => html(StatusCode::OK, flows_page(filters, Some(result)).render()),
        Ok(Some(Err(e))) => bad_request(Section::Flows, e.to_string()),
        Ok(None) => html(StatusCode::OK, flows_page(filters, None).render()),
        Err(answer) => refused(Section::Flows, answer).await,
    }
}

// ---------------------------------------------------------------------------------------
// Explain

pub(super) struct StepRow {
    pub stage: String,
    pub what: String,
    pub link: String,
    pub selected: String,
    pub rule: String,
    pub outcome: String,
    pub detail: Vec<String>,
}

pub(super) struct SideView {
    pub title: String,
    pub endpoint: String,
    pub verdict: String,
    pub steps: Vec<StepRow>,
}

pub(super) struct ExplainForm {
    pub from: String,
    pub to: String,
    pub protocol: String,
    pub port: String,
}

#[derive(Template)]
#[template(path = "explain.html")]
pub(super) struct ExplainPage {
    title: String,
    section: Section,
    live: bool,
    form: ExplainForm,
    error: String,
    /// The CLI's first line (`ALLOW tcp port 80`), empty before a question.
    verdict: String,
    allowed: bool,
    /// The CLI's whole text answer.
    text: String,
    sides: Vec<SideView>,
}

fn step_row(s: &calc_graph::explain::Step) -> StepRow {
    let mut what = Vec::new();
    if let Some(e) = &s.endpoint {
        what.push(e.clone());
    }
    if let Some(t) = &s.tier {
        what.push(format!("tier {t}"));
    }
    let link = match (&s.policy, &s.kind) {
        (Some(p), Some(k)) => {
            what.push(format!("{k} {p}"));
            policy_link(k, p)
        }
        _ => String::new(),
    };
    if let Some(p) = &s.profile {
        what.push(format!("profile {p}"));
    }
    let mut detail: Vec<String> = s
        .not_matched
        .iter()
        .map(|m| format!("rule {} ({}) did not match: {}", m.index, m.action, m.why))
        .collect();
    if let Some(n) = &s.note {
        detail.push(format!("note: {n}"));
    }
    StepRow {
        stage: s.stage.clone(),
        what: what.join(" / "),
        link,
        selected: match (s.selected, &s.selector) {
            (Some(false), Some(sel)) => format!("not selected (selector `{sel}`)"),
            (Some(true), _) => "selected".into(),
            _ => String::new(),
        },
        rule: s
            .rule
            .as_ref()
            .map(|r| format!("rule {} ({})", r.index, r.action))
            .unwrap_or_default(),
        outcome: s.outcome.clone(),
        detail,
    }
}

/// The explain page for a form and, once asked, the answer or the reason there is none.
pub(super) fn explain_page(
    form: ExplainForm,
    answer: Option<Result<calc_graph::explain::Explanation, String>>,
) -> ExplainPage {
    let mut page = ExplainPage {
        title: "Explain".into(),
        section: Section::Explain,
        live: false,
        form,
        error: String::new(),
        verdict: String::new(),
        allowed: false,
        text: String::new(),
        sides: Vec::new(),
    };
    match answer {
        None => {}
        Some(Err(e)) => page.error = e,
        Some(Ok(e)) => {
            page.text = calc_graph::explain::render_text(&e);
            page.verdict = page.text.lines().next().unwrap_or_default().to_string();
            page.allowed = e.verdict == calc_graph::explain::Verdict::Allow;
            let verdict = |s: &calc_graph::explain::Side| {
                serde_json::to_value(s.verdict)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_uppercase))
                    .unwrap_or_default()
            };
            for (title, side) in [("egress", &e.egress), ("ingress", &e.ingress)] {
                page.sides.push(SideView {
                    title: title.into(),
                    endpoint: side
                        .endpoint
                        .clone()
                        .unwrap_or_else(|| "(outside the cluster)".into()),
                    verdict: verdict(side),
                    steps: side.steps.iter().map(step_row).collect(),
                });
            }
        }
    }
    page
}

pub(super) async fn explain(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    let mut form = ExplainForm {
        from: String::new(),
        to: String::new(),
        protocol: "tcp".into(),
        port: String::new(),
    };
    match pairs(query.as_deref()) {
        Ok(p) => {
            for (k, v) in p {
                let v = v.trim().to_string();
                match k.as_str() {
                    "from" => form.from = v,
                    "to" => form.to = v,
                    "protocol" => form.protocol = v,
                    "port" => form.port = v,
                    _ => {
                        return bad_request(Section::Explain, format!("unknown parameter {k:?}"));
                    }
                }
            }
        }
        Err(e) => return bad_request(Section::Explain, e),
    }
    if form.from.is_empty() || form.to.is_empty() {
        let answer = (!form.from.is_empty() || !form.to.is_empty())
            .then(|| Err("give both from and to".to_string()));
        return html(StatusCode::OK, explain_page(form, answer).render());
    }
    let request = calc_graph::explain::Request::Path(calc_graph::explain::Query {
        from: form.from.clone(),
        to: form.to.clone(),
        protocol: (!form.protocol.is_empty()).then(|| form.protocol.clone()),
        port: (!form.port.is_empty()).then(|| form.port.clone()),
        source_port: None,
    });
    if !s.ready.load(Ordering::Relaxed) {
        return html(
            StatusCode::SERVICE_UNAVAILABLE,
            explain_page(form, Some(Err("datastore not loaded yet".into()))).render(),
        );
    }
    let answer = match ask(&s, |reply| Input::Explain { request, reply }).await {
        Ok(Ok(v)) => serde_json::from_value(v).map_err(|e| format!("decoding the answer: {e}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(answer) => return refused(Section::Explain, answer).await,
    };
    html(StatusCode::OK, explain_page(form, Some(answer)).render())
}
