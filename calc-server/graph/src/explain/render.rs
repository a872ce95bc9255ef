//! The text form of explain answers, as `calc-server explain` prints them.
//!
//! Contract: a pure function of the answer (no graph access); every line names what decided
//! and why, so the text alone explains the verdict.

use super::{
    DecidedBy, Dir, EndpointPolicies, Explanation, Peer, PolicyReach, Step, TierPolicies, Verdict,
};

fn decided_text(d: &DecidedBy) -> String {
    match d {
        DecidedBy::Policy {
            tier,
            policy,
            kind,
            rule,
        } => format!(
            "{kind} {policy} (tier {tier}), rule {} ({})",
            rule.index, rule.action
        ),
        DecidedBy::Profile { profile, rule } => {
            format!("profile {profile}, rule {} ({})", rule.index, rule.action)
        }
        DecidedBy::Default { default } => default.clone(),
    }
}

fn verdict_text(v: Verdict) -> &'static str {
    match v {
        Verdict::Allow => "ALLOW",
        Verdict::Deny => "DENY",
    }
}

fn peer_text(p: &Peer) -> String {
    let mut s = format!("{} {} ({}", p.kind, p.name, p.ip);
    if let Some(node) = &p.node {
        s.push_str(&format!(", node {node}"));
    }
    s.push(')');
    if !p.network_sets.is_empty() {
        s.push_str(&format!(" in network sets {}", p.network_sets.join(", ")));
    }
    s
}

fn step_text(s: &Step) -> String {
    let mut what = Vec::new();
    if let Some(e) = &s.endpoint {
        what.push(e.clone());
    }
    if let Some(t) = &s.tier {
        what.push(format!("tier {t}"));
    }
    if let (Some(p), Some(k)) = (&s.policy, &s.kind) {
        what.push(format!("{k} {p}"));
    }
    if let Some(p) = &s.profile {
        what.push(format!("profile {p}"));
    }
    let mut line = format!("  [{}] ", s.stage);
    if !what.is_empty() {
        line.push_str(&what.join(" / "));
        line.push_str(": ");
    }
    if let (Some(false), Some(sel)) = (s.selected, &s.selector) {
        line.push_str(&format!("{} (selector `{sel}`)", s.outcome));
    } else {
        if let Some(r) = &s.rule {
            line.push_str(&format!("rule {} ({}) matched → ", r.index, r.action));
        }
        line.push_str(&s.outcome);
    }
    for m in &s.not_matched {
        line.push_str(&format!(
            "\n      rule {} ({}) did not match: {}",
            m.index, m.action, m.why
        ));
    }
    if let Some(n) = &s.note {
        line.push_str(&format!("\n      note: {n}"));
    }
    line
}

/// The text form: the path, one line per step, like `policy-assistant`.
pub fn render_text(e: &Explanation) -> String {
    let mut out = String::new();
    let port = e.port.map(|p| format!(" port {p}")).unwrap_or_default();
    out.push_str(&format!(
        "{} {}{}\n  from {}\n  to   {}\n",
        verdict_text(e.verdict),
        e.protocol,
        port,
        peer_text(&e.from),
        peer_text(&e.to)
    ));
    for (title, side) in [("egress", &e.egress), ("ingress", &e.ingress)] {
        out.push_str(&format!(
            "\n{title} of {}: {} — decided by {}\n",
            side.endpoint.as_deref().unwrap_or("(outside the cluster)"),
            verdict_text(side.verdict),
            decided_text(&side.decided_by)
        ));
        for s in &side.steps {
            out.push_str(&step_text(s));
            out.push('\n');
        }
    }
    if let Some(p) = &e.pending {
        out.push_str(&format!(
            "\npending (staged policies enforced): {}\n",
            verdict_text(p.verdict)
        ));
        for (title, side) in [("egress", &p.egress), ("ingress", &p.ingress)] {
            out.push_str(&format!(
                "  {title}: {} — decided by {}\n",
                verdict_text(side.verdict),
                decided_text(&side.decided_by)
            ));
            let staged = side.steps.iter().filter(|s| {
                s.selected == Some(true)
                    && s.kind
                        .as_deref()
                        .is_some_and(calico_names::is_staged_policy_kind)
            });
            for s in staged {
                out.push_str("  ");
                out.push_str(&step_text(s));
                out.push('\n');
            }
        }
    }
    out
}

fn tier_lines(out: &mut String, title: &str, tiers: &[TierPolicies]) {
    if tiers.is_empty() {
        out.push_str(&format!("  {title}: no policy\n"));
        return;
    }
    out.push_str(&format!("  {title}:\n"));
    for t in tiers {
        let default = if t.default_action.is_empty() {
            "no Tier resource: Deny".to_string()
        } else {
            t.default_action.clone()
        };
        out.push_str(&format!("    tier {} (end of tier: {default})\n", t.tier));
        for (i, p) in t.policies.iter().enumerate() {
            out.push_str(&format!(
                "      {}. {} {}  selector `{}`\n",
                i + 1,
                p.kind,
                p.policy,
                p.selector
            ));
        }
    }
}

/// The text form of `explain --endpoint`.
pub fn render_endpoint_text(e: &EndpointPolicies) -> String {
    let mut out = format!(
        "{} {}{} addresses {}\n",
        e.endpoint.kind,
        e.endpoint.name,
        e.endpoint
            .node
            .as_ref()
            .map(|n| format!(" on node {n},"))
            .unwrap_or_default(),
        e.addresses.join(", ")
    );
    for c in &e.chains {
        out.push_str(&format!("[{}]\n", c.stage));
        tier_lines(&mut out, "ingress", &c.ingress);
        tier_lines(&mut out, "egress", &c.egress);
    }
    out.push_str(&format!(
        "profiles (after the tiers, first Allow wins): {}\n",
        if e.profiles.is_empty() {
            "none".to_string()
        } else {
            e.profiles.join(", ")
        }
    ));
    out
}

/// The text form of `explain --policy`.
pub fn render_policy_text(p: &PolicyReach) -> String {
    let types: Vec<&str> = p
        .types
        .iter()
        .map(|t| match t {
            Dir::Ingress => "Ingress",
            Dir::Egress => "Egress",
        })
        .collect();
    let mut out = format!(
        "{} {} (tier {}, types {}) selector `{}`\n",
        p.kind,
        p.policy,
        p.tier,
        types.join(", "),
        p.selector
    );
    out.push_str(&format!("selects {} endpoint(s):\n", p.endpoints.len()));
    for e in &p.endpoints {
        out.push_str(&format!("  {e}\n"));
    }
    out.push_str(&format!("active on {} node(s):\n", p.nodes.len()));
    for n in &p.nodes {
        out.push_str(&format!("  {n}\n"));
    }
    out
}
