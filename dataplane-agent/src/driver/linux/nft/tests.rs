//! The nftables writer against a recording `nft`: what each apply writes, and only that.

use std::sync::Arc;

use parking_lot::Mutex;

use super::*;
use crate::driver::linux::desired::{SetKind, Sets};
use crate::driver::linux::rules::static_chains::Hooks;
use crate::driver::linux::rules::{Action, Chain, Match, Rule};
use crate::driver::linux::runner::Output;

/// Answers `nft -j list table` with `listing` (absent table when `None`) and records every
/// `nft -f -` transaction; fails them while `fail` is set.
#[derive(Clone, Default)]
struct FakeNft {
    listing: Arc<Mutex<Option<String>>>,
    scripts: Arc<Mutex<Vec<String>>>,
    lists: Arc<Mutex<usize>>,
    fail: Arc<Mutex<bool>>,
    /// `nft -j list table <family> calico` fails for this family.
    fail_list: Arc<Mutex<Option<&'static str>>>,
}

impl CommandRunner for FakeNft {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> std::io::Result<Output> {
        assert_eq!(program, "nft");
        if args.first() == Some(&"-j") {
            *self.lists.lock() += 1;
            let family = args[3];
            if *self.fail_list.lock() == Some(family) {
                return Ok(Output {
                    success: false,
                    stderr: b"Error: Operation not permitted".to_vec(),
                    ..Output::default()
                });
            }
            return Ok(match &*self.listing.lock() {
                Some(json) if family == "ip" => Output {
                    success: true,
                    stdout: json.clone().into_bytes(),
                    ..Output::default()
                },
                _ => Output {
                    success: false,
                    stderr: b"Error: No such file or directory".to_vec(),
                    ..Output::default()
                },
            });
        }
        assert_eq!(args, ["-f", "-"]);
        self.scripts
            .lock()
            .push(String::from_utf8(stdin.unwrap().to_vec()).unwrap());
        let fail = *self.fail.lock();
        Ok(Output {
            success: !fail,
            stderr: if fail {
                b"Error: boom".to_vec()
            } else {
                vec![]
            },
            ..Output::default()
        })
    }
}

impl FakeNft {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.scripts.lock())
    }
}

/// Records the nfnetlink batches it accepts; refuses them while `fail` is set, and those
/// holding more than element changes while `elements_only` is set (so that the tests of
/// planning read the same transaction as `nft -f` text).
#[derive(Clone, Default)]
struct FakeBatch {
    batches: Arc<Mutex<Vec<Vec<Op>>>>,
    fail: Arc<Mutex<bool>>,
    elements_only: Arc<Mutex<bool>>,
}

impl netlink::BatchWriter for FakeBatch {
    fn write(&mut self, ops: &[Op]) -> std::io::Result<std::time::Duration> {
        let structural = ops.iter().any(|o| !matches!(o, Op::Elements(_)));
        if *self.fail.lock() || (structural && *self.elements_only.lock()) {
            return Err(std::io::Error::from_raw_os_error(22));
        }
        self.batches.lock().push(ops.to_vec());
        Ok(std::time::Duration::ZERO)
    }
}

impl FakeBatch {
    fn text_for_structure() -> Self {
        let b = Self::default();
        *b.elements_only.lock() = true;
        b
    }
}

/// The rules a transaction writes into `chain` of `table <family> calico` (nft's block
/// syntax: one statement per line, blocks closed by a lone `}`).
fn chain_rules<'a>(script: &'a str, family: &str, chain: &str) -> Vec<&'a str> {
    let table = format!("table {family} calico {{");
    let start = format!("chain {chain} {{");
    let mut out = Vec::new();
    // The blocks open at this line: table, then chain.
    let mut open: Vec<&str> = Vec::new();
    for line in script.lines() {
        if line.ends_with('{') {
            open.push(line);
        } else if line == "}" {
            open.pop();
        } else if open.as_slice() == [table.as_str(), start.as_str()] {
            out.push(line);
        }
    }
    out
}

struct World {
    nft: FakeNft,
    elements: FakeBatch,
    writer: NftTables,
    tables: Tables,
    sets: Sets,
}

impl World {
    fn new() -> Self {
        let v = [IpVersion::V4];
        let mut tables = Tables::new(&v);
        let mut hooks = Hooks::default();
        hooks.inserts.insert(
            "FORWARD".into(),
            vec![Rule::always(Action::Jump("cali-FORWARD".into()))],
        );
        tables.table(IpVersion::V4, "filter").set_hooks(hooks);
        tables.table(IpVersion::V4, "filter").set_chain(Chain::new(
            "cali-FORWARD",
            vec![
                Rule::new(
                    Match::new().in_iface("cali+"),
                    Action::Jump(FROM_WL_DISPATCH.into()),
                ),
                Rule::new(
                    Match::new().out_iface("cali+"),
                    Action::Jump(TO_WL_DISPATCH.into()),
                ),
            ],
        ));
        let elements = FakeBatch::text_for_structure();
        let mut w = World {
            nft: FakeNft::default(),
            writer: NftTables::with_batch(&v, Box::new(elements.clone())),
            elements,
            tables,
            sets: Sets::new(v.to_vec()),
        };
        w.dispatch(&["calia", "calib"]);
        w.policy("web", "10.0.0.0/8");
        w.sets.replace(
            "s:db",
            SetKind::Net,
            &["10.1.0.0/16".into(), "10.2.0.1".into()],
        );
        w
    }

    fn dispatch(&mut self, ifaces: &[&str]) {
        let ifaces: Vec<String> = ifaces.iter().map(|s| (*s).to_owned()).collect();
        let [from, to] = crate::driver::linux::rules::static_chains::workload_dispatch(&ifaces);
        let t = self.tables.table(IpVersion::V4, "filter");
        t.set_chain(from);
        t.set_chain(to);
        for i in &ifaces {
            t.set_chain(Chain::new(
                format!("cali-fw-{i}"),
                vec![Rule::always(Action::Accept)],
            ));
            t.set_chain(Chain::new(
                format!("cali-tw-{i}"),
                vec![Rule::always(Action::Accept)],
            ));
        }
    }

    fn policy(&mut self, name: &str, src: &str) {
        self.tables
            .table(IpVersion::V4, "filter")
            .set_chain(Chain::new(
                format!("cali-pi-{name}"),
                vec![
                    Rule::new(
                        Match::new()
                            .src_net(src)
                            .src_set("cali40s:db")
                            .protocol("tcp")
                            .dst_ports("80,443"),
                        Action::SetMark(0x10000),
                    )
                    .comment("allow web"),
                ],
            ));
    }

    /// The last element batch: (add, set, elements) per op; every op of an interval set.
    fn last_batch(&self) -> Vec<(bool, String, Vec<String>)> {
        let batches = self.elements.batches.lock();
        let last: Vec<&netlink::ElementOp> = batches
            .last()
            .expect("a batch")
            .iter()
            .map(|o| match o {
                Op::Elements(e) => e,
                other => panic!("not an element change: {other:?}"),
            })
            .collect();
        assert!(
            last.iter()
                .all(|o| o.interval == o.set.starts_with("cali40s-db"))
        );
        last.iter()
            .map(|o| (o.add, o.set.clone(), o.elems.clone()))
            .collect()
    }

    fn apply(&mut self) -> Result<NftStats, NftError> {
        let mut runner = self.nft.clone();
        self.writer
            .apply(&mut runner, &mut self.tables, &mut self.sets)
    }
}

#[test]
fn the_first_apply_builds_everything_in_one_transaction_and_the_next_writes_nothing() {
    let mut w = World::new();
    let st = w.apply().unwrap();
    assert!(st.read_back);
    let scripts = w.nft.take();
    assert_eq!(scripts.len(), 1, "one transaction for the whole state");
    let s = &scripts[0];
    assert!(s.starts_with("add table ip calico\n"), "{s}");
    assert!(
        s.contains(
            "add chain ip calico filter-FORWARD { type filter hook forward priority 0; policy accept; }"
        ),
        "{s}"
    );
    assert!(
        s.contains("set cali40s-db { type ipv4_addr; flags interval; elements = { 10.1.0.0/16, 10.2.0.1 } }"),
        "{s}"
    );
    assert!(
        s.contains("table ip calico {\nset cali40s-db {"),
        "new sets are declared in a block: {s}"
    );
    assert!(
        s.contains(
            "add element ip calico filter-cali-from-wl-dispatch { \"calia\" : goto filter-cali-fw-calia, \"calib\" : goto filter-cali-fw-calib }"
        ),
        "{s}"
    );
    assert!(
        chain_rules(s, "ip", "filter-cali-from-wl-dispatch")[0]
            .starts_with("iifname vmap @filter-cali-from-wl-dispatch comment"),
        "{s}"
    );
    assert!(
        chain_rules(s, "ip", "filter-cali-FORWARD")[0].starts_with(
            "iifname \"cali*\" counter jump filter-cali-from-wl-dispatch comment \"cali:"
        ),
        "{s}"
    );
    // The port list became one rule per port, each with the rule's comment.
    assert_eq!(chain_rules(s, "ip", "filter-cali-pi-web").len(), 2);
    assert!(s.contains("; allow web\""), "{s}");
    // Declarations come before the rules that use them.
    let decl = s.find("add chain ip calico filter-cali-fw-calia").unwrap();
    let user = s.find(": goto filter-cali-fw-calia").unwrap();
    assert!(decl < user);

    assert_eq!(w.apply().unwrap(), NftStats::default());
    assert!(w.nft.take().is_empty(), "nothing changed, nothing written");
}

#[test]
fn a_change_writes_only_what_changed() {
    let mut w = World::new();
    w.apply().unwrap();
    w.nft.take();

    // One member: element commands only.
    w.sets
        .delta("s:db", &["10.3.0.1".into()], &["10.2.0.1".into()]);
    let st = w.apply().unwrap();
    assert_eq!(
        (st.elements_added, st.elements_removed, st.chains_written),
        (1, 1, 0)
    );
    assert!(st.via_netlink && w.nft.take().is_empty());
    assert_eq!(
        w.last_batch(),
        [
            (false, "cali40s-db".to_owned(), vec!["10.2.0.1".to_owned()]),
            (true, "cali40s-db".to_owned(), vec!["10.3.0.1".to_owned()])
        ]
    );

    // One policy: that chain flushed and rewritten.
    w.policy("web", "10.9.0.0/16");
    w.apply().unwrap();
    let s = w.nft.take().join("");
    assert!(
        s.starts_with("flush chain ip calico filter-cali-pi-web\ntable ip calico {\nchain filter-cali-pi-web {\n"),
        "{s}"
    );
    let rules = chain_rules(&s, "ip", "filter-cali-pi-web");
    assert_eq!(rules.len(), 2);
    assert!(
        rules.iter().all(|r| r.contains("ip saddr 10.9.0.0/16")),
        "{s}"
    );
    assert_eq!(s.lines().count(), 1 + 2 + 2 + 2, "nothing else: {s}");

    // An endpoint goes: map elements and its chains, the dispatch chain untouched.
    let t = w.tables.table(IpVersion::V4, "filter");
    t.remove_chain("cali-fw-calib");
    t.remove_chain("cali-tw-calib");
    w.dispatch(&["calia"]);
    let st = w.apply().unwrap();
    assert_eq!(st.chains_written, 0, "{st:?}");
    assert_eq!(st.chains_deleted, 2);
    let s = w.nft.take().join("");
    let del_elem = s
        .find("delete element ip calico filter-cali-from-wl-dispatch { \"calib\" : goto filter-cali-fw-calib }")
        .expect(&s);
    let del_chain = s
        .find("delete chain ip calico filter-cali-fw-calib")
        .expect(&s);
    assert!(
        del_elem < del_chain,
        "the map lets go of the chain first: {s}"
    );
    assert!(s.contains("flush chain ip calico filter-cali-fw-calib"));
}

#[test]
fn nested_networks_are_left_out_of_interval_sets() {
    let mut w = World::new();
    w.sets.replace(
        "s:db",
        SetKind::Net,
        &["10.0.0.0/8".into(), "10.1.0.0/16".into(), "11.0.0.1".into()],
    );
    w.apply().unwrap();
    let s = w.nft.take().join("");
    assert!(s.contains("elements = { 10.0.0.0/8, 11.0.0.1 }"), "{s}");
    // The covering network goes: the one it hid is added in the same transaction.
    w.sets.delta("s:db", &[], &["10.0.0.0/8".into()]);
    w.apply().unwrap();
    assert_eq!(
        w.last_batch(),
        [
            (
                false,
                "cali40s-db".to_owned(),
                vec!["10.0.0.0/8".to_owned()]
            ),
            (
                true,
                "cali40s-db".to_owned(),
                vec!["10.1.0.0/16".to_owned()]
            )
        ]
    );
}

#[test]
fn a_failed_transaction_is_read_back_and_written_again() {
    let mut w = World::new();
    *w.nft.fail.lock() = true;
    assert!(matches!(w.apply(), Err(NftError::Failed { .. })));
    *w.nft.fail.lock() = false;
    let lists = *w.nft.lists.lock();
    let st = w.apply().unwrap();
    assert!(st.read_back);
    assert_eq!(*w.nft.lists.lock(), lists + 1);
    assert_eq!(w.nft.take().len(), 2, "the failed one and its retry");
}

#[test]
fn a_refresh_repairs_drift_and_removes_what_is_not_ours() {
    let mut w = World::new();
    w.apply().unwrap();
    w.nft.take();
    // The kernel as an operator left it: the policy chain lost its rules, a member is gone,
    // a chain and a set nobody wants were added; the rest is as we wrote it.
    let hashes: Vec<String> = w.writer.families[0].rendered["filter-cali-FORWARD"]
        .hashes
        .clone();
    let rule = |chain: &str, h: &str| {
        format!(
            r#"{{"rule": {{"family": "ip", "table": "calico", "chain": "{chain}", "comment": "cali:{h};"}}}}"#
        )
    };
    let mut items = vec![
        r#"{"table": {"family": "ip", "name": "calico"}}"#.to_owned(),
        r#"{"chain": {"family": "ip", "table": "calico", "name": "filter-cali-FORWARD"}}"#.to_owned(),
        r#"{"chain": {"family": "ip", "table": "calico", "name": "filter-cali-pi-web"}}"#.to_owned(),
        r#"{"chain": {"family": "ip", "table": "calico", "name": "stray"}}"#.to_owned(),
        r#"{"set": {"family": "ip", "name": "cali40s-db", "table": "calico", "type": "ipv4_addr", "flags": ["interval"], "elem": [{"prefix": {"addr": "10.1.0.0", "len": 16}}]}}"#.to_owned(),
        r#"{"set": {"family": "ip", "name": "stray-set", "table": "calico", "type": ["ipv4_addr", "inet_proto", "inet_service"], "elem": [{"concat": ["10.0.0.1", "tcp", 80]}]}}"#.to_owned(),
    ];
    items.extend(hashes.iter().map(|h| rule("filter-cali-FORWARD", h)));
    *w.nft.listing.lock() = Some(format!(r#"{{"nftables": [{}]}}"#, items.join(", ")));
    w.writer.invalidate();
    let st = w.apply().unwrap();
    assert!(st.read_back);
    let s = w.nft.take().join("");
    assert!(
        s.contains("add element ip calico cali40s-db { 10.2.0.1 }"),
        "{s}"
    );
    assert!(
        s.contains("flush chain ip calico filter-cali-pi-web"),
        "{s}"
    );
    assert!(s.contains("delete chain ip calico stray"), "{s}");
    assert!(s.contains("delete set ip calico stray-set"), "{s}");
    assert!(
        !s.contains("flush chain ip calico filter-cali-FORWARD"),
        "intact: {s}"
    );
    assert!(!s.contains("add table"), "the table exists: {s}");
}

#[test]
fn the_listing_parser_reads_what_nft_prints() {
    let json = br#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
      {"table": {"family": "ip", "name": "calico", "handle": 1}},
      {"map": {"family": "ip", "name": "filter-cali-from-wl-dispatch", "table": "calico", "type": "ifname", "handle": 4, "map": "verdict", "elem": [["cali1", {"goto": {"target": "filter-cali-fw-cali1"}}]]}},
      {"set": {"family": "ip", "name": "s", "table": "calico", "type": "ipv4_addr", "flags": ["interval"], "elem": [{"prefix": {"addr": "10.0.0.0", "len": 24}}, "10.1.0.1", {"range": ["10.2.0.1", "10.2.0.9"]}]}},
      {"rule": {"family": "ip", "table": "calico", "chain": "c", "handle": 7, "comment": "cali:abcd; x"}},
      {"rule": {"family": "ip", "table": "calico", "chain": "c", "handle": 8}}]}"#;
    let v = parse_listing(json).unwrap();
    assert_eq!(v.chains["c"], ["abcd", ""]);
    assert_eq!(
        v.sets["filter-cali-from-wl-dispatch"].decl,
        "ifname : verdict"
    );
    assert!(
        v.sets["filter-cali-from-wl-dispatch"]
            .elems
            .contains("\"cali1\" : goto filter-cali-fw-cali1")
    );
    let s = &v.sets["s"];
    assert_eq!(s.decl, "ipv4_addr interval");
    for e in ["10.0.0.0/24", "10.1.0.1", "10.2.0.1-10.2.0.9"] {
        assert!(s.elems.contains(e), "{e}");
    }
    assert!(parse_listing(b"{}").is_err());
}

#[test]
fn exact_key_element_changes_go_over_netlink_and_fall_back_to_nft() {
    let mut w = World::new();
    w.sets.replace("s:pods", SetKind::Ip, &["10.0.0.1".into()]);
    w.apply().unwrap();
    w.nft.take();
    assert!(
        w.elements.batches.lock().is_empty(),
        "creating sets is structural"
    );

    w.sets
        .delta("s:pods", &["10.0.0.2".into()], &["10.0.0.1".into()]);
    let st = w.apply().unwrap();
    assert!(st.via_netlink);
    assert!(w.nft.take().is_empty(), "no nft -f for an element change");
    let batches = w.elements.batches.lock().clone();
    assert_eq!(batches.len(), 1);
    let ops: Vec<(bool, &str, &[String])> = batches[0]
        .iter()
        .map(|o| match o {
            Op::Elements(o) => (o.add, o.set.as_str(), o.elems.as_slice()),
            other => panic!("not an element change: {other:?}"),
        })
        .collect();
    assert_eq!(
        ops,
        [
            (false, "cali40s-pods", &["10.0.0.1".to_owned()][..]),
            (true, "cali40s-pods", &["10.0.0.2".to_owned()][..])
        ]
    );

    // The kernel refuses the batch: the same change goes by nft -f.
    *w.elements.fail.lock() = true;
    w.sets.delta("s:pods", &["10.0.0.3".into()], &[]);
    let st = w.apply().unwrap();
    assert!(!st.via_netlink);
    assert_eq!(
        w.nft.take(),
        ["add element ip calico cali40s-pods { 10.0.0.3 }\n"]
    );
}

#[test]
fn a_failed_read_back_leaves_no_family_planned_ahead_of_the_kernel() {
    let both = IpVersion::BOTH;
    let nft = FakeNft::default();
    let mut writer = NftTables::with_batch(&both, Box::new(FakeBatch::text_for_structure()));
    let mut tables = Tables::new(&both);
    let mut sets = Sets::new(both.to_vec());
    for v in both {
        tables.table(v, "filter").set_chain(Chain::new(
            "cali-pi-web",
            vec![Rule::always(Action::Accept)],
        ));
    }
    // IPv6 cannot be read: nothing is written, and IPv4 is not left planned.
    *nft.fail_list.lock() = Some("ip6");
    assert!(matches!(
        writer.apply(&mut nft.clone(), &mut tables, &mut sets),
        Err(NftError::Failed { .. })
    ));
    assert!(nft.take().is_empty());
    *nft.fail_list.lock() = None;
    let st = writer
        .apply(&mut nft.clone(), &mut tables, &mut sets)
        .unwrap();
    assert!(st.read_back);
    let s = nft.take().join("");
    for fam in ["ip", "ip6"] {
        assert_eq!(
            chain_rules(&s, fam, "filter-cali-pi-web").len(),
            1,
            "{fam}: {s}"
        );
    }
}

/// An op's kind and the object it names, for comparing batches.
fn op_summary(op: &Op) -> String {
    match op {
        Op::NewTable(_) => "new table".into(),
        Op::NewChain { name, hook, .. } => match hook {
            Some(h) => format!("new base chain {name} ({} {})", h.hook, h.priority),
            None => format!("new chain {name}"),
        },
        Op::FlushChain { name, .. } => format!("flush {name}"),
        Op::DelChain { name, .. } => format!("delete chain {name}"),
        Op::Rule { chain, .. } => format!("rule in {chain}"),
        Op::NewSet { name, kind, .. } => format!("new set {name} {kind:?}"),
        Op::DelSet { name, .. } => format!("delete set {name}"),
        Op::Elements(e) => format!(
            "{} {} elements of {}",
            if e.add { "add" } else { "delete" },
            e.elems.len(),
            e.set
        ),
    }
}

#[test]
fn every_change_goes_as_one_netlink_batch_in_dependency_order() {
    let mut w = World::new();
    *w.elements.elements_only.lock() = false;
    let st = w.apply().unwrap();
    assert!(st.via_netlink && st.read_back, "{st:?}");
    assert!(w.nft.take().is_empty(), "no nft -f");
    let first: Vec<String> = w.elements.batches.lock()[0]
        .iter()
        .map(op_summary)
        .collect();
    let at = |what: &str| {
        first
            .iter()
            .position(|o| o == what)
            .unwrap_or_else(|| panic!("{what} in {first:#?}"))
    };
    assert_eq!(first[0], "new table");
    // Declarations (chains, the map, the sets with their elements), then the rules.
    assert!(at("new base chain filter-FORWARD (forward 0)") < at("rule in filter-FORWARD"));
    assert!(at("new set cali40s-db Net") < at("add 2 elements of cali40s-db"));
    assert!(
        at("new chain filter-cali-fw-calia") < at("add 2 elements of filter-cali-from-wl-dispatch")
    );
    assert!(at("add 2 elements of cali40s-db") < at("rule in filter-cali-pi-web"));
    assert_eq!(
        first
            .iter()
            .filter(|o| *o == "rule in filter-cali-pi-web")
            .count(),
        2,
        "one rule per port"
    );

    // A policy change: that chain flushed and written again, nothing else.
    w.policy("web", "10.9.0.0/16");
    let st = w.apply().unwrap();
    assert!(st.via_netlink && st.chains_written == 1, "{st:?}");
    let change: Vec<String> = w.elements.batches.lock()[1]
        .iter()
        .map(op_summary)
        .collect();
    assert_eq!(
        change,
        [
            "flush filter-cali-pi-web",
            "rule in filter-cali-pi-web",
            "rule in filter-cali-pi-web"
        ]
    );
    // Its rules carry the comment nft lists (the hash the read back compares).
    let second = w.elements.batches.lock()[1][1].clone();
    let Op::Rule { userdata, .. } = &second else {
        panic!("a rule")
    };
    assert_eq!(userdata[0], 0, "a comment TLV");
    assert!(
        String::from_utf8_lossy(userdata).contains("; allow web"),
        "{userdata:?}"
    );

    // A workload gone: its chains deleted after the map lost its element.
    w.dispatch(&["calia"]);
    w.tables
        .table(IpVersion::V4, "filter")
        .remove_chain("cali-fw-calib");
    w.tables
        .table(IpVersion::V4, "filter")
        .remove_chain("cali-tw-calib");
    w.apply().unwrap();
    let gone: Vec<String> = w.elements.batches.lock()[2]
        .iter()
        .map(op_summary)
        .collect();
    let at = |what: &str| {
        gone.iter()
            .position(|o| o == what)
            .unwrap_or_else(|| panic!("{what} in {gone:#?}"))
    };
    assert!(
        at("delete 1 elements of filter-cali-from-wl-dispatch")
            < at("delete chain filter-cali-fw-calib")
    );
    assert!(at("flush filter-cali-fw-calib") < at("delete chain filter-cali-fw-calib"));
    assert!(w.nft.take().is_empty());
}

/// The nftables writer maps a rule back to its rule id by position (a rule split per port
/// counts once per kernel rule) and by comment, and nothing in its dispatch map lookups.
#[test]
fn kernel_rules_map_back_to_their_rule_ids() {
    use crate::driver::linux::RuleAt;
    use crate::driver::linux::rules::RuleId;
    use crate::driver::linux::rules::endpoint::Direction;
    use crate::driver::linux::writer::{KernelWriter, NftWriter};

    let mut w = World::new();
    let id = |index| RuleId::Policy {
        policy: "gnp/ids".into(),
        direction: Direction::Ingress,
        index,
    };
    w.tables
        .table(IpVersion::V4, "filter")
        .set_chain(Chain::new(
            "cali-pi-ids",
            vec![
                Rule::new(
                    Match::new().protocol("tcp").dst_ports("80,443"),
                    Action::SetMark(0x10000),
                )
                .with_id(id(0)),
                Rule::new(Match::new().mark_set(0x10000), Action::Return),
                Rule::always(Action::Drop).with_id(id(1)),
            ],
        ));
    w.apply().unwrap();
    let script = w.nft.take().concat();
    let kernel = chain_rules(&script, "ip", "filter-cali-pi-ids");
    assert_eq!(kernel.len(), 4, "{kernel:?}");

    let nft = std::mem::replace(
        &mut w.writer,
        NftTables::with_batch(&[IpVersion::V4], Box::new(FakeBatch::text_for_structure())),
    );
    let writer = NftWriter::with_tables(nft);
    let v4 = IpVersion::V4;
    let at = |p| {
        writer.rule_id(
            &w.tables,
            v4,
            "calico",
            "filter-cali-pi-ids",
            RuleAt::Position(p),
        )
    };
    assert_eq!(
        (1..=5).map(at).collect::<Vec<_>>(),
        vec![Some(id(0)), Some(id(0)), None, Some(id(1)), None]
    );
    for (i, rule) in kernel.iter().enumerate() {
        let comment = rule.split("comment ").nth(1).unwrap();
        assert_eq!(
            writer.rule_id(
                &w.tables,
                v4,
                "calico",
                "filter-cali-pi-ids",
                RuleAt::Comment(comment)
            ),
            at(i + 1),
            "{rule}"
        );
    }
    // The dispatch map lookup renders no rule of ours; other tables are not ours.
    assert_eq!(
        writer.rule_id(
            &w.tables,
            v4,
            "calico",
            "filter-cali-from-wl-dispatch",
            RuleAt::Position(1)
        ),
        None
    );
    assert_eq!(
        writer.rule_id(
            &w.tables,
            v4,
            "filter",
            "filter-cali-pi-ids",
            RuleAt::Position(1)
        ),
        None
    );
}
