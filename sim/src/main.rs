//! `psnet-sim`: psnet's real protocol code (kv scheduler, servers and workers; collectives)
//! on simulated hosts and links, in simulated time.
//!
//! `psnet-sim calibrate` runs the jobs `scripts/bench-cluster.sh` runs on the emulated
//! cluster (kv one key per operation at S servers x W workers, allreduce one rank per host)
//! on a model of that cluster: hosts whose links have the rig's rate, shared max-min fairly
//! by the connections crossing them (`psnet_memnet::LinkModel`). Beside each simulated time
//! it prints the wire bound, so the model's figures compare with the rig's in the same
//! terms. What the model leaves out: TCP's ramp-up, windows and losses, the CPU (compute
//! takes no simulated time), and latency beyond a fixed amount per link.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod allreduce;
mod kv_job;
mod rig;
mod scale;
mod start;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use rig::Rig;
use scale::KvMode;

#[derive(Parser)]
#[command(
    name = "psnet-sim",
    about = "psnet's protocol code on simulated hosts and links"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The emulated cluster's kv and allreduce jobs on a model of it.
    Calibrate(CalibrateArgs),
    /// kv jobs and communicators at many nodes, one a host.
    Scale(ScaleArgs),
}

#[derive(clap::Args)]
struct ScaleArgs {
    /// Node counts: for kv, servers + workers (a quarter servers); for collectives, ranks.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128")]
    nodes: Vec<usize>,
    /// Each host's link, each way, in Gbit/s.
    #[arg(long, default_value_t = 100.0)]
    gbit: f64,
    /// Latency each link adds to a message, in microseconds.
    #[arg(long, default_value_t = 5)]
    latency_us: u64,
    /// How many times slower than described the network runs (a timer tick stands for
    /// 1/SLOW ms). At 1000, a tick of 1 us rounded up each of a ring's 2(n - 1) steps of
    /// about 10 us: 1,024 ranks' allreduce came out 1.09x its bound, 1.01x at 10,000 (the
    /// same wall clock).
    #[arg(long, default_value_t = 10_000.0)]
    slow: f64,
    /// Keys a kv worker pushes and pulls in a round.
    #[arg(long, default_value_t = 4)]
    kv_keys: usize,
    /// Bytes of each key (K, M suffixes are binary).
    #[arg(long, default_value = "64K")]
    kv_bytes: String,
    /// Bytes of the allreduce (K, M suffixes are binary).
    #[arg(long, default_value = "1M")]
    allreduce_bytes: String,
    /// The kv jobs to run: sync (`dist_sync`), 2bit (`dist_sync`, 2-bit pushes), async
    /// (`dist_async`, SGD).
    #[arg(long, value_delimiter = ',', default_value = "sync,2bit,async", value_parser = parse_mode)]
    kv_modes: Vec<KvMode>,
    /// Print JSON Lines, one object per row.
    #[arg(long)]
    json: bool,
}

/// One row of the scale table.
struct Row {
    job: &'static str,
    start: Duration,
    root: psnet_memnet::Traffic,
    conns: usize,
    root_conns: usize,
    peak_queued: u64,
    op: Duration,
    bound: Duration,
    wall: Duration,
}

fn parse_mode(s: &str) -> Result<KvMode, String> {
    match s.trim() {
        "sync" => Ok(KvMode::Sync),
        "2bit" => Ok(KvMode::TwoBit),
        "async" => Ok(KvMode::Async),
        other => Err(format!("not a kv mode: {other:?} (sync, 2bit or async)")),
    }
}

#[derive(clap::Args)]
struct CalibrateArgs {
    /// Hosts.
    #[arg(long, default_value_t = 4)]
    hosts: usize,
    /// Each host's link, each way, in Gbit/s (10^9 bits).
    #[arg(long, default_value_t = 1.0)]
    gbit: f64,
    /// Latency each link adds to a message, in microseconds (the rig adds none on purpose:
    /// this kernel has no netem; what its veth pairs and bridge cost is about this).
    #[arg(long, default_value_t = 30)]
    latency_us: u64,
    /// The share of the link's rate messages get (default: TCP's payload in Ethernet frames
    /// with timestamps, 1448 of 1514 bytes; 1: the model's own bound).
    #[arg(long, default_value_t = rig::TCP_EFFICIENCY)]
    efficiency: f64,
    /// How many times slower than described the network runs, so that tokio's millisecond
    /// timer ticks stand for 1/SLOW ms.
    #[arg(long, default_value_t = 100.0)]
    slow: f64,
    /// kv value sizes (bytes; K, M suffixes are binary).
    #[arg(long, value_delimiter = ',', default_value = "4M,16M")]
    kv_sizes: Vec<String>,
    /// kv shapes, servers x workers.
    #[arg(long, value_delimiter = ',', default_value = "2x2,2x4")]
    kv_shapes: Vec<String>,
    /// Timed kv operations of each kind per size (the median is reported).
    #[arg(long, default_value_t = 5)]
    kv_iters: usize,
    /// Allreduce sizes (bytes; K, M suffixes are binary).
    #[arg(long, value_delimiter = ',', default_value = "1M,2M,4M,8M,16M,32M,64M")]
    ar_sizes: Vec<String>,
    /// Timed allreduce calls per size (the mean is reported).
    #[arg(long, default_value_t = 3)]
    ar_iters: usize,
    /// Print JSON Lines, one object per row.
    #[arg(long)]
    json: bool,
}

/// `4M`, `512K`, `100`: bytes, binary suffixes.
fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, unit) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("not a size: {s:?} (bytes, with K, M or G)"))
}

/// `2x4`: servers and workers.
fn parse_shape(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("not a shape: {s:?} (servers x workers, e.g. 2x4)");
    let (a, b) = s.trim().split_once('x').ok_or_else(bad)?;
    let (a, b) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
    if a == 0 || b == 0 {
        return Err(bad());
    }
    Ok((a, b))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One row of the table: a job, its simulated time and its wire bound.
fn row(json: bool, job: &str, bytes: usize, op: &str, took: Duration, bound: Duration) {
    let ratio = took.as_secs_f64() / bound.as_secs_f64().max(f64::MIN_POSITIVE);
    if json {
        let line = serde_json::json!({
            "job": job, "bytes": bytes, "op": op,
            "sim_ms": ms(took), "bound_ms": ms(bound), "sim_over_bound": ratio,
        });
        println!("{line}");
    } else {
        println!(
            "{job:<10} {:>9} {op:<10} {:>10.2} {:>10.2} {ratio:>8.3}",
            bytes,
            ms(took),
            ms(bound)
        );
    }
}

fn calibrate(args: &CalibrateArgs) -> Result<(), String> {
    let rig = Rig {
        hosts: args.hosts,
        bytes_per_sec: args.gbit * 1e9 / 8.0,
        efficiency: args.efficiency,
        latency: Duration::from_micros(args.latency_us),
        local_bytes_per_sec: args.gbit * 1e9 / 8.0 * 20.0,
        slow: args.slow,
    };
    if args.slow.is_nan() || args.slow < 1.0 {
        return Err(format!("--slow {}: at least 1", args.slow));
    }
    if args.hosts < 2 {
        return Err(format!("--hosts {}: at least 2", args.hosts));
    }
    if args.efficiency.is_nan() || args.efficiency <= 0.0 || args.efficiency > 1.0 {
        return Err(format!(
            "--efficiency {}: above 0, at most 1",
            args.efficiency
        ));
    }
    let kv_sizes = args
        .kv_sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>, _>>()?;
    let shapes = args
        .kv_shapes
        .iter()
        .map(|s| parse_shape(s))
        .collect::<Result<Vec<_>, _>>()?;
    let ar_sizes = args
        .ar_sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>, _>>()?;
    if !args.json {
        println!(
            "# psnet-sim calibrate: {} hosts, {} Gbit/s each way ({:.3} of it for payload), \
             {} us a link, simulated {}x slow",
            args.hosts, args.gbit, args.efficiency, args.latency_us, args.slow
        );
        println!("# bound: the busiest link's bytes over its rate (push then pull: the two added)");
        println!(
            "{:<10} {:>9} {:<10} {:>10} {:>10} {:>8}",
            "job", "bytes", "op", "sim ms", "bound ms", "sim/bnd"
        );
    }
    for &(servers, workers) in &shapes {
        let times = kv_job::run(&rig, servers, workers, &kv_sizes, args.kv_iters)?;
        let job = format!("kv {servers}x{workers}");
        // Workers on the hosts left after the servers', in turn: the most on one host.
        let per_host = workers.div_ceil(args.hosts.saturating_sub(servers).max(1));
        for (t, &bytes) in times.iter().zip(&kv_sizes) {
            let one_way = kv_job::one_way_bound(&rig, servers, workers, per_host, bytes);
            row(args.json, &job, bytes, "push", t.push, one_way);
            row(args.json, &job, bytes, "pull", t.pull, one_way);
            row(
                args.json,
                &job,
                bytes,
                "push+pull",
                t.push_then_pull,
                one_way * 2,
            );
            row(args.json, &job, bytes, "pushpull", t.pushpull, one_way);
        }
    }
    if !ar_sizes.is_empty() {
        let times = allreduce::run(&rig, &ar_sizes, args.ar_iters)?;
        let n = args.hosts as f64;
        for (t, &bytes) in times.iter().zip(&ar_sizes) {
            let bound = rig.wire(2.0 * (n - 1.0) / n * bytes as f64);
            row(args.json, "allreduce", bytes, "sum", *t, bound);
        }
    }
    Ok(())
}

fn scale_rows(args: &ScaleArgs) -> Result<(), String> {
    if args.slow.is_nan() || args.slow < 1.0 {
        return Err(format!("--slow {}: at least 1", args.slow));
    }
    let kv_bytes = parse_size(&args.kv_bytes)?;
    let ar_bytes = parse_size(&args.allreduce_bytes)?;
    let rig_of = |hosts: usize| Rig {
        hosts,
        bytes_per_sec: args.gbit * 1e9 / 8.0,
        efficiency: 1.0,
        latency: Duration::from_micros(args.latency_us),
        local_bytes_per_sec: args.gbit * 1e9 / 8.0 * 4.0,
        slow: args.slow,
    };
    if !args.json {
        println!(
            "# psnet-sim scale: one node a host, {} Gbit/s each way, {} us a link; times simulated",
            args.gbit, args.latency_us
        );
        println!(
            "{:<8} {:>6} {:>10} {:>10} {:>12} {:>6} {:>10} {:>12} {:>10} {:>10} {:>7}",
            "job",
            "nodes",
            "start ms",
            "root msgs",
            "root bytes",
            "conns",
            "root conns",
            "peak queued",
            "op ms",
            "bound ms",
            "wall s"
        );
    }
    for &n in &args.nodes {
        if n < 2 {
            return Err(format!("--nodes {n}: at least 2"));
        }
        let servers = (n / 4).max(1);
        let workers = n - servers;
        let rig = rig_of(n + 1);
        // A round's bound: a worker pushes and pulls its keys one after another, so each key
        // in turn brings every worker's value into its server (or each server's share of a
        // key split over all, from MXNet's big-array bound of 10^6 elements) and sends the
        // sum back out to each; each way also pays the two links' latency. 2-bit pushes
        // carry a sixteenth of the bytes.
        let hop = Duration::from_micros(args.latency_us) * 2;
        let shards = if kv_bytes / 4 >= 1_000_000 {
            servers
        } else {
            1
        };
        let per_key = (workers * kv_bytes) as f64 / shards as f64;
        let mut rows = Vec::new();
        for &mode in &args.kv_modes {
            let wall = std::time::Instant::now();
            let kv = scale::kv(&rig, servers, workers, args.kv_keys, kv_bytes, mode)?;
            let push = match mode {
                KvMode::TwoBit => per_key / 16.0,
                KvMode::Sync | KvMode::Async => per_key,
            };
            let bound = (rig.wire(push) + rig.wire(per_key) + hop * 2) * args.kv_keys as u32;
            rows.push(Row {
                job: mode.name(),
                start: kv.bootstrap,
                root: kv.scheduler,
                conns: kv.connections,
                root_conns: kv.scheduler_connections,
                peak_queued: kv.peak_queued,
                op: kv.round,
                bound,
                wall: wall.elapsed(),
            });
        }
        let wall = std::time::Instant::now();
        let coll = scale::collectives(&rig_of(n), n, ar_bytes)?;
        // The ring: 2 (n - 1) steps, each a chunk of 1/n over a link and two links' latency.
        let ring = (rig.wire(ar_bytes as f64 / n as f64) + hop) * (2 * (n as u32 - 1));
        rows.push(Row {
            job: "coll",
            start: coll.join,
            root: coll.root,
            conns: coll.connections,
            root_conns: coll.root_connections,
            peak_queued: coll.peak_queued,
            op: coll.allreduce,
            bound: ring,
            wall: wall.elapsed(),
        });
        for r in rows {
            let messages = r.root.sent_messages + r.root.received_messages;
            let bytes = r.root.sent_bytes + r.root.received_bytes;
            if args.json {
                let line = serde_json::json!({
                    "job": r.job, "nodes": n, "start_ms": ms(r.start),
                    "root_messages": messages, "root_bytes": bytes,
                    "connections": r.conns, "root_connections": r.root_conns,
                    "peak_queued_bytes": r.peak_queued,
                    "op_ms": ms(r.op), "bound_ms": ms(r.bound), "wall_s": r.wall.as_secs_f64(),
                });
                println!("{line}");
            } else {
                println!(
                    "{:<8} {n:>6} {:>10.3} {messages:>10} {bytes:>12} {:>6} {:>10} {:>12} {:>10.3} {:>10.3} {:>7.1}",
                    r.job,
                    ms(r.start),
                    r.conns,
                    r.root_conns,
                    r.peak_queued,
                    ms(r.op),
                    ms(r.bound),
                    r.wall.as_secs_f64()
                );
            }
        }
    }
    if !args.json {
        println!("# kv: a quarter of the nodes servers (kv-2bit: 2-bit pushes; kv-async: dist_async, SGD); start: until every worker joined; root: the scheduler's messages and bytes both ways, the round included; conns: the most a server or worker holds, root conns: the scheduler's; op: one round of every worker's pushpull of each key; bound: each key in turn, every worker's value into its server and the sum back out over the server's link, each way two links' latency; peak queued: the most bytes the network held for one node at once");
        println!("# coll: start: until every rank joined; root: rank 0's messages and bytes forming it; conns: the most a rank other than 0 holds, root conns: rank 0's; op: one allreduce; bound: the ring's 2(n-1) steps of a chunk and two links' latency");
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Calibrate(args) => calibrate(args),
        Command::Scale(args) => scale_rows(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("psnet-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_shapes_parse_and_bad_ones_say_why() {
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("4X").unwrap_err().contains("not a size"));
        assert_eq!(parse_shape("2x4"), Ok((2, 4)));
        assert!(parse_shape("0x4").is_err());
        assert!(parse_shape("24").unwrap_err().contains("servers x workers"));
    }
}
