//! Helpers for the end-to-end tests: locate the workspace's built binaries and the example data.
//!
//! The binaries are built by `make test` (`cargo build --workspace --bins` before
//! `cargo test --workspace`); a missing binary fails the test with that instruction rather than
//! silently skipping it.

use std::path::PathBuf;

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
    assert!(
        path.is_file(),
        "{} not found: build the binaries first (`cargo build --workspace --bins`, as `make test` does)",
        path.display()
    );
    path
}
