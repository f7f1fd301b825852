//! The time every kv driver reads: tokio's clock, so that a job run on a paused runtime (the
//! deterministic simulation tests) sees simulated time everywhere, timers and timestamps alike.
//! On a normal runtime it is the system's monotonic clock.

use std::time::Instant;

/// Now, on the runtime's clock.
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}
