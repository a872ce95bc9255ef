//! Explain must agree with the kernel.
//!
//! `calc-server explain --file-dir DIR --from SRC --to DST [--protocol P] [--port N] --output
//! json` answers "is this traffic allowed, and why" from the datastore alone, following Felix's
//! evaluation (the source's egress, then the destination's ingress). This test checks that
//! answer against the ground truth: a host network namespace runs calc-server and
//! `dataplane-agent --driver linux` (`--driver nftables` in the test's other half) on the same
//! manifests, workload namespaces hang off it by veth pairs, and a few hundred (source,
//! destination, protocol, port) probes, every flow of the cluster in a seeded random order and
//! naming, are sent as real packets (TCP connects and pings). Every probe's kernel verdict must
//! equal explain's `verdict`; the failure lists every disagreement with explain's whole JSON.
//! The probes must also be meaningful: both verdicts many times, and every rule, end of tier
//! and profile the cluster was built to exercise deciding at least one probe (explain's
//! `decided_by`).
//!
//! The cluster exercises what makes policy evaluation subtle: a Deny tier and a Pass tier before
//! the default tier, Pass rules, end-of-tier drops, policies without an order and policies of
//! equal order (names decide, a global and a namespaced one included), namespace selectors
//! (matching a namespaced NetworkSet too), negations (`notPorts`, `notSelector`, `!has`, `!=`,
//! `notNets`), named ports (ingress, egress, negated), network sets matched by selector, egress
//! and ingress policies, ICMP rules, and a peer outside the cluster (explain's source is then
//! its IP).
//!
//! Needs root, iptables, ipset, nc, ping and nft: `#[ignore]`d with that reason and run by
//! `make test`; a missing tool fails the test (see `integration::netns::require`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use integration::driver_tests;
use integration::netns::{
    ControlPlane, Driver, Netns, Workload, namespace_profile, wep_manifest, write_manifest,
};
use serde_json::Value;

const NODE: &str = "node-a";
/// The peer outside the cluster (`Netns::outside_of`): no endpoint owns it; it is in the
/// `partners` GlobalNetworkSet and in prod's `office` NetworkSet.
const OUTSIDE_IP: &str = "192.0.2.2";
/// How many probes (at least one per flow); the seed makes them the same on every run.
const PROBES: usize = 320;
const SEED: u64 = 0x5EED_F311_C0DE_2024;

/// One pod of the cluster: its workload is the `i`th of [`PODS`], with address `10.65.0.<i+1>`.
struct Pod {
    ns: &'static str,
    name: &'static str,
    labels: &'static [(&'static str, &'static str)],
    /// Named ports (all TCP).
    named_ports: &'static [(&'static str, u16)],
    /// The TCP ports the pod listens on: the probes' ports. Each pod also listens on a port no
    /// policy names (7000 is named only by number, 2222 and 5432 on some pods by no one).
    listen: &'static [u16],
}

/// Three namespaces (`env` label on each), two pods named `web` in different namespaces, and
/// the same port under different names (`http` is 8080 on web, 8081 on api).
const PODS: [Pod; 7] = [
    // 10.65.0.1
    Pod {
        ns: "prod",
        name: "web",
        labels: &[("app", "web"), ("tier", "frontend")],
        named_ports: &[("http", 8080), ("metrics", 9100)],
        listen: &[8080, 9100, 7000],
    },
    // 10.65.0.2
    Pod {
        ns: "prod",
        name: "api",
        labels: &[("app", "api"), ("tier", "backend")],
        named_ports: &[("http", 8081), ("grpc", 9090), ("metrics", 9100)],
        listen: &[8081, 9090, 9100, 7000],
    },
    // 10.65.0.3: 9100 is not named here.
    Pod {
        ns: "prod",
        name: "db",
        labels: &[("app", "db"), ("tier", "backend")],
        named_ports: &[("postgres", 5432)],
        listen: &[5432, 9100, 7000],
    },
    // 10.65.0.4
    Pod {
        ns: "dev",
        name: "web",
        labels: &[("app", "web")],
        named_ports: &[("http", 8080)],
        listen: &[8080, 9100, 7000],
    },
    // 10.65.0.5
    Pod {
        ns: "dev",
        name: "tester",
        labels: &[("app", "tester"), ("role", "debug")],
        named_ports: &[],
        listen: &[7000, 8080, 5432],
    },
    // 10.65.0.6
    Pod {
        ns: "ops",
        name: "monitor",
        labels: &[("app", "prometheus")],
        named_ports: &[("metrics", 9100)],
        listen: &[9100, 7000],
    },
    // 10.65.0.7
    Pod {
        ns: "ops",
        name: "bastion",
        labels: &[("app", "bastion"), ("role", "admin")],
        named_ports: &[("ssh", 2222)],
        listen: &[2222, 7000],
    },
];

impl Pod {
    fn ipv4(i: usize) -> String {
        format!("10.65.0.{}", i + 1)
    }

    fn ipv6(i: usize) -> String {
        format!("fd00:65::{}", i + 1)
    }

    /// `calip-web`, `calid-tester`, …: short enough for an interface, readable in iptables-save.
    fn iface(&self) -> String {
        format!("cali{}-{}", &self.ns[..1], self.name)
    }

    /// The WorkloadEndpoint's name as Calico's CNI plugin writes it (pod names here have no
    /// dashes to double).
    fn wep_name(&self) -> String {
        format!("node--a-k8s-{}-eth0", self.name)
    }

    fn manifest(&self, i: usize) -> String {
        let ports = self
            .named_ports
            .iter()
            .map(|(n, p)| format!("{{name: {n}, protocol: TCP, port: {p}}}"))
            .collect::<Vec<_>>()
            .join(", ");
        self.labels
            .iter()
            .fold(
                wep_manifest(NODE, self.ns, self.name, &self.iface()),
                |m, (k, v)| m.label(k, v),
            )
            .calico_labels()
            .ipv4(&Pod::ipv4(i))
            .ipv6(&Pod::ipv6(i))
            .ports(&ports)
            .render()
    }
}

/// The policy under test. The comments say which probes each rule is meant to decide; the
/// test does not rely on them (it compares explain with the kernel), but it checks that every
/// policy decides at least one probe.
const POLICIES: &str =
    "# Tiers: security drops what it does not decide, platform passes it on, default drops it.
apiVersion: projectcalico.org/v3
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
  name: platform
spec:
  order: 200
  defaultAction: Pass
---
apiVersion: projectcalico.org/v3
kind: Tier
metadata:
  name: default
spec:
  order: 1000000
  defaultAction: Deny
---
# The outside peer (192.0.2.2) is in both network sets.
apiVersion: projectcalico.org/v3
kind: GlobalNetworkSet
metadata:
  name: partners
  labels:
    partner: 'true'
spec:
  nets: [192.0.2.0/24]
---
apiVersion: projectcalico.org/v3
kind: NetworkSet
metadata:
  name: office
  namespace: prod
  labels:
    role: office
spec:
  nets: [192.0.2.0/28]
---
# Security tier, ingress of every endpoint.
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: sec-guard
spec:
  tier: security
  order: 100
  selector: all()
  types: [Ingress]
  ingress:
  # Pings from anyone but dev/web (10.65.0.4).
  - action: Allow
    protocol: ICMP
    icmp: {type: 8}
    source:
      notNets: [10.65.0.4/32]
  # The debug pod may open only 7000 and 8080.
  - action: Deny
    protocol: TCP
    source:
      selector: role == 'debug'
    destination:
      notPorts: [7000, 8080]
  # Partner networks go on to the next tiers ...
  - action: Pass
    source:
      selector: partner == 'true'
  # ... as do prod and ops pods, except admins ...
  - action: Pass
    source:
      namespaceSelector: env in {'prod', 'ops'}
      selector: role != 'admin'
  # ... and TCP from dev to pods without a tier label (none of prod's).
  - action: Pass
    protocol: TCP
    source:
      namespaceSelector: env == 'dev'
    destination:
      selector: '!has(tier)'
  # The rest (the bastion's TCP, dev to prod, dev/web's pings) drops at the end of the tier.
---
# Security tier, egress of prod pods. No order: it comes after every ordered policy.
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: sec-egress
spec:
  tier: security
  selector: projectcalico.org/namespace == 'prod'
  types: [Egress]
  egress:
  # No prod pod may open the monitor's (10.65.0.6) 7000 ...
  - action: Deny
    protocol: TCP
    destination:
      nets: [10.65.0.6/32]
      ports: [7000]
  - action: Pass
---
# ... except db, whose ordered policy comes first and allows 7000 anywhere.
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: sec-egress-db
spec:
  tier: security
  order: 1000
  selector: app == 'db' && projectcalico.org/namespace == 'prod'
  types: [Egress]
  egress:
  - action: Allow
    protocol: TCP
    destination:
      ports: [7000]
---
# Security tier, egress of ops pods: what is not for prod (10.65.0.0/30) goes on; into prod
# only the metrics ports (named: the destination pod's own), the rest drops at the end.
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: sec-egress-ops
spec:
  tier: security
  order: 500
  selector: projectcalico.org/namespace == 'ops'
  types: [Egress]
  egress:
  - action: Pass
    destination:
      notNets: [10.65.0.0/30]
  - action: Allow
    protocol: TCP
    destination:
      ports: [metrics]
---
# Platform tier. Two policies of the same order: the names decide, metrics-allow first.
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: metrics-allow
spec:
  tier: platform
  order: 50
  selector: all()
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source:
      namespaceSelector: env == 'ops'
      selector: app == 'prometheus'
    destination:
      ports: [metrics]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: metrics-deny
spec:
  tier: platform
  order: 50
  selector: all()
  types: [Ingress]
  ingress:
  - action: Deny
    protocol: TCP
    destination:
      ports: [9100]
---
# db's 7000 for anything in prod: its pods, and its office NetworkSet (the outside peer).
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: from-prod
spec:
  tier: platform
  order: 100
  selector: app == 'db'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source:
      namespaceSelector: env == 'prod'
    destination:
      ports: [7000]
---
# The tester may not open pods that neither have a tier nor are web (the monitor, the bastion).
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: tester-egress
spec:
  tier: platform
  order: 10
  selector: app == 'tester'
  types: [Egress]
  egress:
  - action: Deny
    protocol: TCP
    destination:
      notSelector: has(tier) || app == 'web'
---
# Default tier.
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: web-ingress
  namespace: prod
spec:
  order: 100
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    destination:
      ports: [http]
  # A namespaced policy's selector matches its namespace's NetworkSets.
  - action: Allow
    protocol: TCP
    source:
      selector: role == 'office'
    destination:
      ports: [7000]
---
# api: two policies of the same order (no types: ingress only); api-allow comes first.
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: api-allow
  namespace: prod
spec:
  order: 200
  selector: app == 'api'
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: app == 'web'
    destination:
      ports: [http, grpc]
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: api-deny
  namespace: prod
spec:
  order: 200
  selector: app == 'api'
  ingress:
  - action: Allow
    protocol: TCP
    source:
      nets: [192.0.2.0/24]
    destination:
      notPorts: [grpc]
  - action: Deny
    protocol: TCP
    destination:
      ports: [9090]
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: db-policy
  namespace: prod
spec:
  order: 100
  selector: app == 'db'
  types: [Ingress, Egress]
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: tier == 'backend'
    destination:
      ports: [postgres]
  egress:
  - action: Deny
    protocol: ICMP
  - action: Allow
    protocol: TCP
    destination:
      selector: tier == 'backend'
---
# dev/web, no order.
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: dev-web
spec:
  selector: projectcalico.org/namespace == 'dev' && app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source:
      namespaceSelector: env == 'dev'
    destination:
      ports: [http]
  - action: Allow
    protocol: TCP
    source:
      selector: partner == 'true'
---
# The bastion: a global and a namespaced policy of the same order. Calico breaks the tie on
# '<name>/<namespace>/<kind>', so q-bastion comes first (on 'namespace/name' it would not).
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: q-bastion
spec:
  order: 300
  selector: app == 'bastion'
  types: [Ingress]
  ingress:
  - action: Deny
    protocol: TCP
    destination:
      ports: [7000]
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: z-bastion
  namespace: ops
spec:
  order: 300
  selector: app == 'bastion'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
";

/// What some probe must be decided by (explain's `decided_by`, as [`decisions`] labels it), and
/// the feature it stands for: without these the probe set would not show that explain handles
/// them.
const MUST_DECIDE: &[(&str, &str)] = &[
    (
        "ingress sec-guard rule 0",
        "ICMP type Allow with notNets, Deny tier",
    ),
    ("ingress sec-guard rule 1", "Deny with notPorts"),
    (
        "ingress end-of-tier security",
        "end-of-tier drop of a Deny tier",
    ),
    (
        "egress sec-egress rule 0",
        "Deny on nets and port in a policy without order",
    ),
    (
        "egress sec-egress-db rule 0",
        "an ordered policy before one without order",
    ),
    (
        "egress sec-egress-ops rule 1",
        "named port in an egress rule",
    ),
    ("egress end-of-tier security", "end-of-tier drop on egress"),
    (
        "ingress metrics-allow rule 0",
        "equal order, first by name; namespaceSelector",
    ),
    ("ingress metrics-deny rule 0", "equal order, second by name"),
    (
        "ingress from-prod rule 0",
        "namespaceSelector matching a namespaced NetworkSet",
    ),
    (
        "egress tester-egress rule 0",
        "notSelector Deny in a Pass tier",
    ),
    ("ingress prod/web-ingress rule 0", "named port"),
    (
        "ingress prod/web-ingress rule 1",
        "NetworkSet matched by a namespaced selector",
    ),
    (
        "ingress prod/api-allow rule 0",
        "equal order: the Allow first",
    ),
    (
        "ingress prod/api-deny rule 0",
        "source nets, named port in notPorts",
    ),
    (
        "ingress prod/api-deny rule 1",
        "equal order: the Deny second",
    ),
    (
        "ingress prod/db-policy rule 0",
        "named port, selector on another label",
    ),
    ("egress prod/db-policy rule 0", "ICMP Deny on egress"),
    (
        "egress end-of-tier default",
        "end-of-tier drop of the default tier on egress",
    ),
    (
        "ingress dev-web rule 0",
        "policy without order, namespaceSelector",
    ),
    (
        "ingress dev-web rule 1",
        "GlobalNetworkSet matched by selector",
    ),
    (
        "ingress q-bastion rule 0",
        "equal order: global before namespaced",
    ),
    (
        "ingress ops/z-bastion rule 0",
        "equal order: namespaced after global",
    ),
    (
        "ingress end-of-tier default",
        "end-of-tier drop of the default tier",
    ),
    (
        "ingress profile kns.dev",
        "no policy in the last tiers: the profile",
    ),
    (
        "egress profile kns.prod",
        "Pass through every tier to the profile",
    ),
];

/// The running cluster: the host (calc-server and the agent), the workloads (indexed as
/// [`PODS`]) and the outside peer.
struct Cluster {
    host: Netns,
    outside: Netns,
    workloads: Vec<Workload>,
    dir: tempfile::TempDir,
}

fn cluster() -> Cluster {
    let host = Netns::new("host");
    host.make_host();
    let outside = Netns::outside_of(&host);
    // The outside peer's packets to workloads, and the workloads' replies, go through the host.
    outside.route_via_host();
    let workloads = PODS
        .iter()
        .enumerate()
        .map(|(i, pod)| {
            let mut w = Workload::attach(&host, &pod.iface(), &Pod::ipv4(i), &Pod::ipv6(i));
            for port in pod.listen {
                w.listen(*port);
            }
            w
        })
        .collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut manifests: String = ["prod", "dev", "ops"]
        .iter()
        .map(|ns| namespace_profile(ns, ns))
        .collect();
    for (i, pod) in PODS.iter().enumerate() {
        manifests.push_str(&pod.manifest(i));
    }
    // Everything is written before the server starts: its first snapshot is the whole cluster.
    write_manifest(dir.path(), "workloads.yaml", &manifests);
    write_manifest(dir.path(), "policies.yaml", POLICIES);
    Cluster {
        host,
        outside,
        workloads,
        dir,
    }
}

/// Where a probe comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Peer {
    Pod(usize),
    Outside,
}

/// What the kernel decides on: who sends what to whom. `port: None` is a ping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Flow {
    from: Peer,
    to: usize,
    port: Option<u16>,
}

impl Flow {
    fn describe(&self) -> String {
        let from = match self.from {
            Peer::Pod(i) => format!("{}/{} ({})", PODS[i].ns, PODS[i].name, Pod::ipv4(i)),
            Peer::Outside => format!("outside ({OUTSIDE_IP})"),
        };
        let to = format!(
            "{}/{} ({})",
            PODS[self.to].ns,
            PODS[self.to].name,
            Pod::ipv4(self.to)
        );
        match self.port {
            Some(p) => format!("{from} -> {to} tcp/{p}"),
            None => format!("{from} -> {to} ping"),
        }
    }
}

/// A flow and how explain is asked about it: the same flow is named in different ways.
struct Probe {
    flow: Flow,
    from_arg: String,
    to_arg: String,
}

impl Probe {
    fn explain_args(&self, dir: &Path) -> Vec<String> {
        let mut args: Vec<String> = [
            "explain",
            "--file-dir",
            dir.to_str().expect("UTF-8 path"),
            "--from",
            &self.from_arg,
            "--to",
            &self.to_arg,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        match self.flow.port {
            Some(p) => args.extend([
                "--protocol".into(),
                "tcp".into(),
                "--port".into(),
                p.to_string(),
            ]),
            None => args.extend(["--protocol".into(), "icmp".into()]),
        }
        args.extend(["--output".into(), "json".into()]);
        args
    }
}

/// splitmix64: a fixed seed gives the same probes on every run, with no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Every flow of the cluster: from each pod and the outside peer, to each other pod, a ping or
/// TCP to each port the destination listens on. (A pod's packets to its own address never leave
/// it: no policy applies, so it is not a flow here.)
fn all_flows() -> Vec<Flow> {
    let sources = (0..PODS.len()).map(Peer::Pod).chain([Peer::Outside]);
    sources
        .flat_map(|from| {
            (0..PODS.len())
                .filter(move |to| from != Peer::Pod(*to))
                .flat_map(move |to| {
                    let ports = PODS[to].listen.iter().map(|p| Some(*p));
                    ports.chain([None]).map(move |port| Flow { from, to, port })
                })
        })
        .collect()
}

/// The probes: every flow in a random order (a seeded Fisher-Yates shuffle), then the first
/// ones again until there are [`PROBES`]; so every flow is probed (random draws with
/// replacement left some policies unreached) and a repeated flow is named another way. Pods
/// are named mostly as `namespace/pod`, one in six by WorkloadEndpoint name as a source; the
/// outside peer by its IP; destinations half as `namespace/pod`, half by IPv4 address.
fn probes() -> Vec<Probe> {
    let mut rng = Rng(SEED);
    let mut flows = all_flows();
    for i in (1..flows.len()).rev() {
        flows.swap(i, rng.below(i + 1));
    }
    (0..PROBES.max(flows.len()))
        .map(|k| {
            let flow = flows[k % flows.len()];
            let from_arg = match flow.from {
                Peer::Outside => OUTSIDE_IP.to_owned(),
                Peer::Pod(i) if rng.below(6) == 0 => wep_arg(i, rng.below(2) == 0),
                Peer::Pod(i) => format!("{}/{}", PODS[i].ns, PODS[i].name),
            };
            let to_arg = if rng.below(2) == 0 {
                Pod::ipv4(flow.to)
            } else {
                format!("{}/{}", PODS[flow.to].ns, PODS[flow.to].name)
            };
            Probe {
                flow,
                from_arg,
                to_arg,
            }
        })
        .collect()
}

/// A pod named by its WorkloadEndpoint name: bare when `bare` and no other pod's endpoint has
/// that name (both `web` pods' endpoints are `node--a-k8s-web-eth0`), else `namespace/`-prefixed.
fn wep_arg(i: usize, bare: bool) -> String {
    let name = PODS[i].wep_name();
    let unique = PODS.iter().filter(|p| p.wep_name() == name).count() == 1;
    if bare && unique {
        name
    } else {
        format!("{}/{name}", PODS[i].ns)
    }
}

/// Sends one flow's packet from its source's namespace: whether it got through (a TCP connect
/// or an answered ping within 1 s).
fn send(c: &Cluster, flow: Flow) -> bool {
    let ns = match flow.from {
        Peer::Pod(i) => &c.workloads[i].ns,
        Peer::Outside => &c.outside,
    };
    let to = Pod::ipv4(flow.to);
    match flow.port {
        Some(p) => ns.try_exec(&["nc", "-z", "-w", "1", &to, &p.to_string()]),
        None => ns.try_exec(&["ping", "-c", "1", "-W", "1", &to]),
    }
}

/// The kernel's verdict on every flow. Flows to the same port run one after the other (`nc -lk`
/// accepts one connection at a time and has a tiny backlog: parallel connects to one listener
/// could time out though allowed); different ports run in parallel. A flow that did not get
/// through is tried once more, so a slow moment cannot turn an allow into a deny; an allow
/// cannot be a timing artefact.
fn kernel_verdicts(c: &Cluster, flows: &BTreeSet<Flow>) -> BTreeMap<Flow, bool> {
    let mut by_target: BTreeMap<(usize, Option<u16>), Vec<Flow>> = BTreeMap::new();
    for f in flows {
        by_target.entry((f.to, f.port)).or_default().push(*f);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = by_target
            .values()
            .map(|group| {
                s.spawn(move || {
                    let first: Vec<(Flow, bool)> =
                        group.iter().map(|f| (*f, send(c, *f))).collect();
                    first
                        .into_iter()
                        .map(|(f, ok)| (f, ok || send(c, f)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("probe thread"))
            .collect()
    })
}

/// Explain's answer: its JSON, or why there is none (exit status, output).
fn explain(calc_server: &Path, dir: &Path, probe: &Probe) -> Result<Value, String> {
    let args = probe.explain_args(dir);
    let out = Command::new(calc_server)
        .args(&args)
        .output()
        .map_err(|e| format!("run calc-server: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "calc-server {} exited with {}:\n{stdout}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let json: Value = serde_json::from_str(&stdout).map_err(|e| {
        format!(
            "calc-server {}: not one JSON object ({e}):\n{stdout}",
            args.join(" ")
        )
    })?;
    match json["verdict"].as_str() {
        Some("allow" | "deny") => Ok(json),
        _ => Err(format!(
            "calc-server {}: no verdict \"allow\" or \"deny\":\n{stdout}",
            args.join(" ")
        )),
    }
}

/// Explain's answers for every probe, a few at a time (each is a process reading the manifests).
fn explain_all(dir: &Path, probes: &[Probe]) -> Vec<Result<Value, String>> {
    let calc_server: PathBuf = integration::binary("calc-server");
    let next = AtomicUsize::new(0);
    let mut answers: Vec<(usize, Result<Value, String>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(p) = probes.get(i) else { break };
                        mine.push((i, explain(&calc_server, dir, p)));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("explain worker"))
            .collect()
    });
    answers.sort_by_key(|(i, _)| *i);
    answers.into_iter().map(|(_, a)| a).collect()
}

driver_tests! {
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    explain_agrees_with_the_kernel_on_random_probes => explain_agrees;
}

fn explain_agrees(driver: Driver) {
    integration::netns::require();
    let started = Instant::now();
    let c = cluster();
    let cp = ControlPlane::start_with_driver(driver, &c.host, c.dir.path(), NODE, &[]);
    cp.wait_programmed();

    let probes = probes();
    let flows: BTreeSet<Flow> = probes.iter().map(|p| p.flow).collect();
    let kernel = kernel_verdicts(&c, &flows);
    let kernel_done = started.elapsed();
    let answers = explain_all(c.dir.path(), &probes);

    let mut problems = Vec::new();
    let (mut allowed, mut denied) = (0, 0);
    let mut decided: BTreeMap<String, usize> = BTreeMap::new();
    for (probe, answer) in probes.iter().zip(&answers) {
        let kernel_allows = kernel[&probe.flow];
        if kernel_allows {
            allowed += 1;
        } else {
            denied += 1;
        }
        match answer {
            Err(why) => problems.push(format!(
                "{} (--from {} --to {}): kernel {}, explain failed: {why}",
                probe.flow.describe(),
                probe.from_arg,
                probe.to_arg,
                verdict(kernel_allows)
            )),
            Ok(json) if (json["verdict"] == "allow") != kernel_allows => problems.push(format!(
                "{} (--from {} --to {}): kernel {}, explain {}:\n{}",
                probe.flow.describe(),
                probe.from_arg,
                probe.to_arg,
                verdict(kernel_allows),
                json["verdict"],
                serde_json::to_string_pretty(json).expect("JSON")
            )),
            Ok(json) => {
                for d in decisions(&probe.flow, json) {
                    *decided.entry(d).or_default() += 1;
                }
            }
        }
    }
    eprintln!(
        "{driver:?}: {} probes ({} distinct flows): {allowed} allowed, {denied} denied by the \
         kernel; kernel probes done after {:.1?}, explain after {:.1?}",
        probes.len(),
        flows.len(),
        kernel_done,
        started.elapsed()
    );
    assert!(
        problems.is_empty(),
        "{driver:?}: explain disagrees with the kernel on {} of {} probes:\n\n{}\n\nagent log:\n{}",
        problems.len(),
        probes.len(),
        problems.join("\n\n"),
        cp.agent_log_text()
    );

    // The probes must be worth something: both verdicts, many times each, and every way of
    // naming a peer.
    assert!(
        allowed >= 60 && denied >= 60,
        "too one-sided a probe set: {allowed} allowed, {denied} denied"
    );
    let outside = probes
        .iter()
        .filter(|p| p.flow.from == Peer::Outside)
        .count();
    let by_wep = probes
        .iter()
        .filter(|p| matches!(p.flow.from, Peer::Pod(i) if p.from_arg.contains(&PODS[i].wep_name())))
        .count();
    let to_ip = probes
        .iter()
        .filter(|p| p.to_arg == Pod::ipv4(p.flow.to))
        .count();
    let pings = probes.iter().filter(|p| p.flow.port.is_none()).count();
    assert!(
        outside >= 20 && by_wep >= 20 && to_ip >= 60 && pings >= 30,
        "too few probes of a kind: {outside} from outside, {by_wep} by endpoint name, \
         {to_ip} to an IP, {pings} pings"
    );

    // And every feature of the cluster must decide some probe.
    let summary: Vec<String> = decided.iter().map(|(d, n)| format!("{n:4} {d}")).collect();
    eprintln!("decided by:\n{}", summary.join("\n"));
    let missing: Vec<String> = MUST_DECIDE
        .iter()
        .filter(|(d, _)| !decided.contains_key(*d))
        .map(|(d, why)| format!("{d} ({why})"))
        .collect();
    assert!(
        missing.is_empty(),
        "no probe was decided by:\n  {}\nprobes were decided by:\n{}",
        missing.join("\n  "),
        summary.join("\n")
    );
}

/// What decided a probe, per side that took part: the source's egress (a pod only: the outside
/// peer has no policy of its own here) and, when egress let it through, the destination's
/// ingress. Labelled `<direction> <policy> rule <n>`, `<direction> profile <name>` or
/// `<direction> <explain's default>` (`end-of-tier <tier>`, …).
fn decisions(flow: &Flow, json: &Value) -> Vec<String> {
    let label = |direction: &str| {
        let d = &json[direction]["decided_by"];
        let what = if let Some(policy) = d["policy"].as_str() {
            format!("{policy} rule {}", d["rule"]["index"])
        } else if let Some(profile) = d["profile"].as_str() {
            format!("profile {profile}")
        } else {
            d["default"].as_str().unwrap_or("?").to_owned()
        };
        format!("{direction} {what}")
    };
    let mut out = Vec::new();
    if flow.from != Peer::Outside {
        out.push(label("egress"));
        if json["egress"]["verdict"] != "allow" {
            return out;
        }
    }
    out.push(label("ingress"));
    out
}

fn verdict(allowed: bool) -> &'static str {
    if allowed { "allow" } else { "deny" }
}
