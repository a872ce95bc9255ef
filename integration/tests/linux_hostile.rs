//! The agent under attack, on a real kernel: a scripted calc-server in the node's namespace
//! sends `dataplane-agent --driver linux` hostile messages (injection attempts in every string
//! that reaches restore input, netlink or sysctl paths; the host's own interfaces as endpoints;
//! prefixes that would take them over; deny-all on `lo`; values out of range), and the test
//! checks what Calico users rely on: the kernel outside our own chains is unchanged, denied
//! traffic stays denied, the agent keeps its stream, refused endpoints report `error`, and an
//! unrelated policy change is enforced within seconds.
//!
//! Needs root and the namespace tools: `#[ignore]`d with that reason, and `make test` runs it.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use felix_proto::from_dataplane::Payload as Report;
use felix_proto::protocol::NumberOrName;
use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActivePolicyUpdate, ActiveProfileUpdate, ConfigUpdate, HostEndpoint, HostEndpointId,
    HostEndpointUpdate, IcmpTypeAndCode, InSync, IpSetUpdate, Policy, PolicyId, PortRange, Profile,
    ProfileId, Protocol, Rule, RuleMetadata, TierInfo, WorkloadEndpoint, WorkloadEndpointId,
    WorkloadEndpointUpdate, rule,
};
use integration::netns::{self, Netns, Probe, Workload};
use integration::scripted::{ScriptedServer, allow_all_profile};

const NODE: &str = "node-h";
const INJECT: &str = "x\n-A INPUT -j ACCEPT\n-A FORWARD -j ACCEPT\nCOMMIT\n*filter";

fn wep_id(name: &str) -> WorkloadEndpointId {
    WorkloadEndpointId {
        orchestrator_id: "k8s".into(),
        workload_id: format!("prod/{name}"),
        endpoint_id: "eth0".into(),
    }
}

fn pid(name: &str) -> PolicyId {
    PolicyId {
        name: name.into(),
        namespace: "prod".into(),
        kind: "NetworkPolicy".into(),
    }
}

fn tcp() -> Option<Protocol> {
    Some(Protocol {
        number_or_name: Some(NumberOrName::Name("tcp".into())),
    })
}

fn ports(first: i32, last: i32) -> Vec<PortRange> {
    vec![PortRange { first, last }]
}

fn policy(name: &str, rules: Vec<Rule>) -> Payload {
    Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(pid(name)),
        policy: Some(Policy {
            inbound_rules: rules,
            ..Default::default()
        }),
    })
}

/// web accepts the client on the given ports; the tier's end drops the rest.
fn web_guard(allowed_ports: &[i32]) -> Payload {
    policy(
        "web-guard",
        allowed_ports
            .iter()
            .map(|p| Rule {
                action: "allow".into(),
                protocol: tcp(),
                dst_ports: ports(*p, *p),
                src_ip_set_ids: vec!["s:clients".into()],
                ..Default::default()
            })
            .collect(),
    )
}

fn wep(name: &str, iface: &str, ip: &str, policies: &[PolicyId], tier: &str) -> Payload {
    wep_with_mac(name, iface, ip, "ee:ee:ee:ee:ee:ee", policies, tier)
}

fn wep_with_mac(
    name: &str,
    iface: &str,
    ip: &str,
    mac: &str,
    policies: &[PolicyId],
    tier: &str,
) -> Payload {
    Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
        id: Some(wep_id(name)),
        endpoint: Some(WorkloadEndpoint {
            state: "active".into(),
            name: iface.into(),
            mac: mac.into(),
            ipv4_nets: vec![format!("{ip}/32")],
            profile_ids: vec!["kns.prod".into()],
            tiers: if policies.is_empty() {
                vec![]
            } else {
                vec![TierInfo {
                    name: tier.into(),
                    ingress_policies: policies.to_vec(),
                    ..Default::default()
                }]
            },
            ..Default::default()
        }),
    })
}

fn config(pairs: &[(&str, &str)]) -> Payload {
    Payload::ConfigUpdate(ConfigUpdate {
        config: pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    })
}

/// Every message the attack sends: each alone would have injected rules, flushed sets, taken
/// over a host interface, cut the agent off or frozen the node before.
fn hostile_messages() -> Vec<(&'static str, Payload)> {
    let rule_with = |f: &dyn Fn(&mut Rule)| {
        let mut r = Rule {
            action: "allow".into(),
            ..Default::default()
        };
        f(&mut r);
        r
    };
    let mut out: Vec<(&'static str, Payload)> = vec![
        (
            "protocol name",
            policy(
                "evil-protocol",
                vec![rule_with(&|r| {
                    r.protocol = Some(Protocol {
                        number_or_name: Some(NumberOrName::Name(INJECT.into())),
                    })
                })],
            ),
        ),
        (
            "CIDR",
            policy(
                "evil-cidr",
                vec![rule_with(&|r| {
                    r.src_net = vec![format!("10.0.0.0/8 {INJECT}")]
                })],
            ),
        ),
        (
            "annotation with NUL and a trailing backslash",
            policy(
                "evil-annotation",
                vec![rule_with(&|r| {
                    r.metadata = Some(RuleMetadata {
                        annotations: [
                            ("a".to_owned(), "nul\0byte".to_owned()),
                            ("b".to_owned(), "ends in \\".to_owned()),
                        ]
                        .into(),
                    })
                })],
            ),
        ),
        (
            "IP set id",
            Payload::IpsetUpdate(IpSetUpdate {
                id: "s:x\nflush\ndestroy".into(),
                members: vec!["10.0.0.1".into()],
                r#type: 0,
            }),
        ),
        (
            "IP-and-port member",
            Payload::IpsetUpdate(IpSetUpdate {
                id: "s:ipport".into(),
                members: vec!["10.0.0.1,tcp:80\nflush".into(), "10.0.0.2,tcp:81".into()],
                r#type: 1,
            }),
        ),
        (
            "/0 member",
            Payload::IpsetUpdate(IpSetUpdate {
                id: "s:everything".into(),
                members: vec!["0.0.0.0/0".into()],
                r#type: 2,
            }),
        ),
        (
            "interface name",
            wep("evil-iface", &format!("cali{INJECT}"), "10.65.9.1", &[], ""),
        ),
        (
            "wildcard interface",
            wep("evil-plus", "cali+", "10.65.9.2", &[], ""),
        ),
        (
            "loopback endpoint",
            wep("evil-lo", "lo", "10.65.9.3", &[], ""),
        ),
        (
            "uplink endpoint",
            wep("evil-uplink", "uplink0", "10.65.9.4", &[], ""),
        ),
        (
            "tier name",
            wep(
                "evil-tier",
                "calievil",
                "10.65.9.5",
                &[pid("web-guard")],
                "t\\",
            ),
        ),
        (
            "values out of range",
            policy(
                "evil-ranges",
                vec![
                    rule_with(&|r| {
                        r.protocol = tcp();
                        r.dst_ports = ports(65536, 65536)
                    }),
                    rule_with(&|r| {
                        r.protocol = tcp();
                        r.dst_ports = ports(90, 80)
                    }),
                    rule_with(&|r| {
                        r.protocol = Some(Protocol {
                            number_or_name: Some(NumberOrName::Name("icmp".into())),
                        });
                        r.icmp = Some(rule::Icmp::IcmpTypeCode(IcmpTypeAndCode {
                            r#type: 256,
                            code: 0,
                        }))
                    }),
                    rule_with(&|r| {
                        r.protocol = Some(Protocol {
                            number_or_name: Some(NumberOrName::Number(256)),
                        })
                    }),
                    rule_with(&|r| r.dst_net = vec!["10.0.0.0/40".into()]),
                ],
            ),
        ),
        (
            "unknown IP set",
            policy(
                "evil-set",
                vec![rule_with(&|r| {
                    r.src_ip_set_ids = vec!["s:never-sent".into()]
                })],
            ),
        ),
        (
            "name with a space",
            Payload::ActiveProfileUpdate(ActiveProfileUpdate {
                id: Some(ProfileId {
                    name: "kns.evil profile".into(),
                }),
                profile: Some(Profile::default()),
            }),
        ),
        (
            "deny-all host endpoint on lo",
            Payload::HostEndpointUpdate(HostEndpointUpdate {
                id: Some(HostEndpointId {
                    endpoint_id: "lo-deny".into(),
                }),
                endpoint: Some(HostEndpoint {
                    name: "lo".into(),
                    ..Default::default()
                }),
            }),
        ),
    ];
    out.push((
        "wildcard host endpoint with a hostile tier",
        Payload::HostEndpointUpdate(HostEndpointUpdate {
            id: Some(HostEndpointId {
                endpoint_id: format!("all{INJECT}"),
            }),
            endpoint: Some(HostEndpoint {
                name: "*".into(),
                ..Default::default()
            }),
        }),
    ));
    out
}

/// What the node's kernel holds outside the agent's own objects: iptables (nft and legacy,
/// both families, counters dropped), IP sets, routes, permanent neighbours and the sysctls of
/// the host's own interfaces.
fn outside_our_state(host: &Netns) -> String {
    let mut out = String::new();
    for tool in [
        "iptables-nft-save",
        "ip6tables-nft-save",
        "iptables-legacy-save",
        "ip6tables-legacy-save",
    ] {
        out.push_str(&format!("## {tool}\n"));
        for line in host.exec(&[tool]).lines() {
            if line.starts_with('#') || line.contains("cali") {
                continue;
            }
            // Packet counters move with traffic.
            let line = match line.find(" [") {
                Some(i) if line.starts_with(':') => &line[..i],
                _ => line,
            };
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push_str("## ipsets\n");
    for set in host.exec(&["ipset", "list", "-n"]).lines() {
        if !set.starts_with("cali") {
            out.push_str(&host.exec(&["ipset", "list", set]));
        }
    }
    for args in [
        &["ip", "-4", "route", "show", "table", "all"][..],
        &["ip", "-6", "route", "show", "table", "all"],
        &["ip", "neigh", "show", "nud", "permanent"],
    ] {
        out.push_str(&format!("## {}\n", args.join(" ")));
        for line in host.exec(args).lines().filter(|l| !l.contains("cali")) {
            out.push_str(line);
            out.push('\n');
        }
    }
    for iface in ["uplink0", "lo", "all", "default"] {
        for key in [
            "ipv4/conf/{}/forwarding",
            "ipv4/conf/{}/rp_filter",
            "ipv4/conf/{}/proxy_arp",
            "ipv4/conf/{}/route_localnet",
            "ipv6/conf/{}/forwarding",
            "ipv6/conf/{}/proxy_ndp",
            "ipv6/conf/{}/accept_ra",
        ] {
            let path = format!("/proc/sys/net/{}", key.replace("{}", iface));
            out.push_str(&format!("{path}={}", host.exec(&["cat", &path])));
        }
    }
    out
}

fn tcp_probe<'a>(from: &'a Workload, to: &Workload, port: u16, allowed: bool) -> Probe<'a> {
    Probe {
        from,
        to: to.ipv4.clone(),
        port: Some(port),
        allowed,
    }
}

fn expect_within(what: &str, probes: &[Probe<'_>], secs: u64, log: &Path, host: &Netns) {
    netns::expect_verdicts(what, probes, Duration::from_secs(secs), || {
        format!(
            "agent log:\n{}\nfilter table:\n{}",
            std::fs::read_to_string(log).unwrap_or_default(),
            host.exec(&["iptables-save", "-c", "-t", "filter"])
        )
    });
}

/// The latest status each workload reported.
fn workload_statuses(server: &ScriptedServer) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for r in server.reports() {
        if let Some(Report::WorkloadEndpointStatusUpdate(u)) = r.payload
            && let (Some(id), Some(st)) = (u.id, u.status)
        {
            out.insert(id.workload_id, st.status);
        }
    }
    out
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn a_hostile_stream_changes_nothing_outside_our_chains() {
    netns::require();
    let host = Netns::new("hostile");
    host.make_host();
    // Another tool's IP set: an injected `flush` or `destroy` would reach it.
    host.exec(&["ipset", "create", "other-tool", "hash:ip"]);
    host.exec(&["ipset", "add", "other-tool", "192.0.2.7"]);
    let client = Workload::attach(&host, "calicli", "10.65.1.1", "fd00:65::1");
    let mut web = Workload::attach(&host, "caliweb", "10.65.1.2", "fd00:65::2");
    web.listen(80);
    web.listen(8080);

    let server = ScriptedServer::start(&host, 50071, NODE);
    for p in [
        Payload::IpsetUpdate(IpSetUpdate {
            id: "s:clients".into(),
            members: vec!["10.65.1.1".into()],
            r#type: 0,
        }),
        allow_all_profile(),
        web_guard(&[80]),
        wep_with_mac("client", "calicli", "10.65.1.1", &client.mac(), &[], ""),
        wep_with_mac(
            "web",
            "caliweb",
            "10.65.1.2",
            &web.mac(),
            &[pid("web-guard")],
            "default",
        ),
        Payload::InSync(InSync {}),
    ] {
        server.send(p);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let mut agent = server.start_agent(&host, &log);
    server.wait_dataplane_in_sync(1);
    let guarded = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&client, &web, 8080, false),
    ];
    expect_within("before the attack", &guarded, 20, &log, &host);
    let before = outside_our_state(&host);

    for (_, p) in hostile_messages() {
        server.send(p);
    }
    // FelixConfiguration comes whole in each ConfigUpdate: one attack at a time, each with an
    // injected log prefix, each seen refused before the next.
    let log_prefix = "x\" -j ACCEPT\n-I INPUT 1 -j ACCEPT\n#";
    for (prefix, refusal) in [
        ("uplink,cali", "matches host interface \"uplink0\""),
        ("lo,cali", "InterfacePrefix=\"lo,cali\""),
    ] {
        server.send(config(&[
            ("LogPrefix", log_prefix),
            ("InterfacePrefix", prefix),
        ]));
        netns::wait_until(
            &format!("{refusal} refused by name"),
            Duration::from_secs(10),
            || {
                std::fs::read_to_string(&log)
                    .unwrap_or_default()
                    .contains(refusal)
            },
            String::new,
        );
    }
    // The refused endpoints report `error` by name (the status path works under attack).
    server.wait_reports(
        "the refused endpoints as errors",
        Duration::from_secs(20),
        |_| {
            let st = workload_statuses(&server);
            [
                "evil-iface",
                "evil-plus",
                "evil-lo",
                "evil-uplink",
                "evil-tier",
            ]
            .iter()
            .all(|w| st.get(&format!("prod/{w}")).map(String::as_str) == Some("error"))
        },
    );
    assert_eq!(
        server.streams(),
        1,
        "the agent lost its stream under attack"
    );
    // A deny-all host endpoint on lo is in place: established connections survive it, a new
    // one to the calc-server must pass the failsafe. Restart the agent (as after a crash).
    let _ = agent.kill();
    let _ = agent.wait();
    let log = dir.path().join("agent2.log");
    let mut agent = server.start_agent(&host, &log);
    // Back in sync behind deny-all on lo.
    server.wait_dataplane_in_sync(2);
    // An unrelated change after the attack is enforced within seconds.
    server.send(web_guard(&[80, 8080]));
    let opened = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&client, &web, 8080, true),
    ];
    expect_within("the change after the attack", &opened, 10, &log, &host);
    // Denied stays denied: back to port 80 only.
    server.send(web_guard(&[80]));
    expect_within("denied again", &guarded, 10, &log, &host);

    let after = outside_our_state(&host);
    assert_eq!(
        before,
        after,
        "the kernel outside our chains changed; agent log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(server.streams(), 2, "the restarted agent lost its stream");
    let _ = agent.kill();
    let _ = agent.wait();
    let text = std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
    for object in [
        "policy np/prod/evil-protocol",
        "policy np/prod/evil-cidr",
        "policy np/prod/evil-ranges",
        "policy np/prod/evil-set",
        "workload endpoint k8s/prod/evil-uplink/eth0",
        "profile \"kns.evil profile\"",
    ] {
        assert!(
            text.contains(object),
            "{object} is not named in the log:\n{text}"
        );
    }
    assert!(
        text.contains("LogPrefix"),
        "the log prefix refusal is logged:\n{text}"
    );
}

const MANIFEST_NODE: &str = "node-a";

fn manifest_wep(pod: &str, iface: &str, ip: &str) -> String {
    format!(
        "apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--a-k8s-{pod}-eth0
  namespace: prod
  labels:
    app: {pod}
    projectcalico.org/namespace: prod
    projectcalico.org/orchestrator: k8s
spec:
  orchestrator: k8s
  node: {MANIFEST_NODE}
  pod: {pod}
  endpoint: eth0
  interfaceName: {iface}
  ipNetworks: [{ip}/32]
  profiles: [kns.prod]
---
"
    )
}

fn manifest_guard(ports: &str) -> String {
    format!(
        "apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: web-guard
  namespace: prod
spec:
  selector: app == 'web'
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: app == 'client'
    destination:
      ports: [{ports}]
"
    )
}

/// The datastore-side attacks through the real calc-server (file datastore): an injected log
/// prefix, an endpoint naming the uplink, a rule annotation ending in `\`, and a network set
/// holding `0.0.0.0/0` used by a policy. Each is refused by name or rendered safely; the
/// kernel outside our chains is unchanged; an unrelated change is enforced within seconds.
#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn datastore_attacks_are_refused_by_name_and_change_nothing_outside() {
    netns::require();
    let host = Netns::new("dsattack");
    host.make_host();
    host.exec(&["ipset", "create", "other-tool", "hash:ip"]);
    let client = Workload::attach(&host, "calicli", "10.65.2.1", "fd00:65:2::1");
    let mut web = Workload::attach(&host, "caliweb", "10.65.2.2", "fd00:65:2::2");
    for port in [80, 8080, 7777, 9999] {
        web.listen(port);
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    netns::write_manifest(
        d,
        "base.yaml",
        &format!(
            "apiVersion: projectcalico.org/v3
kind: Profile
metadata:
  name: kns.prod
spec:
  ingress: [{{action: Allow}}]
  egress: [{{action: Allow}}]
---
{}{}",
            manifest_wep("client", "calicli", "10.65.2.1"),
            manifest_wep("web", "caliweb", "10.65.2.2")
        ),
    );
    netns::write_manifest(d, "guard.yaml", &manifest_guard("80"));
    let cp = netns::ControlPlane::start(&host, d, MANIFEST_NODE, &[]);
    cp.wait_programmed();
    let before_attack = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&client, &web, 8080, false),
        tcp_probe(&client, &web, 7777, false),
    ];
    expect_within(
        "before the attack",
        &before_attack,
        20,
        &cp.agent_log,
        &host,
    );
    let before = outside_our_state(&host);

    netns::write_manifest(
        d,
        "felix.yaml",
        "apiVersion: projectcalico.org/v3
kind: FelixConfiguration
metadata:
  name: default
spec:
  logPrefix: \"x\\\" -j ACCEPT\\n-I INPUT 1 -j ACCEPT\\n#\"
",
    );
    netns::write_manifest(
        d,
        "evil.yaml",
        &manifest_wep("evil", "uplink0", "10.65.2.9"),
    );
    netns::write_manifest(
        d,
        "annotated.yaml",
        "apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: annotated
spec:
  order: 10
  selector: app == 'web'
  ingress:
  - action: Allow
    protocol: TCP
    destination:
      ports: [9999]
    metadata:
      annotations:
        note: 'ends in \\'
        nul: \"a\\0b\"
",
    );
    netns::write_manifest(
        d,
        "everything.yaml",
        "apiVersion: projectcalico.org/v3
kind: GlobalNetworkSet
metadata:
  name: everything
  labels:
    scope: everything
spec:
  nets: [0.0.0.0/0]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: from-anywhere
spec:
  order: 20
  selector: app == 'web'
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: scope == 'everything'
    destination:
      ports: [7777]
",
    );
    // The annotated rule and the /0 set are programmed (safely), the rest stays as it was.
    let under_attack = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&client, &web, 8080, false),
        tcp_probe(&client, &web, 7777, true),
        tcp_probe(&client, &web, 9999, true),
    ];
    expect_within("under attack", &under_attack, 20, &cp.agent_log, &host);
    let sets = host.exec(&["ipset", "list"]);
    assert!(
        sets.contains("0.0.0.0/1") && sets.contains("128.0.0.0/1"),
        "a /0 member is programmed as its two halves:\n{sets}"
    );

    // An unrelated change is enforced within seconds.
    netns::write_manifest(d, "guard.yaml", &manifest_guard("80, 8080"));
    expect_within(
        "the change after the attack",
        &[tcp_probe(&client, &web, 8080, true)],
        20,
        &cp.agent_log,
        &host,
    );
    assert_eq!(
        before,
        outside_our_state(&host),
        "the kernel outside our chains changed; agent log:\n{}",
        cp.agent_log_text()
    );
    let server_log = std::fs::read_to_string(&cp.server_log).unwrap_or_default();
    let agent_log = cp.agent_log_text();
    assert!(
        server_log.contains("FelixConfiguration") && server_log.contains("logPrefix"),
        "the log prefix is refused by name:\n{server_log}"
    );
    assert!(
        agent_log.contains("workload endpoint k8s/prod/evil/eth0")
            && agent_log.contains("does not match the workload interface prefixes"),
        "the endpoint on the uplink is refused by name:\n{agent_log}"
    );
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn an_ip_set_changing_type_keeps_enforcing_and_settles() {
    netns::require();
    let host = Netns::new("settype");
    host.make_host();
    let client = Workload::attach(&host, "calicli", "10.65.7.1", "fd00:65:7::1");
    let other = Workload::attach(&host, "caliother", "10.65.7.3", "fd00:65:7::3");
    let mut web = Workload::attach(&host, "caliweb", "10.65.7.2", "fd00:65:7::2");
    web.listen(80);
    let server = ScriptedServer::start(&host, 50077, NODE);
    let clients = |r#type: i32, member: &str| {
        Payload::IpsetUpdate(IpSetUpdate {
            id: "s:clients".into(),
            members: vec![member.into()],
            r#type,
        })
    };
    for p in [
        clients(0, "10.65.7.1"),
        allow_all_profile(),
        web_guard(&[80]),
        wep_with_mac("client", "calicli", "10.65.7.1", &client.mac(), &[], ""),
        wep_with_mac("other", "caliother", "10.65.7.3", &other.mac(), &[], ""),
        wep_with_mac(
            "web",
            "caliweb",
            "10.65.7.2",
            &web.mac(),
            &[pid("web-guard")],
            "default",
        ),
        Payload::InSync(InSync {}),
    ] {
        server.send(p);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let mut agent = server.start_agent(&host, &log);
    server.wait_dataplane_in_sync(1);
    let verdicts = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&other, &web, 80, false),
    ];
    expect_within("with a hash:ip set", &verdicts, 20, &log, &host);
    assert!(
        host.exec(&["ipset", "list", "cali40s:clients"])
            .contains("Type: hash:ip")
    );

    // The same set id now as a net set: the kernel cannot swap sets of different types, nor
    // destroy one that rules use.
    server.send(clients(2, "10.65.7.0/31"));
    netns::wait_until(
        "the set is hash:net and the temporary set is gone",
        Duration::from_secs(20),
        || {
            let list = host.exec(&["ipset", "list", "-n"]);
            host.exec(&["ipset", "list", "cali40s:clients"])
                .contains("Type: hash:net")
                && !list.lines().any(|l| l.starts_with("cali4t"))
        },
        || {
            format!(
                "{}\n{}",
                host.exec(&["ipset", "list"]),
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        },
    );
    expect_within("with the hash:net set", &verdicts, 5, &log, &host);
    let save = host.exec(&["iptables-save", "-t", "filter"]);
    assert!(save.contains("--match-set cali40s:clients src"), "{save}");
    assert!(
        !save.contains("cali4t"),
        "the rules are back on the set's own name:\n{save}"
    );
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !text.contains("type does not match") && !text.contains("refused"),
        "{text}"
    );
    let _ = agent.kill();
    let _ = agent.wait();
}
