//! FelixConfiguration values both ends read the same way: the agent programs them, and
//! calc-server's explain reasons about what the agent programmed (and its hit counters about
//! which nodes count).
//!
//! Contract: pure parsing; an invalid value is a [`FailsafeError`] naming the entry, never a
//! partial list (the agent then keeps what it had, so a reader must not guess from half a value).

/// A protocol and port that stays open whatever the host endpoint policy says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failsafe {
    /// `tcp`, `udp` or `sctp`.
    pub protocol: String,
    pub port: u16,
}

/// Why a failsafe value is refused, naming the entry.
#[derive(Debug, thiserror::Error)]
pub enum FailsafeError {
    #[error("{0:?}: expected <tcp|udp|sctp>:<port>")]
    NotProtocolAndPort(String),
    #[error("{0:?}: protocol must be tcp, udp or sctp")]
    Protocol(String),
    #[error("{entry:?}: {port:?} is not a port number")]
    Port { entry: String, port: String },
    #[error("not a JSON list: {0}")]
    NotAJsonList(serde_json::Error),
    #[error("entry {0} has no numeric port")]
    NoNumericPort(serde_json::Value),
}

impl std::str::FromStr for Failsafe {
    type Err = FailsafeError;
    /// `tcp:22` or `udp:68`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (p, port) = s
            .split_once(':')
            .ok_or_else(|| FailsafeError::NotProtocolAndPort(s.to_owned()))?;
        let p = p.to_ascii_lowercase();
        if !matches!(p.as_str(), "tcp" | "udp" | "sctp") {
            return Err(FailsafeError::Protocol(s.to_owned()));
        }
        let port = port.parse().map_err(|_| FailsafeError::Port {
            entry: s.to_owned(),
            port: port.to_owned(),
        })?;
        Ok(Self { protocol: p, port })
    }
}

/// Felix's default FailsafeInboundHostPorts (also the agent flag's default, shown by `--help`).
pub const DEFAULT_FAILSAFES_IN: &str =
    "tcp:22,udp:68,tcp:179,tcp:2379,tcp:2380,tcp:5473,tcp:6443,tcp:6666,tcp:6667";
/// Felix's default FailsafeOutboundHostPorts.
pub const DEFAULT_FAILSAFES_OUT: &str =
    "udp:53,udp:67,tcp:179,tcp:2379,tcp:2380,tcp:5473,tcp:6443,tcp:6666,tcp:6667";

pub fn default_failsafes_in() -> Vec<Failsafe> {
    parse_failsafes(DEFAULT_FAILSAFES_IN).unwrap_or_default()
}

pub fn default_failsafes_out() -> Vec<Failsafe> {
    parse_failsafes(DEFAULT_FAILSAFES_OUT).unwrap_or_default()
}

/// `[{"protocol":"TCP","port":22}, …]` (the v3 resource) or `tcp:22,udp:68` (Felix's env form);
/// `none` or an empty list for none.
pub fn parse_failsafes(v: &str) -> Result<Vec<Failsafe>, FailsafeError> {
    let t = v.trim();
    if t.is_empty() || t.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    if t.starts_with('[') {
        let items: Vec<serde_json::Value> =
            serde_json::from_str(t).map_err(FailsafeError::NotAJsonList)?;
        return items
            .iter()
            .map(|i| {
                let proto = i["protocol"].as_str().unwrap_or("tcp");
                let port = i["port"]
                    .as_u64()
                    .ok_or_else(|| FailsafeError::NoNumericPort(i.clone()))?;
                format!("{proto}:{port}").parse()
            })
            .collect();
    }
    t.split(',').map(|s| s.trim().parse()).collect()
}

/// The FelixConfiguration setting that carries feature gates (`Name=value,Name=value`).
pub const FEATURE_GATES: &str = "FeatureGates";

/// Our gate in [`FEATURE_GATES`]: `PolicyHitCounters=Disabled` turns the reading of rule hit
/// counters off (per node with a `node.<name>` FelixConfiguration). It lives in FeatureGates,
/// a free-form field of Calico's own schema, so that a Kubernetes API server that prunes
/// unknown fields from Calico's CRDs keeps it.
pub const POLICY_HIT_COUNTERS: &str = "PolicyHitCounters";

/// Why a feature gate's value is refused.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    #[error("{0:?} is not Name=value")]
    NotNameValue(String),
    #[error("{name}={value:?}: expected Enabled or Disabled")]
    Value { name: String, value: String },
}

/// Whether rule hit counters are read under `gates` (the FeatureGates value; absent: on).
/// Gate names and values are case-insensitive; `true`/`false` are taken too; other gates are
/// Felix's and are left alone (Felix ignores gates it does not know, and so do we).
pub fn hit_counters_enabled(gates: Option<&str>) -> Result<bool, GateError> {
    let mut enabled = true;
    for item in gates
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
    {
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| GateError::NotNameValue(item.to_owned()))?;
        if !name.trim().eq_ignore_ascii_case(POLICY_HIT_COUNTERS) {
            continue;
        }
        enabled = match value.trim().to_ascii_lowercase().as_str() {
            "enabled" | "true" => true,
            "disabled" | "false" => false,
            _ => {
                return Err(GateError::Value {
                    name: POLICY_HIT_COUNTERS.to_owned(),
                    value: value.trim().to_owned(),
                });
            }
        };
    }
    Ok(enabled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_parse_and_a_bad_entry_spoils_the_whole_value() {
        let env = parse_failsafes("tcp:22, UDP:68").unwrap();
        let json =
            parse_failsafes(r#"[{"protocol":"TCP","port":22},{"protocol":"UDP","port":68}]"#)
                .unwrap();
        assert_eq!(env, json);
        assert_eq!(
            env[1],
            Failsafe {
                protocol: "udp".into(),
                port: 68
            }
        );
        assert!(parse_failsafes("none").unwrap().is_empty());
        assert_eq!(
            parse_failsafes("tcp:22,icmp:1").unwrap_err().to_string(),
            "\"icmp:1\": protocol must be tcp, udp or sctp"
        );
        assert_eq!(
            parse_failsafes("tcp:22,tcp:70000").unwrap_err().to_string(),
            "\"tcp:70000\": \"70000\" is not a port number"
        );
        assert_eq!(
            parse_failsafes(r#"[{"protocol":"TCP"}]"#)
                .unwrap_err()
                .to_string(),
            r#"entry {"protocol":"TCP"} has no numeric port"#
        );
        assert_eq!(default_failsafes_in().len(), 9);
        assert_eq!(
            default_failsafes_out()[0],
            Failsafe {
                protocol: "udp".into(),
                port: 53
            }
        );
    }

    #[test]
    fn the_hit_counter_gate_is_on_unless_disabled() {
        assert!(hit_counters_enabled(None).unwrap());
        assert!(hit_counters_enabled(Some("")).unwrap());
        assert!(
            hit_counters_enabled(Some("BPFConnectTimeLoadBalancingWorkaround=enabled")).unwrap()
        );
        assert!(!hit_counters_enabled(Some("Foo=x, policyhitcounters=Disabled")).unwrap());
        assert!(!hit_counters_enabled(Some("PolicyHitCounters=false")).unwrap());
        assert!(hit_counters_enabled(Some("PolicyHitCounters=Enabled")).unwrap());
        assert_eq!(
            hit_counters_enabled(Some("PolicyHitCounters=off"))
                .unwrap_err()
                .to_string(),
            "PolicyHitCounters=\"off\": expected Enabled or Disabled"
        );
        assert_eq!(
            hit_counters_enabled(Some("PolicyHitCounters"))
                .unwrap_err()
                .to_string(),
            "\"PolicyHitCounters\" is not Name=value"
        );
    }
}
