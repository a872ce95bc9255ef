//! `calc-bench bench`: measures the calculation graph on a datastore directory.
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

use calc_graph::manifest::{self, Outcome};

use calc_server::args::DatastoreArgs;
use calc_server::datastore;

#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub datastore: DatastoreArgs,
    /// Number of single-endpoint label flips to time.
    #[arg(long, env = "CALC_SERVER_BENCH_FLIPS", default_value_t = 2000)]
    pub flips: usize,
    /// Names the cluster in the summary line, which then reads `calc <name>: floor <ms> ms,
    /// compute <ms> ms, rss <MiB> MiB` (the process's peak resident set) instead of
    /// `calc <endpoints>: … ratio <x>`.
    #[arg(long, env = "CALC_SERVER_BENCH_NAME")]
    pub name: Option<String>,
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

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Manifest files of the datastore directory, in load order.
fn files(args: &BenchArgs) -> anyhow::Result<Vec<std::path::PathBuf>> {
    anyhow::ensure!(
        args.datastore.datastore_type == datastore::DatastoreType::File,
        "bench reads the file datastore"
    );
    let mut v: Vec<_> = std::fs::read_dir(&args.datastore.file_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|x| x == "json" || x == "yaml" || x == "yml")
        })
        .collect();
    v.sort();
    Ok(v)
}

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let files = files(args)?;
    let (rss0, _) = rss();

    // The graph is built first, streaming: each object goes into the graph as it is decoded,
    // so resident memory afterwards is the graph's (plus the largest file's text, freed but
    // kept by the allocator).
    let mut g = CalcGraph::new();
    let mut apply_time = Duration::ZERO;
    let (mut endpoint_count, mut policy_count, mut rejected, mut problems) =
        (0usize, 0usize, 0usize, 0usize);
    let mut workloads: Vec<Resource> = Vec::new();
    let mut largest_file = 0usize;
    for f in &files {
        let text = std::fs::read_to_string(f)?;
        largest_file = largest_file.max(text.len());
        manifest::for_each_entry(&text, |e| match e.outcome {
            Outcome::Valid(_, res) => {
                match &*res {
                    Resource::WorkloadEndpoint(..) => {
                        endpoint_count += 1;
                        // Every 50th endpoint is kept for the flips.
                        if endpoint_count % 50 == 1 && workloads.len() < args.flips {
                            workloads.push(res.clone().into_resource());
                        }
                    }
                    Resource::Policy(..) => policy_count += 1,
                    _ => {}
                }
                let t = Instant::now();
                // Validated once, by the decoder, as the serving path does.
                if g.apply(Update::ApplyValid(res)).is_err() {
                    rejected += 1;
                }
                apply_time += t.elapsed();
            }
            Outcome::Ignored(..) => {}
            _ => problems += 1,
        })?;
    }
    anyhow::ensure!(problems == 0, "{problems} invalid objects in the datastore");
    let t = Instant::now();
    g.apply(Update::InSync)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let nodes = g.known_nodes();
    for n in &nodes {
        g.subscribe(n);
    }
    let (rss_applied, _) = rss();
    // Each batch is dropped as soon as it is counted, as a server encodes and sends it.
    let mut messages = 0usize;
    g.flush_with(|b| messages += b.messages.len());
    // As the server does once no snapshot is waiting: the whole IP-set messages kept for the
    // next subscriber are given back.
    g.release_message_cache();
    let flush_time = t.elapsed();
    let stats = g.index_stats();
    let (rss_flushed, peak) = rss();

    // The floor: only reading, decoding and validating the same manifests.
    let t = Instant::now();
    let mut decoded = 0usize;
    for f in &files {
        let text = std::fs::read_to_string(f)?;
        manifest::for_each_entry(&text, |_| decoded += 1)?;
    }
    let floor = t.elapsed();

    let mut lat = Vec::with_capacity(workloads.len());
    let mut flip_messages = 0usize;
    let mut touched_nodes = 0usize;
    for (i, mut res) in workloads.into_iter().enumerate() {
        // Moving an endpoint to another application changes which policies and IP sets
        // select it: the flip reaches every node that holds those sets.
        if let Resource::WorkloadEndpoint(m, _) = &mut res {
            m.labels.insert("app".into(), format!("flipped-{}", i % 2));
        }
        let t = Instant::now();
        g.apply(Update::Apply(res))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        g.flush_with(|b| {
            flip_messages += b.messages.len();
            touched_nodes += 1;
        });
        lat.push(t.elapsed());
    }
    lat.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let compute = apply_time + flush_time;
    println!(
        "cluster: {} nodes, {endpoint_count} workload endpoints, {policy_count} policies, {decoded} objects ({rejected} rejected)",
        nodes.len()
    );
    println!("label index: {stats:?}");
    println!(
        "floor   (read + decode + validate manifests): {:8.1} ms",
        ms(floor)
    );
    println!(
        "compute (apply every object + flush every node): {:8.1} ms = apply {:.1} + flush {:.1}  ({messages} messages)",
        ms(compute),
        ms(apply_time),
        ms(flush_time)
    );
    println!(
        "memory: RSS start {:.1} MiB, after apply {:.1} MiB, after flush {:.1} MiB, peak {:.1} MiB (largest manifest file {:.1} MiB)",
        mib(rss0),
        mib(rss_applied),
        mib(rss_flushed),
        mib(peak),
        mib(largest_file as u64)
    );
    println!("retained_rss_bytes: {}", rss_flushed.saturating_sub(rss0));
    // The contract lines scripts read (`make bench-calc`): the cluster named by its endpoints,
    // or by `--name` with the peak memory (what Antrea's benchmark reports beside its time).
    match &args.name {
        Some(name) => println!(
            "calc {name}: floor {:.0} ms, compute {:.0} ms, rss {:.0} MiB",
            ms(floor),
            ms(compute),
            mib(peak)
        ),
        None => {
            let size = if endpoint_count >= 1000 && endpoint_count % 1000 == 0 {
                format!("{}k", endpoint_count / 1000)
            } else {
                endpoint_count.to_string()
            };
            println!(
                "calc {size}: floor {:.0} ms, compute {:.0} ms, ratio {:.2}",
                ms(floor),
                ms(compute),
                compute.as_secs_f64() / floor.as_secs_f64().max(1e-9)
            );
        }
    }
    println!(
        "incremental label flip ({} flips): median {:.3} ms, p99 {:.3} ms, max {:.3} ms; {:.1} messages to {:.1} nodes per flip",
        lat.len(),
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.99)),
        ms(lat.last().copied().unwrap_or_default()),
        flip_messages as f64 / lat.len().max(1) as f64,
        touched_nodes as f64 / lat.len().max(1) as f64,
    );
    Ok(ExitCode::SUCCESS)
}
