//! A histogram of durations with fixed buckets, written by prometheus-client (it is an
//! [`EncodeMetric`], registered like the library's own metrics: see [`crate::metrics`]).
//! Observing is two relaxed atomic adds: it sits on the hot path of the engine and the agent's
//! apply loop, where prometheus-client's own histogram would take a lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Buckets (upper bounds, seconds) for work measured in milliseconds to seconds.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Cheap to clone: clones share the counts (one is registered, the other observes).
#[derive(Clone, Debug)]
pub struct Histogram(Arc<Counts>);

#[derive(Debug)]
struct Counts {
    bounds: &'static [f64],
    /// One per bound, then the overflow (above the last bound): not cumulative.
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new(SECONDS_BUCKETS)
    }
}

impl Histogram {
    /// A histogram with these upper bounds (seconds, ascending).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram(Arc::new(Counts {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }))
    }

    pub fn observe(&self, d: Duration) {
        let c = &self.0;
        let secs = d.as_secs_f64();
        let i = c
            .bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(c.bounds.len());
        c.counts[i].fetch_add(1, Ordering::Relaxed);
        c.sum_micros.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// The observations so far.
    pub fn count(&self) -> u64 {
        self.0
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// (upper bound, observations in that bucket alone) with `+Inf` last, the sum in seconds
    /// and the count.
    fn snapshot(&self) -> (Vec<(f64, u64)>, f64, u64) {
        let c = &self.0;
        let buckets: Vec<(f64, u64)> = c
            .bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(c.counts.iter().map(|n| n.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = c.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        (buckets, sum, count)
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        let (buckets, sum, count) = self.snapshot();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_overflow_counts_only_in_inf() {
        let h = Histogram::new(&[0.01, 1.0]);
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_secs(5));
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("x_seconds", "Test", h.clone());
        let out = crate::metrics::encode(&registry);
        assert!(
            out.starts_with("# HELP x_seconds Test.\n# TYPE x_seconds histogram\n"),
            "{out}"
        );
        assert!(out.contains("x_seconds_bucket{le=\"0.01\"} 1\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"1.0\"} 2\n"));
        assert!(out.contains("x_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(out.contains("x_seconds_sum 5.505\n"));
        assert!(out.contains("x_seconds_count 3\n"));
        assert_eq!(h.count(), 3);
    }
}
