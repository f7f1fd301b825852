//! `psnet-launch -s SERVERS -n WORKERS [--env K=V]... -- COMMAND [ARGS...]`: runs a psnet job
//! on this host (MXNet's `tools/launch.py --launcher local`).
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use psnet_launch::{launch_local, JobSpec};

#[derive(Parser)]
#[command(
    name = "psnet-launch",
    version,
    about = "Run a psnet job (scheduler, servers, workers) on this host"
)]
struct Cli {
    /// Number of workers.
    #[arg(short = 'n', long = "num-workers")]
    workers: u32,
    /// Number of servers (default: as many as workers, like launch.py).
    #[arg(short = 's', long = "num-servers")]
    servers: Option<u32>,
    /// Launcher: only `local` is built in this version.
    #[arg(long, default_value = "local")]
    launcher: String,
    /// Extra environment for every process, `NAME=VALUE` (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Scheduler port (0: a free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Seconds the others may run on after one process failed.
    #[arg(long, default_value_t = 10)]
    grace: u64,
    /// Pass the processes' output through untouched, without the `[worker 1] ` prefix on
    /// each line (a process then sees the launcher's terminal, for progress bars).
    #[arg(long)]
    no_prefix: bool,
    /// The command every process runs.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.launcher != "local" {
        eprintln!(
            "psnet-launch: error: launcher {:?} is not built yet; use --launcher local",
            cli.launcher
        );
        return ExitCode::FAILURE;
    }
    let mut spec = JobSpec::new(cli.servers.unwrap_or(cli.workers), cli.workers, cli.command);
    spec.env = cli.env;
    spec.root_port = cli.port;
    spec.grace = Duration::from_secs(cli.grace);
    spec.tag_output = !cli.no_prefix;
    match launch_local(&spec) {
        Ok(out) if out.success() => ExitCode::SUCCESS,
        Ok(out) if out.signal.is_some() => {
            let sig = out.signal.unwrap_or(0);
            eprintln!(
                "psnet-launch: stopped by signal {sig}; every process of the job was stopped"
            );
            ExitCode::from(u8::try_from(128 + sig).unwrap_or(255))
        }
        Ok(out) => {
            if let Some((role, index, status)) = out.first_failure {
                eprintln!(
                    "psnet-launch: {} {index} failed first ({status})",
                    role.as_env()
                );
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("psnet-launch: error: {e}");
            ExitCode::FAILURE
        }
    }
}
