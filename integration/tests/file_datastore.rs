//! The file datastore under an unlucky operator: invalid objects keep their last good version
//! across a server restart, so do documents whose kind, apiVersion or name an edit broke,
//! broken files renamed are not deletes, duplicates are reported with both files, and hostile
//! directories (symlink cycles, alias bombs, a 50 MB label) neither stall the server nor stop a
//! good change. Real server, real agents (dry-run driver).
//!
//! Every wait is for a condition (the agent's state, the server's status or log), never a fixed
//! sleep: a test that says an edit was processed has seen it processed.

use std::path::Path;
use std::time::Duration;

use integration::netns::wait_until;
use integration::{Agent, Server, example_datastore, free_port, http_get};
use serde_json::Value;

fn policies(v: &Value) -> Vec<String> {
    v["policies"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

const POLICY: &str = "NetworkPolicy/db/allow-postgres";

/// policies.yaml with allow-postgres made invalid (a selector that does not parse).
fn break_policy(dir: &Path) -> String {
    let path = dir.join("policies.yaml");
    let good = std::fs::read_to_string(&path).unwrap();
    let bad = good.replace("selector: app == 'postgres'", "selector: app == ");
    assert_ne!(good, bad);
    std::fs::write(&path, bad).unwrap();
    good
}

/// Whether `node`'s agent has applied everything this server sent it (its snapshot included).
fn programmed(server: &Server, node: &str) -> bool {
    server.status().as_array().is_some_and(|nodes| {
        nodes.iter().any(|n| {
            n["node"] == node
                && n["connected"] == true
                && n["programmed"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("yes"))
        })
    })
}

fn datastore_health(server: &Server) -> Value {
    let (code, body) = http_get(&server.admin, "/status/datastore").expect("admin answers");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn an_invalid_policy_keeps_its_last_good_version_across_a_restart() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = Server::start_on(ds.path(), port, &[]);
    let agent = Agent::start(work.path(), &server.grpc, "node-2");
    agent.wait_for("in sync", |s| s["in_sync"] == true);
    assert!(policies(&agent.state().unwrap()).contains(&POLICY.to_string()));
    break_policy(ds.path());
    wait_until(
        "the invalid policy reported as held",
        Duration::from_secs(10),
        || {
            datastore_health(&server)["held_last_good"]
                .to_string()
                .contains("allow-postgres")
        },
        || server.log_text(),
    );
    // Restarted while the policy is invalid: the store gives its last good version back.
    drop(server);
    let server = Server::start_on(ds.path(), port, &[]);
    let health = datastore_health(&server);
    assert!(
        health["held_last_good"]
            .to_string()
            .contains("allow-postgres"),
        "{health}"
    );
    assert_eq!(health["without_last_good"], serde_json::json!([]));
    // The agent reconnects and applies the restarted server's snapshot.
    wait_until(
        "the agent programmed from the restarted server",
        Duration::from_secs(20),
        || programmed(&server, "node-2"),
        || server.log_text(),
    );
    let state = agent.state().expect("agent state");
    assert!(
        policies(&state).contains(&POLICY.to_string()),
        "the enforced policy must survive a restart with an invalid overwrite"
    );
    // An object invalid from the start has no last good version: said loudly, not dropped
    // silently.
    std::fs::write(
        ds.path().join("new.yaml"),
        "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {name: deny-new}\nspec: {selector: 'app ==', ingress: [{action: Deny}]}\n",
    )
    .unwrap();
    wait_until(
        "the readiness body names it",
        Duration::from_secs(10),
        || {
            http_get(&server.admin, "/readiness").is_some_and(|(code, body)| {
                code == 200 && body.contains("GlobalNetworkPolicy deny-new")
            })
        },
        || server.log_text(),
    );
    let (_, metrics) = http_get(&server.admin, "/metrics").unwrap();
    assert!(
        metrics.contains("calc_server_objects_without_last_good 1\n"),
        "{metrics}"
    );
    assert!(server.log_text().contains("no known last good version"));
}

#[test]
fn a_broken_file_renamed_is_not_a_delete_and_duplicates_name_both_files() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let server = Server::start(ds.path(), &[]);
    let agent = Agent::start(work.path(), &server.grpc, "node-2");
    agent.wait_for("in sync", |s| s["in_sync"] == true);
    let path = ds.path().join("policies.yaml");
    let good = std::fs::read_to_string(&path).unwrap();
    // Broken beyond parsing (and read so), then renamed: the file's objects are unknown, not
    // gone.
    std::fs::write(&path, format!("{good}\n  - : [unclosed\n")).unwrap();
    wait_until(
        "the broken file read",
        Duration::from_secs(10),
        || server.log_text().contains("policies.yaml: invalid YAML"),
        || server.log_text(),
    );
    std::fs::rename(&path, ds.path().join("policies.yml")).unwrap();
    wait_until(
        "the broken file reported under its new name",
        Duration::from_secs(10),
        || server.log_text().contains("policies.yml: invalid YAML"),
        || server.log_text(),
    );
    // A change written after the rename reaches the agent only once the rename (the old name
    // gone, the new one read) has been processed too: the watcher handles files in order.
    write_marker(ds.path(), 1);
    let state = agent.wait_for("the marker after the rename", |s| has_marker(s, 1));
    assert!(
        policies(&state).contains(&POLICY.to_string()),
        "a broken file renamed must keep its policies"
    );
    assert!(
        datastore_health(&server)["held_last_good"]
            .to_string()
            .contains("allow-postgres"),
        "held while the renamed file is broken"
    );
    // Fixed under the new name: nothing changes for the agent; the same object in a second
    // file is reported once, naming both files.
    std::fs::write(ds.path().join("policies.yml"), &good).unwrap();
    std::fs::write(ds.path().join("zz-copy.yaml"), &good).unwrap();
    wait_until(
        "the duplicate reported",
        Duration::from_secs(10),
        || {
            let log = server.log_text();
            log.lines().any(|l| {
                l.contains("defined in several files")
                    && l.contains("allow-postgres")
                    && l.contains("policies.yml")
                    && l.contains("zz-copy.yaml")
            })
        },
        || server.log_text(),
    );
    // Removing both files is how the objects go.
    std::fs::remove_file(ds.path().join("policies.yml")).unwrap();
    std::fs::remove_file(ds.path().join("zz-copy.yaml")).unwrap();
    agent.wait_for("the policy deleted", |s| {
        !policies(s).contains(&POLICY.to_string())
    });
}

/// A policy named `marker-<n>` in a document of its own: once the agent has it, the server
/// has processed everything written before it (in its file: the same read).
fn marker_doc(n: u32) -> String {
    format!(
        "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {{name: marker-{n}}}\nspec: {{selector: all(), types: [Ingress], ingress: [{{action: Allow, protocol: TCP, destination: {{ports: [{}]}}}}]}}\n",
        1000 + n
    )
}

/// The marker in a file of its own (written after another change, it is read with or after
/// that change: every file waits to settle for the same interval).
fn write_marker(dir: &Path, n: u32) {
    std::fs::write(dir.join("zz-marker.yaml"), marker_doc(n)).unwrap();
}

fn has_marker(state: &Value, n: u32) -> bool {
    policies(state).contains(&format!("GlobalNetworkPolicy/marker-{n}"))
}

/// A deny every endpoint meets.
const DENY: &str = "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {name: deny-ssh}\nspec: {order: 1, selector: all(), types: [Ingress], ingress: [{action: Deny, protocol: TCP, destination: {ports: [22]}}]}\n";
const DENY_KEY: &str = "GlobalNetworkPolicy/deny-ssh";

/// The edits that break the deny document's identity, each with a word of the reason logged.
fn identity_breaking_edits() -> [(&'static str, String, &'static str); 3] {
    [
        (
            "a name with a newline",
            DENY.replace("name: deny-ssh", "name: \"deny-ssh\\nx\""),
            "invalid name",
        ),
        (
            "a misspelt kind",
            DENY.replace("kind: GlobalNetworkPolicy", "kind: GlobalNetworkPolicyy"),
            "unknown kind",
        ),
        (
            "a wrong apiVersion",
            DENY.replace("projectcalico.org/v3", "projectcalico.org/v2"),
            "unsupported apiVersion",
        ),
    ]
}

/// An edit that breaks the identity of the deny's document (its name, kind or apiVersion) is an
/// invalid edit, not a delete: the agents keep the deny exactly as it was, the server names it
/// as held and logs the file, document and reason; repaired, it is the file's again. Broken
/// across a restart, the last-good store keeps it; only removing the file takes it away. Each
/// edit rewrites the file with a new marker in its first document, so the agent having the
/// marker means the server has read the broken document.
#[test]
fn an_edit_that_breaks_a_deny_documents_identity_keeps_it_on_the_agents() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = Server::start_on(ds.path(), port, &[]);
    let agent = Agent::start(work.path(), &server.grpc, "node-2");
    let file = ds.path().join("deny.yaml");
    let write = |n: u32, deny: &str| {
        std::fs::write(&file, format!("{}---\n{deny}", marker_doc(n))).unwrap();
    };
    write(0, DENY);
    let before = agent.wait_for("the deny in force", |s| {
        s["in_sync"] == true && has_marker(s, 0) && policies(s).contains(&DENY_KEY.to_string())
    })["policies"][DENY_KEY]
        .clone();
    assert!(before.to_string().contains("deny"), "{before}");

    let mut n = 0;
    for (what, broken, reason) in identity_breaking_edits() {
        n += 1;
        write(n, &broken);
        let state = agent.wait_for(&format!("the marker after {what}"), |s| has_marker(s, n));
        assert_eq!(
            state["policies"][DENY_KEY], before,
            "{what}: the deny must stay in force as it was"
        );
        let health = datastore_health(&server);
        assert_eq!(
            health["held_last_good"],
            serde_json::json!(["GlobalNetworkPolicy deny-ssh"]),
            "{what}: {health}"
        );
        let log = server.log_text();
        assert!(
            log.lines().any(
                |l| l.contains("deny.yaml: document 2: cannot be identified (")
                    && l.contains(reason)
                    && l.contains("keeps its last good version: GlobalNetworkPolicy deny-ssh")
            ),
            "{what}: the file, document, reason and what stays in force are logged:\n{log}"
        );
        // Repaired: the file's version again, held no more.
        n += 1;
        write(n, DENY);
        let state = agent.wait_for(&format!("the marker after repairing {what}"), |s| {
            has_marker(s, n)
        });
        assert_eq!(state["policies"][DENY_KEY], before, "{what}");
        assert_eq!(
            datastore_health(&server)["held_last_good"],
            serde_json::json!([]),
            "{what}"
        );
    }

    // Never taken out, even for a moment: the agent added it once and never changed it.
    let changes = agent
        .log_text()
        .lines()
        .filter(|l| l.contains("dry-run: policy") && l.contains("deny-ssh"))
        .count();
    assert_eq!(changes, 1, "{}", agent.log_text());

    // Broken while the server restarts: it starts from the last-good store's version.
    n += 1;
    write(n, &identity_breaking_edits()[1].1);
    agent.wait_for("the marker before the restart", |s| has_marker(s, n));
    drop(server);
    let server = Server::start_on(ds.path(), port, &[]);
    wait_until(
        "the agent programmed from the restarted server",
        Duration::from_secs(20),
        || programmed(&server, "node-2"),
        || server.log_text(),
    );
    let state = agent.state().expect("agent state");
    assert_eq!(
        state["policies"][DENY_KEY], before,
        "the deny must survive a restart with its document broken"
    );
    assert!(
        datastore_health(&server)["held_last_good"]
            .to_string()
            .contains("deny-ssh")
    );

    // Removing the file is how the deny goes.
    std::fs::remove_file(&file).unwrap();
    agent.wait_for("the deny deleted with its file", |s| {
        !policies(s).contains(&DENY_KEY.to_string()) && !has_marker(s, n)
    });
}

/// Nine levels of nine aliases: a few hundred bytes that expand to hundreds of millions of
/// strings if nothing bounds them.
fn alias_bomb() -> String {
    let mut y = String::from("a0: &a0 [x,x,x,x,x,x,x,x,x]\n");
    for i in 1..10 {
        let refs = vec![format!("*a{}", i - 1); 9].join(",");
        y.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
    }
    y
}

#[test]
fn a_hostile_directory_neither_stalls_the_server_nor_stops_a_good_change() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let server = Server::start(ds.path(), &[]);
    let agent = Agent::start(work.path(), &server.grpc, "node-2");
    agent.wait_for("in sync", |s| s["in_sync"] == true);
    // Symlink cycles, alias bombs, a 50 MB label value and a name that forges a log line.
    std::os::unix::fs::symlink(".", ds.path().join("backup")).unwrap();
    std::fs::create_dir(ds.path().join("sub")).unwrap();
    std::os::unix::fs::symlink("..", ds.path().join("sub/up")).unwrap();
    for i in 0..10 {
        std::fs::write(ds.path().join(format!("bomb-{i}.yaml")), alias_bomb()).unwrap();
    }
    std::fs::write(
        ds.path().join("huge-label.yaml"),
        format!(
            "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkSet\nmetadata: {{name: huge, labels: {{a: '{}'}}}}\nspec: {{nets: [10.0.0.0/8]}}\n",
            "x".repeat(50 * 1024 * 1024)
        ),
    )
    .unwrap();
    std::fs::write(
        ds.path().join("forged.yaml"),
        "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkSet\nmetadata: {name: \"evil\\n2026-01-01T00:00:00Z  INFO forged line\"}\nspec: {nets: [10.0.0.0/8]}\n",
    )
    .unwrap();
    wait_until(
        "the hostile files reported",
        Duration::from_secs(20),
        || {
            let log = server.log_text();
            log.contains("bomb-9.yaml")
                && log.contains("huge-label.yaml")
                && log.contains("forged.yaml")
        },
        || server.log_text(),
    );
    // The server answers and a good change reaches the agent, while all of it stays. (How
    // fast is a benchmark's question, not this test's.)
    assert!(http_get(&server.admin, "/liveness").is_some_and(|(c, _)| c == 200));
    let path = ds.path().join("policies.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("name: allow-postgres", "name: allow-postgres-renamed"),
    )
    .unwrap();
    agent.wait_for("the renamed policy", |s| {
        policies(s).contains(&"NetworkPolicy/db/allow-postgres-renamed".to_string())
    });
    let log = server.log_text();
    // Each problem once (not every poll), no line echoing the 50 MB value, no forged line.
    assert_eq!(
        log.matches("a symlinked directory; skipped").count(),
        2,
        "{log}"
    );
    assert!(
        log.lines().all(|l| l.len() < 8192),
        "a log line is too long"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("2026-01-01T00:00:00Z")),
        "a name forged a log line"
    );
}

/// `calc-server serve` with these arguments, run from `cwd`: its exit code and output once it
/// exits, or a panic naming what it printed if it is still serving after 10 s (it accepted).
fn serve_must_refuse(cwd: &Path, args: &[&str]) -> (Option<i32>, String) {
    let mut child = std::process::Command::new(integration::binary("calc-server"))
        .current_dir(cwd)
        .arg("serve")
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            return (out.status.code(), text);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    panic!(
        "serve {args:?} was accepted:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The server's own output is never read back as manifests (issue 39, item 1). A status or
/// last-good directory inside --file-dir other than `status` is refused at start, naming the
/// flag and both paths, however it is written (here relative, as an operator in the parent
/// directory types it). And whatever the paths, the walk never enters them: here the status
/// directory is outside, but a ConfigMap-style `..data` link inside --file-dir leads to it, so
/// before the fix the old last-good copy of a policy deleted from the manifests kept it alive.
#[test]
fn the_servers_own_output_is_never_read_as_manifests() {
    let ds = example_datastore();
    let parent = ds.path().parent().unwrap();
    let name = ds.path().file_name().unwrap().to_str().unwrap();
    for (flag, sub) in [("--status-dir", "zz"), ("--last-good-dir", "lg")] {
        let inside = format!("{name}/{sub}");
        let (code, out) = serve_must_refuse(parent, &["--file-dir", name, flag, &inside]);
        assert_ne!(code, Some(0), "{out}");
        assert!(
            out.contains(&format!("{flag} {inside} is inside --file-dir {name}")),
            "{out}"
        );
        assert!(!ds.path().join(sub).exists(), "nothing written: {out}");
    }

    // Accepted paths, but a link the walk follows leads into the status directory.
    let run = tempfile::tempdir().unwrap();
    let status = run.path().join("st");
    std::os::unix::fs::symlink(run.path(), ds.path().join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/st", ds.path().join("st")).unwrap();
    let work = tempfile::tempdir().unwrap();
    let server = Server::start(ds.path(), &["--status-dir", status.to_str().unwrap()]);
    let agent = Agent::start(work.path(), &server.grpc, "node-2");
    agent.wait_for("in sync", |s| policies(s).contains(&POLICY.to_string()));
    wait_until(
        "the status file and the last-good store written",
        Duration::from_secs(10),
        || {
            status.join("node-2.json").exists()
                && std::fs::read_to_string(status.join("last-good/objects.jsonl"))
                    .is_ok_and(|log| log.lines().count() >= 30)
        },
        || server.log_text(),
    );
    // Two more polls at least, then the policy deleted from the manifests: it goes.
    write_marker(ds.path(), 1);
    agent.wait_for("the marker", |s| has_marker(s, 1));
    let path = ds.path().join("policies.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("name: allow-postgres", "name: allow-postgres-renamed"),
    )
    .unwrap();
    agent.wait_for("the policy renamed, the old name gone", |s| {
        let p = policies(s);
        p.contains(&"NetworkPolicy/db/allow-postgres-renamed".to_string())
            && !p.contains(&POLICY.to_string())
    });
    let log = server.log_text();
    assert!(!log.contains("defined in several files"), "{log}");
    assert!(!log.contains("node-2.json"), "{log}");
}

/// A manifest that does not parse is a datastore problem like an invalid object (issue 39,
/// item 2): a new file with a YAML syntax error is named in `/status/datastore`, degrades
/// `/readiness` and counts in the metrics; fixed, it is all clear again. A file that held
/// objects keeps them at their last good versions while it does not parse.
#[test]
fn a_manifest_that_does_not_parse_is_reported_like_an_invalid_object() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let (_, metrics) = http_get(&server.admin, "/metrics").unwrap();
    let decode = r#"calc_server_rejected_objects_total{stage="decode"}"#;
    let decode_before = integration::metric(&metrics, decode).unwrap_or(0.0);
    std::fs::write(
        ds.path().join("zz-new.yaml"),
        "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {name: deny-new}\nspec: {selector: all(), ingress: [{action: Deny}\n",
    )
    .unwrap();
    wait_until(
        "the readiness body names the file",
        Duration::from_secs(10),
        || {
            http_get(&server.admin, "/readiness").is_some_and(|(code, body)| {
                code == 200
                    && body.starts_with("ready, degraded:")
                    && body.contains("zz-new.yaml (cannot be read or parsed)")
            })
        },
        || server.log_text(),
    );
    let health = datastore_health(&server);
    assert_eq!(
        health["without_last_good"].as_array().unwrap().len(),
        1,
        "{health}"
    );
    let (_, metrics) = http_get(&server.admin, "/metrics").unwrap();
    assert!(
        metrics.contains("calc_server_objects_without_last_good 1\n"),
        "{metrics}"
    );
    assert!(
        integration::metric(&metrics, decode).unwrap_or(0.0) > decode_before,
        "{metrics}"
    );
    // A file that held objects, broken: they are held, the file is named too.
    let path = ds.path().join("policies.yaml");
    let good = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, format!("{good}\n  - : [unclosed\n")).unwrap();
    wait_until(
        "the broken policies.yaml named, its objects held",
        Duration::from_secs(10),
        || {
            let h = datastore_health(&server);
            h["without_last_good"]
                .to_string()
                .contains("policies.yaml (cannot be read or parsed)")
                && h["held_last_good"].to_string().contains("allow-postgres")
        },
        || server.log_text(),
    );
    // Both fixed: ready, nothing to report.
    std::fs::write(&path, good).unwrap();
    std::fs::remove_file(ds.path().join("zz-new.yaml")).unwrap();
    wait_until(
        "plain ready again",
        Duration::from_secs(10),
        || http_get(&server.admin, "/readiness").is_some_and(|(_, body)| body == "ready\n"),
        || server.log_text(),
    );
    assert_eq!(
        datastore_health(&server),
        serde_json::json!({"held_last_good": [], "without_last_good": []})
    );
}

/// `calc-server compute` for `node`: the messages, one JSON value per line.
fn compute_messages(args: &[&str], node: &str) -> Vec<Value> {
    let out = std::process::Command::new(integration::binary("calc-server"))
        .arg("compute")
        .args(args)
        .args(["--node", node])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "compute {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The `kind` payloads (`activePolicyUpdate`, …) whose id's name starts with `prefix`, by name.
fn named(msgs: &[Value], kind: &str, prefix: &str) -> std::collections::BTreeMap<String, Value> {
    msgs.iter()
        .filter_map(|m| m.get(kind))
        .filter_map(|p| {
            let name = p["id"]["name"].as_str()?;
            name.starts_with(prefix)
                .then(|| (name.to_string(), p.clone()))
        })
        .collect()
}

/// Kubernetes manifests in a file datastore (issue 39, item 12): `examples/kubernetes` (the
/// Kubernetes documentation's NetworkPolicies, `v1` Namespaces, and the pods as
/// WorkloadEndpoints) validates and computes, and each NetworkPolicy and Namespace read from a
/// file becomes exactly what the Kubernetes datastore makes of the same object: the policies
/// `knp.default.<name>` with the same rules, the profiles `kns.<namespace>` with the same
/// labels (checked through the namespaceSelector's IP set), against the fake API server
/// serving those objects and the pods the WorkloadEndpoints stand for.
#[test]
fn kubernetes_manifests_in_files_become_what_the_kubernetes_datastore_makes_of_them() {
    use integration::fake_kube::{FakeKube, NAMESPACES, NETWORK_POLICIES, PODS};
    let examples = integration::workspace_root().join("examples/kubernetes");
    let examples_arg = examples.to_str().unwrap();
    let out = std::process::Command::new(integration::binary("calc-server"))
        .args(["validate", examples_arg])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("0 problem(s)"), "{err}");
    let from_files = compute_messages(&["--file-dir", examples_arg], "node1");

    let fake = FakeKube::start(&[]);
    for f in std::fs::read_dir(&examples).unwrap() {
        let text = std::fs::read_to_string(f.unwrap().path()).unwrap();
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
        for doc in docs {
            match doc["kind"].as_str().unwrap() {
                "Namespace" => fake.apply(NAMESPACES, doc),
                "NetworkPolicy" => fake.apply(NETWORK_POLICIES, doc),
                // The pod a WorkloadEndpoint stands for.
                "WorkloadEndpoint" => {
                    let (meta, spec) = (&doc["metadata"], &doc["spec"]);
                    let ports: Vec<Value> = spec["ports"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|p| serde_json::json!({"name": p["name"], "containerPort": p["port"]}))
                        .collect();
                    let ip = spec["ipNetworks"][0]
                        .as_str()
                        .unwrap()
                        .trim_end_matches("/32");
                    fake.apply(
                        PODS,
                        serde_json::json!({
                            "metadata": {"name": spec["pod"], "namespace": meta["namespace"],
                                         "labels": meta["labels"]},
                            "spec": {"nodeName": spec["node"],
                                     "containers": [{"name": "main", "ports": ports}]},
                            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
                        }),
                    );
                }
                other => panic!("{other} in examples/kubernetes: add it to this test"),
            }
        }
    }
    let kube = tempfile::tempdir().unwrap();
    let kubeconfig = fake.kubeconfig(kube.path());
    let from_kube = compute_messages(
        &[
            "--datastore-type",
            "kubernetes",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ],
        "node1",
    );

    let policies = named(&from_files, "activePolicyUpdate", "knp.default.");
    assert_eq!(
        policies.keys().collect::<Vec<_>>(),
        [
            "knp.default.allow-from-any-namespace",
            "knp.default.default-deny-ingress",
            "knp.default.multi-port-egress",
            "knp.default.named-port",
            "knp.default.test-network-policy",
        ]
    );
    assert_eq!(
        policies,
        named(&from_kube, "activePolicyUpdate", "knp.default.")
    );
    assert_eq!(
        named(&from_files, "activeProfileUpdate", "kns."),
        named(&from_kube, "activeProfileUpdate", "kns.")
    );
    // The namespaceSelector `project == 'myproject'` selects the client through its
    // namespace's profile labels: the same set, with the same member, both ways.
    let sets = |msgs: &[Value]| -> Vec<Value> {
        msgs.iter()
            .filter_map(|m| m.get("ipsetUpdate").cloned())
            .collect()
    };
    let file_sets = sets(&from_files);
    assert!(
        file_sets
            .iter()
            .any(|s| s["members"] == serde_json::json!(["10.65.1.5/32"])),
        "{file_sets:?}"
    );
    assert_eq!(file_sets, sets(&from_kube));
}
