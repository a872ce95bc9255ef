//! The gRPC server of `CalcServer.Sync`: tonic's generated service on hyper's HTTP/2 server,
//! one task per connection, each request carrying its connection's `PeerInfo`.
//!
//! Contract: what tonic's `transport::Server` did for this service (HTTP/2 only, keepalive
//! pings, a bound on concurrent streams, graceful shutdown: no new connection once `shutdown`
//! completes, every open one sent GOAWAY and awaited), plus a bound on what each stream
//! buffers for sending ([`SEND_BUFFER`]), which tonic does not expose. hyper pulls a stream's
//! next messages only when that buffer has room, so a message waiting for a slow agent waits
//! in the engine's queue as the shared encoding it is, not as a copy per stream.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use axum::http;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;

use super::listener::Connection;

/// What one stream may hold encoded and not yet written to its connection. hyper's default
/// is 400 KiB: with 5,000 agents taking their snapshots at once, each stream held nearly its
/// whole snapshot copied (about 320 KiB each, 1.6 GiB in all). A DATA frame is at most 16 KiB.
pub(super) const SEND_BUFFER: usize = 32 * 1024;

/// HTTP/2 settings of the Sync listener.
pub(super) struct Settings {
    pub(super) keepalive_interval: Duration,
    pub(super) keepalive_timeout: Duration,
    pub(super) max_concurrent_streams: u32,
}

/// Serves `service` on every connection of `incoming` until `shutdown` completes, then closes
/// the connections gracefully and returns once they are gone.
pub(super) async fn serve<S>(
    incoming: impl Stream<Item = std::io::Result<Connection>>,
    service: S,
    settings: Settings,
    shutdown: impl Future<Output = ()>,
) where
    S: tower::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(settings.keepalive_interval)
        .keep_alive_timeout(settings.keepalive_timeout)
        .max_concurrent_streams(settings.max_concurrent_streams)
        .max_send_buf_size(SEND_BUFFER);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    let mut incoming = std::pin::pin!(incoming);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            next = incoming.next() => match next {
                Some(Ok(conn)) => {
                    let info = conn.connect_info();
                    let service = tower::util::MapRequest::new(
                        service.clone(),
                        move |mut req: http::Request<hyper::body::Incoming>| {
                            req.extensions_mut().insert(info.clone());
                            req
                        },
                    );
                    let served = builder.serve_connection(
                        TokioIo::new(conn),
                        hyper_util::service::TowerToHyperService::new(service),
                    );
                    let mut stop = stop_rx.clone();
                    conns.spawn(async move {
                        let mut served = std::pin::pin!(served);
                        let result = tokio::select! {
                            r = served.as_mut() => r,
                            _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                                served.as_mut().graceful_shutdown();
                                served.await
                            }
                        };
                        if let Err(error) = result {
                            tracing::debug!(%error, "agent connection ended with an error");
                        }
                    });
                }
                // The listener reports refused handshakes itself; nothing reaches here but
                // connections, and the stream ends only with the listener.
                Some(Err(error)) => tracing::debug!(%error, "connection not served"),
                None => break,
            },
        }
    }
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
}
