//! Calico Goldmane's gRPC query API over the flow store (issue 42), served on the admin
//! endpoint behind its access check: `goldmane.Flows` (`List`, `Stream`, `FilterHints`) and
//! `goldmane.Statistics` (`List`), with Goldmane's own package, messages and numbers
//! (`felix_proto::goldmane`), so a client generated from Goldmane's schema works. Each call (and
//! each poll of a `Stream`) is one question to the engine, bounded as the admin JSON paths are
//! (`--admin-max-concurrent-queries`, `--admin-query-timeout`). `FlowCollector` is not served:
//! flows come from the agents' Sync streams.
//!
//! `Stream`: the flows of the window from `start_time_gte` (as `List` reads it), one per key
//! and aggregation interval (15 s when zero), each sent once its interval closed 15 s ago (the
//! agents send an interval once it closes), oldest first; then the same every 5 s, as new
//! intervals close, until the client goes. A record arriving later for an interval already
//! sent is not sent again.

use std::pin::Pin;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::admin::{AdminState, ask};
use super::engine::Input;
use crate::flows::InvalidRequest;
use crate::flows::goldmane::{
    FilterHintsRequest, FilterHintsResult, FlowListRequest, FlowListResult, FlowResult,
    FlowStreamRequest, StatisticsRequest, StatisticsResult, flows_server, statistics_server,
};

/// The two services, sharing the admin endpoint's state.
#[derive(Clone)]
pub(super) struct GoldmaneApi {
    pub state: AdminState,
}

/// An admin refusal (not ready, busy, timed out, shutting down) as a gRPC status.
fn refused(answer: axum::response::Response) -> Status {
    match answer.status().as_u16() {
        429 => Status::resource_exhausted(
            "too many questions in flight (--admin-max-concurrent-queries); retry shortly",
        ),
        _ => Status::unavailable("the calc-server cannot answer now (not ready, busy or stopping)"),
    }
}

/// The engine's answer as a gRPC result: flow logs off is FAILED_PRECONDITION, an invalid
/// request INVALID_ARGUMENT.
fn answered<T>(
    answer: Result<Option<Result<T, InvalidRequest>>, axum::response::Response>,
) -> Result<T, Status> {
    match answer {
        Ok(Some(Ok(v))) => Ok(v),
        Ok(Some(Err(e))) => Err(Status::invalid_argument(e.to_string())),
        Ok(None) => Err(Status::failed_precondition(
            "flow logs are off (serve --flow-logs)",
        )),
        Err(r) => Err(refused(r)),
    }
}

/// Follows the flows `list` selects (its `aggregation_interval` set): each flow and interval
/// once its interval closed 15 s ago, oldest first, polling every 5 s until the receiver is
/// dropped. The first poll answers the call: an invalid request (or flow logs off) is refused
/// at once.
pub(super) async fn follow(
    state: AdminState,
    list: FlowListRequest,
) -> Result<tokio::sync::mpsc::Receiver<Result<FlowResult, Status>>, Status> {
    let first = {
        let request = list.clone();
        answered(ask(&state, |reply| Input::FlowList { request, reply }).await)?
    };
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    tokio::spawn(async move {
        let mut sent = std::collections::HashSet::new();
        let mut answer = Ok(first);
        loop {
            if let Ok(result) = answer {
                let now = unix_now();
                for r in closed(result.flows, &mut sent, now) {
                    if tx.send(Ok(r)).await.is_err() {
                        return;
                    }
                }
                sent.retain(|(_, start)| *start > now - 4_000);
            }
            tokio::select! {
                _ = tx.closed() => return,
                _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
            }
            let request = list.clone();
            answer = answered(ask(&state, |reply| Input::FlowList { request, reply }).await);
            if let Err(status) = &answer
                && matches!(
                    status.code(),
                    tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition
                )
            {
                let _ = tx.send(Err(status.clone())).await;
                return;
            }
        }
    });
    Ok(rx)
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The flows whose interval ended at least 15 s before `now` and that were not sent yet
/// (remembered in `sent` by id and start), oldest first.
fn closed(
    flows: Vec<FlowResult>,
    sent: &mut std::collections::HashSet<(i64, i64)>,
    now: i64,
) -> Vec<FlowResult> {
    let mut out: Vec<FlowResult> = flows
        .into_iter()
        .filter(|r| {
            r.flow.as_ref().is_some_and(|f| {
                f.end_time + crate::flows::BUCKET_SECONDS <= now
                    && sent.insert((r.id, f.start_time))
            })
        })
        .collect();
    out.sort_by_key(|r| (r.flow.as_ref().map_or(0, |f| f.start_time), r.id));
    out
}

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl flows_server::Flows for GoldmaneApi {
    async fn list(
        &self,
        request: Request<FlowListRequest>,
    ) -> Result<Response<FlowListResult>, Status> {
        let request = request.into_inner();
        let answer = ask(&self.state, |reply| Input::FlowList { request, reply }).await;
        answered(answer).map(Response::new)
    }

    type StreamStream = Boxed<FlowResult>;

    async fn stream(
        &self,
        request: Request<FlowStreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let req = request.into_inner();
        let interval = if req.aggregation_interval == 0 {
            crate::flows::BUCKET_SECONDS
        } else {
            req.aggregation_interval
        };
        let rx = follow(
            self.state.clone(),
            FlowListRequest {
                start_time_gte: req.start_time_gte,
                filter: req.filter,
                aggregation_interval: interval,
                ..Default::default()
            },
        )
        .await?;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn filter_hints(
        &self,
        request: Request<FilterHintsRequest>,
    ) -> Result<Response<FilterHintsResult>, Status> {
        let request = request.into_inner();
        let answer = ask(&self.state, |reply| Input::FlowHints { request, reply }).await;
        answered(answer).map(Response::new)
    }
}

#[tonic::async_trait]
impl statistics_server::Statistics for GoldmaneApi {
    type ListStream = Boxed<StatisticsResult>;

    async fn list(
        &self,
        request: Request<StatisticsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let request = request.into_inner();
        let answer = ask(&self.state, |reply| Input::FlowStats { request, reply }).await;
        let results = answered(answer)?;
        Ok(Response::new(Box::pin(tokio_stream::iter(
            results.into_iter().map(Ok),
        ))))
    }
}
