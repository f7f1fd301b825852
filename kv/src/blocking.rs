//! A blocking front end for programs that are not async: every call has a blocking form, and
//! the data calls also a non-blocking one returning a [`Handle`] to wait on (MXNet's engine
//! model: issue now, wait when the value is needed).

use std::future::Future;
use std::sync::Arc;

use psnet_transport::Transport;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::config::KvConfig;
use crate::error::KvError;
use crate::proto::server::Mode;
use crate::updater::OptimizerSpec;
use crate::value::Value;
use crate::worker::Worker;

/// A worker with its own background runtime.
pub struct KvStore<T: Transport> {
    runtime: Runtime,
    worker: Arc<Worker<T>>,
}

/// An operation under way; [`Handle::wait`] returns its result.
#[must_use = "an operation's errors are only seen by waiting on it"]
pub struct Handle<T> {
    runtime: tokio::runtime::Handle,
    task: JoinHandle<Result<T, KvError>>,
}

impl<T> Handle<T> {
    /// Blocks until the operation is done.
    pub fn wait(self) -> Result<T, KvError> {
        self.runtime
            .block_on(self.task)
            .unwrap_or_else(|e| Err(KvError::Invalid(format!("operation aborted: {e}"))))
    }

    /// Whether the operation is done (then `wait` returns at once).
    pub fn is_done(&self) -> bool {
        self.task.is_finished()
    }
}

impl<T: Transport> KvStore<T> {
    /// Joins the job as a worker over the transport `bind` builds (it runs on the store's
    /// runtime, where the transport's tasks live); the runtime's one thread carries the
    /// traffic while the caller's thread computes.
    pub fn join<F, Fut>(config: &KvConfig, bind: F) -> Result<KvStore<T>, KvError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, KvError>> + Send + 'static,
    {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| KvError::Invalid(format!("cannot start the runtime: {e}")))?;
        let worker = runtime.block_on(async {
            // Spawned, so that the worker's background tasks live on the runtime's thread.
            tokio::spawn({
                let config = config.clone();
                async move { Worker::join(&config, bind().await?).await }
            })
            .await
        });
        let worker = worker.map_err(|e| KvError::Invalid(format!("join aborted: {e}")))??;
        Ok(KvStore {
            runtime,
            worker: Arc::new(worker),
        })
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.worker.rank()
    }

    /// Number of workers.
    pub fn num_workers(&self) -> u32 {
        self.worker.num_workers()
    }

    /// Number of servers.
    pub fn num_servers(&self) -> u32 {
        self.worker.num_servers()
    }

    /// The integer key for a string key (see [`Worker::key`]).
    pub fn key(&self, name: &str) -> u64 {
        self.worker.key(name)
    }

    /// See [`Worker::init`].
    pub fn init<V: Value>(&self, keys: &[u64], values: &[&[V]]) -> Result<(), KvError> {
        self.runtime.block_on(self.worker.init(keys, values))
    }

    /// Pushes from the caller's slice, blocking until done (no copy).
    pub fn push<V: Value>(&self, key: u64, values: &[V]) -> Result<(), KvError> {
        self.runtime.block_on(self.worker.push(key, values))
    }

    /// Pulls into the caller's slice, blocking until done.
    pub fn pull<V: Value>(&self, key: u64, out: &mut [V]) -> Result<(), KvError> {
        self.runtime.block_on(self.worker.pull(key, out))
    }

    /// Push and pull in one exchange, blocking until done.
    pub fn pushpull<V: Value>(&self, key: u64, values: &[V], out: &mut [V]) -> Result<(), KvError> {
        self.runtime
            .block_on(self.worker.pushpull(key, values, out))
    }

    /// Starts a push of owned values (moved, not copied) and returns at once.
    pub fn push_async<V: Value>(&self, key: u64, values: Vec<V>) -> Handle<()> {
        let worker = self.worker.clone();
        self.spawn(async move { worker.push(key, &values).await })
    }

    /// Starts a pull into `out` (reused, not reallocated) and returns at once; the handle
    /// gives the buffer back filled.
    pub fn pull_async<V: Value>(&self, key: u64, mut out: Vec<V>) -> Handle<Vec<V>> {
        let worker = self.worker.clone();
        self.spawn(async move { worker.pull(key, &mut out).await.map(|()| out) })
    }

    /// Starts a push-pull and returns at once; the handle gives `out` back filled.
    pub fn pushpull_async<V: Value>(
        &self,
        key: u64,
        values: Vec<V>,
        mut out: Vec<V>,
    ) -> Handle<Vec<V>> {
        let worker = self.worker.clone();
        self.spawn(async move { worker.pushpull(key, &values, &mut out).await.map(|()| out) })
    }

    fn spawn<R: Send + 'static>(
        &self,
        op: impl Future<Output = Result<R, KvError>> + Send + 'static,
    ) -> Handle<R> {
        Handle {
            runtime: self.runtime.handle().clone(),
            task: self.runtime.spawn(op),
        }
    }

    /// Waits for every worker (see [`Worker::barrier`]).
    pub fn barrier(&self) -> Result<(), KvError> {
        self.runtime.block_on(self.worker.barrier())
    }

    /// See [`Worker::set_optimizer`].
    pub fn set_optimizer(&self, spec: &OptimizerSpec) -> Result<(), KvError> {
        self.runtime.block_on(self.worker.set_optimizer(spec))
    }

    /// See [`Worker::set_gradient_compression`].
    pub fn set_gradient_compression(
        &self,
        params: impl Into<crate::proto::pulled::KvCompression>,
    ) -> Result<(), KvError> {
        self.runtime
            .block_on(self.worker.set_gradient_compression(params))
    }

    /// See [`Worker::set_mode`].
    pub fn set_mode(&self, mode: Mode) -> Result<(), KvError> {
        self.runtime.block_on(self.worker.set_mode(mode))
    }

    /// See [`Worker::save_checkpoint`].
    pub fn save_checkpoint(&self) -> Result<(), KvError> {
        self.runtime.block_on(self.worker.save_checkpoint())
    }

    /// Leaves the job (see [`Worker::finalize`]). Operations still under way must have been
    /// waited on.
    pub fn finalize(self) -> Result<(), KvError> {
        let KvStore { runtime, worker } = self;
        let worker = Arc::try_unwrap(worker).map_err(|_| {
            KvError::Invalid("finalize while non-blocking operations are still running".into())
        })?;
        runtime.block_on(worker.finalize())
    }
}
