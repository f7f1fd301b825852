//! `psnet-perf` as a user runs it: loopback, two processes, errors.

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};

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

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run psnet-perf");
    assert!(
        out.status.success(),
        "psnet-perf failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
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
    let doc = json(&out);
    assert_eq!(doc["test"], "bw");
    assert_eq!(doc["transport"], "tcp");
    let row = &doc["results"][0];
    assert_eq!(row["bytes"], 65536);
    assert_eq!(row["iterations"], 50);
    for field in [
        "bw_avg_gbit_s",
        "bw_peak_gbit_s",
        "bw_avg_mib_s",
        "msg_rate_mpps",
        "baseline_bw_gbit_s",
        "ratio_vs_baseline",
    ] {
        assert!(
            row[field].as_f64().unwrap_or(0.0) > 0.0,
            "{field} missing or zero: {row}"
        );
    }
    assert!(row["bw_peak_gbit_s"].as_f64() >= row["bw_avg_gbit_s"].as_f64());
}

#[test]
fn loopback_latency_table_and_json() {
    let out = run_ok(perf().args(["lat", "--loopback", "-s", "64", "-n", "50", "--json"]));
    let row = &json(&out)["results"][0];
    assert_eq!(row["bytes"], 64);
    assert_eq!(row["iterations"], 50);
    let (min, med, max) = (
        row["lat_min_us"].as_f64().unwrap(),
        row["lat_median_us"].as_f64().unwrap(),
        row["lat_max_us"].as_f64().unwrap(),
    );
    assert!(0.0 < min && min <= med && med <= max, "{row}");

    let table = run_ok(perf().args(["lat", "--loopback", "-s", "2", "-n", "20"]));
    assert!(
        table.contains("t_median[usec]") && table.contains("round-trip"),
        "{table}"
    );
}

#[test]
fn all_sizes_give_one_row_each() {
    let out = run_ok(perf().args(["bw", "--loopback", "-a", "-n", "3", "--json"]));
    let rows = json(&out)["results"].as_array().unwrap().clone();
    let sizes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, (1..=23).map(|p| 1u64 << p).collect::<Vec<_>>());
    let table = run_ok(perf().args(["bw", "--loopback", "-a", "-n", "2"]));
    assert!(table.contains("BW average[Gb/sec]") && table.contains("BW average[MB/sec]"));
    assert!(table.contains("8388608"), "{table}");
}

#[test]
fn two_processes_server_and_client() {
    let port = free_port().to_string();
    let mut server = perf()
        .args(["bw", "-p", &port])
        .env("DMLC_INTERFACE", "lo")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start server");
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
    let row = &json(&out)["results"][0];
    assert_eq!(row["bytes"], 1 << 20);
    assert!(row["ratio_vs_baseline"].as_f64().unwrap() > 0.0);
    let status = server
        .wait()
        .expect("server exits after the client's goodbye");
    assert!(status.success());
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
    let doc = json(&out);
    let rows = doc.as_array().expect("an array of rows");
    assert_eq!(rows.len(), 4, "2 schemes x (1 thread, all threads): {doc}");
    for row in rows {
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
    let doc = json(&out);
    assert_eq!(
        (doc["servers"].as_u64(), doc["workers"].as_u64()),
        (Some(2), Some(2))
    );
    let rows = doc["results"].as_array().unwrap();
    let sizes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, vec![4096, 2 << 20]);
    for row in rows {
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
        let row = &json(&out)["results"][0];
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
