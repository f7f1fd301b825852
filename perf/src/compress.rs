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
            rows.push(measure_with(&opts).map_err(|e| e.to_string())?);
        }
    }
    if json {
        println!("{}", format_json(&rows));
    } else {
        print!("{}", format_table(&rows));
    }
    Ok(())
}
