//! A blocking front end for programs that are not async (plain threads, the Python package):
//! the communicator lives on a runtime of its own whose one thread carries the traffic while
//! the caller's thread computes. Every call has a blocking form, and the calls on owned
//! buffers a non-blocking one returning a [`Handle`] to wait on (issue now, wait when the
//! result is needed, as NCCL's and Horovod's handles). Calls pair up across ranks in the
//! order they are made, blocking and non-blocking alike.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use psnet_transport::Transport;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::comm::Communicator;
use crate::config::Config;
use crate::element::{Element, ReduceOp};
use crate::error::CollectiveError;

/// A call under way; [`Handle::wait`] returns its result.
#[must_use = "a call's errors are only seen by waiting on it"]
pub struct Handle<R> {
    runtime: tokio::runtime::Handle,
    task: JoinHandle<Result<R, CollectiveError>>,
}

impl<R> Handle<R> {
    /// Blocks until the call is done. Not from inside an async runtime.
    pub fn wait(self) -> Result<R, CollectiveError> {
        self.runtime.block_on(self.task).unwrap_or_else(|e| {
            Err(CollectiveError::Cancelled(format!(
                "the call's task ended: {e}"
            )))
        })
    }

    /// Whether the call is done (then [`Handle::wait`] returns at once).
    pub fn is_done(&self) -> bool {
        self.task.is_finished()
    }
}

/// A communicator with its own background runtime, for callers that are not async. Its
/// blocking calls and [`Handle::wait`] must not be made from inside an async runtime (tokio
/// refuses to block a runtime's thread).
pub struct BlockingCommunicator<T: Transport> {
    // Declared first: dropped (its reading task stopped) before the runtime shuts down.
    comm: Arc<Communicator<T>>,
    runtime: Runtime,
}

fn runtime_error(e: std::io::Error) -> CollectiveError {
    CollectiveError::Transport(format!("cannot start the communicator's runtime: {e}"))
}

impl<T: Transport> BlockingCommunicator<T> {
    /// Joins as `rank` of `size` meeting at `root` (see [`Communicator::join`]) over the
    /// transport `bind` builds; it runs on the communicator's runtime, where the transport's
    /// tasks live.
    pub fn join<F, Fut>(
        bind: F,
        rank: usize,
        size: usize,
        root: SocketAddr,
        config: Config,
    ) -> Result<Self, CollectiveError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, CollectiveError>>,
    {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("psnet-collectives")
            .enable_all()
            .build()
            .map_err(runtime_error)?;
        let comm = runtime.block_on(async move {
            let transport = Arc::new(bind().await?);
            Communicator::join(transport, rank, size, root, config).await
        })?;
        Ok(BlockingCommunicator {
            comm: Arc::new(comm),
            runtime,
        })
    }

    /// The communicator, for its async calls (on [`BlockingCommunicator::runtime`]).
    pub fn communicator(&self) -> &Arc<Communicator<T>> {
        &self.comm
    }

    /// The runtime the communicator lives on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.runtime.handle()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    fn spawn<R: Send + 'static>(
        &self,
        call: impl Future<Output = Result<R, CollectiveError>> + Send + 'static,
    ) -> Handle<R> {
        Handle {
            runtime: self.runtime.handle().clone(),
            task: self.runtime.spawn(call),
        }
    }

    /// [`Communicator::allreduce`], blocking.
    pub fn allreduce<E: Element>(
        &self,
        buf: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.runtime.block_on(self.comm.allreduce(buf, op))
    }

    /// [`Communicator::allreduce_into`], blocking.
    pub fn allreduce_into<E: Element>(
        &self,
        send: &[E],
        recv: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.runtime
            .block_on(self.comm.allreduce_into(send, recv, op))
    }

    /// [`Communicator::reduce_scatter`], blocking.
    pub fn reduce_scatter<E: Element>(
        &self,
        send: &[E],
        recv: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.runtime
            .block_on(self.comm.reduce_scatter(send, recv, op))
    }

    /// [`Communicator::allgather`], blocking.
    pub fn allgather<E: Element>(&self, send: &[E], recv: &mut [E]) -> Result<(), CollectiveError> {
        self.runtime.block_on(self.comm.allgather(send, recv))
    }

    /// [`Communicator::broadcast`], blocking.
    pub fn broadcast<E: Element>(&self, buf: &mut [E], root: usize) -> Result<(), CollectiveError> {
        self.runtime.block_on(self.comm.broadcast(buf, root))
    }

    /// [`Communicator::reduce_into`], blocking.
    pub fn reduce_into<E: Element>(
        &self,
        send: &[E],
        recv: &mut [E],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CollectiveError> {
        self.runtime
            .block_on(self.comm.reduce_into(send, recv, op, root))
    }

    /// [`Communicator::barrier`], blocking.
    pub fn barrier(&self) -> Result<(), CollectiveError> {
        self.runtime.block_on(self.comm.barrier())
    }

    /// [`Communicator::allreduce_owned`], not blocking: wait on the handle for the result.
    pub fn allreduce_async<E: Element>(&self, buf: Vec<E>, op: ReduceOp) -> Handle<Vec<E>> {
        self.spawn(self.comm.allreduce_owned(buf, op))
    }

    /// [`Communicator::broadcast_owned`], not blocking.
    pub fn broadcast_async<E: Element>(&self, buf: Vec<E>, root: usize) -> Handle<Vec<E>> {
        self.spawn(self.comm.broadcast_owned(buf, root))
    }

    /// [`Communicator::allgather_owned`], not blocking.
    pub fn allgather_async<E: Element>(&self, send: Vec<E>) -> Handle<Vec<E>> {
        self.spawn(self.comm.allgather_owned(send))
    }

    /// [`Communicator::barrier_owned`], not blocking.
    pub fn barrier_async(&self) -> Handle<()> {
        self.spawn(self.comm.barrier_owned())
    }
}
