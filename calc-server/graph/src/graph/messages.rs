//! The protobuf payloads the graph sends, built from its state.
//!
//! Contract: pure projections. Nothing here reads or changes what a node was sent or what is
//! dirty, so one built message can be shared by every node that needs it. Field for field these
//! are what Felix's calculation graph would send for the same state (names, ids, config sources),
//! because the agent and Felix's dataplane code read them the same way.

use felix_proto as pb;
use pb::to_dataplane::Payload;

use super::items::StoredKind;
use super::{CalcGraph, SharedMessage};
use crate::convert::{EndpointIds, PolicyId, PolicyModel, endpoint_ids};
use crate::model::{NodeSpec, ObjectMeta, ResourceKey};
use crate::policy_resolver::{self, PolicyRef};
use crate::rule_scanner::ScannedRules;

pub(super) fn msg(p: Payload) -> pb::ToDataplane {
    pb::ToDataplane {
        sequence_number: 0,
        payload: Some(p),
    }
}

/// Felix's parameter name for a FelixConfiguration field: `iptablesRefreshInterval` →
/// `IptablesRefreshInterval`.
pub(super) fn felix_param_name(field: &str) -> String {
    let mut c = field.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

pub(super) fn config_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub(super) fn host_metadata(m: &ObjectMeta, s: &NodeSpec) -> pb::HostMetadataUpdate {
    let strip = |a: &str| a.split('/').next().unwrap_or_default().to_string();
    let bgp = s.bgp.clone().unwrap_or_default();
    pb::HostMetadataUpdate {
        hostname: m.name.clone(),
        ipv4_addr: strip(&bgp.ipv4_address),
        ipv6_addr: strip(&bgp.ipv6_address),
        asnumber: bgp.as_number.map(|a| config_value(&a)).unwrap_or_default(),
        labels: m.labels.clone().into_iter().collect(),
    }
}

pub(super) fn policy_message(model: &PolicyModel, scanned: &ScannedRules) -> pb::Policy {
    pb::Policy {
        inbound_rules: scanned.inbound.clone(),
        outbound_rules: scanned.outbound.clone(),
        untracked: model.untracked,
        pre_dnat: model.pre_dnat,
        namespace: model.namespace.clone(),
        original_selector: model.selector.canonical().to_string(),
        perf_hints: model.performance_hints.clone(),
        tier: model.tier.clone(),
    }
}

pub(super) fn profile_messages(name: &str, profile: pb::Profile) -> SharedMessage {
    SharedMessage::new(msg(Payload::ActiveProfileUpdate(pb::ActiveProfileUpdate {
        id: Some(pb::ProfileId {
            name: name.to_string(),
        }),
        profile: Some(profile),
    })))
}

pub(super) fn policy_id_proto(id: &PolicyId) -> pb::PolicyId {
    pb::PolicyId {
        name: id.name.clone(),
        namespace: id.namespace.clone(),
        kind: id.kind.clone(),
    }
}

impl CalcGraph {
    pub(super) fn endpoint_message(&self, key: &ResourceKey) -> Option<Payload> {
        let item = self.items.item_of.get(key)?;
        let ep = self.items.endpoints.get(item)?;
        let mut ranked: Vec<(u32, PolicyRef<'_>)> = ep
            .policies
            .iter()
            .filter_map(|k| self.policies.by_key.get(k))
            .map(|p| {
                let r = PolicyRef {
                    model: &p.model,
                    sort_string: &p.sort_string,
                };
                (p.rank, r)
            })
            .collect();
        let tier = |t: &str| self.policies.tier(t);
        let tiers = if self.policies.ranks_stale {
            policy_resolver::resolve(ranked.into_iter().map(|(_, r)| r).collect(), tier)
        } else {
            ranked.sort_unstable_by_key(|(rank, _)| *rank);
            policy_resolver::tier_lists(ranked.into_iter().map(|(_, r)| r).collect(), tier)
        };
        let profile_ids = || self.index.parents(*item).map(str::to_string).collect();
        let m = &ep.model;
        Some(match &m.kind {
            StoredKind::Workload {
                interface_name,
                mac,
                ipv4_nat,
                ipv6_nat,
                allow_spoofed_source_prefixes,
                generate_name: _,
            } => {
                let Some(EndpointIds::Workload {
                    orchestrator_id,
                    workload_id,
                    endpoint_id,
                    ..
                }) = endpoint_ids(&ep.key)
                else {
                    unreachable!(
                        "a workload endpoint is stored only under a key that gives its ids"
                    )
                };
                let nat = |v: &[(String, String)]| {
                    v.iter()
                        .map(|(ext, int)| pb::NatInfo {
                            ext_ip: ext.clone(),
                            int_ip: int.clone(),
                        })
                        .collect()
                };
                Payload::WorkloadEndpointUpdate(pb::WorkloadEndpointUpdate {
                    id: Some(pb::WorkloadEndpointId {
                        orchestrator_id,
                        workload_id,
                        endpoint_id,
                    }),
                    endpoint: Some(pb::WorkloadEndpoint {
                        state: "active".into(),
                        name: interface_name.to_string(),
                        mac: mac.to_string(),
                        profile_ids: profile_ids(),
                        ipv4_nets: ep.nets_of(false),
                        ipv6_nets: ep.nets_of(true),
                        tiers: tiers.normal,
                        ipv4_nat: nat(ipv4_nat),
                        ipv6_nat: nat(ipv6_nat),
                        allow_spoofed_source_prefixes: allow_spoofed_source_prefixes.to_vec(),
                        ..Default::default()
                    }),
                })
            }
            StoredKind::Host {
                interface_name,
                expected_ipv4,
                expected_ipv6,
            } => Payload::HostEndpointUpdate(pb::HostEndpointUpdate {
                id: Some(pb::HostEndpointId {
                    endpoint_id: ep.key.name.clone(),
                }),
                endpoint: Some(pb::HostEndpoint {
                    name: interface_name.to_string(),
                    profile_ids: profile_ids(),
                    tiers: tiers.normal,
                    expected_ipv4_addrs: expected_ipv4.to_vec(),
                    expected_ipv6_addrs: expected_ipv6.to_vec(),
                    untracked_tiers: tiers.untracked,
                    pre_dnat_tiers: tiers.pre_dnat,
                    forward_tiers: tiers.forward,
                    ..Default::default()
                }),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::super::test_util::apply;
    use super::*;

    fn felix_config(name: &str, spec: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": "projectcalico.org/v3", "kind": "FelixConfiguration",
               "metadata": {"name": name}, "spec": spec})
    }

    #[test]
    fn per_node_felix_config_overrides_the_global_one_under_felix_names() {
        let mut g = CalcGraph::new();
        apply(
            &mut g,
            felix_config(
                "default",
                json!({"logSeverityScreen": "Info", "routeRefreshInterval": 90,
                       "bpfEnabled": false}),
            ),
        );
        apply(
            &mut g,
            felix_config("node.node-1", json!({"logSeverityScreen": "Debug"})),
        );

        let c = g.broadcast.config_for("node-1");
        let want: BTreeMap<String, String> = [
            ("LogSeverityScreen", "Debug"),
            ("RouteRefreshInterval", "90"),
            ("BpfEnabled", "false"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(c.config, want);
        let sources: Vec<_> = c
            .source_to_raw_config
            .iter()
            .map(|(k, r)| (*k, r.source.as_str()))
            .collect();
        assert_eq!(sources, [(1, "DatastoreGlobal"), (3, "DatastorePerHost")]);

        let other = g.broadcast.config_for("node-2");
        assert_eq!(other.config["LogSeverityScreen"], "Info");
        assert_eq!(
            other.source_to_raw_config.len(),
            1,
            "no per-host source for node-2"
        );
    }

    #[test]
    fn host_metadata_carries_bare_addresses_and_the_as_number_as_text() {
        let mut g = CalcGraph::new();
        apply(
            &mut g,
            json!({"apiVersion": "projectcalico.org/v3", "kind": "Node",
                   "metadata": {"name": "node-1", "labels": {"rack": "r1"}},
                   "spec": {"bgp": {"ipv4Address": "10.0.0.1/24",
                                    "ipv6Address": "fd00::1/64", "asNumber": 64512}}}),
        );
        let h = &g.broadcast.host_metadata["node-1"];
        assert_eq!(h.hostname, "node-1");
        assert_eq!(h.ipv4_addr, "10.0.0.1");
        assert_eq!(h.ipv6_addr, "fd00::1");
        assert_eq!(h.asnumber, "64512");
        assert_eq!(h.labels.get("rack").map(String::as_str), Some("r1"));
    }
}
