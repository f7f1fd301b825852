//! The training loops: one worker of a distributed job, and the single-process reference.

use std::time::Duration;

use psnet::compression::{CompressionParams, Compressor};
use psnet::kv::updater::{OptimizerSpec, SgdParams};
use psnet::kv::{KvConfig, Mode, Worker};

use crate::data::Dataset;
use crate::model::{Grads, Params};
use crate::{Args, ModeArg};

/// Key of the weights.
const KEY_W: u64 = 0;
/// Key of the biases.
const KEY_B: u64 = 1;

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
pub fn compression(args: &Args) -> Result<CompressionParams, String> {
    CompressionParams::new(&args.compression, Some(args.threshold)).map_err(|e| e.to_string())
}

fn data(args: &Args) -> Result<Dataset, String> {
    if args.batch == 0 || args.features == 0 || args.classes < 2 {
        return Err("--batch and --features must be positive, --classes at least 2".into());
    }
    Ok(Dataset::generate(
        args.samples,
        args.features,
        args.classes,
        args.seed,
    ))
}

fn report(epoch: usize, params: &Params, data: &Dataset, shard: std::ops::Range<usize>) {
    let (loss, accuracy) = params.evaluate(data, shard);
    println!("epoch {epoch} loss {loss:.6} accuracy {accuracy:.4}");
}

fn dump(args: &Args, params: &Params) -> Result<(), String> {
    if let Some(path) = &args.dump {
        let bytes: Vec<u8> = params
            .w
            .iter()
            .chain(&params.b)
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
    let (rank, workers) = (kv.rank() as usize, kv.num_workers() as usize);
    let shard = data.shard(rank, workers);
    if rank == 0 {
        println!(
            "psnet-train: {workers} workers, {} servers, {:?}, compression {}",
            kv.num_servers(),
            args.mode,
            args.compression
        );
    }
    let params = compression(args)?;
    if params != CompressionParams::None {
        kv.set_gradient_compression(params).await.map_err(err)?;
    }
    if args.mode == ModeArg::Async {
        kv.set_mode(Mode::Async).await.map_err(err)?;
    }
    kv.set_optimizer(&optimizer(args, workers))
        .await
        .map_err(err)?;
    let mut p = Params::zeros(args.features, args.classes);
    kv.init(&[KEY_W, KEY_B], &[&p.w, &p.b]).await.map_err(err)?;
    let steps = shard.len() / args.batch;
    for epoch in 0..args.epochs {
        for s in 0..steps {
            let start = shard.start + s * args.batch;
            let g = p.gradients(&data, start..start + args.batch);
            kv.pushpull(KEY_W, &g.w, &mut p.w).await.map_err(err)?;
            kv.pushpull(KEY_B, &g.b, &mut p.b).await.map_err(err)?;
            if args.step_delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(args.step_delay_ms)).await;
            }
        }
        if rank == 0 {
            report(epoch, &p, &data, shard.clone());
        }
    }
    // In dist_async, other workers may still be pushing: wait for them, then read the end state.
    kv.barrier().await.map_err(err)?;
    kv.pull_many(&[KEY_W, KEY_B], &mut [&mut p.w, &mut p.b])
        .await
        .map_err(err)?;
    if rank == 0 {
        dump(args, &p)?;
    }
    Ok(())
}

/// One worker's error-feedback state in the reference.
struct Feedback {
    compressor: Box<dyn Compressor>,
    residual_w: Vec<f32>,
    residual_b: Vec<f32>,
}

/// Adds `grads` of every worker, in rank order, as the servers do.
fn rank_ordered_sum(
    grads: &[Grads],
    feedback: &mut [Feedback],
    pick: fn(&Grads) -> &Vec<f32>,
    key: u64,
) -> Vec<f32> {
    if feedback.is_empty() {
        let mut sum = pick(&grads[0]).clone();
        for g in &grads[1..] {
            for (s, v) in sum.iter_mut().zip(pick(g)) {
                *s += *v;
            }
        }
        return sum;
    }
    let n = pick(&grads[0]).len();
    let mut sum = vec![0.0; n];
    for (r, (g, fb)) in grads.iter().zip(feedback.iter_mut()).enumerate() {
        let residual = if key == KEY_W {
            &mut fb.residual_w
        } else {
            &mut fb.residual_b
        };
        let mut bytes = vec![0u8; fb.compressor.compressed_len(n)];
        fb.compressor
            .quantize(pick(g), residual, &mut bytes)
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
pub fn reference(args: &Args) -> Result<(), String> {
    if args.mode == ModeArg::Async {
        return Err("--reference reproduces dist_sync only (dist_async depends on timing)".into());
    }
    let data = data(args)?;
    let workers = args.workers.max(1) as usize;
    let mut updater = optimizer(args, workers).build();
    let mut feedback: Vec<Feedback> = Vec::new();
    if let Some(c) = compression(args)?.compressor().map_err(|e| e.to_string())? {
        let scheme = c.scheme();
        let threshold = c.threshold();
        feedback.push(Feedback {
            compressor: c,
            residual_w: vec![0.0; args.features * args.classes],
            residual_b: vec![0.0; args.classes],
        });
        for _ in 1..workers {
            let params = match scheme {
                psnet::compression::Scheme::TwoBit => CompressionParams::two_bit(threshold),
                psnet::compression::Scheme::OneBit => CompressionParams::one_bit(threshold),
            }
            .map_err(|e| e.to_string())?;
            feedback.push(Feedback {
                compressor: params
                    .compressor()
                    .map_err(|e| e.to_string())?
                    .expect("compressing"),
                residual_w: vec![0.0; args.features * args.classes],
                residual_b: vec![0.0; args.classes],
            });
        }
    }
    let shards: Vec<_> = (0..workers).map(|r| data.shard(r, workers)).collect();
    let steps = shards[0].len() / args.batch;
    let mut p = Params::zeros(args.features, args.classes);
    for epoch in 0..args.epochs {
        for s in 0..steps {
            let grads: Vec<Grads> = shards
                .iter()
                .map(|sh| {
                    let start = sh.start + s * args.batch;
                    p.gradients(&data, start..start + args.batch)
                })
                .collect();
            let sum_w = rank_ordered_sum(&grads, &mut feedback, |g| &g.w, KEY_W);
            let sum_b = rank_ordered_sum(&grads, &mut feedback, |g| &g.b, KEY_B);
            updater
                .update(KEY_W, &sum_w, &mut p.w)
                .map_err(|e| e.to_string())?;
            updater
                .update(KEY_B, &sum_b, &mut p.b)
                .map_err(|e| e.to_string())?;
        }
        report(epoch, &p, &data, shards[0].clone());
    }
    dump(args, &p)
}
