//! The file datastore: a directory of Calico v3 manifests (YAML or JSON), the embedded default.
//!
//! - [`manifest_dir`]: walking the directory and reading manifests (symlink and size limits).
//! - [`watch`]: the watcher `serve` runs on a blocking thread (inotify, or polling); objects
//!   are identified across files, and an invalid one keeps its last good version.
//! - [`notify`]: the inotify source: a watch per directory, events to the paths to read.
//! - [`last_good`]: the on-disk last-good store, so that a restart keeps that version too.
//! - [`status`]: the status writer (`<node>.json` per node).
//!
//! Thin (architecture invariant 2): files are read here, meaning and validation stay in
//! `calc-graph`.

pub mod last_good;
pub mod manifest_dir;
pub mod notify;
pub mod status;
pub mod watch;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use calc_graph::graph::Update;
use calc_graph::untrusted::Untrusted;
use common::Tasks;

use super::{Health, Sink, Snapshot};
use crate::args::ServeArgs;
use crate::status::Board;

/// Starts the watcher (into `sink`) and the status-file writer; fails if the directory
/// is missing or the status or last-good directory is inside it (see [`OutputDirs::check`]).
pub(super) fn start(
    args: &ServeArgs,
    board: Arc<Board>,
    health: Health,
    sink: Sink,
    tasks: &Tasks,
) -> anyhow::Result<String> {
    let dir = args.datastore.file_dir.clone();
    check_file_dir(&dir)?;
    let dirs = OutputDirs::check(
        &dir,
        args.status_dir.as_deref(),
        args.last_good_dir.as_deref(),
    )?;
    let interval = args.file_poll_interval;
    let mode = args.file_watch;
    let watched = dir.clone();
    let skip = dirs.skipped();
    let last_good = dirs.last_good.clone();
    let span = tracing::info_span!("datastore", "type" = "file");
    // Reading and parsing files is blocking work: its own thread, off the runtime. It checks
    // the token between polls (and while waiting for the next one) and stops once cancelled.
    tasks.spawn_blocking(
        tracing::info_span!(parent: &span, "file_watch"),
        move |stop| {
            watch::run(
                watched, skip, last_good, mode, interval, sink, health, &stop,
            )
        },
    );
    if let Some(status_dir) = dirs.status {
        tasks.spawn(
            tracing::info_span!(parent: &span, "status_writer"),
            status::file_writer(board, status_dir, args.status_interval),
        );
    }
    Ok(dir.display().to_string())
}

/// Where the server writes beside the file datastore: the status directory (`None`: no status
/// files) and the last-good store (`None`: kept in memory only). Never read as manifests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutputDirs {
    pub status: Option<PathBuf>,
    pub last_good: Option<PathBuf>,
}

impl OutputDirs {
    /// `--status-dir` and `--last-good-dir` for the datastore directory `file_dir`, with their
    /// defaults (`<file-dir>/status`, `<status-dir>/last-good`; an empty value: none).
    ///
    /// Refused: a status directory inside `file_dir` other than its `status`, and a last-good
    /// directory inside `file_dir` but not inside its `status`. The manifest walk skips only
    /// `status` by name; anything else there would be read back as manifests, and an old
    /// last-good copy could win over the operator's edit. Paths are compared resolved
    /// (absolute, symlinks followed as far as the path exists), so `D/zz`, `./D/zz` and a link
    /// into `D` are all seen inside `D`.
    pub fn check(
        file_dir: &Path,
        status_flag: Option<&Path>,
        last_good_flag: Option<&Path>,
    ) -> anyhow::Result<OutputDirs> {
        let root = resolve(file_dir);
        let skipped = root.join("status");
        let status = match status_flag {
            Some(d) if d.as_os_str().is_empty() => None,
            Some(d) => {
                let abs = resolve(d);
                anyhow::ensure!(
                    !abs.starts_with(&root) || abs == skipped,
                    "--status-dir {} is inside --file-dir {} (as {}): the server would read its \
                     own status files back as manifests. Only `{}` (the default) is skipped; \
                     choose a directory outside --file-dir",
                    d.display(),
                    file_dir.display(),
                    abs.display(),
                    file_dir.join("status").display()
                );
                Some(d.to_path_buf())
            }
            None => Some(file_dir.join("status")),
        };
        let last_good = match last_good_flag {
            Some(d) if d.as_os_str().is_empty() => None,
            Some(d) => {
                let abs = resolve(d);
                anyhow::ensure!(
                    !abs.starts_with(&root) || abs.starts_with(&skipped),
                    "--last-good-dir {} is inside --file-dir {} (as {}): the server would read \
                     its own last-good copies back as manifests, and an old copy would win over \
                     an edit. Only `{}` (the default status directory) is skipped; choose a \
                     directory outside --file-dir",
                    d.display(),
                    file_dir.display(),
                    abs.display(),
                    file_dir.join("status").display()
                );
                Some(d.to_path_buf())
            }
            None => status.as_ref().map(|s| s.join("last-good")),
        };
        Ok(OutputDirs { status, last_good })
    }

    /// The directories the manifest walk must never enter, whatever their paths.
    pub fn skipped(&self) -> Vec<PathBuf> {
        self.status.iter().chain(&self.last_good).cloned().collect()
    }
}

/// `p` as an absolute path with symlinks resolved as far as it exists; the part that does not
/// exist yet is appended as written (`.` dropped, `..` taken lexically: nothing there can be a
/// link).
pub fn resolve(p: &Path) -> PathBuf {
    use std::path::Component;
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(p))
            .unwrap_or_else(|_| p.to_path_buf())
    };
    let parts: Vec<Component<'_>> = abs.components().collect();
    for n in (1..=parts.len()).rev() {
        let prefix: PathBuf = parts[..n].iter().collect();
        if let Ok(mut out) = std::fs::canonicalize(&prefix) {
            for c in &parts[n..] {
                match c {
                    Component::ParentDir => {
                        out.pop();
                    }
                    Component::CurDir => {}
                    other => out.push(other),
                }
            }
            return out;
        }
    }
    abs
}

/// The file datastore's directory must exist: a typo would otherwise read as an empty cluster
/// (no policy anywhere) rather than as an error.
pub fn check_file_dir(dir: &Path) -> anyhow::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    // The built-in default is relative: from another directory it names nothing, and the user
    // never typed the flag the message would otherwise name.
    if dir == Path::new(crate::args::DEFAULT_FILE_DIR) {
        let cwd = std::env::current_dir()
            .map(|d| d.display().to_string())
            .unwrap_or_else(|_| "the current directory".into());
        anyhow::bail!(
            "no datastore given, and the default file datastore {} (relative to {cwd}) does not \
             exist: give --file-dir DIR (or CALC_SERVER_FILE_DIR) with the directory of \
             manifests, or --datastore-type etcdv3|kubernetes",
            dir.display()
        );
    }
    anyhow::bail!(
        "--file-dir {} is not a directory: give the directory holding the manifests",
        dir.display()
    )
}

/// What a server starting now would put in force from `dir`, as `Apply`s then `InSync`;
/// problems by file. The server's last-good store (`dirs.last_good`) is read, never written:
/// an object whose manifest is not usable is at the last good version found there (said in
/// `held`). Without a store, `caveats` names what is left out that a running server may hold.
pub fn snapshot(dir: &Path, dirs: &OutputDirs) -> anyhow::Result<Snapshot> {
    check_file_dir(dir)?;
    let store = dirs.last_good.as_ref().filter(|d| d.is_dir());
    let (stored, store_problems) = match store {
        Some(d) => last_good::LastGood::read(d),
        None => Default::default(),
    };
    let loaded = watch::load_once(dir.to_path_buf(), dirs.skipped(), stored);
    let mut snap = Snapshot {
        problems: loaded.problems,
        ..Snapshot::default()
    };
    snap.problems.extend(store_problems);
    let health = loaded.health;
    match store {
        Some(d) => {
            let d = Untrusted(&d.display().to_string()).to_string();
            for held in &health.held_last_good {
                snap.held.push(format!(
                    "{held}: what the manifests hold of it is not usable; its last good version \
                     from the last-good store {d} is used, as a server with that store keeps it \
                     in force"
                ));
            }
            for without in &health.without_last_good {
                snap.held.push(format!(
                    "{without}: not in force: not usable, and no last good version in the \
                     last-good store {d}"
                ));
            }
        }
        None if !health.without_last_good.is_empty() => {
            let where_ = match &dirs.last_good {
                Some(d) => format!(
                    "no last-good store at {} (serve's --last-good-dir, by default \
                     <status-dir>/last-good)",
                    Untrusted(&d.display().to_string())
                ),
                None => "no last-good store is read (--last-good-dir or --status-dir is empty)"
                    .to_string(),
            };
            snap.caveats.push(format!(
                "{where_}: these invalid objects are left out here, but a running server may \
                 keep older (last good) versions of them in force: {}",
                crate::datastore::listed(&health.without_last_good)
            ));
        }
        None => {}
    }
    snap.updates = loaded
        .objects
        .into_values()
        .map(Update::ApplyValid)
        .collect();
    snap.updates.push(Update::InSync);
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server's own directories stay out of the manifests: inside --file-dir only its
    /// `status` is accepted, however the path is written (relative, `..`, through a link).
    #[test]
    fn the_status_and_last_good_dirs_stay_out_of_the_manifests() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("manifests");
        std::fs::create_dir_all(root.join("policies")).unwrap();
        let outside = tmp.path().join("run");
        let check = |status: Option<&Path>, last_good: Option<&Path>| {
            OutputDirs::check(&root, status, last_good)
        };
        assert_eq!(
            check(None, None).unwrap(),
            OutputDirs {
                status: Some(root.join("status")),
                last_good: Some(root.join("status/last-good")),
            }
        );
        assert_eq!(
            check(Some(Path::new("")), None).unwrap(),
            OutputDirs::default()
        );
        assert_eq!(
            check(Some(&outside), Some(Path::new(""))).unwrap(),
            OutputDirs {
                status: Some(outside.clone()),
                last_good: None,
            }
        );
        assert_eq!(
            check(Some(&root.join("status")), None).unwrap().status,
            Some(root.join("status"))
        );
        assert!(check(None, Some(&root.join("status/lg"))).is_ok());
        assert!(check(None, Some(&outside.join("lg"))).is_ok());
        // A link outside that points inside is inside.
        std::os::unix::fs::symlink(&root, tmp.path().join("link")).unwrap();
        let sneaky = [
            root.join("policies"),
            root.join("zz"),
            root.join("zz/../yy"),
            root.clone(),
            tmp.path().join("link/zz"),
            root.join("status/../zz"),
        ];
        for dir in &sneaky {
            let err = check(Some(dir), None).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!(
                    "--status-dir {} is inside --file-dir",
                    dir.display()
                )),
                "{err}"
            );
            let err = check(None, Some(dir)).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!(
                    "--last-good-dir {} is inside --file-dir",
                    dir.display()
                )),
                "{err}"
            );
        }
        // Refused too when the default last-good dir would be inside: it follows --status-dir.
        assert!(check(Some(&root.join("zz")), None).is_err());
    }

    #[test]
    fn resolve_follows_what_exists_and_appends_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let real = std::fs::canonicalize(tmp.path()).unwrap();
        std::fs::create_dir(real.join("a")).unwrap();
        std::os::unix::fs::symlink(real.join("a"), real.join("l")).unwrap();
        assert_eq!(resolve(&real.join("l/x/./y/../z")), real.join("a/x/z"));
        assert_eq!(resolve(&real.join("l/..")), real.clone());
    }
}
