//! The words a flow is shown in, shared by `calc-server flows` and the admin console: one
//! flow's cells (START SOURCE DEST PORT ACTION REPORTER PACKETS BYTES RULE) and one policy hit
//! of its trace, read from the proto3 JSON of a Goldmane `Flow` (what `/flows?format=goldmane`
//! answers). Pure: no IO.

use serde_json::Value;

/// A string field, or empty.
pub fn text(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

/// A count as proto3 JSON writes it (a string) or a number.
pub fn count(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => "0".into(),
    }
}

/// `namespace/name` (or the name alone), with its type when not a workload.
pub fn side(key: &Value, prefix: &str) -> String {
    let name = text(&key[format!("{prefix}_name")]);
    let ns = text(&key[format!("{prefix}_namespace")]);
    let ty = text(&key[format!("{prefix}_type")]);
    let base = if ns.is_empty() || ns == "-" {
        name.to_string()
    } else {
        format!("{ns}/{name}")
    };
    match ty {
        "WorkloadEndpoint" | "" => base,
        "HostEndpoint" => format!("hep:{base}"),
        "NetworkSet" => format!("netset:{base}"),
        _ => format!("net:{base}"),
    }
}

/// One hit of a trace: `TIER KIND NS/NAME rule N ACTION`; an end of tier names its trigger.
pub fn hit(h: &Value) -> String {
    let kind = text(&h["kind"]);
    let action = text(&h["action"]).to_lowercase();
    let tier = text(&h["tier"]);
    let named = |h: &Value| {
        let ns = text(&h["namespace"]);
        let name = text(&h["name"]);
        if ns.is_empty() || ns == "-" {
            name.to_string()
        } else {
            format!("{ns}/{name}")
        }
    };
    if kind == "EndOfTier" {
        let trigger = &h["trigger"];
        if trigger.is_object() {
            format!(
                "{tier} end-of-tier {action} (after {} {})",
                text(&trigger["kind"]),
                named(trigger)
            )
        } else {
            format!("{tier} end-of-tier {action}")
        }
    } else {
        format!(
            "{tier} {kind} {} rule {} {action}",
            named(h),
            count(&h["rule_index"])
        )
    }
}

/// One flow's cells: START SOURCE DEST PORT ACTION REPORTER PACKETS BYTES RULE.
pub fn row(f: &Value) -> Vec<String> {
    let key = &f["Key"];
    let enforced = key["policies"]["enforced_policies"].as_array();
    let start = count(&f["start_time"])
        .parse::<u64>()
        .map(|s| {
            common::time::rfc3339_utc(std::time::UNIX_EPOCH + std::time::Duration::from_secs(s))
        })
        .unwrap_or_default();
    vec![
        start,
        side(key, "source"),
        side(key, "dest"),
        format!("{}/{}", text(&key["proto"]), count(&key["dest_port"])),
        text(&key["action"]).to_lowercase(),
        match text(&key["reporter"]) {
            "Dst" => "dst".into(),
            "Src" => "src".into(),
            other => other.to_string(),
        },
        format!("{}/{}", count(&f["packets_in"]), count(&f["packets_out"])),
        format!("{}/{}", count(&f["bytes_in"]), count(&f["bytes_out"])),
        enforced
            .and_then(|e| e.last())
            .map_or_else(|| "-".to_string(), hit),
    ]
}
