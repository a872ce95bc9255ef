//! `calc-bench flows`: calc-server's flow-log ingest (issue 42), measured on one core.
//!
//! The graph: a `gen-cluster` cluster (tiers, namespaced and global policies, profiles, network
//! sets) built in memory, plus a staged copy (`StagedNetworkPolicy`, `StagedGlobalNetworkPolicy`)
//! of every `--staged-every`-th policy, so the ingest computes pending traces as it does when a
//! cluster has staged policies. The records: `FlowReport`s as agents send them, one reporting
//! node each, `--report-size` records, each reported by one of that node's workload endpoints
//! in one of its `--peers` conversations, each fixed at random: the peer (another workload
//! endpoint 85 %, else a private or a public address), the side reporting (the destination
//! 70 %), the port and protocol (TCP 90 %, UDP), and the trace: 1–3 hits read from the
//! reporting endpoint's own tiers (a pass in an earlier tier, then an allow, a deny or the last
//! tier's end), or its profile's allow when no policy selects it. Source ports are random and
//! records are spread over the last four 15 s intervals.
//!
//! Measures, on one thread:
//! - **ingest**: each report through `serve::engine::flows::parse` then `FlowIngest::add`
//!   (naming both sides, the enforced trace, de-duplication, the store), the same reports into
//!   a fresh `FlowIngest` each round; the median and best round. Twice: on the cluster without
//!   its staged copies (`--records`, no pending trace: `add` runs explain only when a staged
//!   policy exists), and with them (`--staged-records`: every record also gets its pending
//!   trace from `calc_graph::explain`, which is far slower, hence fewer records). The work runs
//!   in [`ingest_all`] (never inlined), whose instructions `make bench-flows` counts under
//!   callgrind (`--toggle-collect`).
//! - **memory** (on the cluster without staged copies, so keys carry no pending trace): the
//!   resident set grown by a `FlowIngest` filled with `--memory-keys` distinct keys (one record
//!   each, one interval: the store plus what de-duplication remembers); then the same keys, as
//!   the store lists them, inserted into a bare `FlowStore` (bytes per key), and once more one
//!   bucket later (bytes per further bucket a key is held in).
//!
//! It measures; it does not judge (docs/benchmarks.md records the figures).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use calc_graph::convert::EndpointKind;
use calc_graph::graph::{CalcGraph, Update};
use calc_graph::manifest::{Outcome, decode_and_validate};
use calc_graph::model::Kind;
use calc_server::flows::{BUCKET_SECONDS, FlowListRequest, FlowStore};
use calc_server::serve::engine::flows::{FlowIngest, parse};
use common::Rng;
use felix_proto as pb;
use pb::rule_ref::Kind as RefKind;
use pb::to_dataplane::Payload;
use serde_json::Value;

use crate::gen_cluster::{self, GenClusterArgs};

/// Calico Goldmane's own benchmark: about 13 µs per flow received (≈ 75k flows/s).
pub const GOLDMANE_US_PER_FLOW: f64 = 13.0;

#[derive(Clone, Debug, clap::Args)]
pub struct FlowsBenchArgs {
    /// Nodes of the synthetic cluster.
    #[arg(long, env = "FLOWS_BENCH_NODES", default_value_t = 10)]
    pub nodes: usize,
    /// Workload endpoints per node.
    #[arg(long, env = "FLOWS_BENCH_ENDPOINTS_PER_NODE", default_value_t = 150)]
    pub endpoints_per_node: usize,
    /// Policies (NetworkPolicy and GlobalNetworkPolicy, in three tiers).
    #[arg(long, env = "FLOWS_BENCH_POLICIES", default_value_t = 300)]
    pub policies: usize,
    /// Namespaces.
    #[arg(long, env = "FLOWS_BENCH_NAMESPACES", default_value_t = 20)]
    pub namespaces: usize,
    /// Every n-th policy also gets a staged copy (0: none).
    #[arg(long, env = "FLOWS_BENCH_STAGED_EVERY", default_value_t = 10)]
    pub staged_every: usize,
    /// Records timed per round on the cluster without its staged policies (0: none).
    #[arg(long, env = "FLOWS_BENCH_RECORDS", default_value_t = 100_000)]
    pub records: usize,
    /// Records timed per round on the cluster with its staged policies, where every record
    /// also gets a pending trace (0: none).
    #[arg(long, env = "FLOWS_BENCH_STAGED_RECORDS", default_value_t = 1_000)]
    pub staged_records: usize,
    /// Conversations per endpoint: each reporting endpoint talks to this many peers (address,
    /// port, protocol, direction and trace fixed per peer), so records of one conversation
    /// share a key; 0: every record to a random peer, a new key each.
    #[arg(long, env = "FLOWS_BENCH_PEERS", default_value_t = 16)]
    pub peers: usize,
    /// Records per FlowReport.
    #[arg(long, env = "FLOWS_BENCH_REPORT_SIZE", default_value_t = 500)]
    pub report_size: usize,
    /// Timed rounds (the median and the best are printed).
    #[arg(long, env = "FLOWS_BENCH_ROUNDS", default_value_t = 5)]
    pub rounds: usize,
    /// Distinct flow keys for the memory measure (0: none).
    #[arg(long, env = "FLOWS_BENCH_MEMORY_KEYS", default_value_t = 100_000)]
    pub memory_keys: usize,
    /// The server's default `--flow-max-keys`, to scale the memory figure to.
    #[arg(long, env = "FLOWS_BENCH_MAX_KEYS", default_value_t = 100_000)]
    pub max_keys: usize,
    /// Seed of the cluster and of the records.
    #[arg(long, env = "FLOWS_BENCH_SEED", default_value_t = 1)]
    pub seed: u64,
}

/// The reporting node's view of one of its workload endpoints.
pub(crate) struct Endpoint {
    node: usize,
    ip: String,
    /// Enforced (not staged) policies per tier, in order, for ingress and egress.
    ingress: Vec<(String, Vec<pb::PolicyId>)>,
    egress: Vec<(String, Vec<pb::PolicyId>)>,
    profile: Option<String>,
}

/// The cluster's objects; with `staged_every`, staged copies of every n-th policy.
fn objects(args: &FlowsBenchArgs) -> Vec<Value> {
    let gen_args = GenClusterArgs {
        shape: gen_cluster::Shape::Calico,
        nodes: args.nodes,
        endpoints_per_node: args.endpoints_per_node,
        policies: args.policies,
        namespaces: args.namespaces,
        seed: args.seed,
        out: std::path::PathBuf::new(),
    };
    let mut objects = gen_cluster::generate(&gen_args);
    if args.staged_every > 0 {
        let mut staged = Vec::new();
        let mut n = 0usize;
        for o in &objects {
            let kind = o["kind"].as_str().unwrap_or_default();
            let staged_kind = match kind {
                "NetworkPolicy" => "StagedNetworkPolicy",
                "GlobalNetworkPolicy" => "StagedGlobalNetworkPolicy",
                _ => continue,
            };
            n += 1;
            if n.is_multiple_of(args.staged_every) {
                let mut copy = o.clone();
                copy["kind"] = staged_kind.into();
                staged.push(copy);
            }
        }
        objects.extend(staged);
    }
    objects
}

pub(crate) fn build_graph(objects: &[Value]) -> anyhow::Result<(CalcGraph, usize)> {
    let mut g = CalcGraph::new();
    let mut staged = 0;
    for o in objects {
        match decode_and_validate(o.clone()) {
            Outcome::Valid(key, res) => {
                staged += usize::from(key.kind.is_staged());
                g.apply(Update::ApplyValid(res))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            Outcome::Ignored(..) => {}
            _ => anyhow::bail!("invalid object: {}", o["metadata"]["name"]),
        }
    }
    g.apply(Update::InSync)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((g, staged))
}

/// Every workload endpoint with an IPv4 address, with its tiers as its node was sent them.
pub(crate) fn endpoints(g: &CalcGraph) -> (Vec<String>, Vec<Endpoint>) {
    let mut nodes: Vec<String> = Vec::new();
    let mut out = Vec::new();
    let enforced = |ids: Vec<pb::PolicyId>| -> Vec<pb::PolicyId> {
        ids.into_iter()
            .filter(|id| !Kind::from_name(&id.kind).is_some_and(Kind::is_staged))
            .collect()
    };
    for e in g.view().endpoints() {
        if !matches!(e.model().kind, EndpointKind::Workload { .. }) {
            continue;
        }
        let Some(ip) = e
            .nets()
            .iter()
            .map(|n| n.split_once('/').map_or(&**n, |(a, _)| a))
            .find(|a| !a.contains(':'))
        else {
            continue;
        };
        let Some(Payload::WorkloadEndpointUpdate(u)) = e.update() else {
            continue;
        };
        let Some(w) = u.endpoint else { continue };
        let node = match nodes.iter().position(|n| n == e.node()) {
            Some(i) => i,
            None => {
                nodes.push(e.node().to_string());
                nodes.len() - 1
            }
        };
        let mut ingress = Vec::new();
        let mut egress = Vec::new();
        for t in w.tiers {
            let i = enforced(t.ingress_policies);
            let o = enforced(t.egress_policies);
            if !i.is_empty() {
                ingress.push((t.name.clone(), i));
            }
            if !o.is_empty() {
                egress.push((t.name, o));
            }
        }
        out.push(Endpoint {
            node,
            ip: ip.to_string(),
            ingress,
            egress,
            profile: w.profile_ids.first().cloned(),
        });
    }
    (nodes, out)
}

fn hit(rule: pb::RuleRef, action: &str) -> pb::FlowRuleHit {
    pb::FlowRuleHit {
        rule: Some(rule),
        action: action.to_string(),
    }
}

fn policy_rule(id: &pb::PolicyId, egress: bool, index: u32) -> pb::RuleRef {
    pb::RuleRef {
        kind: RefKind::PolicyRule as i32,
        policy: Some(id.clone()),
        egress,
        index,
        ..Default::default()
    }
}

/// A trace of 1–3 hits through `tiers` (or the profile), and whether it allowed.
fn trace(
    rng: &mut Rng,
    tiers: &[(String, Vec<pb::PolicyId>)],
    profile: Option<&str>,
    egress: bool,
) -> (Vec<pb::FlowRuleHit>, bool) {
    let Some(((last_tier, last), earlier)) = tiers.split_last() else {
        let rule = match profile {
            Some(p) => pb::RuleRef {
                kind: RefKind::ProfileRule as i32,
                profile: Some(pb::ProfileId { name: p.into() }),
                egress,
                ..Default::default()
            },
            None => pb::RuleRef {
                kind: RefKind::NoProfileMatched as i32,
                egress,
                ..Default::default()
            },
        };
        let allowed = profile.is_some();
        return (
            vec![hit(rule, if allowed { "allow" } else { "deny" })],
            allowed,
        );
    };
    let mut hits = Vec::new();
    // Passes in up to two earlier tiers.
    for (_, policies) in earlier.iter().rev().take(2).rev() {
        if rng.below(2) == 0 {
            let p = &policies[rng.below(policies.len())];
            hits.push(hit(policy_rule(p, egress, rng.below(2) as u32), "pass"));
        }
    }
    let p = &last[rng.below(last.len())];
    let roll = rng.below(100);
    let allowed = roll < 85;
    if allowed {
        hits.push(hit(policy_rule(p, egress, rng.below(4) as u32), "allow"));
    } else if roll < 92 {
        hits.push(hit(policy_rule(p, egress, rng.below(4) as u32), "deny"));
    } else {
        let end = pb::RuleRef {
            kind: RefKind::EndOfTier as i32,
            tier: last_tier.clone(),
            egress,
            ..Default::default()
        };
        hits.push(hit(end, "deny"));
    }
    (hits, allowed)
}

/// Reports of `size` records (the last one shorter), each from one node, round robin; each
/// endpoint talks to `peers` others (0: to anyone, every record a new conversation).
pub(crate) fn reports(
    rng: &mut Rng,
    nodes: &[String],
    eps: &[Endpoint],
    records: usize,
    size: usize,
    (newest_interval, intervals): (i64, usize),
    peers: usize,
) -> Vec<(String, pb::FlowReport)> {
    let by_node: Vec<Vec<usize>> = (0..nodes.len())
        .map(|n| (0..eps.len()).filter(|&i| eps[i].node == n).collect())
        .collect();
    const PORTS: [u32; 8] = [80, 443, 8080, 5432, 6379, 9090, 3306, 53];
    let mut out = Vec::new();
    let mut left = records;
    let mut node = 0usize;
    while left > 0 {
        let n = size.min(left);
        left -= n;
        while by_node[node % nodes.len()].is_empty() {
            node += 1;
        }
        let own = &by_node[node % nodes.len()];
        let mut report = pb::FlowReport {
            records: Vec::with_capacity(n),
            dropped: 0,
        };
        for _ in 0..n {
            let me_index = own[rng.below(own.len())];
            let me = &eps[me_index];
            // With `peers`, what varies between two records of one of an endpoint's `peers`
            // conversations is only the source port, the interval and the counters.
            let mut conv = if peers > 0 {
                Rng::new((me_index as u64) << 20 | rng.below(peers) as u64)
            } else {
                Rng::new(rng.next_u64())
            };
            let peer = match conv.below(100) {
                0..85 => eps[conv.below(eps.len())].ip.clone(),
                85..95 => format!("192.168.{}.{}", conv.below(256), 1 + conv.below(254)),
                _ => format!("198.51.100.{}", 1 + conv.below(254)),
            };
            let reporter_dest = conv.below(10) < 7;
            let (tiers, egress) = if reporter_dest {
                (&me.ingress, false)
            } else {
                (&me.egress, true)
            };
            let (trace, allowed) = trace(&mut conv, tiers, me.profile.as_deref(), egress);
            let (source_ip, dest_ip) = if reporter_dest {
                (peer, me.ip.clone())
            } else {
                (me.ip.clone(), peer)
            };
            let dest_port = PORTS[conv.below(PORTS.len())];
            let protocol = if conv.below(10) == 0 { 17 } else { 6 };
            let packets = 1 + rng.below(40) as u64;
            report.records.push(pb::FlowRecord {
                interval_start: newest_interval - BUCKET_SECONDS * rng.below(intervals) as i64,
                source_ip,
                dest_ip,
                source_port: 32_768 + rng.below(28_232) as u32,
                dest_port,
                protocol,
                reporter_dest,
                trace,
                allowed,
                packets_in: packets,
                packets_out: if allowed { packets } else { 0 },
                bytes_in: packets * (60 + rng.below(1400) as u64),
                bytes_out: if allowed { packets * 200 } else { 0 },
                connections_started: 1,
                connections_completed: u32::from(allowed),
                connections_live: 0,
                ..Default::default()
            });
        }
        out.push((nodes[node % nodes.len()].clone(), report));
        node += 1;
    }
    out
}

/// What one pass over the reports gave.
#[derive(Default)]
struct Ingested {
    records: usize,
    dropped: BTreeMap<&'static str, u64>,
}

/// Every report through `parse` and `FlowIngest::add`: the measured work (callgrind's
/// `--toggle-collect` names this function).
#[inline(never)]
fn ingest_all(
    graph: &CalcGraph,
    ingest: &mut FlowIngest,
    reports: &[(String, pb::FlowReport)],
    now: i64,
) -> anyhow::Result<Ingested> {
    let mut out = Ingested::default();
    for (node, report) in reports {
        let batch = parse(report).map_err(|e| anyhow::anyhow!("{e}"))?;
        out.records += batch.records.len();
        for (reason, n) in ingest.add(graph, node, batch.records, now) {
            *out.dropped.entry(reason).or_default() += n;
        }
    }
    Ok(out)
}

/// Only `parse`, for the split.
#[inline(never)]
fn parse_all(reports: &[(String, pb::FlowReport)]) -> usize {
    reports
        .iter()
        .map(|(_, r)| parse(r).map_or(0, |b| black_box(b).records.len()))
        .sum()
}

fn rss_bytes() -> u64 {
    // statm: size resident shared … in pages.
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn us_per(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e6 / n.max(1) as f64
}

/// Rounds of the same reports into a fresh ingest each: (median, best, keys, what was dropped).
fn time_ingest(
    graph: &CalcGraph,
    reports: &[(String, pb::FlowReport)],
    now: i64,
    rounds: usize,
) -> anyhow::Result<(Duration, Duration, usize, Ingested)> {
    let mut times = Vec::new();
    let mut last = (0, Ingested::default());
    for _ in 0..rounds.max(1) {
        let mut ingest = FlowIngest::new(10_000_000, 40_000_000);
        let t = Instant::now();
        let got = ingest_all(graph, &mut ingest, reports, now)?;
        times.push(t.elapsed());
        last = (ingest.store.num_keys(), got);
        drop(ingest);
    }
    let best = times.iter().min().copied().unwrap_or_default();
    let med = median(&mut times);
    Ok((med, best, last.0, last.1))
}

fn memory(
    args: &FlowsBenchArgs,
    graph: &CalcGraph,
    nodes: &[String],
    eps: &[Endpoint],
    interval: i64,
    now: i64,
) -> anyhow::Result<()> {
    let n = args.memory_keys;
    let mut rng = Rng::new(args.seed ^ 0x6d656d);
    let before = rss_bytes();
    let mut ingest = FlowIngest::new(n, n.saturating_mul(4));
    let mut sent = 0usize;
    while ingest.store.num_keys() < n && sent < n.saturating_mul(10) {
        let batch = reports(&mut rng, nodes, eps, 10_000, 1_000, (interval, 1), 0);
        for (node, report) in &batch {
            let records = parse(report).map_err(|e| anyhow::anyhow!("{e}"))?.records;
            sent += records.len();
            ingest.add(graph, node, records, now);
        }
    }
    let after_ingest = rss_bytes();
    let keys = ingest.store.num_keys();
    let all = ingest
        .store
        .list(&FlowListRequest::default(), now)
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let flows: Vec<_> = all.flows.into_iter().filter_map(|r| r.flow).collect();
    let labels: usize = flows
        .iter()
        .map(|f| f.source_labels.len() + f.dest_labels.len())
        .sum();
    let hits: usize = flows
        .iter()
        .filter_map(|f| f.key.as_ref()?.policies.as_ref())
        .map(|t| t.enforced_policies.len() + t.pending_policies.len())
        .sum();
    let start = rss_bytes();
    let mut store = FlowStore::new(n, 0);
    for f in &flows {
        store.insert(f, now).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let one_bucket = rss_bytes();
    let later = now + BUCKET_SECONDS;
    for f in &flows {
        let mut again = f.clone();
        again.start_time += BUCKET_SECONDS;
        again.end_time += BUCKET_SECONDS;
        store
            .insert(&again, later)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let two_buckets = rss_bytes();
    let per = |a: u64, b: u64| b.saturating_sub(a) as f64 / keys.max(1) as f64;
    let per_key = per(start, one_bucket);
    let per_bucket = per(one_bucket, two_buckets);
    println!(
        "memory: {keys} keys from {sent} records; {:.1} labels and {:.1} hits per key",
        labels as f64 / keys.max(1) as f64,
        hits as f64 / keys.max(1) as f64
    );
    println!(
        "  FlowIngest (store + de-duplication + address index): {:.0} bytes/key (RSS {:.1} → {:.1} MiB)",
        per(before, after_ingest),
        mib(before),
        mib(after_ingest)
    );
    println!(
        "  FlowStore alone, one bucket: {per_key:.0} bytes/key; each further bucket holding the key: {per_bucket:.0} bytes"
    );
    let cap = args.max_keys as f64;
    println!(
        "flows memory: {per_key:.0} bytes/key, {:.1} MiB at --flow-max-keys {} (one bucket each; {:.1} MiB if every key is in all {} buckets)",
        per_key * cap / 1048576.0,
        args.max_keys,
        (per_key + per_bucket * (store.num_buckets() as f64 - 1.0)) * cap / 1048576.0,
        store.num_buckets()
    );
    black_box((&ingest, &store));
    Ok(())
}

fn mib(b: u64) -> f64 {
    b as f64 / 1048576.0
}

/// Times `records` records (the same ones each round) on `graph` and prints the result and
/// the contract line named `what`.
fn measure(
    what: &str,
    args: &FlowsBenchArgs,
    graph: &CalcGraph,
    records: usize,
    newest: i64,
    now: i64,
) -> anyhow::Result<()> {
    let (nodes, eps) = endpoints(graph);
    let mut rng = Rng::new(args.seed);
    let reports = reports(
        &mut rng,
        &nodes,
        &eps,
        records,
        args.report_size,
        (newest, 4),
        args.peers,
    );
    let hits: usize = reports
        .iter()
        .flat_map(|(_, r)| &r.records)
        .map(|r| r.trace.len())
        .sum();
    let t = Instant::now();
    let parsed = parse_all(&reports);
    let parse_time = t.elapsed();
    let (med, best, keys, got) = time_ingest(graph, &reports, now, args.rounds)?;
    println!(
        "{what}: {records} records in {} reports of up to {} from {} nodes, {:.2} hits per trace, 4 intervals",
        reports.len(),
        args.report_size,
        nodes.len(),
        hits as f64 / records.max(1) as f64
    );
    println!(
        "  parse + add, {} rounds: median {:.2} µs/record, best {:.2} (parse alone {:.2}); {keys} keys; dropped {:?}",
        args.rounds,
        us_per(med, got.records),
        us_per(best, got.records),
        us_per(parse_time, parsed),
        got.dropped
    );
    let us = us_per(med, got.records);
    println!(
        "{what}: {us:.2} µs/record, {:.0} records/s on one core, {:.2}x Goldmane's {GOLDMANE_US_PER_FLOW} µs/flow",
        1e6 / us,
        GOLDMANE_US_PER_FLOW / us
    );
    Ok(())
}

pub fn run(args: &FlowsBenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.report_size > 0, "--report-size must be positive");
    let t = Instant::now();
    let objects = objects(args);
    let (staged_graph, staged) = build_graph(&objects)?;
    let plain: Vec<Value> = objects
        .iter()
        .filter(|o| !o["kind"].as_str().is_some_and(|k| k.starts_with("Staged")))
        .cloned()
        .collect();
    let (graph, _) = build_graph(&plain)?;
    let (nodes, eps) = endpoints(&graph);
    anyhow::ensure!(!eps.is_empty(), "the cluster has no workload endpoint");
    let policies = graph.view().policies().count();
    let tiers: usize = eps.iter().map(|e| e.ingress.len()).sum();
    println!(
        "cluster: {} nodes, {} workload endpoints, {policies} policies (+{staged} staged copies), {} namespaces; {:.1} ingress tiers per endpoint (built in {:.1} s)",
        nodes.len(),
        eps.len(),
        args.namespaces,
        tiers as f64 / eps.len() as f64,
        t.elapsed().as_secs_f64()
    );
    // A fixed clock: the newest interval closed 5 s ago.
    let newest = 1_800_000_000 - 1_800_000_000 % BUCKET_SECONDS;
    let now = newest + BUCKET_SECONDS + 5;
    if args.records > 0 {
        measure("flows ingest", args, &graph, args.records, newest, now)?;
    }
    if args.staged_records > 0 && staged > 0 {
        measure(
            "flows ingest with staged policies",
            args,
            &staged_graph,
            args.staged_records,
            newest,
            now,
        )?;
    }
    if args.memory_keys > 0 {
        memory(args, &graph, &nodes, &eps, newest, now)?;
    }
    Ok(ExitCode::SUCCESS)
}
