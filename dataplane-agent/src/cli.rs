//! The command line: `dataplane-agent --server URL --node NAME --driver dry-run [--state-file PATH]`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::driver::DriverKind;
use crate::session::{SessionConfig, normalize_server_url};

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Plain,
    /// One JSON object per line.
    Json,
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
    /// "http://host:port".
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

    /// The dataplane driver.
    #[arg(
        long,
        env = "DATAPLANE_AGENT_DRIVER",
        value_enum,
        default_value = "dry-run"
    )]
    pub driver: DriverKind,

    /// dry-run driver: after each apply, write the whole desired state here as pretty JSON
    /// (atomically: temporary file in the same directory, then rename).
    #[arg(long, env = "DATAPLANE_AGENT_STATE_FILE", value_name = "PATH")]
    pub state_file: Option<PathBuf>,

    /// How often to send a ProcessStatusUpdate heartbeat (e.g. 5s, 500ms, 1m).
    #[arg(long, env = "DATAPLANE_AGENT_HEARTBEAT_INTERVAL", value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub heartbeat_interval: Duration,

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
}

impl Cli {
    /// Checks what clap cannot and builds the session configuration.
    pub fn session_config(&self) -> Result<SessionConfig, String> {
        let servers = self
            .servers
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(normalize_server_url)
            .collect::<Result<Vec<_>, _>>()?;
        if servers.is_empty() {
            return Err("--server: at least one calc-server URL is required".to_owned());
        }
        if self.node.trim().is_empty() {
            return Err("--node must not be empty".to_owned());
        }
        if self.heartbeat_interval.is_zero() {
            return Err("--heartbeat-interval must be greater than zero".to_owned());
        }
        if self.reconnect_min_delay > self.reconnect_max_delay {
            return Err(format!(
                "--reconnect-min-delay ({:?}) is larger than --reconnect-max-delay ({:?})",
                self.reconnect_min_delay, self.reconnect_max_delay
            ));
        }
        let mut config = SessionConfig::new(servers, self.node.trim());
        config.heartbeat_interval = self.heartbeat_interval;
        config.reconnect_min_delay = self.reconnect_min_delay;
        config.reconnect_max_delay = self.reconnect_max_delay;
        Ok(config)
    }
}

/// Parses `500ms`, `5s`, `1.5s`, `2m`, `1h`; a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 200ms, 5s, 1m)"))?;
    let scale = match unit.trim() {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (use ms, s, m or h)"
            ));
        }
    };
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("200ms"), Ok(Duration::from_millis(200)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("5 days").is_err());
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
        assert_eq!(cli.driver, DriverKind::DryRun);
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
        assert!(config.capabilities.is_empty());
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
