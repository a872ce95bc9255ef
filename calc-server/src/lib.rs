//! calc-server as a library: everything the `calc-server` binary runs, so that tools (the
//! benchmarks in `tools/bench`) can reuse the adapters and the graph wiring.
//!
//! Layers, each importing only those above it:
//! - [`args`]: every flag and environment variable (user contracts) and their value parsers;
//! - [`status`]: the status board, what the agents report (shared by the serving layer and the
//!   datastore's status writers); [`admin_client`] and `table`: the admin endpoint's client side
//!   and its text tables (shared by the commands that ask a running server);
//! - [`datastore`]: one adapter per datastore (file, etcd, Kubernetes) feeding one sink; the
//!   pure part of ingest is the `calc_ingest` crate;
//! - [`serve`]: the engine that owns the graph, the gRPC Sync service, the listener and the
//!   admin endpoint; [`compute`], [`explain_cmd`], [`status_cmd`], [`policies_cmd`] and
//!   [`offline`]: the other commands;
//! - [`flows`]: the flow aggregator's store (Goldmane's queries over 15 s buckets), pure; fed
//!   by the engine (`serve --flow-logs`) and listed by [`flows_cmd`] through `/flows`;
//! - [`recommend`]: policy recommendations from flows, the would-break check and promotion,
//!   pure; asked of the engine through `/recommend` by [`recommend_cmd`] and the console;
//!
//! The benchmark tools (cluster generator, graph and sync benchmarks, etcd-bench) are the
//! `bench-tools` crate (`tools/bench`), which uses this library.

pub mod admin_client;
pub mod args;
pub mod compute;
pub mod datastore;
pub mod explain_cmd;
pub mod flows;
pub mod flows_cmd;
pub mod offline;
mod pem;
pub mod policies_cmd;
pub mod recommend;
pub mod recommend_cmd;
pub mod serve;
pub mod status;
pub mod status_cmd;
mod table;
