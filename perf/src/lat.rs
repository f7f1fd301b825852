//! The latency test's client side (perftest's `ib_send_lat`): times round trips, reported as
//! one-way latencies (half of each), as `ib_send_lat` reports them.

use std::time::Instant;

use psnet::transport::Transport;

use crate::protocol::Control;
use crate::report::LatRow;
use crate::session::{expect_ready, next_message, send_control, PerfResult, SERVER_ID};

/// Default round trips: perftest's 1000, capped so that one size moves at most 1 GiB.
pub fn default_iters(size: u64) -> u64 {
    ((512u64 << 20) / size.max(1)).clamp(20, 1000)
}

/// Ping-pongs `iters` messages of `size` bytes after a warm-up, one in flight at a time.
pub async fn run<T: Transport>(t: &T, size: u64, iters: u64) -> PerfResult<LatRow> {
    let len = usize::try_from(size).map_err(|_| format!("size {size} does not fit in memory"))?;
    send_control(t, SERVER_ID, Control::LatStart { size }, &[]).await?;
    expect_ready(t).await?;
    let payload = vec![0xa5u8; len];
    let warmup = (iters / 10).max(10);
    let mut samples = Vec::with_capacity(iters as usize);
    for i in 0..warmup + iters {
        let start = Instant::now();
        send_control(t, SERVER_ID, Control::Ping, &payload).await?;
        let (control, echo) = next_message(t).await?;
        let rtt = start.elapsed();
        let got: usize = echo.segments.iter().map(|s| s.len()).sum();
        if control != Control::Ping || got != len {
            return Err(format!(
                "bad echo: {control:?} with {got} bytes, expected {len}"
            ));
        }
        if i >= warmup {
            samples.push(rtt.as_secs_f64() * 1e6);
        }
    }
    Ok(LatRow::from_round_trips(size, samples))
}
