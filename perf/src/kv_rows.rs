//! `psnet-perf kv --sparse ROWSxWIDTH`: a sparse model's step on the kv store, per worker. A
//! step pushes the gradient of the rows a batch touched (`--touched` of them, a fresh random
//! set each step) and pulls those rows back, updated by the servers' SGD (MXNet's lazy
//! update); beside it, in the same job, the dense step pushes and pulls the whole table, and
//! both pulls alone are timed too. Rank 0 prints the medians.

use std::collections::BTreeSet;
use std::time::Instant;

use psnet::kv::updater::OptimizerSpec;
use psnet::kv::{KvConfig, KvError, Worker};
use serde::Serialize;

use crate::session::PerfResult;

/// A table's shape and the rows a step touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sparse {
    /// Rows in the table.
    pub rows: usize,
    /// Elements (float32) per row.
    pub width: usize,
    /// Rows each step touches.
    pub touched: usize,
}

impl Sparse {
    /// From `ROWSxWIDTH` and the rows touched per step (default: 1% of the rows).
    pub(crate) fn parse(shape: &str, touched: Option<usize>) -> Result<Sparse, String> {
        let bad = || format!("--sparse takes ROWSxWIDTH (such as 1000000x64), not {shape:?}");
        let (r, w) = shape.split_once(['x', 'X']).ok_or_else(bad)?;
        let rows: usize = r.trim().parse().map_err(|_| bad())?;
        let width: usize = w.trim().parse().map_err(|_| bad())?;
        if rows == 0 || width == 0 {
            return Err(bad());
        }
        let touched = touched.unwrap_or((rows / 100).max(1));
        if touched == 0 || touched > rows {
            return Err(format!(
                "--touched {touched}: between 1 and the table's {rows} rows"
            ));
        }
        if rows
            .checked_mul(width)
            .and_then(|n| n.checked_mul(4))
            .is_none()
        {
            return Err(format!("a table of {rows} x {width} float32 is too large"));
        }
        Ok(Sparse {
            rows,
            width,
            touched,
        })
    }
}

/// What rank 0 measured.
#[derive(Clone, Debug, Serialize)]
pub struct SparseRow {
    /// Rows in the table.
    pub rows: usize,
    /// Elements per row.
    pub width: usize,
    /// Rows each step touched.
    pub touched: usize,
    /// Timed steps per kind.
    pub iterations: usize,
    /// Median dense step (push and pull of the whole table), milliseconds.
    pub dense_step_ms: f64,
    /// Median row step (push of the touched rows, pull of them), milliseconds.
    pub row_step_ms: f64,
    /// Dense step time over row step time.
    pub dense_over_rows_step: f64,
    /// Median dense pull, milliseconds.
    pub dense_pull_ms: f64,
    /// Median row pull of the touched rows, milliseconds.
    pub row_pull_ms: f64,
}

fn median_ms(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Keeps the milliseconds since `start` when `timed` (past the warm-up).
fn keep(times: &mut Vec<f64>, timed: bool, start: Instant) {
    if timed {
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
}

/// `touched` distinct rows of `rows`, drawn from `seed`, in increasing order.
fn draw(rows: usize, touched: usize, seed: u64) -> Vec<u64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut set = BTreeSet::new();
    while set.len() < touched {
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        set.insert(x.wrapping_mul(0x2545_F491_4F6C_DD1D) % rows as u64);
    }
    set.into_iter().collect()
}

async fn measure(kv: &Worker, s: Sparse, iters: usize) -> Result<SparseRow, KvError> {
    const DENSE: u64 = 0;
    const TABLE: u64 = 1;
    let n = s.rows * s.width;
    let table = vec![1.0f32; n];
    kv.init(&[DENSE], &[&table[..]]).await?;
    kv.init_rows(TABLE, s.width, &table).await?;
    let spec = OptimizerSpec::parse(r#"{"type":"sgd","learning_rate":0.01}"#)
        .map_err(|e| KvError::Invalid(e.to_string()))?;
    kv.set_optimizer(&spec).await?;
    kv.barrier().await?;
    let grad = vec![0.5f32; n];
    let mut out = vec![0f32; n];
    let rank = u64::from(kv.rank());
    // Every step's rows and gradient, drawn before the clock runs.
    let warmup = 2;
    let steps: Vec<(Vec<u64>, Vec<f32>)> = (0..warmup + iters)
        .map(|i| {
            let ids = draw(s.rows, s.touched, 1_000 * rank + i as u64 + 1);
            let values = (0..s.touched * s.width)
                .map(|j| ((j + i) % 7) as f32 * 0.125 - 0.375)
                .collect();
            (ids, values)
        })
        .collect();
    let mut rows_out = vec![0f32; s.touched * s.width];
    // Each kind in a phase of its own, the rows first: a dense phase's large buffers are
    // still being freed when the next phase starts.
    let mut row_step = Vec::new();
    for (i, (ids, values)) in steps.iter().enumerate() {
        let start = Instant::now();
        kv.push_rows(TABLE, s.width, ids, values).await?;
        kv.pull_rows(TABLE, s.width, ids, &mut rows_out).await?;
        keep(&mut row_step, i >= warmup, start);
    }
    let mut row_pull = Vec::new();
    for (i, (ids, _)) in steps.iter().enumerate() {
        let start = Instant::now();
        kv.pull_rows(TABLE, s.width, ids, &mut rows_out).await?;
        keep(&mut row_pull, i >= warmup, start);
    }
    let mut dense_step = Vec::new();
    for i in 0..warmup + iters {
        let start = Instant::now();
        kv.push(DENSE, &grad).await?;
        kv.pull(DENSE, &mut out).await?;
        keep(&mut dense_step, i >= warmup, start);
    }
    let mut dense_pull = Vec::new();
    for i in 0..warmup + iters {
        let start = Instant::now();
        kv.pull(DENSE, &mut out).await?;
        keep(&mut dense_pull, i >= warmup, start);
    }
    let (dense_step_ms, row_step_ms) = (median_ms(dense_step), median_ms(row_step));
    Ok(SparseRow {
        rows: s.rows,
        width: s.width,
        touched: s.touched,
        iterations: iters,
        dense_step_ms,
        row_step_ms,
        dense_over_rows_step: dense_step_ms / row_step_ms,
        dense_pull_ms: median_ms(dense_pull),
        row_pull_ms: median_ms(row_pull),
    })
}

/// Runs the benchmark as one worker of a launched job; rank 0 prints.
pub fn run_worker(
    config: KvConfig,
    sparse: Sparse,
    iters: Option<usize>,
    json: bool,
) -> PerfResult<()> {
    // One thread carries the connections while the call runs on this one, as in psnet's
    // Python workers (the shape a training script has).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let kv = psnet::kv::join(&config).await.map_err(|e| e.to_string())?;
        let row = measure(&kv, sparse, iters.unwrap_or(10))
            .await
            .map_err(|e| e.to_string())?;
        if kv.rank() == 0 {
            let (servers, workers) = (kv.num_servers(), kv.num_workers());
            if json {
                let context = serde_json::json!({"test": "kv_sparse", "servers": servers,
                    "workers": workers, "transport": kv.transport_name()});
                println!("{}", crate::report::json_line(&context, &row));
            } else {
                println!(
                    "# kv sparse step: {} x {} float32, {} rows a step, {servers} servers, \
                     {workers} workers, {} ({} steps, medians)",
                    row.rows,
                    row.width,
                    row.touched,
                    kv.transport_name(),
                    row.iterations
                );
                println!(
                    "dense step (push + pull) {:.3} ms | row step (push_rows + pull_rows) \
                     {:.3} ms | {:.1}x",
                    row.dense_step_ms, row.row_step_ms, row.dense_over_rows_step
                );
                println!(
                    "dense pull {:.3} ms | row pull {:.3} ms | {:.1}x",
                    row.dense_pull_ms,
                    row.row_pull_ms,
                    row.dense_pull_ms / row.row_pull_ms
                );
            }
        }
        kv.finalize().await.map_err(|e| e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_are_named() {
        let s = Sparse::parse("1000000x64", None).unwrap();
        assert_eq!((s.rows, s.width, s.touched), (1_000_000, 64, 10_000));
        assert_eq!(Sparse::parse("10X3", Some(10)).unwrap().touched, 10);
        assert!(Sparse::parse("10x3", Some(11))
            .unwrap_err()
            .contains("--touched 11"));
        assert!(Sparse::parse("10", None)
            .unwrap_err()
            .contains("ROWSxWIDTH"));
        assert!(Sparse::parse("0x3", None)
            .unwrap_err()
            .contains("ROWSxWIDTH"));
    }

    #[test]
    fn a_draw_is_distinct_rows_in_order() {
        let ids = draw(1_000, 300, 7);
        assert_eq!(ids.len(), 300);
        assert!(ids.windows(2).all(|w| w[0] < w[1]) && ids[299] < 1_000);
        assert_ne!(ids, draw(1_000, 300, 8));
    }
}
