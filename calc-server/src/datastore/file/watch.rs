//! File datastore watcher: follows the manifest directory and turns changes into graph updates.
//!
//! Runs on a blocking thread (reading and parsing never stall the async runtime that serves
//! agents). Two ways to learn of changes (`--file-watch`):
//! - **inotify** (the default, [`super::notify`]): a watch per directory; only the paths the
//!   kernel names are read again, with no listing of the directory. A file closed after
//!   writing or renamed into place is read at once (an editor's truncate-then-write is read
//!   whole, a rename inside the tree is seen whole); one written but not closed, or removed, is
//!   read once it had no event for `--file-poll-interval` (or after [`UNSETTLED_POLLS`] of
//!   constant change). What inotify cannot name (the kernel's queue overflowing, a directory
//!   created or moved, a ConfigMap volume's `..data` swap) and a listing every
//!   [`RESCAN_EVERY`] (a manifest linked from outside the watched directories changes without
//!   an event) are full listings compared with what was read. Where inotify cannot be used
//!   (no instance or watch left, an error reading events) the watcher polls.
//! - **poll**: a listing of manifest paths, sizes and modification times every interval (see
//!   `manifest_dir::walk`), for filesystems that send no inotify events. A changed file is
//!   read once its size and modification time stayed the same for one interval (a file being
//!   written is read when done; a rename is seen whole).
//!
//! Objects are identified by kind/namespace/name across files, never by file. What is in force
//! for a key:
//! 1. the valid definition in the last file (path order) that has one — a key defined in two
//!    files is reported once with both files;
//! 2. else, if some file holds the key but it is invalid: the last good version (kept), or
//!    nothing, reported loudly as "no last good version". So too when the document that named
//!    the key can no longer be identified (its kind, apiVersion, name or namespace is broken:
//!    `GlobalNetworkPolicyy`, `projectcalico.org/v2`, a name with a newline): that is an
//!    invalid edit, not a delete. A document is followed by its position in the file (its n-th
//!    object; when the same edit adds or removes objects, every unidentifiable document of the
//!    file holds all the file no longer names). Only a document that identifies an object
//!    again (the same one, or validly another one) or the file's removal lets the key go;
//! 3. else, if the key was in force and some file cannot be read or parsed at all (or a file
//!    that had objects reads empty: an editor's truncate-then-write; or a file read for the
//!    first time, as after a restart, holds a document that cannot be identified): kept until
//!    that file is fixed, because the broken file may still hold it (a broken file renamed
//!    `.yaml` → `.yml` is not a delete);
//! 4. else it is deleted.
//!
//! A document that cannot be identified and keeps nothing in force is reported with the
//! objects that have no last good version (`<file>: document <n> (cannot be identified)`), and
//! so is a file that cannot be read or parsed (`<file> (cannot be read or parsed)`: what it says
//! now is not in force, whatever it held before keeps its last good version).
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
use super::manifest_dir::{self, Identity, Stamp};
use super::notify::{Notifier, NotifyError, Pending, Seen};
use crate::args::FileWatch;
use crate::datastore::{Health, Sink};

type Listing = BTreeMap<PathBuf, Stamp>;

/// A key's version to record in the last-good store (`None`: the key is gone).
type StoreOp = (ResourceKey, Option<Valid>);

/// Polls a changing file waits to settle before it is read anyway.
pub(super) const UNSETTLED_POLLS: u32 = 10;

/// How often the inotify watcher lists the whole directory anyway: a manifest that links to a
/// file outside the watched directories changes without an event.
pub const RESCAN_EVERY: Duration = Duration::from_secs(30);

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

/// One object position of a file (its n-th object), as last read.
#[derive(Clone, Debug, PartialEq)]
enum Slot {
    /// Names this resource, valid or not (`None`: a kind the dataplane ignores).
    Named(Option<ResourceKey>),
    /// Cannot be identified (its kind, apiVersion or name is broken): it holds what the
    /// position named before, whose last good versions stay in force.
    Unidentified(Holds),
}

/// What an unidentifiable document holds in force.
#[derive(Clone, Debug, PartialEq)]
struct Holds {
    /// Its 1-based document number and why it cannot be identified, for messages.
    document: usize,
    reason: manifest_dir::Unidentified,
    /// The resources its position named before (carried over while it stays unidentifiable),
    /// except those the file still names elsewhere.
    keys: BTreeSet<ResourceKey>,
    /// What it named before is unknown (the file's first read, as after a restart, or the file
    /// never parsed before): like an unreadable file, it keeps the objects whose file is unknown
    /// or this one.
    unknown: bool,
}

/// What one file held when it was last read.
#[derive(Default)]
struct FileState {
    objects: BTreeMap<ResourceKey, Valid>,
    invalid: BTreeSet<ResourceKey>,
    /// Unreadable, unparseable, or emptied after holding objects: its keys are unknown.
    broken: bool,
    /// Could not be read or parsed at all (not merely emptied): reported as a problem of the
    /// datastore, like an invalid object.
    unreadable: bool,
    /// Every object position, in file order (a broken file keeps those of its last parse, so
    /// that the positions still line up once it parses again).
    slots: Vec<Slot>,
    /// The unidentifiable documents among `slots` and, together, what they hold (kept apart
    /// so that a key's rule is looked up, not searched for, in a file of many documents).
    unidentified: Vec<Holds>,
    held: BTreeSet<ResourceKey>,
    unknown: bool,
    /// Its problems, in file order.
    problems: Vec<String>,
    rejected: Vec<calc_graph::manifest::RejectStage>,
}

impl FileState {
    /// Sets `slots` and what is derived from them.
    fn set_slots(&mut self, slots: Vec<Slot>) {
        self.unidentified = slots
            .iter()
            .filter_map(|s| match s {
                Slot::Unidentified(h) => Some(h.clone()),
                Slot::Named(_) => None,
            })
            .collect();
        self.held = self
            .unidentified
            .iter()
            .flat_map(|h| h.keys.iter().cloned())
            .collect();
        self.unknown = self.unidentified.iter().any(|h| h.unknown);
        self.slots = slots;
    }

    /// Whether which objects the file holds is unknown: rule 3 keeps those it may hold.
    fn keys_unknown(&self) -> bool {
        self.broken || self.unknown
    }
}

/// Which files say what of a key, and which files have problems: kept as files are read, so
/// that a change costs what it changes, not a pass over every file of the directory.
#[derive(Default)]
struct Index {
    keys: BTreeMap<ResourceKey, KeyFiles>,
    /// Files whose keys are unknown ([`FileState::keys_unknown`]).
    unknown: BTreeSet<PathBuf>,
    /// Files that cannot be read or parsed.
    unreadable: BTreeSet<PathBuf>,
    /// Readable files with documents that cannot be identified.
    unidentified: BTreeSet<PathBuf>,
    /// Files holding invalid objects.
    invalid: BTreeSet<PathBuf>,
}

/// The files that define a key validly, hold an invalid version of it, or hold it by an
/// unidentifiable document (each in path order).
#[derive(Default)]
struct KeyFiles {
    valid: BTreeSet<PathBuf>,
    invalid: BTreeSet<PathBuf>,
    held: BTreeSet<PathBuf>,
}

impl Index {
    fn add(&mut self, path: &std::path::Path, f: &FileState) {
        self.each(f, |set| {
            set.insert(path.to_path_buf());
        });
    }

    fn remove(&mut self, path: &std::path::Path, f: &FileState) {
        self.each(f, |set| {
            set.remove(path);
        });
        let keys = f.objects.keys().chain(&f.invalid).chain(&f.held);
        for k in keys {
            if self.keys.get(k).is_some_and(|kf| {
                kf.valid.is_empty() && kf.invalid.is_empty() && kf.held.is_empty()
            }) {
                self.keys.remove(k);
            }
        }
    }

    /// Calls `op` on every set the file `f` belongs to.
    fn each(&mut self, f: &FileState, mut op: impl FnMut(&mut BTreeSet<PathBuf>)) {
        for k in f.objects.keys() {
            op(&mut self.keys.entry(k.clone()).or_default().valid);
        }
        for k in &f.invalid {
            op(&mut self.keys.entry(k.clone()).or_default().invalid);
        }
        for k in &f.held {
            op(&mut self.keys.entry(k.clone()).or_default().held);
        }
        if f.keys_unknown() {
            op(&mut self.unknown);
        }
        if f.unreadable {
            op(&mut self.unreadable);
        }
        if !f.broken && !f.unidentified.is_empty() {
            op(&mut self.unidentified);
        }
        if !f.invalid.is_empty() {
            op(&mut self.invalid);
        }
    }
}

/// The positions of a file just read (`identities`, in file order), given what the previous
/// read found (`before`). An unidentifiable document holds what its position named before:
/// matched by position when the file holds as many objects as before; otherwise (documents
/// added or removed in the same edit, so positions cannot be trusted) every unidentifiable
/// document holds every object the file named before and names no more.
fn slots(identities: Vec<Identity>, before: Option<&FileState>) -> Vec<Slot> {
    // A file never parsed before: what it held is unknown.
    let previous = before
        .filter(|b| !(b.broken && b.slots.is_empty()))
        .map(|b| b.slots.as_slice());
    let named_now: BTreeSet<ResourceKey> = identities
        .iter()
        .filter_map(|i| match i {
            Identity::Object(k) => Some(k.clone()),
            _ => None,
        })
        .collect();
    let held_by = |slot: &Slot| -> (BTreeSet<ResourceKey>, bool) {
        match slot {
            Slot::Named(k) => (k.iter().cloned().collect(), false),
            Slot::Unidentified(h) => (h.keys.clone(), h.unknown),
        }
    };
    let same_positions = previous.is_some_and(|p| p.len() == identities.len());
    // Positions moved: everything the file named or held before, computed once.
    let all_before = (!same_positions).then(|| {
        let mut all = (BTreeSet::new(), false);
        for s in previous.unwrap_or_default() {
            let (keys, unknown) = held_by(s);
            all.0.extend(keys);
            all.1 |= unknown;
        }
        all
    });
    identities
        .into_iter()
        .enumerate()
        .map(|(i, identity)| match identity {
            Identity::Object(k) => Slot::Named(Some(k)),
            Identity::Ignored => Slot::Named(None),
            Identity::Unidentified { document, reason } => {
                let (mut keys, unknown) = match previous {
                    None => (BTreeSet::new(), true),
                    Some(p) if same_positions => held_by(&p[i]),
                    Some(_) => all_before.clone().unwrap_or_default(),
                };
                keys.retain(|k| !named_now.contains(k));
                Slot::Unidentified(Holds {
                    document,
                    reason,
                    keys,
                    unknown,
                })
            }
        })
        .collect()
}

fn read_file(path: &std::path::Path, before: Option<&FileState>) -> FileState {
    let mut report = manifest_dir::Report::default();
    manifest_dir::load_file(path, &mut report);
    let broken = !report.broken.is_empty();
    let mut state = FileState {
        objects: report
            .resources
            .into_iter()
            .map(|(k, (_, r))| (k, r))
            .collect(),
        invalid: report.invalid.into_keys().collect(),
        broken,
        unreadable: broken,
        problems: report.problems.iter().map(ToString::to_string).collect(),
        rejected: report.rejected,
        ..FileState::default()
    };
    // Unparseable: the positions of the last parse stay, for when it parses again.
    state.set_slots(if broken {
        before.map(|b| b.slots.clone()).unwrap_or_default()
    } else {
        slots(report.identities, before)
    });
    // An editor that truncates and then writes shows an empty file for a moment: emptying a
    // file is not how objects are deleted (remove the file, or the objects from it).
    if let Some(old) = before
        && (old.broken || old.slots.iter().any(|s| *s != Slot::Named(None)))
        && state.objects.is_empty()
        && state.invalid.is_empty()
        && !state.broken
        && report.objects == 0
        && report.ignored == 0
    {
        state.broken = true;
        state.set_slots(old.slots.clone());
        state.problems.push(format!(
            "{}: the file is empty; the objects it held stay until it has content again or is removed",
            path.display()
        ));
    }
    if !state.broken {
        let mut notes = Vec::new();
        for h in &state.unidentified {
            let held = if h.unknown {
                "what it named before is not known (read for the first time): the objects no \
                 readable file defines keep their last good versions"
                    .to_string()
            } else if h.keys.is_empty() {
                "it named nothing before: nothing of it is in force".to_string()
            } else {
                let keys: Vec<String> = h.keys.iter().map(ToString::to_string).collect();
                format!(
                    "what it named before keeps its last good version: {}",
                    keys.join(", ")
                )
            };
            let message = format!(
                "{}: document {}: cannot be identified ({}); until it can be, or the file is removed, {held}",
                path.display(),
                h.document,
                h.reason
            );
            notes.push(calc_graph::untrusted::clip(message, 4096));
        }
        state.problems.extend(notes);
    }
    state
}

/// The watcher's state: every file's contents and what is in force.
struct Watcher {
    dir: PathBuf,
    /// Directories never read as manifests: the server's status and last-good directories.
    skip: Vec<PathBuf>,
    files: BTreeMap<PathBuf, FileState>,
    /// Which files say what of each key; which files have problems.
    index: Index,
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
    /// `None` for `serve`: new problems are logged. `Some` for a one-shot read (`compute`,
    /// `explain`): they are collected here, in order, and nothing is logged.
    collected: Option<Vec<String>>,
}

impl Watcher {
    /// A watcher over `dir` (never entering `skip`) starting from `current`, what the
    /// last-good store holds (what a previous run had in force).
    fn new(
        dir: PathBuf,
        skip: Vec<PathBuf>,
        current: BTreeMap<ResourceKey, Valid>,
        store: std::sync::mpsc::Sender<Vec<StoreOp>>,
        health: Health,
    ) -> Watcher {
        Watcher {
            dir,
            skip,
            files: BTreeMap::new(),
            index: Index::default(),
            current,
            store,
            to_store: Vec::new(),
            walk_problems: BTreeSet::new(),
            duplicates: BTreeMap::new(),
            held: BTreeSet::new(),
            origin: BTreeMap::new(),
            health,
            collected: None,
        }
    }

    /// Logs a new problem (`what`: where it was found), or collects it.
    fn warn(&mut self, what: &'static str, problem: String) {
        match &mut self.collected {
            Some(all) => all.push(problem),
            None => tracing::warn!(problem = %problem, "{what}"),
        }
    }

    /// Reads the whole directory and puts in force what the rules say, as at start: the
    /// listing read and the directories walked.
    fn load(&mut self) -> (Listing, Vec<PathBuf>) {
        let (seen, dirs) = self.listing();
        let files: Vec<PathBuf> = seen.keys().cloned().collect();
        self.read(&files, &[]);
        let mut keys: BTreeSet<ResourceKey> = self.current.keys().cloned().collect();
        self.keys_of(&files, &mut keys);
        self.reconcile(keys);
        (seen, dirs)
    }

    /// The manifest files with their stamps, and the directories walked; logs new problems.
    fn listing(&mut self) -> (Listing, Vec<PathBuf>) {
        let walk = manifest_dir::walk_skipping(&self.dir, &self.skip);
        let now: BTreeSet<String> = walk.problems.iter().map(ToString::to_string).collect();
        for p in walk.problems.iter().map(ToString::to_string) {
            if !self.walk_problems.contains(&p) {
                self.warn("manifest directory", p);
            }
        }
        self.walk_problems = now;
        (walk.files.into_iter().collect(), walk.dirs)
    }

    /// Reads `changed` files, forgets `gone` ones and reconciles their keys: the updates to
    /// send.
    fn apply(&mut self, changed: &[PathBuf], gone: &[PathBuf]) -> Vec<Update> {
        let mut keys = BTreeSet::new();
        self.keys_of(changed, &mut keys);
        self.keys_of(gone, &mut keys);
        self.read(changed, gone);
        self.keys_of(changed, &mut keys);
        self.reconcile(keys)
    }

    /// Reads `changed` files and forgets `gone` ones; logs new problems.
    fn read(&mut self, changed: &[PathBuf], gone: &[PathBuf]) {
        for f in gone {
            if let Some(old) = self.files.remove(f) {
                self.index.remove(f, &old);
            }
        }
        for f in changed {
            let state = read_file(f, self.files.get(f));
            if let Some(old) = self.files.get(f) {
                self.index.remove(f, old);
            }
            self.index.add(f, &state);
            for stage in &state.rejected {
                self.health.rejections.count(*stage);
            }
            let before: BTreeSet<&String> = self
                .files
                .get(f)
                .map(|s| s.problems.iter().collect())
                .unwrap_or_default();
            let new: Vec<String> = state
                .problems
                .iter()
                .filter(|p| !before.contains(p))
                .cloned()
                .collect();
            for p in new {
                self.warn("manifest skipped", p);
            }
            self.files.insert(f.clone(), state);
        }
    }

    /// What rule applies to `key` now: the version to put in force, if any.
    fn desired(&self, key: &ResourceKey, any_broken: bool) -> Desired {
        let (mut invalid, mut held_by_document) = (false, false);
        if let Some(kf) = self.index.keys.get(key) {
            let winner = kf
                .valid
                .last()
                .and_then(|p| self.files.get(p))
                .and_then(|f| f.objects.get(key));
            if let Some(r) = winner {
                return Desired::Valid(Box::new(r.clone()), kf.valid.iter().cloned().collect());
            }
            invalid = !kf.invalid.is_empty();
            held_by_document = !kf.held.is_empty();
        }
        match self.current.get(key) {
            Some(_) if invalid || held_by_document => Desired::Held,
            None if invalid => Desired::NoLastGood,
            // Only a key whose file is gone or broken (or holds a document whose previous
            // content is unknown) can still be in such a file; one that a readable file dropped
            // was deleted.
            Some(_)
                if any_broken
                    && self
                        .origin
                        .get(key)
                        .is_none_or(|o| self.files.get(o).is_none_or(FileState::keys_unknown)) =>
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
        let any_broken = !self.index.unknown.is_empty();
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
            .index
            .invalid
            .iter()
            .filter_map(|p| self.files.get(p))
            .flat_map(|f| &f.invalid)
            .filter(|k| !self.current.contains_key(*k))
            .collect();
        let held: Vec<String> = self.held.iter().map(ToString::to_string).collect();
        let mut without: Vec<String> = without.iter().map(ToString::to_string).collect();
        // Files that cannot be read or parsed: what they say now is not in force (what they
        // held before keeps its last good version, listed above when there was any).
        for path in &self.index.unreadable {
            without.push(format!(
                "{} (cannot be read or parsed)",
                calc_graph::untrusted::Untrusted(&path.display().to_string())
            ));
        }
        // Documents that cannot be identified and keep nothing in force: whatever they hold
        // is not in force (a deny among them is not enforced).
        for (path, f) in self
            .index
            .unidentified
            .iter()
            .filter_map(|p| Some((p, self.files.get(p)?)))
        {
            for h in &f.unidentified {
                if !h.keys.iter().any(|k| self.current.contains_key(k)) {
                    without.push(format!(
                        "{}: document {} (cannot be identified)",
                        calc_graph::untrusted::Untrusted(&path.display().to_string()),
                        h.document
                    ));
                }
            }
        }
        if self.collected.is_some() {
            self.health.unusable.set(held, without);
        } else {
            self.health.unusable.publish(held, without);
        }
        updates
    }

    fn report_duplicate(&mut self, key: &ResourceKey, files: Vec<PathBuf>) {
        if files.len() < 2 {
            self.duplicates.remove(key);
            return;
        }
        if self.duplicates.get(key) != Some(&files) {
            let shown: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            match &mut self.collected {
                Some(all) => all.push(format!(
                    "{key} is defined in several files ({}); the last one (in path order) is used",
                    calc_graph::untrusted::Untrusted(&shown.join(", "))
                )),
                None => {
                    tracing::warn!(object = %key, files = ?shown, "object defined in several files; the last one (in path order) is used")
                }
            }
            self.duplicates.insert(key.clone(), files);
        }
    }

    fn keys_of(&self, paths: &[PathBuf], out: &mut BTreeSet<ResourceKey>) {
        for p in paths {
            if let Some(f) = self.files.get(p) {
                out.extend(f.objects.keys().cloned());
                out.extend(f.invalid.iter().cloned());
                out.extend(f.held.iter().cloned());
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
#[allow(clippy::too_many_arguments)]
pub fn run(
    dir: PathBuf,
    skip: Vec<PathBuf>,
    last_good_dir: Option<PathBuf>,
    mode: FileWatch,
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
            while let Ok(batch) = store_rx.recv() {
                // Whatever queued while the disk was busy joins: a key changed several times
                // meanwhile is written once, at its newest version. Nothing waits on purpose:
                // a version in force is on disk as soon as the disk allows (a server killed
                // right after a change still restarts from it).
                let mut ops: BTreeMap<ResourceKey, Option<Valid>> = batch.into_iter().collect();
                while let Ok(more) = store_rx.try_recv() {
                    ops.extend(more);
                }
                for (key, version) in ops {
                    match version {
                        Some(v) => store.save(&key, &v),
                        None => store.forget(&key),
                    }
                }
            }
        });
    // What the store holds is what a previous run had in force.
    let w = Watcher::new(dir, skip, stored, store_tx, health);
    watch(w, mode, interval, &sink, stop);
    match writer {
        Ok(writer) => {
            let _ = writer.join();
        }
        Err(error) => {
            tracing::error!(%error, "cannot start the last-good store's writer; the store is not updated")
        }
    }
}

/// What a server starting now would put in force: see [`load_once`].
#[derive(Debug, Default)]
pub struct Loaded {
    /// The objects in force, by key.
    pub objects: BTreeMap<ResourceKey, Valid>,
    /// Every problem, in the order found (the walk's, then each file's in path order).
    pub problems: Vec<String>,
    /// What is held at its last good version and what is not in force, as a server's
    /// `/status/datastore` shows it.
    pub health: crate::datastore::LastGoodHealth,
}

/// Reads `dir` once (never entering `skip`) as a server starting now with the last-good store
/// `stored` would: the same rules, so an invalid object (or one in a file that does not parse,
/// or in a document that cannot be identified) is at the version `stored` holds, or not in
/// force. Logs nothing and writes nothing (`compute`, `explain`).
pub fn load_once(dir: PathBuf, skip: Vec<PathBuf>, stored: BTreeMap<ResourceKey, Valid>) -> Loaded {
    // Nothing is persisted: the receiver is dropped at once.
    let (store, _) = std::sync::mpsc::channel();
    let health = Health::default();
    let mut w = Watcher::new(dir, skip, stored, store, health.clone());
    w.collected = Some(Vec::new());
    let _ = w.load();
    Loaded {
        objects: std::mem::take(&mut w.current),
        problems: w.collected.take().unwrap_or_default(),
        health: health.unusable.get(),
    }
}

/// The watcher's loop: the first listing, then changes (inotify, else polls) until the sink
/// closes or `stop`.
fn watch(
    mut w: Watcher,
    mode: FileWatch,
    interval: Duration,
    sink: &Sink,
    stop: &CancellationToken,
) {
    let (seen, dirs) = w.load();
    let mut first: Vec<Update> = w
        .current
        .values()
        .cloned()
        .map(Update::ApplyValid)
        .collect();
    tracing::info!(dir = %w.dir.display(), objects = first.len(), held = w.held.len(), "file datastore loaded");
    first.push(Update::InSync);
    // Watched before the snapshot goes: what changes once it is sent is seen.
    let notify = match mode {
        FileWatch::Poll => None,
        FileWatch::Inotify => match Inotify::start(seen.clone(), &dirs, interval) {
            Ok(i) => Some(i),
            Err(error) => {
                tracing::warn!(%error, interval = ?interval, "inotify cannot be used; polling the file datastore directory");
                None
            }
        },
    };
    if stop.is_cancelled() || sink.blocking_send(first).is_err() {
        return;
    }
    w.persist();
    let seen = match notify {
        None => seen,
        Some(mut i) => match i.run(&mut w, sink, stop) {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, interval = ?interval, "inotify failed; polling the file datastore directory from now on");
                i.seen
            }
        },
    };
    poll(w, seen, interval, sink, stop);
}

/// The inotify watcher's state: what was read (by stamp, for listings), the paths waiting.
struct Inotify {
    n: Notifier,
    pending: Pending,
    seen: Listing,
    settle: Duration,
    next_rescan: std::time::Instant,
}

impl Inotify {
    /// Watches `dirs` (the directories of the listing `seen`), then asks for one more listing:
    /// what changed between that listing and the watches is not missed.
    fn start(seen: Listing, dirs: &[PathBuf], settle: Duration) -> Result<Inotify, NotifyError> {
        let mut n = Notifier::new()?;
        n.watch(dirs)?;
        let mut pending = Pending::default();
        pending.rescan = true;
        Ok(Inotify {
            n,
            pending,
            seen,
            settle,
            next_rescan: std::time::Instant::now() + RESCAN_EVERY,
        })
    }

    fn run(
        &mut self,
        w: &mut Watcher,
        sink: &Sink,
        stop: &CancellationToken,
    ) -> Result<(), NotifyError> {
        // The longest wait: the cancel is checked at least this often.
        const SLICE: Duration = Duration::from_millis(50);
        loop {
            if stop.is_cancelled() || sink.is_closed() {
                return Ok(());
            }
            let now = std::time::Instant::now();
            let until = self
                .pending
                .deadline(now, self.settle)
                .unwrap_or(self.next_rescan)
                .min(self.next_rescan);
            self.n
                .wait(until.saturating_duration_since(now).min(SLICE))?;
            let (updates, files) = self.step(w, std::time::Instant::now())?;
            if updates.is_empty() {
                continue;
            }
            tracing::info!(changes = updates.len(), files, "file datastore changed");
            if sink.blocking_send(updates).is_err() {
                return Ok(());
            }
            w.persist();
        }
    }

    /// Takes the events ready, lists the directory if that is due, reads what settled: the
    /// updates and how many files were read or forgotten.
    fn step(
        &mut self,
        w: &mut Watcher,
        now: std::time::Instant,
    ) -> Result<(Vec<Update>, usize), NotifyError> {
        self.n.drain(&mut self.pending, now)?;
        if now >= self.next_rescan {
            self.pending.rescan = true;
        }
        if std::mem::take(&mut self.pending.rescan) {
            self.next_rescan = now + RESCAN_EVERY;
            let (listing, dirs) = w.listing();
            // A directory that appeared since the last listing was walked before it was
            // watched: list once more to find what was created in it meanwhile.
            if self.n.watch(&dirs)? > 0 {
                self.pending.rescan = true;
            }
            for (p, stamp) in &listing {
                if self.seen.get(p) != Some(stamp) {
                    self.pending.note(p.clone(), Seen::Listed, now);
                }
            }
            for p in self.seen.keys().filter(|p| !listing.contains_key(*p)) {
                self.pending.note(p.clone(), Seen::Listed, now);
            }
        }
        let ready = self.pending.ready(now, self.settle);
        if ready.is_empty() {
            return Ok((Vec::new(), 0));
        }
        let (mut changed, mut gone) = (Vec::new(), Vec::new());
        for p in ready {
            match std::fs::metadata(&p) {
                Ok(m) if m.is_file() => {
                    self.seen.insert(p.clone(), manifest_dir::stamp(&m));
                    changed.push(p);
                }
                _ => {
                    if self.seen.remove(&p).is_some() {
                        gone.push(p);
                    }
                }
            }
        }
        let files = changed.len() + gone.len();
        Ok((w.apply(&changed, &gone), files))
    }
}

/// The polling loop: a listing every interval until the sink closes or `stop`; `seen` is what
/// was read.
fn poll(
    mut w: Watcher,
    mut seen: Listing,
    interval: Duration,
    sink: &Sink,
    stop: &CancellationToken,
) {
    // The listing of the previous poll, and for how many polls each file has kept changing.
    let mut last = seen.clone();
    let mut unsettled: BTreeMap<PathBuf, u32> = BTreeMap::new();
    loop {
        if wait(stop, interval) || sink.is_closed() {
            return;
        }
        let (now, _) = w.listing();
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
        let updates = w.apply(&changed, &gone);
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

    /// A watcher over a temporary directory, stepped by hand as `watch` steps it.
    struct Harness {
        w: Watcher,
        dir: tempfile::TempDir,
        _store: std::sync::mpsc::Receiver<Vec<StoreOp>>,
    }

    fn summary(updates: &[Update]) -> Vec<String> {
        updates
            .iter()
            .map(|u| match u {
                Update::ApplyValid(r) => format!("apply {}", r.key()),
                Update::Apply(r) => format!("apply (not validated) {}", r.key()),
                Update::Delete(k) => format!("delete {k}"),
                Update::InSync => "in-sync".into(),
            })
            .collect()
    }

    impl Harness {
        /// `files` written, then read as at start, with `stored` from the last-good store.
        fn start(files: &[(&str, &str)], stored: BTreeMap<ResourceKey, Valid>) -> Harness {
            let dir = tempfile::tempdir().unwrap();
            for (name, text) in files {
                std::fs::write(dir.path().join(name), text).unwrap();
            }
            let (store, rx) = std::sync::mpsc::channel();
            let mut w = Watcher::new(
                dir.path().to_path_buf(),
                Vec::new(),
                stored,
                store,
                Health::default(),
            );
            w.load();
            Harness { w, dir, _store: rx }
        }

        fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }

        /// The names of the objects in force.
        fn in_force(&self) -> Vec<String> {
            self.w.current.keys().map(ToString::to_string).collect()
        }

        fn step(&mut self, changed: &[PathBuf], gone: &[PathBuf]) -> Vec<String> {
            let mut keys = BTreeSet::new();
            self.w.keys_of(changed, &mut keys);
            self.w.keys_of(gone, &mut keys);
            self.w.read(changed, gone);
            self.w.keys_of(changed, &mut keys);
            summary(&self.w.reconcile(keys))
        }

        /// Writes `name` and reads it as the next poll would; the updates sent.
        fn write(&mut self, name: &str, text: &str) -> Vec<String> {
            let path = self.path(name);
            std::fs::write(&path, text).unwrap();
            self.step(&[path], &[])
        }

        fn remove(&mut self, name: &str) -> Vec<String> {
            let path = self.path(name);
            std::fs::remove_file(&path).unwrap();
            self.step(&[], &[path])
        }

        fn problems(&self, name: &str) -> Vec<String> {
            self.w.files[&self.path(name)].problems.clone()
        }
    }

    const ALLOW: &str = "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {name: allow-dns}\nspec: {selector: all(), types: [Egress], egress: [{action: Allow, protocol: UDP, destination: {ports: [53]}}]}\n";
    const DENY: &str = "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {name: deny-ssh}\nspec: {selector: all(), types: [Ingress], ingress: [{action: Deny, protocol: TCP, destination: {ports: [22]}}]}\n";

    /// The three edits that break the deny's identity, each with a word of its reason.
    fn identity_breaking_edits() -> [(&'static str, String, &'static str); 3] {
        [
            (
                "a name with a newline",
                DENY.replace("name: deny-ssh", "name: \"deny-ssh\\nx\""),
                "invalid name",
            ),
            (
                "a misspelt kind",
                DENY.replace("kind: GlobalNetworkPolicy", "kind: GlobalNetworkPolicyy"),
                "unknown kind",
            ),
            (
                "a wrong apiVersion",
                DENY.replace("projectcalico.org/v3", "projectcalico.org/v2"),
                "apiVersion",
            ),
        ]
    }

    fn two_documents(second: &str) -> String {
        format!("{ALLOW}---\n{second}")
    }

    /// An edit that breaks the identity of the deny's document (name, kind or apiVersion) is an
    /// invalid edit of the deny, not its deletion: the deny stays in force, held, named with the
    /// file, document and reason. It stays while the document stays broken (other edits of the
    /// file in between); repaired, it is applied; a document that validly names another object
    /// lets it go, as does removing the file.
    #[test]
    fn an_edit_that_breaks_a_documents_identity_keeps_what_it_named() {
        for (what, broken, reason) in identity_breaking_edits() {
            let mut h = Harness::start(&[("p.yaml", &two_documents(DENY))], BTreeMap::new());
            assert_eq!(
                h.in_force(),
                [
                    "GlobalNetworkPolicy allow-dns",
                    "GlobalNetworkPolicy deny-ssh"
                ]
            );
            assert_eq!(
                h.write("p.yaml", &two_documents(&broken)),
                Vec::<String>::new(),
                "{what}: nothing sent"
            );
            assert!(
                h.in_force()
                    .contains(&"GlobalNetworkPolicy deny-ssh".to_string())
            );
            let health = h.w.health.unusable.get();
            assert_eq!(
                health.held_last_good,
                ["GlobalNetworkPolicy deny-ssh"],
                "{what}"
            );
            assert!(health.without_last_good.is_empty(), "{what}: {health:?}");
            let problems = h.problems("p.yaml").join("\n");
            assert!(
                problems.contains("p.yaml: document 2: cannot be identified (")
                    && problems.contains(reason)
                    && problems
                        .contains("keeps its last good version: GlobalNetworkPolicy deny-ssh"),
                "{what}: {problems}"
            );
            // Another edit of the file while the document stays broken: still held.
            let allow_changed = two_documents(&broken).replace("ports: [53]", "ports: [5353]");
            assert_eq!(
                h.write("p.yaml", &allow_changed),
                ["apply GlobalNetworkPolicy allow-dns"],
                "{what}"
            );
            assert_eq!(h.w.held.len(), 1, "{what}");
            // Repaired with a change: applied.
            let repaired = DENY.replace("ports: [22]", "ports: [2222]");
            assert_eq!(
                h.write("p.yaml", &two_documents(&repaired)),
                [
                    "apply GlobalNetworkPolicy allow-dns",
                    "apply GlobalNetworkPolicy deny-ssh"
                ],
                "{what}"
            );
            assert!(h.w.held.is_empty(), "{what}");
            // Broken again, then the document names another object validly: the deny goes.
            assert!(h.write("p.yaml", &two_documents(&broken)).is_empty());
            let other = DENY.replace("name: deny-ssh", "name: deny-telnet");
            assert_eq!(
                h.write("p.yaml", &two_documents(&other)),
                [
                    "delete GlobalNetworkPolicy deny-ssh",
                    "apply GlobalNetworkPolicy deny-telnet"
                ],
                "{what}"
            );
            // Broken again, then the file removed: everything it held goes.
            let broken_telnet = broken.replace("deny-ssh", "deny-telnet");
            assert!(h.write("p.yaml", &two_documents(&broken_telnet)).is_empty());
            assert_eq!(
                h.remove("p.yaml"),
                [
                    "delete GlobalNetworkPolicy allow-dns",
                    "delete GlobalNetworkPolicy deny-telnet"
                ],
                "{what}"
            );
            assert_eq!(h.w.health.unusable.get(), Default::default(), "{what}");
        }
    }

    /// When the edit that breaks a document also adds or removes objects, positions cannot be
    /// trusted: the file's unidentifiable documents hold everything it no longer names.
    #[test]
    fn documents_added_or_removed_in_the_same_edit_keep_every_object_the_file_dropped() {
        let extra = DENY.replace("deny-ssh", "deny-ftp");
        for (what, broken, _) in identity_breaking_edits() {
            let mut h = Harness::start(&[("p.yaml", &two_documents(DENY))], BTreeMap::new());
            // A new object first: the broken deny moves from document 2 to document 3.
            let text = format!("{extra}---\n{}", two_documents(&broken));
            assert_eq!(
                h.write("p.yaml", &text),
                ["apply GlobalNetworkPolicy deny-ftp"],
                "{what}"
            );
            assert!(h.w.held.contains(&ResourceKey::new(
                calc_graph::model::Kind::GlobalNetworkPolicy,
                None,
                "deny-ssh"
            )));
            // The allow removed while the deny stays broken: which document was removed is
            // not known, so both stay until the broken one is fixed.
            let text = format!("{extra}---\n{broken}");
            assert!(h.write("p.yaml", &text).is_empty(), "{what}");
            assert_eq!(
                h.in_force(),
                [
                    "GlobalNetworkPolicy allow-dns",
                    "GlobalNetworkPolicy deny-ftp",
                    "GlobalNetworkPolicy deny-ssh"
                ],
                "{what}"
            );
            assert_eq!(
                h.w.health.unusable.get().held_last_good,
                [
                    "GlobalNetworkPolicy allow-dns",
                    "GlobalNetworkPolicy deny-ssh"
                ],
                "{what}"
            );
            // Fixed: the file says what it holds again; the allow goes.
            let text = format!("{extra}---\n{DENY}");
            assert_eq!(
                h.write("p.yaml", &text),
                ["delete GlobalNetworkPolicy allow-dns"],
                "{what}"
            );
            assert!(h.w.held.is_empty(), "{what}");
        }
    }

    /// An editor's truncate-then-write seen half done: the file reads empty (its objects
    /// stay), then holds the broken document. The positions of the last parse still count.
    #[test]
    fn an_emptied_file_then_a_broken_document_keeps_the_deny() {
        for (what, broken, _) in identity_breaking_edits() {
            let mut h = Harness::start(&[("p.yaml", &two_documents(DENY))], BTreeMap::new());
            assert!(h.write("p.yaml", "").is_empty(), "{what}");
            assert_eq!(h.w.held.len(), 2, "{what}: the emptied file keeps both");
            assert!(
                h.write("p.yaml", &two_documents(&broken)).is_empty(),
                "{what}"
            );
            assert_eq!(
                h.in_force(),
                [
                    "GlobalNetworkPolicy allow-dns",
                    "GlobalNetworkPolicy deny-ssh"
                ],
                "{what}"
            );
            assert_eq!(
                h.w.health.unusable.get().held_last_good,
                ["GlobalNetworkPolicy deny-ssh"],
                "{what}"
            );
        }
    }

    /// After a restart the previous positions are unknown: a broken document keeps what the
    /// last-good store gave that no readable file defines, until it is fixed or removed.
    #[test]
    fn after_a_restart_a_broken_document_keeps_the_stored_version() {
        for (what, broken, _) in identity_breaking_edits() {
            // What the previous run had in force, as the last-good store gives it back.
            let stored: BTreeMap<ResourceKey, Valid> =
                calc_graph::manifest::parse_manifest(&two_documents(DENY))
                    .unwrap()
                    .into_iter()
                    .map(|e| match e.outcome {
                        calc_graph::manifest::Outcome::Valid(k, v) => (k, v),
                        other => panic!("{other:?}"),
                    })
                    .collect();
            let mut h = Harness::start(&[("p.yaml", &two_documents(&broken))], stored);
            assert_eq!(
                h.in_force(),
                [
                    "GlobalNetworkPolicy allow-dns",
                    "GlobalNetworkPolicy deny-ssh"
                ],
                "{what}"
            );
            assert_eq!(
                h.w.health.unusable.get().held_last_good,
                ["GlobalNetworkPolicy deny-ssh"],
                "{what}"
            );
            // Fixed: the deny is the file's again, held no more.
            assert!(h.write("p.yaml", &two_documents(DENY)).len() <= 2);
            assert!(h.w.held.is_empty(), "{what}");
            // Removed: it goes.
            assert_eq!(
                h.remove("p.yaml"),
                [
                    "delete GlobalNetworkPolicy allow-dns",
                    "delete GlobalNetworkPolicy deny-ssh"
                ],
                "{what}"
            );
        }
    }

    /// A document that cannot be identified and held nothing is said loudly: named (file and
    /// document, escaped) among the objects without a last good version.
    #[test]
    fn a_new_unidentifiable_document_is_reported_without_a_last_good_version() {
        let mut h = Harness::start(&[("p.yaml", ALLOW)], BTreeMap::new());
        let broken = DENY.replace("kind: GlobalNetworkPolicy", "kind: GlobalNetworkPolicyy");
        assert!(h.write("p.yaml", &two_documents(&broken)).is_empty());
        let health = h.w.health.unusable.get();
        assert!(health.held_last_good.is_empty(), "{health:?}");
        assert_eq!(health.without_last_good.len(), 1, "{health:?}");
        assert!(
            health.without_last_good[0].ends_with("p.yaml: document 2 (cannot be identified)"),
            "{health:?}"
        );
        let problems = h.problems("p.yaml").join("\n");
        assert!(
            problems.contains("document 2: cannot be identified (unknown kind")
                && problems.contains("nothing of it is in force"),
            "{problems}"
        );
        // A file name with a newline cannot forge a line in what is shown.
        let name = "evil\nname.yaml";
        h.write(name, &broken);
        let health = h.w.health.unusable.get();
        assert!(
            health
                .without_last_good
                .iter()
                .any(|w| w.contains("evil\\nname.yaml: document 1")),
            "{health:?}"
        );
        assert!(health.without_last_good.iter().all(|w| !w.contains('\n')));
        // Fixed: nothing left to report.
        h.write(name, ALLOW);
        h.write("p.yaml", &two_documents(DENY));
        assert_eq!(h.w.health.unusable.get(), Default::default());
    }

    #[test]
    fn the_watcher_stops_when_cancelled_without_waiting_for_its_next_poll() {
        for mode in [FileWatch::Poll, FileWatch::Inotify] {
            // An hour between polls: only the cancel can end the wait.
            let (mut r, first) = Running::start(mode, Duration::from_secs(3600), |_| {});
            assert_eq!(first.last().map(String::as_str), Some("in-sync"));
            let cancelled = std::time::Instant::now();
            r.stop.cancel();
            r.thread.take().expect("running").join().unwrap();
            assert!(cancelled.elapsed() < Duration::from_secs(2), "{mode:?}");
            // The receiver is still there (in `r`): the cancel, not a closed sink, stopped it.
            drop(r);
        }
    }

    /// A watcher running on its own thread over a temporary directory, as `serve` runs it.
    struct Running {
        dir: tempfile::TempDir,
        rx: tokio::sync::mpsc::Receiver<Vec<Update>>,
        stop: CancellationToken,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Running {
        /// `prepare` lays out the directory; the watcher starts once it is done.
        fn start(
            mode: FileWatch,
            interval: Duration,
            prepare: impl FnOnce(&std::path::Path),
        ) -> (Running, Vec<String>) {
            let dir = tempfile::tempdir().unwrap();
            prepare(dir.path());
            let (sink, mut rx) = tokio::sync::mpsc::channel(64);
            let stop = CancellationToken::new();
            let thread = {
                let (dir, stop) = (dir.path().to_path_buf(), stop.clone());
                std::thread::spawn(move || {
                    run(
                        dir,
                        Vec::new(),
                        None,
                        mode,
                        interval,
                        sink,
                        Health::default(),
                        &stop,
                    )
                })
            };
            let first = summary(&rx.blocking_recv().expect("the initial snapshot"));
            let r = Running {
                dir,
                rx,
                stop,
                thread: Some(thread),
            };
            (r, first)
        }

        fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }

        /// The next batch sent within `within`, and how long it took.
        fn next(&mut self, within: Duration) -> Option<(Vec<String>, Duration)> {
            let t = std::time::Instant::now();
            while t.elapsed() < within {
                if let Ok(b) = self.rx.try_recv() {
                    return Some((summary(&b), t.elapsed()));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            None
        }
    }

    impl Drop for Running {
        fn drop(&mut self) {
            self.stop.cancel();
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    /// With inotify a file closed after writing or renamed into place is read at once (long
    /// before the settle time, which a poll would wait), whether created, rewritten in place or
    /// renamed in; a removal waits the settle time; a rename inside the tree is seen whole.
    #[test]
    fn inotify_reads_finished_changes_at_once_and_removals_once_settled() {
        let settle = Duration::from_millis(1500);
        let fast = Duration::from_millis(700);
        let (mut r, first) = Running::start(FileWatch::Inotify, settle, |d| {
            std::fs::create_dir(d.join("sub")).unwrap();
        });
        assert_eq!(first, ["in-sync"]);
        // Created (a plain write: create, write, close).
        std::fs::write(r.path("sub/a.yaml"), ALLOW).unwrap();
        let (b, took) = r.next(Duration::from_secs(5)).expect("the new file");
        assert_eq!(b, ["apply GlobalNetworkPolicy allow-dns"]);
        assert!(took < fast, "{took:?}");
        // Rewritten in place: truncated, written, closed.
        std::fs::write(r.path("sub/a.yaml"), ALLOW.replace("53", "5353")).unwrap();
        let (b, took) = r.next(Duration::from_secs(5)).expect("the rewrite");
        assert_eq!(b, ["apply GlobalNetworkPolicy allow-dns"]);
        assert!(took < fast, "{took:?}");
        // Written elsewhere and renamed in.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("d.yaml"), DENY).unwrap();
        std::fs::rename(outside.path().join("d.yaml"), r.path("d.yaml")).unwrap();
        let (b, took) = r.next(Duration::from_secs(5)).expect("the rename in");
        assert_eq!(b, ["apply GlobalNetworkPolicy deny-ssh"]);
        assert!(took < fast, "{took:?}");
        // Renamed inside the tree: the same objects, nothing sent (not a delete and a re-add).
        std::fs::rename(r.path("d.yaml"), r.path("sub/e.yaml")).unwrap();
        assert_eq!(r.next(settle * 2), None);
        // Removed: deleted once the removal settled.
        std::fs::remove_file(r.path("sub/e.yaml")).unwrap();
        let (b, took) = r.next(Duration::from_secs(10)).expect("the removal");
        assert_eq!(b, ["delete GlobalNetworkPolicy deny-ssh"]);
        assert!(took >= settle.mul_f64(0.9), "{took:?}");
        // A directory created with a file in it (moved in whole): found by a listing.
        let moved = outside.path().join("more");
        std::fs::create_dir(&moved).unwrap();
        std::fs::write(moved.join("f.yaml"), DENY).unwrap();
        std::fs::rename(&moved, r.path("more")).unwrap();
        let (b, _) = r
            .next(Duration::from_secs(10))
            .expect("the moved directory");
        assert_eq!(b, ["apply GlobalNetworkPolicy deny-ssh"]);
        // And a file written there afterwards is watched.
        std::fs::write(r.path("more/g.yaml"), ALLOW.replace("allow-dns", "allow-g")).unwrap();
        let (b, took) = r
            .next(Duration::from_secs(5))
            .expect("a file in the new directory");
        assert_eq!(b, ["apply GlobalNetworkPolicy allow-g"]);
        assert!(took < fast, "{took:?}");
    }

    /// A Kubernetes ConfigMap volume: every manifest links through `..data`, which the kubelet
    /// swaps to a new directory; the files themselves get no event. The swap is seen.
    #[test]
    fn inotify_follows_a_configmap_volumes_data_swap() {
        fn version(d: &std::path::Path, name: &str, port: &str) {
            std::fs::create_dir_all(d.join(name).join("sub")).unwrap();
            std::fs::write(d.join(name).join("p.yaml"), ALLOW.replace("53", port)).unwrap();
            std::fs::write(d.join(name).join("sub/q.yaml"), DENY.replace("22", port)).unwrap();
        }
        let (mut r, first) = Running::start(FileWatch::Inotify, Duration::from_millis(200), |d| {
            version(d, "..2026_11_28_1", "1");
            std::os::unix::fs::symlink("..2026_11_28_1", d.join("..data")).unwrap();
            std::os::unix::fs::symlink("..data/p.yaml", d.join("p.yaml")).unwrap();
            std::os::unix::fs::symlink("..data/sub", d.join("sub")).unwrap();
        });
        assert_eq!(
            first,
            [
                "apply GlobalNetworkPolicy allow-dns",
                "apply GlobalNetworkPolicy deny-ssh",
                "in-sync"
            ]
        );
        // The kubelet's update: a new directory, a new link, renamed over `..data`, the old
        // directory removed.
        let d = r.dir.path().to_path_buf();
        version(&d, "..2026_11_28_2", "2");
        std::os::unix::fs::symlink("..2026_11_28_2", d.join("..data_tmp")).unwrap();
        std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
        std::fs::remove_dir_all(d.join("..2026_11_28_1")).unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            let (b, _) = r
                .next(Duration::from_secs(10))
                .expect("the swapped versions");
            got.extend(b);
        }
        got.sort();
        assert_eq!(
            got,
            [
                "apply GlobalNetworkPolicy allow-dns",
                "apply GlobalNetworkPolicy deny-ssh"
            ]
        );
        // Then a change in the new version's subdirectory, through the `sub` link, is watched.
        std::fs::write(d.join("..2026_11_28_2/sub/q.yaml"), DENY.replace("22", "3")).unwrap();
        let (b, _) = r
            .next(Duration::from_secs(5))
            .expect("the edit through the link");
        assert_eq!(b, ["apply GlobalNetworkPolicy deny-ssh"]);
    }

    /// More events than the kernel queues (IN_Q_OVERFLOW): the watcher lists the directory
    /// and reads what changed meanwhile, though no event named it.
    #[test]
    fn an_inotify_queue_overflow_is_followed_by_a_listing() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _rx) = std::sync::mpsc::channel();
        let mut w = Watcher::new(
            dir.path().to_path_buf(),
            Vec::new(),
            BTreeMap::new(),
            store,
            Health::default(),
        );
        let (seen, dirs) = w.load();
        let settle = Duration::from_millis(20);
        let mut i = Inotify::start(seen, &dirs, settle).unwrap();
        let t0 = std::time::Instant::now();
        let (updates, files) = i.step(&mut w, t0).unwrap();
        assert!(updates.is_empty() && files == 0);
        assert!(i.pending.is_empty());
        let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
            .expect("/proc/sys/fs/inotify/max_queued_events")
            .trim()
            .parse()
            .unwrap();
        for n in 0..limit / 2 + 100 {
            std::fs::File::create(dir.path().join(format!("junk-{n}"))).unwrap();
        }
        // Written once the queue is full: no event names it.
        std::fs::write(dir.path().join("p.yaml"), ALLOW).unwrap();
        let t1 = std::time::Instant::now();
        let (updates, _) = i.step(&mut w, t1).unwrap();
        assert!(updates.is_empty(), "a listed change settles first");
        assert!(!i.pending.is_empty(), "the listing found p.yaml");
        let (updates, files) = i.step(&mut w, t1 + settle).unwrap();
        assert_eq!(summary(&updates), ["apply GlobalNetworkPolicy allow-dns"]);
        assert_eq!(files, 1);
    }

    /// `--file-watch poll` (and the fallback) still polls.
    #[test]
    fn the_poll_mode_reads_a_change_at_its_next_poll() {
        let (mut r, first) = Running::start(FileWatch::Poll, Duration::from_millis(50), |_| {});
        assert_eq!(first, ["in-sync"]);
        std::fs::write(r.path("a.yaml"), ALLOW).unwrap();
        let (b, _) = r.next(Duration::from_secs(5)).expect("the new file");
        assert_eq!(b, ["apply GlobalNetworkPolicy allow-dns"]);
        std::fs::remove_file(r.path("a.yaml")).unwrap();
        let (b, _) = r.next(Duration::from_secs(5)).expect("the removal");
        assert_eq!(b, ["delete GlobalNetworkPolicy allow-dns"]);
    }

    /// A file that cannot be parsed is a datastore problem like an invalid object: named among
    /// what is not in force (readiness degrades on it), counted once per read as a decode
    /// rejection, and the objects it held before keep their last good versions.
    #[test]
    fn a_file_that_cannot_be_parsed_is_reported_and_keeps_what_it_held() {
        let mut h = Harness::start(&[("p.yaml", ALLOW)], BTreeMap::new());
        // A new file, broken from the start.
        assert!(h.write("new.yaml", "a: [unclosed\n").is_empty());
        let health = h.w.health.unusable.get();
        assert!(health.held_last_good.is_empty(), "{health:?}");
        assert_eq!(health.without_last_good.len(), 1, "{health:?}");
        assert!(
            health.without_last_good[0].ends_with("new.yaml (cannot be read or parsed)"),
            "{health:?}"
        );
        assert_eq!(
            h.w.health
                .rejections
                .get(calc_graph::manifest::RejectStage::Decode),
            1
        );
        // A file that held a policy, broken: the policy is held, the file named.
        assert!(
            h.write("p.yaml", &format!("{ALLOW}  - : [unclosed\n"))
                .is_empty()
        );
        assert_eq!(h.in_force(), ["GlobalNetworkPolicy allow-dns"]);
        let health = h.w.health.unusable.get();
        assert_eq!(health.held_last_good, ["GlobalNetworkPolicy allow-dns"]);
        assert_eq!(health.without_last_good.len(), 2, "{health:?}");
        assert!(
            health.without_last_good[0].ends_with("new.yaml (cannot be read or parsed)")
                && health.without_last_good[1].ends_with("p.yaml (cannot be read or parsed)"),
            "{health:?}"
        );
        // Fixed, both: nothing left to report.
        h.write("p.yaml", ALLOW);
        h.write("new.yaml", DENY);
        assert_eq!(h.w.health.unusable.get(), Default::default());
        // An emptied file (an editor's truncate) is not a parse failure.
        assert!(h.write("new.yaml", "").is_empty());
        assert_eq!(h.w.health.unusable.get().without_last_good.len(), 0);
    }
}
