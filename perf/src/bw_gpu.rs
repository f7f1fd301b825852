//! `psnet-perf bw --gpu`: each size sent again from GPU memory right after the host run, in
//! the same connection, so the staged (or GPUDirect) path compares like with like.

use psnet::compression::cuda::cudarc::driver::CudaSlice;
use psnet::compression::cuda::CudaStager;
use psnet::transport::{Segment, Transport};

use crate::bw;
use crate::report::BwRow;
use crate::session::PerfResult;

/// The GPU buffer every size is sent from, and the stager that copies it out.
pub struct GpuSource {
    stager: CudaStager,
    device: CudaSlice<u8>,
}

impl GpuSource {
    /// `len` bytes of the bandwidth test's pattern on device `ordinal`.
    pub fn new(ordinal: usize, len: usize) -> PerfResult<Self> {
        let stager = CudaStager::new(ordinal).map_err(|e| format!("--gpu: {e}"))?;
        let mut host = vec![0u8; len];
        bw::fill(&mut host);
        let device = stager
            .stream()
            .clone_htod(&host)
            .map_err(|e| format!("--gpu: upload: {e}"))?;
        Ok(GpuSource { stager, device })
    }

    /// [`bw::run`] with the message read from the GPU buffer's first `size` bytes.
    pub async fn run<T: Transport>(
        &self,
        t: &T,
        size: u64,
        iters: u64,
        depth: usize,
    ) -> PerfResult<BwRow> {
        let len = usize::try_from(size).map_err(|_| format!("size {size} does not fit"))?;
        let view = self.device.slice(..len);
        let bytes = self.stager.bytes(&view);
        bw::run_from(t, size, iters, depth, &[Segment::device(&bytes)]).await
    }
}
