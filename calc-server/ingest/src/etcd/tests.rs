//! The etcd front of the mirror: keys identify, values version, re-lists reconcile.

use super::*;
use crate::etcd::RESOURCE_PREFIX as P;
use crate::summary;
use calc_graph::graph::Update;
use calc_graph::manifest::RejectStage;
use calc_graph::model::Kind;

fn gnp(name: &str, selector: &str) -> String {
    format!(
        r#"{{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{{"name":"{name}"}},"spec":{{"selector":"{selector}"}}}}"#
    )
}

/// The stages of the rejections in `b` (what the adapter counts).
fn rejected(b: &Batch) -> Vec<RejectStage> {
    b.problems.iter().filter_map(|p| p.stage).collect()
}

#[test]
fn relist_sends_only_differences() {
    let mut m = Mirror::new();
    let (a, b, c) = (
        format!("{P}globalnetworkpolicies/a"),
        format!("{P}globalnetworkpolicies/b"),
        format!("{P}globalnetworkpolicies/c"),
    );
    let mut out = Batch::default();
    m.begin_list(());
    put(&mut m, &a, gnp("a", "all()").as_bytes(), &mut out);
    put(&mut m, &b, gnp("b", "all()").as_bytes(), &mut out);
    put(&mut m, &format!("{P}bgppeers/x"), b"{}", &mut out);
    m.sweep((), &mut out);
    assert_eq!(
        summary(&out),
        ["apply GlobalNetworkPolicy a", "apply GlobalNetworkPolicy b"]
    );
    assert_eq!(m.len(), 2);

    // Re-list: a unchanged, b changed, c new; a key missing from the list is deleted.
    let mut out = Batch::default();
    m.begin_list(());
    put(&mut m, &b, gnp("b", "has(x)").as_bytes(), &mut out);
    put(&mut m, &c, gnp("c", "all()").as_bytes(), &mut out);
    m.sweep((), &mut out);
    assert_eq!(
        summary(&out),
        [
            "apply GlobalNetworkPolicy b",
            "apply GlobalNetworkPolicy c",
            "delete GlobalNetworkPolicy a"
        ]
    );
    // Same list again: nothing at all.
    let mut out = Batch::default();
    m.begin_list(());
    put(&mut m, &b, gnp("b", "has(x)").as_bytes(), &mut out);
    put(&mut m, &c, gnp("c", "all()").as_bytes(), &mut out);
    m.sweep((), &mut out);
    assert!(out.updates.is_empty());
}

#[test]
fn a_rejected_value_keeps_the_last_good_one_and_is_counted_once() {
    let mut m = Mirror::new();
    let a = format!("{P}globalnetworkpolicies/a");
    let mut out = Batch::default();
    put(&mut m, &a, gnp("a", "all()").as_bytes(), &mut out);
    put(&mut m, &a, b"{oops", &mut out);
    assert_eq!(summary(&out), ["apply GlobalNetworkPolicy a"]);
    assert_eq!(out.problems.len(), 1);
    assert_eq!(out.problems[0].key, a);
    assert!(out.problems[0].held, "the last good version stays");
    assert_eq!(m.unusable(), (vec![a.clone()], vec![]));
    assert_eq!(rejected(&out), [RejectStage::Decode]);
    // A re-list that sees the same bad value reports nothing new and deletes nothing.
    let mut out = Batch::default();
    m.begin_list(());
    put(&mut m, &a, b"{oops", &mut out);
    m.sweep((), &mut out);
    assert!(out.updates.is_empty() && out.problems.is_empty());
    // A later valid value is applied; deleting the key deletes the resource.
    put(&mut m, &a, gnp("a", "has(y)").as_bytes(), &mut out);
    assert_eq!(m.unusable(), (vec![], vec![]));
    m.delete(a.as_str(), &mut out);
    assert_eq!(
        summary(&out),
        [
            "apply GlobalNetworkPolicy a",
            "delete GlobalNetworkPolicy a"
        ]
    );
    // A key that was only ever bad deletes nothing.
    let mut out = Batch::default();
    let b = format!("{P}globalnetworkpolicies/b");
    put(&mut m, &b, b"[]", &mut out);
    m.delete(b.as_str(), &mut out);
    assert!(out.updates.is_empty());
}

#[test]
fn two_keys_naming_one_policy() {
    let mut m = Mirror::new();
    let legacy = format!("{P}globalnetworkpolicies/default.p");
    let new = format!("{P}globalnetworkpolicies/p");
    let mut out = Batch::default();
    put(&mut m, &new, gnp("p", "all()").as_bytes(), &mut out);
    put(
        &mut m,
        &legacy,
        gnp("default.p", "has(old)").as_bytes(),
        &mut out,
    );
    assert_eq!(
        summary(&out),
        ["apply GlobalNetworkPolicy p", "apply GlobalNetworkPolicy p"]
    );
    // The legacy key goes: the graph holds its version, so `p`'s must be re-sent.
    let mut out = Batch::default();
    m.delete(legacy.as_str(), &mut out);
    assert!(out.updates.is_empty());
    assert_eq!(m.take_relists().len(), 1, "a re-list restores p");
    let mut out = Batch::default();
    m.begin_list(());
    put(&mut m, &new, gnp("p", "all()").as_bytes(), &mut out);
    m.sweep((), &mut out);
    assert_eq!(summary(&out), ["apply GlobalNetworkPolicy p"]);
    assert!(m.take_relists().is_empty());
    // The last key goes: the policy is deleted.
    let mut out = Batch::default();
    m.delete(new.as_str(), &mut out);
    assert_eq!(summary(&out), ["delete GlobalNetworkPolicy p"]);
}

#[test]
fn a_value_that_renames_its_resource_deletes_the_old_name() {
    let mut m = Mirror::new();
    let key = format!("{P}globalnetworkpolicies/default.q");
    let mut out = Batch::default();
    put(&mut m, &key, gnp("default.q", "all()").as_bytes(), &mut out);
    let annotated = r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"default.q","annotations":{"projectcalico.org/metadata":"{\"name\":\"renamed\"}"}},"spec":{"selector":"all()"}}"#;
    put(&mut m, &key, annotated.as_bytes(), &mut out);
    assert_eq!(
        summary(&out),
        [
            "apply GlobalNetworkPolicy q",
            "delete GlobalNetworkPolicy q",
            "apply GlobalNetworkPolicy renamed"
        ]
    );
    assert!(
        matches!(&out.updates[2], Update::ApplyValid(r) if r.kind() == Kind::GlobalNetworkPolicy)
    );
}

/// After a restart the mirror knows only the bad value; the caller finds an earlier valid
/// one in etcd's history and adopts it: applied, the bad value still remembered (a re-list
/// sends nothing), and a later valid value replaces it.
#[test]
fn a_last_good_version_from_history_is_adopted_for_a_rejected_key_only() {
    let mut m = Mirror::new();
    let a = format!("{P}globalnetworkpolicies/a");
    let b = format!("{P}globalnetworkpolicies/b");
    let mut out = Batch::default();
    m.begin_list(());
    put(&mut m, &a, b"{oops", &mut out);
    put(&mut m, &b, gnp("b", "all()").as_bytes(), &mut out);
    assert!(!out.problems[0].held, "nothing to hold yet");
    assert!(m.is_rejected_without_last_good(a.as_str()));
    assert_eq!(m.unusable(), (vec![], vec![a.clone()]));
    // Neither an invalid old version nor a valid key's takes effect.
    assert!(!adopt_last_good(&mut m, &a, b"[]", &mut out));
    assert!(!adopt_last_good(
        &mut m,
        &b,
        gnp("b", "has(x)").as_bytes(),
        &mut out
    ));
    assert!(adopt_last_good(
        &mut m,
        &a,
        gnp("a", "has(x)").as_bytes(),
        &mut out
    ));
    assert!(
        !adopt_last_good(&mut m, &a, gnp("a", "all()").as_bytes(), &mut out),
        "once"
    );
    m.sweep((), &mut out);
    assert_eq!(
        summary(&out),
        ["apply GlobalNetworkPolicy b", "apply GlobalNetworkPolicy a"]
    );
    assert_eq!(m.unusable(), (vec![a.clone()], vec![]));
    assert_eq!(m.take_unusable(), Some((vec![a.clone()], vec![])));

    let mut out = Batch::default();
    m.begin_list(());
    put(&mut m, &a, b"{oops", &mut out);
    put(&mut m, &b, gnp("b", "all()").as_bytes(), &mut out);
    m.sweep((), &mut out);
    assert!(out.updates.is_empty() && out.problems.is_empty());
    assert_eq!(
        m.take_unusable(),
        None,
        "nothing changed: nothing to publish"
    );

    put(&mut m, &a, gnp("a", "all()").as_bytes(), &mut out);
    assert_eq!(summary(&out), ["apply GlobalNetworkPolicy a"]);
    assert_eq!(m.take_unusable(), Some((vec![], vec![])), "repaired");
    // A key only ever bad, then deleted, leaves the lists too.
    let c = format!("{P}globalnetworkpolicies/c");
    put(&mut m, &c, b"[]", &mut out);
    assert_eq!(m.take_unusable(), Some((vec![], vec![c.clone()])));
    m.delete(c.as_str(), &mut out);
    assert_eq!(m.take_unusable(), Some((vec![], vec![])));
}

/// A deny policy overwritten by a value that does not say what it is (`{}`, or metadata and
/// spec without kind and apiVersion, as an etcdctl put can write): the value is rejected and
/// the deny stays in force; nothing is sent until a valid value or the key's deletion.
#[test]
fn a_value_without_kind_and_api_version_keeps_the_deny_in_force() {
    let deny = r#"{"kind":"GlobalNetworkPolicy","apiVersion":"projectcalico.org/v3","metadata":{"name":"rel-guard"},"spec":{"selector":"all()","types":["Ingress"],"ingress":[{"action":"Deny"}]}}"#;
    for bad in [
        "{}",
        r#"{"metadata":{"name":"rel-guard"},"spec":{}}"#,
        r#"{"kind":"GlobalNetworkPolicy","metadata":{"name":"rel-guard"},"spec":{}}"#,
        r#"{"apiVersion":"projectcalico.org/v3","metadata":{"name":"rel-guard"},"spec":{}}"#,
    ] {
        let mut m = Mirror::new();
        let key = format!("{P}globalnetworkpolicies/rel-guard");
        let mut out = Batch::default();
        put(&mut m, &key, deny.as_bytes(), &mut out);
        assert_eq!(summary(&out), ["apply GlobalNetworkPolicy rel-guard"]);
        let mut out = Batch::default();
        put(&mut m, &key, bad.as_bytes(), &mut out);
        assert!(out.updates.is_empty(), "{bad}: {:?}", summary(&out));
        assert_eq!(rejected(&out), [RejectStage::Decode], "{bad}");
        assert!(out.problems[0].held, "{bad}: the deny stays");
        assert_eq!(m.unusable(), (vec![key.clone()], vec![]));
        // A re-list sees the same bad value: still nothing sent, nothing swept.
        let mut out = Batch::default();
        m.begin_list(());
        put(&mut m, &key, bad.as_bytes(), &mut out);
        m.sweep((), &mut out);
        assert!(out.updates.is_empty(), "{bad}");
        // After a restart the history's valid version is adopted.
        let mut m = Mirror::new();
        let mut out = Batch::default();
        put(&mut m, &key, bad.as_bytes(), &mut out);
        assert!(out.updates.is_empty(), "{bad}");
        assert!(adopt_last_good(&mut m, &key, deny.as_bytes(), &mut out));
        assert_eq!(summary(&out), ["apply GlobalNetworkPolicy rel-guard"]);
    }
}

/// A page put on several threads gives what putting its keys one by one gives: the same
/// updates and problems in the same order, an unchanged value not decided again, a key put
/// twice in one page (a watch response) ending at its last value.
#[test]
fn a_page_decoded_on_several_threads_is_put_as_one_by_one() {
    let mut page: Vec<(String, Vec<u8>)> = (0..1500)
        .map(|i| {
            let key = format!("{P}globalnetworkpolicies/p{i}");
            let value = match i % 100 {
                7 => b"{not json".to_vec(),
                8 => gnp(&format!("p{i}"), "has(").into_bytes(),
                _ => gnp(&format!("p{i}"), &format!("app == 'a{i}'")).into_bytes(),
            };
            (key, value)
        })
        .collect();
    page.push((format!("{P}bgppeers/x"), b"{}".to_vec()));
    page.push((
        format!("{P}globalnetworkpolicies/p3"),
        gnp("p3", "all()").into_bytes(),
    ));
    let pairs: Vec<(&str, &[u8])> = page
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect();

    let mut one_by_one = (Mirror::new(), Batch::default());
    for (k, v) in &pairs {
        put(&mut one_by_one.0, k, v, &mut one_by_one.1);
    }
    let mut many = (Mirror::new(), Batch::default());
    let mut seen = Vec::new();
    put_many(&mut many.0, &pairs, 3, &mut many.1, |i, out| {
        seen.push((i, out.updates.len()))
    });
    assert_eq!(summary(&many.1), summary(&one_by_one.1));
    assert_eq!(rejected(&many.1), rejected(&one_by_one.1));
    assert_eq!(rejected(&many.1).len(), 30);
    assert_eq!(seen.len(), pairs.len());
    assert!(seen.iter().enumerate().all(|(n, (i, _))| n == *i));
    assert_eq!(many.0.len(), one_by_one.0.len());

    // The same page again, less p3's first value: every value is current, nothing is decided
    // or sent.
    let again_pairs: Vec<(&str, &[u8])> = pairs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(_, kv)| *kv)
        .collect();
    let mut again = Batch::default();
    put_many(&mut many.0, &again_pairs, 3, &mut again, |_, _| {});
    assert!(again.updates.is_empty() && again.problems.is_empty());
}
