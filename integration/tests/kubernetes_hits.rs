//! Policy hit counters kept in ConfigMaps with the Kubernetes datastore (`serve::hits_store::kube`),
//! end to end: the real `calc-server serve --datastore-type kubernetes` (and so the real kube
//! client) against the in-process fake API server of `integration::fake_kube`, which serves
//! namespaced ConfigMaps (LIST by label, server-side apply, DELETE) besides the watched kinds.
//! A raw gRPC client stands in for node1's agent, offers `stats` and reports `RuleStats` on the
//! one rule of a Kubernetes NetworkPolicy it was sent and of its namespace's profile.
//!
//! Asserted: the counts show on the admin `/status/policies`; they are saved as the ConfigMap
//! of part `counts/node1/0` (name, label, annotation, `data["hits.json"]`) in the kubeconfig's
//! namespace (`default`), or in `--hits-namespace`; a SIGTERM'd server's successor shows them
//! before any agent reports and adds to them; a server whose ConfigMap requests fail at start
//! counts meanwhile, writes nothing until it has read them, then saves the sum, never less.
//!
//! Nothing to install (the fake API server is in-process); a missing or stale binary fails.

use std::time::{Duration, Instant};

use integration::fake_kube::{
    CRDS, FakeKube, NAMESPACES, NETWORK_POLICIES, NODES, PODS, SERVICE_ACCOUNTS,
};
use integration::stats_agent::StatsAgent;
use integration::{Server, free_port, http_get, send_signal};
use serde_json::{Value, json};

const NODE: &str = "node1";
/// The label, annotation and data key of a saved part (docs/operations.md).
const LABEL: &str = "calc-server.projectcalico.org/hits";
const PART_ANNOTATION: &str = "calc-server.projectcalico.org/part";
const DATA_KEY: &str = "hits.json";
/// The policy the reports hit, as the stream names it, and its namespace's profile.
const POLICY: &str = "knp.default.allow-frontend";
const PROFILE: &str = "kns.default";

/// `calc-server-hits-<FNV-1a of the part name, 16 hex digits>`, as docs/operations.md names
/// a part's ConfigMap (computed here independently of the server).
fn object_name(part: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in part.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("calc-server-hits-{h:016x}")
}

fn part_name() -> String {
    format!("counts/{NODE}/0")
}

// ---- the cluster: node1 runs db-0 in `default`, which allow-frontend selects.

fn seed(fake: &FakeKube) {
    fake.apply(
        NAMESPACES,
        json!({"metadata": {"name": "default",
                            "labels": {"kubernetes.io/metadata.name": "default"}}}),
    );
    fake.apply(
        SERVICE_ACCOUNTS,
        json!({"metadata": {"name": "default", "namespace": "default"}}),
    );
    fake.apply(
        NODES,
        json!({"metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE},
               "annotations": {"projectcalico.org/IPv4Address": "10.0.0.11/24"}},
               "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.11"}]}}),
    );
    fake.apply(
        PODS,
        json!({
            "metadata": {"name": "db-0", "namespace": "default", "labels": {"role": "db"}},
            "spec": {"nodeName": NODE, "serviceAccountName": "default",
                     "containers": [{"name": "main", "image": "db"}]},
            "status": {"phase": "Running", "podIP": "10.65.0.10",
                       "podIPs": [{"ip": "10.65.0.10"}]},
        }),
    );
    fake.apply(
        NETWORK_POLICIES,
        json!({"metadata": {"name": "allow-frontend", "namespace": "default"},
               "spec": {"podSelector": {"matchLabels": {"role": "db"}},
                        "policyTypes": ["Ingress"],
                        "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "frontend"}}}],
                                     "ports": [{"protocol": "TCP", "port": 6379}]}]}}),
    );
}

fn cluster() -> FakeKube {
    let crds: Vec<&str> = CRDS.iter().map(|(plural, _)| *plural).collect();
    let fake = FakeKube::start(&crds);
    seed(&fake);
    fake
}

/// `calc-server serve` on the fake cluster, saving every 200 ms, with `extra` flags; waits
/// until it is ready (its datastore in sync; the ConfigMaps need not be readable).
fn start_server(fake: &FakeKube, work: &std::path::Path, extra: &[&str]) -> Server {
    let cfg = fake.kubeconfig(work);
    let port = free_port();
    let mut flags = vec!["--hits-save-interval", "200ms"];
    flags.extend_from_slice(extra);
    Server::start_with(
        &[
            "--datastore-type",
            "kubernetes",
            "--kubeconfig",
            cfg.to_str().unwrap(),
        ],
        work.join(format!("server-{port}.log")),
        port,
        &flags,
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
        .filter(|l| l.contains("hit counters") || l.contains("ConfigMap"))
        .collect()
}

// ---- the admin API and the ConfigMaps.

/// `/status/policies`' row of the owner whose `policy` field names `name` and whose kind is
/// `kind`.
fn policy_row(server: &Server, kind: &str, name: &str) -> Value {
    let (code, body) = http_get(&server.admin, "/status/policies").expect("admin answers");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    v.as_array()
        .unwrap_or_else(|| panic!("a list of policies: {v}"))
        .iter()
        .find(|r| r["kind"] == kind && r["policy"].as_str().is_some_and(|p| p.contains(name)))
        .unwrap_or_else(|| panic!("no row for {kind} {name}: {v}"))
        .clone()
}

/// Hits shown for allow-frontend and for the profile kns.default.
fn shown(server: &Server) -> (Option<u64>, Option<u64>) {
    (
        policy_row(server, "NetworkPolicy", "allow-frontend")["hits"].as_u64(),
        policy_row(server, "Profile", PROFILE)["hits"].as_u64(),
    )
}

/// The document a saved part's ConfigMap holds, after checking its label and annotation.
fn part_doc(cm: &Value) -> Value {
    assert_eq!(cm["metadata"]["labels"][LABEL], "v1", "{cm}");
    assert_eq!(
        cm["metadata"]["annotations"][PART_ANNOTATION],
        part_name(),
        "{cm}"
    );
    let text = cm["data"][DATA_KEY]
        .as_str()
        .unwrap_or_else(|| panic!("data.{DATA_KEY} is text: {cm}"));
    let doc: Value = serde_json::from_str(text).expect("the part is JSON");
    assert_eq!(doc["version"], 1, "{doc}");
    doc
}

/// (policy, profile) packets on ingress rule 0 in a part's document.
fn packets_in(doc: &Value) -> (Option<u64>, Option<u64>) {
    let counts = doc["counts"].as_array().cloned().unwrap_or_default();
    let find = |owner_has: &str| {
        counts
            .iter()
            .find(|c| {
                c["owner"].to_string().contains(owner_has)
                    && c["node"] == NODE
                    && c["egress"] == false
                    && c["index"] == 0
            })
            .and_then(|c| c["packets"].as_u64())
    };
    (find("allow-frontend"), find(PROFILE))
}

/// The packets saved in `namespace` for node1 (`None`s: no ConfigMap).
fn saved(fake: &FakeKube, namespace: &str) -> (Option<u64>, Option<u64>) {
    fake.config_map(namespace, &object_name(&part_name()))
        .map(|cm| packets_in(&part_doc(&cm)))
        .unwrap_or_default()
}

fn wait_saved(fake: &FakeKube, namespace: &str, packets: u64) {
    let mut last = (None, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        last = saved(fake, namespace);
        if last == (Some(packets), Some(packets)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "timed out waiting for {packets} packets saved in {namespace}; saved {last:?}; ConfigMaps: {:?}",
        fake.config_maps(namespace)
    );
}

/// A part as the server writes it: `packets` on ingress rule 0 of allow-frontend and of
/// kns.default on node1, as a ConfigMap.
fn saved_part(packets: u64) -> Value {
    let count = |owner: Value| {
        json!({"owner": owner, "node": NODE, "egress": false, "index": 0, "packets": packets,
               "bytes": packets * 100, "first_ms": 1_795_820_151_870_u64,
               "last_ms": 1_795_820_151_870_u64})
    };
    let doc = json!({"version": 1, "counts": [
        count(json!({"policy": {"kind": "NetworkPolicy", "namespace": "default",
                                "name": POLICY}})),
        count(json!({"profile": PROFILE})),
    ], "seen": []});
    json!({"metadata": {"name": object_name(&part_name()),
                        "labels": {LABEL: "v1"},
                        "annotations": {PART_ANNOTATION: part_name()}},
           "data": {DATA_KEY: doc.to_string()}})
}

// ---- the raw agent.

/// node1's agent: offers `stats` and `applied` and reads a snapshot that carries
/// allow-frontend (one ingress rule) and the kns.default profile.
async fn connect(url: &str) -> StatsAgent {
    let agent = StatsAgent::connect(url, NODE, &["stats", "applied"]).await;
    assert!(
        agent.agreed.iter().any(|c| c == "stats"),
        "stats agreed: {:?}",
        agent.agreed
    );
    assert_eq!(
        agent.policies.get(POLICY).map(|(_, rules)| *rules),
        Some(1),
        "allow-frontend has one ingress rule"
    );
    assert!(
        agent.profiles.contains_key(PROFILE),
        "{PROFILE} in the snapshot"
    );
    agent
}

/// Reports `packets` and waits until the server shows `total` on both owners.
async fn report_and_see(agent: &mut StatsAgent, server: &Server, packets: u64, total: u64) {
    agent.report(POLICY, PROFILE, packets).await;
    wait_until(
        &format!("{total} hits on allow-frontend and {PROFILE}"),
        Duration::from_secs(10),
        || shown(server) == (Some(total), Some(total)),
    );
}

// ---- the cases.

/// Reported hits show, are saved as the ConfigMap of counts/node1/0 in the kubeconfig's
/// namespace (`default`), and a SIGTERM'd server's successor shows them before any agent
/// reports, then adds to them and saves the sum.
#[tokio::test(flavor = "multi_thread")]
async fn hits_are_saved_in_config_maps_and_survive_a_graceful_restart() {
    let fake = cluster();
    let work = tempfile::tempdir().unwrap();
    let mut server = start_server(&fake, work.path(), &[]);
    let mut agent = connect(&server.grpc).await;
    report_and_see(&mut agent, &server, 37, 37).await;
    let row = policy_row(&server, "NetworkPolicy", "allow-frontend");
    assert_eq!(row["bytes"], 3700, "{row}");

    wait_saved(&fake, "default", 37);
    let name = object_name(&part_name());
    let cm = fake.config_map("default", &name).unwrap();
    eprintln!("saved: {cm}");
    for field in ["resourceVersion", "uid", "creationTimestamp"] {
        assert!(cm["metadata"][field].is_string(), "{field}: {cm}");
    }
    let requests = fake.config_map_requests();
    assert!(requests.lists >= 1 && requests.applies >= 1, "{requests:?}");
    // Only node1's counts moved: nothing else is saved.
    let others: Vec<Value> = fake
        .config_maps("default")
        .into_iter()
        .filter(|c| c["metadata"]["annotations"][PART_ANNOTATION] != part_name())
        .map(|c| c["metadata"]["annotations"].clone())
        .collect();
    eprintln!("other parts saved: {others:?}");
    assert!(
        others.iter().all(|a| a[PART_ANNOTATION]
            .as_str()
            .is_some_and(|p| !p.starts_with("counts/"))),
        "no other node's counts: {others:?}"
    );

    // SIGTERM; the successor reads the ConfigMaps before anything connects.
    drop(agent);
    terminate(&mut server);
    let log = server.log_text();
    assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
    let server = start_server(&fake, work.path(), &[]);
    wait_until("37 restored", Duration::from_secs(10), || {
        shown(&server) == (Some(37), Some(37))
    });
    let mut agent = connect(&server.grpc).await;
    report_and_see(&mut agent, &server, 5, 42).await;
    wait_saved(&fake, "default", 42);
    let log = server.log_text();
    assert!(log.contains("policy hit counters restored"), "{log}");
    assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
    // Every state the part was given went up: 37 (maybe more than once), then 42.
    let history: Vec<(Option<u64>, Option<u64>)> = fake
        .config_map_history("default", &name)
        .iter()
        .map(|s| packets_in(&part_doc(s.as_ref().expect("never deleted"))))
        .collect();
    assert!(
        history
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1),
        "{history:?}"
    );
    assert_eq!(history.first(), Some(&(Some(37), Some(37))), "{history:?}");
    assert_eq!(history.last(), Some(&(Some(42), Some(42))), "{history:?}");
}

/// A server whose ConfigMap requests fail when it starts (the API answers 500: the kube client
/// itself retries a 503 for minutes before the store sees an error) counts a
/// report meanwhile but writes nothing; once they answer it reads the saved 100 and saves
/// 100 + 5, the part never holding less than 100.
#[tokio::test(flavor = "multi_thread")]
async fn a_server_that_reads_its_config_maps_late_adds_to_them() {
    let fake = cluster();
    let work = tempfile::tempdir().unwrap();
    let name = object_name(&part_name());
    fake.put_config_map("default", saved_part(100));
    fake.fail_config_maps(Some(500));
    let started = Instant::now();
    let server = start_server(&fake, work.path(), &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server
        .log_text()
        .contains("cannot read the saved policy hit counters yet")
    {
        assert!(
            Instant::now() < deadline,
            "the failed read is logged; log:\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut agent = connect(&server.grpc).await;
    report_and_see(&mut agent, &server, 5, 5).await;
    // Retries come 0.5, 1.5, 3.5 s after the first attempt: recovering at about 2.5 s leaves
    // the server counting for a while without its saved counters (and a save interval of
    // 200 ms many chances to write).
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(started.elapsed()));
    let requests = fake.config_map_requests();
    assert!(requests.failed >= 2, "the list was retried: {requests:?}");
    assert_eq!(
        (requests.applies, requests.deletes),
        (0, 0),
        "nothing is written before the store is read"
    );
    assert_eq!(shown(&server), (Some(5), Some(5)));
    fake.fail_config_maps(None);

    wait_until("100 + 5 shown", Duration::from_secs(15), || {
        shown(&server) == (Some(105), Some(105))
    });
    wait_saved(&fake, "default", 105);
    let log = server.log_text();
    assert!(log.contains("policy hit counters restored"), "{log}");
    // The part went from what was saved straight to the sum: never overwritten by the 5.
    let history: Vec<(Option<u64>, Option<u64>)> = fake
        .config_map_history("default", &name)
        .iter()
        .map(|s| packets_in(&part_doc(s.as_ref().expect("never deleted"))))
        .collect();
    assert!(!history.is_empty());
    assert!(
        history.iter().all(|h| *h == (Some(105), Some(105))),
        "{history:?}"
    );
    let requests = fake.config_map_requests();
    assert!(requests.lists >= 1, "{requests:?}");
}

/// `--hits-namespace other` keeps the parts there, and only there.
#[tokio::test(flavor = "multi_thread")]
async fn hits_namespace_chooses_where_they_are_kept() {
    let fake = cluster();
    let work = tempfile::tempdir().unwrap();
    let server = start_server(&fake, work.path(), &["--hits-namespace", "other"]);
    let mut agent = connect(&server.grpc).await;
    report_and_see(&mut agent, &server, 7, 7).await;
    wait_saved(&fake, "other", 7);
    assert_eq!(fake.config_maps("default"), Vec::<Value>::new());
    let log = server.log_text();
    assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
}

/// Two replicas share the ConfigMaps. node1's agent reports 37 to the first, then moves to
/// the second (started before those were saved: its own view of node1 is empty), which
/// carries on from the saved 37 and saves 42; back on the first (whose view is the stale 37),
/// it carries on from 42. Every state the part was given goes up.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_that_fails_over_carries_on_from_what_was_saved() {
    let fake = cluster();
    let (work_a, work_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start_server(&fake, work_a.path(), &[]);
    let b = start_server(&fake, work_b.path(), &[]);
    wait_until("both replicas ready", Duration::from_secs(10), || {
        shown(&a) == (Some(0), Some(0)) && shown(&b) == (Some(0), Some(0))
    });

    let mut agent = connect(&a.grpc).await;
    report_and_see(&mut agent, &a, 37, 37).await;
    wait_saved(&fake, "default", 37);
    drop(agent);

    let mut agent = connect(&b.grpc).await;
    wait_until(
        "the second replica re-read node1's saved 37",
        Duration::from_secs(10),
        || shown(&b) == (Some(37), Some(37)),
    );
    report_and_see(&mut agent, &b, 5, 42).await;
    wait_saved(&fake, "default", 42);
    drop(agent);

    let mut agent = connect(&a.grpc).await;
    wait_until(
        "the first replica re-read node1's saved 42",
        Duration::from_secs(10),
        || shown(&a) == (Some(42), Some(42)),
    );
    report_and_see(&mut agent, &a, 1, 43).await;
    wait_saved(&fake, "default", 43);

    let history: Vec<(Option<u64>, Option<u64>)> = fake
        .config_map_history("default", &object_name(&part_name()))
        .iter()
        .map(|s| packets_in(&part_doc(s.as_ref().expect("never deleted"))))
        .collect();
    assert!(
        history
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1),
        "the part never went down: {history:?}"
    );
    for server in [&a, &b] {
        let log = server.log_text();
        assert_eq!(store_complaints(&log), Vec::<&str>::new(), "{log}");
    }
}
