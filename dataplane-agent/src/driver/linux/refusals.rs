//! What the Linux driver refused to program as sent, by object: the record behind
//! `dataplane_agent_rejected_objects`, the `error` endpoint statuses, and the log lines an
//! operator reads.
//!
//! Contract: objects are named "<kind> <key>" ("policy gnp/x", "ipset \"s:a\"",
//! "workload endpoint k8s/ns/pod/eth0"); each refusal is logged once when it is recorded and
//! once when it clears. Refusals on receipt (`validate`) stay until a valid version arrives or
//! the object goes; the kernel's are rebuilt after every table apply.

use std::collections::BTreeMap;

use tracing::{info, warn};

#[derive(Debug, Default)]
pub(crate) struct Refusals {
    /// Objects from the stream refused by `validate`, "<kind> <key>" → reason. Each is held
    /// failing closed until a valid version arrives or it is removed.
    rejected: BTreeMap<String, String>,
    /// Objects some of whose chains or sets the kernel refused, "<kind> <key>" → reason
    /// (rebuilt after every apply; those chains fail closed).
    pub kernel: BTreeMap<String, String>,
}

impl Refusals {
    /// Records that the stream sent something this agent will not program as sent.
    pub(crate) fn reject(&mut self, what: String, reason: String) {
        warn!(object = %what, %reason, "refused an object from the calc-server; failing closed for it");
        self.rejected.insert(what, reason);
    }

    /// A valid version of `what` arrived (or it went away): no longer refused.
    pub(crate) fn accept(&mut self, what: &str) {
        if self.rejected.remove(what).is_some() {
            info!(object = %what, "object from the calc-server is valid again");
        }
    }

    /// Refusals on receipt.
    pub(crate) fn rejected(&self) -> &BTreeMap<String, String> {
        &self.rejected
    }
}
