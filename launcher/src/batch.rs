//! `--launcher sge|pbs`, as MXNet's `launch.py --launcher sge`: the scheduler runs where the
//! launcher runs; the servers and workers are one array job of `servers + workers` tasks
//! (`qsub -t 1-N` on Grid Engine and Torque, `qsub -J 1-N` on PBS Pro), each running
//! `psnet-launch --role-from-env`, which takes task `i` as rank `i` (1 the first server).
//!
//! The job ends with the scheduler: 0 when every worker finished. The launcher cancels the
//! array job (`qdel`) when the scheduler fails, on SIGINT / SIGTERM / SIGHUP, and when the
//! batch system no longer knows the job while the scheduler still waits (a task that died
//! before joining).

use std::io::Write;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::ssh::shell_quote;
use crate::{JobSpec, LaunchError};

/// The batch system.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchSystem {
    /// Sun / Son of / Univa Grid Engine (`qsub -t`, `SGE_TASK_ID`).
    Sge,
    /// PBS Pro / OpenPBS (`qsub -J`, `PBS_ARRAY_INDEX`).
    PbsPro,
    /// Torque (`qsub -t`, `PBS_ARRAYID`).
    Torque,
}

impl BatchSystem {
    /// The name users know it by.
    pub fn name(self) -> &'static str {
        match self {
            BatchSystem::Sge => "Grid Engine",
            BatchSystem::PbsPro => "PBS Pro",
            BatchSystem::Torque => "Torque",
        }
    }
}

/// What an array job needs beyond the job itself.
#[derive(Clone, Debug)]
pub struct BatchJob {
    /// The batch system.
    pub system: BatchSystem,
    /// The job's name (`-N`).
    pub name: String,
    /// Extra `qsub` arguments (`--sge-args` / `--pbs-args`: queue, parallel environment...).
    pub extra: Vec<String>,
    /// Where the tasks run and write their logs (the launcher's directory).
    pub dir: String,
    /// The `psnet-launch` each task runs (`--role-from-env`).
    pub launcher: String,
    /// How often the batch system is asked whether the job still exists.
    pub poll: Duration,
}

/// `qsub`'s arguments for `tasks` array tasks (the script comes on its standard input).
pub fn qsub_args(job: &BatchJob, tasks: u32) -> Vec<String> {
    let range = format!("1-{tasks}");
    let mut args: Vec<String> = match job.system {
        // -terse: only the job id on stdout; $TASK_ID is Grid Engine's own placeholder.
        BatchSystem::Sge => vec![
            "-terse".into(),
            // The script's own shell, whatever the queue's shell_start_mode.
            "-S".into(),
            "/bin/sh".into(),
            "-t".into(),
            range,
            "-cwd".into(),
            "-V".into(),
            "-N".into(),
            job.name.clone(),
            "-o".into(),
            format!("{}/{}.o$TASK_ID", job.dir, job.name),
            "-e".into(),
            format!("{}/{}.e$TASK_ID", job.dir, job.name),
        ],
        BatchSystem::PbsPro | BatchSystem::Torque => vec![
            if job.system == BatchSystem::PbsPro {
                "-J"
            } else {
                "-t"
            }
            .into(),
            range,
            "-V".into(),
            "-N".into(),
            job.name.clone(),
            "-o".into(),
            job.dir.clone(),
            "-e".into(),
            job.dir.clone(),
        ],
    };
    args.extend(job.extra.iter().cloned());
    args
}

/// The script each array task runs.
pub fn task_script(spec: &JobSpec, job: &BatchJob) -> String {
    let cmd: Vec<String> = crate::cluster::inner_command(spec, &job.launcher)
        .iter()
        .map(|a| shell_quote(a))
        .collect();
    // qsub -V hands the tasks the launcher's environment: its DMLC_NODE_HOST is the submit
    // host's address, not theirs (a --env value still arrives through the arguments).
    format!(
        "#!/bin/sh\n# psnet job {}: task i is rank i (1 the first server)\nunset DMLC_NODE_HOST\ncd {} || exit 1\nexec {}\n",
        job.name,
        shell_quote(&job.dir),
        cmd.join(" ")
    )
}

/// The job id in `qsub`'s answer (Grid Engine's `-terse` `123.1-4:1` is job 123; PBS's
/// `123[].server` is used whole).
pub fn job_id(system: BatchSystem, stdout: &str) -> Option<String> {
    let first = stdout.split_whitespace().next()?;
    let id = match system {
        BatchSystem::Sge => first.split('.').next().unwrap_or(first),
        BatchSystem::PbsPro | BatchSystem::Torque => first,
    };
    (!id.is_empty()).then(|| id.to_string())
}

/// How a batch job ended.
#[derive(Debug)]
pub struct BatchOutcome {
    /// The array job's id.
    pub job_id: String,
    /// The scheduler's exit status (None: the launcher stopped it).
    pub scheduler: Option<ExitStatus>,
    /// The signal that stopped the job, if one did.
    pub signal: Option<i32>,
    /// Why the job failed, in one line, if it did.
    pub failure: Option<String>,
}

fn qsub_missing(system: BatchSystem, e: &std::io::Error) -> LaunchError {
    LaunchError::Invalid(format!(
        "--launcher {}: cannot run qsub ({e}): run psnet-launch on a {} submit host, with \
         its client commands (qsub, qstat, qdel) on PATH",
        if system == BatchSystem::Sge {
            "sge"
        } else {
            "pbs"
        },
        system.name()
    ))
}

/// Whether the batch system still knows job `id` (`qstat` answers for it).
fn job_known(system: BatchSystem, id: &str) -> bool {
    let mut cmd = Command::new("qstat");
    match system {
        BatchSystem::Sge => cmd.args(["-j", id]),
        BatchSystem::PbsPro => cmd.args(["-t", id]),
        BatchSystem::Torque => cmd.arg(id),
    };
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    // A batch system that does not answer in time counts as not knowing the job.
    status_within(&mut cmd, Duration::from_secs(10)).is_ok_and(|s| s.success())
}

fn qdel(id: &str) {
    match status_within(Command::new("qdel").arg(id), Duration::from_secs(30)) {
        Ok(s) if s.success() => {}
        Ok(s) => eprintln!("psnet-launch: qdel {id} failed ({s}); cancel the job by hand"),
        Err(e) => eprintln!("psnet-launch: qdel {id}: {e}; cancel the job by hand"),
    }
}

/// Runs `cmd` and waits at most `limit` for it (a hung batch client must not hold the
/// launcher, which still has signals to answer); killed after that.
fn status_within(cmd: &mut Command, limit: Duration) -> std::io::Result<ExitStatus> {
    let mut child = cmd.spawn()?;
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {limit:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the job: the scheduler here, the servers and workers as one array job.
pub fn launch_batch(spec: &JobSpec, job: &BatchJob) -> Result<BatchOutcome, LaunchError> {
    if spec.command.is_empty() {
        return Err(LaunchError::Invalid("no command to launch".into()));
    }
    // Checked before anything starts.
    let found = Command::new("sh")
        .args(["-c", "command -v qsub"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        return Err(qsub_missing(
            job.system,
            &std::io::Error::new(std::io::ErrorKind::NotFound, "not on PATH"),
        ));
    }
    let port = if spec.root_port == 0 {
        crate::free_port(&spec.root_host)?
    } else {
        spec.root_port
    };
    let mut spec = crate::queued(spec);
    spec.root_port = port;
    let signals = crate::StopSignals::install()?;
    let mut scheduler = crate::spawn_local_scheduler(&spec, port)?;
    let stop_scheduler = crate::stop_local_scheduler;

    let tasks = spec.servers + spec.workers;
    let submitted = Command::new("qsub")
        .args(qsub_args(job, tasks))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            if let Some(mut stdin) = child.stdin.take() {
                stdin.write_all(task_script(&spec, job).as_bytes())?;
            }
            child.wait_with_output()
        });
    let out = match submitted {
        Ok(out) => out,
        Err(e) => {
            stop_scheduler(&mut scheduler);
            return Err(qsub_missing(job.system, &e));
        }
    };
    let id = match job_id(job.system, &String::from_utf8_lossy(&out.stdout)) {
        Some(id) if out.status.success() => id,
        _ => {
            stop_scheduler(&mut scheduler);
            return Err(LaunchError::Invalid(format!(
                "qsub refused the array job ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    };
    eprintln!(
        "psnet-launch: {} array job {id}: {tasks} tasks ({} servers, {} workers); the \
         scheduler runs here on {}:{port}; task logs in {}",
        job.system.name(),
        spec.servers,
        spec.workers,
        spec.root_host,
        job.dir
    );

    let mut next_poll = Instant::now() + job.poll;
    let mut gone_since: Option<Instant> = None;
    loop {
        if let Some(status) = scheduler.try_wait().map_err(LaunchError::Wait)? {
            let failure = (!status.success()).then(|| {
                qdel(&id);
                format!(
                    "the scheduler ended with {status}: a process of the job failed (the task \
                     logs in {} say which); array job {id} cancelled",
                    job.dir
                )
            });
            return Ok(BatchOutcome {
                job_id: id,
                scheduler: Some(status),
                signal: None,
                failure,
            });
        }
        if let Some(sig) = signals.caught() {
            qdel(&id);
            stop_scheduler(&mut scheduler);
            return Ok(BatchOutcome {
                job_id: id.clone(),
                scheduler: None,
                signal: Some(sig),
                failure: Some(format!("stopped by signal {sig}; array job {id} cancelled")),
            });
        }
        if Instant::now() >= next_poll {
            next_poll = Instant::now() + job.poll;
            if job_known(job.system, &id) {
                gone_since = None;
            } else if gone_since.get_or_insert_with(Instant::now).elapsed() >= spec.grace {
                // Every task ended, yet the scheduler still waits: some never joined. (Or
                // qstat cannot reach the batch system: cancel, so nothing is left queued.)
                qdel(&id);
                stop_scheduler(&mut scheduler);
                return Ok(BatchOutcome {
                    job_id: id.clone(),
                    scheduler: None,
                    signal: None,
                    failure: Some(format!(
                        "array job {id} ended but the job did not: a task failed before it \
                         joined (its log in {} says why)",
                        job.dir
                    )),
                });
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(system: BatchSystem) -> BatchJob {
        BatchJob {
            system,
            name: "psnet-7".into(),
            extra: vec!["-q".into(), "gpu.q".into()],
            dir: "/home/me/run".into(),
            launcher: "/opt/psnet-launch".into(),
            poll: Duration::from_secs(2),
        }
    }

    #[test]
    fn qsub_lines_per_batch_system() {
        let sge = qsub_args(&job(BatchSystem::Sge), 4).join(" ");
        assert_eq!(
            sge,
            "-terse -S /bin/sh -t 1-4 -cwd -V -N psnet-7 -o /home/me/run/psnet-7.o$TASK_ID -e /home/me/run/psnet-7.e$TASK_ID -q gpu.q"
        );
        let pro = qsub_args(&job(BatchSystem::PbsPro), 4).join(" ");
        assert!(pro.starts_with("-J 1-4 -V -N psnet-7"), "{pro}");
        let torque = qsub_args(&job(BatchSystem::Torque), 4).join(" ");
        assert!(torque.starts_with("-t 1-4 -V"), "{torque}");
    }

    #[test]
    fn job_ids_from_qsub() {
        assert_eq!(
            job_id(BatchSystem::Sge, "123.1-4:1\n").as_deref(),
            Some("123")
        );
        assert_eq!(
            job_id(BatchSystem::PbsPro, "456[].pbs01\n").as_deref(),
            Some("456[].pbs01")
        );
        assert_eq!(job_id(BatchSystem::Torque, "\n"), None);
    }

    #[test]
    fn the_task_script_runs_the_launcher_in_role_from_env_mode() {
        let mut spec = JobSpec::new(2, 2, vec!["train".into(), "--epochs".into(), "2".into()]);
        spec.root_host = "10.0.0.1".into();
        spec.root_port = 9123;
        let script = task_script(&spec, &job(BatchSystem::Sge));
        assert!(script.starts_with("#!/bin/sh\n"), "{script}");
        assert!(script.contains("cd /home/me/run || exit 1\n"), "{script}");
        assert!(
            script.contains("unset DMLC_NODE_HOST\n"),
            "the submit host's address is not the task's: {script}"
        );
        assert!(
            script.contains(
                "exec /opt/psnet-launch --role-from-env -n 2 -s 2 --root 10.0.0.1 --port 9123"
            ),
            "{script}"
        );
        assert!(
            script.trim_end().ends_with("-- train --epochs 2"),
            "{script}"
        );
    }
}
