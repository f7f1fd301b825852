//! Bad input on the wire: garbage, malformed or oversize frames, truncation, abandoned sends.
//! Each must end in a clear per-peer error, never a panic, a hang or a corrupted stream.

use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::codec::{self, DataPath, FrameKind};
use psnet_transport::{Event, Limits, NodeId, OutMessage, Segment, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(30);

async fn node(id: u64) -> TcpTransport {
    node_with(id, TcpConfig::default()).await
}

async fn node_with(id: u64, config: TcpConfig) -> TcpTransport {
    TcpTransport::bind(NodeId(id), config).await.expect("bind")
}

/// A raw socket that completed the handshake as node `id`.
async fn raw_peer(t: &TcpTransport, id: u64) -> TcpStream {
    let mut s = TcpStream::connect(t.listen_addr()).await.unwrap();
    let hello = codec::encode_frame(
        FrameKind::Hello,
        &OutMessage::new(&codec::encode_hello(NodeId(id), codec::DataPath::Tcp), &[]),
        &Limits::default(),
    )
    .unwrap();
    s.write_all(&hello).await.unwrap();
    let mut ack = [0u8; codec::PREFIX_LEN + codec::HELLO_LEN];
    s.read_exact(&mut ack).await.unwrap();
    assert_eq!(ack[3], FrameKind::HelloAck as u8);
    s
}

async fn next_loss(t: &TcpTransport) -> (NodeId, String) {
    timeout(LIMIT, async {
        loop {
            match t.recv().await.expect("recv") {
                Event::PeerLost { peer, reason } => return (peer, reason),
                _ => continue,
            }
        }
    })
    .await
    .expect("no PeerLost in time")
}

/// Whether the transport closes the raw socket (frames it sends first, such as its
/// shared-memory offer, are skipped).
async fn closed_by_transport(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    timeout(LIMIT, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue,
            }
        }
    })
    .await
    .unwrap_or(false)
}

#[tokio::test]
async fn garbage_instead_of_a_hello_is_dropped_and_service_goes_on() {
    let t = node(1).await;
    let mut raw = TcpStream::connect(t.listen_addr()).await.unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert!(closed_by_transport(&mut raw).await);

    let other = node(2).await;
    other.connect(NodeId(1), t.listen_addr()).await.unwrap();
    other
        .send(NodeId(1), OutMessage::new(b"ok", &[]))
        .await
        .unwrap();
    loop {
        if let Event::Message(m) = t.recv().await.unwrap() {
            assert_eq!(&m.meta[..], b"ok");
            break;
        }
    }
}

#[tokio::test]
async fn malformed_frame_loses_only_that_peer() {
    let t = node(1).await;
    let mut raw = raw_peer(&t, 9).await;
    raw.write_all(b"XX not a frame at all").await.unwrap();
    let (peer, reason) = next_loss(&t).await;
    assert_eq!(peer, NodeId(9));
    assert!(
        reason.contains("malformed frame") && reason.contains("magic"),
        "{reason}"
    );
    assert!(closed_by_transport(&mut raw).await);
}

#[tokio::test]
async fn oversize_lengths_are_refused_before_allocating() {
    let t = node(1).await;
    let mut raw = raw_peer(&t, 9).await;
    // One segment announced at 1 TiB: must be refused from the header alone.
    let mut header = Vec::new();
    header.extend_from_slice(b"PN");
    header.extend_from_slice(&[codec::VERSION, 0]);
    header.extend_from_slice(&1u16.to_le_bytes());
    header.extend_from_slice(&0u16.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&(1u64 << 40).to_le_bytes());
    raw.write_all(&header).await.unwrap();
    let (peer, reason) = next_loss(&t).await;
    assert_eq!(peer, NodeId(9));
    assert!(reason.contains("exceeds the limit"), "{reason}");
}

#[tokio::test]
async fn truncated_frame_is_a_loss_not_a_message() {
    let t = node(1).await;
    let mut raw = raw_peer(&t, 9).await;
    let payload = [7u8; 1000];
    let frame = codec::encode_frame(
        FrameKind::Data,
        &OutMessage::new(b"m", &[Segment::new(&payload)]),
        &Limits::default(),
    )
    .unwrap();
    raw.write_all(&frame[..frame.len() - 10]).await.unwrap();
    drop(raw);
    let (peer, reason) = next_loss(&t).await;
    assert_eq!(peer, NodeId(9));
    assert!(reason.contains("closed inside a frame"), "{reason}");
}

#[tokio::test]
async fn second_hello_after_handshake_is_a_protocol_error() {
    let t = node(1).await;
    let mut raw = raw_peer(&t, 9).await;
    let hello = codec::encode_frame(
        FrameKind::Hello,
        &OutMessage::new(&codec::encode_hello(NodeId(9), codec::DataPath::Tcp), &[]),
        &Limits::default(),
    )
    .unwrap();
    raw.write_all(&hello).await.unwrap();
    let (_, reason) = next_loss(&t).await;
    assert!(reason.contains("unexpected Hello"), "{reason}");
}

#[tokio::test]
async fn duplicate_node_id_is_refused() {
    let t = node(5).await;
    let twin = node(5).await;
    let err = twin
        .connect(NodeId(5), t.listen_addr())
        .await
        .expect_err("same id must be refused");
    assert!(err.to_string().contains("duplicate node id"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_send_closes_the_connection_cleanly() {
    // A receiver whose inbox holds 1 MiB stops reading once two messages wait, so a large
    // third send stalls part-way; dropping that send must not leave half a frame in the stream.
    let receiver = node_with(
        1,
        TcpConfig {
            inbox_bytes: 1 << 20,
            ..TcpConfig::default()
        },
    )
    .await;
    let sender = node(2).await;
    sender
        .connect(NodeId(1), receiver.listen_addr())
        .await
        .unwrap();
    let two_mib = vec![1u8; 2 << 20];
    for _ in 0..2 {
        sender
            .send(NodeId(1), OutMessage::new(b"", &[Segment::new(&two_mib)]))
            .await
            .unwrap();
    }
    let huge = vec![2u8; 256 << 20];
    let stalled = timeout(
        Duration::from_millis(500),
        sender.send(NodeId(1), OutMessage::new(b"", &[Segment::new(&huge)])),
    )
    .await;
    assert!(
        stalled.is_err(),
        "a 256 MiB send completed into a stalled receiver"
    );

    // The two whole messages arrive, then the loss; never a corrupt third message.
    let mut whole = 0;
    let (peer, _) = timeout(LIMIT, async {
        loop {
            match receiver.recv().await.unwrap() {
                Event::Message(m) => {
                    assert_eq!(m.segments[0].len(), 2 << 20, "corrupt message delivered");
                    whole += 1;
                }
                Event::PeerLost { peer, reason } => return (peer, reason),
                Event::PeerConnected { .. } => {}
            }
        }
    })
    .await
    .expect("loss reported");
    assert_eq!((peer, whole), (NodeId(2), 2));
    let err = sender
        .send(NodeId(1), OutMessage::new(b"after", &[]))
        .await
        .expect_err("the connection is gone");
    assert_eq!(err.peer(), Some(NodeId(1)));
}

/// A node whose data goes over RDMA (this transport being its control channel) and a node
/// on plain TCP refuse each other at the handshake, at once and naming both paths, whichever
/// side dials.
#[tokio::test]
async fn a_different_data_path_is_refused_at_once() {
    let tcp = node(1).await;
    let config = TcpConfig {
        data_path: DataPath::Rdma,
        connect_timeout: Duration::from_secs(20),
        ..TcpConfig::default()
    };
    let rdma = node_with(2, config).await;
    for (dialler, target, addr) in [
        (&rdma, NodeId(1), tcp.listen_addr()),
        (&tcp, NodeId(2), rdma.listen_addr()),
    ] {
        let started = std::time::Instant::now();
        let err = timeout(LIMIT, dialler.connect(target, addr))
            .await
            .expect("connect must not hang")
            .expect_err("mismatched data paths must be refused");
        let text = err.to_string();
        assert!(
            text.contains("over rdma") && text.contains("over tcp"),
            "{text}"
        );
        assert!(text.contains("PSNET_TRANSPORT"), "{text}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "refused only after {:?}",
            started.elapsed()
        );
    }
    assert!(tcp.connected_peers().is_empty());
    assert!(rdma.connected_peers().is_empty());
}

/// The first `part` bytes of a data frame carrying one segment of `len` bytes.
fn partial_frame(len: usize, part: usize) -> Vec<u8> {
    let body = vec![7u8; len];
    let mut frame = codec::encode_frame(
        FrameKind::Data,
        &OutMessage::new(b"m", &[Segment::new(&body)]),
        &Limits::default(),
    )
    .unwrap();
    frame.truncate(part);
    frame.to_vec()
}

#[tokio::test]
async fn unfinished_frames_hold_at_most_the_inflight_budget() {
    let config = TcpConfig {
        inflight_bytes: 4 << 20,
        inflight_wait: Duration::from_millis(300),
        ..TcpConfig::default()
    };
    let t = node_with(1, config).await;
    // Peer 9 starts a 3 MiB frame and stops: it holds 3 MiB of the 4 MiB budget.
    let mut stalled = raw_peer(&t, 9).await;
    stalled
        .write_all(&partial_frame(3 << 20, 1 << 20))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Peer 10's 3 MiB frame finds no room: it waits, then is closed naming the limit.
    let mut second = raw_peer(&t, 10).await;
    second.write_all(&partial_frame(3 << 20, 64)).await.unwrap();
    let (peer, reason) = next_loss(&t).await;
    assert_eq!(peer, NodeId(10));
    assert!(
        reason.contains("PSNET_RECV_INFLIGHT_BYTES=4194304"),
        "{reason}"
    );
    // A frame larger than the whole budget is refused at once.
    let mut huge = raw_peer(&t, 11).await;
    huge.write_all(&partial_frame(5 << 20, 64)).await.unwrap();
    let (peer, reason) = next_loss(&t).await;
    assert_eq!(peer, NodeId(11));
    assert!(
        reason.contains("exceeds PSNET_RECV_INFLIGHT_BYTES"),
        "{reason}"
    );
    // When the stalled peer goes, its share comes back: a full frame then gets through.
    drop(stalled);
    let (peer, _) = next_loss(&t).await;
    assert_eq!(peer, NodeId(9));
    let mut fine = raw_peer(&t, 12).await;
    fine.write_all(&partial_frame(3 << 20, usize::MAX))
        .await
        .unwrap();
    let got = timeout(LIMIT, async {
        loop {
            if let Event::Message(m) = t.recv().await.unwrap() {
                return m;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(got.peer, NodeId(12));
    assert_eq!(got.segments[0].len(), 3 << 20);
}

#[tokio::test]
async fn a_sender_refused_for_size_is_told_why() {
    let small = TcpConfig {
        limits: Limits {
            max_message: 1024,
            ..Limits::default()
        },
        shm_ring: 0,
        ..TcpConfig::default()
    };
    let receiver = node_with(1, small).await;
    let sender = node(2).await;
    sender
        .connect(NodeId(1), receiver.listen_addr())
        .await
        .unwrap();
    let big = vec![1u8; 10_000];
    let _ = sender
        .send(NodeId(1), OutMessage::new(b"", &[Segment::new(&big)]))
        .await;
    let (peer, reason) = next_loss(&receiver).await;
    assert_eq!(peer, NodeId(2));
    assert!(reason.contains("exceeds the limit"), "{reason}");
    let (peer, reason) = next_loss(&sender).await;
    assert_eq!(peer, NodeId(1));
    assert!(
        reason.contains("the peer closed the connection") && reason.contains("exceeds the limit"),
        "{reason}"
    );
}
