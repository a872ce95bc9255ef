//! The benchmark tools' library (the binaries: `calc-bench`, `etcd-bench`, `linux-bench`): the synthetic cluster generator and the measurements
//! `calc-bench` runs (see docs/benchmarks.md). Nothing here ships in `calc-server` or
//! `dataplane-agent`.
//!
//! - [`gen_cluster`]: a deterministic synthetic Calico cluster (JSON manifests) from a seed;
//! - [`graph_bench`]: the calculation graph on a datastore, against the floor of reading and
//!   validating the same objects;
//! - [`bench_sync`]: simulated agents against a running server (time to sync, memory, change
//!   latency);
//! - [`churn`]: datastore churn at increasing rates against a running server and its agents
//!   (file or etcd datastore);
//! - [`etcd_store`]: v3 objects into etcd in Calico's key layout (`etcd-bench load`, churn);
//! - [`flows_bench`]: calc-server's flow-log ingest (records per second on one core, memory
//!   per flow key);
//! - [`console_bench`]: the admin console's pages rendered on the server (time per page);
//! - [`recommend_bench`]: policy recommendations for one namespace (1,000 pods, 100k flows);
//! - [`flip_kernel`]: a label flip in the datastore until the kernel IP set of a real agent
//!   (Linux driver, in a network namespace) has it ([`ipset_netlink`] polls the kernel).

pub mod bench_sync;
pub mod churn;
pub mod console_bench;
pub mod etcd_store;
pub mod flip_kernel;
pub mod flows_bench;
pub mod gen_cluster;
pub mod graph_bench;
pub mod ipset_netlink;
pub mod recommend_bench;
mod sync_agent;
mod sync_failover;
