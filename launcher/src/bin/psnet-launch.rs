//! `psnet-launch -n WORKERS [-s SERVERS] [--launcher local|ssh|mpi|slurm|sge|pbs|yarn] [-H HOSTFILE]
//! [--env NAME=VALUE]... -- COMMAND [ARGS...]`: runs a psnet job, as MXNet's
//! `tools/launch.py` does; `--role-from-env` is the per-rank side under mpirun or srun.
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use psnet_config::env;
use psnet_launch::{cluster, launch_local, JobSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Launcher {
    /// Every process on this host.
    Local,
    /// One `mpirun` for every process (rank 0 the scheduler, then servers, then workers).
    Mpi,
    /// One `srun` inside a Slurm allocation (task 0 the scheduler on the first node).
    Slurm,
    /// The scheduler here; servers, then workers, on the hostfile's hosts in turn, by ssh.
    Ssh,
    /// Grid Engine: the scheduler here; servers and workers one array job (`qsub -t`).
    Sge,
    /// PBS Pro (`qsub -J`) or Torque (`qsub -t`, with `--pbs-flavor torque`): as sge.
    Pbs,
    /// Hadoop YARN through the ResourceManager's REST API: one application per server and
    /// worker, the scheduler here.
    Yarn,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PbsFlavor {
    /// PBS Pro / OpenPBS.
    Pro,
    /// Torque.
    Torque,
}

#[derive(Parser)]
#[command(
    name = "psnet-launch",
    version,
    about = "Run a psnet job (a scheduler, servers and workers) on this host, over ssh, or through mpirun, srun, Grid Engine, PBS or YARN"
)]
struct Cli {
    /// Number of workers.
    #[arg(short = 'n', long = "num-workers")]
    workers: u32,
    /// Number of servers (default: as many as workers, like launch.py).
    #[arg(short = 's', long = "num-servers")]
    servers: Option<u32>,
    /// How the processes are started.
    #[arg(long, value_enum, default_value = "local")]
    launcher: Launcher,
    /// Hosts for `--launcher ssh` (servers first, then workers, take them in turn) or
    /// `--launcher mpi` (Open MPI's format; the scheduler runs on the first): one per line.
    #[arg(short = 'H', long)]
    hostfile: Option<String>,
    /// ssh: copy this directory to DIR on every host (rsync) and run the command there.
    #[arg(long, value_name = "DIR")]
    sync_dst_dir: Option<String>,
    /// sge: extra qsub arguments (queue, parallel environment...), e.g. "-q gpu.q -pe smp 4".
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    sge_args: Option<String>,
    /// pbs: extra qsub arguments, e.g. "-q gpu -l select=1:ncpus=4".
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    pbs_args: Option<String>,
    /// pbs: PBS Pro / OpenPBS (`qsub -J`, PBS_ARRAY_INDEX) or Torque (`qsub -t`, PBS_ARRAYID).
    #[arg(long, value_enum, default_value = "pro")]
    pbs_flavor: PbsFlavor,
    /// sge / pbs / yarn: the job's name (default psnet-PID).
    #[arg(long)]
    job_name: Option<String>,
    /// yarn: the ResourceManager's web address (yarn.resourcemanager.webapp.address).
    #[arg(long, value_name = "URL")]
    yarn_rm: Option<String>,
    /// yarn: memory per worker container, MB.
    #[arg(long, default_value_t = 4096)]
    yarn_memory: u32,
    /// yarn: virtual cores per worker container.
    #[arg(long, default_value_t = 2)]
    yarn_vcores: u32,
    /// yarn: memory per server container, MB (default: --yarn-memory).
    #[arg(long)]
    yarn_server_memory: Option<u32>,
    /// yarn: virtual cores per server container (default: --yarn-vcores).
    #[arg(long)]
    yarn_server_vcores: Option<u32>,
    /// yarn: the queue (default: the cluster's default queue).
    #[arg(long)]
    yarn_queue: Option<String>,
    /// Extra environment for every process, `NAME=VALUE` or `NAME:VALUE` (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Scheduler port (local: 0 picks a free one; mpi / slurm: default a random one in
    /// 20000..40000; --role-from-env: default DMLC_PS_ROOT_PORT).
    #[arg(long)]
    port: Option<u16>,
    /// The scheduler's host (mpi: default the hostfile's first host, or 127.0.0.1 without
    /// one; slurm: the allocation's first node; --role-from-env: default DMLC_PS_ROOT_URI).
    #[arg(long)]
    root: Option<String>,
    /// Take this process's role from OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID (0 the
    /// scheduler, then servers, then workers) and become COMMAND in that role.
    #[arg(long)]
    role_from_env: bool,
    /// Seconds the others may run on after one process failed.
    #[arg(long, default_value_t = 10)]
    grace: u64,
    /// Local jobs: start a server that dies again, up to N times each, with its rank; it
    /// rejoins the job from its checkpoint (needs PSNET_CHECKPOINT_DIR). Default:
    /// PSNET_MAX_RESTARTS, else 0 (a dying server stops the job).
    #[arg(long, value_name = "N")]
    max_restarts: Option<u32>,
    /// Pass the processes' output through untouched, without the `[worker 1] ` prefix on
    /// each line (a process then sees the launcher's terminal, for progress bars).
    #[arg(long)]
    no_prefix: bool,
    /// Local jobs: when no process has written a line for SECS seconds, ask every process
    /// for its flight recorder dump and print psnet-doctor's report (the job goes on; once
    /// per quiet spell). SIGUSR1 to the launcher does the same at any time.
    #[arg(long, value_name = "SECS")]
    dump_after: Option<u64>,
    /// The command every process runs.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    let at = s.find(['=', ':']);
    at.map(|i| (&s[..i], &s[i + 1..]))
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE or NAME:VALUE"))
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("psnet-launch: error: {message}");
    ExitCode::FAILURE
}

/// A port for a scheduler on another host, which cannot be probed from here.
fn random_port() -> u16 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    20_000 + ((nanos ^ std::process::id()) % 20_000) as u16
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut spec = JobSpec::new(cli.servers.unwrap_or(cli.workers), cli.workers, cli.command);
    if spec.servers == 0 || spec.workers == 0 {
        return fail("a job needs at least one server and one worker");
    }
    spec.env = cli.env;
    spec.grace = Duration::from_secs(cli.grace);
    spec.tag_output = !cli.no_prefix;
    if let Some(secs) = cli.dump_after {
        if cli.no_prefix {
            return fail("--dump-after watches the processes' output, which --no-prefix passes by");
        }
        spec.dump_after = Some(Duration::from_secs(secs.max(1)));
    }
    if let Some(n) = cli.max_restarts {
        spec.max_restarts = n;
    }
    if cli.role_from_env {
        let Some(root) = cli.root.or_else(|| env::DMLC_PS_ROOT_URI.get()) else {
            return fail("--role-from-env needs the scheduler's host: --root or DMLC_PS_ROOT_URI");
        };
        spec.root_host = root;
        spec.root_port = match cli.port {
            Some(p) => p,
            None => match env::DMLC_PS_ROOT_PORT.parse::<u16>() {
                Ok(p) => p.unwrap_or(0),
                Err(e) => return fail(e),
            },
        };
        return fail(cluster::exec_role_from_env(&spec));
    }
    let launcher_path = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "psnet-launch".into());
    let cluster_cmd = match cli.launcher {
        Launcher::Local => {
            if cli.hostfile.is_some() || cli.sync_dst_dir.is_some() {
                return fail("--hostfile and --sync-dst-dir need --launcher ssh or mpi");
            }
            place_root(&mut spec, cli.port, cli.root);
            None
        }
        Launcher::Ssh => {
            let Some(hostfile) = &cli.hostfile else {
                return fail("--launcher ssh needs --hostfile (one host per line)");
            };
            let hosts = match std::fs::read_to_string(hostfile) {
                Ok(text) => psnet_launch::ssh::hosts_of_hostfile(&text),
                Err(e) => return fail(format!("--hostfile {hostfile}: {e}")),
            };
            let dir = match &cli.sync_dst_dir {
                Some(d) => d.clone(),
                None => match std::env::current_dir() {
                    Ok(d) => d.to_string_lossy().into_owned(),
                    Err(e) => return fail(format!("the current directory: {e}")),
                },
            };
            let chosen = place_root(&mut spec, cli.port, cli.root);
            if let Err(e) = reachable_root(&spec, chosen, Some(&hosts)) {
                return fail(e);
            }
            let job = psnet_launch::ssh::SshJob {
                hosts,
                dir,
                sync: cli.sync_dst_dir.is_some(),
            };
            return report(psnet_launch::ssh::launch_ssh(&spec, &job));
        }
        Launcher::Yarn => {
            if cli.hostfile.is_some() || cli.sync_dst_dir.is_some() {
                return fail("--hostfile and --sync-dst-dir are for --launcher ssh or mpi");
            }
            let Some(rm) = cli.yarn_rm else {
                return fail(
                    "--launcher yarn needs --yarn-rm URL: the ResourceManager's web address \
                     (yarn.resourcemanager.webapp.address, e.g. http://rm:8088)",
                );
            };
            let chosen = place_root(&mut spec, cli.port, cli.root);
            let _ = reachable_root(&spec, chosen, None);
            let job = psnet_launch::yarn::YarnJob {
                rm,
                name: cli
                    .job_name
                    .unwrap_or_else(|| format!("psnet-{}", std::process::id())),
                memory_mb: cli.yarn_memory,
                vcores: cli.yarn_vcores,
                server_memory_mb: cli.yarn_server_memory.unwrap_or(cli.yarn_memory),
                server_vcores: cli.yarn_server_vcores.unwrap_or(cli.yarn_vcores),
                queue: cli.yarn_queue,
                poll: Duration::from_secs(1),
            };
            return match psnet_launch::yarn::launch_yarn(&spec, &job) {
                Ok(out) => match out.failure {
                    None => ExitCode::SUCCESS,
                    Some(why) => {
                        eprintln!("psnet-launch: {why}");
                        let code = out
                            .signal
                            .map(|s| 128 + s)
                            .or_else(|| out.scheduler.and_then(|s| s.code()));
                        ExitCode::from(code.and_then(|c| u8::try_from(c).ok()).unwrap_or(1).max(1))
                    }
                },
                Err(e) => fail(e),
            };
        }
        Launcher::Sge | Launcher::Pbs => {
            if cli.hostfile.is_some() || cli.sync_dst_dir.is_some() {
                return fail("--hostfile and --sync-dst-dir are for --launcher ssh or mpi");
            }
            let system = match (cli.launcher, cli.pbs_flavor) {
                (Launcher::Sge, _) => psnet_launch::batch::BatchSystem::Sge,
                (_, PbsFlavor::Pro) => psnet_launch::batch::BatchSystem::PbsPro,
                (_, PbsFlavor::Torque) => psnet_launch::batch::BatchSystem::Torque,
            };
            let extra = if cli.launcher == Launcher::Sge {
                cli.sge_args
            } else {
                cli.pbs_args
            };
            let dir = match std::env::current_dir() {
                Ok(d) => d.to_string_lossy().into_owned(),
                Err(e) => return fail(format!("the current directory: {e}")),
            };
            let chosen = place_root(&mut spec, cli.port, cli.root);
            let _ = reachable_root(&spec, chosen, None);
            let job = psnet_launch::batch::BatchJob {
                system,
                name: cli
                    .job_name
                    .unwrap_or_else(|| format!("psnet-{}", std::process::id())),
                extra: extra
                    .map(|a| a.split_whitespace().map(str::to_string).collect())
                    .unwrap_or_default(),
                dir,
                launcher: launcher_path.clone(),
                poll: Duration::from_secs(2),
            };
            return match psnet_launch::batch::launch_batch(&spec, &job) {
                Ok(out) => match (out.failure, out.signal) {
                    (None, _) => ExitCode::SUCCESS,
                    (Some(why), signal) => {
                        eprintln!("psnet-launch: {why}");
                        let code = signal
                            .map(|s| 128 + s)
                            .or_else(|| out.scheduler.and_then(|s| s.code()));
                        ExitCode::from(code.and_then(|c| u8::try_from(c).ok()).unwrap_or(1).max(1))
                    }
                },
                Err(e) => fail(e),
            };
        }
        Launcher::Mpi => {
            let first = match &cli.hostfile {
                Some(h) => match std::fs::read_to_string(h) {
                    Ok(text) => cluster::first_host_of_hostfile(&text),
                    Err(e) => return fail(format!("--hostfile {h}: {e}")),
                },
                None => Some("127.0.0.1".into()),
            };
            let Some(root) = cli.root.or(first) else {
                return fail("the hostfile names no host");
            };
            spec.root_host = root;
            spec.root_port = cli.port.unwrap_or_else(random_port);
            Some(cluster::mpirun_command(
                &spec,
                cli.hostfile.as_deref(),
                &launcher_path,
            ))
        }
        Launcher::Slurm => {
            let root = match cli.root.map_or_else(cluster::first_slurm_node, Ok) {
                Ok(r) => r,
                Err(e) => return fail(e),
            };
            spec.root_host = root;
            spec.root_port = cli.port.unwrap_or_else(random_port);
            Some(cluster::srun_command(&spec, &launcher_path))
        }
    };
    if let Some(cmd) = cluster_cmd {
        return match cluster::run_cluster_launcher(&cmd) {
            Ok((_, Some(sig))) => {
                eprintln!(
                    "psnet-launch: stopped by signal {sig}; {} was told to stop every process",
                    cmd[0]
                );
                ExitCode::from(u8::try_from(128 + sig).unwrap_or(255))
            }
            Ok((status, None)) if status.success() => ExitCode::SUCCESS,
            Ok((status, None)) => {
                eprintln!("psnet-launch: {} failed ({status})", cmd[0]);
                ExitCode::from(
                    status
                        .code()
                        .and_then(|c| u8::try_from(c).ok())
                        .unwrap_or(1)
                        .max(1),
                )
            }
            Err(e) => fail(e),
        };
    }
    report(launch_local(&spec))
}

/// The scheduler's port (0: a free one) and, if `--root` gave one, host; whether it did.
fn place_root(spec: &mut JobSpec, port: Option<u16>, root: Option<String>) -> bool {
    spec.root_port = port.unwrap_or(0);
    let chosen = root.is_some();
    if let Some(root) = root {
        spec.root_host = root;
    }
    chosen
}

/// A scheduler on a loopback address cannot be reached from other hosts. With the hosts
/// known (ssh) a remote one is an error; without (batch systems, YARN) a warning. An address
/// chosen with --root is taken as it is.
fn reachable_root(spec: &JobSpec, chosen: bool, hosts: Option<&[String]>) -> Result<(), String> {
    let loopback = spec
        .root_host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
        || spec.root_host == "localhost";
    if chosen || !loopback {
        return Ok(());
    }
    let advice = "set DMLC_INTERFACE to the interface the hosts reach this one through (or \
                  DMLC_NODE_HOST, or --root)";
    match hosts {
        Some(hosts) => {
            let me = rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned();
            let remote: Vec<&str> = hosts
                .iter()
                .map(String::as_str)
                .filter(|h| {
                    *h != "localhost"
                        && *h != me
                        && !h
                            .parse::<std::net::IpAddr>()
                            .is_ok_and(|ip| ip.is_loopback())
                })
                .collect();
            if remote.is_empty() {
                return Ok(());
            }
            Err(format!(
                "the scheduler would listen on {}, which {} cannot reach: {advice}",
                spec.root_host,
                remote.join(", ")
            ))
        }
        None => {
            eprintln!(
                "psnet-launch: warning: the scheduler listens on {}, which only tasks on this \
                 host can reach: {advice}",
                spec.root_host
            );
            Ok(())
        }
    }
}

/// The exit status and the one line for a job's outcome.
fn report(outcome: Result<psnet_launch::Outcome, psnet_launch::LaunchError>) -> ExitCode {
    match outcome {
        Ok(out) if out.success() => ExitCode::SUCCESS,
        Ok(out) if out.signal.is_some() => {
            let sig = out.signal.unwrap_or(0);
            eprintln!(
                "psnet-launch: stopped by signal {sig}; every process of the job was stopped"
            );
            ExitCode::from(u8::try_from(128 + sig).unwrap_or(255))
        }
        Ok(out) => {
            let code = out.failure_code().unwrap_or(1);
            if let Some((role, index, status)) = out.first_failure {
                eprintln!(
                    "psnet-launch: {} {index} failed first ({status}); every other process \
                     was stopped",
                    role.as_env()
                );
            }
            ExitCode::from(code)
        }
        Err(e) => fail(e),
    }
}
