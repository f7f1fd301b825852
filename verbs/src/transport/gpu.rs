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

impl VerbsTransport {
    /// Where this transport's NIC reads `region` in place, for device segments
    /// (`psnet_transport::device`): the registration's key and the region's first byte. A
    /// segment of the region's memory that carries it is sent zero-copy. None on the staged
    /// path, whose registration covers a host buffer, not the GPU memory.
    pub fn nic_region(&self, region: &GpuRegion) -> Option<psnet_transport::device::NicRegion> {
        region.path().is_direct().then(|| {
            let tag = u64::from(self.inner.registrar.tag);
            psnet_transport::device::NicRegion {
                key: psnet_transport::RegionKey((tag << 32) | u64::from(region.lkey())),
                addr: region.addr(),
            }
        })
    }
}
