//! Mutual TLS between the real agent and the real calc-server, with certificates made here
//! (rcgen): the matrix of bad certificates in both directions (plaintext, wrong CA, expired,
//! wrong CN, wrong URI SAN), a node asking for another node's span, the valid cases, the
//! handshake timeout (a stalled client is dropped and delays nobody), the connection limit,
//! health and metrics on both admin endpoints, SIGTERM on both sides, and the agent's log naming
//! why a TLS connection failed (a refused client certificate, TLS against plaintext).

use std::net::TcpStream;
use std::time::{Duration, Instant};

use integration::certs::{Ca, Role, ca, leaf};
use integration::{
    Agent, Server, closed_by_peer, example_datastore, free_port, http_get, metric, strip_ansi,
};

fn server_tls_flags(files: &(String, String, String)) -> Vec<String> {
    vec![
        "--tls-ca-file".into(),
        files.0.clone(),
        "--tls-cert-file".into(),
        files.1.clone(),
        "--tls-key-file".into(),
        files.2.clone(),
    ]
}

fn agent_tls_flags(files: &(String, String, String), server_cn: &str) -> Vec<String> {
    let mut f = server_tls_flags(files);
    f.extend(["--tls-server-cn".into(), server_cn.into()]);
    f
}

fn https(server: &Server) -> String {
    server.grpc.replace("http://", "https://")
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for: {what}");
}

fn wait_server_log(server: &Server, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if server.log_text().contains(needle) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "server log never contained {needle:?}:\n{}",
        server.log_text()
    );
}

fn workloads(state: &serde_json::Value) -> Vec<String> {
    state["workload_endpoints"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// A TLS calc-server (CN identities) and the material to make agents for it.
struct Setup {
    _ds: tempfile::TempDir,
    dir: tempfile::TempDir,
    ca: Ca,
    server: Server,
}

fn tls_server(extra: &[&str]) -> Setup {
    let ds = example_datastore();
    let dir = tempfile::tempdir().unwrap();
    let ca = ca("split-felix test CA");
    let files = leaf(
        dir.path(),
        "server",
        &ca,
        "calc-server",
        &[],
        Role::Server,
        false,
    );
    let mut flags = server_tls_flags(&files);
    flags.extend(extra.iter().map(|s| s.to_string()));
    let server = Server::start(ds.path(), &refs(&flags));
    Setup {
        _ds: ds,
        dir,
        ca,
        server,
    }
}

impl Setup {
    fn client(
        &self,
        name: &str,
        cn: &str,
        uris: &[&str],
        expired: bool,
    ) -> (String, String, String) {
        leaf(
            self.dir.path(),
            name,
            &self.ca,
            cn,
            uris,
            Role::Client,
            expired,
        )
    }
}

#[test]
fn valid_mtls_agent_gets_its_own_span_with_health_and_metrics() {
    let s = tls_server(&[]);
    let files = s.client("node-1-client", "node-1", &[], false);
    let admin = format!("127.0.0.1:{}", free_port());
    let mut flags = agent_tls_flags(&files, "calc-server");
    flags.extend(["--admin-listen".into(), admin.clone()]);
    let agent = Agent::start_with(
        s.dir.path(),
        &https(&s.server),
        "node-1",
        "valid",
        &refs(&flags),
    );
    let state = agent.wait_for("node-1 in sync over mTLS", |st| st["in_sync"] == true);
    assert_eq!(
        workloads(&state),
        [
            "k8s/monitoring/prometheus-0/eth0",
            "k8s/shop/api-1/eth0",
            "k8s/shop/web-1/eth0"
        ]
    );
    // The agent's admin endpoint: ready once connected, in sync and applied.
    wait_until("agent ready", Duration::from_secs(10), || {
        http_get(&admin, "/readiness").is_some_and(|(c, _)| c == 200)
    });
    assert_eq!(http_get(&admin, "/liveness").map(|r| r.0), Some(200));
    let (code, text) = http_get(&admin, "/metrics").expect("agent /metrics");
    assert_eq!(code, 200);
    assert_eq!(metric(&text, "dataplane_agent_connected"), Some(1.0));
    assert_eq!(metric(&text, "dataplane_agent_ready"), Some(1.0));
    assert!(metric(&text, "dataplane_agent_apply_seconds_count").unwrap() >= 1.0);
    assert!(
        metric(&text, "dataplane_agent_programmed_ipsets").unwrap() >= 1.0,
        "{text}"
    );
    assert!(metric(&text, "dataplane_agent_messages_total").unwrap() > 5.0);
    // The server's metrics and status see the agent; its reports (endpoints of its own node)
    // are accepted.
    wait_until(
        "status reports reach the server",
        Duration::from_secs(10),
        || {
            let st = s.server.status();
            st.as_array().unwrap().iter().any(|n| {
                n["node"] == "node-1"
                    && n["connected"] == true
                    && n["dataplane_in_sync"] == true
                    && n["workload_endpoints"]["k8s/shop/web-1/eth0"] == "up"
            })
        },
    );
    let (code, text) = http_get(&s.server.admin, "/metrics").expect("server /metrics");
    assert_eq!(code, 200);
    assert_eq!(
        metric(&text, "calc_server_connected_agents"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(metric(&text, "calc_server_ready"), Some(1.0));
    assert!(metric(&text, "calc_server_datastore_updates_total").unwrap() > 10.0);
    assert_eq!(
        metric(&text, "calc_server_datastore_syncs_total"),
        Some(1.0)
    );
    assert!(metric(&text, "calc_server_calc_seconds_count").unwrap() >= 1.0);
    assert!(
        text.contains("calc_server_agent_lag_messages{node=\"node-1\"} 0"),
        "{text}"
    );
    assert_eq!(
        metric(&text, "calc_server_permission_denied_total"),
        Some(0.0)
    );
}

#[test]
fn server_refuses_clients_without_a_good_certificate() {
    let s = tls_server(&[]);
    let other_ca = ca("another CA");
    let wrong_ca = leaf(
        s.dir.path(),
        "wrong-ca",
        &other_ca,
        "node-1",
        &[],
        Role::Client,
        false,
    );
    // The agent must still trust the real server, so its CA file is the right one.
    let wrong_ca = (
        s.dir
            .path()
            .join("server-ca.pem")
            .to_str()
            .unwrap()
            .to_string(),
        wrong_ca.1,
        wrong_ca.2,
    );
    let expired = s.client("expired", "node-1", &[], true);
    let node_b = s.client("node-2-client", "node-2", &[], false);
    let url = https(&s.server);

    let plaintext = Agent::start_with(s.dir.path(), &s.server.grpc, "node-1", "plaintext", &[]);
    let a_wrong_ca = Agent::start_with(
        s.dir.path(),
        &url,
        "node-1",
        "wrong-ca",
        &refs(&agent_tls_flags(&wrong_ca, "calc-server")),
    );
    let a_expired = Agent::start_with(
        s.dir.path(),
        &url,
        "node-1",
        "expired",
        &refs(&agent_tls_flags(&expired, "calc-server")),
    );
    // Node B's certificate asking for node A's span.
    let b_as_a = Agent::start_with(
        s.dir.path(),
        &url,
        "node-1",
        "node-b-as-a",
        &refs(&agent_tls_flags(&node_b, "calc-server")),
    );

    let log = b_as_a.wait_for_log("PermissionDenied");
    assert!(
        log.contains("the client certificate is for node \\\"node-2\\\"")
            || log.contains("the client certificate is for node \"node-2\""),
        "{log}"
    );
    wait_server_log(&s.server, "refused: AgentHello names another node");
    // Under TLS 1.3 the client learns of the refusal on its first read: the connection or the
    // stream fails.
    for a in [&a_wrong_ca, &a_expired, &plaintext] {
        wait_until(
            "the agent reports the refused connection",
            Duration::from_secs(20),
            || {
                let log = a.log_text();
                log.contains("cannot connect to calc-server") || log.contains("stream ended")
            },
        );
    }
    // Every one of them was refused at the TLS layer (3) or by identity (1), and none ever
    // received a span.
    wait_until("three handshakes refused", Duration::from_secs(10), || {
        let text = http_get(&s.server.admin, "/metrics").unwrap().1;
        text.contains("calc_server_connections_refused_total{reason=\"tls_handshake\"}")
            && text
                .lines()
                .find(|l| l.contains("reason=\"tls_handshake\""))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|n| n >= 3)
    });
    let server_log = s.server.log_text();
    assert!(server_log.contains("TLS handshake failed"), "{server_log}");
    // Each refusal is logged with its reason.
    for reason in [
        "invalid peer certificate: UnknownIssuer",
        "certificate expired",
        "InvalidContentType",
    ] {
        assert!(server_log.contains(reason), "{reason}: {server_log}");
    }
    for a in [&plaintext, &a_wrong_ca, &a_expired, &b_as_a] {
        assert!(
            a.state().is_none(),
            "a refused agent got a span: {}",
            a.log.display()
        );
    }
    let status = s.server.status();
    assert!(
        status
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["connected"] != true),
        "{status}"
    );
}

#[test]
fn agent_refuses_servers_without_the_right_certificate() {
    let ds = example_datastore();
    let dir = tempfile::tempdir().unwrap();
    let ca_ok = ca("agent's CA");
    let ca_other = ca("a CA the agent does not trust");
    let client = leaf(
        dir.path(),
        "client",
        &ca_ok,
        "node-1",
        &[],
        Role::Client,
        false,
    );
    // Servers trust the agent's CA for client certificates, but present various certificates.
    let start = |name: &str, issuer: &Ca, cn: &str, uris: &[&str], expired: bool| {
        let f = leaf(dir.path(), name, issuer, cn, uris, Role::Server, expired);
        let flags = server_tls_flags(&(client.0.clone(), f.1, f.2));
        Server::start(ds.path(), &refs(&flags))
    };
    let wrong_ca = start("srv-wrong-ca", &ca_other, "calc-server", &[], false);
    let expired = start("srv-expired", &ca_ok, "calc-server", &[], true);
    let wrong_cn = start(
        "srv-wrong-cn",
        &ca_ok,
        "impostor",
        &["spiffe://test/impostor"],
        false,
    );
    let good = start(
        "srv-good",
        &ca_ok,
        "calc-server",
        &["spiffe://test/calc-server"],
        false,
    );
    let plain = Server::start(ds.path(), &[]);

    let cn_flags = agent_tls_flags(&client, "calc-server");
    let run = |name: &str, server: &str, flags: &[String]| {
        Agent::start_with(dir.path(), server, "node-1", name, &refs(flags))
    };
    let a_wrong_ca = run("a-wrong-ca", &https(&wrong_ca), &cn_flags);
    let a_expired = run("a-expired", &https(&expired), &cn_flags);
    let a_wrong_cn = run("a-wrong-cn", &https(&wrong_cn), &cn_flags);
    // URI SAN form: the good server's URI SAN matches, a wrong expectation does not.
    let mut uri_ok = server_tls_flags(&client);
    uri_ok.extend([
        "--tls-server-uri-san".into(),
        "spiffe://test/calc-server".into(),
    ]);
    let mut uri_bad = server_tls_flags(&client);
    uri_bad.extend(["--tls-server-uri-san".into(), "spiffe://test/other".into()]);
    let a_uri_bad = run("a-uri-bad", &https(&good), &uri_bad);
    // TLS agent against a plaintext server, and a plaintext agent against a TLS one.
    let a_vs_plain = run("a-vs-plain", &https(&plain), &cn_flags);
    let a_uri_ok = run("a-uri-ok", &https(&good), &uri_ok);
    let a_cn_ok = run("a-cn-ok", &https(&good), &cn_flags);

    // Each failure is one line saying what is wrong and which flag to check, not a debug dump.
    let first_failure = |a: &Agent| {
        a.wait_for_log("cannot connect to calc-server");
        failures(a).into_iter().next().expect("a failure line")
    };
    let line = first_failure(&a_wrong_ca);
    assert!(
        line.contains("UnknownIssuer") && line.contains("check that --tls-ca-file"),
        "{line}"
    );
    let line = first_failure(&a_expired);
    assert!(
        line.contains("certificate expired") && line.contains("renew"),
        "{line}"
    );
    let line = first_failure(&a_wrong_cn);
    assert!(
        line.contains("identity mismatch")
            && line.contains("impostor")
            && line.contains("--tls-server-cn"),
        "{line}"
    );
    let line = first_failure(&a_uri_bad);
    assert!(
        line.contains("spiffe://test/other") && line.contains("--tls-server-uri-san"),
        "{line}"
    );
    for a in [&a_wrong_ca, &a_expired, &a_wrong_cn, &a_uri_bad] {
        let line = failures(a).into_iter().next().unwrap();
        assert!(
            !line.contains("OtherError") && !line.contains("Some("),
            "a debug dump: {line}"
        );
    }
    a_vs_plain.wait_for_log("cannot connect to calc-server");
    a_uri_ok.wait_for("URI SAN server accepted", |s| s["in_sync"] == true);
    a_cn_ok.wait_for("CN server accepted", |s| s["in_sync"] == true);
    for a in [
        &a_wrong_ca,
        &a_expired,
        &a_wrong_cn,
        &a_uri_bad,
        &a_vs_plain,
    ] {
        assert!(a.state().is_none(), "{} got a span", a.log.display());
    }
    // The refused servers never saw a stream.
    for s in [&wrong_ca, &expired, &wrong_cn, &plain] {
        let text = http_get(&s.admin, "/metrics").unwrap().1;
        assert_eq!(metric(&text, "calc_server_connected_agents"), Some(0.0));
    }
}

#[test]
fn uri_san_node_identity() {
    let prefix = "spiffe://cluster.test/calico-node/";
    let s = tls_server(&["--tls-client-uri-san-prefix", prefix]);
    let url = https(&s.server);
    let ok = s.client(
        "uri-ok",
        "not-the-node-name",
        &[&format!("{prefix}node-2")],
        false,
    );
    let wrong_prefix = s.client(
        "uri-wrong",
        "node-1",
        &["spiffe://elsewhere/calico-node/node-1"],
        false,
    );
    let other_node = s.client("uri-other", "node-1", &[&format!("{prefix}node-2")], false);
    let a_ok = Agent::start_with(
        s.dir.path(),
        &url,
        "node-2",
        "uri-ok",
        &refs(&agent_tls_flags(&ok, "calc-server")),
    );
    let a_wrong = Agent::start_with(
        s.dir.path(),
        &url,
        "node-1",
        "uri-wrong",
        &refs(&agent_tls_flags(&wrong_prefix, "calc-server")),
    );
    let a_other = Agent::start_with(
        s.dir.path(),
        &url,
        "node-1",
        "uri-other",
        &refs(&agent_tls_flags(&other_node, "calc-server")),
    );
    let state = a_ok.wait_for("node-2 in sync via its URI SAN", |st| st["in_sync"] == true);
    assert_eq!(workloads(&state).len(), 3);
    let log = a_wrong.wait_for_log("PermissionDenied");
    assert!(log.contains("spiffe://cluster.test/calico-node/"), "{log}");
    a_other.wait_for_log("PermissionDenied");
    assert!(a_wrong.state().is_none() && a_other.state().is_none());
    wait_server_log(&s.server, "refused: the client certificate names no node");
}

/// Clients that never finish their TLS handshake keep no valid agent out, and the server
/// drops them.
#[test]
fn stalled_handshakes_are_dropped_and_delay_nobody() {
    let s = tls_server(&["--tls-handshake-timeout", "2s"]);
    let addr = s.server.grpc.trim_start_matches("http://").to_string();
    // Five clients that connect and send nothing, and one that stalls mid-record.
    let mut stalled: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    let mut half = TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(&mut half, &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).unwrap();
    stalled.push(half);

    let files = s.client("prompt", "node-1", &[], false);
    let agent = Agent::start_with(
        s.dir.path(),
        &https(&s.server),
        "node-1",
        "prompt",
        &refs(&agent_tls_flags(&files, "calc-server")),
    );
    agent.wait_for("valid agent in sync despite stalled clients", |st| {
        st["in_sync"] == true
    });

    // The server drops every stalled socket (its handshake timeout is 2 s; 30 s only keeps the
    // test from hanging). How long the valid agent took is for the benchmarks.
    let held: usize = std::thread::scope(|sc| {
        let handles: Vec<_> = stalled
            .into_iter()
            .map(|sock| sc.spawn(move || closed_by_peer(sock, Duration::from_secs(30))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|closed| !closed)
            .count()
    });
    assert_eq!(held, 0, "stalled sockets the server never dropped");
    let text = http_get(&s.server.admin, "/metrics").unwrap().1;
    assert!(
        text.contains("calc_server_connections_refused_total{reason=\"tls_handshake_timeout\"} 5")
            || text.contains(
                "calc_server_connections_refused_total{reason=\"tls_handshake_timeout\"} 6"
            ),
        "{text}"
    );
    wait_server_log(&s.server, "TLS handshake not completed in time");
}

#[test]
fn pending_connection_limit_closes_extra_connections() {
    let ds = example_datastore();
    let server = Server::start(
        ds.path(),
        &[
            "--max-pending-connections",
            "2",
            "--log-level",
            "info,calc_server::serve::listener=debug",
        ],
    );
    let addr = server.grpc.trim_start_matches("http://").to_string();
    // Two connections the server has taken as pending: each sends the HTTP/2 preface (and then
    // nothing), and the server logs it established, so both hold a pending slot before the
    // third connects.
    let preface = |mut sock: TcpStream| {
        std::io::Write::write_all(&mut sock, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
        sock
    };
    let _a = preface(TcpStream::connect(&addr).unwrap());
    let _b = preface(TcpStream::connect(&addr).unwrap());
    wait_until(
        "both pending connections established",
        Duration::from_secs(20),
        || server.log_text().matches("connection established").count() >= 2,
    );
    assert!(
        closed_by_peer(TcpStream::connect(&addr).unwrap(), Duration::from_secs(30)),
        "the third connection was kept"
    );
    let text = http_get(&server.admin, "/metrics").unwrap().1;
    assert!(
        text.contains("calc_server_connections_refused_total{reason=\"pending_limit\"} 1"),
        "{text}"
    );
}

fn sigterm(child: &std::process::Child) {
    assert!(integration::send_signal(child.id(), "TERM"), "kill -TERM");
}

fn wait_exit(
    child: &mut std::process::Child,
    within: Duration,
) -> (std::process::ExitStatus, Duration) {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, started.elapsed());
        }
        assert!(started.elapsed() < within, "did not exit within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_drains_the_server_and_stops_the_agent_leaving_the_dataplane() {
    let mut s = tls_server(&[]);
    let files = s.client("term", "node-1", &[], false);
    let mut agent = Agent::start_with(
        s.dir.path(),
        &https(&s.server),
        "node-1",
        "term",
        &refs(&agent_tls_flags(&files, "calc-server")),
    );
    let before = agent.wait_for("in sync", |st| st["in_sync"] == true);
    sigterm(&s.server.child);
    let (status, took) = wait_exit(&mut s.server.child, Duration::from_secs(10));
    assert!(status.success(), "server exit status {status}");
    eprintln!("server drained and exited 0 in {took:?}");
    assert!(
        s.server
            .log_text()
            .contains("shutting down: closing agent streams")
    );
    agent.wait_for_log("calc-server is shutting down");
    // The agent keeps its dataplane while the server is gone, and on SIGTERM exits 0 leaving
    // it in place.
    sigterm(&agent.child);
    let (status, took) = wait_exit(&mut agent.child, Duration::from_secs(10));
    assert!(status.success(), "agent exit status {status}");
    eprintln!("agent exited 0 in {took:?}");
    let after = agent.state().expect("state file still there");
    assert_eq!(workloads(&after), workloads(&before));
    assert!(agent.log_text().contains("the dataplane is left"));
}

/// An agent may report status only for endpoints its stream was sent (its own node's).
#[test]
fn status_for_another_nodes_endpoint_is_refused() {
    use felix_proto as pb;
    use pb::from_dataplane::Payload as From;
    use tokio_stream::StreamExt;

    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut client = pb::calc_server_client::CalcServerClient::connect(server.grpc.clone())
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let hello = pb::FromDataplane {
            sequence_number: 1,
            payload: Some(From::AgentHello(pb::AgentHello {
                node_name: "node-1".into(),
                agent_version: "test".into(),
                capabilities: vec![],
            })),
        };
        tx.send(hello).await.unwrap();
        let mut rx_stream = client
            .sync(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        // Read through InSync: the node's endpoints have been sent.
        loop {
            let m = rx_stream.next().await.unwrap().unwrap();
            if matches!(m.payload, Some(pb::to_dataplane::Payload::InSync(_))) {
                break;
            }
        }
        // api-2 lives on node-2 (node-1 has api-1).
        let report = |seq, workload: &str| pb::FromDataplane {
            sequence_number: seq,
            payload: Some(From::WorkloadEndpointStatusUpdate(
                pb::WorkloadEndpointStatusUpdate {
                    id: Some(pb::WorkloadEndpointId {
                        orchestrator_id: "k8s".into(),
                        workload_id: workload.into(),
                        endpoint_id: "eth0".into(),
                    }),
                    status: Some(pb::EndpointStatus {
                        status: "up".into(),
                    }),
                    endpoint: None,
                },
            )),
        };
        tx.send(report(2, "shop/api-1")).await.unwrap();
        tx.send(report(3, "shop/api-2")).await.unwrap();
        let status = loop {
            match tokio::time::timeout(Duration::from_secs(10), rx_stream.next())
                .await
                .expect("the stream ends")
            {
                Some(Ok(_)) => continue,
                Some(Err(status)) => break status,
                None => panic!("stream closed without a status"),
            }
        };
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
        assert!(
            status.message().contains("k8s/shop/api-2/eth0"),
            "{status:?}"
        );
    });
    wait_server_log(
        &server,
        "refused: status report for an endpoint not on this node",
    );
    let st = server.status();
    let n1 = st
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "node-1")
        .cloned()
        .unwrap();
    assert!(
        n1["workload_endpoints"]["k8s/shop/api-2/eth0"].is_null(),
        "{n1}"
    );
}

/// The agent's failure lines (connection or stream).
fn failures(agent: &Agent) -> Vec<String> {
    agent
        .log_text()
        .lines()
        .filter(|l| l.contains("cannot connect to calc-server") || l.contains("stream ended"))
        .map(strip_ansi)
        .collect()
}

/// A calc-server that refuses the agent's client certificate (signed by a CA it does not
/// trust): the agent's log names the TLS alert, and no failure line is left without a reason
/// (before, they read "transport error" or "operation was canceled").
#[test]
fn the_log_names_why_the_server_refused_the_agents_certificate() {
    let ds = example_datastore();
    let dir = tempfile::tempdir().unwrap();
    let server_ca = ca("calc-server CA");
    let srv = leaf(
        dir.path(),
        "server",
        &server_ca,
        "calc-server",
        &[],
        Role::Server,
        false,
    );
    let server = Server::start(
        ds.path(),
        &[
            "--tls-ca-file",
            &srv.0,
            "--tls-cert-file",
            &srv.1,
            "--tls-key-file",
            &srv.2,
        ],
    );
    let stranger = leaf(
        dir.path(),
        "client",
        &ca("another CA"),
        "node-1",
        &[],
        Role::Client,
        false,
    );
    let agent = Agent::start_with(
        dir.path(),
        &server.grpc.replace("http://", "https://"),
        "node-1",
        "refused",
        &[
            "--tls-ca-file",
            &srv.0,
            "--tls-cert-file",
            &stranger.1,
            "--tls-key-file",
            &stranger.2,
            "--tls-server-cn",
            "calc-server",
        ],
    );
    agent.wait_for_log("received fatal alert: UnknownCA");
    for line in failures(&agent) {
        assert!(
            line.contains("UnknownCA") || line.contains("refuses this agent's client certificate"),
            "a failure without its reason: {line}"
        );
    }
    assert!(agent.state().is_none(), "a refused agent got a span");
}

/// TLS against plaintext and plaintext against TLS: each side's log says what is wrong.
#[test]
fn tls_and_plaintext_mismatches_are_named() {
    let ds = example_datastore();
    let dir = tempfile::tempdir().unwrap();
    let the_ca = ca("calc-server CA");
    let srv = leaf(
        dir.path(),
        "server",
        &the_ca,
        "calc-server",
        &[],
        Role::Server,
        false,
    );
    let client = leaf(
        dir.path(),
        "client",
        &the_ca,
        "node-1",
        &[],
        Role::Client,
        false,
    );
    let tls_server = Server::start(
        ds.path(),
        &[
            "--tls-ca-file",
            &srv.0,
            "--tls-cert-file",
            &srv.1,
            "--tls-key-file",
            &srv.2,
        ],
    );
    let plain_server = Server::start(ds.path(), &[]);
    let tls_agent = Agent::start_with(
        dir.path(),
        &plain_server.grpc.replace("http://", "https://"),
        "node-1",
        "tls-to-plain",
        &[
            "--tls-ca-file",
            &client.0,
            "--tls-cert-file",
            &client.1,
            "--tls-key-file",
            &client.2,
            "--tls-server-cn",
            "calc-server",
        ],
    );
    let plain_agent =
        Agent::start_with(dir.path(), &tls_server.grpc, "node-1", "plain-to-tls", &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let named = |agent: &Agent, reasons: &[&str]| {
        failures(agent)
            .iter()
            .any(|l| reasons.iter().any(|r| l.contains(r)))
    };
    while !(named(
        &tls_agent,
        &["InvalidContentType", "during the TLS handshake"],
    ) && named(&plain_agent, &["the server may expect TLS"]))
    {
        assert!(
            Instant::now() < deadline,
            "TLS agent log:\n{}\nplaintext agent log:\n{}",
            tls_agent.log_text(),
            plain_agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(tls_agent.state().is_none() && plain_agent.state().is_none());
}
