//! The file datastore's store of the hit counters: `_hits.json` in its status directory
//! (`--status-dir`; none without one). The name cannot be a node's status file
//! (`<node>.json`): a node name has no `_`.
//!
//! The document is the engine's [`SavedHits`] as JSON (`{"version": 1, "counts": […], "seen":
//! […]}`). [`write_atomic`] writes a copy to a temporary file in the same directory, synced,
//! then renamed, so a crash leaves the old document or the new one, never half of one.
//! [`load`] reads it, bounded by [`MAX_BYTES`]; a missing file is a first start, and a document
//! that is too large, unparsable or of another version is refused with its reason (the caller
//! logs it and starts from zero): never fatal. [`parse`] also reads each part of the etcd
//! store.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::args::{DatastoreType, ServeArgs};
use crate::serve::engine::{SAVED_VERSION, SavedHits};

/// The document's name in the status directory.
pub(crate) const FILE_NAME: &str = "_hits.json";

/// Largest document read or written.
pub(crate) const MAX_BYTES: u64 = 64 << 20;

/// Where `args`' server keeps its hit counters (`None`: nowhere; they live in memory only).
pub(super) fn path(args: &ServeArgs) -> Option<PathBuf> {
    if args.datastore.datastore_type != DatastoreType::File {
        return None;
    }
    let dirs = crate::datastore::file::OutputDirs::check(
        &args.datastore.file_dir,
        args.status_dir.as_deref(),
        args.last_good_dir.as_deref(),
    )
    .ok()?;
    dirs.status.map(|d| d.join(FILE_NAME))
}

/// Why a saved document is refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoadError {
    #[error("cannot read it: {0}")]
    Read(#[source] std::io::Error),
    #[error("it is larger than {MAX_BYTES} bytes")]
    TooLarge,
    #[error("not a hit counters document: {0}")]
    NotADocument(#[source] serde_json::Error),
    #[error("version {0} is not one this server reads ({SAVED_VERSION})")]
    Version(u32),
    #[error("damaged: {0}")]
    Damaged(#[source] serde_json::Error),
}

/// The document at `path` (`Ok(None)`: there is none), or why it is refused.
pub(super) fn load(path: &Path) -> Result<Option<SavedHits>, LoadError> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LoadError::Read(e)),
    };
    let mut body = Vec::new();
    file.take(MAX_BYTES + 1)
        .read_to_end(&mut body)
        .map_err(LoadError::Read)?;
    if body.len() as u64 > MAX_BYTES {
        return Err(LoadError::TooLarge);
    }
    parse(&body).map(Some)
}

/// A document's bytes, checked: JSON, its version, then its shape.
pub(super) fn parse(body: &[u8]) -> Result<SavedHits, LoadError> {
    #[derive(serde::Deserialize)]
    struct Head {
        version: u32,
    }
    let head: Head = serde_json::from_slice(body).map_err(LoadError::NotADocument)?;
    if head.version != SAVED_VERSION {
        return Err(LoadError::Version(head.version));
    }
    serde_json::from_slice(body).map_err(LoadError::Damaged)
}

/// Writes `doc` to `path` atomically (temporary file in the same directory, synced, renamed).
pub(super) fn write_atomic(path: &Path, doc: &SavedHits) -> std::io::Result<()> {
    let body = serde_json::to_vec(doc).map_err(std::io::Error::other)?;
    if body.len() as u64 > MAX_BYTES {
        return Err(std::io::Error::other(format!(
            "the counters take {} bytes, more than the {MAX_BYTES} a start would read",
            body.len()
        )));
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    // Per process: replicas sharing the directory never write into each other's temporary file.
    let tmp = dir.join(format!(".{FILE_NAME}.{}.tmp", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut f, &body)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn doc() -> SavedHits {
        serde_json::from_value(serde_json::json!({
            "version": 1,
            "counts": [{
                "owner": {"policy": {"kind": "NetworkPolicy", "namespace": "shop", "name": "web"}},
                "node": "node-a", "egress": false, "index": 0,
                "packets": 3, "bytes": 300, "first_ms": 1000, "last_ms": 2000
            }, {
                "owner": "failsafe", "node": null, "egress": true, "index": 0,
                "packets": 1, "bytes": 60, "first_ms": 1000, "last_ms": 1000
            }],
            "seen": [{
                "owner": {"profile": "kns.shop"},
                "ingress_since_ms": [500], "egress_since_ms": [],
                "by_action": [[1, 2], [0, 0], [0, 0], [0, 0]]
            }]
        }))
        .unwrap()
    }

    #[test]
    fn a_written_document_loads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("status").join(FILE_NAME);
        assert_eq!(load(&path).unwrap(), None, "no file: a first start");
        write_atomic(&path, &doc()).unwrap();
        assert_eq!(load(&path).unwrap(), Some(doc()));
        // Rewritten in place; no temporary file left behind.
        write_atomic(&path, &doc()).unwrap();
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [FILE_NAME]);
    }

    #[test]
    fn bad_documents_are_refused_with_their_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let refused = |body: &[u8]| {
            std::fs::write(&path, body).unwrap();
            load(&path).unwrap_err().to_string()
        };
        assert!(refused(b"{not json").starts_with("not a hit counters document"));
        assert!(refused(b"[]").starts_with("not a hit counters document"));
        let other = refused(br#"{"version": 2, "counts": [], "seen": []}"#);
        assert_eq!(other, "version 2 is not one this server reads (1)");
        assert!(
            refused(br#"{"version": 1, "counts": [{"owner": 7}], "seen": []}"#)
                .starts_with("damaged")
        );
        let mut big = br#"{"version": 1, "counts": [], "seen": [], "pad": ""#.to_vec();
        big.resize(MAX_BYTES as usize + 10, b' ');
        assert_eq!(
            refused(&big),
            format!("it is larger than {MAX_BYTES} bytes")
        );
    }
}
