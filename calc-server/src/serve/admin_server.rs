//! The admin listener's connections: TCP accept under a connection cap, the TLS handshake (when
//! serve has `--tls-*`) under `--tls-handshake-timeout`, then HTTP/1.1 with a header deadline
//! and a bounded request head (HTTP/2 is served too, so a gRPC client pointed here gets a
//! 404 it can explain). Each request carries the connection's [`Caller`] (what its
//! client certificate proved) for the router's access check.
//!
//! axum's own `serve` gives neither TLS nor the peer certificate, hence this loop (hyper's
//! servers through hyper-util, which axum and tonic already link).

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::admin_access::{Caller, CertNames};
use super::metrics::Metrics;

/// A client has this long to send a request head (slowloris).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head buffered (the admin endpoint takes only short GETs).
const MAX_HEAD_BYTES: usize = 64 * 1024;

pub(super) struct AdminServer {
    pub listener: TcpListener,
    pub tls: Option<rustls::ServerConfig>,
    pub router: axum::Router,
    pub max_connections: usize,
    pub handshake_timeout: Duration,
    pub metrics: Arc<Metrics>,
}

impl AdminServer {
    /// Serves until the task is cancelled.
    pub(super) async fn run(self, tasks: common::Tasks) {
        let tls = self
            .tls
            .map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c)));
        let slots = Arc::new(Semaphore::new(self.max_connections.max(1)));
        loop {
            let (tcp, remote) = match self.listener.accept().await {
                Ok(a) => a,
                Err(error) => {
                    tracing::warn!(%error, "accepting an admin connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                self.metrics.admin_refused("connection_limit");
                tracing::debug!(%remote, "too many admin connections; closing the new one");
                continue;
            };
            let (tls, router, metrics) = (tls.clone(), self.router.clone(), self.metrics.clone());
            let timeout = self.handshake_timeout;
            tasks.spawn(tracing::debug_span!("admin_conn", %remote), async move {
                let _slot = slot;
                let _ = tcp.set_nodelay(true);
                match tls {
                    None => serve(tcp, Caller::default(), router).await,
                    Some(acceptor) => {
                        let stream = match tokio::time::timeout(timeout, acceptor.accept(tcp)).await
                        {
                            Ok(Ok(s)) => s,
                            Ok(Err(error)) => {
                                metrics.admin_refused("tls_handshake");
                                tracing::info!(%remote, %error, "admin TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                metrics.admin_refused("tls_handshake_timeout");
                                return;
                            }
                        };
                        let caller = Caller {
                            cert: stream
                                .get_ref()
                                .1
                                .peer_certificates()
                                .and_then(|c| c.first())
                                .and_then(|leaf| CertNames::of(leaf.as_ref()).ok()),
                        };
                        serve(stream, caller, router).await;
                    }
                }
            });
        }
    }
}

/// One connection's requests, each with `caller` in its extensions.
async fn serve<S>(io: S, caller: Caller, router: axum::Router)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = tower::util::MapRequest::new(
        router,
        move |mut req: axum::http::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(caller.clone());
            req
        },
    );
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(8)
        .max_header_list_size(MAX_HEAD_BYTES as u32);
    let result = builder
        .serve_connection(
            TokioIo::new(io),
            hyper_util::service::TowerToHyperService::new(service),
        )
        .await;
    if let Err(error) = result {
        tracing::debug!(%error, "admin connection ended with an error");
    }
}
