//! Unit tests of the flow store: bucketing and expiry, aggregation, the key cap, each filter,
//! sort and paging, aggregation intervals, time windows, hints and statistics, with the values
//! each must give.

use felix_proto::goldmane::{
    Action, EndpointType, Filter, FilterHintsRequest, FilterType, Flow, FlowKey, FlowListRequest,
    MatchType, PolicyHit, PolicyKind, PolicyMatch, PolicyTrace, PortMatch, Reporter, RuleDirection,
    SortBy, SortOption, StatisticType, StatisticsGroupBy, StatisticsRequest, StringMatch,
};

use super::store::bucket_start;
use super::*;

/// A bucket start (1_700_000_010 = 15 × 113_333_334, also a multiple of 30).
const T0: i64 = 1_700_000_010;

fn key(src: &str, dst: &str) -> FlowKey {
    FlowKey {
        source_name: src.into(),
        source_namespace: "ns-a".into(),
        source_type: EndpointType::WorkloadEndpoint as i32,
        dest_name: dst.into(),
        dest_namespace: "ns-b".into(),
        dest_type: EndpointType::WorkloadEndpoint as i32,
        dest_port: 80,
        proto: "tcp".into(),
        reporter: Reporter::Src as i32,
        action: Action::Allow as i32,
        ..Default::default()
    }
}

fn rec(k: &FlowKey, t: i64, packets_in: i64) -> Flow {
    Flow {
        key: Some(k.clone()),
        start_time: t,
        end_time: t + 15,
        packets_in,
        packets_out: 2 * packets_in,
        bytes_in: 100 * packets_in,
        bytes_out: 200 * packets_in,
        num_connections_started: 1,
        num_connections_completed: 1,
        num_connections_live: 1,
        ..Default::default()
    }
}

fn hit(kind: PolicyKind, tier: &str, ns: &str, name: &str, action: Action, rule: i64) -> PolicyHit {
    PolicyHit {
        kind: kind as i32,
        namespace: ns.into(),
        name: name.into(),
        tier: tier.into(),
        action: action as i32,
        policy_index: 0,
        rule_index: rule,
        trigger: None,
    }
}

fn store() -> FlowStore {
    FlowStore::new(1000, MIN_BUCKETS)
}

fn list(s: &mut FlowStore, req: FlowListRequest) -> Vec<Flow> {
    s.list(&req, T0 + 20)
        .expect("valid request")
        .flows
        .into_iter()
        .map(|r| r.flow.unwrap())
        .collect()
}

/// Source and destination names of each flow, in order.
fn names(flows: &[Flow]) -> Vec<(String, String)> {
    flows
        .iter()
        .map(|f| {
            let k = f.key.as_ref().unwrap();
            (k.source_name.clone(), k.dest_name.clone())
        })
        .collect()
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

fn exact(v: &str) -> StringMatch {
    StringMatch {
        value: v.into(),
        r#type: MatchType::Exact as i32,
    }
}

fn fuzzy(v: &str) -> StringMatch {
    StringMatch {
        value: v.into(),
        r#type: MatchType::Fuzzy as i32,
    }
}

#[test]
fn buckets_start_at_multiples_of_15() {
    assert_eq!(bucket_start(T0), T0);
    assert_eq!(bucket_start(T0 + 14), T0);
    assert_eq!(bucket_start(T0 + 15), T0 + 15);
    assert_eq!(bucket_start(-1), -15);
    let s = store();
    assert_eq!(FlowStore::newest_bucket(T0 + 3), T0 + 15);
    assert_eq!(s.oldest_bucket(T0 + 3), T0 + 15 - 241 * 15);
    assert_eq!(FlowStore::new(10, 5).num_buckets(), MIN_BUCKETS);
    assert_eq!(FlowStore::new(10, 300).num_buckets(), 300);
}

#[test]
fn two_records_of_one_key_in_one_bucket_add_up_and_intersect_labels() {
    let mut s = store();
    let k = key("client-*", "server-*");
    let mut a = rec(&k, T0 + 1, 3);
    a.source_labels = vec!["app=client".into(), "tier=web".into()];
    a.dest_labels = vec!["app=server".into()];
    let mut b = rec(&k, T0 + 14, 4);
    b.source_labels = vec!["app=client".into(), "version=2".into()];
    b.dest_labels = vec!["app=server".into(), "x=y".into()];
    b.num_connections_live = 2;
    s.insert(&a, T0 + 5).unwrap();
    s.insert(&b, T0 + 15).unwrap();
    assert_eq!(s.num_keys(), 1);
    let flows = list(&mut s, FlowListRequest::default());
    assert_eq!(flows.len(), 1);
    let f = &flows[0];
    assert_eq!((f.start_time, f.end_time), (T0, T0 + 15));
    assert_eq!((f.packets_in, f.packets_out), (7, 14));
    assert_eq!((f.bytes_in, f.bytes_out), (700, 1400));
    assert_eq!(f.num_connections_started, 2);
    assert_eq!(f.num_connections_completed, 2);
    // Two nodes' reports for one interval: their live connections add up.
    assert_eq!(f.num_connections_live, 3);
    assert_eq!(f.source_labels, vec!["app=client".to_string()]);
    assert_eq!(f.dest_labels, vec!["app=server".to_string()]);
    assert_eq!(f.key.as_ref(), Some(&k));
}

#[test]
fn a_key_held_in_many_buckets_shares_one_copy_of_its_labels() {
    use std::sync::Arc;
    let mut s = store();
    let k = key("client-*", "server-*");
    let labelled = |t| {
        let mut r = rec(&k, t, 1);
        r.source_labels = vec!["tier=web".into(), "app=client".into()];
        r.dest_labels = vec!["app=server".into()];
        r
    };
    // Records inserted as whole flows (each with its own copy of the labels), then the same
    // key prepared once, as the ingest stores a conversation's records.
    for b in 0..3 {
        s.insert(&labelled(T0 + 15 * b), T0 + 40).unwrap();
    }
    let prepared = PreparedFlow::new(
        k.clone(),
        Labels::from(vec!["app=client".to_string(), "tier=web".to_string()]),
        Labels::from(vec!["app=server".to_string()]),
    )
    .unwrap();
    s.insert_prepared(&prepared, &Tally::default(), T0 + 45, T0 + 50)
        .unwrap();
    assert_eq!(s.num_keys(), 1);
    let held: Vec<_> = s.buckets.values().flat_map(|b| b.values()).collect();
    assert_eq!(held.len(), 4);
    for c in &held {
        assert!(Arc::ptr_eq(&c.source_labels, &held[0].source_labels));
        assert!(Arc::ptr_eq(&c.dest_labels, &held[0].dest_labels));
    }
    // Listed sorted, whatever order a record gave them in.
    let f = &list(&mut s, FlowListRequest::default())[0];
    assert_eq!(f.source_labels, ["app=client", "tier=web"]);
    // Unsorted labels are refused by name.
    let unsorted = Labels::from(vec!["b=1".to_string(), "a=1".to_string()]);
    let e = PreparedFlow::new(k.clone(), unsorted, Labels::default()).unwrap_err();
    assert!(
        matches!(
            e,
            Refused::Invalid {
                field: "source_labels",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_record_taken_back_leaves_the_others_and_frees_an_empty_key() {
    let mut s = store();
    let k = key("client-*", "server-*");
    let flow = PreparedFlow::new(k.clone(), Labels::default(), Labels::default()).unwrap();
    let one = Tally {
        packets_in: 2,
        bytes_in: 100,
        started: 1,
        ..Tally::default()
    };
    s.insert_prepared(&flow, &one, T0, T0 + 5).unwrap();
    s.insert_prepared(&flow, &one, T0, T0 + 5).unwrap();
    s.subtract(&flow, &one, T0);
    let f = &list(&mut s, FlowListRequest::default())[0];
    assert_eq!(
        (f.packets_in, f.bytes_in, f.num_connections_started),
        (2, 100, 1)
    );
    s.subtract(&flow, &one, T0);
    assert_eq!(s.num_keys(), 0, "nothing left: the key is forgotten");
    assert!(list(&mut s, FlowListRequest::default()).is_empty());
    // Taking back what was never stored changes nothing.
    s.subtract(&flow, &one, T0);
    assert_eq!(s.num_keys(), 0);
}

#[test]
fn records_of_different_keys_stay_apart() {
    let mut s = store();
    let k1 = key("a", "b");
    let mut k2 = key("a", "b");
    k2.dest_port = 443;
    s.insert(&rec(&k1, T0, 1), T0).unwrap();
    s.insert(&rec(&k2, T0, 5), T0).unwrap();
    let flows = list(&mut s, FlowListRequest::default());
    let mut packets: Vec<(i64, i64)> = flows
        .iter()
        .map(|f| (f.key.as_ref().unwrap().dest_port, f.packets_in))
        .collect();
    packets.sort();
    assert_eq!(packets, vec![(80, 1), (443, 5)]);
}

#[test]
fn old_buckets_expire_and_take_their_keys_with_them() {
    let mut s = store();
    let k = key("a", "b");
    let k2 = key("c", "d");
    s.insert(&rec(&k, T0, 1), T0).unwrap();
    s.insert(&rec(&k2, T0 + 15, 1), T0 + 15).unwrap();
    // The bucket at T0 is kept while now's bucket is at most T0 + 3600 (240 buckets later).
    let req = FlowListRequest::default();
    let at = |s: &mut FlowStore, now| -> Vec<(String, String)> {
        let mut v = names(
            &s.list(&req, now)
                .unwrap()
                .flows
                .into_iter()
                .map(|r| r.flow.unwrap())
                .collect::<Vec<_>>(),
        );
        v.sort();
        v
    };
    assert_eq!(at(&mut s, T0 + 3614), pairs(&[("a", "b"), ("c", "d")]));
    assert_eq!(s.num_keys(), 2);
    assert_eq!(at(&mut s, T0 + 3615), pairs(&[("c", "d")]));
    assert_eq!(s.num_keys(), 1);
    assert_eq!(s.buckets.keys().copied().collect::<Vec<_>>(), vec![T0 + 15]);
    s.expire(T0 + 3630);
    assert_eq!(s.num_keys(), 0);
    assert!(s.buckets.is_empty());
    // A key forgotten and seen again gets a new id.
    s.insert(&rec(&k, T0 + 3630, 1), T0 + 3630).unwrap();
    let r = s.list(&req, T0 + 3631).unwrap();
    assert_eq!(r.flows[0].id, 3);
}

#[test]
fn records_outside_the_window_are_refused_and_counted() {
    let mut s = store();
    let k = key("a", "b");
    // One bucket ahead of now is accepted (clock skew); two are not.
    s.insert(&rec(&k, T0 + 29, 1), T0).unwrap();
    assert_eq!(
        s.insert(&rec(&k, T0 + 30, 1), T0),
        Err(Refused::InFuture {
            start_time: T0 + 30,
            newest: T0 + 15
        })
    );
    let oldest = s.oldest_bucket(T0);
    s.insert(&rec(&k, oldest, 1), T0).unwrap();
    assert_eq!(
        s.insert(&rec(&k, oldest - 1, 1), T0),
        Err(Refused::TooOld {
            start_time: oldest - 1,
            oldest
        })
    );
    assert_eq!(
        s.drops(),
        DropCounts {
            key_cap: 0,
            too_old: 1,
            in_future: 1,
            invalid: 0
        }
    );
}

#[test]
fn the_key_cap_drops_new_keys_and_counts_them() {
    let mut s = FlowStore::new(2, MIN_BUCKETS);
    s.insert(&rec(&key("a", "x"), T0, 1), T0).unwrap();
    s.insert(&rec(&key("b", "x"), T0, 1), T0).unwrap();
    assert_eq!(
        s.insert(&rec(&key("c", "x"), T0, 1), T0),
        Err(Refused::KeyCap { cap: 2 })
    );
    assert_eq!(
        s.insert(&rec(&key("d", "x"), T0, 1), T0),
        Err(Refused::KeyCap { cap: 2 })
    );
    // Keys already held still count.
    s.insert(&rec(&key("a", "x"), T0 + 15, 1), T0 + 15).unwrap();
    assert_eq!(s.num_keys(), 2);
    assert_eq!(s.drops().key_cap, 2);
    // Once a key expires, a new one fits.
    s.expire(T0 + 3615);
    assert_eq!(s.num_keys(), 1);
    s.insert(&rec(&key("c", "x"), T0 + 3615, 1), T0 + 3615)
        .unwrap();
    assert_eq!(s.num_keys(), 2);
    assert_eq!(s.drops().key_cap, 2);
}

#[test]
fn invalid_records_are_refused_naming_the_field_and_value() {
    let mut s = store();
    let no_key = Flow {
        start_time: T0,
        ..Default::default()
    };
    let e = s.insert(&no_key, T0).unwrap_err();
    assert_eq!(e.to_string(), "invalid record: Key = none: missing");

    let mut neg = rec(&key("a", "b"), T0, 1);
    neg.bytes_out = -5;
    let e = s.insert(&neg, T0).unwrap_err();
    assert_eq!(e.to_string(), "invalid record: bytes_out = -5: negative");

    let long = "n".repeat(300);
    let e = s.insert(&rec(&key(&long, "b"), T0, 1), T0).unwrap_err();
    let Refused::Invalid { field, value, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(*field, "Key.source_name");
    assert!(value.contains("(300 bytes)"), "{value}");

    let mut k = key("a", "b");
    k.action = 9;
    let e = s.insert(&rec(&k, T0, 1), T0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid record: Key.action = 9: unknown enum value"
    );

    let mut k = key("a", "b");
    k.dest_port = 70000;
    assert!(matches!(
        s.insert(&rec(&k, T0, 1), T0),
        Err(Refused::Invalid {
            field: "Key.dest_port",
            ..
        })
    ));

    let mut k = key("a", "b");
    let mut inner = hit(
        PolicyKind::GlobalNetworkPolicy,
        "t",
        "",
        "p",
        Action::Deny,
        0,
    );
    inner.trigger = Some(Box::new(inner.clone()));
    let mut outer = hit(PolicyKind::EndOfTier, "t", "", "p", Action::Deny, -1);
    outer.trigger = Some(Box::new(inner));
    k.policies = Some(PolicyTrace {
        enforced_policies: vec![outer],
        pending_policies: vec![],
    });
    assert!(matches!(
        s.insert(&rec(&k, T0, 1), T0),
        Err(Refused::Invalid {
            field: "Key.policies.enforced_policies",
            ..
        })
    ));

    let mut many = rec(&key("a", "b"), T0, 1);
    many.dest_labels = (0..200).map(|i| format!("l{i}=v")).collect();
    assert!(matches!(
        s.insert(&many, T0),
        Err(Refused::Invalid {
            field: "dest_labels",
            ..
        })
    ));
    assert_eq!(s.drops().invalid, 7);
    assert_eq!(s.num_keys(), 0);
}

/// Five flows with distinct fields, for filters, sorts and paging.
fn filter_fixture() -> FlowStore {
    let mut s = store();
    let mut k1 = key("frontend-*", "backend-*");
    k1.source_namespace = "shop".into();
    k1.dest_namespace = "shop".into();
    k1.policies = Some(PolicyTrace {
        enforced_policies: vec![hit(
            PolicyKind::CalicoNetworkPolicy,
            "default",
            "shop",
            "allow-frontend",
            Action::Allow,
            0,
        )],
        pending_policies: vec![],
    });
    let mut k2 = key("backend-*", "db-*");
    k2.source_namespace = "shop".into();
    k2.dest_namespace = "data".into();
    k2.dest_port = 5432;
    k2.action = Action::Deny as i32;
    let mut eot = hit(PolicyKind::EndOfTier, "security", "", "", Action::Deny, -1);
    eot.trigger = Some(Box::new(hit(
        PolicyKind::GlobalNetworkPolicy,
        "security",
        "",
        "db-lockdown",
        Action::Unspecified,
        -1,
    )));
    k2.policies = Some(PolicyTrace {
        enforced_policies: vec![eot],
        pending_policies: vec![],
    });
    let mut k3 = key("pub", "frontend-*");
    k3.source_type = EndpointType::Network as i32;
    k3.source_namespace = String::new();
    k3.dest_namespace = "shop".into();
    k3.dest_port = 443;
    k3.reporter = Reporter::Dst as i32;
    k3.policies = Some(PolicyTrace {
        enforced_policies: vec![hit(
            PolicyKind::GlobalNetworkPolicy,
            "default",
            "",
            "allow-ingress",
            Action::Allow,
            2,
        )],
        pending_policies: vec![hit(
            PolicyKind::StagedGlobalNetworkPolicy,
            "default",
            "",
            "staged-deny",
            Action::Deny,
            1,
        )],
    });
    let mut k4 = key("dns-client", "kube-dns");
    k4.source_namespace = "kube-system".into();
    k4.dest_namespace = "kube-system".into();
    k4.dest_type = EndpointType::HostEndpoint as i32;
    k4.dest_port = 53;
    k4.proto = "udp".into();
    let mut k5 = key("batch-*", "corp-net");
    k5.source_namespace = "jobs".into();
    k5.dest_namespace = String::new();
    k5.dest_type = EndpointType::NetworkSet as i32;
    k5.dest_port = 443;
    k5.action = Action::Pass as i32;
    // Start times: k1 oldest … k5 newest.
    for (i, k) in [k1, k2, k3, k4, k5].iter().enumerate() {
        let t = T0 - 60 + 15 * i as i64;
        s.insert(&rec(k, t, 1), T0).unwrap();
    }
    s
}

fn filtered(f: Filter) -> Vec<String> {
    let mut s = filter_fixture();
    let mut v: Vec<String> = list(
        &mut s,
        FlowListRequest {
            filter: Some(f),
            ..Default::default()
        },
    )
    .iter()
    .map(|f| f.key.as_ref().unwrap().source_name.clone())
    .collect();
    v.sort();
    v
}

#[test]
fn filter_on_names_exact_and_fuzzy() {
    let f = |source_names, dest_names| Filter {
        source_names,
        dest_names,
        ..Default::default()
    };
    assert_eq!(
        filtered(f(vec![exact("backend-*")], vec![])),
        vec!["backend-*"]
    );
    assert_eq!(
        filtered(f(vec![exact("backend")], vec![])),
        Vec::<String>::new()
    );
    assert_eq!(
        filtered(f(vec![fuzzy("end")], vec![])),
        vec!["backend-*", "frontend-*"]
    );
    // A list is a disjunction…
    assert_eq!(
        filtered(f(vec![exact("pub"), exact("batch-*")], vec![])),
        vec!["batch-*", "pub"]
    );
    // …lists a conjunction.
    assert_eq!(
        filtered(f(vec![fuzzy("end")], vec![fuzzy("db")])),
        vec!["backend-*"]
    );
    assert_eq!(
        filtered(f(vec![], vec![exact("kube-dns")])),
        vec!["dns-client"]
    );
}

#[test]
fn filter_on_namespaces() {
    let f = |source_namespaces, dest_namespaces| Filter {
        source_namespaces,
        dest_namespaces,
        ..Default::default()
    };
    assert_eq!(
        filtered(f(vec![exact("shop")], vec![])),
        vec!["backend-*", "frontend-*"]
    );
    assert_eq!(
        filtered(f(vec![], vec![exact("shop")])),
        vec!["frontend-*", "pub"]
    );
    assert_eq!(
        filtered(f(vec![fuzzy("kube")], vec![fuzzy("system")])),
        vec!["dns-client"]
    );
}

#[test]
fn filter_on_protocols_ports_and_actions() {
    assert_eq!(
        filtered(Filter {
            protocols: vec![exact("udp")],
            ..Default::default()
        }),
        vec!["dns-client"]
    );
    assert_eq!(
        filtered(Filter {
            dest_ports: vec![PortMatch { port: 443 }, PortMatch { port: 5432 }],
            ..Default::default()
        }),
        vec!["backend-*", "batch-*", "pub"]
    );
    assert_eq!(
        filtered(Filter {
            actions: vec![Action::Deny as i32, Action::Pass as i32],
            ..Default::default()
        }),
        vec!["backend-*", "batch-*"]
    );
}

#[test]
fn filter_on_policies_against_both_traces() {
    let p = |m: PolicyMatch| {
        filtered(Filter {
            policies: vec![m],
            ..Default::default()
        })
    };
    assert_eq!(
        p(PolicyMatch {
            name: "allow-frontend".into(),
            ..Default::default()
        }),
        vec!["frontend-*"]
    );
    assert_eq!(
        p(PolicyMatch {
            kind: PolicyKind::GlobalNetworkPolicy as i32,
            ..Default::default()
        }),
        vec!["pub"]
    );
    assert_eq!(
        p(PolicyMatch {
            tier: "default".into(),
            action: Action::Allow as i32,
            ..Default::default()
        }),
        vec!["frontend-*", "pub"]
    );
    assert_eq!(
        p(PolicyMatch {
            namespace: "shop".into(),
            ..Default::default()
        }),
        vec!["frontend-*"]
    );
    // The pending trace counts too.
    assert_eq!(
        p(PolicyMatch {
            kind: PolicyKind::StagedGlobalNetworkPolicy as i32,
            action: Action::Deny as i32,
            ..Default::default()
        }),
        vec!["pub"]
    );
    // An end-of-tier hit answers for its tier's policy.
    assert_eq!(
        p(PolicyMatch {
            name: "db-lockdown".into(),
            action: Action::Deny as i32,
            ..Default::default()
        }),
        vec!["backend-*"]
    );
    assert_eq!(
        p(PolicyMatch {
            kind: PolicyKind::EndOfTier as i32,
            tier: "security".into(),
            ..Default::default()
        }),
        vec!["backend-*"]
    );
    assert_eq!(
        p(PolicyMatch {
            name: "allow-frontend".into(),
            action: Action::Deny as i32,
            ..Default::default()
        }),
        Vec::<String>::new()
    );
}

fn sorted_by(sort: Option<SortBy>) -> Vec<String> {
    let mut s = filter_fixture();
    list(
        &mut s,
        FlowListRequest {
            sort_by: sort
                .map(|s| SortOption { sort_by: s as i32 })
                .into_iter()
                .collect(),
            ..Default::default()
        },
    )
    .iter()
    .map(|f| f.key.as_ref().unwrap().source_name.clone())
    .collect()
}

#[test]
fn every_sort_option_orders_as_documented() {
    let newest_first = vec!["batch-*", "dns-client", "pub", "backend-*", "frontend-*"];
    assert_eq!(sorted_by(None), newest_first);
    assert_eq!(sorted_by(Some(SortBy::Time)), newest_first);
    assert_eq!(
        sorted_by(Some(SortBy::SourceName)),
        vec!["backend-*", "batch-*", "dns-client", "frontend-*", "pub"]
    );
    // Dest names: backend-*, corp-net, db-*, frontend-*, kube-dns.
    assert_eq!(
        sorted_by(Some(SortBy::DestName)),
        vec!["frontend-*", "batch-*", "backend-*", "pub", "dns-client"]
    );
    // Source namespaces "", jobs, kube-system, shop (backend newer than frontend).
    assert_eq!(
        sorted_by(Some(SortBy::SourceNamespace)),
        vec!["pub", "batch-*", "dns-client", "backend-*", "frontend-*"]
    );
    // Dest namespaces "", data, kube-system, shop (pub newer than frontend).
    assert_eq!(
        sorted_by(Some(SortBy::DestNamespace)),
        vec!["batch-*", "backend-*", "dns-client", "pub", "frontend-*"]
    );
    // Type names: HostEndpoint < Network < NetworkSet < WorkloadEndpoint.
    assert_eq!(
        sorted_by(Some(SortBy::DestType)),
        vec!["dns-client", "batch-*", "pub", "backend-*", "frontend-*"]
    );
    assert_eq!(
        sorted_by(Some(SortBy::SourceType)),
        vec!["pub", "batch-*", "dns-client", "backend-*", "frontend-*"]
    );
}

#[test]
fn paging_splits_the_sorted_results() {
    let mut s = filter_fixture();
    let page = |s: &mut FlowStore, page, page_size| {
        let r = s
            .list(
                &FlowListRequest {
                    page,
                    page_size,
                    sort_by: vec![SortOption {
                        sort_by: SortBy::SourceName as i32,
                    }],
                    ..Default::default()
                },
                T0 + 20,
            )
            .unwrap();
        let meta = r.meta.unwrap();
        let names: Vec<String> = r
            .flows
            .iter()
            .map(|f| {
                f.flow
                    .as_ref()
                    .unwrap()
                    .key
                    .as_ref()
                    .unwrap()
                    .source_name
                    .clone()
            })
            .collect();
        (meta.total_pages, meta.total_results, names)
    };
    assert_eq!(
        page(&mut s, 0, 2),
        (3, 5, vec!["backend-*".into(), "batch-*".into()])
    );
    assert_eq!(
        page(&mut s, 1, 2),
        (3, 5, vec!["dns-client".into(), "frontend-*".into()])
    );
    assert_eq!(page(&mut s, 2, 2), (3, 5, vec!["pub".into()]));
    assert_eq!(page(&mut s, 3, 2), (3, 5, vec![]));
    assert_eq!(page(&mut s, 0, 0).0, 1);
    assert_eq!(page(&mut s, 0, 0).2.len(), 5);
    let bad = |page, page_size| {
        s_err(FlowListRequest {
            page,
            page_size,
            ..Default::default()
        })
    };
    assert_eq!(bad(-1, 2).field, "page");
    assert_eq!(bad(1, 0).field, "page");
    let e = bad(0, 10_001);
    assert_eq!((e.field, e.value.as_str()), ("page_size", "10001"));
}

fn s_err(req: FlowListRequest) -> InvalidRequest {
    filter_fixture().list(&req, T0 + 20).unwrap_err()
}

#[test]
fn aggregation_intervals_group_buckets() {
    let mut s = store();
    let k = key("a", "b");
    for (i, live) in [3, 5, 2, 7].iter().enumerate() {
        let mut r = rec(&k, T0 + 15 * i as i64, i as i64 + 1);
        r.num_connections_live = *live;
        s.insert(&r, T0 + 50).unwrap();
    }
    let q = |s: &mut FlowStore, interval| {
        s.list(
            &FlowListRequest {
                aggregation_interval: interval,
                ..Default::default()
            },
            T0 + 70,
        )
        .map(|r| {
            r.flows
                .into_iter()
                .map(|r| {
                    let f = r.flow.unwrap();
                    (
                        f.start_time,
                        f.end_time,
                        f.packets_in,
                        f.num_connections_live,
                    )
                })
                .collect::<Vec<_>>()
        })
    };
    // Whole window: sums, live of the latest bucket, bounds of the buckets with data.
    assert_eq!(q(&mut s, 0).unwrap(), vec![(T0, T0 + 60, 10, 7)]);
    // 15 s: one flow per bucket, newest first.
    assert_eq!(
        q(&mut s, 15).unwrap(),
        vec![
            (T0 + 45, T0 + 60, 4, 7),
            (T0 + 30, T0 + 45, 3, 2),
            (T0 + 15, T0 + 30, 2, 5),
            (T0, T0 + 15, 1, 3),
        ]
    );
    // 30 s, aligned on multiples of 30 (T0 is one).
    assert_eq!(
        q(&mut s, 30).unwrap(),
        vec![(T0 + 30, T0 + 60, 7, 7), (T0, T0 + 30, 3, 5)]
    );
    // 45 s (T0 is a multiple of 45 too).
    assert_eq!(
        q(&mut s, 45).unwrap(),
        vec![(T0 + 45, T0 + 90, 4, 7), (T0, T0 + 45, 6, 2)]
    );
    for bad in [20, -15, 7] {
        let e = q(&mut s, bad).unwrap_err();
        assert_eq!(e.field, "aggregation_interval");
        assert_eq!(e.value, bad.to_string());
        assert!(
            e.to_string()
                .starts_with(&format!("aggregation_interval = {bad}: "))
        );
    }
}

#[test]
fn time_windows_resolve_relative_and_zero_values() {
    let mut s = store();
    let k = key("a", "b");
    for i in 0..4 {
        s.insert(&rec(&k, T0 + 15 * i, 1 << i), T0 + 60).unwrap();
    }
    let now = T0 + 61;
    let packets = |s: &mut FlowStore, gte, lt| {
        s.list(
            &FlowListRequest {
                start_time_gte: gte,
                start_time_lt: lt,
                ..Default::default()
            },
            now,
        )
        .map(|r| {
            r.flows
                .first()
                .map_or(0, |f| f.flow.as_ref().unwrap().packets_in)
        })
    };
    assert_eq!(packets(&mut s, 0, 0).unwrap(), 15);
    // The last 31 s: buckets starting at T0 + 30 and T0 + 45.
    assert_eq!(packets(&mut s, -31, 0).unwrap(), 4 + 8);
    // Absolute, end exclusive.
    assert_eq!(packets(&mut s, T0 + 15, T0 + 45).unwrap(), 2 + 4);
    // Relative end: before now - 30 = T0 + 31 (T0 and T0 + 15, T0 + 30 starts before too).
    assert_eq!(packets(&mut s, 0, -30).unwrap(), 1 + 2 + 4);
    let e = packets(&mut s, T0 + 30, T0 + 30).unwrap_err();
    assert_eq!(e.field, "start_time_gte");
    assert_eq!(e.value, (T0 + 30).to_string());
    let e = packets(&mut s, -10, -20).unwrap_err();
    assert_eq!((e.field, e.value.as_str()), ("start_time_gte", "-10"));
}

#[test]
fn list_refuses_bad_sorts_and_filters_naming_them() {
    let two = s_err(FlowListRequest {
        sort_by: vec![SortOption { sort_by: 1 }, SortOption { sort_by: 2 }],
        ..Default::default()
    });
    assert_eq!((two.field, two.value.as_str()), ("sort_by", "2 options"));
    let unknown = s_err(FlowListRequest {
        sort_by: vec![SortOption { sort_by: 42 }],
        ..Default::default()
    });
    assert_eq!((unknown.field, unknown.value.as_str()), ("sort_by", "42"));
    let f = |filter| {
        s_err(FlowListRequest {
            filter: Some(filter),
            ..Default::default()
        })
    };
    let e = f(Filter {
        dest_names: vec![exact(&"x".repeat(254))],
        ..Default::default()
    });
    assert_eq!(e.field, "filter.dest_names");
    let e = f(Filter {
        source_names: (0..65).map(|i| exact(&i.to_string())).collect(),
        ..Default::default()
    });
    assert_eq!(
        (e.field, e.value.as_str()),
        ("filter.source_names", "65 entries")
    );
    let e = f(Filter {
        actions: vec![7],
        ..Default::default()
    });
    assert_eq!((e.field, e.value.as_str()), ("filter.actions", "7"));
    let e = f(Filter {
        dest_ports: vec![PortMatch { port: -1 }],
        ..Default::default()
    });
    assert_eq!((e.field, e.value.as_str()), ("filter.dest_ports", "-1"));
    let e = f(Filter {
        policies: vec![PolicyMatch {
            kind: 11,
            ..Default::default()
        }],
        ..Default::default()
    });
    assert_eq!((e.field, e.value.as_str()), ("filter.policies", "11"));
}

#[test]
fn list_gives_each_key_a_stable_id() {
    let mut s = filter_fixture();
    let r = s.list(&FlowListRequest::default(), T0 + 20).unwrap();
    let mut ids: Vec<(String, i64)> = r
        .flows
        .iter()
        .map(|f| {
            let k = f.flow.as_ref().unwrap().key.as_ref().unwrap();
            (k.source_name.clone(), f.id)
        })
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        vec![
            ("backend-*".into(), 2),
            ("batch-*".into(), 5),
            ("dns-client".into(), 4),
            ("frontend-*".into(), 1),
            ("pub".into(), 3),
        ]
    );
}

fn hints(
    kind: FilterType,
    filter: Option<Filter>,
    page: i64,
    page_size: i64,
) -> (i64, i64, Vec<String>) {
    let mut s = filter_fixture();
    let r = s
        .filter_hints(
            &FilterHintsRequest {
                r#type: kind as i32,
                filter,
                page,
                page_size,
                ..Default::default()
            },
            T0 + 20,
        )
        .unwrap();
    let meta = r.meta.unwrap();
    (
        meta.total_pages,
        meta.total_results,
        r.hints.into_iter().map(|h| h.value).collect(),
    )
}

#[test]
fn filter_hints_list_distinct_values_of_the_selected_flows() {
    let v = |xs: &[&str]| xs.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        hints(FilterType::DestName, None, 0, 0).2,
        v(&["backend-*", "corp-net", "db-*", "frontend-*", "kube-dns"])
    );
    // Empty values are left out; duplicates once.
    assert_eq!(
        hints(FilterType::SourceNamespace, None, 0, 0).2,
        v(&["jobs", "kube-system", "shop"])
    );
    assert_eq!(
        hints(FilterType::DestNamespace, None, 0, 0).2,
        v(&["data", "kube-system", "shop"])
    );
    assert_eq!(
        hints(FilterType::SourceName, None, 0, 0).2,
        v(&["backend-*", "batch-*", "dns-client", "frontend-*", "pub"])
    );
    // Narrowed by a filter.
    let shop = Filter {
        source_namespaces: vec![exact("shop")],
        ..Default::default()
    };
    assert_eq!(
        hints(FilterType::DestName, Some(shop), 0, 0).2,
        v(&["backend-*", "db-*"])
    );
    // Policy tiers and names from both traces; an end-of-tier hit by its trigger.
    assert_eq!(
        hints(FilterType::PolicyTier, None, 0, 0).2,
        v(&["default", "security"])
    );
    assert_eq!(
        hints(FilterType::PolicyName, None, 0, 0).2,
        v(&[
            "allow-frontend",
            "allow-ingress",
            "db-lockdown",
            "staged-deny"
        ])
    );
    // Paged.
    assert_eq!(
        hints(FilterType::PolicyName, None, 1, 3),
        (2, 4, v(&["staged-deny"]))
    );
    let e = filter_fixture()
        .filter_hints(&FilterHintsRequest::default(), T0 + 20)
        .unwrap_err();
    assert_eq!(e.to_string(), "type = 0: not a filter type");
}

/// key1: egress (source report), allowed by A (rule 0), pending-denied by staged S (rule 1),
/// in two buckets. key2: ingress, denied at the end of tier "default", triggered by A.
fn stats_fixture() -> FlowStore {
    let mut s = store();
    let a = |action, rule| {
        hit(
            PolicyKind::CalicoNetworkPolicy,
            "default",
            "prod",
            "a",
            action,
            rule,
        )
    };
    let mut k1 = key("client", "server");
    k1.policies = Some(PolicyTrace {
        enforced_policies: vec![a(Action::Allow, 0)],
        pending_policies: vec![hit(
            PolicyKind::StagedNetworkPolicy,
            "default",
            "prod",
            "s",
            Action::Deny,
            1,
        )],
    });
    let mut k2 = key("intruder", "server");
    k2.reporter = Reporter::Dst as i32;
    k2.action = Action::Deny as i32;
    let mut eot = hit(PolicyKind::EndOfTier, "default", "", "", Action::Deny, -1);
    eot.trigger = Some(Box::new(a(Action::Unspecified, -1)));
    k2.policies = Some(PolicyTrace {
        enforced_policies: vec![eot],
        pending_policies: vec![],
    });
    let mut r = rec(&k1, T0, 10); // packets 10 in / 20 out, bytes 1000 / 2000, live 1
    r.num_connections_live = 4;
    s.insert(&r, T0).unwrap();
    s.insert(&rec(&k1, T0 + 15, 1), T0 + 15).unwrap();
    s.insert(&rec(&k2, T0, 5), T0).unwrap();
    s
}

fn stats(req: StatisticsRequest) -> Vec<StatisticsResult> {
    stats_fixture().statistics(&req, T0 + 40).unwrap()
}

/// (name, action, rule index, direction, [allowed in/out, denied in/out, passed in/out], x).
type Row = (String, i32, i64, i32, Vec<Vec<i64>>, Vec<i64>);

fn rows(rs: &[StatisticsResult]) -> Vec<Row> {
    rs.iter()
        .map(|r| {
            let p = r.policy.as_ref().unwrap();
            (
                p.name.clone(),
                p.action,
                p.rule_index,
                r.direction,
                vec![
                    r.allowed_in.clone(),
                    r.allowed_out.clone(),
                    r.denied_in.clone(),
                    r.denied_out.clone(),
                    r.passed_in.clone(),
                    r.passed_out.clone(),
                ],
                r.x.clone(),
            )
        })
        .collect()
}

fn cols(c: [i64; 6]) -> Vec<Vec<i64>> {
    c.iter().map(|v| vec![*v]).collect()
}

#[test]
fn statistics_per_policy_sum_packets_by_action() {
    let rs = stats(StatisticsRequest::default());
    assert!(
        rs.iter()
            .all(|r| r.group_by == StatisticsGroupBy::Policy as i32
                && r.r#type == StatisticType::PacketCount as i32
                && r.direction == RuleDirection::Any as i32)
    );
    assert_eq!(
        rows(&rs),
        vec![
            // A: allowed key1 (10+1 in, 20+2 out), denied key2 through the end of tier.
            ("a".into(), 0, 0, 0, cols([11, 22, 5, 10, 0, 0]), vec![]),
            // S (staged): pending-denied key1.
            ("s".into(), 0, 0, 0, cols([0, 0, 11, 22, 0, 0]), vec![]),
        ]
    );
    let p = rs[1].policy.as_ref().unwrap();
    assert_eq!(
        (p.kind, p.tier.as_str(), p.namespace.as_str()),
        (PolicyKind::StagedNetworkPolicy as i32, "default", "prod")
    );
}

#[test]
fn statistics_per_rule_split_by_action_rule_and_direction() {
    let rs = stats(StatisticsRequest {
        group_by: StatisticsGroupBy::PolicyRule as i32,
        r#type: StatisticType::ByteCount as i32,
        ..Default::default()
    });
    let (allow, deny) = (Action::Allow as i32, Action::Deny as i32);
    let (ingress, egress) = (RuleDirection::Ingress as i32, RuleDirection::Egress as i32);
    assert_eq!(
        rows(&rs),
        vec![
            (
                "a".into(),
                allow,
                0,
                egress,
                cols([1100, 2200, 0, 0, 0, 0]),
                vec![]
            ),
            (
                "a".into(),
                deny,
                -1,
                ingress,
                cols([0, 0, 500, 1000, 0, 0]),
                vec![]
            ),
            (
                "s".into(),
                deny,
                1,
                egress,
                cols([0, 0, 1100, 2200, 0, 0]),
                vec![]
            ),
        ]
    );
}

#[test]
fn statistics_time_series_have_one_point_per_bucket_with_data() {
    let rs = stats(StatisticsRequest {
        time_series: true,
        ..Default::default()
    });
    assert_eq!(
        rows(&rs),
        vec![
            (
                "a".into(),
                0,
                0,
                0,
                vec![
                    vec![10, 1],
                    vec![20, 2],
                    vec![5, 0],
                    vec![10, 0],
                    vec![0, 0],
                    vec![0, 0]
                ],
                vec![T0, T0 + 15],
            ),
            (
                "s".into(),
                0,
                0,
                0,
                vec![
                    vec![0, 0],
                    vec![0, 0],
                    vec![10, 1],
                    vec![20, 2],
                    vec![0, 0],
                    vec![0, 0]
                ],
                vec![T0, T0 + 15],
            ),
        ]
    );
}

#[test]
fn statistics_live_connections_by_direction_and_policy_match() {
    let rs = stats(StatisticsRequest {
        r#type: StatisticType::LiveConnectionCount as i32,
        ..Default::default()
    });
    // key1 is egress: live 4 then 1 in the out columns; key2 ingress: 1 in denied_in.
    assert_eq!(
        rows(&rs),
        vec![
            ("a".into(), 0, 0, 0, cols([0, 5, 1, 0, 0, 0]), vec![]),
            ("s".into(), 0, 0, 0, cols([0, 0, 0, 5, 0, 0]), vec![]),
        ]
    );
    let only = |m: PolicyMatch| {
        rows(&stats(StatisticsRequest {
            policy_match: Some(m),
            ..Default::default()
        }))
        .into_iter()
        .map(|r| (r.0, r.4))
        .collect::<Vec<_>>()
    };
    assert_eq!(
        only(PolicyMatch {
            kind: PolicyKind::StagedNetworkPolicy as i32,
            ..Default::default()
        }),
        vec![("s".to_string(), cols([0, 0, 11, 22, 0, 0]))]
    );
    // The action picks hits: A's allow only.
    assert_eq!(
        only(PolicyMatch {
            name: "a".into(),
            action: Action::Allow as i32,
            ..Default::default()
        }),
        vec![("a".to_string(), cols([11, 22, 0, 0, 0, 0]))]
    );
    let e = stats_fixture()
        .statistics(
            &StatisticsRequest {
                group_by: 5,
                ..Default::default()
            },
            T0 + 40,
        )
        .unwrap_err();
    assert_eq!(e.to_string(), "group_by = 5: not a grouping");
    let e = stats_fixture()
        .statistics(
            &StatisticsRequest {
                start_time_gte: T0 + 30,
                start_time_lt: T0,
                ..Default::default()
            },
            T0 + 40,
        )
        .unwrap_err();
    assert_eq!(e.field, "start_time_gte");
    // A window holding only the second bucket.
    let rs = stats_fixture()
        .statistics(
            &StatisticsRequest {
                start_time_gte: T0 + 15,
                ..Default::default()
            },
            T0 + 40,
        )
        .unwrap();
    assert_eq!(
        rows(&rs)
            .into_iter()
            .map(|r| (r.0, r.4))
            .collect::<Vec<_>>(),
        vec![
            ("a".to_string(), cols([1, 2, 0, 0, 0, 0])),
            ("s".to_string(), cols([0, 0, 1, 2, 0, 0])),
        ]
    );
}
