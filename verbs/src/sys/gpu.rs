//! GPU memory and the NIC (feature `cuda`): the three registrations ([`Registration`]: a
//! dma-buf, nvidia-peermem, a pinned staging buffer), what keeps each valid, the copies
//! through the staging buffer, and [`DeviceRange`], the device memory whose owner promised
//! to keep it allocated (the public entry points, `gpu::register_gpu` and
//! `VerbsTransport::register_gpu`, make that promise `unsafe`). Choosing the path is
//! `gpu::register`'s.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionError};
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::cuda::{Context, Driver, PinnedHost};
use super::memory::{access, register};
use super::os::page_size;
use crate::error::gpu::GpuError;
use crate::gpu_path::{check_range, dmabuf_layout, PointerAttrs};

/// GPU memory whose owner keeps it allocated, with its CUDA context, for as long as a region
/// registered from it lives (`register_gpu` takes one). Only the `unsafe`
/// [`DeviceRange::promised`] makes one: the promise is made once, where the memory is known.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRange {
    ptr: u64,
    len: usize,
}

impl DeviceRange {
    /// The device memory `[ptr, ptr + len)`.
    ///
    /// # Safety
    /// The memory must stay allocated, and its CUDA context alive, for as long as any
    /// registration made from the range lives.
    pub unsafe fn promised(ptr: u64, len: usize) -> DeviceRange {
        DeviceRange { ptr, len }
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A GPU buffer's registration with the NIC and what it covers, dropped in that order: the
/// registration first, then the dma-buf descriptor (closed only after deregistration) or
/// the staging buffer.
pub(crate) struct Registration {
    mr: Arc<MemoryRegion>,
    backing: Backing,
    addr: u64,
}

enum Backing {
    DmaBuf { _fd: OwnedFd },
    PeerMem,
    Staged(PinnedHost),
}

fn verbs_error(call: &str, e: &RegisterMemoryRegionError) -> GpuError {
    let cause = std::error::Error::source(e)
        .map(|c| format!(": {c}"))
        .unwrap_or_default();
    GpuError::Registration(format!("{call} failed{cause}"))
}

impl Registration {
    /// The driver exports the allocation holding `range` as a dma-buf, and the NIC registers
    /// the pages of `range` in it (`ibv_reg_dmabuf_mr`).
    pub(crate) fn dmabuf(
        driver: &'static Driver,
        pd: &Arc<ProtectionDomain>,
        ctx: Context,
        attrs: &PointerAttrs,
        range: DeviceRange,
    ) -> Result<Registration, GpuError> {
        let DeviceRange { ptr, len } = range;
        let layout = dmabuf_layout(attrs.base, attrs.size, ptr, len as u64, page_size() as u64)
            .ok_or_else(|| {
                GpuError::BadPointer(format!("[{ptr:#x}, +{len}) overflows the address space"))
            })?;
        let fd = driver.export_dmabuf(ctx, layout.export_start, layout.export_len)?;
        let reg_len = usize::try_from(layout.reg_len)
            .map_err(|_| GpuError::Registration("range too large".into()))?;
        // SAFETY: `fd` is a dma-buf just exported for `[export_start, + export_len)`, and
        // `[offset, offset + reg_len)` lies inside it (`dmabuf_layout`). The GPU memory stays
        // allocated while the registration lives (`DeviceRange`'s contract) and the descriptor
        // is closed only after deregistration (`Registration`'s field order).
        let mr = unsafe {
            pd.reg_dmabuf_mr(
                layout.offset,
                reg_len,
                layout.iova,
                fd.as_raw_fd(),
                access(),
            )
        }
        .map_err(|e| {
            verbs_error(
                "ibv_reg_dmabuf_mr (needs rdma-core 34+ and Linux 5.12+)",
                &e,
            )
        })?;
        Ok(Registration {
            mr,
            backing: Backing::DmaBuf { _fd: fd },
            addr: ptr,
        })
    }

    /// `ibv_reg_mr` on the device pointer itself, which the `nvidia-peermem` module resolves.
    pub(crate) fn peermem(
        pd: &Arc<ProtectionDomain>,
        range: DeviceRange,
    ) -> Result<Registration, GpuError> {
        let DeviceRange { ptr, len } = range;
        let addr = usize::try_from(ptr)
            .map_err(|_| GpuError::BadPointer(format!("{ptr:#x} does not fit an address")))?;
        // SAFETY: `[ptr, ptr + len)` is device memory inside one allocation (checked) that
        // stays allocated while the registration lives (`DeviceRange`'s contract);
        // nvidia-peermem pins the GPU pages behind it, and the CPU never dereferences it.
        let mr = unsafe { pd.reg_mr(addr, len, access()) }
            .map_err(|e| verbs_error("ibv_reg_mr on GPU memory (nvidia-peermem)", &e))?;
        Ok(Registration {
            mr,
            backing: Backing::PeerMem,
            addr: ptr,
        })
    }

    /// A pinned host buffer of `len` bytes (at least), registered with the NIC.
    pub(crate) fn staged(
        driver: &'static Driver,
        pd: &Arc<ProtectionDomain>,
        ctx: Context,
        len: usize,
    ) -> Result<Registration, GpuError> {
        let host = PinnedHost::new(driver, ctx, len)?;
        // SAFETY: the staging buffer (at least `len` bytes) is owned by the registration and
        // freed only after the NIC registration is dropped (field order).
        let mr = unsafe { register(pd, host.as_ptr(), len) }
            .map_err(|e| GpuError::Registration(e.to_string()))?;
        let addr = host.as_ptr() as u64;
        Ok(Registration {
            mr,
            backing: Backing::Staged(host),
            addr,
        })
    }

    /// Local key.
    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key.
    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The address the NIC uses for the first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// The staging and device addresses of bytes `[at, at + len)` of `device`, checked
    /// against it; `None` when there is nothing to copy (a direct path, or no bytes).
    fn staged_span(
        &self,
        device: DeviceRange,
        at: usize,
        len: usize,
    ) -> Result<Option<(*mut u8, u64)>, GpuError> {
        check_range(at, len, device.len)?;
        match &self.backing {
            Backing::Staged(host) if len > 0 => Ok(Some((
                host.as_ptr().wrapping_add(at),
                device.ptr + at as u64,
            ))),
            _ => Ok(None),
        }
    }

    /// Copies bytes `[at, at + len)` of the GPU buffer `device` (registered as this) into the
    /// same bytes of the staging buffer; nothing on direct paths.
    pub(crate) fn copy_from_device(
        &self,
        driver: &Driver,
        ctx: Context,
        device: DeviceRange,
        at: usize,
        len: usize,
    ) -> Result<(), GpuError> {
        let Some((host, src)) = self.staged_span(device, at, len)? else {
            return Ok(());
        };
        // SAFETY: `staged_span` checked `[at, at + len)` against the GPU buffer, and the
        // staging buffer holds at least as many bytes; it is owned here and no Rust reference
        // into it exists. The device range stays allocated (`DeviceRange`'s contract).
        unsafe { driver.copy_dtoh(ctx, host, src, len) }
    }

    /// Copies bytes `[at, at + len)` of the staging buffer into the same bytes of the GPU
    /// buffer `device` (registered as this); nothing on direct paths.
    pub(crate) fn copy_to_device(
        &self,
        driver: &Driver,
        ctx: Context,
        device: DeviceRange,
        at: usize,
        len: usize,
    ) -> Result<(), GpuError> {
        let Some((host, dst)) = self.staged_span(device, at, len)? else {
            return Ok(());
        };
        // SAFETY: as in `copy_from_device`, reading the staging buffer instead.
        unsafe { driver.copy_htod(ctx, dst, host, len) }
    }
}
