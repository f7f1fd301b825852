//! Received segments written into device memory as they arrive: the receive side of
//! [`crate::device`].
//!
//! A receiver that wants a message's data on a GPU installs a [`Placer`] on its transport
//! ([`crate::Transport::set_placer`]). The transport asks it, for every data message, as soon
//! as the message's metadata has arrived and before its data has: the metadata names the call
//! or request, so the placer can answer "segment `i` goes into this device memory"
//! ([`Placement`]). The transport then writes that segment there instead of into host memory:
//! a transport that stages (TCP) reads the socket into a host buffer chunk by chunk and copies
//! chunk k to the device while chunk k+1 is read ([`stream_from_source`]); one whose NIC can
//! write device memory itself (GPUDirect) may let it. The message is delivered as usual, with
//! that segment empty and [`Incoming::placed`](crate::Incoming::placed) saying where it went
//! and whether the copies succeeded.
//!
//! A transport that receives whole messages (the same-host shared-memory path, RDMA's
//! registered buffers, the in-memory network) copies the segment there once it has arrived
//! ([`place_arrived`]); RDMA lets the sender's NIC write it in place where the destination is
//! memory registered with the receiving transport for that ([`DeviceDest::nic`]). A placement is an offer, never a promise: a transport without the
//! ability, or a placement whose length differs from the segment's, delivers host bytes as
//! before (with `placed` unset), and the receiver copies them itself. Receivers must handle
//! both.

use std::fmt;
use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};

use smallvec::SmallVec;

use crate::device::{join, CopyFuture, DeviceError, DevicePath, NicRegion, PathLog, StagingBuf};
use crate::message::{Event, Incoming};
use crate::node::NodeId;

/// Device memory a received segment can be written into: its length, its device, and how to
/// copy host bytes in.
pub trait DeviceDest: Send + Sync + fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> usize;

    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device's ordinal, for logs and errors.
    fn ordinal(&self) -> u32;

    /// The NIC registration covering the whole region, if it has one (a transport whose NIC
    /// can write device memory may place into it without staging). A transport uses it only
    /// if the registration is one it made for peers' writes and covers the region; any other
    /// answer gets the segment copied in.
    fn nic(&self) -> Option<NicRegion> {
        None
    }

    /// A host buffer of `len` bytes to stage through (page-locked where the implementation
    /// can, so the copies run asynchronously).
    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError>;

    /// Copies `buf[..len]` to the region's bytes `offset..offset + len` and gives `buf` back
    /// once the copy is done; other work (a socket read) may run while it is pending. The
    /// future owns the buffer, so a copy can never read memory that was freed or reused.
    fn copy_from_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_>;
}

/// Where one segment of an arriving message goes.
#[derive(Clone, Debug)]
pub struct Placement {
    /// The segment's index in the message.
    pub segment: usize,
    /// The device memory it is written into; its length must be the segment's.
    pub dest: Arc<dyn DeviceDest>,
}

/// Chooses device memory for arriving messages from their metadata.
pub trait Placer: Send + Sync {
    /// Called once per data message from `peer`, when its metadata has arrived and its
    /// segments (of `seg_lens` bytes) have not; None leaves the message in host memory. Called
    /// on the transport's receiving tasks (RDMA: its completion poller, holding the link's
    /// lock): it must be quick, must not block, and must not call into the transport.
    fn place(&self, peer: NodeId, meta: &[u8], seg_lens: &[u64]) -> Option<Placement>;
}

/// How a placed segment ended, reported with its message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    /// The segment's index; it arrives empty in the message's segments.
    pub segment: usize,
    /// The segment's length in bytes (the destination's).
    pub len: u64,
    /// Its bytes are in the placement's device memory, or the copy failed (every byte was
    /// still read off the connection, which stays usable).
    pub result: Result<(), DeviceError>,
}

/// Whether `placement` fits a message of `seg_lens`: a segment that exists, of the
/// destination's length. A transport places nothing else (the peer may have sent a size the
/// receiver did not expect, which the receiver reports from the host bytes).
pub fn fits(placement: &Placement, seg_lens: &[u64]) -> bool {
    seg_lens
        .get(placement.segment)
        .is_some_and(|&len| len == placement.dest.len() as u64)
}

/// Where [`stream_from_source`] reads the bytes it places.
pub trait ChunkSource: Send {
    /// Fills all of `buf` with the next bytes.
    fn read<'b>(
        &'b mut self,
        buf: &'b mut [u8],
    ) -> impl Future<Output = io::Result<()>> + Send + 'b;
}

/// Reads the segment's `total` bytes from `source` into `dest` through two staging buffers of
/// `chunk` bytes: chunk k is copied to the device while chunk k+1 is read.
///
/// The outer error is the source's (the connection failed); the inner one is the device's.
/// After a device error the rest of the bytes are still read and dropped, so the source
/// stays at the next message. A destination whose length is not `total` (any more: it is a
/// trait object) is a device error, never a read of another number of bytes.
pub async fn stream_from_source(
    dest: &dyn DeviceDest,
    total: usize,
    chunk: usize,
    source: &mut impl ChunkSource,
) -> io::Result<Result<(), DeviceError>> {
    if dest.len() != total {
        drain(source, total, chunk.max(1)).await?;
        return Ok(Err(DeviceError {
            ordinal: dest.ordinal(),
            reason: format!(
                "the destination is {} bytes for a segment of {total}",
                dest.len()
            ),
        }));
    }
    if total == 0 {
        return Ok(Ok(()));
    }
    let chunk = chunk.clamp(1, total);
    let mut cur = match staging(dest, chunk) {
        Ok(buf) => buf,
        Err(e) => {
            drain(source, total, chunk).await?;
            return Ok(Err(e));
        }
    };
    let mut spare: Option<StagingBuf> = None;
    let mut pending: Option<CopyFuture<'_>> = None;
    let mut at = 0;
    while at < total {
        let len = chunk.min(total - at);
        let copying = pending.take();
        let (read, copied) = join(source.read(&mut cur[..len]), async move {
            match copying {
                Some(copy) => Some(copy.await),
                None => None,
            }
        })
        .await;
        read?;
        match copied {
            Some(Ok(buf)) => spare = Some(buf),
            Some(Err(e)) => {
                drain(source, total - at - len, chunk).await?;
                return Ok(Err(e));
            }
            None => {}
        }
        pending = Some(dest.copy_from_host(at, len, cur));
        at += len;
        cur = match spare.take() {
            Some(buf) => buf,
            None if at < total => match staging(dest, chunk) {
                Ok(buf) => buf,
                Err(e) => {
                    // The queued copy still owns its buffer: let it finish first.
                    if let Some(copy) = pending.take() {
                        let _ = copy.await;
                    }
                    drain(source, total - at, chunk).await?;
                    return Ok(Err(e));
                }
            },
            // The last chunk is queued: no buffer needed for a next one.
            None => break,
        };
    }
    match pending {
        Some(copy) => Ok(copy.await.map(drop)),
        None => Ok(Ok(())),
    }
}

/// A staging buffer of at least `chunk` bytes from `dest`; an error for a shorter one.
fn staging(dest: &dyn DeviceDest, chunk: usize) -> Result<StagingBuf, DeviceError> {
    let buf = dest.staging(chunk)?;
    if buf.len() < chunk {
        return Err(DeviceError {
            ordinal: dest.ordinal(),
            reason: format!("a staging buffer of {} bytes, {chunk} asked", buf.len()),
        });
    }
    Ok(buf)
}

/// Reads and drops `len` bytes of `source`, `chunk` at a time.
async fn drain(source: &mut impl ChunkSource, len: usize, chunk: usize) -> io::Result<()> {
    let mut scratch = vec![0u8; chunk.min(len)];
    let mut left = len;
    while left > 0 {
        let n = scratch.len().min(left);
        source.read(&mut scratch[..n]).await?;
        left -= n;
    }
    Ok(())
}

/// Places a segment already in host memory into `dest` (a transport that receives whole
/// messages, like the in-memory one), through two staging buffers of `chunk` bytes.
pub async fn copy_into(
    dest: &dyn DeviceDest,
    bytes: &[u8],
    chunk: usize,
) -> Result<(), DeviceError> {
    let mut source = SliceSource(bytes);
    match stream_from_source(dest, bytes.len(), chunk, &mut source).await {
        Ok(result) => result,
        Err(e) => Err(DeviceError {
            ordinal: dest.ordinal(),
            reason: format!("internal: {e}"),
        }),
    }
}

/// Places the segment `placer` chooses of a message that arrived whole in host memory (an
/// in-memory network, a same-host shared-memory ring, RDMA's registered buffers): copies it
/// into the device memory through staging buffers of `chunk` bytes, empties it and sets
/// [`Incoming::placed`]. Returns the device's ordinal when it placed one, for the path log.
/// A message the transport already placed (its NIC wrote the device memory) is left alone,
/// and the placer is not asked again.
pub async fn place_arrived(m: &mut Incoming, placer: &dyn Placer, chunk: usize) -> Option<u32> {
    if m.placed.is_some() {
        return None;
    }
    let lens: SmallVec<[u64; 8]> = m.segments.iter().map(|s| s.len() as u64).collect();
    let p = placer.place(m.peer, &m.meta, &lens)?;
    place_decided(m, p, chunk).await
}

/// Places segment `p.segment` of `m`, which arrived whole in host memory, where the placer
/// already said (a transport that asked it before the data came, and then could not let its
/// NIC write there): as [`place_arrived`], without asking again. A placement that does not fit
/// the message leaves it in host memory.
pub async fn place_decided(m: &mut Incoming, p: Placement, chunk: usize) -> Option<u32> {
    if m.placed.is_some() {
        return None;
    }
    let lens: SmallVec<[u64; 8]> = m.segments.iter().map(|s| s.len() as u64).collect();
    if !fits(&p, &lens) {
        return None;
    }
    let bytes = std::mem::take(&mut m.segments[p.segment]);
    let result = copy_into(&*p.dest, &bytes, chunk).await;
    m.placed = Some(Placed {
        segment: p.segment,
        len: lens[p.segment],
        result,
    });
    Some(p.dest.ordinal())
}

/// What a transport keeps to place received segments: the placer installed, the staging
/// chunk, the paths taken (logged once per peer and device), and the placement under way in
/// `recv`. That placement belongs to the transport rather than to a `recv` call: a `recv`
/// dropped half-way (a timeout, a lost `select!`) leaves it to the next call instead of
/// losing the message.
pub struct ReceivePlacing {
    transport: &'static str,
    chunk: usize,
    placer: RwLock<Option<Arc<dyn Placer>>>,
    slot: Mutex<Option<Placing>>,
    paths: PathLog,
}

/// A placement's future: the message, and the device it was placed on.
type Placing = Pin<Box<dyn Future<Output = (Incoming, Option<u32>)> + Send>>;

impl ReceivePlacing {
    /// For transport `transport` (its name in logs), staging through `chunk`-byte buffers.
    pub fn new(transport: &'static str, chunk: usize) -> Self {
        ReceivePlacing {
            transport,
            chunk,
            placer: RwLock::new(None),
            slot: Mutex::new(None),
            paths: PathLog::default(),
        }
    }

    /// Installs `placer` (`Transport::set_placer`).
    pub fn set_placer(&self, placer: Arc<dyn Placer>) {
        *self.placer.write().unwrap_or_else(|p| p.into_inner()) = Some(placer);
    }

    /// The placer, if one was installed.
    pub fn placer(&self) -> Option<Arc<dyn Placer>> {
        self.placer
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Bytes per staging chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Logs, once per peer, device and path, how a segment from `peer` reached device
    /// `ordinal`.
    pub fn note(&self, peer: NodeId, ordinal: u32, path: DevicePath) {
        self.paths
            .note_received(self.transport, peer, ordinal, path);
    }

    /// Places a segment of `m`, which arrived whole in host memory, if the placer wants one
    /// ([`place_arrived`], [`DevicePath::Copied`]), in a task that is not cancelled (a
    /// transport's reader).
    pub async fn place_now(&self, mut m: Incoming) -> Incoming {
        if let Some(placer) = self.placer() {
            if let Some(ordinal) = place_arrived(&mut m, &*placer, self.chunk).await {
                self.note(m.peer, ordinal, DevicePath::Copied);
            }
        }
        m
    }

    /// For `recv`: places a segment of `event`'s message, which arrived whole, if the placer
    /// wants one; the placement is kept here until it ends ([`ReceivePlacing::finish`]).
    pub async fn place(&self, event: Event) -> Event {
        let Some(placer) = self.placer() else {
            return event;
        };
        let m = match event {
            Event::Message(m) => m,
            other => return other,
        };
        let chunk = self.chunk;
        self.run(Box::pin(async move {
            let mut m = m;
            let ordinal = place_arrived(&mut m, &*placer, chunk).await;
            (m, ordinal)
        }))
        .await
    }

    /// For `recv`: as [`ReceivePlacing::place`] for a message whose placement was decided
    /// before its data arrived ([`place_decided`]); the placer is not asked again.
    pub async fn place_as(&self, m: Incoming, decided: Placement) -> Event {
        let chunk = self.chunk;
        self.run(Box::pin(async move {
            let mut m = m;
            let ordinal = place_decided(&mut m, decided, chunk).await;
            (m, ordinal)
        }))
        .await
    }

    /// Keeps `placing` here and runs it to its end (or until this `recv` is dropped).
    async fn run(&self, placing: Placing) -> Event {
        *lock(&self.slot) = Some(placing);
        match self.finish().await {
            Some(event) => event,
            None => unreachable!("a placement was just started"),
        }
    }

    /// For `recv`, first: ends the placement a dropped `recv` left, if any, and returns its
    /// message.
    pub async fn finish(&self) -> Option<Event> {
        let placing = lock(&self.slot).take()?;
        let mut back = PutBack {
            slot: &self.slot,
            placing: Some(placing),
        };
        let (m, ordinal) = poll_fn(|cx| back.poll(cx)).await;
        if let Some(ordinal) = ordinal {
            self.note(m.peer, ordinal, DevicePath::Copied);
        }
        Some(Event::Message(m))
    }
}

/// Polls a placement; puts it back in its slot if dropped before it ended.
struct PutBack<'s> {
    slot: &'s Mutex<Option<Placing>>,
    placing: Option<Placing>,
}

impl PutBack<'_> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<(Incoming, Option<u32>)> {
        let Some(placing) = self.placing.as_mut() else {
            unreachable!("polled after it ended")
        };
        let out = std::task::ready!(placing.as_mut().poll(cx));
        self.placing = None;
        Poll::Ready(out)
    }
}

impl Drop for PutBack<'_> {
    fn drop(&mut self) {
        if let Some(placing) = self.placing.take() {
            *lock(self.slot) = Some(placing);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A [`ChunkSource`] over bytes in memory.
struct SliceSource<'s>(&'s [u8]);

impl ChunkSource for SliceSource<'_> {
    async fn read<'b>(&'b mut self, buf: &'b mut [u8]) -> io::Result<()> {
        if buf.len() > self.0.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "source too short",
            ));
        }
        let (head, tail) = self.0.split_at(buf.len());
        buf.copy_from_slice(head);
        self.0 = tail;
        Ok(())
    }
}

/// Device memory to receive into, simulated in host memory: the stand-in for a GPU buffer in
/// tests. Each copy yields to the executor once before it completes, as a real asynchronous
/// copy would, and the copies are counted.
#[derive(Debug)]
pub struct SimulatedLanding {
    bytes: Mutex<Vec<u8>>,
    ordinal: u32,
    fail_from: Option<usize>,
    copies: AtomicUsize,
}

impl SimulatedLanding {
    /// `len` zero bytes on simulated device `ordinal`.
    pub fn new(len: usize, ordinal: u32) -> Self {
        SimulatedLanding {
            bytes: Mutex::new(vec![0; len]),
            ordinal,
            fail_from: None,
            copies: AtomicUsize::new(0),
        }
    }

    /// The same, failing every copy that reaches byte `offset` or beyond (a device error).
    pub fn failing_from(mut self, offset: usize) -> Self {
        self.fail_from = Some(offset);
        self
    }

    /// The simulated contents.
    pub fn bytes(&self) -> Vec<u8> {
        self.bytes.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many copies to the device ran.
    pub fn copies(&self) -> usize {
        self.copies.load(Ordering::Relaxed)
    }
}

impl DeviceDest for SimulatedLanding {
    fn len(&self) -> usize {
        self.bytes.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        Ok(Box::new(vec![0u8; len]))
    }

    fn copy_from_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_> {
        Box::pin(async move {
            crate::device::yield_once().await;
            self.copies.fetch_add(1, Ordering::Relaxed);
            let mut bytes = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
            let end = offset
                .checked_add(len)
                .filter(|&e| e <= bytes.len() && len <= buf.len())
                .ok_or_else(|| DeviceError {
                    ordinal: self.ordinal,
                    reason: format!(
                        "copy of {len} bytes at {offset} past the region's {} (or the buffer's {})",
                        bytes.len(),
                        buf.len()
                    ),
                })?;
            if self.fail_from.is_some_and(|f| end > f) {
                return Err(DeviceError {
                    ordinal: self.ordinal,
                    reason: format!("injected copy failure at byte {offset}"),
                });
            }
            bytes[offset..end].copy_from_slice(&buf[..len]);
            Ok(buf)
        })
    }
}

#[cfg(test)]
mod tests;
