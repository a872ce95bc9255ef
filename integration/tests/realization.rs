//! Where policies are in force, as an operator asks it: real agents (dry-run) report what they
//! applied; one agent's driver fails on purpose (its state file is a directory). The CLI and
//! the admin endpoint show the counts, the phase and the failing node's reason; a new
//! endpoint's time to be programmed reaches the metrics.

use std::process::Command;
use std::time::{Duration, Instant};

use integration::netns::wep_manifest;
use integration::{Agent, Server, binary, example_datastore, http_get, metric};

fn status(server: &Server, args: &[&str]) -> String {
    let out = Command::new(binary("calc-server"))
        .args(["status", "--server", &server.admin])
        .args(args)
        .output()
        .expect("run calc-server status");
    assert!(
        out.status.success(),
        "status {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// Polls `/status/policies/NAME` until `pred` holds (20 s), returning the JSON.
fn wait_policy(
    server: &Server,
    name: &str,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = serde_json::Value::Null;
    while Instant::now() < deadline {
        if let Some((200, body)) = http_get(&server.admin, &format!("/status/policies/{name}")) {
            last = serde_json::from_str(&body).expect("JSON");
            if pred(&last) {
                return last;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what}: never reached; last answer: {last}");
}

#[test]
fn a_failing_node_shows_as_failed_with_its_error_and_the_others_as_realized() {
    let dir = example_datastore();
    let server = Server::start(dir.path(), &[]);
    let good = Agent::start(dir.path(), &server.grpc, "node-1");
    // A state file that is a directory: every apply of this agent fails.
    std::fs::create_dir(dir.path().join("broken.state.json")).expect("mkdir");
    let broken = Agent::start_with(dir.path(), &server.grpc, "node-2", "broken", &[]);

    // production-isolation selects pods on both nodes.
    let p = wait_policy(
        &server,
        "production-isolation",
        "node-1 realized, node-2 failed",
        |p| p["realized"] == 1 && p["failed"] == 1,
    );
    assert_eq!(p["desired"], 2);
    assert_eq!(p["phase"], "Failed");
    assert_eq!(p["lagging"][0]["node"], "node-2");
    assert_eq!(p["lagging"][0]["state"], "failed");
    let reason = p["lagging"][0]["reason"].as_str().expect("reason");
    assert!(reason.starts_with("last apply failed: "), "{reason}");

    // The CLI: the table line, the lagging node with its reason, the node table's column.
    let table = status(&server, &["--policies"]);
    assert!(table.starts_with("POLICY"), "{table}");
    let line = table
        .lines()
        .find(|l| l.starts_with("production-isolation "))
        .unwrap_or_else(|| panic!("no line for the policy:\n{table}"));
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        cells[..7],
        [
            "production-isolation",
            "security",
            "2",
            "1",
            "1",
            "Failed",
            "GlobalNetworkPolicy"
        ]
    );
    // HITS and LAST-HIT close the line: a count, and `never` or a time (as the agents counted).
    assert_eq!(cells.len(), 9, "{line}");
    assert!(cells[7].parse::<u64>().is_ok(), "HITS: {line}");
    assert!(
        cells[8] == "never" || cells[8].ends_with('Z'),
        "LAST-HIT: {line}"
    );
    let one = status(&server, &["--policy", "production-isolation"]);
    assert!(one.contains("node-2  failed  last apply failed: "), "{one}");
    // Then one line per rule, with its counts (the dry-run agents report none: 0, never, -).
    let rules: Vec<Vec<&str>> = one
        .lines()
        .skip_while(|l| !l.starts_with("DIRECTION"))
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rules.len(), 4, "{one}");
    for (i, r) in rules.iter().enumerate() {
        assert_eq!(
            (r[0], r[1], &r[3..]),
            (
                "ingress",
                i.to_string().as_str(),
                &["0", "0", "never", "-"][..]
            ),
            "{one}"
        );
    }
    assert_eq!(p["rules"].as_array().map(Vec::len), Some(4), "{p}");
    assert_eq!(p["rules"][0]["direction"], "ingress");
    // Nothing reports stats: nothing can be called unused, only not yet known.
    let unused = Command::new(binary("calc-server"))
        .args([
            "policies",
            "--server",
            &server.admin,
            "--unused",
            "--since",
            "7d",
        ])
        .output()
        .expect("run calc-server policies");
    let table = String::from_utf8_lossy(&unused.stdout);
    assert!(unused.status.success(), "{table}");
    let line = table
        .lines()
        .find(|l| l.starts_with("production-isolation "))
        .unwrap_or_else(|| panic!("no line for the policy:\n{table}"));
    assert_eq!(
        line.split_whitespace().collect::<Vec<_>>(),
        [
            "production-isolation",
            "security",
            "GlobalNetworkPolicy",
            "not-yet-known",
            "never",
            "-"
        ]
    );
    assert!(!table.contains(" unused "), "{table}");
    let bad = Command::new(binary("calc-server"))
        .args([
            "policies",
            "--server",
            &server.admin,
            "--unused",
            "--since",
            "7x",
        ])
        .output()
        .expect("run calc-server policies");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("'--since <DURATION>'"));
    let nodes = status(&server, &[]);
    let node2 = nodes
        .lines()
        .find(|l| l.starts_with("node-2"))
        .expect("node-2");
    assert!(node2.contains("no: last apply failed: "), "{nodes}");
    let node1 = nodes
        .lines()
        .find(|l| l.starts_with("node-1"))
        .expect("node-1");
    assert!(node1.trim_end().ends_with("yes"), "{nodes}");

    // Per-tier gauges (summed at most once a second).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = http_get(&server.admin, "/metrics").expect("metrics").1;
        let failed = metric(&m, "calc_server_policy_nodes_failed{tier=\"security\"}");
        if failed.unwrap_or(0.0) >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no failed security nodes in:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Once the broken agent is gone, its node is pending (not connected), not failed.
    drop(broken);
    let p = wait_policy(&server, "production-isolation", "node-2 pending", |p| {
        p["failed"] == 0 && p["phase"] == "Realizing"
    });
    assert_eq!(p["lagging"][0]["reason"], "not connected");
    drop(good);
}

#[test]
fn a_new_endpoint_is_timed_until_its_agent_applies_it() {
    let dir = example_datastore();
    let server = Server::start(dir.path(), &[]);
    let agent = Agent::start(dir.path(), &server.grpc, "node-1");
    wait_policy(&server, "production-isolation", "snapshot applied", |p| {
        p["realized"] == 1
    });
    let count = || {
        let m = http_get(&server.admin, "/metrics").expect("metrics").1;
        metric(&m, "calc_server_endpoint_programmed_seconds_count").unwrap_or(-1.0)
    };
    assert_eq!(count(), 0.0, "the snapshot's endpoints are not new");
    std::fs::write(
        dir.path().join("new-pod.yaml"),
        wep_manifest("node-1", "shop", "web-9", "caliweb9")
            .label("app", "web")
            .calico_labels()
            .ipv4("10.65.1.99")
            .render(),
    )
    .expect("write");
    agent.wait_for("the new pod", |s| s.to_string().contains("web-9"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while count() < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the new endpoint was never timed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The hit counters survive a restart through `_hits.json` in the status directory: a saved
/// document is loaded (its entries of a policy the datastore no longer has pruned and the file
/// saved again without them), a killed server's successor shows the same counts, and a document
/// of another version is refused with a warning naming the file: the server starts from zero.
#[test]
fn hit_counters_are_kept_in_the_status_directory_across_a_restart() {
    let dir = example_datastore();
    let status_dir = dir.path().join("status");
    std::fs::create_dir_all(&status_dir).expect("mkdir status");
    let file = status_dir.join("_hits.json");
    let count = |name: &str| {
        serde_json::json!({
            "owner": {"policy": {"kind": "GlobalNetworkPolicy", "namespace": "", "name": name}},
            "node": null, "egress": false, "index": 1,
            "packets": 42, "bytes": 4200,
            "first_ms": 1_700_000_000_000_u64, "last_ms": 1_700_000_060_000_u64
        })
    };
    let doc = serde_json::json!({
        "version": 1,
        "counts": [count("production-isolation"), count("gone")],
        "seen": []
    });
    std::fs::write(&file, doc.to_string()).expect("write _hits.json");
    let restored = |p: &serde_json::Value| p["rules"][1]["packets"] == 42;

    let server = Server::start(dir.path(), &["--hits-save-interval", "1s"]);
    let p = wait_policy(&server, "production-isolation", "restored counts", restored);
    assert_eq!(p["rules"][1]["last_hit"], "2023-11-14T22:14:20Z", "{p}");
    assert_eq!(
        p["rules"][1]["nodes"],
        serde_json::json!(["(departed)"]),
        "{p}"
    );
    // The deleted policy's entry is pruned once the datastore is in sync, and saved so.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        if text.contains("production-isolation") && !text.contains("\"gone\"") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never saved without `gone`: {text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Killed (no graceful save): the next server reads what was saved.
    drop(server);
    let server = Server::start(dir.path(), &[]);
    wait_policy(
        &server,
        "production-isolation",
        "counts after a restart",
        restored,
    );
    drop(server);

    std::fs::write(&file, r#"{"version": 9, "counts": [], "seen": []}"#).expect("write");
    let server = Server::start(dir.path(), &[]);
    let p = wait_policy(&server, "production-isolation", "zero counts", |p| {
        p["rules"][1]["packets"] == 0
    });
    assert_eq!(p["rules"][1]["last_hit"], serde_json::Value::Null, "{p}");
    let log = server.log_text();
    assert!(
        log.contains("cannot load the saved policy hit counters")
            && log.contains(file.to_str().expect("UTF-8"))
            && log.contains("version 9 is not one this server reads"),
        "{log}"
    );
}
