//! `psnet-perf allreduce --compression 2bit|1bit`: psnet's compressed allreduce measured as
//! the exact one is (`measure.rs`), on float gradients drawn per rank. Each size keeps its
//! residuals across iterations, as a training loop does. algbw is the uncompressed size over
//! the time, so that compressed and exact rows compare; the last column is the code bytes
//! each rank sends per call. The result is lossy, so `--check 1` counts elements whose bits
//! differ between ranks (every rank must end with the same bits).

use std::time::Instant;

use psnet::collectives::{CollectiveError, Communicator, ReduceOp};
use psnet::compression::{CompressionParams, Compressor};
use psnet::transport::Transport;
use psnet::AnyTransport;

use super::measure::{lengths, Setup, Totals};
use super::ranks::{banner, describe_ranks};
use super::sizes;
use super::table::{self, CollContext, CollRow};

/// Gradients in [-1, 1), different on every rank (a fixed generator: runs compare).
fn fill_gradients(buf: &mut [f32], rank: usize) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (rank as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    for v in buf {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *v = (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
    }
}

/// Elements whose bits differ between ranks, counted on every rank alike: the elementwise
/// max and min over the ranks differ there.
async fn differing(comm: &Communicator<AnyTransport>, buf: &[f32]) -> Result<u64, CollectiveError> {
    let mut high = buf.to_vec();
    let mut low = buf.to_vec();
    comm.allreduce(&mut high, ReduceOp::Max).await?;
    comm.allreduce(&mut low, ReduceOp::Min).await?;
    Ok(high
        .iter()
        .zip(&low)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count() as u64)
}

/// Residuals of one buffer, kept between its calls.
struct Residuals {
    worker: Vec<f32>,
    server: Vec<f32>,
}

impl Residuals {
    fn new(comm: &Communicator<AnyTransport>, len: usize) -> Residuals {
        Residuals {
            worker: vec![0.0; len],
            server: vec![0.0; comm.compressed_server_residual_len(len)],
        }
    }
}

/// One out-of-place call: `send` copied into `recv`, reduced there (the copy is timed, as
/// psnet's exact out-of-place allreduce copies too).
async fn out_of_place(
    comm: &Communicator<AnyTransport>,
    c: &dyn Compressor,
    send: &[f32],
    recv: &mut [f32],
    res: &mut Residuals,
) -> Result<(), CollectiveError> {
    recv.copy_from_slice(send);
    comm.allreduce_compressed(recv, &mut res.worker, &mut res.server, c)
        .await
}

/// Measures every size on this rank; rank 0 prints. Returns the differing elements of every
/// check, summed over sizes and ranks.
pub(super) async fn bench(
    comm: &Communicator<AnyTransport>,
    s: &Setup<'_>,
) -> Result<u64, CollectiveError> {
    let args = s.args;
    let params = CompressionParams::new(&args.compression, Some(args.threshold))
        .map_err(|e| CollectiveError::Invalid(format!("--compression: {e}")))?;
    let compressor = params
        .compressor()
        .map_err(|e| CollectiveError::Invalid(format!("--compression: {e}")))?
        .ok_or_else(|| CollectiveError::Invalid("--compression none".into()))?;
    let c = compressor.as_ref();
    let (rank, n) = (comm.rank(), comm.size());
    let sizes = sizes(args);
    let check = args.check == 1;
    let context = CollContext {
        collective: s.coll.name(),
        dtype: "float",
        op: "sum",
        root: None,
        ranks: n,
        transport: comm.transport().capabilities().name,
        shm_ring_bytes: s.shm_ring_bytes,
        iters: args.iters,
        warmup_iters: args.warmup_iters,
        compression: Some(args.compression.clone()),
    };
    let ranks = describe_ranks(comm).await?;
    if rank == 0 && !args.json {
        println!("{}", banner(s, &context, &ranks));
        println!(
            "# compressed allreduce: {} codes, threshold {}; scheme per size below",
            args.compression, args.threshold
        );
        println!("{}", table::header(true));
    }
    let mut totals = Totals::default();
    for &size in &sizes {
        let (bytes, count, ..) = lengths(s.coll, size, 4, n);
        let mut send = vec![0.0f32; count];
        fill_gradients(&mut send, rank);
        let mut recv = vec![0.0f32; count];
        let mut work = send.clone();
        let mut times = [0.0f64; 2];
        let mut wrong = [0i64; 2];
        for (i, in_place) in [false, true].into_iter().enumerate() {
            let mut res = Residuals::new(comm, count);
            for _ in 0..args.warmup_iters {
                call(comm, c, in_place, &send, &mut recv, &mut work, &mut res).await?;
            }
            comm.barrier().await?;
            let start = Instant::now();
            for _ in 0..args.iters {
                call(comm, c, in_place, &send, &mut recv, &mut work, &mut res).await?;
            }
            times[i] = start.elapsed().as_secs_f64() / args.iters as f64;
            if check {
                let result = if in_place { &work } else { &recv };
                wrong[i] = differing(comm, result).await? as i64;
            }
        }
        comm.allreduce(&mut times, ReduceOp::Max).await?;
        if check {
            comm.allreduce(&mut wrong, ReduceOp::Sum).await?;
        }
        let sent = comm.compressed_bytes_per_rank(count, c);
        let rows = [false, true].map(|ip| {
            let i = usize::from(ip);
            let mut row = CollRow::new(
                s.coll,
                n,
                bytes,
                count as u64,
                ip,
                times[i],
                check.then_some(wrong[i] as u64),
            );
            row.sent_per_rank_bytes = Some(sent);
            row
        });
        totals.report(
            rank == 0 && !args.json,
            rank == 0 && args.json,
            &context,
            &rows,
            || {
                format!(
                    "{}  {:?}",
                    table::line(bytes, count as u64, "float", "sum", -1, &rows[0], &rows[1]),
                    comm.compressed_scheme(count)
                )
            },
        );
    }
    Ok(totals.finish(rank == 0 && !args.json, check))
}

/// One call, out of place or in place (on `work`, which then carries the running result:
/// a training step's buffer is refilled each step, here the codes' sums feed the next).
async fn call(
    comm: &Communicator<AnyTransport>,
    c: &dyn Compressor,
    in_place: bool,
    send: &[f32],
    recv: &mut [f32],
    work: &mut [f32],
    res: &mut Residuals,
) -> Result<(), CollectiveError> {
    if in_place {
        comm.allreduce_compressed(work, &mut res.worker, &mut res.server, c)
            .await
    } else {
        out_of_place(comm, c, send, recv, res).await
    }
}
