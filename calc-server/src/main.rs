//! calc-server: the command-line entry point.
//!
//! Subcommands: `compute` (the stream a node would receive), the offline tools (selector
//! evaluation and normalisation, manifest validation), `gen-cluster` and `bench` for
//! benchmarks. The serving path (`serve`) arrives with the Sync stream.
//! Exit codes: 0 success, 1 invalid manifests found (validate), 2 usage or parse errors.

mod bench;
mod bench_sync;
mod compute;
mod datastore;
mod gen_cluster;
mod serve;
mod status_cmd;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use calc_graph::selector;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "calc-server",
    version,
    about = "Calico policy calculation server: computes tiered policy once for the whole cluster and streams each node what it needs."
)]
struct Cli {
    /// Log level (error, warn, info, debug, trace) or a tracing filter directive. Default:
    /// info for serve, warn for the other commands.
    #[arg(long, env = "CALC_SERVER_LOG_LEVEL", global = true)]
    log_level: Option<String>,

    /// Log line format: plain text or one JSON object per line.
    #[arg(
        long,
        env = "CALC_SERVER_LOG_FORMAT",
        global = true,
        value_enum,
        default_value = "plain"
    )]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

// Parsed once at start: the size of the serve variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Print the complete stream a node would receive (snapshot through InSync), one JSON object
    /// per line: the proto3 JSON mapping of each ToDataplane.
    Compute(compute::ComputeArgs),
    /// Serve the CalcServer.Sync gRPC stream: each connected agent gets its node's snapshot,
    /// InSync, then deltas; endpoint status flows back and is written to the datastore.
    Serve(serve::ServeArgs),
    /// Show connected nodes and their reported status (from a server's admin endpoint).
    Status(status_cmd::StatusArgs),
    /// Write a synthetic Calico cluster (JSON manifests) for benchmarks.
    GenCluster(gen_cluster::GenClusterArgs),
    /// Measure the calculation graph on a datastore directory (see docs/benchmarks.md).
    Bench(bench::BenchArgs),
    /// Simulated agents against a running server: time to sync, memory, change latency.
    BenchSync(bench_sync::BenchSyncArgs),
    /// Debug Calico label selectors.
    #[command(subcommand)]
    Selector(SelectorCommand),
    /// Load Calico v3 manifests (YAML or JSON, files or directories) and report every invalid
    /// object, one problem per line. Exits 1 if any object is invalid.
    Validate {
        /// Files or directories (searched recursively for *.yaml, *.yml and *.json).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
}

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Plain,
    /// One JSON object per line.
    Json,
}

#[derive(Subcommand)]
enum SelectorCommand {
    /// Evaluate a selector against a set of labels; prints `true` or `false`.
    Eval {
        /// The labels as a JSON object of strings, e.g. '{"app": "web", "tier": "frontend"}'.
        #[arg(long, env = "CALC_SERVER_SELECTOR_LABELS")]
        labels: String,
        /// The selector, e.g. "app == 'web' && has(tier)".
        selector: String,
    },
    /// Print the canonical form and unique id of a selector as one JSON object:
    /// {"canonical": "...", "unique_id": "s:..."}.
    Normalize {
        /// The selector to normalise.
        selector: String,
    },
}

fn main() -> ExitCode {
    // `serve --config-file PATH` (or CALC_SERVER_CONFIG_FILE) supplies defaults beneath flags
    // and environment variables.
    let cli: Cli =
        config_file::parse_args("--config-file", "CALC_SERVER_CONFIG_FILE", Some("serve"));
    let default_level = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    init_logging(
        cli.log_level.as_deref().unwrap_or(default_level),
        cli.log_format,
    );
    let result = match cli.command {
        Command::Compute(args) => compute::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Status(args) => status_cmd::run(&args),
        Command::GenCluster(args) => gen_cluster::run(&args).map(|stats| {
            eprintln!("{stats}");
            ExitCode::SUCCESS
        }),
        Command::Bench(args) => bench::run(&args),
        Command::BenchSync(args) => bench_sync::run(&args),
        Command::Selector(SelectorCommand::Eval { labels, selector }) => {
            selector_eval(&labels, &selector)
        }
        Command::Selector(SelectorCommand::Normalize { selector }) => selector_normalize(&selector),
        Command::Validate { paths } => validate(&paths),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}

fn init_logging(level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colour only for a person at a terminal: a log file or collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Plain => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn parse_selector(input: &str) -> anyhow::Result<selector::Selector> {
    // Trimmed as Calico's Normalise does, so a stray shell newline is not an error.
    Ok(selector::parse(input.trim())?)
}

fn selector_eval(labels: &str, sel: &str) -> anyhow::Result<ExitCode> {
    let labels: BTreeMap<String, String> = serde_json::from_str(labels)
        .context("--labels must be a JSON object whose values are strings")?;
    let sel = parse_selector(sel)?;
    println!("{}", sel.evaluate(&labels));
    Ok(ExitCode::SUCCESS)
}

fn selector_normalize(sel: &str) -> anyhow::Result<ExitCode> {
    let sel = parse_selector(sel)?;
    let out = serde_json::json!({"canonical": sel.canonical(), "unique_id": sel.unique_id()});
    println!("{out}");
    Ok(ExitCode::SUCCESS)
}

fn validate(paths: &[PathBuf]) -> anyhow::Result<ExitCode> {
    let report = datastore::file::manifest_dir::load(paths);
    let mut out = std::io::stdout().lock();
    for problem in &report.problems {
        writeln!(out, "{problem}")?;
    }
    eprintln!(
        "checked {} object(s) in {} file(s): {} valid, {} ignored (not used by the policy dataplane), {} problem(s)",
        report.objects,
        report.files,
        report.resources.len(),
        report.ignored,
        report.problems.len()
    );
    Ok(if report.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
