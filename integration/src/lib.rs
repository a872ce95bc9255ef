//! Helpers for the end-to-end tests: locate the workspace's built binaries and the example data.
//!
//! The binaries are built by `make test` (`cargo build --workspace --bins` before
//! `cargo test --workspace`). A missing or stale binary fails the test with that instruction
//! rather than silently testing old code or skipping.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration/ sits in the workspace root")
        .to_path_buf()
}

/// Path of a workspace binary in the same target profile directory as the running test.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test-binary> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps");
    let path = dir.join(name);
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} not found: build the binaries first (`cargo build --workspace --bins`, as `make test` does)",
                path.display()
            )
        });
    let root = workspace_root();
    // The sources a binary is built from: its own crate (for calc-server, with its graph
    // crate) and the proto crate.
    let dirs: &[&str] = match name {
        "dataplane-agent" => &["dataplane-agent", "proto"],
        _ => &["calc-server", "proto"],
    };
    let newest = dirs
        .iter()
        .filter_map(|d| newest_source(&root.join(d)))
        .max();
    if let Some(newest) = newest {
        assert!(
            built >= newest,
            "{} is older than the sources: rebuild (`cargo build --workspace --bins`, as `make test` does)",
            path.display()
        );
    }
    path
}

fn newest_source(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    let entries = std::fs::read_dir(dir).ok()?;
    for e in entries.flatten() {
        let p = e.path();
        let t = if p.is_dir() {
            if p.file_name()
                .is_some_and(|n| n == "tests" || n == "benches")
            {
                continue;
            }
            newest_source(&p)
        } else if p
            .extension()
            .is_some_and(|x| x == "rs" || x == "proto" || x == "toml")
        {
            e.metadata().and_then(|m| m.modified()).ok()
        } else {
            None
        };
        newest = newest.max(t);
    }
    newest
}

/// A free TCP port on loopback (bound then released; good enough for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A copy of the example cluster in a temporary directory (tests edit it).
pub fn example_datastore() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let src = workspace_root().join("examples/cluster");
    for f in std::fs::read_dir(&src).expect("examples/cluster") {
        let f = f.expect("dir entry").path();
        // Only the manifests: a demo run may have left a status/ directory beside them.
        if f.is_file() {
            std::fs::copy(&f, dir.path().join(f.file_name().expect("file name"))).expect("copy");
        }
    }
    dir
}

/// A running `calc-server serve`, killed on drop.
pub struct Server {
    pub child: std::process::Child,
    pub grpc: String,
    pub admin: String,
    pub log: std::path::PathBuf,
}

impl Server {
    /// Starts the server on `dir` with extra flags and waits until it is ready.
    pub fn start(dir: &std::path::Path, extra: &[&str]) -> Server {
        Self::start_on(dir, free_port(), extra)
    }

    pub fn start_on(dir: &std::path::Path, port: u16, extra: &[&str]) -> Server {
        let admin_port = free_port();
        let log = dir.with_extension("server.log");
        let out = std::fs::File::create(&log).expect("log file");
        let child = std::process::Command::new(binary("calc-server"))
            .args(["serve", "--file-dir"])
            .arg(dir)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin_port}")])
            .args([
                "--file-poll-interval",
                "100ms",
                "--status-interval",
                "100ms",
            ])
            .args(extra)
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start calc-server");
        let server = Server {
            child,
            grpc: format!("http://127.0.0.1:{port}"),
            admin: format!("127.0.0.1:{admin_port}"),
            log,
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if http_get(&server.admin, "/readiness").is_some_and(|(code, _)| code == 200) {
                return server;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!(
            "calc-server did not become ready; log:\n{}",
            server.log_text()
        );
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The admin endpoint's /status as JSON.
    pub fn status(&self) -> serde_json::Value {
        let (_, body) = http_get(&self.admin, "/status").expect("admin /status");
        serde_json::from_str(&body).expect("status JSON")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.0 GET; `None` if nothing answers.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let (head, body) = resp.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// A running `dataplane-agent --driver dry-run`, killed on drop.
pub struct Agent {
    pub child: std::process::Child,
    pub state: std::path::PathBuf,
    pub log: std::path::PathBuf,
}

impl Agent {
    /// Starts an agent for `node` against `servers` (comma-separated), writing its state file
    /// and log into `dir`.
    pub fn start(dir: &std::path::Path, servers: &str, node: &str) -> Agent {
        let state = dir.join(format!("{node}.state.json"));
        let log = dir.join(format!("{node}.agent.log"));
        let _ = std::fs::remove_file(&state);
        let out = std::fs::File::create(&log).expect("agent log");
        let child = std::process::Command::new(binary("dataplane-agent"))
            .args([
                "--server",
                servers,
                "--node",
                node,
                "--driver",
                "dry-run",
                "--state-file",
            ])
            .arg(&state)
            .args([
                "--reconnect-min-delay",
                "100ms",
                "--reconnect-max-delay",
                "500ms",
            ])
            .args(["--heartbeat-interval", "1s"])
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start dataplane-agent");
        Agent { child, state, log }
    }

    /// The state file as JSON, if written.
    pub fn state(&self) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(&self.state).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Waits until `pred` holds for the state file (up to 20 s).
    pub fn wait_for(
        &self,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if let Some(s) = self.state()
                && pred(&s)
            {
                return s;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!(
            "agent state never reached: {what}\nstate: {:?}\nlog:\n{}",
            self.state(),
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
