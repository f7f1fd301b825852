//! `psnet-perf allreduce | reducescatter | allgather | broadcast | reduce` as a user runs them:
//! `--np` ranks on 127.0.0.1, nccl-tests' flags and table, checked results, errors, and no rank
//! left behind.

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{json_lines, run_ok};

fn perf() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_psnet-perf"));
    for var in [
        "DMLC_INTERFACE",
        "DMLC_NODE_HOST",
        "PSNET_TRANSPORT",
        "PS_VERBOSE",
        "RUST_LOG",
        "PSNET_RANK",
        "PSNET_WORLD_SIZE",
        "PSNET_ROOT_ADDR",
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "PSNET_ALGO",
        "PSNET_COLL_SMALL",
        "PSNET_COLL_SMALL_SHM",
        "PSNET_COLL_PIECE",
        "PSNET_SHM_RING",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn f64_of(row: &serde_json::Value, field: &str) -> f64 {
    row[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{field} missing: {row}"))
}

/// One run's expectations.
struct Case {
    args: &'static [&'static str],
    collective: &'static str,
    dtype: &'static str,
    op: &'static str,
    ranks: u64,
    root: Option<u64>,
    /// nccl-tests' size column for each size (the n x block buffer for blocked collectives).
    sizes: &'static [u64],
    /// busbw / algbw.
    factor: f64,
}

/// Every row of `case`'s JSON output: the context, 0 wrong elements, nccl-tests' figures.
fn check_case(case: &Case) {
    let out = run_ok(perf().args(case.args));
    let rows = json_lines(&out);
    let what = case.args.join(" ");
    assert_eq!(rows.len(), 2 * case.sizes.len(), "{what}:\n{out}");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row["collective"], case.collective, "{what}: {row}");
        assert_eq!(row["dtype"], case.dtype, "{what}: {row}");
        assert_eq!(row["op"], case.op, "{what}: {row}");
        assert_eq!(row["ranks"], case.ranks, "{what}: {row}");
        assert_eq!(row["transport"], "tcp", "{what}: {row}");
        assert_eq!(row["root"].as_u64(), case.root, "{what}: {row}");
        assert_eq!(
            row["in_place"],
            i % 2 == 1,
            "out of place, then in place: {row}"
        );
        assert_eq!(row["bytes"], case.sizes[i / 2], "{what}: {row}");
        assert_eq!(row["wrong"], 0, "{what}: {row}");
        let time_us = f64_of(row, "time_us");
        assert!(time_us > 0.0, "{what}: {row}");
        // algbw = size / time in 10^9 bytes per second; busbw = algbw x the bus factor.
        let algbw = f64_of(row, "algbw_gb_s");
        let want = case.sizes[i / 2] as f64 / (time_us * 1e-6) / 1e9;
        assert!(
            (algbw - want).abs() <= 1e-9 * want.max(1e-9),
            "{what}: {row}"
        );
        let busbw = f64_of(row, "busbw_gb_s");
        assert!(
            (busbw - algbw * case.factor).abs() <= 1e-9 * busbw.max(1e-9),
            "{what}: {row}"
        );
    }
}

#[test]
fn every_collective_reports_no_wrong_elements() {
    let cases = [
        Case {
            args: &[
                "allreduce",
                "--np",
                "3",
                "-b",
                "8",
                "-e",
                "64K",
                "-f",
                "4",
                "-n",
                "2",
                "-w",
                "1",
                "-c",
                "1",
                "--json",
            ],
            collective: "allreduce",
            dtype: "float",
            op: "sum",
            ranks: 3,
            root: None,
            sizes: &[8, 32, 128, 512, 2048, 8192, 32768],
            factor: 4.0 / 3.0,
        },
        // 3 ranks: a block of 8 bytes is 2 floats, so 8 B holds no whole block (size 0) and
        // 64 B holds 5 floats per rank (60 B).
        Case {
            args: &[
                "reducescatter",
                "--np",
                "3",
                "-b",
                "8",
                "-e",
                "32K",
                "-f",
                "8",
                "-n",
                "2",
                "-w",
                "1",
                "--json",
            ],
            collective: "reducescatter",
            dtype: "float",
            op: "sum",
            ranks: 3,
            root: None,
            sizes: &[0, 60, 504, 4092, 32760],
            factor: 2.0 / 3.0,
        },
        Case {
            args: &[
                "allgather",
                "--np",
                "3",
                "-b",
                "8",
                "-e",
                "32K",
                "-f",
                "8",
                "-n",
                "2",
                "-w",
                "1",
                "-d",
                "half",
                "--json",
            ],
            collective: "allgather",
            dtype: "half",
            op: "none",
            ranks: 3,
            root: None,
            sizes: &[6, 60, 510, 4092, 32766],
            factor: 2.0 / 3.0,
        },
        Case {
            args: &[
                "broadcast",
                "--np",
                "3",
                "-b",
                "8",
                "-e",
                "32K",
                "-f",
                "8",
                "-n",
                "2",
                "-w",
                "1",
                "-r",
                "2",
                "--json",
            ],
            collective: "broadcast",
            dtype: "float",
            op: "none",
            ranks: 3,
            root: Some(2),
            sizes: &[8, 64, 512, 4096, 32768],
            factor: 1.0,
        },
        Case {
            args: &[
                "reduce", "--np", "3", "-b", "8", "-e", "32K", "-f", "8", "-n", "2", "-w", "1",
                "-o", "max", "-r", "1", "--json",
            ],
            collective: "reduce",
            dtype: "float",
            op: "max",
            ranks: 3,
            root: Some(1),
            sizes: &[8, 64, 512, 4096, 32768],
            factor: 1.0,
        },
        Case {
            args: &[
                "alltoall", "--np", "3", "-b", "8", "-e", "32K", "-f", "8", "-n", "2", "-w", "1",
                "-d", "int32", "--json",
            ],
            collective: "alltoall",
            dtype: "int32",
            op: "none",
            ranks: 3,
            root: None,
            sizes: &[0, 60, 504, 4092, 32760],
            factor: 2.0 / 3.0,
        },
        Case {
            args: &[
                "sendrecv", "--np", "3", "-b", "8", "-e", "32K", "-f", "8", "-n", "2", "-w", "1",
                "--json",
            ],
            collective: "sendrecv",
            dtype: "float",
            op: "none",
            ranks: 3,
            root: None,
            sizes: &[8, 64, 512, 4096, 32768],
            factor: 1.0,
        },
        // Recursive doubling up to PSNET_COLL_SMALL_SHM (1 MiB), the pipelined ring past it,
        // pieces of 1 MiB and the shared-memory ring (messages of 256 KiB and more); bfloat16
        // averages.
        Case {
            args: &[
                "allreduce",
                "--np",
                "4",
                "-b",
                "256K",
                "-e",
                "4M",
                "-f",
                "4",
                "-n",
                "1",
                "-w",
                "1",
                "-d",
                "bfloat16",
                "-o",
                "avg",
                "--json",
            ],
            collective: "allreduce",
            dtype: "bfloat16",
            op: "avg",
            ranks: 4,
            root: None,
            sizes: &[256 << 10, 1 << 20, 4 << 20],
            factor: 1.5,
        },
        Case {
            args: &[
                "allreduce",
                "--np",
                "2",
                "-b",
                "1",
                "-e",
                "1M",
                "-f",
                "32",
                "-n",
                "1",
                "-w",
                "0",
                "-d",
                "uint8",
                "-o",
                "prod",
                "--json",
            ],
            collective: "allreduce",
            dtype: "uint8",
            op: "prod",
            ranks: 2,
            root: None,
            sizes: &[1, 32, 1024, 32768, 1 << 20],
            factor: 1.0,
        },
    ];
    for case in &cases {
        check_case(case);
    }
}

#[test]
fn the_compressed_allreduce_reports_every_rank_alike_and_the_bytes_each_sends() {
    // 3 ranks: the allgather of codes below 64 KiB, two phases from it.
    let out = run_ok(perf().args([
        "allreduce",
        "--np",
        "3",
        "-b",
        "4K",
        "-e",
        "256K",
        "-f",
        "8",
        "-n",
        "3",
        "-w",
        "1",
        "--compression",
        "2bit",
        "--json",
    ]));
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 6, "{out}");
    for row in &rows {
        assert_eq!(row["compression"], "2bit", "{row}");
        assert_eq!(row["wrong"], 0, "ranks differ: {row}");
        let count = row["count"].as_u64().unwrap();
        let sent = row["sent_per_rank_bytes"].as_u64().unwrap();
        // 2-bit codes are 1/16 of the floats: the allgather sends (n - 1) of them, two
        // phases 2 (n - 1)/n, the second phase's blocks each with its 4-byte scale.
        let codes = (count * 4).div_ceil(16);
        if count * 4 < 64 << 10 {
            assert_eq!(sent, 2 * codes, "{row}");
        } else {
            assert!(sent.abs_diff(4 * codes / 3 + 2 * 4) <= 16, "{row}");
        }
        // algbw is the uncompressed size over the time.
        let algbw = f64_of(row, "algbw_gb_s");
        let want = row["bytes"].as_f64().unwrap() / f64_of(row, "time_us") / 1e3;
        assert!((algbw - want).abs() <= 1e-6 * want.max(1.0), "{row}");
    }
    let table = run_ok(perf().args([
        "allreduce",
        "--np",
        "2",
        "-b",
        "1K",
        "-e",
        "1K",
        "-n",
        "2",
        "-w",
        "0",
        "--compression",
        "1bit",
    ]));
    assert!(table.contains("sent/rank"), "{table}");
    assert!(table.contains("# Out of bounds values : 0 OK"), "{table}");
    let err = stderr_of(&["allgather", "--np", "2", "--compression", "2bit"]);
    assert!(err.contains("--compression is for allreduce"), "{err}");
}

/// The data lines of a table: those that do not start with `#`, split into columns.
fn table_rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

#[test]
fn the_table_has_nccl_tests_columns_and_ends_with_the_average() {
    let out = run_ok(perf().args([
        "allreduce",
        "--np",
        "2",
        "-b",
        "8",
        "-e",
        "8K",
        "-f",
        "32",
        "-n",
        "3",
        "-w",
        "1",
    ]));
    let header = out
        .lines()
        .find(|l| l.contains("redop"))
        .unwrap_or_else(|| panic!("no header:\n{out}"));
    let labels: Vec<&str> = header.split_whitespace().collect();
    assert_eq!(
        labels,
        [
            "#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
            "time", "algbw", "busbw", "#wrong"
        ],
        "{out}"
    );
    assert!(
        out.contains("# Using ranks") && out.contains("#  Rank  1 Pid"),
        "{out}"
    );
    let rows = table_rows(&out);
    assert_eq!(rows.len(), 3, "8, 256 and 8192 bytes:\n{out}");
    for (row, size) in rows.iter().zip([8, 256, 8192]) {
        assert_eq!(row.len(), 13, "{out}");
        assert_eq!(row[0], size.to_string());
        assert_eq!(row[1], (size / 4).to_string());
        assert_eq!(row[2..5], ["float", "sum", "-1"]);
        assert_eq!((row[8].as_str(), row[12].as_str()), ("0", "0"), "{out}");
    }
    let last = out.lines().last().unwrap();
    assert!(last.starts_with("# Avg bus bandwidth    : "), "{out}");
    let avg: f64 = last.rsplit(' ').next().unwrap().parse().unwrap();
    // The average of the six busbw columns (2 decimals each: within their rounding).
    let sum: f64 = rows
        .iter()
        .map(|r| r[7].parse::<f64>().unwrap() + r[11].parse::<f64>().unwrap())
        .sum();
    assert!(
        (avg - sum / 6.0).abs() <= 0.005 + 1e-9,
        "{avg} vs {sum}:\n{out}"
    );
    assert!(out.contains("# Out of bounds values : 0 OK"), "{out}");

    // Without --check, no wrong column to trust.
    let out = run_ok(perf().args([
        "broadcast",
        "--np",
        "2",
        "-b",
        "4K",
        "-e",
        "4K",
        "-n",
        "1",
        "-c",
        "0",
        "-r",
        "1",
    ]));
    let rows = table_rows(&out);
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0][2..5], ["float", "none", "1"]);
    assert_eq!((rows[0][8].as_str(), rows[0][12].as_str()), ("N/A", "N/A"));
}

fn fails(args: &[&str]) -> Output {
    let out = perf().args(args).output().expect("run psnet-perf");
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(
        out.stdout.is_empty(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

fn stderr_of(args: &[&str]) -> String {
    String::from_utf8_lossy(&fails(args).stderr).into_owned()
}

#[test]
fn bad_flags_are_clear_errors() {
    let err = stderr_of(&["allreduce", "--np", "2", "-d", "complex"]);
    assert!(
        err.contains("complex") && err.contains("unknown data type") && err.contains("bfloat16"),
        "{err}"
    );
    let err = stderr_of(&["reduce", "--np", "2", "-o", "xor"]);
    assert!(err.contains("unknown reduction"), "{err}");
    let err = stderr_of(&["allreduce", "--np", "2", "-c", "2"]);
    assert!(err.contains("--check"), "{err}");
    let err = stderr_of(&["allreduce", "--np", "2", "-b", "2K", "-e", "1K"]);
    assert!(err.contains("larger than -e/--maxbytes"), "{err}");
    let err = stderr_of(&["allreduce", "--np", "2", "-d", "int32", "-o", "avg"]);
    assert!(err.contains("floating-point"), "{err}");
    let err = stderr_of(&["broadcast", "--np", "3", "-r", "3"]);
    assert!(err.contains("--root 3"), "{err}");
    let err = stderr_of(&["allgather", "-e", "1K"]);
    assert!(err.contains("PSNET_RANK") && err.contains("--np"), "{err}");
    let err = stderr_of(&["allreduce", "-e", "1K"]);
    assert!(err.contains("PSNET_RANK"), "{err}");
    // A launcher's world without a meeting point.
    let out = perf()
        .args(["allreduce", "-e", "1K"])
        .env("PSNET_RANK", "0")
        .env("PSNET_WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("PSNET_ROOT_ADDR"));
}

/// The pids of the processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: the fields after the last ')'.
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 1..]
            .split_whitespace()
            .collect();
        if fields[1].parse::<u32>() == Ok(parent) {
            out.push(pid);
        }
    }
    out
}

/// Whether `pid` still runs (a zombie waiting to be reaped does not).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat[stat.rfind(')').unwrap() + 1..]
                .split_whitespace()
                .next()
                .unwrap_or("");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// The rank `PSNET_RANK` gives process `pid`.
fn rank_of(pid: u32) -> Option<u32> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|&b| b == 0)
        .find_map(|v| v.strip_prefix(b"PSNET_RANK="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

fn kill(pid: u32) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
}

/// A launching psnet-perf, and its ranks: whatever remains is killed when the test ends.
struct Job {
    parent: Option<Child>,
    ranks: Vec<u32>,
}

impl Job {
    /// Starts `np` ranks that would run for minutes, and waits until every one runs.
    fn start(np: usize) -> Job {
        let np_text = np.to_string();
        let parent = perf()
            .args([
                "allreduce",
                "--np",
                &np_text,
                "-b",
                "4M",
                "-e",
                "4M",
                "-n",
                "1000000",
                "-w",
                "0",
                "-c",
                "0",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start psnet-perf");
        let pid = parent.id();
        let mut job = Job {
            parent: Some(parent),
            ranks: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while job.ranks.len() < np {
            assert!(Instant::now() < deadline, "ranks: {:?}", job.ranks);
            std::thread::sleep(Duration::from_millis(50));
            job.ranks = children_of(pid);
        }
        job
    }

    /// Waits for the launcher to exit by itself.
    fn finish(&mut self) -> Output {
        let parent = self.parent.take().expect("not finished yet");
        parent.wait_with_output().expect("the launcher exits")
    }

    /// Kills the launcher outright (SIGKILL: it cannot clean up).
    fn kill_launcher(&mut self) {
        let mut parent = self.parent.take().expect("not finished yet");
        parent.kill().unwrap();
        parent.wait().unwrap();
    }

    /// Waits until none of the ranks runs any more.
    fn ranks_end(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.ranks.iter().any(|&p| alive(p)) {
            assert!(
                Instant::now() < deadline,
                "ranks still running: {:?}",
                self.ranks
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(mut parent) = self.parent.take() {
            let _ = parent.kill();
            let _ = parent.wait();
        }
        for &pid in &self.ranks {
            if alive(pid) {
                kill(pid);
            }
        }
    }
}

#[test]
fn a_lost_rank_is_named_and_no_rank_outlives_the_launcher() {
    // A rank dies: the launcher names it, stops the others and fails.
    let mut job = Job::start(3);
    let victim = job
        .ranks
        .iter()
        .copied()
        .find(|&p| rank_of(p) == Some(2))
        .expect("a rank 2");
    // Let them get past joining, into the measurement.
    std::thread::sleep(Duration::from_millis(500));
    kill(victim);
    let out = job.finish();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("rank 2 of 3 failed"), "{err}");
    job.ranks_end();

    // The launcher is killed outright: its ranks go with it.
    let mut job = Job::start(3);
    std::thread::sleep(Duration::from_millis(200));
    job.kill_launcher();
    job.ranks_end();
}
