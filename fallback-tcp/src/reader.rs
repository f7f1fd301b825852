//! The task that reads one connection's frames and queues them for `recv`.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use psnet_transport::codec::FrameHeader;
use psnet_transport::{FrameKind, Incoming, Limits};
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;

use crate::conn::Conn;
use crate::inbox::Inbox;
use crate::shm::{self, RecvRing};

/// Reads are at least this large, so small messages cost about one syscall per batch.
const MIN_READ: usize = 64 << 10;
/// Bodies at least this large are read into buffers of their own, reused once the application
/// drops the message: fresh large allocations cost a page fault per 4 KiB, which on loopback
/// costs more than the copy itself. Medium bodies too: read into the connection's rolling
/// buffer while earlier messages still share it, each made it allocate afresh (a 4-rank ring
/// allreduce of 256 KiB, 64 KiB messages, took twice as long).
const LARGE_BODY: usize = 32 << 10;
/// Large buffers kept per connection, at most. A collective sends a buffer as many messages
/// at once (a 16 MiB allreduce on 2 ranks: 16 of 1 MiB, all received before the first is
/// applied); with only 4 kept, most came from fresh allocations (135,000 page faults in a
/// 2-rank 1-16 MiB sweep, 34,000 with 32 kept; 16 MiB busbw 1.38-1.57 GB/s before,
/// 1.62-2.08 after).
const LARGE_POOL: usize = 32;
/// Bytes of buffers kept per connection, at most: a node with many peers holds at most this
/// much per peer for reuse.
const LARGE_POOL_BYTES: usize = 32 << 20;

/// Recycled buffers for large bodies. Each entry owns an allocation that a delivered message
/// may still share; it is reused only when that message is gone.
#[derive(Default)]
struct LargeBuffers {
    /// Each buffer with the size of its allocation (what is left after a message was split
    /// off says nothing of it).
    pool: VecDeque<(BytesMut, usize)>,
    /// The allocations' sizes in `pool`, added up.
    bytes: usize,
}

impl LargeBuffers {
    /// An empty buffer with room for `len` bytes, and the size of its allocation.
    fn take(&mut self, len: usize) -> (BytesMut, usize) {
        match self.pool.iter_mut().position(|(b, _)| b.try_reclaim(len)) {
            Some(i) => {
                let (buf, size) = self.pool.remove(i).expect("index from position");
                self.bytes -= size;
                (buf, size)
            }
            None => (BytesMut::with_capacity(len), len),
        }
    }

    /// Keeps `buf` (whose contents were split off), an allocation of `size` bytes, for
    /// reuse, dropping the oldest buffers beyond the pool's bounds.
    fn give_back(&mut self, buf: BytesMut, size: usize) {
        self.bytes += size;
        self.pool.push_back((buf, size));
        while self.pool.len() > LARGE_POOL || self.bytes > LARGE_POOL_BYTES {
            match self.pool.pop_front() {
                Some((_, old)) => self.bytes -= old,
                None => break,
            }
        }
    }
}

/// Why a connection's reader stopped.
pub(crate) enum ReadEnd {
    /// The peer closed the connection between frames.
    Closed,
    /// I/O error or truncated frame, or the peer said why it closed.
    Failed(String),
    /// What the peer sent breaks the rules (malformed, over the limits): it is told why.
    Refused(String),
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
    inflight: &Inflight,
) -> ReadEnd {
    let mut large = LargeBuffers::default();
    // The peer's shared-memory ring, once it offered one.
    let mut ring: Option<Arc<RecvRing>> = None;
    loop {
        let (header, header_len) = loop {
            match FrameHeader::decode(&buf, &limits) {
                Ok(Some(h)) => break h,
                Ok(None) => {}
                Err(e) => return ReadEnd::Refused(format!("malformed frame: {e}")),
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
        buf.advance(header_len);
        // The header was checked against the limits, so this allocation is bounded.
        let body_len = usize::try_from(header.body_len()).unwrap_or(usize::MAX);
        let body = if body_len >= LARGE_BODY && buf.len() < body_len {
            // Room for the whole frame before allocating for it: a peer that stops mid-frame
            // holds at most its share of the budget, never the process's memory.
            let _room = match inflight.reserve(body_len).await {
                Ok(room) => room,
                Err(why) => return ReadEnd::Refused(why),
            };
            let (mut big, size) = large.take(body_len);
            let have = buf.len();
            big.extend_from_slice(&buf);
            buf.clear();
            if let Err(e) = fill_exact(&mut read, &mut big, body_len, have).await {
                return ReadEnd::Failed(e.to_string());
            }
            let body = big.split().freeze();
            large.give_back(big, size);
            body
        } else {
            if let Err(e) = fill(&mut read, &mut buf, body_len).await {
                return ReadEnd::Failed(e.to_string());
            }
            buf.split_to(body_len).freeze()
        };
        let frame = header.split_body(body);
        let segments = match frame.kind {
            FrameKind::Data => frame.segments,
            FrameKind::ShmData => {
                let Some(ring) = ring.as_ref() else {
                    return ReadEnd::Refused(
                        "shared-memory message before a ring was offered".into(),
                    );
                };
                let Some(descriptor) = frame.segments.first() else {
                    return ReadEnd::Refused("shared-memory message without a descriptor".into());
                };
                match ring.segments(descriptor, &conn.control, &limits) {
                    Ok(segments) => segments,
                    Err(e) => return ReadEnd::Refused(e),
                }
            }
            FrameKind::ShmOffer => {
                match RecvRing::fetch(&frame.meta).await {
                    Ok(r) => {
                        ring = Some(Arc::new(r));
                        conn.control.push(FrameKind::ShmAccept, Vec::new());
                    }
                    Err(e) => conn
                        .control
                        .push(FrameKind::ShmReject, e.to_string().into_bytes()),
                }
                continue;
            }
            FrameKind::ShmAccept | FrameKind::ShmReject => {
                conn.ring_answer(frame.kind == FrameKind::ShmAccept);
                continue;
            }
            FrameKind::ShmFree => {
                match shm::parse_free(&frame.meta) {
                    Some(regions) if conn.ring_free(&regions) => {}
                    _ => return ReadEnd::Refused("bad shared-memory release".into()),
                }
                continue;
            }
            FrameKind::Close => {
                return ReadEnd::Failed(format!(
                    "the peer closed the connection: {}",
                    String::from_utf8_lossy(&frame.meta)
                ))
            }
            FrameKind::Hello
            | FrameKind::HelloAck
            | FrameKind::HelloReject
            | FrameKind::AuthHello
            | FrameKind::AuthChallenge
            | FrameKind::AuthProof => {
                return ReadEnd::Refused(format!(
                    "unexpected {:?} frame after the handshake",
                    frame.kind
                ))
            }
        };
        let msg = Incoming {
            peer: conn.peer,
            meta: frame.meta,
            segments,
        };
        tracing::trace!(peer = %conn.peer, bytes = body_len, "received message");
        if !inbox.push_message(msg).await {
            return ReadEnd::Shutdown;
        }
    }
}

/// The budget of bytes that large frames still being received may hold, shared by every
/// connection of a transport.
pub(crate) struct Inflight {
    /// In KiB, so that any frame's share fits a semaphore's `u32` request.
    room: tokio::sync::Semaphore,
    total: usize,
    wait: std::time::Duration,
}

impl Inflight {
    pub(crate) fn new(total: usize, wait: std::time::Duration) -> Self {
        let kib = (total / 1024).min(tokio::sync::Semaphore::MAX_PERMITS);
        Inflight {
            room: tokio::sync::Semaphore::new(kib),
            total,
            wait,
        }
    }

    /// Waits for room for a frame of `len` bytes; the room is given back when the returned
    /// permit drops (the frame is complete and counted by the inbox from then on).
    async fn reserve(&self, len: usize) -> Result<tokio::sync::SemaphorePermit<'_>, String> {
        let kib = len.div_ceil(1024);
        let limit = || {
            format!(
                "PSNET_RECV_INFLIGHT_BYTES={} (bytes of unfinished incoming frames, all \
                 connections together)",
                self.total
            )
        };
        let Ok(kib32) = u32::try_from(kib) else {
            return Err(format!("a frame of {len} bytes exceeds {}", limit()));
        };
        if kib * 1024 > self.total {
            return Err(format!("a frame of {len} bytes exceeds {}", limit()));
        }
        match tokio::time::timeout(self.wait, self.room.acquire_many(kib32)).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err("the transport is shutting down".into()),
            Err(_) => Err(format!(
                "no room for a frame of {len} bytes within {:?}: other connections hold \
                 {}",
                self.wait,
                limit()
            )),
        }
    }
}

/// Reads exactly up to `len` bytes into `big` (which holds `have` already), never past the
/// frame: what follows belongs to the next frame and the connection's main buffer.
async fn fill_exact(
    read: &mut OwnedReadHalf,
    big: &mut BytesMut,
    len: usize,
    have: usize,
) -> io::Result<()> {
    let mut limited = read.take((len - have) as u64);
    while big.len() < len {
        if limited.read_buf(big).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "connection closed inside a frame ({} of {len} bytes)",
                    big.len()
                ),
            ));
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A body read into a pooled buffer, split off and dropped, as the reader does.
    fn cycle(pool: &mut LargeBuffers, len: usize) -> *const u8 {
        let (mut big, size) = pool.take(len);
        big.resize(len, 7);
        let body = big.split().freeze();
        let at = body.as_ptr();
        pool.give_back(big, size);
        drop(body);
        at
    }

    #[test]
    fn a_buffer_whose_message_is_gone_is_reused() {
        let mut pool = LargeBuffers::default();
        let first = cycle(&mut pool, 1 << 20);
        assert_eq!(cycle(&mut pool, 1 << 20), first);
        assert_eq!(
            cycle(&mut pool, 512 << 10),
            first,
            "a smaller body fits too"
        );
        assert_eq!(pool.pool.len(), 1);
        assert_eq!(pool.bytes, 1 << 20);
    }

    #[test]
    fn the_pool_keeps_at_most_its_count_and_its_bytes() {
        let mut pool = LargeBuffers::default();
        // Messages still held: every take allocates afresh.
        let mut held = Vec::new();
        for _ in 0..LARGE_POOL + 8 {
            let (mut big, size) = pool.take(64 << 10);
            big.resize(64 << 10, 1);
            held.push(big.split().freeze());
            pool.give_back(big, size);
            assert!(pool.pool.len() <= LARGE_POOL);
        }
        assert_eq!(pool.pool.len(), LARGE_POOL);
        for _ in 0..8 {
            let (mut big, size) = pool.take(8 << 20);
            big.resize(8 << 20, 1);
            held.push(big.split().freeze());
            pool.give_back(big, size);
            assert!(pool.bytes <= LARGE_POOL_BYTES, "{} bytes kept", pool.bytes);
        }
        let kept: usize = pool.pool.iter().map(|(_, size)| size).sum();
        assert_eq!(kept, pool.bytes);
    }
}
