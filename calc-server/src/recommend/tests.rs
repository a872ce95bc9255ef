//! The recommendation on a three-tier application (web → api → db in namespace `shop`, DNS
//! to kube-system, one external address in a NetworkSet), its guard rails, determinism,
//! `check` and `promote`.

use std::collections::BTreeMap;

use felix_proto::goldmane::{
    Action, EndpointType, Flow, FlowKey, PolicyHit, PolicyKind, PolicyTrace, Reporter,
};
use serde_json::{Value, json};

use super::*;

#[derive(Clone)]
struct End {
    ns: &'static str,
    name: &'static str,
    kind: EndpointType,
    labels: Vec<String>,
}

fn wep(ns: &'static str, name: &'static str, labels: &[&str]) -> End {
    End {
        ns,
        name,
        kind: EndpointType::WorkloadEndpoint,
        labels: labels.iter().map(|s| s.to_string()).collect(),
    }
}

fn web() -> End {
    wep(
        "shop",
        "web-7d9f8c6b5-*",
        &["app=web", "pod-template-hash=7d9f8c6b5"],
    )
}
fn api() -> End {
    wep(
        "shop",
        "api-5c8f7b9d4-*",
        &["app.kubernetes.io/name=api", "pod-template-hash=5c8f7b9d4"],
    )
}
fn db() -> End {
    wep(
        "shop",
        "db-0",
        &["role=db", "statefulset.kubernetes.io/pod-name=db-0"],
    )
}
fn dns() -> End {
    wep(
        "kube-system",
        "coredns-6f8b9c7d5-*",
        &["k8s-app=kube-dns", "pod-template-hash=6f8b9c7d5"],
    )
}
fn payments() -> End {
    End {
        ns: "shop",
        name: "payments",
        kind: EndpointType::NetworkSet,
        labels: vec!["role=payments-api".into()],
    }
}
fn public() -> End {
    End {
        ns: "-",
        name: "pub",
        kind: EndpointType::Network,
        labels: vec![],
    }
}
fn host() -> End {
    End {
        ns: "-",
        name: "node-1",
        kind: EndpointType::HostEndpoint,
        labels: vec![],
    }
}

fn record(
    reporter: Reporter,
    src: &End,
    dst: &End,
    proto: &str,
    port: i64,
    action: Action,
    start: i64,
) -> Flow {
    Flow {
        key: Some(FlowKey {
            source_name: src.name.into(),
            source_namespace: src.ns.into(),
            source_type: src.kind as i32,
            dest_name: dst.name.into(),
            dest_namespace: dst.ns.into(),
            dest_type: dst.kind as i32,
            dest_port: port,
            proto: proto.into(),
            reporter: reporter as i32,
            action: action as i32,
            ..Default::default()
        }),
        start_time: start,
        end_time: start + 15,
        source_labels: src.labels.clone(),
        dest_labels: dst.labels.clone(),
        packets_in: 5,
        packets_out: 5,
        bytes_in: 500,
        bytes_out: 500,
        num_connections_started: 1,
        ..Default::default()
    }
}

/// Both sides' reports of an allowed pod-to-pod flow, in two intervals.
fn both(src: &End, dst: &End, proto: &str, port: i64) -> Vec<Flow> {
    let mut out = Vec::new();
    for start in [1000, 1015] {
        if src.kind == EndpointType::WorkloadEndpoint {
            out.push(record(
                Reporter::Src,
                src,
                dst,
                proto,
                port,
                Action::Allow,
                start,
            ));
        }
        if dst.kind == EndpointType::WorkloadEndpoint {
            out.push(record(
                Reporter::Dst,
                src,
                dst,
                proto,
                port,
                Action::Allow,
                start,
            ));
        }
    }
    out
}

fn three_tier_flows() -> Vec<Flow> {
    let mut f = Vec::new();
    f.extend(both(&web(), &api(), "tcp", 8080));
    f.extend(both(&api(), &db(), "tcp", 5432));
    f.extend(both(&web(), &dns(), "udp", 53));
    f.extend(both(&api(), &dns(), "udp", 53));
    f.extend(both(&api(), &payments(), "tcp", 443));
    // Left out: an internet client, the kubelet's probe from the host, a denied attempt.
    f.extend(both(&public(), &web(), "tcp", 443));
    f.extend(both(&host(), &api(), "tcp", 8080));
    f.push(record(
        Reporter::Src,
        &web(),
        &db(),
        "tcp",
        5432,
        Action::Deny,
        1000,
    ));
    // Another namespace's flows are not this namespace's policy.
    f.extend(both(&wep("other", "x-1", &["app=x"]), &dns(), "udp", 53));
    f
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn pod(
    ns: &str,
    name: &str,
    generate: &str,
    l: &[(&str, &str)],
    ports: &[(&str, &str, u16)],
) -> Pod {
    Pod {
        namespace: ns.into(),
        name: name.into(),
        generate_name: generate.into(),
        labels: labels(l),
        ports: ports
            .iter()
            .map(|(n, p, port)| NamedPort {
                name: n.to_string(),
                protocol: p.to_string(),
                port: *port,
            })
            .collect(),
    }
}

fn inventory() -> Inventory {
    let pcns = ("projectcalico.org/namespace", "shop");
    Inventory {
        pods: vec![
            pod(
                "shop",
                "web-7d9f8c6b5-abcde",
                "web-7d9f8c6b5-",
                &[("app", "web"), ("pod-template-hash", "7d9f8c6b5"), pcns],
                &[],
            ),
            pod(
                "shop",
                "web-7d9f8c6b5-fghij",
                "web-7d9f8c6b5-",
                &[("app", "web"), ("pod-template-hash", "7d9f8c6b5"), pcns],
                &[],
            ),
            pod(
                "shop",
                "api-5c8f7b9d4-abcde",
                "api-5c8f7b9d4-",
                &[
                    ("app.kubernetes.io/name", "api"),
                    ("pod-template-hash", "5c8f7b9d4"),
                ],
                &[("http", "tcp", 8080)],
            ),
            pod(
                "shop",
                "db-0",
                "",
                &[
                    ("role", "db"),
                    ("tier", "data"),
                    ("statefulset.kubernetes.io/pod-name", "db-0"),
                    ("controller-revision-hash", "db-7f"),
                ],
                &[],
            ),
            pod(
                "shop",
                "db-1",
                "",
                &[
                    ("role", "db"),
                    ("tier", "data"),
                    ("statefulset.kubernetes.io/pod-name", "db-1"),
                    ("controller-revision-hash", "db-7f"),
                ],
                &[],
            ),
            pod(
                "kube-system",
                "coredns-6f8b9c7d5-abcde",
                "coredns-6f8b9c7d5-",
                &[("k8s-app", "kube-dns"), ("pod-template-hash", "6f8b9c7d5")],
                &[("dns", "udp", 53), ("dns-tcp", "tcp", 53)],
            ),
        ],
        network_sets: vec![NetworkSet {
            namespace: Some("shop".into()),
            name: "payments".into(),
            labels: labels(&[("role", "payments-api")]),
            nets: vec!["203.0.113.10/32".into()],
        }],
    }
}

fn opts() -> Options {
    Options {
        namespace: "shop".into(),
        window: "1h".into(),
        ..Default::default()
    }
}

fn by_name<'a>(r: &'a Recommendation, name: &str) -> &'a Value {
    &r.policies
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| {
            panic!(
                "no policy {name} in {:?}",
                r.policies.iter().map(|p| &p.name).collect::<Vec<_>>()
            )
        })
        .object
}

/// The rules without their annotations.
fn bare(rules: &Value) -> Value {
    let mut rules = rules.clone();
    for r in rules.as_array_mut().into_iter().flatten() {
        r.as_object_mut().unwrap().remove("metadata");
    }
    rules
}

#[test]
fn three_tiers_get_exactly_the_rules_their_flows_need() {
    let r = recommend(&three_tier_flows(), &inventory(), &opts()).unwrap();
    let names: Vec<&str> = r.policies.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        ["recommended-api", "recommended-db", "recommended-web"]
    );

    let web = by_name(&r, "recommended-web");
    assert_eq!(web["kind"], "StagedNetworkPolicy");
    assert_eq!(web["metadata"]["namespace"], "shop");
    assert_eq!(web["spec"]["selector"], "app == 'web'");
    assert_eq!(web["spec"]["tier"], "default");
    assert_eq!(web["spec"]["stagedAction"], "Set");
    assert_eq!(web["spec"]["types"], json!(["Ingress", "Egress"]));
    // No ingress was seen that a rule can name (the internet client is left out).
    assert!(web["spec"].get("ingress").is_none());
    assert_eq!(
        bare(&web["spec"]["egress"]),
        json!([
            {"action": "Allow", "protocol": "TCP",
             "destination": {"selector": "app.kubernetes.io/name == 'api'", "ports": ["http"]}},
            {"action": "Allow", "protocol": "UDP",
             "destination": {"namespaceSelector": "projectcalico.org/name == 'kube-system'",
                             "selector": "k8s-app == 'kube-dns'", "ports": ["dns"]}},
        ])
    );

    let api = by_name(&r, "recommended-api");
    assert_eq!(api["spec"]["selector"], "app.kubernetes.io/name == 'api'");
    assert_eq!(
        bare(&api["spec"]["ingress"]),
        json!([{"action": "Allow", "protocol": "TCP",
                "source": {"selector": "app == 'web'"}, "destination": {"ports": ["http"]}}])
    );
    assert_eq!(
        bare(&api["spec"]["egress"]),
        json!([
            {"action": "Allow", "protocol": "TCP",
             "destination": {"selector": "role == 'db' && tier == 'data'", "ports": [5432]}},
            {"action": "Allow", "protocol": "TCP",
             "destination": {"selector": "role == 'payments-api'", "ports": [443]}},
            {"action": "Allow", "protocol": "UDP",
             "destination": {"namespaceSelector": "projectcalico.org/name == 'kube-system'",
                             "selector": "k8s-app == 'kube-dns'", "ports": ["dns"]}},
        ])
    );

    // The StatefulSet's pods: one group by owner, selected by what they share, less the
    // per-pod and per-revision labels.
    let db = by_name(&r, "recommended-db");
    assert_eq!(db["spec"]["selector"], "role == 'db' && tier == 'data'");
    assert_eq!(
        db["metadata"]["annotations"]["recommend.calc-server/group"],
        "owner db"
    );
    assert_eq!(
        bare(&db["spec"]["ingress"]),
        json!([{"action": "Allow", "protocol": "TCP",
                "source": {"selector": "app.kubernetes.io/name == 'api'"},
                "destination": {"ports": [5432]}}])
    );
    assert!(db["spec"].get("egress").is_none());

    // Each rule names the flows behind it.
    let rule = &api["spec"]["ingress"][0]["metadata"]["annotations"];
    assert_eq!(
        rule["recommend.calc-server/flows"],
        "shop/web-7d9f8c6b5-* -> shop/api-5c8f7b9d4-* tcp/8080 (dst, 2 intervals, 20 packets)"
    );
    assert_eq!(rule["recommend.calc-server/count"], "1");
    let evidence = &r.policies[0].rules;
    assert_eq!(evidence.len(), 4);
    assert_eq!((evidence[0].direction, evidence[0].index), ("ingress", 0));
    assert_eq!(evidence[0].flows[0].source, "shop/web-7d9f8c6b5-*");

    // And every object is one the datastore accepts.
    for p in &r.policies {
        assert!(super::valid(&p.object).is_ok(), "{}", p.object);
    }
}

#[test]
fn what_is_left_out_is_listed_with_the_reason() {
    let r = recommend(&three_tier_flows(), &inventory(), &opts()).unwrap();
    let left: Vec<(Reason, String, &str)> = r
        .left_out
        .iter()
        .map(|l| (l.reason, l.flow.line(), l.flow.reporter.as_str()))
        .collect();
    assert_eq!(
        left,
        [
            (
                Reason::DeniedByEnforcedPolicy,
                "shop/web-7d9f8c6b5-* -> shop/db-0 tcp/5432".to_string(),
                "src"
            ),
            (
                Reason::HostEndpoint,
                "-/node-1 -> shop/api-5c8f7b9d4-* tcp/8080".to_string(),
                "dst"
            ),
            (
                Reason::UnnamedAddress,
                "-/pub -> shop/web-7d9f8c6b5-* tcp/443".to_string(),
                "dst"
            ),
        ]
    );
}

#[test]
fn services_are_named_and_unreported_destinations_noted() {
    let mut flows = three_tier_flows();
    // web reached api through its Service (both reports name it).
    for f in flows.iter_mut() {
        let k = f.key.as_mut().unwrap();
        if k.dest_name.starts_with("api-") && k.source_name.starts_with("web-") {
            k.dest_service_name = "api".into();
            k.dest_service_namespace = "shop".into();
            k.dest_service_port = 80;
        }
    }
    // A flow to db whose node sent nothing: only web's report.
    flows.push(record(
        Reporter::Src,
        &web(),
        &db(),
        "tcp",
        6379,
        Action::Allow,
        1000,
    ));
    let r = recommend(&flows, &inventory(), &opts()).unwrap();
    let api = by_name(&r, "recommended-api");
    assert_eq!(
        api["spec"]["ingress"][0]["metadata"]["annotations"]["recommend.calc-server/flows"],
        "shop/web-7d9f8c6b5-* -> shop/api-5c8f7b9d4-* tcp/8080 via service shop/api (dst, 2 intervals, 20 packets)"
    );
    assert_eq!(r.policies[0].rules[0].flows[0].service, "shop/api");
    assert!(
        r.notes.contains(&"1 flow(s) to shop/db-0 were reported only by their source: no ingress rule covers them (does the destination's node send flow logs?)".to_string()),
        "{:?}",
        r.notes
    );
    // Its egress side is still recommended.
    let web = by_name(&r, "recommended-web");
    assert!(web["spec"]["egress"].to_string().contains("6379"), "{web}");
}

#[test]
fn overlapping_groups_are_told_apart_or_noted() {
    let mut inv = inventory();
    // A pod named by app.kubernetes.io/name that also carries app=web: web's selector leaves
    // it out. And a pod of another owner with db's labels and more: noted.
    inv.pods.push(pod(
        "shop",
        "admin-1",
        "",
        &[("app.kubernetes.io/name", "admin"), ("app", "web")],
        &[],
    ));
    inv.pods.push(pod(
        "shop",
        "backup-1",
        "",
        &[("role", "db"), ("tier", "data"), ("job", "backup")],
        &[],
    ));
    let r = recommend(&three_tier_flows(), &inv, &opts()).unwrap();
    let web = by_name(&r, "recommended-web");
    assert_eq!(
        web["spec"]["selector"],
        "app == 'web' && !has(app.kubernetes.io/name)"
    );
    // The rule peers use the same selector.
    let api = by_name(&r, "recommended-api");
    assert_eq!(
        api["spec"]["ingress"][0]["source"]["selector"],
        "app == 'web' && !has(app.kubernetes.io/name)"
    );
    assert!(
        r.notes.contains(&"shop group owner db: its selector also selects 1 pod(s) of other groups (such as backup-1); they get this policy's rules too".to_string()),
        "{:?}",
        r.notes
    );
    // Without such pods, no exclusion and no note.
    let plain = recommend(&three_tier_flows(), &inventory(), &opts()).unwrap();
    assert_eq!(
        by_name(&plain, "recommended-web")["spec"]["selector"],
        "app == 'web'"
    );
    assert!(
        plain.notes.iter().all(|n| !n.contains("also selects")),
        "{:?}",
        plain.notes
    );
}

#[test]
fn include_denied_allows_what_the_enforced_policy_denied() {
    let r = recommend(
        &three_tier_flows(),
        &inventory(),
        &Options {
            include_denied: true,
            ..opts()
        },
    )
    .unwrap();
    let web = by_name(&r, "recommended-web");
    let egress = bare(&web["spec"]["egress"]);
    assert!(
        egress
            .as_array()
            .unwrap()
            .contains(&json!({"action": "Allow", "protocol": "TCP",
            "destination": {"selector": "role == 'db' && tier == 'data'", "ports": [5432]}})),
        "{egress}"
    );
    assert!(
        r.left_out
            .iter()
            .all(|l| l.reason != Reason::DeniedByEnforcedPolicy)
    );
}

#[test]
fn too_few_samples_are_left_out() {
    let mut flows = three_tier_flows();
    // One more flow, seen in one interval only.
    flows.push(record(
        Reporter::Src,
        &web(),
        &api(),
        "tcp",
        9090,
        Action::Allow,
        1000,
    ));
    let r = recommend(
        &flows,
        &inventory(),
        &Options {
            min_samples: 2,
            ..opts()
        },
    )
    .unwrap();
    let few: Vec<String> = r
        .left_out
        .iter()
        .filter(|l| l.reason == Reason::TooFewSamples)
        .map(|l| l.flow.line())
        .collect();
    assert_eq!(
        few,
        ["shop/web-7d9f8c6b5-* -> shop/api-5c8f7b9d4-* tcp/9090"]
    );
    let web = by_name(&r, "recommended-web");
    assert_eq!(
        web["spec"]["egress"][0]["destination"]["ports"],
        json!(["http"])
    );
}

#[test]
fn the_same_flows_in_any_order_give_the_same_bytes() {
    let flows = three_tier_flows();
    let first = recommend(&flows, &inventory(), &opts()).unwrap();
    let mut reversed = flows.clone();
    reversed.reverse();
    let mut inv = inventory();
    inv.pods.reverse();
    let second = recommend(&reversed, &inv, &opts()).unwrap();
    assert_eq!(first, second);
    assert_eq!(
        yaml::documents(&first.objects()),
        yaml::documents(&second.objects())
    );
    // Rotated too.
    let mut rotated = flows;
    rotated.rotate_left(7);
    assert_eq!(recommend(&rotated, &inventory(), &opts()).unwrap(), first);
}

#[test]
fn no_rule_is_ever_everything_and_unlabelled_sides_are_left_out() {
    let mut flows = three_tier_flows();
    // A pod with no labels at all (no generateName: a bare pod) talks to web.
    let bare_pod = wep("shop", "lonely", &[]);
    flows.extend(both(&bare_pod, &web(), "tcp", 80));
    // A peer in another namespace with no labels, and a pod gone from the inventory.
    flows.extend(both(&wep("other", "ghost-1", &[]), &api(), "tcp", 8080));
    let r = recommend(&flows, &inventory(), &opts()).unwrap();
    let reasons: Vec<(Reason, String)> = r
        .left_out
        .iter()
        .map(|l| (l.reason, l.flow.line()))
        .collect();
    assert!(
        reasons.contains(&(
            Reason::WorkloadWithoutLabels,
            "shop/lonely -> shop/web-7d9f8c6b5-* tcp/80".into()
        )),
        "{reasons:?}"
    );
    assert!(
        reasons.contains(&(
            Reason::PeerWithoutLabels,
            "shop/lonely -> shop/web-7d9f8c6b5-* tcp/80".into()
        )),
        "{reasons:?}"
    );
    assert!(
        reasons.contains(&(
            Reason::PeerWithoutLabels,
            "other/ghost-1 -> shop/api-5c8f7b9d4-* tcp/8080".into()
        )),
        "{reasons:?}"
    );
    for p in &r.policies {
        for dir in ["ingress", "egress"] {
            for rule in p.object["spec"][dir].as_array().into_iter().flatten() {
                let peer = if dir == "ingress" {
                    &rule["source"]
                } else {
                    &rule["destination"]
                };
                let sel = peer["selector"].as_str().unwrap_or_default();
                let ns = peer["namespaceSelector"].as_str().unwrap_or_default();
                assert!(
                    (!sel.is_empty() && sel != "all()") || peer["nets"].is_array(),
                    "{}: {rule}",
                    p.name
                );
                assert!(
                    ns.is_empty()
                        || ns == "global()"
                        || ns.starts_with("projectcalico.org/name == '"),
                    "{rule}"
                );
            }
        }
    }
}

#[test]
fn hostile_labels_never_reach_a_selector() {
    let mut inv = inventory();
    // db's pods share a label whose value a selector cannot hold, and a key with a space.
    for p in inv.pods.iter_mut().filter(|p| p.name.starts_with("db-")) {
        p.labels.insert("note".into(), "it's \"quoted\"".into());
        p.labels.insert("bad key".into(), "x".into());
    }
    let mut flows = three_tier_flows();
    // A flow whose labels claim a hostile app value: it cannot group by it.
    flows.extend(both(
        &wep("shop", "evil-*", &["app=x' || all() || '", "team=red"]),
        &api(),
        "tcp",
        8080,
    ));
    let r = recommend(&flows, &inv, &opts()).unwrap();
    let db = by_name(&r, "recommended-db");
    assert_eq!(db["spec"]["selector"], "role == 'db' && tier == 'data'");
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("\"note\"") && n.contains("cannot be written")),
        "{:?}",
        r.notes
    );
    let text = serde_json::to_string(&r.objects()).unwrap();
    assert!(!text.contains("all()"), "{text}");
    assert!(!text.contains("it's"), "{text}");
    // The hostile app value fell back to the owner group, selected by its clean label.
    let api = by_name(&r, "recommended-api");
    let sources: Vec<&str> = api["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["source"]["selector"].as_str())
        .collect();
    assert!(sources.contains(&"team == 'red'"), "{sources:?}");
    for p in &r.policies {
        assert!(super::valid(&p.object).is_ok());
    }
}

#[test]
fn a_tier_prefixes_the_names_and_bad_options_are_refused() {
    let r = recommend(
        &three_tier_flows(),
        &inventory(),
        &Options {
            tier: "security".into(),
            ..opts()
        },
    )
    .unwrap();
    let web = by_name(&r, "security.recommended-web");
    assert_eq!(web["spec"]["tier"], "security");
    assert_eq!(
        recommend(
            &[],
            &inventory(),
            &Options {
                tier: "No Tier".into(),
                ..opts()
            }
        )
        .unwrap_err(),
        OptionsError::Tier("No Tier".into())
    );
    assert_eq!(
        recommend(
            &[],
            &inventory(),
            &Options {
                namespace: "../x".into(),
                ..opts()
            }
        )
        .unwrap_err(),
        OptionsError::Namespace("../x".into())
    );
}

#[test]
fn global_network_sets_and_unlabelled_sets() {
    let mut inv = inventory();
    inv.network_sets.push(NetworkSet {
        namespace: None,
        name: "cdn".into(),
        labels: labels(&[("kind", "cdn")]),
        nets: vec!["198.51.100.0/24".into()],
    });
    inv.network_sets.push(NetworkSet {
        namespace: Some("shop".into()),
        name: "legacy".into(),
        labels: BTreeMap::new(),
        nets: vec!["192.0.2.7/32".into()],
    });
    let cdn = End {
        ns: "-",
        name: "cdn",
        kind: EndpointType::NetworkSet,
        labels: vec!["kind=cdn".into()],
    };
    let legacy = End {
        ns: "shop",
        name: "legacy",
        kind: EndpointType::NetworkSet,
        labels: vec![],
    };
    let mut flows = both(&web(), &cdn, "tcp", 443);
    flows.extend(both(&web(), &legacy, "tcp", 8443));
    let r = recommend(&flows, &inv, &opts()).unwrap();
    let web = by_name(&r, "recommended-web");
    assert_eq!(
        bare(&web["spec"]["egress"]),
        json!([
            {"action": "Allow", "protocol": "TCP", "destination": {"nets": ["192.0.2.7/32"], "ports": [8443]}},
            {"action": "Allow", "protocol": "TCP",
             "destination": {"namespaceSelector": "global()", "selector": "kind == 'cdn'", "ports": [443]}},
        ])
    );
}

fn hit(kind: PolicyKind, ns: &str, name: &str, action: Action) -> PolicyHit {
    PolicyHit {
        kind: kind as i32,
        namespace: ns.into(),
        name: name.into(),
        tier: "default".into(),
        action: action as i32,
        ..Default::default()
    }
}

fn traced(mut f: Flow, enforced: Vec<PolicyHit>, pending: Vec<PolicyHit>) -> Flow {
    f.key.as_mut().unwrap().policies = Some(PolicyTrace {
        enforced_policies: enforced,
        pending_policies: pending,
    });
    f
}

#[test]
fn check_names_the_flows_each_staged_policy_would_break() {
    let allow_profile = hit(PolicyKind::Profile, "", "kns.shop", Action::Allow);
    let ok = traced(
        record(
            Reporter::Dst,
            &web(),
            &api(),
            "tcp",
            8080,
            Action::Allow,
            1000,
        ),
        vec![allow_profile.clone()],
        vec![hit(
            PolicyKind::StagedNetworkPolicy,
            "shop",
            "recommended-api",
            Action::Allow,
        )],
    );
    // A new client of api: its staged policy's tier ends in a deny.
    let mut end = hit(PolicyKind::EndOfTier, "", "", Action::Deny);
    end.trigger = Some(Box::new(hit(
        PolicyKind::StagedNetworkPolicy,
        "shop",
        "recommended-api",
        Action::Deny,
    )));
    let new_client = wep("shop", "batch-*", &["app=batch"]);
    let broken = traced(
        record(
            Reporter::Dst,
            &new_client,
            &api(),
            "tcp",
            8080,
            Action::Allow,
            1030,
        ),
        vec![allow_profile.clone()],
        vec![end],
    );
    // A deny rule of another staged policy.
    let denied_rule = traced(
        record(
            Reporter::Src,
            &web(),
            &dns(),
            "udp",
            53,
            Action::Allow,
            1030,
        ),
        vec![allow_profile.clone()],
        vec![hit(
            PolicyKind::StagedNetworkPolicy,
            "shop",
            "recommended-web",
            Action::Deny,
        )],
    );
    // Denied already: enforcing changes nothing.
    let already = traced(
        record(
            Reporter::Src,
            &web(),
            &db(),
            "tcp",
            5432,
            Action::Deny,
            1030,
        ),
        vec![hit(
            PolicyKind::CalicoNetworkPolicy,
            "shop",
            "guard",
            Action::Deny,
        )],
        vec![hit(
            PolicyKind::StagedNetworkPolicy,
            "shop",
            "recommended-web",
            Action::Deny,
        )],
    );
    let staged = [
        StagedRef {
            kind: "StagedNetworkPolicy".into(),
            name: "recommended-api".into(),
        },
        StagedRef {
            kind: "StagedNetworkPolicy".into(),
            name: "recommended-db".into(),
        },
        StagedRef {
            kind: "StagedNetworkPolicy".into(),
            name: "recommended-web".into(),
        },
    ];
    let rows = check(&[ok.clone(), broken, denied_rule, already], "shop", &staged);
    let summary: Vec<(String, Vec<String>)> = rows
        .iter()
        .map(|r| {
            (
                r.name.clone(),
                r.breaks.iter().map(SeenFlow::line).collect(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                "recommended-api".to_string(),
                vec!["shop/batch-* -> shop/api-5c8f7b9d4-* tcp/8080".to_string()]
            ),
            ("recommended-db".to_string(), vec![]),
            (
                "recommended-web".to_string(),
                vec!["shop/web-7d9f8c6b5-* -> kube-system/coredns-6f8b9c7d5-* udp/53".to_string()]
            ),
        ]
    );
    // Zero breaks when only the good flow is seen.
    assert!(
        check(&[ok], "shop", &staged)
            .iter()
            .all(|r| r.breaks.is_empty())
    );
}

#[test]
fn promote_drops_the_staged_action_and_changes_the_kind() {
    let r = recommend(&three_tier_flows(), &inventory(), &opts()).unwrap();
    let staged = by_name(&r, "recommended-api");
    let enforced = promote(staged).unwrap();
    assert_eq!(enforced["kind"], "NetworkPolicy");
    assert!(enforced["spec"].get("stagedAction").is_none());
    assert_eq!(enforced["spec"]["ingress"], staged["spec"]["ingress"]);
    assert_eq!(enforced["metadata"], staged["metadata"]);
    assert!(super::valid(&enforced).is_ok());
    let gnp = json!({"apiVersion": "projectcalico.org/v3", "kind": "StagedGlobalNetworkPolicy",
                     "metadata": {"name": "g", "resourceVersion": "7"}, "spec": {"selector": "all()", "stagedAction": "Set"}});
    let promoted = promote(&gnp).unwrap();
    assert_eq!(promoted["kind"], "GlobalNetworkPolicy");
    assert!(promoted["metadata"].get("resourceVersion").is_none());
    let delete = json!({"kind": "StagedNetworkPolicy", "metadata": {"name": "d"}, "spec": {"stagedAction": "Delete"}});
    assert_eq!(
        promote(&delete).unwrap_err(),
        PromoteError::StagesDelete("d".into())
    );
    assert!(matches!(
        promote(&json!({"kind": "NetworkPolicy", "metadata": {}, "spec": {}})),
        Err(PromoteError::Kind(_))
    ));
}

#[test]
fn label_and_name_checks() {
    assert!(is_label_key("app.kubernetes.io/name"));
    assert!(!is_label_key("bad key"));
    assert!(!is_label_key("/x"));
    assert!(is_label_value(""));
    assert!(!is_label_value("it's"));
    assert!(!is_label_value("-x"));
    assert!(is_dns_label("shop"));
    assert!(!is_dns_label("Shop"));
    let mut used = BTreeSet::new();
    let mut notes = BTreeSet::new();
    assert_eq!(
        policy_name("default", "web", &mut used, &mut notes),
        "recommended-web"
    );
    assert_eq!(
        policy_name("default", "Web", &mut used, &mut notes),
        "recommended-web-2"
    );
    assert_eq!(
        policy_name("sec", "a_b", &mut used, &mut notes),
        "sec.recommended-a-b"
    );
    assert_eq!(notes.len(), 2, "{notes:?}");
}

/// Hostile flows and inventory, generated from a fixed seed: names, namespaces and labels
/// with quotes, selector syntax, control and non-ASCII characters, empty and overlong text;
/// any endpoint type, reporter, action, protocol and port. Whatever comes in, the answer is
/// produced without a panic, every object is one the datastore accepts, no selector holds
/// anything but label comparisons of valid labels, and the answer is the same twice.
#[test]
fn hostile_input_never_yields_an_invalid_or_unsafe_object() {
    let words = [
        "web",
        "api",
        "x' || all() || '",
        "\"quoted\"",
        "all()",
        "",
        "-",
        "a\nb",
        "ünïcode",
        "UPPER",
        "has(x)",
        "kube-system",
        "shop",
        "v.1_2-3",
        "a/b",
        "app",
        "app.kubernetes.io/name",
    ];
    let long = "x".repeat(300);
    let mut rng = common::Rng::new(45);
    let pick = |rng: &mut common::Rng| -> String {
        if rng.below(20) == 0 {
            long.clone()
        } else {
            words[rng.below(words.len())].to_string()
        }
    };
    let mut flows = Vec::new();
    for i in 0..600 {
        let side = |rng: &mut common::Rng| {
            let web = rng.below(2) == 0;
            // The side's own labels, then hostile ones.
            let mut labels: Vec<String> = if web {
                vec!["app=web".into()]
            } else {
                vec!["role=db".into(), "tier=data".into()]
            };
            labels.extend((0..rng.below(4)).map(|_| format!("{}={}", pick(rng), pick(rng))));
            End {
                ns: if rng.below(2) == 0 { "shop" } else { "other" },
                name: if web { "web-*" } else { "db-0" },
                kind: if rng.below(3) > 0 {
                    EndpointType::WorkloadEndpoint
                } else {
                    EndpointType::try_from(rng.below(5) as i32).unwrap()
                },
                labels,
            }
        };
        let (src, dst) = (side(&mut rng), side(&mut rng));
        let mut f = record(
            if rng.below(2) == 0 {
                Reporter::Src
            } else {
                Reporter::Dst
            },
            &src,
            &dst,
            ["tcp", "tcp", "udp", "icmp", "sctp", "47", "bogus", ""][rng.below(8)],
            [0, 53, 8080, 8080, 443, 70_000, -1][rng.below(7)],
            [Action::Allow, Action::Allow, Action::Deny, Action::Pass][rng.below(4)],
            1000 + 15 * (i % 4),
        );
        // Hostile names and namespaces too.
        let k = f.key.as_mut().unwrap();
        if rng.below(4) == 0 {
            k.source_name = pick(&mut rng);
        }
        if rng.below(4) == 0 {
            k.dest_namespace = pick(&mut rng);
        }
        flows.push(f);
    }
    let mut inv = inventory();
    for _ in 0..50 {
        let mut labels = BTreeMap::new();
        for _ in 0..rng.below(4) {
            labels.insert(pick(&mut rng), pick(&mut rng));
        }
        inv.pods.push(Pod {
            namespace: ["shop", "other"][rng.below(2)].into(),
            name: pick(&mut rng),
            generate_name: pick(&mut rng),
            labels,
            ports: vec![NamedPort {
                name: pick(&mut rng),
                protocol: "tcp".into(),
                port: 8080,
            }],
        });
    }
    for include_denied in [false, true] {
        let o = Options {
            include_denied,
            ..opts()
        };
        let r = recommend(&flows, &inv, &o).unwrap();
        let rules: usize = r.policies.iter().map(|p| p.rules.len()).sum();
        assert!(
            rules >= 3 && r.policies.len() >= 2,
            "some flows make rules: {rules}"
        );
        assert!(
            r.left_out.len() >= 100,
            "many are left out: {}",
            r.left_out.len()
        );
        for p in &r.policies {
            assert!(super::valid(&p.object).is_ok(), "{}", p.object);
            let mut selectors = vec![p.object["spec"]["selector"].as_str().unwrap().to_string()];
            for dir in ["ingress", "egress"] {
                for rule in p.object["spec"][dir].as_array().into_iter().flatten() {
                    for side in ["source", "destination"] {
                        if let Some(sel) = rule[side]["selector"].as_str() {
                            selectors.push(sel.to_string());
                        }
                    }
                }
            }
            for sel in selectors {
                // Only `key == 'value'` and `!has(key)` terms, every key and value valid.
                for term in sel.split(" && ") {
                    if let Some(k) = term.strip_prefix("!has(").and_then(|t| t.strip_suffix(')')) {
                        assert!(GROUP_LABELS.contains(&k), "{sel}");
                        continue;
                    }
                    let (k, v) = term.split_once(" == ").unwrap_or_else(|| panic!("{sel}"));
                    let v = v
                        .strip_prefix('\'')
                        .and_then(|v| v.strip_suffix('\''))
                        .unwrap();
                    assert!(is_label_key(k) && is_label_value(v), "{sel}");
                }
            }
        }
        assert_eq!(recommend(&flows, &inv, &o).unwrap(), r, "deterministic");
    }
}
