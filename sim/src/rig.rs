//! The simulated cluster: hosts with links of one rate and latency, on the in-memory
//! network's link model, and the clock that measures jobs on it.
//!
//! tokio's timers tick in milliseconds, so a message that lands 0.3 ms after it was sent is
//! seen at 1 ms. The network is therefore modelled [`Rig::slow`] times slower than the one
//! described, with latencies that many times longer, and every time measured is divided by
//! it: a tick is then `1 / slow` of a millisecond of the network described.

use std::time::Duration;

use psnet_memnet::{HostLinks, Link, MemNet, MemNetConfig};

/// The part of an Ethernet frame TCP's payload takes with timestamps on: 1448 of 1514 bytes
/// (what iperf3 sees on the rig's 1 Gbit/s links: 0.96 Gbit/s).
pub const TCP_EFFICIENCY: f64 = 1448.0 / 1514.0;

/// The hosts and their links.
#[derive(Clone, Copy, Debug)]
pub struct Rig {
    /// How many hosts.
    pub hosts: usize,
    /// Each host's uplink and downlink, in bytes per second.
    pub bytes_per_sec: f64,
    /// The share of a link's rate messages get (TCP's payload in Ethernet frames:
    /// [`TCP_EFFICIENCY`]).
    pub efficiency: f64,
    /// Added by each of a message's links (so twice between hosts).
    pub latency: Duration,
    /// Between two endpoints of one host, in bytes per second (no latency).
    pub local_bytes_per_sec: f64,
    /// How many times slower than described the network runs (see the module's docs).
    pub slow: f64,
}

impl Rig {
    /// The in-memory network of this rig: hosts whose links are slowed by `slow`.
    pub(crate) fn network(&self) -> Result<MemNet, String> {
        let link = Link::new(
            self.bytes_per_sec * self.efficiency / self.slow,
            self.latency.mul_f64(self.slow),
        )
        .map_err(|e| format!("the hosts' links: {e}"))?;
        let local = Link::new(self.local_bytes_per_sec / self.slow, Duration::ZERO)
            .map_err(|e| format!("the local path: {e}"))?;
        Ok(MemNet::new(MemNetConfig {
            hosts: vec![HostLinks::symmetric(link, local); self.hosts],
            ..MemNetConfig::default()
        }))
    }

    /// A span of the slowed clock as the network described would see it.
    pub fn seen(&self, clock: Duration) -> Duration {
        clock.div_f64(self.slow)
    }

    /// The time `bytes` take over one link at its full rate (the wire bound's terms).
    pub fn wire(&self, bytes: f64) -> Duration {
        Duration::from_secs_f64(bytes / self.bytes_per_sec)
    }
}

/// A current-thread runtime on a paused clock: time moves only when every task waits, to
/// the next timer.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .map_err(|e| format!("a runtime: {e}"))
}

/// The median of `times` (the upper one of an even count, as the rig's scripts take it).
pub fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}
