//! Times the console's pages for `calc-bench console` (docs/benchmarks.md, "Admin console").
//!
//! Contract: the same path as a browser's request without the network: the admin router (the
//! access check, the console's handler, the engine's answer through `admin::ask`, the
//! template) in front of a real engine task that holds the cluster given and the flow
//! records given, stored as the agents' reports would be. Each page is asked once to warm up,
//! then `rounds` times; the time of each answer is kept, up to its last body byte. Between
//! answers nothing changes, or (per page, [`Before`]) an agent reconnects or a datastore batch
//! arrives, which is what makes the engine compute again what it keeps (the realization
//! table). It measures; it does not judge.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use axum::http::Request;
use calc_graph::graph::Update;
use tower::ServiceExt as _;

use super::super::admin::{AdminState, Bounds, router};
use super::super::admin_access::AdminAccess;
use super::super::engine::{Conn, Engine, Input, Limits};
use super::super::listener::IdentitySource;
use super::super::metrics::Metrics;
use crate::status::Board;

/// One page's answers.
#[derive(Clone, Debug)]
pub struct PageTiming {
    pub path: String,
    pub status: u16,
    /// The HTML's size.
    pub bytes: usize,
    /// The warm-up answer (the first to ask computes what the engine then keeps, such as the
    /// realization table).
    pub first: Duration,
    /// Each timed answer, in order.
    pub times: Vec<Duration>,
    /// The last answer's body.
    pub body: String,
}

/// What happens before each answer of a page (the warm-up's included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Before {
    /// Nothing: the engine's kept results stay valid.
    Nothing,
    /// An agent reconnects (its stream replaced, its snapshot queued): the realization moves.
    AgentReconnect,
    /// A datastore batch arrives (empty: only the fact that the graph may have changed).
    DatastoreBatch,
}

/// What the store held once the reports were in.
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    /// Flow keys in the store.
    pub flow_keys: i64,
    /// Records the engine accepted (the rest were refused, see `/metrics`).
    pub accepted: u64,
}

/// Applies `updates` (ending in `InSync`) and then the flow `reports` (reporting node,
/// report), all at the fixed time `now`, and times each of `paths` `rounds` times.
pub fn run(
    updates: Vec<Update>,
    reports: Vec<(String, felix_proto::FlowReport)>,
    now: SystemTime,
    paths: &[(String, Before)],
    rounds: usize,
) -> anyhow::Result<(Loaded, Vec<PageTiming>)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let (board, metrics) = (Arc::new(Board::default()), Arc::new(Metrics::default()));
        let ready = Arc::new(AtomicBool::new(false));
        let max_keys = reports.iter().map(|(_, r)| r.records.len()).sum::<usize>() + 1024;
        let mut engine = Engine::new(
            Limits {
                // The benchmark's streams are never read: nothing may cut them off.
                backlog: u64::MAX / 4,
                backlog_bytes: Some(u64::MAX / 4),
                concurrent_snapshots: 1 << 20,
                allow_unknown_nodes: false,
            },
            board.clone(),
            ready.clone(),
            metrics.clone(),
        );
        engine.enable_flows(max_keys, max_keys.saturating_mul(4));
        engine.set_wall(Some(now));
        engine.step([Input::Datastore(updates)]);
        // One stream per reporting node (its queue is kept, never read).
        let mut streams = Vec::new();
        let mut ids: HashMap<String, u64> = HashMap::new();
        for (node, _) in &reports {
            if ids.contains_key(node) {
                continue;
            }
            let id = ids.len() as u64 + 1;
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let conn = Conn::new(
                id,
                tx,
                Arc::new(AtomicU64::new(0)),
                Arc::new(AtomicU64::new(0)),
            );
            let (reply, mut verdict) = tokio::sync::oneshot::channel();
            engine.step([Input::Connect {
                node: node.clone(),
                agent_version: "calc-bench".into(),
                conn,
                reply,
            }]);
            match verdict.try_recv() {
                Ok(Ok(())) => {}
                other => anyhow::bail!("node {node} refused: {other:?}"),
            }
            streams.push(rx);
            ids.insert(node.clone(), id);
        }
        for (node, report) in &reports {
            let batch = super::super::engine::flows::parse(report)
                .map_err(|e| anyhow::anyhow!("a report from {node}: {e}"))?;
            engine.step([Input::Flows {
                node: node.clone(),
                id: ids[node],
                batch,
                at: now,
            }]);
        }
        let loaded = Loaded {
            flow_keys: metrics.flow_keys.get(),
            accepted: metrics.flow_records.get(),
        };
        let (engine_tx, engine_rx) = tokio::sync::mpsc::channel(64);
        let (datastore_tx, datastore_rx) = tokio::sync::mpsc::channel(1);
        let reconnecting = reports.first().map(|(n, _)| n.clone()).unwrap_or_default();
        let mut next_id = ids.len() as u64 + 1;
        tokio::spawn(super::super::engine::run(engine, engine_rx, datastore_rx));
        let args = crate::args::AdminArgs {
            admin_allowed_cn: vec![],
            admin_allowed_uri_san: vec![],
            admin_ca_file: None,
            admin_token_file: None,
            admin_max_concurrent_queries: 2,
            admin_query_timeout: Duration::from_secs(60),
            admin_max_response_bytes: 1 << 30,
            admin_max_connections: 8,
        };
        let access = AdminAccess::new(
            &args,
            "127.0.0.1:9096".parse()?,
            false,
            IdentitySource::CommonName,
        )?;
        let app = router(AdminState {
            board,
            ready,
            metrics,
            engine: engine_tx.clone(),
            access: Arc::new(access),
            bounds: Bounds {
                queries: Arc::new(tokio::sync::Semaphore::new(2)),
                query_timeout: Duration::from_secs(60),
                max_response_bytes: 1 << 30,
            },
        });
        let mut out = Vec::new();
        for (path, before) in paths {
            let mut timing = PageTiming {
                path: match before {
                    Before::Nothing => path.clone(),
                    Before::AgentReconnect => format!("{path} after an agent reconnect"),
                    Before::DatastoreBatch => format!("{path} after a datastore batch"),
                },
                status: 0,
                bytes: 0,
                first: Duration::ZERO,
                times: Vec::with_capacity(rounds),
                body: String::new(),
            };
            for round in 0..=rounds {
                match before {
                    Before::Nothing => {}
                    Before::AgentReconnect => {
                        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                        let conn = Conn::new(
                            next_id,
                            tx,
                            Arc::new(AtomicU64::new(0)),
                            Arc::new(AtomicU64::new(0)),
                        );
                        next_id += 1;
                        let (reply, verdict) = tokio::sync::oneshot::channel();
                        let _ = engine_tx
                            .send(Input::Connect {
                                node: reconnecting.clone(),
                                agent_version: "calc-bench".into(),
                                conn,
                                reply,
                            })
                            .await;
                        let _ = verdict.await;
                        streams.push(rx);
                    }
                    Before::DatastoreBatch => {
                        let _ = datastore_tx.send(Vec::new()).await;
                    }
                }
                // Let the engine take the change in before the page is asked.
                tokio::time::sleep(Duration::from_millis(if *before == Before::Nothing {
                    0
                } else {
                    20
                }))
                .await;
                let t = Instant::now();
                let resp = app
                    .clone()
                    .oneshot(Request::get(path.as_str()).body(Body::empty())?)
                    .await?;
                let status = resp.status().as_u16();
                let body = axum::body::to_bytes(resp.into_body(), usize::MAX).await?;
                let took = t.elapsed();
                timing.status = status;
                timing.bytes = body.len();
                timing.body = String::from_utf8_lossy(&body).into_owned();
                if round > 0 {
                    timing.times.push(took);
                } else {
                    timing.first = took;
                }
            }
            out.push(timing);
        }
        drop(streams);
        Ok((loaded, out))
    })
}
