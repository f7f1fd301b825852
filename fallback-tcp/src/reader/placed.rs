//! Data frames with a segment placed in device memory as it arrives, off the socket.

use std::io;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use psnet_transport::codec::FrameHeader;
use psnet_transport::device::DevicePath;
use psnet_transport::placement::{self, stream_from_source, ChunkSource};
use psnet_transport::session::FrameMac;
use psnet_transport::{Incoming, Placed, Placer};
use smallvec::SmallVec;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;

use super::{check_tag, end_of, fill, within, Inflight, ReadEnd, LARGE_BODY};
use crate::conn::Conn;
use crate::inbox::Inbox;

/// Reads a data frame's metadata and asks `placer` whether a segment goes into device
/// memory; if so, reads the frame with that segment streamed there (chunk k copied to the
/// device while chunk k+1 is read off the socket) and returns the message. `Ok(None)`: the
/// frame is left in host memory, its metadata read into `buf`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn read_placed(
    read: &mut OwnedReadHalf,
    buf: &mut BytesMut,
    header: &FrameHeader,
    placer: &dyn Placer,
    conn: &Conn,
    inbox: &Inbox,
    inflight: &Inflight,
    mac: &mut Option<FrameMac>,
) -> Result<Option<Incoming>, ReadEnd> {
    let meta_len = header.meta_len as usize;
    fill(read, buf, meta_len, inflight.stall)
        .await
        .map_err(end_of)?;
    // A sealed frame's metadata is read in a decrypted copy: if the frame is not placed,
    // the whole body is opened as any other frame's.
    let plain_meta = mac
        .as_ref()
        .filter(|m| m.is_sealed())
        .map(|m| m.peek(&buf[..meta_len]));
    let Some(placement) = placer
        .place(
            conn.peer,
            plain_meta.as_deref().unwrap_or(&buf[..meta_len]),
            &header.seg_lens,
        )
        .filter(|p| placement::fits(p, &header.seg_lens))
    else {
        return Ok(None);
    };
    if let Some(mac) = mac.as_mut() {
        mac.open(&mut buf[..meta_len]);
    }
    let meta = buf.split_to(meta_len).freeze();
    // The other segments land in host memory, bounded as any large body is.
    let host_len = header
        .seg_lens
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != placement.segment)
        .fold(0u64, |acc, (_, &len)| acc.saturating_add(len));
    let host_len = usize::try_from(host_len).unwrap_or(usize::MAX);
    let _room = if host_len >= LARGE_BODY {
        Some(inflight.reserve(host_len).await.map_err(ReadEnd::Refused)?)
    } else {
        None
    };
    let mut segments = SmallVec::with_capacity(header.seg_lens.len());
    let mut placed = None;
    for (i, &len) in header.seg_lens.iter().enumerate() {
        // Within the frame's checked bound.
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if i != placement.segment {
            fill(read, buf, len, inflight.stall).await.map_err(end_of)?;
            if let Some(mac) = mac.as_mut() {
                mac.open(&mut buf[..len]);
            }
            segments.push(buf.split_to(len).freeze());
            continue;
        }
        let dest = &*placement.dest;
        inbox
            .placing
            .note(conn.peer, dest.ordinal(), DevicePath::Staged);
        let mut source = SocketSource {
            read,
            buf,
            stall: inflight.stall,
            mac: mac.as_mut(),
        };
        let result = stream_from_source(dest, len, inbox.placing.chunk(), &mut source)
            .await
            .map_err(|e| ReadEnd::Failed(e.to_string()))?;
        if let Err(e) = &result {
            tracing::warn!(peer = %conn.peer, error = %e, "placing a received segment in device memory failed");
        }
        segments.push(Bytes::new());
        placed = Some(Placed {
            segment: i,
            len: len as u64,
            result,
        });
    }
    // Delivered only once the whole frame checks out; bytes already placed in device
    // memory belong to a message that never arrives.
    check_tag(read, buf, mac.take(), conn, inflight.stall).await?;
    Ok(Some(Incoming {
        peer: conn.peer,
        meta,
        segments,
        placed,
    }))
}

/// The socket, with the bytes already read into the connection's buffer first.
struct SocketSource<'r> {
    read: &'r mut OwnedReadHalf,
    buf: &'r mut BytesMut,
    /// How long the frame may go without a byte.
    stall: Duration,
    /// The frame's tag so far, with a job secret.
    mac: Option<&'r mut FrameMac>,
}

impl ChunkSource for SocketSource<'_> {
    async fn read<'b>(&'b mut self, out: &'b mut [u8]) -> io::Result<()> {
        let have = self.buf.len().min(out.len());
        out[..have].copy_from_slice(&self.buf[..have]);
        self.buf.advance(have);
        let (mut at, len) = (have, out.len());
        while at < len {
            let n = within(self.stall, self.read.read(&mut out[at..]), at, len).await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a frame",
                ));
            }
            at += n;
        }
        if let Some(mac) = self.mac.as_mut() {
            mac.open(out);
        }
        Ok(())
    }
}
