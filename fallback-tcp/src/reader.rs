//! The task that reads one connection's frames and queues them for `recv`.

use std::io;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use psnet_transport::codec::FrameHeader;
use psnet_transport::{FrameKind, Incoming, Limits};
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;

use crate::conn::Conn;
use crate::inbox::Inbox;

/// Reads are at least this large, so small messages cost about one syscall per batch.
const MIN_READ: usize = 64 << 10;

/// Why a connection's reader stopped.
pub(crate) enum ReadEnd {
    /// The peer closed the connection between frames.
    Closed,
    /// I/O error, truncated or malformed frame.
    Failed(String),
    /// The inbox is closed: this transport is shutting down.
    Shutdown,
}

/// Reads frames until the connection ends. `buf` holds bytes already read by the handshake.
pub(crate) async fn read_loop(
    mut read: OwnedReadHalf,
    mut buf: BytesMut,
    conn: Arc<Conn>,
    inbox: &Inbox,
    limits: Limits,
) -> ReadEnd {
    loop {
        let (header, header_len) = loop {
            match FrameHeader::decode(&buf, &limits) {
                Ok(Some(h)) => break h,
                Ok(None) => {}
                Err(e) => return ReadEnd::Failed(format!("malformed frame: {e}")),
            }
            if buf.capacity() - buf.len() < MIN_READ / 16 {
                buf.reserve(MIN_READ);
            }
            match read.read_buf(&mut buf).await {
                Ok(0) if buf.is_empty() => return ReadEnd::Closed,
                Ok(0) => return ReadEnd::Failed("connection closed inside a frame header".into()),
                Ok(_) => {}
                Err(e) => return ReadEnd::Failed(e.to_string()),
            }
        };
        if header.kind != FrameKind::Data {
            return ReadEnd::Failed(format!(
                "unexpected {:?} frame after the handshake",
                header.kind
            ));
        }
        buf.advance(header_len);
        // The header was checked against the limits, so this allocation is bounded.
        let body_len = usize::try_from(header.body_len()).unwrap_or(usize::MAX);
        if let Err(e) = fill(&mut read, &mut buf, body_len).await {
            return ReadEnd::Failed(e.to_string());
        }
        let frame = header.split_body(buf.split_to(body_len).freeze());
        let msg = Incoming {
            peer: conn.peer,
            meta: frame.meta,
            segments: frame.segments,
        };
        tracing::trace!(peer = %conn.peer, bytes = body_len, "received message");
        if !inbox.push_message(msg).await {
            return ReadEnd::Shutdown;
        }
    }
}

/// Reads until `buf` holds at least `len` bytes. Reserving exactly the missing part lets the
/// buffer reclaim its own allocation when the application has dropped earlier messages.
async fn fill(read: &mut OwnedReadHalf, buf: &mut BytesMut, len: usize) -> io::Result<()> {
    if buf.len() < len {
        buf.reserve(len - buf.len());
    }
    while buf.len() < len {
        if read.read_buf(buf).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "connection closed inside a frame ({} of {len} bytes)",
                    buf.len()
                ),
            ));
        }
    }
    Ok(())
}
