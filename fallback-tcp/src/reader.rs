//! The task that reads one connection's frames and queues them for `recv`.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use psnet_transport::codec::FrameHeader;
use psnet_transport::session::{FrameMac, Opener, TAG_LEN};
use psnet_transport::{FrameKind, Incoming, Limits};
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;

use crate::buffers::LargeBuffers;
use crate::conn::Conn;
use crate::inbox::Inbox;
use crate::queued::{QueueEnd, QueueLink};
use crate::shm::queue::RecvQueue;
use crate::shm::{self, RecvRing};

mod placed;

use placed::read_placed;

/// Reads are at least this large, so small messages cost about one syscall per batch.
const MIN_READ: usize = 64 << 10;
/// Bodies at least this large are read into buffers of their own, reused once the application
/// drops the message: fresh large allocations cost a page fault per 4 KiB, which on loopback
/// costs more than the copy itself. Medium bodies too: read into the connection's rolling
/// buffer while earlier messages still share it, each made it allocate afresh (a 4-rank ring
/// allreduce of 256 KiB, 64 KiB messages, took twice as long).
const LARGE_BODY: usize = 32 << 10;
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
/// Once the peer's same-host queue is mapped, its messages are delivered too, and everything
/// it held is delivered before the end is reported.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn read_loop(
    read: OwnedReadHalf,
    buf: BytesMut,
    conn: Arc<Conn>,
    inbox: &Arc<Inbox>,
    limits: Limits,
    inflight: &Inflight,
    spin: Duration,
    opener: Option<Opener>,
) -> ReadEnd {
    let mut link = QueueLink::default();
    let end = read_frames(
        read,
        buf,
        conn.clone(),
        inbox,
        limits,
        inflight,
        spin,
        &mut link,
        opener,
    )
    .await;
    // Whether this side closed the connection (`disconnect`, a refusal, a failed write)
    // before the socket ended; a socket that failed under the peer (cut inside a frame by
    // its shutdown, reset) is the peer's end.
    let closed_here = conn.is_broken();
    if link.is_started() {
        match &end {
            ReadEnd::Refused(why) => conn.close_with_notice(why).await,
            ReadEnd::Failed(_) => conn.close(),
            ReadEnd::Closed | ReadEnd::Shutdown => {}
        }
    }
    // What the peer sent before it closed is delivered, as TCP delivers what came before
    // its FIN, also when its last frame was cut short (the queue's records before that frame
    // were complete sends); a connection this side closed or refused takes nothing more, as a
    // socket shut down here reads nothing more.
    let queue_end = if closed_here || matches!(end, ReadEnd::Refused(_)) {
        link.stop()
    } else {
        link.finish().await
    };
    match queue_end {
        Some(QueueEnd::Refused(why)) => ReadEnd::Refused(why),
        Some(QueueEnd::Failed(why)) => ReadEnd::Failed(why),
        _ => end,
    }
}

#[allow(clippy::too_many_arguments)]
async fn read_frames(
    mut read: OwnedReadHalf,
    mut buf: BytesMut,
    conn: Arc<Conn>,
    inbox: &Arc<Inbox>,
    limits: Limits,
    inflight: &Inflight,
    spin: Duration,
    link: &mut QueueLink,
    mut opener: Option<Opener>,
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
        if header.sealed && opener.is_none() {
            return ReadEnd::Refused(
                "a sealed (encrypted) frame on a connection without a session: only a node \
                 holding the job's secret seals its frames"
                    .into(),
            );
        }
        let mut mac = opener.as_mut().map(|o| o.frame(header.sealed));
        if let Some(mac) = mac.as_mut() {
            mac.update(&buf[..header_len]);
        }
        buf.advance(header_len);
        let is_data = matches!(header.kind, FrameKind::Data | FrameKind::ShmData);
        if is_data && link.is_started() && !link.wait_wanted().await {
            return ReadEnd::Shutdown;
        }
        // The header was checked against the limits, so this allocation is bounded.
        let body_len = usize::try_from(header.body_len()).unwrap_or(usize::MAX);
        if header.kind == FrameKind::Data {
            if let Some(placer) = inbox.placing.placer() {
                let placed = read_placed(
                    &mut read, &mut buf, &header, &*placer, &conn, inbox, inflight, &mut mac,
                )
                .await;
                match placed {
                    Ok(Some(msg)) => {
                        if !deliver(msg, body_len, link, inbox).await {
                            return ReadEnd::Shutdown;
                        }
                        continue;
                    }
                    // Left in host memory: read as any other frame (the metadata is in `buf`).
                    Ok(None) => {}
                    Err(end) => return end,
                }
            }
        }
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
            if let Err(e) = fill_exact(&mut read, &mut big, body_len, have, inflight.stall).await {
                return end_of(e);
            }
            if let Some(mac) = mac.as_mut() {
                mac.open(&mut big[..]);
            }
            let body = big.split().freeze();
            large.give_back(big, size);
            body
        } else {
            if let Err(e) = fill(&mut read, &mut buf, body_len, inflight.stall).await {
                return end_of(e);
            }
            if let Some(mac) = mac.as_mut() {
                mac.open(&mut buf[..body_len]);
            }
            buf.split_to(body_len).freeze()
        };
        if let Err(end) = check_tag(&mut read, &mut buf, mac, &conn, inflight.stall).await {
            return end;
        }
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
                        let r = Arc::new(r);
                        // Before the answer: the queue's ring records follow the acceptance.
                        let _ = link.ring.set(r.clone());
                        ring = Some(r);
                        conn.control.push(FrameKind::ShmAccept, Vec::new());
                    }
                    Err(e) => {
                        note_declined(&conn, "ring", &e);
                        conn.control
                            .push(FrameKind::ShmReject, e.to_string().into_bytes())
                    }
                }
                continue;
            }
            FrameKind::QueueOffer => {
                match RecvQueue::fetch(&frame.meta).await {
                    Ok(queue) if !link.is_started() => {
                        conn.set_releases(queue.releases());
                        link.start(queue, conn.clone(), inbox.clone(), limits, spin);
                        conn.control.push(FrameKind::QueueAccept, Vec::new());
                    }
                    Ok(_) => conn
                        .control
                        .push(FrameKind::QueueReject, b"a second queue".to_vec()),
                    Err(e) => {
                        note_declined(&conn, "queue", &e);
                        conn.control
                            .push(FrameKind::QueueReject, e.to_string().into_bytes())
                    }
                }
                continue;
            }
            FrameKind::QueueAccept | FrameKind::QueueReject => {
                conn.queue_answer(frame.kind == FrameKind::QueueAccept);
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
        let mut msg = Incoming {
            peer: conn.peer,
            meta: frame.meta,
            segments,
            placed: None,
        };
        if frame.kind == FrameKind::ShmData {
            msg = inbox.placing.place_now(msg).await;
        }
        if !deliver(msg, body_len, link, inbox).await {
            return ReadEnd::Shutdown;
        }
    }
}

/// Logs a declined same-host offer: at debug level where the peer is on another host (the
/// offer's socket is not here, every cross-host connection sees it), as a warning where the
/// offer itself is wrong (malformed, a wrong size or cookie, a file not sealed): a bug or a
/// peer probing this node.
fn note_declined(conn: &Conn, what: &str, e: &io::Error) {
    if matches!(
        e.kind(),
        io::ErrorKind::InvalidData | io::ErrorKind::PermissionDenied | io::ErrorKind::InvalidInput
    ) {
        tracing::warn!(peer = %conn.peer, error = %e, "refused a same-host {what} offer");
    } else {
        tracing::debug!(peer = %conn.peer, error = %e, "declined a same-host {what} offer");
    }
}

/// Hands a message on: in the order the same-host queue's markers give once it started,
/// else to the inbox. False once the transport is shutting down.
async fn deliver(msg: Incoming, body_len: usize, link: &mut QueueLink, inbox: &Arc<Inbox>) -> bool {
    tracing::trace!(peer = %msg.peer, bytes = body_len, "received message");
    if link.is_started() {
        link.forward(msg)
    } else {
        if !inbox.push_message(msg).await {
            return false;
        }
        link.direct += 1;
        true
    }
}

/// With a job secret, reads the frame's tag and checks it: a frame changed, dropped, replayed
/// or reordered on the path ends the connection, naming the peer.
async fn check_tag(
    read: &mut OwnedReadHalf,
    buf: &mut BytesMut,
    mac: Option<FrameMac>,
    conn: &Conn,
    stall: Duration,
) -> Result<(), ReadEnd> {
    let Some(mac) = mac else {
        return Ok(());
    };
    fill(read, buf, TAG_LEN, stall).await.map_err(end_of)?;
    let checked = mac.check(&buf[..TAG_LEN]);
    buf.advance(TAG_LEN);
    checked.map_err(|e| {
        tracing::error!(peer = %conn.peer, seq = e.seq, "a frame fails its session tag");
        ReadEnd::Refused(format!("from {}: {e}", conn.peer))
    })
}

/// The budget of bytes that large frames still being received may hold, shared by every
/// connection of a transport.
pub(crate) struct Inflight {
    /// In KiB, so that any frame's share fits a semaphore's `u32` request.
    room: tokio::sync::Semaphore,
    total: usize,
    wait: std::time::Duration,
    /// How long a frame being read may go without a byte before its connection is closed
    /// and its room given back (`PSNET_FRAME_STALL_TIMEOUT`).
    pub(crate) stall: Duration,
}

impl Inflight {
    pub(crate) fn new(total: usize, wait: std::time::Duration, stall: Duration) -> Self {
        let kib = (total / 1024).min(tokio::sync::Semaphore::MAX_PERMITS);
        Inflight {
            room: tokio::sync::Semaphore::new(kib),
            total,
            wait,
            stall,
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
    stall: Duration,
) -> io::Result<()> {
    let mut limited = read.take((len - have) as u64);
    while big.len() < len {
        let at = big.len();
        if within(stall, limited.read_buf(big), at, len).await? == 0 {
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
async fn fill(
    read: &mut OwnedReadHalf,
    buf: &mut BytesMut,
    len: usize,
    stall: Duration,
) -> io::Result<()> {
    if buf.len() < len {
        buf.reserve(len - buf.len());
    }
    while buf.len() < len {
        let at = buf.len();
        if within(stall, read.read_buf(buf), at, len).await? == 0 {
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

/// One read inside a frame, which must bring a byte within `stall`: a peer that stops in the
/// middle of a frame would otherwise hold its share of the in-flight budget (and the
/// connection) for as long as the job runs.
async fn within(
    stall: Duration,
    read: impl std::future::Future<Output = io::Result<usize>>,
    at: usize,
    len: usize,
) -> io::Result<usize> {
    match tokio::time::timeout(stall, read).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the peer stalled inside a frame: no byte for {stall:?} after {at} of {len} \
                 bytes (PSNET_FRAME_STALL_TIMEOUT)"
            ),
        )),
    }
}

/// How a read inside a frame ended the connection: a stall breaks the rules (the peer is
/// told), anything else is a failure.
fn end_of(e: io::Error) -> ReadEnd {
    if e.kind() == io::ErrorKind::TimedOut {
        ReadEnd::Refused(e.to_string())
    } else {
        ReadEnd::Failed(e.to_string())
    }
}
