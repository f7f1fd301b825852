//! `--launcher mpi|slurm` and `--role-from-env`, with stub `mpirun`, `srun` and `scontrol`
//! on PATH that start every rank on this host the way the real ones would (each rank told
//! its number through the launcher's variables).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A directory of stub cluster tools, first on PATH for the commands run with it. One per
/// test: tests run in parallel, and a stub rewritten while another test's shell reads it
/// ran as an empty script (a launch that printed nothing and exited 0).
fn stubs(test: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("psnet-launch-stubs-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ranks = |rank: &str, size: &str, count_flag: &str| {
        format!(
            "#!/bin/sh\nn=1\necho \"$@\" >> \"$(dirname \"$0\")/argv.log\"\n\
             while [ $# -gt 0 ]; do case \"$1\" in {count_flag}) n=$2; shift 2;; --hostfile|-x) shift 2;; *) break;; esac; done\n\
             i=0; pids=\"\"\nwhile [ $i -lt $n ]; do {rank}=$i {size}=$n \"$@\" & pids=\"$pids $!\"; i=$((i+1)); done\n\
             rc=0; for p in $pids; do wait $p || rc=$?; done; exit $rc\n"
        )
    };
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    write(
        "mpirun",
        ranks("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "-np"),
    );
    write("srun", ranks("SLURM_PROCID", "SLURM_NTASKS", "--ntasks"));
    write(
        "scontrol",
        "#!/bin/sh\n[ \"$1 $2\" = \"show hostnames\" ] && printf 'node7\\nnode8\\n'\n".into(),
    );
    dir
}

fn launch(stubs: &Path, args: &[&str], extra_env: &[(&str, &str)]) -> (Vec<String>, String, i32) {
    let path = format!(
        "{}:{}",
        stubs.display(),
        psnet_config::env::harness_var("PATH").unwrap_or_default()
    );
    let script = r#"echo "$DMLC_ROLE ${DMLC_WORKER_ID:-${DMLC_SERVER_ID:--}} $DMLC_PS_ROOT_URI $DMLC_NUM_SERVER $DMLC_NUM_WORKER ${PSNET_TRANSPORT:-} ${EXTRA:-}""#;
    let out = Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
        .args(args)
        .args(["--", "sh", "-c", script])
        .env("PATH", path)
        .envs(extra_env.iter().copied())
        .output()
        .expect("run psnet-launch");
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim_end().to_string())
        .collect();
    lines.sort();
    (
        lines,
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.code().unwrap_or(-1),
    )
}

#[test]
fn mpirun_ranks_become_scheduler_servers_then_workers() {
    let dir = stubs("mpirun_ranks_become_scheduler_servers_then_workers");
    let hostfile = dir.join("hosts");
    std::fs::write(&hostfile, "# job\nhostA slots=2\nhostB slots=2\n").unwrap();
    let (lines, stderr, code) = launch(
        &dir,
        &[
            "--launcher",
            "mpi",
            "-n",
            "2",
            "-s",
            "1",
            "--port",
            "9300",
            "-H",
            hostfile.to_str().unwrap(),
            "--env",
            "EXTRA:x",
        ],
        &[("PSNET_TRANSPORT", "tcp")],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        lines,
        [
            "scheduler - hostA 1 2 tcp x",
            "server 0 hostA 1 2 tcp x",
            "worker 0 hostA 1 2 tcp x",
            "worker 1 hostA 1 2 tcp x",
        ]
    );
}

#[test]
fn srun_tasks_put_the_scheduler_on_the_first_node() {
    let dir = stubs("srun_tasks_put_the_scheduler_on_the_first_node");
    let (lines, stderr, code) = launch(
        &dir,
        &["--launcher", "slurm", "-n", "1", "-s", "2"],
        &[("SLURM_JOB_NODELIST", "node[7-8]")],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        lines,
        [
            "scheduler - node7 2 1",
            "server 0 node7 2 1",
            "server 1 node7 2 1",
            "worker 0 node7 2 1",
        ]
    );
}

#[test]
fn slurm_outside_an_allocation_says_so() {
    let dir = stubs("slurm_outside_an_allocation_says_so");
    let (_, stderr, code) = launch(&dir, &["--launcher", "slurm", "-n", "1"], &[]);
    assert_eq!(code, 1);
    assert!(stderr.contains("inside an allocation"), "{stderr}");
}

#[test]
fn role_from_env_under_a_user_run_mpirun() {
    let dir = stubs("role_from_env_under_a_user_run_mpirun");
    // As a user would: mpirun -np 3 psnet-launch --role-from-env -n 1 -s 1 -- COMMAND.
    let (lines, stderr, code) = launch(
        &dir,
        &["--role-from-env", "-n", "1", "-s", "1"],
        &[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "3"),
            ("DMLC_PS_ROOT_URI", "10.1.2.3"),
            ("DMLC_PS_ROOT_PORT", "9000"),
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(lines, ["worker 0 10.1.2.3 1 1"]);
}

#[test]
fn role_from_env_refuses_a_job_of_the_wrong_size_or_no_rank() {
    let dir = stubs("role_from_env_refuses_a_job_of_the_wrong_size_or_no_rank");
    let env = [
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "5"),
        ("DMLC_PS_ROOT_URI", "10.1.2.3"),
        ("DMLC_PS_ROOT_PORT", "9000"),
    ];
    let (_, stderr, code) = launch(&dir, &["--role-from-env", "-n", "2", "-s", "1"], &env);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("started 5 processes but the job has 4"),
        "{stderr}"
    );
    let (_, stderr, code) = launch(&dir, &["--role-from-env", "-n", "2"], &env[2..]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID, SGE_TASK_ID"),
        "{stderr}"
    );
}

#[test]
fn the_secret_reaches_mpi_ranks_in_their_environment_never_on_a_command_line() {
    let dir = stubs("the_secret_reaches_mpi_ranks_in_their_environment_never_on_a_command_line");
    let _ = std::fs::remove_file(dir.join("argv.log"));
    let (lines, stderr, code) = launch(
        &dir,
        &["--launcher", "mpi", "-n", "1", "-s", "1", "--port", "9301"],
        &[
            ("PSNET_SECRET", "tops3cret-value"),
            ("PSNET_TRANSPORT", "tcp"),
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(lines.len(), 3, "{lines:?}");
    let argv = std::fs::read_to_string(dir.join("argv.log")).unwrap();
    assert!(argv.contains("-x PSNET_SECRET"), "{argv}");
    assert!(
        !argv.contains("tops3cret-value"),
        "the secret is on mpirun's command line: {argv}"
    );
    assert!(!stderr.contains("tops3cret-value"), "{stderr}");
}
