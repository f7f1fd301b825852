//! Jobs at many nodes on the simulated network, one node a host: what start-up takes, what
//! the scheduler or rank 0 handles, how many connections each node holds, and the time of a
//! kv round and of an allreduce, each against its bound.

use std::time::Duration;

use futures_util::future::try_join_all;
use psnet_collectives::ReduceOp;
use psnet_memnet::Traffic;
use psnet_transport::Transport;
use tokio::time::Instant;

use crate::rig::Rig;
use crate::start::{communicator, KvJob};

/// A communicator of `n` ranks: forming it, and one allreduce.
#[derive(Debug, PartialEq, Eq)]
pub struct CollScale {
    /// Until every rank has joined.
    pub join: Duration,
    /// The most connections a rank other than 0 holds after the allreduce.
    pub connections: usize,
    /// Rank 0's connections: every rank dialled it to join.
    pub root_connections: usize,
    /// The most bytes the network held for one rank at once (see
    /// [`Traffic::peak_queued_bytes`]).
    pub peak_queued: u64,
    /// What rank 0 sent and received, forming the communicator.
    pub root: Traffic,
    /// One allreduce of the size asked for (every rank's sum checked).
    pub allreduce: Duration,
}

/// Forms a communicator of `n` ranks (host `r` holds rank `r`) and times one allreduce of
/// `bytes` after one untimed.
pub(crate) fn collectives(rig: &Rig, n: usize, bytes: usize) -> Result<CollScale, String> {
    let net = rig.network()?;
    let rig = *rig;
    super::rig::runtime()?.block_on(async move {
        let start = Instant::now();
        let comms = communicator(&net, n, rig.slow).await?;
        let join = rig.seen(start.elapsed());
        let addrs: Vec<_> = comms.iter().map(|c| c.transport().listen_addr()).collect();
        let root_traffic = net.traffic_at(addrs[0]).unwrap_or_default();
        let elems = (bytes / 4).max(1);
        let mut took = Duration::ZERO;
        for round in 0..2 {
            let start = Instant::now();
            let bufs = try_join_all(comms.iter().enumerate().map(|(r, c)| async move {
                let mut buf = vec![r as f32; elems];
                c.allreduce(&mut buf, ReduceOp::Sum).await.map(|()| buf)
            }))
            .await
            .map_err(|e| format!("allreduce on {n} ranks: {e}"))?;
            took = rig.seen(start.elapsed());
            let want = (n * (n - 1) / 2) as f32;
            if round == 1 && bufs.iter().any(|b| b.iter().any(|&x| x != want)) {
                return Err(format!("allreduce on {n} ranks: a rank's sum is wrong"));
            }
        }
        let connections = addrs[1..]
            .iter()
            .filter_map(|&a| net.connections_at(a))
            .max()
            .unwrap_or(0);
        Ok(CollScale {
            join,
            connections,
            root_connections: net.connections_at(addrs[0]).unwrap_or(0),
            peak_queued: peak_queued(&net, &addrs),
            root: root_traffic,
            allreduce: took,
        })
    })
}

/// A kv job of a scheduler, `servers` servers and `workers` workers, each on a host of its
/// own: start-up, and one round.
#[derive(Debug, PartialEq, Eq)]
pub struct KvScale {
    /// Until every worker has joined.
    pub bootstrap: Duration,
    /// What the scheduler sent and received, the round included.
    pub scheduler: Traffic,
    /// The scheduler's connections.
    pub scheduler_connections: usize,
    /// The most connections a server or worker holds.
    pub connections: usize,
    /// The most bytes the network held for one node at once, the scheduler's included (see
    /// [`Traffic::peak_queued_bytes`]).
    pub peak_queued: u64,
    /// One round: every worker's `pushpull` of every key, until the last is done.
    pub round: Duration,
}

/// How a kv job's servers update and its workers push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvMode {
    /// `dist_sync`, no optimizer: a round's sum replaces the value.
    Sync,
    /// `dist_sync` with 2-bit pushes (threshold 0.5): each worker's ones arrive as halves.
    TwoBit,
    /// `dist_async` with SGD at a learning rate of 1: each push takes its ones off at once.
    Async,
}

impl KvMode {
    /// The mode's name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            KvMode::Sync => "kv",
            KvMode::TwoBit => "kv-2bit",
            KvMode::Async => "kv-async",
        }
    }

    /// What a worker pulls after round `round` (from 0) of every worker pushing ones.
    fn pulled(self, workers: usize, round: usize) -> f32 {
        match self {
            KvMode::Sync => workers as f32,
            KvMode::TwoBit => workers as f32 * 0.5,
            KvMode::Async => -((workers * (round + 1)) as f32),
        }
    }
}

/// Runs the job: start-up, then two rounds of `keys` keys of `bytes` each (the second
/// timed; every pulled value checked; in `dist_async`, after the round and a barrier).
pub(crate) fn kv(
    rig: &Rig,
    servers: usize,
    workers: usize,
    keys: usize,
    bytes: usize,
    mode: KvMode,
) -> Result<KvScale, String> {
    let net = rig.network()?;
    let rig = *rig;
    super::rig::runtime()?.block_on(async move {
        let start = Instant::now();
        let server_hosts: Vec<usize> = (1..=servers).collect();
        let worker_hosts: Vec<usize> = (1 + servers..1 + servers + workers).collect();
        let job = KvJob::start(&net, 0, &server_hosts, &worker_hosts, rig.slow).await?;
        let joined = &job.workers;
        let bootstrap = rig.seen(start.elapsed());
        let n = (bytes / 4).max(1);
        try_join_all(joined.iter().map(|w| async move {
            match mode {
                KvMode::Sync => {}
                KvMode::TwoBit => {
                    let two_bit = psnet_compression::CompressionParams::two_bit(0.5)
                        .map_err(|e| psnet_kv::KvError::Invalid(e.to_string()))?;
                    w.set_gradient_compression(two_bit).await?;
                }
                KvMode::Async => {
                    let sgd = r#"{"type":"sgd","learning_rate":1.0}"#;
                    let sgd = psnet_kv::updater::OptimizerSpec::parse(sgd)
                        .map_err(|e| psnet_kv::KvError::Invalid(e.to_string()))?;
                    w.set_mode(psnet_kv::Mode::Async).await?;
                    w.set_optimizer(&sgd).await?;
                }
            }
            let ids: Vec<u64> = (0..keys as u64).collect();
            let init = vec![0.0f32; n];
            let values: Vec<&[f32]> = (0..keys).map(|_| init.as_slice()).collect();
            w.init(&ids, &values).await
        }))
        .await
        .map_err(|e| format!("init: {e}"))?;
        let mut round = Duration::ZERO;
        for r in 0..2 {
            let start = Instant::now();
            try_join_all(joined.iter().map(|w| async move {
                let g = vec![1.0f32; n];
                let mut out = vec![0.0f32; n];
                for key in 0..keys as u64 {
                    w.pushpull(key, &g, &mut out).await?;
                    let want = mode.pulled(workers, r);
                    if let (false, Some(x)) =
                        (mode == KvMode::Async, out.iter().find(|&&x| x != want))
                    {
                        return Err(psnet_kv::KvError::Invalid(format!(
                            "key {key} pulled {x} where {workers} workers pushed ones ({mode:?}: {want})"
                        )));
                    }
                }
                Ok(())
            }))
            .await
            .map_err(|e| format!("round {r}: {e}"))?;
            round = rig.seen(start.elapsed());
            if mode == KvMode::Async {
                // Each push was applied as it came: once every worker is past the round,
                // every key holds all of them.
                try_join_all(joined.iter().map(|w| async move {
                    w.barrier().await?;
                    let mut out = vec![0.0f32; n];
                    let want = mode.pulled(workers, r);
                    for key in 0..keys as u64 {
                        w.pull(key, &mut out).await?;
                        if let Some(x) = out.iter().find(|&&x| x != want) {
                            return Err(psnet_kv::KvError::Invalid(format!(
                                "key {key} holds {x} after round {r} where {want} was due"
                            )));
                        }
                    }
                    Ok(())
                }))
                .await
                .map_err(|e| format!("after round {r}: {e}"))?;
            }
        }
        let connections = job
            .nodes
            .iter()
            .filter_map(|&a| net.connections_at(a))
            .max()
            .unwrap_or(0);
        let mut every = job.nodes.clone();
        every.push(job.root);
        let result = KvScale {
            peak_queued: peak_queued(&net, &every),
            bootstrap,
            scheduler: net.traffic_at(job.root).unwrap_or_default(),
            scheduler_connections: net.connections_at(job.root).unwrap_or(0),
            connections,
            round,
        };
        job.stop();
        Ok(result)
    })
}

/// The most bytes the network held for one of the endpoints listening at `addrs`.
fn peak_queued(net: &psnet_memnet::MemNet, addrs: &[std::net::SocketAddr]) -> u64 {
    addrs
        .iter()
        .filter_map(|&a| net.traffic_at(a))
        .map(|t| t.peak_queued_bytes)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rig(hosts: usize) -> Rig {
        Rig {
            hosts,
            bytes_per_sec: 12.5e9,
            efficiency: 1.0,
            latency: Duration::from_micros(5),
            local_bytes_per_sec: 50e9,
            slow: 1000.0,
        }
    }

    #[test]
    fn a_communicator_of_eight_forms_and_its_ring_runs_near_its_bound() {
        let n = 8;
        let bytes = 1 << 20;
        let c = collectives(&rig(n), n, bytes).unwrap();
        assert!(c.join > Duration::ZERO);
        // Rank 0 and a ring's two neighbours.
        assert_eq!(c.connections, 3, "{c:?}");
        assert_eq!(c.root_connections, n - 1, "{c:?}");
        assert!(
            c.root.sent_messages >= (n - 1) as u64,
            "rank 0 sends every rank the table"
        );
        let hop = Duration::from_micros(10);
        let ring = (rig(n).wire(bytes as f64 / n as f64) + hop) * (2 * (n as u32 - 1));
        assert!(
            c.allreduce >= rig(n).wire(2.0 * 7.0 / 8.0 * bytes as f64),
            "{c:?}"
        );
        assert!(c.allreduce <= ring.mul_f64(1.2), "{c:?} against {ring:?}");
    }

    /// A simulated job is a function of its inputs (a paused clock on one thread, the link
    /// model's arithmetic): run again, it comes out the same to the nanosecond, its traffic,
    /// connections and peaks included, though node identities and secrets are drawn afresh.
    #[test]
    fn the_same_jobs_replay_exactly() {
        let n = 8;
        assert_eq!(
            collectives(&rig(n), n, 1 << 20).unwrap(),
            collectives(&rig(n), n, 1 << 20).unwrap()
        );
        for mode in [KvMode::Sync, KvMode::TwoBit, KvMode::Async] {
            let first = kv(&rig(9), 2, 6, 2, 16 << 10, mode).unwrap();
            let again = kv(&rig(9), 2, 6, 2, 16 << 10, mode).unwrap();
            assert_eq!(first, again, "{mode:?}");
        }
    }

    #[test]
    fn a_kv_job_of_eight_starts_and_runs_a_round() {
        for mode in [KvMode::TwoBit, KvMode::Async] {
            let k = kv(&rig(9), 2, 6, 2, 16 << 10, mode).unwrap();
            assert!(k.round > Duration::ZERO, "{mode:?}: {k:?}");
            assert!(k.peak_queued >= 16 << 10 >> 4, "{mode:?}: {k:?}");
        }
        let k = kv(&rig(9), 2, 6, 2, 16 << 10, KvMode::Sync).unwrap();
        assert!(k.peak_queued >= 16 << 10, "{k:?}");
        assert!(
            k.bootstrap > Duration::ZERO && k.round > Duration::ZERO,
            "{k:?}"
        );
        assert_eq!(
            k.scheduler_connections, 8,
            "every node reaches the scheduler"
        );
        assert!(k.scheduler.received_messages >= 8, "{k:?}");
    }
}
