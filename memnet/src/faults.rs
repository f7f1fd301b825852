//! Faults drawn from a seed.

use std::time::Duration;

/// What goes wrong on a [`crate::MemNet`], drawn from `seed`.
#[derive(Clone, Debug, PartialEq)]
pub struct Faults {
    /// Seed of every random choice the network makes.
    pub seed: u64,
    /// Probability that a send resets its connection instead of delivering (the data in
    /// flight on that connection is lost and both sides see the peer lost).
    pub reset: f64,
    /// Each message is delayed by a uniform draw from this range (order per receiver is
    /// kept: a message never overtakes one sent to the same receiver before it).
    pub delay: (Duration, Duration),
    /// Connections are never reset before this many sends have gone through the network,
    /// so that a job's start-up is not what every seed tests.
    pub reset_after: u64,
}

impl Faults {
    /// No faults: no resets, no delay.
    pub fn none() -> Self {
        Faults {
            seed: 0,
            reset: 0.0,
            delay: (Duration::ZERO, Duration::ZERO),
            reset_after: 0,
        }
    }

    /// No faults yet, with this seed (for delays and resets set afterwards).
    pub fn seeded(seed: u64) -> Self {
        Faults {
            seed,
            ..Faults::none()
        }
    }

    /// Each message delayed by a uniform draw from `min..=max`.
    pub fn delay(mut self, min: Duration, max: Duration) -> Self {
        self.delay = (min, max.max(min));
        self
    }

    /// A send resets its connection with probability `p`, after the first `after` sends.
    pub fn resets(mut self, p: f64, after: u64) -> Self {
        self.reset = p.clamp(0.0, 1.0);
        self.reset_after = after;
        self
    }
}

/// The network's random source.
pub(crate) struct Dice {
    rng: fastrand::Rng,
    faults: Faults,
    sends: u64,
}

impl Dice {
    pub(crate) fn new(faults: Faults) -> Self {
        Dice {
            rng: fastrand::Rng::with_seed(faults.seed),
            faults,
            sends: 0,
        }
    }

    /// For one send: whether it resets its connection, and its delay.
    pub(crate) fn roll(&mut self) -> (bool, Duration) {
        self.sends += 1;
        let reset = self.faults.reset > 0.0
            && self.sends > self.faults.reset_after
            && self.rng.f64() < self.faults.reset;
        let (lo, hi) = self.faults.delay;
        let delay = if hi > lo {
            let span = (hi - lo).as_nanos() as u64;
            lo + Duration::from_nanos(self.rng.u64(0..=span))
        } else {
            lo
        };
        (reset, delay)
    }

    pub(crate) fn faults(&self) -> &Faults {
        &self.faults
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_rolls_the_same_faults() {
        let f = Faults::seeded(42)
            .delay(Duration::from_micros(10), Duration::from_millis(3))
            .resets(0.1, 5);
        let rolls = |f: &Faults| {
            let mut d = Dice::new(f.clone());
            (0..1000).map(|_| d.roll()).collect::<Vec<_>>()
        };
        let a = rolls(&f);
        assert_eq!(a, rolls(&f));
        assert_ne!(
            a,
            rolls(&Faults {
                seed: 43,
                ..f.clone()
            })
        );
        assert!(
            a[..5].iter().all(|(reset, _)| !reset),
            "no reset before reset_after"
        );
        let resets = a.iter().filter(|(r, _)| *r).count();
        assert!(
            (50..=150).contains(&resets),
            "about 10% resets, got {resets}"
        );
        assert!(a
            .iter()
            .all(|(_, d)| *d >= Duration::from_micros(10) && *d <= Duration::from_millis(3)));
    }

    #[test]
    fn no_faults_roll_nothing() {
        let mut d = Dice::new(Faults::none());
        assert!((0..100).all(|_| d.roll() == (false, Duration::ZERO)));
    }
}
