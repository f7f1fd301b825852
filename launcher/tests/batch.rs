//! `--launcher sge|pbs` against stand-ins on PATH: a `qsub` that runs the array's tasks on
//! this host with the batch system's variable set (`SGE_TASK_ID`, `PBS_ARRAY_INDEX`,
//! `PBS_ARRAYID`), a `qstat` that knows the job while a task runs, and a `qdel` that records
//! the cancellation and stops the tasks.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn stubs(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("psnet-batch-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.display();
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    write(
        "qsub",
        format!(
            "#!/bin/sh\necho \"$*\" > {d}/qsub.args\nn=1; var=PBS_ARRAYID; id='4242[].stub'\n\
             while [ $# -gt 0 ]; do case \"$1\" in\n\
               -terse) var=SGE_TASK_ID; id=4242.1-N:1; shift;;\n\
               -t) n=${{2#1-}}; shift 2;;\n\
               -J) n=${{2#1-}}; var=PBS_ARRAY_INDEX; shift 2;;\n\
               -N|-o|-e|-q) shift 2;;\n\
               *) shift;; esac; done\n\
             cat > {d}/task.sh\ni=1\nwhile [ $i -le $n ]; do\n\
               env $var=$i sh {d}/task.sh > {d}/task.$i.log 2>&1 &\n\
               echo $! >> {d}/tasks.pids; i=$((i+1)); done\necho \"$id\"\n"
        ),
    );
    write(
        "qstat",
        format!(
            "#!/bin/sh\nfor p in $(cat {d}/tasks.pids 2>/dev/null); do kill -0 $p 2>/dev/null && exit 0; done\nexit 1\n"
        ),
    );
    write(
        "qdel",
        format!(
            "#!/bin/sh\necho \"$*\" >> {d}/qdel.log\nfor p in $(cat {d}/tasks.pids); do kill -TERM $p 2>/dev/null; done\nexit 0\n"
        ),
    );
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
    let path = format!(
        "{}:{}",
        dir.display(),
        psnet_config::env::harness_var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_psnet-launch"));
    cmd.args(args)
        .args([
            "-n", "2", "-s", "2", "--grace", "1", "--", "sh", "-c", script,
        ])
        .env("PATH", path)
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
            "-terse -t 1-4",
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
    let mut child = launcher(&dir, &["--launcher", "pbs"], &job(&dir, "exec sleep 60"))
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
    let dir = std::env::temp_dir().join(format!("psnet-batch-none-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
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
}
