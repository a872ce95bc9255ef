//! Switching a node between the two dataplane drivers, on real packets: `--driver linux`
//! (iptables and ipsets, on each iptables backend) is stopped and `--driver nftables` (`table
//! ip calico`, `table ip6 calico`; told no backend: it finds the iptables state to remove) started
//! in its place while workloads keep connecting, then back. A denied flow must
//! never get through during a switch and an allowed one may miss at most two probes; after each
//! switch the other driver's state is gone (our chains, rules and sets; the `calico` tables)
//! and what other tools put in iptables, ipset and nftables is untouched.
//!
//! Needs root, iptables (nft and legacy), ipset, nc, ping and nft: `#[ignore]`d with that
//! reason and run by `make test`; a missing tool fails the test (see
//! `integration::netns::require`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use integration::netns::{
    ControlPlane, Driver, Ipt, Netns, Probe, Workload, expect_eventually, namespace_profile,
    nft_chain, nft_list, nft_text, wait_until, wep_manifest, write_manifest,
};

const NODE: &str = "node-a";

fn wep(pod: &str, w: &Workload) -> String {
    wep_labelled(pod, pod, w)
}

/// [`wep`] labelled `app: <app>`.
fn wep_labelled(pod: &str, app: &str, w: &Workload) -> String {
    wep_manifest(NODE, "prod", pod, &w.iface)
        .label("app", app)
        .ipv4(&w.ipv4)
        .ipv6(&w.ipv6)
        .render()
}

/// web accepts the client on 8080 only: 9090 reaches the end of the default tier (drop). The
/// source selector makes the drivers program an IP set.
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

/// The two flows, both families: (address, port, allowed).
fn flows(web: &Workload) -> [(String, u16, bool); 4] {
    [
        (web.ipv4.clone(), 8080, true),
        (web.ipv6.clone(), 8080, true),
        (web.ipv4.clone(), 9090, false),
        (web.ipv6.clone(), 9090, false),
    ]
}

fn probes<'a>(client: &'a Workload, web: &Workload) -> Vec<Probe<'a>> {
    flows(web)
        .into_iter()
        .map(|(to, port, allowed)| Probe {
            from: client,
            to,
            port: Some(port),
            allowed,
        })
        .collect()
}

/// What other tools hold on the node; created before the first switch, it must survive both.
const FOREIGN_RULE: &str = "-A INPUT -s 203.0.113.7/32 -p tcp -m tcp --dport 4444 -j ACCEPT";

fn add_foreign_state(host: &Netns) {
    for tool in ["iptables-nft", "iptables-legacy"] {
        host.exec(&[
            tool,
            "-A",
            "INPUT",
            "-s",
            "203.0.113.7",
            "-p",
            "tcp",
            "--dport",
            "4444",
            "-j",
            "ACCEPT",
        ]);
    }
    host.exec(&["ipset", "create", "other-tool", "hash:ip"]);
    host.exec(&["ipset", "add", "other-tool", "192.0.2.7"]);
    host.exec(&[
        "nft",
        "add table inet foreign; \
         add chain inet foreign input { type filter hook input priority 10; policy accept; }; \
         add rule inet foreign input tcp dport 4444 counter",
    ]);
}

/// `iptables-{nft,legacy}-save` and `ip6tables-…` output, each after its tool's name.
fn iptables_state(host: &Netns) -> String {
    let mut text = String::new();
    for tool in [
        "iptables-nft-save",
        "ip6tables-nft-save",
        "iptables-legacy-save",
        "ip6tables-legacy-save",
    ] {
        text.push_str(&format!("## {tool}\n{}", host.exec(&[tool])));
    }
    text
}

/// Lines of `text` that are ours (chains, rules and sets are named and commented `cali…`).
fn ours(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.contains("cali")).collect()
}

fn assert_foreign_state_survives(host: &Netns, when: &str) {
    for tool in ["iptables-nft-save", "iptables-legacy-save"] {
        let save = host.exec(&[tool, "-t", "filter"]);
        assert!(
            save.lines().any(|l| l == FOREIGN_RULE),
            "{when}: the foreign rule in {tool}:\n{save}"
        );
    }
    let sets = host.exec(&["ipset", "list", "other-tool"]);
    assert!(
        sets.contains("192.0.2.7"),
        "{when}: the foreign IP set:\n{sets}"
    );
    let table = nft_text(host, &["list", "table", "inet", "foreign"]);
    assert!(
        table.contains("tcp dport 4444 counter"),
        "{when}: the foreign nftables table:\n{}",
        nft_text(host, &["list", "ruleset"])
    );
}

/// (attempts, connected) of one probe loop.
struct Tally {
    to: String,
    port: u16,
    allowed: bool,
    tries: u64,
    connected: u64,
}

/// Stops the running agent and starts one on `driver` (with `extra` flags) while every flow is
/// probed in a tight loop (the denied ones by four loops each, with a short timeout), until two
/// seconds after the new agent reported the dataplane in sync. A denied flow must never
/// connect; an allowed one may miss at most two probes.
fn switch_under_load(
    host: &Netns,
    cp: &mut ControlPlane,
    client: &Workload,
    web: &Workload,
    driver: Driver,
    extra: &[&str],
) {
    let what = format!(
        "{:?} {:?} -> {driver:?} {extra:?}",
        cp.driver, cp.agent_extra
    );
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let mut loops = Vec::new();
        for (to, port, allowed) in flows(web) {
            for _ in 0..if allowed { 1 } else { 4 } {
                let (to, stop) = (to.clone(), &stop);
                loops.push(s.spawn(move || {
                    let mut t = Tally {
                        to,
                        port,
                        allowed,
                        tries: 0,
                        connected: 0,
                    };
                    let port = port.to_string();
                    while !stop.load(Ordering::SeqCst) {
                        let ok = if allowed {
                            client.ns.try_exec(&["nc", "-z", "-w", "1", &t.to, &port])
                        } else {
                            client
                                .ns
                                .try_exec(&["timeout", "0.2", "nc", "-z", &t.to, &port])
                        };
                        t.tries += 1;
                        t.connected += u64::from(ok);
                    }
                    t
                }));
            }
        }
        std::thread::sleep(Duration::from_secs(1));
        cp.stop_agent();
        cp.driver = driver;
        cp.agent_extra = extra.iter().map(|s| (*s).to_owned()).collect();
        cp.start_agent(host);
        cp.wait_programmed();
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::SeqCst);
        loops
            .into_iter()
            .map(|l| l.join().expect("probe loop"))
            .collect()
    });
    // One line per flow: attempts and connections summed over its loops.
    let mut summary: Vec<Tally> = Vec::new();
    for t in tallies {
        match summary
            .iter_mut()
            .find(|s| s.to == t.to && s.port == t.port)
        {
            Some(s) => {
                s.tries += t.tries;
                s.connected += t.connected;
            }
            None => summary.push(t),
        }
    }
    let lines: Vec<String> = summary
        .iter()
        .map(|t| {
            format!(
                "{} -> {}:{} ({}): {} of {} connected",
                client.ipv4,
                t.to,
                t.port,
                if t.allowed { "allowed" } else { "denied" },
                t.connected,
                t.tries
            )
        })
        .collect();
    eprintln!(
        "switch {what} ({:.1} s with the new agent's sync):\n  {}",
        started.elapsed().as_secs_f64(),
        lines.join("\n  ")
    );
    for t in &summary {
        assert!(
            t.tries >= 10,
            "{what}: too few probes of {}:{} during the switch: {}",
            t.to,
            t.port,
            t.tries
        );
        if t.allowed {
            assert!(
                t.tries - t.connected <= 2,
                "{what}: an allowed flow ({}:{}) was refused {} times of {} during the switch\n\
                 agent log:\n{}",
                t.to,
                t.port,
                t.tries - t.connected,
                t.tries,
                cp.agent_log_text()
            );
        } else {
            assert_eq!(
                t.connected,
                0,
                "{what}: a denied flow ({}:{}) got through during the switch\nagent log:\n{}",
                t.to,
                t.port,
                cp.agent_log_text()
            );
        }
    }
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn switching_between_the_linux_and_nftables_drivers_keeps_enforcing_and_cleans_up() {
    integration::netns::require();
    for ipt in Ipt::BOTH {
        switching(ipt);
    }
}

/// The switches, the linux driver on iptables backend `ipt`.
fn switching(ipt: Ipt) {
    let backend = ["--iptables-backend", ipt.name()];
    let host = Netns::new("host");
    host.make_host();
    let client = Workload::attach(&host, "cali0client001", "10.65.0.1", "fd00:65::1");
    let web = Workload::attach(&host, "cali0web000002", "10.65.0.2", "fd00:65::2");
    // Listeners that keep up with the probe loops (`nc -lk` would drop connects).
    let _listeners = [web.ns.accept(8080), web.ns.accept(9090)];
    add_foreign_state(&host);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut manifests = namespace_profile("prod", "prod");
    manifests.push_str(&wep("client", &client));
    manifests.push_str(&wep("web", &web));
    write_manifest(dir.path(), "workloads.yaml", &manifests);
    write_manifest(dir.path(), "policy.yaml", POLICY);

    // 1. The iptables driver enforces the policy.
    let mut cp = ControlPlane::start_with_driver(Driver::Linux, &host, dir.path(), NODE, &backend);
    cp.wait_programmed();
    expect_eventually(
        &format!("linux driver ({ipt:?})"),
        &probes(&client, &web),
        &cp,
    );
    let state = host.exec(&[&ipt.tool(4, "save"), "-t", "filter"]);
    assert!(
        state.contains(":cali-FORWARD"),
        "{ipt:?}: the iptables driver's chains:\n{state}"
    );
    assert!(
        nft_list(&host, "ip").is_empty(),
        "no nftables table of ours under the iptables driver"
    );

    // 2. Switch to nftables while the flows are probed; then the iptables driver's chains,
    //    rules and sets are gone, and other tools' state is not.
    switch_under_load(&host, &mut cp, &client, &web, Driver::Nftables, &[]);
    let leftovers = || {
        let state = iptables_state(&host);
        let sets = host.exec(&["ipset", "list", "-n"]);
        let mut left: Vec<String> = ours(&state).into_iter().map(str::to_owned).collect();
        left.extend(ours(&sets).into_iter().map(|s| format!("ipset {s}")));
        left
    };
    wait_until(
        &format!("{ipt:?}: the iptables driver's chains, rules and IP sets are removed"),
        Duration::from_secs(10),
        || leftovers().is_empty(),
        || {
            format!(
                "left: {:#?}\nagent log:\n{}",
                leftovers(),
                cp.agent_log_text()
            )
        },
    );
    for family in ["ip", "ip6"] {
        let table = nft_list(&host, family);
        assert!(
            table.contains("chain filter-cali-FORWARD {"),
            "table {family} calico:\n{table}"
        );
    }
    assert_foreign_state_survives(&host, "after the switch to nftables");
    expect_eventually(
        &format!("nftables driver (after {ipt:?})"),
        &probes(&client, &web),
        &cp,
    );

    // 3. And back: the nftables tables go, the iptables driver's chains and sets return.
    switch_under_load(&host, &mut cp, &client, &web, Driver::Linux, &backend);
    wait_until(
        "the nftables driver's tables are removed",
        Duration::from_secs(10),
        || nft_list(&host, "ip").is_empty() && nft_list(&host, "ip6").is_empty(),
        || {
            format!(
                "{}\nagent log:\n{}",
                nft_text(&host, &["list", "ruleset"]),
                cp.agent_log_text()
            )
        },
    );
    for tool in [ipt.tool(4, "save"), ipt.tool(6, "save")] {
        let save = host.exec(&[&tool, "-t", "filter"]);
        assert!(
            save.contains(":cali-FORWARD") && save.contains(":cali-tw-cali0web000002"),
            "{tool}:\n{save}"
        );
    }
    let sets = host.exec(&["ipset", "list", "-n"]);
    assert!(
        sets.lines().any(|s| s.starts_with("cali40s:"))
            && sets.lines().any(|s| s.starts_with("cali60s:")),
        "the iptables driver's IP sets:\n{sets}"
    );
    assert_foreign_state_survives(&host, "after the switch back to linux");
    expect_eventually(
        &format!("linux driver ({ipt:?}) again"),
        &probes(&client, &web),
        &cp,
    );
}

/// A label change moves a workload into and out of a policy's source set: with the nftables
/// driver that is an element change only, sent to the kernel as one netlink batch (no
/// `nft -f`), and the verdict follows both ways; then a policy change rewrites its chains,
/// also as a netlink batch.
#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn a_label_change_reaches_the_kernel_as_a_netlink_element_batch() {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let client = Workload::attach(&host, "cali0client001", "10.65.0.1", "fd00:65::1");
    let web = Workload::attach(&host, "cali0web000002", "10.65.0.2", "fd00:65::2");
    let _listeners = [web.ns.accept(8080), web.ns.accept(9090)];
    let dir = tempfile::tempdir().expect("temp dir");
    let workloads = |client_app: &str| {
        let mut m = namespace_profile("prod", "prod");
        m.push_str(&wep_labelled("client", client_app, &client));
        m.push_str(&wep("web", &web));
        m
    };
    // The client starts outside the policy's source selector.
    write_manifest(dir.path(), "workloads.yaml", &workloads("other"));
    write_manifest(dir.path(), "policy.yaml", POLICY);
    let cp = ControlPlane::start_with_driver(
        Driver::Nftables,
        &host,
        dir.path(),
        NODE,
        &["--admin-listen", "127.0.0.1:9097"],
    );
    cp.wait_programmed();
    // `/programmed` names the chains as nft holds them.
    let programmed = || {
        host.exec(&[
            "bash",
            "-c",
            "{ exec 3<>/dev/tcp/127.0.0.1/9097; printf 'GET /programmed HTTP/1.0\r\n\r\n' >&3; cat <&3; } 2>/dev/null || true",
        ])
    };
    wait_until(
        "/programmed lists nft chain names",
        Duration::from_secs(10),
        || {
            let p = programmed();
            p.contains("\"filter-cali-pi-np/prod/web-allow\"")
                && p.contains("\"filter-cali-tw-cali0web000002\"")
                && !p.contains("\"cali-tw-")
        },
        programmed,
    );
    // The client to the web workload on `port`, both families.
    let on_port = |port: u16, allowed: bool| -> Vec<Probe<'_>> {
        [web.ipv4.clone(), web.ipv6.clone()]
            .into_iter()
            .map(|to| Probe {
                from: &client,
                to,
                port: Some(port),
                allowed,
            })
            .collect()
    };
    let verdicts = |allowed: bool| on_port(8080, allowed);
    expect_eventually("the client outside the source set", &verdicts(false), &cp);
    let netlink_batches = || cp.agent_log_text().matches("via_netlink: true").count();
    let before = netlink_batches();

    write_manifest(dir.path(), "workloads.yaml", &workloads("client"));
    expect_eventually("the client inside the source set", &verdicts(true), &cp);
    let table = nft_list(&host, "ip");
    assert!(
        table.contains(&client.ipv4),
        "the client's address is in a set of table ip calico:\n{table}"
    );
    assert!(
        nft_list(&host, "ip6").contains(&client.ipv6),
        "and its IPv6 address in table ip6 calico"
    );
    assert!(
        netlink_batches() > before,
        "the member change went as a netlink batch:\n{}",
        cp.agent_log_text()
    );

    write_manifest(dir.path(), "workloads.yaml", &workloads("other"));
    expect_eventually(
        "the client outside the source set again",
        &verdicts(false),
        &cp,
    );
    assert!(!nft_list(&host, "ip").contains(&client.ipv4));

    // A policy change (its port) rewrites the policy's chains: over netlink too, no `nft -f`.
    let rules_over_netlink = || {
        cp.agent_log_text()
            .lines()
            .filter(|l| l.contains("via_netlink: true") && !l.contains("chains_written: 0"))
            .count()
    };
    let before = rules_over_netlink();
    write_manifest(dir.path(), "workloads.yaml", &workloads("client"));
    write_manifest(
        dir.path(),
        "policy.yaml",
        &POLICY.replace("[8080]", "[9090]"),
    );
    let mut moved = on_port(8080, false);
    moved.extend(on_port(9090, true));
    expect_eventually("the policy's new port", &moved, &cp);
    assert!(
        nft_chain(&host, "ip", "filter-cali-pi-np/prod/web-allow").contains("tcp dport 9090"),
        "the chain holds the new port"
    );
    assert!(
        rules_over_netlink() > before,
        "the chain change went as a netlink batch:\n{}",
        cp.agent_log_text()
    );
}
