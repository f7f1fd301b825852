//! The kv store from Python: a worker's calls on NumPy arrays, a scheduler's or server's
//! role, and the server optimizers for the `local` store.

use std::sync::{Arc, Mutex};

use numpy::Element;
use psnet::kv::{KvConfig, Mode, Role};
use psnet_kv::updater::OptimizerSpec;
use psnet_kv::Value;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::{self, Kind};
use crate::error;
use crate::wait::{runtime, wait};

type KvWorker = psnet::kv::Worker;

/// `DMLC_ROLE` (`"scheduler"`, `"server"`, `"worker"`), or None where no launcher started
/// this process. A half-described job (other `DMLC_*` variables without `DMLC_ROLE`) is a
/// `ValueError` naming them.
#[pyfunction]
pub(crate) fn role() -> PyResult<Option<String>> {
    if !psnet::kv::started_by_launcher().map_err(error::kv)? {
        return Ok(None);
    }
    let config = KvConfig::from_env().map_err(|e| error::kv(e.into()))?;
    Ok(Some(config.role.to_string()))
}

/// Runs this process's scheduler or server role until the job ends (as `import mxnet`
/// does) and returns the exit status for `sys.exit`: 0, or psnet's status for a failure,
/// printed to stderr first.
#[pyfunction]
pub(crate) fn run_role(py: Python<'_>) -> PyResult<i32> {
    let config = KvConfig::from_env().map_err(|e| error::kv(e.into()))?;
    if config.role == Role::Worker {
        return Err(PyValueError::new_err(
            "run_role: this process is a worker (DMLC_ROLE=worker); workers create a kvstore",
        ));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| error::PsnetError::new_err(format!("cannot start the runtime: {e}")))?;
    let role = config.role;
    let result = wait(py, &runtime, async {
        Ok(match role {
            Role::Scheduler => psnet::kv::run_scheduler(&config).await,
            _ => psnet::kv::run_server(&config).await,
        })
    })?;
    Ok(match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("psnet {role}: error: {e}");
            i32::from(e.exit_code())
        }
    })
}

/// A kv worker joined from the environment; its traffic runs on a thread of its own.
#[pyclass(module = "psnet._psnet", frozen)]
pub(crate) struct Worker {
    runtime: tokio::runtime::Runtime,
    inner: Mutex<Option<Arc<KvWorker>>>,
    /// The GPUs of `push_cuda` and its kin.
    pub(crate) gpu: crate::cuda::KvDevices,
}

impl Worker {
    pub(crate) fn get(&self) -> PyResult<Arc<KvWorker>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| error::KvError::new_err("this kvstore was closed (finalize)"))
    }

    pub(crate) fn run<R: Send>(
        &self,
        py: Python<'_>,
        op: impl std::future::Future<Output = Result<R, psnet_kv::KvError>> + Send,
    ) -> PyResult<R> {
        wait(py, &self.runtime, async { op.await.map_err(error::kv) })
    }
}

/// Keys and arrays of one element type, borrowed for one call.
fn read_all<'py, V: Value + Element>(
    arrays: &[Bound<'py, PyAny>],
    what: &str,
) -> PyResult<Vec<numpy::PyReadonlyArrayDyn<'py, V>>> {
    arrays.iter().map(|a| arrays::read::<V>(a, what)).collect()
}

fn slices<'a, V: Element>(
    borrowed: &'a [numpy::PyReadonlyArrayDyn<'_, V>],
    what: &str,
) -> PyResult<Vec<&'a [V]>> {
    borrowed.iter().map(|b| arrays::elems(b, what)).collect()
}

/// The one kv element type of `arrays` (float32 or float16).
fn kv_kind(arrays: &[Bound<'_, PyAny>], what: &str) -> PyResult<Kind> {
    let Some(first) = arrays.first() else {
        return Ok(Kind::F32);
    };
    let kind = arrays::kind_of(first, what)?;
    if !matches!(kind, Kind::F32 | Kind::F16) {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what}: the kvstore holds float32 and float16 values, not {}",
            kind.name()
        )));
    }
    for a in &arrays[1..] {
        arrays::expect_kind(a, kind, what)?;
    }
    Ok(kind)
}

impl Worker {
    fn push_t<V: Value + Element>(
        &self,
        py: Python<'_>,
        keys: &[u64],
        values: &[Bound<'_, PyAny>],
    ) -> PyResult<()> {
        let borrowed = read_all::<V>(values, "push")?;
        let slices = slices(&borrowed, "push")?;
        let w = self.get()?;
        self.run(py, w.push_many(keys, &slices))
    }

    fn pull_t<V: Value + Element>(
        &self,
        py: Python<'_>,
        keys: &[u64],
        outs: &[Bound<'_, PyAny>],
    ) -> PyResult<()> {
        let mut borrowed: Vec<_> = outs
            .iter()
            .map(|o| arrays::write::<V>(o, "pull out"))
            .collect::<PyResult<_>>()?;
        let mut slices: Vec<&mut [V]> = borrowed
            .iter_mut()
            .map(|b| arrays::elems_mut(b, "pull out"))
            .collect::<PyResult<_>>()?;
        let w = self.get()?;
        self.run(py, w.pull_many(keys, &mut slices))
    }

    fn pull_rows_t<V: Value + Element>(
        &self,
        py: Python<'_>,
        key: u64,
        width: usize,
        row_ids: &[u64],
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut borrowed = arrays::write::<V>(out, "row_sparse_pull out")?;
        let slice = arrays::elems_mut(&mut borrowed, "row_sparse_pull out")?;
        let w = self.get()?;
        self.run(py, w.pull_rows(key, width, row_ids, slice))
    }

    fn init_rows_t<V: Value + Element>(
        &self,
        py: Python<'_>,
        key: u64,
        width: usize,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let borrowed = arrays::read::<V>(value, "init")?;
        let slice = arrays::elems(&borrowed, "init")?;
        let w = self.get()?;
        self.run(py, w.init_rows(key, width, slice))
    }

    fn push_rows_t<V: Value + Element>(
        &self,
        py: Python<'_>,
        key: u64,
        width: usize,
        row_ids: &[u64],
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let borrowed = arrays::read::<V>(values, "push_rows")?;
        let slice = arrays::elems(&borrowed, "push_rows")?;
        let w = self.get()?;
        self.run(py, w.push_rows(key, width, row_ids, slice))
    }

    fn pushpull_t<V: Value + Element>(
        &self,
        py: Python<'_>,
        keys: &[u64],
        values: &[Bound<'_, PyAny>],
        outs: &[Bound<'_, PyAny>],
    ) -> PyResult<()> {
        let borrowed = read_all::<V>(values, "pushpull")?;
        let (borrowed, copies, mut out_borrowed) = match write_all::<V>(outs) {
            Ok(written) => (Some(borrowed), None, written),
            Err(_) => {
                // An output that is also an input (pushpull(k, g) with out=None), or shares
                // memory with one: numpy does not lend it for writing while it is lent for
                // reading, so the inputs are copied first and the outputs borrowed again.
                let copies: Vec<Vec<V>> = slices(&borrowed, "pushpull")?
                    .iter()
                    .map(|s| s.to_vec())
                    .collect();
                drop(borrowed);
                (None, Some(copies), write_all::<V>(outs)?)
            }
        };
        let inputs: Vec<&[V]> = match (&borrowed, &copies) {
            (Some(b), _) => slices(b, "pushpull")?,
            (None, Some(c)) => c.iter().map(Vec::as_slice).collect(),
            (None, None) => Vec::new(),
        };
        let mut out_slices: Vec<&mut [V]> = out_borrowed
            .iter_mut()
            .map(|b| arrays::elems_mut(b, "pushpull out"))
            .collect::<PyResult<_>>()?;
        let w = self.get()?;
        self.run(py, w.pushpull_many(keys, &inputs, &mut out_slices))
    }

    fn init_t<V: Value + Element>(
        &self,
        py: Python<'_>,
        keys: &[u64],
        values: &[Bound<'_, PyAny>],
    ) -> PyResult<()> {
        let borrowed = read_all::<V>(values, "init")?;
        let slices = slices(&borrowed, "init")?;
        let w = self.get()?;
        self.run(py, w.init(keys, &slices))
    }
}

/// Writable borrows of pushpull's outputs.
fn write_all<'py, V: Value + Element>(
    outs: &[Bound<'py, PyAny>],
) -> PyResult<Vec<numpy::PyReadwriteArrayDyn<'py, V>>> {
    outs.iter()
        .map(|o| arrays::write::<V>(o, "pushpull out"))
        .collect()
}

fn same_len(what: &str, a: usize, b: usize) -> PyResult<()> {
    if a == b {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "{what}: {a} keys and {b} arrays"
        )))
    }
}

#[pymethods]
impl Worker {
    /// Joins the job this process was launched into as a worker (`DMLC_*` variables, as
    /// ps-lite reads them).
    #[staticmethod]
    fn join(py: Python<'_>) -> PyResult<Worker> {
        if !psnet::kv::started_by_launcher().map_err(error::kv)? {
            return Err(error::KvError::new_err(
                "a distributed kvstore needs a job: start this program under psnet-launch \
                 (psnet-launch -n 2 -s 2 python3 train.py), mpirun, srun or another DMLC \
                 launcher, which set DMLC_ROLE, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, \
                 DMLC_NUM_SERVER and DMLC_NUM_WORKER; or create('local')",
            ));
        }
        let config = KvConfig::from_env().map_err(|e| error::kv(e.into()))?;
        if config.role != Role::Worker {
            return Err(PyValueError::new_err(format!(
                "this process is the job's {} (DMLC_ROLE), not a worker",
                config.role
            )));
        }
        let runtime = runtime("kv")?;
        let handle = runtime.handle().clone();
        let worker = wait(py, &runtime, async move {
            // Spawned, so that the worker's background tasks live on the runtime's thread.
            handle
                .spawn(async move { psnet::kv::join(&config).await })
                .await
                .map_err(|e| error::KvError::new_err(format!("join aborted: {e}")))?
                .map_err(error::kv)
        })?;
        Ok(Worker {
            runtime,
            inner: Mutex::new(Some(Arc::new(worker))),
            gpu: crate::cuda::KvDevices::default(),
        })
    }

    /// This worker's rank.
    #[getter]
    fn rank(&self) -> PyResult<u32> {
        Ok(self.get()?.rank())
    }

    /// The number of workers.
    #[getter]
    fn num_workers(&self) -> PyResult<u32> {
        Ok(self.get()?.num_workers())
    }

    /// The number of servers.
    #[getter]
    fn num_servers(&self) -> PyResult<u32> {
        Ok(self.get()?.num_servers())
    }

    /// The integer key psnet uses for a string key (the same on every worker).
    fn key(&self, name: &str) -> PyResult<u64> {
        Ok(self.get()?.key(name))
    }

    /// Initializes keys with rank 0's arrays (other ranks' are ignored); every worker waits
    /// for the others.
    fn init(&self, py: Python<'_>, keys: Vec<u64>, values: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        same_len("init", keys.len(), values.len())?;
        match kv_kind(&values, "init")? {
            Kind::F16 => self.init_t::<half::f16>(py, &keys, &values),
            _ => self.init_t::<f32>(py, &keys, &values),
        }
    }

    /// Pushes arrays (one per key), in place.
    fn push(&self, py: Python<'_>, keys: Vec<u64>, values: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        same_len("push", keys.len(), values.len())?;
        match kv_kind(&values, "push")? {
            Kind::F16 => self.push_t::<half::f16>(py, &keys, &values),
            _ => self.push_t::<f32>(py, &keys, &values),
        }
    }

    /// Pulls into arrays (one per key), in place.
    fn pull(&self, py: Python<'_>, keys: Vec<u64>, outs: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        same_len("pull", keys.len(), outs.len())?;
        match kv_kind(&outs, "pull out")? {
            Kind::F16 => self.pull_t::<half::f16>(py, &keys, &outs),
            _ => self.pull_t::<f32>(py, &keys, &outs),
        }
    }

    /// Pushes `values` and pulls the result into `outs` in one exchange per key.
    fn pushpull(
        &self,
        py: Python<'_>,
        keys: Vec<u64>,
        values: Vec<Bound<'_, PyAny>>,
        outs: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        same_len("pushpull", keys.len(), values.len())?;
        same_len("pushpull", keys.len(), outs.len())?;
        let kind = kv_kind(&values, "pushpull")?;
        for o in &outs {
            arrays::expect_kind(o, kind, "pushpull out")?;
        }
        match kind {
            Kind::F16 => self.pushpull_t::<half::f16>(py, &keys, &values, &outs),
            _ => self.pushpull_t::<f32>(py, &keys, &values, &outs),
        }
    }

    /// Pulls rows `row_ids` of `key`, read as rows of `width` elements, into `out` (row
    /// `row_ids[i]` into its i-th `width` elements), in place.
    fn pull_rows(
        &self,
        py: Python<'_>,
        key: u64,
        width: usize,
        row_ids: Vec<u64>,
        out: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        match kv_kind(std::slice::from_ref(&out), "row_sparse_pull out")? {
            Kind::F16 => self.pull_rows_t::<half::f16>(py, key, width, &row_ids, &out),
            _ => self.pull_rows_t::<f32>(py, key, width, &row_ids, &out),
        }
    }

    /// Initializes `key` row-sparse, with rows of `width` elements (rank 0's `value`
    /// counts): it is pushed by rows only from now on.
    fn init_rows(
        &self,
        py: Python<'_>,
        key: u64,
        width: usize,
        value: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        match kv_kind(std::slice::from_ref(&value), "init")? {
            Kind::F16 => self.init_rows_t::<half::f16>(py, key, width, &value),
            _ => self.init_rows_t::<f32>(py, key, width, &value),
        }
    }

    /// Pushes rows `row_ids` of the row-sparse `key` (row `row_ids[i]` in the i-th `width`
    /// elements of `values`), every other row zero.
    fn push_rows(
        &self,
        py: Python<'_>,
        key: u64,
        width: usize,
        row_ids: Vec<u64>,
        values: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        match kv_kind(std::slice::from_ref(&values), "push_rows")? {
            Kind::F16 => self.push_rows_t::<half::f16>(py, key, width, &row_ids, &values),
            _ => self.push_rows_t::<f32>(py, key, width, &row_ids, &values),
        }
    }

    /// Waits for every worker.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let w = self.get()?;
        self.run(py, w.barrier())
    }

    /// Sets the servers' optimizer from its JSON spec (`{"type": "sgd", ...}`).
    fn set_optimizer(&self, py: Python<'_>, spec: &str) -> PyResult<()> {
        let spec = OptimizerSpec::parse(spec).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let w = self.get()?;
        self.run(py, w.set_optimizer(&spec))
    }

    /// Turns on gradient compression (`{"type": "2bit", "threshold": 0.5}` as JSON).
    fn set_gradient_compression(&self, py: Python<'_>, params: &str) -> PyResult<()> {
        let params = psnet_kv::proto::pulled::KvCompression::parse(params)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let w = self.get()?;
        self.run(py, w.set_gradient_compression(params))
    }

    /// `"sync"` or `"async"`.
    fn set_mode(&self, py: Python<'_>, mode: &str) -> PyResult<()> {
        let mode = match mode {
            "sync" => Mode::Sync,
            "async" => Mode::Async,
            other => {
                return Err(PyValueError::new_err(format!(
                    "mode {other:?}: expected \"sync\" or \"async\""
                )))
            }
        };
        let w = self.get()?;
        self.run(py, w.set_mode(mode))
    }

    /// Asks every server to write a snapshot of its shard (`PSNET_CHECKPOINT_DIR`).
    fn save_checkpoint(&self, py: Python<'_>) -> PyResult<()> {
        let w = self.get()?;
        self.run(py, w.save_checkpoint())
    }

    /// Benchmark hook: `iterations` push-pulls of float32 `values` into `out` timed inside
    /// Rust, with no Python between them (the Rust API's time, to set Python's beside);
    /// seconds.
    fn bench_pushpull(
        &self,
        py: Python<'_>,
        key: u64,
        values: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        iterations: u32,
    ) -> PyResult<f64> {
        let v = arrays::read::<f32>(values, "bench_pushpull")?;
        let mut o = arrays::write::<f32>(out, "bench_pushpull out")?;
        let v = arrays::elems(&v, "bench_pushpull")?;
        let o = arrays::elems_mut(&mut o, "bench_pushpull out")?;
        let w = self.get()?;
        self.run(py, async {
            let start = std::time::Instant::now();
            for _ in 0..iterations {
                w.pushpull(key, v, o).await?;
            }
            Ok::<_, psnet_kv::KvError>(start.elapsed().as_secs_f64())
        })
    }

    /// Leaves the job; every worker must call it (MXNet does at exit).
    fn finalize(&self, py: Python<'_>) -> PyResult<()> {
        let w = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            match inner.as_ref() {
                None => return Ok(()),
                // Left in place, so that a later finalize (at exit) still leaves the job.
                Some(w) if Arc::strong_count(w) > 1 => {
                    return Err(error::KvError::new_err(
                        "finalize while another thread is in a kvstore call: wait for it first",
                    ))
                }
                Some(_) => inner.take(),
            }
        };
        let Some(w) = w.and_then(Arc::into_inner) else {
            return Ok(());
        };
        self.run(py, w.finalize())
    }
}

/// One of psnet's server optimizers, applied in this process (the `local` kvstore).
#[pyclass(module = "psnet._psnet", frozen)]
pub(crate) struct Updater {
    inner: Mutex<Box<dyn psnet_kv::updater::Updater>>,
}

#[pymethods]
impl Updater {
    /// From the optimizer's JSON spec (`{"type": "sgd", "learning_rate": 0.1}`).
    #[new]
    fn new(spec: &str) -> PyResult<Updater> {
        let spec = OptimizerSpec::parse(spec).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Updater {
            inner: Mutex::new(spec.build()),
        })
    }

    /// Updates `weight` (float32) in place with `grad` for `key`.
    fn update(&self, key: u64, grad: &Bound<'_, PyAny>, weight: &Bound<'_, PyAny>) -> PyResult<()> {
        arrays::expect_kind(grad, Kind::F32, "update grad")?;
        arrays::expect_kind(weight, Kind::F32, "update weight")?;
        let g = arrays::read::<f32>(grad, "update grad")?;
        let mut w = arrays::write::<f32>(weight, "update weight")?;
        let g = arrays::elems(&g, "update grad")?;
        let w = arrays::elems_mut(&mut w, "update weight")?;
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .update(key, g, w)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// MXNet's lazy update: rows `row_ids` (increasing, of `width` elements) of `weight`
    /// (float32, in place) with `grad` (their gradients, row after row); other rows and their
    /// state stay as they are.
    fn update_rows(
        &self,
        key: u64,
        width: usize,
        row_ids: Vec<u64>,
        grad: &Bound<'_, PyAny>,
        weight: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        arrays::expect_kind(grad, Kind::F32, "update grad")?;
        arrays::expect_kind(weight, Kind::F32, "update weight")?;
        let g = arrays::read::<f32>(grad, "update grad")?;
        let mut w = arrays::write::<f32>(weight, "update weight")?;
        let g = arrays::elems(&g, "update grad")?;
        let w = arrays::elems_mut(&mut w, "update weight")?;
        let ranges: Vec<std::ops::Range<usize>> = row_ids
            .iter()
            .map(|&r| {
                let r = usize::try_from(r).unwrap_or(usize::MAX);
                r.saturating_mul(width)..r.saturating_add(1).saturating_mul(width)
            })
            .collect();
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .update_ranges(key, &ranges, g, w)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }
}
