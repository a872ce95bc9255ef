//! Kubernetes Services in policy rules: the members of a rule's service IP sets, read from the
//! Services' EndpointSlices as Felix's `serviceindex` reads them.
//!
//! Contract: the set of Service `<ns>/<name>` holds, for every EndpointSlice in `<ns>` labelled
//! `kubernetes.io/service-name: <name>`, every address of every endpoint (ready or not: Felix
//! does not read the conditions) — as `<ip>/32` (`/128`) in a source set (`svcnoport`, type
//! NET), or as `<ip>,<proto>:<port>` for each of the slice's numbered ports in a destination
//! set (`svc`, type IP_AND_PORT; protocol `udp` or `sctp` as the port says, else `tcp`; a port
//! without a number adds nothing). An address that is not an IP (an FQDN slice's) is skipped.
//! The Service object itself is never needed: a Service without slices, or no Service at all,
//! is a set without members, so a rule naming it matches nothing. Members are counted per
//! contributing slice, so two slices holding one address make one member until both drop it;
//! every change goes through `IpSets::member_change`, so it reaches exactly the nodes that hold the set,
//! as a delta, like a selector set's.

use std::net::IpAddr;
use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use super::{CalcGraph, Key, Name};
use crate::model::{EndpointSliceSpec, LABEL_SERVICE_NAME, ObjectMeta};
use crate::rule_scanner::IpSetKind;

/// The EndpointSlices that name a Service, and the Services' defined sets.
#[derive(Default)]
pub(super) struct Services {
    /// EndpointSlices that name a Service, by key.
    pub(super) slices: FxHashMap<Key, SliceState>,
    /// Per Service (`<ns>/<name>`), the keys of its EndpointSlices.
    pub(super) service_slices: FxHashMap<Name, FxHashSet<Key>>,
    /// Per Service, the ids of its defined IP sets (with and without ports).
    pub(super) service_sets: FxHashMap<Name, Vec<Name>>,
    /// The Services by the addresses and ports clients reach them at (flow logs only).
    pub(super) frontends: super::frontends::Frontends,
}

impl Services {
    pub(super) fn set_frontends(&mut self, key: Key, spec: &crate::model::ServiceSpec) {
        self.frontends.set(key, spec);
    }

    pub(super) fn remove_frontends(&mut self, key: &Key) {
        self.frontends.remove(key);
    }
}

/// What one EndpointSlice contributes to its Service's sets.
pub(super) struct SliceState {
    /// `<namespace>/<service>`.
    service: Name,
    /// Members of the Service's source set: `<ip>/32` or `<ip>/128`.
    addresses: Vec<Arc<str>>,
    /// Members of the Service's destination set: `<ip>,<proto>:<port>`.
    ip_ports: Vec<Arc<str>>,
}

impl SliceState {
    fn members(&self, include_ports: bool) -> &[Arc<str>] {
        if include_ports {
            &self.ip_ports
        } else {
            &self.addresses
        }
    }
}

/// The slice's contribution; `None` when it names no Service.
fn slice_state(meta: &ObjectMeta, spec: &EndpointSliceSpec) -> Option<SliceState> {
    let service = meta.labels.get(LABEL_SERVICE_NAME)?;
    let ns = meta.namespace.as_deref().unwrap_or("default");
    let ips: Vec<IpAddr> = spec
        .endpoints
        .iter()
        .flat_map(|e| &e.addresses)
        .filter_map(|a| a.trim().parse().ok())
        .collect();
    let addresses = ips
        .iter()
        .map(|ip| {
            let bits = if ip.is_ipv6() { 128 } else { 32 };
            Arc::from(format!("{ip}/{bits}"))
        })
        .collect();
    let mut ip_ports = Vec::new();
    for p in &spec.ports {
        let Some(port) = p.port.and_then(|n| u16::try_from(n).ok()) else {
            continue;
        };
        let proto = match p.protocol.as_deref() {
            Some("UDP") => "udp",
            Some("SCTP") => "sctp",
            _ => "tcp",
        };
        for ip in &ips {
            ip_ports.push(Arc::from(format!("{ip},{proto}:{port}")));
        }
    }
    Some(SliceState {
        service: Arc::from(format!("{ns}/{service}")),
        addresses,
        ip_ports,
    })
}

impl CalcGraph {
    /// Installs (or replaces) an EndpointSlice.
    pub(super) fn set_slice(&mut self, key: Key, meta: &ObjectMeta, spec: &EndpointSliceSpec) {
        let new = slice_state(meta, spec);
        // The new contribution first, then the old one withdrawn: an address in both stays,
        // and only the difference reaches the nodes.
        if let Some(new) = &new {
            self.slice_contributes(new, true);
        }
        self.remove_slice(&key);
        if let Some(new) = new {
            self.services
                .service_slices
                .entry(new.service.clone())
                .or_default()
                .insert(key.clone());
            self.services.slices.insert(key, new);
        }
    }

    pub(super) fn remove_slice(&mut self, key: &Key) {
        let Some(old) = self.services.slices.remove(key) else {
            return;
        };
        self.slice_contributes(&old, false);
        if let Some(keys) = self.services.service_slices.get_mut(&old.service) {
            keys.remove(key);
            if keys.is_empty() {
                self.services.service_slices.remove(&old.service);
            }
        }
    }

    /// Adds (`true`) or withdraws a slice's members in every defined set of its Service.
    fn slice_contributes(&mut self, slice: &SliceState, add: bool) {
        let Some(ids) = self.services.service_sets.get(&slice.service).cloned() else {
            return;
        };
        for id in ids {
            let Some(IpSetKind::Service { include_ports, .. }) =
                self.ipsets.sets.get(&id).map(|s| &s.spec.kind)
            else {
                continue;
            };
            for m in slice.members(*include_ports).to_vec() {
                self.ipsets.member_change(&id, m, add);
            }
        }
    }

    /// A service set was just defined (`true`: fill it from the Service's slices) or is about
    /// to be dropped (`false`: empty it, so a node still holding it is sent the removals).
    pub(super) fn service_set_defined(&mut self, id: &Name, defined: bool) {
        let Some(IpSetKind::Service {
            service,
            include_ports,
        }) = self.ipsets.sets.get(id).map(|s| s.spec.kind.clone())
        else {
            return;
        };
        let service: Name = Arc::from(service.as_str());
        if defined {
            self.services
                .service_sets
                .entry(service.clone())
                .or_default()
                .push(id.clone());
        } else if let Some(ids) = self.services.service_sets.get_mut(&service) {
            ids.retain(|i| i != id);
            if ids.is_empty() {
                self.services.service_sets.remove(&service);
            }
        }
        let keys: Vec<Key> = self
            .services
            .service_slices
            .get(&service)
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default();
        for k in keys {
            let members = self.services.slices[&k].members(include_ports).to_vec();
            for m in members {
                self.ipsets.member_change(id, m, defined);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use felix_proto as pb;
    use pb::to_dataplane::Payload;
    use serde_json::{Value, json};

    use super::super::test_util::{apply, flush_for, kinds, wep};
    use super::super::{CalcGraph, SharedMessage, Update};
    use crate::hash::make_unique_id;

    /// EndpointSlice `name` of Service `service` in `ns`, one endpoint per address.
    fn slice(name: &str, ns: &str, service: &str, addresses: &[&str], ports: Value) -> Value {
        let endpoints: Vec<Value> = addresses
            .iter()
            .map(|a| json!({"addresses": [a], "conditions": {"ready": false}}))
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": ns,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "endpoints": endpoints, "ports": ports,
        })
    }

    /// NetworkPolicy in namespace `ns` for `app == 'client'` with one rule naming a Service:
    /// egress to it (`dir` = "egress"), or ingress from it.
    fn service_policy(name: &str, dir: &str, service: Value) -> Value {
        let (types, peer) = if dir == "egress" {
            (json!(["Egress"]), "destination")
        } else {
            (json!(["Ingress"]), "source")
        };
        json!({
            "apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"selector": "app == 'client'", "types": types,
                     dir: [{"action": "Allow", peer: {"services": service}}]}
        })
    }

    fn client(g: &mut CalcGraph, node: &str) {
        apply(
            g,
            wep(
                "client",
                node,
                "10.9.0.1",
                json!({"app": "client"}),
                json!([]),
            ),
        );
    }

    /// The IP set updates in `messages`: (type, sorted members) by id.
    fn ipsets(messages: &[SharedMessage]) -> Vec<(String, i32, Vec<String>)> {
        messages
            .iter()
            .filter_map(|m| match &m.payload {
                Some(Payload::IpsetUpdate(u)) => {
                    let mut members = u.members.clone();
                    members.sort();
                    Some((u.id.clone(), u.r#type, members))
                }
                _ => None,
            })
            .collect()
    }

    fn deltas(messages: &[SharedMessage]) -> Vec<(String, Vec<String>, Vec<String>)> {
        messages
            .iter()
            .filter_map(|m| match &m.payload {
                Some(Payload::IpsetDeltaUpdate(d)) => Some((
                    d.id.clone(),
                    d.added_members.clone(),
                    d.removed_members.clone(),
                )),
                _ => None,
            })
            .collect()
    }

    /// The first rule of the policy update in `messages`.
    fn first_rule(messages: &[SharedMessage]) -> pb::Rule {
        messages
            .iter()
            .find_map(|m| match &m.payload {
                Some(Payload::ActivePolicyUpdate(u)) => {
                    let p = u.policy.as_ref()?;
                    p.outbound_rules
                        .first()
                        .or(p.inbound_rules.first())
                        .cloned()
                }
                _ => None,
            })
            .expect("a policy update")
    }

    const IP_AND_PORT: i32 = pb::ip_set_update::IpSetType::IpAndPort as i32;
    const NET: i32 = pb::ip_set_update::IpSetType::Net as i32;

    #[test]
    fn a_destination_service_rule_allows_exactly_the_endpoints_ports() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        client(&mut g, "node-1");
        let ports = json!([{"name": "http", "port": 80},
                           {"name": "dns", "protocol": "UDP", "port": 53},
                           {"name": "any"}]);
        apply(
            &mut g,
            slice("web-a", "ns", "web", &["10.0.0.5", "10.0.0.6"], ports),
        );
        // Not web's: another Service, web in another namespace, a slice naming no Service.
        apply(
            &mut g,
            slice("db-a", "ns", "db", &["10.0.0.7"], json!([{"port": 5432}])),
        );
        apply(
            &mut g,
            slice(
                "web-b",
                "other",
                "web",
                &["10.0.1.5"],
                json!([{"port": 80}]),
            ),
        );
        let mut orphan = slice("x", "ns", "web", &["10.0.0.8"], json!([{"port": 80}]));
        orphan["metadata"]["labels"] = json!({});
        apply(&mut g, orphan);
        // An FQDN slice's names are not addresses.
        apply(
            &mut g,
            slice(
                "web-fqdn",
                "ns",
                "web",
                &["web.example.com"],
                json!([{"port": 80}]),
            ),
        );
        apply(
            &mut g,
            service_policy("to-web", "egress", json!({"name": "web"})),
        );

        let msgs = flush_for(&mut g, "node-1");
        let id = make_unique_id("svc", "ns/web");
        assert_eq!(
            first_rule(&msgs).dst_ip_port_set_ids,
            std::slice::from_ref(&id)
        );
        assert_eq!(
            ipsets(&msgs),
            [(
                id,
                IP_AND_PORT,
                vec![
                    "10.0.0.5,tcp:80".to_string(),
                    "10.0.0.5,udp:53".into(),
                    "10.0.0.6,tcp:80".into(),
                    "10.0.0.6,udp:53".into(),
                ]
            )],
            "both endpoints (ready or not) on each numbered port; nothing else"
        );
    }

    #[test]
    fn a_source_service_rule_matches_the_endpoint_addresses() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        client(&mut g, "node-1");
        apply(
            &mut g,
            service_policy(
                "from-web",
                "ingress",
                json!({"name": "web", "namespace": "ns"}),
            ),
        );
        let mut v6 = slice("web-6", "ns", "web", &["fd00::5"], json!([{"port": 80}]));
        v6["addressType"] = json!("IPv6");
        apply(&mut g, v6);
        apply(
            &mut g,
            slice("web-a", "ns", "web", &["10.0.0.5"], json!([{"port": 80}])),
        );
        let msgs = flush_for(&mut g, "node-1");
        let id = make_unique_id("svcnoport", "ns/web");
        let rule = first_rule(&msgs);
        assert_eq!(rule.src_ip_set_ids, std::slice::from_ref(&id));
        assert_eq!(rule.original_src_service, "web");
        assert_eq!(
            ipsets(&msgs),
            [(
                id,
                NET,
                vec!["10.0.0.5/32".to_string(), "fd00::5/128".into()]
            )]
        );
    }

    #[test]
    fn slice_changes_reach_only_the_nodes_holding_the_set_as_deltas() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        g.subscribe("node-2");
        client(&mut g, "node-1");
        apply(
            &mut g,
            wep(
                "other",
                "node-2",
                "10.9.0.2",
                json!({"app": "other"}),
                json!([]),
            ),
        );
        apply(
            &mut g,
            service_policy("to-web", "egress", json!({"name": "web"})),
        );
        let a = apply(
            &mut g,
            slice(
                "web-a",
                "ns",
                "web",
                &["10.0.0.5", "10.0.0.6"],
                json!([{"port": 80}]),
            ),
        );
        g.flush();
        let id = make_unique_id("svc", "ns/web");

        apply(
            &mut g,
            slice(
                "web-a",
                "ns",
                "web",
                &["10.0.0.5", "10.0.0.7"],
                json!([{"port": 80}]),
            ),
        );
        let batches = g.flush();
        assert_eq!(batches.len(), 1, "node-2 holds no service set: {batches:?}");
        assert_eq!(batches[0].node, "node-1");
        assert_eq!(
            deltas(&batches[0].messages),
            [(
                id.clone(),
                vec!["10.0.0.7,tcp:80".to_string()],
                vec!["10.0.0.6,tcp:80".to_string()]
            )]
        );

        // A second slice with one of the addresses: deleting the first keeps that member.
        apply(
            &mut g,
            slice("web-b", "ns", "web", &["10.0.0.5"], json!([{"port": 80}])),
        );
        assert_eq!(
            deltas(&flush_for(&mut g, "node-1")),
            [],
            "10.0.0.5 was already a member"
        );
        g.apply(Update::Delete((*a).clone())).unwrap();
        assert_eq!(
            deltas(&flush_for(&mut g, "node-1")),
            [(id, vec![], vec!["10.0.0.7,tcp:80".to_string()])]
        );
        // The same slice again: nothing to send.
        apply(
            &mut g,
            slice("web-b", "ns", "web", &["10.0.0.5"], json!([{"port": 80}])),
        );
        assert!(flush_for(&mut g, "node-1").is_empty());
    }

    #[test]
    fn a_service_without_slices_matches_nothing_and_fills_when_they_come() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        client(&mut g, "node-1");
        apply(
            &mut g,
            service_policy("to-web", "egress", json!({"name": "web"})),
        );
        let id = make_unique_id("svc", "ns/web");
        let msgs = flush_for(&mut g, "node-1");
        assert_eq!(ipsets(&msgs), [(id.clone(), IP_AND_PORT, vec![])]);
        assert!(
            kinds(&msgs).iter().position(|k| k == "IpsetUpdate")
                < kinds(&msgs).iter().position(|k| k == "ActivePolicyUpdate"),
            "the set before the policy that uses it"
        );
        apply(
            &mut g,
            slice("web-a", "ns", "web", &["10.0.0.5"], json!([{"port": 80}])),
        );
        assert_eq!(
            deltas(&flush_for(&mut g, "node-1")),
            [(id, vec!["10.0.0.5,tcp:80".to_string()], vec![])]
        );
    }

    #[test]
    fn a_rule_naming_a_service_in_another_namespace_reads_that_namespace() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        client(&mut g, "node-1");
        apply(
            &mut g,
            slice("db-a", "data", "db", &["10.0.2.1"], json!([{"port": 5432}])),
        );
        apply(
            &mut g,
            slice("db-a", "ns", "db", &["10.0.0.9"], json!([{"port": 5432}])),
        );
        apply(
            &mut g,
            service_policy(
                "to-db",
                "egress",
                json!({"name": "db", "namespace": "data"}),
            ),
        );
        let msgs = flush_for(&mut g, "node-1");
        assert_eq!(
            ipsets(&msgs),
            [(
                make_unique_id("svc", "data/db"),
                IP_AND_PORT,
                vec!["10.0.2.1,tcp:5432".to_string()]
            )]
        );
    }

    #[test]
    fn the_result_does_not_depend_on_the_order_of_slices_and_policies() {
        let policy = service_policy("to-web", "egress", json!({"name": "web"}));
        let s1 = slice("web-a", "ns", "web", &["10.0.0.5"], json!([{"port": 80}]));
        let s2 = slice(
            "web-b",
            "ns",
            "web",
            &["10.0.0.5", "10.0.0.6"],
            json!([{"port": 80}]),
        );
        let run = |order: &[&Value]| {
            let mut g = CalcGraph::new();
            g.subscribe("node-1");
            client(&mut g, "node-1");
            for v in order {
                apply(&mut g, (*v).clone());
            }
            ipsets(&flush_for(&mut g, "node-1"))
        };
        let want = run(&[&policy, &s1, &s2]);
        assert_eq!(want[0].2, ["10.0.0.5,tcp:80", "10.0.0.6,tcp:80"]);
        assert_eq!(run(&[&s1, &s2, &policy]), want);
        assert_eq!(run(&[&s2, &policy, &s1]), want);
    }

    #[test]
    fn a_set_dropped_and_defined_again_is_refilled() {
        let mut g = CalcGraph::new();
        g.subscribe("node-1");
        client(&mut g, "node-1");
        let policy = apply(
            &mut g,
            service_policy("to-web", "egress", json!({"name": "web"})),
        );
        apply(
            &mut g,
            slice("web-a", "ns", "web", &["10.0.0.5"], json!([{"port": 80}])),
        );
        g.flush();
        g.apply(Update::Delete((*policy).clone())).unwrap();
        assert!(
            kinds(&flush_for(&mut g, "node-1")).contains(&"IpsetRemove".to_string()),
            "the set goes with its last user"
        );
        assert!(
            g.ipsets.members.existing("10.0.0.5,tcp:80").is_none(),
            "released"
        );
        apply(
            &mut g,
            service_policy("to-web", "egress", json!({"name": "web"})),
        );
        assert_eq!(
            ipsets(&flush_for(&mut g, "node-1"))[0].2,
            ["10.0.0.5,tcp:80"]
        );
    }
}
