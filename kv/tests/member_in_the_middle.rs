//! A member of the job in the middle of a connection, on real sockets.
//!
//! It holds the job's secret, so it can run the opening exchange with each end: worker 0
//! dials it believing it is server 0, and it dials server 0 itself. It opens worker 0's
//! sealed hello with its own session's keys and forwards the hello, proof and all, to server 0
//! sealed under the other session. Server 0 must refuse it: what the member read is a proof
//! for its own connection with worker 0, not for the one it forwards it on.
//!
//! The control case runs the same relay against the old design, where a hello carried a bearer
//! token: server 0 lets the forwarded hello in. So the refusal comes from the proof's binding,
//! not from a relay that does not work.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_kv::proto::admission::JobAdmission;
use psnet_kv::proto::ids::{node_id, Role, SCHEDULER};
use psnet_kv::proto::msg::NodeInfo;
use psnet_transport::auth::{Acceptor, Dialler, Fresh, Secret};
use psnet_transport::codec::{self, Frame};
use psnet_transport::session::{Role as End, Session, TAG_LEN};
use psnet_transport::{
    Admission, Binding, FrameKind, Identity, Limits, NodeId, OutMessage, Proof, Refusal, Transport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(20);
const SECRET: &str = "the job's secret, which every member holds";

fn seed(id: NodeId) -> [u8; 32] {
    [id.0 as u8; 32]
}

fn table() -> Vec<NodeInfo> {
    let info = |id: NodeId, role, addr: &str| NodeInfo {
        id,
        role,
        rank: 0,
        addr: addr.parse().unwrap(),
        identity: Identity::from_seed(seed(id)).public(),
    };
    vec![
        info(SCHEDULER, Role::Scheduler, "127.0.0.1:1"),
        info(node_id(Role::Server, 0), Role::Server, "127.0.0.1:2"),
        info(node_id(Role::Worker, 0), Role::Worker, "127.0.0.1:3"),
    ]
}

/// The design before: a node proves its id with a token it shows as is, whatever the
/// connection.
struct BearerTokens;

impl Admission for BearerTokens {
    fn proof(&self, local: NodeId, _: &Binding) -> Option<Proof> {
        Some(Proof([local.0 as u8; 64]))
    }
    fn admit(&self, peer: NodeId, proof: Option<&Proof>, _: &Binding) -> Result<(), Refusal> {
        match proof {
            Some(p) if p.matches(&Proof([peer.0 as u8; 64])) => Ok(()),
            _ => Err(Refusal::WrongProof(format!("{peer} did not prove its id"))),
        }
    }
}

async fn node(id: NodeId, bearer: bool) -> TcpTransport {
    let config = TcpConfig {
        secret: Some(Secret::new(SECRET).unwrap()),
        connect_timeout: Duration::from_secs(3),
        shm_ring: 0,
        ..TcpConfig::default()
    };
    let t = TcpTransport::bind(id, config).await.expect("bind");
    if bearer {
        t.set_admission(Arc::new(BearerTokens));
    } else {
        let admission = JobAdmission::member(id, Identity::from_seed(seed(id)), &table());
        t.set_admission(Arc::new(admission));
    }
    t
}

async fn read_frame(s: &mut TcpStream, buf: &mut BytesMut) -> Frame {
    let limits = Limits::default();
    loop {
        if let Some(f) = codec::decode_frame(buf, &limits).expect("a frame") {
            return f;
        }
        let n = timeout(LIMIT, s.read_buf(buf))
            .await
            .expect("in time")
            .unwrap();
        assert!(n > 0, "closed during the handshake");
    }
}

async fn read_tag(s: &mut TcpStream, buf: &mut BytesMut) -> Vec<u8> {
    while buf.len() < TAG_LEN {
        let n = timeout(LIMIT, s.read_buf(buf))
            .await
            .expect("in time")
            .unwrap();
        assert!(n > 0, "closed before the tag");
    }
    buf.split_to(TAG_LEN).to_vec()
}

async fn write_frame(s: &mut TcpStream, kind: FrameKind, meta: &[u8]) {
    let bytes = codec::encode_frame(kind, &OutMessage::new(meta, &[]), &Limits::default()).unwrap();
    s.write_all(&bytes).await.unwrap();
}

/// Accepts one dial at `listener` as its acceptor and forwards its hello to `to` as the
/// dialler of a second connection; returns what `to` answered: its kind and (for a refusal)
/// its reason.
async fn member_in_the_middle(listener: TcpListener, to: SocketAddr) -> (FrameKind, String) {
    let secret = Secret::new(SECRET).unwrap();
    // With the victim: the member answers as the acceptor.
    let (mut victim, _) = listener.accept().await.unwrap();
    let mut vbuf = BytesMut::new();
    let opening = read_frame(&mut victim, &mut vbuf).await;
    assert_eq!(opening.kind, FrameKind::AuthHello);
    let (acceptor, challenge) =
        Acceptor::handle_hello(&secret, &opening.meta, Fresh::draw().unwrap()).unwrap();
    write_frame(&mut victim, FrameKind::AuthChallenge, &challenge).await;
    let proof = read_frame(&mut victim, &mut vbuf).await;
    acceptor
        .handle_proof(&proof.meta)
        .expect("the victim knows the secret");
    let (_, mut from_victim) = Session::opening(&acceptor.session_base(), End::Acceptor);
    let hello = read_frame(&mut victim, &mut vbuf).await;
    let tag = read_tag(&mut victim, &mut vbuf).await;
    let plain = from_victim
        .open_handshake(hello.kind, &hello.meta, &tag)
        .expect("the member holds this session's keys");
    let claimed = codec::decode_hello(&plain).unwrap();
    assert!(claimed.proof.is_some(), "the victim's hello proves its id");
    // With the target: the member dials, and forwards the hello it read.
    let mut target = TcpStream::connect(to).await.unwrap();
    let (dialler, opening) = Dialler::start(&secret, Fresh::draw().unwrap());
    write_frame(&mut target, FrameKind::AuthHello, &opening).await;
    let mut tbuf = BytesMut::new();
    let challenge = read_frame(&mut target, &mut tbuf).await;
    let (proof, base) = dialler.handle_challenge(&challenge.meta).unwrap();
    let (mut to_target, _) = Session::opening(&base, End::Dialler);
    write_frame(&mut target, FrameKind::AuthProof, &proof).await;
    let sealed = to_target.seal_handshake(FrameKind::Hello, &plain).unwrap();
    target.write_all(&sealed).await.unwrap();
    let answer = read_frame(&mut target, &mut tbuf).await;
    let reason = match answer.kind {
        FrameKind::HelloReject => String::from_utf8_lossy(&answer.meta).into_owned(),
        _ => String::new(),
    };
    (answer.kind, reason)
}

async fn relay_worker_to_server(bearer: bool) -> (FrameKind, String) {
    let (server, worker) = (node_id(Role::Server, 0), node_id(Role::Worker, 0));
    let real_server = node(server, bearer).await;
    let victim = node(worker, bearer).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let middle = listener.local_addr().unwrap();
    let relay = tokio::spawn(member_in_the_middle(listener, real_server.listen_addr()));
    // The victim dials "server 0" at the member's address; the member never answers it, so
    // this dial fails or times out: only the server's answer to the member matters.
    let _ = timeout(LIMIT, victim.connect(server, middle)).await;
    let answer = timeout(LIMIT, relay)
        .await
        .expect("the relay ends")
        .unwrap();
    victim.shutdown();
    real_server.shutdown();
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_in_the_middle_cannot_forward_a_workers_hello_to_a_server() {
    let (kind, reason) = relay_worker_to_server(false).await;
    assert_eq!(
        kind,
        FrameKind::HelloReject,
        "the forwarded hello was let in"
    );
    assert!(reason.contains("made for another connection"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_bearer_tokens_the_same_relay_is_let_in() {
    let (kind, reason) = relay_worker_to_server(true).await;
    assert_eq!(kind, FrameKind::HelloAck, "refused: {reason}");
}
