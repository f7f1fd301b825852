//! [`VerbsTransport::register_gpu`] (feature `cuda`): `gpu::register_gpu` on the transport's
//! own device.

use crate::gpu::{register_gpu, DeviceRange, GpuError, GpuRegion};
use crate::transport::VerbsTransport;

impl VerbsTransport {
    /// Registers the GPU buffer `range` with this transport's device: see [`register_gpu`].
    pub fn register_gpu(&self, range: DeviceRange) -> Result<GpuRegion, GpuError> {
        register_gpu(self.device(), range)
    }
}
