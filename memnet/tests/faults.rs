//! The in-memory network's faults, in simulated time.

use std::time::Duration;

use psnet_memnet::{Faults, MemNet, MemTransport};
use psnet_transport::{Event, NodeId, OutMessage, Segment, Transport, TransportError};
use tokio::time::{timeout, Instant};

async fn pair(net: &MemNet) -> (MemTransport, MemTransport) {
    let a = net.bind(NodeId(1));
    let b = net.bind(NodeId(2));
    a.connect(NodeId(2), b.listen_addr())
        .await
        .expect("connect");
    (a, b)
}

async fn send(t: &MemTransport, to: u64, seq: u32) -> Result<(), TransportError> {
    let meta = seq.to_le_bytes();
    let data = vec![seq as u8; 100];
    let segs = [Segment::new(&data)];
    t.send(NodeId(to), OutMessage::new(&meta, &segs)).await
}

/// The next message's sequence number, or the lost peer.
async fn next(t: &MemTransport) -> Result<u32, NodeId> {
    loop {
        match t.recv().await.expect("recv") {
            Event::Message(m) => return Ok(u32::from_le_bytes(m.meta[..4].try_into().unwrap())),
            Event::PeerLost { peer, .. } => return Err(peer),
            Event::PeerConnected { .. } => {}
        }
    }
}

#[tokio::test(start_paused = true)]
async fn delays_run_in_simulated_time_and_keep_order() {
    for seed in 0..20 {
        let net = MemNet::with_faults(
            Faults::seeded(seed).delay(Duration::from_millis(10), Duration::from_millis(500)),
        );
        let (a, b) = pair(&net).await;
        let start = Instant::now();
        for i in 0..200 {
            send(&a, 2, i).await.unwrap();
        }
        for i in 0..200 {
            assert_eq!(next(&b).await, Ok(i), "seed {seed}");
        }
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(10) && took <= Duration::from_millis(500),
            "seed {seed}: {took:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_killed_node_is_lost_to_its_peers_and_closed_to_itself() {
    let net = MemNet::reliable();
    let (a, b) = pair(&net).await;
    send(&a, 2, 1).await.unwrap();
    assert!(net.kill(NodeId(2)));
    assert!(!net.kill(NodeId(2)), "a dead node dies once");
    // What was in flight to the dead node is gone with it; the survivor is told.
    assert_eq!(next(&a).await, Err(NodeId(2)));
    assert!(matches!(b.recv().await, Err(TransportError::Closed)));
    let err = send(&a, 2, 2).await.unwrap_err();
    assert_eq!(err.peer(), Some(NodeId(2)));
    let err = a.connect(NodeId(2), b.listen_addr()).await.unwrap_err();
    assert_eq!(err.peer(), Some(NodeId(2)), "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_frozen_node_holds_everything_until_thawed() {
    let net = MemNet::reliable();
    let (a, b) = pair(&net).await;
    assert!(net.freeze(NodeId(2), true));
    for i in 0..10 {
        send(&a, 2, i).await.unwrap();
    }
    assert!(
        timeout(Duration::from_secs(60), next(&b)).await.is_err(),
        "a frozen node receives nothing"
    );
    assert!(
        timeout(Duration::from_secs(60), send(&b, 1, 99))
            .await
            .is_err(),
        "a frozen node sends nothing"
    );
    assert!(timeout(Duration::from_secs(1), next(&a)).await.is_err());
    net.freeze(NodeId(2), false);
    for i in 0..10 {
        assert_eq!(next(&b).await, Ok(i));
    }
    send(&b, 1, 7).await.unwrap();
    assert_eq!(next(&a).await, Ok(7));
}

#[tokio::test(start_paused = true)]
async fn a_reset_loses_data_in_flight_and_tells_both_sides() {
    // Every send after the second resets its connection.
    let net = MemNet::with_faults(
        Faults::seeded(3)
            .delay(Duration::from_secs(1), Duration::from_secs(1))
            .resets(1.0, 2),
    );
    let (a, b) = pair(&net).await;
    for i in 0..2 {
        send(&a, 2, i).await.unwrap();
    }
    let err = send(&a, 2, 2).await.unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::PeerLost {
                peer: NodeId(2),
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(next(&a).await, Err(NodeId(2)));
    // The two delayed messages were still in flight: lost with the connection.
    assert_eq!(next(&b).await, Err(NodeId(1)));
    assert!(a.connected_peers().is_empty() && b.connected_peers().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_connection_to_the_wrong_node_is_refused() {
    let net = MemNet::reliable();
    let a = net.bind(NodeId(1));
    let b = net.bind(NodeId(2));
    let err = a.connect(NodeId(3), b.listen_addr()).await.unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Handshake {
                peer: NodeId(3),
                ..
            }
        ),
        "{err}"
    );
}
