//! Admin HTTP endpoint: `/status` (JSON of every node's connection and reported status),
//! `/status/datastore` (JSON: objects held at their last good version, and invalid objects
//! with none), `/status/policies` and `/status/policies/[NAMESPACE/]NAME` (JSON: where each
//! policy is in force, from the engine's realization tracking), `/liveness`, `/readiness` (200 once the datastore is loaded, 503 before; the body
//! names the invalid objects that have no last good version, a degraded condition that does
//! not take the server out of service), `/metrics` (Prometheus text, see `metrics`) and
//! `/explain` (JSON: why traffic is allowed or denied, what applies to an endpoint, where a
//! policy is in force; answered by the engine from its current state, see `calc_graph::explain`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::routing::get;

use super::metrics::{LastGoodHealth, Metrics};
use super::status::{Board, NodeStatus};

#[derive(Clone)]
pub(super) struct AdminState {
    pub board: Arc<Board>,
    pub ready: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
    /// The engine, which answers explain queries from its state.
    pub engine: tokio::sync::mpsc::Sender<super::engine::Input>,
}

/// `/explain`'s parameters: `from` and `to` (with `protocol`, `port`, `source_port`), or
/// `endpoint`, or `policy`.
#[derive(Debug, Default)]
pub(super) struct ExplainParams {
    from: Option<String>,
    to: Option<String>,
    protocol: Option<String>,
    port: Option<String>,
    source_port: Option<String>,
    endpoint: Option<String>,
    policy: Option<String>,
}

/// `%XX` and `+` decoded; `None` for an invalid escape or non-UTF-8 text.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = [bytes.next()?, bytes.next()?];
                out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
            }
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

impl ExplainParams {
    fn parse(query: &str) -> Result<Self, String> {
        let mut p = ExplainParams::default();
        for pair in query.split('&').filter(|s| !s.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v).ok_or_else(|| format!("parameter {k}: invalid escape"))?;
            let slot = match k {
                "from" => &mut p.from,
                "to" => &mut p.to,
                "protocol" => &mut p.protocol,
                "port" => &mut p.port,
                "source_port" => &mut p.source_port,
                "endpoint" => &mut p.endpoint,
                "policy" => &mut p.policy,
                other => {
                    return Err(format!(
                        "unknown parameter {:?}",
                        calc_graph::untrusted::Untrusted(other)
                    ));
                }
            };
            *slot = Some(v);
        }
        Ok(p)
    }

    fn request(self) -> Result<calc_graph::explain::Request, String> {
        use calc_graph::explain::{Query, Request};
        match (self.from, self.to, self.endpoint, self.policy) {
            (Some(from), Some(to), None, None) => Ok(Request::Path(Query {
                from,
                to,
                protocol: self.protocol,
                port: self.port,
                source_port: self.source_port,
            })),
            (None, None, Some(e), None) => Ok(Request::Endpoint(e)),
            (None, None, None, Some(p)) => Ok(Request::Policy(p)),
            _ => Err("give from and to (with protocol and port), or endpoint, or policy".into()),
        }
    }
}

fn json_error(status: StatusCode, error: String) -> (StatusCode, Json<serde_json::Value>) {
    (status, Json(serde_json::json!({ "error": error })))
}

type JsonAnswer = (StatusCode, Json<serde_json::Value>);

/// Asks the engine a question (`make` builds the input around the reply channel); 503 before
/// the datastore is loaded (an answer would describe a partial cluster) or while stopping.
async fn ask<T>(
    s: &AdminState,
    make: impl FnOnce(tokio::sync::oneshot::Sender<T>) -> super::engine::Input,
) -> Result<T, JsonAnswer> {
    if !s.ready.load(Ordering::Relaxed) {
        return Err(json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "datastore not loaded yet".into(),
        ));
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    let stopping = || {
        json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "calc-server is shutting down".into(),
        )
    };
    s.engine.send(make(reply)).await.map_err(|_| stopping())?;
    answer.await.map_err(|_| stopping())
}

async fn explain(State(s): State<AdminState>, RawQuery(query): RawQuery) -> JsonAnswer {
    let request = match ExplainParams::parse(query.as_deref().unwrap_or_default())
        .and_then(ExplainParams::request)
    {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e),
    };
    match ask(&s, |reply| super::engine::Input::Explain { request, reply }).await {
        Ok(Ok(value)) => (StatusCode::OK, Json(value)),
        Ok(Err(e)) => json_error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(answer) => answer,
    }
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

/// Asks the engine where policies are in force (`only`: one policy, with its lagging nodes).
async fn realization(s: &AdminState, only: Option<String>) -> JsonAnswer {
    let single = only.is_some();
    match ask(s, |reply| super::engine::Input::Realization { only, reply }).await {
        Ok(Ok(mut rows)) if single => match rows.pop() {
            Some(row) => (StatusCode::OK, Json(serde_json::json!(row))),
            None => json_error(
                StatusCode::NOT_FOUND,
                "no such policy, and no profile of that name is in use".into(),
            ),
        },
        Ok(Ok(rows)) => (StatusCode::OK, Json(serde_json::json!(rows))),
        Ok(Err(e)) => json_error(StatusCode::BAD_REQUEST, e),
        Err(answer) => answer,
    }
}

async fn policies(State(s): State<AdminState>) -> JsonAnswer {
    realization(&s, None).await
}

async fn policy(State(s): State<AdminState>, Path(name): Path<String>) -> JsonAnswer {
    realization(&s, Some(name)).await
}

pub(super) fn router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/status", get(status))
        .route("/status/datastore", get(datastore))
        .route("/status/policies", get(policies))
        .route("/status/policies/{*name}", get(policy))
        .route("/liveness", get(|| async { "alive\n" }))
        .route("/readiness", get(readiness))
        .route("/metrics", get(metrics))
        .route("/explain", get(explain))
        .with_state(state)
}
