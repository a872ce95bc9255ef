//! `calc-server explain`: why traffic is allowed or denied, what applies to an endpoint, where
//! a policy is in force — from a datastore snapshot (as `compute` reads it) or from a running
//! server's admin endpoint (`--server`, `GET /explain`). Both answer with the same
//! `calc_graph::explain` values; this module only reads the question, asks, and prints.
//! Exit codes: 0 with an answer (allow or deny alike), 2 for a question that cannot be answered
//! (unknown or ambiguous endpoint, bad port…) or an unreachable datastore or server.

use std::process::ExitCode;

use calc_graph::explain::{
    EndpointPolicies, Explanation, PolicyReach, Query, Request, render_endpoint_text,
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
                render_policy_text(&serde_json::from_value::<PolicyReach>(answer)?)
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
}
