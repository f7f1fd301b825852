//! The codes of a two-phase compressed allreduce's second phase: a chunk's sum of the ranks'
//! codes, quantized again with the chunk owner's residual. That sum runs in steps of the
//! job's threshold up to n times it, so codes that stood for plus or minus the threshold
//! would shrink it: each chunk's codes carry a scale of their own instead, the mean
//! magnitude of the elements they mark (as ternary weight networks scale theirs; with 1-bit
//! codes, of every element). A chunk's block is its scale (`f32`, little-endian), then its
//! codes.

use psnet_compression::scale::mean_magnitude_from;
use psnet_compression::{two_bit, OneBitCompressor, Scheme, TwoBitCompressor};

/// Bytes before a block's codes: its scale.
const SCALE_LEN: usize = 4;

/// Bytes of the block of a chunk of `elems` elements.
pub(crate) fn block_len(scheme: Scheme, elems: usize) -> usize {
    SCALE_LEN + scheme.compressed_size(elems)
}

/// Adds `sum` to `residual` and quantizes the result into `block` (scale and codes, padded
/// to the block's length), leaving in `residual` what the codes leave out. 2-bit codes mark
/// the elements of magnitude at least `threshold` (the job's), 1-bit codes carry every
/// element's sign.
pub(crate) fn encode(
    scheme: Scheme,
    threshold: f32,
    sum: &[f32],
    residual: &mut [f32],
    block: &mut [u8],
) -> Result<(), String> {
    for (r, s) in residual.iter_mut().zip(sum) {
        *r += s;
    }
    let decide = match scheme {
        Scheme::TwoBit => threshold,
        Scheme::OneBit => 0.0,
    };
    let scale = mean_magnitude_from(residual, decide);
    if !scale.is_finite() {
        return Err(format!(
            "the chunk's sum is not finite (a scale of {scale})"
        ));
    }
    block.fill(0);
    block[..SCALE_LEN].copy_from_slice(&scale.to_le_bytes());
    if scale == 0.0 {
        return Ok(());
    }
    let codes = &mut block[SCALE_LEN..SCALE_LEN + scheme.compressed_size(residual.len())];
    let bad = |e: psnet_compression::CompressionError| e.to_string();
    if scheme == Scheme::TwoBit {
        // Codes at the threshold, and the residual less them at the scale, in one pass.
        return two_bit::requantize(residual, decide, scale, codes).map_err(bad);
    }
    // The codes only: the compressor's own residual update is by its threshold.
    let mut scratch = vec![0.0f32; residual.len()];
    OneBitCompressor::new(decide)
        .map_err(|e| e.to_string())?
        .quantize(residual, &mut scratch, codes)
        .map_err(bad)?;
    decode(scheme, block, &mut scratch)?;
    for (r, d) in residual.iter_mut().zip(&scratch) {
        *r -= d;
    }
    Ok(())
}

/// What `block` stands for, into `out` (every rank decodes every chunk so, to the same bits).
pub(crate) fn decode(scheme: Scheme, block: &[u8], out: &mut [f32]) -> Result<(), String> {
    let want = block_len(scheme, out.len());
    if block.len() < want {
        return Err(format!(
            "a block of {} bytes for {} elements (want {want})",
            block.len(),
            out.len()
        ));
    }
    let scale = f32::from_le_bytes(block[..SCALE_LEN].try_into().expect("4 bytes"));
    if !scale.is_finite() || scale < 0.0 {
        return Err(format!("a chunk's scale of {scale}"));
    }
    if scale == 0.0 {
        out.fill(0.0);
        return Ok(());
    }
    let codes = &block[SCALE_LEN..want];
    let bad = |e: psnet_compression::CompressionError| e.to_string();
    match scheme {
        Scheme::TwoBit => TwoBitCompressor::new(scale)
            .map_err(|e| e.to_string())?
            .dequantize(codes, out)
            .map_err(bad),
        Scheme::OneBit => {
            OneBitCompressor::new(0.0)
                .map_err(|e| e.to_string())?
                .dequantize(codes, out)
                .map_err(bad)?;
            for x in out.iter_mut() {
                *x *= scale;
            }
            Ok(())
        }
    }
}
