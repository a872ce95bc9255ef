//! The last-good store: the version of every object the server last put in force, kept on disk
//! so that a restart (or a replica sharing the directory) starts from it.
//!
//! Why: an invalid overwrite must never drop the enforced policy. In memory that holds until
//! the server restarts; then the invalid object's previous version is known only if it was
//! kept. The store is one append-only log, `objects.jsonl`: a line per change, either an
//! object's manifest (its version in force from then on) or `{"forget": {kind, namespace,
//! name}}` (it was deleted). A change costs one append, where a file per object cost creating
//! an inode per change (half the server's time under churn). When the log holds more than
//! twice what is live, it is rewritten with the live lines only, to a temporary file renamed
//! over it, so a crash leaves the old log or the new one. Lines are decoded and validated on
//! load like any manifest: a damaged line (a torn last write, a hand edit) is reported and
//! skipped. A store written by earlier versions (one `<hash>.json` per object) is read and
//! folded into the log at open.
//!
//! Replicas sharing the directory append to the same log; each notices another's rewrite (the
//! path names another file) and reads the new log before appending again.
//!
//! The store is an optimisation of safety, not a source of truth: the datastore wins whenever
//! it has a valid version. Without a directory (or when writing fails) it lives in memory only,
//! and the first failure is logged.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use calc_graph::manifest::{Outcome, decode_and_validate};
use calc_graph::model::validate::Invalid;
use calc_graph::model::{DecodeError, Kind, ResourceKey, Valid};
use serde_json::{Value, json};

/// The log's name in the store's directory.
const LOG: &str = "objects.jsonl";

/// Below this size the log is never rewritten: rewriting a small log saves nothing.
const MIN_REWRITE_BYTES: u64 = 1 << 20;

/// Where last-good versions are kept; see the module documentation.
#[derive(Debug)]
pub struct LastGood {
    dir: Option<PathBuf>,
    /// The log, open for appending, and what is known of it.
    log: Option<Log>,
    /// Whether a write failure was already logged.
    warned: bool,
    /// After a failure, when to try the disk again (until then versions are kept in memory
    /// only; a read-only volume is not read again at every change).
    retry_at: Option<Instant>,
}

/// How long after a write failure the store tries the disk again.
const RETRY: Duration = Duration::from_secs(10);

/// The open log: where each live object's newest line is, and how big the log is.
#[derive(Debug)]
struct Log {
    file: File,
    /// The inode the file was opened at: another at the path means another replica rewrote it.
    ino: u64,
    len: u64,
    /// Per live object, its newest line's offset and length (newline included).
    live: HashMap<ResourceKey, (u64, u64)>,
    live_bytes: u64,
    /// Byte ranges other replicas appended between this one's lines: read at the rewrite.
    foreign: Vec<(u64, u64)>,
}

/// Why a line or an entry of the store is skipped.
#[derive(Debug, thiserror::Error)]
enum EntryError {
    #[error("cannot read: {0}")]
    Read(std::io::Error),
    #[error("not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error(transparent)]
    Undecodable(DecodeError),
    #[error(transparent)]
    Invalid(Invalid),
    #[error("kind {0} is not kept")]
    NotKept(String),
    #[error("a forget record without a kind and name")]
    BadForget,
}

/// A line of the log, decoded.
// Consumed at once, one at a time: boxing would only add an allocation per line.
#[allow(clippy::large_enum_variant)]
enum Record {
    Put(ResourceKey, Valid),
    Forget(ResourceKey),
}

fn decode_object(value: Value) -> Result<(ResourceKey, Valid), EntryError> {
    match decode_and_validate(value) {
        Outcome::Valid(key, res) => Ok((key, res)),
        Outcome::Invalid(inv) => Err(EntryError::Invalid(inv)),
        Outcome::Undecodable(e) => Err(EntryError::Undecodable(e)),
        Outcome::Ignored(kind, _) => Err(EntryError::NotKept(kind)),
    }
}

fn decode_line(line: &[u8]) -> Result<Record, EntryError> {
    let mut value: Value = serde_json::from_slice(line).map_err(EntryError::NotJson)?;
    if let Some(forget) = value.as_object_mut().and_then(|o| o.remove("forget")) {
        let kind = forget
            .get("kind")
            .and_then(Value::as_str)
            .and_then(Kind::from_name);
        let name = forget.get("name").and_then(Value::as_str);
        let namespace = forget.get("namespace").and_then(Value::as_str);
        return match (kind, name) {
            (Some(kind), Some(name)) => Ok(Record::Forget(ResourceKey::new(kind, namespace, name))),
            _ => Err(EntryError::BadForget),
        };
    }
    let (key, res) = decode_object(value)?;
    Ok(Record::Put(key, res))
}

fn forget_line(key: &ResourceKey) -> Vec<u8> {
    let mut line = serde_json::to_vec(&json!({"forget": {
        "kind": key.kind.as_str(),
        "namespace": key.namespace,
        "name": key.name,
    }}))
    .unwrap_or_default();
    line.push(b'\n');
    line
}

fn put_line(res: &Valid) -> Vec<u8> {
    let mut line = serde_json::to_vec(&res.to_value()).unwrap_or_default();
    line.push(b'\n');
    line
}

/// The lines of `text`, which starts at byte `from` of the log: each line's offset in the log,
/// its length with its newline, and its body without it (`None`: a last line with no newline,
/// still being written or torn).
fn lines(text: &[u8], from: u64) -> impl Iterator<Item = (u64, u64, Option<&[u8]>)> {
    text.split_inclusive(|b| *b == b'\n')
        .scan(from, |at, line| {
            let offset = *at;
            *at += line.len() as u64;
            Some((offset, line.len() as u64, line.strip_suffix(b"\n")))
        })
}

/// What a log's text holds: the live objects (newest line wins) with where their lines are, and
/// the damaged lines as problems. A last line without its newline is a torn write: skipped.
fn replay(path: &Path, text: &[u8]) -> Replayed {
    let mut objects = BTreeMap::new();
    let mut forgotten = HashSet::new();
    let mut live = HashMap::new();
    let mut problems = Vec::new();
    for (at, len, body) in lines(text, 0) {
        let Some(body) = body else {
            problems.push(format!(
                "last-good store {}: the last line (byte {at}) is incomplete; skipped",
                path.display()
            ));
            break;
        };
        if body.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match decode_line(body) {
            Ok(Record::Put(key, res)) => {
                live.insert(key.clone(), (at, len));
                forgotten.remove(&key);
                objects.insert(key, res);
            }
            Ok(Record::Forget(key)) => {
                live.remove(&key);
                objects.remove(&key);
                forgotten.insert(key);
            }
            Err(why) => problems.push(format!(
                "last-good store {}: line at byte {at}: {why}; skipped",
                path.display()
            )),
        }
    }
    Replayed {
        objects,
        live,
        forgotten,
        problems,
    }
}

/// What a log holds; see [`replay`].
struct Replayed {
    objects: BTreeMap<ResourceKey, Valid>,
    live: HashMap<ResourceKey, (u64, u64)>,
    /// Objects whose last line is a forget.
    forgotten: HashSet<ResourceKey>,
    problems: Vec<String>,
}

/// The name a store of earlier versions kept an object under.
fn legacy_file_name(key: &ResourceKey) -> String {
    let id = calc_graph::hash::make_unique_id(
        "last-good",
        &format!(
            "{}/{}/{}",
            key.kind,
            key.namespace.as_deref().unwrap_or(""),
            key.name
        ),
    );
    // The part after "last-good:" is URL-safe base64: a safe file name.
    format!("{}.json", &id["last-good:".len()..])
}

/// A store of earlier versions: one `<hash>.json` per object. Returns the objects, the files
/// read (to remove once folded into the log) and the damaged ones as problems.
fn read_legacy(dir: &Path) -> (BTreeMap<ResourceKey, Valid>, Vec<PathBuf>, Vec<String>) {
    let mut objects = BTreeMap::new();
    let mut files = Vec::new();
    let mut problems = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            problems.push(format!(
                "last-good store {}: cannot read: {e}",
                dir.display()
            ));
            return (objects, files, problems);
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let read = std::fs::read(&path)
            .map_err(EntryError::Read)
            .and_then(|text| serde_json::from_slice(&text).map_err(EntryError::NotJson))
            .and_then(decode_object);
        match read {
            Ok((key, res)) if path.file_name() == Some(legacy_file_name(&key).as_ref()) => {
                objects.insert(key, res);
                files.push(path);
            }
            Ok((key, _)) => problems.push(format!(
                "last-good store {}: holds {key} under the wrong name; skipped",
                path.display()
            )),
            Err(why) => problems.push(format!(
                "last-good store {}: {why}; skipped",
                path.display()
            )),
        }
    }
    (objects, files, problems)
}

/// What the store in `dir` holds: the earlier versions' files, then the log over them (the log
/// is newer: files are removed once folded into it).
fn read_all(dir: &Path) -> Stored {
    let (mut objects, legacy, mut problems) = read_legacy(dir);
    let path = dir.join(LOG);
    let (mut live, mut clean) = (HashMap::new(), true);
    match std::fs::read(&path) {
        Ok(text) => {
            let log = replay(&path, &text);
            clean = log.problems.is_empty();
            problems.extend(log.problems);
            objects.retain(|k, _| !log.forgotten.contains(k));
            objects.extend(log.objects);
            live = log.live;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => problems.push(format!(
            "last-good store {}: cannot read: {e}",
            path.display()
        )),
    }
    Stored {
        objects,
        live,
        legacy,
        problems,
        clean,
    }
}

/// What a store's directory holds; see [`read_all`].
struct Stored {
    objects: BTreeMap<ResourceKey, Valid>,
    /// Where the log's live lines are.
    live: HashMap<ResourceKey, (u64, u64)>,
    /// Earlier versions' files read.
    legacy: Vec<PathBuf>,
    problems: Vec<String>,
    /// The log has no damaged line.
    clean: bool,
}

impl LastGood {
    /// Opens (creating it) the store in `dir` and reads what it holds; `None` keeps nothing on
    /// disk. Problems (unreadable directory, damaged lines) are returned, not fatal.
    pub fn open(dir: Option<PathBuf>) -> (LastGood, BTreeMap<ResourceKey, Valid>, Vec<String>) {
        let mut store = LastGood {
            dir: None,
            log: None,
            warned: false,
            retry_at: None,
        };
        let Some(dir) = dir else {
            return (store, BTreeMap::new(), Vec::new());
        };
        if let Err(e) = std::fs::create_dir_all(&dir) {
            store.warned = true;
            let problem = format!(
                "last-good store {}: cannot create: {e}; last good versions are kept in memory only",
                dir.display()
            );
            return (store, BTreeMap::new(), vec![problem]);
        }
        store.dir = Some(dir);
        let (objects, problems) = store.load();
        (store, objects, problems)
    }

    /// What the store in `dir` holds, without creating or changing anything (`compute` and
    /// `explain` read a server's store this way). Damaged entries are reported and skipped.
    pub fn read(dir: &Path) -> (BTreeMap<ResourceKey, Valid>, Vec<String>) {
        let stored = read_all(dir);
        (stored.objects, stored.problems)
    }

    /// Reads the store and opens its log for appending; a log that is damaged, or a store of
    /// earlier versions, is rewritten first (appending after a torn line would join the two).
    fn load(&mut self) -> (BTreeMap<ResourceKey, Valid>, Vec<String>) {
        let Some(dir) = self.dir.clone() else {
            return Default::default();
        };
        let stored = read_all(&dir);
        self.log = None;
        let opened = if stored.clean && stored.legacy.is_empty() {
            self.open_log(stored.live)
        } else {
            self.rewrite_from(&stored.objects)
        };
        match opened {
            Ok(()) => {
                for path in stored.legacy {
                    let _ = std::fs::remove_file(path);
                }
            }
            Err(e) => self.failed(&e, &dir.join(LOG)),
        }
        (stored.objects, stored.problems)
    }

    fn open_log(&mut self, live: HashMap<ResourceKey, (u64, u64)>) -> std::io::Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(LOG))?;
        let meta = file.metadata()?;
        let live_bytes = live.values().map(|(_, len)| len).sum();
        self.retry_at = None;
        self.log = Some(Log {
            file,
            ino: meta.ino(),
            len: meta.len(),
            live,
            live_bytes,
            foreign: Vec::new(),
        });
        Ok(())
    }

    /// Writes a log holding `objects` only and puts it in place of the current one.
    fn rewrite_from(&mut self, objects: &BTreeMap<ResourceKey, Valid>) -> std::io::Result<()> {
        let Some(dir) = self.dir.clone() else {
            return Ok(());
        };
        let mut text = Vec::new();
        let mut live = HashMap::with_capacity(objects.len());
        for (key, res) in objects {
            let line = put_line(res);
            live.insert(key.clone(), (text.len() as u64, line.len() as u64));
            text.extend_from_slice(&line);
        }
        self.install(&dir, &text)?;
        self.open_log(live)
    }

    /// `text` as the log: written aside, then renamed over it.
    fn install(&mut self, dir: &Path, text: &[u8]) -> std::io::Result<()> {
        self.log = None;
        let tmp = dir.join(format!(".{LOG}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, dir.join(LOG))
    }

    /// Rewrites the log with its live lines only (copied as they are, not encoded again).
    /// Lines other replicas appended are read first, so their changes are kept.
    fn compact(&mut self) -> std::io::Result<()> {
        let (Some(dir), Some(mut log)) = (self.dir.clone(), self.log.take()) else {
            return Ok(());
        };
        let path = dir.join(LOG);
        // Another replica rewrote the log since this one's last line: the offsets this one
        // holds are not that file's. Read it instead; it has just been rewritten anyway.
        if std::fs::metadata(&path)?.ino() != log.ino {
            let _ = self.load();
            return Ok(());
        }
        let old = std::fs::read(&path)?;
        if old.len() as u64 > log.len {
            log.foreign.push((log.len, old.len() as u64));
        }
        for &(from, to) in &log.foreign {
            let Some(range) = old.get(from as usize..to as usize) else {
                continue;
            };
            for (offset, len, body) in lines(range, from) {
                // A line still being written by another replica is left to it.
                let Some(body) = body else {
                    break;
                };
                let newer = |live: &HashMap<ResourceKey, (u64, u64)>, key: &ResourceKey| {
                    live.get(key).is_none_or(|(o, _)| *o < offset)
                };
                match decode_line(body) {
                    Ok(Record::Put(key, _)) if newer(&log.live, &key) => {
                        log.live.insert(key, (offset, len));
                    }
                    Ok(Record::Forget(key)) if newer(&log.live, &key) => {
                        log.live.remove(&key);
                    }
                    _ => {}
                }
            }
        }
        let mut lines: Vec<(&ResourceKey, u64, u64)> = log
            .live
            .iter()
            .map(|(k, (at, len))| (k, *at, *len))
            .collect();
        lines.sort_by_key(|(_, at, _)| *at);
        let mut text = Vec::with_capacity(log.live_bytes as usize);
        let mut live = HashMap::with_capacity(lines.len());
        for (key, at, len) in lines {
            let Some(line) = old.get(at as usize..(at + len) as usize) else {
                return Err(std::io::Error::other("the log is shorter than its index"));
            };
            live.insert(key.clone(), (text.len() as u64, len));
            text.extend_from_slice(line);
        }
        self.install(&dir, &text)?;
        self.open_log(live)
    }

    /// Appends `line` for `key` (`None`: a forget), after reading the log again if another
    /// replica rewrote it, and rewrites the log when it has grown to twice what is live.
    fn append(&mut self, key: &ResourceKey, line: Option<Vec<u8>>) {
        let Some(dir) = self.dir.clone() else { return };
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let path = dir.join(LOG);
        let replaced = match (&self.log, std::fs::metadata(&path)) {
            (Some(log), Ok(meta)) => meta.ino() != log.ino,
            _ => true,
        };
        if replaced {
            let _ = self.load();
        }
        let Some(log) = &mut self.log else { return };
        let (line, is_put) = match line {
            Some(line) => (line, true),
            None if log.live.contains_key(key) => (forget_line(key), false),
            None => return,
        };
        // With O_APPEND the line lands at the end, wherever other replicas left it.
        let end = match log
            .file
            .write_all(&line)
            .and_then(|()| log.file.stream_position())
        {
            Ok(end) => end,
            Err(e) => {
                self.failed(&e, &path);
                return;
            }
        };
        let len = line.len() as u64;
        let at = end - len;
        if at != log.len {
            log.foreign.push((log.len, at));
        }
        let previous = if is_put {
            log.live.insert(key.clone(), (at, len))
        } else {
            log.live.remove(key)
        };
        log.live_bytes =
            log.live_bytes - previous.map_or(0, |(_, l)| l) + if is_put { len } else { 0 };
        log.len = end;
        if log.len > MIN_REWRITE_BYTES.max(2 * log.live_bytes)
            && let Err(e) = self.compact()
        {
            self.failed(&e, &path);
        }
    }

    /// Records `res` as the version in force.
    pub fn save(&mut self, key: &ResourceKey, res: &Valid) {
        if self.dir.is_some() {
            self.append(key, Some(put_line(res)));
        }
    }

    /// Forgets `key` (its object was deleted from the datastore).
    pub fn forget(&mut self, key: &ResourceKey) {
        self.append(key, None);
    }

    fn failed(&mut self, error: &std::io::Error, path: &Path) {
        self.log = None;
        self.retry_at = Some(Instant::now() + RETRY);
        if !self.warned {
            self.warned = true;
            tracing::error!(%error, path = %path.display(), "cannot write the last-good store; a restart will not know the last good version of objects that are invalid then");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, selector: &str) -> (ResourceKey, Valid) {
        let text = format!(
            "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {{name: {name}}}\nspec: {{selector: \"{selector}\", ingress: [{{action: Deny}}]}}\n"
        );
        match calc_graph::manifest::parse_manifest(&text)
            .unwrap()
            .remove(0)
            .outcome
        {
            Outcome::Valid(k, r) => (k, r),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn versions_survive_a_reopen_and_deletions_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let store_dir = dir.path().join("last-good");
        let (mut store, loaded, problems) = LastGood::open(Some(store_dir.clone()));
        assert!(loaded.is_empty() && problems.is_empty(), "{problems:?}");
        let (k1, p1) = policy("deny-db", "app == 'db'");
        let (k2, p2) = policy("deny-web", "app == 'web'");
        store.save(&k1, &p1);
        store.save(&k2, &p2);
        store.forget(&k2);
        // A damaged entry (a crash, a hand edit) is reported and skipped, not fatal.
        std::fs::write(store_dir.join("junk.json"), "{not json").unwrap();
        let (_, loaded, problems) = LastGood::open(Some(store_dir));
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded.get(&k1), Some(&p1));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("junk.json"), "{problems:?}");
    }

    #[test]
    fn an_unusable_directory_keeps_versions_in_memory_only() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, "").unwrap();
        let (mut store, loaded, problems) = LastGood::open(Some(file.join("sub")));
        assert!(loaded.is_empty());
        assert!(problems[0].contains("in memory only"), "{problems:?}");
        let (k, p) = policy("x", "all()");
        store.save(&k, &p); // No panic, no file.
    }

    fn log_len(dir: &Path) -> u64 {
        std::fs::metadata(dir.join(LOG)).map_or(0, |m| m.len())
    }

    /// A change is one appended line, and the log is rewritten with what is live once it has
    /// grown past twice that: it stays bounded however often objects change.
    #[test]
    fn the_log_is_bounded_and_keeps_the_newest_version() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = LastGood::open(Some(dir.path().to_path_buf()));
        let (gone, p) = policy("gone", "all()");
        store.save(&gone, &p);
        let versions: Vec<_> = (0..30)
            .map(|i| policy(&format!("p{}", i % 10), &format!("app == 'v{i}'")))
            .collect();
        let mut largest = 0;
        for (k, p) in versions.iter().cycle().take(12_000) {
            store.save(k, p);
            largest = largest.max(log_len(dir.path()));
        }
        store.forget(&gone);
        assert!(
            largest > 0 && largest <= MIN_REWRITE_BYTES + 4096,
            "{largest}"
        );
        drop(store);
        let (_, loaded, problems) = LastGood::open(Some(dir.path().to_path_buf()));
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(loaded.len(), 10);
        for (k, p) in &versions[20..] {
            assert_eq!(loaded.get(k), Some(p), "{k}");
        }
        assert_eq!(LastGood::read(dir.path()).0, loaded);
    }

    /// A write cut short (the machine lost power) leaves a last line without its newline: it is
    /// reported and skipped, the lines before it stand, and the log is rewritten before
    /// anything is appended after it.
    #[test]
    fn a_torn_last_line_is_skipped_and_not_appended_to() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = LastGood::open(Some(dir.path().to_path_buf()));
        let (k1, p1) = policy("a", "all()");
        store.save(&k1, &p1);
        drop(store);
        let mut log = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join(LOG))
            .unwrap();
        log.write_all(b"{\"apiVersion\":\"projectcalico.org/v3\",\"ki")
            .unwrap();
        drop(log);
        let (mut store, loaded, problems) = LastGood::open(Some(dir.path().to_path_buf()));
        assert_eq!(loaded.get(&k1), Some(&p1));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("incomplete"), "{problems:?}");
        let (k2, p2) = policy("b", "has(x)");
        store.save(&k2, &p2);
        let (_, loaded, problems) = LastGood::open(Some(dir.path().to_path_buf()));
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded.get(&k2), Some(&p2));
    }

    /// A store written by an earlier version (a file per object) is read, folded into the log
    /// and its files removed; a forget in the log ends an object whose file remains.
    #[test]
    fn a_store_of_files_is_folded_into_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let (k1, p1) = policy("old-a", "all()");
        let (k2, p2) = policy("old-b", "has(y)");
        for (k, p) in [(&k1, &p1), (&k2, &p2)] {
            std::fs::write(dir.path().join(legacy_file_name(k)), put_line(p)).unwrap();
        }
        std::fs::write(dir.path().join(LOG), forget_line(&k2)).unwrap();
        let (_, loaded, problems) = LastGood::open(Some(dir.path().to_path_buf()));
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded.get(&k1), Some(&p1));
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, [std::ffi::OsString::from(LOG)]);
        assert_eq!(LastGood::read(dir.path()).0, loaded);
    }

    /// Two replicas sharing the directory: when one rewrites the log, the other's next change
    /// goes into the new log, not into the file the rename replaced.
    #[test]
    fn replicas_sharing_the_store_keep_each_others_changes() {
        let dir = tempfile::tempdir().unwrap();
        let (mut a, _, _) = LastGood::open(Some(dir.path().to_path_buf()));
        let (mut b, _, _) = LastGood::open(Some(dir.path().to_path_buf()));
        let (kb, pb) = policy("from-b", "all()");
        b.save(&kb, &pb);
        // Enough changes from a to make it rewrite the log.
        let (ka, pa) = policy("from-a", "app == 'a'");
        for _ in 0..12_000 {
            a.save(&ka, &pa);
        }
        let (kb2, pb2) = policy("from-b-later", "has(z)");
        b.save(&kb2, &pb2);
        let (loaded, problems) = LastGood::read(dir.path());
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(loaded.get(&kb), Some(&pb));
        assert_eq!(loaded.get(&kb2), Some(&pb2));
        assert_eq!(loaded.len(), 3);
    }
}
