//! `PSNET_FAULTS` on real sockets: a dropped connection loses its message and both sides see
//! the peer lost; a periodic reset closes the connection after the message it strikes.

use std::time::Duration;

use psnet_fallback_tcp::{FaultSpec, TcpConfig, TcpTransport};
use psnet_transport::{Event, NodeId, OutMessage, Transport};
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(30);

async fn node(id: u64, faults: Option<&str>) -> TcpTransport {
    let config = TcpConfig {
        faults: faults.map(|f| f.parse::<FaultSpec>().unwrap()),
        ..TcpConfig::default()
    };
    TcpTransport::bind(NodeId(id), config).await.unwrap()
}

/// The next message or loss `t` sees (connection announcements skipped).
async fn next(t: &TcpTransport) -> Event {
    loop {
        match timeout(LIMIT, t.recv()).await.expect("no hang").unwrap() {
            Event::PeerConnected { .. } => {}
            other => return other,
        }
    }
}

#[tokio::test]
async fn a_dropped_connection_loses_its_message_and_both_sides_see_the_loss() {
    let a = node(1, Some("drop=1,seed=1")).await;
    let b = node(2, None).await;
    a.connect(NodeId(2), b.listen_addr()).await.unwrap();
    // The send reports success, as a write into a dying connection's buffer does.
    a.send(NodeId(2), OutMessage::new(b"lost", &[]))
        .await
        .unwrap();
    assert!(matches!(next(&b).await, Event::PeerLost { peer, .. } if peer == NodeId(1)));
    assert!(matches!(next(&a).await, Event::PeerLost { peer, .. } if peer == NodeId(2)));
    let c = a.fault_counts().unwrap();
    assert_eq!((c.sends, c.drops, c.resets), (1, 1, 0));
    assert!(b.fault_counts().is_none());
}

#[tokio::test]
async fn a_periodic_reset_strikes_after_the_message() {
    let a = node(1, Some("reset_every=3,delay=1ms,seed=2")).await;
    let b = node(2, None).await;
    a.connect(NodeId(2), b.listen_addr()).await.unwrap();
    for i in 0u8..3 {
        a.send(NodeId(2), OutMessage::new(&[i], &[])).await.unwrap();
    }
    // The first two arrive in order; the third was written before the close.
    for i in 0u8..3 {
        match next(&b).await {
            Event::Message(m) => assert_eq!(&m.meta[..], &[i]),
            other => panic!("message {i}: got {other:?}"),
        }
    }
    assert!(matches!(next(&b).await, Event::PeerLost { .. }));
    // A fresh connection works again, and the fourth send is not struck.
    a.connect(NodeId(2), b.listen_addr()).await.unwrap();
    a.send(NodeId(2), OutMessage::new(b"again", &[]))
        .await
        .unwrap();
    match next(&b).await {
        Event::Message(m) => assert_eq!(&m.meta[..], b"again"),
        other => panic!("got {other:?}"),
    }
    let c = a.fault_counts().unwrap();
    assert_eq!((c.sends, c.drops, c.resets), (4, 0, 1));
}
