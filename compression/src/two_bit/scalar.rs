//! Portable 2-bit kernels: the reference implementation every other path must match.
//!
//! Callers guarantee `residual.len() == grad.len()` and
//! `out.len() == compressed_size(grad.len())` (checked by the public API); the kernels assert
//! it too, so a mistake panics instead of writing out of place.

use super::compressed_size;

/// Code of `+threshold` (pairs are stored most-significant first inside a byte).
pub(crate) const CODE_POS: u8 = 0b11;
/// Code of `-threshold`.
pub(crate) const CODE_NEG: u8 = 0b10;

/// One element of MXNet's `quantize_2bit`: `r += g`, then at most one threshold step.
///
/// `neg` is `-pos`; `r - neg` is MXNet's `residual[i] -= neg_threshold` (== `r + pos`).
/// Written with selects rather than branches (the signs of gradients are unpredictable);
/// both candidates are computed and one is picked, which changes no result.
#[inline(always)]
pub(crate) fn step(r: &mut f32, g: f32, pos: f32, neg: f32) -> u8 {
    let v = *r + g;
    let is_pos = v >= pos;
    let is_neg = v <= neg;
    let (down, up) = (v - pos, v - neg);
    *r = if is_pos {
        down
    } else if is_neg {
        up
    } else {
        v
    };
    (u8::from(is_pos) * CODE_POS) | (u8::from(is_neg) * CODE_NEG)
}

/// One element of [`super::requantize`]: the code of `r` at `pos` (`neg == -pos`), and `r`
/// less what it stands for at `scale` (`r - scale`, or `r - (-scale)`; unchanged for none).
#[inline(always)]
pub(crate) fn step_scaled(r: &mut f32, pos: f32, neg: f32, scale: f32) -> u8 {
    let v = *r;
    let is_pos = v >= pos;
    let is_neg = v <= neg;
    let (down, up) = (v - scale, v - (-scale));
    *r = if is_pos {
        down
    } else if is_neg {
        up
    } else {
        v
    };
    (u8::from(is_pos) * CODE_POS) | (u8::from(is_neg) * CODE_NEG)
}

/// [`super::requantize`] one element at a time.
pub(crate) fn requantize(residual: &mut [f32], out: &mut [u8], threshold: f32, scale: f32) {
    assert_eq!(out.len(), compressed_size(residual.len()));
    let (pos, neg) = (threshold, -threshold);
    out.fill(0);
    for (i, r) in residual.iter_mut().enumerate() {
        out[i / 4] |= step_scaled(r, pos, neg, scale) << (6 - 2 * (i % 4));
    }
}

/// Quantizes `grad` into `out`, updating `residual`.
pub(crate) fn quantize(grad: &[f32], residual: &mut [f32], out: &mut [u8], threshold: f32) {
    assert_eq!(residual.len(), grad.len());
    assert_eq!(out.len(), compressed_size(grad.len()));
    let (pos, neg) = (threshold, -threshold);
    let full = grad.len() / 4;
    let (g_full, g_tail) = grad.split_at(full * 4);
    let (r_full, r_tail) = residual.split_at_mut(full * 4);
    let (o_full, o_rest) = out.split_at_mut(full);

    for ((g, r), o) in g_full
        .chunks_exact(4)
        .zip(r_full.chunks_exact_mut(4))
        .zip(o_full.iter_mut())
    {
        *o = (step(&mut r[0], g[0], pos, neg) << 6)
            | (step(&mut r[1], g[1], pos, neg) << 4)
            | (step(&mut r[2], g[2], pos, neg) << 2)
            | step(&mut r[3], g[3], pos, neg);
    }

    let mut padding = o_rest;
    if !g_tail.is_empty() {
        let mut byte = 0u8;
        for (k, (g, r)) in g_tail.iter().zip(r_tail.iter_mut()).enumerate() {
            byte |= step(r, *g, pos, neg) << (6 - 2 * k);
        }
        padding[0] = byte;
        padding = &mut padding[1..];
    }
    padding.fill(0);
}

/// The value of each code: `00` and `01` decode to `+0.0`, `10` to `-t`, `11` to `+t`.
#[inline(always)]
fn table(threshold: f32) -> [f32; 4] {
    [0.0, 0.0, -threshold, threshold]
}

/// Decodes `compressed` into `out`.
pub(crate) fn dequantize(compressed: &[u8], out: &mut [f32], threshold: f32) {
    assert_eq!(compressed.len(), compressed_size(out.len()));
    let table = table(threshold);
    for (o, &byte) in out.chunks_mut(4).zip(compressed) {
        for (k, o) in o.iter_mut().enumerate() {
            *o = table[usize::from((byte >> (6 - 2 * k)) & 3)];
        }
    }
}

/// `acc[i] += decoded[i]`.
pub(crate) fn dequantize_add(compressed: &[u8], acc: &mut [f32], threshold: f32) {
    assert_eq!(compressed.len(), compressed_size(acc.len()));
    let table = table(threshold);
    for (a, &byte) in acc.chunks_mut(4).zip(compressed) {
        for (k, a) in a.iter_mut().enumerate() {
            *a += table[usize::from((byte >> (6 - 2 * k)) & 3)];
        }
    }
}
