//! Portable 1-bit kernels: the reference implementation every other path must match.
//!
//! Callers guarantee `residual.len() == grad.len()` and
//! `out.len() == compressed_size(grad.len())` (checked by the public API); the kernels assert
//! it too, so a mistake panics instead of writing out of place.

use super::compressed_size;

/// One element of MXNet 2.x's `quantize_1bit`: `r += g`, then `r -= 1` (bit 1) if
/// `r > threshold`, else `r += 1` (bit 0).
#[inline(always)]
pub(crate) fn step(r: &mut f32, g: f32, threshold: f32) -> u8 {
    let v = *r + g;
    if v > threshold {
        *r = v - 1.0;
        1
    } else {
        *r = v + 1.0;
        0
    }
}

/// Quantizes `grad` into `out`, updating `residual`.
pub(crate) fn quantize(grad: &[f32], residual: &mut [f32], out: &mut [u8], threshold: f32) {
    assert_eq!(residual.len(), grad.len());
    assert_eq!(out.len(), compressed_size(grad.len()));
    let full = grad.len() / 8;
    let (g_full, g_tail) = grad.split_at(full * 8);
    let (r_full, r_tail) = residual.split_at_mut(full * 8);
    let (o_full, o_rest) = out.split_at_mut(full);

    for ((g, r), o) in g_full
        .chunks_exact(8)
        .zip(r_full.chunks_exact_mut(8))
        .zip(o_full.iter_mut())
    {
        let mut byte = 0u8;
        for (k, (g, r)) in g.iter().zip(r.iter_mut()).enumerate() {
            byte |= step(r, *g, threshold) << (7 - k);
        }
        *o = byte;
    }

    let mut padding = o_rest;
    if !g_tail.is_empty() {
        let mut byte = 0u8;
        for (k, (g, r)) in g_tail.iter().zip(r_tail.iter_mut()).enumerate() {
            byte |= step(r, *g, threshold) << (7 - k);
        }
        padding[0] = byte;
        padding = &mut padding[1..];
    }
    padding.fill(0);
}

/// The decoded value of element `k` (0 = most significant bit) of `byte`.
#[inline(always)]
fn value(byte: u8, k: usize) -> f32 {
    if byte & (0x80 >> k) != 0 {
        1.0
    } else {
        -1.0
    }
}

/// Decodes `compressed` into `out` (`+1.0` / `-1.0`).
pub(crate) fn dequantize(compressed: &[u8], out: &mut [f32]) {
    assert_eq!(compressed.len(), compressed_size(out.len()));
    for (o, &byte) in out.chunks_mut(8).zip(compressed) {
        for (k, o) in o.iter_mut().enumerate() {
            *o = value(byte, k);
        }
    }
}

/// `acc[i] += decoded[i]`.
pub(crate) fn dequantize_add(compressed: &[u8], acc: &mut [f32]) {
    assert_eq!(compressed.len(), compressed_size(acc.len()));
    for (a, &byte) in acc.chunks_mut(8).zip(compressed) {
        for (k, a) in a.iter_mut().enumerate() {
            *a += value(byte, k);
        }
    }
}
