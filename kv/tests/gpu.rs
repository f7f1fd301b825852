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
