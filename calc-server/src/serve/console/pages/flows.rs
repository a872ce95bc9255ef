//! The flows table (`/ui/flows?namespace=&name=&action=&policy=&port=&since=&page=`): the
//! flow store's answer in `calc-server flows`' words (`flows::words`), each row opening its
//! traces, paged by 100.

use askama::Template;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::super::super::admin::{AdminState, ask, flow_request};
use super::super::super::engine::Input;

/// Rows per page of the flows table unless `page_size` says otherwise.
const FLOWS_PAGE: usize = 100;
use super::super::html;
use super::super::query::{build, escape, pairs, policy_link};
use super::{Section, bad_request, refused};

pub(super) struct HitItem {
    pub text: String,
    /// The policy's page, when the hit names a policy.
    pub link: String,
}

pub(super) struct FlowRow {
    pub key: String,
    pub start: String,
    pub source: String,
    pub dest: String,
    pub port: String,
    pub action: String,
    pub reporter: String,
    pub packets: String,
    pub bytes: String,
    pub rule: String,
    pub source_labels: String,
    pub dest_labels: String,
    pub enforced: Vec<HitItem>,
    pub pending: Vec<HitItem>,
}

/// The flows filter form's values (as given, for the form and the links).
#[derive(Default)]
pub(super) struct FlowFilters {
    pub namespace: String,
    pub name: String,
    pub action: String,
    pub policy: String,
    pub port: String,
    /// Seconds back from now.
    pub since: String,
    pub page: usize,
    pub page_size: usize,
}

impl FlowFilters {
    fn parse(query: Option<&str>) -> Result<FlowFilters, String> {
        let mut f = FlowFilters {
            since: "3600".into(),
            page_size: FLOWS_PAGE,
            ..Default::default()
        };
        for (k, v) in pairs(query)? {
            let v = v.trim().to_string();
            match k.as_str() {
                "namespace" => f.namespace = v,
                "name" => f.name = v,
                "action" => f.action = v,
                "policy" => f.policy = v,
                "port" => f.port = v,
                "since" => f.since = v,
                "page" => {
                    f.page = v
                        .parse()
                        .map_err(|_| "parameter page: not a whole number".to_string())?;
                }
                "page_size" => {
                    f.page_size = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or("parameter page_size: a whole number from 1 to 1000")?;
                }
                _ => return Err(format!("unknown parameter {k:?}")),
            }
        }
        Ok(f)
    }

    /// The store's question: everything but namespace and name, which match either side
    /// (as `calc-server flows --namespace/--name`) and are applied here.
    fn request(&self) -> Result<crate::flows::FlowListRequest, String> {
        let mut q = Vec::new();
        if !self.since.is_empty() {
            let secs: u64 = self
                .since
                .parse()
                .ok()
                .filter(|s| *s > 0)
                .ok_or("parameter since: a whole number of seconds above 0")?;
            q.push(format!("start_time_gte=-{secs}"));
        }
        for (k, v) in [
            ("action", &self.action),
            ("policy", &self.policy),
            ("dest_port", &self.port),
        ] {
            if !v.is_empty() {
                q.push(format!("{k}={}", escape(v)));
            }
        }
        let local = !self.namespace.is_empty() || !self.name.is_empty();
        if !local {
            q.push(format!("page={}&page_size={}", self.page, self.page_size));
        }
        flow_request(&q.join("&")).map_err(|e| e.replace("dest_port", "port"))
    }

    fn link(&self, page: usize) -> String {
        let page = page.to_string();
        let size = if self.page_size == FLOWS_PAGE {
            String::new()
        } else {
            self.page_size.to_string()
        };
        format!(
            "/ui/flows{}",
            build(&[
                ("namespace", &self.namespace),
                ("name", &self.name),
                ("action", &self.action),
                ("policy", &self.policy),
                ("port", &self.port),
                ("since", &self.since),
                ("page", if page == "0" { "" } else { &page }),
                ("page_size", &size),
            ])
        )
    }
}

#[derive(Template)]
#[template(path = "flows.html")]
pub(super) struct Flows {
    title: String,
    section: Section,
    live: bool,
    f: FlowFilters,
    off: bool,
    total: usize,
    page: usize,
    pages: usize,
    prev: String,
    next: String,
    rows: Vec<FlowRow>,
    /// The recommendation page of the namespace filtered on (empty: none).
    recommend: String,
}

/// `/ui/policies/…` for a trace hit (`None` for an end of tier or a profile).
fn hit_link(h: &serde_json::Value) -> String {
    let text = |k: &str| h[k].as_str().unwrap_or_default();
    let (ns, name) = (text("namespace"), text("name"));
    let policy = if ns.is_empty() || ns == "-" {
        name.to_string()
    } else {
        format!("{ns}/{name}")
    };
    let kind = match text("kind") {
        "CalicoNetworkPolicy" => "NetworkPolicy",
        "GlobalNetworkPolicy" => "GlobalNetworkPolicy",
        "StagedNetworkPolicy" => "StagedNetworkPolicy",
        "StagedGlobalNetworkPolicy" => "StagedGlobalNetworkPolicy",
        "StagedKubernetesNetworkPolicy" => "StagedKubernetesNetworkPolicy",
        // A Kubernetes NetworkPolicy is Calico's `knp.default.NAME`.
        "NetworkPolicy" => {
            let k8s = if ns.is_empty() {
                format!("knp.default.{name}")
            } else {
                format!("{ns}/knp.default.{name}")
            };
            return policy_link("NetworkPolicy", &k8s);
        }
        "ClusterNetworkPolicyAdminTier" | "ClusterNetworkPolicyBaselineTier" => "",
        _ => return String::new(),
    };
    if kind.is_empty() {
        format!("/ui/policies/{}", super::super::query::escape_path(&policy))
    } else {
        policy_link(kind, &policy)
    }
}

fn flow_row(r: &crate::flows::FlowResult) -> FlowRow {
    let v = serde_json::to_value(r).unwrap_or_default();
    let f = &v["flow"];
    let cells = crate::flows::words::row(f);
    let trace = |field: &str| -> Vec<HitItem> {
        f["Key"]["policies"][field]
            .as_array()
            .into_iter()
            .flatten()
            .map(|h| HitItem {
                text: crate::flows::words::hit(h),
                link: hit_link(h),
            })
            .collect()
    };
    let labels = |k: &str| {
        f[k].as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let cell = |i: usize| cells.get(i).cloned().unwrap_or_default();
    FlowRow {
        key: format!("{}-{}", r.id, cell(0)),
        start: cell(0),
        source: cell(1),
        dest: cell(2),
        port: cell(3),
        action: cell(4),
        reporter: cell(5),
        packets: cell(6),
        bytes: cell(7),
        rule: cell(8),
        source_labels: labels("source_labels"),
        dest_labels: labels("dest_labels"),
        enforced: trace("enforced_policies"),
        pending: trace("pending_policies"),
    }
}

/// Whether a flow's source or destination has the namespace and the name asked for.
fn flow_matches(r: &crate::flows::FlowResult, f: &FlowFilters) -> bool {
    let Some(k) = r.flow.as_ref().and_then(|f| f.key.as_ref()) else {
        return false;
    };
    (f.namespace.is_empty() || k.source_namespace == f.namespace || k.dest_namespace == f.namespace)
        && (f.name.is_empty() || k.source_name == f.name || k.dest_name == f.name)
}

/// The flows page from the store's answer (`None`: flow logs are off). Without a namespace or
/// name filter the store paged it; with one, it answered every match and the page is cut here.
pub(super) fn flows_page(f: FlowFilters, answer: Option<crate::flows::FlowListResult>) -> Flows {
    let off = answer.is_none();
    let answer = answer.unwrap_or_default();
    let local = !f.namespace.is_empty() || !f.name.is_empty();
    let (total, pages, rows): (usize, usize, Vec<FlowRow>) = if local {
        let matched: Vec<&crate::flows::FlowResult> = answer
            .flows
            .iter()
            .filter(|r| flow_matches(r, &f))
            .collect();
        let total = matched.len();
        let rows = matched
            .into_iter()
            .skip(f.page * f.page_size)
            .take(f.page_size)
            .map(flow_row)
            .collect();
        (total, total.div_ceil(f.page_size), rows)
    } else {
        let meta = answer.meta.unwrap_or_default();
        (
            usize::try_from(meta.total_results).unwrap_or_default(),
            usize::try_from(meta.total_pages).unwrap_or_default(),
            answer.flows.iter().map(flow_row).collect(),
        )
    };
    let pages = pages.max(1);
    Flows {
        title: "Flows".into(),
        section: Section::Flows,
        live: true,
        off,
        total,
        page: f.page,
        pages,
        prev: if f.page > 0 {
            f.link(f.page - 1)
        } else {
            String::new()
        },
        next: if f.page + 1 < pages {
            f.link(f.page + 1)
        } else {
            String::new()
        },
        rows,
        recommend: if f.namespace.is_empty() {
            String::new()
        } else {
            format!("/ui/recommend/{}", escape(&f.namespace))
        },
        f,
    }
}

pub(in crate::serve::console) async fn flows(
    State(s): State<AdminState>,
    RawQuery(query): RawQuery,
) -> Response {
    let (filters, request) =
        match FlowFilters::parse(query.as_deref()).and_then(|f| Ok((f.request()?, f))) {
            Ok((r, f)) => (f, r),
            Err(e) => return bad_request(Section::Flows, e),
        };
    match ask(&s, |reply| Input::FlowList { request, reply }).await {
        Ok(Some(Ok(result))) => html(StatusCode::OK, flows_page(filters, Some(result)).render()),
        Ok(Some(Err(e))) => bad_request(Section::Flows, e.to_string()),
        Ok(None) => html(StatusCode::OK, flows_page(filters, None).render()),
        Err(answer) => refused(Section::Flows, answer).await,
    }
}
