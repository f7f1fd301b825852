//! Throughput of the CUDA kernels against a device-to-device copy of the gradient, measured
//! in one process on the same device (what `psnet-perf compress --gpu` prints).
//!
//! # Method
//! The gradient holds pseudo-random values in [-1, 1) (so every code occurs), the residual
//! starts at zero. One untimed warm-up repetition comes first; each repetition then times,
//! with CUDA events on the compressor's stream, one device-to-device copy of the gradient,
//! one quantize, one dequantize and one dequantize-add. Figures are medians over the
//! repetitions.
//!
//! Bandwidth counts the bytes each operation reads and writes in device memory, as a copy is
//! counted (`8 * n` bytes for a copy of `n` elements): quantize reads the gradient and the
//! residual and writes the residual and the compressed bytes; dequantize reads the compressed
//! bytes and writes the values; dequantize-add also reads the values. `vs_copy` is the
//! kernel's bandwidth over the copy's. 1 GB = 10^9 bytes.

use std::fmt::Write as _;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use serde::Serialize;

use super::{cuda_err, guard, CudaCompressor};
use crate::error::CompressionError;

/// One kernel measured beside the copy. Field names carry their units; serialises to flat JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuMeasureRow {
    /// `"2bit"` or `"1bit"`.
    pub scheme: String,
    /// `"quantize"`, `"dequantize"` or `"dequantize_add"`.
    pub op: String,
    /// Number of `f32` elements.
    pub n: usize,
    /// Median time of the kernel, microseconds.
    pub kernel_us: f64,
    /// Device-memory bytes the kernel reads and writes.
    pub kernel_bytes: u64,
    /// The kernel's bandwidth, GB/s.
    pub kernel_gb_s: f64,
    /// Median time of the device-to-device copy of the gradient, microseconds.
    pub copy_us: f64,
    /// The copy's bandwidth (read + written), GB/s.
    pub copy_gb_s: f64,
    /// `kernel_gb_s / copy_gb_s`.
    pub vs_copy: f64,
}

/// Measures quantize, dequantize and dequantize-add of `compressor` on `n` elements against a
/// device-to-device copy, `reps` timed repetitions (at least one).
pub fn measure_gpu(
    compressor: &CudaCompressor,
    n: usize,
    reps: usize,
) -> Result<Vec<GpuMeasureRow>, CompressionError> {
    let stream = compressor.stream().clone();
    let host = pseudo_random(n);
    let grad = guard(|| stream.clone_htod(&host)).map_err(cuda_err("copy to device"))?;
    drop(host);
    let mut residual: CudaSlice<f32> =
        guard(|| stream.alloc_zeros(n)).map_err(cuda_err("allocating the residual"))?;
    let mut values: CudaSlice<f32> =
        guard(|| stream.alloc_zeros(n)).map_err(cuda_err("allocating the values"))?;
    let mut packed: CudaSlice<u8> = guard(|| stream.alloc_zeros(compressor.compressed_len(n)))
        .map_err(cuda_err("allocating the compressed buffer"))?;

    let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for rep in 0..=reps.max(1) {
        let copy = timed(&stream, || {
            guard(|| stream.memcpy_dtod(&grad, &mut values)).map_err(cuda_err("copy"))
        })?;
        let quantize = timed(&stream, || {
            compressor.quantize(&grad, &mut residual, &mut packed)
        })?;
        let dequantize = timed(&stream, || compressor.dequantize(&packed, &mut values))?;
        let dequantize_add = timed(&stream, || compressor.dequantize_add(&packed, &mut values))?;
        if rep > 0 {
            for (list, t) in times
                .iter_mut()
                .zip([copy, quantize, dequantize, dequantize_add])
            {
                list.push(t);
            }
        }
    }
    let [copy, quantize, dequantize, dequantize_add] = times.map(median);

    let f32_bytes = 4 * n as u64;
    let packed_bytes = compressor.compressed_len(n) as u64;
    let copy_bytes = 2 * f32_bytes;
    let copy_gb_s = gb_s(copy_bytes, copy);
    let row = |op: &str, us: f64, bytes: u64| {
        let kernel_gb_s = gb_s(bytes, us);
        GpuMeasureRow {
            scheme: compressor.scheme().to_string(),
            op: op.into(),
            n,
            kernel_us: us,
            kernel_bytes: bytes,
            kernel_gb_s,
            copy_us: copy,
            copy_gb_s,
            vs_copy: if copy_gb_s > 0.0 {
                kernel_gb_s / copy_gb_s
            } else {
                0.0
            },
        }
    };
    Ok(vec![
        row("quantize", quantize, 3 * f32_bytes + packed_bytes),
        row("dequantize", dequantize, packed_bytes + f32_bytes),
        row(
            "dequantize_add",
            dequantize_add,
            packed_bytes + 2 * f32_bytes,
        ),
    ])
}

/// Microseconds between events recorded around `work` on `stream`.
fn timed(
    stream: &std::sync::Arc<CudaStream>,
    work: impl FnOnce() -> Result<(), CompressionError>,
) -> Result<f64, CompressionError> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = guard(|| stream.record_event(flags)).map_err(cuda_err("recording an event"))?;
    work()?;
    let end = guard(|| stream.record_event(flags)).map_err(cuda_err("recording an event"))?;
    let ms = guard(|| start.elapsed_ms(&end)).map_err(cuda_err("reading an event"))?;
    Ok(f64::from(ms) * 1e3)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn gb_s(bytes: u64, us: f64) -> f64 {
    if us > 0.0 {
        bytes as f64 / (us * 1e3)
    } else {
        0.0
    }
}

/// Values in [-1, 1) from a fixed xorshift sequence (the figures do not depend on a seed).
fn pseudo_random(n: usize) -> Vec<f32> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The rows as a table, perftest style: one line per kernel with the copy beside it.
pub fn format_gpu_table(rows: &[GpuMeasureRow]) -> String {
    let mut s = format!(
        "{:>6} {:>15} {:>11} {:>12} {:>12} {:>12} {:>12} {:>8}\n",
        "scheme",
        "kernel",
        "#elements",
        "kernel[us]",
        "kernel[GB/s]",
        "copy[us]",
        "copy[GB/s]",
        "vs_copy"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:>6} {:>15} {:>11} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>7.2}x",
            r.scheme, r.op, r.n, r.kernel_us, r.kernel_gb_s, r.copy_us, r.copy_gb_s, r.vs_copy
        );
    }
    s
}

/// The rows as JSON Lines: one flat object per row, on its own line (no trailing newline),
/// `"test": "compress-gpu"` then the [`GpuMeasureRow`] fields (units in the names).
pub fn format_gpu_json(rows: &[GpuMeasureRow]) -> String {
    crate::measure::json_lines("compress-gpu", rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_medians_and_ratios() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(Vec::new()), 0.0);
        assert_eq!(gb_s(2_000_000_000, 1e6), 2.0);
        assert_eq!(gb_s(1, 0.0), 0.0);
    }

    #[test]
    fn gradient_covers_both_signs_within_one() {
        let v = pseudo_random(10_000);
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(v.iter().any(|&x| x > 0.9) && v.iter().any(|&x| x < -0.9));
    }
}
