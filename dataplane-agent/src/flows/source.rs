//! The seam between flow aggregation and the kernel: a [`FlowSource`] hands over what NFLOG
//! delivered and what conntrack reported since the last read, each event stamped with its
//! time: `driver::linux::flow_source::KernelFlowSource` reads the kernel's NFLOG groups and
//! conntrack table; [`MemorySource`] is the in-memory one tests feed.

use std::sync::Arc;

use parking_lot::Mutex;

use super::{CtObservation, Tuple};

/// One thing the kernel reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlowEvent {
    /// A packet logged by a rule (see [`super::NflogEvent`]).
    Nflog {
        /// Unix seconds.
        at: i64,
        group: u16,
        prefix: String,
        tuple: Tuple,
        len: u32,
    },
    /// A conntrack entry as seen.
    Conntrack {
        /// Unix seconds.
        at: i64,
        entry: CtObservation,
    },
}

/// Where flow events come from.
pub trait FlowSource: Send {
    /// Appends the events since the last call to `out`, oldest first, without blocking.
    fn read(&mut self, out: &mut Vec<FlowEvent>) -> std::io::Result<()>;

    /// Stops listening (flow logs turned off); the next `read` starts again.
    fn close(&mut self) {}
}

/// Events pushed by a test (clones share the queue).
#[derive(Clone, Debug, Default)]
pub struct MemorySource {
    events: Arc<Mutex<Vec<FlowEvent>>>,
}

impl MemorySource {
    pub fn push(&self, ev: FlowEvent) {
        self.events.lock().push(ev);
    }
}

impl FlowSource for MemorySource {
    fn read(&mut self, out: &mut Vec<FlowEvent>) -> std::io::Result<()> {
        out.append(&mut self.events.lock());
        Ok(())
    }
}
