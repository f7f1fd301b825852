//! Calls whose futures own what they work on (the communicator through an `Arc`, the
//! buffers as `Vec`s), so they can be spawned and waited for later, as NCCL's and Horovod's
//! handles are. Like every call, each takes its place in the order of calls when it is made.

use std::future::Future;
use std::sync::Arc;

use psnet_transport::Transport;

use crate::comm::Communicator;
use crate::element::{Element, ReduceOp};
use crate::error::CollectiveError;

impl<T: Transport> Communicator<T> {
    /// [`Communicator::allreduce`] of an owned buffer; the future returns it reduced.
    pub fn allreduce_owned<E: Element>(
        self: &Arc<Self>,
        mut buf: Vec<E>,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Vec<E>, CollectiveError>> + Send + 'static {
        let seq = self.order.take();
        let comm = self.clone();
        async move {
            let prepared = comm.prepare_allreduce::<E>(buf.len(), op);
            comm.allreduce_in_turn(comm.ticket_for(seq), &mut buf, prepared, op)
                .await
                .map(|()| buf)
        }
    }

    /// [`Communicator::broadcast`] of an owned buffer; the future returns it with `root`'s
    /// values.
    pub fn broadcast_owned<E: Element>(
        self: &Arc<Self>,
        mut buf: Vec<E>,
        root: usize,
    ) -> impl Future<Output = Result<Vec<E>, CollectiveError>> + Send + 'static {
        let seq = self.order.take();
        let comm = self.clone();
        async move {
            let prepared = comm.prepare_broadcast::<E>(buf.len(), root);
            comm.run(comm.ticket_for(seq), prepared, &mut buf)
                .await
                .map(|()| buf)
        }
    }

    /// [`Communicator::allgather`] of an owned block; the future returns every rank's, in
    /// rank order.
    pub fn allgather_owned<E: Element>(
        self: &Arc<Self>,
        send: Vec<E>,
    ) -> impl Future<Output = Result<Vec<E>, CollectiveError>> + Send + 'static {
        let seq = self.order.take();
        let comm = self.clone();
        async move {
            let mut recv = vec![E::zeroed(); send.len() * comm.size()];
            comm.allgather_in_turn(comm.ticket_for(seq), &send, &mut recv)
                .await
                .map(|()| recv)
        }
    }

    /// [`Communicator::barrier`], owning the communicator.
    pub fn barrier_owned(
        self: &Arc<Self>,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'static {
        let seq = self.order.take();
        let comm = self.clone();
        async move { comm.barrier_in_turn(comm.ticket_for(seq)).await }
    }
}
