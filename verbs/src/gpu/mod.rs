//! GPUDirect: registering CUDA device memory with the NIC (feature `cuda`).
//!
//! [`register_gpu`] (or [`VerbsTransport::register_gpu`](crate::VerbsTransport::register_gpu))
//! makes a GPU buffer usable in work requests, by the first of these that works:
//!
//! 1. **dma-buf**: the driver exports the allocation as a dma-buf
//!    (`cuMemGetHandleForAddressRange`) and the NIC registers it (`ibv_reg_dmabuf_mr`). Needs
//!    `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (open NVIDIA kernel modules, CUDA 11.7+), Linux
//!    5.12+ and rdma-core 34+.
//! 2. **nvidia-peermem**: `ibv_reg_mr` on the device pointer, resolved by the
//!    `nvidia-peermem` kernel module (detected through `/sys/module/nvidia_peermem`, or the
//!    older `nv_peer_mem`).
//! 3. **staged**: a page-locked (`cuMemHostRegister`) host buffer registered with the NIC; the
//!    caller moves data with [`GpuRegion::copy_from_device`] before sending and
//!    [`GpuRegion::copy_to_device`] after receiving.
//!
//! A direct path whose registration fails at run time falls back to the next one, with a
//! warning saying why; the path taken is logged at info level and reported by
//! [`GpuRegion::path`].
//!
//! `PSNET_GPUDIRECT` chooses: `auto` (default: the order above), `dmabuf`, `peermem` or
//! `staged` (that path only, an error if it is unavailable), `off` (GPU registration refused).
//!
//! The CUDA driver is loaded at run time (cudarc, `dynamic-loading`): building needs no CUDA
//! installation, and on a host without the driver [`Driver::load`] and every registration
//! return [`GpuError::NoDriver`] instead of panicking; everything else in the crate works as
//! without the feature.
//!
//! The CUDA calls ([`Driver`]) and the registrations with the NIC are in the crate's `sys`
//! module; this one decides the path and holds the entry point [`register_gpu`], which takes a
//! [`DeviceRange`] (made by the `unsafe` [`DeviceRange::promised`]). The
//! decision's plain types and functions ([`Plan`], [`PointerAttrs`], ...) and [`GpuError`]
//! are defined in the crate's bottom layer, where `sys` uses them too, and re-exported here.

mod register;

pub use crate::error::gpu::GpuError;
pub use crate::gpu_path::{
    check_pointer, check_range, dmabuf_layout, first_success, plan, DmaBufLayout, GpuPath, Mode,
    Plan, PointerAttrs, Probe, ENV,
};
pub use crate::sys::cuda::{Context, Current, Driver, PinnedHost};
pub use crate::sys::gpu::DeviceRange;
pub use crate::sys::os::page_size;
pub use register::{peermem_loaded, peermem_loaded_under, register_gpu, GpuRegion};
