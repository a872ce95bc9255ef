//! `calc-bench bench-sync --failover-replicas`: calc-server replicas behind one address, one
//! killed.
//!
//! The replicas serve the same datastore. The agents are given one address: a TCP forwarder
//! in this process that sends each new connection to the next replica that accepts it, as a
//! Kubernetes Service (kube-proxy) does once the dead replica's endpoint is gone; connections
//! are balanced per connection, not per request, and a connection to a replica that dies is
//! closed, as the kernel closes it. Once every agent is in sync the first replica is killed
//! (SIGKILL); measured: the time until every agent it served is in sync again on another, and
//! how many agents' programmed state (a digest of everything a dry-run agent would hold,
//! `sync_agent::Programmed`) differs from before the kill.

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::mpsc;

use crate::bench_sync::{BenchSyncArgs, Event, mib, reason_class, rss_of, wait_for_marker};

/// The forwarder's buffer per connection towards the replica (reports: small) and towards the
/// agent (snapshots of megabytes).
const FORWARD_UP: usize = 8 * 1024;
const FORWARD_DOWN: usize = 256 * 1024;

/// The forwarder: one listening address, the replicas behind it.
struct Forwarder {
    backends: Vec<String>,
    /// Connections currently forwarded to each replica.
    live: Vec<AtomicUsize>,
    next: AtomicUsize,
}

impl Forwarder {
    /// Accepts on `listener` and forwards each connection to the next replica that accepts
    /// a connection (round robin, skipping one that refuses).
    async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let _ = client.set_nodelay(true);
            let me = self.clone();
            tokio::spawn(async move {
                let n = me.backends.len();
                let first = me.next.fetch_add(1, Ordering::Relaxed);
                for k in 0..n {
                    let b = (first + k) % n;
                    let Ok(mut server) = tokio::net::TcpStream::connect(&me.backends[b]).await
                    else {
                        continue;
                    };
                    let _ = server.set_nodelay(true);
                    me.live[b].fetch_add(1, Ordering::Relaxed);
                    // Large buffers, as a kernel forwarder would not copy at all: with tokio's 8 KiB
                    // the forwarder's syscalls, not the replicas, set the pace of a resync.
                    let _ = tokio::io::copy_bidirectional_with_sizes(
                        &mut client,
                        &mut server,
                        FORWARD_UP,
                        FORWARD_DOWN,
                    )
                    .await;
                    me.live[b].fetch_sub(1, Ordering::Relaxed);
                    return;
                }
                // No replica accepted: the client sees its connection closed and retries.
            });
        }
    }
}

pub(crate) async fn run(args: &BenchSyncArgs) -> anyhow::Result<ExitCode> {
    let replicas = args.failover_replicas.clone();
    anyhow::ensure!(
        replicas.len() >= 2 && args.failover_pids.len() == replicas.len(),
        "--failover-replicas needs at least two replicas and as many --failover-pids"
    );
    if let Some(dir) = &args.file_dir {
        std::fs::write(
            dir.join("zz-bench-sync-marker.yaml"),
            crate::bench_sync::marker_policy(1),
        )?;
    }
    for admin in &args.failover_admins {
        wait_for_marker(admin).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle: Vec<_> = args
        .failover_pids
        .iter()
        .map(|p| rss_of(Some(*p)).map_or(0, |r| r.0))
        .collect();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let forwarder = Arc::new(Forwarder {
        live: replicas.iter().map(|_| AtomicUsize::new(0)).collect(),
        backends: replicas,
        next: AtomicUsize::new(0),
    });
    tokio::spawn(forwarder.clone().serve(listener));

    let digests: Arc<Vec<AtomicU64>> =
        Arc::new((0..args.nodes).map(|_| AtomicU64::new(0)).collect());
    let setup = crate::sync_agent::AgentSetup {
        addr,
        report_applied: args.report_applied,
        stats: None,
        digests: Some(digests.clone()),
    };
    let (etx, mut erx) = mpsc::unbounded_channel();
    let start = Instant::now();
    for i in 0..args.nodes {
        tokio::spawn(crate::sync_agent::run(
            i,
            format!("{}{i}", args.node_prefix),
            setup.clone(),
            etx.clone(),
        ));
    }
    drop(etx);
    let mut synced = vec![false; args.nodes];
    let mut early = std::collections::HashMap::<String, usize>::new();
    let (mut in_sync, mut reconnects) = (0usize, 0usize);
    while in_sync < args.nodes {
        match tokio::time::timeout(Duration::from_secs(120), erx.recv()).await {
            Ok(Some(Event::InSync(i))) => {
                if !std::mem::replace(&mut synced[i], true) {
                    in_sync += 1;
                }
            }
            Ok(Some(Event::Disconnected(_, w))) => {
                reconnects += 1;
                *early.entry(reason_class(&w)).or_default() += 1;
            }
            Ok(Some(Event::Marker(_))) => {}
            Ok(None) | Err(_) => anyhow::bail!(
                "timed out with {in_sync} of {} agents in sync on the replicas",
                args.nodes
            ),
        }
    }
    let all_in_sync = start.elapsed();
    // Let the last reports and digests settle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    while let Ok(e) = erx.try_recv() {
        if let Event::Disconnected(..) = e {
            reconnects += 1;
        }
    }
    let before: Vec<u64> = digests.iter().map(|d| d.load(Ordering::Relaxed)).collect();
    let per_replica: Vec<usize> = forwarder
        .live
        .iter()
        .map(|l| l.load(Ordering::Relaxed))
        .collect();
    let rss: Vec<u64> = args
        .failover_pids
        .iter()
        .map(|p| rss_of(Some(*p)).map_or(0, |r| r.0))
        .collect();
    println!(
        "failover: {} agents in sync through one address on {} replicas in {:.2} s ({} reconnects); agents per replica {:?}; replicas' RSS above idle {:?} MiB",
        args.nodes,
        per_replica.len(),
        all_in_sync.as_secs_f64(),
        reconnects,
        per_replica,
        rss.iter()
            .zip(&idle)
            .map(|(r, i)| format!("{:.1}", mib(r.saturating_sub(*i))))
            .collect::<Vec<_>>()
    );

    if !early.is_empty() {
        let mut early: Vec<_> = early.into_iter().collect();
        early.sort_by_key(|e| std::cmp::Reverse(e.1));
        println!(
            "failover: why streams ended before all were in sync: {}",
            early
                .iter()
                .map(|(r, n)| format!("{n} {r}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    // Kill the first replica.
    let victim = args.failover_pids[0];
    let affected = per_replica[0];
    let killed = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .context("running kill")?;
    anyhow::ensure!(status.success(), "kill -KILL {victim} failed");
    let mut lost = BTreeSet::new();
    let mut back = BTreeSet::new();
    let mut why = std::collections::HashMap::<String, usize>::new();
    let resync = loop {
        if lost.len() >= affected && back.len() == lost.len() {
            break killed.elapsed();
        }
        match tokio::time::timeout(Duration::from_secs(60), erx.recv()).await {
            Ok(Some(Event::Disconnected(i, w))) => {
                lost.insert(i);
                back.remove(&i);
                *why.entry(reason_class(&w)).or_default() += 1;
            }
            Ok(Some(Event::InSync(i))) => {
                if lost.contains(&i) {
                    back.insert(i);
                }
            }
            Ok(Some(Event::Marker(_))) => {}
            Ok(None) | Err(_) => anyhow::bail!(
                "{} of {affected} agents of the killed replica lost their stream, {} are in sync again after 60 s",
                lost.len(),
                back.len()
            ),
        }
    };
    // Let reports and digests settle, then compare.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after: Vec<u64> = digests.iter().map(|d| d.load(Ordering::Relaxed)).collect();
    let changed = before.iter().zip(&after).filter(|(a, b)| a != b).count();
    let per_replica: Vec<usize> = forwarder
        .live
        .iter()
        .map(|l| l.load(Ordering::Relaxed))
        .collect();
    let distinct: BTreeSet<u64> = before.iter().copied().collect();
    println!(
        "failover: killed replica 1 (pid {victim}) serving {affected} agents; {} agents lost their stream and were in sync again on the others after {:.2} s; agents per replica now {:?}; {} distinct states before",
        lost.len(),
        resync.as_secs_f64(),
        per_replica,
        distinct.len()
    );
    if !why.is_empty() {
        let mut why: Vec<_> = why.into_iter().collect();
        why.sort_by_key(|e| std::cmp::Reverse(e.1));
        println!(
            "failover: why streams ended: {}",
            why.iter()
                .map(|(r, n)| format!("{n} {r}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if let Some(dir) = &args.file_dir {
        let _ = std::fs::remove_file(dir.join("zz-bench-sync-marker.yaml"));
    }
    // The contract line scripts read (`make bench-sync`).
    println!(
        "failover {} replicas: resync {:.2} s, state changes {changed}",
        args.failover_replicas.len(),
        resync.as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
