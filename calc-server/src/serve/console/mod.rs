//! The admin console: read-only HTML pages under `/ui/` on the admin listener.
//!
//! Contract: every page is rendered on the server from the same state the JSON endpoints
//! answer from (the status board, the datastore's last-good health, and the engine's
//! realization, unused, explain and flow answers), through askama templates that HTML-escape
//! every value by default. The only script is the embedded `/ui/static/console.js`, which
//! re-fetches the page it is on and swaps its `<main>` in place; no page carries inline script
//! or data meant for a script. The routes sit in the admin router's sensitive part, so the
//! same access check as `/status` applies; only GET (and HEAD) is answered. Every response
//! under `/ui` (refusals and 404s included) carries [`CSP`] and `nosniff` ([`headers`]).
//!
//! Modules: `bench` times the pages for `calc-bench console`; `query` reads the query strings and builds the links; `pages` asks for the data
//! and fills the templates (`calc-server/templates/*.html`); the assets are in
//! `calc-server/assets/`.

#[doc(hidden)]
pub mod bench;
mod pages;
mod query;
#[cfg(test)]
mod tests;

use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::admin::AdminState;

/// The console's Content-Security-Policy: scripts, styles and fetches from the admin listener
/// only, no inline script or style, no framing, forms that submit only to the listener.
pub(super) const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; \
     base-uri 'none'";

const CSS: &str = include_str!("../../../assets/console.css");
const JS: &str = include_str!("../../../assets/console.js");
const ICON: &[u8] = include_bytes!("../../../assets/favicon.svg");

/// The console's routes (merged into the admin router's sensitive part).
pub(super) fn router() -> axum::Router<AdminState> {
    axum::Router::new()
        .route(
            "/ui",
            get(|| async { axum::response::Redirect::permanent("/ui/") }),
        )
        .route("/ui/", get(pages::overview))
        .route("/ui/nodes", get(pages::nodes))
        .route("/ui/nodes/{name}", get(pages::node))
        .route("/ui/policies", get(pages::policies))
        .route("/ui/policies/{*name}", get(pages::policy))
        .route("/ui/flows", get(pages::flows))
        .route("/ui/recommend", get(pages::recommend_index))
        .route("/ui/recommend/{namespace}", get(pages::recommend))
        .route("/ui/explain", get(pages::explain))
        .route(
            "/ui/static/console.css",
            get(|| async { asset("text/css; charset=utf-8", CSS.as_bytes()) }),
        )
        .route(
            "/ui/static/console.js",
            get(|| async { asset("text/javascript; charset=utf-8", JS.as_bytes()) }),
        )
        .route(
            "/ui/static/favicon.svg",
            get(|| async { asset("image/svg+xml", ICON) }),
        )
        .route("/ui/{*rest}", get(pages::unknown))
}

/// An embedded asset: cached for a short while (a new binary may change it).
fn asset(content_type: &'static str, body: &'static [u8]) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        body,
    )
        .into_response()
}

/// Adds [`CSP`], `nosniff`, no referrer and no caching of pages to every answer under `/ui`
/// (whatever answered: a page, the access check's refusal, a 405 for another method).
pub(super) async fn headers(req: Request, next: Next) -> Response {
    let console = req.uri().path() == "/ui" || req.uri().path().starts_with("/ui/");
    let mut resp = next.run(req).await;
    if console {
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        );
        h.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        h.insert(
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        );
        h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
        if !h.contains_key(header::CACHE_CONTROL) {
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
    }
    resp
}

/// A rendered page, or the error page when the template fails (it should not: the templates
/// are checked at compile time, and only formatting can fail).
fn html(status: StatusCode, rendered: askama::Result<String>) -> Response {
    match rendered {
        Ok(body) => (
            status,
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("rendering the page: {e}\n"),
        )
            .into_response(),
    }
}
