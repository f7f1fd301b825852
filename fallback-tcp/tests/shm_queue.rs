//! The same-host message queue: once a peer on this host maps it, every message goes through
//! it (small ones whole, large ones as ring descriptors, the rest as markers for the socket)
//! and arrives intact and in the order it was sent.

use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::device::SimulatedDevice;
use psnet_transport::{Event, Incoming, NodeId, OutMessage, Segment, Transport};
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(60);

async fn pair(config: TcpConfig) -> (TcpTransport, TcpTransport) {
    let a = TcpTransport::bind(NodeId(1), config.clone()).await.unwrap();
    let b = TcpTransport::bind(NodeId(2), config).await.unwrap();
    a.connect(NodeId(2), b.listen_addr()).await.unwrap();
    (a, b)
}

async fn next_message(t: &TcpTransport) -> Incoming {
    timeout(LIMIT, async {
        loop {
            match t.recv().await.unwrap() {
                Event::Message(m) => return m,
                Event::PeerLost { reason, .. } => panic!("peer lost: {reason}"),
                _ => continue,
            }
        }
    })
    .await
    .expect("a message within the limit")
}

/// Message `i` of a sender: its size picks the path (inline, ring, socket past the ring,
/// device memory through the socket); its bytes say who sent it and its number.
fn message(sender: u8, i: u32) -> (Vec<u8>, bool) {
    let len = match i % 7 {
        0..=2 => (i as usize * 31) % 200,
        3 => 1024 + (i as usize * 97) % (32 << 10),
        4 | 5 => (64 << 10) + (i as usize * 4099) % (512 << 10),
        _ if i % 14 == 6 => (5 << 20) + i as usize % 7,
        _ => (100 << 10) + 3,
    };
    let mut bytes = vec![sender ^ (i as u8); len];
    if len >= 5 {
        bytes[..4].copy_from_slice(&i.to_le_bytes());
        bytes[4] = sender;
    }
    (bytes, i % 14 == 13)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_delivers_in_the_order_sent() {
    // A 4 MiB ring, so that 5 MiB messages take the socket with a marker in the queue.
    let config = TcpConfig {
        shm_ring: 4 << 20,
        ..TcpConfig::default()
    };
    let (a, b) = pair(config).await;
    let a = std::sync::Arc::new(a);
    const N: u32 = 700;
    // Two senders at once: each one's messages keep their order. The first messages leave
    // before the queue is mapped, through the socket.
    let mut senders = Vec::new();
    for sender in [1u8, 2] {
        let a = a.clone();
        senders.push(tokio::spawn(async move {
            for i in 0..N {
                let (bytes, device) = message(sender, i);
                let meta = [sender];
                if device {
                    let region = SimulatedDevice::new(bytes, 0);
                    a.send(
                        NodeId(2),
                        OutMessage::new(&meta, &[Segment::device(&region)]),
                    )
                    .await
                    .unwrap();
                } else {
                    a.send(NodeId(2), OutMessage::new(&meta, &[Segment::new(&bytes)]))
                        .await
                        .unwrap();
                }
                if i % 100 == 99 {
                    // Long enough for the receiver to stop polling and sleep on its eventfd.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }
    let mut next = [0u32; 2];
    for _ in 0..2 * N {
        let m = next_message(&b).await;
        let sender = m.meta[0];
        let i = next[sender as usize - 1];
        let (want, _) = message(sender, i);
        assert_eq!(m.segments.len(), 1);
        assert!(
            m.segments[0] == want[..],
            "sender {sender} message {i}: {} bytes, {} expected",
            m.segments[0].len(),
            want.len()
        );
        next[sender as usize - 1] += 1;
    }
    for s in senders {
        s.await.unwrap();
    }
    let paths = a.send_paths();
    assert!(paths.queue > 0, "{paths:?}");
    assert!(paths.ring > 0, "{paths:?}");
    assert!(paths.socket > 0, "{paths:?}");
    assert_eq!(paths.queue + paths.ring + paths.socket, 2 * N as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departed_peer_s_queued_messages_arrive_before_its_loss() {
    let (a, b) = pair(TcpConfig::default()).await;
    wait_for_the_queue(&a, &b).await;
    for i in 0..2000u32 {
        a.send(NodeId(2), OutMessage::new(&i.to_le_bytes(), &[]))
            .await
            .unwrap();
    }
    drop(a);
    for i in 0..2000u32 {
        let m = next_message(&b).await;
        assert_eq!(&m.meta[..], &i.to_le_bytes());
    }
    let lost = timeout(LIMIT, async {
        loop {
            if let Event::PeerLost { peer, .. } = b.recv().await.unwrap() {
                return peer;
            }
        }
    })
    .await
    .expect("the loss is reported");
    assert_eq!(lost, NodeId(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_ring_only_sockets_carry_messages() {
    let config = TcpConfig {
        shm_ring: 0,
        ..TcpConfig::default()
    };
    let (a, b) = pair(config).await;
    for i in 0..50u32 {
        let body = vec![i as u8; (i as usize) << 12];
        a.send(NodeId(2), OutMessage::new(b"", &[Segment::new(&body)]))
            .await
            .unwrap();
        let m = next_message(&b).await;
        assert!(m.segments[0] == body[..]);
    }
    let paths = a.send_paths();
    assert_eq!((paths.queue, paths.ring, paths.socket), (0, 0, 50));
}

/// Sends probes until one goes through the queue.
async fn wait_for_the_queue(a: &TcpTransport, b: &TcpTransport) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let before = a.send_paths().queue;
        a.send(NodeId(2), OutMessage::new(b"probe", &[]))
            .await
            .unwrap();
        next_message(b).await;
        if a.send_paths().queue > before {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the queue was never used"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn next_loss(t: &TcpTransport) -> (NodeId, String) {
    timeout(LIMIT, async {
        loop {
            if let Event::PeerLost { peer, reason } = t.recv().await.unwrap() {
                return (peer, reason);
            }
        }
    })
    .await
    .expect("the loss is reported")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_message_over_the_receiver_s_limits_ends_the_connection_on_both_sides() {
    // As over the socket: the receiver refuses, says why, and both sides lose the peer.
    let a = TcpTransport::bind(NodeId(1), TcpConfig::default())
        .await
        .unwrap();
    let strict = TcpConfig {
        limits: psnet_transport::Limits {
            max_message: 50_000,
            ..psnet_transport::Limits::default()
        },
        ..TcpConfig::default()
    };
    let b = TcpTransport::bind(NodeId(2), strict).await.unwrap();
    a.connect(NodeId(2), b.listen_addr()).await.unwrap();
    wait_for_the_queue(&a, &b).await;
    let big = vec![5u8; 60_000];
    // The send itself succeeds: the message is in the queue before the receiver looks.
    a.send(NodeId(2), OutMessage::new(b"", &[Segment::new(&big)]))
        .await
        .unwrap();
    let (peer, why) = next_loss(&b).await;
    assert_eq!(peer, NodeId(1));
    assert!(why.contains("PSNET_MAX_MESSAGE"), "{why}");
    let (peer, why) = next_loss(&a).await;
    assert_eq!(peer, NodeId(2));
    assert!(
        why.contains("PSNET_MAX_MESSAGE"),
        "the sender is told why: {why}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_send_dropped_before_it_left_gives_its_ring_region_back() {
    // A 2 MiB ring holds one 1 MiB message at a time: a region kept by a send that never left
    // would send every later one through the socket.
    let a = std::sync::Arc::new(
        TcpTransport::bind(
            NodeId(1),
            TcpConfig {
                shm_ring: 2 << 20,
                shm_queue: 4096,
                ..TcpConfig::default()
            },
        )
        .await
        .unwrap(),
    );
    let b = TcpTransport::bind(
        NodeId(2),
        TcpConfig {
            inbox_bytes: 64 << 10,
            ..TcpConfig::default()
        },
    )
    .await
    .unwrap();
    a.connect(NodeId(2), b.listen_addr()).await.unwrap();
    wait_for_the_queue(&a, &b).await;
    let big = vec![3u8; 1 << 20];
    let send_big = |a: std::sync::Arc<TcpTransport>, big: Vec<u8>| async move {
        a.send(NodeId(2), OutMessage::new(b"B", &[Segment::new(&big)]))
            .await
    };
    // The first large message offers the ring; send until one has gone through it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while a.send_paths().ring == 0 {
        send_big(a.clone(), big.clone()).await.unwrap();
        next_message(&b).await;
        assert!(
            std::time::Instant::now() < deadline,
            "the ring was never used: {:?}",
            a.send_paths()
        );
    }
    // b stops reading: its inbox fills, then a's queue; a sender then waits for room
    // holding the connection's writer.
    let small = vec![1u8; 600];
    let filler = {
        let a = a.clone();
        tokio::spawn(async move {
            for _ in 0..400 {
                a.send(NodeId(2), OutMessage::new(b"s", &[Segment::new(&small)]))
                    .await
                    .unwrap();
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!filler.is_finished(), "the queue never filled");
    // This send takes its ring region, then waits for the writer; it is dropped there.
    let dropped = timeout(Duration::from_millis(200), send_big(a.clone(), big.clone())).await;
    assert!(
        dropped.is_err(),
        "the large send went out while the queue was full"
    );
    // b reads everything; then every 1 MiB message still fits the ring.
    let reader = async {
        for _ in 0..400 {
            let m = next_message(&b).await;
            assert_eq!(&m.meta[..], b"s");
        }
    };
    reader.await;
    filler.await.unwrap();
    let before = a.send_paths();
    for _ in 0..6 {
        send_big(a.clone(), big.clone()).await.unwrap();
        let m = next_message(&b).await;
        assert_eq!(m.segments[0].len(), 1 << 20);
    }
    let after = a.send_paths();
    assert_eq!(
        (after.ring - before.ring, after.socket - before.socket),
        (6, 0),
        "{before:?} -> {after:?}"
    );
}
