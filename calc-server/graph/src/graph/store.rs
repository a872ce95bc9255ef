//! The input store: the last good version of every accepted resource, and whether the
//! datastore has delivered its snapshot.
//!
//! Contract: a key's entry changes only when an update for it is accepted (a rejected update
//! leaves the previous version in force) or deleted; an update equal to the stored version is
//! a no-op. Endpoints are the bulk of a cluster and are not stored here: their converted form
//! in [`super::items`] is what a no-op update is compared with. `in_sync` turns true once and
//! stays.

use rustc_hash::FxHashMap;

use super::Key;
use crate::model::Resource;

#[derive(Default)]
pub(super) struct Store {
    /// Last good version of every accepted resource except endpoints.
    pub(super) resources: FxHashMap<Key, Resource>,
    pub(super) in_sync: bool,
}
