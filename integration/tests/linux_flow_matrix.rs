//! Flow logs on real traffic between two nodes (issue 42's test matrix), for each driver: the
//! iptables driver (nft backend, and legacy), and the nftables driver.
//!
//! Two nodes as in `linux_hits.rs`: `node-a` and `node-b` are host namespaces linked by a veth
//! pair (10.253.0.1/30 in node-a, .2 in node-b), each routing the other's workload subnet over
//! it; `calc-server serve --flow-logs` runs in node-a's namespace and both agents (`--flow-logs
//! --flows-interval 1s`) dial it. Workloads: `client-a` (ns `prod`, 10.65.0.1) on node-a;
//! `web-b` (ns `prod`, 10.65.1.2) and `locked-b` (ns `locked`, 10.65.1.3, whose profile allows
//! egress only and which no policy selects) on node-b. Every case is asserted on what
//! `calc-server flows --output json` lists (one Goldmane `Flow` per line):
//!
//! 1. client-a → web-b:8080, allowed by `prod/web-allow` rule 0: a small client sends a known
//!    request and reads a known reply, then closes. Both reports are there with the same names
//!    (`Src` from node-a, `Dst` from node-b); each one's packets and bytes, both ways, are
//!    within one packet of what each node's kernel counted for the connection (an nft counter
//!    table of the test's own, in the forward hook) and at least the payloads; one connection
//!    started and, once conntrack forgot it (its TIME_WAIT shortened to 3 s), one completed.
//! 2. client-a → web-b:9091, denied by `prod/web-deny` rule 1: `Deny`, the enforced trace's last
//!    hit that policy and rule.
//! 3. client-a → web-b:9092, which no rule names: `Deny` by `EndOfTier` of tier `default`,
//!    triggered by `web-allow` (the first policy of the tier selecting web-b).
//! 4. client-a → locked-b:8080: no policy, a profile without ingress rules: `EndOfTier` of
//!    tier `__PROFILE__`.
//! 5. client-a → web-b:8081, allowed by `web-allow`, which the staged `prod/web-trial` would deny:
//!    `Allow`, with the staged policy's `Deny` in the pending trace.
//! 6. From node-a's own addresses (host traffic, no policy on node-a) to web-b:8080, allowed by
//!    `web-allow` rule 1: from 10.253.0.1 (in GlobalNetworkSet `node-links`) the source is that
//!    set, type `NetworkSet`, namespace `-`; from 10.98.0.7 (in NetworkSet `prod/partners`)
//!    that set; from 10.99.0.9 (in no set) `pvt`; from 8.8.8.8 (assigned on node-a's end of
//!    the link: there is no outside network here) `pub`, both type `Network`.
//!
//! Needs root, iptables, ipset, nc and nft: `#[ignore]`d with that reason and run by
//! `make test`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use integration::binary;
use integration::netns::{
    ControlPlane, Driver, Ipt, Netns, NodeAgent, Workload, link_nodes, namespace_profile,
    wait_until, wep_manifest, write_manifest,
};
use serde_json::Value;

/// What the client sends and what the server answers (one segment each way).
const REQUEST: &[u8] = &[b'q'; 1200];
const REPLY: &[u8] = &[b'r'; 700];
/// Ports of web-b: allowed; allowed and staged-denied; denied by a rule; by the tier's end.
const ALLOWED: u16 = 8080;
const STAGED: u16 = 8081;
const DENIED: u16 = 9091;
const UNMATCHED: u16 = 9092;

const CLIENT_A: &str = "10.65.0.1";
const WEB_B: &str = "10.65.1.2";
const LOCKED_B: &str = "10.65.1.3";
/// Addresses of node-a used as sources (case 6): in a GlobalNetworkSet (node-a's own end of the
/// link), in a NetworkSet, in no set (private), in no set (public).
const NODE_LINK_A: &str = "10.253.0.1";
const PARTNER: &str = "10.98.0.7";
const PRIVATE: &str = "10.99.0.9";
const PUBLIC: &str = "8.8.8.8";

/// Policies, staged policy, profile of `locked` and the network sets.
const RESOURCES: &str = "apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata: {name: web-trial, namespace: prod}
spec:
  stagedAction: Set
  order: 5
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Deny
    protocol: TCP
    destination: {ports: [8081]}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-allow, namespace: prod}
spec:
  order: 10
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {selector: app == 'client'}
    destination: {ports: [8080, 8081]}
  - action: Allow
    protocol: TCP
    source: {nets: [10.253.0.0/30, 10.98.0.0/24, 10.99.0.0/24, 8.8.8.8/32]}
    destination: {ports: [8080]}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-deny, namespace: prod}
spec:
  order: 20
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {selector: app == 'nobody'}
    destination: {ports: [7777]}
  - action: Deny
    protocol: TCP
    destination: {ports: [9091]}
---
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.locked}
spec:
  egress: [{action: Allow}]
  labelsToApply:
    pcns.projectcalico.org/name: locked
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkSet
metadata:
  name: node-links
  labels: {role: node-link}
spec:
  nets: [10.253.0.0/30]
---
apiVersion: projectcalico.org/v3
kind: NetworkSet
metadata:
  name: partners
  namespace: prod
  labels: {role: partner}
spec:
  nets: [10.98.0.0/24]
---
";

/// What programs both nodes.
#[derive(Clone, Copy, Debug)]
enum Plane {
    Iptables(Ipt),
    Nftables,
}

impl Plane {
    fn driver(self) -> (Driver, &'static str) {
        match self {
            Plane::Iptables(ipt) => (Driver::Linux, ipt.name()),
            Plane::Nftables => (Driver::Nftables, "auto"),
        }
    }

    /// The node's ruleset as the plane's tool prints it.
    fn listing(self, host: &Netns) -> String {
        match self {
            Plane::Iptables(ipt) => host.exec(&[&ipt.tool(4, "save"), "-c"]),
            Plane::Nftables => host.exec(&["nft", "list", "table", "ip", "calico"]),
        }
    }
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc): `make test` runs it"]
fn flow_matrix_iptables_nft() {
    flow_matrix(Plane::Iptables(Ipt::Nft));
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc): `make test` runs it"]
fn flow_matrix_iptables_legacy() {
    flow_matrix(Plane::Iptables(Ipt::Legacy));
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc): `make test` runs it"]
fn flow_matrix_nftables_driver() {
    flow_matrix(Plane::Nftables);
}

/// A TCP server inside a namespace: on each connection, reads the request to its end, answers
/// [`REPLY`] and closes. Stopped on drop.
struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(ns: &Netns, ports: &[u16]) -> Server {
        let path = format!("/var/run/netns/{}", ns.name);
        let ports = ports.to_vec();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("namespace file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let listeners: Vec<TcpListener> = ports
                .iter()
                .map(|p| {
                    let l = TcpListener::bind(("0.0.0.0", *p)).expect("bind");
                    l.set_nonblocking(true).expect("non-blocking");
                    l
                })
                .collect();
            ready_tx.send(()).expect("test waits");
            while !stopping.load(Ordering::SeqCst) {
                let mut idle = true;
                for l in &listeners {
                    if let Ok((stream, _)) = l.accept() {
                        idle = false;
                        std::thread::spawn(move || answer(stream));
                    }
                }
                if idle {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("server listening");
        Server {
            stop,
            thread: Some(thread),
        }
    }
}

fn answer(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut got = Vec::new();
    if stream.read_to_end(&mut got).is_ok() {
        let _ = stream.write_all(REPLY);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// From `from`'s namespace, connects to `to:port` (2 s), sends [`REQUEST`], closes its side and
/// reads the reply to its end: whether the whole exchange happened.
fn exchange(from: &Netns, to: &str, port: u16) -> Result<(), String> {
    let addr: SocketAddr = format!("{to}:{port}").parse().expect("address");
    from.run_in(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .map_err(|e| format!("connect {addr}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        s.write_all(REQUEST).map_err(|e| format!("send: {e}"))?;
        s.shutdown(std::net::Shutdown::Write)
            .map_err(|e| format!("shutdown: {e}"))?;
        let mut reply = Vec::new();
        s.read_to_end(&mut reply)
            .map_err(|e| format!("read: {e}"))?;
        if reply != REPLY {
            return Err(format!("reply of {} bytes", reply.len()));
        }
        Ok(())
    })
}

/// The flow listing as an operator reads it, traces included (for failures).
fn flow_table(host: &Netns) -> String {
    let cli = binary("calc-server");
    host.exec(&[
        cli.to_str().expect("utf-8 path"),
        "flows",
        "--server",
        "127.0.0.1:9099",
        "--trace",
    ])
}

/// A count as proto3 JSON writes it (a string; absent when zero).
fn count(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or(0)
}

/// The flow of `source` to `dest` port `port` reported by `reporter` (`Src`, `Dst`).
fn find<'a>(
    all: &'a [Value],
    source: &str,
    dest: &str,
    port: u16,
    reporter: &str,
) -> Option<&'a Value> {
    let port = port.to_string();
    let matching: Vec<&Value> = all
        .iter()
        .filter(|f| {
            let k = &f["Key"];
            k["source_name"] == source
                && k["dest_name"] == dest
                && k["dest_port"] == port.as_str()
                && k["reporter"] == reporter
        })
        .collect();
    assert!(
        matching.len() <= 1,
        "one flow per key over the window: {matching:#?}"
    );
    matching.first().copied()
}

/// A hit as (kind, name, namespace, tier, action, rule index).
fn hit(h: &Value) -> (&str, &str, &str, &str, &str, u64) {
    let text = |k: &str| h[k].as_str().unwrap_or("");
    (
        text("kind"),
        text("name"),
        text("namespace"),
        text("tier"),
        text("action"),
        count(&h["rule_index"]),
    )
}

fn enforced(f: &Value) -> &Vec<Value> {
    f["Key"]["policies"]["enforced_policies"]
        .as_array()
        .unwrap_or_else(|| panic!("an enforced trace: {f:#}"))
}

/// A counter table of the test's in `host` (`table inet sfcount`, forward hook, before any
/// filter): the kernel's own count of case 1's connection, each way.
fn install_counters(host: &Netns) {
    let rules = format!(
        "table inet sfcount {{
  chain counting {{
    type filter hook forward priority -300; policy accept;
    ip saddr {CLIENT_A} ip daddr {WEB_B} tcp dport {ALLOWED} counter
    ip saddr {WEB_B} ip daddr {CLIENT_A} tcp sport {ALLOWED} counter
  }}
}}
"
    );
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), rules).expect("write nft rules");
    host.exec(&["nft", "-f", file.path().to_str().expect("utf-8 path")]);
}

/// What `install_counters`' rules counted: (packets, bytes) client → web and web → client.
fn kernel_counts(host: &Netns) -> [(u64, u64); 2] {
    let listing = host.exec(&["nft", "list", "chain", "inet", "sfcount", "counting"]);
    let counts: Vec<(u64, u64)> = listing
        .lines()
        .filter_map(|l| l.split_once("counter packets "))
        .map(|(_, rest)| {
            let w: Vec<&str> = rest.split_whitespace().collect();
            (w[0].parse().expect("packets"), w[2].parse().expect("bytes"))
        })
        .collect();
    assert_eq!(counts.len(), 2, "{listing}");
    [counts[0], counts[1]]
}

/// Routes `nets` of `host` via `via` (the other node's end of the link).
fn route(host: &Netns, nets: &[&str], via: &str) {
    for net in nets {
        host.exec(&["ip", "route", "add", net, "via", via]);
    }
}

/// A workload of `node` (pod `pod` of namespace `ns`, label `app` its name without the node's
/// suffix) attached to `host` by `iface`, with its WorkloadEndpoint manifest.
fn workload(
    host: &Netns,
    node: &str,
    (ns, pod): (&str, &str),
    iface: &str,
    (ip, ip6): (&str, &str),
) -> (Workload, String) {
    let w = Workload::attach(host, iface, ip, ip6);
    let app = pod.trim_end_matches("-a").trim_end_matches("-b");
    let manifest = wep_manifest(node, ns, pod, iface)
        .label("app", app)
        .calico_labels()
        .ipv4(&w.ipv4)
        .ipv6(&w.ipv6)
        .render();
    (w, manifest)
}

/// Sets a conntrack timeout of `host` (they are per namespace once conntrack is loaded).
fn conntrack_sysctl(host: &Netns, key: &str, value: &str) {
    let path = format!("/proc/sys/net/netfilter/{key}");
    host.exec(&["sh", "-c", &format!("echo {value} > {path}")]);
}

fn flow_matrix(plane: Plane) {
    integration::netns::require();
    let started = Instant::now();
    let host_a = Netns::new("host");
    host_a.make_host();
    let host_b = Netns::new("host");
    host_b.make_host();
    let (addr_a, addr_b) = link_nodes(&host_a, &host_b);
    assert_eq!(addr_a, NODE_LINK_A);
    route(&host_a, &["10.65.1.0/24"], &addr_b);
    route(
        &host_b,
        &["10.65.0.0/24", "10.98.0.0/24", "10.99.0.0/24", "8.8.8.8/32"],
        &addr_a,
    );
    // node-a's other source addresses (case 6), on its end of the link.
    for ip in [PARTNER, PRIVATE, PUBLIC] {
        host_a.exec(&["ip", "addr", "add", &format!("{ip}/32"), "dev", "node0"]);
    }
    let listen = format!("{addr_a}:50051");
    let (client, m_client) = workload(
        &host_a,
        "node-a",
        ("prod", "client-a"),
        "cali0client001",
        (CLIENT_A, "fd00:65::1"),
    );
    let (web, m_web) = workload(
        &host_b,
        "node-b",
        ("prod", "web-b"),
        "cali0web000002",
        (WEB_B, "fd00:65:1::2"),
    );
    let (locked, m_locked) = workload(
        &host_b,
        "node-b",
        ("locked", "locked-b"),
        "cali0locked003",
        (LOCKED_B, "fd00:65:1::3"),
    );
    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(
        dir.path(),
        "workloads.yaml",
        &format!(
            "{}{m_client}{m_web}{m_locked}",
            namespace_profile("prod", "prod")
        ),
    );
    write_manifest(dir.path(), "resources.yaml", RESOURCES);
    let (driver, backend) = plane.driver();
    let flags = [
        "--flow-logs",
        "--flows-interval",
        "1s",
        "--iptables-backend",
        backend,
    ];
    let cp = ControlPlane::start_with_server(
        driver,
        &host_a,
        dir.path(),
        "node-a",
        &flags,
        &listen,
        &["--flow-logs"],
    );
    let agent_b = NodeAgent::start(
        &host_b,
        driver,
        &listen,
        "node-b",
        &flags,
        &dir.path().with_extension("agent-b.log"),
    );
    cp.wait_programmed();
    agent_b.wait_programmed(&cp.server_log);
    let diag = |what: &str| {
        format!(
            "{what}\n{plane:?}\nflows:\n{}\nnode-a agent log:\n{}\nnode-b agent log:\n{}\nserver log:\n{}\nnode-b ruleset:\n{}",
            flow_table(&host_a),
            cp.agent_log_text(),
            agent_b.log_text(),
            cp.server_log_text(),
            plane.listing(&host_b),
        )
    };
    let _web_server = Server::start(&web.ns, &[ALLOWED, STAGED, DENIED, UNMATCHED]);
    let _locked_server = Server::start(&locked.ns, &[ALLOWED]);
    install_counters(&host_a);
    install_counters(&host_b);
    // Conntrack forgets a closed connection 3 s after it closed (instead of 2 min), so that the
    // agents see it complete; the agents read conntrack every second, so they still see its
    // last counters first.
    for h in [&host_a, &host_b] {
        conntrack_sysctl(h, "nf_conntrack_tcp_timeout_time_wait", "3");
    }

    // The NFLOG rules are programmed with the policy; the agents bind the NFLOG groups at their
    // first read. The cases' traffic goes once both are past it: a warm-up exchange from
    // client-a to locked-b (case 4: locked-b's profile denies it) is reported by both nodes.
    wait_until(
        "the agents listen (a warm-up flow is reported)",
        Duration::from_secs(60),
        || {
            let _ = exchange(&client.ns, LOCKED_B, ALLOWED);
            wait_a_bit();
            let all = integration::netns::flow_listing(&host_a, "127.0.0.1:9099");
            ["Src", "Dst"]
                .iter()
                .all(|r| find(&all, "client-a", "locked-b", ALLOWED, r).is_some())
        },
        || diag("no warm-up flow"),
    );
    let ready = started.elapsed();

    // Case 1 and 5: allowed.
    exchange(&client.ns, WEB_B, ALLOWED)
        .unwrap_or_else(|e| panic!("{}", diag(&format!("8080 is allowed: {e}"))));
    exchange(&client.ns, WEB_B, STAGED)
        .unwrap_or_else(|e| panic!("{}", diag(&format!("8081 is allowed: {e}"))));
    // Cases 2 and 3: denied on node-b.
    for port in [DENIED, UNMATCHED] {
        assert!(
            exchange(&client.ns, WEB_B, port).is_err(),
            "{}",
            diag(&format!("{port} is denied"))
        );
    }
    // Case 6: node-a's addresses.
    for src in [NODE_LINK_A, PARTNER, PRIVATE, PUBLIC] {
        assert!(
            host_a.try_exec(&[
                "nc",
                "-z",
                "-w",
                "2",
                "-s",
                src,
                WEB_B,
                &ALLOWED.to_string()
            ]),
            "{}",
            diag(&format!("{src} -> web-b:8080 is allowed"))
        );
    }

    // Everything is reported: the allowed connection completed on both sides, and each other
    // case's flow is there.
    let names = [
        ("client-a", "web-b", ALLOWED, "Src"),
        ("client-a", "web-b", ALLOWED, "Dst"),
        ("client-a", "web-b", STAGED, "Dst"),
        ("client-a", "web-b", DENIED, "Dst"),
        ("client-a", "web-b", UNMATCHED, "Dst"),
        ("node-links", "web-b", ALLOWED, "Dst"),
        ("partners", "web-b", ALLOWED, "Dst"),
        ("pvt", "web-b", ALLOWED, "Dst"),
        ("pub", "web-b", ALLOWED, "Dst"),
    ];
    let mut all = Vec::new();
    wait_until(
        "every case's flow is listed, the allowed connection completed on both nodes",
        Duration::from_secs(90),
        || {
            all = integration::netns::flow_listing(&host_a, "127.0.0.1:9099");
            names
                .iter()
                .all(|(s, d, p, r)| find(&all, s, d, *p, r).is_some())
                && ["Src", "Dst"].iter().all(|r| {
                    find(&all, "client-a", "web-b", ALLOWED, r)
                        .is_some_and(|f| count(&f["num_connections_completed"]) >= 1)
                })
        },
        || diag("not every flow"),
    );
    // 1. Allowed, both reports, counted as the kernels counted (read now that the connection
    // is over: its last ACK may still have been on its way when the client returned).
    let kernel_a = kernel_counts(&host_a);
    let kernel_b = kernel_counts(&host_b);
    // Any wrong attribute: the logs and the listing too.
    if let Err(e) = std::panic::catch_unwind(|| check_cases(plane, &all, kernel_a, kernel_b)) {
        eprintln!("{}", diag("a case failed"));
        std::panic::resume_unwind(e);
    }
    eprintln!(
        "{plane:?}: both agents reporting {ready:?} after start; whole test {:?}; \
         kernels (client to web, web to client): node-a {kernel_a:?}, node-b {kernel_b:?}\n{}",
        started.elapsed(),
        flow_table(&host_a)
    );
}

/// Cases 1 to 6 on the listing `all`, with the kernels' counts of case 1's connection on node-a
/// and node-b ([`kernel_counts`]).
fn check_cases(plane: Plane, all: &[Value], kernel_a: [(u64, u64); 2], kernel_b: [(u64, u64); 2]) {
    let listed = || {
        all.iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let src = find(all, "client-a", "web-b", ALLOWED, "Src").expect("listed");
    let dst = find(all, "client-a", "web-b", ALLOWED, "Dst").expect("listed");
    for (f, reporter) in [(src, "Src"), (dst, "Dst")] {
        let k = &f["Key"];
        assert_eq!(
            (
                &k["source_namespace"],
                &k["source_type"],
                &k["dest_namespace"],
                &k["dest_type"],
                &k["proto"],
                &k["action"],
            ),
            (
                &Value::from("prod"),
                &Value::from("WorkloadEndpoint"),
                &Value::from("prod"),
                &Value::from("WorkloadEndpoint"),
                &Value::from("tcp"),
                &Value::from("Allow"),
            ),
            "{reporter}: {f:#}\n{}",
            listed()
        );
        assert_eq!(
            (
                count(&f["num_connections_started"]),
                count(&f["num_connections_completed"])
            ),
            (1, 1),
            "{reporter}: one connection, completed: {f:#}\n{}",
            listed()
        );
    }
    let last = enforced(dst).last().expect("a hit");
    assert_eq!(
        hit(last),
        (
            "CalicoNetworkPolicy",
            "web-allow",
            "prod",
            "default",
            "Allow",
            0
        ),
        "{dst:#}"
    );
    // The client's egress: no policy selects it, its namespace's profile allows.
    let last = enforced(src).last().expect("a hit");
    assert_eq!(
        (&last["kind"], &last["name"], &last["tier"], &last["action"]),
        (
            &Value::from("Profile"),
            &Value::from("kns.prod"),
            &Value::from("__PROFILE__"),
            &Value::from("Allow")
        ),
        "{src:#}"
    );
    // Counts: the destination receives what the client sent; the source receives the reply.
    let [a_to_web, a_to_client] = kernel_a;
    let [b_to_web, b_to_client] = kernel_b;
    let within_one_packet = |what: &str, got: (u64, u64), kernel: (u64, u64)| {
        let largest = 20 + 40 + REQUEST.len().max(REPLY.len()) as u64;
        assert!(
            got.0.abs_diff(kernel.0) <= 1 && got.1.abs_diff(kernel.1) <= largest,
            "{plane:?}: {what}: flow says {got:?} (packets, bytes), the kernel {kernel:?}\n{}",
            listed()
        );
    };
    let pair = |f: &Value, dir: &str| {
        (
            count(&f[format!("packets_{dir}")]),
            count(&f[format!("bytes_{dir}")]),
        )
    };
    within_one_packet("Dst in", pair(dst, "in"), b_to_web);
    within_one_packet("Dst out", pair(dst, "out"), b_to_client);
    within_one_packet("Src out", pair(src, "out"), a_to_web);
    within_one_packet("Src in", pair(src, "in"), a_to_client);
    // The kernels counted the payloads and at least a 40-byte header per packet.
    for (what, (p, b), payload) in [
        ("node-a to web", a_to_web, REQUEST.len()),
        ("node-a to client", a_to_client, REPLY.len()),
        ("node-b to web", b_to_web, REQUEST.len()),
        ("node-b to client", b_to_client, REPLY.len()),
    ] {
        assert!(
            p >= 3 && b >= payload as u64 + 40 * p,
            "{what}: {p} packets, {b} bytes for a payload of {payload}"
        );
    }
    assert_eq!(a_to_web, b_to_web, "both nodes forwarded the same packets");
    assert_eq!(
        a_to_client, b_to_client,
        "both nodes forwarded the same packets"
    );

    // 2. Denied by web-deny's rule 1.
    let f = find(all, "client-a", "web-b", DENIED, "Dst").expect("listed");
    assert_eq!(f["Key"]["action"], "Deny", "{f:#}");
    let last = enforced(f).last().expect("a hit");
    assert_eq!(
        hit(last),
        (
            "CalicoNetworkPolicy",
            "web-deny",
            "prod",
            "default",
            "Deny",
            1
        ),
        "{f:#}"
    );
    assert!(count(&f["packets_in"]) >= 1, "{f:#}");

    // 3. Denied by the end of tier default, triggered by web-allow.
    let f = find(all, "client-a", "web-b", UNMATCHED, "Dst").expect("listed");
    assert_eq!(f["Key"]["action"], "Deny", "{f:#}");
    let last = enforced(f).last().expect("a hit");
    assert_eq!(
        (&last["kind"], &last["tier"], &last["action"]),
        (
            &Value::from("EndOfTier"),
            &Value::from("default"),
            &Value::from("Deny")
        ),
        "{f:#}"
    );
    assert_eq!(
        (
            &last["trigger"]["kind"],
            &last["trigger"]["name"],
            &last["trigger"]["namespace"]
        ),
        (
            &Value::from("CalicoNetworkPolicy"),
            &Value::from("web-allow"),
            &Value::from("prod")
        ),
        "the trigger is the tier's first policy selecting web-b: {f:#}"
    );

    // 4. Denied because no profile matched.
    let f = find(all, "client-a", "locked-b", ALLOWED, "Dst").expect("listed");
    assert_eq!(f["Key"]["action"], "Deny", "{f:#}");
    assert_eq!(f["Key"]["dest_namespace"], "locked", "{f:#}");
    let last = enforced(f).last().expect("a hit");
    assert_eq!(
        (&last["kind"], &last["tier"], &last["action"]),
        (
            &Value::from("EndOfTier"),
            &Value::from("__PROFILE__"),
            &Value::from("Deny")
        ),
        "{f:#}"
    );

    // 5. Allowed, pending deny by the staged policy.
    let f = find(all, "client-a", "web-b", STAGED, "Dst").expect("listed");
    assert_eq!(f["Key"]["action"], "Allow", "{f:#}");
    let last = enforced(f).last().expect("a hit");
    assert_eq!(
        (&last["name"], &last["action"]),
        (&Value::from("web-allow"), &Value::from("Allow")),
        "{f:#}"
    );
    let pending = f["Key"]["policies"]["pending_policies"]
        .as_array()
        .unwrap_or_else(|| panic!("a pending trace: {f:#}"));
    let last = pending.last().expect("a pending hit");
    assert_eq!(
        hit(last),
        (
            "StagedNetworkPolicy",
            "web-trial",
            "prod",
            "default",
            "Deny",
            0
        ),
        "{f:#}"
    );
    assert!(
        !enforced(f).iter().any(|h| h["name"] == "web-trial"),
        "a staged policy is never enforced: {f:#}"
    );

    // 6. Sources named from network sets, else private or public.
    for (name, namespace, kind) in [
        ("node-links", "-", "NetworkSet"),
        ("partners", "prod", "NetworkSet"),
        ("pvt", "-", "Network"),
        ("pub", "-", "Network"),
    ] {
        let f = find(all, name, "web-b", ALLOWED, "Dst").expect("listed");
        let k = &f["Key"];
        assert_eq!(
            (&k["source_namespace"], &k["source_type"], &k["action"]),
            (
                &Value::from(namespace),
                &Value::from(kind),
                &Value::from("Allow")
            ),
            "{f:#}"
        );
        let last = enforced(f).last().expect("a hit");
        assert_eq!(
            (&last["name"], count(&last["rule_index"])),
            (&Value::from("web-allow"), 1),
            "{f:#}"
        );
    }
    // Host traffic of node-a has no policy there: node-a reports none of it.
    for name in ["node-links", "partners", "pvt", "pub"] {
        assert!(
            find(all, name, "web-b", ALLOWED, "Src").is_none(),
            "{name}: no source report\n{}",
            listed()
        );
    }
}

fn wait_a_bit() {
    std::thread::sleep(Duration::from_millis(800));
}
