//! [`GpuError`]: why a GPU buffer could not be registered (feature `cuda`).
//!
//! Defined below the FFI layer, which reports CUDA failures with it; `gpu` re-exports it.

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
