//! The shape of Antrea's controller benchmark ("25k namespaces, 100k pods, 75k network
//! policies", `TestInitXLargeScaleWithSmallNamespaces` in Antrea's network-policy controller),
//! written as this project's datastore holds it.
//!
//! Contract: for each of `namespaces` namespaces `ns-<j>`:
//! - one Kubernetes `Namespace` (`v1`) labelled `app: ns-<j>` (Calico turns it into the Profile
//!   `kns.ns-<j>`);
//! - three Kubernetes `NetworkPolicy` objects (`networking.k8s.io/v1`), all with both policy
//!   types: `default-deny-all` (every pod, no rule), `np-1` (pods `app-1: scale-1`, ingress from
//!   pods `app-1: scale-1`) and `np-2` (the same with `app-2: scale-2`);
//! - four pods as Calico's Kubernetes datastore converts them to WorkloadEndpoints: `pod1` and
//!   `pod2` labelled `app-1: scale-1`, `pod3` and `pod4` `app-2: scale-2`, each on a random node
//!   of `nodes` (`node-<i>`, as Antrea's test picks one of 1,000) with a unique IPv4 address of
//!   10.128.0.0/9 and the profile `kns.<namespace>` (the test's pods name no service account).
//!
//! Plus the `default` Tier. `--endpoints-per-node` and `--policies` do not apply: the counts
//! follow from `namespaces` (4 endpoints and 3 policies each). Deterministic for a seed.

use std::net::Ipv4Addr;

use serde_json::{Map, Value, json};

use super::{
    GenClusterArgs, POOL_V4, Rng, Section, escape_segment, labels, object, permute44, with_spec,
};

/// Pods per namespace and their labels, in Antrea's test's order.
const PODS: [(&str, &str, &str); 4] = [
    ("pod1", "app-1", "scale-1"),
    ("pod2", "app-1", "scale-1"),
    ("pod3", "app-2", "scale-2"),
    ("pod4", "app-2", "scale-2"),
];

/// Every object of the shape, section by section, into `sink`.
pub(super) fn emit<E>(
    args: &GenClusterArgs,
    sink: &mut dyn FnMut(Section, Value) -> Result<(), E>,
) -> Result<(), E> {
    sink(
        Section::Tiers,
        with_spec(
            object("Tier", "default", None, Map::new()),
            json!({"order": 1_000_000, "defaultAction": "Deny"}),
        ),
    )?;
    let names: Vec<String> = (0..args.namespaces).map(|j| format!("ns-{j}")).collect();
    for ns in &names {
        let mut v = object("Namespace", ns, None, labels([("app", ns.as_str())]));
        v["apiVersion"] = "v1".into();
        v.as_object_mut().map(|o| o.remove("spec"));
        sink(Section::Namespaces, v)?;
    }
    let mut rng = Rng::new(args.seed, "antrea-pods");
    let iface_offset = rng.next_u64();
    let mut k = 0u32;
    for ns in &names {
        for (pod, key, value) in PODS {
            let node = format!("node-{}", rng.below(args.nodes.max(1)));
            let ip = Ipv4Addr::from(u32::from(POOL_V4) + k);
            let meta_labels = labels([
                (key, value),
                ("projectcalico.org/namespace", ns.as_str()),
                ("projectcalico.org/orchestrator", "k8s"),
            ]);
            let name = format!("{}-k8s-{}-eth0", escape_segment(&node), escape_segment(pod));
            let spec = json!({
                "orchestrator": "k8s",
                "node": node,
                "pod": pod,
                "endpoint": "eth0",
                "ipNetworks": [format!("{ip}/32")],
                "profiles": [format!("kns.{ns}")],
                "interfaceName": format!("cali{:011x}", permute44(iface_offset.wrapping_add(u64::from(k)))),
            });
            sink(
                Section::Workloads,
                with_spec(
                    object("WorkloadEndpoint", &name, Some(ns), meta_labels),
                    spec,
                ),
            )?;
            k += 1;
        }
    }
    for ns in &names {
        for v in policies(ns) {
            sink(Section::Policies, v)?;
        }
    }
    Ok(())
}

/// The namespace's three NetworkPolicies.
fn policies(ns: &str) -> [Value; 3] {
    let np = |name: &str, pods: Value, ingress: Value| {
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "podSelector": pods,
                "policyTypes": ["Ingress", "Egress"],
                "ingress": ingress,
            },
        })
    };
    let peer = |key: &str, value: &str| json!([{"from": [{"podSelector": {"matchLabels": {key: value}}}]}]);
    [
        np("default-deny-all", json!({}), json!([])),
        np(
            "np-1",
            json!({"matchLabels": {"app-1": "scale-1"}}),
            peer("app-1", "scale-1"),
        ),
        np(
            "np-2",
            json!({"matchLabels": {"app-2": "scale-2"}}),
            peer("app-2", "scale-2"),
        ),
    ]
}
