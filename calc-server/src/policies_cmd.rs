//! `calc-server policies --server ADDR --unused [--since DURATION]`: asks a running server's
//! admin endpoint (`/status/unused`) which policies and profiles in force, and which of their
//! rules, no packet matched within the window, and prints them as a table (or the JSON).
//!
//! The request is `crate::admin_client`; the classification (unused, partly unused, not yet
//! known) is the server's, from its hit counters: this module only renders it.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

use crate::admin_client::get;
use crate::args::{ListOutput, PoliciesArgs};
use crate::table::table;

const HEADER: [&str; 6] = [
    "POLICY",
    "TIER",
    "KIND",
    "STATE",
    "OBSERVED",
    "UNUSED-RULES",
];
const RIGHT: [bool; 6] = [false, false, false, false, true, false];

/// `secs` as the largest two units (`3d4h`, `5h12m`, `4m10s`, `12s`).
fn human(secs: u64) -> String {
    let units = [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];
    let Some(first) = units.iter().position(|(_, n)| secs >= *n) else {
        return "0s".into();
    };
    let mut rest = secs;
    let mut out = String::new();
    for (unit, n) in &units[first..(first + 2).min(units.len())] {
        let v = rest / n;
        rest %= n;
        if v > 0 || out.is_empty() {
            out.push_str(&format!("{v}{unit}"));
        }
    }
    out
}

/// The `/status/unused` path for a window (whole seconds, rounded up).
fn path(since: Option<Duration>) -> String {
    match since {
        Some(d) => format!(
            "/status/unused?since={}",
            d.as_secs() + u64::from(d.subsec_nanos() > 0)
        ),
        None => "/status/unused".into(),
    }
}

/// `ingress 0,2; egress 1` for a list of `{direction, index}`; `-` for none.
fn rule_list(rules: &serde_json::Value) -> String {
    let mut parts = Vec::new();
    for dir in ["ingress", "egress"] {
        let indexes: Vec<String> = rules
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["direction"] == dir)
            .filter_map(|r| r["index"].as_u64())
            .map(|i| i.to_string())
            .collect();
        if !indexes.is_empty() {
            parts.push(format!("{dir} {}", indexes.join(",")));
        }
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join("; ")
    }
}

/// One row per policy or profile of `/status/unused` (already sorted by the server).
fn rows(answer: &[serde_json::Value]) -> Vec<Vec<String>> {
    answer
        .iter()
        .map(|p| {
            let text = |k: &str| p[k].as_str().unwrap_or_default().to_string();
            let unused = &p["unused_rules"];
            let count = unused.as_array().map_or(0, Vec::len);
            let tier = text("tier");
            vec![
                if p["kind"] == "Profile" {
                    format!("profile:{}", text("policy"))
                } else {
                    text("policy")
                },
                if tier.is_empty() { "-".into() } else { tier },
                text("kind"),
                text("state"),
                p["observed_seconds"].as_u64().map_or("never".into(), human),
                if count == 0 {
                    "-".into()
                } else {
                    format!(
                        "{count}/{}: {}",
                        p["rule_count"].as_u64().unwrap_or_default(),
                        rule_list(unused)
                    )
                },
            ]
        })
        .collect()
}

/// The answer as a table and a line saying what the window was; or a line saying there is
/// nothing to report.
fn render(answer: &[serde_json::Value], since: Option<Duration>) -> String {
    let window = match since {
        Some(d) => format!("the last {}", human(d.as_secs().max(1))),
        None => "each rule's whole observed history".into(),
    };
    if answer.is_empty() {
        return format!(
            "every policy and profile in force was matched within {window}: nothing unused\n"
        );
    }
    format!(
        "{}\nwindow: {window}. OBSERVED: since first in force on a node whose agent reports \
         stats; not-yet-known: observed for less than the window, or never.\n",
        table(&HEADER, &rows(answer), &RIGHT)
    )
}

pub fn run(args: &PoliciesArgs) -> anyhow::Result<ExitCode> {
    let path = path(args.since);
    let body = get(&args.server, &path, &args.client)?;
    let text = match args.output {
        ListOutput::Json => format!("{body}\n"),
        ListOutput::Table => {
            let answer: Vec<serde_json::Value> =
                serde_json::from_str(&body).context("decoding /status/unused")?;
            render(&answer, args.since)
        }
    };
    // `policies | head` closes stdout early: not an error.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(ExitCode::SUCCESS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn durations_read_in_two_units() {
        assert_eq!(human(0), "0s");
        assert_eq!(human(12), "12s");
        assert_eq!(human(250), "4m10s");
        assert_eq!(human(3_600), "1h");
        assert_eq!(human(18_720), "5h12m");
        assert_eq!(human(7 * 86_400 + 3_600 + 59), "7d1h");
    }

    #[test]
    fn the_window_goes_in_whole_seconds_rounded_up() {
        assert_eq!(path(None), "/status/unused");
        assert_eq!(
            path(Some(Duration::from_secs(604_800))),
            "/status/unused?since=604800"
        );
        assert_eq!(
            path(Some(Duration::from_millis(1_500))),
            "/status/unused?since=2"
        );
    }

    #[test]
    fn the_table_names_each_policy_its_state_and_its_unused_rules() {
        let answer = [
            json!({"policy": "shop/legacy-db", "kind": "NetworkPolicy", "tier": "default",
                   "state": "unused", "observed_since": "2026-11-17T10:00:00Z",
                   "observed_seconds": 612_000, "rule_count": 3,
                   "unused_rules": [
                       {"direction": "ingress", "index": 0, "action": "allow", "last_hit": null},
                       {"direction": "ingress", "index": 1, "action": "allow", "last_hit": null},
                       {"direction": "egress", "index": 0, "action": "deny", "last_hit": "2026-11-01T00:00:00Z"}],
                   "not_yet_known_rules": []}),
            json!({"policy": "block-threat-feed", "kind": "GlobalNetworkPolicy", "tier": "security",
                   "state": "partly-unused", "observed_since": "2026-11-17T10:00:00Z",
                   "observed_seconds": 612_000, "rule_count": 2,
                   "unused_rules": [{"direction": "ingress", "index": 1, "action": "deny", "last_hit": null}],
                   "not_yet_known_rules": []}),
            json!({"policy": "kns.shop", "kind": "Profile", "tier": "",
                   "state": "not-yet-known", "observed_since": null, "observed_seconds": null,
                   "rule_count": 2, "unused_rules": [],
                   "not_yet_known_rules": [{"direction": "ingress", "index": 0, "action": "allow", "last_hit": null}]}),
        ];
        let text = render(&answer, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(
            text,
            "\
POLICY             TIER      KIND                 STATE          OBSERVED  UNUSED-RULES
shop/legacy-db     default   NetworkPolicy        unused             7d2h  3/3: ingress 0,1; egress 0
block-threat-feed  security  GlobalNetworkPolicy  partly-unused      7d2h  1/2: ingress 1
profile:kns.shop   -         Profile              not-yet-known     never  -

window: the last 7d. OBSERVED: since first in force on a node whose agent reports stats; not-yet-known: observed for less than the window, or never.
"
        );
        assert_eq!(
            render(&[], None),
            "every policy and profile in force was matched within each rule's whole observed history: nothing unused\n"
        );
    }
}
