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
use std::sync::Arc;

use calc_graph::graph::Update;
use common::Tasks;

use super::{Health, Sink, Snapshot};
use crate::args::ServeArgs;
use crate::status::Board;

/// Starts the polling watcher (into `sink`) and the status-file writer; fails if the directory
/// is missing or the status directory is inside it.
pub(super) fn start(
    args: &ServeArgs,
    board: Arc<Board>,
    health: Health,
    sink: Sink,
    tasks: &Tasks,
) -> anyhow::Result<String> {
    let dir = args.datastore.file_dir.clone();
    check_file_dir(&dir)?;
    let status_dir = status::status_dir(&dir, args.status_dir.as_deref())?;
    let last_good = match &args.last_good_dir {
        Some(d) if d.as_os_str().is_empty() => None,
        Some(d) => Some(d.clone()),
        None => status_dir.as_ref().map(|s| s.join("last-good")),
    };
    let interval = args.file_poll_interval;
    let watched = dir.clone();
    let span = tracing::info_span!("datastore", "type" = "file");
    // Reading and parsing files is blocking work: its own thread, off the runtime. It checks
    // the token between polls (and while waiting for the next one) and stops once cancelled.
    tasks.spawn_blocking(
        tracing::info_span!(parent: &span, "file_watch"),
        move |stop| watch::run(watched, last_good, interval, sink, health, &stop),
    );
    if let Some(status_dir) = status_dir {
        tasks.spawn(
            tracing::info_span!(parent: &span, "status_writer"),
            status::file_writer(board, status_dir, args.status_interval),
        );
    }
    Ok(dir.display().to_string())
}

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
        .map(|(_, res)| Update::ApplyValid(res))
        .collect();
    updates.push(Update::InSync);
    Ok(Snapshot { updates, problems })
}
