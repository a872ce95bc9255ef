//! Drives the [`Engine`] from its channels: control inputs (connections) and datastore
//! batches, each burst applied in one step (datastore changes at most once per
//! [`DATASTORE_GAP`], so that a fast datastore's changes are applied and flushed together), plus a 10 ms tick while snapshots are admitted or
//! the realization gauges wait to be summed, and a 1 s tick while changed hit counters wait to be
//! saved.

use calc_graph::graph::Update;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Engine, Input};

/// Inputs taken per step at most: a flood of connections still flushes regularly.
const MAX_BURST: usize = 4096;

/// Least time between two steps that apply datastore changes. A change after a quiet spell is
/// applied at once; under churn the changes of the gap are applied as one batch and flushed
/// once. A flush costs per node holding what changed (a label flip is an IP-set delta to every
/// node holding the set), whether one change is in it or fifty, so this bounds the fan-out to
/// agents by this rate rather than by the datastore's (inotify or an etcd watch can deliver
/// thousands of single changes a second).
pub(super) const DATASTORE_GAP: std::time::Duration = std::time::Duration::from_millis(10);

/// When a datastore batch that arrived at `now` may be applied, the previous datastore step
/// having been at `last`: `None` at once.
fn datastore_wait(last: Option<Instant>, now: Instant) -> Option<Instant> {
    let at = last? + DATASTORE_GAP;
    (at > now).then_some(at)
}

/// Runs until both channels close or a Shutdown arrives.
pub(crate) async fn run(
    mut engine: Engine,
    mut control: mpsc::Receiver<Input>,
    mut datastore: mpsc::Receiver<Vec<Update>>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // While changed hit counters wait for their save interval (see `Engine::save_hits_every`).
    let mut save_tick = tokio::time::interval(std::time::Duration::from_secs(1));
    save_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut datastore_open = true;
    // When datastore changes were last applied.
    let mut last_datastore: Option<Instant> = None;
    loop {
        let busy = engine.wants_tick();
        let saving = engine.wants_save_tick();
        let first = tokio::select! {
            i = control.recv() => match i {
                Some(i) => Some(i),
                None => return,
            },
            b = datastore.recv(), if datastore_open => match b {
                Some(b) => Some(Input::Datastore(b)),
                // An adapter that stops leaves the graph as it is; agents keep being served.
                None => { datastore_open = false; None }
            },
            _ = tick.tick(), if busy => None,
            _ = save_tick.tick(), if saving => None,
        };
        // Take everything already waiting: one flush for the whole burst. Datastore batches
        // go first so that a connection is judged against the newest view of the cluster.
        let (mut batches, mut control_inputs) = (Vec::new(), Vec::new());
        match first {
            Some(Input::Datastore(b)) => {
                // Under churn, wait for the rest of the gap: what arrives meanwhile joins.
                if let Some(at) = datastore_wait(last_datastore, Instant::now()) {
                    tokio::time::sleep_until(at).await;
                }
                batches.push(Input::Datastore(b));
            }
            Some(other) => control_inputs.push(other),
            None => {}
        }
        while datastore_open && batches.len() < MAX_BURST {
            match datastore.try_recv() {
                Ok(b) => batches.push(Input::Datastore(b)),
                Err(_) => break,
            }
        }
        while control_inputs.len() < MAX_BURST {
            match control.try_recv() {
                Ok(i) => control_inputs.push(i),
                Err(_) => break,
            }
        }
        if !batches.is_empty() {
            last_datastore = Some(Instant::now());
        }
        let inputs = batches.into_iter().chain(control_inputs);
        if engine.step(inputs).stopped {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datastore_changes_wait_only_for_the_rest_of_the_gap() {
        let t0 = Instant::now();
        let ms = std::time::Duration::from_millis;
        assert_eq!(
            datastore_wait(None, t0),
            None,
            "the first change goes at once"
        );
        assert_eq!(
            datastore_wait(Some(t0), t0 + DATASTORE_GAP),
            None,
            "after a quiet gap, at once"
        );
        assert_eq!(
            datastore_wait(Some(t0), t0 + ms(3)),
            Some(t0 + DATASTORE_GAP),
            "under churn, the rest of the gap"
        );
    }
}
