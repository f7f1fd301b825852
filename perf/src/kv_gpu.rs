//! `psnet-perf kv --gpu`: the kv phases from GPU buffers (feature `cuda`), measured in the
//! same job right after the same sizes from host memory, so the two compare like with like.
//! Keys in flight go one after another here (GpuKv has no many-key call yet).

use psnet::compression::cuda::context;
use psnet::compression::cuda::cudarc::driver::CudaSlice;
use psnet::compression::CompressionError;
use psnet::kv::{GpuKv, KvError, Worker};

use crate::kv::{default_iters, size_keys, time_phases, KvRow, Ops};
use crate::session::PerfResult;

struct GpuOps<'a> {
    gpu: &'a GpuKv<'a>,
    keys: Vec<u64>,
    values: CudaSlice<f32>,
    outs: Vec<CudaSlice<f32>>,
}

impl Ops for GpuOps<'_> {
    async fn push(&mut self) -> Result<(), KvError> {
        for &key in &self.keys {
            self.gpu.push(key, &self.values.slice(..)).await?;
        }
        Ok(())
    }

    async fn pull(&mut self) -> Result<(), KvError> {
        for (&key, out) in self.keys.iter().zip(&mut self.outs) {
            self.gpu.pull(key, &mut out.slice_mut(..)).await?;
        }
        Ok(())
    }

    async fn pushpull(&mut self) -> Result<(), KvError> {
        for (&key, out) in self.keys.iter().zip(&mut self.outs) {
            self.gpu
                .pushpull(key, &self.values.slice(..), &mut out.slice_mut(..))
                .await?;
        }
        Ok(())
    }
}

/// The rows of every size from buffers on device `ordinal`.
pub async fn measure_gpu(
    kv: &Worker,
    ordinal: usize,
    sizes: &[u64],
    iters: Option<usize>,
    in_flight: usize,
) -> PerfResult<Vec<KvRow>> {
    let err = |e: KvError| e.to_string();
    let cuda = |e: String| KvError::Gpu(CompressionError::Cuda(e)).to_string();
    let gpu = GpuKv::new(kv, ordinal).map_err(err)?;
    let stream = context(ordinal)
        .map_err(|e| KvError::Gpu(e).to_string())?
        .default_stream();
    let in_flight = in_flight.max(1);
    let mut rows = Vec::new();
    for (i, &bytes) in sizes.iter().enumerate() {
        // Keys apart from the host phase's.
        let (keys, n) = size_keys(i + sizes.len(), bytes, in_flight);
        let host = vec![1.0f32; n];
        let refs: Vec<&[f32]> = keys.iter().map(|_| &host[..]).collect();
        kv.init(&keys, &refs).await.map_err(err)?;
        let values = stream.clone_htod(&host).map_err(|e| cuda(e.to_string()))?;
        let outs = (0..in_flight)
            .map(|_| stream.alloc_zeros(n).map_err(|e| cuda(e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ops = GpuOps {
            gpu: &gpu,
            keys,
            values,
            outs,
        };
        let iters = iters.unwrap_or_else(|| default_iters(bytes * in_flight as u64));
        let row = time_phases(kv, &mut ops, (n * 4) as u64, in_flight, iters).await;
        rows.push(row.map_err(err)?);
    }
    Ok(rows)
}
