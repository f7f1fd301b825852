//! A peer that stops in the middle of a large frame: before, it held that frame's share of the
//! in-flight budget (`PSNET_RECV_INFLIGHT_BYTES`) for as long as its connection lived, so that
//! two such frames pinned about 2 GiB of a server and starved every other sender. Now the
//! frame must bring a byte every `frame_stall`; then its connection is closed naming the stall
//! and the room goes back to the others.

use std::time::Duration;

use bytes::BytesMut;
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::codec::{self, DataPath, FrameKind};
use psnet_transport::{Event, Limits, NodeId, OutMessage, Segment, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(30);
const BIG: usize = 48 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_stalled_midway_gives_its_room_back_and_names_the_stall() {
    let config = || TcpConfig {
        inflight_bytes: 64 << 20,
        inflight_wait: LIMIT,
        frame_stall: Duration::from_secs(1),
        shm_ring: 0,
        ..TcpConfig::default()
    };
    let b = TcpTransport::bind(NodeId(2), config()).await.unwrap();
    let a = TcpTransport::bind(NodeId(1), config()).await.unwrap();

    // A raw peer says hello as node 9, then starts a 48 MiB frame and stops sending.
    let mut raw = TcpStream::connect(b.listen_addr()).await.unwrap();
    let hello = codec::encode_hello_proved(NodeId(9), DataPath::Tcp, None);
    let frame = |kind, meta: &[u8], segs: &[Segment<'_>]| {
        codec::encode_frame(kind, &OutMessage::new(meta, segs), &Limits::default()).unwrap()
    };
    raw.write_all(&frame(FrameKind::Hello, &hello, &[]))
        .await
        .unwrap();
    let payload = vec![1u8; BIG];
    let whole = frame(FrameKind::Data, b"stalled", &[Segment::new(&payload)]);
    raw.write_all(&whole[..4096]).await.unwrap();

    // Node 1's 48 MiB message needs room the stalled frame holds.
    timeout(LIMIT, a.connect(b.local_id(), b.listen_addr()))
        .await
        .unwrap()
        .unwrap();
    let sent = tokio::spawn(async move {
        let payload = vec![7u8; BIG];
        a.send(
            NodeId(2),
            OutMessage::new(b"mine", &[Segment::new(&payload)]),
        )
        .await
        .map(|_| a)
    });
    let mut stalled_reason = None;
    let got = loop {
        match timeout(LIMIT, b.recv()).await.expect("no hang").unwrap() {
            Event::Message(m) => break m,
            Event::PeerLost {
                peer: NodeId(9),
                reason,
            } => stalled_reason = Some(reason),
            _ => {}
        }
    };
    assert_eq!(got.peer, NodeId(1));
    assert_eq!(&got.meta[..], b"mine");
    assert_eq!(got.segments[0].len(), BIG);
    let _a = sent.await.unwrap().expect("the send completes");
    let reason = match stalled_reason {
        Some(r) => r,
        None => loop {
            if let Event::PeerLost { peer, reason } =
                timeout(LIMIT, b.recv()).await.unwrap().unwrap()
            {
                if peer == NodeId(9) {
                    break reason;
                }
            }
        },
    };
    assert!(reason.contains("stalled inside a frame"), "{reason}");
    // The stalled peer is told why, then its connection ends.
    let mut told = BytesMut::new();
    let _ = timeout(LIMIT, async {
        while raw
            .read_buf(&mut told)
            .await
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
    })
    .await;
    assert!(
        String::from_utf8_lossy(&told).contains("stalled inside a frame"),
        "the Close frame names the stall"
    );
}
