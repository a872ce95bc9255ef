//! The flow aggregator: exact records for each input, bounds and prefix parsing.

use std::net::{IpAddr, Ipv4Addr};

use super::*;

const CLIENT: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 65, 0, 2));
const SERVER: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 65, 1, 3));
const SERVICE: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10));

fn tcp(src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Tuple {
    Tuple {
        src,
        dst,
        src_port: sport,
        dst_port: dport,
        protocol: 6,
    }
}

fn conn() -> Tuple {
    tcp(CLIENT, 40000, SERVER, 80)
}

/// The reply of `conn()` (no NAT).
fn reply() -> Tuple {
    tcp(SERVER, 80, CLIENT, 40000)
}

/// A resolver naming each prefix by itself (tier = prefix), to see the order.
fn named(prefix: &str) -> Option<RuleRef> {
    Some(RuleRef {
        tier: prefix.to_owned(),
        ..RuleRef::default()
    })
}

fn hit(prefix: &str, action: &str) -> FlowRuleHit {
    FlowRuleHit {
        rule: named(prefix),
        action: action.to_owned(),
    }
}

fn log(a: &mut FlowAggregator, now: i64, group: u16, prefix: &str, tuple: Tuple, len: u32) {
    a.on_nflog(
        now,
        &NflogEvent {
            group,
            prefix,
            tuple,
            len,
        },
        named,
    );
}

fn ct(orig: Tuple, reply: Tuple, counts: [u64; 4], new: bool, destroyed: bool) -> CtObservation {
    CtObservation {
        orig,
        reply,
        orig_packets: counts[0],
        orig_bytes: counts[1],
        reply_packets: counts[2],
        reply_bytes: counts[3],
        new,
        destroyed,
    }
}

fn settings() -> FlowSettings {
    FlowSettings {
        max_connections: 100,
        max_queued_records: 100,
        idle_intervals: 2,
    }
}

#[test]
fn intervals_start_at_multiples_of_15() {
    assert_eq!(interval_start(0), 0);
    assert_eq!(interval_start(14), 0);
    assert_eq!(interval_start(15), 15);
    assert_eq!(interval_start(1_700_000_007), 1_699_999_995);
    assert_eq!(interval_start(-1), -15);
}

#[test]
fn an_allowed_connection_is_traced_counted_and_completed() {
    let mut a = FlowAggregator::new(settings());
    // Inbound: the first tier passes, the second allows.
    log(&mut a, 1005, 1, "PPI|security", conn(), 60);
    log(&mut a, 1005, 1, "API0|np/prod/web", conn(), 60);
    a.on_conntrack(1008, &ct(conn(), reply(), [3, 180, 2, 120], true, false));
    a.on_conntrack(1013, &ct(conn(), reply(), [10, 900, 8, 5000], false, false));
    // Nothing closed yet.
    assert!(a.take_reports(1019, 100).is_empty());
    // Next interval: more traffic, then destroyed.
    a.on_conntrack(1022, &ct(conn(), reply(), [12, 1000, 9, 5100], false, true));
    let reports = a.take_reports(1035, 100);
    assert_eq!(reports.len(), 2, "{reports:?}");
    let expected = |start, p_in, b_in, p_out, b_out, started, completed, live| FlowRecord {
        interval_start: start,
        source_ip: "10.65.0.2".into(),
        dest_ip: "10.65.1.3".into(),
        source_port: 40000,
        dest_port: 80,
        protocol: 6,
        reporter_dest: true,
        trace: vec![
            hit("PPI|security", "pass"),
            hit("API0|np/prod/web", "allow"),
        ],
        allowed: true,
        packets_in: p_in,
        packets_out: p_out,
        bytes_in: b_in,
        bytes_out: b_out,
        connections_started: started,
        connections_completed: completed,
        connections_live: live,
        // Not translated: no original destination.
        original_dest_ip: String::new(),
        original_dest_port: 0,
    };
    assert_eq!(
        reports[0],
        FlowReport {
            records: vec![expected(1005, 10, 900, 8, 5000, 1, 0, 1)],
            dropped: 0
        }
    );
    assert_eq!(
        reports[1],
        FlowReport {
            records: vec![expected(1020, 2, 100, 1, 100, 0, 1, 0)],
            dropped: 0
        }
    );
    assert_eq!(a.tracked(), 0, "a completed connection is forgotten");
}

#[test]
fn the_source_side_counts_the_reply_as_received() {
    let mut a = FlowAggregator::new(settings());
    log(&mut a, 30, 2, "APE1|gnp/egress", conn(), 60);
    a.on_conntrack(31, &ct(conn(), reply(), [4, 400, 3, 3000], false, false));
    let r = &a.take_reports(45, 100)[0].records[0];
    assert!(!r.reporter_dest);
    assert_eq!(
        (r.packets_in, r.bytes_in, r.packets_out, r.bytes_out),
        (3, 3000, 4, 400)
    );
    assert_eq!(r.trace, vec![hit("APE1|gnp/egress", "allow")]);
}

#[test]
fn both_sides_on_one_node_give_two_records_and_dnat_is_seen_through() {
    let mut a = FlowAggregator::new(settings());
    // The client dialled the service; the policy saw the pod (after DNAT).
    log(&mut a, 0, 2, "APE0|gnp/out", conn(), 60);
    log(&mut a, 0, 1, "API0|gnp/in", conn(), 60);
    let orig = tcp(CLIENT, 40000, SERVICE, 8080);
    a.on_conntrack(1, &ct(orig, reply(), [2, 200, 1, 100], false, false));
    let reports = a.take_reports(15, 100);
    let recs = &reports[0].records;
    assert_eq!(recs.len(), 2);
    // Sorted by (tuple, reporter_dest): the source's record first.
    assert_eq!(
        (recs[0].reporter_dest, recs[1].reporter_dest),
        (false, true)
    );
    assert_eq!(recs[0].dest_ip, "10.65.1.3");
    assert_eq!(recs[0].dest_port, 80);
    assert_eq!((recs[0].packets_out, recs[0].packets_in), (2, 1));
    assert_eq!((recs[1].packets_in, recs[1].packets_out), (2, 1));
    // Both carry what the client addressed: it names the destination service.
    for r in recs {
        assert_eq!(
            (r.original_dest_ip.as_str(), r.original_dest_port),
            ("10.96.0.10", 8080)
        );
    }
}

#[test]
fn a_denied_connection_counts_its_logged_packets_and_is_never_live() {
    let mut a = FlowAggregator::new(settings());
    log(&mut a, 15, 1, "DPI|default", conn(), 60);
    // The SYN retransmitted: same trace, counted again.
    log(&mut a, 16, 1, "DPI|default", conn(), 60);
    let r = a.take_reports(30, 100);
    assert_eq!(
        r[0].records,
        vec![FlowRecord {
            interval_start: 15,
            source_ip: "10.65.0.2".into(),
            dest_ip: "10.65.1.3".into(),
            source_port: 40000,
            dest_port: 80,
            protocol: 6,
            reporter_dest: true,
            trace: vec![hit("DPI|default", "deny")],
            allowed: false,
            packets_in: 2,
            packets_out: 0,
            bytes_in: 120,
            bytes_out: 0,
            connections_started: 1,
            connections_completed: 0,
            connections_live: 0,
            original_dest_ip: String::new(),
            original_dest_port: 0,
        }]
    );
    // Another retransmission in the next interval: the same connection, not a new start.
    log(&mut a, 31, 1, "DPI|default", conn(), 60);
    let r = a.take_reports(45, 100);
    assert_eq!(
        (
            r[0].records[0].connections_started,
            r[0].records[0].packets_in
        ),
        (0, 1)
    );
    // Idle for 2 intervals: forgotten, no further records.
    assert!(a.take_reports(100, 100).is_empty());
    assert_eq!(a.tracked(), 0);
}

#[test]
fn an_open_connection_reports_live_while_conntrack_sees_it() {
    let mut a = FlowAggregator::new(settings());
    log(&mut a, 0, 1, "API0|np/a/b", conn(), 60);
    a.on_conntrack(5, &ct(conn(), reply(), [1, 60, 1, 60], false, false));
    // Polled again, nothing moved.
    a.on_conntrack(20, &ct(conn(), reply(), [1, 60, 1, 60], false, false));
    a.on_conntrack(35, &ct(conn(), reply(), [1, 60, 1, 60], false, false));
    let r = a.take_reports(45, 100);
    let summary: Vec<_> = r
        .iter()
        .flat_map(|r| &r.records)
        .map(|r| {
            (
                r.interval_start,
                r.packets_in,
                r.connections_started,
                r.connections_live,
            )
        })
        .collect();
    assert_eq!(summary, [(0, 1, 1, 1), (15, 0, 0, 1), (30, 0, 0, 1)]);
    // Unseen since 30: live in 45 and 60 (not yet idle for 2 intervals), then forgotten.
    let r = a.take_reports(90, 100);
    let starts: Vec<_> = r
        .iter()
        .flat_map(|r| &r.records)
        .map(|r| r.interval_start)
        .collect();
    assert_eq!(starts, [45]);
    assert_eq!(a.tracked(), 0);
}

#[test]
fn a_reused_tuple_starts_again_and_new_counters_are_not_subtracted() {
    let mut a = FlowAggregator::new(settings());
    log(&mut a, 0, 1, "API0|np/a/b", conn(), 60);
    a.on_conntrack(1, &ct(conn(), reply(), [5, 500, 5, 500], false, true));
    log(&mut a, 2, 1, "API0|np/a/b", conn(), 60);
    a.on_conntrack(3, &ct(conn(), reply(), [2, 100, 1, 50], true, false));
    let r = &a.take_reports(15, 100)[0].records[0];
    assert_eq!(
        (
            r.packets_in,
            r.bytes_in,
            r.connections_started,
            r.connections_completed,
            r.connections_live
        ),
        (7, 600, 2, 1, 1)
    );
    assert_eq!(r.trace.len(), 1);
}

#[test]
fn conntrack_entries_of_unlogged_connections_are_ignored() {
    let mut a = FlowAggregator::new(settings());
    a.on_conntrack(1, &ct(conn(), reply(), [5, 500, 5, 500], true, false));
    assert_eq!(a.tracked(), 0);
    assert!(a.take_reports(100, 100).is_empty());
}

#[test]
fn unknown_groups_and_prefixes_are_ignored_and_unresolved_rules_only_decide() {
    let mut a = FlowAggregator::new(settings());
    log(&mut a, 0, 3, "API0|x", conn(), 60);
    log(&mut a, 0, 1, "XPI0|x", conn(), 60);
    assert_eq!(a.tracked(), 0);
    a.on_nflog(
        0,
        &NflogEvent {
            group: 1,
            prefix: "DPI|gone",
            tuple: conn(),
            len: 40,
        },
        |_| None,
    );
    let r = &a.take_reports(15, 100)[0].records[0];
    assert_eq!(r.trace, vec![]);
    assert!(!r.allowed);
    assert_eq!(a.unresolved_total(), 1);
}

#[test]
fn the_connection_cap_drops_new_connections_and_counts_them() {
    let mut a = FlowAggregator::new(FlowSettings {
        max_connections: 2,
        ..settings()
    });
    for port in 1..=4 {
        log(&mut a, 0, 1, "API0|p", tcp(CLIENT, port, SERVER, 80), 60);
    }
    // Known connections still count.
    log(&mut a, 1, 1, "API0|p", tcp(CLIENT, 1, SERVER, 80), 60);
    assert_eq!(a.tracked(), 2);
    let r = a.take_reports(15, 100);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].records.len(), 2);
    assert_eq!(r[0].dropped, 2);
    assert_eq!(a.dropped_total(), 2);
    // Reported once.
    assert!(a.take_reports(16, 100).is_empty());
}

#[test]
fn the_queue_drops_the_oldest_records_and_reports_split_by_interval_and_size() {
    let mut a = FlowAggregator::new(FlowSettings {
        max_queued_records: 3,
        idle_intervals: 1,
        ..settings()
    });
    // Interval 0: two denied connections; interval 15: two more.
    for (t, port) in [(0, 1), (0, 2), (15, 3), (15, 4)] {
        log(
            &mut a,
            t,
            1,
            "DPI|default",
            tcp(CLIENT, port, SERVER, 80),
            60,
        );
    }
    let r = a.take_reports(30, 1);
    let shape: Vec<_> = r
        .iter()
        .map(|r| {
            (
                r.records
                    .iter()
                    .map(|x| (x.interval_start, x.source_port))
                    .collect::<Vec<_>>(),
                r.dropped,
            )
        })
        .collect();
    assert_eq!(
        shape,
        [(vec![(0, 2)], 1), (vec![(15, 3)], 0), (vec![(15, 4)], 0)]
    );
    // A dropped count with nothing queued goes alone.
    let mut a = FlowAggregator::new(FlowSettings {
        max_queued_records: 0,
        ..settings()
    });
    log(&mut a, 0, 1, "DPI|default", conn(), 60);
    assert_eq!(
        a.take_reports(15, 10),
        [FlowReport {
            records: vec![],
            dropped: 1
        }]
    );
}

#[test]
fn a_long_silence_closes_the_intervals_between_without_looping_over_them() {
    let mut a = FlowAggregator::new(settings());
    log(&mut a, 0, 1, "API0|p", conn(), 60);
    let r = a.take_reports(1_000_000_000, 100);
    let starts: Vec<_> = r
        .iter()
        .flat_map(|r| &r.records)
        .map(|r| r.interval_start)
        .collect();
    // Active in 0, then live (unobserved) in 15, then idle for 2 intervals: forgotten.
    assert_eq!(starts, [0, 15]);
}

#[test]
fn prefixes_parse_back_to_their_rules() {
    use Direction::{Egress, Ingress};
    assert_eq!(
        parse_prefix("API0|np/namespace1/default.policy"),
        Some((
            Action::Allow,
            RuleId::Policy {
                policy: "np/namespace1/default.policy".into(),
                direction: Ingress,
                index: 0
            }
        ))
    );
    assert_eq!(
        parse_prefix("PRE999|short.profile.name"),
        Some((
            Action::Pass,
            RuleId::Profile {
                profile: "short.profile.name".into(),
                direction: Egress,
                index: 999
            }
        ))
    );
    assert_eq!(
        parse_prefix("DPE|tier-1"),
        Some((
            Action::Deny,
            RuleId::EndOfTier {
                tier: "tier-1".into(),
                direction: Egress
            }
        ))
    );
    assert_eq!(
        parse_prefix("DRI"),
        Some((
            Action::Deny,
            RuleId::NoProfileMatched { direction: Ingress }
        ))
    );
    // Malformed: no index or name where one is needed, unknown letters, an index out of range.
    for bad in [
        "",
        "A",
        "API",
        "ARI|x",
        "XPI0|x",
        "AXI0|x",
        "APX0|x",
        "API0|",
        "APIx|y",
        "API-1|y",
        "ARI|tier",
        "API99999999999|p",
    ] {
        assert_eq!(parse_prefix(bad), None, "{bad:?}");
    }
    // Hashed (63 bytes): only the index names it.
    let hashed = "DPI88|gnp/_12IXaBPahNM7a7dZhI8zg6PStmHsgneYaax8LVSIq_RSTUVWXYZ0";
    assert_eq!(hashed.len(), HASHED_PREFIX_LEN);
    assert_eq!(parse_prefix(hashed), None);
}

#[test]
fn the_index_names_hashed_prefixes_as_the_renderer_wrote_them() {
    use crate::driver::linux::rules::nflog;
    let long = RuleId::Policy {
        policy: "gnp/abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0".into(),
        direction: Direction::Ingress,
        index: 88,
    };
    let short = RuleId::EndOfTier {
        tier: "default".into(),
        direction: Direction::Egress,
    };
    let mut idx = PrefixIndex::default();
    for id in [&long, &short] {
        for v in [
            nflog::Verdict::Allow,
            nflog::Verdict::Deny,
            nflog::Verdict::Pass,
        ] {
            idx.insert(nflog::for_rule(id, v).unwrap(), id.clone());
        }
    }
    assert_eq!(idx.len(), 3, "only the hashed ones are kept");
    let p = nflog::for_rule(&long, nflog::Verdict::Deny).unwrap();
    assert_eq!(idx.lookup(&p), Some((Action::Deny, long)));
    assert_eq!(idx.lookup("PPE|default"), Some((Action::Pass, short)));
    assert_eq!(
        idx.lookup("DPI88|gnp/_unknownhashxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx_RSTUVWXYZ0"),
        None
    );
}

#[test]
fn a_trace_is_bounded_and_repeats_are_kept_once() {
    let mut a = FlowAggregator::new(settings());
    for i in 0..70 {
        log(&mut a, 0, 1, &format!("PPI|tier{i}"), conn(), 60);
        log(&mut a, 0, 1, &format!("PPI|tier{i}"), conn(), 60);
    }
    let r = &a.take_reports(15, 100)[0].records[0];
    assert_eq!(r.trace.len(), MAX_TRACE);
    assert_eq!(r.trace[63], hit("PPI|tier63", "pass"));
}

#[test]
fn a_flood_of_new_connections_stays_within_the_caps_and_is_counted() {
    let mut a = FlowAggregator::new(FlowSettings {
        max_connections: 1000,
        max_queued_records: 1500,
        idle_intervals: 1,
    });
    // 20 000 new connections in each of three intervals (ports wrap: distinct sources).
    let mut logged = 0u64;
    for interval in 0..3i64 {
        for i in 0..20_000u32 {
            let src = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i + 20_000 * interval as u32));
            log(
                &mut a,
                interval * 15,
                1,
                "DPI|default",
                tcp(src, 1, SERVER, 80),
                60,
            );
            logged += 1;
            assert!(a.tracked() <= 1000);
        }
    }
    let reports = a.take_reports(45, MAX_RECORDS_PER_REPORT);
    let records: u64 = reports.iter().map(|r| r.records.len() as u64).sum();
    let dropped: u64 = reports.iter().map(|r| r.dropped).sum();
    // At most 1000 tracked per interval; the queue keeps the newest 1500 records.
    assert_eq!(records, 1500);
    assert_eq!(dropped, logged - 1500);
    assert!(
        reports
            .iter()
            .all(|r| r.records.len() <= MAX_RECORDS_PER_REPORT)
    );
    assert_eq!(
        reports
            .last()
            .unwrap()
            .records
            .last()
            .unwrap()
            .interval_start,
        30
    );
}

#[test]
fn a_busy_interval_is_split_into_reports_the_server_can_decode() {
    use felix_proto::prost::Message;
    let mut a = FlowAggregator::new(FlowSettings {
        max_connections: 5000,
        max_queued_records: 5000,
        ..settings()
    });
    // 3,000 connections in one interval, as a load test makes: about 75 KB of records, more
    // than the server's default 64 KiB per message.
    for port in 0..3000u16 {
        log(
            &mut a,
            0,
            1,
            "API0|np/prod/web",
            tcp(CLIENT, 10_000 + port, SERVER, 80),
            60,
        );
    }
    let reports = a.take_reports(15, MAX_RECORDS_PER_REPORT);
    let total: usize = reports.iter().map(|r| r.records.len()).sum();
    assert_eq!(total, 3000, "every record sent");
    assert!(reports.len() > 1);
    for r in &reports {
        // The report inside its FromDataplane wrapper: a few bytes more.
        assert!(
            r.encoded_len() + 16 <= 64 * 1024,
            "{} bytes in one report",
            r.encoded_len()
        );
        assert!(r.encoded_len() <= MAX_REPORT_BYTES);
    }
}
