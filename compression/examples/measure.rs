//! Prints the compression throughput table (what `psnet-perf compress` shows).
//!
//! `cargo run --release -p psnet-compression --example measure -- [N] [REPS] [--json]
//! [--simd=avx2|sse2|scalar]` (defaults: N = 16777216 elements, REPS = 10, detected SIMD level).
//! Rows: each scheme single-threaded and with all threads.

use psnet_compression::measure::{format_json, format_table, measure_with, MeasureOptions};
use psnet_compression::{CompressionError, Scheme, SimdLevel};

fn main() -> Result<(), CompressionError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let mut numbers = args.iter().filter_map(|a| a.parse::<usize>().ok());
    let n = numbers.next().unwrap_or(16 << 20);
    let reps = numbers.next().unwrap_or(10);
    let simd = args
        .iter()
        .find_map(|a| a.strip_prefix("--simd="))
        .map(|s| s.parse::<SimdLevel>().expect("--simd=avx2|sse2|scalar"));

    let mut rows = Vec::new();
    for scheme in [Scheme::TwoBit, Scheme::OneBit] {
        for threads in [1, 0] {
            let mut opts = MeasureOptions::new(scheme, n, threads, reps);
            opts.simd = simd;
            rows.push(measure_with(&opts)?);
        }
    }
    if json {
        println!("{}", format_json(&rows));
    } else {
        print!("{}", format_table(&rows));
    }
    Ok(())
}
