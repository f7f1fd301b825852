//! Criterion bench of a kv server's `dist_sync` round on one piece, as psnet-train's
//! compressed job runs it: 2 workers, 2-bit pushes (about 2% of the fields nonzero, packed),
//! SGD with momentum on the server, and compressed pulls whose packed codes go back to
//! both workers. The round's parts are timed alone beside it: the shadow's requantization
//! and the packing of its codes. Run: `cargo bench -p psnet-kv --bench server_round`.

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use psnet_compression::{Scheme, TwoBitCompressor};
use psnet_kv::proto::msg::{CommandKind, PushFlags};
use psnet_kv::proto::packed;
use psnet_kv::proto::pulled::{self, Form};
use psnet_kv::proto::server::{Output, Push, ServerState};

/// Elements of a 512 KiB piece of f32 values (compressed pulls' default piece).
const N: usize = 128 << 10;
const KEY: u64 = 3;

/// Deterministic values of about `spread` in magnitude.
fn values(seed: u64, n: usize, spread: f32) -> Vec<f32> {
    let mut state = seed | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * spread
        })
        .collect()
}

/// A worker's packed 2-bit pushes: gradients whose residual crosses the threshold in a few
/// percent of the elements a round, as psnet-train's do.
fn pushes(seed: u64, rounds: usize) -> Vec<Bytes> {
    let comp = TwoBitCompressor::new(0.5).unwrap();
    let mut residual = vec![0.0f32; N];
    (0..rounds)
        .map(|r| {
            let grad = values(seed + r as u64 * 7919, N, 0.03);
            let mut codes = vec![0u8; comp.compressed_len(N)];
            comp.quantize(&grad, &mut residual, &mut codes).unwrap();
            Bytes::from(packed::pack(&codes).unwrap())
        })
        .collect()
}

fn server() -> ServerState {
    let mut s = ServerState::new(2);
    s.handle_command(
        CommandKind::SetCompression,
        r#"{"type":"2bit","threshold":0.5,"pull":true,"pack":true}"#,
    )
    .unwrap();
    s.handle_command(
        CommandKind::SetOptimizer,
        r#"{"type":"sgd","learning_rate":0.01,"momentum":0.9,"rescale_grad":0.03125}"#,
    )
    .unwrap();
    let init = values(42, N, 0.05);
    s.handle_push(Push {
        rank: 0,
        ts: 1,
        key: KEY,
        flags: PushFlags {
            init: true,
            ..PushFlags::default()
        },
        n_elems: N as u64,
        payload: Bytes::copy_from_slice(bytemuck::cast_slice(&init)),
    });
    while s.poll_output().is_some() {}
    s
}

fn bench(c: &mut Criterion) {
    const ROUNDS: usize = 64;
    const RESTART: usize = 256;
    let by_worker = [pushes(1, ROUNDS), pushes(2, ROUNDS)];
    let mut group = c.benchmark_group("server_round_128k");
    group
        .throughput(Throughput::Elements(N as u64))
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));

    let mut s = server();
    let mut ts = 10u64;
    let mut round = 0usize;
    group.bench_function("round/2bit-pull-packed", |b| {
        b.iter(|| {
            // A fresh server every RESTART rounds, so that every sample times rounds of the
            // same ages (the state drifts as rounds accumulate).
            if round % RESTART == 0 {
                s = server();
            }
            let have = s.shadow(KEY).map(|sh| sh.version);
            for (rank, pushes) in by_worker.iter().enumerate() {
                ts += 1;
                s.handle_push(Push {
                    rank: rank as u32,
                    ts,
                    key: KEY,
                    flags: PushFlags {
                        compressed: true,
                        pull_back: true,
                        packed: true,
                        have,
                        ..PushFlags::default()
                    },
                    n_elems: N as u64,
                    payload: pushes[round % ROUNDS].clone(),
                });
            }
            round += 1;
            while let Some(out) = s.poll_output() {
                if let Output::Done {
                    value: Some(key),
                    have,
                    ..
                } = out
                {
                    let (value, pulled) = s.answer_value(key, have).unwrap();
                    assert!(matches!(
                        pulled.map(|p| p.form),
                        Some(Form::Packed { .. } | Form::Full)
                    ));
                    black_box(value);
                }
            }
        })
    });

    let master = values(5, N, 0.05);
    let start = values(6, N, 0.05);
    let mut copy = start.clone();
    group.bench_function("requantize/2bit", |b| {
        b.iter(|| {
            copy.copy_from_slice(&start);
            black_box(pulled::quantize(Scheme::TwoBit, &master, &mut copy))
        })
    });
    let delta = pulled::quantize(Scheme::TwoBit, &master, &mut start.clone()).unwrap();
    group.bench_function("pack/pull-codes", |b| {
        b.iter(|| black_box(packed::pack(&delta.codes).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
