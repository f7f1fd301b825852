//! Shared test helpers: a plain model of MXNet's kernels (straight from the spec) and the list
//! of every code path to compare against it.
#![allow(dead_code)]

use psnet_compression::{OneBitCompressor, Parallelism, SimdLevel, TwoBitCompressor};

/// MXNet `quantize_2bit`, written as in `gradient_compression-inl.h`: the block is zeroed, then
/// per element `residual += grad` and at most one threshold step.
pub fn mxnet_quantize_2bit(grad: &[f32], residual: &mut [f32], threshold: f32) -> Vec<u8> {
    let posbits = [0xC0u8, 0x30, 0x0C, 0x03];
    let negbits = [0x80u8, 0x20, 0x08, 0x02];
    let pos_threshold = threshold;
    let neg_threshold = -threshold;
    let mut out = vec![0u8; 4 * grad.len().div_ceil(16)];
    for i in 0..grad.len() {
        residual[i] += grad[i];
        if residual[i] >= pos_threshold {
            out[i >> 2] |= posbits[i & 3];
            residual[i] -= pos_threshold;
        } else if residual[i] <= neg_threshold {
            out[i >> 2] |= negbits[i & 3];
            residual[i] -= neg_threshold;
        }
    }
    out
}

/// MXNet `dequantize_2bit`: `masked == mask` → `+t`, `masked == negmask` → `-t`, else 0.
pub fn mxnet_dequantize_2bit(compressed: &[u8], n: usize, threshold: f32) -> Vec<f32> {
    let posbits = [0xC0u8, 0x30, 0x0C, 0x03];
    let negbits = [0x80u8, 0x20, 0x08, 0x02];
    (0..n)
        .map(|i| {
            let masked = compressed[i >> 2] & posbits[i & 3];
            if masked == posbits[i & 3] {
                threshold
            } else if masked == negbits[i & 3] {
                -threshold
            } else {
                0.0
            }
        })
        .collect()
}

/// MXNet 2.x `quantize_1bit`.
pub fn mxnet_quantize_1bit(grad: &[f32], residual: &mut [f32], threshold: f32) -> Vec<u8> {
    let bits = [0x80u8, 0x40, 0x20, 0x10, 0x08, 0x04, 0x02, 0x01];
    let mut out = vec![0u8; 4 * grad.len().div_ceil(32)];
    for i in 0..grad.len() {
        residual[i] += grad[i];
        if residual[i] > threshold {
            out[i >> 3] |= bits[i & 7];
            residual[i] -= 1.0;
        } else {
            residual[i] += 1.0;
        }
    }
    out
}

/// MXNet 2.x `dequantize_1bit`.
pub fn mxnet_dequantize_1bit(compressed: &[u8], n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mask = 0x80u8 >> (i & 7);
            if compressed[i >> 3] & mask == mask {
                1.0
            } else {
                -1.0
            }
        })
        .collect()
}

/// A split that kicks in above 1024 elements, to exercise the parallel path on small arrays.
pub fn eager_parallel() -> Parallelism {
    Parallelism::threads(3).with_min_chunk(1)
}

/// Every 2-bit code path on this machine: each supported SIMD level, sequential and split.
pub fn two_bit_paths(threshold: f32) -> Vec<(String, TwoBitCompressor)> {
    let base = TwoBitCompressor::new(threshold).unwrap();
    let mut paths = Vec::new();
    for level in SimdLevel::supported() {
        let c = base.with_simd(level).unwrap();
        paths.push((
            format!("{level}/seq"),
            c.with_parallelism(Parallelism::sequential()),
        ));
        paths.push((format!("{level}/par"), c.with_parallelism(eager_parallel())));
    }
    paths
}

/// Every 1-bit code path on this machine.
pub fn one_bit_paths(threshold: f32) -> Vec<(String, OneBitCompressor)> {
    let base = OneBitCompressor::new(threshold).unwrap();
    let mut paths = Vec::new();
    for level in SimdLevel::supported() {
        let c = base.with_simd(level).unwrap();
        paths.push((
            format!("{level}/seq"),
            c.with_parallelism(Parallelism::sequential()),
        ));
        paths.push((format!("{level}/par"), c.with_parallelism(eager_parallel())));
    }
    paths
}

/// Bit patterns (0.0 != -0.0), with every NaN mapped to one pattern (see [`same_float`]).
pub fn bits(values: &[f32]) -> Vec<u32> {
    values
        .iter()
        .map(|v| if v.is_nan() { 0x7FC0_0000 } else { v.to_bits() })
        .collect()
}

/// Deterministic pseudo-random values in [-scale, scale), with every 37th a special value.
pub fn pseudo_random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let specials = [
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        -1e-40,
        0.5,
        -0.5,
    ];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            if i % 37 == 36 {
                specials[(state % specials.len() as u64) as usize]
            } else {
                ((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
            }
        })
        .collect()
}

/// `v` copied into a buffer at element offset `offset`, to get slices that are not 16- or
/// 32-byte aligned.
pub fn misaligned(v: &[f32], offset: usize) -> Vec<f32> {
    let mut buf = vec![0.0; offset];
    buf.extend_from_slice(v);
    buf
}

/// Bit-identical, except that any NaN equals any NaN: Rust (like C++) leaves the payload and
/// sign of a NaN produced from two NaN operands unspecified, and LLVM may swap the operands of
/// a commutative `fadd`, so no implementation can promise NaN bits.
pub fn same_float(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Asserts two float slices are identical per [`same_float`], reporting the first difference.
#[track_caller]
pub fn assert_bits_eq(got: &[f32], want: &[f32], context: &str) {
    assert_eq!(got.len(), want.len(), "{context}: length");
    if let Some(i) = (0..got.len()).find(|&i| !same_float(got[i], want[i])) {
        panic!(
            "{context}: first difference at {i}: got {} ({:#010x}), want {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// Asserts two byte slices are equal, reporting the first difference only.
#[track_caller]
pub fn assert_bytes_eq(got: &[u8], want: &[u8], context: &str) {
    assert_eq!(got.len(), want.len(), "{context}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{context}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}
