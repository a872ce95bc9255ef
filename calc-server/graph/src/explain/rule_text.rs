//! One policy rule as a line of text, for `explain --policy` and the per-rule hit tables: what
//! the operator wrote (the original selectors, not the IP-set ids they became), in the order
//! of a v3 rule: action, IP version, protocol, ICMP, then `from …` and `to …`.
//!
//! Contract: pure, one line, deterministic; a field that is not set is left out, so `allow`
//! alone is a rule that matches everything. Strings from the datastore are printed as JSON
//! strings (quoted, control characters escaped), so a hostile selector cannot break the line
//! or forge another column.

use crate::convert::ModelRule;
use crate::model::Port;

/// `allow tcp from selector "role == 'web'" to ports [80, 443]` and so on.
pub fn rule_text(r: &ModelRule) -> String {
    let mut parts: Vec<String> = vec![super::rules::action_name(&r.action).to_ascii_lowercase()];
    if let Some(v) = r.ip_version {
        parts.push(format!("ipv{v}"));
    }
    if let Some(p) = &r.protocol {
        parts.push(p.to_string().to_ascii_lowercase());
    }
    if let Some(p) = &r.not_protocol {
        parts.push(format!("not {}", p.to_string().to_ascii_lowercase()));
    }
    for (word, ty, code) in [
        ("icmp", r.icmp_type, r.icmp_code),
        ("not icmp", r.not_icmp_type, r.not_icmp_code),
    ] {
        match (ty, code) {
            (Some(t), Some(c)) => parts.push(format!("{word} type {t} code {c}")),
            (Some(t), None) => parts.push(format!("{word} type {t}")),
            _ => {}
        }
    }
    let from = side(Side {
        selector: &r.original_src_selector,
        namespace_selector: &r.original_src_namespace_selector,
        not_selector: &r.original_not_src_selector,
        nets: &r.src_nets,
        not_nets: &r.not_src_nets,
        ports: &r.src_ports,
        not_ports: &r.not_src_ports,
        service_accounts: r.src_service_accounts.as_ref(),
        service: r.src_service.as_ref(),
    });
    if !from.is_empty() {
        parts.push(format!("from {from}"));
    }
    let to = side(Side {
        selector: &r.original_dst_selector,
        namespace_selector: &r.original_dst_namespace_selector,
        not_selector: &r.original_not_dst_selector,
        nets: &r.dst_nets,
        not_nets: &r.not_dst_nets,
        ports: &r.dst_ports,
        not_ports: &r.not_dst_ports,
        service_accounts: r.dst_service_accounts.as_ref(),
        service: r.dst_service.as_ref(),
    });
    if !to.is_empty() {
        parts.push(format!("to {to}"));
    }
    if let Some((methods, paths)) = &r.http {
        if !methods.is_empty() {
            parts.push(format!("http methods {}", list(methods)));
        }
        let paths: Vec<String> = paths
            .iter()
            .filter_map(|p| match p {
                (Some(e), _) => Some(format!("exact {}", quoted(e))),
                (None, Some(pre)) => Some(format!("prefix {}", quoted(pre))),
                (None, None) => None,
            })
            .collect();
        if !paths.is_empty() {
            parts.push(format!("http paths [{}]", paths.join(", ")));
        }
    }
    parts.join(" ")
}

/// One side (source or destination) of a rule.
struct Side<'a> {
    selector: &'a str,
    namespace_selector: &'a str,
    not_selector: &'a str,
    nets: &'a [String],
    not_nets: &'a [String],
    ports: &'a [Port],
    not_ports: &'a [Port],
    service_accounts: Option<&'a (Vec<String>, String)>,
    service: Option<&'a (String, String)>,
}

fn side(s: Side<'_>) -> String {
    let mut out = Vec::new();
    if let Some((name, namespace)) = s.service {
        out.push(format!(
            "service {}",
            quoted(&format!("{namespace}/{name}"))
        ));
    }
    if !s.namespace_selector.is_empty() {
        out.push(format!(
            "namespaceSelector {}",
            quoted(s.namespace_selector)
        ));
    }
    if !s.selector.is_empty() {
        out.push(format!("selector {}", quoted(s.selector)));
    }
    if !s.not_selector.is_empty() {
        out.push(format!("notSelector {}", quoted(s.not_selector)));
    }
    if let Some((names, selector)) = s.service_accounts {
        if !names.is_empty() {
            out.push(format!("serviceAccounts {}", list(names)));
        }
        if !selector.is_empty() {
            out.push(format!("serviceAccountSelector {}", quoted(selector)));
        }
    }
    if !s.nets.is_empty() {
        out.push(format!("nets {}", list(s.nets)));
    }
    if !s.not_nets.is_empty() {
        out.push(format!("notNets {}", list(s.not_nets)));
    }
    if !s.ports.is_empty() {
        out.push(format!("ports {}", ports(s.ports)));
    }
    if !s.not_ports.is_empty() {
        out.push(format!("notPorts {}", ports(s.not_ports)));
    }
    out.join(" ")
}

fn quoted(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

fn list(items: &[String]) -> String {
    let q: Vec<String> = items.iter().map(|i| quoted(i)).collect();
    format!("[{}]", q.join(", "))
}

fn ports(items: &[Port]) -> String {
    let q: Vec<String> = items
        .iter()
        .map(|p| match p {
            Port::Range { .. } => p.to_string(),
            Port::Named(_) | Port::Invalid(_) => quoted(&p.to_string()),
        })
        .collect();
    format!("[{}]", q.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    #[test]
    fn a_rule_reads_as_the_operator_wrote_it() {
        assert_eq!(
            rule_text(&ModelRule {
                action: "allow".into(),
                ..Default::default()
            }),
            "allow"
        );
        let r = ModelRule {
            action: "next-tier".into(),
            ip_version: Some(4),
            protocol: Some(Protocol::Name("TCP".into())),
            original_src_selector: "role == 'web'".into(),
            original_src_namespace_selector: "all()".into(),
            src_nets: vec!["10.0.0.0/8".into()],
            dst_ports: vec![
                Port::Range { min: 80, max: 80 },
                Port::Range {
                    min: 8000,
                    max: 8080,
                },
                Port::Named("http-alt".into()),
            ],
            not_dst_nets: vec!["10.1.0.0/16".into()],
            ..Default::default()
        };
        assert_eq!(
            rule_text(&r),
            r#"pass ipv4 tcp from namespaceSelector "all()" selector "role == 'web'" nets ["10.0.0.0/8"] to notNets ["10.1.0.0/16"] ports [80, 8000:8080, "http-alt"]"#
        );
        let icmp = ModelRule {
            action: "deny".into(),
            protocol: Some(Protocol::Name("ICMP".into())),
            icmp_type: Some(8),
            icmp_code: Some(0),
            src_service_accounts: Some((vec!["api".into()], String::new())),
            dst_service: Some(("db".into(), "shop".into())),
            ..Default::default()
        };
        assert_eq!(
            rule_text(&icmp),
            r#"deny icmp icmp type 8 code 0 from serviceAccounts ["api"] to service "shop/db""#
        );
    }

    /// A selector holding a newline or a quote stays on its line and inside its quotes.
    #[test]
    fn hostile_strings_cannot_break_the_line() {
        let r = ModelRule {
            action: "deny".into(),
            original_dst_selector: "a == 'x\"\n  forged 0 allow'".into(),
            ..Default::default()
        };
        let text = rule_text(&r);
        assert!(!text.contains('\n'), "{text}");
        assert_eq!(text, r#"deny to selector "a == 'x\"\n  forged 0 allow'""#);
    }
}
