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
//! 11 new flows to a port neither policy names (5003) fall off the end of tier `default` and
//! are dropped: `/status/verdicts` (and `status --verdicts`) shows end-of-tier, tier `default`,
//! ingress, with exactly 11 packets, equal to the kernel's counter of the server endpoint's
//! "Drop if no policies passed packet" line. The client's egress profile (`kns.prod`, no
//! policy selects the client's egress) decides every new flow of the client: with 13 more to
//! the node, its status row and rule move by exactly 11 + 13, as its kernel lines do.
//! A second rule then rewrites the allow policy's chain (its kernel counters start again from
//! zero); 10 more datagrams must bring its HITS to 47, nothing counted twice or lost. The
//! agent then restarts (the kernel keeps its counters): 10 more bring HITS to 57, the 10 it
//! had already reported not counted again.
//!
//! Then, with the same policies and flows, each count checked against the kernel's counters:
//! - two nodes (`node-a`, `node-b`: a host namespace, an agent and two workloads each; the
//!   server in node-a's namespace, node-b's agent dialing it over a link between the two), for
//!   the iptables driver (nft backend) and the nftables driver: status is the sum of the two
//!   kernels' counters, and `/status/policies/NAME` and `status --policy` name both nodes;
//! - calc-server restarts (`--hits-save-interval 1h`, then `200ms`), with flows while it is
//!   down: a graceful stop saves everything to `_hits.json`; a `kill -9` loses exactly what
//!   agents reported after the last save (operations.md, "Policy hit counters": agents do not
//!   send it again), while what the kernel counted while no server ran is reported to the next;
//! - a driver switch, `linux` → `nftables` → `linux` (each removes the other's rules once its
//!   own are in place): the sum of what each dataplane counted, nothing lost or counted twice.
//!
//! Needs root, iptables (nft and legacy), ipset, nc, ping and nft: the tests are `#[ignore]`d
//! with that reason and `make test` runs them; a missing tool fails the test
//! (see `integration::netns::require`).

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use integration::netns::{
    ControlPlane, Driver, Ipt, Netns, NodeAgent, Workload, client_and, link_nodes,
    namespace_profile, wait_until, wep_manifest, write_manifest,
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
/// The namespace profile of both workloads, its status row, and its inbound and outbound
/// chains.
const PROFILE: &str = "kns.prod";
const PROFILE_IN_CHAIN: &str = "cali-pri-kns.prod";
const PROFILE_OUT_CHAIN: &str = "cali-pro-kns.prod";
/// A port of the server that neither policy names: its flows fall off the end of tier
/// `default` and are dropped there.
const UNMATCHED_PORT: u16 = 5003;
/// TCP port `tcp-allow` opens on the server.
const TCP_PORT: u16 = 5004;
const TCP_ALLOW: &str = "prod/tcp-allow";
const TCP_CHAIN: &str = "cali-pi-np/prod/tcp-allow";
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
metadata: {{name: tcp-allow, namespace: prod}}
spec:
  order: 15
  selector: app == 'server'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: app == 'client'
    destination:
      ports: [{TCP_PORT}]
---
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

/// Sends one datagram from `from` to `to:port` for each source port in `sources`: a socket of
/// its own per datagram, bound to that port, so that each is a new conntrack flow.
fn send_flows(from: &Workload, to: &str, port: u16, sources: std::ops::Range<u16>) {
    let (src, dst) = (from.ipv4.clone(), to.to_owned());
    from.ns.run_in(move || {
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
            let sock = server.ns.run_in(move || {
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
/// again). Summed over those rules, as (packets, bytes), from `iptables-save -c` (IPv4), or
/// `nft list chain` for the nftables driver.
fn kernel_counts(host: &Netns, plane: Plane, chain: &str) -> (u64, u64) {
    let (total, found) = line_counts(host, plane, 4, chain, |rule| match plane {
        Plane::Iptables(_) => rule.contains("-j MARK --set-xmark"),
        Plane::Nftables => rule.contains("meta mark set"),
    });
    assert!(found > 0, "{plane:?}: no verdict-mark rule in {chain}");
    total
}

/// The kernel's counters of the rules of `chain` (IPv4 or IPv6, `family` 4 or 6) that
/// `select` picks, summed as (packets, bytes), with how many rules it picked (0 when the chain
/// is absent). iptables: `<tool>-save -c` lines `[p:b] -A <chain> …`; nftables: the rules of
/// `filter-<chain>` in `table ip[6] calico`, from their `counter` statements.
fn line_counts(
    host: &Netns,
    plane: Plane,
    family: u8,
    chain: &str,
    select: impl Fn(&str) -> bool,
) -> ((u64, u64), usize) {
    let mut total = (0, 0);
    let mut found = 0;
    let mut add_line = |p: &str, b: &str, line: &str| {
        total.0 += p
            .parse::<u64>()
            .unwrap_or_else(|e| panic!("packets: {e}: {line}"));
        total.1 += b
            .parse::<u64>()
            .unwrap_or_else(|e| panic!("bytes: {e}: {line}"));
        found += 1;
    };
    match plane {
        Plane::Iptables(ipt) => {
            let save = host.exec(&[&ipt.tool(family, "save"), "-c", "-t", "filter"]);
            let prefix = format!("-A {chain} ");
            for line in save.lines() {
                let Some((counts, rule)) = line.strip_prefix('[').and_then(|l| l.split_once("] "))
                else {
                    continue;
                };
                if !rule.starts_with(&prefix) || !select(rule) {
                    continue;
                }
                let (p, b) = counts.split_once(':').expect("[packets:bytes]");
                add_line(p, b, line);
            }
        }
        Plane::Nftables => {
            let table = if family == 6 { "ip6" } else { "ip" };
            let chains = host.exec(&["nft", "list", "table", table, "calico"]);
            if !chains.contains(&format!("chain filter-{chain} {{")) {
                return (total, 0);
            }
            let listing = host.exec(&[
                "nft",
                "list",
                "chain",
                table,
                "calico",
                &format!("filter-{chain}"),
            ]);
            for line in listing.lines().filter(|l| select(l)) {
                let Some((_, rest)) = line.split_once("counter packets ") else {
                    continue;
                };
                let mut words = rest.split_whitespace();
                let p = words.next().expect("packets");
                assert_eq!(words.next(), Some("bytes"), "{line}");
                let b = words.next().expect("bytes");
                add_line(p, b, line);
            }
        }
    }
    (total, found)
}

/// The kernel's counter of the line that drops what falls off the end of the server
/// endpoint's tier (the one line of its `cali-tw-<iface>` chain commented "Drop if no
/// policies passed packet", IPv4): the line the agent counts as the tier's end.
fn end_of_tier_counts(host: &Netns, plane: Plane, iface: &str) -> (u64, u64) {
    let chain = format!("cali-tw-{iface}");
    let (total, found) = line_counts(host, plane, 4, &chain, |rule| {
        rule.contains("Drop if no policies passed packet")
            && match plane {
                Plane::Iptables(_) => rule.ends_with("-j DROP"),
                Plane::Nftables => rule.contains(" drop comment \""),
            }
    });
    assert_eq!(
        found,
        1,
        "{plane:?}: one end-of-tier drop line in {chain}:\n{}",
        kernel_listing(host, plane)
    );
    total
}

/// The kernel's counters of the profile `kns.prod`'s verdict lines (the rules of its inbound
/// and outbound chains that set the accept mark), IPv4 and IPv6: everything its status row
/// sums.
fn profile_kernel_counts(host: &Netns, plane: Plane) -> (u64, u64) {
    let mut total = (0, 0);
    let mut found = 0;
    for family in [4, 6] {
        for chain in [PROFILE_IN_CHAIN, PROFILE_OUT_CHAIN] {
            let (t, n) = line_counts(host, plane, family, chain, |rule| match plane {
                Plane::Iptables(_) => rule.contains("-j MARK --set-xmark"),
                Plane::Nftables => rule.contains("meta mark set"),
            });
            total = add(total, t);
            found += n;
        }
    }
    assert!(
        found >= 2,
        "{plane:?}: the profile's allow lines:\n{}",
        kernel_listing(host, plane)
    );
    total
}

/// (packets, bytes) of `kns.prod`'s egress rule 0 in `/status/policies/kns.prod`, (0, 0) while
/// it counted nothing.
fn profile_egress_rule(host: &Netns) -> (u64, u64) {
    let detail = policy_detail(host, PROFILE);
    let rules = detail["rules"].as_array().expect("rules");
    let egress: Vec<_> = rules
        .iter()
        .filter(|r| r["direction"] == "egress" && r["index"] == 0)
        .collect();
    assert_eq!(egress.len(), 1, "{PROFILE}: {detail:#}");
    (
        egress[0]["packets"].as_u64().expect("packets"),
        egress[0]["bytes"].as_u64().expect("bytes"),
    )
}

/// `/status/verdicts` as JSON (the dataplane's own verdicts that counted something).
fn verdict_rows(host: &Netns) -> Vec<serde_json::Value> {
    let (code, body) = host
        .run_in(|| integration::http_get("127.0.0.1:9099", "/status/verdicts"))
        .expect("the admin endpoint answers");
    assert_eq!(code, 200, "/status/verdicts: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/status/verdicts: {e}\n{body}"))
}

/// (packets, bytes) of the end-of-tier row of tier `default`, ingress; `None` while absent.
fn end_of_tier_hits(rows: &[serde_json::Value]) -> Option<(u64, u64)> {
    let mut matching = rows.iter().filter(|r| {
        r["verdict"] == "end-of-tier" && r["tier"] == "default" && r["direction"] == "ingress"
    });
    let r = matching.next()?;
    assert!(
        matching.next().is_none(),
        "one row per tier and direction: {rows:?}"
    );
    Some((r["packets"].as_u64()?, r["bytes"].as_u64()?))
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
        host.run_in(|| integration::http_get("127.0.0.1:9099", "/metrics"))
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
    let dir = tempfile::tempdir().expect("temp dir");
    let (client, mut server) = client_and(&host, NODE, "server", "cali0server002", dir.path());
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
    let [allow, deny, profile_before] = settled(&host, [ALLOW, DENY, PROFILE]);
    let profile_kernel_before = profile_kernel_counts(&host, plane);
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

    // The dataplane's own verdict and a profile, exactly. 11 new flows to a port neither
    // policy names fall off the end of tier `default` (its policies select the server) and are
    // dropped there; 13 new flows from the client to the node reach no policy. The client's
    // egress has no policy: its profile decides every new flow it sends, the 11 as well as
    // the 13 (and, before, the warm-up and the 37 + 5). The end-of-tier line has counted
    // nothing yet (the server got nothing but 5001 and 5002), so its row must show exactly
    // the 11, as its kernel line does; the profile's counters (status, and the kernel's lines)
    // already hold the warm-up, so both must move by exactly 11 + 13.
    assert_eq!(
        end_of_tier_counts(&host, plane, &server.iface),
        (0, 0),
        "{plane:?}: nothing fell off the end of tier default yet\n{}",
        diag()
    );
    assert_eq!(
        end_of_tier_hits(&verdict_rows(&host)),
        None,
        "{plane:?}: no end-of-tier row before any flow fell off the tier\n{}",
        diag()
    );
    let profile_rule_before = profile_egress_rule(&host);
    const DROPPED: u64 = 11;
    const PROFILED: u64 = 13;
    send_flows(
        &client,
        &server.ipv4,
        UNMATCHED_PORT,
        42000..42000 + DROPPED as u16,
    );
    send_flows(&client, "10.254.0.1", 9, 33000..33000 + PROFILED as u16);
    wait_until(
        "status shows every flow: 11 end-of-tier drops and 24 more profile hits",
        Duration::from_secs(20),
        || {
            end_of_tier_hits(&verdict_rows(&host)).is_some_and(|(p, _)| p >= DROPPED)
                && at_least(
                    &policy_rows(&host),
                    PROFILE,
                    profile_before.0 + PROFILED + DROPPED,
                )
        },
        diag,
    );
    let verdict_of = |rows: Vec<serde_json::Value>| {
        end_of_tier_hits(&rows).unwrap_or_else(|| panic!("no end-of-tier row: {rows:#?}"))
    };
    // One second with no change (see `settled`) for the profile and the policies, the
    // end-of-tier row the same before and after it.
    let dropped = verdict_of(verdict_rows(&host));
    let [allow_now, deny_now, profile_after] = settled(&host, [ALLOW, DENY, PROFILE]);
    assert_eq!(
        verdict_of(verdict_rows(&host)),
        dropped,
        "{plane:?}: the end-of-tier row still moving with no traffic"
    );
    let kernel_dropped = end_of_tier_counts(&host, plane, &server.iface);
    assert_eq!(
        kernel_dropped,
        want(DROPPED),
        "{plane:?}: the kernel's end-of-tier line counted each unmatched flow once\n{}",
        diag()
    );
    assert_eq!(
        dropped,
        kernel_dropped,
        "{plane:?}: /status/verdicts end-of-tier (tier default, ingress) against the kernel's \
         counter of its line\n{}",
        diag()
    );
    let profile_kernel_after = profile_kernel_counts(&host, plane);
    let delta = |a: (u64, u64), b: (u64, u64)| (a.0 - b.0, a.1 - b.1);
    let profile_kernel = delta(profile_kernel_after, profile_kernel_before);
    assert_eq!(
        profile_kernel,
        want(DROPPED + PROFILED),
        "{plane:?}: the kernel's profile lines counted each new flow of the client once (before \
         {profile_kernel_before:?}, after {profile_kernel_after:?})\n{}",
        diag()
    );
    assert_eq!(
        delta(profile_after, profile_before),
        profile_kernel,
        "{plane:?}: {PROFILE} in status (before {profile_before:?}, after {profile_after:?}) \
         moved as its kernel lines did\n{}",
        diag()
    );
    assert_eq!(
        delta(profile_egress_rule(&host), profile_rule_before),
        want(DROPPED + PROFILED),
        "{plane:?}: /status/policies/{PROFILE}: its egress rule 0 moved by the 11 + 13\n{}",
        diag()
    );
    assert_eq!(
        [allow_now, deny_now],
        [allow, deny],
        "{plane:?}: neither policy counted those flows"
    );
    assert_eq!(receiver.received(), (37, 0));
    let verdicts = host.exec(&[
        bin.to_str().expect("UTF-8 path"),
        "status",
        "--server",
        "127.0.0.1:9099",
        "--verdicts",
    ]);
    let line: Vec<&str> = verdicts
        .lines()
        .find(|l| l.starts_with("end-of-tier "))
        .unwrap_or_else(|| panic!("no end-of-tier line:\n{verdicts}"))
        .split_whitespace()
        .collect();
    assert_eq!(
        line,
        [
            "end-of-tier",
            "default",
            "ingress",
            "deny",
            &DROPPED.to_string(),
            &(DROPPED * PACKET_BYTES).to_string(),
            line[6],
            NODE
        ],
        "{plane:?}:\n{verdicts}"
    );
    assert!(
        line[6].ends_with('Z') && line[6].contains('T'),
        "LAST-HIT: {verdicts}"
    );

    // TCP connections: the policy's rule sees each connection's first packet only (the rest
    // is accepted as established before any policy), so 7 connections are 7 packets there.
    const CONNECTIONS: u64 = 7;
    server.listen(TCP_PORT);
    assert_eq!(hits_of(&policy_rows(&host), TCP_ALLOW), Some((0, 0)));
    for _ in 0..CONNECTIONS {
        assert!(
            client.connects(&server.ipv4, TCP_PORT),
            "{plane:?}: tcp-allow lets the client connect\n{}",
            diag()
        );
    }
    wait_until(
        "status shows the 7 TCP connections on tcp-allow",
        Duration::from_secs(20),
        || at_least(&policy_rows(&host), TCP_ALLOW, CONNECTIONS),
        diag,
    );
    let [tcp] = settled(&host, [TCP_ALLOW]);
    let tcp_kernel = kernel_counts(&host, plane, TCP_CHAIN);
    assert_eq!(
        tcp_kernel.0,
        CONNECTIONS,
        "{plane:?}: the kernel counted each connection's first packet once on tcp-allow's rule\n{}",
        diag()
    );
    assert_eq!(
        tcp,
        tcp_kernel,
        "{plane:?}: (packets, bytes) of tcp-allow in status against the kernel's counter of its \
         rule\n{}",
        diag()
    );

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

// ---------------------------------------------------------------------------------------------
// Two nodes, a calc-server restart and a driver switch: the same policies and flows, the same
// comparison with the kernel's counters, summed over the nodes and dataplanes that counted.

/// A node's two workloads (`client-<n>` and `server-<n>`, ns `prod`) on `host`, addresses
/// 10.65.`subnet`.1 and .2; their WorkloadEndpoint manifests for `node`.
fn node_workloads(host: &Netns, node: &str, subnet: u8) -> (Workload, Workload, String) {
    let client = Workload::attach(
        host,
        "cali0client001",
        &format!("10.65.{subnet}.1"),
        &format!("fd00:65:{subnet}::1"),
    );
    let server = Workload::attach(
        host,
        "cali0server002",
        &format!("10.65.{subnet}.2"),
        &format!("fd00:65:{subnet}::2"),
    );
    let suffix = node.trim_start_matches("node-");
    let mut manifests = String::new();
    for (w, app) in [(&client, "client"), (&server, "server")] {
        manifests.push_str(
            &wep_manifest(node, "prod", &format!("{app}-{suffix}"), &w.iface)
                .label("app", app)
                .calico_labels()
                .ipv4(&w.ipv4)
                .ipv6(&w.ipv6)
                .render(),
        );
    }
    (client, server, manifests)
}

/// The profile's hits in status (0 while none).
fn profile_hits(admin: &Netns) -> u64 {
    hits_of(&policy_rows(admin), "kns.prod").map_or(0, |(h, _)| h)
}

/// Sends a datagram from `client` to its node (its profile allows it), on a new flow each
/// poll from `sports`, until the profile's hits in status (read in `admin`) pass what they
/// were: the agent of `client`'s node is connected, past its baseline read and reporting.
fn warm_up(
    admin: &Netns,
    client: &Workload,
    sports: std::ops::Range<u16>,
    what: &str,
    diag: impl FnOnce() -> String,
) {
    let before = profile_hits(admin);
    let mut sports = sports;
    wait_until(
        what,
        Duration::from_secs(30),
        || {
            let sport = sports.next().expect("a warm-up source port");
            send_flows(client, "10.254.0.1", 9, sport..sport + 1);
            policy_rows_if_up(admin)
                .is_some_and(|rows| hits_of(&rows, "kns.prod").is_some_and(|(h, _)| h > before))
        },
        diag,
    );
}

/// [`policy_rows`], or `None` while the admin endpoint does not answer (a server restarting).
fn policy_rows_if_up(host: &Netns) -> Option<Vec<serde_json::Value>> {
    let out = host.run_in(|| integration::http_get("127.0.0.1:9099", "/status/policies"))?;
    match out {
        (200, body) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// `/status/policies/<name>` (one policy, with its `rules`) as JSON.
fn policy_detail(host: &Netns, name: &str) -> serde_json::Value {
    let path = format!("/status/policies/{name}");
    let (code, body) = host
        .run_in(move || integration::http_get("127.0.0.1:9099", &path))
        .expect("the admin endpoint answers");
    assert_eq!(code, 200, "/status/policies/{name}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/status/policies/{name}: {e}\n{body}"))
}

/// Sends `allowed` and `denied` new flows from `client` to `server` (source ports from
/// `base` and `base + 1000`) and waits until `receiver` has all the allowed ones (`expected`
/// in total on that receiver).
fn traffic(
    client: &Workload,
    server: &Workload,
    receiver: &Receiver,
    base: u16,
    (allowed, denied): (u16, u16),
    expected: u64,
    diag: impl FnOnce() -> String,
) {
    send_flows(client, &server.ipv4, ALLOWED_PORT, base..base + allowed);
    send_flows(
        client,
        &server.ipv4,
        DENIED_PORT,
        base + 1000..base + 1000 + denied,
    );
    wait_until(
        &format!("{} received {expected} allowed datagrams", server.ipv4),
        Duration::from_secs(10),
        || receiver.received().0 == expected,
        || format!("received {:?}\n{}", receiver.received(), diag()),
    );
}

/// Waits until status shows at least `allow` and `deny` packets for the two policies, then
/// returns their settled (packets, bytes).
fn counted(admin: &Netns, allow: u64, deny: u64, diag: impl FnOnce() -> String) -> [(u64, u64); 2] {
    wait_until(
        &format!("status shows at least {allow} hits for udp-allow and {deny} for udp-deny"),
        Duration::from_secs(20),
        || {
            policy_rows_if_up(admin)
                .is_some_and(|rows| at_least(&rows, ALLOW, allow) && at_least(&rows, DENY, deny))
        },
        diag,
    );
    settled(admin, [ALLOW, DENY])
}

fn add(a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
    (a.0 + b.0, a.1 + b.1)
}

fn want(n: u64) -> (u64, u64) {
    (n, n * PACKET_BYTES)
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn two_nodes_sum_their_kernel_counters_nft() {
    two_nodes_sum_their_kernel_counters(Plane::Iptables(Ipt::Nft));
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn two_nodes_sum_their_kernel_counters_nftables_driver() {
    two_nodes_sum_their_kernel_counters(Plane::Nftables);
}

/// The agent flags of `plane`: its driver, and `--iptables-backend` with a 200 ms stats
/// interval.
fn plane_flags(plane: Plane) -> (Driver, [&'static str; 4]) {
    match plane {
        Plane::Iptables(ipt) => (
            Driver::Linux,
            [
                "--iptables-backend",
                ipt.name(),
                "--stats-interval",
                "200ms",
            ],
        ),
        Plane::Nftables => (
            Driver::Nftables,
            ["--iptables-backend", "auto", "--stats-interval", "200ms"],
        ),
    }
}

/// Two nodes (`node-a`, `node-b`), each a host namespace with an agent and a client and a
/// server workload; one calc-server in node-a's namespace, which node-b's agent dials over a
/// link between the two. 37 allowed and 5 denied flows on node-a, 23 and 3 on node-b: status
/// shows 60 and 8, the sum of the two kernels' counters, and each policy's rule lists both
/// nodes.
fn two_nodes_sum_their_kernel_counters(plane: Plane) {
    integration::netns::require();
    let started = Instant::now();
    let host_a = Netns::new("host");
    host_a.make_host();
    let host_b = Netns::new("host");
    host_b.make_host();
    let (addr_a, _) = link_nodes(&host_a, &host_b);
    let listen = format!("{addr_a}:50051");
    let (client_a, server_a, weps_a) = node_workloads(&host_a, "node-a", 0);
    let (client_b, server_b, weps_b) = node_workloads(&host_b, "node-b", 1);
    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(
        dir.path(),
        "workloads.yaml",
        &format!("{}{weps_a}{weps_b}", namespace_profile("prod", "prod")),
    );
    write_manifest(dir.path(), "policies.yaml", &policies(false));
    let (driver, flags) = plane_flags(plane);
    let cp = ControlPlane::start_with_server(
        driver,
        &host_a,
        dir.path(),
        "node-a",
        &flags,
        &listen,
        &[],
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
    let diag = || {
        format!(
            "{}\nnode-b kernel:\n{}\nnode-b agent log:\n{}",
            diagnostics(&host_a, plane, &cp),
            kernel_listing(&host_b, plane),
            agent_b.log_text()
        )
    };
    let receiver_a = Receiver::start(&server_a);
    let receiver_b = Receiver::start(&server_b);
    warm_up(
        &host_a,
        &client_a,
        30000..31000,
        "node-a's agent reports",
        diag,
    );
    warm_up(
        &host_a,
        &client_b,
        30000..31000,
        "node-b's agent reports",
        diag,
    );
    let ready = started.elapsed();
    assert_eq!(
        [ALLOW, DENY].map(|n| hits_of(&policy_rows(&host_a), n)),
        [Some((0, 0)); 2],
        "{plane:?}: nothing reached the policies yet\n{}",
        diag()
    );

    traffic(&client_a, &server_a, &receiver_a, 40000, (37, 5), 37, diag);
    traffic(&client_b, &server_b, &receiver_b, 40000, (23, 3), 23, diag);
    let [allow, deny] = counted(&host_a, 60, 8, diag);
    let kernel_a = [ALLOW_CHAIN, DENY_CHAIN].map(|c| kernel_counts(&host_a, plane, c));
    let kernel_b = [ALLOW_CHAIN, DENY_CHAIN].map(|c| kernel_counts(&host_b, plane, c));
    assert_eq!(
        (kernel_a, kernel_b),
        ([want(37), want(5)], [want(23), want(3)]),
        "{plane:?}: each node's kernel counted its own flows once\n{}",
        diag()
    );
    assert_eq!(
        [allow, deny],
        [add(kernel_a[0], kernel_b[0]), add(kernel_a[1], kernel_b[1])],
        "{plane:?}: status is the sum of the two nodes' kernel counters\n{}",
        diag()
    );
    assert_eq!(receiver_a.received(), (37, 0));
    assert_eq!(receiver_b.received(), (23, 0));

    // One policy's rules: the ingress rule's packets and bytes over both nodes, and both nodes
    // named.
    for (name, total) in [(ALLOW, allow), (DENY, deny)] {
        let detail = policy_detail(&host_a, name);
        let rules = detail["rules"].as_array().expect("rules");
        let ingress: Vec<_> = rules
            .iter()
            .filter(|r| r["direction"] == "ingress")
            .collect();
        assert_eq!(ingress.len(), 1, "{name}: {detail:#}");
        let r = ingress[0];
        assert_eq!(
            (
                r["index"].as_u64(),
                r["packets"].as_u64(),
                r["bytes"].as_u64()
            ),
            (Some(0), Some(total.0), Some(total.1)),
            "{plane:?}: {name}'s rule counts both nodes: {detail:#}"
        );
        assert_eq!(
            r["nodes"],
            serde_json::json!(["node-a", "node-b"]),
            "{plane:?}: {name}'s rule fired on both nodes: {detail:#}"
        );
        assert!(r["last_hit"].is_string(), "{detail:#}");
    }
    // And the table an operator reads.
    let bin = integration::binary("calc-server");
    let table = host_a.exec(&[
        bin.to_str().expect("UTF-8 path"),
        "status",
        "--server",
        "127.0.0.1:9099",
        "--policy",
        ALLOW,
    ]);
    let line: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with("ingress "))
        .unwrap_or_else(|| panic!("no ingress rule line:\n{table}"))
        .split_whitespace()
        .collect();
    assert_eq!(
        [line[1], line[2], line[3], line[4], line[6]],
        [
            "0",
            "allow",
            "60",
            &(60 * PACKET_BYTES).to_string(),
            "node-a,node-b"
        ],
        "{plane:?}:\n{table}"
    );
    eprintln!(
        "{plane:?}: two nodes counting {ready:?} after start; whole test {:?}",
        started.elapsed()
    );
}

/// What `<dir>/status/_hits.json` (the server's saved counters) holds for policy `name`
/// (`NAMESPACE/NAME`), summed over its rules and nodes: (packets, bytes); (0, 0) when the
/// file or the policy's entries are absent.
fn saved_hits(dir: &std::path::Path, name: &str) -> (u64, u64) {
    let Ok(text) = std::fs::read_to_string(dir.join("status").join("_hits.json")) else {
        return (0, 0);
    };
    let doc: serde_json::Value = serde_json::from_str(&text).expect("_hits.json is JSON");
    let (ns, policy) = name.split_once('/').expect("NAMESPACE/NAME");
    doc["counts"]
        .as_array()
        .expect("counts")
        .iter()
        .filter(|c| {
            c["owner"]["policy"]["namespace"] == ns && c["owner"]["policy"]["name"] == policy
        })
        .fold((0, 0), |acc, c| {
            add(
                acc,
                (
                    c["packets"].as_u64().expect("packets"),
                    c["bytes"].as_u64().expect("bytes"),
                ),
            )
        })
}

/// Waits until a (re)started server answers and shows (packets, bytes) `allow` and `deny` for
/// the two policies (what it loaded from `_hits.json`), then that they hold still.
fn restored(host: &Netns, allow: (u64, u64), deny: (u64, u64), diag: impl FnOnce() -> String) {
    wait_until(
        "the restarted server answers with the counts it loaded",
        Duration::from_secs(20),
        || {
            policy_rows_if_up(host).is_some_and(|rows| {
                hits_of(&rows, ALLOW) == Some(allow) && hits_of(&rows, DENY) == Some(deny)
            })
        },
        diag,
    );
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn calc_server_restarts_keep_what_was_saved() {
    integration::netns::require();
    let started = Instant::now();
    let plane = Plane::Iptables(Ipt::Nft);
    let host = Netns::new("host");
    host.make_host();
    let (client, server, weps) = node_workloads(&host, NODE, 0);
    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(
        dir.path(),
        "workloads.yaml",
        &format!("{}{weps}", namespace_profile("prod", "prod")),
    );
    write_manifest(dir.path(), "policies.yaml", &policies(false));
    let (driver, flags) = plane_flags(plane);
    // A save interval longer than the test: after a start's first save (its first change),
    // only a graceful shutdown saves.
    let mut cp = ControlPlane::start_with_server(
        driver,
        &host,
        dir.path(),
        NODE,
        &flags,
        "127.0.0.1:50051",
        &["--hits-save-interval", "1h"],
    );
    cp.wait_programmed();
    let receiver = Receiver::start(&server);
    let kernel = |host: &Netns| [ALLOW_CHAIN, DENY_CHAIN].map(|c| kernel_counts(host, plane, c));
    macro_rules! diag {
        () => {
            || {
                format!(
                    "{}\nserver log:\n{}\n_hits.json:\n{}",
                    diagnostics(&host, plane, &cp),
                    cp.server_log_text(),
                    std::fs::read_to_string(dir.path().join("status/_hits.json"))
                        .unwrap_or_default()
                )
            }
        };
    }
    warm_up(&host, &client, 30000..30200, "the agent reports", diag!());
    // The agent's "stream ended" lines: it noticed its server gone (no read of the counters
    // before it connects again).
    let stream_ends = |cp: &ControlPlane| cp.agent_log_text().matches("stream ended").count();
    let wait_agent_noticed = |cp: &ControlPlane, before: usize| {
        wait_until(
            "the agent notices its server gone",
            Duration::from_secs(10),
            || stream_ends(cp) > before,
            || cp.agent_log_text(),
        );
    };
    let file = |dir: &std::path::Path| [saved_hits(dir, ALLOW), saved_hits(dir, DENY)];

    // 37 + 5 flows, reported; a graceful stop saves them.
    traffic(&client, &server, &receiver, 40000, (37, 5), 37, diag!());
    let counts = counted(&host, 37, 5, diag!());
    assert_eq!(kernel(&host), [want(37), want(5)], "{}", diag!()());
    assert_eq!(counts, kernel(&host), "{}", diag!()());
    let ends = stream_ends(&cp);
    cp.stop_server(true);
    assert_eq!(
        file(dir.path()),
        counts,
        "a graceful shutdown saves every count it was sent\n{}",
        diag!()()
    );
    // 10 + 2 flows while no server runs: the kernel counts them, the agent reads them after it
    // reconnects (its previous read was before the stop) and reports them to the new server.
    wait_agent_noticed(&cp, ends);
    traffic(&client, &server, &receiver, 40100, (10, 2), 47, diag!());
    cp.start_server(&host);
    let counts = counted(&host, 47, 7, diag!());
    assert_eq!(
        kernel(&host),
        [want(47), want(7)],
        "the resync after the server's restart does not rewrite the chains (counters kept)\n{}",
        diag!()()
    );
    assert_eq!(
        counts,
        kernel(&host),
        "across a graceful restart of calc-server, with traffic while it was down: nothing \
         lost, nothing counted twice\n{}",
        diag!()()
    );
    warm_up(
        &host,
        &client,
        30200..30400,
        "the agent reports to the new server",
        diag!(),
    );

    // kill -9. The file holds what the first save of this server wrote (at its first change,
    // the 10 + 2 flows of the downtime: 47 + 7; the next save is an hour away). 10 + 2 flows
    // reported after it are lost with the process: the docs (operations.md, "Policy hit
    // counters") say agents do not send again what they reported. 5 + 1 flows while no
    // server runs are the agent's to report to the next one.
    traffic(&client, &server, &receiver, 40200, (10, 2), 57, diag!());
    let reported = counted(&host, 57, 9, diag!());
    assert_eq!(reported, kernel(&host), "{}", diag!()());
    let saved = file(dir.path());
    assert_eq!(
        saved,
        [want(47), want(7)],
        "the file holds the counts of this server's first save, before the last 10 + 2 \
         flows\n{}",
        diag!()()
    );
    let ends = stream_ends(&cp);
    cp.stop_server(false);
    wait_agent_noticed(&cp, ends);
    traffic(&client, &server, &receiver, 40300, (5, 1), 62, diag!());
    cp.start_server(&host);
    let counts = counted(&host, 52, 8, diag!());
    let k = kernel(&host);
    assert_eq!(k, [want(62), want(10)], "{}", diag!()());
    let lost = [want(10), want(2)];
    assert_eq!(
        counts,
        [
            (k[0].0 - lost[0].0, k[0].1 - lost[0].1),
            (k[1].0 - lost[1].0, k[1].1 - lost[1].1)
        ],
        "after a crash of calc-server: the kernel's counts less exactly what was reported \
         after the last save (not sent again); what the kernel counted while no server ran \
         is reported; nothing counted twice\n{}",
        diag!()()
    );

    // A short save interval: what was reported before a crash survives it once saved.
    warm_up(
        &host,
        &client,
        30400..30600,
        "the agent reports after the crash",
        diag!(),
    );
    cp.server_extra = vec!["--hits-save-interval".into(), "200ms".into()];
    cp.restart_server(&host, true);
    restored(&host, counts[0], counts[1], diag!());
    warm_up(
        &host,
        &client,
        30600..30800,
        "the agent reports (save every 200ms)",
        diag!(),
    );
    traffic(&client, &server, &receiver, 40400, (10, 2), 72, diag!());
    let counts = counted(&host, 62, 10, diag!());
    wait_until(
        "the periodic save writes the 10 + 2 flows",
        Duration::from_secs(5),
        || file(dir.path()) == counts,
        diag!(),
    );
    cp.restart_server(&host, false);
    restored(&host, counts[0], counts[1], diag!());
    let k = kernel(&host);
    assert_eq!(k, [want(72), want(12)], "{}", diag!()());
    assert_eq!(
        counts,
        [want(62), want(10)],
        "a crash after a save loses nothing more than the earlier crash did\n{}",
        diag!()()
    );
    assert_eq!(receiver.received(), (72, 0));
    eprintln!("calc-server restarts: whole test {:?}", started.elapsed());
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn a_driver_switch_counts_each_dataplane_once() {
    integration::netns::require();
    let started = Instant::now();
    let iptables = Plane::Iptables(Ipt::Nft);
    let host = Netns::new("host");
    host.make_host();
    let (client, server, weps) = node_workloads(&host, NODE, 0);
    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(
        dir.path(),
        "workloads.yaml",
        &format!("{}{weps}", namespace_profile("prod", "prod")),
    );
    write_manifest(dir.path(), "policies.yaml", &policies(false));
    let (driver, flags) = plane_flags(iptables);
    let mut cp = ControlPlane::start_with_driver(driver, &host, dir.path(), NODE, &flags);
    cp.wait_programmed();
    let receiver = Receiver::start(&server);
    let kernel = |plane: Plane| [ALLOW_CHAIN, DENY_CHAIN].map(|c| kernel_counts(&host, plane, c));
    let diag = |cp: &ControlPlane| {
        format!(
            "{}\nnft:\n{}",
            diagnostics(&host, iptables, cp),
            kernel_listing(&host, Plane::Nftables)
        )
    };
    let iptables_chain = || {
        host.exec(&["iptables-nft-save", "-t", "filter"])
            .lines()
            .any(|l| l.starts_with(&format!("-A {ALLOW_CHAIN} ")))
    };
    let nft_table = || integration::netns::nft_list(&host, "ip").contains("table ip calico");
    warm_up(
        &host,
        &client,
        30000..30200,
        "the linux agent reports",
        || diag(&cp),
    );

    // linux: 37 + 5.
    traffic(&client, &server, &receiver, 40000, (37, 5), 37, || {
        diag(&cp)
    });
    let counts = counted(&host, 37, 5, || diag(&cp));
    let by_iptables = kernel(iptables);
    assert_eq!(by_iptables, [want(37), want(5)], "{}", diag(&cp));
    assert_eq!(counts, by_iptables, "{}", diag(&cp));

    // Switch to nftables: it programs its table, then removes the linux driver's chains.
    cp.stop_agent();
    assert_eq!(
        kernel(iptables),
        by_iptables,
        "nothing moved after the agent stopped"
    );
    let (driver, flags) = plane_flags(Plane::Nftables);
    cp.driver = driver;
    cp.agent_extra = flags.iter().map(|s| (*s).to_owned()).collect();
    cp.start_agent(&host);
    cp.wait_programmed();
    wait_until(
        "the nftables driver removes the linux driver's chains",
        Duration::from_secs(20),
        || nft_table() && !iptables_chain(),
        || diag(&cp),
    );
    warm_up(
        &host,
        &client,
        30200..30400,
        "the nftables agent reports",
        || diag(&cp),
    );
    traffic(&client, &server, &receiver, 40100, (10, 2), 47, || {
        diag(&cp)
    });
    let counts = counted(&host, 47, 7, || diag(&cp));
    let by_nft = kernel(Plane::Nftables);
    assert_eq!(by_nft, [want(10), want(2)], "{}", diag(&cp));
    assert_eq!(
        counts,
        [
            add(by_iptables[0], by_nft[0]),
            add(by_iptables[1], by_nft[1])
        ],
        "linux then nftables: what iptables counted plus what nftables counted\n{}",
        diag(&cp)
    );

    // And back to linux: it rewrites its chains (counting from zero) and deletes the table.
    cp.stop_agent();
    assert_eq!(
        kernel(Plane::Nftables),
        by_nft,
        "nothing moved after the agent stopped"
    );
    let (driver, flags) = plane_flags(iptables);
    cp.driver = driver;
    cp.agent_extra = flags.iter().map(|s| (*s).to_owned()).collect();
    cp.start_agent(&host);
    cp.wait_programmed();
    wait_until(
        "the linux driver deletes the nftables driver's table",
        Duration::from_secs(20),
        || iptables_chain() && !nft_table(),
        || diag(&cp),
    );
    warm_up(
        &host,
        &client,
        30400..30600,
        "the linux agent reports again",
        || diag(&cp),
    );
    traffic(&client, &server, &receiver, 40200, (10, 2), 57, || {
        diag(&cp)
    });
    let counts = counted(&host, 57, 9, || diag(&cp));
    let by_iptables_again = kernel(iptables);
    assert_eq!(
        by_iptables_again,
        [want(10), want(2)],
        "the linux driver's new chains count from zero\n{}",
        diag(&cp)
    );
    let total = |i: usize| add(add(by_iptables[i], by_nft[i]), by_iptables_again[i]);
    assert_eq!(
        counts,
        [total(0), total(1)],
        "linux, nftables, linux: the sum of the three dataplanes' counters\n{}",
        diag(&cp)
    );
    assert_eq!(receiver.received(), (57, 0));
    eprintln!("driver switches: whole test {:?}", started.elapsed());
}
