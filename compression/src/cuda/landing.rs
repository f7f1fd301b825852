//! Device memory that received messages are placed into ([`DeviceDest`]): the receive side
//! of [`super::CudaStager`].
//!
//! [`CudaLandings`] hands out [`CudaLanding`]s: device allocations kept in a pool between
//! calls, written by the transport chunk by chunk from page-locked staging buffers
//! (`cuMemcpyHtoDAsync` on the landings' own stream, so copies in run beside the stager's
//! copies out). Once the message is delivered its bytes are on the device, and a kernel
//! reads them from [`CudaLanding::view`] (the reduction of a received piece).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr};
use psnet_transport::device::{CopyFuture, DeviceError, StagingBuf};
use psnet_transport::DeviceDest;

use super::guarded;
use super::staging::{keep_in_pool, take_from_pool, AsyncCopy, Direction};
use super::CudaStager;
use crate::error::CompressionError;

/// Allocations kept for reuse, at most this many (the largest are kept).
const POOL_MAX: usize = 8;

/// Device memory for received pieces on one device: a stream and staging buffers of their
/// own, and a pool of allocations kept between calls.
#[derive(Debug)]
pub struct CudaLandings {
    stager: Arc<CudaStager>,
    pool: Arc<Mutex<Vec<CudaSlice<u8>>>>,
}

impl CudaLandings {
    /// Landings on device `ordinal`; [`CompressionError::NoCudaDevice`] (saying why) without
    /// a driver or device.
    pub fn new(ordinal: usize) -> Result<Self, CompressionError> {
        Ok(CudaLandings {
            stager: Arc::new(CudaStager::new(ordinal)?),
            pool: Arc::default(),
        })
    }

    /// A landing of `len` bytes: the smallest pooled allocation that holds it, or a new one
    /// (whole powers of two, so a pool of few sizes serves every message).
    pub fn take(&self, len: usize) -> Result<Arc<CudaLanding>, CompressionError> {
        let mem = match take_from_pool(&self.pool, len, CudaSlice::len) {
            Some(mem) => mem,
            None => {
                let size = len
                    .max(1)
                    .checked_next_power_of_two()
                    .ok_or_else(|| CompressionError::Cuda(format!("a landing of {len} bytes")))?;
                let stream = self.stager.stream();
                guarded("allocating device memory for received pieces", || {
                    stream.alloc_zeros::<u8>(size)
                })?
            }
        };
        // Taken once: the copies in address the memory by pointer, untracked by cudarc's
        // events. That is sound because a kernel reads the landing only after the message
        // was delivered, which happens once every copy's event has fired, and the reader
        // waits for its kernel before the landing can be dropped and reused.
        let ptr = {
            let (ptr, _recorded) = mem.device_ptr(self.stager.stream());
            ptr
        };
        Ok(Arc::new(CudaLanding {
            mem: Some(mem),
            ptr,
            len,
            in_flight: Arc::default(),
            stager: self.stager.clone(),
            pool: self.pool.clone(),
        }))
    }
}

/// `len` bytes of device memory a transport places a received segment into (see
/// [`CudaLandings`]). Dropped, it goes back to the pool (after waiting for the stream if a
/// copy's future was leaked while the copy ran).
pub struct CudaLanding {
    mem: Option<CudaSlice<u8>>,
    /// `mem`'s first byte.
    ptr: CUdeviceptr,
    len: usize,
    /// Copies in whose futures have not ended (completed or dropped): more than zero at
    /// drop only if one was leaked, which may still be writing.
    in_flight: Arc<AtomicUsize>,
    stager: Arc<CudaStager>,
    pool: Arc<Mutex<Vec<CudaSlice<u8>>>>,
}

impl std::fmt::Debug for CudaLanding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLanding")
            .field("ordinal", &self.stager.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl CudaLanding {
    /// The landing's bytes, for a kernel to read once the message holding them has been
    /// delivered (its copies are done by then).
    pub fn view(&self) -> Result<CudaView<'_, u8>, CompressionError> {
        match &self.mem {
            Some(mem) => Ok(mem.slice(..self.len)),
            None => Err(CompressionError::Cuda(
                "a landing used after it was dropped".into(),
            )),
        }
    }
}

impl DeviceDest for CudaLanding {
    fn len(&self) -> usize {
        self.len
    }

    fn ordinal(&self) -> u32 {
        self.stager.ordinal()
    }

    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        Ok(Box::new(self.stager.take_staging(len)?))
    }

    fn copy_from_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_> {
        let copy = AsyncCopy::boxed(
            &self.stager,
            Direction::ToDevice,
            (self.ptr, self.len),
            offset,
            len,
            buf,
        );
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Box::pin(Counted {
            copy,
            in_flight: &self.in_flight,
        })
    }
}

/// A copy in, counted in its landing's `in_flight` until its future ends.
struct Counted<'l> {
    copy: CopyFuture<'l>,
    in_flight: &'l AtomicUsize,
}

impl Future for Counted<'_> {
    type Output = Result<StagingBuf, DeviceError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.copy.as_mut().poll(cx)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        // Completed, or dropped (the copy's own drop then waits for a copy still running,
        // before the landing, which this borrows, can go).
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for CudaLanding {
    fn drop(&mut self) {
        // A copy whose future was leaked may still be writing: none may reach the memory
        // once someone else has it. (Copies whose futures ended are done.)
        if self.in_flight.load(Ordering::Acquire) > 0 {
            let _ = self.stager.stream().synchronize();
        }
        if let Some(mem) = self.mem.take() {
            keep_in_pool(&self.pool, mem, POOL_MAX, CudaSlice::len);
        }
    }
}
