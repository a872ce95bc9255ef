//! The pure half of calc-server's datastore adapters: what a datastore's keys, values and
//! objects mean as graph [`Update`]s, and how any (re-)list of them reconciles the graph.
//!
//! Contract: no IO. No async runtime, no network, no filesystem, no clock; the `Cargo.toml`
//! shows it (no tokio, kube, etcd-client or tracing-subscriber). The adapters in calc-server
//! read the datastore and hand this crate what they read; everything here is a function of its
//! inputs, so it is unit-tested without etcd or an API server. Invalid input comes back as a
//! value ([`Decision::Reject`], a [`Problem`]), never a panic.
//!
//! - [`etcd`]: one key/value of Calico's etcd v3 layout → a [`Decision`].
//! - [`kubernetes`]: the watched collections ([`kubernetes::Source`], as plain data) and one
//!   Kubernetes object → a [`Decision`], exactly as Calico's Kubernetes backend converts it.
//! - [`mirror`]: the one mark-and-sweep mirror both use, so that a re-list after compaction,
//!   a lost connection or an anti-entropy timer sends only what changed.
//!
//! Decoding goes through `calc_graph::manifest`'s decoders (the path manifests take), so a
//! resource looks the same whichever datastore it came from (architecture invariant 2).

pub mod etcd;
pub mod kubernetes;
pub mod mirror;

use calc_graph::graph::Update;
use calc_graph::manifest::{Outcome, RejectStage, Rejection, decode_and_validate};
use calc_graph::model::{API_VERSION, Valid};

/// The profile Calico's client synthesises (never stored): allow everything both ways.
pub const DEFAULT_ALLOW_PROFILE: &str = "projectcalico-default-allow";

/// Calico's synthesised `projectcalico-default-allow` profile (ingress and egress Allow). The
/// etcd and Kubernetes adapters send it before their first list, as Calico's client does; the
/// file datastore has only what its files hold.
pub fn default_allow_profile() -> Valid {
    let v = serde_json::json!({
        "kind": "Profile",
        "apiVersion": API_VERSION,
        "metadata": {"name": DEFAULT_ALLOW_PROFILE},
        "spec": {"ingress": [{"action": "Allow"}], "egress": [{"action": "Allow"}]},
    });
    match decode_and_validate(v) {
        Outcome::Valid(_, res) => res,
        other => unreachable!("the built-in default-allow profile is valid: {other:?}"),
    }
}

/// What one datastore key or object means for the graph.
#[derive(Debug)]
// A transient value, consumed at once; boxing would only add an allocation per object.
#[allow(clippy::large_enum_variant)]
pub enum Decision {
    /// A valid resource (validated once, here: the graph takes it as is). `warnings`: parts
    /// Calico drops while keeping the rest (a Kubernetes NetworkPolicy rule that cannot be
    /// converted), each worth reporting.
    Apply {
        resource: Valid,
        warnings: Vec<String>,
    },
    /// Not something the graph has (another key family, a kind with no policy role, a pod
    /// without an IP).
    Skip,
    /// The value cannot be used; the stage and reason (the caller names the object).
    Reject(Rejection),
}

impl Decision {
    /// The decision a decoded-and-validated object leads to.
    pub fn from_outcome(outcome: Outcome, mut warnings: Vec<String>) -> Decision {
        match outcome.into_resource() {
            Ok(Some(resource)) => {
                // What the decoder's own conversion (a Kubernetes policy kind) dropped.
                warnings.extend(resource.conversion_warnings().iter().cloned());
                Decision::Apply { resource, warnings }
            }
            Ok(None) => Decision::Skip,
            Err(rejection) => Decision::Reject(rejection),
        }
    }
}

/// Something worth reporting about one datastore object: a rejected value, or a warning about
/// one that is used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The object as its datastore names it (an etcd key, `<collection> <namespace>/<name>`).
    pub key: String,
    /// The [`Rejection`] or the warning, as the report shows it (this is the report's line;
    /// the stage that refused the object is kept beside it).
    pub reason: String,
    /// A version of the object stays in force (its last good one, or, for a warning, the
    /// object itself).
    pub held: bool,
    /// The stage that refused the value, which the caller counts
    /// (`calc_server_rejected_objects_total`); `None` for a warning about an object in use.
    pub stage: Option<RejectStage>,
}

/// Updates and problems produced by one batch of keys or objects.
#[derive(Debug, Default)]
pub struct Batch {
    pub updates: Vec<Update>,
    pub problems: Vec<Problem>,
}

/// Rejected objects as (name, whether a last good version is in force), split into the held
/// and the without lists, each sorted: what `/status/datastore`, `/readiness` and the
/// unusable-object gauges show.
pub fn split_unusable(
    rejected: impl Iterator<Item = (String, bool)>,
) -> (Vec<String>, Vec<String>) {
    let (mut held, mut without) = (Vec::new(), Vec::new());
    for (name, has_last_good) in rejected {
        if has_last_good {
            held.push(name);
        } else {
            without.push(name);
        }
    }
    held.sort();
    without.sort();
    (held, without)
}

/// The updates of `b`, one line each, as tests compare them. A resource the graph would have to
/// validate again shows as such: everything the adapters send is validated once, on decoding.
#[cfg(test)]
pub(crate) fn summary(b: &Batch) -> Vec<String> {
    b.updates
        .iter()
        .map(|u| match u {
            Update::ApplyValid(r) => format!("apply {}", r.key()),
            Update::Apply(r) => format!("apply (not validated) {}", r.key()),
            Update::Delete(k) => format!("delete {k}"),
            Update::InSync => "in-sync".into(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use calc_graph::model::{Kind, Resource, ResourceKey};

    #[test]
    fn default_allow_profile_allows_both_ways() {
        let r = default_allow_profile();
        assert_eq!(
            r.key(),
            ResourceKey::new(Kind::Profile, None, DEFAULT_ALLOW_PROFILE)
        );
        let Resource::Profile(_, spec) = r.into_resource() else {
            unreachable!()
        };
        assert_eq!(spec.ingress.len(), 1);
        assert_eq!(spec.egress.len(), 1);
    }
}
