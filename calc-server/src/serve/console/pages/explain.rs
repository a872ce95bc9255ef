//! Explain (`/ui/explain?from=&to=&protocol=&port=`): the form and, once asked, the engine's
//! walk, with the CLI's verdict line and text (`calc_graph::explain::render_text`).

use std::sync::atomic::Ordering;

use askama::Template;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::super::super::admin::{AdminState, ask};
use super::super::super::engine::Input;
use super::super::html;
use super::super::query::{pairs, policy_link};
use super::{Section, bad_request, refused};

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

pub(in crate::serve::console) async fn explain(
    State(s): State<AdminState>,
    RawQuery(query): RawQuery,
) -> Response {
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
