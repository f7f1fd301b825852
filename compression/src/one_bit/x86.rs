//! SSE2 and AVX2 1-bit kernels (x86-64).
//!
//! Each lane performs exactly the scalar operations of [`super::scalar::step`]: `v = r + g`,
//! an ordered `v > t` (NaN is false), then `v - 1` or `v + 1` selected bitwise by the mask.
//! Elements after the last whole vector iteration go to the scalar kernel.
//!
//! Only the loads and stores through raw pointers need `unsafe` blocks; the functions are
//! `unsafe` because they require the CPU feature they are compiled for.

use std::arch::x86_64::*;

use super::{compressed_size, scalar};

/// `REVERSE[m]` is `m` with its 8 bits reversed: lane `j` of a compare mask (bit `j` of a
/// `movemask`) becomes bit `7 - j`, i.e. MXNet's `0x80 >> j`.
static REVERSE: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = (i as u8).reverse_bits();
        i += 1;
    }
    table
};

/// 1-bit quantize, 32 elements (one compressed word) per iteration.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn quantize_avx2(
    grad: &[f32],
    residual: &mut [f32],
    out: &mut [u8],
    threshold: f32,
) {
    let n = grad.len();
    assert_eq!(residual.len(), n);
    assert_eq!(out.len(), compressed_size(n));
    let blocks = n / 32;

    let t = _mm256_set1_ps(threshold);
    let one = _mm256_set1_ps(1.0);
    let g_ptr = grad.as_ptr();
    let r_ptr = residual.as_mut_ptr();
    for block in 0..blocks {
        let mut bytes = [0u8; 4];
        for (k, byte) in bytes.iter_mut().enumerate() {
            let i = block * 32 + k * 8;
            // SAFETY: i + 8 <= blocks * 32 <= n == grad.len() == residual.len(); unaligned
            // loads are allowed.
            let (g, r) = unsafe { (_mm256_loadu_ps(g_ptr.add(i)), _mm256_loadu_ps(r_ptr.add(i))) };
            let r = _mm256_add_ps(r, g);
            let p = _mm256_cmp_ps::<_CMP_GT_OQ>(r, t);
            let r = _mm256_blendv_ps(_mm256_add_ps(r, one), _mm256_sub_ps(r, one), p);
            // SAFETY: same range as the load above; unaligned stores are allowed.
            unsafe { _mm256_storeu_ps(r_ptr.add(i), r) };
            *byte = REVERSE[_mm256_movemask_ps(p) as usize];
        }
        out[block * 4..block * 4 + 4].copy_from_slice(&bytes);
    }

    let done = blocks * 32;
    scalar::quantize(
        &grad[done..],
        &mut residual[done..],
        &mut out[blocks * 4..],
        threshold,
    );
}

/// 1-bit quantize, 32 elements (one compressed word) per iteration.
///
/// # Safety
/// The CPU must support SSE2 (always true on x86-64).
#[target_feature(enable = "sse2")]
pub(crate) unsafe fn quantize_sse2(
    grad: &[f32],
    residual: &mut [f32],
    out: &mut [u8],
    threshold: f32,
) {
    let n = grad.len();
    assert_eq!(residual.len(), n);
    assert_eq!(out.len(), compressed_size(n));
    let blocks = n / 32;

    let t = _mm_set1_ps(threshold);
    let one = _mm_set1_ps(1.0);
    let g_ptr = grad.as_ptr();
    let r_ptr = residual.as_mut_ptr();
    for (b, byte) in out[..blocks * 4].iter_mut().enumerate() {
        let mut bits = 0;
        for k in 0..2 {
            let i = b * 8 + k * 4;
            // SAFETY: i + 4 <= blocks * 32 <= n == grad.len() == residual.len(); unaligned
            // loads are allowed.
            let (g, r) = unsafe { (_mm_loadu_ps(g_ptr.add(i)), _mm_loadu_ps(r_ptr.add(i))) };
            let r = _mm_add_ps(r, g);
            let p = _mm_cmpgt_ps(r, t);
            let r = _mm_or_ps(
                _mm_and_ps(p, _mm_sub_ps(r, one)),
                _mm_andnot_ps(p, _mm_add_ps(r, one)),
            );
            // SAFETY: same range as the load above; unaligned stores are allowed.
            unsafe { _mm_storeu_ps(r_ptr.add(i), r) };
            bits |= _mm_movemask_ps(p) << (4 * k);
        }
        *byte = REVERSE[bits as usize];
    }

    let done = blocks * 32;
    scalar::quantize(
        &grad[done..],
        &mut residual[done..],
        &mut out[blocks * 4..],
        threshold,
    );
}

/// 1-bit dequantize (`ADD = false`: `out = decoded`; `ADD = true`: `out += decoded`),
/// 32 elements (one compressed word) per iteration.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn dequantize_avx2<const ADD: bool>(compressed: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert_eq!(compressed.len(), compressed_size(n));
    let words = n / 32;

    let one = _mm256_set1_ps(1.0);
    let minus_one = _mm256_set1_ps(-1.0);
    let byte_masks = _mm256_setr_epi32(0x80, 0x40, 0x20, 0x10, 0x08, 0x04, 0x02, 0x01);
    let masks = [
        byte_masks,
        _mm256_slli_epi32::<8>(byte_masks),
        _mm256_slli_epi32::<16>(byte_masks),
        _mm256_slli_epi32::<24>(byte_masks),
    ];

    let o_ptr = out.as_mut_ptr();
    for (w, bytes) in compressed[..words * 4].chunks_exact(4).enumerate() {
        let word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let bits = _mm256_set1_epi32(word as i32);
        for (k, &mask) in masks.iter().enumerate() {
            let set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bits, mask), mask));
            let v = _mm256_blendv_ps(minus_one, one, set);
            let i = w * 32 + k * 8;
            // SAFETY: i + 8 <= words * 32 <= n == out.len(); unaligned access is allowed.
            unsafe {
                if ADD {
                    let acc = _mm256_loadu_ps(o_ptr.add(i));
                    _mm256_storeu_ps(o_ptr.add(i), _mm256_add_ps(acc, v));
                } else {
                    _mm256_storeu_ps(o_ptr.add(i), v);
                }
            }
        }
    }

    tail::<ADD>(compressed, out, words);
}

/// 1-bit dequantize (see [`dequantize_avx2`]) with SSE2, 32 elements per iteration.
///
/// # Safety
/// The CPU must support SSE2 (always true on x86-64).
#[target_feature(enable = "sse2")]
pub(crate) unsafe fn dequantize_sse2<const ADD: bool>(compressed: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert_eq!(compressed.len(), compressed_size(n));
    let words = n / 32;

    let one = _mm_set1_ps(1.0);
    let minus_one = _mm_set1_ps(-1.0);
    let mut masks = [_mm_setzero_si128(); 8];
    for (k, mask) in masks.iter_mut().enumerate() {
        // Elements 4k..4k+4 of the word: byte k / 2, bits from 0x80 (k even) or 0x08 (k odd).
        let top = (0x80u32 >> (4 * (k % 2))) << (8 * (k / 2));
        *mask = _mm_setr_epi32(
            top as i32,
            (top >> 1) as i32,
            (top >> 2) as i32,
            (top >> 3) as i32,
        );
    }

    let o_ptr = out.as_mut_ptr();
    for (w, bytes) in compressed[..words * 4].chunks_exact(4).enumerate() {
        let word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let bits = _mm_set1_epi32(word as i32);
        for (k, &mask) in masks.iter().enumerate() {
            let set = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(bits, mask), mask));
            let v = _mm_or_ps(_mm_and_ps(set, one), _mm_andnot_ps(set, minus_one));
            let i = w * 32 + k * 4;
            // SAFETY: i + 4 <= words * 32 <= n == out.len(); unaligned access is allowed.
            unsafe {
                if ADD {
                    let acc = _mm_loadu_ps(o_ptr.add(i));
                    _mm_storeu_ps(o_ptr.add(i), _mm_add_ps(acc, v));
                } else {
                    _mm_storeu_ps(o_ptr.add(i), v);
                }
            }
        }
    }

    tail::<ADD>(compressed, out, words);
}

/// The elements after the last whole word, with the scalar kernel.
#[inline(always)]
fn tail<const ADD: bool>(compressed: &[u8], out: &mut [f32], words: usize) {
    let (c, o) = (&compressed[words * 4..], &mut out[words * 32..]);
    if ADD {
        scalar::dequantize_add(c, o);
    } else {
        scalar::dequantize(c, o);
    }
}

#[cfg(test)]
mod tests {
    use super::REVERSE;

    #[test]
    fn reverse_table() {
        assert_eq!(REVERSE[0x01], 0x80);
        assert_eq!(REVERSE[0x0F], 0xF0);
        assert_eq!(REVERSE[0b1100_0010], 0b0100_0011);
    }
}
