//! Reductions of received bytes into GPU buffers: what psnet-collectives runs when a call's
//! buffer is on the GPU and the reduction runs where the data is. The kernels
//! ([`REDUCE_KERNELS_SRC`](super::REDUCE_KERNELS_SRC)) perform the host path's operations
//! element for element, so a GPU buffer reduced this way ends with the bits a host buffer
//! reduced by the same plan has (NaNs that arithmetic produces are the GPU's canonical NaN,
//! as in the compression kernels).
//!
//! They live in this crate because it holds psnet's CUDA runtime (NVRTC, contexts, page-locked
//! memory, the `unsafe` that launching takes); collectives stays free of `unsafe`.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, DeviceSlice,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::grid::{grid_stride, max_blocks};
use super::reduce_kernels::REDUCE_KERNELS_SRC;
use super::{context, cuda_err, guard, guarded, ptx_once};
use crate::error::CompressionError;

/// An element type the reduction kernels combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceElement {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// IEEE half (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
    /// `i32`.
    I32,
    /// `i64`.
    I64,
    /// `u8`.
    U8,
}

impl DeviceElement {
    /// Every type, in the order of the kernels' table.
    pub const ALL: [DeviceElement; 7] = [
        DeviceElement::F32,
        DeviceElement::F64,
        DeviceElement::F16,
        DeviceElement::BF16,
        DeviceElement::I32,
        DeviceElement::I64,
        DeviceElement::U8,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DeviceElement::F64 | DeviceElement::I64 => 8,
            DeviceElement::F32 | DeviceElement::I32 => 4,
            DeviceElement::F16 | DeviceElement::BF16 => 2,
            DeviceElement::U8 => 1,
        }
    }

    /// The kernels' name for the type (`psnet_reduce_<suffix>`).
    pub fn suffix(self) -> &'static str {
        match self {
            DeviceElement::F32 => "f32",
            DeviceElement::F64 => "f64",
            DeviceElement::F16 => "f16",
            DeviceElement::BF16 => "bf16",
            DeviceElement::I32 => "i32",
            DeviceElement::I64 => "i64",
            DeviceElement::U8 => "u8",
        }
    }

    /// Whether averages of the type can be taken (it has a divide kernel).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DeviceElement::F32 | DeviceElement::F64 | DeviceElement::F16 | DeviceElement::BF16
        )
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|&e| e == self).expect("listed")
    }
}

/// How a received piece combines with the buffer's (the kernels' `op`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Combine {
    /// Sum (integers wrap).
    Sum = 0,
    /// Product (integers wrap).
    Prod = 1,
    /// Minimum; a NaN on either side wins.
    Min = 2,
    /// Maximum; a NaN on either side wins.
    Max = 3,
    /// The received values replace the buffer's.
    Copy = 4,
}

/// Reduces received bytes into device buffers on one device, on a stream of its own, with a
/// device scratch buffer (kept between calls) that the bytes are copied into first.
pub struct CudaReducer {
    ordinal: usize,
    stream: Arc<CudaStream>,
    reduce: Vec<CudaFunction>,
    divide: Vec<Option<CudaFunction>>,
    scratch: Mutex<Option<CudaSlice<u8>>>,
    max_blocks: u32,
}

impl std::fmt::Debug for CudaReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaReducer")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

fn reduce_ptx() -> Result<Ptx, CompressionError> {
    static PTX: OnceLock<Result<Ptx, String>> = OnceLock::new();
    ptx_once(&PTX, REDUCE_KERNELS_SRC, "psnet_reduce.cu")
}

impl CudaReducer {
    /// A reducer on device `ordinal`; [`CompressionError::NoCudaDevice`] (saying why) without
    /// a driver, a device or NVRTC. Never panics.
    pub fn new(ordinal: usize) -> Result<Self, CompressionError> {
        let ctx = context(ordinal)?;
        let ptx = reduce_ptx()?;
        let stream = guarded("creating a stream", || ctx.new_stream())?;
        let max_blocks = max_blocks(&ctx)?;
        let module =
            guard(|| ctx.load_module(ptx)).map_err(cuda_err("loading the reduction kernels"))?;
        let load = |name: String| {
            guard(|| module.load_function(&name))
                .map_err(|e| CompressionError::Cuda(format!("{name}: {e}")))
        };
        let mut reduce = Vec::new();
        let mut divide = Vec::new();
        for e in DeviceElement::ALL {
            reduce.push(load(format!("psnet_reduce_{}", e.suffix()))?);
            divide.push(if e.is_float() {
                Some(load(format!("psnet_divide_{}", e.suffix()))?)
            } else {
                None
            });
        }
        Ok(CudaReducer {
            ordinal,
            stream,
            reduce,
            divide,
            scratch: Mutex::new(None),
            max_blocks,
        })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The reducer's stream: its copies and kernels run on it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `dst[i] = combine(dst[i], src[i])` (`combine(src[i], dst[i])` when `remote_first`),
    /// where `src` holds `dst.len()` elements of `kind` in the host's byte order at any
    /// alignment; returns once `dst` holds the result. An error if `T` is not `kind`'s size
    /// or `src` not `dst`'s length.
    pub fn apply<T: DeviceRepr>(
        &self,
        kind: DeviceElement,
        combine: Combine,
        remote_first: bool,
        dst: &mut CudaViewMut<'_, T>,
        src: &[u8],
    ) -> Result<(), CompressionError> {
        if !self.ready_for(kind, dst, src.len())? {
            return Ok(());
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if scratch.as_ref().is_none_or(|s| s.len() < src.len()) {
            // Dropped first: the old buffer's memory serves the new one.
            *scratch = None;
            let len = src.len().next_power_of_two();
            *scratch = Some(guarded("allocating the reduction's scratch", || {
                self.stream.alloc_zeros::<u8>(len)
            })?);
        }
        let Some(scratch) = scratch.as_mut() else {
            unreachable!("allocated just above")
        };
        let mut landing = scratch.slice_mut(..src.len());
        guarded("copy to device", || {
            self.stream.memcpy_htod(src, &mut landing)
        })?;
        self.combine_from(kind, combine, remote_first, dst, &landing.as_view())
    }

    /// [`apply`](Self::apply) with the received bytes already on the device: `src` (a
    /// [`CudaLanding`](super::CudaLanding)'s view, its copies done) holds `dst.len()`
    /// elements of `kind`. Returns once `dst` holds the result.
    pub fn apply_placed<T: DeviceRepr>(
        &self,
        kind: DeviceElement,
        combine: Combine,
        remote_first: bool,
        dst: &mut CudaViewMut<'_, T>,
        src: &CudaView<'_, u8>,
    ) -> Result<(), CompressionError> {
        if !self.ready_for(kind, dst, src.len())? {
            return Ok(());
        }
        self.combine_from(kind, combine, remote_first, dst, src)
    }

    /// Checks that `dst` holds `kind`'s elements and `src_len` is their bytes, and orders the
    /// reducer's stream after `dst`'s (where its owner writes it); false when there is
    /// nothing to reduce.
    fn ready_for<T: DeviceRepr>(
        &self,
        kind: DeviceElement,
        dst: &CudaViewMut<'_, T>,
        src_len: usize,
    ) -> Result<bool, CompressionError> {
        check_kind::<T>(kind)?;
        let n = dst.len();
        CompressionError::check_len("received piece", n, n * kind.size(), src_len)?;
        if n == 0 {
            return Ok(false);
        }
        guarded("ordering after the buffer's stream", || {
            self.stream.join(dst.stream())
        })?;
        Ok(true)
    }

    /// Runs the reduction kernel over `dst` and `src` (`dst.len()` elements of `kind`, sizes
    /// checked by the caller) and waits for it.
    fn combine_from<T: DeviceRepr>(
        &self,
        kind: DeviceElement,
        combine: Combine,
        remote_first: bool,
        dst: &mut CudaViewMut<'_, T>,
        src: &CudaView<'_, u8>,
    ) -> Result<(), CompressionError> {
        let n = dst.len();
        let (len, op, remote) = (n as u64, combine as i32, i32::from(remote_first));
        let mut launch = self.stream.launch_builder(&self.reduce[kind.index()]);
        launch.arg(dst).arg(src).arg(&len).arg(&op).arg(&remote);
        // SAFETY: the arguments match `psnet_reduce_<kind>(T* dst, const T* src, u64 n,
        // int op, int remote_first)`: `T` has `kind`'s size and `src` holds `n * size` bytes
        // (both checked by the callers), so every index the kernel touches lies inside both.
        guard(|| unsafe { launch.launch(self.config(len)) }).map_err(cuda_err("reduce"))?;
        guarded("synchronize", || self.stream.synchronize())
    }

    /// Divides every element of `dst` by the divisor whose bits (in `kind`, zero-extended)
    /// are `divisor_bits`: the end of an average. Returns once `dst` holds the result. An
    /// error for integer types or a `T` not of `kind`'s size.
    pub fn divide<T: DeviceRepr>(
        &self,
        kind: DeviceElement,
        dst: &mut CudaViewMut<'_, T>,
        divisor_bits: u64,
    ) -> Result<(), CompressionError> {
        check_kind::<T>(kind)?;
        let Some(function) = &self.divide[kind.index()] else {
            return Err(CompressionError::Cuda(format!(
                "averages of {} elements: no divide kernel",
                kind.suffix()
            )));
        };
        let len = dst.len() as u64;
        if len == 0 {
            return Ok(());
        }
        guarded("ordering after the buffer's stream", || {
            self.stream.join(dst.stream())
        })?;
        let mut launch = self.stream.launch_builder(function);
        launch.arg(dst).arg(&len);
        // The divisor is passed as the kernel's parameter type takes it.
        let (f32_div, f64_div, half_div) = (
            f32::from_bits(divisor_bits as u32),
            f64::from_bits(divisor_bits),
            divisor_bits as u16,
        );
        match kind {
            DeviceElement::F32 => launch.arg(&f32_div),
            DeviceElement::F64 => launch.arg(&f64_div),
            _ => launch.arg(&half_div),
        };
        // SAFETY: the arguments match `psnet_divide_<kind>(T* dst, u64 n, divisor)` with the
        // divisor in the kernel's type; `dst` holds `n` elements of `kind`'s size.
        guard(|| unsafe { launch.launch(self.config(len)) }).map_err(cuda_err("divide"))?;
        guarded("synchronize", || self.stream.synchronize())
    }

    /// A thread per element, in as many blocks as fill the device; grid-stride loops cover
    /// the rest.
    fn config(&self, n: u64) -> LaunchConfig {
        grid_stride(n, self.max_blocks)
    }
}

fn check_kind<T>(kind: DeviceElement) -> Result<(), CompressionError> {
    if std::mem::size_of::<T>() != kind.size() {
        return Err(CompressionError::Cuda(format!(
            "a buffer of {}-byte elements reduced as {} ({} bytes)",
            std::mem::size_of::<T>(),
            kind.suffix(),
            kind.size()
        )));
    }
    Ok(())
}

/// `view` split into consecutive views of `lens` elements (which must add up to at most its
/// length), each usable on its own while the others are: the pieces of a collective, sent
/// from and reduced into at the same time.
pub fn split_view_mut<'a, T>(
    view: CudaViewMut<'a, T>,
    lens: impl IntoIterator<Item = usize>,
) -> Result<Vec<CudaViewMut<'a, T>>, CompressionError> {
    let total = view.len();
    let mut rest = view;
    let mut pieces = Vec::new();
    for len in lens {
        let Some((head, tail)) = rest.try_split_at_mut(len) else {
            return Err(CompressionError::Cuda(format!(
                "pieces longer than the {total} elements of the view"
            )));
        };
        // SAFETY: a view is a device pointer, a length and references (of lifetime 'a) to
        // its allocation's events and stream; `try_split_at_mut` only ties the halves to the
        // borrow of `rest`, which is itself a part of `view`, moved in here and never used
        // again as a whole. The halves are disjoint, so extending them to 'a aliases nothing.
        let (head, tail) = unsafe {
            (
                std::mem::transmute::<CudaViewMut<'_, T>, CudaViewMut<'a, T>>(head),
                std::mem::transmute::<CudaViewMut<'_, T>, CudaViewMut<'a, T>>(tail),
            )
        };
        pieces.push(head);
        rest = tail;
    }
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::super::compile_source;
    use super::super::tests::{entry_params, inexact_instructions, nvrtc_or_skip};
    use super::*;

    /// The reduction kernels compile for NVRTC's default target and the A100's and H100's,
    /// every entry with the parameters `apply` and `divide` push (pointers and `n` 8 bytes,
    /// `op` and `remote_first` 4, the divisor in its type's width), and no instruction fuses
    /// a multiply into an add or flushes denormals. Skipped, saying why, without libnvrtc;
    /// `PSNET_REQUIRE_NVRTC=1` makes that a failure (CI sets it).
    #[test]
    fn the_reduction_kernels_compile_with_the_launches_parameters_and_exact_arithmetic() {
        if !nvrtc_or_skip("reduction kernel check") {
            return;
        }
        for arch in [None, Some("compute_80"), Some("compute_90")] {
            let ptx = compile_source(REDUCE_KERNELS_SRC, "psnet_reduce.cu", arch)
                .unwrap_or_else(|e| panic!("compiling for {arch:?}: {e}"))
                .to_src();
            for e in DeviceElement::ALL {
                let name = format!("psnet_reduce_{}", e.suffix());
                let params = entry_params(&ptx, &name)
                    .unwrap_or_else(|| panic!("{arch:?}: no entry {name} in the PTX"));
                assert_eq!(params, [8, 8, 8, 4, 4], "{arch:?}: parameters of {name}");
                let name = format!("psnet_divide_{}", e.suffix());
                match entry_params(&ptx, &name) {
                    Some(params) => {
                        assert!(e.is_float(), "{arch:?}: {name} for an integer type");
                        let divisor = e.size();
                        assert_eq!(params, [8, 8, divisor], "{arch:?}: parameters of {name}");
                    }
                    None => assert!(!e.is_float(), "{arch:?}: no entry {name} in the PTX"),
                }
            }
            let inexact = inexact_instructions(&ptx);
            assert!(inexact.is_empty(), "{arch:?}: {inexact:?}");
        }
    }
}
