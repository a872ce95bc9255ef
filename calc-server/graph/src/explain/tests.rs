//! Explain answers over small clusters, through the graph's public API.

use felix_proto as pb;
use pb::to_dataplane::Payload;

use super::path::failsafes;
use super::*;
use crate::explain::{Verdict::*, render_endpoint_text, render_text};
use crate::graph::Update;
use crate::manifest::parse_manifest;

/// Namespaces `prod` and `dev` (profiles with labels, allow-all), and workloads:
/// prod/web (10.0.0.1, app=web, named port http=8080), prod/client (10.0.0.2,
/// app=client), dev/client (10.0.1.2, app=client), prod/db on node-b (10.0.2.1, app=db).
const BASE: &str = r#"
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.prod}
spec:
  ingress: [{action: Allow}]
  egress: [{action: Allow}]
  labelsToApply: {pcns.projectcalico.org/name: prod, pcns.env: prod}
---
apiVersion: projectcalico.org/v3
kind: Profile
metadata: {name: kns.dev}
spec:
  ingress: [{action: Allow}]
  egress: [{action: Allow}]
  labelsToApply: {pcns.projectcalico.org/name: dev, pcns.env: dev}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-web-eth0, namespace: prod, labels: {app: web, projectcalico.org/namespace: prod, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-a, pod: web, endpoint: eth0, interfaceName: caliweb, ipNetworks: [10.0.0.1/32], profiles: [kns.prod], ports: [{name: http, protocol: TCP, port: 8080}]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-client-eth0, namespace: prod, labels: {app: client, projectcalico.org/namespace: prod, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-a, pod: client, endpoint: eth0, interfaceName: caliclient, ipNetworks: [10.0.0.2/32], profiles: [kns.prod]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-client-eth0, namespace: dev, labels: {app: client, projectcalico.org/namespace: dev, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-a, pod: client, endpoint: eth0, interfaceName: calidevclient, ipNetworks: [10.0.1.2/32], profiles: [kns.dev]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--b-k8s-db-eth0, namespace: prod, labels: {app: db, projectcalico.org/namespace: prod, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-b, pod: db, endpoint: eth0, interfaceName: calidb, ipNetworks: [10.0.2.1/32], profiles: [kns.prod]}
"#;

fn graph(extra: &str) -> CalcGraph {
    let mut g = CalcGraph::new();
    for text in [BASE, extra] {
        for entry in parse_manifest(text).expect("manifest parses") {
            // A kind the graph does not use (a Service) is skipped.
            if let Some(valid) = entry.outcome.into_resource().expect("valid object") {
                g.apply(Update::ApplyValid(valid)).expect("accepted");
            }
        }
    }
    g.apply(Update::InSync).expect("in sync");
    g
}

fn ask(g: &CalcGraph, from: &str, to: &str, protocol: &str, port: Option<u16>) -> Explanation {
    g.explain(&Query {
        from: from.into(),
        to: to.into(),
        protocol: Some(protocol.into()),
        port: port.map(|p| p.to_string()),
        source_port: None,
    })
    .unwrap_or_else(|e| panic!("{from} -> {to}: {e}"))
}

fn by_policy(tier: &str, policy: &str, index: usize, action: &str) -> DecidedBy {
    DecidedBy::Policy {
        tier: tier.into(),
        policy: policy.into(),
        kind: if policy.contains('/') {
            "NetworkPolicy"
        } else {
            "GlobalNetworkPolicy"
        }
        .into(),
        rule: crate::explain::RuleRef {
            index,
            action: action.into(),
        },
    }
}

fn default(what: &str) -> DecidedBy {
    DecidedBy::Default {
        default: what.into(),
    }
}

#[test]
fn no_policy_means_the_namespace_profile_decides() {
    let g = graph("");
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(80));
    assert_eq!(e.verdict, Allow);
    assert_eq!(
        e.ingress.decided_by,
        DecidedBy::Profile {
            profile: "kns.prod".into(),
            rule: crate::explain::RuleRef {
                index: 0,
                action: "Allow".into()
            }
        }
    );
    assert_eq!(e.from.ip, "10.0.0.2");
    assert_eq!(e.to.node.as_deref(), Some("node-a"));
}

const TIERS: &str = r#"
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: security}
spec: {order: 100, defaultAction: Deny}
---
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: platform}
spec: {order: 200, defaultAction: Pass}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: pass-prod}
spec:
  tier: security
  order: 10
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Pass
    source: {namespaceSelector: env == 'prod'}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: platform-watch}
spec:
  tier: platform
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Deny
    protocol: TCP
    destination: {ports: [9999]}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-http, namespace: prod}
spec:
  order: 100
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {selector: app == 'client'}
    destination: {ports: [http]}
"#;

/// A rule that is missed names the part of its selector that fails, in the order Calico's
/// combined selector tests them, never a part that matches.
#[test]
fn a_missed_rule_names_the_part_of_its_selector_that_fails() {
    let g = graph(
        r#"
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: db-guard, namespace: prod}
spec:
  selector: app == 'db'
  types: [Ingress]
  ingress:
  - action: Allow
    source:
      namespaceSelector: env == 'prod'
      serviceAccounts: {selector: role == 'backend'}
  - action: Allow
    source:
      namespaceSelector: env == 'prod'
      serviceAccounts: {names: [backup]}
  - action: Allow
    source: {namespaceSelector: env == 'prod', selector: app == 'web'}
"#,
    );
    let misses = |from: &str| -> Vec<String> {
        let e = ask(&g, from, "prod/db", "tcp", Some(9999));
        let step = e
            .ingress
            .steps
            .iter()
            .find(|s| s.policy.as_deref() == Some("prod/db-guard"))
            .expect("the policy is walked")
            .clone();
        step.not_matched.iter().map(|m| m.why.clone()).collect()
    };
    // prod/client is in a namespace labelled env=prod: the namespace is not the miss.
    let why = misses("prod/client");
    assert_eq!(why.len(), 3, "{why:?}");
    assert!(
        why[0].contains("serviceAccounts.selector `role == 'backend'`"),
        "{why:?}"
    );
    assert!(why[1].contains("serviceAccounts.names [backup]"), "{why:?}");
    assert!(why[2].contains("selector `app == 'web'`"), "{why:?}");
    assert!(
        !why.iter().any(|w| w.contains("namespaceSelector")),
        "{why:?}"
    );
    // dev/client fails the namespace first, whatever else it would fail.
    for w in misses("dev/client") {
        assert!(w.contains("namespaceSelector `env == 'prod'`"), "{w}");
    }
}

#[test]
fn pass_moves_to_the_next_tier_and_a_deny_tier_drops_at_its_end() {
    let g = graph(TIERS);
    // prod/client: passed by security, nothing in platform (default Pass), allowed by the
    // default tier's named-port rule.
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(8080));
    assert_eq!(e.verdict, Allow, "{}", render_text(&e));
    assert_eq!(
        e.ingress.decided_by,
        by_policy("default", "prod/web-http", 0, "Allow")
    );
    let outcomes: Vec<(Option<&str>, &str)> = e
        .ingress
        .steps
        .iter()
        .map(|s| (s.tier.as_deref(), s.outcome.as_str()))
        .collect();
    assert_eq!(
        outcomes,
        [
            (Some("security"), "pass: on to the next tier"),
            (Some("platform"), "no rule matched: next policy"),
            (
                Some("platform"),
                "end of tier (default action Pass): next tier"
            ),
            (Some("default"), "allow"),
        ]
    );
    // The named port: 80 is not `http`.
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(80));
    assert_eq!(e.ingress.decided_by, default("end-of-tier default"));
    let web_http = e
        .ingress
        .steps
        .iter()
        .find(|s| s.policy.as_deref() == Some("prod/web-http"))
        .expect("visited");
    assert!(
        web_http.not_matched[0].why.contains("destination port 80"),
        "{web_http:?}"
    );
    // dev/client is not in a prod namespace: security's end-of-tier drop.
    let e = ask(&g, "dev/client", "prod/web", "tcp", Some(8080));
    assert_eq!(e.verdict, Deny);
    assert_eq!(e.ingress.decided_by, default("end-of-tier security"));
    let pass = &e.ingress.steps[0];
    assert!(
        pass.not_matched[0].why.contains("env == 'prod'"),
        "{pass:?}"
    );
    // The platform tier's deny, after a pass.
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(9999));
    assert_eq!(
        e.ingress.decided_by,
        by_policy("platform", "platform-watch", 0, "Deny")
    );
    // The egress side has no policy: the profile allows.
    assert_eq!(e.egress.verdict, Allow);
}

#[test]
fn nil_order_sorts_last_and_ties_go_by_name() {
    let g = graph(
        r#"
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: a-no-order}
spec: {selector: app == 'web', types: [Ingress], ingress: [{action: Allow}]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: z-deny}
spec: {order: 5, selector: app == 'web', types: [Ingress], ingress: [{action: Deny}]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: b-deny}
spec: {order: 5, selector: app == 'web', types: [Ingress], ingress: [{action: Deny}]}
"#,
    );
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(80));
    assert_eq!(
        e.ingress.decided_by,
        by_policy("default", "b-deny", 0, "Deny")
    );
    let visited: Vec<&str> = e
        .ingress
        .steps
        .iter()
        .filter_map(|s| s.policy.as_deref())
        .collect();
    assert_eq!(visited, ["b-deny"], "evaluation stops at the first deny");
}

#[test]
fn unselected_policies_are_shown_as_passed_over() {
    let g = graph(TIERS);
    let e = ask(&g, "prod/web", "prod/client", "tcp", Some(80));
    // No tier applies to prod/client's ingress: the tiers are listed as not applied.
    assert!(
        e.ingress
            .steps
            .iter()
            .any(|s| s.tier.as_deref() == Some("security") && s.outcome.starts_with("not applied"))
    );
    assert_eq!(
        e.ingress.decided_by,
        DecidedBy::Profile {
            profile: "kns.prod".into(),
            rule: crate::explain::RuleRef {
                index: 0,
                action: "Allow".into()
            },
        }
    );
    // A policy in a visited tier that does not select the endpoint is listed as such.
    let g = graph(&format!(
            "{TIERS}---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {{name: db-only}}
spec: {{tier: security, order: 1, selector: app == 'db', types: [Ingress], ingress: [{{action: Allow}}]}}
"
        ));
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(8080));
    let first = &e.ingress.steps[0];
    assert_eq!(first.policy.as_deref(), Some("db-only"));
    assert_eq!(first.selected, Some(false));
    assert_eq!(first.selector.as_deref(), Some("app == \"db\""));
}

#[test]
fn egress_policies_negations_and_network_sets() {
    let g = graph(
        r#"
apiVersion: projectcalico.org/v3
kind: GlobalNetworkSet
metadata: {name: partners, labels: {kind: partner}}
spec: {nets: [192.0.2.0/24]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: client-out}
spec:
  order: 1
  selector: app == 'client' && projectcalico.org/namespace == 'prod'
  types: [Egress]
  egress:
  - action: Deny
    protocol: TCP
    destination: {notPorts: [443], selector: kind == 'partner'}
  - action: Allow
    destination: {selector: kind == 'partner'}
  - action: Allow
    destination: {notSelector: app == 'db', namespaceSelector: env == 'prod'}
"#,
    );
    // To a partner address on 443: the deny's notPorts excludes it, rule 1 allows.
    let e = ask(&g, "prod/client", "192.0.2.7", "tcp", Some(443));
    assert_eq!(
        e.egress.decided_by,
        by_policy("default", "client-out", 1, "Allow")
    );
    assert_eq!(e.to.kind, "outside the cluster");
    assert_eq!(e.to.network_sets, ["partners"]);
    assert_eq!(e.ingress.decided_by, default("no policy"));
    assert_eq!(e.verdict, Allow);
    // On 80, rule 0 denies.
    let e = ask(&g, "prod/client", "192.0.2.7", "tcp", Some(80));
    assert_eq!(
        e.egress.decided_by,
        by_policy("default", "client-out", 0, "Deny")
    );
    // Elsewhere outside: no rule matches, the tier drops at its end.
    let e = ask(&g, "prod/client", "198.51.100.1", "udp", Some(53));
    assert_eq!(e.egress.decided_by, default("end-of-tier default"));
    // notSelector: prod/web yes (named by its address), prod/db no.
    let e = ask(&g, "prod/client", "10.0.0.1", "tcp", Some(80));
    assert_eq!(e.to.name, "prod/web");
    assert_eq!(
        e.egress.decided_by,
        by_policy("default", "client-out", 2, "Allow")
    );
    let e = ask(&g, "prod/client", "prod/db", "tcp", Some(80));
    assert_eq!(e.egress.decided_by, default("end-of-tier default"));
    let miss = &e.egress.steps.last().expect("steps");
    assert!(miss.outcome.contains("end of tier"), "{miss:?}");
}

#[test]
fn icmp_and_missing_profiles() {
    let g = graph(
        r#"
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: ping}
spec:
  selector: app == 'web'
  types: [Ingress]
  ingress: [{action: Allow, protocol: ICMP, icmp: {type: 8}}]
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-orphan-eth0, namespace: prod, labels: {app: orphan, projectcalico.org/namespace: prod, projectcalico.org/orchestrator: k8s}}
spec: {orchestrator: k8s, node: node-a, pod: orphan, endpoint: eth0, interfaceName: caliorphan, ipNetworks: [10.0.0.9/32], profiles: [kns.gone]}
"#,
    );
    let e = ask(&g, "prod/client", "prod/web", "icmp", None);
    assert_eq!(
        e.ingress.decided_by,
        by_policy("default", "ping", 0, "Allow")
    );
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(22));
    assert!(
        e.ingress.steps[0].not_matched[0]
            .why
            .contains("protocol: rule wants ICMP")
    );
    // A profile that does not exist: Felix's deny-all rules.
    let e = ask(&g, "prod/client", "prod/orphan", "tcp", Some(80));
    assert_eq!(
        e.ingress.decided_by,
        DecidedBy::Profile {
            profile: "kns.gone".into(),
            rule: crate::explain::RuleRef {
                index: 0,
                action: "Deny".into()
            }
        }
    );
}

/// Services prod/web (10.0.0.1 on TCP 8080; 10.0.2.1 too, in a second slice, on UDP 53
/// only) and prod/client (10.0.0.2), and policies that name them.
const SERVICES: &str = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a1, namespace: prod, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.0.0.1], conditions: {ready: true}}]
ports: [{name: http, protocol: TCP, port: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-b2, namespace: prod, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.0.2.1]}]
ports: [{name: dns, protocol: UDP, port: 53}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: client-c3, namespace: prod, labels: {kubernetes.io/service-name: client}}
addressType: IPv4
endpoints: [{addresses: [10.0.0.2]}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: prod}
spec: {selector: {app: web}, ports: [{port: 80, targetPort: http}]}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: client-to-web, namespace: prod}
spec:
  selector: app == 'client'
  types: [Egress]
  egress:
  - action: Allow
    destination: {services: {name: web}}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: web-from-client}
spec:
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {services: {name: client, namespace: prod}}
"#;

#[test]
fn service_rules_match_the_endpoints_and_ports_of_the_service() {
    let g = graph(SERVICES);
    // To web's endpoint on web's port, from client's endpoint: both rules allow.
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(8080));
    assert_eq!(e.verdict, Allow, "{}", render_text(&e));
    assert_eq!(
        e.egress.decided_by,
        by_policy("default", "prod/client-to-web", 0, "Allow")
    );
    assert_eq!(
        e.ingress.decided_by,
        by_policy("default", "web-from-client", 0, "Allow")
    );
    // Another port of the same endpoint is not the service's.
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(9090));
    assert_eq!(e.verdict, Deny);
    assert_eq!(e.egress.decided_by, default("end-of-tier default"));
    let why = &e.egress.steps[0].not_matched[0].why;
    assert_eq!(why, "destination is not an endpoint of service prod/web");
    // prod/db is web's endpoint on UDP 53 only (its slice's port).
    assert_eq!(
        ask(&g, "prod/client", "prod/db", "udp", Some(53))
            .egress
            .verdict,
        Allow
    );
    assert_eq!(
        ask(&g, "prod/client", "prod/db", "tcp", Some(8080))
            .egress
            .verdict,
        Deny
    );
    // dev/client is not an endpoint of prod/client.
    let e = ask(&g, "dev/client", "prod/web", "tcp", Some(8080));
    assert_eq!(e.ingress.verdict, Deny);
    assert_eq!(
        e.ingress.steps[0].not_matched[0].why,
        "source 10.0.1.2 is not an endpoint of service prod/client"
    );
}

#[test]
fn endpoint_and_policy_listings() {
    let g = graph(TIERS);
    let e = g.explain_endpoint("prod/web").expect("known");
    assert_eq!(e.addresses, ["10.0.0.1"]);
    assert_eq!(e.profiles, ["kns.prod"]);
    let tiers: Vec<(&str, Vec<&str>)> = e.chains[0]
        .ingress
        .iter()
        .map(|t| {
            (
                t.tier.as_str(),
                t.policies.iter().map(|p| p.policy.as_str()).collect(),
            )
        })
        .collect();
    assert_eq!(
        tiers,
        [
            ("security", vec!["pass-prod"]),
            ("platform", vec!["platform-watch"]),
            ("default", vec!["prod/web-http"]),
        ]
    );
    assert!(e.chains[0].egress.is_empty());
    assert!(render_endpoint_text(&e).contains("tier security (end of tier: Deny)"));

    let p = g.explain_policy("prod/web-http").expect("known");
    assert_eq!(p.endpoints, ["prod/web"]);
    assert_eq!(p.nodes, ["node-a"]);
    assert_eq!(p.types, [Dir::Ingress]);
    let p = g
        .explain_policy("web-http")
        .expect("a unique name needs no namespace");
    assert_eq!(p.policy, "prod/web-http");
    assert!(g.explain_policy("nope").is_err());
    assert!(g.explain_endpoint("203.0.113.1").is_err());
}

const HOSTS: &str = r#"
apiVersion: projectcalico.org/v3
kind: HostEndpoint
metadata: {name: a-eth0, labels: {role: node}}
spec: {node: node-a, interfaceName: eth0, expectedIPs: [192.168.0.1], profiles: []}
---
apiVersion: projectcalico.org/v3
kind: HostEndpoint
metadata: {name: b-all, labels: {role: gateway}}
spec: {node: node-b, interfaceName: "*", expectedIPs: [192.168.0.2]}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: untracked-trusted}
spec:
  selector: role == 'node'
  doNotTrack: true
  applyOnForward: true
  types: [Ingress]
  ingress: [{action: Allow, source: {nets: [10.9.0.0/16]}}]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: prednat-block}
spec:
  selector: role == 'node'
  preDNAT: true
  applyOnForward: true
  types: [Ingress]
  ingress: [{action: Deny, source: {nets: [10.66.0.0/16]}}]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: node-web}
spec:
  selector: role == 'node'
  types: [Ingress]
  ingress: [{action: Allow, protocol: TCP, destination: {ports: [443]}}]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: gateway-forward}
spec:
  selector: role == 'gateway'
  applyOnForward: true
  types: [Ingress]
  ingress: [{action: Deny, protocol: TCP, destination: {ports: [25]}}]
---
apiVersion: projectcalico.org/v3
kind: FelixConfiguration
metadata: {name: default}
spec:
  defaultEndpointToHostAction: Accept
  failsafeInboundHostPorts: [{protocol: TCP, port: 2222}]
"#;

#[test]
fn host_endpoints_meet_untracked_pre_dnat_normal_and_forward_policy() {
    let g = graph(HOSTS);
    // doNotTrack allows at once: no later chain is walked.
    let e = ask(&g, "10.9.1.1", "hep:a-eth0", "tcp", Some(80));
    assert_eq!(
        e.ingress.decided_by,
        by_policy("default", "untracked-trusted", 0, "Allow")
    );
    assert!(
        e.ingress.steps.iter().all(|s| s.stage == "untracked"),
        "{}",
        render_text(&e)
    );
    // pre-DNAT denies before normal policy.
    let e = ask(&g, "10.66.1.1", "hep:a-eth0", "tcp", Some(443));
    assert_eq!(
        e.ingress.decided_by,
        by_policy("default", "prednat-block", 0, "Deny")
    );
    // Otherwise normal policy (no profile: the end of the tier drops what it does not allow).
    assert_eq!(
        ask(&g, "10.1.1.1", "hep:a-eth0", "tcp", Some(443)).verdict,
        Allow
    );
    let e = ask(&g, "10.1.1.1", "hep:a-eth0", "tcp", Some(80));
    assert_eq!(e.ingress.decided_by, default("end-of-tier default"));
    // The failsafes FelixConfiguration sets replace Felix's defaults.
    let e = ask(&g, "10.1.1.1", "hep:a-eth0", "tcp", Some(2222));
    assert_eq!(e.ingress.decided_by, default("failsafe tcp:2222"));
    assert_eq!(
        ask(&g, "10.1.1.1", "hep:a-eth0", "tcp", Some(22)).verdict,
        Deny
    );
    // A workload to its own host: DefaultEndpointToHostAction, not host endpoint policy.
    let e = ask(&g, "prod/web", "hep:a-eth0", "tcp", Some(80));
    assert_eq!(
        e.ingress.decided_by,
        default("DefaultEndpointToHostAction Accept")
    );
    // The `*` endpoint's forward policy meets traffic forwarded to node-b's workload.
    let e = ask(&g, "10.1.1.1", "prod/db", "tcp", Some(25));
    assert_eq!(
        e.ingress.decided_by,
        by_policy("default", "gateway-forward", 0, "Deny")
    );
    assert_eq!(e.ingress.steps[0].stage, "forward");
    // Forward chains drop at the end of a tier too.
    let e = ask(&g, "10.1.1.1", "prod/db", "tcp", Some(80));
    assert_eq!(e.ingress.decided_by, default("end-of-tier default"));
    assert_eq!(e.ingress.steps[1].stage, "forward");
    // Traffic between node-a's workloads never reaches node-b's gateway.
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(25));
    assert!(e.ingress.steps.iter().all(|s| s.stage != "forward"));
}

#[test]
fn failsafes_are_read_as_the_agent_reads_them() {
    let config = |v: &str| pb::ConfigUpdate {
        config: [("FailsafeInboundHostPorts".to_string(), v.to_string())].into(),
        ..Default::default()
    };
    let ports = |v: &str| -> Vec<u16> {
        failsafes(&config(v), "FailsafeInboundHostPorts", "tcp:22")
            .iter()
            .map(|f| f.port)
            .collect()
    };
    assert_eq!(ports("udp:68,tcp:443"), [68, 443]);
    assert!(ports("none").is_empty());
    // An invalid value is refused whole by the agent, which keeps the default.
    assert_eq!(ports("tcp:443,icmp:1"), [22]);
}

#[test]
fn bad_queries_say_what_is_wrong() {
    let g = graph("");
    let q = |from: &str, to: &str, protocol: &str, port: Option<&str>| Query {
        from: from.into(),
        to: to.into(),
        protocol: Some(protocol.into()),
        port: port.map(Into::into),
        source_port: None,
    };
    let err = |q: Query| g.explain(&q).expect_err("refused").to_string();
    assert!(
        err(q("prod/nope", "prod/web", "tcp", Some("80"))).contains("no endpoint \"prod/nope\"")
    );
    // Two namespaces hold a node--a-k8s-client-eth0.
    let e = err(q("node--a-k8s-client-eth0", "prod/web", "tcp", Some("80")));
    assert!(
        e.contains("ambiguous")
            && e.contains("dev/node--a-k8s-client-eth0")
            && e.contains("prod/node--a-k8s-client-eth0"),
        "{e}"
    );
    assert!(err(q("prod/client", "prod/web", "tcp", Some("0"))).contains("not a port number"));
    assert!(err(q("prod/client", "prod/web", "tcp", None)).contains("needs a destination port"));
    assert!(err(q("prod/client", "prod/web", "icmp", Some("80"))).contains("has no ports"));
    assert!(err(q("prod/client", "prod/web", "bogus", Some("80"))).contains("unknown protocol"));
    assert!(
        err(q("prod/client", "2001:db8::1", "tcp", Some("80")))
            .contains("no address family in common")
    );
    // The full name with its namespace is not ambiguous.
    let e = ask(
        &g,
        "dev/node--a-k8s-client-eth0",
        "prod/web",
        "tcp",
        Some(80),
    );
    assert_eq!(e.from.name, "dev/client");
}

const STAGED: &str = r#"
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: default}
spec: {order: 1000000, defaultAction: Deny}
---
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: trial}
spec: {order: 50, defaultAction: Deny}
---
# Enforced: web accepts 8080 from prod.
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-http, namespace: prod}
spec:
  selector: app == 'web'
  ingress: [{action: Allow, protocol: TCP, source: {selector: all()}, destination: {ports: [8080]}}]
---
# Staged in the enforced tier: would deny the client.
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata: {name: lock-client, namespace: prod}
spec:
  stagedAction: Set
  order: 1
  selector: app == 'web'
  ingress: [{action: Deny, source: {selector: app == 'client'}}]
---
# A tier of staged policies only: no end-of-tier drop while staged.
apiVersion: projectcalico.org/v3
kind: StagedGlobalNetworkPolicy
metadata: {name: trial-db}
spec:
  tier: trial
  selector: app == 'db'
  ingress: [{action: Allow, source: {selector: app == 'web'}}]
---
# A staged Kubernetes policy: a Kubernetes spec plus stagedAction.
apiVersion: projectcalico.org/v3
kind: StagedKubernetesNetworkPolicy
metadata: {name: db-ingress, namespace: prod}
spec:
  stagedAction: Set
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
---
# A staged delete: not sent at all.
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata: {name: web-http, namespace: prod}
spec:
  stagedAction: Delete
  selector: app == 'web'
"#;

fn staged_ids(g: &mut CalcGraph, node: &str) -> Vec<String> {
    g.subscribe(node);
    let mut ids = Vec::new();
    for m in g.snapshot(node) {
        match &m.payload {
            Some(Payload::ActivePolicyUpdate(u)) => {
                let id = u.id.as_ref().unwrap();
                ids.push(format!("{}:{}/{}", id.kind, id.namespace, id.name));
            }
            Some(Payload::WorkloadEndpointUpdate(u)) => {
                for t in &u.endpoint.as_ref().unwrap().tiers {
                    for id in t.ingress_policies.iter() {
                        ids.push(format!(
                            "{} tier {}: {}:{}/{}",
                            u.id.as_ref().unwrap().workload_id,
                            t.name,
                            id.kind,
                            id.namespace,
                            id.name
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    ids.sort();
    ids
}

#[test]
fn staged_policies_are_sent_with_their_kind_and_never_change_the_enforced_verdict() {
    let mut g = graph(STAGED);
    let a = staged_ids(&mut g, "node-a");
    for want in [
        "NetworkPolicy:prod/web-http",
        "StagedNetworkPolicy:prod/lock-client",
        "prod/web tier default: StagedNetworkPolicy:prod/lock-client",
        "prod/web tier default: NetworkPolicy:prod/web-http",
    ] {
        assert!(a.iter().any(|i| i == want), "{want} missing from {a:#?}");
    }
    let b = staged_ids(&mut g, "node-b");
    for want in [
        "StagedGlobalNetworkPolicy:/trial-db",
        "StagedKubernetesNetworkPolicy:prod/knp.default.db-ingress",
        "prod/db tier trial: StagedGlobalNetworkPolicy:/trial-db",
        "prod/db tier default: StagedKubernetesNetworkPolicy:prod/knp.default.db-ingress",
    ] {
        assert!(b.iter().any(|i| i == want), "{want} missing from {b:#?}");
    }
    // The staged Delete of web-http is not sent: web-http itself still is.
    assert_eq!(
        a.iter().filter(|i| i.contains("web-http")).count(),
        2,
        "{a:#?}"
    );

    // Enforced: the staged deny is passed over; pending: it denies.
    let e = ask(&g, "prod/client", "prod/web", "tcp", Some(8080));
    assert_eq!(e.verdict, Allow, "{}", render_text(&e));
    assert_eq!(
        e.ingress.decided_by,
        by_policy("default", "prod/web-http", 0, "Allow")
    );
    let staged_step = e
        .ingress
        .steps
        .iter()
        .find(|s| s.policy.as_deref() == Some("prod/lock-client"))
        .expect("shown");
    assert!(staged_step.outcome.starts_with("staged: not enforced"));
    let pending = e.pending.as_ref().expect("a staged policy is on the path");
    assert_eq!(pending.verdict, Deny);
    assert_eq!(
        pending.ingress.decided_by,
        DecidedBy::Policy {
            tier: "default".into(),
            policy: "prod/lock-client".into(),
            kind: "StagedNetworkPolicy".into(),
            rule: crate::explain::RuleRef {
                index: 0,
                action: "Deny".into()
            },
        }
    );
    let text = render_text(&e);
    assert!(
        text.contains("pending (staged policies enforced): DENY"),
        "{text}"
    );

    // A tier of staged policies only has no end-of-tier drop while staged; the staged
    // Kubernetes policy (ingress, no rules) would deny everything else.
    let e = ask(&g, "prod/client", "prod/db", "tcp", Some(5432));
    assert_eq!(e.verdict, Allow, "{}", render_text(&e));
    assert_eq!(e.pending.as_ref().map(|p| p.verdict), Some(Deny));
    let e = ask(&g, "prod/web", "prod/db", "tcp", Some(5432));
    assert_eq!(e.verdict, Allow);
    assert_eq!(
        e.pending.as_ref().map(|p| p.verdict),
        Some(Allow),
        "trial-db allows web before the staged Kubernetes policy is reached"
    );

    // No staged policy on the path: no pending verdict.
    let e = ask(&g, "prod/web", "prod/client", "tcp", Some(80));
    assert!(e.pending.is_none(), "{:?}", e.pending);

    // explain --policy finds staged policies; a kind prefix picks one of a name.
    let r = g.explain_policy("trial-db").unwrap();
    assert_eq!(r.kind, "StagedGlobalNetworkPolicy");
    assert_eq!(r.endpoints, ["prod/db"]);
    assert_eq!(r.nodes, ["node-b"]);
    let r = g.explain_policy("sknp:prod/db-ingress").unwrap();
    assert_eq!(r.endpoints, ["prod/db"]);
    let r = g.explain_policy("NetworkPolicy:prod/web-http").unwrap();
    assert_eq!(r.kind, "NetworkPolicy");
    assert!(g.explain_policy("frob:prod/web-http").is_err());
}

#[test]
fn endpoints_are_found_by_address_whatever_its_spelling() {
    // An IPv6 address written long-hand in the manifest, and a workload holding a /30.
    let g = graph(
        r#"
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-v6-eth0, namespace: prod, labels: {app: v6}}
spec: {orchestrator: k8s, node: node-a, pod: v6, endpoint: eth0, interfaceName: caliv6, ipNetworks: ["fd00:0:0::0:7/128"], profiles: [kns.prod]}
---
apiVersion: projectcalico.org/v3
kind: WorkloadEndpoint
metadata: {name: node--a-k8s-wide-eth0, namespace: prod, labels: {app: wide}}
spec: {orchestrator: k8s, node: node-a, pod: wide, endpoint: eth0, interfaceName: caliwide, ipNetworks: [10.0.9.0/30], profiles: [kns.prod]}
"#,
    );
    let v = g.view();
    let pods = |ip: &str| -> Vec<String> {
        let mut found: Vec<String> = v
            .endpoints_with_ip(ip.parse().unwrap())
            .map(|e| e.key().name.clone())
            .collect();
        found.sort();
        found
    };
    assert_eq!(pods("fd00::7"), ["node--a-k8s-v6-eth0"]);
    assert_eq!(pods("10.0.9.2"), ["node--a-k8s-wide-eth0"]);
    assert_eq!(pods("10.0.9.4"), Vec::<String>::new());
    assert_eq!(pods("10.0.0.1"), ["node--a-k8s-web-eth0"]);
    // Not a prefix match on the text: 10.0.0.1 is not 10.0.0.10.
    assert_eq!(pods("10.0.0.10"), Vec::<String>::new());
}
