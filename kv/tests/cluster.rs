//! Whole jobs inside one test process (scheduler, servers and workers as tasks over
//! 127.0.0.1): the semantics end to end.

use std::sync::Arc;
use std::time::Duration;

use psnet_compression::CompressionParams;
use psnet_kv::updater::OptimizerSpec;
use psnet_kv::{KvError, Mode};

mod common;

use common::{cluster_with, on_all, Cluster};

async fn cluster(servers: u32, workers: u32, bound: usize) -> Cluster {
    cluster_with(servers, workers, |c| {
        c.bigarray_bound(bound).heartbeats(
            Some(Duration::from_millis(200)),
            Some(Duration::from_secs(5)),
        )
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_sums_small_and_sharded_keys() {
    let c = cluster(2, 2, 100).await;
    assert_eq!(c.workers[0].num_servers(), 2);
    assert_eq!(c.workers[1].num_workers(), 2);
    let results = on_all(&c.workers, |w| async move {
        let small: Vec<f32> = vec![0.0; 10];
        let big: Vec<f32> = vec![0.0; 250];
        w.init(&[3, 4], &[&small, &big]).await?;
        let r = w.rank() as f32 + 1.0;
        let g_small = vec![r; 10];
        let g_big: Vec<f32> = (0..250).map(|i| i as f32 * r).collect();
        w.push_many(&[3, 4], &[&g_small, &g_big]).await?;
        let mut out_small = vec![0.0; 10];
        let mut out_big = vec![0.0; 250];
        w.pull_many(&[3, 4], &mut [&mut out_small, &mut out_big])
            .await?;
        let mut all = out_small;
        all.extend(out_big);
        Ok(all)
    })
    .await;
    for r in results {
        let v = r.expect("worker ops");
        assert!(v[..10].iter().all(|&x| x == 3.0), "{:?}", &v[..10]);
        for (i, &x) in v[10..].iter().enumerate() {
            assert_eq!(x, i as f32 * 3.0);
        }
    }
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushpull_with_optimizer_and_compression() {
    let c = cluster(2, 2, 16).await;
    let results = on_all(&c.workers, |w| async move {
        w.set_gradient_compression(CompressionParams::two_bit(0.5).unwrap())
            .await?;
        w.set_optimizer(&OptimizerSpec::parse(r#"{"type":"test","rescale_grad":1.0}"#).unwrap())
            .await?;
        w.init(&[1], &[&[1.0; 35]]).await?;
        let grad = vec![0.6f32; 35];
        let mut out = vec![0.0; 35];
        w.pushpull(1, &grad, &mut out).await?;
        Ok(out)
    })
    .await;
    for r in results {
        // Each worker's 0.6 quantizes to +0.5; the test optimizer adds the sum.
        assert_eq!(r.expect("pushpull"), vec![2.0f32; 35]);
    }
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_mode_applies_each_push() {
    let c = cluster(1, 2, 1_000_000).await;
    let results = on_all(&c.workers, |w| async move {
        w.set_mode(Mode::Async).await?;
        w.set_optimizer(&OptimizerSpec::parse(r#"{"type":"sgd","learning_rate":1.0}"#).unwrap())
            .await?;
        w.init(&[9], &[&[0.0; 4]]).await?;
        w.push(9, &[1.0; 4]).await?;
        w.barrier().await?;
        let mut out = vec![0.0; 4];
        w.pull(9, &mut out).await?;
        Ok(out)
    })
    .await;
    for r in results {
        assert_eq!(r.expect("async ops"), vec![-2.0f32; 4]);
    }
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_clear() {
    let c = cluster(1, 1, 1_000_000).await;
    let w = &c.workers[0];
    assert!(matches!(
        w.push(5, &[1.0]).await,
        Err(KvError::UnknownKey(5))
    ));
    w.init(&[5], &[&[0.0; 3]]).await.unwrap();
    assert!(matches!(
        w.push(5, &[1.0; 2]).await,
        Err(KvError::SizeMismatch {
            key: 5,
            expected: 3,
            got: 2
        })
    ));
    w.set_mode(Mode::Async).await.unwrap();
    let err = w.push(5, &[1.0; 3]).await.unwrap_err();
    assert!(err.to_string().contains("set_optimizer"), "{err}");
    assert!(err.to_string().contains("server 0 (node 8)"), "{err}");
    assert_eq!(w.key("weight"), 0);
    assert_eq!(w.key("bias"), 1);
    assert_eq!(w.key("weight"), 0);
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_fails_the_others_instead_of_hanging() {
    let mut c = cluster(1, 2, 1_000_000).await;
    let results = on_all(&c.workers, |w| async move {
        w.init(&[1], &[&[0.0; 8]]).await?;
        Ok(vec![])
    })
    .await;
    assert!(results.iter().all(|r| r.is_ok()));
    let gone = Arc::try_unwrap(c.workers.pop().unwrap()).unwrap_or_else(|_| panic!("shared"));
    assert_eq!(gone.rank(), 1);
    let survivor = &c.workers[0];
    let push = survivor.push(1, &[1.0; 8]);
    drop(gone);
    let err = tokio::time::timeout(Duration::from_secs(20), push)
        .await
        .expect("the push must fail, not hang")
        .expect_err("its round can never complete");
    assert!(err.to_string().contains("worker 1 (node 11)"), "{err}");
    let err = survivor
        .barrier()
        .await
        .expect_err("barrier with a dead worker");
    assert!(err.to_string().contains("worker 1 (node 11)"), "{err}");
}

/// Sends a hello claiming `id` (without a token) to `addr` and returns the answer's kind and
/// body.
async fn forged_hello(addr: std::net::SocketAddr, id: u64) -> (psnet_transport::FrameKind, String) {
    use psnet_transport::codec::{self, DataPath};
    use psnet_transport::{FrameKind, Limits, NodeId, OutMessage};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let hello = codec::encode_hello(NodeId(id), DataPath::Tcp);
    let frame = codec::encode_frame(
        FrameKind::Hello,
        &OutMessage::new(&hello, &[]),
        &Limits::default(),
    )
    .unwrap();
    s.write_all(&frame).await.unwrap();
    let mut buf = bytes::BytesMut::new();
    loop {
        if let Some(f) = codec::decode_frame(&mut buf, &Limits::default()).unwrap() {
            return (f.kind, String::from_utf8_lossy(&f.meta).into_owned());
        }
        assert!(
            s.read_buf(&mut buf).await.unwrap() > 0,
            "closed without an answer"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_hellos_over_tcp_are_refused_and_the_job_goes_on() {
    use psnet_transport::{FrameKind, Transport};
    let c = cluster(1, 2, 100).await;
    let victim = c.workers[0].debug_transport().listen_addr();
    // The scheduler's id, the other worker's (live) id, an id never assigned.
    for (id, why) in [
        (1, "without the proof of its id"),
        (11, "without the proof of its id"),
        (77, "never assigned"),
    ] {
        let (kind, reason) = forged_hello(victim, id).await;
        assert_eq!(kind, FrameKind::HelloReject, "node {id} was let in");
        assert!(reason.contains(why), "node {id}: {reason}");
    }
    // Nothing was swapped: the job still runs.
    let results = on_all(&c.workers, |w| async move {
        w.init(&[1], &[&[0.0; 4]]).await?;
        let mut out = vec![0.0; 4];
        w.pushpull(1, &[1.0; 4], &mut out).await?;
        Ok::<_, KvError>(out)
    })
    .await;
    for r in results {
        assert_eq!(r.unwrap(), vec![2.0; 4]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_sends_give_the_same_sums() {
    // PSNET_KV_SERIAL_SENDS (for benchmarks) changes only how requests go out.
    let c = cluster_with(2, 2, |c| {
        let mut c = c.bigarray_bound(100);
        c.serial_sends = true;
        c
    })
    .await;
    let results = on_all(&c.workers, |w| async move {
        w.init(&[4], &[&[0.0; 250]]).await?;
        let g: Vec<f32> = (0..250).map(|i| i as f32).collect();
        let mut out = vec![0.0; 250];
        w.pushpull(4, &g, &mut out).await?;
        Ok::<_, KvError>(out)
    })
    .await;
    for r in results {
        let out = r.unwrap();
        assert!(out.iter().enumerate().all(|(i, v)| *v == 2.0 * i as f32));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wished_ranks_from_the_launcher_are_the_ranks() {
    use psnet_kv::{run_server, KvConfig, Role, Scheduler, Worker};
    use psnet_transport::NodeId;
    let config =
        |role, root| KvConfig::local(role, root, 1, 3).bootstrap_timeout(Duration::from_secs(30));
    let sched = Scheduler::new(
        &config(Role::Scheduler, "127.0.0.1:0".parse().unwrap()),
        common::tcp(psnet_kv::proto::ids::SCHEDULER, 0).await,
    );
    let root = sched.addr();
    let scheduler = tokio::spawn(sched.run());
    let server = {
        let c = config(Role::Server, root);
        tokio::spawn(async move { run_server(&c, common::tcp(NodeId(0), 0).await).await })
    };
    // Launch index i wishes rank (i + 1) % 3: not the order of the listening ports.
    let joins: Vec<_> = (0..3u32)
        .map(|i| {
            let mut c = config(Role::Worker, root);
            c.rank_hint = Some((i + 1) % 3);
            tokio::spawn(async move {
                let w = Worker::join(&c, common::tcp(NodeId(0), 0).await).await?;
                Ok::<_, KvError>((i, w))
            })
        })
        .collect();
    let mut workers = Vec::new();
    for j in joins {
        let (i, w) = j.await.unwrap().expect("worker joins");
        assert_eq!(w.rank(), (i + 1) % 3, "launch index {i}");
        workers.push(w);
    }
    let finals: Vec<_> = workers
        .into_iter()
        .map(|w| tokio::spawn(async move { w.finalize().await }))
        .collect();
    for f in finals {
        f.await.unwrap().expect("finalize");
    }
    server.await.unwrap().expect("server ends");
    scheduler.await.unwrap().expect("scheduler ends");
}

/// The second hardening round: without a secret, a process saying hello to a worker as
/// server 0 before the scheduler had told the worker who server 0 is was believed, and kept
/// as server 0 afterwards (the workers never reached the real one). A node without its
/// assignment now takes no claim but the scheduler's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_its_assignment_a_node_takes_no_claim_of_an_id() {
    use psnet_kv::{run_server, KvConfig, Role, Scheduler, Worker};
    use psnet_transport::{FrameKind, NodeId, Transport};
    let config =
        |role, root| KvConfig::local(role, root, 1, 1).bootstrap_timeout(Duration::from_secs(30));
    let sched = Scheduler::new(
        &config(Role::Scheduler, "127.0.0.1:0".parse().unwrap()),
        common::tcp(psnet_kv::proto::ids::SCHEDULER, 0).await,
    );
    let root = sched.addr();
    let scheduler = tokio::spawn(sched.run());
    // The worker registers and waits: the job's server has not started yet.
    let t = common::tcp(NodeId(0), 0).await;
    // As a node's own start does before its listener takes a hello (here the listener is up
    // before the spawned join runs: without this, a hello in between met no policy at all).
    t.set_admission(std::sync::Arc::new(
        psnet_kv::proto::admission::JobAdmission::joining(),
    ));
    let victim = t.listen_addr();
    let c = config(Role::Worker, root);
    let worker = tokio::spawn(async move { Worker::join(&c, t).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    // Claims of the scheduler (node 1: a process dialling in under its id would replace the
    // worker's connection to the real one and hand it a table of its own), of server 0
    // (node 8) and of worker 0 (node 9), before anyone is assigned.
    let mut refused = Vec::new();
    for id in [1, 8, 9] {
        loop {
            let (kind, reason) = forged_hello(victim, id).await;
            // Until the worker is bound its listener may not answer hellos yet.
            if kind == FrameKind::HelloReject && reason.contains("no assignment yet") {
                refused.push(id);
                break;
            }
            assert_ne!(kind, FrameKind::HelloAck, "node {id} was let in: {reason}");
            assert!(tokio::time::Instant::now() < deadline, "{kind:?}: {reason}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(refused, [1, 8, 9]);
    // The real server starts; the job runs, and the worker reaches it.
    let server = {
        let c = config(Role::Server, root);
        tokio::spawn(async move { run_server(&c, common::tcp(NodeId(0), 0).await).await })
    };
    let w = worker.await.unwrap().expect("the worker joins");
    w.init(&[1], &[&[0.0; 4]]).await.unwrap();
    let mut out = vec![0.0; 4];
    w.pushpull(1, &[1.0; 4], &mut out).await.unwrap();
    assert_eq!(out, vec![1.0; 4]);
    w.finalize().await.unwrap();
    server.await.unwrap().unwrap();
    scheduler.await.unwrap().unwrap();
}
