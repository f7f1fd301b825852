//! MXNet `2bit` compression (MXNet 1.9.1 and 2.x, `src/kvstore/gradient_compression-inl.h`).
//!
//! # Format
//! `n` elements compress to `4 * ceil(n / 16)` bytes. Element `i` lives in byte `i >> 2`,
//! most-significant pair first: `i & 3` = 0, 1, 2, 3 use masks `0xC0`, `0x30`, `0x0C`, `0x03`.
//! Codes: `11` = `+t`, `10` = `-t`, `00` = `0` (`01` also decodes to `0`); padding slots
//! past `n` are `00`.
//!
//! # Error feedback
//! Per element, in `f32` arithmetic, one step per call:
//! `r += g; if r >= t {11; r -= t} else if r <= -t {10; r += t} else {00}`.
//! At most one threshold is subtracted per call, so `|r|` can stay above `t` for many calls.
//! NaN matches neither comparison: it encodes `00` and stays in the residual (as some NaN:
//! like C++, Rust does not specify which NaN bits an operation on NaNs returns). `±Inf`
//! encodes `±t` and the residual stays `±Inf`.

mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::compressor::{
    check_dequantize, check_dequantize_parts, check_quantize, Compressor, Scheme,
};
use crate::error::{CompressionError, ParamsError};
use crate::parallel::{self, Parallelism};
use crate::simd::SimdLevel;

/// Size in bytes of `n` elements compressed with 2-bit: `4 * ceil(n / 16)`.
pub fn compressed_size(n: usize) -> usize {
    Scheme::TwoBit.compressed_size(n)
}

/// The codes of `value - base` at `threshold` (each difference an `f32` subtraction), as
/// one quantization step from a zero residual with the difference as the gradient gives
/// them, and [`crate::scale::magnitudes_from`]`(value - base, threshold)`, in one pass and
/// without writing the difference anywhere. Compressed pulls' codes of a weight's change.
pub fn quantize_difference(
    value: &[f32],
    base: &[f32],
    threshold: f32,
    out: &mut [u8],
) -> (f64, u64) {
    match SimdLevel::detect() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect` only returns levels this CPU supports.
        SimdLevel::Avx2 => unsafe { x86::quantize_difference_avx2(value, base, threshold, out) },
        _ => quantize_difference_portable(value, base, threshold, out),
    }
}

/// [`quantize_difference`] in portable code. The AVX2 kernel makes the same codes and takes
/// the same additions in each of the 32 running sums.
fn quantize_difference_portable(
    value: &[f32],
    base: &[f32],
    threshold: f32,
    out: &mut [u8],
) -> (f64, u64) {
    assert_eq!(value.len(), base.len());
    assert_eq!(out.len(), compressed_size(value.len()));
    const LANES: usize = crate::scale::LANES;
    let code = |r: f32| code_of_difference(r, threshold);
    let (cv, cb) = (value.chunks_exact(LANES), base.chunks_exact(LANES));
    let full = value.len() / LANES;
    let mut rest = [0.0f32; LANES];
    let tail_len = cv.remainder().len();
    for (r, (v, b)) in rest
        .iter_mut()
        .zip(cv.remainder().iter().zip(cb.remainder()))
    {
        *r = v - b;
    }
    let rest = &rest[..tail_len];
    let mut lanes = crate::scale::Lanes::default();
    for ((v, b), o) in cv.zip(cb).zip(out.chunks_exact_mut(LANES / 4)) {
        let r: [f32; LANES] = std::array::from_fn(|lane| v[lane] - b[lane]);
        lanes.add(&r, threshold);
        for (byte, r) in o.iter_mut().zip(r.chunks_exact(4)) {
            *byte = (code(r[0]) << 6) | (code(r[1]) << 4) | (code(r[2]) << 2) | code(r[3]);
        }
    }
    codes_of_tail(rest, &mut out[full * LANES / 4..], threshold);
    lanes.finish(rest.iter().copied(), threshold)
}

/// The code of a difference `r` at `threshold` (ordered compares: a NaN is 0).
#[inline(always)]
fn code_of_difference(r: f32, threshold: f32) -> u8 {
    (u8::from(r >= threshold) * scalar::CODE_POS) | (u8::from(r <= -threshold) * scalar::CODE_NEG)
}

/// The codes of the differences `rest` (fewer than a block's), from element 0 of `out`.
fn codes_of_tail(rest: &[f32], out: &mut [u8], threshold: f32) {
    out.fill(0);
    for (k, &r) in rest.iter().enumerate() {
        out[k / 4] |= code_of_difference(r, threshold) << (6 - 2 * (k % 4));
    }
}

/// The codes of `residual` at `threshold`, written to `out`, and `residual` less what they
/// stand for at `scale`: `scale` off where at least `threshold`, `-scale` off where at most
/// `-threshold`, unchanged elsewhere. Bit for bit what quantizing `residual` as a gradient
/// from a zero residual, decoding the codes with `scale` and subtracting them does, in one
/// pass and without a scratch buffer: the second phase of the compressed allreduce, whose
/// codes stand for a scale of their own. The threshold must be valid as a compressor's
/// ([`validate_threshold`]).
pub fn requantize(
    residual: &mut [f32],
    threshold: f32,
    scale: f32,
    out: &mut [u8],
) -> Result<(), CompressionError> {
    let n = residual.len();
    validate_threshold(threshold)?;
    CompressionError::check_len("compressed output", n, compressed_size(n), out.len())?;
    match SimdLevel::detect() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect` only returns levels this CPU supports.
        SimdLevel::Avx2 => unsafe { x86::requantize_avx2(residual, out, threshold, scale) },
        _ => scalar::requantize(residual, out, threshold, scale),
    }
    Ok(())
}

/// Checks a 2-bit threshold: it must be finite and `> 0` (MXNet checks `> 0`; an infinite
/// threshold would turn every finite gradient into zeros forever, so it is refused too).
pub fn validate_threshold(threshold: f32) -> Result<f32, ParamsError> {
    let reason = if threshold.is_nan() {
        "must be a number (got NaN)"
    } else if threshold.is_infinite() {
        "must be finite"
    } else if threshold <= 0.0 {
        "must be greater than 0"
    } else {
        return Ok(threshold);
    };
    Err(ParamsError::InvalidThreshold {
        scheme: "2bit",
        threshold,
        reason,
    })
}

/// MXNet `2bit` compressor with a fixed threshold.
///
/// Cheap to copy; holds no buffers. The residual belongs to the caller (one per key and
/// worker, zero-initialised, as in MXNet).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TwoBitCompressor {
    threshold: f32,
    /// Invariant: supported by this CPU.
    simd: SimdLevel,
    parallelism: Parallelism,
}

crate::compressor::compressor_settings!(TwoBitCompressor);

impl TwoBitCompressor {
    /// A compressor for `threshold` (finite and `> 0`), with the detected SIMD level and
    /// [`Parallelism::auto`].
    pub fn new(threshold: f32) -> Result<Self, ParamsError> {
        Ok(TwoBitCompressor {
            threshold: validate_threshold(threshold)?,
            simd: SimdLevel::detect(),
            parallelism: Parallelism::auto(),
        })
    }

    /// Size in bytes of `n` compressed elements (see [`compressed_size`]).
    pub fn compressed_len(&self, n: usize) -> usize {
        compressed_size(n)
    }

    /// Adds `grad` into `residual`, writes the 2-bit codes to `out` (all
    /// [`compressed_size(grad.len())`](compressed_size) bytes, padding zeroed) and subtracts
    /// the encoded `±t` from `residual`. See [`Compressor::quantize`].
    pub fn quantize(
        &self,
        grad: &[f32],
        residual: &mut [f32],
        out: &mut [u8],
    ) -> Result<(), CompressionError> {
        check_quantize(Scheme::TwoBit, grad, residual, out)?;
        let (level, t) = (self.simd, self.threshold);
        parallel::quantize_chunks(self.parallelism, 4, grad, residual, out, |g, r, o| {
            quantize_with(level, g, r, o, t)
        });
        Ok(())
    }

    /// Decodes `compressed` into `out`: `+t`, `-t` or `+0.0`.
    pub fn dequantize(&self, compressed: &[u8], out: &mut [f32]) -> Result<(), CompressionError> {
        check_dequantize(Scheme::TwoBit, compressed, out)?;
        let (level, t) = (self.simd, self.threshold);
        parallel::dequantize_chunks(self.parallelism, 4, compressed, out, |c, o| {
            dequantize_with::<false>(level, c, o, t)
        });
        Ok(())
    }

    /// `acc[i] += decoded[i]` (the `00` code adds `+0.0`, exactly like adding a dequantized
    /// array), for servers summing workers' pushes.
    pub fn dequantize_add(
        &self,
        compressed: &[u8],
        acc: &mut [f32],
    ) -> Result<(), CompressionError> {
        check_dequantize(Scheme::TwoBit, compressed, acc)?;
        let (level, t) = (self.simd, self.threshold);
        parallel::dequantize_chunks(self.parallelism, 4, compressed, acc, |c, o| {
            dequantize_with::<true>(level, c, o, t)
        });
        Ok(())
    }

    /// Every part decoded and added in order, in one pass over `out`. See
    /// [`Compressor::dequantize_sum`].
    pub fn dequantize_sum(&self, parts: &[&[u8]], out: &mut [f32]) -> Result<(), CompressionError> {
        check_dequantize_parts(Scheme::TwoBit, parts, out)?;
        let (level, t) = (self.simd, self.threshold);
        parallel::dequantize_sum_chunks(self.parallelism, 4, parts, out, |p, o| {
            dequantize_sum_with(level, p, o, t)
        });
        Ok(())
    }
}

/// Sequential [`TwoBitCompressor::dequantize_sum`] with the given, supported, level.
fn dequantize_sum_with(level: SimdLevel, parts: &[&[u8]], out: &mut [f32], t: f32) {
    let Some((first, rest)) = parts.split_first() else {
        out.fill(0.0);
        return;
    };
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level of a `TwoBitCompressor` is supported by this CPU.
        SimdLevel::Avx2 => unsafe { x86::dequantize_sum_avx2(first, rest, out, t) },
        _ => {
            dequantize_with::<false>(level, first, out, t);
            for part in rest {
                dequantize_with::<true>(level, part, out, t);
            }
        }
    }
}

/// Sequential quantize with the given level (which must be supported: see the field invariant).
fn quantize_with(level: SimdLevel, grad: &[f32], residual: &mut [f32], out: &mut [u8], t: f32) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` comes from a `TwoBitCompressor`, whose level is always supported
        // by this CPU (`SimdLevel::detect` / `SimdLevel::check`).
        SimdLevel::Avx2 => unsafe { x86::quantize_avx2(grad, residual, out, t) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (SSE2 is part of the x86-64 baseline anyway).
        SimdLevel::Sse2 => unsafe { x86::quantize_sse2(grad, residual, out, t) },
        _ => scalar::quantize(grad, residual, out, t),
    }
}

/// Sequential dequantize (`ADD`: accumulate) with the given, supported, level.
fn dequantize_with<const ADD: bool>(level: SimdLevel, compressed: &[u8], out: &mut [f32], t: f32) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level of a `TwoBitCompressor` is supported by this CPU.
        SimdLevel::Avx2 => unsafe { x86::dequantize_avx2::<ADD>(compressed, out, t) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (SSE2 is part of the x86-64 baseline anyway).
        SimdLevel::Sse2 => unsafe { x86::dequantize_sse2::<ADD>(compressed, out, t) },
        _ if ADD => scalar::dequantize_add(compressed, out, t),
        _ => scalar::dequantize(compressed, out, t),
    }
}

impl Compressor for TwoBitCompressor {
    fn scheme(&self) -> Scheme {
        Scheme::TwoBit
    }

    fn threshold(&self) -> f32 {
        self.threshold
    }

    fn quantize(
        &self,
        grad: &[f32],
        residual: &mut [f32],
        out: &mut [u8],
    ) -> Result<(), CompressionError> {
        TwoBitCompressor::quantize(self, grad, residual, out)
    }

    fn dequantize(&self, compressed: &[u8], out: &mut [f32]) -> Result<(), CompressionError> {
        TwoBitCompressor::dequantize(self, compressed, out)
    }

    fn dequantize_add(&self, compressed: &[u8], acc: &mut [f32]) -> Result<(), CompressionError> {
        TwoBitCompressor::dequantize_add(self, compressed, acc)
    }

    fn dequantize_sum(&self, parts: &[&[u8]], out: &mut [f32]) -> Result<(), CompressionError> {
        TwoBitCompressor::dequantize_sum(self, parts, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A level's [`requantize`] kernel.
    type Requantize = fn(&mut [f32], &mut [u8], f32, f32);

    #[test]
    fn threshold_validation() {
        assert!(TwoBitCompressor::new(0.5).is_ok());
        assert!(TwoBitCompressor::new(f32::MIN_POSITIVE / 2.0).is_ok());
        for bad in [0.0, -0.0, -0.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let err = TwoBitCompressor::new(bad).unwrap_err();
            assert!(
                matches!(err, ParamsError::InvalidThreshold { scheme: "2bit", .. }),
                "{err}"
            );
        }
        let msg = TwoBitCompressor::new(0.0).unwrap_err().to_string();
        assert_eq!(
            msg,
            "invalid threshold 0 for 2bit compression: must be greater than 0"
        );
    }

    #[test]
    fn requantizing_refuses_a_bad_threshold_and_a_wrong_length() {
        let mut r = [1.0f32; 20];
        let mut out = [0u8; 8];
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let e = requantize(&mut r, bad, 1.0, &mut out).unwrap_err();
            assert!(matches!(e, CompressionError::Params(_)), "{bad}: {e}");
        }
        let e = requantize(&mut r, 0.5, 1.0, &mut out[..4]).unwrap_err();
        assert!(matches!(
            e,
            CompressionError::LengthMismatch {
                expected: 8,
                actual: 4,
                ..
            }
        ));
        assert_eq!(r, [1.0; 20], "nothing changes on an error");
    }

    proptest::proptest! {
        /// Requantizing is quantizing from a zero residual, decoding with the scale and
        /// subtracting, bit for bit, on every level.
        #[test]
        fn requantizing_is_quantize_decode_subtract(
            xs in proptest::collection::vec(-3.0f32..3.0, 0..140),
            special in 0usize..6,
            threshold in 0.01f32..2.0,
            scale in 0.0f32..4.0,
        ) {
            let mut xs = xs;
            if let Some(x) = xs.first_mut() {
                *x = [f32::INFINITY, f32::NEG_INFINITY, -0.0, threshold, -threshold, *x][special];
            }
            let n = xs.len();
            let mut scratch = vec![0.0f32; n];
            let mut want_codes = vec![0u8; compressed_size(n)];
            scalar::quantize(&xs, &mut scratch, &mut want_codes, threshold);
            scalar::dequantize(&want_codes, &mut scratch, scale);
            let want: Vec<f32> = xs.iter().zip(&scratch).map(|(x, d)| x - d).collect();
            let mut levels: Vec<Requantize> = vec![scalar::requantize, |r, o, t, s| {
                requantize(r, t, s, o).unwrap()
            }];
            #[cfg(target_arch = "x86_64")]
            if SimdLevel::Avx2.is_supported() {
                // SAFETY: the CPU supports AVX2 (checked just above).
                levels.push(|r, o, t, s| unsafe { x86::requantize_avx2(r, o, t, s) });
            }
            for level in levels {
                let mut got = xs.clone();
                let mut codes = vec![0xffu8; want_codes.len()];
                level(&mut got, &mut codes, threshold, scale);
                proptest::prop_assert_eq!(&codes, &want_codes);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                proptest::prop_assert_eq!(bits(&got), bits(&want));
            }
        }

        /// Every level's one pass gives the codes of a quantization step from a zero residual
        /// and the magnitudes of the difference written out, bit for bit.
        #[test]
        fn the_difference_quantized_in_one_pass_is_the_passes(
            pairs in proptest::collection::vec((-3.0f32..3.0, -3.0f32..3.0), 0..140),
            special in 0usize..5,
            threshold in 0.01f32..2.0,
        ) {
            let (mut value, base): (Vec<f32>, Vec<f32>) = pairs.into_iter().unzip();
            if let Some(v) = value.first_mut() {
                *v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, *v][special];
            }
            let mut change: Vec<f32> = value.iter().zip(&base).map(|(v, b)| v - b).collect();
            let want_sums = crate::scale::magnitudes_from(&change, threshold);
            let mut want = vec![0u8; compressed_size(value.len())];
            scalar::quantize(&vec![0.0; value.len()], &mut change, &mut want, threshold);
            let mut levels = vec![quantize_difference_portable as fn(&[f32], &[f32], f32, &mut [u8]) -> (f64, u64)];
            #[cfg(target_arch = "x86_64")]
            if SimdLevel::Avx2.is_supported() {
                // SAFETY: the CPU supports AVX2 (checked just above).
                levels.push(|v, b, t, o| unsafe { x86::quantize_difference_avx2(v, b, t, o) });
            }
            for level in levels {
                let mut got = vec![0xffu8; want.len()];
                let sums = level(&value, &base, threshold, &mut got);
                proptest::prop_assert_eq!(&got, &want);
                proptest::prop_assert_eq!(sums.0.to_bits(), want_sums.0.to_bits());
                proptest::prop_assert_eq!(sums.1, want_sums.1);
            }
        }

        /// The parts' codes summed in one pass: bit for bit the first part decoded and the
        /// others added in order, on every level, whole and split across threads.
        #[test]
        fn the_parts_summed_in_one_pass_are_the_passes(
            len in 0usize..5000,
            count in 0usize..9,
            seed in proptest::prelude::any::<u64>(),
            threshold in 0.01f32..4.0,
        ) {
            let mut state = seed | 1;
            let parts: Vec<Vec<u8>> = (0..count)
                .map(|_| {
                    (0..compressed_size(len))
                        .map(|_| {
                            state ^= state << 13;
                            state ^= state >> 7;
                            state ^= state << 17;
                            state as u8
                        })
                        .collect()
                })
                .collect();
            let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            for level in SimdLevel::ALL.into_iter().filter(|l| l.is_supported()) {
                for par in [Parallelism::sequential(), Parallelism::threads(3).with_min_chunk(1)] {
                    let c = TwoBitCompressor::new(threshold)
                        .unwrap()
                        .with_simd(level)
                        .unwrap()
                        .with_parallelism(par);
                    let mut want = vec![0.0f32; len];
                    for (i, part) in refs.iter().enumerate() {
                        if i == 0 {
                            scalar::dequantize(part, &mut want, threshold);
                        } else {
                            scalar::dequantize_add(part, &mut want, threshold);
                        }
                    }
                    let mut got = vec![f32::NAN; len];
                    Compressor::dequantize_sum(&c, &refs, &mut got).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    proptest::prop_assert_eq!(bits(&got), bits(&want), "{:?} {:?}", level, par);
                }
            }
        }
    }

    #[test]
    fn summing_parts_refuses_a_part_of_the_wrong_length_and_writes_nothing() {
        let c = TwoBitCompressor::new(0.5).unwrap();
        let (good, short) = ([0xffu8; 8], [0xffu8; 4]);
        let mut out = [7.0f32; 20];
        let e = c.dequantize_sum(&[&good, &short], &mut out).unwrap_err();
        assert!(
            matches!(
                e,
                CompressionError::LengthMismatch {
                    expected: 8,
                    actual: 4,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(out, [7.0; 20]);
        c.dequantize_sum(&[], &mut out).unwrap();
        assert!(out.iter().all(|x| x.to_bits() == 0), "no parts: +0.0");
    }
}
