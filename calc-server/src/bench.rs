//! `calc-server bench`: measures the calculation graph on a datastore directory.
//!
//! Reports the floor (reading and decoding the manifests), the full compute (every resource
//! applied, every known node subscribed and flushed: the complete per-node streams), memory
//! (resident set before and after, peak), and incremental latency: one endpoint's label flipped,
//! then a flush that produces the affected nodes' messages, repeated. It measures; it does not
//! judge (docs/benchmarks.md records the figures).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use calc_graph::graph::{CalcGraph, Update};
use calc_graph::model::Resource;

use crate::datastore::{self, DatastoreArgs};

#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub datastore: DatastoreArgs,
    /// Number of single-endpoint label flips to time.
    #[arg(long, env = "CALC_SERVER_BENCH_FLIPS", default_value_t = 2000)]
    pub flips: usize,
}

/// (current RSS, peak RSS) in bytes, from /proc/self/status.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let (rss0, _) = rss();
    let t = Instant::now();
    let snap = datastore::snapshot(&args.datastore)?;
    let load = t.elapsed();
    anyhow::ensure!(
        snap.problems.is_empty(),
        "datastore has problems: {:?}",
        &snap.problems[..snap.problems.len().min(5)]
    );
    let endpoints: Vec<Resource> = snap
        .updates
        .iter()
        .filter_map(|u| match u {
            Update::Apply(r @ Resource::WorkloadEndpoint(..)) => Some(r.clone()),
            _ => None,
        })
        .collect();
    let endpoint_count = endpoints.len();
    let policy_count = snap
        .updates
        .iter()
        .filter(|u| {
            matches!(
                u,
                Update::Apply(Resource::NetworkPolicy(..) | Resource::GlobalNetworkPolicy(..))
            )
        })
        .count();
    // Keep only the endpoints the flips will use.
    let step = (endpoint_count / args.flips.max(1)).max(1);
    let flip_set: Vec<Resource> = endpoints
        .into_iter()
        .step_by(step)
        .take(args.flips)
        .collect();
    let (rss1, _) = rss();

    let t = Instant::now();
    let mut g = CalcGraph::new();
    let mut rejected = 0usize;
    for u in snap.updates {
        if g.apply(u).is_err() {
            rejected += 1;
        }
    }
    let applied = t.elapsed();
    let nodes = g.known_nodes();
    for n in &nodes {
        g.subscribe(n);
    }
    let batches = g.flush();
    let compute = t.elapsed();
    let messages: usize = batches.iter().map(|b| b.messages.len()).sum();
    let stats = g.index_stats();
    drop(batches);
    let (rss2, peak) = rss();

    let mut lat = Vec::with_capacity(flip_set.len());
    let mut flip_messages = 0usize;
    let mut touched_nodes = 0usize;
    for (i, res) in flip_set.into_iter().enumerate() {
        let mut res = res;
        if let Resource::WorkloadEndpoint(m, _) = &mut res {
            m.labels.insert("bench-flip".into(), format!("v{}", i % 2));
        }
        let t = Instant::now();
        g.apply(Update::Apply(res))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let out = g.flush();
        lat.push(t.elapsed());
        flip_messages += out.iter().map(|b| b.messages.len()).sum::<usize>();
        touched_nodes += out.len();
    }
    lat.sort();
    println!(
        "cluster: {} nodes, {endpoint_count} workload endpoints, {policy_count} policies ({rejected} rejected)",
        nodes.len()
    );
    println!("label index: {stats:?}");
    println!(
        "floor  (read + decode + validate manifests): {:8.1} ms",
        load.as_secs_f64() * 1e3
    );
    println!(
        "apply  (graph build, all resources):         {:8.1} ms",
        applied.as_secs_f64() * 1e3
    );
    println!(
        "compute (apply + flush every node):          {:8.1} ms  ({messages} messages)",
        compute.as_secs_f64() * 1e3
    );
    println!(
        "memory: RSS start {:.1} MiB, after load {:.1} MiB, after compute {:.1} MiB, peak {:.1} MiB",
        mib(rss0),
        mib(rss1),
        mib(rss2),
        mib(peak)
    );
    println!(
        "retained_bytes_per_endpoint: {:.0}",
        (rss2.saturating_sub(rss0)) as f64 / endpoint_count.max(1) as f64
    );
    println!("retained_rss_bytes: {}", rss2.saturating_sub(rss0));
    println!(
        "incremental label flip ({} flips): median {:.3} ms, p99 {:.3} ms, max {:.3} ms; {:.1} messages and {:.1} nodes per flip",
        lat.len(),
        percentile(&lat, 0.5).as_secs_f64() * 1e3,
        percentile(&lat, 0.99).as_secs_f64() * 1e3,
        lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        flip_messages as f64 / lat.len().max(1) as f64,
        touched_nodes as f64 / lat.len().max(1) as f64,
    );
    Ok(ExitCode::SUCCESS)
}
