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

impl VerbsTransport {
    /// Lets peers' NICs write received segments straight into `region` (GPUDirect RDMA
    /// receive): a placer whose destination reports the returned [`NicRegion`] (or a part of
    /// it: the key and an address inside) from [`DeviceDest::nic`] gets such segments written
    /// there with no copy, flushed to the GPU before the message is delivered. The transport
    /// keeps only weak references: once `region` is dropped, segments placed in its memory
    /// are copied in instead, and a write on its way then fails (the registration goes first)
    /// and its link with it. Drop the region only once its receives ended.
    ///
    /// `region` must be registered with this transport ([`VerbsTransport::register_gpu`]).
    /// The placer must not name memory that a receive under way is already being written
    /// into (two writes would interleave); each receive holds its destination until it lands.
    ///
    /// None on the staged path (the registration covers a host buffer, not the GPU memory)
    /// or where the driver cannot flush such writes (CUDA older than 11.3).
    ///
    /// [`NicRegion`]: psnet_transport::device::NicRegion
    /// [`DeviceDest::nic`]: psnet_transport::DeviceDest::nic
    pub fn accept_writes(
        &self,
        region: &std::sync::Arc<GpuRegion>,
    ) -> Option<psnet_transport::device::NicRegion> {
        if !region.path().is_direct() || !region.can_flush_nic_writes() {
            return None;
        }
        let weak: std::sync::Weak<dyn crate::landing::NicTarget> =
            std::sync::Arc::downgrade(region) as std::sync::Weak<GpuRegion>;
        Some(self.inner.landings.accept(region.lkey(), weak))
    }
}
