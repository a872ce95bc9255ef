//! Drives the [`Engine`] from its channels: control inputs (connections) and datastore
//! batches, each burst applied in one step, plus a 10 ms tick while snapshots are admitted or
//! the realization gauges wait to be summed, and a 1 s tick while changed hit counters wait to be
//! saved.

use calc_graph::graph::Update;
use tokio::sync::mpsc;

use super::{Engine, Input};

/// Inputs taken per step at most: a flood of connections still flushes regularly.
const MAX_BURST: usize = 4096;

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
            Some(Input::Datastore(b)) => batches.push(Input::Datastore(b)),
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
        let inputs = batches.into_iter().chain(control_inputs);
        if engine.step(inputs).stopped {
            return;
        }
    }
}
