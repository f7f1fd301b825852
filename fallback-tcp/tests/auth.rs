//! The job's shared secret on real sockets: nodes that share it connect and exchange
//! messages; a node with another secret, with none, or with one where the job has none is
//! refused with a reason on both sides, and a raw intruder gets nothing past the challenge.

use std::time::Duration;

use bytes::BytesMut;
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::auth::{Secret, AUTH_VERSION, CHALLENGE_LEN, HELLO_LEN};
use psnet_transport::codec::{self, DataPath, FrameKind};
use psnet_transport::{Event, Limits, NodeId, OutMessage, Segment, Transport, TransportError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(30);

async fn node(id: u64, secret: Option<&str>) -> TcpTransport {
    let config = TcpConfig {
        secret: secret.map(|s| Secret::new(s).unwrap()),
        connect_timeout: Duration::from_secs(5),
        ..TcpConfig::default()
    };
    TcpTransport::bind(NodeId(id), config).await.expect("bind")
}

async fn refused(dialler: &TcpTransport, acceptor: &TcpTransport) -> String {
    let err = timeout(
        LIMIT,
        dialler.connect(acceptor.local_id(), acceptor.listen_addr()),
    )
    .await
    .expect("an answer, not a hang")
    .expect_err("refused");
    match err {
        TransportError::Handshake { reason, .. } => reason,
        other => panic!("expected a handshake refusal, got {other}"),
    }
}

async fn frame(kind: FrameKind, meta: &[u8]) -> Vec<u8> {
    codec::encode_frame(kind, &OutMessage::new(meta, &[]), &Limits::default())
        .unwrap()
        .to_vec()
}

/// Reads one frame, or `None` if the acceptor closes first.
async fn read_answer(s: &mut TcpStream, buf: &mut BytesMut) -> Option<(FrameKind, Vec<u8>)> {
    loop {
        if let Some(f) = codec::decode_frame(buf, &Limits::default()).unwrap() {
            return Some((f.kind, f.meta.to_vec()));
        }
        match timeout(LIMIT, s.read_buf(buf)).await.expect("no hang") {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

#[tokio::test]
async fn nodes_sharing_the_secret_connect_and_exchange_messages() {
    let a = node(1, Some("the job's secret")).await;
    let b = node(2, Some("the job's secret")).await;
    timeout(LIMIT, a.connect(b.local_id(), b.listen_addr()))
        .await
        .unwrap()
        .expect("connect");
    let big = vec![7u8; 100_000];
    a.send(
        b.local_id(),
        OutMessage::new(b"meta", &[Segment::new(&big)]),
    )
    .await
    .unwrap();
    loop {
        match timeout(LIMIT, b.recv()).await.unwrap().unwrap() {
            Event::Message(m) => {
                assert_eq!(m.peer, a.local_id());
                assert_eq!(&m.meta[..], b"meta");
                assert_eq!(m.segments.len(), 1);
                assert!(m.segments[0].iter().all(|&x| x == 7));
                break;
            }
            Event::PeerConnected { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    // And the other way, over the same connection.
    b.send(a.local_id(), OutMessage::new(b"back", &[]))
        .await
        .unwrap();
    loop {
        if let Event::Message(m) = timeout(LIMIT, a.recv()).await.unwrap().unwrap() {
            assert_eq!(&m.meta[..], b"back");
            break;
        }
    }
}

#[tokio::test]
async fn a_different_secret_is_refused_on_both_sides() {
    let a = node(1, Some("secret one")).await;
    let b = node(2, Some("secret two")).await;
    let reason = refused(&a, &b).await;
    assert!(
        reason.contains("does not know this job's secret"),
        "{reason}"
    );
    assert!(b.connected_peers().is_empty());
    assert!(a.connected_peers().is_empty());
}

#[tokio::test]
async fn no_secret_against_a_secret_and_a_secret_against_none_are_refused_with_the_reason() {
    let guarded = node(1, Some("s3cret")).await;
    let open = node(2, None).await;
    let reason = refused(&open, &guarded).await;
    assert!(reason.contains("requires its shared secret"), "{reason}");
    let reason = refused(&guarded, &open).await;
    assert!(reason.contains("this node has none"), "{reason}");
    assert!(guarded.connected_peers().is_empty() && open.connected_peers().is_empty());
}

#[tokio::test]
async fn a_raw_intruder_gets_no_further_than_the_challenge() {
    let guarded = node(1, Some("s3cret")).await;
    let addr = guarded.listen_addr();

    // A plain hello, as psnet without a secret (or an older psnet) sends it.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let hello = codec::encode_hello_proved(NodeId(9), DataPath::Tcp, None);
    s.write_all(&frame(FrameKind::Hello, &hello).await)
        .await
        .unwrap();
    let (kind, why) = read_answer(&mut s, &mut BytesMut::new()).await.unwrap();
    assert_eq!(kind, FrameKind::HelloReject);
    assert!(String::from_utf8_lossy(&why).contains("presented none"));

    // The exchange begun honestly, then a guessed proof with a hello right behind it.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut opening = [0u8; HELLO_LEN];
    opening[0] = AUTH_VERSION;
    // X25519's base point as the public key: a key of full order, as an honest one is.
    opening[HELLO_LEN - 32] = 9;
    s.write_all(&frame(FrameKind::AuthHello, &opening).await)
        .await
        .unwrap();
    let mut buf = BytesMut::new();
    let (kind, challenge) = read_answer(&mut s, &mut buf).await.unwrap();
    assert_eq!(kind, FrameKind::AuthChallenge);
    assert_eq!(challenge.len(), CHALLENGE_LEN);
    let mut forged = frame(FrameKind::AuthProof, &challenge[CHALLENGE_LEN - 32..]).await;
    forged.extend(frame(FrameKind::Hello, &hello).await);
    s.write_all(&forged).await.unwrap();
    let (kind, why) = read_answer(&mut s, &mut buf).await.unwrap();
    assert_eq!(kind, FrameKind::HelloReject);
    assert!(String::from_utf8_lossy(&why).contains("does not know this job's secret"));

    // A malformed opening: wrong version, wrong length.
    for bad in [vec![AUTH_VERSION + 1; HELLO_LEN], vec![AUTH_VERSION; 3]] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&frame(FrameKind::AuthHello, &bad).await)
            .await
            .unwrap();
        let (kind, why) = read_answer(&mut s, &mut BytesMut::new()).await.unwrap();
        assert_eq!(kind, FrameKind::HelloReject);
        assert!(String::from_utf8_lossy(&why).contains("malformed"));
    }
    assert!(guarded.connected_peers().is_empty());

    // The guarded node still takes an honest peer afterwards.
    let honest = node(2, Some("s3cret")).await;
    timeout(LIMIT, honest.connect(NodeId(1), addr))
        .await
        .unwrap()
        .expect("honest peer connects");
}
