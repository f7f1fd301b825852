//! MXNet 2.x `1bit` compression (`src/kvstore/gradient_compression-inl.h`, MXNet 2.0).
//!
//! # Format
//! `n` elements compress to `4 * ceil(n / 32)` bytes (MXNet counts 32 elements per `f32`
//! word). Element `i` is bit `0x80 >> (i & 7)` of byte `i >> 3`; padding bits and bytes past
//! `n` are zero.
//!
//! # Error feedback
//! Per element, in `f32` arithmetic: `r += g; if r > t {1; r -= 1} else {0; r += 1}`.
//! Bits decode to `+1.0` (1) and `-1.0` (0): the threshold is only the decision point, not the
//! magnitude. NaN compares false: bit 0, residual stays NaN. `+Inf` gives 1, `-Inf` gives 0,
//! and the residual stays infinite.
//!
//! # Threshold
//! As in MXNet 2.x, which only checks `threshold > 0` for `2bit`, any threshold is accepted
//! (zero, negative, infinite) except NaN, which would make every element decode to `-1` forever
//! and is refused as a configuration mistake.
//!
//! # Denormals
//! MXNet 2.x enables flush-to-zero / denormals-are-zero by default, so subnormal gradients and
//! residuals behave as zero there. This crate never flushes (like MXNet 1.9.1); results differ
//! from MXNet 2.x only when subnormal values occur.

mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::compressor::{check_dequantize, check_quantize, Compressor, Scheme};
use crate::error::{CompressionError, ParamsError};
use crate::parallel::{self, Parallelism};
use crate::simd::SimdLevel;

/// Size in bytes of `n` elements compressed with 1-bit: `4 * ceil(n / 32)`.
pub fn compressed_size(n: usize) -> usize {
    Scheme::OneBit.compressed_size(n)
}

/// Checks a 1-bit threshold: anything but NaN (see the [module docs](self#threshold)).
pub fn validate_threshold(threshold: f32) -> Result<f32, ParamsError> {
    if threshold.is_nan() {
        Err(ParamsError::InvalidThreshold {
            scheme: "1bit",
            threshold,
            reason: "must be a number (got NaN)",
        })
    } else {
        Ok(threshold)
    }
}

/// MXNet 2.x `1bit` compressor with a fixed decision threshold.
///
/// Cheap to copy; holds no buffers. The residual belongs to the caller (one per key and
/// worker, zero-initialised, as in MXNet).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OneBitCompressor {
    threshold: f32,
    /// Invariant: supported by this CPU.
    simd: SimdLevel,
    parallelism: Parallelism,
}

crate::compressor::compressor_settings!(OneBitCompressor);

impl OneBitCompressor {
    /// A compressor deciding at `threshold` (anything but NaN), with the detected SIMD level
    /// and [`Parallelism::auto`].
    pub fn new(threshold: f32) -> Result<Self, ParamsError> {
        Ok(OneBitCompressor {
            threshold: validate_threshold(threshold)?,
            simd: SimdLevel::detect(),
            parallelism: Parallelism::auto(),
        })
    }

    /// Size in bytes of `n` compressed elements (see [`compressed_size`]).
    pub fn compressed_len(&self, n: usize) -> usize {
        compressed_size(n)
    }

    /// Adds `grad` into `residual`, writes one bit per element to `out` (all
    /// [`compressed_size(grad.len())`](compressed_size) bytes, padding zeroed) and subtracts
    /// the encoded `±1` from `residual`. See [`Compressor::quantize`].
    pub fn quantize(
        &self,
        grad: &[f32],
        residual: &mut [f32],
        out: &mut [u8],
    ) -> Result<(), CompressionError> {
        check_quantize(Scheme::OneBit, grad, residual, out)?;
        let (level, t) = (self.simd, self.threshold);
        parallel::quantize_chunks(self.parallelism, 8, grad, residual, out, |g, r, o| {
            quantize_with(level, g, r, o, t)
        });
        Ok(())
    }

    /// Decodes `compressed` into `out`: `+1.0` or `-1.0`.
    pub fn dequantize(&self, compressed: &[u8], out: &mut [f32]) -> Result<(), CompressionError> {
        check_dequantize(Scheme::OneBit, compressed, out)?;
        let level = self.simd;
        parallel::dequantize_chunks(self.parallelism, 8, compressed, out, |c, o| {
            dequantize_with::<false>(level, c, o)
        });
        Ok(())
    }

    /// `acc[i] += decoded[i]`, for servers summing workers' pushes.
    pub fn dequantize_add(
        &self,
        compressed: &[u8],
        acc: &mut [f32],
    ) -> Result<(), CompressionError> {
        check_dequantize(Scheme::OneBit, compressed, acc)?;
        let level = self.simd;
        parallel::dequantize_chunks(self.parallelism, 8, compressed, acc, |c, o| {
            dequantize_with::<true>(level, c, o)
        });
        Ok(())
    }
}

/// Sequential quantize with the given level (which must be supported: see the field invariant).
fn quantize_with(level: SimdLevel, grad: &[f32], residual: &mut [f32], out: &mut [u8], t: f32) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` comes from a `OneBitCompressor`, whose level is always supported
        // by this CPU (`SimdLevel::detect` / `SimdLevel::check`).
        SimdLevel::Avx2 => unsafe { x86::quantize_avx2(grad, residual, out, t) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (SSE2 is part of the x86-64 baseline anyway).
        SimdLevel::Sse2 => unsafe { x86::quantize_sse2(grad, residual, out, t) },
        _ => scalar::quantize(grad, residual, out, t),
    }
}

/// Sequential dequantize (`ADD`: accumulate) with the given, supported, level.
fn dequantize_with<const ADD: bool>(level: SimdLevel, compressed: &[u8], out: &mut [f32]) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level of a `OneBitCompressor` is supported by this CPU.
        SimdLevel::Avx2 => unsafe { x86::dequantize_avx2::<ADD>(compressed, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (SSE2 is part of the x86-64 baseline anyway).
        SimdLevel::Sse2 => unsafe { x86::dequantize_sse2::<ADD>(compressed, out) },
        _ if ADD => scalar::dequantize_add(compressed, out),
        _ => scalar::dequantize(compressed, out),
    }
}

impl Compressor for OneBitCompressor {
    fn scheme(&self) -> Scheme {
        Scheme::OneBit
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
        OneBitCompressor::quantize(self, grad, residual, out)
    }

    fn dequantize(&self, compressed: &[u8], out: &mut [f32]) -> Result<(), CompressionError> {
        OneBitCompressor::dequantize(self, compressed, out)
    }

    fn dequantize_add(&self, compressed: &[u8], acc: &mut [f32]) -> Result<(), CompressionError> {
        OneBitCompressor::dequantize_add(self, compressed, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_validation() {
        for ok in [0.5, 0.0, -0.0, -3.0, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(OneBitCompressor::new(ok).unwrap().threshold(), ok);
        }
        let err = OneBitCompressor::new(f32::NAN).unwrap_err();
        assert!(matches!(
            err,
            ParamsError::InvalidThreshold { scheme: "1bit", .. }
        ));
    }
}
