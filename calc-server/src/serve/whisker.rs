//! The JSON forms Calico's Whisker backend serves over Goldmane (`GET /flows`,
//! `GET /flows-filter-hints`), so a client written for Whisker's backend reads ours unchanged.
//!
//! What is Whisker's, as its backend answers:
//! - a list is `{"total": {"totalPages": P, "totalResults": R}, "items": [...]}`; a watch is
//!   server-sent events, one `data: <item>` per flow;
//! - a flow is flat: `start_time`, `end_time` (RFC 3339), `action`, `source_name`,
//!   `source_namespace`, `source_labels` (the labels joined by ` | `), the same for `dest_`,
//!   `protocol`, `dest_port`, `reporter` (`Src`/`Dst`), `policies` (`enforced` and `pending`,
//!   each hit with `kind`, `name`, `namespace`, `tier`, `action`, `policy_index`,
//!   `rule_index` and `trigger`, `null` when none), `packets_in`, `packets_out`, `bytes_in`,
//!   `bytes_out`; enums by their Goldmane names;
//! - names `pub` and `pvt` are shown as `PUBLIC NETWORK` and `PRIVATE NETWORK`, and a hint's
//!   empty or `-` namespace as `Global`; filters take those forms back;
//! - parameters: `startTimeGte`, `startTimeLt`, `sortBy` (a Goldmane `SortBy` name, may
//!   repeat), `filters` (JSON: `source_names`, `source_namespaces`, `dest_names`,
//!   `dest_namespaces`, `protocols` as lists of `{"value", "type": "Exact"|"Fuzzy"}`,
//!   `dest_ports` as `{"value": N}`, `actions` as names, `policies` as
//!   `{"kind", "tier", "namespace", "name"` (each `{"value", "type"}`)`, "action"}`), and for
//!   hints `type` (a `FilterType` name without its prefix: `DestName`, …), `page`, `pageSize`.
//!
//! Our own snake_case parameters (`start_time_gte`, `action=deny`, `policy=KIND:NS/NAME`, …,
//! see `admin::flow_request`) are accepted beside them; `format=goldmane` answers Goldmane's
//! own proto3 JSON instead (`FlowListResult`, `FilterHintsResult`, `FlowResult` per event).
//! A filter key Whisker's backend does not pass to Goldmane is refused, naming it.

use serde_json::{Value, json};

use crate::flows::goldmane::{
    self, Action, Filter, FilterHintsResult, FilterType, Flow, FlowListResult, MatchType,
    PolicyHit, PolicyKind, PolicyMatch, PortMatch, Reporter, SortBy, SortOption, StringMatch,
};

const PUBLIC: &str = "PUBLIC NETWORK";
const PRIVATE: &str = "PRIVATE NETWORK";
const GLOBAL: &str = "Global";

/// The name Whisker shows for a flow's side.
fn shown_name(name: &str) -> &str {
    match name {
        "pub" => PUBLIC,
        "pvt" => PRIVATE,
        other => other,
    }
}

/// A name as Whisker's filter gives it, back to the flow's.
fn stored_name(name: String) -> String {
    match name.as_str() {
        PUBLIC => "pub".into(),
        PRIVATE => "pvt".into(),
        _ => name,
    }
}

fn stored_namespace(ns: String) -> String {
    if ns == GLOBAL { "-".into() } else { ns }
}

fn enum_name<E: TryFrom<i32>>(v: i32, name: impl Fn(E) -> &'static str) -> &'static str {
    E::try_from(v).map_or("", name)
}

fn action_name(v: i32) -> &'static str {
    enum_name(v, |a: Action| a.as_str_name())
}

fn hit(h: &PolicyHit) -> Value {
    json!({
        "kind": enum_name(h.kind, |k: PolicyKind| k.as_str_name()),
        "name": h.name,
        "namespace": h.namespace,
        "tier": h.tier,
        "action": action_name(h.action),
        "policy_index": h.policy_index,
        "rule_index": h.rule_index,
        "trigger": h.trigger.as_deref().map(hit),
    })
}

fn time(secs: i64) -> String {
    let t = u64::try_from(secs).unwrap_or(0);
    common::rfc3339_utc(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t))
}

/// One flow as Whisker's backend writes it.
pub(super) fn flow(f: &Flow) -> Value {
    let key = f.key.clone().unwrap_or_default();
    let trace = key.policies.clone().unwrap_or_default();
    json!({
        "start_time": time(f.start_time),
        "end_time": time(f.end_time),
        "action": action_name(key.action),
        "source_name": shown_name(&key.source_name),
        "source_namespace": key.source_namespace,
        "source_labels": f.source_labels.join(" | "),
        "dest_name": shown_name(&key.dest_name),
        "dest_namespace": key.dest_namespace,
        "dest_labels": f.dest_labels.join(" | "),
        "protocol": key.proto,
        "dest_port": key.dest_port,
        "reporter": enum_name(key.reporter, |r: Reporter| r.as_str_name()),
        "policies": {
            "enforced": trace.enforced_policies.iter().map(hit).collect::<Vec<_>>(),
            "pending": trace.pending_policies.iter().map(hit).collect::<Vec<_>>(),
        },
        "packets_in": f.packets_in,
        "packets_out": f.packets_out,
        "bytes_in": f.bytes_in,
        "bytes_out": f.bytes_out,
    })
}

fn total(meta: Option<&goldmane::ListMetadata>) -> Value {
    let meta = meta.cloned().unwrap_or_default();
    json!({"totalPages": meta.total_pages, "totalResults": meta.total_results})
}

/// A flow list as Whisker's backend answers it.
pub(super) fn flow_list(r: &FlowListResult) -> Value {
    json!({
        "total": total(r.meta.as_ref()),
        "items": r.flows.iter().filter_map(|f| f.flow.as_ref()).map(flow).collect::<Vec<_>>(),
    })
}

/// Filter hints as Whisker's backend answers them (names and namespaces as it shows them).
pub(super) fn hint_list(r: &FilterHintsResult, kind: i32) -> Value {
    let items: Vec<Value> = r
        .hints
        .iter()
        .map(|h| {
            let v = h.value.as_str();
            let shown = match FilterType::try_from(kind) {
                Ok(FilterType::SourceName | FilterType::DestName) => shown_name(v),
                Ok(FilterType::SourceNamespace | FilterType::DestNamespace)
                    if v.is_empty() || v == "-" =>
                {
                    GLOBAL
                }
                _ => v,
            };
            json!({"value": shown})
        })
        .collect();
    json!({"total": total(r.meta.as_ref()), "items": items})
}

/// A `sortBy` value: a Goldmane `SortBy` name.
pub(super) fn sort_option(v: &str) -> Result<SortOption, String> {
    SortBy::from_str_name(v)
        .map(|by| SortOption { sort_by: by as i32 })
        .ok_or_else(|| {
            format!(
                "parameter sortBy: unknown sort {:?} (Time, DestName, DestNamespace, DestType, SourceName, SourceNamespace or SourceType)",
                calc_graph::untrusted::Untrusted(v)
            )
        })
}

/// A hint `type` value: a Goldmane `FilterType` name without its `FilterType` prefix.
pub(super) fn filter_type(v: &str) -> Option<FilterType> {
    FilterType::from_str_name(&format!("FilterType{v}")).filter(|t| *t != FilterType::Unspecified)
}

fn field_err(field: &str, why: impl std::fmt::Display) -> String {
    format!("parameter filters: {field}: {why}")
}

fn matches(
    obj: &serde_json::Map<String, Value>,
    field: &str,
    conv: fn(String) -> String,
) -> Result<Vec<StringMatch>, String> {
    let Some(list) = obj.get(field) else {
        return Ok(Vec::new());
    };
    let list = list
        .as_array()
        .ok_or_else(|| field_err(field, "not a list"))?;
    list.iter()
        .map(|m| {
            string_match(m, field).map(|(v, t)| StringMatch {
                value: conv(v),
                r#type: t,
            })
        })
        .collect()
}

fn string_match(m: &Value, field: &str) -> Result<(String, i32), String> {
    let value = m["value"]
        .as_str()
        .ok_or_else(|| field_err(field, "each entry needs a string \"value\""))?
        .to_string();
    let kind = match m.get("type").and_then(Value::as_str) {
        None | Some("Exact") => MatchType::Exact,
        Some("Fuzzy") => MatchType::Fuzzy,
        Some(_) => return Err(field_err(field, "\"type\" is Exact or Fuzzy")),
    };
    Ok((value, kind as i32))
}

fn action(v: &Value, field: &str) -> Result<i32, String> {
    v.as_str()
        .and_then(Action::from_str_name)
        .filter(|a| *a != Action::Unspecified)
        .map(|a| a as i32)
        .ok_or_else(|| field_err(field, "an action is Allow, Deny or Pass"))
}

/// Reads Whisker's `filters` parameter (its JSON) into Goldmane's `Filter`.
pub(super) fn filters(text: &str) -> Result<Filter, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("parameter filters: {e}"))?;
    let obj = v
        .as_object()
        .ok_or("parameter filters: not a JSON object")?;
    const KNOWN: [&str; 8] = [
        "source_names",
        "source_namespaces",
        "dest_names",
        "dest_namespaces",
        "protocols",
        "dest_ports",
        "actions",
        "policies",
    ];
    if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(format!(
            "parameter filters: unknown filter {:?} (known: {})",
            calc_graph::untrusted::Untrusted(k),
            KNOWN.join(", ")
        ));
    }
    let list = |field: &str| -> Result<&[Value], String> {
        match obj.get(field) {
            None => Ok(&[]),
            Some(Value::Array(a)) => Ok(a),
            Some(_) => Err(field_err(field, "not a list")),
        }
    };
    let filter = Filter {
        source_names: matches(obj, "source_names", stored_name)?,
        source_namespaces: matches(obj, "source_namespaces", stored_namespace)?,
        dest_names: matches(obj, "dest_names", stored_name)?,
        dest_namespaces: matches(obj, "dest_namespaces", stored_namespace)?,
        protocols: matches(obj, "protocols", |s| s)?,
        dest_ports: list("dest_ports")?
            .iter()
            .map(|m| {
                m["value"]
                    .as_i64()
                    .or_else(|| m["value"].as_str().and_then(|s| s.parse().ok()))
                    .map(|port| PortMatch { port })
                    .ok_or_else(|| field_err("dest_ports", "each entry needs a numeric \"value\""))
            })
            .collect::<Result<_, _>>()?,
        actions: list("actions")?
            .iter()
            .map(|a| action(a, "actions"))
            .collect::<Result<_, _>>()?,
        policies: list("policies")?
            .iter()
            .map(policy_match)
            .collect::<Result<_, _>>()?,
    };
    Ok(filter)
}

fn policy_match(p: &Value) -> Result<PolicyMatch, String> {
    const FIELD: &str = "policies";
    let text = |k: &str| -> Result<String, String> {
        match p.get(k) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(m @ Value::Object(_)) => string_match(m, FIELD).map(|(v, _)| v),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(field_err(FIELD, format!("{k} is {{\"value\", \"type\"}}"))),
        }
    };
    let kind = match p.get("kind").and_then(Value::as_str) {
        None | Some("") => 0,
        Some(k) => PolicyKind::from_str_name(k)
            .map(|k| k as i32)
            .ok_or_else(|| field_err(FIELD, "unknown policy kind"))?,
    };
    let action = match p.get("action") {
        None | Some(Value::Null) => 0,
        Some(Value::String(s)) if s.is_empty() => 0,
        Some(a) => action(a, FIELD)?,
    };
    Ok(PolicyMatch {
        kind,
        tier: text("tier")?,
        namespace: stored_namespace(text("namespace")?),
        name: text("name")?,
        action,
    })
}

/// Appends `more` to `into`, list by list.
pub(super) fn merge(into: &mut Filter, more: Filter) {
    into.source_names.extend(more.source_names);
    into.source_namespaces.extend(more.source_namespaces);
    into.dest_names.extend(more.dest_names);
    into.dest_namespaces.extend(more.dest_namespaces);
    into.protocols.extend(more.protocols);
    into.dest_ports.extend(more.dest_ports);
    into.actions.extend(more.actions);
    into.policies.extend(more.policies);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flows::goldmane::{FlowKey, FlowResult, ListMetadata, PolicyTrace};

    #[test]
    fn a_flow_is_written_as_whiskers_backend_writes_it() {
        let eot = PolicyHit {
            kind: PolicyKind::EndOfTier as i32,
            tier: "security".into(),
            action: Action::Deny as i32,
            policy_index: 1,
            rule_index: -1,
            trigger: Some(Box::new(PolicyHit {
                kind: PolicyKind::GlobalNetworkPolicy as i32,
                name: "guard".into(),
                tier: "security".into(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let f = Flow {
            key: Some(FlowKey {
                source_name: "pub".into(),
                source_namespace: "-".into(),
                dest_name: "web-*".into(),
                dest_namespace: "shop".into(),
                dest_port: 443,
                proto: "tcp".into(),
                reporter: Reporter::Dst as i32,
                action: Action::Deny as i32,
                policies: Some(PolicyTrace {
                    enforced_policies: vec![eot],
                    pending_policies: vec![],
                }),
                ..Default::default()
            }),
            start_time: 1_800_000_000,
            end_time: 1_800_000_015,
            dest_labels: vec!["app=web".into(), "tier=front".into()],
            packets_in: 3,
            bytes_in: 180,
            ..Default::default()
        };
        let list = flow_list(&FlowListResult {
            meta: Some(ListMetadata {
                total_pages: 1,
                total_results: 1,
            }),
            flows: vec![FlowResult {
                id: 7,
                flow: Some(f),
            }],
        });
        assert_eq!(list["total"], json!({"totalPages": 1, "totalResults": 1}));
        let w = &list["items"][0];
        assert_eq!(w["start_time"], "2027-01-15T08:00:00Z");
        assert_eq!(w["end_time"], "2027-01-15T08:00:15Z");
        assert_eq!(w["action"], "Deny");
        assert_eq!(w["source_name"], "PUBLIC NETWORK");
        assert_eq!(w["source_namespace"], "-");
        assert_eq!(w["source_labels"], "");
        assert_eq!(w["dest_labels"], "app=web | tier=front");
        assert_eq!(w["dest_port"], 443);
        assert_eq!(w["protocol"], "tcp");
        assert_eq!(w["reporter"], "Dst");
        assert_eq!(w["packets_in"], 3);
        assert_eq!(w["bytes_in"], 180);
        let hit = &w["policies"]["enforced"][0];
        assert_eq!(hit["kind"], "EndOfTier");
        assert_eq!(hit["rule_index"], -1);
        assert_eq!(hit["trigger"]["name"], "guard");
        assert_eq!(hit["trigger"]["kind"], "GlobalNetworkPolicy");
        assert_eq!(hit["trigger"]["trigger"], Value::Null);
        assert_eq!(w["policies"]["pending"], json!([]));
    }

    #[test]
    fn whiskers_filters_become_goldmanes() {
        let f = filters(
            r#"{"source_names": [{"value": "PUBLIC NETWORK", "type": "Exact"}],
                "dest_namespaces": [{"value": "Global"}, {"value": "sh", "type": "Fuzzy"}],
                "dest_ports": [{"value": 443, "type": "Exact"}],
                "actions": ["Deny"],
                "policies": [{"kind": "GlobalNetworkPolicy", "tier": {"value": "security", "type": "Exact"},
                              "name": {"value": "guard", "type": "Exact"}, "action": "Deny"}]}"#,
        )
        .unwrap();
        assert_eq!(f.source_names[0].value, "pub");
        assert_eq!(f.dest_namespaces[0].value, "-");
        assert_eq!(f.dest_namespaces[1].r#type, MatchType::Fuzzy as i32);
        assert_eq!(f.dest_ports[0].port, 443);
        assert_eq!(f.actions, [Action::Deny as i32]);
        assert_eq!(
            (
                f.policies[0].kind,
                f.policies[0].tier.as_str(),
                f.policies[0].name.as_str(),
                f.policies[0].action
            ),
            (
                PolicyKind::GlobalNetworkPolicy as i32,
                "security",
                "guard",
                Action::Deny as i32
            )
        );
        for (bad, says) in [
            ("[]", "not a JSON object"),
            (r#"{"reporter": []}"#, "unknown filter \"reporter\""),
            (r#"{"actions": ["Drop"]}"#, "Allow, Deny or Pass"),
            (r#"{"dest_names": [{"value": 1}]}"#, "string \"value\""),
            (
                r#"{"dest_names": [{"value": "a", "type": "Regex"}]}"#,
                "Exact or Fuzzy",
            ),
            (r#"{"policies": [{"kind": "Nope"}]}"#, "unknown policy kind"),
            ("{", "parameter filters"),
        ] {
            let e = filters(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert_eq!(
            sort_option("DestName").unwrap().sort_by,
            SortBy::DestName as i32
        );
        assert!(sort_option("dest").is_err());
        assert_eq!(
            filter_type("DestNamespace"),
            Some(FilterType::DestNamespace)
        );
        assert_eq!(filter_type("Unspecified"), None);
        assert_eq!(filter_type("Pods"), None);
    }

    #[test]
    fn hints_show_whiskers_names() {
        let r = FilterHintsResult {
            meta: Some(ListMetadata {
                total_pages: 1,
                total_results: 3,
            }),
            hints: ["-", "pvt", "shop"]
                .into_iter()
                .map(|v| goldmane::FilterHint { value: v.into() })
                .collect(),
        };
        let ns = hint_list(&r, FilterType::SourceNamespace as i32);
        assert_eq!(
            ns["items"],
            json!([{"value": "Global"}, {"value": "pvt"}, {"value": "shop"}])
        );
        let names = hint_list(&r, FilterType::DestName as i32);
        assert_eq!(names["items"][1]["value"], "PRIVATE NETWORK");
        assert_eq!(names["total"]["totalResults"], 3);
    }
}
