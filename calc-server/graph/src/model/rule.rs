//! Policy rules as Calico's v3 API spells them (`Rule`, `EntityRule`, protocol, ports, ICMP).
//!
//! Decoding is lenient on purpose: a value of the right JSON shape but the wrong content (an
//! unknown protocol name, a port range `"90:80"`) still decodes, into an `Invalid` variant, so
//! that validation can report every problem of an object at once instead of the first one.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// One ingress or egress rule.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Rule {
    /// `Allow`, `Deny`, `Log` or `Pass` (checked by validation).
    pub action: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ip_version: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<Protocol>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icmp: Option<IcmpFields>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_protocol: Option<Protocol>,
    #[serde(rename = "notICMP", skip_serializing_if = "Option::is_none")]
    pub not_icmp: Option<IcmpFields>,
    #[serde(skip_serializing_if = "EntityRule::is_empty")]
    pub source: EntityRule,
    #[serde(skip_serializing_if = "EntityRule::is_empty")]
    pub destination: EntityRule,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpMatch>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<RuleMetadata>,
}

/// The parsed form of [`Rule::action`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Allow,
    Deny,
    Log,
    Pass,
}

impl Action {
    /// Calico's v3 validation is case-sensitive: only these four spellings are accepted.
    pub fn parse(s: &str) -> Option<Action> {
        match s {
            "Allow" => Some(Action::Allow),
            "Deny" => Some(Action::Deny),
            "Log" => Some(Action::Log),
            "Pass" => Some(Action::Pass),
            _ => None,
        }
    }

    /// The action string of the felixbackend `Rule` (Pass becomes `next-tier`).
    pub fn proto_name(self) -> &'static str {
        match self {
            Action::Allow => "allow",
            Action::Deny => "deny",
            Action::Log => "log",
            Action::Pass => "next-tier",
        }
    }
}

/// Source or destination of a rule.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EntityRule {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nets: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub selector: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace_selector: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub services: Option<ServiceMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<Port>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_nets: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub not_selector: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_ports: Vec<Port>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_accounts: Option<ServiceAccountMatch>,
}

impl EntityRule {
    pub fn is_empty(&self) -> bool {
        self == &EntityRule::default()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceAccountMatch {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub selector: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceMatch {
    pub name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpMatch {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<HttpPath>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpPath {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RuleMetadata {
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// ICMP match. Numbers are kept wide so out-of-range values reach validation.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct IcmpFields {
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub icmp_type: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<i64>,
}

/// Calico's `numorstring.Protocol`: a number or a name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    Number(i64),
    Name(String),
}

impl Protocol {
    /// The names v3 validation accepts (case-sensitive, as Calico's `protocolRegex`).
    pub const NAMES: [&'static str; 6] = ["TCP", "UDP", "ICMP", "ICMPv6", "SCTP", "UDPLite"];

    pub fn is_valid(&self) -> bool {
        match self {
            Protocol::Number(n) => (1..=255).contains(n),
            Protocol::Name(s) => Self::NAMES.contains(&s.as_str()),
        }
    }

    /// The IANA number, when known.
    pub fn number(&self) -> Option<u8> {
        match self {
            Protocol::Number(n) => u8::try_from(*n).ok(),
            Protocol::Name(s) => match s.to_ascii_lowercase().as_str() {
                "tcp" => Some(6),
                "udp" => Some(17),
                "icmp" => Some(1),
                "icmpv6" => Some(58),
                "sctp" => Some(132),
                "udplite" => Some(136),
                _ => None,
            },
        }
    }

    /// Whether port matches are meaningful (TCP, UDP, SCTP and UDPLite).
    pub fn supports_ports(&self) -> bool {
        matches!(self.number(), Some(6 | 17 | 132 | 136))
    }

    pub fn is_icmp(&self) -> bool {
        self.number() == Some(1)
    }

    pub fn is_icmpv6(&self) -> bool {
        self.number() == Some(58)
    }

    /// The lower-case v1/proto form (`tcp`, `icmpv6`, …); numbers stay numbers.
    pub fn lowercase_name(&self) -> Option<String> {
        match self {
            Protocol::Number(_) => None,
            Protocol::Name(s) => Some(s.to_ascii_lowercase()),
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Protocol::Number(n) => write!(f, "{n}"),
            Protocol::Name(s) => f.write_str(s),
        }
    }
}

impl Serialize for Protocol {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Protocol::Number(n) => s.serialize_i64(*n),
            Protocol::Name(n) => s.serialize_str(n),
        }
    }
}

impl<'de> Deserialize<'de> for Protocol {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Protocol;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a protocol name or number")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Protocol, E> {
                Ok(Protocol::Number(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Protocol, E> {
                Ok(Protocol::Number(i64::try_from(v).unwrap_or(i64::MAX)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Protocol, E> {
                Ok(Protocol::Name(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// Calico's `numorstring.Port`: a number, a `"min:max"` range or a named port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Port {
    /// A single port has `min == max`.
    Range {
        min: u16,
        max: u16,
    },
    Named(String),
    /// Kept verbatim so validation can name it.
    Invalid(String),
}

impl Port {
    pub fn single(p: u16) -> Port {
        Port::Range { min: p, max: p }
    }

    /// Parses the string form: `"80"`, `"80:90"` or a port name.
    pub fn parse(s: &str) -> Port {
        if let Some((a, b)) = s.split_once(':') {
            return match (a.parse::<u16>(), b.parse::<u16>()) {
                (Ok(min), Ok(max)) if min <= max => Port::Range { min, max },
                _ => Port::Invalid(s.to_string()),
            };
        }
        if let Ok(p) = s.parse::<u16>() {
            return Port::single(p);
        }
        if s.bytes().all(|b| b.is_ascii_digit()) {
            // All digits but not a u16: out of range, not a name.
            return Port::Invalid(s.to_string());
        }
        Port::Named(s.to_string())
    }
}

impl fmt::Display for Port {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Port::Range { min, max } if min == max => write!(f, "{min}"),
            Port::Range { min, max } => write!(f, "{min}:{max}"),
            Port::Named(s) | Port::Invalid(s) => f.write_str(s),
        }
    }
}

impl Serialize for Port {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Port::Range { min, max } if min == max => s.serialize_u16(*min),
            other => s.serialize_str(&other.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for Port {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Port;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a port number, a \"min:max\" range or a port name")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Port, E> {
                Ok(u16::try_from(v)
                    .map(Port::single)
                    .unwrap_or_else(|_| Port::Invalid(v.to_string())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Port, E> {
                Ok(u16::try_from(v)
                    .map(Port::single)
                    .unwrap_or_else(|_| Port::Invalid(v.to_string())))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Port, E> {
                Ok(Port::Invalid(v.to_string()))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Port, E> {
                Ok(Port::parse(v))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_decode_every_calico_form() {
        let ports: Vec<Port> =
            serde_json::from_str(r#"[80, "8080", "100:200", "http", "90:80", 70000, "99999"]"#)
                .unwrap();
        assert_eq!(
            ports,
            vec![
                Port::single(80),
                Port::single(8080),
                Port::Range { min: 100, max: 200 },
                Port::Named("http".into()),
                Port::Invalid("90:80".into()),
                Port::Invalid("70000".into()),
                Port::Invalid("99999".into()),
            ]
        );
        assert_eq!(serde_json::to_string(&ports[2]).unwrap(), r#""100:200""#);
        assert_eq!(serde_json::to_string(&ports[0]).unwrap(), "80");
    }

    #[test]
    fn protocols_know_their_numbers_and_ports() {
        let tcp = Protocol::Name("TCP".into());
        assert!(tcp.is_valid() && tcp.supports_ports());
        assert_eq!(tcp.lowercase_name().as_deref(), Some("tcp"));
        assert!(Protocol::Name("ICMPv6".into()).is_icmpv6());
        assert!(
            !Protocol::Name("tcp".into()).is_valid(),
            "v3 names are case-sensitive"
        );
        assert!(Protocol::Number(132).supports_ports());
        assert!(!Protocol::Number(0).is_valid());
        assert!(!Protocol::Number(1).supports_ports());
    }

    #[test]
    fn actions_are_case_sensitive() {
        assert_eq!(
            Action::parse("Pass").map(Action::proto_name),
            Some("next-tier")
        );
        assert_eq!(Action::parse("allow"), None);
    }
}
