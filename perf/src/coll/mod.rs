//! `psnet-perf allreduce | reducescatter | allgather | broadcast | reduce`: psnet's collectives
//! measured the way nccl-tests measures NCCL's (`all_reduce_perf` and its siblings), with
//! nccl-tests' flags and table.
//!
//! Every process is one rank: it joins with [`psnet::collectives::join_from_env`] (so it runs
//! under psnet-launch, mpirun, srun or torchrun), or `--np N` starts N ranks on this host
//! (`launch.rs`). For each size, out of place and then in place: `-w` untimed iterations, a
//! barrier, `-n` timed ones; the time is the average iteration, the slowest rank's (an
//! allreduce of each rank's average with max). With `--check 1`, one more iteration runs on
//! inputs whose result is known exactly (`check.rs`) and the wrong elements are counted on
//! every rank and summed. Only rank 0 prints: nccl-tests' table, or with `--json` JSON Lines,
//! one object per measurement (a size out of place, or in place; `in_place` says which).
//!
//! broadcast and reduce have no out-of-place form in psnet: out of place, the send buffer is
//! copied into the receive buffer (on the root only, for broadcast) and the call runs there,
//! as psnet's own out-of-place allreduce does; the copy is timed.

mod bind;
mod check;
mod compressed;
mod launch;
mod measure;
mod ranks;
mod table;

use std::process::ExitCode;

use clap::Args;
use psnet::collectives::{bf16, f16, CollectiveError, DType, ReduceOp, World};
use psnet::config::env;
use psnet::AnyTransport;

use self::measure::{bench, Setup};
use crate::size;

/// A collective `psnet-perf` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// `all_reduce_perf`.
    AllReduce,
    /// `reduce_scatter_perf`.
    ReduceScatter,
    /// `all_gather_perf`.
    AllGather,
    /// `broadcast_perf`.
    Broadcast,
    /// `reduce_perf`.
    Reduce,
    /// `alltoall_perf`.
    AllToAll,
    /// `sendrecv_perf`: each rank sends to the next and receives from the previous.
    SendRecv,
}

impl Collective {
    /// The subcommand's name.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::ReduceScatter => "reducescatter",
            Collective::AllGather => "allgather",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::AllToAll => "alltoall",
            Collective::SendRecv => "sendrecv",
        }
    }

    /// nccl-tests' program measuring it.
    fn nccl_test(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce_perf",
            Collective::ReduceScatter => "reduce_scatter_perf",
            Collective::AllGather => "all_gather_perf",
            Collective::Broadcast => "broadcast_perf",
            Collective::Reduce => "reduce_perf",
            Collective::AllToAll => "alltoall_perf",
            Collective::SendRecv => "sendrecv_perf",
        }
    }

    /// busbw / algbw over `n` ranks (nccl-tests' PERFORMANCE.md).
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => {
                (n - 1.0) / n
            }
            Collective::Broadcast | Collective::Reduce | Collective::SendRecv => 1.0,
        }
    }

    /// Whether it reduces (takes `-o`).
    fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }

    /// Whether it has a root (takes `-r`).
    fn rooted(self) -> bool {
        matches!(self, Collective::Broadcast | Collective::Reduce)
    }

    /// Whether the buffer holds one block per rank (size = n x block).
    fn blocked(self) -> bool {
        matches!(
            self,
            Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll
        )
    }
}

/// nccl-tests' flags.
#[derive(Args, Clone, Debug)]
pub struct CollArgs {
    /// Smallest size in bytes (K, M, G suffixes: powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = size::parse_size)]
    pub minbytes: u64,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "128M", value_parser = size::parse_size)]
    pub maxbytes: u64,
    /// Each size is the previous one times this (1: plus --stepbytes instead).
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub stepfactor: u64,
    /// With `-f 1`: each size is the previous one plus this many bytes.
    #[arg(short = 'i', long = "stepbytes", default_value = "1M", value_parser = size::parse_size)]
    pub stepbytes: u64,
    /// Timed iterations per size and placement.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: u64,
    /// Untimed iterations before them.
    #[arg(
        short = 'w',
        long = "warmup_iters",
        alias = "warmup-iters",
        default_value_t = 5
    )]
    pub warmup_iters: u64,
    /// 1: check every result against the known one and count wrong elements; 0: do not.
    #[arg(short = 'c', long = "check", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(0..=1))]
    pub check: u8,
    /// Element type: float, double, half, bfloat16, int32, int64, uint8.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub datatype: DType,
    /// Reduction: sum, prod, min, max, avg (floating-point types only).
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: ReduceOp,
    /// Root rank (broadcast, reduce).
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub root: usize,
    /// Print JSON Lines: one object per size and placement, units in the field names.
    #[arg(long)]
    pub json: bool,
    /// allreduce only: psnet's compressed allreduce (lossy, error feedback) with MXNet's
    /// `2bit` or `1bit` codes instead of the exact one; float only. algbw stays the
    /// uncompressed size over the time, and a column gives the code bytes each rank sends.
    /// `--check 1` then counts elements whose bits differ between ranks.
    #[arg(long, default_value = "none")]
    pub compression: String,
    /// The threshold of `--compression`.
    #[arg(long, default_value_t = psnet::compression::DEFAULT_THRESHOLD)]
    pub threshold: f32,
    /// Start this many ranks on this host (otherwise this process is one rank, told its place
    /// by psnet's, torchrun's, mpirun's or Slurm's variables).
    #[arg(long)]
    pub np: Option<usize>,
    /// Set by `--np` for the ranks it starts: the launching process's pid.
    #[arg(long = "np-parent", hide = true)]
    pub np_parent: Option<u32>,
}

/// A failure and the exit status it gives.
#[derive(Debug)]
pub struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn new(code: u8, message: String) -> Failure {
        Failure { code, message }
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::new(1, message)
    }
}

/// A collective's error on this rank. A rank that only lost another, or was told another
/// failed, exits with `EXIT_PEER_FAILED`, so that whoever launched the ranks blames the one
/// that failed first.
fn rank_failure(rank: Option<usize>, e: CollectiveError) -> Failure {
    let code = match e {
        CollectiveError::RankLost { .. } | CollectiveError::Aborted { .. } => {
            psnet_launch::EXIT_PEER_FAILED as u8
        }
        _ => 1,
    };
    match rank {
        Some(r) => Failure::new(code, format!("rank {r}: {e}")),
        None => Failure::new(code, e.to_string()),
    }
}

/// Runs the subcommand; the process's exit status.
pub fn main(coll: Collective, args: CollArgs) -> ExitCode {
    match run(coll, &args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("psnet-perf: error: {}", f.message);
            ExitCode::from(f.code.max(1))
        }
    }
}

/// The sizes from `-b`, `-e`, `-f` and `-i`.
pub fn sizes(args: &CollArgs) -> Vec<u64> {
    let mut out = Vec::new();
    let mut size = args.minbytes;
    while size <= args.maxbytes {
        out.push(size);
        let next = if args.stepfactor > 1 {
            size.checked_mul(args.stepfactor)
        } else {
            size.checked_add(args.stepbytes)
        };
        match next {
            Some(n) if n > size => size = n,
            _ => break,
        }
    }
    out
}

/// Checks the flags before any rank starts.
fn validate(coll: Collective, args: &CollArgs) -> Result<(), String> {
    if args.minbytes == 0 {
        return Err("-b/--minbytes must be at least 1 byte".into());
    }
    if args.minbytes > args.maxbytes {
        return Err(format!(
            "-b/--minbytes ({}) is larger than -e/--maxbytes ({})",
            args.minbytes, args.maxbytes
        ));
    }
    if args.stepfactor == 0 || (args.stepfactor == 1 && args.stepbytes == 0) {
        return Err(
            "-f/--stepfactor must be at least 2, or 1 with -i/--stepbytes of at least 1 byte"
                .into(),
        );
    }
    if args.iters == 0 {
        return Err("-n/--iters must be at least 1".into());
    }
    if coll.reduces() && args.op == ReduceOp::Avg && !args.datatype.is_float() {
        return Err(format!(
            "-o avg needs a floating-point type, not {}",
            args.datatype
        ));
    }
    if args.np == Some(0) {
        return Err("--np must be at least 1".into());
    }
    if let Some(np) = args.np {
        if coll.rooted() && args.root >= np {
            return Err(format!("-r/--root {} with --np {np}", args.root));
        }
    }
    if args.compression != "none" {
        psnet::compression::CompressionParams::new(&args.compression, Some(args.threshold))
            .map_err(|e| format!("--compression {}: {e}", args.compression))?;
        if coll != Collective::AllReduce || args.datatype != DType::F32 {
            return Err(format!(
                "--compression is for allreduce of float (-d float), not {} of {}",
                coll.name(),
                args.datatype
            ));
        }
    }
    if args.maxbytes > isize::MAX as u64 / 4 {
        return Err(format!("-e/--maxbytes {} is too large", args.maxbytes));
    }
    Ok(())
}

fn run(coll: Collective, args: &CollArgs) -> Result<(), Failure> {
    validate(coll, args)?;
    if let Some(np) = args.np {
        return launch::run_ranks(np);
    }
    if let Some(parent) = args.np_parent {
        launch::die_with_parent(parent)?;
    }
    let world = World::from_env().map_err(|e| {
        let mut f = rank_failure(None, e);
        f.message
            .push_str(" (or give --np N to start N ranks on this host)");
        f
    })?;
    let config = psnet::collectives::config_from_env().map_err(|e| rank_failure(None, e))?;
    if coll.rooted() && args.root >= world.size {
        return Err(format!(
            "-r/--root {} in a world of {} ranks ({})",
            args.root, world.size, world.source
        )
        .into());
    }
    let shm_ring_bytes = env::PSNET_SHM_RING
        .parse_or_default::<u64>()
        .map_err(|e| e.to_string())?;
    let runtime = crate::session::runtime()?;
    let rank = world.rank;
    runtime.block_on(async {
        let comm = psnet::collectives::join(&world, config.clone())
            .await
            .map_err(|e| rank_failure(Some(rank), e))?;
        let setup = Setup {
            coll,
            args,
            world: &world,
            config: &config,
            shm_ring_bytes,
        };
        let wrong = match args.datatype {
            DType::F32 if args.compression != "none" => compressed::bench(&comm, &setup).await,
            DType::F32 => bench::<f32>(&comm, &setup).await,
            DType::F64 => bench::<f64>(&comm, &setup).await,
            DType::F16 => bench::<f16>(&comm, &setup).await,
            DType::BF16 => bench::<bf16>(&comm, &setup).await,
            DType::I32 => bench::<i32>(&comm, &setup).await,
            DType::I64 => bench::<i64>(&comm, &setup).await,
            DType::U8 => bench::<u8>(&comm, &setup).await,
        }
        .map_err(|e| rank_failure(Some(rank), e))?;
        // Every rank leaves together: none closes its connections while another still
        // waits on them.
        comm.barrier()
            .await
            .map_err(|e| rank_failure(Some(rank), e))?;
        // Which paths this rank's messages took: a same-host run that fell back to its
        // sockets shows here, not only in its times.
        if let AnyTransport::Tcp(tcp) = comm.transport().as_ref() {
            let paths = tcp.send_paths();
            tracing::info!(
                rank,
                queue = paths.queue,
                ring = paths.ring,
                socket = paths.socket,
                "messages sent by path"
            );
        }
        // Every rank knows the sum; rank 0 alone reports it, so that the failure is one.
        if wrong > 0 && rank == 0 {
            return Err(Failure::new(
                1,
                format!(
                    "{wrong} wrong elements in {} results ({} over {} ranks)",
                    coll.name(),
                    args.datatype,
                    world.size
                ),
            ));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::measure::lengths;
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: CollArgs,
    }

    fn parse(args: &[&str]) -> Result<CollArgs, String> {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .map(|c| c.args)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_nccl_tests() {
        let a = parse(&[]).unwrap();
        assert_eq!((a.minbytes, a.maxbytes, a.stepfactor), (8, 128 << 20, 2));
        assert_eq!((a.iters, a.warmup_iters, a.check, a.root), (20, 5, 1, 0));
        assert_eq!((a.datatype, a.op), (DType::F32, ReduceOp::Sum));
        let s = sizes(&a);
        assert_eq!((s[0], *s.last().unwrap(), s.len()), (8, 128 << 20, 25));
    }

    #[test]
    fn flags_parse_and_bad_ones_are_refused() {
        let a = parse(&[
            "-b", "1K", "-e", "64K", "-f", "4", "-n", "3", "-w", "0", "-c", "0", "-d", "half",
            "-o", "max", "-r", "2",
        ])
        .unwrap();
        assert_eq!(sizes(&a), [1024, 4096, 16384, 65536]);
        assert_eq!(
            (a.datatype, a.op, a.check, a.root),
            (DType::F16, ReduceOp::Max, 0, 2)
        );
        let a = parse(&[
            "--minbytes",
            "10",
            "--maxbytes",
            "40",
            "--stepfactor",
            "1",
            "--stepbytes",
            "15",
            "--warmup_iters",
            "2",
        ])
        .unwrap();
        assert_eq!(sizes(&a), [10, 25, 40]);
        assert_eq!(a.warmup_iters, 2);
        assert!(parse(&["-d", "complex"])
            .unwrap_err()
            .contains("unknown data type"));
        assert!(parse(&["-o", "xor"])
            .unwrap_err()
            .contains("unknown reduction"));
        assert!(parse(&["-c", "2"]).is_err());
        assert!(parse(&["-e", "lots"]).unwrap_err().contains("not a size"));
        let bad = |args: &[&str], coll, what: &str| {
            let err = validate(coll, &parse(args).unwrap()).unwrap_err();
            assert!(err.contains(what), "{args:?}: {err}");
        };
        bad(
            &["-b", "1M", "-e", "1K"],
            Collective::AllReduce,
            "larger than",
        );
        bad(&["-b", "0"], Collective::AllReduce, "at least 1 byte");
        bad(&["-n", "0"], Collective::AllReduce, "-n/--iters");
        bad(&["-f", "0"], Collective::AllReduce, "--stepfactor");
        bad(
            &["-o", "avg", "-d", "int32"],
            Collective::AllReduce,
            "floating-point",
        );
        bad(&["-r", "3", "--np", "3"], Collective::Broadcast, "--root 3");
        bad(&["--np", "0"], Collective::AllGather, "--np");
        bad(
            &["--compression", "3bit"],
            Collective::AllReduce,
            "--compression 3bit",
        );
        bad(
            &["--compression", "2bit"],
            Collective::AllGather,
            "allreduce of float",
        );
        bad(
            &["--compression", "1bit", "-d", "half"],
            Collective::AllReduce,
            "allreduce of float",
        );
        assert!(validate(
            Collective::AllReduce,
            &parse(&["--compression", "2bit", "--threshold", "0.25"]).unwrap()
        )
        .is_ok());
        // avg of integers is only refused where there is a reduction.
        assert!(validate(
            Collective::AllGather,
            &parse(&["-o", "avg", "-d", "u8"]).unwrap()
        )
        .is_ok());
        assert!(validate(
            Collective::AllReduce,
            &parse(&["-r", "7", "--np", "2"]).unwrap()
        )
        .is_ok());
    }

    #[test]
    fn buffer_lengths_follow_nccl_tests() {
        // (size, count, send, recv, in place)
        assert_eq!(
            lengths(Collective::AllReduce, 1024, 4, 3),
            (1024, 256, 256, 256, 256)
        );
        assert_eq!(lengths(Collective::AllReduce, 6, 4, 3), (4, 1, 1, 1, 1));
        assert_eq!(
            lengths(Collective::Broadcast, 1024, 2, 4),
            (1024, 512, 512, 512, 512)
        );
        // Blocked: the size is the whole n x block buffer, the count one block.
        assert_eq!(
            lengths(Collective::AllGather, 1024, 4, 3),
            (1020, 85, 85, 255, 255)
        );
        assert_eq!(
            lengths(Collective::ReduceScatter, 1024, 4, 3),
            (1020, 85, 255, 85, 255)
        );
        assert_eq!(lengths(Collective::ReduceScatter, 8, 4, 3), (0, 0, 0, 0, 0));
    }
}
