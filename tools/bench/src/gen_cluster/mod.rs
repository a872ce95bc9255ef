//! Synthetic cluster generator for benchmarks.
//!
//! Role: produces a realistic Calico v3 cluster of a chosen size: tiers, nodes, IP pools,
//! namespace and service-account profiles, workload and host endpoints, network sets and a
//! mix of tiered, global and namespaced policies. Load, calculation and Sync benchmarks can then
//! run on a large cluster without a real datastore. The style follows `examples/cluster/`:
//! names, labels and rules look like what kube-controllers, the CNI plugin and real teams
//! write, so that selectors match realistic subsets and named ports resolve.
//!
//! Contract:
//! - [`generate`] is pure and deterministic. The same arguments (seed included) always give the
//!   same objects in the same order, and another seed gives another cluster. Every object passes
//!   `calc_graph::manifest::decode_and_validate`, and the keys, interface names and IPs are unique.
//! - Exact counts: `nodes` Nodes; `nodes × endpoints_per_node` WorkloadEndpoints (exactly
//!   `endpoints_per_node` on each node); `policies` policies in all (NetworkPolicy plus
//!   GlobalNetworkPolicy); `namespaces × 4` Profiles (`kns.<ns>` plus three `ksa.<ns>.<sa>`).
//!   On top come a fixed set: 3 Tiers, 2 IPPools, 1 FelixConfiguration, 1 ClusterInformation and
//!   4 GlobalNetworkSets. There is one NetworkSet per 10 namespaces and one HostEndpoint per 20
//!   nodes, each rounded up.
//! - Policy mix: `policies / 10` (rounded down) go to the `security` and `platform` tiers and
//!   `policies / 5` are default-tier GlobalNetworkPolicies. The first of these selects the host
//!   endpoints when there are any. The rest are NetworkPolicies.
//! - Each part draws from its own random stream, derived from the seed and the part's name.
//!   Changing `--policies` therefore leaves the workloads as they were, and changing the
//!   endpoint counts leaves the policies as they were. The namespace layout depends only on
//!   `namespaces` and the seed.
//! - [`run`] writes the objects that [`generate`] returns, as one JSON array per file
//!   ([`FILES`]), into `out`. A file holds at most [`MAX_PER_FILE`] objects (the file
//!   datastore reads at most that many documents from one file); the rest go on into
//!   `<stem>-2.json`, `<stem>-3.json`, … It creates the directory, overwrites those files,
//!   removes continuation files an earlier, larger run left, and leaves other files alone. It
//!   streams object by object, so 100k endpoints need memory for only one object at a time.
//! - `--shape antrea` writes Antrea's controller benchmark instead (module [`antrea`]): only
//!   `namespaces`, `nodes` and `seed` apply.
//! - Limits: `namespaces >= 1`, `nodes <= 1_000_000` (node IPs come from 172.16.0.0/12), and
//!   `nodes × endpoints_per_node <= 2^23` (the 10.128.0.0/9 pool). [`run`] reports a breach as an
//!   error and [`generate`] panics.

// main.rs calls `run`; `generate` and `GenStats::count` serve tests and benchmarks. Dead code
// is still checked in the test build, which uses every entry point.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};
use serde_json::{Map, Value, json};

mod antrea;

/// Command-line arguments of `gen-cluster`.
#[derive(clap::Args, Debug, Clone)]
pub struct GenClusterArgs {
    /// Number of nodes (`node-0` … `node-<n-1>`).
    #[arg(long, env = "GEN_CLUSTER_NODES", default_value_t = 100)]
    pub nodes: usize,
    /// Workload endpoints on each node.
    #[arg(long, env = "GEN_CLUSTER_ENDPOINTS_PER_NODE", default_value_t = 100)]
    pub endpoints_per_node: usize,
    /// Total number of policies (NetworkPolicy + GlobalNetworkPolicy).
    #[arg(long, env = "GEN_CLUSTER_POLICIES", default_value_t = 1000)]
    pub policies: usize,
    /// Number of namespaces (`ns-0` … `ns-<n-1>`); at least 1.
    #[arg(long, env = "GEN_CLUSTER_NAMESPACES", default_value_t = 100)]
    pub namespaces: usize,
    /// Seed of the random generator: the same seed gives the same cluster.
    #[arg(long, env = "GEN_CLUSTER_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Output directory (created if missing; the generated files in it are overwritten).
    #[arg(long, env = "GEN_CLUSTER_OUT")]
    pub out: PathBuf,
    /// What the cluster looks like: `calico` (tiers, guard rails, named ports, network sets)
    /// or `antrea` (Antrea's controller benchmark: per namespace 4 pods and 3 Kubernetes
    /// NetworkPolicies; only `--namespaces`, `--nodes` and `--seed` apply).
    #[arg(long, env = "GEN_CLUSTER_SHAPE", value_enum, default_value_t = Shape::Calico)]
    pub shape: Shape,
}

/// The kinds of cluster `gen-cluster` writes (`--shape`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Shape {
    /// The realistic Calico cluster described in the module documentation.
    #[default]
    Calico,
    /// Antrea's controller benchmark (see [`antrea`]).
    Antrea,
}

/// What [`run`] wrote.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GenStats {
    /// Files written.
    pub files: usize,
    /// Objects written, over all files.
    pub objects: usize,
    /// Objects by v3 kind (`"WorkloadEndpoint"` → count).
    pub by_kind: BTreeMap<String, usize>,
}

impl GenStats {
    /// The number of objects of one kind (0 if none).
    #[cfg(test)]
    pub fn count(&self, kind: &str) -> usize {
        self.by_kind.get(kind).copied().unwrap_or(0)
    }

    fn record(&mut self, value: &Value) {
        self.objects += 1;
        let kind = value.get("kind").and_then(Value::as_str).unwrap_or("?");
        *self.by_kind.entry(kind.to_string()).or_default() += 1;
    }
}

impl fmt::Display for GenStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} objects in {} files (", self.objects, self.files)?;
        for (i, (kind, n)) in self.by_kind.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{kind}: {n}")?;
        }
        f.write_str(")")
    }
}

/// The files [`run`] writes, one per [`Section`], in section order.
pub const FILES: [&str; 6] = [
    "tiers.json",
    "infra.json",
    "namespaces.json",
    "netsets.json",
    "workloads.json",
    "policies.json",
];

/// The most objects one generated file holds: the file datastore's limit per file
/// (`calc_graph::manifest::MAX_DOCUMENTS`).
pub const MAX_PER_FILE: usize = calc_graph::manifest::MAX_DOCUMENTS;

/// Every file a generated cluster in `dir` consists of, sorted.
pub fn cluster_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = e?.path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_cluster_file)
        {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// `<stem>.json` or `<stem>-<n>.json` for a stem of [`FILES`].
fn is_cluster_file(name: &str) -> bool {
    FILES.iter().any(|f| {
        let stem = f.trim_end_matches(".json");
        name == *f
            || name
                .strip_prefix(stem)
                .and_then(|r| r.strip_prefix('-'))
                .and_then(|r| r.strip_suffix(".json"))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// Generates the cluster and writes it into `args.out`.
pub fn run(args: &GenClusterArgs) -> anyhow::Result<GenStats> {
    check(args)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    for stale in cluster_files(&args.out)? {
        std::fs::remove_file(&stale)
            .with_context(|| format!("cannot remove {}", stale.display()))?;
    }
    let mut writers = FILES
        .iter()
        .map(|f| ArrayWriter::create(&args.out, f))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut stats = GenStats::default();
    emit(args, &mut |section, value| {
        stats.record(&value);
        writers[section as usize].push(&value)
    })?;
    for w in writers {
        stats.files += w.finish()?;
    }
    tracing::info!(out = %args.out.display(), %stats, "generated cluster");
    Ok(stats)
}

/// The objects of the cluster, in the order [`run`] writes them (file by file).
///
/// # Panics
/// If the arguments break the limits in the module documentation.
pub fn generate(args: &GenClusterArgs) -> Vec<Value> {
    if let Err(e) = check(args) {
        panic!("gen-cluster: {e:#}");
    }
    let mut out = Vec::new();
    let Ok(()) = emit::<std::convert::Infallible>(args, &mut |_, v| {
        out.push(v);
        Ok(())
    });
    out
}

// ---------------------------------------------------------------------------------------------
// Sizes and limits

/// IPv4 workload addresses come from this pool.
const POOL_V4: Ipv4Addr = Ipv4Addr::new(10, 128, 0, 0);
const POOL_V4_PREFIX: u32 = 9;
/// IPv6 workload addresses (for about 10% of endpoints) come from this pool.
const POOL_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0);
const POOL_V6_PREFIX: u32 = 48;
/// Node addresses: the first `NODE_IP_OFFSET` addresses are left for gateways.
const NODE_NET: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 0);
const NODE_IP_OFFSET: u32 = 10;
const MAX_NODES: usize = 1_000_000;
const GLOBAL_THREAT_FEEDS: usize = 4;
const CIDRS_PER_FEED: usize = 50;
/// One NetworkSet per this many namespaces, and one HostEndpoint per this many nodes.
const NAMESPACES_PER_NETSET: usize = 10;
const NODES_PER_HOST_ENDPOINT: usize = 20;
/// Service accounts per namespace: `default` and two others.
const SERVICE_ACCOUNTS_PER_NS: usize = 3;

fn check(args: &GenClusterArgs) -> anyhow::Result<()> {
    ensure!(
        args.namespaces >= 1,
        "--namespaces must be at least 1 (every endpoint and namespaced policy needs one)"
    );
    ensure!(
        args.nodes <= MAX_NODES,
        "--nodes must be at most {MAX_NODES} (node IPs come from {NODE_NET}/12)"
    );
    let capacity = 1usize << (32 - POOL_V4_PREFIX);
    if args.shape == Shape::Antrea {
        ensure!(
            args.nodes >= 1 && args.namespaces.saturating_mul(4) <= capacity,
            "with --shape antrea, --nodes must be at least 1 and --namespaces × 4 at most {capacity} (the {POOL_V4}/{POOL_V4_PREFIX} pool)"
        );
        return Ok(());
    }
    let total = args.nodes.checked_mul(args.endpoints_per_node);
    ensure!(
        total.is_some_and(|t| t <= capacity),
        "--nodes × --endpoints-per-node must be at most {capacity} (the {POOL_V4}/{POOL_V4_PREFIX} pool)"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Output

/// Which file an object goes to; the discriminant indexes [`FILES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    Tiers = 0,
    Infra = 1,
    Namespaces = 2,
    NetSets = 3,
    Workloads = 4,
    Policies = 5,
}

/// Streams JSON arrays to files, one object per line, so that a large file is never held in
/// memory and a diff or `head` of it stays readable; starts a continuation file every
/// [`MAX_PER_FILE`] objects.
struct ArrayWriter {
    dir: PathBuf,
    name: &'static str,
    path: PathBuf,
    out: BufWriter<File>,
    /// Objects in the current file.
    count: usize,
    /// Files written so far, the current one included.
    files: usize,
}

impl ArrayWriter {
    fn create(dir: &Path, name: &'static str) -> anyhow::Result<ArrayWriter> {
        let path = dir.join(name);
        Ok(ArrayWriter {
            dir: dir.to_path_buf(),
            name,
            out: Self::open(&path)?,
            path,
            count: 0,
            files: 1,
        })
    }

    fn open(path: &Path) -> anyhow::Result<BufWriter<File>> {
        let file =
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(BufWriter::with_capacity(1 << 20, file))
    }

    fn push(&mut self, value: &Value) -> anyhow::Result<()> {
        if self.count == MAX_PER_FILE {
            self.end_file()?;
            self.files += 1;
            let stem = self.name.trim_end_matches(".json");
            self.path = self.dir.join(format!("{stem}-{}.json", self.files));
            self.out = Self::open(&self.path)?;
            self.count = 0;
        }
        let sep: &[u8] = if self.count == 0 { b"[\n" } else { b",\n" };
        self.count += 1;
        self.out
            .write_all(sep)
            .map_err(anyhow::Error::from)
            .and_then(|()| serde_json::to_writer(&mut self.out, value).map_err(Into::into))
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    fn end_file(&mut self) -> anyhow::Result<()> {
        let end: &[u8] = if self.count == 0 { b"[]\n" } else { b"\n]\n" };
        self.out
            .write_all(end)
            .and_then(|()| self.out.flush())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// Ends the last file; returns how many files were written.
    fn finish(mut self) -> anyhow::Result<usize> {
        self.end_file()?;
        Ok(self.files)
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic randomness

/// The shared splitmix64 ([`common::Rng`]), one independent stream per part of the cluster,
/// with the picks the generator needs.
struct Rng(common::Rng);

impl Rng {
    /// An independent stream for one part of the cluster.
    fn new(seed: u64, stream: &str) -> Rng {
        Rng(common::Rng::new(seed ^ fnv1a(stream.as_bytes())))
    }

    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn below(&mut self, n: usize) -> usize {
        self.0.below(n)
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// Picks by weight from `(item, weight)` pairs.
    fn weighted<T: Copy>(&mut self, items: &[(T, usize)]) -> T {
        let total: usize = items.iter().map(|(_, w)| w).sum();
        let mut x = self.below(total);
        for &(item, w) in items {
            if x < w {
                return item;
            }
            x -= w;
        }
        items[items.len() - 1].0
    }

    /// `k` distinct indices of `0..n` (`k <= n`), in random order.
    fn distinct(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = i + self.below(n - i);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }

    fn hex(&mut self, digits: usize) -> String {
        let mut s = String::with_capacity(digits + 16);
        while s.len() < digits {
            s.push_str(&format!("{:016x}", self.next_u64()));
        }
        s.truncate(digits);
        s
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A bijection on 44-bit numbers (odd multiplications and xorshifts, mod 2^44). Interface names
/// carry 11 hex digits (44 bits). Calico derives them from sha1("<ns>.<pod>"), but a hash can
/// collide. Permuting the endpoint's index instead looks just as random and is unique by
/// construction.
fn permute44(x: u64) -> u64 {
    const MASK: u64 = (1 << 44) - 1;
    let mut x = x & MASK;
    x = x.wrapping_mul(0x9E37_79B9_7F4B) & MASK;
    x ^= x >> 23;
    x = x.wrapping_mul(0x5851_F42D_4C95_7F2D) & MASK;
    x ^= x >> 19;
    x
}

/// Kubernetes' pod-name alphabet (`rand.String`: no vowels, no confusable digits).
const K8S_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

/// Distinct 5-character pod-name suffixes: 27^5.
const POD_SUFFIXES: u64 = 14_348_907;

/// `len` characters of the k8s alphabet spelling `n` (little-endian, wrapping).
fn k8s_chars(mut n: u64, len: usize) -> String {
    let base = K8S_ALPHABET.len() as u64;
    (0..len)
        .map(|_| {
            let c = K8S_ALPHABET[(n % base) as usize] as char;
            n /= base;
            c
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Vocabulary

const TEAMS: [&str; 8] = [
    "storefront",
    "payments",
    "search",
    "data",
    "platform",
    "identity",
    "analytics",
    "messaging",
];
const ENVIRONMENTS: [(&str, usize); 3] = [("prod", 50), ("staging", 30), ("dev", 20)];
const VERSIONS: [(&str, usize); 3] = [("v1", 50), ("v2", 35), ("v3", 15)];

#[derive(Clone, Copy, Debug)]
struct NamedPort {
    name: &'static str,
    protocol: &'static str,
    port: u16,
}

const HTTP: NamedPort = NamedPort {
    name: "http",
    protocol: "TCP",
    port: 80,
};
const METRICS: NamedPort = NamedPort {
    name: "metrics",
    protocol: "TCP",
    port: 9090,
};
const GRPC: NamedPort = NamedPort {
    name: "grpc",
    protocol: "TCP",
    port: 50051,
};
const DNS: NamedPort = NamedPort {
    name: "dns",
    protocol: "UDP",
    port: 53,
};

#[derive(Clone, Copy, Debug)]
struct App {
    name: &'static str,
    tier: &'static str,
    ports: &'static [NamedPort],
    /// StatefulSet pods are `<app>-<ordinal>`; Deployment pods `<app>-<hash>-<suffix>`.
    stateful: bool,
}

const fn app(
    name: &'static str,
    tier: &'static str,
    ports: &'static [NamedPort],
    stateful: bool,
) -> App {
    App {
        name,
        tier,
        ports,
        stateful,
    }
}

const APPS: [App; 20] = [
    app("web", "frontend", &[HTTP, METRICS], false),
    app("frontend", "frontend", &[HTTP], false),
    app("gateway", "frontend", &[HTTP, GRPC], false),
    app("api", "backend", &[HTTP, GRPC, METRICS], false),
    app("checkout", "backend", &[GRPC, METRICS], false),
    app("cart", "backend", &[GRPC], false),
    app("catalog", "backend", &[HTTP, METRICS], false),
    app("search", "backend", &[HTTP], false),
    app("auth", "backend", &[GRPC, METRICS], false),
    app("payments", "backend", &[GRPC, METRICS], false),
    app("orders", "backend", &[HTTP, GRPC], false),
    app("shipping", "backend", &[], false),
    app("notifications", "backend", &[], false),
    app("worker", "backend", &[METRICS], false),
    app("postgres", "data", &[METRICS], true),
    app("redis", "data", &[], true),
    app("kafka", "data", &[METRICS], true),
    app("elasticsearch", "data", &[HTTP], true),
    app("prometheus", "backend", &[HTTP], true),
    app("coredns", "backend", &[DNS, METRICS], false),
];

fn app_index(name: &str) -> usize {
    APPS.iter()
        .position(|a| a.name == name)
        .expect("a known app")
}

/// Non-default service accounts and the `pcsa.role` label each one carries.
const SERVICE_ACCOUNTS: [(&str, &str); 6] = [
    ("api", "backend"),
    ("worker", "backend"),
    ("gateway", "frontend"),
    ("reader", "data"),
    ("batch", "data"),
    ("deployer", "ci"),
];

// ---------------------------------------------------------------------------------------------
// The cluster layout shared by workloads and policies

struct Namespace {
    name: String,
    team: &'static str,
    env: &'static str,
    /// Indices into [`APPS`] of the apps deployed here.
    apps: Vec<usize>,
    /// The service account of each app in `apps`.
    app_sas: Vec<&'static str>,
    /// `default` first, then the others.
    sas: Vec<&'static str>,
}

impl Namespace {
    fn has_netset(index: usize) -> bool {
        index.is_multiple_of(NAMESPACES_PER_NETSET)
    }
}

/// Namespace `ns-0` is the platform namespace. It is where prometheus and coredns run, so the
/// platform tier's monitoring and DNS rules find their peers. The others get a random team,
/// environment and 3-6 apps.
fn namespaces(args: &GenClusterArgs) -> Vec<Namespace> {
    let mut rng = Rng::new(args.seed, "namespaces");
    (0..args.namespaces)
        .map(|j| {
            let (team, env, mut apps) = if j == 0 {
                let mut apps = vec![app_index("prometheus"), app_index("coredns")];
                let extra = rng.pick(&["web", "api", "worker"]);
                apps.push(app_index(extra));
                ("platform", "prod", apps)
            } else {
                let n = 3 + rng.below(4);
                // The last two apps, prometheus and coredns, run in ns-0 only.
                let apps = rng.distinct(APPS.len() - 2, n);
                (*rng.pick(&TEAMS), rng.weighted(&ENVIRONMENTS), apps)
            };
            apps.sort_unstable();
            let mut sas = vec!["default"];
            for i in rng.distinct(SERVICE_ACCOUNTS.len(), SERVICE_ACCOUNTS_PER_NS - 1) {
                sas.push(SERVICE_ACCOUNTS[i].0);
            }
            let app_sas = apps
                .iter()
                .map(|_| {
                    if rng.chance(30) {
                        "default"
                    } else {
                        sas[1 + rng.below(sas.len() - 1)]
                    }
                })
                .collect();
            Namespace {
                name: format!("ns-{j}"),
                team,
                env,
                apps,
                app_sas,
                sas,
            }
        })
        .collect()
}

fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(NODE_NET) + NODE_IP_OFFSET + i as u32)
}

fn host_endpoint_nodes(args: &GenClusterArgs) -> impl Iterator<Item = usize> {
    (0..args.nodes).step_by(NODES_PER_HOST_ENDPOINT)
}

// ---------------------------------------------------------------------------------------------
// Object builders

const API_VERSION: &str = "projectcalico.org/v3";

fn object(kind: &str, name: &str, namespace: Option<&str>, labels: Map<String, Value>) -> Value {
    let mut meta = Map::new();
    meta.insert("name".into(), name.into());
    if let Some(ns) = namespace {
        meta.insert("namespace".into(), ns.into());
    }
    if !labels.is_empty() {
        meta.insert("labels".into(), Value::Object(labels));
    }
    json!({"apiVersion": API_VERSION, "kind": kind, "metadata": meta, "spec": {}})
}

fn with_spec(mut obj: Value, spec: Value) -> Value {
    obj["spec"] = spec;
    obj
}

fn labels<const N: usize>(pairs: [(&str, &str); N]) -> Map<String, Value> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), Value::from(v)))
        .collect()
}

/// Calico's workload endpoint name segments double every `-` so the `-` separators stay
/// unambiguous (`libcalico-go/lib/names/workloadendpoint.go`).
fn escape_segment(s: &str) -> String {
    s.replace('-', "--")
}

// ---------------------------------------------------------------------------------------------
// The generator

/// Emits every object, section by section, into `sink`.
fn emit<E>(
    args: &GenClusterArgs,
    sink: &mut dyn FnMut(Section, Value) -> Result<(), E>,
) -> Result<(), E> {
    if args.shape == Shape::Antrea {
        return antrea::emit(args, sink);
    }
    let nss = namespaces(args);
    for v in tiers() {
        sink(Section::Tiers, v)?;
    }
    for v in infrastructure(args) {
        sink(Section::Infra, v)?;
    }
    for v in namespace_profiles(&nss) {
        sink(Section::Namespaces, v)?;
    }
    for v in network_sets(args, &nss) {
        sink(Section::NetSets, v)?;
    }
    workloads(args, &nss, &mut |v| sink(Section::Workloads, v))?;
    let mut policies = Policies::new(args, &nss);
    for i in 0..args.policies {
        sink(Section::Policies, policies.policy(i))?;
    }
    Ok(())
}

fn tiers() -> Vec<Value> {
    [
        ("security", 100, "Pass"),
        ("platform", 200, "Pass"),
        ("default", 1_000_000, "Deny"),
    ]
    .into_iter()
    .map(|(name, order, action)| {
        with_spec(
            object("Tier", name, None, Map::new()),
            json!({"order": order, "defaultAction": action}),
        )
    })
    .collect()
}

fn infrastructure(args: &GenClusterArgs) -> Vec<Value> {
    let mut rng = Rng::new(args.seed, "infrastructure");
    let mut out = vec![
        with_spec(
            object("ClusterInformation", "default", None, Map::new()),
            json!({
                "clusterGUID": rng.hex(32),
                "clusterType": "k8s,bgp,kubeadm",
                "calicoVersion": "v3.31.0",
                "datastoreReady": true,
            }),
        ),
        with_spec(
            object("FelixConfiguration", "default", None, Map::new()),
            json!({
                "logSeverityScreen": "Info",
                "defaultEndpointToHostAction": "Drop",
                "iptablesRefreshInterval": "180s",
                "reportingInterval": "0s",
            }),
        ),
        with_spec(
            object("IPPool", "default-ipv4-ippool", None, Map::new()),
            json!({
                "cidr": format!("{POOL_V4}/{POOL_V4_PREFIX}"),
                "blockSize": 26,
                "ipipMode": "Never",
                "vxlanMode": "CrossSubnet",
                "natOutgoing": true,
                "nodeSelector": "all()",
            }),
        ),
        with_spec(
            object("IPPool", "default-ipv6-ippool", None, Map::new()),
            json!({
                "cidr": format!("{POOL_V6}/{POOL_V6_PREFIX}"),
                "blockSize": 122,
                "ipipMode": "Never",
                "vxlanMode": "Never",
                "natOutgoing": false,
                "nodeSelector": "all()",
            }),
        ),
    ];
    const ZONES: [&str; 3] = ["zone-a", "zone-b", "zone-c"];
    for i in 0..args.nodes {
        let name = format!("node-{i}");
        let zone = ZONES[i % ZONES.len()];
        out.push(with_spec(
            object(
                "Node",
                &name,
                None,
                labels([
                    ("kubernetes.io/hostname", name.as_str()),
                    ("kubernetes.io/os", "linux"),
                    ("topology.kubernetes.io/zone", zone),
                ]),
            ),
            json!({"bgp": {"ipv4Address": format!("{}/12", node_ip(i))}}),
        ));
    }
    for i in host_endpoint_nodes(args) {
        let node = format!("node-{i}");
        let role = if rng.chance(50) { "ingress" } else { "egress" };
        out.push(with_spec(
            object(
                "HostEndpoint",
                &format!("{node}-eth0"),
                None,
                labels([("host-endpoint", "true"), ("node-role", role)]),
            ),
            json!({
                "node": node,
                "interfaceName": "eth0",
                "expectedIPs": [node_ip(i).to_string()],
                "profiles": [],
                "ports": [{"name": "ssh", "protocol": "TCP", "port": 22}],
            }),
        ));
    }
    out
}

/// The profiles kube-controllers writes: `kns.<ns>` (allow-all, carrying the namespace labels
/// as `pcns.*`) and `ksa.<ns>.<sa>` (carrying the service account labels as `pcsa.*`).
fn namespace_profiles(nss: &[Namespace]) -> Vec<Value> {
    let mut out = Vec::with_capacity(nss.len() * (1 + SERVICE_ACCOUNTS_PER_NS));
    for ns in nss {
        out.push(with_spec(
            object("Profile", &format!("kns.{}", ns.name), None, Map::new()),
            json!({
                "ingress": [{"action": "Allow"}],
                "egress": [{"action": "Allow"}],
                "labelsToApply": {
                    "pcns.projectcalico.org/name": ns.name,
                    "pcns.team": ns.team,
                    "pcns.environment": ns.env,
                },
            }),
        ));
        for sa in &ns.sas {
            let mut to_apply = labels([("pcsa.projectcalico.org/name", *sa)]);
            if let Some((_, role)) = SERVICE_ACCOUNTS.iter().find(|(n, _)| n == sa) {
                to_apply.insert("pcsa.role".into(), (*role).into());
            }
            out.push(with_spec(
                object(
                    "Profile",
                    &format!("ksa.{}.{sa}", ns.name),
                    None,
                    Map::new(),
                ),
                json!({"labelsToApply": to_apply}),
            ));
        }
    }
    out
}

/// A public-looking IPv4 CIDR (no RFC 1918, loopback or link-local), strictly masked.
fn public_v4(rng: &mut Rng, prefix: u32) -> String {
    loop {
        let first = 1 + rng.below(222) as u32;
        if matches!(first, 10 | 100 | 127 | 169 | 172 | 192) {
            continue;
        }
        let addr = (first << 24) | (rng.next_u64() as u32 & 0x00ff_ffff);
        let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
        return format!("{}/{prefix}", Ipv4Addr::from(addr & mask));
    }
}

fn network_sets(args: &GenClusterArgs, nss: &[Namespace]) -> Vec<Value> {
    let mut rng = Rng::new(args.seed, "network-sets");
    let mut out = Vec::new();
    for f in 0..GLOBAL_THREAT_FEEDS {
        let name = format!("threat-feed-{f}");
        let mut nets: Vec<String> = Vec::with_capacity(CIDRS_PER_FEED);
        while nets.len() < CIDRS_PER_FEED {
            let net = if rng.chance(10) {
                format!("2001:db8:{:x}::/48", rng.below(0x10000))
            } else {
                let prefix = *rng.pick(&[16, 20, 24, 24, 24, 28, 32, 32]);
                public_v4(&mut rng, prefix)
            };
            if !nets.contains(&net) {
                nets.push(net);
            }
        }
        out.push(with_spec(
            object(
                "GlobalNetworkSet",
                &name,
                None,
                labels([("feed", "threats"), ("feed-name", name.as_str())]),
            ),
            json!({"nets": nets}),
        ));
    }
    for (j, ns) in nss.iter().enumerate() {
        if !Namespace::has_netset(j) {
            continue;
        }
        let third = (j / NAMESPACES_PER_NETSET) % 256;
        out.push(with_spec(
            object(
                "NetworkSet",
                "backup-servers",
                Some(&ns.name),
                labels([("role", "backup")]),
            ),
            json!({"nets": [
                format!("192.168.{third}.0/24"),
                format!("10.{}.{}.0/28", rng.below(128), rng.below(256)),
            ]}),
        ));
    }
    out
}

fn workloads<E>(
    args: &GenClusterArgs,
    nss: &[Namespace],
    sink: &mut dyn FnMut(Value) -> Result<(), E>,
) -> Result<(), E> {
    let mut rng = Rng::new(args.seed, "workloads");
    let per_node = args.endpoints_per_node;
    // Each node owns an aligned range of the pool, as Calico's IPAM blocks do. If the ranges
    // would not fit, the addresses are packed densely instead.
    let capacity = 1usize << (32 - POOL_V4_PREFIX);
    let block = per_node.next_power_of_two().max(64);
    let block = if args.nodes.saturating_mul(block) <= capacity {
        block
    } else {
        per_node
    };
    let iface_offset = rng.next_u64();
    let suffix_offset = rng.next_u64() % POD_SUFFIXES;
    // Per (namespace, app): the Deployment's pod-template hash and the next StatefulSet ordinal.
    let template_hash = |ns: usize, app: usize| {
        k8s_chars(fnv1a(format!("{}/{ns}/{app}", args.seed).as_bytes()), 10)
    };
    let mut ordinals = vec![0u32; nss.len() * APPS.len()];
    for i in 0..args.nodes {
        let node = format!("node-{i}");
        let node_segment = escape_segment(&node);
        for j in 0..per_node {
            let k = i * per_node + j;
            let n = rng.below(nss.len());
            let ns = &nss[n];
            let slot = rng.below(ns.apps.len());
            let a = ns.apps[slot];
            let app = &APPS[a];
            let sa = ns.app_sas[slot];
            let pod = if app.stateful {
                let o = &mut ordinals[n * APPS.len() + a];
                *o += 1;
                format!("{}-{}", app.name, *o - 1)
            } else {
                // An affine map mod 27^5 with a multiplier prime to 27 spreads consecutive
                // indices over the suffix space and keeps them distinct (k < 2^23 < 27^5).
                let suffix = k8s_chars(((k as u64) * 7_654_321 + suffix_offset) % POD_SUFFIXES, 5);
                format!("{}-{}-{suffix}", app.name, template_hash(n, a))
            };
            let ip4 = Ipv4Addr::from(u32::from(POOL_V4) + (i * block + j) as u32);
            let mut ips = vec![Value::from(format!("{ip4}/32"))];
            if rng.chance(10) {
                let ip6 = Ipv6Addr::from(u128::from(POOL_V6) | ((i as u128) << 32) | j as u128);
                ips.push(format!("{ip6}/128").into());
            }
            let mut meta_labels = labels([
                ("app", app.name),
                ("version", rng.weighted(&VERSIONS)),
                ("tier", app.tier),
                ("projectcalico.org/namespace", ns.name.as_str()),
                ("projectcalico.org/orchestrator", "k8s"),
                ("projectcalico.org/serviceaccount", sa),
            ]);
            // A few quarantined pods, so that the security tier's quarantine policy bites.
            if rng.chance(1) {
                meta_labels.insert("quarantine".into(), "true".into());
            }
            let ports: Vec<Value> = app
                .ports
                .iter()
                .map(|p| json!({"name": p.name, "protocol": p.protocol, "port": p.port}))
                .collect();
            let mut spec = json!({
                "orchestrator": "k8s",
                "node": node,
                "containerID": rng.hex(64),
                "pod": pod,
                "endpoint": "eth0",
                "serviceAccountName": sa,
                "ipNetworks": ips,
                "profiles": [format!("kns.{}", ns.name), format!("ksa.{}.{sa}", ns.name)],
                "interfaceName": format!("cali{:011x}", permute44(iface_offset.wrapping_add(k as u64))),
                "mac": "ee:ee:ee:ee:ee:ee",
            });
            if !ports.is_empty() {
                spec["ports"] = Value::Array(ports);
            }
            let name = format!("{node_segment}-k8s-{}-eth0", escape_segment(&pod));
            sink(with_spec(
                object("WorkloadEndpoint", &name, Some(&ns.name), meta_labels),
                spec,
            ))?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Policies

/// Builds one rule; only the fields that are set are written, as calicoctl does.
struct RuleBuilder {
    rule: Map<String, Value>,
    source: Map<String, Value>,
    destination: Map<String, Value>,
}

fn rule(action: &str) -> RuleBuilder {
    let mut rule = Map::new();
    rule.insert("action".into(), action.into());
    RuleBuilder {
        rule,
        source: Map::new(),
        destination: Map::new(),
    }
}

impl RuleBuilder {
    fn set(mut self, key: &str, v: impl Into<Value>) -> Self {
        self.rule.insert(key.into(), v.into());
        self
    }
    fn protocol(self, p: &str) -> Self {
        self.set("protocol", p)
    }
    fn src(mut self, key: &str, v: impl Into<Value>) -> Self {
        self.source.insert(key.into(), v.into());
        self
    }
    fn dst(mut self, key: &str, v: impl Into<Value>) -> Self {
        self.destination.insert(key.into(), v.into());
        self
    }
    fn build(mut self) -> Value {
        if !self.source.is_empty() {
            self.rule
                .insert("source".into(), Value::Object(self.source));
        }
        if !self.destination.is_empty() {
            self.rule
                .insert("destination".into(), Value::Object(self.destination));
        }
        Value::Object(self.rule)
    }
}

/// An order as Calico stores it: integral orders as integers, so the JSON reads naturally.
fn order_value(o: f64) -> Value {
    if o.fract() == 0.0 && o.abs() < 1e15 {
        Value::from(o as i64)
    } else {
        Value::from(o)
    }
}

fn sel_eq(key: &str, value: &str) -> String {
    format!("{key} == '{value}'")
}

struct Policies<'a> {
    nss: &'a [Namespace],
    rng: Rng,
    tiered: usize,
    global: usize,
    host_endpoints: bool,
}

impl<'a> Policies<'a> {
    fn new(args: &GenClusterArgs, nss: &'a [Namespace]) -> Policies<'a> {
        Policies {
            nss,
            rng: Rng::new(args.seed, "policies"),
            tiered: args.policies / 10,
            global: args.policies / 5,
            host_endpoints: args.nodes > 0,
        }
    }

    /// Policy `i`: first the tiered ones, then the default-tier globals, then namespaced ones.
    fn policy(&mut self, i: usize) -> Value {
        if i < self.tiered {
            self.tiered_policy(i)
        } else if i < self.tiered + self.global {
            self.global_policy(i - self.tiered, i)
        } else {
            self.namespaced_policy(i)
        }
    }

    /// Mostly distinct orders, some shared (ties are broken by name) and some unset (sorted
    /// last), so the policy sort's every branch is exercised.
    fn order(&mut self, index: usize, base: f64, step: f64) -> Option<f64> {
        match self.rng.below(100) {
            0..10 => None,
            10..25 => Some(base * *self.rng.pick(&[1.0, 2.0, 5.0])),
            _ if self.rng.chance(5) => Some(base + index as f64 * step + 0.5),
            _ => Some(base + index as f64 * step),
        }
    }

    fn action(&mut self) -> &'static str {
        self.rng
            .weighted(&[("Allow", 75), ("Deny", 12), ("Log", 8), ("Pass", 5)])
    }

    fn team(&mut self) -> &'static str {
        TEAMS[self.rng.below(TEAMS.len())]
    }

    fn env(&mut self) -> &'static str {
        self.rng.weighted(&ENVIRONMENTS)
    }

    fn app(&mut self) -> &'static str {
        self.rng.pick(&APPS).name
    }

    /// Assembles a policy. `types` is written only when `explicit_types`: otherwise Calico
    /// infers it, and both forms should appear.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        &mut self,
        kind: &str,
        name: &str,
        namespace: Option<&str>,
        tier: Option<&str>,
        order: Option<f64>,
        selector: &str,
        namespace_selector: Option<String>,
        ingress: Vec<Value>,
        egress: Vec<Value>,
        explicit_types: bool,
    ) -> Value {
        let mut spec = Map::new();
        if let Some(t) = tier {
            spec.insert("tier".into(), t.into());
        }
        if let Some(o) = order {
            spec.insert("order".into(), order_value(o));
        }
        if !selector.is_empty() {
            spec.insert("selector".into(), selector.into());
        }
        if let Some(ns) = namespace_selector {
            spec.insert("namespaceSelector".into(), ns.into());
        }
        if explicit_types || (ingress.is_empty() && egress.is_empty()) {
            let mut types = Vec::new();
            if !ingress.is_empty() || egress.is_empty() {
                types.push("Ingress");
            }
            if !egress.is_empty() || ingress.is_empty() {
                types.push("Egress");
            }
            spec.insert("types".into(), json!(types));
        }
        if !ingress.is_empty() {
            spec.insert("ingress".into(), Value::Array(ingress));
        }
        if !egress.is_empty() {
            spec.insert("egress".into(), Value::Array(egress));
        }
        with_spec(
            object(kind, name, namespace, Map::new()),
            Value::Object(spec),
        )
    }

    /// Guard rails in the security and platform tiers (both default to Pass).
    fn tiered_policy(&mut self, t: usize) -> Value {
        let security = t.is_multiple_of(2);
        let n = t / 2;
        let order = self.order(n, 10.0, 10.0);
        let explicit = self.rng.chance(70);
        let (tier, base, ns_sel, selector, ingress, egress) = if security {
            match n % 5 {
                0 => {
                    let feed = if self.rng.chance(50) {
                        sel_eq("feed", "threats")
                    } else {
                        let f = self.rng.below(GLOBAL_THREAT_FEEDS);
                        format!("feed == 'threats' && feed-name == 'threat-feed-{f}'")
                    };
                    (
                        "security",
                        "block-threat-feeds",
                        None,
                        "all()".to_string(),
                        vec![rule("Deny").src("selector", feed.clone()).build()],
                        vec![rule("Deny").dst("selector", feed).build()],
                    )
                }
                1 => {
                    let env = self.env();
                    (
                        "security",
                        "environment-isolation",
                        Some(sel_eq("environment", env)),
                        String::new(),
                        vec![
                            rule("Pass")
                                .src(
                                    "namespaceSelector",
                                    format!("environment == '{env}' || team == 'platform'"),
                                )
                                .build(),
                            rule("Pass").src("selector", "role == 'backup'").build(),
                            rule("Log").build(),
                            rule("Deny").build(),
                        ],
                        vec![],
                    )
                }
                2 => {
                    let metadata = json!(["169.254.169.254/32"]);
                    (
                        "security",
                        "deny-cloud-metadata",
                        None,
                        "has(projectcalico.org/namespace)".to_string(),
                        vec![],
                        vec![
                            rule("Log").dst("nets", metadata.clone()).build(),
                            rule("Deny").dst("nets", metadata).build(),
                        ],
                    )
                }
                3 => (
                    "security",
                    "quarantine",
                    None,
                    sel_eq("quarantine", "true"),
                    vec![rule("Deny").build()],
                    vec![rule("Deny").build()],
                ),
                _ => {
                    let team = self.team();
                    (
                        "security",
                        "team-isolation",
                        Some(sel_eq("team", team)),
                        "has(app)".to_string(),
                        vec![
                            rule("Pass")
                                .src(
                                    "namespaceSelector",
                                    format!("team in {{'{team}', 'platform'}}"),
                                )
                                .build(),
                            rule("Deny")
                                .src("namespaceSelector", "environment == 'dev'")
                                .build(),
                        ],
                        vec![],
                    )
                }
            }
        } else {
            match n % 5 {
                0 => (
                    "platform",
                    "allow-prometheus-scrape",
                    None,
                    if self.rng.chance(50) {
                        "all()".to_string()
                    } else {
                        "has(app)".to_string()
                    },
                    vec![
                        rule("Allow")
                            .protocol("TCP")
                            .src("namespaceSelector", "team == 'platform'")
                            .src("selector", "app == 'prometheus'")
                            .dst("ports", json!(["metrics"]))
                            .build(),
                    ],
                    vec![],
                ),
                1 => {
                    let kube_dns = json!(["10.96.0.10/32"]);
                    (
                        "platform",
                        "allow-dns-egress",
                        None,
                        "has(projectcalico.org/namespace)".to_string(),
                        vec![],
                        vec![
                            rule("Allow")
                                .protocol("UDP")
                                .dst("namespaceSelector", "team == 'platform'")
                                .dst("selector", "app == 'coredns'")
                                .dst("ports", json!(["dns"]))
                                .build(),
                            rule("Allow")
                                .protocol("UDP")
                                .dst("nets", kube_dns.clone())
                                .dst("ports", json!([53]))
                                .build(),
                            rule("Allow")
                                .protocol("TCP")
                                .dst("nets", kube_dns)
                                .dst("ports", json!([53]))
                                .build(),
                        ],
                    )
                }
                2 => (
                    "platform",
                    "allow-ping",
                    None,
                    "all()".to_string(),
                    vec![
                        rule("Allow")
                            .protocol("ICMP")
                            .set("icmp", json!({"type": 8}))
                            .build(),
                        rule("Allow")
                            .protocol("ICMPv6")
                            .set("ipVersion", 6)
                            .set("icmp", json!({"type": 128}))
                            .build(),
                    ],
                    vec![],
                ),
                3 => (
                    "platform",
                    "pass-frontends",
                    None,
                    sel_eq("tier", "frontend"),
                    vec![rule("Pass").src("nets", json!(["0.0.0.0/0"])).build()],
                    vec![rule("Pass").build()],
                ),
                _ => (
                    "platform",
                    "allow-health-checks",
                    None,
                    "has(app)".to_string(),
                    vec![
                        rule("Allow")
                            .protocol("TCP")
                            .src("nets", json!([format!("{NODE_NET}/12")]))
                            .dst("ports", json!(["http", "8000:8100"]))
                            .build(),
                    ],
                    vec![],
                ),
            }
        };
        // The first round of each guard rail is cluster-wide; further copies are the same rail
        // owned by one application's team, so a large cluster does not stack dozens of
        // identical cluster-wide policies on every endpoint.
        let selector = match (n < 5, selector.is_empty()) {
            (true, _) => selector,
            (false, true) => sel_eq("app", self.app()),
            (false, false) => format!("({selector}) && app == '{}'", self.app()),
        };
        self.assemble(
            "GlobalNetworkPolicy",
            &format!("{base}-{n}"),
            None,
            Some(tier),
            order,
            &selector,
            ns_sel,
            ingress,
            egress,
            explicit,
        )
    }

    /// Cluster-wide application policies in the default tier.
    fn global_policy(&mut self, g: usize, index: usize) -> Value {
        let order = self.order(index, 100.0, 5.0);
        let explicit = self.rng.chance(50);
        let tier = self.rng.chance(50).then_some("default");
        if g == 0 && self.host_endpoints {
            let ingress = vec![
                rule("Allow")
                    .protocol("TCP")
                    .src("nets", json!(["192.168.0.0/24"]))
                    .dst("ports", json!([22]))
                    .build(),
                rule("Allow")
                    .protocol("TCP")
                    .src("nets", json!([format!("{NODE_NET}/12")]))
                    .dst("ports", json!([179, "10250:10259"]))
                    .build(),
            ];
            return self.assemble(
                "GlobalNetworkPolicy",
                "host-endpoints",
                None,
                tier,
                Some(10.0),
                "has(host-endpoint)",
                None,
                ingress,
                vec![rule("Allow").build()],
                true,
            );
        }
        let variant = self.rng.below(8);
        let (base, selector, ns_sel, ingress, egress) = match variant {
            0 => {
                let env = self.env();
                (
                    "data-tier-ingress",
                    sel_eq("tier", "data"),
                    None,
                    vec![
                        rule("Allow")
                            .protocol("TCP")
                            .src("selector", "tier == 'backend'")
                            .src("namespaceSelector", sel_eq("environment", env))
                            .dst("ports", json!([5432, 6379, 9092, "9200:9300"]))
                            .build(),
                    ],
                    vec![],
                )
            }
            1 => (
                "frontends",
                "has(app) && tier == 'frontend'".to_string(),
                Some(sel_eq("environment", self.env())),
                vec![
                    rule("Allow")
                        .protocol("TCP")
                        .dst("ports", json!(["http", 443]))
                        .build(),
                ],
                vec![
                    rule("Allow")
                        .protocol("TCP")
                        .dst("selector", "tier == 'backend'")
                        .dst("ports", json!(["http", "grpc"]))
                        .build(),
                ],
            ),
            2 => {
                let (a, b, c) = (self.app(), self.app(), self.app());
                let action = self.action();
                (
                    "app-access",
                    sel_eq("app", a),
                    Some(sel_eq("team", self.team())),
                    vec![
                        rule(action)
                            .protocol("TCP")
                            .src("selector", format!("app in {{'{b}', '{c}'}}"))
                            .dst("ports", json!(["grpc", "http"]))
                            .build(),
                    ],
                    vec![],
                )
            }
            3 => {
                let t = *self.rng.pick(&["frontend", "backend", "data"]);
                (
                    "deprecated-version",
                    format!("version == 'v1' && tier == '{t}'"),
                    None,
                    vec![],
                    vec![
                        rule("Log").dst("notNets", json!(["10.0.0.0/8"])).build(),
                        rule("Deny")
                            .dst("notNets", json!(["10.0.0.0/8", "172.16.0.0/12"]))
                            .build(),
                    ],
                )
            }
            4 => (
                "backup-access",
                "has(app) && tier == 'data'".to_string(),
                None,
                vec![],
                vec![
                    rule("Allow")
                        .protocol("TCP")
                        .dst("selector", "role == 'backup'")
                        .dst("ports", json!(["5432:5433", 873]))
                        .build(),
                ],
            ),
            5 => {
                let nets: Vec<String> = (0..3).map(|_| public_v4(&mut self.rng, 24)).collect();
                (
                    "dev-no-internet",
                    "has(app) && tier != 'data'".to_string(),
                    Some(sel_eq("environment", "dev")),
                    vec![],
                    vec![
                        rule("Allow").dst("nets", json!(nets)).build(),
                        rule("Deny").dst("notNets", json!(["10.0.0.0/8"])).build(),
                    ],
                )
            }
            6 => (
                "icmp",
                "all()".to_string(),
                None,
                vec![
                    rule("Allow")
                        .protocol("ICMP")
                        .set("ipVersion", 4)
                        .set("icmp", json!({"type": 8, "code": 0}))
                        .build(),
                ],
                vec![],
            ),
            _ => {
                let a = self.app();
                (
                    "service-accounts",
                    format!("app == '{a}' || tier == 'data'"),
                    Some("all()".to_string()),
                    vec![
                        rule("Allow")
                            .protocol("TCP")
                            .src("serviceAccounts", json!({"selector": "role == 'backend'"}))
                            .build(),
                        rule(self.action())
                            .protocol("UDP")
                            .src("notSelector", "has(quarantine)")
                            .dst("notPorts", json!([9, "137:139"]))
                            .build(),
                    ],
                    vec![],
                )
            }
        };
        // A real cluster's global policies mostly name the workloads they are for: only some of
        // the `all()` variant stay cluster-wide; the others are narrowed to one application.
        let selector = if variant == 2 || (variant == 6 && index.is_multiple_of(8)) {
            selector
        } else {
            format!("({selector}) && app == '{}'", self.app())
        };
        self.assemble(
            "GlobalNetworkPolicy",
            &format!("{base}-{index}"),
            None,
            tier,
            order,
            &selector,
            ns_sel,
            ingress,
            egress,
            explicit,
        )
    }

    /// A team's own policy in its namespace (default tier): selects one of the namespace's apps
    /// and admits its peers.
    fn namespaced_policy(&mut self, index: usize) -> Value {
        let n = self.rng.below(self.nss.len());
        let nss = self.nss;
        let ns = &nss[n];
        let order = self.order(index, 1000.0, 1.0);
        let explicit = self.rng.chance(40);
        let target = APPS[*self.rng.pick(&ns.apps)];
        let peer = APPS[*self.rng.pick(&ns.apps)];
        if self.rng.chance(5) {
            let selector = if self.rng.chance(50) { "all()" } else { "" };
            return self.assemble(
                "NetworkPolicy",
                &format!("default-deny-{index}"),
                Some(&ns.name),
                None,
                order,
                selector,
                None,
                vec![],
                vec![],
                true,
            );
        }
        let selector = match self.rng.below(6) {
            0 | 1 => sel_eq("app", target.name),
            2 => format!("app == '{}' && version == 'v2'", target.name),
            3 => sel_eq("tier", target.tier),
            4 => format!("app in {{'{}', '{}'}}", target.name, peer.name),
            _ => format!("app == '{}' && tier == '{}'", target.name, target.tier),
        };
        // Duplicate draws are dropped: a repeated rule adds nothing but noise.
        let mut ingress = Vec::new();
        for _ in 0..1 + self.rng.below(3) {
            let r = self.ingress_rule(ns, target, peer);
            if !ingress.contains(&r) {
                ingress.push(r);
            }
        }
        let mut egress = Vec::new();
        if self.rng.chance(45) {
            for _ in 0..1 + self.rng.below(2) {
                let r = self.egress_rule(ns, peer);
                if !egress.contains(&r) {
                    egress.push(r);
                }
            }
            // Some egress-only policies.
            if self.rng.chance(20) {
                ingress.clear();
            }
        }
        let direction = match (ingress.is_empty(), egress.is_empty()) {
            (false, true) => "ingress",
            (true, false) => "egress",
            _ => "traffic",
        };
        let mut policy = self.assemble(
            "NetworkPolicy",
            &format!("{}-{direction}-{index}", target.name),
            Some(&ns.name),
            None,
            order,
            &selector,
            None,
            ingress,
            egress,
            explicit,
        );
        if self.rng.chance(5) {
            policy["spec"]["serviceAccountSelector"] = "role == 'backend'".into();
        }
        policy
    }

    /// A named port of the app if it has one (so named-port resolution is exercised), else a
    /// numeric port, list or range.
    fn ports_of(&mut self, app: App) -> (&'static str, Value) {
        let tcp: Vec<&NamedPort> = app.ports.iter().filter(|p| p.protocol == "TCP").collect();
        if !tcp.is_empty() && self.rng.chance(60) {
            return ("TCP", json!([self.rng.pick(&tcp).name]));
        }
        let ports = match self.rng.below(4) {
            0 => json!([80, 443]),
            1 => json!(["8000:8100"]),
            2 => json!([8080]),
            _ => json!([8443, "9000:9010"]),
        };
        ("TCP", ports)
    }

    fn ingress_rule(&mut self, ns: &Namespace, target: App, peer: App) -> Value {
        match self.rng.below(12) {
            0..=2 => {
                let (proto, ports) = self.ports_of(target);
                rule("Allow")
                    .protocol(proto)
                    .src("selector", sel_eq("app", peer.name))
                    .dst("ports", ports)
                    .build()
            }
            3 => {
                let mut r = rule("Allow")
                    .protocol("TCP")
                    .src("namespaceSelector", sel_eq("team", self.team()));
                if self.rng.chance(50) {
                    r = r.src("selector", sel_eq("app", self.app()));
                }
                r.dst("ports", json!(["metrics"])).build()
            }
            4 => rule(self.action())
                .src("namespaceSelector", sel_eq("environment", ns.env))
                .build(),
            5 => rule("Allow")
                .protocol("TCP")
                .src("selector", "role == 'backup'")
                .dst("ports", json!(["5432:5433"]))
                .build(),
            6 => {
                let sa = if self.rng.chance(50) {
                    json!({"selector": "role == 'backend'"})
                } else {
                    json!({"names": [*self.rng.pick(&ns.sas)]})
                };
                let (proto, ports) = self.ports_of(target);
                rule("Allow")
                    .protocol(proto)
                    .src("serviceAccounts", sa)
                    .dst("ports", ports)
                    .build()
            }
            7 => {
                let ports = if self.rng.chance(50) {
                    json!(["dns"])
                } else {
                    json!([53])
                };
                rule("Allow").protocol("UDP").dst("ports", ports).build()
            }
            8 => rule("Allow")
                .protocol("ICMP")
                .set("icmp", json!({"type": 8}))
                .build(),
            9 => {
                let nets: Vec<String> = (0..1 + self.rng.below(3))
                    .map(|_| public_v4(&mut self.rng, 24))
                    .collect();
                rule("Deny").src("nets", json!(nets)).build()
            }
            10 => rule("Allow")
                .protocol("TCP")
                .src("selector", sel_eq("tier", "frontend"))
                .dst("notPorts", json!([22]))
                .build(),
            _ => {
                let action = self.action();
                rule(action).protocol("TCP").build()
            }
        }
    }

    fn egress_rule(&mut self, ns: &Namespace, peer: App) -> Value {
        match self.rng.below(7) {
            0 => rule("Allow")
                .protocol("TCP")
                .dst("namespaceSelector", "team == 'data'")
                .dst("selector", "app == 'postgres'")
                .dst("ports", json!([5432]))
                .build(),
            1 => rule("Allow")
                .protocol("UDP")
                .dst("nets", json!(["10.96.0.10/32"]))
                .dst("ports", json!([53]))
                .build(),
            2 => {
                let nets: Vec<String> = (0..2).map(|_| public_v4(&mut self.rng, 24)).collect();
                rule("Allow")
                    .protocol("TCP")
                    .dst("nets", json!(nets))
                    .dst("ports", json!([443]))
                    .build()
            }
            3 => rule("Deny")
                .dst("namespaceSelector", "global()")
                .dst("selector", "feed == 'threats'")
                .build(),
            4 => {
                let (proto, ports) = self.ports_of(peer);
                rule("Allow")
                    .protocol(proto)
                    .dst("selector", sel_eq("app", peer.name))
                    .dst("ports", ports)
                    .build()
            }
            5 => rule("Allow")
                .dst("namespaceSelector", sel_eq("environment", ns.env))
                .build(),
            _ => rule(self.action()).build(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use calc_graph::manifest::{Outcome, decode_and_validate, parse_manifest};

    use super::*;

    fn small(seed: u64) -> GenClusterArgs {
        GenClusterArgs {
            shape: Shape::Calico,
            nodes: 3,
            endpoints_per_node: 5,
            policies: 20,
            namespaces: 4,
            seed,
            out: PathBuf::new(),
        }
    }

    fn kinds(objects: &[Value]) -> GenStats {
        let mut stats = GenStats::default();
        for o in objects {
            stats.record(o);
        }
        stats
    }

    fn assert_all_valid(objects: &[Value]) {
        for o in objects {
            match decode_and_validate(o.clone()) {
                Outcome::Valid(..) => {}
                other => panic!("{other:?}\nobject: {o}"),
            }
        }
    }

    #[test]
    fn gen_cluster_antrea_shape_counts_and_policies() {
        let args = GenClusterArgs {
            shape: Shape::Antrea,
            nodes: 7,
            ..small(3)
        };
        let objects = generate(&args);
        assert_all_valid(&objects);
        let s = kinds(&objects);
        assert_eq!(s.count("Namespace"), 4);
        assert_eq!(s.count("NetworkPolicy"), 12);
        assert_eq!(s.count("WorkloadEndpoint"), 16);
        assert_eq!(s.count("Tier"), 1);
        assert_eq!(s.objects, 33, "nothing else: {s}");
        let ips: BTreeSet<_> = objects
            .iter()
            .filter(|o| o["kind"] == "WorkloadEndpoint")
            .map(|o| o["spec"]["ipNetworks"][0].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ips.len(), 16, "addresses are unique");
        assert!(objects.iter().all(|o| {
            o["kind"] != "WorkloadEndpoint"
                || o["spec"]["node"].as_str().unwrap()["node-".len()..]
                    .parse::<usize>()
                    .unwrap()
                    < 7
        }));
        // As Calico converts them: knp.default.<name>, the namespace's pods for `{}`, and the
        // np-1 peer a pod selector within the namespace.
        let keys: BTreeSet<String> = objects
            .iter()
            .filter_map(|o| match decode_and_validate(o.clone()) {
                Outcome::Valid(key, _) => Some(key.to_string()),
                _ => None,
            })
            .filter(|k| k.contains("knp.default."))
            .collect();
        assert_eq!(keys.len(), 12, "{keys:?}");
        let np1 = objects
            .iter()
            .find(|o| o["kind"] == "NetworkPolicy" && o["metadata"]["name"] == "np-1")
            .unwrap();
        assert_eq!(
            np1["spec"]["podSelector"]["matchLabels"]["app-1"],
            "scale-1"
        );
        assert_eq!(np1["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
        let again = generate(&args);
        assert_eq!(objects, again, "deterministic");
    }

    #[test]
    fn gen_cluster_small_is_valid_and_counts_match() {
        let args = small(7);
        let objects = generate(&args);
        assert_all_valid(&objects);
        let s = kinds(&objects);
        assert_eq!(s.count("Node"), 3);
        assert_eq!(s.count("WorkloadEndpoint"), 15);
        assert_eq!(
            s.count("NetworkPolicy") + s.count("GlobalNetworkPolicy"),
            20
        );
        assert_eq!(s.count("GlobalNetworkPolicy"), 2 + 4);
        assert_eq!(s.count("Profile"), 4 * 4);
        assert_eq!(s.count("Tier"), 3);
        assert_eq!(s.count("IPPool"), 2);
        assert_eq!(s.count("ClusterInformation"), 1);
        assert_eq!(s.count("FelixConfiguration"), 1);
        assert_eq!(s.count("GlobalNetworkSet"), 4);
        assert_eq!(s.count("NetworkSet"), 1);
        assert_eq!(s.count("HostEndpoint"), 1);
        assert_eq!(s.objects, objects.len());
        let per_node = |n: &str| {
            objects
                .iter()
                .filter(|o| o["kind"] == "WorkloadEndpoint" && o["spec"]["node"] == n)
                .count()
        };
        assert!((0..3).all(|i| per_node(&format!("node-{i}")) == 5));
    }

    #[test]
    fn gen_cluster_is_deterministic_per_seed() {
        assert_eq!(generate(&small(7)), generate(&small(7)));
        assert_ne!(generate(&small(7)), generate(&small(8)));
        // Independent streams: more policies leave the workloads untouched.
        let wl = |a: &GenClusterArgs| -> Vec<Value> {
            generate(a)
                .into_iter()
                .filter(|o| o["kind"] == "WorkloadEndpoint")
                .collect()
        };
        let more = GenClusterArgs {
            policies: 50,
            ..small(7)
        };
        assert_eq!(wl(&small(7)), wl(&more));
    }

    #[test]
    fn gen_cluster_medium_is_valid_unique_and_mixed() {
        let args = GenClusterArgs {
            shape: Shape::Calico,
            nodes: 40,
            endpoints_per_node: 50,
            policies: 400,
            namespaces: 30,
            seed: 3,
            out: PathBuf::new(),
        };
        let objects = generate(&args);
        assert_all_valid(&objects);
        let s = kinds(&objects);
        assert_eq!(s.count("WorkloadEndpoint"), 2000);
        assert_eq!(s.count("NetworkPolicy"), 280);
        assert_eq!(s.count("GlobalNetworkPolicy"), 120);
        assert_eq!(s.count("NetworkSet"), 3);
        assert_eq!(s.count("HostEndpoint"), 2);
        let mut keys = BTreeSet::new();
        let (mut ifaces, mut ips) = (BTreeSet::new(), BTreeSet::new());
        for o in &objects {
            let key = (
                o["kind"].to_string(),
                o["metadata"]["namespace"].to_string(),
                o["metadata"]["name"].to_string(),
            );
            assert!(keys.insert(key), "duplicate object {o}");
            if o["kind"] == "WorkloadEndpoint" {
                let iface = o["spec"]["interfaceName"].as_str().unwrap().to_string();
                assert_eq!(iface.len(), 15);
                assert!(ifaces.insert(iface), "duplicate interface {o}");
                for ip in o["spec"]["ipNetworks"].as_array().unwrap() {
                    assert!(ips.insert(ip.to_string()), "duplicate IP {ip}");
                }
            }
        }
        // The mix the benchmarks rely on is present.
        let text = serde_json::to_string(&objects).unwrap();
        for needle in [
            r#""ports":["metrics"]"#,
            r#""ports":["8000:8100"]"#,
            r#""namespaceSelector":"team == "#,
            r#""namespaceSelector":"global()""#,
            r#""action":"Pass""#,
            r#""action":"Log""#,
            r#""action":"Deny""#,
            r#""protocol":"ICMP""#,
            r#""protocol":"UDP""#,
            r#""selector":"has(host-endpoint)""#,
            r#""tier":"security""#,
            r#""tier":"platform""#,
            "/128",
        ] {
            assert!(text.contains(needle), "no {needle}");
        }
        let policies: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"].as_str().unwrap().ends_with("NetworkPolicy"))
            .collect();
        let unordered = policies
            .iter()
            .filter(|p| p["spec"].get("order").is_none())
            .count();
        assert!(unordered > 0 && unordered < policies.len() / 4);
    }

    /// Namespaced policies pick their apps from their namespace, so nearly all of them select
    /// some endpoint: a benchmark of mostly inactive policies would measure little.
    #[test]
    fn gen_cluster_namespaced_policies_select_endpoints() {
        let args = GenClusterArgs {
            shape: Shape::Calico,
            nodes: 20,
            endpoints_per_node: 50,
            policies: 300,
            namespaces: 20,
            seed: 5,
            out: PathBuf::new(),
        };
        let objects = generate(&args);
        let labels_of = |o: &Value| -> BTreeMap<String, String> {
            o["metadata"]["labels"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                        .collect()
                })
                .unwrap_or_default()
        };
        let endpoints: Vec<(String, BTreeMap<String, String>)> = objects
            .iter()
            .filter(|o| o["kind"] == "WorkloadEndpoint")
            .map(|o| {
                (
                    o["metadata"]["namespace"].as_str().unwrap().into(),
                    labels_of(o),
                )
            })
            .collect();
        let (mut total, mut active) = (0, 0);
        for p in objects.iter().filter(|o| o["kind"] == "NetworkPolicy") {
            let ns = p["metadata"]["namespace"].as_str().unwrap();
            let sel = p["spec"]["selector"].as_str().unwrap_or("all()");
            let sel = calc_graph::selector::parse(sel).unwrap();
            total += 1;
            if endpoints.iter().any(|(n, l)| n == ns && sel.evaluate(l)) {
                active += 1;
            }
        }
        assert!(
            active * 100 >= total * 90,
            "{active} of {total} select endpoints"
        );
    }

    #[test]
    fn gen_cluster_interface_names_are_a_bijection() {
        let mut seen = BTreeSet::new();
        for x in 0..200_000u64 {
            assert!(seen.insert(permute44(x.wrapping_add(u64::MAX - 1000))));
        }
    }

    #[test]
    fn gen_cluster_rejects_impossible_sizes() {
        let zero_ns = GenClusterArgs {
            namespaces: 0,
            ..small(1)
        };
        assert!(check(&zero_ns).is_err());
        let too_many = GenClusterArgs {
            nodes: 1 << 20,
            endpoints_per_node: 9,
            ..small(1)
        };
        assert!(check(&too_many).is_err());
        let empty = GenClusterArgs {
            nodes: 0,
            endpoints_per_node: 0,
            policies: 0,
            ..small(1)
        };
        assert_all_valid(&generate(&empty));
    }

    #[test]
    fn gen_cluster_run_writes_loadable_files() {
        let dir = tempfile::tempdir().unwrap();
        let args = GenClusterArgs {
            out: dir.path().join("cluster"),
            ..small(11)
        };
        let stats = run(&args).unwrap();
        assert_eq!(stats.files, FILES.len());
        assert_eq!(stats, {
            let mut s = kinds(&generate(&args));
            s.files = FILES.len();
            s
        });
        let mut loaded = 0;
        for f in cluster_files(&args.out).unwrap() {
            let text = std::fs::read_to_string(&f).unwrap();
            for entry in parse_manifest(&text).unwrap() {
                assert!(
                    matches!(entry.outcome, Outcome::Valid(..)),
                    "{}: {entry:?}",
                    f.display()
                );
                loaded += 1;
            }
        }
        assert_eq!(loaded, stats.objects);
    }

    #[test]
    fn a_section_over_the_per_file_limit_goes_on_in_continuation_files() {
        let dir = tempfile::tempdir().unwrap();
        let big = GenClusterArgs {
            nodes: 2,
            endpoints_per_node: MAX_PER_FILE / 2 + 50,
            out: dir.path().to_path_buf(),
            ..small(3)
        };
        let stats = run(&big).unwrap();
        assert_eq!(stats.files, FILES.len() + 1);
        let count = |name: &str| {
            let text = std::fs::read_to_string(dir.path().join(name)).unwrap();
            parse_manifest(&text).unwrap().len()
        };
        assert_eq!(count("workloads.json"), MAX_PER_FILE);
        assert_eq!(count("workloads-2.json"), 100);

        // A smaller cluster in the same directory leaves no stale continuation behind.
        let stats = run(&GenClusterArgs {
            out: dir.path().to_path_buf(),
            ..small(3)
        })
        .unwrap();
        assert_eq!(stats.files, FILES.len());
        assert!(!dir.path().join("workloads-2.json").exists());
        assert_eq!(cluster_files(dir.path()).unwrap().len(), FILES.len());
    }

    /// `cargo test --release -p calc-server gen_cluster_default_size -- --ignored --nocapture`
    /// (set `GEN_CLUSTER_OUT` to keep the output there, e.g. to run `calc-server validate`).
    #[test]
    #[ignore = "benchmark-sized; run by hand"]
    fn gen_cluster_default_size() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = std::env::var_os("GEN_CLUSTER_OUT")
            .map_or_else(|| tmp.path().to_path_buf(), PathBuf::from);
        for (nodes, epn) in [(100, 100), (1000, 100)] {
            let args = GenClusterArgs {
                shape: Shape::Calico,
                nodes,
                endpoints_per_node: epn,
                policies: 1000,
                namespaces: 100,
                seed: 1,
                out: dir.join(format!("c{nodes}")),
            };
            let start = std::time::Instant::now();
            let stats = run(&args).unwrap();
            let bytes: u64 = cluster_files(&args.out)
                .unwrap()
                .iter()
                .map(|f| std::fs::metadata(f).unwrap().len())
                .sum();
            eprintln!(
                "{nodes}x{epn}: {stats} in {:?}, {bytes} bytes",
                start.elapsed()
            );
        }
    }
}
