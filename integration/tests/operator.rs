//! What an operator meets first: errors that say what to do, a status table that shows the node
//! that is missing, logs without colour codes in files, and docs that list every flag.

use std::process::Command;

use integration::{Agent, Server, binary, example_datastore, http_get, metric, workspace_root};

/// Every `--flag` and `[env: NAME]` the `--help` of `args` prints.
fn help_names(bin: &str, args: &[&str]) -> Vec<String> {
    let out = Command::new(binary(bin))
        .args(args)
        .arg("--help")
        .output()
        .expect("run --help");
    assert!(out.status.success(), "{bin} {args:?} --help failed");
    let text = String::from_utf8(out.stdout).expect("UTF-8 help");
    let mut names = Vec::new();
    for line in text.lines() {
        // Option lines: `--flag <V>` or `-x, --flag <V>`.
        let t = line.trim_start();
        let t = match t.as_bytes() {
            [b'-', c, b',', b' ', ..] if c.is_ascii_alphabetic() => &t[4..],
            _ => t,
        };
        if let Some(flag) = t.strip_prefix("--") {
            let name: String = flag
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            if !name.is_empty() && name != "help" && name != "version" {
                names.push(format!("--{name}"));
            }
        }
        if let Some(i) = line.find("[env: ") {
            let env: String = line[i + 6..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            names.push(env);
        }
    }
    assert!(!names.is_empty(), "no flags found in {bin} {args:?} --help");
    names
}

#[test]
fn every_flag_and_env_var_is_documented() {
    let doc = |name: &str| {
        std::fs::read_to_string(workspace_root().join("docs").join(name)).expect("doc")
    };
    let operations = doc("operations.md");
    // The bench tools share the global flags documented with the operator commands.
    let benchmarks = doc("benchmarks.md") + &operations;
    let commands: [(&str, &[&str], &str, &str); 23] = [
        ("calc-server", &[], "operations.md", &operations),
        ("calc-server", &["serve"], "operations.md", &operations),
        ("calc-server", &["status"], "operations.md", &operations),
        ("calc-server", &["policies"], "operations.md", &operations),
        ("calc-server", &["flows"], "operations.md", &operations),
        ("calc-server", &["recommend"], "operations.md", &operations),
        ("calc-server", &["compute"], "operations.md", &operations),
        ("calc-server", &["explain"], "operations.md", &operations),
        ("calc-server", &["validate"], "operations.md", &operations),
        ("dataplane-agent", &[], "operations.md", &operations),
        ("calc-bench", &[], "benchmarks.md", &benchmarks),
        ("calc-bench", &["gen-cluster"], "benchmarks.md", &benchmarks),
        ("calc-bench", &["bench"], "benchmarks.md", &benchmarks),
        ("calc-bench", &["bench-sync"], "benchmarks.md", &benchmarks),
        ("calc-bench", &["churn"], "benchmarks.md", &benchmarks),
        ("calc-bench", &["flip-kernel"], "benchmarks.md", &benchmarks),
        ("calc-bench", &["console"], "benchmarks.md", &benchmarks),
        ("calc-bench", &["recommend"], "benchmarks.md", &benchmarks),
        ("etcd-bench", &[], "benchmarks.md", &benchmarks),
        ("etcd-bench", &["load"], "benchmarks.md", &benchmarks),
        ("etcd-bench", &["list"], "benchmarks.md", &benchmarks),
        ("etcd-bench", &["cold-start"], "benchmarks.md", &benchmarks),
        ("linux-bench", &[], "benchmarks.md", &benchmarks),
    ];
    let mut missing = Vec::new();
    for (bin, args, doc_name, text) in commands {
        for name in help_names(bin, args) {
            // Whole names only: `--tls-ca-file` must not pass because `--tls-ca-file-x` is there.
            let found = text.match_indices(&name).any(|(i, _)| {
                !text[i + name.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            });
            if !found {
                missing.push(format!(
                    "{bin} {}: {name} (docs/{doc_name})",
                    args.join(" ")
                ));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "flags or env vars missing from the docs:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_readme_lists_the_packages_make_installs() {
    let deps = std::fs::read_to_string(workspace_root().join("scripts/deps.sh")).unwrap();
    let list = deps
        .split_once("PACKAGES=(")
        .and_then(|(_, rest)| rest.split_once(')'))
        .expect("PACKAGES=( … ) in scripts/deps.sh")
        .0;
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    for package in list.split_whitespace() {
        assert!(
            readme.contains(&format!("`{package}`")),
            "README.md does not name the package {package} that `make deps` installs"
        );
    }
}

#[test]
fn status_against_the_grpc_port_names_the_admin_address() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let grpc = server.grpc.trim_start_matches("http://");
    // status, and explain --server: the port's own message, no reset, no JSON parser noise.
    for args in [
        vec!["status", "--server", grpc],
        vec!["explain", "--server", grpc, "--policy", "block-threat-feed"],
    ] {
        let out = Command::new(binary("calc-server"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains("gRPC port") && err.contains("--admin-listen"),
            "{args:?}: {err}"
        );
        for noise in ["reset by peer", "expected ident", "line 1 column"] {
            assert!(!err.contains(noise), "{args:?}: {err}");
        }
    }
}

#[test]
fn status_lists_known_nodes_that_never_connected_in_aligned_columns() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &server.grpc, "node-1");
    agent.wait_for("in sync", |s| s["in_sync"] == true);
    let run = || {
        let out = Command::new(binary("calc-server"))
            .args(["status", "--server", &server.admin])
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    // The first heartbeat follows the hello.
    let mut table = run();
    for _ in 0..100 {
        if table.contains("s ago") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        table = run();
    }
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    let header = lines[0];
    let row = |node: &str| *lines.iter().find(|l| l.starts_with(node)).expect(node);
    let (one, two) = (row("node-1 "), row("node-2 "));
    assert!(one.contains(" yes ") && one.contains("s ago"), "{table}");
    assert!(two.contains(" never "), "{table}");
    for col in ["CONNECTED", "SINCE", "IN-SYNC", "ENDPOINTS"] {
        let at = header.find(col).unwrap();
        for l in [one, two] {
            assert_eq!(&l[at - 1..at], " ", "{col} misaligned:\n{table}");
            assert_ne!(&l[at..at + 1], " ", "{col} misaligned:\n{table}");
        }
    }
}

#[test]
fn an_unknown_node_is_refused_with_a_log_line_and_a_metric() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &server.grpc, "node-typo");
    let log = agent.wait_for_log("calc-server refused the stream");
    assert!(
        log.contains("node-typo") && log.contains("is not in the datastore"),
        "{log}"
    );
    // The agent's own log says what to do, not only the server's.
    assert!(
        log.contains("--node") && log.contains("--allow-unknown-nodes"),
        "{log}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !server.log_text().contains("refused an agent") {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            server.log_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let line = server
        .log_text()
        .lines()
        .find(|l| l.contains("refused an agent"))
        .unwrap()
        .to_owned();
    assert!(
        line.contains("node=node-typo") && line.contains("--allow-unknown-nodes"),
        "{line}"
    );
    let (_, text) = http_get(&server.admin, "/metrics").unwrap();
    assert!(
        metric(&text, "calc_server_unknown_node_refusals_total").is_some_and(|n| n >= 1.0),
        "{text}"
    );
    // Logs written to a file carry no colour codes.
    assert!(
        !server.log_text().contains('\u{1b}'),
        "server log has ANSI codes"
    );
    assert!(
        !agent.log_text().contains('\u{1b}'),
        "agent log has ANSI codes"
    );
}

#[test]
fn an_agent_pointed_at_the_admin_port_is_told_so() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &server.admin, "node-1");
    let log = agent.wait_for_log("calc-server refused the stream");
    let line = log
        .lines()
        .find(|l| l.contains("calc-server refused the stream"))
        .unwrap();
    assert!(
        line.contains("admin port") && line.contains("--listen"),
        "{line}"
    );
}

#[test]
fn status_files_go_to_the_status_dir() {
    let ds = example_datastore();
    let status = tempfile::tempdir().unwrap();
    let status_dir = status.path().join("node-status");
    let server = Server::start(ds.path(), &["--status-dir", status_dir.to_str().unwrap()]);
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &server.grpc, "node-1");
    agent.wait_for("in sync", |s| s["in_sync"] == true);
    let file = status_dir.join("node-1.json");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !file.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            server.log_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let st: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(st["node"], "node-1");
    assert!(
        !ds.path().join("status").exists(),
        "nothing written into --file-dir"
    );
    // The last-good store follows the status directory.
    assert!(status_dir.join("last-good").exists());
    // An empty value writes no status files (and keeps the last-good store in memory).
    let ds2 = example_datastore();
    let server2 = Server::start(ds2.path(), &["--status-dir", ""]);
    let agent2 = Agent::start(dir.path(), &server2.grpc, "node-1");
    agent2.wait_for("in sync", |s| s["in_sync"] == true);
    // The agent's reports have reached the server's status board: what a status writer would
    // write (the first server's file above appeared once they had).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !server2.status().as_array().is_some_and(|nodes| {
        nodes
            .iter()
            .any(|n| n["node"] == "node-1" && n["dataplane_in_sync"] == true)
    }) {
        assert!(std::time::Instant::now() < deadline, "{}", server2.status());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        !ds2.path().join("status").exists(),
        "{}",
        server2.log_text()
    );
    // A status directory inside the manifests is refused at start.
    let out = Command::new(binary("calc-server"))
        .args(["serve", "--file-dir", ds.path().to_str().unwrap()])
        .args(["--status-dir", ds.path().join("sub").to_str().unwrap()])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("inside --file-dir"),
        "{err}"
    );
}

#[test]
fn etcd_bench_load_of_an_empty_directory_fails() {
    let empty = tempfile::tempdir().unwrap();
    let out = Command::new(binary("etcd-bench"))
        // Checked before connecting: no etcd is needed to hear about the directory.
        .args(["--endpoints", "http://127.0.0.1:1"])
        .args(["load", "--dir", empty.path().to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("no .json files") && err.contains("gen-cluster"),
        "{err}"
    );
}
