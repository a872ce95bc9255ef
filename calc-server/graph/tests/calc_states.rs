//! Felix's calculation-graph states (testdata/calc_states_v3.json, converted from
//! felix/calc/states_for_test.go), driven through the graph with Felix-style expanders: every
//! transition between any two states, in forward and reverse update order, one update at a time
//! or all at once, with duplicates and with empty states in between, flushed at different points.
//! The node's dataplane (as the stream describes it) must depend only on the final state, and
//! the stream must never break its contract (see `calc_graph::stream_model`).

use std::collections::{BTreeMap, BTreeSet};

use calc_graph::graph::{CalcGraph, Update};
use calc_graph::model::{Decoded, Resource, ResourceKey};
use calc_graph::stream_model::StreamModel;
use felix_proto as pb;
use serde_json::Value;

struct State {
    name: String,
    node: String,
    resources: Vec<Resource>,
    expect: Value,
}

fn load() -> Vec<State> {
    let text = include_str!("../../../testdata/calc_states_v3.json");
    let doc: Value = serde_json::from_str(text).unwrap();
    doc["states"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| State {
            name: s["name"].as_str().unwrap().to_string(),
            node: s["node"].as_str().unwrap().to_string(),
            resources: s["resources"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| match Resource::from_value(r.clone()).unwrap() {
                    Decoded::Resource(_, res) => res,
                    other => panic!("{other:?}"),
                })
                .collect(),
            expect: s["expect"].clone(),
        })
        .collect()
}

/// The updates that move the datastore from `from` to `to` (Felix's `KVDeltas`).
fn deltas(from: &[Resource], to: &[Resource]) -> Vec<Update> {
    let old: BTreeMap<ResourceKey, &Resource> = from.iter().map(|r| (r.key(), r)).collect();
    let new: BTreeSet<ResourceKey> = to.iter().map(|r| r.key()).collect();
    let mut out: Vec<Update> = to
        .iter()
        .filter(|r| old.get(&r.key()) != Some(r))
        .map(|r| Update::Apply(r.clone()))
        .collect();
    out.extend(
        old.keys()
            .filter(|k| !new.contains(k))
            .map(|k| Update::Delete(k.clone())),
    );
    out
}

#[derive(Clone, Copy, Debug)]
enum Flush {
    AfterEach,
    AfterEachWithDuplicate,
    AfterState,
    AtEnd,
}

/// Runs a sequence of states through a fresh graph; returns the node's final dataplane.
fn run(states: &[&State], node: &str, reverse: bool, flush: Flush) -> StreamModel {
    let mut g = CalcGraph::new();
    g.subscribe(node);
    let mut dp = StreamModel::default();
    let mut prev: &[Resource] = &[];
    let drain = |g: &mut CalcGraph, dp: &mut StreamModel, ctx: &str| {
        for b in g.flush() {
            assert_eq!(b.node, node);
            if let Err(e) = dp.apply_all(b.messages.iter().map(|m| &**m)) {
                panic!("{ctx}: stream contract broken: {e}\n{:#?}", b.messages);
            }
        }
    };
    for (i, s) in states.iter().enumerate() {
        let mut ups = deltas(prev, &s.resources);
        if reverse {
            ups.reverse();
        }
        for u in ups {
            g.apply(u.clone())
                .unwrap_or_else(|e| panic!("{}: rejected {e}", s.name));
            if let Flush::AfterEachWithDuplicate = flush {
                g.apply(u).unwrap();
            }
            if matches!(flush, Flush::AfterEach | Flush::AfterEachWithDuplicate) {
                drain(&mut g, &mut dp, &s.name);
            }
        }
        if i == 0 {
            g.apply(Update::InSync).unwrap();
        }
        if !matches!(flush, Flush::AtEnd) {
            drain(&mut g, &mut dp, &s.name);
        }
        prev = &s.resources;
    }
    drain(&mut g, &mut dp, "end");
    assert!(dp.in_sync, "InSync must have been sent");
    dp
}

fn pid(v: &Value) -> (String, String, String) {
    (
        v["name"].as_str().unwrap().into(),
        v["namespace"].as_str().unwrap().into(),
        v["kind"].as_str().unwrap().into(),
    )
}

/// Felix's fixtures name workload endpoints `orch/wl/ep`; our ids carry the namespace in the
/// workload id as Calico's v3 → v1 conversion does (`orch/<namespace>/wl/ep`).
fn endpoint_id(fixture: &str) -> String {
    let parts: Vec<&str> = fixture.split('/').collect();
    if parts.len() == 3 {
        format!("{}/default/{}/{}", parts[0], parts[1], parts[2])
    } else {
        fixture.to_string()
    }
}

fn tiers_of(v: &[pb::TierInfo]) -> Vec<(String, Vec<String>, Vec<String>)> {
    v.iter()
        .map(|t| {
            (
                t.name.clone(),
                t.ingress_policies.iter().map(|p| p.name.clone()).collect(),
                t.egress_policies.iter().map(|p| p.name.clone()).collect(),
            )
        })
        .collect()
}

fn expected_tiers(v: &Value) -> Vec<(String, Vec<String>, Vec<String>)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let names = |k: &str| {
                t[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p["name"].as_str().unwrap().to_string())
                    .collect()
            };
            (
                t["name"].as_str().unwrap().to_string(),
                names("ingress_policies"),
                names("egress_policies"),
            )
        })
        .collect()
}

/// Checks a dataplane against a state's expectations.
fn check(dp: &StreamModel, s: &State, ctx: &str) {
    let e = &s.expect;
    let want_pols: BTreeSet<_> = e["active_policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(pid)
        .collect();
    let got_pols: BTreeSet<_> = dp.policies.keys().cloned().collect();
    assert_eq!(got_pols, want_pols, "{ctx}: active policies");
    let want_profs: BTreeSet<String> = e["active_profiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    let got_profs: BTreeSet<String> = dp.profiles.keys().cloned().collect();
    assert_eq!(got_profs, want_profs, "{ctx}: active profiles");
    let want_sets: BTreeMap<String, BTreeSet<String>> = e["ipsets"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(id, m)| {
            (
                id.clone(),
                m.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_str().unwrap().to_string())
                    .collect(),
            )
        })
        .collect();
    let got_sets: BTreeMap<String, BTreeSet<String>> = dp
        .ipsets
        .iter()
        .map(|(k, (_, m))| (k.clone(), m.clone()))
        .collect();
    assert_eq!(got_sets, want_sets, "{ctx}: IP sets");
    for (fixture_id, tiers) in e["endpoint_tiers"].as_object().unwrap() {
        let id = endpoint_id(fixture_id);
        let got = if let Some(w) = dp.workload_endpoints.get(&id) {
            tiers_of(&w.tiers)
        } else if let Some(h) = dp.host_endpoints.get(&id) {
            tiers_of(&h.tiers)
        } else {
            panic!(
                "{ctx}: endpoint {id} missing; have {:?} {:?}",
                dp.workload_endpoints.keys(),
                dp.host_endpoints.keys()
            )
        };
        assert_eq!(got, expected_tiers(tiers), "{ctx}: tiers of {id}");
    }
    let ep_count = dp.workload_endpoints.len() + dp.host_endpoints.len();
    assert_eq!(
        ep_count,
        e["endpoint_tiers"].as_object().unwrap().len(),
        "{ctx}: endpoint count"
    );
    for (field, key) in [
        ("endpoint_untracked_tiers", 0),
        ("endpoint_prednat_tiers", 1),
    ] {
        if let Some(m) = e.get(field).and_then(|v| v.as_object()) {
            for (id, tiers) in m {
                let h = dp
                    .host_endpoints
                    .get(id)
                    .unwrap_or_else(|| panic!("{ctx}: host endpoint {id}"));
                let got = tiers_of(if key == 0 {
                    &h.untracked_tiers
                } else {
                    &h.pre_dnat_tiers
                });
                assert_eq!(got, expected_tiers(tiers), "{ctx}: {field} of {id}");
            }
        }
    }
    for (field, untracked) in [("untracked_policies", true), ("prednat_policies", false)] {
        if let Some(list) = e.get(field).and_then(|v| v.as_array()) {
            let want: BTreeSet<_> = list.iter().map(pid).collect();
            let got: BTreeSet<_> = dp
                .policies
                .iter()
                .filter(|(_, p)| if untracked { p.untracked } else { p.pre_dnat })
                .map(|(k, _)| k.clone())
                .collect();
            assert_eq!(got, want, "{ctx}: {field}");
        }
    }
}

const FLUSHES: [Flush; 4] = [
    Flush::AfterEach,
    Flush::AfterEachWithDuplicate,
    Flush::AfterState,
    Flush::AtEnd,
];

#[test]
fn each_state_from_empty() {
    let states = load();
    assert_eq!(states.len(), 7);
    for s in &states {
        for reverse in [false, true] {
            for flush in FLUSHES {
                let dp = run(&[s], &s.node, reverse, flush);
                check(
                    &dp,
                    s,
                    &format!("{} (reverse={reverse}, {flush:?})", s.name),
                );
            }
        }
    }
}

#[test]
fn every_transition_between_states_converges() {
    let states = load();
    let empty = State {
        name: "empty".into(),
        node: states[0].node.clone(),
        resources: vec![],
        expect: Value::Null,
    };
    for a in &states {
        for b in &states {
            for reverse in [false, true] {
                for flush in FLUSHES {
                    let ctx = format!("{} -> {} (reverse={reverse}, {flush:?})", a.name, b.name);
                    let dp = run(&[a, b], &b.node, reverse, flush);
                    check(&dp, b, &ctx);
                    // With an empty state in between, and back again.
                    let dp2 = run(&[a, &empty, b], &b.node, reverse, flush);
                    assert_eq!(dp2, dp, "{ctx}: via empty differs");
                }
            }
        }
    }
}

#[test]
fn squashed_and_split_sequences_agree() {
    let states = load();
    // Squashed: the last state applied directly; split: all states in order, then reversed.
    let all: Vec<&State> = states.iter().collect();
    let mut rev = all.clone();
    rev.reverse();
    for seq in [&all, &rev] {
        let last = seq.last().unwrap();
        let long = run(seq, &last.node, false, Flush::AfterState);
        let direct = run(&[last], &last.node, false, Flush::AtEnd);
        assert_eq!(long, direct, "sequence ending in {}", last.name);
        check(&long, last, "long sequence");
    }
}
