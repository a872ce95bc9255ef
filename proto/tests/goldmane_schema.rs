//! Checks our `goldmane.proto` against Calico's Goldmane API.
//!
//! `testdata/goldmane_field_numbers.json` holds Calico's names and numbers (see its "source" key),
//! transcribed from Calico's schema, not from ours. Our descriptor set must have exactly those
//! services, messages, fields (number, label and type) and enum values, and nothing more: an
//! extra field or value could collide with one Goldmane adds later.

use std::collections::BTreeMap;

use felix_proto::goldmane;
use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{FileDescriptorProto, FileDescriptorSet};
use serde_json::{Value, json};

const TABLE: &str = include_str!("../../testdata/goldmane_field_numbers.json");

fn file() -> FileDescriptorProto {
    let set = FileDescriptorSet::decode(goldmane::FILE_DESCRIPTOR_SET).expect("descriptor decodes");
    let file = set
        .file
        .into_iter()
        .find(|f| f.name() == "goldmane.proto")
        .expect("goldmane.proto is in the descriptor set");
    assert_eq!(file.package(), "goldmane");
    file
}

fn table() -> Value {
    serde_json::from_str(TABLE).expect("table is valid JSON")
}

/// The type of a field as Calico's schema writes it: `int64`, `repeated PolicyHit`, ….
fn written_type(f: &prost_types::FieldDescriptorProto) -> String {
    let base = match f.r#type() {
        Type::Message | Type::Enum => f
            .type_name()
            .strip_prefix(".goldmane.")
            .unwrap_or_else(|| panic!("{}: type outside the package", f.name()))
            .to_string(),
        Type::Int64 => "int64".into(),
        Type::String => "string".into(),
        Type::Bool => "bool".into(),
        other => panic!("{}: unexpected type {other:?}", f.name()),
    };
    if f.label() == Label::Repeated {
        format!("repeated {base}")
    } else {
        base
    }
}

#[test]
fn table_is_calicos_and_complete() {
    let t = table();
    assert_eq!(t["source"]["repo"], "projectcalico/calico");
    assert_eq!(t["source"]["path"], "goldmane/proto/api.proto");
    assert_eq!(t["messages"].as_object().unwrap().len(), 21);
    assert_eq!(t["enums"].as_object().unwrap().len(), 10);
    assert_eq!(t["messages"]["FlowKey"].as_object().unwrap().len(), 15);
    assert_eq!(t["messages"]["Flow"].as_object().unwrap().len(), 12);
}

#[test]
fn messages_have_calicos_fields_numbers_and_types_and_nothing_more() {
    let file = file();
    let t = table();
    let expected = t["messages"].as_object().unwrap();
    let ours: BTreeMap<_, _> = file
        .message_type
        .iter()
        .map(|m| (m.name().to_string(), m))
        .collect();
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>(),
        "message names differ"
    );
    let mut checked = 0;
    for (name, fields) in expected {
        let m = ours[name.as_str()];
        assert!(m.nested_type.is_empty() && m.enum_type.is_empty(), "{name}");
        assert!(m.oneof_decl.is_empty(), "{name} has a oneof");
        let fields = fields.as_object().unwrap();
        assert_eq!(m.field.len(), fields.len(), "{name}: field count");
        for (fname, spec) in fields {
            let f = m
                .field
                .iter()
                .find(|f| f.name() == fname)
                .unwrap_or_else(|| panic!("{name}.{fname} missing"));
            assert_eq!(
                i64::from(f.number()),
                spec[0].as_i64().unwrap(),
                "{name}.{fname}"
            );
            assert_eq!(written_type(f), spec[1].as_str().unwrap(), "{name}.{fname}");
            assert!(!f.proto3_optional(), "{name}.{fname} is `optional`");
            checked += 1;
        }
    }
    assert_eq!(checked, 97);
}

#[test]
fn enums_have_calicos_values_and_nothing_more() {
    let file = file();
    let t = table();
    let expected = t["enums"].as_object().unwrap();
    let ours: BTreeMap<_, _> = file
        .enum_type
        .iter()
        .map(|e| {
            let values: BTreeMap<String, Value> = e
                .value
                .iter()
                .map(|v| (v.name().to_string(), json!(v.number())))
                .collect();
            (e.name().to_string(), values)
        })
        .collect();
    let expected: BTreeMap<String, BTreeMap<String, Value>> = expected
        .iter()
        .map(|(k, v)| {
            let values = v
                .as_object()
                .unwrap()
                .iter()
                .map(|(n, x)| (n.clone(), x.clone()))
                .collect();
            (k.clone(), values)
        })
        .collect();
    assert_eq!(ours, expected);
}

#[test]
fn services_have_calicos_rpcs() {
    let file = file();
    let t = table();
    let mut ours = serde_json::Map::new();
    for s in &file.service {
        let mut rpcs = serde_json::Map::new();
        for m in &s.method {
            rpcs.insert(
                m.name().to_string(),
                json!({
                    "input": m.input_type().strip_prefix(".goldmane.").unwrap(),
                    "output": m.output_type().strip_prefix(".goldmane.").unwrap(),
                    "client_streaming": m.client_streaming(),
                    "server_streaming": m.server_streaming(),
                }),
            );
        }
        ours.insert(s.name().to_string(), Value::Object(rpcs));
    }
    assert_eq!(Value::Object(ours), t["services"]);
}

#[test]
fn generated_enums_carry_the_same_numbers() {
    // The Rust side agrees with the descriptor (spot checks across every enum).
    assert_eq!(goldmane::Action::Pass as i32, 3);
    assert_eq!(goldmane::PolicyKind::EndOfTier as i32, 10);
    assert_eq!(goldmane::SortBy::SourceType as i32, 6);
    assert_eq!(goldmane::FilterType::PolicyName as i32, 6);
    assert_eq!(goldmane::EndpointType::Network as i32, 4);
    assert_eq!(goldmane::Reporter::Dst as i32, 2);
    assert_eq!(goldmane::MatchType::Fuzzy as i32, 1);
    assert_eq!(goldmane::StatisticType::LiveConnectionCount as i32, 2);
    assert_eq!(goldmane::StatisticsGroupBy::PolicyRule as i32, 1);
    assert_eq!(goldmane::RuleDirection::Egress as i32, 2);
}

fn sample_flow() -> goldmane::Flow {
    let hit = |name: &str, action: goldmane::Action, rule_index| goldmane::PolicyHit {
        kind: goldmane::PolicyKind::CalicoNetworkPolicy as i32,
        namespace: "prod".into(),
        name: name.into(),
        tier: "default".into(),
        action: action as i32,
        policy_index: 0,
        rule_index,
        trigger: None,
    };
    goldmane::Flow {
        key: Some(goldmane::FlowKey {
            source_name: "client-*".into(),
            source_namespace: "prod".into(),
            source_type: goldmane::EndpointType::WorkloadEndpoint as i32,
            dest_name: "pub".into(),
            dest_type: goldmane::EndpointType::Network as i32,
            dest_port: 443,
            proto: "tcp".into(),
            reporter: goldmane::Reporter::Src as i32,
            action: goldmane::Action::Deny as i32,
            policies: Some(goldmane::PolicyTrace {
                enforced_policies: vec![hit("egress", goldmane::Action::Deny, 1)],
                pending_policies: vec![],
            }),
            ..Default::default()
        }),
        start_time: 1_700_000_010,
        end_time: 1_700_000_025,
        source_labels: vec!["app=client".into()],
        packets_out: 3,
        num_connections_started: 1,
        ..Default::default()
    }
}

#[cfg(feature = "json")]
#[test]
fn flow_json_uses_goldmanes_field_names_and_enum_names() {
    let v = serde_json::to_value(sample_flow()).unwrap();
    assert_eq!(
        v,
        json!({
            "Key": {
                "source_name": "client-*",
                "source_namespace": "prod",
                "source_type": "WorkloadEndpoint",
                "dest_name": "pub",
                "dest_type": "Network",
                "dest_port": "443",
                "proto": "tcp",
                "reporter": "Src",
                "action": "Deny",
                "policies": {
                    "enforced_policies": [{
                        "kind": "CalicoNetworkPolicy",
                        "namespace": "prod",
                        "name": "egress",
                        "tier": "default",
                        "action": "Deny",
                        "rule_index": "1",
                    }],
                },
            },
            "start_time": "1700000010",
            "end_time": "1700000025",
            "source_labels": ["app=client"],
            "packets_out": "3",
            "num_connections_started": "1",
        })
    );
    assert_eq!(v["Key"]["action"], "Deny");
    assert_eq!(
        v["Key"]["policies"]["enforced_policies"][0]["name"],
        "egress"
    );
}

#[cfg(feature = "json")]
#[test]
fn flow_json_round_trips_and_accepts_numbers_and_camel_case() {
    let f = sample_flow();
    let text = serde_json::to_string(&f).unwrap();
    let back: goldmane::Flow = serde_json::from_str(&text).unwrap();
    assert_eq!(back, f);
    // What Goldmane's Go JSON writes: enums and int64 as numbers; and the lowerCamelCase form.
    let go: goldmane::Flow = serde_json::from_value(json!({
        "Key": {"action": 2, "dest_port": 443, "policies": {"enforcedPolicies": [{"ruleIndex": 1}]}},
        "startTime": 1_700_000_010,
    }))
    .unwrap();
    let key = go.key.unwrap();
    assert_eq!(key.action, goldmane::Action::Deny as i32);
    assert_eq!(key.dest_port, 443);
    assert_eq!(key.policies.unwrap().enforced_policies[0].rule_index, 1);
    assert_eq!(go.start_time, 1_700_000_010);
}

#[test]
fn flow_binary_round_trips() {
    let f = sample_flow();
    let bytes = f.encode_to_vec();
    assert_eq!(goldmane::Flow::decode(bytes.as_slice()).unwrap(), f);
}
