//! What the launcher's end-to-end tests share: scratch directories, stand-in programs on
//! PATH, the pids a job's processes record, and psnet-train built beside psnet-launch.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// An empty scratch directory for one test.
pub fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("psnet-launch-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes an executable `name` into `dir`.
pub fn write_exe(dir: &Path, name: &str, text: &str) {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// PATH with `dir` first (its stand-ins win).
pub fn path_with(dir: &Path) -> String {
    format!(
        "{}:{}",
        dir.display(),
        psnet_config::env::harness_var("PATH").unwrap_or_default()
    )
}

/// The pids a job's processes wrote, one file each, into `dir`.
pub fn pids_in(dir: &Path) -> Vec<i32> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
                .filter_map(|s| s.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether process `pid` runs (a zombie does not).
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// Waits up to `limit` for `done`, panicking with `what` after that.
pub fn wait_for(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts that none of the processes that recorded their pids in `dir` runs any more,
/// giving them `limit` to go.
pub fn assert_all_gone(dir: &Path, limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    while pids_in(dir).into_iter().any(alive) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in pids_in(dir) {
        assert!(!alive(pid), "{what}: process {pid} outlived the launcher");
    }
}

/// Stand-ins for `qsub` / `qstat` / `qdel` in `dir`: qsub runs the array's tasks on this
/// host with the batch system's variable set (`-terse`: Grid Engine's SGE_TASK_ID; `-J`: PBS
/// Pro's PBS_ARRAY_INDEX; else Torque's PBS_ARRAYID), records its arguments in qsub.args and
/// the tasks' pids in tasks.pids; qstat knows the job while a task runs; qdel records its
/// arguments in qdel.log and stops the tasks.
pub fn batch_stand_ins(dir: &Path) {
    let d = dir.display();
    write_exe(
        dir,
        "qsub",
        &format!(
            "#!/bin/sh\necho \"$*\" > {d}/qsub.args\nn=1; var=PBS_ARRAYID; id='4242[].stub'\n\
             while [ $# -gt 0 ]; do case \"$1\" in\n\
               -terse) var=SGE_TASK_ID; id=4242.1-N:1; shift;;\n\
               -t) n=${{2#1-}}; shift 2;;\n\
               -J) n=${{2#1-}}; var=PBS_ARRAY_INDEX; shift 2;;\n\
               -N|-o|-e|-q|-S) shift 2;;\n\
               *) shift;; esac; done\n\
             cat > {d}/task.sh\ni=1\nwhile [ $i -le $n ]; do\n\
               env $var=$i sh {d}/task.sh > {d}/task.$i.log 2>&1 &\n\
               echo $! >> {d}/tasks.pids; i=$((i+1)); done\necho \"$id\"\n"
        ),
    );
    write_exe(
        dir,
        "qstat",
        &format!(
            "#!/bin/sh\nfor p in $(cat {d}/tasks.pids 2>/dev/null); do kill -0 $p 2>/dev/null && exit 0; done\nexit 1\n"
        ),
    );
    write_exe(
        dir,
        "qdel",
        &format!(
            "#!/bin/sh\necho \"$*\" >> {d}/qdel.log\nfor p in $(cat {d}/tasks.pids); do kill -TERM $p 2>/dev/null; done\nexit 0\n"
        ),
    );
}

/// psnet-train, built beside psnet-launch (`cargo test --workspace` builds it; otherwise it
/// is built here).
pub fn trainer() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_psnet-launch")).with_file_name("psnet-train");
    if !path.exists() {
        let cargo = psnet_config::env::harness_var("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "psnet-train"])
            .status()
            .expect("run cargo build -p psnet-train");
        assert!(status.success(), "cargo build -p psnet-train failed");
    }
    path
}

/// A small perceptron psnet-train trains in a second or two, and its single-process
/// reference weights.
pub const SMALL_MODEL: [&str; 12] = [
    "--hidden",
    "16",
    "--features",
    "20",
    "--classes",
    "5",
    "--samples",
    "1024",
    "--batch",
    "16",
    "--epochs",
    "2",
];

/// The reference weights of [`SMALL_MODEL`] with two workers, written into `dir`.
pub fn reference_weights(dir: &Path) -> Vec<u8> {
    let path = dir.join("reference.bin");
    let out = Command::new(trainer())
        .args(SMALL_MODEL)
        .args(["--workers", "2", "--reference", "--dump"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&path).unwrap()
}

/// The pid of the process whose environment holds every one of `marks`, if one runs.
pub fn process_with(marks: &[String]) -> Option<i32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
        if marks.iter().all(|m| vars.contains(&m.as_bytes())) {
            return Some(pid);
        }
    }
    None
}
