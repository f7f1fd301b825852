//! The interface shared by the compression schemes.

use std::fmt;
use std::str::FromStr;

use crate::error::{CompressionError, ParamsError};

/// A compression scheme, by its MXNet name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// MXNet `2bit`: `+t` / `-t` / `0`, 16 elements per 32-bit word.
    TwoBit,
    /// MXNet 2.x `1bit`: `+1` / `-1`, 32 elements per 32-bit word.
    OneBit,
}

impl Scheme {
    /// The MXNet name: `"2bit"` or `"1bit"`.
    pub fn name(self) -> &'static str {
        match self {
            Scheme::TwoBit => "2bit",
            Scheme::OneBit => "1bit",
        }
    }

    /// Elements per compressed 32-bit word (MXNet's `GetCompressionFactor`): 16 or 32.
    pub fn factor(self) -> usize {
        match self {
            Scheme::TwoBit => 16,
            Scheme::OneBit => 32,
        }
    }

    /// Size in bytes of `n` compressed elements: `4 * ceil(n / factor)`.
    pub fn compressed_size(self, n: usize) -> usize {
        4 * n.div_ceil(self.factor())
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Scheme {
    type Err = ParamsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "2bit" => Ok(Scheme::TwoBit),
            "1bit" => Ok(Scheme::OneBit),
            other => Err(ParamsError::UnknownType(other.to_owned())),
        }
    }
}

/// A gradient compressor with error feedback (residual), as used by MXNet's kvstore.
///
/// All slices are plain `f32` / `u8` buffers; lengths are checked and a wrong length is a
/// [`CompressionError::LengthMismatch`] with nothing written.
pub trait Compressor: fmt::Debug + Send + Sync {
    /// The scheme.
    fn scheme(&self) -> Scheme;

    /// The threshold the compressor was created with.
    fn threshold(&self) -> f32;

    /// Size in bytes of `n` compressed elements.
    fn compressed_len(&self, n: usize) -> usize {
        self.scheme().compressed_size(n)
    }

    /// Worker side: adds `grad` into `residual`, writes the codes to `out` and subtracts what
    /// the codes stand for from `residual`.
    ///
    /// `residual.len()` must equal `grad.len()`, `out.len()` must equal
    /// [`compressed_len(grad.len())`](Self::compressed_len). Every byte of `out` is written
    /// (padding codes are zero).
    fn quantize(
        &self,
        grad: &[f32],
        residual: &mut [f32],
        out: &mut [u8],
    ) -> Result<(), CompressionError>;

    /// Decodes `compressed` into `out` (`compressed.len()` must equal
    /// [`compressed_len(out.len())`](Self::compressed_len)).
    fn dequantize(&self, compressed: &[u8], out: &mut [f32]) -> Result<(), CompressionError>;

    /// Server side: `acc[i] += decoded[i]` without materialising the decoded array
    /// (bit-identical to [`dequantize`](Self::dequantize) into a temporary then adding).
    fn dequantize_add(&self, compressed: &[u8], acc: &mut [f32]) -> Result<(), CompressionError>;

    /// `out[i] = decoded_0[i] + decoded_1[i] + ...`, the codes of every part decoded and
    /// added in `parts`' order in `f32`: bit for bit what [`dequantize`](Self::dequantize)
    /// of the first part then [`dequantize_add`](Self::dequantize_add) of each other one
    /// give. Every part must be [`compressed_len(out.len())`](Self::compressed_len) bytes
    /// (nothing is written otherwise); with no parts, `out` is all `+0.0`.
    ///
    /// Compressors may override it to make one pass over `out` instead of one per part:
    /// an allreduce's ranks' codes are summed so.
    fn dequantize_sum(&self, parts: &[&[u8]], out: &mut [f32]) -> Result<(), CompressionError> {
        check_dequantize_parts(self.scheme(), parts, out)?;
        match parts.split_first() {
            None => out.fill(0.0),
            Some((first, rest)) => {
                self.dequantize(first, out)?;
                for part in rest {
                    self.dequantize_add(part, out)?;
                }
            }
        }
        Ok(())
    }
}

/// Checks the lengths of a quantize call.
pub(crate) fn check_quantize(
    scheme: Scheme,
    grad: &[f32],
    residual: &[f32],
    out: &[u8],
) -> Result<(), CompressionError> {
    let n = grad.len();
    CompressionError::check_len("residual", n, n, residual.len())?;
    CompressionError::check_len("compressed output", n, scheme.compressed_size(n), out.len())
}

/// Checks the lengths of a dequantize call.
pub(crate) fn check_dequantize(
    scheme: Scheme,
    compressed: &[u8],
    values: &[f32],
) -> Result<(), CompressionError> {
    let n = values.len();
    CompressionError::check_len(
        "compressed input",
        n,
        scheme.compressed_size(n),
        compressed.len(),
    )
}

/// Checks the lengths of a [`Compressor::dequantize_sum`] call: every part's.
pub(crate) fn check_dequantize_parts(
    scheme: Scheme,
    parts: &[&[u8]],
    values: &[f32],
) -> Result<(), CompressionError> {
    parts
        .iter()
        .try_for_each(|part| check_dequantize(scheme, part, values))
}

/// The settings every compressor type shares: SIMD level and thread split, with their
/// builders and getters, and the threshold getter. The type needs the fields `threshold`,
/// `simd` and `parallelism`.
macro_rules! compressor_settings {
    ($ty:ident) => {
        impl $ty {
            /// Forces a SIMD level; an error if this CPU does not support it.
            pub fn with_simd(
                mut self,
                level: $crate::simd::SimdLevel,
            ) -> Result<Self, $crate::error::CompressionError> {
                self.simd = level.check()?;
                Ok(self)
            }

            /// Sets how large arrays are split across threads.
            #[must_use]
            pub fn with_parallelism(mut self, parallelism: $crate::parallel::Parallelism) -> Self {
                self.parallelism = parallelism;
                self
            }

            /// The threshold the compressor was created with.
            pub fn threshold(&self) -> f32 {
                self.threshold
            }

            /// The SIMD level in use.
            pub fn simd(&self) -> $crate::simd::SimdLevel {
                self.simd
            }

            /// The thread split in use.
            pub fn parallelism(&self) -> $crate::parallel::Parallelism {
                self.parallelism
            }
        }
    };
}
pub(crate) use compressor_settings;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (n, two, one) in [
            (0, 0, 0),
            (1, 4, 4),
            (15, 4, 4),
            (16, 4, 4),
            (17, 8, 4),
            (31, 8, 4),
            (32, 8, 4),
            (33, 12, 8),
            (1 << 24, 1 << 22, 1 << 21),
        ] {
            assert_eq!(Scheme::TwoBit.compressed_size(n), two, "2bit n={n}");
            assert_eq!(Scheme::OneBit.compressed_size(n), one, "1bit n={n}");
        }
    }

    #[test]
    fn names() {
        assert_eq!("2bit".parse::<Scheme>(), Ok(Scheme::TwoBit));
        assert_eq!("1bit".parse::<Scheme>(), Ok(Scheme::OneBit));
        assert!("3bit".parse::<Scheme>().is_err());
        assert_eq!(Scheme::OneBit.to_string(), "1bit");
    }
}
