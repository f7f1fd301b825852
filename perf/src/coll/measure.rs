//! One rank's measurement: for each size, out of place and then in place, the warmup, a
//! barrier, the timed iterations and the check; the slowest rank's average time and the
//! wrong elements summed over ranks go to rank 0's table.

use std::time::Instant;

use psnet::collectives::{CollectiveError, Communicator, Config, ReduceOp, World};
use psnet::transport::Transport;
use psnet::AnyTransport;

use super::check::{self, Sample};
use super::ranks::{banner, describe_ranks};
use super::table::{self, CollContext, CollRow};
use super::{sizes, CollArgs, Collective};

/// What one rank's benchmark runs with.
pub(super) struct Setup<'a> {
    pub(super) coll: Collective,
    pub(super) args: &'a CollArgs,
    pub(super) world: &'a World,
    pub(super) config: &'a Config,
    pub(super) shm_ring_bytes: u64,
}

/// Buffer lengths in elements for a size: (nccl-tests' size in bytes, count, send, receive,
/// in place).
pub(super) fn lengths(
    coll: Collective,
    bytes: u64,
    elem: usize,
    n: usize,
) -> (u64, usize, usize, usize, usize) {
    let count = (bytes / elem as u64) as usize;
    if coll.blocked() {
        let block = count / n;
        let (send, recv) = match coll {
            Collective::AllGather => (block, block * n),
            Collective::AllToAll => (block * n, block * n),
            _ => (block * n, block),
        };
        ((block * n * elem) as u64, block, send, recv, block * n)
    } else {
        ((count * elem) as u64, count, count, count, count)
    }
}

async fn out_of_place<E: Sample>(
    comm: &Communicator<AnyTransport>,
    s: &Setup<'_>,
    send: &[E],
    recv: &mut [E],
) -> Result<(), CollectiveError> {
    let (op, root) = (s.args.op, s.args.root);
    match s.coll {
        Collective::AllReduce => comm.allreduce_into(send, recv, op).await,
        Collective::ReduceScatter => comm.reduce_scatter(send, recv, op).await,
        Collective::AllGather => comm.allgather(send, recv).await,
        Collective::Broadcast => {
            if comm.rank() == root {
                recv.copy_from_slice(send);
            }
            comm.broadcast(recv, root).await
        }
        Collective::Reduce => {
            recv.copy_from_slice(send);
            comm.reduce(recv, op, root).await
        }
        Collective::AllToAll => comm.alltoall(send, recv).await,
        Collective::SendRecv => send_recv(comm, send, recv).await,
    }
}

/// Sends `send` to the next rank and receives the previous rank's into `recv`, at once.
async fn send_recv<E: Sample>(
    comm: &Communicator<AnyTransport>,
    send: &[E],
    recv: &mut [E],
) -> Result<(), CollectiveError> {
    let (rank, n) = (comm.rank(), comm.size());
    if n == 1 {
        recv.copy_from_slice(send);
        return Ok(());
    }
    let (sent, received) = tokio::join!(
        comm.send((rank + 1) % n, 0, send),
        comm.recv((rank + n - 1) % n, 0, recv)
    );
    sent.and(received)
}

async fn in_place<E: Sample>(
    comm: &Communicator<AnyTransport>,
    s: &Setup<'_>,
    buf: &mut [E],
) -> Result<(), CollectiveError> {
    let (op, root) = (s.args.op, s.args.root);
    match s.coll {
        Collective::AllReduce => comm.allreduce(buf, op).await,
        Collective::ReduceScatter => comm.reduce_scatter_in_place(buf, op).await,
        Collective::AllGather => comm.allgather_in_place(buf).await,
        Collective::Broadcast => comm.broadcast(buf, root).await,
        Collective::Reduce => comm.reduce(buf, op, root).await,
        // psnet has no in-place all-to-all or send-receive: the input is copied aside first,
        // and the copy is part of the time.
        Collective::AllToAll => {
            let input = buf.to_vec();
            comm.alltoall(&input, buf).await
        }
        Collective::SendRecv => {
            let input = buf.to_vec();
            send_recv(comm, &input, buf).await
        }
    }
}

/// Fills a call's input: `buf` is the send buffer (out of place) or the one buffer (in
/// place); `block` the elements per rank of a blocked collective.
fn fill_input<E: Sample>(s: &Setup<'_>, buf: &mut [E], in_place: bool, block: usize) {
    let (rank, n, op) = (s.world.rank, s.world.size, s.args.op);
    match s.coll {
        Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce => {
            check::fill_inputs(buf, op, rank, n, 0)
        }
        Collective::Broadcast | Collective::SendRecv => check::fill_own(buf, rank),
        // Block j, for rank j, identifies this rank and j.
        Collective::AllToAll => {
            for (j, b) in buf.chunks_mut(block.max(1)).enumerate() {
                check::fill_own(b, rank * n + j);
            }
        }
        Collective::AllGather if in_place => {
            check::poison(buf);
            check::fill_own(&mut buf[rank * block..(rank + 1) * block], rank);
        }
        Collective::AllGather => check::fill_own(buf, rank),
    }
}

/// Wrong elements in a call's result: `buf` is the receive buffer (out of place) or the one
/// buffer (in place).
fn count_wrong<E: Sample>(s: &Setup<'_>, buf: &[E], in_place: bool, block: usize) -> u64 {
    let (rank, n, op, root) = (s.world.rank, s.world.size, s.args.op, s.args.root);
    match s.coll {
        Collective::AllReduce => check::wrong_reduced(buf, op, n, 0),
        Collective::Reduce if rank == root => check::wrong_reduced(buf, op, n, 0),
        Collective::Reduce => 0,
        Collective::ReduceScatter => {
            let mine = if in_place {
                &buf[rank * block..(rank + 1) * block]
            } else {
                buf
            };
            check::wrong_reduced(mine, op, n, rank * block)
        }
        Collective::AllGather => (0..n)
            .map(|b| check::wrong_own(&buf[b * block..(b + 1) * block], b))
            .sum(),
        Collective::Broadcast => check::wrong_own(buf, root),
        Collective::AllToAll => (0..n)
            .map(|i| check::wrong_own(&buf[i * block..(i + 1) * block], i * n + rank))
            .sum(),
        Collective::SendRecv => check::wrong_own(buf, (rank + n - 1) % n),
    }
}

/// Average seconds per iteration of `iters` calls of `call`, after `warmup` and a barrier.
macro_rules! timed {
    ($comm:expr, $args:expr, $call:expr) => {{
        for _ in 0..$args.warmup_iters {
            $call.await?;
        }
        $comm.barrier().await?;
        let start = Instant::now();
        for _ in 0..$args.iters {
            $call.await?;
        }
        start.elapsed().as_secs_f64() / $args.iters as f64
    }};
}

/// Measures every size on this rank; rank 0 prints. Returns the wrong elements of every
/// check, summed over sizes and ranks.
pub(super) async fn bench<E: Sample>(
    comm: &Communicator<AnyTransport>,
    s: &Setup<'_>,
) -> Result<u64, CollectiveError> {
    let (args, coll) = (s.args, s.coll);
    let (rank, n) = (comm.rank(), comm.size());
    let elem = E::DTYPE.size();
    let sizes = sizes(args);
    let top = lengths(coll, *sizes.last().unwrap_or(&0), elem, n);
    let mut send = vec![E::from_small(0); top.2];
    let mut recv = vec![E::from_small(0); top.3];
    let mut work = vec![E::from_small(0); top.4];
    let check = args.check == 1;
    let transport = comm.transport().capabilities().name;
    let context = CollContext {
        collective: coll.name(),
        dtype: E::DTYPE.name(),
        op: if coll.reduces() {
            args.op.name()
        } else {
            "none"
        },
        root: coll.rooted().then_some(args.root),
        ranks: n,
        transport,
        shm_ring_bytes: s.shm_ring_bytes,
        iters: args.iters,
        warmup_iters: args.warmup_iters,
        compression: None,
    };
    let ranks = describe_ranks(comm).await?;
    if rank == 0 && !args.json {
        println!("{}", banner(s, &context, &ranks));
        println!("{}", table::header(false));
    }
    let mut totals = Totals::default();
    for &size in &sizes {
        let (bytes, count, ls, lr, lw) = lengths(coll, size, elem, n);
        let (send, recv, work) = (&mut send[..ls], &mut recv[..lr], &mut work[..lw]);
        let block = if coll.blocked() { count } else { 0 };
        // Out of place.
        fill_input(s, send, false, block);
        let oop_s = timed!(comm, args, out_of_place(comm, s, send, recv));
        let mut wrong = [0i64; 2];
        if check {
            fill_input(s, send, false, block);
            check::poison(recv);
            out_of_place(comm, s, send, recv).await?;
            wrong[0] = count_wrong(s, recv, false, block) as i64;
        }
        // In place.
        fill_input(s, work, true, block);
        let ip_s = timed!(comm, args, in_place(comm, s, work));
        if check {
            fill_input(s, work, true, block);
            in_place(comm, s, work).await?;
            wrong[1] = count_wrong(s, work, true, block) as i64;
        }
        // Every rank agrees: the slowest rank's time, every rank's wrong elements.
        let mut times = [oop_s, ip_s];
        comm.allreduce(&mut times, ReduceOp::Max).await?;
        if check {
            comm.allreduce(&mut wrong, ReduceOp::Sum).await?;
        }
        let wrong = wrong.map(|w| check.then_some(w as u64));
        let rows = [false, true].map(|ip| {
            let i = usize::from(ip);
            CollRow::new(coll, n, bytes, count as u64, ip, times[i], wrong[i])
        });
        totals.report(
            rank == 0 && !args.json,
            rank == 0 && args.json,
            &context,
            &rows,
            || {
                let root = if coll.rooted() { args.root as i64 } else { -1 };
                table::line(
                    bytes,
                    count as u64,
                    E::DTYPE.name(),
                    context.op,
                    root,
                    &rows[0],
                    &rows[1],
                )
            },
        );
    }
    Ok(totals.finish(rank == 0 && !args.json, check))
}

/// What every size's rows add to, for the table's last lines.
#[derive(Default)]
pub(super) struct Totals {
    wrong: u64,
    busbw: f64,
    measured: usize,
}

impl Totals {
    /// Counts a size's rows and prints them: `line()` where `table`, JSON lines where `json`
    /// (rank 0 prints, the others only count).
    pub(super) fn report(
        &mut self,
        table: bool,
        json: bool,
        context: &CollContext,
        rows: &[CollRow],
        line: impl FnOnce() -> String,
    ) {
        for r in rows {
            self.wrong += r.wrong.unwrap_or(0);
            self.busbw += r.busbw_gb_s;
            self.measured += 1;
            if json {
                println!("{}", crate::report::json_line(context, r));
            }
        }
        if table {
            println!("{}", line());
        }
    }

    /// Prints the table's last lines where `table`; the wrong elements of every check.
    pub(super) fn finish(&self, table: bool, check: bool) -> u64 {
        if table {
            println!(
                "{}",
                table::footer(check.then_some(self.wrong), self.busbw, self.measured)
            );
        }
        self.wrong
    }
}
