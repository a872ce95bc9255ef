//! dataplane-agent: follows a calc-server's Sync stream and programs this node's dataplane.
//!
//! Not implemented yet: the session, the driver trait and the dry-run driver land with the
//! Sync-stream issue, the Linux driver after it. Until then the binary only parses its
//! command line and says so, rather than pretending to run.

use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "dataplane-agent",
    version,
    about = "Follows a calc-server's Sync stream and programs this node's dataplane (iptables, ipsets, routes) through a pluggable driver."
)]
struct Cli {
    /// calc-server URL(s), tried in order (e.g. http://calc-server:50051).
    #[arg(long = "server", env = "DATAPLANE_AGENT_SERVER", value_delimiter = ',')]
    servers: Vec<String>,
    /// This node's name, as in the datastore's WorkloadEndpoint spec.node.
    #[arg(long, env = "DATAPLANE_AGENT_NODE")]
    node: Option<String>,
}

fn main() -> ExitCode {
    let _cli = Cli::parse();
    eprintln!(
        "dataplane-agent: the Sync session is not implemented yet; see `dataplane-agent --help` and docs/proto.md"
    );
    ExitCode::from(2)
}
