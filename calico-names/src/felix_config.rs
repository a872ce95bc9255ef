//! FelixConfiguration values both ends read the same way: the agent programs them, and
//! calc-server's explain reasons about what the agent programmed.
//!
//! Contract: pure parsing; an invalid value is an `Err` naming the entry, never a partial list
//! (the agent then keeps what it had, so a reader must not guess from half a value).

/// A protocol and port that stays open whatever the host endpoint policy says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failsafe {
    /// `tcp`, `udp` or `sctp`.
    pub protocol: String,
    pub port: u16,
}

impl std::str::FromStr for Failsafe {
    type Err = String;
    /// `tcp:22` or `udp:68`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (p, port) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?}: expected <tcp|udp|sctp>:<port>"))?;
        let p = p.to_ascii_lowercase();
        if !matches!(p.as_str(), "tcp" | "udp" | "sctp") {
            return Err(format!("{s:?}: protocol must be tcp, udp or sctp"));
        }
        let port = port
            .parse()
            .map_err(|_| format!("{s:?}: {port:?} is not a port number"))?;
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
pub fn parse_failsafes(v: &str) -> Result<Vec<Failsafe>, String> {
    let t = v.trim();
    if t.is_empty() || t.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    if t.starts_with('[') {
        let items: Vec<serde_json::Value> =
            serde_json::from_str(t).map_err(|e| format!("not a JSON list: {e}"))?;
        return items
            .iter()
            .map(|i| {
                let proto = i["protocol"].as_str().unwrap_or("tcp");
                let port = i["port"]
                    .as_u64()
                    .ok_or_else(|| format!("entry {i} has no numeric port"))?;
                format!("{proto}:{port}").parse()
            })
            .collect();
    }
    t.split(',').map(|s| s.trim().parse()).collect()
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
        assert!(parse_failsafes("tcp:22,icmp:1").is_err());
        assert!(parse_failsafes("tcp:22,tcp:70000").is_err());
        assert_eq!(default_failsafes_in().len(), 9);
        assert_eq!(
            default_failsafes_out()[0],
            Failsafe {
                protocol: "udp".into(),
                port: 53
            }
        );
    }
}
