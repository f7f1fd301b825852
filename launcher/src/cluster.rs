//! Jobs across hosts through a cluster's own launcher, as MXNet's `launch.py --launcher
//! mpi|slurm` does: one `mpirun` or `srun` starts `1 + servers + workers` copies of
//! `psnet-launch --role-from-env`, and each copy takes its role from its rank (0: the
//! scheduler, then the servers, then the workers) and becomes the job's command (`exec`).
//! The same mapping serves users who run `mpirun` or `srun` themselves.

use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus};

use psnet_config::env;
use psnet_config::rank;

use crate::{process_env, JobSpec, LaunchError, Role};

/// This process's rank and the number of processes, from the first rank variable set, and
/// the variable's name.
pub fn rank_from_env() -> Result<(u32, Option<u32>, &'static str), LaunchError> {
    match rank::first_rank(|v| v.get(), &rank::ROLE_FROM_ENV) {
        Ok(Some(found)) => Ok((found.rank, found.size, found.vars.rank.name)),
        Ok(None) => Err(LaunchError::Invalid(format!(
            "--role-from-env: none of {} is set; run it under mpirun, srun or an array job, \
             or use psnet-launch's own launchers",
            rank::names(&rank::ROLE_FROM_ENV).join(", ")
        ))),
        Err(e) => Err(LaunchError::Invalid(format!("--role-from-env: {e}"))),
    }
}

/// The role and index of rank `rank` in a job of `servers` and `workers`: rank 0 is the
/// scheduler, ranks 1..=servers the servers, the rest the workers.
pub fn role_of(rank: u32, servers: u32, workers: u32) -> Result<(Role, u32), LaunchError> {
    let total = 1 + u64::from(servers) + u64::from(workers);
    match rank {
        0 => Ok((Role::Scheduler, 0)),
        r if r <= servers => Ok((Role::Server, r - 1)),
        r if u64::from(r) < total => Ok((Role::Worker, r - 1 - servers)),
        r => Err(LaunchError::Invalid(format!(
            "rank {r} is beyond the job: it has {total} processes (1 scheduler, {servers} \
             servers, {workers} workers); start exactly {total}"
        ))),
    }
}

/// Under mpirun or srun: becomes this rank's process of the job (`exec`); returns only on
/// failure.
pub fn exec_role_from_env(spec: &JobSpec) -> LaunchError {
    let (rank, size, var) = match rank_from_env() {
        Ok(r) => r,
        Err(e) => return e,
    };
    let total = 1 + spec.servers + spec.workers;
    if let Some(n) = size.filter(|&n| n != total) {
        return LaunchError::Invalid(format!(
            "{var}: the launcher started {n} processes but the job has {total} (1 scheduler, \
             {} servers, {} workers)",
            spec.servers, spec.workers
        ));
    }
    let (role, index) = match role_of(rank, spec.servers, spec.workers) {
        Ok(r) => r,
        Err(e) => return e,
    };
    if spec.root_port == 0 {
        return LaunchError::Invalid(
            "--role-from-env needs the scheduler's port: --port or DMLC_PS_ROOT_PORT".into(),
        );
    }
    let Some(program) = spec.command.first() else {
        return LaunchError::Invalid("no command to launch".into());
    };
    let err = Command::new(program)
        .args(&spec.command[1..])
        .envs(process_env(spec, role, index, spec.root_port))
        .exec();
    LaunchError::Spawn {
        role,
        index,
        program: program.clone(),
        source: err,
    }
}

/// Variables never written into a command line or a job description, where other users
/// could read them: their values are secrets. They travel only in the environment itself
/// (local processes, `srun`, `mpirun -x`, `qsub -V`); ssh and YARN launches refuse them
/// ([`refuse_inline_secret`]), `PSNET_SECRET_FILE` works everywhere.
pub const NOT_FORWARDED: &[&str] = &["PSNET_SECRET"];

/// The variables every process of a multi-host job is given from the launcher's environment:
/// the interface choice and every `PS_*`, `PSNET_*` and `MXNET_KVSTORE_*` setting but the
/// secret ([`NOT_FORWARDED`]); a process's own `DMLC_NODE_HOST` stays its own.
pub fn forwarded_env() -> Vec<(String, String)> {
    env::ALL
        .iter()
        .filter(|v| !NOT_FORWARDED.contains(&v.name))
        .filter(|v| {
            v.name == "DMLC_INTERFACE"
                || v.name == "RUST_LOG"
                || ["PS_", "PSNET_", "MXNET_KVSTORE_"]
                    .iter()
                    .any(|p| v.name.starts_with(p))
        })
        .filter_map(|v| v.get().map(|value| (v.name.to_string(), value)))
        .collect()
}

/// The inner `psnet-launch --role-from-env` command line every rank runs.
pub(crate) fn inner_command(spec: &JobSpec, launcher: &str) -> Vec<String> {
    let mut args = vec![
        launcher.to_string(),
        "--role-from-env".into(),
        "-n".into(),
        spec.workers.to_string(),
        "-s".into(),
        spec.servers.to_string(),
        "--root".into(),
        spec.root_host.clone(),
        "--port".into(),
        spec.root_port.to_string(),
    ];
    for (k, v) in forwarded_env().into_iter().chain(spec.env.iter().cloned()) {
        args.push("--env".into());
        args.push(format!("{k}={v}"));
    }
    args.push("--".into());
    args.extend(spec.command.iter().cloned());
    args
}

/// Refuses a launch that would have to write `PSNET_SECRET` where others can read it (`how`:
/// an ssh command line, a YARN submission).
pub fn refuse_inline_secret(how: &str) -> Result<(), LaunchError> {
    if env::PSNET_SECRET.is_set() {
        return Err(LaunchError::Invalid(format!(
            "PSNET_SECRET is set, but {how} would carry it where other users can read it: put \
             the secret in a file every host can read (chmod 600) and set PSNET_SECRET_FILE \
             instead"
        )));
    }
    Ok(())
}

/// `mpirun -np N [--hostfile H] psnet-launch --role-from-env ...`. The scheduler is rank 0,
/// which mpirun places on the hostfile's first host: `spec.root_host` must be that host.
/// `PSNET_SECRET` goes with `-x` (in mpirun's environment, not on a command line).
pub fn mpirun_command(spec: &JobSpec, hostfile: Option<&str>, launcher: &str) -> Vec<String> {
    let mut cmd = vec![
        "mpirun".to_string(),
        "-np".into(),
        (1 + spec.servers + spec.workers).to_string(),
    ];
    if let Some(h) = hostfile {
        cmd.push("--hostfile".into());
        cmd.push(h.into());
    }
    for name in NOT_FORWARDED {
        if env::ALL.iter().any(|v| v.name == *name && v.is_set()) {
            cmd.push("-x".into());
            cmd.push((*name).into());
        }
    }
    cmd.extend(inner_command(spec, launcher));
    cmd
}

/// `srun --ntasks N psnet-launch --role-from-env ...`; the scheduler is task 0, on the
/// allocation's first node: `spec.root_host` must be that node. srun passes the caller's
/// environment (`--export=ALL`, its default), `PSNET_SECRET` with it.
pub fn srun_command(spec: &JobSpec, launcher: &str) -> Vec<String> {
    let mut cmd = vec![
        "srun".to_string(),
        "--ntasks".into(),
        (1 + spec.servers + spec.workers).to_string(),
    ];
    cmd.extend(inner_command(spec, launcher));
    cmd
}

/// The first host of an Open MPI hostfile (`host slots=N`, `host:N` or `host` per line;
/// comments and blank lines skipped).
pub fn first_host_of_hostfile(text: &str) -> Option<String> {
    crate::ssh::hosts_of_hostfile(text).into_iter().next()
}

/// The first node of the Slurm allocation (`scontrol show hostnames $SLURM_JOB_NODELIST`).
pub fn first_slurm_node() -> Result<String, LaunchError> {
    let Some(list) = env::SLURM_JOB_NODELIST.get() else {
        return Err(LaunchError::Invalid(
            "--launcher slurm: SLURM_JOB_NODELIST is not set; run psnet-launch inside an \
             allocation (salloc or sbatch)"
                .into(),
        ));
    };
    let out = Command::new("scontrol")
        .args(["show", "hostnames", &list])
        .output()
        .map_err(|e| LaunchError::Invalid(format!("scontrol show hostnames {list}: {e}")))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
        .ok_or_else(|| {
            LaunchError::Invalid(format!("scontrol show hostnames {list} named no node"))
        })
}

/// Runs `cmd` (mpirun or srun) in a process group of its own, passing SIGINT / SIGTERM /
/// SIGHUP on to it, and returns its exit status and the signal that stopped the job, if any.
pub fn run_cluster_launcher(cmd: &[String]) -> Result<(ExitStatus, Option<i32>), LaunchError> {
    let Some(program) = cmd.first() else {
        return Err(LaunchError::Invalid("no command".into()));
    };
    let signals = crate::StopSignals::install()?;
    let mut command = Command::new(program);
    command.args(&cmd[1..]).process_group(0);
    crate::sys::die_with_launcher(&mut command);
    let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
        role: Role::Scheduler,
        index: 0,
        program: program.clone(),
        source,
    })?;
    let mut signal = None;
    let mut kill_at: Option<std::time::Instant> = None;
    loop {
        if let Some(status) = child.try_wait().map_err(LaunchError::Wait)? {
            return Ok((status, signal));
        }
        if let Some(sig) = signals.caught() {
            if signal.is_none() {
                // SIGTERM whatever the signal: srun answers one SIGINT with a status report
                // only; both it and mpirun pass SIGTERM on to every rank on every host.
                signal = Some(sig);
                crate::signal_group(&child, rustix::process::Signal::TERM);
                kill_at = Some(std::time::Instant::now() + crate::SIGNAL_GRACE);
            }
        }
        if kill_at.is_some_and(|t| std::time::Instant::now() >= t) {
            crate::signal_group(&child, rustix::process::Signal::KILL);
            kill_at = None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_map_to_scheduler_then_servers_then_workers() {
        assert_eq!(role_of(0, 2, 3).unwrap(), (Role::Scheduler, 0));
        assert_eq!(role_of(1, 2, 3).unwrap(), (Role::Server, 0));
        assert_eq!(role_of(2, 2, 3).unwrap(), (Role::Server, 1));
        assert_eq!(role_of(3, 2, 3).unwrap(), (Role::Worker, 0));
        assert_eq!(role_of(5, 2, 3).unwrap(), (Role::Worker, 2));
        let err = role_of(6, 2, 3).unwrap_err().to_string();
        assert!(err.contains("start exactly 6"), "{err}");
    }

    #[test]
    fn cluster_command_lines_carry_the_job() {
        let mut spec = JobSpec::new(1, 2, vec!["train".into(), "--epochs".into(), "3".into()]);
        spec.root_host = "node1".into();
        spec.root_port = 9091;
        spec.env.push(("PSNET_TRANSPORT".into(), "tcp".into()));
        let mpi = mpirun_command(&spec, Some("hosts"), "/opt/psnet-launch");
        let joined = mpi.join(" ");
        assert!(
            joined.starts_with("mpirun -np 4 --hostfile hosts /opt/psnet-launch --role-from-env -n 2 -s 1 --root node1 --port 9091"),
            "{joined}"
        );
        assert!(joined.contains("--env PSNET_TRANSPORT=tcp"), "{joined}");
        assert!(joined.ends_with("-- train --epochs 3"), "{joined}");
        let srun = srun_command(&spec, "psnet-launch").join(" ");
        assert!(
            srun.starts_with("srun --ntasks 4 psnet-launch --role-from-env"),
            "{srun}"
        );
    }

    #[test]
    fn the_first_host_of_a_hostfile() {
        let text = "# the job\n\n node1 slots=4\nnode2:2\n";
        assert_eq!(first_host_of_hostfile(text).as_deref(), Some("node1"));
        assert_eq!(first_host_of_hostfile("a:8\n").as_deref(), Some("a"));
        assert_eq!(first_host_of_hostfile("# none\n"), None);
    }
}
