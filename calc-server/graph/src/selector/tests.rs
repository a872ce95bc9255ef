//! Conformance tests against the shared Calico vectors, error positions, and properties.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use serde_json::Value;

use super::*;

const SELECTORS: &str = include_str!("../../../../testdata/selectors.json");

fn vectors() -> Value {
    serde_json::from_str(SELECTORS).expect("selectors.json parses")
}

fn entries<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v[key].as_array().expect(key)
}

fn labels_of(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .expect("labels object")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("label value").to_owned()))
        .collect()
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn sel(s: &str) -> Selector {
    parse(s).unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
}

#[test]
fn every_evaluation_vector() {
    let v = vectors();
    let cases = entries(&v, "vectors");
    assert!(!cases.is_empty());
    for case in cases {
        let s = case["selector"].as_str().unwrap();
        let labels = labels_of(&case["labels"]);
        let expected = case["matches"].as_bool().unwrap();
        let selector = sel(s);
        assert_eq!(selector.evaluate(&labels), expected, "{s:?} on {labels:?}");
        // The canonical form must mean the same thing.
        assert_eq!(
            sel(selector.canonical()).evaluate(&labels),
            expected,
            "canonical {:?} of {s:?}",
            selector.canonical()
        );
        // HashMap labels behave the same.
        let hashed: HashMap<String, String> = labels.clone().into_iter().collect();
        assert_eq!(selector.evaluate(&hashed), expected, "{s:?} (HashMap)");
    }
}

#[test]
fn every_invalid_selector_fails() {
    let v = vectors();
    let cases = entries(&v, "invalid");
    assert!(!cases.is_empty());
    for case in cases {
        let s = case["selector"].as_str().unwrap();
        let err = parse(s).expect_err(s);
        assert_eq!(err.input, s);
        assert!(err.position <= s.len(), "{err}");
        assert!(validate(s).is_err());
        // Normalise hands back an unparseable selector trimmed but otherwise untouched.
        if !s.contains('\n') {
            assert_eq!(normalise(s), s.trim(), "{s:?}");
        }
    }
}

#[test]
fn every_canonical_entry() {
    let v = vectors();
    let cases = entries(&v, "canonical");
    assert!(!cases.is_empty());
    for case in cases {
        let input = case["input"].as_str().unwrap();
        let canonical = case["canonical"].as_str().unwrap();
        let unique_id = case["unique_id"].as_str().unwrap();
        let selector = sel(input);
        assert_eq!(selector.canonical(), canonical, "{input:?}");
        assert_eq!(selector.to_string(), canonical, "{input:?}");
        assert_eq!(selector.unique_id(), unique_id, "{input:?}");
        assert_eq!(selector.unique_id().len(), 40);
        assert_eq!(normalise(input), canonical, "{input:?}");
        // Canonical strings are fixed points (none of these hit the `!!` quirk).
        assert_eq!(sel(canonical).canonical(), canonical);
    }
}

#[test]
fn every_prefix_visitor_entry() {
    let v = vectors();
    let cases = entries(&v, "prefix_visitor");
    assert!(!cases.is_empty());
    for case in cases {
        let input = case["input"].as_str().unwrap();
        let prefix = case["prefix"].as_str().unwrap();
        let output = case["output"].as_str().unwrap();
        let prefixed = sel(input).with_label_prefix(prefix);
        assert_eq!(prefixed.canonical(), output, "{input:?}");
        assert_eq!(prefixed.unique_id(), sel(output).unique_id());
    }
}

#[test]
fn all_selector() {
    let all = Selector::all();
    assert!(all.is_all());
    assert_eq!(all.canonical(), "all()");
    assert_eq!(all.unique_id(), "s:5y5I3VdRZfDU01O--xXAPx2yxCQQqMf0M6IWug");
    assert_eq!(all, sel(""));
    assert_eq!(all, sel(" \t "));
    assert_eq!(all, Selector::default());
    assert_eq!(*all.root(), Node::All);
    assert!(!sel("global()").is_all());
    assert!(sel("(all())").is_all());
}

#[test]
fn not_not_quirk() {
    // Calico renders NOT without parentheses, so a negated negation loses its meaning on a
    // round trip through the canonical string; the ids differ accordingly.
    let nested = sel("!(!has(a))");
    assert_eq!(nested.canonical(), "!!has(a)");
    assert_eq!(
        *nested.root(),
        Node::Not(Box::new(Node::Not(Box::new(Node::Has {
            label: "a".into()
        }))))
    );
    let collapsed = sel("!!has(a)");
    assert_eq!(collapsed.canonical(), "has(a)");
    assert_ne!(nested.unique_id(), collapsed.unique_id());
    assert_eq!(sel("!!!has(a)").canonical(), "!has(a)");
    assert_eq!(sel("! ! !has(a)").canonical(), "!has(a)");
}

#[test]
fn canonical_rendering_details() {
    let cases = [
        ("a==\"b\"", "a == \"b\""),
        ("!(a == \"1\")", "!a == \"1\""),
        ("((a == \"1\"))", "a == \"1\""),
        (
            "(a == 'x' && b == 'y') && c == 'z'",
            "((a == \"x\" && b == \"y\") && c == \"z\")",
        ),
        (
            "a == 'x' && b == 'y' && c == 'z'",
            "(a == \"x\" && b == \"y\" && c == \"z\")",
        ),
        ("a in {}", "a in {}"),
        ("a not in {'b','a','b',}", "a not in {\"a\", \"b\"}"),
        ("a in {'\"', \"'\"}", "a in {'\"', \"'\"}"),
        ("has( a )", "has(a)"),
        ("all( )", "all()"),
        ("global(\t)", "global()"),
        ("a startswith 'x'", "a starts with \"x\""),
        ("a ends\t\twith 'x'", "a ends with \"x\""),
        ("a notin {'x'}", "a not in {\"x\"}"),
        ("a in{'x'}", "a in {\"x\"}"),
        ("a == \"é ü\"", "a == \"é ü\""),
        ("in in {\"in\"}", "in in {\"in\"}"),
        (
            "contains contains \"contains\"",
            "contains contains \"contains\"",
        ),
        ("all == 'x'", "all == \"x\""),
        ("!global()", "!global()"),
    ];
    for (input, canonical) in cases {
        assert_eq!(sel(input).canonical(), canonical, "{input:?}");
    }
    // Set values sort by bytes, as Go's string comparison does.
    assert_eq!(
        sel("a in {'b', 'B', 'é', 'a', ''}").canonical(),
        "a in {\"\", \"B\", \"a\", \"b\", \"é\"}"
    );
}

#[test]
fn tokenizer_edge_cases() {
    let valid = [
        "a in {\"a\"}",
        "a in{\"a\"}",
        "label contains\"value\"",
        "a\tnot\tin\t{\"x\"}",
        "a not in {\"x\"}",
        "a notin {\"x\"}",
        "a == \"b\"\t",
        "\ta == \"b\"",
        "a!=\"b\"",
        "!a==\"b\"",
        "has(a)&&has(b)||!has(c)",
        "a == 'x\"y'",
        "a == \"x'y\"",
        // Go's tokenizer takes anything up to the closing quote, newlines included.
        "a == \"x\ny\"",
        "not in {\"a\"}",
        "has == \"x\"",
        "global == \"x\"",
        "starts starts with \"x\"",
        "k8s-app/name.x_y == 'v'",
    ];
    for s in valid {
        assert!(parse(s).is_ok(), "{s:?}: {:?}", parse(s).err());
    }
    let invalid = [
        "a inx {\"a\"}",
        "a startswithx \"y\"",
        "a containsx \"y\"",
        "a not inx {}",
        "a == \"b\"\n",
        "\na == \"b\"",
        "a == \"b\"\r",
        "a ==\u{a0}\"b\"",
        "a == b",
        "a in {'a' 'b'}",
        "a in {,}",
        "a in {'a',,}",
        "a in {",
        "()",
        "!",
        "!!",
        "a == 'b' &&",
        "a == 'b' ||",
        "a == 'b' && || b == 'c'",
        "has(a))",
        "(has(a)",
        "has(a b)",
        "has(",
        "all(x)",
        "a == 'b' c == 'd'",
        "'a' == 'b'",
        "a ! = 'b'",
        "a =! 'b'",
        "é == 'b'",
    ];
    for s in invalid {
        assert!(parse(s).is_err(), "{s:?} should not parse");
    }
}

#[test]
fn valid_labels() {
    assert!(is_valid_label("projectcalico.org/namespace"));
    assert!(is_valid_label(&"a".repeat(MAX_LABEL_LEN)));
    assert!(!is_valid_label(&"a".repeat(MAX_LABEL_LEN + 1)));
    assert!(!is_valid_label(""));
    assert!(!is_valid_label("a b"));
    assert!(!is_valid_label("é"));
}

#[test]
fn label_length_limit() {
    let ok = "a".repeat(MAX_LABEL_LEN);
    let too_long = "a".repeat(MAX_LABEL_LEN + 1);
    assert!(parse(&format!("{ok} == 'x'")).is_ok());
    assert!(parse(&format!("has({ok})")).is_ok());
    let err = parse(&format!("{too_long} == 'x'")).unwrap_err();
    assert_eq!(err.position, 0);
    assert!(err.message.contains("513"), "{err}");
    let err = parse(&format!("has( {too_long})")).unwrap_err();
    assert_eq!(err.position, 5);
}

/// (selector, byte position of the error).
#[test]
fn error_positions() {
    let cases: &[(&str, usize)] = &[
        ("%", 0),
        ("a == \"b\" && %", 12),
        ("a == \"b\" || %", 12),
        ("label = \"value\"", 6),
        ("a == \"b\" & has(foo)", 9),
        ("a == \"b\" | has(foo)", 9),
        ("b == b", 5),
        ("'b1' == b", 0),
        ("b", 1),
        ("a ", 2),
        ("a b", 2),
        ("!", 1),
        ("\"FOO", 0),
        ("x == 'FOO", 5),
        ("(", 1),
        ("(a == \"foo\"", 11),
        (")", 0),
        ("()", 1),
        ("has()", 4),
        ("has( foo ", 9),
        ("all(", 4),
        ("label starts foo \"value\"", 6),
        ("label squiggles \"value\"", 6),
        ("a in {,}", 6),
        ("a in {\"a\"", 9),
        ("a in {'a' 'b'}", 10),
        ("a in \"bar\"", 5),
        ("has(a)b", 6),
        ("a == \"b\"\n&& c == \"d\"", 8),
        ("@a == \"b\"", 0),
        ("has(foo) &&", 11),
        ("a == 'b') ", 8),
    ];
    for &(input, position) in cases {
        let err = parse(input).expect_err(input);
        assert_eq!(err.position, position, "{input:?}: {err}");
        assert_eq!(err.input, input);
        let shown = err.to_string();
        assert!(shown.contains(&format!("at byte {position}")), "{shown}");
        assert!(shown.contains(&format!("{input:?}")), "{shown}");
    }
}

#[test]
fn error_messages_say_what_was_expected() {
    let msg = |s: &str| parse(s).unwrap_err().message;
    assert!(msg("a = 'b'").contains("=="));
    assert!(msg("b == b").contains("quoted string"));
    assert!(msg("a b").contains("operator"));
    assert!(msg("(a == 'b'").contains("')'"));
    assert!(msg("x == 'FOO").contains("unterminated"));
    assert!(msg("has(a) b").contains("after the end"));
}

#[test]
fn nesting_limit() {
    let deep = |n: usize| format!("{}has(a){}", "(".repeat(n), ")".repeat(n));
    assert!(sel(&deep(MAX_NESTING)).evaluate(&labels(&[("a", "")])));
    let err = parse(&deep(MAX_NESTING + 1)).unwrap_err();
    assert_eq!(err.position, MAX_NESTING);
    // Depth is nesting, not the number of parenthesised groups.
    let wide = vec!["(has(a))"; 1000].join(" && ");
    assert!(parse(&wide).is_ok());
    // A long run of `!` is not nesting.
    assert_eq!(
        sel(&format!("{}has(a)", "!".repeat(10_001))).canonical(),
        "!has(a)"
    );
}

#[test]
fn evaluation_table() {
    let present = labels(&[("a", "xyz"), ("e", "")]);
    let absent = labels(&[]);
    let table: &[(&str, bool, bool)] = &[
        // selector, on {a: xyz, e: ""}, on {}
        ("a == 'xyz'", true, false),
        ("a != 'xyz'", false, true),
        ("a != 'q'", true, true),
        ("a in {'xyz'}", true, false),
        ("a in {}", false, false),
        ("a not in {'xyz'}", false, true),
        ("a not in {}", true, true),
        ("has(a)", true, false),
        ("has(e)", true, false),
        ("e == ''", true, false),
        ("a contains 'y'", true, false),
        ("a contains ''", true, false),
        ("e contains ''", true, false),
        ("a starts with 'xy'", true, false),
        ("a starts with 'yz'", false, false),
        ("a ends with 'yz'", true, false),
        ("a ends with ''", true, false),
        ("a == 'XYZ'", false, false),
        ("all()", true, true),
        ("global()", true, true),
        ("!all()", false, false),
    ];
    for &(s, on_present, on_absent) in table {
        let selector = sel(s);
        assert_eq!(selector.evaluate(&present), on_present, "{s:?} present");
        assert_eq!(selector.evaluate(&absent), on_absent, "{s:?} absent");
    }
}

#[test]
fn normalise_trims_then_canonicalises() {
    assert_eq!(normalise(""), "all()");
    assert_eq!(normalise("  a=='b'  \n"), "a == \"b\"");
    assert_eq!(normalise("\n\ta=='b'\r\n"), "a == \"b\"");
    assert_eq!(normalise("  not valid  "), "not valid");
    assert_eq!(
        normalise("a == \"b\"\n&& c == \"d\""),
        "a == \"b\"\n&& c == \"d\""
    );
}

#[test]
fn from_node_and_combinators() {
    let a = sel("a == 'x'");
    let b = sel("b == 'y' || has(c)");
    let both = and(vec![a.clone(), b.clone()]);
    assert_eq!(both, sel("(a == 'x') && (b == 'y' || has(c))"));
    assert_eq!(both.canonical(), "(a == \"x\" && (b == \"y\" || has(c)))");
    let either = or(vec![a.clone(), b.clone()]);
    assert_eq!(either, sel("(a == 'x') || (b == 'y' || has(c))"));
    // Degenerate combinations re-parse to themselves.
    assert_eq!(and(vec![a.clone()]), a);
    assert!(and(vec![]).is_all());
    assert_eq!(or(vec![]).canonical(), "!all()");
    assert!(!or(vec![]).evaluate(&labels(&[])));
    let built = Selector::from_node(Node::And(vec![
        Node::Or(vec![Node::Has { label: "k".into() }]),
        Node::In {
            label: "k".into(),
            values: ValueSet::new(["z", "a", "z"]),
        },
    ]));
    assert_eq!(built.canonical(), "(has(k) && k in {\"a\", \"z\"})");
    assert_eq!(built, sel(built.canonical()));
    assert_eq!(*built.root(), *sel(built.canonical()).root());
}

#[test]
fn selector_identity_by_canonical() {
    use std::collections::HashSet;
    let a = sel("a=='b'");
    let b = sel("  a == \"b\"  ");
    assert_eq!(a, b);
    let set: HashSet<Selector> = [a.clone(), b].into_iter().collect();
    assert_eq!(set.len(), 1);
    assert_eq!(format!("{a}"), "a == \"b\"");
    assert_eq!(format!("{a:?}"), "Selector(\"a == \\\"b\\\"\")");
    assert_eq!("a=='b'".parse::<Selector>().unwrap(), a);
}

#[test]
fn labels_visitor() {
    let s = sel("has(a) && (b in {'x'} || !c == 'y') && all()");
    let mut seen = Vec::new();
    s.root().for_each_label(&mut |l| seen.push(l));
    assert_eq!(seen, ["a", "b", "c"]);
}

// ---------------------------------------------------------------------------------------
// Properties.

/// Small pools so that random labels actually hit the labels the selectors test.
const LABEL_POOL: &[&str] = &["a", "b", "has", "in", "not", "k8s.io/x-y_z"];
const VALUE_POOL: &[&str] = &["", "x", "y", "xy", "yx", "'", "\"", "a b", "é"];

fn label_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(LABEL_POOL).prop_map(str::to_owned),
        1 => "[a-zA-Z0-9_./-]{1,8}",
    ]
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(VALUE_POOL).prop_map(str::to_owned),
        // Anything without both quote characters can be written as a literal.
        1 => "[^\"]{0,6}",
        1 => "[^']{0,6}",
    ]
}

fn leaf() -> impl Strategy<Value = Node> {
    prop_oneof![
        (label_name(), value()).prop_map(|(label, value)| Node::Eq { label, value }),
        (label_name(), value()).prop_map(|(label, value)| Node::Ne { label, value }),
        (label_name(), value()).prop_map(|(label, value)| Node::Contains { label, value }),
        (label_name(), value()).prop_map(|(label, value)| Node::StartsWith { label, value }),
        (label_name(), value()).prop_map(|(label, value)| Node::EndsWith { label, value }),
        (label_name(), prop::collection::vec(value(), 0..4)).prop_map(|(label, values)| {
            Node::In {
                label,
                values: ValueSet::new(values),
            }
        }),
        (label_name(), prop::collection::vec(value(), 0..4)).prop_map(|(label, values)| {
            Node::NotIn {
                label,
                values: ValueSet::new(values),
            }
        }),
        label_name().prop_map(|label| Node::Has { label }),
        Just(Node::All),
        Just(Node::Global),
    ]
}

/// Random trees; `allow_double_not` decides whether `Not(Not(_))` may appear.
fn tree(allow_double_not: bool) -> impl Strategy<Value = Node> {
    leaf().prop_recursive(4, 32, 4, move |inner| {
        prop_oneof![
            inner
                .clone()
                .prop_filter_map("!! does not round-trip", move |n| {
                    if !allow_double_not && matches!(n, Node::Not(_)) {
                        None
                    } else {
                        Some(Node::Not(Box::new(n)))
                    }
                }),
            prop::collection::vec(inner.clone(), 2..4).prop_map(Node::And),
            prop::collection::vec(inner, 2..4).prop_map(Node::Or),
        ]
    })
}

fn label_map() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(
        prop::sample::select(LABEL_POOL).prop_map(str::to_owned),
        value(),
        0..5,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn canonical_round_trips(node in tree(false), maps in prop::collection::vec(label_map(), 8)) {
        let original = Selector::from_node(node);
        let reparsed = parse(original.canonical()).expect("canonical form parses");
        prop_assert_eq!(reparsed.canonical(), original.canonical());
        prop_assert_eq!(reparsed.unique_id(), original.unique_id());
        prop_assert_eq!(reparsed.root(), original.root());
        for labels in &maps {
            prop_assert_eq!(reparsed.evaluate(labels), original.evaluate(labels));
        }
    }

    #[test]
    fn canonical_preserves_meaning_even_with_double_not(
        node in tree(true),
        maps in prop::collection::vec(label_map(), 8),
    ) {
        // `!!x` re-parses as `x`, which means the same thing.
        let original = Selector::from_node(node);
        let reparsed = parse(original.canonical()).expect("canonical form parses");
        for labels in &maps {
            prop_assert_eq!(reparsed.evaluate(labels), original.evaluate(labels));
        }
        // Re-rendering the re-parsed tree is stable from then on.
        let again = parse(reparsed.canonical()).expect("parses");
        prop_assert_eq!(again.canonical(), reparsed.canonical());
    }

    #[test]
    fn prefixing_labels_is_consistent(node in tree(true), labels in label_map()) {
        let original = Selector::from_node(node);
        let prefixed = original.with_label_prefix("pcns.");
        let prefixed_labels: BTreeMap<String, String> =
            labels.iter().map(|(k, v)| (format!("pcns.{k}"), v.clone())).collect();
        prop_assert_eq!(prefixed.evaluate(&prefixed_labels), original.evaluate(&labels));
        let mut names = Vec::new();
        prefixed.root().for_each_label(&mut |l| names.push(l));
        prop_assert!(names.iter().all(|l| l.starts_with("pcns.")));
    }

    #[test]
    fn arbitrary_input_never_panics(input in "\\PC{0,40}") {
        if let Ok(selector) = parse(&input) {
            // Whatever parsed, its canonical form parses to something equivalent.
            let reparsed = parse(selector.canonical()).expect("canonical form parses");
            let empty = BTreeMap::<String, String>::new();
            prop_assert_eq!(reparsed.evaluate(&empty), selector.evaluate(&empty));
        } else {
            let err = parse(&input).unwrap_err();
            prop_assert!(err.position <= input.len());
            prop_assert!(input.is_char_boundary(err.position));
        }
    }

    #[test]
    fn selector_like_input_never_panics(
        input in "[a-c !&|=(){},'\"\t]{0,8}(has|all|global|in|not|contains|starts|with)?[a-c !&|=(){},'\"\t]{0,12}",
    ) {
        match parse(&input) {
            Ok(selector) => {
                let reparsed = parse(selector.canonical()).expect("canonical form parses");
                let map = labels(&[("a", "b"), ("b", "")]);
                prop_assert_eq!(reparsed.evaluate(&map), selector.evaluate(&map));
            }
            Err(err) => prop_assert!(err.position <= input.len()),
        }
    }
}

const WHITESPACE: &str = include_str!("../../../../testdata/selector_whitespace.json");

/// Calico skips exactly `' '` and `'\t'` between tokens: every other whitespace character, in
/// every gap, is a parse error at the gap (the vectors name each character and each gap).
#[test]
fn only_space_and_tab_are_whitespace() {
    let v: Value = serde_json::from_str(WHITESPACE).expect("selector_whitespace.json parses");
    let characters = entries(&v, "characters");
    let templates = entries(&v, "templates");
    assert!(characters.len() > 20 && templates.len() > 10);
    for c in characters {
        let code = c["codepoint"].as_str().unwrap();
        let ch = char::from_u32(u32::from_str_radix(&code[2..], 16).unwrap()).unwrap();
        let accepted = c["accepted"].as_bool().unwrap();
        for t in templates {
            let template = t["template"].as_str().unwrap();
            let input = template.replace('\u{b7}', &ch.to_string());
            let with_space = sel(&template.replace('\u{b7}', " "));
            match parse(&input) {
                Ok(s) => {
                    assert!(accepted, "{code} ({}) accepted in {input:?}", c["name"]);
                    assert_eq!(s.canonical(), with_space.canonical(), "{input:?}");
                }
                Err(e) => {
                    assert!(!accepted, "{code} rejected in {input:?}: {e}");
                    let at = t["error_at"].as_u64().unwrap() as usize;
                    assert_eq!(e.position, at, "{code} in {input:?}: {e}");
                }
            }
        }
    }
}
