//! Sending one application message on a connection: through the same-host queue once the
//! peer mapped it, otherwise (and for what the queue cannot carry) through the socket.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use psnet_transport::codec::{FrameHeader, HeaderBuf};
use psnet_transport::device::StreamError;
use psnet_transport::{FrameKind, Limits, OutMessage, Segment};
use smallvec::SmallVec;

use crate::conn::{Conn, Writer};
use crate::shm::queue::{inline_header, Kind, QueueError, SendQueue};
use crate::shm::{QUEUED_RING_MIN, SHM_MIN};

/// How long a sender whose queue is full polls before it sleeps between polls.
const FULL_SPIN: Duration = Duration::from_micros(200);
/// How long it sleeps between polls after that.
const FULL_NAP: Duration = Duration::from_millis(1);

/// The way a message left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// Copied whole into the queue.
    Inline,
    /// In the ring, described by a queue record or a `ShmData` frame.
    Ring,
    /// Through the socket.
    Socket,
}

impl Conn {
    /// Sends one message. `ring` is the message's ring descriptor when its segments were
    /// already put in the ring; `chunk` is the staging chunk for device segments.
    pub(crate) async fn send_message(
        &self,
        msg: &OutMessage<'_>,
        limits: &Limits,
        ring: Option<Vec<u8>>,
        chunk: usize,
    ) -> Result<Path, StreamError> {
        let mut writer = self.writer.lock().await;
        if self.is_broken() {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "connection closed").into());
        }
        self.start_queue(&mut writer).await?;
        let queue = writer.queue.clone();
        if let Some(queue) = &queue {
            if let Some(descriptor) = &ring {
                let meta_len = (msg.meta.len() as u32).to_le_bytes();
                if 4 + msg.meta.len() + descriptor.len() <= queue.max_payload() {
                    self.push_waiting(queue, Kind::Ring, &[&meta_len, msg.meta, descriptor])
                        .await?;
                    return Ok(Path::Ring);
                }
            }
            if self.try_inline(queue, msg)? {
                return Ok(Path::Inline);
            }
        }
        let mut head = HeaderBuf::new();
        let (kind, descriptor);
        let out = match &ring {
            Some(d) => {
                descriptor = [Segment::new(d)];
                kind = FrameKind::ShmData;
                OutMessage::new(msg.meta, &descriptor)
            }
            None => {
                kind = FrameKind::Data;
                OutMessage::new(msg.meta, msg.segments)
            }
        };
        let mut header = FrameHeader::for_message(kind, &out, limits)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // PSNET_ENCRYPT: data frames on the socket are sealed (the same-host ring's are not:
        // no network path); so is a message that carries a secret, whatever the setting.
        header.sealed = kind == FrameKind::Data
            && writer
                .sealer
                .as_ref()
                .is_some_and(|s| s.encrypts() || msg.confidential);
        header.encode_into(&mut head);
        let marker = async || match &queue {
            Some(q) => self.push_waiting(q, Kind::Socket, &[]).await,
            None => Ok(()),
        };
        if out.has_device() {
            // The frame's first write follows the marker with no wait between (the staged
            // writer marks the frame started before it awaits).
            self.write_frame_staged(&mut writer, &head, out.meta, out.segments, chunk, marker)
                .await?;
        } else {
            marker().await?;
            // Once the marker is published the frame must follow: a send dropped before its
            // first byte left would leave the marker to claim the next frame.
            let mut unfinished = CloseUnlessFinished {
                conn: self,
                finished: false,
            };
            self.write_frame_locked(&mut writer, &head, out.meta, out.segments)
                .await?;
            unfinished.finished = true;
        }
        writer.socket_data += 1;
        Ok(if ring.is_some() {
            Path::Ring
        } else {
            Path::Socket
        })
    }

    /// Writes the queue's first record once the peer has mapped it: how many data frames the
    /// socket carried before it, so that the receiver delivers those first.
    async fn start_queue(&self, writer: &mut Writer) -> io::Result<()> {
        if writer.queue.is_none() {
            if let Some(queue) = self.active_queue() {
                let before = writer.socket_data.to_le_bytes();
                self.push_waiting(&queue, Kind::Start, &[&before]).await?;
                writer.queue = Some(queue);
            }
        }
        Ok(())
    }

    /// Copies a small host message into the queue whole; false if it is not small, holds
    /// device memory, or the queue has no room beyond what markers and descriptors keep.
    fn try_inline(&self, queue: &SendQueue, msg: &OutMessage<'_>) -> io::Result<bool> {
        let host: Option<SmallVec<[&[u8]; 4]>> = msg.segments.iter().map(Segment::host).collect();
        let Some(host) = host else {
            return Ok(false);
        };
        let bytes: usize = host.iter().map(|s| s.len()).sum();
        let header = inline_header(msg.meta, &host);
        if bytes >= queued_ring_min(queue)
            || header.len() + msg.meta.len() + bytes > queue.max_payload()
        {
            return Ok(false);
        }
        let mut parts: SmallVec<[&[u8]; 6]> = SmallVec::new();
        parts.push(&header);
        parts.push(msg.meta);
        parts.extend(host.iter().copied());
        // Half a record's worth stays free for markers and descriptors, so that a receiver
        // slow to drain small messages never holds up the large ones behind them for long.
        queue
            .push(Kind::Inline, &parts, queue.max_payload() / 2)
            .map_err(|e| self.broken_queue(e))
    }

    /// Appends a record, waiting for room while the receiver drains the queue (as a full
    /// socket buffer makes a writer wait); fails once the connection is closed.
    async fn push_waiting(
        &self,
        queue: &Arc<SendQueue>,
        kind: Kind,
        parts: &[&[u8]],
    ) -> io::Result<()> {
        let since = Instant::now();
        loop {
            if queue
                .push(kind, parts, 0)
                .map_err(|e| self.broken_queue(e))?
            {
                return Ok(());
            }
            if self.is_broken() {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "connection closed",
                ));
            }
            if since.elapsed() < FULL_SPIN {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(FULL_NAP).await;
            }
        }
    }

    /// The peer broke the queue's rules: the connection cannot go on.
    fn broken_queue(&self, why: QueueError) -> io::Error {
        tracing::warn!(peer = %self.peer, %why, "shared-memory queue broken: closing the connection");
        self.close();
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("shared-memory queue: {why}"),
        )
    }
}

/// The size from which messages go through the ring once the queue is in use: up to it they
/// are copied into the queue, so it stays below the largest record the queue takes.
pub(crate) fn queued_ring_min(queue: &SendQueue) -> usize {
    QUEUED_RING_MIN
        .min(queue.max_payload().saturating_sub(INLINE_SLACK))
        .max(SHM_MIN)
}

/// Room left in the largest record for an inline message's lengths and metadata.
const INLINE_SLACK: usize = 4096;

/// Closes the connection when dropped before `finished` is set.
struct CloseUnlessFinished<'a> {
    conn: &'a Conn,
    finished: bool,
}

impl Drop for CloseUnlessFinished<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.close();
        }
    }
}
