//! `psnet-perf kv`: push, pull and push+pull goodput of the kv store, per worker, for each value
//! size. Without `DMLC_ROLE` it launches a job on this host running itself in every role;
//! started by a launcher, it is one process of that job. Rank 0 prints the results.

use std::time::Instant;

use psnet::kv::{KvConfig, Worker};
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

/// Measures every size on a joined worker; returns the rows (every worker measures, in
/// lockstep, since `dist_sync` rounds need all of them).
pub async fn measure(
    kv: &Worker,
    sizes: &[u64],
    iters: Option<usize>,
    in_flight: usize,
) -> PerfResult<Vec<KvRow>> {
    let err = |e: psnet::kv::KvError| e.to_string();
    let in_flight = in_flight.max(1);
    let mut rows = Vec::new();
    for (i, &bytes) in sizes.iter().enumerate() {
        let n = (bytes / 4).max(1) as usize;
        let keys: Vec<u64> = (0..in_flight as u64)
            .map(|k| (i * 1000) as u64 + k)
            .collect();
        let values = vec![1.0f32; n];
        let mut outs: Vec<Vec<f32>> = vec![vec![0.0f32; n]; in_flight];
        let value_refs: Vec<&[f32]> = keys.iter().map(|_| values.as_slice()).collect();
        kv.init(&keys, &value_refs).await.map_err(err)?;
        let iters = iters.unwrap_or_else(|| default_iters(bytes * in_flight as u64));
        let warmup = 2;
        // One phase per operation, so that every worker runs the same operation at the same
        // time (a dist_sync push waits for all workers; mixing phases would time the others).
        let (mut push_t, mut pull_t, mut pp_t) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..warmup + iters {
            let t = Instant::now();
            kv.push_many(&keys, &value_refs).await.map_err(err)?;
            if round >= warmup {
                push_t.push(t.elapsed().as_secs_f64());
            }
        }
        kv.barrier().await.map_err(err)?;
        for round in 0..warmup + iters {
            let t = Instant::now();
            let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
            kv.pull_many(&keys, &mut out_refs).await.map_err(err)?;
            if round >= warmup {
                pull_t.push(t.elapsed().as_secs_f64());
            }
        }
        kv.barrier().await.map_err(err)?;
        for round in 0..warmup + iters {
            let t = Instant::now();
            kv.pushpull_many(&keys, &value_refs, &mut outs)
                .await
                .map_err(err)?;
            if round >= warmup {
                pp_t.push(t.elapsed().as_secs_f64());
            }
        }
        kv.barrier().await.map_err(err)?;
        let payload = (n * 4 * in_flight) as f64;
        let rate = |times: Vec<f64>| payload / median(times);
        let (push, pull, pp_median) = (rate(push_t), rate(pull_t), median(pp_t.clone()));
        let pushpull = payload / pp_median;
        rows.push(KvRow {
            bytes: (n * 4) as u64,
            keys_in_flight: in_flight,
            iterations: iters,
            push_mb_s: push / 1e6,
            pull_mb_s: pull / 1e6,
            pushpull_mb_s: pushpull / 1e6,
            push_gbit_s: push * 8.0 / 1e9,
            pull_gbit_s: pull * 8.0 / 1e9,
            pushpull_gbit_s: pushpull * 8.0 / 1e9,
            pushpull_median_us: pp_median * 1e6,
        });
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

/// Runs the benchmark as one worker of a launched job; rank 0 prints.
pub fn run_worker(
    config: KvConfig,
    sizes: &[u64],
    iters: Option<usize>,
    in_flight: usize,
    json: bool,
) -> PerfResult<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let kv = psnet::kv::join(&config).await.map_err(|e| e.to_string())?;
        let rows = measure(&kv, sizes, iters, in_flight).await;
        let (servers, workers, rank) = (kv.num_servers(), kv.num_workers(), kv.rank());
        let transport = kv.transport_name();
        kv.finalize().await.map_err(|e| e.to_string())?;
        let rows = rows?;
        if rank == 0 {
            if json {
                let doc = serde_json::json!({
                    "test": "kv",
                    "servers": servers,
                    "workers": workers,
                    "transport": transport,
                    "results": rows,
                });
                println!("{doc}");
            } else {
                print!("{}", table(&rows, servers, workers, transport));
            }
        }
        Ok(())
    })
}
