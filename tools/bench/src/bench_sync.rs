//! `calc-bench bench-sync`: simulated agents against a running `calc-server serve`.
//!
//! Opens one Sync stream per node (all at once), measures the time until every stream has
//! received InSync, then edits the datastore (a global policy every node runs) and measures how
//! long the change takes to reach each agent. Reads the server's resident memory from /proc
//! when given its pid. Measures; does not judge (docs/benchmarks.md).
//!
//! With `--stats-period`, the agents also offer the `stats` capability and, once the changes
//! are timed, send every period a `RuleStats` report with small random deltas for the rules
//! of the policies and profiles their stream was sent (up to `--stats-max-hits`). The server's
//! CPU time (`/proc/<pid>/stat`) is read over an idle window and over `--stats-seconds` of
//! reporting; the bench fails unless the server accepted every report and refused nothing.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use felix_proto as pb;
use pb::to_dataplane::Payload as To;
use tokio::sync::{Mutex, mpsc};

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
    /// Measure rule stats reporting: agents offer `stats` and, after the changes, each sends a
    /// `RuleStats` report this often (a real agent's default is 10s). Needs --admin and
    /// --server-pid. Off when not given.
    #[arg(long, env = "BENCH_SYNC_STATS_PERIOD", value_parser = common::duration::parse_duration)]
    pub stats_period: Option<Duration>,
    /// How long the server's CPU time is measured while the agents report (after one period
    /// of warm-up); the same time capped at 10 s is measured before, with no reports.
    #[arg(long, env = "BENCH_SYNC_STATS_SECONDS", default_value_t = 20)]
    pub stats_seconds: u64,
    /// Most hits per report: each agent reports every rule it was sent, up to this many.
    #[arg(long, env = "BENCH_SYNC_STATS_MAX_HITS", default_value_t = 4096)]
    pub stats_max_hits: usize,
    /// Add the change p99 to the contract line (`…, change p99 <ms> ms`), as the 5,000-agent
    /// run prints it.
    #[arg(long, env = "BENCH_SYNC_CONTRACT_CHANGE_P99")]
    pub contract_change_p99: bool,
    /// Fail-over mode: the gRPC addresses (`host:port`, comma-separated) of calc-server
    /// replicas serving the same datastore. The agents connect through a TCP forwarder in this
    /// process (one address, each new connection to the next replica that accepts it, as a
    /// Service does); once all are in sync the first replica is killed (SIGKILL) and the time
    /// until its agents are in sync on the others, and how many agents' programmed state
    /// changed, are measured. Needs --failover-pids; --server is not used.
    #[arg(long, env = "BENCH_SYNC_FAILOVER_REPLICAS", value_delimiter = ',')]
    pub failover_replicas: Vec<String>,
    /// The replicas' process ids, in the order of --failover-replicas.
    #[arg(long, env = "BENCH_SYNC_FAILOVER_PIDS", value_delimiter = ',')]
    pub failover_pids: Vec<u32>,
    /// The replicas' admin addresses: each must have loaded the cluster before agents connect.
    #[arg(long, env = "BENCH_SYNC_FAILOVER_ADMINS", value_delimiter = ',')]
    pub failover_admins: Vec<String>,
}

/// The stats phase, shared by the coordinator and the simulated agents.
pub(crate) struct StatsPlan {
    pub(crate) period: Duration,
    pub(crate) max_hits: usize,
    /// Agents report while this is set.
    pub(crate) on: AtomicBool,
    /// Reports and hits sent so far, by all agents.
    pub(crate) reports: AtomicU64,
    pub(crate) hits: AtomicU64,
}

/// A policy `(kind, namespace, name)` or a profile `("", "", name)` the stream sent, with
/// its inbound and outbound rule counts.
pub(crate) type SentRules = HashMap<(String, String, String), (u32, u32)>;

/// A `RuleStats` with a small random delta for each sent rule, up to `max` hits.
pub(crate) fn rule_stats(sent: &SentRules, max: usize, rng: &mut u64) -> pb::RuleStats {
    let mut hits = Vec::new();
    'all: for ((kind, namespace, name), &(inbound, outbound)) in sent {
        for (egress, n) in [(false, inbound), (true, outbound)] {
            for index in 0..n {
                if hits.len() == max {
                    break 'all;
                }
                let (policy, profile, k) = if kind.is_empty() {
                    let p = pb::ProfileId { name: name.clone() };
                    (None, Some(p), pb::rule_ref::Kind::ProfileRule)
                } else {
                    let p = pb::PolicyId {
                        kind: kind.clone(),
                        namespace: namespace.clone(),
                        name: name.clone(),
                    };
                    (Some(p), None, pb::rule_ref::Kind::PolicyRule)
                };
                let packets = 1 + next(rng) % 100;
                hits.push(pb::RuleHits {
                    rule: Some(pb::RuleRef {
                        kind: k as i32,
                        policy,
                        profile,
                        egress,
                        index,
                        ..Default::default()
                    }),
                    packets,
                    bytes: packets * (64 + next(rng) % 1400),
                });
            }
        }
    }
    pb::RuleStats { hits }
}

/// xorshift64: enough randomness for deltas and phases, no dependency.
pub(crate) fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// The server's CPU time (user + system, all threads) from `/proc/<pid>/stat`, in seconds.
pub(crate) fn cpu_of(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command's closing parenthesis start at field 3; utime and stime are
    // fields 14 and 15, in clock ticks (USER_HZ, 100 on Linux).
    let f: Vec<&str> = stat
        .rsplit_once(')')
        .context("/proc/<pid>/stat")?
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    Ok(ticks as f64 / 100.0)
}

/// The sum of a metric's series (all labels) in the server's `/metrics`.
async fn metric(admin: &str, name: &str) -> anyhow::Result<f64> {
    let text = admin_get(admin, "/metrics").await?;
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    anyhow::ensure!(!values.is_empty(), "the server's /metrics has no {name}");
    Ok(values.iter().sum())
}

pub(crate) fn rss_of(pid: Option<u32>) -> Option<(u64, u64)> {
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

/// A stream's end reason without what differs per agent (node names, numbers).
pub(crate) fn reason_class(why: &str) -> String {
    let cut = why.find(['"', '(']).unwrap_or(why.len()).min(80);
    why[..cut]
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect::<String>()
        .trim()
        .to_string()
}

pub(crate) fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// What each simulated agent reports to the coordinator.
pub(crate) enum Event {
    InSync(usize),
    /// An agent saw the marker policy with this port.
    Marker(i32),
    /// An agent's stream ended (why); it reconnects with back-off.
    Disconnected(usize, String),
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

/// A simulated agent for `node` against the server at `url` (`http://host:port`): see
/// [`crate::sync_agent`]. Runs until the receiver of `events` is dropped.
pub(crate) async fn agent(
    i: usize,
    url: String,
    node: String,
    report_applied: bool,
    stats: Option<Arc<StatsPlan>>,
    events: mpsc::UnboundedSender<Event>,
) {
    let setup = crate::sync_agent::AgentSetup {
        addr: url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string(),
        report_applied,
        stats,
        digests: None,
    };
    crate::sync_agent::run(i, node, setup, events).await
}

/// Keeps `sent` to the policies and profiles (and their rule counts) the stream holds; staged
/// policies are left out (never programmed, so they decide nothing).
pub(crate) fn track_rules(sent: &mut SentRules, payload: &Option<To>) {
    let policy_key = |id: &Option<pb::PolicyId>| {
        let id = id.clone().unwrap_or_default();
        (id.kind, id.namespace, id.name)
    };
    let profile_key = |id: &Option<pb::ProfileId>| {
        let name = id.as_ref().map_or(String::new(), |p| p.name.clone());
        (String::new(), String::new(), name)
    };
    match payload {
        Some(To::ActivePolicyUpdate(u)) => {
            let key = policy_key(&u.id);
            let rules = u.policy.as_ref().map_or((0, 0), |p| {
                (p.inbound_rules.len() as u32, p.outbound_rules.len() as u32)
            });
            if !key.0.starts_with("Staged") {
                sent.insert(key, rules);
            }
        }
        Some(To::ActivePolicyRemove(r)) => {
            sent.remove(&policy_key(&r.id));
        }
        Some(To::ActiveProfileUpdate(u)) => {
            let rules = u.profile.as_ref().map_or((0, 0), |p| {
                (p.inbound_rules.len() as u32, p.outbound_rules.len() as u32)
            });
            sent.insert(profile_key(&u.id), rules);
        }
        Some(To::ActiveProfileRemove(r)) => {
            sent.remove(&profile_key(&r.id));
        }
        _ => {}
    }
}

/// Where the timed change is written.
enum Target {
    File(PathBuf),
    Etcd(Box<etcd_client::Client>),
}

pub(crate) const MARKER_KEY: &str =
    "/calico/resources/v3/projectcalico.org/globalnetworkpolicies/bench-sync-marker";

impl Target {
    async fn write(&mut self, port: i32) -> anyhow::Result<()> {
        match self {
            Target::File(p) => {
                // Written beside and renamed over, so the server's poller never reads a
                // half-written (or empty) file.
                let tmp = p.with_extension("tmp");
                std::fs::write(&tmp, marker_policy(port)).context("writing the marker policy")?;
                std::fs::rename(&tmp, p).context("renaming the marker policy into place")
            }
            Target::Etcd(c) => {
                c.put(MARKER_KEY, marker_value(port).to_string(), None)
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

/// The marker policy as the etcd datastore stores it ([`marker_policy`] as JSON).
pub(crate) fn marker_value(port: i32) -> serde_json::Value {
    serde_json::json!({
        "kind": "GlobalNetworkPolicy", "apiVersion": "projectcalico.org/v3",
        "metadata": {"name": "bench-sync-marker"},
        "spec": {"order": 1, "selector": "all()", "types": ["Ingress"],
                 "ingress": [{"action": "Allow", "protocol": "TCP", "destination": {"ports": [port]}}]}
    })
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

/// This process's CPU time (user + system), in seconds.
fn own_cpu() -> f64 {
    cpu_of(std::process::id()).unwrap_or(0.0)
}

async fn bench(args: BenchSyncArgs) -> anyhow::Result<ExitCode> {
    if !args.failover_replicas.is_empty() {
        return crate::sync_failover::run(&args).await;
    }
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
    // Idle means the cluster loaded and the marker in: on a loaded machine the server may still
    // be reading the datastore when its admin endpoint answers.
    if let Some(admin) = &args.admin {
        wait_for_marker(admin).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = rss_of(args.server_pid);

    let plan = args.stats_period.map(|period| {
        Arc::new(StatsPlan {
            period,
            max_hits: args.stats_max_hits,
            on: AtomicBool::new(false),
            reports: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        })
    });
    let (etx, mut erx) = mpsc::unbounded_channel();
    let server_cpu0 = args.server_pid.and_then(|p| cpu_of(p).ok());
    let own_cpu0 = own_cpu();
    let start = Instant::now();
    for i in 0..args.nodes {
        tokio::spawn(agent(
            i,
            args.server.clone(),
            format!("{}{i}", args.node_prefix),
            args.report_applied,
            plan.clone(),
            etx.clone(),
        ));
    }
    drop(etx);
    let seen = Arc::new(Mutex::new(vec![false; args.nodes]));
    let mut in_sync = 0usize;
    let mut peak_during_sync = 0u64;
    // Agents whose stream ended and who reconnected, and the streams that ended.
    let mut reconnected = std::collections::BTreeSet::new();
    let mut reconnects = 0usize;
    let mut reasons: HashMap<String, usize> = HashMap::new();
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
            Ok(Some(Event::Disconnected(i, why))) => {
                reconnected.insert(i);
                reconnects += 1;
                *reasons.entry(reason_class(&why)).or_default() += 1;
            }
            Ok(Some(Event::Marker(_))) => {}
            Ok(None) | Err(_) => {
                anyhow::bail!("timed out with {in_sync} of {} agents in sync", args.nodes)
            }
        }
    }
    let all_in_sync = start.elapsed();
    let server_cpu = server_cpu0
        .zip(args.server_pid.and_then(|p| cpu_of(p).ok()))
        .map(|(a, b)| b - a);
    let own_cpu_sync = own_cpu() - own_cpu0;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let steady = rss_of(args.server_pid);

    let mut lat_all = Vec::new();
    let mut lat_each = Vec::new();
    let mut lat_realized = Vec::new();
    let mut reconnects_later = 0usize;
    let mut reconnected_later = std::collections::BTreeSet::new();
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
                Ok(Some(Event::Disconnected(i, why))) => {
                    reconnects_later += 1;
                    reconnected_later.insert(i);
                    *reasons.entry(reason_class(&why)).or_default() += 1;
                }
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
        "sync {} agents: in sync {:.2} s, rss above idle {}{}",
        args.nodes,
        all_in_sync.as_secs_f64(),
        match (idle, steady) {
            (Some((i, _)), Some((s, _))) => format!("{:.1} MiB", mib(s.saturating_sub(i))),
            _ => "unknown (no --server-pid)".to_string(),
        },
        if args.contract_change_p99 {
            format!(", change p99 {:.1} ms", pct(&lat_all, 0.99))
        } else {
            String::new()
        }
    );
    let mut reasons: Vec<_> = reasons.into_iter().collect();
    reasons.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    println!(
        "reconnects: {} of {} agents reconnected before all were in sync ({reconnects} streams ended), {} during the changes ({reconnects_later} streams){}",
        reconnected.len(),
        args.nodes,
        reconnected_later.len(),
        if reasons.is_empty() {
            String::new()
        } else {
            format!(
                "; why: {}",
                reasons
                    .iter()
                    .map(|(r, n)| format!("{n} {r}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    if let Some(cpu) = server_cpu {
        println!(
            "CPU during the initial sync: server {cpu:.2} s ({:.0} % of one core), simulated agents {own_cpu_sync:.2} s",
            cpu / all_in_sync.as_secs_f64() * 100.0
        );
    }
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
    if let Some(plan) = plan {
        stats_phase(&args, &plan).await?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Measures the server while every agent reports rule stats each period.
async fn stats_phase(args: &BenchSyncArgs, plan: &StatsPlan) -> anyhow::Result<()> {
    let (Some(admin), Some(pid)) = (args.admin.as_deref(), args.server_pid) else {
        anyhow::bail!("--stats-period needs --admin and --server-pid");
    };
    const REPORTS: &str = "calc_server_rule_stats_reports_total";
    const REFUSED: &str = "calc_server_rule_stats_refused_total";
    // Let the marker policy's removal reach every agent before anyone reports.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (reports0, refused0) = (metric(admin, REPORTS).await?, metric(admin, REFUSED).await?);
    let window = Duration::from_secs(args.stats_seconds);

    // The server with every agent in sync and nothing reported.
    let idle_wall = window.min(Duration::from_secs(10));
    let (c0, t0) = (cpu_of(pid)?, Instant::now());
    tokio::time::sleep(idle_wall).await;
    let idle_cpu = (cpu_of(pid)? - c0) / t0.elapsed().as_secs_f64();
    let rss_in_sync = rss_of(Some(pid)).map_or(0, |r| r.0);

    plan.on.store(true, Ordering::Relaxed);
    // One period of warm-up: every agent's first report creates the server's entries.
    tokio::time::sleep(plan.period).await;
    let snap = || {
        (
            cpu_of(pid),
            Instant::now(),
            plan.reports.load(Ordering::Relaxed),
            plan.hits.load(Ordering::Relaxed),
        )
    };
    let (c0, t0, r0, h0) = snap();
    tokio::time::sleep(window).await;
    let (c1, t1, r1, h1) = snap();
    plan.on.store(false, Ordering::Relaxed);
    let wall = (t1 - t0).as_secs_f64();
    let cpu = c1? - c0?;
    let (reports, hits) = ((r1 - r0) as f64, (h1 - h0) as f64);

    // Every report sent must be accepted, and no hit refused.
    let sent = plan.reports.load(Ordering::Relaxed) as f64;
    let deadline = Instant::now() + Duration::from_secs(15);
    let accepted = loop {
        let accepted = metric(admin, REPORTS).await? - reports0;
        if accepted >= sent || Instant::now() > deadline {
            break accepted;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let refused = metric(admin, REFUSED).await? - refused0;
    anyhow::ensure!(
        accepted == sent && refused == 0.0,
        "the server accepted {accepted} of {sent} reports and refused {refused} (hits or reports; {REFUSED})"
    );
    // Let the engine apply what it received before reading its memory and entries.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = rss_of(Some(pid)).map_or(0, |r| r.0);
    let entries = metric(admin, "calc_server_rule_stats_entries").await?;

    let period = plan.period.as_secs_f64();
    let busy = cpu / wall;
    println!(
        "rule stats: {} agents, one report each every {period} s, {:.0} hits per report, {} reports ({} hits) over {wall:.1} s after {period} s of warm-up, {sent} reports in all accepted, none refused",
        args.nodes,
        hits / reports.max(1.0),
        reports,
        hits,
    );
    println!(
        "server CPU: idle with all agents in sync {:.1} % of a core, while reporting {:.1} % ({:.1}x idle); above idle {:.0} µs per report, {:.0} ns per hit",
        idle_cpu * 100.0,
        busy * 100.0,
        busy / idle_cpu.max(1e-9),
        (busy - idle_cpu) * wall / reports.max(1.0) * 1e6,
        (busy - idle_cpu) * wall / hits.max(1.0) * 1e9,
    );
    println!(
        "scaled to one report every 10 s: {:.0} reports/s, {:.1} % of a core ({:.1} % above idle)",
        reports / wall * period / 10.0,
        (idle_cpu + (busy - idle_cpu) * period / 10.0) * 100.0,
        (busy - idle_cpu) * period / 10.0 * 100.0
    );
    println!(
        "server RSS: all agents in sync, before any report {:.1} MiB; after reporting {:.1} MiB",
        mib(rss_in_sync),
        mib(rss_after)
    );
    // The contract line scripts read (`make bench-stats`).
    println!(
        "stats {} agents: reports {:.0} /s, cpu {:.1} % of a core ({:.0} µs/report, {:.0} ns/hit), rss above in-sync {:.1} MiB, entries {entries}",
        args.nodes,
        reports / wall,
        busy * 100.0,
        cpu / reports.max(1.0) * 1e6,
        cpu / hits.max(1.0) * 1e9,
        (rss_after as f64 - rss_in_sync as f64) / (1024.0 * 1024.0),
    );
    Ok(())
}

/// Polls the admin endpoint until the server knows the marker policy (so it has read the
/// cluster), for at most 120 s.
pub(crate) async fn wait_for_marker(admin: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        // Before the datastore is loaded, and while the policy is unknown, the answer is an
        // `error` object.
        let marker = admin_get(admin, "/status/policies/bench-sync-marker")
            .await
            .unwrap_or_default();
        let known = serde_json::from_str::<serde_json::Value>(&marker)
            .is_ok_and(|v| v.is_object() && v.get("error").is_none());
        if known {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the server did not load the cluster and the marker policy within 120 s: {}",
            marker.chars().take(200).collect::<String>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
