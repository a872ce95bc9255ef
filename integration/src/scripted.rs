//! A scripted calc-server inside a network namespace: the test decides every `ToDataplane`
//! message the agent receives (hostile ones included) and reads every report it sends back.
//!
//! It runs on its own thread, which enters the namespace (`setns`) before it builds a
//! single-threaded runtime, so it listens on the namespace's loopback like a calc-server on the
//! node would. Each stream gets `ServerHello` after the agent's hello, then every payload sent
//! so far, then each new one as the test sends it ([`ScriptedServer::start`]), or what a
//! [`Plan`] made for that stream says ([`ScriptedServer::start_planned`]: a snapshot, then hold,
//! close, or trickle forever without `InSync`).

use std::path::Path;
use std::process::Child;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use felix_proto::calc_server_server::{CalcServer, CalcServerServer};
use felix_proto::from_dataplane::Payload as Report;
use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActiveProfileUpdate, FromDataplane, Profile, ProfileId, Rule, ServerHello, ToDataplane,
};
use tokio::sync::{Notify, mpsc};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use crate::netns::{Driver, Netns};

/// What one stream of a [`ScriptedServer::start_planned`] server sends after its ServerHello.
pub struct Plan {
    pub snapshot: Vec<Payload>,
    pub then: Then,
}

/// What a planned stream does once its snapshot is sent.
#[derive(Clone, Copy)]
pub enum Then {
    /// Keep the stream open and quiet.
    Hold,
    /// End the stream once the agent reported DataplaneInSync on it.
    CloseWhenProgrammed,
    /// Send `filler(0)`, `filler(1)`, … every `every`, forever, never InSync.
    Endless {
        every: Duration,
        filler: fn(u64) -> Payload,
    },
}

#[derive(Default)]
struct Shared {
    sent: Mutex<Vec<Payload>>,
    reports: Mutex<Vec<FromDataplane>>,
    /// When each stream opened.
    opened: Mutex<Vec<Instant>>,
    more: Notify,
}

struct Service {
    node: String,
    shared: Arc<Shared>,
    /// Stream `n` (from 0) follows `plan(n)`; `None`: every stream sends what the test sent.
    plan: Option<fn(usize) -> Plan>,
}

/// The namespace's profile (`kns.prod`): everything allowed both ways.
pub fn allow_all_profile() -> Payload {
    let allow = || Rule {
        action: "allow".into(),
        ..Default::default()
    };
    Payload::ActiveProfileUpdate(ActiveProfileUpdate {
        id: Some(ProfileId {
            name: "kns.prod".into(),
        }),
        profile: Some(Profile {
            inbound_rules: vec![allow()],
            outbound_rules: vec![allow()],
        }),
    })
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
        Self::start_with(ns, port, node, None)
    }

    /// [`Self::start`] whose stream `n` (from 0) follows `plan(n)`; [`Self::send`] is unused.
    pub fn start_planned(
        ns: &Netns,
        port: u16,
        node: &str,
        plan: fn(usize) -> Plan,
    ) -> ScriptedServer {
        Self::start_with(ns, port, node, Some(plan))
    }

    fn start_with(
        ns: &Netns,
        port: u16,
        node: &str,
        plan: Option<fn(usize) -> Plan>,
    ) -> ScriptedServer {
        let shared = Arc::new(Shared::default());
        let service = Service {
            node: node.to_owned(),
            shared: shared.clone(),
            plan,
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
        self.shared.sent.lock().push(payload);
        self.shared.more.notify_waiters();
    }

    /// Every report received so far, on any stream.
    pub fn reports(&self) -> Vec<FromDataplane> {
        self.shared.reports.lock().clone()
    }

    /// Streams opened so far.
    pub fn streams(&self) -> usize {
        self.shared.opened.lock().len()
    }

    /// When each stream opened so far.
    pub fn stream_times(&self) -> Vec<Instant> {
        self.shared.opened.lock().clone()
    }

    /// DataplaneInSync reports received so far, on any stream.
    pub fn dataplane_in_syncs(&self) -> usize {
        self.shared
            .reports
            .lock()
            .iter()
            .filter(|m| matches!(m.payload, Some(Report::DataplaneInSync(_))))
            .count()
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
        self.start_agent_driver(Driver::Linux, ns, log, extra)
    }

    /// [`Self::start_agent_with`] on `driver`.
    pub fn start_agent_driver(
        &self,
        driver: Driver,
        ns: &Netns,
        log: &Path,
        extra: &[&str],
    ) -> Child {
        let args = self.driver_agent_args(driver, extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ns.spawn(&crate::binary("dataplane-agent"), &args, log)
    }

    /// The flags [`Self::start_agent_with`] gives the agent, `extra` last.
    pub fn agent_args(&self, extra: &[&str]) -> Vec<String> {
        self.driver_agent_args(Driver::Linux, extra)
    }

    /// The flags [`Self::start_agent_driver`] gives the agent, `extra` last.
    pub fn driver_agent_args(&self, driver: Driver, extra: &[&str]) -> Vec<String> {
        let mut args = crate::netns::agent_args(driver, &self.url, &self.node, "info");
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
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
        let n = {
            let mut opened = self.shared.opened.lock();
            opened.push(Instant::now());
            opened.len() - 1
        };
        let mut inbound = request.into_inner();
        let (hello_tx, hello_rx) = tokio::sync::oneshot::channel();
        let (programmed_tx, programmed_rx) = tokio::sync::oneshot::channel();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut hello_tx = Some(hello_tx);
            let mut programmed_tx = Some(programmed_tx);
            while let Some(Ok(msg)) = inbound.next().await {
                if matches!(msg.payload, Some(Report::DataplaneInSync(_)))
                    && let Some(tx) = programmed_tx.take()
                {
                    let _ = tx.send(());
                }
                shared.reports.lock().push(msg);
                if let Some(tx) = hello_tx.take() {
                    let _ = tx.send(());
                }
            }
        });
        let (tx, rx) = mpsc::channel(64);
        let shared = self.shared.clone();
        let plan = self.plan.map(|plan| plan(n));
        let hello = Payload::ServerHello(ServerHello {
            server_version: "scripted".into(),
            capabilities: vec![],
            node_name: self.node.clone(),
        });
        tokio::spawn(async move {
            if hello_rx.await.is_err() {
                return;
            }
            let mut out = Numbered { tx, seq: 0 };
            if out.send(hello).await.is_err() {
                return;
            }
            match plan {
                Some(plan) => out.follow(plan, programmed_rx).await,
                None => out.follow_the_test(&shared).await,
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A stream's sender, numbering messages from 1.
struct Numbered {
    tx: mpsc::Sender<Result<ToDataplane, Status>>,
    seq: u64,
}

impl Numbered {
    async fn send(&mut self, payload: Payload) -> Result<(), ()> {
        self.seq += 1;
        let msg = ToDataplane {
            payload: Some(payload),
            sequence_number: self.seq,
        };
        self.tx.send(Ok(msg)).await.map_err(|_| ())
    }

    /// Sends everything the test sent, then each new payload, until the stream closes.
    async fn follow_the_test(&mut self, shared: &Shared) {
        let mut next = 0;
        loop {
            // Registered before reading, so a send in between is not missed.
            let more = shared.more.notified();
            tokio::pin!(more);
            more.as_mut().enable();
            let batch: Vec<Payload> = shared.sent.lock()[next..].to_vec();
            next += batch.len();
            for payload in batch {
                if self.send(payload).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                _ = more => {}
                _ = self.tx.closed() => return,
            }
        }
    }

    async fn follow(&mut self, plan: Plan, programmed: tokio::sync::oneshot::Receiver<()>) {
        for payload in plan.snapshot {
            if self.send(payload).await.is_err() {
                return;
            }
        }
        match plan.then {
            Then::Hold => self.tx.closed().await,
            Then::CloseWhenProgrammed => {
                let _ = programmed.await;
            }
            Then::Endless { every, filler } => {
                for i in 0.. {
                    if !every.is_zero() {
                        tokio::time::sleep(every).await;
                    }
                    if self.send(filler(i)).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}
