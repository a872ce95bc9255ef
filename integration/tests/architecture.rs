//! The crate graph is the architecture (docs/architecture.md, "Crate graph"): these checks keep
//! it so. The pure crates link nothing that does IO, the agent does not link the server's
//! crates, the server does not link the agent, and no production binary links the benchmark
//! tools or the test fixtures. Read from `cargo tree` for one package at a time, so each crate's
//! own features count, not the workspace's union.

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
        assert_links_none(pure, IO, "it must stay pure (architecture invariant 1)");
    }
}

#[test]
fn the_binaries_link_neither_each_other_nor_the_benchmarks() {
    assert_links_none(
        "dataplane-agent",
        &[
            "calc-graph",
            "calc-ingest",
            "calc-server",
            "bench-tools",
            "test-support",
        ],
        "the agent shares only felix-proto, calico-names, common and config-file with the server, \
         and ships no fixtures",
    );
    assert_links_none(
        "calc-server",
        &[
            "dataplane-agent",
            "bench-tools",
            "rtnetlink",
            "test-support",
        ],
        "the server knows nothing of the dataplane and ships no benchmarks or fixtures",
    );
}

/// Every Rust source file of the workspace, relative to the root.
fn sources() -> Vec<std::path::PathBuf> {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                if !["target", ".git", "node_modules"].contains(&name.as_str()) {
                    walk(&p, out);
                }
            } else if name.ends_with(".rs") {
                out.push(p);
            }
        }
    }
    let root = workspace_root();
    let mut out = Vec::new();
    walk(&root, &mut out);
    out.into_iter()
        .map(|p| p.strip_prefix(&root).unwrap().to_path_buf())
        .collect()
}

/// Every source file says what it holds in a `//!` comment at its top.
#[test]
fn every_source_file_starts_with_its_module_doc() {
    let root = workspace_root();
    let files = sources();
    assert!(
        files.len() > 100,
        "the walk found only {} files",
        files.len()
    );
    let missing: Vec<String> = files
        .iter()
        .filter(|f| {
            let text = std::fs::read_to_string(root.join(f)).unwrap();
            !text.trim_start().starts_with("//!")
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "files without a `//!` module doc at the top:\n{}",
        missing.join("\n")
    );
}

/// The `crate::…` modules a source text names (`use crate::a::…`, `crate::b::f()`,
/// `use crate::{c, d::e}`), first path segment only.
fn crate_refs(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in text.match_indices("crate::") {
        // Not the tail of another path (`calc_graph::crate::` does not exist, `$crate::` is a
        // macro's).
        if text[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name = ident(item.trim());
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// calc-server's modules are layered (docs/architecture.md): `args`, `pem`, `flows` (the
/// pure flow store) and `recommend` (pure) import none of ours; `status`, `admin_client` and
/// `table` only those; `datastore` those; the commands (`serve`, `compute`, `explain_cmd`,
/// `status_cmd`, `policies_cmd`, `flows_cmd`, `recommend_cmd`, `offline`) any lower layer and never each other; and no datastore adapter imports another adapter or the serving layer.
/// A module cycle or a sideways import fails here, naming the file.
#[test]
fn calc_servers_modules_import_only_lower_layers() {
    let layer = |m: &str| -> Option<u8> {
        Some(match m {
            "args" | "pem" | "flows" | "recommend" => 0,
            "status" | "admin_client" | "table" => 1,
            "datastore" => 2,
            "serve" | "compute" | "explain_cmd" | "status_cmd" | "policies_cmd" | "flows_cmd"
            | "recommend_cmd" | "offline" => 3,
            _ => return None,
        })
    };
    let root = workspace_root().join("calc-server/src");
    let mut problems = Vec::new();
    let mut checked = 0;
    for f in sources() {
        let Ok(rel) = f.strip_prefix("calc-server/src") else {
            continue;
        };
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if first == "main" || first == "lib" {
            continue; // the command line and the module list see everything
        }
        let Some(own) = layer(&first) else {
            problems.push(format!("{}: module {first} has no layer here", f.display()));
            continue;
        };
        checked += 1;
        let text = std::fs::read_to_string(root.join(rel)).unwrap();
        for r in crate_refs(&text) {
            if r == first {
                continue;
            }
            match layer(&r) {
                Some(l) if l < own => {}
                Some(_) => problems.push(format!(
                    "{}: module {first} imports crate::{r}, which is not below it",
                    f.display()
                )),
                None => problems.push(format!("{}: imports unknown crate::{r}", f.display())),
            }
        }
        // Adapters: no adapter reaches another, nor the serving layer.
        let adapters = ["file", "etcd", "kubernetes"];
        if first == "datastore"
            && let Some(adapter) = rel
                .components()
                .nth(1)
                .map(|c| {
                    c.as_os_str()
                        .to_string_lossy()
                        .trim_end_matches(".rs")
                        .to_string()
                })
                .filter(|a| adapters.contains(&a.as_str()))
        {
            for other in adapters.iter().filter(|a| **a != adapter) {
                for pattern in [
                    format!("datastore::{other}"),
                    format!("super::{other}"),
                    format!("super::super::{other}"),
                ] {
                    if text.contains(&pattern) {
                        problems.push(format!(
                            "{}: the {adapter} adapter imports the {other} adapter ({pattern})",
                            f.display()
                        ));
                    }
                }
            }
        }
    }
    assert!(checked > 20, "only {checked} files checked");
    assert!(
        problems.is_empty(),
        "layering broken:\n{}",
        problems.join("\n")
    );
}

/// Whether `word` occurs in `code` as a whole identifier or path (`IpSets`, not
/// `IpSetsManager`; `nft::render`, not `my_nft::render`).
fn has_word(code: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    code.match_indices(word).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + word.len()..].chars().next();
        let joined_after = word.ends_with(is_ident) && after.is_some_and(is_ident);
        !before.is_some_and(is_ident) && !joined_after
    })
}

/// The agent's Linux driver (docs/architecture.md, `driver::linux`): managers write only the
/// desired state, each kernel writer reads the desired state and its own state and nothing of
/// the other writer's, and one place asks which writer is in force. Checked on the code (not
/// comments) of every non-test source file; a violation names the file and the word.
#[test]
fn the_agents_writers_read_only_the_desired_state() {
    let root = workspace_root();
    let linux = "dataplane-agent/src/driver/linux/";
    // (files, words they must not use, why)
    let nft_side: &[&str] = &["nft/", "writer/nftables.rs"];
    let ipt_side: &[&str] = &["iptables.rs", "ipsets.rs", "writer/iptables.rs"];
    let managers: &[&str] = &[
        "config_mgr.rs",
        "masq_mgr.rs",
        "policy_mgr.rs",
        "endpoint_mgr.rs",
        "ipsets_mgr.rs",
        "routes_mgr.rs",
        "desired/",
        "rules/",
    ];
    let rules: &[(&[&str], &[&str], &str)] = &[
        (
            nft_side,
            &["KernelTable", "IpSets", "ipsets::", "rule_hashes"],
            "the nftables writer reads the iptables writer's state",
        ),
        (
            ipt_side,
            &[
                "NftTables",
                "nft::render",
                "nft::expr",
                "nft::netlink",
                "nft::plan",
            ],
            "the iptables writer reads the nftables writer's state",
        ),
        (
            managers,
            &[
                "KernelTable",
                "IpSets",
                "NftTables",
                "writer::",
                "ipsets::",
                "nft::",
            ],
            "a manager reaches past the desired state into a writer",
        ),
    ];
    let mut problems = Vec::new();
    let mut checked = 0;
    let mut writer_choices = Vec::new();
    for f in sources() {
        let Some(rel) = f.to_str().and_then(|p| p.strip_prefix(linux)) else {
            continue;
        };
        if rel.ends_with("tests.rs") || rel == "fake.rs" {
            continue;
        }
        let text = std::fs::read_to_string(root.join(&f)).unwrap();
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .map(|l| l.split(" // ").next().unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n");
        // Tests inside a file see everything.
        let code = code
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or(&code);
        checked += 1;
        for (files, words, why) in rules {
            if !files
                .iter()
                .any(|p| rel == *p || (p.ends_with('/') && rel.starts_with(p)))
            {
                continue;
            }
            for w in *words {
                if has_word(code, w) {
                    problems.push(format!("{}: {why} ({w})", f.display()));
                }
            }
        }
        if code.contains(".nftables") {
            writer_choices.push(f.display().to_string());
        }
    }
    assert!(checked > 25, "only {checked} files checked");
    assert_eq!(
        writer_choices,
        [format!("{linux}mod.rs")],
        "the writer is chosen in one place"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_import_reader_sees_every_form() {
    let refs = crate_refs(
        "use crate::args::X;\nuse crate::{status, datastore::file};\nlet a = crate::serve::f();\nmacro $crate::x\n",
    );
    assert_eq!(
        refs.into_iter().collect::<Vec<_>>(),
        ["args", "datastore", "serve", "status"]
    );
}
