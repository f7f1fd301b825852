//! Push and pull of GPU buffers (feature `cuda`).
//!
//! [`GpuKv`] gives a [`Worker`] device buffers instead of host slices: a push reads the
//! gradient from the GPU, a pull writes the value into it. Keys, layouts and sharding are the
//! worker's, and servers stay on the CPU, as BytePS's do.
//!
//! With gradient compression on, each part of a push is quantized on the GPU, its residual
//! kept on the GPU, and only the compressed bytes cross PCIe and the wire. Results are
//! bit-identical to pushing the same values from host memory: the kernels are bit-exact with
//! the CPU compressors and the parts are MXNet's. Without compression the gradient is copied
//! to the host once and pushed as a host push is.
//!
//! Work runs on the device's default stream and every call waits for its copies to finish
//! before it returns; buffers written on another stream are ordered by cudarc's events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use psnet_compression::cuda::cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use psnet_compression::cuda::{context, guarded, CudaCompressor};
use psnet_compression::{CompressionError, CompressionParams, Scheme};
use psnet_transport::Transport;

use crate::error::KvError;
use crate::proto::msg::PushFlags;
use crate::proto::worker::{Layout, PreparedPart};
use crate::worker::{answer, fill, Worker};

/// A worker's push and pull of buffers on one GPU.
pub struct GpuKv<'w, T: Transport> {
    worker: &'w Worker<T>,
    ordinal: usize,
    stream: Arc<CudaStream>,
    device: Mutex<DeviceState>,
}

/// What lives on the device between calls.
#[derive(Default)]
struct DeviceState {
    /// The compressor for the worker's compression, with the epoch it was built for.
    compressor: Option<(u64, CudaCompressor)>,
    /// Error-feedback residuals, one per key, on the device.
    residuals: HashMap<u64, CudaSlice<f32>>,
}

/// A push made ready: its parts, and the host copy of the values when they go uncompressed.
struct Staged {
    parts: Vec<(usize, PreparedPart)>,
    host: Vec<f32>,
}

fn gpu_err(e: CompressionError) -> KvError {
    KvError::Gpu(e)
}

impl<'w, T: Transport> GpuKv<'w, T> {
    /// Buffers on device `ordinal` for `worker`. Fails with [`KvError::Gpu`] holding
    /// [`CompressionError::NoCudaDevice`] (saying why) when there is no such device.
    pub fn new(worker: &'w Worker<T>, ordinal: usize) -> Result<Self, KvError> {
        let ctx = context(ordinal).map_err(gpu_err)?;
        Ok(GpuKv {
            worker,
            ordinal,
            stream: ctx.default_stream(),
            device: Mutex::new(DeviceState::default()),
        })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Pushes the device buffer `values` for `key` (see [`Worker::push`]).
    pub async fn push(&self, key: u64, values: &CudaView<'_, f32>) -> Result<(), KvError> {
        let staged = self.stage(key, values, false)?;
        let rxs = self
            .worker
            .send_pushes(&staged.parts, &[&staged.host])
            .await?;
        for rx in rxs {
            answer(rx).await?;
        }
        Ok(())
    }

    /// Pulls `key` into the device buffer `out` (see [`Worker::pull`]).
    pub async fn pull(&self, key: u64, out: &mut CudaViewMut<'_, f32>) -> Result<(), KvError> {
        let mut host = vec![0f32; out.len()];
        self.worker.pull(key, &mut host).await?;
        self.upload(&host, out)
    }

    /// Pushes `values` and pulls the updated value into `out`, in one exchange per server
    /// (see [`Worker::pushpull`]).
    pub async fn pushpull(
        &self,
        key: u64,
        values: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KvError> {
        if out.len() != values.len() {
            return Err(KvError::SizeMismatch {
                key,
                expected: values.len(),
                got: out.len(),
            });
        }
        let staged = self.stage(key, values, true)?;
        let rxs = self
            .worker
            .send_pushes(&staged.parts, &[&staged.host])
            .await?;
        let mut host = vec![0f32; out.len()];
        for ((_, pp), rx) in staged.parts.iter().zip(rxs) {
            let value = answer(rx).await?;
            let p = pp.part;
            let from = self.worker.shared.servers[p.server];
            fill(key, &mut host[p.offset..p.offset + p.len], value, from)?;
        }
        self.upload(&host, out)
    }

    /// The parts of a push of `values`: quantized on the device when compression is on,
    /// else the values copied to the host.
    fn stage(
        &self,
        key: u64,
        values: &CudaView<'_, f32>,
        pull_back: bool,
    ) -> Result<Staged, KvError> {
        let (layout, compression, epoch) = {
            let state = self.worker.shared.state();
            let layout = state.layout(key, values.len())?.clone();
            let (compression, epoch) = state.compression();
            (layout, compression, epoch)
        };
        let flags = |compressed| PushFlags {
            init: false,
            compressed,
            pull_back,
        };
        let Some((scheme, threshold)) = compression else {
            let mut host = vec![0f32; values.len()];
            guarded("copy to host", || {
                self.stream.memcpy_dtoh(values, &mut host)
            })
            .and_then(|()| guarded("synchronize", || self.stream.synchronize()))
            .map_err(gpu_err)?;
            let parts = layout
                .parts
                .iter()
                .map(|p| {
                    let part = PreparedPart {
                        key,
                        part: *p,
                        flags: flags(false),
                        compressed: None,
                    };
                    (0, part)
                })
                .collect();
            return Ok(Staged { parts, host });
        };
        let packed = self.quantize(key, values, &layout, scheme, threshold, epoch)?;
        let parts = layout
            .parts
            .iter()
            .zip(packed)
            .map(|(p, bytes)| {
                let part = PreparedPart {
                    key,
                    part: *p,
                    flags: flags(true),
                    compressed: Some(bytes),
                };
                (0, part)
            })
            .collect();
        Ok(Staged {
            parts,
            host: Vec::new(),
        })
    }

    /// Quantizes every part of `values` on the device into one buffer, copies that to the
    /// host once, and splits it into the parts' bytes.
    fn quantize(
        &self,
        key: u64,
        values: &CudaView<'_, f32>,
        layout: &Layout,
        scheme: Scheme,
        threshold: f32,
        epoch: u64,
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
        let mut host = vec![0u8; total];
        guarded("copy to host", || {
            stream.memcpy_dtoh(&packed.slice(..total), &mut host)
        })
        .and_then(|()| guarded("synchronize", || stream.synchronize()))
        .map_err(gpu_err)?;
        let mut out = Vec::with_capacity(sizes.len());
        let mut rest = &host[..];
        for size in sizes {
            let (part, tail) = rest.split_at(size);
            out.push(part.to_vec());
            rest = tail;
        }
        Ok(out)
    }

    /// Copies `host` into `out` and waits for the copy.
    fn upload(&self, host: &[f32], out: &mut CudaViewMut<'_, f32>) -> Result<(), KvError> {
        guarded("copy to device", || self.stream.memcpy_htod(host, out))
            .and_then(|()| guarded("synchronize", || self.stream.synchronize()))
            .map_err(gpu_err)
    }

    fn device(&self) -> MutexGuard<'_, DeviceState> {
        // Only this module changes the state, and no step leaves it half-changed.
        self.device.lock().unwrap_or_else(|p| p.into_inner())
    }
}
