//! Admin HTTP endpoint: `/status` (JSON of every node's connection and reported status) and
//! `/liveness`, `/readiness` (200 once the datastore is loaded, 503 before) and `/metrics`
//! (Prometheus text, see `metrics`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use super::metrics::Metrics;
use super::status::{Board, NodeStatus};

#[derive(Clone)]
pub struct AdminState {
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

async fn readiness(State(s): State<AdminState>) -> (StatusCode, &'static str) {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "datastore not loaded yet\n",
        )
    }
}

pub fn router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/status", get(status))
        .route("/liveness", get(|| async { "alive\n" }))
        .route("/readiness", get(readiness))
        .route("/metrics", get(metrics))
        .with_state(state)
}
