//! The one metrics writer both binaries' `/metrics` go through: prometheus-client's
//! OpenMetrics text encoder, over a [`Registry`] each binary fills once at start.
//!
//! - Event counters are prometheus-client `Counter`s (a relaxed atomic add where the event
//!   happens); a family over a fixed set of label values is [`counters_by_label`], every
//!   series there from the start.
//! - Durations are [`Histogram`]s (fixed buckets, atomic, registered like any metric).
//! - Values computed when scraped (readiness, queue lags, sizes the driver reports) come from a
//!   `Collector` the binary registers, which writes them with [`gauge`], [`gauges`] and
//!   [`counters`] on each encode, so nothing is kept for a series that no longer exists.
//!
//! Counters are registered without `_total`: the encoder appends it. Help texts are given
//! without their final period, which the registry adds (and so do the collector helpers).

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

pub use crate::histogram::{Histogram, SECONDS_BUCKETS};

/// What `/metrics` answers with: OpenMetrics 1.0 text, which Prometheus scrapes as it is.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The registry's metrics as OpenMetrics text, ending with `# EOF`.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail, and our collectors fail only when the writer does.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// A `/metrics` answer (the content type and [`encode`]'s text), as axum takes it from a
/// handler.
pub fn response(registry: &Registry) -> ([(&'static str, &'static str); 1], String) {
    ([("content-type", CONTENT_TYPE)], encode(registry))
}

/// Registers the counter family `name{label}` with one series per value in `values`, each
/// there (at 0) from the start and written in that order, and returns their counters in the
/// order of `values`.
pub fn counters_by_label(
    registry: &mut Registry,
    name: &str,
    help: &str,
    label: &'static str,
    values: &[&'static str],
) -> Vec<Counter> {
    let counters: Vec<Counter> = values.iter().map(|_| Counter::default()).collect();
    let family = FixedFamily {
        label,
        series: values.iter().copied().zip(counters.clone()).collect(),
    };
    registry.register(name, help, family);
    counters
}

/// Counters over a fixed set of values of one label (prometheus-client's `Family` would
/// write them in hash order).
#[derive(Debug)]
struct FixedFamily {
    label: &'static str,
    series: Vec<(&'static str, Counter)>,
}

impl EncodeMetric for FixedFamily {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        for (value, counter) in &self.series {
            counter.encode(encoder.encode_family(&[(self.label, *value)])?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

/// From a collector: the gauge `name` with `value`.
pub fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let help = format!("{help}.");
    let metric = encoder.encode_descriptor(name, &help, None, MetricType::Gauge)?;
    ConstGauge::new(value).encode(metric)
}

/// From a collector: the gauge family `name`, one series per label set.
pub fn gauges<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (L, u64)>,
) -> Result<(), std::fmt::Error> {
    let help = format!("{help}.");
    let mut metric = encoder.encode_descriptor(name, &help, None, MetricType::Gauge)?;
    for (labels, value) in series {
        ConstGauge::new(value).encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

/// From a collector: the counter family `name` (written `name_total`), one series per label
/// set.
pub fn counters<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (L, u64)>,
) -> Result<(), std::fmt::Error> {
    let help = format!("{help}.");
    let mut metric = encoder.encode_descriptor(name, &help, None, MetricType::Counter)?;
    for (labels, value) in series {
        ConstCounter::new(value).encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::collector::Collector;

    #[derive(Debug)]
    struct Live;

    impl Collector for Live {
        fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
            gauge(&mut encoder, "x_ready", "Ready", 1)?;
            gauges(
                &mut encoder,
                "x_lag",
                "Lag",
                [([("node", "a\"b")], 3), ([("node", "c")], 0)],
            )?;
            counters(
                &mut encoder,
                "x_rejected",
                "Rejected",
                [([("stage", "decode")], 2)],
            )
        }
    }

    #[test]
    fn writes_openmetrics_text_ending_with_eof() {
        let mut registry = Registry::default();
        let events = Counter::<u64>::default();
        registry.register("x_events", "Events", events.clone());
        let refused = counters_by_label(
            &mut registry,
            "x_refused",
            "Refused",
            "reason",
            &["limit", "timeout"],
        );
        registry.register_collector(Box::new(Live));
        events.inc_by(5);
        refused[1].inc();

        let text = encode(&registry);
        assert!(text.ends_with("\n# EOF\n"), "{text}");
        assert!(
            text.contains(
                "\nx_refused_total{reason=\"limit\"} 0\nx_refused_total{reason=\"timeout\"} 1\n"
            ),
            "in order"
        );
        for line in [
            "# HELP x_events Events.",
            "# TYPE x_events counter",
            "x_events_total 5",
            "x_refused_total{reason=\"limit\"} 0",
            "x_refused_total{reason=\"timeout\"} 1",
            "# HELP x_ready Ready.",
            "# TYPE x_ready gauge",
            "x_ready 1",
            "x_lag{node=\"a\\\"b\"} 3",
            "x_lag{node=\"c\"} 0",
            "x_rejected_total{stage=\"decode\"} 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        let (headers, body) = response(&registry);
        assert_eq!(headers[0].1, CONTENT_TYPE);
        assert_eq!(body, text);
    }
}
