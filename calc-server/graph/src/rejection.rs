//! Why a datastore object is not used: one [`Rejection`] for every stage that can refuse one.
//!
//! The stages are a datastore adapter's own checks of a key or value (an etcd key, a Kubernetes
//! annotation), the decoder, validation, and the graph's conversion of a validated object
//! (`CalcGraph::apply`). Whichever refused it, the previous good version of the object (if any)
//! stays in force, and the operators' counter (`calc_server_rejected_objects_total`) counts it
//! by its [`RejectStage`].
//!
//! Contract: structured until shown. A rejection keeps the decoder's error, the validation
//! errors (each with its field) or the conversion error as values; [`RejectStage`] is derived
//! from them, never stored beside them; the text is built only when a log line, a report or an
//! answer displays the rejection. The parts that came from the datastore are escaped and bounded
//! where those errors are built.

use std::sync::Arc;

use crate::convert::ConvertError;
use crate::model::validate::Invalid;
use crate::model::{DecodeError, ResourceKey};

/// Why an object is not used: the stage that refused it (the label operators count it by).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectStage {
    /// The value cannot be read as an object of its kind (syntax, key, shape).
    Decode,
    /// Read, but its values are invalid.
    Validation,
    /// Read, but it holds a field Calico's API does not define (a typo, most often).
    UnknownField,
}

impl RejectStage {
    pub const ALL: [RejectStage; 3] = [
        RejectStage::Decode,
        RejectStage::Validation,
        RejectStage::UnknownField,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectStage::Decode => "decode",
            RejectStage::Validation => "validation",
            RejectStage::UnknownField => "unknown_field",
        }
    }

    /// The stage of an invalid object: [`RejectStage::UnknownField`] when one of its errors is
    /// a field Calico's API does not define, even beside other errors (the typo is the likely
    /// cause), else [`RejectStage::Validation`].
    pub fn of_invalid(invalid: &Invalid) -> RejectStage {
        if invalid
            .errors
            .iter()
            .any(crate::model::fields::is_unknown_field)
        {
            RejectStage::UnknownField
        } else {
            RejectStage::Validation
        }
    }
}

/// An object that is not used, and why (see the module documentation). Shown as the reason
/// alone, except for a conversion failure, which names the object: the others' errors name it
/// themselves where they can, and the caller names it by its datastore key otherwise.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Rejection {
    /// The decoder cannot read the value as an object of its kind.
    #[error(transparent)]
    Undecodable(DecodeError),
    /// A datastore adapter's own check of the key or value refused it (an etcd key that is
    /// malformed, a Kubernetes object whose annotation is not a CIDR): the adapter's error.
    #[error(transparent)]
    Datastore(Arc<dyn std::error::Error + Send + Sync>),
    /// Read, but invalid: every problem, each with its field.
    #[error(transparent)]
    Invalid(Invalid),
    /// Valid, yet the graph cannot convert it (validation refuses each such object first).
    #[error("{key}: {error}")]
    Unconvertible {
        key: ResourceKey,
        error: Box<ConvertError>,
    },
}

impl Rejection {
    /// A rejection by a datastore adapter's own check.
    pub fn datastore(error: impl std::error::Error + Send + Sync + 'static) -> Rejection {
        Rejection::Datastore(Arc::new(error))
    }

    /// The stage that refused the object.
    pub fn stage(&self) -> RejectStage {
        match self {
            Rejection::Undecodable(_) | Rejection::Datastore(_) => RejectStage::Decode,
            Rejection::Invalid(invalid) => RejectStage::of_invalid(invalid),
            Rejection::Unconvertible { .. } => RejectStage::Validation,
        }
    }

    /// The object refused, when the rejection knows it (an adapter's check and some decode
    /// errors come before the object is named: the caller names it by its datastore key).
    pub fn key(&self) -> Option<&ResourceKey> {
        match self {
            Rejection::Undecodable(DecodeError::Field { key, .. })
            | Rejection::Invalid(Invalid { key, .. })
            | Rejection::Unconvertible { key, .. } => Some(key),
            Rejection::Undecodable(_) | Rejection::Datastore(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Kind;
    use crate::model::validate::FieldError;

    #[test]
    fn the_stage_follows_the_reason() {
        let key = ResourceKey::new(Kind::GlobalNetworkPolicy, None, "p");
        let invalid = |field: &str, reason: &str| {
            Rejection::Invalid(Invalid {
                key: key.clone(),
                errors: vec![
                    FieldError::new("spec.order", "must be a number"),
                    FieldError::new(field, reason),
                ],
            })
        };
        assert_eq!(
            Rejection::Undecodable(DecodeError::MissingKind).stage(),
            RejectStage::Decode
        );
        assert_eq!(
            Rejection::datastore(std::fmt::Error).stage(),
            RejectStage::Decode
        );
        assert_eq!(
            invalid("spec.types", "bad").stage(),
            RejectStage::Validation
        );
        let typo = invalid("spec.selectr", "unknown field (did you mean \"selector\"?)");
        assert_eq!(typo.stage(), RejectStage::UnknownField);
        assert_eq!(typo.key(), Some(&key));
        assert_eq!(
            typo.to_string(),
            "GlobalNetworkPolicy p is invalid: spec.order: must be a number; spec.selectr: \
             unknown field (did you mean \"selector\"?)"
        );
        let unconvertible = Rejection::Unconvertible {
            key: key.clone(),
            error: Box::new(ConvertError::Action("Maybe".into())),
        };
        assert_eq!(unconvertible.stage(), RejectStage::Validation);
        assert_eq!(
            unconvertible.to_string(),
            "GlobalNetworkPolicy p: invalid action \"Maybe\""
        );
    }
}
