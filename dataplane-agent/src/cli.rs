//! The command line: `dataplane-agent --server URL --node NAME --driver dry-run [--state-file PATH]`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
pub use common::LogFormat;
use common::parse_duration;

use crate::driver::linux::iptables::Backend;
use crate::driver::linux::rules::static_chains::{
    EndpointToHostAction, Failsafe, default_failsafes_in, default_failsafes_out,
};
use crate::driver::{DriverKind, LinuxOptions};
use crate::session::{SessionConfig, UrlError, normalize_server_url};
use crate::tls::{ClientTls, ServerIdentity, TlsError};

/// What is wrong with the flags beyond what clap checks; shown as `error: ...` at start-up.
#[derive(Debug, thiserror::Error)]
pub enum FlagError {
    #[error(transparent)]
    ServerUrl(#[from] UrlError),
    #[error(
        "--server {0}: the --tls-* flags are set, so every server must be https:// (no plaintext fallback)"
    )]
    PlaintextServer(String),
    #[error(
        "--server {0}: https:// needs --tls-ca-file, --tls-cert-file, --tls-key-file and --tls-server-cn or --tls-server-uri-san"
    )]
    HttpsWithoutTls(String),
    #[error("--server: at least one calc-server URL is required")]
    NoServer,
    #[error("--node must not be empty")]
    EmptyNode,
    #[error(
        "--state-file {}: the directory {} does not exist (create it, or give a path in an existing directory)",
        path.display(),
        dir.display()
    )]
    StateFileDirectory { path: PathBuf, dir: PathBuf },
    /// A duration flag that must be positive.
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("--reconnect-min-delay ({min:?}) is larger than --reconnect-max-delay ({max:?})")]
    ReconnectDelays { min: Duration, max: Duration },
    /// Some --tls-* flags without the others (each missing item is one choice: `A or B`).
    #[error(
        "TLS needs all of --tls-ca-file, --tls-cert-file, --tls-key-file and one of \
         --tls-server-cn / --tls-server-uri-san; given: {}; missing: {}",
        given.join(", "),
        missing.iter().map(|m| format!("[{m}]")).collect::<Vec<_>>().join(" ")
    )]
    IncompleteTls {
        given: Vec<&'static str>,
        missing: Vec<&'static str>,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("--interface-prefix must name at least one prefix")]
    NoInterfacePrefix,
    #[error("--interface-prefix: {0}")]
    InterfacePrefix(calico_names::validate::NameError),
    #[error("--log-prefix: {0}")]
    LogPrefix(calico_names::validate::NameError),
    #[error("{flag}: {error}")]
    Failsafe {
        flag: &'static str,
        error: calico_names::felix_config::FailsafeError,
    },
    /// The driver's parser of Felix's feature overrides, which says what is wrong.
    #[error("--feature-detect-override: {0}")]
    FeatureDetectOverride(String),
    #[error(
        "--device-route-protocol {0}: reserved for the kernel (redirect, kernel, boot, static); \
         routes with it are not ours to delete"
    )]
    ReservedRouteProtocol(u8),
}

/// Follows a calc-server's Sync stream and programs this node's dataplane through a pluggable
/// driver.
///
/// The agent connects to the first --server, says hello with its --node name, receives the
/// node's snapshot and, only after the server's InSync, programs the dataplane; then it applies
/// deltas as they come and reports endpoint status and heartbeats back. If the stream is lost it
/// keeps the dataplane as it is, reconnects (with back-off, trying the next --server) and
/// reconciles against the new snapshot. SIGTERM or SIGINT stop it with exit code 0, leaving the
/// dataplane in place.
#[derive(Debug, Parser)]
#[command(name = "dataplane-agent", version, about, long_about)]
pub struct Cli {
    /// calc-server URL; repeat the flag or separate with commas. Tried in order, moving to the
    /// next one when a connection fails or a stream ends (fail-over). "host:port" means
    /// "http://host:port", or "https://host:port" when the --tls-* flags are set.
    #[arg(
        long = "server",
        env = "DATAPLANE_AGENT_SERVERS",
        value_name = "URL",
        value_delimiter = ',',
        required = true
    )]
    pub servers: Vec<String>,

    /// This node's name (the Calico Node name, as in a WorkloadEndpoint's spec.node).
    #[arg(long, env = "DATAPLANE_AGENT_NODE", value_name = "NAME")]
    pub node: String,

    /// The dataplane driver. Default: `linux` when running as root on Linux, `dry-run`
    /// otherwise. `nftables` programs the same policy as `linux` through nftables (tables
    /// `ip calico` and `ip6 calico`) and takes the `linux driver:` flags too, except
    /// `--iptables-backend` and `--xtables-lock-timeout`; switching a node between `linux` and
    /// `nftables` removes the other driver's state once the new one is in place.
    #[arg(long, env = "DATAPLANE_AGENT_DRIVER", value_enum)]
    pub driver: Option<DriverKind>,

    /// dry-run driver: after each apply, write the whole desired state here as pretty JSON
    /// (atomically: temporary file in the same directory, then rename).
    #[arg(long, env = "DATAPLANE_AGENT_STATE_FILE", value_name = "PATH")]
    pub state_file: Option<PathBuf>,

    /// linux driver: the iptables implementation. `auto` follows whichever of legacy and nft
    /// already holds rules (Kubernetes' hint chain first), else `iptables --version`.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_IPTABLES_BACKEND",
        value_enum,
        default_value = "auto"
    )]
    pub iptables_backend: Backend,

    /// linux driver: also program ip6tables and IPv6 sets.
    #[arg(long, env = "DATAPLANE_AGENT_IPV6_SUPPORT", default_value = "true", action = clap::ArgAction::Set, value_name = "BOOL")]
    pub ipv6_support: bool,

    /// linux driver: workload interface prefixes (Felix's InterfacePrefix), comma-separated.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_INTERFACE_PREFIX",
        value_delimiter = ',',
        default_value = "cali",
        value_name = "PREFIX"
    )]
    pub interface_prefix: Vec<String>,

    /// linux driver: what happens to workload-to-host traffic that egress policy allowed
    /// (Felix's DefaultEndpointToHostAction).
    #[arg(
        long,
        env = "DATAPLANE_AGENT_DEFAULT_ENDPOINT_TO_HOST_ACTION",
        value_enum,
        default_value = "drop"
    )]
    pub default_endpoint_to_host_action: EndpointToHostAction,

    /// linux driver: ports always open to this host whatever host endpoint policy says,
    /// `proto:port` comma-separated (Felix's FailsafeInboundHostPorts and its defaults; an empty
    /// value for none). The calc-server addresses of --server are always open besides.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_FAILSAFE_INBOUND_HOST_PORTS",
        value_delimiter = ',',
        value_name = "PROTO:PORT",
        default_value = crate::driver::linux::rules::static_chains::DEFAULT_FAILSAFES_IN
    )]
    pub failsafe_inbound_host_ports: Option<Vec<String>>,

    /// linux driver: ports this host may always reach (Felix's FailsafeOutboundHostPorts and
    /// its defaults; an empty value for none). The calc-server addresses of --server (each
    /// address and port, resolved at start) are always reachable besides, so host endpoint
    /// policy cannot cut the agent off from its server.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_FAILSAFE_OUTBOUND_HOST_PORTS",
        value_delimiter = ',',
        value_name = "PROTO:PORT",
        default_value = crate::driver::linux::rules::static_chains::DEFAULT_FAILSAFES_OUT
    )]
    pub failsafe_outbound_host_ports: Option<Vec<String>>,

    /// linux driver: how often iptables, ipsets and routes are read back and out-of-band
    /// changes repaired (0 turns it off).
    #[arg(long, env = "DATAPLANE_AGENT_REFRESH_INTERVAL", value_name = "DURATION", default_value = "90s", value_parser = parse_duration)]
    pub refresh_interval: Duration,

    /// linux driver: how long iptables-restore waits for the xtables lock.
    #[arg(long, env = "DATAPLANE_AGENT_XTABLES_LOCK_TIMEOUT", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub xtables_lock_timeout: Duration,

    /// linux driver: leave routes, static neighbours and workload interface sysctls to someone
    /// else (Felix's RouteSyncDisabled). Interfaces are then not monitored either, and endpoint
    /// status ignores link state.
    #[arg(long, env = "DATAPLANE_AGENT_ROUTE_SYNC_DISABLED")]
    pub route_sync_disabled: bool,

    /// linux driver: the route protocol number our workload routes carry; routes with it are
    /// ours to add and delete (Felix's DeviceRouteProtocol).
    #[arg(long, env = "DATAPLANE_AGENT_DEVICE_ROUTE_PROTOCOL", default_value = "80", value_parser = clap::value_parser!(u8).range(1..=255))]
    pub device_route_protocol: u8,

    /// linux driver: prefix of the LOG rules that `action: Log` renders.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_LOG_PREFIX",
        default_value = "calico-packet"
    )]
    pub log_prefix: String,

    /// linux and nftables drivers: flow logs. Every rule that decides a packet (policy and
    /// profile allow, deny and pass rules, each tier's end, the no-profile drop) also sends it
    /// to NFLOG (group 1 inbound, 2 outbound) with Felix's prefix naming the rule. Off by
    /// default, as in Calico; when not given, FelixConfiguration `FlowLogsGoldmaneServer`
    /// (non-empty) turns it on. The agent then reads those groups and conntrack and sends flow
    /// records to a calc-server that takes them (capability `flows`).
    #[arg(long, env = "DATAPLANE_AGENT_FLOW_LOGS", value_name = "BOOL", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub flow_logs: bool,

    /// Flow logs: the most connections tracked at once (both sides of a connection between two
    /// local endpoints count twice); a new one beyond is not tracked and counted as dropped.
    /// Twice as many records wait to be sent at most, the oldest dropped first.
    #[arg(long, env = "DATAPLANE_AGENT_FLOW_MAX_CONNECTIONS", value_name = "N", default_value_t = 50_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub flow_max_connections: u64,

    /// Flow logs: how often to send the records of the 15-second intervals closed since the last
    /// send (and read NFLOG and conntrack); 0 sends none and does not offer `flows`.
    #[arg(long, env = "DATAPLANE_AGENT_FLOWS_INTERVAL", value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub flows_interval: Duration,

    /// linux driver: force features instead of detecting them, in Felix's form
    /// (`MASQFullyRandom=false`; Felix's other names are accepted and have no effect here).
    /// `MASQFullyRandom` is detected as iptables 1.6.2+ on Linux 3.14+.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_FEATURE_DETECT_OVERRIDE",
        value_name = "NAME=BOOL,...",
        default_value = ""
    )]
    pub feature_detect_override: String,

    /// How often to send a ProcessStatusUpdate heartbeat (e.g. 5s, 500ms, 1m).
    #[arg(long, env = "DATAPLANE_AGENT_HEARTBEAT_INTERVAL", value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub heartbeat_interval: Duration,

    /// How often to read the kernel's per-rule counters and report to the calc-server what each
    /// policy rule (and each verdict of ours) decided since the last report, for the `HITS`
    /// columns of `calc-server status` (the linux and nftables drivers; 0 turns collection off).
    #[arg(long, env = "DATAPLANE_AGENT_STATS_INTERVAL", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub stats_interval: Duration,

    /// Largest message accepted from the server, in bytes. An IP set travels as one message: a
    /// network set of a million IPv6 addresses needs about 47 MB.
    #[arg(long, env = "DATAPLANE_AGENT_MAX_RECV_BYTES", value_name = "BYTES", default_value_t = 128 * 1024 * 1024, value_parser = clap::value_parser!(u64).range(1024 * 1024..=2 * 1024 * 1024 * 1024))]
    pub max_recv_bytes: u64,

    /// Longest wait, after a calc-server's ServerHello, for the stream's InSync (the end of its
    /// snapshot). A snapshot that takes longer is dropped with an error and the agent reconnects
    /// with back-off (next --server); the dataplane stays as it is meanwhile.
    #[arg(long, env = "DATAPLANE_AGENT_SNAPSHOT_TIMEOUT", value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub snapshot_timeout: Duration,

    /// Most bytes (encoded messages) a stream may send before its InSync. The agent holds an
    /// unfinished snapshot in memory, so this bounds what a server that never finishes one can
    /// make it keep; over the bound the stream is dropped with an error and the agent
    /// reconnects with back-off. Unset: sized from this node's state, 4x its last complete
    /// snapshot, at least 64 MiB (256 MiB before the first), doubled after each cut, at most
    /// 512 MiB. The largest legitimate node snapshots (100k endpoints) take a few hundred MB.
    #[arg(long, env = "DATAPLANE_AGENT_MAX_SNAPSHOT_BYTES", value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1024 * 1024..))]
    pub max_snapshot_bytes: Option<u64>,

    /// /liveness (and /readiness) answer 503 when the session loop has made no progress for
    /// this long: it is stuck in a blocking call such as an apply that never returns (Felix's
    /// DataplaneWatchdogTimeout). Waiting for a server, idling on a quiet stream and backing
    /// off are progress.
    #[arg(long, env = "DATAPLANE_AGENT_DATAPLANE_WATCHDOG_TIMEOUT", value_name = "DURATION", default_value = "90s", value_parser = parse_duration)]
    pub dataplane_watchdog_timeout: Duration,

    /// Shortest delay before reconnecting (jittered, doubling per failure).
    #[arg(long, env = "DATAPLANE_AGENT_RECONNECT_MIN_DELAY", value_name = "DURATION", default_value = "200ms", value_parser = parse_duration)]
    pub reconnect_min_delay: Duration,

    /// Longest delay before reconnecting.
    #[arg(long, env = "DATAPLANE_AGENT_RECONNECT_MAX_DELAY", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub reconnect_max_delay: Duration,

    /// Log level (error, warn, info, debug, trace) or a tracing filter directive.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_LOG_LEVEL",
        value_name = "LEVEL",
        default_value = "info"
    )]
    pub log_level: String,

    /// Log format.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_LOG_FORMAT",
        value_enum,
        default_value = "plain"
    )]
    pub log_format: LogFormat,

    /// PEM bundle of the CA that signs the calc-server's certificate. Setting any --tls-* flag
    /// requires --tls-ca-file, --tls-cert-file, --tls-key-file and one of --tls-server-cn /
    /// --tls-server-uri-san; every server URL is then https:// (no plaintext fallback).
    #[arg(long, env = "DATAPLANE_AGENT_TLS_CA_FILE", value_name = "PATH")]
    pub tls_ca_file: Option<PathBuf>,

    /// PEM client certificate: its CN (or URI SAN, as the server is configured) is this node's
    /// identity and must name the --node.
    #[arg(long, env = "DATAPLANE_AGENT_TLS_CERT_FILE", value_name = "PATH")]
    pub tls_cert_file: Option<PathBuf>,

    /// PEM private key of --tls-cert-file.
    #[arg(long, env = "DATAPLANE_AGENT_TLS_KEY_FILE", value_name = "PATH")]
    pub tls_key_file: Option<PathBuf>,

    /// Required common name of the calc-server's certificate.
    #[arg(long, env = "DATAPLANE_AGENT_TLS_SERVER_CN", value_name = "NAME")]
    pub tls_server_cn: Option<String>,

    /// Required URI SAN of the calc-server's certificate (either this or the CN must match
    /// when both are set).
    #[arg(long, env = "DATAPLANE_AGENT_TLS_SERVER_URI_SAN", value_name = "URI")]
    pub tls_server_uri_san: Option<String>,

    /// Serve /liveness, /readiness, /metrics and /programmed over HTTP on this address (e.g.
    /// 127.0.0.1:9097; 9099 and 9098 are Felix's and Typha's health ports). Off when not set.
    #[arg(long, env = "DATAPLANE_AGENT_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,

    /// YAML file of settings: keys are flag names without the dashes (`node: node-1`,
    /// `server: [https://calc:50051]`, `tls-ca-file: /etc/agent/ca.pem`). Precedence: flags,
    /// then environment variables, then this file, then the defaults.
    #[arg(long, env = "DATAPLANE_AGENT_CONFIG_FILE", value_name = "PATH")]
    pub config_file: Option<PathBuf>,

    /// Print the effective settings (after flags, environment and config file) and exit: one
    /// `key: value  # source` line each, in the config file's form (source: flag, env NAME,
    /// file PATH or default). --server and --node need not be given for it.
    #[arg(long)]
    pub print_config: bool,
}

impl Cli {
    /// Checks what clap cannot and builds the session configuration.
    pub fn session_config(&self) -> Result<SessionConfig, FlagError> {
        let tls = self.tls()?;
        let servers = self
            .servers
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|s| {
                let url = if tls.is_some() && !s.contains("://") {
                    normalize_server_url(&format!("https://{s}"))?
                } else {
                    normalize_server_url(s)?
                };
                match (tls.is_some(), url.starts_with("https://")) {
                    (true, false) => Err(FlagError::PlaintextServer(url)),
                    (false, true) => Err(FlagError::HttpsWithoutTls(url)),
                    _ => Ok(url),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        if servers.is_empty() {
            return Err(FlagError::NoServer);
        }
        if self.node.trim().is_empty() {
            return Err(FlagError::EmptyNode);
        }
        // Checked now: a state file that cannot be written would fail every apply, forever.
        if let Some(path) = &self.state_file {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => std::path::Path::new("."),
            };
            if !dir.is_dir() {
                return Err(FlagError::StateFileDirectory {
                    path: path.clone(),
                    dir: dir.to_path_buf(),
                });
            }
        }
        for (flag, value) in [
            ("--heartbeat-interval", self.heartbeat_interval),
            ("--snapshot-timeout", self.snapshot_timeout),
            (
                "--dataplane-watchdog-timeout",
                self.dataplane_watchdog_timeout,
            ),
        ] {
            if value.is_zero() {
                return Err(FlagError::Zero(flag));
            }
        }
        if self.reconnect_min_delay > self.reconnect_max_delay {
            return Err(FlagError::ReconnectDelays {
                min: self.reconnect_min_delay,
                max: self.reconnect_max_delay,
            });
        }
        let mut config = SessionConfig::new(servers, self.node.trim());
        config.heartbeat_interval = self.heartbeat_interval;
        config.stats_interval = (!self.stats_interval.is_zero()).then_some(self.stats_interval);
        config.flows_interval = (!self.flows_interval.is_zero()).then_some(self.flows_interval);
        config.reconnect_min_delay = self.reconnect_min_delay;
        config.reconnect_max_delay = self.reconnect_max_delay;
        config.max_recv_bytes = usize::try_from(self.max_recv_bytes).unwrap_or(usize::MAX);
        config.snapshot_timeout = self.snapshot_timeout;
        config.max_snapshot_bytes = self.max_snapshot_bytes;
        config.watchdog_timeout = self.dataplane_watchdog_timeout;
        config.tls = tls;
        Ok(config)
    }

    /// The TLS settings: `None` without any --tls-* flag; all-or-nothing otherwise.
    pub fn tls(&self) -> Result<Option<ClientTls>, FlagError> {
        let any = self.tls_ca_file.is_some()
            || self.tls_cert_file.is_some()
            || self.tls_key_file.is_some()
            || self.tls_server_cn.is_some()
            || self.tls_server_uri_san.is_some();
        if !any {
            return Ok(None);
        }
        let missing: Vec<&'static str> = [
            ("--tls-ca-file", self.tls_ca_file.is_none()),
            ("--tls-cert-file", self.tls_cert_file.is_none()),
            ("--tls-key-file", self.tls_key_file.is_none()),
            (
                "--tls-server-cn or --tls-server-uri-san",
                self.tls_server_cn.is_none() && self.tls_server_uri_san.is_none(),
            ),
        ]
        .iter()
        .filter(|(_, m)| *m)
        .map(|(n, _)| *n)
        .collect();
        let (Some(ca), Some(cert), Some(key), true) = (
            &self.tls_ca_file,
            &self.tls_cert_file,
            &self.tls_key_file,
            missing.is_empty(),
        ) else {
            let given: Vec<&'static str> = [
                ("--tls-ca-file", self.tls_ca_file.is_some()),
                ("--tls-cert-file", self.tls_cert_file.is_some()),
                ("--tls-key-file", self.tls_key_file.is_some()),
                ("--tls-server-cn", self.tls_server_cn.is_some()),
                ("--tls-server-uri-san", self.tls_server_uri_san.is_some()),
            ]
            .iter()
            .filter(|(_, g)| *g)
            .map(|(n, _)| *n)
            .collect();
            return Err(FlagError::IncompleteTls { given, missing });
        };
        let identity = ServerIdentity {
            cn: self.tls_server_cn.clone().filter(|s| !s.is_empty()),
            uri_san: self.tls_server_uri_san.clone().filter(|s| !s.is_empty()),
        };
        Ok(Some(ClientTls::load(ca, cert, key, identity)?))
    }
}

/// The addresses a --server value connects to (resolved now: the failsafe rules name
/// addresses). A name that does not resolve is logged and left out.
fn server_addresses(server: &str) -> Vec<std::net::SocketAddr> {
    use std::net::ToSocketAddrs as _;
    let (default_port, rest) = match server.split_once("://") {
        Some(("https", rest)) => (443, rest),
        Some((_, rest)) => (80, rest),
        None => (80, server),
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let authority = authority.rsplit('@').next().unwrap_or_default();
    let with_port = match authority.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() && !host.ends_with(':') => {
            authority.to_owned()
        }
        _ => format!("{authority}:{default_port}"),
    };
    match with_port.to_socket_addrs() {
        Ok(addrs) => addrs.collect(),
        Err(error) => {
            tracing::warn!(server, %error, "cannot resolve the calc-server for the failsafe rules; its connection is not held open against host endpoint policy");
            Vec::new()
        }
    }
}

impl Cli {
    /// The driver to use: the flag, or the default for this process.
    pub fn driver_kind(&self) -> DriverKind {
        self.driver.unwrap_or_else(|| {
            if running_as_root_on_linux() {
                DriverKind::Linux
            } else {
                DriverKind::DryRun
            }
        })
    }

    /// The Linux driver's settings from the flags.
    pub fn linux_options(&self) -> Result<LinuxOptions, FlagError> {
        let prefixes: Vec<String> = self
            .interface_prefix
            .iter()
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.is_empty())
            .collect();
        if prefixes.is_empty() {
            return Err(FlagError::NoInterfacePrefix);
        }
        if let Some(e) = prefixes
            .iter()
            .find_map(|p| crate::driver::linux::validate::interface_prefix(p).err())
        {
            return Err(FlagError::InterfacePrefix(e));
        }
        crate::driver::linux::validate::log_prefix(&self.log_prefix)
            .map_err(FlagError::LogPrefix)?;
        let failsafes =
            |flag: &'static str, v: &Option<Vec<String>>, default: Vec<Failsafe>| match v {
                None => Ok(default),
                Some(list) => list
                    .iter()
                    .map(|s| s.trim())
                    .filter(|s| !s.is_empty())
                    .map(|s| {
                        s.parse::<Failsafe>()
                            .map_err(|error| FlagError::Failsafe { flag, error })
                    })
                    .collect(),
            };
        let mut opts = LinuxOptions {
            backend: self.iptables_backend,
            ipv6: self.ipv6_support,
            refresh_interval: self.refresh_interval,
            lock_wait_secs: self.xtables_lock_timeout.as_secs().clamp(1, 3600) as u32,
            ..LinuxOptions::default()
        };
        opts.statics.workload_prefixes = prefixes;
        opts.statics.endpoint_to_host = self.default_endpoint_to_host_action;
        opts.statics.failsafe_in = failsafes(
            "--failsafe-inbound-host-ports",
            &self.failsafe_inbound_host_ports,
            default_failsafes_in(),
        )?;
        opts.statics.failsafe_out = failsafes(
            "--failsafe-outbound-host-ports",
            &self.failsafe_outbound_host_ports,
            default_failsafes_out(),
        )?;
        opts.statics.control_plane = self
            .servers
            .iter()
            .flat_map(|s| server_addresses(s))
            .collect();
        opts.render.log_prefix = self.log_prefix.clone();
        opts.render.flow_logs = self.flow_logs;
        let max = usize::try_from(self.flow_max_connections).unwrap_or(usize::MAX);
        opts.flows = crate::flows::FlowSettings {
            max_connections: max,
            max_queued_records: max.saturating_mul(2),
            ..crate::flows::FlowSettings::default()
        };
        opts.masq_fully_random =
            crate::driver::linux::config::parse_feature_overrides(&self.feature_detect_override)
                .map_err(FlagError::FeatureDetectOverride)?;
        opts.manage_routes = !self.route_sync_disabled;
        opts.route_protocol = self.device_route_protocol;
        if matches!(opts.route_protocol, 1..=4) {
            return Err(FlagError::ReservedRouteProtocol(opts.route_protocol));
        }
        Ok(opts)
    }
}

/// The Felix settings that flags given explicitly (command line, environment or config file)
/// pin, so that the datastore's FelixConfiguration does not override them.
pub fn pinned_felix_settings(
    explicit_flags: &std::collections::BTreeSet<String>,
) -> std::collections::BTreeSet<String> {
    use crate::driver::linux::config as felix;
    [
        (
            "default-endpoint-to-host-action",
            felix::DEFAULT_ENDPOINT_TO_HOST_ACTION,
        ),
        ("interface-prefix", felix::INTERFACE_PREFIX),
        ("failsafe-inbound-host-ports", felix::FAILSAFE_INBOUND),
        ("failsafe-outbound-host-ports", felix::FAILSAFE_OUTBOUND),
        ("log-prefix", felix::LOG_PREFIX),
        ("feature-detect-override", felix::FEATURE_DETECT_OVERRIDE),
        ("flow-logs", felix::FLOW_LOGS_GOLDMANE_SERVER),
    ]
    .iter()
    .filter(|(flag, _)| explicit_flags.contains(*flag))
    .map(|(_, setting)| (*setting).to_owned())
    .collect()
}

/// Effective uid 0 on Linux (the owner of `/proc/self` is the effective uid).
fn running_as_root_on_linux() -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn help_shows_the_failsafe_defaults_and_the_server_exception() {
        use crate::driver::linux::rules::static_chains::{
            DEFAULT_FAILSAFES_IN, DEFAULT_FAILSAFES_OUT,
        };
        let help = Cli::command().render_long_help().to_string();
        assert!(
            help.contains(&format!("[default: {DEFAULT_FAILSAFES_IN}]")),
            "{help}"
        );
        assert!(
            help.contains(&format!("[default: {DEFAULT_FAILSAFES_OUT}]")),
            "{help}"
        );
        assert!(help.contains("--server are always"), "{help}");
        // The defaults parse to Felix's lists.
        assert_eq!(default_failsafes_in().len(), 9);
        assert_eq!(default_failsafes_out().len(), 9);
    }

    #[test]
    fn server_urls_give_the_addresses_the_failsafes_keep_open() {
        let addrs = |s: &str| {
            server_addresses(s)
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(addrs("http://10.0.0.5:50051"), vec!["10.0.0.5:50051"]);
        assert_eq!(addrs("10.0.0.5:50051"), vec!["10.0.0.5:50051"]);
        assert_eq!(addrs("https://10.0.0.5"), vec!["10.0.0.5:443"]);
        assert_eq!(addrs("http://[fd00::5]:7/path"), vec!["[fd00::5]:7"]);
        assert!(addrs("http://localhost:50051").contains(&"127.0.0.1:50051".to_owned()));
        assert!(addrs("http://no-such-host.invalid:1").is_empty());
    }

    #[test]
    fn issue_command_line_parses_with_defaults() {
        let cli = Cli::try_parse_from([
            "dataplane-agent",
            "--server",
            "http://a:50051,b:50051",
            "--server",
            "http://c:50051",
            "--node",
            "node-1",
            "--driver",
            "dry-run",
            "--state-file",
            "/tmp/state.json",
        ])
        .expect("parses");
        assert_eq!(cli.driver_kind(), DriverKind::DryRun);
        let linux = cli.linux_options().expect("defaults are valid");
        assert_eq!(linux.statics.workload_prefixes, vec!["cali"]);
        assert_eq!(linux.statics.failsafe_in.len(), 9);
        assert!(linux.ipv6);
        assert_eq!(cli.log_format, LogFormat::Plain);
        let config = cli.session_config().expect("valid");
        assert_eq!(
            config.servers,
            vec!["http://a:50051", "http://b:50051", "http://c:50051"]
        );
        assert_eq!(config.node_name, "node-1");
        assert_eq!(config.heartbeat_interval, Duration::from_secs(5));
        assert_eq!(config.reconnect_min_delay, Duration::from_millis(200));
        assert_eq!(config.reconnect_max_delay, Duration::from_secs(10));
        assert_eq!(config.snapshot_timeout, Duration::from_secs(300));
        assert_eq!(
            config.max_snapshot_bytes, None,
            "sized from the node's snapshots"
        );
        assert_eq!(config.watchdog_timeout, Duration::from_secs(90));
        assert!(config.capabilities.is_empty());
    }

    #[test]
    fn flags_given_explicitly_pin_their_felix_settings() {
        let args: Vec<std::ffi::OsString> = [
            "dataplane-agent",
            "--server",
            "a:1",
            "--node",
            "n",
            "--default-endpoint-to-host-action",
            "accept",
        ]
        .iter()
        .map(Into::into)
        .collect();
        let explicit = config_file::explicit_long_flags_from::<Cli>(
            &args,
            "--config-file",
            "DATAPLANE_AGENT_TEST_UNSET_CONFIG_FILE",
        );
        let pinned = pinned_felix_settings(&explicit);
        assert_eq!(
            pinned.into_iter().collect::<Vec<_>>(),
            vec!["DefaultEndpointToHostAction"],
            "only what was given is pinned; defaults stay open to the datastore"
        );
    }

    #[test]
    fn linux_flags_are_checked() {
        let parse = |extra: &[&str]| {
            let mut args = vec!["dataplane-agent", "--server", "a:1", "--node", "n"];
            args.extend_from_slice(extra);
            Cli::try_parse_from(args).expect("parses")
        };
        let cli = parse(&["--failsafe-inbound-host-ports", "tcp:22,udp:x"]);
        let err = cli.linux_options().unwrap_err().to_string();
        assert!(
            err.contains("--failsafe-inbound-host-ports") && err.contains("udp:x"),
            "{err}"
        );
        let cli = parse(&[
            "--failsafe-inbound-host-ports",
            "",
            "--ipv6-support",
            "false",
        ]);
        let opts = cli.linux_options().unwrap();
        assert!(opts.statics.failsafe_in.is_empty());
        assert!(!opts.ipv6);
        assert!(
            parse(&["--interface-prefix", "ca li"])
                .linux_options()
                .is_err()
        );
        let opts = parse(&["--feature-detect-override", "MASQFullyRandom=false"])
            .linux_options()
            .unwrap();
        assert_eq!(opts.masq_fully_random, Some(false));
        assert_eq!(parse(&[]).linux_options().unwrap().masq_fully_random, None);
        let err = parse(&["--feature-detect-override", "Turbo=true"])
            .linux_options()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--feature-detect-override") && err.contains("Turbo"),
            "{err}"
        );
        let cli = parse(&[
            "--interface-prefix",
            "cali,tap",
            "--iptables-backend",
            "legacy",
        ]);
        let opts = cli.linux_options().unwrap();
        assert_eq!(opts.statics.workload_prefixes, vec!["cali", "tap"]);
        assert_eq!(opts.backend, Backend::IptablesLegacy);
    }

    #[test]
    fn tls_flags_are_all_or_nothing() {
        let parse = |extra: &[&str]| {
            let mut args = vec!["dataplane-agent", "--server", "calc:50051", "--node", "n"];
            args.extend_from_slice(extra);
            Cli::try_parse_from(args).expect("parses")
        };
        let err = parse(&["--tls-server-cn", "calc"])
            .session_config()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--tls-ca-file") && err.contains("--tls-key-file"),
            "{err}"
        );
        let err = parse(&[
            "--tls-ca-file",
            "/ca",
            "--tls-cert-file",
            "/c",
            "--tls-key-file",
            "/k",
        ])
        .session_config()
        .unwrap_err()
        .to_string();
        assert!(err.contains("--tls-server-cn"), "{err}");
        // What is missing is listed item by item: "A or B" is one choice, not two flags.
        assert!(
            err.contains("missing: [--tls-server-cn or --tls-server-uri-san]")
                && err.contains("given: --tls-ca-file, --tls-cert-file, --tls-key-file"),
            "{err}"
        );
        // https:// without TLS settings is refused rather than tried in plaintext.
        let cli = Cli::try_parse_from([
            "dataplane-agent",
            "--server",
            "https://calc:50051",
            "--node",
            "n",
        ])
        .unwrap();
        assert!(matches!(
            cli.session_config(),
            Err(FlagError::HttpsWithoutTls(url)) if url == "https://calc:50051"
        ));
    }

    #[test]
    fn a_state_file_in_a_missing_directory_is_refused_at_start() {
        let cli = Cli::try_parse_from([
            "dataplane-agent",
            "--server",
            "calc:50051",
            "--node",
            "n",
            "--state-file",
            "/nonexistent-dir-xyz/node.json",
        ])
        .unwrap();
        let err = cli.session_config().unwrap_err().to_string();
        assert!(
            err.contains("/nonexistent-dir-xyz") && err.contains("does not exist"),
            "{err}"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.json");
        let cli = Cli::try_parse_from([
            "dataplane-agent",
            "--server",
            "calc:50051",
            "--node",
            "n",
            "--state-file",
            path.to_str().unwrap(),
        ])
        .unwrap();
        assert!(cli.session_config().is_ok());
    }

    #[test]
    fn a_server_without_a_port_is_refused() {
        for url in ["127.0.0.1", "http://calc-server", "https://calc.example"] {
            let err = crate::session::normalize_server_url(url).unwrap_err();
            assert!(
                matches!(&err, crate::session::UrlError::NoPort(_)),
                "{url}: {err}"
            );
            assert!(err.to_string().contains("port"), "{url}: {err}");
        }
        assert_eq!(
            crate::session::normalize_server_url("127.0.0.1:50051").unwrap(),
            "http://127.0.0.1:50051"
        );
    }

    #[test]
    fn snapshot_and_watchdog_limits() {
        let parse = |extra: &[&str]| {
            let mut args = vec!["dataplane-agent", "--server", "a:1", "--node", "n"];
            args.extend_from_slice(extra);
            Cli::try_parse_from(args)
        };
        let config = parse(&[
            "--snapshot-timeout",
            "2s",
            "--max-snapshot-bytes",
            "1048576",
            "--dataplane-watchdog-timeout",
            "500ms",
        ])
        .expect("parses")
        .session_config()
        .expect("valid");
        assert_eq!(config.snapshot_timeout, Duration::from_secs(2));
        assert_eq!(config.max_snapshot_bytes, Some(1024 * 1024));
        assert_eq!(config.watchdog_timeout, Duration::from_millis(500));
        assert!(
            parse(&["--max-snapshot-bytes", "1000"]).is_err(),
            "below 1 MiB"
        );
        let err = parse(&["--snapshot-timeout", "0s"])
            .expect("parses")
            .session_config()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "--snapshot-timeout must be greater than zero"
        );
        let err = parse(&["--dataplane-watchdog-timeout", "0"])
            .expect("parses")
            .session_config()
            .unwrap_err();
        assert!(
            matches!(err, FlagError::Zero("--dataplane-watchdog-timeout")),
            "{err}"
        );
        let help = Cli::command().render_long_help().to_string();
        for env in [
            "DATAPLANE_AGENT_SNAPSHOT_TIMEOUT",
            "DATAPLANE_AGENT_MAX_SNAPSHOT_BYTES",
            "DATAPLANE_AGENT_DATAPLANE_WATCHDOG_TIMEOUT",
        ] {
            assert!(help.contains(env), "{env} in --help");
        }
    }

    #[test]
    fn node_is_required_and_delays_are_checked() {
        assert!(Cli::try_parse_from(["dataplane-agent", "--server", "a:1"]).is_err());
        let cli = Cli::try_parse_from([
            "dataplane-agent",
            "--server",
            "a:1",
            "--node",
            "n",
            "--reconnect-min-delay",
            "20s",
        ])
        .expect("parses");
        assert!(cli.session_config().is_err());
    }
}
