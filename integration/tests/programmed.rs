//! The agent's `GET /programmed` (admin endpoint) through the real binaries: a dry-run agent on
//! the example cluster lists each policy, profile and endpoint with Calico's chain names, the
//! cross-references agree with the state file, and an edit to the manifests shows up.

use std::time::{Duration, Instant};

use integration::{Agent, Server, example_datastore, free_port, http_get};
use serde_json::Value;

const MAX_CHAIN_NAME: usize = 28;

/// `/programmed` once it answers 200 and `pred` holds.
fn programmed(admin: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = None;
    while Instant::now() < deadline {
        if let Some((200, body)) = http_get(admin, "/programmed") {
            let dump: Value = serde_json::from_str(&body).expect("/programmed is JSON");
            if pred(&dump) {
                return dump;
            }
            last = Some(dump);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("/programmed never showed {what}; last: {last:#?}");
}

fn by_id<'a>(list: &'a Value, field: &str, id: &str) -> Option<&'a Value> {
    list.as_array()?.iter().find(|v| v[field] == id)
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

#[test]
fn programmed_maps_chain_names_to_policies_and_endpoints() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let server = Server::start(ds.path(), &[]);
    let admin = format!("127.0.0.1:{}", free_port());
    let agent = Agent::start_with(
        work.path(),
        &server.grpc,
        "node-1",
        "node-1",
        &["--admin-listen", &admin],
    );
    let state = agent.wait_for("node-1 in sync", |s| s["in_sync"] == true);
    let dump = programmed(&admin, "the snapshot's policies", |d| {
        d["policies"].as_array().is_some_and(|p| !p.is_empty())
    });

    // A short id is its own chain name, as Calico names it.
    let ping = by_id(&dump["policies"], "id", "GlobalNetworkPolicy/allow-ping").expect("listed");
    assert_eq!(ping["kind"], "GlobalNetworkPolicy");
    assert_eq!(ping["name"], "allow-ping");
    assert_eq!(ping["tier"], "default");
    assert_eq!(
        strings(&ping["chains"]),
        ["cali-pi-gnp/allow-ping", "cali-po-gnp/allow-ping"]
    );
    let workloads: Vec<String> = state["workload_endpoints"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(strings(&ping["endpoints"]), workloads);

    // A long one is hashed: the dump is how an operator finds it again.
    let threats = by_id(
        &dump["policies"],
        "id",
        "GlobalNetworkPolicy/block-threat-feed",
    )
    .expect("listed");
    assert_eq!(threats["tier"], "security");
    let chains = strings(&threats["chains"]);
    assert_eq!(chains.len(), 2, "{chains:?}");
    assert!(chains[0].starts_with("cali-pi-_") && chains[1].starts_with("cali-po-_"));
    assert_eq!(chains[0]["cali-pi-".len()..], chains[1]["cali-po-".len()..]);
    assert!(
        chains.iter().all(|c| c.len() <= MAX_CHAIN_NAME),
        "{chains:?}"
    );

    let web = by_id(
        &dump["policies"],
        "id",
        "NetworkPolicy/shop/allow-web-ingress",
    )
    .expect("a namespaced policy");
    assert_eq!(web["namespace"], "shop");

    // Every endpoint of the state file, with its interface's chains; each policy its tiers
    // name is listed and lists it back.
    let endpoints = dump["endpoints"].as_array().unwrap();
    for (id, ep) in state["workload_endpoints"].as_object().unwrap() {
        let entry = by_id(&dump["endpoints"], "id", id).expect("every workload listed");
        let iface = ep["name"].as_str().unwrap();
        assert_eq!(entry["kind"], "workload");
        assert_eq!(entry["interface"], iface);
        assert_eq!(
            strings(&entry["chains"]),
            [format!("cali-fw-{iface}"), format!("cali-tw-{iface}")]
        );
    }
    for entry in endpoints {
        for tier in entry["tiers"].as_array().unwrap() {
            for policy in strings(&tier["ingress"])
                .into_iter()
                .chain(strings(&tier["egress"]))
            {
                let p = by_id(&dump["policies"], "id", policy).expect("a used policy is listed");
                assert!(strings(&p["endpoints"]).contains(&entry["id"].as_str().unwrap()));
                assert_eq!(p["tier"], tier["name"], "{policy}");
            }
        }
    }
    let shop = by_id(&dump["profiles"], "name", "kns.shop").expect("namespace profile");
    assert_eq!(
        strings(&shop["chains"]),
        ["cali-pri-kns.shop", "cali-pro-kns.shop"]
    );
    assert_eq!(http_get(&admin, "/programmed/nope").map(|r| r.0), Some(404));
    assert_eq!(http_get(&admin, "/nope").map(|r| r.0), Some(404));

    // The dump follows applies: a deleted policy leaves it.
    let path = ds.path().join("policies.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs: Vec<&str> = text
        .split("\n---\n")
        .filter(|d| !d.contains("name: allow-ping\n"))
        .collect();
    std::fs::write(&path, docs.join("\n---\n")).unwrap();
    programmed(&admin, "allow-ping gone", |d| {
        by_id(&d["policies"], "id", "GlobalNetworkPolicy/allow-ping").is_none()
    });
}
