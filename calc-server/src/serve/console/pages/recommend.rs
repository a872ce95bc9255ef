//! The recommendation page (`/ui/recommend/<namespace>?since=&tier=&include_denied=&min_samples=`):
//! what `calc-server recommend` prints for the namespace (each policy's YAML, each rule with the
//! flows behind it, the flows left out and why, notes) and what `--check` says of the
//! namespace's staged policies (the "would break" list). `/ui/recommend` asks for a namespace.
//! Both answers come from the engine through `admin::recommend_answer`, as `/recommend` and
//! `/recommend/check` give them.

use askama::Template;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::super::super::admin::{AdminState, recommend_answer};
use super::super::html;
use super::super::query::{build, escape, pairs};
use super::{Section, bad_request, refused};

/// The page's form values, as given.
#[derive(Default)]
pub(super) struct RecommendForm {
    pub namespace: String,
    /// Seconds back from now (empty: all the store holds).
    pub since: String,
    pub tier: String,
    pub include_denied: bool,
    pub min_samples: String,
}

impl RecommendForm {
    fn parse(namespace: String, query: Option<&str>) -> Result<RecommendForm, String> {
        let mut f = RecommendForm {
            namespace,
            since: "3600".into(),
            ..Default::default()
        };
        for (k, v) in pairs(query)? {
            let v = v.trim().to_string();
            match k.as_str() {
                "since" => f.since = v,
                "tier" => f.tier = v,
                "include_denied" => f.include_denied = v == "true" || v == "on",
                "min_samples" => f.min_samples = v,
                _ => return Err(format!("unknown parameter {k:?}")),
            }
        }
        Ok(f)
    }

    /// `/recommend`'s (or `/recommend/check`'s) query.
    fn query(&self, check: bool) -> String {
        let denied = if self.include_denied { "true" } else { "" };
        let q = if check {
            build(&[("namespace", &self.namespace), ("since", &self.since)])
        } else {
            build(&[
                ("namespace", &self.namespace),
                ("since", &self.since),
                ("tier", &self.tier),
                ("include_denied", denied),
                ("min_samples", &self.min_samples),
            ])
        };
        q.trim_start_matches('?').to_string()
    }
}

pub(super) struct FlowItem {
    pub text: String,
    /// The flows page filtered to its source.
    pub link: String,
}

pub(super) struct RuleRow {
    pub direction: String,
    pub index: String,
    pub text: String,
    pub flows: Vec<FlowItem>,
}

pub(super) struct PolicyBlock {
    pub name: String,
    pub group: String,
    pub selector: String,
    pub yaml: String,
    pub rules: Vec<RuleRow>,
}

pub(super) struct LeftRow {
    pub flow: String,
    pub why: String,
}

pub(super) struct CheckRow {
    pub policy: String,
    pub link: String,
    pub verdict: String,
    pub safe: bool,
    pub breaks: Vec<FlowItem>,
}

#[derive(Template)]
#[template(path = "recommend.html")]
pub(super) struct RecommendPage {
    title: String,
    section: Section,
    live: bool,
    f: RecommendForm,
    /// No namespace asked for yet: only the form.
    ask: bool,
    off: bool,
    yaml_all: String,
    policies: Vec<PolicyBlock>,
    left_out: Vec<LeftRow>,
    notes: Vec<String>,
    checks: Vec<CheckRow>,
}

/// `shop/web-* -> shop/api-* tcp/8080 (dst, 2 intervals, 20 packets)`.
fn flow_text(f: &Value) -> String {
    let via = f["service"]
        .as_str()
        .map(|s| format!(" via service {s}"))
        .unwrap_or_default();
    format!(
        "{}{via} ({}, {}, {} intervals, {} packets)",
        crate::recommend::yaml::flow_line(f),
        f["reporter"].as_str().unwrap_or_default(),
        f["action"].as_str().unwrap_or("-"),
        f["samples"],
        f["packets"],
    )
}

fn flow_item(f: &Value) -> FlowItem {
    let side = f["source"].as_str().unwrap_or_default();
    let (ns, name) = side.split_once('/').unwrap_or(("", side));
    FlowItem {
        text: flow_text(f),
        link: format!(
            "/ui/flows{}",
            build(&[
                ("namespace", if ns == "-" { "" } else { ns }),
                ("name", name)
            ])
        ),
    }
}

/// A rule in words: `from <peer>` / `to <peer>`, protocol and ports.
fn rule_text(direction: &str, rule: &Value) -> String {
    let peer = if direction == "ingress" {
        &rule["source"]
    } else {
        &rule["destination"]
    };
    let mut who = Vec::new();
    if let Some(ns) = peer["namespaceSelector"].as_str() {
        who.push(format!("namespaces {ns}"));
    }
    if let Some(sel) = peer["selector"].as_str() {
        who.push(format!("endpoints {sel}"));
    }
    if let Some(nets) = peer["nets"].as_array() {
        let nets: Vec<&str> = nets.iter().filter_map(Value::as_str).collect();
        who.push(format!("nets {}", nets.join(", ")));
    }
    let ports: Vec<String> = rule["destination"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| p.as_str().map_or_else(|| p.to_string(), str::to_string))
        .collect();
    format!(
        "{} {} {} {}{}",
        rule["action"].as_str().unwrap_or_default(),
        if direction == "ingress" { "from" } else { "to" },
        who.join(", "),
        rule["protocol"]
            .as_str()
            .map_or_else(|| rule["protocol"].to_string(), str::to_string),
        if ports.is_empty() {
            String::new()
        } else {
            format!(" ports {}", ports.join(", "))
        }
    )
}

/// The page from the two answers (`None`: flow logs are off).
pub(super) fn recommend_page(f: RecommendForm, answers: Option<(Value, Value)>) -> RecommendPage {
    let mut page = RecommendPage {
        title: if f.namespace.is_empty() {
            "Recommend".into()
        } else {
            format!("Recommend: {}", f.namespace)
        },
        section: Section::Recommend,
        live: false,
        ask: f.namespace.is_empty(),
        off: answers.is_none() && !f.namespace.is_empty(),
        yaml_all: String::new(),
        policies: Vec::new(),
        left_out: Vec::new(),
        notes: Vec::new(),
        checks: Vec::new(),
        f,
    };
    let Some((rec, check)) = answers else {
        return page;
    };
    page.yaml_all = crate::recommend::yaml::answer(&rec);
    for p in rec["policies"].as_array().into_iter().flatten() {
        page.policies.push(PolicyBlock {
            name: p["name"].as_str().unwrap_or_default().into(),
            group: p["group"].as_str().unwrap_or_default().into(),
            selector: p["selector"].as_str().unwrap_or_default().into(),
            yaml: crate::recommend::yaml::documents(std::slice::from_ref(&p["object"])),
            rules: p["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| {
                    let dir = r["direction"].as_str().unwrap_or_default();
                    RuleRow {
                        direction: dir.into(),
                        index: r["index"].to_string(),
                        text: rule_text(dir, &r["rule"]),
                        flows: r["flows"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(flow_item)
                            .collect(),
                    }
                })
                .collect(),
        });
    }
    page.left_out = rec["left_out"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|l| LeftRow {
            flow: flow_text(&l["flow"]),
            why: l["why"].as_str().unwrap_or_default().into(),
        })
        .collect();
    page.notes = rec["notes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect();
    let ns = page.f.namespace.clone();
    page.checks = check["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let kind = c["kind"].as_str().unwrap_or_default();
            let name = c["name"].as_str().unwrap_or_default();
            let breaks: Vec<FlowItem> = c["breaks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(flow_item)
                .collect();
            CheckRow {
                policy: format!("{kind} {ns}/{name}"),
                link: super::super::query::policy_link(kind, &format!("{ns}/{name}")),
                verdict: if breaks.is_empty() {
                    "0 flows would break: safe to promote".into()
                } else {
                    format!(
                        "{} {} would break",
                        breaks.len(),
                        if breaks.len() == 1 { "flow" } else { "flows" }
                    )
                },
                safe: breaks.is_empty(),
                breaks,
            }
        })
        .collect();
    page
}

/// `/ui/recommend`: the namespace form.
pub(in crate::serve::console) async fn recommend_index(RawQuery(query): RawQuery) -> Response {
    // The form submits `?namespace=NS`: go to the namespace's page.
    if let Ok(p) = pairs(query.as_deref())
        && let Some((_, ns)) = p
            .iter()
            .find(|(k, v)| k == "namespace" && !v.trim().is_empty())
    {
        let rest: Vec<(&str, &str)> = p
            .iter()
            .filter(|(k, _)| k != "namespace")
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        return axum::response::Redirect::to(&format!(
            "/ui/recommend/{}{}",
            escape(ns.trim()),
            build(&rest)
        ))
        .into_response();
    }
    let form = RecommendForm {
        since: "3600".into(),
        ..Default::default()
    };
    html(StatusCode::OK, recommend_page(form, None).render())
}

/// `/ui/recommend/<namespace>`.
pub(in crate::serve::console) async fn recommend(
    State(s): State<AdminState>,
    Path(namespace): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let form = match RecommendForm::parse(namespace, query.as_deref()) {
        Ok(f) => f,
        Err(e) => return bad_request(Section::Recommend, e),
    };
    let answers = async {
        let rec = recommend_answer(&s, &form.query(false), false).await?;
        let check = recommend_answer(&s, &form.query(true), true).await?;
        Ok::<_, Response>((rec, check))
    }
    .await;
    match answers {
        Ok(a) => html(StatusCode::OK, recommend_page(form, Some(a)).render()),
        Err(answer) if answer.status() == StatusCode::NOT_FOUND => {
            html(StatusCode::OK, recommend_page(form, None).render())
        }
        Err(answer) if answer.status() == StatusCode::BAD_REQUEST => {
            let body = axum::body::to_bytes(answer.into_body(), 64 * 1024)
                .await
                .unwrap_or_default();
            let message = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_string))
                .unwrap_or_default();
            bad_request(Section::Recommend, message)
        }
        Err(answer) => refused(Section::Recommend, answer).await,
    }
}
