//! `--launcher ssh` and the flight recorder: processes on other hosts dump into a folder of the
//! job's under their own host's temporary directory, and after a failed job the launcher copies
//! those dumps into its own folder, so the doctor's verdict reads the whole job. The stub `ssh`
//! runs the line on this host with `TMPDIR` set to a folder per host: each "host" has a
//! temporary directory of its own, as on a real cluster.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

fn dumps_in(dir: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for job in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(job.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            names.push(f.file_name().to_string_lossy().into_owned());
        }
    }
    names
}

/// A long psnet-train job (1 server, 2 workers) launched over ssh to the "hosts" h1 and h2
/// (the stub gives each a temporary directory of its own, under `dir`), the launcher's own
/// temporary directory `dir/here`; and a thread collecting its stderr.
fn ssh_job(dir: &Path) -> (std::process::Child, std::thread::JoinHandle<String>) {
    let stub = "#!/bin/sh\nwhile [ \"$1\" = -o ]; do shift 2; done\nhost=$1; shift\n\
                mkdir -p \"@ROOT@/host-$host\"\n\
                TMPDIR=\"@ROOT@/host-$host\" PSNET_TEST_HOST=$host exec setsid --wait sh -c \"$1\"\n"
        .replace("@ROOT@", &dir.display().to_string());
    common::write_exe(dir, "ssh", &stub);
    std::fs::write(dir.join("hosts"), "h1\nh2\n").unwrap();
    let here = dir.join("here");
    std::fs::create_dir_all(&here).unwrap();
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
        .args(["--launcher", "ssh", "-H"])
        .arg(dir.join("hosts"))
        .args(["--root", "127.0.0.1", "-n", "2", "-s", "1", "--"])
        .arg(common::trainer())
        .args(&common::SMALL_MODEL[..10])
        .args(["--epochs", "5000"])
        .env("PATH", common::path_with(dir))
        .env("TMPDIR", &here)
        .env_remove("PSNET_RECORDER_DIR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start psnet-launch");
    let mut stderr = launcher.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut err = String::new();
        let _ = stderr.read_to_string(&mut err);
        err
    });
    (launcher, reader)
}

/// The pid of `worker` once it runs on one of the hosts, or the launcher's stderr in a panic.
fn worker_pid(
    dir: &Path,
    worker: u32,
    launcher: &mut std::process::Child,
    reader: std::thread::JoinHandle<String>,
) -> (i32, std::thread::JoinHandle<String>) {
    let started = Instant::now();
    loop {
        let found = ["h1", "h2"].iter().find_map(|h| {
            common::process_with(&[
                format!("DMLC_WORKER_ID={worker}"),
                format!("TMPDIR={}/host-{h}", dir.display()),
            ])
        });
        if let Some(pid) = found {
            return (pid, reader);
        }
        if started.elapsed() > Duration::from_secs(60) || launcher.try_wait().unwrap().is_some() {
            let _ = launcher.kill();
            let _ = launcher.wait();
            panic!("worker {worker} never ran: {}", reader.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (at most 2 minutes) for the launcher to end.
fn ended(launcher: &mut std::process::Child) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            return s;
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = launcher.kill();
            panic!("the launcher did not end");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn after_a_failed_job_the_dumps_of_other_hosts_are_fetched_and_read() {
    let dir = common::scratch("remote-dumps");
    let (mut launcher, reader) = ssh_job(&dir);
    // Worker 1, on whichever "host" it went to, killed once it trains.
    let (pid, reader) = worker_pid(&dir, 1, &mut launcher, reader);
    std::thread::sleep(Duration::from_secs(2));
    let pid = rustix::process::Pid::from_raw(pid).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    let status = ended(&mut launcher);
    let err = reader.join().unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("flight recorder dumps from h"), "{err}");
    // The dumps written on the other hosts are in the launcher's folder, and read.
    let local = dumps_in(&dir.join("here").join("psnet-recorder"));
    assert!(
        local.iter().any(|n| n.contains("worker")),
        "{local:?}\n{err}"
    );
    let verdict = err
        .split("flight recorder dumps in")
        .nth(1)
        .unwrap_or_else(|| panic!("no verdict: {err}"));
    assert!(
        verdict.contains("kv job: worker 0 sent") && verdict.contains("worker 1"),
        "{verdict}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGUSR1 to the launcher of an ssh job: the processes on the other hosts are asked through
/// ssh (before, the local `ssh` clients were signalled, which kills a real one and its remote
/// command), their dumps are brought here and read, and the job goes on.
#[test]
fn sigusr1_asks_the_processes_on_other_hosts_and_the_job_goes_on() {
    let dir = common::scratch("remote-ask");
    let (mut launcher, reader) = ssh_job(&dir);
    let (_, reader) = worker_pid(&dir, 1, &mut launcher, reader);
    std::thread::sleep(Duration::from_secs(2));
    let me = rustix::process::Pid::from_child(&launcher);
    rustix::process::kill_process(me, rustix::process::Signal::USR1).unwrap();
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        launcher.try_wait().unwrap().is_none(),
        "the job ended when asked for dumps"
    );
    rustix::process::kill_process(me, rustix::process::Signal::TERM).unwrap();
    ended(&mut launcher);
    let err = reader.join().unwrap();
    assert!(
        err.contains("SIGUSR1: asked 1 processes here and every process on 2 other hosts"),
        "{err}"
    );
    assert!(err.contains("flight recorder dumps from h"), "{err}");
    for who in ["worker 0 (pid", "worker 1 (pid", "server 0 (pid"] {
        assert!(err.contains(who), "{who}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
