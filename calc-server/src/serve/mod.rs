//! `calc-server serve`: the datastore adapter, the engine that owns the graph, the gRPC Sync
//! service and the admin endpoint, wired together.
//!
//! Tasks: the datastore adapter and its status writer (`crate::datastore::start_adapter`; its
//! updates go straight into the engine's datastore receiver), the engine (graph, per-node
//! queues), two per agent stream (the watch for its going away, its reports), the listener's
//! accept loop and handshakes, the admin HTTP server. All are spawned through one
//! [`common::Tasks`]: each runs in a span naming it (`engine`, `agent{node, conn}`,
//! `datastore{type}` …), and all are cancelled together. SIGTERM/SIGINT: every stream is closed
//! with UNAVAILABLE through the engine, the remaining tasks are cancelled and awaited (at most
//! [`SHUTDOWN_TIMEOUT`]), then the process exits 0.
//! `listener` accepts connections (mutual TLS, handshake timeout, connection limit) and
//! `metrics` holds what `/metrics` shows. Where the datastore gives a place (the file
//! datastore's status directory, etcd), the `hits_store` task reads the saved policy hit
//! counters into the engine and saves the copies it hands over; on shutdown it is awaited (at
//! most [`SHUTDOWN_TIMEOUT`]) after the engine, so the last copy is stored before the process
//! exits.

mod admin;
mod admin_access;
mod admin_server;
/// Only `console::bench` is public (for `calc-bench console`); the rest serves `/ui/`.
#[doc(hidden)]
pub mod console;
#[doc(hidden)]
pub mod engine;
mod goldmane_api;
mod hits_store;
pub mod listener;
pub mod metrics;
mod service;
mod sync_route;
mod sync_server;
mod whisker;
/// The status board lives at the top (`crate::status`): the datastore's status writers read it.
pub use crate::status;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use anyhow::Context;
use common::Tasks;
use tokio::sync::mpsc;

use crate::args::ServeArgs;

/// How long tasks get to stop once cancelled, after the agent streams are closed.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

pub fn run(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(args.clone()))
}

async fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    // Checked before anything starts: TLS flags are all or nothing, files must load, an
    // unauthenticated admin endpoint only on loopback.
    let tls = args.listener.tls()?;
    let admin_tls = args
        .listener
        .admin_tls(args.admin.admin_ca_file.as_deref())?;
    let access = admin_access::AdminAccess::new(
        &args.admin,
        args.admin_listen,
        admin_tls.is_some(),
        args.listener.identity_source(),
    )?;
    if let Some(listen) = args.flows_listen {
        anyhow::ensure!(
            args.admin.authenticates() || listen.ip().is_loopback(),
            "--flows-listen {listen} is not a loopback address and the admin endpoint has no \
             authentication: anyone who reaches it could read every flow. Set \
             --admin-token-file, or TLS with --admin-allowed-cn, --admin-allowed-uri-san or \
             --admin-ca-file; or listen on 127.0.0.1 (see docs/tls.md, \"Who can read what\")"
        );
    }
    // Every task below is spawned through this: spans, one cancellation, a bounded wait.
    let tasks = Tasks::new();
    let result = serve_with(args, tls, (admin_tls, access), &tasks).await;
    // Whatever ended serving (the signal, once the streams are closed, or an error): stop and
    // wait for the rest.
    tracing::debug!(tasks = tasks.len(), "stopping tasks");
    tasks.shutdown(SHUTDOWN_TIMEOUT).await;
    if result.is_ok() {
        tracing::info!("stopped");
    }
    result
}

async fn serve_with(
    args: ServeArgs,
    tls: Option<listener::TlsSettings>,
    (admin_tls, access): (Option<rustls::ServerConfig>, admin_access::AdminAccess),
    tasks: &Tasks,
) -> anyhow::Result<ExitCode> {
    let board = Arc::new(status::Board::default());
    let metrics = Arc::new(metrics::Metrics::default());
    if !args.policy_hit_metrics {
        metrics.hide_policy_hits();
    }
    let ready = Arc::new(AtomicBool::new(false));
    let (engine_tx, engine_rx) = mpsc::channel(1024);
    let (sink, datastore_rx): (crate::datastore::Sink, _) = mpsc::channel(64);
    let mut engine = engine::Engine::new(
        engine::Limits {
            backlog: args.agent_backlog_limit as u64,
            backlog_bytes: args.agent_backlog_bytes,
            concurrent_snapshots: args.max_concurrent_snapshots,
            allow_unknown_nodes: args.allow_unknown_nodes,
        },
        board.clone(),
        ready.clone(),
        metrics.clone(),
    );
    if args.flow_logs {
        engine.enable_flows(args.flow_max_keys, args.flow_max_keys.saturating_mul(4));
    }
    let source = crate::datastore::start_adapter(
        &args,
        board.clone(),
        metrics.datastore_health(),
        sink,
        tasks,
    )
    .await?;
    let hits_writer = hits_store::Store::for_args(&args).map(|store| {
        let copies = engine.save_hits_every(args.hits_save_interval);
        let reloads = store.reloads_nodes().then(|| engine.reload_node_hits());
        tasks.spawn(
            tracing::info_span!("hits_store"),
            hits_store::run(store, engine_tx.clone(), copies, reloads),
        )
    });
    let engine_task = tasks.spawn(
        tracing::info_span!("engine"),
        engine::run(engine, engine_rx, datastore_rx),
    );

    let admin = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .with_context(|| format!("binding the admin endpoint {}", args.admin_listen))?;
    let admin_scheme = if admin_tls.is_some() { "https" } else { "http" };
    let admin_state = admin::AdminState {
        board: board.clone(),
        ready,
        metrics: metrics.clone(),
        engine: engine_tx.clone(),
        access: Arc::new(access),
        bounds: admin::Bounds {
            queries: Arc::new(tokio::sync::Semaphore::new(usize::from(
                args.admin.admin_max_concurrent_queries,
            ))),
            query_timeout: args.admin.admin_query_timeout,
            max_response_bytes: args.admin.admin_max_response_bytes,
        },
    };
    let admin_router = admin::router(admin_state.clone());
    if let Some(listen) = args.flows_listen {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding the flows endpoint {listen}"))?;
        let server = admin_server::AdminServer {
            listener,
            tls: admin_tls.clone(),
            router: admin::goldmane_router(admin_state),
            max_connections: usize::from(args.admin.admin_max_connections),
            handshake_timeout: args.listener.tls_handshake_timeout,
            metrics: metrics.clone(),
        };
        tasks.spawn(
            tracing::info_span!("flows", listen = %listen),
            server.run(tasks.clone()),
        );
    }
    let admin_server = admin_server::AdminServer {
        listener: admin,
        tls: admin_tls,
        router: admin_router,
        max_connections: usize::from(args.admin.admin_max_connections),
        handshake_timeout: args.listener.tls_handshake_timeout,
        metrics: metrics.clone(),
    };
    tasks.spawn(
        tracing::info_span!("admin", listen = %args.admin_listen),
        admin_server.run(tasks.clone()),
    );

    let service = service::SyncService {
        engine: engine_tx.clone(),
        flow_logs: args.flow_logs,
        flow_rate: args.flow_max_records_per_second,
        board,
        hello_timeout: args.hello_timeout,
        next_id: AtomicU64::new(1),
        metrics: metrics.clone(),
        tasks: tasks.clone(),
    };
    let svc = sync_route::SyncRoute::new(service, args.max_recv_bytes);
    let listener =
        listener::bind(args.listen).with_context(|| format!("binding {}", args.listen))?;
    let scheme = if tls.is_some() { "mTLS" } else { "plaintext" };
    tracing::info!(listen = %args.listen, admin = %args.admin_listen, datastore = %source, transport = scheme, "calc-server serving");
    eprintln!(
        "calc-server: serving {source} on {} ({scheme}; admin {admin_scheme}://{})",
        args.listen, args.admin_listen
    );
    let limits = listener::Limits::new(
        args.listener.max_connections,
        args.listener.max_pending_connections,
        args.listener.max_pending_per_address,
        metrics.clone(),
    );
    let incoming = listener::incoming(
        listener,
        tls,
        limits,
        listener::Deadlines {
            handshake: args.listener.tls_handshake_timeout,
            hello: args.hello_timeout,
        },
        metrics,
        tasks,
    );

    let shutdown = async move {
        common::shutdown_signal().await;
        tracing::info!("shutting down: closing agent streams");
        let _ = engine_tx.send(engine::Input::Shutdown).await;
        let _ = engine_task.await;
        // The engine handed over its last copy of the hit counters as it stopped.
        if let Some(writer) = hits_writer {
            let _ = tokio::time::timeout(SHUTDOWN_TIMEOUT, writer).await;
        }
    };
    sync_server::serve(
        incoming,
        svc,
        sync_server::Settings {
            keepalive_interval: args.keepalive_interval,
            keepalive_timeout: args.keepalive_timeout,
            max_concurrent_streams: args.listener.max_concurrent_streams,
        },
        shutdown,
    )
    .await;
    Ok(ExitCode::SUCCESS)
}
