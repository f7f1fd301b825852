//! nccl-tests' table and its figures.
//!
//! - `size`: the buffer in bytes as nccl-tests counts it: the whole `n x block` buffer for
//!   allgather and reduce-scatter, the one buffer otherwise; `count`: the elements each rank
//!   passes (a block for allgather and reduce-scatter).
//! - `time`: the average time of one iteration, the slowest rank's.
//! - `algbw = size / time`, `busbw = algbw x` 2(n-1)/n (allreduce), (n-1)/n (reduce-scatter,
//!   allgather) or 1 (broadcast, reduce); GB/s are 10^9 bytes per second.
//! - `#wrong`: elements that differ from the known result, summed over the ranks (`N/A` with
//!   `--check 0`).

use serde::Serialize;

use super::Collective;

/// One measurement: one size, out of place or in place.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CollRow {
    /// Whether the call worked in place.
    pub in_place: bool,
    /// nccl-tests' size column, bytes.
    pub bytes: u64,
    /// nccl-tests' count column, elements.
    pub count: u64,
    /// Average time of one iteration, the slowest rank's, in microseconds.
    pub time_us: f64,
    /// `bytes / time`, 10^9 bytes per second.
    pub algbw_gb_s: f64,
    /// `algbw` times the collective's bus factor, 10^9 bytes per second.
    pub busbw_gb_s: f64,
    /// Wrong elements, summed over the ranks; absent without `--check 1`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wrong: Option<u64>,
    /// `--compression`: the code bytes each rank sends in one call (message headers aside).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sent_per_rank_bytes: Option<u64>,
}

impl CollRow {
    /// A row from the slowest rank's average iteration time in seconds.
    pub fn new(
        coll: Collective,
        ranks: usize,
        bytes: u64,
        count: u64,
        in_place: bool,
        time_s: f64,
        wrong: Option<u64>,
    ) -> CollRow {
        let algbw = bytes as f64 / time_s / 1e9;
        CollRow {
            in_place,
            bytes,
            count,
            time_us: time_s * 1e6,
            algbw_gb_s: algbw,
            busbw_gb_s: algbw * coll.bus_factor(ranks),
            wrong,
            sent_per_rank_bytes: None,
        }
    }
}

/// What every JSON line carries beside its row.
#[derive(Clone, Debug, Serialize)]
pub struct CollContext {
    /// `allreduce`, `reducescatter`, `allgather`, `broadcast` or `reduce`.
    pub collective: &'static str,
    /// nccl-tests' name of the element type (`float`, `half`, ...).
    pub dtype: &'static str,
    /// The reduction (`sum`, ...), `none` for allgather and broadcast.
    pub op: &'static str,
    /// The root, for broadcast and reduce.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root: Option<usize>,
    /// Number of ranks.
    pub ranks: usize,
    /// The transport the ranks talk over (`tcp`, `rdma`).
    pub transport: &'static str,
    /// `PSNET_SHM_RING`: shared memory offered to a peer on the same host, per direction
    /// (0: sockets only).
    pub shm_ring_bytes: u64,
    /// Timed iterations per measurement.
    pub iters: u64,
    /// Untimed iterations before them.
    pub warmup_iters: u64,
    /// `--compression`: `2bit` or `1bit`; absent for the exact collectives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compression: Option<String>,
}

/// nccl-tests' time column: more digits for shorter times.
fn time_cell(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:.0}")
    } else if us >= 100.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

/// The size columns: `%12s  %12s  %8s  %6s  %6s`.
fn size_cells(size: &str, count: &str, dtype: &str, op: &str, root: &str) -> String {
    format!("{size:>12}  {count:>12}  {dtype:>8}  {op:>6}  {root:>6}")
}

/// One placement's columns: `  %7s  %6s  %6s  %6s`.
fn result_cells(time: &str, algbw: &str, busbw: &str, wrong: &str) -> String {
    format!("  {time:>7}  {algbw:>6}  {busbw:>6}  {wrong:>6}")
}

/// The three header lines over the columns (nccl-tests' layout); with `sent`, a last column
/// of the bytes each rank sends (`--compression`).
pub fn header(sent: bool) -> String {
    let mut lead = size_cells("size", "count", "type", "redop", "root");
    lead.replace_range(0..1, "#");
    let mut units = size_cells("(B)", "(elements)", "", "", "");
    units.replace_range(0..1, "#");
    let result = result_cells("time", "algbw", "busbw", "#wrong");
    let result_units = result_cells("(us)", "(GB/s)", "(GB/s)", "");
    let width = result.len();
    let over = format!(
        "#{}{:^width$}{:^width$}",
        " ".repeat(lead.len() - 1),
        "out-of-place",
        "in-place"
    );
    let (sent_label, sent_units) = if sent {
        (format!("  {:>12}", "sent/rank"), format!("  {:>12}", "(B)"))
    } else {
        (String::new(), String::new())
    };
    let lines = [
        over,
        format!("{lead}{result}{result}{sent_label}"),
        format!("{units}{result_units}{result_units}{sent_units}"),
    ];
    lines.map(|l| l.trim_end().to_string()).join("\n")
}

/// One table line: a size, out of place then in place.
pub fn line(
    size: u64,
    count: u64,
    dtype: &str,
    op: &str,
    root: i64,
    out_of_place: &CollRow,
    in_place: &CollRow,
) -> String {
    let mut text = size_cells(
        &size.to_string(),
        &count.to_string(),
        dtype,
        op,
        &root.to_string(),
    );
    for r in [out_of_place, in_place] {
        let wrong = r.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
        text.push_str(&result_cells(
            &time_cell(r.time_us),
            &format!("{:.2}", r.algbw_gb_s),
            &format!("{:.2}", r.busbw_gb_s),
            &wrong,
        ));
    }
    if let Some(sent) = out_of_place.sent_per_rank_bytes {
        text.push_str(&format!("  {sent:>12}"));
    }
    text
}

/// `x` with six significant digits and no trailing zeros, as C's `%g` writes numbers from
/// 1e-4 to 1e6.
pub fn g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let digits = (5 - x.abs().log10().floor() as i64).clamp(0, 20) as usize;
    let text = format!("{x:.digits$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// The lines after the table: the wrong elements in all, and the average bus bandwidth over
/// every measurement (both placements), last.
pub fn footer(wrong: Option<u64>, busbw_sum: f64, measurements: usize) -> String {
    let check = match wrong {
        Some(0) => "0 OK".to_string(),
        Some(w) => format!("{w} FAILED"),
        None => "N/A (--check 0)".to_string(),
    };
    let avg = if measurements == 0 {
        0.0
    } else {
        busbw_sum / measurements as f64
    };
    format!(
        "# Out of bounds values : {check}\n# Avg bus bandwidth    : {}",
        g(avg)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where each run of non-blanks ends.
    fn ends(s: &str) -> Vec<usize> {
        let b = s.as_bytes();
        (0..b.len())
            .filter(|&i| b[i] != b' ' && (i + 1 == b.len() || b[i + 1] == b' '))
            .collect()
    }

    #[test]
    fn columns_end_under_their_labels() {
        let h = header(false);
        let lines: Vec<&str> = h.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines.iter().all(|l| l.starts_with('#')), "{h}");
        assert!(lines[1].contains(
            "size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong"
        ), "{h}");
        let oop = CollRow::new(
            Collective::AllReduce,
            4,
            1 << 20,
            1 << 18,
            false,
            1e-3,
            Some(0),
        );
        let ip = CollRow::new(
            Collective::AllReduce,
            4,
            1 << 20,
            1 << 18,
            true,
            2.5e-5,
            None,
        );
        let row = line(1 << 20, 1 << 18, "float", "sum", -1, &oop, &ip);
        // Every value ends where its label does (the label line's first word is its `#`).
        assert_eq!(ends(&row), ends(lines[1])[1..], "\n{h}\n{row}");
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "1048576", "262144", "float", "sum", "-1", "1000.0", "1.05", "1.57", "0", "25.00",
                "41.94", "62.91", "N/A"
            ]
        );
        // The units line's labels end where the columns do.
        let unit_ends = ends(lines[2]);
        assert_eq!(unit_ends[..3], ends(lines[1])[..3]);
        assert!(lines[0].contains("out-of-place") && lines[0].contains("in-place"));
        assert!(lines[0].find("out-of-place") < lines[1].find("#wrong"));

        // `--compression`: one more column, the bytes each rank sends, under its label.
        let h = header(true);
        let lines: Vec<&str> = h.lines().collect();
        assert!(lines[1].ends_with("#wrong     sent/rank"), "{h}");
        let (mut oop, mut ip) = (oop, ip);
        oop.sent_per_rank_bytes = Some(98304);
        ip.sent_per_rank_bytes = Some(98304);
        let row = line(1 << 20, 1 << 18, "float", "sum", -1, &oop, &ip);
        assert_eq!(ends(&row), ends(lines[1])[1..], "\n{h}\n{row}");
        assert!(row.ends_with(" 98304"), "{row}");
        assert_eq!(ends(lines[2]).last(), ends(lines[1]).last());
    }

    #[test]
    fn bandwidths_follow_nccl_tests() {
        // 1 GB in one second over 4 ranks.
        let bytes = 1_000_000_000;
        let bw = |c| CollRow::new(c, 4, bytes, 1, false, 1.0, None);
        let r = bw(Collective::AllReduce);
        assert_eq!((r.algbw_gb_s, r.busbw_gb_s, r.time_us), (1.0, 1.5, 1e6));
        assert_eq!(bw(Collective::ReduceScatter).busbw_gb_s, 0.75);
        assert_eq!(bw(Collective::AllGather).busbw_gb_s, 0.75);
        assert_eq!(bw(Collective::Broadcast).busbw_gb_s, 1.0);
        assert_eq!(bw(Collective::Reduce).busbw_gb_s, 1.0);
        // One rank moves nothing over a bus.
        assert_eq!(
            CollRow::new(Collective::AllReduce, 1, bytes, 1, false, 1.0, None).busbw_gb_s,
            0.0
        );
    }

    #[test]
    fn times_and_averages_print_like_nccl_tests() {
        assert_eq!(time_cell(12345.6), "12346");
        assert_eq!(time_cell(123.45), "123.5");
        assert_eq!(time_cell(9.876), "9.88");
        assert_eq!(g(0.0), "0");
        assert_eq!(g(12.3456789), "12.3457");
        assert_eq!(g(0.000123456789), "0.000123457");
        assert_eq!(g(2.5), "2.5");
        assert_eq!(g(100000.0), "100000");
        let f = footer(Some(0), 6.0, 4);
        assert_eq!(
            f,
            "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 1.5"
        );
        assert!(footer(Some(3), 1.0, 1).contains("3 FAILED"));
        assert!(footer(None, 0.0, 0).ends_with(": 0"));
    }
}
