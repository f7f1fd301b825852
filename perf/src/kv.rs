//! `psnet-perf kv`: push, pull and push+pull goodput of the kv store, per worker, for each value
//! size. Without `DMLC_ROLE` it launches a job on this host running itself in every role;
//! started by a launcher, it is one process of that job. Rank 0 prints the results.

use std::time::Instant;

use psnet::kv::{KvConfig, KvError, Worker};
use serde::Serialize;

use crate::session::PerfResult;

/// One size's results, as rank 0 saw them.
#[derive(Clone, Debug, Serialize)]
pub struct KvRow {
    /// Value size in bytes.
    pub bytes: u64,
    /// Keys in flight per operation.
    pub keys_in_flight: usize,
    /// Timed operations per kind.
    pub iterations: usize,
    /// Push goodput (payload bytes / median operation time), 10^6 bytes per second.
    pub push_mb_s: f64,
    /// Pull goodput.
    pub pull_mb_s: f64,
    /// Push+pull goodput: array bytes / time of one push-then-pull exchange (psnet's
    /// `pushpull`, which answers the push with the updated value).
    pub pushpull_mb_s: f64,
    /// Push goodput in 10^9 bits per second.
    pub push_gbit_s: f64,
    /// Pull goodput in 10^9 bits per second.
    pub pull_gbit_s: f64,
    /// Push+pull goodput in 10^9 bits per second.
    pub pushpull_gbit_s: f64,
    /// Median push+pull time in microseconds.
    pub pushpull_median_us: f64,
}

/// Default timed operations: enough bytes to be stable, bounded for big values.
pub fn default_iters(bytes: u64) -> usize {
    ((512u64 << 20) / bytes.max(1)).clamp(5, 200) as usize
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The operations one size's phases time, on host or device buffers.
pub(crate) trait Ops {
    async fn push(&mut self) -> Result<(), KvError>;
    async fn pull(&mut self) -> Result<(), KvError>;
    async fn pushpull(&mut self) -> Result<(), KvError>;
}

/// Host slices, the keys in flight at once.
struct HostOps<'a> {
    kv: &'a Worker,
    keys: Vec<u64>,
    values: Vec<f32>,
    outs: Vec<Vec<f32>>,
}

impl Ops for HostOps<'_> {
    async fn push(&mut self) -> Result<(), KvError> {
        let refs: Vec<&[f32]> = self.keys.iter().map(|_| &self.values[..]).collect();
        self.kv.push_many(&self.keys, &refs).await
    }

    async fn pull(&mut self) -> Result<(), KvError> {
        let mut refs: Vec<&mut [f32]> = self.outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        self.kv.pull_many(&self.keys, &mut refs).await
    }

    async fn pushpull(&mut self) -> Result<(), KvError> {
        let refs: Vec<&[f32]> = self.keys.iter().map(|_| &self.values[..]).collect();
        self.kv
            .pushpull_many(&self.keys, &refs, &mut self.outs)
            .await
    }
}

/// Times `iters` of each operation (after two untimed), one phase per operation so that
/// every worker runs the same operation at the same time (a dist_sync push waits for all
/// workers; mixing phases would time the others).
pub(crate) async fn time_phases(
    kv: &Worker,
    ops: &mut impl Ops,
    bytes: u64,
    in_flight: usize,
    iters: usize,
) -> Result<KvRow, KvError> {
    let warmup = 2;
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for (phase, list) in times.iter_mut().enumerate() {
        for round in 0..warmup + iters {
            let t = Instant::now();
            match phase {
                0 => ops.push().await?,
                1 => ops.pull().await?,
                _ => ops.pushpull().await?,
            }
            if round >= warmup {
                list.push(t.elapsed().as_secs_f64());
            }
        }
        kv.barrier().await?;
    }
    let [push_t, pull_t, pp_t] = times;
    let payload = (bytes * in_flight as u64) as f64;
    let rate = |times: Vec<f64>| payload / median(times);
    let (push, pull, pp_median) = (rate(push_t), rate(pull_t), median(pp_t));
    let pushpull = payload / pp_median;
    Ok(KvRow {
        bytes,
        keys_in_flight: in_flight,
        iterations: iters,
        push_mb_s: push / 1e6,
        pull_mb_s: pull / 1e6,
        pushpull_mb_s: pushpull / 1e6,
        push_gbit_s: push * 8.0 / 1e9,
        pull_gbit_s: pull * 8.0 / 1e9,
        pushpull_gbit_s: pushpull * 8.0 / 1e9,
        pushpull_median_us: pp_median * 1e6,
    })
}

/// The keys of size `i`, their count, and the elements of each.
pub(crate) fn size_keys(i: usize, bytes: u64, in_flight: usize) -> (Vec<u64>, usize) {
    let n = (bytes / 4).max(1) as usize;
    let keys = (0..in_flight as u64)
        .map(|k| (i * 1000) as u64 + k)
        .collect();
    (keys, n)
}

/// Measures every size on a joined worker; returns the rows (every worker measures, in
/// lockstep, since `dist_sync` rounds need all of them).
pub async fn measure(
    kv: &Worker,
    sizes: &[u64],
    iters: Option<usize>,
    in_flight: usize,
) -> PerfResult<Vec<KvRow>> {
    let err = |e: KvError| e.to_string();
    let in_flight = in_flight.max(1);
    let mut rows = Vec::new();
    for (i, &bytes) in sizes.iter().enumerate() {
        let (keys, n) = size_keys(i, bytes, in_flight);
        let mut ops = HostOps {
            kv,
            values: vec![1.0f32; n],
            outs: vec![vec![0.0f32; n]; in_flight],
            keys,
        };
        let refs: Vec<&[f32]> = ops.keys.iter().map(|_| &ops.values[..]).collect();
        kv.init(&ops.keys, &refs).await.map_err(err)?;
        let iters = iters.unwrap_or_else(|| default_iters(bytes * in_flight as u64));
        let row = time_phases(kv, &mut ops, (n * 4) as u64, in_flight, iters).await;
        rows.push(row.map_err(err)?);
    }
    Ok(rows)
}

/// The table rank 0 prints.
pub fn table(rows: &[KvRow], servers: u32, workers: u32, transport: &str) -> String {
    let mut out = format!(
        "psnet kv goodput per worker ({servers} servers, {workers} workers, {transport}; median of the timed operations)\n {:>10} {:>7} {:>6} {:>12} {:>12} {:>15} {:>12} {:>12} {:>15}\n",
        "#bytes", "keys", "iters", "push[MB/s]", "pull[MB/s]", "push+pull[MB/s]", "push[Gb/s]", "pull[Gb/s]", "push+pull[Gb/s]"
    );
    for r in rows {
        out.push_str(&format!(
            " {:>10} {:>7} {:>6} {:>12.1} {:>12.1} {:>15.1} {:>12.3} {:>12.3} {:>15.3}\n",
            r.bytes,
            r.keys_in_flight,
            r.iterations,
            r.push_mb_s,
            r.pull_mb_s,
            r.pushpull_mb_s,
            r.push_gbit_s,
            r.pull_gbit_s,
            r.pushpull_gbit_s
        ));
    }
    out
}

/// What every JSON line of `psnet-perf kv` carries beside its row.
#[derive(Serialize)]
struct KvContext {
    test: &'static str,
    servers: u32,
    workers: u32,
    transport: &'static str,
    /// Where the values lived: `"host"`, or `"gpu"` for `--gpu`'s rows.
    memory: &'static str,
}

/// Runs the benchmark as one worker of a launched job; rank 0 prints.
/// With `gpu`, the same sizes are measured again from buffers on that device.
pub fn run_worker(
    config: KvConfig,
    sizes: &[u64],
    iters: Option<usize>,
    in_flight: usize,
    json: bool,
    gpu: Option<usize>,
) -> PerfResult<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let kv = psnet::kv::join(&config).await.map_err(|e| e.to_string())?;
        let rows = measure(&kv, sizes, iters, in_flight).await;
        let gpu_rows = match (&rows, gpu) {
            (Ok(_), Some(ordinal)) => Some(gpu_rows(&kv, ordinal, sizes, iters, in_flight).await),
            _ => None,
        };
        let (servers, workers, rank) = (kv.num_servers(), kv.num_workers(), kv.rank());
        let transport = kv.transport_name();
        // A failed measurement (an init the servers refused, say) ends this process at once,
        // without `finalize`: the other workers may wait in a barrier this one never
        // reaches, and its exit is what ends the job. The figures are printed before
        // `finalize`, which a failure elsewhere can still turn into an error.
        let rows = rows?;
        let gpu_rows = gpu_rows.transpose()?;
        if rank == 0 {
            if json {
                // JSON Lines: one flat object per size and memory, with the job's shape.
                let context = |memory| KvContext {
                    test: "kv",
                    servers,
                    workers,
                    transport,
                    memory,
                };
                for row in &rows {
                    println!("{}", crate::report::json_line(&context("host"), row));
                }
                for row in gpu_rows.iter().flatten() {
                    println!("{}", crate::report::json_line(&context("gpu"), row));
                }
            } else {
                print!("{}", table(&rows, servers, workers, transport));
                if let Some(g) = &gpu_rows {
                    println!("from GPU memory (device {}):", gpu.unwrap_or(0));
                    print!("{}", table(g, servers, workers, transport));
                    println!("GPU / host memory, same job:");
                    for (h, g) in rows.iter().zip(g) {
                        println!(
                            " {:>10} push {:.2}x  pull {:.2}x  push+pull {:.2}x",
                            h.bytes,
                            g.push_mb_s / h.push_mb_s,
                            g.pull_mb_s / h.pull_mb_s,
                            g.pushpull_mb_s / h.pushpull_mb_s
                        );
                    }
                }
            }
        }
        kv.finalize().await.map_err(|e| e.to_string())
    })
}

#[cfg(feature = "cuda")]
async fn gpu_rows(
    kv: &Worker,
    ordinal: usize,
    sizes: &[u64],
    iters: Option<usize>,
    in_flight: usize,
) -> PerfResult<Vec<KvRow>> {
    crate::kv_gpu::measure_gpu(kv, ordinal, sizes, iters, in_flight).await
}

#[cfg(not(feature = "cuda"))]
async fn gpu_rows(
    _kv: &Worker,
    _ordinal: usize,
    _sizes: &[u64],
    _iters: Option<usize>,
    _in_flight: usize,
) -> PerfResult<Vec<KvRow>> {
    Err(GPU_FEATURE.into())
}

/// What `--gpu` says on a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub const GPU_FEATURE: &str = "--gpu needs psnet-perf built with the cuda feature \
     (cargo build --release -p psnet-perf --features cuda)";
