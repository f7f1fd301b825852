//! Every code path against the plain MXNet model, plus hand-worked examples from the spec.

mod common;

use common::*;
use psnet_compression::{Compressor, OneBitCompressor, Parallelism, SimdLevel, TwoBitCompressor};

const SIZES: &[usize] = &[
    0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 100, 1000, 1023, 1024,
    1025, 3071, 4097, 10_000,
];

#[test]
fn spec_example_e3() {
    for (name, c) in two_bit_paths(0.5) {
        let grad = [0.6f32, -0.6, 0.1, 1.0];
        let mut residual = [0.0f32; 4];
        let mut out = [0xFFu8; 4];
        c.quantize(&grad, &mut residual, &mut out).unwrap();
        assert_eq!(out, [0xE3, 0, 0, 0], "{name}");
        assert_eq!(residual, [0.6 - 0.5, -0.6 + 0.5, 0.1, 0.5], "{name}");
        let mut values = [9.0f32; 4];
        c.dequantize(&out, &mut values).unwrap();
        assert_eq!(values, [0.5, -0.5, 0.0, 0.5], "{name}");
    }
}

#[test]
fn one_threshold_per_round() {
    // g = 5 once, then zeros: the residual drains by t per round, each round sending +t.
    let c = TwoBitCompressor::new(0.5).unwrap();
    let mut residual = [0.0f32];
    let mut out = [0u8; 4];
    c.quantize(&[5.0], &mut residual, &mut out).unwrap();
    assert_eq!((out[0], residual[0]), (0xC0, 4.5));
    for expected in [4.0, 3.5, 3.0, 2.5] {
        c.quantize(&[0.0], &mut residual, &mut out).unwrap();
        assert_eq!((out[0], residual[0]), (0xC0, expected));
    }
}

#[test]
fn ties_go_to_the_threshold() {
    let c = TwoBitCompressor::new(0.25).unwrap();
    let mut residual = [0.0f32; 4];
    let mut out = [0u8; 4];
    c.quantize(&[0.25, -0.25, 0.2499, -0.2499], &mut residual, &mut out)
        .unwrap();
    assert_eq!(out[0], 0b11_10_00_00);
    assert_eq!(residual, [0.0, 0.0, 0.2499, -0.2499]);
}

#[test]
fn non_finite_two_bit() {
    for (name, c) in two_bit_paths(0.5) {
        // Enough elements for the vector loops too.
        let n = 64;
        let mut grad = vec![0.0f32; n];
        for (i, g) in grad.iter_mut().enumerate() {
            *g = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.1][i % 4];
        }
        let mut residual = vec![0.0f32; n];
        let mut out = vec![0u8; c.compressed_len(n)];
        for round in 0..3 {
            let g = if round == 0 {
                grad.clone()
            } else {
                vec![0.2; n]
            };
            c.quantize(&g, &mut residual, &mut out).unwrap();
            for i in (0..n).step_by(4) {
                // NaN -> 00, +Inf -> 11, -Inf -> 10.
                assert_eq!(out[i / 4] & 0xFC, 0b00_11_10_00, "{name} round {round}");
                assert!(residual[i].is_nan(), "{name}");
                assert_eq!(residual[i + 1], f32::INFINITY, "{name}");
                assert_eq!(residual[i + 2], f32::NEG_INFINITY, "{name}");
            }
        }
    }
}

#[test]
fn code_01_decodes_to_zero_and_padding_is_zero() {
    for (name, c) in two_bit_paths(2.0) {
        let mut values = vec![7.0f32; 16];
        let mut compressed = vec![0b01_11_10_00u8; 4];
        c.dequantize(&compressed, &mut values).unwrap();
        assert_eq!(&values[..4], &[0.0, 2.0, -2.0, 0.0], "{name}");
        assert_eq!(values[0].to_bits(), 0, "{name}: +0.0");

        let grad = vec![3.0f32; 17];
        let mut residual = vec![0.0f32; 17];
        compressed = vec![0xAA; 8];
        c.quantize(&grad, &mut residual, &mut compressed).unwrap();
        assert_eq!(
            compressed,
            [0xFF, 0xFF, 0xFF, 0xFF, 0xC0, 0, 0, 0],
            "{name}"
        );
    }
}

#[test]
fn one_bit_spec_example() {
    for (name, c) in one_bit_paths(0.5) {
        let grad = [
            1.0f32,
            -1.0,
            0.6,
            0.4,
            0.5,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut residual = [0.0f32; 8];
        let mut out = [0xFFu8; 4];
        c.quantize(&grad, &mut residual, &mut out).unwrap();
        assert_eq!(out, [0b1010_0010, 0, 0, 0], "{name}");
        assert_eq!(&residual[..5], &[0.0, 0.0, 0.6 - 1.0, 1.4, 1.5], "{name}");
        assert!(residual[5].is_nan(), "{name}");
        assert_eq!(residual[6], f32::INFINITY, "{name}");
        assert_eq!(residual[7], f32::NEG_INFINITY, "{name}");
        let mut values = [0.0f32; 8];
        c.dequantize(&out, &mut values).unwrap();
        assert_eq!(
            values,
            [1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0],
            "{name}"
        );
    }
}

#[test]
fn one_bit_sizes_and_padding() {
    let c = OneBitCompressor::new(0.0).unwrap();
    for (n, size) in [(0, 0), (1, 4), (31, 4), (32, 4), (33, 8)] {
        assert_eq!(c.compressed_len(n), size);
    }
    let grad = vec![1.0f32; 33];
    let mut residual = vec![0.0f32; 33];
    let mut out = vec![0x55u8; 8];
    c.quantize(&grad, &mut residual, &mut out).unwrap();
    assert_eq!(out, [0xFF, 0xFF, 0xFF, 0xFF, 0x80, 0, 0, 0]);
}

/// Several rounds of quantize on every path against the model, then dequantize and
/// dequantize-add against the model's decoding.
fn check_two_bit(n: usize, offset: usize, threshold: f32, seed: u64) {
    let mut model_residual = pseudo_random(n, seed ^ 0xAB, threshold);
    let initial_residual = model_residual.clone();
    let grads: Vec<Vec<f32>> = (0..3)
        .map(|r| pseudo_random(n, seed + r, 2.0 * threshold))
        .collect();
    let expected: Vec<Vec<u8>> = grads
        .iter()
        .map(|g| mxnet_quantize_2bit(g, &mut model_residual, threshold))
        .collect();
    let acc0 = pseudo_random(n, seed ^ 0xCD, 10.0);

    for (name, c) in two_bit_paths(threshold) {
        let mut residual_buf = misaligned(&initial_residual, offset);
        let residual = &mut residual_buf[offset..];
        let mut out_buf = vec![0xA5u8; c.compressed_len(n) + offset];
        for (g, want) in grads.iter().zip(&expected) {
            let g = misaligned(g, offset);
            let out = &mut out_buf[offset..];
            c.quantize(&g[offset..], residual, out).unwrap();
            assert_bytes_eq(
                out,
                want,
                &format!("{name} n={n} offset={offset} t={threshold}"),
            );
        }
        assert_bits_eq(residual, &model_residual, &format!("{name} n={n} residual"));

        let out = &out_buf[offset..];
        let decoded = mxnet_dequantize_2bit(out, n, threshold);
        let mut values = misaligned(&vec![f32::NAN; n], offset);
        c.dequantize(out, &mut values[offset..]).unwrap();
        assert_bits_eq(
            &values[offset..],
            &decoded,
            &format!("{name} n={n} dequantize"),
        );

        let mut acc = misaligned(&acc0, offset);
        c.dequantize_add(out, &mut acc[offset..]).unwrap();
        let want: Vec<f32> = acc0.iter().zip(&decoded).map(|(a, d)| a + d).collect();
        assert_bits_eq(
            &acc[offset..],
            &want,
            &format!("{name} n={n} dequantize_add"),
        );
    }
}

fn check_one_bit(n: usize, offset: usize, threshold: f32, seed: u64) {
    let mut model_residual = pseudo_random(n, seed ^ 0xAB, 1.0);
    let initial_residual = model_residual.clone();
    let grads: Vec<Vec<f32>> = (0..3).map(|r| pseudo_random(n, seed + r, 1.5)).collect();
    let expected: Vec<Vec<u8>> = grads
        .iter()
        .map(|g| mxnet_quantize_1bit(g, &mut model_residual, threshold))
        .collect();
    let acc0 = pseudo_random(n, seed ^ 0xCD, 10.0);

    for (name, c) in one_bit_paths(threshold) {
        let mut residual_buf = misaligned(&initial_residual, offset);
        let residual = &mut residual_buf[offset..];
        let mut out_buf = vec![0xA5u8; c.compressed_len(n) + offset];
        for (g, want) in grads.iter().zip(&expected) {
            let g = misaligned(g, offset);
            let out = &mut out_buf[offset..];
            c.quantize(&g[offset..], residual, out).unwrap();
            assert_bytes_eq(
                out,
                want,
                &format!("{name} n={n} offset={offset} t={threshold}"),
            );
        }
        assert_bits_eq(residual, &model_residual, &format!("{name} n={n} residual"));

        let out = &out_buf[offset..];
        let decoded = mxnet_dequantize_1bit(out, n);
        let mut values = misaligned(&vec![f32::NAN; n], offset);
        c.dequantize(out, &mut values[offset..]).unwrap();
        assert_bits_eq(
            &values[offset..],
            &decoded,
            &format!("{name} n={n} dequantize"),
        );

        let mut acc = misaligned(&acc0, offset);
        c.dequantize_add(out, &mut acc[offset..]).unwrap();
        let want: Vec<f32> = acc0.iter().zip(&decoded).map(|(a, d)| a + d).collect();
        assert_bits_eq(
            &acc[offset..],
            &want,
            &format!("{name} n={n} dequantize_add"),
        );
    }
}

#[test]
fn two_bit_all_paths_match_mxnet_model() {
    for &n in SIZES {
        for offset in [0, 1, 3] {
            for threshold in [0.5, 1e-3, 3.0, 1e-40] {
                check_two_bit(n, offset, threshold, n as u64 * 31 + offset as u64);
            }
        }
    }
}

#[test]
fn one_bit_all_paths_match_mxnet_model() {
    for &n in SIZES {
        for offset in [0, 1, 3] {
            for threshold in [0.5, 0.0, -0.25, 1.0] {
                check_one_bit(n, offset, threshold, n as u64 * 17 + offset as u64);
            }
        }
    }
}

#[test]
fn large_arrays_default_parallelism_match_model() {
    // Above the default split size, so `Parallelism::auto()` splits on multi-core machines.
    let n = 3 * Parallelism::DEFAULT_MIN_CHUNK + 33;
    let grad = pseudo_random(n, 7, 1.0);

    let mut model_residual = vec![0.0f32; n];
    let want = mxnet_quantize_2bit(&grad, &mut model_residual, 0.5);
    let c = TwoBitCompressor::new(0.5).unwrap();
    let mut residual = vec![0.0f32; n];
    let mut out = vec![0u8; c.compressed_len(n)];
    c.quantize(&grad, &mut residual, &mut out).unwrap();
    assert!(out == want, "2bit large output differs");
    assert!(
        bits(&residual) == bits(&model_residual),
        "2bit large residual differs"
    );

    let mut model_residual = vec![0.0f32; n];
    let want = mxnet_quantize_1bit(&grad, &mut model_residual, 0.5);
    let c = OneBitCompressor::new(0.5).unwrap();
    let mut residual = vec![0.0f32; n];
    let mut out = vec![0u8; c.compressed_len(n)];
    c.quantize(&grad, &mut residual, &mut out).unwrap();
    assert!(out == want, "1bit large output differs");
    assert!(
        bits(&residual) == bits(&model_residual),
        "1bit large residual differs"
    );
}

#[test]
fn trait_objects_work_for_both_schemes() {
    let compressors: Vec<Box<dyn Compressor>> = vec![
        Box::new(TwoBitCompressor::new(0.5).unwrap()),
        Box::new(OneBitCompressor::new(0.5).unwrap()),
    ];
    for c in compressors {
        let grad = pseudo_random(100, 3, 1.0);
        let mut residual = vec![0.0; 100];
        let mut out = vec![0; c.compressed_len(100)];
        c.quantize(&grad, &mut residual, &mut out).unwrap();
        let mut values = vec![0.0; 100];
        c.dequantize(&out, &mut values).unwrap();
        assert!(values
            .iter()
            .all(|v| v.abs() == 0.5 || v.abs() == 1.0 || *v == 0.0));
    }
}

#[test]
fn forced_levels_are_reported() {
    for level in SimdLevel::supported() {
        let c = TwoBitCompressor::new(0.5)
            .unwrap()
            .with_simd(level)
            .unwrap();
        assert_eq!(c.simd(), level);
    }
}
