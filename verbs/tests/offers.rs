//! Standing offers over real verbs: a repeated large message is written straight into a buffer
//! the receiver offered, without the rendezvous round trip, and arrives intact and in order.
//! Runs where an RDMA device exists (the Soft-RoCE guest); prints SKIPPED with the reason
//! elsewhere.

mod common;

use common::{next_message, pair};

use std::time::Duration;

use psnet_transport::{Incoming, NodeId, OutMessage, Segment, Transport};
use psnet_verbs::link::LinkStats;
use psnet_verbs::VerbsTransport;

const CASE_TIMEOUT: Duration = Duration::from_secs(120);

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(131).wrapping_add(seed) as u8)
        .collect()
}

/// Sends message `seq`: 8 bytes of metadata (the seq) and the given segments.
async fn send(t: &VerbsTransport, to: NodeId, seq: u64, segments: &[Vec<u8>]) {
    let meta = seq.to_le_bytes();
    let segs: Vec<Segment<'_>> = segments.iter().map(|s| Segment::new(s)).collect();
    t.send(to, OutMessage::new(&meta, &segs))
        .await
        .unwrap_or_else(|e| panic!("send #{seq}: {e}"));
}

fn check(m: &Incoming, seq: u64, segments: &[Vec<u8>]) {
    assert_eq!(u64::from_le_bytes(m.meta[..].try_into().unwrap()), seq);
    assert_eq!(m.segments.len(), segments.len(), "message #{seq}");
    for (got, want) in m.segments.iter().zip(segments) {
        assert!(got[..] == want[..], "message #{seq} corrupted");
    }
}

fn stats(t: &VerbsTransport, peer: NodeId) -> LinkStats {
    t.link_stats(peer).expect("a queue pair to the peer")
}

/// Request and reply of the same sizes, as a worker pushing and pulling one key: after the
/// first exchange, both directions write into offered buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_messages_are_written_into_offered_buffers() {
    let Some((a, b)) = pair(16 << 20).await else {
        return;
    };
    tokio::time::timeout(CASE_TIMEOUT, async {
        const ROUNDS: u64 = 30;
        for i in 0..ROUNDS {
            let push = vec![pattern(300 << 10, i), pattern(5, i)];
            send(&a, b.local_id(), i, &push).await;
            check(&next_message(&b).await, i, &push);
            let reply = vec![pattern(1 << 20, i + 1000)];
            send(&b, a.local_id(), i, &reply).await;
            check(&next_message(&a).await, i, &reply);
        }
        for (from, to) in [(&a, &b), (&b, &a)] {
            let sent = stats(from, to.local_id());
            let got = stats(to, from.local_id());
            assert_eq!(sent.sent_rendezvous + sent.sent_direct, ROUNDS);
            assert!(
                sent.sent_direct >= ROUNDS - 2,
                "offers were not used for a repeated message: {sent:?}"
            );
            assert_eq!(got.received_direct, sent.sent_direct);
            assert!(
                got.offered_now >= 1,
                "the receiver keeps an offer out: {got:?}"
            );
        }
    })
    .await
    .expect("hung");
}

/// Sizes that change from message to message, four in flight at once, large and eager
/// messages interleaved: whichever path each takes, every message arrives intact, once, and
/// after every message whose send completed before it was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_sizes_in_flight_stay_in_order() {
    let Some((a, b)) = pair(16 << 20).await else {
        return;
    };
    let a = std::sync::Arc::new(a);
    tokio::time::timeout(CASE_TIMEOUT, async {
        const N: u64 = 400;
        let size = |i: u64| [20 << 10, 700 << 10, 100, 64 << 10, 3 << 20][(i * 7 % 5) as usize];
        let to = b.local_id();
        let sender = {
            let a = a.clone();
            tokio::spawn(async move {
                // Four sends in flight at a time; they may be posted in any order.
                for c in 0..N / 4 {
                    let body = |k: u64| vec![pattern(size(4 * c + k), 4 * c + k)];
                    let (b0, b1, b2, b3) = (body(0), body(1), body(2), body(3));
                    tokio::join!(
                        send(&a, to, 4 * c, &b0),
                        send(&a, to, 4 * c + 1, &b1),
                        send(&a, to, 4 * c + 2, &b2),
                        send(&a, to, 4 * c + 3, &b3),
                    );
                }
            })
        };
        for c in 0..N / 4 {
            let mut seen = Vec::new();
            for _ in 0..4 {
                let m = next_message(&b).await;
                let i = u64::from_le_bytes(m.meta[..].try_into().unwrap());
                assert_eq!(i / 4, c, "message #{i} overtook a whole group of sends");
                check(&m, i, &[pattern(size(i), i)]);
                seen.push(i);
            }
            seen.sort();
            assert_eq!(seen, (4 * c..4 * c + 4).collect::<Vec<_>>());
        }
        sender.await.expect("sender");
        let sent = stats(&a, to);
        assert!(sent.sent_direct > 0, "{sent:?}");
        assert_eq!(stats(&b, a.local_id()).received_direct, sent.sent_direct);
    })
    .await
    .expect("hung");
}

/// `offer_bytes = 0` turns offers off: every large message takes the rendezvous.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_offer_budget_means_rendezvous_only() {
    let Some((a, b)) = pair(0).await else {
        return;
    };
    tokio::time::timeout(CASE_TIMEOUT, async {
        for i in 0..5 {
            let body = vec![pattern(256 << 10, i)];
            send(&a, b.local_id(), i, &body).await;
            check(&next_message(&b).await, i, &body);
        }
        let sent = stats(&a, b.local_id());
        assert_eq!((sent.sent_rendezvous, sent.sent_direct), (5, 0));
        assert_eq!(stats(&b, a.local_id()).offered_now, 0);
    })
    .await
    .expect("hung");
}
