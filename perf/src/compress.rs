//! `psnet-perf compress`: gradient-compression throughput next to memcpy of the same buffer,
//! measured in the same run.

use psnet::compression::measure::{
    format_json, format_table, measure_with, MeasureOptions, MeasureRow,
};
use psnet::compression::Scheme;

use crate::session::PerfResult;

/// Which schemes to measure.
pub fn schemes(name: &str) -> PerfResult<Vec<Scheme>> {
    match name {
        "all" => Ok(vec![Scheme::TwoBit, Scheme::OneBit]),
        other => other
            .parse::<Scheme>()
            .map(|s| vec![s])
            .map_err(|e| format!("--scheme: {e} (use 2bit, 1bit or all)")),
    }
}

/// One row per scheme and thread count; `threads` empty means one thread and all threads.
pub fn run(
    schemes: &[Scheme],
    n: usize,
    threads: Option<usize>,
    reps: usize,
    json: bool,
) -> PerfResult<()> {
    let thread_counts = match threads {
        Some(t) => vec![t],
        None => vec![1, 0],
    };
    let mut rows: Vec<MeasureRow> = Vec::new();
    for &scheme in schemes {
        for &t in &thread_counts {
            let opts = MeasureOptions::new(scheme, n, t, reps.max(1));
            let row = measure_with(&opts).map_err(|e| e.to_string())?;
            // JSON Lines: each row as soon as it is measured.
            if json {
                println!("{}", format_json(std::slice::from_ref(&row)));
            }
            rows.push(row);
        }
    }
    if !json {
        print!("{}", format_table(&rows));
    }
    Ok(())
}

/// The CUDA kernels of each scheme on device `ordinal` beside a device-to-device copy, for
/// `n` elements (default: 2^26 and 2^28).
#[cfg(feature = "cuda")]
pub fn run_gpu(
    schemes: &[Scheme],
    ordinal: usize,
    n: Option<usize>,
    reps: usize,
    json: bool,
) -> PerfResult<()> {
    use psnet::compression::cuda::measure::{format_gpu_json, format_gpu_table, measure_gpu};
    use psnet::compression::cuda::CudaCompressor;
    use psnet::compression::CompressionParams;

    let sizes = n.map_or_else(|| vec![1 << 26, 1 << 28], |n| vec![n]);
    let mut rows = Vec::new();
    for &scheme in schemes {
        let params = match scheme {
            Scheme::TwoBit => CompressionParams::two_bit(psnet::compression::DEFAULT_THRESHOLD),
            Scheme::OneBit => CompressionParams::one_bit(psnet::compression::DEFAULT_THRESHOLD),
        }
        .map_err(|e| e.to_string())?;
        let compressor = CudaCompressor::new(ordinal, &params).map_err(|e| e.to_string())?;
        for &n in &sizes {
            let measured = measure_gpu(&compressor, n, reps.max(1)).map_err(|e| e.to_string())?;
            // JSON Lines: each size's rows as soon as they are measured.
            if json {
                println!("{}", format_gpu_json(&measured));
            }
            rows.extend(measured);
        }
    }
    if !json {
        print!("{}", format_gpu_table(&rows));
    }
    Ok(())
}

/// Without the `cuda` feature: says how to build it.
#[cfg(not(feature = "cuda"))]
pub fn run_gpu(
    _schemes: &[Scheme],
    _ordinal: usize,
    _n: Option<usize>,
    _reps: usize,
    _json: bool,
) -> PerfResult<()> {
    Err(crate::kv::GPU_FEATURE.into())
}
