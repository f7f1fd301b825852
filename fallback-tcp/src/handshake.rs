//! Opening a connection: the dialler says who it is, the acceptor agrees or refuses.

use std::io;

use bytes::BytesMut;
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

/// Reads exactly one handshake frame. Bytes after it (the peer's first data frames) stay in
/// the returned buffer for the connection's reader.
pub(crate) async fn read_frame(stream: &mut TcpStream) -> io::Result<(Frame, BytesMut)> {
    let mut buf = BytesMut::with_capacity(4096);
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

pub(crate) async fn write_frame(
    stream: &mut TcpStream,
    kind: FrameKind,
    meta: &[u8],
) -> io::Result<()> {
    let bytes = codec::encode_frame(kind, &OutMessage::new(meta, &[]), &HANDSHAKE_LIMITS)
        .map_err(|e| invalid(e.to_string()))?;
    stream.write_all(&bytes).await
}

/// The acceptor's answer to a hello.
pub(crate) enum Answer {
    /// Accepted by this node (its id, data path and proof of its id).
    Ack(Hello),
    /// Refused, with the acceptor's reason.
    Reject(String),
}

/// Dialler side: send our hello, read the answer.
pub(crate) async fn dial(
    stream: &mut TcpStream,
    local: NodeId,
    path: DataPath,
    proof: Option<&Proof>,
) -> io::Result<(Answer, BytesMut)> {
    let hello = codec::encode_hello_proved(local, path, proof);
    write_frame(stream, FrameKind::Hello, &hello).await?;
    let (frame, rest) = read_frame(stream).await?;
    let answer = match frame.kind {
        FrameKind::HelloAck => {
            Answer::Ack(codec::decode_hello(&frame.meta).map_err(|e| invalid(e.to_string()))?)
        }
        FrameKind::HelloReject => Answer::Reject(String::from_utf8_lossy(&frame.meta).into_owned()),
        other => return Err(invalid(format!("expected a hello answer, got {other:?}"))),
    };
    Ok((answer, rest))
}

/// Acceptor side: read the dialler's hello.
pub(crate) async fn read_hello(stream: &mut TcpStream) -> io::Result<(Hello, BytesMut)> {
    let (frame, rest) = read_frame(stream).await?;
    if frame.kind != FrameKind::Hello {
        return Err(invalid(format!("expected a hello, got {:?}", frame.kind)));
    }
    let hello = codec::decode_hello(&frame.meta).map_err(|e| invalid(e.to_string()))?;
    Ok((hello, rest))
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
