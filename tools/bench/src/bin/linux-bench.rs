//! Benchmark of the Linux driver against the floor (run as root; `make bench` runs it).
//!
//! `linux-bench [--endpoints N --policies N --members N --runs N]` creates a fresh network
//! namespace per run and re-runs itself inside it:
//!
//! * `program`: feeds a synthetic node state (endpoints with tiered policies, profiles, IP sets)
//!   to the Linux driver (nft backend) and times a full apply; then times one-chain changes
//!   and hit-counter collections (`collect_hits`: wall and CPU time, the tools included);
//!   dumps `ipset save` and `ip[6]tables-save` of the result.
//! * `floor`: in another fresh namespace, times one `ipset restore` and one
//!   `ip[6]tables-restore` per family of exactly that dump, and a bare `--noflush` restore of
//!   the same one-chain change.
//!
//! Prints the medians and the ratios. Measures only; never fails on time.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use dataplane_agent::driver::linux::Backend;
use dataplane_agent::driver::linux::bench::{CommandRunner, Output, SystemRunner};
use dataplane_agent::driver::{Driver, LinuxDriver, LinuxOptions, Message};
use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActivePolicyUpdate, ActiveProfileUpdate, IpSetUpdate, Policy, PolicyId, PortRange, Profile,
    ProfileId, Protocol, Rule, TierInfo, WorkloadEndpoint, WorkloadEndpointId,
    WorkloadEndpointUpdate, protocol,
};

struct Params {
    endpoints: usize,
    policies: usize,
    members: usize,
    runs: usize,
    /// The nftables driver (`--driver nftables`) instead of iptables.
    nft: bool,
}

/// Benchmark of the Linux driver against the floor: a raw `ipset restore` and
/// `ip[6]tables-restore` of the same rules, in fresh network namespaces. Needs root; `make bench`
/// runs it. Measures only; never fails on time.
#[derive(clap::Parser)]
#[command(name = "linux-bench")]
struct Cli {
    /// Workload endpoints in the synthetic node (each with tiered policies and a profile).
    #[arg(
        long,
        global = true,
        env = "LINUX_BENCH_ENDPOINTS",
        default_value_t = 100
    )]
    endpoints: usize,
    /// Policies in the synthetic node.
    #[arg(
        long,
        global = true,
        env = "LINUX_BENCH_POLICIES",
        default_value_t = 200
    )]
    policies: usize,
    /// IP set members in all.
    #[arg(
        long,
        global = true,
        env = "LINUX_BENCH_MEMBERS",
        default_value_t = 100_000
    )]
    members: usize,
    /// Runs per measure (the medians are printed).
    #[arg(long, global = true, env = "LINUX_BENCH_RUNS", default_value_t = 3)]
    runs: usize,
    /// The driver measured: `linux` (iptables and ipsets, against bare `ipset restore` and
    /// `iptables-restore`) or `nftables` (against bare `nft -f` of the same ruleset, at 1k, 10k
    /// and 100k rules, with one IP set member change as well).
    #[arg(long, global = true, env = "LINUX_BENCH_DRIVER", default_value = "linux",
          value_parser = ["linux", "nftables"])]
    driver: String,
    #[command(subcommand)]
    phase: Option<Phase>,
}

/// The phases the benchmark runs of itself inside each namespace.
#[derive(clap::Subcommand)]
enum Phase {
    /// Program the synthetic node here and dump the result into DIR.
    #[command(hide = true)]
    Program { dir: PathBuf },
    /// Restore DIR's dump here with the bare tools.
    #[command(hide = true)]
    Floor { dir: PathBuf },
    /// Time route programming.
    #[command(hide = true)]
    Routes,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    let p = Params {
        endpoints: cli.endpoints,
        policies: cli.policies,
        members: cli.members,
        runs: cli.runs,
        nft: cli.driver == "nftables",
    };
    match cli.phase {
        Some(Phase::Program { dir }) => program(&p, &dir),
        Some(Phase::Floor { dir }) if p.nft => nft_floor(&dir),
        Some(Phase::Floor { dir }) => floor(&dir),
        Some(Phase::Routes) => routes_bench(p.endpoints, p.runs),
        None => orchestrate(&p),
    }
}

fn msg(payload: Payload) -> Message {
    Message::try_from(payload).expect("the synthetic state is valid")
}

fn pid(i: usize) -> PolicyId {
    PolicyId {
        name: format!("policy-{i:04}"),
        namespace: String::new(),
        kind: "GlobalNetworkPolicy".into(),
    }
}

/// The synthetic node state: IP sets of 10.x addresses, policies of 10 inbound and 10
/// outbound rules (set match + ports), endpoints in two tiers of 4 policies each.
fn state(p: &Params, variant: usize) -> Vec<Message> {
    let mut out = Vec::new();
    let sets = (p.policies).max(1);
    let per_set = p.members / sets;
    for s in 0..sets {
        let members = (0..per_set)
            .map(|m| {
                let n = s * per_set + m;
                format!("10.{}.{}.{}/32", (n >> 16) & 255, (n >> 8) & 255, n & 255)
            })
            .collect();
        out.push(msg(Payload::IpsetUpdate(IpSetUpdate {
            id: format!("s:bench-set-{s:04}"),
            members,
            r#type: 2,
        })));
    }
    // The workload addresses as a selector's IP set (hash:ip): what endpoint churn changes.
    out.push(msg(Payload::IpsetUpdate(IpSetUpdate {
        id: "s:bench-pods".into(),
        members: (0..per_set.max(1))
            .map(|m| format!("10.66.{}.{}", (m >> 8) & 255, m & 255))
            .collect(),
        r#type: 0,
    })));
    let tcp = Some(Protocol {
        number_or_name: Some(protocol::NumberOrName::Name("tcp".into())),
    });
    for i in 0..p.policies {
        let rules = |dir: usize| -> Vec<Rule> {
            (0..10)
                .map(|r| Rule {
                    action: if r % 5 == 4 {
                        "deny".into()
                    } else {
                        "allow".into()
                    },
                    protocol: tcp.clone(),
                    src_ip_set_ids: vec![format!("s:bench-set-{:04}", (i + r + dir) % sets)],
                    dst_ports: vec![
                        PortRange {
                            first: (1000 + r + variant) as i32,
                            last: (1000 + r + variant) as i32,
                        },
                        PortRange {
                            first: 8000,
                            last: 8100,
                        },
                    ],
                    ..Default::default()
                })
                .collect()
        };
        out.push(msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pid(i)),
            policy: Some(Policy {
                inbound_rules: rules(0),
                outbound_rules: rules(1),
                tier: if i % 2 == 0 {
                    "security".into()
                } else {
                    "default".into()
                },
                ..Default::default()
            }),
        })));
    }
    for ns in 0..10 {
        out.push(msg(Payload::ActiveProfileUpdate(ActiveProfileUpdate {
            id: Some(ProfileId {
                name: format!("kns.ns-{ns}"),
            }),
            profile: Some(Profile {
                inbound_rules: vec![Rule {
                    action: "allow".into(),
                    ..Default::default()
                }],
                outbound_rules: vec![Rule {
                    action: "allow".into(),
                    ..Default::default()
                }],
            }),
        })));
    }
    for e in 0..p.endpoints {
        let pick = |k: usize| pid((e * 7 + k * 13) % p.policies.max(1));
        let tiers = vec![
            TierInfo {
                name: "security".into(),
                ingress_policies: (0..4).map(|k| pick(2 * k)).collect(),
                egress_policies: (0..4).map(|k| pick(2 * k)).collect(),
                default_action: "Pass".into(),
            },
            TierInfo {
                name: "default".into(),
                ingress_policies: (0..4).map(|k| pick(2 * k + 1)).collect(),
                egress_policies: (0..4).map(|k| pick(2 * k + 1)).collect(),
                default_action: "Deny".into(),
            },
        ];
        out.push(msg(Payload::WorkloadEndpointUpdate(
            WorkloadEndpointUpdate {
                id: Some(WorkloadEndpointId {
                    orchestrator_id: "k8s".into(),
                    workload_id: format!("ns-{}/pod-{e}", e % 10),
                    endpoint_id: "eth0".into(),
                }),
                endpoint: Some(WorkloadEndpoint {
                    state: "active".into(),
                    name: format!("cali{e:011}"),
                    profile_ids: vec![format!("kns.ns-{}", e % 10)],
                    ipv4_nets: vec![format!("10.65.{}.{}/32", e / 256, e % 256)],
                    tiers,
                    ..Default::default()
                }),
            },
        )));
    }
    out
}

/// Sums the time spent in each external program (printed to stderr for the breakdown).
struct Timing {
    inner: SystemRunner,
    spent: std::sync::Arc<parking_lot::Mutex<Vec<(String, f64)>>>,
}

impl CommandRunner for Timing {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> std::io::Result<Output> {
        let t = Instant::now();
        let out = self.inner.run(program, args, stdin);
        let label = format!("{program} {}", args.join(" "));
        self.spent.lock().push((label, t.elapsed().as_secs_f64()));
        out
    }
}

fn options(nft: bool) -> LinuxOptions {
    LinuxOptions {
        backend: Backend::IptablesNft,
        nftables: nft,
        // Routes are measured on their own (they need the async runtime).
        manage_routes: false,
        ..LinuxOptions::default()
    }
}

fn sh(cmd: &str) -> String {
    let out = Command::new("sh").args(["-c", cmd]).output().expect("sh");
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What one collection of the rules' hit counters costs (median wall time; CPU time of the
/// process and the tools it ran, per collection).
struct Collection {
    wall: f64,
    cpu: f64,
}

/// CPU seconds used by this process and its waited-for children (`/proc/self/stat` utime,
/// stime, cutime, cstime; clock ticks of 1/100 s).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the command name, which ends with the last ')'.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    // utime is field 14 of the whole line, the 12th after the state (field 3).
    let ticks: u64 = fields[11..15]
        .iter()
        .map(|f| f.parse::<u64>().unwrap_or(0))
        .sum();
    ticks as f64 / 100.0
}

/// Times `collect_hits` as the agent runs it every stats interval: a baseline read, then ten.
fn hit_collection(driver: &mut LinuxDriver) -> Collection {
    driver.collect_hits().expect("baseline collection");
    let mut times = Vec::new();
    let cpu0 = cpu_seconds();
    for _ in 0..10 {
        let t = Instant::now();
        driver.collect_hits().expect("collection");
        times.push(t.elapsed().as_secs_f64());
    }
    Collection {
        wall: median(times),
        cpu: (cpu_seconds() - cpu0) / 10.0,
    }
}

/// Inside a fresh namespace: program the state with the driver, time it, dump the result.
fn program(p: &Params, dump: &Path) {
    let spent = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut driver = LinuxDriver::new(
        options(p.nft),
        Box::new(Timing {
            inner: SystemRunner,
            spent: spent.clone(),
        }),
    );
    for m in state(p, 0) {
        driver.on_update(&m);
    }
    let t = Instant::now();
    driver.apply().expect("full apply");
    let full = t.elapsed().as_secs_f64();
    let full_kernel = driver.nft_stats().kernel_us as f64 / 1e6;
    let programmed = driver.programmed();
    let commands: f64 = spent.lock().iter().map(|(_, d)| d).sum();
    for (label, d) in spent.lock().drain(..) {
        eprintln!("  {:>8.1} ms  {label}", d * 1e3);
    }
    eprintln!(
        "  {:>8.1} ms  in the driver itself",
        (full - commands) * 1e3
    );

    // One-chain changes: one policy's inbound rules alternate between two versions.
    let base = state(p, 0);
    let changed = state(p, 1);
    let pick = |s: &[Message]| -> Message {
        s.iter()
            .find(|m| matches!(m, Message::PolicyUpdate { key, .. } if key.name == "policy-0000"))
            .cloned()
            .expect("policy-0000")
    };
    let (a, b) = (pick(&base), pick(&changed));
    let mut change_times = Vec::new();
    let mut change_kernel = Vec::new();
    for i in 0..20 {
        driver.on_update(if i % 2 == 0 { &b } else { &a });
        let t = Instant::now();
        driver.apply().expect("change apply");
        change_times.push(t.elapsed().as_secs_f64());
        change_kernel.push(driver.nft_stats().kernel_us as f64 / 1e6);
    }
    let hits = hit_collection(&mut driver);
    std::fs::create_dir_all(dump).expect("dump dir");
    if p.nft {
        let kernel = Kernel {
            full: full_kernel,
            change: median(change_kernel),
        };
        return nft_program_tail(&mut driver, dump, full, change_times, kernel, &spent, hits);
    }
    std::fs::write(dump.join("ipset.save"), sh("ipset save")).expect("write");
    std::fs::write(dump.join("v4.save"), sh("iptables-nft-save")).expect("write");
    std::fs::write(dump.join("v6.save"), sh("ip6tables-nft-save")).expect("write");
    // The one-chain transaction as the driver writes it (flush + rewrite of cali-pi-gnp/policy-0000).
    // The driver rewrites the chain in both families; so does the floor.
    let chain = "cali-pi-gnp/policy-0000";
    for (family, file) in [
        ("iptables", "change4.restore"),
        ("ip6tables", "change6.restore"),
    ] {
        let save = sh(&format!("{family}-nft-save -t filter"));
        let body: Vec<&str> = save
            .lines()
            .filter(|l| l.starts_with(&format!("-A {chain} ")))
            .collect();
        std::fs::write(
            dump.join(file),
            format!("*filter\n:{chain} - [0:0]\n{}\nCOMMIT\n", body.join("\n")),
        )
        .expect("write");
    }
    // Breakdown of the last change (stderr, for BENCH_VERBOSE).
    let last: f64 = *change_times.last().expect("changes");
    let commands: f64 = spent.lock().iter().rev().take(2).map(|(_, d)| d).sum();
    for (label, d) in spent.lock().iter().rev().take(2) {
        eprintln!("  change {:>8.2} ms  {label}", d * 1e3);
    }
    eprintln!(
        "  change {:>8.2} ms  in the driver itself",
        (last - commands) * 1e3
    );
    change_times.sort_by(f64::total_cmp);
    println!(
        "{{\"full_s\":{full},\"change_median_s\":{},\"collect_s\":{},\"collect_cpu_s\":{},\"rules\":{},\"ipsets\":{},\"members\":{}}}",
        change_times[change_times.len() / 2],
        hits.wall,
        hits.cpu,
        programmed.rules,
        programmed.ipsets,
        programmed.ipset_members
    );
}

/// The nftables half of `program`: one IP set member added and removed in turn (timed), then
/// the dump the floor restores: the whole ruleset, the one-chain transaction and the member
/// transactions, as bare `nft -f` input.
/// Seconds the kernel spent taking the nftables driver's batches (its commit runs inside the
/// netlink `send`): the full programming's, and the median one-chain change's.
struct Kernel {
    full: f64,
    change: f64,
}

fn nft_program_tail(
    driver: &mut LinuxDriver,
    dump: &Path,
    full: f64,
    mut change_times: Vec<f64>,
    kernel: Kernel,
    spent: &std::sync::Arc<parking_lot::Mutex<Vec<(String, f64)>>>,
    hits: Collection,
) {
    use felix_proto::IpSetDeltaUpdate;
    let member = "10.250.0.1".to_owned();
    let delta = |set: &str, add: bool| {
        msg(Payload::IpsetDeltaUpdate(IpSetDeltaUpdate {
            id: set.into(),
            added_members: if add { vec![member.clone()] } else { vec![] },
            removed_members: if add { vec![] } else { vec![member.clone()] },
        }))
    };
    // A workload address (exact set: netlink) and a network set member (interval set: nft -f).
    let mut member_times = Vec::new();
    let mut net_member_times = Vec::new();
    for (set, times) in [
        ("s:bench-pods", &mut member_times),
        ("s:bench-set-0000", &mut net_member_times),
    ] {
        let nft_set = format!("cali40{}", &set[..1]) + "-" + &set[2..];
        for i in 0..20 {
            driver.on_update(&delta(set, i % 2 == 0));
            let t = Instant::now();
            driver.apply().expect("member apply");
            times.push(t.elapsed().as_secs_f64());
            if i < 2 {
                // Not timed: the change is in the kernel (added, then removed).
                let listed = sh(&format!("nft list set ip calico {nft_set}"));
                assert_eq!(
                    listed.contains("10.250.0.1"),
                    i == 0,
                    "member change {i} of {nft_set} not in the kernel:\n{listed}"
                );
            }
        }
        for (label, d) in spent.lock().iter().rev().take(1) {
            eprintln!("  member {set} {:>8.2} ms  {label}", d * 1e3);
        }
    }
    let programmed = driver.programmed();
    let ruleset = format!(
        "{}\n{}",
        sh("nft list table ip calico"),
        sh("nft list table ip6 calico")
    );
    std::fs::write(dump.join("nft.save"), ruleset).expect("write");
    let chain = "filter-cali-pi-gnp/policy-0000";
    let mut change = String::new();
    // The fastest form nft reads: the flush, then the rules in block syntax.
    for fam in ["ip", "ip6"] {
        change.push_str(&format!(
            "flush chain {fam} calico {chain}\ntable {fam} calico {{\nchain {chain} {{\n"
        ));
        let listing = sh(&format!("nft list chain {fam} calico {chain}"));
        let mut inside = false;
        for line in listing.lines() {
            let l = line.trim();
            if l.starts_with("chain ") {
                inside = true;
            } else if l == "}" {
                inside = false;
            } else if inside && !l.is_empty() {
                change.push_str(&format!("{l}\n"));
            }
        }
        change.push_str("}\n}\n");
    }
    std::fs::write(dump.join("change.nft"), change).expect("write");
    for (file, op, set) in [
        ("add", "add", "cali40s-bench-pods"),
        ("del", "delete", "cali40s-bench-pods"),
        ("netadd", "add", "cali40s-bench-set-0000"),
        ("netdel", "delete", "cali40s-bench-set-0000"),
    ] {
        std::fs::write(
            dump.join(format!("{file}.nft")),
            format!("{op} element ip calico {set} {{ 10.250.0.1 }}\n"),
        )
        .expect("write");
    }
    change_times.sort_by(f64::total_cmp);
    println!(
        "{{\"full_s\":{full},\"change_median_s\":{},\"member_median_s\":{},\"net_member_median_s\":{},\"full_kernel_s\":{},\"change_kernel_s\":{},\"collect_s\":{},\"collect_cpu_s\":{},\"rules\":{},\"ipsets\":{},\"members\":{}}}",
        change_times[change_times.len() / 2],
        median(member_times),
        median(net_member_times),
        kernel.full,
        kernel.change,
        hits.wall,
        hits.cpu,
        programmed.rules,
        programmed.ipsets,
        programmed.ipset_members
    );
}

/// Inside another fresh namespace: `nft -f` of the nftables dump, its one-chain transaction
/// and its member transactions.
fn nft_floor(dump: &Path) {
    let d = dump.display();
    let full = timed(&format!("nft -f {d}/nft.save"));
    let mut change = Vec::new();
    let mut member = Vec::new();
    let mut net_member = Vec::new();
    for i in 0..20 {
        change.push(timed(&format!("nft -f {d}/change.nft")));
        let (file, net) = if i % 2 == 0 {
            ("add", "netadd")
        } else {
            ("del", "netdel")
        };
        member.push(timed(&format!("nft -f {d}/{file}.nft")));
        net_member.push(timed(&format!("nft -f {d}/{net}.nft")));
    }
    println!(
        "{{\"full_s\":{full},\"change_median_s\":{},\"member_median_s\":{},\"net_member_median_s\":{}}}",
        median(change),
        median(member),
        median(net_member)
    );
}

fn timed(cmd: &str) -> f64 {
    let t = Instant::now();
    let ok = Command::new("sh")
        .args(["-c", cmd])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("sh")
        .success();
    assert!(ok, "{cmd} failed");
    t.elapsed().as_secs_f64()
}

/// Inside another fresh namespace: restore the dump with the bare tools.
fn floor(dump: &Path) {
    let d = dump.display();
    let t = Instant::now();
    for cmd in [
        format!("ipset restore < {d}/ipset.save"),
        format!("iptables-nft-restore < {d}/v4.save"),
        format!("ip6tables-nft-restore < {d}/v6.save"),
    ] {
        let took = timed(&cmd);
        eprintln!("  floor {:>8.1} ms  {cmd}", took * 1e3);
    }
    let full = t.elapsed().as_secs_f64();
    let mut change = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        timed(&format!(
            "iptables-nft-restore --noflush < {d}/change4.restore"
        ));
        timed(&format!(
            "ip6tables-nft-restore --noflush < {d}/change6.restore"
        ));
        change.push(t.elapsed().as_secs_f64());
    }
    change.sort_by(f64::total_cmp);
    println!(
        "{{\"full_s\":{full},\"change_median_s\":{}}}",
        change[change.len() / 2]
    );
}

fn field(json: &str, key: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect("child JSON");
    v[key].as_f64().unwrap_or(0.0)
}

fn in_netns(tag: &str, args: &[String]) -> String {
    let ns = format!("sf-bench-{}-{tag}", std::process::id());
    sh(&format!("ip netns add {ns} && ip -n {ns} link set lo up"));
    let exe = std::env::current_exe().expect("exe");
    let out = Command::new("ip")
        .args(["netns", "exec", &ns])
        .arg(&exe)
        .args(args)
        .stderr(if std::env::var_os("BENCH_VERBOSE").is_some() {
            Stdio::inherit()
        } else {
            Stdio::piped()
        })
        .output()
        .expect("child");
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
    assert!(
        out.status.success(),
        "{tag}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Inside a fresh namespace: N veth interfaces, then the driver's route manager programs one
/// /32 per interface (timed), against `ip -batch` of the same routes (timed), alternately.
fn routes_bench(n: usize, runs: usize) {
    use dataplane_agent::driver::linux::bench::IpVersion;
    use dataplane_agent::driver::linux::bench::Routes;
    use dataplane_agent::driver::linux::bench::{Netlink, RouteEntry, RtNetlink};

    let mut batch = String::new();
    for i in 0..n {
        batch.push_str(&format!(
            "link add calib{i:06} type veth peer name calip{i:06}\nlink set calib{i:06} up\nlink set calip{i:06} up\n"
        ));
    }
    let setup = std::env::temp_dir().join(format!("sf-routes-setup-{}", std::process::id()));
    std::fs::write(&setup, batch).expect("write");
    sh(&format!("ip -batch {}", setup.display()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (ours, floor) = rt.block_on(async move {
        tokio::spawn(async move {
            tokio::task::block_in_place(|| {
                let mut nl = RtNetlink::connect().expect("netlink");
                let links = nl.links().expect("links");
                let mut desired = std::collections::BTreeSet::new();
                let mut lines = String::new();
                for l in links.iter().filter(|l| l.name.starts_with("calib")) {
                    let i: usize = l.name[5..].parse().expect("index");
                    let ip = format!("10.{}.{}.{}", 64 + i / 65536, (i / 256) % 256, i % 256);
                    desired.insert(RouteEntry {
                        dst: ip.parse().expect("ip"),
                        prefix: 32,
                        ifindex: l.index,
                    });
                    lines.push_str(&format!("route replace {ip}/32 dev {} proto 80\n", l.name));
                }
                let file = std::env::temp_dir().join(format!("sf-routes-{}", std::process::id()));
                std::fs::write(&file, lines).expect("write");
                let (mut ours, mut floor) = (Vec::new(), Vec::new());
                for _ in 0..runs {
                    let mut routes = Routes::new(80, vec![IpVersion::V4]);
                    let t = Instant::now();
                    let st = routes.apply(&mut nl, &desired).expect("routes");
                    ours.push(t.elapsed().as_secs_f64());
                    assert_eq!(st.added, desired.len());
                    sh("ip route flush proto 80");
                    floor.push(timed(&format!("ip -batch {}", file.display())));
                    sh("ip route flush proto 80");
                }
                (median(ours), median(floor))
            })
        })
        .await
        .expect("task")
    });
    println!("{{\"routes\":{n},\"driver_s\":{ours},\"floor_s\":{floor}}}");
}

/// One line on the cost of reading the rules' counters, against the 1 %-of-a-core budget at the
/// default 10 s interval.
fn print_collection(wall: f64, cpu: f64) {
    println!(
        "hit counter collection: {:.1} ms wall, {:.1} ms CPU (agent and tools) per collection, {:.2} % of one core at a 10 s interval (target <= 1 %)",
        wall * 1e3,
        cpu * 1e3,
        cpu / 10.0 * 100.0
    );
}

fn orchestrate(p: &Params) {
    let dump: PathBuf = std::env::temp_dir().join(format!("sf-linux-bench-{}", std::process::id()));
    let extra = |sizes: (usize, usize, usize)| -> Vec<String> {
        vec![
            "--endpoints".into(),
            sizes.0.to_string(),
            "--policies".into(),
            sizes.1.to_string(),
            "--members".into(),
            sizes.2.to_string(),
        ]
    };
    if p.nft {
        return nft_orchestrate(p, &dump, &extra);
    }
    for (label, sizes) in [
        ("small", (10, 20, 10_000)),
        ("full", (p.endpoints, p.policies, p.members)),
    ] {
        let mut ours_full = Vec::new();
        let mut ours_change = Vec::new();
        let mut floor_full = Vec::new();
        let mut floor_change = Vec::new();
        let mut collect = Vec::new();
        let mut collect_cpu = Vec::new();
        let mut shape = String::new();
        for run in 0..p.runs {
            let mut args = vec!["program".to_owned(), dump.display().to_string()];
            args.extend(extra(sizes));
            let ours = in_netns(&format!("p{run}"), &args);
            let theirs = in_netns(
                &format!("f{run}"),
                &["floor".to_owned(), dump.display().to_string()],
            );
            ours_full.push(field(&ours, "full_s"));
            ours_change.push(field(&ours, "change_median_s"));
            floor_full.push(field(&theirs, "full_s"));
            floor_change.push(field(&theirs, "change_median_s"));
            collect.push(field(&ours, "collect_s"));
            collect_cpu.push(field(&ours, "collect_cpu_s"));
            let v: serde_json::Value = serde_json::from_str(ours.trim()).expect("JSON");
            shape = format!(
                "{} endpoints, {} policies: {} rules (v4+v6), {} ipsets, {} members",
                sizes.0, sizes.1, v["rules"], v["ipsets"], v["members"]
            );
        }
        let (of, ff) = (median(ours_full), median(floor_full));
        let (oc, fc) = (median(ours_change), median(floor_change));
        println!("== {label}: {shape}");
        println!(
            "full programming: driver {:.1} ms, floor (ipset restore + iptables-restore x2) {:.1} ms, ratio {:.2}",
            of * 1e3,
            ff * 1e3,
            of / ff
        );
        println!(
            "one-chain change: driver {:.2} ms, floor (bare --noflush restores of that chain, v4 + v6) {:.2} ms, ratio {:.2}",
            oc * 1e3,
            fc * 1e3,
            oc / fc
        );
        print_collection(median(collect), median(collect_cpu));
    }
    let _ = std::fs::remove_dir_all(&dump);

    let out = in_netns(
        "routes",
        &[
            "routes".into(),
            "--endpoints".into(),
            "1000".into(),
            "--runs".into(),
            p.runs.to_string(),
        ],
    );
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    let (d, f) = (
        v["driver_s"].as_f64().unwrap_or(0.0),
        v["floor_s"].as_f64().unwrap_or(1.0),
    );
    println!("== routes: {} workload routes (one veth each)", v["routes"]);
    println!(
        "programming: driver (rtnetlink) {:.1} ms, floor (ip -batch of the same routes) {:.1} ms, ratio {:.2}",
        d * 1e3,
        f * 1e3,
        d / f
    );
}

/// `--driver nftables`: the same synthetic node at three sizes, so that the change costs can be
/// read against the ruleset size.
fn nft_orchestrate(p: &Params, dump: &Path, extra: &dyn Fn((usize, usize, usize)) -> Vec<String>) {
    for (label, sizes) in [
        ("1k rules", (5, 8, 1_000)),
        ("10k rules", (50, 80, 10_000)),
        ("100k rules", (p.endpoints, 800, p.members)),
    ] {
        let mut ours: [Vec<f64>; 4] = Default::default();
        let mut floor: [Vec<f64>; 4] = Default::default();
        let mut kernel: [Vec<f64>; 2] = Default::default();
        let mut collect: [Vec<f64>; 2] = Default::default();
        let mut shape = String::new();
        for run in 0..p.runs {
            let mut args = vec!["program".to_owned(), dump.display().to_string()];
            args.extend(extra(sizes));
            args.extend(["--driver".to_owned(), "nftables".to_owned()]);
            let o = in_netns(&format!("p{run}"), &args);
            let f = in_netns(
                &format!("f{run}"),
                &[
                    "floor".to_owned(),
                    dump.display().to_string(),
                    "--driver".to_owned(),
                    "nftables".to_owned(),
                ],
            );
            for (i, key) in [
                "full_s",
                "change_median_s",
                "member_median_s",
                "net_member_median_s",
            ]
            .iter()
            .enumerate()
            {
                ours[i].push(field(&o, key));
                floor[i].push(field(&f, key));
            }
            kernel[0].push(field(&o, "full_kernel_s"));
            kernel[1].push(field(&o, "change_kernel_s"));
            collect[0].push(field(&o, "collect_s"));
            collect[1].push(field(&o, "collect_cpu_s"));
            let v: serde_json::Value = serde_json::from_str(o.trim()).expect("JSON");
            shape = format!(
                "{} endpoints, {} policies: {} rules (v4+v6), {} sets, {} members",
                sizes.0, sizes.1, v["rules"], v["ipsets"], v["members"]
            );
        }
        let [of, oc, om, on] = ours.map(median);
        let [ff, fc, fm, fnet] = floor.map(median);
        let [kf, kc] = kernel.map(median);
        println!("== nftables, {label}: {shape}");
        println!(
            "full programming: driver {:.1} ms (kernel commit {:.1} ms), floor (nft -f of the same ruleset) {:.1} ms, ratio {:.2}",
            of * 1e3,
            kf * 1e3,
            ff * 1e3,
            of / ff
        );
        println!(
            "one-chain change: driver {:.2} ms (kernel commit {:.2} ms, the driver's own {:.2} ms), floor (nft -f flush + rules of that chain, block syntax, v4 + v6) {:.2} ms, ratio {:.2}",
            oc * 1e3,
            kc * 1e3,
            (oc - kc) * 1e3,
            fc * 1e3,
            oc / fc
        );
        println!(
            "one IP set member (workload address, netlink): driver {:.2} ms, floor (nft -f of one element) {:.2} ms, ratio {:.2}",
            om * 1e3,
            fm * 1e3,
            om / fm
        );
        println!(
            "one network set member (interval set, netlink): driver {:.2} ms, floor (nft -f of one element) {:.2} ms, ratio {:.2}",
            on * 1e3,
            fnet * 1e3,
            on / fnet
        );
        let [cw, cc] = collect.map(median);
        print_collection(cw, cc);
    }
    let _ = std::fs::remove_dir_all(dump);
}
