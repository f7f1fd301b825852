//! Push and pull of GPU buffers (feature `cuda`).
//!
//! [`GpuKv`] gives a [`Worker`] device buffers instead of host slices: a push reads the
//! gradient from the GPU, a pull writes the value into it. Keys, layouts and sharding are the
//! worker's, and servers stay on the CPU, as BytePS's do.
//!
//! With gradient compression on, each part of a push is quantized on the GPU, its residual
//! kept on the GPU, and only the compressed bytes cross PCIe and the wire. Results are
//! bit-identical to pushing the same values from host memory: the kernels are bit-exact with
//! the CPU compressors and the parts are MXNet's. Without compression each part is sent from
//! the device buffer itself (a device segment, `psnet_transport::device`): the transport
//! copies it out through page-locked buffers on a stream of its own, chunk k+1 crossing PCIe
//! while chunk k is written, or lets its NIC read it in place (GPUDirect).
//!
//! Compressed bytes and pulled values cross PCIe through page-locked host buffers kept per
//! key (allocated on a key's first use), so copies run at full PCIe speed. A pull copies each
//! server's part to the device as soon as it arrives, while the other parts are awaited. Quantizing and
//! uploads run on the device's default stream, pushes' copies on the stager's; every call
//! waits for its copies to finish before it returns, and buffers written on another stream
//! are ordered by cudarc's events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use psnet_compression::cuda::cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, PinnedHostSlice, ValidAsZeroBits,
};
use psnet_compression::cuda::{
    context, guarded, pinned_zeroed, CudaCompressor, CudaStager, WaitOnDrop,
};
use psnet_compression::{CompressionError, CompressionParams, Scheme};
use psnet_transport::Transport;

use crate::error::KvError;
use crate::proto::msg::PushFlags;
use crate::proto::worker::{Layout, PreparedPart};
use crate::worker::{fill, Ask, Outgoing, Worker};

mod half;

pub use half::HalfValue;

/// A worker's push and pull of buffers on one GPU.
pub struct GpuKv<'w, T: Transport> {
    worker: WorkerRef<'w, T>,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Copies uncompressed pushes out of the device for the transport, chunk by chunk.
    stager: CudaStager,
    device: Mutex<DeviceState>,
}

/// The worker a [`GpuKv`] serves: borrowed from its owner, or shared with it (a binding that
/// keeps both in one object).
enum WorkerRef<'w, T: Transport> {
    Borrowed(&'w Worker<T>),
    Shared(Arc<Worker<T>>),
}

impl<T: Transport> std::ops::Deref for WorkerRef<'_, T> {
    type Target = Worker<T>;

    fn deref(&self) -> &Worker<T> {
        match self {
            WorkerRef::Borrowed(w) => w,
            WorkerRef::Shared(w) => w,
        }
    }
}

/// What lives on the device between calls.
#[derive(Default)]
struct DeviceState {
    /// The compressor for the worker's compression, with the epoch it was built for.
    compressor: Option<(u64, CudaCompressor)>,
    /// Error-feedback residuals, one per key, on the device.
    residuals: HashMap<u64, CudaSlice<f32>>,
    /// Page-locked host buffers, one per key (taken out while a call uses them).
    staging: HashMap<u64, Staging>,
    /// Page-locked host buffers of half-precision keys' pulls, one per key.
    half_staging: HashMap<u64, PinnedHostSlice<u8>>,
}

/// A key's page-locked host buffers.
struct Staging {
    values: PinnedHostSlice<f32>,
    /// The compressed parts, sized on first use.
    packed: Option<PinnedHostSlice<u8>>,
}

/// A compressed push made ready: its parts, with their compressed bytes.
struct Staged {
    parts: Vec<(usize, PreparedPart)>,
}

/// An error unless a pushpull's output has its input's length.
fn same_len(key: u64, values: usize, out: usize) -> Result<(), KvError> {
    if out != values {
        return Err(KvError::SizeMismatch {
            key,
            expected: values,
            got: out,
        });
    }
    Ok(())
}

fn gpu_err(e: CompressionError) -> KvError {
    KvError::Gpu(e)
}

/// The host side of a pinned buffer, once the copies queued into it have finished.
fn host_of<T: ValidAsZeroBits>(pinned: &PinnedHostSlice<T>) -> Result<&[T], KvError> {
    guarded("waiting for a copy", || pinned.as_slice()).map_err(gpu_err)
}

/// The host side of a pinned buffer to write, once the copies queued from it have finished.
fn host_of_mut<T: ValidAsZeroBits>(pinned: &mut PinnedHostSlice<T>) -> Result<&mut [T], KvError> {
    guarded("waiting for a copy", || pinned.as_mut_slice()).map_err(gpu_err)
}

impl<'w, T: Transport> GpuKv<'w, T> {
    /// Buffers on device `ordinal` for `worker`. Fails with [`KvError::Gpu`] holding
    /// [`CompressionError::NoCudaDevice`] (saying why) when there is no such device.
    pub fn new(worker: &'w Worker<T>, ordinal: usize) -> Result<Self, KvError> {
        Self::serving(WorkerRef::Borrowed(worker), ordinal)
    }

    fn serving(worker: WorkerRef<'w, T>, ordinal: usize) -> Result<Self, KvError> {
        let ctx = context(ordinal).map_err(gpu_err)?;
        Ok(GpuKv {
            worker,
            ordinal,
            stager: CudaStager::new(ordinal).map_err(gpu_err)?,
            stream: ctx.default_stream(),
            ctx,
            device: Mutex::new(DeviceState::default()),
        })
    }

    /// [`new`](Self::new) for a worker shared with its owner rather than borrowed: for a
    /// binding (Python's) that keeps the worker and its GPU buffers' state in one object.
    pub fn shared(worker: Arc<Worker<T>>, ordinal: usize) -> Result<GpuKv<'static, T>, KvError> {
        GpuKv::serving(WorkerRef::Shared(worker), ordinal)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Pushes the device buffer `values` for `key` (see [`Worker::push`]).
    pub async fn push(&self, key: u64, values: &CudaView<'_, f32>) -> Result<(), KvError> {
        if self.worker.shared.state().compression().0.is_none() {
            // Sent from the device: no host buffer needed.
            let bytes = self.stager.bytes(values);
            return self.worker.push_device::<f32>(key, &bytes).await;
        }
        let mut staging = self.take_staging(key, values.len())?;
        let result = async {
            match self.stage(key, values, false, &mut staging)? {
                None => {
                    let bytes = self.stager.bytes(values);
                    self.worker.push_device::<f32>(key, &bytes).await
                }
                Some(staged) => {
                    self.send_compressed(&staged, &staging).await?;
                    Ok(())
                }
            }
        }
        .await;
        self.put_staging(key, staging);
        result
    }

    /// Pulls `key` into the device buffer `out` (see [`Worker::pull`]). Each server's part
    /// is copied to the device as soon as it arrives (from page-locked memory, so the copy
    /// runs while the next part is awaited); the call returns once every copy is done.
    pub async fn pull(&self, key: u64, out: &mut CudaViewMut<'_, f32>) -> Result<(), KvError> {
        let mut staging = self.take_staging(key, out.len())?;
        // Dropped half-way, the call waits for the copies queued so far before `staging`
        // goes and `out` is its owner's again.
        let _wait = WaitOnDrop(self.stream.clone());
        let result = self.pull_parts(key, &mut staging, out).await;
        // Also after a failure: no copy may still read the buffer when it is reused.
        let synced = guarded("synchronize", || self.stream.synchronize()).map_err(gpu_err);
        self.put_staging(key, staging);
        result.and(synced)
    }

    /// Asks every server for its part of `key` and queues each part's copy to `out` as it
    /// lands in `staging` (the caller waits for the copies).
    async fn pull_parts(
        &self,
        key: u64,
        staging: &mut Staging,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KvError> {
        let shared = &self.worker.shared;
        let layout = shared
            .state()
            .layout(key, out.len(), crate::value::Dtype::F32)?
            .clone();
        let requests = layout
            .parts
            .iter()
            .map(|p| Outgoing {
                to: shared.servers[p.server],
                ask: Ask::Pull {
                    key: p.slot,
                    n_elems: p.len as u64,
                },
                value: None,
            })
            .collect();
        let waits = shared.send_all(requests).await?;
        let host = host_of_mut(&mut staging.values)?;
        for (p, wait) in layout.parts.iter().zip(waits) {
            let value = shared.settle(wait).await?;
            let range = p.offset..p.offset + p.len;
            fill(
                key,
                &mut host[range.clone()],
                value,
                shared.servers[p.server],
            )?;
            // Page-locked source: queued, not waited for. Each part's range is written once,
            // before its copy is queued.
            guarded("copy to device", || {
                self.stream
                    .memcpy_htod(&host[range.clone()], &mut out.slice_mut(range.clone()))
            })
            .map_err(gpu_err)?;
        }
        Ok(())
    }

    /// Pushes `values` and pulls the updated value into `out`, in one exchange per server
    /// (see [`Worker::pushpull`]).
    pub async fn pushpull(
        &self,
        key: u64,
        values: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KvError> {
        same_len(key, values.len(), out.len())?;
        let mut staging = self.take_staging(key, out.len())?;
        let result = async {
            match self.stage(key, values, true, &mut staging)? {
                None => {
                    let bytes = self.stager.bytes(values);
                    let host = host_of_mut(&mut staging.values)?;
                    self.worker
                        .pushpull_device::<f32>(key, &bytes, host)
                        .await?;
                }
                Some(staged) => {
                    // Every answer first: a server that restarts gets the pushes again.
                    let answers = self.send_compressed(&staged, &staging).await?;
                    let host = host_of_mut(&mut staging.values)?;
                    for ((_, pp), value) in staged.parts.iter().zip(answers) {
                        let p = pp.part;
                        let from = self.worker.shared.servers[p.server];
                        fill(key, &mut host[p.offset..p.offset + p.len], value, from)?;
                    }
                }
            }
            self.upload(&staging.values, out)
        }
        .await;
        self.put_staging(key, staging);
        result
    }

    /// Sends the compressed parts of `staged` and waits for every answer, in the parts' order.
    async fn send_compressed(
        &self,
        staged: &Staged,
        staging: &Staging,
    ) -> Result<Vec<Option<bytes::Bytes>>, KvError> {
        // Every part carries its compressed bytes: the host values are not read.
        let host = host_of(&staging.values)?;
        let mut answers = Vec::with_capacity(staged.parts.len());
        for wait in self.worker.send_pushes(&staged.parts, &[host]).await? {
            answers.push(self.worker.shared.settle(wait).await?);
        }
        Ok(answers)
    }

    /// The parts of a push of `values`, quantized on the device; None when compression is off
    /// (the worker then sends the values from the device, [`Worker::push_device`]).
    fn stage(
        &self,
        key: u64,
        values: &CudaView<'_, f32>,
        pull_back: bool,
        staging: &mut Staging,
    ) -> Result<Option<Staged>, KvError> {
        let (layout, compression, epoch) = {
            let state = self.worker.shared.state();
            state.dense_push(key)?;
            let layout = state
                .layout(key, values.len(), crate::value::Dtype::F32)?
                .clone();
            let (compression, epoch) = state.compression();
            (layout, compression, epoch)
        };
        let Some((scheme, threshold)) = compression else {
            return Ok(None);
        };
        let flags = PushFlags {
            init: false,
            compressed: true,
            pull_back,
            retry: None,
            dtype: crate::value::Dtype::F32,
            have: None,
            packed: false,
        };
        let packed = self.quantize(key, values, &layout, (scheme, threshold, epoch), staging)?;
        let parts = layout
            .parts
            .iter()
            .zip(packed)
            .map(|(p, bytes)| {
                let part = PreparedPart {
                    key,
                    part: *p,
                    flags,
                    compressed: Some(bytes),
                };
                (0, part)
            })
            .collect();
        Ok(Some(Staged { parts }))
    }

    /// Quantizes every part of `values` on the device into one buffer, copies that to the
    /// host once, and splits it into the parts' bytes.
    fn quantize(
        &self,
        key: u64,
        values: &CudaView<'_, f32>,
        layout: &Layout,
        (scheme, threshold, epoch): (Scheme, f32, u64),
        staging: &mut Staging,
    ) -> Result<Vec<Vec<u8>>, KvError> {
        let mut device = self.device();
        let device = &mut *device;
        let current = matches!(&device.compressor, Some((e, c))
            if *e == epoch && c.scheme() == scheme && c.threshold().to_bits() == threshold.to_bits());
        if !current {
            let params = match scheme {
                Scheme::TwoBit => CompressionParams::two_bit(threshold),
                Scheme::OneBit => CompressionParams::one_bit(threshold),
            }
            .map_err(|e| gpu_err(e.into()))?;
            let compressor = CudaCompressor::new(self.ordinal, &params).map_err(gpu_err)?;
            device.compressor = Some((epoch, compressor));
            device.residuals.clear();
        }
        let Some((_, compressor)) = &device.compressor else {
            unreachable!("set just above")
        };
        let stream = compressor.stream();
        let residual = match device.residuals.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(
                guarded("allocating a residual", || stream.alloc_zeros(layout.len))
                    .map_err(gpu_err)?,
            ),
        };
        let sizes: Vec<usize> = layout
            .parts
            .iter()
            .map(|p| compressor.compressed_len(p.len))
            .collect();
        let total = sizes.iter().sum::<usize>();
        let mut packed: CudaSlice<u8> = guarded("allocating the compressed buffer", || {
            stream.alloc_zeros(total.max(1))
        })
        .map_err(gpu_err)?;
        let mut at = 0;
        for (p, &size) in layout.parts.iter().zip(&sizes) {
            let range = p.offset..p.offset + p.len;
            compressor
                .quantize_view(
                    &values.slice(range.clone()),
                    &mut residual.slice_mut(range),
                    &mut packed.slice_mut(at..at + size),
                )
                .map_err(gpu_err)?;
            at += size;
        }
        if staging.packed.as_ref().map(|p| p.len()) != Some(total) {
            staging.packed = Some(pinned_zeroed(&self.ctx, total).map_err(gpu_err)?);
        }
        let Some(host) = staging.packed.as_mut() else {
            unreachable!("sized just above")
        };
        guarded("copy to host", || {
            stream.memcpy_dtoh(&packed.slice(..total), host)
        })
        .and_then(|()| guarded("synchronize", || stream.synchronize()))
        .map_err(gpu_err)?;
        let mut out = Vec::with_capacity(sizes.len());
        let mut rest = host_of(host)?;
        for size in sizes {
            let (part, tail) = rest.split_at(size);
            out.push(part.to_vec());
            rest = tail;
        }
        Ok(out)
    }

    /// `key`'s staging buffers for `len` elements, taken out of the state until
    /// [`put_staging`](Self::put_staging) (a concurrent call on the key gets its own).
    fn take_staging(&self, key: u64, len: usize) -> Result<Staging, KvError> {
        if let Some(s) = self.device().staging.remove(&key) {
            if s.values.len() == len {
                return Ok(s);
            }
        }
        Ok(Staging {
            values: pinned_zeroed(&self.ctx, len).map_err(gpu_err)?,
            packed: None,
        })
    }

    fn put_staging(&self, key: u64, staging: Staging) {
        self.device().staging.insert(key, staging);
    }

    /// Copies `host` into `out` and waits for the copy.
    fn upload(
        &self,
        host: &PinnedHostSlice<f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KvError> {
        guarded("copy to device", || self.stream.memcpy_htod(host, out))
            .and_then(|()| guarded("synchronize", || self.stream.synchronize()))
            .map_err(gpu_err)
    }

    fn device(&self) -> MutexGuard<'_, DeviceState> {
        // Only this module changes the state, and no step leaves it half-changed.
        self.device.lock().unwrap_or_else(|p| p.into_inner())
    }
}
