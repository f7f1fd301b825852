//! The flight recorder through the launcher: SIGUSR1 to psnet-launch asks every process of
//! a running psnet-train job for its dump and prints the doctor's report, and the job goes
//! on to its end.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

/// psnet-launch running a long psnet-train job (1 server, 2 workers, `env` added) that dumps
/// into `dir`: the small model without its epoch count, long enough to act on mid-job.
fn long_job(dir: &std::path::Path, env: &[(&str, &str)]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
        .args(["-n", "2", "-s", "1", "--"])
        .arg(common::trainer())
        .args(&common::SMALL_MODEL[..10])
        .args(["--epochs", "5000"])
        .env("PSNET_RECORDER_DIR", dir)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start psnet-launch")
}

/// Everything the launcher writes to stderr, once it ends.
fn stderr_of(launcher: &mut std::process::Child) -> String {
    let mut err = String::new();
    launcher
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}

#[test]
fn sigusr1_to_the_launcher_prints_every_process_dump_and_the_job_goes_on() {
    let dir = common::scratch("dumps");
    let mut launcher = long_job(&dir, &[]);
    // Every process is past its start by then (it catches SIGUSR1 from there on).
    std::thread::sleep(Duration::from_secs(3));
    let pid = rustix::process::Pid::from_child(&launcher);
    rustix::process::kill_process(pid, rustix::process::Signal::USR1).unwrap();
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        launcher.try_wait().unwrap().is_none(),
        "the job ended when asked for dumps"
    );
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let err = stderr_of(&mut launcher);
    launcher.wait().unwrap();
    assert!(err.contains("SIGUSR1: asked 4 processes"), "{err}");
    assert!(err.contains("flight recorder dumps in"), "{err}");
    // Workers and the server each dumped, and the doctor read them.
    for who in ["worker 0 (pid", "worker 1 (pid", "server 0 (pid"] {
        assert!(err.contains(who), "{who}: {err}");
    }
    assert!(err.contains("kv job:"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--dump-after 1`: processes that print nothing for a second are asked for their dumps
/// (here shells that answer SIGUSR1 with a line, which starts a new quiet spell), and the
/// job goes on.
#[test]
fn a_quiet_job_is_asked_for_its_dumps_after_dump_after_seconds() {
    let dir = common::scratch("dump-after");
    let script =
        "trap 'echo asked' USR1; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
        .args([
            "-n",
            "2",
            "-s",
            "1",
            "--dump-after",
            "1",
            "--",
            "sh",
            "-c",
            script,
        ])
        .env("PSNET_RECORDER_DIR", &dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start psnet-launch");
    std::thread::sleep(Duration::from_secs(5));
    assert!(launcher.try_wait().unwrap().is_none(), "the job ended");
    let pid = rustix::process::Pid::from_child(&launcher);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let mut out = String::new();
    launcher
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let err = stderr_of(&mut launcher);
    launcher.wait().unwrap();
    assert!(
        err.contains("no output for 1 s (--dump-after): asked 4 processes"),
        "{err}"
    );
    // Every process got the signal (and, being a shell, said so).
    for tag in [
        "[scheduler] asked",
        "[server 0] asked",
        "[worker 0] asked",
        "[worker 1] asked",
    ] {
        assert!(out.contains(tag), "{tag}: {out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts a long psnet-train job (1 server, 2 workers, `env` added) dumping into `dir`,
/// waits until the process whose environment holds `marks` runs and trains, sends it `sig`,
/// and returns whether the launcher succeeded, and its stderr.
fn strike(
    dir: &std::path::Path,
    marks: &[&str],
    sig: rustix::process::Signal,
    env: &[(&str, &str)],
) -> (bool, String) {
    let mut launcher = long_job(dir, env);
    let mut marks: Vec<String> = marks.iter().map(|m| m.to_string()).collect();
    marks.push(format!("PSNET_RECORDER_DIR={}", dir.display()));
    let mut target = None;
    common::wait_for(Duration::from_secs(30), "the process never ran", || {
        target = common::process_with(&marks);
        target.is_some()
    });
    // Past its start and into the training.
    std::thread::sleep(Duration::from_secs(2));
    let pid = rustix::process::Pid::from_raw(target.unwrap()).unwrap();
    rustix::process::kill_process(pid, sig).unwrap();
    let err = stderr_of(&mut launcher);
    let status = launcher.wait().unwrap();
    // A stopped process is killed with its job; let it go in any case.
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    (status.success(), err)
}

/// The doctor's verdict the launcher printed after a failed job.
fn verdict(err: &str) -> &str {
    err.split("flight recorder dumps in")
        .nth(1)
        .unwrap_or_else(|| panic!("no verdict: {err}"))
}

/// A worker of a running psnet-train job killed outright: the job fails, and the launcher
/// ends with the doctor's verdict on what the others dumped, naming the lost worker.
#[test]
fn a_killed_worker_ends_the_job_with_the_doctors_verdict() {
    let dir = common::scratch("killed");
    let (ok, err) = strike(
        &dir,
        &["DMLC_ROLE=worker", "DMLC_WORKER_ID=1"],
        rustix::process::Signal::KILL,
        &[],
    );
    assert!(!ok, "{err}");
    let verdict = verdict(&err);
    assert!(
        verdict.contains("kv job: worker 0 sent") && verdict.contains("it failed: "),
        "{verdict}"
    );
    // The request by its key, part and server, and the lost worker.
    assert!(
        verdict.contains(" of key ") && verdict.contains(") to server 0"),
        "{verdict}"
    );
    assert!(verdict.contains("worker 1"), "{verdict}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The server frozen (SIGSTOP) mid-job: the scheduler declares it lost after the heartbeat
/// timeout, the workers' requests fail, and the verdict names the server, which left no
/// dump.
#[test]
fn a_frozen_server_ends_the_job_with_the_doctors_verdict() {
    let dir = common::scratch("frozen-server");
    let (ok, err) = strike(
        &dir,
        &["DMLC_ROLE=server"],
        rustix::process::Signal::STOP,
        &[
            ("PS_HEARTBEAT_INTERVAL", "0.2"),
            ("PS_HEARTBEAT_TIMEOUT", "2"),
        ],
    );
    assert!(!ok, "{err}");
    let verdict = verdict(&err);
    assert!(verdict.contains("kv job: worker "), "{verdict}");
    // The request the server never answered, by its key, part and server.
    assert!(
        verdict.contains(" of key ") && verdict.contains(") to server 0"),
        "{verdict}"
    );
    assert!(verdict.contains("server 0 left no dump"), "{verdict}");
    let _ = std::fs::remove_dir_all(&dir);
}
