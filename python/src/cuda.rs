//! CUDA tensors reduced where they lie: `Comm.allreduce_cuda` takes a contiguous tensor's
//! device pointer, element count, type and device (`data_ptr()`, `numel()`, `dtype`,
//! `device.index`) and runs the allreduce on the GPU (`GpuStage::reducing_on_device`):
//! pieces sent from device memory, received pieces reduced by kernels into the tensor. The
//! Python side synchronizes torch's current stream first and keeps the tensor alive for
//! the call. `PSNET_CUDA_TENSORS=staged` takes the host-copy path instead.
//!
//! This is the only module of the crate with `unsafe`: borrowing memory by raw pointer.
#![allow(unsafe_code)]

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use psnet_collectives::{bf16, f16, CollectiveError, Element, GpuStage};
use psnet_compression::cuda::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use psnet_compression::cuda::BorrowedDevice;
use psnet_config::env;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::coll::Comm;

/// One stage per device and element type, made on first use (it compiles and loads the
/// reduction kernels) and kept for the communicator's life.
#[derive(Default)]
pub(crate) struct Stages(Mutex<HashMap<(usize, &'static str), AnyStage>>);

/// A `GpuStage` of some element type.
type AnyStage = Arc<dyn Any + Send + Sync>;

impl Stages {
    fn get<E>(&self, device: usize) -> Result<Arc<GpuStage<E>>, CollectiveError>
    where
        E: Element + DeviceRepr + ValidAsZeroBits,
    {
        let key = (device, E::DTYPE.name());
        let mut stages = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(stage) = stages.get(&key) {
            if let Ok(stage) = stage.clone().downcast::<GpuStage<E>>() {
                return Ok(stage);
            }
        }
        let stage = Arc::new(GpuStage::<E>::reducing_on_device(device)?);
        stages.insert(key, stage.clone());
        Ok(stage)
    }
}

/// How CUDA tensors are taken (`PSNET_CUDA_TENSORS`): `"device"` (reduced where they lie)
/// or `"staged"` (copied to host memory for the call); a `ValueError` for anything else.
#[pyfunction]
pub(crate) fn cuda_tensors() -> PyResult<&'static str> {
    let var = env::PSNET_CUDA_TENSORS;
    match var.get().as_deref().map(str::trim) {
        None | Some("") | Some("device") => Ok("device"),
        Some("staged") => Ok("staged"),
        Some(other) => Err(PyValueError::new_err(format!(
            "{}={other:?}: expected device or staged",
            var.name
        ))),
    }
}

impl Comm {
    /// Reduces on the GPU; `false` (with a warning) when this rank cannot take the tensor
    /// there, so that the caller stages it instead. Both run the same plan with the same
    /// messages, so ranks that differ in this still reduce together, to the same bits.
    fn allreduce_cuda_t<E>(
        &self,
        py: Python<'_>,
        ptr: u64,
        numel: usize,
        device: usize,
        op: psnet_collectives::ReduceOp,
    ) -> PyResult<bool>
    where
        E: Element + DeviceRepr + ValidAsZeroBits,
    {
        let stage = match self.gpu.get::<E>(device) {
            Ok(stage) => stage,
            Err(e) => return Ok(staged_instead(&e.to_string())),
        };
        // SAFETY: the Python caller passes a live, contiguous CUDA tensor's `data_ptr()`,
        // `numel()` and device index, keeps the tensor referenced for the whole call (the
        // frame holds it), and has synchronized torch's current stream, so nothing queued
        // there still touches it; `BorrowedDevice::new` checks with the driver that both ends
        // of the range are that device's memory and that it is aligned for `E`.
        let mut memory = match unsafe { BorrowedDevice::<E>::new(device, ptr, numel) } {
            Ok(memory) => memory,
            Err(e) => return Ok(staged_instead(&e.to_string())),
        };
        let comm = self.comm.clone();
        self.run(py, async move {
            comm.allreduce_device(&stage, &mut memory.view_mut(), op)
                .await
        })?;
        Ok(true)
    }
}

/// Says (once per process as a warning, then at debug level) why a CUDA tensor is staged
/// instead of reduced on its GPU; returns `false`.
fn staged_instead(why: &str) -> bool {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::debug!(reason = why, "CUDA tensor staged through host memory");
    } else {
        tracing::warn!(
            reason = why,
            "CUDA tensors are staged through host memory: psnet cannot reduce them on the GPU here"
        );
    }
    false
}

/// Reduces a contiguous CUDA tensor in place on its GPU (`dtype`: torch's name without
/// `torch.`; `op`: sum, prod, min, max, avg). Returns `False`, having logged why, when this
/// process cannot (no NVRTC, say): the caller then stages the tensor, and the ranks still
/// reduce together.
#[pyfunction]
pub(crate) fn allreduce_cuda(
    py: Python<'_>,
    comm: &Comm,
    ptr: u64,
    numel: usize,
    dtype: &str,
    device: usize,
    op: &str,
) -> PyResult<bool> {
    let op: psnet_collectives::ReduceOp = op.parse().map_err(PyValueError::new_err)?;
    let float = matches!(dtype, "float32" | "float64" | "float16" | "bfloat16");
    if op == psnet_collectives::ReduceOp::Avg && !float {
        return Err(PyValueError::new_err(format!(
            "allreduce: avg is for floating-point elements, not {dtype}"
        )));
    }
    match dtype {
        "float32" => comm.allreduce_cuda_t::<f32>(py, ptr, numel, device, op),
        "float64" => comm.allreduce_cuda_t::<f64>(py, ptr, numel, device, op),
        "float16" => comm.allreduce_cuda_t::<f16>(py, ptr, numel, device, op),
        "bfloat16" => comm.allreduce_cuda_t::<bf16>(py, ptr, numel, device, op),
        "int32" => comm.allreduce_cuda_t::<i32>(py, ptr, numel, device, op),
        "int64" => comm.allreduce_cuda_t::<i64>(py, ptr, numel, device, op),
        "uint8" => comm.allreduce_cuda_t::<u8>(py, ptr, numel, device, op),
        other => Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "allreduce: {other} tensors are not reduced on the GPU \
             (float32, float64, float16, bfloat16, int32, int64, uint8)"
        ))),
    }
}
