//! Flow logs through the Linux driver: events from an in-memory source, rules named as the
//! stream names them (hashed prefixes through the rules as rendered), reports per interval.

use super::*;
use crate::flows::source::{FlowEvent, MemorySource};
use crate::flows::{CtObservation, FlowSettings, Tuple};
use felix_proto::rule_ref::Kind;
use felix_proto::{FlowRecord, FlowReport, FlowRuleHit, RuleRef};
use rules::endpoint::Direction::Ingress;
use rules::nflog::{self, Verdict};

/// A policy whose NFLOG prefix is hashed (its id is long).
fn long_id() -> PolicyId {
    PolicyId {
        name: "security.this-policy-name-is-long-enough-to-be-hashed-in-a-prefix".into(),
        namespace: String::new(),
        kind: "GlobalNetworkPolicy".into(),
    }
}

fn policy_with(id: PolicyId, action: &str) -> Message {
    msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
        id: Some(id),
        policy: Some(Policy {
            inbound_rules: vec![Rule {
                action: action.into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
    }))
}

/// `caliweb` (10.65.0.2) with tier `security` (the long policy passes) before `default`.
fn tiered_wep() -> Message {
    msg(Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
        id: Some(wep_id()),
        endpoint: Some(WorkloadEndpoint {
            state: "active".into(),
            name: "caliweb".into(),
            ipv4_nets: vec!["10.65.0.2/32".into()],
            tiers: vec![
                TierInfo {
                    name: "security".into(),
                    ingress_policies: vec![long_id()],
                    egress_policies: vec![],
                    default_action: "Deny".into(),
                },
                TierInfo {
                    name: "default".into(),
                    ingress_policies: vec![pol_id()],
                    egress_policies: vec![],
                    default_action: "Deny".into(),
                },
            ],
            ..Default::default()
        }),
    }))
}

fn tuple() -> Tuple {
    Tuple {
        src: "10.65.1.9".parse().unwrap(),
        dst: "10.65.0.2".parse().unwrap(),
        src_port: 40000,
        dst_port: 80,
        protocol: 6,
    }
}

fn nflog_event(at: i64, prefix: String) -> FlowEvent {
    FlowEvent::Nflog {
        at,
        group: 1,
        prefix,
        tuple: tuple(),
        len: 60,
    }
}

fn ct_event(at: i64, destroyed: bool) -> FlowEvent {
    let t = tuple();
    FlowEvent::Conntrack {
        at,
        entry: CtObservation {
            orig: t,
            reply: Tuple {
                src: t.dst,
                dst: t.src,
                src_port: t.dst_port,
                dst_port: t.src_port,
                protocol: 6,
            },
            orig_packets: 6,
            orig_bytes: 600,
            reply_packets: 4,
            reply_bytes: 4000,
            new: false,
            destroyed,
        },
    }
}

fn policy_ref(id: PolicyId) -> RuleRef {
    let mut r = RuleRef {
        policy: Some(id),
        ..Default::default()
    };
    r.set_kind(Kind::PolicyRule);
    r
}

/// An interval start (a multiple of 15).
const T0: i64 = 1_700_000_010;

fn flow_logs_on() -> (LinuxDriver, MemorySource) {
    let (mut d, _k) = driver();
    d.on_update(&config(&[(
        "FlowLogsGoldmaneServer",
        "goldmane.calico-system:7443",
    )]));
    d.on_update(&policy_with(long_id(), "pass"));
    d.on_update(&policy_with(pol_id(), "allow"));
    d.on_update(&tiered_wep());
    d.apply().unwrap();
    let source = MemorySource::default();
    d.set_flow_source(Box::new(source.clone()), FlowSettings::default());
    (d, source)
}

#[test]
fn logged_rules_are_named_as_the_stream_names_them_hashed_or_not() {
    let (mut d, source) = flow_logs_on();
    assert!(d.collects_flows());
    let pass = nflog::policy_rule(
        Verdict::Pass,
        Ingress,
        0,
        &rules::policy_id_string(&long_id()),
    );
    assert_eq!(pass.len(), 63, "hashed: {pass}");
    let allow = nflog::policy_rule(
        Verdict::Allow,
        Ingress,
        0,
        &rules::policy_id_string(&pol_id()),
    );
    // A hashed prefix of no rule programmed (a tier since removed): left out of the trace.
    source.push(nflog_event(T0, format!("PPI0|{}", "x".repeat(58))));
    source.push(nflog_event(T0, pass));
    source.push(nflog_event(T0, allow));
    source.push(ct_event(T0 + 3, true));
    assert!(d.collect_flows(T0 + 14).unwrap().is_empty(), "still open");
    let reports = d.collect_flows(T0 + 15).unwrap();
    assert_eq!(
        reports,
        [FlowReport {
            records: vec![FlowRecord {
                interval_start: T0,
                source_ip: "10.65.1.9".into(),
                dest_ip: "10.65.0.2".into(),
                source_port: 40000,
                dest_port: 80,
                protocol: 6,
                reporter_dest: true,
                trace: vec![
                    FlowRuleHit {
                        rule: Some(policy_ref(long_id())),
                        action: "pass".into(),
                    },
                    FlowRuleHit {
                        rule: Some(policy_ref(pol_id())),
                        action: "allow".into(),
                    },
                ],
                allowed: true,
                packets_in: 6,
                packets_out: 4,
                bytes_in: 600,
                bytes_out: 4000,
                connections_started: 1,
                connections_completed: 1,
                connections_live: 0,
                original_dest_ip: String::new(),
                original_dest_port: 0,
            }],
            dropped: 0,
        }]
    );
}

#[test]
fn the_end_of_a_tier_is_named_by_parsing_its_prefix() {
    let (mut d, source) = flow_logs_on();
    source.push(nflog_event(T0, "DPI|default".into()));
    let reports = d.collect_flows(T0 + 15).unwrap();
    let mut end = RuleRef {
        tier: "default".into(),
        ..Default::default()
    };
    end.set_kind(Kind::EndOfTier);
    assert_eq!(
        reports[0].records[0].trace,
        [FlowRuleHit {
            rule: Some(end),
            action: "deny".into()
        }]
    );
    assert!(!reports[0].records[0].allowed);
}

#[test]
fn with_flow_logs_off_nothing_is_kept() {
    let (mut d, source) = flow_logs_on();
    source.push(nflog_event(T0, "DPI|default".into()));
    assert!(d.collect_flows(T0 + 1).unwrap().is_empty(), "open interval");
    d.on_update(&config(&[]));
    d.apply().unwrap();
    assert!(d.collect_flows(T0 + 15).unwrap().is_empty());
    // On again: nothing of before comes back.
    d.on_update(&config(&[(
        "FlowLogsGoldmaneServer",
        "goldmane.calico-system:7443",
    )]));
    d.apply().unwrap();
    assert!(d.collect_flows(T0 + 60).unwrap().is_empty());
    // Without a source the driver offers nothing.
    let (plain, _k) = driver();
    assert!(!plain.collects_flows());
}
