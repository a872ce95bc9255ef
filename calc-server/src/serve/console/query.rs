//! The console's query strings and links.
//!
//! Contract: a page's filters live in its query string (so a URL can be shared), read here
//! into typed values with the reason a value is refused; links are built here with their
//! parts percent-encoded, so a name from the datastore can never end a path or a parameter
//! early. (The templates then HTML-escape the whole link.)

use super::super::admin::percent_decode;

/// The decoded `key=value` pairs of a query string; `Err` names the first bad escape.
pub(super) fn pairs(query: Option<&str>) -> Result<Vec<(String, String)>, String> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let k = percent_decode(k).ok_or_else(|| "a parameter: invalid escape".to_string())?;
            let v = percent_decode(v).ok_or_else(|| format!("parameter {k}: invalid escape"))?;
            Ok((k, v))
        })
        .collect()
}

/// A query value or path segment, percent-encoded.
pub(super) use crate::admin_client::query_escape as escape;

/// A path of `/`-separated parts (a policy's `[KIND:][NAMESPACE/]NAME`), each part encoded.
pub(super) use crate::admin_client::url_escape as escape_path;

/// `/ui/policies/KIND:NAME`: a policy's page (a profile has no kind: `/ui/policies/NAME`).
pub(super) fn policy_link(kind: &str, policy: &str) -> String {
    if kind.is_empty() || kind == "Profile" {
        format!("/ui/policies/{}", escape_path(policy))
    } else {
        format!("/ui/policies/{}", escape_path(&format!("{kind}:{policy}")))
    }
}

/// `/ui/nodes/NAME`.
pub(super) fn node_link(node: &str) -> String {
    format!("/ui/nodes/{}", escape(node))
}

/// A query string from the non-empty pairs (`?a=1&b=2`, or empty).
pub(super) fn build(params: &[(&str, &str)]) -> String {
    let parts: Vec<String> = params
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", escape(v)))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_encode_what_could_end_them() {
        assert_eq!(
            policy_link("NetworkPolicy", "shop/a b?c#d"),
            "/ui/policies/NetworkPolicy:shop/a%20b%3Fc%23d"
        );
        assert_eq!(policy_link("Profile", "kns.shop"), "/ui/policies/kns.shop");
        assert_eq!(node_link("node/1"), "/ui/nodes/node%2F1");
        assert_eq!(
            build(&[("q", "a&b=c"), ("page", ""), ("x", "<")]),
            "?q=a%26b%3Dc&x=%3C"
        );
        assert_eq!(build(&[("q", "")]), "");
        assert_eq!(
            pairs(Some("q=a+b&n=%3Cx%3E")).unwrap(),
            [("q".into(), "a b".into()), ("n".into(), "<x>".into())]
        );
        assert!(pairs(Some("q=%zz")).is_err());
    }
}
