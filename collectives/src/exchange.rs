//! The exchanges' public calls: all-to-all (equal blocks and per-rank sizes), gather and
//! scatter. Like every call they take their place in the order of calls when made; their
//! plans are `plan/exchange.rs`'s.

use std::future::Future;

use psnet_transport::Transport;

use crate::comm::{Communicator, Ticket};
use crate::element::{Element, ReduceOp};
use crate::error::CollectiveError;
use crate::plan;
use crate::wire::{Call, Coll};

fn invalid(what: &str, why: String) -> CollectiveError {
    CollectiveError::Invalid(format!("{what}: {why}"))
}

/// Offsets of blocks of `counts` elements laid end to end.
fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect()
}

impl<T: Transport> Communicator<T> {
    fn exchange_call<E: Element>(&self, coll: Coll, count: usize, root: usize) -> Call {
        Call {
            coll,
            dtype: E::DTYPE,
            op: ReduceOp::Sum,
            count: count as u64,
            root: root as u32,
        }
    }

    /// All-to-all (`MPI_Alltoall`): `send` holds one block per rank, in rank order; `recv`
    /// (as long) ends with every rank's block for this one, in rank order.
    pub fn alltoall<'a, E: Element>(
        &'a self,
        send: &'a [E],
        recv: &'a mut [E],
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let n = self.size();
            let block = send.len() / n;
            if send.len() % n != 0 || recv.len() != send.len() {
                let why = format!(
                    "send ({}) and recv ({}) must both be {n} equal blocks",
                    send.len(),
                    recv.len()
                );
                return self
                    .alltoallv_checked(ticket, Err(invalid("alltoall", why)), send, recv)
                    .await;
            }
            let counts = vec![block; n];
            self.alltoallv_checked(ticket, Ok((&counts, &counts)), send, recv)
                .await
        }
    }

    /// All-to-all with per-rank sizes (`MPI_Alltoallv`, torch's `all_to_all_single` with
    /// splits): `send` is `send_counts[j]` elements for rank j, in rank order; `recv` ends
    /// with `recv_counts[i]` elements from rank i, in rank order. Rank i's `send_counts` entry
    /// for this rank must equal this rank's `recv_counts[i]`: a rank that finds another length
    /// fails the call naming the sender.
    pub fn alltoallv<'a, E: Element>(
        &'a self,
        send: &'a [E],
        send_counts: &'a [usize],
        recv: &'a mut [E],
        recv_counts: &'a [usize],
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let n = self.size();
            let checked = if send_counts.len() != n || recv_counts.len() != n {
                Err(invalid(
                    "alltoallv",
                    format!(
                        "{} send counts and {} receive counts for {n} ranks",
                        send_counts.len(),
                        recv_counts.len()
                    ),
                ))
            } else if send_counts.iter().sum::<usize>() != send.len()
                || recv_counts.iter().sum::<usize>() != recv.len()
            {
                Err(invalid(
                    "alltoallv",
                    format!(
                        "the send counts add up to {} for a send buffer of {}, the receive \
                         counts to {} for one of {}",
                        send_counts.iter().sum::<usize>(),
                        send.len(),
                        recv_counts.iter().sum::<usize>(),
                        recv.len()
                    ),
                ))
            } else if send_counts[self.rank] != recv_counts[self.rank] {
                Err(invalid(
                    "alltoallv",
                    format!(
                        "this rank sends itself {} elements but expects {}",
                        send_counts[self.rank], recv_counts[self.rank]
                    ),
                ))
            } else {
                Ok((send_counts, recv_counts))
            };
            self.alltoallv_checked(ticket, checked, send, recv).await
        }
    }

    async fn alltoallv_checked<E: Element>(
        &self,
        ticket: Ticket<'_, T>,
        counts: Result<(&[usize], &[usize]), CollectiveError>,
        send: &[E],
        recv: &mut [E],
    ) -> Result<(), CollectiveError> {
        let (rank, n) = (self.rank, self.size());
        let prepared = counts.map(|(s, r)| {
            let plan = plan::alltoall(rank, n, s, r, E::DTYPE.size(), self.piece_elems(E::DTYPE));
            (self.exchange_call::<E>(Coll::Alltoall, 0, 0), plan, s, r)
        });
        let (prepared, layout) = match prepared {
            Ok((call, plan, s, r)) => (Ok((call, plan)), Some((s, r))),
            Err(e) => (Err(e), None),
        };
        // This rank's own block first: the plan sends from `send` and writes only the
        // other ranks' blocks of `recv`.
        if let Some((send_counts, recv_counts)) = layout {
            let own = offsets(send_counts)[rank];
            let into = offsets(recv_counts)[rank];
            let len = send_counts[rank];
            recv[into..into + len].copy_from_slice(&send[own..own + len]);
        }
        self.run_with(ticket, prepared, |plan| {
            Ok(crate::pieces::HostPieces::over_two(send, recv, plan))
        })
        .await
    }

    /// Gather (`MPI_Gather`): the root's `recv` (rank count x `send`'s length) ends with every
    /// rank's `send`, in rank order; the other ranks pass `None`.
    pub fn gather<'a, E: Element>(
        &'a self,
        send: &'a [E],
        recv: Option<&'a mut [E]>,
        root: usize,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let (rank, n, block) = (self.rank, self.size(), send.len());
            let counts = vec![block; n];
            let checked = self.check_rooted("gather", root, recv.as_deref().map(<[E]>::len), block);
            let prepared = checked.map(|()| {
                let plan = plan::gather(
                    rank,
                    n,
                    root,
                    &counts,
                    E::DTYPE.size(),
                    self.piece_elems(E::DTYPE),
                );
                (self.exchange_call::<E>(Coll::Gather, block, root), plan)
            });
            let mut local;
            let buf: &mut [E] = match recv {
                Some(r) if rank == root => r,
                _ => {
                    local = vec![E::zeroed(); block * n];
                    &mut local
                }
            };
            if prepared.is_ok() {
                buf[rank * block..(rank + 1) * block].copy_from_slice(send);
            }
            self.run(ticket, prepared, buf).await
        }
    }

    /// Scatter (`MPI_Scatter`): every rank's `recv` ends with its block of the root's `send`
    /// (rank count x `recv`'s length); the other ranks pass `None`.
    pub fn scatter<'a, E: Element>(
        &'a self,
        send: Option<&'a [E]>,
        recv: &'a mut [E],
        root: usize,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.ticket();
        async move {
            let (rank, n, block) = (self.rank, self.size(), recv.len());
            let counts = vec![block; n];
            let checked = self.check_rooted("scatter", root, send.map(<[E]>::len), block);
            let prepared = checked.map(|()| {
                let plan = plan::scatter(
                    rank,
                    n,
                    root,
                    &counts,
                    E::DTYPE.size(),
                    self.piece_elems(E::DTYPE),
                );
                (self.exchange_call::<E>(Coll::Scatter, block, root), plan)
            });
            let mut buf = vec![E::zeroed(); block * n];
            if let (Some(s), true) = (send, prepared.is_ok() && rank == root) {
                buf.copy_from_slice(s);
            }
            self.run(ticket, prepared, &mut buf).await?;
            recv.copy_from_slice(&buf[rank * block..(rank + 1) * block]);
            Ok(())
        }
    }

    /// The root's buffer (`root_len`, given by the root only) must be rank count x `block`.
    fn check_rooted(
        &self,
        what: &str,
        root: usize,
        root_len: Option<usize>,
        block: usize,
    ) -> Result<(), CollectiveError> {
        let n = self.size();
        if root >= n {
            return Err(invalid(
                what,
                format!("root {root} in a communicator of {n} ranks"),
            ));
        }
        match (self.rank == root, root_len) {
            (true, None) => Err(invalid(
                what,
                "the root passes its buffer of every rank's blocks".into(),
            )),
            (true, Some(len)) if len != block * n => Err(invalid(
                what,
                format!(
                    "the root's buffer has {len} elements, {n} blocks of {block} make {}",
                    block * n
                ),
            )),
            _ => Ok(()),
        }
    }
}
