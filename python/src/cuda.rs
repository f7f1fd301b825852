//! CUDA tensors taken where they lie, by device pointer, element count, type and device
//! (`data_ptr()`, `numel()`, `dtype`, `device.index`):
//! - `allreduce_cuda` runs an allreduce on the GPU (`GpuStage::reducing_on_device`): pieces
//!   sent from device memory, received pieces reduced by kernels into the tensor;
//!   `broadcast_cuda` a broadcast, received pieces copied into the tensor on the device;
//!   `allgather_cuda`, `reduce_scatter_cuda` and `reduce_cuda` the same calls in place;
//! - `kv_push_cuda`, `kv_pull_cuda`, `kv_pushpull_cuda` are the kv worker's calls on GPU
//!   buffers (`GpuKv`): sent from device memory, or quantized on the GPU with the residual
//!   kept there when compression is on; pulled values copied into the tensor.
//!
//! The Python side synchronizes torch's current stream first, makes the tensor's device
//! current, and keeps the tensor alive for the call. Each returns `False` (logging why once)
//! when this process cannot take the tensor on its GPU, and the caller stages it instead.
//! `PSNET_CUDA_TENSORS=staged` stages every CUDA tensor.
//!
//! This is the only module of the crate with `unsafe`: borrowing memory by raw pointer.
#![allow(unsafe_code)]

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use psnet::kv::GpuKv;
use psnet_collectives::{bf16, f16, CollectiveError, Element, GpuStage};
use psnet_compression::cuda::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use psnet_compression::cuda::BorrowedDevice;
use psnet_config::env;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::coll::Comm;
use crate::kv::Worker;

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

/// A collective on one CUDA tensor.
#[derive(Clone, Copy, Debug)]
enum OnGpu {
    Allreduce(psnet_collectives::ReduceOp),
    Broadcast(usize),
    AllgatherInPlace,
    ReduceScatterInPlace(psnet_collectives::ReduceOp),
    Reduce(psnet_collectives::ReduceOp, usize),
}

impl Comm {
    /// Runs `call` on the GPU; `false` (with a warning) when this rank cannot take the tensor
    /// there, so that the caller stages it instead. Both run the same plan with the same
    /// messages, so ranks that differ in this still take part together, with the same bits.
    fn collective_cuda_t<E>(
        &self,
        py: Python<'_>,
        ptr: u64,
        numel: usize,
        device: usize,
        call: OnGpu,
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
            let mut view = memory.view_mut();
            match call {
                OnGpu::Allreduce(op) => comm.allreduce_device(&stage, &mut view, op).await,
                OnGpu::Broadcast(root) => comm.broadcast_device(&stage, &mut view, root).await,
                OnGpu::AllgatherInPlace => comm.allgather_in_place_device(&stage, &mut view).await,
                OnGpu::ReduceScatterInPlace(op) => {
                    comm.reduce_scatter_in_place_device(&stage, &mut view, op)
                        .await
                }
                OnGpu::Reduce(op, root) => comm.reduce_device(&stage, &mut view, op, root).await,
            }
        })?;
        Ok(true)
    }

    /// `collective_cuda_t` for the element type torch names `dtype`.
    fn collective_cuda(
        &self,
        py: Python<'_>,
        ptr: u64,
        numel: usize,
        dtype: &str,
        device: usize,
        call: OnGpu,
    ) -> PyResult<bool> {
        match dtype {
            "float32" => self.collective_cuda_t::<f32>(py, ptr, numel, device, call),
            "float64" => self.collective_cuda_t::<f64>(py, ptr, numel, device, call),
            "float16" => self.collective_cuda_t::<f16>(py, ptr, numel, device, call),
            "bfloat16" => self.collective_cuda_t::<bf16>(py, ptr, numel, device, call),
            "int32" => self.collective_cuda_t::<i32>(py, ptr, numel, device, call),
            "int64" => self.collective_cuda_t::<i64>(py, ptr, numel, device, call),
            "uint8" => self.collective_cuda_t::<u8>(py, ptr, numel, device, call),
            other => Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "{call:?}: {other} tensors are not taken on the GPU \
                 (float32, float64, float16, bfloat16, int32, int64, uint8)"
            ))),
        }
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
    let op = reduction("allreduce", op, dtype)?;
    comm.collective_cuda(py, ptr, numel, dtype, device, OnGpu::Allreduce(op))
}

/// `op` parsed, and refused where `dtype` cannot take it (avg of integers).
fn reduction(what: &str, op: &str, dtype: &str) -> PyResult<psnet_collectives::ReduceOp> {
    let op: psnet_collectives::ReduceOp = op.parse().map_err(PyValueError::new_err)?;
    let float = matches!(dtype, "float32" | "float64" | "float16" | "bfloat16");
    if op == psnet_collectives::ReduceOp::Avg && !float {
        return Err(PyValueError::new_err(format!(
            "{what}: avg is for floating-point elements, not {dtype}"
        )));
    }
    Ok(op)
}

/// Allgather in place of a contiguous CUDA tensor on its GPU: one block per rank, this rank's
/// filled in; afterwards every block holds its rank's (see `allreduce_cuda`). `False` when
/// this process cannot.
#[pyfunction]
pub(crate) fn allgather_cuda(
    py: Python<'_>,
    comm: &Comm,
    ptr: u64,
    numel: usize,
    dtype: &str,
    device: usize,
) -> PyResult<bool> {
    comm.collective_cuda(py, ptr, numel, dtype, device, OnGpu::AllgatherInPlace)
}

/// Reduce-scatter in place of a contiguous CUDA tensor on its GPU: one block per rank;
/// afterwards block `rank` holds the reduction of every rank's (see `allreduce_cuda`).
/// `False` when this process cannot.
#[pyfunction]
pub(crate) fn reduce_scatter_cuda(
    py: Python<'_>,
    comm: &Comm,
    ptr: u64,
    numel: usize,
    dtype: &str,
    device: usize,
    op: &str,
) -> PyResult<bool> {
    let op = reduction("reduce_scatter", op, dtype)?;
    comm.collective_cuda(
        py,
        ptr,
        numel,
        dtype,
        device,
        OnGpu::ReduceScatterInPlace(op),
    )
}

/// Reduces every rank's contiguous CUDA tensor into `root`'s, in place on the GPU (see
/// `allreduce_cuda`); the other ranks' tensors are used as scratch. `False` when this
/// process cannot.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_cuda(
    py: Python<'_>,
    comm: &Comm,
    ptr: u64,
    numel: usize,
    dtype: &str,
    device: usize,
    op: &str,
    root: usize,
) -> PyResult<bool> {
    let op = reduction("reduce", op, dtype)?;
    check_root("reduce", root, comm)?;
    comm.collective_cuda(py, ptr, numel, dtype, device, OnGpu::Reduce(op, root))
}

/// Broadcasts `root`'s contiguous CUDA tensor into every rank's, in place on the GPU (see
/// `allreduce_cuda`); `False` when this process cannot.
#[pyfunction]
pub(crate) fn broadcast_cuda(
    py: Python<'_>,
    comm: &Comm,
    ptr: u64,
    numel: usize,
    dtype: &str,
    device: usize,
    root: usize,
) -> PyResult<bool> {
    check_root("broadcast", root, comm)?;
    comm.collective_cuda(py, ptr, numel, dtype, device, OnGpu::Broadcast(root))
}

/// Refuses a root that is not a rank of `comm`.
fn check_root(what: &str, root: usize, comm: &Comm) -> PyResult<()> {
    if root >= comm.comm.size() {
        return Err(PyValueError::new_err(format!(
            "{what}: root {root} is not a rank of {} ranks",
            comm.comm.size()
        )));
    }
    Ok(())
}

/// One `GpuKv` per device, made on first use and kept for the worker's life: it holds the
/// device's compressor and each key's error-feedback residual.
#[derive(Default)]
pub(crate) struct KvDevices(Mutex<HashMap<usize, Arc<GpuKv<'static>>>>);

/// What a kv call does with its tensors.
#[derive(Clone, Copy, Debug)]
enum KvCall {
    Push,
    Pull,
    PushPull,
}

/// Runs a kv call on device memory: `input` (push, pushpull) and `output` (pull, pushpull)
/// are `(pointer, elements)` of `dtype` on `device`; false, logged, when this process cannot
/// take them on the GPU.
#[allow(clippy::too_many_arguments)]
fn kv_call(
    py: Python<'_>,
    worker: &Worker,
    call: KvCall,
    key: u64,
    input: Option<(u64, usize)>,
    output: Option<(u64, usize)>,
    dtype: &str,
    device: usize,
) -> PyResult<bool> {
    let w = worker.get()?;
    let gpu = {
        let mut devices = worker.gpu.0.lock().unwrap_or_else(|p| p.into_inner());
        match devices.get(&device) {
            Some(gpu) => gpu.clone(),
            None => match GpuKv::shared(w, device) {
                Ok(gpu) => {
                    let gpu = Arc::new(gpu);
                    devices.insert(device, gpu.clone());
                    gpu
                }
                Err(e) => return Ok(staged_instead(&e.to_string())),
            },
        }
    };
    // The same steps for every type; `$push`, `$pull`, `$pushpull` are `GpuKv`'s calls for it.
    macro_rules! on_gpu {
        ($e:ty, $push:ident, $pull:ident, $pushpull:ident) => {{
            let lent = |range: Option<(u64, usize)>| match range {
                Some(range) => borrow::<$e>(device, range).map(Some),
                None => Some(None),
            };
            let (Some(input), Some(output)) = (lent(input), lent(output)) else {
                return Ok(false);
            };
            match (call, input, output) {
                (KvCall::Push, Some(i), None) => {
                    worker.run(py, async { gpu.$push(key, &i.view()).await })?
                }
                (KvCall::Pull, None, Some(mut o)) => {
                    worker.run(py, async { gpu.$pull(key, &mut o.view_mut()).await })?
                }
                (KvCall::PushPull, Some(i), Some(mut o)) => worker.run(py, async {
                    gpu.$pushpull(key, &i.view(), &mut o.view_mut()).await
                })?,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "{call:?}: the wrong tensors for the call (internal error)"
                    )))
                }
            }
            Ok(true)
        }};
    }
    match dtype {
        "float32" => on_gpu!(f32, push, pull, pushpull),
        "float16" => on_gpu!(f16, push_half, pull_half, pushpull_half),
        "bfloat16" => on_gpu!(bf16, push_half, pull_half, pushpull_half),
        other => Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{call:?}: the kvstore holds float32, float16 and bfloat16 values, not {other}"
        ))),
    }
}

/// Device memory of a tensor the Python caller lends for one call.
fn borrow<E: DeviceRepr>(device: usize, (ptr, len): (u64, usize)) -> Option<BorrowedDevice<E>> {
    // SAFETY: the Python caller passes a live, contiguous CUDA tensor's `data_ptr()`,
    // `numel()` and device index, keeps the tensor referenced for the whole call, and has
    // synchronized torch's current stream, so nothing queued there still touches it. A
    // pushpull in place lends one tensor as input and output: `GpuKv` reads all of the input
    // (quantizing it, or sending it) before it writes the output. `BorrowedDevice::new` checks
    // with the driver that both ends of the range are that device's memory, aligned for `E`.
    match unsafe { BorrowedDevice::<E>::new(device, ptr, len) } {
        Ok(memory) => Some(memory),
        Err(e) => {
            staged_instead(&e.to_string());
            None
        }
    }
}

/// Pushes `numel` elements of `dtype` at device address `ptr` on `device` for `key` (see
/// `Worker.push`); `False` when this process cannot take them on the GPU.
#[pyfunction]
pub(crate) fn kv_push_cuda(
    py: Python<'_>,
    worker: &Worker,
    key: u64,
    ptr: u64,
    numel: usize,
    dtype: &str,
    device: usize,
) -> PyResult<bool> {
    let input = Some((ptr, numel));
    kv_call(py, worker, KvCall::Push, key, input, None, dtype, device)
}

/// Pulls `key` into `numel` elements of `dtype` at device address `ptr` on `device`.
#[pyfunction]
pub(crate) fn kv_pull_cuda(
    py: Python<'_>,
    worker: &Worker,
    key: u64,
    ptr: u64,
    numel: usize,
    dtype: &str,
    device: usize,
) -> PyResult<bool> {
    let output = Some((ptr, numel));
    kv_call(py, worker, KvCall::Pull, key, None, output, dtype, device)
}

/// Pushes the elements at `ptr` and pulls the result into those at `out` (the same address
/// for a pushpull in place).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn kv_pushpull_cuda(
    py: Python<'_>,
    worker: &Worker,
    key: u64,
    ptr: u64,
    out: u64,
    numel: usize,
    dtype: &str,
    device: usize,
) -> PyResult<bool> {
    let (input, output) = (Some((ptr, numel)), Some((out, numel)));
    kv_call(
        py,
        worker,
        KvCall::PushPull,
        key,
        input,
        output,
        dtype,
        device,
    )
}
