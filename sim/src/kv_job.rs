//! A kv job on the simulated rig, shaped as `scripts/bench-cluster.sh kv` runs it: servers
//! on hosts of their own, workers over the other hosts in turn, `dist_sync`, one key per
//! size, and per operation the median of the first worker's times (as `bench-mxnet.py`
//! reports rank 0's).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::try_join_all;
use psnet_kv::Worker;
use psnet_memnet::MemTransport;
use tokio::time::Instant;

use crate::rig::{median, Rig};
use crate::start::KvJob;

/// Per operation, the median time (as the network described sees it).
#[derive(Clone, Copy, Debug)]
pub struct KvTimes {
    /// `push` alone.
    pub push: Duration,
    /// `pull` alone.
    pub pull: Duration,
    /// `push` then `pull`.
    pub push_then_pull: Duration,
    /// One `pushpull`.
    pub pushpull: Duration,
}

/// Where `servers` servers and `workers` workers go on `hosts` hosts: servers on the first
/// hosts, one each; workers over the other hosts in turn. The scheduler shares the first
/// host.
fn layout(
    hosts: usize,
    servers: usize,
    workers: usize,
) -> Result<(Vec<usize>, Vec<usize>), String> {
    if servers >= hosts {
        return Err(format!("{servers} servers need more than {hosts} hosts"));
    }
    let left = hosts - servers;
    Ok((
        (0..servers).collect(),
        (0..workers).map(|w| servers + w % left).collect(),
    ))
}

/// The wire bound of one push (or one pull) of `bytes` per worker: the busiest link's bytes
/// over its rate, a worker host's `per_host` values against a server's share of every
/// worker's (arrays of at least MXNet's big-array bound, 10^6 elements, are split over
/// every server; smaller ones go to one).
pub fn one_way_bound(
    rig: &Rig,
    servers: usize,
    workers: usize,
    per_host: usize,
    bytes: usize,
) -> Duration {
    let shards = if bytes / 4 >= 1_000_000 { servers } else { 1 };
    let b = bytes as f64;
    rig.wire((per_host as f64 * b).max(workers as f64 * b / shards as f64))
}

/// Runs the job: for each of `sizes` (bytes), `iters` timed operations of each kind after
/// two untimed ones. The scheduler shares the first host.
pub(crate) fn run(
    rig: &Rig,
    servers: usize,
    workers: usize,
    sizes: &[usize],
    iters: usize,
) -> Result<Vec<KvTimes>, String> {
    let (server_hosts, worker_hosts) = layout(rig.hosts, servers, workers)?;
    let net = rig.network()?;
    let rig = *rig;
    let sizes = sizes.to_vec();
    super::rig::runtime()?.block_on(async move {
        let job = KvJob::start(&net, 0, &server_hosts, &worker_hosts, rig.slow).await?;
        let mut rows = Vec::new();
        for (key, &bytes) in sizes.iter().enumerate() {
            let times = try_join_all(
                job.workers
                    .iter()
                    .map(|w| measure(w.clone(), workers, key as u64, bytes, iters, &rig)),
            )
            .await?;
            rows.push(times[0]);
        }
        job.stop();
        Ok(rows)
    })
}

/// One worker's timings of `key`, `bytes` long.
async fn measure(
    w: Arc<Worker<MemTransport>>,
    workers: usize,
    key: u64,
    bytes: usize,
    iters: usize,
    rig: &Rig,
) -> Result<KvTimes, String> {
    let n = (bytes / 4).max(1);
    let value = vec![1.0f32; n];
    let mut out = vec![0.0f32; n];
    let bad = |what: &str, e: psnet_kv::KvError| format!("{what} of {bytes} bytes: {e}");
    w.init(&[key], &[&value])
        .await
        .map_err(|e| bad("init", e))?;
    let mut kinds = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for (kind, times) in kinds.iter_mut().enumerate() {
        for i in 0..iters + 2 {
            let start = Instant::now();
            match kind {
                0 => w.push(key, &value).await.map_err(|e| bad("push", e))?,
                1 => w.pull(key, &mut out).await.map_err(|e| bad("pull", e))?,
                2 => {
                    w.push(key, &value).await.map_err(|e| bad("push", e))?;
                    w.pull(key, &mut out).await.map_err(|e| bad("pull", e))?;
                }
                _ => w
                    .pushpull(key, &value, &mut out)
                    .await
                    .map_err(|e| bad("pushpull", e))?,
            }
            if i >= 2 {
                times.push(rig.seen(start.elapsed()));
            }
        }
        w.barrier().await.map_err(|e| bad("barrier", e))?;
    }
    // Without an optimizer a dist_sync server keeps the round's sum: every worker's ones.
    let want = workers as f32;
    if let Some(x) = out.iter().find(|&&x| x != want) {
        return Err(format!(
            "a pull of {bytes} bytes gave {x} where {workers} workers pushed ones"
        ));
    }
    let [push, pull, push_then_pull, pushpull] = kinds.map(median);
    Ok(KvTimes {
        push,
        pull,
        push_then_pull,
        pushpull,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 servers + 2 workers at 1 Gbit/s: pushes and pulls of 4 MiB run at their wire
    /// bound in simulated time (the model has no TCP to lose to), never under it.
    #[test]
    fn a_kv_job_runs_at_its_wire_bound_in_simulated_time() {
        let rig = Rig {
            hosts: 4,
            bytes_per_sec: 125e6,
            efficiency: 1.0,
            latency: Duration::from_micros(30),
            local_bytes_per_sec: 2.5e9,
            slow: 100.0,
        };
        let bytes = 4 << 20;
        let t = run(&rig, 2, 2, &[bytes], 1).unwrap()[0];
        let bound = one_way_bound(&rig, 2, 2, 1, bytes);
        for (op, took, bound) in [
            ("push", t.push, bound),
            ("pull", t.pull, bound),
            ("push then pull", t.push_then_pull, bound * 2),
            ("pushpull", t.pushpull, bound),
        ] {
            assert!(took >= bound, "{op}: {took:?} beats the wire ({bound:?})");
            if op != "pushpull" {
                assert!(
                    took <= bound.mul_f64(1.05),
                    "{op}: {took:?} against {bound:?}"
                );
            }
        }
    }

    #[test]
    fn servers_get_hosts_of_their_own_and_workers_take_the_rest_in_turn() {
        assert_eq!(layout(4, 2, 4).unwrap(), (vec![0, 1], vec![2, 3, 2, 3]));
        assert_eq!(layout(4, 1, 2).unwrap(), (vec![0], vec![1, 2]));
        assert!(layout(2, 2, 1).unwrap_err().contains("more than 2 hosts"));
    }
}
