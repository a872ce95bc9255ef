//! Policy hit counters kept in a real etcd across calc-server restarts (`serve::hits_store`):
//! a raw gRPC client stands in for an agent that offers `stats` and reports `RuleStats`; the
//! counters show on the admin `/status/policies`, are saved as parts under
//! `/calico/calc-server/v1/hits/`, survive a graceful restart (SIGTERM) exactly, lose only what
//! came after the last save on a crash (SIGKILL), and a server that reads the store late (etcd
//! down when it starts) adds to what was saved instead of overwriting it.
//!
//! Without etcd these tests fail (they are `#[ignore]`d for a plain `cargo test`; `make test`,
//! CI included, installs etcd and runs them), as the other etcd tests do.

use std::time::{Duration, Instant};

use integration::stats_agent::StatsAgent;
use integration::{Etcd, Server, binary, free_port, http_get, send_signal};
use serde_json::Value;

const P: &str = "/calico/resources/v3/projectcalico.org";
const HITS: &str = "/calico/calc-server/v1/hits/";
const NODE: &str = "node-1";
/// The policy the reports hit, as `/status/policies` names it.
const AF: &str = "prod/allow-frontend";

// ---- the seeded cluster (as in etcd.rs): node-1 runs backend-1 (profile kns.prod), which
// allow-frontend selects.

fn seed(etcd: &Etcd) {
    etcd.put(
        &format!("{P}/tiers/default"),
        r#"{"kind":"Tier","apiVersion":"projectcalico.org/v3","metadata":{"name":"default","uid":"6f1c2d0e-0c4e-4c55-9d1e-2b7c3e1d9a10","creationTimestamp":"2025-06-01T12:00:00Z"},"spec":{"order":1000000,"defaultAction":"Deny"}}"#,
    );
    etcd.put(
        &format!("{P}/nodes/{NODE}"),
        &format!(
            r#"{{"kind":"Node","apiVersion":"projectcalico.org/v3","metadata":{{"name":"{NODE}","uid":"n-{NODE}","creationTimestamp":"2025-06-01T12:00:00Z","labels":{{"kubernetes.io/hostname":"{NODE}"}}}},"spec":{{"bgp":{{"ipv4Address":"192.168.0.11/24"}}}}}}"#
        ),
    );
    etcd.put(
        &format!("{P}/profiles/kns.prod"),
        r#"{"kind":"Profile","apiVersion":"projectcalico.org/v3","metadata":{"name":"kns.prod","uid":"p-prod","creationTimestamp":"2025-06-01T12:00:00Z"},"spec":{"ingress":[{"action":"Allow"}],"egress":[{"action":"Allow"}],"labelsToApply":{"pcns.projectcalico.org/name":"prod"}}}"#,
    );
    etcd.put(
        &format!("{P}/networkpolicies/prod/allow-frontend"),
        r#"{"kind":"NetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"allow-frontend","namespace":"prod","uid":"b3f1","creationTimestamp":"2025-06-01T12:00:00Z","labels":{"projectcalico.org/tier":"default"},"annotations":{"projectcalico.org/metadata":"{\"name\":\"allow-frontend\"}"}},"spec":{"order":100,"ingress":[{"action":"Allow","protocol":"TCP","source":{"selector":"role == 'frontend'"},"destination":{"ports":[8080]}}],"selector":"app == 'backend'","types":["Ingress"]}}"#,
    );
    let name = format!("{}-k8s-backend--1-eth0", NODE.replace('-', "--"));
    etcd.put(
        &format!("{P}/workloadendpoints/prod/{name}"),
        &format!(
            r#"{{"kind":"WorkloadEndpoint","apiVersion":"projectcalico.org/v3","metadata":{{"name":"{name}","namespace":"prod","uid":"w-backend-1","creationTimestamp":"2025-06-01T12:00:00Z","labels":{{"app":"backend","projectcalico.org/namespace":"prod","projectcalico.org/orchestrator":"k8s"}}}},"spec":{{"orchestrator":"k8s","node":"{NODE}","containerID":"4a1bbackend-1","pod":"backend-1","endpoint":"eth0","serviceAccountName":"default","ipNetworks":["10.65.0.5/32"],"profiles":["kns.prod"],"interfaceName":"calibackend-1","mac":"ee:ee:ee:ee:ee:ee"}}}}"#
        ),
    );
}

fn start_server(etcd: &Etcd, work: &std::path::Path, save_interval: &str) -> Server {
    let port = free_port();
    Server::start_etcd(
        &etcd.endpoint,
        work.join(format!("server-{port}.log")),
        port,
        &["--hits-save-interval", save_interval],
    )
}

fn wait_until(what: &str, timeout: Duration, mut pred: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if pred() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for: {what}");
}

/// SIGTERM, then waits for the server to exit (it saves the counters on the way out).
fn terminate(server: &mut Server) {
    assert!(send_signal(server.child.id(), "TERM"));
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = server.child.try_wait() {
            assert!(status.success(), "a graceful stop exits 0: {status:?}");
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "calc-server did not stop on SIGTERM; log:\n{}",
        server.log_text()
    );
}

/// The log lines that warn or err about the hit counters' store.
fn store_complaints(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .filter(|l| l.contains("hit counters") || l.contains(HITS))
        .collect()
}

// ---- the admin API and etcd.

/// `/status/policies`' row for `name` (`[NAMESPACE/]NAME`) of `kind` (`Profile` for a profile).
fn policy_row(server: &Server, kind: &str, name: &str) -> Value {
    let (code, body) = http_get(&server.admin, "/status/policies").expect("admin answers");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    v.as_array()
        .unwrap_or_else(|| panic!("a list of policies: {v}"))
        .iter()
        .find(|r| r["kind"] == kind && r["policy"] == name)
        .unwrap_or_else(|| panic!("no row for {kind} {name}: {v}"))
        .clone()
}

fn hits_of(server: &Server, kind: &str, name: &str) -> Option<u64> {
    policy_row(server, kind, name)["hits"].as_u64()
}

/// The saved counts of `node` (its parts `counts/<node>/<i>`, joined).
fn saved_counts(etcd: &Etcd, node: &str) -> Vec<Value> {
    etcd.get_prefix(&format!("{HITS}counts/{node}/"))
        .values()
        .flat_map(|v| {
            let doc: Value = serde_json::from_str(v).expect("a part is JSON");
            assert_eq!(doc["version"], 1, "{doc}");
            doc["counts"].as_array().cloned().unwrap_or_default()
        })
        .collect()
}

/// (packets, bytes) saved for `node` on ingress rule 0 of the owner `owner_has` names.
fn saved_rule0(etcd: &Etcd, node: &str, owner_has: &str) -> Option<(u64, u64)> {
    saved_counts(etcd, node)
        .into_iter()
        .find(|c| {
            c["owner"].to_string().contains(owner_has) && c["egress"] == false && c["index"] == 0
        })
        .map(|c| (c["packets"].as_u64().unwrap(), c["bytes"].as_u64().unwrap()))
}

// ---- the raw agent.

/// node-1's agent: offers `stats` and reads a snapshot that carries allow-frontend (one
/// ingress rule) and kns.prod (one ingress rule).
async fn connect(url: &str, node: &str) -> StatsAgent {
    let agent = StatsAgent::connect(url, node, &["stats"]).await;
    assert_eq!(agent.agreed, ["stats"], "stats agreed");
    assert_eq!(
        agent
            .policies
            .get("allow-frontend")
            .map(|(_, rules)| *rules),
        Some(1),
        "allow-frontend has one ingress rule"
    );
    assert_eq!(agent.profiles.get("kns.prod"), Some(&1));
    agent
}

/// Reports `packets` and waits until the server counted `total` on both owners.
async fn report_and_see(agent: &mut StatsAgent, server: &Server, packets: u64, total: u64) {
    agent.report("allow-frontend", "kns.prod", packets).await;
    wait_until(
        &format!("{total} hits on allow-frontend and kns.prod"),
        Duration::from_secs(10),
        || {
            hits_of(server, "NetworkPolicy", AF) == Some(total)
                && hits_of(server, "Profile", "kns.prod") == Some(total)
        },
    );
}

fn wait_saved(etcd: &Etcd, packets: u64) {
    wait_until(
        &format!("{packets} packets saved in etcd"),
        Duration::from_secs(10),
        || {
            saved_rule0(etcd, NODE, "allow-frontend") == Some((packets, packets * 100))
                && saved_rule0(etcd, NODE, "kns.prod") == Some((packets, packets * 100))
        },
    );
}

// ---- the cases.

/// Reported hits show, are saved under counts/node-1/0, and a SIGTERM'd server's successor
/// shows them before any agent connects, then adds to them and saves the sum.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs etcd: `make test` installs it and runs this"]
async fn hits_are_saved_in_etcd_and_survive_a_graceful_restart() {
    let etcd = Etcd::start();
    let work = tempfile::tempdir().unwrap();
    seed(&etcd);
    let mut server = start_server(&etcd, work.path(), "200ms");
    let mut agent = connect(&server.grpc, NODE).await;
    report_and_see(&mut agent, &server, 37, 37).await;
    let row = policy_row(&server, "NetworkPolicy", AF);
    assert_eq!(row["bytes"], 3700, "{row}");
    // The part of node-1 exists, and holds what was counted.
    let part = format!("{HITS}counts/{NODE}/0");
    wait_until("counts/node-1/0 in etcd", Duration::from_secs(10), || {
        etcd.get_prefix(&part).contains_key(&part)
    });
    wait_saved(&etcd, 37);

    // SIGTERM; the successor reads the store before anything connects.
    drop(agent);
    terminate(&mut server);
    let log = server.log_text();
    assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
    let server = start_server(&etcd, work.path(), "200ms");
    wait_until("37 restored", Duration::from_secs(10), || {
        hits_of(&server, "NetworkPolicy", AF) == Some(37)
            && hits_of(&server, "Profile", "kns.prod") == Some(37)
    });
    let mut agent = connect(&server.grpc, NODE).await;
    report_and_see(&mut agent, &server, 5, 42).await;
    wait_saved(&etcd, 42);
    let log = server.log_text();
    assert!(log.contains("policy hit counters restored"), "{log}");
    assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
}

/// SIGKILL: what was saved is kept exactly; a report after the last save is lost.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs etcd: `make test` installs it and runs this"]
async fn a_killed_server_loses_only_what_came_after_the_last_save() {
    let etcd = Etcd::start();
    let work = tempfile::tempdir().unwrap();
    seed(&etcd);
    // Saves at most every 5 s: a report right after a save stays unsaved that long.
    let mut server = start_server(&etcd, work.path(), "5s");
    let mut agent = connect(&server.grpc, NODE).await;
    report_and_see(&mut agent, &server, 37, 37).await;
    wait_saved(&etcd, 37);
    report_and_see(&mut agent, &server, 11, 48).await;
    assert_eq!(
        saved_rule0(&etcd, NODE, "allow-frontend"),
        Some((37, 3700)),
        "the second report is not saved yet"
    );
    let log = server.log_text();
    assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert!(agent.ended().await);

    let server = start_server(&etcd, work.path(), "200ms");
    wait_until("37 restored", Duration::from_secs(10), || {
        hits_of(&server, "NetworkPolicy", AF) == Some(37)
            && hits_of(&server, "Profile", "kns.prod") == Some(37)
    });
    let mut agent = connect(&server.grpc, NODE).await;
    report_and_see(&mut agent, &server, 5, 42).await;
    wait_saved(&etcd, 42);
    let log = server.log_text();
    assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
}

/// A part as the server writes it: `packets` (and 100 bytes each) on ingress rule 0 of
/// allow-frontend and of kns.prod on `node`.
fn part(node: &str, packets: u64) -> String {
    let count = |owner: &str| {
        format!(
            r#"{{"owner":{owner},"node":"{node}","egress":false,"index":0,"packets":{packets},"bytes":{},"first_ms":1795820151870,"last_ms":1795820151870}}"#,
            packets * 100
        )
    };
    format!(
        r#"{{"version":1,"counts":[{},{}],"seen":[]}}"#,
        count(r#"{"policy":{"kind":"NetworkPolicy","namespace":"prod","name":"allow-frontend"}}"#),
        count(r#"{"profile":"kns.prod"}"#)
    )
}

/// Every value `key` has had (etcd's history, oldest first).
fn history(etcd: &Etcd, key: &str) -> Vec<String> {
    let out = etcd.ctl(&["get", key, "--write-out", "json"]);
    let v: Value = serde_json::from_str(&out).expect("etcdctl JSON");
    let kv = &v["kvs"][0];
    let (from, to) = (
        kv["create_revision"].as_i64().expect("the key exists"),
        kv["mod_revision"].as_i64().unwrap(),
    );
    let mut values: Vec<String> = Vec::new();
    for rev in from..=to {
        let out = etcd.ctl(&["get", key, &format!("--rev={rev}"), "--print-value-only"]);
        let value = out.trim_end().to_string();
        if values.last() != Some(&value) {
            values.push(value);
        }
    }
    values
}

/// A server started while etcd is down reads the saved counters only once etcd is back, some
/// retries later, and writes nothing before it has: a report of 5 ends as 100 + 5 = 105 in
/// etcd, whose history of the part holds 100 then 105 and nothing else (never the 5 alone).
/// Whether the report reaches it before or after the read depends on the datastore's and the
/// store's retry timers (both back off), so that order is not asserted.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs etcd: `make test` installs it and runs this"]
async fn a_server_that_reads_the_store_late_adds_to_it() {
    let mut etcd = Etcd::start();
    let work = tempfile::tempdir().unwrap();
    seed(&etcd);
    let key = format!("{HITS}counts/{NODE}/0");
    etcd.put(&key, &part(NODE, 100));
    etcd.kill();

    // Started by hand: Server::start_etcd waits for a readiness that needs etcd.
    let (port, admin_port) = (free_port(), free_port());
    let log = work.path().join("server.log");
    let out = std::fs::File::create(&log).unwrap();
    let child = std::process::Command::new(binary("calc-server"))
        .args(["serve", "--datastore-type", "etcdv3", "--etcd-endpoints"])
        .arg(&etcd.endpoint)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin_port}")])
        .args([
            "--status-interval",
            "100ms",
            "--hits-save-interval",
            "200ms",
        ])
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("start calc-server");
    let started = Instant::now();
    let server = Server {
        child,
        grpc: format!("http://127.0.0.1:{port}"),
        admin: format!("127.0.0.1:{admin_port}"),
        log,
    };
    wait_until("the store read fails", Duration::from_secs(10), || {
        server
            .log_text()
            .contains("cannot read the saved policy hit counters yet")
    });
    // etcd back after 3 s: the read is retried (0.5 s, doubling), so it comes late.
    std::thread::sleep(Duration::from_secs(3).saturating_sub(started.elapsed()));
    etcd.restart();
    wait_until("ready once etcd is back", Duration::from_secs(20), || {
        http_get(&server.admin, "/readiness").is_some_and(|(code, _)| code == 200)
    });
    let mut agent = connect(&server.grpc, NODE).await;
    agent.report("allow-frontend", "kns.prod", 5).await;
    let mut seen = Vec::new();
    wait_until("100 + 5 counted", Duration::from_secs(30), || {
        let now = (
            hits_of(&server, "NetworkPolicy", AF),
            hits_of(&server, "Profile", "kns.prod"),
        );
        if seen.last() != Some(&now) {
            seen.push(now);
        }
        now == (Some(105), Some(105))
    });
    // Whether the report or the saved counters came first depends on the two retry timers;
    // either way nothing but their sum, or one of them alone, ever shows.
    assert!(
        seen.iter()
            .all(|(p, q)| [p, q].iter().all(|h| matches!(h, Some(0 | 5 | 100 | 105)))),
        "{seen:?}"
    );
    wait_saved(&etcd, 105);
    let log = server.log_text();
    assert!(log.contains("policy hit counters restored"), "{log}");
    let complaints = store_complaints(&log);
    assert!(
        complaints.len() == 1
            && complaints[0].contains("cannot read the saved policy hit counters yet"),
        "only the read that failed is logged, once: {complaints:?}"
    );
    // The part went from what was saved straight to the sum: never overwritten by the 5.
    let values: Vec<Option<u64>> = history(&etcd, &key)
        .iter()
        .map(|v| {
            let doc: Value = serde_json::from_str(v).unwrap();
            doc["counts"][0]["packets"].as_u64()
        })
        .collect();
    assert_eq!(values, [Some(100), Some(105)]);
}

/// Two replicas on one etcd. node-1's agent reports 37 to the first, moves to the second
/// (started before they were saved), which carries on from the saved 37 to 42, and back to the
/// first (whose own view is the stale 37), which carries on from 42 to 43.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs etcd: `make test` installs it and runs this"]
async fn a_node_that_fails_over_carries_on_from_what_was_saved() {
    let etcd = Etcd::start();
    seed(&etcd);
    let (work_a, work_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start_server(&etcd, work_a.path(), "200ms");
    let b = start_server(&etcd, work_b.path(), "200ms");
    let shows = |server: &Server, n: u64| {
        hits_of(server, "NetworkPolicy", AF) == Some(n)
            && hits_of(server, "Profile", "kns.prod") == Some(n)
    };
    wait_until("both replicas ready", Duration::from_secs(10), || {
        shows(&a, 0) && shows(&b, 0)
    });

    let mut agent = connect(&a.grpc, NODE).await;
    report_and_see(&mut agent, &a, 37, 37).await;
    wait_saved(&etcd, 37);
    drop(agent);

    let mut agent = connect(&b.grpc, NODE).await;
    wait_until(
        "the second replica re-read node-1's saved 37",
        Duration::from_secs(10),
        || shows(&b, 37),
    );
    report_and_see(&mut agent, &b, 5, 42).await;
    wait_saved(&etcd, 42);
    drop(agent);

    let mut agent = connect(&a.grpc, NODE).await;
    wait_until(
        "the first replica re-read node-1's saved 42",
        Duration::from_secs(10),
        || shows(&a, 42),
    );
    report_and_see(&mut agent, &a, 1, 43).await;
    wait_saved(&etcd, 43);
    for server in [&a, &b] {
        let log = server.log_text();
        assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
    }
}
