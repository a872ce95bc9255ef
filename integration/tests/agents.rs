//! Real agents (dry-run driver) against the real calc-server: disjoint spans, edits reaching the
//! agent, and a calc-server killed and restarted mid-stream, with deletes made while it was
//! down: the agent keeps its state meanwhile and then converges to exactly what a fresh agent
//! gets.

use integration::{Agent, Server, example_datastore, free_port};
use serde_json::Value;

fn keys(v: &Value, field: &str) -> Vec<String> {
    v[field]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// A barrier through the server to `agent`: writes a policy every endpoint gets (a file of its
/// own) and waits until the agent has it. The server handles its datastore in order and the
/// stream is ordered, so whatever the server did with earlier changes (a deletion, say) has
/// reached the agent by then: a test can then check that something did *not* happen.
fn barrier(ds: &std::path::Path, agent: &Agent, name: &str) {
    std::fs::write(
        ds.join(format!("{name}.yaml")),
        format!(
            "apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: {name}
spec:
  order: 5000
  selector: all()
  types: [Ingress]
  ingress: [{{action: Pass}}]
"
        ),
    )
    .unwrap();
    agent.wait_for(&format!("the barrier {name} at the agent"), |s| {
        keys(s, "policies")
            .iter()
            .any(|p| p.ends_with(&format!("/{name}")))
    });
}

/// The dataplane part of a state file (everything the stream determines).
fn dataplane(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("in_sync");
    }
    v
}

#[test]
fn agents_get_disjoint_spans_and_follow_edits() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let server = Server::start(ds.path(), &[]);
    let a = Agent::start(work.path(), &server.grpc, "node-1");
    let b = Agent::start(work.path(), &server.grpc, "node-2");
    let sa = a.wait_for("node-1 in sync", |s| s["in_sync"] == true);
    let sb = b.wait_for("node-2 in sync", |s| s["in_sync"] == true);
    let (wa, wb) = (
        keys(&sa, "workload_endpoints"),
        keys(&sb, "workload_endpoints"),
    );
    assert_eq!(
        wa,
        [
            "k8s/monitoring/prometheus-0/eth0",
            "k8s/shop/api-1/eth0",
            "k8s/shop/web-1/eth0"
        ]
    );
    assert_eq!(wb.len(), 3);
    assert!(wa.iter().all(|w| !wb.contains(w)));
    assert!(
        keys(&sb, "policies").contains(&"NetworkPolicy/db/allow-postgres".to_string()),
        "{:?}",
        keys(&sb, "policies")
    );
    assert!(
        !keys(&sa, "policies")
            .iter()
            .any(|p| p.contains("allow-postgres"))
    );
    assert_eq!(keys(&sb, "host_endpoints"), ["node-2-eth0"]);

    // Delete web-1 from the manifests: node-1's agent drops it, node-2 is untouched.
    let path = ds.path().join("workloads.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs: Vec<&str> = text
        .split("\n---\n")
        .filter(|d| !d.contains("name: node--1-k8s-web--1-eth0"))
        .collect();
    std::fs::write(&path, docs.join("\n---\n")).unwrap();
    a.wait_for("web-1 gone", |s| {
        !keys(s, "workload_endpoints").contains(&"k8s/shop/web-1/eth0".to_string())
    });
    assert_eq!(keys(&b.state().unwrap(), "workload_endpoints"), wb);

    // Remove a whole file: the threat feed's CIDRs leave the IP set every node holds for it.
    let threats = "s:qvKxGNdSpt4DbUMswvbD0TY46HvXS70GrYL2zQ";
    assert_eq!(
        sa["ipsets"][threats]["members"].as_array().map(Vec::len),
        Some(3),
        "{}",
        sa["ipsets"]
    );
    std::fs::remove_file(ds.path().join("network-sets.yaml")).unwrap();
    a.wait_for("threat feed emptied", |s| {
        s["ipsets"][threats]["members"]
            .as_array()
            .is_some_and(Vec::is_empty)
    });

    // The server has the agents' reports.
    let st = server.status();
    let n1 = st
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "node-1")
        .unwrap()
        .clone();
    assert_eq!(n1["connected"], true);
    assert_eq!(n1["dataplane_in_sync"], true, "{n1}");
}

#[test]
fn a_restarted_server_converges_the_agent_to_a_fresh_agents_state() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = Server::start_on(ds.path(), port, &[]);
    let agent = Agent::start(work.path(), &server.grpc, "node-1");
    let before = agent.wait_for("in sync", |s| s["in_sync"] == true);
    assert!(keys(&before, "workload_endpoints").contains(&"k8s/shop/api-1/eth0".to_string()));

    // Kill the server mid-stream. The agent keeps its dataplane as it is: once it has lost the
    // stream and failed to reconnect, its state is still what it was.
    drop(server);
    agent.wait_for_log("cannot connect to calc-server");
    assert_eq!(
        agent.state().unwrap(),
        before,
        "nothing changes while the server is gone"
    );

    // While it is down: delete api-1 and drop one policy.
    let wl = ds.path().join("workloads.yaml");
    let text = std::fs::read_to_string(&wl).unwrap();
    let docs: Vec<&str> = text
        .split("\n---\n")
        .filter(|d| !d.contains("name: node--1-k8s-api--1-eth0"))
        .collect();
    std::fs::write(&wl, docs.join("\n---\n")).unwrap();
    let pol = ds.path().join("policies.yaml");
    let text = std::fs::read_to_string(&pol).unwrap();
    let docs: Vec<&str> = text
        .split("\n---\n")
        .filter(|d| !d.contains("name: allow-ping"))
        .collect();
    std::fs::write(&pol, docs.join("\n---\n")).unwrap();

    // Restart on the same address: the agent reconnects, resyncs and sweeps.
    let server = Server::start_on(ds.path(), port, &[]);
    let after = agent.wait_for("api-1 and allow-ping swept", |s| {
        !keys(s, "workload_endpoints").contains(&"k8s/shop/api-1/eth0".to_string())
            && !keys(s, "policies").iter().any(|p| p.contains("allow-ping"))
    });
    assert_eq!(after["in_sync"], true);

    // A fresh agent for the same node sees exactly the same dataplane.
    let fresh_dir = tempfile::tempdir().unwrap();
    let fresh = Agent::start(fresh_dir.path(), &server.grpc, "node-1");
    let f = fresh.wait_for("fresh in sync", |s| s["in_sync"] == true);
    // The fresh agent replaced the first one's stream; compare what both programmed.
    assert_eq!(dataplane(&agent.state().unwrap()), dataplane(&f));
}

#[test]
fn a_broken_edit_keeps_the_last_good_version() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let server = Server::start(ds.path(), &[]);
    let b = Agent::start(work.path(), &server.grpc, "node-2");
    b.wait_for("in sync", |s| s["in_sync"] == true);
    let path = ds.path().join("policies.yaml");
    let good = std::fs::read_to_string(&path).unwrap();
    // An editor's backup of an older version next to the file is not a manifest.
    std::fs::write(ds.path().join("policies.yaml~"), "garbage: [").unwrap();
    // Break allow-postgres's selector: the policy must stay as it was on the node.
    let broken = good.replace("  selector: app == 'postgres'", "  selector: app ==");
    assert_ne!(broken, good);
    std::fs::write(&path, &broken).unwrap();
    let mut logged = false;
    for _ in 0..100 {
        if server.log_text().contains("allow-postgres") {
            logged = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        logged,
        "the bad object is reported by name: {}",
        server.log_text()
    );
    // Had the broken edit removed the policy, the removal would reach the agent before this.
    barrier(ds.path(), &b, "after-the-broken-edit");
    let s = b.state().unwrap();
    assert!(
        keys(&s, "policies").contains(&"NetworkPolicy/db/allow-postgres".to_string()),
        "{:?}",
        keys(&s, "policies")
    );
    assert!(
        !server.log_text().contains("policies.yaml~"),
        "backups are ignored"
    );
}

#[test]
fn an_emptied_manifest_keeps_its_objects_until_it_has_content_again() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let server = Server::start(ds.path(), &[]);
    let b = Agent::start(work.path(), &server.grpc, "node-2");
    b.wait_for("in sync", |s| s["in_sync"] == true);
    let policy = "NetworkPolicy/db/allow-postgres".to_string();
    assert!(keys(&b.state().unwrap(), "policies").contains(&policy));
    let path = ds.path().join("policies.yaml");
    let good = std::fs::read_to_string(&path).unwrap();
    // An editor truncates, then (here: much later) writes.
    std::fs::write(&path, "").unwrap();
    let mut warned = false;
    for _ in 0..100 {
        if server.log_text().contains("the file is empty") {
            warned = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(warned, "the empty file is reported: {}", server.log_text());
    // Had the empty file removed its policies, the removal would reach the agent before this.
    barrier(ds.path(), &b, "after-the-emptied-file");
    assert!(
        keys(&b.state().unwrap(), "policies").contains(&policy),
        "an emptied file must not delete its policies"
    );
    // Written back (with one port changed, so the agent shows that the server read the
    // content), then removed: removing the file is how its objects go.
    let edited = good.replace("ports: [\"5432:5433\"]", "ports: [\"5432:5434\"]");
    assert_ne!(edited, good);
    std::fs::write(&path, &edited).unwrap();
    b.wait_for("the written-back file's content at the agent", |s| {
        s["policies"][&policy].to_string().contains("5434")
    });
    std::fs::remove_file(&path).unwrap();
    b.wait_for("the removed file's policy deleted", |s| {
        !keys(s, "policies").contains(&policy)
    });
}
