//! Admin HTTP endpoint: `/status` (JSON of every node's connection and reported status),
//! `/status/datastore` (JSON: objects held at their last good version, and invalid objects
//! with none), `/liveness`, `/readiness` (200 once the datastore is loaded, 503 before; the body
//! names the invalid objects that have no last good version, a degraded condition that does
//! not take the server out of service) and `/metrics` (Prometheus text, see `metrics`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use super::metrics::{LastGoodHealth, Metrics};
use super::status::{Board, NodeStatus};

#[derive(Clone)]
pub(super) struct AdminState {
    pub board: Arc<Board>,
    pub ready: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
}

async fn metrics(State(s): State<AdminState>) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(s.ready.load(Ordering::Relaxed)),
    )
}

async fn status(State(s): State<AdminState>) -> Json<Vec<NodeStatus>> {
    Json(s.board.snapshot())
}

async fn datastore(State(s): State<AdminState>) -> Json<LastGoodHealth> {
    Json(s.metrics.last_good())
}

async fn readiness(State(s): State<AdminState>) -> (StatusCode, String) {
    if !s.ready.load(Ordering::Relaxed) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "datastore not loaded yet\n".into(),
        );
    }
    let health = s.metrics.last_good();
    if health.without_last_good.is_empty() {
        return (StatusCode::OK, "ready\n".into());
    }
    // Serving stays right for every other object: degraded, not unready.
    let shown: Vec<&str> = health
        .without_last_good
        .iter()
        .take(10)
        .map(String::as_str)
        .collect();
    (
        StatusCode::OK,
        format!(
            "ready, degraded: {} invalid objects have no last good version and are not in force: {}{}\n",
            health.without_last_good.len(),
            shown.join(", "),
            if health.without_last_good.len() > shown.len() {
                ", …"
            } else {
                ""
            }
        ),
    )
}

pub(super) fn router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/status", get(status))
        .route("/status/datastore", get(datastore))
        .route("/liveness", get(|| async { "alive\n" }))
        .route("/readiness", get(readiness))
        .route("/metrics", get(metrics))
        .with_state(state)
}
