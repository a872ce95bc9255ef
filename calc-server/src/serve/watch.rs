//! File datastore watcher: polls the manifest directory and turns changes into graph updates.
//!
//! Polling (a listing of manifest paths, sizes and modification times, every interval, following
//! symlinks) is used rather than inotify so it works the same on every filesystem, including
//! ConfigMap volumes (whose files are links into a directory swapped on update). An edit that
//! makes an object invalid keeps its last good version.
//! A change is read once the listing stayed the same for one interval (a file being written is
//! read when done; a rename is seen whole); a file that turns empty keeps its objects (an
//! editor's truncate-then-write). Changed files are reloaded and compared with the last load:
//! changed or new objects become `Apply`, vanished ones `Delete`. Problems are logged once each,
//! by file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use calc_graph::graph::Update;
use calc_graph::model::{Resource, ResourceKey};
use tokio::sync::mpsc;

use super::engine::Input;
use crate::manifest_dir;

type Listing = BTreeMap<PathBuf, (u64, SystemTime)>;

/// Polls a changing directory waits for it to settle before reading it anyway.
const UNSETTLED_POLLS: u32 = 10;

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
            // Follow symlinks: a Kubernetes ConfigMap volume is `name -> ..data/name` and an update
            // swaps `..data`, which only shows through the link's target.
            match std::fs::metadata(&path) {
                Ok(m) if m.is_dir() => walk(root, &path, out),
                Ok(m) if manifest_dir::is_manifest(&path) => {
                    out.insert(
                        path,
                        (m.len(), m.modified().unwrap_or(SystemTime::UNIX_EPOCH)),
                    );
                }
                _ => {}
            }
        }
    }
    let mut out = Listing::new();
    walk(dir, dir, &mut out);
    out
}

/// Loads some manifest files; returns each file's valid resources and logs new problems.
/// A file with any problem (unreadable, not YAML/JSON, an invalid object) keeps the objects it
/// had before that are missing now: an edit that breaks an object must not delete it (the last
/// good version stays), and a deletion from a broken file waits until the file is fixed.
fn load_files(
    files: &[PathBuf],
    seen_problems: &mut BTreeMap<PathBuf, BTreeSet<String>>,
    previous: &BTreeMap<PathBuf, BTreeMap<ResourceKey, Resource>>,
) -> BTreeMap<PathBuf, BTreeMap<ResourceKey, Resource>> {
    let mut out = BTreeMap::new();
    for f in files {
        let report = manifest_dir::load(std::slice::from_ref(f));
        let mut objects: BTreeMap<ResourceKey, Resource> = report
            .resources
            .into_iter()
            .map(|(k, (_, r))| (k, r))
            .collect();
        let mut now: BTreeSet<String> = report.problems.iter().map(ToString::to_string).collect();
        // An editor that truncates and then writes shows an empty file for a moment: emptying
        // a file is not how objects are deleted (remove the file, or the objects from it).
        if let Some(old) = previous.get(f)
            && !old.is_empty()
            && objects.is_empty()
            && now.is_empty()
            && std::fs::read_to_string(f).is_ok_and(|t| t.trim().is_empty())
        {
            now.insert(format!(
                "{}: the file is empty; its {} objects stay until it has content again or is removed",
                f.display(),
                old.len()
            ));
        }
        if !now.is_empty()
            && let Some(old) = previous.get(f)
        {
            for (k, r) in old {
                objects.entry(k.clone()).or_insert_with(|| r.clone());
            }
        }
        let before = seen_problems.remove(f).unwrap_or_default();
        for p in now.difference(&before) {
            tracing::warn!(problem = %p, "manifest skipped");
        }
        seen_problems.insert(f.clone(), now);
        out.insert(f.clone(), objects);
    }
    out
}

/// Every file's objects merged; a key defined twice keeps the later file's (path order).
fn merged(
    by_file: &BTreeMap<PathBuf, BTreeMap<ResourceKey, Resource>>,
) -> BTreeMap<ResourceKey, Resource> {
    let mut out = BTreeMap::new();
    for objects in by_file.values() {
        for (k, r) in objects {
            out.insert(k.clone(), r.clone());
        }
    }
    out
}

/// The object a key currently has: the last file (in path order) that defines it.
fn winner<'a>(
    by_file: &'a BTreeMap<PathBuf, BTreeMap<ResourceKey, Resource>>,
    k: &ResourceKey,
) -> Option<&'a Resource> {
    by_file.values().rev().find_map(|objs| objs.get(k))
}

/// Sends the initial snapshot and InSync, then changes as they appear, until the engine goes.
/// Only files whose size or modification time changed are read again, and only their keys are
/// compared. One copy of the objects is kept (per file), to tell what an edit changed.
pub async fn run(dir: PathBuf, interval: Duration, engine: mpsc::Sender<Input>) {
    let mut problems = BTreeMap::new();
    let mut seen = listing(&dir);
    let files: Vec<PathBuf> = seen.keys().cloned().collect();
    let mut by_file = load_files(&files, &mut problems, &BTreeMap::new());
    let mut first: Vec<Update> = merged(&by_file).into_values().map(Update::Apply).collect();
    tracing::info!(dir = %dir.display(), objects = first.len(), "file datastore loaded");
    first.push(Update::InSync);
    if engine.send(Input::Datastore(first)).await.is_err() {
        return;
    }
    let mut tick = tokio::time::interval(interval);
    // The listing of the previous poll, and for how many polls it has kept changing.
    let mut last = seen.clone();
    let mut unsettled = 0;
    loop {
        tick.tick().await;
        let now = listing(&dir);
        if now == seen {
            last = now;
            unsettled = 0;
            continue;
        }
        // Read only what stayed the same for a whole interval: a file being written (or an
        // editor's truncate-then-write, or a rename seen half done) is read once it is done.
        // A directory that never settles is read anyway after a few polls.
        if now != last && unsettled < UNSETTLED_POLLS {
            last = now;
            unsettled += 1;
            continue;
        }
        last = now.clone();
        unsettled = 0;
        let changed: Vec<PathBuf> = now
            .iter()
            .filter(|(p, meta)| seen.get(*p) != Some(*meta))
            .map(|(p, _)| p.clone())
            .collect();
        let gone: Vec<PathBuf> = seen
            .keys()
            .filter(|p| !now.contains_key(*p))
            .cloned()
            .collect();
        seen = now;
        let fresh = load_files(&changed, &mut problems, &by_file);
        // Only the keys of the files that changed can change.
        let mut keys: BTreeSet<ResourceKey> = BTreeSet::new();
        for f in changed.iter().chain(&gone) {
            if let Some(old) = by_file.get(f) {
                keys.extend(old.keys().cloned());
            }
        }
        for objects in fresh.values() {
            keys.extend(objects.keys().cloned());
        }
        let before: BTreeMap<ResourceKey, Option<Resource>> = keys
            .iter()
            .map(|k| (k.clone(), winner(&by_file, k).cloned()))
            .collect();
        for f in &gone {
            by_file.remove(f);
            problems.remove(f);
        }
        by_file.extend(fresh);
        let mut updates = Vec::new();
        for (k, old) in before {
            match (old, winner(&by_file, &k)) {
                (old, Some(new)) if old.as_ref() != Some(new) => {
                    updates.push(Update::Apply(new.clone()))
                }
                (Some(_), None) => updates.push(Update::Delete(k)),
                _ => {}
            }
        }
        if updates.is_empty() {
            continue;
        }
        tracing::info!(
            changes = updates.len(),
            files = changed.len() + gone.len(),
            "file datastore changed"
        );
        if engine.send(Input::Datastore(updates)).await.is_err() {
            return;
        }
    }
}
