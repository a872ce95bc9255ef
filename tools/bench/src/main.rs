//! calc-bench: the calc-server benchmarks (docs/benchmarks.md): synthetic clusters, the
//! calculation graph, simulated agents, label flips to the kernel. Not part of calc-server.

use std::process::ExitCode;

use bench_tools::{
    bench_sync, churn, console_bench, flip_kernel, flows_bench, gen_cluster, graph_bench,
    recommend_bench,
};
use clap::{Parser, Subcommand};

/// The same allocator as calc-server, so the graph benchmarks measure what the server runs.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "calc-bench",
    version,
    about = "Benchmarks for calc-server: synthetic clusters, the calculation graph, simulated agents, label flips to the kernel."
)]
struct Cli {
    /// Log level (error, warn, info, debug, trace) or a tracing filter directive.
    #[arg(
        long,
        env = "CALC_BENCH_LOG_LEVEL",
        global = true,
        default_value = "warn"
    )]
    log_level: String,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a synthetic Calico cluster (JSON manifests) for benchmarks.
    GenCluster(gen_cluster::GenClusterArgs),
    /// Measure the calculation graph on a datastore directory (see docs/benchmarks.md).
    Bench(graph_bench::BenchArgs),
    /// Simulated agents against a running server: time to sync, memory, change latency.
    BenchSync(bench_sync::BenchSyncArgs),
    /// Datastore churn at increasing rates against a running server and simulated agents:
    /// the highest rate held with the change latency's p99 within a limit.
    Churn(churn::ChurnArgs),
    /// Root only: an endpoint's label flipped in etcd (or a manifest directory) until its
    /// address is in or out of the kernel IP set of an agent (Linux driver) in a fresh network
    /// namespace; the breakdown from the server's and the agent's logs.
    FlipKernel(flip_kernel::FlipKernelArgs),
    /// calc-server's flow-log ingest (issue 42) on one core: records per second through
    /// parse and the flow store, and memory per flow key.
    Flows(flows_bench::FlowsBenchArgs),
    /// The admin console's pages (issue 43) rendered on the server for a large cluster with
    /// flows in the store: time per page.
    Console(console_bench::ConsoleBenchArgs),
    /// Policy recommendations (issue 45) for one namespace, pure: prints
    /// `recommend: <pods> pods, <flows> flows: <ms> ms` (target ≤ 1 s for 1,000 pods and
    /// 100,000 flows).
    Recommend(recommend_bench::RecommendBenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    common::init_logging(&cli.log_level, common::LogFormat::Plain, "warn");
    let result = match cli.command {
        Command::GenCluster(args) => gen_cluster::run(&args).map(|stats| {
            eprintln!("{stats}");
            ExitCode::SUCCESS
        }),
        Command::Bench(args) => graph_bench::run(&args),
        Command::BenchSync(args) => bench_sync::run(&args),
        Command::Churn(args) => churn::run(&args),
        Command::FlipKernel(args) => flip_kernel::run(&args),
        Command::Flows(args) => flows_bench::run(&args),
        Command::Console(args) => console_bench::run(&args),
        Command::Recommend(args) => recommend_bench::run(&args),
    };
    result.unwrap_or_else(|error| {
        eprintln!("error: {error:#}");
        ExitCode::from(2)
    })
}
