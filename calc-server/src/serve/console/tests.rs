//! The console's pages through the real admin router, over an engine holding a small
//! in-memory cluster: hostile text from the datastore and from agents comes out escaped on
//! every page, every answer under `/ui` carries the security headers, only GET is answered,
//! and a missing node or policy is a 404 naming it.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use calc_graph::graph::Update;
use calc_graph::manifest::{Outcome, decode_and_validate};
use serde_json::json;
use tower::ServiceExt as _;

use super::super::admin::{AdminState, Bounds, router};
use super::super::admin_access::AdminAccess;
use super::super::engine::{Engine, Limits};
use super::super::listener::IdentitySource;
use super::super::metrics::Metrics;
use crate::args::AdminArgs;
use crate::status::Board;

/// Text that would run as script, or end an attribute, if written raw.
const EVIL: &str = "<script>alert(1)</script>\"'";
/// The same text as HTML escaping writes it (askama escapes `"` and `'` as numeric references).
const EVIL_ESCAPED: &str = "&#60;script&#62;alert(1)&#60;/script&#62;&#34;&#39;";

fn apply(value: serde_json::Value) -> Update {
    match decode_and_validate(value.clone()) {
        Outcome::Valid(_, res) => Update::ApplyValid(res),
        other => panic!("test object must be valid: {value} → {other:?}"),
    }
}

/// Two nodes, a web pod on each, a tier, and policies whose annotations, labels and selector
/// carry [`EVIL`] (names cannot: the datastore refuses them).
fn cluster() -> Vec<Update> {
    let node = |name: &str| {
        apply(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "Node",
            "metadata": {"name": name, "annotations": {"note": EVIL}}, "spec": {},
        }))
    };
    let workload = |node: &str, pod: &str, ip: &str| {
        apply(json!({
            "apiVersion": "projectcalico.org/v3",
            "kind": "WorkloadEndpoint",
            "metadata": {
                "name": format!("{}-k8s-{}-eth0", node.replace('-', "--"), pod.replace('-', "--")),
                "namespace": "shop",
                "labels": {"app": "web", "projectcalico.org/namespace": "shop"},
                "annotations": {"evil": EVIL},
            },
            "spec": {
                "orchestrator": "k8s", "node": node, "pod": pod, "endpoint": "eth0",
                "interfaceName": format!("cali{pod}"), "ipNetworks": [format!("{ip}/32")],
            },
        }))
    };
    vec![
        node("node-a"),
        node("node-b"),
        apply(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "Tier",
            "metadata": {"name": "security"}, "spec": {"order": 100},
        })),
        apply(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "security.guard", "annotations": {"evil": EVIL}},
            "spec": {
                "tier": "security", "order": 10,
                "selector": format!("app == 'web' || evil == \"{}\"", EVIL.replace('"', "")),
                "ingress": [{"action": "Pass"}],
            },
        })),
        apply(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "NetworkPolicy",
            "metadata": {"name": "allow-web", "namespace": "shop",
                         "labels": {"team": "web"}, "annotations": {"evil": EVIL}},
            "spec": {
                "selector": "app == 'web'",
                "ingress": [{"action": "Allow", "protocol": "TCP", "destination": {"ports": [80]}}],
            },
        })),
        apply(json!({
            "apiVersion": "projectcalico.org/v3", "kind": "StagedNetworkPolicy",
            "metadata": {"name": "tighten", "namespace": "shop"},
            "spec": {"selector": "app == 'web'", "ingress": [{"action": "Deny"}]},
        })),
        workload("node-a", "web-1", "10.0.0.1"),
        workload("node-b", "web-2", "10.0.0.2"),
        Update::InSync,
    ]
}

struct Console {
    router: axum::Router,
    board: Arc<Board>,
    metrics: Arc<Metrics>,
    /// Kept open: the engine runs until its inputs close.
    _datastore: tokio::sync::mpsc::Sender<Vec<Update>>,
}

fn admin_args(token: Option<std::path::PathBuf>) -> AdminArgs {
    AdminArgs {
        admin_allowed_cn: vec![],
        admin_allowed_uri_san: vec![],
        admin_ca_file: None,
        admin_token_file: token,
        admin_max_concurrent_queries: 4,
        admin_query_timeout: std::time::Duration::from_secs(10),
        admin_max_response_bytes: 1 << 24,
        admin_max_connections: 8,
    }
}

/// The admin router over an engine that has applied `updates`.
fn console(updates: Vec<Update>, token: Option<std::path::PathBuf>) -> Console {
    let (board, metrics) = (Arc::new(Board::default()), Arc::new(Metrics::default()));
    let ready = Arc::new(AtomicBool::new(false));
    let mut engine = Engine::new(
        Limits {
            backlog: 1000,
            backlog_bytes: Some(1 << 30),
            concurrent_snapshots: 8,
            allow_unknown_nodes: false,
        },
        board.clone(),
        ready.clone(),
        metrics.clone(),
    );
    engine.enable_flows(1000, 4000);
    engine.step([super::super::engine::Input::Datastore(updates)]);
    assert_eq!(
        metrics.rejections.total(),
        0,
        "every test object is accepted"
    );
    let (engine_tx, engine_rx) = tokio::sync::mpsc::channel(64);
    let (datastore_tx, datastore_rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(super::super::engine::run(engine, engine_rx, datastore_rx));
    let access = AdminAccess::new(
        &admin_args(token),
        "127.0.0.1:9096".parse().unwrap(),
        false,
        IdentitySource::CommonName,
    )
    .expect("admin access");
    let state = AdminState {
        board: board.clone(),
        ready,
        metrics: metrics.clone(),
        engine: engine_tx,
        access: Arc::new(access),
        bounds: Bounds {
            queries: Arc::new(tokio::sync::Semaphore::new(4)),
            query_timeout: std::time::Duration::from_secs(10),
            max_response_bytes: 1 << 24,
        },
    };
    Console {
        router: router(state),
        board,
        metrics,
        _datastore: datastore_tx,
    }
}

struct Answer {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: String,
}

async fn call(c: &Console, method: Method, path: &str, auth: Option<&str>) -> Answer {
    let mut req = Request::builder().method(method).uri(path);
    if let Some(token) = auth {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let resp = c
        .router
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .expect("the router answers");
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 24)
        .await
        .expect("body");
    Answer {
        status,
        headers,
        body: String::from_utf8(body.to_vec()).expect("UTF-8"),
    }
}

async fn get(c: &Console, path: &str) -> Answer {
    call(c, Method::GET, path, None).await
}

fn assert_console_headers(a: &Answer, path: &str) {
    let csp = a
        .headers
        .get("content-security-policy")
        .unwrap_or_else(|| panic!("{path}: no Content-Security-Policy"))
        .to_str()
        .unwrap();
    assert_eq!(csp, super::CSP, "{path}");
    for needed in [
        "default-src 'none'",
        "script-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(needed), "{path}: CSP lacks {needed}");
    }
    assert_eq!(
        a.headers
            .get("x-content-type-options")
            .map(|v| v.to_str().unwrap()),
        Some("nosniff"),
        "{path}"
    );
}

/// An agent on `node` that reports hostile endpoint ids, status, version and apply error.
fn hostile_agent(board: &Board, node: &str) {
    use felix_proto as pb;
    board.connected(node, 7, EVIL, true);
    let report = |seq: u64, payload| pb::FromDataplane {
        sequence_number: seq,
        payload: Some(payload),
    };
    board.report(
        node,
        7,
        &report(
            2,
            pb::from_dataplane::Payload::WorkloadEndpointStatusUpdate(
                pb::WorkloadEndpointStatusUpdate {
                    id: Some(pb::WorkloadEndpointId {
                        orchestrator_id: "k8s".into(),
                        workload_id: format!("shop/{EVIL}"),
                        endpoint_id: "eth0".into(),
                    }),
                    status: Some(pb::EndpointStatus {
                        status: EVIL.into(),
                    }),
                    ..Default::default()
                },
            ),
        ),
    );
    board.report(
        node,
        7,
        &report(
            3,
            pb::from_dataplane::Payload::DataplaneApplied(pb::DataplaneApplied {
                applied_sequence_number: 1,
                error: EVIL.into(),
                ..Default::default()
            }),
        ),
    );
}

/// Every page, hostile text everywhere it can reach one: what the datastore holds
/// (annotations, labels, a selector), what an agent reports (endpoint ids and status, its
/// version, an apply error), the datastore's problem list, and the query string itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_escapes_what_it_shows() {
    let c = console(cluster(), None);
    hostile_agent(&c.board, "node-a");
    c.metrics.datastore_health().unusable.set(
        vec![format!("NetworkPolicy shop/{EVIL}")],
        vec![format!("Tier {EVIL}")],
    );
    let q = super::query::escape(EVIL);
    let pages = [
        "/ui/".to_string(),
        "/ui/nodes".into(),
        format!("/ui/nodes?q={q}"),
        "/ui/nodes/node-a".into(),
        format!("/ui/nodes/{q}"),
        "/ui/policies".into(),
        format!("/ui/policies?q={q}"),
        "/ui/policies/GlobalNetworkPolicy:security.guard".into(),
        "/ui/policies/NetworkPolicy:shop/allow-web".into(),
        format!("/ui/policies/{q}"),
        "/ui/flows".into(),
        format!("/ui/flows?namespace={q}&name={q}&policy=shop/x"),
        "/ui/explain".into(),
        format!("/ui/explain?from={q}&to=shop/web-2&protocol=tcp&port=80"),
        "/ui/explain?from=shop/web-1&to=shop/web-2&protocol=tcp&port=80".into(),
        format!("/ui/{q}"),
    ];
    let mut escaped_seen = 0;
    for path in &pages {
        let a = get(&c, path).await;
        assert_console_headers(&a, path);
        assert!(
            a.status == StatusCode::OK || a.status == StatusCode::NOT_FOUND,
            "{path}: {} {}",
            a.status,
            a.body
        );
        assert_eq!(
            a.headers.get("content-type").unwrap(),
            "text/html; charset=utf-8",
            "{path}"
        );
        assert!(
            !a.body.to_lowercase().contains("<script>alert"),
            "{path}: raw script in\n{}",
            a.body
        );
        assert!(!a.body.contains(EVIL), "{path}: raw text in\n{}", a.body);
        // The only script is the embedded file; no inline script anywhere.
        assert_eq!(a.body.matches("<script").count(), 1, "{path}");
        assert!(
            a.body
                .contains(r#"<script src="/ui/static/console.js" defer></script>"#),
            "{path}"
        );
        if a.body.contains(EVIL_ESCAPED) {
            escaped_seen += 1;
        }
    }
    // The hostile text is shown, escaped, where it belongs.
    for (path, what) in [
        ("/ui/", "a datastore problem"),
        ("/ui/nodes", "the agent version"),
        (
            "/ui/nodes/node-a",
            "an endpoint id, its status and the apply error",
        ),
    ] {
        let a = get(&c, path).await;
        assert!(
            a.body.contains(EVIL_ESCAPED),
            "{path} shows {what} escaped:\n{}",
            a.body
        );
    }
    let a = get(&c, &format!("/ui/explain?from={q}&to=shop/web-2")).await;
    assert!(
        a.body.contains(&format!("value=\"{EVIL_ESCAPED}\"")),
        "the form keeps the value, escaped:\n{}",
        a.body
    );
    assert!(escaped_seen >= 6, "escaped text on {escaped_seen} pages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_board_lists_policies_in_evaluation_order_with_their_state() {
    let c = console(cluster(), None);
    let a = get(&c, "/ui/policies").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let body = &a.body;
    let at = |s: &str| {
        body.find(s)
            .unwrap_or_else(|| panic!("{s} not on the board:\n{body}"))
    };
    // Tier security (order 100) before default; in default, staged and not.
    assert!(at("security.guard") < at("allow-web"));
    assert!(at("tier security") < at("tier default"));
    assert!(body.contains(r#"href="/ui/policies/NetworkPolicy:shop/allow-web""#));
    assert!(body.contains(r#"<span class="badge badge-staged">staged</span>"#));
    // The selector, escaped (its quotes too).
    assert!(body.contains("app == &#34;web&#34;"), "{body}");
    // Filtered by the query string.
    let a = get(&c, "/ui/policies?q=tighten").await;
    assert!(a.body.contains("shop/tighten") && !a.body.contains("shop/allow-web"));

    // One policy: its rules (text from explain) and where it is not in force yet.
    let a = get(&c, "/ui/policies/NetworkPolicy:shop/allow-web").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert!(a.body.contains("allow tcp"), "rule text:\n{}", a.body);
    assert!(a.body.contains(r#"<a href="/ui/nodes/node-a">node-a</a>"#));
    assert!(a.body.contains("not connected"), "{}", a.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_things_are_404_pages_that_name_them() {
    let c = console(cluster(), None);
    let a = get(&c, "/ui/nodes/node-z").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(a.body.contains("no node &#34;node-z&#34;"), "{}", a.body);
    let a = get(&c, "/ui/policies/NetworkPolicy:shop/nope").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(a.body.contains("shop/nope"), "{}", a.body);
    let a = get(&c, "/ui/nowhere").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(a.body.contains("/ui/nowhere"));
    let a = get(&c, "/ui/nodes?bad=1").await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(
        a.body.contains("unknown parameter &#34;bad&#34;"),
        "{}",
        a.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_get_is_answered_and_assets_have_their_types() {
    let c = console(cluster(), None);
    for method in [Method::POST, Method::PUT, Method::DELETE, Method::PATCH] {
        for path in [
            "/ui/",
            "/ui/policies",
            "/ui/explain",
            "/ui/static/console.js",
        ] {
            let a = call(&c, method.clone(), path, None).await;
            assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            assert_console_headers(&a, path);
        }
    }
    for (path, ty) in [
        ("/ui/static/console.css", "text/css; charset=utf-8"),
        ("/ui/static/console.js", "text/javascript; charset=utf-8"),
        ("/ui/static/favicon.svg", "image/svg+xml"),
    ] {
        let a = get(&c, path).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        assert_eq!(a.headers.get("content-type").unwrap(), ty, "{path}");
        assert_console_headers(&a, path);
    }
    // The other admin paths are left as they were.
    let a = get(&c, "/status").await;
    assert!(a.headers.get("content-security-policy").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_needs_the_admin_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "0123456789abcdef0123").unwrap();
    let c = console(cluster(), Some(token));
    for path in [
        "/ui/",
        "/ui/nodes",
        "/ui/policies",
        "/ui/static/console.js",
        "/ui/recommend/shop",
    ] {
        let a = get(&c, path).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{path}");
        assert_console_headers(&a, path);
        let a = call(&c, Method::GET, path, Some("0123456789abcdef0123")).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
    }
    // The JSON recommendation paths sit behind the same check.
    for path in [
        "/recommend?namespace=shop",
        "/recommend/check?namespace=shop",
    ] {
        let a = get(&c, path).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{path}");
        let a = call(&c, Method::GET, path, Some("0123456789abcdef0123")).await;
        assert_eq!(a.status, StatusCode::OK, "{path}: {}", a.body);
        assert!(
            a.body.contains("\"namespace\":\"shop\""),
            "{path}: {}",
            a.body
        );
    }
    let a = get(&c, "/readiness").await;
    assert_eq!(a.status, StatusCode::OK, "probes stay open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_clis_verdict_and_links_each_policy() {
    let c = console(cluster(), None);
    let a = get(
        &c,
        "/ui/explain?from=shop/web-1&to=shop/web-2&protocol=tcp&port=80",
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert!(
        a.body
            .contains(r#"<p class="verdict bad" id="verdict">DENY TCP port 80</p>"#),
        "{}",
        a.body
    );
    // web-1's egress has no policy and no profile; web-2's ingress is allowed after a pass.
    assert!(a.body.contains("egress of shop/web-1: DENY"), "{}", a.body);
    assert!(
        a.body.contains("ingress of shop/web-2: ALLOW"),
        "{}",
        a.body
    );
    assert!(
        a.body
            .contains(r#"href="/ui/policies/NetworkPolicy:shop/allow-web""#)
    );
    assert!(
        a.body
            .contains(r#"href="/ui/policies/GlobalNetworkPolicy:security.guard""#)
    );
    // The command line's text, the same words.
    assert!(
        a.body
            .contains("rule 0 (Pass) matched → pass: on to the next tier")
    );
    let a = get(&c, "/ui/explain?from=shop/nobody&to=shop/web-2").await;
    assert!(a.body.contains(r#"id="error-message""#), "{}", a.body);
}

/// A flow record as node-b's agent reports it for web-2 (the destination): from `source`,
/// passed by the security tier then allowed by shop/allow-web.
fn flow_record(interval_start: i64, source: &str, port: u32) -> felix_proto::FlowRecord {
    use felix_proto as pb;
    let rule = |kind: &str, name: &str, namespace: &str, tier: &str| pb::RuleRef {
        policy: Some(pb::PolicyId {
            name: name.into(),
            namespace: namespace.into(),
            kind: kind.into(),
        }),
        tier: tier.into(),
        ..Default::default()
    };
    pb::FlowRecord {
        interval_start,
        source_ip: source.into(),
        dest_ip: "10.0.0.2".into(),
        source_port: 40_000,
        dest_port: port,
        protocol: 6,
        reporter_dest: true,
        trace: vec![
            pb::FlowRuleHit {
                rule: Some(rule(
                    "GlobalNetworkPolicy",
                    "security.guard",
                    "",
                    "security",
                )),
                action: "pass".into(),
            },
            pb::FlowRuleHit {
                rule: Some(rule("NetworkPolicy", "allow-web", "shop", "default")),
                action: "allow".into(),
            },
        ],
        allowed: true,
        packets_in: 3,
        packets_out: 3,
        bytes_in: 300,
        bytes_out: 200,
        connections_started: 1,
        ..Default::default()
    }
}

/// Flows in the store (through the engine, as an agent's reports arrive): rows in the CLI's
/// words, each opening its traces with links to the policies; the filters in the query string;
/// paging.
#[test]
fn the_flows_page_lists_filters_and_pages_the_store() {
    let now = std::time::SystemTime::now();
    let secs = now.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let interval = secs - secs % 15 - 30;
    let report = felix_proto::FlowReport {
        records: vec![
            flow_record(interval, "10.0.0.1", 80),
            flow_record(interval, "192.0.2.9", 80),
            flow_record(interval, "10.0.0.1", 443),
        ],
        ..Default::default()
    };
    let paths: Vec<(String, super::bench::Before)> = [
        "/ui/flows",
        "/ui/flows?port=443",
        "/ui/flows?action=deny",
        "/ui/flows?page_size=1&page=1",
        "/ui/flows?namespace=shop&name=web-1",
        "/ui/flows?since=0",
    ]
    .iter()
    .map(|s| (s.to_string(), super::bench::Before::Nothing))
    .collect();
    let (loaded, pages) =
        super::bench::run(cluster(), vec![("node-b".into(), report)], now, &paths, 0).unwrap();
    assert_eq!(loaded.accepted, 3, "every record stored");
    let page = |p: &str| {
        pages
            .iter()
            .find(|t| t.path == p)
            .map(|t| (t.status, t.body.as_str()))
            .unwrap()
    };
    let (status, all) = page("/ui/flows");
    assert_eq!(status, 200, "{all}");
    assert_eq!(all.matches(r#"<tr class="flow">"#).count(), 3, "{all}");
    assert!(all.contains(r#"<span id="flow-total">3</span>"#));
    // The CLI's words: both sides, proto/port, the deciding rule; the traces behind <details>.
    assert!(all.contains("<th scope=\"row\">shop/web-1</th>"), "{all}");
    assert!(all.contains("<td>shop/web-2</td>"));
    assert!(
        all.contains("<td>tcp/443</td>") || all.contains("<td>TCP/443</td>"),
        "{all}"
    );
    assert!(
        all.contains("default CalicoNetworkPolicy shop/allow-web rule 0 allow"),
        "{all}"
    );
    assert!(
        all.contains(r#"<a href="/ui/policies/NetworkPolicy:shop/allow-web">"#),
        "{all}"
    );
    assert!(
        all.contains(r#"<a href="/ui/policies/GlobalNetworkPolicy:security.guard">"#),
        "{all}"
    );
    let (_, port) = page("/ui/flows?port=443");
    assert_eq!(port.matches(r#"<tr class="flow">"#).count(), 1);
    assert!(port.contains(r#"value="443""#), "the form keeps the filter");
    let (_, deny) = page("/ui/flows?action=deny");
    assert!(deny.contains("No flow matches."));
    let (_, second) = page("/ui/flows?page_size=1&page=1");
    assert_eq!(second.matches(r#"<tr class="flow">"#).count(), 1);
    assert!(second.contains("page 2 of 3"), "{second}");
    assert!(
        second.contains(r#"href="/ui/flows?since=3600&#38;page_size=1" rel="prev""#),
        "{second}"
    );
    assert!(
        second.contains(r#"href="/ui/flows?since=3600&#38;page=2&#38;page_size=1" rel="next""#),
        "{second}"
    );
    // Namespace and name match either side: web-1 is the source of two flows.
    let (_, named) = page("/ui/flows?namespace=shop&name=web-1");
    assert_eq!(named.matches(r#"<tr class="flow">"#).count(), 2, "{named}");
    let (status, bad) = page("/ui/flows?since=0");
    assert_eq!(status, 400);
    assert!(bad.contains("parameter since"), "{bad}");
}

/// The recommendation page: from the same store and graph as `/recommend` and
/// `/recommend/check`, the policy for the web pods with the flows behind its rule, the flow
/// from an unnamed address left out with the reason, and the staged policy `tighten` (deny
/// all ingress to web) named with the allowed flows it would break; linked from the flows
/// page of the namespace; bad parameters are 400 pages.
#[test]
fn the_recommend_page_shows_policies_flows_and_what_would_break() {
    let now = std::time::SystemTime::now();
    let secs = now.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let interval = secs - secs % 15 - 30;
    let report = felix_proto::FlowReport {
        records: vec![
            flow_record(interval, "10.0.0.1", 80),
            flow_record(interval, "192.0.2.9", 80),
            flow_record(interval, "10.0.0.1", 443),
        ],
        ..Default::default()
    };
    let paths: Vec<(String, super::bench::Before)> = [
        "/ui/recommend/shop",
        "/ui/recommend",
        "/ui/recommend?namespace=shop&since=600",
        "/ui/recommend/shop?since=0",
        "/ui/recommend/Not_A_Namespace",
        "/ui/flows?namespace=shop",
    ]
    .iter()
    .map(|s| (s.to_string(), super::bench::Before::Nothing))
    .collect();
    let (loaded, pages) =
        super::bench::run(cluster(), vec![("node-b".into(), report)], now, &paths, 0).unwrap();
    assert_eq!(loaded.accepted, 3, "every record stored");
    let page = |p: &str| {
        pages
            .iter()
            .find(|t| t.path == p)
            .map(|t| (t.status, t.body.as_str()))
            .unwrap()
    };
    let (status, shop) = page("/ui/recommend/shop");
    assert_eq!(status, 200, "{shop}");
    assert!(
        shop.contains(r#"aria-current="page">Recommend</a>"#),
        "{shop}"
    );
    // The recommendation: one policy, its one ingress rule, the flows behind it.
    assert!(
        shop.contains(r#"<span id="policy-count">1</span>"#),
        "{shop}"
    );
    assert!(shop.contains("<h3>recommended-web</h3>"), "{shop}");
    assert!(
        shop.contains("Allow from endpoints app == &#39;web&#39; TCP ports 80, 443"),
        "{shop}"
    );
    assert_eq!(shop.matches(r#"<tr class="rule">"#).count(), 1, "{shop}");
    assert!(
        shop.contains(
            r#"<a href="/ui/flows?namespace=shop&#38;name=web-1">shop/web-1 -&#62; shop/web-2 tcp/80 (dst, Allow, 1 intervals, 6 packets)</a>"#
        ),
        "{shop}"
    );
    assert!(
        shop.contains("kind: &#34;StagedNetworkPolicy&#34;"),
        "{shop}"
    );
    // Left out: the address no NetworkSet holds.
    assert!(
        shop.contains(r#"<span id="left-out-count">1</span>"#),
        "{shop}"
    );
    assert!(shop.contains("-/pub -&#62; shop/web-2 tcp/80"), "{shop}");
    assert!(shop.contains("address no NetworkSet holds"), "{shop}");
    // Would break: the staged deny-all comes after allow-web (port 80) in the default tier,
    // so of the allowed flows to web only the one to 443 would be denied.
    assert!(
        shop.contains(
            r#"<a href="/ui/policies/StagedNetworkPolicy:shop/tighten">StagedNetworkPolicy shop/tighten</a>: <span class="warn">1 flow would break</span>"#
        ),
        "{shop}"
    );
    assert_eq!(shop.matches(r#"<li class="break">"#).count(), 1, "{shop}");
    assert!(
        shop.contains(r#"<li class="break"><a href="/ui/flows?namespace=shop&#38;name=web-1">shop/web-1 -&#62; shop/web-2 tcp/443 (dst, Allow, 1 intervals, 6 packets)</a></li>"#),
        "{shop}"
    );
    // Nothing the datastore holds is written raw.
    assert!(!shop.contains("<script>alert"), "{shop}");

    let (status, index) = page("/ui/recommend");
    assert_eq!(status, 200);
    assert!(index.contains(r#"name="namespace""#), "{index}");
    let (status, _) = page("/ui/recommend?namespace=shop&since=600");
    assert_eq!(status, 303, "the form leads to the namespace's page");
    let (status, bad) = page("/ui/recommend/shop?since=0");
    assert_eq!(status, 400);
    assert!(bad.contains("parameter since"), "{bad}");
    let (status, bad) = page("/ui/recommend/Not_A_Namespace");
    assert_eq!(status, 400);
    assert!(bad.contains("not a Kubernetes namespace name"), "{bad}");
    let (_, flows) = page("/ui/flows?namespace=shop");
    assert!(
        flows.contains(r#"<a href="/ui/recommend/shop" id="recommend-link">"#),
        "{flows}"
    );
}
