//! MXNet-compatible gradient compression with error feedback.
//!
//! This crate produces **the same bytes and the same residuals** as MXNet's kvstore gradient
//! compression for the same inputs:
//!
//! * [`TwoBitCompressor`] — MXNet `2bit` (1.9.1 and 2.x): each element becomes `+t`, `-t` or `0`,
//!   16 elements per 32-bit word, `4 * ceil(n / 16)` bytes.
//! * [`OneBitCompressor`] — MXNet 2.x `1bit`: each element becomes `+1.0` or `-1.0`
//!   (the threshold is only the decision point), 32 elements per word, `4 * ceil(n / 32)` bytes.
//!
//! Both keep a per-key *residual* (error feedback) that the caller owns and passes to every
//! [`quantize`](Compressor::quantize) call. A server sums many workers' pushes with
//! [`dequantize_add`](Compressor::dequantize_add) without materialising each one.
//!
//! ```
//! use psnet_compression::{Compressor, TwoBitCompressor};
//!
//! let c = TwoBitCompressor::new(0.5)?;
//! let grad = [0.6f32, -0.6, 0.1, 1.0];
//! let mut residual = [0.0f32; 4];
//! let mut out = vec![0u8; c.compressed_len(grad.len())];
//! c.quantize(&grad, &mut residual, &mut out)?;
//! assert_eq!(out, [0xE3, 0, 0, 0]);
//! assert_eq!(residual, [0.100000024, -0.100000024, 0.1, 0.5]);
//!
//! let mut sum = [0.0f32; 4];
//! c.dequantize_add(&out, &mut sum)?;
//! assert_eq!(sum, [0.5, -0.5, 0.0, 0.5]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Users configure compression the way they do in MXNet; [`CompressionParams`] parses
//! `{"type": "2bit", "threshold": 0.5}` and builds the matching compressor.
//!
//! # Implementation notes
//!
//! * Every code path (portable, SSE2, AVX2, multi-threaded, CUDA) performs exactly the float32
//!   operations of MXNet's kernels, in the same order, with no FMA and no reassociation, so the
//!   results are bit-identical (the test suite checks this against a plain model of the spec).
//!   The one exception is the bits of a NaN: a NaN stays a NaN on every path, but which NaN an
//!   operation on NaNs returns is unspecified in Rust, as in C++ (and the GPU returns the
//!   canonical NaN).
//!   Denormals are not flushed (MXNet 1.9.1 does not flush them; MXNet 2.x does, see
//!   [`one_bit`]).
//! * The SIMD level is picked at run time ([`SimdLevel::detect`]); the environment variable
//!   `PSNET_COMPRESSION_SIMD` (`avx2`, `sse2` or `scalar`, see [`SIMD_ENV_VAR`]) caps it, and
//!   [`TwoBitCompressor::with_simd`] forces one per compressor.
//! * Large arrays are split across threads ([`Parallelism`]) at boundaries that keep the byte
//!   layout identical to the sequential result.
//! * With the `cuda` feature, `cuda::CudaCompressor` runs the same algorithms on device buffers
//!   with kernels compiled at run time through NVRTC.
//! * [`measure`] holds the throughput measurement behind `psnet-perf compress`.
#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod compressor;
mod error;
mod parallel;
mod params;
mod simd;

pub mod measure;
pub mod one_bit;
pub mod planes;
pub mod scale;
pub mod two_bit;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use compressor::{Compressor, Scheme};
pub use error::{CompressionError, ParamsError};
pub use one_bit::OneBitCompressor;
pub use parallel::Parallelism;
pub use params::{mxnet_wire_threshold, CompressionParams, MxnetVersion, DEFAULT_THRESHOLD};
pub use simd::{SimdLevel, SIMD_ENV_VAR};
pub use two_bit::TwoBitCompressor;
