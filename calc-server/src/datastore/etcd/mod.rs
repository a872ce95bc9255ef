//! The etcd v3 datastore: Calico's key layout, read with a paginated list at one revision and
//! then watched; endpoint status written back under Calico's status keys.
//!
//! What a key/value means and how a re-list reconciles (mark and sweep) are pure and live in
//! `calc_ingest::etcd` and `calc_ingest::mirror`; this module is the IO:
//! - [`watcher`]: the IO: connect, list, watch, back off, re-list.
//! - [`status`]: the status writer (endpoint status and node liveness keys).
//!
//! The adapter is thin (architecture invariant 2): meaning and validation stay in `calc-graph`.

pub mod status;
pub mod watcher;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use common::Tasks;
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use super::{Health, Sink};
use crate::args::{EtcdArgs, ServeArgs};
use crate::status::Board;

pub use calc_ingest::etcd::RESOURCE_PREFIX;

/// Starts the watcher (into `sink`) and the status writer; fails only on bad arguments.
pub(super) async fn start(
    args: &ServeArgs,
    board: Arc<Board>,
    health: Health,
    sink: Sink,
    tasks: &Tasks,
) -> anyhow::Result<String> {
    // Fail fast on bad URLs or TLS files; an unreachable etcd is retried.
    connect(&args.datastore.etcd).await?;
    let watcher = watcher::Watcher::new(
        watcher::WatchConfig {
            args: args.datastore.etcd.clone(),
            resync_interval: args.etcd.etcd_resync_interval,
            min_backoff: Duration::from_millis(100),
            max_backoff: args.etcd.etcd_max_backoff,
        },
        sink,
        health,
        tasks.clone(),
    );
    let span = tracing::info_span!("datastore", "type" = "etcd");
    tasks.spawn(span.clone(), watcher.run());
    let writer = status::StatusWriter::new(
        board,
        status::StatusConfig {
            args: args.datastore.etcd.clone(),
            interval: args.status_interval,
            resync_interval: args.etcd.etcd_status_resync_interval,
        },
    );
    tasks.spawn(
        tracing::info_span!(parent: &span, "status_writer"),
        writer.run(),
    );
    Ok(format!(
        "etcd {}",
        args.datastore.etcd.etcd_endpoints.join(",")
    ))
}

/// A client for `args`. Connecting is lazy: this fails only on bad arguments (URLs, TLS files);
/// an unreachable etcd shows up as errors of the first requests.
pub async fn connect(args: &EtcdArgs) -> anyhow::Result<Client> {
    anyhow::ensure!(
        args.etcd_endpoints.iter().any(|e| !e.trim().is_empty()),
        "--etcd-endpoints is empty"
    );
    let endpoints: Vec<&str> = args
        .etcd_endpoints
        .iter()
        .map(|e| e.trim())
        .filter(|e| !e.is_empty())
        .collect();
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(true)
        // A member cut off from its cluster fails requests and watches instead of serving a
        // stale view (as Calico's client does for watches).
        .with_require_leader(true);
    if args.etcd_ca_file.is_some() || args.etcd_cert_file.is_some() {
        let mut tls = TlsOptions::new();
        if let Some(ca) = &args.etcd_ca_file {
            let pem = std::fs::read(ca)
                .with_context(|| format!("reading --etcd-ca-file {}", ca.display()))?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        if let (Some(cert), Some(key)) = (&args.etcd_cert_file, &args.etcd_key_file) {
            let cert_pem = std::fs::read(cert)
                .with_context(|| format!("reading --etcd-cert-file {}", cert.display()))?;
            let key_pem = std::fs::read(key)
                .with_context(|| format!("reading --etcd-key-file {}", key.display()))?;
            tls = tls.identity(Identity::from_pem(cert_pem, key_pem));
        }
        opts = opts.with_tls(tls);
    }
    Client::connect(&endpoints, Some(opts))
        .await
        .with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))
}
