//! Device memory that psnet does not own: a raw device pointer, a length and a device, as
//! frameworks hand them out (`tensor.data_ptr()` in PyTorch, `__cuda_array_interface__`).
//! [`BorrowedDevice`] gives it the cudarc views that kv's `GpuKv` and the
//! collectives take, checks first that the driver knows both ends of the range as memory of
//! that device, and never frees it.

use std::sync::Arc;

use cudarc::driver::sys::{CUmemorytype, CUpointer_attribute, CUresult};
use cudarc::driver::{CudaContext, CudaSlice, CudaView, CudaViewMut, DeviceRepr};

use super::{context, guarded};
use crate::error::CompressionError;

/// What the driver says of one address: the facts [`check_range`] rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PointerFacts {
    /// `CU_MEMORYTYPE_*` (2: device memory).
    pub memory_type: u32,
    /// The device holding it.
    pub ordinal: i64,
}

/// Whether `bytes` bytes at `ptr` (`first` and `last`: the facts of its first and last byte)
/// are device memory of device `ordinal`, aligned to `align`; the reason why not otherwise.
/// Both ends are asked about rather than the allocation's extent: PyTorch's expandable
/// segments map one tensor's range from several physical allocations, and the driver reports
/// the extent of one of them only.
pub(crate) fn check_range(
    first: &PointerFacts,
    last: Option<&PointerFacts>,
    ordinal: usize,
    ptr: u64,
    align: u64,
) -> Result<(), String> {
    if ptr % align != 0 {
        return Err(format!(
            "{ptr:#x} is not aligned to the element's {align} bytes"
        ));
    }
    for (facts, which) in [(Some(first), "first"), (last, "last")] {
        let Some(facts) = facts else { continue };
        if facts.memory_type != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(format!(
                "the {which} byte of the range at {ptr:#x} is not device memory (CUDA memory type {})",
                facts.memory_type
            ));
        }
        if facts.ordinal != ordinal as i64 {
            return Err(format!(
                "the {which} byte of the range at {ptr:#x} is memory of device {}, not of device {ordinal}",
                facts.ordinal
            ));
        }
    }
    Ok(())
}

/// What the driver knows of `addr`, the range's `which` (first or last) byte (the context
/// must be current).
fn pointer_facts(addr: u64, which: &str) -> Result<PointerFacts, String> {
    let mut memory_type = 0u32;
    let mut ordinal = 0i32;
    let queries: [(CUpointer_attribute, *mut std::ffi::c_void); 2] = [
        (
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            (&mut memory_type as *mut u32).cast(),
        ),
        (
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            (&mut ordinal as *mut i32).cast(),
        ),
    ];
    for (attribute, data) in queries {
        // SAFETY: each destination is a live local of the attribute's type (CUmemorytype and
        // the ordinal are 32-bit); the driver library is loaded (a context exists) and only
        // reads `addr`'s bookkeeping.
        let rc = unsafe { cudarc::driver::sys::cuPointerGetAttribute(data, attribute, addr) };
        match rc {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_INVALID_VALUE => {
                return Err(format!(
                    "the {which} byte, {addr:#x}, is not memory the CUDA driver knows"
                ))
            }
            other => return Err(format!("cuPointerGetAttribute({attribute:?}): {other:?}")),
        }
    }
    Ok(PointerFacts {
        memory_type,
        ordinal: i64::from(ordinal),
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
    /// driver that the range's first and last bytes are device memory of that device and that
    /// it is aligned for `T`, and fails saying why if not (or without a driver or device).
    ///
    /// # Safety
    /// The allocation must stay allocated, and hold values valid for `T`, until this is
    /// dropped, and nothing else may read it while psnet writes it nor write it while psnet
    /// reads it: work queued on other streams that touches it must be finished first (for
    /// PyTorch: synchronize the tensor's current stream).
    pub unsafe fn new(ordinal: usize, ptr: u64, len: usize) -> Result<Self, CompressionError> {
        let ctx: Arc<CudaContext> = context(ordinal)?;
        let last = (len as u64)
            .checked_mul(std::mem::size_of::<T>() as u64)
            .and_then(|bytes| (bytes - 1).checked_add(ptr))
            .ok_or_else(|| {
                CompressionError::Cuda(format!(
                    "borrowing device memory: {len} elements at {ptr:#x} pass the end of the address space"
                ))
            });
        if len > 0 {
            let last = last?;
            guarded("binding the context", || ctx.bind_to_thread())?;
            let align = std::mem::align_of::<T>() as u64;
            pointer_facts(ptr, "first")
                .and_then(|first| {
                    let last = pointer_facts(last, "last")?;
                    check_range(&first, Some(&last), ordinal, ptr, align)
                })
                .map_err(|why| CompressionError::Cuda(format!("borrowing device memory: {why}")))?;
        }
        let stream = ctx.default_stream();
        let slice = guarded("borrowing device memory", || {
            // SAFETY: the range's ends are device memory of this device (checked above, or
            // it is empty), and the caller keeps it allocated, valid and unshared while this
            // lives; the slice is leaked, never dropped, so cudarc never
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

    const DEVICE: PointerFacts = PointerFacts {
        memory_type: CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
        ordinal: 1,
    };

    #[test]
    fn a_range_of_the_devices_memory_is_accepted() {
        assert_eq!(
            check_range(&DEVICE, Some(&DEVICE), 1, 0x7f00_0000_0040, 4),
            Ok(())
        );
        assert_eq!(check_range(&DEVICE, None, 1, 0x7f00_0000_0040, 8), Ok(()));
    }

    #[test]
    fn ranges_that_are_not_the_devices_memory_are_refused_saying_why() {
        let err = |first: &PointerFacts, last: &PointerFacts, ordinal, ptr, align| {
            check_range(first, Some(last), ordinal, ptr, align).unwrap_err()
        };
        assert!(err(&DEVICE, &DEVICE, 1, 0x1002, 4).contains("not aligned"));
        assert!(err(&DEVICE, &DEVICE, 0, 0x1000, 4).contains("of device 1, not of device 0"));
        let host = PointerFacts {
            memory_type: CUmemorytype::CU_MEMORYTYPE_HOST as u32,
            ..DEVICE
        };
        assert!(err(&host, &DEVICE, 1, 0x1000, 4).contains("first byte"));
        assert!(err(&DEVICE, &host, 1, 0x1000, 4)
            .contains("last byte of the range at 0x1000 is not device memory"));
        let other = PointerFacts {
            ordinal: 2,
            ..DEVICE
        };
        assert!(err(&DEVICE, &other, 1, 0x1000, 4).contains("last byte"));
    }
}
