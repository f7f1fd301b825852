use super::*;
use proptest::prelude::*;

#[test]
fn gpu_rows_give_the_ratio_and_say_what_was_compared() {
    let host = BwRow::new(1 << 20, 100, 0.1, None);
    let gpu = BwRow::new(1 << 20, 100, 0.125, None);
    let to_gpu = BwRow::new(1 << 20, 100, 0.16, None);
    let row = GpuBwRow::new(0, &host, &gpu, &to_gpu);
    assert!((row.gpu_vs_host - 0.8).abs() < 1e-12, "{row:?}");
    assert!((row.to_gpu_vs_host - 0.625).abs() < 1e-12, "{row:?}");
    assert_eq!(row.host_bw_mib_s, 1000.0);
    let table = gpu_bw_table(std::slice::from_ref(&row), BwUnit::MibPerSec, "0");
    assert!(table.contains("Sockets for both"), "{table}");
    assert!(table.contains("1000.00") && table.contains("800.00") && table.contains("0.800"));
    assert!(
        table.contains("625.00") && table.contains("0.625"),
        "{table}"
    );
    let table = gpu_bw_table(&[row], BwUnit::MibPerSec, "67108864");
    assert!(table.contains("set PSNET_SHM_RING=0"), "{table}");
}

#[test]
fn bandwidth_units() {
    // 1000 messages of 1 MiB in one second.
    let r = BwRow::new(1 << 20, 1000, 1.0, Some(0.0));
    assert!((r.bw_avg_mib_s - 1000.0).abs() < 1e-9);
    assert!((r.bw_avg_gbit_s - 8.388608).abs() < 1e-9);
    assert_eq!(
        r.bw_peak_gbit_s,
        Some(r.bw_avg_gbit_s),
        "peak is at least the average"
    );
    assert!((r.msg_rate_mpps - 0.001).abs() < 1e-12);
    let r = r.with_baseline(2.0);
    assert!((r.ratio_vs_baseline.unwrap() - 2.0).abs() < 1e-9);
    assert!((r.baseline_bw_mib_s.unwrap() - 500.0).abs() < 1e-9);
    assert!((r.baseline_bw_gbit_s.unwrap() - 4.194304).abs() < 1e-9);
    // 125 MB/s (10^6) is 1 Gb/s.
    assert!((BwUnit::GbitPerSec.of(125e6) - 1.0).abs() < 1e-12);
}

#[test]
fn peak_only_where_it_means_something() {
    assert!(peak_is_meaningful("rdma") && !peak_is_meaningful("tcp"));
    let r = BwRow::new(64, 10, 1.0, None);
    let json = serde_json::to_string(&r).unwrap();
    assert!(!json.contains("peak"), "{json}");
    let line = bw_line(&r, BwUnit::MibPerSec);
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cols[..3], ["64", "10", "-"], "{line}");
    let r = BwRow::new(64, 10, 1.0, Some(2.0 * MIB));
    assert_eq!(r.bw_peak_mib_s, Some(2.0));
    let cols: Vec<String> = bw_line(&r, BwUnit::MibPerSec)
        .split_whitespace()
        .map(String::from)
        .collect();
    assert_eq!(cols[2], "2.00");
}

#[test]
fn bw_columns_line_up_under_their_headers() {
    for unit in [BwUnit::MibPerSec, BwUnit::GbitPerSec] {
        for baseline in [false, true] {
            let header = bw_header(unit, baseline);
            let mut r = BwRow::new(8 << 20, 5000, 3.0, Some(1e10));
            if baseline {
                r = r.with_baseline(2.5);
            }
            let line = bw_line(&r, unit);
            // Every value starts where its header label starts.
            let starts = |s: &str| -> Vec<usize> {
                let b = s.as_bytes();
                (1..b.len())
                    .filter(|&i| b[i] != b' ' && b[i - 1] == b' ')
                    .collect()
            };
            let label_starts: Vec<usize> = ["#bytes", "#iterations", "BW peak", "BW average"]
                .iter()
                .map(|l| header.find(l).unwrap())
                .collect();
            assert_eq!(starts(&line)[..4], label_starts[..], "{header}\n{line}");
            assert_eq!(
                line.split_whitespace().count(),
                if baseline { 7 } else { 5 },
                "{line}"
            );
        }
    }
    assert!(bw_header(BwUnit::MibPerSec, false).contains(
        "#bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
    ));
    assert!(bw_header(BwUnit::GbitPerSec, false)
        .contains("BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"));
}

#[test]
fn latency_is_half_the_round_trip() {
    // Round trips 2, 4, ..., 200 us: one-way 1..=100.
    let rtts: Vec<f64> = (1..=100).map(|i| f64::from(i) * 2.0).collect();
    let r = LatRow::from_round_trips(64, rtts);
    assert_eq!(r.iterations, 100);
    assert_eq!((r.t_min_us, r.t_max_us), (1.0, 100.0));
    assert_eq!(r.t_typical_us, 50.5, "mean of the middle two");
    assert_eq!(r.rtt_median_us, 101.0);
    assert_eq!(r.t_p99_us, 99.0);
    assert_eq!(r.t_p99_9_us, 100.0);
    assert!((r.t_avg_us - 50.5).abs() < 1e-9);
}

#[test]
fn stdev_and_percentiles_of_known_samples() {
    // One-way {1,2,2,2,2.5,2.5,3.5,4.5}: the classic population stdev 2 of
    // {2,4,4,4,5,5,7,9}, halved.
    let r = LatRow::from_round_trips(8, vec![2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
    assert!((r.t_stdev_us - 1.0).abs() < 1e-12, "{}", r.t_stdev_us);
    assert!((r.t_avg_us - 2.5).abs() < 1e-12);
    assert_eq!(r.t_typical_us, 2.25);
    // 1000 samples: 99% is the 990th, 99.9% the 999th.
    let r = LatRow::from_round_trips(8, (1..=1000).rev().map(f64::from).collect());
    assert_eq!((r.t_p99_us, r.t_p99_9_us), (495.0, 499.5));
    // One sample: every figure is that sample, stdev 0.
    let r = LatRow::from_round_trips(8, vec![7.0]);
    assert_eq!(
        (
            r.t_min_us,
            r.t_max_us,
            r.t_typical_us,
            r.t_p99_us,
            r.t_p99_9_us
        ),
        (3.5, 3.5, 3.5, 3.5, 3.5)
    );
    assert_eq!(r.t_stdev_us, 0.0);
    // None: zeros, not a panic.
    let r = LatRow::from_round_trips(8, Vec::new());
    assert_eq!((r.iterations, r.t_max_us, r.t_p99_9_us), (0, 0.0, 0.0));
}

#[test]
fn latency_table_has_perftest_columns() {
    let header = lat_header();
    assert!(header.contains(
        "t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
    ), "{header}");
    let line = lat_line(&LatRow::from_round_trips(
        64,
        (1..=1000).map(f64::from).collect(),
    ));
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        cols,
        ["64", "1000", "0.50", "500.00", "250.25", "250.25", "144.34", "495.00", "499.50"]
    );
}

#[test]
fn json_lines_are_flat_with_context_first() {
    let ctx = RunContext {
        test: "bw",
        transport: "tcp",
        local: "127.0.0.1:1".into(),
        remote: "127.0.0.1:2".into(),
    };
    let line = json_line(&ctx, &BwRow::new(64, 10, 1.0, None));
    assert!(!line.contains('\n'));
    assert!(
        line.starts_with("{\"test\":\"bw\",\"transport\":\"tcp\""),
        "{line}"
    );
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["bytes"], 64);
    assert!(v["bw_avg_mib_s"].is_number() && v["bw_avg_gbit_s"].is_number());
    assert!(v.get("baseline_bw_gbit_s").is_none() && v.get("bw_peak_mib_s").is_none());
    let line = json_line(&ctx, &LatRow::from_round_trips(64, vec![1.0]));
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    for field in [
        "t_min_us",
        "t_max_us",
        "t_typical_us",
        "t_avg_us",
        "t_stdev_us",
        "t_p99_us",
        "t_p99_9_us",
        "rtt_median_us",
    ] {
        assert!(v[field].is_number(), "{field}: {line}");
    }
}

proptest! {
    #[test]
    fn latency_statistics_hold_for_any_samples(
        rtts in proptest::collection::vec(0.01f64..1e6, 1..400),
        shift in 0.0f64..1e3,
    ) {
        let r = LatRow::from_round_trips(1, rtts.clone());
        let mut one_way: Vec<f64> = rtts.iter().map(|x| x / 2.0).collect();
        one_way.sort_by(f64::total_cmp);
        let n = one_way.len();
        prop_assert_eq!(r.iterations, n as u64);
        prop_assert!(r.t_min_us <= r.t_typical_us && r.t_typical_us <= r.t_max_us);
        prop_assert!(r.t_min_us <= r.t_p99_us && r.t_p99_us <= r.t_p99_9_us);
        prop_assert!(r.t_p99_9_us <= r.t_max_us);
        let eps = 1e-9 * r.t_max_us.max(1.0);
        prop_assert!(r.t_min_us - eps <= r.t_avg_us && r.t_avg_us <= r.t_max_us + eps);
        prop_assert_eq!(r.rtt_median_us, 2.0 * r.t_typical_us);
        // Nearest rank: at least q of the samples at or below, fewer strictly below.
        for (p, num, den) in [(r.t_p99_us, 99, 100), (r.t_p99_9_us, 999, 1000)] {
            let rank = (n * num).div_ceil(den);
            prop_assert!(one_way.iter().filter(|&&x| x <= p).count() >= rank);
            prop_assert!(one_way.iter().filter(|&&x| x < p).count() < rank);
        }
        // Stdev: non-negative, at most half the range (Popoviciu), and the textbook
        // formula E[x^2] - E[x]^2 within rounding.
        prop_assert!(r.t_stdev_us >= 0.0);
        prop_assert!(r.t_stdev_us <= (r.t_max_us - r.t_min_us) / 2.0 + eps);
        let mean_sq = one_way.iter().map(|x| x * x).sum::<f64>() / n as f64;
        let var = (mean_sq - r.t_avg_us * r.t_avg_us).max(0.0);
        prop_assert!((r.t_stdev_us.powi(2) - var).abs() <= 1e-6 * mean_sq.max(1.0));
        // Shifting every round trip shifts the one-way figures by half, keeps the spread.
        let shifted = LatRow::from_round_trips(1, rtts.iter().map(|x| x + shift).collect());
        let tol = 1e-6 * (r.t_max_us + shift).max(1.0);
        prop_assert!((shifted.t_typical_us - r.t_typical_us - shift / 2.0).abs() <= tol);
        prop_assert!((shifted.t_p99_us - r.t_p99_us - shift / 2.0).abs() <= tol);
        prop_assert!((shifted.t_stdev_us - r.t_stdev_us).abs() <= tol);
    }
}
