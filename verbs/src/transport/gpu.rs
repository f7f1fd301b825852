//! [`VerbsTransport::register_gpu`] (feature `cuda`): `gpu::register_gpu` on the transport's
//! own device.

use crate::gpu::{register_gpu, GpuError, GpuRegion};
use crate::transport::VerbsTransport;

impl VerbsTransport {
    /// Registers the GPU buffer `[ptr, ptr + len)` with this transport's device: see
    /// [`register_gpu`].
    ///
    /// # Safety
    /// As [`register_gpu`]: the device memory stays allocated while the region lives.
    // An `unsafe fn` because it forwards `register_gpu`'s promise; it sits here rather than in
    // `sys`, which may not depend on the transport, and does nothing but forward.
    #[allow(unsafe_code)]
    pub unsafe fn register_gpu(&self, ptr: u64, len: usize) -> Result<GpuRegion, GpuError> {
        // SAFETY: forwarded from the caller.
        unsafe { register_gpu(self.device(), ptr, len) }
    }
}
