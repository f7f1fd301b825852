//! The same-host bulk path: peers on one host map each other's ring and large messages travel
//! through it, intact and in order with the small ones that still use the socket.

use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::{Event, NodeId, OutMessage, Segment, Transport};

/// How many psnet rings (anonymous memory files) this process has mapped.
fn mapped_rings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| {
            m.lines()
                .filter(|l| l.contains("/memfd:psnet-ring"))
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_use_the_ring_and_stay_in_order() {
    let before = mapped_rings();
    let a = TcpTransport::bind(NodeId(1), TcpConfig::default())
        .await
        .unwrap();
    let b = TcpTransport::bind(NodeId(2), TcpConfig::default())
        .await
        .unwrap();
    a.connect(NodeId(2), b.listen_addr()).await.unwrap();
    // The first large message offers the ring (and itself takes the socket).
    let first = vec![9u8; 1 << 20];
    a.send(NodeId(2), OutMessage::new(b"F", &[Segment::new(&first)]))
        .await
        .unwrap();
    let m = loop {
        match b.recv().await.unwrap() {
            Event::Message(m) => break m,
            _ => continue,
        }
    };
    assert!(m.segments[0] == first[..]);
    // The sender's mapping and the receiver's.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while mapped_rings() < before + 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "rings were not mapped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Alternate large (ring) and small (socket) messages; 300 x 1 MiB also wraps the ring.
    let big: Vec<Vec<u8>> = (0..4u8).map(|k| vec![k; 1 << 20]).collect();
    let sender = tokio::spawn(async move {
        for i in 0..300u32 {
            let seq = i.to_le_bytes();
            let large = [Segment::new(&big[i as usize % 4]), Segment::new(&seq)];
            a.send(NodeId(2), OutMessage::new(b"L", &large))
                .await
                .unwrap();
            a.send(NodeId(2), OutMessage::new(b"S", &[Segment::new(&seq)]))
                .await
                .unwrap();
        }
        a
    });
    for i in 0..300u32 {
        for kind in [b"L", b"S"] {
            let m = loop {
                match b.recv().await.unwrap() {
                    Event::Message(m) => break m,
                    _ => continue,
                }
            };
            assert_eq!(&m.meta[..], kind);
            let seq = m.segments.last().unwrap();
            assert_eq!(&seq[..], &i.to_le_bytes(), "out of order");
            if kind == b"L" {
                assert_eq!(m.segments[0].len(), 1 << 20);
                assert!(
                    m.segments[0].iter().all(|&v| v == (i % 4) as u8),
                    "corrupted #{i}"
                );
            }
        }
    }
    let a = sender.await.unwrap();
    a.shutdown();
    b.shutdown();
}
