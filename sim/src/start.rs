//! Starting the jobs the simulations measure: a communicator of one rank a host, and a kv
//! job of a scheduler, servers and workers on hosts given.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::try_join_all;
use psnet_collectives::{node_of, Communicator, Config};
use psnet_kv::proto::ids::{Role, SCHEDULER};
use psnet_kv::{run_server, KvConfig, KvError, Scheduler, Worker};
use psnet_memnet::{MemNet, MemTransport};
use psnet_transport::{NodeId, Transport};
use tokio::task::JoinHandle;

/// A communicator's ranks on the simulated network.
pub type Comm = Communicator<MemTransport>;

/// Forms a communicator of `n` ranks, rank `r` on host `r`, on a network `slow` times
/// slower than the one described: its heartbeats come as often as they would there (at
/// the clock's rate they would be `slow` times too many, each a message crossing the links).
/// Its ranks do not spin while they wait: spinning is for a CPU's wake-up time, which the
/// simulation does not have; the simulated clock stands still while a rank spins, so it
/// changed no time measured, but cost wall clock.
pub(crate) async fn communicator(net: &MemNet, n: usize, slow: f64) -> Result<Vec<Comm>, String> {
    let defaults = Config::default();
    let config = Config {
        heartbeat_timeout: defaults.heartbeat_timeout.map(|t| t.mul_f64(slow)),
        spin: Duration::ZERO,
        ..defaults
    };
    let transports: Vec<Arc<MemTransport>> = (0..n)
        .map(|r| Arc::new(net.bind_on(r, node_of(r))))
        .collect();
    let root = transports[0].listen_addr();
    try_join_all(
        transports
            .iter()
            .enumerate()
            .map(|(r, t)| Communicator::join(t.clone(), r, n, root, config.clone())),
    )
    .await
    .map_err(|e| format!("forming a communicator of {n}: {e}"))
}

/// A running kv job.
pub struct KvJob {
    /// Where the scheduler listens.
    pub root: SocketAddr,
    /// Where each server, then each worker, listens.
    pub nodes: Vec<SocketAddr>,
    /// The workers, by rank.
    pub workers: Vec<Arc<Worker<MemTransport>>>,
    scheduler: JoinHandle<Result<(), KvError>>,
    servers: Vec<JoinHandle<Result<(), KvError>>>,
}

/// A node's settings on a network `slow` times slower than the one described: heartbeats
/// as often as there (ps-lite's defaults, 1 s and a timeout of 10 s, in its time).
fn config(role: Role, root: SocketAddr, servers: usize, workers: usize, slow: f64) -> KvConfig {
    let (every, timeout) = (Duration::from_secs(1), Duration::from_secs(10));
    KvConfig::local(role, root, servers as u32, workers as u32)
        .heartbeats(Some(every.mul_f64(slow)), Some(timeout.mul_f64(slow)))
}

impl KvJob {
    /// Starts the scheduler on host `scheduler`, a server on each of `servers` and a
    /// worker on each of `workers` (hosts), on a network `slow` times slower than the one
    /// described, and waits until every worker has joined.
    pub(crate) async fn start(
        net: &MemNet,
        scheduler: usize,
        servers: &[usize],
        workers: &[usize],
        slow: f64,
    ) -> Result<KvJob, String> {
        let (s, w) = (servers.len(), workers.len());
        let any: SocketAddr = "127.0.0.1:0".parse().expect("an address");
        let sched = Scheduler::new(
            &config(Role::Scheduler, any, s, w, slow),
            net.bind_on(scheduler, SCHEDULER),
        );
        let root = sched.addr();
        let sched = tokio::spawn(sched.run());
        let mut nodes = Vec::new();
        let mut server_tasks = Vec::new();
        for &h in servers {
            let t = net.bind_on(h, NodeId(0));
            nodes.push(t.listen_addr());
            let c = config(Role::Server, root, s, w, slow);
            server_tasks.push(tokio::spawn(async move { run_server(&c, t).await }));
        }
        let joins: Vec<_> = workers
            .iter()
            .map(|&h| {
                let t = net.bind_on(h, NodeId(0));
                nodes.push(t.listen_addr());
                let c = config(Role::Worker, root, s, w, slow);
                tokio::spawn(async move { Worker::join(&c, t).await })
            })
            .collect();
        let mut joined = Vec::new();
        for j in joins {
            let worker = j
                .await
                .map_err(|e| format!("a worker's task: {e}"))?
                .map_err(|e| format!("a worker joining: {e}"))?;
            joined.push(Arc::new(worker));
        }
        joined.sort_by_key(|w| w.rank());
        Ok(KvJob {
            root,
            nodes,
            workers: joined,
            scheduler: sched,
            servers: server_tasks,
        })
    }

    /// Stops the scheduler and the servers (the workers go with the job).
    pub fn stop(self) {
        self.scheduler.abort();
        for s in self.servers {
            s.abort();
        }
    }
}
