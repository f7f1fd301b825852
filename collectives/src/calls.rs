//! The collectives' public calls. Each takes its place in the order of calls when it is made
//! (see [`Communicator`]), checks its arguments, builds its plan and runs it in its turn. A
//! call with wrong arguments fails in its turn and fails the communicator, so that the other
//! ranks, which wait for it, hear why instead of waiting for ever.

use std::future::Future;

use psnet_transport::Transport;

use crate::comm::{Communicator, Ticket};
use crate::config::Algo;
use crate::element::{divide, Element, ReduceOp};
use crate::error::CollectiveError;
use crate::plan::{self, Plan};
use crate::wire::{Call, Coll};

type Prepared = Result<(Call, Plan), CollectiveError>;

fn same_len(a: usize, b: usize, what: &str) -> Result<(), CollectiveError> {
    if a != b {
        return Err(CollectiveError::Invalid(format!(
            "{what} differ in length ({a} and {b} elements)"
        )));
    }
    Ok(())
}

impl<T: Transport> Communicator<T> {
    fn call_of<E: Element>(&self, coll: Coll, op: ReduceOp, count: usize, root: usize) -> Call {
        Call {
            coll,
            dtype: E::DTYPE,
            op,
            count: count as u64,
            root: root as u32,
        }
    }

    fn check_op<E: Element>(&self, op: ReduceOp) -> Result<(), CollectiveError> {
        if op == ReduceOp::Avg && !E::DTYPE.is_float() {
            return Err(CollectiveError::Invalid(format!(
                "avg of {} elements: averages are for floating-point types",
                E::DTYPE
            )));
        }
        Ok(())
    }

    fn check_root(&self, root: usize) -> Result<(), CollectiveError> {
        if root >= self.size() {
            return Err(CollectiveError::Invalid(format!(
                "root {root} in a communicator of {} ranks",
                self.size()
            )));
        }
        Ok(())
    }

    fn check_blocks(&self, len: usize, what: &str) -> Result<usize, CollectiveError> {
        let n = self.size();
        if len % n != 0 {
            return Err(CollectiveError::Invalid(format!(
                "{what}: {len} elements do not split into {n} equal blocks"
            )));
        }
        Ok(len / n)
    }

    pub(crate) fn prepare_allreduce<E: Element>(&self, count: usize, op: ReduceOp) -> Prepared {
        self.check_op::<E>(op)?;
        let (rank, n, size) = (self.rank, self.size(), E::DTYPE.size());
        let bytes = count * size;
        let shm_local = self.all_local && self.transport.capabilities().same_host_shm;
        let piece = self.piece_elems(E::DTYPE);
        let plan = match allreduce_algo(&self.config, n, bytes, shm_local) {
            Algo::Doubling if n > 2 => {
                plan::doubling_allreduce(rank, n, count, size, doubling_piece(piece, count))
            }
            Algo::Doubling => plan::doubling_allreduce(rank, n, count, size, piece),
            Algo::Halving => plan::halving_allreduce(rank, n, count, size, piece),
            Algo::Ring | Algo::Auto => plan::ring_allreduce(rank, n, count, size, piece),
        };
        Ok((self.call_of::<E>(Coll::Allreduce, op, count, 0), plan))
    }

    pub(crate) async fn allreduce_in_turn<E: Element>(
        &self,
        ticket: Ticket<'_, T>,
        buf: &mut [E],
        prepared: Prepared,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.run(ticket, prepared, buf).await?;
        if op == ReduceOp::Avg {
            divide(buf, self.size());
        }
        Ok(())
    }

    /// Reduces `buf` across all ranks with `op`; every rank ends with the result, bit for bit
    /// the same.
    pub fn allreduce<'a, E: Element>(
        &'a self,
        buf: &'a mut [E],
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let prepared = self.prepare_allreduce::<E>(buf.len(), op);
            self.allreduce_in_turn(ticket, buf, prepared, op).await
        }
    }

    /// Reduces `send` across all ranks into `recv` (of the same length); `send` is unchanged.
    pub fn allreduce_into<'a, E: Element>(
        &'a self,
        send: &'a [E],
        recv: &'a mut [E],
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let prepared = same_len(send.len(), recv.len(), "allreduce_into: send and recv")
                .and_then(|()| self.prepare_allreduce::<E>(recv.len(), op));
            if prepared.is_ok() {
                recv.copy_from_slice(send);
            }
            self.allreduce_in_turn(ticket, recv, prepared, op).await
        }
    }

    pub(crate) fn prepare_reduce_scatter<E: Element>(&self, len: usize, op: ReduceOp) -> Prepared {
        self.check_op::<E>(op)?;
        let block = self.check_blocks(len, "reduce_scatter")?;
        let plan = plan::ring_reduce_scatter(
            self.rank,
            self.size(),
            block,
            E::DTYPE.size(),
            self.piece_elems(E::DTYPE),
        );
        Ok((self.call_of::<E>(Coll::ReduceScatter, op, len, 0), plan))
    }

    async fn reduce_scatter_in_turn<E: Element>(
        &self,
        ticket: Ticket<'_, T>,
        buf: &mut [E],
        prepared: Prepared,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.run(ticket, prepared, buf).await?;
        if op == ReduceOp::Avg {
            let block = buf.len() / self.size();
            divide(
                &mut buf[self.rank * block..(self.rank + 1) * block],
                self.size(),
            );
        }
        Ok(())
    }

    /// Reduce-scatter in place: `buf` holds one block per rank (its length a multiple of the
    /// rank count); afterwards block `rank` holds the reduction of every rank's block `rank`
    /// (the other blocks hold partial results).
    pub fn reduce_scatter_in_place<'a, E: Element>(
        &'a self,
        buf: &'a mut [E],
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let prepared = self.prepare_reduce_scatter::<E>(buf.len(), op);
            self.reduce_scatter_in_turn(ticket, buf, prepared, op).await
        }
    }

    /// Reduce-scatter: `send` holds one block per rank, `recv` one block; afterwards `recv`
    /// holds the reduction of every rank's block `rank`. `send` is unchanged.
    pub fn reduce_scatter<'a, E: Element>(
        &'a self,
        send: &'a [E],
        recv: &'a mut [E],
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let n = self.size();
            let prepared = same_len(
                send.len(),
                recv.len() * n,
                "reduce_scatter: send and size x recv",
            )
            .and_then(|()| self.prepare_reduce_scatter::<E>(send.len(), op));
            let mut work = send.to_vec();
            self.reduce_scatter_in_turn(ticket, &mut work, prepared, op)
                .await?;
            let block = recv.len();
            recv.copy_from_slice(&work[self.rank * block..(self.rank + 1) * block]);
            Ok(())
        }
    }

    pub(crate) fn prepare_allgather<E: Element>(&self, len: usize) -> Prepared {
        let block = self.check_blocks(len, "allgather")?;
        let plan = plan::ring_allgather(
            self.rank,
            self.size(),
            block,
            E::DTYPE.size(),
            self.piece_elems(E::DTYPE),
        );
        Ok((
            self.call_of::<E>(Coll::Allgather, ReduceOp::Sum, len, 0),
            plan,
        ))
    }

    /// Allgather in place: `buf` holds one block per rank, this rank's block `rank` filled in;
    /// afterwards every block holds its rank's.
    pub fn allgather_in_place<'a, E: Element>(
        &'a self,
        buf: &'a mut [E],
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let prepared = self.prepare_allgather::<E>(buf.len());
            self.run(ticket, prepared, buf).await
        }
    }

    /// Allgather: `recv` (rank count x `send`'s length) ends with every rank's `send`, in
    /// rank order.
    pub fn allgather<'a, E: Element>(
        &'a self,
        send: &'a [E],
        recv: &'a mut [E],
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        self.allgather_in_turn(ticket, send, recv)
    }

    pub(crate) async fn allgather_in_turn<E: Element>(
        &self,
        ticket: Ticket<'_, T>,
        send: &[E],
        recv: &mut [E],
    ) -> Result<(), CollectiveError> {
        let block = send.len();
        let prepared = same_len(
            recv.len(),
            block * self.size(),
            "allgather: recv and size x send",
        )
        .and_then(|()| self.prepare_allgather::<E>(recv.len()));
        if prepared.is_ok() {
            recv[self.rank * block..(self.rank + 1) * block].copy_from_slice(send);
        }
        self.run(ticket, prepared, recv).await
    }

    pub(crate) fn prepare_broadcast<E: Element>(&self, count: usize, root: usize) -> Prepared {
        self.check_root(root)?;
        let plan = plan::tree_broadcast(
            self.rank,
            self.size(),
            root,
            count,
            E::DTYPE.size(),
            self.piece_elems(E::DTYPE),
        );
        Ok((
            self.call_of::<E>(Coll::Broadcast, ReduceOp::Sum, count, root),
            plan,
        ))
    }

    /// Broadcast: every rank's `buf` ends with `root`'s.
    pub fn broadcast<'a, E: Element>(
        &'a self,
        buf: &'a mut [E],
        root: usize,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let prepared = self.prepare_broadcast::<E>(buf.len(), root);
            self.run(ticket, prepared, buf).await
        }
    }

    pub(crate) fn prepare_reduce<E: Element>(
        &self,
        count: usize,
        op: ReduceOp,
        root: usize,
    ) -> Prepared {
        self.check_op::<E>(op)?;
        self.check_root(root)?;
        let plan = plan::tree_reduce(
            self.rank,
            self.size(),
            root,
            count,
            E::DTYPE.size(),
            self.piece_elems(E::DTYPE),
        );
        Ok((self.call_of::<E>(Coll::Reduce, op, count, root), plan))
    }

    async fn reduce_in_turn<E: Element>(
        &self,
        ticket: Ticket<'_, T>,
        buf: &mut [E],
        prepared: Prepared,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CollectiveError> {
        self.run(ticket, prepared, buf).await?;
        if op == ReduceOp::Avg && self.rank == root {
            divide(buf, self.size());
        }
        Ok(())
    }

    /// Reduce in place: `root`'s `buf` ends with the reduction of every rank's. The other
    /// ranks' `buf` are used as scratch and hold partial results afterwards (use
    /// [`Communicator::reduce_into`] to keep them).
    pub fn reduce<'a, E: Element>(
        &'a self,
        buf: &'a mut [E],
        op: ReduceOp,
        root: usize,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let prepared = self.prepare_reduce::<E>(buf.len(), op, root);
            self.reduce_in_turn(ticket, buf, prepared, op, root).await
        }
    }

    /// Reduce: `root`'s `recv` ends with the reduction of every rank's `send` (of the same
    /// length); `send` is unchanged everywhere, and `recv` is untouched on the other ranks.
    pub fn reduce_into<'a, E: Element>(
        &'a self,
        send: &'a [E],
        recv: &'a mut [E],
        op: ReduceOp,
        root: usize,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let prepared = same_len(send.len(), recv.len(), "reduce_into: send and recv")
                .and_then(|()| self.prepare_reduce::<E>(send.len(), op, root));
            if self.rank == root {
                if prepared.is_ok() {
                    recv.copy_from_slice(send);
                }
                self.reduce_in_turn(ticket, recv, prepared, op, root).await
            } else {
                let mut scratch = send.to_vec();
                self.reduce_in_turn(ticket, &mut scratch, prepared, op, root)
                    .await
            }
        }
    }

    /// Waits until every rank has called it.
    pub fn barrier(&self) -> impl Future<Output = Result<(), CollectiveError>> + Send + '_ {
        let ticket = self.ticket();
        self.barrier_in_turn(ticket)
    }

    pub(crate) async fn barrier_in_turn(
        &self,
        ticket: Ticket<'_, T>,
    ) -> Result<(), CollectiveError> {
        let plan = plan::barrier(self.rank, self.size());
        let call = self.call_of::<u8>(Coll::Barrier, ReduceOp::Sum, 0, 0);
        self.run::<u8>(ticket, Ok((call, plan)), &mut []).await
    }
}

/// The algorithm of an allreduce of `bytes` on `n` ranks (never [`Algo::Auto`]).
///
/// On two ranks doubling is one exchange where the ring takes two steps for the same bytes;
/// on more, it moves log2(n) whole buffers where the ring moves two, in 2(n - 1)
/// latency-bound steps: doubling wins up to a size (`small_bytes`), the ring above. Through
/// shared memory (`shm_local`: every rank on this host, reached that way) a step costs copies
/// but no kernel: 4-rank allreduces on one host took 0.4-0.6x the ring's time with doubling
/// from 128 KiB to 1 MiB (alternating runs, 2 cores); at 2 MiB doubling took 1,000 us and
/// the ring 580 us (medians of 6) once the shared-memory ring placed data as aligned as the
/// sender's (it was 1.5-3x slower before), hence `small_shm_bytes` (1 MiB) there.
fn allreduce_algo(config: &crate::Config, n: usize, bytes: usize, shm_local: bool) -> Algo {
    let small = if shm_local {
        config.small_bytes.max(config.small_shm_bytes)
    } else {
        config.small_bytes
    };
    match config.algo {
        Algo::Auto if n == 2 || bytes <= small => Algo::Doubling,
        Algo::Auto => Algo::Ring,
        chosen => chosen,
    }
}

/// Pieces for recursive doubling on more than 2 ranks: a piece goes on to the next round as
/// soon as it is combined, but a buffer of one or two pieces barely overlaps its rounds, so
/// one larger than a piece is split in at least 4 (pieces of at least a quarter of the
/// configured size). 4-rank 2 MiB allreduces on one host (shared memory, 1 MiB pieces
/// configured) took 720-850 us in pieces of 512 KiB against 850-1,470 us in pieces of 1 MiB
/// (alternating runs); at 1 MiB (one piece) splitting did not help. On 2 ranks (one round)
/// smaller pieces only cost more messages. The split does not change any element's
/// reduction order: the bits are the same.
fn doubling_piece(piece: usize, count: usize) -> usize {
    if count <= piece {
        piece
    } else {
        piece.min(count.div_ceil(4)).max(piece / 4).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubling_on_more_ranks_splits_a_buffer_of_two_pieces_in_four() {
        assert_eq!(doubling_piece(256, 256), 256, "one piece stays whole");
        assert_eq!(doubling_piece(256, 100), 256);
        assert_eq!(doubling_piece(256, 512), 128);
        assert_eq!(doubling_piece(256, 300), 75);
        assert_eq!(doubling_piece(256, 4096), 256, "many pieces already");
        assert_eq!(
            doubling_piece(256, 257),
            65,
            "at least a quarter of a piece"
        );
        assert_eq!(doubling_piece(1, 10), 1);
    }

    #[test]
    fn shared_memory_takes_doubling_to_larger_sizes() {
        let doubling =
            |c: &crate::Config, n, bytes, shm| allreduce_algo(c, n, bytes, shm) == Algo::Doubling;
        let c = crate::Config::default();
        assert!(doubling(&c, 2, 1 << 30, false), "2 ranks always");
        assert!(doubling(&c, 4, 256 << 10, false));
        assert!(
            !doubling(&c, 4, (256 << 10) + 4, false),
            "the ring over sockets"
        );
        assert!(
            doubling(&c, 4, 1 << 20, true),
            "doubling through shared memory"
        );
        assert!(!doubling(&c, 4, (1 << 20) + 4, true));
        assert!(
            !doubling(&c, 4, 2 << 20, true),
            "the ring from just above 1 MiB"
        );
        let ring = crate::Config {
            algo: Algo::Ring,
            ..crate::Config::default()
        };
        assert!(!doubling(&ring, 4, 8, true), "PSNET_ALGO wins");
    }
}
