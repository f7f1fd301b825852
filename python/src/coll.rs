//! Collectives from Python: a communicator of the job's ranks, reducing NumPy arrays in
//! place.

use std::sync::Arc;

use numpy::{Element as NpElement, PyUntypedArray, PyUntypedArrayMethods};
use psnet::AnyTransport;
use psnet_collectives::{Communicator, Element, ReduceOp};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::{self, with_element, Kind};
use crate::error;
use crate::wait::{runtime, wait};

/// A communicator of every rank of the job, joined from psnet's (`PSNET_RANK`,
/// `PSNET_WORLD_SIZE`, `PSNET_ROOT_ADDR`), torchrun's, mpirun's or Slurm's variables.
#[pyclass(module = "psnet._psnet", frozen)]
pub(crate) struct Comm {
    /// Shared by the communicators split from this one: they share its transport, whose
    /// tasks run here.
    runtime: Arc<tokio::runtime::Runtime>,
    pub(crate) comm: Arc<Communicator<AnyTransport>>,
    /// The GPU stages of `allreduce_cuda`.
    pub(crate) gpu: crate::cuda::Stages,
}

fn op_of(op: &str) -> PyResult<ReduceOp> {
    op.parse::<ReduceOp>().map_err(PyValueError::new_err)
}

/// Integer elements, which have no average.
fn is_integer(kind: Kind) -> bool {
    matches!(kind, Kind::I32 | Kind::I64 | Kind::U8)
}

fn elements(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    Ok(obj.cast::<PyUntypedArray>()?.len())
}

impl Comm {
    pub(crate) fn run(
        &self,
        py: Python<'_>,
        call: impl std::future::Future<Output = Result<(), psnet_collectives::CollectiveError>> + Send,
    ) -> PyResult<()> {
        self.usable()?;
        wait(py, &self.runtime, async { call.await.map_err(error::coll) })
    }

    /// Runs a point-to-point call: outside the order of collective calls, so a communicator
    /// failed by a collective still sends and receives between the ranks that are there.
    pub(crate) fn run_p2p<R: Send>(
        &self,
        py: Python<'_>,
        call: impl std::future::Future<Output = Result<R, psnet_collectives::CollectiveError>> + Send,
    ) -> PyResult<R> {
        wait(py, &self.runtime, async { call.await.map_err(error::coll) })
    }

    /// An error if an earlier call failed the communicator (its ranks no longer agree on
    /// what comes next).
    fn usable(&self) -> PyResult<()> {
        match self.comm.failure() {
            Some(e) => Err(error::CollectiveError::new_err(format!(
                "this communicator failed in an earlier call and cannot be used: {e}"
            ))),
            None => Ok(()),
        }
    }

    /// Checks made here, before the call takes its turn: a call refused by the communicator
    /// fails it on every rank, an argument refused here only raises.
    fn check_op(kind: Kind, op: ReduceOp, what: &str) -> PyResult<()> {
        if op == ReduceOp::Avg && is_integer(kind) {
            return Err(PyValueError::new_err(format!(
                "{what}: avg is for floating-point elements, not {}",
                kind.name()
            )));
        }
        Ok(())
    }

    fn check_root(&self, root: usize, what: &str) -> PyResult<()> {
        if root >= self.comm.size() {
            return Err(PyValueError::new_err(format!(
                "{what}: root {root} is not a rank of {} ranks",
                self.comm.size()
            )));
        }
        Ok(())
    }

    fn check_len(what: &str, got: usize, want: usize, rule: &str) -> PyResult<()> {
        if got != want {
            return Err(PyValueError::new_err(format!(
                "{what}: {got} elements where {rule} makes {want}"
            )));
        }
        Ok(())
    }

    fn allreduce_t<E: Element + NpElement>(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        op: ReduceOp,
    ) -> PyResult<()> {
        let mut b = arrays::write::<E>(buf, "allreduce")?;
        let s = arrays::elems_mut(&mut b, "allreduce")?;
        self.run(py, self.comm.allreduce(s, op))
    }

    fn broadcast_t<E: Element + NpElement>(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        root: usize,
    ) -> PyResult<()> {
        let mut b = arrays::write::<E>(buf, "broadcast")?;
        let s = arrays::elems_mut(&mut b, "broadcast")?;
        self.run(py, self.comm.broadcast(s, root))
    }

    fn allgather_t<E: Element + NpElement>(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let s = arrays::read_apart::<E>(send, recv, "allgather send")?;
        let mut r = arrays::write::<E>(recv, "allgather recv")?;
        let s = s.elems("allgather send")?;
        let r = arrays::elems_mut(&mut r, "allgather recv")?;
        self.run(py, self.comm.allgather(s, r))
    }

    fn reduce_scatter_t<E: Element + NpElement>(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        op: ReduceOp,
    ) -> PyResult<()> {
        let s = arrays::read_apart::<E>(send, recv, "reduce_scatter send")?;
        let mut r = arrays::write::<E>(recv, "reduce_scatter recv")?;
        let s = s.elems("reduce_scatter send")?;
        let r = arrays::elems_mut(&mut r, "reduce_scatter recv")?;
        self.run(py, self.comm.reduce_scatter(s, r, op))
    }

    fn reduce_t<E: Element + NpElement>(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        op: ReduceOp,
        root: usize,
    ) -> PyResult<()> {
        let s = arrays::read_apart::<E>(send, recv, "reduce send")?;
        let mut r = arrays::write::<E>(recv, "reduce recv")?;
        let s = s.elems("reduce send")?;
        let r = arrays::elems_mut(&mut r, "reduce recv")?;
        self.run(py, self.comm.reduce_into(s, r, op, root))
    }
}

/// The element type shared by `a` and `b`.
fn pair_kind(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>, what: &str) -> PyResult<Kind> {
    let kind = arrays::kind_of(a, what)?;
    arrays::expect_kind(b, kind, what)?;
    Ok(kind)
}

#[pymethods]
impl Comm {
    /// Joins every rank of the job (rank 0 listens at the root address).
    #[staticmethod]
    fn join(py: Python<'_>) -> PyResult<Comm> {
        let runtime = runtime("collectives")?;
        let handle = runtime.handle().clone();
        let comm = wait(py, &runtime, async move {
            // Spawned, so that the transport's tasks live on the runtime's thread.
            handle
                .spawn(psnet::collectives::join_from_env())
                .await
                .map_err(|e| error::CollectiveError::new_err(format!("join aborted: {e}")))?
                .map_err(error::coll)
        })?;
        Ok(Comm {
            runtime: Arc::new(runtime),
            comm: Arc::new(comm),
            gpu: crate::cuda::Stages::default(),
        })
    }

    /// Joins as `rank` of `size` ranks, rank 0 listening at `root` (`"host:port"`): for
    /// launchers whose rendezvous hands out the root address (torch.distributed's store).
    #[staticmethod]
    fn join_world(py: Python<'_>, rank: usize, size: usize, root: &str) -> PyResult<Comm> {
        let root = root.parse().map_err(|_| {
            PyValueError::new_err(format!(
                "root {root:?}: expected an address like 10.0.0.1:29500"
            ))
        })?;
        let world = psnet::collectives::World {
            rank,
            size,
            root,
            source: "the caller's rendezvous".into(),
        };
        let config = psnet::collectives::config_from_env().map_err(error::coll)?;
        let runtime = runtime("collectives")?;
        let handle = runtime.handle().clone();
        let comm = wait(py, &runtime, async move {
            handle
                .spawn(async move { psnet::collectives::join(&world, config).await })
                .await
                .map_err(|e| error::CollectiveError::new_err(format!("join aborted: {e}")))?
                .map_err(error::coll)
        })?;
        Ok(Comm {
            runtime: Arc::new(runtime),
            comm: Arc::new(comm),
            gpu: crate::cuda::Stages::default(),
        })
    }

    /// Splits the ranks by `colour`, as `MPI_Comm_split`: the ranks that pass the same colour
    /// form a new communicator over this one's connections, ranked by `key` (ties by rank).
    /// Every rank calls it, in the order of its collective calls; one that passes `None`
    /// gets `None`.
    #[pyo3(signature = (colour, key=0))]
    fn split(&self, py: Python<'_>, colour: Option<u32>, key: i64) -> PyResult<Option<Comm>> {
        self.usable()?;
        let comm = self.comm.clone();
        let child = wait(py, &self.runtime, async move {
            comm.split(colour, key).await.map_err(error::coll)
        })?;
        Ok(child.map(|c| Comm {
            runtime: self.runtime.clone(),
            comm: Arc::new(c),
            gpu: crate::cuda::Stages::default(),
        }))
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.comm.size()
    }

    /// Reduces `buf` across the ranks in place (`op`: sum, prod, min, max, avg).
    fn allreduce(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, op: &str) -> PyResult<()> {
        let op = op_of(op)?;
        let kind = arrays::kind_of(buf, "allreduce")?;
        Self::check_op(kind, op, "allreduce")?;
        with_element!(kind, E => self.allreduce_t::<E>(py, buf, op))
    }

    /// Every rank's `buf` ends with `root`'s.
    fn broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, root: usize) -> PyResult<()> {
        self.check_root(root, "broadcast")?;
        with_element!(arrays::kind_of(buf, "broadcast")?, E => self.broadcast_t::<E>(py, buf, root))
    }

    /// `recv` (size x `send`) ends with every rank's `send`, in rank order.
    fn allgather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let kind = pair_kind(send, recv, "allgather")?;
        let n = self.comm.size();
        Self::check_len(
            "allgather recv",
            elements(recv)?,
            n * elements(send)?,
            "ranks x send",
        )?;
        with_element!(kind, E => self.allgather_t::<E>(py, send, recv))
    }

    /// `recv` ends with the reduction of every rank's block `rank` of `send` (size x `recv`).
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<()> {
        let op = op_of(op)?;
        let kind = pair_kind(send, recv, "reduce_scatter")?;
        Self::check_op(kind, op, "reduce_scatter")?;
        let n = self.comm.size();
        Self::check_len(
            "reduce_scatter send",
            elements(send)?,
            n * elements(recv)?,
            "ranks x recv",
        )?;
        with_element!(kind, E => self.reduce_scatter_t::<E>(py, send, recv, op))
    }

    /// `root`'s `recv` ends with the reduction of every rank's `send`.
    fn reduce(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        op: &str,
        root: usize,
    ) -> PyResult<()> {
        let op = op_of(op)?;
        let kind = pair_kind(send, recv, "reduce")?;
        Self::check_op(kind, op, "reduce")?;
        self.check_root(root, "reduce")?;
        Self::check_len("reduce recv", elements(recv)?, elements(send)?, "send")?;
        with_element!(kind, E => self.reduce_t::<E>(py, send, recv, op, root))
    }

    /// Lossy allreduce of float32 `buf`: each rank's values plus its `residual` quantized
    /// with MXNet's 2-bit or 1-bit codes (`params`: `{"type": "2bit", "threshold": 0.5}` as
    /// JSON), the codes summed in rank order (the same bits everywhere); the quantization
    /// error stays in `residual` for the next call (error feedback). With two phases (more
    /// than 2 ranks, from `PSNET_COLL_COMPRESSED_TWO_PHASE` bytes) this rank's chunk of the
    /// sum is quantized again with `server_residual`
    /// ([`compressed_server_residual_len`](Self::compressed_server_residual_len) elements,
    /// none otherwise).
    #[pyo3(signature = (buf, residual, params, server_residual=None))]
    fn allreduce_compressed(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        residual: &Bound<'_, PyAny>,
        params: &str,
        server_residual: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let params = psnet_compression::CompressionParams::parse(params)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let compressor = params
            .compressor()
            .map_err(|e| PyValueError::new_err(e.to_string()))?
            .ok_or_else(|| PyValueError::new_err("allreduce_compressed: compression type none"))?;
        arrays::expect_kind(buf, Kind::F32, "allreduce_compressed")?;
        arrays::expect_kind(residual, Kind::F32, "allreduce_compressed residual")?;
        let mut b = arrays::write::<f32>(buf, "allreduce_compressed")?;
        let mut r = arrays::write::<f32>(residual, "allreduce_compressed residual")?;
        let b = arrays::elems_mut(&mut b, "allreduce_compressed")?;
        let r = arrays::elems_mut(&mut r, "allreduce_compressed residual")?;
        Self::check_len("allreduce_compressed residual", r.len(), b.len(), "buf")?;
        let mut s = match server_residual {
            Some(s) => {
                arrays::expect_kind(s, Kind::F32, "allreduce_compressed server_residual")?;
                Some(arrays::write::<f32>(
                    s,
                    "allreduce_compressed server_residual",
                )?)
            }
            None => None,
        };
        let mut none: [f32; 0] = [];
        let s: &mut [f32] = match s.as_mut() {
            Some(s) => arrays::elems_mut(s, "allreduce_compressed server_residual")?,
            None => &mut none,
        };
        self.run(
            py,
            self.comm.allreduce_compressed(b, r, s, compressor.as_ref()),
        )
    }

    /// Elements of the server residual `allreduce_compressed` takes on this rank for a
    /// buffer of `n` elements (0 where it allgathers every rank's codes).
    fn compressed_server_residual_len(&self, n: usize) -> usize {
        self.comm.compressed_server_residual_len(n)
    }

    /// Benchmark hook: `iterations` allreduces of float32 `buf` timed inside Rust, with no
    /// Python between them (the Rust API's time, to set Python's beside); seconds.
    fn bench_allreduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        op: &str,
        iterations: u32,
    ) -> PyResult<f64> {
        let op = op_of(op)?;
        let mut b = arrays::write::<f32>(buf, "bench_allreduce")?;
        let s = arrays::elems_mut(&mut b, "bench_allreduce")?;
        let comm = &self.comm;
        wait(py, &self.runtime, async {
            let start = std::time::Instant::now();
            for _ in 0..iterations {
                comm.allreduce(s, op).await.map_err(error::coll)?;
            }
            Ok(start.elapsed().as_secs_f64())
        })
    }

    /// Waits for every rank.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, self.comm.barrier())
    }
}
