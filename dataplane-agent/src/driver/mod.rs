//! The seam between the session (which follows the calc-server's stream) and a dataplane.
//!
//! A driver is two-phase (architecture invariant 7): [`Driver::on_update`] records the desired
//! change and does no IO; [`Driver::apply`] does the work for everything recorded since the last
//! successful apply. The session guarantees the ordering described on [`Driver`]; the contract is
//! written out for driver authors in `docs/drivers.md`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use felix_proto::WorkloadEndpoint;

pub use crate::message::{HostEndpointKey, Message, WorkloadEndpointKey};

pub mod dry_run;
pub mod linux;
pub mod programmed;

pub use dry_run::DryRunDriver;
pub use linux::{LinuxDriver, LinuxOptions};
pub use programmed::ProgrammedObjects;

/// A dataplane the session can drive.
///
/// What the session guarantees (see `docs/drivers.md`):
///
/// * Messages are typed ([`Message`]): converted once from the stream, with their keys built and
///   their required parts present. A message the session could not convert never reaches a
///   driver (see `session.rs`).
/// * Messages reach `on_update` in the server's order, which keeps dependencies before users
///   (IP sets before the policies using them, policies and profiles before the endpoints using
///   them) and removals in the reverse order. No message names an IP set, policy or profile the
///   driver has not been given.
/// * An `*Update` carries the complete object and replaces what the driver had; a `*Remove` of
///   something the driver does not have is harmless and must be ignored.
/// * [`Message::InSync`] is passed through as well (a driver may ignore it). `ServerHello` is
///   not: it belongs to the session.
/// * `apply` is never called before the process saw its first `InSync`, and never while a
///   reconnect's snapshot is still arriving. After a reconnect, the session feeds the new snapshot
///   (updates replace) and at its `InSync` sends synthetic `*Remove`s for every object the new
///   snapshot did not contain (mark and sweep), endpoints first and IP sets last, then applies.
/// * Calls are sequential; a driver needs no locking of its own.
pub trait Driver: Send {
    /// Records the desired change. Cheap and without IO: an `*Update` replaces the object, a
    /// `*Remove` deletes it, an `IPSetDeltaUpdate` adds and removes members.
    fn on_update(&mut self, msg: &Message);

    /// Does the work for everything recorded since the last successful apply. On error the
    /// failed work must stay recorded (dirty): the session retries with back-off, and keeps
    /// calling `on_update` in between.
    fn apply(&mut self) -> Result<(), DriverError>;

    /// The oper status of every endpoint the driver knows ("up", "down" or "error"). The session
    /// diffs this against what it reported before and sends only the changes (everything again
    /// on a new stream).
    fn endpoint_statuses(&self) -> EndpointStatuses;

    /// The endpoint as programmed, sent along with its status update when available.
    fn workload_endpoint(&self, _id: &WorkloadEndpointKey) -> Option<WorkloadEndpoint> {
        None
    }

    /// How often the session should ask for a refresh (a read-back of the kernel that repairs
    /// out-of-band changes), if the driver wants one.
    fn refresh_interval(&self) -> Option<Duration> {
        None
    }

    /// Makes the next `apply` re-read and repair the dataplane, even with nothing pending.
    fn request_refresh(&mut self) {}

    /// Notified when the driver saw the dataplane change under it (an interface came, went or
    /// changed state): the session then calls `on_wakeup` and applies, once in sync.
    fn wakeup(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        None
    }

    /// Called before the apply that a wakeup triggers.
    fn on_wakeup(&mut self) {}

    /// What the driver has programmed, for `/metrics` (read after each apply). Counts a driver
    /// does not know stay `None` and are not exported.
    fn metrics(&self) -> DriverMetrics {
        DriverMetrics::default()
    }

    /// Whether this driver counts what its rules decide ([`Driver::collect_hits`]).
    fn counts_hits(&self) -> bool {
        false
    }

    /// The packets and bytes each rule of the stream (and each verdict of ours) decided since
    /// the previous call, only for rules whose counters moved. The first call after start only
    /// takes the kernel's counters as its baseline (what an earlier process already reported
    /// is not counted again) and returns nothing.
    fn collect_hits(&mut self) -> Result<Vec<felix_proto::RuleHits>, DriverError> {
        Ok(Vec::new())
    }

    /// Whether this driver can collect flow logs ([`Driver::collect_flows`]): it has an NFLOG
    /// and conntrack source. Whether flow logs are on is the driver's own setting (the flag or
    /// FelixConfiguration, which may change while a stream is up); while they are off,
    /// `collect_flows` returns nothing.
    fn collects_flows(&self) -> bool {
        false
    }

    /// The flow records of the 15-second intervals closed by `now` (Unix seconds), one
    /// `FlowReport` per interval, oldest first, with what the driver dropped since the previous
    /// call (see [`crate::flows`]). What is returned is forgotten by the driver: the session
    /// keeps the last interval's records to send again after a reconnect.
    fn collect_flows(&mut self, _now: i64) -> Result<Vec<felix_proto::FlowReport>, DriverError> {
        Ok(Vec::new())
    }

    /// What is programmed, by stream object, with Calico's chain names (the admin endpoint's
    /// `/programmed`; see [`programmed`]). Read after each successful apply, and only while
    /// that endpoint is served. `None`: the driver cannot say.
    fn programmed_objects(&self) -> Option<ProgrammedObjects> {
        None
    }
}

/// Sizes of the programmed dataplane, as a driver reports them for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverMetrics {
    /// iptables rules of ours, all tables and families.
    pub rules: Option<u64>,
    /// IP sets of ours.
    pub ipsets: Option<u64>,
    /// Members of those IP sets.
    pub ipset_members: Option<u64>,
    /// Routes of ours.
    pub routes: Option<u64>,
    /// Objects from the stream the driver refused to program as sent (failing closed).
    pub rejected: Option<u64>,
}

impl<D: Driver + ?Sized> Driver for Box<D> {
    fn on_update(&mut self, msg: &Message) {
        (**self).on_update(msg);
    }
    fn apply(&mut self) -> Result<(), DriverError> {
        (**self).apply()
    }
    fn endpoint_statuses(&self) -> EndpointStatuses {
        (**self).endpoint_statuses()
    }
    fn workload_endpoint(&self, id: &WorkloadEndpointKey) -> Option<WorkloadEndpoint> {
        (**self).workload_endpoint(id)
    }
    fn refresh_interval(&self) -> Option<Duration> {
        (**self).refresh_interval()
    }
    fn request_refresh(&mut self) {
        (**self).request_refresh();
    }
    fn wakeup(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        (**self).wakeup()
    }
    fn on_wakeup(&mut self) {
        (**self).on_wakeup();
    }
    fn metrics(&self) -> DriverMetrics {
        (**self).metrics()
    }
    fn programmed_objects(&self) -> Option<ProgrammedObjects> {
        (**self).programmed_objects()
    }
    fn counts_hits(&self) -> bool {
        (**self).counts_hits()
    }
    fn collect_hits(&mut self) -> Result<Vec<felix_proto::RuleHits>, DriverError> {
        (**self).collect_hits()
    }
    fn collects_flows(&self) -> bool {
        (**self).collects_flows()
    }
    fn collect_flows(&mut self, now: i64) -> Result<Vec<felix_proto::FlowReport>, DriverError> {
        (**self).collect_flows(now)
    }
}

/// Why an apply failed. The session logs it with its sources and retries with back-off.
///
/// The Linux driver's failures keep the error of the layer that failed as their typed
/// [`std::error::Error::source`], so a caller can tell a table the kernel refused from an IP
/// set restore or a netlink failure without parsing text.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Reading back or writing the iptables tables failed.
    #[error("iptables not programmed")]
    Tables(#[source] linux::iptables::TableApplyError),
    /// Creating, filling or destroying IP sets failed.
    #[error("IP sets not {stage}")]
    IpSets {
        /// "programmed" or "destroyed".
        stage: &'static str,
        #[source]
        source: linux::ipsets::IpSetError,
    },
    /// Programming routes failed.
    #[error("routes not programmed")]
    Routes(#[source] linux::routes::RouteError),
    /// Reading the kernel's rule counters failed (nothing was reported).
    #[error("rule counters not read")]
    Counters(#[source] linux::iptables::TableError),
    /// Reading the nftables rules' counters failed (nothing was reported).
    #[error("nftables rule counters not read")]
    NftCounters(#[source] linux::nft::NftError),
    /// Reading the flow-log events (NFLOG, conntrack) failed; the next read goes on.
    #[error("flow-log events not read")]
    Flows(#[source] std::io::Error),
    /// The nftables transaction (or the read-back before it) failed; nothing of it applied.
    #[error("nftables")]
    Nftables(#[source] linux::nft::NftError),
    /// The interface monitor or the netlink socket could not start.
    #[error("{what} could not start")]
    Netlink {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// Anything else, described.
    #[error("{0}")]
    Other(String),
}

/// Per-endpoint oper status, as a driver reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointStatuses {
    /// Workload endpoint -> "up" | "down" | "error".
    pub workloads: BTreeMap<WorkloadEndpointKey, String>,
    /// Host endpoint -> "up" | "down" | "error".
    pub hosts: BTreeMap<HostEndpointKey, String>,
}

/// The `--driver` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DriverKind {
    /// Records the desired state, logs every change, optionally writes it to `--state-file`.
    DryRun,
    /// Programs iptables, ipsets, routes, interface sysctls and endpoint status in Calico's
    /// layout (root).
    Linux,
    /// Programs the same policy as `linux` through nftables (`table ip calico` and
    /// `table ip6 calico`, native sets, verdict maps), and shares its routes, interface
    /// sysctls and endpoint status (root).
    Nftables,
}

impl DriverKind {
    /// The name used on the command line and in logs.
    pub fn name(self) -> &'static str {
        match self {
            DriverKind::DryRun => "dry-run",
            DriverKind::Linux => "linux",
            DriverKind::Nftables => "nftables",
        }
    }
}

/// What a driver needs to start.
#[derive(Clone, Debug, Default)]
pub struct DriverOptions {
    /// This node's name.
    pub node_name: String,
    /// Where the dry-run driver writes its state (JSON), if anywhere.
    pub state_file: Option<PathBuf>,
    /// Settings of the Linux driver.
    pub linux: LinuxOptions,
}

/// Builds the driver selected on the command line.
pub fn build(kind: DriverKind, options: &DriverOptions) -> anyhow::Result<Box<dyn Driver>> {
    match kind {
        DriverKind::DryRun => Ok(Box::new(DryRunDriver::new(
            options.node_name.clone(),
            options.state_file.clone(),
        ))),
        DriverKind::Linux | DriverKind::Nftables => {
            if !cfg!(target_os = "linux") {
                anyhow::bail!("--driver {} needs Linux; use --driver dry-run", kind.name());
            }
            let mut opts = options.linux.clone();
            opts.nftables = kind == DriverKind::Nftables;
            let flows = opts.flows;
            let mut d = LinuxDriver::new(opts, Box::new(linux::runner::SystemRunner));
            // Read only while flow logs are on (the flag or FelixConfiguration).
            d.set_flow_source(
                Box::new(linux::flow_source::KernelFlowSource::new(
                    flows.max_connections.saturating_mul(4),
                )),
                flows,
            );
            Ok(Box::new(d))
        }
    }
}
