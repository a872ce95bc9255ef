//! The Sync stream against the real `calc-server serve`, with a raw gRPC client standing in for
//! an agent: hello → ServerHello → snapshot → InSync → deltas, disjoint spans per node, edits
//! reaching connected agents, protocol errors refused with clear statuses while good agents sync,
//! replacement of a node's older stream, and a stalled agent cut off instead of growing memory.

use std::time::Duration;

use felix_proto as pb;
use felix_proto::calc_server_client::CalcServerClient;
use integration::{Server, example_datastore};
use pb::from_dataplane::Payload as From;
use pb::to_dataplane::Payload as To;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

struct Agent {
    tx: mpsc::Sender<pb::FromDataplane>,
    rx: tonic::Streaming<pb::ToDataplane>,
    seq: u64,
}

fn hello(node: &str) -> pb::FromDataplane {
    pb::FromDataplane {
        sequence_number: 1,
        payload: Some(From::AgentHello(pb::AgentHello {
            node_name: node.into(),
            agent_version: "test".into(),
            capabilities: vec![],
        })),
    }
}

async fn connect(url: &str, first: pb::FromDataplane) -> Result<Agent, tonic::Status> {
    let mut client = CalcServerClient::connect(url.to_string())
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel(16);
    tx.send(first).await.unwrap();
    let resp = client.sync(ReceiverStream::new(rx)).await?;
    Ok(Agent {
        tx,
        rx: resp.into_inner(),
        seq: 0,
    })
}

impl Agent {
    /// Next message, checking sequence numbers go up by one.
    async fn next(&mut self) -> Result<pb::ToDataplane, tonic::Status> {
        let m = tokio::time::timeout(Duration::from_secs(10), self.rx.next())
            .await
            .expect("a message within 10 s")
            .expect("stream still open")?;
        assert_eq!(
            m.sequence_number,
            self.seq + 1,
            "sequence numbers increase by one"
        );
        self.seq = m.sequence_number;
        Ok(m)
    }

    /// Everything up to and including InSync.
    async fn snapshot(&mut self) -> Vec<To> {
        let mut out = Vec::new();
        loop {
            let m = self
                .next()
                .await
                .expect("snapshot message")
                .payload
                .unwrap();
            let done = matches!(m, To::InSync(_));
            out.push(m);
            if done {
                return out;
            }
        }
    }
}

fn policy_names(msgs: &[To]) -> Vec<String> {
    msgs.iter()
        .filter_map(|m| match m {
            To::ActivePolicyUpdate(u) => u.id.as_ref().map(|i| i.name.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn hello_snapshot_in_sync_then_deltas() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let mut a = connect(&server.grpc, hello("node-1")).await.unwrap();
    match a.next().await.unwrap().payload {
        Some(To::ServerHello(h)) => assert_eq!(h.node_name, "node-1"),
        other => panic!("first message must be ServerHello, got {other:?}"),
    }
    let snap = a.snapshot().await;
    assert!(matches!(snap[0], To::ConfigUpdate(_)));
    let weps = snap
        .iter()
        .filter(|m| matches!(m, To::WorkloadEndpointUpdate(_)))
        .count();
    assert_eq!(weps, 3, "node-1 runs three pods");
    assert!(
        !policy_names(&snap).contains(&"allow-postgres".to_string()),
        "not node-1's policy"
    );

    // Edit a manifest: allow-web-ingress opens 8443 instead of 443. The agent gets the delta.
    let path = ds.path().join("policies.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = text.replace("      ports: [80, 443]", "      ports: [80, 8443]");
    assert_ne!(edited, text);
    std::fs::write(&path, edited).unwrap();
    let m = a.next().await.unwrap().payload.unwrap();
    match m {
        To::ActivePolicyUpdate(u) => assert_eq!(u.id.unwrap().name, "allow-web-ingress"),
        other => panic!("expected the edited policy, got {other:?}"),
    }

    // Status back: the server records the agent's reports.
    let id = pb::WorkloadEndpointId {
        orchestrator_id: "k8s".into(),
        workload_id: "shop/web-1".into(),
        endpoint_id: "eth0".into(),
    };
    a.tx.send(pb::FromDataplane {
        sequence_number: 2,
        payload: Some(From::DataplaneInSync(pb::DataplaneInSync {})),
    })
    .await
    .unwrap();
    a.tx.send(pb::FromDataplane {
        sequence_number: 3,
        payload: Some(From::WorkloadEndpointStatusUpdate(
            pb::WorkloadEndpointStatusUpdate {
                id: Some(id),
                status: Some(pb::EndpointStatus {
                    status: "up".into(),
                }),
                endpoint: None,
            },
        )),
    })
    .await
    .unwrap();
    let mut ok = false;
    for _ in 0..100 {
        let st = server.status();
        let n = st
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node"] == "node-1")
            .cloned()
            .unwrap_or_default();
        if n["dataplane_in_sync"] == true && n["workload_endpoints"]["k8s/shop/web-1/eth0"] == "up"
        {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "status reached the admin endpoint: {}", server.status());
    // And the file datastore's status writer persisted it under status/.
    let mut written = String::new();
    for _ in 0..100 {
        written = std::fs::read_to_string(ds.path().join("status/node-1.json")).unwrap_or_default();
        if written.contains("k8s/shop/web-1/eth0") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        written.contains("\"k8s/shop/web-1/eth0\": \"up\""),
        "{written}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn nodes_receive_disjoint_spans() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let mut a = connect(&server.grpc, hello("node-1")).await.unwrap();
    let mut b = connect(&server.grpc, hello("node-2")).await.unwrap();
    a.next().await.unwrap();
    b.next().await.unwrap();
    let (sa, sb) = (a.snapshot().await, b.snapshot().await);
    let ids = |s: &[To]| -> Vec<String> {
        s.iter()
            .filter_map(|m| match m {
                To::WorkloadEndpointUpdate(u) => u.id.as_ref().map(|i| i.workload_id.clone()),
                _ => None,
            })
            .collect()
    };
    let (ia, ib) = (ids(&sa), ids(&sb));
    assert_eq!(ia.len(), 3);
    assert_eq!(ib.len(), 3);
    assert!(ia.iter().all(|w| !ib.contains(w)), "{ia:?} vs {ib:?}");
    assert!(policy_names(&sb).contains(&"allow-postgres".to_string()));
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_first_messages_are_refused_while_a_good_agent_syncs() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &["--hello-timeout", "1s"]);
    let mut good = connect(&server.grpc, hello("node-1")).await.unwrap();

    // Garbage on the TCP port: the server survives it.
    {
        use std::io::Write;
        let addr = server.grpc.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n\x00\x01garbage\xff\xfe");
    }
    // A status report instead of a hello.
    let not_hello = pb::FromDataplane {
        sequence_number: 1,
        payload: Some(From::DataplaneInSync(pb::DataplaneInSync {})),
    };
    let err = match connect(&server.grpc, not_hello).await {
        Err(e) => e,
        Ok(mut a) => a.next().await.expect_err("refused"),
    };
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("AgentHello"), "{}", err.message());
    // A hello for a node the datastore does not know.
    let err = match connect(&server.grpc, hello("no-such-node")).await {
        Err(e) => e,
        Ok(mut a) => a.next().await.expect_err("refused"),
    };
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    // A node name that is not a DNS name (it would become a status file path).
    let err = match connect(&server.grpc, hello("../../etc/x")).await {
        Err(e) => e,
        Ok(mut a) => a.next().await.expect_err("refused"),
    };
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    // Silence: no hello within the timeout.
    let mut client = CalcServerClient::connect(server.grpc.clone())
        .await
        .unwrap();
    let (_tx, rx) = mpsc::channel::<pb::FromDataplane>(1);
    let err = client
        .sync(ReceiverStream::new(rx))
        .await
        .expect_err("refused");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");

    // The good agent was unaffected.
    assert!(matches!(
        good.next().await.unwrap().payload,
        Some(To::ServerHello(_))
    ));
    assert!(matches!(good.snapshot().await.last(), Some(To::InSync(_))));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_hello_replaces_the_older_stream() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let mut old = connect(&server.grpc, hello("node-2")).await.unwrap();
    old.next().await.unwrap();
    old.snapshot().await;
    let mut new = connect(&server.grpc, hello("node-2")).await.unwrap();
    new.next().await.unwrap();
    assert!(
        matches!(new.snapshot().await.last(), Some(To::InSync(_))),
        "the new stream gets a full snapshot"
    );
    let err = old.next().await.expect_err("the old stream is closed");
    assert_eq!(err.code(), tonic::Code::Aborted, "{err:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_agent_is_cut_off_not_buffered_forever() {
    // A bigger cluster so one node's snapshot overflows the HTTP/2 window of a client that
    // never reads.
    let dir = tempfile::tempdir().unwrap();
    let generated = std::process::Command::new(integration::binary("calc-bench"))
        .args([
            "gen-cluster",
            "--nodes",
            "2",
            "--endpoints-per-node",
            "400",
            "--policies",
            "60",
            "--namespaces",
            "4",
            "--out",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        generated.status.success(),
        "{}",
        String::from_utf8_lossy(&generated.stderr)
    );
    let server = Server::start(dir.path(), &["--agent-backlog-limit", "100"]);
    // Connects, says hello, then never reads.
    let stalled = connect(&server.grpc, hello("node-0")).await.unwrap();
    // The server has accepted it (and queued its snapshot) before the changes start.
    let connected = || {
        server.status().as_array().is_some_and(|nodes| {
            nodes
                .iter()
                .any(|n| n["node"] == "node-0" && n["connected"] == true)
        })
    };
    for _ in 0..400 {
        if connected() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        connected(),
        "node-0 never shown connected: {}",
        server.status()
    );
    // Move every workload to new addresses, round after round, until the server cuts the
    // agent off: far more messages than the backlog limit and the transport's buffers together.
    // Rounds continue until then (bounded), so a slow machine on which the file watcher merges
    // several rounds into one still gets there.
    let path = dir.path().join("workloads.json");
    let original = std::fs::read_to_string(&path).unwrap();
    let stalled_is_cut = || {
        server
            .status()
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["node"] == "node-0" && n["connected"] == false)
    };
    let mut cut = false;
    for round in 0..60 {
        std::fs::write(
            &path,
            original.replace("\"10.128.", &format!("\"10.{}.", 130 + round)),
        )
        .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        if stalled_is_cut() {
            cut = true;
            break;
        }
    }
    assert!(
        cut,
        "the stalled agent must be disconnected: {}",
        server.status()
    );
    assert!(
        server.log_text().contains("fell too far behind"),
        "{}",
        server.log_text()
    );
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_reports_close_the_stream_with_a_clear_status() {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &["--max-recv-bytes", "65536"]);
    let mut a = connect(&server.grpc, hello("node-1")).await.unwrap();
    a.next().await.unwrap();
    a.snapshot().await;
    // A 1 MiB heartbeat timestamp: far above the limit.
    a.tx.send(pb::FromDataplane {
        sequence_number: 2,
        payload: Some(From::ProcessStatusUpdate(pb::ProcessStatusUpdate {
            iso_timestamp: "x".repeat(1 << 20),
            uptime: 1.0,
        })),
    })
    .await
    .unwrap();
    let err = loop {
        match a.next().await {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
    assert!(err.message().contains("too large"), "{}", err.message());
}
