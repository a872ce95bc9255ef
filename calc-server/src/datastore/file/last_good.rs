//! The last-good store: the version of every object the server last put in force, kept on disk
//! so that a restart (or a replica sharing the directory) starts from it.
//!
//! Why: an invalid overwrite must never drop the enforced policy. In memory that holds until
//! the server restarts; then the invalid object's previous version is known only if it was
//! kept. Each object is one JSON manifest (`<hash of kind/namespace/name>.json`, written to a
//! temporary file and renamed, so a crash never leaves half a file). Entries are decoded and
//! validated on load like any manifest: a damaged entry is reported and skipped.
//!
//! The store is an optimisation of safety, not a source of truth: the datastore wins whenever
//! it has a valid version. Without a directory (or when writing fails) it lives in memory only,
//! and the first failure is logged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use calc_graph::manifest::{Outcome, decode_and_validate};
use calc_graph::model::validate::Invalid;
use calc_graph::model::{DecodeError, ResourceKey, Valid};

/// Where last-good versions are kept; see the module documentation.
#[derive(Debug)]
pub struct LastGood {
    dir: Option<PathBuf>,
    /// Whether a write failure was already logged.
    warned: bool,
}

fn file_name(key: &ResourceKey) -> String {
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

impl LastGood {
    /// Opens (creating it) the store in `dir` and reads what it holds; `None` keeps nothing on
    /// disk. Problems (unreadable directory, damaged entries) are returned, not fatal.
    pub fn open(dir: Option<PathBuf>) -> (LastGood, BTreeMap<ResourceKey, Valid>, Vec<String>) {
        let objects = BTreeMap::new();
        let mut problems = Vec::new();
        let Some(dir) = dir else {
            return (
                LastGood {
                    dir: None,
                    warned: false,
                },
                objects,
                problems,
            );
        };
        if let Err(e) = std::fs::create_dir_all(&dir) {
            problems.push(format!(
                "last-good store {}: cannot create: {e}; last good versions are kept in memory only",
                dir.display()
            ));
            return (
                LastGood {
                    dir: None,
                    warned: true,
                },
                objects,
                problems,
            );
        }
        let (objects, read_problems) = Self::read(&dir);
        problems.extend(read_problems);
        (
            LastGood {
                dir: Some(dir),
                warned: false,
            },
            objects,
            problems,
        )
    }

    /// What the store in `dir` holds, without creating or changing anything (`compute` and
    /// `explain` read a server's store this way). Damaged entries are reported and skipped.
    pub fn read(dir: &Path) -> (BTreeMap<ResourceKey, Valid>, Vec<String>) {
        let mut objects = BTreeMap::new();
        let mut problems = Vec::new();
        match std::fs::read_dir(dir) {
            Ok(entries) => {
                for entry in entries.flatten() {
                    let path = entry.path();
                    if path.extension().is_none_or(|e| e != "json") {
                        continue;
                    }
                    match read_entry(&path) {
                        Ok((key, res)) if path.file_name() == Some(file_name(&key).as_ref()) => {
                            objects.insert(key, res);
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
            }
            Err(e) => problems.push(format!(
                "last-good store {}: cannot read: {e}",
                dir.display()
            )),
        }
        (objects, problems)
    }

    /// Records `res` as the version in force.
    pub fn save(&mut self, key: &ResourceKey, res: &Valid) {
        let Some(dir) = &self.dir else { return };
        let path = dir.join(file_name(key));
        let tmp = dir.join(format!(".{}.tmp", file_name(key)));
        let body = serde_json::to_vec(&res.to_value()).unwrap_or_default();
        let result = std::fs::write(&tmp, body).and_then(|()| std::fs::rename(&tmp, &path));
        self.check(result, &path);
    }

    /// Forgets `key` (its object was deleted from the datastore).
    pub fn forget(&mut self, key: &ResourceKey) {
        let Some(dir) = &self.dir else { return };
        let path = dir.join(file_name(key));
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            result => self.check(result, &path),
        }
    }

    fn check(&mut self, result: std::io::Result<()>, path: &Path) {
        if let Err(error) = result
            && !self.warned
        {
            self.warned = true;
            tracing::error!(%error, path = %path.display(), "cannot write the last-good store; a restart will not know the last good version of objects that are invalid then");
        }
    }
}

/// Why a last-good entry is skipped.
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
}

fn read_entry(path: &Path) -> Result<(ResourceKey, Valid), EntryError> {
    let text = std::fs::read(path).map_err(EntryError::Read)?;
    let value: serde_json::Value = serde_json::from_slice(&text).map_err(EntryError::NotJson)?;
    match decode_and_validate(value) {
        Outcome::Valid(key, res) => Ok((key, res)),
        Outcome::Invalid(inv) => Err(EntryError::Invalid(inv)),
        Outcome::Undecodable(e) => Err(EntryError::Undecodable(e)),
        Outcome::Ignored(kind, _) => Err(EntryError::NotKept(kind)),
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
}
