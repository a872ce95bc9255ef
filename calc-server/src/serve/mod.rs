//! `calc-server serve`: the datastore adapter, the engine that owns the graph, the gRPC Sync
//! service and the admin endpoint, wired together.
//!
//! Tasks: the datastore adapter (its updates go straight into the engine's datastore receiver),
//! the engine (graph, per-node queues), one task per
//! agent stream (its outgoing queue) and one per agent's reports, the status writer, the admin
//! HTTP server. SIGTERM/SIGINT: every stream is closed with UNAVAILABLE, then the process exits 0.
//! `listener` accepts connections (mutual TLS, handshake timeout, connection limit) and
//! `metrics` holds what `/metrics` shows.

mod admin;
mod engine;
pub mod listener;
pub mod metrics;
mod service;
pub mod status;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::mpsc;

use crate::datastore::{DatastoreArgs, DatastoreType};

#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub datastore: DatastoreArgs,
    /// Address the gRPC Sync service listens on.
    #[arg(long, env = "CALC_SERVER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address of the admin HTTP endpoint (/status, /liveness, /readiness, /metrics). The
    /// default port is 9096 because Felix's health port (9099) and Typha's (9098) are taken
    /// on a Calico node.
    #[arg(
        long,
        env = "CALC_SERVER_ADMIN_LISTEN",
        default_value = crate::status_cmd::DEFAULT_ADMIN
    )]
    pub admin_listen: SocketAddr,
    /// How often the file datastore directory is checked for changes.
    #[arg(long, env = "CALC_SERVER_FILE_POLL_INTERVAL", default_value = "500ms", value_parser = parse_duration)]
    pub file_poll_interval: Duration,
    /// File datastore: directory of the last-good store (the version of every object in force,
    /// so that after a restart an object that is invalid by then keeps its last good version).
    /// Default: `last-good` inside the status directory (shared by replicas that share it);
    /// an empty value keeps it in memory only. See docs/operations.md.
    #[arg(long, env = "CALC_SERVER_LAST_GOOD_DIR", value_name = "PATH", value_parser = path_or_empty)]
    pub last_good_dir: Option<PathBuf>,
    /// File datastore: directory the agents' endpoint status is written to (`<node>.json`).
    /// Default: `status` inside --file-dir; set it when that directory is read-only (a
    /// ConfigMap volume), e.g. to an emptyDir. An empty value writes no status files (the admin
    /// endpoint's /status still has them). It may not be inside --file-dir elsewhere than
    /// `status`: the manifest loader would read the status files.
    #[arg(long, env = "CALC_SERVER_STATUS_DIR", value_name = "PATH", value_parser = path_or_empty)]
    pub status_dir: Option<PathBuf>,
    /// An agent that falls this many messages behind is disconnected and resent a snapshot.
    #[arg(
        long,
        env = "CALC_SERVER_AGENT_BACKLOG_LIMIT",
        default_value_t = 200_000
    )]
    pub agent_backlog_limit: usize,
    /// An agent that falls this many bytes (encoded messages) behind is disconnected and resent
    /// a snapshot: a stalled agent costs at most this much memory beyond shared messages.
    #[arg(
        long,
        env = "CALC_SERVER_AGENT_BACKLOG_BYTES",
        default_value_t = 256 * 1024 * 1024
    )]
    pub agent_backlog_bytes: u64,
    /// How many nodes' snapshots may be in flight at once (others wait their turn).
    #[arg(
        long,
        env = "CALC_SERVER_MAX_CONCURRENT_SNAPSHOTS",
        default_value_t = 32
    )]
    pub max_concurrent_snapshots: usize,
    /// Time an agent has to send its AgentHello.
    #[arg(long, env = "CALC_SERVER_HELLO_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub hello_timeout: Duration,
    /// HTTP/2 keepalive ping interval; a peer that does not answer within the timeout is dropped.
    #[arg(long, env = "CALC_SERVER_KEEPALIVE_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub keepalive_interval: Duration,
    /// Time an agent has to answer a keepalive ping before its connection is dropped (and its
    /// node shown disconnected); keep it above the network's worst round trip.
    #[arg(long, env = "CALC_SERVER_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub keepalive_timeout: Duration,
    /// Largest message accepted from an agent (reports are small: a status, a heartbeat).
    #[arg(long, env = "CALC_SERVER_MAX_RECV_BYTES", default_value_t = 64 * 1024)]
    pub max_recv_bytes: usize,
    /// Accept agents for nodes the datastore does not know (they get config and InSync only).
    #[arg(long, env = "CALC_SERVER_ALLOW_UNKNOWN_NODES")]
    pub allow_unknown_nodes: bool,
    /// How often changed endpoint status is written to the datastore.
    #[arg(long, env = "CALC_SERVER_STATUS_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub status_interval: Duration,
    /// etcd watch and status settings (for `--datastore-type etcdv3`).
    #[command(flatten)]
    pub etcd: crate::datastore::etcd::EtcdServeArgs,
    /// Kubernetes watch settings (for `--datastore-type kubernetes`).
    #[command(flatten)]
    pub kube: crate::datastore::kubernetes::KubeServeArgs,
    /// mTLS and connection limits of the Sync listener.
    #[command(flatten)]
    pub listener: listener::ListenerArgs,
    /// YAML file of settings for serve: keys are flag names without the dashes
    /// (`listen: 0.0.0.0:50051`, `tls-ca-file: /etc/calc/ca.pem`, lists as YAML sequences).
    /// Precedence: flags, then environment variables, then this file, then the defaults.
    #[arg(long, env = "CALC_SERVER_CONFIG_FILE", value_name = "PATH")]
    pub config_file: Option<PathBuf>,
    /// Print the effective settings (after flags, environment and config file) and exit: one
    /// `key: value  # source` line each, in the config file's form (source: flag, env NAME,
    /// file PATH or default). Answered by `config_file::parse_args` before serving starts.
    #[arg(long)]
    pub print_config: bool,
}

/// Parses `500ms`, `10s`, `2m` or a bare number of seconds.
/// A path where an empty value means "none" (clap's path parser refuses empty values).
fn path_or_empty(s: &str) -> Result<PathBuf, String> {
    Ok(PathBuf::from(s))
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?} (e.g. 500ms, 10s, 2m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("invalid duration unit in {s:?} (ms, s, m or h)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

pub fn run(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(args.clone()))
}

async fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    // Checked before anything starts: TLS flags are all or nothing, files must load.
    let tls = args.listener.tls()?;
    let mut kube_client = None;
    let source = match args.datastore.datastore_type {
        DatastoreType::File => {
            let dir: PathBuf = args.datastore.file_dir.clone();
            crate::datastore::file::check_file_dir(&dir)?;
            dir.display().to_string()
        }
        DatastoreType::Etcdv3 => {
            // Fail fast on bad URLs or TLS files; an unreachable etcd is retried.
            crate::datastore::etcd::connect(&args.datastore.etcd).await?;
            format!("etcd {}", args.datastore.etcd.etcd_endpoints.join(","))
        }
        DatastoreType::Kubernetes => {
            // Fail fast on a missing or broken configuration; an unreachable API server is
            // retried by the watchers.
            kube_client = Some(crate::datastore::kubernetes::client(&args.datastore.kube).await?);
            "the Kubernetes API".to_string()
        }
    };

    let board = Arc::new(status::Board::default());
    let metrics = Arc::new(metrics::Metrics::default());
    let ready = Arc::new(AtomicBool::new(false));
    let (engine_tx, engine_rx) = mpsc::channel(1024);
    let (sink, datastore_rx): (crate::datastore::Sink, _) = mpsc::channel(64);
    let engine = engine::Engine::new(
        board.clone(),
        args.agent_backlog_limit,
        args.agent_backlog_bytes,
        args.allow_unknown_nodes,
        ready.clone(),
        args.max_concurrent_snapshots,
        metrics.clone(),
    );
    let engine_task = tokio::spawn(engine.run(engine_rx, datastore_rx));
    match args.datastore.datastore_type {
        DatastoreType::Etcdv3 => {
            let watcher = crate::datastore::etcd::watcher::Watcher::new(
                crate::datastore::etcd::watcher::WatchConfig {
                    args: args.datastore.etcd.clone(),
                    resync_interval: args.etcd.etcd_resync_interval,
                    min_backoff: Duration::from_millis(100),
                    max_backoff: args.etcd.etcd_max_backoff,
                },
                sink,
                metrics.clone(),
            );
            tokio::spawn(watcher.run());
            let writer = crate::datastore::etcd::status::StatusWriter::new(
                board.clone(),
                crate::datastore::etcd::status::StatusConfig {
                    args: args.datastore.etcd.clone(),
                    interval: args.status_interval,
                    resync_interval: args.etcd.etcd_status_resync_interval,
                },
            );
            tokio::spawn(writer.run());
        }
        DatastoreType::Kubernetes => {
            let client = kube_client
                .take()
                .context("the Kubernetes client is made before the engine starts")?;
            let watcher = crate::datastore::kubernetes::watcher::Watcher::new(
                crate::datastore::kubernetes::watcher::WatchConfig {
                    args: args.datastore.kube.clone(),
                    resync_interval: args.kube.kube_resync_interval,
                },
                sink,
                metrics.clone(),
            );
            tokio::spawn(watcher.run(client));
            // Calico's Kubernetes datastore keeps no endpoint status: reports stay on the
            // status board (admin /status) only.
        }
        DatastoreType::File => {
            let dir = args.datastore.file_dir.clone();
            let status_dir =
                crate::datastore::file::status::status_dir(&dir, args.status_dir.as_deref())?;
            let last_good = match &args.last_good_dir {
                Some(d) if d.as_os_str().is_empty() => None,
                Some(d) => Some(d.clone()),
                None => status_dir.as_ref().map(|s| s.join("last-good")),
            };
            let (interval, metrics) = (args.file_poll_interval, metrics.clone());
            let watched = dir.clone();
            // Reading and parsing files is blocking work: its own thread, off the runtime.
            tokio::task::spawn_blocking(move || {
                crate::datastore::file::watch::run(watched, last_good, interval, sink, metrics)
            });
            if let Some(status_dir) = status_dir {
                tokio::spawn(crate::datastore::file::status::file_writer(
                    board.clone(),
                    status_dir,
                    args.status_interval,
                ));
            }
        }
    }

    let admin = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .with_context(|| format!("binding the admin endpoint {}", args.admin_listen))?;
    let admin_router = admin::router(admin::AdminState {
        board: board.clone(),
        ready,
        metrics: metrics.clone(),
    });
    tokio::spawn(async move {
        if let Err(error) = axum::serve(admin, admin_router).await {
            tracing::error!(%error, "admin endpoint failed");
        }
    });

    let service = service::SyncService {
        engine: engine_tx.clone(),
        board,
        hello_timeout: args.hello_timeout,
        next_id: AtomicU64::new(1),
        metrics: metrics.clone(),
    };
    let svc = felix_proto::calc_server_server::CalcServerServer::new(service)
        .max_decoding_message_size(args.max_recv_bytes)
        .max_encoding_message_size(usize::MAX);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let scheme = if tls.is_some() { "mTLS" } else { "plaintext" };
    tracing::info!(listen = %args.listen, admin = %args.admin_listen, datastore = %source, transport = scheme, "calc-server serving");
    eprintln!(
        "calc-server: serving {source} on {} ({scheme}; admin http://{})",
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
    );

    let shutdown = async move {
        shutdown_signal().await;
        tracing::info!("shutting down: closing agent streams");
        let _ = engine_tx.send(engine::Input::Shutdown).await;
        let _ = engine_task.await;
    };
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(args.keepalive_interval))
        .http2_keepalive_timeout(Some(args.keepalive_timeout))
        .max_concurrent_streams(Some(args.listener.max_concurrent_streams))
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .context("gRPC server")?;
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
