//! `calc-bench flip-kernel`: an endpoint's label flipped in the datastore, timed until its
//! address is in (or out of) the kernel IP set on another node (docs/benchmarks.md).
//!
//! Needs root. The run creates a fresh network namespace and re-executes itself inside it
//! (hidden flag `--inside`), where it starts a private etcd (or uses a manifest directory),
//! `calc-server serve` and `dataplane-agent --driver linux` for `node-a`, all on the
//! namespace's loopback. The cluster: a policy on `node-a` whose rule's source selector
//! (`app == 'client'`) is an IP set; `--endpoints` clients and one flipped endpoint on
//! `node-b`; and `node-c`, which runs the same policy and whose agent is simulated in this
//! process (a probe: when the server's IP set delta arrives over gRPC). Each flip writes the
//! endpoint with `app` changed and polls the kernel (netlink `IPSET_CMD_TEST` from inside the
//! namespace) until the member is in or out. The agent's and the server's JSON logs give the
//! breakdown. The namespace, every process in it and the run's files are removed at the end,
//! on error and on SIGINT/SIGTERM too. Measures; never fails on time.

use std::io::BufRead as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use felix_proto as pb;
use pb::to_dataplane::Payload as To;
use serde_json::{Value, json};
use tokio_stream::StreamExt as _;

use crate::graph_bench::percentile;
use crate::ipset_netlink::IpsetTester;

/// The datastore the server watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Store {
    /// A private etcd v3 started in the namespace; each flip is a put (the server's watch
    /// pushes it).
    Etcdv3,
    /// A manifest directory; each flip rewrites one file (the server polls every
    /// --file-poll-interval).
    File,
}

impl Store {
    fn name(self) -> &'static str {
        match self {
            Store::Etcdv3 => "etcdv3",
            Store::File => "file",
        }
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct FlipKernelArgs {
    /// Where the cluster lives: `etcdv3` (a private etcd in the namespace) or `file` (a
    /// manifest directory the server polls).
    #[arg(
        long,
        env = "FLIP_KERNEL_DATASTORE_TYPE",
        value_enum,
        default_value = "etcdv3"
    )]
    pub datastore_type: Store,
    /// Flips to time, alternately out of and into the set.
    #[arg(long, env = "FLIP_KERNEL_FLIPS", default_value_t = 200)]
    pub flips: usize,
    /// Flips made first and not counted.
    #[arg(long, env = "FLIP_KERNEL_WARMUP", default_value_t = 10)]
    pub warmup: usize,
    /// Pause after a flip is seen in the kernel before the next one, plus a random jitter of
    /// up to as much again: flips never overlap and do not beat with periodic work.
    #[arg(long, env = "FLIP_KERNEL_SPACING", default_value = "50ms", value_parser = common::parse_duration)]
    pub spacing: Duration,
    /// Pause between two kernel polls, in microseconds (0: back to back, one core busy).
    #[arg(long, env = "FLIP_KERNEL_POLL_INTERVAL_US", default_value_t = 200)]
    pub poll_interval_us: u64,
    /// File datastore: the server's --file-poll-interval.
    #[arg(long, env = "FLIP_KERNEL_FILE_POLL_INTERVAL", default_value = "10ms", value_parser = common::parse_duration)]
    pub file_poll_interval: Duration,
    /// Other endpoints in the flipped endpoint's IP set (on node-b, like it).
    #[arg(long, env = "FLIP_KERNEL_ENDPOINTS", default_value_t = 100)]
    pub endpoints: usize,
    /// Directory holding `calc-server` and `dataplane-agent` (default: calc-bench's own).
    #[arg(long, env = "FLIP_KERNEL_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// The etcd server binary (a name is looked up on PATH).
    #[arg(long, env = "FLIP_KERNEL_ETCD", default_value = "etcd")]
    pub etcd: PathBuf,
    /// Parent of the run's directory (etcd's data, manifests, logs; removed at the end).
    /// The default is memory (tmpfs), so that etcd's fsync does not time this machine's disk.
    #[arg(long, env = "FLIP_KERNEL_WORK_DIR", default_value = "/dev/shm")]
    pub work_dir: PathBuf,
    /// Copy the run's logs here at the end (etcd.log; server.log and agent.log, JSON lines).
    #[arg(long, env = "FLIP_KERNEL_LOGS_DIR")]
    pub logs_dir: Option<PathBuf>,
    /// Set by the run when it re-executes itself inside its namespace: the run's directory.
    #[arg(long, hide = true)]
    pub inside: Option<PathBuf>,
}

// Ports on the fresh namespace's own loopback (nothing else listens there).
const ETCD_URL: &str = "http://127.0.0.1:52379";
const ETCD_PEER_URL: &str = "http://127.0.0.1:52380";
const GRPC: &str = "127.0.0.1:52051";
const SERVER_ADMIN: &str = "127.0.0.1:52096";
const NS: &str = "flip";
const FLIP_IP: Ipv4Addr = Ipv4Addr::new(10, 67, 0, 1);
/// node-a's endpoint: its interface is created in the namespace (a veth pair).
const LOCAL_IFACE: &str = "califlipsrv0";
const LOCAL_PEER: &str = "flippeer0";
const FLIP_TIMEOUT: Duration = Duration::from_secs(10);

pub fn run(args: &FlipKernelArgs) -> anyhow::Result<ExitCode> {
    match &args.inside {
        Some(dir) => {
            let result = measure(args, dir);
            if result.is_err() {
                print_log_tails(dir);
            }
            result
        }
        None => outside(args),
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    })
}

fn bin_dir(args: &FlipKernelArgs) -> anyhow::Result<PathBuf> {
    let dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("calc-bench's directory")?
            .to_path_buf(),
    };
    for bin in ["calc-server", "dataplane-agent"] {
        ensure!(
            dir.join(bin).is_file(),
            "{} not found (build it: cargo build --release -p calc-server -p dataplane-agent, or set --bin-dir)",
            dir.join(bin).display()
        );
    }
    Ok(dir)
}

/// Runs a command; its stdout, or an error with its stderr.
fn cmd(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The namespace, whatever still runs in it, and the run's directory: removed on drop.
struct Cleanup {
    ns: String,
    run_dir: PathBuf,
    netns: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.netns {
            // The run's etcd, server and agent, if the run inside could not stop them.
            if let Ok(out) = Command::new("ip")
                .args(["netns", "pids", &self.ns])
                .output()
            {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill")
                        .args(["-KILL", pid])
                        .stderr(Stdio::null())
                        .status();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        }
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

/// Creates the namespace, runs this command again inside it, and cleans up.
fn outside(args: &FlipKernelArgs) -> anyhow::Result<ExitCode> {
    ensure!(
        is_root(),
        "flip-kernel needs root (network namespaces, iptables, ipset)"
    );
    bin_dir(args)?;
    if args.datastore_type == Store::Etcdv3 {
        Command::new(&args.etcd)
            .arg("--version")
            .output()
            .with_context(|| {
                format!(
                    "running {} (etcd from Debian's etcd-server; make deps installs it)",
                    args.etcd.display()
                )
            })?;
    }
    let ns = format!("sf-flip-{}", std::process::id());
    let run_dir = args.work_dir.join(&ns);
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let mut cleanup = Cleanup {
        ns: ns.clone(),
        run_dir: run_dir.clone(),
        netns: false,
    };
    cmd("ip", &["netns", "add", &ns])?;
    cleanup.netns = true;
    cmd("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
    let exe = std::env::current_exe()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let status = rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut child = tokio::process::Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(&exe)
            .args(std::env::args_os().skip(1))
            .arg("--inside")
            .arg(&run_dir)
            .spawn()
            .context("starting the run inside the namespace")?;
        let stopped = tokio::select! {
            s = child.wait() => return anyhow::Ok(Some(s?)),
            _ = tokio::signal::ctrl_c() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        };
        eprintln!("{stopped}: stopping and cleaning up");
        let _ = child.start_kill();
        let _ = child.wait().await;
        Ok(None)
    });
    drop(cleanup);
    match status? {
        Some(s) if s.success() => Ok(ExitCode::SUCCESS),
        Some(s) => Ok(ExitCode::from(
            s.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(2),
        )),
        None => Ok(ExitCode::from(130)),
    }
}

/// Child processes, killed on drop.
#[derive(Default)]
struct Procs(Vec<Child>);

impl Procs {
    fn spawn(&mut self, mut command: Command, log: &Path) -> anyhow::Result<()> {
        let out = std::fs::File::create(log)?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {:?}", command.get_program()))?;
        self.0.push(child);
        Ok(())
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in self.0.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn print_log_tails(dir: &Path) {
    for name in ["etcd.log", "server.log", "agent.log"] {
        let Ok(text) = std::fs::read_to_string(dir.join(name)) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        eprintln!("--- last lines of {name}:");
        for l in &lines[lines.len().saturating_sub(15)..] {
            eprintln!("{l}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// The cluster.

fn wep_name(node: &str, pod: &str) -> String {
    format!(
        "{}-k8s-{}-eth0",
        node.replace('-', "--"),
        pod.replace('-', "--")
    )
}

fn wep(node: &str, pod: &str, labels: Value, iface: &str, ip: Ipv4Addr) -> Value {
    let mut labels = labels;
    labels["projectcalico.org/namespace"] = json!(NS);
    labels["projectcalico.org/orchestrator"] = json!("k8s");
    json!({
        "kind": "WorkloadEndpoint", "apiVersion": "projectcalico.org/v3",
        "metadata": {"name": wep_name(node, pod), "namespace": NS, "labels": labels},
        "spec": {"orchestrator": "k8s", "node": node, "pod": pod, "endpoint": "eth0",
                 "interfaceName": iface, "ipNetworks": [format!("{ip}/32")],
                 "profiles": [format!("kns.{NS}")]}
    })
}

/// The endpoint whose label flips: in the source set when `app == 'client'`.
fn flipped(in_set: bool) -> Value {
    let app = if in_set { "client" } else { "other" };
    wep(
        "node-b",
        "flipped",
        json!({"app": app}),
        "califlipped0",
        FLIP_IP,
    )
}

/// Everything but the flipped endpoint.
fn cluster(clients: usize) -> Vec<Value> {
    let mut out = vec![
        json!({"kind": "Tier", "apiVersion": "projectcalico.org/v3",
               "metadata": {"name": "default"},
               "spec": {"order": 1_000_000, "defaultAction": "Deny"}}),
        json!({"kind": "Profile", "apiVersion": "projectcalico.org/v3",
               "metadata": {"name": format!("kns.{NS}")},
               "spec": {"ingress": [{"action": "Allow"}], "egress": [{"action": "Allow"}],
                        "labelsToApply": {"pcns.projectcalico.org/name": NS}}}),
        json!({"kind": "NetworkPolicy", "apiVersion": "projectcalico.org/v3",
               "metadata": {"name": "allow-clients", "namespace": NS},
               "spec": {"order": 100, "selector": "role == 'server'", "types": ["Ingress"],
                        "ingress": [{"action": "Allow", "protocol": "TCP",
                                     "source": {"selector": "app == 'client'"},
                                     "destination": {"ports": [8080]}}]}}),
    ];
    for node in ["node-a", "node-b", "node-c"] {
        out.push(json!({"kind": "Node", "apiVersion": "projectcalico.org/v3",
                        "metadata": {"name": node}, "spec": {}}));
    }
    out.push(wep(
        "node-a",
        "server-a",
        json!({"role": "server"}),
        LOCAL_IFACE,
        Ipv4Addr::new(10, 65, 0, 1),
    ));
    // The probe's node: the same policy is active there, so it gets the same IP set deltas.
    out.push(wep(
        "node-c",
        "server-c",
        json!({"role": "server"}),
        "califlipsrvc",
        Ipv4Addr::new(10, 65, 0, 3),
    ));
    for i in 0..clients {
        out.push(wep(
            "node-b",
            &format!("client-{i}"),
            json!({"app": "client"}),
            &format!("caliclient{i}"),
            Ipv4Addr::new(10, 66, (i / 256 % 256) as u8, (i % 256) as u8),
        ));
    }
    out
}

fn etcd_key(v: &Value) -> anyhow::Result<String> {
    crate::etcd_store::key_of(v)?.context("a kind Calico does not store in etcd")
}

/// Writes the file datastore's file aside and renames it: the watcher never reads half.
fn write_file(path: &Path, v: &Value) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, v.to_string())?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The probe: a simulated agent for node-c, noting when each IP set delta arrives.

enum ProbeEvent {
    InSync,
    Delta(Instant),
    Failed(String),
}

async fn probe(url: String, events: mpsc::Sender<ProbeEvent>) {
    let run = async {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut client = loop {
            match pb::calc_server_client::CalcServerClient::connect(url.clone()).await {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => return Err(e.to_string()),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        let (tx, mut stream) =
            crate::bench_sync::open_sync(&mut client, "node-c".into(), "flip-kernel probe", vec![])
                .await?;
        while let Some(m) = stream.next().await {
            let at = Instant::now();
            let event = match m.map_err(|e| e.to_string())?.payload {
                Some(To::InSync(_)) => ProbeEvent::InSync,
                Some(To::IpsetDeltaUpdate(_)) => ProbeEvent::Delta(at),
                _ => continue,
            };
            let _ = events.send(event);
        }
        drop(tx);
        Err::<(), String>("the server ended the stream".to_owned())
    };
    if let Err(e) = run.await {
        let _ = events.send(ProbeEvent::Failed(e));
    }
}

// ---------------------------------------------------------------------------------------
// Logs.

/// `2026-11-24T13:46:54.297527Z` (tracing's timestamps) as a time.
fn parse_utc(ts: &str) -> Option<SystemTime> {
    let (date, time) = ts.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.splitn(3, '-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.splitn(3, ':').map(str::parse::<i64>);
    let (h, mi, s) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let nanos: u32 = format!("{frac:0<9}").get(..9)?.parse().ok()?;
    // Days since the epoch (Howard Hinnant's days_from_civil).
    let yy = if m <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let secs = u64::try_from(days * 86_400 + h * 3600 + mi * 60 + s).ok()?;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

struct LogEvent {
    at: SystemTime,
    message: String,
    fields: Value,
}

/// The JSON lines of a log file (others are skipped).
fn read_log(path: &Path) -> Vec<LogEvent> {
    let Ok(file) = std::fs::File::open(path) else {
        return Vec::new();
    };
    std::io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| {
            let v: Value = serde_json::from_str(&line).ok()?;
            Some(LogEvent {
                at: parse_utc(v["timestamp"].as_str()?)?,
                message: v["fields"]["message"].as_str()?.to_owned(),
                fields: v["fields"].clone(),
            })
        })
        .collect()
}

fn wait_for_log(path: &Path, needle: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle)) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("no {needle:?} in {} within {timeout:?}", path.display())
}

// ---------------------------------------------------------------------------------------
// The run inside the namespace.

struct Flip {
    into: bool,
    wall0: SystemTime,
    t0: Instant,
    seen: Instant,
    put: Option<Duration>,
    probe: Option<Instant>,
}

enum Writer {
    Etcd(Box<etcd_client::Client>, String),
    File(PathBuf),
}

impl Writer {
    /// Starts writing the flipped endpoint; an etcd put completes on the runtime (its round
    /// trip comes back through the handle).
    fn write(
        &self,
        rt: &tokio::runtime::Runtime,
        in_set: bool,
    ) -> anyhow::Result<Option<tokio::task::JoinHandle<anyhow::Result<Duration>>>> {
        match self {
            Writer::Etcd(client, key) => {
                let (mut client, key) = ((**client).clone(), key.clone());
                let value = flipped(in_set).to_string();
                Ok(Some(rt.spawn(async move {
                    let t = Instant::now();
                    client.put(key, value, None).await.context("etcd put")?;
                    Ok(t.elapsed())
                })))
            }
            Writer::File(path) => {
                write_file(path, &json!([flipped(in_set)]))?;
                Ok(None)
            }
        }
    }
}

async fn connect_etcd() -> anyhow::Result<etcd_client::Client> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let attempt = async {
            let mut c = etcd_client::Client::connect([ETCD_URL], None).await?;
            c.status().await?;
            anyhow::Ok(c)
        };
        match attempt.await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => {
                return Err(e.context("etcd did not come up within 20 s"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The kernel's name for the set (the `cali40s:` set holding the flipped address) and its
/// number of members.
fn find_set() -> anyhow::Result<(String, usize)> {
    let save = cmd("ipset", &["save"])?;
    let flip_ip = FLIP_IP.to_string();
    let set = save
        .lines()
        .find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() >= 3 && w[0] == "add" && w[1].starts_with("cali40s:") && w[2] == flip_ip)
                .then(|| w[1].to_owned())
        })
        .with_context(|| format!("no cali40s: set holds {flip_ip}; ipset save:\n{save}"))?;
    let prefix = format!("add {set} ");
    let members = save.lines().filter(|l| l.starts_with(&prefix)).count();
    Ok((set, members))
}

/// Starts the datastore with the cluster in it: the server's datastore flags, the flip's
/// writer, and a description.
fn start_datastore(
    args: &FlipKernelArgs,
    run_dir: &Path,
    rt: &tokio::runtime::Runtime,
    procs: &mut Procs,
) -> anyhow::Result<(Vec<String>, Writer, String)> {
    Ok(match args.datastore_type {
        Store::Etcdv3 => {
            let version = cmd(args.etcd.to_str().unwrap_or("etcd"), &["--version"])
                .unwrap_or_default()
                .lines()
                .next()
                .unwrap_or_default()
                .replace("etcd Version: ", "");
            let mut etcd = Command::new(&args.etcd);
            etcd.args(["--name", "flip", "--data-dir"])
                .arg(run_dir.join("etcd"))
                .args(["--listen-client-urls", ETCD_URL])
                .args(["--advertise-client-urls", ETCD_URL])
                .args(["--listen-peer-urls", ETCD_PEER_URL])
                .args(["--initial-advertise-peer-urls", ETCD_PEER_URL])
                .args(["--initial-cluster", &format!("flip={ETCD_PEER_URL}")])
                .args(["--initial-cluster-token", "flip-kernel"]);
            procs.spawn(etcd, &run_dir.join("etcd.log"))?;
            let client = rt.block_on(connect_etcd())?;
            rt.block_on(async {
                let mut c = client.clone();
                for v in cluster(args.endpoints).iter().chain([&flipped(true)]) {
                    c.put(etcd_key(v)?, v.to_string(), None).await?;
                }
                anyhow::Ok(())
            })?;
            (
                ["--datastore-type", "etcdv3", "--etcd-endpoints", ETCD_URL]
                    .map(String::from)
                    .to_vec(),
                Writer::Etcd(Box::new(client), etcd_key(&flipped(true))?),
                format!(
                    "etcd {version} in the namespace, data on {}, each flip one put",
                    args.work_dir.display()
                ),
            )
        }
        Store::File => {
            let dir = run_dir.join("datastore");
            std::fs::create_dir_all(&dir)?;
            write_file(
                &dir.join("cluster.json"),
                &Value::Array(cluster(args.endpoints)),
            )?;
            let flip_file = dir.join("flipped.json");
            write_file(&flip_file, &json!([flipped(true)]))?;
            let poll = format!("{}ms", args.file_poll_interval.as_secs_f64() * 1e3);
            (
                vec![
                    "--datastore-type".into(),
                    "file".into(),
                    "--file-dir".into(),
                    dir.display().to_string(),
                    "--file-poll-interval".into(),
                    poll.clone(),
                ],
                Writer::File(flip_file),
                format!("manifest directory polled every {poll}, each flip one file rewritten"),
            )
        }
    })
}

fn measure(args: &FlipKernelArgs, run_dir: &Path) -> anyhow::Result<ExitCode> {
    let bins = bin_dir(args)?;
    // This machine may be shared: the load when the run began goes with its figures.
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut procs = Procs::default();
    let (server_store, writer, store_desc) = start_datastore(args, run_dir, &rt, &mut procs)?;
    // node-a's endpoint needs its interface for the agent to program it.
    cmd(
        "ip",
        &[
            "link",
            "add",
            LOCAL_IFACE,
            "type",
            "veth",
            "peer",
            "name",
            LOCAL_PEER,
        ],
    )?;
    cmd("ip", &["link", "set", LOCAL_IFACE, "up"])?;
    cmd("ip", &["link", "set", LOCAL_PEER, "up"])?;

    let mut server = Command::new(bins.join("calc-server"));
    server
        .arg("serve")
        .args(&server_store)
        .args(["--listen", GRPC, "--admin-listen", SERVER_ADMIN])
        .args(["--log-format", "json"])
        .args(["--log-level", "info,calc_server::datastore::etcd=debug"]);
    let server_log = run_dir.join("server.log");
    procs.spawn(server, &server_log)?;
    let mut agent = Command::new(bins.join("dataplane-agent"));
    agent
        .args(["--server", GRPC, "--node", "node-a", "--driver", "linux"])
        .args(["--iptables-backend", "nft"])
        .args([
            "--reconnect-min-delay",
            "100ms",
            "--reconnect-max-delay",
            "500ms",
        ])
        .args(["--log-format", "json"])
        .args([
            "--log-level",
            "info,dataplane_agent::driver::linux::ipsets_mgr=debug",
        ]);
    let agent_log = run_dir.join("agent.log");
    procs.spawn(agent, &agent_log)?;

    let (ptx, prx) = mpsc::channel();
    rt.spawn(probe(format!("http://{GRPC}"), ptx));
    match prx.recv_timeout(Duration::from_secs(60)) {
        Ok(ProbeEvent::InSync) => {}
        Ok(ProbeEvent::Failed(e)) => bail!("the node-c probe failed: {e}"),
        _ => bail!("the node-c probe got no InSync within 60 s"),
    }
    wait_for_log(&agent_log, "dataplane in sync", Duration::from_secs(60))?;

    let (set, members) = find_set()?;
    let flip_ip = FLIP_IP.to_string();
    let mut tester = IpsetTester::new(&set, FLIP_IP).context("netlink socket for ipset")?;
    ensure!(
        tester.test()?,
        "netlink says {flip_ip} is not in {set}, ipset save says it is"
    );

    let poll_interval = Duration::from_micros(args.poll_interval_us);
    let mut rng = common::rng::Rng::from_entropy();
    let mut flips = Vec::new();
    let (mut polls, mut poll_span, mut test_time) = (0u64, Duration::ZERO, Duration::ZERO);
    let mut in_set = true;
    let mut floor = Vec::new();
    cmd("ipset", &["create", FLOOR_SET, "hash:ip", "family", "inet"])?;
    for k in 0..args.warmup + args.flips {
        let target = !in_set;
        let wall0 = SystemTime::now();
        let t0 = Instant::now();
        let put = writer.write(&rt, target)?;
        let mut first = None;
        let mut n = 0u64;
        let seen = loop {
            let at = Instant::now();
            let now = tester.test().context("ipset test over netlink")?;
            test_time += at.elapsed();
            n += 1;
            first.get_or_insert(at);
            if now == target {
                break at;
            }
            ensure!(
                t0.elapsed() < FLIP_TIMEOUT,
                "flip {k}: {flip_ip} still {} {set} after {FLIP_TIMEOUT:?}",
                if target { "not in" } else { "in" }
            );
            if !poll_interval.is_zero() {
                std::thread::sleep(poll_interval);
            }
        };
        if n > 1 {
            polls += n - 1;
            poll_span += seen - first.unwrap_or(seen);
        }
        let put = match put {
            Some(h) => Some(rt.block_on(h)??),
            None => None,
        };
        // The probe's copy of the same delta (it normally arrived before the kernel had it).
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut probe_at = None;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match prx.recv_timeout(left) {
                Ok(ProbeEvent::Delta(at)) if at >= t0 => {
                    probe_at = Some(at);
                    break;
                }
                Ok(ProbeEvent::Failed(e)) => bail!("the node-c probe failed: {e}"),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        if k >= args.warmup {
            flips.push(Flip {
                into: target,
                wall0,
                t0,
                seen,
                put,
                probe: probe_at,
            });
        }
        in_set = target;
        // The floor, in the pause (the agent is idle again): same machine load as the flips.
        let pause = Instant::now() + args.spacing.mul_f64(1.0 + rng.unit());
        let took = ipset_floor_once(target)?;
        if k >= args.warmup {
            floor.push(took);
        }
        std::thread::sleep(pause.saturating_duration_since(Instant::now()));
    }
    std::thread::sleep(Duration::from_millis(200));
    cmd("ipset", &["destroy", FLOOR_SET])?;
    let agent_events = read_log(&agent_log);
    let server_events = read_log(&server_log);
    drop(procs);
    if let Some(dir) = &args.logs_dir {
        std::fs::create_dir_all(dir)?;
        for name in ["etcd.log", "server.log", "agent.log"] {
            if run_dir.join(name).is_file() {
                std::fs::copy(run_dir.join(name), dir.join(name))
                    .with_context(|| format!("copying {name} to {}", dir.display()))?;
            }
        }
    }
    report(&Report {
        args,
        store_desc: &store_desc,
        load: &load,
        set: &set,
        members,
        flips: &flips,
        poll_interval,
        mean_poll: poll_span.checked_div(u32::try_from(polls).unwrap_or(u32::MAX)),
        mean_test: test_time.checked_div(u32::try_from(polls.max(1)).unwrap_or(u32::MAX)),
        agent: agent_events,
        server: server_events,
        floor,
    });
    Ok(ExitCode::SUCCESS)
}

/// The scratch set of the floor (not the agent's: `ipset_floor_once` changes it).
const FLOOR_SET: &str = "sf-flip-floor";

/// The floor of the agent's step: one bare `ipset -exist restore` of one line (an add or a
/// del of the same address) on the scratch set, spawned from this process and timed to its
/// exit, as the agent's runner does.
fn ipset_floor_once(add: bool) -> anyhow::Result<Duration> {
    use std::io::Write as _;
    let line = format!(
        "{} {FLOOR_SET} 10.99.0.1\n",
        if add { "add" } else { "del" }
    );
    let t = Instant::now();
    let mut child = Command::new("ipset")
        .args(["-exist", "restore"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running ipset restore")?;
    child
        .stdin
        .take()
        .context("ipset's stdin")?
        .write_all(line.as_bytes())?;
    let out = child.wait_with_output()?;
    let took = t.elapsed();
    ensure!(
        out.status.success(),
        "ipset restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(took)
}

struct Report<'a> {
    args: &'a FlipKernelArgs,
    store_desc: &'a str,
    load: &'a str,
    set: &'a str,
    members: usize,
    flips: &'a [Flip],
    poll_interval: Duration,
    mean_poll: Option<Duration>,
    mean_test: Option<Duration>,
    agent: Vec<LogEvent>,
    server: Vec<LogEvent>,
    floor: Vec<Duration>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// "p50 / p99" in ms of `v` (sorted here), or "n/a".
fn p50_p99(v: &mut [Duration]) -> String {
    if v.is_empty() {
        return "n/a".to_owned();
    }
    v.sort();
    format!(
        "{:.2} / {:.2}",
        ms(percentile(v, 0.5)),
        ms(percentile(v, 0.99))
    )
}

/// What the logs say about one flip (offsets from the write).
#[derive(Default)]
struct Seen {
    server_rx: Option<Duration>,
    apply_start: Option<Duration>,
    restored: Option<Duration>,
    apply_end: Option<Duration>,
    apply_took: Option<Duration>,
    applies: usize,
    changes: u64,
}

fn report(r: &Report<'_>) {
    let flips = r.flips;
    let store = r.args.datastore_type.name();
    let latency = |f: &Flip| f.seen - f.t0;
    let mut total: Vec<Duration> = flips.iter().map(latency).collect();
    let mut into: Vec<Duration> = flips.iter().filter(|f| f.into).map(latency).collect();
    let mut out: Vec<Duration> = flips.iter().filter(|f| !f.into).map(latency).collect();
    total.sort();

    // Log events per flip: the first of each kind between this flip's write and the next.
    let logs: Vec<Seen> = (0..flips.len())
        .map(|i| {
            let from = flips[i].wall0;
            let to = flips.get(i + 1).map(|f| f.wall0);
            let within = |events: &'_ [LogEvent], message: &str| -> Vec<(Duration, Value)> {
                events
                    .iter()
                    .filter(|e| e.message == message && e.at >= from && to.is_none_or(|t| e.at < t))
                    .map(|e| {
                        (
                            e.at.duration_since(from).unwrap_or_default(),
                            e.fields.clone(),
                        )
                    })
                    .collect()
            };
            let applied = within(&r.agent, "applied");
            let took = applied.first().map(|(_, f)| {
                Duration::from_secs_f64(f["elapsed_ms"].as_f64().unwrap_or(0.0) / 1e3)
            });
            Seen {
                server_rx: within(&r.server, "etcd watch events").first().map(|e| e.0),
                apply_start: applied
                    .first()
                    .zip(took)
                    .map(|((at, _), took)| at.saturating_sub(took)),
                restored: within(&r.agent, "ipsets updated").first().map(|e| e.0),
                apply_end: applied.first().map(|e| e.0),
                apply_took: took,
                applies: applied.len(),
                changes: applied
                    .iter()
                    .map(|(_, f)| f["changes"].as_u64().unwrap_or(0))
                    .sum(),
            }
        })
        .collect();
    let series = |f: &dyn Fn(&Flip, &Seen) -> Option<Duration>| -> Vec<Duration> {
        flips
            .iter()
            .zip(&logs)
            .filter_map(|(fl, s)| f(fl, s))
            .collect()
    };

    println!(
        "flip-kernel: {store} datastore ({}); calc-server and one dataplane-agent (linux driver, nft) in a fresh network namespace",
        r.store_desc
    );
    println!(
        "machine: {} cores, load average {} (1 min) when the run began",
        std::thread::available_parallelism().map_or(0, usize::from),
        r.load
    );
    println!(
        "set {} on node-a: {} members; the flipped endpoint ({FLIP_IP}, node-b) goes out and in by its `app` label",
        r.set, r.members
    );
    println!(
        "{} flips ({} in, {} out) after {} warm-up, {:.0}–{:.0} ms apart",
        flips.len(),
        into.len(),
        out.len(),
        r.args.warmup,
        ms(r.args.spacing),
        ms(r.args.spacing * 2)
    );
    println!(
        "kernel poll: netlink IPSET_CMD_TEST inside the namespace every {} µs; measured {} µs between polls, {} µs per test: resolution ~{:.2} ms",
        r.poll_interval.as_micros(),
        r.mean_poll
            .map_or("?".into(), |d| d.as_micros().to_string()),
        r.mean_test
            .map_or("?".into(), |d| d.as_micros().to_string()),
        r.mean_poll.map_or(0.0, ms)
    );
    if total.is_empty() {
        println!("no flips timed");
        return;
    }
    println!(
        "datastore write → kernel ipset: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (in: {} ms; out: {} ms, p50 / p99)",
        ms(percentile(&total, 0.5)),
        ms(percentile(&total, 0.99)),
        ms(*total.last().unwrap_or(&Duration::ZERO)),
        p50_p99(&mut into),
        p50_p99(&mut out)
    );
    let row = |what: &str, mut v: Vec<Duration>| {
        if !v.is_empty() {
            let n = v.len();
            let unit = if what.starts_with("floor") {
                "runs"
            } else {
                "flips"
            };
            println!("  {what:<64} {:>15}  ({n} {unit})", p50_p99(&mut v));
        }
    };
    println!("when (ms after the write began; p50 / p99):");
    row("etcd put acknowledged to the writer", series(&|f, _| f.put));
    row(
        "calc-server has the watch event, decoded (server log)",
        series(&|_, s| s.server_rx),
    );
    row(
        "the IP set delta reaches a simulated agent (node-c, gRPC)",
        series(&|f, _| f.probe.map(|p| p - f.t0)),
    );
    row(
        "the agent starts its apply (agent log: end − elapsed_ms)",
        series(&|_, s| s.apply_start),
    );
    row(
        "the kernel set has changed (the poll sees it)",
        total.clone(),
    );
    row(
        "the agent's ipset restore has returned (agent log)",
        series(&|_, s| s.restored),
    );
    row(
        "the agent's apply ends (agent log)",
        series(&|_, s| s.apply_end),
    );
    println!("how long (ms; p50 / p99 of each flip's own difference):");
    row(
        "datastore → server: put, commit, watch, decode",
        series(&|_, s| s.server_rx),
    );
    row(
        "server → the agent's apply starts: graph, flush, gRPC, decode",
        series(&|_, s| s.apply_start?.checked_sub(s.server_rx?)),
    );
    row(
        "agent: apply start → kernel set changed",
        series(&|f, s| (f.seen - f.t0).checked_sub(s.apply_start?)),
    );
    row("agent: whole apply", series(&|_, s| s.apply_took));
    row(
        "floor: a bare `ipset -exist restore` of one line (between flips)",
        r.floor.clone(),
    );
    let applies: usize = logs.iter().map(|s| s.applies).sum();
    let changes: u64 = logs.iter().map(|s| s.changes).sum();
    let multi = logs.iter().filter(|s| s.applies > 1).count();
    println!(
        "agent: {applies} applies for {} flips ({changes} changes; {multi} flips took more than one apply)",
        flips.len()
    );
    // The contract line scripts read.
    println!(
        "flip to kernel: p50 {:.2} ms, p99 {:.2} ms ({} flips, {store})",
        ms(percentile(&total, 0.5)),
        ms(percentile(&total, 0.99)),
        flips.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_timestamps_are_read_to_the_microsecond() {
        let t = parse_utc("2026-11-24T13:46:54.297527Z").unwrap();
        let d = t.duration_since(UNIX_EPOCH).unwrap();
        assert_eq!(
            common::rfc3339_utc(t),
            "2026-11-24T13:46:54Z",
            "the date and time of day"
        );
        assert_eq!(d.subsec_micros(), 297_527);
        assert_eq!(
            parse_utc("2024-02-29T00:00:00Z").map(common::rfc3339_utc),
            Some("2024-02-29T00:00:00Z".to_owned())
        );
        assert!(parse_utc("yesterday").is_none());
    }

    #[test]
    fn every_object_has_an_etcd_key() {
        for v in cluster(3).iter().chain([&flipped(false)]) {
            let key = etcd_key(v).unwrap();
            assert!(
                key.starts_with("/calico/resources/v3/projectcalico.org/"),
                "{key}"
            );
        }
        assert_eq!(
            etcd_key(&flipped(true)).unwrap(),
            "/calico/resources/v3/projectcalico.org/workloadendpoints/flip/node--b-k8s-flipped-eth0"
        );
    }
}
