//! `calc-bench churn`: datastore churn at increasing rates against a running
//! `calc-server serve` (file or etcd v3 datastore) with simulated agents.
//!
//! It adds its own objects to the server's datastore (file: under `churn/` in its directory;
//! etcd: in Calico's key layout): endpoints spread over the agents' nodes, policies whose rules
//! select them by a label, a marker policy. Then for each rate it writes label flips (nine in
//! ten) and policy edits for `--seconds`, while the marker policy is edited every 200 ms and
//! timed from the write until every agent has it. A rate is *held* when the writer kept it,
//! the marker's p99 stayed within `--p99-limit`, and the agents' queues did not grow (the
//! server's `calc_server_agent_lag_messages`, summed, at the end of the step is no larger than
//! a step's worth of marker edits). A rate the writer itself could not keep is said so: it
//! measures the writer, not the server. Measures; does not judge (docs/benchmarks.md).
//!
//! The last line per run is `churn <datastore>: held <n>/s, p99 <ms> ms` (the highest rate
//! held, the marker's p99 at that rate; `held 0/s` with the first rate's p99 when none held).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::mpsc;

use crate::bench_sync::{Event, admin_get, agent};
use crate::etcd_store;
use crate::graph_bench::percentile;

/// Which datastore the server runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Datastore {
    /// A manifest directory (`--file-dir`): each change is a file written aside and renamed.
    File,
    /// etcd v3 in Calico's layout (`--etcd-endpoint`): each change is one put.
    Etcd,
}

impl Datastore {
    fn label(self) -> &'static str {
        match self {
            Datastore::File => "file",
            Datastore::Etcd => "etcd",
        }
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct ChurnArgs {
    /// The server's gRPC URL.
    #[arg(long, env = "CHURN_SERVER", default_value = "http://127.0.0.1:50051")]
    pub server: String,
    /// The server's admin address (its queues are read from /metrics).
    #[arg(long, env = "CHURN_ADMIN", default_value = "127.0.0.1:9096")]
    pub admin: String,
    /// The server's datastore.
    #[arg(long, env = "CHURN_DATASTORE", value_enum, default_value_t = Datastore::File)]
    pub datastore: Datastore,
    /// File datastore: the server's directory; the churned objects are written under `churn/`.
    #[arg(long, env = "CHURN_FILE_DIR")]
    pub file_dir: Option<PathBuf>,
    /// etcd datastore: the endpoint the server watches (the churned objects are put there).
    #[arg(
        long,
        env = "CHURN_ETCD_ENDPOINT",
        default_value = "http://127.0.0.1:2379"
    )]
    pub etcd_endpoint: String,
    /// Writes in flight at most (file writes queued for the writer thread, etcd puts not yet
    /// acknowledged); a write that would exceed it waits for the next tick, so a writer that
    /// cannot keep the rate shows as such.
    #[arg(long, env = "CHURN_ETCD_IN_FLIGHT", default_value_t = 256)]
    pub etcd_in_flight: usize,
    /// Simulated agents, for nodes `<prefix><i>`, i in 0..nodes (nodes the cluster has).
    #[arg(long, env = "CHURN_NODES", default_value_t = 100)]
    pub nodes: usize,
    #[arg(long, env = "CHURN_NODE_PREFIX", default_value = "node-")]
    pub node_prefix: String,
    /// Updates per second to try, in order (label flips and policy edits, 9:1); the run stops
    /// at the first rate not held.
    #[arg(
        long,
        env = "CHURN_RATES",
        value_delimiter = ',',
        default_value = "1000,2500,5000,7500"
    )]
    pub rates: Vec<u32>,
    /// How long each rate is held, in seconds.
    #[arg(long, env = "CHURN_SECONDS", default_value_t = 20)]
    pub seconds: u64,
    /// Endpoints the churn flips (one file or key each).
    #[arg(long, env = "CHURN_ENDPOINTS", default_value_t = 1000)]
    pub endpoints: usize,
    /// Policies the churn edits (one file or key each); their rules select the flipped label.
    #[arg(long, env = "CHURN_POLICIES", default_value_t = 100)]
    pub policies: usize,
    /// A rate is held while the marker's p99 (datastore write → every agent) stays within this.
    #[arg(long, env = "CHURN_P99_LIMIT_MS", default_value_t = 100)]
    pub p99_limit_ms: u64,
    /// The server's process id: each rate's line then says the server's CPU time per 1,000
    /// updates (from /proc; comparable across runs on a machine other work also loads).
    #[arg(long, env = "CHURN_SERVER_PID")]
    pub server_pid: Option<u32>,
}

/// CPU seconds `pid` has used (user and system, /proc's clock ticks of 1/100 s).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: fields count from the last `)`.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the command.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

fn wep(i: usize, node: &str, side: char) -> String {
    format!(
        "apiVersion: projectcalico.org/v3\nkind: WorkloadEndpoint\nmetadata:\n  name: {}-k8s-churn--{i}-eth0\n  namespace: churn\n  labels: {{churn: '{side}', projectcalico.org/namespace: churn, projectcalico.org/orchestrator: k8s}}\nspec:\n  orchestrator: k8s\n  node: {node}\n  pod: churn-{i}\n  endpoint: eth0\n  interfaceName: calichurn{i}\n  ipNetworks: [10.{}.{}.{}/32]\n  profiles: [kns.churn]\n",
        node.replace('-', "--"),
        200 + i / 65536,
        (i / 256) % 256,
        i % 256
    )
}

fn policy(j: usize, port: u32) -> String {
    format!(
        "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata:\n  name: churn-{j}\nspec:\n  order: {}\n  selector: churn == 'a'\n  types: [Ingress]\n  ingress:\n  - action: Allow\n    protocol: TCP\n    source: {{selector: churn == 'b'}}\n    destination: {{ports: [{port}]}}\n",
        5000 + j
    )
}

const PROFILE: &str = "apiVersion: projectcalico.org/v3\nkind: Profile\nmetadata:\n  name: kns.churn\nspec:\n  ingress: [{action: Allow}]\n  egress: [{action: Allow}]\n";

/// [`wep`] as the etcd datastore stores it.
fn wep_json(i: usize, node: &str, side: char) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "projectcalico.org/v3", "kind": "WorkloadEndpoint",
        "metadata": {
            "name": format!("{}-k8s-churn--{i}-eth0", node.replace('-', "--")),
            "namespace": "churn",
            "labels": {"churn": side.to_string(), "projectcalico.org/namespace": "churn",
                       "projectcalico.org/orchestrator": "k8s"}
        },
        "spec": {
            "orchestrator": "k8s", "node": node, "pod": format!("churn-{i}"), "endpoint": "eth0",
            "interfaceName": format!("calichurn{i}"),
            "ipNetworks": [format!("10.{}.{}.{}/32", 200 + i / 65536, (i / 256) % 256, i % 256)],
            "profiles": ["kns.churn"]
        }
    })
}

/// [`policy`] as the etcd datastore stores it.
fn policy_json(j: usize, port: u32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
        "metadata": {"name": format!("churn-{j}")},
        "spec": {
            "order": 5000 + j, "selector": "churn == 'a'", "types": ["Ingress"],
            "ingress": [{"action": "Allow", "protocol": "TCP", "source": {"selector": "churn == 'b'"},
                         "destination": {"ports": [port]}}]
        }
    })
}

fn profile_json() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "projectcalico.org/v3", "kind": "Profile",
        "metadata": {"name": "kns.churn"},
        "spec": {"ingress": [{"action": "Allow"}], "egress": [{"action": "Allow"}]}
    })
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    // Written aside and renamed, so the watcher never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// One object the churn writes.
#[derive(Clone, Copy)]
enum Obj {
    Wep(usize, char),
    Policy(usize, u32),
    Profile,
    Marker(i32),
}

/// Where the churn writes: files written in order by a thread of their own (so that the
/// writes never hold back the agents' events the bench times), or etcd puts in flight on the
/// runtime; each counted when done (acknowledged).
enum Store {
    File {
        dir: PathBuf,
        tx: std::sync::mpsc::Sender<(PathBuf, String)>,
        in_flight: Arc<AtomicU64>,
        max_in_flight: u64,
        acked: Arc<AtomicU64>,
        failed: Arc<parking_lot::Mutex<Option<String>>>,
    },
    Etcd {
        client: Box<etcd_client::Client>,
        /// Keys computed once (Calico's layout, from the objects themselves).
        wep_keys: Vec<String>,
        policy_keys: Vec<String>,
        profile_key: String,
        in_flight: Arc<AtomicU64>,
        max_in_flight: u64,
        acked: Arc<AtomicU64>,
        failed: Arc<parking_lot::Mutex<Option<String>>>,
    },
}

impl Store {
    async fn open(args: &ChurnArgs, node: &dyn Fn(usize) -> String) -> anyhow::Result<Store> {
        Ok(match args.datastore {
            Datastore::File => {
                let dir = args
                    .file_dir
                    .as_ref()
                    .context("--file-dir is required with --datastore file")?
                    .join("churn");
                std::fs::create_dir_all(&dir).context("creating the churn directory")?;
                let (tx, rx) = std::sync::mpsc::channel::<(PathBuf, String)>();
                let (in_flight, acked) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
                let failed: Arc<parking_lot::Mutex<Option<String>>> = Arc::default();
                {
                    let (in_flight, acked, failed) =
                        (in_flight.clone(), acked.clone(), failed.clone());
                    std::thread::Builder::new()
                        .name("churn-writer".into())
                        .spawn(move || {
                            for (path, text) in rx {
                                match write(&path, &text) {
                                    Ok(()) => {
                                        acked.fetch_add(1, Ordering::Relaxed);
                                    }
                                    Err(e) => *failed.lock() = Some(format!("{e:#}")),
                                }
                                in_flight.fetch_sub(1, Ordering::Relaxed);
                            }
                        })
                        .context("starting the file writer")?;
                }
                Store::File {
                    dir,
                    tx,
                    in_flight,
                    max_in_flight: args.etcd_in_flight.max(1) as u64,
                    acked,
                    failed,
                }
            }
            Datastore::Etcd => {
                let client = etcd_client::Client::connect([args.etcd_endpoint.as_str()], None)
                    .await
                    .with_context(|| format!("connecting to etcd at {}", args.etcd_endpoint))?;
                let key = |v: &serde_json::Value| -> anyhow::Result<String> {
                    etcd_store::key_of(v)?.context("a kind Calico does not keep in etcd")
                };
                Store::Etcd {
                    wep_keys: (0..args.endpoints)
                        .map(|i| key(&wep_json(i, &node(i), 'a')))
                        .collect::<anyhow::Result<_>>()?,
                    policy_keys: (0..args.policies)
                        .map(|j| key(&policy_json(j, 1000)))
                        .collect::<anyhow::Result<_>>()?,
                    profile_key: key(&profile_json())?,
                    client: Box::new(client),
                    in_flight: Arc::default(),
                    max_in_flight: args.etcd_in_flight.max(1) as u64,
                    acked: Arc::default(),
                    failed: Arc::default(),
                }
            }
        })
    }

    /// Writes `obj` (its etcd put is started; `false` if too many are in flight).
    fn write(&self, obj: Obj, node: &dyn Fn(usize) -> String) -> anyhow::Result<bool> {
        match self {
            Store::File {
                dir,
                tx,
                in_flight,
                max_in_flight,
                failed,
                ..
            } => {
                if let Some(e) = failed.lock().take() {
                    anyhow::bail!("file write: {e}");
                }
                if in_flight.load(Ordering::Relaxed) >= *max_in_flight {
                    return Ok(false);
                }
                let (name, text) = match obj {
                    Obj::Wep(i, side) => (format!("wep-{i}.yaml"), wep(i, &node(i), side)),
                    Obj::Policy(j, port) => (format!("pol-{j}.yaml"), policy(j, port)),
                    Obj::Profile => ("profile.yaml".into(), PROFILE.to_string()),
                    Obj::Marker(port) => {
                        ("marker.yaml".into(), crate::bench_sync::marker_policy(port))
                    }
                };
                in_flight.fetch_add(1, Ordering::Relaxed);
                tx.send((dir.join(name), text))
                    .map_err(|_| anyhow::anyhow!("the file writer stopped"))?;
                Ok(true)
            }
            Store::Etcd {
                client,
                wep_keys,
                policy_keys,
                profile_key,
                in_flight,
                max_in_flight,
                acked,
                failed,
            } => {
                if let Some(e) = failed.lock().take() {
                    anyhow::bail!("etcd put: {e}");
                }
                if in_flight.load(Ordering::Relaxed) >= *max_in_flight {
                    return Ok(false);
                }
                let (key, value) = match obj {
                    Obj::Wep(i, side) => (wep_keys[i].clone(), wep_json(i, &node(i), side)),
                    Obj::Policy(j, port) => (policy_keys[j].clone(), policy_json(j, port)),
                    Obj::Profile => (profile_key.clone(), profile_json()),
                    Obj::Marker(port) => (
                        crate::bench_sync::MARKER_KEY.to_string(),
                        crate::bench_sync::marker_value(port),
                    ),
                };
                let mut client = client.clone();
                let (in_flight, acked, failed) = (in_flight.clone(), acked.clone(), failed.clone());
                in_flight.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    match client.put(key, value.to_string(), None).await {
                        Ok(_) => {
                            acked.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => *failed.lock() = Some(e.to_string()),
                    }
                    in_flight.fetch_sub(1, Ordering::Relaxed);
                });
                Ok(true)
            }
        }
    }

    /// Waits until every put started has been acknowledged (or 30 s).
    async fn settle(&self) -> anyhow::Result<()> {
        let (Store::Etcd {
            in_flight, failed, ..
        }
        | Store::File {
            in_flight, failed, ..
        }) = self;
        {
            let until = Instant::now() + Duration::from_secs(30);
            while in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if let Some(e) = failed.lock().take() {
                anyhow::bail!("write: {e}");
            }
        }
        Ok(())
    }

    /// Writes done (files written, puts acknowledged) so far.
    fn acked(&self) -> u64 {
        let (Store::File { acked, .. } | Store::Etcd { acked, .. }) = self;
        acked.load(Ordering::Relaxed)
    }

    /// Removes the churn's objects.
    async fn clean(&self) {
        match self {
            Store::File { dir, .. } => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Store::Etcd {
                client,
                wep_keys,
                policy_keys,
                profile_key,
                ..
            } => {
                let mut c = client.clone();
                for k in wep_keys
                    .iter()
                    .chain(policy_keys)
                    .chain([profile_key, &crate::bench_sync::MARKER_KEY.to_string()])
                {
                    let _ = c.delete(k.as_str(), None).await;
                }
            }
        }
    }
}

/// The sum of the agents' queue lengths, from the server's /metrics.
async fn lag(admin: &str) -> anyhow::Result<u64> {
    Ok(admin_get(admin, "/metrics")
        .await?
        .lines()
        .filter(|l| l.starts_with("calc_server_agent_lag_messages{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

/// Milliseconds at percentile `p` of `v` (sorted here).
fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    percentile(v, p).as_secs_f64() * 1e3
}

pub fn run(args: &ChurnArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(churn(args.clone()))
}

async fn churn(args: ChurnArgs) -> anyhow::Result<ExitCode> {
    let label = args.datastore.label();
    let nodes = args.nodes.max(1);
    let prefix = args.node_prefix.clone();
    let node = move |i: usize| format!("{prefix}{}", i % nodes);
    let store = Store::open(&args, &node).await?;
    store.write(Obj::Profile, &node)?;
    for i in 0..args.endpoints {
        while !store.write(Obj::Wep(i, 'a'), &node)? {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    for j in 0..args.policies {
        while !store.write(Obj::Policy(j, 1000), &node)? {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let mut marker_port: i32 = 1;
    store.write(Obj::Marker(marker_port), &node)?;
    store.settle().await?;

    let (etx, mut erx) = mpsc::unbounded_channel();
    for i in 0..args.nodes {
        tokio::spawn(agent(
            i,
            args.server.clone(),
            node(i),
            true,
            None,
            etx.clone(),
        ));
    }
    // Everyone in sync with the churn objects in place.
    let mut in_sync = 0;
    while in_sync < args.nodes {
        match tokio::time::timeout(Duration::from_secs(120), erx.recv()).await {
            Ok(Some(Event::InSync(_))) => in_sync += 1,
            Ok(Some(_)) => {}
            _ => anyhow::bail!("only {in_sync} of {} agents in sync", args.nodes),
        }
    }
    println!(
        "churn {label}: {} agents, {} churned endpoints, {} churned policies, {} s per rate",
        args.nodes, args.endpoints, args.policies, args.seconds
    );

    // (rate, p99) of the highest rate held, and the first rate's p99.
    let mut held_best: Option<(u32, f64)> = None;
    let mut first_p99 = None;
    let mut flip_side = vec!['a'; args.endpoints];
    let (mut next_wep, mut next_pol, mut edits) = (0usize, 0usize, 0u64);
    for &rate in &args.rates {
        let lag_start = lag(&args.admin).await?;
        let start = Instant::now();
        let end = start + Duration::from_secs(args.seconds);
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut written = 0u64;
        let acked_start = store.acked();
        let cpu_start = args.server_pid.and_then(cpu_seconds);
        let mut latencies = Vec::new();
        // The marker edit being timed: (port, when written, agents that have it).
        let mut timing: Option<(i32, Instant, usize)> = None;
        let mut last_marker = start;
        while Instant::now() < end {
            tokio::select! {
                _ = tick.tick() => {
                    // Catch up to the rate for the time elapsed.
                    let due = (start.elapsed().as_secs_f64() * f64::from(rate)) as u64;
                    while written < due {
                        let obj = if (edits + 1) % 10 == 0 && args.policies > 0 {
                            Obj::Policy(next_pol % args.policies, 1000 + ((edits + 1) % 50_000) as u32)
                        } else if args.endpoints > 0 {
                            let i = next_wep % args.endpoints;
                            Obj::Wep(i, if flip_side[i] == 'a' { 'b' } else { 'a' })
                        } else {
                            break;
                        };
                        if !store.write(obj, &node)? {
                            break; // Too many puts in flight: the writer falls behind.
                        }
                        edits += 1;
                        match obj {
                            Obj::Policy(..) => next_pol += 1,
                            Obj::Wep(i, side) => {
                                flip_side[i] = side;
                                next_wep += 1;
                            }
                            _ => {}
                        }
                        written += 1;
                    }
                    if timing.is_none() && last_marker.elapsed() >= Duration::from_millis(200) {
                        marker_port += 1;
                        last_marker = Instant::now();
                        while !store.write(Obj::Marker(marker_port), &node)? {
                            tokio::task::yield_now().await;
                        }
                        timing = Some((marker_port, last_marker, 0));
                    }
                }
                e = erx.recv() => match e {
                    Some(Event::Marker(p)) => {
                        if let Some((port, at, got)) = &mut timing
                            && *port == p
                        {
                            *got += 1;
                            if *got == args.nodes {
                                latencies.push(at.elapsed());
                                timing = None;
                            }
                        }
                    }
                    Some(_) => {}
                    None => anyhow::bail!("every agent is gone"),
                },
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        // Markers are acknowledged too: the count of updates excludes them.
        let markers = latencies.len() as u64 + u64::from(timing.is_some());
        let acked = store
            .acked()
            .saturating_sub(acked_start)
            .saturating_sub(markers);
        let cpu = args
            .server_pid
            .and_then(cpu_seconds)
            .zip(cpu_start)
            .map(|(end, start)| end - start);
        let lag_end = lag(&args.admin).await?;
        let unfinished = timing.is_some_and(|(_, at, _)| at.elapsed() > Duration::from_secs(1));
        let achieved = acked.min(written) as f64 / elapsed;
        let (p50, p99) = (pct(&mut latencies, 0.5), pct(&mut latencies, 0.99));
        first_p99.get_or_insert(p99);
        // A step's worth of marker edits may be queued at any moment; more means growth.
        let backlog_grew = lag_end > lag_start + (args.nodes as u64) * 10;
        let writer_kept = achieved >= 0.95 * f64::from(rate);
        // No marker edit timed at all is not a rate held.
        let held = !latencies.is_empty()
            && writer_kept
            && p99 <= args.p99_limit_ms as f64
            && !backlog_grew
            && !unfinished;
        println!(
            "churn {label} {rate}/s: wrote {achieved:.0}/s, marker (write → every agent) p50 {p50:.1} ms, p99 {p99:.1} ms over {} edits, agents' queues {lag_start} → {lag_end} messages: {}",
            latencies.len(),
            if held { "held" } else { "not held" }
        );
        if let Some(cpu) = cpu {
            println!(
                "churn {label} {rate}/s: server CPU {:.0} ms per 1,000 updates ({:.2} cores)",
                cpu * 1e3 / (acked.max(1) as f64 / 1e3),
                cpu / elapsed
            );
        }
        if !writer_kept {
            println!(
                "churn {label} {rate}/s: the writer itself did not keep the rate ({achieved:.0}/s written): this step measures the writer, not the server"
            );
        }
        if held {
            held_best = Some((rate, p99));
        } else {
            break;
        }
        // The next rate starts from a quiet server.
        store.settle().await?;
    }
    match held_best {
        Some((r, p99)) => println!("churn {label}: held {r}/s, p99 {p99:.1} ms"),
        None => println!(
            "churn {label}: held 0/s, p99 {:.1} ms",
            first_p99.unwrap_or(f64::NAN)
        ),
    }
    store.clean().await;
    Ok(ExitCode::SUCCESS)
}
