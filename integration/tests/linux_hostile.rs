//! The agent under attack, on a real kernel: a scripted calc-server in the node's namespace
//! sends `dataplane-agent` (each test once per driver, `--driver linux` and `--driver nftables`,
//! see [`driver_tests!`]) hostile messages (injection attempts in every string
//! that reaches restore input, netlink or sysctl paths; the host's own interfaces as endpoints;
//! prefixes that would take them over; deny-all on `lo`; values out of range; rules the kernel
//! takes but reads as "every protocol", on a workload's path), and the test checks what Calico
//! users rely on: the kernel outside our own chains is unchanged, denied traffic stays denied
//! (only the agent's own validation keeps it so: the kernel would program the widening rules),
//! the agent keeps its stream, refused endpoints report `error`, every log line is one event
//! whatever the names hold, and an unrelated policy change is enforced within seconds.
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
    ProfileId, Protocol, Rule, RuleMetadata, rule,
};
use integration::driver_tests;
use integration::netns::{self, Driver, Netns, Probe, Workload, nft_text};
use integration::scripted::{ScriptedServer, allow_all_profile};

const NODE: &str = "node-h";
const INJECT: &str = "x\n-A INPUT -j ACCEPT\n-A FORWARD -j ACCEPT\nCOMMIT\n*filter";

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
    let wep = test_support::wep(&format!("prod/{name}"))
        .active()
        .iface(iface)
        .mac(mac)
        .ipv4(&format!("{ip}/32"))
        .profile("kns.prod");
    if policies.is_empty() {
        wep.update()
    } else {
        wep.ingress_tier(tier, policies).update()
    }
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

/// The policies on web's path after web-guard that a kernel takes but that do not mean what
/// they seem: iptables reads protocol 0 and the protocol names `all` and `ip` as "every
/// protocol", so each rule would accept whatever web-guard left to the tier's end. Only the
/// agent's validation refuses them (failing each closed); the kernel never would, so without it
/// web's port 8080 opens.
const WIDENING: [&str; 3] = ["evil-proto-zero", "evil-proto-all", "evil-proto-ip"];

fn widening_policies() -> Vec<(&'static str, Payload)> {
    let allow = |p: NumberOrName| Rule {
        action: "allow".into(),
        protocol: Some(Protocol {
            number_or_name: Some(p),
        }),
        ..Default::default()
    };
    vec![
        (
            "protocol 0",
            policy(WIDENING[0], vec![allow(NumberOrName::Number(0))]),
        ),
        (
            "protocol all",
            policy(WIDENING[1], vec![allow(NumberOrName::Name("all".into()))]),
        ),
        (
            "protocol ip",
            policy(WIDENING[2], vec![allow(NumberOrName::Name("ip".into()))]),
        ),
    ]
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

/// Tables of `nft list ruleset` that [`outside_our_state`] leaves out: the nftables driver's
/// own tables (everything in them is ours), and the tables iptables-nft keeps its rules in.
/// Those are already compared through `iptables-nft-save` (our `cali` lines dropped); in nft's
/// own syntax they hold our rules too, and nothing marks them line by line (jumps, comments and
/// counters of the built-in chains all move with the agent and with traffic), so comparing
/// them here would only repeat iptables-save with noise.
fn skipped_nft_table(header: &str) -> bool {
    let mut words = header.split_whitespace();
    let (Some("table"), Some(family), Some(name)) = (words.next(), words.next(), words.next())
    else {
        return false;
    };
    match family {
        "ip" | "ip6" => {
            matches!(
                name,
                "calico" | "filter" | "nat" | "mangle" | "raw" | "security"
            )
        }
        _ => false,
    }
}

/// `nft list ruleset` without the tables [`skipped_nft_table`] names, counters dropped.
fn foreign_nft_ruleset(host: &Netns) -> String {
    let mut out = String::new();
    let mut skipping = false;
    for line in nft_text(host, &["list", "ruleset"]).lines() {
        if line.starts_with("table ") {
            skipping = skipped_nft_table(line);
        }
        if !skipping {
            // Packet counters move with traffic: `counter packets N bytes M …` → `counter …`.
            let line = match line.split_once("counter packets ") {
                Some((head, rest)) => {
                    let tail: Vec<&str> = rest.split(' ').skip(3).collect();
                    format!("{head}counter {}", tail.join(" "))
                        .trim_end()
                        .to_owned()
                }
                None => line.to_owned(),
            };
            out.push_str(&line);
            out.push('\n');
        }
        if line == "}" {
            skipping = false;
        }
    }
    out
}

/// Another tool's nftables table: an agent that flushed the ruleset or touched tables not its
/// own would change it.
fn add_foreign_nft_table(host: &Netns) {
    host.exec(&["nft", "add", "table", "inet", "foreign"]);
    host.exec(&["nft", "add", "chain", "inet", "foreign", "c"]);
    host.exec(&[
        "nft",
        "add",
        "rule",
        "inet",
        "foreign",
        "c",
        "ip",
        "saddr",
        "192.0.2.7",
        "counter",
        "accept",
    ]);
    host.exec(&[
        "nft",
        "add",
        "set",
        "inet",
        "foreign",
        "s",
        "{ type ipv4_addr; }",
    ]);
    host.exec(&[
        "nft",
        "add",
        "element",
        "inet",
        "foreign",
        "s",
        "{ 192.0.2.8 }",
    ]);
}

/// What the node's kernel holds outside the agent's own objects: iptables (nft and legacy,
/// both families, counters dropped), nftables (see [`foreign_nft_ruleset`]), IP sets, routes,
/// permanent neighbours and the sysctls of the host's own interfaces.
fn outside_our_state(host: &Netns) -> String {
    let mut out = String::new();
    out.push_str("## nft list ruleset (foreign tables)\n");
    let nft = foreign_nft_ruleset(host);
    assert!(
        nft.contains("table inet foreign"),
        "the foreign nft table is in the snapshot:\n{nft}"
    );
    out.push_str(&nft);
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

fn expect_within(
    what: &str,
    probes: &[Probe<'_>],
    secs: u64,
    log: &Path,
    host: &Netns,
    driver: Driver,
) {
    netns::expect_verdicts(what, probes, Duration::from_secs(secs), || {
        let rules = match driver {
            Driver::Linux => host.exec(&["iptables-save", "-c", "-t", "filter"]),
            Driver::Nftables => nft_text(host, &["list", "ruleset"]),
        };
        format!(
            "agent log:\n{}\nrules:\n{rules}",
            std::fs::read_to_string(log).unwrap_or_default(),
        )
    });
}

/// What an nftables run's log must never hold: the driver failing to apply its own input.
fn assert_no_apply_failure(driver: Driver, log: &str) {
    if driver == Driver::Nftables {
        assert!(
            !log.contains("apply failed") && !log.contains("nft -f failed"),
            "the nftables driver failed to apply:\n{log}"
        );
    }
}

/// Every line of a plain-format log starts like an event (with its timestamp): a name from the
/// stream or the datastore that reached the log with its newline raw would start a line with
/// whatever followed the newline (an injected `-A INPUT …`, or nothing). calc-server's own
/// start-up line (`calc-server: serving …`, on stdout) is not an event.
fn assert_one_event_per_line(who: &str, log: &str) {
    let starts_event = |l: &str| {
        let b = l.as_bytes();
        (b.len() > 20 && b[..4].iter().all(u8::is_ascii_digit) && b[4] == b'-' && b[10] == b'T')
            || l.starts_with("calc-server: serving ")
    };
    let forged: Vec<&str> = log.lines().filter(|l| !starts_event(l)).collect();
    assert!(
        forged.is_empty(),
        "{who} log lines that do not start an event: {forged:?}"
    );
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

driver_tests! {
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    a_hostile_stream_changes_nothing_outside_our_chains => hostile_stream;
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    datastore_attacks_are_refused_by_name_and_change_nothing_outside => datastore_attacks;
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    an_ip_set_changing_type_keeps_enforcing_and_settles => set_changing_type;
}

/// What a name from the stream holds to forge log lines: a newline and a whole fake event, a
/// carriage return, a terminal escape (clear screen) and a bidirectional override.
const FORGED_NAME: &str =
    "web\n2026-01-01T00:00:00.000000Z  INFO dataplane_agent: policy allowed everything";

/// Objects from a scripted stream whose names forge log lines reach a dry-run agent (which logs
/// every object it records, by key), once with plain and once with JSON logs: each event stays
/// one line, with the name escaped, and no raw control character reaches the log.
#[test]
#[ignore = "needs root and the namespace tools (ip): `make test` runs it"]
fn names_from_the_stream_forge_no_log_lines() {
    netns::require();
    let host = Netns::new("logforge");
    let server = ScriptedServer::start(&host, 50079, NODE);
    server.send(Payload::IpsetUpdate(IpSetUpdate {
        id: "s:x\r\u{1b}[2Jforged".into(),
        members: vec!["10.0.0.1".into()],
        r#type: 0,
    }));
    server.send(policy(FORGED_NAME, vec![]));
    server.send(Payload::ActiveProfileUpdate(ActiveProfileUpdate {
        id: Some(ProfileId {
            name: "kns.\u{202e}txt.exe\n".into(),
        }),
        profile: Some(Profile::default()),
    }));
    server.send(Payload::InSync(InSync {}));
    let dir = tempfile::tempdir().expect("tempdir");
    let mut agents = Vec::new();
    for format in ["plain", "json"] {
        let log = dir.path().join(format!("{format}.log"));
        let state = dir.path().join(format!("{format}.state.json"));
        let state = state.to_str().expect("utf-8 path");
        let args = [
            "--server",
            &server.url,
            "--node",
            NODE,
            "--driver",
            "dry-run",
            "--state-file",
            state,
            "--log-level",
            "info",
            "--log-format",
            format,
        ];
        let child = host.spawn(&integration::binary("dataplane-agent"), &args, &log);
        agents.push((child, log));
    }
    server.wait_dataplane_in_sync(2);
    let read = |log: &Path| {
        netns::wait_until(
            "the dry-run agent logged the policy",
            Duration::from_secs(10),
            || {
                std::fs::read_to_string(log)
                    .unwrap_or_default()
                    .contains("dry-run: policy")
            },
            || std::fs::read_to_string(log).unwrap_or_default(),
        );
        std::fs::read_to_string(log).unwrap_or_default()
    };
    let plain = read(&agents[0].1);
    let json = read(&agents[1].1);
    for (mut child, _) in agents {
        let _ = child.kill();
        let _ = child.wait();
    }
    let raw_control = |text: &str| {
        text.lines()
            .flat_map(str::chars)
            .any(|c| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c))
    };
    assert_one_event_per_line("plain-format agent", &plain);
    assert!(!raw_control(&plain), "a raw control character:\n{plain}");
    assert!(
        plain.contains("policy=NetworkPolicy/prod/web\\n2026-01-01T00:00:00.000000Z  INFO"),
        "the name is logged escaped:\n{plain}"
    );
    assert!(!raw_control(&json), "a raw control character:\n{json}");
    let events: Vec<serde_json::Value> = json
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: not one JSON event: {l:?}"))
        })
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e["fields"]["policy"] == format!("NetworkPolicy/prod/{FORGED_NAME}").as_str()),
        "the name decodes to what was sent:\n{json}"
    );
}

fn hostile_stream(driver: Driver) {
    netns::require();
    let host = Netns::new(&format!("hostile-{}", &driver.name()[..2]));
    host.make_host();
    // Another tool's IP set and nft table: an injected `flush` or `destroy` would reach them.
    host.exec(&["ipset", "create", "other-tool", "hash:ip"]);
    host.exec(&["ipset", "add", "other-tool", "192.0.2.7"]);
    add_foreign_nft_table(&host);
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
    let mut agent = server.start_agent_driver(driver, &host, &log, &[]);
    server.wait_dataplane_in_sync(1);
    let guarded = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&client, &web, 8080, false),
    ];
    expect_within("before the attack", &guarded, 20, &log, &host, driver);
    let before = outside_our_state(&host);

    // The widening policies, then web with them on its path after web-guard, before the rest
    // of the attack: the refused endpoints' statuses below come from an apply that holds them.
    for (_, p) in widening_policies() {
        server.send(p);
    }
    let mut web_path = vec![pid("web-guard")];
    web_path.extend(WIDENING.iter().map(|n| pid(n)));
    server.send(wep_with_mac(
        "web",
        "caliweb",
        "10.65.1.2",
        &web.mac(),
        &web_path,
        "default",
    ));
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
    // The widening policies are in force and failed closed: still only port 80 (a probe that
    // sees 8080 open fails here, whatever the logs say).
    expect_within("under attack", &guarded, 20, &log, &host, driver);
    // A deny-all host endpoint on lo is in place: established connections survive it, a new
    // one to the calc-server must pass the failsafe. Restart the agent (as after a crash).
    let _ = agent.kill();
    let _ = agent.wait();
    let log = dir.path().join("agent2.log");
    let mut agent = server.start_agent_driver(driver, &host, &log, &[]);
    // Back in sync behind deny-all on lo.
    server.wait_dataplane_in_sync(2);
    // An unrelated change after the attack is enforced within seconds.
    server.send(web_guard(&[80, 8080]));
    let opened = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&client, &web, 8080, true),
    ];
    expect_within(
        "the change after the attack",
        &opened,
        10,
        &log,
        &host,
        driver,
    );
    // Denied stays denied: back to port 80 only.
    server.send(web_guard(&[80]));
    expect_within("denied again", &guarded, 10, &log, &host, driver);

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
    assert_no_apply_failure(driver, &text);
    assert_no_apply_failure(driver, &std::fs::read_to_string(&log).unwrap_or_default());
    for object in [
        "policy np/prod/evil-protocol",
        "policy np/prod/evil-cidr",
        "policy np/prod/evil-ranges",
        "policy np/prod/evil-set",
        "policy np/prod/evil-proto-zero",
        "policy np/prod/evil-proto-all",
        "policy np/prod/evil-proto-ip",
        "workload endpoint k8s/prod/evil-uplink/eth0",
        "profile \"kns.evil profile\"",
    ] {
        assert!(
            text.contains(object),
            "{object} is not named in the log:\n{text}"
        );
    }
    // The names above held newlines and injected restore lines: each event is still one line.
    assert_one_event_per_line("agent", &text);
    assert_one_event_per_line(
        "restarted agent",
        &std::fs::read_to_string(&log).unwrap_or_default(),
    );
    assert!(
        text.contains("LogPrefix"),
        "the log prefix refusal is logged:\n{text}"
    );
}

const MANIFEST_NODE: &str = "node-a";

fn manifest_wep(pod: &str, iface: &str, ip: &str) -> String {
    netns::wep_manifest(MANIFEST_NODE, "prod", pod, iface)
        .label("app", pod)
        .calico_labels()
        .ipv4(ip)
        .render()
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
fn datastore_attacks(driver: Driver) {
    netns::require();
    let host = Netns::new(&format!("dsattack-{}", &driver.name()[..2]));
    host.make_host();
    host.exec(&["ipset", "create", "other-tool", "hash:ip"]);
    add_foreign_nft_table(&host);
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
    let cp = netns::ControlPlane::start_with_driver(driver, &host, d, MANIFEST_NODE, &[]);
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
        driver,
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
    expect_within(
        "under attack",
        &under_attack,
        20,
        &cp.agent_log,
        &host,
        driver,
    );
    match driver {
        Driver::Linux => {
            let sets = host.exec(&["ipset", "list"]);
            assert!(
                sets.contains("0.0.0.0/1") && sets.contains("128.0.0.0/1"),
                "a /0 member is programmed as its two halves:\n{sets}"
            );
        }
        Driver::Nftables => {
            // The network set is an interval set of our table holding the two halves (the
            // kernel keeps them as two intervals, nft prints them as networks).
            let sets = netns::nft_sets_holding(&host, "ip", "0.0.0.0/1");
            assert_eq!(
                sets.len(),
                1,
                "one set holds 0.0.0.0/1:\n{}",
                netns::nft_list(&host, "ip")
            );
            let set = nft_text(&host, &["list", "set", "ip", "calico", &sets[0]]);
            assert!(
                sets[0].starts_with("cali40s-")
                    && set.contains("flags interval")
                    && set.contains("0.0.0.0/1")
                    && set.contains("128.0.0.0/1"),
                "a /0 member is programmed as its two halves:\n{set}"
            );
        }
    }

    // An unrelated change is enforced within seconds.
    netns::write_manifest(d, "guard.yaml", &manifest_guard("80, 8080"));
    expect_within(
        "the change after the attack",
        &[tcp_probe(&client, &web, 8080, true)],
        20,
        &cp.agent_log,
        &host,
        driver,
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
    assert_one_event_per_line("calc-server", &server_log);
    assert_one_event_per_line("agent", &agent_log);
    assert!(
        agent_log.contains("workload endpoint k8s/prod/evil/eth0")
            && agent_log.contains("does not match the workload interface prefixes"),
        "the endpoint on the uplink is refused by name:\n{agent_log}"
    );
    assert_no_apply_failure(driver, &agent_log);
}

fn set_changing_type(driver: Driver) {
    match driver {
        Driver::Linux => ipset_changing_type(),
        Driver::Nftables => nft_set_changing_type(),
    }
}

/// The set-type scenario's start, shared by both drivers: a client in `s:clients` (hash:ip)
/// allowed to web:80, another workload not; the agent in sync.
struct SetTypeFixture {
    host: Netns,
    client: Workload,
    other: Workload,
    web: Workload,
    server: ScriptedServer,
    agent: std::process::Child,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn clients(r#type: i32, member: &str) -> Payload {
    Payload::IpsetUpdate(IpSetUpdate {
        id: "s:clients".into(),
        members: vec![member.into()],
        r#type,
    })
}

fn set_type_fixture(driver: Driver, ns: &str, port: u16) -> SetTypeFixture {
    netns::require();
    let host = Netns::new(ns);
    host.make_host();
    let client = Workload::attach(&host, "calicli", "10.65.7.1", "fd00:65:7::1");
    let other = Workload::attach(&host, "caliother", "10.65.7.3", "fd00:65:7::3");
    let mut web = Workload::attach(&host, "caliweb", "10.65.7.2", "fd00:65:7::2");
    web.listen(80);
    let server = ScriptedServer::start(&host, port, NODE);
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
    let agent = server.start_agent_driver(driver, &host, &log, &[]);
    server.wait_dataplane_in_sync(1);
    SetTypeFixture {
        host,
        client,
        other,
        web,
        server,
        agent,
        log,
        _dir: dir,
    }
}

/// The ipset way: the kernel cannot swap sets of different types, so the agent goes through a
/// temporary set (`cali4t…`) and moves the rules back.
fn ipset_changing_type() {
    let SetTypeFixture {
        host,
        client,
        other,
        web,
        server,
        mut agent,
        log,
        _dir,
    } = set_type_fixture(Driver::Linux, "settype-li", 50077);
    let verdicts = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&other, &web, 80, false),
    ];
    expect_within(
        "with a hash:ip set",
        &verdicts,
        20,
        &log,
        &host,
        Driver::Linux,
    );
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
    expect_within(
        "with the hash:net set",
        &verdicts,
        5,
        &log,
        &host,
        Driver::Linux,
    );
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

/// The nftables way: `cali40s-clients` goes from `type ipv4_addr` to an interval set (`flags
/// interval`) while rules refer to it; enforcement holds and the set ends with the new type.
fn nft_set_changing_type() {
    let SetTypeFixture {
        host,
        client,
        other,
        web,
        server,
        mut agent,
        log,
        _dir,
    } = set_type_fixture(Driver::Nftables, "settype-nf", 50078);
    let verdicts = [
        tcp_probe(&client, &web, 80, true),
        tcp_probe(&other, &web, 80, false),
    ];
    let set = || nft_text(&host, &["list", "set", "ip", "calico", "cali40s-clients"]);
    expect_within(
        "with an address set",
        &verdicts,
        20,
        &log,
        &host,
        Driver::Nftables,
    );
    let before = set();
    assert!(
        before.contains("type ipv4_addr")
            && !before.contains("interval")
            && before.contains("10.65.7.1"),
        "{before}"
    );

    server.send(clients(2, "10.65.7.0/31"));
    netns::wait_until(
        "the set is an interval set holding 10.65.7.0/31",
        Duration::from_secs(20),
        || {
            let s = set();
            s.contains("type ipv4_addr")
                && s.contains("flags interval")
                && s.contains("10.65.7.0/31")
        },
        || {
            format!(
                "{}\n{}",
                nft_text(&host, &["list", "ruleset"]),
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        },
    );
    expect_within(
        "with the interval set",
        &verdicts,
        5,
        &log,
        &host,
        Driver::Nftables,
    );
    let table = netns::nft_list(&host, "ip");
    assert!(
        table.contains("ip saddr @cali40s-clients"),
        "the rules still use the set by its own name:\n{table}"
    );
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_no_apply_failure(Driver::Nftables, &text);
    assert!(
        !text.contains("type does not match") && !text.contains("refused"),
        "{text}"
    );
    let _ = agent.kill();
    let _ = agent.wait();
}
