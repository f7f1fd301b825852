//! Results in perftest's table layout, or as JSON with units in the field names.

use serde::Serialize;

/// Bytes per MB in perftest's MB/sec columns (2^20).
const MIB: f64 = 1024.0 * 1024.0;

/// One bandwidth row.
#[derive(Clone, Debug, Serialize)]
pub struct BwRow {
    /// Message size.
    pub bytes: u64,
    /// Messages sent.
    pub iterations: u64,
    /// Best rate over a tenth of the messages, at the receiver.
    pub bw_peak_gbit_s: f64,
    /// Total bytes over the sender's time from first send to the receiver's confirmation.
    pub bw_avg_gbit_s: f64,
    /// Peak in MiB/s (perftest's MB/sec).
    pub bw_peak_mib_s: f64,
    /// Average in MiB/s (perftest's MB/sec).
    pub bw_avg_mib_s: f64,
    /// Messages per second, millions.
    pub msg_rate_mpps: f64,
    /// The raw TCP reference over the same bytes, when `--baseline` was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_bw_gbit_s: Option<f64>,
    /// `bw_avg_gbit_s / baseline_bw_gbit_s`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_baseline: Option<f64>,
}

impl BwRow {
    /// A row from totals.
    pub fn new(bytes: u64, iterations: u64, elapsed_s: f64, peak_bytes_per_s: f64) -> Self {
        let avg = (bytes * iterations) as f64 / elapsed_s;
        let peak = peak_bytes_per_s.max(avg);
        BwRow {
            bytes,
            iterations,
            bw_peak_gbit_s: peak * 8.0 / 1e9,
            bw_avg_gbit_s: avg * 8.0 / 1e9,
            bw_peak_mib_s: peak / MIB,
            bw_avg_mib_s: avg / MIB,
            msg_rate_mpps: iterations as f64 / elapsed_s / 1e6,
            baseline_bw_gbit_s: None,
            ratio_vs_baseline: None,
        }
    }

    /// Adds the reference measured over the same bytes.
    pub fn with_baseline(mut self, elapsed_s: f64) -> Self {
        let gbit = (self.bytes * self.iterations) as f64 * 8.0 / elapsed_s / 1e9;
        self.baseline_bw_gbit_s = Some(gbit);
        self.ratio_vs_baseline = Some(self.bw_avg_gbit_s / gbit);
        self
    }
}

/// One latency row; times are round trips in microseconds.
#[derive(Clone, Debug, Serialize)]
pub struct LatRow {
    /// Message size.
    pub bytes: u64,
    /// Measured round trips (after warm-up).
    pub iterations: u64,
    /// Fastest round trip.
    pub lat_min_us: f64,
    /// Median round trip.
    pub lat_median_us: f64,
    /// 99th percentile.
    pub lat_p99_us: f64,
    /// Slowest round trip.
    pub lat_max_us: f64,
    /// Mean round trip.
    pub lat_avg_us: f64,
}

impl LatRow {
    /// A row from round-trip samples in microseconds.
    pub fn from_samples(bytes: u64, mut us: Vec<f64>) -> Self {
        us.sort_by(f64::total_cmp);
        let n = us.len().max(1);
        let at = |q: f64| {
            us.get(((n - 1) as f64 * q).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        LatRow {
            bytes,
            iterations: us.len() as u64,
            lat_min_us: at(0.0),
            lat_median_us: at(0.5),
            lat_p99_us: at(0.99),
            lat_max_us: at(1.0),
            lat_avg_us: us.iter().sum::<f64>() / n as f64,
        }
    }
}

const RULE: &str =
    "---------------------------------------------------------------------------------------";

/// The banner perftest prints above its table.
pub fn banner(title: &str, transport: &str, local: &str, remote: &str) -> String {
    format!(
        "{RULE}\n                    {title}\n Transport: {transport}\n local address: {local}\n remote address: {remote}\n{RULE}"
    )
}

/// The bandwidth table's header.
pub fn bw_header(baseline: bool) -> String {
    let mut h = format!(
        " {:<10} {:<13} {:>16} {:>19} {:>16} {:>19} {:>14}",
        "#bytes",
        "#iterations",
        "BW peak[Gb/sec]",
        "BW average[Gb/sec]",
        "BW peak[MB/sec]",
        "BW average[MB/sec]",
        "MsgRate[Mpps]"
    );
    if baseline {
        h.push_str(&format!(" {:>17} {:>9}", "raw TCP[Gb/sec]", "ratio"));
    }
    h
}

/// One bandwidth line.
pub fn bw_line(r: &BwRow) -> String {
    let mut line = format!(
        " {:<10} {:<13} {:>16.2} {:>19.2} {:>16.2} {:>19.2} {:>14.6}",
        r.bytes,
        r.iterations,
        r.bw_peak_gbit_s,
        r.bw_avg_gbit_s,
        r.bw_peak_mib_s,
        r.bw_avg_mib_s,
        r.msg_rate_mpps
    );
    if let (Some(b), Some(ratio)) = (r.baseline_bw_gbit_s, r.ratio_vs_baseline) {
        line.push_str(&format!(" {b:>17.2} {ratio:>9.3}"));
    }
    line
}

/// The latency table's header (round trips, where perftest's `ib_send_lat` halves them).
pub fn lat_header() -> String {
    format!(
        " {:<10} {:<13} {:>13} {:>16} {:>13} {:>13} {:>13}\n (round-trip times; perftest's ib_send_lat reports half of this)",
        "#bytes",
        "#iterations",
        "t_min[usec]",
        "t_median[usec]",
        "t_p99[usec]",
        "t_max[usec]",
        "t_avg[usec]"
    )
}

/// One latency line.
pub fn lat_line(r: &LatRow) -> String {
    format!(
        " {:<10} {:<13} {:>13.2} {:>16.2} {:>13.2} {:>13.2} {:>13.2}",
        r.bytes,
        r.iterations,
        r.lat_min_us,
        r.lat_median_us,
        r.lat_p99_us,
        r.lat_max_us,
        r.lat_avg_us
    )
}

/// The rule between header, rows and end.
pub fn rule() -> &'static str {
    RULE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_units() {
        // 1000 messages of 1 MiB in one second.
        let r = BwRow::new(1 << 20, 1000, 1.0, 0.0);
        assert!((r.bw_avg_mib_s - 1000.0).abs() < 1e-9);
        assert!((r.bw_avg_gbit_s - 8.388608).abs() < 1e-9);
        assert_eq!(
            r.bw_peak_gbit_s, r.bw_avg_gbit_s,
            "peak is at least the average"
        );
        assert!((r.msg_rate_mpps - 0.001).abs() < 1e-12);
        let r = r.with_baseline(2.0);
        assert!((r.ratio_vs_baseline.unwrap() - 2.0).abs() < 1e-9);
    }

    #[test]
    fn latency_percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        let r = LatRow::from_samples(64, samples);
        assert_eq!((r.lat_min_us, r.lat_max_us), (1.0, 100.0));
        assert_eq!(r.lat_median_us, 51.0);
        assert_eq!(r.lat_p99_us, 99.0);
        assert!((r.lat_avg_us - 50.5).abs() < 1e-9);
    }

    #[test]
    fn json_fields_carry_units() {
        let json = serde_json::to_string(&BwRow::new(64, 10, 1.0, 0.0)).unwrap();
        assert!(json.contains("\"bw_avg_gbit_s\"") && json.contains("\"bw_avg_mib_s\""));
        assert!(
            !json.contains("baseline"),
            "absent baseline is omitted: {json}"
        );
        let json = serde_json::to_string(&LatRow::from_samples(64, vec![1.0])).unwrap();
        assert!(json.contains("\"lat_median_us\""));
    }
}
