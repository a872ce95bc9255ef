//! One tracker and one cancellation token for all of a process's tasks.
//!
//! [`Tasks`] is a cloneable handle: every task is spawned through it, instrumented with a span
//! (so what it logs says which task it is), tracked (so shutdown can wait for it) and stopped
//! by one [`cancel`](Tasks::cancel). An async task simply ends (is dropped at its next
//! `.await`) when cancelled; a blocking one is given the token and checks it itself.
//! [`shutdown`](Tasks::shutdown) cancels, then waits a bounded time and names what is left.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

pub use tokio_util::sync::CancellationToken;

/// The handle every task is spawned through (clones share the tracker and the token).
#[derive(Clone, Debug, Default)]
pub struct Tasks {
    tracker: TaskTracker,
    token: CancellationToken,
    running: Arc<Mutex<Running>>,
}

/// The spans of the tasks still running, to name them when a shutdown times out.
#[derive(Debug, Default)]
struct Running {
    next: u64,
    spans: BTreeMap<u64, Span>,
}

/// A task's entry in [`Running`], removed when the task ends (completes, is cancelled or
/// aborted, or panics).
struct Registered {
    id: u64,
    running: Arc<Mutex<Running>>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.running.lock().spans.remove(&self.id);
    }
}

impl Tasks {
    pub fn new() -> Tasks {
        Tasks::default()
    }

    fn register(&self, span: &Span) -> Registered {
        let mut running = self.running.lock();
        running.next += 1;
        let id = running.next;
        running.spans.insert(id, span.clone());
        Registered {
            id,
            running: self.running.clone(),
        }
    }

    /// Spawns `future` on the current runtime inside `span`, tracked. It ends early, dropped at
    /// its next `.await`, when the token is cancelled (at once if it already is): the handle
    /// then gives `None`.
    pub fn spawn<F>(&self, span: Span, future: F) -> JoinHandle<Option<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let registered = self.register(&span);
        let token = self.token.clone();
        self.tracker.spawn(
            async move {
                let _registered = registered;
                token.run_until_cancelled_owned(future).await
            }
            .instrument(span),
        )
    }

    /// Runs `f` on the blocking pool inside `span`, tracked. `f` gets the token: it must check
    /// it (at least every poll or wait) and return once it is cancelled.
    pub fn spawn_blocking<F, R>(&self, span: Span, f: F) -> JoinHandle<R>
    where
        F: FnOnce(CancellationToken) -> R + Send + 'static,
        R: Send + 'static,
    {
        let registered = self.register(&span);
        let token = self.token.clone();
        // The subscriber too: a scoped one (tests) is per thread.
        let dispatch = tracing::dispatcher::get_default(Clone::clone);
        self.tracker.spawn_blocking(move || {
            let _registered = registered;
            tracing::dispatcher::with_default(&dispatch, || span.in_scope(|| f(token)))
        })
    }

    /// Cancels every task, spawned or still to be spawned.
    pub fn cancel(&self) {
        self.token.cancel();
    }

    pub fn is_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Completes once [`cancel`](Self::cancel) has been called.
    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    /// The cancellation token (for code that checks it itself).
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// How many tracked tasks are still running.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Cancels every task and waits up to `timeout` for all of them to end; true if they did.
    /// Otherwise the ones still running are logged (by span name, and each in its span) and left
    /// behind.
    pub async fn shutdown(&self, timeout: Duration) -> bool {
        self.cancel();
        self.tracker.close();
        if tokio::time::timeout(timeout, self.tracker.wait())
            .await
            .is_ok()
        {
            return true;
        }
        let left: Vec<Span> = self.running.lock().spans.values().cloned().collect();
        // A span the log filter disabled has no name.
        let names: Vec<&str> = left
            .iter()
            .map(|s| s.metadata().map_or("unknown", |m| m.name()))
            .collect();
        tracing::warn!(?timeout, tasks = ?names, "tasks still running after the shutdown timeout; leaving them");
        for span in &left {
            tracing::warn!(parent: span, "task did not stop in time");
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn current_name() -> Option<&'static str> {
        Span::current().metadata().map(|m| m.name())
    }

    #[tokio::test]
    async fn a_cancelled_task_ends() {
        let tasks = Tasks::new();
        let pending = tasks.spawn(tracing::info_span!("pending"), std::future::pending::<()>());
        let done = tasks.spawn(tracing::info_span!("done"), async { 7 });
        assert_eq!(done.await.unwrap(), Some(7));
        assert_eq!(tasks.len(), 1);
        tasks.cancel();
        assert_eq!(pending.await.unwrap(), None);
        assert!(tasks.is_empty());
        // Spawned after the cancel: never runs.
        let late = tasks.spawn(tracing::info_span!("late"), async { 1 });
        assert_eq!(late.await.unwrap(), None);
        tokio::time::timeout(Duration::from_secs(1), tasks.cancelled())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn shutdown_waits_for_tracked_tasks() {
        let tasks = Tasks::new();
        let stopped = Arc::new(AtomicBool::new(false));
        let flag = stopped.clone();
        tasks.spawn_blocking(tracing::info_span!("poller"), move |token| {
            while !token.is_cancelled() {
                std::thread::sleep(Duration::from_millis(5));
            }
            // Some clean-up after the cancel: shutdown waits for it.
            std::thread::sleep(Duration::from_millis(50));
            flag.store(true, Ordering::SeqCst);
        });
        tasks.spawn(tracing::info_span!("waiter"), std::future::pending::<()>());
        assert!(tasks.shutdown(Duration::from_secs(5)).await);
        assert!(stopped.load(Ordering::SeqCst));
        assert!(tasks.is_empty());
    }

    #[tokio::test]
    async fn shutdown_gives_up_after_the_timeout() {
        let _subscriber = tracing::subscriber::set_default(tracing_subscriber::registry());
        let tasks = Tasks::new();
        tasks.spawn_blocking(tracing::info_span!("stubborn"), |_token| {
            std::thread::sleep(Duration::from_millis(300));
        });
        assert!(!tasks.shutdown(Duration::from_millis(20)).await);
        assert_eq!(tasks.len(), 1);
        let names: Vec<_> = tasks
            .running
            .lock()
            .spans
            .values()
            .map(|s| s.metadata().map(|m| m.name()))
            .collect();
        assert_eq!(names, [Some("stubborn")]);
    }

    #[tokio::test]
    async fn tasks_run_in_their_spans() {
        // A subscriber that enables every span, for this thread (the test's runtime).
        let _subscriber = tracing::subscriber::set_default(tracing_subscriber::registry());
        let tasks = Tasks::new();
        let a = tasks.spawn(tracing::info_span!("worker", id = 1), async {
            tokio::task::yield_now().await;
            current_name()
        });
        let b = tasks.spawn_blocking(tracing::info_span!("blocking_worker"), |_| current_name());
        assert_eq!(a.await.unwrap(), Some(Some("worker")));
        assert_eq!(b.await.unwrap(), Some("blocking_worker"));
        assert!(tasks.shutdown(Duration::from_secs(1)).await);
    }
}
