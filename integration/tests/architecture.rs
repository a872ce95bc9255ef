//! The crate graph is the architecture (docs/architecture.md, "Crate graph"): these checks keep
//! it so. The pure crates link nothing that does IO, the agent does not link the server's
//! crates, the server does not link the agent, and no production binary links the benchmark
//! tools. Read from `cargo tree` for one package at a time, so each crate's own features count,
//! not the workspace's union.

use std::process::Command;

use integration::workspace_root;

/// The package names `package` links (normal dependencies, transitively).
fn linked(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(workspace_root())
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
            package,
        ])
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    names.sort();
    names.dedup();
    // The tree starts at the package itself: an empty answer must not pass as "links nothing".
    assert!(
        names.iter().any(|n| n == package),
        "cargo tree -p {package} listed no package"
    );
    names
}

fn assert_links_none(package: &str, forbidden: &[&str], why: &str) {
    let linked = linked(package);
    let found: Vec<&&str> = forbidden
        .iter()
        .filter(|f| linked.iter().any(|l| l == **f))
        .collect();
    assert!(found.is_empty(), "{package} links {found:?}: {why}");
}

/// Crates that do IO: an async runtime, sockets, gRPC, the datastores' clients, netlink.
const IO: &[&str] = &[
    "tokio",
    "mio",
    "hyper",
    "tonic",
    "axum",
    "kube",
    "kube-client",
    "etcd-client",
    "rtnetlink",
    "netlink-proto",
    "tracing-subscriber",
];

#[test]
fn the_pure_crates_link_nothing_that_does_io() {
    // The check itself sees IO where there is some.
    assert!(linked("calc-server").iter().any(|l| l == "tokio"));
    for pure in ["calc-graph", "calc-ingest", "calico-names"] {
        assert_links_none(pure, IO, "it must stay pure (DESIGN.md invariant 1)");
    }
}

#[test]
fn the_binaries_link_neither_each_other_nor_the_benchmarks() {
    assert_links_none(
        "dataplane-agent",
        &["calc-graph", "calc-ingest", "calc-server", "bench-tools"],
        "the agent shares only felix-proto, calico-names, common and config-file with the server",
    );
    assert_links_none(
        "calc-server",
        &["dataplane-agent", "bench-tools", "rtnetlink"],
        "the server knows nothing of the dataplane and ships no benchmarks",
    );
}
