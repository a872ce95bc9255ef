//! calc-server: the command-line entry point. Only the CLI lives here (parsing, logging,
//! dispatch); the commands are in the `calc_server` library.
//!
//! Subcommands: `serve` (the Sync stream), `status`, `policies` (unused policies and rules, from
//! a running server's hit counters), `flows`, `recommend` (staged policies from a namespace's
//! flows, their would-break check, promotion), `compute` (the stream a node would receive), `explain`
//! (why traffic is allowed or denied), the offline tools (selector
//! evaluation and normalisation, manifest validation). The benchmarks are the separate
//! `calc-bench` tool (`tools/bench`), not commands of the server.
//! Exit codes: 0 success, 1 invalid manifests found (validate), 2 usage or parse errors.

use std::path::PathBuf;
use std::process::ExitCode;

use calc_server::args::{
    ComputeArgs, ExplainArgs, FlowsArgs, PoliciesArgs, RecommendArgs, ServeArgs, StatusArgs,
};
use calc_server::{
    compute, explain_cmd, flows_cmd, offline, policies_cmd, recommend_cmd, serve, status_cmd,
};
use clap::{Parser, Subcommand};
use common::LogFormat;

/// mimalloc, not glibc's malloc: see the workspace Cargo.toml.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    #[command(override_usage = "calc-server compute [OPTIONS] <--node <NODE>... | --all-nodes>")]
    Compute(ComputeArgs),
    /// Explain why traffic is allowed or denied (--from/--to), list what applies to an endpoint
    /// (--endpoint) or where a policy is in force (--policy): from the datastore, or from a
    /// running server with --server ADMIN_ADDR.
    #[command(
        override_usage = "calc-server explain [OPTIONS] --from <FROM> --to <TO> [--protocol <PROTOCOL>] [--port <PORT>]\n       calc-server explain [OPTIONS] --endpoint <ENDPOINT>\n       calc-server explain [OPTIONS] --policy <[KIND:][NAMESPACE/]NAME>"
    )]
    Explain(ExplainArgs),
    /// Serve the CalcServer.Sync gRPC stream: each connected agent gets its node's snapshot,
    /// InSync, then deltas; endpoint status flows back and is written to the datastore.
    Serve(ServeArgs),
    /// Show connected nodes and their reported status (from a server's admin endpoint).
    Status(StatusArgs),
    /// List the policies and profiles in force, and their rules, that no packet matched within
    /// a window (--unused [--since 7d]), from a running server's hit counters; those observed
    /// for less than the window are listed as not yet known, never as unused.
    #[command(
        override_usage = "calc-server policies [OPTIONS] --unused [--since <DURATION>] [--output <OUTPUT>]"
    )]
    Policies(PoliciesArgs),
    /// List the flows a running server aggregated from its agents' flow logs (serve
    /// --flow-logs): one line per flow with both sides, port, action, packets and bytes and
    /// the rule that decided (--trace: the whole trace).
    Flows(FlowsArgs),
    /// Recommend least-privilege StagedNetworkPolicies for a namespace from the flows a
    /// running server aggregated (serve --flow-logs), one per workload group, each rule
    /// annotated with the flows behind it; --check: what each staged policy of the namespace
    /// would break (flows it denies that the enforced policies allow; exit 1 if any);
    /// --promote: the enforced NetworkPolicy of each staged policy.
    #[command(
        override_usage = "calc-server recommend --server <ADMIN> --namespace <NS> [--since <DURATION>] [--output yaml|json] [--tier <T>] [--include-denied] [--min-samples <N>]\n       calc-server recommend --server <ADMIN> --namespace <NS> --check [--since <DURATION>] [--output yaml|json]\n       calc-server recommend --promote [--file <PATH>...] [--namespace <NS>] [--server <ADMIN>] [--output yaml|json]"
    )]
    Recommend(RecommendArgs),
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
    common::init_logging(
        cli.log_level.as_deref().unwrap_or(default_level),
        cli.log_format,
        "warn",
    );
    let result = match cli.command {
        Command::Compute(args) => compute::run(&args),
        Command::Explain(args) => explain_cmd::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Status(args) => status_cmd::run(&args),
        Command::Policies(args) => policies_cmd::run(&args),
        Command::Flows(args) => flows_cmd::run(&args),
        Command::Recommend(args) => recommend_cmd::run(&args),
        Command::Selector(SelectorCommand::Eval { labels, selector }) => {
            offline::selector_eval(&labels, &selector)
        }
        Command::Selector(SelectorCommand::Normalize { selector }) => {
            offline::selector_normalize(&selector)
        }
        Command::Validate { paths } => offline::validate(&paths),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}
