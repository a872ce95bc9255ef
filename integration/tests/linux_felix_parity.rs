//! Felix's verdicts where our static and host-endpoint chains once differed, with real packets:
//! a workload cannot spoof its source (IPv4 and IPv6), and SSH replies survive a doNotTrack
//! deny-all host endpoint. A scripted calc-server sends exactly the messages each case needs.
//!
//! Needs root and the namespace tools: `#[ignore]`d with that reason, and `make test` runs it.

use std::path::Path;
use std::process::Child;
use std::time::Duration;

use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActivePolicyUpdate, ActiveProfileUpdate, HostEndpoint, HostEndpointId, HostEndpointUpdate,
    InSync, Policy, PolicyId, Profile, ProfileId, Rule, TierInfo, WorkloadEndpoint,
    WorkloadEndpointId, WorkloadEndpointUpdate,
};
use integration::netns::{self, Netns, Workload, wait_until};
use integration::scripted::ScriptedServer;

const NODE: &str = "node-p";

fn allow_all_profile() -> Payload {
    let allow = || Rule {
        action: "allow".into(),
        ..Default::default()
    };
    Payload::ActiveProfileUpdate(ActiveProfileUpdate {
        id: Some(ProfileId {
            name: "kns.prod".into(),
        }),
        profile: Some(Profile {
            inbound_rules: vec![allow()],
            outbound_rules: vec![allow()],
        }),
    })
}

fn wep(name: &str, w: &Workload) -> Payload {
    Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
        id: Some(WorkloadEndpointId {
            orchestrator_id: "k8s".into(),
            workload_id: format!("prod/{name}"),
            endpoint_id: "eth0".into(),
        }),
        endpoint: Some(WorkloadEndpoint {
            state: "active".into(),
            name: w.iface.clone(),
            mac: w.mac(),
            ipv4_nets: vec![format!("{}/32", w.ipv4)],
            ipv6_nets: vec![format!("{}/128", w.ipv6)],
            profile_ids: vec!["kns.prod".into()],
            ..Default::default()
        }),
    })
}

/// Starts the agent against `server` in `host` and waits for its first DataplaneInSync.
fn start_agent(host: &Netns, server: &ScriptedServer, log: &Path) -> Child {
    let agent = server.start_agent(host, log);
    server.wait_dataplane_in_sync(1);
    agent
}

/// The agent's log, for a failure message.
fn log_text(log: &Path) -> String {
    format!(
        "agent log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    )
}

/// Packets counted by the first rule of `ns`'s INPUT chain whose spec contains `needle`.
fn input_count(ns: &Netns, tool: &str, needle: &str) -> u64 {
    let save = ns.exec(&[tool, "-c", "-t", "filter"]);
    save.lines()
        .find(|l| l.contains("-A INPUT") && l.contains(needle))
        .and_then(|l| l.strip_prefix('['))
        .and_then(|l| l.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counting rule for {needle} in:\n{save}"))
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn a_workload_cannot_spoof_its_source() {
    netns::require();
    let host = Netns::new("rpf");
    host.make_host();
    let client = Workload::attach(&host, "calicli", "10.65.4.1", "fd00:65:4::1");
    let web = Workload::attach(&host, "caliweb", "10.65.4.2", "fd00:65:4::2");
    let server = ScriptedServer::start(&host, 50072, NODE);
    for p in [
        allow_all_profile(),
        wep("client", &client),
        wep("web", &web),
        Payload::InSync(InSync {}),
    ] {
        server.send(p);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let mut agent = start_agent(&host, &server, &log);

    // The web workload counts what reaches it from the client's own and a spoofed address.
    let (spoof4, spoof6) = ("10.65.4.99", "fd00:65:4::99");
    for (tool, src) in [
        ("iptables", client.ipv4.as_str()),
        ("iptables", spoof4),
        ("ip6tables", client.ipv6.as_str()),
        ("ip6tables", spoof6),
    ] {
        web.ns.exec(&[tool, "-A", "INPUT", "-s", src]);
    }
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
        "the client's own traffic reaches web",
        Duration::from_secs(20),
        || {
            client
                .ns
                .try_exec(&["ping", "-c", "1", "-W", "1", &web.ipv4]);
            client
                .ns
                .try_exec(&["ping", "-6", "-c", "1", "-W", "1", &web.ipv6]);
            let own4 = input_count(&web.ns, "iptables-save", &format!("-s {}/32", client.ipv4));
            let own6 = input_count(
                &web.ns,
                "ip6tables-save",
                &format!("-s {}/128", client.ipv6),
            );
            own4 > 0 && own6 > 0
        },
        || log_text(&log),
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
        input_count(&web.ns, "iptables-save", &format!("-s {spoof4}/32")),
        0,
        "a spoofed IPv4 source reached the other workload"
    );
    assert_eq!(
        input_count(&web.ns, "ip6tables-save", &format!("-s {spoof6}/128")),
        0,
        "a spoofed IPv6 source reached the other workload"
    );
    let raw = host.exec(&["ip6tables-save", "-c", "-t", "raw"]);
    let dropped = raw
        .lines()
        .find(|l| l.contains("rpfilter") && l.contains("DROP"))
        .unwrap_or_else(|| panic!("no RPF rule in the IPv6 raw table:\n{raw}"));
    assert!(
        !dropped.starts_with("[0:"),
        "the IPv6 RPF rule dropped nothing: {dropped}"
    );
    let _ = agent.kill();
    let _ = agent.wait();
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn ssh_replies_survive_a_do_not_track_deny_all_host_endpoint() {
    netns::require();
    let host = Netns::new("dnt");
    host.make_host();
    let outside = Netns::outside_of(&host);
    let _ssh = host.listen(22, &["-4"]);
    let _other = host.listen(8080, &["-4"]);
    let server = ScriptedServer::start(&host, 50073, NODE);
    let deny = || Rule {
        action: "deny".into(),
        ..Default::default()
    };
    let pid = PolicyId {
        name: "deny-all-untracked".into(),
        namespace: String::new(),
        kind: "GlobalNetworkPolicy".into(),
    };
    for p in [
        Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pid.clone()),
            policy: Some(Policy {
                inbound_rules: vec![deny()],
                outbound_rules: vec![deny()],
                untracked: true,
                ..Default::default()
            }),
        }),
        Payload::HostEndpointUpdate(HostEndpointUpdate {
            id: Some(HostEndpointId {
                endpoint_id: "ext0".into(),
            }),
            endpoint: Some(HostEndpoint {
                name: "ext0".into(),
                untracked_tiers: vec![TierInfo {
                    name: "default".into(),
                    ingress_policies: vec![pid.clone()],
                    egress_policies: vec![pid],
                    ..Default::default()
                }],
                ..Default::default()
            }),
        }),
        Payload::InSync(InSync {}),
    ] {
        server.send(p);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let mut agent = start_agent(&host, &server, &log);
    let connects = |port: &str| outside.try_exec(&["nc", "-z", "-w", "1", "192.0.2.1", port]);
    wait_until(
        "the doNotTrack deny-all takes effect",
        Duration::from_secs(20),
        || !connects("8080"),
        || log_text(&log),
    );
    assert!(
        connects("22"),
        "SSH to the host must survive a doNotTrack deny-all (its replies too)\n{}",
        host.exec(&["iptables-save", "-c", "-t", "raw"])
    );
    let _ = agent.kill();
    let _ = agent.wait();
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn dnat_host_traffic_meets_host_endpoint_egress_policy() {
    netns::require();
    let host = Netns::new("dnat");
    host.make_host();
    let outside = Netns::outside_of(&host);
    // Replies to the node's own address (the source the first route lookup picked).
    outside.exec(&["ip", "route", "add", "default", "via", "192.0.2.1"]);
    let _denied = outside.listen(9000, &["-4"]);
    let _allowed = outside.listen(9001, &["-4"]);
    // A "service" address the host reaches through DNAT, as kube-proxy would program it.
    for (port, to) in [("80", "192.0.2.2:9000"), ("81", "192.0.2.2:9001")] {
        host.exec(&[
            "iptables",
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-d",
            "10.96.0.10/32",
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
    let pid = PolicyId {
        name: "no-9000".into(),
        namespace: String::new(),
        kind: "GlobalNetworkPolicy".into(),
    };
    for p in [
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
                    Rule {
                        action: "allow".into(),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
        }),
        Payload::HostEndpointUpdate(HostEndpointUpdate {
            id: Some(HostEndpointId {
                endpoint_id: "ext0".into(),
            }),
            endpoint: Some(HostEndpoint {
                name: "ext0".into(),
                profile_ids: vec!["kns.prod".into()],
                tiers: vec![TierInfo {
                    name: "default".into(),
                    egress_policies: vec![pid],
                    ..Default::default()
                }],
                ..Default::default()
            }),
        }),
        Payload::InSync(InSync {}),
    ] {
        server.send(p);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let mut agent = start_agent(&host, &server, &log);
    let connects = |addr: &str, port: &str| host.try_exec(&["nc", "-z", "-w", "1", addr, port]);
    let want = [
        ("192.0.2.2", "9000", false),
        ("192.0.2.2", "9001", true),
        ("10.96.0.10", "80", false),
        ("10.96.0.10", "81", true),
    ];
    let got = std::cell::RefCell::new(Vec::new());
    wait_until(
        &format!("verdicts {want:?}"),
        Duration::from_secs(20),
        || {
            *got.borrow_mut() = want.iter().map(|(a, p, _)| connects(a, p)).collect();
            got.borrow().iter().zip(&want).all(|(g, w)| *g == w.2)
        },
        || {
            format!(
                "got {:?}\n{}\n{}",
                got.borrow(),
                host.exec(&["iptables-save", "-c", "-t", "mangle"]),
                log_text(&log)
            )
        },
    );
    let _ = agent.kill();
    let _ = agent.wait();
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn wildcard_host_endpoint_polices_forwarded_traffic_and_ignores_untracked_policy() {
    netns::require();
    let host = Netns::new("star");
    host.make_host();
    let outside = Netns::outside_of(&host);
    outside.exec(&["ip", "route", "add", "default", "via", "192.0.2.1"]);
    let _svc = outside.listen(9000, &["-4"]);
    let _local = host.listen(8080, &["-4"]);
    let client = Workload::attach(&host, "calicli", "10.65.5.1", "fd00:65:5::1");
    let server = ScriptedServer::start(&host, 50075, NODE);
    for p in [
        allow_all_profile(),
        wep("client", &client),
        Payload::InSync(InSync {}),
    ] {
        server.send(p);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let mut agent = start_agent(&host, &server, &log);
    let forwarded = || client.connects("192.0.2.2", 9000);
    let local = || host.try_exec(&["nc", "-z", "-w", "1", "127.0.0.1", "8080"]);
    let wait_for = |what: &str, check: &dyn Fn() -> bool| {
        wait_until(what, Duration::from_secs(20), check, || {
            format!(
                "{}\n{}",
                host.exec(&["iptables-save", "-c"]),
                log_text(&log)
            )
        })
    };
    wait_for(
        "forwarded traffic flows before the host endpoint",
        &forwarded,
    );

    let deny = || Rule {
        action: "deny".into(),
        ..Default::default()
    };
    let gnp = |name: &str| PolicyId {
        name: name.into(),
        namespace: String::new(),
        kind: "GlobalNetworkPolicy".into(),
    };
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
                inbound_rules: vec![deny()],
                outbound_rules: vec![deny()],
                untracked,
                ..Default::default()
            }),
        }));
    }
    server.send(Payload::HostEndpointUpdate(HostEndpointUpdate {
        id: Some(HostEndpointId {
            endpoint_id: "all-interfaces".into(),
        }),
        endpoint: Some(HostEndpoint {
            name: "*".into(),
            profile_ids: vec!["kns.prod".into()],
            forward_tiers: vec![tier(gnp("forward-deny"))],
            untracked_tiers: vec![tier(gnp("untracked-deny"))],
            ..Default::default()
        }),
    }));
    wait_for(
        "an applyOnForward deny on '*' blocks forwarded traffic",
        &|| !forwarded(),
    );
    assert!(
        local(),
        "doNotTrack policy on '*' must not touch the host's own (loopback) traffic"
    );
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("do not apply to the '*' host endpoint"),
        "the ignored doNotTrack policy is reported:\n{text}"
    );
    let _ = agent.kill();
    let _ = agent.wait();
}
