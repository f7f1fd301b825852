//! Faults injected on real sockets (`PSNET_FAULTS`), to show that what runs above the
//! transport survives them: connections dropped with a message in flight, connections reset
//! at a fixed period, and delayed sends. Off, and a single branch per send, when unset.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// What to inject, parsed from `PSNET_FAULTS`, e.g. `drop=0.01,delay=2ms,reset_every=500,seed=7`.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultSpec {
    /// Probability that a send drops its connection instead of writing: the message is lost
    /// with the connection, as when a link dies with data still in the kernel's buffer (the
    /// send itself reports success; both sides then see the peer lost).
    pub drop: f64,
    /// Each send waits a uniformly drawn time up to this long before it writes.
    pub delay: Duration,
    /// Every this many sends (of this transport, all peers together) the connection is closed
    /// right after the message is written; 0: never.
    pub reset_every: u64,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for FaultSpec {
    fn default() -> Self {
        FaultSpec {
            drop: 0.0,
            delay: Duration::ZERO,
            reset_every: 0,
            seed: 0,
        }
    }
}

impl FromStr for FaultSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut spec = FaultSpec::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?} is not key=value"))?;
            let bad = |why: &str| format!("{key}={value:?}: {why}");
            match key.trim() {
                "drop" => {
                    spec.drop = value
                        .parse()
                        .map_err(|_| bad("a probability between 0 and 1"))?;
                    if !(0.0..=1.0).contains(&spec.drop) {
                        return Err(bad("a probability between 0 and 1"));
                    }
                }
                "delay" => {
                    spec.delay = parse_duration(value)
                        .ok_or_else(|| bad("a duration such as 2ms, 500us or 1s"))?
                }
                "reset_every" => {
                    spec.reset_every = value.parse().map_err(|_| bad("a count of sends"))?
                }
                "seed" => spec.seed = value.parse().map_err(|_| bad("an unsigned integer"))?,
                other => {
                    return Err(format!(
                        "unknown fault {other:?} (known: drop, delay, reset_every, seed)"
                    ))
                }
            }
        }
        Ok(spec)
    }
}

impl fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "drop={},delay={}us,reset_every={},seed={}",
            self.drop,
            self.delay.as_micros(),
            self.reset_every,
            self.seed
        )
    }
}

fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.')?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().ok()?;
    let seconds = match unit {
        "s" => number,
        "ms" => number / 1e3,
        "us" => number / 1e6,
        "ns" => number / 1e9,
        _ => return None,
    };
    (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds))
}

/// What a send is to suffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Strike {
    /// Nothing.
    None,
    /// Close the connection instead of writing.
    Drop,
    /// Write, then close the connection.
    Reset,
}

/// Counts of what was injected, for tests and the closing log line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Sends seen.
    pub sends: u64,
    /// Connections dropped with the message.
    pub drops: u64,
    /// Connections reset after the message.
    pub resets: u64,
}

/// The injector of one transport.
pub(crate) struct Faults {
    spec: FaultSpec,
    rng: Mutex<fastrand::Rng>,
    sends: AtomicU64,
    drops: AtomicU64,
    resets: AtomicU64,
}

impl Faults {
    pub(crate) fn new(spec: FaultSpec) -> Self {
        Faults {
            rng: Mutex::new(fastrand::Rng::with_seed(spec.seed)),
            spec,
            sends: AtomicU64::new(0),
            drops: AtomicU64::new(0),
            resets: AtomicU64::new(0),
        }
    }

    /// The next send's delay and fate.
    pub(crate) fn draw(&self) -> (Duration, Strike) {
        let n = self.sends.fetch_add(1, Ordering::Relaxed) + 1;
        let (delay, dropped) = {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            let delay = if self.spec.delay.is_zero() {
                Duration::ZERO
            } else {
                self.spec.delay.mul_f64(rng.f64())
            };
            (delay, self.spec.drop > 0.0 && rng.f64() < self.spec.drop)
        };
        let strike = if dropped {
            self.drops.fetch_add(1, Ordering::Relaxed);
            Strike::Drop
        } else if self.spec.reset_every > 0 && n % self.spec.reset_every == 0 {
            self.resets.fetch_add(1, Ordering::Relaxed);
            Strike::Reset
        } else {
            Strike::None
        };
        (delay, strike)
    }

    pub(crate) fn counts(&self) -> FaultCounts {
        FaultCounts {
            sends: self.sends.load(Ordering::Relaxed),
            drops: self.drops.load(Ordering::Relaxed),
            resets: self.resets.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn spec(&self) -> &FaultSpec {
        &self.spec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        let s: FaultSpec = "drop=0.01,delay=2ms,reset_every=500,seed=7"
            .parse()
            .unwrap();
        assert_eq!(
            s,
            FaultSpec {
                drop: 0.01,
                delay: Duration::from_millis(2),
                reset_every: 500,
                seed: 7
            }
        );
        assert_eq!("".parse::<FaultSpec>().unwrap(), FaultSpec::default());
        assert_eq!(
            "delay=250us".parse::<FaultSpec>().unwrap().delay,
            Duration::from_micros(250)
        );
        for (bad, why) in [
            ("drop=2", "probability"),
            ("drop=x", "probability"),
            ("delay=5", "duration"),
            ("delay=-1ms", "duration"),
            ("reset_every=-1", "count"),
            ("lose=1", "unknown fault"),
            ("drop", "key=value"),
        ] {
            let e = bad.parse::<FaultSpec>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn resets_come_at_the_period_and_drops_at_about_the_rate() {
        let f = Faults::new("drop=0.1,reset_every=50,seed=3".parse().unwrap());
        let strikes: Vec<Strike> = (0..10_000).map(|_| f.draw().1).collect();
        let c = f.counts();
        assert_eq!(c.sends, 10_000);
        assert_eq!(
            c.drops + c.resets,
            strikes.iter().filter(|s| **s != Strike::None).count() as u64
        );
        // A reset on every 50th send that was not dropped instead.
        for (i, s) in strikes.iter().enumerate() {
            if *s == Strike::Reset {
                assert_eq!((i + 1) % 50, 0);
            }
        }
        assert!((800..1200).contains(&c.drops), "{c:?}");
        assert!(c.resets > 150, "{c:?}");
        // The same seed draws the same faults.
        let g = Faults::new("drop=0.1,reset_every=50,seed=3".parse().unwrap());
        assert!(strikes.iter().all(|s| *s == g.draw().1));
    }

    #[test]
    fn delays_stay_within_the_bound() {
        let f = Faults::new("delay=2ms,seed=1".parse().unwrap());
        for _ in 0..1000 {
            let (d, s) = f.draw();
            assert!(d <= Duration::from_millis(2));
            assert_eq!(s, Strike::None);
        }
    }
}
