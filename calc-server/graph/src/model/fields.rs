//! The fields Calico's v3 API defines, per kind, so that a typo (`selectr:`, `ingres:`) is caught
//! by name instead of silently dropping the field (a policy without its selector applies to
//! every endpoint; one without its rules denies everything).
//!
//! Contract: [`unknown_fields`] returns every field of an object that Calico's API does not
//! define, each as a [`FieldError`] with its path (`spec.ingress[0].sourc`) and, for a near miss,
//! the field meant. It checks names only (shapes and values are the decoder's and the validator's
//! job) and never fails: a value of the wrong type is not descended into. The top level and
//! `metadata` are checked for every kind; specs for the kinds described here (the policy kinds,
//! the network-policy-api kinds and Kubernetes' NetworkPolicy, whose rules are checked to the
//! last field, tiers, profiles, endpoints, network sets, IP pools and Kubernetes' Namespace). The
//! network-policy-api kinds' decoder ignores fields it does not know (so that a peer of a newer
//! API fails closed instead of failing the object), so their whole spec is described here.
//! Kinds the dataplane ignores, and specs not described here (FelixConfiguration, Node, the
//! Kubernetes kinds Service and EndpointSlice, whose top-level `addressType`, `endpoints` and
//! `ports` are accepted), are not checked.

use serde_json::Value;

use super::validate::FieldError;

/// What a field may hold, as far as names go.
enum Shape {
    /// Anything: a scalar, a free-form map (labels), or a structure not checked.
    Any,
    /// An object with exactly these fields.
    Object(&'static [(&'static str, Shape)]),
    /// A list of the inner shape.
    List(&'static Shape),
}

const ANY: Shape = Shape::Any;

const ICMP: Shape = Shape::Object(&[("type", ANY), ("code", ANY)]);

const ENTITY_RULE: Shape = Shape::Object(&[
    ("nets", ANY),
    ("notNets", ANY),
    ("selector", ANY),
    ("notSelector", ANY),
    ("namespaceSelector", ANY),
    ("ports", ANY),
    ("notPorts", ANY),
    (
        "services",
        Shape::Object(&[("name", ANY), ("namespace", ANY)]),
    ),
    (
        "serviceAccounts",
        Shape::Object(&[("names", ANY), ("selector", ANY)]),
    ),
]);

const HTTP_PATH: Shape = Shape::Object(&[("exact", ANY), ("prefix", ANY)]);

const RULE: Shape = Shape::Object(&[
    ("action", ANY),
    ("ipVersion", ANY),
    ("protocol", ANY),
    ("notProtocol", ANY),
    ("icmp", ICMP),
    ("notICMP", ICMP),
    ("source", ENTITY_RULE),
    ("destination", ENTITY_RULE),
    (
        "http",
        Shape::Object(&[("methods", ANY), ("paths", Shape::List(&HTTP_PATH))]),
    ),
    ("metadata", Shape::Object(&[("annotations", ANY)])),
]);

const RULES: Shape = Shape::List(&RULE);

const NETWORK_POLICY: Shape = Shape::Object(&[
    ("tier", ANY),
    ("order", ANY),
    ("selector", ANY),
    ("types", ANY),
    ("ingress", RULES),
    ("egress", RULES),
    ("serviceAccountSelector", ANY),
    ("performanceHints", ANY),
]);

const GLOBAL_NETWORK_POLICY: Shape = Shape::Object(&[
    ("tier", ANY),
    ("order", ANY),
    ("selector", ANY),
    ("types", ANY),
    ("ingress", RULES),
    ("egress", RULES),
    ("serviceAccountSelector", ANY),
    ("performanceHints", ANY),
    ("doNotTrack", ANY),
    ("preDNAT", ANY),
    ("applyOnForward", ANY),
    ("namespaceSelector", ANY),
]);

const STAGED_NETWORK_POLICY: Shape = Shape::Object(&[
    ("stagedAction", ANY),
    ("tier", ANY),
    ("order", ANY),
    ("selector", ANY),
    ("types", ANY),
    ("ingress", RULES),
    ("egress", RULES),
    ("serviceAccountSelector", ANY),
    ("performanceHints", ANY),
]);

const STAGED_GLOBAL_NETWORK_POLICY: Shape = Shape::Object(&[
    ("stagedAction", ANY),
    ("tier", ANY),
    ("order", ANY),
    ("selector", ANY),
    ("types", ANY),
    ("ingress", RULES),
    ("egress", RULES),
    ("serviceAccountSelector", ANY),
    ("performanceHints", ANY),
    ("doNotTrack", ANY),
    ("preDNAT", ANY),
    ("applyOnForward", ANY),
    ("namespaceSelector", ANY),
]);

// Kubernetes' NetworkPolicy (`networking.k8s.io/v1`), whose typed decoder ignores fields it
// does not know: a misspelt `from` would otherwise be a rule that allows every source.

const K8S_IP_BLOCK: Shape = Shape::Object(&[("cidr", ANY), ("except", ANY)]);

const K8S_PEER: Shape = Shape::Object(&[
    ("podSelector", LABEL_SELECTOR),
    ("namespaceSelector", LABEL_SELECTOR),
    ("ipBlock", K8S_IP_BLOCK),
]);

const K8S_PORT: Shape = Shape::Object(&[("protocol", ANY), ("port", ANY), ("endPort", ANY)]);

const K8S_INGRESS_RULE: Shape = Shape::Object(&[
    ("from", Shape::List(&K8S_PEER)),
    ("ports", Shape::List(&K8S_PORT)),
]);

const K8S_EGRESS_RULE: Shape = Shape::Object(&[
    ("to", Shape::List(&K8S_PEER)),
    ("ports", Shape::List(&K8S_PORT)),
]);

const KUBERNETES_NETWORK_POLICY: Shape = Shape::Object(&[
    ("podSelector", LABEL_SELECTOR),
    ("ingress", Shape::List(&K8S_INGRESS_RULE)),
    ("egress", Shape::List(&K8S_EGRESS_RULE)),
    ("policyTypes", ANY),
]);

/// A Kubernetes NetworkPolicy spec plus `stagedAction`.
const STAGED_KUBERNETES_NETWORK_POLICY: Shape = Shape::Object(&[
    ("stagedAction", ANY),
    ("podSelector", LABEL_SELECTOR),
    ("ingress", Shape::List(&K8S_INGRESS_RULE)),
    ("egress", Shape::List(&K8S_EGRESS_RULE)),
    ("policyTypes", ANY),
]);

/// Kubernetes' Namespace (`v1`): only its metadata matters here.
const NAMESPACE: Shape = Shape::Object(&[("finalizers", ANY)]);

// The network-policy-api kinds (`policy.networking.k8s.io`), as their CRDs define them.

const MATCH_EXPRESSION: Shape = Shape::Object(&[("key", ANY), ("operator", ANY), ("values", ANY)]);

/// Kubernetes' LabelSelector.
const LABEL_SELECTOR: Shape = Shape::Object(&[
    ("matchLabels", ANY),
    ("matchExpressions", Shape::List(&MATCH_EXPRESSION)),
]);

const NAMESPACED_POD: Shape = Shape::Object(&[
    ("namespaceSelector", LABEL_SELECTOR),
    ("podSelector", LABEL_SELECTOR),
]);

const NPA_SUBJECT: Shape =
    Shape::Object(&[("namespaces", LABEL_SELECTOR), ("pods", NAMESPACED_POD)]);

const NPA_INGRESS_PEER: Shape =
    Shape::Object(&[("namespaces", LABEL_SELECTOR), ("pods", NAMESPACED_POD)]);

/// `nodes` and `domainNames` are the API's (and make a rule fail closed), not typos.
const NPA_EGRESS_PEER: Shape = Shape::Object(&[
    ("namespaces", LABEL_SELECTOR),
    ("pods", NAMESPACED_POD),
    ("nodes", LABEL_SELECTOR),
    ("networks", ANY),
    ("domainNames", ANY),
]);

const CNP_PORT_MATCH: Shape = Shape::Object(&[(
    "destinationPort",
    Shape::Object(&[
        ("number", ANY),
        ("range", Shape::Object(&[("start", ANY), ("end", ANY)])),
    ]),
)]);

const CNP_PROTOCOL: Shape = Shape::Object(&[
    ("tcp", CNP_PORT_MATCH),
    ("udp", CNP_PORT_MATCH),
    ("sctp", CNP_PORT_MATCH),
    ("destinationNamedPort", ANY),
]);

const CNP_INGRESS_RULE: Shape = Shape::Object(&[
    ("name", ANY),
    ("action", ANY),
    ("from", Shape::List(&NPA_INGRESS_PEER)),
    ("protocols", Shape::List(&CNP_PROTOCOL)),
]);

const CNP_EGRESS_RULE: Shape = Shape::Object(&[
    ("name", ANY),
    ("action", ANY),
    ("to", Shape::List(&NPA_EGRESS_PEER)),
    ("protocols", Shape::List(&CNP_PROTOCOL)),
]);

const CLUSTER_NETWORK_POLICY: Shape = Shape::Object(&[
    ("tier", ANY),
    ("priority", ANY),
    ("subject", NPA_SUBJECT),
    ("ingress", Shape::List(&CNP_INGRESS_RULE)),
    ("egress", Shape::List(&CNP_EGRESS_RULE)),
]);

const ANP_PORT: Shape = Shape::Object(&[
    (
        "portNumber",
        Shape::Object(&[("protocol", ANY), ("port", ANY)]),
    ),
    ("namedPort", ANY),
    (
        "portRange",
        Shape::Object(&[("protocol", ANY), ("start", ANY), ("end", ANY)]),
    ),
]);

const ANP_INGRESS_RULE: Shape = Shape::Object(&[
    ("name", ANY),
    ("action", ANY),
    ("from", Shape::List(&NPA_INGRESS_PEER)),
    ("ports", Shape::List(&ANP_PORT)),
]);

const ANP_EGRESS_RULE: Shape = Shape::Object(&[
    ("name", ANY),
    ("action", ANY),
    ("to", Shape::List(&NPA_EGRESS_PEER)),
    ("ports", Shape::List(&ANP_PORT)),
]);

const ADMIN_NETWORK_POLICY: Shape = Shape::Object(&[
    ("priority", ANY),
    ("subject", NPA_SUBJECT),
    ("ingress", Shape::List(&ANP_INGRESS_RULE)),
    ("egress", Shape::List(&ANP_EGRESS_RULE)),
]);

const BASELINE_ADMIN_NETWORK_POLICY: Shape = Shape::Object(&[
    ("subject", NPA_SUBJECT),
    ("ingress", Shape::List(&ANP_INGRESS_RULE)),
    ("egress", Shape::List(&ANP_EGRESS_RULE)),
]);

const PROFILE: Shape = Shape::Object(&[
    ("ingress", RULES),
    ("egress", RULES),
    ("labelsToApply", ANY),
]);

const TIER: Shape = Shape::Object(&[("order", ANY), ("defaultAction", ANY)]);

const HOST_ENDPOINT_PORT: Shape = Shape::Object(&[("name", ANY), ("protocol", ANY), ("port", ANY)]);

const HOST_ENDPOINT: Shape = Shape::Object(&[
    ("node", ANY),
    ("interfaceName", ANY),
    ("expectedIPs", ANY),
    ("profiles", ANY),
    ("ports", Shape::List(&HOST_ENDPOINT_PORT)),
]);

const NETWORK_SET: Shape = Shape::Object(&[("nets", ANY)]);

const IP_POOL: Shape = Shape::Object(&[
    ("cidr", ANY),
    ("vxlanMode", ANY),
    ("ipipMode", ANY),
    ("natOutgoing", ANY),
    ("disabled", ANY),
    ("disableBGPExport", ANY),
    ("blockSize", ANY),
    ("nodeSelector", ANY),
    ("namespaceSelector", ANY),
    ("allowedUses", ANY),
    ("assignmentMode", ANY),
    // Deprecated v3 spellings Calico still reads.
    ("ipip", ANY),
    ("nat-outgoing", ANY),
]);

const WORKLOAD_ENDPOINT_PORT: Shape = Shape::Object(&[
    ("name", ANY),
    ("protocol", ANY),
    ("port", ANY),
    ("hostPort", ANY),
    ("hostIP", ANY),
]);

const WORKLOAD_ENDPOINT: Shape = Shape::Object(&[
    ("orchestrator", ANY),
    ("workload", ANY),
    ("node", ANY),
    ("containerID", ANY),
    ("pod", ANY),
    ("endpoint", ANY),
    ("serviceAccountName", ANY),
    ("ipNetworks", ANY),
    ("ipNATs", ANY),
    ("ipv4Gateway", ANY),
    ("ipv6Gateway", ANY),
    ("profiles", ANY),
    ("interfaceName", ANY),
    ("mac", ANY),
    ("ports", Shape::List(&WORKLOAD_ENDPOINT_PORT)),
    ("allowSpoofedSourcePrefixes", ANY),
    ("qosControls", ANY),
    ("awsElasticIPs", ANY),
]);

/// Kubernetes' ObjectMeta, which every Calico resource carries.
const METADATA: Shape = Shape::Object(&[
    ("name", ANY),
    ("generateName", ANY),
    ("namespace", ANY),
    ("selfLink", ANY),
    ("uid", ANY),
    ("resourceVersion", ANY),
    ("generation", ANY),
    ("creationTimestamp", ANY),
    ("deletionTimestamp", ANY),
    ("deletionGracePeriodSeconds", ANY),
    ("labels", ANY),
    ("annotations", ANY),
    ("ownerReferences", ANY),
    ("finalizers", ANY),
    ("managedFields", ANY),
]);

/// Fields a kind has beside `apiVersion`, `kind`, `metadata` and `spec`, whose insides are not
/// checked: a Kubernetes EndpointSlice keeps its fields at the top level.
fn top_level_extra(kind: &str) -> &'static [&'static str] {
    match kind {
        "EndpointSlice" => &["addressType", "endpoints", "ports"],
        _ => &[],
    }
}

/// The spec's shape for a kind, by its name and `apiVersion` (`None`: not checked).
fn spec_shape(kind: &str, api_version: &str) -> Option<&'static Shape> {
    use super::kubernetes::Native;
    Some(match kind {
        _ if Native::of(kind, api_version) == Some(Native::NetworkPolicy) => {
            &KUBERNETES_NETWORK_POLICY
        }
        _ if Native::of(kind, api_version) == Some(Native::Namespace) => &NAMESPACE,
        "NetworkPolicy" => &NETWORK_POLICY,
        "GlobalNetworkPolicy" => &GLOBAL_NETWORK_POLICY,
        "StagedNetworkPolicy" => &STAGED_NETWORK_POLICY,
        "StagedGlobalNetworkPolicy" => &STAGED_GLOBAL_NETWORK_POLICY,
        "StagedKubernetesNetworkPolicy" => &STAGED_KUBERNETES_NETWORK_POLICY,
        "ClusterNetworkPolicy" => &CLUSTER_NETWORK_POLICY,
        "AdminNetworkPolicy" => &ADMIN_NETWORK_POLICY,
        "BaselineAdminNetworkPolicy" => &BASELINE_ADMIN_NETWORK_POLICY,
        "Profile" => &PROFILE,
        "Tier" => &TIER,
        "HostEndpoint" => &HOST_ENDPOINT,
        "NetworkSet" | "GlobalNetworkSet" => &NETWORK_SET,
        "IPPool" => &IP_POOL,
        "WorkloadEndpoint" => &WORKLOAD_ENDPOINT,
        _ => return None,
    })
}

/// Every field of `object` (a whole v3 resource) that Calico's API does not define; empty for a
/// kind whose spec is not described here beyond the top level and metadata.
pub fn unknown_fields(object: &Value) -> Vec<FieldError> {
    let mut out = Vec::new();
    let Value::Object(top) = object else {
        return out;
    };
    let kind = top.get("kind").and_then(Value::as_str).unwrap_or_default();
    let api_version = top
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let extra = top_level_extra(kind);
    let mut path = Vec::new();
    for (name, value) in top {
        path.clear();
        path.push(Seg::Field(name));
        match name.as_str() {
            "apiVersion" | "kind" | "status" => {}
            n if extra.contains(&n) => {}
            "metadata" => walk(&METADATA, value, &mut path, &mut out),
            "spec" => {
                if let Some(shape) = spec_shape(kind, api_version) {
                    walk(shape, value, &mut path, &mut out);
                }
            }
            _ => out.push(unknown(
                name.clone(),
                name,
                ["apiVersion", "kind", "metadata", "spec"]
                    .into_iter()
                    .chain(extra.iter().copied()),
            )),
        }
    }
    out
}

/// One step of a field's path; the path is only written out for an unknown field.
enum Seg<'a> {
    Field(&'a str),
    Index(usize),
}

/// `spec.ingress[0].source`.
fn render(path: &[Seg<'_>]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Field(name) if out.is_empty() => out.push_str(name),
            Seg::Field(name) => {
                out.push('.');
                out.push_str(name);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

fn walk<'a>(shape: &Shape, value: &'a Value, path: &mut Vec<Seg<'a>>, out: &mut Vec<FieldError>) {
    match (shape, value) {
        (Shape::Object(fields), Value::Object(map)) => {
            for (name, v) in map {
                path.push(Seg::Field(name));
                match fields.iter().find(|(f, _)| f == name) {
                    Some((_, inner)) => walk(inner, v, path, out),
                    None => out.push(unknown(render(path), name, fields.iter().map(|(f, _)| *f))),
                }
                path.pop();
            }
        }
        (Shape::List(inner), Value::Array(items)) => {
            for (i, v) in items.iter().enumerate() {
                path.push(Seg::Index(i));
                walk(inner, v, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}

/// How every unknown-field error's message starts (callers count them apart).
pub const UNKNOWN_FIELD: &str = "unknown field";

/// Whether `e` is one of [`unknown_fields`]' errors.
pub fn is_unknown_field(e: &FieldError) -> bool {
    e.reason.starts_with(UNKNOWN_FIELD)
}

fn unknown<'a>(path: String, name: &str, known: impl Iterator<Item = &'a str>) -> FieldError {
    let message = match did_you_mean(name, known) {
        Some(meant) => format!("{UNKNOWN_FIELD} (did you mean \"{meant}\"?)"),
        None => UNKNOWN_FIELD.to_owned(),
    };
    FieldError::new(path, message)
}

/// The known field closest to `name`, if it is a near miss: the same but for case, or at most
/// two edits away (one for short names).
fn did_you_mean<'a>(name: &str, known: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let limit = if name.chars().count() <= 4 { 1 } else { 2 };
    known
        .map(|k| {
            let d = if k.eq_ignore_ascii_case(name) {
                0
            } else {
                edit_distance(&name.to_ascii_lowercase(), &k.to_ascii_lowercase())
            };
            (d, k)
        })
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Levenshtein distance over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = if ca == *cb {
                diagonal
            } else {
                1 + diagonal.min(above).min(row[j])
            };
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn shown(errors: &[FieldError]) -> Vec<String> {
        errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn typos_are_named_with_the_field_meant() {
        let gnp = json!({
            "apiVersion": "projectcalico.org/v3",
            "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "deny-db", "lables": {"a": "b"}},
            "spec": {
                "selectr": "app == 'db'",
                "ingres": [{"action": "Deny"}],
                "egress": [{"action": "Allow", "destination": {"prots": [53], "selector": "x"},
                            "icmp": {"type": 8, "cod": 0}, "http": {"paths": [{"exct": "/"}]}}],
                "order": 10,
                "frobnicate": true,
                "notICMP": {},
            },
            "extra": 1,
        });
        let mut got = shown(&unknown_fields(&gnp));
        got.sort();
        assert_eq!(
            got,
            [
                "extra: unknown field",
                "metadata.lables: unknown field (did you mean \"labels\"?)",
                "spec.egress[0].destination.prots: unknown field (did you mean \"ports\"?)",
                "spec.egress[0].http.paths[0].exct: unknown field (did you mean \"exact\"?)",
                "spec.egress[0].icmp.cod: unknown field (did you mean \"code\"?)",
                "spec.frobnicate: unknown field",
                "spec.ingres: unknown field (did you mean \"ingress\"?)",
                "spec.notICMP: unknown field",
                "spec.selectr: unknown field (did you mean \"selector\"?)",
            ]
        );
    }

    #[test]
    fn every_field_calico_defines_is_accepted() {
        let rule = json!({
            "action": "Allow", "ipVersion": 4, "protocol": "TCP", "notProtocol": "UDP",
            "icmp": {"type": 8, "code": 0}, "notICMP": {"type": 0},
            "source": {"nets": [], "notNets": [], "selector": "a", "notSelector": "b",
                       "namespaceSelector": "c", "ports": [1], "notPorts": [2],
                       "services": {"name": "s", "namespace": "n"},
                       "serviceAccounts": {"names": ["x"], "selector": "y"}},
            "destination": {},
            "http": {"methods": ["GET"], "paths": [{"exact": "/"}, {"prefix": "/a"}]},
            "metadata": {"annotations": {"k": "v"}},
        });
        let objects = [
            json!({"apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
                   "metadata": {"name": "p", "uid": "u", "resourceVersion": "1",
                                "creationTimestamp": null, "labels": {}, "annotations": {},
                                "generation": 2, "managedFields": []},
                   "spec": {"tier": "default", "order": 1, "selector": "all()",
                            "types": ["Ingress"], "ingress": [rule.clone()], "egress": [rule.clone()],
                            "serviceAccountSelector": "", "performanceHints": [],
                            "doNotTrack": false, "preDNAT": false, "applyOnForward": true,
                            "namespaceSelector": ""}}),
            json!({"apiVersion": "projectcalico.org/v3", "kind": "Profile",
                   "metadata": {"name": "kns.a"},
                   "spec": {"ingress": [rule], "egress": [], "labelsToApply": {"a": "b"}}}),
            json!({"apiVersion": "projectcalico.org/v3", "kind": "HostEndpoint",
                   "metadata": {"name": "h"},
                   "spec": {"node": "n", "interfaceName": "eth0", "expectedIPs": [],
                            "profiles": [], "ports": [{"name": "a", "protocol": "TCP", "port": 1}]}}),
            json!({"apiVersion": "projectcalico.org/v3", "kind": "IPPool",
                   "metadata": {"name": "p"},
                   "spec": {"cidr": "10.0.0.0/16", "vxlanMode": "Never", "natOutgoing": true,
                            "allowedUses": ["Workload"], "assignmentMode": "Automatic"}}),
            json!({"apiVersion": "projectcalico.org/v3", "kind": "FelixConfiguration",
                   "metadata": {"name": "default"}, "spec": {"anyFieldAtAll": 1}}),
            json!({"apiVersion": "projectcalico.org/v3", "kind": "Node",
                   "metadata": {"name": "n"}, "spec": {"bgp": {}}, "status": {"x": 1}}),
            // Kubernetes objects: their insides are not checked.
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": "web-x1", "namespace": "prod", "generateName": "web-",
                                "ownerReferences": [{"kind": "Service", "name": "web"}]},
                   "addressType": "IPv4",
                   "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": true},
                                  "nodeName": "n", "targetRef": {"kind": "Pod"}}],
                   "ports": [{"name": "http", "protocol": "TCP", "port": 80, "appProtocol": "http"}]}),
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": "web", "namespace": "prod"},
                   "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}],
                            "clusterIP": "10.96.0.10", "type": "ClusterIP"},
                   "status": {"loadBalancer": {}}}),
        ];
        for o in objects {
            assert_eq!(shown(&unknown_fields(&o)), Vec::<String>::new(), "{o}");
        }
    }

    /// Kubernetes' NetworkPolicy is checked by its own fields (a misspelt `from` would allow
    /// every source), as is the staged kind that carries its spec; a Namespace's spec too.
    #[test]
    fn kubernetes_network_policy_fields_are_its_own() {
        let spec = json!({
            "podSelector": {"matchLabels": {"role": "db"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": []}},
                                  {"namespaceSelector": {"matchExpressions": [
                                      {"key": "a", "operator": "In", "values": ["b"]}]},
                                   "podSelector": {}}],
                         "ports": [{"protocol": "TCP", "port": 80, "endPort": 90}]}],
            "egress": [{"to": [{"podSelector": {}}], "ports": [{"port": "dns"}]}],
        });
        let knp = |spec: &Value| {
            json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                   "metadata": {"name": "p", "namespace": "prod"}, "spec": spec})
        };
        assert_eq!(shown(&unknown_fields(&knp(&spec))), Vec::<String>::new());
        let mut staged = spec.clone();
        staged["stagedAction"] = "Set".into();
        let staged = json!({"apiVersion": "projectcalico.org/v3",
                            "kind": "StagedKubernetesNetworkPolicy",
                            "metadata": {"name": "p"}, "spec": staged});
        assert_eq!(shown(&unknown_fields(&staged)), Vec::<String>::new());
        let typos = json!({
            "podSelector": {"matchLabel": {"role": "db"}},
            "ingress": [{"frm": [{"podSelector": {}}], "ports": [{"portt": 80}]}],
            "egress": [{"to": [{"ipblock": {"cidr": "10.0.0.0/8"}}]}],
            "policyType": ["Ingress"],
        });
        let mut got = shown(&unknown_fields(&knp(&typos)));
        got.sort();
        assert_eq!(
            got,
            [
                "spec.egress[0].to[0].ipblock: unknown field (did you mean \"ipBlock\"?)",
                "spec.ingress[0].frm: unknown field (did you mean \"from\"?)",
                "spec.ingress[0].ports[0].portt: unknown field (did you mean \"port\"?)",
                "spec.podSelector.matchLabel: unknown field (did you mean \"matchLabels\"?)",
                "spec.policyType: unknown field (did you mean \"policyTypes\"?)",
            ]
        );
        let ns = json!({"apiVersion": "v1", "kind": "Namespace",
                        "metadata": {"name": "prod", "labels": {"a": "b"}},
                        "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}});
        assert_eq!(shown(&unknown_fields(&ns)), Vec::<String>::new());
    }

    #[test]
    fn near_misses_only() {
        let known = ["selector", "ingress", "egress", "types", "order"];
        assert_eq!(
            did_you_mean("Selector", known.into_iter()),
            Some("selector")
        );
        assert_eq!(did_you_mean("egres", known.into_iter()), Some("egress"));
        assert_eq!(did_you_mean("typs", known.into_iter()), Some("types"));
        assert_eq!(did_you_mean("tier", known.into_iter()), None);
        assert_eq!(did_you_mean("frobnicate", known.into_iter()), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
