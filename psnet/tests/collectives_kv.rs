//! A kv job's workers form a collectives communicator from the job itself (each worker's kv
//! rank its rank, worker 0's address passed through the kv store), then allreduce beside
//! their kv traffic.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::try_join_all;
use psnet::collectives::{join_kv_workers, Config, ReduceOp};
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_kv::{run_server, KvConfig, Role, Scheduler, Worker};
use psnet_transport::NodeId;

async fn tcp(id: NodeId) -> TcpTransport {
    TcpTransport::bind(id, TcpConfig::new("127.0.0.1:0".parse().unwrap()))
        .await
        .expect("bind")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_jobs_workers_allreduce_as_ranks_of_their_kv_rank() {
    let workers = 3;
    let config = |role, root: SocketAddr| {
        KvConfig::local(role, root, 1, workers).bootstrap_timeout(Duration::from_secs(30))
    };
    let sched = Scheduler::new(
        &config(Role::Scheduler, "127.0.0.1:0".parse().unwrap()),
        tcp(psnet_kv::proto::ids::SCHEDULER).await,
    );
    let root = sched.addr();
    let scheduler = tokio::spawn(sched.run());
    let server = {
        let c = config(Role::Server, root);
        tokio::spawn(async move { run_server(&c, tcp(NodeId(0)).await).await })
    };
    let joins: Vec<_> = (0..workers)
        .map(|_| {
            let c = config(Role::Worker, root);
            tokio::spawn(async move { Worker::join(&c, tcp(NodeId(0)).await).await })
        })
        .collect();
    let mut kvs = Vec::new();
    for j in joins {
        kvs.push(Arc::new(j.await.unwrap().expect("worker joins")));
    }
    let comms = try_join_all(kvs.iter().map(|kv| join_kv_workers(kv, Config::default())))
        .await
        .expect("the workers form a communicator");
    for (kv, comm) in kvs.iter().zip(&comms) {
        assert_eq!(
            (comm.rank(), comm.size()),
            (kv.rank() as usize, workers as usize)
        );
    }
    let mut bufs: Vec<Vec<f32>> = comms
        .iter()
        .map(|c| vec![c.rank() as f32 + 1.0; 5000])
        .collect();
    try_join_all(
        comms
            .iter()
            .zip(bufs.iter_mut())
            .map(|(c, b)| c.allreduce(b, ReduceOp::Sum)),
    )
    .await
    .expect("allreduce");
    assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 6.0)));
    drop(comms);
    // Every worker finalizes at once: the job ends when all have.
    try_join_all(kvs.into_iter().map(|kv| {
        let kv = Arc::try_unwrap(kv).unwrap_or_else(|_| panic!("worker still shared"));
        kv.finalize()
    }))
    .await
    .expect("finalize");
    server.await.unwrap().expect("server ends");
    scheduler.await.unwrap().expect("scheduler ends");
}
