//! Small utilities both binaries (and the benchmark tools) share, so that each exists once:
//! jittered back-off, a deterministic RNG, duration flags, logging set-up, the shutdown signal,
//! the task tracker (spans, cancellation, bounded shutdown), RFC 3339 timestamps, and the one
//! metrics writer (prometheus-client's OpenMetrics text) with fixed-bucket histograms.
//!
//! Nothing here knows Calico, the graph or the dataplane.

pub mod backoff;
pub mod duration;
pub mod histogram;
pub mod logging;
pub mod metrics;
pub mod rng;
pub mod shutdown;
pub mod tasks;
pub mod time;

pub use backoff::Backoff;
pub use duration::{DurationError, parse_duration};
pub use histogram::Histogram;
pub use logging::{LogFormat, init_logging};
pub use rng::Rng;
pub use shutdown::shutdown_signal;
pub use tasks::Tasks;
pub use time::rfc3339_utc;
