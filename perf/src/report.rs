//! Results in perftest's table layout, or as JSON Lines with units in the field names.
//!
//! perftest's conventions, followed here:
//! - `ib_write_bw`: `#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]`,
//!   MB = 2^20 bytes (recent perftest labels the same figure MiB/sec); `--report_gbits`
//!   turns both BW columns into Gb/sec, 10^9 bits. MsgRate is millions of messages per second.
//! - `ib_send_lat`: one-way latency, half of each measured round trip, with
//!   `t_min t_max t_typical t_avg t_stdev` and the 99% / 99.9% percentiles in usec;
//!   `t_typical` is the median. (perftest also drops the two slowest samples before its
//!   statistics; psnet-perf keeps every timed sample, so `t_max` is the slowest one.)
//!
//! JSON: one flat object per line (JSON Lines), each carrying its context (`test`,
//! `transport`, addresses) beside the row's figures; every figure's unit is in its name
//! (`_mib_s` 2^20 bytes/s, `_mb_s` 10^6 bytes/s, `_gbit_s` 10^9 bits/s, `_us`, `_s`).

use serde::Serialize;

/// Bytes per MB in perftest's MB/sec columns (2^20).
const MIB: f64 = 1024.0 * 1024.0;
/// Bytes per Gb in perftest's Gb/sec columns (10^9 bits).
const GBIT_BYTES: f64 = 1e9 / 8.0;

/// Whether a bandwidth peak means anything on `transport` (a `Capabilities::name`). On TCP
/// the receiver sees messages in bursts drained from the socket buffer, so the best window
/// of arrivals measures the kernel's buffering, not the wire: no peak is reported there.
pub fn peak_is_meaningful(transport: &str) -> bool {
    transport == "rdma"
}

/// The unit of the bandwidth table's BW columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwUnit {
    /// MB/sec, MB = 2^20 bytes (perftest's default).
    MibPerSec,
    /// Gb/sec, 10^9 bits (perftest's `--report_gbits`).
    GbitPerSec,
}

impl BwUnit {
    fn label(self) -> &'static str {
        match self {
            BwUnit::MibPerSec => "MB/sec",
            BwUnit::GbitPerSec => "Gb/sec",
        }
    }

    /// `bytes_per_s` in this unit.
    pub fn of(self, bytes_per_s: f64) -> f64 {
        match self {
            BwUnit::MibPerSec => bytes_per_s / MIB,
            BwUnit::GbitPerSec => bytes_per_s / GBIT_BYTES,
        }
    }
}

/// One bandwidth row.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BwRow {
    /// Message size.
    pub bytes: u64,
    /// Messages sent.
    pub iterations: u64,
    /// Best rate over a tenth of the messages, at the receiver, in 2^20 bytes per second;
    /// absent where a peak means nothing ([`peak_is_meaningful`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bw_peak_mib_s: Option<f64>,
    /// Total bytes over the sender's time from first send to the receiver's confirmation,
    /// in 2^20 bytes per second (perftest's MB/sec).
    pub bw_avg_mib_s: f64,
    /// The peak in 10^9 bits per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bw_peak_gbit_s: Option<f64>,
    /// The average in 10^9 bits per second.
    pub bw_avg_gbit_s: f64,
    /// Messages per second, millions.
    pub msg_rate_mpps: f64,
    /// The raw TCP reference over the same bytes, when `--baseline` was given, 2^20 bytes/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_bw_mib_s: Option<f64>,
    /// The raw TCP reference in 10^9 bits per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_bw_gbit_s: Option<f64>,
    /// `bw_avg / baseline_bw` (a ratio, unit-free).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_baseline: Option<f64>,
}

impl BwRow {
    /// A row from totals; `peak_bytes_per_s` is `None` where a peak means nothing.
    pub fn new(bytes: u64, iterations: u64, elapsed_s: f64, peak_bytes_per_s: Option<f64>) -> Self {
        let avg = (bytes * iterations) as f64 / elapsed_s;
        // The best window can never be slower than the whole run.
        let peak = peak_bytes_per_s.map(|p| p.max(avg));
        BwRow {
            bytes,
            iterations,
            bw_peak_mib_s: peak.map(|p| BwUnit::MibPerSec.of(p)),
            bw_avg_mib_s: BwUnit::MibPerSec.of(avg),
            bw_peak_gbit_s: peak.map(|p| BwUnit::GbitPerSec.of(p)),
            bw_avg_gbit_s: BwUnit::GbitPerSec.of(avg),
            msg_rate_mpps: iterations as f64 / elapsed_s / 1e6,
            baseline_bw_mib_s: None,
            baseline_bw_gbit_s: None,
            ratio_vs_baseline: None,
        }
    }

    /// Adds the reference measured over the same bytes.
    pub fn with_baseline(mut self, elapsed_s: f64) -> Self {
        let rate = (self.bytes * self.iterations) as f64 / elapsed_s;
        self.baseline_bw_mib_s = Some(BwUnit::MibPerSec.of(rate));
        self.baseline_bw_gbit_s = Some(BwUnit::GbitPerSec.of(rate));
        self.ratio_vs_baseline = Some(self.bw_avg_mib_s / BwUnit::MibPerSec.of(rate));
        self
    }

    /// (peak, average, baseline) in `unit`.
    fn in_unit(&self, unit: BwUnit) -> (Option<f64>, f64, Option<f64>) {
        match unit {
            BwUnit::MibPerSec => (
                self.bw_peak_mib_s,
                self.bw_avg_mib_s,
                self.baseline_bw_mib_s,
            ),
            BwUnit::GbitPerSec => (
                self.bw_peak_gbit_s,
                self.bw_avg_gbit_s,
                self.baseline_bw_gbit_s,
            ),
        }
    }
}

/// One latency row. Like perftest's `ib_send_lat`, the `t_*` figures are one-way latencies:
/// half of each measured round trip, in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LatRow {
    /// Message size.
    pub bytes: u64,
    /// Measured round trips (after warm-up).
    pub iterations: u64,
    /// Fastest one-way latency.
    pub t_min_us: f64,
    /// Slowest one-way latency.
    pub t_max_us: f64,
    /// Median one-way latency (perftest's `t_typical`).
    pub t_typical_us: f64,
    /// Mean one-way latency.
    pub t_avg_us: f64,
    /// Standard deviation of the one-way latencies (population: divided by the count, as
    /// perftest).
    pub t_stdev_us: f64,
    /// 99th percentile (nearest rank: the smallest sample at or above 99% of them).
    pub t_p99_us: f64,
    /// 99.9th percentile (nearest rank).
    pub t_p99_9_us: f64,
    /// Median round trip, not halved (`2 * t_typical_us`), to compare with raw ping-pongs.
    pub rtt_median_us: f64,
}

/// The median of ascending `sorted` (the mean of the middle two for an even count, as
/// perftest's); 0 for none.
fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The nearest-rank `num/den` percentile of ascending `sorted`: the sample of rank
/// `ceil(n * num / den)` (1-based), so that at least that share of the samples is at or below
/// it; 0 for none. Integer arithmetic: 0.999 has no exact binary form.
fn percentile(sorted: &[f64], num: usize, den: usize) -> f64 {
    let rank = (sorted.len() * num).div_ceil(den).max(1);
    sorted.get(rank - 1).copied().unwrap_or(0.0)
}

/// Mean and population standard deviation (two passes); zeros for none.
fn mean_stdev(samples: &[f64]) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    let n = samples.len() as f64;
    let mean = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

impl LatRow {
    /// A row from round-trip samples in microseconds.
    pub fn from_round_trips(bytes: u64, rtt_us: Vec<f64>) -> Self {
        let mut one_way: Vec<f64> = rtt_us.into_iter().map(|rtt| rtt / 2.0).collect();
        one_way.sort_by(f64::total_cmp);
        let (avg, stdev) = mean_stdev(&one_way);
        let typical = median(&one_way);
        LatRow {
            bytes,
            iterations: one_way.len() as u64,
            t_min_us: one_way.first().copied().unwrap_or(0.0),
            t_max_us: one_way.last().copied().unwrap_or(0.0),
            t_typical_us: typical,
            t_avg_us: avg,
            t_stdev_us: stdev,
            t_p99_us: percentile(&one_way, 99, 100),
            t_p99_9_us: percentile(&one_way, 999, 1000),
            // Halving is exact in binary floating point, so this is the round trips' median.
            rtt_median_us: typical * 2.0,
        }
    }
}

/// One JSON Lines record: `context`'s fields, then `row`'s, in one flat object on one line.
pub fn json_line<C: Serialize, R: Serialize>(context: &C, row: &R) -> String {
    #[derive(Serialize)]
    struct Line<'a, C, R> {
        #[serde(flatten)]
        context: &'a C,
        #[serde(flatten)]
        row: &'a R,
    }
    serde_json::to_string(&Line { context, row })
        .unwrap_or_else(|e| format!("{{\"error\":\"cannot serialise a row: {e}\"}}"))
}

/// The context of every JSON line of a `bw` or `lat` run.
#[derive(Clone, Debug, Serialize)]
pub struct RunContext {
    /// `"bw"` or `"lat"`.
    pub test: &'static str,
    /// The transport that carried the messages (`"tcp"`, `"rdma"`).
    pub transport: &'static str,
    /// The client's address.
    pub local: String,
    /// The server's address.
    pub remote: String,
}

const RULE: &str =
    "---------------------------------------------------------------------------------------";

/// The banner perftest prints above its table.
pub fn banner(title: &str, transport: &str, local: &str, remote: &str) -> String {
    format!(
        "{RULE}\n                    {title}\n Transport: {transport}\n local address: {local}\n remote address: {remote}\n{RULE}"
    )
}

/// A table line: each cell left-aligned in its column (the column's label and the gap after
/// it in perftest's header), one space at least between cells, no trailing blanks.
fn cells<S: AsRef<str>>(columns: &[(&str, usize)], values: &[S]) -> String {
    let mut line = String::from(" ");
    for ((label, gap), value) in columns.iter().zip(values) {
        let width = label.len() + gap;
        let value = value.as_ref();
        line.push_str(&format!("{value:<width$}"));
        if value.len() >= width {
            line.push(' ');
        }
    }
    line.truncate(line.trim_end().len());
    line
}

/// perftest's `#bytes` and `#iterations` columns (the gaps of `ib_write_bw`'s header, which
/// leave room for 10-digit sizes).
const SIZE_COLUMNS: [(&str, usize); 2] = [("#bytes", 5), ("#iterations", 4)];

fn bw_columns(unit: BwUnit, baseline: bool) -> Vec<(String, usize)> {
    let u = unit.label();
    let mut columns = vec![
        (format!("BW peak[{u}]"), 4),
        (format!("BW average[{u}]"), 3),
        ("MsgRate[Mpps]".to_string(), 3),
    ];
    if baseline {
        columns.push((format!("raw TCP[{u}]"), 3));
        columns.push(("ratio".to_string(), 0));
    }
    columns
}

fn bw_table_line<S: AsRef<str>>(unit: BwUnit, baseline: bool, values: &[S]) -> String {
    let extra = bw_columns(unit, baseline);
    let columns: Vec<(&str, usize)> = SIZE_COLUMNS
        .iter()
        .copied()
        .chain(extra.iter().map(|(l, g)| (l.as_str(), *g)))
        .collect();
    cells(&columns, values)
}

/// The bandwidth table's header: perftest's `ib_write_bw` columns in `unit`, then the
/// baseline's when `--baseline` was given.
pub fn bw_header(unit: BwUnit, baseline: bool) -> String {
    let mut labels: Vec<String> = SIZE_COLUMNS.iter().map(|(l, _)| l.to_string()).collect();
    labels.extend(bw_columns(unit, baseline).into_iter().map(|(l, _)| l));
    bw_table_line(unit, baseline, &labels)
}

/// One bandwidth line in `unit`; `-` in the peak column where there is no peak.
pub fn bw_line(r: &BwRow, unit: BwUnit) -> String {
    let (peak, avg, base) = r.in_unit(unit);
    let mut values = vec![
        r.bytes.to_string(),
        r.iterations.to_string(),
        peak.map_or_else(|| "-".to_string(), |p| format!("{p:.2}")),
        format!("{avg:.2}"),
        format!("{:.6}", r.msg_rate_mpps),
    ];
    let baseline = base.is_some();
    if let (Some(b), Some(ratio)) = (base, r.ratio_vs_baseline) {
        values.push(format!("{b:.2}"));
        values.push(format!("{ratio:.3}"));
    }
    bw_table_line(unit, baseline, &values)
}

/// perftest's `ib_send_lat` columns and the gaps after them.
const LAT_COLUMNS: [(&str, usize); 9] = [
    SIZE_COLUMNS[0],
    SIZE_COLUMNS[1],
    ("t_min[usec]", 4),
    ("t_max[usec]", 2),
    ("t_typical[usec]", 4),
    ("t_avg[usec]", 4),
    ("t_stdev[usec]", 3),
    ("99% percentile[usec]", 3),
    ("99.9% percentile[usec]", 0),
];

/// The latency table's header (one-way latencies, as perftest's `ib_send_lat`).
pub fn lat_header() -> String {
    let labels: Vec<&str> = LAT_COLUMNS.iter().map(|(l, _)| *l).collect();
    cells(&LAT_COLUMNS, &labels)
}

/// One latency line.
pub fn lat_line(r: &LatRow) -> String {
    let mut values = vec![r.bytes.to_string(), r.iterations.to_string()];
    values.extend(
        [
            r.t_min_us,
            r.t_max_us,
            r.t_typical_us,
            r.t_avg_us,
            r.t_stdev_us,
            r.t_p99_us,
            r.t_p99_9_us,
        ]
        .iter()
        .map(|v| format!("{v:.2}")),
    );
    cells(&LAT_COLUMNS, &values)
}

/// The rule between header, rows and end.
pub fn rule() -> &'static str {
    RULE
}

/// One size sent from host memory and then from GPU memory in the same run (`bw --gpu`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuBwRow {
    /// Always `"bw_gpu"` (JSON lines of `bw` rows have no such field).
    pub row: &'static str,
    /// The GPU's ordinal.
    pub gpu: usize,
    /// Message size.
    pub bytes: u64,
    /// Messages sent each way.
    pub iterations: u64,
    /// Average from host memory, 2^20 bytes per second.
    pub host_bw_mib_s: f64,
    /// Average from GPU memory, 2^20 bytes per second.
    pub gpu_bw_mib_s: f64,
    /// Average from host memory, 10^9 bits per second.
    pub host_bw_gbit_s: f64,
    /// Average from GPU memory, 10^9 bits per second.
    pub gpu_bw_gbit_s: f64,
    /// `gpu_bw / host_bw`.
    pub gpu_vs_host: f64,
    /// Average from host memory into the server's GPU memory (placed as it arrives), 2^20
    /// bytes per second.
    pub to_gpu_bw_mib_s: f64,
    /// The same, 10^9 bits per second.
    pub to_gpu_bw_gbit_s: f64,
    /// `to_gpu_bw / host_bw`.
    pub to_gpu_vs_host: f64,
}

impl GpuBwRow {
    /// The rows measured for one size: host to host, GPU to host, host to GPU.
    pub fn new(gpu: usize, host: &BwRow, from_gpu: &BwRow, to_gpu: &BwRow) -> Self {
        GpuBwRow {
            row: "bw_gpu",
            gpu,
            bytes: host.bytes,
            iterations: host.iterations,
            host_bw_mib_s: host.bw_avg_mib_s,
            gpu_bw_mib_s: from_gpu.bw_avg_mib_s,
            host_bw_gbit_s: host.bw_avg_gbit_s,
            gpu_bw_gbit_s: from_gpu.bw_avg_gbit_s,
            gpu_vs_host: from_gpu.bw_avg_mib_s / host.bw_avg_mib_s,
            to_gpu_bw_mib_s: to_gpu.bw_avg_mib_s,
            to_gpu_bw_gbit_s: to_gpu.bw_avg_gbit_s,
            to_gpu_vs_host: to_gpu.bw_avg_mib_s / host.bw_avg_mib_s,
        }
    }
}

/// The `bw --gpu` table: each size's average from host memory, from GPU memory and into the
/// server's GPU memory, and the GPU rows' ratios to the host row.
/// `ring` is `PSNET_SHM_RING`: device messages never take the same-host ring, so host and GPU
/// rows compare like with like only at 0 (what `--loopback --gpu` sets when it is unset).
pub fn gpu_bw_table(rows: &[GpuBwRow], unit: BwUnit, ring: &str) -> String {
    let label = match unit {
        BwUnit::MibPerSec => "[MB/sec]",
        BwUnit::GbitPerSec => "[Gb/sec]",
    };
    let gpu = rows.first().map_or(0, |r| r.gpu);
    let mut out = format!(
        " From GPU {gpu} memory, and into the server's GPU {gpu} memory (placed as it arrives), \
         right after each size from host memory\n"
    );
    out += &if ring.trim() == "0" {
        " Sockets for both (PSNET_SHM_RING=0); GPU messages staged through page-locked buffers\n"
            .to_string()
    } else {
        format!(
            " PSNET_SHM_RING={ring}: host messages may take the same-host ring, GPU messages \
             never do (set PSNET_SHM_RING=0 to compare sockets with sockets)\n"
        )
    };
    out += &format!(
        " {:<10} {:<13} {:<18} {:<22} {:<20} {:<10} {}\n",
        "#bytes",
        "#iterations",
        format!("host BW{label}"),
        format!("from GPU BW{label}"),
        format!("to GPU BW{label}"),
        "from/host",
        "to/host"
    );
    for r in rows {
        let (host, gpu, to_gpu) = match unit {
            BwUnit::MibPerSec => (r.host_bw_mib_s, r.gpu_bw_mib_s, r.to_gpu_bw_mib_s),
            BwUnit::GbitPerSec => (r.host_bw_gbit_s, r.gpu_bw_gbit_s, r.to_gpu_bw_gbit_s),
        };
        out += &format!(
            " {:<10} {:<13} {:<18.2} {:<22.2} {:<20.2} {:<10.3} {:.3}\n",
            r.bytes, r.iterations, host, gpu, to_gpu, r.gpu_vs_host, r.to_gpu_vs_host
        );
    }
    out + RULE + "\n"
}

#[cfg(test)]
mod tests;
