//! `calc-server explain` as a user runs it: on the example cluster, from the datastore and from
//! a running server (`--server`, `GET /explain`), the same answer; bad questions exit 2 with the
//! reason. The verdict semantics are unit-tested in `calc_graph` and checked against the kernel
//! in `linux_explain`.

use std::process::{Command, Output};

use integration::{Server, binary, example_datastore, http_get};

fn explain(dir: &std::path::Path, args: &[&str]) -> Output {
    Command::new(binary("calc-server"))
        .arg("explain")
        .arg("--file-dir")
        .arg(dir)
        .args(args)
        .output()
        .expect("run calc-server explain")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "explain failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn a_denied_scrape_names_the_end_of_tier_and_every_step() {
    let dir = example_datastore();
    let out = explain(
        dir.path(),
        &[
            "--from",
            "monitoring/prometheus-0",
            "--to",
            "shop/api-1",
            "--protocol",
            "tcp",
            "--port",
            "9090",
            "--output",
            "json",
        ],
    );
    let v = json(&out);
    assert_eq!(v["verdict"], "deny");
    assert_eq!(v["egress"]["verdict"], "allow");
    assert_eq!(v["egress"]["endpoint"], "monitoring/prometheus-0");
    assert_eq!(v["ingress"]["endpoint"], "shop/api-1");
    assert_eq!(v["ingress"]["verdict"], "deny");
    assert_eq!(
        v["ingress"]["decided_by"],
        serde_json::json!({"default": "end-of-tier default"})
    );
    let steps = v["ingress"]["steps"].as_array().expect("steps");
    // The security tier passes production traffic on; the walk shows it in order.
    let pass = steps
        .iter()
        .find(|s| s["policy"] == "production-isolation")
        .expect("production-isolation visited");
    assert_eq!(
        pass["rule"],
        serde_json::json!({"index": 0, "action": "Pass"})
    );
    assert_eq!(pass["tier"], "security");
    let tiers: Vec<&str> = steps.iter().filter_map(|s| s["tier"].as_str()).collect();
    let first = |t: &str| tiers.iter().position(|x| *x == t).expect("tier visited");
    assert!(first("security") < first("platform") && first("platform") < first("default"));

    // The text form walks the same path, one line per step.
    let text = explain(
        dir.path(),
        &[
            "--from",
            "monitoring/prometheus-0",
            "--to",
            "shop/api-1",
            "--port",
            "9090",
        ],
    );
    let text = String::from_utf8(text.stdout).expect("UTF-8");
    assert!(text.starts_with("DENY TCP port 9090"), "{text}");
    assert!(
        text.contains("production-isolation: rule 0 (Pass) matched → pass"),
        "{text}"
    );
    assert!(
        text.contains("tier default: end of tier (default action Deny): deny"),
        "{text}"
    );
}

#[test]
fn an_allowed_path_names_the_policy_and_rule() {
    let dir = example_datastore();
    let v = json(&explain(
        dir.path(),
        &[
            "--from",
            "shop/web-1",
            "--to",
            "10.65.2.11",
            "--port",
            "8080",
            "--output",
            "json",
        ],
    ));
    assert_eq!(v["verdict"], "allow");
    assert_eq!(
        v["to"]["name"], "shop/api-2",
        "an endpoint's address names the endpoint"
    );
    assert_eq!(
        v["ingress"]["decided_by"],
        serde_json::json!({"tier": "default", "policy": "shop/allow-api-from-web",
                           "kind": "NetworkPolicy", "rule": {"index": 0, "action": "Allow"}})
    );
    assert_eq!(v["egress"]["decided_by"]["profile"], "kns.shop");
}

#[test]
fn bad_questions_exit_2_with_the_reason() {
    let dir = example_datastore();
    for (args, needle) in [
        (
            vec!["--from", "shop/nope", "--to", "shop/api-1", "--port", "80"],
            "no endpoint \"shop/nope\"",
        ),
        (
            vec![
                "--from",
                "shop/web-1",
                "--to",
                "shop/api-1",
                "--port",
                "http",
            ],
            "not a port number",
        ),
        (
            vec![
                "--from",
                "shop/web-1",
                "--to",
                "shop/api-1",
                "--protocol",
                "tcp",
            ],
            "needs a destination port",
        ),
        (vec!["--policy", "nope"], "no policy \"nope\""),
    ] {
        let out = explain(dir.path(), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn a_running_server_gives_the_same_answers_as_the_datastore() {
    let dir = example_datastore();
    let server = Server::start(dir.path(), &[]);
    for question in [
        vec![
            "--from",
            "monitoring/prometheus-0",
            "--to",
            "shop/api-1",
            "--port",
            "9090",
        ],
        vec![
            "--from",
            "203.0.113.9",
            "--to",
            "shop/web-1",
            "--port",
            "443",
        ],
        vec![
            "--from",
            "shop/web-1",
            "--to",
            "shop/api-1",
            "--protocol",
            "icmp",
        ],
        vec!["--endpoint", "shop/api-1"],
        vec!["--policy", "production-isolation"],
    ] {
        let mut remote = Command::new(binary("calc-server"));
        remote
            .args(["explain", "--server", &server.admin, "--output", "json"])
            .args(&question);
        let remote = json(&remote.output().expect("run explain --server"));
        let mut local = question.clone();
        local.extend(["--output", "json"]);
        assert_eq!(remote, json(&explain(dir.path(), &local)), "{question:?}");
    }
    // The endpoint answers JSON errors a script can read.
    let (code, body) = http_get(
        &server.admin,
        "/explain?from=shop/web-1&to=shop/nope&port=80",
    )
    .expect("admin answers");
    assert_eq!(code, 400);
    let body: serde_json::Value = serde_json::from_str(&body).expect("JSON error");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("shop/nope")),
        "{body}"
    );
    let (code, _) =
        http_get(&server.admin, "/explain?endpoint=shop/api-1&policy=x").expect("answers");
    assert_eq!(code, 400, "two questions at once are refused");
    // The same error through the CLI: exit 2.
    let out = Command::new(binary("calc-server"))
        .args([
            "explain",
            "--server",
            &server.admin,
            "--endpoint",
            "shop/nope",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no endpoint \"shop/nope\""));
}
