//! The agent against servers that would take a node down: a snapshot that never ends (slowly,
//! or as a flood of bytes) and a session loop stuck in a blocking apply. What users rely on: the
//! agent drops such a stream and reconnects, the dataplane it last programmed stays enforced
//! meanwhile, and `/liveness` fails (with the reason) only when the agent itself is stuck.
//!
//! Each test runs `dataplane-agent --driver linux` in a network namespace against a scripted
//! server whose every stream follows a plan (hello, snapshot, then close, or trickle forever
//! without InSync); they need root and the namespace tools, so they are `#[ignore]`d with that
//! reason and `make test` runs them. (The agent's TLS failure reasons are tested in `tls.rs`.)

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use felix_proto::to_dataplane::Payload;
use felix_proto::{InSync, IpSetUpdate};
use integration::netns::{self, Ipt, Netns, Workload};
use integration::scripted::{Plan, ScriptedServer, Then, allow_all_profile};
use integration::strip_ansi;

const NODE: &str = "node-lim";
const ADMIN: &str = "127.0.0.1:9098";

// ------------------------------------------------------------------------------------------------
// Messages and helpers
// ------------------------------------------------------------------------------------------------

/// One workload allowed everything by its namespace's profile: its `cali-tw-` chain is the
/// dataplane the tests watch.
fn programmed_state(iface: &str, ip: &str) -> Vec<Payload> {
    vec![
        allow_all_profile(),
        test_support::wep("prod/w1")
            .active()
            .iface(iface)
            .mac("ee:ee:ee:ee:ee:ee")
            .ipv4(&format!("{ip}/32"))
            .profile("kns.prod")
            .update(),
        Payload::InSync(InSync {}),
    ]
}

/// A small IP set per message, each with a new id: a snapshot that only grows.
fn small_set(i: u64) -> Payload {
    Payload::IpsetUpdate(IpSetUpdate {
        id: format!("s:endless-{i}"),
        members: vec![format!("10.99.{}.{}", (i / 256) % 256, i % 256)],
        r#type: 0,
    })
}

/// About 64 KiB per message.
fn big_set(i: u64) -> Payload {
    Payload::IpsetUpdate(IpSetUpdate {
        id: format!("s:flood-{i}"),
        members: (0..4096u32)
            .map(|m| format!("10.{}.{}.{}", i % 200, m / 256, m % 256))
            .collect(),
        r#type: 0,
    })
}

/// `integration::http_get` from inside `ns` (where the agent's admin endpoint listens).
fn http_get_in(ns: &Netns, addr: &str, path: &str) -> Option<(u16, String)> {
    let ns_path = format!("/var/run/netns/{}", ns.name);
    let (addr, path) = (addr.to_owned(), path.to_owned());
    std::thread::spawn(move || {
        let file = std::fs::File::open(&ns_path).expect("namespace file");
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        integration::http_get(&addr, &path)
    })
    .join()
    .expect("http thread")
}

/// The agent's log without the terminal colours its plain format carries.
fn log_text(log: &Path) -> String {
    strip_ansi(&std::fs::read_to_string(log).unwrap_or_default())
}

fn chains(host: &Netns, ipt: Ipt) -> String {
    host.exec(&[&ipt.tool(4, "save"), "-t", "filter"])
}

/// A process of the test's, killed and reaped on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(what: &str, timeout: Duration, check: impl FnMut() -> bool, log: &Path) {
    netns::wait_until(what, timeout, check, || {
        format!("agent log:\n{}", log_text(log))
    });
}

/// Stream 0 programs the workload and ends once applied; every later stream sends a snapshot
/// that never reaches InSync.
fn program_then_never_finish(n: usize, filler: fn(u64) -> Payload, every: Duration) -> Plan {
    if n == 0 {
        Plan {
            snapshot: programmed_state("calilim1", "10.65.7.1"),
            then: Then::CloseWhenProgrammed,
        }
    } else {
        Plan {
            snapshot: vec![],
            then: Then::Endless { every, filler },
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Snapshot limits
// ------------------------------------------------------------------------------------------------

/// A server that trickles a snapshot forever: the agent drops it at `--snapshot-timeout`,
/// reconnects, and meanwhile keeps the last complete dataplane and programs none of the
/// unfinished snapshot; it stays live (the server is at fault, restarting the agent would not
/// help) and reports not ready.
#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn a_snapshot_that_never_ends_is_dropped_at_the_deadline() {
    netns::require();
    let host = Netns::new("lim-dl");
    host.make_host();
    let _w = Workload::attach(&host, "calilim1", "10.65.7.1", "fd00:65:7::1");
    let server = ScriptedServer::start_planned(&host, 50081, NODE, |n| {
        program_then_never_finish(n, small_set, Duration::from_millis(50))
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let _agent = Running(server.start_agent_with(
        &host,
        &log,
        &[
            "--iptables-backend",
            "nft",
            "--snapshot-timeout",
            "1s",
            "--dataplane-watchdog-timeout",
            "1s",
            "--admin-listen",
            ADMIN,
        ],
    ));
    wait_for(
        "the first stream programmed",
        Duration::from_secs(30),
        || server.dataplane_in_syncs() >= 1,
        &log,
    );
    assert!(chains(&host, Ipt::Nft).contains(":cali-tw-calilim1"));

    wait_for(
        "two never-ending snapshots dropped (a fourth stream opened)",
        Duration::from_secs(20),
        || server.streams() >= 4,
        &log,
    );
    let opened = server.stream_times();
    for pair in opened[1..].windows(2) {
        let held = pair[1] - pair[0];
        assert!(
            held >= Duration::from_secs(1),
            "a snapshot was dropped before its deadline: {held:?}"
        );
    }
    let text = log_text(&log);
    let dropped: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("no InSync within --snapshot-timeout"))
        .collect();
    assert!(dropped.len() >= 2, "{text}");
    assert!(
        dropped
            .iter()
            .all(|l| l.contains("ERROR") && l.contains("messages=") && l.contains("timeout=1s")),
        "{dropped:#?}"
    );
    // The dataplane of the last complete snapshot is still enforced; nothing of the unfinished
    // ones was programmed.
    assert!(
        chains(&host, Ipt::Nft).contains(":cali-tw-calilim1"),
        "{}",
        chains(&host, Ipt::Nft)
    );
    let sets = host.exec(&["ipset", "list", "-n"]);
    assert!(!sets.contains("endless"), "{sets}");
    assert_eq!(
        server.dataplane_in_syncs(),
        1,
        "no later stream reached its dataplane"
    );
    // A hostile server does not make the agent look dead: live, not ready.
    assert_eq!(
        http_get_in(&host, ADMIN, "/liveness"),
        Some((200, "alive\n".to_owned()))
    );
    let (code, why) = http_get_in(&host, ADMIN, "/readiness").expect("readiness");
    assert_eq!(code, 503, "{why}");
}

/// A server that floods a snapshot without end: the agent drops the stream as soon as the
/// snapshot passes `--max-snapshot-bytes`, names the bound, reconnects, and keeps the last
/// complete dataplane.
#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn a_snapshot_flood_is_dropped_at_the_byte_bound() {
    netns::require();
    let host = Netns::new("lim-by");
    host.make_host();
    let _w = Workload::attach(&host, "calilim1", "10.65.7.1", "fd00:65:7::1");
    let server = ScriptedServer::start_planned(&host, 50082, NODE, |n| {
        program_then_never_finish(n, big_set, Duration::ZERO)
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    let _agent = Running(server.start_agent_with(
        &host,
        &log,
        &[
            "--iptables-backend",
            "nft",
            "--max-snapshot-bytes",
            "1048576",
        ],
    ));
    wait_for(
        "the first stream programmed",
        Duration::from_secs(30),
        || server.dataplane_in_syncs() >= 1,
        &log,
    );
    wait_for(
        "two flooded snapshots dropped",
        Duration::from_secs(20),
        || {
            log_text(&log)
                .lines()
                .filter(|l| l.contains("exceeds --max-snapshot-bytes"))
                .count()
                >= 2
        },
        &log,
    );
    // Dropped for its size (the log lines above), not at the five-minute deadline.
    assert!(server.streams() >= 3);
    let text = log_text(&log);
    let line = text
        .lines()
        .find(|l| l.contains("exceeds --max-snapshot-bytes"))
        .expect("logged");
    assert!(
        line.contains("ERROR") && line.contains("limit_bytes=1048576"),
        "{line}"
    );
    assert!(chains(&host, Ipt::Nft).contains(":cali-tw-calilim1"));
    let sets = host.exec(&["ipset", "list", "-n"]);
    assert!(!sets.contains("flood"), "{sets}");
    assert_eq!(server.dataplane_in_syncs(), 1);
}

// ------------------------------------------------------------------------------------------------
// Liveness
// ------------------------------------------------------------------------------------------------

/// An apply stuck behind the xtables lock (another iptables user holding it) stops the session
/// loop: past `--dataplane-watchdog-timeout` `/liveness` answers 503 naming the stall, and once
/// the lock is released the apply completes and the agent is live and ready again.
#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn liveness_fails_with_the_reason_while_the_session_is_stuck() {
    netns::require();
    let host = Netns::new("lim-lv");
    host.make_host();
    let _w = Workload::attach(&host, "calilim1", "10.65.7.1", "fd00:65:7::1");
    let server = ScriptedServer::start_planned(&host, 50083, NODE, |_| Plan {
        snapshot: programmed_state("calilim1", "10.65.7.1"),
        then: Then::Hold,
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("agent.log");
    // The test holds the xtables lock (flock, as iptables takes it) of a lock file of its own
    // (XTABLES_LOCKFILE), so no other iptables user is held up.
    let lock: PathBuf = dir.path().join("xtables.lock");
    let holder = std::fs::File::create(&lock).expect("lock file");
    holder.lock().expect("take the xtables lock");
    let mut args = vec![
        format!("XTABLES_LOCKFILE={}", lock.display()),
        integration::binary("dataplane-agent").display().to_string(),
    ];
    args.extend(server.agent_args(&[
        "--iptables-backend",
        "legacy",
        "--xtables-lock-timeout",
        "60s",
        "--dataplane-watchdog-timeout",
        "1s",
        "--admin-listen",
        ADMIN,
    ]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _agent = Running(host.spawn(Path::new("env"), &args, &log));

    let mut last = None;
    wait_for(
        "/liveness 503 while the apply waits for the lock",
        Duration::from_secs(20),
        || {
            last = http_get_in(&host, ADMIN, "/liveness");
            last.as_ref().is_some_and(|(code, _)| *code == 503)
        },
        &log,
    );
    let (_, why) = last.expect("answered");
    assert!(
        why.starts_with("session loop stalled: no progress for "),
        "{why}"
    );
    assert_eq!(why.lines().count(), 1, "{why}");
    let (code, _) = http_get_in(&host, ADMIN, "/readiness").expect("readiness");
    assert_eq!(code, 503);
    assert!(!chains(&host, Ipt::Legacy).contains(":cali-tw-calilim1"));

    drop(holder);
    wait_for(
        "live and ready once the apply completed",
        Duration::from_secs(20),
        || {
            http_get_in(&host, ADMIN, "/liveness").is_some_and(|(c, _)| c == 200)
                && http_get_in(&host, ADMIN, "/readiness").is_some_and(|(c, _)| c == 200)
        },
        &log,
    );
    assert!(chains(&host, Ipt::Legacy).contains(":cali-tw-calilim1"));
    assert_eq!(server.dataplane_in_syncs(), 1);
}
