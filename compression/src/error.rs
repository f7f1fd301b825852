//! Error types.

use thiserror::Error;

use crate::simd::SimdLevel;

/// Invalid compression parameters: unknown type, bad threshold or malformed text.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ParamsError {
    /// The `type` is not one of `"2bit"`, `"1bit"` or `"none"`.
    #[error("unknown gradient compression type {0:?}: expected \"2bit\", \"1bit\" or \"none\"")]
    UnknownType(String),
    /// The threshold is not acceptable for the scheme.
    #[error("invalid threshold {threshold} for {scheme} compression: {reason}")]
    InvalidThreshold {
        /// The scheme's MXNet name (`"2bit"` or `"1bit"`).
        scheme: &'static str,
        /// The rejected value.
        threshold: f32,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// The parameter text could not be parsed (bad JSON, missing `type`, unknown key, ...).
    #[error("invalid gradient compression parameters: {0}")]
    Malformed(String),
}

/// Errors of the compression operations.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum CompressionError {
    /// A buffer does not have the length the operation needs. Nothing was written.
    #[error("{buffer} has length {actual}, expected {expected} for {elements} elements")]
    LengthMismatch {
        /// Which argument (`"residual"`, `"compressed output"`, ...).
        buffer: &'static str,
        /// The number of gradient elements of the operation.
        elements: usize,
        /// The length the buffer must have.
        expected: usize,
        /// The length it has.
        actual: usize,
    },
    /// The requested SIMD level cannot run on this CPU.
    #[error("SIMD level {0} is not supported by this CPU")]
    UnsupportedSimd(SimdLevel),
    /// Invalid parameters (threshold, scheme).
    #[error(transparent)]
    Params(#[from] ParamsError),
    /// No usable CUDA driver or device: the library is absent, no device is present, or the
    /// requested ordinal does not exist.
    #[error("no CUDA device: {0}")]
    NoCudaDevice(String),
    /// A CUDA driver, NVRTC or kernel error.
    #[error("CUDA error: {0}")]
    Cuda(String),
}

impl CompressionError {
    /// Checks `actual == expected`, naming the buffer in the error otherwise.
    pub(crate) fn check_len(
        buffer: &'static str,
        elements: usize,
        expected: usize,
        actual: usize,
    ) -> Result<(), CompressionError> {
        if actual == expected {
            Ok(())
        } else {
            Err(CompressionError::LengthMismatch {
                buffer,
                elements,
                expected,
                actual,
            })
        }
    }
}
