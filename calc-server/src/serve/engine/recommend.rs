//! The engine's side of `/recommend` and `/recommend/check` (issue 45): lists the flows of a
//! namespace over a window from the flow store (per 15 s interval, so each key's intervals
//! count as samples), reads the inventory the recommendation needs from the graph (the pods
//! of the namespaces those flows name, with their labels, `generateName` and named ports;
//! every network set) or the namespace's staged policies ([`gather`], on the engine's task,
//! after the datastore batches queued before the question, like `/explain`); the admin
//! endpoint then hands them to the pure [`crate::recommend`] module on a blocking thread
//! ([`answer`]), so the engine is held only for the copies.

use std::collections::BTreeSet;

use calc_graph::convert::EndpointKind;
use calc_graph::graph::{CalcGraph, GraphView};
use calc_graph::model::Kind;
use felix_proto::goldmane::{Filter, Flow, MatchType, StringMatch};
use serde_json::{Value, json};

use crate::flows::{BUCKET_SECONDS, FlowListRequest, FlowStore};
use crate::recommend::{self, Inventory, NamedPort, NetworkSet, Options, Pod, StagedRef};

/// What `/recommend` or `/recommend/check` asks.
#[derive(Clone, Debug)]
pub(crate) struct Question {
    pub options: Options,
    /// The window: this many seconds before now (`None`: everything the store holds).
    pub since: Option<u64>,
    /// `--check`: the staged policies' would-break lists instead of a recommendation.
    pub check: bool,
}

/// What the engine gathers for a question: the window's records and, for a recommendation,
/// the inventory, for a check the namespace's staged policies.
#[derive(Debug)]
pub(crate) struct Gathered {
    flows: Vec<Flow>,
    inventory: Inventory,
    staged: Vec<StagedRef>,
}

/// Gathers what `q` needs from the graph and the flow store (on the engine's task: only
/// copies). The error is the 400 answer's text.
pub(super) fn gather(
    graph: &CalcGraph,
    store: &mut FlowStore,
    q: &Question,
    now: i64,
) -> Result<Gathered, String> {
    q.options.check().map_err(|e| e.to_string())?;
    let ns = q.options.namespace.as_str();
    let flows = window_flows(store, ns, q.since, now)?;
    let view = graph.view();
    Ok(if q.check {
        Gathered {
            staged: staged_in(view, ns),
            inventory: Inventory::default(),
            flows,
        }
    } else {
        Gathered {
            inventory: inventory(view, &flows),
            staged: Vec::new(),
            flows,
        }
    })
}

/// The answer to `q` from what was gathered: the pure recommendation or check, off the
/// engine's task (the admin endpoint runs it on a blocking thread).
pub(crate) fn answer(q: &Question, g: &Gathered) -> Result<Value, String> {
    let ns = q.options.namespace.as_str();
    if q.check {
        let rows = recommend::check(&g.flows, ns, &g.staged);
        return Ok(json!({
            "namespace": ns,
            "flows": g.flows.len(),
            "policies": rows,
        }));
    }
    let r = recommend::recommend(&g.flows, &g.inventory, &q.options).map_err(|e| e.to_string())?;
    serde_json::to_value(&r).map_err(|e| e.to_string())
}

/// Every record (per key and 15 s interval) of the window with a side in `ns`.
fn window_flows(
    store: &mut FlowStore,
    ns: &str,
    since: Option<u64>,
    now: i64,
) -> Result<Vec<Flow>, String> {
    let gte = match since {
        // The bucket holding `now - since` is in the window.
        Some(s) => -i64::try_from(s).unwrap_or(i64::MAX / 2),
        None => 0,
    };
    let exact = || {
        vec![StringMatch {
            value: ns.to_string(),
            r#type: MatchType::Exact as i32,
        }]
    };
    let mut out = Vec::new();
    for source_side in [true, false] {
        let filter = if source_side {
            Filter {
                source_namespaces: exact(),
                ..Default::default()
            }
        } else {
            Filter {
                dest_namespaces: exact(),
                ..Default::default()
            }
        };
        let req = FlowListRequest {
            start_time_gte: gte,
            aggregation_interval: BUCKET_SECONDS,
            filter: Some(filter),
            ..Default::default()
        };
        let listed = store.list(&req, now).map_err(|e| e.to_string())?;
        out.extend(
            listed
                .flows
                .into_iter()
                .filter_map(|r| r.flow)
                // Both sides in `ns`: already listed by the first query.
                .filter(|f| {
                    source_side || f.key.as_ref().is_some_and(|k| k.source_namespace != ns)
                }),
        );
    }
    Ok(out)
}

/// The pods of the namespaces the flows name, and every network set.
fn inventory(view: GraphView<'_>, flows: &[Flow]) -> Inventory {
    let namespaces: BTreeSet<&str> = flows
        .iter()
        .filter_map(|f| f.key.as_ref())
        .flat_map(|k| [k.source_namespace.as_str(), k.dest_namespace.as_str()])
        .collect();
    let mut inv = Inventory::default();
    for e in view.endpoints() {
        let m = e.model();
        let EndpointKind::Workload {
            workload_id,
            generate_name,
            ..
        } = &m.kind
        else {
            continue;
        };
        let Some(ns) = e.key().namespace.as_deref() else {
            continue;
        };
        if !namespaces.contains(ns) {
            continue;
        }
        let name = workload_id
            .split_once('/')
            .map_or(workload_id.as_str(), |(_, n)| n);
        inv.pods.push(Pod {
            namespace: ns.to_string(),
            name: name.to_string(),
            generate_name: generate_name.clone(),
            labels: e.labels().unwrap_or_default(),
            ports: m
                .ports
                .iter()
                .map(|p| NamedPort {
                    name: p.name.clone(),
                    protocol: p.protocol.to_string(),
                    port: p.port,
                })
                .collect(),
        });
    }
    for (key, nets) in view.network_sets() {
        inv.network_sets.push(NetworkSet {
            namespace: key.namespace.clone(),
            name: key.name.clone(),
            labels: view.network_set_labels(key).unwrap_or_default(),
            nets: nets.iter().map(|n| n.to_string()).collect(),
        });
    }
    inv
}

/// The staged policies of `ns` (Calico's and Kubernetes' staged kinds), sorted.
fn staged_in(view: GraphView<'_>, ns: &str) -> Vec<StagedRef> {
    let mut out: Vec<StagedRef> = view
        .policies()
        .filter(|p| p.key().namespace.as_deref() == Some(ns))
        .filter_map(|p| {
            let kind = match p.key().kind {
                Kind::StagedNetworkPolicy => "StagedNetworkPolicy",
                Kind::StagedKubernetesNetworkPolicy => "StagedKubernetesNetworkPolicy",
                _ => return None,
            };
            Some(StagedRef {
                kind: kind.into(),
                name: p.key().name.clone(),
            })
        })
        .collect();
    out.sort();
    out
}
