//! `calc-bench churn`: datastore churn at increasing rates against a running
//! `calc-server serve` (file datastore) with simulated agents.
//!
//! It adds its own objects to the server's datastore directory (`churn/`: endpoints spread over
//! the agents' nodes, policies whose rules select them by a label, a marker policy), then for
//! each rate writes label flips (nine in ten) and policy edits for `--seconds`, while the marker
//! policy is edited every 200 ms and timed until every agent has it. A rate is *held* when the
//! writer kept it, the marker's p99 stayed within `--p99-limit`, and the agents' queues did not
//! grow (the server's `calc_server_agent_lag_messages`, summed, at the end of the step is no
//! larger than a step's worth of marker edits). Measures; does not judge (docs/benchmarks.md).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::mpsc;

use crate::bench_sync::{Event, admin_get, agent};
use crate::graph_bench::percentile;

#[derive(Clone, Debug, clap::Args)]
pub struct ChurnArgs {
    /// The server's gRPC URL.
    #[arg(long, env = "CHURN_SERVER", default_value = "http://127.0.0.1:50051")]
    pub server: String,
    /// The server's admin address (its queues are read from /metrics).
    #[arg(long, env = "CHURN_ADMIN", default_value = "127.0.0.1:9096")]
    pub admin: String,
    /// The server's datastore directory: the churned objects are written under `churn/`.
    #[arg(long, env = "CHURN_FILE_DIR")]
    pub file_dir: PathBuf,
    /// Simulated agents, for nodes `<prefix><i>`, i in 0..nodes (nodes the cluster has).
    #[arg(long, env = "CHURN_NODES", default_value_t = 100)]
    pub nodes: usize,
    #[arg(long, env = "CHURN_NODE_PREFIX", default_value = "node-")]
    pub node_prefix: String,
    /// Updates per second to try, in order (label flips and policy edits, 9:1).
    #[arg(
        long,
        env = "CHURN_RATES",
        value_delimiter = ',',
        default_value = "500,1000,2000,5000,10000"
    )]
    pub rates: Vec<u32>,
    /// How long each rate is held.
    #[arg(long, env = "CHURN_SECONDS", default_value_t = 60)]
    pub seconds: u64,
    /// Endpoints the churn flips (one file each).
    #[arg(long, env = "CHURN_ENDPOINTS", default_value_t = 1000)]
    pub endpoints: usize,
    /// Policies the churn edits (one file each); their rules select the flipped label.
    #[arg(long, env = "CHURN_POLICIES", default_value_t = 100)]
    pub policies: usize,
    /// A rate is held while the marker's p99 (datastore write → every agent) stays within this.
    #[arg(long, env = "CHURN_P99_LIMIT_MS", default_value_t = 100)]
    pub p99_limit_ms: u64,
}

fn wep(i: usize, node: &str, side: char) -> String {
    format!(
        "apiVersion: projectcalico.org/v3\nkind: WorkloadEndpoint\nmetadata:\n  name: {}-k8s-churn--{i}-eth0\n  namespace: churn\n  labels: {{churn: '{side}', projectcalico.org/namespace: churn, projectcalico.org/orchestrator: k8s}}\nspec:\n  orchestrator: k8s\n  node: {node}\n  pod: churn-{i}\n  endpoint: eth0\n  interfaceName: calichurn{i}\n  ipNetworks: [10.{}.{}.{}/32]\n  profiles: [kns.churn]\n",
        node.replace('-', "--"),
        200 + i / 65536,
        (i / 256) % 256,
        i % 256
    )
}

fn policy(j: usize, port: u32) -> String {
    format!(
        "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata:\n  name: churn-{j}\nspec:\n  order: {}\n  selector: churn == 'a'\n  types: [Ingress]\n  ingress:\n  - action: Allow\n    protocol: TCP\n    source: {{selector: churn == 'b'}}\n    destination: {{ports: [{port}]}}\n",
        5000 + j
    )
}

const PROFILE: &str = "apiVersion: projectcalico.org/v3\nkind: Profile\nmetadata:\n  name: kns.churn\nspec:\n  ingress: [{action: Allow}]\n  egress: [{action: Allow}]\n";

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    // Written aside and renamed, so the watcher never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// The sum of the agents' queue lengths, from the server's /metrics.
async fn lag(admin: &str) -> anyhow::Result<u64> {
    Ok(admin_get(admin, "/metrics")
        .await?
        .lines()
        .filter(|l| l.starts_with("calc_server_agent_lag_messages{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

/// Milliseconds at percentile `p` of `v` (sorted here).
fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    percentile(v, p).as_secs_f64() * 1e3
}

pub fn run(args: &ChurnArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(churn(args.clone()))
}

async fn churn(args: ChurnArgs) -> anyhow::Result<ExitCode> {
    let dir = args.file_dir.join("churn");
    std::fs::create_dir_all(&dir).context("creating the churn directory")?;
    let node = |i: usize| format!("{}{}", args.node_prefix, i % args.nodes.max(1));
    write(&dir.join("profile.yaml"), PROFILE)?;
    for i in 0..args.endpoints {
        write(&dir.join(format!("wep-{i}.yaml")), &wep(i, &node(i), 'a'))?;
    }
    for j in 0..args.policies {
        write(&dir.join(format!("pol-{j}.yaml")), &policy(j, 1000))?;
    }
    let marker = dir.join("marker.yaml");
    let mut marker_port: i32 = 1;
    write(&marker, &crate::bench_sync::marker_policy(marker_port))?;

    let (etx, mut erx) = mpsc::unbounded_channel();
    for i in 0..args.nodes {
        tokio::spawn(agent(
            i,
            args.server.clone(),
            node(i),
            true,
            None,
            etx.clone(),
        ));
    }
    // Everyone in sync with the churn objects in place.
    let mut in_sync = 0;
    while in_sync < args.nodes {
        match tokio::time::timeout(Duration::from_secs(120), erx.recv()).await {
            Ok(Some(Event::InSync(_))) => in_sync += 1,
            Ok(Some(_)) => {}
            _ => anyhow::bail!("only {in_sync} of {} agents in sync", args.nodes),
        }
    }
    println!(
        "churn: {} agents, {} churned endpoints, {} churned policies, {} s per rate",
        args.nodes, args.endpoints, args.policies, args.seconds
    );

    let mut held_best = None;
    let mut flip_side = vec!['a'; args.endpoints];
    let (mut next_wep, mut next_pol, mut edits) = (0usize, 0usize, 0u64);
    for &rate in &args.rates {
        let lag_start = lag(&args.admin).await?;
        let start = Instant::now();
        let end = start + Duration::from_secs(args.seconds);
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut written = 0u64;
        let mut latencies = Vec::new();
        // The marker edit being timed: (port, when written, agents that have it).
        let mut timing: Option<(i32, Instant, usize)> = None;
        let mut last_marker = start;
        while Instant::now() < end {
            tokio::select! {
                _ = tick.tick() => {
                    // Catch up to the rate for the time elapsed.
                    let due = (start.elapsed().as_secs_f64() * f64::from(rate)) as u64;
                    while written < due {
                        edits += 1;
                        if edits % 10 == 0 && args.policies > 0 {
                            let j = next_pol % args.policies;
                            next_pol += 1;
                            write(&dir.join(format!("pol-{j}.yaml")), &policy(j, 1000 + (edits % 50_000) as u32))?;
                        } else if args.endpoints > 0 {
                            let i = next_wep % args.endpoints;
                            next_wep += 1;
                            flip_side[i] = if flip_side[i] == 'a' { 'b' } else { 'a' };
                            write(&dir.join(format!("wep-{i}.yaml")), &wep(i, &node(i), flip_side[i]))?;
                        }
                        written += 1;
                    }
                    if timing.is_none() && last_marker.elapsed() >= Duration::from_millis(200) {
                        marker_port += 1;
                        write(&marker, &crate::bench_sync::marker_policy(marker_port))?;
                        last_marker = Instant::now();
                        timing = Some((marker_port, last_marker, 0));
                    }
                }
                e = erx.recv() => match e {
                    Some(Event::Marker(p)) => {
                        if let Some((port, at, got)) = &mut timing
                            && *port == p
                        {
                            *got += 1;
                            if *got == args.nodes {
                                latencies.push(at.elapsed());
                                timing = None;
                            }
                        }
                    }
                    Some(_) => {}
                    None => anyhow::bail!("every agent is gone"),
                },
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        let lag_end = lag(&args.admin).await?;
        let unfinished = timing.is_some_and(|(_, at, _)| at.elapsed() > Duration::from_secs(1));
        let achieved = written as f64 / elapsed;
        let (p50, p99) = (pct(&mut latencies, 0.5), pct(&mut latencies, 0.99));
        // A step's worth of marker edits may be queued at any moment; more means growth.
        let backlog_grew = lag_end > lag_start + (args.nodes as u64) * 10;
        // No marker edit timed at all is not a rate held.
        let held = !latencies.is_empty()
            && achieved >= 0.95 * f64::from(rate)
            && p99 <= args.p99_limit_ms as f64
            && !backlog_grew
            && !unfinished;
        println!(
            "churn {rate}/s: wrote {achieved:.0}/s, marker (write → every agent) p50 {p50:.1} ms, p99 {p99:.1} ms over {} edits, agents' queues {lag_start} → {lag_end} messages: {}",
            latencies.len(),
            if held { "held" } else { "not held" }
        );
        if held {
            held_best = Some(rate);
        } else {
            break;
        }
    }
    match held_best {
        Some(r) => println!(
            "churn: highest rate held with p99 <= {} ms: {r} updates/s",
            args.p99_limit_ms
        ),
        None => println!("churn: no rate held with p99 <= {} ms", args.p99_limit_ms),
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ExitCode::SUCCESS)
}
