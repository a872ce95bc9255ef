//! `calc-server flows --server ADMIN [--since 10m] [--action allow|deny] [--namespace NS]
//! [--name NAME] [--policy [KIND:][NS/]NAME] [--port N] [--output text|json] [--trace]`: asks a
//! running server's admin endpoint (`/flows`) for the flows it aggregated and prints one line
//! per flow (both sides, port, action, packets and bytes, the deciding rule), or one JSON
//! object per flow in the proto3 JSON mapping of Goldmane's `Flow`.
//!
//! The window, action, port and policy go to the server as `/flows` parameters; `--namespace`
//! and `--name` select a flow when either side has them, so they are applied here (Goldmane's
//! filter has a list per side, combined with "and").

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use serde_json::Value;

use crate::admin_client::{get, query_escape};
use crate::args::{FlowsArgs, FlowsOutput};
use crate::flows::words::{count, hit, row, text};
use crate::table::table;

const HEADER: [&str; 9] = [
    "START", "SOURCE", "DEST", "PORT", "ACTION", "REPORTER", "PACKETS", "BYTES", "RULE",
];
const RIGHT: [bool; 9] = [false, false, false, true, false, false, true, true, false];

/// The `/flows` path for the arguments.
pub(crate) fn path(args: &FlowsArgs) -> String {
    let mut q = vec!["format=goldmane".to_string()];
    if args.follow {
        q.push("aggregation_interval=15".to_string());
    }
    if let Some(since) = args.since {
        let secs = since.as_secs() + u64::from(since.subsec_nanos() > 0);
        q.push(format!("start_time_gte=-{secs}"));
    }
    if let Some(a) = &args.action {
        q.push(format!("action={}", a.as_str()));
    }
    if let Some(p) = args.port {
        q.push(format!("dest_port={p}"));
    }
    if let Some(p) = &args.policy {
        q.push(format!("policy={}", query_escape(p)));
    }
    format!("/flows?{}", q.join("&"))
}

fn flow_matches(flow: &Value, args: &FlowsArgs) -> bool {
    let key = &flow["Key"];
    let either = |field: &str, want: &str| {
        text(&key[format!("source_{field}")]) == want || text(&key[format!("dest_{field}")]) == want
    };
    args.namespace
        .as_deref()
        .is_none_or(|ns| either("namespace", ns))
        && args.name.as_deref().is_none_or(|n| either("name", n))
}

/// The rows (and, with `trace`, the traces under each) of a `/flows` answer.
pub(crate) fn render(answer: &Value, args: &FlowsArgs) -> String {
    let flows: Vec<&Value> = answer["flows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| &r["flow"])
        .filter(|f| flow_matches(f, args))
        .collect();
    if !args.trace {
        let rows: Vec<Vec<String>> = flows.iter().map(|f| row(f)).collect();
        return table(&HEADER, &rows, &RIGHT);
    }
    flows.into_iter().map(traced).collect()
}

/// A flow's line followed by its enforced and pending traces.
fn traced(f: &Value) -> String {
    let mut out = row(f).join("  ");
    out.push('\n');
    for (label, field) in [
        ("enforced", "enforced_policies"),
        ("pending", "pending_policies"),
    ] {
        let hits = f["Key"]["policies"][field]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if hits.is_empty() {
            out.push_str(&format!("  {label}: -\n"));
        }
        for (i, h) in hits.iter().enumerate() {
            out.push_str(&format!("  {label} {i}: {}\n", hit(h)));
        }
    }
    out
}

/// With `--follow`: the flows of `answer` (per 15 s interval) not printed yet whose interval
/// closed at least 15 s before `now` (agents send an interval once it closes), oldest first;
/// each is remembered in `printed` (by flow id and start) and printed once.
pub(crate) fn fresh<'a>(
    answer: &'a Value,
    args: &FlowsArgs,
    printed: &mut std::collections::HashSet<(String, String)>,
    now: i64,
) -> Vec<&'a Value> {
    let mut out: Vec<&Value> = answer["flows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| flow_matches(&r["flow"], args))
        .filter(|r| {
            count(&r["flow"]["start_time"])
                .parse::<i64>()
                .is_ok_and(|s| s + 30 <= now)
        })
        .filter(|r| printed.insert((count(&r["id"]), count(&r["flow"]["start_time"]))))
        .map(|r| &r["flow"])
        .collect();
    out.sort_by_key(|f| count(&f["start_time"]).parse::<i64>().unwrap_or(0));
    out
}

fn write(text: &str) -> anyhow::Result<bool> {
    // `flows | head` closes stdout early: not an error, but the end.
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
        Ok(()) => Ok(true),
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// `--follow`: polls every 5 s and prints each interval's flows once, as they close.
fn follow(args: &FlowsArgs) -> anyhow::Result<ExitCode> {
    let mut printed = std::collections::HashSet::new();
    let path = path(args);
    loop {
        let body = get(&args.server, &path, &args.client)?;
        let answer: Value = serde_json::from_str(&body).context("decoding /flows")?;
        let now = unix_now();
        let text: String = fresh(&answer, args, &mut printed, now)
            .into_iter()
            .map(|f| match (args.output, args.trace) {
                (FlowsOutput::Json, _) => format!("{f}\n"),
                (FlowsOutput::Text, true) => traced(f),
                (FlowsOutput::Text, false) => format!("{}\n", row(f).join("  ")),
            })
            .collect();
        if !write(&text)? {
            return Ok(ExitCode::SUCCESS);
        }
        // Forget what fell out of the server's hour.
        printed.retain(|(_, start)| start.parse::<i64>().is_ok_and(|s| s > now - 4_000));
        std::thread::sleep(std::time::Duration::from_secs(5));
    }
}

pub fn run(args: &FlowsArgs) -> anyhow::Result<ExitCode> {
    if args.follow {
        return follow(args);
    }
    let body = get(&args.server, &path(args), &args.client)?;
    let answer: Value = serde_json::from_str(&body).context("decoding /flows")?;
    let text = match args.output {
        FlowsOutput::Json => answer["flows"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| &r["flow"])
            .filter(|f| flow_matches(f, args))
            .map(|f| format!("{f}\n"))
            .collect(),
        FlowsOutput::Text => render(&answer, args),
    };
    write(&text)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde_json::json;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        flows: FlowsArgs,
    }

    fn args(extra: &[&str]) -> FlowsArgs {
        Cli::parse_from(std::iter::once("flows").chain(extra.iter().copied())).flows
    }

    #[test]
    fn the_path_carries_the_servers_filters() {
        assert_eq!(path(&args(&[])), "/flows?format=goldmane");
        assert_eq!(
            path(&args(&[
                "--since",
                "10m",
                "--action",
                "deny",
                "--port",
                "80",
                "--policy",
                "gnp:a b",
                "--namespace",
                "shop"
            ])),
            "/flows?format=goldmane&start_time_gte=-600&action=deny&dest_port=80&policy=gnp%3Aa%20b"
        );
        assert_eq!(
            path(&args(&["--follow"])),
            "/flows?format=goldmane&aggregation_interval=15"
        );
    }

    #[test]
    fn follow_prints_each_closed_interval_once_oldest_first() {
        let flow = |id: i64, start: i64, ns: &str| {
            json!({"id": id.to_string(), "flow": {"start_time": start.to_string(),
                    "Key": {"source_namespace": ns, "dest_namespace": "x"}}})
        };
        let answer = json!({"flows": [flow(1, 1000, "shop"), flow(2, 970, "shop"),
                                       flow(1, 1015, "shop"), flow(3, 970, "other")]});
        let a = args(&["--follow", "--namespace", "shop"]);
        let mut printed = std::collections::HashSet::new();
        let starts =
            |v: Vec<&Value>| -> Vec<String> { v.iter().map(|f| count(&f["start_time"])).collect() };
        // At 1030 the interval of 1000 closed 15 s ago; 1015's only now.
        assert_eq!(
            starts(fresh(&answer, &a, &mut printed, 1030)),
            ["970", "1000"]
        );
        assert_eq!(
            starts(fresh(&answer, &a, &mut printed, 1040)),
            Vec::<String>::new()
        );
        assert_eq!(starts(fresh(&answer, &a, &mut printed, 1045)), ["1015"]);
    }

    #[test]
    fn a_hit_reads_as_tier_kind_name_rule_action() {
        assert_eq!(
            hit(
                &json!({"kind": "CalicoNetworkPolicy", "namespace": "shop", "name": "db",
                        "tier": "default", "action": "Allow", "rule_index": "2"})
            ),
            "default CalicoNetworkPolicy shop/db rule 2 allow"
        );
        assert_eq!(
            hit(
                &json!({"kind": "EndOfTier", "tier": "security", "action": "Deny",
                        "trigger": {"kind": "GlobalNetworkPolicy", "name": "guard"}})
            ),
            "security end-of-tier deny (after GlobalNetworkPolicy guard)"
        );
        assert_eq!(
            hit(&json!({"kind": "EndOfTier", "tier": "__PROFILE__", "action": "Deny"})),
            "__PROFILE__ end-of-tier deny"
        );
    }
}
