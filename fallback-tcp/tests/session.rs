//! A process on the network path, between two real nodes: it relays the connection and
//! changes one byte of a message, and it reads everything that passes. Without a job secret
//! the change goes through (the job is open, and says so); with one, the frame fails its
//! session tag, the connection ends naming the peer, the message is never delivered, and
//! the tokens of the hellos are not in what the relay read. With `PSNET_ENCRYPT` too, the
//! relay reads nothing of the message either, and an unchanged message arrives intact.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::auth::Secret;
use psnet_transport::{
    Admission, Binding, Event, NodeId, OutMessage, Proof, Refusal, Segment, Transport, PROOF_LEN,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(30);
const PAYLOAD: usize = 200_000;
/// What the message's segment repeats: easy to look for in what the relay saw.
const PATTERN: &[u8] = b"weights of layer 7 ";

/// Every node proves its id with a token of its id's byte repeated: easy to look for in
/// what the relay saw.
struct KnownTokens;

fn token(id: NodeId) -> Proof {
    Proof([0xA0 | id.0 as u8; PROOF_LEN])
}

impl Admission for KnownTokens {
    fn proof(&self, local: NodeId, _: &Binding) -> Option<Proof> {
        Some(token(local))
    }
    fn admit(&self, peer: NodeId, proof: Option<&Proof>, _: &Binding) -> Result<(), Refusal> {
        match proof {
            Some(p) if p.matches(&token(peer)) => Ok(()),
            _ => Err(Refusal::WrongProof(format!("{peer} did not prove its id"))),
        }
    }
}

async fn node(id: u64, secret: Option<&str>, encrypt: bool) -> TcpTransport {
    let config = TcpConfig {
        secret: secret.map(|s| Secret::new(s).unwrap()),
        encrypt,
        connect_timeout: Duration::from_secs(5),
        // The relay sits between two processes of this host: keep every byte on the socket
        // (the shared-memory paths have no network path to be on).
        shm_ring: 0,
        ..TcpConfig::default()
    };
    let t = TcpTransport::bind(NodeId(id), config).await.expect("bind");
    t.set_admission(Arc::new(KnownTokens));
    t
}

/// Relays one connection to `to`, flipping the byte at `flip_at` of the dialler's stream,
/// and records both directions.
async fn relay(
    to: std::net::SocketAddr,
    flip_at: usize,
) -> (std::net::SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        let Ok((inbound, _)) = listener.accept().await else {
            return;
        };
        let outbound = TcpStream::connect(to).await.unwrap();
        let (mut in_r, mut in_w) = inbound.into_split();
        let (mut out_r, mut out_w) = outbound.into_split();
        let up_record = record.clone();
        let up = tokio::spawn(async move {
            let mut passed = 0usize;
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match in_r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if (passed..passed + n).contains(&flip_at) {
                    buf[flip_at - passed] ^= 0x01;
                }
                passed += n;
                up_record.lock().unwrap().extend_from_slice(&buf[..n]);
                if out_w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = out_w.shutdown().await;
        });
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match out_r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            record.lock().unwrap().extend_from_slice(&buf[..n]);
            if in_w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = in_w.shutdown().await;
        let _ = up.await;
    });
    (addr, seen)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn payload() -> Vec<u8> {
    PATTERN.iter().copied().cycle().take(PAYLOAD).collect()
}

/// Node 1 (encrypting if `encrypt`) sends node 2 one message through the relay, which flips
/// the byte at `flip_at` of the stream (`None`: changes nothing); returns what node 2
/// received (`Ok`: the message, `Err`: why its connection ended) and what the relay saw.
async fn through_the_relay(
    secret: Option<&str>,
    encrypt: bool,
    flip_at: Option<usize>,
) -> (Result<Vec<u8>, String>, Vec<u8>) {
    through_the_relay_as(secret, encrypt, flip_at, false).await
}

/// [`through_the_relay`], the message marked confidential or not.
async fn through_the_relay_as(
    secret: Option<&str>,
    encrypt: bool,
    flip_at: Option<usize>,
    confidential: bool,
) -> (Result<Vec<u8>, String>, Vec<u8>) {
    let a = node(1, secret, encrypt).await;
    let b = node(2, secret, false).await;
    let (addr, seen) = relay(b.listen_addr(), flip_at.unwrap_or(usize::MAX)).await;
    timeout(LIMIT, a.connect(b.local_id(), addr))
        .await
        .unwrap()
        .expect("connect through the relay");
    let payload = payload();
    let segments = [Segment::new(&payload)];
    let mut msg = OutMessage::new(b"metadata of key 7", &segments);
    if confidential {
        msg = msg.confidential();
    }
    a.send(b.local_id(), msg).await.unwrap();
    let got = loop {
        match timeout(LIMIT, b.recv())
            .await
            .expect("no hang")
            .expect("an event")
        {
            Event::Message(m) => {
                assert_eq!(&m.meta[..], b"metadata of key 7");
                break Ok(m.segments[0].to_vec());
            }
            Event::PeerLost { peer, reason } => {
                assert_eq!(peer, a.local_id());
                break Err(reason);
            }
            Event::PeerConnected { .. } => {}
        }
    };
    let seen = seen.lock().unwrap().clone();
    (got, seen)
}

#[tokio::test]
async fn without_a_secret_the_path_can_change_a_message_and_read_the_tokens() {
    let (got, seen) = through_the_relay(None, false, Some(100_000)).await;
    let got = got.expect("delivered");
    assert_ne!(got, payload(), "the open job takes the changed message");
    assert!(
        contains(&seen, &token(NodeId(1)).0),
        "tokens cross in clear"
    );
}

#[tokio::test]
async fn with_a_secret_a_changed_frame_ends_the_connection_and_is_never_delivered() {
    let (got, seen) = through_the_relay(Some("the job's secret"), false, Some(100_000)).await;
    let reason = got.expect_err("the changed message is refused, not delivered");
    assert!(reason.contains("fails its session tag"), "{reason}");
    assert!(
        reason.contains("node 1") || reason.contains(&NodeId(1).to_string()),
        "{reason}"
    );
    assert!(
        !contains(&seen, &token(NodeId(1)).0) && !contains(&seen, &token(NodeId(2)).0),
        "no token crosses in clear once the session has keys"
    );
    // Tagged, not encrypted: the path reads the message.
    assert!(contains(&seen, PATTERN));
}

#[tokio::test]
async fn with_encryption_the_path_reads_nothing_and_the_message_arrives_intact() {
    let (got, seen) = through_the_relay(Some("the job's secret"), true, None).await;
    assert_eq!(got.expect("delivered"), payload());
    assert!(seen.len() > PAYLOAD, "the message went through the relay");
    assert!(!contains(&seen, PATTERN), "the segment crossed in clear");
    assert!(
        !contains(&seen, b"metadata of key"),
        "the metadata crossed in clear"
    );
    assert!(!contains(&seen, &token(NodeId(1)).0));
}

#[tokio::test]
async fn with_encryption_a_changed_frame_still_ends_the_connection() {
    let (got, _) = through_the_relay(Some("the job's secret"), true, Some(100_000)).await;
    let reason = got.expect_err("the changed message is refused, not delivered");
    assert!(reason.contains("fails its session tag"), "{reason}");
}

#[tokio::test]
async fn with_a_secret_a_confidential_message_is_sealed_without_psnet_encrypt() {
    let (got, seen) = through_the_relay_as(Some("the job's secret"), false, None, true).await;
    assert_eq!(got.expect("delivered"), payload());
    assert!(seen.len() > PAYLOAD, "the message went through the relay");
    assert!(
        !contains(&seen, PATTERN),
        "the confidential segment crossed in clear"
    );
    assert!(
        !contains(&seen, b"metadata of key"),
        "its metadata crossed in clear"
    );
    // Changed on the path, it is refused like any other frame.
    let (got, _) = through_the_relay_as(Some("the job's secret"), false, Some(100_000), true).await;
    let reason = got.expect_err("the changed message is refused, not delivered");
    assert!(reason.contains("fails its session tag"), "{reason}");
}

#[tokio::test]
async fn without_a_secret_a_confidential_message_goes_in_clear_as_everything_does() {
    let (got, seen) = through_the_relay_as(None, false, None, true).await;
    assert_eq!(got.expect("delivered"), payload());
    assert!(
        contains(&seen, PATTERN),
        "an open job has no key to seal it with"
    );
}
