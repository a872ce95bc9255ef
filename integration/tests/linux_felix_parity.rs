//! Felix's verdicts where our static and host-endpoint chains once differed, with real packets,
//! each scenario on both iptables backends (nft and legacy) and both families where the case
//! has two: a workload cannot spoof its source; SSH replies survive a doNotTrack deny-all host
//! endpoint; DNAT'd host traffic meets host endpoint egress policy; a `*` host endpoint's
//! applyOnForward deny blocks forwarded traffic and its doNotTrack policy leaves loopback alone;
//! a forward policy in one direction does not open the other. A scripted calc-server sends
//! exactly the messages each case needs. Each case also runs on the nftables driver (its own
//! test), where the test's own iptables rules (fixtures, counters) are made with iptables-nft.
//!
//! Needs root and the namespace tools: `#[ignore]`d with that reason, and `make test` runs it.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActivePolicyUpdate, HostEndpoint, HostEndpointId, HostEndpointUpdate, InSync, Policy, PolicyId,
    Rule, TierInfo,
};
use integration::driver_tests;
use integration::netns::{self, Driver, Ipt, Netns, Workload, nft_list, nft_packets, wait_until};
use integration::scripted::{ScriptedServer, allow_all_profile};

const NODE: &str = "node-p";

fn wep(name: &str, w: &Workload) -> Payload {
    test_support::wep(&format!("prod/{name}"))
        .active()
        .iface(&w.iface)
        .mac(&w.mac())
        .ipv4(&format!("{}/32", w.ipv4))
        .ipv6(&format!("{}/128", w.ipv6))
        .profile("kns.prod")
        .update()
}

/// What a scenario runs on: a driver and, for the linux driver, its iptables backend. The
/// test's own iptables rules (fixtures, counting rules) use `ipt`'s tools: iptables-nft with
/// the nftables driver.
#[derive(Clone, Copy)]
struct Case {
    driver: Driver,
    ipt: Ipt,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.driver {
            Driver::Linux => write!(f, "linux/{}", self.ipt.name()),
            Driver::Nftables => write!(f, "nftables"),
        }
    }
}

/// Runs `scenario` on `driver`: the linux driver on both iptables backends, the nftables
/// driver once.
fn on(driver: Driver, scenario: fn(Case)) {
    netns::require();
    match driver {
        Driver::Linux => {
            for ipt in Ipt::BOTH {
                scenario(Case { driver, ipt });
            }
        }
        Driver::Nftables => scenario(Case {
            driver,
            ipt: Ipt::Nft,
        }),
    }
}

/// An agent on one backend, killed when dropped.
struct Running {
    agent: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.agent.kill();
        let _ = self.agent.wait();
    }
}

/// `server` sends `snapshot`; the agent starts on `case`'s driver (and backend) in `host` and
/// is waited for until its first DataplaneInSync.
fn run(host: &Netns, server: &ScriptedServer, snapshot: Vec<Payload>, case: Case) -> Running {
    for p in snapshot {
        server.send(p);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let extra: &[&str] = match case.driver {
        Driver::Linux => &["--iptables-backend", case.ipt.name()],
        Driver::Nftables => &[],
    };
    let agent = server.start_agent_driver(case.driver, host, &log, extra);
    server.wait_dataplane_in_sync(1);
    Running {
        agent,
        log,
        _dir: dir,
    }
}

fn hep(endpoint_id: &str, endpoint: HostEndpoint) -> Payload {
    Payload::HostEndpointUpdate(HostEndpointUpdate {
        id: Some(HostEndpointId {
            endpoint_id: endpoint_id.into(),
        }),
        endpoint: Some(endpoint),
    })
}

/// The agent's log, for a failure message.
fn log_text(log: &Path) -> String {
    format!(
        "agent log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    )
}

/// What the host's tables hold on both families, with counters, for a failure message: the
/// iptables `table`, and with the nftables driver its tables too.
fn tables(host: &Netns, case: Case, table: &str) -> String {
    let mut text = [4, 6]
        .map(|f| host.exec(&[&case.ipt.tool(f, "save"), "-c", "-t", table]))
        .join("\n");
    if case.driver == Driver::Nftables {
        for family in ["ip", "ip6"] {
            text.push('\n');
            text.push_str(&nft_list(host, family));
        }
    }
    text
}

/// Packets counted by the first rule of `ns`'s INPUT chain whose spec contains `needle`.
fn input_count(ns: &Netns, save: &str, needle: &str) -> u64 {
    let text = ns.exec(&[save, "-c", "-t", "filter"]);
    text.lines()
        .find(|l| l.contains("-A INPUT") && l.contains(needle))
        .and_then(|l| l.strip_prefix('['))
        .and_then(|l| l.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counting rule for {needle} in:\n{text}"))
}

/// The MAC address of `iface` in `ns`.
fn mac(ns: &Netns, iface: &str) -> String {
    ns.exec(&["cat", &format!("/sys/class/net/{iface}/address")])
        .trim()
        .to_owned()
}

/// A TCP connection from `ns` to `addr:port` succeeds within 1 s.
fn connects(ns: &Netns, addr: &str, port: u16) -> bool {
    ns.try_exec(&["nc", "-z", "-w", "1", addr, &port.to_string()])
}

fn gnp(name: &str) -> PolicyId {
    PolicyId {
        name: name.into(),
        namespace: String::new(),
        kind: "GlobalNetworkPolicy".into(),
    }
}

fn rule(action: &str) -> Rule {
    Rule {
        action: action.into(),
        ..Default::default()
    }
}

driver_tests! {
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    a_workload_cannot_spoof_its_source => |d| on(d, spoofing);
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    ssh_replies_survive_a_do_not_track_deny_all_host_endpoint => |d| on(d, ssh_under_do_not_track);
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    dnat_host_traffic_meets_host_endpoint_egress_policy => |d| on(d, dnat_host_traffic);
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    wildcard_host_endpoint_polices_forwarded_traffic_and_ignores_untracked_policy =>
        |d| on(d, wildcard_host_endpoint);
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    a_one_way_forward_policy_does_not_open_the_other_direction => |d| on(d, one_way_forward_policy);
}

fn spoofing(case: Case) {
    let ipt = case.ipt;
    let host = Netns::new("rpf");
    host.make_host();
    let client = Workload::attach(&host, "calicli", "10.65.4.1", "fd00:65:4::1");
    let web = Workload::attach(&host, "caliweb", "10.65.4.2", "fd00:65:4::2");
    let server = ScriptedServer::start(&host, 50072, NODE);
    let agent = run(
        &host,
        &server,
        vec![
            allow_all_profile(),
            wep("client", &client),
            wep("web", &web),
            Payload::InSync(InSync {}),
        ],
        case,
    );

    // The web workload counts what reaches it from the client's own and a spoofed address.
    let (spoof4, spoof6) = ("10.65.4.99", "fd00:65:4::99");
    for (family, src) in [
        (4, client.ipv4.as_str()),
        (4, spoof4),
        (6, client.ipv6.as_str()),
        (6, spoof6),
    ] {
        web.ns
            .exec(&[&ipt.tool(family, ""), "-A", "INPUT", "-s", src]);
    }
    let (save4, save6) = (ipt.tool(4, "save"), ipt.tool(6, "save"));
    client
        .ns
        .exec(&["ip", "addr", "add", &format!("{spoof4}/32"), "dev", "eth0"]);
    client.ns.exec(&[
        "ip",
        "-6",
        "addr",
        "add",
        &format!("{spoof6}/128"),
        "dev",
        "eth0",
        "nodad",
    ]);
    wait_until(
        &format!("{case:?}: the client's own traffic reaches web"),
        Duration::from_secs(20),
        || {
            client
                .ns
                .try_exec(&["ping", "-c", "1", "-W", "1", &web.ipv4]);
            client
                .ns
                .try_exec(&["ping", "-6", "-c", "1", "-W", "1", &web.ipv6]);
            let own4 = input_count(&web.ns, &save4, &format!("-s {}/32", client.ipv4));
            let own6 = input_count(&web.ns, &save6, &format!("-s {}/128", client.ipv6));
            own4 > 0 && own6 > 0
        },
        || log_text(&agent.log),
    );
    for _ in 0..3 {
        client
            .ns
            .try_exec(&["ping", "-c", "1", "-W", "1", "-I", spoof4, &web.ipv4]);
        client
            .ns
            .try_exec(&["ping", "-6", "-c", "1", "-W", "1", "-I", spoof6, &web.ipv6]);
    }
    assert_eq!(
        input_count(&web.ns, &save4, &format!("-s {spoof4}/32")),
        0,
        "{case:?}: a spoofed IPv4 source reached the other workload"
    );
    assert_eq!(
        input_count(&web.ns, &save6, &format!("-s {spoof6}/128")),
        0,
        "{case:?}: a spoofed IPv6 source reached the other workload"
    );
    let (raw, rpf) = match case.driver {
        Driver::Linux => (host.exec(&[&save6, "-c", "-t", "raw"]), "rpfilter"),
        Driver::Nftables => (nft_list(&host, "ip6"), "fib saddr"),
    };
    let dropped = raw
        .lines()
        .find(|l| l.contains(rpf) && l.to_lowercase().contains("drop"))
        .unwrap_or_else(|| panic!("{case:?}: no RPF rule in the IPv6 raw table:\n{raw}"));
    let counted = match case.driver {
        Driver::Linux => !dropped.starts_with("[0:"),
        Driver::Nftables => nft_packets(dropped) > 0,
    };
    assert!(
        counted,
        "{case:?}: the IPv6 RPF rule dropped nothing: {dropped}"
    );
}

fn ssh_under_do_not_track(case: Case) {
    let host = Netns::new("dnt");
    host.make_host();
    let outside = Netns::outside_of(&host);
    let _ssh = host.listen(22, &["-4", "-6"]);
    let _other = host.listen(8080, &["-4", "-6"]);
    let server = ScriptedServer::start(&host, 50073, NODE);
    // As in Felix, doNotTrack policy on an IPv6 host endpoint also drops neighbour discovery
    // (failsafes are ports only): the neighbours are static here so that SSH's own packets
    // are what is tested.
    host.exec(&[
        "ip",
        "-6",
        "neigh",
        "replace",
        "2001:db8:2::2",
        "lladdr",
        &mac(&outside, "eth0"),
        "dev",
        "ext0",
        "nud",
        "permanent",
    ]);
    outside.exec(&[
        "ip",
        "-6",
        "neigh",
        "replace",
        "2001:db8:2::1",
        "lladdr",
        &mac(&host, "ext0"),
        "dev",
        "eth0",
        "nud",
        "permanent",
    ]);
    let pid = gnp("deny-all-untracked");
    let agent = run(
        &host,
        &server,
        vec![
            Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                id: Some(pid.clone()),
                policy: Some(Policy {
                    inbound_rules: vec![rule("deny")],
                    outbound_rules: vec![rule("deny")],
                    untracked: true,
                    ..Default::default()
                }),
            }),
            hep(
                "ext0",
                HostEndpoint {
                    name: "ext0".into(),
                    untracked_tiers: vec![TierInfo {
                        name: "default".into(),
                        ingress_policies: vec![pid.clone()],
                        egress_policies: vec![pid],
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ),
            Payload::InSync(InSync {}),
        ],
        case,
    );
    for addr in ["192.0.2.1", "2001:db8:2::1"] {
        wait_until(
            &format!("{case:?}: the doNotTrack deny-all takes effect on {addr}"),
            Duration::from_secs(20),
            || !connects(&outside, addr, 8080),
            || log_text(&agent.log),
        );
        assert!(
            connects(&outside, addr, 22),
            "{case:?}: SSH to {addr} must survive a doNotTrack deny-all (its replies too)\n{}",
            tables(&host, case, "raw")
        );
    }
}

fn dnat_host_traffic(case: Case) {
    let ipt = case.ipt;
    let host = Netns::new("dnat");
    host.make_host();
    let outside = Netns::outside_of(&host);
    // Replies to the node's own address (the source the first route lookup picked).
    outside.route_via_host();
    let _denied = outside.listen(9000, &["-4", "-6"]);
    let _allowed = outside.listen(9001, &["-4", "-6"]);
    // A "service" address the host reaches through DNAT, as kube-proxy would program it.
    for (family, service, port, to) in [
        (4, "10.96.0.10/32", "80", "192.0.2.2:9000"),
        (4, "10.96.0.10/32", "81", "192.0.2.2:9001"),
        (6, "fd00:96::10/128", "80", "[2001:db8:2::2]:9000"),
        (6, "fd00:96::10/128", "81", "[2001:db8:2::2]:9001"),
    ] {
        host.exec(&[
            &ipt.tool(family, ""),
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-d",
            service,
            "-p",
            "tcp",
            "--dport",
            port,
            "-j",
            "DNAT",
            "--to-destination",
            to,
        ]);
    }
    let server = ScriptedServer::start(&host, 50074, NODE);
    let pid = gnp("no-9000");
    let agent = run(
        &host,
        &server,
        vec![
            allow_all_profile(),
            Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                id: Some(pid.clone()),
                policy: Some(Policy {
                    outbound_rules: vec![
                        Rule {
                            action: "deny".into(),
                            protocol: Some(felix_proto::Protocol {
                                number_or_name: Some(felix_proto::protocol::NumberOrName::Name(
                                    "tcp".into(),
                                )),
                            }),
                            dst_ports: vec![felix_proto::PortRange {
                                first: 9000,
                                last: 9000,
                            }],
                            ..Default::default()
                        },
                        rule("allow"),
                    ],
                    ..Default::default()
                }),
            }),
            hep(
                "ext0",
                HostEndpoint {
                    name: "ext0".into(),
                    profile_ids: vec!["kns.prod".into()],
                    tiers: vec![TierInfo {
                        name: "default".into(),
                        egress_policies: vec![pid],
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ),
            Payload::InSync(InSync {}),
        ],
        case,
    );
    let want = [
        ("192.0.2.2", 9000, false),
        ("192.0.2.2", 9001, true),
        ("10.96.0.10", 80, false),
        ("10.96.0.10", 81, true),
        ("2001:db8:2::2", 9000, false),
        ("2001:db8:2::2", 9001, true),
        ("fd00:96::10", 80, false),
        ("fd00:96::10", 81, true),
    ];
    let got = std::cell::RefCell::new(Vec::new());
    wait_until(
        &format!("{case:?}: verdicts {want:?}"),
        Duration::from_secs(20),
        || {
            *got.borrow_mut() = want
                .iter()
                .map(|(a, p, _)| connects(&host, a, *p))
                .collect();
            got.borrow().iter().zip(&want).all(|(g, w)| *g == w.2)
        },
        || {
            format!(
                "got {:?}\n{}\n{}",
                got.borrow(),
                tables(&host, case, "mangle"),
                log_text(&agent.log)
            )
        },
    );
}

fn wildcard_host_endpoint(case: Case) {
    let host = Netns::new("star");
    host.make_host();
    let outside = Netns::outside_of(&host);
    outside.route_via_host();
    let _svc = outside.listen(9000, &["-4", "-6"]);
    let _local = host.listen(8080, &["-4", "-6"]);
    let client = Workload::attach(&host, "calicli", "10.65.5.1", "fd00:65:5::1");
    let server = ScriptedServer::start(&host, 50075, NODE);
    let agent = run(
        &host,
        &server,
        vec![
            allow_all_profile(),
            wep("client", &client),
            Payload::InSync(InSync {}),
        ],
        case,
    );
    let forwarded = || {
        [
            client.connects("192.0.2.2", 9000),
            client.connects("2001:db8:2::2", 9000),
        ]
    };
    let local = || {
        [
            connects(&host, "127.0.0.1", 8080),
            connects(&host, "::1", 8080),
        ]
    };
    let wait_for = |what: &str, check: &dyn Fn() -> bool| {
        wait_until(
            &format!("{case:?}: {what}"),
            Duration::from_secs(20),
            check,
            || {
                format!(
                    "{}\n{}",
                    tables(&host, case, "filter"),
                    log_text(&agent.log)
                )
            },
        )
    };
    wait_for("forwarded traffic flows before the host endpoint", &|| {
        forwarded() == [true, true]
    });

    let tier = |id: PolicyId| TierInfo {
        name: "default".into(),
        ingress_policies: vec![id.clone()],
        egress_policies: vec![id],
        ..Default::default()
    };
    for (name, untracked) in [("forward-deny", false), ("untracked-deny", true)] {
        server.send(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(gnp(name)),
            policy: Some(Policy {
                inbound_rules: vec![rule("deny")],
                outbound_rules: vec![rule("deny")],
                untracked,
                ..Default::default()
            }),
        }));
    }
    server.send(hep(
        "all-interfaces",
        HostEndpoint {
            name: "*".into(),
            profile_ids: vec!["kns.prod".into()],
            forward_tiers: vec![tier(gnp("forward-deny"))],
            untracked_tiers: vec![tier(gnp("untracked-deny"))],
            ..Default::default()
        },
    ));
    wait_for(
        "an applyOnForward deny on '*' blocks forwarded traffic",
        &|| forwarded() == [false, false],
    );
    assert_eq!(
        local(),
        [true, true],
        "{case:?}: doNotTrack policy on '*' must not touch the host's own (loopback) traffic"
    );
    let text = std::fs::read_to_string(&agent.log).unwrap_or_default();
    assert!(
        text.contains("do not apply to the '*' host endpoint"),
        "{case:?}: the ignored doNotTrack policy is reported:\n{text}"
    );
}

fn one_way_forward_policy(case: Case) {
    let ipt = case.ipt;
    let host = Netns::new("oneway");
    host.make_host();
    // The host's own firewall drops what nobody accepted, as on a Kubernetes node. Not with
    // the nftables driver: there our `accept` ends only our own base chain, and every other
    // base chain at the forward hook (iptables-nft's FORWARD among them) still sees the packet,
    // so a DROP policy there would drop what our policy accepts too (nftables semantics: a
    // packet passes a hook only if every base chain accepts it). What the DROP policy shows
    // with iptables (our chains do not accept the other direction) is read from the counters
    // of our FORWARD base chain instead (below).
    if case.driver == Driver::Linux {
        for family in [4, 6] {
            host.exec(&[&ipt.tool(family, ""), "-P", "FORWARD", "DROP"]);
        }
    }
    let outside = Netns::outside_of(&host);
    outside.route_via_host();
    let _svc = outside.listen(9000, &["-4", "-6"]);
    let mut pod = Workload::attach(&host, "calipod", "10.65.6.1", "fd00:65:6::1");
    pod.listen(8080);
    let server = ScriptedServer::start(&host, 50076, NODE);
    let allow_in = gnp("forward-in");
    let agent = run(
        &host,
        &server,
        vec![
            allow_all_profile(),
            wep("pod", &pod),
            Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                id: Some(allow_in.clone()),
                policy: Some(Policy {
                    inbound_rules: vec![rule("allow")],
                    ..Default::default()
                }),
            }),
            // applyOnForward policy for traffic arriving on ext0 only: nothing for traffic
            // leaving through it.
            hep(
                "ext0",
                HostEndpoint {
                    name: "ext0".into(),
                    // The host's own traffic on ext0 (IPv6 neighbour discovery among it) is open;
                    // forwarded traffic is what the forward tiers decide.
                    profile_ids: vec!["kns.prod".into()],
                    forward_tiers: vec![TierInfo {
                        name: "default".into(),
                        ingress_policies: vec![allow_in],
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ),
            Payload::InSync(InSync {}),
        ],
        case,
    );
    for (pod_addr, out_addr) in [(&pod.ipv4, "192.0.2.2"), (&pod.ipv6, "2001:db8:2::2")] {
        wait_until(
            &format!(
                "{case:?}: forwarded traffic the ingress forward policy allows reaches {pod_addr}"
            ),
            Duration::from_secs(20),
            || connects(&outside, pod_addr, 8080),
            || {
                format!(
                    "{}\n{}",
                    tables(&host, case, "filter"),
                    log_text(&agent.log)
                )
            },
        );
        // Leaving through ext0 there is no forward policy: Felix lets the packet fall through
        // to the rest of FORWARD, where the host's DROP policy applies; nothing accepts it
        // for us.
        match case.driver {
            Driver::Linux => assert!(
                !pod.connects(out_addr, 9000),
                "{case:?}: the one-way forward policy opened the other direction to \
                 {out_addr}:\n{}",
                tables(&host, case, "filter")
            ),
            Driver::Nftables => {
                nft_forward_verdicts(
                    &host,
                    case,
                    pod_addr,
                    out_addr,
                    &|| connects(&outside, pod_addr, 8080),
                    &|| pod.connects(out_addr, 9000),
                );
            }
        }
    }
}

/// The packets our FORWARD base chain (`filter-FORWARD` of the nftables driver's table of
/// `family`) accepted ("Policy explicitly accepted packet.") and let fall through to the
/// other base chains (its last rule, which sets the accept mark for the mangle chains).
fn nft_forward_counts(host: &Netns, family: &str) -> (u64, u64) {
    let chain = netns::nft_chain(host, family, "filter-FORWARD");
    let rules: Vec<&str> = chain
        .lines()
        .filter(|l| l.contains("counter packets"))
        .collect();
    let accepted = rules
        .iter()
        .find(|l| l.contains("Policy explicitly accepted packet.") && l.contains("accept"))
        .unwrap_or_else(|| panic!("no accept rule in our FORWARD chain:\n{chain}"));
    let fell_through = rules
        .last()
        .filter(|l| l.contains("mark set"))
        .unwrap_or_else(|| panic!("no final mark rule in our FORWARD chain:\n{chain}"));
    (nft_packets(accepted), nft_packets(fell_through))
}

/// With the nftables driver (no host DROP policy to make the difference visible as a failed
/// connection): a connection the forward policy allows is accepted by our FORWARD chain, one in
/// the other direction is not: it falls through to the rest of the hook.
fn nft_forward_verdicts(
    host: &Netns,
    case: Case,
    pod_addr: &str,
    out_addr: &str,
    allowed: &dyn Fn() -> bool,
    other_direction: &dyn Fn() -> bool,
) {
    let family = if out_addr.contains(':') { "ip6" } else { "ip" };
    let (accepted, _) = nft_forward_counts(host, family);
    assert!(allowed(), "{case:?}: outside -> {pod_addr}:8080 is allowed");
    let (accepted_after, _) = nft_forward_counts(host, family);
    assert!(
        accepted_after > accepted,
        "{case:?}: our FORWARD chain accepted the allowed connection to {pod_addr}:\n{}",
        netns::nft_chain(host, family, "filter-FORWARD")
    );
    let (accepted, fell_through) = nft_forward_counts(host, family);
    let passed = other_direction();
    let (accepted_after, fell_through_after) = nft_forward_counts(host, family);
    assert!(
        accepted_after == accepted && fell_through_after > fell_through,
        "{case:?}: the one-way forward policy accepted the other direction to {out_addr} \
         (the connection {}):\n{}",
        if passed { "passed" } else { "failed" },
        tables(host, case, "filter")
    );
}
