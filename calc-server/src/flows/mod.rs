//! The flow aggregator's store (issue 42): flow records from the agents, already named, kept in
//! 15-second buckets for about an hour and queried as Calico's Goldmane answers its `Flows.List`,
//! `Flows.FilterHints` and `Statistics.List`. Fed by the serving engine with the agents' named
//! records (`serve::engine::flows`, `serve --flow-logs`), listed as JSON on the admin endpoint
//! (`/flows`, `/flows-filter-hints`) and through Goldmane's gRPC services
//! (`serve::goldmane_api`). This is the pure part, with no IO, no clock and no async. Every
//! call takes `now` (seconds since the Unix epoch) from its caller.
//!
//! Records and answers are the generated Goldmane types (`felix_proto::goldmane`), so the wire
//! API is a thin layer on top. A record ([`FlowRecord`]) is a `goldmane::Flow` whose `start_time`
//! says which bucket it counts in (its `end_time` is not used); what identifies it is its `Key`
//! (a `goldmane::FlowKey`, policy trace included), compared field by field.
//!
//! # Storage
//! - Bucket `b` covers `[b, b + 15)` with `b = floor(t / 15) · 15`. The store holds
//!   [`FlowStore::num_buckets`] buckets (at least [`MIN_BUCKETS`] = 242, as Goldmane: the newest
//!   one starts 15 s after the bucket holding `now`, to absorb clock skew between nodes). Older
//!   buckets are dropped as `now` moves on, and with them the keys no bucket holds any more.
//! - Two records of one key in one bucket add up: packets and bytes in and out, connections
//!   started, completed and live (each record is one node's report for the interval, so the
//!   live connections of two nodes add up); the labels of each side are intersected.
//! - Memory bound: at most `max_keys` distinct keys are held. A record of a new key beyond that
//!   is dropped and counted ([`DropCounts::key_cap`]); so are records outside the kept window
//!   (`too_old`, `in_future`) and invalid ones (`invalid`: a missing key, a string or list beyond
//!   its bound, a negative counter, an unknown enum value). Held memory is thus at most
//!   `max_keys` keys and `max_keys × num_buckets` counter sets, each bounded in size.
//!
//! # Queries, and what we chose where Goldmane's behaviour was unclear
//! - Time window (`start_time_gte`, `start_time_lt`, seconds): `gte` zero means the oldest bucket
//!   held, negative means `now + gte`; `lt` zero means `now`, negative `now + lt`; after that
//!   `gte < lt` or the request is refused (Goldmane's rules). A bucket is in the window when its
//!   start is: `gte <= start < lt`.
//! - `aggregation_interval`: zero gives one flow per key over the whole window, from the start
//!   of its first bucket with data to the end of its last (as Goldmane's `List`). A positive
//!   multiple of 15 gives one flow per key per interval, intervals aligned on multiples of the
//!   interval since the epoch (stable across queries and pages). Anything else is refused,
//!   naming the value. Over several buckets the counters add up, except the live connections,
//!   which are those of the latest bucket (the field means "live at the flow's end").
//! - Filter: each list is a disjunction and the lists a conjunction; an empty list selects
//!   everything. `Fuzzy` is a substring match, `Exact` equality. A policy match selects a flow
//!   when one hit of its enforced or pending trace has every non-empty field of the match
//!   (kind, tier, namespace, name, action); for an end-of-tier hit, the tier, namespace and
//!   name are also compared with its trigger's (the tier's own policy).
//! - Sort (at most one option, as Goldmane): `Time` (default) is newest first; the name,
//!   namespace and type options sort by that field ascending (a type by its enum name),
//!   then newest first. Goldmane itself refuses `DestType` and `SourceType`; we accept them.
//!   Ties end with the flow id, so the order is total and paging is stable.
//! - Paging: `page` is zero-based; `page_size` zero means everything on one page. The metadata
//!   gives the total results and pages (`ceil(results / page_size)`; one page when `page_size`
//!   is zero and there are results). A page past the end is empty, not an error.
//! - [`FlowResult`] ids are given to a key when it is first stored and kept while it is held.
//! - Filter hints: the distinct non-empty values of the field among the flows of the window the
//!   filter selects, ascending, paged as above. For policy tiers and names every hit of both
//!   traces counts, an end-of-tier hit by its trigger's value (Goldmane does the same).
//! - Statistics: each bucket's counters of a key count once for every distinct policy
//!   (kind, tier, namespace, name) of its enforced and pending traces, under the action the
//!   policy took (a flow whose pending trace denies what the enforced one allowed counts as both
//!   allowed and denied for that policy), and once for every distinct rule (policy, action,
//!   rule index, direction). An end-of-tier hit counts for its trigger policy with its own
//!   action and rule index. Direction: a source report is egress, a destination report
//!   ingress. `PacketCount` and `ByteCount` give packets or bytes in and out; for
//!   `LiveConnectionCount` the `_in` columns hold ingress live connections and `_out` egress.
//!   The policy match is compared with the hit as above (Goldmane compares the action of the
//!   policy-level key, which has none). Grouped by policy the direction is `Any`. Without
//!   `time_series` every column has one value, the sum over the window, and `x` is empty; with
//!   it, one value per bucket in which that policy or rule had data, `x` holding the bucket
//!   starts (sparse, as Goldmane). Results are ordered by tier, kind, namespace, name, action,
//!   rule index and direction. (Goldmane's rule key uses the policy index where the rule index
//!   belongs, and adds a flow to a policy once per rule; we use the rule index and add once.)
//! - Validation: every refusal is a [`InvalidRequest`] naming the field and the value; lists
//!   and strings in requests are bounded ([`limits`]).
//!
//! Not done here: de-duplication of records re-sent after a reconnect (the ingest layer's job,
//! `serve::engine::flows`), and `Flows.Stream` (polled over `list` by `serve::goldmane_api`).

mod query;
pub(crate) mod store;
#[cfg(test)]
mod tests;
pub mod words;

pub use felix_proto::goldmane;
pub use query::InvalidRequest;
pub use store::{
    BUCKET_SECONDS, DropCounts, FlowRecord, FlowStore, Labels, MIN_BUCKETS, PreparedFlow, Refused,
    Tally,
};

/// Re-exported so callers can name the answers without reaching into the proto crate.
pub use goldmane::{
    FilterHintsRequest, FilterHintsResult, FlowListRequest, FlowListResult, FlowResult,
    StatisticsRequest, StatisticsResult,
};

/// Bounds on what a record or a request may hold.
pub mod limits {
    /// A name, namespace, service name, tier or policy name (a DNS subdomain's bound).
    pub const MAX_NAME: usize = 253;
    /// A protocol name (`tcp`, `udp`, `sctp`, `icmp`, or a number).
    pub const MAX_PROTO: usize = 32;
    /// One label, as `key=value`.
    pub const MAX_LABEL: usize = 384;
    /// Labels on one side of a record.
    pub const MAX_LABELS: usize = 128;
    /// Hits in one trace (enforced or pending).
    pub const MAX_HITS: usize = 64;
    /// Entries in one list of a filter.
    pub const MAX_FILTER_ITEMS: usize = 64;
    /// Results on one page.
    pub const MAX_PAGE_SIZE: i64 = 10_000;
}
