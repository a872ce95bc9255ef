//! `calc-bench bench-sync`: simulated agents against a running `calc-server serve`.
//!
//! Opens one Sync stream per node (all at once), measures the time until every stream has
//! received InSync, then edits the datastore (a global policy every node runs) and measures how
//! long the change takes to reach each agent. Reads the server's resident memory from /proc
//! when given its pid. Measures; does not judge (docs/benchmarks.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use felix_proto as pb;
use pb::to_dataplane::Payload as To;
use tokio::sync::{Mutex, mpsc};
use tokio_stream::StreamExt;

#[derive(Clone, Debug, clap::Args)]
pub struct BenchSyncArgs {
    /// The server's gRPC URL.
    #[arg(
        long,
        env = "BENCH_SYNC_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// Node names are `<prefix><i>` for i in 0..nodes (gen-cluster names nodes `node-<i>`).
    #[arg(long, env = "BENCH_SYNC_NODES", default_value_t = 1000)]
    pub nodes: usize,
    #[arg(long, env = "BENCH_SYNC_NODE_PREFIX", default_value = "node-")]
    pub node_prefix: String,
    /// The server's datastore directory: the file whose edit is timed lives there.
    #[arg(
        long,
        env = "BENCH_SYNC_FILE_DIR",
        required_unless_present = "etcd_endpoint"
    )]
    pub file_dir: Option<PathBuf>,
    /// Time the change as an etcd put (Calico's key layout) instead of a file write, for a
    /// server running on the etcd v3 datastore.
    #[arg(long, env = "BENCH_SYNC_ETCD_ENDPOINT")]
    pub etcd_endpoint: Option<String>,
    /// The server's process id, to read its memory from /proc.
    #[arg(long, env = "BENCH_SYNC_SERVER_PID")]
    pub server_pid: Option<u32>,
    /// How many global changes to time.
    #[arg(long, env = "BENCH_SYNC_CHANGES", default_value_t = 20)]
    pub changes: usize,
    /// Simulated agents offer the `applied` capability and report every message applied as
    /// soon as it arrives (`DataplaneApplied`), as a real agent does after each apply.
    #[arg(long, env = "BENCH_SYNC_REPORT_APPLIED", default_value_t = true, action = clap::ArgAction::Set)]
    pub report_applied: bool,
    /// The server's admin address: with it, each change is also timed until the server shows
    /// the marker policy `Realized` on every node (`/status/policies/bench-sync-marker`).
    #[arg(long, env = "BENCH_SYNC_ADMIN")]
    pub admin: Option<String>,
}

fn rss_of(pid: Option<u32>) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    Some((field("VmRSS:"), field("VmHWM:")))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// What each simulated agent reports to the coordinator.
pub(crate) enum Event {
    InSync(usize),
    /// An agent saw the marker policy with this port.
    Marker(i32),
    Failed(usize, String),
}

/// Opens a Sync stream as a simulated agent: sends the hello and returns the sender for further
/// reports (keep it: dropping it ends the stream) and the server's messages.
pub(crate) async fn open_sync(
    client: &mut pb::calc_server_client::CalcServerClient<tonic::transport::Channel>,
    node: String,
    version: &str,
    capabilities: Vec<String>,
) -> Result<
    (
        mpsc::Sender<pb::FromDataplane>,
        tonic::Streaming<pb::ToDataplane>,
    ),
    String,
> {
    let (tx, rx) = mpsc::channel(4);
    tx.send(pb::FromDataplane {
        sequence_number: 1,
        payload: Some(pb::from_dataplane::Payload::AgentHello(pb::AgentHello {
            node_name: node,
            agent_version: version.into(),
            capabilities,
        })),
    })
    .await
    .map_err(|e| e.to_string())?;
    let stream = client
        .sync(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    Ok((tx, stream))
}

pub(crate) async fn agent(
    i: usize,
    url: String,
    node: String,
    report_applied: bool,
    events: mpsc::UnboundedSender<Event>,
) {
    let run = async {
        let mut client = pb::calc_server_client::CalcServerClient::connect(url)
            .await
            .map_err(|e| e.to_string())?
            .max_decoding_message_size(usize::MAX);
        let capabilities = if report_applied {
            vec!["applied".into()]
        } else {
            vec![]
        };
        let (tx, mut stream) = open_sync(&mut client, node, "bench-sync", capabilities).await?;
        let mut in_sync = false;
        // Reports go only to a server that echoed the capability in its hello.
        let mut server_takes_reports = false;
        let mut report_seq = 1;
        while let Some(m) = stream.next().await {
            let m = m.map_err(|e| e.to_string())?;
            let seq = m.sequence_number;
            if let Some(To::ServerHello(h)) = &m.payload {
                server_takes_reports = h.capabilities.iter().any(|c| c == "applied");
            }
            match m.payload {
                Some(To::InSync(_)) => {
                    in_sync = true;
                    let _ = events.send(Event::InSync(i));
                }
                Some(To::ActivePolicyUpdate(u)) => {
                    let port = u
                        .policy
                        .as_ref()
                        .and_then(|p| p.inbound_rules.first())
                        .and_then(|r| r.dst_ports.first())
                        .map(|p| p.first);
                    if let Some(p) = port
                        && u.id
                            .as_ref()
                            .is_some_and(|id| id.name == "bench-sync-marker")
                    {
                        let _ = events.send(Event::Marker(p));
                    }
                }
                _ => {}
            }
            if report_applied && server_takes_reports && in_sync {
                report_seq += 1;
                tx.send(pb::FromDataplane {
                    sequence_number: report_seq,
                    payload: Some(pb::from_dataplane::Payload::DataplaneApplied(
                        pb::DataplaneApplied {
                            applied_sequence_number: seq,
                            received_sequence_number: seq,
                            ..Default::default()
                        },
                    )),
                })
                .await
                .map_err(|e| e.to_string())?;
            }
        }
        drop(tx);
        Ok::<(), String>(())
    };
    if let Err(e) = run.await {
        let _ = events.send(Event::Failed(i, e));
    }
}

/// Where the timed change is written.
enum Target {
    File(PathBuf),
    Etcd(Box<etcd_client::Client>),
}

const MARKER_KEY: &str =
    "/calico/resources/v3/projectcalico.org/globalnetworkpolicies/bench-sync-marker";

impl Target {
    async fn write(&mut self, port: i32) -> anyhow::Result<()> {
        match self {
            Target::File(p) => {
                std::fs::write(p, marker_policy(port)).context("writing the marker policy")
            }
            Target::Etcd(c) => {
                let v = serde_json::json!({
                    "kind": "GlobalNetworkPolicy", "apiVersion": "projectcalico.org/v3",
                    "metadata": {"name": "bench-sync-marker"},
                    "spec": {"order": 1, "selector": "all()", "types": ["Ingress"],
                             "ingress": [{"action": "Allow", "protocol": "TCP", "destination": {"ports": [port]}}]}
                });
                c.put(MARKER_KEY, v.to_string(), None)
                    .await
                    .context("etcd put")?;
                Ok(())
            }
        }
    }

    async fn remove(&mut self) {
        match self {
            Target::File(p) => {
                let _ = std::fs::remove_file(p);
            }
            Target::Etcd(c) => {
                let _ = c.delete(MARKER_KEY, None).await;
            }
        }
    }
}

pub(crate) fn marker_policy(port: i32) -> String {
    format!(
        "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata:\n  name: bench-sync-marker\nspec:\n  order: 1\n  selector: all()\n  types: [Ingress]\n  ingress:\n  - action: Allow\n    protocol: TCP\n    destination:\n      ports: [{port}]\n"
    )
}

pub fn run(args: &BenchSyncArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(bench(args.clone()))
}

async fn bench(args: BenchSyncArgs) -> anyhow::Result<ExitCode> {
    let mut target = match (&args.etcd_endpoint, &args.file_dir) {
        (Some(e), _) => Target::Etcd(Box::new(
            etcd_client::Client::connect([e.as_str()], None)
                .await
                .context("connecting to etcd")?,
        )),
        (None, Some(dir)) => Target::File(dir.join("zz-bench-sync-marker.yaml")),
        (None, None) => anyhow::bail!("--file-dir or --etcd-endpoint is required"),
    };
    target.write(1).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = rss_of(args.server_pid);

    let (etx, mut erx) = mpsc::unbounded_channel();
    let start = Instant::now();
    for i in 0..args.nodes {
        tokio::spawn(agent(
            i,
            args.server.clone(),
            format!("{}{i}", args.node_prefix),
            args.report_applied,
            etx.clone(),
        ));
    }
    let seen = Arc::new(Mutex::new(vec![false; args.nodes]));
    let mut in_sync = 0usize;
    let mut peak_during_sync = 0u64;
    while in_sync < args.nodes {
        match tokio::time::timeout(Duration::from_secs(120), erx.recv()).await {
            Ok(Some(Event::InSync(i))) => {
                let mut s = seen.lock().await;
                if !s[i] {
                    s[i] = true;
                    in_sync += 1;
                }
                if in_sync.is_multiple_of(100)
                    && let Some((rss, _)) = rss_of(args.server_pid)
                {
                    peak_during_sync = peak_during_sync.max(rss);
                }
            }
            Ok(Some(Event::Failed(i, e))) => anyhow::bail!("agent {i} failed: {e}"),
            Ok(Some(Event::Marker(_))) => {}
            Ok(None) | Err(_) => {
                anyhow::bail!("timed out with {in_sync} of {} agents in sync", args.nodes)
            }
        }
    }
    let all_in_sync = start.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let steady = rss_of(args.server_pid);

    let mut lat_all = Vec::new();
    let mut lat_each = Vec::new();
    let mut lat_realized = Vec::new();
    for c in 0..args.changes {
        let port = 1000 + c as i32;
        let t = Instant::now();
        target.write(port).await?;
        let mut got = 0usize;
        while got < args.nodes {
            match tokio::time::timeout(Duration::from_secs(30), erx.recv()).await {
                Ok(Some(Event::Marker(p))) if p == port => {
                    got += 1;
                    lat_each.push(t.elapsed());
                }
                Ok(Some(Event::Failed(i, e))) => anyhow::bail!("agent {i} failed: {e}"),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => {
                    anyhow::bail!("change {c}: only {got} of {} agents got it", args.nodes)
                }
            }
        }
        lat_all.push(t.elapsed());
        if let Some(admin) = &args.admin {
            wait_realized(admin, args.nodes).await?;
            lat_realized.push(t.elapsed());
        }
    }
    target.remove().await;
    lat_realized.sort();
    lat_all.sort();
    lat_each.sort();
    let pct = |v: &[Duration], p: f64| crate::graph_bench::percentile(v, p).as_secs_f64() * 1e3;
    println!("agents: {}", args.nodes);
    println!("time until all in sync: {:.2} s", all_in_sync.as_secs_f64());
    // The contract line scripts read (`make bench-sync`).
    println!(
        "sync {} agents: in sync {:.2} s, rss above idle {}",
        args.nodes,
        all_in_sync.as_secs_f64(),
        match (idle, steady) {
            (Some((i, _)), Some((s, _))) => format!("{:.1} MiB", mib(s.saturating_sub(i))),
            _ => "unknown (no --server-pid)".to_string(),
        }
    );
    if let (Some((idle_rss, _)), Some((steady_rss, hwm))) = (idle, steady) {
        println!(
            "server RSS: idle {:.1} MiB, with all agents in sync {:.1} MiB (+{:.1} MiB), peak during the initial sync {:.1} MiB (high-water {:.1} MiB)",
            mib(idle_rss),
            mib(steady_rss),
            mib(steady_rss.saturating_sub(idle_rss)),
            mib(peak_during_sync.max(steady_rss)),
            mib(hwm)
        );
    }
    println!(
        "one global change (datastore write → every agent has it; a file write includes the poll interval): p50 {:.1} ms, p99 {:.1} ms over {} changes; per agent p50 {:.1} ms, p99 {:.1} ms",
        pct(&lat_all, 0.5),
        pct(&lat_all, 0.99),
        lat_all.len(),
        pct(&lat_each, 0.5),
        pct(&lat_each, 0.99)
    );
    if !lat_realized.is_empty() {
        println!(
            "one global change until the server shows it Realized on all {} nodes (from the agents' applied reports): p50 {:.1} ms, p99 {:.1} ms",
            args.nodes,
            pct(&lat_realized, 0.5),
            pct(&lat_realized, 0.99)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Polls the admin endpoint until the marker policy is realized on `nodes` nodes.
async fn wait_realized(admin: &str, nodes: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let json = admin_get(admin, "/status/policies/bench-sync-marker").await?;
        let v: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
        let realized = v["realized"].as_u64().unwrap_or_default() as usize;
        if realized >= nodes {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the marker policy was not realized on {nodes} nodes within 30 s: {}",
            json.chars().take(400).collect::<String>()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The body of `GET <path>` from the server's admin endpoint (plain HTTP/1.0).
pub(crate) async fn admin_get(admin: &str, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(admin)
        .await
        .with_context(|| format!("connecting to the admin endpoint {admin}"))?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    s.read_to_string(&mut response).await?;
    Ok(response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_string()))
}
