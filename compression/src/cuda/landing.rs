//! Device memory that received messages are placed into ([`DeviceDest`]): the receive side
//! of [`super::CudaStager`].
//!
//! [`CudaLandings`] hands out [`CudaLanding`]s: device allocations kept in a pool between
//! calls, written by the transport chunk by chunk from page-locked staging buffers
//! (`cuMemcpyHtoDAsync` on the landings' own stream, so copies in run beside the stager's
//! copies out). Once the message is delivered its bytes are on the device, and a kernel
//! reads them from [`CudaLanding::view`] (the reduction of a received piece).

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr};
use psnet_transport::device::{CopyFuture, DeviceError, StagingBuf};
use psnet_transport::DeviceDest;

use super::guarded;
use super::staging::{AsyncCopy, Direction};
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
        let pooled = {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            let at = (0..pool.len())
                .filter(|&i| pool[i].len() >= len)
                .min_by_key(|&i| pool[i].len());
            at.map(|i| pool.swap_remove(i))
        };
        let mem = match pooled {
            Some(mem) => mem,
            None => {
                let stream = self.stager.stream();
                guarded("allocating device memory for received pieces", || {
                    stream.alloc_zeros::<u8>(len.max(1).next_power_of_two())
                })?
            }
        };
        // Taken once: the copies in address the memory by pointer, and the kernel that reads
        // it runs after they completed (the message is delivered only then).
        let ptr = {
            let (ptr, _recorded) = mem.device_ptr(self.stager.stream());
            ptr
        };
        Ok(Arc::new(CudaLanding {
            mem: Some(mem),
            ptr,
            len,
            stager: self.stager.clone(),
            pool: self.pool.clone(),
        }))
    }
}

/// `len` bytes of device memory a transport places a received segment into (see
/// [`CudaLandings`]). Dropped, it waits for the copies queued into it, then goes back to the
/// pool.
pub struct CudaLanding {
    mem: Option<CudaSlice<u8>>,
    /// `mem`'s first byte.
    ptr: CUdeviceptr,
    len: usize,
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
        AsyncCopy::boxed(
            &self.stager,
            Direction::ToDevice,
            (self.ptr, self.len),
            offset,
            len,
            buf,
        )
    }
}

impl Drop for CudaLanding {
    fn drop(&mut self) {
        // A copy whose future was leaked may still be writing: none may reach the memory
        // once someone else has it.
        let _ = self.stager.stream().synchronize();
        if let Some(mem) = self.mem.take() {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < POOL_MAX {
                pool.push(mem);
            } else if let Some(smallest) = (0..pool.len()).min_by_key(|&i| pool[i].len()) {
                if pool[smallest].len() < mem.len() {
                    pool[smallest] = mem;
                }
            }
        }
    }
}
