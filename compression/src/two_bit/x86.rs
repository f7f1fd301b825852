//! SSE2 and AVX2 2-bit kernels (x86-64).
//!
//! Each vector lane performs exactly the scalar operations of [`super::scalar::step`]:
//! `v = r + g`, compare with `t` and `-t` (ordered, so NaN matches neither), then `v - t` or
//! `v - (-t)` selected by mask ([`super::scalar::step_scaled`] for requantizing: `v = r`,
//! and the scale subtracted instead of `t`). Selections are bitwise, so lanes that match no
//! threshold keep `v` unchanged, bit for bit. Blocks that do not fill a whole vector
//! iteration go to the scalar kernel.
//!
//! Only the loads and stores through raw pointers need `unsafe` blocks; the functions are
//! `unsafe` because they require the CPU feature they are compiled for.

use std::arch::x86_64::*;

use super::{compressed_size, scalar};

/// Per-byte weights of the four 2-bit codes of a group (`c0 * 64 + c1 * 16 + c2 * 4 + c3`),
/// as the four little-endian bytes of an `i32` lane.
const PACK_WEIGHTS: i32 = 0x0104_1040;

/// 2-bit quantize, 32 elements (8 output bytes) per iteration.
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

    let steps = Steps::new(threshold, threshold);
    let g_ptr = grad.as_ptr();
    let r_ptr = residual.as_mut_ptr();
    for block in 0..blocks {
        let mut codes = [_mm256_setzero_si256(); 4];
        for (k, code) in codes.iter_mut().enumerate() {
            let i = block * 32 + k * 8;
            // SAFETY: i + 8 <= blocks * 32 <= n == grad.len() == residual.len(); unaligned
            // loads are allowed.
            let (g, r) = unsafe { (_mm256_loadu_ps(g_ptr.add(i)), _mm256_loadu_ps(r_ptr.add(i))) };
            let (r, c) = steps.step(_mm256_add_ps(r, g));
            // SAFETY: same range as the load above; unaligned stores are allowed.
            unsafe { _mm256_storeu_ps(r_ptr.add(i), r) };
            *code = c;
        }
        let word = pack32(codes);
        out[block * 8..block * 8 + 8].copy_from_slice(&word.to_le_bytes());
    }

    let done = blocks * 32;
    scalar::quantize(
        &grad[done..],
        &mut residual[done..],
        &mut out[blocks * 8..],
        threshold,
    );
}

/// One threshold step of eight lanes: codes where `v >= threshold` or `v <= -threshold`
/// (ordered compares: a NaN matches neither), and `v` less `amount` or `-amount` there,
/// selected bitwise (other lanes keep `v` bit for bit).
struct Steps {
    pos: __m256,
    neg: __m256,
    down: __m256,
    up: __m256,
    code_pos: __m256i,
    code_neg: __m256i,
}

impl Steps {
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn new(threshold: f32, amount: f32) -> Steps {
        Steps {
            pos: _mm256_set1_ps(threshold),
            neg: _mm256_set1_ps(-threshold),
            down: _mm256_set1_ps(amount),
            up: _mm256_set1_ps(-amount),
            code_pos: _mm256_set1_epi32(i32::from(scalar::CODE_POS)),
            code_neg: _mm256_set1_epi32(i32::from(scalar::CODE_NEG)),
        }
    }

    /// The stepped values and their codes, one a lane.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn step(&self, v: __m256) -> (__m256, __m256i) {
        let p = _mm256_cmp_ps::<_CMP_GE_OQ>(v, self.pos);
        let m = _mm256_cmp_ps::<_CMP_LE_OQ>(v, self.neg);
        let v = _mm256_blendv_ps(v, _mm256_sub_ps(v, self.down), p);
        let v = _mm256_blendv_ps(v, _mm256_sub_ps(v, self.up), m);
        let code = _mm256_or_si256(
            _mm256_and_si256(_mm256_castps_si256(p), self.code_pos),
            _mm256_and_si256(_mm256_castps_si256(m), self.code_neg),
        );
        (v, code)
    }
}

/// The 8 output bytes of 32 elements' codes, one code per `i32` lane: `codes[k]` holds
/// elements `8k..8k + 8`.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pack32(codes: [__m256i; 4]) -> u64 {
    let weights = _mm256_set1_epi32(PACK_WEIGHTS);
    let ones = _mm256_set1_epi16(1);
    // Byte 0 of each i32 lane to the front of its 128-bit half.
    #[rustfmt::skip]
    let gather = _mm256_setr_epi8(
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
    );
    // One code per byte. Per 128-bit half, the four 32-bit lanes hold the groups of
    // elements {0-3, 8-11, 16-19, 24-27} (low half) and {4-7, 12-15, 20-23, 28-31}
    // (high half), i.e. output bytes 0, 2, 4, 6 and 1, 3, 5, 7.
    let bytes = _mm256_packus_epi16(
        _mm256_packs_epi32(codes[0], codes[1]),
        _mm256_packs_epi32(codes[2], codes[3]),
    );
    // Each 32-bit lane becomes its output byte value.
    let packed = _mm256_madd_epi16(_mm256_maddubs_epi16(bytes, weights), ones);
    let gathered = _mm256_shuffle_epi8(packed, gather);
    let ordered = _mm_unpacklo_epi8(
        _mm256_castsi256_si128(gathered),
        _mm256_extracti128_si256::<1>(gathered),
    );
    _mm_cvtsi128_si64(ordered) as u64
}

/// [`super::requantize`], 32 elements (8 output bytes) per iteration: the lanes of
/// [`super::scalar::step_scaled`], selected bitwise as in [`quantize_avx2`].
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn requantize_avx2(
    residual: &mut [f32],
    out: &mut [u8],
    threshold: f32,
    scale: f32,
) {
    let n = residual.len();
    assert_eq!(out.len(), compressed_size(n));
    let blocks = n / 32;
    let steps = Steps::new(threshold, scale);
    let r_ptr = residual.as_mut_ptr();
    for block in 0..blocks {
        let mut codes = [_mm256_setzero_si256(); 4];
        for (k, code) in codes.iter_mut().enumerate() {
            let i = block * 32 + k * 8;
            // SAFETY: i + 8 <= blocks * 32 <= n == residual.len(); unaligned loads are
            // allowed.
            let (r, c) = steps.step(unsafe { _mm256_loadu_ps(r_ptr.add(i)) });
            // SAFETY: same range as the load above; unaligned stores are allowed.
            unsafe { _mm256_storeu_ps(r_ptr.add(i), r) };
            *code = c;
        }
        let word = pack32(codes);
        out[block * 8..block * 8 + 8].copy_from_slice(&word.to_le_bytes());
    }
    let done = blocks * 32;
    scalar::requantize(
        &mut residual[done..],
        &mut out[blocks * 8..],
        threshold,
        scale,
    );
}

/// 2-bit quantize, 16 elements (4 output bytes) per iteration.
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
    let blocks = n / 16;

    let pos = _mm_set1_ps(threshold);
    let neg = _mm_set1_ps(-threshold);
    let code_pos = _mm_set1_epi32(i32::from(scalar::CODE_POS));
    let code_neg = _mm_set1_epi32(i32::from(scalar::CODE_NEG));
    let low_byte = _mm_set1_epi32(0xFF);

    let g_ptr = grad.as_ptr();
    let r_ptr = residual.as_mut_ptr();
    for block in 0..blocks {
        let mut codes = [_mm_setzero_si128(); 4];
        for (k, code) in codes.iter_mut().enumerate() {
            let i = block * 16 + k * 4;
            // SAFETY: i + 4 <= blocks * 16 <= n == grad.len() == residual.len(); unaligned
            // loads are allowed.
            let (g, r) = unsafe { (_mm_loadu_ps(g_ptr.add(i)), _mm_loadu_ps(r_ptr.add(i))) };
            let r = _mm_add_ps(r, g);
            let p = _mm_cmpge_ps(r, pos);
            let m = _mm_cmple_ps(r, neg);
            let r = select_ps(p, _mm_sub_ps(r, pos), r);
            let r = select_ps(m, _mm_sub_ps(r, neg), r);
            // SAFETY: same range as the load above; unaligned stores are allowed.
            unsafe { _mm_storeu_ps(r_ptr.add(i), r) };
            *code = _mm_or_si128(
                _mm_and_si128(_mm_castps_si128(p), code_pos),
                _mm_and_si128(_mm_castps_si128(m), code_neg),
            );
        }
        // Lane k holds the codes of elements 4k..4k+4 in its bytes 0..4 (little-endian);
        // shift them to c0 << 6 | c1 << 4 | c2 << 2 | c3 in the low byte.
        let x = _mm_packus_epi16(
            _mm_packs_epi32(codes[0], codes[1]),
            _mm_packs_epi32(codes[2], codes[3]),
        );
        let v = _mm_or_si128(
            _mm_or_si128(_mm_slli_epi32::<6>(x), _mm_srli_epi32::<4>(x)),
            _mm_or_si128(_mm_srli_epi32::<14>(x), _mm_srli_epi32::<24>(x)),
        );
        let v = _mm_and_si128(v, low_byte);
        let v = _mm_packus_epi16(_mm_packs_epi32(v, v), v);
        let word = _mm_cvtsi128_si32(v) as u32;
        out[block * 4..block * 4 + 4].copy_from_slice(&word.to_le_bytes());
    }

    let done = blocks * 16;
    scalar::quantize(
        &grad[done..],
        &mut residual[done..],
        &mut out[blocks * 4..],
        threshold,
    );
}

/// `mask ? a : b`, bitwise.
#[inline(always)]
unsafe fn select_ps(mask: __m128, a: __m128, b: __m128) -> __m128 {
    _mm_or_ps(_mm_and_ps(mask, a), _mm_andnot_ps(mask, b))
}

/// Decodes a compressed word's 16 elements to `+t`, `-t` or `+0.0`, eight lanes a half.
struct Words {
    pos: __m256,
    neg: __m256,
    /// Each half's code masks and the `10` (negative) pattern under them.
    halves: [(__m256i, __m256i); 2],
}

impl Words {
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn new(threshold: f32) -> Words {
        // Lane j of the first half: element j of the word, in byte j / 4.
        let masks_lo = _mm256_setr_epi32(0xC0, 0x30, 0x0C, 0x03, 0xC000, 0x3000, 0x0C00, 0x0300);
        let negs_lo = _mm256_setr_epi32(0x80, 0x20, 0x08, 0x02, 0x8000, 0x2000, 0x0800, 0x0200);
        Words {
            pos: _mm256_set1_ps(threshold),
            neg: _mm256_set1_ps(-threshold),
            halves: [
                (masks_lo, negs_lo),
                (
                    _mm256_slli_epi32::<16>(masks_lo),
                    _mm256_slli_epi32::<16>(negs_lo),
                ),
            ],
        }
    }

    /// The 16 elements of the compressed word `bytes`, eight a half.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn word(&self, bytes: &[u8]) -> [__m256; 2] {
        let bits = _mm256_set1_epi32(i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]));
        self.halves.map(|(mask, negmask)| {
            let masked = _mm256_and_si256(bits, mask);
            let p = _mm256_castsi256_ps(_mm256_cmpeq_epi32(masked, mask));
            let m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(masked, negmask));
            _mm256_or_ps(_mm256_and_ps(p, self.pos), _mm256_and_ps(m, self.neg))
        })
    }
}

/// 2-bit dequantize (`ADD = false`: `out = decoded`; `ADD = true`: `out += decoded`),
/// 16 elements (one compressed word) per iteration.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn dequantize_avx2<const ADD: bool>(
    compressed: &[u8],
    out: &mut [f32],
    threshold: f32,
) {
    let n = out.len();
    assert_eq!(compressed.len(), compressed_size(n));
    let words = n / 16;
    let decode = Words::new(threshold);
    let o_ptr = out.as_mut_ptr();
    for (w, bytes) in compressed[..words * 4].chunks_exact(4).enumerate() {
        for (k, v) in decode.word(bytes).into_iter().enumerate() {
            let i = w * 16 + k * 8;
            // SAFETY: i + 8 <= words * 16 <= n == out.len(); unaligned access is allowed.
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

    tail::<ADD>(compressed, out, words, threshold);
}

/// `out = decoded(first) + decoded(rest[0]) + ...`, added in that order, one word of every
/// part per iteration: the same additions as [`dequantize_avx2`] of `first` then of each
/// part with `ADD`, with the sums held in registers rather than stored and loaded again.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn dequantize_sum_avx2(
    first: &[u8],
    rest: &[&[u8]],
    out: &mut [f32],
    threshold: f32,
) {
    let n = out.len();
    assert_eq!(first.len(), compressed_size(n));
    assert!(rest.iter().all(|p| p.len() == compressed_size(n)));
    let words = n / 16;
    let decode = Words::new(threshold);
    let o_ptr = out.as_mut_ptr();
    for (w, bytes) in first[..words * 4].chunks_exact(4).enumerate() {
        let mut sums = decode.word(bytes);
        for part in rest {
            let [lo, hi] = decode.word(&part[w * 4..w * 4 + 4]);
            sums = [_mm256_add_ps(sums[0], lo), _mm256_add_ps(sums[1], hi)];
        }
        for (k, sum) in sums.into_iter().enumerate() {
            // SAFETY: w * 16 + k * 8 + 8 <= words * 16 <= n == out.len(); unaligned access
            // is allowed.
            unsafe { _mm256_storeu_ps(o_ptr.add(w * 16 + k * 8), sum) };
        }
    }
    tail::<false>(first, out, words, threshold);
    for part in rest {
        tail::<true>(part, out, words, threshold);
    }
}

/// 2-bit dequantize (see [`dequantize_avx2`]) with SSE2, 16 elements per iteration.
///
/// # Safety
/// The CPU must support SSE2 (always true on x86-64).
#[target_feature(enable = "sse2")]
pub(crate) unsafe fn dequantize_sse2<const ADD: bool>(
    compressed: &[u8],
    out: &mut [f32],
    threshold: f32,
) {
    let n = out.len();
    assert_eq!(compressed.len(), compressed_size(n));
    let words = n / 16;

    let pos = _mm_set1_ps(threshold);
    let neg = _mm_set1_ps(-threshold);
    let quarter = |shift: i32| {
        (
            _mm_setr_epi32(0xC0 << shift, 0x30 << shift, 0x0C << shift, 0x03 << shift),
            _mm_setr_epi32(0x80 << shift, 0x20 << shift, 0x08 << shift, 0x02 << shift),
        )
    };
    let quarters = [quarter(0), quarter(8), quarter(16), quarter(24)];

    let o_ptr = out.as_mut_ptr();
    for (w, bytes) in compressed[..words * 4].chunks_exact(4).enumerate() {
        let word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let bits = _mm_set1_epi32(word as i32);
        for (k, &(mask, negmask)) in quarters.iter().enumerate() {
            let masked = _mm_and_si128(bits, mask);
            let p = _mm_castsi128_ps(_mm_cmpeq_epi32(masked, mask));
            let m = _mm_castsi128_ps(_mm_cmpeq_epi32(masked, negmask));
            let v = _mm_or_ps(_mm_and_ps(p, pos), _mm_and_ps(m, neg));
            let i = w * 16 + k * 4;
            // SAFETY: i + 4 <= words * 16 <= n == out.len(); unaligned access is allowed.
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

    tail::<ADD>(compressed, out, words, threshold);
}

/// The elements after the last whole word, with the scalar kernel.
#[inline(always)]
fn tail<const ADD: bool>(compressed: &[u8], out: &mut [f32], words: usize, threshold: f32) {
    let (c, o) = (&compressed[words * 4..], &mut out[words * 16..]);
    if ADD {
        scalar::dequantize_add(c, o, threshold);
    } else {
        scalar::dequantize(c, o, threshold);
    }
}

/// [`super::quantize_difference`]: 32 elements (8 output bytes) per iteration, the codes
/// as [`quantize_avx2`] makes them and the sums as [`crate::scale`]'s kernel takes them.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn quantize_difference_avx2(
    value: &[f32],
    base: &[f32],
    threshold: f32,
    out: &mut [u8],
) -> (f64, u64) {
    const LANES: usize = crate::scale::LANES;
    let n = value.len();
    assert_eq!(base.len(), n);
    assert_eq!(out.len(), compressed_size(n));
    let blocks = n / LANES;
    let pos = _mm256_set1_ps(threshold);
    let neg = _mm256_set1_ps(-threshold);
    let code_pos = _mm256_set1_epi32(i32::from(scalar::CODE_POS));
    let code_neg = _mm256_set1_epi32(i32::from(scalar::CODE_NEG));
    let mut sums = crate::scale::x86::Sums::new(threshold);
    let (v_ptr, b_ptr) = (value.as_ptr(), base.as_ptr());
    for block in 0..blocks {
        let mut codes = [_mm256_setzero_si256(); 4];
        for (k, code) in codes.iter_mut().enumerate() {
            let i = block * LANES + k * 8;
            // SAFETY: i + 8 <= blocks * LANES <= n == value.len() == base.len(); unaligned
            // loads are allowed.
            let r = unsafe {
                _mm256_sub_ps(_mm256_loadu_ps(v_ptr.add(i)), _mm256_loadu_ps(b_ptr.add(i)))
            };
            sums.take8(k, r);
            let p = _mm256_cmp_ps::<_CMP_GE_OQ>(r, pos);
            let m = _mm256_cmp_ps::<_CMP_LE_OQ>(r, neg);
            *code = _mm256_or_si256(
                _mm256_and_si256(_mm256_castps_si256(p), code_pos),
                _mm256_and_si256(_mm256_castps_si256(m), code_neg),
            );
        }
        let word = pack32(codes);
        out[block * 8..block * 8 + 8].copy_from_slice(&word.to_le_bytes());
    }
    let done = blocks * LANES;
    let mut rest = [0.0f32; LANES];
    let tail_len = n - done;
    for (r, (v, b)) in rest.iter_mut().zip(value[done..].iter().zip(&base[done..])) {
        *r = v - b;
    }
    let rest = &rest[..tail_len];
    super::codes_of_tail(rest, &mut out[blocks * 8..], threshold);
    sums.lanes().finish(rest.iter().copied(), threshold)
}
