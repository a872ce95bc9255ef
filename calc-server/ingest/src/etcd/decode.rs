//! One etcd key/value of Calico's v3 layout → a graph resource.
//!
//! Key: `/calico/resources/v3/projectcalico.org/<plural>/[<namespace>/]<name>`; value: the JSON
//! of the v3 object as calicoctl (libcalico-go's `clientv3`) writes it. Before decoding with
//! [`decode_and_validate_strict`] (the path manifests take):
//! - `kind` must be the kind of the key's plural and `apiVersion` `projectcalico.org/v3`, as
//!   Calico's client always writes them: a value without them, or with other ones, is rejected
//!   (so an invalid overwrite such as `{}` keeps the last good version instead of replacing a
//!   policy with an empty one);
//! - `metadata.name` and `metadata.namespace` are taken from the key: the key is the object's
//!   identity in etcd (a value that disagrees is logged at debug and the key wins, so a delete of
//!   the key always removes what its put created);
//! - policies (enforced and staged) get their v3 name back as
//!   `model.determinePolicyName` does: from the `projectcalico.org/metadata` annotation
//!   (`{"name":"<v3 name>"}`) when present, else a legacy `default.` prefix is stripped when the
//!   tier is `default` or empty.
//!
//! Plurals of kinds the graph does not use (BGP, IPAM, …) are skipped without
//! reading the value.

use calc_graph::manifest::{Rejection, decode_and_validate_strict};
use calc_graph::model::Kind;
use calc_graph::untrusted::Untrusted;
use serde_json::{Map, Value};

use super::RESOURCE_PREFIX;
use crate::Decision;

/// The annotation Calico's etcd backend stores a policy's v3 name in.
pub const POLICY_NAME_ANNOTATION: &str = "projectcalico.org/metadata";

/// The graph kind stored under `<plural>`, if any.
pub fn kind_of_plural(plural: &str) -> Option<Kind> {
    Kind::ALL.into_iter().find(|k| k.plural() == plural)
}

/// A key split into kind, namespace (namespaced kinds) and name.
pub type KeyParts<'a> = (Kind, Option<&'a str>, &'a str);

/// A key under a plural the graph reads that is not `<plural>/[<namespace>/]<name>`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error(
        "malformed key: {plural} are namespaced, expected {RESOURCE_PREFIX}{plural}/<namespace>/<name>",
        plural = .0.plural()
    )]
    Namespaced(Kind),
    #[error("malformed key: expected {RESOURCE_PREFIX}{plural}/<name>", plural = .0.plural())]
    Global(Kind),
}

/// Why a value under a key the graph reads is refused before it is decoded (see the module
/// documentation). Values from the datastore are shown escaped and cut.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("value is not valid JSON: {0}")]
    Json(serde_json::Error),
    #[error("value is not a JSON object")]
    NotAnObject,
    #[error("value has no kind (expected {0}, as its key is under {plural})", plural = .0.plural())]
    NoKind(Kind),
    #[error(
        "value has kind {found}, but the key is under {plural} (expected {expected})",
        found = shown(found),
        plural = expected.plural()
    )]
    OtherKind { found: Value, expected: Kind },
    #[error("value has no apiVersion (expected {0})")]
    NoApiVersion(&'static str),
    #[error("value has apiVersion {found}, expected {expected}", found = shown(found))]
    OtherApiVersion {
        found: Value,
        expected: &'static str,
    },
    #[error("metadata is not a JSON object")]
    MetadataNotAnObject,
}

/// Splits a key into its parts. `Ok(None)`: not a key the graph reads.
pub fn parse_key(key: &str) -> Result<Option<KeyParts<'_>>, KeyError> {
    let Some(rest) = key.strip_prefix(RESOURCE_PREFIX) else {
        return Ok(None);
    };
    let Some((plural, path)) = rest.split_once('/') else {
        return Ok(None);
    };
    let Some(kind) = kind_of_plural(plural) else {
        return Ok(None);
    };
    let parts: Vec<&str> = path.split('/').collect();
    match (kind.namespaced(), parts.as_slice()) {
        (true, [ns, name]) if !ns.is_empty() && !name.is_empty() => {
            Ok(Some((kind, Some(*ns), *name)))
        }
        (false, [name]) if !name.is_empty() => Ok(Some((kind, None, *name))),
        (true, _) => Err(KeyError::Namespaced(kind)),
        (false, _) => Err(KeyError::Global(kind)),
    }
}

/// Decodes one key/value (see the module documentation).
pub fn decode(key: &str, value: &[u8]) -> Decision {
    let reject = |e: ValueError| Decision::Reject(Rejection::datastore(e));
    let (kind, namespace, name) = match parse_key(key) {
        Ok(Some(parts)) => parts,
        Ok(None) => return Decision::Skip,
        Err(e) => return reject(e.into()),
    };
    let mut v: Value = match serde_json::from_slice(value) {
        Ok(v) => v,
        Err(e) => return reject(ValueError::Json(e)),
    };
    let Value::Object(obj) = &mut v else {
        return reject(ValueError::NotAnObject);
    };
    // The key says what the value must be; the value must say it too. Calico's client writes
    // both fields on every put, so a value lacking one was written around it.
    match obj.get("kind") {
        Some(Value::String(k)) if k == kind.as_str() => {}
        None | Some(Value::Null) => return reject(ValueError::NoKind(kind)),
        Some(other) => {
            return reject(ValueError::OtherKind {
                found: other.clone(),
                expected: kind,
            });
        }
    }
    let expected = kind.api_version();
    match obj.get("apiVersion") {
        Some(Value::String(v)) if v == expected => {}
        None | Some(Value::Null) => return reject(ValueError::NoApiVersion(expected)),
        Some(other) => {
            return reject(ValueError::OtherApiVersion {
                found: other.clone(),
                expected,
            });
        }
    }
    let tier = obj
        .get("spec")
        .and_then(|s| s.get("tier"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let meta = obj
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if meta.is_null() {
        *meta = Value::Object(Map::new());
    }
    let Value::Object(meta) = meta else {
        return reject(ValueError::MetadataNotAnObject);
    };
    for (field, from_key) in [("name", Some(name)), ("namespace", namespace)] {
        let Some(from_key) = from_key else { continue };
        match meta.get(field).and_then(Value::as_str) {
            Some(v) if v == from_key => {}
            Some(v) if !v.is_empty() => {
                tracing::debug!(%key, field, value = v, "metadata disagrees with the key; the key wins");
                meta.insert(field.into(), from_key.into());
            }
            _ => {
                meta.insert(field.into(), from_key.into());
            }
        }
    }
    if kind.is_policy() {
        let restored = policy_name(meta, name, &tier);
        meta.insert("name".into(), restored.into());
    }
    // calicoctl refuses unknown fields on write; one here was written around it (etcdctl), and
    // a misspelt selector or rule list would change what the policy means.
    Decision::from_outcome(decode_and_validate_strict(v), Vec::new())
}

/// A value from the datastore, for a message: a string quoted and escaped (and cut), another
/// JSON type by its type alone.
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{:?}", Untrusted(s)),
        Value::Null => "null".into(),
        Value::Bool(_) => "a boolean".into(),
        Value::Number(_) => "a number".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// `model.determinePolicyName`: the annotation's name, else `default.` stripped in the default
/// tier, else the stored name.
fn policy_name(meta: &Map<String, Value>, stored: &str, tier: &str) -> String {
    let annotated = meta
        .get("annotations")
        .and_then(|a| a.get(POLICY_NAME_ANNOTATION))
        .and_then(Value::as_str)
        .and_then(|s| serde_json::from_str::<Value>(s).ok())
        .and_then(|m| m.get("name").and_then(Value::as_str).map(str::to_string))
        .filter(|n| !n.is_empty());
    if let Some(n) = annotated {
        return n;
    }
    if (tier.is_empty() || tier == "default")
        && let Some(stripped) = stored.strip_prefix("default.").filter(|s| !s.is_empty())
    {
        return stripped.to_string();
    }
    stored.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use calc_graph::model::{Resource, ResourceKey};

    fn applied(key: &str, value: &str) -> Resource {
        match decode(key, value.as_bytes()) {
            Decision::Apply { resource, .. } => resource.into_resource(),
            other => panic!("{key}: expected Apply, got {other:?}"),
        }
    }

    fn rejected(key: &str, value: &str) -> String {
        match decode(key, value.as_bytes()) {
            Decision::Reject(r) => r.to_string(),
            other => panic!("{key}: expected Reject, got {other:?}"),
        }
    }

    const P: &str = RESOURCE_PREFIX;

    #[test]
    fn calicoctl_examples_decode() {
        let tier = applied(
            &format!("{P}tiers/default"),
            r#"{"kind":"Tier","apiVersion":"projectcalico.org/v3","metadata":{"name":"default","uid":"6f1c2d0e-0c4e-4c55-9d1e-2b7c3e1d9a10","creationTimestamp":"2025-06-01T12:00:00Z"},"spec":{"order":1000000,"defaultAction":"Deny"}}"#,
        );
        assert_eq!(tier.key(), ResourceKey::new(Kind::Tier, None, "default"));
        let np = applied(
            &format!("{P}networkpolicies/prod/allow-frontend"),
            r#"{"kind":"NetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"allow-frontend","namespace":"prod","uid":"b3f1","creationTimestamp":"2025-06-01T12:00:00Z","labels":{"projectcalico.org/tier":"default"},"annotations":{"projectcalico.org/metadata":"{\"name\":\"allow-frontend\"}"}},"spec":{"order":100,"ingress":[{"action":"Allow","protocol":"TCP","source":{"selector":"role == 'frontend'"},"destination":{"ports":[8080]}}],"selector":"app == 'backend'","types":["Ingress"]}}"#,
        );
        assert_eq!(
            np.key(),
            ResourceKey::new(Kind::NetworkPolicy, Some("prod"), "allow-frontend")
        );
        let wep = applied(
            &format!("{P}workloadendpoints/default/node1-k8s-nginx--5d8f-eth0"),
            r#"{"kind":"WorkloadEndpoint","apiVersion":"projectcalico.org/v3","metadata":{"name":"node1-k8s-nginx--5d8f-eth0","namespace":"default","uid":"x","creationTimestamp":"2025-06-01T12:00:00Z","labels":{"app":"nginx","projectcalico.org/namespace":"default","projectcalico.org/orchestrator":"k8s"}},"spec":{"orchestrator":"k8s","node":"node1","containerID":"4a1b","pod":"nginx-5d8f","endpoint":"eth0","serviceAccountName":"default","ipNetworks":["10.65.0.5/32"],"profiles":["kns.default","ksa.default.default"],"interfaceName":"calia37792c9b43","mac":"ee:ee:ee:ee:ee:ee"}}"#,
        );
        assert_eq!(wep.kind(), Kind::WorkloadEndpoint);
        assert_eq!(wep.meta().namespace.as_deref(), Some("default"));
    }

    #[test]
    fn policy_names_are_restored() {
        // Annotation wins over the stored (backend) name.
        let r = applied(
            &format!("{P}globalnetworkpolicies/default.allow-dns"),
            r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"default.allow-dns","annotations":{"projectcalico.org/metadata":"{\"name\":\"allow-dns\"}"}},"spec":{"selector":"all()"}}"#,
        );
        assert_eq!(r.meta().name, "allow-dns");
        // Legacy key without annotation: `default.` stripped in the default (or empty) tier.
        let r = applied(
            &format!("{P}globalnetworkpolicies/default.legacy"),
            r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"default.legacy"},"spec":{"selector":"all()"}}"#,
        );
        assert_eq!(r.meta().name, "legacy");
        let r = applied(
            &format!("{P}networkpolicies/ns1/default.legacy"),
            r#"{"kind":"NetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{},"spec":{"tier":"default","selector":"all()"}}"#,
        );
        assert_eq!(
            r.key(),
            ResourceKey::new(Kind::NetworkPolicy, Some("ns1"), "legacy")
        );
        // Another tier keeps its prefixed name.
        let r = applied(
            &format!("{P}globalnetworkpolicies/security.block"),
            r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"security.block"},"spec":{"tier":"security","selector":"all()"}}"#,
        );
        assert_eq!(r.meta().name, "security.block");
        // A `default.` name in another tier is not stripped.
        let r = applied(
            &format!("{P}globalnetworkpolicies/default.x"),
            r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"default.x"},"spec":{"tier":"platform","selector":"all()"}}"#,
        );
        assert_eq!(r.meta().name, "default.x");
    }

    #[test]
    fn metadata_name_and_namespace_come_from_the_key() {
        let r = applied(
            &format!("{P}networksets/ns2/blocked"),
            r#"{"kind":"NetworkSet","apiVersion":"projectcalico.org/v3","spec":{"nets":["10.0.0.0/8"]}}"#,
        );
        assert_eq!(
            r.key(),
            ResourceKey::new(Kind::NetworkSet, Some("ns2"), "blocked")
        );
        // The key is the identity: a disagreeing value does not move the object elsewhere.
        let r = applied(
            &format!("{P}networksets/ns2/blocked"),
            r#"{"kind":"NetworkSet","apiVersion":"projectcalico.org/v3","metadata":{"name":"other","namespace":"ns3"},"spec":{}}"#,
        );
        assert_eq!(
            r.key(),
            ResourceKey::new(Kind::NetworkSet, Some("ns2"), "blocked")
        );
    }

    /// Calico's client writes kind and apiVersion on every put. A value without them (`{}`, or
    /// an object with only metadata and spec) would otherwise decode as an empty object of the
    /// key's kind: an empty policy replacing a deny. It is rejected like a wrong kind, so the
    /// last good version stays.
    #[test]
    fn a_value_without_its_kind_or_api_version_is_rejected() {
        let key = format!("{P}globalnetworkpolicies/rel-guard");
        let good = r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"rel-guard"},"spec":{"selector":"all()","ingress":[{"action":"Deny"}]}}"#;
        assert_eq!(applied(&key, good).meta().name, "rel-guard");
        for (value, reason) in [
            ("{}", "no kind"),
            (r#"{"metadata":{"name":"rel-guard"},"spec":{}}"#, "no kind"),
            (
                r#"{"kind":null,"apiVersion":"projectcalico.org/v3"}"#,
                "no kind",
            ),
            (
                r#"{"kind":"GlobalNetworkPolicy","spec":{}}"#,
                "no apiVersion",
            ),
            (
                r#"{"apiVersion":"projectcalico.org/v3","metadata":{"name":"rel-guard"},"spec":{}}"#,
                "no kind",
            ),
            (
                r#"{"kind":"GlobalNetworkPolicy","apiVersion":null,"spec":{}}"#,
                "no apiVersion",
            ),
            (
                r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v2","spec":{}}"#,
                "apiVersion \"projectcalico.org/v2\"",
            ),
            (
                r#"{"kind":"GlobalNetworkPolicy","apiVersion":3,"spec":{}}"#,
                "apiVersion a number",
            ),
            (
                r#"{"kind":"NetworkPolicy","apiVersion":"projectcalico.org/v3","spec":{}}"#,
                "kind \"NetworkPolicy\"",
            ),
            (
                r#"{"kind":["GlobalNetworkPolicy"],"apiVersion":"projectcalico.org/v3"}"#,
                "kind an array",
            ),
        ] {
            let Decision::Reject(r) = decode(&key, value.as_bytes()) else {
                panic!("{value}: must be rejected");
            };
            assert_eq!(
                r.stage(),
                calc_graph::manifest::RejectStage::Decode,
                "{value}"
            );
            assert!(r.to_string().contains(reason), "{value}: {r}");
        }
        // The kind is named for the operator; hostile text in it is escaped and cut.
        let hostile = format!(
            r#"{{"kind":"GlobalNetworkPolicy\nINFO forged {}","apiVersion":"projectcalico.org/v3"}}"#,
            "x".repeat(10_000)
        );
        let reason = rejected(&key, &hostile);
        assert!(!reason.contains('\n') && reason.len() < 1024, "{reason}");
        assert!(
            reason.contains("GlobalNetworkPolicy\\nINFO forged"),
            "{reason}"
        );
    }

    #[test]
    fn staged_policies_are_read_under_their_plurals() {
        let r = applied(
            &format!("{P}stagednetworkpolicies/ns/x"),
            r#"{"kind":"StagedNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"x","namespace":"ns"},"spec":{"stagedAction":"Set","selector":"all()"}}"#,
        );
        assert_eq!(
            r.key(),
            ResourceKey::new(Kind::StagedNetworkPolicy, Some("ns"), "x")
        );
        let r = applied(
            &format!("{P}stagedkubernetesnetworkpolicies/ns/k"),
            r#"{"kind":"StagedKubernetesNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"k","namespace":"ns"},"spec":{"podSelector":{},"policyTypes":["Ingress"]}}"#,
        );
        assert_eq!(
            r.key(),
            ResourceKey::new(Kind::StagedKubernetesNetworkPolicy, Some("ns"), "k")
        );
    }

    #[test]
    fn other_key_families_are_skipped() {
        for key in [
            format!("{P}bgppeers/rr1"),
            format!("{P}bgpfilters/f1"),
            // Not Calico resources: never under Calico's etcd prefix.
            format!("{P}clusternetworkpolicies/x"),
            format!("{P}adminnetworkpolicies/x"),
            format!("{P}kubecontrollersconfigurations/default"),
            "/calico/ipam/v2/assignment/ipv4/block/10.65.0.0-26".to_string(),
            format!("{P}tiers"),
        ] {
            assert!(matches!(decode(&key, b"not json"), Decision::Skip), "{key}");
        }
    }

    #[test]
    fn bad_values_are_rejected_with_a_reason() {
        assert!(rejected(&format!("{P}tiers/t"), "{not json").contains("not valid JSON"));
        assert!(rejected(&format!("{P}tiers/t"), "[1]").contains("not a JSON object"));
        assert!(
            rejected(
                &format!("{P}tiers/t"),
                r#"{"kind":"Profile","apiVersion":"projectcalico.org/v3","metadata":{"name":"t"}}"#
            )
            .contains("kind \"Profile\"")
        );
        let r = rejected(
            &format!("{P}globalnetworkpolicies/p"),
            r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"p"},"spec":{"selector":"a ="}}"#,
        );
        assert!(r.contains("GlobalNetworkPolicy p"), "{r}");
        assert!(rejected(&format!("{P}workloadendpoints/only-name"), "{}").contains("malformed"));
        assert!(rejected(&format!("{P}tiers/a/b"), "{}").contains("malformed"));
        assert_eq!(
            rejected(&format!("{P}workloadendpoints/only-name"), "{}"),
            format!(
                "malformed key: workloadendpoints are namespaced, expected \
                 {P}workloadendpoints/<namespace>/<name>"
            )
        );
        assert_eq!(
            rejected(&format!("{P}tiers/a/b"), "{}"),
            format!("malformed key: expected {P}tiers/<name>")
        );
        assert_eq!(
            rejected(
                &format!("{P}tiers/t"),
                r#"{"apiVersion":"projectcalico.org/v3"}"#
            ),
            "value has no kind (expected Tier, as its key is under tiers)"
        );
    }

    #[test]
    fn a_misspelt_field_rejects_the_value_by_name() {
        let key = format!("{P}globalnetworkpolicies/default.typo");
        let value = r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","spec":{"tier":"default","selectr":"app == 'web'","ingres":[{"action":"Allow"}]}}"#;
        let Decision::Reject(r) = decode(&key, value.as_bytes()) else {
            panic!("a value with unknown fields must be rejected");
        };
        assert_eq!(r.stage(), calc_graph::manifest::RejectStage::UnknownField);
        let Rejection::Invalid(invalid) = &r else {
            panic!("{r:?}");
        };
        let fields: Vec<&str> = invalid.errors.iter().map(|e| e.field.as_str()).collect();
        assert!(fields.contains(&"spec.selectr"), "{r}");
        assert!(fields.contains(&"spec.ingres"), "{r}");
        assert!(r.to_string().contains("did you mean \"selector\""), "{r}");
        // A value that is merely invalid counts as validation.
        let Decision::Reject(r) = decode(
            &format!("{P}tiers/t"),
            br#"{"kind":"Tier","apiVersion":"projectcalico.org/v3","spec":{"order":1,"defaultAction":"Maybe"}}"#,
        ) else {
            panic!("an invalid tier must be rejected");
        };
        assert_eq!(
            r.stage(),
            calc_graph::manifest::RejectStage::Validation,
            "{r}"
        );
    }
}
