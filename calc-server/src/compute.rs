//! `calc-server compute`: runs the graph once over a datastore snapshot and prints what the
//! requested nodes would be sent.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use calc_graph::graph::{CalcGraph, Rejection};
use felix_proto as pb;

use crate::args::ComputeArgs;
use crate::datastore;

/// Builds the graph from a snapshot and returns each node's stream (sequence numbers from 1).
/// A requested node the datastore does not know is an error, as `serve` refuses its agent
/// (NOT_FOUND), unless `allow_unknown` (serve's `--allow-unknown-nodes`).
pub fn compute(
    updates: Vec<calc_graph::graph::Update>,
    nodes: Option<&[String]>,
    allow_unknown: bool,
    mut on_rejection: impl FnMut(Rejection),
) -> anyhow::Result<Vec<(String, Vec<pb::ToDataplane>)>> {
    let mut g = CalcGraph::new();
    for u in updates {
        if let Err(rejection) = g.apply(u) {
            on_rejection(rejection);
        }
    }
    let known = g.known_nodes();
    let nodes: Vec<String> = match nodes {
        Some(n) => n.to_vec(),
        None => known.clone(),
    };
    let unknown: Vec<&String> = nodes.iter().filter(|n| !known.contains(n)).collect();
    if !allow_unknown && !unknown.is_empty() {
        anyhow::bail!(
            "{} not in the datastore (no Node resource and no endpoints): `serve` refuses such \
             an agent with NOT_FOUND unless it runs with --allow-unknown-nodes (give that flag \
             here to see what the agent would then receive); the datastore's nodes: {}",
            unknown
                .iter()
                .map(|n| format!("node {:?}", calc_graph::untrusted::Untrusted(n.as_str())))
                .collect::<Vec<_>>()
                .join(", "),
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        );
    }
    for n in &nodes {
        g.subscribe(n);
    }
    let mut by_node: std::collections::BTreeMap<String, Vec<pb::ToDataplane>> =
        nodes.iter().map(|n| (n.clone(), Vec::new())).collect();
    for batch in g.flush() {
        by_node
            .entry(batch.node)
            .or_default()
            .extend(batch.messages.iter().map(|m| (**m).clone()));
    }
    Ok(by_node
        .into_iter()
        .map(|(n, mut msgs)| {
            for (i, m) in msgs.iter_mut().enumerate() {
                m.sequence_number = i as u64 + 1;
            }
            (n, msgs)
        })
        .collect())
}

pub fn run(args: &ComputeArgs) -> anyhow::Result<ExitCode> {
    let snap = datastore::snapshot(&args.datastore, &args.store)?;
    for p in &snap.problems {
        eprintln!("warning: skipped: {p}");
    }
    for h in &snap.held {
        eprintln!("note: {h}");
    }
    for c in &snap.caveats {
        eprintln!("warning: {c}");
    }
    let nodes = (!args.all_nodes).then_some(args.nodes.as_slice());
    let streams = compute(snap.updates, nodes, args.allow_unknown_nodes, |r| {
        eprintln!("warning: rejected: {r}")
    })?;
    if let Some(dir) = &args.out_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let stdout = std::io::stdout();
    for (node, msgs) in &streams {
        let endpoints = msgs
            .iter()
            .filter(|m| {
                matches!(
                    m.payload,
                    Some(
                        pb::to_dataplane::Payload::WorkloadEndpointUpdate(_)
                            | pb::to_dataplane::Payload::HostEndpointUpdate(_)
                    )
                )
            })
            .count();
        if endpoints == 0 {
            eprintln!("note: node {node} has no endpoints in the datastore");
        }
        let mut text = String::new();
        for m in msgs {
            text.push_str(&serde_json::to_string(m)?);
            text.push('\n');
        }
        match &args.out_dir {
            Some(dir) => {
                let path = dir.join(format!("{node}.jsonl"));
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!("{node}: {} messages → {}", msgs.len(), path.display());
            }
            None => {
                if streams.len() > 1 {
                    eprintln!("== {node}: {} messages", msgs.len());
                }
                stdout.lock().write_all(text.as_bytes())?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
