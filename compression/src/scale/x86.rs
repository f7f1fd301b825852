//! The magnitudes' kernels compiled for AVX2: the portable code, which the compiler
//! vectorizes with 256-bit vectors once the feature is on.

/// [`super::magnitudes_of_difference`] for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn magnitudes_of_difference_avx2(a: &[f32], b: &[f32], from: f32) -> (f64, u64) {
    super::magnitudes_of_difference_portable(a, b, from)
}
