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

#[test]
fn after_a_failed_job_the_dumps_of_other_hosts_are_fetched_and_read() {
    let dir = common::scratch("remote-dumps");
    let stub = "#!/bin/sh\nwhile [ \"$1\" = -o ]; do shift 2; done\nhost=$1; shift\n\
                mkdir -p \"@ROOT@/host-$host\"\n\
                TMPDIR=\"@ROOT@/host-$host\" PSNET_TEST_HOST=$host exec setsid --wait sh -c \"$1\"\n"
        .replace("@ROOT@", &dir.display().to_string());
    common::write_exe(&dir, "ssh", &stub);
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
        .env("PATH", common::path_with(&dir))
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
    // Worker 1, on whichever "host" it went to, killed once it trains.
    let started = Instant::now();
    let target = loop {
        let found = ["h1", "h2"].iter().find_map(|h| {
            common::process_with(&[
                "DMLC_WORKER_ID=1".to_string(),
                format!("TMPDIR={}/host-{h}", dir.display()),
            ])
        });
        if let Some(pid) = found {
            break pid;
        }
        if started.elapsed() > Duration::from_secs(60) || launcher.try_wait().unwrap().is_some() {
            let _ = launcher.kill();
            let _ = launcher.wait();
            panic!("worker 1 never ran: {}", reader.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_secs(2));
    let pid = rustix::process::Pid::from_raw(target).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = launcher.kill();
            panic!("the launcher did not end after worker 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let err = reader.join().unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("flight recorder dumps from h"), "{err}");
    // The dumps written on the other hosts are in the launcher's folder, and read.
    let local = dumps_in(&here.join("psnet-recorder"));
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
