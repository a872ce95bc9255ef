//! A scripted calc-server inside a network namespace: the test decides every `ToDataplane`
//! message the agent receives (hostile ones included) and reads every report it sends back.
//!
//! The server is `test_support::sync_server` (the one the agent's session tests use). It runs
//! on its own thread, which enters the namespace (`setns`) before it builds a single-threaded
//! runtime, so it listens on the namespace's loopback like a calc-server on the node would. Each
//! stream gets `ServerHello` after the agent's hello, then every payload sent so far, then each
//! new one as the test sends it ([`ScriptedServer::start`]), or what a [`Plan`] made for that
//! stream says ([`ScriptedServer::start_planned`]: a snapshot, then hold, close, or trickle
//! forever without `InSync`).

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use felix_proto::to_dataplane::Payload;
use felix_proto::{ActiveProfileUpdate, FromDataplane, Profile, ProfileId, Rule};
use test_support::sync_server::{Step, SyncServer, is_dataplane_in_sync, server_hello};

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

impl Plan {
    /// The script of a stream that follows this plan, as the calc-server of `node`.
    fn script(self, node: &str) -> Vec<Step> {
        let mut steps = vec![Step::hello_received(), Step::Send(hello(node))];
        steps.extend(self.snapshot.into_iter().map(Step::Send));
        match self.then {
            Then::Hold => steps.push(Step::Hold),
            Then::CloseWhenProgrammed => steps.extend([Step::programmed(), Step::End(None)]),
            Then::Endless { every, filler } => steps.push(Step::Endless { every, filler }),
        }
        steps
    }
}

fn hello(node: &str) -> Payload {
    server_hello("scripted", node, &[])
}

/// The server; dropping it stops nothing (the namespace's end does).
pub struct ScriptedServer {
    server: SyncServer,
    node: String,
    pub url: String,
}

impl ScriptedServer {
    /// Starts listening on `127.0.0.1:port` inside `ns`, as the calc-server of `node`.
    pub fn start(ns: &Netns, port: u16, node: &str) -> ScriptedServer {
        let owned = node.to_owned();
        let server = SyncServer::per_stream(move |_| {
            vec![
                Step::hello_received(),
                Step::Send(hello(&owned)),
                Step::Follow,
            ]
        });
        Self::start_with(ns, port, node, server)
    }

    /// [`Self::start`] whose stream `n` (from 0) follows `plan(n)`; [`Self::send`] is unused.
    pub fn start_planned(
        ns: &Netns,
        port: u16,
        node: &str,
        plan: fn(usize) -> Plan,
    ) -> ScriptedServer {
        let owned = node.to_owned();
        let server = SyncServer::per_stream(move |n| plan(n).script(&owned));
        Self::start_with(ns, port, node, server)
    }

    fn start_with(ns: &Netns, port: u16, node: &str, server: SyncServer) -> ScriptedServer {
        let server = server.buffer(64);
        let serving = server.clone();
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
                let _ = serving.serve(listener).await;
            });
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("scripted server listening");
        ScriptedServer {
            server,
            node: node.to_owned(),
            url: format!("127.0.0.1:{port}"),
        }
    }

    /// Sends a payload on every stream (and on any later one).
    pub fn send(&self, payload: Payload) {
        self.server.send(payload);
    }

    /// Every report received so far, on any stream.
    pub fn reports(&self) -> Vec<FromDataplane> {
        self.server.all_received()
    }

    /// Streams opened so far.
    pub fn streams(&self) -> usize {
        self.server.connection_count()
    }

    /// When each stream opened so far.
    pub fn stream_times(&self) -> Vec<Instant> {
        self.server.opened_times()
    }

    /// DataplaneInSync reports received so far, on any stream.
    pub fn dataplane_in_syncs(&self) -> usize {
        self.reports()
            .iter()
            .filter(|m| is_dataplane_in_sync(m))
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
            |r| r.iter().filter(|m| is_dataplane_in_sync(m)).count() >= count,
        );
    }
}
