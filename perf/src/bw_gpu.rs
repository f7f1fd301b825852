//! `psnet-perf bw --gpu`: each size sent again from GPU memory right after the host run, in
//! the same connection, so the staged (or GPUDirect) path compares like with like; then sent
//! from host memory into the server's GPU memory, each message placed there as it arrives.

use std::sync::{Arc, Mutex};

use psnet::compression::cuda::cudarc::driver::CudaSlice;
use psnet::compression::cuda::{CudaLanding, CudaLandings, CudaStager};
use psnet::transport::{NodeId, Placement, Placer, Segment, Transport};

use crate::bw;
use crate::protocol::Control;
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

/// The server's side of `bw --gpu`'s third row: each bandwidth message placed in GPU memory
/// as it arrives (the transport's [`Placer`]), one landing reused for every message of a
/// size.
#[derive(Default)]
pub struct GpuSink {
    state: Arc<SinkState>,
    installed: bool,
}

#[derive(Default)]
struct SinkState {
    /// Where the current test's messages go; None between tests.
    armed: Mutex<Option<Arc<CudaLanding>>>,
    /// Device memory on the device of the last test that asked.
    landings: Mutex<Option<(u64, CudaLandings)>>,
}

impl Placer for SinkState {
    fn place(&self, _: NodeId, meta: &[u8], _: &[u64]) -> Option<Placement> {
        if Control::decode(meta) != Ok(Control::BwData) {
            return None;
        }
        let landing = lock(&self.armed).clone()?;
        Some(Placement {
            segment: 0,
            dest: landing,
        })
    }
}

impl GpuSink {
    /// Places the next test's messages of `size` bytes in GPU `gpu`'s memory; an error if
    /// this GPU or `t` cannot.
    pub fn arm<T: Transport>(&mut self, t: &T, size: u64, gpu: u64) -> PerfResult<()> {
        if !self.installed {
            if !t.set_placer(self.state.clone()) {
                return Err(format!(
                    "--gpu: the server's transport ({}) cannot place received messages in GPU \
                     memory",
                    t.capabilities().name
                ));
            }
            self.installed = true;
        }
        let len = usize::try_from(size).map_err(|_| format!("size {size} does not fit"))?;
        let mut landings = lock(&self.state.landings);
        if landings.as_ref().is_none_or(|(on, _)| *on != gpu) {
            let ordinal = usize::try_from(gpu).map_err(|_| format!("no GPU {gpu}"))?;
            let made = CudaLandings::new(ordinal).map_err(|e| format!("--gpu: {e}"))?;
            *landings = Some((gpu, made));
        }
        let Some((_, landings)) = landings.as_ref() else {
            unreachable!("made above")
        };
        let landing = landings.take(len).map_err(|e| format!("--gpu: {e}"))?;
        *lock(&self.state.armed) = Some(landing);
        Ok(())
    }

    /// Messages go to host memory again.
    pub fn disarm(&self) {
        lock(&self.state.armed).take();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
