//! `--launcher ssh` with a stub `ssh` on PATH that runs the remote line on this host, detached
//! from the launcher's process group (`setsid`) as a real remote command is, and a stub
//! `rsync` that records its arguments.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

fn stubs(tag: &str) -> PathBuf {
    let dir = common::scratch(&format!("ssh-{tag}"));
    common::write_exe(
        &dir,
        "ssh",
        "#!/bin/sh\nwhile [ \"$1\" = -o ]; do shift 2; done\nhost=$1; shift\n\
         PSNET_TEST_HOST=$host exec setsid --wait sh -c \"$1\"\n",
    );
    common::write_exe(
        &dir,
        "rsync",
        &format!("#!/bin/sh\necho \"$@\" >> {}/rsync.log\n", dir.display()),
    );
    std::fs::write(dir.join("hosts"), "# two hosts\nh1\nh2 slots=4\n").unwrap();
    dir
}

fn launcher(stubs: &Path, args: &[&str], script: &str) -> Command {
    let path = common::path_with(stubs);
    let hosts = stubs.join("hosts");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_psnet-launch"));
    cmd.args([
        "--launcher",
        "ssh",
        "-H",
        hosts.to_str().unwrap(),
        "--root",
        "127.0.0.1",
    ])
    .args(args)
    .args(["--", "sh", "-c", script])
    .env("PATH", path);
    cmd
}

#[test]
fn servers_then_workers_take_the_hosts_in_turn_and_the_scheduler_stays_here() {
    let dir = stubs("roles");
    let work = dir.join("work dir");
    std::fs::create_dir_all(&work).unwrap();
    let script = r#"echo "$DMLC_ROLE ${DMLC_WORKER_ID:-${DMLC_SERVER_ID:--}} ${PSNET_TEST_HOST:-here} $(basename "$PWD") ${PSNET_TRANSPORT:-}""#;
    let out = launcher(
        &dir,
        &[
            "-n",
            "2",
            "-s",
            "1",
            "--sync-dst-dir",
            work.to_str().unwrap(),
        ],
        script,
    )
    .env("PSNET_TRANSPORT", "tcp")
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim_end().to_string())
        .collect();
    lines.sort();
    let scheduler_dir = std::env::current_dir().unwrap();
    let here = scheduler_dir.file_name().unwrap().to_string_lossy();
    assert_eq!(
        lines,
        [
            format!("[scheduler] scheduler - here {here} tcp"),
            "[server 0] server 0 h1 work dir tcp".to_string(),
            "[worker 0] worker 0 h2 work dir tcp".to_string(),
            "[worker 1] worker 1 h1 work dir tcp".to_string(),
        ]
    );
    let rsync = std::fs::read_to_string(dir.join("rsync.log")).unwrap();
    let w = work.display();
    assert_eq!(
        rsync.lines().collect::<Vec<_>>(),
        [format!("-az ./ h1:{w}"), format!("-az ./ h2:{w}")]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stopping_the_launcher_stops_the_remote_commands() {
    let dir = stubs("stop");
    let pids = dir.join("pids");
    std::fs::create_dir_all(&pids).unwrap();
    // The remote processes start a child each: the watchdog must stop those too. (The local
    // scheduler's own children are its to stop when the launcher is killed outright.)
    let script = format!(
        "echo $$ > {p}/$DMLC_ROLE-$$; [ \"$DMLC_ROLE\" = scheduler ] && exec sleep 120; \
         sleep 120 & echo $! > {p}/child-$DMLC_ROLE-$$; wait",
        p = pids.display()
    );
    let read_pids = || common::pids_in(&pids);
    let alive = common::alive;
    // SIGTERM (passed on) and SIGKILL (the launcher dies outright): the remote side is only
    // reachable through its ssh session either way.
    for sig in [rustix::process::Signal::TERM, rustix::process::Signal::KILL] {
        for e in std::fs::read_dir(&pids).unwrap() {
            let _ = std::fs::remove_file(e.unwrap().path());
        }
        let mut child = launcher(&dir, &["-n", "1", "-s", "1", "--no-prefix"], &script)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while read_pids().len() < 5 {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the job did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Running, and staying so while the launcher runs.
        std::thread::sleep(Duration::from_millis(500));
        for p in read_pids() {
            assert!(
                alive(p),
                "process {p} ended before the launcher was stopped"
            );
        }
        let pid = rustix::process::Pid::from_child(&child);
        rustix::process::kill_process(pid, sig).unwrap();
        child.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while read_pids().into_iter().any(alive) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        for p in read_pids() {
            assert!(!alive(p), "{sig:?}: process {p} outlived the launcher");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_loopback_scheduler_for_remote_hosts_is_refused_saying_what_to_set() {
    let dir = stubs("loopback");
    let out = Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
        .args([
            "--launcher",
            "ssh",
            "-H",
            dir.join("hosts").to_str().unwrap(),
        ])
        .args(["-n", "1", "-s", "1", "--", "true"])
        .env("PATH", common::path_with(&dir))
        .env_remove("DMLC_INTERFACE")
        .env_remove("DMLC_NODE_HOST")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("would listen on 127.0.0.1, which h1, h2 cannot reach")
            && stderr.contains("DMLC_INTERFACE"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_inline_secret_is_refused_over_ssh_naming_the_file_variable() {
    let dir = stubs("secret");
    let out = launcher(&dir, &["-n", "1", "-s", "1"], "true")
        .env("PSNET_SECRET", "tops3cret-value")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("PSNET_SECRET_FILE") && !stderr.contains("tops3cret-value"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
