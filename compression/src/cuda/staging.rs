//! GPU memory as a transport message's segment ([`DeviceBytes`]).
//!
//! A [`CudaStager`] owns a stream and a pool of page-locked host buffers on one device;
//! [`CudaStager::bytes`] wraps a cudarc view as [`CudaBytes`], which a message carries with
//! `Segment::device`. Its copies to the host are queued on the stager's stream
//! (`cuMemcpyDtoHAsync`) and complete when an event recorded after them has fired, so a
//! transport writes one chunk to the wire while the next is still crossing PCIe.
//!
//! A pending copy is polled (`cuEventQuery`) each time its task runs and asks to run again
//! while the copy is in flight: the task spins on the copy, as NCCL's proxy thread does,
//! rather than parking a thread per copy.

use std::future::Future;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaStream, CudaView, DevicePtr, DeviceRepr, DeviceSlice,
    PinnedHostSlice, SyncOnDrop,
};
use psnet_transport::device::{CopyFuture, DeviceBytes, DeviceError, NicRegion, StagingBuf};

use super::{context, guarded, pinned_zeroed};
use crate::error::CompressionError;

/// Staging buffers kept for reuse, at most this many (the largest are kept).
const POOL_MAX: usize = 4;

/// The smallest staging buffer allocated.
const MIN_STAGING: usize = 64 << 10;

/// Copies device memory out for transports: a stream of its own and page-locked buffers
/// kept between messages, on one device.
pub struct CudaStager {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: u32,
    pool: Arc<Mutex<Vec<PinnedHostSlice<u8>>>>,
}

impl std::fmt::Debug for CudaStager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStager")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl CudaStager {
    /// A stager on device `ordinal`; [`CompressionError::NoCudaDevice`] (saying why) without
    /// a driver or device.
    pub fn new(ordinal: usize) -> Result<Self, CompressionError> {
        let ctx = context(ordinal)?;
        let stream = guarded("creating a stream", || ctx.new_stream())?;
        Ok(CudaStager {
            ctx,
            stream,
            ordinal: ordinal as u32,
            pool: Arc::default(),
        })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The stager's stream: its copies run on it, after work queued there before.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `view` as a segment's device memory. The stager's stream waits for writes to the view
    /// that cudarc tracks on other streams; later writers wait for its reads once the
    /// [`CudaBytes`] is dropped.
    pub fn bytes<'a, T: DeviceRepr>(&'a self, view: &'a CudaView<'a, T>) -> CudaBytes<'a> {
        let len = view.len() * std::mem::size_of::<T>();
        // Work queued before on the view's own stream (where its owner usually writes it)
        // comes first, whether or not cudarc tracks the buffer with events (it does not for
        // buffers made before the context had a second stream). A failure here fails the
        // copies.
        let unordered = guarded("ordering after the buffer's stream", || {
            self.stream.join(view.stream())
        })
        .err()
        .map(|e| e.to_string());
        let (ptr, reads) = view.device_ptr(&self.stream);
        CudaBytes {
            stager: self,
            ptr,
            len,
            nic: None,
            unordered,
            _reads: reads,
            _view: PhantomData,
        }
    }

    pub(super) fn take_staging(&self, len: usize) -> Result<Staging, DeviceError> {
        let mut buf = match take_from_pool(&self.pool, len, PinnedHostSlice::len) {
            Some(buf) => buf,
            None => {
                // Whole powers of two from 64 KiB: a pool of few sizes serves every message.
                let size = len.max(MIN_STAGING).next_power_of_two();
                pinned_zeroed::<u8>(&self.ctx, size).map_err(|e| self.error(e))?
            }
        };
        let ptr = guarded("pinned host memory", || buf.as_mut_ptr()).map_err(|e| self.error(e))?;
        Ok(Staging {
            buf: Some(buf),
            ptr,
            len,
            pool: self.pool.clone(),
        })
    }

    pub(super) fn error(&self, e: impl std::fmt::Display) -> DeviceError {
        DeviceError {
            ordinal: self.ordinal,
            reason: e.to_string(),
        }
    }
}

/// A view of GPU memory that a message can carry (see [`CudaStager::bytes`]).
pub struct CudaBytes<'a> {
    stager: &'a CudaStager,
    ptr: CUdeviceptr,
    len: usize,
    nic: Option<NicRegion>,
    /// Why the stager's stream could not be ordered after the view's, if it could not.
    unordered: Option<String>,
    /// Records the stream's reads of the view when dropped (after every copy was queued).
    _reads: SyncOnDrop<'a>,
    _view: PhantomData<&'a ()>,
}

impl std::fmt::Debug for CudaBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBytes")
            .field("ordinal", &self.stager.ordinal)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("nic", &self.nic)
            .finish()
    }
}

impl CudaBytes<'_> {
    /// The same, inside a region registered with the NIC: `nic` names the registration and
    /// its first byte, `region_len` its length (`VerbsTransport::nic_region` and the region's
    /// length). An RDMA transport then lets the NIC read this view in place. The NIC does not
    /// follow CUDA streams, so this waits for the work queued before on the stager's stream
    /// (which waits for the view's tracked writes). An error if the view leaves the region.
    pub fn with_nic(mut self, nic: NicRegion, region_len: usize) -> Result<Self, DeviceError> {
        if let Some(why) = &self.unordered {
            return Err(self.stager.error(why));
        }
        let start = self.ptr;
        let inside = start >= nic.addr
            && (start - nic.addr)
                .checked_add(self.len as u64)
                .is_some_and(|end| end <= region_len as u64);
        if !inside {
            return Err(self.stager.error(format!(
                "the view at {start:#x} ({} bytes) is not inside the registered region at {:#x} ({region_len} bytes)",
                self.len, nic.addr
            )));
        }
        guarded("synchronize", || self.stager.stream.synchronize())
            .map_err(|e| self.stager.error(e))?;
        self.nic = Some(NicRegion {
            key: nic.key,
            addr: start,
        });
        Ok(self)
    }
}

impl DeviceBytes for CudaBytes<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn ordinal(&self) -> u32 {
        self.stager.ordinal
    }

    fn nic(&self) -> Option<NicRegion> {
        self.nic
    }

    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        Ok(Box::new(self.stager.take_staging(len)?))
    }

    fn copy_to_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_> {
        if let Some(why) = &self.unordered {
            return Box::pin(std::future::ready(Err(self.stager.error(why))));
        }
        AsyncCopy::boxed(
            self.stager,
            Direction::ToHost,
            (self.ptr, self.len),
            offset,
            len,
            buf,
        )
    }
}

/// Which way an [`AsyncCopy`] moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Direction {
    /// Device memory into the staging buffer (a send).
    ToHost,
    /// The staging buffer into device memory (a placed receive).
    ToDevice,
}

/// One copy between device memory and a staging buffer the copy owns: queued on the
/// stager's stream on first poll, done when its event fires, then the buffer is given back.
/// Dropped while in flight, it waits for the copy before the buffer goes; leaked, the buffer
/// is never freed. Either way the device never touches host memory that someone else owns.
/// The device memory is borrowed from its owner for `'b` (a view, or a landing that waits
/// for its stager's stream before its memory is reused).
pub(super) struct AsyncCopy<'b> {
    stager: &'b CudaStager,
    direction: Direction,
    /// The device range's first byte, and its length.
    device: (CUdeviceptr, usize),
    offset: usize,
    len: usize,
    buf: Option<StagingBuf>,
    event: Option<CudaEvent>,
}

impl<'b> AsyncCopy<'b> {
    /// The copy of `len` bytes at `offset` of the device range `device` (its first byte and
    /// length), which stays allocated for `'b`, as a transport's copy future.
    pub(super) fn boxed(
        stager: &'b CudaStager,
        direction: Direction,
        device: (CUdeviceptr, usize),
        offset: usize,
        len: usize,
        buf: StagingBuf,
    ) -> CopyFuture<'b> {
        Box::pin(AsyncCopy {
            stager,
            direction,
            device,
            offset,
            len,
            buf: Some(buf),
            event: None,
        })
    }

    fn start(&mut self) -> Result<(), DeviceError> {
        let stager = self.stager;
        let (offset, len) = (self.offset, self.len);
        let (base, extent) = self.device;
        let Some(buf) = self.buf.as_mut() else {
            return Err(stager.error("copy polled after it completed"));
        };
        if offset.checked_add(len).is_none_or(|end| end > extent) || len > buf.len() {
            return Err(stager.error(format!(
                "copy of {len} bytes at {offset} past the region's {extent} (or the buffer's {})",
                buf.len()
            )));
        }
        guarded("binding the context", || stager.ctx.bind_to_thread())
            .map_err(|e| stager.error(e))?;
        let device = base + offset as u64;
        let stream = stager.stream.cu_stream();
        let host = &mut buf[..len];
        let queued = match self.direction {
            // SAFETY: `device..device + len` lies inside the range (checked above), which its
            // owner keeps allocated for `'b`, the life of this copy. `host` is inside the
            // buffer this future owns: it is not freed or handed out before the copy ends
            // (`Drop` waits for it; a leaked future never frees it).
            Direction::ToHost => guarded("copy to host", || unsafe {
                result::memcpy_dtoh_async(host, device, stream)
            }),
            // SAFETY: as above, with the bytes going the other way.
            Direction::ToDevice => guarded("copy to device", || unsafe {
                result::memcpy_htod_async(device, host, stream)
            }),
        };
        queued.map_err(|e| stager.error(e))?;
        match guarded("recording an event", || stager.stream.record_event(None)) {
            Ok(event) => {
                self.event = Some(event);
                Ok(())
            }
            Err(e) => {
                // No event to wait on: wait for the stream before the buffer can go.
                let _ = stager.stream.synchronize();
                Err(stager.error(e))
            }
        }
    }
}

impl Future for AsyncCopy<'_> {
    type Output = Result<StagingBuf, DeviceError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let stager = self.stager;
        if self.len == 0 {
            return Poll::Ready(self.buf.take().ok_or_else(|| stager.error("polled again")));
        }
        if self.event.is_none() {
            if let Err(e) = self.start() {
                return Poll::Ready(Err(e));
            }
        }
        let Some(event) = &self.event else {
            unreachable!("set by start")
        };
        // SAFETY: the event is live (owned here) and was recorded on the stager's stream.
        match unsafe { result::event::query(event.cu_event()) } {
            Ok(()) => {
                self.event = None;
                Poll::Ready(self.buf.take().ok_or_else(|| stager.error("polled again")))
            }
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Err(e) => {
                // The copy failed; wait for the stream before the buffer can go.
                let _ = event.synchronize();
                self.event = None;
                let what = match self.direction {
                    Direction::ToHost => "copy to host",
                    Direction::ToDevice => "copy to device",
                };
                Poll::Ready(Err(stager.error(format!("{what}: {e}"))))
            }
        }
    }
}

impl Drop for AsyncCopy<'_> {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            // The copy may still use the buffer: wait for it before the buffer goes.
            let _ = event.synchronize();
        }
    }
}

/// A page-locked staging buffer, back to its stager's pool when dropped.
pub(super) struct Staging {
    buf: Option<PinnedHostSlice<u8>>,
    ptr: *mut u8,
    len: usize,
    pool: Arc<Mutex<Vec<PinnedHostSlice<u8>>>>,
}

// SAFETY: `ptr` points into `buf`, which this struct owns; the pinned allocation may be used
// from any thread.
unsafe impl Send for Staging {}
// SAFETY: shared access only reads through `ptr`.
unsafe impl Sync for Staging {}

impl Deref for Staging {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is the start of `buf`'s allocation of at least `len` bytes, alive
        // while `buf` is; copies into it are awaited before the pipeline reads it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for Staging {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            keep_in_pool(&self.pool, buf, POOL_MAX, PinnedHostSlice::len);
        }
    }
}

/// The smallest item of `pool` holding `len` bytes, taken out of it: the large ones stay for
/// large messages.
pub(super) fn take_from_pool<T>(
    pool: &Mutex<Vec<T>>,
    len: usize,
    size: fn(&T) -> usize,
) -> Option<T> {
    let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
    let at = (0..pool.len())
        .filter(|&i| size(&pool[i]) >= len)
        .min_by_key(|&i| size(&pool[i]));
    at.map(|i| pool.swap_remove(i))
}

/// Keeps `item` in `pool` for reuse: at most `max` items, the largest ones (large messages
/// need them; small ones fit any).
pub(super) fn keep_in_pool<T>(pool: &Mutex<Vec<T>>, item: T, max: usize, len: fn(&T) -> usize) {
    let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
    if pool.len() < max {
        pool.push(item);
    } else if let Some(smallest) = (0..pool.len()).min_by_key(|&i| len(&pool[i])) {
        if len(&pool[smallest]) < len(&item) {
            pool[smallest] = item;
        }
    }
}

/// Waits for a stream's queued work when dropped: a call abandoned half-way (its future
/// dropped) leaves no copy running into memory that is then freed, reused or given back to
/// its owner.
#[must_use = "the wait happens when this is dropped"]
pub struct WaitOnDrop(pub Arc<CudaStream>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        let _ = guarded("synchronize", || self.0.synchronize());
    }
}
