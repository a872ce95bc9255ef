//! `calc-bench recommend`: the policy recommendation (issue 45, `calc_server::recommend`) for
//! one namespace, pure, on one thread.
//!
//! The input, deterministic from `--seed`: `--pods` pods in namespace `bench`, in groups of
//! `--pods-per-group` (a Deployment each: label `app: app-N`, `generateName`
//! `app-N-<hash>-`, a named port `http` 8080/TCP); half as many pods again in
//! `--peer-namespaces` other namespaces (their own apps); kube-dns in kube-system; 20
//! network sets. `--flows` Goldmane records (one key in one 15 s interval each) over the last
//! hour, each of one of the namespace's conversations, fixed at random: the namespace's side
//! is the source (egress, reported by the source) or the destination (ingress, reported by the
//! destination); the peer is a pod of the namespace 60 %, of another namespace 20 %, a network
//! set 8 %, DNS 7 %, a public address 3 % (left out), a host endpoint 2 % (left out); 5 % of
//! records were denied (left out); TCP on one of 5 ports (8080 named), or UDP 53 to DNS.
//!
//! Measures `recommend()` over the whole input, `--rounds` times after one warm-up: the median
//! and the best, printed as `recommend: <pods> pods, <flows> flows: <median> ms`. It
//! measures; it does not judge (target: ≤ 1 s for 1,000 pods and 100,000 flows).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use calc_server::recommend::{Inventory, NamedPort, NetworkSet, Options, Pod, recommend};
use common::Rng;
use felix_proto::goldmane::{Action, EndpointType, Flow, FlowKey, Reporter};

#[derive(Clone, Debug, clap::Args)]
pub struct RecommendBenchArgs {
    /// Pods in the namespace recommended for.
    #[arg(long, env = "RECOMMEND_BENCH_PODS", default_value_t = 1000)]
    pub pods: usize,
    /// Pods per workload group (Deployment).
    #[arg(long, env = "RECOMMEND_BENCH_PODS_PER_GROUP", default_value_t = 10)]
    pub pods_per_group: usize,
    /// Other namespaces holding peers.
    #[arg(long, env = "RECOMMEND_BENCH_PEER_NAMESPACES", default_value_t = 10)]
    pub peer_namespaces: usize,
    /// Flow records (one key in one 15 s interval each).
    #[arg(long, env = "RECOMMEND_BENCH_FLOWS", default_value_t = 100_000)]
    pub flows: usize,
    /// Distinct conversations the records are drawn from.
    #[arg(long, env = "RECOMMEND_BENCH_CONVERSATIONS", default_value_t = 20_000)]
    pub conversations: usize,
    /// Timed rounds after one warm-up.
    #[arg(long, env = "RECOMMEND_BENCH_ROUNDS", default_value_t = 5)]
    pub rounds: usize,
    #[arg(long, env = "RECOMMEND_BENCH_SEED", default_value_t = 45)]
    pub seed: u64,
}

/// One side of a generated conversation.
#[derive(Clone)]
struct Side {
    ns: String,
    name: String,
    kind: EndpointType,
    labels: Vec<String>,
}

const NS: &str = "bench";

fn group_pods(ns: &str, group: usize, n: usize, inv: &mut Inventory) -> Side {
    let app = format!("app-{group}");
    let hash = format!(
        "{:x}",
        0x5c8f_7b9d_u64.wrapping_mul(group as u64 + 1) & 0xff_ffff
    );
    let generate = format!("{app}-{hash}-");
    for i in 0..n {
        let mut labels = BTreeMap::new();
        labels.insert("app".to_string(), app.clone());
        labels.insert("pod-template-hash".to_string(), hash.clone());
        labels.insert("team".to_string(), format!("team-{}", group % 7));
        inv.pods.push(Pod {
            namespace: ns.into(),
            name: format!("{generate}{i:05}"),
            generate_name: generate.clone(),
            labels,
            ports: vec![NamedPort {
                name: "http".into(),
                protocol: "tcp".into(),
                port: 8080,
            }],
        });
    }
    Side {
        ns: ns.into(),
        name: format!("{generate}*"),
        kind: EndpointType::WorkloadEndpoint,
        labels: vec![
            format!("app={app}"),
            format!("pod-template-hash={hash}"),
            format!("team=team-{}", group % 7),
        ],
    }
}

/// The inventory and the flows.
pub fn generate(args: &RecommendBenchArgs) -> (Inventory, Vec<Flow>) {
    let mut rng = Rng::new(args.seed);
    let mut inv = Inventory::default();
    let per = args.pods_per_group.max(1);
    let groups = args.pods.div_ceil(per);
    let own: Vec<Side> = (0..groups)
        .map(|g| group_pods(NS, g, per.min(args.pods - g * per), &mut inv))
        .collect();
    let peer_groups = (groups / 2).max(1);
    let peers: Vec<Side> = (0..peer_groups)
        .map(|g| {
            let ns = format!("peer-{}", g % args.peer_namespaces.max(1));
            group_pods(&ns, 10_000 + g, per, &mut inv)
        })
        .collect();
    let mut dns_labels = BTreeMap::new();
    dns_labels.insert("k8s-app".to_string(), "kube-dns".to_string());
    inv.pods.push(Pod {
        namespace: "kube-system".into(),
        name: "coredns-6f8b9c7d5-abcde".into(),
        generate_name: "coredns-6f8b9c7d5-".into(),
        labels: dns_labels,
        ports: vec![NamedPort {
            name: "dns".into(),
            protocol: "udp".into(),
            port: 53,
        }],
    });
    let dns = Side {
        ns: "kube-system".into(),
        name: "coredns-6f8b9c7d5-*".into(),
        kind: EndpointType::WorkloadEndpoint,
        labels: vec!["k8s-app=kube-dns".into()],
    };
    let sets: Vec<Side> = (0..20)
        .map(|i| {
            let mut labels = BTreeMap::new();
            labels.insert("external".to_string(), format!("service-{i}"));
            inv.network_sets.push(NetworkSet {
                namespace: Some(NS.into()),
                name: format!("external-{i}"),
                labels,
                nets: vec![format!("203.0.113.{i}/32")],
            });
            Side {
                ns: NS.into(),
                name: format!("external-{i}"),
                kind: EndpointType::NetworkSet,
                labels: vec![format!("external=service-{i}")],
            }
        })
        .collect();
    let public = Side {
        ns: "-".into(),
        name: "pub".into(),
        kind: EndpointType::Network,
        labels: vec![],
    };
    let host = Side {
        ns: "-".into(),
        name: "node-1".into(),
        kind: EndpointType::HostEndpoint,
        labels: vec![],
    };
    // Conversations: (own side, peer, egress?, proto, port, action).
    let ports = [8080_i64, 443, 9090, 5432, 6379];
    let conversations: Vec<(Side, Side, bool, &str, i64, Action)> = (0..args.conversations.max(1))
        .map(|_| {
            let me = own[rng.below(own.len())].clone();
            let roll = rng.below(100);
            let (peer, proto, port) = match roll {
                0..60 => (
                    own[rng.below(own.len())].clone(),
                    "tcp",
                    ports[rng.below(5)],
                ),
                60..80 => (
                    peers[rng.below(peers.len())].clone(),
                    "tcp",
                    ports[rng.below(5)],
                ),
                80..88 => (sets[rng.below(sets.len())].clone(), "tcp", 443),
                88..95 => (dns.clone(), "udp", 53),
                95..98 => (public.clone(), "tcp", 443),
                _ => (host.clone(), "tcp", 8080),
            };
            // DNS and network sets are egress; the rest either way.
            let egress =
                matches!(peer.kind, EndpointType::NetworkSet) || port == 53 || rng.below(2) == 0;
            let action = if rng.below(100) < 5 {
                Action::Deny
            } else {
                Action::Allow
            };
            (me, peer, egress, proto, port, action)
        })
        .collect();
    // A bucket start (a multiple of 15 s).
    let now = 1_800_000_000_i64;
    let flows = (0..args.flows)
        .map(|i| {
            let (me, peer, egress, proto, port, action) = &conversations[i % conversations.len()];
            let (src, dst) = if *egress { (me, peer) } else { (peer, me) };
            let interval = (i / conversations.len()) as i64 % 240;
            Flow {
                key: Some(FlowKey {
                    source_name: src.name.clone(),
                    source_namespace: src.ns.clone(),
                    source_type: src.kind as i32,
                    dest_name: dst.name.clone(),
                    dest_namespace: dst.ns.clone(),
                    dest_type: dst.kind as i32,
                    dest_port: *port,
                    proto: (*proto).into(),
                    reporter: if *egress {
                        Reporter::Src
                    } else {
                        Reporter::Dst
                    } as i32,
                    action: *action as i32,
                    ..Default::default()
                }),
                start_time: now - 15 * interval,
                end_time: now - 15 * interval + 15,
                source_labels: src.labels.clone(),
                dest_labels: dst.labels.clone(),
                packets_in: 10,
                packets_out: 12,
                bytes_in: 1000,
                bytes_out: 1200,
                num_connections_started: 1,
                ..Default::default()
            }
        })
        .collect();
    (inv, flows)
}

pub fn run(args: &RecommendBenchArgs) -> anyhow::Result<ExitCode> {
    let (inv, flows) = generate(args);
    let opts = Options {
        namespace: NS.into(),
        window: "1h".into(),
        ..Default::default()
    };
    let warm = recommend(&flows, &inv, &opts)?;
    let rules: usize = warm.policies.iter().map(|p| p.rules.len()).sum();
    eprintln!(
        "recommend: {} policies, {rules} rules, {} flows left out",
        warm.policies.len(),
        warm.left_out.len()
    );
    let mut times: Vec<Duration> = (0..args.rounds.max(1))
        .map(|_| {
            let t = Instant::now();
            black_box(recommend(black_box(&flows), &inv, &opts).ok());
            t.elapsed()
        })
        .collect();
    times.sort();
    let median = times[times.len() / 2];
    eprintln!("recommend: best {:.1} ms", times[0].as_secs_f64() * 1000.0);
    println!(
        "recommend: {} pods, {} flows: {:.0} ms",
        args.pods,
        flows.len(),
        median.as_secs_f64() * 1000.0
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generated_namespace_gets_a_policy_per_group_and_left_out_flows() {
        let args = RecommendBenchArgs {
            pods: 40,
            pods_per_group: 10,
            peer_namespaces: 2,
            flows: 2_000,
            conversations: 500,
            rounds: 1,
            seed: 45,
        };
        let (inv, flows) = generate(&args);
        assert_eq!(inv.pods.iter().filter(|p| p.namespace == NS).count(), 40);
        assert_eq!(flows.len(), 2_000);
        let opts = Options {
            namespace: NS.into(),
            ..Default::default()
        };
        let r = recommend(&flows, &inv, &opts).unwrap();
        assert_eq!(r.policies.len(), 4, "one per app");
        assert!(r.left_out.len() > 10, "public, host and denied flows");
        // Deterministic: generated again, the same answer.
        let (inv2, flows2) = generate(&args);
        assert_eq!(recommend(&flows2, &inv2, &opts).unwrap(), r);
    }
}
