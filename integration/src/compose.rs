//! The compose cluster (`docker/compose.yaml`) for the tests: etcd, calc-server, three nodes
//! (a namespace-holding container and an agent in it) and workload containers wired to them,
//! started, wired and loaded by `scripts/containers.sh` under a compose project of the test's
//! own on a free /24, and removed (`down -v`) when the [`Cluster`] is dropped, whatever the
//! test's outcome.
//!
//! Prerequisites: a Docker engine ([`crate::docker::require_engine`]: skipped without one
//! unless `CI` is set), root, `docker-compose` and `nsenter` (missing ones fail the test).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::docker::{Docker, require_engine};
use crate::workspace_root;

/// The workloads `scripts/containers.sh` wires: (compose service, node, namespace, address).
/// Node N's workload block is 10.65.N.0/24; each listens on TCP 8080.
pub const WORKLOADS: [(&str, &str, &str, &str); 5] = [
    ("web-1", "node-1", "prod", "10.65.1.10"),
    ("tool-1", "node-1", "dev", "10.65.1.20"),
    ("web-2", "node-2", "prod", "10.65.2.10"),
    ("web-3", "node-3", "prod", "10.65.3.10"),
    ("tool-3", "node-3", "dev", "10.65.3.20"),
];

pub const NODES: [&str; 3] = ["node-1", "node-2", "node-3"];

/// The address of a workload service.
pub fn ip_of(workload: &str) -> &'static str {
    WORKLOADS
        .iter()
        .find(|w| w.0 == workload)
        .map(|w| w.3)
        .unwrap_or_else(|| panic!("no workload {workload}"))
}

/// The engine, or `None` (skip) when there is none and `CI` is unset; panics when another
/// prerequisite of the cluster is missing.
pub fn require() -> Option<Docker> {
    let d = require_engine()?;
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(str::to_owned))
        })
        .is_some_and(|uid| uid == "0");
    assert!(
        root,
        "the compose cluster needs root (nsenter, ip link set … netns)"
    );
    for tool in ["docker-compose", "nsenter", "ip"] {
        // Spawning is enough to know it is installed.
        let found = Command::new(tool).arg("--version").output().is_ok();
        assert!(found, "{tool} is not installed (`make deps` installs it)");
    }
    Some(d)
}

/// A running compose cluster, taken down with its volumes on drop.
pub struct Cluster {
    pub project: String,
    /// The bridge network's /24 prefix (`SPLIT_FELIX_NET`): etcd .2, calc-server .3,
    /// node-N .1N.
    pub net: String,
}

impl Cluster {
    /// Starts, wires, loads and waits for the cluster (`scripts/containers.sh up`) as the
    /// compose project `sf-<what>-<pid>` on a /24 no other network uses.
    pub fn up(d: &Docker, what: &str) -> Cluster {
        let project = format!("sf-{what}-{}", std::process::id());
        let net = free_prefix(d, &project);
        let cluster = Cluster { project, net };
        let started = Instant::now();
        let o = cluster.script(&["up"]);
        assert!(
            o.status.success(),
            "scripts/containers.sh up failed:\n{}{}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            cluster.agent_logs()
        );
        eprintln!(
            "cluster {} on {}.0/24 up, wired and in sync in {:.1} s",
            cluster.project,
            cluster.net,
            started.elapsed().as_secs_f64()
        );
        cluster
    }

    fn env(&self, c: &mut Command) {
        c.env("COMPOSE_PROJECT_NAME", &self.project)
            .env("SPLIT_FELIX_NET", &self.net)
            .current_dir(workspace_root());
    }

    /// `scripts/containers.sh ARGS` for this cluster.
    pub fn script(&self, args: &[&str]) -> Output {
        let mut c = Command::new(workspace_root().join("scripts/containers.sh"));
        c.args(args);
        self.env(&mut c);
        c.output().expect("run scripts/containers.sh")
    }

    /// `docker-compose ARGS` for this cluster.
    pub fn compose(&self, args: &[&str]) -> Output {
        let mut c = Command::new("docker-compose");
        c.args(["-f", "docker/compose.yaml"]).args(args);
        self.env(&mut c);
        c.output().expect("run docker-compose")
    }

    /// The container of a service (compose names it `<project>_<service>_1`).
    pub fn container(&self, service: &str) -> String {
        format!("{}_{service}_1", self.project)
    }

    /// Whether `from` (a workload service) connects to `to`'s port 8080 within a second.
    pub fn connects(&self, from: &str, to: &str) -> bool {
        Docker.connects(&self.container(from), ip_of(to), 8080)
    }

    /// `etcdctl put KEY VALUE` in the etcd container.
    pub fn etcd_put(&self, key: &str, value: &str) {
        Docker.exec_ok(&self.container("etcd"), &["etcdctl", "put", key, value]);
    }

    /// Waits until every agent is connected, in sync, programmed and has its endpoints up
    /// (`scripts/containers.sh wait`).
    pub fn wait_ready(&self) {
        let o = self.script(&["wait"]);
        assert!(
            o.status.success(),
            "agents not ready:\n{}\n{}",
            String::from_utf8_lossy(&o.stderr),
            self.agent_logs()
        );
    }

    /// The last lines of each agent's log.
    pub fn agent_logs(&self) -> String {
        NODES
            .iter()
            .map(|n| {
                let agent = format!("agent-{}", &n[5..]);
                format!("--- {agent}:\n{}", Docker.logs(&self.container(&agent)))
            })
            .collect()
    }

    pub fn logs(&self, service: &str) -> String {
        Docker.logs(&self.container(service))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let o = self.compose(&["down", "-v", "--remove-orphans", "--timeout", "5"]);
        if !o.status.success() {
            eprintln!(
                "docker-compose down for {} failed: {}",
                self.project,
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
}

/// A 172.31.x prefix (200–249; the demo's default, 250, stays free) whose /24 no Docker
/// network overlaps: probed by creating (and removing) a network on it.
fn free_prefix(d: &Docker, project: &str) -> String {
    let probe = format!("{project}-probe");
    for i in 0..40u32 {
        let prefix = format!("172.31.{}", 200 + (std::process::id() + i) % 50);
        let o = d.output(&[
            "network",
            "create",
            "--subnet",
            &format!("{prefix}.0/24"),
            &probe,
        ]);
        if o.status.success() {
            d.output(&["network", "rm", &probe]);
            return prefix;
        }
    }
    panic!("no free /24 in 172.31.200-249 for the compose cluster");
}

/// Polls `pred` every 200 ms until it holds or `timeout` passes; whether it held.
pub fn eventually(timeout: Duration, mut pred: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if pred() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
