//! File datastore watcher: polls the manifest directory and turns changes into graph updates.
//!
//! Polling (a listing of paths, sizes and modification times, every interval) is used rather
//! than inotify so it works the same on every filesystem, including bind-mounted ConfigMaps.
//! On a change the directory is reloaded and compared with the last load: changed or new
//! objects become `Apply`, vanished ones `Delete`. Problems are logged once each, by file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use calc_graph::graph::Update;
use calc_graph::model::{Resource, ResourceKey};
use tokio::sync::mpsc;

use super::engine::Input;
use crate::manifest_dir;

type Listing = BTreeMap<PathBuf, (u64, SystemTime)>;

fn listing(dir: &Path) -> Listing {
    fn walk(root: &Path, p: &Path, out: &mut Listing) {
        let Ok(entries) = std::fs::read_dir(p) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') || (p == root && name == "status") {
                continue;
            }
            match e.metadata() {
                Ok(m) if m.is_dir() => walk(root, &path, out),
                Ok(m) => {
                    out.insert(
                        path,
                        (m.len(), m.modified().unwrap_or(SystemTime::UNIX_EPOCH)),
                    );
                }
                Err(_) => {}
            }
        }
    }
    let mut out = Listing::new();
    walk(dir, dir, &mut out);
    out
}

/// Loads the directory; returns the valid resources and logs new problems.
fn load(dir: &Path, seen_problems: &mut BTreeSet<String>) -> BTreeMap<ResourceKey, Resource> {
    let report = manifest_dir::load(&[dir.to_path_buf()]);
    let mut now = BTreeSet::new();
    for p in &report.problems {
        let p = p.to_string();
        if !seen_problems.contains(&p) {
            tracing::warn!(problem = %p, "manifest skipped");
        }
        now.insert(p);
    }
    *seen_problems = now;
    report
        .resources
        .into_iter()
        .map(|(k, (_, r))| (k, r))
        .collect()
}

/// The updates that move `old` to `new`.
pub fn diff(
    old: &BTreeMap<ResourceKey, Resource>,
    new: &BTreeMap<ResourceKey, Resource>,
) -> Vec<Update> {
    let mut out: Vec<Update> = new
        .iter()
        .filter(|(k, r)| old.get(*k) != Some(*r))
        .map(|(_, r)| Update::Apply(r.clone()))
        .collect();
    out.extend(
        old.keys()
            .filter(|k| !new.contains_key(*k))
            .map(|k| Update::Delete(k.clone())),
    );
    out
}

/// Sends the initial snapshot and InSync, then changes as they appear, until the engine goes.
pub async fn run(dir: PathBuf, interval: Duration, engine: mpsc::Sender<Input>) {
    let mut problems = BTreeSet::new();
    let mut seen = listing(&dir);
    let mut state = load(&dir, &mut problems);
    tracing::info!(dir = %dir.display(), objects = state.len(), "file datastore loaded");
    let mut first: Vec<Update> = state.values().cloned().map(Update::Apply).collect();
    first.push(Update::InSync);
    if engine.send(Input::Datastore(first)).await.is_err() {
        return;
    }
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        let now = listing(&dir);
        if now == seen {
            continue;
        }
        seen = now;
        let next = load(&dir, &mut problems);
        let updates = diff(&state, &next);
        state = next;
        if updates.is_empty() {
            continue;
        }
        tracing::info!(changes = updates.len(), "file datastore changed");
        if engine.send(Input::Datastore(updates)).await.is_err() {
            return;
        }
    }
}
