//! Throughput measurement of the compression kernels against memcpy, run in one process on
//! the same buffers (what `psnet-perf compress` prints).
//!
//! ```no_run
//! use psnet_compression::{measure, Scheme};
//!
//! let rows = vec![
//!     measure::measure(Scheme::TwoBit, 16 << 20, 1, 10)?, // single thread
//!     measure::measure(Scheme::TwoBit, 16 << 20, 0, 10)?, // all threads
//! ];
//! print!("{}", measure::format_table(&rows));
//! println!("{}", measure::format_json(&rows));
//! # Ok::<(), psnet_compression::CompressionError>(())
//! ```
//!
//! # Method
//! All buffers are allocated and written before timing (no page faults inside the timed
//! region). Each repetition times, in this order, one quantize, one dequantize, one
//! dequantize-add and one memcpy (`copy_from_slice` of the gradient into the dequantize
//! output, the same number of bytes); one untimed warm-up repetition comes first. Figures are
//! medians over the repetitions, so the ratios compare the kernels with the memory bandwidth
//! of the same moment. With several threads, memcpy is split across the same threads in the
//! same chunks as the kernels.
//!
//! Throughput counts the uncompressed `f32` bytes (`4 * n`): gradient bytes read for
//! quantize, bytes of `f32` output for dequantize / dequantize-add, bytes copied for memcpy.
//! 1 GB = 10^9 bytes.

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::compressor::{Compressor, Scheme};
use crate::error::CompressionError;
use crate::parallel::{self, Parallelism};
use crate::simd::SimdLevel;
use crate::{OneBitCompressor, TwoBitCompressor};

/// What to measure. [`MeasureOptions::new`] fills in the defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasureOptions {
    /// The scheme.
    pub scheme: Scheme,
    /// Number of `f32` elements.
    pub n: usize,
    /// Threads; `0` = all threads of the rayon global pool. Arrays are split only into chunks
    /// of at least 64 Ki elements here.
    pub threads: usize,
    /// Timed repetitions (at least 1; medians are reported).
    pub reps: usize,
    /// The threshold (default [`crate::DEFAULT_THRESHOLD`]).
    pub threshold: f32,
    /// Forced SIMD level (`None` = [`SimdLevel::detect`]).
    pub simd: Option<SimdLevel>,
}

impl MeasureOptions {
    /// Options with threshold 0.5 and the detected SIMD level.
    pub fn new(scheme: Scheme, n: usize, threads: usize, reps: usize) -> Self {
        MeasureOptions {
            scheme,
            n,
            threads,
            reps,
            threshold: crate::DEFAULT_THRESHOLD,
            simd: None,
        }
    }
}

/// One measured configuration. Field names carry their units; serialises to flat JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MeasureRow {
    /// `"2bit"` or `"1bit"`.
    pub scheme: String,
    /// Number of `f32` elements.
    pub n: usize,
    /// Threads used (resolved when `0` was asked).
    pub threads: usize,
    /// SIMD level used (`"avx2"`, `"sse2"`, `"scalar"`).
    pub simd: String,
    /// Timed repetitions.
    pub reps: usize,
    /// Uncompressed size, `4 * n`.
    pub input_bytes: usize,
    /// Compressed size.
    pub compressed_bytes: usize,
    /// Quantize throughput, gradient bytes per second / 1e9 (median).
    pub quantize_gb_s: f64,
    /// Dequantize throughput, output `f32` bytes per second / 1e9 (median).
    pub dequantize_gb_s: f64,
    /// Dequantize-add throughput, accumulator bytes per second / 1e9 (median).
    pub dequantize_add_gb_s: f64,
    /// memcpy of the gradient buffer, bytes per second / 1e9 (median).
    pub memcpy_gb_s: f64,
    /// `quantize_gb_s / memcpy_gb_s`.
    pub quantize_vs_memcpy: f64,
    /// `dequantize_gb_s / memcpy_gb_s`.
    pub dequantize_vs_memcpy: f64,
    /// `dequantize_add_gb_s / memcpy_gb_s`.
    pub dequantize_add_vs_memcpy: f64,
    /// Median quantize time, seconds.
    pub quantize_s: f64,
    /// Median dequantize-add time, seconds.
    pub dequantize_add_s: f64,
    /// Median memcpy time, seconds.
    pub memcpy_s: f64,
}

/// Minimum chunk when measuring with several threads (smaller than the library default so
/// that mid-sized arrays are split too).
const MEASURE_MIN_CHUNK: usize = 64 * 1024;

/// Measures `scheme` on `n` elements with `threads` threads (`0` = all), `reps` repetitions,
/// threshold 0.5 and the detected SIMD level. See the [module docs](self) for the method.
pub fn measure(
    scheme: Scheme,
    n: usize,
    threads: usize,
    reps: usize,
) -> Result<MeasureRow, CompressionError> {
    measure_with(&MeasureOptions::new(scheme, n, threads, reps))
}

/// Measures with explicit options.
pub fn measure_with(opts: &MeasureOptions) -> Result<MeasureRow, CompressionError> {
    let par = Parallelism::threads(opts.threads).with_min_chunk(MEASURE_MIN_CHUNK);
    let simd = opts.simd.unwrap_or_else(SimdLevel::detect).check()?;
    let compressor: Box<dyn Compressor> = match opts.scheme {
        Scheme::TwoBit => Box::new(
            TwoBitCompressor::new(opts.threshold)?
                .with_simd(simd)?
                .with_parallelism(par),
        ),
        Scheme::OneBit => Box::new(
            OneBitCompressor::new(opts.threshold)?
                .with_simd(simd)?
                .with_parallelism(par),
        ),
    };
    let n = opts.n;
    let reps = opts.reps.max(1);

    // Deterministic gradients in [-1, 1) (a mix of all codes at t = 0.5).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let grad: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    let mut residual = vec![0.0f32; n];
    let mut compressed = vec![0u8; compressor.compressed_len(n)];
    let mut values = vec![0.0f32; n];
    let mut acc = vec![0.0f32; n];

    let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for rep in 0..=reps {
        let q = time(|| compressor.quantize(&grad, &mut residual, &mut compressed))?;
        let d = time(|| compressor.dequantize(&compressed, &mut values))?;
        let a = time(|| compressor.dequantize_add(&compressed, &mut acc))?;
        let m = time(|| {
            parallel::copy(par, black_box(&grad), &mut values);
            Ok(())
        })?;
        black_box((&residual, &values, &acc));
        if rep > 0 {
            for (list, t) in times.iter_mut().zip([q, d, a, m]) {
                list.push(t);
            }
        }
    }
    let [q, d, a, m] = times.map(median);

    let bytes = 4 * n;
    let gb_s = |t: Duration| bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9;
    let (quantize_gb_s, dequantize_gb_s, dequantize_add_gb_s, memcpy_gb_s) =
        (gb_s(q), gb_s(d), gb_s(a), gb_s(m));
    Ok(MeasureRow {
        scheme: opts.scheme.name().into(),
        n,
        threads: par.thread_count(),
        simd: simd.name().into(),
        reps,
        input_bytes: bytes,
        compressed_bytes: compressor.compressed_len(n),
        quantize_gb_s,
        dequantize_gb_s,
        dequantize_add_gb_s,
        memcpy_gb_s,
        quantize_vs_memcpy: ratio(quantize_gb_s, memcpy_gb_s),
        dequantize_vs_memcpy: ratio(dequantize_gb_s, memcpy_gb_s),
        dequantize_add_vs_memcpy: ratio(dequantize_add_gb_s, memcpy_gb_s),
        quantize_s: q.as_secs_f64(),
        dequantize_add_s: a.as_secs_f64(),
        memcpy_s: m.as_secs_f64(),
    })
}

fn time(f: impl FnOnce() -> Result<(), CompressionError>) -> Result<Duration, CompressionError> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed())
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}

/// Formats rows as an aligned text table, one line per row, with a header line.
pub fn format_table(rows: &[MeasureRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<6} {:>10} {:>7} {:<6} {:>13} {:>15} {:>19} {:>11} {:>10} {:>11} {:>12}",
        "scheme",
        "n",
        "threads",
        "simd",
        "quantize GB/s",
        "dequantize GB/s",
        "dequantize-add GB/s",
        "memcpy GB/s",
        "q/memcpy",
        "dq/memcpy",
        "dqa/memcpy"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<6} {:>10} {:>7} {:<6} {:>13.2} {:>15.2} {:>19.2} {:>11.2} {:>10.2} {:>11.2} {:>12.2}",
            r.scheme,
            r.n,
            r.threads,
            r.simd,
            r.quantize_gb_s,
            r.dequantize_gb_s,
            r.dequantize_add_gb_s,
            r.memcpy_gb_s,
            r.quantize_vs_memcpy,
            r.dequantize_vs_memcpy,
            r.dequantize_add_vs_memcpy
        );
    }
    s
}

/// Formats rows as JSON Lines: one flat object per row, on its own line (no trailing newline),
/// `"test": "compress"` then the [`MeasureRow`] fields (units in the names).
pub fn format_json(rows: &[MeasureRow]) -> String {
    json_lines("compress", rows)
}

/// One JSON object per row, `"test": test` first, then the row's own fields.
pub(crate) fn json_lines<R: Serialize>(test: &'static str, rows: &[R]) -> String {
    #[derive(Serialize)]
    struct Line<'a, R> {
        test: &'static str,
        #[serde(flatten)]
        row: &'a R,
    }
    rows.iter()
        .map(|row| {
            serde_json::to_string(&Line { test, row })
                .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_small_arrays() {
        for scheme in [Scheme::TwoBit, Scheme::OneBit] {
            let row = measure(scheme, 100_000, 2, 2).unwrap();
            assert_eq!(row.scheme, scheme.name());
            assert_eq!(row.n, 100_000);
            assert_eq!(row.threads, 2);
            assert_eq!(row.compressed_bytes, scheme.compressed_size(100_000));
            assert!(row.quantize_gb_s > 0.0 && row.memcpy_gb_s > 0.0);
            let table = format_table(std::slice::from_ref(&row));
            assert!(table.starts_with("scheme"));
            assert_eq!(table.lines().count(), 2);
            let text = format_json(&[row.clone(), row]);
            assert_eq!(text.lines().count(), 2, "one line per row: {text}");
            for line in text.lines() {
                let json: serde_json::Value = serde_json::from_str(line).unwrap();
                assert_eq!(json["test"], "compress");
                assert!(json["quantize_gb_s"].is_number());
                assert!(json["dequantize_add_vs_memcpy"].is_number());
            }
        }
    }

    #[test]
    fn zero_elements_do_not_divide_by_zero_badly() {
        let row = measure(Scheme::TwoBit, 0, 1, 1).unwrap();
        assert_eq!(row.compressed_bytes, 0);
        assert!(row.quantize_gb_s.is_finite() && row.quantize_vs_memcpy.is_finite());
    }
}
