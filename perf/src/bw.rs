//! The bandwidth test's client side (perftest's `ib_write_bw`).

use std::time::Instant;

use psnet_transport::{OutMessage, Segment, Transport};

use crate::protocol::Control;
use crate::report::BwRow;
use crate::session::{expect_ready, next_message, send_control, PerfResult, SERVER_ID};

/// Default message count: perftest's 5000, capped so that one size moves at most 2 GiB.
pub fn default_iters(size: u64) -> u64 {
    ((2u64 << 30) / size.max(1)).clamp(100, 5000)
}

/// Sends `iters` messages of `size` bytes from one registered buffer, back to back, and waits
/// for the server to confirm the last one.
pub async fn run<T: Transport>(t: &T, size: u64, iters: u64) -> PerfResult<BwRow> {
    let len = usize::try_from(size).map_err(|_| format!("size {size} does not fit in memory"))?;
    send_control(t, SERVER_ID, Control::BwStart { size, iters }, &[]).await?;
    expect_ready(t).await?;
    let mut buf = t.alloc_registered(len).map_err(|e| e.to_string())?;
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let meta = Control::BwData.encode();
    let start = Instant::now();
    for _ in 0..iters {
        let segs = [Segment::registered(&buf, 0..len)];
        t.send(SERVER_ID, OutMessage::new(&meta, &segs))
            .await
            .map_err(|e| e.to_string())?;
    }
    match next_message(t).await?.0 {
        Control::BwDone {
            peak_bytes_per_s, ..
        } => Ok(BwRow::new(
            size,
            iters,
            start.elapsed().as_secs_f64(),
            peak_bytes_per_s,
        )),
        other => Err(format!("expected BwDone from the server, got {other:?}")),
    }
}
