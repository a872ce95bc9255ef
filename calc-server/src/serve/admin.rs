//! Admin HTTP endpoint: `/status` (JSON of every node's connection and reported status),
//! `/status/datastore` (JSON: objects held at their last good version, and invalid objects
//! with none), `/status/policies` and `/status/policies/[NAMESPACE/]NAME` (JSON: where each
//! policy is in force, from the engine's realization tracking, with hit counts; one policy's
//! per rule), `/status/unused[?since=SECONDS]` (JSON: the policies and profiles in force whose
//! rules nothing matched within the window, and those not observed long enough to tell),
//! `/status/verdicts` (JSON: the dataplane's own verdicts, a tier's end and so on, that counted
//! packets),
//! `/liveness`, `/readiness` (200
//! once the datastore is loaded, 503 before; the body names the invalid objects that have no
//! last good version, a degraded condition that does not take the server out of service),
//! `/metrics` (Prometheus text, see `metrics`), `/explain` (JSON: why traffic is allowed or
//! denied, what applies to an endpoint, where a policy is in force; answered by the engine from
//! its current state, see `calc_graph::explain`) and `/recommend`, `/recommend/check` (JSON:
//! staged policies recommended from a namespace's flows, and what the namespace's staged
//! policies would break; see `crate::recommend`).
//!
//! Access: the probes and `/metrics` are open; every other path passes [`AdminAccess`] first
//! (401/403 otherwise). Cost: questions to the engine (`/explain`, `/status/policies…`,
//! `/status/unused`, `/status/verdicts`) hold
//! one of `--admin-max-concurrent-queries` slots until the engine answers (429 when none is
//! free), wait at most `--admin-query-timeout` (503), and no JSON answer above
//! `--admin-max-response-bytes` is sent (413): a flood of questions queues at most that many
//! behind the datastore's updates in the engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::{Path, RawQuery, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::sync::Semaphore;

use super::admin_access::{AdminAccess, Caller, Refusal};
use super::metrics::{LastGoodHealth, Metrics};
use super::status::Board;
use calc_graph::untrusted::Untrusted;

/// What one request may cost.
#[derive(Clone)]
pub(super) struct Bounds {
    /// Slots for questions to the engine.
    pub queries: Arc<Semaphore>,
    pub query_timeout: Duration,
    pub max_response_bytes: usize,
}

#[derive(Clone)]
pub(super) struct AdminState {
    pub board: Arc<Board>,
    pub ready: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
    /// The engine, which answers explain queries from its state.
    pub engine: tokio::sync::mpsc::Sender<super::engine::Input>,
    pub access: Arc<AdminAccess>,
    pub bounds: Bounds,
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

/// Why `/explain`'s query is refused (400; the text is the answer's `error`).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum ParamsError {
    #[error("parameter {0}: invalid escape")]
    InvalidEscape(String),
    #[error("unknown parameter {:?}", calc_graph::untrusted::Untrusted(.0))]
    Unknown(String),
    #[error("give from and to (with protocol and port), or endpoint, or policy")]
    NoQuestion,
    #[error("parameter since: a whole number of seconds above 0")]
    Since,
}

/// `%XX` and `+` decoded; `None` for an invalid escape or non-UTF-8 text.
pub(super) fn percent_decode(s: &str) -> Option<String> {
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
    fn parse(query: &str) -> Result<Self, ParamsError> {
        let mut p = ExplainParams::default();
        for pair in query.split('&').filter(|s| !s.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v).ok_or_else(|| ParamsError::InvalidEscape(k.to_string()))?;
            let slot = match k {
                "from" => &mut p.from,
                "to" => &mut p.to,
                "protocol" => &mut p.protocol,
                "port" => &mut p.port,
                "source_port" => &mut p.source_port,
                "endpoint" => &mut p.endpoint,
                "policy" => &mut p.policy,
                other => return Err(ParamsError::Unknown(other.to_string())),
            };
            *slot = Some(v);
        }
        Ok(p)
    }

    fn request(self) -> Result<calc_graph::explain::Request, ParamsError> {
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
            _ => Err(ParamsError::NoQuestion),
        }
    }
}

pub(super) fn json_error(status: StatusCode, error: String) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        serde_json::json!({ "error": error }).to_string(),
    )
        .into_response()
}

/// `value` as a JSON answer, unless it is larger than the cap (413, naming its size).
fn json_answer(s: &AdminState, status: StatusCode, value: &impl serde::Serialize) -> Response {
    let body = match serde_json::to_vec(value) {
        Ok(b) => b,
        Err(e) => {
            return json_error(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding: {e}"));
        }
    };
    if body.len() > s.bounds.max_response_bytes {
        s.metrics.admin_refused("too_large");
        return json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the answer is {} bytes, above --admin-max-response-bytes {}; ask a narrower question",
                body.len(),
                s.bounds.max_response_bytes
            ),
        );
    }
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

/// Asks the engine a question (`make` builds the input around the reply channel); 503 before
/// the datastore is loaded (an answer would describe a partial cluster), while stopping, or
/// when the engine does not answer in time; 429 when every query slot is taken. The slot is
/// held until the engine has answered, even when the caller stopped waiting, so the engine
/// never has more than the cap of questions queued.
pub(super) async fn ask<T: Send + 'static>(
    s: &AdminState,
    make: impl FnOnce(tokio::sync::oneshot::Sender<T>) -> super::engine::Input,
) -> Result<T, Response> {
    if !s.ready.load(Ordering::Relaxed) {
        return Err(json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "datastore not loaded yet".into(),
        ));
    }
    let Ok(slot) = s.bounds.queries.clone().try_acquire_owned() else {
        s.metrics.admin_refused("busy");
        return Err(json_error(
            StatusCode::TOO_MANY_REQUESTS,
            "too many questions in flight (--admin-max-concurrent-queries); retry shortly".into(),
        ));
    };
    let stopping = || {
        json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "calc-server is shutting down".into(),
        )
    };
    let timed_out = || {
        s.metrics.admin_refused("timeout");
        json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine did not answer within --admin-query-timeout (it is busy with updates); retry".into(),
        )
    };
    let deadline = tokio::time::Instant::now() + s.bounds.query_timeout;
    let (reply, mut answer) = tokio::sync::oneshot::channel();
    match tokio::time::timeout_at(deadline, s.engine.send(make(reply))).await {
        Err(_) => return Err(timed_out()),
        Ok(Err(_)) => return Err(stopping()),
        Ok(Ok(())) => {}
    }
    match tokio::time::timeout_at(deadline, &mut answer).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(stopping()),
        Err(_) => {
            // The question is queued: its slot stays taken until the engine gets to it.
            tokio::spawn(async move {
                let _ = answer.await;
                drop(slot);
            });
            Err(timed_out())
        }
    }
}

async fn explain(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    let request = match ExplainParams::parse(query.as_deref().unwrap_or_default())
        .and_then(ExplainParams::request)
    {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    match ask(&s, |reply| super::engine::Input::Explain { request, reply }).await {
        Ok(Ok(value)) => json_answer(&s, StatusCode::OK, &value),
        Ok(Err(e)) => json_error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(answer) => answer,
    }
}

async fn metrics(State(s): State<AdminState>) -> impl axum::response::IntoResponse {
    s.metrics.response(s.ready.load(Ordering::Relaxed))
}

async fn status(State(s): State<AdminState>) -> Response {
    json_answer(&s, StatusCode::OK, &s.board.snapshot())
}

async fn datastore(State(s): State<AdminState>) -> Response {
    let health: LastGoodHealth = s.metrics.last_good();
    json_answer(&s, StatusCode::OK, &health)
}

async fn readiness(State(s): State<AdminState>) -> (StatusCode, String) {
    readiness_text(&s)
}

/// `/readiness`' answer: 503 before the datastore is loaded, else 200 with `ready` or, when
/// invalid objects have no last good version, `ready, degraded: …` naming them (the console's
/// overview shows the same text).
pub(super) fn readiness_text(s: &AdminState) -> (StatusCode, String) {
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
async fn realization(s: &AdminState, only: Option<String>) -> Response {
    let single = only.is_some();
    match ask(s, |reply| super::engine::Input::Realization { only, reply }).await {
        Ok(Ok(mut rows)) if single => match rows.pop() {
            Some(row) => json_answer(s, StatusCode::OK, &row),
            None => json_error(
                StatusCode::NOT_FOUND,
                "no such policy, and no profile of that name is in use".into(),
            ),
        },
        Ok(Ok(rows)) => json_answer(s, StatusCode::OK, &rows),
        Ok(Err(e)) => json_error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(answer) => answer,
    }
}

/// `/status/unused`'s window: `since=SECONDS` (a whole number above 0), or none (all recorded
/// history). The error is the 400 answer's text.
fn unused_window(query: &str) -> Result<Option<Duration>, ParamsError> {
    let mut window = None;
    for pair in query.split('&').filter(|s| !s.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "since" => {
                let secs = v
                    .parse::<u64>()
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or(ParamsError::Since)?;
                window = Some(Duration::from_secs(secs));
            }
            other => {
                return Err(ParamsError::Unknown(
                    percent_decode(other).unwrap_or_else(|| other.to_string()),
                ));
            }
        }
    }
    Ok(window)
}

async fn unused(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    let window = match unused_window(query.as_deref().unwrap_or_default()) {
        Ok(w) => w,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    match ask(&s, |reply| super::engine::Input::Unused { window, reply }).await {
        Ok(rows) => json_answer(&s, StatusCode::OK, &rows),
        Err(answer) => answer,
    }
}

async fn verdicts(State(s): State<AdminState>) -> Response {
    match ask(&s, |reply| super::engine::Input::Verdicts { reply }).await {
        Ok(rows) => json_answer(&s, StatusCode::OK, &rows),
        Err(answer) => answer,
    }
}

async fn policies(State(s): State<AdminState>) -> Response {
    realization(&s, None).await
}

async fn policy(State(s): State<AdminState>, Path(name): Path<String>) -> Response {
    realization(&s, Some(name)).await
}

/// Reads `/flows`' query into a Goldmane `FlowListRequest`. Parameters (each list parameter
/// may repeat; values of one parameter are alternatives, parameters are combined):
/// `start_time_gte`, `start_time_lt` (Unix seconds; negative: relative to now), `page`,
/// `page_size`, `aggregation_interval` (a multiple of 15 s), `sort_by` (`time`, `dest_name`,
/// `dest_namespace`, `dest_type`, `source_name`, `source_namespace`, `source_type`),
/// `source_name`, `source_namespace`, `dest_name`, `dest_namespace`, `protocol` (exact),
/// `dest_port`, `action` (`allow`, `deny`, `pass`), `policy` (`[KIND:][NAMESPACE/]NAME`, a
/// hit of the enforced or pending trace); and Whisker's (`startTimeGte`, `startTimeLt`,
/// `sortBy`, `filters`, `pageSize`: [`super::whisker`]).
pub(super) fn flow_request(query: &str) -> Result<crate::flows::FlowListRequest, String> {
    use crate::flows::goldmane::{self, Filter, MatchType, PolicyMatch, StringMatch};
    let mut req = crate::flows::FlowListRequest::default();
    let mut filter = Filter::default();
    let mut filtered = false;
    for pair in query.split('&').filter(|s| !s.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k =
            percent_decode(k).ok_or_else(|| ParamsError::InvalidEscape(k.into()).to_string())?;
        let v =
            percent_decode(v).ok_or_else(|| ParamsError::InvalidEscape(k.clone()).to_string())?;
        let int = |v: &str| {
            v.parse::<i64>()
                .map_err(|_| format!("parameter {k}: not a whole number"))
        };
        let exact = |v: String| StringMatch {
            value: v,
            r#type: MatchType::Exact as i32,
        };
        match k.as_str() {
            "start_time_gte" | "startTimeGte" => req.start_time_gte = int(&v)?,
            "start_time_lt" | "startTimeLt" => req.start_time_lt = int(&v)?,
            "page" => req.page = int(&v)?,
            "page_size" | "pageSize" => req.page_size = int(&v)?,
            "sortBy" => req.sort_by.push(super::whisker::sort_option(&v)?),
            "filters" => super::whisker::merge(&mut filter, super::whisker::filters(&v)?),
            "aggregation_interval" => req.aggregation_interval = int(&v)?,
            "sort_by" => {
                let by = match v.as_str() {
                    "time" => goldmane::SortBy::Time,
                    "dest_name" => goldmane::SortBy::DestName,
                    "dest_namespace" => goldmane::SortBy::DestNamespace,
                    "dest_type" => goldmane::SortBy::DestType,
                    "source_name" => goldmane::SortBy::SourceName,
                    "source_namespace" => goldmane::SortBy::SourceNamespace,
                    "source_type" => goldmane::SortBy::SourceType,
                    _ => {
                        return Err(format!(
                            "parameter sort_by: unknown sort {:?}",
                            Untrusted(&v)
                        ));
                    }
                };
                req.sort_by
                    .push(goldmane::SortOption { sort_by: by as i32 });
            }
            "source_name" => filter.source_names.push(exact(v)),
            "source_namespace" => filter.source_namespaces.push(exact(v)),
            "dest_name" => filter.dest_names.push(exact(v)),
            "dest_namespace" => filter.dest_namespaces.push(exact(v)),
            "protocol" => filter.protocols.push(exact(v)),
            "dest_port" => filter
                .dest_ports
                .push(goldmane::PortMatch { port: int(&v)? }),
            "action" => filter.actions.push(match v.as_str() {
                "allow" => goldmane::Action::Allow,
                "deny" => goldmane::Action::Deny,
                "pass" => goldmane::Action::Pass,
                _ => return Err("parameter action: allow, deny or pass".into()),
            } as i32),
            "policy" => {
                let (kind, rest) = match v.split_once(':') {
                    Some((kind, rest)) => {
                        let k = calc_graph::model::Kind::policy_by_name(kind).ok_or_else(|| {
                            format!(
                                "parameter policy: unknown policy kind {:?}",
                                Untrusted(kind)
                            )
                        })?;
                        (Some(k), rest)
                    }
                    None => (None, v.as_str()),
                };
                let (namespace, name) = rest.split_once('/').unwrap_or(("", rest));
                let (kind, name) = match kind {
                    Some(k) => {
                        let (g, n) = super::engine::policy_kind(k, name, "");
                        (g as i32, n)
                    }
                    None => (0, name.to_string()),
                };
                filter.policies.push(PolicyMatch {
                    kind,
                    namespace: namespace.to_string(),
                    name,
                    ..Default::default()
                });
            }
            _ => return Err(ParamsError::Unknown(k).to_string()),
        }
        filtered = true;
    }
    if filtered && filter != Filter::default() {
        req.filter = Some(filter);
    }
    Ok(req)
}

/// Reads `/flows-filter-hints`' query: `type` (`source_name`, `dest_name`,
/// `source_namespace`, `dest_namespace`, `policy_tier`, `policy_name`, or Whisker's
/// `SourceName`, …; required), then the window, paging and filter parameters of
/// [`flow_request`].
pub(super) fn hints_request(query: &str) -> Result<crate::flows::FilterHintsRequest, String> {
    use crate::flows::goldmane::FilterType;
    let mut kind = None;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|s| !s.is_empty()) {
        match pair.split_once('=') {
            Some(("type", v)) => {
                kind = Some(match v {
                    "source_name" => FilterType::SourceName,
                    "dest_name" => FilterType::DestName,
                    "source_namespace" => FilterType::SourceNamespace,
                    "dest_namespace" => FilterType::DestNamespace,
                    "policy_tier" => FilterType::PolicyTier,
                    "policy_name" => FilterType::PolicyName,
                    // Whisker's names: SourceName, DestNamespace, PolicyTier, …
                    _ => super::whisker::filter_type(v).ok_or(
                        "parameter type: source_name, dest_name, source_namespace, dest_namespace, policy_tier or policy_name (or Whisker's SourceName, DestName, …)",
                    )?,
                })
            }
            _ => rest.push(pair),
        }
    }
    let kind = kind.ok_or("parameter type is required")?;
    let list = flow_request(&rest.join("&"))?;
    if !list.sort_by.is_empty() || list.aggregation_interval != 0 {
        return Err("sort_by and aggregation_interval do not apply to filter hints".into());
    }
    Ok(crate::flows::FilterHintsRequest {
        r#type: kind as i32,
        filter: list.filter,
        start_time_gte: list.start_time_gte,
        start_time_lt: list.start_time_lt,
        page: list.page,
        page_size: list.page_size,
    })
}

async fn flow_hints(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    let (goldmane, request) =
        match answer_options(&query.unwrap_or_default()).and_then(|(watch, goldmane, rest)| {
            if watch {
                return Err("filter hints cannot be watched".into());
            }
            Ok((goldmane, hints_request(&rest)?))
        }) {
            Ok(r) => r,
            Err(e) => return json_error(StatusCode::BAD_REQUEST, e),
        };
    let kind = request.r#type;
    match ask(&s, |reply| super::engine::Input::FlowHints {
        request,
        reply,
    })
    .await
    {
        Ok(Some(Ok(result))) if goldmane => json_answer(&s, StatusCode::OK, &result),
        Ok(Some(Ok(result))) => json_answer(
            &s,
            StatusCode::OK,
            &super::whisker::hint_list(&result, kind),
        ),
        Ok(Some(Err(e))) => json_error(StatusCode::BAD_REQUEST, e.to_string()),
        Ok(None) => json_error(
            StatusCode::NOT_FOUND,
            "flow logs are off (serve --flow-logs)".into(),
        ),
        Err(answer) => answer,
    }
}

/// `/flows?watch=true`: server-sent events, one `data:` line per flow (as Whisker's backend
/// writes a flow, or with `goldmane` the proto3 JSON of a Goldmane `FlowResult`) and
/// interval, each once its interval closed (see `goldmane_api::follow`); an error ends the
/// stream with an `event: error` whose data is `{"error": …}`.
async fn watch_flows(
    s: AdminState,
    mut request: crate::flows::FlowListRequest,
    goldmane: bool,
) -> Response {
    use tokio_stream::StreamExt;
    if request.aggregation_interval == 0 {
        request.aggregation_interval = crate::flows::BUCKET_SECONDS;
    }
    let rx = match super::goldmane_api::follow(s, request).await {
        Ok(rx) => rx,
        Err(status) => {
            let code = match status.code() {
                tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
                tonic::Code::FailedPrecondition => StatusCode::NOT_FOUND,
                tonic::Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            return json_error(code, status.message().to_string());
        }
    };
    let events = tokio_stream::wrappers::ReceiverStream::new(rx).map(move |item| {
        let text = match item {
            Ok(r) if goldmane => format!(
                "data: {}\n\n",
                serde_json::to_string(&r).unwrap_or_default()
            ),
            Ok(r) => format!(
                "data: {}\n\n",
                r.flow
                    .as_ref()
                    .map(super::whisker::flow)
                    .unwrap_or_default()
            ),
            Err(status) => format!(
                "event: error\ndata: {}\n\n",
                serde_json::json!({"error": status.message()})
            ),
        };
        Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(text))
    });
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/event-stream"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(events),
    )
        .into_response()
}

/// The `/flows` and `/flows-filter-hints` options that are not part of the question: `watch`
/// and `format` (`whisker`, the default, or `goldmane`). Returns the rest of the query.
fn answer_options(query: &str) -> Result<(bool, bool, String), String> {
    let (mut watch, mut goldmane) = (false, false);
    let mut rest = Vec::new();
    for p in query.split('&').filter(|p| !p.is_empty()) {
        match p {
            "watch=true" => watch = true,
            "watch=false" => {}
            "format=goldmane" => goldmane = true,
            "format=whisker" => goldmane = false,
            _ if p.starts_with("format=") => {
                return Err("parameter format: whisker or goldmane".into());
            }
            _ => rest.push(p),
        }
    }
    Ok((watch, goldmane, rest.join("&")))
}

async fn flows(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    let (watch, goldmane, rest) = match answer_options(&query.unwrap_or_default()) {
        Ok(o) => o,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e),
    };
    let request = match flow_request(&rest) {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e),
    };
    if watch {
        return watch_flows(s, request, goldmane).await;
    }
    match ask(&s, |reply| super::engine::Input::FlowList {
        request,
        reply,
    })
    .await
    {
        Ok(Some(Ok(result))) if goldmane => json_answer(&s, StatusCode::OK, &result),
        Ok(Some(Ok(result))) => {
            json_answer(&s, StatusCode::OK, &super::whisker::flow_list(&result))
        }
        Ok(Some(Err(e))) => json_error(StatusCode::BAD_REQUEST, e.to_string()),
        Ok(None) => json_error(
            StatusCode::NOT_FOUND,
            "flow logs are off (serve --flow-logs)".into(),
        ),
        Err(answer) => answer,
    }
}

/// Reads `/recommend`'s and `/recommend/check`'s query: `namespace` (required), `since`
/// (seconds above 0; none: the whole hour the store holds), and for a recommendation `tier`
/// (default `default`), `include_denied` (`true`/`false`), `min_samples` (intervals, default 1).
pub(super) fn recommend_question(
    query: &str,
    check: bool,
) -> Result<super::engine::recommend::Question, String> {
    let mut options = crate::recommend::Options::default();
    let mut since = None;
    let mut namespace = None;
    for pair in query.split('&').filter(|s| !s.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v)
            .ok_or_else(|| ParamsError::InvalidEscape(k.to_string()).to_string())?;
        match k {
            "namespace" => namespace = Some(v),
            "since" => {
                since = Some(
                    v.parse::<u64>()
                        .ok()
                        .filter(|s| *s > 0)
                        .ok_or_else(|| ParamsError::Since.to_string())?,
                )
            }
            "tier" if !check => options.tier = v,
            "include_denied" if !check => {
                options.include_denied = match v.as_str() {
                    "true" => true,
                    "false" => false,
                    _ => return Err("parameter include_denied: true or false".into()),
                }
            }
            "min_samples" if !check => {
                options.min_samples = v
                    .parse()
                    .map_err(|_| "parameter min_samples: a whole number".to_string())?
            }
            other => return Err(ParamsError::Unknown(other.to_string()).to_string()),
        }
    }
    options.namespace = namespace.ok_or("parameter namespace is required")?;
    options.window = match since {
        None => "all held".into(),
        Some(s) if s % 3600 == 0 => format!("{}h", s / 3600),
        Some(s) if s % 60 == 0 => format!("{}m", s / 60),
        Some(s) => format!("{s}s"),
    };
    options.check().map_err(|e| e.to_string())?;
    Ok(super::engine::recommend::Question {
        options,
        since,
        check,
    })
}

/// `/recommend` and `/recommend/check`: the engine gathers the records and the inventory (it
/// holds the flows and the graph), the pure module answers on a blocking thread.
pub(super) async fn recommend_answer(
    s: &AdminState,
    query: &str,
    check: bool,
) -> Result<serde_json::Value, Response> {
    let question =
        recommend_question(query, check).map_err(|e| json_error(StatusCode::BAD_REQUEST, e))?;
    let asked = question.clone();
    match ask(s, |reply| super::engine::Input::Recommend {
        question,
        reply,
    })
    .await
    {
        Ok(Some(Ok(gathered))) => {
            // The work itself, off the engine and the async workers, holding a query slot
            // again so that no more than the cap of them run at once.
            let Ok(slot) = s.bounds.queries.clone().try_acquire_owned() else {
                s.metrics.admin_refused("busy");
                return Err(json_error(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too many questions in flight (--admin-max-concurrent-queries); retry shortly"
                        .into(),
                ));
            };
            let answer = tokio::task::spawn_blocking(move || {
                let _slot = slot;
                super::engine::recommend::answer(&asked, &gathered)
            })
            .await;
            match answer {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(json_error(StatusCode::BAD_REQUEST, e)),
                Err(e) => Err(json_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the recommendation failed: {e}"),
                )),
            }
        }
        Ok(Some(Err(e))) => Err(json_error(StatusCode::BAD_REQUEST, e)),
        Ok(None) => Err(json_error(
            StatusCode::NOT_FOUND,
            "flow logs are off (serve --flow-logs): recommendations are made from them".into(),
        )),
        Err(answer) => Err(answer),
    }
}

async fn recommend(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    match recommend_answer(&s, query.as_deref().unwrap_or_default(), false).await {
        Ok(v) => json_answer(&s, StatusCode::OK, &v),
        Err(answer) => answer,
    }
}

async fn recommend_check(State(s): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    match recommend_answer(&s, query.as_deref().unwrap_or_default(), true).await {
        Ok(v) => json_answer(&s, StatusCode::OK, &v),
        Err(answer) => answer,
    }
}

/// The access check in front of every sensitive path.
async fn guard(State(s): State<AdminState>, req: Request, next: Next) -> Response {
    let caller = req
        .extensions()
        .get::<Caller>()
        .cloned()
        .unwrap_or_default();
    let authorization = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match s
        .access
        .check(&caller, authorization, |n| s.board.is_node(n))
    {
        Ok(()) => next.run(req).await,
        Err(refusal) => {
            let (status, reason, why) = match refusal {
                Refusal::Unauthenticated(why) => (StatusCode::UNAUTHORIZED, "unauthenticated", why),
                Refusal::Forbidden(why) => (StatusCode::FORBIDDEN, "forbidden", why),
            };
            s.metrics.admin_refused(reason);
            tracing::info!(
                path = %calc_graph::untrusted::Untrusted(req.uri().path()),
                caller = AdminAccess::describe(&caller),
                reason,
                "admin request refused"
            );
            let mut answer = json_error(status, why);
            if status == StatusCode::UNAUTHORIZED {
                answer.headers_mut().insert(
                    axum::http::header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static("Bearer realm=\"calc-server admin\""),
                );
            }
            answer
        }
    }
}

/// Goldmane's gRPC services alone, behind [`guard`] (`--flows-listen`).
pub(super) fn goldmane_router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route_service(
            "/goldmane.Flows/{*method}",
            crate::flows::goldmane::flows_server::FlowsServer::new(
                super::goldmane_api::GoldmaneApi {
                    state: state.clone(),
                },
            ),
        )
        .route_service(
            "/goldmane.Statistics/{*method}",
            crate::flows::goldmane::statistics_server::StatisticsServer::new(
                super::goldmane_api::GoldmaneApi {
                    state: state.clone(),
                },
            ),
        )
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// The paths and their access: probes and metrics open, the rest behind [`guard`].
pub(super) fn router(state: AdminState) -> axum::Router {
    let sensitive = axum::Router::new()
        .route("/status", get(status))
        .route("/status/datastore", get(datastore))
        .route("/status/policies", get(policies))
        .route("/status/policies/{*name}", get(policy))
        .route("/status/unused", get(unused))
        .route("/status/verdicts", get(verdicts))
        .route("/explain", get(explain))
        .route("/flows", get(flows))
        .route("/flows-filter-hints", get(flow_hints))
        .route("/recommend", get(recommend))
        .route("/recommend/check", get(recommend_check))
        .merge(super::console::router())
        .route_service(
            "/goldmane.Flows/{*method}",
            crate::flows::goldmane::flows_server::FlowsServer::new(
                super::goldmane_api::GoldmaneApi {
                    state: state.clone(),
                },
            ),
        )
        .route_service(
            "/goldmane.Statistics/{*method}",
            crate::flows::goldmane::statistics_server::StatisticsServer::new(
                super::goldmane_api::GoldmaneApi {
                    state: state.clone(),
                },
            ),
        )
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), guard));
    axum::Router::new()
        .route("/liveness", get(|| async { "alive\n" }))
        .route("/readiness", get(readiness))
        .route("/metrics", get(metrics))
        .merge(sensitive)
        .layer(axum::middleware::from_fn(super::console::headers))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_parameters_make_a_goldmane_request() {
        use crate::flows::goldmane::{Action, PolicyKind};
        let req = flow_request(
            "start_time_gte=-600&action=deny&dest_port=80&policy=gnp:security.guard&policy=shop/web&dest_namespace=shop&sort_by=dest_name",
        )
        .unwrap();
        assert_eq!(req.start_time_gte, -600);
        assert_eq!(req.sort_by.len(), 1);
        let f = req.filter.unwrap();
        assert_eq!(f.actions, [Action::Deny as i32]);
        assert_eq!(f.dest_ports[0].port, 80);
        assert_eq!(f.dest_namespaces[0].value, "shop");
        assert_eq!(
            (f.policies[0].kind, f.policies[0].name.as_str()),
            (PolicyKind::GlobalNetworkPolicy as i32, "security.guard")
        );
        assert_eq!(
            (
                f.policies[1].kind,
                f.policies[1].namespace.as_str(),
                f.policies[1].name.as_str()
            ),
            (0, "shop", "web")
        );
        assert!(flow_request("").unwrap().filter.is_none());
        assert_eq!(
            flow_request("action=drop").unwrap_err(),
            "parameter action: allow, deny or pass"
        );
        assert_eq!(
            flow_request("page=x").unwrap_err(),
            "parameter page: not a whole number"
        );
        assert_eq!(
            flow_request("nope=1").unwrap_err(),
            "unknown parameter \"nope\""
        );
    }

    #[test]
    fn filter_hint_parameters_need_a_type() {
        use crate::flows::goldmane::FilterType;
        let req = hints_request("type=dest_namespace&action=deny&page_size=5").unwrap();
        assert_eq!(req.r#type, FilterType::DestNamespace as i32);
        assert_eq!(req.page_size, 5);
        assert_eq!(req.filter.unwrap().actions.len(), 1);
        assert_eq!(hints_request("").unwrap_err(), "parameter type is required");
        assert!(hints_request("type=pods").is_err());
        assert!(hints_request("type=dest_name&sort_by=time").is_err());
    }

    #[test]
    fn explain_parameters_name_what_is_wrong() {
        let ask = |q: &str| ExplainParams::parse(q).and_then(ExplainParams::request);
        assert_eq!(
            ask("from=a&nope=1").unwrap_err().to_string(),
            "unknown parameter \"nope\""
        );
        assert_eq!(
            ask("from=%zz").unwrap_err(),
            ParamsError::InvalidEscape("from".into())
        );
        assert_eq!(ask("from=a").unwrap_err(), ParamsError::NoQuestion);
        assert!(matches!(
            ask("endpoint=shop%2Fweb"),
            Ok(calc_graph::explain::Request::Endpoint(e)) if e == "shop/web"
        ));
    }

    #[test]
    fn recommend_parameters_name_what_is_wrong() {
        let q = recommend_question(
            "namespace=shop&since=3600&tier=security&include_denied=true&min_samples=3",
            false,
        )
        .unwrap();
        assert_eq!(q.options.namespace, "shop");
        assert_eq!(q.options.tier, "security");
        assert!(q.options.include_denied);
        assert_eq!(q.options.min_samples, 3);
        assert_eq!(q.options.window, "1h");
        assert_eq!(q.since, Some(3600));
        assert!(!q.check);
        assert_eq!(
            recommend_question("since=60", false).unwrap_err(),
            "parameter namespace is required"
        );
        assert_eq!(
            recommend_question("namespace=Shop%20x", false).unwrap_err(),
            "namespace \"Shop x\": not a Kubernetes namespace name (a DNS label)"
        );
        assert_eq!(
            recommend_question("namespace=shop&tier=x", true).unwrap_err(),
            "unknown parameter \"tier\""
        );
        assert!(recommend_question("namespace=shop&include_denied=yes", false).is_err());
        assert!(recommend_question("namespace=shop&since=0", true).is_err());
        let c = recommend_question("namespace=shop&since=90", true).unwrap();
        assert!(c.check);
        assert_eq!(c.options.window, "90s");
    }

    #[test]
    fn the_unused_window_is_whole_seconds_or_all_history() {
        assert_eq!(unused_window("").unwrap(), None);
        assert_eq!(
            unused_window("since=604800").unwrap(),
            Some(Duration::from_secs(604_800))
        );
        for bad in ["since=0", "since=7d", "since=", "since=-1"] {
            assert_eq!(
                unused_window(bad).unwrap_err().to_string(),
                "parameter since: a whole number of seconds above 0",
                "{bad}"
            );
        }
        assert_eq!(
            unused_window("window=1").unwrap_err().to_string(),
            "unknown parameter \"window\""
        );
    }
}
