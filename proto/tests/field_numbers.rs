//! Checks our compiled schema against Calico's field numbers.
//!
//! `testdata/proto_field_numbers.json` is extracted from Calico's `felixbackend.proto` (not ours;
//! see its "source" key and `proto/tools/extract_field_numbers.py`). For every message and enum it
//! lists, our descriptor set must have the same names, numbers, labels, types, oneof membership
//! and map key/value types; none of our extra fields may reuse a number Calico uses or reserves.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{
    DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorProto,
    FileDescriptorSet,
};
use serde_json::Value;

const TABLE: &str = include_str!("../../testdata/proto_field_numbers.json");

/// Top-level keys of the table that are not message or enum names.
const META_KEYS: [&str; 3] = ["source", "field_types", "reserved"];

/// Our additions to Calico's messages: (message, field, number).
const OUR_ADDITIONS: [(&str, &str, i32); 5] = [
    ("ToDataplane", "server_hello", 1000),
    ("FromDataplane", "agent_hello", 1000),
    ("FromDataplane", "dataplane_applied", 1001),
    ("FromDataplane", "rule_stats", 1002),
    ("FromDataplane", "flow_report", 1003),
];

struct Schema {
    messages: BTreeMap<String, DescriptorProto>,
    enums: BTreeMap<String, EnumDescriptorProto>,
    file: FileDescriptorProto,
}

fn schema() -> Schema {
    let set = FileDescriptorSet::decode(felix_proto::FILE_DESCRIPTOR_SET)
        .expect("FILE_DESCRIPTOR_SET decodes");
    let file = set
        .file
        .into_iter()
        .find(|f| f.name() == "felixbackend.proto")
        .expect("felixbackend.proto is in the descriptor set");
    assert_eq!(file.package(), "felix");
    let mut messages = BTreeMap::new();
    let mut enums = BTreeMap::new();
    for e in &file.enum_type {
        enums.insert(e.name().to_string(), e.clone());
    }
    for m in &file.message_type {
        index_message(m, "", &mut messages, &mut enums);
    }
    Schema {
        messages,
        enums,
        file,
    }
}

fn index_message(
    m: &DescriptorProto,
    prefix: &str,
    messages: &mut BTreeMap<String, DescriptorProto>,
    enums: &mut BTreeMap<String, EnumDescriptorProto>,
) {
    let name = format!("{prefix}{}", m.name());
    for e in &m.enum_type {
        enums.insert(format!("{name}.{}", e.name()), e.clone());
    }
    for n in &m.nested_type {
        index_message(n, &format!("{name}."), messages, enums);
    }
    messages.insert(name, m.clone());
}

fn table() -> serde_json::Map<String, Value> {
    match serde_json::from_str(TABLE).expect("table is valid JSON") {
        Value::Object(map) => map,
        other => panic!("table must be a JSON object, got {other}"),
    }
}

/// Message and enum entries of the table (everything but the meta keys).
fn entries(table: &serde_json::Map<String, Value>) -> BTreeMap<String, BTreeMap<String, i64>> {
    table
        .iter()
        .filter(|(k, _)| !META_KEYS.contains(&k.as_str()))
        .map(|(k, v)| {
            let fields = v
                .as_object()
                .unwrap_or_else(|| panic!("{k}: expected an object"))
                .iter()
                .map(|(f, n)| {
                    let n = n
                        .as_i64()
                        .unwrap_or_else(|| panic!("{k}.{f}: expected an integer"));
                    (f.clone(), n)
                })
                .collect();
            (k.clone(), fields)
        })
        .collect()
}

fn field<'a>(m: &'a DescriptorProto, name: &str) -> Option<&'a FieldDescriptorProto> {
    m.field.iter().find(|f| f.name() == name)
}

fn reserved_numbers(m: &DescriptorProto) -> BTreeSet<i32> {
    m.reserved_range
        .iter()
        .flat_map(|r| r.start()..r.end())
        .collect()
}

fn label_name(f: &FieldDescriptorProto) -> &'static str {
    Label::try_from(f.label.unwrap_or_default())
        .expect("known label")
        .as_str_name()
}

fn type_name_of(f: &FieldDescriptorProto) -> &'static str {
    Type::try_from(f.r#type.unwrap_or_default())
        .expect("known type")
        .as_str_name()
}

#[test]
fn table_is_calicos_and_not_trivially_small() {
    let table = table();
    let source = table["source"].as_object().expect("source is an object");
    assert_eq!(source["repo"], "projectcalico/calico");
    assert_eq!(source["path"], "felix/proto/felixbackend.proto");
    let entries = entries(&table);
    // Calico's ToDataplane has sequence_number plus 33 live oneof members; FromDataplane has
    // sequence_number plus 7. A truncated table must not pass the checks below vacuously.
    assert_eq!(entries["ToDataplane"].len(), 34);
    assert_eq!(entries["FromDataplane"].len(), 8);
    assert!(entries.len() > 80, "only {} entries", entries.len());
    // Our own messages must never appear in a table that claims to be Calico's.
    for ours in ["AgentHello", "ServerHello"] {
        assert!(!entries.contains_key(ours), "{ours} is not Calico's");
    }
}

#[test]
fn every_calico_message_and_enum_has_the_same_numbers_here() {
    let schema = schema();
    let mut checked_fields = 0;
    for (name, expected) in entries(&table()) {
        if let Some(msg) = schema.messages.get(&name) {
            for (fname, number) in &expected {
                let ours = field(msg, fname)
                    .unwrap_or_else(|| panic!("{name}.{fname} is missing from our schema"));
                assert_eq!(
                    i64::from(ours.number()),
                    *number,
                    "{name}.{fname}: number differs from Calico's"
                );
                checked_fields += 1;
            }
        } else if let Some(en) = schema.enums.get(&name) {
            for (vname, number) in &expected {
                let ours = en
                    .value
                    .iter()
                    .find(|v| v.name() == vname)
                    .unwrap_or_else(|| panic!("enum value {name}.{vname} is missing"));
                assert_eq!(
                    i64::from(ours.number()),
                    *number,
                    "{name}.{vname}: value differs from Calico's"
                );
            }
            // No extra enum values: a value we add could collide with one Calico adds later.
            assert_eq!(
                en.value.len(),
                expected.len(),
                "enum {name} has values Calico does not have"
            );
        } else {
            panic!("{name} is in Calico's schema but not in ours");
        }
    }
    assert!(checked_fields > 250, "only {checked_fields} fields checked");
}

#[test]
fn field_labels_types_oneofs_and_maps_match_calico() {
    let schema = schema();
    let table = table();
    let types = table["field_types"]
        .as_object()
        .expect("field_types is an object");
    let entries = entries(&table);
    for (mname, fields) in types {
        assert!(
            entries.contains_key(mname),
            "field_types lists {mname}, which has no number entry"
        );
        let msg = &schema.messages[mname];
        for (fname, want) in fields.as_object().expect("object") {
            let got = field(msg, fname).unwrap_or_else(|| panic!("{mname}.{fname} missing"));
            let ctx = format!("{mname}.{fname}");
            assert_eq!(label_name(got), want["label"], "{ctx}: label");
            assert_eq!(type_name_of(got), want["type"], "{ctx}: type");
            match want.get("type_name") {
                Some(t) => assert_eq!(got.type_name(), t, "{ctx}: type_name"),
                None => assert!(got.type_name.is_none(), "{ctx}: unexpected type_name"),
            }
            let our_oneof = got
                .oneof_index
                .map(|i| msg.oneof_decl[i as usize].name().to_string());
            let want_oneof = want
                .get("oneof")
                .map(|v| v.as_str().expect("str").to_string());
            assert_eq!(our_oneof, want_oneof, "{ctx}: oneof membership");
            if let Some(map) = want.get("map") {
                // Map fields are repeated messages of a synthetic "<Field>Entry" type with
                // key = 1 and value = 2.
                let entry_name = got
                    .type_name()
                    .strip_prefix(".felix.")
                    .expect("entry type is in package felix");
                let entry = &schema.messages[entry_name];
                assert!(
                    entry.options.as_ref().is_some_and(|o| o.map_entry()),
                    "{ctx}: {entry_name} is not a map entry"
                );
                let key = field(entry, "key").expect("map key");
                let value = field(entry, "value").expect("map value");
                assert_eq!((key.number(), value.number()), (1, 2));
                assert_eq!(type_name_of(key), map["key"], "{ctx}: map key type");
                assert_eq!(type_name_of(value), map["value"], "{ctx}: map value type");
                if let Some(t) = map.get("value_type_name") {
                    assert_eq!(value.type_name(), t, "{ctx}: map value message");
                }
            }
        }
    }
}

#[test]
fn our_numbers_never_collide_with_calicos() {
    let schema = schema();
    let table = table();
    let entries = entries(&table);
    let reserved = table["reserved"]
        .as_object()
        .expect("reserved is an object");
    let mut extras = BTreeSet::new();
    for (mname, calico_fields) in &entries {
        let Some(msg) = schema.messages.get(mname) else {
            continue; // an enum
        };
        let by_number: BTreeMap<i64, &String> =
            calico_fields.iter().map(|(f, n)| (*n, f)).collect();
        let calico_reserved: BTreeSet<i64> = reserved
            .get(mname)
            .map(|r| {
                r["numbers"]
                    .as_array()
                    .expect("numbers")
                    .iter()
                    .map(|n| n.as_i64().expect("int"))
                    .collect()
            })
            .unwrap_or_default();
        for f in &msg.field {
            let n = i64::from(f.number());
            if let Some(calico_name) = by_number.get(&n) {
                assert_eq!(
                    f.name(),
                    calico_name.as_str(),
                    "{mname}: our field {} uses Calico's number {n} (Calico's {calico_name})",
                    f.name()
                );
            } else {
                assert!(
                    !calico_reserved.contains(&n),
                    "{mname}.{} uses number {n}, which Calico reserves",
                    f.name()
                );
                extras.insert((mname.clone(), f.name().to_string(), f.number()));
            }
        }
    }
    let expected: BTreeSet<_> = OUR_ADDITIONS
        .iter()
        .map(|(m, f, n)| (m.to_string(), f.to_string(), *n))
        .collect();
    assert_eq!(
        extras, expected,
        "fields on Calico's messages that Calico does not have"
    );
}

#[test]
fn calicos_reserved_numbers_and_names_stay_reserved() {
    let schema = schema();
    let table = table();
    let reserved = table["reserved"]
        .as_object()
        .expect("reserved is an object");
    assert!(
        reserved.contains_key("PolicyID"),
        "PolicyID reserves 1 (tier)"
    );
    for (mname, r) in reserved {
        let msg = &schema.messages[mname];
        let ours = reserved_numbers(msg);
        for n in r["numbers"].as_array().expect("numbers") {
            let n = i32::try_from(n.as_i64().expect("int")).expect("fits i32");
            assert!(ours.contains(&n), "{mname}: {n} must stay reserved");
        }
        for name in r["names"].as_array().expect("names") {
            let name = name.as_str().expect("str");
            assert!(
                msg.reserved_name.iter().any(|x| x == name),
                "{mname}: name {name:?} must stay reserved"
            );
        }
    }
}

#[test]
fn our_hello_messages_have_the_documented_shape() {
    let schema = schema();
    let agent = &schema.messages["AgentHello"];
    let server = &schema.messages["ServerHello"];
    let shape = |m: &DescriptorProto| -> Vec<(String, i32, &'static str, &'static str)> {
        m.field
            .iter()
            .map(|f| {
                (
                    f.name().to_string(),
                    f.number(),
                    label_name(f),
                    type_name_of(f),
                )
            })
            .collect()
    };
    let s = |x: &str| x.to_string();
    assert_eq!(
        shape(agent),
        vec![
            (s("node_name"), 1, "LABEL_OPTIONAL", "TYPE_STRING"),
            (s("agent_version"), 2, "LABEL_OPTIONAL", "TYPE_STRING"),
            (s("capabilities"), 3, "LABEL_REPEATED", "TYPE_STRING"),
        ]
    );
    assert_eq!(
        shape(server),
        vec![
            (s("server_version"), 1, "LABEL_OPTIONAL", "TYPE_STRING"),
            (s("capabilities"), 2, "LABEL_REPEATED", "TYPE_STRING"),
            (s("node_name"), 3, "LABEL_OPTIONAL", "TYPE_STRING"),
        ]
    );
    // Both hellos are members of the envelopes' payload oneof.
    for (env, fname, ty) in [
        ("ToDataplane", "server_hello", ".felix.ServerHello"),
        ("FromDataplane", "agent_hello", ".felix.AgentHello"),
        (
            "FromDataplane",
            "dataplane_applied",
            ".felix.DataplaneApplied",
        ),
    ] {
        let m = &schema.messages[env];
        let f = field(m, fname).expect("our field");
        assert_eq!(f.type_name(), ty);
        let oneof = f.oneof_index.expect("in a oneof") as usize;
        assert_eq!(m.oneof_decl[oneof].name(), "payload");
    }
}

#[test]
fn services_are_declared_as_documented() {
    let schema = schema();
    let services: BTreeMap<&str, _> = schema.file.service.iter().map(|s| (s.name(), s)).collect();
    let calc = services["CalcServer"];
    assert_eq!(calc.method.len(), 1);
    let sync = &calc.method[0];
    assert_eq!(sync.name(), "Sync");
    assert_eq!(sync.input_type(), ".felix.FromDataplane");
    assert_eq!(sync.output_type(), ".felix.ToDataplane");
    assert!(sync.client_streaming() && sync.server_streaming());

    let policy_sync = services["PolicySync"];
    let methods: Vec<_> = policy_sync
        .method
        .iter()
        .map(|m| {
            (
                m.name(),
                m.input_type(),
                m.output_type(),
                m.client_streaming(),
                m.server_streaming(),
            )
        })
        .collect();
    assert_eq!(
        methods,
        vec![
            (
                "Sync",
                ".felix.SyncRequest",
                ".felix.ToDataplane",
                false,
                true
            ),
            (
                "Report",
                ".felix.DataplaneStats",
                ".felix.ReportResult",
                false,
                false
            ),
        ]
    );
}
