//! Calico Goldmane's gRPC query API over the flow store (issue 42), served on the admin
//! endpoint behind its access check: `goldmane.Flows` (`List`, `FilterHints`; `Stream` answers
//! UNIMPLEMENTED) and `goldmane.Statistics` (`List`), with Goldmane's own package, messages and
//! numbers (`felix_proto::goldmane`), so a client generated from Goldmane's schema works. Each
//! call is one question to the engine, bounded as the admin JSON paths are
//! (`--admin-max-concurrent-queries`, `--admin-query-timeout`). `FlowCollector` is not served:
//! flows come from the agents' Sync streams.

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
        _request: Request<FlowStreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        Err(Status::unimplemented(
            "Flows.Stream is not served yet: poll Flows.List with aggregation_interval 15",
        ))
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
