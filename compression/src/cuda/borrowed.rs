//! Device memory that psnet does not own: a raw device pointer, a length and a device, as
//! frameworks hand them out (`tensor.data_ptr()` in PyTorch, `__cuda_array_interface__`).
//! [`BorrowedDevice`] gives it the cudarc views that kv's `GpuKv` and the
//! collectives take, checks first that the driver knows the range as memory of that device,
//! and never frees it.

use std::sync::Arc;

use cudarc::driver::sys::{CUmemorytype, CUpointer_attribute, CUresult};
use cudarc::driver::{CudaContext, CudaSlice, CudaView, CudaViewMut, DeviceRepr};

use super::{context, guarded};
use crate::error::CompressionError;

/// What the driver says of a pointer: the facts [`check_range`] rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PointerFacts {
    /// `CU_MEMORYTYPE_*` (2: device memory).
    pub memory_type: u32,
    /// The device holding it.
    pub ordinal: i64,
    /// The allocation containing the pointer: its first byte and its size.
    pub base: u64,
    pub size: u64,
}

/// Whether `bytes` bytes at `ptr` are device memory of device `ordinal` inside one
/// allocation, aligned to `align`; the reason why not otherwise.
pub(crate) fn check_range(
    facts: &PointerFacts,
    ordinal: usize,
    ptr: u64,
    bytes: u64,
    align: u64,
) -> Result<(), String> {
    if ptr % align != 0 {
        return Err(format!(
            "{ptr:#x} is not aligned to the element's {align} bytes"
        ));
    }
    if facts.memory_type != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Err(format!(
            "{ptr:#x} is not device memory (CUDA memory type {})",
            facts.memory_type
        ));
    }
    if facts.ordinal != ordinal as i64 {
        return Err(format!(
            "{ptr:#x} is memory of device {}, not of device {ordinal}",
            facts.ordinal
        ));
    }
    let end = ptr.checked_add(bytes);
    let alloc_end = facts.base.checked_add(facts.size);
    match (end, alloc_end) {
        (Some(end), Some(alloc_end)) if ptr >= facts.base && end <= alloc_end => Ok(()),
        _ => Err(format!(
            "{bytes} bytes at {ptr:#x} leave their allocation ({} bytes at {:#x})",
            facts.size, facts.base
        )),
    }
}

/// What the driver knows of `ptr` (the context must be current).
fn pointer_facts(ptr: u64) -> Result<PointerFacts, String> {
    let mut memory_type = 0u32;
    let mut ordinal = 0i32;
    let mut base = 0u64;
    let mut size = 0usize;
    let queries: [(CUpointer_attribute, *mut std::ffi::c_void); 4] = [
        (
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            (&mut memory_type as *mut u32).cast(),
        ),
        (
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            (&mut ordinal as *mut i32).cast(),
        ),
        (
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            (&mut base as *mut u64).cast(),
        ),
        (
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            (&mut size as *mut usize).cast(),
        ),
    ];
    for (attribute, data) in queries {
        // SAFETY: each destination is a live local of the attribute's type (CUmemorytype and
        // the ordinal are 32-bit, the start a CUdeviceptr, the size a size_t); the driver
        // library is loaded (a context exists) and only reads `ptr`'s bookkeeping.
        let rc = unsafe { cudarc::driver::sys::cuPointerGetAttribute(data, attribute, ptr) };
        match rc {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_INVALID_VALUE => {
                return Err(format!("{ptr:#x} is not memory the CUDA driver knows"))
            }
            other => return Err(format!("cuPointerGetAttribute({attribute:?}): {other:?}")),
        }
    }
    Ok(PointerFacts {
        memory_type,
        ordinal: i64::from(ordinal),
        base,
        size: size as u64,
    })
}

/// `len` elements of device memory at a raw pointer, borrowed: views of it go to psnet's GPU
/// calls, and dropping it leaves the memory as it was (allocated, its owner's).
pub struct BorrowedDevice<T> {
    /// cudarc's handle on the memory; never dropped as such (that would free it), but
    /// leaked on drop, which frees only cudarc's own events.
    slice: Option<CudaSlice<T>>,
    ordinal: usize,
}

impl<T> std::fmt::Debug for BorrowedDevice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BorrowedDevice")
            .field("ordinal", &self.ordinal)
            .field("len", &self.len())
            .finish()
    }
}

impl<T: DeviceRepr> BorrowedDevice<T> {
    /// `len` elements of `T` at device address `ptr` on device `ordinal`. Checks with the
    /// driver that the range is device memory of that device inside one allocation and
    /// aligned for `T`, and fails saying why if not (or without a driver or device).
    ///
    /// # Safety
    /// The allocation must stay allocated, and hold values valid for `T`, until this is
    /// dropped, and nothing else may read it while psnet writes it nor write it while psnet
    /// reads it: work queued on other streams that touches it must be finished first (for
    /// PyTorch: synchronize the tensor's current stream).
    pub unsafe fn new(ordinal: usize, ptr: u64, len: usize) -> Result<Self, CompressionError> {
        let ctx: Arc<CudaContext> = context(ordinal)?;
        let bytes = (len as u64)
            .checked_mul(std::mem::size_of::<T>() as u64)
            .ok_or_else(|| CompressionError::Cuda(format!("{len} elements overflow")))?;
        if len > 0 {
            guarded("binding the context", || ctx.bind_to_thread())?;
            pointer_facts(ptr)
                .and_then(|facts| {
                    let align = std::mem::align_of::<T>() as u64;
                    check_range(&facts, ordinal, ptr, bytes, align)
                })
                .map_err(|why| CompressionError::Cuda(format!("borrowing device memory: {why}")))?;
        }
        let stream = ctx.default_stream();
        let slice = guarded("borrowing device memory", || {
            // SAFETY: the range is device memory of this device inside one allocation
            // (checked above, or empty), and the caller keeps it allocated, valid and
            // unshared while this lives; the slice is leaked, never dropped, so cudarc never
            // frees it.
            Ok::<_, String>(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) })
        })?;
        Ok(BorrowedDevice {
            slice: Some(slice),
            ordinal,
        })
    }
}

impl<T> BorrowedDevice<T> {
    /// Elements borrowed.
    pub fn len(&self) -> usize {
        self.slice.as_ref().map_or(0, CudaSlice::len)
    }

    /// Whether no element is borrowed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The memory, to read.
    pub fn view(&self) -> CudaView<'_, T> {
        self.slice
            .as_ref()
            .expect("present until dropped")
            .as_view()
    }

    /// The memory, to write.
    pub fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice
            .as_mut()
            .expect("present until dropped")
            .as_view_mut()
    }
}

impl<T> Drop for BorrowedDevice<T> {
    fn drop(&mut self) {
        if let Some(slice) = self.slice.take() {
            // Waits (on the stream) for work tracked on the memory, frees cudarc's events
            // and keeps the memory.
            let _ = slice.leak();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> PointerFacts {
        PointerFacts {
            memory_type: CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
            ordinal: 1,
            base: 0x7f00_0000_0000,
            size: 4096,
        }
    }

    #[test]
    fn a_range_inside_one_allocation_of_the_device_is_accepted() {
        let f = facts();
        assert_eq!(check_range(&f, 1, f.base, 4096, 4), Ok(()));
        assert_eq!(check_range(&f, 1, f.base + 64, 4032, 4), Ok(()));
        assert_eq!(check_range(&f, 1, f.base + 4096, 0, 4), Ok(()));
    }

    #[test]
    fn ranges_that_are_not_the_devices_memory_are_refused_saying_why() {
        let f = facts();
        let err = |facts: &PointerFacts, ordinal, ptr, bytes, align| {
            check_range(facts, ordinal, ptr, bytes, align).unwrap_err()
        };
        assert!(err(&f, 1, f.base + 2, 8, 4).contains("not aligned"));
        assert!(err(&f, 0, f.base, 8, 4).contains("of device 1, not of device 0"));
        let host = PointerFacts {
            memory_type: CUmemorytype::CU_MEMORYTYPE_HOST as u32,
            ..f
        };
        assert!(err(&host, 1, f.base, 8, 4).contains("not device memory"));
        assert!(err(&f, 1, f.base + 4092, 8, 4).contains("leave their allocation"));
        assert!(err(&f, 1, f.base - 4, 8, 4).contains("leave their allocation"));
        assert!(err(&f, 1, u64::MAX - 3, 8, 4).contains("leave their allocation"));
    }
}
