//! Unauthenticated peers against the Sync listener: idle sockets and connections that never
//! say hello are closed after the handshake and hello deadlines and are limited per source
//! address, so a flood locks out no agent: a good agent connects and follows a change while the
//! flood runs. Real server, real agent (dry-run driver). How fast is for the benchmarks, not
//! asserted here.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use integration::{Agent, Server, closed_by_peer, example_datastore, http_get, metric};

/// A TCP connection to `to` from the loopback address `from` (each a separate "host").
fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
        sock.connect(to).await.unwrap().into_std().unwrap()
    })
}

#[test]
fn a_flood_of_idle_and_silent_connections_locks_out_no_agent() {
    let ds = example_datastore();
    let work = tempfile::tempdir().unwrap();
    let server = Server::start(
        ds.path(),
        &[
            "--tls-handshake-timeout",
            "1s",
            "--hello-timeout",
            "1s",
            "--max-pending-per-address",
            "8",
        ],
    );
    let addr: SocketAddr = server.grpc.trim_start_matches("http://").parse().unwrap();
    // One "host" opens 300 idle sockets; another completes the HTTP/2 preface and then says
    // nothing more (no settings, no stream, no hello).
    let idle: Vec<TcpStream> = (0..300).map(|_| connect_from("127.0.0.2", addr)).collect();
    let silent: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = connect_from("127.0.0.3", addr);
            s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
            s
        })
        .collect();
    // An HTTP/1 client on the gRPC port is told where it is.
    let mut http1 = connect_from("127.0.0.4", addr);
    http1
        .write_all(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    // Meanwhile a good agent connects and follows a change.
    let agent = Agent::start(work.path(), &server.grpc, "node-2");
    agent.wait_for("in sync during the flood", |s| s["in_sync"] == true);
    let path = ds.path().join("policies.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("name: allow-postgres", "name: allow-postgres-2"),
    )
    .unwrap();
    agent.wait_for("the change during the flood", |s| {
        s["policies"]
            .as_object()
            .is_some_and(|p| p.contains_key("NetworkPolicy/db/allow-postgres-2"))
    });
    // Every idle and silent socket is closed by the server (the deadlines are 1 s + 1 s; 30 s
    // only keeps the test from hanging), not held forever.
    let held: usize = std::thread::scope(|sc| {
        let handles: Vec<_> = idle
            .into_iter()
            .chain(silent)
            .map(|s| sc.spawn(move || closed_by_peer(s, Duration::from_secs(30))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|closed| !closed)
            .count()
    });
    assert_eq!(held, 0, "sockets the server never closed");
    assert!(
        closed_by_peer(http1, Duration::from_secs(30)),
        "the HTTP/1 client is answered and closed"
    );
    let (_, m) = http_get(&server.admin, "/metrics").unwrap();
    let refused = |reason: &str| {
        metric(
            &m,
            &format!("calc_server_connections_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(
        refused("pending_per_address"),
        Some((300 - 8 + 20 - 8) as f64),
        "{m}"
    );
    assert_eq!(refused("preface_timeout"), Some(8.0), "{m}");
    assert_eq!(refused("hello_timeout"), Some(8.0), "{m}");
    assert_eq!(refused("not_http2"), Some(1.0), "{m}");
    assert!(
        server
            .log_text()
            .contains("an HTTP/1 request on the gRPC port"),
        "{}",
        server.log_text()
    );
    // The agent is still there.
    let state = agent.state().unwrap();
    assert_eq!(state["in_sync"], true);
}
