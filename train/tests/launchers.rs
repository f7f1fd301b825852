//! A 2-server, 2-worker training job through `psnet-launch --launcher sge` and `pbs`, with
//! stand-ins for `qsub` / `qstat` / `qdel` that run the array tasks on this host: the job
//! succeeds and its weights are the single-process reference's, bit for bit.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// psnet-launch, built beside psnet-train (`cargo test --workspace` builds it; a lone
/// `cargo test -p psnet-train` builds it here).
fn launcher() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_psnet-train")).with_file_name("psnet-launch");
    if !path.exists() {
        let cargo = psnet::config::env::harness_var("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "psnet-launch"])
            .status()
            .expect("run cargo build -p psnet-launch");
        assert!(status.success(), "cargo build -p psnet-launch failed");
    }
    path
}

fn stand_ins(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("psnet-train-{tag}-{}", std::process::id()));
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
            "#!/bin/sh\nn=1; var=PBS_ARRAYID; id='77[].stub'\n\
             while [ $# -gt 0 ]; do case \"$1\" in\n\
               -terse) var=SGE_TASK_ID; id=77.1-N:1; shift;;\n\
               -t) n=${{2#1-}}; shift 2;;\n\
               -J) n=${{2#1-}}; var=PBS_ARRAY_INDEX; shift 2;;\n\
               -N|-o|-e) shift 2;;\n\
               *) shift;; esac; done\n\
             cat > {d}/task.sh\ni=1\nwhile [ $i -le $n ]; do\n\
               env $var=$i sh {d}/task.sh > {d}/task.$i.log 2>&1 &\n\
               echo $! >> {d}/tasks.pids; i=$((i+1)); done\necho \"$id\"\n"
        ),
    );
    write(
        "qstat",
        format!("#!/bin/sh\nfor p in $(cat {d}/tasks.pids 2>/dev/null); do kill -0 $p 2>/dev/null && exit 0; done\nexit 1\n"),
    );
    write(
        "qdel",
        format!("#!/bin/sh\necho \"$*\" >> {d}/qdel.log\nfor p in $(cat {d}/tasks.pids); do kill -TERM $p 2>/dev/null; done\n"),
    );
    dir
}

const MODEL: [&str; 12] = [
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

#[test]
fn training_through_grid_engine_and_pbs_matches_the_reference() {
    let launch = launcher();
    let train = env!("CARGO_BIN_EXE_psnet-train");
    let reference = std::env::temp_dir().join(format!("psnet-ref-{}.bin", std::process::id()));
    let out = Command::new(train)
        .args(MODEL)
        .args(["--workers", "2", "--reference", "--dump"])
        .arg(&reference)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = std::fs::read(&reference).unwrap();
    for (tag, args) in [
        ("sge", vec!["--launcher", "sge"]),
        ("pbs", vec!["--launcher", "pbs"]),
    ] {
        let dir = stand_ins(tag);
        let path = format!(
            "{}:{}",
            dir.display(),
            psnet::config::env::harness_var("PATH").unwrap_or_default()
        );
        let weights = dir.join("w.bin");
        let out = Command::new(&launch)
            .args(&args)
            .args(["-n", "2", "-s", "2", "--", train])
            .args(MODEL)
            .arg("--dump")
            .arg(&weights)
            .env("PATH", path)
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
    let _ = std::fs::remove_file(&reference);
}
