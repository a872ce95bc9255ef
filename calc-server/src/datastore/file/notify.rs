//! The file datastore's inotify source: one watch per directory the manifest walk enters, and
//! the kernel's events turned into the paths to read again, each once it is done changing.
//!
//! Only the changed paths are named: nothing lists the directory on a change. A path is read
//! - at once when the event says the change is finished: the file was closed after writing
//!   (`IN_CLOSE_WRITE`, so an editor's truncate-then-write is read whole) or renamed into place
//!   (`IN_MOVED_TO`; a rename inside the tree finishes its source too, so it is seen whole);
//! - otherwise once it has had no event for the settle time (a file written but not closed
//!   yet, a removed file, which an editor may be about to write again), or after
//!   [`UNSETTLED`] settle times of constant change.
//!
//! What inotify cannot name asks for a full listing (a *rescan*, compared by size and
//! modification time with what was read): the kernel's queue overflowed (`IN_Q_OVERFLOW`), a
//! directory appeared, went or moved (its files are not named one by one), a watched directory
//! itself went, or a name starting with `..` changed (a Kubernetes ConfigMap volume swaps its
//! `..data` link: its files change without an event of their own). Other hidden names
//! (editors' swap files) are ignored, as the walk skips them.
//!
//! Every string here comes from the filesystem: names are only joined to watched paths and
//! compared, never interpreted.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};

use super::manifest_dir::is_manifest;

/// Settle times a path that never stops changing waits before it is read anyway (as many as
/// polls do).
pub(super) const UNSETTLED: u32 = super::watch::UNSETTLED_POLLS;

/// What an event says about a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Seen {
    /// Created, written or removed: maybe not done yet.
    Unfinished,
    /// Closed after writing: done.
    Finished,
    /// Only its attributes changed (a `touch`, a `chmod`): done unless a write is under way.
    Touched,
    /// Renamed away (the cookie pairs it with its arrival, if inside the tree).
    MovedFrom(u32),
    /// Renamed into place: done, and so is the path it came from.
    MovedTo(u32),
    /// Found changed by a listing: settles like an unfinished change unless already waiting.
    Listed,
}

#[derive(Clone, Debug)]
struct Waiting {
    first: Instant,
    last: Instant,
    finished: bool,
}

/// Paths named by events, waiting until they can be read; whether a full listing is due.
#[derive(Debug, Default)]
pub(super) struct Pending {
    paths: BTreeMap<PathBuf, Waiting>,
    /// Renames away not yet paired with their arrival, by cookie.
    moved_from: HashMap<u32, PathBuf>,
    pub(super) rescan: bool,
}

impl Pending {
    pub(super) fn note(&mut self, path: PathBuf, seen: Seen, now: Instant) {
        if let Seen::MovedTo(cookie) = seen
            && let Some(from) = self.moved_from.remove(&cookie)
            && let Some(w) = self.paths.get_mut(&from)
        {
            w.finished = true;
        }
        if let Seen::MovedFrom(cookie) = seen {
            self.moved_from.insert(cookie, path.clone());
        }
        let new = !self.paths.contains_key(&path);
        let w = self.paths.entry(path).or_insert(Waiting {
            first: now,
            last: now,
            finished: false,
        });
        match seen {
            Seen::Listed if !new => return,
            Seen::Listed => {}
            Seen::Unfinished | Seen::MovedFrom(_) => w.finished = false,
            Seen::Finished | Seen::MovedTo(_) => w.finished = true,
            Seen::Touched => w.finished |= new,
        }
        w.last = now;
    }

    /// Takes the paths that can be read now, in path order.
    pub(super) fn ready(&mut self, now: Instant, settle: Duration) -> Vec<PathBuf> {
        let cap = settle * UNSETTLED;
        let ready: Vec<PathBuf> = self
            .paths
            .iter()
            .filter(|(_, w)| {
                w.finished
                    || now.duration_since(w.last) >= settle
                    || now.duration_since(w.first) >= cap
            })
            .map(|(p, _)| p.clone())
            .collect();
        if !ready.is_empty() {
            for p in &ready {
                self.paths.remove(p);
            }
            let paths = &self.paths;
            self.moved_from.retain(|_, p| paths.contains_key(p));
        }
        ready
    }

    /// When the next waiting path will be ready (now, if one is or a listing is due).
    pub(super) fn deadline(&self, now: Instant, settle: Duration) -> Option<Instant> {
        if self.rescan {
            return Some(now);
        }
        let cap = settle * UNSETTLED;
        self.paths
            .values()
            .map(|w| {
                if w.finished {
                    now
                } else {
                    (w.last + settle).min(w.first + cap)
                }
            })
            .min()
    }

    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.paths.is_empty() && !self.rescan
    }
}

const MASK: WatchFlags = WatchFlags::CREATE
    .union(WatchFlags::DELETE)
    .union(WatchFlags::MODIFY)
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::ONLYDIR);

/// Why inotify cannot be used (the watcher then polls).
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("cannot create an inotify instance: {0}")]
    Init(std::io::Error),
    #[error("cannot watch {}: {error}", calc_graph::untrusted::Untrusted(&dir.display().to_string()))]
    Watch { dir: PathBuf, error: std::io::Error },
    #[error("cannot wait for inotify events: {0}")]
    Wait(std::io::Error),
    #[error("cannot read inotify events: {0}")]
    Read(std::io::Error),
}

/// An inotify instance watching the directories of the walk.
pub(super) struct Notifier {
    fd: OwnedFd,
    /// Each watch's directories, by the paths walked (one inode reached by two paths is one
    /// watch).
    dirs: HashMap<i32, Vec<PathBuf>>,
    wds: HashMap<PathBuf, i32>,
    buf: Vec<MaybeUninit<u8>>,
}

impl Notifier {
    pub(super) fn new() -> Result<Notifier, NotifyError> {
        let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)
            .map_err(|e| NotifyError::Init(e.into()))?;
        Ok(Notifier {
            fd,
            dirs: HashMap::new(),
            wds: HashMap::new(),
            // Room for a few hundred events per read.
            buf: vec![MaybeUninit::uninit(); 64 * 1024],
        })
    }

    /// Watches exactly `dirs`: each is (re)added, so a path that now leads to another
    /// directory (a ConfigMap's `sub` link after a `..data` swap) is watched there; those the
    /// walk no longer enters are removed. A directory gone since the walk is skipped (its
    /// parent's event asks for a listing); the kernel refusing a watch (the per-user limit) is
    /// an error. Returns how many directories are watched anew: what was created in them
    /// between the walk and their watch has sent no event.
    pub(super) fn watch(&mut self, dirs: &[PathBuf]) -> Result<usize, NotifyError> {
        let mut added = 0;
        let keep: std::collections::HashSet<&PathBuf> = dirs.iter().collect();
        let gone: Vec<PathBuf> = self
            .wds
            .keys()
            .filter(|d| !keep.contains(d))
            .cloned()
            .collect();
        for d in gone {
            self.forget(&d);
        }
        for d in dirs {
            match inotify::add_watch(&self.fd, d.as_path(), MASK) {
                Ok(wd) if self.wds.get(d) == Some(&wd) => {}
                Ok(wd) => {
                    self.forget(d);
                    self.wds.insert(d.clone(), wd);
                    self.dirs.entry(wd).or_default().push(d.clone());
                    added += 1;
                }
                Err(e)
                    if e == rustix::io::Errno::NOENT
                        || e == rustix::io::Errno::NOTDIR
                        || e == rustix::io::Errno::ACCESS => {}
                Err(e) => {
                    return Err(NotifyError::Watch {
                        dir: d.clone(),
                        error: e.into(),
                    });
                }
            }
        }
        Ok(added)
    }

    /// Stops watching `dir` by that path (the watch goes once no path leads to it).
    fn forget(&mut self, dir: &std::path::Path) {
        if let Some(wd) = self.wds.remove(dir)
            && let Some(paths) = self.dirs.get_mut(&wd)
        {
            paths.retain(|p| p.as_path() != dir);
            if paths.is_empty() {
                self.dirs.remove(&wd);
                // Already gone with its directory, or removed now.
                let _ = inotify::remove_watch(&self.fd, wd);
            }
        }
    }

    /// Waits until events are ready or `timeout` passed.
    pub(super) fn wait(&self, timeout: Duration) -> Result<(), NotifyError> {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
        let t = Timespec {
            tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        match rustix::event::poll(&mut fds, Some(&t)) {
            Ok(_) => Ok(()),
            Err(e) if e == rustix::io::Errno::INTR => Ok(()),
            Err(e) => Err(NotifyError::Wait(e.into())),
        }
    }

    /// Reads every event ready and notes what it says in `pending`.
    pub(super) fn drain(&mut self, pending: &mut Pending, now: Instant) -> Result<(), NotifyError> {
        let Notifier {
            fd, dirs, wds, buf, ..
        } = self;
        let mut reader = inotify::Reader::new(&*fd, buf);
        let mut ignored = Vec::new();
        loop {
            let ev = match reader.next() {
                Ok(ev) => ev,
                Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INTR => break,
                Err(e) => return Err(NotifyError::Read(e.into())),
            };
            let mask = ev.events();
            if mask.contains(ReadFlags::QUEUE_OVERFLOW) {
                pending.rescan = true;
                continue;
            }
            // A watch removed here: its late events are not ours any more.
            let Some(paths) = dirs.get(&ev.wd()) else {
                continue;
            };
            if mask.intersects(
                ReadFlags::IGNORED
                    | ReadFlags::DELETE_SELF
                    | ReadFlags::MOVE_SELF
                    | ReadFlags::UNMOUNT,
            ) {
                // A watched directory went or moved: list again to know what is there.
                if mask.contains(ReadFlags::IGNORED) {
                    ignored.push(ev.wd());
                }
                pending.rescan = true;
                continue;
            }
            let Some(name) = ev.file_name() else {
                continue;
            };
            let name = OsStr::from_bytes(name.to_bytes());
            if name.as_bytes().starts_with(b"..") {
                // A ConfigMap volume's `..data` swap (or another `..` entry): what its links
                // lead to changed without an event of its own.
                pending.rescan = true;
                continue;
            }
            if name.as_bytes().starts_with(b".") {
                continue; // Hidden: never read.
            }
            if mask.contains(ReadFlags::ISDIR) {
                pending.rescan = true;
                continue;
            }
            for dir in paths {
                let path = dir.join(name);
                if !is_manifest(&path) {
                    // Not a manifest by name, but maybe a directory: a watched one removed, or
                    // a link to one arriving (a ConfigMap's `sub -> ..data/sub`).
                    if wds.contains_key(&path)
                        || (mask.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO)
                            && path.is_dir())
                    {
                        pending.rescan = true;
                    }
                    continue;
                }
                let seen = if mask.contains(ReadFlags::MOVED_FROM) {
                    Seen::MovedFrom(ev.cookie())
                } else if mask.contains(ReadFlags::MOVED_TO) {
                    Seen::MovedTo(ev.cookie())
                } else if mask.contains(ReadFlags::CLOSE_WRITE) {
                    Seen::Finished
                } else if mask.contains(ReadFlags::ATTRIB) {
                    Seen::Touched
                } else {
                    Seen::Unfinished
                };
                pending.note(path, seen, now);
            }
        }
        for wd in ignored {
            if let Some(paths) = dirs.remove(&wd) {
                for p in paths {
                    wds.remove(&p);
                }
            }
        }
        Ok(())
    }

    /// The directories watched (for tests).
    #[cfg(test)]
    pub(super) fn watched(&self) -> Vec<&std::path::Path> {
        let mut v: Vec<&std::path::Path> = self.wds.keys().map(PathBuf::as_path).collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64, t0: Instant) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn finished_changes_are_ready_at_once_and_the_rest_once_quiet() {
        let t0 = Instant::now();
        let settle = Duration::from_millis(100);
        let mut p = Pending::default();
        p.note("a".into(), Seen::Unfinished, t0);
        p.note("a".into(), Seen::Finished, at(5, t0));
        p.note("b".into(), Seen::Unfinished, t0);
        p.note("c".into(), Seen::Finished, t0);
        p.note("c".into(), Seen::Unfinished, at(5, t0)); // Written again after its close.
        assert_eq!(p.ready(at(10, t0), settle), [PathBuf::from("a")]);
        assert_eq!(p.deadline(at(10, t0), settle), Some(at(100, t0)));
        assert_eq!(p.ready(at(100, t0), settle), [PathBuf::from("b")]);
        assert_eq!(p.ready(at(105, t0), settle), [PathBuf::from("c")]);
        assert!(p.is_empty());
        // A path written without pause is read after UNSETTLED settle times anyway.
        for ms in (0..2000).step_by(50) {
            p.note("d".into(), Seen::Unfinished, at(ms, t0));
            let ready = p.ready(at(ms, t0), settle);
            if !ready.is_empty() {
                assert_eq!(u128::from(ms), settle.as_millis() * u128::from(UNSETTLED));
                break;
            }
        }
        assert!(p.is_empty());
    }

    #[test]
    fn a_rename_inside_the_tree_is_seen_whole_and_a_listing_does_not_delay_an_event() {
        let t0 = Instant::now();
        let settle = Duration::from_millis(100);
        let mut p = Pending::default();
        p.note("a.yaml".into(), Seen::MovedFrom(7), t0);
        p.note("b.yaml".into(), Seen::MovedTo(7), t0);
        assert_eq!(
            p.ready(t0, settle),
            [PathBuf::from("a.yaml"), PathBuf::from("b.yaml")]
        );
        // Moved out of the tree: its arrival is never seen; it goes once quiet.
        p.note("c.yaml".into(), Seen::MovedFrom(8), t0);
        assert!(p.ready(t0, settle).is_empty());
        assert_eq!(p.ready(at(100, t0), settle), [PathBuf::from("c.yaml")]);
        // A listing finds a path an event already finished: it stays ready.
        p.note("d.yaml".into(), Seen::Finished, t0);
        p.note("d.yaml".into(), Seen::Listed, t0);
        p.note("e.yaml".into(), Seen::Listed, t0);
        assert_eq!(p.ready(t0, settle), [PathBuf::from("d.yaml")]);
        assert_eq!(p.ready(at(100, t0), settle), [PathBuf::from("e.yaml")]);
    }

    /// Events name the path they change; hidden names are ignored; a `..` name, a directory,
    /// and the kernel's queue overflowing ask for a listing.
    #[test]
    fn events_name_changed_paths_and_what_they_cannot_name_asks_for_a_listing() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let mut n = Notifier::new().unwrap();
        n.watch(std::slice::from_ref(&root)).unwrap();
        assert_eq!(n.watched(), [root.as_path()]);
        let drain = |n: &mut Notifier| {
            let mut p = Pending::default();
            n.drain(&mut p, Instant::now()).unwrap();
            let ready = p.ready(Instant::now(), Duration::from_secs(3600));
            (ready, p.rescan, p.paths.len())
        };
        std::fs::write(root.join("a.yaml"), "x").unwrap();
        std::fs::write(root.join(".swap.yaml"), "x").unwrap();
        std::fs::write(root.join("notes.txt"), "x").unwrap();
        assert_eq!(drain(&mut n), (vec![root.join("a.yaml")], false, 0));
        std::fs::write(root.join("elsewhere.tmp"), "y").unwrap();
        std::fs::rename(root.join("elsewhere.tmp"), root.join("b.yaml")).unwrap();
        std::fs::remove_file(root.join("a.yaml")).unwrap();
        // b arrived whole; a's removal waits to settle.
        assert_eq!(drain(&mut n), (vec![root.join("b.yaml")], false, 1));
        std::os::unix::fs::symlink("x", root.join("..data")).unwrap();
        assert!(drain(&mut n).1, "a `..` entry asks for a listing");
        std::fs::create_dir(root.join("sub")).unwrap();
        assert!(drain(&mut n).1, "a new directory asks for a listing");
        // More events than the kernel queues: IN_Q_OVERFLOW.
        let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
            .expect("/proc/sys/fs/inotify/max_queued_events")
            .trim()
            .parse()
            .unwrap();
        for i in 0..limit / 2 + 100 {
            std::fs::File::create(root.join(format!("f{i}"))).unwrap();
        }
        assert!(drain(&mut n).1, "an overflow asks for a listing");
        // Only the directory not watched before counts as new (the caller lists again).
        assert_eq!(n.watch(&[root.clone(), root.join("sub")]).unwrap(), 1);
        assert_eq!(n.watch(&[root.clone(), root.join("sub")]).unwrap(), 0);
        // The watch of a removed directory goes with it.
        std::fs::remove_dir(root.join("sub")).unwrap();
        assert!(drain(&mut n).1);
        n.watch(std::slice::from_ref(&root)).unwrap();
        assert_eq!(n.watched(), [root.as_path()]);
    }
}
