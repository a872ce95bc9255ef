//! Decoding manifests: YAML (one or more `---`-separated documents) or JSON (an object or an
//! array of objects), each document a v3 resource or a `…List` with `items`.
//!
//! Contract: [`parse_manifest`] never fails as a whole for a bad object; it returns one entry per
//! object found, each decoded and validated or carrying the reason it was rejected, so a caller
//! can keep every good object of a file that also holds a bad one. Only text that is not YAML or
//! JSON at all fails the whole file. The caller reads the bytes (this crate does no IO).

use crate::model::validate::Invalid;
use crate::model::{DecodeError, Decoded, Resource, ResourceKey, Valid};

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
    /// Decoded and valid: the key and the validated resource (validation runs once, here).
    Valid(ResourceKey, Valid),
    /// A Calico kind the policy dataplane does not use (kind, name); skipped.
    Ignored(String, String),
    /// Could not be decoded.
    Undecodable(DecodeError),
    /// Decoded but invalid.
    Invalid(Invalid),
}

pub use crate::rejection::{RejectStage, Rejection};

impl Outcome {
    /// The stage that refused the object; `None` for a valid or ignored one. An object with an
    /// unknown field counts as [`RejectStage::UnknownField`] even when other errors come with
    /// it: the typo is the likely cause.
    pub fn stage(&self) -> Option<RejectStage> {
        match self {
            Outcome::Valid(..) | Outcome::Ignored(..) => None,
            Outcome::Undecodable(_) => Some(RejectStage::Decode),
            Outcome::Invalid(inv) => Some(RejectStage::of_invalid(inv)),
        }
    }

    /// The resource to use (`None`: a kind the dataplane ignores), or why not.
    pub fn into_resource(self) -> Result<Option<Valid>, Rejection> {
        match self {
            Outcome::Valid(_, res) => Ok(Some(res)),
            Outcome::Ignored(..) => Ok(None),
            Outcome::Undecodable(e) => Err(Rejection::Undecodable(e)),
            Outcome::Invalid(inv) => Err(Rejection::Invalid(inv)),
        }
    }
}

/// Why a whole file could not be read as a manifest.
#[derive(Debug, thiserror::Error)]
pub enum SyntaxError {
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("invalid YAML: {0}")]
    Yaml(String),
    #[error("{0} documents in one file; at most {MAX_DOCUMENTS} are read (split the file)")]
    TooManyDocuments(usize),
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
                outcome: decode_and_validate_strict(value),
            });
        }
    };
    if trimmed.starts_with('[') {
        // Decode array items one at a time so a large file never exists as one value tree.
        let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(trimmed)?;
        if items.len() > MAX_DOCUMENTS {
            return Err(SyntaxError::TooManyDocuments(items.len()));
        }
        for (i, raw) in items.into_iter().enumerate() {
            push_doc(i, serde_json::from_str(raw.get())?);
        }
    } else if trimmed.starts_with('{') {
        push_doc(0, serde_json::from_str(trimmed)?);
    } else {
        let docs =
            serde_saphyr::from_multiple_with_options::<serde_json::Value>(text, yaml_limits())
                .map_err(|e| {
                    // The first line says what and where; the rest is a source snippet that may
                    // quote hostile text.
                    let e = e.to_string();
                    let first = e
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .trim_start_matches("error: ");
                    SyntaxError::Yaml(crate::untrusted::clip(first.to_string(), 1024))
                })?;
        for (i, doc) in docs.into_iter().enumerate() {
            push_doc(i, doc);
        }
    }
    Ok(())
}

/// Documents one manifest file may hold.
pub const MAX_DOCUMENTS: usize = 10_000;
/// Events aliases may replay in one file. Manifests rarely use anchors at all; a few hundred
/// bytes of nested aliases (a "billion laughs") would otherwise expand to millions of nodes.
pub const MAX_ALIAS_EXPANSION: usize = 10_000;

/// The YAML parser's budget: bounds on documents, nodes and alias expansion, so one hostile
/// file costs milliseconds, not seconds.
fn yaml_limits() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_documents = MAX_DOCUMENTS;
    // A large `calicoctl get -o yaml` dump is one document with many nodes.
    budget.max_nodes = 5_000_000;
    budget.max_events = 10_000_000;
    budget.max_aliases = 1_000;
    budget.max_recorded_anchor_bytes = 1024 * 1024;
    budget.max_recorded_anchor_events = MAX_ALIAS_EXPANSION;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.alias_limits.max_total_replayed_events = MAX_ALIAS_EXPANSION;
    options
}

/// Decodes and validates one object.
pub fn decode_and_validate(value: serde_json::Value) -> Outcome {
    match Resource::from_value(value) {
        Err(e) => Outcome::Undecodable(e),
        Ok(Decoded::Ignored(kind, name)) => Outcome::Ignored(kind, name),
        Ok(Decoded::Resource(key, res)) => match Valid::check(res) {
            Ok(valid) => Outcome::Valid(key, valid),
            Err(invalid) => Outcome::Invalid(invalid),
        },
    }
}

/// [`decode_and_validate`], and a field Calico's API does not define is an error too, as
/// calicoctl makes it (manifests: `validate`, `compute` and the file datastore).
pub fn decode_and_validate_strict(value: serde_json::Value) -> Outcome {
    let unknown = crate::model::fields::unknown_fields(&value);
    let outcome = decode_and_validate(value);
    if unknown.is_empty() {
        return outcome;
    }
    match outcome {
        Outcome::Valid(key, _) => Outcome::Invalid(Invalid {
            key,
            errors: unknown,
        }),
        Outcome::Invalid(mut invalid) => {
            invalid.errors.extend(unknown);
            Outcome::Invalid(invalid)
        }
        other => other,
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

    /// Nine levels of nine aliases: 412 bytes that would expand to 387 million strings.
    fn alias_bomb() -> String {
        let mut y = String::from("a0: &a0 [x,x,x,x,x,x,x,x,x]\n");
        for i in 1..10 {
            let refs = vec![format!("*a{}", i - 1); 9].join(",");
            y.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
        }
        y
    }

    #[test]
    fn an_alias_bomb_is_refused_quickly() {
        let started = std::time::Instant::now();
        let err = parse_manifest(&alias_bomb()).unwrap_err();
        assert!(matches!(err, SyntaxError::Yaml(_)), "{err}");
        // Not a timing assertion of speed, a guard against expansion: unbounded, this takes
        // minutes and gigabytes.
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // Anchors used sensibly still work.
        let ok = "kind: GlobalNetworkSetList\nitems:\n- kind: GlobalNetworkSet\n  apiVersion: projectcalico.org/v3\n  metadata: {name: a, labels: &l {x: z}}\n  spec: {nets: [10.0.0.0/8]}\n- kind: GlobalNetworkSet\n  apiVersion: projectcalico.org/v3\n  metadata: {name: b, labels: *l}\n  spec: {nets: [10.0.0.0/8]}\n";
        let entries = parse_manifest(ok).unwrap();
        assert_eq!(entries.len(), 2);
        for e in &entries {
            assert!(matches!(e.outcome, Outcome::Valid(..)), "{:?}", e.outcome);
        }
    }

    #[test]
    fn too_many_documents_are_refused_by_count() {
        let many = "---\nkind: X\n".repeat(MAX_DOCUMENTS + 1);
        let err = parse_manifest(&many).unwrap_err().to_string();
        assert!(err.contains("document"), "{err}");
        let json = format!("[{}]", vec!["{}"; MAX_DOCUMENTS + 1].join(","));
        assert!(matches!(
            parse_manifest(&json),
            Err(SyntaxError::TooManyDocuments(n)) if n == MAX_DOCUMENTS + 1
        ));
    }

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
                assert_eq!(inv.errors[0].field, "spec.selector");
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

    /// A misspelt field makes the object invalid (all of its problems listed), so the file
    /// datastore keeps its last good version instead of applying a policy without a selector.
    #[test]
    fn misspelt_fields_make_a_manifest_object_invalid() {
        let text = "apiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {name: p}\nspec:\n  selectr: all()\n  ingress: [{action: allow}]\n";
        let entries = parse_manifest(text).expect("parses");
        let Outcome::Invalid(invalid) = &entries[0].outcome else {
            panic!("{:?}", entries[0].outcome);
        };
        let text = invalid.to_string();
        assert!(
            text.starts_with("GlobalNetworkPolicy p is invalid: "),
            "{text}"
        );
        assert!(text.contains("spec.ingress[0].action"), "{text}");
        assert!(
            text.contains("spec.selectr: unknown field (did you mean \"selector\"?)"),
            "{text}"
        );
        // The same object from etcd or Kubernetes is decoded leniently.
        let value: serde_json::Value = serde_json::json!({"apiVersion": "projectcalico.org/v3",
            "kind": "GlobalNetworkPolicy", "metadata": {"name": "p"},
            "spec": {"selector": "all()", "newField": 1}});
        assert!(matches!(
            decode_and_validate(value.clone()),
            Outcome::Valid(..)
        ));
        assert!(matches!(
            decode_and_validate_strict(value),
            Outcome::Invalid(..)
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
