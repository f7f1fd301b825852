//! Property tests (proptest) of both schemes on every code path.

mod common;

use common::*;
use proptest::prelude::*;
use psnet_compression::{one_bit, two_bit, Parallelism, SimdLevel, TwoBitCompressor};

/// Mostly ordinary values, with all the special ones and arbitrary bit patterns mixed in.
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -2.0f32..2.0,
        1 => prop::sample::select(vec![
            0.0f32,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -1e-40,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            0.5,
            -0.5,
            1.0,
            -1.0,
        ]),
        1 => any::<u32>().prop_map(f32::from_bits),
    ]
}

/// Interesting lengths: the word boundaries, small ones, and a few thousand (vector loops and
/// the eager parallel split).
fn len() -> impl Strategy<Value = usize> {
    prop_oneof![
        prop::sample::select(vec![0usize, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65]),
        0usize..200,
        1000usize..5000,
    ]
}

fn vec_of(n: usize, s: impl Strategy<Value = f32>) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(s, n)
}

/// (gradients for `rounds` rounds, initial residual, element offset for misaligned slices).
fn case() -> impl Strategy<Value = (Vec<Vec<f32>>, Vec<f32>, usize)> {
    (len(), 1usize..4, 0usize..4).prop_flat_map(|(n, rounds, offset)| {
        (
            prop::collection::vec(vec_of(n, value()), rounds),
            vec_of(n, value()),
            Just(offset),
        )
    })
}

fn threshold_2bit() -> impl Strategy<Value = f32> {
    prop_oneof![
        prop::sample::select(vec![0.5f32, 1.0, 1e-3, 1e-40, 4.0]),
        1e-6f32..10.0,
    ]
}

fn threshold_1bit() -> impl Strategy<Value = f32> {
    prop_oneof![
        prop::sample::select(vec![0.5f32, 0.0, -0.5, 1.0, f32::INFINITY]),
        -2.0f32..2.0,
    ]
}

/// Runs all rounds on every path; checks them against the model and each other.
fn all_paths_2bit(grads: &[Vec<f32>], residual0: &[f32], offset: usize, t: f32) {
    let n = residual0.len();
    let mut model_r = residual0.to_vec();
    let want: Vec<Vec<u8>> = grads
        .iter()
        .map(|g| mxnet_quantize_2bit(g, &mut model_r, t))
        .collect();
    for (name, c) in two_bit_paths(t) {
        let mut r = misaligned(residual0, offset);
        let mut out = vec![0x5Au8; two_bit::compressed_size(n) + offset];
        for (g, want) in grads.iter().zip(&want) {
            let g = misaligned(g, offset);
            c.quantize(&g[offset..], &mut r[offset..], &mut out[offset..])
                .unwrap();
            assert_bytes_eq(&out[offset..], want, &name);
        }
        assert_bits_eq(&r[offset..], &model_r, &name);
    }
}

fn all_paths_1bit(grads: &[Vec<f32>], residual0: &[f32], offset: usize, t: f32) {
    let n = residual0.len();
    let mut model_r = residual0.to_vec();
    let want: Vec<Vec<u8>> = grads
        .iter()
        .map(|g| mxnet_quantize_1bit(g, &mut model_r, t))
        .collect();
    for (name, c) in one_bit_paths(t) {
        let mut r = misaligned(residual0, offset);
        let mut out = vec![0x5Au8; one_bit::compressed_size(n) + offset];
        for (g, want) in grads.iter().zip(&want) {
            let g = misaligned(g, offset);
            c.quantize(&g[offset..], &mut r[offset..], &mut out[offset..])
                .unwrap();
            assert_bytes_eq(&out[offset..], want, &name);
        }
        assert_bits_eq(&r[offset..], &model_r, &name);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Every path (each SIMD level, sequential and split, misaligned slices) equals the MXNet
    /// model, hence each other, bit for bit, over several rounds.
    #[test]
    fn two_bit_paths_equal_model((grads, r0, offset) in case(), t in threshold_2bit()) {
        all_paths_2bit(&grads, &r0, offset, t);
    }

    #[test]
    fn one_bit_paths_equal_model((grads, r0, offset) in case(), t in threshold_1bit()) {
        all_paths_1bit(&grads, &r0, offset, t);
    }

    /// Output length, and each code in its documented bits: element i in byte i >> 2, pair
    /// (6 - 2 * (i & 3)); 11 iff r + g >= t, 10 iff r + g <= -t; padding 00.
    #[test]
    fn two_bit_layout(grad in len().prop_flat_map(|n| vec_of(n, value())), t in threshold_2bit()) {
        let n = grad.len();
        let c = TwoBitCompressor::new(t).unwrap();
        prop_assert_eq!(c.compressed_len(n), 4 * n.div_ceil(16));
        let mut r = vec![0.0f32; n];
        let mut out = vec![0xFFu8; c.compressed_len(n)];
        c.quantize(&grad, &mut r, &mut out).unwrap();
        for slot in 0..out.len() * 4 {
            let code = (out[slot >> 2] >> (6 - 2 * (slot & 3))) & 3;
            let want = match grad.get(slot) {
                None => 0,
                Some(&g) if g >= t => 0b11,
                Some(&g) if g <= -t => 0b10,
                Some(_) => 0,
            };
            prop_assert_eq!(code, want, "slot {}", slot);
        }
    }

    /// Element i is bit 0x80 >> (i & 7) of byte i >> 3, set iff r + g > t; padding 0.
    #[test]
    fn one_bit_layout(grad in len().prop_flat_map(|n| vec_of(n, value())), t in threshold_1bit()) {
        let n = grad.len();
        let c = psnet_compression::OneBitCompressor::new(t).unwrap();
        prop_assert_eq!(c.compressed_len(n), 4 * n.div_ceil(32));
        let mut r = vec![0.0f32; n];
        let mut out = vec![0xFFu8; c.compressed_len(n)];
        c.quantize(&grad, &mut r, &mut out).unwrap();
        for slot in 0..out.len() * 8 {
            let bit = out[slot >> 3] & (0x80 >> (slot & 7)) != 0;
            let want = grad.get(slot).is_some_and(|&g| g > t);
            prop_assert_eq!(bit, want, "slot {}", slot);
        }
    }

    /// For finite inputs, dequantized + residual_out == residual_in + grad up to the rounding
    /// of the two float operations.
    #[test]
    fn two_bit_error_feedback_conserves(
        (g, r0) in len().prop_flat_map(|n| (vec_of(n, -100.0f32..100.0), vec_of(n, -100.0f32..100.0))),
        t in threshold_2bit(),
    ) {
        let c = TwoBitCompressor::new(t).unwrap();
        let mut r = r0.clone();
        let mut out = vec![0u8; c.compressed_len(g.len())];
        c.quantize(&g, &mut r, &mut out).unwrap();
        let mut d = vec![0.0f32; g.len()];
        c.dequantize(&out, &mut d).unwrap();
        for i in 0..g.len() {
            let lhs = f64::from(d[i]) + f64::from(r[i]);
            let rhs = f64::from(r0[i]) + f64::from(g[i]);
            let tol = 2.0 * f64::from(f32::EPSILON) * (f64::from(r0[i]).abs() + f64::from(g[i]).abs() + f64::from(t));
            prop_assert!((lhs - rhs).abs() <= tol, "i={} {} vs {}", i, lhs, rhs);
        }
    }

    #[test]
    fn one_bit_error_feedback_conserves(
        (g, r0) in len().prop_flat_map(|n| (vec_of(n, -100.0f32..100.0), vec_of(n, -100.0f32..100.0))),
        t in threshold_1bit(),
    ) {
        let c = psnet_compression::OneBitCompressor::new(t).unwrap();
        let mut r = r0.clone();
        let mut out = vec![0u8; c.compressed_len(g.len())];
        c.quantize(&g, &mut r, &mut out).unwrap();
        let mut d = vec![0.0f32; g.len()];
        c.dequantize(&out, &mut d).unwrap();
        for i in 0..g.len() {
            let lhs = f64::from(d[i]) + f64::from(r[i]);
            let rhs = f64::from(r0[i]) + f64::from(g[i]);
            let tol = 2.0 * f64::from(f32::EPSILON) * (f64::from(r0[i]).abs() + f64::from(g[i]).abs() + 1.0);
            prop_assert!((lhs - rhs).abs() <= tol, "i={} {} vs {}", i, lhs, rhs);
        }
    }

    /// Starting from zero, gradients bounded by |g| <= t keep |r| <= t forever (2-bit).
    #[test]
    fn two_bit_residual_stays_bounded(
        t in threshold_2bit().prop_filter("normal", |t| *t > 1e-30),
        rounds in prop::collection::vec(prop::collection::vec(-1.0f32..=1.0, 40), 1..20),
    ) {
        let c = TwoBitCompressor::new(t).unwrap();
        let mut r = vec![0.0f32; 40];
        let mut out = vec![0u8; c.compressed_len(40)];
        for unit in rounds {
            let g: Vec<f32> = unit.iter().map(|u| u * t).collect();
            c.quantize(&g, &mut r, &mut out).unwrap();
            prop_assert!(r.iter().all(|r| r.abs() <= t), "{:?}", r);
        }
    }

    /// With |g| <= 1 and |t| <= 1, the 1-bit residual stays within t - 2 ..= t + 2.
    #[test]
    fn one_bit_residual_stays_bounded(
        t in -1.0f32..=1.0,
        rounds in prop::collection::vec(prop::collection::vec(-1.0f32..=1.0, 40), 1..20),
    ) {
        let c = psnet_compression::OneBitCompressor::new(t).unwrap();
        let mut r = vec![0.0f32; 40];
        let mut out = vec![0u8; c.compressed_len(40)];
        for g in rounds {
            c.quantize(&g, &mut r, &mut out).unwrap();
            prop_assert!(r.iter().all(|r| (r - t).abs() <= 2.0 + 1e-5), "{:?}", r);
        }
    }

    /// dequantize and dequantize-add on every path equal the model's decoding (and the sum
    /// `acc + decoded`, including -0.0 and NaN accumulators), for arbitrary bytes (01 codes too).
    #[test]
    fn dequantize_paths_equal_model(
        (bytes, acc, offset) in len().prop_flat_map(|n| (
            prop::collection::vec(any::<u8>(), two_bit::compressed_size(n)),
            vec_of(n, value()),
            0usize..4,
        )),
        t in threshold_2bit(),
    ) {
        let n = acc.len();
        let decoded2 = mxnet_dequantize_2bit(&bytes, n, t);
        for (name, c) in two_bit_paths(t) {
            let mut d = misaligned(&vec![f32::NAN; n], offset);
            c.dequantize(&bytes, &mut d[offset..]).unwrap();
            assert_bits_eq(&d[offset..], &decoded2, &name);
            let mut a = misaligned(&acc, offset);
            c.dequantize_add(&bytes, &mut a[offset..]).unwrap();
            let want: Vec<f32> = acc.iter().zip(&decoded2).map(|(a, d)| a + d).collect();
            assert_bits_eq(&a[offset..], &want, &name);
        }
        let bytes1 = &bytes[..one_bit::compressed_size(n)];
        let decoded1 = mxnet_dequantize_1bit(bytes1, n);
        for (name, c) in one_bit_paths(t) {
            let mut d = misaligned(&vec![f32::NAN; n], offset);
            c.dequantize(bytes1, &mut d[offset..]).unwrap();
            assert_bits_eq(&d[offset..], &decoded1, &name);
            let mut a = misaligned(&acc, offset);
            c.dequantize_add(bytes1, &mut a[offset..]).unwrap();
            let want: Vec<f32> = acc.iter().zip(&decoded1).map(|(a, d)| a + d).collect();
            assert_bits_eq(&a[offset..], &want, &name);
        }
    }

    /// Any split (thread count, chunk size) gives the sequential result.
    #[test]
    fn parallel_equals_sequential(
        n in 0usize..20_000,
        threads in 2usize..8,
        min_chunk in 1usize..5000,
        seed in any::<u64>(),
    ) {
        let grad = pseudo_random(n, seed, 1.0);
        for level in SimdLevel::supported() {
            let seq = TwoBitCompressor::new(0.5).unwrap().with_simd(level).unwrap()
                .with_parallelism(Parallelism::sequential());
            let par = seq.with_parallelism(Parallelism::threads(threads).with_min_chunk(min_chunk));
            let (mut r1, mut r2) = (vec![0.1f32; n], vec![0.1f32; n]);
            let (mut o1, mut o2) = (vec![0u8; seq.compressed_len(n)], vec![1u8; seq.compressed_len(n)]);
            seq.quantize(&grad, &mut r1, &mut o1).unwrap();
            par.quantize(&grad, &mut r2, &mut o2).unwrap();
            prop_assert_eq!(&o1, &o2);
            prop_assert_eq!(bits(&r1), bits(&r2));
            let (mut a1, mut a2) = (grad.clone(), grad.clone());
            seq.dequantize_add(&o1, &mut a1).unwrap();
            par.dequantize_add(&o1, &mut a2).unwrap();
            prop_assert_eq!(bits(&a1), bits(&a2));

            let seq = psnet_compression::OneBitCompressor::new(0.0).unwrap().with_simd(level).unwrap()
                .with_parallelism(Parallelism::sequential());
            let par = seq.with_parallelism(Parallelism::threads(threads).with_min_chunk(min_chunk));
            let (mut r1, mut r2) = (vec![0.1f32; n], vec![0.1f32; n]);
            let (mut o1, mut o2) = (vec![0u8; seq.compressed_len(n)], vec![1u8; seq.compressed_len(n)]);
            seq.quantize(&grad, &mut r1, &mut o1).unwrap();
            par.quantize(&grad, &mut r2, &mut o2).unwrap();
            prop_assert_eq!(&o1, &o2);
            prop_assert_eq!(bits(&r1), bits(&r2));
            let (mut a1, mut a2) = (grad.clone(), grad.clone());
            seq.dequantize(&o1, &mut a1).unwrap();
            par.dequantize(&o1, &mut a2).unwrap();
            prop_assert_eq!(bits(&a1), bits(&a2));
        }
    }
}
