//! Allreduce of GPU buffers (feature `cuda`), two ways.
//!
//! **Reduced on the device** ([`GpuStage::reducing_on_device`]): the call runs the plan a
//! host buffer of the same length would (the same pieces, the same order of reductions), but
//! every piece is sent straight from device memory (the transport stages it through
//! page-locked buffers, chunk k+1 crossing PCIe while chunk k is written, or lets a GPUDirect
//! NIC read it) and every piece received is copied to the device and combined there by a
//! kernel that performs the host path's operation element for element. The buffer ends with
//! the bits a host allreduce of the same values gives (NaNs made by arithmetic aside: the
//! GPU's are canonical), and the CPU does no arithmetic.
//!
//! **Reduced on the host** ([`GpuStage::new`]): staged through page-locked host memory in a
//! pipeline of chunks: every chunk's copy to the host is queued at once on the stage's own
//! stream, and each chunk is reduced across the ranks as soon as its copy has landed, while
//! the later chunks are still copying; its result is copied back before the next chunk's
//! reduction starts. The reduction itself runs on the CPU (the ring's pieces are reduced as
//! they arrive). Each chunk is one collective call of its own, so every rank ends with the
//! same bits, those that allreduces of the same chunks from host memory give (a float sum's
//! bits depend on how the buffer is split: the chunk size is part of the result).

use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use half::{bf16, f16};
use psnet_compression::cuda::cudarc::driver::{
    CudaContext, CudaStream, CudaViewMut, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use psnet_compression::cuda::{
    context, guarded, pinned_zeroed, split_view_mut, Combine, CudaLanding, CudaLandings,
    CudaReducer, CudaStager, DeviceElement, WaitOnDrop,
};
use psnet_compression::CompressionError;
use psnet_transport::{Segment, Transport};
use tokio::sync::RwLock;

use crate::comm::Communicator;
use crate::element::{DType, Element, ReduceOp};
use crate::error::CollectiveError;
use crate::payload::Payload;
use crate::pieces::{busy, send_segment, Outgoing, Pieces, Sent};
use crate::placing::{CallLandings, LandingSource};
use crate::plan::{Action, Plan};

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
    /// Set when allreduces reduce on the device.
    on_device: Option<OnDevice>,
}

/// What reducing on the device takes: a stream that copies pieces out for the transport,
/// and one that copies received pieces in and combines them.
struct OnDevice {
    stager: CudaStager,
    reducer: CudaReducer,
    /// Device memory the transport places received pieces in (`placing.rs`).
    landings: Arc<CudaLandings>,
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
            on_device: None,
        })
    }

    /// A stage on device `ordinal` whose allreduces reduce on the device (see the module's
    /// documentation). Fails, saying why, without a CUDA driver, device or NVRTC (the
    /// kernels are compiled at run time).
    pub fn reducing_on_device(ordinal: usize) -> Result<Self, CollectiveError> {
        let mut stage = Self::new(ordinal, psnet_transport::device::DEFAULT_STAGE_CHUNK)?;
        stage.on_device = Some(OnDevice {
            stager: CudaStager::new(ordinal).map_err(gpu_err)?,
            reducer: CudaReducer::new(ordinal).map_err(gpu_err)?,
            landings: Arc::new(CudaLandings::new(ordinal).map_err(gpu_err)?),
        });
        tracing::info!(
            device = ordinal,
            dtype = %E::DTYPE,
            "GPU allreduces: pieces sent from device memory and reduced on the device"
        );
        Ok(stage)
    }

    /// Whether this stage's allreduces reduce on the device.
    pub fn reduces_on_device(&self) -> bool {
        self.on_device.is_some()
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
    /// Reduces the GPU buffer `buf` across all ranks with `op` (see the module's
    /// documentation). With a stage [reducing on the device](GpuStage::reducing_on_device),
    /// every rank ends with the bits a host allreduce of the same values gives, and every rank
    /// must reduce on the device too. Otherwise the stage reduces chunk by chunk on the host:
    /// every rank ends with the bits of host allreduces of the same chunks, and every rank
    /// must use the same chunk size. Work queued on other streams must be finished (or
    /// ordered before the stage's streams) first. Unlike the host calls, it takes its place
    /// (its chunks take theirs) in the order of calls when it first runs (is first polled),
    /// not when it is made.
    pub async fn allreduce_device<E: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        stage: &GpuStage<E>,
        buf: &mut CudaViewMut<'_, E>,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        if let Some(on_device) = &stage.on_device {
            return self.allreduce_on_device(on_device, buf, op).await;
        }
        let len = buf.len();
        let ranges: Vec<std::ops::Range<usize>> = (0..len)
            .step_by(stage.chunk)
            .map(|s| s..(s + stage.chunk).min(len))
            .collect();
        let mut chunks = stage.take(ranges.len())?;
        let stream = &stage.stream;
        // Dropped half-way, the call waits for the copies queued so far before the chunks
        // are freed and `buf` is its owner's again.
        let _wait = WaitOnDrop(stream.clone());
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

    /// [`allreduce_device`](Self::allreduce_device) reducing on the device: one call, run by
    /// the plan a host buffer of the same length would get.
    async fn allreduce_on_device<E: Element + DeviceRepr>(
        &self,
        on_device: &OnDevice,
        buf: &mut CudaViewMut<'_, E>,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let ticket = self.ticket();
        let prepared = self.prepare_allreduce::<E>(buf.len(), op);
        self.run_on_device(ticket, prepared, on_device, buf).await?;
        if op == ReduceOp::Avg {
            self.divide_on_device(on_device, buf)?;
        }
        Ok(())
    }

    /// Avg's last step on the device: `buf` divided by the number of ranks, as the host
    /// path divides.
    fn divide_on_device<E: Element + DeviceRepr>(
        &self,
        on_device: &OnDevice,
        buf: &mut CudaViewMut<'_, E>,
    ) -> Result<(), CollectiveError> {
        let divisor = divisor_bits(E::DTYPE, self.size());
        on_device
            .reducer
            .divide(device_element(E::DTYPE), buf, divisor)
            .map_err(gpu_err)
    }

    /// Broadcast of a GPU buffer: every rank's `buf` ends with `root`'s. Pieces are sent
    /// from device memory and copied into the buffer on the device, by the plan a host
    /// buffer of the same length gets (so ranks broadcasting host buffers take part too). The
    /// stage must be one [reducing on the device](GpuStage::reducing_on_device); with any
    /// other the call fails, on every rank.
    pub async fn broadcast_device<E: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        stage: &GpuStage<E>,
        buf: &mut CudaViewMut<'_, E>,
        root: usize,
    ) -> Result<(), CollectiveError> {
        let ticket = self.ticket();
        let prepared = self.prepare_broadcast::<E>(buf.len(), root);
        self.on_device_only(stage, ticket, prepared, buf, "broadcast_device")
            .await
    }

    /// Allgather in place of a GPU buffer (as [`Communicator::allgather_in_place`]): `buf`
    /// holds one block per rank, this rank's block filled in; afterwards every block holds
    /// its rank's. Pieces are sent from device memory and copied in on the device, by the
    /// plan a host buffer gets (ranks gathering host buffers take part too). The stage must
    /// be one [reducing on the device](GpuStage::reducing_on_device).
    pub async fn allgather_in_place_device<E: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        stage: &GpuStage<E>,
        buf: &mut CudaViewMut<'_, E>,
    ) -> Result<(), CollectiveError> {
        let ticket = self.ticket();
        let prepared = self.prepare_allgather::<E>(buf.len());
        self.on_device_only(stage, ticket, prepared, buf, "allgather_in_place_device")
            .await
    }

    /// Reduce-scatter in place of a GPU buffer (as
    /// [`Communicator::reduce_scatter_in_place`]): `buf` holds one block per rank; afterwards
    /// block `rank` holds the reduction of every rank's block `rank`, with the bits the host
    /// call gives. Reduced on the device by the host plan, so ranks reducing host buffers
    /// take part too. The stage must be one [reducing on the
    /// device](GpuStage::reducing_on_device).
    pub async fn reduce_scatter_in_place_device<E: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        stage: &GpuStage<E>,
        buf: &mut CudaViewMut<'_, E>,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let ticket = self.ticket();
        let prepared = self.prepare_reduce_scatter::<E>(buf.len(), op);
        self.on_device_only(
            stage,
            ticket,
            prepared,
            buf,
            "reduce_scatter_in_place_device",
        )
        .await?;
        if op == ReduceOp::Avg {
            let Some(on_device) = &stage.on_device else {
                unreachable!("the call ran on the device")
            };
            let block = buf.len() / self.size();
            let mut mine = buf.slice_mut(self.rank * block..(self.rank + 1) * block);
            self.divide_on_device(on_device, &mut mine)?;
        }
        Ok(())
    }

    /// Reduce in place of a GPU buffer (as [`Communicator::reduce`]): `root`'s `buf` ends with
    /// the reduction of every rank's, with the bits the host call gives; the other ranks'
    /// are used as scratch. Reduced on the device by the host plan, so ranks reducing host
    /// buffers take part too. The stage must be one [reducing on the
    /// device](GpuStage::reducing_on_device).
    pub async fn reduce_device<E: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        stage: &GpuStage<E>,
        buf: &mut CudaViewMut<'_, E>,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CollectiveError> {
        let ticket = self.ticket();
        let prepared = self.prepare_reduce::<E>(buf.len(), op, root);
        self.on_device_only(stage, ticket, prepared, buf, "reduce_device")
            .await?;
        if op == ReduceOp::Avg && self.rank == root {
            let Some(on_device) = &stage.on_device else {
                unreachable!("the call ran on the device")
            };
            self.divide_on_device(on_device, buf)?;
        }
        Ok(())
    }

    /// Runs a prepared call on the device; with a stage that does not work on the device,
    /// fails it (on every rank), naming `what`.
    async fn on_device_only<E: Element + DeviceRepr>(
        &self,
        stage: &GpuStage<E>,
        ticket: crate::comm::Ticket<'_, T>,
        prepared: Result<(crate::wire::Call, Plan), CollectiveError>,
        buf: &mut CudaViewMut<'_, E>,
        what: &str,
    ) -> Result<(), CollectiveError> {
        match &stage.on_device {
            Some(on_device) => self.run_on_device(ticket, prepared, on_device, buf).await,
            None => {
                let refused = Err(CollectiveError::Invalid(format!(
                    "{what}: the stage does not work on the device \
                     (GpuStage::reducing_on_device makes one that does)"
                )));
                let nothing = |_: &Plan| -> Result<crate::pieces::HostPieces<'_, E>, _> {
                    unreachable!("a refused call runs no plan")
                };
                self.run_with(ticket, refused, nothing).await
            }
        }
    }

    /// Runs a prepared call's plan over `buf`'s pieces on the device, in the ticket's turn.
    async fn run_on_device<E: Element + DeviceRepr>(
        &self,
        ticket: crate::comm::Ticket<'_, T>,
        prepared: Result<(crate::wire::Call, Plan), CollectiveError>,
        on_device: &OnDevice,
        buf: &mut CudaViewMut<'_, E>,
    ) -> Result<(), CollectiveError> {
        let kind = device_element(E::DTYPE);
        // Armed before the call's turn: pieces that other ranks send early are placed too.
        let armed = prepared.as_ref().ok().and_then(|(_, plan)| {
            let expected = plan
                .receives()
                .map(|(rank, tag, len)| ((self.members[rank], tag), len))
                .collect();
            self.placing.arm(
                &*self.transport,
                self.comm,
                ticket.seq,
                on_device.landings.clone(),
                expected,
            )
        });
        let whole = buf.slice_mut(..);
        let split = |plan: &Plan| {
            let views =
                split_view_mut(whole, plan.pieces().iter().map(|r| r.len())).map_err(gpu_err)?;
            Ok(DevicePieces {
                pieces: views.into_iter().map(RwLock::new).collect(),
                on_device,
                kind,
                placed: armed.as_ref().map(|a| a.call.clone()),
            })
        };
        self.run_with(ticket, prepared, split).await
    }
}

impl LandingSource for CudaLandings {
    type Landing = CudaLanding;

    fn take(&self, len: usize) -> Result<Arc<CudaLanding>, String> {
        CudaLandings::take(self, len).map_err(|e| e.to_string())
    }
}

/// The reduction kernels' name for an element type.
fn device_element(dtype: DType) -> DeviceElement {
    match dtype {
        DType::F32 => DeviceElement::F32,
        DType::F64 => DeviceElement::F64,
        DType::F16 => DeviceElement::F16,
        DType::BF16 => DeviceElement::BF16,
        DType::I32 => DeviceElement::I32,
        DType::I64 => DeviceElement::I64,
        DType::U8 => DeviceElement::U8,
    }
}

/// The bits of `n` in `dtype`, as the host path's average divides by it
/// ([`Element::div_count`]); zero for integers, whose averages are refused before.
fn divisor_bits(dtype: DType, n: usize) -> u64 {
    match dtype {
        DType::F32 => u64::from((n as f32).to_bits()),
        DType::F64 => (n as f64).to_bits(),
        DType::F16 => u64::from(f16::from_f64(n as f64).to_bits()),
        DType::BF16 => u64::from(bf16::from_f64(n as f64).to_bits()),
        DType::I32 | DType::I64 | DType::U8 => 0,
    }
}

/// A GPU buffer's pieces: sent from device memory, reduced into on the device.
struct DevicePieces<'b, 's, E> {
    pieces: Vec<RwLock<CudaViewMut<'b, E>>>,
    on_device: &'s OnDevice,
    kind: DeviceElement,
    /// Where the transport placed received pieces, when the call was armed.
    placed: Option<Arc<CallLandings<CudaLandings>>>,
}

impl<E: Element + DeviceRepr> Pieces for DevicePieces<'_, '_, E> {
    fn send<'a, T: Transport>(
        &'a self,
        transport: &'a T,
        out: Outgoing,
        piece: usize,
    ) -> Result<BoxFuture<'a, Sent>, CollectiveError> {
        let piece = self.pieces[piece]
            .try_read()
            .map_err(|_| busy("sent while being written"))?;
        let stager = &self.on_device.stager;
        Ok(async move {
            let view = piece.as_view();
            let bytes = stager.bytes(&view);
            send_segment(transport, out, Segment::device(&bytes)).await
        }
        .boxed())
    }

    fn apply(
        &self,
        piece: usize,
        action: Action,
        op: ReduceOp,
        data: &Payload,
    ) -> Result<(), CollectiveError> {
        let mut piece = self.pieces[piece]
            .try_write()
            .map_err(|_| busy("written while being sent"))?;
        let (combine, remote_first) = match action {
            Action::Copy => (Combine::Copy, false),
            Action::Reduce(order) => (
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => Combine::Sum,
                    ReduceOp::Prod => Combine::Prod,
                    ReduceOp::Min => Combine::Min,
                    ReduceOp::Max => Combine::Max,
                },
                order == crate::element::Order::RemoteFirst,
            ),
        };
        let reducer = &self.on_device.reducer;
        let applied = match data {
            Payload::Host(bytes) => {
                reducer.apply(self.kind, combine, remote_first, &mut piece, bytes)
            }
            Payload::Placed {
                from,
                result: Err(e),
                ..
            } => {
                return Err(CollectiveError::Invalid(format!(
                    "GPU: placing the piece node {from} sent in device memory: {e}"
                )))
            }
            Payload::Placed { from, tag, .. } => {
                let landing = self
                    .placed
                    .as_ref()
                    .and_then(|call| call.take(*from, *tag))
                    .ok_or_else(|| busy("placed in device memory the call did not arm"))?;
                let src = landing.view().map_err(gpu_err)?;
                reducer.apply_placed(self.kind, combine, remote_first, &mut piece, &src)
            }
        };
        applied.map_err(gpu_err)
    }
}
