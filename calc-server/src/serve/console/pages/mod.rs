//! The console's pages: each handler reads its query, asks for the state through the same
//! functions the JSON endpoints use (the status board's snapshot, `/readiness`' text, the
//! datastore's last-good health, and the engine's realization, unused, explain and flow
//! answers through `admin::ask`), shapes it into rows, and renders its template.
//!
//! One module per page family (`overview`, `nodes`, `policies`, `flows`, `recommend`,
//! `explain`); this one
//! holds what they share: the top bar's sections, the error pages, and the 404 for a path that
//! is no page.
//!
//! Contract: a template gets only plain values (strings, numbers, flags, links already
//! percent-encoded by `query`); askama escapes each one as it is written. A missing node or
//! policy is a 404 page naming what was not found; a bad parameter a 400 page naming it; an
//! engine that cannot answer (not loaded yet, busy, stopping) a page with its reason and the
//! same status code as the JSON endpoint.

mod explain;
mod flows;
mod nodes;
mod overview;
mod policies;
mod recommend;

use askama::Template;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::Response;

use super::html;
use crate::status::NodeStatus;

pub(super) use explain::explain;
pub(super) use flows::flows;
pub(super) use nodes::{node, nodes};
pub(super) use overview::overview;
pub(super) use policies::{policies, policy};
pub(super) use recommend::{recommend, recommend_index};

/// The top bar's sections, for `aria-current`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Section {
    Overview,
    Nodes,
    Policies,
    Flows,
    Recommend,
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
            Section::Recommend => "recommend",
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

fn programmed(n: &NodeStatus) -> bool {
    n.programmed.starts_with("yes")
}
