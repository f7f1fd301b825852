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
    result, CudaContext, CudaEvent, CudaStream, CudaView, DevicePtr, DeviceRepr, PinnedHostSlice,
    SyncOnDrop,
};
use psnet_transport::device::{CopyFuture, DeviceBytes, DeviceError, NicRegion, StagingBuf};

use super::{context, guarded, pinned_zeroed};
use crate::error::CompressionError;

/// Staging buffers kept for reuse, at most this many.
const POOL_MAX: usize = 4;

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

    /// The stager's stream: its copies run on it, after work queued there before.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `view` as a segment's device memory. The stager's stream waits for writes to the view
    /// that cudarc tracks on other streams; later writers wait for its reads once the
    /// [`CudaBytes`] is dropped.
    pub fn bytes<'a, T: DeviceRepr>(&'a self, view: &'a CudaView<'a, T>) -> CudaBytes<'a> {
        let len = view.len() * std::mem::size_of::<T>();
        let (ptr, reads) = view.device_ptr(&self.stream);
        CudaBytes {
            stager: self,
            ptr,
            len,
            nic: None,
            _reads: reads,
            _view: PhantomData,
        }
    }

    fn take_staging(&self, len: usize) -> Result<Staging, DeviceError> {
        let pooled = {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            let at = pool.iter().position(|b| b.len() >= len);
            at.map(|i| pool.swap_remove(i))
        };
        let mut buf = match pooled {
            Some(buf) => buf,
            None => pinned_zeroed::<u8>(&self.ctx, len).map_err(|e| self.error(e))?,
        };
        let ptr = guarded("pinned host memory", || buf.as_mut_ptr()).map_err(|e| self.error(e))?;
        Ok(Staging {
            buf: Some(buf),
            ptr,
            len,
            pool: self.pool.clone(),
        })
    }

    fn error(&self, e: impl std::fmt::Display) -> DeviceError {
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
    /// The same, registered with the NIC as `nic` (an RDMA transport then lets the NIC read
    /// it in place). `nic` must cover this view's memory.
    pub fn with_nic(mut self, nic: NicRegion) -> Self {
        self.nic = Some(nic);
        self
    }
}

// SAFETY: the struct holds a device address (a number), a shared reference to the stager and
// cudarc's read marker, which only records an event on the stager's stream when dropped;
// cudarc's streams and events are usable from any thread (the context is bound per call).
unsafe impl Send for CudaBytes<'_> {}
// SAFETY: as above; no method mutates the struct through a shared reference.
unsafe impl Sync for CudaBytes<'_> {}

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

    fn copy_to_host<'b>(&'b self, offset: usize, dst: &'b mut [u8]) -> CopyFuture<'b> {
        Box::pin(CopyOut {
            bytes: self,
            offset,
            dst,
            event: None,
        })
    }
}

/// One copy out of the device: queued on first poll, done when its event fires. Dropped while
/// in flight, it waits for the copy (the destination is borrowed only as long as it lives).
struct CopyOut<'b> {
    bytes: &'b CudaBytes<'b>,
    offset: usize,
    dst: &'b mut [u8],
    event: Option<CudaEvent>,
}

// SAFETY: the event is only queried or waited on; cudarc's events are usable from any thread.
unsafe impl Send for CopyOut<'_> {}

impl CopyOut<'_> {
    fn start(&mut self) -> Result<(), DeviceError> {
        let bytes = self.bytes;
        let stager = bytes.stager;
        let end = self
            .offset
            .checked_add(self.dst.len())
            .filter(|&e| e <= bytes.len)
            .ok_or_else(|| {
                stager.error(format!(
                    "copy of {} bytes at {} past the region's {}",
                    self.dst.len(),
                    self.offset,
                    bytes.len
                ))
            })?;
        debug_assert!(end <= bytes.len);
        guarded("binding the context", || stager.ctx.bind_to_thread())
            .map_err(|e| stager.error(e))?;
        let src = bytes.ptr + self.offset as u64;
        let stream = stager.stream.cu_stream();
        // SAFETY: `src..src + dst.len()` lies inside the view (checked above), which stays
        // allocated while `CudaBytes` borrows it; `dst` stays borrowed by this future, whose
        // drop waits for the copy, so the device never writes freed host memory.
        guarded("copy to host", || unsafe {
            result::memcpy_dtoh_async(self.dst, src, stream)
        })
        .map_err(|e| stager.error(e))?;
        let event = guarded("recording an event", || stager.stream.record_event(None))
            .map_err(|e| stager.error(e))?;
        self.event = Some(event);
        Ok(())
    }
}

impl Future for CopyOut<'_> {
    type Output = Result<(), DeviceError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        if self.dst.is_empty() {
            return Poll::Ready(Ok(()));
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
                Poll::Ready(Ok(()))
            }
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Err(e) => {
                self.event = None;
                Poll::Ready(Err(self.bytes.stager.error(format!("copy to host: {e}"))))
            }
        }
    }
}

impl Drop for CopyOut<'_> {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            // The copy may still write `dst`: wait for it before the borrow ends.
            let _ = event.synchronize();
        }
    }
}

/// A page-locked staging buffer, back to its stager's pool when dropped.
struct Staging {
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
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < POOL_MAX {
                pool.push(buf);
            }
        }
    }
}
