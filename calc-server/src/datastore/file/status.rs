//! The file datastore's status writer: the agents' reports as `<node>.json` in the status
//! directory (`--status-dir`, by default `status` inside the datastore directory, which the
//! manifest loader skips; see `super::OutputDirs`), written atomically and at most once per
//! interval per node.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::status::{Board, NodeStatus};

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
