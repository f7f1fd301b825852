//! `--launcher sge|pbs` against stand-ins on PATH: a `qsub` that runs the array's tasks on
//! this host with the batch system's variable set (`SGE_TASK_ID`, `PBS_ARRAY_INDEX`,
//! `PBS_ARRAYID`), a `qstat` that knows the job while a task runs, and a `qdel` that records
//! the cancellation and stops the tasks.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{batch_stand_ins, path_with, reference_weights, scratch, trainer, SMALL_MODEL};

fn stubs(tag: &str) -> std::path::PathBuf {
    let dir = scratch(&format!("batch-{tag}"));
    batch_stand_ins(&dir);
    dir
}

/// The job: each task records its role, rank and the scheduler's address, then does `then`;
/// the scheduler ends once all four tasks recorded theirs.
fn job(dir: &Path, then: &str) -> String {
    let d = dir.display();
    format!(
        "if [ \"$DMLC_ROLE\" = scheduler ]; then \
           while [ $(ls {d} | grep -c '^rank\\.') -lt 4 ]; do sleep 0.05; done; exit 0; fi; \
         echo \"$DMLC_ROLE ${{DMLC_WORKER_ID:-${{DMLC_SERVER_ID:-}}}} $DMLC_PS_ROOT_URI $DMLC_NUM_SERVER $DMLC_NUM_WORKER\" \
           > {d}/rank.$DMLC_ROLE.${{DMLC_WORKER_ID:-${{DMLC_SERVER_ID:-}}}}; {then}"
    )
}

fn launcher(dir: &Path, args: &[&str], script: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_psnet-launch"));
    cmd.args(args)
        .args([
            "-n", "2", "-s", "2", "--grace", "1", "--", "sh", "-c", script,
        ])
        .env("PATH", path_with(dir))
        .current_dir(dir);
    cmd
}

fn ranks(dir: &Path) -> Vec<String> {
    let mut r: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("rank.")
                .then(|| std::fs::read_to_string(e.path()).ok())
                .flatten()
        })
        .map(|s| s.trim().to_string())
        .collect();
    r.sort();
    r
}

#[test]
fn array_tasks_become_servers_then_workers_on_each_batch_system() {
    for (tag, args, var) in [
        (
            "sge",
            vec!["--launcher", "sge", "--sge-args", "-q all.q"],
            "-terse -S /bin/sh -t 1-4",
        ),
        ("pbs", vec!["--launcher", "pbs"], "-J 1-4"),
        (
            "torque",
            vec!["--launcher", "pbs", "--pbs-flavor", "torque"],
            "-t 1-4",
        ),
    ] {
        let dir = stubs(tag);
        let out = launcher(&dir, &args, &job(&dir, "exit 0"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{tag}: {stderr}");
        assert_eq!(
            ranks(&dir),
            [
                "server 0 127.0.0.1 2 2",
                "server 1 127.0.0.1 2 2",
                "worker 0 127.0.0.1 2 2",
                "worker 1 127.0.0.1 2 2",
            ],
            "{tag}"
        );
        let qsub = std::fs::read_to_string(dir.join("qsub.args")).unwrap();
        assert!(qsub.starts_with(var), "{tag}: {qsub}");
        if tag == "sge" {
            assert!(qsub.trim_end().ends_with("-q all.q"), "{qsub}");
        }
        assert!(
            !dir.join("qdel.log").exists(),
            "{tag}: a job that ended well is not cancelled"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_task_failing_before_it_joins_stops_the_job() {
    let dir = stubs("fail");
    // Worker 1 dies before recording its rank: the scheduler would wait for ever.
    let script = job(&dir, "exit 0").replace(
        "if [ \"$DMLC_ROLE\" = scheduler ]",
        "[ \"${DMLC_WORKER_ID:-}\" = 1 ] && exit 3; if [ \"$DMLC_ROLE\" = scheduler ]",
    );
    let started = Instant::now();
    let out = launcher(&dir, &["--launcher", "sge"], &script)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("a task failed before it joined"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_signal_to_the_launcher_cancels_the_array_job() {
    let dir = stubs("signal");
    // The scheduler waits on after the tasks started (a job in progress), as do the tasks.
    let script = job(&dir, "exec sleep 60").replace("exit 0; fi", "exec sleep 60; fi");
    let mut child = launcher(&dir, &["--launcher", "pbs"], &script)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while ranks(&dir).len() < 4 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the tasks did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15));
    let qdel = std::fs::read_to_string(dir.join("qdel.log")).unwrap();
    assert_eq!(qdel.trim(), "4242[].stub");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_qsub_the_error_says_what_to_install() {
    let dir = scratch("batch-none");
    let out = Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
        .args(["--launcher", "sge", "-n", "1", "--", "/bin/true"])
        .env("PATH", &dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("cannot run qsub") && stderr.contains("Grid Engine submit host"),
        "{stderr}"
    );
    // Without --root the scheduler is on loopback here: said, since tasks elsewhere cannot
    // reach it.
    assert!(
        stderr.contains("warning: the scheduler listens on 127.0.0.1"),
        "{stderr}"
    );
}

#[test]
fn training_through_grid_engine_and_pbs_matches_the_reference() {
    let train = trainer();
    for tag in ["sge", "pbs"] {
        let dir = stubs(&format!("train-{tag}"));
        let want = reference_weights(&dir);
        let weights = dir.join("w.bin");
        let out = Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
            .args([
                "--launcher",
                tag,
                "--root",
                "127.0.0.1",
                "-n",
                "2",
                "-s",
                "2",
                "--",
            ])
            .arg(&train)
            .args(SMALL_MODEL)
            .arg("--dump")
            .arg(&weights)
            .env("PATH", path_with(&dir))
            .env("PS_HEARTBEAT_INTERVAL", "0.2")
            .env_remove("DMLC_INTERFACE")
            .env_remove("DMLC_NODE_HOST")
            .current_dir(&dir)
            .output()
            .unwrap();
        let logs: String = (1..=4)
            .map(|i| std::fs::read_to_string(dir.join(format!("task.{i}.log"))).unwrap_or_default())
            .collect();
        assert!(
            out.status.success(),
            "{tag}: {}\n{logs}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            logs.contains("epoch 1 loss"),
            "{tag}: rank 0 trained: {logs}"
        );
        assert!(
            std::fs::read(&weights).unwrap() == want,
            "{tag}: weights differ from the reference"
        );
        assert!(!dir.join("qdel.log").exists(), "{tag}: nothing to cancel");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
