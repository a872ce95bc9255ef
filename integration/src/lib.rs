//! Helpers for the end-to-end tests: locate the workspace's built binaries and the example data.
//!
//! The binaries are built by `make test` (`cargo build --workspace --bins` before
//! `cargo test --workspace`). A missing or stale binary fails the test with that instruction
//! rather than silently testing old code or skipping.

pub mod browser;
pub mod certs;
pub mod compose;
pub mod docker;
pub mod fake_kube;
pub mod https;

use std::path::{Path, PathBuf};
use std::time::SystemTime;

pub mod netns;
pub mod scripted;
pub mod stats_agent;

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
    // The sources a binary is built from: its own crate (for calc-server, with its graph and
    // ingest crates) and the shared crates it links.
    let dirs: &[&str] = match name {
        "dataplane-agent" => &[
            "dataplane-agent",
            "proto",
            "calico-names",
            "common",
            "config-file",
        ],
        "calc-bench" | "etcd-bench" | "linux-bench" => &[
            "tools",
            "calc-server",
            "dataplane-agent",
            "proto",
            "calico-names",
            "common",
            "config-file",
        ],
        _ => &[
            "calc-server",
            "proto",
            "calico-names",
            "common",
            "config-file",
        ],
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
        } else if p.file_name().is_some_and(|n| n == "tests.rs") {
            // A `#[cfg(test)] mod tests;`: not in the binary, so cargo does not rebuild it.
            continue;
        } else if p
            .extension()
            // The console's templates and assets are compiled in too.
            .is_some_and(|x| {
                ["rs", "proto", "toml", "html", "css", "js", "svg"]
                    .iter()
                    .any(|e| x == *e)
            })
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
        // A port picked free can be taken by a parallel test before the server binds it: then
        // the server exits at once, and another pair of ports is tried.
        for _ in 0..4 {
            if let Some(server) = Self::try_start(dir, free_port(), extra) {
                return server;
            }
        }
        Self::start_on(dir, free_port(), extra)
    }

    fn try_start(dir: &std::path::Path, port: u16, extra: &[&str]) -> Option<Server> {
        let dir_arg = dir.to_str().expect("UTF-8 temp path");
        Self::launch(
            &["--file-dir", dir_arg],
            dir.with_extension("server.log"),
            port,
            extra,
        )
    }

    pub fn start_on(dir: &std::path::Path, port: u16, extra: &[&str]) -> Server {
        let dir_arg = dir.to_str().expect("UTF-8 temp path");
        Self::start_with(
            &["--file-dir", dir_arg],
            dir.with_extension("server.log"),
            port,
            extra,
        )
    }

    /// Starts the server on an etcd datastore, logging to `log`, and waits until it is ready.
    pub fn start_etcd(
        endpoint: &str,
        log: std::path::PathBuf,
        port: u16,
        extra: &[&str],
    ) -> Server {
        Self::start_with(
            &["--datastore-type", "etcdv3", "--etcd-endpoints", endpoint],
            log,
            port,
            extra,
        )
    }

    /// Starts `calc-server serve` with these datastore flags (plus the test defaults and
    /// `extra`) and waits until it is ready.
    pub fn start_with(
        datastore: &[&str],
        log: std::path::PathBuf,
        port: u16,
        extra: &[&str],
    ) -> Server {
        match Self::launch(datastore, log.clone(), port, extra) {
            Some(server) => server,
            None => panic!(
                "calc-server exited before it was ready; log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            ),
        }
    }

    /// Starts the server and waits until it is ready; `None` if it exited first (a port taken).
    fn launch(
        datastore: &[&str],
        log: std::path::PathBuf,
        port: u16,
        extra: &[&str],
    ) -> Option<Server> {
        let admin_port = free_port();
        let out = std::fs::File::create(&log).expect("log file");
        let child = std::process::Command::new(binary("calc-server"))
            .arg("serve")
            .args(datastore)
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
        let mut server = Server {
            child,
            grpc: format!("http://127.0.0.1:{port}"),
            admin: format!("127.0.0.1:{admin_port}"),
            log,
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if http_get(&server.admin, "/readiness").is_some_and(|(code, _)| code == 200) {
                return Some(server);
            }
            if let Ok(Some(_)) = server.child.try_wait() {
                return None;
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

/// A sample's value in Prometheus text: the line that is `name` (labels included) then a space.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Whether the peer closes `sock` (end of stream or a reset) before `deadline` passes: reads
/// until then, discarding what arrives. For a test that a server drops a connection, without a
/// claim on how fast (the deadline only keeps a test from hanging).
pub fn closed_by_peer(mut sock: std::net::TcpStream, deadline: std::time::Duration) -> bool {
    use std::io::{ErrorKind, Read};
    let _ = sock.set_nonblocking(false);
    let until = std::time::Instant::now() + deadline;
    let mut buf = [0u8; 1024];
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        sock.set_read_timeout(Some(left)).expect("read timeout");
        match sock.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
}

/// How long after `started` the peer closes `sock` (read until EOF or an error, at most 30 s).
pub fn time_to_close(
    mut sock: std::net::TcpStream,
    started: std::time::Instant,
) -> std::time::Duration {
    use std::io::Read;
    // A socket made by tokio is non-blocking; the read timeout needs a blocking one.
    let _ = sock.set_nonblocking(false);
    sock.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("read timeout");
    let mut buf = [0u8; 1024];
    loop {
        match sock.read(&mut buf) {
            Ok(0) | Err(_) => return started.elapsed(),
            Ok(_) => {}
        }
    }
}

/// `text` without the terminal colour codes (ESC `[` … letter) the plain log format carries.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// An HTTP/1.0 GET as a probe makes it (HTTPS, unverified, when the listener wants TLS);
/// `None` if nothing answers.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    // One write: a TLS listener closes after the first bytes, and a second write would fail.
    let _ = s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes());
    let mut resp = Vec::new();
    let _ = s.read_to_end(&mut resp);
    // A TLS listener (serve with --tls-*) answers clear text with an alert or not at all: ask
    // again as a probe would, over TLS without verifying the server or presenting credentials.
    if !resp.starts_with(b"HTTP/") {
        return https::get(addr, path, &https::Client::default());
    }
    parse_response(&resp)
}

/// An HTTP/1 answer's status code and body.
pub fn parse_response(resp: &[u8]) -> Option<(u16, String)> {
    let resp = String::from_utf8_lossy(resp);
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
        Self::start_with(dir, servers, node, node, &[])
    }

    /// Like [`Agent::start`] with extra flags; `name` names the state and log files (so two
    /// agents for one node can run side by side).
    pub fn start_with(
        dir: &std::path::Path,
        servers: &str,
        node: &str,
        name: &str,
        extra: &[&str],
    ) -> Agent {
        let state = dir.join(format!("{name}.state.json"));
        let log = dir.join(format!("{name}.agent.log"));
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
            .args(extra)
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

impl Agent {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the agent's log contains `needle` (up to 20 s); returns the log.
    pub fn wait_for_log(&self, needle: &str) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            let log = self.log_text();
            if log.contains(needle) {
                return log;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!(
            "agent log never contained {needle:?}; log:\n{}",
            self.log_text()
        );
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `signal` (`TERM`, `STOP`, `CONT`, `KILL`, …) to a process, with the shell's builtin
/// `kill`: the tests then need no `procps`, which a minimal machine does not have. Whether it
/// was delivered.
pub fn send_signal(pid: u32, signal: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("kill -{signal} {pid}")])
        .status()
        .is_ok_and(|s| s.success())
}

/// The etcd server binary: `/usr/bin/etcd`, else the first `etcd` on PATH.
pub fn etcd_binary() -> Option<PathBuf> {
    let fixed = PathBuf::from("/usr/bin/etcd");
    if fixed.is_file() {
        return Some(fixed);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

/// A private etcd: free loopback ports, its own temporary data directory, killed on drop.
pub struct Etcd {
    child: Option<std::process::Child>,
    binary: PathBuf,
    /// `http://127.0.0.1:<client port>`.
    pub endpoint: String,
    client_port: u16,
    peer_port: u16,
    /// `--initial-cluster-token`: a new token on a new data directory makes a new cluster ID.
    token: String,
    /// Client TLS files when etcd serves HTTPS and requires client certificates.
    pub tls: Option<EtcdTls>,
    /// Holds the data directory and the log (removed on drop).
    pub dir: tempfile::TempDir,
}

/// A test CA and a certificate/key signed by it (valid for 127.0.0.1 as server and client).
#[derive(Clone, Debug)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

// Test-only material, made once with openssl (P-256, valid until 2076):
//   CA `CN=calc-server-test-ca`; leaf `CN=127.0.0.1`, SAN IP:127.0.0.1 and DNS:localhost,
//   extendedKeyUsage serverAuth+clientAuth. Shipping it avoids needing openssl in tests.
const TEST_CA_PEM: &str = "-----BEGIN CERTIFICATE-----
MIIBlDCCATmgAwIBAgIUc/58hl/Zls2tLsv9TorQ+aid2mMwCgYIKoZIzj0EAwIw
HjEcMBoGA1UEAwwTY2FsYy1zZXJ2ZXItdGVzdC1jYTAgFw0yNjExMjIwNjA1NDla
GA8yMDc2MTEwOTA2MDU0OVowHjEcMBoGA1UEAwwTY2FsYy1zZXJ2ZXItdGVzdC1j
YTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABA732PZXFmDZ1YuOwk0xZfch8VmS
8HTctl30sEfWSowKKIpTgL2EGeyriiqP8WjpinkVN8WUNQuYcxuEDXdoqmCjUzBR
MB0GA1UdDgQWBBQMzA8HW+DorMOQDZeC3Vf8UVmoHTAfBgNVHSMEGDAWgBQMzA8H
W+DorMOQDZeC3Vf8UVmoHTAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0kA
MEYCIQDMHyYAz+ita65Cgw6cImZMKABMfOZx+2vjCqGRon8OZAIhAKo7GI0UGcga
tPRCgQlSo4Kd05pjw351+dBqK1uJ9HFc
-----END CERTIFICATE-----
";
const TEST_CERT_PEM: &str = "-----BEGIN CERTIFICATE-----
MIIBwTCCAWagAwIBAgIUPntzgG+Oe/6CCi4OSCr3EFLV0AowCgYIKoZIzj0EAwIw
HjEcMBoGA1UEAwwTY2FsYy1zZXJ2ZXItdGVzdC1jYTAgFw0yNjExMjIwNjA1NDla
GA8yMDc2MTEwOTA2MDU0OVowFDESMBAGA1UEAwwJMTI3LjAuMC4xMFkwEwYHKoZI
zj0CAQYIKoZIzj0DAQcDQgAEI97N/oB29jL9t6QKqy0olfqhkHwKxscukiRjAfwj
h1dUJE2bsYgTYCntJlwXoLssMd2r+RcPc/icbNq+pYgN/qOBiTCBhjAaBgNVHREE
EzARhwR/AAABgglsb2NhbGhvc3QwHQYDVR0lBBYwFAYIKwYBBQUHAwEGCCsGAQUF
BwMCMAkGA1UdEwQCMAAwHQYDVR0OBBYEFDCKtzEzMqrcZMP1SNqoSfTH+0d3MB8G
A1UdIwQYMBaAFAzMDwdb4Oisw5ANl4LdV/xRWagdMAoGCCqGSM49BAMCA0kAMEYC
IQD2ICRGEudyL6SJHa/5GkccawsS2lRGIGaX6Cy3rQdCaAIhAJuKyls1mIVYIO0b
kJ4OgVXu65FNJjH7je0SvO9/NIO+
-----END CERTIFICATE-----
";
const TEST_KEY_PEM: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg5+2vKRHjOThChMOL
q53nBweFcnGQpQNK/LBNHm4nrbyhRANCAAQj3s3+gHb2Mv23pAqrLSiV+qGQfArG
xy6SJGMB/COHV1QkTZuxiBNgKe0mXBeguywx3av5Fw9z+Jxs2r6liA3+
-----END PRIVATE KEY-----
";

impl EtcdTls {
    /// Writes the test CA, certificate and key into `dir`.
    fn write(dir: &Path) -> EtcdTls {
        let tls = EtcdTls {
            ca: dir.join("ca.pem"),
            cert: dir.join("node.pem"),
            key: dir.join("node.key"),
        };
        for (path, pem) in [
            (&tls.ca, TEST_CA_PEM),
            (&tls.cert, TEST_CERT_PEM),
            (&tls.key, TEST_KEY_PEM),
        ] {
            std::fs::write(path, pem).expect("write test TLS file");
        }
        tls
    }
}

impl Etcd {
    /// Starts etcd and waits until it is healthy. Without etcd installed this fails the test,
    /// naming the fix: the tests that need etcd are `#[ignore]`d so that only a run that asked
    /// for them (`make test`) gets here.
    pub fn start() -> Etcd {
        Self::start_with_tls(false)
    }

    /// Like [`Etcd::start`], serving HTTPS only to clients with a certificate from a test CA.
    pub fn start_tls() -> Etcd {
        Self::start_with_tls(true)
    }

    fn start_with_tls(tls: bool) -> Etcd {
        let binary = etcd_binary()
            .expect("this test needs etcd, which is not installed: `make deps` installs it");
        let client_port = free_port();
        let mut peer_port = free_port();
        while peer_port == client_port {
            peer_port = free_port();
        }
        let dir = tempfile::tempdir().expect("temp dir for etcd");
        let tls = tls.then(|| EtcdTls::write(dir.path()));
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut etcd = Etcd {
            child: None,
            binary,
            endpoint: format!("{scheme}://127.0.0.1:{client_port}"),
            client_port,
            peer_port,
            token: "calc-server-test".into(),
            tls,
            dir,
        };
        etcd.spawn();
        etcd
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn spawn(&mut self) {
        let client = self.endpoint.clone();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("etcd log");
        let mut cmd = std::process::Command::new(&self.binary);
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key)
                .arg("--trusted-ca-file")
                .arg(&t.ca)
                .arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", "test"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .args(["--initial-cluster-token", &self.token])
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.client_port);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            let healthy = if self.tls.is_some() {
                self.ctl_command()
                    .args(["endpoint", "health"])
                    .output()
                    .is_ok_and(|o| o.status.success())
            } else {
                http_get(&addr, "/health")
                    .is_some_and(|(code, body)| code == 200 && body.contains("true"))
            };
            if healthy {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!(
            "etcd did not become healthy; log:\n{}",
            std::fs::read_to_string(self.log_path()).unwrap_or_default()
        );
    }

    /// Kills etcd (SIGKILL), keeping its data directory.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports and data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Replaces etcd by an empty new cluster (new data directory and cluster token, so a new
    /// cluster ID) on the same ports.
    pub fn replace_cluster(&mut self, token: &str) {
        self.kill();
        let _ = std::fs::remove_dir_all(self.dir.path().join("data"));
        self.token = token.to_string();
        self.spawn();
    }

    /// `etcdctl` (API v3) pointed at this etcd (with the client certificate under TLS).
    pub fn ctl_command(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoint]);
        if let Some(t) = &self.tls {
            cmd.arg("--cacert")
                .arg(&t.ca)
                .arg("--cert")
                .arg(&t.cert)
                .arg("--key")
                .arg(&t.key);
        }
        cmd
    }

    /// Runs `etcdctl` (API v3) against this etcd; panics on failure; returns stdout.
    pub fn ctl(&self, args: &[&str]) -> String {
        let out = self
            .ctl_command()
            .args(args)
            .output()
            .expect("run etcdctl (installed with etcd: `make deps`)");
        assert!(
            out.status.success(),
            "etcdctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn put(&self, key: &str, value: &str) {
        self.ctl(&["put", key, value]);
    }

    pub fn del(&self, key: &str) {
        self.ctl(&["del", key]);
    }

    /// Every key under `prefix` with its value (values must be one line, as JSON in etcd is).
    pub fn get_prefix(&self, prefix: &str) -> std::collections::BTreeMap<String, String> {
        let out = self.ctl(&["get", "--prefix", prefix]);
        let lines: Vec<&str> = out.lines().collect();
        lines
            .chunks(2)
            .filter(|c| c.len() == 2)
            .map(|c| (c[0].to_string(), c[1].to_string()))
            .collect()
    }

    /// The store's current revision.
    pub fn revision(&self) -> i64 {
        let out = self.ctl(&["get", "--write-out", "json", "/"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("etcdctl JSON");
        v["header"]["revision"].as_i64().expect("header.revision")
    }

    /// Compacts the history up to the current revision (already compacted there: fine).
    pub fn compact(&self) -> i64 {
        let rev = self.revision();
        let out = self
            .ctl_command()
            .args(["compact", &rev.to_string()])
            .output()
            .expect("run etcdctl");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() || stderr.contains("has been compacted"),
            "etcdctl compact {rev} failed: {stderr}"
        );
        rev
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Writes `count` keys `<prefix><i>` with `value` as fast as possible (8 writers, etcd's
    /// JSON gateway instead of one etcdctl process per key): one revision each. Plain HTTP
    /// only.
    pub fn flood(&self, prefix: &str, count: usize, value: &str) {
        assert!(self.tls.is_none(), "flood speaks plain HTTP");
        let addr = format!("127.0.0.1:{}", self.client_port);
        let value = base64(value.as_bytes());
        std::thread::scope(|sc| {
            for t in 0..8 {
                let (addr, value) = (&addr, &value);
                sc.spawn(move || {
                    for i in (t..count).step_by(8) {
                        let body = format!(
                            r#"{{"key":"{}","value":"{value}"}}"#,
                            base64(format!("{prefix}{i}").as_bytes())
                        );
                        let (code, resp) =
                            http_post(addr, "/v3/kv/put", &body).expect("etcd gateway answers");
                        assert_eq!(code, 200, "{resp}");
                    }
                });
            }
        });
    }
}

/// Standard base64 with padding (etcd's JSON gateway encodes bytes so).
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(A[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A plain HTTP/1.0 POST of a JSON body; `None` if nothing answers.
pub fn http_post(addr: &str, path: &str, body: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .ok()?;
    write!(
        s,
        "POST {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let (head, body) = resp.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
