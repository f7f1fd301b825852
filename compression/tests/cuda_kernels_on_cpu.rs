//! The CUDA kernels' source, run on the CPU by an emulation of the few CUDA features they use
//! (`common/kernel_emu.rs`), against the plain model of MXNet's kernels: every byte and every
//! residual and value bit the same, for lengths that end in every partial group, on grids
//! from a lone warp to the launches' own shape (so grid-stride loops turn several times), from
//! 16-byte aligned buffers (the `float4` path) and misaligned ones (the scalar path), with
//! values on the thresholds, signed zeros, denormals and infinities. Where a GPU is, the GPU
//! tests (`cuda.rs`) run the same kernels for real; this runs them wherever a C++ compiler is
//! (and says why it skipped where none is).
#![cfg(feature = "cuda")]

mod common;
#[path = "common/kernel_emu.rs"]
mod kernel_emu;

use common::*;
use kernel_emu::{available, run, Kernel, Launch};

/// (blocks, threads per block): one warp; two blocks of two warps; three one-warp blocks; the
/// launches' own block of 256 threads.
const GRIDS: [(u32, u32); 4] = [(1, 32), (2, 64), (3, 32), (1, 256)];

/// Every length up to 40 (each partial group, each partial byte and float of the padded
/// output), then around warp and block boundaries, then lengths that make the grid loop.
fn lengths() -> Vec<usize> {
    let mut v: Vec<usize> = (0..=40).collect();
    v.extend([
        63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 1023, 4097, 8195,
    ]);
    v
}

/// Pseudo-random values with the cases that decide a branch or a bit mixed in.
fn values(n: usize, seed: u64, threshold: f32) -> Vec<f32> {
    let special = [
        threshold,
        -threshold,
        0.0,
        -0.0,
        1e-40,
        -1e-40,
        f32::MIN_POSITIVE,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        3.0e38,
    ];
    let mut v = pseudo_random(n, seed, 2.0 * threshold);
    for (i, x) in v.iter_mut().enumerate() {
        if (i as u64 + seed) % 5 == 0 {
            *x = special[(i / 5 + seed as usize) % special.len()];
        }
    }
    v
}

/// Gradients that put a zero residual exactly on the threshold, or one step of a float either
/// side of it (a comparison's edge).
fn edges(n: usize, t: f32) -> Vec<f32> {
    let up = f32::from_bits(t.to_bits() + 1);
    let down = f32::from_bits(t.to_bits() - 1);
    let cycle = [t, -t, up, -up, down, -down, 0.0, -0.0];
    (0..n).map(|i| cycle[i % cycle.len()]).collect()
}

fn launch(kernel: Kernel, grid: (u32, u32), misalign: u32, n: usize) -> Launch {
    Launch {
        kernel,
        blocks: grid.0,
        threads: grid.1,
        misalign,
        a: 0.0,
        b: 0.0,
        add: false,
        grad: vec![0.0; n],
        residual: vec![0.0; n],
        bytes: Vec::new(),
        out: vec![0.0; n],
    }
}

/// A quantize kernel's case: the kernel, its threshold, the scale of its values (and of the
/// seed they start from), the misalignments to try and MXNet's model of it.
struct Quantize {
    kernel: Kernel,
    threshold: f32,
    scale: f32,
    seed: u64,
    misaligns: [u32; 2],
    model: fn(&[f32], &mut [f32], f32) -> Vec<u8>,
}

/// Three rounds of `q` for every length, grid and misalignment: the second starts from the
/// residual the first left; the last from a zero residual, which it puts on the thresholds.
/// The output starts stale: the kernel writes every byte, the padding as zeros.
fn quantize_matches_the_model(q: Quantize) {
    let t = q.threshold;
    for n in lengths() {
        for (g, &grid) in GRIDS.iter().enumerate() {
            for misalign in q.misaligns {
                let what = format!("{:?} n={n} grid={grid:?} misalign={misalign}", q.kernel);
                let mut l = launch(q.kernel, grid, misalign, n);
                (l.a, l.b) = (t, -t);
                l.residual = values(n, q.seed + g as u64, q.scale);
                let mut model_residual = l.residual.clone();
                for round in 0..3 {
                    l.grad = values(n, 100 * q.seed + round, q.scale);
                    if round == 2 {
                        l.residual = vec![0.0; n];
                        model_residual = vec![0.0; n];
                        l.grad = edges(n, t);
                    }
                    let want = (q.model)(&l.grad, &mut model_residual, t);
                    l.bytes = vec![0xEE; want.len()];
                    let got = run(&l);
                    assert_bytes_eq(&got.bytes, &want, &format!("{what} round {round}"));
                    assert_bits_eq(&got.residual, &model_residual, &what);
                    l.residual = got.residual;
                }
            }
        }
    }
}

#[test]
fn two_bit_quantize_matches_the_model_on_every_grid_and_alignment() {
    if !available("two_bit_quantize_matches_the_model") {
        return;
    }
    quantize_matches_the_model(Quantize {
        kernel: Kernel::Quantize2,
        threshold: 0.5,
        scale: 0.5,
        seed: 7,
        misaligns: [0, 1],
        model: mxnet_quantize_2bit,
    });
}

#[test]
fn one_bit_quantize_matches_the_model_with_its_warp_shuffle() {
    if !available("one_bit_quantize_matches_the_model") {
        return;
    }
    quantize_matches_the_model(Quantize {
        kernel: Kernel::Quantize1,
        threshold: 0.25,
        scale: 1.0,
        seed: 11,
        misaligns: [0, 3],
        model: mxnet_quantize_1bit,
    });
}

/// Compressed bytes with every code in every position.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    // xorshift64*: the high byte of each step.
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

#[test]
fn dequantize_and_dequantize_add_match_the_model_for_both_schemes() {
    if !available("dequantize_matches_the_model") {
        return;
    }
    let t = 0.5;
    for n in lengths() {
        for (g, &grid) in GRIDS.iter().enumerate() {
            for misalign in [0, 2] {
                for add in [false, true] {
                    for kernel in [Kernel::Dequantize2, Kernel::Dequantize1] {
                        let what =
                            format!("{kernel:?} n={n} grid={grid:?} misalign={misalign} add={add}");
                        let mut l = launch(kernel, grid, misalign, n);
                        let per_float = match kernel {
                            Kernel::Dequantize2 => 16,
                            _ => 32,
                        };
                        (l.a, l.b) = (t, -t);
                        l.add = add;
                        l.bytes = random_bytes(4 * n.div_ceil(per_float), n as u64 + g as u64);
                        l.out = values(n, 300 + g as u64, 3.0);
                        let decoded = match kernel {
                            Kernel::Dequantize2 => mxnet_dequantize_2bit(&l.bytes, n, t),
                            _ => mxnet_dequantize_1bit(&l.bytes, n),
                        };
                        let want: Vec<f32> = if add {
                            l.out.iter().zip(&decoded).map(|(o, d)| o + d).collect()
                        } else {
                            decoded
                        };
                        let got = run(&l);
                        assert_bits_eq(&got.out, &want, &what);
                        assert_eq!(got.bytes, l.bytes, "{what}: the input was changed");
                    }
                }
            }
        }
    }
}
