//! Network-namespace fixtures for the Linux driver tests (`--driver linux` and `--driver nftables`,
//! see [`Driver`] and [`driver_tests!`](crate::driver_tests)): a "host" namespace that runs the
//! calc-server and the agent, and "workload" namespaces wired to it by veth pairs whose host ends
//! carry the workload prefix, set up the way Calico's CNI plugin does (proxy ARP towards
//! 169.254.1.1, an `ee:ee:ee:ee:ee:ee` host side, /32 and /128 routes on the host).
//!
//! Everything needs root, `ip`, iptables, ipset, `nc`, `ping` and `nft`. The tests that use
//! these fixtures are `#[ignore]`d with that reason, so a plain `cargo test` lists them as
//! ignored; `make test` installs the tools and runs them (`--include-ignored`), and a test that
//! runs without its prerequisites fails naming what is missing ([`require`]): it never passes
//! without having run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::binary;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// What is missing for the namespace tests, if anything.
pub fn prerequisites() -> Result<(), String> {
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(str::to_owned))
        })
        .unwrap_or_default();
    if uid != "0" {
        return Err("not running as root".to_owned());
    }
    for tool in [
        "ip",
        "iptables-nft-restore",
        "iptables-legacy-restore",
        "ip6tables-nft-restore",
        "ipset",
        "nc",
        "ping",
        "nft",
    ] {
        let found = std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            || Path::new("/usr/sbin").join(tool).is_file();
        if !found {
            return Err(format!("{tool} is not installed (make deps installs it)"));
        }
    }
    Ok(())
}

/// Fails the calling test, naming what is missing, unless every prerequisite is present.
pub fn require() {
    if let Err(why) = prerequisites() {
        panic!("this test needs root and the namespace tools: {why} (`make test` installs them)");
    }
}

/// A namespace's profile as kube-controllers writes it: allow all both ways, carrying the
/// namespace's labels (`pcns.`-prefixed, `env` here) for namespace selectors.
pub fn namespace_profile(ns: &str, env: &str) -> String {
    format!(
        "apiVersion: projectcalico.org/v3
kind: Profile
metadata:
  name: kns.{ns}
spec:
  ingress: [{{action: Allow}}]
  egress: [{{action: Allow}}]
  labelsToApply:
    pcns.projectcalico.org/name: {ns}
    pcns.env: {env}
---
"
    )
}

/// A pod's WorkloadEndpoint as Calico's CNI plugin writes it, for the file datastore: pod `pod`
/// of namespace `ns` on `node`, endpoint `eth0` on host interface `iface`, with its namespace's
/// profile (`kns.<ns>`). Each method adds one field; [`WepManifest::render`] writes the YAML
/// document (ending `---`).
pub fn wep_manifest(node: &str, ns: &str, pod: &str, iface: &str) -> WepManifest {
    WepManifest {
        node: node.to_owned(),
        ns: ns.to_owned(),
        pod: pod.to_owned(),
        iface: iface.to_owned(),
        labels: Vec::new(),
        mac: None,
        nets: Vec::new(),
        ports: None,
    }
}

/// A WorkloadEndpoint manifest being built: see [`wep_manifest`].
#[must_use]
pub struct WepManifest {
    node: String,
    ns: String,
    pod: String,
    iface: String,
    labels: Vec<(String, String)>,
    mac: Option<String>,
    nets: Vec<String>,
    ports: Option<String>,
}

impl WepManifest {
    /// One more label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.push((key.to_owned(), value.to_owned()));
        self
    }

    /// The labels Calico puts on every pod's endpoint: its namespace and its orchestrator.
    pub fn calico_labels(self) -> Self {
        let ns = self.ns.clone();
        self.label("projectcalico.org/namespace", &ns)
            .label("projectcalico.org/orchestrator", "k8s")
    }

    /// The workload's MAC.
    pub fn mac(mut self, mac: &str) -> Self {
        self.mac = Some(mac.to_owned());
        self
    }

    /// One more IPv4 address (as a /32).
    pub fn ipv4(mut self, ip: &str) -> Self {
        self.nets.push(format!("{ip}/32"));
        self
    }

    /// One more IPv6 address (as a /128).
    pub fn ipv6(mut self, ip: &str) -> Self {
        self.nets.push(format!("{ip}/128"));
        self
    }

    /// The named ports, as YAML flow items (`{name: http, protocol: TCP, port: 8080}`, comma
    /// separated; empty for `ports: []`).
    pub fn ports(mut self, items: &str) -> Self {
        self.ports = Some(items.to_owned());
        self
    }

    /// The YAML document.
    pub fn render(&self) -> String {
        let escape = |s: &str| s.replace('-', "--");
        let mut out = format!(
            "apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: {}-k8s-{}-eth0
  namespace: {}
",
            escape(&self.node),
            escape(&self.pod),
            self.ns
        );
        if !self.labels.is_empty() {
            out.push_str("  labels:\n");
            for (k, v) in &self.labels {
                out.push_str(&format!("    {k}: {v}\n"));
            }
        }
        out.push_str(&format!(
            "spec:
  orchestrator: k8s
  node: {}
  pod: {}
  endpoint: eth0
  interfaceName: {}
",
            self.node, self.pod, self.iface
        ));
        if let Some(mac) = &self.mac {
            out.push_str(&format!("  mac: \"{mac}\"\n"));
        }
        out.push_str(&format!(
            "  ipNetworks: [{}]\n  profiles: [kns.{}]\n",
            self.nets.join(", "),
            self.ns
        ));
        if let Some(ports) = &self.ports {
            out.push_str(&format!("  ports: [{ports}]\n"));
        }
        out.push_str("---\n");
        out
    }
}

/// Writes a manifest for the file datastore beside its final name and renames it, so the
/// server's watcher never reads half a file.
pub fn write_manifest(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("write manifest");
    std::fs::rename(&tmp, dir.join(name)).expect("rename manifest");
}

/// Runs a command, panicking with its output if it fails.
pub fn run(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", args[0]));
    assert!(
        out.status.success(),
        "{:?} failed: {}{}",
        args,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An iptables backend: the agent's `--iptables-backend` and the tools a test uses for its own
/// rules and read-backs, so that a scenario runs the same on both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ipt {
    Nft,
    Legacy,
}

impl Ipt {
    pub const BOTH: [Ipt; 2] = [Ipt::Nft, Ipt::Legacy];

    /// The agent's `--iptables-backend` value.
    pub fn name(self) -> &'static str {
        match self {
            Ipt::Nft => "nft",
            Ipt::Legacy => "legacy",
        }
    }

    /// `iptables-nft`, `ip6tables-legacy-save`, …: `family` is 4 or 6, `tool` empty for the
    /// main command.
    pub fn tool(self, family: u8, tool: &str) -> String {
        let base = if family == 6 { "ip6tables" } else { "iptables" };
        match tool {
            "" => format!("{base}-{}", self.name()),
            t => format!("{base}-{}-{t}", self.name()),
        }
    }
}

/// A dataplane driver of the agent (`--driver`): the same policy through iptables and ipsets
/// (`linux`) or through nftables (`nftables`: `table ip calico` and `table ip6 calico`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driver {
    Linux,
    Nftables,
}

impl Driver {
    pub const ALL: [Driver; 2] = [Driver::Linux, Driver::Nftables];

    /// The agent's `--driver` value.
    pub fn name(self) -> &'static str {
        match self {
            Driver::Linux => "linux",
            Driver::Nftables => "nftables",
        }
    }
}

/// One namespace test per driver: `driver_tests! { #[ignore = "…"] name => scenario }` makes a
/// module `name` with the tests `name::linux` and `name::nftables`, calling `scenario(driver)`
/// (a function or closure taking a [`Driver`]). Each driver passes or fails on its own.
#[macro_export]
macro_rules! driver_tests {
    ($($(#[$attr:meta])* $name:ident => $scenario:expr;)+) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;

                $(#[$attr])*
                #[test]
                fn linux() {
                    ($scenario)($crate::netns::Driver::Linux)
                }

                $(#[$attr])*
                #[test]
                fn nftables() {
                    ($scenario)($crate::netns::Driver::Nftables)
                }
            }
        )+
    };
}

/// `nft list table <family> calico` in `ns` (`family` is `ip` or `ip6`): the nftables driver's
/// table, empty when there is none.
pub fn nft_list(ns: &Netns, family: &str) -> String {
    nft_text(ns, &["list", "table", family, "calico"])
}

/// `nft -a list chain <family> calico <chain>` (rule handles shown), empty when absent.
pub fn nft_chain(ns: &Netns, family: &str, chain: &str) -> String {
    nft_text(ns, &["-a", "list", "chain", family, "calico", chain])
}

/// `nft <args>` in `ns`: its output, empty when it fails (no such table, chain or set).
pub fn nft_text(ns: &Netns, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.name, "nft"])
        .args(args)
        .output()
        .expect("run nft");
    if out.status.success() {
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        String::new()
    }
}

/// The packet count of the `counter` in an nft rule line (`counter packets N bytes M`).
pub fn nft_packets(rule: &str) -> u64 {
    rule.split_once("counter packets ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in nft rule: {rule}"))
}

/// The names of the sets in the nftables driver's table of `family` that hold `member`.
pub fn nft_sets_holding(ns: &Netns, family: &str, member: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut current: Option<String> = None;
    for line in nft_list(ns, family).lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("set ") {
            current = rest.split_whitespace().next().map(str::to_owned);
        } else if l.starts_with("map ") || l.starts_with("chain ") {
            current = None;
        } else if let Some(name) = &current {
            let holds = l
                .split(|c: char| c == ',' || c == '{' || c == '}' || c.is_whitespace())
                .any(|e| e == member);
            if holds && !found.contains(name) {
                found.push(name.clone());
            }
        }
    }
    found
}

/// A network namespace, deleted (with its processes) on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Runs `f` on a new thread that has entered this network namespace (`setns` changes only
    /// the calling thread), returning what it returns.
    pub fn run_in<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("namespace file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("namespace thread")
    }

    /// A port of the calling process's namespace (on 127.0.0.1) forwarding each connection to
    /// `inner` in this one, whose end is opened by a thread that entered it: how a browser
    /// outside reaches a node's admin endpoint. Serves until the test process ends.
    pub fn forward(&self, inner: std::net::SocketAddr) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a local port");
        let addr = listener.local_addr().expect("its address").to_string();
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let path = path.clone();
                std::thread::spawn(move || {
                    let Ok(file) = std::fs::File::open(&path) else {
                        return;
                    };
                    if nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                        return;
                    }
                    if let Ok(server) = std::net::TcpStream::connect(inner) {
                        pipe(client, server);
                    }
                });
            }
        });
        addr
    }

    pub fn new(role: &str) -> Netns {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("sf-{role}-{}-{n}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run(&["ip", "netns", "add", &name]);
        run(&["ip", "-n", &name, "link", "set", "lo", "up"]);
        // Addresses usable at once: no duplicate address detection in tests.
        let ns = Netns { name };
        ns.sysctl("net.ipv6.conf.default.accept_dad", "0");
        ns.sysctl("net.ipv6.conf.all.accept_dad", "0");
        ns
    }

    /// `ip netns exec <ns> args…`, panicking on failure.
    pub fn exec(&self, args: &[&str]) -> String {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(args);
        run(&full)
    }

    /// `ip netns exec <ns> args…`: whether it succeeded.
    pub fn try_exec(&self, args: &[&str]) -> bool {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Makes this namespace a router like a node: forwarding on, and a default route out of
    /// an uplink (proxy ARP answers only for addresses routed through another interface).
    pub fn make_host(&self) {
        self.sysctl("net.ipv4.ip_forward", "1");
        self.sysctl("net.ipv6.conf.all.forwarding", "1");
        self.sysctl("net.ipv4.conf.all.rp_filter", "0");
        self.sysctl("net.ipv4.conf.default.rp_filter", "0");
        self.exec(&[
            "ip", "link", "add", "uplink0", "type", "veth", "peer", "name", "uplink1",
        ]);
        self.exec(&["ip", "link", "set", "uplink0", "up"]);
        self.exec(&["ip", "link", "set", "uplink1", "up"]);
        // The node's own address (source of host-to-workload traffic).
        self.exec(&["ip", "addr", "add", "10.254.0.1/32", "dev", "uplink0"]);
        self.exec(&[
            "ip",
            "-6",
            "addr",
            "add",
            "fd00:254::1/128",
            "dev",
            "uplink0",
            "nodad",
        ]);
        self.exec(&["ip", "route", "add", "default", "dev", "uplink0"]);
        self.exec(&["ip", "-6", "route", "add", "default", "dev", "uplink0"]);
    }

    /// Sets a (per-namespace) sysctl by writing `/proc/sys` (no dependency on procps).
    pub fn sysctl(&self, key: &str, value: &str) {
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        self.exec(&["sh", "-c", &format!("echo {value} > {path}")]);
    }

    /// Starts a long-running process inside the namespace, logging to `log`.
    pub fn spawn(&self, program: &Path, args: &[&str], log: &Path) -> Child {
        let out = std::fs::File::create(log).expect("log file");
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", program.display()))
    }
}

/// Copies bytes both ways between two connections until each side has closed.
fn pipe(a: std::net::TcpStream, b: std::net::TcpStream) {
    let (Ok(mut a_in), Ok(mut b_out)) = (a.try_clone(), b.try_clone()) else {
        return;
    };
    let there = std::thread::spawn(move || {
        let _ = std::io::copy(&mut a_in, &mut b_out);
        let _ = b_out.shutdown(std::net::Shutdown::Write);
    });
    let (mut b_in, mut a_out) = (b, a);
    let _ = std::io::copy(&mut b_in, &mut a_out);
    let _ = a_out.shutdown(std::net::Shutdown::Write);
    let _ = there.join();
}

/// `nc` processes accepting TCP connections on one port, killed on drop.
pub struct Listener(Vec<Child>);

impl Drop for Listener {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A TCP listener inside a namespace, served by a thread of this process (see
/// [`Netns::accept`]); stopped on drop.
pub struct Acceptor {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Netns {
    /// Accepts (and at once closes) TCP connections on `port`, IPv4 and IPv6, until the
    /// returned acceptor is dropped; returns once the socket is bound. Unlike `nc -lk` (a
    /// backlog of one, one connection at a time, [`Netns::listen`]) its backlog is the kernel's
    /// default, so a tight loop of connects never overflows it: a refused probe is the
    /// network's doing.
    pub fn accept(&self, port: u16) -> Acceptor {
        let path = format!("/var/run/netns/{}", self.name);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("namespace file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            // `[::]` takes IPv4 too (as mapped addresses): bindv6only is off in a namespace.
            let listener = std::net::TcpListener::bind(("::", port)).expect("bind");
            listener.set_nonblocking(true).expect("non-blocking");
            ready_tx.send(()).expect("test waits");
            while !stopping.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => drop(stream),
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("acceptor listening");
        Acceptor {
            stop,
            thread: Some(thread),
        }
    }

    /// Accepts TCP connections on `port` for each of `families` (`-4`, `-6`) until the
    /// returned listener is dropped; returns once every socket is bound.
    pub fn listen(&self, port: u16, families: &[&str]) -> Listener {
        let children = families
            .iter()
            .map(|family| {
                Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &self.name,
                        "nc",
                        family,
                        "-lk",
                        &port.to_string(),
                    ])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("nc listener")
            })
            .collect();
        let listener = Listener(children);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let ss = self.exec(&["ss", "-ltnH"]);
            if ss.matches(&format!(":{port} ")).count() >= families.len() {
                return listener;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("nc never listened on {port}");
    }

    /// A namespace standing for the network outside the node: its `eth0` (192.0.2.2/24,
    /// 2001:db8:2::2/64) is linked to `ext0` (192.0.2.1/24, 2001:db8:2::1/64) in `host`.
    pub fn outside_of(host: &Netns) -> Netns {
        let outside = Netns::new("out");
        host.exec(&[
            "ip",
            "link",
            "add",
            "ext0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &outside.name,
        ]);
        host.exec(&["ip", "addr", "add", "192.0.2.1/24", "dev", "ext0"]);
        host.exec(&["ip", "link", "set", "ext0", "up"]);
        host.exec(&["ip", "-6", "addr", "add", "2001:db8:2::1/64", "dev", "ext0"]);
        outside.exec(&["ip", "addr", "add", "192.0.2.2/24", "dev", "eth0"]);
        outside.exec(&["ip", "-6", "addr", "add", "2001:db8:2::2/64", "dev", "eth0"]);
        outside.exec(&["ip", "link", "set", "eth0", "up"]);
        outside
    }

    /// Routes everything of both families from this (outside) namespace back through `host`'s
    /// `ext0`.
    pub fn route_via_host(&self) {
        self.exec(&["ip", "route", "add", "default", "via", "192.0.2.1"]);
        self.exec(&[
            "ip",
            "-6",
            "route",
            "add",
            "default",
            "via",
            "2001:db8:2::1",
        ]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse() {
                    crate::send_signal(pid, "KILL");
                }
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// The one-node set-up of the flow-log and hit tests: on `host`, a workload `client`
/// (`cali0client001`, 10.65.0.1, fd00:65::1) and one named `app` (`iface`, 10.65.0.2,
/// fd00:65::2), both in namespace `prod` of `node`, labelled `app=<name>` with Calico's own
/// labels; their WorkloadEndpoints and the namespace's profile written to
/// `dir/workloads.yaml`.
pub fn client_and(
    host: &Netns,
    node: &str,
    app: &str,
    iface: &str,
    dir: &Path,
) -> (Workload, Workload) {
    let client = Workload::attach(host, "cali0client001", "10.65.0.1", "fd00:65::1");
    let other = Workload::attach(host, iface, "10.65.0.2", "fd00:65::2");
    let mut manifests = namespace_profile("prod", "prod");
    for (w, app) in [(&client, "client"), (&other, app)] {
        manifests.push_str(
            &wep_manifest(node, "prod", app, &w.iface)
                .label("app", app)
                .calico_labels()
                .ipv4(&w.ipv4)
                .ipv6(&w.ipv6)
                .render(),
        );
    }
    write_manifest(dir, "workloads.yaml", &manifests);
    (client, other)
}

/// A workload: its own namespace, `eth0` inside, `iface` on the host.
pub struct Workload {
    pub ns: Netns,
    pub iface: String,
    pub ipv4: String,
    pub ipv6: String,
    listeners: Vec<Listener>,
}

impl Workload {
    /// Wires a workload to `host` the way Calico's CNI plugin does, with the host side's
    /// sysctls and routes made by the harness (the agent replaces the routes with its own).
    pub fn attach(host: &Netns, iface: &str, ipv4: &str, ipv6: &str) -> Workload {
        let w = Self::attach_without_routes(host, iface, ipv4, ipv6);
        host.sysctl(&format!("net.ipv4.conf.{iface}.proxy_arp"), "1");
        host.sysctl(&format!("net.ipv4.neigh.{iface}.proxy_delay"), "0");
        host.exec(&["ip", "route", "add", &format!("{ipv4}/32"), "dev", iface]);
        host.exec(&[
            "ip",
            "-6",
            "route",
            "add",
            &format!("{ipv6}/128"),
            "dev",
            iface,
        ]);
        w
    }

    /// The workload's `eth0` MAC address.
    pub fn mac(&self) -> String {
        self.ns
            .exec(&["cat", "/sys/class/net/eth0/address"])
            .trim()
            .to_owned()
    }

    /// The veth pair and the workload side only: host routes, proxy ARP and the rest of the
    /// host side's settings are left to the agent.
    pub fn attach_without_routes(host: &Netns, iface: &str, ipv4: &str, ipv6: &str) -> Workload {
        let ns = Netns::new("wl");
        host.exec(&[
            "ip", "link", "add", iface, "type", "veth", "peer", "name", "eth0", "netns", &ns.name,
        ]);
        host.exec(&["ip", "link", "set", iface, "address", "ee:ee:ee:ee:ee:ee"]);
        host.exec(&["ip", "link", "set", iface, "up"]);
        ns.exec(&["ip", "link", "set", "eth0", "up"]);
        ns.exec(&["ip", "addr", "add", &format!("{ipv4}/32"), "dev", "eth0"]);
        ns.exec(&[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{ipv6}/128"),
            "dev",
            "eth0",
            "nodad",
        ]);
        ns.exec(&[
            "ip",
            "route",
            "add",
            "169.254.1.1",
            "dev",
            "eth0",
            "scope",
            "link",
        ]);
        ns.exec(&[
            "ip",
            "route",
            "add",
            "default",
            "via",
            "169.254.1.1",
            "dev",
            "eth0",
        ]);
        ns.exec(&[
            "ip",
            "-6",
            "route",
            "add",
            "default",
            "via",
            "fe80::ecee:eeff:feee:eeee",
            "dev",
            "eth0",
        ]);
        Workload {
            ns,
            iface: iface.to_owned(),
            ipv4: ipv4.to_owned(),
            ipv6: ipv6.to_owned(),
            listeners: Vec::new(),
        }
    }

    /// Accepts TCP connections on `port` (IPv4 and IPv6) until dropped.
    pub fn listen(&mut self, port: u16) {
        self.listeners.push(self.ns.listen(port, &["-4", "-6"]));
    }

    /// Whether a TCP connection from this workload to `addr:port` succeeds within 1 s.
    pub fn connects(&self, addr: &str, port: u16) -> bool {
        self.ns
            .try_exec(&["nc", "-z", "-w", "1", addr, &port.to_string()])
    }

    /// Whether one ping from this workload is answered within 1 s.
    pub fn pings(&self, addr: &str) -> bool {
        self.ns.try_exec(&["ping", "-c", "1", "-W", "1", addr])
    }
}

/// The flags of a `dataplane-agent --driver <driver>` under test: quick reconnects.
pub fn agent_args(driver: Driver, server: &str, node: &str, log_level: &str) -> Vec<String> {
    [
        "--server",
        server,
        "--node",
        node,
        "--driver",
        driver.name(),
        "--reconnect-min-delay",
        "100ms",
        "--reconnect-max-delay",
        "500ms",
        "--log-level",
        log_level,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// The flags of a `dataplane-agent --driver linux` under test: quick reconnects.
pub fn linux_agent_args(server: &str, node: &str, log_level: &str) -> Vec<String> {
    agent_args(Driver::Linux, server, node, log_level)
}

/// A calc-server (file datastore in `dir`) and an agent (`--driver linux` unless told), both
/// inside `host`.
pub struct ControlPlane {
    pub server: Child,
    pub agent: Option<Child>,
    pub agent_log: PathBuf,
    pub server_log: PathBuf,
    pub node: String,
    pub driver: Driver,
    pub agent_extra: Vec<String>,
    restarts: usize,
    /// The file datastore's directory.
    dir: PathBuf,
    /// The server's `--listen` address, which the agents dial.
    pub listen: String,
    /// More flags of `calc-server serve`, kept across [`Self::restart_server`].
    pub server_extra: Vec<String>,
    server_starts: usize,
}

impl ControlPlane {
    /// [`Self::start_with_driver`] with `--driver linux`.
    pub fn start(host: &Netns, dir: &Path, node: &str, agent_extra: &[&str]) -> ControlPlane {
        Self::start_with_driver(Driver::Linux, host, dir, node, agent_extra)
    }

    pub fn start_with_driver(
        driver: Driver,
        host: &Netns,
        dir: &Path,
        node: &str,
        agent_extra: &[&str],
    ) -> ControlPlane {
        Self::start_with_server(driver, host, dir, node, agent_extra, "127.0.0.1:50051", &[])
    }

    /// [`Self::start_with_driver`] with the server listening for agents on `listen` (an
    /// address of `host` that agents in other namespaces reach, see [`link_nodes`]) and more
    /// `calc-server serve` flags.
    pub fn start_with_server(
        driver: Driver,
        host: &Netns,
        dir: &Path,
        node: &str,
        agent_extra: &[&str],
        listen: &str,
        server_extra: &[&str],
    ) -> ControlPlane {
        let server_log = dir.with_extension("server.log");
        let owned = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let server = spawn_server(host, dir, listen, &owned(server_extra), &server_log);
        let mut cp = ControlPlane {
            server,
            agent: None,
            agent_log: dir.with_extension("agent.log"),
            server_log,
            node: node.to_owned(),
            driver,
            agent_extra: owned(agent_extra),
            restarts: 0,
            dir: dir.to_owned(),
            listen: listen.to_owned(),
            server_extra: owned(server_extra),
            server_starts: 1,
        };
        cp.start_agent(host);
        cp
    }

    /// Restarts calc-server with the same directories and flags (its log goes to a new file),
    /// stopped as [`Self::stop_server`] says. The agents stay and reconnect.
    pub fn restart_server(&mut self, host: &Netns, graceful: bool) {
        self.stop_server(graceful);
        self.start_server(host);
    }

    /// Stops calc-server: `graceful` as an operator would (SIGTERM, waiting up to 10 s for it
    /// to exit), otherwise killed (SIGKILL, as in a crash). [`Self::start_server`] starts it
    /// again.
    pub fn stop_server(&mut self, graceful: bool) {
        if graceful {
            crate::send_signal(self.server.id(), "TERM");
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.server.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.server.kill();
        let _ = self.server.wait();
    }

    /// Starts calc-server again after [`Self::stop_server`], with the same directories and
    /// flags ([`Self::server_extra`]); its log goes to a new file.
    pub fn start_server(&mut self, host: &Netns) {
        self.server_log = self
            .dir
            .with_extension(format!("server{}.log", self.server_starts));
        self.server_starts += 1;
        self.server = spawn_server(
            host,
            &self.dir,
            &self.listen,
            &self.server_extra,
            &self.server_log,
        );
    }

    pub fn server_log_text(&self) -> String {
        std::fs::read_to_string(&self.server_log).unwrap_or_default()
    }

    /// (Re)starts the agent; its log goes to a new file per start.
    pub fn start_agent(&mut self, host: &Netns) {
        if self.restarts > 0 {
            self.agent_log = self
                .dir
                .with_extension(format!("agent{}.log", self.restarts));
        }
        self.restarts += 1;
        let mut args = agent_args(
            self.driver,
            &self.listen,
            &self.node,
            "info,dataplane_agent::driver::linux=debug",
        );
        args.extend(self.agent_extra.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.agent = Some(host.spawn(&binary("dataplane-agent"), &args, &self.agent_log));
    }

    /// Stops the agent as an operator would (SIGTERM), waiting up to 10 s for it to exit
    /// before killing it.
    pub fn stop_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            crate::send_signal(a.id(), "TERM");
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = a.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = a.kill();
            let _ = a.wait();
        }
    }

    /// Kills the agent (SIGKILL: no chance to clean up, as in a crash).
    pub fn kill_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
    }

    pub fn agent_log_text(&self) -> String {
        std::fs::read_to_string(&self.agent_log).unwrap_or_default()
    }

    /// Waits until the agent has reported its dataplane in sync.
    pub fn wait_programmed(&self) {
        wait_in_sync(&self.agent_log, &self.server_log);
    }
}

/// Starts `calc-server serve` on the file datastore in `dir` inside `host`: agents on
/// `listen`, the admin endpoint on `127.0.0.1:9099`.
fn spawn_server(host: &Netns, dir: &Path, listen: &str, extra: &[String], log: &Path) -> Child {
    let mut args = vec![
        "serve",
        "--file-dir",
        dir.to_str().expect("UTF-8 path"),
        "--listen",
        listen,
        "--admin-listen",
        "127.0.0.1:9099",
        "--file-poll-interval",
        "100ms",
        "--status-interval",
        "100ms",
    ];
    args.extend(extra.iter().map(String::as_str));
    host.spawn(&binary("calc-server"), &args, log)
}

/// Waits (up to 30 s) until the agent logging to `agent_log` has reported its dataplane in
/// sync; the panic shows both logs.
fn wait_in_sync(agent_log: &Path, server_log: &Path) {
    let text = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if text(agent_log).contains("dataplane in sync") {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "agent never programmed the dataplane; agent log ({}):\n{}\nserver log:\n{}",
        agent_log.display(),
        text(agent_log),
        text(server_log)
    );
}

/// Links two host namespaces (two nodes) by a veth pair, `node0` in `a` (10.253.0.1/30) and
/// `node1` in `b` (10.253.0.2/30), and returns those two addresses: a calc-server in `a`
/// listening on the first serves an agent in `b`.
pub fn link_nodes(a: &Netns, b: &Netns) -> (String, String) {
    a.exec(&[
        "ip", "link", "add", "node0", "type", "veth", "peer", "name", "node1", "netns", &b.name,
    ]);
    a.exec(&["ip", "addr", "add", "10.253.0.1/30", "dev", "node0"]);
    b.exec(&["ip", "addr", "add", "10.253.0.2/30", "dev", "node1"]);
    a.exec(&["ip", "link", "set", "node0", "up"]);
    b.exec(&["ip", "link", "set", "node1", "up"]);
    ("10.253.0.1".to_owned(), "10.253.0.2".to_owned())
}

/// One more node's agent, in its own host namespace, dialing a [`ControlPlane`]'s server (see
/// [`link_nodes`]); killed on drop.
pub struct NodeAgent {
    pub child: Option<Child>,
    pub log: PathBuf,
    pub node: String,
}

impl NodeAgent {
    /// Starts `dataplane-agent --driver <driver> --node <node> --server <server> extra…` in
    /// `host`, logging to `log`.
    pub fn start(
        host: &Netns,
        driver: Driver,
        server: &str,
        node: &str,
        extra: &[&str],
        log: &Path,
    ) -> NodeAgent {
        let mut args = agent_args(
            driver,
            server,
            node,
            "info,dataplane_agent::driver::linux=debug",
        );
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        NodeAgent {
            child: Some(host.spawn(&binary("dataplane-agent"), &args, log)),
            log: log.to_owned(),
            node: node.to_owned(),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until this agent has reported its dataplane in sync (`server_log` for the panic).
    pub fn wait_programmed(&self, server_log: &Path) {
        wait_in_sync(&self.log, server_log);
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        if let Some(mut a) = self.child.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.kill_agent();
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// One expected verdict: from a workload to an address and port (`None` = ping).
pub struct Probe<'a> {
    pub from: &'a Workload,
    pub to: String,
    pub port: Option<u16>,
    pub allowed: bool,
}

impl Probe<'_> {
    fn passes(&self) -> bool {
        let ok = match self.port {
            Some(p) => self.from.connects(&self.to, p),
            None => self.from.pings(&self.to),
        };
        ok == self.allowed
    }

    pub fn describe(&self) -> String {
        format!(
            "{} -> {}{} should be {}",
            self.from.ipv4,
            self.to,
            self.port
                .map(|p| format!(":{p}"))
                .unwrap_or_else(|| " (ping)".into()),
            if self.allowed { "allowed" } else { "denied" }
        )
    }
}

/// Runs every probe in parallel; the ones whose verdict is wrong.
pub fn failing<'a>(probes: &'a [Probe<'a>]) -> Vec<&'a Probe<'a>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = probes
            .iter()
            .map(|p| s.spawn(move || (p, p.passes())))
            .collect();
        handles
            .into_iter()
            .filter_map(|h| {
                let (p, ok) = h.join().expect("probe thread");
                (!ok).then_some(p)
            })
            .collect()
    })
}

/// Polls `check` every 200 ms until it holds; past `timeout`, panics with `what` and the
/// `diagnostics` (agent log, kernel state) gathered at that moment.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> bool,
    diagnostics: impl FnOnce() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !check() {
        if Instant::now() > deadline {
            panic!("{what}: not within {timeout:?}\n{}", diagnostics());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits up to `timeout` until every probe gives the expected verdict; the panic lists the
/// wrong ones, then `diagnostics`.
pub fn expect_verdicts(
    what: &str,
    probes: &[Probe<'_>],
    timeout: Duration,
    diagnostics: impl FnOnce() -> String,
) {
    let wrong = std::cell::RefCell::new(Vec::new());
    wait_until(
        what,
        timeout,
        || {
            *wrong.borrow_mut() = failing(probes).iter().map(|p| p.describe()).collect();
            wrong.borrow().is_empty()
        },
        || {
            format!(
                "wrong verdicts:\n  {}\n{}",
                wrong.borrow().join("\n  "),
                diagnostics()
            )
        },
    );
}

/// Waits (up to 20 s) until every probe gives the expected verdict.
pub fn expect_eventually(what: &str, probes: &[Probe<'_>], cp: &ControlPlane) {
    expect_verdicts(what, probes, Duration::from_secs(20), || {
        format!("agent log:\n{}", cp.agent_log_text())
    });
}

/// The flows a server holds (`calc-server flows --server ADMIN --output json`, run in
/// `host`'s namespace), one Goldmane `Flow` each.
pub fn flow_listing(host: &Netns, admin: &str) -> Vec<serde_json::Value> {
    let cli = binary("calc-server");
    let out = host.exec(&[
        cli.to_str().expect("utf-8 path"),
        "flows",
        "--server",
        admin,
        "--output",
        "json",
    ]);
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("one JSON object per line: {e}: {l}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::wep_manifest;

    /// The document as the tests wrote it by hand before there was a builder, names escaped as
    /// Calico's CNI plugin escapes them.
    #[test]
    fn a_wep_manifest_is_the_cni_plugins_document() {
        let text = wep_manifest("node-a", "prod", "web-1", "caliweb")
            .label("app", "web")
            .calico_labels()
            .mac("ee:ee:ee:ee:ee:01")
            .ipv4("10.65.0.2")
            .ipv6("fd00:65::2")
            .ports("{name: http, protocol: TCP, port: 8080}")
            .render();
        assert_eq!(
            text,
            "apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata:
  name: node--a-k8s-web--1-eth0
  namespace: prod
  labels:
    app: web
    projectcalico.org/namespace: prod
    projectcalico.org/orchestrator: k8s
spec:
  orchestrator: k8s
  node: node-a
  pod: web-1
  endpoint: eth0
  interfaceName: caliweb
  mac: \"ee:ee:ee:ee:ee:01\"
  ipNetworks: [10.65.0.2/32, fd00:65::2/128]
  profiles: [kns.prod]
  ports: [{name: http, protocol: TCP, port: 8080}]
---
"
        );
    }
}
