//! The input store: the last good version of every accepted resource, and whether the
//! datastore has delivered its snapshot.
//!
//! Contract: a key's entry changes only when an update for it is accepted (a rejected update
//! leaves the previous version in force) or deleted; an update equal to the stored version is
//! a no-op. Endpoints and policies are the bulk of a cluster and are not stored here
//! ([`Store::keeps_converted`]): their converted form (in [`super::items`] and
//! [`super::policies`]) is what a no-op update is compared with, and removing an absent one is
//! a no-op there. `in_sync` turns true once and stays.

use rustc_hash::FxHashMap;

use super::Key;
use crate::model::{Kind, Resource};

#[derive(Default)]
pub(super) struct Store {
    /// Last good version of every accepted resource except endpoints.
    pub(super) resources: FxHashMap<Key, Resource>,
    pub(super) in_sync: bool,
}

impl Store {
    /// Kinds whose resources are not kept here: the graph keeps their converted form only (a
    /// policy's resource would be a third copy of its rules, beside its model and its update).
    pub(super) fn keeps_converted(kind: Kind) -> bool {
        matches!(kind, Kind::WorkloadEndpoint | Kind::HostEndpoint) || kind.is_policy()
    }
}
