//! The Linux drivers on real packets: a host network namespace runs calc-server and
//! `dataplane-agent --driver linux` (iptables and ipsets) or `--driver nftables` (each test runs
//! on both: `<test>::linux`, `<test>::nftables`); workload namespaces hang off it by veth pairs
//! named with the workload prefix; TCP connects and pings show which pairs policy lets through.
//!
//! Needs root, iptables (nft and legacy), ipset, nc, ping and nft: the tests are `#[ignore]`d
//! with that reason and `make test` runs them; a missing tool fails the test
//! (see `integration::netns::require`).

use std::time::Duration;

use integration::driver_tests;
use integration::netns::{
    ControlPlane, Driver, Netns, Probe, Workload, expect_eventually, failing, namespace_profile,
    nft_chain, nft_list, nft_sets_holding, wait_until, wep_manifest, write_manifest,
};

const NODE: &str = "node-a";

fn wep(ns: &str, pod: &str, app: &str, iface: &str, w: &Workload, ports: &str) -> String {
    wep_manifest(NODE, ns, pod, iface)
        .label("app", app)
        .calico_labels()
        .ipv4(&w.ipv4)
        .ipv6(&w.ipv6)
        .ports(ports)
        .render()
}

/// The security tier passes traffic from prod namespaces and from trusted network sets,
/// allows ping from anywhere, and drops the rest at its end. The default tier lets the client
/// reach the web pod's named port and trusted networks reach 9090.
fn policies(web_extra_port: bool) -> String {
    let extra = if web_extra_port {
        "  - action: Allow
    protocol: TCP
    source:
      selector: app == 'client'
    destination:
      ports: [9090]
"
    } else {
        ""
    };
    format!(
        "apiVersion: projectcalico.org/v3
kind: Tier
metadata:
  name: security
spec:
  order: 100
  defaultAction: Deny
---
apiVersion: projectcalico.org/v3
kind: Tier
metadata:
  name: default
spec:
  order: 1000000
  defaultAction: Deny
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: prod-only
spec:
  tier: security
  order: 10
  selector: all()
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: ICMP
  - action: Allow
    protocol: ICMPv6
  - action: Pass
    source:
      namespaceSelector: env == 'prod'
  - action: Pass
    source:
      selector: role == 'trusted'
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkSet
metadata:
  name: trusted-db
  labels:
    role: trusted
spec:
  nets: [10.65.0.3/32]
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: web-allow
  namespace: prod
spec:
  order: 100
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: app == 'client'
    destination:
      ports: [http]
{extra}---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: trusted-9090
spec:
  order: 200
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: role == 'trusted'
    destination:
      ports: [9090]
"
    )
}

struct Cluster {
    host: Netns,
    client: Workload,
    web: Workload,
    db: Workload,
    dir: tempfile::TempDir,
}

fn cluster() -> Cluster {
    let host = Netns::new("host");
    host.make_host();
    let mut client = Workload::attach(&host, "cali0client001", "10.65.0.1", "fd00:65::1");
    let mut web = Workload::attach(&host, "cali0web000002", "10.65.0.2", "fd00:65::2");
    let mut db = Workload::attach(&host, "cali0db0000003", "10.65.0.3", "fd00:65::3");
    client.listen(7070);
    web.listen(8080);
    web.listen(9090);
    db.listen(5432);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut manifests = namespace_profile("prod", "prod");
    manifests.push_str(&namespace_profile("dev", "dev"));
    manifests.push_str(&wep("prod", "client", "client", &client.iface, &client, ""));
    manifests.push_str(&wep(
        "prod",
        "web",
        "web",
        &web.iface,
        &web,
        "{name: http, protocol: TCP, port: 8080}",
    ));
    manifests.push_str(&wep("dev", "db", "db", &db.iface, &db, ""));
    write_manifest(dir.path(), "workloads.yaml", &manifests);
    write_manifest(dir.path(), "policies.yaml", &policies(false));
    Cluster {
        host,
        client,
        web,
        db,
        dir,
    }
}

fn tcp<'a>(from: &'a Workload, to: &str, port: u16, allowed: bool) -> Probe<'a> {
    Probe {
        from,
        to: to.to_owned(),
        port: Some(port),
        allowed,
    }
}

fn ping<'a>(from: &'a Workload, to: &str, allowed: bool) -> Probe<'a> {
    Probe {
        from,
        to: to.to_owned(),
        port: None,
        allowed,
    }
}

/// The verdicts the initial policy gives (see `policies`).
fn initial_matrix(c: &Cluster) -> Vec<Probe<'_>> {
    let (client, web, db) = (&c.client, &c.web, &c.db);
    vec![
        // Named port "http" on web, from a prod client: passed by security, allowed by default.
        tcp(client, &web.ipv4, 8080, true),
        tcp(client, &web.ipv6, 8080, true),
        // 9090 only from trusted networks: the client falls to the default tier's drop.
        tcp(client, &web.ipv4, 9090, false),
        // db (dev namespace) is not passed by security for 8080 …
        tcp(db, &web.ipv4, 8080, false),
        tcp(db, &web.ipv6, 8080, false),
        // … but it is in a trusted network set (IPv4 only), and 9090 allows trusted nets.
        tcp(db, &web.ipv4, 9090, true),
        tcp(db, &web.ipv6, 9090, false),
        // No default-tier policy on client and db: profiles (allow) decide after the pass.
        tcp(web, &client.ipv4, 7070, true),
        tcp(client, &db.ipv4, 5432, true),
        tcp(client, &db.ipv6, 5432, true),
        // db → client: over IPv4 db's address is in the trusted network set, so security
        // passes it and the profile allows; over IPv6 it is just a dev-namespace pod: dropped.
        tcp(db, &client.ipv4, 7070, true),
        tcp(db, &client.ipv6, 7070, false),
        // ICMP is allowed in the security tier, whoever sends it.
        ping(db, &client.ipv4, true),
        ping(db, &client.ipv6, true),
    ]
}

driver_tests! {
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    policy_is_enforced_on_real_traffic_and_follows_changes => policy_is_enforced;
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    out_of_band_changes_are_repaired_and_a_restart_changes_nothing => repaired_and_restarted;
}

fn policy_is_enforced(driver: Driver) {
    integration::netns::require();
    let c = cluster();
    let cp = ControlPlane::start_with_driver(driver, &c.host, c.dir.path(), NODE, &[]);
    cp.wait_programmed();
    expect_eventually("initial policy", &initial_matrix(&c), &cp);
    // On an nft host neither driver leaves legacy tables behind (looking at the legacy backend
    // must not create its tables: `iptables-save` would then warn "iptables-legacy tables
    // present"). The kernel lists the node's legacy tables per namespace.
    let legacy = c.host.exec(&[
        "sh",
        "-c",
        "cat /proc/net/ip_tables_names /proc/net/ip6_tables_names 2>/dev/null; true",
    ]);
    assert_eq!(
        legacy.trim(),
        "",
        "{driver:?}: legacy tables were created on an nft host"
    );

    // Widen web-allow: the client may now reach 9090 too; nothing else changes.
    write_manifest(c.dir.path(), "policies.yaml", &policies(true));
    let mut after = initial_matrix(&c);
    after[2].allowed = true;
    expect_eventually("after allowing 9090 from the client", &after, &cp);

    // An interface with the workload prefix but no endpoint yet: the dispatch chains drop
    // everything to and from it.
    let mut stray = Workload::attach(&c.host, "cali0new000004", "10.65.0.4", "fd00:65::4");
    stray.listen(7070);
    let unknown = [
        tcp(&stray, &c.client.ipv4, 7070, false),
        tcp(&c.client, &stray.ipv4, 7070, false),
        ping(&stray, &c.client.ipv4, false),
    ];
    let bad = failing(&unknown);
    assert!(
        bad.is_empty(),
        "{driver:?}: an interface without an endpoint must get no traffic through: {:?}",
        bad.iter().map(|p| p.describe()).collect::<Vec<_>>()
    );
    // Once its endpoint exists (prod namespace), it is a normal workload.
    write_manifest(
        c.dir.path(),
        "late.yaml",
        &wep("prod", "late", "late", &stray.iface, &stray, ""),
    );
    expect_eventually(
        "the late endpoint's traffic",
        &[
            tcp(&stray, &c.client.ipv4, 7070, true),
            tcp(&c.client, &stray.ipv4, 7070, true),
        ],
        &cp,
    );

    // Web's default-tier policies stop selecting it: whatever the security tier passes now
    // reaches web's profile (allow); what it does not pass is still dropped.
    write_manifest(
        c.dir.path(),
        "policies.yaml",
        &policies(true).replace("app == 'web'", "app == 'nobody'"),
    );
    expect_eventually(
        "after web's default-tier policies stop selecting it",
        &[
            tcp(&c.client, &c.web.ipv4, 9090, true),
            tcp(&c.db, &c.web.ipv4, 8080, true),
            tcp(&c.db, &c.web.ipv6, 8080, false),
        ],
        &cp,
    );
    // Chains of policies that no endpoint uses any more are removed.
    let state = match driver {
        Driver::Linux => c.host.exec(&["iptables-save", "-t", "filter"]),
        Driver::Nftables => nft_list(&c.host, "ip"),
    };
    assert!(
        state.contains("cali-FORWARD"),
        "{driver:?}: the filter chains are where we look:\n{state}"
    );
    assert!(
        !state.contains("cali-pi-np/prod/web-allow"),
        "{driver:?}: chains of policies that no endpoint uses any more are removed:\n{state}"
    );
}

/// An nft listing without what changes by itself: the counters' values.
fn without_counters(text: &str) -> String {
    text.lines()
        .map(|l| match l.split_once("counter packets ") {
            Some((head, rest)) => {
                // "counter packets N bytes M <rest>"
                let rest = rest.splitn(4, ' ').nth(3).unwrap_or("");
                format!("{head}counter {rest}")
            }
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The values of every `key: N` the agent logged (its apply statistics).
fn logged_counts(log: &str, key: &str) -> Vec<u64> {
    log.match_indices(key)
        .filter_map(|(i, _)| {
            log[i + key.len()..]
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse().ok())
        })
        .collect()
}

fn repaired_and_restarted(driver: Driver) {
    integration::netns::require();
    let c = cluster();
    let mut cp = ControlPlane::start_with_driver(
        driver,
        &c.host,
        c.dir.path(),
        NODE,
        &["--refresh-interval", "1s"],
    );
    cp.wait_programmed();
    let probes = [
        tcp(&c.client, &c.web.ipv4, 8080, true),
        tcp(&c.db, &c.web.ipv4, 8080, false),
        tcp(&c.db, &c.web.ipv4, 9090, true),
    ];
    expect_eventually("initial policy", &probes, &cp);

    // Tamper: delete the rule of web-allow that sets the accept mark, and remove db from the
    // trusted set (as a careless operator might); the periodic read-back puts both back.
    match driver {
        Driver::Linux => tamper_iptables(&c, &cp),
        Driver::Nftables => tamper_nftables(&c, &cp),
    }
    expect_eventually("after the repair", &probes, &cp);

    // Kill the agent: the kernel keeps enforcing.
    let handles = |ns: &Netns| -> Vec<String> {
        ns.exec(&["nft", "-a", "list", "ruleset"])
            .lines()
            .filter_map(|l| l.rsplit_once("# handle ").map(|(_, h)| h.to_owned()))
            .collect()
    };
    // What must not change: with iptables the sets; with nftables both tables whole (rules
    // with their handles, sets with their elements, verdict maps), counters aside.
    let sets = |ns: &Netns| match driver {
        Driver::Linux => ns.exec(&["ipset", "save"]),
        Driver::Nftables => ["ip", "ip6"]
            .map(|f| {
                without_counters(&integration::netns::nft_text(
                    ns,
                    &["-a", "list", "table", f, "calico"],
                ))
            })
            .join("\n"),
    };
    let sets_before = sets(&c.host);
    let rules_before = handles(&c.host);
    cp.kill_agent();
    let bad = failing(&probes);
    assert!(
        bad.is_empty(),
        "{driver:?}: policy must hold while the agent is down"
    );

    // The restarted agent finds everything right and rewrites nothing: same nft rule handles
    // (a rewritten rule gets a new handle), same sets.
    cp.start_agent(&c.host);
    cp.wait_programmed();
    assert_eq!(
        handles(&c.host),
        rules_before,
        "{driver:?}: a restart must not rewrite correct rules"
    );
    assert_eq!(
        sets(&c.host),
        sets_before,
        "{driver:?}: a restart changes nothing"
    );
    let log = cp.agent_log_text();
    let written: Vec<u64> = ["chains_written: ", "elements_added: "]
        .iter()
        .flat_map(|k| logged_counts(&log, k))
        .filter(|n| *n > 0)
        .collect();
    assert!(
        written.is_empty() && log.contains("read_back: true"),
        "{driver:?}: the restarted agent read the kernel back and wrote no chain or element:\n{log}"
    );
    expect_eventually("after the restart", &probes, &cp);
}

/// Deletes web-allow's accept-mark rule (`iptables -D`) and db's address from the trusted
/// set (`ipset del`), then waits until the agent has put both back.
fn tamper_iptables(c: &Cluster, cp: &ControlPlane) {
    let chain = "cali-pi-np/prod/web-allow";
    let before = c.host.exec(&["iptables-save", "-t", "filter"]);
    let rule = before
        .lines()
        .find(|l| {
            l.starts_with(&format!("-A {chain} ")) && l.contains("--set-xmark 0x10000/0x10000")
        })
        .unwrap_or_else(|| panic!("web-allow's accept rule in:\n{before}"))
        .to_owned();
    c.host.exec(&["iptables", "-D", chain, "1"]);
    let trusted_set = c
        .host
        .exec(&["ipset", "list", "-n"])
        .lines()
        .find(|n| {
            n.starts_with("cali40s:") && c.host.exec(&["ipset", "list", n]).contains("10.65.0.3")
        })
        .expect("a v4 selector set holding db's address")
        .to_owned();
    c.host.exec(&["ipset", "del", &trusted_set, "10.65.0.3"]);

    wait_until(
        "refresh repairs the deleted rule and member",
        Duration::from_secs(15),
        || {
            let save = c.host.exec(&["iptables-save", "-t", "filter"]);
            let member = c
                .host
                .exec(&["ipset", "list", &trusted_set])
                .contains("10.65.0.3");
            save.lines().any(|l| l == rule) && member
        },
        || format!("agent log:\n{}", cp.agent_log_text()),
    );
}

/// Deletes web-allow's accept-mark rule (`nft delete rule … handle N`) and db's address from
/// the trusted set (`nft delete element`), then waits until the agent has put both back.
fn tamper_nftables(c: &Cluster, cp: &ControlPlane) {
    let chain = "filter-cali-pi-np/prod/web-allow";
    // A rule as it reads without its handle and counter values.
    let rules = || -> Vec<(String, String)> {
        nft_chain(&c.host, "ip", chain)
            .lines()
            .filter_map(|l| l.rsplit_once(" # handle "))
            .map(|(rule, h)| (without_counters(rule.trim()), h.to_owned()))
            .collect()
    };
    let before = rules();
    let (rule, handle) = before
        .iter()
        .find(|(r, _)| r.contains("mark set") && r.contains("0x00010000"))
        .unwrap_or_else(|| {
            panic!(
                "web-allow's accept rule in:\n{}",
                nft_chain(&c.host, "ip", chain)
            )
        })
        .clone();
    c.host.exec(&[
        "nft", "delete", "rule", "ip", "calico", chain, "handle", &handle,
    ]);
    assert!(
        !rules().iter().any(|(r, _)| *r == rule),
        "the rule is gone:\n{}",
        nft_chain(&c.host, "ip", chain)
    );
    let trusted_set = nft_sets_holding(&c.host, "ip", "10.65.0.3")
        .into_iter()
        .find(|n| n.starts_with("cali40s-"))
        .unwrap_or_else(|| {
            panic!(
                "a v4 selector set holding db's address in:\n{}",
                nft_list(&c.host, "ip")
            )
        });
    c.host.exec(&[
        "nft",
        "delete",
        "element",
        "ip",
        "calico",
        &trusted_set,
        "{ 10.65.0.3 }",
    ]);
    assert!(!nft_sets_holding(&c.host, "ip", "10.65.0.3").contains(&trusted_set));

    wait_until(
        "refresh repairs the deleted rule and element",
        Duration::from_secs(15),
        || {
            rules().iter().any(|(r, _)| *r == rule)
                && nft_sets_holding(&c.host, "ip", "10.65.0.3").contains(&trusted_set)
        },
        || {
            format!(
                "wanted rule: {rule}\nin set {trusted_set}: 10.65.0.3\n{}\nagent log:\n{}",
                nft_list(&c.host, "ip"),
                cp.agent_log_text()
            )
        },
    );
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn legacy_backend_enforces_the_same_policy() {
    integration::netns::require();
    let c = cluster();
    let cp = ControlPlane::start(
        &c.host,
        c.dir.path(),
        NODE,
        &["--iptables-backend", "legacy"],
    );
    cp.wait_programmed();
    expect_eventually("initial policy (legacy)", &initial_matrix(&c), &cp);
    let save = c.host.exec(&["iptables-legacy-save", "-t", "filter"]);
    assert!(
        save.contains("-A FORWARD -m comment --comment \"cali:"),
        "{save}"
    );
    assert!(save.contains(":cali-tw-cali0web000002"), "{save}");
}
