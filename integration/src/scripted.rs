//! A scripted calc-server inside a network namespace: the test decides every `ToDataplane`
//! message the agent receives (hostile ones included) and reads every report it sends back.
//!
//! It runs on its own thread, which enters the namespace (`setns`) before it builds a
//! single-threaded runtime, so it listens on the namespace's loopback like a calc-server on the
//! node would. Each stream gets `ServerHello` after the agent's hello, then every payload sent
//! so far, then each new one as the test sends it.

use std::path::Path;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use felix_proto::calc_server_server::{CalcServer, CalcServerServer};
use felix_proto::from_dataplane::Payload as Report;
use felix_proto::to_dataplane::Payload;
use felix_proto::{FromDataplane, ServerHello, ToDataplane};
use tokio::sync::{Notify, mpsc};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use crate::netns::Netns;

#[derive(Default)]
struct Shared {
    sent: Mutex<Vec<Payload>>,
    reports: Mutex<Vec<FromDataplane>>,
    streams: Mutex<usize>,
    more: Notify,
}

struct Service {
    node: String,
    shared: Arc<Shared>,
}

/// The server; dropping it stops nothing (the namespace's end does).
pub struct ScriptedServer {
    shared: Arc<Shared>,
    node: String,
    pub url: String,
}

impl ScriptedServer {
    /// Starts listening on `127.0.0.1:port` inside `ns`, as the calc-server of `node`.
    pub fn start(ns: &Netns, port: u16, node: &str) -> ScriptedServer {
        let shared = Arc::new(Shared::default());
        let service = Service {
            node: node.to_owned(),
            shared: shared.clone(),
        };
        let path = format!("/var/run/netns/{}", ns.name);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("namespace file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                    .await
                    .expect("bind in the namespace");
                ready_tx.send(()).expect("test waits");
                let _ = tonic::transport::Server::builder()
                    .add_service(CalcServerServer::new(service))
                    .serve_with_incoming(TcpListenerStream::new(listener))
                    .await;
            });
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("scripted server listening");
        ScriptedServer {
            shared,
            node: node.to_owned(),
            url: format!("127.0.0.1:{port}"),
        }
    }

    /// Sends a payload on every stream (and on any later one).
    pub fn send(&self, payload: Payload) {
        self.shared.sent.lock().expect("lock").push(payload);
        self.shared.more.notify_waiters();
    }

    /// Every report received so far, on any stream.
    pub fn reports(&self) -> Vec<FromDataplane> {
        self.shared.reports.lock().expect("lock").clone()
    }

    /// Streams opened so far.
    pub fn streams(&self) -> usize {
        *self.shared.streams.lock().expect("lock")
    }

    /// Waits up to `timeout` for the reports to satisfy `check`.
    pub fn wait_reports(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&[FromDataplane]) -> bool,
    ) {
        crate::netns::wait_until(
            &format!("scripted server: a report showing {what}"),
            timeout,
            || check(&self.reports()),
            String::new,
        );
    }

    /// Starts `dataplane-agent --driver linux` in `ns` against this server (quick reconnects),
    /// logging to `log`.
    pub fn start_agent(&self, ns: &Netns, log: &Path) -> Child {
        self.start_agent_with(ns, log, &[])
    }

    /// [`Self::start_agent`] with more flags (`--iptables-backend legacy`).
    pub fn start_agent_with(&self, ns: &Netns, log: &Path, extra: &[&str]) -> Child {
        let mut args = crate::netns::linux_agent_args(&self.url, &self.node, "info");
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ns.spawn(&crate::binary("dataplane-agent"), &args, log)
    }

    /// Waits until the agents reported DataplaneInSync `count` times in all (one per stream
    /// that reached the dataplane).
    pub fn wait_dataplane_in_sync(&self, count: usize) {
        self.wait_reports(
            &format!("DataplaneInSync x{count}"),
            Duration::from_secs(30),
            |r| {
                r.iter()
                    .filter(|m| matches!(m.payload, Some(Report::DataplaneInSync(_))))
                    .count()
                    >= count
            },
        );
    }
}

#[tonic::async_trait]
impl CalcServer for Service {
    type SyncStream = ReceiverStream<Result<ToDataplane, Status>>;

    async fn sync(
        &self,
        request: Request<Streaming<FromDataplane>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        *self.shared.streams.lock().expect("lock") += 1;
        let mut inbound = request.into_inner();
        let (hello_tx, hello_rx) = tokio::sync::oneshot::channel();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut hello_tx = Some(hello_tx);
            while let Some(Ok(msg)) = inbound.next().await {
                shared.reports.lock().expect("lock").push(msg);
                if let Some(tx) = hello_tx.take() {
                    let _ = tx.send(());
                }
            }
        });
        let (tx, rx) = mpsc::channel(64);
        let shared = self.shared.clone();
        let node = self.node.clone();
        tokio::spawn(async move {
            if hello_rx.await.is_err() {
                return;
            }
            let hello = Payload::ServerHello(ServerHello {
                server_version: "scripted".into(),
                capabilities: vec![],
                node_name: node,
            });
            let mut seq = 1;
            if tx
                .send(Ok(ToDataplane {
                    payload: Some(hello),
                    sequence_number: seq,
                }))
                .await
                .is_err()
            {
                return;
            }
            let mut next = 0;
            loop {
                // Registered before reading, so a send in between is not missed.
                let more = shared.more.notified();
                tokio::pin!(more);
                more.as_mut().enable();
                let batch: Vec<Payload> = shared.sent.lock().expect("lock")[next..].to_vec();
                next += batch.len();
                for payload in batch {
                    seq += 1;
                    let msg = ToDataplane {
                        payload: Some(payload),
                        sequence_number: seq,
                    };
                    if tx.send(Ok(msg)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    _ = more => {}
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
