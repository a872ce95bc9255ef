//! `calc-server status --server ADDR`: asks a running server's admin endpoint for its nodes and
//! prints them as a table (or the raw JSON); with `--policies` / `--policy NAME`, where policies
//! are in force and what their rules matched; with `--verdicts`, what the dataplane's own
//! verdicts (a tier's end …) counted.
//!
//! The request itself (HTTP or HTTPS, client certificate, token) is `crate::admin_client`.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;

use crate::admin_client::{get, url_escape};
use crate::args::StatusArgs;
use crate::table::table;

/// One row per node of `/status` (see `serve::status::NodeStatus`).
fn rows(nodes: &[serde_json::Value]) -> Vec<Vec<String>> {
    nodes
        .iter()
        .map(|n| {
            let endpoints = || {
                n["workload_endpoints"]
                    .as_object()
                    .into_iter()
                    .chain(n["host_endpoints"].as_object())
                    .flat_map(|m| m.values())
            };
            let eps = endpoints().count();
            let up = endpoints().filter(|v| *v == "up").count();
            let connected = n["connected"].as_bool().unwrap_or_default();
            let since = n["connected_since"].as_str().unwrap_or_default();
            let state = match (connected, since.is_empty()) {
                (true, _) => "yes",
                (false, true) => "never",
                (false, false) => "no",
            };
            // What a disconnected node last reported is history, not its state: shown as such.
            let heartbeat = match (n["last_heartbeat_age_seconds"].as_u64(), connected) {
                (Some(s), true) => format!("{s}s ago"),
                (Some(s), false) => format!("{s}s ago (stale)"),
                (None, _) => "-".into(),
            };
            let dash = |s: &str| {
                if s.is_empty() {
                    "-".to_string()
                } else {
                    s.to_string()
                }
            };
            vec![
                n["node"].as_str().unwrap_or_default().to_string(),
                if n["in_datastore"].as_bool().unwrap_or(true) {
                    "yes".into()
                } else {
                    "no".into()
                },
                state.into(),
                dash(since),
                match (
                    connected,
                    n["dataplane_in_sync"].as_bool().unwrap_or_default(),
                ) {
                    (false, _) => "unknown".into(),
                    (true, true) => "yes".into(),
                    (true, false) => "no".into(),
                },
                heartbeat,
                n["messages_sent"].as_u64().unwrap_or_default().to_string(),
                n["last_sequence_received"]
                    .as_u64()
                    .unwrap_or_default()
                    .to_string(),
                match (connected, state) {
                    (true, _) => format!("{up}/{eps} up"),
                    (false, "never") => "-".into(),
                    (false, _) => format!("unknown (last {up}/{eps} up)"),
                },
                n["programmed"].as_str().unwrap_or("-").to_string(),
            ]
        })
        .collect()
}

const HEADER: [&str; 10] = [
    "NODE",
    "IN-DATASTORE",
    "CONNECTED",
    "SINCE",
    "IN-SYNC",
    "HEARTBEAT",
    "SENT",
    "LAST-SEQ",
    "ENDPOINTS",
    "PROGRAMMED",
];
const RIGHT: [bool; 10] = [
    false, false, false, false, false, true, true, true, false, false,
];

/// `/status/policies` as a table. HITS and LAST-HIT are `-` for a staged policy (no dataplane
/// programs it: the server answers `hits: null`) and for a server that does not count hits;
/// LAST-HIT is `never` for a policy nothing has hit yet.
fn policy_rows(rows: &[serde_json::Value]) -> Vec<Vec<String>> {
    rows.iter()
        .map(|r| {
            let text = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            let num = |k: &str| r[k].as_u64().unwrap_or_default().to_string();
            let tier = text("tier");
            let (hits, last_hit) = match r["hits"].as_u64() {
                Some(n) if r["phase"] != "Staged" => (
                    n.to_string(),
                    r["last_hit"].as_str().unwrap_or("never").to_string(),
                ),
                _ => ("-".to_string(), "-".to_string()),
            };
            vec![
                if r["kind"] == "Profile" {
                    format!("profile:{}", text("policy"))
                } else {
                    text("policy")
                },
                if tier.is_empty() { "-".into() } else { tier },
                num("desired"),
                num("realized"),
                num("failed"),
                text("phase"),
                text("kind"),
                hits,
                last_hit,
            ]
        })
        .collect()
}

const POLICY_HEADER: [&str; 9] = [
    "POLICY", "TIER", "DESIRED", "REALIZED", "FAILED", "PHASE", "KIND", "HITS", "LAST-HIT",
];
const POLICY_RIGHT: [bool; 9] = [false, false, true, true, true, false, false, true, false];

/// One policy: its line, then the nodes that lag, then its rules' hit counts.
fn policy_detail(r: &serde_json::Value) -> String {
    let mut out = table(
        &POLICY_HEADER,
        &policy_rows(std::slice::from_ref(r)),
        &POLICY_RIGHT,
    );
    let lagging = r["lagging"].as_array().cloned().unwrap_or_default();
    if lagging.is_empty() {
        out.push_str("\nno node lags\n");
    } else {
        out.push('\n');
        let rows: Vec<Vec<String>> = lagging
            .iter()
            .map(|l| {
                ["node", "state", "reason"]
                    .iter()
                    .map(|k| l[*k].as_str().unwrap_or_default().to_string())
                    .collect()
            })
            .collect();
        out.push_str(&table(
            &["NODE", "STATE", "REASON"],
            &rows,
            &[false, false, false],
        ));
    }
    out.push_str(&crate::table::rule_hits(r, true));
    out
}

const VERDICT_HEADER: [&str; 8] = [
    "VERDICT",
    "TIER",
    "DIRECTION",
    "ACTION",
    "PACKETS",
    "BYTES",
    "LAST-HIT",
    "NODES",
];
const VERDICT_RIGHT: [bool; 8] = [false, false, false, false, true, true, false, false];

/// `/status/verdicts` as a table: `-` for a verdict without a tier; a server that counted no
/// verdict says so instead of printing an empty table.
fn verdict_table(rows: &[serde_json::Value]) -> String {
    if rows.is_empty() {
        return "no verdict of the dataplane's own has counted a packet yet\n".into();
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let text = |k: &str| r[k].as_str().unwrap_or("-").to_string();
            let nodes: Vec<&str> = r["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(serde_json::Value::as_str)
                .collect();
            vec![
                text("verdict"),
                text("tier"),
                text("direction"),
                text("action"),
                r["packets"].as_u64().unwrap_or_default().to_string(),
                r["bytes"].as_u64().unwrap_or_default().to_string(),
                r["last_hit"].as_str().unwrap_or("never").to_string(),
                if nodes.is_empty() {
                    "-".into()
                } else {
                    nodes.join(",")
                },
            ]
        })
        .collect();
    table(&VERDICT_HEADER, &cells, &VERDICT_RIGHT)
}

/// `[NAMESPACE/]NAME`'s `/status/policies` path.
fn policy_path(name: &str) -> String {
    format!("/status/policies/{}", url_escape(name))
}

pub fn run(args: &StatusArgs) -> anyhow::Result<ExitCode> {
    let path = match (&args.policy, args.policies) {
        _ if args.verdicts => "/status/verdicts".to_string(),
        (Some(name), _) => policy_path(name),
        (None, true) => "/status/policies".to_string(),
        (None, false) => "/status".to_string(),
    };
    let body = get(&args.server, &path, &args.client)?;
    let mut out = std::io::stdout().lock();
    let text = if args.json {
        format!("{body}\n")
    } else if args.verdicts {
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&body).context("decoding /status/verdicts")?;
        verdict_table(&rows)
    } else if args.policy.is_some() {
        policy_detail(&serde_json::from_str(&body).context("decoding the policy's status")?)
    } else if args.policies {
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&body).context("decoding /status/policies")?;
        table(&POLICY_HEADER, &policy_rows(&rows), &POLICY_RIGHT)
    } else {
        let nodes: Vec<serde_json::Value> =
            serde_json::from_str(&body).context("decoding /status")?;
        table(&HEADER, &rows(&nodes), &RIGHT)
    };
    // `status | head` closes stdout early: not an error.
    match out.write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(ExitCode::SUCCESS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn verdicts_print_one_line_each() {
        let rows = [
            json!({"verdict": "end-of-tier", "tier": "security", "direction": "ingress",
                   "action": "deny", "packets": 1204, "bytes": 96320,
                   "last_hit": "2026-11-24T10:04:10Z", "nodes": ["node-1", "node-2"]}),
            json!({"verdict": "failsafe", "tier": null, "direction": "ingress",
                   "action": "allow", "packets": 3, "bytes": 180, "last_hit": null,
                   "nodes": []}),
        ];
        assert_eq!(
            verdict_table(&rows),
            "\
VERDICT      TIER      DIRECTION  ACTION  PACKETS  BYTES  LAST-HIT              NODES
end-of-tier  security  ingress    deny       1204  96320  2026-11-24T10:04:10Z  node-1,node-2
failsafe     -         ingress    allow         3    180  never                 -
"
        );
        assert_eq!(
            verdict_table(&[]),
            "no verdict of the dataplane's own has counted a packet yet\n"
        );
    }

    #[test]
    fn columns_line_up_whatever_the_widths() {
        let nodes = [
            json!({"node": "a-very-long-node-name.example.internal", "in_datastore": true, "connected": true,
                   "connected_since": "2026-11-24T10:00:00Z", "dataplane_in_sync": true,
                   "last_heartbeat_age_seconds": 3, "messages_sent": 123456, "last_sequence_received": 7,
                   "workload_endpoints": {"k8s/a/eth0": "up", "k8s/b/eth0": "down"}, "host_endpoints": {}}),
            json!({"node": "n2", "in_datastore": true, "connected": false, "connected_since": "",
                   "dataplane_in_sync": false, "messages_sent": 0, "last_sequence_received": 0,
                   "workload_endpoints": {}, "host_endpoints": {}}),
        ];
        let text = table(&HEADER, &rows(&nodes), &RIGHT);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        // Every column starts at the same offset on every line.
        for col in ["IN-DATASTORE", "CONNECTED", "SINCE", "IN-SYNC", "ENDPOINTS"] {
            let at = lines[0].find(col).unwrap();
            for l in &lines[1..] {
                assert!(
                    l.len() > at && l.as_bytes()[at - 1] == b' ' && l.as_bytes()[at] != b' ',
                    "column {col} misaligned:\n{text}"
                );
            }
        }
        // Right-aligned numbers end where their header ends.
        let end = lines[0].find("SENT").unwrap() + "SENT".len();
        assert_eq!(&lines[1][end - 6..end], "123456", "{text}");
        assert_eq!(&lines[2][end - 1..end], "0", "{text}");
        assert!(
            lines[1].contains("3s ago") && lines[1].contains("1/2 up"),
            "{text}"
        );
        assert!(
            lines[2].contains("never"),
            "a node that never connected says so:\n{text}"
        );
    }

    /// A node whose agent went away shows what it last reported as history, not as its state.
    #[test]
    fn a_disconnected_node_shows_its_last_report_as_stale() {
        let nodes = [
            json!({"node": "n1", "in_datastore": true, "connected": false,
               "connected_since": "2026-11-24T10:00:00Z", "dataplane_in_sync": true,
               "last_heartbeat_age_seconds": 300, "messages_sent": 9, "last_sequence_received": 7,
               "workload_endpoints": {"k8s/a/eth0": "up"}, "host_endpoints": {},
               "programmed": "no: not connected"}),
        ];
        let row = &rows(&nodes)[0];
        assert_eq!(row[2], "no");
        assert_eq!(row[4], "unknown", "IN-SYNC of a disconnected node");
        assert_eq!(row[5], "300s ago (stale)");
        assert_eq!(row[8], "unknown (last 1/1 up)");
    }

    /// HITS and LAST-HIT come after every other column: a count and its time, `never` when
    /// nothing hit, `-` for a staged policy (hits: null) or a server that counts no hits.
    #[test]
    fn the_policy_table_ends_with_hits_and_the_last_hit() {
        let rows = [
            json!({"policy": "shop/allow-api-from-web", "kind": "NetworkPolicy", "tier": "default",
                   "desired": 2, "realized": 2, "failed": 0, "phase": "Realized",
                   "hits": 1234, "bytes": 99000, "last_hit": "2026-11-24T10:00:00Z"}),
            json!({"policy": "block-threat-feed", "kind": "GlobalNetworkPolicy", "tier": "security",
                   "desired": 2, "realized": 1, "failed": 1, "phase": "Failed",
                   "hits": 0, "bytes": 0, "last_hit": null}),
            json!({"policy": "shop/web-http-only", "kind": "StagedNetworkPolicy", "tier": "default",
                   "desired": 1, "realized": 1, "failed": 0, "phase": "Staged",
                   "hits": null, "bytes": null, "last_hit": null}),
            json!({"policy": "kns.shop", "kind": "Profile", "tier": "",
                   "desired": 1, "realized": 1, "failed": 0, "phase": "Realized",
                   "hits": 7, "bytes": 700, "last_hit": "2026-11-24T09:59:00Z"}),
            // An older server: no hit fields at all.
            json!({"policy": "old", "kind": "GlobalNetworkPolicy", "tier": "default",
                   "desired": 1, "realized": 1, "failed": 0, "phase": "Realized"}),
        ];
        let text = table(&POLICY_HEADER, &policy_rows(&rows), &POLICY_RIGHT);
        assert_eq!(
            text,
            "\
POLICY                   TIER      DESIRED  REALIZED  FAILED  PHASE     KIND                 HITS  LAST-HIT
shop/allow-api-from-web  default         2         2       0  Realized  NetworkPolicy        1234  2026-11-24T10:00:00Z
block-threat-feed        security        2         1       1  Failed    GlobalNetworkPolicy     0  never
shop/web-http-only       default         1         1       0  Staged    StagedNetworkPolicy     -  -
profile:kns.shop         -               1         1       0  Realized  Profile                 7  2026-11-24T09:59:00Z
old                      default         1         1       0  Realized  GlobalNetworkPolicy     -  -
"
        );
        // One policy's detail starts with the same line.
        let one = policy_detail(&rows[1]);
        assert!(
            one.starts_with(
                "POLICY             TIER      DESIRED  REALIZED  FAILED  PHASE   KIND                 HITS  LAST-HIT\n\
                 block-threat-feed  security        2         1       1  Failed  GlobalNetworkPolicy     0  never\n"
            ),
            "{one}"
        );
    }

    /// After the policy's line and its lagging nodes, one line per rule: ingress then egress,
    /// with its action, counts, last hit (`never`) and nodes (`-`). A staged policy says it
    /// has no counters; an older server's answer (no `rules`) shows what it showed before.
    #[test]
    fn one_policy_ends_with_a_line_per_rule() {
        let mut r = json!({"policy": "shop/allow-api-from-web", "kind": "NetworkPolicy",
               "tier": "default", "desired": 2, "realized": 2, "failed": 0, "phase": "Realized",
               "hits": 1234, "bytes": 99000, "last_hit": "2026-11-24T10:00:00Z",
               "rules": [
                   {"direction": "ingress", "index": 0, "action": "allow", "packets": 1234,
                    "bytes": 99000, "last_hit": "2026-11-24T10:00:00Z",
                    "nodes": ["node-1", "node-2"]},
                   {"direction": "ingress", "index": 1, "action": "deny", "packets": 0,
                    "bytes": 0, "last_hit": null, "nodes": []},
                   {"direction": "egress", "index": 0, "action": "pass", "packets": 0,
                    "bytes": 0, "last_hit": null, "nodes": []}]});
        let text = policy_detail(&r);
        assert!(
            text.ends_with(
                "\n\nno node lags\n\n\
DIRECTION  RULE  ACTION  PACKETS  BYTES  LAST-HIT              NODES
ingress       0  allow      1234  99000  2026-11-24T10:00:00Z  node-1,node-2
ingress       1  deny          0      0  never                 -
egress        0  pass          0      0  never                 -
"
            ),
            "{text}"
        );
        r["rules"] = json!([]);
        assert!(policy_detail(&r).ends_with("no node lags\n\nno rules\n"));
        r.as_object_mut().unwrap().remove("rules");
        assert!(policy_detail(&r).ends_with("no node lags\n"));
        let staged = json!({"policy": "shop/web-http-only", "kind": "StagedNetworkPolicy",
               "tier": "default", "desired": 1, "realized": 1, "failed": 0, "phase": "Staged",
               "hits": null, "bytes": null, "last_hit": null,
               "rules": [{"direction": "ingress", "index": 0, "action": "deny", "packets": null,
                          "bytes": null, "last_hit": null, "nodes": []}]});
        assert!(
            policy_detail(&staged)
                .ends_with("no node lags\n\nstaged: not in the dataplane, no counters\n")
        );
    }
}
