//! The Kubernetes front of the mirror: per-source lists, resourceVersions, conversions.

use super::*;
use crate::summary;
use serde_json::json;

/// The stages of the rejections in `b` (what the adapter counts).
fn rejected(b: &Batch) -> Vec<RejectStage> {
    b.problems.iter().filter_map(|p| p.stage).collect()
}

fn ns(name: &str, rv: &str, labels: Value) -> Value {
    json!({"metadata": {"name": name, "resourceVersion": rv, "labels": labels}})
}

fn pod(name: &str, rv: &str, ip: Option<&str>, phase: &str) -> Value {
    let mut status = json!({"phase": phase});
    if let Some(ip) = ip {
        status["podIP"] = ip.into();
    }
    json!({
        "metadata": {"name": name, "namespace": "shop", "resourceVersion": rv,
                     "labels": {"app": "web"}},
        "spec": {"nodeName": "node1", "serviceAccountName": "default",
                 "containers": [{"name": "c"}]},
        "status": status,
    })
}

#[test]
fn relists_send_only_differences_per_source() {
    let (mut m, conv) = (new_mirror(), Converter::default());
    let mut out = Batch::default();
    m.begin_list(Source::Namespace);
    put(
        &mut m,
        &conv,
        Source::Namespace,
        ns("a", "1", json!({})),
        &mut out,
    );
    put(
        &mut m,
        &conv,
        Source::Namespace,
        ns("b", "2", json!({})),
        &mut out,
    );
    m.sweep(Source::Namespace, &mut out);
    m.begin_list(Source::Pod);
    put(
        &mut m,
        &conv,
        Source::Pod,
        pod("p", "3", Some("10.0.0.1"), "Running"),
        &mut out,
    );
    m.sweep(Source::Pod, &mut out);
    assert_eq!(
        summary(&out),
        [
            "apply Profile kns.a",
            "apply Profile kns.b",
            "apply WorkloadEndpoint shop/node1-k8s-p-eth0"
        ]
    );
    // Re-list of namespaces: a unchanged, b changed, c new, (missing) nothing else; the
    // pods are untouched by a namespace re-list.
    let mut out = Batch::default();
    m.begin_list(Source::Namespace);
    put(
        &mut m,
        &conv,
        Source::Namespace,
        ns("a", "1", json!({})),
        &mut out,
    );
    put(
        &mut m,
        &conv,
        Source::Namespace,
        ns("c", "5", json!({})),
        &mut out,
    );
    m.sweep(Source::Namespace, &mut out);
    assert_eq!(
        summary(&out),
        ["apply Profile kns.c", "delete Profile kns.b"]
    );
    assert_eq!(m.len(), 3);
}

#[test]
fn unchanged_conversions_are_not_resent_and_lost_ips_delete() {
    let (mut m, conv) = (new_mirror(), Converter::default());
    let mut out = Batch::default();
    put(
        &mut m,
        &conv,
        Source::Pod,
        pod("p", "1", Some("10.0.0.1"), "Running"),
        &mut out,
    );
    // Status churn: a new resourceVersion, the same endpoint.
    put(
        &mut m,
        &conv,
        Source::Pod,
        pod("p", "2", Some("10.0.0.1"), "Running"),
        &mut out,
    );
    assert_eq!(
        summary(&out),
        ["apply WorkloadEndpoint shop/node1-k8s-p-eth0"]
    );
    // The pod finishes: its endpoint goes; watching it finish again sends nothing.
    let mut out = Batch::default();
    put(
        &mut m,
        &conv,
        Source::Pod,
        pod("p", "3", Some("10.0.0.1"), "Succeeded"),
        &mut out,
    );
    put(
        &mut m,
        &conv,
        Source::Pod,
        pod("p", "4", Some("10.0.0.1"), "Succeeded"),
        &mut out,
    );
    assert_eq!(
        summary(&out),
        ["delete WorkloadEndpoint shop/node1-k8s-p-eth0"]
    );
    // Deleting a pod that delivers nothing sends nothing.
    let mut out = Batch::default();
    delete(
        &mut m,
        Source::Pod,
        &pod("p", "5", None, "Succeeded"),
        &mut out,
    );
    assert!(out.updates.is_empty());
}

#[test]
fn a_rejected_object_keeps_the_last_good_version_and_is_reported_once() {
    let (mut m, conv) = (new_mirror(), Converter::default());
    let tier = |rv: &str, order: Value| {
        json!({"apiVersion": "crd.projectcalico.org/v1", "kind": "Tier",
               "metadata": {"name": "security", "resourceVersion": rv},
               "spec": {"order": order}})
    };
    let src = Source::Crd(Kind::Tier);
    let mut out = Batch::default();
    m.begin_list(src);
    put(&mut m, &conv, src, tier("1", json!(100)), &mut out);
    put(&mut m, &conv, src, tier("2", json!("high")), &mut out);
    m.sweep(src, &mut out);
    assert_eq!(summary(&out), ["apply Tier security"]);
    assert_eq!(out.problems.len(), 1);
    assert!(
        out.problems[0]
            .key
            .contains("tiers.crd.projectcalico.org security"),
        "{:?}",
        out.problems
    );
    assert_eq!(rejected(&out), [RejectStage::Decode]);
    assert!(out.problems[0].held);
    let held = vec!["tiers.crd.projectcalico.org security".to_owned()];
    assert_eq!(m.unusable(), (held, vec![]));
    // The same bad version on a re-list: not reported again, nothing deleted.
    let mut out = Batch::default();
    m.begin_list(src);
    put(&mut m, &conv, src, tier("2", json!("high")), &mut out);
    m.sweep(src, &mut out);
    assert!(out.updates.is_empty() && out.problems.is_empty());
    // A later valid version applies; deleting the object deletes the tier.
    put(&mut m, &conv, src, tier("3", json!(200)), &mut out);
    delete(&mut m, src, &tier("4", json!(200)), &mut out);
    assert_eq!(
        summary(&out),
        ["apply Tier security", "delete Tier security"]
    );
    assert_eq!(m.unusable(), (vec![], vec![]));
    // Bad from its first version (as after a restart): not in force, and listed.
    let mut out = Batch::default();
    put(&mut m, &conv, src, tier("5", json!("high")), &mut out);
    assert!(out.updates.is_empty() && !out.problems[0].held);
    let without = vec!["tiers.crd.projectcalico.org security".to_owned()];
    assert_eq!(m.take_unusable(), Some((vec![], without)));
    assert_eq!(m.take_unusable(), None, "published once");
    delete(&mut m, src, &tier("6", json!(200)), &mut out);
    assert_eq!(m.take_unusable(), Some((vec![], vec![])), "deleted");
}

#[test]
fn two_objects_naming_one_policy() {
    let (mut m, conv) = (new_mirror(), Converter::default());
    let crd = json!({"apiVersion": "crd.projectcalico.org/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "knp.default.deny", "namespace": "shop", "resourceVersion": "1"},
        "spec": {"selector": "all()"}});
    let knp = json!({"metadata": {"name": "deny", "namespace": "shop", "resourceVersion": "2"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}});
    let mut out = Batch::default();
    put(
        &mut m,
        &conv,
        Source::Crd(Kind::NetworkPolicy),
        crd.clone(),
        &mut out,
    );
    put(
        &mut m,
        &conv,
        Source::KubernetesNetworkPolicy,
        knp.clone(),
        &mut out,
    );
    assert_eq!(
        summary(&out),
        [
            "apply NetworkPolicy shop/knp.default.deny",
            "apply NetworkPolicy shop/knp.default.deny"
        ]
    );
    // The Kubernetes one goes: the CRD's version must come back through a re-list.
    let mut out = Batch::default();
    delete(&mut m, Source::KubernetesNetworkPolicy, &knp, &mut out);
    assert!(out.updates.is_empty());
    let relists = m.take_relists();
    assert_eq!(
        relists.into_iter().collect::<Vec<_>>(),
        [Source::Crd(Kind::NetworkPolicy)]
    );
    let mut out = Batch::default();
    m.begin_list(Source::Crd(Kind::NetworkPolicy));
    put(
        &mut m,
        &conv,
        Source::Crd(Kind::NetworkPolicy),
        crd.clone(),
        &mut out,
    );
    m.sweep(Source::Crd(Kind::NetworkPolicy), &mut out);
    assert_eq!(summary(&out), ["apply NetworkPolicy shop/knp.default.deny"]);
    let mut out = Batch::default();
    delete(&mut m, Source::Crd(Kind::NetworkPolicy), &crd, &mut out);
    assert_eq!(
        summary(&out),
        ["delete NetworkPolicy shop/knp.default.deny"]
    );
}

#[test]
fn sources_name_their_collections() {
    assert_eq!(Source::Pod.name(), "pods");
    assert_eq!(
        Source::KubernetesNetworkPolicy.name(),
        "networkpolicies.networking.k8s.io"
    );
    assert_eq!(
        Source::Crd(Kind::GlobalNetworkPolicy).name(),
        "globalnetworkpolicies.crd.projectcalico.org"
    );
    let c = Source::Crd(Kind::Tier).collection();
    assert_eq!(c.api_version(), "crd.projectcalico.org/v1");
    assert_eq!(c.kind, "Tier");
    assert_eq!(Source::Node.collection().api_version(), "v1");
    assert!(Source::Crd(Kind::NetworkSet).namespaced());
    assert!(!Source::Crd(Kind::Tier).namespaced());
    // The network-policy-api kinds, cluster-scoped, each at its own version.
    let cnp = Source::NetworkPolicyApi(Kind::ClusterNetworkPolicy);
    assert_eq!(
        cnp.name(),
        "clusternetworkpolicies.policy.networking.k8s.io"
    );
    assert_eq!(
        cnp.collection().api_version(),
        "policy.networking.k8s.io/v1alpha2"
    );
    assert!(!cnp.namespaced());
    let banp = Source::NetworkPolicyApi(Kind::BaselineAdminNetworkPolicy).collection();
    assert_eq!(
        (banp.api_version().as_str(), banp.kind, banp.plural),
        (
            "policy.networking.k8s.io/v1alpha1",
            "BaselineAdminNetworkPolicy",
            "baselineadminnetworkpolicies"
        )
    );
    for kind in Kind::NETWORK_POLICY_API {
        assert!(
            Source::ALL.contains(&Source::NetworkPolicyApi(kind)),
            "{kind} watched"
        );
    }
}

fn slice(rv: &str, ready: bool, addresses: Value) -> Value {
    json!({
        "metadata": {"name": "web-x1", "namespace": "shop", "resourceVersion": rv,
                     "labels": {"kubernetes.io/service-name": "web"},
                     "ownerReferences": [{"kind": "Service", "name": "web"}]},
        "addressType": "IPv4",
        "endpoints": [{"addresses": addresses, "conditions": {"ready": ready},
                       "nodeName": "node1"}],
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
    })
}

#[test]
fn endpoint_slices_are_watched_and_readiness_alone_sends_nothing() {
    assert_eq!(
        Source::EndpointSlice.name(),
        "endpointslices.discovery.k8s.io"
    );
    assert!(Source::EndpointSlice.namespaced());
    assert!(Source::ALL.contains(&Source::EndpointSlice));
    let (mut m, conv) = (new_mirror(), Converter::default());
    let mut out = Batch::default();
    put(
        &mut m,
        &conv,
        Source::EndpointSlice,
        slice("1", true, json!(["10.0.0.1"])),
        &mut out,
    );
    // Felix does not read conditions: a slice whose endpoint turns unready is unchanged.
    put(
        &mut m,
        &conv,
        Source::EndpointSlice,
        slice("2", false, json!(["10.0.0.1"])),
        &mut out,
    );
    assert_eq!(summary(&out), ["apply EndpointSlice shop/web-x1"]);
    let mut out = Batch::default();
    put(
        &mut m,
        &conv,
        Source::EndpointSlice,
        slice("3", false, json!(["10.0.0.1", "10.0.0.2"])),
        &mut out,
    );
    delete(
        &mut m,
        Source::EndpointSlice,
        &slice("4", false, json!([])),
        &mut out,
    );
    assert_eq!(
        summary(&out),
        [
            "apply EndpointSlice shop/web-x1",
            "delete EndpointSlice shop/web-x1"
        ]
    );
}
