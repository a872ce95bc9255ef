//! A fake calc-server: `CalcServer.Sync` with tonic, where every accepted stream plays a script
//! of [`Step`]s (send messages, wait for the agent's reports, wait for the test, end with a
//! status, or send what the test sends) and every report the agent sends back is recorded, per
//! stream and in arrival order over all streams.
//!
//! Where it listens is the caller's: [`SyncServer::spawn`] on 127.0.0.1 in the test's runtime,
//! or [`SyncServer::serve`] on any listener (the integration tests bind one inside a network
//! namespace).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use felix_proto::calc_server_server::{CalcServer, CalcServerServer};
use felix_proto::from_dataplane::Payload as Report;
use felix_proto::to_dataplane::Payload;
use felix_proto::{FromDataplane, ServerHello, ToDataplane};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc, watch};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

/// A condition on the reports received so far on one stream.
pub type Predicate = Box<dyn Fn(&[FromDataplane]) -> bool + Send + Sync>;

/// One step of a stream's script.
pub enum Step {
    /// Send a payload with the next sequence number (the stream's first message is 1).
    Send(Payload),
    /// Send a message exactly as given (to break the numbering); later sends count on from it.
    SendRaw(ToDataplane),
    /// Wait until the reports received on this stream satisfy the predicate. The stream ends if
    /// the agent goes away first; past the server's [`SyncServer::wait_limit`] the stream's task
    /// panics, naming what it waited for.
    WaitFor(&'static str, Predicate),
    /// Wait until the test calls `notify_one`.
    Gate(Arc<Notify>),
    /// Tell the test this point was reached.
    Signal(Arc<Notify>),
    /// End the stream: cleanly (`None`) or with a status.
    End(Option<Status>),
    /// Keep the stream open until the agent goes away (recorded as the stream's end).
    Hold,
    /// Send every payload of [`SyncServer::send`] so far, then each new one as the test sends
    /// it, until the agent goes away.
    Follow,
    /// Send `filler(0)`, `filler(1)`, … every `every` (back to back if zero), never InSync,
    /// until the agent goes away.
    Endless {
        every: Duration,
        filler: fn(u64) -> Payload,
    },
}

impl Step {
    /// [`Step::WaitFor`] with the predicate boxed.
    pub fn wait_for(
        what: &'static str,
        check: impl Fn(&[FromDataplane]) -> bool + Send + Sync + 'static,
    ) -> Step {
        Step::WaitFor(what, Box::new(check))
    }

    /// Waits for the agent's first report on this stream, its AgentHello.
    pub fn hello_received() -> Step {
        Step::wait_for("AgentHello", |r| !r.is_empty())
    }

    /// Waits for the agent's DataplaneInSync on this stream.
    pub fn programmed() -> Step {
        Step::wait_for("DataplaneInSync", |r| r.iter().any(is_dataplane_in_sync))
    }
}

/// A `ServerHello` from server `version` for `node`, offering `capabilities`.
pub fn server_hello(version: &str, node: &str, capabilities: &[&str]) -> Payload {
    Payload::ServerHello(ServerHello {
        server_version: version.into(),
        capabilities: capabilities.iter().map(|c| (*c).to_owned()).collect(),
        node_name: node.into(),
    })
}

/// Whether `m` is a DataplaneInSync report.
pub fn is_dataplane_in_sync(m: &FromDataplane) -> bool {
    matches!(m.payload, Some(Report::DataplaneInSync(_)))
}

/// Stream `n` (from 0) gets the script this returns.
type Scripts = Box<dyn FnMut(usize) -> Vec<Step> + Send>;

#[derive(Default)]
struct Connection {
    received: Vec<FromDataplane>,
    opened: Option<Instant>,
    ended: Option<Instant>,
    /// The agent's side of the stream ended.
    closed: bool,
}

#[derive(Default)]
struct Record {
    connections: Vec<Connection>,
    /// Every report, in arrival order over all streams.
    all: Vec<FromDataplane>,
}

struct Shared {
    scripts: Mutex<Scripts>,
    record: Mutex<Record>,
    /// Bumped on every report and every end of an agent's side.
    changed: watch::Sender<u64>,
    /// What [`Step::Follow`] sends.
    sent: Mutex<Vec<Payload>>,
    more: Notify,
    wait_limit: Option<Duration>,
    buffer: usize,
}

/// The fake calc-server's handle: configure it, serve it, send through it, read what it
/// received. Clones share one server.
#[derive(Clone)]
pub struct SyncServer {
    shared: Arc<Shared>,
}

impl SyncServer {
    /// Plays `scripts`, one per accepted stream, in order; a stream beyond them ends at once
    /// with UNAVAILABLE ("no script left").
    pub fn scripted(scripts: Vec<Vec<Step>>) -> SyncServer {
        let mut scripts = VecDeque::from(scripts);
        Self::per_stream(move |_| {
            scripts
                .pop_front()
                .unwrap_or_else(|| vec![Step::End(Some(Status::unavailable("no script left")))])
        })
    }

    /// Stream `n` (from 0) plays `script(n)`.
    pub fn per_stream(script: impl FnMut(usize) -> Vec<Step> + Send + 'static) -> SyncServer {
        SyncServer {
            shared: Arc::new(Shared {
                scripts: Mutex::new(Box::new(script)),
                record: Mutex::new(Record::default()),
                changed: watch::channel(0).0,
                sent: Mutex::new(Vec::new()),
                more: Notify::new(),
                wait_limit: None,
                buffer: 1024,
            }),
        }
    }

    /// A [`Step::WaitFor`] not satisfied within `limit` panics (default: it waits as long as
    /// the stream lives). Set before serving.
    pub fn wait_limit(self, limit: Duration) -> SyncServer {
        self.configure(|s| s.wait_limit = Some(limit))
    }

    /// Messages a stream queues ahead of the agent's reading (default 1024). Set before
    /// serving.
    pub fn buffer(self, messages: usize) -> SyncServer {
        self.configure(|s| s.buffer = messages)
    }

    fn configure(mut self, f: impl FnOnce(&mut Shared)) -> SyncServer {
        f(Arc::get_mut(&mut self.shared).expect("configured before it is served or cloned"));
        self
    }

    /// Serves on `listener` until the runtime ends.
    pub async fn serve(&self, listener: TcpListener) -> Result<(), tonic::transport::Error> {
        tonic::transport::Server::builder()
            .add_service(CalcServerServer::new(Service {
                shared: self.shared.clone(),
            }))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
    }

    /// Serves on a free port of 127.0.0.1 from a task of the current runtime; returns its URL
    /// (`http://127.0.0.1:port`).
    pub async fn spawn(&self) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let server = self.clone();
        tokio::spawn(async move { server.serve(listener).await });
        format!("http://{addr}")
    }

    /// Sends a payload on every stream at its [`Step::Follow`] (and on any later one).
    pub fn send(&self, payload: Payload) {
        self.shared.sent.lock().push(payload);
        self.shared.more.notify_waiters();
    }

    /// Streams accepted so far.
    pub fn connection_count(&self) -> usize {
        self.shared.record.lock().connections.len()
    }

    /// The reports received on stream `conn` (from 0) so far; none for a stream not accepted.
    pub fn received(&self, conn: usize) -> Vec<FromDataplane> {
        self.shared
            .record
            .lock()
            .connections
            .get(conn)
            .map(|c| c.received.clone())
            .unwrap_or_default()
    }

    /// Every report received so far, on any stream, in arrival order.
    pub fn all_received(&self) -> Vec<FromDataplane> {
        self.shared.record.lock().all.clone()
    }

    /// When stream `conn` opened and when its script ended it (or saw the agent go away).
    pub fn times(&self, conn: usize) -> (Option<Instant>, Option<Instant>) {
        let record = self.shared.record.lock();
        let c = &record.connections[conn];
        (c.opened, c.ended)
    }

    /// When each stream opened, in order.
    pub fn opened_times(&self) -> Vec<Instant> {
        self.shared
            .record
            .lock()
            .connections
            .iter()
            .filter_map(|c| c.opened)
            .collect()
    }
}

impl Shared {
    fn mark_ended(&self, conn: usize) {
        self.record.lock().connections[conn].ended = Some(Instant::now());
    }
}

struct Service {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl CalcServer for Service {
    type SyncStream = ReceiverStream<Result<ToDataplane, Status>>;

    async fn sync(
        &self,
        request: Request<Streaming<FromDataplane>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let conn = {
            let mut record = self.shared.record.lock();
            record.connections.push(Connection {
                opened: Some(Instant::now()),
                ..Connection::default()
            });
            record.connections.len() - 1
        };
        let script = (self.shared.scripts.lock())(conn);
        // Reader: records every report of this stream.
        let mut inbound = request.into_inner();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            while let Some(Ok(msg)) = inbound.next().await {
                {
                    let mut record = shared.record.lock();
                    record.all.push(msg.clone());
                    record.connections[conn].received.push(msg);
                }
                shared.changed.send_modify(|n| *n += 1);
            }
            shared.record.lock().connections[conn].closed = true;
            shared.changed.send_modify(|n| *n += 1);
        });
        // Writer: plays the script.
        let (tx, rx) = mpsc::channel(self.shared.buffer);
        let mut player = Player {
            shared: self.shared.clone(),
            conn,
            tx,
            seq: 0,
        };
        tokio::spawn(async move { player.play(script).await });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The agent went away (or the script ended the stream): stop playing.
struct Gone;

/// One stream's writer.
struct Player {
    shared: Arc<Shared>,
    conn: usize,
    tx: mpsc::Sender<Result<ToDataplane, Status>>,
    seq: u64,
}

impl Player {
    async fn play(&mut self, script: Vec<Step>) {
        for step in script {
            if self.step(step).await.is_err() {
                return;
            }
        }
    }

    async fn step(&mut self, step: Step) -> Result<(), Gone> {
        match step {
            Step::Send(payload) => self.send(payload).await?,
            Step::SendRaw(msg) => {
                self.seq = msg.sequence_number;
                self.tx.send(Ok(msg)).await.map_err(|_| Gone)?;
            }
            Step::WaitFor(what, predicate) => self.wait_for(what, &predicate).await?,
            Step::Gate(gate) => gate.notified().await,
            Step::Signal(signal) => signal.notify_one(),
            Step::End(status) => {
                self.shared.mark_ended(self.conn);
                if let Some(status) = status {
                    let _ = self.tx.send(Err(status)).await;
                }
                return Err(Gone);
            }
            Step::Hold => {
                self.tx.closed().await;
                self.shared.mark_ended(self.conn);
                return Err(Gone);
            }
            Step::Follow => {
                self.follow().await;
                self.shared.mark_ended(self.conn);
                return Err(Gone);
            }
            Step::Endless { every, filler } => {
                for i in 0.. {
                    if !every.is_zero() {
                        tokio::time::sleep(every).await;
                    }
                    if self.send(filler(i)).await.is_err() {
                        break;
                    }
                }
                self.shared.mark_ended(self.conn);
                return Err(Gone);
            }
        }
        Ok(())
    }

    async fn send(&mut self, payload: Payload) -> Result<(), Gone> {
        self.seq += 1;
        let msg = ToDataplane {
            payload: Some(payload),
            sequence_number: self.seq,
        };
        self.tx.send(Ok(msg)).await.map_err(|_| Gone)
    }

    async fn wait_for(&self, what: &str, predicate: &Predicate) -> Result<(), Gone> {
        let mut changed = self.shared.changed.subscribe();
        let deadline = self
            .shared
            .wait_limit
            .map(|limit| tokio::time::Instant::now() + limit);
        loop {
            let closed = {
                let record = self.shared.record.lock();
                let c = &record.connections[self.conn];
                if predicate(&c.received) {
                    return Ok(());
                }
                c.closed
            };
            if closed {
                return Err(Gone);
            }
            let next = changed.changed();
            let woke = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, next).await,
                None => Ok(next.await),
            };
            match woke {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(Gone),
                Err(_) => panic!("fake server: timed out waiting for {what}"),
            }
        }
    }

    /// Sends everything the test sent, then each new payload, until the stream closes.
    async fn follow(&mut self) {
        let shared = self.shared.clone();
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
}
