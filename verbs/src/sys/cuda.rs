//! The CUDA driver API, loaded at run time through cudarc: every CUDA call of the crate.
//!
//! cudarc panics when `libcuda` cannot be opened or lacks a symbol it is asked for, so
//! [`Driver::load`] first probes for the library (`libcuda.so`, `libcuda.so.1`, ...) and then
//! for every entry point used here; only a [`Driver`] that passed both is ever used, and it is
//! the only way to reach the calls below. Nothing here panics for a missing driver.

use std::alloc::Layout;
use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{
    self, CUcontext, CUdevice_attribute, CUmemRangeHandleType, CUpointer_attribute, CUresult,
};

use super::os::page_size;
use crate::error::gpu::GpuError;
use crate::gpu_path::PointerAttrs;

/// Entry points every registration path may call.
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuPointerGetAttributes",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
];

/// The dma-buf export (CUDA 11.7+ drivers); its absence only rules out the dma-buf path.
const DMABUF_EXPORT: &str = "cuMemGetHandleForAddressRange";

/// The flush of GPUDirect RDMA writes (CUDA 11.3+ drivers); its absence rules out peers'
/// NICs writing GPU memory that kernels then read.
const FLUSH_WRITES: &str = "cuFlushGPUDirectRDMAWrites";

/// A loaded, initialised CUDA driver with at least one device.
#[derive(Debug)]
pub struct Driver {
    version: i32,
    devices: usize,
    dmabuf_export: bool,
    flush_writes: bool,
}

/// `rc` as the driver names it (`CUDA_ERROR_INVALID_VALUE: invalid argument`).
fn describe(rc: CUresult) -> String {
    let err = DriverError(rc);
    match (err.error_name(), err.error_string()) {
        (Ok(name), Ok(text)) => format!("{}: {}", name.to_string_lossy(), text.to_string_lossy()),
        _ => format!("{rc:?}"),
    }
}

/// `Ok` for `CUDA_SUCCESS`, else a [`GpuError::Cuda`] naming the call.
fn check(rc: CUresult, call: &str) -> Result<(), GpuError> {
    match rc {
        CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(GpuError::Cuda(format!("{call}: {}", describe(other)))),
    }
}

impl Driver {
    /// The process's driver, loaded and initialised on first use (`cuInit`).
    ///
    /// [`GpuError::NoDriver`] when `libcuda` is not installed (or is the toolkit's stub),
    /// [`GpuError::NoDevice`] when it reports no GPU, [`GpuError::Cuda`] for a driver too old
    /// or failing to initialise. The outcome is cached.
    pub fn load() -> Result<&'static Driver, GpuError> {
        static DRIVER: OnceLock<Result<Driver, GpuError>> = OnceLock::new();
        DRIVER
            .get_or_init(Driver::init)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn init() -> Result<Driver, GpuError> {
        // SAFETY: only dlopens the usual names of the driver library and closes them again;
        // no code of the library runs beyond its initialisers.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        // SAFETY: opens the library just found (same names, same order), so it does not
        // reach cudarc's panic for a missing library; the handle lives for the process.
        let lib = unsafe { sys::culib() };
        let has = |name: &str| {
            // SAFETY: the symbol is only looked up, never called through this type.
            unsafe { lib.get::<unsafe extern "C" fn()>(name) }.is_ok()
        };
        if let Some(missing) = REQUIRED.iter().find(|name| !has(name)) {
            return Err(GpuError::Cuda(format!(
                "libcuda lacks {missing}: the NVIDIA driver is too old (GPUDirect needs 470 or \
                 newer)"
            )));
        }
        let dmabuf_export = has(DMABUF_EXPORT);
        let flush_writes = has(FLUSH_WRITES);
        // SAFETY: cuInit takes a flags word (must be 0); its symbol was found above.
        match unsafe { sys::cuInit(0) } {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_STUB_LIBRARY => return Err(GpuError::NoDriver),
            CUresult::CUDA_ERROR_NO_DEVICE => {
                return Err(GpuError::NoDevice(
                    "cuInit: no CUDA-capable device is detected".into(),
                ))
            }
            other => return Err(GpuError::Cuda(format!("cuInit: {}", describe(other)))),
        }
        let mut version: c_int = 0;
        // SAFETY: writes one int into the valid pointer; symbol checked.
        let rc = unsafe { sys::cuDriverGetVersion(&mut version) };
        check(rc, "cuDriverGetVersion")?;
        let mut count: c_int = 0;
        // SAFETY: writes one int into the valid pointer; the driver is initialised.
        let rc = unsafe { sys::cuDeviceGetCount(&mut count) };
        check(rc, "cuDeviceGetCount")?;
        let devices = usize::try_from(count).unwrap_or(0);
        if devices == 0 {
            return Err(GpuError::NoDevice(
                "the CUDA driver reports no device".into(),
            ));
        }
        tracing::debug!(version, devices, dmabuf_export, "CUDA driver loaded");
        Ok(Driver {
            version,
            devices,
            dmabuf_export,
            flush_writes,
        })
    }

    /// The driver's CUDA version (`12040` for 12.4).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Number of GPUs.
    pub fn device_count(&self) -> usize {
        self.devices
    }

    /// Whether the driver has the dma-buf export entry point at all.
    pub fn has_dmabuf_export(&self) -> bool {
        self.dmabuf_export
    }

    /// Whether GPU `ordinal` can export its memory as dma-bufs
    /// (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub fn dmabuf_supported(&self, ordinal: i32) -> Result<bool, GpuError> {
        if !self.dmabuf_export {
            return Ok(false);
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one device handle into the valid pointer; the driver is initialised.
        let rc = unsafe { sys::cuDeviceGet(&mut dev, ordinal) };
        check(rc, "cuDeviceGet")?;
        let mut value: c_int = 0;
        // SAFETY: writes one int into the valid pointer for a device handle just obtained.
        let rc = unsafe {
            sys::cuDeviceGetAttribute(
                &mut value,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                dev,
            )
        };
        check(rc, "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)")?;
        Ok(value != 0)
    }

    /// What the driver knows of `ptr`, and the context owning it.
    pub fn pointer(&self, ptr: u64) -> Result<(PointerAttrs, Context), GpuError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // Each scalar attribute is written into a zeroed 8-byte slot, wide enough for any of
        // them (ints, a bool, a device address, a size).
        let mut memory_type = 0u64;
        let mut managed = 0u64;
        let mut ordinal = 0u64;
        let mut base = 0u64;
        let mut size = 0u64;
        let mut attributes = [
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data: [*mut c_void; 6] = [
            (&mut ctx as *mut CUcontext).cast(),
            (&mut memory_type as *mut u64).cast(),
            (&mut managed as *mut u64).cast(),
            (&mut ordinal as *mut u64).cast(),
            (&mut base as *mut u64).cast(),
            (&mut size as *mut u64).cast(),
        ];
        // SAFETY: `attributes` and `data` have the same length; each data pointer is valid for
        // the attribute's value (a context handle, or at most 8 bytes in a zeroed u64). For
        // memory the driver does not know, it stores defaults and returns success.
        let rc = unsafe {
            sys::cuPointerGetAttributes(
                attributes.len() as u32,
                attributes.as_mut_ptr(),
                data.as_mut_ptr(),
                ptr,
            )
        };
        if rc == CUresult::CUDA_ERROR_INVALID_VALUE {
            return Err(GpuError::BadPointer(format!(
                "{ptr:#x} is not memory known to the CUDA driver"
            )));
        }
        check(rc, "cuPointerGetAttributes")?;
        let attrs = PointerAttrs {
            memory_type: memory_type as u32,
            managed: managed as u32 != 0,
            ordinal: ordinal as u32 as i32,
            base,
            size,
            has_context: !ctx.is_null(),
        };
        Ok((attrs, Context(ctx)))
    }

    /// Exports `[start, start + len)` of `ctx`'s memory as a dma-buf file descriptor.
    pub fn export_dmabuf(&self, ctx: Context, start: u64, len: u64) -> Result<OwnedFd, GpuError> {
        if !self.dmabuf_export {
            return Err(GpuError::Registration(format!(
                "libcuda lacks {DMABUF_EXPORT} (driver older than CUDA 11.7)"
            )));
        }
        let len = usize::try_from(len)
            .map_err(|_| GpuError::Registration("range too large to export".into()))?;
        let _current = self.make_current(ctx)?;
        let mut fd: c_int = -1;
        // SAFETY: the symbol exists (checked at load); the handle pointer is valid for the
        // int a dma-buf handle is; the range is page-aligned inside one allocation of the
        // current context (see `path::dmabuf_layout`).
        let rc = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast(),
                start,
                len,
                CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        check(rc, "cuMemGetHandleForAddressRange")?;
        if fd < 0 {
            return Err(GpuError::Registration(format!(
                "cuMemGetHandleForAddressRange returned fd {fd}"
            )));
        }
        // SAFETY: the driver just created this descriptor for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Whether the driver can flush GPUDirect RDMA writes ([`Driver::flush_writes`]).
    pub fn can_flush_writes(&self) -> bool {
        self.flush_writes
    }

    /// Makes the NIC's writes into `ctx`'s memory so far visible to work then launched in it
    /// (`cuFlushGPUDirectRDMAWrites`, to the owner): call after a peer's RDMA write into GPU
    /// memory landed and before a kernel reads it.
    pub fn flush_writes(&self, ctx: Context) -> Result<(), GpuError> {
        if !self.flush_writes {
            return Err(GpuError::Cuda(format!(
                "libcuda lacks {FLUSH_WRITES} (CUDA 11.3 or newer is needed for peers to write \
                 GPU memory)"
            )));
        }
        let _current = self.make_current(ctx)?;
        // SAFETY: takes two enum values and touches no memory of ours; the symbol was found
        // at load (`flush_writes`).
        let rc = unsafe {
            sys::cuFlushGPUDirectRDMAWrites(
                sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            )
        };
        check(rc, "cuFlushGPUDirectRDMAWrites")
    }

    /// Makes `ctx` current on this thread until the guard is dropped.
    pub fn make_current(&self, ctx: Context) -> Result<Current, GpuError> {
        if ctx.0.is_null() {
            return Err(GpuError::Cuda("no CUDA context".into()));
        }
        // SAFETY: pushes a context handle the driver gave for live memory; symbol checked.
        let rc = unsafe { sys::cuCtxPushCurrent_v2(ctx.0) };
        check(rc, "cuCtxPushCurrent")?;
        Ok(Current {
            _thread: std::marker::PhantomData,
        })
    }

    /// Copies `len` bytes from device address `src` to host memory `dst` (synchronous).
    ///
    /// # Safety
    /// `dst` is valid for `len` bytes of writes that race with no Rust reference, and
    /// `[src, src + len)` is device memory of `ctx` that stays allocated during the call.
    pub unsafe fn copy_dtoh(
        &self,
        ctx: Context,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        let _current = self.make_current(ctx)?;
        // SAFETY: forwarded from the caller; symbol checked.
        let rc = unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), src, len) };
        check(rc, "cuMemcpyDtoH")
    }

    /// Copies `len` bytes from host memory `src` to device address `dst` (synchronous).
    ///
    /// # Safety
    /// `src` is valid for `len` bytes of reads, and `[dst, dst + len)` is device memory of
    /// `ctx` that stays allocated during the call.
    pub unsafe fn copy_htod(
        &self,
        ctx: Context,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), GpuError> {
        let _current = self.make_current(ctx)?;
        // SAFETY: forwarded from the caller; symbol checked.
        let rc = unsafe { sys::cuMemcpyHtoD_v2(dst, src.cast(), len) };
        check(rc, "cuMemcpyHtoD")
    }
}

/// A CUDA context handle, as the driver reported it for a pointer. Not retained: it stays
/// valid while the memory it owns is allocated, which callers of registration guarantee.
#[derive(Clone, Copy, Debug)]
pub struct Context(CUcontext);

// SAFETY: a context handle is an opaque token the driver accepts from any thread (the driver
// API is thread-safe; contexts are pushed per thread where used).
unsafe impl Send for Context {}
// SAFETY: as above; the handle is never dereferenced here.
unsafe impl Sync for Context {}

/// A context made current by [`Driver::make_current`]; popped when dropped, on the thread
/// that pushed it (the guard is neither `Send` nor `Sync`).
#[must_use]
pub struct Current {
    _thread: std::marker::PhantomData<*const ()>,
}

impl Drop for Current {
    fn drop(&mut self) {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context this guard pushed: it exists only after a successful push,
        // is dropped on the pushing thread (not Send), and is never cloned.
        let rc = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if rc != CUresult::CUDA_SUCCESS {
            tracing::warn!(error = %describe(rc), "cuCtxPopCurrent failed");
        }
    }
}

/// Page-aligned host memory, page-locked with `cuMemHostRegister` (portable: pinned for
/// every context); unregistered and freed when dropped.
pub struct PinnedHost {
    ptr: NonNull<u8>,
    layout: Layout,
    ctx: Context,
    driver: &'static Driver,
}

// SAFETY: owns its allocation; the pointer is only an address into it.
unsafe impl Send for PinnedHost {}
// SAFETY: no method hands out references into the memory; access goes through raw-pointer
// copies whose exclusivity is the caller's contract.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    /// `len` zeroed bytes (at least one page), page-locked in `ctx`.
    pub fn new(driver: &'static Driver, ctx: Context, len: usize) -> Result<PinnedHost, GpuError> {
        let page = page_size();
        let size = len
            .max(1)
            .checked_next_multiple_of(page)
            .ok_or_else(|| GpuError::Registration(format!("{len} bytes cannot be staged")))?;
        let layout = Layout::from_size_align(size, page)
            .map_err(|e| GpuError::Registration(format!("staging buffer of {size} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            GpuError::Registration(format!("out of memory for a {size}-byte staging buffer"))
        })?;
        let pinned = driver.make_current(ctx).and_then(|_current| {
            // SAFETY: `[ptr, ptr + size)` is a live allocation owned here and unregistered
            // before it is freed (Drop); `ctx` is current while the call runs.
            let rc = unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.as_ptr().cast(),
                    size,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            check(rc, "cuMemHostRegister")
        });
        if let Err(e) = pinned {
            // SAFETY: allocated above with this layout and not registered.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
            return Err(e);
        }
        Ok(PinnedHost {
            ptr,
            layout,
            ctx,
            driver,
        })
    }

    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Usable bytes (a whole number of pages).
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        match self.driver.make_current(self.ctx) {
            Ok(_current) => {
                // SAFETY: the range was registered by `new`; no registration with the NIC
                // covers it any more (the owner drops that first).
                let rc = unsafe { sys::cuMemHostUnregister(self.ptr.as_ptr().cast()) };
                if rc != CUresult::CUDA_SUCCESS {
                    tracing::warn!(error = %describe(rc), "cuMemHostUnregister failed");
                }
            }
            Err(e) => tracing::warn!(error = %e, "staging buffer not unregistered from CUDA"),
        }
        // SAFETY: allocated in `new` with this layout; nothing refers to it any more.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
