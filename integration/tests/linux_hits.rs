//! Policy hit counters on real packets: a host network namespace (one node, `node-a`) runs
//! calc-server (file datastore) and `dataplane-agent --stats-interval 200ms` (one test per
//! iptables backend, nft and legacy, and one for `--driver nftables`); a client and a server
//! workload hang off it
//! by veth pairs. One NetworkPolicy allows UDP 5001 from the client to the server, another
//! denies UDP 5002. The client sends 37 datagrams to 5001 and 5 to 5002, each on a new flow (a
//! source port of its own: only a flow's first packet reaches the policy rules). `calc-server
//! status --policies` must show HITS 37 and 5, equal to what the kernel's own counters of those
//! rules say (`iptables-save -c`, or `nft list chain` for the nftables driver: the policy
//! chains' rules that set the accept and drop marks).
//! A second rule then rewrites the allow policy's chain (its kernel counters start again from
//! zero); 10 more datagrams must bring its HITS to 47, nothing counted twice or lost. The
//! agent then restarts (the kernel keeps its counters): 10 more bring HITS to 57, the 10 it
//! had already reported not counted again.
//!
//! One node only: the namespace fixtures (`integration::netns::ControlPlane`) run one agent
//! beside its calc-server, so the sum over several nodes is left to the calc-server's unit
//! tests.
//!
//! Needs root, iptables (nft and legacy), ipset, nc, ping and nft: the tests are `#[ignore]`d
//! with that reason and `make test` runs them; a missing tool fails the test
//! (see `integration::netns::require`).

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use integration::netns::{
    ControlPlane, Driver, Ipt, Netns, Workload, namespace_profile, wait_until, wep_manifest,
    write_manifest,
};

/// What programs the node: the iptables driver on one backend, or the nftables driver.
#[derive(Clone, Copy, Debug)]
enum Plane {
    Iptables(Ipt),
    Nftables,
}

const NODE: &str = "node-a";
const ALLOWED_PORT: u16 = 5001;
const DENIED_PORT: u16 = 5002;
const ALLOW: &str = "prod/udp-allow";
const DENY: &str = "prod/udp-deny";
/// The policies' inbound chains (`cali-pi-` + kind/namespace/name).
const ALLOW_CHAIN: &str = "cali-pi-np/prod/udp-allow";
const DENY_CHAIN: &str = "cali-pi-np/prod/udp-deny";
/// The UDP payload of every datagram (the kernel counts IP packets: 20 + 8 + 16 bytes each).
const PAYLOAD: &[u8] = b"policy-hit-count";
const PACKET_BYTES: u64 = 20 + 8 + PAYLOAD.len() as u64;

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn policy_hits_match_the_kernel_counters_nft() {
    policy_hits_match_the_kernel_counters(Plane::Iptables(Ipt::Nft));
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn policy_hits_match_the_kernel_counters_legacy() {
    policy_hits_match_the_kernel_counters(Plane::Iptables(Ipt::Legacy));
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn policy_hits_match_the_kernel_counters_nftables_driver() {
    policy_hits_match_the_kernel_counters(Plane::Nftables);
}

/// `udp-allow` lets the client reach UDP 5001 on the server (with `second_rule`, also TCP 9999:
/// nothing uses it, it only makes the chain change); `udp-deny`, after it, drops UDP 5002.
fn policies(second_rule: bool) -> String {
    let extra = if second_rule {
        "  - action: Allow
    protocol: TCP
    source:
      selector: app == 'client'
    destination:
      ports: [9999]
"
    } else {
        ""
    };
    format!(
        "apiVersion: projectcalico.org/v3
kind: Tier
metadata: {{name: default}}
spec: {{order: 1000000, defaultAction: Deny}}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {{name: udp-allow, namespace: prod}}
spec:
  order: 10
  selector: app == 'server'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: UDP
    source:
      selector: app == 'client'
    destination:
      ports: [{ALLOWED_PORT}]
{extra}---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {{name: udp-deny, namespace: prod}}
spec:
  order: 20
  selector: app == 'server'
  types: [Ingress]
  ingress:
  - action: Deny
    protocol: UDP
    destination:
      ports: [{DENIED_PORT}]
"
    )
}

/// Runs `f` on a new thread that has entered `ns`'s network namespace (`setns` changes only
/// the calling thread), returning what it returns.
fn in_netns<T: Send + 'static>(ns: &Netns, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{}", ns.name);
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("namespace file");
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
    .join()
    .expect("namespace thread")
}

/// Sends one datagram from `from` to `to:port` for each source port in `sources`: a socket of
/// its own per datagram, bound to that port, so that each is a new conntrack flow.
fn send_flows(from: &Workload, to: &str, port: u16, sources: std::ops::Range<u16>) {
    let (src, dst) = (from.ipv4.clone(), to.to_owned());
    in_netns(&from.ns, move || {
        for sport in sources {
            let sock = UdpSocket::bind((src.as_str(), sport))
                .unwrap_or_else(|e| panic!("bind {src}:{sport}: {e}"));
            let sent = sock
                .send_to(PAYLOAD, (dst.as_str(), port))
                .unwrap_or_else(|e| panic!("send {src}:{sport} -> {dst}:{port}: {e}"));
            assert_eq!(sent, PAYLOAD.len());
        }
    });
}

/// The datagrams the server's sockets on 5001 and 5002 received (counted on threads inside the
/// server's namespace until the returned guard is dropped).
struct Receiver {
    counts: std::sync::Arc<[std::sync::atomic::AtomicU64; 2]>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Receiver {
    fn start(server: &Workload) -> Receiver {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let counts = std::sync::Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        for (slot, port) in [ALLOWED_PORT, DENIED_PORT].into_iter().enumerate() {
            let (addr, counts, stop) = (server.ipv4.clone(), counts.clone(), stop.clone());
            let sock = in_netns(&server.ns, move || {
                UdpSocket::bind((addr.as_str(), port)).expect("bind the server's port")
            });
            sock.set_read_timeout(Some(Duration::from_millis(100)))
                .expect("read timeout");
            std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::SeqCst) {
                    if let Ok((n, _)) = sock.recv_from(&mut buf) {
                        assert_eq!(&buf[..n], PAYLOAD);
                        counts[slot].fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        }
        Receiver { counts, stop }
    }

    /// Datagrams received on (5001, 5002).
    fn received(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        (
            self.counts[0].load(Ordering::SeqCst),
            self.counts[1].load(Ordering::SeqCst),
        )
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// `/status/policies` as `calc-server status --policies --json` prints it, run in the host
/// namespace (the admin endpoint listens on its loopback).
fn policy_rows(host: &Netns) -> Vec<serde_json::Value> {
    let bin = integration::binary("calc-server");
    let out = host.exec(&[
        bin.to_str().expect("UTF-8 path"),
        "status",
        "--server",
        "127.0.0.1:9099",
        "--policies",
        "--json",
    ]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status --policies --json: {e}\n{out}"))
}

/// The row of `name` (`NAMESPACE/NAME`, or `kns.<ns>` for a profile).
fn row<'a>(rows: &'a [serde_json::Value], name: &str) -> Option<&'a serde_json::Value> {
    rows.iter().find(|r| r["policy"] == name)
}

/// (hits, bytes) of a row; `None` while the server counts nothing for it.
fn hits_of(rows: &[serde_json::Value], name: &str) -> Option<(u64, u64)> {
    let r = row(rows, name)?;
    Some((r["hits"].as_u64()?, r["bytes"].as_u64()?))
}

/// Whether the server counts at least `n` packets for `name`.
fn at_least(rows: &[serde_json::Value], name: &str, n: u64) -> bool {
    hits_of(rows, name).is_some_and(|(h, _)| h >= n)
}

/// The (packets, bytes) of each of `names` once they hold still: the same in every answer for
/// one second (five of the agent's 200 ms reports), or the test fails naming the change.
fn settled<const N: usize>(host: &Netns, names: [&str; N]) -> [(u64, u64); N] {
    let read = || {
        let rows = policy_rows(host);
        names.map(|n| hits_of(&rows, n).unwrap_or_else(|| panic!("no hits for {n}")))
    };
    let first = read();
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(1) {
        let now = read();
        assert_eq!(now, first, "{names:?} still moving with no traffic");
    }
    first
}

/// The kernel's counters of a policy chain's rules that carry its verdicts: the rules that set
/// the accept (0x10000) or drop mark, one per proto rule, each counting every packet the rule
/// matched once (the `-j RETURN` / `-j DROP` gated on the mark would count the same packets
/// again). Summed over those rules, as (packets, bytes), from `iptables-save -c` (IPv4).
fn kernel_counts(host: &Netns, plane: Plane, chain: &str) -> (u64, u64) {
    let ipt = match plane {
        Plane::Iptables(ipt) => ipt,
        Plane::Nftables => return nft_counts(host, chain),
    };
    let save = host.exec(&[&ipt.tool(4, "save"), "-c", "-t", "filter"]);
    let prefix = format!("-A {chain} ");
    let mut total = (0, 0);
    let mut found = false;
    for line in save.lines() {
        let Some((counts, rule)) = line.strip_prefix('[').and_then(|l| l.split_once("] ")) else {
            continue;
        };
        if !rule.starts_with(&prefix) || !rule.contains("-j MARK --set-xmark") {
            continue;
        }
        let (p, b) = counts.split_once(':').expect("[packets:bytes]");
        total.0 += p.parse::<u64>().expect("packets");
        total.1 += b.parse::<u64>().expect("bytes");
        found = true;
    }
    assert!(found, "no verdict-mark rule in {chain}:\n{save}");
    total
}

/// The same under the nftables driver: the rules of `filter-<chain>` in `table ip calico` that
/// set the accept or drop mark, from their `counter` statements.
fn nft_counts(host: &Netns, chain: &str) -> (u64, u64) {
    let listing = host.exec(&[
        "nft",
        "list",
        "chain",
        "ip",
        "calico",
        &format!("filter-{chain}"),
    ]);
    let mut total = (0, 0);
    let mut found = false;
    for line in listing.lines().filter(|l| l.contains("meta mark set")) {
        let Some((_, rest)) = line.split_once("counter packets ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let p: u64 = words.next().and_then(|w| w.parse().ok()).expect("packets");
        assert_eq!(words.next(), Some("bytes"), "{line}");
        let b: u64 = words.next().and_then(|w| w.parse().ok()).expect("bytes");
        total.0 += p;
        total.1 += b;
        found = true;
    }
    assert!(found, "no verdict-mark rule in filter-{chain}:\n{listing}");
    total
}

/// The ruleset as the plane's own tool prints it, counters included.
fn kernel_listing(host: &Netns, plane: Plane) -> String {
    match plane {
        Plane::Iptables(ipt) => host.exec(&[&ipt.tool(4, "save"), "-c", "-t", "filter"]),
        Plane::Nftables => host.exec(&["nft", "list", "table", "ip", "calico"]),
    }
}

/// Everything worth reading when the counts are wrong.
fn diagnostics(host: &Netns, plane: Plane, cp: &ControlPlane) -> String {
    format!(
        "status rows:\n{}\nserver metrics:\n{}\nkernel ({plane:?}, counters):\n{}\nagent log:\n{}",
        serde_json::to_string_pretty(&policy_rows(host)).unwrap_or_default(),
        in_netns(host, || integration::http_get("127.0.0.1:9099", "/metrics"))
            .map(|(_, body)| body)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("calc_server_rule_stats"))
            .collect::<Vec<_>>()
            .join("\n"),
        kernel_listing(host, plane),
        cp.agent_log_text()
    )
}

fn policy_hits_match_the_kernel_counters(plane: Plane) {
    integration::netns::require();
    let started = Instant::now();
    let host = Netns::new("host");
    host.make_host();
    let client = Workload::attach(&host, "cali0client001", "10.65.0.1", "fd00:65::1");
    let server = Workload::attach(&host, "cali0server002", "10.65.0.2", "fd00:65::2");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut manifests = namespace_profile("prod", "prod");
    for (w, app) in [(&client, "client"), (&server, "server")] {
        manifests.push_str(
            &wep_manifest(NODE, "prod", app, &w.iface)
                .label("app", app)
                .calico_labels()
                .ipv4(&w.ipv4)
                .ipv6(&w.ipv6)
                .render(),
        );
    }
    write_manifest(dir.path(), "workloads.yaml", &manifests);
    write_manifest(dir.path(), "policies.yaml", &policies(false));
    let (driver, backend) = match plane {
        Plane::Iptables(ipt) => (Driver::Linux, ipt.name()),
        Plane::Nftables => (Driver::Nftables, "auto"),
    };
    let mut cp = ControlPlane::start_with_driver(
        driver,
        &host,
        dir.path(),
        NODE,
        &["--iptables-backend", backend, "--stats-interval", "200ms"],
    );
    cp.wait_programmed();
    let receiver = Receiver::start(&server);
    let diag = || diagnostics(&host, plane, &cp);

    // The agent's first read of the counters is only its baseline: anything counted before it
    // is never reported. A datagram from the client to the node (its egress profile allows it;
    // it reaches no policy of the server), on a new flow each poll, shows the agent is past it
    // once one of them is reported as a hit of the profile.
    let mut warmup = 30000..31000;
    wait_until(
        "the client's profile shows a hit (the agent reports what it counts)",
        Duration::from_secs(20),
        || {
            let sport = warmup.next().expect("a warm-up source port");
            send_flows(&client, "10.254.0.1", 9, sport..sport + 1);
            hits_of(&policy_rows(&host), "kns.prod").is_some_and(|(h, _)| h >= 1)
        },
        diag,
    );
    let ready = started.elapsed();
    let rows = policy_rows(&host);
    for name in [ALLOW, DENY] {
        assert_eq!(
            hits_of(&rows, name),
            Some((0, 0)),
            "{plane:?}: nothing reached {name} yet\n{}",
            diag()
        );
        assert!(row(&rows, name).expect("row")["last_hit"].is_null());
    }

    // 37 new flows to the allowed port, 5 to the denied one.
    let sent_at = Instant::now();
    send_flows(&client, &server.ipv4, ALLOWED_PORT, 40000..40037);
    send_flows(&client, &server.ipv4, DENIED_PORT, 41000..41005);
    wait_until(
        "the server received the 37 allowed datagrams",
        Duration::from_secs(10),
        || receiver.received().0 == 37,
        || format!("received {:?}\n{}", receiver.received(), diag()),
    );
    let want = |n: u64| (n, n * PACKET_BYTES);
    wait_until(
        "status shows every flow: at least 37 hits for udp-allow and 5 for udp-deny",
        Duration::from_secs(20),
        || {
            let rows = policy_rows(&host);
            at_least(&rows, ALLOW, 37) && at_least(&rows, DENY, 5)
        },
        diag,
    );
    let counted_after = sent_at.elapsed();
    let [allow, deny] = settled(&host, [ALLOW, DENY]);
    let kernel = [ALLOW_CHAIN, DENY_CHAIN].map(|c| kernel_counts(&host, plane, c));
    assert_eq!(
        kernel,
        [want(37), want(5)],
        "{plane:?}: the kernel counted each flow once, on the rule that decided it\n{}",
        diag()
    );
    assert_eq!(
        [allow, deny],
        kernel,
        "{plane:?}: (packets, bytes) of udp-allow and udp-deny in status against the kernel's \
         counters of their rules\n{}",
        diag()
    );
    assert_eq!(
        receiver.received(),
        (37, 0),
        "{plane:?}: only the allowed datagrams arrive"
    );

    // The table an operator reads: HITS and LAST-HIT close each line.
    let bin = integration::binary("calc-server");
    let table = host.exec(&[
        bin.to_str().expect("UTF-8 path"),
        "status",
        "--server",
        "127.0.0.1:9099",
        "--policies",
    ]);
    let cells = |name: &str| -> Vec<String> {
        table
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no line for {name}:\n{table}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    for (name, hits) in [(ALLOW, "37"), (DENY, "5")] {
        let c = cells(name);
        assert_eq!(c.len(), 9, "{table}");
        assert_eq!(c[6], "NetworkPolicy", "{table}");
        assert_eq!(c[7], hits, "{plane:?}: HITS of {name}:\n{table}");
        assert!(
            c[8].ends_with('Z') && c[8].contains('T'),
            "LAST-HIT: {table}"
        );
    }

    // A second rule rewrites udp-allow's chain: the kernel's counters of its rules start again
    // from zero. The 37 already reported stay; the next 10 flows add 10.
    write_manifest(dir.path(), "policies.yaml", &policies(true));
    wait_until(
        "udp-allow's chain is rewritten with its second rule",
        Duration::from_secs(20),
        || match plane {
            Plane::Iptables(ipt) => host
                .exec(&[&ipt.tool(4, "save"), "-t", "filter"])
                .lines()
                .any(|l| l.starts_with(&format!("-A {ALLOW_CHAIN} ")) && l.contains("9999")),
            Plane::Nftables => host
                .exec(&[
                    "nft",
                    "list",
                    "chain",
                    "ip",
                    "calico",
                    &format!("filter-{ALLOW_CHAIN}"),
                ])
                .contains("9999"),
        },
        diag,
    );
    assert_eq!(
        kernel_counts(&host, plane, ALLOW_CHAIN),
        (0, 0),
        "{plane:?}: the rewritten chain counts from zero"
    );
    send_flows(&client, &server.ipv4, ALLOWED_PORT, 40037..40047);
    wait_until(
        "the server received the 10 more datagrams",
        Duration::from_secs(10),
        || receiver.received().0 == 47,
        || format!("received {:?}\n{}", receiver.received(), diag()),
    );
    wait_until(
        "status shows every flow: at least 47 hits for udp-allow",
        Duration::from_secs(20),
        || at_least(&policy_rows(&host), ALLOW, 47),
        diag,
    );
    let [allow, deny] = settled(&host, [ALLOW, DENY]);
    let kernel_after = kernel_counts(&host, plane, ALLOW_CHAIN);
    assert_eq!(
        kernel_after,
        want(10),
        "{plane:?}: the kernel counted the 10 new flows once\n{}",
        diag()
    );
    let total = (kernel[0].0 + kernel_after.0, kernel[0].1 + kernel_after.1);
    assert_eq!(
        [allow, deny],
        [total, kernel[1]],
        "{plane:?}: udp-allow is its rules' {:?} from before its chain was rewritten plus the \
         {kernel_after:?} of the new chain; udp-deny unchanged\n{}",
        kernel[0],
        diag()
    );
    assert_eq!(total, want(47));
    assert_eq!(receiver.received(), (47, 0));

    // The agent restarts: the kernel keeps its counters (the chain is not rewritten), and the
    // new agent's first read is its baseline, so the 10 already reported are not sent again.
    cp.stop_agent();
    cp.start_agent(&host);
    cp.wait_programmed();
    let profile_before = hits_of(&policy_rows(&host), "kns.prod").map_or(0, |(h, _)| h);
    let mut warmup = 31000..32000;
    wait_until(
        "the restarted agent reports again (the client's profile gains a hit)",
        Duration::from_secs(20),
        || {
            let sport = warmup.next().expect("a warm-up source port");
            send_flows(&client, "10.254.0.1", 9, sport..sport + 1);
            hits_of(&policy_rows(&host), "kns.prod").is_some_and(|(h, _)| h > profile_before)
        },
        || diagnostics(&host, plane, &cp),
    );
    send_flows(&client, &server.ipv4, ALLOWED_PORT, 40047..40057);
    wait_until(
        "status shows the 10 flows sent after the restart: at least 57 hits for udp-allow",
        Duration::from_secs(20),
        || at_least(&policy_rows(&host), ALLOW, 57),
        || diagnostics(&host, plane, &cp),
    );
    let [allow, _] = settled(&host, [ALLOW, DENY]);
    assert_eq!(
        kernel_counts(&host, plane, ALLOW_CHAIN),
        want(20),
        "{plane:?}: the kernel kept counting across the agent's restart\n{}",
        diagnostics(&host, plane, &cp)
    );
    assert_eq!(
        allow,
        want(57),
        "{plane:?}: nothing counted twice across the agent's restart\n{}",
        diagnostics(&host, plane, &cp)
    );
    eprintln!(
        "{plane:?}: agent counting {ready:?} after start; 37+5 flows in status {counted_after:?} \
         after sending; whole test {:?}",
        started.elapsed()
    );
}
