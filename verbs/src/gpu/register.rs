//! Registering one GPU buffer: probe the host, plan the paths, try them in order, and keep
//! what the winning registration needs.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionError};

use super::driver::{page_size, Context, Driver, PinnedHost};
use super::path::{
    check_pointer, check_range, dmabuf_layout, first_success, plan, GpuPath, Mode, PointerAttrs,
    Probe,
};
use super::GpuError;
use crate::device::Device;
use crate::memory;
use crate::transport::VerbsTransport;

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
    // Drop order: the NIC registration first, then what it covers (the dma-buf descriptor,
    // closed only after deregistration; or the staging buffer).
    mr: Arc<MemoryRegion>,
    backing: Backing,
    path: GpuPath,
    device_ptr: u64,
    len: usize,
    addr: u64,
    ctx: Context,
    driver: &'static Driver,
}

enum Backing {
    DmaBuf { _fd: OwnedFd },
    PeerMem,
    Staged(PinnedHost),
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRegion")
            .field("path", &self.path)
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr))
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
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
        self.mr.lkey()
    }

    /// Remote key a peer writes with.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The address the NIC uses for the first byte: the device address on direct paths, the
    /// staging buffer's on [`GpuPath::Staged`].
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: registration refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU buffer's device address.
    pub fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    /// Copies the whole GPU buffer into the staging buffer (before the NIC reads it).
    pub fn copy_from_device(&self) -> Result<(), GpuError> {
        self.copy_from_device_range(0, self.len)
    }

    /// Copies the staging buffer into the whole GPU buffer (after the NIC wrote it).
    pub fn copy_to_device(&self) -> Result<(), GpuError> {
        self.copy_to_device_range(0, self.len)
    }

    /// Copies bytes `[at, at + len)` of the GPU buffer into the same bytes of the staging
    /// buffer; nothing on direct paths. Call only while no work request uses those bytes.
    pub fn copy_from_device_range(&self, at: usize, len: usize) -> Result<(), GpuError> {
        let Some((host, device)) = self.staged_span(at, len)? else {
            return Ok(());
        };
        // SAFETY: `staged_span` checked `[at, at + len)` against the staging buffer, which
        // this region owns and of which no Rust reference exists; the device range lies in
        // the buffer `register_gpu`'s caller keeps allocated while this region lives.
        unsafe { self.driver.copy_dtoh(self.ctx, host, device, len) }
    }

    /// Copies bytes `[at, at + len)` of the staging buffer into the same bytes of the GPU
    /// buffer; nothing on direct paths. Call only once the NIC's write of them completed.
    pub fn copy_to_device_range(&self, at: usize, len: usize) -> Result<(), GpuError> {
        let Some((host, device)) = self.staged_span(at, len)? else {
            return Ok(());
        };
        // SAFETY: as in `copy_from_device_range`, reading the staging buffer instead.
        unsafe { self.driver.copy_htod(self.ctx, device, host, len) }
    }

    /// The staging and device addresses of `[at, at + len)`, checked against the region;
    /// `None` when there is nothing to copy (a direct path, or no bytes).
    fn staged_span(&self, at: usize, len: usize) -> Result<Option<(*mut u8, u64)>, GpuError> {
        check_range(at, len, self.len)?;
        match &self.backing {
            Backing::Staged(host) if len > 0 => Ok(Some((
                host.as_ptr().wrapping_add(at),
                self.device_ptr + at as u64,
            ))),
            _ => Ok(None),
        }
    }
}

/// A registration, what keeps it valid, and the address the NIC uses.
type Registered = (Arc<MemoryRegion>, Backing, u64);

fn verbs_error(call: &str, e: &RegisterMemoryRegionError) -> GpuError {
    let cause = std::error::Error::source(e)
        .map(|c| format!(": {c}"))
        .unwrap_or_default();
    GpuError::Registration(format!("{call} failed{cause}"))
}

fn reg_dmabuf(
    driver: &'static Driver,
    dev: &Device,
    ctx: Context,
    attrs: &PointerAttrs,
    ptr: u64,
    len: usize,
) -> Result<Registered, GpuError> {
    let layout = dmabuf_layout(attrs.base, attrs.size, ptr, len as u64, page_size() as u64)
        .ok_or_else(|| {
            GpuError::BadPointer(format!("[{ptr:#x}, +{len}) overflows the address space"))
        })?;
    let fd = driver.export_dmabuf(ctx, layout.export_start, layout.export_len)?;
    let reg_len = usize::try_from(layout.reg_len)
        .map_err(|_| GpuError::Registration("range too large".into()))?;
    // SAFETY: `fd` is a dma-buf just exported for `[export_start, + export_len)`, and
    // `[offset, offset + reg_len)` lies inside it (`dmabuf_layout`). The GPU memory stays
    // allocated while the registration lives (`register_gpu`'s contract) and the descriptor
    // is closed only after deregistration (`GpuRegion`'s field order).
    let mr = unsafe {
        dev.pd.reg_dmabuf_mr(
            layout.offset,
            reg_len,
            layout.iova,
            fd.as_raw_fd(),
            memory::access(),
        )
    }
    .map_err(|e| {
        verbs_error(
            "ibv_reg_dmabuf_mr (needs rdma-core 34+ and Linux 5.12+)",
            &e,
        )
    })?;
    Ok((mr, Backing::DmaBuf { _fd: fd }, ptr))
}

fn reg_peermem(dev: &Device, ptr: u64, len: usize) -> Result<Registered, GpuError> {
    let addr = usize::try_from(ptr)
        .map_err(|_| GpuError::BadPointer(format!("{ptr:#x} does not fit an address")))?;
    // SAFETY: `[ptr, ptr + len)` is device memory inside one allocation (checked) that stays
    // allocated while the registration lives (`register_gpu`'s contract); nvidia-peermem pins
    // the GPU pages behind it, and the CPU never dereferences the address.
    let mr = unsafe { dev.pd.reg_mr(addr, len, memory::access()) }
        .map_err(|e| verbs_error("ibv_reg_mr on GPU memory (nvidia-peermem)", &e))?;
    Ok((mr, Backing::PeerMem, ptr))
}

fn reg_staged(
    driver: &'static Driver,
    dev: &Device,
    ctx: Context,
    len: usize,
) -> Result<Registered, GpuError> {
    let host = PinnedHost::new(driver, ctx, len)?;
    // SAFETY: the staging buffer (at least `len` bytes) is owned by the region and freed only
    // after the registration is dropped (`GpuRegion`'s field order).
    let mr = unsafe { memory::register(&dev.pd, host.as_ptr(), len) }
        .map_err(|e| GpuError::Registration(e.to_string()))?;
    let addr = host.as_ptr() as u64;
    Ok((mr, Backing::Staged(host), addr))
}

/// Registers the GPU buffer `[ptr, ptr + len)` with `dev`'s protection domain, by the first
/// path that works (see the [module docs](super)); the path taken is logged.
///
/// Errors: [`GpuError::NoDriver`] / [`GpuError::NoDevice`] without a GPU,
/// [`GpuError::BadPointer`] for memory that is not plain device memory or a range leaving its
/// allocation, [`GpuError::Disabled`] / [`GpuError::BadSetting`] from `PSNET_GPUDIRECT`,
/// [`GpuError::Registration`] when every allowed path failed (each reason listed).
///
/// # Safety
/// The device memory must stay allocated, and its CUDA context alive, for as long as the
/// returned region lives: the NIC may access it until the region is dropped.
pub unsafe fn register_gpu(dev: &Device, ptr: u64, len: usize) -> Result<GpuRegion, GpuError> {
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
    let (path, (mr, backing, addr)) = first_success(&plan.tries, |path| match path {
        GpuPath::DmaBuf => reg_dmabuf(driver, dev, ctx, &attrs, ptr, len),
        GpuPath::PeerMem => reg_peermem(dev, ptr, len),
        GpuPath::Staged => reg_staged(driver, dev, ctx, len),
    })?;
    let region = GpuRegion {
        mr,
        backing,
        path,
        device_ptr: ptr,
        len,
        addr,
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

impl VerbsTransport {
    /// Registers the GPU buffer `[ptr, ptr + len)` with this transport's device: see
    /// [`register_gpu`].
    ///
    /// # Safety
    /// As [`register_gpu`]: the device memory stays allocated while the region lives.
    pub unsafe fn register_gpu(&self, ptr: u64, len: usize) -> Result<GpuRegion, GpuError> {
        // SAFETY: forwarded from the caller.
        unsafe { register_gpu(self.device(), ptr, len) }
    }
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
