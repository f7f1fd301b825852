//! Opening a connection: with a job secret both sides first prove they know it
//! ([`psnet_transport::auth`]); then the dialler says who it is, the acceptor agrees or
//! refuses. With a secret the hello and its answer are sealed under the connection's session
//! keys ([`psnet_transport::session`]): the proofs of identity they carry never cross the wire
//! in clear.

use std::io;

use bytes::BytesMut;
use psnet_transport::auth::{self, Acceptor, Dialler, Secret};
use psnet_transport::codec::{self, DataPath, Frame, Hello};
use psnet_transport::session::{Opener, Role, Sealer, Session, SessionBase, TAG_LEN};
use psnet_transport::{Binding, FrameKind, Limits, NodeId, OutMessage, Proof};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Handshake frames are tiny; anything bigger is not a psnet peer.
const HANDSHAKE_LIMITS: Limits = Limits {
    max_meta: 1024,
    max_segments: 0,
    max_message: 1024,
};

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Reads exactly one handshake frame, starting with the bytes already read into `buf`. Bytes
/// after it (the peer's next frames) stay in the returned buffer.
pub(crate) async fn read_frame(
    stream: &mut TcpStream,
    mut buf: BytesMut,
) -> io::Result<(Frame, BytesMut)> {
    loop {
        match codec::decode_frame(&mut buf, &HANDSHAKE_LIMITS) {
            Ok(Some(frame)) => return Ok((frame, buf)),
            Ok(None) => {}
            Err(e) => return Err(invalid(e.to_string())),
        }
        if stream.read_buf(&mut buf).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection during the handshake",
            ));
        }
    }
}

fn encode(kind: FrameKind, meta: &[u8]) -> io::Result<Vec<u8>> {
    codec::encode_frame(kind, &OutMessage::new(meta, &[]), &HANDSHAKE_LIMITS)
        .map(|b| b.to_vec())
        .map_err(|e| invalid(e.to_string()))
}

pub(crate) async fn write_frame(
    stream: &mut TcpStream,
    kind: FrameKind,
    meta: &[u8],
) -> io::Result<()> {
    stream.write_all(&encode(kind, meta)?).await
}

/// Reads a sealed handshake frame's tag (right behind the frame) and opens the frame's body.
async fn read_sealed(
    stream: &mut TcpStream,
    frame: &Frame,
    mut buf: BytesMut,
    opener: &mut Opener,
    from: &str,
) -> io::Result<(Vec<u8>, BytesMut)> {
    while buf.len() < TAG_LEN {
        if stream.read_buf(&mut buf).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection during the handshake",
            ));
        }
    }
    let tag = buf.split_to(TAG_LEN);
    let plain = opener
        .open_handshake(frame.kind, &frame.meta, &tag)
        .map_err(|e| invalid(format!("the {from}'s {:?}: {e}", frame.kind)))?;
    Ok((plain, buf))
}

/// Session keys of an accepted connection: the base its later keys derive from, and the
/// sealer for its answer.
pub(crate) struct AcceptedSession {
    pub(crate) base: SessionBase,
    sealer: Sealer,
}

/// Writes the acceptor's `HelloAck`, sealed where the connection has a session.
pub(crate) async fn write_ack(
    stream: &mut TcpStream,
    ack: &[u8],
    session: Option<&mut AcceptedSession>,
) -> io::Result<()> {
    match session {
        None => write_frame(stream, FrameKind::HelloAck, ack).await,
        Some(s) => {
            let bytes = s
                .sealer
                .seal_handshake(FrameKind::HelloAck, ack)
                .map_err(|e| invalid(e.to_string()))?;
            stream.write_all(&bytes).await
        }
    }
}

/// A fresh buffer for the first handshake read.
fn fresh() -> BytesMut {
    BytesMut::with_capacity(4096)
}

/// The acceptor's answer to a hello.
pub(crate) enum Answer {
    /// Accepted by this node (its id, data path and proof of its id).
    Ack(Hello),
    /// Refused, with the acceptor's reason.
    Reject(String),
}

/// Dialler side: prove the secret (if the job has one), send our hello with the proof of our
/// id that `prove` makes for this connection's binding, read the answer. An acceptor that
/// fails the secret exchange is an [`Answer::Reject`] with the reason.
pub(crate) async fn dial(
    stream: &mut TcpStream,
    local: NodeId,
    path: DataPath,
    prove: impl Fn(&Binding) -> Option<Proof>,
    secret: Option<&Secret>,
) -> io::Result<(Answer, BytesMut, Option<SessionBase>)> {
    let hello_body = |session: Option<&SessionBase>| {
        let proof = prove(&Binding::new(session, Role::Dialler));
        codec::encode_hello_proved(local, path, proof.as_ref())
    };
    let mut buf = fresh();
    let mut session = None;
    match secret {
        None => {
            stream
                .write_all(&encode(FrameKind::Hello, &hello_body(None))?)
                .await?
        }
        Some(secret) => {
            let fresh = auth::Fresh::draw().map_err(|e| invalid(e.to_string()))?;
            let (dialler, opening) = Dialler::start(secret, fresh);
            write_frame(stream, FrameKind::AuthHello, &opening).await?;
            let (frame, rest) = read_frame(stream, buf).await?;
            buf = rest;
            match frame.kind {
                FrameKind::AuthChallenge => {}
                FrameKind::HelloReject => {
                    return Ok((
                        Answer::Reject(String::from_utf8_lossy(&frame.meta).into_owned()),
                        buf,
                        None,
                    ))
                }
                other => {
                    return Err(invalid(format!(
                        "expected the acceptor's authentication challenge, got {other:?}"
                    )))
                }
            }
            let (proof, base) = match dialler.handle_challenge(&frame.meta) {
                Ok(p) => p,
                Err(e) => {
                    // Tell the acceptor, so that its log names this address too.
                    let reason = e.to_string();
                    let _ = write_frame(stream, FrameKind::HelloReject, reason.as_bytes()).await;
                    return Ok((Answer::Reject(reason), buf, None));
                }
            };
            let (mut sealer, opener) = Session::opening(&base, Role::Dialler);
            // The hello rides right behind the proof, sealed: no extra round trip, and its
            // proof is not in clear.
            let mut both = encode(FrameKind::AuthProof, &proof)?;
            both.extend_from_slice(
                &sealer
                    .seal_handshake(FrameKind::Hello, &hello_body(Some(&base)))
                    .map_err(|e| invalid(e.to_string()))?,
            );
            stream.write_all(&both).await?;
            session = Some((base, opener));
        }
    }
    let (frame, mut rest) = read_frame(stream, buf).await?;
    let answer = match frame.kind {
        FrameKind::HelloAck => {
            let body = match session.as_mut() {
                None => frame.meta.to_vec(),
                Some((_, opener)) => {
                    let (plain, after) =
                        read_sealed(stream, &frame, rest, opener, "acceptor").await?;
                    rest = after;
                    plain
                }
            };
            Answer::Ack(codec::decode_hello(&body).map_err(|e| invalid(e.to_string()))?)
        }
        FrameKind::HelloReject => Answer::Reject(String::from_utf8_lossy(&frame.meta).into_owned()),
        other => return Err(invalid(format!("expected a hello answer, got {other:?}"))),
    };
    Ok((answer, rest, session.map(|(base, _)| base)))
}

/// How a connection opened, seen from the acceptor.
pub(crate) enum Opening {
    /// The dialler's hello (after it proved the secret, where the job has one), the bytes
    /// read past it, and the connection's session where the job has a secret.
    Hello(Box<Hello>, BytesMut, Option<AcceptedSession>),
    /// Refuse it with this reason (sent back and logged with the dialler's address).
    Refuse(String),
}

/// Acceptor side: check the dialler's proof of the secret (if this node has one), then read
/// its hello. Nothing of the hello is read before the proof checks out.
pub(crate) async fn accept_opening(
    stream: &mut TcpStream,
    secret: Option<&Secret>,
) -> io::Result<Opening> {
    let (frame, mut buf) = read_frame(stream, fresh()).await?;
    let mut session = None;
    let hello_body = match (frame.kind, secret) {
        (FrameKind::Hello, None) => frame.meta.to_vec(),
        (FrameKind::Hello, Some(_)) => return Ok(Opening::Refuse(auth::REFUSE_NO_PROOF.into())),
        (FrameKind::AuthHello, None) => {
            return Ok(Opening::Refuse(auth::REFUSE_UNEXPECTED_PROOF.into()))
        }
        (FrameKind::AuthHello, Some(secret)) => {
            let fresh = auth::Fresh::draw().map_err(|e| invalid(e.to_string()))?;
            let (acceptor, challenge) = match Acceptor::handle_hello(secret, &frame.meta, fresh) {
                Ok(a) => a,
                Err(e) => return Ok(Opening::Refuse(e.to_string())),
            };
            write_frame(stream, FrameKind::AuthChallenge, &challenge).await?;
            let (proof, rest) = read_frame(stream, buf).await?;
            if proof.kind == FrameKind::HelloReject {
                return Err(invalid(format!(
                    "the dialler refused this node: {}",
                    String::from_utf8_lossy(&proof.meta)
                )));
            }
            if proof.kind != FrameKind::AuthProof {
                return Err(invalid(format!(
                    "expected the dialler's authentication proof, got {:?}",
                    proof.kind
                )));
            }
            if let Err(e) = acceptor.handle_proof(&proof.meta) {
                return Ok(Opening::Refuse(e.to_string()));
            }
            let base = acceptor.session_base();
            let (sealer, mut opener) = Session::opening(&base, Role::Acceptor);
            let (hello, rest) = read_frame(stream, rest).await?;
            if hello.kind != FrameKind::Hello {
                return Err(invalid(format!("expected a hello, got {:?}", hello.kind)));
            }
            let (plain, rest) = read_sealed(stream, &hello, rest, &mut opener, "dialler").await?;
            buf = rest;
            session = Some(AcceptedSession { base, sealer });
            plain
        }
        (other, _) => return Err(invalid(format!("expected a hello, got {other:?}"))),
    };
    let hello = codec::decode_hello(&hello_body).map_err(|e| invalid(e.to_string()))?;
    Ok(Opening::Hello(Box::new(hello), buf, session))
}

/// Why two nodes whose data paths differ cannot talk.
pub(crate) fn path_mismatch(
    local: NodeId,
    ours: DataPath,
    peer: NodeId,
    theirs: DataPath,
) -> String {
    format!(
        "{local} moves data over {} but {peer} over {}: every node of a job must choose the \
         same transport (set PSNET_TRANSPORT, or DMLC_INTERFACE to interfaces that all have \
         an RDMA device or all have none)",
        ours.name(),
        theirs.name()
    )
}
