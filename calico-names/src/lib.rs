//! Names both ends of the split Felix must agree on, byte for byte.
//!
//! calc-server computes IP set ids and validates FelixConfiguration; the agent turns the same ids
//! into chain and IP set names and re-checks the same settings against an untrusted stream. Both
//! take these functions from here, so the agent does not link the calculation graph and the two
//! can never drift apart.
//!
//! Contract: everything here is pure (no IO, no clock, no allocation beyond the returned value)
//! and never panics on any input: hostile strings come back as values or typed errors, which
//! show them bounded and escaped.
//!
//! - [`error`]: `FieldError`, one problem with one field, as both ends report it;
//! - [`cert`]: the CN and URI SANs of a certificate (node, server and admin identities);
//! - [`hash`]: Calico's `libcalico-go/lib/hash` ids (unique ids, length-limited names).
//! - [`validate`]: the name rules both binaries enforce (interface and log prefixes) and how a
//!   rejected value is shown in an error;
//! - [`felix_config`]: FelixConfiguration values both read (failsafe ports).
//! - [`is_staged_policy_kind`]: which `PolicyID.kind`s are staged (computed, never programmed).

pub mod cert;
pub mod error;
pub mod felix_config;
pub mod hash;
pub mod validate;

pub use error::FieldError;

/// The `PolicyID.kind`s of Calico's staged policies (3.30+).
pub const STAGED_POLICY_KINDS: [&str; 3] = [
    "StagedNetworkPolicy",
    "StagedGlobalNetworkPolicy",
    "StagedKubernetesNetworkPolicy",
];

/// Whether a policy of this `PolicyID.kind` is staged: the server computes it and ships it in
/// endpoints' tier lists (explain's pending verdicts read it), and no driver programs it.
pub fn is_staged_policy_kind(kind: &str) -> bool {
    STAGED_POLICY_KINDS.contains(&kind)
}
