//! Every flag and environment variable of calc-server's commands, and their value parsers.
//!
//! These are user contracts (names, env vars, defaults and help text are checked by
//! `calc-server/tests/cli.rs` and `integration/tests/operator.rs`): they live here, at the top,
//! so that the adapters and the serving layer take their settings from one place and none of
//! them imports another for a flag type. This module imports none of ours.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The admin address `serve` listens on unless told otherwise (Felix's health port, 9099,
/// and Typha's, 9098, are taken on a Calico node).
pub const DEFAULT_ADMIN: &str = "127.0.0.1:9096";

/// The file datastore's directory unless told otherwise: the example cluster, relative to the
/// current directory (the repository's root for `make demo`).
pub const DEFAULT_FILE_DIR: &str = "examples/cluster";

/// How the file datastore learns of changes (`--file-watch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FileWatch {
    /// Linux inotify: changed paths are reported by the kernel; polling is the fallback.
    Inotify,
    /// List the directory every --file-poll-interval.
    Poll,
}

/// Which datastore to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DatastoreType {
    /// A directory of Calico v3 YAML/JSON manifests (the embedded default).
    File,
    /// Calico's etcd v3 layout (`/calico/resources/v3/projectcalico.org/...`).
    Etcdv3,
    /// The Kubernetes API: Calico CRDs (crd.projectcalico.org/v1) and pods, namespaces,
    /// service accounts, nodes and NetworkPolicies, as Calico's Kubernetes datastore reads them.
    Kubernetes,
}

/// Datastore selection flags shared by `compute` and `serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct DatastoreArgs {
    /// Where the cluster's Calico resources come from.
    #[arg(long, env = "DATASTORE_TYPE", value_enum, default_value = "file")]
    pub datastore_type: DatastoreType,
    /// Directory of manifests for the file datastore (searched recursively; `status/` ignored).
    #[arg(long, env = "CALC_SERVER_FILE_DIR", default_value = DEFAULT_FILE_DIR)]
    pub file_dir: PathBuf,
    /// etcd connection (for `--datastore-type etcdv3`).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Kubernetes API connection (for `--datastore-type kubernetes`).
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// Connection flags shared by `serve` and `compute` (flattened into `DatastoreArgs`). The env
/// names are Felix's.
#[derive(Clone, Debug, clap::Args)]
pub struct EtcdArgs {
    /// etcd v3 endpoints, comma-separated URLs (`http://` or `https://`).
    #[arg(
        long,
        env = "ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub etcd_endpoints: Vec<String>,
    /// PEM CA bundle that signs the etcd servers' certificates (needed for https endpoints).
    #[arg(long, env = "ETCD_CA_CERT_FILE")]
    pub etcd_ca_file: Option<PathBuf>,
    /// PEM client certificate for etcd (with --etcd-key-file).
    #[arg(long, env = "ETCD_CERT_FILE", requires = "etcd_key_file")]
    pub etcd_cert_file: Option<PathBuf>,
    /// PEM private key of the client certificate (with --etcd-cert-file).
    #[arg(long, env = "ETCD_KEY_FILE", requires = "etcd_cert_file")]
    pub etcd_key_file: Option<PathBuf>,
    /// Keys per range request when listing (all pages are read at one revision).
    #[arg(
        long,
        env = "CALC_SERVER_ETCD_PAGE_SIZE",
        default_value_t = 4000,
        value_parser = clap::value_parser!(i64).range(1..)
    )]
    pub etcd_page_size: i64,
}

/// Flags only `serve` needs (flattened into `ServeArgs`).
#[derive(Clone, Debug, clap::Args)]
pub struct EtcdServeArgs {
    /// Anti-entropy: re-list everything this often and reconcile (only differences are sent).
    #[arg(long, env = "CALC_SERVER_ETCD_RESYNC_INTERVAL", default_value = "5m", value_parser = parse_duration)]
    pub etcd_resync_interval: Duration,
    /// How often this server's own status keys are listed and repaired (rewritten if they
    /// differ, deleted if stale).
    #[arg(long, env = "CALC_SERVER_ETCD_STATUS_RESYNC_INTERVAL", default_value = "1m", value_parser = parse_duration)]
    pub etcd_status_resync_interval: Duration,
    /// Longest wait between reconnection attempts (the back-off doubles from 100 ms, jittered).
    #[arg(long, env = "CALC_SERVER_ETCD_MAX_BACKOFF", default_value = "10s", value_parser = parse_duration)]
    pub etcd_max_backoff: Duration,
}

/// Connection flags shared by `serve` and `compute` (flattened into `DatastoreArgs`).
#[derive(Clone, Debug, clap::Args)]
pub struct KubeArgs {
    /// Kubeconfig file for `--datastore-type kubernetes`. Without it the client is configured
    /// as kubectl would be: $KUBECONFIG, then ~/.kube/config, then the in-cluster service
    /// account.
    #[arg(long, env = "CALC_SERVER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the kubeconfig to use (default: its current context).
    #[arg(long, env = "CALC_SERVER_KUBE_CONTEXT")]
    pub kube_context: Option<String>,
    /// Prefix of the host-side interface names of pods (Felix's InterfacePrefix; the first of a
    /// comma-separated list is used, as Calico's CNI plugin does).
    #[arg(long, env = "FELIX_INTERFACEPREFIX", default_value = "cali")]
    pub interface_prefix: String,
}

/// Flags only `serve` needs (flattened into `ServeArgs`).
#[derive(Clone, Debug, clap::Args)]
pub struct KubeServeArgs {
    /// Anti-entropy: re-list every source this often and reconcile (only differences are
    /// sent; 0 disables). Watches already re-list on 410 Gone and after errors.
    #[arg(long, env = "CALC_SERVER_KUBE_RESYNC_INTERVAL", default_value = "30m", value_parser = parse_duration)]
    pub kube_resync_interval: Duration,
    /// Namespace of the ConfigMaps that keep the policy hit counters across a restart
    /// (default: the client's namespace, the pod's own in a cluster).
    #[arg(long, env = "CALC_SERVER_HITS_NAMESPACE")]
    pub hits_namespace: Option<String>,
}

impl KubeArgs {
    /// The interface prefix in force (first entry of the list).
    pub fn interface_prefix(&self) -> String {
        self.interface_prefix
            .split(',')
            .map(str::trim)
            .find(|p| !p.is_empty())
            .unwrap_or("cali")
            .to_string()
    }
}

// `calc-server serve` (a doc comment here would become the subcommand's help).
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub datastore: DatastoreArgs,
    /// Address the gRPC Sync service listens on.
    #[arg(long, env = "CALC_SERVER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address of the admin endpoint (/status, /status/policies, /status/unused,
    /// /status/datastore, /explain, /liveness, /readiness, /metrics).
    /// The default port is 9096 because Felix's health port (9099) and Typha's (9098) are
    /// taken on a Calico node. Without admin authentication (--admin-allowed-cn,
    /// --admin-allowed-uri-san, --admin-ca-file or --admin-token-file) only a loopback address
    /// is accepted. With --tls-* it serves HTTPS with the server's certificate.
    #[arg(
        long,
        env = "CALC_SERVER_ADMIN_LISTEN",
        default_value = DEFAULT_ADMIN
    )]
    pub admin_listen: SocketAddr,
    /// Who may read the admin endpoint, and how much one request may cost.
    #[command(flatten)]
    pub admin: AdminArgs,
    /// How often the file datastore directory is checked for changes when it is polled
    /// (--file-watch poll, or inotify unavailable). With inotify: how long a change that is
    /// not known to be finished (a file written but not yet closed, a removed file, a
    /// ConfigMap's `..data` swap) must stay quiet before it is read.
    #[arg(long, env = "CALC_SERVER_FILE_POLL_INTERVAL", default_value = "500ms", value_parser = parse_duration)]
    pub file_poll_interval: Duration,
    /// How the file datastore learns of changes: `inotify` (only the changed files are read,
    /// a file closed after writing or renamed into place at once; polling takes over where
    /// inotify is unavailable) or `poll` (the directory is listed every --file-poll-interval:
    /// for filesystems that send no inotify events, such as NFS).
    #[arg(long, env = "CALC_SERVER_FILE_WATCH", value_enum, default_value_t = FileWatch::Inotify)]
    pub file_watch: FileWatch,
    /// File datastore: directory of the last-good store (the version of every object in force,
    /// so that after a restart an object that is invalid by then keeps its last good version).
    /// Default: `last-good` inside the status directory (shared by replicas that share it);
    /// an empty value keeps it in memory only. It may not be inside --file-dir elsewhere than
    /// under `status`: the manifest loader would read the copies back. See docs/operations.md.
    #[arg(long, env = "CALC_SERVER_LAST_GOOD_DIR", value_name = "PATH", value_parser = path_or_empty)]
    pub last_good_dir: Option<PathBuf>,
    /// File datastore: directory the agents' endpoint status is written to (`<node>.json`).
    /// Default: `status` inside --file-dir; set it when that directory is read-only (a
    /// ConfigMap volume), e.g. to an emptyDir. An empty value writes no status files (the admin
    /// endpoint's /status still has them). It may not be inside --file-dir elsewhere than
    /// `status`: the manifest loader would read the status files.
    #[arg(long, env = "CALC_SERVER_STATUS_DIR", value_name = "PATH", value_parser = path_or_empty)]
    pub status_dir: Option<PathBuf>,
    /// An agent that falls this many messages behind is disconnected and resent a snapshot.
    #[arg(
        long,
        env = "CALC_SERVER_AGENT_BACKLOG_LIMIT",
        default_value_t = 200_000
    )]
    pub agent_backlog_limit: usize,
    /// An agent that falls this many bytes (encoded messages) behind is disconnected and resent
    /// a snapshot: a stalled agent costs at most this much memory beyond shared messages.
    /// Unset: sized per node from the snapshot its stream was sent, 4x it, at most 256 MiB, at
    /// least the snapshot plus 16 MiB (so a node's snapshot and the changes made while it is
    /// taken always fit).
    #[arg(long, env = "CALC_SERVER_AGENT_BACKLOG_BYTES", value_name = "BYTES")]
    pub agent_backlog_bytes: Option<u64>,
    /// How many nodes' snapshots may be in flight at once (others wait their turn).
    #[arg(
        long,
        env = "CALC_SERVER_MAX_CONCURRENT_SNAPSHOTS",
        default_value_t = 32
    )]
    pub max_concurrent_snapshots: usize,
    /// Time an agent has to send its AgentHello.
    #[arg(long, env = "CALC_SERVER_HELLO_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub hello_timeout: Duration,
    /// HTTP/2 keepalive ping interval; a peer that does not answer within the timeout is dropped.
    #[arg(long, env = "CALC_SERVER_KEEPALIVE_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub keepalive_interval: Duration,
    /// Time an agent has to answer a keepalive ping before its connection is dropped (and its
    /// node shown disconnected); keep it above the network's worst round trip.
    #[arg(long, env = "CALC_SERVER_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub keepalive_timeout: Duration,
    /// Largest message accepted from an agent (reports are small: a status, a heartbeat).
    #[arg(long, env = "CALC_SERVER_MAX_RECV_BYTES", default_value_t = 64 * 1024)]
    pub max_recv_bytes: usize,
    /// Accept agents for nodes the datastore does not know (they get config and InSync only).
    #[arg(long, env = "CALC_SERVER_ALLOW_UNKNOWN_NODES")]
    pub allow_unknown_nodes: bool,
    /// Export the per-policy hit totals on /metrics (`calc_server_policy_hits_*`, labelled with
    /// tier, policy, kind and action). /metrics is open to whoever reaches the admin port; set
    /// false to keep policy names off it (the admin /status paths still show the counts).
    #[arg(long, env = "CALC_SERVER_POLICY_HIT_METRICS", default_value_t = true, action = clap::ArgAction::Set)]
    pub policy_hit_metrics: bool,
    /// Flow logs (issue 42): offer the `flows` capability to agents, name and keep the flow
    /// records they send (15 s buckets, about an hour) and serve them on the admin endpoint's
    /// `/flows` and `calc-server flows`. Off by default, as in Calico.
    #[arg(long, env = "CALC_SERVER_FLOW_LOGS")]
    pub flow_logs: bool,
    /// The most flow keys kept (source, destination, port, protocol, reporter, action and
    /// trace); a record of a new key beyond it is dropped and counted
    /// (`calc_server_flow_reports_refused_total{reason="key_cap"}`). Four times as many records
    /// are remembered to drop re-sent ones.
    #[arg(long, env = "CALC_SERVER_FLOW_MAX_KEYS", default_value_t = 100_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub flow_max_keys: usize,
    /// Serve Calico Goldmane's gRPC API (`goldmane.Flows`, `goldmane.Statistics`) on a
    /// listener of its own too, with the admin endpoint's TLS and access rules (it is always
    /// served on the admin endpoint). Needs --flow-logs; without admin authentication only a
    /// loopback address is accepted.
    #[arg(
        long,
        env = "CALC_SERVER_FLOWS_LISTEN",
        value_name = "ADDR",
        requires = "flow_logs"
    )]
    pub flows_listen: Option<SocketAddr>,
    /// The most flow records one agent's stream may send per second, with 15 seconds' worth
    /// of burst (an agent sends an interval's records at once); records beyond are dropped and
    /// counted (`calc_server_flow_reports_refused_total{reason="rate"}`).
    #[arg(long, env = "CALC_SERVER_FLOW_MAX_RECORDS_PER_SECOND", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub flow_max_records_per_second: u32,
    /// How often changed endpoint status is written to the datastore.
    #[arg(long, env = "CALC_SERVER_STATUS_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub status_interval: Duration,
    /// How often changed policy hit counters are saved (also once at shutdown), so a restart
    /// keeps them: file datastore to `_hits.json` in the status directory (none without one),
    /// etcd under `/calico/calc-server/v1/hits/`, Kubernetes as ConfigMaps labelled
    /// `calc-server.projectcalico.org/hits=v1` (see --hits-namespace).
    #[arg(long, env = "CALC_SERVER_HITS_SAVE_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub hits_save_interval: Duration,
    /// etcd watch and status settings (for `--datastore-type etcdv3`).
    #[command(flatten)]
    pub etcd: EtcdServeArgs,
    /// Kubernetes watch settings (for `--datastore-type kubernetes`).
    #[command(flatten)]
    pub kube: KubeServeArgs,
    /// mTLS and connection limits of the Sync listener.
    #[command(flatten)]
    pub listener: ListenerArgs,
    /// YAML file of settings for serve: keys are flag names without the dashes
    /// (`listen: 0.0.0.0:50051`, `tls-ca-file: /etc/calc/ca.pem`, lists as YAML sequences).
    /// Precedence: flags, then environment variables, then this file, then the defaults.
    #[arg(long, env = "CALC_SERVER_CONFIG_FILE", value_name = "PATH")]
    pub config_file: Option<PathBuf>,
    /// Print the effective settings (after flags, environment and config file) and exit: one
    /// `key: value  # source` line each, in the config file's form (source: flag, env NAME,
    /// file PATH or default). Nothing is served.
    #[arg(long)]
    pub print_config: bool,
}

/// Flags of the Sync listener: TLS and connection limits.
#[derive(Clone, Debug, clap::Args)]
pub struct ListenerArgs {
    /// PEM bundle of the CA that signs agents' client certificates. Setting any of
    /// --tls-ca-file, --tls-cert-file, --tls-key-file requires all three; then every agent must
    /// present a certificate chaining to this CA (no plaintext fallback).
    #[arg(long, env = "CALC_SERVER_TLS_CA_FILE", value_name = "PATH")]
    pub tls_ca_file: Option<PathBuf>,
    /// PEM certificate (chain) this server presents to agents.
    #[arg(long, env = "CALC_SERVER_TLS_CERT_FILE", value_name = "PATH")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long, env = "CALC_SERVER_TLS_KEY_FILE", value_name = "PATH")]
    pub tls_key_file: Option<PathBuf>,
    /// Take the node name from the client certificate's URI SAN instead of its CN: the URI SAN
    /// that starts with this prefix, minus the prefix, is the node name (e.g.
    /// `spiffe://cluster.local/calico-node/` and a SAN `spiffe://cluster.local/calico-node/node-1`).
    #[arg(
        long,
        env = "CALC_SERVER_TLS_CLIENT_URI_SAN_PREFIX",
        value_name = "PREFIX"
    )]
    pub tls_client_uri_san_prefix: Option<String>,
    /// Time a client has to complete the TLS handshake (with TLS) and send the HTTP/2 preface
    /// (plaintext too) before its socket is closed.
    #[arg(long, env = "CALC_SERVER_TLS_HANDSHAKE_TIMEOUT", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub tls_handshake_timeout: Duration,
    /// Most agents (connections whose AgentHello was accepted) at once; a further hello is
    /// refused with RESOURCE_EXHAUSTED. Pending connections do not count here.
    #[arg(long, env = "CALC_SERVER_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,
    /// Most connections not yet accepted as agents (handshaking, or waiting for their hello) at
    /// once; further ones are closed at once.
    #[arg(
        long,
        env = "CALC_SERVER_MAX_PENDING_CONNECTIONS",
        default_value_t = 1024
    )]
    pub max_pending_connections: usize,
    /// Most pending connections from one source address.
    #[arg(
        long,
        env = "CALC_SERVER_MAX_PENDING_PER_ADDRESS",
        default_value_t = 64
    )]
    pub max_pending_per_address: usize,
    /// Most concurrent HTTP/2 streams per connection (an agent uses one).
    #[arg(long, env = "CALC_SERVER_MAX_CONCURRENT_STREAMS", default_value_t = 16)]
    pub max_concurrent_streams: u32,
}

/// Authentication and request bounds of serve's admin endpoint. Everything but `/liveness`,
/// `/readiness` and `/metrics` needs an admin caller once any of the first four is set.
#[derive(Clone, Debug, clap::Args)]
pub struct AdminArgs {
    /// Client certificate CNs that are admins (comma-separated). Needs --tls-*: the certificate
    /// must chain to --tls-ca-file (or to --admin-ca-file when set). Agents' node certificates
    /// are never admins, even when the CN is listed.
    #[arg(
        long,
        env = "CALC_SERVER_ADMIN_ALLOWED_CN",
        value_delimiter = ',',
        value_name = "CN"
    )]
    pub admin_allowed_cn: Vec<String>,
    /// Client certificate URI SANs that are admins (comma-separated, exact match; e.g.
    /// `spiffe://cluster.local/ops/admin`). Needs --tls-*, as --admin-allowed-cn.
    #[arg(
        long,
        env = "CALC_SERVER_ADMIN_ALLOWED_URI_SAN",
        value_delimiter = ',',
        value_name = "URI"
    )]
    pub admin_allowed_uri_san: Vec<String>,
    /// PEM bundle of a CA that signs admin client certificates only: every certificate that
    /// chains to it is an admin (narrowed by --admin-allowed-cn / --admin-allowed-uri-san when
    /// given), and agents' certificates (from --tls-ca-file) are not accepted on the admin
    /// endpoint at all. Needs --tls-*.
    #[arg(long, env = "CALC_SERVER_ADMIN_CA_FILE", value_name = "PATH")]
    pub admin_ca_file: Option<PathBuf>,
    /// File holding a bearer token (surrounding whitespace ignored, at least 16 bytes):
    /// `Authorization: Bearer <token>` then makes a caller an admin. Re-read when the file
    /// changes (a rotated Secret). Without --tls-* the token crosses the network in clear text.
    #[arg(long, env = "CALC_SERVER_ADMIN_TOKEN_FILE", value_name = "PATH")]
    pub admin_token_file: Option<PathBuf>,
    /// Most `/explain`, `/status/…`, `/flows` and Goldmane gRPC questions the engine works on
    /// at once; more are answered 429 at once, so the admin endpoint cannot starve the engine.
    #[arg(
        long,
        env = "CALC_SERVER_ADMIN_MAX_CONCURRENT_QUERIES",
        default_value_t = 2,
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub admin_max_concurrent_queries: u16,
    /// Longest wait for the engine's answer to one question (503 after it).
    #[arg(long, env = "CALC_SERVER_ADMIN_QUERY_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub admin_query_timeout: Duration,
    /// Largest admin answer in bytes; a larger one is refused (413) with its size, so one
    /// request cannot make the server build and send an unbounded body.
    #[arg(
        long,
        env = "CALC_SERVER_ADMIN_MAX_RESPONSE_BYTES",
        default_value_t = 32 * 1024 * 1024
    )]
    pub admin_max_response_bytes: usize,
    /// Most open admin connections at once; further ones are closed at once.
    #[arg(
        long,
        env = "CALC_SERVER_ADMIN_MAX_CONNECTIONS",
        default_value_t = 64,
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub admin_max_connections: u16,
}

impl AdminArgs {
    /// Whether any way of authenticating an admin is configured.
    pub fn authenticates(&self) -> bool {
        !self.admin_allowed_cn.is_empty()
            || !self.admin_allowed_uri_san.is_empty()
            || self.admin_ca_file.is_some()
            || self.admin_token_file.is_some()
    }
}

/// How `status` and `explain --server` reach an admin endpoint that wants TLS or a token.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct AdminClientArgs {
    /// PEM CA bundle that signs the server's certificate; needed for an `https://` --server.
    #[arg(
        long = "tls-ca-file",
        env = "CALC_ADMIN_TLS_CA_FILE",
        value_name = "PATH"
    )]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate to present (an admin identity: a CN in serve's
    /// --admin-allowed-cn, or one from --admin-ca-file), with --tls-key-file.
    #[arg(
        long = "tls-cert-file",
        env = "CALC_ADMIN_TLS_CERT_FILE",
        value_name = "PATH",
        requires = "key_file"
    )]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(
        long = "tls-key-file",
        env = "CALC_ADMIN_TLS_KEY_FILE",
        value_name = "PATH",
        requires = "cert_file"
    )]
    pub key_file: Option<PathBuf>,
    /// Name the server's certificate must carry (a DNS SAN, e.g.
    /// `calc-server.calico-system.svc`); default: the host of --server. Set it when connecting
    /// through an address the certificate does not name (127.0.0.1, a port-forward).
    #[arg(
        long = "tls-server-name",
        env = "CALC_ADMIN_TLS_SERVER_NAME",
        value_name = "NAME"
    )]
    pub server_name: Option<String>,
    /// File holding the bearer token (serve's --admin-token-file).
    #[arg(
        long = "token-file",
        env = "CALC_ADMIN_TOKEN_FILE",
        value_name = "PATH"
    )]
    pub token_file: Option<PathBuf>,
}

/// Where `compute` and `explain` find the last-good store a server keeps for the file
/// datastore (serve's flags and environment variables, with the same defaults), so that they
/// answer with the version of an invalid object that a server keeps in force.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct StoreArgs {
    /// File datastore: the last-good store a server keeps (serve's --last-good-dir). Each object
    /// whose manifest is invalid is computed at the last good version found there, as a server
    /// with that store keeps it in force (said on stderr). Default: `last-good` inside the status
    /// directory; an empty value reads none. Without a store, the answer names the invalid
    /// objects a running server may hold older versions of.
    #[arg(long, env = "CALC_SERVER_LAST_GOOD_DIR", value_name = "PATH", value_parser = path_or_empty)]
    pub last_good_dir: Option<PathBuf>,
    /// File datastore: serve's --status-dir (default: `status` inside --file-dir), for the
    /// default of --last-good-dir; never read as manifests.
    #[arg(long, env = "CALC_SERVER_STATUS_DIR", value_name = "PATH", value_parser = path_or_empty)]
    pub status_dir: Option<PathBuf>,
}

// `calc-server compute`.
#[derive(Clone, Debug, clap::Args)]
pub struct ComputeArgs {
    #[command(flatten)]
    pub datastore: DatastoreArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Node to compute (repeat for several).
    #[arg(
        long = "node",
        env = "CALC_SERVER_NODES",
        value_delimiter = ',',
        required_unless_present = "all_nodes"
    )]
    pub nodes: Vec<String>,
    /// Compute every node that has endpoints or a Node resource.
    #[arg(long, env = "CALC_SERVER_ALL_NODES", conflicts_with = "nodes")]
    pub all_nodes: bool,
    /// Write `<node>.jsonl` per node into this directory instead of printing to stdout.
    #[arg(long, env = "CALC_SERVER_OUT_DIR")]
    pub out_dir: Option<PathBuf>,
    /// Compute a node the datastore does not know (what its agent would receive from a server
    /// run with --allow-unknown-nodes: config and InSync); without it such a node is an
    /// error, as serve refuses its agent.
    #[arg(long, env = "CALC_SERVER_ALLOW_UNKNOWN_NODES")]
    pub allow_unknown_nodes: bool,
}

// `calc-server explain`.
#[derive(Clone, Debug, clap::Args)]
#[command(group(
    clap::ArgGroup::new("question")
        .required(true)
        .args(["from", "endpoint", "policy"])
))]
pub struct ExplainArgs {
    #[command(flatten)]
    pub datastore: DatastoreArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Ask a running server (its admin address, serve's --admin-listen) instead of reading the
    /// datastore: the answer then reflects exactly the state it serves.
    #[arg(long, env = "CALC_SERVER_EXPLAIN_SERVER")]
    pub server: Option<String>,
    /// TLS and token for an admin endpoint that requires them (with --server).
    #[command(flatten)]
    pub client: AdminClientArgs,
    /// The source: a workload as namespace/pod (or its WorkloadEndpoint name, optionally
    /// namespace/-prefixed), a host endpoint as hep:NAME, or an IP address (an address no
    /// endpoint owns is outside the cluster).
    #[arg(long, env = "CALC_SERVER_EXPLAIN_FROM", requires = "to")]
    pub from: Option<String>,
    /// The destination, in the same forms as --from.
    #[arg(long, env = "CALC_SERVER_EXPLAIN_TO", requires = "from")]
    pub to: Option<String>,
    /// The protocol: tcp, udp, sctp, icmp, icmpv6 or a number (icmp means an echo request).
    #[arg(long, env = "CALC_SERVER_EXPLAIN_PROTOCOL", default_value = "tcp")]
    pub protocol: String,
    /// The destination port (needed for tcp, udp and sctp).
    #[arg(long, env = "CALC_SERVER_EXPLAIN_PORT")]
    pub port: Option<String>,
    /// The source port; without it, rules that match source ports do not match.
    #[arg(long, env = "CALC_SERVER_EXPLAIN_SOURCE_PORT")]
    pub source_port: Option<String>,
    /// List the tiers and policies that apply to this endpoint (same forms as --from), in
    /// order, per direction, with their selectors.
    #[arg(long, env = "CALC_SERVER_EXPLAIN_ENDPOINT", conflicts_with_all = ["from", "policy"])]
    pub endpoint: Option<String>,
    /// List the endpoints this policy ([KIND:][NAMESPACE/]NAME, e.g. `snp:shop/web-http-only`)
    /// selects and the nodes where it is active; the kind picks one of several policies of one
    /// name (a kind or Calico's short form: np, gnp, snp, sgnp, sknp, kcnp).
    #[arg(long, env = "CALC_SERVER_EXPLAIN_POLICY", conflicts_with_all = ["from", "endpoint"])]
    pub policy: Option<String>,
    /// Output: the walk as text, one line per step, or one JSON object.
    #[arg(
        long,
        env = "CALC_SERVER_EXPLAIN_OUTPUT",
        value_enum,
        default_value = "text"
    )]
    pub output: ExplainOutput,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExplainOutput {
    Text,
    Json,
}

// `calc-server status`.
#[derive(Clone, Debug, clap::Args)]
pub struct StatusArgs {
    /// The server's admin address (`--admin-listen` of serve), as host:port, http://host:port
    /// or https://host:port (a server with --tls-*). Not the gRPC address (`--listen`).
    #[arg(long, env = "CALC_SERVER_ADMIN", default_value = DEFAULT_ADMIN)]
    pub server: String,
    /// TLS and token for an admin endpoint that requires them.
    #[command(flatten)]
    pub client: AdminClientArgs,
    /// Print the raw JSON instead of a table.
    #[arg(long, env = "CALC_SERVER_STATUS_JSON")]
    pub json: bool,
    /// One line per policy and profile: POLICY TIER DESIRED REALIZED FAILED PHASE KIND HITS
    /// LAST-HIT (where it is in force, from what the agents report they applied; staged policies
    /// are `Staged`; packets its rules decided and when last, from the agents' hit counts).
    #[arg(long, env = "CALC_SERVER_STATUS_POLICIES", conflicts_with = "policy")]
    pub policies: bool,
    /// One policy ([KIND:][NAMESPACE/]NAME, e.g. `snp:shop/web-http-only`, or a profile's name): its
    /// counts and the nodes that lag, with their reason, then one line per rule (ingress, then
    /// egress): its action, packets, bytes, last hit and the nodes where it matched.
    #[arg(long, env = "CALC_SERVER_STATUS_POLICY")]
    pub policy: Option<String>,
    /// One line per verdict of the dataplane's own that counted packets (a tier's end, no
    /// profile matched, the default action of forwarded traffic, failsafe ports) and direction:
    /// VERDICT TIER DIRECTION ACTION PACKETS BYTES LAST-HIT NODES, from the agents' hit counts.
    #[arg(long, env = "CALC_SERVER_STATUS_VERDICTS", conflicts_with_all = ["policy", "policies"])]
    pub verdicts: bool,
}

// `calc-server policies`.
#[derive(Clone, Debug, clap::Args)]
pub struct PoliciesArgs {
    /// The server's admin address (`--admin-listen` of serve), as host:port, http://host:port
    /// or https://host:port (a server with --tls-*). Not the gRPC address (`--listen`).
    #[arg(long, env = "CALC_SERVER_ADMIN", default_value = DEFAULT_ADMIN)]
    pub server: String,
    /// TLS and token for an admin endpoint that requires them.
    #[command(flatten)]
    pub client: AdminClientArgs,
    /// List the policies and profiles in force on at least one node, and their rules, that no
    /// packet matched within the window, from the agents' hit counts. One observed (in force
    /// on a node whose agent reports stats) for less than the window is not yet known, never
    /// unused.
    #[arg(long, env = "CALC_SERVER_POLICIES_UNUSED", required = true)]
    pub unused: bool,
    /// The window, back from now (e.g. `7d`, `12h`, `30m`; units d, h, m, s, ms; at least 1s).
    /// Default: all the history the server recorded, each rule since it was first observed.
    #[arg(long, env = "CALC_SERVER_POLICIES_SINCE", value_name = "DURATION", value_parser = parse_window)]
    pub since: Option<Duration>,
    /// Output: a table, or the server's JSON (a list of objects).
    #[arg(
        long,
        env = "CALC_SERVER_POLICIES_OUTPUT",
        value_enum,
        default_value = "table"
    )]
    pub output: ListOutput,
}

// `calc-server flows`.
#[derive(Clone, Debug, clap::Args)]
pub struct FlowsArgs {
    /// The server's admin address (`--admin-listen` of serve), as host:port, http://host:port
    /// or https://host:port (a server with --tls-*). Not the gRPC address (`--listen`).
    #[arg(long, env = "CALC_SERVER_ADMIN", default_value = DEFAULT_ADMIN)]
    pub server: String,
    /// TLS and token for an admin endpoint that requires them.
    #[command(flatten)]
    pub client: AdminClientArgs,
    /// Only flows of this window back from now (e.g. `10m`, `1h`; units d, h, m, s). Default:
    /// all the server keeps (about an hour).
    #[arg(long, env = "CALC_SERVER_FLOWS_SINCE", value_name = "DURATION", value_parser = parse_window)]
    pub since: Option<Duration>,
    /// Only flows with this action.
    #[arg(long, env = "CALC_SERVER_FLOWS_ACTION", value_enum)]
    pub action: Option<FlowAction>,
    /// Only flows with a side in this namespace.
    #[arg(long, env = "CALC_SERVER_FLOWS_NAMESPACE", value_name = "NS")]
    pub namespace: Option<String>,
    /// Only flows with a side of this name (a pod, host endpoint, network set, `pub` or `pvt`).
    #[arg(long, env = "CALC_SERVER_FLOWS_NAME")]
    pub name: Option<String>,
    /// Only flows whose trace has a hit of this policy ([KIND:][NAMESPACE/]NAME, e.g.
    /// `gnp:deny-all` or `shop/web`).
    #[arg(
        long,
        env = "CALC_SERVER_FLOWS_POLICY",
        value_name = "[KIND:][NS/]NAME"
    )]
    pub policy: Option<String>,
    /// Only flows to this destination port.
    #[arg(long, env = "CALC_SERVER_FLOWS_PORT", value_name = "N")]
    pub port: Option<u16>,
    /// Output: one line per flow, or one JSON object per flow (proto3 JSON of Goldmane's
    /// `Flow`: `Key.action`, `Key.policies.enforced_policies`, …).
    #[arg(
        long,
        env = "CALC_SERVER_FLOWS_OUTPUT",
        value_enum,
        default_value = "text"
    )]
    pub output: FlowsOutput,
    /// With text output, print each flow's enforced and pending traces under it.
    #[arg(long, env = "CALC_SERVER_FLOWS_TRACE")]
    pub trace: bool,
    /// Keep listing: one line per flow and 15-second interval, each printed once about 15 s
    /// after its interval closes (the server is polled every 5 s), until interrupted.
    #[arg(long, env = "CALC_SERVER_FLOWS_FOLLOW")]
    pub follow: bool,
}

// `calc-server recommend`.
#[derive(Clone, Debug, clap::Args)]
pub struct RecommendArgs {
    /// The server's admin address (`--admin-listen` of serve), as host:port, http://host:port
    /// or https://host:port. The server must run with --flow-logs.
    #[arg(long, env = "CALC_SERVER_ADMIN", default_value = DEFAULT_ADMIN)]
    pub server: String,
    /// TLS and token for an admin endpoint that requires them.
    #[command(flatten)]
    pub client: AdminClientArgs,
    /// The namespace whose workloads get policies (or whose staged policies --check judges).
    /// Required, except with --promote --file.
    #[arg(long, env = "CALC_SERVER_RECOMMEND_NAMESPACE", value_name = "NS")]
    pub namespace: Option<String>,
    /// Only flows of this window back from now (e.g. `30m`, `1h`; units d, h, m, s). Default:
    /// all the server keeps (about an hour).
    #[arg(long, env = "CALC_SERVER_RECOMMEND_SINCE", value_name = "DURATION", value_parser = parse_window)]
    pub since: Option<Duration>,
    /// Output: YAML documents ready for `kubectl apply -f` or the YAML datastore directory
    /// (what was left out, as comments at the top), or the whole answer as JSON (with the flows
    /// behind each rule). With --check: `yaml` prints one line per staged policy and break.
    #[arg(
        long,
        env = "CALC_SERVER_RECOMMEND_OUTPUT",
        value_enum,
        default_value = "yaml"
    )]
    pub output: RecommendOutput,
    /// The tier of the recommended policies; outside `default` their names get the `<tier>.`
    /// prefix Calico requires. The tier must exist before the policies are applied.
    #[arg(
        long,
        env = "CALC_SERVER_RECOMMEND_TIER",
        default_value = "default",
        value_name = "TIER"
    )]
    pub tier: String,
    /// Also allow flows the enforced policies denied (by default they are left out and listed).
    #[arg(long, env = "CALC_SERVER_RECOMMEND_INCLUDE_DENIED")]
    pub include_denied: bool,
    /// Leave out flows seen in fewer 15-second intervals than this.
    #[arg(
        long,
        env = "CALC_SERVER_RECOMMEND_MIN_SAMPLES",
        default_value_t = 1,
        value_name = "N"
    )]
    pub min_samples: u32,
    /// Instead of recommending: for each staged policy of the namespace, the flows of the
    /// window the enforced policies allow and it would deny (what enforcing it would break).
    /// Exits 0 when there are none, 1 when some flow would break.
    #[arg(long, env = "CALC_SERVER_RECOMMEND_CHECK", conflicts_with_all = ["promote", "include_denied", "tier", "min_samples"])]
    pub check: bool,
    /// Instead of recommending: print the enforced NetworkPolicy (GlobalNetworkPolicy) of each
    /// staged policy: those in --file, else those the server recommends now.
    #[arg(long, env = "CALC_SERVER_RECOMMEND_PROMOTE")]
    pub promote: bool,
    /// With --promote: the staged policies to promote (files or directories of manifests, as
    /// applied); with --namespace only those of that namespace.
    #[arg(
        long,
        env = "CALC_SERVER_RECOMMEND_FILE",
        value_name = "PATH",
        requires = "promote"
    )]
    pub file: Vec<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RecommendOutput {
    Yaml,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FlowAction {
    Allow,
    Deny,
}

impl FlowAction {
    pub fn as_str(self) -> &'static str {
        match self {
            FlowAction::Allow => "allow",
            FlowAction::Deny => "deny",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FlowsOutput {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ListOutput {
    Table,
    Json,
}

/// Why a window (`--since`) is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WindowError {
    #[error("{0:?} is not a duration (e.g. 7d, 12h, 30m, 90s)")]
    NotADuration(String),
    #[error("{0:?} is shorter than 1s")]
    TooShort(String),
}

/// A window back from now: a duration as [`parse_duration`] reads it, or whole days (`7d`);
/// at least a second.
pub fn parse_window(text: &str) -> Result<Duration, WindowError> {
    let t = text.trim();
    let d = match t.strip_suffix('d') {
        Some(days) => days
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|d| d.is_finite() && *d >= 0.0)
            .and_then(|d| Duration::try_from_secs_f64(d * 86_400.0).ok()),
        None => parse_duration(t).ok(),
    }
    .ok_or_else(|| WindowError::NotADuration(text.to_owned()))?;
    if d < Duration::from_secs(1) {
        return Err(WindowError::TooShort(text.to_owned()));
    }
    Ok(d)
}

/// A path where an empty value means "none" (clap's path parser refuses empty values).
pub fn path_or_empty(s: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(s))
}

/// Parses `500ms`, `10s`, `1.5s`, `2m`, `1h` or a bare number of seconds (shared with the
/// agent).
pub use common::parse_duration;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_prefix_takes_the_first_entry() {
        let args = KubeArgs {
            kubeconfig: None,
            kube_context: None,
            interface_prefix: " eni , veth".into(),
        };
        assert_eq!(args.interface_prefix(), "eni");
    }

    /// A window takes days too, and is at least a second.
    #[test]
    fn windows_take_days_and_are_at_least_a_second() {
        assert_eq!(parse_window("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_window("1.5d"), Ok(Duration::from_secs(129_600)));
        assert_eq!(parse_window("12h"), Ok(Duration::from_secs(43_200)));
        assert_eq!(parse_window("90"), Ok(Duration::from_secs(90)));
        for bad in ["0", "500ms", "0d", "xd", "-1d", "7w", ""] {
            assert!(parse_window(bad).is_err(), "{bad}");
        }
    }

    /// Durations are written as operators write them in flags, env vars and config files.
    #[test]
    fn durations_take_a_unit_or_mean_seconds() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration(" 2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert!(
            parse_duration("10d")
                .unwrap_err()
                .to_string()
                .contains("unit")
        );
        assert!(parse_duration("fast").is_err());
    }
}
