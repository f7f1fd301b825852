//! Point-to-point messages on the in-memory network, in simulated time with seeded delays:
//! matched per sender and tag in the order the calls were made (not polled), several in
//! flight, in pieces, zero-length; and their failures: a receive of another length, a sender
//! that dies, a rank that is not a peer.

use futures_util::future::try_join_all;
use psnet_collectives::{node_of, Config};
use psnet_memnet::MemNet;

mod common;

use common::{delayed, runtime, world};

#[test]
fn messages_match_per_sender_and_tag_in_the_order_the_calls_were_made() {
    for seed in 0..8 {
        runtime().block_on(async {
            let net = delayed(seed);
            let config = Config {
                piece_bytes: 24,
                ..Config::default()
            };
            let comms = world(&net, 3, config).await;
            // Rank 0 sends rank 2 five messages with tag 7 and three with tag 9, rank 1 sends
            // it two with tag 7; lengths differ, one is empty. The sends' futures are made in
            // order and run in reverse.
            let msg = |from: usize, tag: u64, k: usize| -> Vec<i32> {
                (0..(k * 5) % 17)
                    .map(|i| (from * 10_000 + tag as usize * 100 + k * 10 + i) as i32)
                    .collect()
            };
            let plan: Vec<(usize, u64, usize)> = (0..5)
                .map(|k| (0, 7, k))
                .chain((0..3).map(|k| (0, 9, k)))
                .chain((0..2).map(|k| (1, 7, k)))
                .collect();
            let datas: Vec<Vec<i32>> = plan.iter().map(|&(f, t, k)| msg(f, t, k)).collect();
            let mut sends: Vec<_> = plan
                .iter()
                .zip(&datas)
                .map(|(&(from, tag, _), d)| comms[from].send(2, tag, d))
                .collect();
            sends.reverse();
            let mut bufs: Vec<Vec<i32>> = datas.iter().map(|d| vec![-1; d.len()]).collect();
            let recvs: Vec<_> = plan
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(from, tag, _), b)| comms[2].recv(from, tag, b))
                .collect();
            let (s, r) = tokio::join!(try_join_all(sends), try_join_all(recvs.into_iter().rev()));
            s.expect("sends");
            r.expect("receives");
            assert_eq!(bufs, datas, "seed {seed}");
        });
    }
}

#[test]
fn a_receive_of_another_length_or_type_fails_naming_the_sender() {
    runtime().block_on(async {
        let net = MemNet::reliable();
        let comms = world(&net, 2, Config::default()).await;
        let data = vec![1.5f32; 10];
        let mut short = vec![0f32; 8];
        let (s, r) = tokio::join!(comms[0].send(1, 3, &data), comms[1].recv(0, 3, &mut short));
        s.expect("the send goes");
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("rank 0") && e.contains("send of 10 x") && e.contains("recv of 8 x"),
            "{e}"
        );
        let ints = vec![1i32; 4];
        let mut floats = vec![0f32; 4];
        let (_, r) = tokio::join!(comms[0].send(1, 4, &ints), comms[1].recv(0, 4, &mut floats));
        let e = r.unwrap_err().to_string();
        assert!(e.contains("rank 0") && e.contains("send of 4 x"), "{e}");
    });
}

/// Ranks connect when a call first needs them: two ranks that no call has joined yet (not
/// neighbours on 6 ranks) exchange messages both ways; a rank that died before anyone
/// dialled it is named by a receive from it and by a send to it, not waited for.
#[test]
fn ranks_no_call_has_joined_yet_connect_when_they_first_talk() {
    for seed in 0..4 {
        runtime().block_on(async {
            let net = delayed(seed);
            let comms = world(&net, 6, Config::default()).await;
            let (a, b) = (1, 4);
            let (to_b, to_a) = (vec![seed as i64; 9], vec![-(seed as i64); 3]);
            let (mut at_b, mut at_a) = (vec![0i64; 9], vec![0i64; 3]);
            let (s1, r1, s2, r2) = tokio::join!(
                comms[a].send(b, 5, &to_b),
                comms[b].recv(a, 5, &mut at_b),
                comms[b].send(a, 6, &to_a),
                comms[a].recv(b, 6, &mut at_a),
            );
            s1.and(r1).and(s2).and(r2).expect("both ways");
            assert_eq!((at_b, at_a), (to_b, to_a), "seed {seed}");

            // What a rank sent before it died is still received, though it can no longer
            // be dialled.
            let sent = vec![7u8; 5];
            comms[2].send(5, 8, &sent).await.expect("the send goes");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            assert!(net.kill(node_of(2)));
            let mut got = vec![0u8; 5];
            comms[5]
                .recv(2, 8, &mut got)
                .await
                .expect("what rank 2 sent");
            assert_eq!(got, sent, "seed {seed}");

            assert!(net.kill(node_of(3)));
            let mut buf = vec![0u8; 4];
            let e = comms[1].recv(3, 0, &mut buf).await.unwrap_err().to_string();
            assert!(e.contains("rank 3"), "seed {seed}: {e}");
            let e = comms[5].send(3, 0, &[1u8]).await.unwrap_err().to_string();
            assert!(e.contains("rank 3"), "seed {seed}: {e}");
        });
    }
}

#[test]
fn a_receive_from_a_rank_that_dies_fails_naming_it() {
    runtime().block_on(async {
        let net = MemNet::reliable();
        let comms = world(&net, 3, Config::default()).await;
        let mut buf = vec![0u8; 4];
        let recv = comms[0].recv(2, 0, &mut buf);
        let kill = async {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            assert!(net.kill(node_of(2)));
        };
        let (r, ()) = tokio::join!(recv, kill);
        let e = r.unwrap_err().to_string();
        assert!(e.contains("rank 2"), "{e}");
        // A send to it fails too, naming it.
        let e = comms[1].send(2, 0, &[1u8]).await.unwrap_err().to_string();
        assert!(e.contains("rank 2"), "{e}");
    });
}

#[test]
fn only_other_ranks_are_peers() {
    runtime().block_on(async {
        let net = MemNet::reliable();
        let comms = world(&net, 2, Config::default()).await;
        for bad in [0usize, 2] {
            let e = comms[0].send(bad, 0, &[1u8]).await.unwrap_err().to_string();
            assert!(
                e.contains(&format!("rank {bad} is not another rank")),
                "{e}"
            );
        }
        // The communicator is still usable.
        let mut buf = [0u8; 1];
        let (s, r) = tokio::join!(comms[0].send(1, 0, &[9u8]), comms[1].recv(0, 0, &mut buf));
        s.unwrap();
        r.unwrap();
        assert_eq!(buf, [9]);
    });
}

/// A receive from any rank takes whichever sender's next message with its tag arrives, says
/// who sent it, and leaves a receive from a named rank made before it its own message.
#[test]
fn a_receive_from_any_rank_names_the_sender_and_keeps_earlier_receives_theirs() {
    for seed in 0..8 {
        runtime().block_on(async {
            let net = delayed(seed);
            let config = Config {
                piece_bytes: 16,
                ..Config::default()
            };
            let comms = world(&net, 3, config).await;
            let msg = |from: usize, k: i32| vec![from as i32 * 100 + k; 10];
            // Rank 0 names rank 1 for its first message with tag 3, then takes two from any
            // rank: rank 1's second and rank 2's first, in whichever order they come.
            let mut first = vec![0i32; 10];
            let named = comms[0].recv(1, 3, &mut first);
            let sends = async {
                comms[1].send(0, 3, &msg(1, 0)).await?;
                comms[1].send(0, 3, &msg(1, 1)).await?;
                comms[2].send(0, 3, &msg(2, 0)).await
            };
            let any = async {
                let (mut a, mut b) = (vec![0i32; 10], vec![0i32; 10]);
                let fa = comms[0].recv_any(3, &mut a).await?;
                let fb = comms[0].recv_any(3, &mut b).await?;
                Ok::<_, psnet_collectives::CollectiveError>(vec![(fa, a), (fb, b)])
            };
            let (n, s, got) = tokio::join!(named, sends, any);
            n.expect("the named receive");
            s.expect("the sends");
            let mut got = got.expect("the receives from any rank");
            got.sort();
            assert_eq!(first, msg(1, 0), "seed {seed}");
            assert_eq!(got, vec![(1, msg(1, 1)), (2, msg(2, 0))], "seed {seed}");
        });
    }
}

#[test]
fn a_receive_from_any_rank_that_nobody_sends_times_out_naming_them_all() {
    runtime().block_on(async {
        let config = Config {
            call_timeout: Some(std::time::Duration::from_secs(5)),
            ..Config::default()
        };
        let comms = world(&MemNet::reliable(), 3, config).await;
        let mut buf = [0u8; 4];
        let e = comms[1]
            .recv_any(0, &mut buf)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("recv from any rank (tag 0)") && e.contains("[0, 2]"),
            "{e}"
        );
    });
}
