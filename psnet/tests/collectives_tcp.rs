//! Collectives over real TCP sockets on 127.0.0.1, bound the way `join_from_env` binds them:
//! results against a reference, and a rank whose transport dies mid-call named by the others.

use std::time::Duration;

use futures_util::future::{join_all, try_join_all};
use psnet::collectives::{join, CollectiveError, Config, ReduceOp, World};
use psnet::Transport;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

async fn world(n: usize) -> Vec<psnet::collectives::Communicator<psnet::AnyTransport>> {
    let root = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    try_join_all((0..n).map(|rank| {
        let w = World {
            rank,
            size: n,
            root,
            source: "test".into(),
        };
        async move { join(&w, Config::default()).await }
    }))
    .await
    .expect("every rank joins")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_and_friends_over_tcp() {
    let n = 4;
    let comms = world(n).await;
    for count in [1usize, 1000, 1 << 20] {
        let mut bufs: Vec<Vec<f32>> = (0..n)
            .map(|r| {
                (0..count)
                    .map(|i| ((i * 31 + r * 7) % 1000) as f32)
                    .collect()
            })
            .collect();
        let want: Vec<f32> = (0..count)
            .map(|i| (0..n).map(|r| ((i * 31 + r * 7) % 1000) as f32).sum())
            .collect();
        try_join_all(
            comms
                .iter()
                .zip(bufs.iter_mut())
                .map(|(c, b)| c.allreduce(b, ReduceOp::Sum)),
        )
        .await
        .expect("allreduce");
        for b in &bufs {
            assert_eq!(b, &want, "{count} elements");
        }
    }
    let mut gathered = vec![vec![0u8; 3 * n]; n];
    try_join_all(
        comms
            .iter()
            .zip(gathered.iter_mut())
            .enumerate()
            .map(|(r, (c, g))| async move { c.allgather(&[r as u8; 3], g).await }),
    )
    .await
    .expect("allgather");
    assert!(gathered
        .iter()
        .all(|g| g == &[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]));
    try_join_all(comms.iter().map(|c| c.barrier()))
        .await
        .expect("barrier");
}

/// Whether `err` blames rank 2: lost itself, or named in the abort of a rank that saw it go.
fn names_rank_2(err: &CollectiveError) -> bool {
    match err {
        CollectiveError::RankLost { rank, .. } => *rank == 2,
        CollectiveError::Aborted { reason, .. } => reason.contains("rank 2"),
        _ => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_whose_transport_dies_is_named_by_the_others() {
    let n = 3;
    let mut comms = world(n).await;
    let dead = comms.pop().expect("rank 2");
    let mut bufs = vec![vec![1.0f32; 1 << 18]; n - 1];
    let calls = comms
        .iter()
        .zip(bufs.iter_mut())
        .map(|(c, b)| tokio::time::timeout(Duration::from_secs(60), c.allreduce(b, ReduceOp::Sum)));
    let kill = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        dead.transport().shutdown();
    };
    let (results, ()) = tokio::join!(join_all(calls), kill);
    for result in results {
        let err = result.expect("fails in bounded time").unwrap_err();
        assert!(names_rank_2(&err), "{err}");
    }
}

/// Rank 2 dies; rank 1, once its call fails, drops its transport at once (as a process that
/// exits on the error does) while rank 0 may still be sending to it. Rank 0 must still name
/// rank 2, the first failure, which rank 1 reported before it went, not the broken pipe rank
/// 1 left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_exits_on_an_error_is_not_blamed_for_it() {
    for attempt in 0..5 {
        let n = 3;
        let mut comms = world(n).await;
        let dead = comms.pop().expect("rank 2");
        let rank1 = comms.pop().expect("rank 1");
        let rank0 = comms.pop().expect("rank 0");
        let mut b0 = vec![1.0f32; 1 << 22];
        let mut b1 = vec![1.0f32; 1 << 22];
        let first = async {
            tokio::time::timeout(
                Duration::from_secs(60),
                rank0.allreduce(&mut b0, ReduceOp::Sum),
            )
            .await
        };
        let second = async {
            let result = tokio::time::timeout(
                Duration::from_secs(60),
                rank1.allreduce(&mut b1, ReduceOp::Sum),
            )
            .await;
            rank1.transport().shutdown();
            result
        };
        let kill = async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            dead.transport().shutdown();
        };
        let (r0, r1, ()) = tokio::join!(first, second, kill);
        for (rank, result) in [(0, r0), (1, r1)] {
            let err = result.expect("fails in bounded time").unwrap_err();
            assert!(names_rank_2(&err), "attempt {attempt}, rank {rank}: {err}");
        }
    }
}
