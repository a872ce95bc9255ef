//! `calc-server explain`: why traffic is allowed or denied, what applies to an endpoint, where
//! a policy is in force — from a datastore snapshot (as `compute` reads it) or from a running
//! server's admin endpoint (`--server`, `GET /explain`). Both answer with the same
//! `calc_graph::explain` values; this module only reads the question, asks, and prints.
//! `--policy` text ends with each rule's hit counters: from a running server, read from its
//! `/status/policies/KIND:NAME` and shown per direction and index; offline, one line saying
//! where they come from (a datastore has none).
//! Exit codes: 0 with an answer (allow or deny alike), 2 for a question that cannot be answered
//! (unknown or ambiguous endpoint, bad port…) or an unreachable datastore or server.

use std::process::ExitCode;

use calc_graph::explain::{
    EndpointPolicies, Explanation, PolicyReach, Query, Request, RuleLine, render_endpoint_text,
    render_policy_text, render_text,
};
use calc_graph::graph::{CalcGraph, Update};

use crate::args::{ExplainArgs, ExplainOutput};
use crate::datastore;

fn request(args: &ExplainArgs) -> Request {
    if let Some(e) = &args.endpoint {
        return Request::Endpoint(e.clone());
    }
    if let Some(p) = &args.policy {
        return Request::Policy(p.clone());
    }
    Request::Path(Query {
        from: args.from.clone().unwrap_or_default(),
        to: args.to.clone().unwrap_or_default(),
        protocol: Some(args.protocol.clone()),
        port: args.port.clone(),
        source_port: args.source_port.clone(),
    })
}

fn path_of(r: &Request) -> String {
    let mut params: Vec<(&str, &str)> = Vec::new();
    match r {
        Request::Path(q) => {
            params.push(("from", &q.from));
            params.push(("to", &q.to));
            for (k, v) in [
                ("protocol", &q.protocol),
                ("port", &q.port),
                ("source_port", &q.source_port),
            ] {
                if let Some(v) = v {
                    params.push((k, v));
                }
            }
        }
        Request::Endpoint(e) => params.push(("endpoint", e)),
        Request::Policy(p) => params.push(("policy", p)),
    }
    let query: Vec<String> = params
        .iter()
        .map(|(k, v)| format!("{k}={}", crate::admin_client::url_escape(v)))
        .collect();
    format!("/explain?{}", query.join("&"))
}

fn ask_server(
    addr: &str,
    client: &crate::args::AdminClientArgs,
    r: &Request,
) -> anyhow::Result<serde_json::Value> {
    let (status, body) = crate::admin_client::fetch(addr, &path_of(r), client)?;
    // An answer that is not JSON is a message for a person (the gRPC port says which port to
    // use): shown as it is, without the JSON parser's complaint.
    let Ok(value) = serde_json::from_str::<serde_json::Value>(&body) else {
        anyhow::bail!("{addr} answered {status}: {}", body.trim());
    };
    if let Some(error) = value.get("error").and_then(|e| e.as_str()) {
        anyhow::bail!("{error}{}", crate::admin_client::refusal_hint(&status));
    }
    anyhow::ensure!(status.contains(" 200"), "{addr}: {status}");
    Ok(value)
}

/// Said once, offline, after the rules: a datastore holds no counters.
const OFFLINE_HITS: &str = "\nhits: only from a running server (--server)\n";

/// A policy's rules, each with its text and, from the server's `/status/policies/NAME` answer
/// (`status`; `None` offline), its hits (see [`crate::table::rule_hits`]; without the nodes,
/// which explain does not show). A rule the status does not list keeps its text alone.
fn hit_lines(reach: &PolicyReach, status: Option<&serde_json::Value>) -> String {
    let counted = |line: &RuleLine| {
        status
            .and_then(|s| s["rules"].as_array())
            .and_then(|rules| {
                rules.iter().find(|r| {
                    r["direction"] == serde_json::json!(line.direction)
                        && r["index"].as_u64() == Some(u64::from(line.index))
                })
            })
            .cloned()
    };
    let rules: Vec<serde_json::Value> = reach
        .rules
        .iter()
        .map(|line| {
            let mut row = counted(line).unwrap_or_else(|| {
                serde_json::json!({"direction": line.direction, "index": line.index,
                                   "action": line.action})
            });
            row["text"] = line.text.clone().into();
            row
        })
        .collect();
    let mut answer = serde_json::json!({ "rules": rules });
    match status {
        Some(status) if reach.rules.is_empty() => crate::table::rule_hits(status, false),
        Some(status) => {
            answer["phase"] = status["phase"].clone();
            crate::table::rule_hits(&answer, false)
        }
        None => crate::table::rule_hits(&answer, false),
    }
}

/// The rule lines of the policy `p` names with the hits of the server that answered the explain
/// question (asked by its kind and name, so that the same policy is counted); a server that
/// cannot say is noted in one line after the rules rather than failing the answer already given.
fn server_hits(addr: &str, client: &crate::args::AdminClientArgs, p: &PolicyReach) -> String {
    let path = format!(
        "/status/policies/{}",
        crate::admin_client::url_escape(&format!("{}:{}", p.kind, p.policy))
    );
    let answer = crate::admin_client::get(addr, &path, client).and_then(|body| {
        serde_json::from_str::<serde_json::Value>(&body).map_err(anyhow::Error::from)
    });
    match answer {
        Ok(status) => hit_lines(p, Some(&status)),
        Err(e) => format!("{}\nhits: unavailable ({e:#})\n", hit_lines(p, None)),
    }
}

/// The answer from a datastore snapshot, and the notes that go with it: where a running
/// server may answer otherwise (invalid objects left out whose last good versions it may hold).
fn ask_datastore(
    args: &ExplainArgs,
    r: &Request,
) -> anyhow::Result<(serde_json::Value, Vec<String>)> {
    let snap = datastore::snapshot(&args.datastore, &args.store)?;
    for p in &snap.problems {
        eprintln!("warning: skipped: {p}");
    }
    for h in &snap.held {
        eprintln!("note: {h}");
    }
    let mut g = CalcGraph::new();
    for u in snap.updates {
        if let Err(rejection) = g.apply(u) {
            eprintln!("warning: rejected: {rejection}");
        }
    }
    g.apply(Update::InSync)
        .map_err(|r| anyhow::anyhow!("{r}"))?;
    Ok((g.answer(r)?, snap.caveats))
}

pub fn run(args: &ExplainArgs) -> anyhow::Result<ExitCode> {
    let r = request(args);
    let (mut answer, notes) = match &args.server {
        Some(addr) => (ask_server(addr, &args.client, &r)?, Vec::new()),
        None => ask_datastore(args, &r)?,
    };
    let mut text = match args.output {
        ExplainOutput::Json => {
            if !notes.is_empty()
                && let Some(obj) = answer.as_object_mut()
            {
                obj.insert("notes".into(), notes.clone().into());
            }
            serde_json::to_string_pretty(&answer)? + "\n"
        }
        ExplainOutput::Text => match r {
            Request::Path(_) => render_text(&serde_json::from_value::<Explanation>(answer)?),
            Request::Endpoint(_) => {
                render_endpoint_text(&serde_json::from_value::<EndpointPolicies>(answer)?)
            }
            Request::Policy(_) => {
                let reach = serde_json::from_value::<PolicyReach>(answer)?;
                let hits = match &args.server {
                    Some(addr) => server_hits(addr, &args.client, &reach),
                    None => hit_lines(&reach, None) + OFFLINE_HITS,
                };
                render_policy_text(&reach) + &hits
            }
        },
    };
    if args.output == ExplainOutput::Text {
        for n in &notes {
            text.push_str(&format!("note: {n}\n"));
        }
    }
    print!("{text}");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use calc_graph::explain::Dir;

    #[test]
    fn queries_reach_the_admin_endpoint_escaped() {
        let r = Request::Path(Query {
            from: "prod/web".into(),
            to: "fd00::1".into(),
            protocol: Some("tcp".into()),
            port: Some("80".into()),
            source_port: None,
        });
        assert_eq!(
            path_of(&r),
            "/explain?from=prod/web&to=fd00::1&protocol=tcp&port=80"
        );
        assert_eq!(
            path_of(&Request::Policy("a b&c".into())),
            "/explain?policy=a%20b%26c"
        );
    }

    fn reach(rules: &[(Dir, u32, &str, &str)]) -> PolicyReach {
        PolicyReach {
            policy: "shop/allow-api-from-web".into(),
            kind: "NetworkPolicy".into(),
            tier: "default".into(),
            selector: "app == 'api'".into(),
            types: vec![Dir::Ingress, Dir::Egress],
            endpoints: vec![],
            nodes: vec![],
            rules: rules
                .iter()
                .map(|&(direction, index, action, text)| RuleLine {
                    direction,
                    index,
                    action: action.into(),
                    text: text.into(),
                })
                .collect(),
        }
    }

    /// One line per rule with its packets, bytes and last hit (`never`) beside its text,
    /// ingress then egress; a staged policy says it has no counters and still lists its
    /// rules; offline, the rules alone; an older server's answer adds nothing.
    #[test]
    fn a_policy_ends_with_its_rules_hits_beside_their_text() {
        let p = reach(&[
            (
                Dir::Ingress,
                0,
                "allow",
                r#"allow tcp from selector "app == 'web'""#,
            ),
            (Dir::Ingress, 1, "deny", "deny"),
            (Dir::Egress, 0, "pass", "pass"),
        ]);
        let status = serde_json::json!({
            "policy": "shop/allow-api-from-web", "phase": "Realized",
            "rules": [
                {"direction": "ingress", "index": 0, "action": "allow", "packets": 18342,
                 "bytes": 99000, "last_hit": "2026-11-24T10:04:10Z", "nodes": ["node-1"]},
                {"direction": "ingress", "index": 1, "action": "deny", "packets": 0,
                 "bytes": 0, "last_hit": null, "nodes": []},
                {"direction": "egress", "index": 0, "action": "pass", "packets": 0,
                 "bytes": 0, "last_hit": null, "nodes": []}]});
        assert_eq!(
            hit_lines(&p, Some(&status)),
            "
DIRECTION  RULE  ACTION  PACKETS  BYTES  LAST-HIT              TEXT
ingress       0  allow     18342  99000  2026-11-24T10:04:10Z  allow tcp from selector \"app == 'web'\"
ingress       1  deny          0      0  never                 deny
egress        0  pass          0      0  never                 pass
"
        );
        let staged = serde_json::json!({"phase": "Staged", "rules": [
            {"direction": "ingress", "index": 0, "action": "deny", "packets": null,
             "bytes": null, "last_hit": null, "nodes": []}]});
        let one = reach(&[(Dir::Ingress, 0, "deny", "deny udp")]);
        assert_eq!(
            hit_lines(&one, Some(&staged)),
            "
staged: not in the dataplane, no counters

DIRECTION  RULE  ACTION  TEXT
ingress       0  deny    deny udp
"
        );
        assert_eq!(
            hit_lines(&one, None) + OFFLINE_HITS,
            "
DIRECTION  RULE  ACTION  TEXT
ingress       0  deny    deny udp

hits: only from a running server (--server)
"
        );
        assert_eq!(
            hit_lines(
                &reach(&[]),
                Some(&serde_json::json!({"phase": "Realized", "rules": []}))
            ),
            "\nno rules\n"
        );
        assert_eq!(
            hit_lines(&reach(&[]), Some(&serde_json::json!({"phase": "Realized"}))),
            ""
        );
    }
}
