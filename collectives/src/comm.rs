//! The communicator: n ranks over one transport, and the collectives' public calls. Each call
//! checks its arguments, builds its plan and hands it to the driver (`drive.rs`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use psnet_transport::{NodeId, Transport};
use tokio::task::JoinHandle;

use crate::config::{Algo, Config};
use crate::element::{divide, DType, Element, ReduceOp};
use crate::error::CollectiveError;
use crate::mailbox::{self, Mailbox};
use crate::plan::{self, Plan};
use crate::wire::{Call, Coll, HEADER_LEN};

/// The node id of rank `rank`: ranks are node ids 1, 2, ... on the communicator's transport.
pub fn node_of(rank: usize) -> NodeId {
    NodeId(rank as u64 + 1)
}

/// n ranks that run collectives together over one transport.
///
/// Calls are made in the same order on every rank. Several may be in flight (from several
/// tasks): they complete in the order they were issued. The first call that fails fails the
/// communicator: the other ranks are told why, and every later call reports the same error.
pub struct Communicator<T: Transport> {
    pub(crate) transport: Arc<T>,
    pub(crate) mailbox: Arc<Mailbox>,
    /// The task reading the transport, shared with the communicators split from this one.
    reader: Arc<Reader>,
    /// This communicator's id in every message header (0: the one formed by `join`).
    pub(crate) comm: u32,
    /// Splits made so far, which name the communicators they make.
    splits: AtomicU64,
    pub(crate) rank: usize,
    pub(crate) members: Vec<NodeId>,
    pub(crate) config: Config,
    /// The next call's number; held for the whole call, so calls run one at a time, in order.
    pub(crate) turn: tokio::sync::Mutex<u64>,
    pub(crate) failed: Mutex<Option<CollectiveError>>,
}

/// Stops the task reading the transport when the last communicator using it goes.
struct Reader(JoinHandle<()>);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T: Transport> Communicator<T> {
    /// Forms a communicator of `size` ranks, this one `rank`, meeting at `root`: the address
    /// rank 0's transport listens at. Every rank's transport must be reachable at its
    /// `listen_addr()`. This process's transport takes node id [`node_of`]`(rank)`, and the
    /// communicator reads every message it receives from now on.
    pub async fn join(
        transport: Arc<T>,
        rank: usize,
        size: usize,
        root: SocketAddr,
        config: Config,
    ) -> Result<Self, CollectiveError> {
        if size == 0 || rank >= size {
            return Err(CollectiveError::Invalid(format!(
                "rank {rank} of a communicator of {size} ranks"
            )));
        }
        transport.set_local_id(node_of(rank));
        let mailbox = Arc::new(Mailbox::default());
        let reader = Arc::new(Reader(tokio::spawn(mailbox::read_all(
            transport.clone(),
            mailbox.clone(),
        ))));
        let comm = Communicator {
            transport,
            mailbox,
            reader,
            comm: 0,
            splits: AtomicU64::new(0),
            rank,
            members: (0..size).map(node_of).collect(),
            config,
            turn: tokio::sync::Mutex::new(0),
            failed: Mutex::new(None),
        };
        crate::join::join(&comm, root).await?;
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The transport the ranks talk over.
    pub fn transport(&self) -> &Arc<T> {
        &self.transport
    }

    /// The error that failed this communicator, if one did.
    pub fn failure(&self) -> Option<CollectiveError> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Elements per piece for elements of `dtype`: the configured piece size, within what one
    /// message of the transport may carry.
    fn piece_elems(&self, dtype: DType) -> usize {
        let max = (self.transport.capabilities().max_message as usize).saturating_sub(HEADER_LEN);
        (self.config.piece_bytes.min(max) / dtype.size()).max(1)
    }

    fn call<E: Element>(&self, coll: Coll, op: ReduceOp, count: usize, root: usize) -> Call {
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

    /// Reduces `buf` across all ranks with `op`; every rank ends with the result, bit for bit
    /// the same.
    pub async fn allreduce<E: Element>(
        &self,
        buf: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.check_op::<E>(op)?;
        let (n, rank, count) = (self.size(), self.rank, buf.len());
        let bytes = std::mem::size_of_val(buf);
        let max = self.transport.capabilities().max_message as usize;
        let doubling = match self.config.algo {
            Algo::Doubling => true,
            Algo::Ring => false,
            Algo::Auto => bytes <= self.config.small_bytes,
        } && bytes + HEADER_LEN <= max;
        let plan = if doubling {
            plan::doubling_allreduce(rank, n, count, E::DTYPE.size())
        } else {
            plan::ring_allreduce(rank, n, count, E::DTYPE.size(), self.piece_elems(E::DTYPE))
        };
        let call = self.call::<E>(Coll::Allreduce, op, count, 0);
        self.run(call, plan, buf).await?;
        if op == ReduceOp::Avg {
            divide(buf, n);
        }
        Ok(())
    }

    /// Reduces `send` across all ranks into `recv` (of the same length); `send` is unchanged.
    pub async fn allreduce_into<E: Element>(
        &self,
        send: &[E],
        recv: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        same_len(send.len(), recv.len(), "allreduce_into: send and recv")?;
        recv.copy_from_slice(send);
        self.allreduce(recv, op).await
    }

    /// Reduce-scatter in place: `buf` holds one block per rank (its length a multiple of the
    /// rank count); afterwards block `rank` holds the reduction of every rank's block `rank`
    /// (the other blocks hold partial results).
    pub async fn reduce_scatter_in_place<E: Element>(
        &self,
        buf: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.check_op::<E>(op)?;
        let n = self.size();
        if buf.len() % n != 0 {
            return Err(CollectiveError::Invalid(format!(
                "reduce_scatter: {} elements do not split into {n} equal blocks",
                buf.len()
            )));
        }
        let block = buf.len() / n;
        let plan = plan::ring_reduce_scatter(
            self.rank,
            n,
            block,
            E::DTYPE.size(),
            self.piece_elems(E::DTYPE),
        );
        let call = self.call::<E>(Coll::ReduceScatter, op, buf.len(), 0);
        self.run(call, plan, buf).await?;
        if op == ReduceOp::Avg {
            divide(&mut buf[self.rank * block..(self.rank + 1) * block], n);
        }
        Ok(())
    }

    /// Reduce-scatter: `send` holds one block per rank, `recv` one block; afterwards `recv`
    /// holds the reduction of every rank's block `rank`.
    pub async fn reduce_scatter<E: Element>(
        &self,
        send: &[E],
        recv: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let n = self.size();
        same_len(
            send.len(),
            recv.len() * n,
            "reduce_scatter: send and size x recv",
        )?;
        let mut work = send.to_vec();
        self.reduce_scatter_in_place(&mut work, op).await?;
        let block = recv.len();
        recv.copy_from_slice(&work[self.rank * block..(self.rank + 1) * block]);
        Ok(())
    }

    /// Allgather in place: `buf` holds one block per rank, this rank's block `rank` filled in;
    /// afterwards every block holds its rank's.
    pub async fn allgather_in_place<E: Element>(
        &self,
        buf: &mut [E],
    ) -> Result<(), CollectiveError> {
        let n = self.size();
        if buf.len() % n != 0 {
            return Err(CollectiveError::Invalid(format!(
                "allgather: {} elements do not split into {n} equal blocks",
                buf.len()
            )));
        }
        let block = buf.len() / n;
        let plan = plan::ring_allgather(
            self.rank,
            n,
            block,
            E::DTYPE.size(),
            self.piece_elems(E::DTYPE),
        );
        let call = self.call::<E>(Coll::Allgather, ReduceOp::Sum, buf.len(), 0);
        self.run(call, plan, buf).await
    }

    /// Allgather: `recv` (rank count x `send`'s length) ends with every rank's `send`, in
    /// rank order.
    pub async fn allgather<E: Element>(
        &self,
        send: &[E],
        recv: &mut [E],
    ) -> Result<(), CollectiveError> {
        let block = send.len();
        same_len(
            recv.len(),
            block * self.size(),
            "allgather: recv and size x send",
        )?;
        recv[self.rank * block..(self.rank + 1) * block].copy_from_slice(send);
        self.allgather_in_place(recv).await
    }

    /// Broadcast: every rank's `buf` ends with `root`'s.
    pub async fn broadcast<E: Element>(
        &self,
        buf: &mut [E],
        root: usize,
    ) -> Result<(), CollectiveError> {
        self.check_root(root)?;
        let plan = plan::tree_broadcast(
            self.rank,
            self.size(),
            root,
            buf.len(),
            E::DTYPE.size(),
            self.piece_elems(E::DTYPE),
        );
        let call = self.call::<E>(Coll::Broadcast, ReduceOp::Sum, buf.len(), root);
        self.run(call, plan, buf).await
    }

    /// Reduce: `root`'s `buf` ends with the reduction of every rank's; the other ranks' `buf`
    /// hold partial results afterwards.
    pub async fn reduce<E: Element>(
        &self,
        buf: &mut [E],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CollectiveError> {
        self.check_op::<E>(op)?;
        self.check_root(root)?;
        let plan = plan::tree_reduce(
            self.rank,
            self.size(),
            root,
            buf.len(),
            E::DTYPE.size(),
            self.piece_elems(E::DTYPE),
        );
        let call = self.call::<E>(Coll::Reduce, op, buf.len(), root);
        self.run(call, plan, buf).await?;
        if op == ReduceOp::Avg && self.rank == root {
            divide(buf, self.size());
        }
        Ok(())
    }

    /// Splits the ranks by `colour`, as `MPI_Comm_split`: the ranks that pass the same colour
    /// form a new communicator, ranked by `key` (ties by rank here), sharing this one's
    /// transport. A rank that passes `None` joins none and gets `None`. Every rank calls it.
    pub async fn split(
        &self,
        colour: Option<u32>,
        key: i64,
    ) -> Result<Option<Communicator<T>>, CollectiveError> {
        let n = self.size();
        let mine = [colour.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * n];
        self.allgather(&mine, &mut all).await?;
        let split = self.splits.fetch_add(1, Ordering::Relaxed);
        let Some(colour) = colour else {
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = (0..n)
            .filter(|&r| all[2 * r] == i64::from(colour))
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort_unstable();
        let rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank is among its colour");
        Ok(Some(Communicator {
            transport: self.transport.clone(),
            mailbox: self.mailbox.clone(),
            reader: self.reader.clone(),
            comm: child_id(self.comm, split, colour),
            splits: AtomicU64::new(0),
            rank,
            members: members.iter().map(|&(_, r)| self.members[r]).collect(),
            config: self.config.clone(),
            turn: tokio::sync::Mutex::new(0),
            failed: Mutex::new(None),
        }))
    }

    /// Waits until every rank has called it.
    pub async fn barrier(&self) -> Result<(), CollectiveError> {
        let plan = plan::barrier(self.rank, self.size());
        let call = self.call::<u8>(Coll::Barrier, ReduceOp::Sum, 0, 0);
        self.run::<u8>(call, plan, &mut []).await
    }

    /// Runs `plan` over `buf` as call `call`, in this communicator's order of calls.
    async fn run<E: Element>(
        &self,
        call: Call,
        plan: Plan,
        buf: &mut [E],
    ) -> Result<(), CollectiveError> {
        let mut turn = self.turn.lock().await;
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let seq = *turn;
        *turn += 1;
        match crate::drive::drive(self, seq, call, plan, buf).await {
            Ok(()) => Ok(()),
            Err(e) => {
                crate::drive::fail(self, &e).await;
                Err(e)
            }
        }
    }
}

/// The id of the communicator of `colour` made by split number `split` of communicator
/// `parent`: the same on every member, and different from its siblings' and the world's
/// (FNV-1a; 0 is the world's).
fn child_id(parent: u32, split: u64, colour: u32) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    let bytes = parent
        .to_le_bytes()
        .into_iter()
        .chain(split.to_le_bytes())
        .chain(colour.to_le_bytes());
    for b in bytes {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h.max(1)
}

fn same_len(a: usize, b: usize, what: &str) -> Result<(), CollectiveError> {
    if a != b {
        return Err(CollectiveError::Invalid(format!(
            "{what} differ in length ({a} and {b} elements)"
        )));
    }
    Ok(())
}
