//! Felix settings from the datastore (`FelixConfiguration`, sent by the calc-server as a
//! `ConfigUpdate`) applied on top of the agent's own flags, with Felix's precedence: a setting
//! given on the command line or in the environment wins; otherwise the datastore's value
//! (per-node over global, merged by the server); otherwise the built-in default.
//!
//! Pure: [`effective`] maps (base options, pinned settings, datastore map) to the options to
//! use plus a problem per value it could not take.

use std::collections::{BTreeMap, BTreeSet};

use super::LinuxOptions;
use super::rules::static_chains::EndpointToHostAction;
use super::validate;

/// Settings the datastore may set, by their Felix names.
pub(crate) const DEFAULT_ENDPOINT_TO_HOST_ACTION: &str = "DefaultEndpointToHostAction";
pub(crate) const INTERFACE_PREFIX: &str = "InterfacePrefix";
pub(crate) const FAILSAFE_INBOUND: &str = "FailsafeInboundHostPorts";
pub(crate) const FAILSAFE_OUTBOUND: &str = "FailsafeOutboundHostPorts";
pub(crate) const LOG_PREFIX: &str = "LogPrefix";
pub(crate) const FEATURE_DETECT_OVERRIDE: &str = "FeatureDetectOverride";
/// Felix renders its NFLOG rules when this names a Goldmane server; so does this agent when
/// it is non-empty (the flow records themselves are the calc-server's business).
pub(crate) const FLOW_LOGS_GOLDMANE_SERVER: &str = "FlowLogsGoldmaneServer";
pub(crate) use calico_names::felix_config::FEATURE_GATES;

/// The settings [`effective`] applies.
pub(crate) const APPLIED: &[&str] = &[
    DEFAULT_ENDPOINT_TO_HOST_ACTION,
    INTERFACE_PREFIX,
    FAILSAFE_INBOUND,
    FAILSAFE_OUTBOUND,
    LOG_PREFIX,
    FEATURE_DETECT_OVERRIDE,
    FEATURE_GATES,
    FLOW_LOGS_GOLDMANE_SERVER,
];

/// The datastore's settings this agent does not act on, each group sorted: those it has no use
/// for (Felix's BPF, logging, reporting settings …), those a flag pins, and those read at start
/// only. An operator who sets one expecting an effect should see it named.
pub(crate) fn not_applied<'a>(
    pinned: &BTreeSet<String>,
    datastore: &'a BTreeMap<String, String>,
) -> (Vec<&'a str>, Vec<&'a str>, Vec<&'a str>) {
    let (mut unused, mut by_flag, mut at_start) = (Vec::new(), Vec::new(), Vec::new());
    for key in datastore.keys().map(String::as_str) {
        if RESTART_ONLY.contains(&key) {
            at_start.push(key);
        } else if !APPLIED.contains(&key) {
            unused.push(key);
        } else if pinned.contains(key) {
            by_flag.push(key);
        }
    }
    (unused, by_flag, at_start)
}

/// Settings read at start only: a datastore value that differs is reported, not applied.
pub(crate) const RESTART_ONLY: &[&str] = &["IptablesBackend", "Ipv6Support", "DeviceRouteProtocol"];

/// The options to use, and the datastore values that were refused (named, with the reason).
pub(crate) fn effective(
    base: &LinuxOptions,
    pinned: &BTreeSet<String>,
    datastore: &BTreeMap<String, String>,
) -> (LinuxOptions, Vec<String>) {
    let mut out = base.clone();
    let mut problems = Vec::new();
    let take = |key: &str| -> Option<&String> {
        if pinned.contains(key) {
            None
        } else {
            datastore.get(key)
        }
    };
    if let Some(v) = take(DEFAULT_ENDPOINT_TO_HOST_ACTION) {
        match v.to_ascii_lowercase().as_str() {
            "drop" => out.statics.endpoint_to_host = EndpointToHostAction::Drop,
            "accept" => out.statics.endpoint_to_host = EndpointToHostAction::Accept,
            "return" => out.statics.endpoint_to_host = EndpointToHostAction::Return,
            _ => problems.push(format!(
                "FelixConfiguration {DEFAULT_ENDPOINT_TO_HOST_ACTION}={v:?}: expected Drop, Accept or Return"
            )),
        }
    }
    if let Some(v) = take(INTERFACE_PREFIX) {
        let prefixes: Vec<String> = v
            .split(',')
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.is_empty())
            .collect();
        match prefixes.iter().try_for_each(|p| validate::interface_prefix(p)) {
            Ok(()) if !prefixes.is_empty() => out.statics.workload_prefixes = prefixes,
            Ok(()) => problems.push(format!(
                "FelixConfiguration {INTERFACE_PREFIX}={v:?}: not a comma-separated list of interface name prefixes"
            )),
            Err(e) => problems.push(format!("FelixConfiguration {INTERFACE_PREFIX}={v:?}: {e}")),
        }
    }
    for (key, slot) in [
        (FAILSAFE_INBOUND, &mut out.statics.failsafe_in),
        (FAILSAFE_OUTBOUND, &mut out.statics.failsafe_out),
    ] {
        if let Some(v) = take(key) {
            match parse_failsafes(v) {
                Ok(list) => *slot = list,
                Err(e) => problems.push(format!("FelixConfiguration {key}={v:?}: {e}")),
            }
        }
    }
    if let Some(v) = take(FEATURE_DETECT_OVERRIDE) {
        match parse_feature_overrides(v) {
            Ok(masq) => out.masq_fully_random = masq,
            Err(e) => problems.push(format!(
                "FelixConfiguration {FEATURE_DETECT_OVERRIDE}={v:?}: {e}"
            )),
        }
    }
    if let Some(v) = take(FEATURE_GATES) {
        match calico_names::felix_config::hit_counters_enabled(Some(v)) {
            Ok(on) => out.hit_counters = on,
            Err(e) => problems.push(format!("FelixConfiguration {FEATURE_GATES}={v:?}: {e}")),
        }
    }
    if let Some(v) = take(FLOW_LOGS_GOLDMANE_SERVER) {
        out.render.flow_logs = !v.trim().is_empty();
    }
    if let Some(v) = take(LOG_PREFIX) {
        match validate::log_prefix(v) {
            Ok(()) => out.render.log_prefix = v.clone(),
            Err(e) => problems.push(format!("FelixConfiguration {LOG_PREFIX}: {e}")),
        }
    }
    (out, problems)
}

/// Felix's feature names; only `MASQFullyRandom` changes what this agent renders, the others
/// are accepted so that a FelixConfiguration written for Felix is not refused.
const FELIX_FEATURES: &[&str] = &[
    "MASQFullyRandom",
    "SNATFullyRandom",
    "RestoreSupportsLock",
    "ChecksumOffloadBroken",
    "IPIPDeviceIsL3",
    "KernelSideRouteFiltering",
];

/// `MASQFullyRandom=true,SNATFullyRandom=false,RestoreSupportsLock=` (Felix's form): the
/// `MASQFullyRandom` override, `None` when it is empty or absent (detected).
pub(crate) fn parse_feature_overrides(v: &str) -> Result<Option<bool>, String> {
    let mut masq = None;
    for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?} is not NAME=true|false|(empty)"))?;
        let Some(known) = FELIX_FEATURES
            .iter()
            .find(|f| f.eq_ignore_ascii_case(name.trim()))
        else {
            return Err(format!(
                "unknown feature {name:?} (known: {})",
                FELIX_FEATURES.join(", ")
            ));
        };
        let value = match value.trim().to_ascii_lowercase().as_str() {
            "" => None,
            "true" => Some(true),
            "false" => Some(false),
            other => return Err(format!("{name}={other:?}: expected true, false or nothing")),
        };
        if *known == "MASQFullyRandom" {
            masq = value;
        }
    }
    Ok(masq)
}

pub(crate) use calico_names::felix_config::parse_failsafes;

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn settings_not_applied_are_named_by_why() {
        let ds = map(&[
            ("BPFEnabled", "true"),
            ("LogSeverityScreen", "Debug"),
            (LOG_PREFIX, "x"),
            (INTERFACE_PREFIX, "cali"),
            ("IptablesBackend", "nft"),
        ]);
        let pinned: BTreeSet<String> = [LOG_PREFIX.to_owned()].into();
        let (unused, by_flag, at_start) = not_applied(&pinned, &ds);
        assert_eq!(unused, ["BPFEnabled", "LogSeverityScreen"]);
        assert_eq!(by_flag, [LOG_PREFIX]);
        assert_eq!(at_start, ["IptablesBackend"]);
    }

    #[test]
    fn datastore_values_apply_unless_pinned_by_a_flag() {
        let base = LinuxOptions::default();
        let ds = map(&[
            ("DefaultEndpointToHostAction", "Accept"),
            ("InterfacePrefix", "cali,tap"),
            (
                "FailsafeInboundHostPorts",
                r#"[{"protocol":"TCP","port":22},{"protocol":"UDP","port":68}]"#,
            ),
            ("FailsafeOutboundHostPorts", "none"),
            ("LogPrefix", "calico-drop"),
            (
                "FeatureDetectOverride",
                "SNATFullyRandom=true,MASQFullyRandom=false,RestoreSupportsLock=",
            ),
        ]);
        let (o, problems) = effective(&base, &BTreeSet::new(), &ds);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(o.masq_fully_random, Some(false));
        assert_eq!(o.statics.endpoint_to_host, EndpointToHostAction::Accept);
        assert_eq!(o.statics.workload_prefixes, vec!["cali", "tap"]);
        assert_eq!(o.statics.failsafe_in.len(), 2);
        assert_eq!(o.statics.failsafe_in[1].protocol, "udp");
        assert!(o.statics.failsafe_out.is_empty());
        assert_eq!(o.render.log_prefix, "calico-drop");

        // A flag (or env var) given by the operator wins over the datastore, as in Felix.
        let pinned: BTreeSet<String> = [DEFAULT_ENDPOINT_TO_HOST_ACTION.to_owned()].into();
        let (o, _) = effective(&base, &pinned, &ds);
        assert_eq!(o.statics.endpoint_to_host, EndpointToHostAction::Drop);
    }

    #[test]
    fn bad_values_are_refused_by_name_and_the_rest_still_applies() {
        let base = LinuxOptions::default();
        let ds = map(&[
            ("DefaultEndpointToHostAction", "Maybe"),
            ("FailsafeInboundHostPorts", "tcp:not-a-port"),
            ("InterfacePrefix", "tap"),
            ("FeatureDetectOverride", "MASQFullyRandom=yes"),
        ]);
        let (o, problems) = effective(&base, &BTreeSet::new(), &ds);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(
            problems[2].contains("MASQFullyRandom=\"yes\""),
            "{problems:?}"
        );
        assert_eq!(o.masq_fully_random, None);
        assert!(problems[0].contains("DefaultEndpointToHostAction=\"Maybe\""));
        assert_eq!(o.statics.endpoint_to_host, EndpointToHostAction::Drop);
        assert_eq!(o.statics.failsafe_in, base.statics.failsafe_in);
        assert_eq!(o.statics.workload_prefixes, vec!["tap"]);
    }

    #[test]
    fn feature_overrides_take_felix_names_and_refuse_unknown_ones() {
        assert_eq!(parse_feature_overrides(""), Ok(None));
        assert_eq!(parse_feature_overrides("MASQFullyRandom="), Ok(None));
        assert_eq!(
            parse_feature_overrides("masqfullyrandom=TRUE"),
            Ok(Some(true))
        );
        let e = parse_feature_overrides("MASQRandom=true").unwrap_err();
        assert!(e.contains("unknown feature \"MASQRandom\""), "{e}");
        assert!(parse_feature_overrides("MASQFullyRandom").is_err());
    }

    #[test]
    fn the_hit_counter_gate_comes_from_feature_gates() {
        let base = LinuxOptions::default();
        assert!(base.hit_counters);
        let ds = map(&[(
            "FeatureGates",
            "SomeFelixGate=on,PolicyHitCounters=Disabled",
        )]);
        let (o, problems) = effective(&base, &BTreeSet::new(), &ds);
        assert!(problems.is_empty(), "{problems:?}");
        assert!(!o.hit_counters);
        let ds = map(&[("FeatureGates", "PolicyHitCounters=sometimes")]);
        let (o, problems) = effective(&base, &BTreeSet::new(), &ds);
        assert!(o.hit_counters, "a bad value keeps the default");
        assert_eq!(
            problems,
            [
                "FelixConfiguration FeatureGates=\"PolicyHitCounters=sometimes\": PolicyHitCounters=\"sometimes\": expected Enabled or Disabled"
            ]
        );
    }
}
