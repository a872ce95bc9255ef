//! The agent's CPU per new connection with flow logs on (issue 42), on a real kernel:
//! `cargo bench -p bench-tools --bench agent_flows` (root; `make bench-flows` runs it).
//!
//! One node as the integration tests build it (`integration::netns`): a host namespace running
//! `calc-server serve` (file datastore) and `dataplane-agent --driver linux` (iptables, nft
//! backend), and two workloads wired to it as Calico's CNI plugin does; a policy allows the
//! client to reach the server's TCP port 8080, so each new connection passes the allow rule
//! (NFLOG, with flow logs on) and conntrack. A load generator (this binary, re-executed inside
//! the client's namespace with `--load`) opens and closes `AGENT_FLOWS_RATE` connections a
//! second (default 1,000) with `std::net::TcpStream` for `AGENT_FLOWS_SECONDS` (default 20),
//! paced to the schedule; the server side accepts and closes them from a thread in the
//! workload's namespace (`Netns::accept`).
//!
//! Measured from `/proc/<pid>/stat` (utime + stime) of the agent and the server: their CPU over
//! 10 s idle (programmed, no traffic), then over the load plus a 12 s tail (the agent reads
//! NFLOG and conntrack and sends every 5 s, so work for the last connections lands after the
//! load). Reported: the rate achieved, CPU-ms per second of load per 1,000 connections/s (above
//! idle, and gross), which is also tenths of a percent of one core. Run twice: flow logs off
//! (the baseline) and on (agent and server `--flow-logs`). With flow logs on, the connections
//! the server's flow store counted (`calc-server flows`, `num_connections_started` of the
//! destination's records) are read after the next intervals close, to show that the records
//! made it.
//!
//! Outside `cargo bench` (no `--bench` argument, as `cargo test --all-targets` runs it) it does
//! nothing; without root or the namespace tools it says so and does nothing. Measures; never
//! fails on time.

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use integration::binary;
use integration::netns::{Driver, Netns, agent_args, client_and, write_manifest};
use serde_json::Value;

const NODE: &str = "node-a";
const PORT: u16 = 8080;
/// CPU read this long after the load ends: the agent's periodic read (5 s) of the last
/// connections falls inside.
const TAIL: Duration = Duration::from_secs(12);
const IDLE: Duration = Duration::from_secs(10);
/// Connecting threads of the load generator.
const LOAD_THREADS: u64 = 8;

const POLICY: &str = "apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-allow, namespace: prod}
spec:
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {selector: app == 'client'}
    destination: {ports: [8080]}
";

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// utime + stime of a process, in milliseconds (clock ticks of 10 ms).
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at the third: state.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    ticks as f64 * 1000.0 / ticks_per_second()
}

fn ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// The load generator, inside the client's namespace: `--load ADDR RATE SECONDS`, on
/// [`LOAD_THREADS`] threads each keeping its share of the schedule (one connect can take
/// milliseconds on a loaded machine). Prints `load: <ok> ok, <failed> failed, <seconds> s`.
fn load(args: &[String]) {
    let addr: SocketAddr = args[0].parse().expect("address");
    let rate: u64 = args[1].parse().expect("rate");
    let seconds: u64 = args[2].parse().expect("seconds");
    let total = rate * seconds;
    let start = Instant::now();
    let threads: Vec<_> = (0..LOAD_THREADS)
        .map(|t| {
            std::thread::spawn(move || {
                let (mut ok, mut failed) = (0u64, 0u64);
                for i in (t..total).step_by(LOAD_THREADS as usize) {
                    let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                        Ok(s) => {
                            drop(s);
                            ok += 1;
                        }
                        Err(_) => failed += 1,
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    let (mut ok, mut failed) = (0u64, 0u64);
    for t in threads {
        let (o, f) = t.join().expect("load thread");
        ok += o;
        failed += f;
    }
    println!(
        "load: {ok} ok, {failed} failed, {:.3} s",
        start.elapsed().as_secs_f64()
    );
}

/// What one run measured.
struct Measured {
    ok: u64,
    failed: u64,
    load_s: f64,
    agent_idle_pct: f64,
    agent_ms: f64,
    server_idle_pct: f64,
    server_ms: f64,
    window_s: f64,
    counted: Option<u64>,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.ok as f64 / self.load_s
    }

    /// CPU-ms per second of load per 1,000 connections/s: (gross, above idle).
    fn per_1k(&self, ms: f64, idle_pct: f64) -> (f64, f64) {
        let scale = 1000.0 / self.rate().max(1e-9) / self.load_s;
        let above = ms - idle_pct / 100.0 * 1000.0 * self.window_s;
        (ms * scale, above * scale)
    }
}

/// Connections started that the server's store holds for the destination's side on `PORT`.
fn counted(host: &Netns) -> u64 {
    let cli = binary("calc-server");
    let out = host.exec(&[
        cli.to_str().expect("utf-8 path"),
        "flows",
        "--server",
        "127.0.0.1:9099",
        "--output",
        "json",
    ]);
    let n = |v: &Value| {
        v.as_u64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .unwrap_or(0)
    };
    let total = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|f| {
            let k = if f["Key"].is_object() {
                &f["Key"]
            } else {
                &f["key"]
            };
            n(&k["dest_port"]) == u64::from(PORT) && k["reporter"] == "Dst"
        })
        .map(|f| n(&f["num_connections_started"]))
        .sum();
    if total == 0 {
        let head: String = out.lines().take(3).collect::<Vec<_>>().join("\n");
        println!(
            "  (no flow to port {PORT} reported by the destination; `calc-server flows` printed: {head})"
        );
    }
    total
}

fn run(flows: bool, rate: u64, seconds: u64) -> Measured {
    let host = Netns::new("host");
    host.make_host();
    let dir = tempfile::tempdir().expect("temp dir");
    let (client, web) = client_and(&host, NODE, "web", "cali0web00002", dir.path());
    write_manifest(dir.path(), "policy.yaml", POLICY);
    // Spawned as `ControlPlane` does, but logging at warn: no per-rule debug lines on the
    // measured path.
    let log = |name: &str| dir.path().with_extension(name);
    let mut server_args = vec![
        "serve".to_string(),
        "--file-dir".into(),
        dir.path().to_str().expect("UTF-8 path").into(),
        "--listen".into(),
        "127.0.0.1:50051".into(),
        "--admin-listen".into(),
        "127.0.0.1:9099".into(),
        "--log-level".into(),
        "warn".into(),
    ];
    let mut agent_args = agent_args(Driver::Linux, "127.0.0.1:50051", NODE, "warn");
    agent_args.extend(["--iptables-backend".to_string(), "nft".into()]);
    if flows {
        server_args.push("--flow-logs".into());
        agent_args.push("--flow-logs".into());
    }
    let mut server_child = host.spawn(
        &binary("calc-server"),
        &server_args.iter().map(String::as_str).collect::<Vec<_>>(),
        &log("server.log"),
    );
    let mut agent_child = host.spawn(
        &binary("dataplane-agent"),
        &agent_args.iter().map(String::as_str).collect::<Vec<_>>(),
        &log("agent.log"),
    );
    let logs = || {
        let text = |n: &str| std::fs::read_to_string(log(n)).unwrap_or_default();
        format!(
            "agent:\n{}\nserver:\n{}",
            text("agent.log"),
            text("server.log")
        )
    };
    // Programmed once the allow rule lets the client in.
    let _acceptor = web.ns.accept(PORT);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !client.connects(&web.ipv4, PORT) {
        assert!(
            Instant::now() < deadline,
            "the client never reached web:{PORT}\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // As the flow records test: a flow period for the agent's first read to bind NFLOG.
    std::thread::sleep(Duration::from_secs(6));
    let agent_pid = agent_child.id();
    let server_pid = server_child.id();
    let comm = std::fs::read_to_string(format!("/proc/{agent_pid}/comm")).unwrap_or_default();
    assert_eq!(
        comm.trim(),
        "dataplane-agent",
        "pid {agent_pid} is the agent"
    );
    let (agent, server) = (agent_pid, server_pid);

    let (a0, s0, t0) = (cpu_ms(agent), cpu_ms(server), Instant::now());
    std::thread::sleep(IDLE);
    let idle_s = t0.elapsed().as_secs_f64();
    let agent_idle_pct = (cpu_ms(agent) - a0) / idle_s / 10.0;
    let server_idle_pct = (cpu_ms(server) - s0) / idle_s / 10.0;

    let exe = std::env::current_exe().expect("this binary");
    let (a0, s0, t0) = (cpu_ms(agent), cpu_ms(server), Instant::now());
    let out = Command::new("ip")
        .args(["netns", "exec", &client.ns.name])
        .arg(&exe)
        .args([
            "--load",
            &format!("{}:{PORT}", web.ipv4),
            &rate.to_string(),
            &seconds.to_string(),
        ])
        .output()
        .expect("load generator");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("load: "))
        .unwrap_or_else(|| {
            panic!(
                "load generator: {text}{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                logs()
            )
        });
    let nums: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|v| v.parse().ok())
        .collect();
    std::thread::sleep(TAIL);
    let window_s = t0.elapsed().as_secs_f64();
    let (agent_ms, server_ms) = (cpu_ms(agent) - a0, cpu_ms(server) - s0);
    // The records of the last intervals: sent once their interval closed (15 s) and the
    // agent's next send (5 s).
    let counted = flows.then(|| {
        std::thread::sleep(Duration::from_secs(15));
        let n = counted(&host);
        if n == 0 {
            println!("{}", logs());
        }
        n
    });
    for child in [&mut agent_child, &mut server_child] {
        let _ = child.kill();
        let _ = child.wait();
    }
    Measured {
        ok: nums.first().copied().unwrap_or(0.0) as u64,
        failed: nums.get(1).copied().unwrap_or(0.0) as u64,
        load_s: nums.get(2).copied().unwrap_or(1.0),
        agent_idle_pct,
        agent_ms,
        server_idle_pct,
        server_ms,
        window_s,
        counted,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--load") {
        load(&args[2..]);
        return;
    }
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    if let Err(why) = integration::netns::prerequisites() {
        println!("agent flows: skipped: {why}");
        return;
    }
    let rate = env_u64("AGENT_FLOWS_RATE", 1000).max(1);
    let seconds = env_u64("AGENT_FLOWS_SECONDS", 20).max(1);
    println!(
        "{rate} new TCP connections/s for {seconds} s, client to web through an allow rule; CPU over the load + {} s",
        TAIL.as_secs()
    );
    let mut per = [0.0f64; 2];
    for (i, flows) in [false, true].into_iter().enumerate() {
        let m = run(flows, rate, seconds);
        let (agent_gross, agent_above) = m.per_1k(m.agent_ms, m.agent_idle_pct);
        let (server_gross, server_above) = m.per_1k(m.server_ms, m.server_idle_pct);
        per[i] = agent_above;
        println!(
            "flow logs {}: {:.0} conn/s achieved ({} ok, {} failed in {:.1} s)",
            if flows { "on " } else { "off" },
            m.rate(),
            m.ok,
            m.failed,
            m.load_s
        );
        println!(
            "  agent:  {:.0} CPU-ms over {:.1} s (idle {:.2} % of a core); per 1k conn/s: {agent_above:.1} CPU-ms/s above idle ({:.2} % of a core), {agent_gross:.1} gross",
            m.agent_ms,
            m.window_s,
            m.agent_idle_pct,
            agent_above / 10.0
        );
        println!(
            "  server: {:.0} CPU-ms (idle {:.2} %); per 1k conn/s: {server_above:.1} CPU-ms/s above idle, {server_gross:.1} gross",
            m.server_ms, m.server_idle_pct
        );
        if let Some(c) = m.counted {
            println!(
                "  the server's flow store counted {c} connections started (of {} made)",
                m.ok
            );
        }
    }
    println!(
        "agent flows: {:.1} CPU-ms/s per 1k conn/s with flow logs ({:.2} % of a core), {:.1} without",
        per[1],
        per[1] / 10.0,
        per[0]
    );
}
