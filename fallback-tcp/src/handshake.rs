//! Opening a connection: with a job secret both sides first prove they know it
//! ([`psnet_transport::auth`]); then the dialler says who it is, the acceptor agrees or
//! refuses.

use std::io;

use bytes::BytesMut;
use psnet_transport::auth::{self, Acceptor, Dialler, Secret};
use psnet_transport::codec::{self, DataPath, Frame, Hello};
use psnet_transport::{FrameKind, Limits, NodeId, OutMessage, Proof};
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

/// Dialler side: prove the secret (if the job has one), send our hello, read the answer. An
/// acceptor that fails the secret exchange is an [`Answer::Reject`] with the reason.
pub(crate) async fn dial(
    stream: &mut TcpStream,
    local: NodeId,
    path: DataPath,
    proof: Option<&Proof>,
    secret: Option<&Secret>,
) -> io::Result<(Answer, BytesMut)> {
    let hello = encode(
        FrameKind::Hello,
        &codec::encode_hello_proved(local, path, proof),
    )?;
    let mut buf = fresh();
    match secret {
        None => stream.write_all(&hello).await?,
        Some(secret) => {
            let nonce = auth::fresh_nonce().map_err(|e| invalid(e.to_string()))?;
            let (dialler, opening) = Dialler::start(secret, nonce);
            write_frame(stream, FrameKind::AuthHello, &opening).await?;
            let (frame, rest) = read_frame(stream, buf).await?;
            buf = rest;
            match frame.kind {
                FrameKind::AuthChallenge => {}
                FrameKind::HelloReject => {
                    return Ok((
                        Answer::Reject(String::from_utf8_lossy(&frame.meta).into_owned()),
                        buf,
                    ))
                }
                other => {
                    return Err(invalid(format!(
                        "expected the acceptor's authentication challenge, got {other:?}"
                    )))
                }
            }
            let proof = match dialler.handle_challenge(&frame.meta) {
                Ok(p) => p,
                Err(e) => {
                    // Tell the acceptor, so that its log names this address too.
                    let reason = e.to_string();
                    let _ = write_frame(stream, FrameKind::HelloReject, reason.as_bytes()).await;
                    return Ok((Answer::Reject(reason), buf));
                }
            };
            // The hello rides right behind the proof: no extra round trip.
            let mut both = encode(FrameKind::AuthProof, &proof)?;
            both.extend_from_slice(&hello);
            stream.write_all(&both).await?;
        }
    }
    let (frame, rest) = read_frame(stream, buf).await?;
    let answer = match frame.kind {
        FrameKind::HelloAck => {
            Answer::Ack(codec::decode_hello(&frame.meta).map_err(|e| invalid(e.to_string()))?)
        }
        FrameKind::HelloReject => Answer::Reject(String::from_utf8_lossy(&frame.meta).into_owned()),
        other => return Err(invalid(format!("expected a hello answer, got {other:?}"))),
    };
    Ok((answer, rest))
}

/// How a connection opened, seen from the acceptor.
pub(crate) enum Opening {
    /// The dialler's hello (after it proved the secret, where the job has one), and the bytes
    /// read past it.
    Hello(Hello, BytesMut),
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
    let hello_frame = match (frame.kind, secret) {
        (FrameKind::Hello, None) => frame,
        (FrameKind::Hello, Some(_)) => return Ok(Opening::Refuse(auth::REFUSE_NO_PROOF.into())),
        (FrameKind::AuthHello, None) => {
            return Ok(Opening::Refuse(auth::REFUSE_UNEXPECTED_PROOF.into()))
        }
        (FrameKind::AuthHello, Some(secret)) => {
            let nonce = auth::fresh_nonce().map_err(|e| invalid(e.to_string()))?;
            let (acceptor, challenge) = match Acceptor::handle_hello(secret, &frame.meta, nonce) {
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
            let (hello, rest) = read_frame(stream, rest).await?;
            buf = rest;
            hello
        }
        (other, _) => return Err(invalid(format!("expected a hello, got {other:?}"))),
    };
    if hello_frame.kind != FrameKind::Hello {
        return Err(invalid(format!(
            "expected a hello, got {:?}",
            hello_frame.kind
        )));
    }
    let hello = codec::decode_hello(&hello_frame.meta).map_err(|e| invalid(e.to_string()))?;
    Ok(Opening::Hello(hello, buf))
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
