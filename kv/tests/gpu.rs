//! GPU buffers in whole jobs (feature `cuda`): one scheduler, one or two servers and two
//! workers over 127.0.0.1, pushing from and pulling into device memory, without compression
//! and with 2-bit and 1-bit compression quantized on the GPU. The weights must be
//! bit-identical to the same job pushing the same values from host memory. Without a GPU the
//! tests say why they skipped.
#![cfg(feature = "cuda")]

use std::time::Duration;

use psnet_compression::cuda::cudarc::driver::CudaSlice;
use psnet_compression::cuda::{context, device_count};
use psnet_compression::{CompressionError, CompressionParams};
use psnet_kv::gpu::GpuKv;
use psnet_kv::updater::OptimizerSpec;
use psnet_kv::KvError;

mod common;

use common::{cluster_with, on_all};

/// Key 1 stays on one server; key 2 is sharded over every server, at offsets that are not
/// multiples of four elements.
const KEYS: [(u64, usize); 2] = [(1, 1003), (2, 40_001)];
const ROUNDS: u32 = 4;

#[derive(Clone, Copy, PartialEq)]
enum From {
    Host,
    Gpu,
}

fn gradient(rank: u32, round: u32, key: u64, len: usize) -> Vec<f32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (u64::from(rank) << 40 | u64::from(round) << 20 | key);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Every worker's final values of both keys (key 1 then key 2).
async fn job(servers: u32, compression: Option<CompressionParams>, from: From) -> Vec<Vec<f32>> {
    let c = cluster_with(servers, 2, |c| {
        c.bigarray_bound(1000).heartbeats(
            Some(Duration::from_millis(200)),
            Some(Duration::from_secs(10)),
        )
    })
    .await;
    let results = on_all(&c.workers, move |w| async move {
        if let Some(params) = compression {
            w.set_gradient_compression(params).await?;
        }
        let sgd = r#"{"type":"sgd","learning_rate":0.25,"momentum":0.5,"rescale_grad":0.5}"#;
        w.set_optimizer(&OptimizerSpec::parse(sgd).unwrap()).await?;
        let init: Vec<Vec<f32>> = KEYS.iter().map(|&(_, n)| vec![0.5; n]).collect();
        let keys: Vec<u64> = KEYS.iter().map(|&(k, _)| k).collect();
        let refs: Vec<&[f32]> = init.iter().map(|v| &v[..]).collect();
        w.init(&keys, &refs).await?;
        let rank = w.rank();
        let mut finals = Vec::new();
        match from {
            From::Host => {
                for round in 0..ROUNDS {
                    let (k1, n1) = KEYS[0];
                    let mut out = vec![0.0; n1];
                    w.pushpull(k1, &gradient(rank, round, k1, n1), &mut out)
                        .await?;
                    let (k2, n2) = KEYS[1];
                    w.push(k2, &gradient(rank, round, k2, n2)).await?;
                }
                for &(k, n) in &KEYS {
                    let mut out = vec![0.0; n];
                    w.pull(k, &mut out).await?;
                    finals.extend(out);
                }
            }
            From::Gpu => {
                let gpu = GpuKv::new(&w, 0)?;
                let stream = context(0).map_err(KvError::Gpu)?.default_stream();
                let upload = |v: &[f32]| -> Result<CudaSlice<f32>, KvError> {
                    stream
                        .clone_htod(v)
                        .map_err(|e| KvError::Gpu(CompressionError::Cuda(e.to_string())))
                };
                let zeros = |n: usize| -> Result<CudaSlice<f32>, KvError> {
                    stream
                        .alloc_zeros(n)
                        .map_err(|e| KvError::Gpu(CompressionError::Cuda(e.to_string())))
                };
                for round in 0..ROUNDS {
                    let (k1, n1) = KEYS[0];
                    let g1 = upload(&gradient(rank, round, k1, n1))?;
                    let mut out = zeros(n1)?;
                    gpu.pushpull(k1, &g1.slice(..), &mut out.slice_mut(..))
                        .await?;
                    let (k2, n2) = KEYS[1];
                    gpu.push(k2, &upload(&gradient(rank, round, k2, n2))?.slice(..))
                        .await?;
                }
                for &(k, n) in &KEYS {
                    let mut out = zeros(n)?;
                    gpu.pull(k, &mut out.slice_mut(..)).await?;
                    let host = stream
                        .clone_dtoh(&out)
                        .map_err(|e| KvError::Gpu(CompressionError::Cuda(e.to_string())))?;
                    finals.extend(host);
                }
            }
        }
        Ok(finals)
    })
    .await;
    c.finish().await;
    results
        .into_iter()
        .map(|r| r.expect("worker ops"))
        .collect()
}

fn gpu_present(test: &str) -> bool {
    match device_count() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("{test}: skipped: {e}");
            false
        }
    }
}

async fn gpu_matches_host(compression: Option<CompressionParams>, test: &str) {
    if !gpu_present(test) {
        return;
    }
    for servers in [1, 2] {
        let host = job(servers, compression, From::Host).await;
        let gpu = job(servers, compression, From::Gpu).await;
        assert_eq!(host.len(), 2);
        // Both workers see the same weights, and the GPU job's are the host job's, bit for bit.
        assert_eq!(
            host[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            host[1].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{test}: host workers disagree ({servers} servers)"
        );
        for (rank, (h, g)) in host.iter().zip(&gpu).enumerate() {
            assert_eq!(h.len(), g.len());
            if let Some(i) = h
                .iter()
                .zip(g)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{test}: {servers} servers, worker {rank}: element {i}: host {} gpu {}",
                    h[i], g[i]
                );
            }
        }
        // The updates moved the weights away from their initial 0.5.
        assert!(host[0].iter().filter(|&&x| x != 0.5).count() > host[0].len() / 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_pushes_match_host_pushes() {
    gpu_matches_host(None, "gpu_pushes_match_host_pushes").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_two_bit_pushes_match_host_pushes() {
    let params = CompressionParams::two_bit(0.5).unwrap();
    gpu_matches_host(Some(params), "gpu_two_bit_pushes_match_host_pushes").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_one_bit_pushes_match_host_pushes() {
    let params = CompressionParams::one_bit(0.25).unwrap();
    gpu_matches_host(Some(params), "gpu_one_bit_pushes_match_host_pushes").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_gpu_the_error_says_why() {
    if device_count().is_ok() {
        return;
    }
    let c = cluster_with(1, 1, |c| c).await;
    match GpuKv::new(&c.workers[0], 0) {
        Err(KvError::Gpu(CompressionError::NoCudaDevice(reason))) => {
            eprintln!("without_a_gpu_the_error_says_why: {reason}");
            assert!(!reason.is_empty());
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("a GpuKv without a device"),
    }
    c.finish().await;
}

/// A worker's final values of an f16 key (one server's) and a bf16 key (sharded), after
/// rounds of pushpull and push of half values, from host memory or from the GPU.
async fn half_job(from: From) -> Vec<(Vec<u16>, Vec<u16>)> {
    use psnet_kv::value::{bf16, f16};
    const N1: usize = 1003;
    const N2: usize = 40_001;
    let c = cluster_with(2, 2, |c| c.bigarray_bound(1000)).await;
    let results = on_all(&c.workers, move |w| async move {
        let rank = w.rank();
        let g16 = |round| -> Vec<f16> {
            gradient(rank, round, 1, N1)
                .into_iter()
                .map(f16::from_f32)
                .collect()
        };
        let gb16 = |round| -> Vec<bf16> {
            gradient(rank, round, 2, N2)
                .into_iter()
                .map(bf16::from_f32)
                .collect()
        };
        w.init(&[1], &[&vec![f16::from_f32(0.5); N1]]).await?;
        w.init(&[2], &[&vec![bf16::from_f32(0.5); N2]]).await?;
        let mut a = vec![f16::ZERO; N1];
        let mut b = vec![bf16::ZERO; N2];
        match from {
            From::Host => {
                for round in 0..ROUNDS {
                    w.pushpull(1, &g16(round), &mut a).await?;
                    w.push(2, &gb16(round)).await?;
                }
                w.pull(2, &mut b).await?;
            }
            From::Gpu => {
                let cuda = |e: String| KvError::Gpu(CompressionError::Cuda(e));
                let gpu = GpuKv::new(&w, 0)?;
                let stream = context(0).map_err(KvError::Gpu)?.default_stream();
                let mut out_a = stream
                    .alloc_zeros::<f16>(N1)
                    .map_err(|e| cuda(e.to_string()))?;
                let mut out_b = stream
                    .alloc_zeros::<bf16>(N2)
                    .map_err(|e| cuda(e.to_string()))?;
                for round in 0..ROUNDS {
                    let ga = stream
                        .clone_htod(&g16(round))
                        .map_err(|e| cuda(e.to_string()))?;
                    gpu.pushpull_half(1, &ga.slice(..), &mut out_a.slice_mut(..))
                        .await?;
                    let gb = stream
                        .clone_htod(&gb16(round))
                        .map_err(|e| cuda(e.to_string()))?;
                    gpu.push_half(2, &gb.slice(..)).await?;
                }
                gpu.pull_half(2, &mut out_b.slice_mut(..)).await?;
                a = stream.clone_dtoh(&out_a).map_err(|e| cuda(e.to_string()))?;
                b = stream.clone_dtoh(&out_b).map_err(|e| cuda(e.to_string()))?;
            }
        }
        let mut bits: Vec<f32> = a.iter().map(|x| f32::from(x.to_bits())).collect();
        bits.extend(b.iter().map(|x| f32::from(x.to_bits())));
        Ok(bits)
    })
    .await;
    c.finish().await;
    results
        .into_iter()
        .map(|r| {
            let v = r.expect("worker ops");
            let bits: Vec<u16> = v.iter().map(|&x| x as u16).collect();
            (bits[..N1].to_vec(), bits[N1..].to_vec())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_half_pushes_match_host_pushes() {
    if !gpu_present("gpu_half_pushes_match_host_pushes") {
        return;
    }
    let host = half_job(From::Host).await;
    let gpu = half_job(From::Gpu).await;
    assert_eq!(
        host, gpu,
        "f16 / bf16 values from the GPU differ from host pushes"
    );
    // Moved away from the initial 0.5 (f16 0x3800, bf16 0x3f00).
    assert!(host[0].0.iter().any(|&x| x != 0x3800));
    assert!(host[0].1.iter().any(|&x| x != 0x3f00));
}
