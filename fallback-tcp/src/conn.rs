//! One established connection: the write half behind a fair lock, and a handle to force it shut.

use std::io::{self, IoSlice};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use psnet_transport::codec::{FrameHeader, HeaderBuf};
use psnet_transport::device::{prefetch, ChunkSink, StreamError};
use psnet_transport::session::{FrameMac, Role, Sealer, SessionBase, TAG_LEN};
use psnet_transport::{FrameKind, Limits, NodeId, OutMessage, Segment};
use smallvec::SmallVec;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::task::AbortHandle;

use crate::shm::queue::SendQueue;
use crate::shm::releases::ReleaseReader;
use crate::shm::{Control, SendRing};

/// How long a connection closed for what it sent may take to be told why.
const CLOSE_NOTICE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// How long a closed connection keeps reading (and dropping) what the peer still sends, at
/// most, waiting for it to close its side.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);
/// Most buffers one `writev` takes (Linux's IOV_MAX).
const IOV_MAX: usize = 1024;

pub(crate) struct Conn {
    pub(crate) peer: NodeId,
    /// Whether this side dialled (the simultaneous-connect rule needs to know).
    pub(crate) dialed_by_us: bool,
    /// Tokio's mutex is FIFO, so concurrent senders are served in arrival order.
    pub(crate) writer: tokio::sync::Mutex<Writer>,
    /// A duplicate of the socket, to shut it down from synchronous code while a send may hold
    /// the writer.
    control_socket: std::net::TcpStream,
    broken: AtomicBool,
    /// A graceful close began (transport shutdown): the read side stays open.
    graceful: AtomicBool,
    reader: Mutex<Option<AbortHandle>>,
    /// This side's ring for large messages to the peer, once offered.
    send_ring: Mutex<Option<Arc<SendRing>>>,
    /// Whether the peer is on this host (loopback, or our own address).
    same_host: bool,
    ring_offered: AtomicBool,
    /// This side's message queue to the peer, once offered.
    send_queue: Mutex<Option<Arc<SendQueue>>>,
    /// Where the peer hands back regions of our ring, once we mapped its queue.
    releases: Mutex<Option<ReleaseReader>>,
    /// Frames the control task writes (ring offers and answers, released regions).
    pub(crate) control: Arc<Control>,
    control_task: Mutex<Option<AbortHandle>>,
    /// The connection's session (a job secret), and which end this is: what a channel
    /// beside it derives its keys from (see [`crate::TcpTransport::session_with`]).
    pub(crate) session: Option<(SessionBase, Role)>,
}

impl Conn {
    pub(crate) fn new(
        peer: NodeId,
        dialed_by_us: bool,
        same_host: bool,
        writer: OwnedWriteHalf,
        control_socket: std::net::TcpStream,
        sealer: Option<Sealer>,
        session: Option<(SessionBase, Role)>,
    ) -> Self {
        Conn {
            session,
            peer,
            dialed_by_us,
            writer: tokio::sync::Mutex::new(Writer {
                half: writer,
                socket_data: 0,
                queue: None,
                sealer,
                scratch: Vec::new(),
            }),
            control_socket,
            broken: AtomicBool::new(false),
            graceful: AtomicBool::new(false),
            reader: Mutex::new(None),
            send_ring: Mutex::new(None),
            same_host,
            ring_offered: AtomicBool::new(false),
            send_queue: Mutex::new(None),
            releases: Mutex::new(None),
            control: Arc::new(Control::default()),
            control_task: Mutex::new(None),
        }
    }

    pub(crate) fn set_reader(&self, handle: AbortHandle) {
        *self.reader.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
    }

    pub(crate) fn set_control_task(&self, handle: AbortHandle) {
        *self.control_task.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
    }

    /// Offers a shared-memory ring of `size` bytes to the peer, once per connection, when it
    /// is on this host (a peer elsewhere could not map it anyway).
    pub(crate) fn offer_ring(&self, size: usize) {
        if size == 0 || !self.same_host || self.ring_offered.swap(true, Ordering::AcqRel) {
            return;
        }
        match SendRing::create(size) {
            Ok(ring) => {
                // In its slot before the offer leaves: the answer can come back (and find the
                // slot) before this thread runs again.
                let offer = ring.offer();
                *self.send_ring.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(ring));
                self.control.push(FrameKind::ShmOffer, offer);
            }
            Err(e) => tracing::debug!(peer = %self.peer, error = %e, "no shared-memory ring"),
        }
    }

    /// The ring, once the peer has accepted it.
    pub(crate) fn active_ring(&self) -> Option<Arc<SendRing>> {
        self.send_ring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|r| r.is_active())
            .cloned()
    }

    /// The peer's answer to our offer.
    pub(crate) fn ring_answer(&self, accepted: bool) {
        let mut slot = self.send_ring.lock().unwrap_or_else(|p| p.into_inner());
        match (accepted, slot.as_ref()) {
            (true, Some(ring)) => ring.activate(),
            _ => *slot = None,
        }
    }

    /// Offers the peer on this host a message queue of `size` bytes of records, when the
    /// connection opens.
    pub(crate) fn offer_queue(&self, size: usize) {
        if size == 0 || !self.same_host {
            return;
        }
        match SendQueue::create(size) {
            Ok(queue) => {
                // In its slot before the offer leaves, as for the ring.
                let offer = queue.offer().to_vec();
                *self.send_queue.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(queue));
                self.control.push(FrameKind::QueueOffer, offer);
            }
            Err(e) => tracing::debug!(peer = %self.peer, error = %e, "no shared-memory queue"),
        }
    }

    /// The peer's answer to our queue offer.
    pub(crate) fn queue_answer(&self, accepted: bool) {
        let mut slot = self.send_queue.lock().unwrap_or_else(|p| p.into_inner());
        match (accepted, slot.as_ref()) {
            (true, Some(queue)) => {
                queue.activate();
                self.control.release_through(queue.clone());
            }
            _ => *slot = None,
        }
    }

    /// The queue, once the peer has mapped it.
    pub(crate) fn active_queue(&self) -> Option<Arc<SendQueue>> {
        self.send_queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|q| q.is_active())
            .cloned()
    }

    /// The peer's queue is mapped: its release area tells which regions of our ring it is
    /// done with.
    pub(crate) fn set_releases(&self, reader: ReleaseReader) {
        *self.releases.lock().unwrap_or_else(|p| p.into_inner()) = Some(reader);
    }

    /// Frees the regions of our ring the peer released through shared memory (called before
    /// each allocation in the ring). A broken release area closes the connection.
    pub(crate) fn collect_releases(&self) {
        let mut slot = self.releases.lock().unwrap_or_else(|p| p.into_inner());
        let Some(reader) = slot.as_mut() else {
            return;
        };
        let regions = match reader.collect() {
            Ok(regions) => regions,
            Err(why) => {
                tracing::warn!(peer = %self.peer, %why, "closing the connection");
                self.close();
                return;
            }
        };
        if !regions.is_empty() && !self.ring_free(&regions) {
            tracing::warn!(peer = %self.peer, "the peer released ring regions never handed out: closing the connection");
            self.close();
        }
    }

    /// The peer released regions of our ring; false if it named one we never handed out.
    pub(crate) fn ring_free(&self, regions: &[(usize, usize)]) -> bool {
        let slot = self.send_ring.lock().unwrap_or_else(|p| p.into_inner());
        let Some(ring) = slot.as_ref() else {
            return false;
        };
        regions.iter().all(|&(o, l)| ring.free(o, l))
    }

    /// Writes one control frame (the control task's only job).
    pub(crate) async fn write_control(&self, kind: FrameKind, body: &[u8]) -> io::Result<()> {
        let mut writer = self.writer.lock().await;
        self.write_control_locked(&mut writer, kind, body).await
    }

    /// `write_control` with the writer already held.
    pub(crate) async fn write_control_locked(
        &self,
        writer: &mut Writer,
        kind: FrameKind,
        body: &[u8],
    ) -> io::Result<()> {
        let msg = OutMessage::new(body, &[]);
        let header = FrameHeader::for_message(kind, &msg, &Limits::default())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let mut head = HeaderBuf::new();
        header.encode_into(&mut head);
        self.write_frame_locked(writer, &head, body, &[]).await
    }

    /// Tells the peer why this side closes the connection (a frame or record that breaks the
    /// rules), waiting at most `CLOSE_NOTICE_WAIT` for a peer that does not read, then closes.
    pub(crate) async fn close_with_notice(&self, why: &str) {
        let say = self.write_control(FrameKind::Close, why.as_bytes());
        let _ = tokio::time::timeout(CLOSE_NOTICE_WAIT, say).await;
        self.close();
    }

    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Shuts the socket down both ways (only for writing once a graceful close began):
    /// pending and later writes fail, the reader sees the end.
    pub(crate) fn close(&self) {
        self.broken.store(true, Ordering::Release);
        // Once a graceful close began, the read side stays open whatever fails next (a write
        // cut short by it, the reader's end): a socket shut for reading is reset by the kernel
        // as soon as the peer sends anything, and the reset drops what the peer has not yet
        // acknowledged.
        let how = if self.graceful.load(Ordering::Acquire) {
            Shutdown::Write
        } else {
            Shutdown::Both
        };
        let _ = self.control_socket.shutdown(how);
        if let Some(h) = self
            .control_task
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            h.abort();
        }
    }

    /// Stops the reader task too (transport shutdown).
    pub(crate) fn close_and_stop_reader(&self) {
        self.close();
        self.stop_reader();
    }

    fn stop_reader(&self) {
        if let Some(h) = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
    }

    /// Starts closing the connection without losing what was sent: later writes fail, what
    /// the kernel holds goes out followed by the FIN, and the read side stays open. Shutting
    /// the read side too would make the kernel answer anything the peer still sends (a ring
    /// release, a credit) with a reset, which throws away what it had not yet delivered.
    pub(crate) fn begin_graceful_close(&self) {
        self.graceful.store(true, Ordering::Release);
        self.close();
    }

    /// Whether the peer's kernel has acknowledged everything written, the FIN included (or
    /// the connection is gone, so that waiting longer is pointless).
    pub(crate) fn all_acknowledged(&self) -> bool {
        if matches!(self.control_socket.take_error(), Ok(Some(_)) | Err(_)) {
            return true;
        }
        crate::sys::unacknowledged_bytes(&self.control_socket).map_or(true, |n| n == 0)
    }

    /// Ends a graceful close: stops the reader and, inside a runtime, reads and drops what the
    /// peer still sends until it closes its side (at most `DRAIN_LIMIT`), so that the last
    /// descriptor closes on an empty receive queue and the peer sees an orderly end, not a
    /// reset.
    pub(crate) fn finish_graceful_close(&self) {
        self.stop_reader();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Ok(dup) = self.control_socket.try_clone() else {
            return;
        };
        runtime.spawn(async move {
            let Ok(mut stream) = tokio::net::TcpStream::from_std(dup) else {
                return;
            };
            let mut scratch = vec![0u8; 64 * 1024];
            let drain = async {
                while let Ok(n) = stream.read(&mut scratch).await {
                    if n == 0 {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(DRAIN_LIMIT, drain).await;
        });
    }

    /// Writes one frame (header, metadata, segments) with vectored writes straight from the
    /// caller's buffers; the caller holds the writer.
    pub(crate) async fn write_frame_locked(
        &self,
        writer: &mut Writer,
        header: &HeaderBuf,
        meta: &[u8],
        segments: &[Segment<'_>],
    ) -> io::Result<()> {
        if FrameHeader::is_sealed_encoded(header) {
            return self
                .write_frame_sealed(writer, header, meta, segments)
                .await;
        }
        let tag: [u8; TAG_LEN];
        let mut slices: SmallVec<[IoSlice<'_>; 8]> = SmallVec::new();
        slices.push(IoSlice::new(header));
        if !meta.is_empty() {
            slices.push(IoSlice::new(meta));
        }
        for seg in segments.iter().filter(|s| !s.is_empty()) {
            // Device memory goes through `write_frame_staged`; here it would be written as
            // nothing under a header announcing its length.
            let Some(bytes) = seg.host() else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a device segment on the host-only write path",
                ));
            };
            slices.push(IoSlice::new(bytes));
        }
        if self.is_broken() {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "connection closed",
            ));
        }
        if let Some(sealer) = writer.sealer.as_mut() {
            let mut mac = sealer.frame(false);
            for slice in &slices {
                mac.update(slice);
            }
            tag = mac.tag();
            slices.push(IoSlice::new(&tag));
        }
        let mut guard = PartialWriteGuard {
            conn: self,
            started: false,
            done: false,
        };
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let batch = rest.len().min(IOV_MAX);
            let n = match writer.half.write_vectored(&rest[..batch]).await {
                Ok(0) => Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "socket wrote 0 bytes",
                )),
                other => other,
            }
            .inspect_err(|_| self.close())?;
            guard.started = true;
            IoSlice::advance_slices(&mut rest, n);
        }
        guard.done = true;
        Ok(())
    }

    /// Writes one sealed frame (`PSNET_ENCRYPT`): the header in clear, the metadata and host
    /// segments encrypted a chunk at a time into a buffer of the connection's, then the tag.
    async fn write_frame_sealed(
        &self,
        writer: &mut Writer,
        header: &[u8],
        meta: &[u8],
        segments: &[Segment<'_>],
    ) -> io::Result<()> {
        if self.is_broken() {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "connection closed",
            ));
        }
        let mut sink = SocketSink::new(self, writer, true);
        sink.write_clear(header).await?;
        sink.write(meta).await?;
        for seg in segments {
            let Some(bytes) = seg.host() else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a device segment on the host-only write path",
                ));
            };
            sink.write(bytes).await?;
        }
        sink.finish().await
    }
}

impl Conn {
    /// Writes one frame whose segments include device memory: the header, metadata and host
    /// segments as they are, each device segment through two staging buffers of `chunk` bytes,
    /// copying chunk k+1 out of the device while chunk k is written. Each device segment's
    /// first chunk is copied before the frame starts, so a region that cannot be read fails
    /// with the connection intact; a device error after the frame has started closes the
    /// connection (the frame cannot be finished).
    /// `before_header` runs once every first chunk is copied, just before the frame starts
    /// (the queue's marker for the frame goes there).
    pub(crate) async fn write_frame_staged(
        &self,
        writer: &mut Writer,
        header: &HeaderBuf,
        meta: &[u8],
        segments: &[Segment<'_>],
        chunk: usize,
        before_header: impl AsyncFnOnce() -> io::Result<()>,
    ) -> Result<(), StreamError> {
        if self.is_broken() {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "connection closed").into());
        }
        // Every device segment's first chunk before the frame starts: a region that cannot
        // be read fails the send with the connection intact.
        let mut ready = Vec::new();
        for device in segments.iter().filter_map(|s| s.device_bytes()) {
            ready.push(prefetch(device, chunk).await?);
        }
        let mut ready = ready.into_iter();
        before_header().await?;
        let mut sink = SocketSink::new(self, writer, FrameHeader::is_sealed_encoded(header));
        sink.write_clear(header).await?;
        sink.write(meta).await?;
        for seg in segments {
            match seg.host() {
                Some(bytes) => sink.write(bytes).await?,
                None => match ready.next() {
                    Some(device) => device.stream_to(&mut sink).await?,
                    None => unreachable!("one prefetched region per device segment"),
                },
            }
        }
        sink.finish().await.map_err(StreamError::from)
    }
}

/// Bytes of a sealed frame encrypted at a time: the buffer stays in cache between the
/// cipher and the socket's copy.
const SEAL_CHUNK: usize = 256 << 10;

/// The socket as a frame's sink (the staging pipeline's, and sealed frames'); a failed write
/// closes the connection.
struct SocketSink<'a, 'c> {
    /// The frame's tag so far, with a job secret; its cipher, if the frame is sealed.
    mac: Option<FrameMac>,
    writer: &'a mut OwnedWriteHalf,
    /// Where a sealed frame's bytes are encrypted (kept with the connection's writer).
    scratch: &'a mut Vec<u8>,
    guard: PartialWriteGuard<'c>,
}

impl<'a, 'c> SocketSink<'a, 'c> {
    /// The sink of `conn`'s next frame, `sealed` or not.
    fn new(conn: &'c Conn, writer: &'a mut Writer, sealed: bool) -> Self {
        SocketSink {
            mac: writer.sealer.as_mut().map(|s| s.frame(sealed)),
            writer: &mut writer.half,
            scratch: &mut writer.scratch,
            guard: PartialWriteGuard {
                conn,
                started: false,
                done: false,
            },
        }
    }

    /// Writes bytes that go in clear (a header), tagged.
    async fn write_clear(&mut self, bytes: &[u8]) -> io::Result<()> {
        if let Some(mac) = self.mac.as_mut() {
            mac.update(bytes);
        }
        self.write_raw(bytes).await
    }

    async fn write_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.guard.started = true;
        self.writer
            .write_all(bytes)
            .await
            .inspect_err(|_| self.guard.conn.close())
    }

    /// Writes the tag, if any: the frame is complete.
    async fn finish(mut self) -> io::Result<()> {
        if let Some(mac) = self.mac.take() {
            self.write_raw(&mac.tag()).await?;
        }
        self.guard.done = true;
        Ok(())
    }
}

impl ChunkSink for SocketSink<'_, '_> {
    async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        if !self.mac.as_ref().is_some_and(FrameMac::is_sealed) {
            if let Some(mac) = self.mac.as_mut() {
                mac.update(bytes);
            }
            return self.write_raw(bytes).await;
        }
        for chunk in bytes.chunks(SEAL_CHUNK) {
            let mut scratch = std::mem::take(self.scratch);
            scratch.clear();
            scratch.extend_from_slice(chunk);
            if let Some(mac) = self.mac.as_mut() {
                mac.seal(&mut scratch);
            }
            let written = self.write_raw(&scratch).await;
            *self.scratch = scratch;
            written?;
        }
        Ok(())
    }
}

/// If a send is dropped after writing part of a frame, the stream can no longer be parsed by
/// the peer: close the connection so both sides see a clean loss instead of garbage.
struct PartialWriteGuard<'a> {
    conn: &'a Conn,
    started: bool,
    done: bool,
}

impl Drop for PartialWriteGuard<'_> {
    fn drop(&mut self) {
        if self.started && !self.done {
            self.conn.close();
        }
    }
}

/// The socket's write half and what the send path keeps with it.
pub(crate) struct Writer {
    pub(crate) half: OwnedWriteHalf,
    /// Data frames (`Data`, `ShmData`) written to the socket so far: the queue's first record
    /// tells the receiver how many of them came before it.
    pub(crate) socket_data: u64,
    /// The message queue, once this side has started using it (written its first record).
    pub(crate) queue: Option<Arc<SendQueue>>,
    /// With a job secret: tags every frame written ([`psnet_transport::session`]).
    pub(crate) sealer: Option<Sealer>,
    /// Where sealed frames are encrypted before they are written (`PSNET_ENCRYPT`).
    pub(crate) scratch: Vec<u8>,
}
