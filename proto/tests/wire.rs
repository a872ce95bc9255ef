//! Wire-level behaviour: round trips, bytes laid out the way Calico's Go code lays them out, and a
//! consumer that only knows Calico's fields reading our additions.

use felix_proto::{
    ActivePolicyUpdate, AgentHello, DataplaneInSync, EndpointStatus, FromDataplane, HttpMatch,
    IcmpTypeAndCode, InSync, IpSetUpdate, IpVersion, Policy, PolicyId, PortRange,
    ProcessStatusUpdate, Protocol, Rule, RuleMetadata, ServerHello, ServiceAccountMatch, TierInfo,
    ToDataplane, WorkloadEndpoint, WorkloadEndpointId, WorkloadEndpointStatusUpdate,
    WorkloadEndpointUpdate, from_dataplane, http_match, ip_set_update, protocol, rule,
    to_dataplane,
};
use prost::Message;

fn gnp(name: &str) -> PolicyId {
    PolicyId {
        name: name.to_string(),
        namespace: String::new(),
        kind: "GlobalNetworkPolicy".to_string(),
    }
}

fn np(namespace: &str, name: &str) -> PolicyId {
    PolicyId {
        name: name.to_string(),
        namespace: namespace.to_string(),
        kind: "NetworkPolicy".to_string(),
    }
}

fn strings(xs: &[&str]) -> Vec<String> {
    xs.iter().map(|s| s.to_string()).collect()
}

fn ipset_update() -> ToDataplane {
    ToDataplane {
        sequence_number: 2,
        payload: Some(to_dataplane::Payload::IpsetUpdate(IpSetUpdate {
            id: "s:5y5I3VdRZfDU01O--xXAPx2".to_string(),
            members: strings(&["10.0.0.1/32", "fc00::1/128"]),
            r#type: ip_set_update::IpSetType::Net as i32,
        })),
    }
}

fn policy_update() -> ToDataplane {
    let allow_tcp = Rule {
        action: "allow".to_string(),
        ip_version: IpVersion::Ipv4 as i32,
        protocol: Some(Protocol {
            number_or_name: Some(protocol::NumberOrName::Name("tcp".to_string())),
        }),
        src_ip_set_ids: strings(&["s:abc"]),
        dst_ports: vec![
            PortRange {
                first: 80,
                last: 80,
            },
            PortRange {
                first: 8000,
                last: 8080,
            },
        ],
        dst_named_port_ip_set_ids: strings(&["n:http"]),
        not_src_net: strings(&["10.1.0.0/16"]),
        src_service_account_match: Some(ServiceAccountMatch {
            selector: "role == 'web'".to_string(),
            names: strings(&["sa-1"]),
        }),
        http_match: Some(HttpMatch {
            methods: strings(&["GET"]),
            paths: vec![http_match::PathMatch {
                path_match: Some(http_match::path_match::PathMatch::Prefix(
                    "/api".to_string(),
                )),
            }],
        }),
        metadata: Some(RuleMetadata {
            annotations: [("owner".to_string(), "team-a".to_string())].into(),
        }),
        rule_id: "aBcDeFgHiJkLmNoP".to_string(),
        ..Default::default()
    };
    let deny_icmp = Rule {
        action: "deny".to_string(),
        protocol: Some(Protocol {
            number_or_name: Some(protocol::NumberOrName::Number(1)),
        }),
        // Type 0 (echo reply) must survive: the oneof makes it distinct from "unset".
        icmp: Some(rule::Icmp::IcmpType(0)),
        not_icmp: Some(rule::NotIcmp::NotIcmpTypeCode(IcmpTypeAndCode {
            r#type: 3,
            code: 4,
        })),
        ..Default::default()
    };
    ToDataplane {
        sequence_number: 3,
        payload: Some(to_dataplane::Payload::ActivePolicyUpdate(
            ActivePolicyUpdate {
                id: Some(np("prod", "allow-web")),
                policy: Some(Policy {
                    inbound_rules: vec![allow_tcp],
                    outbound_rules: vec![deny_icmp],
                    namespace: "prod".to_string(),
                    tier: "default".to_string(),
                    original_selector: "app == 'web'".to_string(),
                    ..Default::default()
                }),
            },
        )),
    }
}

fn workload_update() -> ToDataplane {
    ToDataplane {
        sequence_number: 4,
        payload: Some(to_dataplane::Payload::WorkloadEndpointUpdate(
            WorkloadEndpointUpdate {
                id: Some(WorkloadEndpointId {
                    orchestrator_id: "k8s".to_string(),
                    workload_id: "prod/web-0".to_string(),
                    endpoint_id: "eth0".to_string(),
                }),
                endpoint: Some(WorkloadEndpoint {
                    state: "active".to_string(),
                    name: "cali1234567890a".to_string(),
                    mac: "ee:ee:ee:ee:ee:ee".to_string(),
                    profile_ids: strings(&["kns.prod", "ksa.prod.default"]),
                    ipv4_nets: strings(&["10.65.0.2/32"]),
                    tiers: vec![
                        TierInfo {
                            name: "security".to_string(),
                            ingress_policies: vec![gnp("block-bad")],
                            egress_policies: vec![],
                            default_action: "Pass".to_string(),
                        },
                        TierInfo {
                            name: "default".to_string(),
                            ingress_policies: vec![np("prod", "allow-web"), gnp("default-deny")],
                            egress_policies: vec![gnp("default-deny")],
                            default_action: "Deny".to_string(),
                        },
                    ],
                    ..Default::default()
                }),
            },
        )),
    }
}

#[test]
fn to_dataplane_payloads_round_trip() {
    for msg in [ipset_update(), policy_update(), workload_update()] {
        let bytes = msg.encode_to_vec();
        assert!(!bytes.is_empty());
        let back = ToDataplane::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(back, msg);
    }
    // Spot-check that the interesting parts really made it, not just "equal to itself".
    let back = ToDataplane::decode(policy_update().encode_to_vec().as_slice()).unwrap();
    let Some(to_dataplane::Payload::ActivePolicyUpdate(update)) = back.payload else {
        panic!("wrong payload");
    };
    let policy = update.policy.unwrap();
    assert_eq!(policy.outbound_rules[0].icmp, Some(rule::Icmp::IcmpType(0)));
    assert_eq!(policy.inbound_rules[0].dst_ports.len(), 2);
    assert_eq!(update.id.unwrap().kind, "NetworkPolicy");
}

#[test]
fn length_delimited_stream_of_envelopes_round_trips_in_order() {
    // The gRPC stream and Felix's external-driver pipe both carry one envelope per frame; a
    // sequence of length-delimited messages must come back in the same order.
    let msgs = [ipset_update(), policy_update(), workload_update()];
    let mut buf = Vec::new();
    for m in &msgs {
        m.encode_length_delimited(&mut buf).unwrap();
    }
    let mut cursor = buf.as_slice();
    let mut back = Vec::new();
    while !cursor.is_empty() {
        back.push(ToDataplane::decode_length_delimited(&mut cursor).unwrap());
    }
    assert_eq!(back, msgs);
    let seqs: Vec<u64> = back.iter().map(|m| m.sequence_number).collect();
    assert_eq!(seqs, vec![2, 3, 4]);
}

#[test]
fn decodes_bytes_laid_out_as_calico_sends_them() {
    // in_sync (field 1, empty message) then sequence_number (field 15) = 7: the number order in
    // which Go's marshaller writes them.
    let in_sync = [0x0a, 0x00, 0x78, 0x07];
    let msg = ToDataplane::decode(&in_sync[..]).unwrap();
    assert_eq!(msg.sequence_number, 7);
    assert_eq!(msg.payload, Some(to_dataplane::Payload::InSync(InSync {})));
    // Field order on the wire must not matter.
    let reordered = [0x78, 0x07, 0x0a, 0x00];
    assert_eq!(ToDataplane::decode(&reordered[..]).unwrap(), msg);

    // IPSetUpdate (field 2): id = "s:a" (1), members "10.0.0.1/32" (2), type NET = 2 (3);
    // envelope sequence_number 300 (two-byte varint 0xac 0x02).
    let mut inner = vec![0x0a, 3];
    inner.extend_from_slice(b"s:a");
    inner.extend_from_slice(&[0x12, 11]);
    inner.extend_from_slice(b"10.0.0.1/32");
    inner.extend_from_slice(&[0x18, 0x02]);
    let mut bytes = vec![0x12, u8::try_from(inner.len()).unwrap()];
    bytes.extend_from_slice(&inner);
    bytes.extend_from_slice(&[0x78, 0xac, 0x02]);
    let msg = ToDataplane::decode(bytes.as_slice()).unwrap();
    assert_eq!(msg.sequence_number, 300);
    let Some(to_dataplane::Payload::IpsetUpdate(set)) = msg.payload else {
        panic!("expected ipset_update, got {:?}", msg.payload);
    };
    assert_eq!(set.id, "s:a");
    assert_eq!(set.members, vec!["10.0.0.1/32".to_string()]);
    assert_eq!(set.r#type(), ip_set_update::IpSetType::Net);
}

#[test]
fn decodes_status_reports_laid_out_as_felix_sends_them() {
    // FromDataplane: process_status_update (3) { iso_timestamp (1), uptime (2, fixed64 double) },
    // sequence_number (8) = 5.
    let ts = b"2024-01-02T03:04:05Z";
    let mut inner = vec![0x0a, u8::try_from(ts.len()).unwrap()];
    inner.extend_from_slice(ts);
    inner.push(0x11);
    inner.extend_from_slice(&12.5f64.to_le_bytes());
    let mut bytes = vec![0x1a, u8::try_from(inner.len()).unwrap()];
    bytes.extend_from_slice(&inner);
    bytes.extend_from_slice(&[0x40, 0x05]);
    let msg = FromDataplane::decode(bytes.as_slice()).unwrap();
    assert_eq!(msg.sequence_number, 5);
    assert_eq!(
        msg.payload,
        Some(from_dataplane::Payload::ProcessStatusUpdate(
            ProcessStatusUpdate {
                iso_timestamp: "2024-01-02T03:04:05Z".to_string(),
                uptime: 12.5,
            }
        ))
    );

    // dataplane_in_sync (10), empty.
    let msg = FromDataplane::decode(&[0x52, 0x00][..]).unwrap();
    assert_eq!(
        msg.payload,
        Some(from_dataplane::Payload::DataplaneInSync(DataplaneInSync {}))
    );

    // workload_endpoint_status_update (6) { id (1) { endpoint_id (4) = "eth0" }, status (2) { "up" } }
    let id = [0x22, 4, b'e', b't', b'h', b'0'];
    let status = [0x0a, 2, b'u', b'p'];
    let mut inner = vec![0x0a, u8::try_from(id.len()).unwrap()];
    inner.extend_from_slice(&id);
    inner.extend_from_slice(&[0x12, u8::try_from(status.len()).unwrap()]);
    inner.extend_from_slice(&status);
    let mut bytes = vec![0x32, u8::try_from(inner.len()).unwrap()];
    bytes.extend_from_slice(&inner);
    let msg = FromDataplane::decode(bytes.as_slice()).unwrap();
    assert_eq!(
        msg.payload,
        Some(from_dataplane::Payload::WorkloadEndpointStatusUpdate(
            WorkloadEndpointStatusUpdate {
                id: Some(WorkloadEndpointId {
                    endpoint_id: "eth0".to_string(),
                    ..Default::default()
                }),
                status: Some(EndpointStatus {
                    status: "up".to_string()
                }),
                endpoint: None,
            }
        ))
    );
}

/// What a consumer generated from Calico's proto sees of FromDataplane: the sequence number and
/// Calico's payloads, nothing of ours.
#[derive(Clone, PartialEq, prost::Message)]
struct CalicoOnlyFromDataplane {
    #[prost(uint64, tag = "8")]
    sequence_number: u64,
    #[prost(message, optional, tag = "3")]
    process_status_update: Option<ProcessStatusUpdate>,
    #[prost(message, optional, tag = "10")]
    dataplane_in_sync: Option<DataplaneInSync>,
}

/// Likewise for ToDataplane.
#[derive(Clone, PartialEq, prost::Message)]
struct CalicoOnlyToDataplane {
    #[prost(uint64, tag = "15")]
    sequence_number: u64,
    #[prost(message, optional, tag = "1")]
    in_sync: Option<InSync>,
}

#[test]
fn calico_only_consumers_skip_our_hellos() {
    let hello = FromDataplane {
        sequence_number: 1,
        payload: Some(from_dataplane::Payload::AgentHello(AgentHello {
            node_name: "node-1".to_string(),
            agent_version: "0.1.0".to_string(),
            capabilities: strings(&["dataplane-in-sync"]),
        })),
    };
    let bytes = hello.encode_to_vec();
    // Tag of field 1000, wire type 2: varint(1000 << 3 | 2) = 0xc2 0x3e.
    assert!(bytes.windows(2).any(|w| w == [0xc2, 0x3e]));
    let seen = CalicoOnlyFromDataplane::decode(bytes.as_slice()).expect("unknown field skipped");
    assert_eq!(
        seen,
        CalicoOnlyFromDataplane {
            sequence_number: 1,
            process_status_update: None,
            dataplane_in_sync: None,
        }
    );
    // And our decoder reads it back whole.
    assert_eq!(FromDataplane::decode(bytes.as_slice()).unwrap(), hello);

    let server = ToDataplane {
        sequence_number: 1,
        payload: Some(to_dataplane::Payload::ServerHello(ServerHello {
            server_version: "0.1.0".to_string(),
            capabilities: vec![],
            node_name: "node-1".to_string(),
        })),
    };
    let seen = CalicoOnlyToDataplane::decode(server.encode_to_vec().as_slice()).unwrap();
    assert_eq!(seen.sequence_number, 1);
    assert_eq!(seen.in_sync, None);
}

#[test]
fn calico_consumer_bytes_of_a_known_payload_decode_identically_on_both_sides() {
    let ours = FromDataplane {
        sequence_number: 9,
        payload: Some(from_dataplane::Payload::DataplaneInSync(DataplaneInSync {})),
    };
    let theirs = CalicoOnlyFromDataplane {
        sequence_number: 9,
        process_status_update: None,
        dataplane_in_sync: Some(DataplaneInSync {}),
    };
    assert_eq!(
        CalicoOnlyFromDataplane::decode(ours.encode_to_vec().as_slice()).unwrap(),
        theirs
    );
    assert_eq!(
        FromDataplane::decode(theirs.encode_to_vec().as_slice()).unwrap(),
        ours
    );
}

/// Reads (field number, wire type) pairs of the top level of an encoded message.
fn top_level_tags(mut buf: &[u8]) -> Vec<u32> {
    use prost::encoding::{WireType, decode_key, decode_varint};
    let mut tags = Vec::new();
    while !buf.is_empty() {
        let (tag, wire) = decode_key(&mut buf).unwrap();
        tags.push(tag);
        match wire {
            WireType::Varint => {
                decode_varint(&mut buf).unwrap();
            }
            WireType::LengthDelimited => {
                let len = usize::try_from(decode_varint(&mut buf).unwrap()).unwrap();
                buf = &buf[len..];
            }
            WireType::SixtyFourBit => buf = &buf[8..],
            WireType::ThirtyTwoBit => buf = &buf[4..],
            other => panic!("unexpected wire type {other:?}"),
        }
    }
    tags
}

#[test]
fn rules_encode_in_field_number_order_like_go() {
    // Calico derives rule_id from a hash over the Go-marshalled rule, and Go writes fields in
    // ascending number order. Our encoder must do the same for the id to be reproducible,
    // including the icmp oneof (8) sitting between dst_ports (7) and src_ip_set_ids (10).
    let Some(to_dataplane::Payload::ActivePolicyUpdate(update)) = policy_update().payload else {
        unreachable!()
    };
    let mut rule = update.policy.unwrap().inbound_rules[0].clone();
    rule.icmp = Some(rule::Icmp::IcmpType(8));
    rule.not_icmp = Some(rule::NotIcmp::NotIcmpType(3));
    let tags = top_level_tags(&rule.encode_to_vec());
    assert!(tags.contains(&8) && tags.contains(&107) && tags.contains(&201));
    let mut sorted = tags.clone();
    sorted.sort_unstable();
    assert_eq!(tags, sorted, "fields must be written in number order");
}

#[test]
fn truncated_input_is_an_error_not_a_partial_message() {
    let bytes = workload_update().encode_to_vec();
    let cut = &bytes[..bytes.len() - 3];
    assert!(ToDataplane::decode(cut).is_err());
}

#[cfg(feature = "grpc")]
#[test]
fn grpc_service_names_are_in_package_felix() {
    assert_eq!(
        felix_proto::calc_server_server::SERVICE_NAME,
        "felix.CalcServer"
    );
    assert_eq!(
        felix_proto::policy_sync_server::SERVICE_NAME,
        "felix.PolicySync"
    );
}
