//! One problem with one field of an object, the shape both ends report: the calc-server's
//! validation of a datastore object and the agent's re-check of a message from the stream.
//!
//! Contract: plain data, kept structured until a log line or an answer shows it as
//! `field: reason`; the texts are built by the checks, and any part of them that came from the
//! datastore or the stream is escaped there.

use std::fmt;

/// Where (`spec.ingress[0].protocol`, `rule 2 ip_set_ids`) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub reason: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> FieldError {
        FieldError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for FieldError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_as_field_then_reason() {
        let e = FieldError::new("spec.order", "must be a number");
        assert_eq!(e.to_string(), "spec.order: must be a number");
    }
}
