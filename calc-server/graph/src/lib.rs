//! The pure core of calc-server.
//!
//! Everything in this crate is synchronous and side-effect free: no async runtime, no network,
//! no filesystem, no clock (architecture invariant 1). Callers hand it bytes or values and get
//! values back; invalid input comes back as an error value, never a panic.
//!
//! - [`selector`]: Calico's label-selector language (parse, evaluate, canonical form, ids).
//! - [`model`]: Calico's v3 resources as serde types, defaulting and validation.
//! - [`manifest`]: decoding YAML/JSON manifests (multi-document) into resources.
//! - [`rejection`]: why an object is not used, whichever stage refused it.
//! - [`untrusted`]: datastore strings made safe to show in logs and errors.

pub mod convert;
pub mod explain;
pub mod graph;
pub mod hash;
pub mod label_index;
pub mod manifest;
pub mod model;
pub mod policy_resolver;
pub mod rejection;
pub mod rule_scanner;
pub mod selector;
pub mod stream_model;
pub mod untrusted;
