//! `calc-bench console`: the admin console's pages (issue 43) rendered on the server for a
//! large cluster, with flow records in the store.
//!
//! The cluster: a `gen-cluster` cluster (by default 1000 nodes × 10 workload endpoints, 10 000
//! policies in three tiers, 100 namespaces). The flows: `--flows` records, each its own flow
//! key (`calc-bench flows`' generator with no shared conversations), reported by the nodes in
//! turn, `--report-size` per report, over the last four 15 s intervals. Both go into a real
//! engine (`calc_server::serve::console::bench`), behind the real admin router; each page is
//! then asked `--rounds` times after one warm-up, without the network (the access check, the
//! engine's answer, the template), and its first (warm-up) answer time, its median, 95th
//! percentile and largest answer time and its size are printed. Nothing changes between
//! answers: the first page that needs the realization table (the overview) computes it, the
//! others reuse it, as on a quiet cluster. Pages: the overview, the policy board's first and last page, one
//! policy, the nodes table, and the flows table (the first page of 100, and a namespace
//! filter, which the console applies to every flow of the window); and, for comparison,
//! `/status/policies` (the JSON of the realization table the overview and the board use).
//!
//! It measures; it does not judge (docs/benchmarks.md records the figures; the target is at
//! most 100 ms for the overview and the board).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use calc_graph::graph::Update;
use calc_graph::manifest::{Outcome, decode_and_validate};
use calc_server::flows::BUCKET_SECONDS;
use calc_server::serve::console::bench::Before;
use common::Rng;

use crate::flows_bench;
use crate::gen_cluster::{self, GenClusterArgs};

#[derive(Clone, Debug, clap::Args)]
pub struct ConsoleBenchArgs {
    /// Nodes of the synthetic cluster.
    #[arg(long, env = "CONSOLE_BENCH_NODES", default_value_t = 1000)]
    pub nodes: usize,
    /// Workload endpoints per node.
    #[arg(long, env = "CONSOLE_BENCH_ENDPOINTS_PER_NODE", default_value_t = 10)]
    pub endpoints_per_node: usize,
    /// Policies (NetworkPolicy and GlobalNetworkPolicy, in three tiers).
    #[arg(long, env = "CONSOLE_BENCH_POLICIES", default_value_t = 10_000)]
    pub policies: usize,
    /// Namespaces.
    #[arg(long, env = "CONSOLE_BENCH_NAMESPACES", default_value_t = 100)]
    pub namespaces: usize,
    /// Flow records put in the store, each its own key.
    #[arg(long, env = "CONSOLE_BENCH_FLOWS", default_value_t = 10_000)]
    pub flows: usize,
    /// Records per FlowReport.
    #[arg(long, env = "CONSOLE_BENCH_REPORT_SIZE", default_value_t = 500)]
    pub report_size: usize,
    /// Timed answers per page (after one warm-up).
    #[arg(long, env = "CONSOLE_BENCH_ROUNDS", default_value_t = 20)]
    pub rounds: usize,
    /// Seed of the cluster and of the records.
    #[arg(long, env = "CONSOLE_BENCH_SEED", default_value_t = 1)]
    pub seed: u64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `q`-quantile of sorted times.
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn run(args: &ConsoleBenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.report_size > 0, "--report-size must be positive");
    let t = Instant::now();
    let objects = gen_cluster::generate(&GenClusterArgs {
        shape: gen_cluster::Shape::Calico,
        nodes: args.nodes,
        endpoints_per_node: args.endpoints_per_node,
        policies: args.policies,
        namespaces: args.namespaces,
        seed: args.seed,
        out: std::path::PathBuf::new(),
    });
    let mut updates = Vec::with_capacity(objects.len() + 1);
    for o in &objects {
        match decode_and_validate(o.clone()) {
            Outcome::Valid(_, res) => updates.push(Update::ApplyValid(res)),
            Outcome::Ignored(..) => {}
            _ => anyhow::bail!("invalid object: {}", o["metadata"]["name"]),
        }
    }
    updates.push(Update::InSync);
    // The reporting endpoints and their tiers, from the same objects.
    let (graph, _) = flows_bench::build_graph(&objects)?;
    let (nodes, eps) = flows_bench::endpoints(&graph);
    anyhow::ensure!(!eps.is_empty(), "the cluster has no workload endpoint");
    let policies = graph.view().policies().count();
    drop(graph);
    // A fixed clock: the newest interval closed 5 s ago.
    let newest = 1_800_000_000 - 1_800_000_000 % BUCKET_SECONDS;
    let now = std::time::UNIX_EPOCH + Duration::from_secs((newest + BUCKET_SECONDS + 5) as u64);
    let mut rng = Rng::new(args.seed);
    let reports = flows_bench::reports(
        &mut rng,
        &nodes,
        &eps,
        args.flows,
        args.report_size,
        (newest, 4),
        0,
    );
    let namespace = "ns-1".to_string();
    let last_board_page = (policies / 250).to_string();
    let some_policy = objects
        .iter()
        .find(|o| o["kind"] == "NetworkPolicy")
        .map(|o| {
            format!(
                "/ui/policies/NetworkPolicy:{}/{}",
                o["metadata"]["namespace"].as_str().unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap_or_default()
            )
        })
        .unwrap_or_else(|| "/ui/policies".into());
    let paths = [
        ("/ui/".to_string(), Before::Nothing),
        // The JSON of the realization table the overview and the board are built on.
        ("/status/policies".into(), Before::Nothing),
        ("/ui/policies".into(), Before::Nothing),
        (
            format!("/ui/policies?page={last_board_page}"),
            Before::Nothing,
        ),
        (some_policy, Before::Nothing),
        ("/ui/nodes".into(), Before::Nothing),
        ("/ui/flows".into(), Before::Nothing),
        (format!("/ui/flows?namespace={namespace}"), Before::Nothing),
        // On a cluster that moves: the kept table is no longer current.
        ("/ui/".into(), Before::AgentReconnect),
        ("/ui/policies".into(), Before::AgentReconnect),
        ("/status/policies".into(), Before::AgentReconnect),
        ("/ui/".into(), Before::DatastoreBatch),
        ("/ui/policies".into(), Before::DatastoreBatch),
    ];
    println!(
        "cluster: {} nodes, {} workload endpoints, {policies} policies, {} namespaces; {} flow records in {} reports (prepared in {:.1} s)",
        nodes.len(),
        eps.len(),
        args.namespaces,
        args.flows,
        reports.len(),
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let (loaded, timings) =
        calc_server::serve::console::bench::run(updates, reports, now, &paths, args.rounds)?;
    println!(
        "engine loaded: {} flow keys from {} accepted records (with the timed pages: {:.1} s)",
        loaded.flow_keys,
        loaded.accepted,
        t.elapsed().as_secs_f64()
    );
    println!(
        "{:<72} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "PAGE", "STATUS", "BYTES", "FIRST", "MEDIAN", "P95", "MAX"
    );
    for mut p in timings {
        p.times.sort();
        println!(
            "{:<72} {:>6} {:>10} {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms",
            p.path,
            p.status,
            p.bytes,
            ms(p.first),
            ms(quantile(&p.times, 0.5)),
            ms(quantile(&p.times, 0.95)),
            ms(p.times.last().copied().unwrap_or_default()),
        );
    }
    Ok(ExitCode::SUCCESS)
}
