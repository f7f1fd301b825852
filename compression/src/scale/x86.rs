//! The magnitudes' kernel for AVX2: eight vectors of four `f64` sums hold the 32 running
//! sums (vector `j` those of lanes `4j..4j + 4`), each taking exactly the additions of the
//! portable code's lane.

use std::arch::x86_64::*;

use super::{Lanes, LANES};

/// [`super::magnitudes_from`] of `a` (`DIFF = false`, `b` unused) or
/// [`super::magnitudes_of_difference`] of `a - b` (`DIFF = true`).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn magnitudes_avx2<const DIFF: bool>(
    a: &[f32],
    b: &[f32],
    from: f32,
) -> (f64, u64) {
    let n = a.len();
    if DIFF {
        assert_eq!(b.len(), n);
    }
    let blocks = n / LANES;
    let mut acc = Sums::new(from);
    let (a_ptr, b_ptr) = (a.as_ptr(), b.as_ptr());
    for block in 0..blocks {
        for k in 0..4 {
            let i = block * LANES + k * 8;
            // SAFETY: i + 8 <= blocks * LANES <= n == a.len() (== b.len() with DIFF);
            // unaligned loads are allowed.
            let r = unsafe {
                let x = _mm256_loadu_ps(a_ptr.add(i));
                if DIFF {
                    _mm256_sub_ps(x, _mm256_loadu_ps(b_ptr.add(i)))
                } else {
                    x
                }
            };
            acc.take8(k, r);
        }
    }
    let done = blocks * LANES;
    let rest = a[done..]
        .iter()
        .enumerate()
        .map(|(i, &x)| if DIFF { x - b[done + i] } else { x });
    acc.lanes().finish(rest, from)
}

/// The 32 running sums in vectors, and the count.
pub(crate) struct Sums {
    acc: [__m256d; 8],
    count: u64,
    from: __m256,
}

impl Sums {
    /// No element taken yet; elements of magnitude at least `from` (or NaN) will be.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn new(from: f32) -> Sums {
        Sums {
            acc: [_mm256_setzero_pd(); 8],
            count: 0,
            from: _mm256_set1_ps(from),
        }
    }

    /// Takes elements `8k..8k + 8` of a block of `LANES` (`k < 4`), lanes `8k..8k + 8`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn take8(&mut self, k: usize, r: __m256) {
        let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), r);
        let taken = _mm256_or_ps(
            _mm256_cmp_ps::<_CMP_GE_OQ>(a, self.from),
            _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a),
        );
        // Lanes not taken add +0.0, as the portable code does.
        let sel = _mm256_and_ps(taken, a);
        let (lo, hi) = (2 * k, 2 * k + 1);
        self.acc[lo] = _mm256_add_pd(self.acc[lo], _mm256_cvtps_pd(_mm256_castps256_ps128(sel)));
        self.acc[hi] = _mm256_add_pd(
            self.acc[hi],
            _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(sel)),
        );
        self.count += u64::from(_mm256_movemask_ps(taken).count_ones());
    }

    /// The sums as the portable code's lanes, to finish with.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn lanes(&self) -> Lanes {
        let mut sums = [0.0f64; LANES];
        for (j, v) in self.acc.iter().enumerate() {
            // SAFETY: sums has 4 elements from 4j (j < 8, LANES == 32); unaligned stores
            // are allowed.
            unsafe { _mm256_storeu_pd(sums.as_mut_ptr().add(4 * j), *v) };
        }
        Lanes::from_parts(sums, self.count)
    }
}
