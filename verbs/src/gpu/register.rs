//! Registering one GPU buffer: probe the host, plan the paths, try them in order, and keep
//! what the winning registration needs; and the public entry point, [`register_gpu`], whose
//! caller vouches for the device memory. The registrations themselves are `sys::gpu`'s.

use std::path::Path;

use crate::device::Device;
use crate::error::gpu::GpuError;
use crate::gpu_path::{check_pointer, first_success, plan, GpuPath, Mode, Probe};
use crate::sys::cuda::{Context, Driver};
use crate::sys::gpu::{DeviceRange, Registration};

/// Files whose presence under `/` shows a peer-memory client for NVIDIA GPUs: the
/// `nvidia-peermem` module (driver 470+) or the older `nv_peer_mem`.
const PEERMEM_MARKERS: [&str; 3] = [
    "sys/module/nvidia_peermem",
    "sys/module/nv_peer_mem",
    "sys/kernel/mm/memory_peers/nv_mem",
];

/// Whether a peer-memory module is loaded, looking under `root` instead of `/`.
pub fn peermem_loaded_under(root: &Path) -> bool {
    PEERMEM_MARKERS.iter().any(|m| root.join(m).exists())
}

/// Whether the `nvidia-peermem` (or `nv_peer_mem`) kernel module is loaded.
pub fn peermem_loaded() -> bool {
    peermem_loaded_under(Path::new("/"))
}

/// A GPU buffer registered with the NIC.
///
/// Work requests use [`addr`](Self::addr) with [`lkey`](Self::lkey) locally, and a peer
/// writes to it with [`rkey`](Self::rkey). On the direct paths that is the GPU memory itself;
/// on [`GpuPath::Staged`] it is a pinned host buffer, filled from the GPU with
/// [`copy_from_device`](Self::copy_from_device) before a send and copied back with
/// [`copy_to_device`](Self::copy_to_device) after a receive (both do nothing on direct
/// paths, so callers may call them unconditionally).
pub struct GpuRegion {
    registration: Registration,
    path: GpuPath,
    device: DeviceRange,
    ctx: Context,
    driver: &'static Driver,
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRegion")
            .field("path", &self.path)
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl GpuRegion {
    /// How the NIC reaches the buffer.
    pub fn path(&self) -> GpuPath {
        self.path
    }

    /// Local key for work requests.
    pub fn lkey(&self) -> u32 {
        self.registration.lkey()
    }

    /// Remote key a peer writes with.
    pub fn rkey(&self) -> u32 {
        self.registration.rkey()
    }

    /// The address the NIC uses for the first byte: the device address on direct paths, the
    /// staging buffer's on [`GpuPath::Staged`].
    pub fn addr(&self) -> u64 {
        self.registration.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.device.len()
    }

    /// Whether the region is empty (never: registration refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The GPU buffer's device address.
    pub fn device_ptr(&self) -> u64 {
        self.device.ptr()
    }

    /// Copies the whole GPU buffer into the staging buffer (before the NIC reads it).
    pub fn copy_from_device(&self) -> Result<(), GpuError> {
        self.copy_from_device_range(0, self.len())
    }

    /// Copies the staging buffer into the whole GPU buffer (after the NIC wrote it).
    pub fn copy_to_device(&self) -> Result<(), GpuError> {
        self.copy_to_device_range(0, self.len())
    }

    /// Copies bytes `[at, at + len)` of the GPU buffer into the same bytes of the staging
    /// buffer; nothing on direct paths. Call only while no work request uses those bytes.
    pub fn copy_from_device_range(&self, at: usize, len: usize) -> Result<(), GpuError> {
        self.registration
            .copy_from_device(self.driver, self.ctx, self.device, at, len)
    }

    /// Makes a peer's RDMA writes into the GPU memory (a direct path) visible to kernels
    /// launched from now on: call once the write landed (see [`Driver::flush_writes`]).
    pub fn flush_nic_writes(&self) -> Result<(), GpuError> {
        self.driver.flush_writes(self.ctx)
    }

    /// Whether [`GpuRegion::flush_nic_writes`] can work: peers may write this region.
    pub fn can_flush_nic_writes(&self) -> bool {
        self.driver.can_flush_writes()
    }

    /// Copies bytes `[at, at + len)` of the staging buffer into the same bytes of the GPU
    /// buffer; nothing on direct paths. Call only once the NIC's write of them completed.
    pub fn copy_to_device_range(&self, at: usize, len: usize) -> Result<(), GpuError> {
        self.registration
            .copy_to_device(self.driver, self.ctx, self.device, at, len)
    }
}

/// Registers the GPU buffer `range` with `dev`'s protection domain, by the first
/// path that works (see the [module docs](crate::gpu)); the path taken is logged.
///
/// Errors: [`GpuError::NoDriver`] / [`GpuError::NoDevice`] without a GPU,
/// [`GpuError::BadPointer`] for memory that is not plain device memory or a range leaving its
/// allocation, [`GpuError::Disabled`] / [`GpuError::BadSetting`] from `PSNET_GPUDIRECT`,
/// [`GpuError::Registration`] when every allowed path failed (each reason listed).
///
/// The memory stays allocated, and its CUDA context alive, while the region lives: the
/// caller promised so when it made `range` ([`DeviceRange::promised`], the one `unsafe` step).
pub fn register_gpu(dev: &Device, range: DeviceRange) -> Result<GpuRegion, GpuError> {
    register(dev, range)
}

/// [`register_gpu`] once its caller has vouched for `device`.
fn register(dev: &Device, device: DeviceRange) -> Result<GpuRegion, GpuError> {
    let (ptr, len) = (device.ptr(), device.len());
    let mode = Mode::from_env()?;
    if mode == Mode::Off {
        return Err(GpuError::Disabled);
    }
    let driver = Driver::load()?;
    let (attrs, ctx) = driver.pointer(ptr)?;
    check_pointer(&attrs, ptr, len)?;
    let dmabuf = driver.dmabuf_supported(attrs.ordinal).unwrap_or_else(|e| {
        tracing::debug!(error = %e, "dma-buf support unknown; treating it as absent");
        false
    });
    let probe = Probe {
        dmabuf,
        peermem: peermem_loaded(),
    };
    let plan = plan(mode, probe)?;
    for (path, reason) in &plan.skipped {
        tracing::info!(path = %path, reason, "GPU registration path not tried");
    }
    let (path, registration) = first_success(&plan.tries, |path| match path {
        GpuPath::DmaBuf => Registration::dmabuf(driver, &dev.pd, ctx, &attrs, device),
        GpuPath::PeerMem => Registration::peermem(&dev.pd, device),
        GpuPath::Staged => Registration::staged(driver, &dev.pd, ctx, len),
    })?;
    let region = GpuRegion {
        registration,
        path,
        device,
        ctx,
        driver,
    };
    tracing::info!(
        path = %path,
        device = %dev.name,
        gpu = attrs.ordinal,
        ptr = %format_args!("{ptr:#x}"),
        len,
        lkey = region.lkey(),
        "GPU buffer registered with the NIC ({path})"
    );
    Ok(region)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peermem_detection_reads_the_module_markers() {
        let root = tempfile::tempdir().unwrap();
        assert!(!peermem_loaded_under(root.path()));
        std::fs::create_dir_all(root.path().join("sys/module/nvidia")).unwrap();
        assert!(
            !peermem_loaded_under(root.path()),
            "the GPU driver alone is not peermem"
        );
        std::fs::create_dir_all(root.path().join("sys/module/nvidia_peermem")).unwrap();
        assert!(peermem_loaded_under(root.path()));

        let legacy = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(legacy.path().join("sys/kernel/mm/memory_peers/nv_mem")).unwrap();
        assert!(peermem_loaded_under(legacy.path()));
    }
}
