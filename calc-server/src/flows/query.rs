//! `List`, `FilterHints` and `Statistics` over a [`FlowStore`]. See the module doc for the
//! semantics.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use felix_proto::goldmane::{
    Action, EndpointType, Filter, FilterHint, FilterHintsRequest, FilterHintsResult, FilterType,
    Flow, FlowKey, FlowListRequest, FlowListResult, FlowResult, ListMetadata, MatchType, PolicyHit,
    PolicyKind, PolicyMatch, PolicyTrace, Reporter, RuleDirection, SortBy, StatisticType,
    StatisticsGroupBy, StatisticsRequest, StatisticsResult, StringMatch,
};

use super::limits::{MAX_FILTER_ITEMS, MAX_NAME, MAX_PAGE_SIZE, MAX_PROTO};
use super::store::{BUCKET_SECONDS, Counters, FastMap, FlowStore, shown};

/// A request refused: which field, its value, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} = {value}: {reason}")]
pub struct InvalidRequest {
    pub field: &'static str,
    pub value: String,
    pub reason: String,
}

fn bad(field: &'static str, value: impl ToString, reason: impl Into<String>) -> InvalidRequest {
    InvalidRequest {
        field,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// The window `[gte, lt)` in absolute seconds.
struct Window {
    gte: i64,
    lt: i64,
}

impl FlowStore {
    fn window(&self, gte: i64, lt: i64, now: i64) -> Result<Window, InvalidRequest> {
        let abs_gte = match gte {
            0 => self.oldest_bucket(now),
            g if g < 0 => now.saturating_add(g),
            g => g,
        };
        let abs_lt = match lt {
            0 => now,
            l if l < 0 => now.saturating_add(l),
            l => l,
        };
        if abs_gte >= abs_lt {
            return Err(bad(
                "start_time_gte",
                gte,
                format!("must be before start_time_lt ({lt}); resolved to {abs_gte} and {abs_lt}"),
            ));
        }
        Ok(Window {
            gte: abs_gte,
            lt: abs_lt,
        })
    }

    /// The buckets whose start lies in the window, oldest first.
    fn buckets_in<'a>(
        &'a self,
        w: &Window,
    ) -> impl Iterator<Item = (i64, &'a FastMap<i64, Counters>)> + 'a {
        self.buckets.range(w.gte..w.lt).map(|(s, b)| (*s, b))
    }

    /// Key ids the filter selects, among the keys held.
    fn selected(&self, filter: Option<&Filter>) -> HashMap<i64, bool> {
        self.keys
            .values()
            .map(|k| (k.id, filter.is_none_or(|f| matches(f, k.flow.key()))))
            .collect()
    }

    /// `Flows.List` at `now`.
    pub fn list(
        &mut self,
        req: &FlowListRequest,
        now: i64,
    ) -> Result<FlowListResult, InvalidRequest> {
        self.expire(now);
        let w = self.window(req.start_time_gte, req.start_time_lt, now)?;
        let (page, page_size) = check_paging(req.page, req.page_size)?;
        if req.sort_by.len() > 1 {
            return Err(bad(
                "sort_by",
                format!("{} options", req.sort_by.len()),
                "at most one sort option is supported",
            ));
        }
        let sort = match req.sort_by.first() {
            None => SortBy::Time,
            Some(o) => SortBy::try_from(o.sort_by)
                .map_err(|_| bad("sort_by", o.sort_by, "unknown sort option"))?,
        };
        let interval = req.aggregation_interval;
        if interval < 0 || interval % BUCKET_SECONDS != 0 {
            return Err(bad(
                "aggregation_interval",
                interval,
                "must be a multiple of 15 seconds (zero: the whole window)",
            ));
        }
        if let Some(f) = &req.filter {
            check_filter(f)?;
        }
        let selected = self.selected(req.filter.as_ref());

        // (key id, interval start) → (counters, first bucket start, last bucket end).
        let mut groups: HashMap<(i64, i64), (Counters, i64, i64)> = HashMap::new();
        for (start, bucket) in self.buckets_in(&w) {
            for (id, c) in bucket {
                if !selected.get(id).copied().unwrap_or(false) {
                    continue;
                }
                let slot = if interval == 0 {
                    0
                } else {
                    start.div_euclid(interval) * interval
                };
                match groups.get_mut(&(*id, slot)) {
                    // Buckets come oldest first: the live count ends as the latest bucket's.
                    Some((acc, _, end)) => {
                        acc.add(c, false);
                        *end = start + BUCKET_SECONDS;
                    }
                    None => {
                        groups.insert((*id, slot), (c.clone(), start, start + BUCKET_SECONDS));
                    }
                }
            }
        }
        let mut flows: Vec<FlowResult> = groups
            .into_iter()
            .map(|((id, slot), (c, first, last_end))| {
                let (start_time, end_time) = if interval == 0 {
                    (first, last_end)
                } else {
                    (slot, slot.saturating_add(interval))
                };
                FlowResult {
                    id,
                    flow: Some(to_flow(self.keys[&id].flow.key(), &c, start_time, end_time)),
                }
            })
            .collect();
        sort_flows(&mut flows, sort);
        let (meta, flows) = paginate(flows, page, page_size);
        Ok(FlowListResult {
            meta: Some(meta),
            flows,
        })
    }

    /// `Flows.FilterHints` at `now`.
    pub fn filter_hints(
        &mut self,
        req: &FilterHintsRequest,
        now: i64,
    ) -> Result<FilterHintsResult, InvalidRequest> {
        self.expire(now);
        let w = self.window(req.start_time_gte, req.start_time_lt, now)?;
        let (page, page_size) = check_paging(req.page, req.page_size)?;
        let kind = match FilterType::try_from(req.r#type) {
            Ok(FilterType::Unspecified) | Err(_) => {
                return Err(bad("type", req.r#type, "not a filter type"));
            }
            Ok(t) => t,
        };
        if let Some(f) = &req.filter {
            check_filter(f)?;
        }
        let selected = self.selected(req.filter.as_ref());
        let mut seen: BTreeSet<i64> = BTreeSet::new();
        for (_, bucket) in self.buckets_in(&w) {
            seen.extend(bucket.keys().filter(|id| selected[*id]));
        }
        let mut values: BTreeSet<String> = BTreeSet::new();
        for id in seen {
            let k = self.keys[&id].flow.key();
            let mut push = |v: &str| {
                if !v.is_empty() {
                    values.insert(v.to_string());
                }
            };
            match kind {
                FilterType::DestName => push(&k.dest_name),
                FilterType::SourceName => push(&k.source_name),
                FilterType::DestNamespace => push(&k.dest_namespace),
                FilterType::SourceNamespace => push(&k.source_namespace),
                FilterType::PolicyTier | FilterType::PolicyName => {
                    for h in hits(k) {
                        let h = h.trigger.as_deref().unwrap_or(h);
                        push(if kind == FilterType::PolicyTier {
                            &h.tier
                        } else {
                            &h.name
                        });
                    }
                }
                FilterType::Unspecified => {}
            }
        }
        let hints = values
            .into_iter()
            .map(|value| FilterHint { value })
            .collect();
        let (meta, hints) = paginate(hints, page, page_size);
        Ok(FilterHintsResult {
            meta: Some(meta),
            hints,
        })
    }

    /// `Statistics.List` at `now` (the stream's messages, in order).
    pub fn statistics(
        &mut self,
        req: &StatisticsRequest,
        now: i64,
    ) -> Result<Vec<StatisticsResult>, InvalidRequest> {
        self.expire(now);
        let w = self.window(req.start_time_gte, req.start_time_lt, now)?;
        let stat = StatisticType::try_from(req.r#type)
            .map_err(|_| bad("type", req.r#type, "not a statistic type"))?;
        let group = StatisticsGroupBy::try_from(req.group_by)
            .map_err(|_| bad("group_by", req.group_by, "not a grouping"))?;
        if let Some(m) = &req.policy_match {
            check_policy_match("policy_match", m)?;
        }

        // Stat key → bucket start → six columns.
        let mut acc: BTreeMap<StatKey, BTreeMap<i64, [i64; 6]>> = BTreeMap::new();
        for (start, bucket) in self.buckets_in(&w) {
            for (id, c) in bucket {
                let key = self.keys[id].flow.key();
                let egress = key.reporter == Reporter::Src as i32;
                let (v_in, v_out) = match stat {
                    StatisticType::PacketCount => (c.tally.packets_in, c.tally.packets_out),
                    StatisticType::ByteCount => (c.tally.bytes_in, c.tally.bytes_out),
                    StatisticType::LiveConnectionCount if egress => (0, c.tally.live),
                    StatisticType::LiveConnectionCount => (c.tally.live, 0),
                };
                let mut counted: BTreeSet<(StatKey, usize)> = BTreeSet::new();
                for hit in hits(key) {
                    if req
                        .policy_match
                        .as_ref()
                        .is_some_and(|m| !policy_matches(m, hit))
                    {
                        continue;
                    }
                    let Some(column) = action_column(hit.action) else {
                        continue;
                    };
                    let sk = StatKey::new(hit, group, egress);
                    if !counted.insert((sk.clone(), column)) {
                        continue;
                    }
                    let cols = acc.entry(sk).or_default().entry(start).or_default();
                    cols[column] = cols[column].saturating_add(v_in);
                    cols[column + 1] = cols[column + 1].saturating_add(v_out);
                }
            }
        }
        Ok(acc
            .into_iter()
            .map(|(sk, series)| sk.result(series, group, stat, req.time_series))
            .collect())
    }
}

/// Index of a hit's action's `_in` column among allowed, denied, passed (in, out).
fn action_column(action: i32) -> Option<usize> {
    match Action::try_from(action) {
        Ok(Action::Allow) => Some(0),
        Ok(Action::Deny) => Some(2),
        Ok(Action::Pass) => Some(4),
        _ => None,
    }
}

/// What one statistics result is about; its order is the order of the results.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct StatKey {
    tier: String,
    kind: i32,
    namespace: String,
    name: String,
    /// Rule grouping only (zero otherwise): action, rule index, direction.
    action: i32,
    rule_index: i64,
    direction: i32,
}

impl StatKey {
    fn new(hit: &PolicyHit, group: StatisticsGroupBy, egress: bool) -> Self {
        // An end-of-tier hit counts for the policy that triggered it.
        let policy = match &hit.trigger {
            Some(t) if hit.kind == PolicyKind::EndOfTier as i32 => t.as_ref(),
            _ => hit,
        };
        let mut k = StatKey {
            tier: policy.tier.clone(),
            kind: policy.kind,
            namespace: policy.namespace.clone(),
            name: policy.name.clone(),
            action: hit.action,
            rule_index: 0,
            direction: RuleDirection::Any as i32,
        };
        match group {
            // Per policy, the action only picks the column: one key per policy.
            StatisticsGroupBy::Policy => k.action = 0,
            StatisticsGroupBy::PolicyRule => {
                k.rule_index = hit.rule_index;
                k.direction = if egress {
                    RuleDirection::Egress
                } else {
                    RuleDirection::Ingress
                } as i32;
            }
        }
        k
    }

    fn result(
        self,
        series: BTreeMap<i64, [i64; 6]>,
        group: StatisticsGroupBy,
        stat: StatisticType,
        time_series: bool,
    ) -> StatisticsResult {
        let mut r = StatisticsResult {
            policy: Some(PolicyHit {
                kind: self.kind,
                namespace: self.namespace,
                name: self.name,
                tier: self.tier,
                action: self.action,
                rule_index: self.rule_index,
                ..Default::default()
            }),
            direction: self.direction,
            group_by: group as i32,
            r#type: stat as i32,
            ..Default::default()
        };
        let points: Vec<(i64, [i64; 6])> = if time_series {
            series.into_iter().collect()
        } else {
            let mut sum = [0i64; 6];
            for cols in series.values() {
                for (s, c) in sum.iter_mut().zip(cols) {
                    *s = s.saturating_add(*c);
                }
            }
            vec![(0, sum)]
        };
        for (x, c) in points {
            r.allowed_in.push(c[0]);
            r.allowed_out.push(c[1]);
            r.denied_in.push(c[2]);
            r.denied_out.push(c[3]);
            r.passed_in.push(c[4]);
            r.passed_out.push(c[5]);
            if time_series {
                r.x.push(x);
            }
        }
        r
    }
}

fn check_paging(page: i64, page_size: i64) -> Result<(usize, usize), InvalidRequest> {
    if !(0..=MAX_PAGE_SIZE).contains(&page_size) {
        return Err(bad(
            "page_size",
            page_size,
            format!("must be between 0 and {MAX_PAGE_SIZE}"),
        ));
    }
    if page < 0 {
        return Err(bad("page", page, "must not be negative"));
    }
    if page > 0 && page_size == 0 {
        return Err(bad("page", page, "needs a page_size"));
    }
    let page = usize::try_from(page).map_err(|_| bad("page", page, "too large"))?;
    Ok((page, page_size as usize))
}

fn paginate<T>(items: Vec<T>, page: usize, page_size: usize) -> (ListMetadata, Vec<T>) {
    let total = items.len();
    let (pages, items) = if page_size == 0 {
        (usize::from(total > 0), items)
    } else {
        let pages = total.div_ceil(page_size);
        let from = page.saturating_mul(page_size).min(total);
        let items = items.into_iter().skip(from).take(page_size).collect();
        (pages, items)
    };
    (
        ListMetadata {
            total_pages: pages as i64,
            total_results: total as i64,
        },
        items,
    )
}

fn endpoint_type_name(t: i32) -> &'static str {
    EndpointType::try_from(t).map_or("", |t| t.as_str_name())
}

fn sort_flows(flows: &mut [FlowResult], sort: SortBy) {
    let field = |r: &FlowResult| -> String {
        let k = r.flow.as_ref().and_then(|f| f.key.as_ref());
        let Some(k) = k else { return String::new() };
        match sort {
            SortBy::Time => String::new(),
            SortBy::DestName => k.dest_name.clone(),
            SortBy::DestNamespace => k.dest_namespace.clone(),
            SortBy::DestType => endpoint_type_name(k.dest_type).to_string(),
            SortBy::SourceName => k.source_name.clone(),
            SortBy::SourceNamespace => k.source_namespace.clone(),
            SortBy::SourceType => endpoint_type_name(k.source_type).to_string(),
        }
    };
    let start = |r: &FlowResult| r.flow.as_ref().map_or(0, |f| f.start_time);
    flows.sort_by_cached_key(|r| (field(r), std::cmp::Reverse(start(r)), r.id));
}

fn to_flow(key: &FlowKey, c: &Counters, start_time: i64, end_time: i64) -> Flow {
    Flow {
        key: Some(key.clone()),
        start_time,
        end_time,
        source_labels: c.source_labels.to_vec(),
        dest_labels: c.dest_labels.to_vec(),
        packets_in: c.tally.packets_in,
        packets_out: c.tally.packets_out,
        bytes_in: c.tally.bytes_in,
        bytes_out: c.tally.bytes_out,
        num_connections_started: c.tally.started,
        num_connections_completed: c.tally.completed,
        num_connections_live: c.tally.live,
    }
}

/// Every hit of both traces.
fn hits(k: &FlowKey) -> impl Iterator<Item = &PolicyHit> {
    let t: Option<&PolicyTrace> = k.policies.as_ref();
    t.into_iter()
        .flat_map(|t| t.enforced_policies.iter().chain(&t.pending_policies))
}

fn string_matches(list: &[StringMatch], value: &str) -> bool {
    list.is_empty()
        || list.iter().any(|m| {
            if m.r#type == MatchType::Fuzzy as i32 {
                value.contains(m.value.as_str())
            } else {
                value == m.value
            }
        })
}

fn policy_matches(m: &PolicyMatch, hit: &PolicyHit) -> bool {
    let one = |h: &PolicyHit| {
        (m.kind == PolicyKind::KindUnspecified as i32 || m.kind == h.kind)
            && (m.tier.is_empty() || m.tier == h.tier)
            && (m.namespace.is_empty() || m.namespace == h.namespace)
            && (m.name.is_empty() || m.name == h.name)
            && (m.action == Action::Unspecified as i32 || m.action == h.action)
    };
    if one(hit) {
        return true;
    }
    // An end-of-tier hit also answers for its tier's policy (kind and action stay the hit's).
    match &hit.trigger {
        Some(t) if hit.kind == PolicyKind::EndOfTier as i32 => one(&PolicyHit {
            kind: hit.kind,
            action: hit.action,
            tier: t.tier.clone(),
            namespace: t.namespace.clone(),
            name: t.name.clone(),
            ..Default::default()
        }),
        _ => false,
    }
}

/// Whether the filter selects a flow of this key.
pub(super) fn matches(f: &Filter, k: &FlowKey) -> bool {
    string_matches(&f.source_names, &k.source_name)
        && string_matches(&f.source_namespaces, &k.source_namespace)
        && string_matches(&f.dest_names, &k.dest_name)
        && string_matches(&f.dest_namespaces, &k.dest_namespace)
        && string_matches(&f.protocols, &k.proto)
        && (f.dest_ports.is_empty() || f.dest_ports.iter().any(|p| p.port == k.dest_port))
        && (f.actions.is_empty() || f.actions.contains(&k.action))
        && (f.policies.is_empty()
            || f.policies
                .iter()
                .any(|m| hits(k).any(|h| policy_matches(m, h))))
}

fn check_strings(
    field: &'static str,
    list: &[StringMatch],
    max: usize,
) -> Result<(), InvalidRequest> {
    if list.len() > MAX_FILTER_ITEMS {
        return Err(bad(
            field,
            format!("{} entries", list.len()),
            format!("at most {MAX_FILTER_ITEMS}"),
        ));
    }
    for m in list {
        if m.value.len() > max {
            return Err(bad(
                field,
                shown(&m.value),
                format!("longer than {max} bytes"),
            ));
        }
        if MatchType::try_from(m.r#type).is_err() {
            return Err(bad(field, m.r#type, "not a match type"));
        }
    }
    Ok(())
}

fn check_policy_match(field: &'static str, m: &PolicyMatch) -> Result<(), InvalidRequest> {
    if PolicyKind::try_from(m.kind).is_err() {
        return Err(bad(field, m.kind, "not a policy kind"));
    }
    if Action::try_from(m.action).is_err() {
        return Err(bad(field, m.action, "not an action"));
    }
    for s in [&m.tier, &m.namespace, &m.name] {
        if s.len() > MAX_NAME {
            return Err(bad(
                field,
                shown(s),
                format!("longer than {MAX_NAME} bytes"),
            ));
        }
    }
    Ok(())
}

fn check_filter(f: &Filter) -> Result<(), InvalidRequest> {
    check_strings("filter.source_names", &f.source_names, MAX_NAME)?;
    check_strings("filter.source_namespaces", &f.source_namespaces, MAX_NAME)?;
    check_strings("filter.dest_names", &f.dest_names, MAX_NAME)?;
    check_strings("filter.dest_namespaces", &f.dest_namespaces, MAX_NAME)?;
    check_strings("filter.protocols", &f.protocols, MAX_PROTO)?;
    let too_many = |field: &'static str, n: usize| {
        bad(
            field,
            format!("{n} entries"),
            format!("at most {MAX_FILTER_ITEMS}"),
        )
    };
    if f.dest_ports.len() > MAX_FILTER_ITEMS {
        return Err(too_many("filter.dest_ports", f.dest_ports.len()));
    }
    if let Some(p) = f.dest_ports.iter().find(|p| !(0..=65535).contains(&p.port)) {
        return Err(bad("filter.dest_ports", p.port, "not a port"));
    }
    if f.actions.len() > MAX_FILTER_ITEMS {
        return Err(too_many("filter.actions", f.actions.len()));
    }
    if let Some(a) = f.actions.iter().find(|a| Action::try_from(**a).is_err()) {
        return Err(bad("filter.actions", a, "not an action"));
    }
    if f.policies.len() > MAX_FILTER_ITEMS {
        return Err(too_many("filter.policies", f.policies.len()));
    }
    for m in &f.policies {
        check_policy_match("filter.policies", m)?;
    }
    Ok(())
}
