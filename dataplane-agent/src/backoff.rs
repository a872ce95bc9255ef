//! Jittered exponential back-off with a tiny xorshift generator (no `rand` needed).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Delays of `min * 2^n`, capped at `max`, each jittered down to between half and all of it
/// (never below `min`).
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    failures: u32,
    rng: u64,
}

impl Backoff {
    /// A back-off between `min` and `max` (`max` is raised to `min` if smaller).
    pub fn new(min: Duration, max: Duration) -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Self::with_seed(min, max, nanos ^ (u64::from(std::process::id()) << 32))
    }

    /// As [`Backoff::new`] with a fixed seed (for tests).
    pub fn with_seed(min: Duration, max: Duration, seed: u64) -> Self {
        Self {
            min,
            max: max.max(min),
            failures: 0,
            rng: seed | 1,
        }
    }

    /// Forgets past failures: the next delay is about `min` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// The longest delay.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The delay before the next attempt; each call counts one more failure.
    pub fn next_delay(&mut self) -> Duration {
        let factor = 1u32 << self.failures.min(20);
        self.failures = self.failures.saturating_add(1);
        let base = self.min.saturating_mul(factor).min(self.max);
        // Uniform in [base/2, base].
        let half = base / 2;
        let fraction = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let jittered = half + half.mul_f64(fraction);
        jittered.clamp(self.min, self.max)
    }

    fn next_u64(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_exponentially_within_bounds_and_resets() {
        let min = Duration::from_millis(100);
        let max = Duration::from_secs(2);
        let mut b = Backoff::with_seed(min, max, 42);
        let delays: Vec<Duration> = (0..10).map(|_| b.next_delay()).collect();
        for (n, d) in delays.iter().enumerate() {
            let base = (min * (1 << n)).min(max);
            assert!(*d >= (base / 2).max(min) && *d <= base, "{n}: {d:?}");
        }
        assert!(delays[9] >= max / 2);
        b.reset();
        assert_eq!(b.next_delay(), min, "first delay after reset is min");
    }

    #[test]
    fn jitter_varies() {
        let mut b = Backoff::with_seed(Duration::from_millis(10), Duration::from_secs(10), 7);
        for _ in 0..8 {
            b.next_delay();
        }
        let a = b.clone().next_delay();
        let mut c = b.clone();
        c.rng ^= 0xdead_beef;
        assert_ne!(a, c.next_delay());
    }
}
