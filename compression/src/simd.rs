//! Run-time choice of the SIMD code path.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use crate::error::CompressionError;

/// Environment variable capping the SIMD level picked by [`SimdLevel::detect`]:
/// `avx2`, `sse2` or `scalar` (case-insensitive). A level the CPU lacks falls back to the
/// best supported one below it; an unrecognised value is ignored with a warning.
pub const SIMD_ENV_VAR: &str = psnet_config::env::PSNET_COMPRESSION_SIMD.name;

/// A code path for the compression kernels. All levels produce bit-identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust, any architecture.
    Scalar,
    /// x86-64 SSE2 (128-bit vectors).
    Sse2,
    /// x86-64 AVX2 (256-bit vectors).
    Avx2,
}

impl SimdLevel {
    /// All levels, lowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Sse2, SimdLevel::Avx2];

    /// The level used by default: the best level this CPU supports, capped by
    /// [`SIMD_ENV_VAR`] when set. Computed once per process.
    pub fn detect() -> SimdLevel {
        static DETECTED: OnceLock<SimdLevel> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let best = SimdLevel::best_supported();
            match psnet_config::env::PSNET_COMPRESSION_SIMD.get() {
                Some(value) => match value.parse::<SimdLevel>() {
                    Ok(cap) if cap.is_supported() => cap,
                    Ok(cap) => {
                        tracing::warn!(
                            "{SIMD_ENV_VAR}={value}: {cap} is not supported by this CPU, using {best}"
                        );
                        best
                    }
                    Err(e) => {
                        tracing::warn!("{SIMD_ENV_VAR}={value} ignored: {e}");
                        best
                    }
                },
                None => best,
            }
        })
    }

    /// The best level this CPU supports, ignoring [`SIMD_ENV_VAR`].
    pub fn best_supported() -> SimdLevel {
        SimdLevel::ALL
            .into_iter()
            .rev()
            .find(|l| l.is_supported())
            .unwrap_or(SimdLevel::Scalar)
    }

    /// The levels this CPU supports, lowest first (always includes [`SimdLevel::Scalar`]).
    pub fn supported() -> Vec<SimdLevel> {
        SimdLevel::ALL
            .into_iter()
            .filter(|l| l.is_supported())
            .collect()
    }

    /// Whether this CPU can run the level.
    pub fn is_supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Sse2 => std::arch::is_x86_feature_detected!("sse2"),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(not(target_arch = "x86_64"))]
            SimdLevel::Sse2 | SimdLevel::Avx2 => false,
        }
    }

    /// Returns `self` if the CPU supports it, an error otherwise.
    pub fn check(self) -> Result<SimdLevel, CompressionError> {
        if self.is_supported() {
            Ok(self)
        } else {
            Err(CompressionError::UnsupportedSimd(self))
        }
    }

    /// The lowercase name (`"avx2"`, `"sse2"`, `"scalar"`), as accepted by [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Sse2 => "sse2",
            SimdLevel::Avx2 => "avx2",
        }
    }
}

impl fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SimdLevel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "portable" | "none" => Ok(SimdLevel::Scalar),
            "sse2" => Ok(SimdLevel::Sse2),
            "avx2" => Ok(SimdLevel::Avx2),
            other => Err(format!(
                "unknown SIMD level {other:?}: expected avx2, sse2 or scalar"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for level in SimdLevel::ALL {
            assert_eq!(level.name().parse::<SimdLevel>(), Ok(level));
        }
        assert_eq!(" AVX2 ".parse::<SimdLevel>(), Ok(SimdLevel::Avx2));
        assert!("avx512".parse::<SimdLevel>().is_err());
    }

    #[test]
    fn scalar_always_supported_and_detect_is_supported() {
        assert!(SimdLevel::Scalar.is_supported());
        assert!(SimdLevel::supported().contains(&SimdLevel::Scalar));
        assert!(SimdLevel::detect().is_supported());
        assert!(SimdLevel::best_supported() >= SimdLevel::detect());
    }
}
