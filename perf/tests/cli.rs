//! `psnet-perf` as a user runs it: loopback, two processes, errors.

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};

mod common;

use common::{json_lines, run_ok, Server};

fn perf() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_psnet-perf"));
    for var in [
        "DMLC_INTERFACE",
        "DMLC_NODE_HOST",
        "PSNET_TRANSPORT",
        "PS_VERBOSE",
        "RUST_LOG",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The one JSON line of a single-size run.
fn one_row(text: &str) -> serde_json::Value {
    let mut rows = json_lines(text);
    assert_eq!(rows.len(), 1, "{text}");
    rows.remove(0)
}

fn f64_of(row: &serde_json::Value, field: &str) -> f64 {
    row[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{field} missing: {row}"))
}

/// The data lines of a table (those starting with a size), split into columns.
fn table_rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<u64>().is_ok())
        })
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

fn free_port() -> u16 {
    // Two consecutive free ports: the server's and the raw baseline's.
    loop {
        let a = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = a.local_addr().unwrap().port();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

#[test]
fn loopback_bandwidth_json_has_units_and_baseline() {
    let out = run_ok(perf().args([
        "bw",
        "--loopback",
        "-s",
        "64K",
        "-n",
        "50",
        "--json",
        "--baseline",
    ]));
    let row = one_row(&out);
    assert_eq!(row["test"], "bw");
    assert_eq!(row["transport"], "tcp");
    assert!(row["local"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert!(row["remote"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert_eq!(row["bytes"], 65536);
    assert_eq!(row["iterations"], 50);
    for field in [
        "bw_avg_mib_s",
        "bw_avg_gbit_s",
        "msg_rate_mpps",
        "baseline_bw_mib_s",
        "baseline_bw_gbit_s",
        "ratio_vs_baseline",
    ] {
        assert!(f64_of(&row, field) > 0.0, "{field} zero: {row}");
    }
    // The same figure in both units: Gb/s (10^9 bits) = MiB/s * 2^20 * 8 / 10^9.
    let (mib, gbit) = (f64_of(&row, "bw_avg_mib_s"), f64_of(&row, "bw_avg_gbit_s"));
    assert!(
        (mib * 1048576.0 * 8.0 / 1e9 - gbit).abs() <= 1e-9 * gbit,
        "{row}"
    );
    // 50 messages of 64 KiB: MsgRate[Mpps] = bandwidth / message size.
    let mpps = f64_of(&row, "msg_rate_mpps");
    assert!(
        (mib * 1048576.0 / 65536.0 / 1e6 - mpps).abs() <= 1e-9 * mpps,
        "{row}"
    );
    // No peak over TCP: absent, not zero.
    for field in ["bw_peak_mib_s", "bw_peak_gbit_s"] {
        assert!(row.get(field).is_none(), "{field} on tcp: {row}");
    }
    // Every numeric field's name carries its unit (or is a count).
    for (name, value) in row.as_object().unwrap() {
        if value.is_number() {
            assert!(
                [
                    "_mib_s",
                    "_gbit_s",
                    "_mpps",
                    "ratio_vs_baseline",
                    "bytes",
                    "iterations"
                ]
                .iter()
                .any(|u| name.ends_with(u) || name == u),
                "{name} has no unit: {row}"
            );
        }
    }
}

#[test]
fn bandwidth_table_has_perftest_columns_and_no_peak_on_tcp() {
    let table = run_ok(perf().args(["bw", "--loopback", "-s", "1M", "-n", "20"]));
    assert!(
        table.contains(
            " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
        ),
        "{table}"
    );
    assert!(!table.contains("Gb/sec"), "{table}");
    let rows = table_rows(&table);
    assert_eq!(rows.len(), 1, "{table}");
    assert_eq!(rows[0][..3], ["1048576", "20", "-"], "{table}");
    assert!(rows[0][3].parse::<f64>().unwrap() > 0.0, "{table}");
    assert!(rows[0][4].parse::<f64>().unwrap() > 0.0, "{table}");

    let table = run_ok(perf().args([
        "bw",
        "--loopback",
        "-s",
        "1M",
        "-n",
        "20",
        "--report_gbits",
        "--baseline",
    ]));
    assert!(
        table.contains("BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]")
            && table.contains("raw TCP[Gb/sec]"),
        "{table}"
    );
    assert!(!table.contains("MB/sec"), "{table}");
    let rows = table_rows(&table);
    assert_eq!(rows[0].len(), 7, "{table}");
    assert_eq!(rows[0][2], "-", "{table}");

    // Gb/sec applies to bw only.
    let out = perf()
        .args(["lat", "--loopback", "--report_gbits"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--report_gbits"));
}

#[test]
fn loopback_latency_is_one_way_in_table_and_json() {
    let out = run_ok(perf().args(["lat", "--loopback", "-s", "64", "-n", "200", "--json"]));
    let row = one_row(&out);
    assert_eq!(row["test"], "lat");
    assert_eq!(row["transport"], "tcp");
    assert_eq!(row["bytes"], 64);
    assert_eq!(row["iterations"], 200);
    let f = |field: &str| f64_of(&row, field);
    let (min, typical, max) = (f("t_min_us"), f("t_typical_us"), f("t_max_us"));
    assert!(0.0 < min && min <= typical && typical <= max, "{row}");
    assert!(min <= f("t_avg_us") && f("t_avg_us") <= max, "{row}");
    assert!(
        typical <= f("t_p99_us") && f("t_p99_us") <= f("t_p99_9_us"),
        "{row}"
    );
    assert!(f("t_p99_9_us") <= max, "{row}");
    assert!(f("t_stdev_us") >= 0.0 && f("t_stdev_us") <= (max - min) / 2.0 + 1e-9);
    // One-way is half the round trip (ib_send_lat's convention).
    let rtt = f("rtt_median_us");
    assert!((rtt / 2.0 - typical).abs() <= 1e-9 * rtt, "{row}");
    for (name, value) in row.as_object().unwrap() {
        if value.is_number() && !["bytes", "iterations"].contains(&name.as_str()) {
            assert!(name.ends_with("_us"), "{name} has no unit: {row}");
        }
    }

    let table = run_ok(perf().args(["lat", "--loopback", "-s", "2", "-n", "20"]));
    assert!(
        table.contains(
            " #bytes     #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    \
             t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
        ),
        "{table}"
    );
    assert!(
        !table.contains("round-trip") && !table.contains("t_median"),
        "{table}"
    );
    let rows = table_rows(&table);
    assert_eq!(rows.len(), 1, "{table}");
    let v: Vec<f64> = rows[0].iter().map(|c| c.parse().unwrap()).collect();
    assert_eq!((v.len(), v[0], v[1]), (9, 2.0, 20.0), "{table}");
    // min <= typical <= max, p99 <= p99.9 <= max (two decimals).
    assert!(
        v[2] <= v[4] && v[4] <= v[3] && v[7] <= v[8] && v[8] <= v[3],
        "{table}"
    );
}

#[test]
fn all_sizes_give_one_row_each() {
    let out = run_ok(perf().args(["bw", "--loopback", "-a", "-n", "3", "--json"]));
    let rows = json_lines(&out);
    let sizes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, (1..=23).map(|p| 1u64 << p).collect::<Vec<_>>());
    assert!(rows
        .iter()
        .all(|r| r["test"] == "bw" && r["transport"] == "tcp"));
    let table = run_ok(perf().args(["bw", "--loopback", "-a", "-n", "2"]));
    let rows = table_rows(&table);
    assert_eq!(rows.len(), 23, "{table}");
    assert_eq!(rows[22][0], "8388608", "{table}");
}

#[test]
fn two_processes_server_and_client() {
    let port = free_port().to_string();
    let server = Server::start(
        perf()
            .args(["bw", "-p", &port, "--json"])
            .env("DMLC_INTERFACE", "lo")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let out = run_ok(
        perf()
            .args([
                "bw",
                "127.0.0.1",
                "-p",
                &port,
                "-s",
                "1M",
                "-n",
                "20",
                "--json",
                "--baseline",
            ])
            .env("DMLC_INTERFACE", "lo"),
    );
    let row = one_row(&out);
    assert_eq!(row["bytes"], 1 << 20);
    assert_eq!(row["remote"], format!("127.0.0.1:{port}"));
    assert!(row["ratio_vs_baseline"].as_f64().unwrap() > 0.0);
    let server = server.finish();
    assert!(server.status.success());
    // Under --json the server's banner goes to stderr: stdout holds only JSON lines (none).
    assert!(server.stdout.is_empty(), "{:?}", server.stdout);
    let banner = String::from_utf8_lossy(&server.stderr);
    assert!(banner.contains(&format!("127.0.0.1:{port}")), "{banner}");
}

/// This host's address psnet would choose without DMLC_INTERFACE, if it has a non-loopback one.
fn default_address() -> Option<String> {
    let out = perf().args(["select", "--json"]).output().unwrap();
    if !out.status.success() {
        eprintln!(
            "SKIPPED: no non-loopback interface here: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let doc = json(&String::from_utf8_lossy(&out.stdout));
    Some(doc["address"].as_str().unwrap().to_string())
}

/// Without DMLC_INTERFACE or DMLC_NODE_HOST the server listens on every address: a client
/// reaches it over 127.0.0.1 although the address psnet picks for the node is another one.
/// With an interface chosen it listens on that address only.
#[test]
fn server_listens_on_every_address_unless_an_interface_is_chosen() {
    let Some(addr) = default_address() else {
        return;
    };
    let port = free_port().to_string();
    let server = Server::start(
        perf()
            .args(["lat", "-p", &port, "--transport", "tcp"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let out = run_ok(
        perf()
            .args([
                "lat",
                "127.0.0.1",
                "-p",
                &port,
                "-s",
                "64",
                "-n",
                "20",
                "--json",
            ])
            .env("DMLC_INTERFACE", "lo"),
    );
    assert_eq!(one_row(&out)["iterations"], 20);
    let server = server.finish();
    assert!(server.status.success());
    let banner = String::from_utf8_lossy(&server.stdout);
    assert!(
        banner.contains(&format!("0.0.0.0:{port}")) && banner.contains(&addr),
        "{banner}"
    );

    // DMLC_INTERFACE=lo: 127.0.0.1 only, so the node's other address is refused.
    if addr == "127.0.0.1" {
        return;
    }
    let port = free_port().to_string();
    let server = Server::start(
        perf()
            .args(["lat", "-p", &port])
            .env("DMLC_INTERFACE", "lo")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let out = perf()
        .args(["lat", &addr, "-p", &port, "-n", "5"])
        .env("DMLC_INTERFACE", "lo")
        .env("PSNET_CONNECT_TIMEOUT", "1")
        .output()
        .unwrap();
    let refused = !out.status.success();
    // Let the server go: a client over 127.0.0.1 gets through.
    let out = run_ok(
        perf()
            .args(["lat", "127.0.0.1", "-p", &port, "-n", "5", "--json"])
            .env("DMLC_INTERFACE", "lo"),
    );
    assert_eq!(one_row(&out)["iterations"], 5);
    assert!(server.finish().status.success());
    assert!(refused, "a server on lo answered on {addr}");
}

#[test]
fn unreachable_server_is_a_clear_error() {
    let port = free_port().to_string();
    let out: Output = perf()
        .args(["lat", "127.0.0.1", "-p", &port])
        .env("DMLC_INTERFACE", "lo")
        .env("PSNET_CONNECT_TIMEOUT", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot reach the server") && err.contains("node 1"),
        "{err}"
    );
}

#[test]
fn bad_arguments_and_environment_are_reported() {
    let out = perf()
        .args(["bw", "--loopback", "-s", "lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a size"));

    let out = perf()
        .args(["select"])
        .env("DMLC_INTERFACE", "nosuchif")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nosuchif") && err.contains("lo (127.0.0.1)"),
        "{err}"
    );

    let out = perf()
        .args(["select"])
        .env("PSNET_TRANSPORT", "carrier-pigeon")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("PSNET_TRANSPORT"));

    let out = perf()
        .args(["bw", "--loopback", "-s", "1K", "-n", "5"])
        .env("PSNET_GPU_STAGE_CHUNK", "100")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("PSNET_GPU_STAGE_CHUNK") && err.contains("4096"),
        "{err}"
    );
}

#[test]
fn print_env_lists_every_variable() {
    let out = run_ok(perf().arg("--print-env"));
    for name in [
        "DMLC_INTERFACE",
        "DMLC_NODE_HOST",
        "PSNET_TRANSPORT",
        "PS_VERBOSE",
        "PSNET_MAX_MESSAGE",
    ] {
        assert!(out.contains(name), "{name} missing:\n{out}");
    }
}

#[test]
fn select_on_loopback_is_tcp_with_a_reason() {
    let out = run_ok(
        perf()
            .args(["select", "--json"])
            .env("DMLC_INTERFACE", "lo"),
    );
    let doc = json(&out);
    assert_eq!(doc["interface"], "lo");
    assert_eq!(doc["address"], "127.0.0.1");
    assert_eq!(doc["transport"], "tcp");
    assert!(doc["transport_reason"]
        .as_str()
        .unwrap()
        .contains("no RDMA device is bound to lo"));
}

#[test]
fn compress_reports_throughput_next_to_memcpy() {
    let out = run_ok(perf().args(["compress", "-n", "100000", "--reps", "2", "--json"]));
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 4, "2 schemes x (1 thread, all threads): {out}");
    for row in &rows {
        assert_eq!(row["test"], "compress", "{row}");
        for field in [
            "quantize_gb_s",
            "dequantize_add_gb_s",
            "memcpy_gb_s",
            "quantize_vs_memcpy",
        ] {
            assert!(row[field].as_f64().unwrap_or(0.0) > 0.0, "{field}: {row}");
        }
    }
    let table = run_ok(perf().args([
        "compress",
        "-n",
        "5000",
        "--reps",
        "1",
        "--scheme",
        "2bit",
        "--threads",
        "1",
    ]));
    assert!(
        table.contains("2bit") && table.contains("memcpy"),
        "{table}"
    );
    let out = perf()
        .args(["compress", "--scheme", "3bit"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn kv_goodput_launches_a_job_and_reports_every_size() {
    let out = run_ok(
        perf()
            .args([
                "kv",
                "--servers",
                "2",
                "--workers",
                "2",
                "--sizes",
                "4K,2M",
                "-n",
                "5",
                "--json",
            ])
            .env("MXNET_KVSTORE_BIGARRAY_BOUND", "100000"),
    );
    let rows = json_lines(&out);
    let sizes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, vec![4096, 2 << 20]);
    for row in &rows {
        assert_eq!(row["test"], "kv", "{row}");
        assert_eq!(
            (row["servers"].as_u64(), row["workers"].as_u64()),
            (Some(2), Some(2)),
            "{row}"
        );
        assert_eq!(row["memory"], "host", "{row}");
        assert_eq!(row["transport"], "tcp", "{row}");
        for field in ["push_mb_s", "pull_mb_s", "pushpull_mb_s", "pushpull_gbit_s"] {
            assert!(row[field].as_f64().unwrap_or(0.0) > 0.0, "{field}: {row}");
        }
    }
    let table = run_ok(perf().args([
        "kv",
        "--servers",
        "1",
        "--workers",
        "1",
        "--sizes",
        "64K",
        "-n",
        "3",
    ]));
    assert!(
        table.contains("push+pull[MB/s]") && table.contains("65536"),
        "{table}"
    );
}

/// The second hardening round: with inits the servers refuse (PSNET_KV_SERVER_KEY_BYTES),
/// worker 0 called `finalize` before reporting and the job hung, the other worker waiting in
/// the init's barrier. It now exits non-zero at once, naming the limit.
#[test]
fn kv_with_refused_inits_fails_naming_the_limit_instead_of_hanging() {
    let start = std::time::Instant::now();
    let out = perf()
        .args([
            "kv",
            "--servers",
            "1",
            "--workers",
            "2",
            "--sizes",
            "1M",
            "-n",
            "2",
        ])
        .env("PSNET_KV_SERVER_KEY_BYTES", "4096")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("PSNET_KV_SERVER_KEY_BYTES"), "{err}");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(60),
        "took {:?}",
        start.elapsed()
    );
}

/// Sends kept in flight (`--tx-depth`) all arrive, whole and counted, whatever the depth;
/// a depth of 0 is refused.
#[test]
fn bandwidth_with_sends_in_flight_delivers_every_message() {
    for depth in ["1", "7"] {
        let out = run_ok(perf().args([
            "bw",
            "--loopback",
            "-s",
            "1M",
            "-n",
            "20",
            "-t",
            depth,
            "--json",
        ]));
        let row = one_row(&out);
        assert_eq!(row["bytes"], 1 << 20, "depth {depth}: {row}");
        assert_eq!(row["iterations"], 20, "depth {depth}: {row}");
    }
    let out = perf()
        .args(["bw", "--loopback", "-t", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tx-depth"));
}

#[test]
fn a_size_beyond_the_largest_message_is_refused_before_any_output() {
    let out = perf()
        .args(["bw", "-s", "2G", "--loopback"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("PSNET_MAX_MESSAGE"), "{err}");
}

#[test]
fn bandwidth_from_gpu_memory_beside_host_memory_or_why_not() {
    let out = perf()
        .args([
            "bw",
            "--loopback",
            "--gpu",
            "-s",
            "4M",
            "-n",
            "30",
            "--json",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        // No GPU here, or a build without CUDA: the reason, and no rows.
        let why = if cfg!(feature = "cuda") {
            "no CUDA device"
        } else {
            "cuda feature"
        };
        assert!(stderr.contains(why), "{stderr}");
        assert!(out.stdout.is_empty(), "rows printed before the refusal");
        eprintln!("bandwidth_from_gpu_memory: skipped: {stderr}");
        return;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let gpu_row = text
        .lines()
        .map(json)
        .find(|r| r["row"] == "bw_gpu")
        .unwrap_or_else(|| panic!("no bw_gpu row in {text}"));
    assert_eq!(gpu_row["bytes"], 4 << 20);
    assert!(f64_of(&gpu_row, "gpu_bw_mib_s") > 0.0, "{gpu_row}");
    let ratio = f64_of(&gpu_row, "gpu_vs_host");
    let expected = f64_of(&gpu_row, "gpu_bw_mib_s") / f64_of(&gpu_row, "host_bw_mib_s");
    assert!((ratio - expected).abs() < 1e-9, "{gpu_row}");
    // Into the server's GPU memory, placed as each message arrives.
    assert!(f64_of(&gpu_row, "to_gpu_bw_mib_s") > 0.0, "{gpu_row}");
    let ratio = f64_of(&gpu_row, "to_gpu_vs_host");
    let expected = f64_of(&gpu_row, "to_gpu_bw_mib_s") / f64_of(&gpu_row, "host_bw_mib_s");
    assert!((ratio - expected).abs() < 1e-9, "{gpu_row}");
}

#[test]
fn gpu_is_for_the_bandwidth_client() {
    let out = perf()
        .args(["lat", "--loopback", "--gpu"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--gpu applies to `bw`"));
    let out = perf().args(["bw", "--gpu", "-p", "1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--gpu applies to the client"));
}
