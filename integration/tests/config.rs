//! Configuration precedence through the real binaries: flags, then environment variables, then
//! `--config-file`, then the defaults. `--print-config` shows the settings in force, one
//! `key: value  # source` line each, in the config file's own form.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use integration::binary;

fn print_config(bin: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(binary(bin));
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

/// The line of `key`, asserting there is exactly one.
fn line<'a>(out: &'a str, key: &str) -> &'a str {
    let prefix = format!("{key}: ");
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with(&prefix)).collect();
    assert_eq!(lines.len(), 1, "one {key:?} line in:\n{out}");
    lines[0]
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
    let from_file = format!("# file {f}");
    // File only (plus defaults).
    let out = print_config("dataplane-agent", &["--config-file", f], &[]);
    assert_eq!(
        line(&out, "node"),
        format!("node: node-from-file  {from_file}")
    );
    assert_eq!(
        line(&out, "server"),
        format!("server: [calc-a:50051, calc-b:50051]  {from_file}")
    );
    assert_eq!(
        line(&out, "heartbeat-interval"),
        format!("heartbeat-interval: 7s  {from_file}")
    );
    assert_eq!(
        line(&out, "reconnect-min-delay"),
        "reconnect-min-delay: 200ms  # default"
    );
    assert!(
        !out.contains("config-file") && !out.contains("print-config"),
        "command-line-only flags are not settings: {out}"
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
    assert_eq!(
        line(&out, "node"),
        "node: node-from-env  # env DATAPLANE_AGENT_NODE"
    );
    assert_eq!(
        line(&out, "heartbeat-interval"),
        "heartbeat-interval: 11s  # flag"
    );
    assert_eq!(
        line(&out, "log-level"),
        "log-level: warn  # env DATAPLANE_AGENT_LOG_LEVEL"
    );
    assert_eq!(
        line(&out, "reconnect-max-delay"),
        format!("reconnect-max-delay: 30s  {from_file}"),
        "file under no env/flag"
    );
    // The output is itself a config file: fed back, the same values, now all from the file.
    let again = dir.path().join("again.yaml");
    std::fs::write(&again, &out).unwrap();
    let out2 = print_config(
        "dataplane-agent",
        &["--config-file", again.to_str().unwrap()],
        &[],
    );
    let value = |l: &str| l.split("  # ").next().unwrap().to_owned();
    assert_eq!(
        out.lines().map(value).collect::<Vec<_>>(),
        out2.lines().map(value).collect::<Vec<_>>()
    );
    // The file can be named by the environment too.
    let out = print_config(
        "dataplane-agent",
        &[],
        &[("DATAPLANE_AGENT_CONFIG_FILE", f)],
    );
    assert_eq!(
        line(&out, "node"),
        format!("node: node-from-file  {from_file}")
    );
    // A typo in the file is an error, not silently ignored.
    std::fs::write(&file, "nod: x\n").unwrap();
    let out = Command::new(binary("dataplane-agent"))
        .args(["--config-file", f, "--server", "a:1", "--node", "n"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown setting \"nod\""));
}

#[test]
fn agent_prints_its_config_without_server_or_node() {
    let out = print_config("dataplane-agent", &[], &[]);
    assert_eq!(line(&out, "node"), "node: \"\"  # default");
    assert_eq!(line(&out, "server"), "server: \"\"  # default");
    assert_eq!(line(&out, "admin-listen"), "admin-listen: null  # default");
    assert_eq!(
        line(&out, "interface-prefix"),
        "interface-prefix: [cali]  # default"
    );
    assert!(
        out.lines().all(|l| l.contains(": ") && l.contains("  # ")),
        "{out}"
    );
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
    let from_file = format!("# file {f}");
    let out = print_config(
        "calc-server",
        &["serve", "--config-file", f, "--max-connections", "70"],
        &[("CALC_SERVER_ADMIN_LISTEN", "127.0.0.1:7001")],
    );
    assert_eq!(
        line(&out, "listen"),
        format!("listen: 0.0.0.0:6000  {from_file}")
    );
    assert_eq!(
        line(&out, "admin-listen"),
        "admin-listen: 127.0.0.1:7001  # env CALC_SERVER_ADMIN_LISTEN",
        "env over file"
    );
    assert_eq!(
        line(&out, "max-connections"),
        "max-connections: 70  # flag",
        "flag over file"
    );
    assert_eq!(
        line(&out, "tls-handshake-timeout"),
        format!("tls-handshake-timeout: 3s  {from_file}")
    );
    assert_eq!(
        line(&out, "log-format"),
        format!("log-format: json  {from_file}"),
        "a global flag set in the file"
    );
    assert_eq!(line(&out, "hello-timeout"), "hello-timeout: 10s  # default");
}

/// `--print-config | head -1`: the reader leaves after one line; the writer must exit 0 quietly
/// (no broken-pipe panic). The output fits in a pipe's buffer, so reading one line first may
/// leave nothing for the writer to fail on; a reader that leaves before reading anything always
/// does.
#[test]
fn print_config_into_a_closed_pipe_exits_0() {
    for (bin, args) in [
        ("dataplane-agent", &[][..]),
        ("calc-server", &["serve"][..]),
    ] {
        for read_first_line in [true, false] {
            let mut child = Command::new(binary(bin))
                .args(args)
                .arg("--print-config")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn");
            let stdout = child.stdout.take().expect("piped");
            if read_first_line {
                let mut first = String::new();
                BufReader::new(stdout)
                    .read_line(&mut first)
                    .expect("one line");
                assert!(first.contains("  # "), "{bin}: {first:?}");
            } else {
                drop(stdout);
            }
            // The read end is gone: the child's further writes fail with EPIPE.
            let out = child.wait_with_output().expect("wait");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(0), "{bin}: {stderr}");
            assert!(stderr.is_empty(), "{bin}: no panic, no error: {stderr}");
        }
    }
}
