//! Configuration precedence through the real binaries: flags, then environment variables, then
//! `--config-file`, then the defaults (`--print-config` shows the effective settings).

use integration::binary;

fn print_config(bin: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = std::process::Command::new(binary(bin));
    cmd.args(args).arg("--print-config");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{bin} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn agent_flags_beat_env_beat_file_beat_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.yaml");
    std::fs::write(
        &file,
        "node: node-from-file\nserver: [calc-a:50051, calc-b:50051]\nheartbeat-interval: 7s\n\
         log-level: debug\nreconnect-max-delay: 30s\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    // File only (plus defaults).
    let out = print_config("dataplane-agent", &["--config-file", f], &[]);
    assert!(out.contains("node: \"node-from-file\""), "{out}");
    assert!(
        out.contains("\"calc-a:50051\"") && out.contains("\"calc-b:50051\""),
        "{out}"
    );
    assert!(out.contains("heartbeat_interval: 7s"), "{out}");
    assert!(
        out.contains("reconnect_min_delay: 200ms"),
        "default kept: {out}"
    );
    // Env over file; flag over env.
    let env = [
        ("DATAPLANE_AGENT_NODE", "node-from-env"),
        ("DATAPLANE_AGENT_HEARTBEAT_INTERVAL", "9s"),
        ("DATAPLANE_AGENT_LOG_LEVEL", "warn"),
    ];
    let out = print_config(
        "dataplane-agent",
        &["--config-file", f, "--heartbeat-interval", "11s"],
        &env,
    );
    assert!(out.contains("node: \"node-from-env\""), "{out}");
    assert!(out.contains("heartbeat_interval: 11s"), "{out}");
    assert!(out.contains("log_level: \"warn\""), "{out}");
    assert!(
        out.contains("reconnect_max_delay: 30s"),
        "file under no env/flag: {out}"
    );
    // The file can be named by the environment too.
    let out = print_config(
        "dataplane-agent",
        &[],
        &[("DATAPLANE_AGENT_CONFIG_FILE", f)],
    );
    assert!(out.contains("node: \"node-from-file\""), "{out}");
    // A typo in the file is an error, not silently ignored.
    std::fs::write(&file, "nod: x\n").unwrap();
    let out = std::process::Command::new(binary("dataplane-agent"))
        .args(["--config-file", f, "--server", "a:1", "--node", "n"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown setting \"nod\""));
}

#[test]
fn server_flags_beat_env_beat_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("server.yaml");
    std::fs::write(
        &file,
        "listen: 0.0.0.0:6000\nadmin-listen: 0.0.0.0:6001\nmax-connections: 50\n\
         tls-handshake-timeout: 3s\nlog-format: json\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let out = print_config(
        "calc-server",
        &["serve", "--config-file", f, "--max-connections", "70"],
        &[("CALC_SERVER_ADMIN_LISTEN", "127.0.0.1:7001")],
    );
    assert!(out.contains("listen: 0.0.0.0:6000"), "{out}");
    assert!(
        out.contains("admin_listen: 127.0.0.1:7001"),
        "env over file: {out}"
    );
    assert!(out.contains("max_connections: 70"), "flag over file: {out}");
    assert!(out.contains("tls_handshake_timeout: 3s"), "{out}");
    assert!(out.contains("hello_timeout: 10s"), "default: {out}");
}
