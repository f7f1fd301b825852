//! The training loops: one worker of a distributed job, and the single-process reference.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use psnet::compression::{CompressionParams, Compressor};
use psnet::kv::updater::{OptimizerSpec, SgdParams};
use psnet::kv::{KvConfig, Mode, Worker};

use crate::data::Dataset;
use crate::model::Params;
use crate::{Args, ModeArg};

fn optimizer(args: &Args, workers: usize) -> OptimizerSpec {
    // Gradients are summed over a batch and (dist_sync) over workers: rescale to a mean.
    let per_update = match args.mode {
        ModeArg::Sync => args.batch * workers,
        ModeArg::Async => args.batch,
    };
    OptimizerSpec::Sgd(SgdParams {
        learning_rate: args.lr,
        momentum: args.momentum,
        rescale_grad: 1.0 / per_update as f64,
        ..SgdParams::default()
    })
}

/// The compression the arguments ask for.
pub(crate) fn compression(args: &Args) -> Result<CompressionParams, String> {
    let params = CompressionParams::new(&args.compression, Some(args.threshold))
        .map_err(|e| e.to_string())?;
    if args.compression_pull && params.scheme().is_none() {
        return Err("--compression-pull needs --compression 2bit or 1bit".into());
    }
    if args.compression_pull && args.mode == ModeArg::Async {
        return Err(
            "--compression-pull is for dist_sync only (each dist_async worker pulls at its own \
             pace)"
                .into(),
        );
    }
    Ok(params)
}

/// The layer widths: features, the hidden layers, classes.
pub(crate) fn widths(args: &Args) -> Result<Vec<usize>, String> {
    if args.batch == 0 || args.features == 0 || args.classes < 2 {
        return Err("--batch and --features must be positive, --classes at least 2".into());
    }
    let mut widths = vec![args.features];
    let hidden = args.hidden.trim();
    if !hidden.is_empty() && hidden != "none" {
        for h in hidden.split(',') {
            match h.trim().parse::<usize>() {
                Ok(n) if n > 0 => widths.push(n),
                _ => {
                    return Err(format!(
                        "--hidden {hidden:?}: give layer widths like 1024,256, or none"
                    ))
                }
            }
        }
    }
    widths.push(args.classes);
    Ok(widths)
}

fn data(args: &Args) -> Result<Dataset, String> {
    widths(args)?;
    Ok(Dataset::generate(
        args.samples,
        args.features,
        args.classes,
        args.seed,
    ))
}

/// Samples of a worker's shard the loss and accuracy are measured on each epoch.
const EVAL_SAMPLES: usize = 1024;

/// The epoch's loss and accuracy, the part of an epoch line a reference run prints too.
fn quality(params: &Params, data: &Dataset, shard: &std::ops::Range<usize>) -> String {
    let end = shard.end.min(shard.start + EVAL_SAMPLES);
    let (loss, accuracy) = params.evaluate(data, shard.start..end);
    format!("loss {loss:.6} accuracy {accuracy:.4}")
}

fn dump(args: &Args, params: &Params) -> Result<(), String> {
    if let Some(path) = &args.dump {
        let bytes: Vec<u8> = params
            .tensors
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Why a process of the job failed, and the exit status that says whose fault it was.
#[derive(Debug)]
pub struct Failure {
    /// The error, for stderr.
    pub message: String,
    /// [`psnet::kv::EXIT_PEER_FAILED`] when another process failed first, else 1.
    pub code: u8,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure {
            message,
            code: psnet::kv::EXIT_FAILED,
        }
    }
}

impl From<psnet::kv::KvError> for Failure {
    fn from(e: psnet::kv::KvError) -> Self {
        Failure {
            code: e.exit_code(),
            message: e.to_string(),
        }
    }
}

/// One worker of a job started by a launcher.
pub fn worker(args: &Args, config: KvConfig) -> Result<(), Failure> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let kv = psnet::kv::join(&config).await?;
        train(args, &kv).await?;
        Ok(kv.finalize().await?)
    })
}

async fn train(args: &Args, kv: &Worker) -> Result<(), Failure> {
    let err = Failure::from;
    let data = data(args)?;
    let widths = widths(args)?;
    let (rank, workers) = (kv.rank() as usize, kv.num_workers() as usize);
    let shard = data.shard(rank, workers);
    let mut p = Params::init(&widths, args.seed);
    let keys: Vec<u64> = (0..p.tensors.len() as u64).collect();
    let params = compression(args)?;
    if rank == 0 {
        println!("{}", job_line(args, kv, &p));
    }
    if params != CompressionParams::None {
        let params = psnet::kv::KvCompression {
            params,
            pull: args.compression_pull,
            // PSNET_PACK_CODES decides (by default: across hosts).
            pack: false,
        };
        kv.set_gradient_compression(params).await.map_err(err)?;
    }
    if args.mode == ModeArg::Async {
        kv.set_mode(Mode::Async).await.map_err(err)?;
    }
    kv.set_optimizer(&optimizer(args, workers))
        .await
        .map_err(err)?;
    let init: Vec<&[f32]> = p.tensors.iter().map(|t| &t[..]).collect();
    kv.init(&keys, &init).await.map_err(err)?;
    let steps = shard.len() / args.batch;
    let progress = Progress::new(rank == 0, args.epochs, steps);
    let started = Instant::now();
    let mut total = Comm::default();
    for epoch in 0..args.epochs {
        let epoch_start = Instant::now();
        let mut comm = Comm::default();
        for s in 0..steps {
            let start = shard.start + s * args.batch;
            let g = p.gradients(&data, start..start + args.batch);
            let grads: Vec<&[f32]> = g.tensors.iter().map(|t| &t[..]).collect();
            let t = Instant::now();
            if args.by_layer {
                let first = by_layer(kv, &keys, &grads, &mut p.tensors)
                    .await
                    .map_err(err)?;
                comm.first_layer.push(first);
            } else {
                kv.pushpull_many(&keys, &grads, &mut p.tensors)
                    .await
                    .map_err(err)?;
            }
            comm.add(t.elapsed(), 2 * 4 * p.len() as u64);
            if args.step_delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(args.step_delay_ms)).await;
            }
            progress.step(epoch, s + 1);
        }
        if rank == 0 {
            // The epoch's time is its training steps': the evaluation below is not part of it.
            let trained = epoch_start.elapsed();
            let line = format!(
                "epoch {epoch} {} | {}",
                quality(&p, &data, &shard),
                comm.describe(trained)
            );
            progress.line(&line);
        }
        total.merge(&comm);
    }
    progress.finish();
    // In dist_async, other workers may still be pushing: wait for them, then read the end state.
    kv.barrier().await.map_err(err)?;
    let mut outs: Vec<&mut [f32]> = p.tensors.iter_mut().map(|t| &mut t[..]).collect();
    kv.pull_many(&keys, &mut outs).await.map_err(err)?;
    if rank == 0 {
        println!(
            "psnet-train: {} epochs in {:.2} s, {}; {}",
            args.epochs,
            started.elapsed().as_secs_f64(),
            quality(&p, &data, &shard),
            total.describe(started.elapsed())
        );
        dump(args, &p)?;
    }
    Ok(())
}

/// The first line: the job and the model's shape.
fn job_line(args: &Args, kv: &Worker, p: &Params) -> String {
    let sharded = p
        .tensors
        .iter()
        .enumerate()
        .filter(|(k, t)| kv.servers_for(*k as u64, t.len()) > 1)
        .count();
    format!(
        "psnet-train: {} workers, {} servers, {:?}, compression {}; model {} ({:.1} MB of \
         parameters in {} keys, {sharded} sharded over every server)",
        kv.num_workers(),
        kv.num_servers(),
        args.mode,
        args.compression,
        p.widths
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join("-"),
        (4 * p.len()) as f64 / 1e6,
        p.tensors.len()
    )
}

/// One step's push-pulls as `--by-layer` makes them: a call per tensor, all at once, the
/// last layer's first; returns how long the first layer's tensors (keys 0 and 1) took.
async fn by_layer(
    kv: &Worker,
    keys: &[u64],
    grads: &[&[f32]],
    tensors: &mut [Vec<f32>],
) -> Result<Duration, psnet::kv::KvError> {
    let start = Instant::now();
    let calls = keys.iter().zip(grads).zip(tensors.iter_mut()).rev().map(
        |((&key, grad), out)| async move {
            kv.pushpull(key, grad, out)
                .await
                .map(|()| (key, start.elapsed()))
        },
    );
    let done = futures_util::future::try_join_all(calls).await?;
    Ok(done
        .iter()
        .filter(|(key, _)| *key < 2)
        .map(|(_, at)| *at)
        .max()
        .unwrap_or_default())
}

/// Time spent in push+pull and the bytes moved (pushed plus pulled, uncompressed).
#[derive(Default)]
struct Comm {
    time: Duration,
    bytes: u64,
    /// `--by-layer`: per step, when the first layer's tensors were back.
    first_layer: Vec<Duration>,
}

impl Comm {
    fn add(&mut self, time: Duration, bytes: u64) {
        self.time += time;
        self.bytes += bytes;
    }

    fn merge(&mut self, other: &Comm) {
        self.add(other.time, other.bytes);
        self.first_layer.extend_from_slice(&other.first_layer);
    }

    fn describe(&self, wall: Duration) -> String {
        let secs = self.time.as_secs_f64();
        let first = if self.first_layer.is_empty() {
            String::new()
        } else {
            let mut at = self.first_layer.clone();
            at.sort_unstable();
            let steps = self.first_layer.len() as f64;
            format!(
                ", first layer back after {:.1} ms of {:.1} ms a step (median {:.1} ms)",
                at.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e3 / steps,
                secs * 1e3 / steps,
                at[at.len() / 2].as_secs_f64() * 1e3
            )
        };
        format!(
            "push+pull {:.1} MB/s, communication {:.2} s of {:.2} s ({:.0}%){first}",
            if secs > 0.0 {
                self.bytes as f64 / secs / 1e6
            } else {
                0.0
            },
            secs,
            wall.as_secs_f64(),
            100.0 * secs / wall.as_secs_f64().max(1e-9)
        )
    }
}

/// Rank 0's progress: a bar on a terminal, nothing extra otherwise (the epoch lines are
/// printed either way).
struct Progress(Option<ProgressBar>);

impl Progress {
    fn new(rank0: bool, epochs: usize, steps: usize) -> Self {
        if !rank0 || !std::io::stdout().is_terminal() {
            return Progress(None);
        }
        let bar = ProgressBar::new((epochs * steps) as u64);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} epoch {msg} [{bar:40}] {pos}/{len} steps, {elapsed} (eta {eta})",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        Progress(Some(bar))
    }

    fn step(&self, epoch: usize, _step: usize) {
        if let Some(bar) = &self.0 {
            bar.set_message(epoch.to_string());
            bar.inc(1);
        }
    }

    fn line(&self, line: &str) {
        match &self.0 {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

/// One worker's error-feedback state in the reference: a residual per key.
struct Feedback {
    compressor: Box<dyn Compressor>,
    residuals: Vec<Vec<f32>>,
}

/// Adds tensor `key` of every worker's gradients, in rank order, as the servers do.
fn rank_ordered_sum(grads: &[Params], feedback: &mut [Feedback], key: usize) -> Vec<f32> {
    if feedback.is_empty() {
        let mut sum = grads[0].tensors[key].clone();
        for g in &grads[1..] {
            for (s, v) in sum.iter_mut().zip(&g.tensors[key]) {
                *s += *v;
            }
        }
        return sum;
    }
    let n = grads[0].tensors[key].len();
    let mut sum = vec![0.0; n];
    for (r, (g, fb)) in grads.iter().zip(feedback.iter_mut()).enumerate() {
        let mut bytes = vec![0u8; fb.compressor.compressed_len(n)];
        fb.compressor
            .quantize(&g.tensors[key], &mut fb.residuals[key], &mut bytes)
            .expect("sizes match");
        let r = if r == 0 {
            fb.compressor.dequantize(&bytes, &mut sum)
        } else {
            fb.compressor.dequantize_add(&bytes, &mut sum)
        };
        r.expect("sizes match");
    }
    sum
}

/// Trains in one process exactly as a `dist_sync` job would.
pub(crate) fn reference(args: &Args) -> Result<(), String> {
    if args.mode == ModeArg::Async {
        return Err("--reference reproduces dist_sync only (dist_async depends on timing)".into());
    }
    if args.compression_pull {
        return Err(
            "--reference does not model --compression-pull: each stored piece's copy depends \
             on how keys are laid out over the servers"
                .into(),
        );
    }
    let data = data(args)?;
    let widths = widths(args)?;
    let workers = args.workers.max(1) as usize;
    let mut updater = optimizer(args, workers).build();
    let mut p = Params::init(&widths, args.seed);
    let mut feedback: Vec<Feedback> = Vec::new();
    let params = compression(args)?;
    for _ in 0..workers {
        if let Some(compressor) = params.compressor().map_err(|e| e.to_string())? {
            feedback.push(Feedback {
                compressor,
                residuals: p.tensors.iter().map(|t| vec![0.0; t.len()]).collect(),
            });
        }
    }
    let shards: Vec<_> = (0..workers).map(|r| data.shard(r, workers)).collect();
    let steps = shards[0].len() / args.batch;
    for epoch in 0..args.epochs {
        for s in 0..steps {
            let grads: Vec<Params> = shards
                .iter()
                .map(|sh| {
                    let start = sh.start + s * args.batch;
                    p.gradients(&data, start..start + args.batch)
                })
                .collect();
            for key in 0..p.tensors.len() {
                let sum = rank_ordered_sum(&grads, &mut feedback, key);
                updater
                    .update(key as u64, &sum, &mut p.tensors[key])
                    .map_err(|e| e.to_string())?;
            }
        }
        println!("epoch {epoch} {}", quality(&p, &data, &shards[0]));
    }
    dump(args, &p)
}
