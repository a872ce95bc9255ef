//! Jittered exponential back-off, for reconnecting to etcd, the Kubernetes API or a
//! calc-server: a fleet that lost its peer at the same moment must not retry in lockstep.

use std::time::Duration;

use crate::rng::Rng;

/// Delays of `min * 2^n`, capped at `max`, each jittered down to between half and all of it
/// (never below `min`).
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    failures: u32,
    rng: Rng,
}

impl Backoff {
    /// A back-off between `min` and `max` (`max` is raised to `min` if smaller).
    pub fn new(min: Duration, max: Duration) -> Self {
        Self::with_rng(min, max, Rng::from_entropy())
    }

    /// As [`Backoff::new`] with a fixed seed (for tests).
    pub fn with_seed(min: Duration, max: Duration, seed: u64) -> Self {
        Self::with_rng(min, max, Rng::new(seed))
    }

    fn with_rng(min: Duration, max: Duration, rng: Rng) -> Self {
        Self {
            min,
            max: max.max(min),
            failures: 0,
            rng,
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
        let half = base / 2;
        let jittered = half + half.mul_f64(self.rng.unit());
        jittered.clamp(self.min, self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_with_jitter_caps_and_resets() {
        let ms = Duration::from_millis;
        let mut b = Backoff::with_seed(ms(100), ms(1000), 3);
        let caps = [100, 200, 400, 800, 1000, 1000, 1000];
        for cap in caps {
            let d = b.next_delay();
            let cap = ms(cap);
            assert!(d <= cap && d >= (cap / 2).max(ms(100)), "{d:?} vs {cap:?}");
        }
        b.reset();
        assert_eq!(b.next_delay(), ms(100));
    }

    #[test]
    fn max_below_min_is_raised() {
        let mut b = Backoff::with_seed(Duration::from_secs(2), Duration::from_secs(1), 1);
        assert_eq!(b.max(), Duration::from_secs(2));
        assert_eq!(b.next_delay(), Duration::from_secs(2));
    }
}
