//! The Linux driver as a whole, against in-memory seams (a fake kernel for `iptables-*` and
//! `ipset`, fake netlink and sysctl): what the managers program together, in what order, and
//! what an operator sees (statuses, refusals, `/programmed`).

use super::fake::FakeKernel;
use super::*;
use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActivePolicyRemove, ActivePolicyUpdate, IpSetUpdate, Policy, PolicyId, Profile, Rule, TierInfo,
    WorkloadEndpointId, WorkloadEndpointRemove, WorkloadEndpointUpdate,
};
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;

/// A runner over a shared fake kernel, so the test can look at it while the driver owns
/// the runner.
#[derive(Clone)]
struct Shared(Arc<Mutex<FakeKernel>>);

impl CommandRunner for Shared {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> std::io::Result<runner::Output> {
        self.0.lock().run(program, args, stdin)
    }
}

fn msg(p: Payload) -> Message {
    Message::try_from(p).expect("a valid message")
}

fn pol_id() -> PolicyId {
    PolicyId {
        name: "web".into(),
        namespace: "prod".into(),
        kind: "NetworkPolicy".into(),
    }
}

fn policy(untracked: bool) -> Message {
    msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(pol_id()),
        policy: Some(Policy {
            inbound_rules: vec![Rule {
                action: "allow".into(),
                src_ip_set_ids: vec!["s:clients".into()],
                ..Default::default()
            }],
            untracked,
            ..Default::default()
        }),
    }))
}

/// The set `policy()` uses.
fn clients_set() -> Message {
    msg(Payload::IpsetUpdate(IpSetUpdate {
        id: "s:clients".into(),
        members: vec!["10.65.0.1/32".into()],
        r#type: 2,
    }))
}

fn wep_id() -> WorkloadEndpointId {
    WorkloadEndpointId {
        orchestrator_id: "k8s".into(),
        workload_id: "prod/web".into(),
        endpoint_id: "eth0".into(),
    }
}

fn wep(iface: &str) -> Message {
    msg(Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
        id: Some(wep_id()),
        endpoint: Some(WorkloadEndpoint {
            state: "active".into(),
            name: iface.into(),
            ipv4_nets: vec!["10.65.0.2/32".into()],
            tiers: vec![TierInfo {
                name: "default".into(),
                ingress_policies: vec![pol_id()],
                egress_policies: vec![],
                default_action: "Deny".into(),
            }],
            ..Default::default()
        }),
    }))
}

/// Netlink over a shared fake routing table.
#[derive(Clone)]
struct SharedNl(Arc<Mutex<netlink::FakeNetlink>>);

impl Netlink for SharedNl {
    fn links(&mut self) -> std::io::Result<Vec<netlink::LinkInfo>> {
        self.0.lock().links()
    }
    fn routes(&mut self, v: IpVersion, p: u8) -> std::io::Result<Vec<netlink::RouteEntry>> {
        self.0.lock().routes(v, p)
    }
    fn add_route(&mut self, r: &netlink::RouteEntry, p: u8) -> std::io::Result<()> {
        self.0.lock().add_route(r, p)
    }
    fn del_route(&mut self, r: &netlink::RouteEntry, p: u8) -> std::io::Result<()> {
        self.0.lock().del_route(r, p)
    }
    fn set_neighbour(&mut self, i: u32, ip: IpAddr, mac: [u8; 6]) -> std::io::Result<()> {
        self.0.lock().set_neighbour(i, ip, mac)
    }
}

struct Rig {
    nl: Arc<Mutex<netlink::FakeNetlink>>,
    ifaces: Arc<Interfaces>,
}

fn rig() -> (LinuxDriver, Arc<Mutex<FakeKernel>>, Rig) {
    rig_with(LinuxOptions {
        backend: Backend::IptablesNft,
        ..LinuxOptions::default()
    })
}

fn rig_with(opts: LinuxOptions) -> (LinuxDriver, Arc<Mutex<FakeKernel>>, Rig) {
    let kernel = Arc::new(Mutex::new(FakeKernel::new()));
    let nl = Arc::new(Mutex::new(netlink::FakeNetlink::default()));
    let ifaces = Interfaces::new();
    let mut sysctl = sysctl::FakeSysctl::default();
    sysctl
        .values
        .insert("kernel/osrelease".into(), "6.1.0-13-amd64".into());
    let d = LinuxDriver::with_seams(
        opts,
        Box::new(Shared(kernel.clone())),
        Some(Box::new(SharedNl(nl.clone()))),
        Box::new(sysctl),
        ifaces.clone(),
    );
    (d, kernel, Rig { nl, ifaces })
}

fn driver() -> (LinuxDriver, Arc<Mutex<FakeKernel>>) {
    let (d, k, rig) = rig();
    // Interfaces known and up for the endpoints the tests use.
    for (i, name) in ["caliweb", "caliweb2"].iter().enumerate() {
        rig.ifaces.upsert(netlink::LinkInfo {
            index: 10 + i as u32,
            name: (*name).into(),
            oper_up: true,
        });
    }
    rig.ifaces.upsert(netlink::LinkInfo {
        index: 1,
        name: "lo".into(),
        oper_up: true,
    });
    (d, k)
}

#[test]
fn programmed_objects_name_the_chains_the_renderer_programs() {
    let (mut d, k) = driver();
    let long = PolicyId {
        name: "allow-the-frontend-to-reach-the-backend".into(),
        namespace: "prod".into(),
        kind: "NetworkPolicy".into(),
    };
    d.on_update(&clients_set());
    d.on_update(&policy(false));
    d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(long.clone()),
        policy: Some(Policy {
            tier: "default".into(),
            ..Default::default()
        }),
    })));
    d.on_update(&msg(Payload::ActiveProfileUpdate(
        felix_proto::ActiveProfileUpdate {
            id: Some(felix_proto::ProfileId {
                name: "kns.prod".into(),
            }),
            profile: Some(Profile::default()),
        },
    )));
    let mut ep = wep("caliweb");
    if let Message::WorkloadEndpointUpdate { endpoint: e, .. } = &mut ep {
        e.tiers[0].egress_policies.push(long.clone());
        e.profile_ids.push("kns.prod".into());
    }
    d.on_update(&ep);
    d.apply().unwrap();

    let dump = d.programmed_objects().expect("the linux driver reports");
    let p = dump
        .policies
        .iter()
        .find(|p| p.name == long.name)
        .expect("listed");
    let mut expected = vec![
        rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &long),
        rules::policy_chain_name(rules::POLICY_OUTBOUND_PFX, &long),
    ];
    expected.sort();
    assert_eq!(p.chains, expected);
    assert!(
        p.chains.iter().all(|c| !c.contains(&long.name)),
        "a long id is hashed, which is why the dump exists: {:?}",
        p.chains
    );
    assert_eq!(
        (p.tier.as_str(), p.kind.as_str(), p.namespace.as_str()),
        ("default", "NetworkPolicy", "prod")
    );
    assert_eq!(p.endpoints, ["k8s/prod/web/eth0"]);
    let web = dump.policies.iter().find(|p| p.name == "web").unwrap();
    assert_eq!(web.tier, "default", "from the endpoint's tier");
    let profile = &dump.profiles[0];
    assert_eq!(
        profile.chains,
        [
            rules::profile_chain_name(rules::PROFILE_INBOUND_PFX, "kns.prod"),
            rules::profile_chain_name(rules::PROFILE_OUTBOUND_PFX, "kns.prod"),
        ]
    );
    let [endpoint] = dump.endpoints.as_slice() else {
        panic!("one endpoint: {:?}", dump.endpoints)
    };
    assert_eq!(endpoint.interface, "caliweb");
    // Every chain the dump names is in the kernel, in both families.
    let kernel = k.lock();
    let named = dump
        .policies
        .iter()
        .flat_map(|p| &p.chains)
        .chain(dump.profiles.iter().flat_map(|p| &p.chains))
        .chain(&endpoint.chains);
    for chain in named {
        for v in IpVersion::BOTH {
            assert!(kernel.has_chain(v, "filter", chain), "{chain} (v{v:?})");
        }
    }
    drop(kernel);

    d.on_update(&msg(Payload::WorkloadEndpointRemove(
        WorkloadEndpointRemove { id: Some(wep_id()) },
    )));
    d.apply().unwrap();
    let dump = d.programmed_objects().unwrap();
    assert!(dump.endpoints.is_empty());
    assert!(dump.policies.iter().all(|p| p.endpoints.is_empty()));
}

#[test]
fn programs_endpoints_policies_and_sets_then_cleans_up() {
    let (mut d, k) = driver();
    d.on_update(&msg(Payload::IpsetUpdate(IpSetUpdate {
        id: "s:clients".into(),
        members: vec!["10.65.0.1/32".into(), "fd00::1/128".into()],
        r#type: 2,
    })));
    d.on_update(&policy(false));
    d.on_update(&wep("caliweb"));
    d.apply().unwrap();
    {
        let k = k.lock();
        let v4 = IpVersion::V4;
        assert!(k.has_chain(v4, "filter", "cali-pi-np/prod/web"));
        assert!(k.has_chain(v4, "filter", "cali-tw-caliweb"));
        assert!(k.has_chain(IpVersion::V6, "filter", "cali-tw-caliweb"));
        let dispatch = k.chain_rules(v4, "filter", "cali-to-wl-dispatch");
        assert!(dispatch[0].contains("--out-interface caliweb --goto cali-tw-caliweb"));
        assert!(dispatch.last().unwrap().contains("Unknown interface"));
        assert_eq!(k.set("cali40s:clients").unwrap().members.len(), 1);
        assert_eq!(k.set("cali60s:clients").unwrap().members.len(), 1);
    }
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["up"]
    );

    // The interface is renamed: old chains go, new ones come, dispatch follows.
    d.on_update(&wep("caliweb2"));
    d.apply().unwrap();
    {
        let k = k.lock();
        assert!(!k.has_chain(IpVersion::V4, "filter", "cali-tw-caliweb"));
        assert!(k.has_chain(IpVersion::V4, "filter", "cali-tw-caliweb2"));
    }

    // An untracked policy moves to the raw table (workloads never use untracked policy: the
    // server sends the endpoint without it in the same batch).
    d.on_update(&policy(true));
    d.on_update(&msg(Payload::WorkloadEndpointUpdate(
        WorkloadEndpointUpdate {
            id: Some(wep_id()),
            endpoint: Some(WorkloadEndpoint {
                state: "active".into(),
                name: "caliweb2".into(),
                ..Default::default()
            }),
        },
    )));
    d.apply().unwrap();
    {
        let k = k.lock();
        assert!(!k.has_chain(IpVersion::V4, "filter", "cali-pi-np/prod/web"));
        assert!(k.has_chain(IpVersion::V4, "raw", "cali-pi-np/prod/web"));
    }

    // Everything removed: our chains and sets go; the hooks and static chains stay.
    d.on_update(&msg(Payload::WorkloadEndpointRemove(
        WorkloadEndpointRemove { id: Some(wep_id()) },
    )));
    d.on_update(&msg(Payload::ActivePolicyRemove(ActivePolicyRemove {
        id: Some(pol_id()),
    })));
    d.on_update(&msg(Payload::IpsetRemove(felix_proto::IpSetRemove {
        id: "s:clients".into(),
    })));
    d.apply().unwrap();
    let k = k.lock();
    let chains = k.chain_names(IpVersion::V4, "filter");
    assert!(
        !chains
            .iter()
            .any(|c| c.starts_with("cali-tw-") || c.starts_with("cali-pi-")),
        "{chains:?}"
    );
    assert!(!k.has_chain(IpVersion::V4, "raw", "cali-pi-np/prod/web"));
    // Only the (empty) IPAM pool sets of the NAT rule remain.
    assert_eq!(
        k.set_names(),
        vec![
            "cali40masq-ipam-pools",
            "cali40network-ip-pools",
            "cali60masq-ipam-pools",
            "cali60network-ip-pools"
        ]
    );
    assert!(k.chain_rules(IpVersion::V4, "filter", "FORWARD")[0].contains("cali-FORWARD"));
    assert!(d.endpoint_statuses().workloads.is_empty());
}

fn rule_with(f: impl FnOnce(&mut Rule)) -> Rule {
    let mut r = Rule {
        action: "allow".into(),
        ..Default::default()
    };
    f(&mut r);
    r
}

fn policy_named(name: &str, rule: Rule) -> Message {
    msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(PolicyId {
            name: name.into(),
            namespace: String::new(),
            kind: "GlobalNetworkPolicy".into(),
        }),
        policy: Some(Policy {
            inbound_rules: vec![rule],
            ..Default::default()
        }),
    }))
}

/// A hostile stream: every refused object is named with its reason and held failing
/// closed, every valid one is programmed, and no restore line carries anything the
/// messages did not describe.
#[test]
fn hostile_messages_are_refused_by_key_and_the_rest_applies() {
    use felix_proto::protocol::NumberOrName;
    let (mut d, k) = driver();
    let set = |id: &str, members: &[&str]| {
        msg(Payload::IpsetUpdate(IpSetUpdate {
            id: id.into(),
            members: members.iter().map(|m| (*m).to_owned()).collect(),
            r#type: 2,
        }))
    };
    d.on_update(&set("s:clients", &["10.65.0.1/32"]));
    d.on_update(&set("s:x\ndestroy", &["10.0.0.1"]));
    d.on_update(&set("s:bad", &["0.0.0.0/0", "10.0.0.0/40"]));
    d.on_update(&set("s:all", &["0.0.0.0/0"]));
    d.on_update(&policy(false));
    d.on_update(&policy_named(
        "uses-bad",
        rule_with(|r| r.src_ip_set_ids = vec!["s:bad".into()]),
    ));
    d.on_update(&policy_named(
        "uses-missing",
        rule_with(|r| r.src_ip_set_ids = vec!["s:never-sent".into()]),
    ));
    d.on_update(&policy_named(
        "proto",
        rule_with(|r| {
            r.protocol = Some(felix_proto::Protocol {
                number_or_name: Some(NumberOrName::Name("tcp\n-A INPUT -j ACCEPT".into())),
            })
        }),
    ));
    d.on_update(&policy_named(
        "port",
        rule_with(|r| {
            r.dst_ports = vec![felix_proto::PortRange {
                first: 1,
                last: 65536,
            }]
        }),
    ));
    d.on_update(&policy_named(
        "annotated",
        rule_with(|r| {
            r.metadata = Some(felix_proto::RuleMetadata {
                annotations: [(
                    "note".to_owned(),
                    "ends in \\\" \n-A INPUT -j ACCEPT\0".to_owned(),
                )]
                .into(),
            })
        }),
    ));
    d.on_update(&wep("caliweb"));
    d.on_update(&msg(Payload::WorkloadEndpointUpdate(
        WorkloadEndpointUpdate {
            id: Some(WorkloadEndpointId {
                workload_id: "prod/hijack".into(),
                ..wep_id()
            }),
            endpoint: Some(WorkloadEndpoint {
                state: "active".into(),
                name: "eth0".into(),
                ..Default::default()
            }),
        },
    )));
    d.on_update(&msg(Payload::ConfigUpdate(felix_proto::ConfigUpdate {
        config: [(
            "LogPrefix".to_owned(),
            "x\"\n-I INPUT 1 -j ACCEPT".to_owned(),
        )]
        .into(),
        ..Default::default()
    })));
    d.apply().expect("everything valid applies");

    let rejected = d.rejected();
    let refused: Vec<&str> = rejected.keys().map(String::as_str).collect();
    assert_eq!(
        refused,
        [
            "ipset \"s:bad\"",
            "ipset \"s:x\\ndestroy\"",
            "policy gnp/port",
            "policy gnp/proto",
            "policy gnp/uses-bad",
            "policy gnp/uses-missing",
            "workload endpoint k8s/prod/hijack/eth0",
        ]
    );
    assert!(d.rejected()["policy gnp/port"].contains("65536"));
    assert!(d.rejected()["workload endpoint k8s/prod/hijack/eth0"].contains("prefixes"));
    let statuses = d.endpoint_statuses().workloads;
    assert_eq!(statuses.values().collect::<Vec<_>>(), ["error", "up"]);
    assert_eq!(d.metrics().rejected, Some(7));

    let k = k.lock();
    let v4 = IpVersion::V4;
    // The valid objects are programmed.
    assert!(k.has_chain(v4, "filter", "cali-tw-caliweb"));
    assert!(k.has_chain(v4, "filter", "cali-pi-np/prod/web"));
    assert!(!k.has_chain(v4, "filter", "cali-tw-eth0"));
    // Refused policies keep their chains, which drop whatever reaches them.
    for name in ["uses-bad", "uses-missing", "proto", "port"] {
        let rules = k.chain_rules(v4, "filter", &format!("cali-pi-gnp/{name}"));
        assert!(
            rules.iter().any(|r| r.ends_with("--jump DROP")),
            "{name}: {rules:?}"
        );
        assert!(
            !rules
                .iter()
                .any(|r| r.contains("ACCEPT") || r.contains("0x10000/0x10000")),
            "{name}: {rules:?}"
        );
    }
    // A /0 becomes its two halves; the refused member is left out.
    let members = |name: &str| {
        let mut m: Vec<String> = k.set(name).unwrap().members.iter().cloned().collect();
        m.sort();
        m
    };
    assert_eq!(members("cali40s:all"), ["0.0.0.0/1", "128.0.0.0/1"]);
    assert_eq!(members("cali40s:bad"), ["0.0.0.0/1", "128.0.0.0/1"]);
    assert!(k.set("cali40s:x\ndestroy").is_none());
    // No restore line says anything it was not built to say: read back as the tools read
    // them, every rule is in a chain of ours or jumps to one, and no ipset command names a
    // set that is not ours.
    for (program, args, input) in &k.calls {
        for line in input.lines() {
            if program.contains("tables") && line.starts_with('-') {
                let a = rules::quote::split_restore_line(line).unwrap();
                let ours = a[1].starts_with("cali")
                    || a.iter().any(|x| x.starts_with("cali:"))
                    || a.windows(2).any(|w| {
                        matches!(w[0].as_str(), "--jump" | "--goto" | "-j" | "-g")
                            && w[1].starts_with("cali-")
                    });
                assert!(ours, "{program}: {line}");
            }
            if program == "ipset" && args.iter().any(|a| a == "restore") {
                let words: Vec<&str> = line.split_whitespace().collect();
                assert!(
                    words.len() < 2 || words[1].starts_with("cali"),
                    "ipset: {line}"
                );
            }
        }
    }
    let annotated = k.chain_rules(v4, "filter", "cali-pi-gnp/annotated");
    assert!(
        annotated
            .iter()
            .any(|r| r.contains("note=ends in __ _-A INPUT -j ACCEPT_")),
        "{annotated:?}"
    );
    let log_prefix_lines = k
        .calls
        .iter()
        .flat_map(|c| c.2.lines())
        .filter(|l| l.contains("--log-prefix"))
        .count();
    assert_eq!(log_prefix_lines, 0, "no LOG rule was asked for");
    drop(k);

    // The poisoned set comes back clean: the policy using it is programmed as sent again
    // and no longer reported.
    d.on_update(&set("s:bad", &["10.0.0.0/8"]));
    d.apply().unwrap();
    let rejected = d.rejected();
    assert!(!rejected.contains_key("ipset \"s:bad\""), "{rejected:?}");
    assert!(
        !rejected.contains_key("policy gnp/uses-bad"),
        "{rejected:?}"
    );
    assert!(
        rejected.contains_key("policy gnp/uses-missing"),
        "{rejected:?}"
    );
    assert_eq!(d.metrics().rejected, Some(5));
}

mod hostile {
    //! Hostile policy messages against the fake kernel, judged by an oracle that does not ask
    //! `validate`: every generated field is drawn either from values the agent must accept or
    //! from values it must refuse, so whether a policy is valid is known by construction, and
    //! what is checked is the kernel's input (every line in our chains, nothing from the
    //! message outside a quoted comment) and what the policy's chain does.
    use super::*;
    use proptest::prelude::*;

    /// A generated value and whether the agent must accept it.
    type Judged<T> = (T, bool);

    /// Characters no name, id, protocol, action or address may hold: they split restore
    /// arguments, end lines, open or escape quotes, or are not ASCII.
    const BAD_CHARS: &[char] = &[
        ' ', '\n', '\r', '\t', '"', '\'', '\\', '\0', '\u{1b}', 'é', '/', '#',
    ];

    /// Text holding at least one [`BAD_CHARS`] character between two non-blank parts (so no
    /// trimming makes it valid), or one of the classic injections.
    fn hostile() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => ("[a-z0-9:.-]{1,8}", prop::sample::select(BAD_CHARS), "[a-zA-Z0-9:.-]{1,8}")
                .prop_map(|(a, c, b)| format!("{a}{c}{b}")),
            1 => Just("x\"\n-A INPUT -j ACCEPT\n".to_owned()),
            1 => Just("tcp -j ACCEPT".to_owned()),
            1 => Just("allow\n-I INPUT 1 -j ACCEPT\nCOMMIT".to_owned()),
            1 => Just("a\\".to_owned()),
            1 => Just("a\0b".to_owned()),
        ]
    }

    /// Text for fields where anything is acceptable (a rule's annotation).
    fn any_text() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "[ -~]{0,20}",
            any::<String>(),
            hostile()
        ]
    }

    fn name() -> impl Strategy<Value = Judged<String>> {
        prop_oneof![
            3 => "[A-Za-z0-9._:-]{1,40}".prop_map(|n| (n, true)),
            1 => "[a-z]{254,260}".prop_map(|n| (n, false)),
            1 => Just((String::new(), false)),
            3 => hostile().prop_map(|n| (n, false)),
        ]
    }

    fn action() -> impl Strategy<Value = Judged<String>> {
        prop_oneof![
            4 => prop::sample::select(&["allow", "deny", "pass", "next-tier", "log"][..])
                .prop_map(|a| (a.to_owned(), true)),
            1 => prop::sample::select(&["ACCEPT", "Allow", "drop", "allow "][..])
                .prop_map(|a| (a.to_owned(), false)),
            1 => hostile().prop_map(|a| (a, false)),
        ]
    }

    fn protocol() -> impl Strategy<Value = Judged<Option<felix_proto::Protocol>>> {
        use felix_proto::protocol::NumberOrName;
        let p = |n: NumberOrName| {
            Some(felix_proto::Protocol {
                number_or_name: Some(n),
            })
        };
        prop_oneof![
            2 => Just((None, true)),
            2 => prop::sample::select(&["tcp", "udp", "icmp", "sctp", "udplite", "TCP", "Udp"][..])
                .prop_map(move |n| (p(NumberOrName::Name(n.to_owned())), true)),
            1 => (1i32..=255).prop_map(move |n| (p(NumberOrName::Number(n)), true)),
            // `all`, `ip` and 0 mean "every protocol" to iptables.
            1 => prop::sample::select(&["all", "ip", "ALL", "0", "6"][..])
                .prop_map(move |n| (p(NumberOrName::Name(n.to_owned())), false)),
            1 => prop_oneof![-5i32..=0, 256i32..70000]
                .prop_map(move |n| (p(NumberOrName::Number(n)), false)),
            1 => hostile().prop_map(move |n| (p(NumberOrName::Name(n)), false)),
        ]
    }

    fn net() -> impl Strategy<Value = Judged<String>> {
        prop_oneof![
            3 => (any::<[u8; 4]>(), 0u8..=32)
                .prop_map(|(a, l)| (format!("{}/{l}", std::net::Ipv4Addr::from(a)), true)),
            1 => any::<[u8; 4]>().prop_map(|a| (std::net::Ipv4Addr::from(a).to_string(), true)),
            1 => (any::<u128>(), 0u8..=128)
                .prop_map(|(a, l)| (format!("{}/{l}", std::net::Ipv6Addr::from(a)), true)),
            1 => (any::<[u8; 4]>(), 33u8..=255)
                .prop_map(|(a, l)| (format!("{}/{l}", std::net::Ipv4Addr::from(a)), false)),
            1 => (any::<u128>(), 129u16..=300)
                .prop_map(|(a, l)| (format!("{}/{l}", std::net::Ipv6Addr::from(a)), false)),
            2 => hostile().prop_map(|n| (n, false)),
        ]
    }

    fn ports() -> impl Strategy<Value = Judged<felix_proto::PortRange>> {
        let range = |first, last| felix_proto::PortRange { first, last };
        prop_oneof![
            3 => (0i32..=65535, 0i32..=65535)
                .prop_map(move |(a, b)| (range(a.min(b), a.max(b)), true)),
            1 => (0i32..=65534, 1i32..=1000).prop_map(move |(a, d)| {
                let last = a;
                let first = (a + d).min(65535);
                (range(first, last), first <= last)
            }),
            1 => (prop_oneof![-100_000i32..0, 65536i32..200_000], 0i32..=65535)
                .prop_map(move |(bad, good)| (range(bad, good), false)),
            1 => (0i32..=65535, 65536i32..200_000)
                .prop_map(move |(good, bad)| (range(good, bad), false)),
        ]
    }

    fn icmp() -> impl Strategy<Value = Judged<Option<felix_proto::rule::Icmp>>> {
        use felix_proto::rule::Icmp;
        prop_oneof![
            3 => Just((None, true)),
            1 => (0i32..=255).prop_map(|t| (Some(Icmp::IcmpType(t)), true)),
            1 => (0i32..=255, 0i32..=255).prop_map(|(t, code)| {
                (Some(Icmp::IcmpTypeCode(felix_proto::IcmpTypeAndCode { r#type: t, code })), true)
            }),
            1 => prop_oneof![-100i32..0, 256i32..1000].prop_map(|t| (Some(Icmp::IcmpType(t)), false)),
            1 => (0i32..=255, prop_oneof![-100i32..0, 256i32..1000]).prop_map(|(t, code)| {
                (Some(Icmp::IcmpTypeCode(felix_proto::IcmpTypeAndCode { r#type: t, code })), false)
            }),
        ]
    }

    /// An IP set id: the set the test programs, one never sent, or a hostile one.
    fn set_id() -> impl Strategy<Value = Judged<String>> {
        prop_oneof![
            4 => Just(("s:known".to_owned(), true)),
            1 => Just(("s:never-sent".to_owned(), false)),
            1 => hostile().prop_map(|s| (s, false)),
        ]
    }

    fn all_valid<T>(items: Vec<Judged<T>>) -> (Vec<T>, bool) {
        let ok = items.iter().all(|(_, ok)| *ok);
        (items.into_iter().map(|(v, _)| v).collect(), ok)
    }

    prop_compose! {
        fn rule()(action in action(), protocol in protocol(),
                  src_net in prop::collection::vec(net(), 0..3), dst_net in prop::collection::vec(net(), 0..2),
                  src_ports in prop::collection::vec(ports(), 0..3), dst_ports in prop::collection::vec(ports(), 0..3),
                  icmp in icmp(), sets in prop::collection::vec(set_id(), 0..2),
                  note in any_text()) -> Judged<Rule> {
            let (src_net, ok_src) = all_valid(src_net);
            let (dst_net, ok_dst) = all_valid(dst_net);
            let (src_ports, ok_sp) = all_valid(src_ports);
            let (dst_ports, ok_dp) = all_valid(dst_ports);
            let (sets, ok_sets) = all_valid(sets);
            let valid = action.1 && protocol.1 && icmp.1 && ok_src && ok_dst && ok_sp && ok_dp && ok_sets;
            (Rule {
                action: action.0,
                protocol: protocol.0,
                src_net, dst_net, src_ports, dst_ports,
                icmp: icmp.0,
                src_ip_set_ids: sets.clone(),
                not_dst_ip_set_ids: sets,
                metadata: Some(felix_proto::RuleMetadata { annotations: [("note".to_owned(), note)].into() }),
                ..Default::default()
            }, valid)
        }
    }

    /// Whether one restore line carries nothing from a message outside a quoted comment:
    /// outside quotes only the bytes of names, addresses, ports and marks (and `!` as a word);
    /// a quoted argument only as the value of `--comment` (or of `--log-prefix`, which comes
    /// from the agent's settings), and holding no control character.
    fn only_quoted_comments(line: &str) -> Result<(), String> {
        let bytes = line.as_bytes();
        let mut i = 0;
        let mut previous_word = "";
        let mut word_start = 0;
        while i < bytes.len() {
            match bytes[i] {
                b' ' => {
                    previous_word = &line[word_start..i];
                    i += 1;
                    word_start = i;
                }
                b'"' => {
                    // The log prefix is the agent's own setting, not the message's.
                    if previous_word != "--comment" && previous_word != "--log-prefix" {
                        return Err(format!("a quoted argument after {previous_word:?}"));
                    }
                    i += 1;
                    while i < bytes.len() && bytes[i] != b'"' {
                        if bytes[i] == b'\\' {
                            i += 1;
                        }
                        if bytes.get(i).is_some_and(|b| b.is_ascii_control()) {
                            return Err("a control byte in a quoted argument".into());
                        }
                        i += 1;
                    }
                    if i == bytes.len() {
                        return Err("an unterminated quote".into());
                    }
                    i += 1;
                }
                b if rules::quote::is_bare(b) => i += 1,
                // Negation, a word of its own.
                b'!' if i == word_start && bytes.get(i + 1) == Some(&b' ') => i += 1,
                b => return Err(format!("byte {b:#04x} outside quotes")),
            }
        }
        Ok(())
    }

    /// Every line of an `iptables-restore` input: a table, a chain of ours declared, a
    /// command on a chain of ours (or on a built-in chain, carrying our `cali:` rule id), or
    /// COMMIT; each within [`only_quoted_comments`].
    fn check_restore_input(input: &str) -> Result<(), String> {
        for line in input.lines() {
            if line.is_empty() || line.starts_with('#') || line == "COMMIT" {
                continue;
            }
            if let Some(t) = line.strip_prefix('*') {
                if !["filter", "raw", "mangle", "nat"].contains(&t) {
                    return Err(format!("table {t:?}: {line:?}"));
                }
                continue;
            }
            if let Some(decl) = line.strip_prefix(':') {
                // `:<chain> <policy> [<packets>:<bytes>]`, the chain ours.
                let parts: Vec<&str> = decl.split(' ').collect();
                let counters = |c: &str| {
                    c.strip_prefix('[')
                        .and_then(|c| c.strip_suffix(']'))
                        .and_then(|c| c.split_once(':'))
                        .is_some_and(|(p, b)| p.parse::<u64>().is_ok() && b.parse::<u64>().is_ok())
                };
                let ok = matches!(parts.as_slice(), [name, "-", c]
                    if name.starts_with("cali") && name.bytes().all(rules::quote::is_bare) && counters(c));
                if !ok {
                    return Err(format!("not a declaration of a chain of ours: {line:?}"));
                }
                continue;
            }
            only_quoted_comments(line).map_err(|e| format!("{e}: {line:?}"))?;
            let args = rules::quote::split_restore_line(line)?;
            let ours = args.get(1).is_some_and(|c| c.starts_with("cali"))
                || args.iter().any(|a| a.starts_with("cali:"));
            if !matches!(args[0].as_str(), "-A" | "-I" | "-R" | "-D" | "-F" | "-X") || !ours {
                return Err(format!("not a command on a chain of ours: {line:?}"));
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Whatever a policy message holds, the apply succeeds; the policy is refused exactly
        /// when one of its fields was drawn from the refused values, and then its chain only
        /// drops; every restore line stays in our chains, with nothing from the message outside
        /// a quoted comment.
        #[test]
        fn any_policy_message_applies_safely(
            name in name(),
            rules in prop::collection::vec(rule(), 0..4),
        ) {
            let (mut d, k) = driver();
            d.on_update(&msg(Payload::IpsetUpdate(IpSetUpdate { id: "s:known".into(), members: vec!["10.0.0.1".into()], r#type: 2 })));
            let (rules, rules_ok) = all_valid(rules);
            let valid = name.1 && rules_ok;
            let id = PolicyId { name: name.0, namespace: String::new(), kind: "GlobalNetworkPolicy".into() };
            d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                id: Some(id.clone()),
                policy: Some(Policy { inbound_rules: rules.clone(), ..Default::default() }),
            })));
            prop_assert!(d.apply().is_ok());
            let rejected = d.rejected();
            prop_assert_eq!(rejected.is_empty(), valid, "{:?}", rejected);
            let k = k.lock();
            let chain = rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &id);
            prop_assert!(chain.bytes().all(rules::quote::is_bare));
            prop_assert!(k.has_chain(IpVersion::V4, "filter", &chain));
            let got = k.chain_rules(IpVersion::V4, "filter", &chain);
            if valid {
                // An allow rule the IPv4 chain must carry: no address of another family, not
                // ICMPv6: it sets the accept mark.
                let renders_allow = rules.iter().any(|r| {
                    r.action == "allow" && r.src_net.is_empty() && r.dst_net.is_empty()
                });
                if renders_allow {
                    prop_assert!(got.iter().any(|r| r.contains("0x10000/0x10000")), "{:?}", got);
                }
            } else {
                // Refused: programmed as a deny of everything (Felix's deny sets a mark and
                // drops on it), nothing accepted or passed on.
                prop_assert!(got.iter().any(|r| r.ends_with("--jump DROP")), "{:?}", got);
                prop_assert!(
                    !got.iter().any(|r| r.contains("0x10000/0x10000")
                        || r.ends_with("--jump ACCEPT")
                        || r.ends_with("--jump RETURN")),
                    "{:?}",
                    got
                );
            }
            let mut restores = 0;
            for (program, _, input) in &k.calls {
                if program.contains("tables") && program.ends_with("restore") {
                    restores += 1;
                    prop_assert!(check_restore_input(input).is_ok(), "{}\n{}", check_restore_input(input).unwrap_err(), input);
                }
            }
            prop_assert!(restores > 0);
        }
    }

    #[test]
    fn the_restore_input_check_catches_what_validation_stops() {
        assert!(check_restore_input("*filter\n:cali-pi-x - [0:0]\n-A cali-pi-x -m comment --comment \"a \\\"b\" --jump DROP\nCOMMIT\n").is_ok());
        for bad in [
            "*filter\n-A cali-pi-x --protocol \"tcp -j ACCEPT\" --jump ACCEPT\n",
            "*filter\n-A INPUT --jump ACCEPT\n",
            "*filter\n:INPUT ACCEPT [0:0]\n",
            "*filter\n:cali-x\n-A INPUT --jump ACCEPT - [0:0]\n",
            "*security\n",
            "*filter\n-A cali-pi-x --source 10.0.0.0/8\t--jump ACCEPT\n",
            "*filter\n-A cali-pi-x -m comment --comment \"a\u{1b}\" --jump DROP\n",
            "*filter\n-A cali-pi-x -m comment --comment \"open\n",
        ] {
            assert!(
                check_restore_input(bad).is_err(),
                "{bad:?}: {:?}",
                check_restore_input(bad)
            );
        }
    }
}

/// What the kernel refuses, that the agent's checks let through, holds back nothing else:
/// the chain or set is found, fails closed, and is reported by the object it renders.
#[test]
fn what_the_kernel_refuses_fails_closed_by_name_and_the_rest_applies() {
    let (mut d, k) = driver();
    k.lock().refuse.push("10.66.6.6".into());
    d.on_update(&clients_set());
    d.on_update(&policy(false));
    d.on_update(&wep("caliweb"));
    d.apply().unwrap();
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["up"]
    );

    // A policy whose chain the kernel refuses.
    let other_id = PolicyId {
        name: "other".into(),
        ..pol_id()
    };
    let policy_with = |id: &PolicyId, net: &str| {
        msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(id.clone()),
            policy: Some(Policy {
                inbound_rules: vec![Rule {
                    action: "allow".into(),
                    src_net: vec![net.into()],
                    ..Default::default()
                }],
                ..Default::default()
            }),
        }))
    };
    d.on_update(&policy_with(&pol_id(), "10.66.6.6/32"));
    d.on_update(&policy_with(&other_id, "10.1.0.0/16"));
    d.apply().expect("a refused chain does not fail the apply");
    {
        let k = k.lock();
        let bad = k.chain_rules(IpVersion::V4, "filter", "cali-pi-np/prod/web");
        assert_eq!(bad.len(), 1);
        assert!(bad[0].ends_with("--jump DROP"), "{bad:?}");
        let other = k.chain_rules(IpVersion::V4, "filter", "cali-pi-np/prod/other");
        assert!(other.iter().any(|r| r.contains("10.1.0.0/16")), "{other:?}");
    }
    let rejected = d.rejected();
    let reason = &rejected["policy np/prod/web"];
    assert!(
        reason.contains("the kernel refused chain cali-pi-np/prod/web"),
        "{reason}"
    );
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["error"],
        "the endpoint using it is not enforced as written"
    );
    assert_eq!(d.metrics().rejected, Some(1));

    // Fixed: programmed as sent, and the endpoint is up again.
    d.on_update(&policy_with(&pol_id(), "10.65.0.0/16"));
    d.apply().unwrap();
    assert!(d.rejected().is_empty());
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["up"]
    );

    // An IP set the kernel refuses: the policy using it fails closed in the same apply,
    // and the set is named.
    d.on_update(&policy(false));
    d.on_update(&msg(Payload::IpsetUpdate(IpSetUpdate {
        id: "s:clients".into(),
        members: vec!["10.65.0.1/32".into(), "10.66.6.6/32".into()],
        r#type: 2,
    })));
    d.apply().unwrap();
    let rejected = d.rejected();
    assert!(
        rejected["ipset \"s:clients\""].contains("cali40s:clients"),
        "{rejected:?}"
    );
    assert!(
        rejected["policy np/prod/web"].contains("s:clients"),
        "{rejected:?}"
    );
    {
        let k = k.lock();
        let web = k.chain_rules(IpVersion::V4, "filter", "cali-pi-np/prod/web");
        assert!(!web.iter().any(|r| r.contains("--match-set")), "{web:?}");
        assert!(web.iter().any(|r| r.contains("DROP")), "{web:?}");
    }
    d.on_update(&clients_set());
    d.apply().unwrap();
    assert!(d.rejected().is_empty(), "{:?}", d.rejected());
    let k = k.lock();
    let web = k.chain_rules(IpVersion::V4, "filter", "cali-pi-np/prod/web");
    assert!(web.iter().any(|r| r.contains("cali40s:clients")), "{web:?}");
}

#[test]
fn a_failed_apply_reports_error_and_the_retry_converges() {
    let (mut d, k) = driver();
    d.on_update(&clients_set());
    d.on_update(&policy(false));
    d.on_update(&wep("caliweb"));
    k.lock().fail_restores = Some("Another app is currently holding the xtables lock".into());
    let err = d.apply().unwrap_err();
    // The kernel's reason is the typed source, and reaches the log through the chain.
    let DriverError::Tables(iptables::TableApplyError::Restore { table, source, .. }) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*table, "filter");
    assert!(source.to_string().contains("xtables lock"), "{source}");
    let logged = crate::session::error_chain(&err);
    assert!(logged.contains("xtables lock"), "{logged}");
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["error"]
    );
    k.lock().fail_restores = None;
    d.apply().unwrap();
    assert!(
        k.lock()
            .has_chain(IpVersion::V4, "filter", "cali-tw-caliweb")
    );
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["up"]
    );
    // Nothing to do: no restore at all.
    let calls = k.lock().restore_calls();
    d.apply().unwrap();
    assert_eq!(k.lock().restore_calls(), calls);
    // A refresh reads back (saves) but, with nothing changed, writes nothing.
    d.request_refresh();
    d.apply().unwrap();
    assert_eq!(k.lock().restore_calls(), calls);
}

#[test]
fn routes_follow_interfaces_and_status_follows_the_link() {
    let (mut d, _k, rig) = rig();
    d.on_update(&clients_set());
    d.on_update(&policy(false));
    d.on_update(&wep("caliweb"));
    // The monitor has not dumped yet: nothing is touched, the endpoint is down.
    d.apply().unwrap();
    assert!(rig.nl.lock().routes.is_empty());
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["down"]
    );

    rig.ifaces.upsert(netlink::LinkInfo {
        index: 10,
        name: "caliweb".into(),
        oper_up: true,
    });
    rig.nl.lock().links.push(netlink::LinkInfo {
        index: 10,
        name: "caliweb".into(),
        oper_up: true,
    });
    // Ready only after the monitor's dump.
    rig.ifaces.mark_ready_for_tests();
    d.apply().unwrap();
    {
        let nl = rig.nl.lock();
        let routes: Vec<_> = nl
            .routes
            .iter()
            .map(|(r, p)| (r.dst.to_string(), r.prefix, r.ifindex, *p))
            .collect();
        assert_eq!(routes, vec![("10.65.0.2".to_owned(), 32, 10, 80)]);
    }
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["up"]
    );

    // Link down: route withdrawn, status down; up again: both back.
    rig.ifaces.upsert(netlink::LinkInfo {
        index: 10,
        name: "caliweb".into(),
        oper_up: false,
    });
    d.on_wakeup();
    d.apply().unwrap();
    assert!(rig.nl.lock().routes.is_empty());
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["down"]
    );
    rig.ifaces.upsert(netlink::LinkInfo {
        index: 10,
        name: "caliweb".into(),
        oper_up: true,
    });
    d.apply().unwrap();
    assert_eq!(rig.nl.lock().routes.len(), 1);

    // Deleted by hand: the refresh puts it back.
    rig.nl.lock().routes.clear();
    d.request_refresh();
    d.apply().unwrap();
    assert_eq!(rig.nl.lock().routes.len(), 1);

    // Endpoint removed: route and status gone.
    d.on_update(&msg(Payload::WorkloadEndpointRemove(
        WorkloadEndpointRemove { id: Some(wep_id()) },
    )));
    d.apply().unwrap();
    assert!(rig.nl.lock().routes.is_empty());
    assert!(d.endpoint_statuses().workloads.is_empty());
}

#[test]
fn felix_configuration_from_the_datastore_reshapes_the_static_chains() {
    let (mut d, k) = driver();
    d.apply().unwrap();
    let last = |k: &FakeKernel| {
        k.chain_rules(IpVersion::V4, "filter", "cali-wl-to-host")
            .last()
            .cloned()
            .unwrap()
    };
    assert!(last(&k.lock()).ends_with("--jump DROP"));
    d.on_update(&msg(Payload::ConfigUpdate(felix_proto::ConfigUpdate {
        config: [
            (
                "DefaultEndpointToHostAction".to_owned(),
                "Accept".to_owned(),
            ),
            ("InterfacePrefix".to_owned(), "cali,tap".to_owned()),
        ]
        .into(),
        ..Default::default()
    })));
    d.apply().unwrap();
    let k = k.lock();
    assert!(last(&k).ends_with("--jump ACCEPT"), "{}", last(&k));
    let fwd = k.chain_rules(IpVersion::V4, "filter", "cali-FORWARD");
    assert!(
        fwd.iter().any(|r| r.contains("--in-interface tap+")),
        "{fwd:?}"
    );
}

fn pool(cidr: &str, masquerade: bool, uses: &[&str]) -> Payload {
    Payload::IpamPoolUpdate(felix_proto::IpamPoolUpdate {
        id: cidr.replace('/', "-"),
        pool: Some(felix_proto::IpamPool {
            cidr: cidr.into(),
            masquerade,
            allowed_uses: uses.iter().map(|u| (*u).to_owned()).collect(),
            ..Default::default()
        }),
    })
}

fn members(k: &FakeKernel, set: &str) -> Vec<String> {
    k.set(set).unwrap().members.iter().cloned().collect()
}

#[test]
fn nat_outgoing_pools_fill_the_pool_sets() {
    let (mut d, k) = driver();
    d.apply().unwrap();
    // No natOutgoing pool: Felix's chain is empty.
    assert!(
        k.lock()
            .chain_rules(IpVersion::V4, "nat", "cali-nat-outgoing")
            .is_empty()
    );

    d.on_update(&msg(pool("10.65.0.0/16", true, &[])));
    d.on_update(&msg(pool("10.66.0.0/16", false, &["Workload", "Tunnel"])));
    // LoadBalancer addresses are outside the network: traffic to them is masqueraded.
    d.on_update(&msg(pool("10.96.100.0/24", false, &["LoadBalancer"])));
    d.apply().unwrap();
    let k = k.lock();
    assert_eq!(members(&k, "cali40masq-ipam-pools"), vec!["10.65.0.0/16"]);
    assert_eq!(
        members(&k, "cali40network-ip-pools"),
        vec!["10.65.0.0/16", "10.66.0.0/16"]
    );
    let rules = k.chain_rules(IpVersion::V4, "nat", "cali-nat-outgoing");
    assert_eq!(rules.len(), 1, "{rules:?}");
    assert!(
        rules[0].contains("--match-set cali40masq-ipam-pools src")
            && rules[0].contains("! --match-set cali40network-ip-pools dst")
            && rules[0].contains("--jump MASQUERADE --random-fully"),
        "{}",
        rules[0]
    );
    // The IPv6 family has no natOutgoing pool.
    assert!(
        k.chain_rules(IpVersion::V6, "nat", "cali-nat-outgoing")
            .is_empty()
    );
    assert!(k.chain_rules(IpVersion::V4, "nat", "POSTROUTING")[0].contains("cali-POSTROUTING"));
}

/// The first rule of the NAT-outgoing chain in the fake kernel.
fn nat_outgoing_rule(k: &Arc<Mutex<FakeKernel>>) -> String {
    k.lock()
        .chain_rules(IpVersion::V4, "nat", "cali-nat-outgoing")[0]
        .clone()
}

#[test]
fn masquerade_random_fully_follows_the_override_and_the_kernel() {
    let (mut d, k, _) = rig_with(LinuxOptions {
        backend: Backend::IptablesNft,
        masq_fully_random: Some(false),
        ..LinuxOptions::default()
    });
    d.on_update(&msg(pool("10.65.0.0/16", true, &[])));
    d.apply().unwrap();
    let rule = nat_outgoing_rule(&k);
    assert!(rule.ends_with("--jump MASQUERADE"), "{rule}");

    // The datastore's FeatureDetectOverride applies (no flag pins it here).
    let mut ds = BTreeMap::new();
    ds.insert(
        "FeatureDetectOverride".to_owned(),
        "MASQFullyRandom=true".to_owned(),
    );
    d.on_update(&msg(Payload::ConfigUpdate(felix_proto::ConfigUpdate {
        config: ds,
        ..Default::default()
    })));
    d.apply().unwrap();
    let rule = nat_outgoing_rule(&k);
    assert!(rule.ends_with("--jump MASQUERADE --random-fully"), "{rule}");

    // An old kernel: detected as unsupported.
    let (mut d, k, _) = rig();
    d.routes.sysctl = Box::new(sysctl::FakeSysctl {
        values: [("kernel/osrelease".to_owned(), "3.10.0-1160.el7".to_owned())].into(),
    });
    d.on_update(&msg(pool("10.65.0.0/16", true, &[])));
    d.apply().unwrap();
    let rule = nat_outgoing_rule(&k);
    assert!(rule.ends_with("--jump MASQUERADE"), "{rule}");
}

fn default_route_via(ifaces: &Interfaces, index: u32) {
    use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage, RouteType};
    let mut r = RouteMessage::default();
    r.header.kind = RouteType::Unicast;
    r.header.address_family = rtnetlink::packet_route::AddressFamily::Inet;
    r.header.table = 254;
    r.attributes.push(RouteAttribute::Oif(index));
    ifaces.route(&r, true);
}

fn host_address_on(ifaces: &Interfaces, index: u32, ip: IpAddr) {
    use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
    let mut a = AddressMessage::default();
    a.header.index = index;
    a.attributes.push(AddressAttribute::Address(ip));
    ifaces.address(&a, true);
}

fn config(pairs: &[(&str, &str)]) -> Message {
    msg(Payload::ConfigUpdate(felix_proto::ConfigUpdate {
        config: pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    }))
}

/// An endpoint naming one of the host's own interfaces (it carries the default route or
/// host addresses) gets its policy chains but never sysctls, routes or neighbours.
#[test]
fn the_hosts_own_interfaces_are_never_taken_over() {
    let (mut d, _k, rig) = rig();
    for (index, name) in [(20, "caliuplink"), (21, "caliaddr"), (22, "caliweb")] {
        let link = netlink::LinkInfo {
            index,
            name: name.into(),
            oper_up: true,
        };
        rig.ifaces.upsert(link.clone());
        rig.nl.lock().links.push(link);
    }
    default_route_via(&rig.ifaces, 20);
    host_address_on(&rig.ifaces, 21, "192.168.1.10".parse().unwrap());
    rig.ifaces.mark_ready_for_tests();
    assert!(rig.ifaces.carries_default_route(20) && !rig.ifaces.carries_default_route(22));
    for (n, iface) in ["caliuplink", "caliaddr", "caliweb"].iter().enumerate() {
        d.on_update(&msg(Payload::WorkloadEndpointUpdate(
            WorkloadEndpointUpdate {
                id: Some(WorkloadEndpointId {
                    endpoint_id: format!("eth{n}"),
                    ..wep_id()
                }),
                endpoint: Some(WorkloadEndpoint {
                    state: "active".into(),
                    name: (*iface).into(),
                    mac: "ee:ee:ee:ee:ee:ee".into(),
                    ipv4_nets: vec![format!("10.65.0.{}/32", n + 1)],
                    ..Default::default()
                }),
            },
        )));
    }
    d.apply().unwrap();
    let nl = rig.nl.lock();
    let routed: Vec<u32> = nl.routes.iter().map(|(r, _)| r.ifindex).collect();
    assert_eq!(routed, vec![22], "only the workload's veth gets a route");
    let neighbours: Vec<u32> = nl.neighbours.iter().map(|(i, _, _)| *i).collect();
    assert_eq!(neighbours, vec![22]);
}

/// The workload prefixes can change at runtime: every endpoint is checked again, and a
/// prefix that matches one of the host's own interfaces is refused.
#[test]
fn interface_prefix_changes_recheck_endpoints_and_never_match_the_host() {
    let (mut d, k, rig) = rig();
    for (index, name) in [(2, "eth0"), (30, "tap0")] {
        let link = netlink::LinkInfo {
            index,
            name: name.into(),
            oper_up: true,
        };
        rig.ifaces.upsert(link.clone());
        rig.nl.lock().links.push(link);
    }
    default_route_via(&rig.ifaces, 2);
    rig.ifaces.mark_ready_for_tests();
    d.on_update(&clients_set());
    d.on_update(&policy(false));
    d.on_update(&wep("tap0"));
    d.apply().unwrap();
    let what = "workload endpoint k8s/prod/web/eth0";
    assert!(d.rejected().contains_key(what), "{:?}", d.rejected());
    assert!(!k.lock().has_chain(IpVersion::V4, "filter", "cali-tw-tap0"));

    d.on_update(&config(&[("InterfacePrefix", "cali,tap")]));
    d.apply().unwrap();
    assert!(!d.rejected().contains_key(what), "{:?}", d.rejected());
    assert!(k.lock().has_chain(IpVersion::V4, "filter", "cali-tw-tap0"));

    // "eth" would hand the uplink to workload dispatch: refused, the flag value is used.
    d.on_update(&config(&[("InterfacePrefix", "eth,tap")]));
    d.apply().unwrap();
    let k = k.lock();
    let fwd = k.chain_rules(IpVersion::V4, "filter", "cali-FORWARD");
    assert!(!fwd.iter().any(|r| r.contains("eth+")), "{fwd:?}");
    assert!(fwd.iter().any(|r| r.contains("cali+")), "{fwd:?}");
    assert!(!k.has_chain(IpVersion::V4, "filter", "cali-tw-tap0"));
    assert!(d.rejected().contains_key(what));
    assert_eq!(
        d.endpoint_statuses().workloads.values().collect::<Vec<_>>(),
        vec!["error"]
    );
}

/// Host endpoint egress policy is also in mangle (for DNAT'd host traffic), only while a
/// host endpoint uses it.
#[test]
fn host_endpoint_egress_policy_is_placed_in_mangle_while_used() {
    let (mut d, k) = driver();
    d.on_update(&clients_set());
    d.on_update(&policy(false));
    let hep = |tiers: Vec<TierInfo>| {
        msg(Payload::HostEndpointUpdate(
            felix_proto::HostEndpointUpdate {
                id: Some(felix_proto::HostEndpointId {
                    endpoint_id: "lo-ep".into(),
                }),
                endpoint: Some(felix_proto::HostEndpoint {
                    name: "lo".into(),
                    tiers,
                    ..Default::default()
                }),
            },
        ))
    };
    d.on_update(&hep(vec![TierInfo {
        name: "default".into(),
        egress_policies: vec![pol_id()],
        ..Default::default()
    }]));
    d.apply().unwrap();
    {
        let k = k.lock();
        assert!(k.has_chain(IpVersion::V4, "mangle", "cali-po-np/prod/web"));
        assert!(!k.has_chain(IpVersion::V4, "mangle", "cali-pi-np/prod/web"));
        let th = k.chain_rules(IpVersion::V4, "mangle", "cali-th-lo");
        assert!(
            th.iter().any(|r| r.contains("cali-po-np/prod/web")),
            "{th:?}"
        );
        let post = k.chain_rules(IpVersion::V4, "mangle", "cali-POSTROUTING");
        assert!(
            post.iter()
                .any(|r| r.contains("--ctstate DNAT") && r.contains("cali-to-host-endpoint")),
            "{post:?}"
        );
        assert!(
            k.chain_rules(IpVersion::V4, "mangle", "POSTROUTING")[0].contains("cali-POSTROUTING")
        );
    }
    d.on_update(&hep(vec![]));
    d.apply().unwrap();
    let k = k.lock();
    assert!(!k.has_chain(IpVersion::V4, "mangle", "cali-po-np/prod/web"));
    assert!(k.has_chain(IpVersion::V4, "filter", "cali-po-np/prod/web"));
}

/// An interface handed from one endpoint to another in one batch (a pod recreated under a
/// new name, or an endpoint whose key changed) keeps its chains, whatever order the two keys
/// are handled in: the old endpoint's chains go before the new one's are set.
#[test]
fn an_interface_moving_between_endpoints_in_one_batch_keeps_its_chains() {
    let (mut d, k) = driver();
    d.on_update(&policy(false));
    let mut current = wep_id();
    d.on_update(&wep("calimove"));
    d.apply().unwrap();
    for i in 0..16 {
        let next = WorkloadEndpointId {
            workload_id: format!("prod/web-{i}"),
            ..wep_id()
        };
        let Message::WorkloadEndpointUpdate { endpoint, .. } = wep("calimove") else {
            unreachable!()
        };
        d.on_update(&msg(Payload::WorkloadEndpointUpdate(
            WorkloadEndpointUpdate {
                id: Some(next.clone()),
                endpoint: Some((*endpoint).clone()),
            },
        )));
        d.on_update(&msg(Payload::WorkloadEndpointRemove(
            WorkloadEndpointRemove {
                id: Some(current.clone()),
            },
        )));
        d.apply().unwrap();
        let k = k.lock();
        for v in IpVersion::BOTH {
            // Desired, not only kept in the kernel (the iptables writer keeps a chain that a
            // dispatch rule still jumps to; the nftables one cannot delete it either).
            for chain in ["cali-tw-calimove", "cali-fw-calimove"] {
                assert!(
                    d.tables.table(v, "filter").has_chain(chain),
                    "round {i}, {v:?}"
                );
                assert!(k.has_chain(v, "filter", chain), "round {i}, {v:?}");
            }
        }
        drop(k);
        let dump = d.programmed_objects().unwrap();
        assert_eq!(dump.endpoints.len(), 1);
        assert!(
            dump.endpoints[0]
                .chains
                .contains(&"cali-tw-calimove".to_owned())
        );
        current = next;
    }
}

/// Every rule that decides carries its rule id, and the iptables writer maps a kernel rule
/// (by position or by its `cali:` comment) back to it.
#[test]
fn kernel_rules_map_back_to_their_rule_ids() {
    use super::RuleAt;
    use super::rules::endpoint::Direction;
    use super::rules::{RuleId, policy_chain_name, policy_id_string};

    let (mut d, k) = driver();
    d.on_update(&clients_set());
    d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(pol_id()),
        policy: Some(Policy {
            inbound_rules: vec![
                Rule {
                    action: "deny".into(),
                    src_ip_set_ids: vec!["s:clients".into()],
                    ..Default::default()
                },
                Rule {
                    action: "allow".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        }),
    })));
    d.on_update(&wep("caliweb"));
    d.apply().unwrap();

    let v4 = IpVersion::V4;
    let chain = policy_chain_name(rules::POLICY_INBOUND_PFX, &pol_id());
    let kernel = k.lock().chain_rules(v4, "filter", &chain);
    let key = policy_id_string(&pol_id());
    let rule = |index| {
        Some(RuleId::Policy {
            policy: key.clone(),
            direction: Direction::Ingress,
            index,
        })
    };
    assert!(kernel.len() >= 2, "{kernel:?}");
    assert_eq!(
        d.rule_id(v4, "filter", &chain, RuleAt::Position(1)),
        rule(0)
    );
    assert_eq!(
        d.rule_id(v4, "filter", &chain, RuleAt::Position(kernel.len())),
        rule(1)
    );
    assert_eq!(
        d.rule_id(v4, "filter", &chain, RuleAt::Position(kernel.len() + 1)),
        None
    );
    // By comment: the whole saved line, or the `cali:` comment alone.
    for (i, line) in kernel.iter().enumerate() {
        let at = d.rule_id(v4, "filter", &chain, RuleAt::Position(i + 1));
        assert_eq!(d.rule_id(v4, "filter", &chain, RuleAt::Comment(line)), at);
        let hash = line
            .split("cali:")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(
            d.rule_id(
                v4,
                "filter",
                &chain,
                RuleAt::Comment(&format!("cali:{hash}"))
            ),
            at
        );
    }
    // The endpoint chain: end of tier and no profile matched; jumps have none.
    let tw = k.lock().chain_rules(v4, "filter", "cali-tw-caliweb");
    let ids: Vec<Option<RuleId>> = (1..=tw.len())
        .map(|p| d.rule_id(v4, "filter", "cali-tw-caliweb", RuleAt::Position(p)))
        .collect();
    assert!(ids.contains(&Some(RuleId::EndOfTier {
        tier: "default".into(),
        direction: Direction::Ingress,
    })));
    assert_eq!(
        ids.last().cloned().flatten(),
        Some(RuleId::NoProfileMatched {
            direction: Direction::Ingress
        })
    );
    let jump = tw.iter().position(|l| l.contains(&chain)).unwrap();
    assert_eq!(ids[jump], None);
    // Failsafes, in every table that holds them.
    for table in ["filter", "raw", "mangle"] {
        assert_eq!(
            d.rule_id(v4, table, "cali-failsafe-in", RuleAt::Position(1)),
            Some(RuleId::Failsafe {
                direction: Direction::Ingress
            })
        );
    }
    // Not a table this writer programs.
    assert_eq!(d.rule_id(v4, "calico", &chain, RuleAt::Position(1)), None);
}

/// The kernel's counters come back as deltas per stream rule: a baseline first, then what
/// moved, added up over families; a rewritten policy chain counts again from its new rules
/// without counting the old ones twice.
#[test]
fn rule_counters_are_reported_as_deltas_by_stream_rule() {
    use felix_proto::rule_ref::Kind;

    let policy = |action: &str| {
        msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pol_id()),
            policy: Some(Policy {
                inbound_rules: vec![Rule {
                    action: action.into(),
                    protocol: Some(felix_proto::Protocol {
                        number_or_name: Some(felix_proto::protocol::NumberOrName::Name(
                            "udp".into(),
                        )),
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
        }))
    };
    let (d, k) = driver();
    // Boxed, as `driver::build` hands it to the session: the box must forward the hit methods.
    let mut d: Box<dyn crate::driver::Driver> = Box::new(d);
    assert!(d.counts_hits());
    d.on_update(&policy("allow"));
    d.on_update(&wep("caliweb"));
    d.apply().unwrap();
    let chain = rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &pol_id());
    k.lock().hit(IpVersion::V4, &chain, "udp", 100, 10_000);
    assert!(
        d.collect_hits().unwrap().is_empty(),
        "the first read is the baseline"
    );

    k.lock().hit(IpVersion::V4, &chain, "udp", 37, 3_700);
    k.lock().hit(IpVersion::V6, &chain, "udp", 3, 300);
    let hits = d.collect_hits().unwrap();
    let policy_hits: Vec<_> = hits
        .iter()
        .filter(|h| h.rule.as_ref().unwrap().kind() == Kind::PolicyRule)
        .collect();
    assert_eq!(policy_hits.len(), 1, "{hits:?}");
    let h = policy_hits[0];
    let r = h.rule.as_ref().unwrap();
    assert_eq!(r.policy.as_ref(), Some(&pol_id()));
    assert_eq!((r.egress, r.index), (false, 0));
    assert_eq!((h.packets, h.bytes), (40, 4_000));
    assert!(d.collect_hits().unwrap().is_empty(), "nothing moved");

    // The policy changes: its chain is rewritten and counts from zero.
    d.on_update(&policy("deny"));
    d.apply().unwrap();
    k.lock().hit(IpVersion::V4, &chain, "udp", 5, 500);
    let hits = d.collect_hits().unwrap();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!((hits[0].packets, hits[0].bytes), (5, 500));
    // The verdict line gated on the mark sees the same packets again: it does not count.
    let verdict = k
        .lock()
        .chain_rules(IpVersion::V4, "filter", &chain)
        .into_iter()
        .find(|r| r.contains("--mark") && !r.contains("MARK --set"))
        .expect("the verdict line");
    k.lock().hit(IpVersion::V4, &chain, &verdict, 40, 4_000);
    assert!(
        d.collect_hits().unwrap().is_empty(),
        "the verdict line counted: {verdict}"
    );
}

/// FeatureGates `PolicyHitCounters=Disabled` (per node, from the server's FelixConfiguration)
/// stops the reading; turned on again, the first read is a new baseline, so what passed while
/// it was off is never reported.
#[test]
fn the_hit_counter_gate_turns_collection_off_and_on() {
    let (mut d, k) = driver();
    d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(pol_id()),
        policy: Some(Policy {
            inbound_rules: vec![Rule {
                action: "allow".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
    })));
    d.on_update(&wep("caliweb"));
    d.apply().unwrap();
    let chain = rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &pol_id());
    let allow = k
        .lock()
        .chain_rules(IpVersion::V4, "filter", &chain)
        .into_iter()
        .find(|r| r.contains("MARK --set"))
        .expect("the rule's line");
    assert!(d.collect_hits().unwrap().is_empty(), "baseline");
    k.lock().hit(IpVersion::V4, &chain, &allow, 7, 700);
    assert_eq!(d.collect_hits().unwrap().len(), 1);

    d.on_update(&config(&[("FeatureGates", "PolicyHitCounters=Disabled")]));
    d.apply().unwrap();
    k.lock().hit(IpVersion::V4, &chain, &allow, 50, 5_000);
    assert!(d.collect_hits().unwrap().is_empty(), "off: nothing read");

    d.on_update(&config(&[("FeatureGates", "PolicyHitCounters=Enabled")]));
    d.apply().unwrap();
    assert!(
        d.collect_hits().unwrap().is_empty(),
        "on again: a new baseline, the 50 packets seen while off are not reported"
    );
    k.lock().hit(IpVersion::V4, &chain, &allow, 3, 300);
    let hits = d.collect_hits().unwrap();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!((hits[0].packets, hits[0].bytes), (3, 300));
}

/// FelixConfiguration `FlowLogsGoldmaneServer` turns flow logs on (no flag pins it here): the
/// policy and the endpoint chains are rendered again with their NFLOG lines (Felix's groups
/// and prefixes), and the hit counters still count each packet once, on the match line.
#[test]
fn flow_logs_from_the_datastore_add_nflog_lines_counted_nowhere() {
    use felix_proto::rule_ref::Kind;

    let (mut d, k) = driver();
    d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(pol_id()),
        policy: Some(Policy {
            inbound_rules: vec![Rule {
                action: "allow".into(),
                protocol: Some(felix_proto::Protocol {
                    number_or_name: Some(felix_proto::protocol::NumberOrName::Name("udp".into())),
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
    })));
    d.on_update(&wep("caliweb"));
    d.apply().unwrap();
    let chain = rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &pol_id());
    let ep_chain = rules::endpoint_chain_name(rules::endpoint::WORKLOAD_TO_PFX, "caliweb");
    let nflog_lines = |k: &Arc<Mutex<FakeKernel>>, c: &str| -> Vec<String> {
        k.lock()
            .chain_rules(IpVersion::V4, "filter", c)
            .into_iter()
            .filter(|r| r.contains("NFLOG"))
            .collect()
    };
    assert!(nflog_lines(&k, &chain).is_empty(), "off by default");
    assert!(nflog_lines(&k, &ep_chain).is_empty(), "off by default");

    d.on_update(&config(&[(
        "FlowLogsGoldmaneServer",
        "goldmane.calico-system:7443",
    )]));
    d.apply().unwrap();
    let pol_id_str = rules::policy_id_string(&pol_id());
    let pol_lines = nflog_lines(&k, &chain);
    assert_eq!(pol_lines.len(), 1, "{pol_lines:?}");
    assert!(
        pol_lines[0].contains(&format!(
            "--nflog-group 1 --nflog-prefix \"API0|{pol_id_str}\" --nflog-size 80"
        )),
        "{pol_lines:?}"
    );
    let ep_lines = nflog_lines(&k, &ep_chain);
    assert_eq!(ep_lines.len(), 2, "{ep_lines:?}");
    assert!(ep_lines[0].contains("--nflog-group 1 --nflog-prefix \"DPI|default\""));
    assert!(ep_lines[1].contains("--nflog-group 1 --nflog-prefix DRI "));

    // Counted once: the match line counts, the NFLOG line behind it does not.
    assert!(d.collect_hits().unwrap().is_empty(), "baseline");
    k.lock().hit(IpVersion::V4, &chain, "MARK --set", 9, 900);
    k.lock().hit(IpVersion::V4, &chain, "NFLOG", 9, 900);
    k.lock()
        .hit(IpVersion::V4, &ep_chain, "DPI|default", 4, 400);
    let hits = d.collect_hits().unwrap();
    let policy_hits: Vec<_> = hits
        .iter()
        .filter(|h| h.rule.as_ref().unwrap().kind() == Kind::PolicyRule)
        .collect();
    assert_eq!(policy_hits.len(), 1, "{hits:?}");
    assert_eq!((policy_hits[0].packets, policy_hits[0].bytes), (9, 900));
    assert_eq!(
        hits.len(),
        1,
        "the end-of-tier NFLOG line counts nothing: {hits:?}"
    );

    // Turned off again: the chains are as before.
    d.on_update(&config(&[]));
    d.apply().unwrap();
    assert!(nflog_lines(&k, &chain).is_empty());
    assert!(nflog_lines(&k, &ep_chain).is_empty());
}

mod flows;
