//! Scales chosen from the values being quantized, for codes whose magnitude is not the
//! job's threshold (psnet's compressed pulls and the second phase of its compressed
//! allreduce): sums of magnitudes that every rank or node computes to the same bits.

/// How many running sums [`magnitudes_from`] keeps: element i goes to sum `i % LANES`.
pub(crate) const LANES: usize = 32;

/// The sum of `|x|` over the elements of `xs` with `|x| >= from` (a NaN counts, so that it
/// shows in the sum), in `f64`, and how many there are. Element i goes to running sum
/// `i % 32`, and the 32 sums are added as a balanced tree in index order (the halves first,
/// `(l0 + l1) + (l2 + l3)` at its leaves): one running sum would be bound by the latency of
/// each addition, 32 keep a vector unit busy, and the order is fixed, so that a model
/// elsewhere finds the same bits.
pub fn magnitudes_from(xs: &[f32], from: f32) -> (f64, u64) {
    match crate::SimdLevel::detect() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect` only returns levels this CPU supports.
        crate::SimdLevel::Avx2 => unsafe { x86::magnitudes_avx2::<false>(xs, &[], from) },
        _ => magnitudes_portable(xs, from),
    }
}

fn magnitudes_portable(xs: &[f32], from: f32) -> (f64, u64) {
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    let mut lanes = Lanes::default();
    for c in chunks {
        lanes.add(c, from);
    }
    lanes.finish(rest.iter().copied(), from)
}

/// [`magnitudes_from`] of the element-wise difference `a - b` (each an `f32` subtraction),
/// the same bits, without writing the difference anywhere.
pub fn magnitudes_of_difference(a: &[f32], b: &[f32], from: f32) -> (f64, u64) {
    assert_eq!(a.len(), b.len());
    match crate::SimdLevel::detect() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect` only returns levels this CPU supports.
        crate::SimdLevel::Avx2 => unsafe { x86::magnitudes_avx2::<true>(a, b, from) },
        _ => magnitudes_of_difference_portable(a, b, from),
    }
}

fn magnitudes_of_difference_portable(a: &[f32], b: &[f32], from: f32) -> (f64, u64) {
    assert_eq!(a.len(), b.len());
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x - y);
    let mut lanes = Lanes::default();
    for (x, y) in ca.zip(cb) {
        let r: [f32; LANES] = std::array::from_fn(|lane| x[lane] - y[lane]);
        lanes.add(&r, from);
    }
    lanes.finish(rest, from)
}

/// [`magnitudes_from`]'s running sums and count.
pub(crate) struct Lanes {
    sums: [f64; LANES],
    count: u64,
}

impl Default for Lanes {
    fn default() -> Self {
        Lanes {
            sums: [0.0; LANES],
            count: 0,
        }
    }
}

impl Lanes {
    /// Sums and a count that vector code kept, sum `j` that of lane `j`.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn from_parts(sums: [f64; LANES], count: u64) -> Self {
        Lanes { sums, count }
    }

    /// Takes the next `LANES` elements, one a lane.
    #[inline(always)]
    pub(crate) fn add(&mut self, xs: &[f32], from: f32) {
        for (lane, x) in xs[..LANES].iter().enumerate() {
            self.take(lane, *x, from);
        }
    }

    #[inline(always)]
    fn take(&mut self, lane: usize, x: f32, from: f32) {
        let a = x.abs();
        let taken = a >= from || a.is_nan();
        self.sums[lane] += if taken { f64::from(a) } else { 0.0 };
        self.count += u64::from(taken);
    }

    /// Takes the last (fewer than `LANES`) elements from lane 0 on; the sum in the fixed
    /// order, and the count.
    pub(crate) fn finish(mut self, rest: impl Iterator<Item = f32>, from: f32) -> (f64, u64) {
        for (lane, x) in rest.enumerate() {
            self.take(lane, x, from);
        }
        (tree(&self.sums), self.count)
    }
}

/// The sum of `s` as a balanced tree in index order: each half's sum, then the two.
fn tree(s: &[f64]) -> f64 {
    match s {
        [] => 0.0,
        [x] => *x,
        _ => {
            let (l, r) = s.split_at(s.len() / 2);
            tree(l) + tree(r)
        }
    }
}

/// The mean `|x|` of the elements of `xs` with `|x| >= from`, as `f32` (0 where there are
/// none): [`magnitudes_from`]'s sum over its count.
pub fn mean_magnitude_from(xs: &[f32], from: f32) -> f32 {
    match magnitudes_from(xs, from) {
        (_, 0) => 0.0,
        (sum, count) => (sum / count as f64) as f32,
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_difference_has_the_magnitudes_of_the_difference_written_out() {
        let a: Vec<f32> = (0..101).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut b: Vec<f32> = (0..101).map(|i| (i as f32 * 0.11).cos()).collect();
        b[9] = -0.0;
        let clean: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
        for from in [0.0, 0.5, 2.0] {
            let want = magnitudes_portable(&clean, from);
            let mut got = vec![magnitudes_from(&clean, from)];
            #[cfg(target_arch = "x86_64")]
            if crate::SimdLevel::Avx2.is_supported() {
                // SAFETY: the CPU supports AVX2 (checked just above).
                got.push(unsafe { x86::magnitudes_avx2::<false>(&clean, &[], from) });
            }
            for (sum, count) in got {
                assert_eq!((sum.to_bits(), count), (want.0.to_bits(), want.1));
            }
        }
        b[5] = f32::NAN;
        let change: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
        for from in [0.0, 0.5, 2.0] {
            let want = magnitudes_from(&change, from);
            let mut got = vec![
                magnitudes_of_difference_portable(&a, &b, from),
                magnitudes_portable(&change, from),
            ];
            #[cfg(target_arch = "x86_64")]
            if crate::SimdLevel::Avx2.is_supported() {
                // SAFETY: the CPU supports AVX2 (checked just above).
                got.push(unsafe { x86::magnitudes_avx2::<true>(&a, &b, from) });
                // SAFETY: as above.
                got.push(unsafe { x86::magnitudes_avx2::<false>(&change, &[], from) });
            }
            for g in got {
                assert_eq!((g.0.to_bits(), g.1), (want.0.to_bits(), want.1), "{from}");
            }
        }
    }

    #[test]
    fn lanes_add_in_a_fixed_order_and_count_what_they_take() {
        let xs: Vec<f32> = (0..75).map(|i| (i as f32 - 37.0) * 0.037).collect();
        let (sum, count) = magnitudes_from(&xs, 0.5);
        let want: Vec<f32> = xs.iter().map(|x| x.abs()).filter(|&a| a >= 0.5).collect();
        assert_eq!(count, want.len() as u64);
        assert!((sum - want.iter().map(|&a| f64::from(a)).sum::<f64>()).abs() < 1e-12);
        let mut level = vec![0.0f64; 32];
        for (i, x) in xs.iter().enumerate() {
            if x.abs() >= 0.5 {
                level[i % 32] += f64::from(x.abs());
            }
        }
        // Neighbours added pairwise, level by level.
        while level.len() > 1 {
            level = level.chunks(2).map(|p| p[0] + p[1]).collect();
        }
        assert_eq!(sum.to_bits(), level[0].to_bits());
        assert_eq!(mean_magnitude_from(&xs, 5.0), 0.0);
        assert!(mean_magnitude_from(&[f32::NAN, 1.0], 0.0).is_nan());
    }
}
