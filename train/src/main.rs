//! `psnet-train`: trains a multi-layer perceptron (by default 1024-1024-256-10, 5.3 MB of
//! parameters in 6 keys, the first sharded over every server) on generated data over
//! psnet's kv store, and prints per epoch the loss, the accuracy, the push+pull bandwidth
//! and the time spent communicating, then a one-line summary. A progress bar shows on a
//! terminal. `--hidden none` trains softmax regression.
//!
//! - Without `DMLC_ROLE`, it launches a whole job on this host (`--servers`, `--workers`)
//!   running itself in every role, like `tools/launch.py --launcher local python train.py`.
//! - With `DMLC_ROLE` (set by a launcher), it is one process of the job.
//! - `--reference` trains in one process, applying the rank-ordered sum of every worker's
//!   gradients itself: a `dist_sync` run must end with bit-identical weights.
#![forbid(unsafe_code)]

mod data;
mod model;
mod train;

use std::process::ExitCode;

use clap::{Parser, ValueEnum};

/// Synchronization mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// dist_sync (also accepted under MXNet's names dist_sync, dist_sync_device and
    /// dist_device_sync: gradients are reduced on the servers either way).
    #[value(
        alias = "dist_sync",
        alias = "dist_sync_device",
        alias = "dist_device_sync"
    )]
    Sync,
    /// dist_async (also accepted under MXNet's name).
    #[value(alias = "dist_async")]
    Async,
}

/// Command line.
#[derive(Parser, Clone, Debug)]
#[command(
    name = "psnet-train",
    version,
    about = "Train a multi-layer perceptron over psnet's kv store"
)]
pub struct Args {
    /// Servers to launch (when not started by a launcher).
    #[arg(long, default_value_t = 2)]
    pub servers: u32,
    /// Workers to launch (when not started by a launcher).
    #[arg(long, default_value_t = 2)]
    pub workers: u32,
    /// dist_sync or dist_async.
    #[arg(long, value_enum, default_value_t = ModeArg::Sync)]
    pub mode: ModeArg,
    /// Gradient compression: none, 2bit or 1bit.
    #[arg(long, default_value = "none")]
    pub compression: String,
    /// Compression threshold.
    #[arg(long, default_value_t = 0.5)]
    pub threshold: f32,
    /// With --compression: pulls compressed too (dist_sync; lossy, every worker holds the
    /// same weights, the servers' master copy differs by their residual).
    #[arg(long)]
    pub compression_pull: bool,
    /// Learning rate (SGD on the servers).
    #[arg(long, default_value_t = 0.01)]
    pub lr: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Epochs.
    #[arg(long, default_value_t = 5)]
    pub epochs: usize,
    /// Samples per worker step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Samples in the data set (split evenly over the workers).
    #[arg(long, default_value_t = 8192)]
    pub samples: usize,
    /// Inputs per sample.
    #[arg(long, default_value_t = 1024)]
    pub features: usize,
    /// Hidden layers' widths (ReLU), comma-separated; `none`: softmax regression.
    #[arg(long, default_value = "1024,256")]
    pub hidden: String,
    /// Classes.
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Data seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the final weights (f32 little-endian, w then b) here (rank 0).
    #[arg(long)]
    pub dump: Option<std::path::PathBuf>,
    /// Train in this process, applying the rank-ordered gradient sums itself.
    #[arg(long)]
    pub reference: bool,
    /// Pause per step (to test failures mid-run).
    #[arg(long, default_value_t = 0)]
    pub step_delay_ms: u64,
    /// Push-pull each tensor as a call of its own, all at once, last layer's first, as a
    /// framework's backward hooks start them; the epoch lines then say when the first
    /// layer's parameters were back (the next forward pass can start there). Compare
    /// PSNET_KV_PRIORITY=1 (declared order first, the default) with 0 (the order of the
    /// calls).
    #[arg(long)]
    pub by_layer: bool,
}

fn main() -> ExitCode {
    psnet::config::logging::init();
    let args = Args::parse();
    let launched = match psnet::kv::started_by_launcher() {
        Ok(launched) => launched,
        Err(e) => {
            eprintln!("psnet-train: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Settings are checked before any process starts.
    if let Err(e) = train::compression(&args).and_then(|_| train::widths(&args).map(|_| ())) {
        eprintln!("psnet-train: error: {e}");
        return ExitCode::FAILURE;
    }
    let result = if args.reference {
        train::reference(&args).map_err(train::Failure::from)
    } else if launched {
        match psnet::kv::launch_from_env() {
            // Scheduler and server processes never return from launch_from_env.
            Ok(config) => train::worker(&args, config),
            Err(e) => Err(e.into()),
        }
    } else {
        launch(&args).map_err(train::Failure::from)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("psnet-train: error: {}", e.message);
            ExitCode::from(e.code)
        }
    }
}

/// Runs the whole job on this host: this program in every role.
fn launch(args: &Args) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let mut command = vec![exe.to_string_lossy().into_owned()];
    command.extend(std::env::args().skip(1));
    let spec = psnet_launch::JobSpec::new(args.servers, args.workers, command);
    let outcome = psnet_launch::launch_local(&spec).map_err(|e| e.to_string())?;
    if let Some(sig) = outcome.signal {
        return Err(format!(
            "stopped by signal {sig}; every process of the job was stopped"
        ));
    }
    match outcome.first_failure {
        None => Ok(()),
        Some((role, index, status)) => {
            Err(format!("{} {index} failed first ({status})", role.as_env()))
        }
    }
}
