//! The compressed allreduce's two schemes on whole communicators of the in-memory network,
//! against a model of each computed in one process: every rank's bits on 1 to 9 ranks and
//! lengths 0 to about 10k, over calls that carry residuals; error feedback over many calls;
//! the bytes each rank sends at 64 ranks; and ranks that disagree.

use std::ops::Range;
use std::time::Duration;

use futures_util::future::{join_all, try_join_all};
use psnet_collectives::{CompressedScheme, Config};
use psnet_compression::scale::mean_magnitude_from;
use psnet_compression::{Compressor, OneBitCompressor, Scheme, TwoBitCompressor};
use psnet_memnet::MemNet;

mod common;

use common::{delayed, runtime, world, Comm};

/// Chunk `c` of `len` elements split over `n` ranks, the first `len % n` one longer.
fn chunk(len: usize, n: usize, c: usize) -> Range<usize> {
    let (base, extra) = (len / n, len % n);
    let start = c * base + c.min(extra);
    start..start + base + usize::from(c < extra)
}

/// One rank's residuals, as the caller keeps them between calls.
#[derive(Clone, Debug, PartialEq)]
struct Residuals {
    worker: Vec<f32>,
    server: Vec<f32>,
}

/// The model of one call: every rank's result (the same) from the ranks' gradients,
/// updating the residuals as each rank would.
fn model(
    scheme: CompressedScheme,
    c: &dyn Compressor,
    grads: &[Vec<f32>],
    res: &mut [Residuals],
) -> Vec<f32> {
    let n = grads.len();
    let len = grads[0].len();
    let mut out = vec![0.0f32; len];
    match scheme {
        CompressedScheme::Allgather => {
            for r in 0..n {
                let mut codes = vec![0u8; c.compressed_len(len)];
                c.quantize(&grads[r], &mut res[r].worker, &mut codes)
                    .unwrap();
                c.dequantize_add(&codes, &mut out).unwrap();
            }
        }
        CompressedScheme::TwoPhase => {
            // codes[r][j]: rank r's codes of chunk j.
            let mut codes = vec![Vec::new(); n];
            for r in 0..n {
                for j in 0..n {
                    let range = chunk(len, n, j);
                    let mut q = vec![0u8; c.compressed_len(range.len())];
                    c.quantize(&grads[r][range.clone()], &mut res[r].worker[range], &mut q)
                        .unwrap();
                    codes[r].push(q);
                }
            }
            for j in 0..n {
                let range = chunk(len, n, j);
                let mut sum = vec![0.0f32; range.len()];
                for rank_codes in &codes {
                    c.dequantize_add(&rank_codes[j], &mut sum).unwrap();
                }
                // Rank j's server residual takes the sum; the codes mark (2-bit) what is at
                // least the job's threshold, or (1-bit) every sign, and stand for the mean
                // magnitude of what they mark.
                let server = &mut res[j].server;
                for (r, s) in server.iter_mut().zip(&sum) {
                    *r += s;
                }
                let decide = match c.scheme() {
                    Scheme::TwoBit => c.threshold(),
                    Scheme::OneBit => 0.0,
                };
                let scale = mean_magnitude_from(server, decide);
                let decoded: Vec<f32> = server
                    .iter()
                    .map(|&x| match c.scheme() {
                        _ if scale == 0.0 => 0.0,
                        Scheme::TwoBit if x >= decide => scale,
                        Scheme::TwoBit if x <= -decide => -scale,
                        Scheme::TwoBit => 0.0,
                        Scheme::OneBit if x > 0.0 => scale,
                        Scheme::OneBit => -scale,
                    })
                    .collect();
                for (r, d) in server.iter_mut().zip(&decoded) {
                    *r -= d;
                }
                out[range].copy_from_slice(&decoded);
            }
        }
    }
    out
}

fn gradients(n: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n)
        .map(|_| (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect())
        .collect()
}

fn compressors() -> [Box<dyn Compressor>; 2] {
    [
        Box::new(TwoBitCompressor::new(0.5).unwrap()),
        Box::new(OneBitCompressor::new(0.0).unwrap()),
    ]
}

fn forcing(scheme: CompressedScheme) -> Config {
    Config {
        compressed_two_phase_bytes: match scheme {
            CompressedScheme::Allgather => usize::MAX,
            CompressedScheme::TwoPhase => 0,
        },
        // Small pieces: blocks of codes travel as several messages.
        piece_bytes: 96,
        ..Config::default()
    }
}

fn fresh(comms: &[Comm], len: usize) -> Vec<Residuals> {
    comms
        .iter()
        .map(|c| Residuals {
            worker: vec![0.0; len],
            server: vec![0.0; c.compressed_server_residual_len(len)],
        })
        .collect()
}

/// Runs one call on every rank: `bufs` in, the results out.
async fn call(comms: &[Comm], bufs: &mut [Vec<f32>], res: &mut [Residuals], c: &dyn Compressor) {
    try_join_all(
        comms
            .iter()
            .zip(bufs.iter_mut().zip(res.iter_mut()))
            .map(|(comm, (b, r))| comm.allreduce_compressed(b, &mut r.worker, &mut r.server, c)),
    )
    .await
    .expect("compressed allreduce");
}

#[test]
fn every_rank_ends_with_the_models_bits_for_both_schemes() {
    let lengths = [0, 1, 3, 16, 17, 100, 1001, 4099, 10007];
    for scheme in [CompressedScheme::Allgather, CompressedScheme::TwoPhase] {
        for n in 1..=9 {
            runtime().block_on(async {
                let net = delayed(n as u64);
                let comms = world(&net, n, forcing(scheme)).await;
                for &len in &lengths {
                    let chosen = comms[0].compressed_scheme(len);
                    let scheme = if n <= 2 {
                        CompressedScheme::Allgather
                    } else {
                        scheme
                    };
                    assert_eq!(chosen, scheme, "n {n}, len {len}");
                    for compressor in &compressors() {
                        let c = compressor.as_ref();
                        let mut res = fresh(&comms, len);
                        let mut model_res = res.clone();
                        // Three calls: the residuals carried between them matter.
                        for round in 0..3 {
                            let grads = gradients(n, len, round * 31 + len as u64);
                            let want = model(scheme, c, &grads, &mut model_res);
                            let mut bufs = grads.clone();
                            call(&comms, &mut bufs, &mut res, c).await;
                            for (r, b) in bufs.iter().enumerate() {
                                assert!(
                                    b.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                                    "{scheme:?} {:?}, n {n}, len {len}, rank {r}, round {round}",
                                    c.scheme()
                                );
                            }
                            assert_eq!(res, model_res, "{scheme:?}, n {n}, len {len}");
                        }
                    }
                }
            });
        }
    }
}

#[test]
fn what_was_applied_plus_every_residual_is_the_sum_of_the_gradients() {
    let (n, len, rounds) = (5, 3001, 40);
    runtime().block_on(async {
        let net = delayed(7);
        let comms = world(&net, n, forcing(CompressedScheme::TwoPhase)).await;
        for compressor in &compressors() {
            let c = compressor.as_ref();
            let mut res = fresh(&comms, len);
            let mut applied = vec![0.0f64; len];
            let mut given = vec![0.0f64; len];
            for round in 0..rounds {
                let grads = gradients(n, len, 1000 + round);
                for g in &grads {
                    for (s, x) in given.iter_mut().zip(g) {
                        *s += f64::from(*x);
                    }
                }
                let mut bufs = grads;
                call(&comms, &mut bufs, &mut res, c).await;
                for (s, x) in applied.iter_mut().zip(&bufs[0]) {
                    *s += f64::from(*x);
                }
            }
            let mut held = applied;
            for (r, rr) in res.iter().enumerate() {
                for (s, x) in held.iter_mut().zip(&rr.worker) {
                    *s += f64::from(*x);
                }
                for (s, x) in held[chunk(len, n, r)].iter_mut().zip(&rr.server) {
                    *s += f64::from(*x);
                }
            }
            for (i, (h, g)) in held.iter().zip(&given).enumerate() {
                assert!(
                    (h - g).abs() <= 1e-3 * (1.0 + g.abs()),
                    "{:?}: element {i}: applied plus residuals {h}, gradients {g}",
                    c.scheme()
                );
            }
            // The residuals are not the whole story: quantization did leave something out.
            assert!(res.iter().any(|r| r.server.iter().any(|&x| x != 0.0)));
        }
    });
}

#[test]
fn at_64_ranks_two_phases_send_2_n_minus_1_over_n_of_the_codes_per_rank() {
    let n = 64;
    let len = n * 4096;
    runtime().block_on(async {
        let net = MemNet::reliable();
        let config = Config {
            heartbeat_timeout: None,
            ..Config::default()
        };
        let comms = world(&net, n, config).await;
        assert_eq!(comms[0].compressed_scheme(len), CompressedScheme::TwoPhase);
        for compressor in &compressors() {
            let c = compressor.as_ref();
            let before: Vec<u64> = comms.iter().map(|c| c.transport().bytes_sent()).collect();
            let mut res = fresh(&comms, len);
            let mut bufs = gradients(n, len, 3);
            call(&comms, &mut bufs, &mut res, c).await;
            let codes = c.compressed_len(len) as f64;
            let ideal = 2.0 * (n - 1) as f64 / n as f64 * codes;
            for (r, comm) in comms.iter().enumerate() {
                let sent = (comm.transport().bytes_sent() - before[r]) as f64;
                assert!(
                    sent <= 1.1 * ideal,
                    "{:?}: rank {r} sent {sent} bytes, 1.1 x 2(n-1)/n of {codes} is {}",
                    c.scheme(),
                    1.1 * ideal
                );
                assert!(
                    sent >= ideal,
                    "rank {r} sent {sent}, less than the codes {ideal}"
                );
            }
        }
    });
}

#[test]
fn ranks_that_disagree_or_pass_a_wrong_residual_fail_every_rank_in_bounded_time() {
    runtime().block_on(async {
        let n = 4;
        let len = 1000;
        let net = delayed(11);
        let comms = world(&net, n, forcing(CompressedScheme::TwoPhase)).await;
        let two = TwoBitCompressor::new(0.5).unwrap();
        let other = TwoBitCompressor::new(0.25).unwrap();
        let mut res = fresh(&comms, len);
        let mut bufs = gradients(n, len, 1);
        let results = join_all(
            comms
                .iter()
                .zip(bufs.iter_mut().zip(res.iter_mut()))
                .enumerate()
                .map(|(r, (comm, (b, rr)))| {
                    let c: &dyn Compressor = if r == 2 { &other } else { &two };
                    tokio::time::timeout(
                        Duration::from_secs(30),
                        comm.allreduce_compressed(b, &mut rr.worker, &mut rr.server, c),
                    )
                }),
        )
        .await;
        for (r, result) in results.into_iter().enumerate() {
            let err = result.expect("bounded time").expect_err("a mismatch");
            assert!(!err.to_string().is_empty(), "rank {r}");
        }

        // A fresh communicator: rank 1 passes a server residual of the wrong length.
        let net = delayed(12);
        let comms = world(&net, n, forcing(CompressedScheme::TwoPhase)).await;
        let mut res = fresh(&comms, len);
        res[1].server.push(0.0);
        let mut bufs = gradients(n, len, 2);
        let results = join_all(comms.iter().zip(bufs.iter_mut().zip(res.iter_mut())).map(
            |(comm, (b, rr))| {
                tokio::time::timeout(
                    Duration::from_secs(30),
                    comm.allreduce_compressed(b, &mut rr.worker, &mut rr.server, &two),
                )
            },
        ))
        .await;
        let errors: Vec<String> = results
            .into_iter()
            .map(|r| r.expect("bounded time").expect_err("fails").to_string())
            .collect();
        assert!(
            errors[1].contains("server residual of 251 elements"),
            "{}",
            errors[1]
        );
        assert!(errors[1].contains("takes 250"), "{}", errors[1]);
    });
}
