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
//! The CUDA calls ([`Driver`]), the registrations with the NIC and the `unsafe` entry point
//! [`register_gpu`] are in the crate's `sys` module; this one decides the path.

mod path;
mod register;

pub use crate::sys::cuda::{Context, Current, Driver, PinnedHost};
pub use crate::sys::gpu::register_gpu;
pub use crate::sys::os::page_size;
pub use path::{
    check_pointer, check_range, dmabuf_layout, first_success, plan, DmaBufLayout, GpuPath, Mode,
    Plan, PointerAttrs, Probe, ENV,
};
pub(crate) use register::register;
pub use register::{peermem_loaded, peermem_loaded_under, GpuRegion};

/// Why a GPU buffer could not be registered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// No CUDA driver library on this host.
    #[error(
        "CUDA driver libcuda.so.1 not found: no GPU on this host; build/run without GPU buffers \
         or install the NVIDIA driver"
    )]
    NoDriver,
    /// The driver is installed but reports no usable GPU.
    #[error("no CUDA device: {0} (check nvidia-smi and CUDA_VISIBLE_DEVICES)")]
    NoDevice(String),
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Cuda(String),
    /// The NIC registration failed on every path allowed.
    #[error("GPU memory registration failed: {0}")]
    Registration(String),
    /// The pointer is not device memory, or the range leaves its allocation.
    #[error("not registrable GPU memory: {0}")]
    BadPointer(String),
    /// `PSNET_GPUDIRECT=off`.
    #[error("GPU memory registration is disabled (PSNET_GPUDIRECT=off)")]
    Disabled,
    /// `PSNET_GPUDIRECT` has a value that is not understood.
    #[error("PSNET_GPUDIRECT={0:?} is not valid: use auto, dmabuf, peermem, staged or off")]
    BadSetting(String),
    /// A copy range outside the region.
    #[error("range [{at}, {at} + {len}) is outside the {region}-byte GPU region")]
    OutOfRange {
        /// Start of the range.
        at: usize,
        /// Its length.
        len: usize,
        /// The region's length.
        region: usize,
    },
}
