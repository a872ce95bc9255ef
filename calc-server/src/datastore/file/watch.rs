//! File datastore watcher: polls the manifest directory and turns changes into graph updates.
//!
//! Runs on a blocking thread (reading and parsing never stall the async runtime that serves
//! agents). Polling (a listing of manifest paths, sizes and modification times, every
//! interval, see `manifest_dir::walk`) is used rather than inotify so it works the same on every
//! filesystem, including ConfigMap volumes. A change is read once the listing stayed the same
//! for one interval (a file being written is read when done; a rename is seen whole).
//!
//! Objects are identified by kind/namespace/name across files, never by file. What is in force
//! for a key:
//! 1. the valid definition in the last file (path order) that has one — a key defined in two
//!    files is reported once with both files;
//! 2. else, if some file holds the key but it is invalid: the last good version (kept), or
//!    nothing, reported loudly as "no last good version";
//! 3. else, if the key was in force and some file cannot be read or parsed at all (or a file
//!    that had objects reads empty: an editor's truncate-then-write): kept until that file is
//!    fixed, because the broken file may still hold it (a broken file renamed `.yaml` →
//!    `.yml` is not a delete);
//! 4. else it is deleted.
//!
//! The versions in force are saved to the last-good store ([`LastGood`]), so a restart with an
//! invalid object starts from its last good version.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use std::time::Duration;

use calc_graph::graph::Update;
use calc_graph::model::{ResourceKey, Valid};
use common::tasks::CancellationToken;

use super::last_good::LastGood;
use super::manifest_dir::{self, Stamp};
use crate::datastore::{Health, Sink};

type Listing = BTreeMap<PathBuf, Stamp>;

/// A key's version to record in the last-good store (`None`: the key is gone).
type StoreOp = (ResourceKey, Option<Valid>);

/// Polls a changing file waits to settle before it is read anyway.
const UNSETTLED_POLLS: u32 = 10;

/// What to read at this poll, per file: a file whose stamp differs from what was read, once it
/// has kept that stamp for a whole interval (a file being written, an editor's
/// truncate-then-write or a rename seen half done is read once it is done), or after
/// [`UNSETTLED_POLLS`] polls of changing; a file gone from the listing, once it stayed gone
/// for an interval. Each file settles on its own, so a directory under constant churn still
/// has every finished write read within about two intervals. `unsettled` counts, per file,
/// the polls it has been seen changing.
fn settled(
    seen: &Listing,
    last: &Listing,
    now: &Listing,
    unsettled: &mut BTreeMap<PathBuf, u32>,
) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut ready = |p: &PathBuf, stable: bool| {
        let polls = unsettled.entry(p.clone()).or_default();
        if stable || *polls >= UNSETTLED_POLLS {
            unsettled.remove(p);
            true
        } else {
            *polls += 1;
            false
        }
    };
    let mut changed = Vec::new();
    for (p, stamp) in now {
        if seen.get(p) == Some(stamp) {
            continue;
        }
        if ready(p, last.get(p) == Some(stamp)) {
            changed.push(p.clone());
        }
    }
    let mut gone = Vec::new();
    for p in seen.keys().filter(|p| !now.contains_key(*p)) {
        if ready(p, !last.contains_key(p)) {
            gone.push(p.clone());
        }
    }
    // Files back to what was read need no more waiting.
    unsettled.retain(|p, _| now.get(p) != seen.get(p));
    (changed, gone)
}

/// What one file held when it was last read.
#[derive(Default)]
struct FileState {
    objects: BTreeMap<ResourceKey, Valid>,
    invalid: BTreeSet<ResourceKey>,
    /// Unreadable, unparseable, or emptied after holding objects: its keys are unknown.
    broken: bool,
    problems: BTreeSet<String>,
    rejected: Vec<calc_graph::manifest::RejectStage>,
}

fn read_file(path: &std::path::Path, before: Option<&FileState>) -> FileState {
    let mut report = manifest_dir::Report::default();
    manifest_dir::load_file(path, &mut report);
    let mut state = FileState {
        objects: report
            .resources
            .into_iter()
            .map(|(k, (_, r))| (k, r))
            .collect(),
        invalid: report.invalid.into_keys().collect(),
        broken: !report.broken.is_empty(),
        problems: report.problems.iter().map(ToString::to_string).collect(),
        rejected: report.rejected,
    };
    // An editor that truncates and then writes shows an empty file for a moment: emptying a
    // file is not how objects are deleted (remove the file, or the objects from it).
    if let Some(old) = before
        && (!old.objects.is_empty() || old.broken)
        && state.objects.is_empty()
        && state.invalid.is_empty()
        && !state.broken
        && report.objects == 0
        && report.ignored == 0
    {
        state.broken = true;
        state.problems.insert(format!(
            "{}: the file is empty; the objects it held stay until it has content again or is removed",
            path.display()
        ));
    }
    state
}

/// The watcher's state: every file's contents and what is in force.
struct Watcher {
    dir: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    /// The version of each key in force (what the engine has).
    current: BTreeMap<ResourceKey, Valid>,
    /// The last-good store's writer (its own thread: the disk is not on the way of a change).
    store: std::sync::mpsc::Sender<Vec<StoreOp>>,
    /// Versions to record in (`Some`) or drop from (`None`) the last-good store, handed to the
    /// writer once the updates have gone to the engine.
    to_store: Vec<StoreOp>,
    /// Problems of the directory walk already logged.
    walk_problems: BTreeSet<String>,
    /// Keys defined in several files, already reported (with the files).
    duplicates: BTreeMap<ResourceKey, Vec<PathBuf>>,
    /// Keys held by rule 2 or 3 (re-evaluated on every change).
    held: BTreeSet<ResourceKey>,
    /// The file whose definition of a key is in force (unknown for what the store gave).
    origin: BTreeMap<ResourceKey, PathBuf>,
    health: Health,
}

impl Watcher {
    fn listing(&mut self) -> Listing {
        let walk = manifest_dir::walk(&self.dir);
        let now: BTreeSet<String> = walk.problems.iter().map(ToString::to_string).collect();
        for p in now.difference(&self.walk_problems) {
            tracing::warn!(problem = %p, "manifest directory");
        }
        self.walk_problems = now;
        walk.files.into_iter().collect()
    }

    /// Reads `changed` files and forgets `gone` ones; logs new problems.
    fn read(&mut self, changed: &[PathBuf], gone: &[PathBuf]) {
        for f in gone {
            self.files.remove(f);
        }
        for f in changed {
            let state = read_file(f, self.files.get(f));
            for stage in &state.rejected {
                self.health.rejections.count(*stage);
            }
            let before = self.files.get(f).map(|s| &s.problems);
            for p in &state.problems {
                if before.is_none_or(|b| !b.contains(p)) {
                    tracing::warn!(problem = %p, "manifest skipped");
                }
            }
            self.files.insert(f.clone(), state);
        }
    }

    /// What rule applies to `key` now: the version to put in force, if any.
    fn desired(&self, key: &ResourceKey, any_broken: bool) -> Desired {
        let mut defined_in = Vec::new();
        let mut winner = None;
        let mut invalid = false;
        for (path, f) in &self.files {
            if let Some(r) = f.objects.get(key) {
                defined_in.push(path);
                winner = Some(r);
            }
            invalid |= f.invalid.contains(key);
        }
        if let Some(r) = winner {
            return Desired::Valid(
                Box::new(r.clone()),
                defined_in.into_iter().cloned().collect(),
            );
        }
        match self.current.get(key) {
            Some(_) if invalid => Desired::Held,
            None if invalid => Desired::NoLastGood,
            // Only a key whose file is gone or broken can still be in a broken file; one that a
            // readable file dropped was deleted.
            Some(_)
                if any_broken
                    && self
                        .origin
                        .get(key)
                        .is_none_or(|o| self.files.get(o).is_none_or(|f| f.broken)) =>
            {
                Desired::Held
            }
            _ => Desired::Absent,
        }
    }

    /// Hands what [`Watcher::reconcile`] left for the last-good store to its writer.
    fn persist(&mut self) {
        if !self.to_store.is_empty() {
            // A writer that is gone has logged why; the engine has the versions anyway.
            let _ = self.store.send(std::mem::take(&mut self.to_store));
        }
    }

    /// Brings `keys` in line with the files; returns the updates to send (what the last-good
    /// store must record waits in `to_store`, see [`Watcher::persist`]).
    fn reconcile(&mut self, keys: BTreeSet<ResourceKey>) -> Vec<Update> {
        let any_broken = self.files.values().any(|f| f.broken);
        let mut updates = Vec::new();
        for key in keys.iter().chain(self.held.clone().iter()) {
            let desired = self.desired(key, any_broken);
            self.held.remove(key);
            match desired {
                Desired::Valid(r, files) => {
                    if let Some(last) = files.last() {
                        self.origin.insert(key.clone(), last.clone());
                    }
                    self.report_duplicate(key, files);
                    if self.current.get(key) != Some(&*r) {
                        self.to_store.push((key.clone(), Some((*r).clone())));
                        self.current.insert(key.clone(), (*r).clone());
                        updates.push(Update::ApplyValid(*r));
                    }
                }
                Desired::Held => {
                    self.duplicates.remove(key);
                    self.held.insert(key.clone());
                }
                Desired::NoLastGood => {
                    self.duplicates.remove(key);
                }
                Desired::Absent => {
                    self.duplicates.remove(key);
                    self.origin.remove(key);
                    if self.current.remove(key).is_some() {
                        self.to_store.push((key.clone(), None));
                        updates.push(Update::Delete(key.clone()));
                    }
                }
            }
        }
        // Invalid keys with no last good version, over the whole directory. A key not in force
        // has no valid definition anywhere (that would be in force).
        let without: BTreeSet<&ResourceKey> = self
            .files
            .values()
            .flat_map(|f| &f.invalid)
            .filter(|k| !self.current.contains_key(*k))
            .collect();
        let held: Vec<String> = self.held.iter().map(ToString::to_string).collect();
        let without: Vec<String> = without.iter().map(ToString::to_string).collect();
        self.health.unusable.publish(held, without);
        updates
    }

    fn report_duplicate(&mut self, key: &ResourceKey, files: Vec<PathBuf>) {
        if files.len() < 2 {
            self.duplicates.remove(key);
            return;
        }
        if self.duplicates.get(key) != Some(&files) {
            let shown: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            tracing::warn!(object = %key, files = ?shown, "object defined in several files; the last one (in path order) is used");
            self.duplicates.insert(key.clone(), files);
        }
    }

    fn keys_of(&self, paths: &[PathBuf], out: &mut BTreeSet<ResourceKey>) {
        for p in paths {
            if let Some(f) = self.files.get(p) {
                out.extend(f.objects.keys().cloned());
                out.extend(f.invalid.iter().cloned());
            }
        }
    }
}

/// Waits `interval`, or less once `stop` is cancelled; true when it is. Sleeps in short slices
/// (no runtime needed, so this works even while the runtime shuts down).
fn wait(stop: &CancellationToken, interval: Duration) -> bool {
    const SLICE: Duration = Duration::from_millis(50);
    let until = std::time::Instant::now() + interval;
    loop {
        if stop.is_cancelled() {
            return true;
        }
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(left.min(SLICE));
    }
}

enum Desired {
    Valid(Box<Valid>, Vec<PathBuf>),
    Held,
    NoLastGood,
    Absent,
}

/// Sends the initial snapshot and InSync, then changes as they appear, until the sink's
/// receiver goes or `stop` is cancelled (checked at every poll; the wait between polls ends
/// early). `health` gets the rejected objects (counter) and unusable ones (gauges).
/// Only files whose size or modification time changed are read again, and only their keys
/// (and the held ones) are reconciled.
pub fn run(
    dir: PathBuf,
    last_good_dir: Option<PathBuf>,
    interval: Duration,
    sink: Sink,
    health: Health,
    stop: &CancellationToken,
) {
    let (mut store, stored, problems) = LastGood::open(last_good_dir);
    for p in &problems {
        tracing::warn!(problem = %p, "last-good store");
    }
    let (store_tx, store_rx) = std::sync::mpsc::channel::<Vec<StoreOp>>();
    // The writer ends when the watcher drops its sender, after writing everything queued.
    let span = tracing::Span::current();
    let writer = std::thread::Builder::new()
        .name("last-good".into())
        .spawn(move || {
            let _span = span.enter();
            for batch in store_rx {
                for (key, version) in batch {
                    match version {
                        Some(v) => store.save(&key, &v),
                        None => store.forget(&key),
                    }
                }
            }
        });
    let w = Watcher {
        dir,
        files: BTreeMap::new(),
        // What the store holds is what a previous run had in force.
        current: stored,
        store: store_tx,
        to_store: Vec::new(),
        walk_problems: BTreeSet::new(),
        duplicates: BTreeMap::new(),
        held: BTreeSet::new(),
        origin: BTreeMap::new(),
        health,
    };
    watch(w, interval, &sink, stop);
    match writer {
        Ok(writer) => {
            let _ = writer.join();
        }
        Err(error) => {
            tracing::error!(%error, "cannot start the last-good store's writer; the store is not updated")
        }
    }
}

/// The watcher's loop: the first listing, then every poll until the sink closes or `stop`.
fn watch(mut w: Watcher, interval: Duration, sink: &Sink, stop: &CancellationToken) {
    let mut seen = w.listing();
    let files: Vec<PathBuf> = seen.keys().cloned().collect();
    w.read(&files, &[]);
    let mut keys: BTreeSet<ResourceKey> = w.current.keys().cloned().collect();
    w.keys_of(&files, &mut keys);
    w.reconcile(keys);
    let mut first: Vec<Update> = w
        .current
        .values()
        .cloned()
        .map(Update::ApplyValid)
        .collect();
    tracing::info!(dir = %w.dir.display(), objects = first.len(), held = w.held.len(), "file datastore loaded");
    first.push(Update::InSync);
    if stop.is_cancelled() || sink.blocking_send(first).is_err() {
        return;
    }
    w.persist();
    // The listing of the previous poll, and for how many polls each file has kept changing.
    let mut last = seen.clone();
    let mut unsettled: BTreeMap<PathBuf, u32> = BTreeMap::new();
    loop {
        if wait(stop, interval) || sink.is_closed() {
            return;
        }
        let now = w.listing();
        if now == seen {
            last = now;
            unsettled.clear();
            continue;
        }
        let (changed, gone) = settled(&seen, &last, &now, &mut unsettled);
        last = now;
        if changed.is_empty() && gone.is_empty() {
            continue;
        }
        // `seen` is what was read: the files still settling keep their old stamp.
        for p in &changed {
            seen.insert(p.clone(), last[p]);
        }
        for p in &gone {
            seen.remove(p);
        }
        let mut keys = BTreeSet::new();
        w.keys_of(&changed, &mut keys);
        w.keys_of(&gone, &mut keys);
        w.read(&changed, &gone);
        w.keys_of(&changed, &mut keys);
        let updates = w.reconcile(keys);
        if updates.is_empty() {
            continue;
        }
        tracing::info!(
            changes = updates.len(),
            files = changed.len() + gone.len(),
            "file datastore changed"
        );
        if sink.blocking_send(updates).is_err() {
            return;
        }
        w.persist();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(files: &[(&str, u64)]) -> Listing {
        files
            .iter()
            .map(|(p, size)| (PathBuf::from(p), (*size, std::time::UNIX_EPOCH)))
            .collect()
    }

    #[test]
    fn each_file_is_read_once_it_settles_whatever_the_others_do() {
        let mut unsettled = BTreeMap::new();
        let seen = listing(&[("a", 1), ("b", 1), ("c", 1)]);
        // Poll 1: a and b were written since; nothing has held still for an interval yet.
        let last = seen.clone();
        let now = listing(&[("a", 2), ("b", 2), ("c", 1)]);
        assert_eq!(
            settled(&seen, &last, &now, &mut unsettled),
            (vec![], vec![])
        );
        // Poll 2: a is done; b is written again (a writer that never stops).
        let (last, now) = (now, listing(&[("a", 2), ("b", 3), ("c", 1)]));
        let (changed, gone) = settled(&seen, &last, &now, &mut unsettled);
        assert_eq!(changed, [PathBuf::from("a")], "a is read while b churns");
        assert!(gone.is_empty());
        // b keeps changing: it is read anyway after UNSETTLED_POLLS polls.
        let mut last = now;
        let mut read_at = None;
        for poll in 0..UNSETTLED_POLLS + 2 {
            let now = listing(&[("a", 2), ("b", 10 + u64::from(poll)), ("c", 1)]);
            let (changed, _) = settled(&seen, &last, &now, &mut unsettled);
            if changed.contains(&PathBuf::from("b")) {
                read_at = Some(poll);
                break;
            }
            last = now;
        }
        assert!(read_at.is_some_and(|p| p <= UNSETTLED_POLLS), "{read_at:?}");
    }

    #[test]
    fn a_removed_file_is_forgotten_once_it_stays_gone() {
        let mut unsettled = BTreeMap::new();
        let seen = listing(&[("a", 1), ("b", 1)]);
        let now = listing(&[("a", 1)]);
        // Gone since the previous poll: wait an interval (a rename seen half done).
        assert_eq!(
            settled(&seen, &seen, &now, &mut unsettled),
            (vec![], vec![])
        );
        assert_eq!(
            settled(&seen, &now, &now, &mut unsettled),
            (vec![], vec![PathBuf::from("b")])
        );
        // Back before it settled: nothing to do, and nothing left waiting.
        let mut unsettled = BTreeMap::new();
        let _ = settled(&seen, &seen, &now, &mut unsettled);
        let _ = settled(&seen, &now, &seen, &mut unsettled);
        assert!(unsettled.is_empty());
    }

    #[test]
    fn the_watcher_stops_when_cancelled_without_waiting_for_its_next_poll() {
        let dir = tempfile::tempdir().unwrap();
        let (sink, mut rx) = tokio::sync::mpsc::channel(4);
        let stop = CancellationToken::new();
        let watcher = {
            let (dir, stop) = (dir.path().to_path_buf(), stop.clone());
            // An hour between polls: only the cancel can end the wait.
            let hour = Duration::from_secs(3600);
            std::thread::spawn(move || run(dir, None, hour, sink, Health::default(), &stop))
        };
        let first = rx.blocking_recv().expect("the initial snapshot");
        assert!(matches!(first.last(), Some(Update::InSync)));
        let cancelled = std::time::Instant::now();
        stop.cancel();
        watcher.join().unwrap();
        assert!(cancelled.elapsed() < Duration::from_secs(2));
        // The receiver is still there: the cancel, not a closed sink, stopped it.
        drop(rx);
    }
}
