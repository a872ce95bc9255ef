//! Decoding manifests: YAML (one or more `---`-separated documents) or JSON (an object or an
//! array of objects), each document a v3 resource or a `…List` with `items`.
//!
//! Contract: [`parse_manifest`] never fails as a whole for a bad object; it returns one entry per
//! object found, each decoded and validated or carrying the reason it was rejected, so a caller
//! can keep every good object of a file that also holds a bad one. Only text that is not YAML or
//! JSON at all fails the whole file. The caller reads the bytes (this crate does no IO).

use crate::model::validate::{Invalid, validate};
use crate::model::{DecodeError, Decoded, Resource, ResourceKey};

/// One object of a manifest, with its position for error messages.
#[derive(Debug)]
pub struct Entry {
    /// 1-based document number in the file (YAML `---` documents or JSON array items).
    pub document: usize,
    pub outcome: Outcome,
}

// A transient value, consumed at once; boxing would only add an allocation per object.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Outcome {
    /// Decoded and valid.
    Valid(ResourceKey, Resource),
    /// A Calico kind the policy dataplane does not use (kind, name); skipped.
    Ignored(String, String),
    /// Could not be decoded.
    Undecodable(DecodeError),
    /// Decoded but invalid.
    Invalid(Invalid),
}

/// Why a whole file could not be read as a manifest.
#[derive(Debug, thiserror::Error)]
pub enum SyntaxError {
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("invalid YAML: {0}")]
    Yaml(String),
}

/// Parses manifest text. JSON is recognised by a leading `{` or `[`; anything else is YAML.
pub fn parse_manifest(text: &str) -> Result<Vec<Entry>, SyntaxError> {
    let mut out = Vec::new();
    for_each_entry(text, |e| out.push(e))?;
    Ok(out)
}

/// Like [`parse_manifest`], handing each entry to `f` as soon as it is decoded, so a large
/// file never holds all its objects at once. On a syntax error some entries may already have
/// been handed over (JSON arrays are checked whole before the first one).
pub fn for_each_entry(text: &str, mut f: impl FnMut(Entry)) -> Result<(), SyntaxError> {
    let trimmed = text.trim_start_matches('\u{feff}').trim_start();
    let mut push_doc = |i: usize, doc: serde_json::Value| {
        if doc.is_null() {
            return; // An empty document (a trailing `---`) is not an object.
        }
        for value in flatten_lists(doc) {
            f(Entry {
                document: i + 1,
                outcome: decode_and_validate(value),
            });
        }
    };
    if trimmed.starts_with('[') {
        // Decode array items one at a time so a large file never exists as one value tree.
        let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(trimmed)?;
        for (i, raw) in items.into_iter().enumerate() {
            push_doc(i, serde_json::from_str(raw.get())?);
        }
    } else if trimmed.starts_with('{') {
        push_doc(0, serde_json::from_str(trimmed)?);
    } else {
        let docs = serde_saphyr::from_multiple::<serde_json::Value>(text)
            .map_err(|e| SyntaxError::Yaml(e.to_string()))?;
        for (i, doc) in docs.into_iter().enumerate() {
            push_doc(i, doc);
        }
    }
    Ok(())
}

/// Decodes and validates one object.
pub fn decode_and_validate(value: serde_json::Value) -> Outcome {
    match Resource::from_value(value) {
        Err(e) => Outcome::Undecodable(e),
        Ok(Decoded::Ignored(kind, name)) => Outcome::Ignored(kind, name),
        Ok(Decoded::Resource(key, res)) => match validate(&res) {
            Ok(()) => Outcome::Valid(key, res),
            Err(invalid) => Outcome::Invalid(invalid),
        },
    }
}

/// `calicoctl get -o yaml` wraps objects as `kind: XList` with `items`.
fn flatten_lists(doc: serde_json::Value) -> Vec<serde_json::Value> {
    let is_list = doc
        .get("kind")
        .and_then(|k| k.as_str())
        .is_some_and(|k| k == "List" || k.ends_with("List"))
        && doc.get("items").is_some_and(|i| i.is_array());
    if !is_list {
        return vec![doc];
    }
    match doc {
        serde_json::Value::Object(mut m) => match m.remove("items") {
            Some(serde_json::Value::Array(items)) => items,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_documents_lists_and_bad_objects() {
        let text = r#"
apiVersion: projectcalico.org/v3
kind: Tier
metadata:
  name: security
spec:
  order: 100
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicyList
items:
- apiVersion: projectcalico.org/v3
  kind: GlobalNetworkPolicy
  metadata: {name: good}
  spec: {selector: "all()"}
- apiVersion: projectcalico.org/v3
  kind: GlobalNetworkPolicy
  metadata: {name: bad}
  spec: {selector: "a ="}
---
apiVersion: projectcalico.org/v3
kind: BGPPeer
metadata: {name: rr}
---
"#;
        let entries = parse_manifest(text).unwrap();
        assert_eq!(entries.len(), 4);
        assert!(
            matches!(&entries[0].outcome, Outcome::Valid(k, _) if k.to_string() == "Tier security")
        );
        assert!(
            matches!(&entries[1].outcome, Outcome::Valid(k, _) if k.to_string() == "GlobalNetworkPolicy good")
        );
        match &entries[2].outcome {
            Outcome::Invalid(inv) => {
                assert_eq!(entries[2].document, 2);
                assert_eq!(inv.key.to_string(), "GlobalNetworkPolicy bad");
                assert_eq!(inv.errors[0].path, "spec.selector");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(&entries[3].outcome, Outcome::Ignored(k, n) if k == "BGPPeer" && n == "rr")
        );
    }

    #[test]
    fn json_object_and_array() {
        let one = r#"{"apiVersion":"projectcalico.org/v3","kind":"Profile","metadata":{"name":"kns.default"},"spec":{"ingress":[{"action":"Allow"}]}}"#;
        assert!(matches!(
            parse_manifest(one).unwrap()[0].outcome,
            Outcome::Valid(..)
        ));
        let arr =
            format!("[{one}, {{\"kind\": \"Nope\", \"apiVersion\": \"projectcalico.org/v3\"}}]");
        let entries = parse_manifest(&arr).unwrap();
        assert_eq!(entries.len(), 2);
        assert!(matches!(
            entries[1].outcome,
            Outcome::Undecodable(DecodeError::UnknownKind(_))
        ));
    }

    #[test]
    fn syntax_errors_fail_the_file() {
        assert!(matches!(
            parse_manifest("{not json"),
            Err(SyntaxError::Json(_))
        ));
        assert!(matches!(
            parse_manifest("a: [unclosed"),
            Err(SyntaxError::Yaml(_))
        ));
    }
}
