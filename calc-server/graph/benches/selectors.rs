//! Selector benchmark: parse and evaluate throughput for a realistic selector mix.
//! Prints figures; it does not pass or fail on time (docs/benchmarks.md records them).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use calc_graph::selector;

const SELECTORS: &[&str] = &[
    "all()",
    "app == 'web'",
    "app == 'api' && version != 'v1'",
    "role in {'frontend', 'backend', 'cache'} && has(projectcalico.org/namespace)",
    "(env == 'prod' || env == 'staging') && !has(quarantine)",
    "pcns.team == 'storefront' && app not in {'db', 'queue'}",
    "name starts with 'web-' && zone ends with '-a'",
    "projectcalico.org/namespace == 'shop' && (app == 'web' && tier contains 'front')",
];

fn labels(i: usize) -> BTreeMap<String, String> {
    let apps = ["web", "api", "db", "queue", "cache"];
    let mut m = BTreeMap::new();
    m.insert("app".to_string(), apps[i % apps.len()].to_string());
    m.insert("version".to_string(), format!("v{}", i % 3));
    m.insert(
        "env".to_string(),
        ["prod", "staging", "dev"][i % 3].to_string(),
    );
    m.insert(
        "projectcalico.org/namespace".to_string(),
        format!("ns-{}", i % 10),
    );
    m.insert(
        "pcns.team".to_string(),
        ["storefront", "data"][i % 2].to_string(),
    );
    m.insert("name".to_string(), format!("web-{i}"));
    m.insert("zone".to_string(), ["eu-1-a", "eu-1-b"][i % 2].to_string());
    m.insert(
        "role".to_string(),
        ["frontend", "backend", "batch"][i % 3].to_string(),
    );
    m
}

fn main() {
    let rounds = 20_000;
    let t = Instant::now();
    for _ in 0..rounds {
        for s in SELECTORS {
            black_box(selector::parse(black_box(s)).expect("valid"));
        }
    }
    let parse_ns = t.elapsed().as_nanos() as f64 / (rounds * SELECTORS.len()) as f64;

    let parsed: Vec<_> = SELECTORS
        .iter()
        .map(|s| selector::parse(s).unwrap())
        .collect();
    let label_sets: Vec<_> = (0..1000).map(labels).collect();
    let evals = 200;
    let t = Instant::now();
    let mut hits = 0usize;
    for _ in 0..evals {
        for l in &label_sets {
            for s in &parsed {
                hits += usize::from(s.evaluate(black_box(l)));
            }
        }
    }
    let n = evals * label_sets.len() * parsed.len();
    let eval_ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!(
        "selector parse:    {parse_ns:8.0} ns/selector ({} selectors x {rounds})",
        SELECTORS.len()
    );
    println!("selector evaluate: {eval_ns:8.1} ns/evaluation ({n} evaluations, {hits} matched)");
}
