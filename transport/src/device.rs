//! Device (GPU) memory in messages.
//!
//! A [`Segment`](crate::Segment) may name device memory instead of host bytes: anything that
//! implements [`DeviceBytes`] (the CUDA implementation wraps a cudarc view; tests use
//! [`SimulatedDevice`]). A transport whose NIC reads the region itself (an RDMA transport with
//! a GPUDirect registration, [`DeviceBytes::nic`]) sends it without a copy; every other path
//! stages it through host buffers the region hands out ([`DeviceBytes::staging`], page-locked
//! for CUDA) in a pipeline of chunks, [`stream_to_sink`]: the copy of chunk k+1 to the host runs
//! while chunk k is written. Receivers get host bytes either way, unless they name device
//! memory for the segment as it arrives ([`crate::placement`]).
//!
//! The region's own type does the copies, so this crate needs neither CUDA nor `unsafe`: a
//! [`DeviceBytes`] can only be made from memory its implementation knows to be valid.

use std::collections::HashSet;
use std::fmt;
use std::future::{poll_fn, Future};
use std::io;
use std::ops::DerefMut;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::task::Poll;

use crate::memory::RegionKey;
use crate::node::NodeId;

/// Bytes staged per chunk when a transport does not say otherwise: large enough that a copy's
/// fixed cost (a few microseconds) is small against its transfer, small enough that two chunks
/// in flight stay in cache-sized pinned buffers.
pub const DEFAULT_STAGE_CHUNK: usize = 1 << 20;

/// A device copy that failed, or a region that cannot be staged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GPU {ordinal}: {reason}")]
pub struct DeviceError {
    /// The device's ordinal.
    pub ordinal: u32,
    /// What failed, in the driver's words where it gave some.
    pub reason: String,
}

/// A future of a device copy into a staging buffer, which it owns until the copy is done and
/// then gives back.
pub type CopyFuture<'a> =
    Pin<Box<dyn Future<Output = Result<StagingBuf, DeviceError>> + Send + 'a>>;

/// A host buffer for staging device bytes (page-locked where the implementation can).
pub type StagingBuf = Box<dyn DerefMut<Target = [u8]> + Send + Sync>;

/// Where the NIC finds a region registered with it (GPUDirect: dma-buf or nvidia-peermem).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NicRegion {
    /// The transport's key of the registration.
    pub key: RegionKey,
    /// The region's first byte in the registration's address space (the device address).
    pub addr: u64,
}

/// Device memory a message may carry: its length, its device, and how to copy it out.
pub trait DeviceBytes: Send + Sync + fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> usize;

    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device's ordinal, for logs and errors.
    fn ordinal(&self) -> u32;

    /// The NIC registration covering the whole region, if it has one.
    fn nic(&self) -> Option<NicRegion> {
        None
    }

    /// A host buffer of `len` bytes to stage through.
    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError>;

    /// Copies the region's bytes `offset..offset + len` into `buf[..len]` and gives `buf`
    /// back once they are there; other work (a socket write) may run while it is pending.
    /// The future owns the buffer: an asynchronous copy can never write memory that was
    /// freed or handed to someone else, even if the future is dropped or leaked (dropped, it
    /// waits for the copy; leaked, the buffer is never freed).
    fn copy_to_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_>;
}

/// Bytes `offset..offset + len` of another region: a part of a device buffer sent as its own
/// segment (the kv store's parts of a key).
#[derive(Debug, Clone, Copy)]
pub struct DeviceSlice<'a> {
    whole: &'a dyn DeviceBytes,
    offset: usize,
    len: usize,
}

impl<'a> DeviceSlice<'a> {
    /// Bytes `range` of `whole`; None if the range leaves it.
    pub fn new(whole: &'a dyn DeviceBytes, range: std::ops::Range<usize>) -> Option<Self> {
        (range.start <= range.end && range.end <= whole.len()).then_some(DeviceSlice {
            whole,
            offset: range.start,
            len: range.end - range.start,
        })
    }
}

impl DeviceBytes for DeviceSlice<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn ordinal(&self) -> u32 {
        self.whole.ordinal()
    }

    fn nic(&self) -> Option<NicRegion> {
        self.whole.nic().map(|n| NicRegion {
            key: n.key,
            addr: n.addr + self.offset as u64,
        })
    }

    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        self.whole.staging(len)
    }

    fn copy_to_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_> {
        if offset.saturating_add(len) > self.len {
            let err = DeviceError {
                ordinal: self.ordinal(),
                reason: format!(
                    "copy of {len} bytes at {offset} past the slice's {}",
                    self.len
                ),
            };
            return Box::pin(std::future::ready(Err(err)));
        }
        self.whole.copy_to_host(self.offset + offset, len, buf)
    }
}

/// How a device segment travels to one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DevicePath {
    /// The NIC reads (sending) or writes (receiving) the device memory itself (GPUDirect RDMA).
    Direct,
    /// Copied to host buffers in chunks, each written while the next is copied.
    Staged,
    /// Copied to the host whole, then sent as host bytes (a transport that writes messages in
    /// one piece: the in-memory transport, RDMA's eager path).
    Copied,
}

impl fmt::Display for DevicePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DevicePath::Direct => "GPUDirect (the NIC reads or writes device memory itself)",
            DevicePath::Staged => "staged through host buffers, pipelined in chunks",
            DevicePath::Copied => "copied to host memory, then sent",
        })
    }
}

/// Logs the path device segments take, once per peer, device, path and direction.
#[derive(Debug, Default)]
pub struct PathLog {
    seen: Mutex<HashSet<(NodeId, u32, DevicePath, bool)>>,
}

impl PathLog {
    /// Records that a segment from device `ordinal` went to `peer` by `path`; true (and one
    /// log line) the first time.
    pub fn note(&self, transport: &str, peer: NodeId, ordinal: u32, path: DevicePath) -> bool {
        let first = self.first(peer, ordinal, path, false);
        if first {
            tracing::info!(transport, %peer, gpu = ordinal, %path, "device memory path");
        }
        first
    }

    /// Records that a segment from `peer` was placed into device `ordinal` by `path` (see
    /// [`crate::placement`]); true (and one log line) the first time.
    pub fn note_received(
        &self,
        transport: &str,
        peer: NodeId,
        ordinal: u32,
        path: DevicePath,
    ) -> bool {
        let first = self.first(peer, ordinal, path, true);
        if first {
            tracing::info!(transport, %peer, gpu = ordinal, %path, "device memory path (receive)");
        }
        first
    }

    fn first(&self, peer: NodeId, ordinal: u32, path: DevicePath, received: bool) -> bool {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((peer, ordinal, path, received))
    }
}

/// Where [`stream_to_sink`] writes the staged chunks.
pub trait ChunkSink: Send {
    /// Writes all of `bytes`.
    fn write<'b>(&'b mut self, bytes: &'b [u8])
        -> impl Future<Output = io::Result<()>> + Send + 'b;
}

/// What stopped [`stream_to_sink`].
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A copy out of the device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The sink failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Writes all of `src` to `sink` through two staging buffers of `chunk` bytes: while chunk k
/// is written, chunk k+1 is copied out of the device. A device error stops the stream after
/// the chunks before it were written. ([`prefetch`] then [`Prefetched::stream_to`].)
pub async fn stream_to_sink(
    src: &dyn DeviceBytes,
    chunk: usize,
    sink: &mut impl ChunkSink,
) -> Result<(), StreamError> {
    prefetch(src, chunk).await?.stream_to(sink).await
}

/// A region made ready to stream: a staging buffer taken and its first chunk copied out, so
/// that a region that cannot be read fails before anything of it is written.
pub struct Prefetched<'a> {
    src: &'a dyn DeviceBytes,
    chunk: usize,
    first: Option<StagingBuf>,
}

/// Takes a staging buffer of `chunk` bytes for `src` and copies its first chunk out.
pub async fn prefetch(src: &dyn DeviceBytes, chunk: usize) -> Result<Prefetched<'_>, DeviceError> {
    let total = src.len();
    if total == 0 {
        return Ok(Prefetched {
            src,
            chunk: 0,
            first: None,
        });
    }
    let chunk = chunk.clamp(1, total);
    let buf = src.staging(chunk)?;
    let first = src.copy_to_host(0, chunk, buf).await?;
    Ok(Prefetched {
        src,
        chunk,
        first: Some(first),
    })
}

impl Prefetched<'_> {
    /// Writes the region to `sink`, copying chunk k+1 out while chunk k is written (a second
    /// staging buffer is taken here, once there is a second chunk).
    pub async fn stream_to(self, sink: &mut impl ChunkSink) -> Result<(), StreamError> {
        let Prefetched { src, chunk, first } = self;
        let Some(mut cur) = first else {
            return Ok(());
        };
        let total = src.len();
        let mut spare = None;
        let (mut at, mut len) = (0, chunk);
        loop {
            let next_at = at + len;
            if next_at >= total {
                sink.write(&cur[..len]).await?;
                return Ok(());
            }
            let next_len = chunk.min(total - next_at);
            let next = match spare.take() {
                Some(buf) => buf,
                None => src.staging(chunk)?,
            };
            let (written, copied) = join(
                sink.write(&cur[..len]),
                src.copy_to_host(next_at, next_len, next),
            )
            .await;
            written?;
            spare = Some(std::mem::replace(&mut cur, copied?));
            (at, len) = (next_at, next_len);
        }
    }
}

/// All of `src` in one host vector, copied through a staging buffer in chunks of
/// [`DEFAULT_STAGE_CHUNK`].
pub async fn copy_all(src: &dyn DeviceBytes) -> Result<Vec<u8>, DeviceError> {
    let total = src.len();
    let mut out = Vec::with_capacity(total);
    if total == 0 {
        return Ok(out);
    }
    let chunk = DEFAULT_STAGE_CHUNK.min(total);
    let mut buf = src.staging(chunk)?;
    while out.len() < total {
        let n = chunk.min(total - out.len());
        buf = src.copy_to_host(out.len(), n, buf).await?;
        out.extend_from_slice(&buf[..n]);
    }
    Ok(out)
}

/// Runs two futures at once on this task; both run to the end.
pub(crate) async fn join<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    let (mut a, mut b) = (pin!(a), pin!(b));
    let (mut ra, mut rb) = (None, None);
    poll_fn(|cx| {
        if ra.is_none() {
            if let Poll::Ready(v) = a.as_mut().poll(cx) {
                ra = Some(v);
            }
        }
        if rb.is_none() {
            if let Poll::Ready(v) = b.as_mut().poll(cx) {
                rb = Some(v);
            }
        }
        match (ra.take(), rb.take()) {
            (Some(x), Some(y)) => Poll::Ready((x, y)),
            (x, y) => {
                (ra, rb) = (x, y);
                Poll::Pending
            }
        }
    })
    .await
}

/// Device memory simulated in host memory: the stand-in for a GPU in tests and wherever the
/// path logic runs without one. Each copy yields to the executor once before it completes, as
/// a real asynchronous copy would, and the copies are counted.
#[derive(Debug)]
pub struct SimulatedDevice {
    bytes: Vec<u8>,
    ordinal: u32,
    nic: Option<NicRegion>,
    fail_from: Option<usize>,
    copies: AtomicUsize,
}

impl SimulatedDevice {
    /// `bytes` on simulated device `ordinal`.
    pub fn new(bytes: Vec<u8>, ordinal: u32) -> Self {
        SimulatedDevice {
            bytes,
            ordinal,
            nic: None,
            fail_from: None,
            copies: AtomicUsize::new(0),
        }
    }

    /// The same, registered with a NIC as `nic`.
    pub fn with_nic(mut self, nic: NicRegion) -> Self {
        self.nic = Some(nic);
        self
    }

    /// The same, failing every copy that reaches byte `offset` or beyond (a device error).
    pub fn failing_from(mut self, offset: usize) -> Self {
        self.fail_from = Some(offset);
        self
    }

    /// The simulated contents.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// How many copies to the host ran.
    pub fn copies(&self) -> usize {
        self.copies.load(Ordering::Relaxed)
    }
}

impl DeviceBytes for SimulatedDevice {
    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn nic(&self) -> Option<NicRegion> {
        self.nic
    }

    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        Ok(Box::new(vec![0u8; len]))
    }

    fn copy_to_host(&self, offset: usize, len: usize, mut buf: StagingBuf) -> CopyFuture<'_> {
        Box::pin(async move {
            yield_once().await;
            self.copies.fetch_add(1, Ordering::Relaxed);
            let end = offset
                .checked_add(len)
                .filter(|&e| e <= self.bytes.len() && len <= buf.len())
                .ok_or_else(|| DeviceError {
                    ordinal: self.ordinal,
                    reason: format!(
                        "copy of {len} bytes at {offset} past the region's {} (or the buffer's {})",
                        self.bytes.len(),
                        buf.len()
                    ),
                })?;
            if self.fail_from.is_some_and(|f| end > f) {
                return Err(DeviceError {
                    ordinal: self.ordinal,
                    reason: format!("injected copy failure at byte {offset}"),
                });
            }
            buf[..len].copy_from_slice(&self.bytes[offset..end]);
            Ok(buf)
        })
    }
}

pub(crate) async fn yield_once() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

#[cfg(test)]
mod tests;
