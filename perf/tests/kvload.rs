//! `psnet-perf kvload` as CI runs it: 16 worker processes and 4 servers on this host, many
//! small keys and a sharded one, every pulled value checked by the workers; every process's
//! peak RSS is reported and bounded. (The full 100,000-key figure is a benchmark run by hand:
//! `psnet-perf kvload`.)

use std::process::Command;

mod common;

use common::{json_lines, run_ok};

#[test]
fn many_processes_and_keys_complete_with_bounded_peak_memory() {
    let out = run_ok(
        Command::new(env!("CARGO_BIN_EXE_psnet-perf"))
            .args([
                "kvload",
                "--servers",
                "4",
                "--workers",
                "16",
                "--keys",
                "5000",
                "--sharded",
                "1",
                "--rounds",
                "2",
                "--json",
            ])
            // A loaded 2-core machine running 21 debug processes: no false deaths.
            .env("PS_HEARTBEAT_TIMEOUT", "120")
            .env_remove("DMLC_ROLE"),
    );
    let rows = json_lines(&out);
    let count = |role: &str| rows.iter().filter(|r| r["role"] == role).count();
    assert_eq!(
        (count("scheduler"), count("server"), count("worker")),
        (1, 4, 16),
        "{out}"
    );
    for r in &rows {
        let kib = r["peak_rss_kib"].as_u64().expect("a peak");
        assert!(kib > 0, "{r}");
        // Bounded: far below what unbounded queues or per-round growth would reach.
        assert!(kib < 1 << 20, "a process peaked at {kib} KiB: {r}");
    }
}
