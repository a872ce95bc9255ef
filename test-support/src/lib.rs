//! Fixtures for the tests of both ends, in one place: [`sync_server`], a fake calc-server whose
//! every Sync stream plays a script, and [`endpoint`], the builder of `WorkloadEndpoint`
//! messages.
//!
//! A crate of its own, not a feature of `dataplane-agent` or `felix-proto`: the agent's own
//! integration tests and the `integration` crate both use it, and neither a self
//! dev-dependency nor `integration` linking the agent may unify test code into the binaries
//! that `cargo build --workspace --bins` makes. Only tests depend on it (architecture.rs).

pub mod endpoint;
pub mod sync_server;

pub use endpoint::{Wep, wep, wep_id};
