//! Whole kv jobs inside one test process: scheduler, servers and workers as tasks over
//! 127.0.0.1.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_kv::{run_server, KvConfig, KvError, Role, Scheduler};
use psnet_transport::NodeId;
use tokio::task::JoinHandle;

/// A worker over TCP.
pub type Worker = psnet_kv::Worker<TcpTransport>;

/// A TCP transport on 127.0.0.1 (any free port), as the `psnet` crate binds for a loopback job.
pub async fn tcp(id: NodeId, port: u16) -> TcpTransport {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    TcpTransport::bind(id, TcpConfig::new(addr))
        .await
        .expect("bind 127.0.0.1")
}

/// A running job.
pub struct Cluster {
    /// The workers, by rank.
    pub workers: Vec<Arc<Worker>>,
    /// The scheduler's task.
    pub scheduler: JoinHandle<Result<(), KvError>>,
    /// The servers' tasks.
    pub servers: Vec<JoinHandle<Result<(), KvError>>>,
}

/// A job of `servers` and `workers`; `configure` adjusts every node's configuration.
pub async fn cluster_with(
    servers: u32,
    workers: u32,
    configure: impl Fn(KvConfig) -> KvConfig,
) -> Cluster {
    psnet_config::logging::init();
    let config = |role, root: SocketAddr| {
        configure(
            KvConfig::local(role, root, servers, workers)
                .bootstrap_timeout(Duration::from_secs(30)),
        )
    };
    let sched = Scheduler::new(
        &config(Role::Scheduler, "127.0.0.1:0".parse().unwrap()),
        tcp(psnet_kv::proto::ids::SCHEDULER, 0).await,
    );
    let root = sched.addr();
    let scheduler = tokio::spawn(sched.run());
    let servers = (0..servers)
        .map(|_| {
            let c = config(Role::Server, root);
            tokio::spawn(async move { run_server(&c, tcp(NodeId(0), 0).await).await })
        })
        .collect();
    let joins: Vec<_> = (0..workers)
        .map(|_| {
            let c = config(Role::Worker, root);
            tokio::spawn(async move { Worker::join(&c, tcp(NodeId(0), 0).await).await })
        })
        .collect();
    let mut ws = Vec::new();
    for j in joins {
        ws.push(Arc::new(j.await.unwrap().expect("worker joins")));
    }
    ws.sort_by_key(|w| w.rank());
    Cluster {
        workers: ws,
        scheduler,
        servers,
    }
}

impl Cluster {
    /// Every worker finalizes; every task ends cleanly.
    pub async fn finish(self) {
        let finals: Vec<_> = self
            .workers
            .into_iter()
            .map(|w| {
                let w = Arc::try_unwrap(w).unwrap_or_else(|_| panic!("worker still shared"));
                tokio::spawn(async move { w.finalize().await })
            })
            .collect();
        for f in finals {
            f.await.unwrap().expect("worker finalizes");
        }
        for s in self.servers {
            s.await.unwrap().expect("server ends cleanly");
        }
        self.scheduler
            .await
            .unwrap()
            .expect("scheduler ends cleanly");
    }
}

/// Runs `f(worker)` on every worker concurrently.
pub async fn on_all<F, Fut>(workers: &[Arc<Worker>], f: F) -> Vec<Result<Vec<f32>, KvError>>
where
    F: Fn(Arc<Worker>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<f32>, KvError>> + Send + 'static,
{
    let handles: Vec<_> = workers.iter().map(|w| tokio::spawn(f(w.clone()))).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}
