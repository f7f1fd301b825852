//! All-to-all, gather and scatter on whole communicators of the in-memory network, in
//! simulated time with seeded delays: against the blocks each rank sent, on 1 to 6 ranks,
//! with uneven and zero-length splits; and their failures: split sizes that two ranks
//! disagree on, a rank lost mid-call, a bad root.

use std::time::Duration;

use futures_util::future::try_join_all;
use psnet_collectives::{node_of, Config};
use psnet_memnet::MemNet;

mod common;

use common::{delayed, runtime, world};

/// What rank `from` sends rank `to` at position `i`.
fn value(from: usize, to: usize, i: usize) -> i64 {
    (from * 1_000_000 + to * 1_000 + i) as i64
}

/// Elements rank `from` sends rank `to`: uneven, some zero.
fn split(from: usize, to: usize, seed: u64) -> usize {
    ((from * 7 + to * 3 + seed as usize) % 5) * 3
}

#[test]
fn alltoallv_delivers_every_rank_its_blocks() {
    for n in 1..=6 {
        for seed in 0..4 {
            runtime().block_on(async {
                let net = delayed(seed);
                // Small pieces: blocks travel as several messages.
                let config = Config {
                    piece_bytes: 16,
                    ..Config::default()
                };
                let comms = world(&net, n, config).await;
                let sends: Vec<Vec<i64>> = (0..n)
                    .map(|r| {
                        (0..n)
                            .flat_map(|j| (0..split(r, j, seed)).map(move |i| value(r, j, i)))
                            .collect()
                    })
                    .collect();
                let send_counts: Vec<Vec<usize>> = (0..n)
                    .map(|r| (0..n).map(|j| split(r, j, seed)).collect())
                    .collect();
                let recv_counts: Vec<Vec<usize>> = (0..n)
                    .map(|r| (0..n).map(|i| split(i, r, seed)).collect())
                    .collect();
                let mut recvs: Vec<Vec<i64>> = recv_counts
                    .iter()
                    .map(|c| vec![-1; c.iter().sum()])
                    .collect();
                try_join_all(comms.iter().zip(recvs.iter_mut()).enumerate().map(
                    |(r, (c, recv))| c.alltoallv(&sends[r], &send_counts[r], recv, &recv_counts[r]),
                ))
                .await
                .expect("alltoallv");
                for (r, recv) in recvs.iter().enumerate() {
                    let want: Vec<i64> = (0..n)
                        .flat_map(|i| (0..split(i, r, seed)).map(move |k| value(i, r, k)))
                        .collect();
                    assert_eq!(recv, &want, "rank {r} of {n}, seed {seed}");
                }
            });
        }
    }
}

#[test]
fn alltoall_gather_and_scatter_of_equal_blocks() {
    for n in 1..=5 {
        runtime().block_on(async {
            let net = delayed(n as u64);
            let comms = world(&net, n, Config::default()).await;
            let block = 1000;
            // All-to-all.
            let sends: Vec<Vec<i64>> = (0..n)
                .map(|r| {
                    (0..n)
                        .flat_map(|j| (0..block).map(move |i| value(r, j, i)))
                        .collect()
                })
                .collect();
            let mut recvs = vec![vec![0i64; block * n]; n];
            try_join_all(
                comms
                    .iter()
                    .zip(recvs.iter_mut())
                    .enumerate()
                    .map(|(r, (c, recv))| c.alltoall(&sends[r], recv)),
            )
            .await
            .expect("alltoall");
            for (r, recv) in recvs.iter().enumerate() {
                for i in 0..n {
                    assert_eq!(recv[i * block], value(i, r, 0));
                    assert_eq!(recv[(i + 1) * block - 1], value(i, r, block - 1));
                }
            }
            // Gather to the last rank, then scatter from it.
            let root = n - 1;
            let mine: Vec<Vec<i64>> = (0..n)
                .map(|r| (0..block).map(|i| value(r, root, i)).collect())
                .collect();
            let mut gathered = vec![0i64; block * n];
            let mut slot = Some(&mut gathered);
            let calls = comms.iter().enumerate().map(|(r, c)| {
                let recv = if r == root {
                    slot.take().map(|g| &mut g[..])
                } else {
                    None
                };
                c.gather(&mine[r], recv, root)
            });
            try_join_all(calls).await.expect("gather");
            let want: Vec<i64> = mine.concat();
            assert_eq!(gathered, want);
            let mut parts = vec![vec![0i64; block]; n];
            let calls = comms
                .iter()
                .zip(parts.iter_mut())
                .enumerate()
                .map(|(r, (c, p))| {
                    let send = (r == root).then_some(&want[..]);
                    c.scatter(send, p, root)
                });
            try_join_all(calls).await.expect("scatter");
            assert_eq!(parts, mine);
        });
    }
}

#[test]
fn split_sizes_two_ranks_disagree_on_fail_naming_the_sender() {
    runtime().block_on(async {
        let net = MemNet::reliable();
        let comms = world(&net, 3, Config::default()).await;
        // Rank 0 sends rank 1 four elements; rank 1 expects two from it. Every other pair
        // agrees.
        let (send0, send1, send2) = (vec![1i64; 6], vec![2i64; 6], vec![3i64; 6]);
        let (mut r0, mut r1, mut r2) = (vec![0i64; 4], vec![0i64; 6], vec![0i64; 6]);
        let (a, b, c) = tokio::join!(
            comms[0].alltoallv(&send0, &[2, 4, 0], &mut r0, &[2, 2, 0]),
            comms[1].alltoallv(&send1, &[2, 2, 2], &mut r1, &[2, 2, 2]),
            comms[2].alltoallv(&send2, &[0, 2, 4], &mut r2, &[0, 2, 4]),
        );
        let e1 = b.expect_err("rank 1 refuses rank 0's block").to_string();
        assert!(e1.contains("rank 0"), "{e1}");
        // Ranks 0 and 2 got what they expected; their next call fails with rank 1's reason.
        let _ = (a, c);
        let (a, c) = tokio::join!(comms[0].barrier(), comms[2].barrier());
        for e in [a.unwrap_err(), c.unwrap_err()] {
            let e = e.to_string();
            assert!(e.contains("rank 1") && e.contains("rank 0"), "{e}");
        }
    });
}

#[test]
fn a_rank_lost_mid_alltoall_is_named_by_the_others() {
    runtime().block_on(async {
        let net = MemNet::reliable();
        let comms = world(&net, 3, Config::default()).await;
        assert!(net.kill(node_of(2)));
        let send = vec![0i64; 3 * 100];
        let (mut a, mut b) = (vec![0i64; 300], vec![0i64; 300]);
        let (ra, rb) = tokio::join!(
            comms[0].alltoall(&send, &mut a),
            comms[1].alltoall(&send, &mut b)
        );
        for e in [ra.unwrap_err(), rb.unwrap_err()] {
            assert!(e.to_string().contains("rank 2"), "{e}");
        }
    });
}

#[test]
fn bad_arguments_fail_the_call_with_the_reason() {
    runtime().block_on(async {
        let net = MemNet::reliable();
        let comms = world(&net, 2, Config::default()).await;
        let mut out = vec![0i64; 4];
        let e = comms[0]
            .alltoall(&[1i64; 3], &mut out)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 equal blocks"), "{e}");
        let net = MemNet::reliable();
        let comms = world(&net, 2, Config::default()).await;
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            comms[0].gather(&[1i64; 2], None, 0),
        )
        .await
        .expect("no hang");
        assert!(r.unwrap_err().to_string().contains("the root passes"));
    });
}
