//! `calc-server status --server ADDR`: asks a running server's admin endpoint for its nodes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

#[derive(Clone, Debug, clap::Args)]
pub struct StatusArgs {
    /// The server's admin address (`--admin-listen` of serve), as host:port or http://host:port.
    #[arg(long, env = "CALC_SERVER_ADMIN", default_value = "127.0.0.1:9099")]
    pub server: String,
    /// Print the raw JSON instead of a table.
    #[arg(long, env = "CALC_SERVER_STATUS_JSON")]
    pub json: bool,
}

/// A minimal HTTP/1.0 GET: the admin endpoint is local plain HTTP and this keeps the binary
/// free of an HTTP client.
fn get(addr: &str, path: &str) -> anyhow::Result<String> {
    let addr = addr.trim_start_matches("http://").trim_end_matches('/');
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    let status = head.lines().next().unwrap_or_default();
    anyhow::ensure!(status.contains(" 200"), "{addr}{path}: {status}");
    Ok(body.to_string())
}

pub fn run(args: &StatusArgs) -> anyhow::Result<ExitCode> {
    let body = get(&args.server, "/status")?;
    if args.json {
        println!("{body}");
        return Ok(ExitCode::SUCCESS);
    }
    let nodes: Vec<serde_json::Value> = serde_json::from_str(&body).context("decoding /status")?;
    println!(
        "{:<20} {:<10} {:<21} {:<8} {:>8} {:>8}  ENDPOINTS",
        "NODE", "CONNECTED", "SINCE", "IN-SYNC", "SENT", "LAST-SEQ"
    );
    for n in &nodes {
        let eps = n["workload_endpoints"].as_object().map_or(0, |m| m.len())
            + n["host_endpoints"].as_object().map_or(0, |m| m.len());
        let up = n["workload_endpoints"]
            .as_object()
            .into_iter()
            .chain(n["host_endpoints"].as_object())
            .flat_map(|m| m.values())
            .filter(|v| v == &"up")
            .count();
        println!(
            "{:<20} {:<10} {:<21} {:<8} {:>8} {:>8}  {up}/{eps} up",
            n["node"].as_str().unwrap_or_default(),
            n["connected"].as_bool().unwrap_or_default(),
            n["connected_since"].as_str().unwrap_or_default(),
            n["dataplane_in_sync"].as_bool().unwrap_or_default(),
            n["messages_sent"],
            n["last_sequence_received"],
        );
    }
    Ok(ExitCode::SUCCESS)
}
