//! The policy board (`/ui/policies?q=&page=`: tiers in evaluation order, each policy's
//! realization, hits and unused badge, from the engine's `PolicyBoard` answer) and one policy's
//! page (`/ui/policies/[KIND:][NAMESPACE/]NAME`: its rules with hits and where it lags, from
//! the single-policy realization and explain's reach).

use askama::Template;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::super::super::admin::{AdminState, ask};
use super::super::super::engine::{Input, OrderedPolicy, PolicyBoard, PolicyRealization};
use super::super::html;
use super::super::query::{build, node_link, pairs, policy_link};
use super::{Section, bad_request, not_found, refused};

/// Policies per page of the board.
const BOARD_PAGE: usize = 250;

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

pub(in crate::serve::console) async fn policies(
    State(s): State<AdminState>,
    RawQuery(query): RawQuery,
) -> Response {
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

pub(in crate::serve::console) async fn policy(
    State(s): State<AdminState>,
    Path(name): Path<String>,
) -> Response {
    use super::super::super::engine::FindError;
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
