//! One endpoint chain walked for one packet, as the Linux dataplane renders it (Felix's
//! `rules/endpoints.go`): failsafes (host endpoints), the encapsulation drops (workload egress),
//! then per tier the endpoint's policies in order — first matching rule decides, Pass skips to
//! the next tier, Log goes on — with a drop at the end of a tier unless it passed or its default
//! is Pass (normal and forward chains only), then the profiles (normal chains only), first Allow
//! wins, else drop. Untracked and pre-DNAT chains give no verdict when nothing matched; a
//! forward chain of an endpoint with no forward tiers at all allows.
//!
//! Contract: pure; the policies, profiles and sets come from [`State`], and every policy and
//! tier passed over is recorded as a [`Step`], so the walk reads the same as the verdict.

use felix_proto as pb;

use super::rules::{Sets, action_name, rule_matches};
use super::{DecidedBy, Dir, Packet, RuleMiss, RuleRef, Stage, Step};

/// What the walk reads from the calculation graph.
pub trait State: Sets {
    /// The rules of an active policy.
    fn policy(&self, id: &pb::PolicyId) -> Option<&pb::Policy>;
    /// The rules of a profile (a missing profile's are Felix's deny-all ones).
    fn profile(&self, name: &str) -> std::borrow::Cow<'_, pb::Profile>;
    /// Every policy of `tier` that takes part in `stage` and `dir`, in evaluation order, with
    /// its selector: the ones that do not select the endpoint are shown as passed over.
    fn tier_policies(&self, tier: &str, stage: Stage, dir: Dir) -> Vec<(pb::PolicyId, String)>;
    /// Every tier holding a policy for `stage` and `dir`, in order.
    fn tiers(&self, stage: Stage, dir: Dir) -> Vec<String>;
    /// Whether staged policies are evaluated as if enforced (the pending verdict); otherwise
    /// they are passed over, as every driver leaves them out.
    fn enforce_staged(&self) -> bool;
}

fn is_staged(id: &pb::PolicyId) -> bool {
    calico_names::is_staged_policy_kind(&id.kind)
}

/// A chain's result.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Allow(DecidedBy),
    Deny(DecidedBy),
    /// No verdict: the packet goes on to whatever follows the chain.
    Continue,
}

/// A failsafe port: open whatever policy says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failsafe {
    pub protocol: u8,
    pub port: u16,
}

/// One chain to walk.
pub struct Chain<'a> {
    pub stage: Stage,
    pub dir: Dir,
    pub tiers: &'a [pb::TierInfo],
    pub profiles: &'a [String],
    pub failsafes: &'a [Failsafe],
    /// Workload egress: VXLAN and IP-in-IP packets from a workload are dropped first.
    pub drop_encap: bool,
}

/// How many passed-over policies a tier lists before summing up the rest.
const MAX_UNSELECTED_SHOWN: usize = 20;

/// `namespace/name` of a namespaced policy, else its name.
pub(crate) fn policy_label(id: &pb::PolicyId) -> String {
    if id.namespace.is_empty() {
        id.name.clone()
    } else {
        format!("{}/{}", id.namespace, id.name)
    }
}

/// Evaluates a rule list: the first rule that matches with a verdict (Log only notes), and
/// why each rule before it did not match.
fn first_match(
    rules: &[pb::Rule],
    p: &Packet,
    sets: &dyn Sets,
    misses: &mut Vec<RuleMiss>,
    logged: &mut Vec<usize>,
) -> Option<(usize, &'static str)> {
    for (index, r) in rules.iter().enumerate() {
        let action = action_name(&r.action);
        match rule_matches(r, p, sets) {
            Ok(()) if action == "Log" => logged.push(index),
            Ok(()) => return Some((index, action)),
            Err(why) => misses.push(RuleMiss {
                index,
                action: action.to_string(),
                why,
            }),
        }
    }
    None
}

fn step(stage: Stage, outcome: impl Into<String>) -> Step {
    Step {
        stage: stage.label(),
        outcome: outcome.into(),
        ..Step::default()
    }
}

/// Walks one chain, appending its steps.
pub fn walk(c: &Chain<'_>, p: &Packet, state: &dyn State, steps: &mut Vec<Step>) -> Outcome {
    let stage = c.stage;
    if let Some(fs) = c
        .failsafes
        .iter()
        .find(|f| f.protocol == p.protocol && Some(f.port) == p.dst_port)
    {
        let what = format!(
            "failsafe {}:{}",
            super::rules::protocol_name(fs.protocol).to_lowercase(),
            fs.port
        );
        steps.push(step(
            stage,
            format!("allow: {what} (open whatever policy says)"),
        ));
        return Outcome::Allow(DecidedBy::Default { default: what });
    }
    if c.drop_encap {
        let encap = if p.protocol == 17 && p.dst_port == Some(4789) {
            Some("VXLAN")
        } else if p.protocol == 4 {
            Some("IP-in-IP")
        } else {
            None
        };
        if let Some(encap) = encap {
            let why = format!("{encap} packets from workloads are dropped");
            steps.push(step(stage, format!("deny: {why}")));
            return Outcome::Deny(DecidedBy::Default { default: why });
        }
    }

    // Every tier with policies for this direction, in order: the ones that select nothing
    // here are not in the endpoint's chain (no end-of-tier drop either).
    let order = state.tiers(stage, c.dir);
    let enforce_staged = state.enforce_staged();
    // The policies of a tier the chain evaluates: staged ones only for the pending verdict.
    let evaluated = |t: &pb::TierInfo| -> Vec<pb::PolicyId> {
        policies_of(t, c.dir)
            .iter()
            .filter(|id| enforce_staged || !is_staged(id))
            .cloned()
            .collect()
    };
    let mut sequence: Vec<Result<&pb::TierInfo, (String, &'static str)>> = Vec::new();
    const NOT_SELECTED: &str = "not applied: no policy in this tier selects the endpoint";
    const ONLY_STAGED: &str = "not applied: only staged policies select the endpoint here (not enforced; no end-of-tier drop)";
    for name in &order {
        match c.tiers.iter().find(|t| &t.name == name) {
            Some(t) if !evaluated(t).is_empty() => sequence.push(Ok(t)),
            Some(t) if !policies_of(t, c.dir).is_empty() => {
                sequence.push(Err((name.clone(), ONLY_STAGED)))
            }
            _ => sequence.push(Err((name.clone(), NOT_SELECTED))),
        }
    }
    for t in c.tiers {
        if !policies_of(t, c.dir).is_empty() && !order.contains(&t.name) {
            if evaluated(t).is_empty() {
                sequence.push(Err((t.name.clone(), ONLY_STAGED)));
            } else {
                sequence.push(Ok(t));
            }
        }
    }

    for tier in sequence {
        let tier = match tier {
            Ok(t) => t,
            Err((name, why)) => {
                steps.push(Step {
                    tier: Some(name),
                    ..step(stage, why)
                });
                continue;
            }
        };
        let selected = policies_of(tier, c.dir);
        let mut all = state.tier_policies(&tier.name, stage, c.dir);
        // The graph's full list, in order, must agree with what the node was sent; if it
        // ever did not, walk exactly what was sent.
        let agrees = all
            .iter()
            .filter(|(id, _)| selected.contains(id))
            .map(|(id, _)| id)
            .eq(selected.iter());
        if !agrees {
            all = selected
                .iter()
                .map(|id| (id.clone(), String::new()))
                .collect();
        }
        let mut unselected_shown = 0;
        let mut unselected_hidden = 0;
        let mut passed = false;
        for (id, selector) in &all {
            let is_selected = selected.contains(id);
            let base = Step {
                tier: Some(tier.name.clone()),
                policy: Some(policy_label(id)),
                kind: Some(id.kind.clone()),
                selected: Some(is_selected),
                selector: (!selector.is_empty()).then(|| selector.clone()),
                ..step(stage, "")
            };
            if !is_selected {
                if unselected_shown < MAX_UNSELECTED_SHOWN {
                    unselected_shown += 1;
                    steps.push(Step {
                        outcome: "does not select the endpoint".into(),
                        ..base
                    });
                } else {
                    unselected_hidden += 1;
                }
                continue;
            }
            if !enforce_staged && is_staged(id) {
                steps.push(Step {
                    outcome: "staged: not enforced (see the pending verdict)".into(),
                    ..base
                });
                continue;
            }
            if passed {
                steps.push(Step {
                    outcome: "skipped: an earlier policy in this tier passed".into(),
                    ..base
                });
                continue;
            }
            let Some(policy) = state.policy(id) else {
                steps.push(Step {
                    outcome: "no rules known (not active): no match".into(),
                    ..base
                });
                continue;
            };
            let rules = match c.dir {
                Dir::Ingress => &policy.inbound_rules,
                Dir::Egress => &policy.outbound_rules,
            };
            let mut misses = Vec::new();
            let mut logged = Vec::new();
            let hit = first_match(rules, p, state, &mut misses, &mut logged);
            let logged_note = (!logged.is_empty()).then(|| {
                format!(
                    "logged by rule{} {}",
                    if logged.len() > 1 { "s" } else { "" },
                    logged
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            });
            let mut s = Step {
                not_matched: misses,
                note: logged_note,
                ..base
            };
            match hit {
                None => {
                    s.outcome = if rules.is_empty() {
                        "no rules for this direction: next policy".into()
                    } else {
                        "no rule matched: next policy".into()
                    };
                    steps.push(s);
                }
                Some((index, action)) => {
                    let rule = RuleRef {
                        index,
                        action: action.to_string(),
                    };
                    s.rule = Some(rule.clone());
                    let decided = DecidedBy::Policy {
                        tier: tier.name.clone(),
                        policy: policy_label(id),
                        kind: id.kind.clone(),
                        rule,
                    };
                    match action {
                        "Allow" => {
                            s.outcome = "allow".into();
                            steps.push(s);
                            return Outcome::Allow(decided);
                        }
                        "Pass" => {
                            s.outcome = "pass: on to the next tier".into();
                            steps.push(s);
                            passed = true;
                        }
                        _ => {
                            s.outcome = "deny".into();
                            steps.push(s);
                            return Outcome::Deny(decided);
                        }
                    }
                }
            }
        }
        if unselected_hidden > 0 {
            steps.push(Step {
                tier: Some(tier.name.clone()),
                ..step(
                    stage,
                    format!("{unselected_hidden} more policies do not select the endpoint"),
                )
            });
        }
        if passed {
            continue;
        }
        let tier_step = |outcome: String| Step {
            tier: Some(tier.name.clone()),
            ..step(stage, outcome)
        };
        let drops = matches!(stage, Stage::Normal | Stage::Forward)
            && !tier.default_action.eq_ignore_ascii_case("pass");
        if drops {
            let shown = if tier.default_action.is_empty() {
                "no Tier resource: Deny".to_string()
            } else {
                format!("default action {}", tier.default_action)
            };
            steps.push(tier_step(format!("end of tier ({shown}): deny")));
            return Outcome::Deny(DecidedBy::Default {
                default: format!("end-of-tier {}", tier.name),
            });
        }
        steps.push(tier_step(match stage {
            Stage::Normal | Stage::Forward => "end of tier (default action Pass): next tier".into(),
            _ => "end of tier: next tier (no end-of-tier drop in this chain)".into(),
        }));
    }

    match stage {
        Stage::Forward if c.tiers.is_empty() => {
            steps.push(step(
                stage,
                "allow: no forward policy on this host endpoint",
            ));
            Outcome::Allow(DecidedBy::Default {
                default: "no forward policy".into(),
            })
        }
        Stage::Normal => profiles(c, p, state, steps),
        _ => {
            steps.push(step(stage, "no verdict: on to the next stage"));
            Outcome::Continue
        }
    }
}

fn policies_of(t: &pb::TierInfo, dir: Dir) -> &[pb::PolicyId] {
    match dir {
        Dir::Ingress => &t.ingress_policies,
        Dir::Egress => &t.egress_policies,
    }
}

fn profiles(c: &Chain<'_>, p: &Packet, state: &dyn State, steps: &mut Vec<Step>) -> Outcome {
    for name in c.profiles {
        let profile = state.profile(name);
        let rules = match c.dir {
            Dir::Ingress => &profile.inbound_rules,
            Dir::Egress => &profile.outbound_rules,
        };
        let mut misses = Vec::new();
        let mut logged = Vec::new();
        let hit = first_match(rules, p, state, &mut misses, &mut logged);
        let mut s = Step {
            profile: Some(name.clone()),
            not_matched: misses,
            ..step(c.stage, "")
        };
        match hit {
            Some((index, action @ ("Allow" | "Deny"))) => {
                let rule = RuleRef {
                    index,
                    action: action.to_string(),
                };
                s.rule = Some(rule.clone());
                s.outcome = action.to_lowercase();
                steps.push(s);
                let decided = DecidedBy::Profile {
                    profile: name.clone(),
                    rule,
                };
                return if action == "Allow" {
                    Outcome::Allow(decided)
                } else {
                    Outcome::Deny(decided)
                };
            }
            Some((index, action)) => {
                s.rule = Some(RuleRef {
                    index,
                    action: action.to_string(),
                });
                s.outcome = "pass in a profile: next profile".into();
                steps.push(s);
            }
            None => {
                s.outcome = "no rule matched: next profile".into();
                steps.push(s);
            }
        }
    }
    let default = if c.profiles.is_empty() {
        "no policy and no profile"
    } else {
        "no profile matched"
    };
    steps.push(step(c.stage, format!("deny: {default}")));
    Outcome::Deny(DecidedBy::Default {
        default: default.into(),
    })
}
