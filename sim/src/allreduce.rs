//! Allreduce on the simulated rig, as `psnet-perf allreduce` runs it there: one rank per
//! host, float32 sums in place, the slowest rank's mean time per call.

use std::time::Duration;

use futures_util::future::try_join_all;
use psnet_collectives::ReduceOp;
use tokio::time::Instant;

use crate::rig::Rig;
use crate::start::communicator;

/// Mean time per call of each of `sizes` (bytes), `iters` timed calls after two untimed
/// ones; every rank's sum is checked.
pub(crate) fn run(rig: &Rig, sizes: &[usize], iters: usize) -> Result<Vec<Duration>, String> {
    let net = rig.network()?;
    let n = rig.hosts;
    let rig = *rig;
    let sizes = sizes.to_vec();
    super::rig::runtime()?.block_on(async move {
        let comms = communicator(&net, n, rig.slow).await?;
        let mut rows = Vec::new();
        for &bytes in &sizes {
            let elems = (bytes / 4).max(1);
            let calls = try_join_all(comms.iter().enumerate().map(|(r, c)| async move {
                let mut buf = vec![0.0f32; elems];
                let mut took = Duration::ZERO;
                for i in 0..iters + 2 {
                    buf.fill(r as f32 + 1.0);
                    let start = Instant::now();
                    c.allreduce(&mut buf, ReduceOp::Sum).await?;
                    if i >= 2 {
                        took += start.elapsed();
                    }
                }
                Ok::<_, psnet_collectives::CollectiveError>((took, buf))
            }))
            .await
            .map_err(|e| format!("allreduce of {bytes} bytes: {e}"))?;
            let want = (n * (n + 1) / 2) as f32;
            if calls.iter().any(|(_, b)| b.iter().any(|&x| x != want)) {
                return Err(format!("allreduce of {bytes} bytes: a rank's sum is wrong"));
            }
            let slowest = calls.iter().map(|(t, _)| *t).max().unwrap_or_default();
            rows.push(rig.seen(slowest) / iters.max(1) as u32);
        }
        Ok(rows)
    })
}
