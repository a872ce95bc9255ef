//! The file datastore: a directory of Calico v3 manifests (YAML or JSON), the embedded default.
//!
//! - [`manifest_dir`]: walking the directory and reading manifests (symlink and size limits).
//! - [`watch`]: the polling watcher `serve` runs on a blocking thread; objects are identified
//!   across files, and an invalid one keeps its last good version.
//! - [`last_good`]: the on-disk last-good store, so that a restart keeps that version too.
//! - [`status`]: the status writer (`<node>.json` per node).
//!
//! Thin (DESIGN.md invariant 2): files are read here, meaning and validation stay in
//! `calc-graph`.

pub mod last_good;
pub mod manifest_dir;
pub mod status;
pub mod watch;

use std::path::Path;

use calc_graph::graph::Update;

use super::Snapshot;

/// The file datastore's directory must exist: a typo would otherwise read as an empty cluster
/// (no policy anywhere) rather than as an error.
pub fn check_file_dir(dir: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(
        dir.is_dir(),
        "--file-dir {} is not a directory: give the directory holding the manifests",
        dir.display()
    );
    Ok(())
}

/// Every valid object under `dir` as an `Apply`, then `InSync`; problems by file.
pub fn snapshot(dir: &Path) -> anyhow::Result<Snapshot> {
    check_file_dir(dir)?;
    let report = manifest_dir::load(&[dir.to_path_buf()]);
    let problems = report.problems.iter().map(ToString::to_string).collect();
    let mut updates: Vec<Update> = report
        .resources
        .into_values()
        .map(|(_, res)| Update::Apply(res))
        .collect();
    updates.push(Update::InSync);
    Ok(Snapshot { updates, problems })
}
