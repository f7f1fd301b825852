//! Criterion bench on 16 Mi elements: quantize, dequantize, dequantize-add and the memcpy
//! reference, single-threaded with each supported SIMD level, and with all threads.
//! Throughput counts uncompressed f32 bytes. Run: `cargo bench -p psnet-compression`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use psnet_compression::{Compressor, OneBitCompressor, Parallelism, SimdLevel, TwoBitCompressor};

const N: usize = 16 << 20;

fn gradient(n: usize) -> Vec<f32> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn configs() -> Vec<(String, Box<dyn Compressor>)> {
    let mut out: Vec<(String, Box<dyn Compressor>)> = Vec::new();
    for level in SimdLevel::supported() {
        let seq = Parallelism::sequential();
        out.push((
            format!("2bit/{level}/1t"),
            Box::new(
                TwoBitCompressor::new(0.5)
                    .unwrap()
                    .with_simd(level)
                    .unwrap()
                    .with_parallelism(seq),
            ),
        ));
        out.push((
            format!("1bit/{level}/1t"),
            Box::new(
                OneBitCompressor::new(0.5)
                    .unwrap()
                    .with_simd(level)
                    .unwrap()
                    .with_parallelism(seq),
            ),
        ));
    }
    let all = Parallelism::auto();
    let threads = all.thread_count();
    out.push((
        format!("2bit/{}/{threads}t", SimdLevel::detect()),
        Box::new(TwoBitCompressor::new(0.5).unwrap().with_parallelism(all)),
    ));
    out.push((
        format!("1bit/{}/{threads}t", SimdLevel::detect()),
        Box::new(OneBitCompressor::new(0.5).unwrap().with_parallelism(all)),
    ));
    out
}

fn bench(c: &mut Criterion) {
    let grad = gradient(N);
    let mut residual = vec![0.0f32; N];
    let mut values = vec![0.0f32; N];
    let mut compressed = vec![0u8; TwoBitCompressor::new(0.5).unwrap().compressed_len(N)];

    let mut group = c.benchmark_group("compress_16M");
    group
        .throughput(Throughput::Bytes(4 * N as u64))
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));

    group.bench_function("memcpy/1t", |b| {
        b.iter(|| values.copy_from_slice(black_box(&grad)))
    });
    for (name, comp) in configs() {
        let out = &mut compressed[..comp.compressed_len(N)];
        group.bench_function(BenchmarkId::new("quantize", &name), |b| {
            b.iter(|| comp.quantize(black_box(&grad), &mut residual, out).unwrap())
        });
        group.bench_function(BenchmarkId::new("dequantize", &name), |b| {
            b.iter(|| comp.dequantize(black_box(out), &mut values).unwrap())
        });
        group.bench_function(BenchmarkId::new("dequantize_add", &name), |b| {
            b.iter(|| comp.dequantize_add(black_box(out), &mut values).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
