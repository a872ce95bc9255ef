//! Who can read calc-server's admin endpoint, end to end with the real binary: the endpoint
//! refuses to start unauthenticated on a routable address; with TLS it serves HTTPS and every
//! path but the probes and metrics answers only admin identities (listed client certificates,
//! a separate admin CA, a bearer token), never a node's certificate; `calc-server status` and
//! `explain --server` reach it with the matching flags; and a flood of questions is bounded so
//! agents keep receiving updates.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use integration::certs::{Role, ca, leaf};
use integration::https::{self, Client};
use integration::{Agent, Server, binary, example_datastore, free_port, http_get, metric};

/// The paths that show the cluster's policy, endpoints or nodes.
const SENSITIVE: [&str; 9] = [
    "/status",
    "/status/datastore",
    "/status/policies",
    "/status/policies/block-threat-feed",
    "/status/unused?since=3600",
    "/status/verdicts",
    "/explain?policy=block-threat-feed",
    "/explain?endpoint=shop/web-1",
    "/explain?from=shop/web-1&to=shop/api-1&port=8080",
];
const PROBES: [&str; 3] = ["/liveness", "/readiness", "/metrics"];

fn calc_server(args: &[&str]) -> std::process::Output {
    Command::new(binary("calc-server"))
        .args(args)
        .output()
        .expect("run calc-server")
}

#[test]
fn an_unauthenticated_admin_endpoint_binds_only_loopback() {
    let ds = example_datastore();
    let dir = ds.path().to_str().unwrap();
    let admin = format!("0.0.0.0:{}", free_port());
    let listen = format!("127.0.0.1:{}", free_port());
    let serve = |extra: &[&str]| {
        let mut args = vec![
            "serve",
            "--file-dir",
            dir,
            "--listen",
            &listen,
            "--admin-listen",
            &admin,
        ];
        args.extend(extra);
        let out = calc_server(&args);
        assert!(
            !out.status.success(),
            "serve {extra:?} started on {admin} without authentication"
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = serve(&[]);
    for flag in [
        "--admin-token-file",
        "--admin-allowed-cn",
        "--admin-ca-file",
        &admin,
    ] {
        assert!(err.contains(flag), "the refusal names {flag}:\n{err}");
    }
    // Certificate identities without TLS are refused too: there is no handshake to prove them.
    assert!(serve(&["--admin-allowed-cn", "ops"]).contains("--tls-ca-file"));
}

/// A TLS server whose admins are the CN `ops-admin` (and, by mistake, node-2's CN, which
/// must still be refused as a node certificate).
struct Cluster {
    _ds: tempfile::TempDir,
    dir: tempfile::TempDir,
    server: Server,
    ca: integration::certs::Ca,
    ca_file: String,
}

impl Cluster {
    fn client(&self, name: &str, cn: &str) -> Client {
        let (_, cert, key) = leaf(
            self.dir.path(),
            name,
            &self.ca,
            cn,
            &[],
            Role::Client,
            false,
        );
        Client {
            ca: Some(self.ca_file.clone().into()),
            cert: Some((cert.into(), key.into())),
            token: None,
        }
    }
}

fn tls_cluster(extra: &[&str]) -> Cluster {
    let ds = example_datastore();
    let dir = tempfile::tempdir().unwrap();
    let ca = ca("cluster CA");
    let (ca_file, cert, key) = leaf(
        dir.path(),
        "server",
        &ca,
        "calc-server",
        &[],
        Role::Server,
        false,
    );
    let mut flags = vec![
        "--tls-ca-file",
        &ca_file,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
    ];
    flags.extend(extra);
    let server = Server::start(ds.path(), &flags);
    Cluster {
        _ds: ds,
        dir,
        server,
        ca,
        ca_file,
    }
}

fn code(addr: &str, path: &str, client: &Client) -> Option<u16> {
    https::get(addr, path, client).map(|(c, _)| c)
}

#[test]
fn sensitive_paths_answer_only_admin_identities() {
    let c = tls_cluster(&["--admin-allowed-cn", "ops-admin,node-2"]);
    let admin = &c.server.admin;
    let anonymous = Client {
        ca: Some(c.ca_file.clone().into()),
        ..Default::default()
    };
    let ops = c.client("ops", "ops-admin");
    let eve = c.client("eve", "eve");
    let node1 = c.client("node-1", "node-1");
    let node2 = c.client("node-2", "node-2");
    let stranger = {
        let other = ca("another CA");
        let (_, cert, key) = leaf(
            c.dir.path(),
            "stranger",
            &other,
            "ops-admin",
            &[],
            Role::Client,
            false,
        );
        Client {
            ca: anonymous.ca.clone(),
            cert: Some((cert.into(), key.into())),
            token: None,
        }
    };
    for path in SENSITIVE {
        let (status, body) = https::get(admin, path, &ops).expect("the admin is answered");
        assert_eq!(status, 200, "{path} for the admin: {body}");
        let (status, body) = https::get(admin, path, &anonymous).expect("answered");
        assert_eq!(status, 401, "{path} without credentials: {body}");
        assert!(
            !body.contains("shop"),
            "{path}: a refusal leaks nothing: {body}"
        );
        let (status, body) = https::get(admin, path, &eve).expect("answered");
        assert_eq!(status, 403, "{path} for a wrong identity: {body}");
        for (who, node) in [("node-1", &node1), ("node-2 (listed by mistake)", &node2)] {
            let (status, body) = https::get(admin, path, node).expect("answered");
            assert_eq!(status, 403, "{path} for {who}'s certificate: {body}");
            assert!(
                body.contains("node certificates are not admin identities"),
                "{body}"
            );
        }
        assert_eq!(
            code(admin, path, &stranger),
            None,
            "{path}: a certificate of another CA fails the handshake"
        );
        // Clear text is not served at all on a TLS admin endpoint.
        let plain = std::net::TcpStream::connect(admin).unwrap();
        assert!(raw_plain_get(plain, path).is_none_or(|r| !r.starts_with("HTTP/")));
    }
    for path in PROBES {
        assert_eq!(
            code(admin, path, &anonymous),
            Some(200),
            "{path} stays open"
        );
    }
    let (_, metrics) = https::get(admin, "/metrics", &anonymous).unwrap();
    let refused = |reason: &str| {
        metric(
            &metrics,
            &format!("calc_server_admin_refused_total{{reason=\"{reason}\"}}"),
        )
        .unwrap_or_default()
    };
    assert_eq!(refused("unauthenticated"), SENSITIVE.len() as f64);
    assert_eq!(refused("forbidden"), 3.0 * SENSITIVE.len() as f64);
    assert!(
        refused("tls_handshake") >= SENSITIVE.len() as f64,
        "{metrics}"
    );

    // The CLI, with the admin's certificate: through 127.0.0.1, naming the certificate's host.
    let url = format!("https://{admin}");
    let (ops_cert, ops_key) = (c.dir.path().join("ops.pem"), c.dir.path().join("ops.key"));
    let tls_flags = |cert: &Path, key: &Path| -> Vec<String> {
        [
            "--server",
            &url,
            "--tls-ca-file",
            &c.ca_file,
            "--tls-cert-file",
            cert.to_str().unwrap(),
            "--tls-key-file",
            key.to_str().unwrap(),
            "--tls-server-name",
            "localhost",
        ]
        .map(String::from)
        .to_vec()
    };
    let run = |cmd: &[&str], flags: &[String]| {
        let mut args: Vec<&str> = cmd.to_vec();
        args.extend(flags.iter().map(String::as_str));
        calc_server(&args)
    };
    let out = run(&["status", "--policies"], &tls_flags(&ops_cert, &ops_key));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("block-threat-feed"));
    let out = run(
        &["explain", "--policy", "block-threat-feed"],
        &tls_flags(&ops_cert, &ops_key),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // node-1's certificate through the CLI: refused, and the error says why.
    let node1_flags = tls_flags(
        &c.dir.path().join("node-1.pem"),
        &c.dir.path().join("node-1.key"),
    );
    let out = run(&["status"], &node1_flags);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("403") && err.contains("node certificates"),
        "{err}"
    );
    // No certificate: told authentication is required.
    let out = calc_server(&[
        "status",
        "--server",
        &url,
        "--tls-ca-file",
        &c.ca_file,
        "--tls-server-name",
        "localhost",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
}

fn raw_plain_get(mut s: std::net::TcpStream, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    Some(String::from_utf8_lossy(&out).into_owned())
}

#[test]
fn an_admin_ca_and_a_token_are_admin_identities_nodes_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let admin_ca = ca("admin CA");
    let (admin_ca_file, admin_cert, admin_key) = leaf(
        dir.path(),
        "ops",
        &admin_ca,
        "anyone-from-the-admin-ca",
        &[],
        Role::Client,
        false,
    );
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-admin-token-0123456789\n").unwrap();
    let c = tls_cluster(&[
        "--admin-ca-file",
        &admin_ca_file,
        "--admin-token-file",
        token_file.to_str().unwrap(),
    ]);
    let admin = &c.server.admin;
    let by_ca = Client {
        ca: Some(c.ca_file.clone().into()),
        cert: Some((admin_cert.into(), admin_key.into())),
        token: None,
    };
    let token = |t: &str| Client {
        ca: Some(c.ca_file.clone().into()),
        cert: None,
        token: Some(t.into()),
    };
    let node1 = c.client("node-1", "node-1");
    for path in SENSITIVE {
        assert_eq!(
            code(admin, path, &by_ca),
            Some(200),
            "{path} with an admin-CA certificate"
        );
        assert_eq!(
            code(admin, path, &token("s3cret-admin-token-0123456789")),
            Some(200),
            "{path} with the token"
        );
        assert_eq!(
            code(admin, path, &token("s3cret-admin-token-012345678")),
            Some(403),
            "{path}"
        );
        assert_eq!(code(admin, path, &token("")), Some(401), "{path}");
        // The agents' CA is not the admin CA: node-1's certificate does not even connect.
        assert_eq!(
            code(admin, path, &node1),
            None,
            "{path} with node-1's certificate"
        );
    }
    // The token through the CLI.
    let out = calc_server(&[
        "status",
        "--server",
        &format!("https://{admin}"),
        "--tls-ca-file",
        &c.ca_file,
        "--tls-server-name",
        "localhost",
        "--token-file",
        token_file.to_str().unwrap(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("node-1"));
}

#[test]
fn a_token_guards_a_plaintext_endpoint_too() {
    let ds = example_datastore();
    let token_file = ds.path().with_extension("token");
    std::fs::write(&token_file, "plain-admin-token-0123456789").unwrap();
    let server = Server::start(
        ds.path(),
        &["--admin-token-file", token_file.to_str().unwrap()],
    );
    for path in SENSITIVE {
        let (status, _) = http_get(&server.admin, path).expect("answered");
        assert_eq!(status, 401, "{path} without the token");
    }
    for path in PROBES {
        assert_eq!(
            http_get(&server.admin, path).map(|r| r.0),
            Some(200),
            "{path}"
        );
    }
    let out = calc_server(&[
        "explain",
        "--server",
        &server.admin,
        "--token-file",
        token_file.to_str().unwrap(),
        "--from",
        "shop/web-1",
        "--to",
        "shop/api-1",
        "--port",
        "8080",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = calc_server(&["status", "--server", &server.admin]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("401") && err.contains("--token-file"),
        "the refusal says which flag to give: {err}"
    );
}

/// Writes a cluster-wide policy named `name` (applies to every endpoint of node-1).
fn write_probe_policy(dir: &Path, name: &str) {
    std::fs::write(
        dir.join("probe.yaml"),
        format!(
            "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata:\n  name: {name}\nspec:\n  order: 1\n  selector: all()\n  types: [Ingress]\n  ingress:\n  - action: Allow\n    protocol: TCP\n    destination:\n      ports: [7777]\n"
        ),
    )
    .unwrap();
}

/// Time from writing a new policy until node-1's agent has it.
fn change_latency(dir: &Path, agent: &Agent, name: &str) -> Duration {
    let start = Instant::now();
    write_probe_policy(dir, name);
    agent.wait_for(name, |s| {
        s["policies"]
            .as_object()
            .is_some_and(|p| p.keys().any(|k| k.contains(name)))
    });
    start.elapsed()
}

#[test]
fn an_explain_flood_is_bounded_and_agents_keep_their_updates() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &["--admin-max-concurrent-queries", "2"]);
    let agent = Agent::start(ds.path(), &server.grpc, "node-1");
    agent.wait_for("in sync", |s| s["in_sync"] == true);
    let baseline: Vec<Duration> = (0..3)
        .map(|i| change_latency(ds.path(), &agent, &format!("quiet-{i}")))
        .collect();

    let stop = Arc::new(AtomicBool::new(false));
    let (answered, busy) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let flooders: Vec<_> = (0..16)
        .map(|i| {
            let (stop, answered, busy) = (stop.clone(), answered.clone(), busy.clone());
            let addr = server.admin.clone();
            std::thread::spawn(move || {
                let paths = [
                    "/explain?policy=block-threat-feed",
                    "/explain?endpoint=shop/web-1",
                    "/explain?from=shop/web-1&to=db/postgres-0&port=5432",
                    "/status/policies",
                ];
                let mut n = i;
                while !stop.load(Ordering::Relaxed) {
                    match http_get(&addr, paths[n % paths.len()]).map(|r| r.0) {
                        Some(200) => answered.fetch_add(1, Ordering::Relaxed),
                        Some(429) => busy.fetch_add(1, Ordering::Relaxed),
                        other => panic!("a question was answered {other:?}"),
                    };
                    n += 1;
                }
            })
        })
        .collect();
    // The flood is under way before the changes are made.
    while answered.load(Ordering::Relaxed) < 20 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let flooded: Vec<Duration> = (0..3)
        .map(|i| change_latency(ds.path(), &agent, &format!("flooded-{i}")))
        .collect();
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.join().expect("flooder");
    }
    let (answered, busy) = (
        answered.load(Ordering::Relaxed),
        busy.load(Ordering::Relaxed),
    );
    assert!(
        busy > 0,
        "16 clients against 2 query slots: some are told to retry"
    );
    assert!(answered > 0);
    let (_, metrics) = http_get(&server.admin, "/metrics").unwrap();
    assert_eq!(
        metric(&metrics, "calc_server_admin_refused_total{reason=\"busy\"}"),
        Some(busy as f64)
    );
    // Within the normal range: a change under the flood takes no longer than the slowest quiet
    // change plus one poll-and-flush cycle's worth of slack.
    let worst_quiet = *baseline.iter().max().unwrap();
    let worst_flooded = *flooded.iter().max().unwrap();
    assert!(
        worst_flooded <= worst_quiet * 3 + Duration::from_secs(2),
        "changes under the flood {flooded:?} vs quiet {baseline:?} ({answered} answered, {busy} busy)"
    );
}
