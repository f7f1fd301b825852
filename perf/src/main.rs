//! `psnet-perf`: psnet's benchmarks, in perftest's shape.
//!
//! - `psnet-perf bw` / `psnet-perf lat`: without a host, serve; with a host, be the client;
//!   `--loopback` runs both ends in one process. `--baseline` adds the raw-TCP reference
//!   measured in the same run. Tables in perftest's columns (`ib_write_bw`, `ib_send_lat`:
//!   one-way latency); `--json` prints JSON Lines, one flat object per result row.
//! - `psnet-perf allreduce | reducescatter | allgather | broadcast | reduce | alltoall |
//!   sendrecv`: the collectives and point-to-point messages,
//!   with nccl-tests' flags and table (`-b -e -f -n -w -c -d -o -r`); `--np N` starts N ranks
//!   on this host, otherwise the process is one rank of a job a launcher started.
//! - `psnet-perf select`: which address and transport this node would use, and why.
//! - `psnet-perf --print-env`: every environment variable psnet reads.
#![forbid(unsafe_code)]

mod baseline;
mod bw;
#[cfg(feature = "cuda")]
mod bw_gpu;
mod coll;
mod compress;
mod kv;
#[cfg(feature = "cuda")]
mod kv_gpu;
mod kv_rows;
mod kvload;
mod lat;
mod protocol;
mod report;
mod server;
mod session;
mod size;
mod transfer;

use transfer::run_test;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use psnet::transport::Transport;
use psnet::{AnyTransport, Selection, TransportKind, TransportPref};

use crate::coll::Collective;
use crate::report::{BwUnit, RunContext};
use crate::session::{PerfResult, SERVER_ID};

#[derive(Parser)]
#[command(
    name = "psnet-perf",
    version,
    about = "psnet bandwidth and latency benchmarks (perftest-style)"
)]
struct Cli {
    /// Print every environment variable psnet reads, with its default and current value.
    #[arg(long)]
    print_env: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Bandwidth, like perftest's ib_write_bw.
    Bw(TestArgs),
    /// Latency, like perftest's ib_send_lat: one-way, half of each round trip.
    Lat(TestArgs),
    /// Gradient-compression throughput (quantize, dequantize, dequantize-add) vs memcpy.
    Compress {
        /// Elements per array [default: 16777216; with --gpu: 67108864 and 268435456].
        #[arg(short = 'n', long)]
        elems: Option<usize>,
        /// 2bit, 1bit or all.
        #[arg(long, default_value = "all")]
        scheme: String,
        /// Threads (0: all); default: one row with 1 thread and one with all.
        #[arg(long)]
        threads: Option<usize>,
        /// Repetitions (the median is reported).
        #[arg(long, default_value_t = 10)]
        reps: usize,
        /// Print JSON Lines: one object per row, units in the field names.
        #[arg(long)]
        json: bool,
        /// Measure the CUDA kernels on this device instead, beside a device-to-device copy
        /// (needs the `cuda` feature; `-n` defaults to 2^26 and 2^28 elements here).
        #[arg(long, value_name = "ORDINAL", num_args = 0..=1, default_missing_value = "0")]
        gpu: Option<usize>,
    },
    /// kv store goodput (push, pull, push+pull) per worker, for each value size.
    Kv {
        /// Servers to launch (when not started by a launcher).
        #[arg(long, default_value_t = 2)]
        servers: u32,
        /// Workers to launch (when not started by a launcher).
        #[arg(long, default_value_t = 2)]
        workers: u32,
        /// Value sizes (bytes, with K/M/G suffixes), comma-separated.
        #[arg(long, value_delimiter = ',', value_parser = size::parse_size, default_value = "4K,64K,1M,16M,64M")]
        sizes: Vec<u64>,
        /// Timed operations per size (default: bounded by volume).
        #[arg(short = 'n', long)]
        iters: Option<usize>,
        /// Keys in flight per operation (ps-lite's benchmark keeps 4 per server).
        #[arg(long, default_value_t = 1)]
        keys: usize,
        /// Print JSON Lines: one object per row, units in the field names.
        #[arg(long)]
        json: bool,
        /// Then the same sizes again from buffers on this GPU, in the same job, with the
        /// ratios to host memory (needs the `cuda` feature).
        #[arg(long, value_name = "ORDINAL", num_args = 0..=1, default_missing_value = "0")]
        gpu: Option<usize>,
        /// Instead: a sparse model's step on a table of ROWSxWIDTH float32 (such as
        /// 1000000x64), its touched rows pushed (`push_rows`) and pulled back
        /// (`pull_rows`), beside a dense push and pull of the table, in the same job.
        #[arg(long, value_name = "ROWSxWIDTH", conflicts_with_all = ["gpu", "keys"])]
        sparse: Option<String>,
        /// With `--sparse`: rows each step touches (default: 1% of the rows).
        #[arg(long, requires = "sparse")]
        touched: Option<usize>,
    },
    /// A dist_sync job of many processes and many small keys (16 workers, 4 servers and
    /// 100,000 keys by default), every pulled value checked; reports each process's peak RSS.
    Kvload(kvload::LoadArgs),
    /// Allreduce bandwidth among ranks, like nccl-tests' all_reduce_perf.
    #[command(visible_alias = "all_reduce")]
    Allreduce(coll::CollArgs),
    /// Reduce-scatter bandwidth, like nccl-tests' reduce_scatter_perf.
    #[command(visible_alias = "reduce_scatter")]
    Reducescatter(coll::CollArgs),
    /// Allgather bandwidth, like nccl-tests' all_gather_perf.
    #[command(visible_alias = "all_gather")]
    Allgather(coll::CollArgs),
    /// Broadcast bandwidth, like nccl-tests' broadcast_perf.
    Broadcast(coll::CollArgs),
    /// Reduce bandwidth, like nccl-tests' reduce_perf.
    Reduce(coll::CollArgs),
    /// All-to-all bandwidth, like nccl-tests' alltoall_perf.
    #[command(alias = "all_to_all")]
    Alltoall(coll::CollArgs),
    /// Send-receive bandwidth (each rank to the next), like nccl-tests' sendrecv_perf.
    #[command(alias = "send_recv")]
    Sendrecv(coll::CollArgs),
    /// Show the address and transport this node would use, and why.
    Select {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Transport preference (beats PSNET_TRANSPORT): auto, rdma or tcp.
        #[arg(long)]
        transport: Option<TransportPref>,
    },
}

#[derive(Args, Clone)]
struct TestArgs {
    /// Server to connect to; without it, this process is the server.
    host: Option<String>,
    /// Message size (64, 4K, 16M, ...).
    #[arg(short = 's', long, value_parser = size::parse_size)]
    size: Option<u64>,
    /// Every power of two from 2 B to 8 MiB.
    #[arg(short = 'a', long)]
    all: bool,
    /// Iterations per size (default: perftest's, capped to keep each size short).
    #[arg(short = 'n', long)]
    iters: Option<u64>,
    /// `bw`: messages in flight (perftest's tx depth).
    #[arg(short = 't', long, default_value_t = bw::DEFAULT_TX_DEPTH)]
    tx_depth: usize,
    /// Server port (the raw-TCP baseline uses the next one).
    #[arg(short = 'p', long, default_value_t = 18515)]
    port: u16,
    /// Transport: auto, rdma or tcp (beats PSNET_TRANSPORT).
    #[arg(long)]
    transport: Option<TransportPref>,
    /// Print JSON Lines: one object per size, units in the field names.
    #[arg(long)]
    json: bool,
    /// `bw`: BW columns in Gb/sec (10^9 bits) instead of MB/sec (2^20 bytes), as perftest.
    #[arg(long = "report_gbits", alias = "report-gbits")]
    report_gbits: bool,
    /// Run server and client in this process, over 127.0.0.1.
    #[arg(long)]
    loopback: bool,
    /// Also measure the raw-TCP reference (blocking 1 MiB writes) over the same bytes.
    #[arg(long)]
    baseline: bool,
    /// `bw`: send each size again from memory on this GPU, right after the host run, and
    /// print the ratio (needs the `cuda` feature).
    #[arg(long, value_name = "ORDINAL", num_args = 0..=1, default_missing_value = "0")]
    gpu: Option<usize>,
}

#[derive(Clone, Copy, PartialEq)]
enum Test {
    Bw,
    Lat,
}

fn main() -> ExitCode {
    psnet::config::logging::init();
    let cli = Cli::parse();
    let result = if cli.print_env {
        print_env();
        Ok(())
    } else {
        match cli.command {
            Some(Command::Bw(args)) => run_test(Test::Bw, args),
            Some(Command::Lat(args)) => run_test(Test::Lat, args),
            Some(Command::Select { json, transport }) => print_selection(json, transport),
            Some(Command::Allreduce(args)) => return coll::main(Collective::AllReduce, args),
            Some(Command::Reducescatter(args)) => {
                return coll::main(Collective::ReduceScatter, args)
            }
            Some(Command::Allgather(args)) => return coll::main(Collective::AllGather, args),
            Some(Command::Broadcast(args)) => return coll::main(Collective::Broadcast, args),
            Some(Command::Reduce(args)) => return coll::main(Collective::Reduce, args),
            Some(Command::Alltoall(args)) => return coll::main(Collective::AllToAll, args),
            Some(Command::Sendrecv(args)) => return coll::main(Collective::SendRecv, args),
            Some(Command::Kv {
                servers,
                workers,
                sizes,
                iters,
                keys,
                json,
                gpu,
                sparse: None,
                touched: _,
            }) => run_kv(servers, workers, &sizes, iters, keys, json, gpu),
            Some(Command::Kv {
                servers,
                workers,
                iters,
                json,
                sparse: Some(shape),
                touched,
                ..
            }) => kv_rows::Sparse::parse(&shape, touched)
                .and_then(|s| run_kv_sparse(servers, workers, s, iters, json)),
            Some(Command::Kvload(args)) => run_kvload(&args),
            Some(Command::Compress {
                elems,
                scheme,
                threads,
                reps,
                json,
                gpu: None,
            }) => compress::schemes(&scheme)
                .and_then(|s| compress::run(&s, elems.unwrap_or(16 << 20), threads, reps, json)),
            Some(Command::Compress {
                elems,
                scheme,
                reps,
                json,
                gpu: Some(ordinal),
                threads: _,
            }) => compress::schemes(&scheme)
                .and_then(|s| compress::run_gpu(&s, ordinal, elems, reps, json)),
            None => {
                Err("nothing to do: try `psnet-perf bw --loopback` or `psnet-perf --help`".into())
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("psnet-perf: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_kv(
    servers: u32,
    workers: u32,
    sizes: &[u64],
    iters: Option<usize>,
    keys: usize,
    json: bool,
    gpu: Option<usize>,
) -> PerfResult<()> {
    if sizes.contains(&0) || iters == Some(0) || keys == 0 {
        return Err("sizes, -n and --keys must be at least 1".into());
    }
    if let Some(ordinal) = gpu {
        gpu_present(ordinal)?;
    }
    if psnet::kv::started_by_launcher().map_err(|e| e.to_string())? {
        // Scheduler and server processes run inside launch_from_env and exit there.
        let config = psnet::kv::launch_from_env().map_err(|e| e.to_string())?;
        return kv::run_worker(config, sizes, iters, keys, json, gpu);
    }
    launch_self(servers, workers)
}

fn run_kv_sparse(
    servers: u32,
    workers: u32,
    sparse: kv_rows::Sparse,
    iters: Option<usize>,
    json: bool,
) -> PerfResult<()> {
    if iters == Some(0) {
        return Err("-n must be at least 1".into());
    }
    if psnet::kv::started_by_launcher().map_err(|e| e.to_string())? {
        // Scheduler and server processes run inside launch_from_env and exit there.
        let config = psnet::kv::launch_from_env().map_err(|e| e.to_string())?;
        return kv_rows::run_worker(config, sparse, iters, json);
    }
    launch_self(servers, workers)
}

/// Runs this command again as every process of a job on this host.
fn launch_self(servers: u32, workers: u32) -> PerfResult<()> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut command = vec![exe.to_string_lossy().into_owned()];
    command.extend(std::env::args().skip(1));
    let spec = psnet_launch::JobSpec::new(servers, workers, command);
    let outcome = psnet_launch::launch_local(&spec).map_err(|e| e.to_string())?;
    if let Some(sig) = outcome.signal {
        return Err(format!(
            "stopped by signal {sig}; every process of the job was stopped"
        ));
    }
    match outcome.first_failure {
        None => Ok(()),
        Some((role, index, status)) => Err(format!("{} {index} failed ({status})", role.as_env())),
    }
}

fn run_kvload(args: &kvload::LoadArgs) -> PerfResult<()> {
    if args.workers == 0 || args.servers == 0 || args.elems == 0 || args.keys + args.sharded == 0 {
        return Err("kvload needs servers, workers, keys and elements".into());
    }
    if psnet::kv::started_by_launcher().map_err(|e| e.to_string())? {
        // Scheduler and server processes run inside launch_from_env and exit there.
        let config = psnet::kv::launch_from_env().map_err(|e| e.to_string())?;
        return kvload::run_worker(config, args);
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut command = vec![exe.to_string_lossy().into_owned()];
    command.extend(std::env::args().skip(1));
    let spec = psnet_launch::JobSpec::new(args.servers, args.workers, command);
    let sampler = kvload::Sampler::start(std::time::Duration::from_millis(50));
    let started = std::time::Instant::now();
    let outcome = psnet_launch::launch_local(&spec).map_err(|e| e.to_string());
    let peaks = sampler.finish();
    let outcome = outcome?;
    if let Some(sig) = outcome.signal {
        return Err(format!("stopped by signal {sig}"));
    }
    if let Some((role, index, status)) = outcome.first_failure {
        return Err(format!("{} {index} failed ({status})", role.as_env()));
    }
    let wall = started.elapsed().as_secs_f64();
    if args.json {
        for (role, kibs) in &peaks.by_role {
            for kib in kibs {
                println!(
                    "{}",
                    serde_json::json!({"test": "kvload", "role": role, "peak_rss_kib": kib,
                        "servers": args.servers, "workers": args.workers, "keys": args.keys,
                        "rounds": args.rounds, "wall_s": wall})
                );
            }
        }
    } else {
        print!("{}", kvload::report(&peaks, args, wall));
    }
    Ok(())
}

/// Whether `--gpu` can run here, checked before any process of the job starts.
#[cfg(feature = "cuda")]
fn gpu_present(ordinal: usize) -> PerfResult<()> {
    match psnet::compression::cuda::device_count() {
        Ok(count) if ordinal < count => Ok(()),
        Ok(count) => Err(format!("--gpu {ordinal}: only {count} CUDA devices here")),
        Err(e) => Err(format!("--gpu: {e}")),
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_present(_ordinal: usize) -> PerfResult<()> {
    Err(kv::GPU_FEATURE.into())
}

fn print_env() {
    println!(
        "{:<32} {:<12} {:<14} DESCRIPTION",
        "VARIABLE", "DEFAULT", "CURRENT"
    );
    let all = psnet::config::env::ALL.iter();
    for var in all {
        let current = var.get().unwrap_or_else(|| "-".into());
        let default = if var.default.is_empty() {
            "-"
        } else {
            var.default
        };
        println!(
            "{:<32} {:<12} {:<14} {}",
            var.name, default, current, var.description
        );
    }
}

fn print_selection(json: bool, pref: Option<TransportPref>) -> PerfResult<()> {
    let sel = Selection::from_env(pref).map_err(|e| e.to_string())?;
    if json {
        let value = serde_json::json!({
            "address": sel.address.ip.to_string(),
            "interface": sel.address.interface,
            "address_reason": sel.address.reason,
            "transport": sel.decision.kind.name(),
            "transport_reason": sel.decision.reason,
        });
        println!("{value}");
    } else {
        println!("address:   {}", sel.address);
        println!(
            "transport: {} ({})",
            sel.decision.kind.name(),
            sel.decision.reason
        );
    }
    Ok(())
}
