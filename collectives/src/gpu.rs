//! Allreduce of GPU buffers (feature `cuda`), staged through page-locked host memory in a
//! pipeline of chunks: every chunk's copy to the host is queued at once on the stage's own
//! stream, and each chunk is reduced across the ranks as soon as its copy has landed, while
//! the later chunks are still copying; its result is copied back before the next chunk's
//! reduction starts. The reduction itself runs on the CPU (the ring's pieces are reduced as
//! they arrive). Each chunk is one collective call of its own, so every rank ends with the
//! same bits, those that allreduces of the same chunks from host memory give (a float sum's
//! bits depend on how the buffer is split: the chunk size is part of the result).

use std::sync::{Arc, Mutex};

use psnet_compression::cuda::cudarc::driver::{
    CudaContext, CudaStream, CudaViewMut, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use psnet_compression::cuda::{context, guarded, pinned_zeroed};
use psnet_compression::CompressionError;
use psnet_transport::Transport;

use crate::comm::Communicator;
use crate::element::{Element, ReduceOp};
use crate::error::CollectiveError;

fn gpu_err(e: CompressionError) -> CollectiveError {
    CollectiveError::Invalid(format!("GPU: {e}"))
}

/// The staging of one element type's GPU buffers on one device: a stream of its own and
/// page-locked chunks kept between calls.
pub struct GpuStage<E: DeviceRepr> {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    chunk: usize,
    pool: Mutex<Vec<PinnedHostSlice<E>>>,
}

impl<E: Element + DeviceRepr + ValidAsZeroBits> GpuStage<E> {
    /// A stage on device `ordinal` moving chunks of `chunk_bytes` (rounded to whole elements).
    /// Fails, saying why, without a CUDA driver or device.
    pub fn new(ordinal: usize, chunk_bytes: usize) -> Result<Self, CollectiveError> {
        let ctx = context(ordinal).map_err(gpu_err)?;
        let stream = guarded("creating a stream", || ctx.new_stream())
            .map_err(|e| CollectiveError::Invalid(format!("GPU: {e}")))?;
        Ok(GpuStage {
            ctx,
            stream,
            chunk: (chunk_bytes / std::mem::size_of::<E>()).max(1),
            pool: Mutex::new(Vec::new()),
        })
    }

    /// The stage's stream: the copies run on it, after what was queued there before.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn take(&self, count: usize) -> Result<Vec<PinnedHostSlice<E>>, CollectiveError> {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        let mut taken: Vec<_> = (0..count.min(pool.len()))
            .filter_map(|_| pool.pop())
            .collect();
        drop(pool);
        while taken.len() < count {
            let chunk = pinned_zeroed::<E>(&self.ctx, self.chunk).map_err(gpu_err)?;
            taken.push(chunk);
        }
        Ok(taken)
    }

    fn give_back(&self, chunks: Vec<PinnedHostSlice<E>>) {
        self.pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(chunks);
    }
}

impl<T: Transport> Communicator<T> {
    /// Reduces the GPU buffer `buf` across all ranks with `op`, staged by `stage` in chunks
    /// (see the module's documentation); every rank ends with the same bits, those of host
    /// allreduces of the same chunks. Every rank must use the same chunk size. Work queued on
    /// other streams must be finished (or ordered before the stage's stream) first. Unlike the
    /// host calls, its chunks take their places in the order of calls when it first runs (is
    /// first polled), not when it is made.
    pub async fn allreduce_device<E: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        stage: &GpuStage<E>,
        buf: &mut CudaViewMut<'_, E>,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let len = buf.len();
        let ranges: Vec<std::ops::Range<usize>> = (0..len)
            .step_by(stage.chunk)
            .map(|s| s..(s + stage.chunk).min(len))
            .collect();
        let mut chunks = stage.take(ranges.len())?;
        let stream = &stage.stream;
        // Every copy to the host queued now; an event marks each one's end.
        let mut landed = Vec::with_capacity(ranges.len());
        for (range, host) in ranges.iter().zip(chunks.iter_mut()) {
            let src = buf.slice(range.clone());
            if range.len() == stage.chunk {
                guarded("copy to host", || stream.memcpy_dtoh(&src, host)).map_err(gpu_err)?;
            } else {
                // cudarc copies as many elements as the destination holds: a shorter last
                // chunk goes into a plain slice of its length. That slice is still
                // page-locked memory, so the copy is as asynchronous as the others and the
                // event recorded after it marks its end too.
                let dst = guarded("pinned memory", || host.as_mut_slice()).map_err(gpu_err)?;
                guarded("copy to host", || {
                    stream.memcpy_dtoh(&src, &mut dst[..range.len()])
                })
                .map_err(gpu_err)?;
            }
            landed.push(guarded("event", || stream.record_event(None)).map_err(gpu_err)?);
        }
        let result = async {
            for ((range, host), event) in ranges.iter().zip(chunks.iter_mut()).zip(&landed) {
                guarded("waiting for a copy", || event.synchronize()).map_err(gpu_err)?;
                let values = guarded("pinned memory", || host.as_mut_slice()).map_err(gpu_err)?;
                let values = &mut values[..range.len()];
                self.allreduce(values, op).await?;
                // Queued, not waited for: the source is page-locked, so the driver copies it
                // asynchronously on the stage's stream while the next chunk is reduced. The
                // chunk goes back to the pool only after the stream is synchronized below.
                guarded("copy to device", || {
                    stream.memcpy_htod(&*values, &mut buf.slice_mut(range.clone()))
                })
                .map_err(gpu_err)?;
            }
            Ok(())
        }
        .await;
        let synced = guarded("synchronize", || stream.synchronize()).map_err(gpu_err);
        stage.give_back(chunks);
        result.and(synced)
    }
}
