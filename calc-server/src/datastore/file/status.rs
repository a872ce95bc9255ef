//! The file datastore's status writer: the agents' reports as `<node>.json` in the status
//! directory (`--status-dir`, by default `status` inside the datastore directory, which the
//! manifest loader skips), written atomically and at most once per interval per node.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::status::{Board, NodeStatus};

/// The status directory for the file datastore `file_dir` and `--status-dir` (`None`: no
/// status files). A directory inside `file_dir` other than its `status` is refused: the manifest
/// loader would read the status files as manifests.
pub fn status_dir(file_dir: &Path, flag: Option<&Path>) -> anyhow::Result<Option<PathBuf>> {
    let default = file_dir.join("status");
    let dir = match flag {
        Some(d) if d.as_os_str().is_empty() => return Ok(None),
        Some(d) => d.to_path_buf(),
        None => return Ok(Some(default)),
    };
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let (abs, root) = (canonical(&dir), canonical(file_dir));
    anyhow::ensure!(
        !abs.starts_with(&root) || abs == root.join("status"),
        "--status-dir {} is inside --file-dir {} (only its `status` subdirectory is skipped by \
         the manifest loader); choose a directory outside it",
        dir.display(),
        file_dir.display()
    );
    Ok(Some(dir))
}

/// Writes changed node statuses to `<dir>/<node>.json` every `interval`. A failing directory is
/// reported once (with its path) when it starts failing and once when it recovers, not on every
/// retry.
pub async fn file_writer(board: Arc<Board>, dir: PathBuf, interval: std::time::Duration) {
    let mut tick = tokio::time::interval(interval);
    let mut failing = false;
    loop {
        tick.tick().await;
        for st in board.take_dirty() {
            match write_atomic(&dir, &st).await {
                Err(error) => {
                    if !failing {
                        tracing::error!(%error, dir = %dir.display(), node = %st.node,
                            "cannot write endpoint status files; retrying every --status-interval \
                             (a read-only datastore directory? set --status-dir to a writable one)");
                    }
                    failing = true;
                    board.mark_dirty(&st.node);
                }
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!(dir = %dir.display(), "writing endpoint status files again");
                }
                Ok(()) => {}
            }
        }
    }
}

async fn write_atomic(dir: &Path, st: &NodeStatus) -> std::io::Result<()> {
    tokio::fs::create_dir_all(dir).await?;
    let body = serde_json::to_vec_pretty(st).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!(".{}.json.tmp", st.node));
    tokio::fs::write(&tmp, body).await?;
    tokio::fs::rename(&tmp, dir.join(format!("{}.json", st.node))).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_dir_stays_out_of_the_manifests() {
        let root = std::env::temp_dir().join(format!("status-dir-{}", std::process::id()));
        std::fs::create_dir_all(root.join("policies")).unwrap();
        assert_eq!(status_dir(&root, None).unwrap(), Some(root.join("status")));
        assert_eq!(status_dir(&root, Some(Path::new(""))).unwrap(), None);
        assert_eq!(
            status_dir(&root, Some(Path::new("/var/run/calc-status"))).unwrap(),
            Some(PathBuf::from("/var/run/calc-status"))
        );
        assert_eq!(
            status_dir(&root, Some(&root.join("status"))).unwrap(),
            Some(root.join("status"))
        );
        let err = status_dir(&root, Some(&root.join("policies"))).unwrap_err();
        assert!(err.to_string().contains("inside --file-dir"), "{err}");
        std::fs::remove_dir_all(root).unwrap();
    }
}
