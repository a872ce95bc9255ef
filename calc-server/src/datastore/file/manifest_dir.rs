//! Reads manifests from files and directories: the IO half of the file datastore.
//!
//! Directories are walked recursively in name order; `*.yaml`, `*.yml` and `*.json` files are
//! read; hidden entries and a top-level `status/` directory (where endpoint status is written)
//! are skipped, and so are the directories the server writes to wherever they are
//! ([`walk_skipping`]: the status and last-good directories, recognised by device and inode, so
//! whatever path or link leads there). Symlinked files are followed; a symlinked directory only when it points into a
//! Kubernetes ConfigMap volume's `..data` (so `ln -s . backup` is skipped, not walked forever),
//! and a directory already on the walk is never entered twice. A file larger than
//! [`MAX_FILE_BYTES`] is not read. Every problem is collected with its file and document
//! number; good objects are kept. When two files define the same object, the later one (in path
//! order) wins and the duplicate is reported with both files. Each object's [`Identity`] is
//! kept in file order: one whose kind, apiVersion, name or namespace is missing or invalid
//! cannot be identified, and the watcher keeps in force what that position held before.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use calc_graph::manifest::{Outcome, RejectStage, parse_manifest};
use calc_graph::model::validate::FieldError;
use calc_graph::model::{DecodeError, ResourceKey, Valid};

/// One problem with its location.
#[derive(Debug)]
pub struct Problem {
    pub file: PathBuf,
    /// 1-based document number, when the problem belongs to one object.
    pub document: Option<usize>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.document {
            Some(d) => write!(f, "{}: document {d}: {}", self.file.display(), self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

/// What one object of a file says it is: its position's identity, which the watcher compares
/// across reads of the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Identity {
    /// Names this resource (valid or not).
    Object(ResourceKey),
    /// A kind the dataplane does not use (BGPPeer, a v1 Service, …): names nothing in force.
    Ignored,
    /// Does not say which object it is: not an object, no or an unknown kind, a wrong
    /// apiVersion, or a missing or invalid name or namespace. `document`: its 1-based number.
    Unidentified {
        document: usize,
        reason: Unidentified,
    },
}

/// Why an object of a file does not say which object it is. Shown bounded, with control
/// characters escaped (it quotes the file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unidentified {
    /// Not an object, no or an unknown kind, a wrong apiVersion, or no name.
    Undecodable(DecodeError),
    /// Its name or namespace is invalid: the validation errors of those fields.
    Identity(Vec<FieldError>),
}

impl fmt::Display for Unidentified {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Unidentified::Undecodable(e) => e.to_string(),
            Unidentified::Identity(errors) => errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        };
        f.write_str(&calc_graph::untrusted::clip(text, 1024))
    }
}

/// The validation errors that break an object's identity (its name or namespace is invalid:
/// whatever it names, it is not an object that can be in force); none when its identity is
/// sound.
fn identity_errors(errors: &[FieldError]) -> Vec<FieldError> {
    errors
        .iter()
        .filter(|e| e.field == "metadata.name" || e.field == "metadata.namespace")
        .cloned()
        .collect()
}

/// What loading produced.
#[derive(Debug, Default)]
pub struct Report {
    pub files: usize,
    pub objects: usize,
    pub ignored: usize,
    /// Valid resources by key, with the file each came from.
    pub resources: BTreeMap<ResourceKey, (PathBuf, Valid)>,
    /// Objects present but unusable (invalid, or a named object with a malformed field), with
    /// their file: their last good version, if one is known, stays in force.
    pub invalid: BTreeMap<ResourceKey, PathBuf>,
    /// Files that could not be read or parsed at all: which objects they hold is unknown.
    pub broken: Vec<PathBuf>,
    pub problems: Vec<Problem>,
    /// One stage per object refused (a whole unreadable file counts once, as decode).
    pub rejected: Vec<RejectStage>,
    /// Every object's identity in the order read (for a report of one file: by position).
    pub identities: Vec<Identity>,
}

/// Largest manifest file read (a ConfigMap holds at most 1 MiB; a `calicoctl get -o yaml`
/// dump of a large cluster can be tens of MiB).
pub const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// Loads every manifest under `paths`.
pub fn load(paths: &[PathBuf]) -> Report {
    let mut report = Report::default();
    for root in paths {
        let walk = walk(root);
        report.problems.extend(walk.problems);
        for (file, _) in walk.files {
            load_file(&file, &mut report);
        }
    }
    report
}

/// Whether a path is a manifest file by its extension (editor backups such as `a.yaml~` are not).
pub fn is_manifest(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml" | "json")
    )
}

/// A file found by [`walk`]: its size and modification time.
pub type Stamp = (u64, std::time::SystemTime);

/// The manifest files under a root, in path order, and what could not be walked.
#[derive(Debug, Default)]
pub struct Walk {
    pub files: Vec<(PathBuf, Stamp)>,
    /// The directories entered, root first, by the path walked (a ConfigMap's `sub` link by
    /// its own path): what an inotify watcher watches.
    pub dirs: Vec<PathBuf>,
    pub problems: Vec<Problem>,
}

/// Lists the manifest files under `root` (or `root` itself if it is a file).
pub fn walk(root: &Path) -> Walk {
    walk_skipping(root, &[])
}

/// [`walk`], never entering the directories `skip` names (the server's own output: status
/// files, last-good copies). They are recognised by device and inode, not by path, so a
/// symlink, a bind mount or a relative path leading there is skipped too; one that does not
/// exist yet is checked again at the next walk.
pub fn walk_skipping(root: &Path, skip: &[PathBuf]) -> Walk {
    let mut out = Walk::default();
    match std::fs::metadata(root) {
        Ok(m) if m.is_file() => out.files.push((root.to_path_buf(), stamp(&m))),
        Ok(m) => {
            let mut on_path = Vec::new();
            let skip: Vec<(u64, u64)> = skip
                .iter()
                .filter_map(|d| std::fs::metadata(d).ok())
                .filter(std::fs::Metadata::is_dir)
                .map(|m| dir_id(&m))
                .collect();
            let mut w = Walker {
                root,
                skip: &skip,
                on_path: &mut on_path,
                out: &mut out,
            };
            w.dir(root, &m);
        }
        Err(e) => out.problems.push(Problem {
            file: root.to_path_buf(),
            document: None,
            message: format!("cannot read: {e}"),
        }),
    }
    out
}

/// A file's [`Stamp`] from its metadata.
pub fn stamp(m: &std::fs::Metadata) -> Stamp {
    (
        m.len(),
        m.modified().unwrap_or(std::time::SystemTime::UNIX_EPOCH),
    )
}

/// A directory's identity, to notice a cycle through links.
fn dir_id(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino())
}

/// Whether a symlink to a directory is one a ConfigMap volume makes (`sub -> ..data/sub`).
fn configmap_link(link: &Path) -> bool {
    std::fs::read_link(link).is_ok_and(|target| {
        target
            .components()
            .next()
            .is_some_and(|c| c.as_os_str() == "..data")
    })
}

/// One walk's state: where it started, what it never enters, the directories being walked (a
/// link back to one is a cycle) and what it found.
struct Walker<'a> {
    root: &'a Path,
    skip: &'a [(u64, u64)],
    on_path: &'a mut Vec<(u64, u64)>,
    out: &'a mut Walk,
}

impl Walker<'_> {
    fn problem(&mut self, file: &Path, message: String) {
        self.out.problems.push(Problem {
            file: file.to_path_buf(),
            document: None,
            message,
        });
    }

    fn dir(&mut self, dir: &Path, meta: &std::fs::Metadata) {
        if self.on_path.contains(&dir_id(meta)) {
            self.problem(
                dir,
                "a link back to a directory being read (a cycle); skipped".into(),
            );
            return;
        }
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) => {
                self.problem(dir, format!("cannot read: {e}"));
                return;
            }
        };
        let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        entries.sort();
        self.on_path.push(dir_id(meta));
        self.out.dirs.push(dir.to_path_buf());
        for e in entries {
            let name = e.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.starts_with('.') || (dir == self.root && name == "status") {
                continue;
            }
            let Ok(link_meta) = std::fs::symlink_metadata(&e) else {
                continue; // Gone since the listing.
            };
            // Follow links: a ConfigMap volume's files are `name -> ..data/name`, and an update
            // swaps `..data`, which only shows through the link's target.
            let meta = match std::fs::metadata(&e) {
                Ok(m) => m,
                Err(err) => {
                    if is_manifest(&e) {
                        self.problem(&e, format!("cannot read: {err}"));
                    }
                    continue;
                }
            };
            if meta.is_dir() {
                if self.skip.contains(&dir_id(&meta)) {
                    continue; // The server's own output, never a manifest.
                }
                if link_meta.file_type().is_symlink() && !configmap_link(&e) {
                    self.problem(
                        &e,
                        "a symlinked directory; skipped (only a ConfigMap volume's ..data links are followed)".into(),
                    );
                    continue;
                }
                self.dir(&e, &meta);
            } else if meta.is_file() && is_manifest(&e) {
                self.out.files.push((e, stamp(&meta)));
            }
        }
        self.on_path.pop();
    }
}

/// Why a manifest file's text cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read: {0}")]
    Io(std::io::Error),
    #[error(
        "larger than {} MiB; not read (split it into several files)",
        MAX_FILE_BYTES / (1024 * 1024)
    )]
    TooLarge,
}

/// Reads one manifest file's text, refusing files over [`MAX_FILE_BYTES`].
pub fn read_manifest(file: &Path) -> Result<String, ReadError> {
    use std::io::Read;
    let f = std::fs::File::open(file).map_err(ReadError::Io)?;
    let mut text = String::new();
    // Read one byte past the limit to tell "exactly at the limit" from "over it", without
    // trusting a size the file may change while it is read.
    f.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(ReadError::Io)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(ReadError::TooLarge);
    }
    Ok(text)
}

/// Adds one file's objects and problems to `report`.
pub fn load_file(file: &Path, report: &mut Report) {
    report.files += 1;
    // Messages quote datastore text: bounded and escaped before they reach a log line.
    let problem = |document, message: String| Problem {
        file: file.to_path_buf(),
        document,
        message: calc_graph::untrusted::clip(message, 2048),
    };
    let text = match read_manifest(file) {
        Ok(t) => t,
        Err(e) => {
            report.problems.push(problem(None, e.to_string()));
            report.broken.push(file.to_path_buf());
            report.rejected.push(RejectStage::Decode);
            return;
        }
    };
    let entries = match parse_manifest(&text) {
        Ok(e) => e,
        Err(e) => {
            report.problems.push(problem(None, e.to_string()));
            report.broken.push(file.to_path_buf());
            report.rejected.push(RejectStage::Decode);
            return;
        }
    };
    for entry in entries {
        report.objects += 1;
        let doc = Some(entry.document);
        if let Some(stage) = entry.outcome.stage() {
            report.rejected.push(stage);
        }
        match entry.outcome {
            Outcome::Valid(key, res) => {
                report.identities.push(Identity::Object(key.clone()));
                if let Some((prev, _)) = report.resources.get(&key) {
                    report.problems.push(problem(
                        doc,
                        format!(
                            "{key} is defined again (first in {}); the later definition wins",
                            prev.display()
                        ),
                    ));
                }
                for w in res.conversion_warnings() {
                    report.problems.push(problem(
                        doc,
                        format!("{key}: {w}; the rest of the policy is in force"),
                    ));
                }
                report.resources.insert(key, (file.to_path_buf(), res));
            }
            Outcome::Ignored(..) => {
                report.ignored += 1;
                report.identities.push(Identity::Ignored);
            }
            Outcome::Undecodable(e) => {
                if let DecodeError::Field { key, .. } = &e {
                    // Named, with a malformed field: an invalid version of that object.
                    report.problems.push(problem(doc, e.to_string()));
                    report.identities.push(Identity::Object(key.clone()));
                    report.invalid.insert(key.clone(), file.to_path_buf());
                } else {
                    report.problems.push(problem(doc, e.to_string()));
                    report.identities.push(Identity::Unidentified {
                        document: entry.document,
                        reason: Unidentified::Undecodable(e),
                    });
                }
            }
            Outcome::Invalid(inv) => {
                for e in &inv.errors {
                    report
                        .problems
                        .push(problem(doc, format!("{}: {e}", inv.key)));
                }
                let broken = identity_errors(&inv.errors);
                if broken.is_empty() {
                    report.identities.push(Identity::Object(inv.key.clone()));
                    report.invalid.insert(inv.key, file.to_path_buf());
                } else {
                    // Not "an invalid version of the object named so": no such object can be.
                    report.identities.push(Identity::Unidentified {
                        document: entry.document,
                        reason: Unidentified::Identity(broken),
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each object's identity by position: only a broken kind, apiVersion, name or namespace
    /// (or a document that is no object at all) leaves it unidentified; an object with another
    /// invalid field still names itself, so its last good version is found by name.
    #[test]
    fn identities_follow_the_file_order_and_only_identity_errors_unidentify() {
        let dir = tempfile::tempdir().unwrap();
        let gnp = |name: &str, rest: &str| {
            format!(
                "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {{name: {name}}}\nspec: {{selector: all(){rest}}}\n"
            )
        };
        let docs = [
            gnp("good", ""),
            gnp("bad-selector", ", order: x"),
            gnp("\"bad\\nname\"", ""),
            gnp("typo", "").replace("GlobalNetworkPolicy", "GlobalNetworkPolicyy"),
            gnp("old", "").replace("/v3", "/v2"),
            "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nspec: {}\n".into(),
            "just text\n".into(),
            "apiVersion: projectcalico.org/v3\nkind: BGPPeer\nmetadata: {name: rr}\n".into(),
            "apiVersion: projectcalico.org/v3\nkind: NetworkPolicy\nmetadata: {name: p, namespace: \"Bad_NS\"}\nspec: {}\n".into(),
            "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkSet\nmetadata: {name: s, labels: {\"bad key!\": x}}\nspec: {}\n".into(),
        ];
        let path = dir.path().join("m.yaml");
        std::fs::write(&path, docs.join("---\n")).unwrap();
        let mut report = Report::default();
        load_file(&path, &mut report);
        let key = |name: &str| {
            Identity::Object(ResourceKey::new(
                calc_graph::model::Kind::GlobalNetworkPolicy,
                None,
                name,
            ))
        };
        let un = |document, reason: &str| (document, reason.to_string());
        let unidentified: Vec<(usize, String)> = report
            .identities
            .iter()
            .filter_map(|i| match i {
                Identity::Unidentified { document, reason } => {
                    Some((*document, reason.to_string()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(report.identities[..2], [key("good"), key("bad-selector")]);
        assert_eq!(report.identities[7], Identity::Ignored);
        assert_eq!(
            report.identities[9],
            Identity::Object(ResourceKey::new(
                calc_graph::model::Kind::GlobalNetworkSet,
                None,
                "s"
            ))
        );
        let expected = [
            un(3, "metadata.name: invalid name \"bad\\nname\""),
            un(4, "unknown kind \"GlobalNetworkPolicyy\""),
            un(5, "unsupported apiVersion \"projectcalico.org/v2\""),
            un(6, "GlobalNetworkPolicy has no metadata.name"),
            un(7, "not an object"),
            un(9, "metadata.namespace: invalid namespace \"Bad_NS\""),
        ];
        assert_eq!(unidentified.len(), expected.len(), "{unidentified:#?}");
        for ((doc, reason), (want_doc, want)) in unidentified.iter().zip(&expected) {
            assert_eq!(doc, want_doc);
            assert!(reason.starts_with(want.as_str()), "{doc}: {reason}");
            assert!(!reason.contains('\n'), "{reason}");
        }
        // The unidentified are not "invalid objects" under a made-up name.
        assert_eq!(report.invalid.len(), 2, "{:?}", report.invalid);
    }

    /// The server's own directories are never walked, by whatever path they are reached: by
    /// name, through a link, or as a ConfigMap's `..data` link.
    #[test]
    fn the_servers_own_directories_are_never_walked() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("manifests");
        let doc =
            "apiVersion: projectcalico.org/v3\nkind: Tier\nmetadata: {name: t}\nspec: {order: 1}\n";
        for d in ["zz", "lg", "..data/lg2", "policies"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
            std::fs::write(root.join(d).join("a.yaml"), doc).unwrap();
        }
        std::os::unix::fs::symlink("..data/lg2", root.join("lg2")).unwrap();
        // The status dir named through a link outside the tree, the last-good dirs by a
        // relative path and through the ConfigMap-style link.
        std::os::unix::fs::symlink(root.join("zz"), tmp.path().join("status-link")).unwrap();
        let skip = [
            tmp.path().join("status-link"),
            root.join("policies/../lg"),
            root.join("lg2"),
            tmp.path().join("not-there-yet"),
        ];
        let files: Vec<PathBuf> = walk_skipping(&root, &skip)
            .files
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        assert_eq!(files, [root.join("policies/a.yaml")]);
        // Without the list, all four are read.
        assert_eq!(walk(&root).files.len(), 4);
    }
}
