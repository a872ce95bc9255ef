//! Helpers for the end-to-end tests: locate the workspace's built binaries and the example data.
//!
//! The binaries are built by `make test` (`cargo build --workspace --bins` before
//! `cargo test --workspace`). A missing or stale binary fails the test with that instruction
//! rather than silently testing old code or skipping.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration/ sits in the workspace root")
        .to_path_buf()
}

/// Path of a workspace binary in the same target profile directory as the running test.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test-binary> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps");
    let path = dir.join(name);
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} not found: build the binaries first (`cargo build --workspace --bins`, as `make test` does)",
                path.display()
            )
        });
    let root = workspace_root();
    let newest = ["calc-server", "dataplane-agent", "proto"]
        .iter()
        .filter_map(|d| newest_source(&root.join(d)))
        .max();
    if let Some(newest) = newest {
        assert!(
            built >= newest,
            "{} is older than the sources: rebuild (`cargo build --workspace --bins`, as `make test` does)",
            path.display()
        );
    }
    path
}

fn newest_source(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    let entries = std::fs::read_dir(dir).ok()?;
    for e in entries.flatten() {
        let p = e.path();
        let t = if p.is_dir() {
            if p.file_name()
                .is_some_and(|n| n == "tests" || n == "benches")
            {
                continue;
            }
            newest_source(&p)
        } else if p
            .extension()
            .is_some_and(|x| x == "rs" || x == "proto" || x == "toml")
        {
            e.metadata().and_then(|m| m.modified()).ok()
        } else {
            None
        };
        newest = newest.max(t);
    }
    newest
}
