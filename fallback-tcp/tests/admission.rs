//! Admission on real sockets: with a policy installed, a hello must prove the id it claims.
//! A forged claim of a live peer's id is refused and the live connection goes on untouched;
//! an id the policy does not know is refused; a proven claim is let in.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::codec::{self, DataPath, FrameKind};
use psnet_transport::{
    Admission, Binding, Event, Limits, NodeId, OutMessage, Proof, Refusal, Transport, PROOF_LEN,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(30);

/// Node n's token is n repeated.
struct Table(HashMap<NodeId, Proof>);

fn token(n: u8) -> Proof {
    Proof([n; PROOF_LEN])
}

impl Admission for Table {
    fn proof(&self, local: NodeId, _: &Binding) -> Option<Proof> {
        self.0.get(&local).copied()
    }

    fn admit(&self, peer: NodeId, proof: Option<&Proof>, _: &Binding) -> Result<(), Refusal> {
        match (self.0.get(&peer), proof) {
            (None, _) => Err(Refusal::NotMember(format!("{peer} is unknown"))),
            (Some(t), Some(p)) if t.matches(p) => Ok(()),
            _ => Err(Refusal::WrongProof(format!("{peer} did not prove its id"))),
        }
    }
}

async fn node(id: u8) -> TcpTransport {
    let t = TcpTransport::bind(NodeId(id as u64), TcpConfig::default())
        .await
        .expect("bind");
    let table = Table((1..=3).map(|n| (NodeId(n as u64), token(n))).collect());
    t.set_admission(Arc::new(table));
    t
}

/// Sends a hello as `id` (with `proof`) and returns the answer's kind and body.
async fn hello(t: &TcpTransport, id: u64, proof: Option<&Proof>) -> (FrameKind, Vec<u8>) {
    let mut s = TcpStream::connect(t.listen_addr()).await.unwrap();
    let body = codec::encode_hello_proved(NodeId(id), DataPath::Tcp, proof);
    let frame = codec::encode_frame(
        FrameKind::Hello,
        &OutMessage::new(&body, &[]),
        &Limits::default(),
    )
    .unwrap();
    s.write_all(&frame).await.unwrap();
    let mut buf = BytesMut::new();
    loop {
        if let Some(f) = codec::decode_frame(&mut buf, &Limits::default()).unwrap() {
            return (f.kind, f.meta.to_vec());
        }
        let n = timeout(LIMIT, s.read_buf(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "closed without an answer");
    }
}

async fn next_event(t: &TcpTransport) -> Event {
    timeout(LIMIT, t.recv())
        .await
        .expect("event")
        .expect("open")
}

#[tokio::test]
async fn a_forged_claim_of_a_live_id_is_refused_and_the_live_connection_stays() {
    let one = node(1).await;
    let two = node(2).await;
    two.connect(NodeId(1), one.listen_addr()).await.unwrap();
    assert!(
        matches!(next_event(&one).await, Event::PeerConnected { peer, .. } if peer == NodeId(2))
    );

    // Without a proof, with a wrong one, under an unknown id: all refused with the reason.
    let (kind, reason) = hello(&one, 2, None).await;
    assert_eq!(kind, FrameKind::HelloReject);
    assert!(String::from_utf8_lossy(&reason).contains("did not prove"));
    let (kind, _) = hello(&one, 2, Some(&token(3))).await;
    assert_eq!(kind, FrameKind::HelloReject);
    let (kind, reason) = hello(&one, 9, Some(&token(9))).await;
    assert_eq!(kind, FrameKind::HelloReject);
    assert!(String::from_utf8_lossy(&reason).contains("unknown"));

    // The live connection was not touched: a message still arrives, and no loss is seen.
    two.send(NodeId(1), OutMessage::new(b"still here", &[]))
        .await
        .unwrap();
    match next_event(&one).await {
        Event::Message(m) => {
            assert_eq!(m.peer, NodeId(2));
            assert_eq!(&m.meta[..], b"still here");
        }
        other => panic!("expected the message, got {other:?}"),
    }
    assert_eq!(one.connected_peers(), vec![NodeId(2)]);
}

#[tokio::test]
async fn a_proven_claim_is_let_in_and_the_answer_carries_the_acceptor_proof() {
    let one = node(1).await;
    let (kind, body) = hello(&one, 3, Some(&token(3))).await;
    assert_eq!(kind, FrameKind::HelloAck);
    let ack = codec::decode_hello(&body).unwrap();
    assert_eq!(ack.id, NodeId(1));
    assert_eq!(ack.proof, Some(token(1)));
}

#[tokio::test]
async fn a_dialler_refuses_an_acceptor_that_cannot_prove_its_id() {
    let one = node(1).await;
    // Node 2 without a policy answers without a proof: node 1 must not take the link.
    let bare = TcpTransport::bind(NodeId(2), TcpConfig::default())
        .await
        .unwrap();
    let err = one
        .connect(NodeId(2), bare.listen_addr())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("did not prove"), "{err}");
    assert!(one.connected_peers().is_empty());
}
