//! The command-line contract of the offline tools (issue: Foundation). Users and scripts rely on
//! these exact forms: output, exit codes, where errors go.

use std::path::Path;
use std::process::{Command, Output};

fn calc_server(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_calc-server"))
        .args(args)
        .output()
        .expect("run calc-server")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn selector_eval_prints_true_or_false() {
    let o = calc_server(&[
        "selector",
        "eval",
        "--labels",
        r#"{"app":"web","tier":"front"}"#,
        "app == 'web' && has(tier)",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), "true\n");
    let o = calc_server(&[
        "selector",
        "eval",
        "--labels",
        r#"{"app":"web"}"#,
        "app != 'web'",
    ]);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(stdout(&o), "false\n");
    // A label that is absent makes `!=` and `not in` true, as in Calico.
    let o = calc_server(&["selector", "eval", "--labels", "{}", "app not in {'web'}"]);
    assert_eq!(stdout(&o), "true\n");
}

#[test]
fn selector_eval_rejects_bad_selector_with_exit_2() {
    let o = calc_server(&["selector", "eval", "--labels", "{}", "app = 'web'"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stdout.is_empty());
    let err = stderr(&o);
    assert!(
        err.contains("at byte 4"),
        "error says where the selector broke: {err}"
    );
}

/// The CLI passes the selector as given: it accepts exactly what the datastore's parser
/// accepts (a trailing newline is refused there, so here too).
#[test]
fn selector_eval_takes_the_text_as_given() {
    for (text, valid) in [
        ("a == \"b\" \n", false),
        (
            "\ta == \"b\"",
            calc_graph::selector::parse("\ta == \"b\"").is_ok(),
        ),
        (
            " a == \"b\" ",
            calc_graph::selector::parse(" a == \"b\" ").is_ok(),
        ),
        ("a == \"b\"", true),
    ] {
        assert_eq!(
            calc_graph::selector::parse(text).is_ok(),
            valid,
            "the parser's verdict on {text:?}"
        );
        let o = calc_server(&["selector", "eval", "--labels", r#"{"a": "b"}"#, text]);
        if valid {
            assert_eq!(
                (o.status.code(), stdout(&o).as_str()),
                (Some(0), "true\n"),
                "{text:?}"
            );
        } else {
            assert_eq!(
                o.status.code(),
                Some(2),
                "{text:?} is refused: {}",
                stdout(&o)
            );
            assert!(stderr(&o).contains("selector"), "{}", stderr(&o));
        }
    }
}

#[test]
fn selector_eval_rejects_bad_labels_with_exit_2() {
    let o = calc_server(&["selector", "eval", "--labels", r#"{"a": 1}"#, "has(a)"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--labels"), "{}", stderr(&o));
}

#[test]
fn selector_normalize_prints_one_json_object() {
    let o = calc_server(&["selector", "normalize", " all() "]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("one JSON object");
    assert_eq!(
        v,
        serde_json::json!({"canonical": "all()", "unique_id": "s:5y5I3VdRZfDU01O--xXAPx2yxCQQqMf0M6IWug"})
    );
    assert_eq!(stdout(&o).lines().count(), 1);
    let o = calc_server(&[
        "selector",
        "normalize",
        "a == \"1\" || b == \"2\" && c == \"3\"",
    ]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["canonical"], "(a == \"1\" || (b == \"2\" && c == \"3\"))");
    assert_eq!(v["unique_id"], "s:56Xc0A7csNp3GP5O899NX2z-Ipd4BIUtjkhm5A");
}

#[test]
fn selector_normalize_parse_error_exits_2() {
    let o = calc_server(&["selector", "normalize", "has("]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stdout.is_empty());
    assert!(!stderr(&o).is_empty());
}

fn write(dir: &Path, name: &str, text: &str) {
    let p = dir.join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

const GOOD: &str = "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {name: good}\nspec: {selector: all()}\n";

#[test]
fn validate_reports_every_invalid_object_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a-good.yaml", GOOD);
    write(
        dir.path(),
        "b-bad.yaml",
        "apiVersion: projectcalico.org/v3\nkind: NetworkPolicy\nmetadata: {name: p, namespace: prod}\nspec:\n  selector: \"a ==\"\n  ingress: [{action: Allow, protocol: TCP, destination: {ports: ['90:80']}}]\n---\napiVersion: projectcalico.org/v3\nkind: Tier\nmetadata: {name: t}\nspec: {defaultAction: Maybe}\n",
    );
    write(dir.path(), "sub/c.json", "{not json");
    write(dir.path(), "notes.txt", "not a manifest, not read");
    let o = calc_server(&["validate", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert!(
        lines[0].ends_with("b-bad.yaml: document 1: NetworkPolicy prod/p: spec.selector: invalid selector: expected a quoted string after '==', found end of selector at byte 4 of selector \"a ==\""),
        "{out}"
    );
    assert!(lines[1].contains("document 1: NetworkPolicy prod/p: spec.ingress[0].destination.ports[0]: invalid port \"90:80\""), "{out}");
    assert!(
        lines[2].contains("document 2: Tier t: spec.defaultAction:"),
        "{out}"
    );
    assert!(lines[3].contains("c.json: invalid JSON"), "{out}");
    assert!(stderr(&o).contains("1 valid"), "{}", stderr(&o));
}

#[test]
fn validate_accepts_a_clean_directory_and_skips_status() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "policy.yaml", GOOD);
    // The file datastore writes endpoint status here; it is not a manifest.
    write(
        dir.path(),
        "status/node-1.json",
        "{\"not\": \"a resource\"}",
    );
    let o = calc_server(&["validate", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert!(o.stdout.is_empty());
}

#[test]
fn validate_reports_duplicates_and_missing_paths() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "one.yaml", GOOD);
    write(dir.path(), "two.yaml", GOOD);
    let missing = dir.path().join("missing.yaml");
    let o = calc_server(&[
        "validate",
        dir.path().to_str().unwrap(),
        missing.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    assert!(
        out.contains("two.yaml: document 1: GlobalNetworkPolicy good is defined again"),
        "{out}"
    );
    assert!(out.contains("missing.yaml: cannot read"), "{out}");
}

#[test]
fn validate_without_paths_is_a_usage_error() {
    let o = calc_server(&["validate"]);
    assert_eq!(o.status.code(), Some(2));
}

fn examples() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/cluster")
}

fn payload_type(v: &serde_json::Value) -> String {
    v.as_object()
        .unwrap()
        .keys()
        .find(|k| *k != "sequenceNumber")
        .cloned()
        .unwrap_or_default()
}

#[test]
fn compute_prints_one_todataplane_per_line_through_in_sync() {
    let o = calc_server(&[
        "compute",
        "--file-dir",
        examples().to_str().unwrap(),
        "--node",
        "node-1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is one JSON object"))
        .collect();
    let seqs: Vec<u64> = lines
        .iter()
        .map(|l| l["sequenceNumber"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=lines.len() as u64).collect::<Vec<_>>(),
        "sequence numbers count from 1"
    );
    let types: Vec<String> = lines.iter().map(payload_type).collect();
    assert_eq!(types.first().map(String::as_str), Some("configUpdate"));
    assert_eq!(
        types.last().map(String::as_str),
        Some("inSync"),
        "snapshot ends with InSync"
    );
    assert_eq!(
        types
            .iter()
            .filter(|t| *t == "workloadEndpointUpdate")
            .count(),
        3,
        "node-1 has three pods"
    );
    // Dependencies first: every IP set before every policy, every policy before every endpoint.
    let first = |t: &str| types.iter().position(|x| x == t).unwrap();
    let last = |t: &str| types.iter().rposition(|x| x == t).unwrap();
    assert!(last("ipsetUpdate") < first("activePolicyUpdate"));
    assert!(last("activePolicyUpdate") < first("activeProfileUpdate"));
    assert!(last("activeProfileUpdate") < first("workloadEndpointUpdate"));
    // Node 1 does not run node 2's database, so it does not get postgres's policy.
    assert!(!stdout(&o).contains("\"allow-postgres\""));
}

#[test]
fn compute_all_nodes_writes_a_file_per_node() {
    let out = tempfile::tempdir().unwrap();
    let o = calc_server(&[
        "compute",
        "--file-dir",
        examples().to_str().unwrap(),
        "--all-nodes",
        "--out-dir",
        out.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for node in ["node-1", "node-2"] {
        let text = std::fs::read_to_string(out.path().join(format!("{node}.jsonl"))).unwrap();
        assert!(text.lines().last().unwrap().contains("inSync"), "{node}");
    }
    let node2 = std::fs::read_to_string(out.path().join("node-2.jsonl")).unwrap();
    assert!(node2.contains("\"allow-postgres\"") && node2.contains("hostEndpointUpdate"));
}

/// Run from a directory without the example cluster and without --file-dir, the error says
/// the default was used and how to give a datastore, not "--file-dir X" the user never typed.
#[test]
fn the_default_file_dir_is_named_as_the_default() {
    let elsewhere = tempfile::tempdir().unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_calc-server"))
        .args(["compute", "--node", "node-1"])
        .current_dir(elsewhere.path())
        .env_remove("CALC_SERVER_FILE_DIR")
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0));
    let err = stderr(&o);
    assert!(
        err.contains("default file datastore") && err.contains("give --file-dir"),
        "{err}"
    );
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_calc-server"))
        .args(["compute", "--node", "node-1", "--file-dir", "no-such-dir"])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    assert!(
        stderr(&o).contains("--file-dir no-such-dir is not a directory"),
        "{}",
        stderr(&o)
    );
}

/// `compute` and `serve` agree on a node the datastore does not know: an error naming the
/// flag and the known nodes, unless --allow-unknown-nodes, which shows what serve would then send.
#[test]
fn compute_refuses_an_unknown_node_as_serve_does() {
    let dir = examples();
    let dir = dir.to_str().unwrap();
    let o = calc_server(&["compute", "--file-dir", dir, "--node", "node-9"]);
    assert_ne!(o.status.code(), Some(0), "{}", stdout(&o));
    assert!(o.stdout.is_empty());
    let err = stderr(&o);
    assert!(
        err.contains("node-9")
            && err.contains("--allow-unknown-nodes")
            && err.contains("node-1, node-2"),
        "{err}"
    );
    let o = calc_server(&[
        "compute",
        "--file-dir",
        dir,
        "--node",
        "node-9",
        "--allow-unknown-nodes",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.lines().last().unwrap().contains("inSync"), "{out}");
    assert!(!out.contains("workloadEndpointUpdate"), "{out}");
}

#[test]
fn compute_reports_bad_manifests_and_computes_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(examples()).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
        }
    }
    write(
        dir.path(),
        "zz-bad.yaml",
        "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {name: broken}\nspec: {selector: \"a ==\"}\n",
    );
    let o = calc_server(&[
        "compute",
        "--file-dir",
        dir.path().to_str().unwrap(),
        "--node",
        "node-1",
    ]);
    assert_eq!(o.status.code(), Some(0));
    assert!(
        stderr(&o).contains("zz-bad.yaml: document 1: GlobalNetworkPolicy broken"),
        "{}",
        stderr(&o)
    );
    assert!(stdout(&o).lines().last().unwrap().contains("inSync"));
}

#[test]
fn compute_reads_network_policy_api_kinds_from_files() {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(examples()).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
        }
    }
    write(
        dir.path(),
        "admin.yaml",
        r#"apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: isolate-monitoring}
spec:
  tier: Admin
  priority: 10
  subject:
    namespaces:
      matchLabels: {projectcalico.org/name: monitoring}
  ingress:
  - name: deny-shop
    action: Deny
    from:
    - namespaces:
        matchLabels: {projectcalico.org/name: shop}
    protocols:
    - tcp: {destinationPort: {range: {start: 9000, end: 9100}}}
  egress:
  - name: to-nodes
    action: Deny
    to: [{nodes: {}}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {}}
  ingress:
  - action: Deny
    from: [{namespaces: {}}]
"#,
    );
    let o = calc_server(&[
        "compute",
        "--file-dir",
        dir.path().to_str().unwrap(),
        "--node",
        "node-1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let policy_ids: Vec<(String, String)> = lines
        .iter()
        .filter_map(|l| l.get("activePolicyUpdate"))
        .map(|p| {
            let id = &p["id"];
            (
                id["name"].as_str().unwrap().to_string(),
                id["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for id in [
        ("isolate-monitoring", "KubernetesClusterNetworkPolicy"),
        (
            "kbanp.baselineadminnetworkpolicy.default",
            "GlobalNetworkPolicy",
        ),
    ] {
        assert!(
            policy_ids.contains(&(id.0.into(), id.1.into())),
            "{id:?} in {policy_ids:?}"
        );
    }
    // Prometheus's tiers: the built-in ones around the default tier from the manifests.
    let prometheus = lines
        .iter()
        .filter_map(|l| l.get("workloadEndpointUpdate"))
        .find(|w| w["id"]["workloadId"] == "monitoring/prometheus-0")
        .expect("prometheus is on node-1");
    let tiers: Vec<&str> = prometheus["endpoint"]["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    let at = |t: &str| tiers.iter().position(|x| *x == t);
    assert!(
        at("kube-admin").is_some()
            && at("kube-admin") < at("baselineadminnetworkpolicy")
            && tiers.last() == Some(&"baselineadminnetworkpolicy"),
        "{tiers:?}"
    );
    // The rule with a nodes peer failed closed, and the operator is told which.
    assert!(
        stderr(&o).contains(
            "admin.yaml: document 1: ClusterNetworkPolicy isolate-monitoring: egress rule 0 (\"to-nodes\") cannot be converted"
        ),
        "{}",
        stderr(&o)
    );
}

#[test]
fn compute_on_kubernetes_names_a_bad_kubeconfig() {
    let o = calc_server(&[
        "compute",
        "--datastore-type",
        "kubernetes",
        "--kubeconfig",
        "/nonexistent/kubeconfig",
        "--node",
        "n",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("reading --kubeconfig /nonexistent/kubeconfig"),
        "{}",
        stderr(&o)
    );
}

/// A workload on node-1 whose egress policy names a Service, the Service's EndpointSlice (in
/// Kubernetes' shape) and the Service itself, as `kubectl get -o yaml` writes them.
const SERVICE_MANIFESTS: &str = r#"
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--1-k8s-client-eth0, namespace: shop, labels: {app: client}}
spec: {orchestrator: k8s, node: node-1, pod: client, endpoint: eth0, interfaceName: caliclient, ipNetworks: [10.65.0.2/32]}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: client-to-db, namespace: shop}
spec:
  selector: app == 'client'
  types: [Egress]
  egress:
  - action: Allow
    destination: {services: {name: db}}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec: {selector: {app: db}, ports: [{port: 5432, targetPort: 5432}], clusterIP: 10.96.0.20}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: db-x7k2p
  namespace: shop
  labels: {kubernetes.io/service-name: db}
addressType: IPv4
endpoints:
- addresses: [10.65.1.5]
  conditions: {ready: true}
  nodeName: node-2
- addresses: [10.65.1.6]
  conditions: {ready: false}
ports:
- {name: pg, protocol: TCP, port: 5432}
"#;

#[test]
fn compute_fills_a_service_rule_from_the_manifests_endpoint_slices() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "shop.yaml", SERVICE_MANIFESTS);
    let v = calc_server(&["validate", dir.path().to_str().unwrap()]);
    assert_eq!(v.status.code(), Some(0), "{}{}", stdout(&v), stderr(&v));
    let o = calc_server(&[
        "compute",
        "--file-dir",
        dir.path().to_str().unwrap(),
        "--node",
        "node-1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let policy = lines
        .iter()
        .find_map(|l| l.get("activePolicyUpdate"))
        .expect("the client's policy");
    let rule = &policy["policy"]["outboundRules"][0];
    let id = rule["dstIpPortSetIds"][0].as_str().expect("a service set");
    let set = lines
        .iter()
        .find_map(|l| l.get("ipsetUpdate").filter(|s| s["id"] == id))
        .expect("the service's set is sent");
    assert_eq!(set["type"], "IP_AND_PORT");
    assert_eq!(
        set["members"],
        serde_json::json!(["10.65.1.5,tcp:5432", "10.65.1.6,tcp:5432"]),
        "every endpoint of the Service on its port"
    );
}

/// Two workloads in namespace `app` on node-1, a deny-by-default for the db and the policy that
/// lets the client in (`ALLOW_DB`).
const CLIENT_AND_DB: &str = r#"
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.app}
spec: {ingress: [{action: Allow}], egress: [{action: Allow}]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--1-k8s-client-eth0, namespace: app, labels: {app: client}}
spec: {orchestrator: k8s, node: node-1, pod: client, endpoint: eth0, interfaceName: cali0client1, ipNetworks: [10.65.0.1/32], profiles: [kns.app]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--1-k8s-db-eth0, namespace: app, labels: {app: db}}
spec: {orchestrator: k8s, node: node-1, pod: db, endpoint: eth0, interfaceName: cali0db00001, ipNetworks: [10.65.0.2/32], profiles: [kns.app]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: db-default-deny}
spec: {order: 1000, selector: app == 'db', types: [Ingress]}
"#;

const ALLOW_DB: &str = "apiVersion: projectcalico.org/v3\nkind: NetworkPolicy\nmetadata: {name: allow-client, namespace: app}\nspec: {order: 100, selector: app == 'db', types: [Ingress], ingress: [{action: Allow, protocol: TCP, source: {selector: app == 'client'}, destination: {ports: [5432]}}]}\n";

/// What the server would have saved for `ALLOW_DB` in the last-good store at `store`.
fn save_last_good(store: &Path) {
    let entry = calc_graph::manifest::parse_manifest(ALLOW_DB)
        .unwrap()
        .remove(0);
    let calc_graph::manifest::Outcome::Valid(key, valid) = entry.outcome else {
        panic!("{:?}", entry.outcome);
    };
    let (mut lg, _, problems) =
        calc_server::datastore::file::last_good::LastGood::open(Some(store.to_path_buf()));
    assert!(problems.is_empty(), "{problems:?}");
    lg.save(&key, &valid);
}

fn explain_db(dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "explain",
        "--file-dir",
        dir.to_str().unwrap(),
        "--from",
        "app/client",
        "--to",
        "app/db",
        "--port",
        "5432",
    ];
    args.extend_from_slice(extra);
    calc_server(&args)
}

/// `compute` and `explain` answer as the server enforces when an object is held at its last
/// good version (issue 39, item 3): they read the server's last-good store (serve's default
/// place, or --last-good-dir) and use the last good version of the invalid policy, saying so on
/// stderr. Without a store they leave it out, and say which invalid objects a running server
/// may hold older versions of: a warning from compute, a note in explain's text and JSON.
#[test]
fn compute_and_explain_use_the_last_good_version_a_server_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "cluster.yaml", CLIENT_AND_DB);
    write(
        d,
        "allow.yaml",
        &ALLOW_DB.replace("selector: app == 'db'", "selector: app =="),
    );
    save_last_good(&d.join("status/last-good"));
    let dir_arg = d.to_str().unwrap();
    let compute = |extra: &[&str]| {
        let mut args = vec!["compute", "--file-dir", dir_arg, "--node", "node-1"];
        args.extend_from_slice(extra);
        calc_server(&args)
    };

    // The store at serve's default place: what the server keeps in force.
    let o = compute(&[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("\"allow-client\""), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("note: NetworkPolicy app/allow-client: what the manifests hold of it is not usable; its last good version from the last-good store"),
        "{}",
        stderr(&o)
    );
    let o = explain_db(d, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("ALLOW"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("note:"), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("note: NetworkPolicy app/allow-client"),
        "{}",
        stderr(&o)
    );

    // The store elsewhere, named by --last-good-dir (as serve's flag).
    let elsewhere = tempfile::tempdir().unwrap();
    save_last_good(elsewhere.path());
    std::fs::remove_dir_all(d.join("status")).unwrap();
    let o = compute(&["--last-good-dir", elsewhere.path().to_str().unwrap()]);
    assert!(stdout(&o).contains("\"allow-client\""), "{}", stderr(&o));

    // No store: left out, and said so.
    let o = compute(&[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stdout(&o).contains("\"allow-client\""), "{}", stdout(&o));
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "warning: no last-good store at {}",
            d.join("status/last-good").display()
        )) && err.contains("a running server may keep older (last good) versions of them in force: NetworkPolicy app/allow-client"),
        "{err}"
    );
    let o = explain_db(d, &["--last-good-dir", ""]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("DENY"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("note: no last-good store is read")
                && l.ends_with("in force: NetworkPolicy app/allow-client")),
        "{out}"
    );
    let o = explain_db(d, &["--output", "json"]);
    let answer: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let notes = answer["notes"].as_array().expect("notes");
    assert_eq!(notes.len(), 1, "{answer}");
    assert!(
        notes[0]
            .as_str()
            .unwrap()
            .ends_with("in force: NetworkPolicy app/allow-client"),
        "{answer}"
    );
}

/// `recommend --promote --file`: the enforced kind of each staged policy in the files, ready to
/// apply (and read back by the manifest reader); a staged deletion is not promoted, said on
/// stderr; nothing to promote is an error. Without --namespace (and not promoting) it is a
/// usage error, as is --check with a recommendation option.
#[test]
fn recommend_promotes_staged_policies_from_files() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "staged.yaml",
        r#"apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata:
  name: recommended-web
  namespace: shop
  annotations: {recommend.calc-server/group: app=web}
spec:
  stagedAction: Set
  selector: app == 'web'
  types: [Ingress, Egress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {selector: app == 'lb'}
    destination: {ports: [80]}
    metadata: {annotations: {recommend.calc-server/count: "1"}}
---
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata: {name: gone, namespace: shop}
spec: {stagedAction: Delete, selector: all()}
---
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata: {name: elsewhere, namespace: other}
spec: {selector: all()}
"#,
    );
    let file = dir.path().join("staged.yaml");
    let o = calc_server(&[
        "recommend",
        "--promote",
        "--namespace",
        "shop",
        "--file",
        file.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert_eq!(out.matches("kind: \"NetworkPolicy\"").count(), 1, "{out}");
    assert!(out.contains("name: \"recommended-web\""), "{out}");
    assert!(out.contains("recommend.calc-server/count: \"1\""), "{out}");
    assert!(!out.contains("stagedAction"), "{out}");
    assert!(!out.contains("elsewhere"), "--namespace narrows: {out}");
    assert!(
        stderr(&o).contains("not promoted: gone: stagedAction Delete"),
        "{}",
        stderr(&o)
    );
    // What it prints is a valid manifest.
    write(dir.path(), "enforced.yaml", &out);
    std::fs::remove_file(&file).unwrap();
    let v = calc_server(&["validate", dir.path().to_str().unwrap()]);
    assert!(v.status.success(), "{}{}", stdout(&v), stderr(&v));

    let none = calc_server(&[
        "recommend",
        "--promote",
        "--file",
        dir.path().join("enforced.yaml").to_str().unwrap(),
    ]);
    assert_eq!(none.status.code(), Some(2));
    assert!(stderr(&none).contains("no staged policy to promote"));

    let no_ns = calc_server(&["recommend", "--server", "127.0.0.1:1"]);
    assert_eq!(no_ns.status.code(), Some(2));
    assert!(stderr(&no_ns).contains("--namespace NS is required"));
    let mixed = calc_server(&["recommend", "--namespace", "shop", "--check", "--tier", "x"]);
    assert_eq!(mixed.status.code(), Some(2));
    assert!(
        stderr(&mixed).contains("cannot be used with"),
        "{}",
        stderr(&mixed)
    );
}
