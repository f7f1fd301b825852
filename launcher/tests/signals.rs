//! A signal to the launcher stops the whole job. In a process of its own: the test sends
//! SIGTERM to itself, which would reach any other launch running in the same process.

use std::time::{Duration, Instant};

use psnet_launch::{launch_local, JobSpec};

mod common;

#[test]
fn a_signal_to_the_launcher_stops_every_process_and_what_they_started() {
    // Each process starts a grandchild of its own and records its pid; all must be gone once
    // the launcher, sent SIGTERM, returns.
    let dir = std::env::temp_dir().join(format!("psnet-launch-signal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = format!(
        "sleep 120 & echo $! > {}/$DMLC_ROLE-$$; wait",
        dir.display()
    );
    let mut spec = JobSpec::new(1, 2, vec!["sh".into(), "-c".into(), script]);
    spec.grace = Duration::from_secs(30);
    let me = rustix::process::getpid();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        let _ = rustix::process::kill_process(me, rustix::process::Signal::TERM);
    });
    let started = Instant::now();
    let out = launch_local(&spec).unwrap();
    assert_eq!(out.signal, Some(signal_hook::consts::SIGTERM), "{out:?}");
    assert!(!out.success());
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
    let pids: Vec<i32> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    assert_eq!(
        pids.len(),
        4,
        "scheduler, server and two workers each started one"
    );
    std::thread::sleep(Duration::from_millis(200));
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"));
        let alive = stat.is_ok_and(|s| !s.contains(") Z "));
        assert!(!alive, "grandchild {pid} still runs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts psnet-launch (`extra` arguments) on a job of 1 server and 2 workers whose
/// processes record their pids in `dir` and sleep; returns once all four run.
fn sleeping_job(dir: &std::path::Path, extra: &[&str]) -> std::process::Child {
    let script = format!("echo $$ > {}/$DMLC_ROLE-$$; exec sleep 120", dir.display());
    let launcher = std::process::Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
        .args(["-n", "2", "-s", "1"])
        .args(extra)
        .args(["--", "sh", "-c", &script])
        .spawn()
        .expect("start psnet-launch");
    common::wait_for(Duration::from_secs(20), "the job did not start", || {
        common::pids_in(dir).len() == 4
    });
    launcher
}

#[test]
fn a_launcher_killed_outright_leaves_no_process_of_the_job() {
    // SIGKILL cannot be caught: the processes go because the kernel's parent-death signal
    // kills them, not because the launcher passed anything on.
    let dir = common::scratch("kill");
    let mut launcher = sleeping_job(&dir, &[]);
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    common::assert_all_gone(&dir, Duration::from_secs(5), "SIGKILL");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigint_to_the_launcher_binary_stops_the_job_with_128_plus_2() {
    let dir = common::scratch("int");
    let mut launcher = sleeping_job(&dir, &["--no-prefix"]);
    let pid = rustix::process::Pid::from_child(&launcher);
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    let status = launcher.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 2), "{status}");
    common::assert_all_gone(&dir, Duration::from_secs(5), "SIGINT");
    let _ = std::fs::remove_dir_all(&dir);
}
